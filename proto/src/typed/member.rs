//! Members of a map's keys and values, by path ("key.daddr",
//! "value.stats.bytes", `"value.counters[2]"`, `"values[1].bytes"`): parsed
//! once, resolved against a [`MapLayout`] once per call, then read from
//! entries' bytes as often as needed. The one rule for anonymous members is
//! the layout's: their members belong to the enclosing record, as in C.

use super::{EncodeError, EnumNode, IntField, MapLayout, Node, Rendering, TypeError, err};
use crate::v1::{self as pb, type_info::Kind};

/// The longest member path accepted, in bytes.
pub const MAX_PATH: usize = 256;

/// Where a member lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Root {
    /// The key.
    Key,
    /// The value (for per-CPU maps: its sum over the CPUs).
    Value,
    /// One CPU's value of a per-CPU map.
    Cpu(usize),
}

impl Root {
    /// The path of the root itself ("key", "value", `"values[2]"`).
    pub fn name(self) -> String {
        match self {
            Self::Key => "key".into(),
            Self::Value => "value".into(),
            Self::Cpu(i) => format!("values[{i}]"),
        }
    }
}

/// One step down a path.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Step {
    /// A member of a struct or union.
    Member(String),
    /// An element of an array.
    Index(u64),
}

/// Parses a member path ("key", "value.stats.bytes", `"value.counters[2]"`,
/// `"values[0].bytes"`). The error quotes the path and says what is wrong.
pub fn parse(text: &str) -> Result<(Root, Vec<Step>), TypeError> {
    let bad = |why: &str| err(&format!("{text:?}"), why);
    if text.len() > MAX_PATH {
        return Err(bad("a member path is at most 256 characters"));
    }
    let head_end = text.find(['.', '[']).unwrap_or(text.len());
    let mut rest = &text[head_end..];
    let mut root = match &text[..head_end] {
        "key" => Root::Key,
        "value" => Root::Value,
        "values" => Root::Cpu(usize::MAX),
        _ => return Err(bad("a member path starts with key, value or values[i]")),
    };
    let mut steps = Vec::new();
    while !rest.is_empty() {
        if let Some(r) = rest.strip_prefix('.') {
            let end = r.find(['.', '[']).unwrap_or(r.len());
            let name = &r[..end];
            if name.is_empty() || !name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_') {
                return Err(bad("member names are C identifiers"));
            }
            steps.push(Step::Member(name.to_owned()));
            rest = &r[end..];
        } else if let Some(r) = rest.strip_prefix('[') {
            let end = r.find(']').ok_or_else(|| bad("unclosed ["))?;
            let i: u64 = r[..end].parse().map_err(|_| bad("an index is a number"))?;
            rest = &r[end + 1..];
            if root == Root::Cpu(usize::MAX) {
                root = Root::Cpu(usize::try_from(i).unwrap_or(usize::MAX - 1));
            } else {
                steps.push(Step::Index(i));
            }
        } else {
            return Err(bad("expected . or ["));
        }
    }
    if root == Root::Cpu(usize::MAX) {
        return Err(bad("values needs a CPU index: values[0]"));
    }
    Ok((root, steps))
}

/// A member found in a map's layout: where its bytes are and what it is.
#[derive(Debug, Clone)]
pub struct Member<'a> {
    path: String,
    root: Root,
    /// From the start of its root, in bits.
    bit_offset: usize,
    /// The width of a bitfield; 0 when it is not one.
    bitfield: usize,
    size: usize,
    /// Its type; `None` for the bytes of an untyped key or value.
    node: Option<&'a Node>,
    /// Read as the sum over the CPUs (the value of a per-CPU map).
    summed: bool,
    /// The bytes of a map without types (`node` is then `None`, or their
    /// rendering).
    untyped: bool,
    /// The record fields (and array elements, as `usize::MAX`) walked to
    /// reach it, for renderings.
    pub(crate) trail: Vec<usize>,
}

