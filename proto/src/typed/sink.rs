//! Where decoded values go: JSON text, or a `google.protobuf.Value`.

use std::{collections::BTreeMap, io::Write as _};

use prost_types::{ListValue, Struct, Value, value::Kind};

/// Receives a decoded value, depth first. The rules (what is a number, what
/// a string) are decided by the decoder; a sink only writes.
pub trait Sink {
    /// No value (bytes of the wrong size).
    fn null(&mut self);
    /// `true` or `false`.
    fn bool(&mut self, v: bool);
    /// A JSON number that holds `v` exactly (|v| <= 2^53).
    fn int(&mut self, v: i64);
    /// An integer as a decimal string.
    fn decimal(&mut self, v: i128);
    /// An unsigned integer as a decimal string.
    fn decimal_unsigned(&mut self, v: u128);
    /// A floating-point number (NaN and the infinities as strings).
    fn float(&mut self, v: f64);
    /// A string.
    fn string(&mut self, s: &str);
    /// A pointer: `"0x..."`.
    fn pointer(&mut self, v: u64);
    /// Bytes as a hex string.
    fn hex(&mut self, bytes: &[u8]);
    /// Starts an object; members follow as [`key`](Self::key) then a value.
    fn begin_object(&mut self);
    /// The name of the next member.
    fn key(&mut self, name: &str);
    /// The name of the next member of a record, with its encodings made
    /// once, when the layout was built.
    fn field_key(&mut self, key: &FieldKey) {
        self.key(&key.name);
    }
    /// Ends an object.
    fn end_object(&mut self);
    /// Starts an array.
    fn begin_array(&mut self);
    /// Ends an array.
    fn end_array(&mut self);
}

const HEX: &[u8; 16] = b"0123456789abcdef";

/// A record member's name, and how the sinks write it: as a JSON object key
/// (quoted, escaped, with its colon) and as the key field of a
/// `google.protobuf.Struct` map entry (tag, length, bytes).
#[derive(Debug, Clone, PartialEq)]
pub struct FieldKey {
    name: String,
    json: Box<[u8]>,
    proto: Box<[u8]>,
}

impl FieldKey {
    /// The encodings of `name`.
    pub fn new(name: &str) -> Self {
        let mut json = Vec::with_capacity(name.len() + 3);
        write_json_string(&mut json, name);
        json.push(b':');
        let mut proto = vec![0x0a];
        let mut n = name.len() as u64;
        while n >= 0x80 {
            proto.push((n as u8) | 0x80);
            n >>= 7;
        }
        proto.push(n as u8);
        proto.extend_from_slice(name.as_bytes());
        Self {
            name: name.to_owned(),
            json: json.into(),
            proto: proto.into(),
        }
    }

    /// The name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The name as a JSON object key: quoted, escaped, with its colon.
    pub(crate) fn json(&self) -> &[u8] {
        &self.json
    }

    /// The key field of a Struct map entry: tag 1, length, the name.
    pub fn proto(&self) -> &[u8] {
        &self.proto
    }
}

#[derive(Debug, Clone, Copy)]
enum Frame {
    Array { first: bool },
    Object { first: bool },
}

/// Writes compact JSON text into a buffer.
#[derive(Debug)]
pub struct JsonWriter<'a> {
    out: &'a mut Vec<u8>,
    open: Vec<Frame>,
}

impl<'a> JsonWriter<'a> {
    /// Appends to `out`.
    pub fn new(out: &'a mut Vec<u8>) -> Self {
        Self {
            out,
            open: Vec::new(),
        }
    }

    /// Before a value: a comma after the previous element of an array. (In
    /// an object the key wrote its own.)
    fn before_value(&mut self) {
        if let Some(Frame::Array { first }) = self.open.last_mut() {
            if *first {
                *first = false;
            } else {
                self.out.push(b',');
            }
        }
    }

    /// Before a key: a comma after the previous member.
    fn before_key(&mut self) {
        if let Some(Frame::Object { first }) = self.open.last_mut() {
            if *first {
                *first = false;
            } else {
                self.out.push(b',');
            }
        }
    }

    fn quoted(&mut self, f: impl FnOnce(&mut Vec<u8>)) {
        self.before_value();
        self.out.push(b'"');
        f(self.out);
        self.out.push(b'"');
    }
}

impl Sink for JsonWriter<'_> {
    fn null(&mut self) {
        self.before_value();
        self.out.extend_from_slice(b"null");
    }

    fn bool(&mut self, v: bool) {
        self.before_value();
        self.out
            .extend_from_slice(if v { b"true" as &[u8] } else { b"false" });
    }

    fn int(&mut self, v: i64) {
        self.before_value();
        self.out
            .extend_from_slice(itoa::Buffer::new().format(v).as_bytes());
    }

    fn decimal(&mut self, v: i128) {
        self.quoted(|out| out.extend_from_slice(itoa::Buffer::new().format(v).as_bytes()));
    }

    fn decimal_unsigned(&mut self, v: u128) {
        self.quoted(|out| match u64::try_from(v) {
            Ok(v) => out.extend_from_slice(itoa::Buffer::new().format(v).as_bytes()),
            Err(_) => out.extend_from_slice(itoa::Buffer::new().format(v).as_bytes()),
        });
    }

    fn float(&mut self, v: f64) {
        match float_text(v) {
            Ok(text) => {
                self.before_value();
                self.out.extend_from_slice(text.as_bytes());
            }
            Err(name) => self.quoted(|out| out.extend_from_slice(name.as_bytes())),
        }
    }

    fn string(&mut self, s: &str) {
        self.before_value();
        write_json_string(self.out, s);
    }

    fn pointer(&mut self, v: u64) {
        self.quoted(|out| {
            let _ = write!(out, "{v:#x}");
        });
    }

    fn hex(&mut self, bytes: &[u8]) {
        self.quoted(|out| {
            let start = out.len();
            out.resize(start + bytes.len() * 2, 0);
            faster_hex::hex_encode(bytes, &mut out[start..]).expect("room for two digits per byte");
        });
    }

    fn begin_object(&mut self) {
        self.before_value();
        self.out.push(b'{');
        self.open.push(Frame::Object { first: true });
    }

    fn key(&mut self, name: &str) {
        self.before_key();
        write_json_string(self.out, name);
        self.out.push(b':');
    }

    fn field_key(&mut self, key: &FieldKey) {
        self.before_key();
        self.out.extend_from_slice(&key.json);
    }

    fn end_object(&mut self) {
        self.open.pop();
        self.out.push(b'}');
    }

    fn begin_array(&mut self) {
        self.before_value();
        self.out.push(b'[');
        self.open.push(Frame::Array { first: true });
    }

    fn end_array(&mut self) {
        self.open.pop();
        self.out.push(b']');
    }
}

