//! Keys and values read through their types ([`TypeInfo`], from the map's
//! BTF): one model of a map's types for every reader. The daemon (which
//! fills `Entry.decoded_key` and `decoded_value`, evaluates filters,
//! projections, aggregates and watch deltas), the client library (which
//! decodes packed chunks itself) and bpfmapctl all read through it.
//!
//! A [`Layout`] is a [`TypeInfo`] checked once (every member inside its
//! record, array sizes that add up, bounded depth), so that decoding,
//! encoding and per-CPU sums never read outside the bytes they are given,
//! whatever the description says. A [`MapLayout`] is a map's key and value
//! layouts as one call sees them (with the call's [`Renderings`]), and
//! resolves member paths ("key.daddr", `"value.counters[2]"`, `"values[1].bytes"`)
//! once per call into a [`Member`]: where its bytes are and what it is.
//! Integers are read and written through [`IntField`] (width, sign, byte
//! order, bitfields) wherever they are read. The rules of decoding:
//!
//! - integers of up to 32 bits are JSON numbers; 64- and 128-bit integers
//!   are decimal strings (as the proto3 JSON mapping writes int64), so that
//!   no counter loses precision;
//! - bool is `true`/`false`; an enum is its enumerator's name, or its number
//!   when none matches;
//! - an array of `char` is a string when it holds text (printable ASCII up
//!   to a NUL, as libbpf's dumper decides), else an array of numbers;
//! - a struct or union is an object, the members of an anonymous member
//!   appearing in the enclosing object as in C (member paths reach them the
//!   same way); an array is an array; bitfields are extracted (a number up
//!   to 32 bits wide, a string above); a pointer is a hex string
//!   (`"0xffff..."`); a float is a number (NaN and the infinities as the
//!   strings `"NaN"`, `"Infinity"`, `"-Infinity"`);
//! - anything else is the hex string of its bytes.
//!
//! Values are read as little-endian, the byte order of the hosts bpfmapd
//! runs on (x86-64, arm64), except integers marked big-endian
//! (`IntType.big_endian`: the kernel's `__be16`, `__be32`, `__be64`,
//! `__sum16` and `__wsum`), which are read and written in network order.
//!
//! A member may be shown another way than its type says ([`Rendering`]:
//! an IPv4 or IPv6 address, a MAC address, hex), when a call asks for it
//! ([`MapLayout::with_renderings`]); its JSON form is then a string, and
//! encoding accepts that string.
//!
//! One set of bounds holds for every description, whoever made it:
//! [`MAX_DEPTH`] levels, [`MAX_NODES`] types and enumerators, and
//! [`MAX_VALUES`] decoded values.
#![forbid(unsafe_code)]

#[cfg(feature = "arrow")]
pub mod arrow;
mod declare;
mod encode;
mod int;
mod map_layout;
mod member;
mod plan;
mod projection;
mod render;
mod rendering;
mod sink;
mod value_writer;

use std::{collections::HashSet, fmt};

pub use declare::parse_c_type;
pub use encode::EncodeError;
pub use int::IntField;
pub use map_layout::{MapLayout, MapShape};
pub use member::{
    BytesMember, Counter, EntryRef, IntMember, Literal, MAX_COUNTERS, MAX_PATH, Member, MemberKind,
    Root, Step, parse as parse_path,
};
pub use projection::{MAX_FIELDS, Projection, ProjectionError, Source};
pub use rendering::{Rendering, Renderings, UnknownRendering};
pub use sink::{FieldKey, JsonWriter, Sink, ValueBuilder, write_json_string};
pub use value_writer::ValueWriter;

use crate::v1::{TypeInfo, type_info::Kind};

/// Most levels of nesting a description may have, the outermost type being
/// level 1. Clients decode with prost's recursion limit of 100, and each
/// level costs three nested messages (TypeInfo, RecordType or ArrayType,
/// Member).
pub const MAX_DEPTH: usize = 24;
/// Most nodes (types and enumerators) in one description.
pub const MAX_NODES: usize = 10_000;
/// Most values one decoded key or value may hold (array elements count one
/// by one): a description cannot make decoding loop far beyond its bytes.
pub const MAX_VALUES: usize = 1 << 20;

