//! Encoding: a value written as JSON (the decoded form) back into bytes,
//! for keys given as JSON.

use prost_types::{Value, value::Kind};

use super::{Field, IntField, Node, RecordNode, push_member};

/// Why a value does not fit its type; names the member.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{path}: {message}")]
#[non_exhaustive]
pub struct EncodeError {
    /// The member (`key.proto`, `key.addr[2]`).
    pub path: String,
    /// What is wrong, and what would fit.
    pub message: String,
}

pub(crate) fn fail<T>(path: &str, message: impl Into<String>) -> Result<T, EncodeError> {
    Err(EncodeError {
        path: path.to_owned(),
        message: message.into(),
    })
}

pub(crate) fn describe(v: &Value) -> String {
    const MAX: usize = 40;
    let s = match &v.kind {
        None | Some(Kind::NullValue(_)) => "null".to_owned(),
        Some(Kind::BoolValue(b)) => b.to_string(),
        Some(Kind::NumberValue(n)) => n.to_string(),
        Some(Kind::StringValue(s)) => format!("{s:?}"),
        Some(Kind::StructValue(_)) => "an object".to_owned(),
        Some(Kind::ListValue(_)) => "a list".to_owned(),
    };
    if s.chars().count() > MAX {
        let cut: String = s.chars().take(MAX).collect();
        format!("{cut}...")
    } else {
        s
    }
}

/// The range of a `bits`-bit integer.
fn range(bits: usize, signed: bool) -> (i128, u128) {
    match (bits, signed) {
        (128, true) => (i128::MIN, i128::MAX as u128),
        (128, false) => (0, u128::MAX),
        (b, true) => (-(1i128 << (b - 1)), (1u128 << (b - 1)) - 1),
        (b, false) => (0, (1u128 << b) - 1),
    }
}

/// An integer from a JSON number (integral) or a string (decimal, or hex
/// with 0x), checked against the range of `bits` bits: its two's-complement
/// bits.
pub(crate) fn integer(
    v: &Value,
    bits: usize,
    signed: bool,
    path: &str,
) -> Result<u128, EncodeError> {
    let (min, max) = range(bits, signed);
    let kind = if signed { "signed" } else { "unsigned" };
    let out_of_range = || {
        fail(
            path,
            format!(
                "{} is out of range for a {bits}-bit {kind} integer ({min} to {max})",
                describe(v)
            ),
        )
    };
    let (negative, magnitude) = sign_and_magnitude(v, path)?;
    if negative && magnitude != 0 {
        if !signed || magnitude > min.unsigned_abs() {
            return out_of_range();
        }
        Ok((magnitude as i128).wrapping_neg() as u128)
    } else {
        if magnitude > max {
            return out_of_range();
        }
        Ok(magnitude)
    }
}

/// Whether an integer written as a JSON number (integral) or a string
/// (decimal, or hex with 0x) is negative, and its magnitude.
fn sign_and_magnitude(v: &Value, path: &str) -> Result<(bool, u128), EncodeError> {
    match &v.kind {
        Some(Kind::NumberValue(n)) => {
            if n.fract() != 0.0 || !n.is_finite() {
                return fail(path, format!("{} is not an integer", describe(v)));
            }
            if n.abs() > 9_007_199_254_740_992.0 {
                return fail(
                    path,
                    format!(
                        "{} is beyond what a JSON number holds exactly; write it as a string",
                        describe(v)
                    ),
                );
            }
            Ok((*n < 0.0, n.abs() as u128))
        }
        Some(Kind::StringValue(s)) => {
            let t = s.trim();
            let (negative, digits) = match t.strip_prefix('-') {
                Some(rest) => (true, rest),
                None => (false, t.strip_prefix('+').unwrap_or(t)),
            };
            let parsed = match digits
                .strip_prefix("0x")
                .or_else(|| digits.strip_prefix("0X"))
            {
                Some(hex) => u128::from_str_radix(hex, 16),
                None => digits.parse::<u128>(),
            };
            match parsed {
                Ok(m) => Ok((negative, m)),
                Err(_) => fail(
                    path,
                    format!(
                        "{} is not an integer (decimal, or hex with 0x)",
                        describe(v)
                    ),
                ),
            }
        }
        _ => fail(
            path,
            format!(
                "expected an integer (a number or a string), got {}",
                describe(v)
            ),
        ),
    }
}

