//! Keys from the command line: JSON, decimal numbers or hex, as `lookup`
//! and `--inner` take them.

use bpfmap_client::Key;

use crate::{output, usage};

/// Whether a key argument is a decimal number.
pub(crate) fn is_decimal(arg: &str) -> bool {
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
            let n: u128 = arg
                .parse()
                .map_err(|e| usage(format!("key {arg:?}: {e}")))?;
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

pub(crate) fn to_proto_value(v: &serde_json::Value) -> prost_types::Value {
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
