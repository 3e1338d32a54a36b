//! `list`, `show` and `lookup`.

use std::{collections::HashMap, io};

use bpfmap_client::{
    Error, FleetEvent, FleetRun, Key, ListMapsOptions, LookupOptions, MapName, MapTypes, Target,
};
use futures::StreamExt as _;

use crate::{
    ListArgs, RenderArg,
    drive::{self, Io, drive},
    output::{self, Printer},
    render_pairs,
    setup::Setup,
    usage,
};

/// `list`: every target's maps.
pub(crate) async fn list(setup: Setup, io: Io<'_>, args: &ListArgs) -> anyhow::Result<()> {
    let mut options = ListMapsOptions::default();
    if let Some(name) = &args.name {
        options = options.with_name(name);
    }
    if let Some(t) = &args.map_type {
        options = options.with_type(t);
    }
    if let Some(owner) = &args.owner {
        options = options.with_owner(owner);
    }
    let run = setup.fleet().list_maps_with(options);
    print_all(setup, io, run, |p, out, t, maps| p.maps(out, t, &maps)).await
}

/// `show MAP`: the map on every target.
pub(crate) async fn show(setup: Setup, io: Io<'_>, map: &str) -> anyhow::Result<()> {
    let run = setup.fleet().get_map(&setup.map_name(map)?);
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
    let map = setup.map_name(map)?;
    let fleet = setup.fleet();
    // Renderings that do not fit a target's types are refused before the
    // lookup; a decimal key needs the key size.
    let decimal = keys.iter().any(|k| is_decimal(k));
    let (mut types, key_size) = if setup.decode || !render.is_empty() || decimal {
        map_types(&fleet, &map, render).await?
    } else {
        (HashMap::new(), None)
    };
    let keys = keys
        .iter()
        .map(|k| parse_key(k, key_size))
        .collect::<anyhow::Result<Vec<Key>>>()?;
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
/// configured renderings, and the key size of the first target that
/// answers; targets that fail or have no types are left out, and print hex.
/// Renderings a target's types refuse are a usage error.
async fn map_types(
    fleet: &bpfmap_client::Fleet,
    map: &MapName,
    render: &[RenderArg],
) -> anyhow::Result<(HashMap<Target, MapTypes>, Option<usize>)> {
    let mut run = fleet.get_map(map);
    let mut types = HashMap::new();
    let mut key_size = None;
    let total = fleet.targets().len();
    while let Some(event) = run.next().await {
        if let FleetEvent::Answer { target, answer } = event {
            key_size.get_or_insert(answer.key_size() as usize);
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
    Ok((types, key_size))
}

/// Whether a key argument is a decimal number.
fn is_decimal(arg: &str) -> bool {
    !arg.is_empty() && arg.len() <= 20 && arg.bytes().all(|b| b.is_ascii_digit())
}

/// A key from the command line: JSON (an argument starting with `{`, `[`
/// or `"`, or anything after `json:`); a decimal number (an integer key or
/// an index, encoded by the daemon through the key's type), unless it has
/// exactly twice as many digits as the key has bytes (`key_size`), which
/// reads as hex; hex otherwise (`0x` forces hex).
pub(crate) fn parse_key(arg: &str, key_size: Option<usize>) -> anyhow::Result<Key> {
    let text = match arg.strip_prefix("json:") {
        Some(rest) => rest,
        None if arg.starts_with(['{', '[', '"']) => arg,
        None if is_decimal(arg) && key_size.is_none_or(|n| arg.len() != 2 * n) => {
            // As JSON writes it (no leading zeros); beyond 2^53 as a
            // decimal string, which the daemon reads exactly.
            let n: u128 = arg.parse().map_err(|e| usage(format!("key {arg:?}: {e}")))?;
            return Ok(Key::Json(to_proto_value(&match u64::try_from(n) {
                Ok(n) => serde_json::Value::from(n),
                Err(_) => serde_json::Value::from(n.to_string()),
            })));
        }
        None => {
            let hex = arg.strip_prefix("0x").unwrap_or(arg);
            return output::unhex(hex)
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
    fn keys_are_hex_json_or_decimal_numbers() {
        assert_eq!(parse_key("0a0b", None).unwrap(), Key::Bytes(vec![10, 11]));
        assert_eq!(parse_key("json:7", None).unwrap(), Key::Json(7u32.into()));
        // A port index as xdp-filter keeps it: decimal, whatever the key.
        assert_eq!(
            parse_key("47873", Some(4)).unwrap(),
            Key::Json(47873u32.into())
        );
        // Exactly the key's bytes in hex digits reads as hex; 0x forces it.
        assert_eq!(
            parse_key("01000000", Some(4)).unwrap(),
            Key::Bytes(vec![1, 0, 0, 0])
        );
        assert_eq!(
            parse_key("01000000", Some(8)).unwrap(),
            Key::Json(1_000_000u32.into())
        );
        assert_eq!(parse_key("0x0100", None).unwrap(), Key::Bytes(vec![1, 0]));
        let Key::Json(v) = parse_key(r#"{"big": 18446744073709551615}"#, None).unwrap() else {
            panic!("a JSON key")
        };
        let prost_types::value::Kind::StructValue(s) = v.kind.unwrap() else {
            panic!("an object")
        };
        assert_eq!(s.fields["big"], "18446744073709551615".into());
        assert!(parse_key("json:{", None).is_err());
        assert!(parse_key("zz", None).is_err());
    }
}