/// Why a [`TypeInfo`] cannot be used.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{path}: {message}")]
#[non_exhaustive]
pub struct TypeError {
    /// Where in the type ("value.stats.bytes").
    pub path: String,
    /// What is wrong.
    pub message: String,
}

/// A checked type description, ready to decode and encode values.
#[derive(Debug, Clone, PartialEq)]
pub struct Layout {
    root: Node,
    size: usize,
    name: String,
    plan: Planned,
}

/// A layout's decoding plan, made when it first decodes (a layout whose
/// renderings change makes it again).
#[derive(Clone, Default)]
struct Planned(std::sync::OnceLock<Option<Box<plan::Plan>>>);

impl Planned {
    fn get(&self, root: &Node) -> Option<&plan::Plan> {
        self.0
            .get_or_init(|| plan::Plan::new(root).map(Box::new))
            .as_deref()
    }
}

/// Derived from the tree, so equal trees plan alike.
impl PartialEq for Planned {
    fn eq(&self, _: &Self) -> bool {
        true
    }
}

impl fmt::Debug for Planned {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.0.get() {
            Some(Some(_)) => f.write_str("planned"),
            Some(None) => f.write_str("decoded from its tree"),
            None => f.write_str("not planned yet"),
        }
    }
}

#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Node {
    Int {
        size: usize,
        signed: bool,
        /// Stored in network byte order.
        big_endian: bool,
        /// The type's name ("__u32", "__be16"; empty when anonymous).
        name: String,
    },
    Bool {
        size: usize,
    },
    Char {
        signed: bool,
    },
    Float {
        size: usize,
    },
    Enum(EnumNode),
    Record(RecordNode),
    Array {
        element: Box<Node>,
        element_size: usize,
        length: usize,
    },
    Pointer {
        size: usize,
    },
    Opaque {
        size: usize,
    },
    /// A member shown another way than its type says ([`Rendering`]).
    Rendered {
        how: Rendering,
        node: Box<Node>,
        size: usize,
    },
}

#[derive(Debug, Clone, PartialEq)]
pub(crate) struct EnumNode {
    pub size: usize,
    pub signed: bool,
    pub name: String,
    /// (value, name), in declaration order.
    pub values: Vec<(i64, String)>,
}

impl EnumNode {
    pub(crate) fn name_of(&self, value: i64) -> Option<&str> {
        self.values
            .iter()
            .find(|(v, _)| *v == value)
            .map(|(_, n)| n.as_str())
    }
}

#[derive(Debug, Clone, PartialEq)]
pub(crate) struct RecordNode {
    pub union: bool,
    /// The type's name ("flow_key"; empty when anonymous).
    pub name: String,
    pub size: usize,
    /// Members in declaration order; anonymous records already flattened
    /// into `Field`s of this record with their offsets added up.
    pub fields: Vec<Field>,
}

#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Field {
    pub name: String,
    /// The name as the sinks write it.
    pub key: FieldKey,
    /// Offset from the start of the record, in bits.
    pub bit_offset: usize,
    /// Width of a bitfield; 0 when the field is not one.
    pub bitfield_size: usize,
    pub node: Node,
    pub size: usize,
}

impl Node {
    pub(crate) fn is_char(&self) -> bool {
        matches!(self, Node::Char { .. })
    }
}

struct Compiler {
    nodes: usize,
}

impl Layout {
    /// Checks `info` and prepares it for decoding. `what` names the root in
    /// errors ("key", "value").
    pub fn new(info: &TypeInfo, what: &str) -> Result<Self, TypeError> {
        let mut c = Compiler { nodes: 0 };
        let (root, size) = c.node(info, what, 0)?;
        let values = values(&root);
        if values > MAX_VALUES {
            return Err(err(
                what,
                format!("decodes into more than {MAX_VALUES} values ({values})"),
            ));
        }
        Ok(Self::of_node(root, size, info.name.clone()))
    }