/// What kind of thing a member is, as readers of members tell them apart.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MemberKind {
    /// An integer, an enum or a char: [`Member::int`] reads it.
    Integer,
    /// A bool.
    Bool,
    /// An array of char: text up to its first NUL.
    Text,
    /// Bytes: an untyped key or value, an opaque type, an array of
    /// anything but char.
    Bytes,
    /// A struct, a union, a float or a pointer.
    Other,
}

impl<'a> Member<'a> {
    /// The path as written, normalized ("key.daddr").
    pub fn path(&self) -> &str {
        &self.path
    }

    /// Where it lives.
    pub fn root(&self) -> Root {
        self.root
    }

    /// Its size in bytes (of the integer that holds a bitfield).
    pub fn size(&self) -> usize {
        self.size
    }

    /// Its offset from the start of its root, in bits.
    pub fn bit_offset(&self) -> usize {
        self.bit_offset
    }

    /// A bitfield's width, if it is one.
    pub fn bitfield(&self) -> Option<usize> {
        (self.bitfield != 0).then_some(self.bitfield)
    }

    /// Whether it is read as the sum over the CPUs (a member of the value
    /// of a per-CPU map).
    pub fn summed(&self) -> bool {
        self.summed
    }

    /// Whether the map describes it (false for the bytes of an untyped key
    /// or value).
    pub fn typed(&self) -> bool {
        !self.untyped
    }

