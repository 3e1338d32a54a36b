//! Decoding compiled: a [`Layout`](super::Layout)'s tree flattened, once,
//! into the steps of one value (where each member's bytes are, how wide,
//! signed, in which byte order, which bits, shown how), which every reader
//! runs instead of walking the tree per value. JSON text gets its own form
//! of the same steps: the text between two members (`,"dport":`, `}`) is
//! made once, so that a value is its members' readings between copies of
//! ready text.
//!
//! The plan is derived from the layout and nothing else, by the rules of
//! [`render`](super::render) (which still decodes the layouts a plan would
//! be too long for: more than [`MAX_STEPS`] steps, arrays of records in the
//! thousands). Both give the same values; the tests compare them.

use std::ops::Range;

use super::{
    EnumNode, IntField, Node, Rendering, Sink,
    int::sign_extend,
    render::{self, text},
    sink::{FieldKey, JsonWriter, write_json_string},
};

/// Most steps a plan holds (a member, an object's or an array's start or
/// end each take one): a layout that needs more is decoded from its tree.
pub(crate) const MAX_STEPS: usize = 1 << 14;

/// A layout's steps, for any [`Sink`] and as JSON text.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Plan {
    steps: Vec<Step>,
    keys: Vec<FieldKey>,
    enums: Vec<Enum>,
    rendered: Vec<(Rendering, Node)>,
    json: JsonPlan,
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum Step {
    BeginObject,
    /// The name of the next member: an index into `keys`.
    Key(u32),
    EndObject,
    BeginArray,
    EndArray,
    Leaf(Leaf),
}

/// A member read as one value.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Leaf {
    /// An integer (a char too): a number up to 32 bits, a decimal string
    /// above.
    Int(Int),
    /// An enum: its enumerator's name (an index into `enums`), or its
    /// number.
    Enum(Int, u32),
    Bool(Int),
    Pointer(Int),
    Float {
        at: usize,
        size: usize,
    },
    /// A char array: its text, or its chars as numbers.
    Text {
        at: usize,
        len: usize,
        signed: bool,
    },
    /// Bytes as hex.
    Hex {
        at: usize,
        len: usize,
    },
    /// A member shown another way: an index into `rendered`, its bytes.
    Rendered {
        index: u32,
        at: usize,
        size: usize,
    },
}