/// Writes `s` as a JSON string (quotes, escapes) to `out`.
pub fn write_json_string(out: &mut Vec<u8>, s: &str) {
    out.push(b'"');
    let plain = |b: &u8| *b >= 0x20 && *b != b'"' && *b != b'\\' && *b != 0x7f;
    if s.as_bytes().iter().all(plain) {
        // Member names and most strings: nothing to escape.
        out.extend_from_slice(s.as_bytes());
        out.push(b'"');
        return;
    }
    for &b in s.as_bytes() {
        match b {
            b'"' => out.extend_from_slice(b"\\\""),
            b'\\' => out.extend_from_slice(b"\\\\"),
            b'\n' => out.extend_from_slice(b"\\n"),
            b'\r' => out.extend_from_slice(b"\\r"),
            b'\t' => out.extend_from_slice(b"\\t"),
            0..0x20 | 0x7f => {
                out.extend_from_slice(b"\\u00");
                out.push(HEX[usize::from(b >> 4)]);
                out.push(HEX[usize::from(b & 15)]);
            }
            _ => out.push(b),
        }
    }
    out.push(b'"');
}

/// The JSON text of a finite float, or the proto3 JSON name of the others.
fn float_text(v: f64) -> Result<String, &'static str> {
    if v.is_nan() {
        Err("NaN")
    } else if v.is_infinite() {
        Err(if v > 0.0 { "Infinity" } else { "-Infinity" })
    } else {
        // Debug is the shortest form that reads back exactly, and valid
        // JSON ("1.0", "1e300", "-0.5").
        Ok(format!("{v:?}"))
    }
}

#[derive(Debug)]
enum Open {
    List(Vec<Value>),
    Object(BTreeMap<String, Value>, String),
}

/// Builds a `google.protobuf.Value`.
#[derive(Debug, Default)]
pub struct ValueBuilder {
    open: Vec<Open>,
    done: Option<Value>,
}

impl ValueBuilder {
    /// The value built (null when nothing was written).
    pub fn finish(self) -> Value {
        self.done.unwrap_or(Value {
            kind: Some(Kind::NullValue(0)),
        })
    }

    fn push(&mut self, kind: Kind) {
        let v = Value { kind: Some(kind) };
        match self.open.last_mut() {
            Some(Open::List(items)) => items.push(v),
            Some(Open::Object(fields, key)) => {
                fields.insert(std::mem::take(key), v);
            }
            None => self.done = Some(v),
        }
    }
}

impl Sink for ValueBuilder {
    fn null(&mut self) {
        self.push(Kind::NullValue(0));
    }

    fn bool(&mut self, v: bool) {
        self.push(Kind::BoolValue(v));
    }

    fn int(&mut self, v: i64) {
        self.push(Kind::NumberValue(v as f64));
    }

    fn decimal(&mut self, v: i128) {
        self.push(Kind::StringValue(v.to_string()));
    }

    fn decimal_unsigned(&mut self, v: u128) {
        self.push(Kind::StringValue(v.to_string()));
    }

    fn float(&mut self, v: f64) {
        match float_text(v) {
            Ok(_) => self.push(Kind::NumberValue(v)),
            Err(name) => self.push(Kind::StringValue(name.to_owned())),
        }
    }

    fn string(&mut self, s: &str) {
        self.push(Kind::StringValue(s.to_owned()));
    }

    fn pointer(&mut self, v: u64) {
        self.push(Kind::StringValue(format!("{v:#x}")));
    }

    fn hex(&mut self, bytes: &[u8]) {
        self.push(Kind::StringValue(faster_hex::hex_string(bytes)));
    }

    fn begin_object(&mut self) {
        self.open.push(Open::Object(BTreeMap::new(), String::new()));
    }

    fn key(&mut self, name: &str) {
        if let Some(Open::Object(_, key)) = self.open.last_mut() {
            name.clone_into(key);
        }
    }

    fn end_object(&mut self) {
        if let Some(Open::Object(fields, _)) = self.open.pop() {
            self.push(Kind::StructValue(Struct { fields }));
        }
    }

    fn begin_array(&mut self) {
        self.open.push(Open::List(Vec::new()));
    }

    fn end_array(&mut self) {
        if let Some(Open::List(values)) = self.open.pop() {
            self.push(Kind::ListValue(ListValue { values }));
        }
    }
}