    /// An unsigned integer of `size` bytes (1, 2, 4 or 8): how untyped
    /// per-CPU values are summed.
    pub fn unsigned(size: usize) -> Option<Self> {
        matches!(size, 1 | 2 | 4 | 8).then(|| {
            let root = Node::Int {
                size,
                signed: false,
                big_endian: false,
                name: String::new(),
            };
            Self::of_node(root, size, String::new())
        })
    }

    /// The bytes of an untyped key or value, shown as hex.
    pub fn opaque(size: usize) -> Self {
        Self::of_node(Node::Opaque { size }, size, String::new())
    }

    /// A layout of `root`, already checked (a record built of checked
    /// members).
    pub(crate) fn of_node(root: Node, size: usize, name: String) -> Self {
        Self {
            root,
            size,
            name,
            plan: Planned::default(),
        }
    }

    pub(crate) fn root(&self) -> &Node {
        &self.root
    }

    /// The description of this layout: its types as [`TypeInfo`], with
    /// anonymous members flattened into their records and renderings left
    /// out (what a client needs to decode the same bytes).
    pub fn describe(&self) -> TypeInfo {
        member::describe(&self.root, self.size)
    }

    /// Whether this is a struct or union (for table columns).
    pub fn is_record(&self) -> bool {
        matches!(self.root, Node::Record(_))
    }

    /// Size of a value in bytes.
    pub fn size(&self) -> usize {
        self.size
    }

    /// The type's declared name ("" when anonymous).
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The member names of a struct or union type, anonymous members
    /// flattened (for table columns); empty for other types.
    pub fn member_names(&self) -> Vec<&str> {
        match &self.root {
            Node::Record(r) => r.fields.iter().map(|f| f.name.as_str()).collect(),
            _ => Vec::new(),
        }
    }

    /// About how many bytes a value takes decoded as a
    /// `google.protobuf.Value` (to size messages before building them).
    pub fn encoded_size_hint(&self) -> usize {
        fn hint(node: &Node) -> usize {
            match node {
                Node::Int { size, .. } if *size > 4 => 26,
                Node::Int { .. } | Node::Char { .. } | Node::Bool { .. } | Node::Float { .. } => 11,
                Node::Enum(e) => {
                    e.values
                        .iter()
                        .map(|(_, n)| n.len())
                        .max()
                        .unwrap_or(0)
                        .max(20)
                        + 4
                }
                Node::Record(r) => {
                    4 + r
                        .fields
                        .iter()
                        .map(|f| f.name.len() + 8 + hint(&f.node))
                        .sum::<usize>()
                }
                Node::Array {
                    element, length, ..
                } if element.is_char() => length + 4,
                Node::Array {
                    element, length, ..
                } => 4 + length * (hint(element) + 2),
                Node::Pointer { .. } => 24,
                Node::Opaque { size } => 2 * size + 4,
                Node::Rendered { how, size, .. } => how.size_hint(*size),
            }
        }
        hint(&self.root)
    }

    /// Whether per-CPU values of this type can be summed: integers of at
    /// most 64 bits, and structs and arrays made only of them. The error says
    /// which member is not.
    pub fn check_summable(&self) -> Result<(), TypeError> {
        fn check(node: &Node, path: &mut String) -> Result<(), TypeError> {
            match node {
                Node::Int { size, .. } if *size <= 8 => Ok(()),
                Node::Rendered { node, .. } => check(node, path),
                Node::Int { .. } => Err(err(path, "128-bit integers are not summed")),
                Node::Record(r) if !r.union => {
                    for f in &r.fields {
                        let len = path.len();
                        push_member(path, &f.name);
                        check(&f.node, path)?;
                        path.truncate(len);
                    }
                    Ok(())
                }
                Node::Array { element, .. } if !element.is_char() => {
                    let len = path.len();
                    path.push_str("[]");
                    check(element, path)?;
                    path.truncate(len);
                    Ok(())
                }
                other => Err(err(
                    path,
                    format!(
                        "{} is not an integer: only integers are summed",
                        kind_name(other)
                    ),
                )),
            }
        }
        let mut path = String::from("value");
        check(&self.root, &mut path)
    }