/// Writes the little-endian `size`-byte integer `raw` at `offset`.
fn put(out: &mut [u8], offset: usize, size: usize, raw: u128) {
    IntField::whole(offset, size, false, false).write(out, raw);
}

/// An enum value by enumerator name or number: its bits.
fn enumerator(
    e: &super::EnumNode,
    v: &Value,
    bits: usize,
    path: &str,
) -> Result<u128, EncodeError> {
    if let Some(Kind::StringValue(s)) = &v.kind
        && let Some((value, _)) = e.values.iter().find(|(_, n)| n == s)
    {
        let (min, max) = range(bits, e.signed);
        let (fits, raw) = if e.signed {
            let mask = if bits >= 128 {
                u128::MAX
            } else {
                (1u128 << bits) - 1
            };
            (
                (min..=max as i128).contains(&i128::from(*value)),
                (i128::from(*value) as u128) & mask,
            )
        } else {
            let raw = u128::from(*value as u64);
            (raw <= max, raw)
        };
        if !fits {
            return fail(path, format!("{s} ({value}) does not fit in {bits} bits"));
        }
        return Ok(raw);
    }
    match &v.kind {
        Some(Kind::NumberValue(_)) => integer(v, bits, e.signed, path),
        Some(Kind::StringValue(s))
            if s.trim()
                .trim_start_matches(['-', '+'])
                .starts_with(|c: char| c.is_ascii_digit()) =>
        {
            integer(v, bits, e.signed, path)
        }
        _ => {
            let names: Vec<&str> = e.values.iter().take(16).map(|(_, n)| n.as_str()).collect();
            let more = if e.values.len() > 16 { ", ..." } else { "" };
            let of = if e.name.is_empty() {
                "the enum".to_owned()
            } else {
                format!("enum {}", e.name)
            };
            fail(
                path,
                format!(
                    "{} is not an enumerator of {of} (one of {}{more}, or a number)",
                    describe(v),
                    names.join(", ")
                ),
            )
        }
    }
}

pub(crate) fn node(
    node: &Node,
    v: &Value,
    out: &mut [u8],
    offset: usize,
    path: &mut String,
) -> Result<(), EncodeError> {
    match node {
        Node::Int {
            size,
            signed,
            big_endian,
            ..
        } => {
            let raw = integer(v, size * 8, *signed, path)?;
            IntField::whole(offset, *size, *signed, *big_endian).write(out, raw);
        }
        Node::Rendered { how, node, size } => {
            let member = out.get_mut(offset..).unwrap_or_default();
            how.encode(node, *size, v, member, path)?
        }
        Node::Char { signed } => {
            let raw = match &v.kind {
                Some(Kind::StringValue(s)) if s.len() == 1 => u128::from(s.as_bytes()[0]),
                _ => integer(v, 8, *signed, path)?,
            };
            put(out, offset, 1, raw);
        }
        Node::Bool { size } => match &v.kind {
            Some(Kind::BoolValue(b)) => put(out, offset, *size, u128::from(*b)),
            _ => return fail(path, format!("expected true or false, got {}", describe(v))),
        },
        Node::Float { size } => match &v.kind {
            Some(Kind::NumberValue(n)) => {
                if *size == 4 {
                    put(out, offset, 4, u128::from((*n as f32).to_bits()));
                } else {
                    put(out, offset, 8, u128::from(n.to_bits()));
                }
            }
            _ => return fail(path, format!("expected a number, got {}", describe(v))),
        },
        Node::Enum(e) => put(out, offset, e.size, enumerator(e, v, e.size * 8, path)?),
        Node::Record(r) => record(r, v, out, offset, path)?,
        Node::Array {
            element,
            element_size,
            length,
        } => {
            let member = out.get_mut(offset..).unwrap_or_default();
            array(element, *element_size, *length, v, member, path)?
        }
        Node::Pointer { size } => {
            let raw = integer(v, size * 8, false, path)?;
            put(out, offset, *size, raw);
        }
        Node::Opaque { size } => {
            let Some(Kind::StringValue(s)) = &v.kind else {
                return fail(
                    path,
                    format!("expected {size} bytes as a hex string, got {}", describe(v)),
                );
            };
            let bytes = hex_bytes(s)
                .filter(|b| b.len() == *size)
                .ok_or_else(|| EncodeError {
                    path: path.clone(),
                    message: format!("expected {size} bytes as a hex string, got {}", describe(v)),
                })?;
            if let Some(dst) = out.get_mut(offset..offset + size) {
                dst.copy_from_slice(&bytes);
            }
        }
    }
    Ok(())
}