/// An integer: how to read it (whole bytes at a byte offset, read with one
/// load, or anything else through its [`IntField`]).
#[derive(Debug, Clone, Copy, PartialEq)]
struct Int {
    field: IntField,
    read: Read,
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum Read {
    U8(usize),
    Le16(usize),
    Le32(usize),
    Le64(usize),
    Be16(usize),
    Be32(usize),
    Be64(usize),
    /// A bitfield within 8 bytes: bits `shift..shift + bits` of the
    /// little-endian word at byte `first`, whose bytes end before `last`.
    Bits {
        first: usize,
        last: usize,
        shift: u32,
        bits: u32,
    },
    Field,
}

/// An enum's enumerators, and their names as JSON strings.
#[derive(Debug, Clone, PartialEq)]
struct Enum {
    node: EnumNode,
    json: Vec<Box<[u8]>>,
}

impl Enum {
    /// The JSON string of the enumerator whose value is `value`.
    #[inline]
    fn json_of(&self, value: i64) -> Option<&[u8]> {
        let i = self.node.values.iter().position(|(v, _)| *v == value)?;
        Some(&self.json[i])
    }
}

/// The JSON text form: each leaf with the text before it, then the text
/// after the last.
#[derive(Debug, Clone, PartialEq, Default)]
struct JsonPlan {
    text: Vec<u8>,
    leaves: Vec<(Range<u32>, JsonLeaf)>,
    tail: Range<u32>,
}

/// A leaf as the JSON text form writes it: the integers most members are
/// (whole bytes, little-endian) read and written in one step, any other
/// leaf through [`Plan::json_leaf`].
#[derive(Debug, Clone, Copy, PartialEq)]
enum JsonLeaf {
    /// An unsigned integer of 8, 16 or 32 bits at this byte offset: a
    /// number.
    U8(usize),
    U16(usize),
    U32(usize),
    /// A signed 32-bit integer: a number.
    I32(usize),
    /// An unsigned 64-bit integer: a decimal string.
    U64(usize),
    /// An unsigned bitfield of up to 32 bits, read with one load (see
    /// [`Read::Bits`]): a number.
    Bits(Int),
    /// An enum of one unsigned byte at this offset (an index into the
    /// plan's enums): its enumerator's name, or its number.
    Enum8(usize, u32),
    Other(Leaf),
}

impl JsonLeaf {
    fn of(leaf: Leaf) -> Self {
        let int = match leaf {
            Leaf::Int(int) => int,
            Leaf::Enum(int, e) => {
                return match (int.read, int.field.signed()) {
                    (Read::U8(at), false) => Self::Enum8(at, e),
                    _ => Self::Other(leaf),
                };
            }
            _ => return Self::Other(leaf),
        };
        match (int.read, int.field.signed()) {
            (Read::Bits { bits, .. }, false) if bits <= 32 => Self::Bits(int),
            (Read::U8(at), false) => Self::U8(at),
            (Read::Le16(at), false) => Self::U16(at),
            (Read::Le32(at), false) => Self::U32(at),
            (Read::Le32(at), true) => Self::I32(at),
            (Read::Le64(at), false) => Self::U64(at),
            _ => Self::Other(leaf),
        }
    }
}

/// `N` bytes of `b` at `i` (zeros when `b` is too short: a checked
/// layout's value of its size never is).
#[inline]
fn bytes_at<const N: usize>(b: &[u8], i: usize) -> [u8; N] {
    i.checked_add(N)
        .and_then(|end| b.get(i..end))
        .and_then(|s| s.try_into().ok())
        .unwrap_or([0; N])
}

/// Appends a number's digits.
#[inline(always)]
fn push_number(out: &mut Vec<u8>, n: impl itoa::Integer) {
    let mut digits = itoa::Buffer::new();
    push_digits(out, digits.format(n).as_bytes());
}

impl Int {
    fn new(field: IntField) -> Self {
        let read = match (field.is_bitfield(), field.bits(), field.big_endian()) {
            (true, bits, _) if field.bit_offset() % 8 + bits <= 64 => Read::Bits {
                first: field.offset(),
                last: (field.bit_offset() + bits).div_ceil(8),
                shift: (field.bit_offset() % 8) as u32,
                bits: bits as u32,
            },
            (true, _, _) => Read::Field,
            (_, 8, _) => Read::U8(field.offset()),
            (_, 16, false) => Read::Le16(field.offset()),
            (_, 32, false) => Read::Le32(field.offset()),
            (_, 64, false) => Read::Le64(field.offset()),
            (_, 16, true) => Read::Be16(field.offset()),
            (_, 32, true) => Read::Be32(field.offset()),
            (_, 64, true) => Read::Be64(field.offset()),
            _ => Read::Field,
        };
        Self { field, read }
    }

    /// Its bits, zero-extended (0 when `b` is too short: a checked layout's
    /// value of its size never is).
    #[inline]
    fn raw(&self, b: &[u8]) -> u128 {
        match self.read {
            Read::U8(i) => u128::from(b.get(i).copied().unwrap_or(0)),
            Read::Le16(i) => u128::from(u16::from_le_bytes(bytes_at(b, i))),
            Read::Le32(i) => u128::from(u32::from_le_bytes(bytes_at(b, i))),
            Read::Le64(i) => u128::from(u64::from_le_bytes(bytes_at(b, i))),
            Read::Be16(i) => u128::from(u16::from_be_bytes(bytes_at(b, i))),
            Read::Be32(i) => u128::from(u32::from_be_bytes(bytes_at(b, i))),
            Read::Be64(i) => u128::from(u64::from_be_bytes(bytes_at(b, i))),
            Read::Bits {
                first,
                last,
                shift,
                bits,
            } => bits_at(b, first, last, shift, bits)
                .or_else(|| self.field.raw(b))
                .unwrap_or(0),
            Read::Field => self.field.raw(b).unwrap_or(0),
        }
    }