    pub(crate) fn node(&self) -> Option<&'a Node> {
        self.node
    }

    /// The node, through a rendering.
    fn plain(&self) -> Option<&'a Node> {
        match self.node? {
            Node::Rendered { node, .. } => Some(node),
            n => Some(n),
        }
    }

    /// How the call shows it, when a rendering says.
    pub fn rendering(&self) -> Option<Rendering> {
        match self.node? {
            Node::Rendered { how, .. } => Some(*how),
            _ => None,
        }
    }

    /// What kind of thing it is.
    pub fn kind(&self) -> MemberKind {
        match self.plain() {
            None => MemberKind::Bytes,
            Some(Node::Int { .. } | Node::Enum(_) | Node::Char { .. }) => MemberKind::Integer,
            Some(Node::Bool { .. }) => MemberKind::Bool,
            Some(Node::Array { element, .. }) if element.is_char() => MemberKind::Text,
            Some(Node::Array { .. } | Node::Opaque { .. }) => MemberKind::Bytes,
            Some(_) => MemberKind::Other,
        }
    }

    /// Its type's name, for messages ("u64", "struct flow_key",
    /// `"char[16]"`; "8 bytes" for untyped bytes).
    pub fn type_name(&self) -> String {
        self.plain()
            .map_or_else(|| format!("{} bytes", self.size), type_name)
    }

    /// An enum's enumerators, (value, name) in declaration order.
    pub fn enumerators(&self) -> Option<&'a [(i64, String)]> {
        match self.plain()? {
            Node::Enum(EnumNode { values, .. }) => Some(values),
            _ => None,
        }
    }

    /// Its description (renderings left out); `None` for untyped bytes.
    pub fn describe(&self) -> Option<pb::TypeInfo> {
        self.plain().map(|n| describe(n, self.size))
    }

    /// Where its integer is, when it is an integer, an enum, a char or a
    /// bool (bitfields included).
    fn field(&self) -> Option<IntField> {
        let signed = match self.plain()? {
            Node::Int { signed, .. } | Node::Char { signed } => *signed,
            Node::Enum(e) => e.signed,
            Node::Bool { .. } => false,
            _ => return None,
        };
        Some(if self.bitfield != 0 {
            IntField::bitfield(self.bit_offset, self.bitfield, signed)
        } else {
            let big_endian = matches!(
                self.plain(),
                Some(Node::Int {
                    big_endian: true,
                    ..
                })
            );
            IntField::whole(self.bit_offset / 8, self.size, signed, big_endian)
        })
    }

    /// The member as an integer: an integer, an enum or a char, or the
    /// bytes of an untyped key or value of 1, 2, 4 or 8 bytes (an unsigned
    /// little-endian integer). The value of a per-CPU map is summed over
    /// the CPUs, which only integers can be. The error names the member and
    /// says what it is.
    pub fn int(&self) -> Result<IntMember, TypeError> {
        let untyped = self.untyped && matches!(self.size, 1 | 2 | 4 | 8);
        let summable = untyped || matches!(self.plain(), Some(Node::Int { .. }));
        if self.summed && !summable {
            return Err(self.not_summable());
        }
        let field = if untyped {
            Some(IntField::unsigned(self.size))
        } else if self.kind() == MemberKind::Integer {
            self.field()
        } else {
            None
        };
        field
            .map(|field| IntMember {
                root: self.root,
                field,
            })
            .ok_or_else(|| err(&self.path, format!("not an integer ({})", self.type_name())))
    }

    /// Why this member of a per-CPU value cannot be read as its sum over
    /// the CPUs.
    pub fn not_summable(&self) -> TypeError {
        err(
            &self.path,
            format!(
                "per-CPU values are summed over the CPUs for `value`, and only integers can be (this is {}); read one CPU's with values[i]",
                self.type_name()
            ),
        )
    }

    /// A value in the spelling of this member's rendering ("10.0.0.1" for
    /// an address, 443 for a be16 port, "bash" for text), as the member
    /// holds it: its integer value, or its bytes (a char array's up to the
    /// first NUL, as [`bytes`](Self::bytes) reads them). `None` when the
    /// member has no rendering.
    pub fn read_rendered(&self, v: &prost_types::Value) -> Option<Result<Literal, EncodeError>> {
        let Some(Node::Rendered { how, node, size }) = self.node else {
            return None;
        };
        let mut buf = vec![0u8; *size];
        let mut path = self.path.clone();
        if let Err(e) = how.encode(node, *size, v, &mut buf, &mut path) {
            return Some(Err(e));
        }
        let at_start = Member {
            bit_offset: 0,
            root: Root::Key,
            summed: false,
            ..self.clone()
        };
        let int = (self.kind() == MemberKind::Integer)
            .then(|| at_start.int().ok())
            .flatten();
        Some(Ok(match int {
            Some(int) => Literal::Int(int.field().value(&buf).unwrap_or_default()),
            None if self.kind() == MemberKind::Text => {
                let end = buf.iter().position(|&c| c == 0).unwrap_or(buf.len());
                buf.truncate(end);
                Literal::Bytes(buf)
            }
            None => Literal::Bytes(buf),
        }))
    }

    /// A bool member, read as an integer (0 is false).
    pub fn flag(&self) -> Result<IntMember, TypeError> {
        match (self.plain(), self.field()) {
            (Some(Node::Bool { .. }), Some(field)) if !self.summed => Ok(IntMember {
                root: self.root,
                field,
            }),
            _ => Err(err(
                &self.path,
                format!("not a bool ({})", self.type_name()),
            )),
        }
    }

    /// The member's bytes (a char array's up to its first NUL). `None`
    /// for a bitfield, or for the value of a per-CPU map (its CPUs' bytes
    /// cannot be taken as one).
    pub fn bytes(&self) -> Option<BytesMember> {
        if self.bitfield != 0 || self.summed {
            return None;
        }
        Some(BytesMember {
            root: self.root,
            offset: self.bit_offset / 8,
            len: self.size,
            text: self.kind() == MemberKind::Text,
        })
    }
}

/// A literal as a member holds it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Literal {
    /// An integer member's value.
    Int(i128),
    /// Any other member's bytes.
    Bytes(Vec<u8>),
}