/// A struct or union: an object with exactly the members it has (a union:
/// exactly one of them).
fn record(
    r: &RecordNode,
    v: &Value,
    out: &mut [u8],
    offset: usize,
    path: &mut String,
) -> Result<(), EncodeError> {
    let Some(Kind::StructValue(s)) = &v.kind else {
        return fail(path, format!("expected an object, got {}", describe(v)));
    };
    for name in s.fields.keys() {
        if !r.fields.iter().any(|f| &f.name == name) {
            let names: Vec<&str> = r.fields.iter().map(|f| f.name.as_str()).collect();
            return fail(
                path,
                format!("no member named {name:?} (members: {})", names.join(", ")),
            );
        }
    }
    if r.union {
        let given: Vec<&Field> = r
            .fields
            .iter()
            .filter(|f| s.fields.contains_key(&f.name))
            .collect();
        let [f] = given.as_slice() else {
            let names: Vec<&str> = r.fields.iter().map(|f| f.name.as_str()).collect();
            return fail(
                path,
                format!(
                    "a union takes exactly one member ({}), {} given",
                    names.join(", "),
                    given.len()
                ),
            );
        };
        field(f, &s.fields[&f.name], out, offset, path)?;
    } else {
        for f in &r.fields {
            let Some(value) = s.fields.get(&f.name) else {
                let len = path.len();
                push_member(path, &f.name);
                let e = fail(path, "missing");
                path.truncate(len);
                return e;
            };
            field(f, value, out, offset, path)?;
        }
    }
    Ok(())
}

/// An array of `length` elements of `element_size` bytes: a list of its
/// length, or a string for an array of char, into `out` (the array's bytes
/// and what follows them).
fn array(
    element: &Node,
    element_size: usize,
    length: usize,
    v: &Value,
    out: &mut [u8],
    path: &mut String,
) -> Result<(), EncodeError> {
    if element.is_char()
        && let Some(Kind::StringValue(s)) = &v.kind
    {
        if s.len() >= length {
            return fail(
                path,
                format!(
                    "a string of {} bytes does not fit in char[{length}] with its NUL (at most {})",
                    s.len(),
                    length.saturating_sub(1)
                ),
            );
        }
        let bytes = s.as_bytes();
        if let Some(dst) = out.get_mut(..bytes.len()) {
            dst.copy_from_slice(bytes);
        }
        return Ok(());
    }
    let Some(Kind::ListValue(list)) = &v.kind else {
        return fail(
            path,
            format!("expected a list of {length}, got {}", describe(v)),
        );
    };
    if list.values.len() != length {
        return fail(
            path,
            format!("expected {length} elements, got {}", list.values.len()),
        );
    }
    for (i, item) in list.values.iter().enumerate() {
        let len = path.len();
        path.push_str(&format!("[{i}]"));
        self::node(element, item, out, i * element_size, path)?;
        path.truncate(len);
    }
    Ok(())
}

fn field(
    f: &Field,
    v: &Value,
    out: &mut [u8],
    record: usize,
    path: &mut String,
) -> Result<(), EncodeError> {
    let len = path.len();
    push_member(path, &f.name);
    let result = if f.bitfield_size == 0 {
        node(&f.node, v, out, record + f.bit_offset / 8, path)
    } else {
        let bits = f.bitfield_size;
        let raw = match &f.node {
            Node::Int { signed, .. } | Node::Char { signed } => integer(v, bits, *signed, path),
            Node::Enum(e) => enumerator(e, v, bits, path),
            Node::Bool { .. } => match &v.kind {
                Some(Kind::BoolValue(b)) => Ok(u128::from(*b)),
                _ => fail(path, format!("expected true or false, got {}", describe(v))),
            },
            _ => fail(path, "not encodable"),
        };
        raw.map(|raw| IntField::bitfield(record * 8 + f.bit_offset, bits, false).write(out, raw))
    };
    if result.is_ok() {
        path.truncate(len);
    }
    result
}

pub(crate) fn hex_bytes(s: &str) -> Option<Vec<u8>> {
    let s = s.strip_prefix("0x").unwrap_or(s);
    faster_hex::hex_decode_vec(s.as_bytes()).ok()
}