    /// Its value: sign-extended when signed.
    #[inline]
    fn value(&self, raw: u128) -> i128 {
        match self.field.signed() {
            true => sign_extend(raw, self.field.bits()),
            false => raw as i128,
        }
    }

    /// Writes it as JSON: a number up to 32 bits, else a decimal string.
    #[inline]
    fn write_json(&self, raw: u128, out: &mut Vec<u8>) {
        let mut digits = itoa::Buffer::new();
        let bits = self.field.bits();
        let text = match (self.field.signed(), bits) {
            (false, ..=32) => digits.format(raw as u32),
            (true, ..=32) => digits.format(self.value(raw) as i32),
            (false, ..=64) => quoted(digits.format(raw as u64), out),
            (true, ..=64) => quoted(digits.format(self.value(raw) as i64), out),
            (false, _) => quoted(digits.format(raw), out),
            (true, _) => quoted(digits.format(self.value(raw)), out),
        };
        push_digits(out, text.as_bytes());
        if bits > 32 {
            out.push(b'"');
        }
    }

    /// Writes it into a sink, as [`write_json`](Self::write_json) does.
    fn write(&self, raw: u128, sink: &mut impl Sink) {
        let bits = self.field.bits();
        match self.field.signed() {
            _ if bits <= 32 => sink.int(self.value(raw) as i64),
            true => sink.decimal(self.value(raw)),
            false => sink.decimal_unsigned(raw),
        }
    }
}

/// A bitfield of `bits` bits starting `shift` bits into byte `first`, its
/// bytes ending before `last`, read with one 8-byte load: at `first`, or
/// of the last 8 bytes of `b` when fewer follow `first`. `None` when `b`
/// ends before `last` or is shorter than 8 bytes (the field reads it).
#[inline]
fn bits_at(b: &[u8], first: usize, last: usize, shift: u32, bits: u32) -> Option<u128> {
    if b.len() < last {
        return None;
    }
    let (at, shift) = match first.checked_add(8) {
        Some(end) if end <= b.len() => (first, shift),
        _ => {
            let at = b.len().checked_sub(8)?;
            (at, shift + 8 * (first - at) as u32)
        }
    };
    let word = u64::from_le_bytes(b.get(at..at + 8)?.try_into().ok()?) >> shift;
    let word = if bits >= 64 {
        word
    } else {
        word & ((1u64 << bits) - 1)
    };
    Some(u128::from(word))
}

/// Appends a number's digits, copied as a block of their length (most
/// numbers have a few digits, and a copy of unknown length is a call to
/// `memcpy`, which costs more than the copy).
#[inline(always)]
fn push_digits(out: &mut Vec<u8>, digits: &[u8]) {
    macro_rules! by_length {
        ($($n:literal)*) => {
            match digits.len() {
                $($n => {
                    let block: &[u8; $n] = digits.try_into().expect("the length matched");
                    out.extend_from_slice(block);
                })*
                _ => out.extend_from_slice(digits),
            }
        };
    }
    by_length!(1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20);
}

/// Opens a JSON string before `text`'s digits.
#[inline]
fn quoted<'a>(text: &'a str, out: &mut Vec<u8>) -> &'a str {
    out.push(b'"');
    text
}

impl Plan {
    /// The plan of a layout whose tree is `root`, or `None` when it needs
    /// more than [`MAX_STEPS`] steps.
    pub(crate) fn new(root: &Node) -> Option<Self> {
        let mut plan = Self {
            steps: Vec::new(),
            keys: Vec::new(),
            enums: Vec::new(),
            rendered: Vec::new(),
            json: JsonPlan::default(),
        };
        plan.node(root, 0)?;
        plan.json = JsonPlan::of(&plan);
        Some(plan)
    }

    fn push(&mut self, step: Step) -> Option<()> {
        (self.steps.len() < MAX_STEPS).then(|| self.steps.push(step))
    }