/// One entry's bytes as members read them: the key, and the value in the
/// kernel's layout (per-CPU values back to back, each `stride` bytes).
#[derive(Debug, Clone, Copy)]
pub struct EntryRef<'a> {
    /// The key.
    pub key: &'a [u8],
    /// The value, or per-CPU values back to back.
    pub value: &'a [u8],
    /// For per-CPU maps: the bytes of one CPU's value in `value`; 0
    /// otherwise.
    pub stride: usize,
}

impl<'a> EntryRef<'a> {
    /// The bytes `root` names: the key, the value (not per-CPU), or one
    /// CPU's value.
    #[inline]
    pub fn bytes(&self, root: Root) -> Option<&'a [u8]> {
        match root {
            Root::Key => Some(self.key),
            Root::Value if self.stride == 0 => Some(self.value),
            Root::Value => None,
            Root::Cpu(i) => self.value.get(i * self.stride..(i + 1) * self.stride),
        }
    }
}

/// An integer member, ready to read from entries.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct IntMember {
    root: Root,
    field: IntField,
}

impl IntMember {
    /// The integer `field` of `root` (bytes read at offsets: `key.u32(4)`).
    pub fn new(root: Root, field: IntField) -> Self {
        Self { root, field }
    }

    /// The member's value in `e` (the value of a per-CPU map: its sum over
    /// the CPUs); `None` when it cannot be read exactly.
    #[inline]
    pub fn read(&self, e: &EntryRef<'_>) -> Option<i128> {
        match self.root {
            Root::Value if e.stride != 0 => self.field.sum(e.value.chunks_exact(e.stride)),
            root => self.field.value(e.bytes(root)?),
        }
    }

    /// The integer's place and encoding in its root.
    pub fn field(&self) -> IntField {
        self.field
    }

    /// Where it lives.
    pub fn root(&self) -> Root {
        self.root
    }

    /// Whether the member is signed.
    pub fn signed(&self) -> bool {
        self.field.signed()
    }

    /// The same member in CPU `cpu`'s value.
    pub fn on_cpu(&self, cpu: usize) -> Self {
        Self {
            root: Root::Cpu(cpu),
            ..*self
        }
    }

    /// The whole value of a map whose values are untyped unsigned integers
    /// of `size` bytes (1, 2, 4 or 8).
    pub(crate) fn untyped_value(size: usize) -> Self {
        Self {
            root: Root::Value,
            field: IntField::unsigned(size),
        }
    }
}

/// A member's bytes, ready to read from entries.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BytesMember {
    root: Root,
    offset: usize,
    len: usize,
    /// A char array: up to its first NUL.
    text: bool,
}

impl BytesMember {
    /// The member's bytes in `e`.
    #[inline]
    pub fn read<'a>(&self, e: &EntryRef<'a>) -> Option<&'a [u8]> {
        let b = e
            .bytes(self.root)?
            .get(self.offset..self.offset + self.len)?;
        Some(if self.text {
            b.iter().position(|&c| c == 0).map_or(b, |n| &b[..n])
        } else {
            b
        })
    }
}

/// An integer member of a value, by path: what a watch computes deltas and
/// rates of.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Counter {
    /// Its path ("value.bytes", `"value.counters[2]"`).
    pub path: String,
    /// How it is read.
    pub int: IntMember,
}

/// Most members a value's counters cover; elements of arrays count one
/// each.
pub const MAX_COUNTERS: usize = 256;
/// Elements of one array that count (the first ones).
const MAX_COUNTED_ELEMENTS: usize = 64;