    /// Decodes `bytes` (exactly [`size`](Self::size) bytes; shorter input
    /// decodes as null) into `sink`.
    pub fn render(&self, bytes: &[u8], sink: &mut impl Sink) {
        if bytes.len() != self.size {
            sink.null();
            return;
        }
        match self.plan.get(&self.root) {
            Some(plan) => plan.run(bytes, sink),
            None => render::node(&self.root, bytes, 0, sink),
        }
    }

    /// Decodes `bytes` by walking the layout's tree, without its plan: the
    /// reference the plan is tested against.
    #[doc(hidden)]
    pub fn render_from_tree(&self, bytes: &[u8], sink: &mut impl Sink) {
        match bytes.len() == self.size {
            true => render::node(&self.root, bytes, 0, sink),
            false => sink.null(),
        }
    }

    /// [`render_sum`](Self::render_sum) by walking the layout's tree.
    #[doc(hidden)]
    pub fn render_sum_from_tree(&self, cpus: &[&[u8]], sink: &mut impl Sink) {
        match cpus.iter().all(|c| c.len() == self.size) {
            true => render::sum(&self.root, cpus, 0, sink),
            false => sink.null(),
        }
    }

    /// Decodes `bytes` as JSON text appended to `out`.
    pub fn write_json(&self, bytes: &[u8], out: &mut Vec<u8>) {
        match self.plan.get(&self.root) {
            Some(plan) if bytes.len() == self.size => plan.write_json(bytes, out),
            _ => self.render(bytes, &mut JsonWriter::new(out)),
        }
    }

    /// Decodes `bytes` as a `google.protobuf.Value`.
    pub fn to_value(&self, bytes: &[u8]) -> prost_types::Value {
        let mut b = ValueBuilder::default();
        self.render(bytes, &mut b);
        b.finish()
    }

    /// Decodes per-CPU values: a list with one decoded value per CPU.
    pub fn render_per_cpu<'a>(
        &self,
        cpus: impl IntoIterator<Item = &'a [u8]>,
        sink: &mut impl Sink,
    ) {
        sink.begin_array();
        for v in cpus {
            self.render(v, sink);
        }
        sink.end_array();
    }

    /// Sums per-CPU values member by member (see
    /// [`check_summable`](Self::check_summable), which must pass) and
    /// writes the sums with the same shape as one value.
    pub fn render_sum(&self, cpus: &[&[u8]], sink: &mut impl Sink) {
        if cpus.iter().any(|c| c.len() != self.size) {
            sink.null();
            return;
        }
        match self.plan.get(&self.root) {
            Some(plan) => plan.run_sum(cpus, sink),
            None => render::sum(&self.root, cpus, 0, sink),
        }
    }

    /// Encodes a value given as JSON (the form [`render`](Self::render)
    /// produces) into its bytes. `what` names the root in errors ("key").
    pub fn encode(&self, value: &prost_types::Value, what: &str) -> Result<Vec<u8>, EncodeError> {
        let mut out = vec![0u8; self.size];
        let mut path = what.to_owned();
        encode::node(&self.root, value, &mut out, 0, &mut path)?;
        Ok(out)
    }
}

/// How many values decoding `node` produces (saturating).
fn values(node: &Node) -> usize {
    match node {
        Node::Record(r) => r
            .fields
            .iter()
            .fold(1usize, |n, f| n.saturating_add(values(&f.node))),
        Node::Array {
            element, length, ..
        } => 1usize.saturating_add(length.saturating_mul(values(element))),
        _ => 1,
    }
}

/// An integer, bool, char, float or pointer of `size` bytes.
fn scalar(info: &TypeInfo, kind: &Kind, size: usize, path: &str) -> Result<Node, TypeError> {
    Ok(match kind {
        Kind::Int(i) => {
            if !matches!(size, 1 | 2 | 4 | 8 | 16) {
                return Err(err(path, format!("an integer of {size} bytes")));
            }
            Node::Int {
                size,
                signed: i.signed,
                big_endian: i.big_endian,
                name: info.name.clone(),
            }
        }
        Kind::Bool(_) => {
            if !matches!(size, 1 | 2 | 4 | 8) {
                return Err(err(path, format!("a bool of {size} bytes")));
            }
            Node::Bool { size }
        }
        Kind::Char(c) => {
            if size != 1 {
                return Err(err(path, format!("a char of {size} bytes")));
            }
            Node::Char { signed: c.signed }
        }
        Kind::Float(_) => match size {
            4 | 8 => Node::Float { size },
            _ => Node::Opaque { size },
        },
        Kind::Pointer(_) => {
            if !matches!(size, 4 | 8) {
                return Err(err(path, format!("a pointer of {size} bytes")));
            }
            Node::Pointer { size }
        }
        _ => return Err(err(path, "not a scalar type")),
    })
}

