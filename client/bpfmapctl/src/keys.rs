//! Keys typed by hand (`lookup`, `--inner`), one grammar where each
//! spelling has one meaning:
//!
//! - a decimal number, `7` or `-1`: the integer (of an integer or enum key,
//!   an array's index), encoded by the daemon through the key's type;
//! - `0x` and hex digits, `0xffff888188fb9bc0`: the same, a number written
//!   in hex (as tables show hex numbers and pointers);
//! - `hex:` and two hex digits per byte, `hex:0a000001`: the key's bytes,
//!   in memory order;
//! - JSON, an argument starting with `{`, `[` or `"` (or anything after
//!   `json:`): `{"pid":42}`, `"bash"`, encoded through the key's type.
//!
//! A spelling that could mean two things is refused with both readings:
//! a number with leading zeros (`0102`: the number 102, or the bytes 01
//! 02?), hex digits without a prefix (`0a0b`).

use bpfmap_client::Key;

use crate::usage;

/// Largest integer a JSON number carries exactly (2^53).
const EXACT: u128 = 1 << 53;

/// A key from the command line, as the module's grammar says.
pub(crate) fn parse_key(arg: &str) -> anyhow::Result<Key> {
    if let Some(json) = arg.strip_prefix("json:") {
        return json_key(json);
    }
    if arg.bytes().next().is_some_and(|b| b"{[\"".contains(&b)) {
        return json_key(arg);
    }
    if let Some(hex) = arg.strip_prefix("hex:") {
        return faster_hex::hex_decode_vec(hex.as_bytes())
            .map(Key::Bytes)
            .map_err(|_| {
                usage(format!(
                    "key {arg:?}: hex: takes the key's bytes as two hex digits each (hex:0a000001)"
                ))
            });
    }
    if let Some(digits) = arg.strip_prefix("0x") {
        return match u128::from_str_radix(digits, 16) {
            Ok(n) => Ok(number(n, false)),
            Err(_) => Err(usage(format!(
                "key {arg:?}: 0x starts a number in hex (0x1bb); the key's bytes are hex:{digits}"
            ))),
        };
    }
    if let Some(key) = decimal(arg) {
        return key;
    }
    if !arg.is_empty() && arg.bytes().all(|b| b.is_ascii_hexdigit()) {
        return Err(usage(format!(
            "key {arg:?}: write hex:{arg} for the key's bytes, or 0x{arg} for a number in hex"
        )));
    }
    Err(usage(format!(
        "key {arg:?} is not a key: write a number (42, 0x2a), the key's bytes (hex:2a000000) or JSON ({{\"pid\":42}}, \"bash\" in quotes)"
    )))
}

/// A decimal number (`7`, `-1`), or `None` when `arg` is not digits; a
/// number with leading zeros is refused with its two readings.
fn decimal(arg: &str) -> Option<anyhow::Result<Key>> {
    let (negative, digits) = match arg.strip_prefix('-') {
        Some(d) => (true, d),
        None => (false, arg),
    };
    if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    if digits.len() > 1 && digits.starts_with('0') {
        let number = digits.trim_start_matches('0');
        let number = if number.is_empty() { "0" } else { number };
        return Some(Err(usage(format!(
            "key {arg:?} could be the number {number} or the bytes {arg}: write {number} for the number, or hex:{arg} for the bytes"
        ))));
    }
    Some(
        digits
            .parse()
            .map(|n| number(n, negative))
            .map_err(|_| usage(format!("key {arg:?} is too large a number"))),
    )
}

fn json_key(text: &str) -> anyhow::Result<Key> {
    serde_json::from_str::<serde_json::Value>(text)
        .map(|v| Key::Json(to_proto_value(&v)))
        .map_err(|e| usage(format!("key {text:?} is not valid JSON: {e}")))
}

/// A number as the daemon reads a JSON key: a JSON number up to 2^53, a
/// decimal string beyond (read exactly).
fn number(n: u128, negative: bool) -> Key {
    let value = match (negative, n <= EXACT) {
        (false, true) => serde_json::Value::from(n as u64),
        (true, true) => serde_json::Value::from(-(n as i64)),
        (false, false) => serde_json::Value::from(n.to_string()),
        (true, false) => serde_json::Value::from(format!("-{n}")),
    };
    Key::Json(to_proto_value(&value))
}

pub(crate) fn to_proto_value(v: &serde_json::Value) -> prost_types::Value {
    use prost_types::value::Kind;
    let kind = match v {
        serde_json::Value::Null => Kind::NullValue(0),
        serde_json::Value::Bool(b) => Kind::BoolValue(*b),
        // Integers beyond 2^53 keep every digit as strings, which the
        // daemon reads as exactly.
        serde_json::Value::Number(n) => match n.as_f64() {
            Some(f) if n.is_f64() || f.abs() <= EXACT as f64 => Kind::NumberValue(f),
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

    fn error(arg: &str) -> String {
        parse_key(arg).unwrap_err().to_string()
    }

    #[test]
    fn each_spelling_of_a_key_has_one_meaning() {
        // Decimal, whatever its length: an 8-digit pid is a pid.
        assert_eq!(
            parse_key("12345678").unwrap(),
            Key::Json(12345678u32.into())
        );
        assert_eq!(parse_key("47873").unwrap(), Key::Json(47873u32.into()));
        assert_eq!(parse_key("0").unwrap(), Key::Json(0u32.into()));
        assert_eq!(parse_key("-14").unwrap(), Key::Json((-14i32).into()));
        // A pointer pasted as a table shows it: the number.
        assert_eq!(
            parse_key("0xffff888188fb9bc0").unwrap(),
            Key::Json("18446612688663190464".into())
        );
        assert_eq!(parse_key("0x1bb").unwrap(), Key::Json(443u32.into()));
        // Bytes only when asked for.
        assert_eq!(parse_key("hex:0a0b").unwrap(), Key::Bytes(vec![10, 11]));
        assert_eq!(parse_key("json:7").unwrap(), Key::Json(7u32.into()));
        assert_eq!(parse_key("\"bash\"").unwrap(), Key::Json("bash".into()));
        let Key::Json(v) = parse_key(r#"{"big": 18446744073709551615}"#).unwrap() else {
            panic!("a JSON key")
        };
        let prost_types::value::Kind::StructValue(s) = v.kind.unwrap() else {
            panic!("an object")
        };
        assert_eq!(s.fields["big"], "18446744073709551615".into());
    }

    #[test]
    fn doubtful_spellings_are_refused_with_both_readings() {
        assert_eq!(
            error("0102"),
            "key \"0102\" could be the number 102 or the bytes 0102: write 102 for the number, or hex:0102 for the bytes"
        );
        assert_eq!(
            error("0a0b"),
            "key \"0a0b\": write hex:0a0b for the key's bytes, or 0x0a0b for a number in hex"
        );
        assert!(error("0xzz").contains("0x starts a number in hex"));
        assert!(error("hex:abc").contains("two hex digits each"));
        assert!(error("json:{").contains("is not valid JSON"));
        assert!(error("bash").contains("is not a key"));
    }
}