/// Adds the integer leaves of `node` (at `bit` bits into a value, named
/// `path`) to `out`: integers and integer bitfields, in records
/// (anonymous members included, as paths reach them) and in arrays (the
/// first elements). Enums, bools, chars, floats, pointers and the members
/// of named unions (two names for the same bytes) are not counters.
pub(crate) fn counters(node: &Node, path: &str, bit: usize, out: &mut Vec<Counter>) {
    if out.len() >= MAX_COUNTERS {
        return;
    }
    match node {
        Node::Int {
            size,
            signed,
            big_endian,
            ..
        } => out.push(Counter {
            path: path.to_owned(),
            int: IntMember {
                root: Root::Value,
                field: IntField::whole(bit / 8, *size, *signed, *big_endian),
            },
        }),
        Node::Rendered { node, .. } => counters(node, path, bit, out),
        Node::Record(r) if !r.union => {
            for f in &r.fields {
                let p = format!("{path}.{}", f.name);
                let at = bit + f.bit_offset;
                match (&f.node, f.bitfield_size) {
                    (_, 0) => counters(&f.node, &p, at, out),
                    (Node::Int { signed, .. }, bits) if out.len() < MAX_COUNTERS => {
                        out.push(Counter {
                            path: p,
                            int: IntMember {
                                root: Root::Value,
                                field: IntField::bitfield(at, bits, *signed),
                            },
                        });
                    }
                    _ => {}
                }
            }
        }
        Node::Array {
            element,
            element_size,
            length,
        } if !element.is_char() => {
            for i in 0..(*length).min(MAX_COUNTED_ELEMENTS) {
                counters(
                    element,
                    &format!("{path}[{i}]"),
                    bit + i * element_size * 8,
                    out,
                );
            }
        }
        _ => {}
    }
}

impl MapLayout {
    /// The member at `path` ("key.daddr", `"values[1].bytes"`). The error
    /// names the path and says what is wrong.
    pub fn member(&self, path: &str) -> Result<Member<'_>, TypeError> {
        let (root, steps) = parse(path)?;
        self.resolve(root, &steps)
    }

    /// The member `steps` below `root` name.
    pub fn resolve(&self, root: Root, steps: &[Step]) -> Result<Member<'_>, TypeError> {
        let path = root.name();
        let (layout, typed) = match root {
            Root::Key => (self.key(), self.key_typed()),
            Root::Value => (self.value(), self.typed()),
            Root::Cpu(i) => {
                let Some(cpus) = self.cpus() else {
                    return Err(err(
                        &path,
                        "the map is not per-CPU (use value, not values[i])",
                    ));
                };
                if i >= cpus {
                    return Err(err(&path, format!("the host has {cpus} possible CPUs")));
                }
                (self.value(), self.typed())
            }
        };
        let summed = root == Root::Value && self.cpus().is_some();
        if !typed {
            if let Some(step) = steps.first() {
                let what = match step {
                    Step::Member(m) => format!(".{m}"),
                    Step::Index(i) => format!("[{i}]"),
                };
                let side = if root == Root::Key { "key" } else { "value" };
                return Err(err(
                    &format!("{path}{what}"),
                    format!("the map has no types (BTF): its {side} is bytes"),
                ));
            }
            // Bytes, or their rendering.
            let node = Some(layout.root()).filter(|n| matches!(n, Node::Rendered { .. }));
            return Ok(Member {
                path,
                root,
                bit_offset: 0,
                bitfield: 0,
                size: layout.size(),
                node,
                summed,
                untyped: true,
                trail: Vec::new(),
            });
        }
        let mut m = Member {
            path,
            root,
            bit_offset: 0,
            bitfield: 0,
            size: layout.size(),
            node: Some(layout.root()),
            summed,
            untyped: false,
            trail: Vec::new(),
        };
        for step in steps {
            m.step(step)?;
        }
        Ok(m)
    }
}