    /// The steps of `node`, whose bytes start at `at`.
    fn node(&mut self, node: &Node, at: usize) -> Option<()> {
        let whole = |size: usize, signed: bool, big_endian: bool| {
            Int::new(IntField::whole(at, size, signed, big_endian))
        };
        let leaf = match node {
            Node::Int {
                size,
                signed,
                big_endian,
                ..
            } => Leaf::Int(whole(*size, *signed, *big_endian)),
            Node::Char { signed } => Leaf::Int(whole(1, *signed, false)),
            Node::Enum(e) => self.enum_leaf(e, whole(e.size, e.signed, false)),
            Node::Bool { size } => Leaf::Bool(whole(*size, false, false)),
            Node::Pointer { size } => Leaf::Pointer(whole(*size, false, false)),
            Node::Float { size } => Leaf::Float { at, size: *size },
            Node::Opaque { size } => Leaf::Hex { at, len: *size },
            Node::Array {
                element,
                element_size,
                length,
            } => return self.array(element, *element_size, *length, at),
            Node::Record(r) => {
                self.push(Step::BeginObject)?;
                for f in &r.fields {
                    self.keys.push(f.key.clone());
                    self.push(Step::Key(self.keys.len() as u32 - 1))?;
                    self.field(f, at)?;
                }
                return self.push(Step::EndObject);
            }
            Node::Rendered { how, node, size } => {
                self.rendered.push((*how, (**node).clone()));
                Leaf::Rendered {
                    index: self.rendered.len() as u32 - 1,
                    at,
                    size: *size,
                }
            }
        };
        self.push(Step::Leaf(leaf))
    }

    fn enum_leaf(&mut self, e: &EnumNode, int: Int) -> Leaf {
        let json = e
            .values
            .iter()
            .map(|(_, name)| {
                let mut text = Vec::new();
                write_json_string(&mut text, name);
                text.into_boxed_slice()
            })
            .collect();
        self.enums.push(Enum {
            node: e.clone(),
            json,
        });
        Leaf::Enum(int, self.enums.len() as u32 - 1)
    }

    fn array(&mut self, element: &Node, size: usize, length: usize, at: usize) -> Option<()> {
        if let Node::Char { signed } = element {
            let (len, signed) = (size * length, *signed);
            return self.push(Step::Leaf(Leaf::Text { at, len, signed }));
        }
        if length > MAX_STEPS {
            return None;
        }
        self.push(Step::BeginArray)?;
        for i in 0..length {
            self.node(element, at + i * size)?;
        }
        self.push(Step::EndArray)
    }

    fn field(&mut self, f: &super::Field, record: usize) -> Option<()> {
        if f.bitfield_size == 0 {
            return self.node(&f.node, record + f.bit_offset / 8);
        }
        let (signed, bits) = (
            matches!(
                &f.node,
                Node::Int { signed: true, .. } | Node::Char { signed: true }
            ) || matches!(&f.node, Node::Enum(e) if e.signed),
            f.bitfield_size,
        );
        let int = Int::new(IntField::bitfield(record * 8 + f.bit_offset, bits, signed));
        let leaf = match &f.node {
            Node::Enum(e) => self.enum_leaf(e, int),
            Node::Bool { .. } => Leaf::Bool(int),
            Node::Pointer { .. } => Leaf::Pointer(int),
            Node::Int { .. } | Node::Char { .. } => Leaf::Int(int),
            // A checked layout has no other bitfields.
            _ => return None,
        };
        self.push(Step::Leaf(leaf))
    }

    /// Decodes `bytes` into `sink`.
    pub(crate) fn run(&self, bytes: &[u8], sink: &mut impl Sink) {
        for step in &self.steps {
            match *step {
                Step::BeginObject => sink.begin_object(),
                Step::Key(i) => sink.field_key(&self.keys[i as usize]),
                Step::EndObject => sink.end_object(),
                Step::BeginArray => sink.begin_array(),
                Step::EndArray => sink.end_array(),
                Step::Leaf(leaf) => self.leaf(leaf, bytes, sink),
            }
        }
    }