fn err(path: &str, message: impl Into<String>) -> TypeError {
    TypeError {
        path: path.to_owned(),
        message: message.into(),
    }
}

pub(crate) fn push_member(path: &mut String, name: &str) {
    path.push('.');
    path.push_str(name);
}

pub(crate) fn kind_name(node: &Node) -> &'static str {
    match node {
        Node::Int { .. } => "an integer",
        Node::Bool { .. } => "a bool",
        Node::Char { .. } => "a char",
        Node::Float { .. } => "a float",
        Node::Enum(_) => "an enum",
        Node::Record(r) if r.union => "a union",
        Node::Record(_) => "a struct",
        Node::Array { .. } => "an array",
        Node::Pointer { .. } => "a pointer",
        Node::Opaque { .. } => "an opaque type",
        Node::Rendered { node, .. } => kind_name(node),
    }
}

impl Compiler {
    fn count(&mut self, path: &str) -> Result<(), TypeError> {
        self.nodes += 1;
        if self.nodes > MAX_NODES {
            return Err(err(path, format!("more than {MAX_NODES} types described")));
        }
        Ok(())
    }

    fn node(
        &mut self,
        info: &TypeInfo,
        path: &str,
        depth: usize,
    ) -> Result<(Node, usize), TypeError> {
        self.count(path)?;
        if depth >= MAX_DEPTH {
            return Err(err(
                path,
                format!("nested more than {MAX_DEPTH} levels deep"),
            ));
        }
        let size = info.size as usize;
        let kind = info
            .kind
            .as_ref()
            .ok_or_else(|| err(path, "the type has no kind"))?;
        let node = match kind {
            Kind::Int(_) | Kind::Bool(_) | Kind::Char(_) | Kind::Float(_) | Kind::Pointer(_) => {
                scalar(info, kind, size, path)?
            }
            Kind::Enum(e) => {
                if !matches!(size, 1 | 2 | 4 | 8) {
                    return Err(err(path, format!("an enum of {size} bytes")));
                }
                for _ in &e.enumerators {
                    self.count(path)?;
                }
                Node::Enum(EnumNode {
                    size,
                    signed: e.signed,
                    name: info.name.clone(),
                    values: e
                        .enumerators
                        .iter()
                        .map(|v| (v.value, v.name.clone()))
                        .collect(),
                })
            }
            Kind::Struct(r) | Kind::Union(r) => {
                let union = matches!(kind, Kind::Union(_));
                let mut fields = Vec::with_capacity(r.members.len());
                let mut names = HashSet::new();
                self.record(r, 0, size, path, depth, &mut fields, &mut names)?;
                Node::Record(RecordNode {
                    union,
                    name: info.name.clone(),
                    size,
                    fields,
                })
            }
            Kind::Array(a) => self.array(a, size, path, depth)?,
            Kind::Opaque(_) => Node::Opaque { size },
        };
        Ok((node, size))
    }

    fn array(
        &mut self,
        a: &crate::v1::ArrayType,
        size: usize,
        path: &str,
        depth: usize,
    ) -> Result<Node, TypeError> {
        let element = a
            .element
            .as_ref()
            .ok_or_else(|| err(path, "an array without an element type"))?;
        let (node, element_size) = self.node(element, &format!("{path}[]"), depth + 1)?;
        let length = a.length as usize;
        if element_size.checked_mul(length) != Some(size) {
            return Err(err(
                path,
                format!("{length} elements of {element_size} bytes do not make {size} bytes"),
            ));
        }
        Ok(Node::Array {
            element: Box::new(node),
            element_size,
            length,
        })
    }