impl Member<'_> {
    /// One step down: a member, or an array element.
    fn step(&mut self, step: &Step) -> Result<(), TypeError> {
        let node = self.plain().unwrap_or(&Node::Opaque { size: 0 });
        let here = self.path.clone();
        if self.bitfield != 0 {
            return Err(err(&here, "a bitfield has no members"));
        }
        match step {
            Step::Member(name) => {
                self.path = format!("{here}.{name}");
                let Node::Record(r) = node else {
                    return Err(err(
                        &self.path,
                        format!("{here} is {}, which has no members", type_name(node)),
                    ));
                };
                let Some((i, f)) = r.fields.iter().enumerate().find(|(_, f)| f.name == *name)
                else {
                    let names: Vec<&str> = r.fields.iter().map(|f| f.name.as_str()).collect();
                    return Err(err(
                        &self.path,
                        format!(
                            "no such member of {} (members: {})",
                            type_name(node),
                            names.join(", ")
                        ),
                    ));
                };
                self.bit_offset += f.bit_offset;
                self.bitfield = f.bitfield_size;
                self.size = f.size;
                self.node = Some(&f.node);
                self.trail.push(i);
            }
            Step::Index(i) => {
                self.path = format!("{here}[{i}]");
                let Node::Array {
                    element,
                    element_size,
                    length,
                } = node
                else {
                    return Err(err(
                        &self.path,
                        format!("{here} is {}, not an array", type_name(node)),
                    ));
                };
                let Some(i) = usize::try_from(*i).ok().filter(|i| i < length) else {
                    return Err(err(
                        &self.path,
                        format!("out of bounds ({} has {length} elements)", type_name(node)),
                    ));
                };
                self.bit_offset += i * element_size * 8;
                self.size = *element_size;
                self.node = Some(element);
                self.trail.push(usize::MAX);
            }
        }
        Ok(())
    }
}

/// The name of a type in messages ("u64", "__be16", "struct flow_key",
/// `"char[16]"`).
pub(crate) fn type_name(node: &Node) -> String {
    let named = |what: &str, name: &str| {
        if name.is_empty() {
            format!("anonymous {what}")
        } else {
            format!("{what} {name}")
        }
    };
    match node {
        Node::Int {
            name, size, signed, ..
        } if name.is_empty() => format!("{}{}", if *signed { "s" } else { "u" }, size * 8),
        Node::Int { name, .. } => name.clone(),
        Node::Record(r) => named(if r.union { "union" } else { "struct" }, &r.name),
        Node::Enum(e) => named("enum", &e.name),
        Node::Array {
            element, length, ..
        } => format!("{}[{length}]", type_name(element)),
        Node::Bool { .. } => "bool".into(),
        Node::Char { .. } => "char".into(),
        Node::Float { size } => format!("float{}", size * 8),
        Node::Pointer { .. } => "pointer".into(),
        Node::Opaque { size } => format!("{size} bytes"),
        Node::Rendered { node, .. } => type_name(node),
    }
}

