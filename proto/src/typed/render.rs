//! Decoding: bytes to JSON-shaped values, by the rules in the module docs.

use super::{Field, Node, Sink};

/// `bytes[offset..offset + n]`, or an empty slice when out of range (a
/// checked [`Layout`](super::Layout) never is).
pub(crate) fn slice(bytes: &[u8], offset: usize, n: usize) -> &[u8] {
    offset
        .checked_add(n)
        .and_then(|end| bytes.get(offset..end))
        .unwrap_or(&[])
}

/// A little-endian unsigned integer of up to 16 bytes.
pub(crate) fn uint(b: &[u8]) -> u128 {
    b.iter()
        .take(16)
        .rev()
        .fold(0u128, |acc, &x| (acc << 8) | u128::from(x))
}

/// The `size`-byte integer `raw`, sign-extended when `signed`.
pub(crate) fn sign_extend(raw: u128, bits: usize, signed: bool) -> i128 {
    if bits == 0 || bits >= 128 {
        return raw as i128;
    }
    if signed && raw >> (bits - 1) & 1 == 1 {
        (raw | (!0u128 << bits)) as i128
    } else {
        raw as i128
    }
}

/// `bits` bits at bit `bit` of `bytes` (little-endian, as the compiler lays
/// bitfields out on little-endian hosts).
pub(crate) fn bitfield(bytes: &[u8], bit: usize, bits: usize) -> u128 {
    let start = bit / 8;
    let shift = bit % 8;
    let n = (shift + bits).div_ceil(8);
    let raw = uint(slice(bytes, start, n)) >> shift;
    if bits >= 128 {
        raw
    } else {
        raw & ((1u128 << bits) - 1)
    }
}

/// An integer of `bits` bits: a number up to 32 bits, a decimal string
/// above.
fn integer(v: i128, bits: usize, sink: &mut impl Sink) {
    if bits <= 32 {
        sink.int(v as i64);
    } else {
        sink.decimal(v);
    }
}

/// The same for an unsigned value that may not fit an i128.
fn unsigned(v: u128, bits: usize, sink: &mut impl Sink) {
    if bits <= 32 {
        sink.int(v as i64);
    } else {
        sink.decimal_unsigned(v);
    }
}

fn int_value(raw: u128, bits: usize, signed: bool, sink: &mut impl Sink) {
    if signed {
        integer(sign_extend(raw, bits, true), bits, sink);
    } else {
        unsigned(raw, bits, sink);
    }
}

fn enum_value(e: &super::EnumNode, raw: u128, bits: usize, sink: &mut impl Sink) {
    let value = sign_extend(raw, bits, e.signed);
    // Enumerators hold 64-bit two's complement.
    let as_i64 = value as i64;
    match e.name_of(as_i64) {
        Some(name) => sink.string(name),
        None => int_value(raw, bits, e.signed, sink),
    }
}

fn is_text(b: &[u8]) -> Option<&str> {
    let nul = b.iter().position(|&c| c == 0)?;
    let text = &b[..nul];
    text.iter()
        .all(|&c| (0x20..0x7f).contains(&c))
        .then(|| std::str::from_utf8(text).ok())
        .flatten()
}

/// The integer of `size` bytes at `offset`, in either byte order.
pub(crate) fn int_at(bytes: &[u8], offset: usize, size: usize, big_endian: bool) -> u128 {
    let b = slice(bytes, offset, size);
    if big_endian {
        b.iter()
            .take(16)
            .fold(0u128, |acc, &x| (acc << 8) | u128::from(x))
    } else {
        uint(b)
    }
}

pub(crate) fn node(node: &Node, bytes: &[u8], offset: usize, sink: &mut impl Sink) {
    match node {
        Node::Int {
            size,
            signed,
            big_endian,
        } => int_value(
            int_at(bytes, offset, *size, *big_endian),
            size * 8,
            *signed,
            sink,
        ),
        Node::Bool { size } => sink.bool(uint(slice(bytes, offset, *size)) != 0),
        Node::Char { signed } => {
            int_value(uint(slice(bytes, offset, 1)), 8, *signed, sink);
        }
        Node::Float { size } => {
            let b = slice(bytes, offset, *size);
            let v = match *size {
                4 => b.try_into().map(f32::from_le_bytes).map(f64::from).ok(),
                _ => b.try_into().map(f64::from_le_bytes).ok(),
            };
            match v {
                Some(v) => sink.float(v),
                None => sink.null(),
            }
        }
        Node::Enum(e) => enum_value(e, uint(slice(bytes, offset, e.size)), e.size * 8, sink),
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
                && let Some(text) = is_text(slice(bytes, offset, element_size * length))
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
        Node::Pointer { size } => sink.pointer(uint(slice(bytes, offset, *size)) as u64),
        Node::Opaque { size } => sink.hex(slice(bytes, offset, *size)),
        Node::Rendered { how, node, size } => sink.string(&how.show(node, *size, bytes, offset)),
    }
}

fn field(f: &Field, bytes: &[u8], record: usize, sink: &mut impl Sink) {
    if f.bitfield_size == 0 {
        node(&f.node, bytes, record + f.bit_offset / 8, sink);
        return;
    }
    let raw = bitfield(bytes, record * 8 + f.bit_offset, f.bitfield_size);
    let bits = f.bitfield_size;
    match &f.node {
        Node::Int { signed, .. } | Node::Char { signed } => int_value(raw, bits, *signed, sink),
        Node::Enum(e) => enum_value(e, raw, bits, sink),
        Node::Bool { .. } => sink.bool(raw != 0),
        // A checked layout has no other bitfields.
        _ => sink.null(),
    }
}

/// Sums the integers of per-CPU values (a summable layout: integers,
/// structs and arrays of them).
pub(crate) fn sum(node: &Node, cpus: &[&[u8]], offset: usize, sink: &mut impl Sink) {
    match node {
        Node::Int {
            size,
            signed,
            big_endian,
        } => {
            let bits = size * 8;
            let total: i128 = cpus
                .iter()
                .map(|b| sign_extend(int_at(b, offset, *size, *big_endian), bits, *signed))
                .sum();
            sum_out(total, bits, sink);
        }
        // Sums are numbers whatever the rendering.
        Node::Rendered { node, .. } => sum(node, cpus, offset, sink),
        Node::Record(r) => {
            sink.begin_object();
            for f in &r.fields {
                sink.field_key(&f.key);
                if f.bitfield_size == 0 {
                    sum(&f.node, cpus, offset + f.bit_offset / 8, sink);
                } else {
                    let signed = matches!(f.node, Node::Int { signed: true, .. });
                    let total: i128 = cpus
                        .iter()
                        .map(|b| {
                            let raw = bitfield(b, offset * 8 + f.bit_offset, f.bitfield_size);
                            sign_extend(raw, f.bitfield_size, signed)
                        })
                        .sum();
                    sum_out(total, f.bitfield_size, sink);
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

/// A sum of `bits`-bit integers: a number while a JSON number holds it
/// exactly (a 32-bit type summed over up to 2^21 CPUs always is), else a
/// decimal string.
fn sum_out(total: i128, bits: usize, sink: &mut impl Sink) {
    const EXACT: i128 = 1 << 53;
    if bits <= 32 && (-EXACT..=EXACT).contains(&total) {
        sink.int(total as i64);
    } else {
        sink.decimal(total);
    }
}
