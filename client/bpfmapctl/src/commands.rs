//! `list`, `show` and `lookup`.

use std::{collections::HashMap, io};

use bpfmap_client::{Error, FleetEvent, FleetRun, Key, LookupOptions, MapName, MapTypes, Target};
use futures::StreamExt as _;

use crate::{
    RenderArg,
    drive::{self, Io, drive},
    output::{self, Printer},
    render_pairs,
    setup::{Setup, map_name},
    usage,
};

/// `list`: every target's maps.
pub(crate) async fn list(setup: Setup, io: Io<'_>) -> anyhow::Result<()> {
    let run = setup.fleet().list_maps();
    print_all(setup, io, run, |p, out, t, maps| p.maps(out, t, &maps)).await
}

/// `show MAP`: the map on every target.
pub(crate) async fn show(setup: Setup, io: Io<'_>, map: &str) -> anyhow::Result<()> {
    let run = setup.fleet().get_map(&map_name(map)?);
    print_all(setup, io, run, |p, out, t, info| {
        p.maps(out, t, std::slice::from_ref(&info))
    })
    .await
}

/// `lookup MAP KEY...`: the keys on every target, decoded through each
/// target's types (with the renderings of `--render` over the configured
/// ones).
pub(crate) async fn lookup(
    setup: Setup,
    io: Io<'_>,
    map: &str,
    keys: &[String],
    render: &[RenderArg],
) -> anyhow::Result<()> {
    let map = map_name(map)?;
    let keys = keys
        .iter()
        .map(|k| parse_key(k))
        .collect::<anyhow::Result<Vec<Key>>>()?;
    let fleet = setup.fleet();
    // Renderings that do not fit a target's types are refused before the
    // lookup.
    let mut types = if setup.decode || !render.is_empty() {
        map_types(&fleet, &map, render).await?
    } else {
        HashMap::new()
    };
    if !setup.decode {
        types.clear();
    }
    // Raw: the bytes are decoded here, as a dump's are; the renderings go
    // along for JSON keys in their rendered spelling.
    let options = LookupOptions::default()
        .with_raw(true)
        .with_render(render_pairs(render));
    let run = fleet.lookup(&map, keys, options);
    print_all(setup, io, run, |p, out, t, results| {
        let types = types.get(t);
        results
            .iter()
            .try_for_each(|r| p.typed_lookup(out, t, r, types))
    })
    .await
}

/// Prints every answer of `run` with `print`, then what failed.
async fn print_all<T>(
    setup: Setup,
    io: Io<'_>,
    run: FleetRun<T>,
    mut print: impl FnMut(&mut Printer, &mut dyn io::Write, &Target, T) -> io::Result<()>,
) -> anyhow::Result<()> {
    let Setup {
        mut printer,
        progress,
        ..
    } = setup;
    let out = &mut *io.out;
    let (reports, end) = drive(run, &progress, std::future::pending(), |t, answer| {
        print(&mut printer, out, &t, answer)
    })
    .await;
    drive::finish(io, &progress, reports, end)
}

/// Every target's types for `map` (GetMap), with `render` over the
/// configured renderings; targets that fail or have no types are left out,
/// and print hex. Renderings a target's types refuse are a usage error.
async fn map_types(
    fleet: &bpfmap_client::Fleet,
    map: &MapName,
    render: &[RenderArg],
) -> anyhow::Result<HashMap<Target, MapTypes>> {
    let mut run = fleet.get_map(map);
    let mut types = HashMap::new();
    let total = fleet.targets().len();
    while let Some(event) = run.next().await {
        if let FleetEvent::Answer { target, answer } = event {
            match answer.types_with(render_pairs(render)) {
                Ok(Some(t)) => {
                    types.insert(target, t);
                }
                // The command line's renderings; a daemon's own that do not
                // fit leave its results in hex.
                Err(e @ Error::Render { .. }) if !render.is_empty() => {
                    return Err(usage(if total == 1 {
                        e.to_string()
                    } else {
                        format!("{target}: {e}")
                    }));
                }
                _ => {}
            }
        }
    }
    Ok(types)
}

/// A key from the command line: JSON (an argument starting with `{`, `[`
/// or `"`, or anything after `json:`), else hex.
fn parse_key(arg: &str) -> anyhow::Result<Key> {
    let text = match arg.strip_prefix("json:") {
        Some(rest) => rest,
        None if arg.starts_with(['{', '[', '"']) => arg,
        None => {
            return output::unhex(arg)
                .map(Key::Bytes)
                .map_err(|e| usage(e.to_string()));
        }
    };
    serde_json::from_str::<serde_json::Value>(text)
        .map(|v| Key::Json(to_proto_value(&v)))
        .map_err(|e| usage(format!("key {text:?} is not valid JSON: {e}")))
}

fn to_proto_value(v: &serde_json::Value) -> prost_types::Value {
    use prost_types::value::Kind;
    let kind = match v {
        serde_json::Value::Null => Kind::NullValue(0),
        serde_json::Value::Bool(b) => Kind::BoolValue(*b),
        // Integers beyond 2^53 keep every digit as strings, which the
        // daemon reads as exactly.
        serde_json::Value::Number(n) => match n.as_f64() {
            Some(f) if n.is_f64() || f.abs() <= 9_007_199_254_740_992.0 => Kind::NumberValue(f),
            _ => Kind::StringValue(n.to_string()),
        },
        serde_json::Value::String(s) => Kind::StringValue(s.clone()),
        serde_json::Value::Array(a) => Kind::ListValue(prost_types::ListValue {
            values: a.iter().map(to_proto_value).collect(),
        }),
        serde_json::Value::Object(o) => Kind::StructValue(prost_types::Struct {
            fields: o
                .iter()
                .map(|(k, v)| (k.clone(), to_proto_value(v)))
                .collect(),
        }),
    };
    prost_types::Value { kind: Some(kind) }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_are_hex_or_json() {
        assert_eq!(parse_key("0a0b").unwrap(), Key::Bytes(vec![10, 11]));
        assert_eq!(parse_key("json:7").unwrap(), Key::Json(7u32.into()));
        let Key::Json(v) = parse_key(r#"{"big": 18446744073709551615}"#).unwrap() else {
            panic!("a JSON key")
        };
        let prost_types::value::Kind::StructValue(s) = v.kind.unwrap() else {
            panic!("an object")
        };
        assert_eq!(s.fields["big"], "18446744073709551615".into());
        assert!(parse_key("json:{").is_err());
        assert!(parse_key("zz").is_err());
    }
}