/// The description of `node` (of `size` bytes): what a client needs to
/// decode the same bytes. Anonymous members appear flattened into their
/// records; renderings are left out.
pub(crate) fn describe(node: &Node, size: usize) -> pb::TypeInfo {
    let info = |name: &str, kind: Kind| pb::TypeInfo {
        name: name.to_owned(),
        size: size as u32,
        kind: Some(kind),
    };
    match node {
        Node::Int {
            signed,
            big_endian,
            name,
            ..
        } => info(
            name,
            Kind::Int(pb::IntType {
                signed: *signed,
                big_endian: *big_endian,
            }),
        ),
        Node::Bool { .. } => info("", Kind::Bool(pb::BoolType {})),
        Node::Char { signed } => info("char", Kind::Char(pb::CharType { signed: *signed })),
        Node::Float { .. } => info("", Kind::Float(pb::FloatType {})),
        Node::Enum(e) => info(
            &e.name,
            Kind::Enum(pb::EnumType {
                signed: e.signed,
                enumerators: e
                    .values
                    .iter()
                    .map(|(value, name)| pb::Enumerator {
                        name: name.clone(),
                        value: *value,
                    })
                    .collect(),
            }),
        ),
        Node::Record(r) => {
            let record = pb::RecordType {
                members: r
                    .fields
                    .iter()
                    .map(|f| pb::Member {
                        name: f.name.clone(),
                        bit_offset: f.bit_offset as u32,
                        bitfield_size: f.bitfield_size as u32,
                        r#type: Some(describe(&f.node, f.size)),
                    })
                    .collect(),
            };
            let kind = if r.union {
                Kind::Union(record)
            } else {
                Kind::Struct(record)
            };
            info(&r.name, kind)
        }
        Node::Array {
            element,
            element_size,
            length,
        } => info(
            "",
            Kind::Array(Box::new(pb::ArrayType {
                element: Some(Box::new(describe(element, *element_size))),
                length: *length as u32,
            })),
        ),
        Node::Pointer { .. } => info("", Kind::Pointer(pb::PointerType::default())),
        Node::Opaque { .. } => info("", Kind::Opaque(pb::OpaqueType::default())),
        Node::Rendered { node, .. } => describe(node, size),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::typed::MapShape;
    use crate::v1::{ArrayType, IntType, Member as PbMember, RecordType, TypeInfo};

    fn int(name: &str, size: u32) -> TypeInfo {
        TypeInfo {
            name: name.into(),
            size,
            kind: Some(Kind::Int(IntType::default())),
        }
    }

    fn record(name: &str, size: u32, members: Vec<(&str, u32, TypeInfo)>) -> TypeInfo {
        TypeInfo {
            name: name.into(),
            size,
            kind: Some(Kind::Struct(RecordType {
                members: members
                    .into_iter()
                    .map(|(n, off, t)| PbMember {
                        name: n.into(),
                        bit_offset: off,
                        bitfield_size: 0,
                        r#type: Some(t),
                    })
                    .collect(),
            })),
        }
    }

    #[test]
    fn paths_resolve_members_anonymous_members_and_indexes() {
        let counters = TypeInfo {
            name: String::new(),
            size: 16,
            kind: Some(Kind::Array(Box::new(ArrayType {
                element: Some(Box::new(int("__u32", 4))),
                length: 4,
            }))),
        };
        let inner = record("", 8, vec![("bytes", 0, int("__u64", 8))]);
        let value = record(
            "stats",
            24,
            vec![("", 0, inner), ("counters", 64, counters)],
        );
        let key = int("__u32", 4);
        let l = MapLayout::new(Some(&key), Some(&value), MapShape::new(4, 24)).unwrap();
        let m = l.member("value.counters[2]").unwrap();
        assert_eq!((m.bit_offset(), m.size()), (64 + 64, 4));
        assert_eq!(l.member("value.bytes").unwrap().bit_offset(), 0);
        let e = l.member("value.byts").unwrap_err();
        assert_eq!(
            e.to_string(),
            "value.byts: no such member of struct stats (members: bytes, counters)"
        );
        let e = l.member("value.counters[4]").unwrap_err().to_string();
        assert!(e.contains("out of bounds (__u32[4] has 4 elements)"), "{e}");
        let e = l.member("key.x").unwrap_err().to_string();
        assert_eq!(e, "key.x: key is __u32, which has no members");
        assert!(parse("values.x").is_err());
        assert!(parse("flow.x").is_err());
        assert!(parse("key..x").is_err());
        assert_eq!(parse("values[3].bytes").unwrap().0, Root::Cpu(3));
        let e = l.member("values[0]").unwrap_err().to_string();
        assert!(e.contains("not per-CPU"), "{e}");
    }

    #[test]
    fn untyped_maps_have_bytes_and_no_members() {
        let l = MapLayout::untyped(MapShape::new(16, 8).with_cpus(Some(2)));
        let key = l.member("key").unwrap();
        assert_eq!(
            (key.kind(), key.size(), key.typed()),
            (MemberKind::Bytes, 16, false)
        );
        let e = l.member("key.comm").unwrap_err().to_string();
        assert_eq!(e, "key.comm: the map has no types (BTF): its key is bytes");
        assert!(l.member("values[1]").is_ok());
        assert!(l.member("values[2]").is_err());
    }
}