    /// Adds the members of `r` (a record at `base_bits` inside the record
    /// being built, of `size` bytes) to `fields`, flattening anonymous
    /// records.
    #[allow(clippy::too_many_arguments)]
    fn record(
        &mut self,
        r: &crate::v1::RecordType,
        base_bits: usize,
        size: usize,
        path: &str,
        depth: usize,
        fields: &mut Vec<Field>,
        names: &mut HashSet<String>,
    ) -> Result<(), TypeError> {
        for m in &r.members {
            let member_path = if m.name.is_empty() {
                format!("{path}.(anonymous)")
            } else {
                format!("{path}.{}", m.name)
            };
            let ty = m
                .r#type
                .as_ref()
                .ok_or_else(|| err(&member_path, "a member without a type"))?;
            let bit_offset = m.bit_offset as usize;
            let bitfield_size = m.bitfield_size as usize;
            let (node, member_size) = self.node(ty, &member_path, depth + 1)?;
            let end_bits = end_bits(&member_path, &node, member_size, bit_offset, bitfield_size)?;
            if end_bits > size * 8 {
                return Err(err(
                    &member_path,
                    format!("ends at bit {end_bits}, past the end of its {size}-byte record"),
                ));
            }
            if m.name.is_empty() {
                // An anonymous struct or union: its members belong to this
                // object, as in C.
                if let (Some(Kind::Struct(inner) | Kind::Union(inner)), 0) =
                    (ty.kind.as_ref(), bitfield_size)
                {
                    self.record(
                        inner,
                        base_bits + bit_offset,
                        member_size,
                        path,
                        depth + 1,
                        fields,
                        names,
                    )?;
                }
                // Anything else anonymous is padding (`int :3;`): nothing to
                // show.
                continue;
            }
            if !names.insert(m.name.clone()) {
                return Err(err(&member_path, "a second member of that name"));
            }
            fields.push(Field {
                name: m.name.clone(),
                key: FieldKey::new(&m.name),
                bit_offset: base_bits + bit_offset,
                bitfield_size,
                node,
                size: member_size,
            });
        }
        Ok(())
    }
}

/// Where a member (of `size` bytes, of type `node`) ends, in bits, once
/// checked: a bitfield (`bitfield_size` > 0) is of an integer-like type and
/// fits the member; any other member starts on a byte.
fn end_bits(
    path: &str,
    node: &Node,
    size: usize,
    bit_offset: usize,
    bitfield_size: usize,
) -> Result<usize, TypeError> {
    if bitfield_size > 0 {
        if bitfield_size > 64 || bitfield_size > size * 8 {
            return Err(err(
                path,
                format!("a bitfield of {bitfield_size} bits in {size} bytes"),
            ));
        }
        if !matches!(
            node,
            Node::Int { .. } | Node::Enum(_) | Node::Bool { .. } | Node::Char { .. }
        ) {
            return Err(err(path, format!("a bitfield of {}", kind_name(node))));
        }
        Ok(bit_offset + bitfield_size)
    } else {
        if !bit_offset.is_multiple_of(8) {
            return Err(err(
                path,
                format!("not a bitfield, yet at bit offset {bit_offset}"),
            ));
        }
        Ok(bit_offset + size * 8)
    }
}

impl fmt::Display for Layout {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let kind = kind_name(&self.root);
        if self.name.is_empty() {
            write!(f, "{kind} of {} bytes", self.size)
        } else {
            write!(f, "{} ({kind} of {} bytes)", self.name, self.size)
        }
    }
}

/// A JSON value in a map reference's text form (an inner map's key in
/// `outer[KEY]`): numbers and strings as they are, objects and lists
/// elided.
pub fn value_brief(v: &prost_types::Value) -> String {
    use prost_types::value::Kind;
    match &v.kind {
        Some(Kind::NumberValue(n)) => format!("{n}"),
        Some(Kind::StringValue(s)) => format!("{s:?}"),
        Some(Kind::BoolValue(b)) => b.to_string(),
        Some(Kind::StructValue(_) | Kind::ListValue(_)) => "{...}".to_owned(),
        Some(Kind::NullValue(_)) | None => "null".to_owned(),
    }
}

#[cfg(test)]
mod tests;
