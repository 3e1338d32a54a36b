//! Decoding: bytes to JSON-shaped values, by the rules in the module docs.

use super::{Field, IntField, Node, Sink, int::sign_extend};

/// `bytes[offset..offset + n]`, or an empty slice when out of range (a
/// checked [`Layout`](super::Layout) never is).
pub(crate) fn slice(bytes: &[u8], offset: usize, n: usize) -> &[u8] {
    offset
        .checked_add(n)
        .and_then(|end| bytes.get(offset..end))
        .unwrap_or(&[])
}

/// Where the integer-like `node` at byte `offset` (or, for a bitfield
/// `f`, at its bits) is, and how it is stored.
fn int_field(node: &Node, offset: usize, f: Option<&Field>) -> Option<IntField> {
    let (size, signed, big_endian) = match node {
        Node::Int {
            size,
            signed,
            big_endian,
            ..
        } => (*size, *signed, *big_endian),
        Node::Char { signed } => (1, *signed, false),
        Node::Enum(e) => (e.size, e.signed, false),
        Node::Bool { size } | Node::Pointer { size } => (*size, false, false),
        _ => return None,
    };
    Some(match f {
        Some(f) if f.bitfield_size != 0 => {
            IntField::bitfield(offset * 8 + f.bit_offset, f.bitfield_size, signed)
        }
        Some(f) => IntField::whole(offset + f.bit_offset / 8, size, signed, big_endian),
        None => IntField::whole(offset, size, signed, big_endian),
    })
}

/// An integer of `bits` bits: a number up to 32 bits, a decimal string
/// above (an unsigned value that may not fit an i128 included).
fn int_value(raw: u128, field: &IntField, sink: &mut impl Sink) {
    let bits = field.bits();
    if bits <= 32 {
        let v = if field.signed() {
            sign_extend(raw, bits)
        } else {
            raw as i128
        };
        sink.int(v as i64);
    } else if field.signed() {
        sink.decimal(sign_extend(raw, bits));
    } else {
        sink.decimal_unsigned(raw);
    }
}

fn enum_value(e: &super::EnumNode, raw: u128, field: &IntField, sink: &mut impl Sink) {
    let value = if e.signed {
        sign_extend(raw, field.bits())
    } else {
        raw as i128
    };
    // Enumerators hold 64-bit two's complement.
    match e.name_of(value as i64) {
        Some(name) => sink.string(name),
        None => int_value(raw, field, sink),
    }
}

/// The text a char array holds: printable ASCII up to a NUL.
pub(crate) fn text(b: &[u8]) -> Option<&str> {
    let nul = b.iter().position(|&c| c == 0)?;
    let text = &b[..nul];
    text.iter()
        .all(|&c| (0x20..0x7f).contains(&c))
        .then(|| std::str::from_utf8(text).ok())
        .flatten()
}

/// An integer-like value (or a bitfield of one) through `field`.
fn scalar(node: &Node, field: &IntField, bytes: &[u8], sink: &mut impl Sink) {
    let raw = field.raw(bytes).unwrap_or(0);
    match node {
        Node::Enum(e) => enum_value(e, raw, field, sink),
        Node::Bool { .. } => sink.bool(raw != 0),
        Node::Pointer { .. } => sink.pointer(raw as u64),
        _ => int_value(raw, field, sink),
    }
}

/// A float of 4 or 8 bytes (`b`, its bytes), or null.
pub(crate) fn float(b: &[u8], sink: &mut impl Sink) {
    let v = match b.len() {
        4 => b.try_into().map(f32::from_le_bytes).map(f64::from).ok(),
        _ => b.try_into().map(f64::from_le_bytes).ok(),
    };
    match v {
        Some(v) => sink.float(v),
        None => sink.null(),
    }
}

pub(crate) fn node(node: &Node, bytes: &[u8], offset: usize, sink: &mut impl Sink) {
    if let Some(field) = int_field(node, offset, None) {
        return scalar(node, &field, bytes, sink);
    }
    match node {
        Node::Float { size } => float(slice(bytes, offset, *size), sink),
        Node::Record(r) => {
            sink.begin_object();
            for f in &r.fields {
                sink.field_key(&f.key);
                field(f, bytes, offset, sink);
            }
            sink.end_object();
        }
        Node::Array {
            element,
            element_size,
            length,
        } => {
            if element.is_char()
                && let Some(text) = text(slice(bytes, offset, element_size * length))
            {
                sink.string(text);
                return;
            }
            sink.begin_array();
            for i in 0..*length {
                self::node(element, bytes, offset + i * element_size, sink);
            }
            sink.end_array();
        }
        Node::Opaque { size } => sink.hex(slice(bytes, offset, *size)),
        Node::Rendered { how, node, size } => how.render(node, slice(bytes, offset, *size), sink),
        // Integers, chars, enums, bools and pointers are read above.
        _ => sink.null(),
    }
}

fn field(f: &Field, bytes: &[u8], record: usize, sink: &mut impl Sink) {
    if f.bitfield_size == 0 {
        return node(&f.node, bytes, record + f.bit_offset / 8, sink);
    }
    match int_field(&f.node, record, Some(f)) {
        Some(field) => scalar(&f.node, &field, bytes, sink),
        // A checked layout has no other bitfields.
        None => sink.null(),
    }
}

/// Sums the integers of per-CPU values (a summable layout: integers,
/// structs and arrays of them).
pub(crate) fn sum(node: &Node, cpus: &[&[u8]], offset: usize, sink: &mut impl Sink) {
    match node {
        Node::Int { .. } => {
            if let Some(field) = int_field(node, offset, None) {
                sum_out(cpus, &field, sink);
            }
        }
        // Sums are numbers whatever the rendering.
        Node::Rendered { node, .. } => sum(node, cpus, offset, sink),
        Node::Record(r) => {
            sink.begin_object();
            for f in &r.fields {
                sink.field_key(&f.key);
                if f.bitfield_size == 0 {
                    sum(&f.node, cpus, offset + f.bit_offset / 8, sink);
                } else if let Some(field) = int_field(&f.node, offset, Some(f)) {
                    sum_out(cpus, &field, sink);
                } else {
                    sink.null();
                }
            }
            sink.end_object();
        }
        Node::Array {
            element,
            element_size,
            length,
        } => {
            sink.begin_array();
            for i in 0..*length {
                sum(element, cpus, offset + i * element_size, sink);
            }
            sink.end_array();
        }
        _ => sink.null(),
    }
}

/// The sum of an integer over the CPUs: a number while a JSON number holds
/// it exactly (a 32-bit type summed over up to 2^21 CPUs always is), else a
/// decimal string; null when it cannot be summed exactly.
pub(crate) fn sum_out(cpus: &[&[u8]], field: &IntField, sink: &mut impl Sink) {
    const EXACT: i128 = 1 << 53;
    match field.sum(cpus.iter().copied()) {
        Some(total) if field.bits() <= 32 && (-EXACT..=EXACT).contains(&total) => {
            sink.int(total as i64)
        }
        Some(total) => sink.decimal(total),
        None => sink.null(),
    }
}