    fn leaf(&self, leaf: Leaf, b: &[u8], sink: &mut impl Sink) {
        match leaf {
            Leaf::Int(int) => int.write(int.raw(b), sink),
            Leaf::Enum(int, e) => {
                let raw = int.raw(b);
                match self.enums[e as usize].node.name_of(int.value(raw) as i64) {
                    Some(name) => sink.string(name),
                    None => int.write(raw, sink),
                }
            }
            Leaf::Bool(int) => sink.bool(int.raw(b) != 0),
            Leaf::Pointer(int) => sink.pointer(int.raw(b) as u64),
            Leaf::Float { at, size } => render::float(render::slice(b, at, size), sink),
            Leaf::Text { at, len, signed } => {
                let chars = render::slice(b, at, len);
                match text(chars) {
                    Some(t) => sink.string(t),
                    None => {
                        sink.begin_array();
                        for &c in chars {
                            sink.int(if signed {
                                i64::from(c as i8)
                            } else {
                                i64::from(c)
                            });
                        }
                        sink.end_array();
                    }
                }
            }
            Leaf::Hex { at, len } => sink.hex(render::slice(b, at, len)),
            Leaf::Rendered { index, at, size } => {
                let (how, node) = &self.rendered[index as usize];
                how.render(node, render::slice(b, at, size), sink);
            }
        }
    }

    /// Appends `bytes` decoded as JSON text to `out`.
    pub(crate) fn write_json(&self, bytes: &[u8], out: &mut Vec<u8>) {
        let json = &self.json;
        let b = bytes;
        for (before, leaf) in &json.leaves {
            json.append(before, out);
            match *leaf {
                JsonLeaf::U8(i) => push_number(out, b.get(i).copied().unwrap_or(0)),
                JsonLeaf::U16(i) => push_number(out, u16::from_le_bytes(bytes_at(b, i))),
                JsonLeaf::U32(i) => push_number(out, u32::from_le_bytes(bytes_at(b, i))),
                JsonLeaf::I32(i) => push_number(out, i32::from_le_bytes(bytes_at(b, i))),
                JsonLeaf::U64(i) => {
                    out.push(b'"');
                    push_number(out, u64::from_le_bytes(bytes_at(b, i)));
                    out.push(b'"');
                }
                JsonLeaf::Bits(int) => push_number(out, int.raw(b) as u32),
                JsonLeaf::Enum8(i, e) => {
                    let value = b.get(i).copied().unwrap_or(0);
                    match self.enums[e as usize].json_of(i64::from(value)) {
                        Some(name) => out.extend_from_slice(name),
                        None => push_number(out, value),
                    }
                }
                JsonLeaf::Other(leaf) => self.json_leaf(leaf, b, out),
            }
        }
        json.append(&json.tail, out);
    }

    #[inline]
    fn json_leaf(&self, leaf: Leaf, b: &[u8], out: &mut Vec<u8>) {
        match leaf {
            Leaf::Int(int) => int.write_json(int.raw(b), out),
            Leaf::Enum(int, e) => {
                let raw = int.raw(b);
                match self.enums[e as usize].json_of(int.value(raw) as i64) {
                    Some(name) => out.extend_from_slice(name),
                    None => int.write_json(raw, out),
                }
            }
            Leaf::Text { at, len, .. } => match text(render::slice(b, at, len)) {
                Some(t) => write_json_string(out, t),
                None => self.leaf(leaf, b, &mut JsonWriter::new(out)),
            },
            other => self.leaf(other, b, &mut JsonWriter::new(out)),
        }
    }

    /// Writes the sums over the CPUs of a summable layout's integers (see
    /// `Layout::check_summable`) with the shape of one value: a number
    /// while a JSON number holds it exactly, else a decimal string, null
    /// when it cannot be summed exactly. Renderings do not apply to sums.
    pub(crate) fn run_sum(&self, cpus: &[&[u8]], sink: &mut impl Sink) {
        for step in &self.steps {
            match *step {
                Step::BeginObject => sink.begin_object(),
                Step::Key(i) => sink.field_key(&self.keys[i as usize]),
                Step::EndObject => sink.end_object(),
                Step::BeginArray => sink.begin_array(),
                Step::EndArray => sink.end_array(),
                Step::Leaf(Leaf::Int(int)) => render::sum_out(cpus, &int.field, sink),
                Step::Leaf(Leaf::Rendered { index, at, .. }) => {
                    match &self.rendered[index as usize].1 {
                        Node::Int {
                            size,
                            signed,
                            big_endian,
                            ..
                        } => {
                            let field = IntField::whole(at, *size, *signed, *big_endian);
                            render::sum_out(cpus, &field, sink)
                        }
                        _ => sink.null(),
                    }
                }
                Step::Leaf(_) => sink.null(),
            }
        }
    }
}

