//! A sink that writes a `google.protobuf.Value` straight in the protobuf
//! wire format, as a field of the message being written: no `Value` tree,
//! no map, no string per member is built. Struct members are written in
//! declaration order (any order is valid on the wire; decoders read the
//! same value as [`ValueBuilder`](super::ValueBuilder) builds).

use std::fmt::Write as _;

use super::{FieldKey, Sink};

/// Wire types.
const VARINT: u32 = 0;
const I64: u32 = 1;
const LEN: u32 = 2;

/// Fields of google.protobuf.Value, Struct, its map entries and ListValue.
const NULL_VALUE: u32 = 1;
const NUMBER_VALUE: u32 = 2;
const STRING_VALUE: u32 = 3;
const BOOL_VALUE: u32 = 4;
const STRUCT_VALUE: u32 = 5;
const LIST_VALUE: u32 = 6;
const STRUCT_FIELDS: u32 = 1;
const ENTRY_KEY: u32 = 1;
const ENTRY_VALUE: u32 = 2;
const LIST_VALUES: u32 = 1;

#[derive(Debug, Clone, Copy)]
enum Open {
    Object,
    Array,
}

/// Writes one `google.protobuf.Value` as field `field` (length-delimited)
/// of the message whose bytes `out` holds.
#[derive(Debug)]
pub struct ValueWriter<'a> {
    out: &'a mut Vec<u8>,
    field: u32,
    /// Where each open length-delimited message starts (its one-byte length
    /// placeholder).
    lengths: Vec<usize>,
    open: Vec<Open>,
    scratch: String,
}

fn varint(out: &mut Vec<u8>, mut v: u64) {
    while v >= 0x80 {
        out.push((v as u8) | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

impl<'a> ValueWriter<'a> {
    /// Appends the value, as field `field` of the enclosing message, to
    /// `out`.
    pub fn new(out: &'a mut Vec<u8>, field: u32) -> Self {
        Self {
            out,
            field,
            lengths: Vec::new(),
            open: Vec::new(),
            scratch: String::new(),
        }
    }

    fn tag(&mut self, field: u32, wire: u32) {
        varint(self.out, u64::from(field << 3 | wire));
    }

    /// Opens a length-delimited field; its length is written when it closes.
    fn open_len(&mut self, field: u32) {
        self.tag(field, LEN);
        self.lengths.push(self.out.len());
        self.out.push(0);
    }

    fn close_len(&mut self) {
        let Some(at) = self.lengths.pop() else { return };
        let len = self.out.len() - at - 1;
        if len < 0x80 {
            self.out[at] = len as u8;
        } else {
            let mut prefix = Vec::with_capacity(4);
            varint(&mut prefix, len as u64);
            self.out.splice(at..at + 1, prefix);
        }
    }

    /// Opens the next Value where it goes: the field itself, a list's next
    /// element, or the value of the map entry a key opened.
    fn begin_value(&mut self) {
        let field = match self.open.last() {
            None => self.field,
            Some(Open::Array) => LIST_VALUES,
            Some(Open::Object) => ENTRY_VALUE,
        };
        self.open_len(field);
    }

    fn end_value(&mut self) {
        self.close_len();
        if let Some(Open::Object) = self.open.last() {
            // The map entry the key opened.
            self.close_len();
        }
    }

    fn string_field(&mut self, field: u32, s: &str) {
        self.tag(field, LEN);
        varint(self.out, s.len() as u64);
        self.out.extend_from_slice(s.as_bytes());
    }

    fn scratch_string(&mut self, write: impl FnOnce(&mut String)) {
        let mut s = std::mem::take(&mut self.scratch);
        s.clear();
        write(&mut s);
        self.string(&s);
        self.scratch = s;
    }

    fn number(&mut self, v: f64) {
        self.begin_value();
        self.tag(NUMBER_VALUE, I64);
        self.out.extend_from_slice(&v.to_le_bytes());
        self.end_value();
    }
}

impl Sink for ValueWriter<'_> {
    fn null(&mut self) {
        self.begin_value();
        self.tag(NULL_VALUE, VARINT);
        self.out.push(0);
        self.end_value();
    }

    fn bool(&mut self, v: bool) {
        self.begin_value();
        self.tag(BOOL_VALUE, VARINT);
        self.out.push(u8::from(v));
        self.end_value();
    }

    fn int(&mut self, v: i64) {
        self.number(v as f64);
    }

    fn decimal(&mut self, v: i128) {
        self.scratch_string(|s| {
            let _ = write!(s, "{v}");
        });
    }

    fn decimal_unsigned(&mut self, v: u128) {
        self.scratch_string(|s| {
            let _ = write!(s, "{v}");
        });
    }

    fn float(&mut self, v: f64) {
        if v.is_nan() {
            self.string("NaN");
        } else if v.is_infinite() {
            self.string(if v > 0.0 { "Infinity" } else { "-Infinity" });
        } else {
            self.number(v);
        }
    }

    fn string(&mut self, s: &str) {
        self.begin_value();
        self.string_field(STRING_VALUE, s);
        self.end_value();
    }

    fn pointer(&mut self, v: u64) {
        self.scratch_string(|s| {
            let _ = write!(s, "{v:#x}");
        });
    }

    fn hex(&mut self, bytes: &[u8]) {
        self.begin_value();
        self.tag(STRING_VALUE, LEN);
        varint(self.out, 2 * bytes.len() as u64);
        let start = self.out.len();
        self.out.resize(start + 2 * bytes.len(), 0);
        faster_hex::hex_encode(bytes, &mut self.out[start..])
            .expect("room for two digits per byte");
        self.end_value();
    }

    fn begin_object(&mut self) {
        self.begin_value();
        self.open_len(STRUCT_VALUE);
        self.open.push(Open::Object);
    }

    fn key(&mut self, name: &str) {
        self.open_len(STRUCT_FIELDS);
        self.string_field(ENTRY_KEY, name);
    }

    fn field_key(&mut self, key: &FieldKey) {
        self.open_len(STRUCT_FIELDS);
        self.out.extend_from_slice(key.proto());
    }

    fn end_object(&mut self) {
        self.open.pop();
        self.close_len();
        self.end_value();
    }

    fn begin_array(&mut self) {
        self.begin_value();
        self.open_len(LIST_VALUE);
        self.open.push(Open::Array);
    }

    fn end_array(&mut self) {
        self.open.pop();
        self.close_len();
        self.end_value();
    }
}