/// Text pieces up to this long are copied as a block of this size (the
/// text is padded to allow it): one fixed move rather than a call to
/// `memmove` per member name.
const SHORT: usize = 16;

impl JsonPlan {
    /// Appends the text in `range` to `out`.
    #[inline]
    fn append(&self, range: &Range<u32>, out: &mut Vec<u8>) {
        let (start, end) = (range.start as usize, range.end as usize);
        let block = self
            .text
            .get(start..start + SHORT)
            .and_then(|b| <&[u8; SHORT]>::try_from(b).ok());
        match block {
            Some(block) if end - start <= SHORT => {
                let len = out.len();
                out.extend_from_slice(block);
                out.truncate(len + end - start);
            }
            _ => out.extend_from_slice(&self.text[start..end]),
        }
    }

    /// The JSON text form of `plan`'s steps.
    fn of(plan: &Plan) -> Self {
        let mut json = Self::default();
        // Whether the open object or array has a member yet.
        let mut open: Vec<bool> = Vec::new();
        let mut start = 0u32;
        let comma = |json: &mut Self, open: &mut Vec<bool>| {
            if let Some(seen) = open.last_mut() {
                if *seen {
                    json.text.push(b',');
                }
                *seen = true;
            }
        };
        for step in &plan.steps {
            match *step {
                Step::BeginObject | Step::BeginArray => {
                    // An object's members come after their keys.
                    if !matches!(json.text.last(), Some(b':')) {
                        comma(&mut json, &mut open);
                    }
                    let brace = if *step == Step::BeginObject {
                        b'{'
                    } else {
                        b'['
                    };
                    json.text.push(brace);
                    open.push(false);
                }
                Step::EndObject | Step::EndArray => {
                    open.pop();
                    json.text
                        .push(if *step == Step::EndObject { b'}' } else { b']' });
                }
                Step::Key(i) => {
                    comma(&mut json, &mut open);
                    let key = &plan.keys[i as usize];
                    json.text.extend_from_slice(key.json());
                }
                Step::Leaf(leaf) => {
                    if !matches!(json.text.last(), Some(b':')) {
                        comma(&mut json, &mut open);
                    }
                    let end = json.text.len() as u32;
                    json.leaves.push((start..end, JsonLeaf::of(leaf)));
                    start = end;
                }
            }
        }
        json.tail = start..json.text.len() as u32;
        json.text.extend_from_slice(&[0; SHORT]);
        json
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A bitfield read with one load gives what the field reads, at every
    /// bit offset and width in sides of 1 to 20 bytes (a side too short
    /// for the field included).
    #[test]
    fn bitfields_read_with_one_load_equal_the_field() {
        let mut seed = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = || {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed
        };
        for len in 1..=20usize {
            let bytes: Vec<u8> = (0..len).map(|_| next() as u8).collect();
            for bit_offset in 0..len * 8 {
                for bits in 1..=64 {
                    let field = IntField::bitfield(bit_offset, bits, false);
                    let int = Int::new(field);
                    if !field.is_bitfield() {
                        continue;
                    }
                    if bit_offset % 8 + bits <= 64 {
                        assert!(matches!(int.read, Read::Bits { .. }), "{field:?}");
                    }
                    for side in [&bytes[..], &bytes[..len.saturating_sub(1)]] {
                        assert_eq!(
                            int.raw(side),
                            field.raw(side).unwrap_or(0),
                            "{field:?} in {side:02x?}"
                        );
                    }
                }
            }
        }
    }
}
