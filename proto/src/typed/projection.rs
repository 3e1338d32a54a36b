//! Projections: only some members of each entry, packed into records of
//! their own (a key record and a value record), whose layouts decode them
//! and whose descriptions let a client decode them the same way.
//!
//! A selected member keeps its type (and, in a call's layout, its
//! rendering); the whole key or value of a map without types is bytes
//! (shown in hex unless rendered); a bitfield becomes an integer of the
//! next size up; a member
//! of a per-CPU value (`value.x`) is summed over the CPUs into a 128-bit
//! integer. Members are named by their path below their root ("daddr" for
//! "key.daddr"); a whole key or value, or one CPU's value, keeps its full
//! path ("key", `"values[1].bytes"`).

use std::collections::HashSet;

use super::{
    Counter, EntryRef, FieldKey, IntField, IntMember, Layout, MapLayout, Member, Node, Root,
    TypeError, member,
};
use crate::v1::TypeInfo;

/// Most members one projection selects.
pub const MAX_FIELDS: usize = 64;

/// Why members cannot be selected.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ProjectionError {
    /// More than [`MAX_FIELDS`] members.
    #[error("at most {MAX_FIELDS} fields")]
    TooMany,
    /// A member given twice.
    #[error("{0}: given twice")]
    Twice(String),
    /// A member that cannot be selected.
    #[error(transparent)]
    Member(#[from] TypeError),
}

/// Members selected from a map's entries.
#[derive(Debug, Clone)]
pub struct Projection {
    key: Vec<Part>,
    value: Vec<Part>,
    /// The records' layouts (not per-CPU).
    layout: MapLayout,
}

/// One selected member: where it is read and where it goes.
#[derive(Debug, Clone)]
struct Part {
    /// Its path as given ("key.daddr").
    path: String,
    read: Read,
    /// Its type in the record.
    node: Node,
    /// Its offset and size in the record.
    out: usize,
    out_size: usize,
}

#[derive(Debug, Clone)]
enum Read {
    /// `len` bytes at `offset` of `root`.
    Bytes {
        root: Root,
        offset: usize,
        len: usize,
    },
    /// An integer (a bitfield, or a sum over the CPUs), written
    /// little-endian.
    Int(IntMember),
}

/// Where a selected member is read ([`Projection::places`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Source {
    /// `len` bytes at `offset` of `root`, copied.
    Bytes {
        root: Root,
        offset: usize,
        len: usize,
    },
    /// An integer, written little-endian in its place's size.
    Int(IntMember),
}

impl Projection {
    /// Resolves `fields` ("key.daddr", "value.bytes") in `layout`. The
    /// error names the field that cannot be selected.
    pub fn new(fields: &[String], layout: &MapLayout) -> Result<Self, ProjectionError> {
        if fields.len() > MAX_FIELDS {
            return Err(ProjectionError::TooMany);
        }
        let (mut key, mut value) = (Vec::new(), Vec::new());
        let mut seen = HashSet::new();
        for f in fields {
            if !seen.insert(f.as_str()) {
                return Err(ProjectionError::Twice(f.clone()));
            }
            let m = layout.member(f)?;
            let parts = if m.root() == Root::Key {
                &mut key
            } else {
                &mut value
            };
            let out = parts.last().map_or(0, |p: &Part| p.out + p.out_size);
            parts.push(Part::of(&m, out)?);
        }
        let layout = MapLayout::of_records(record("key", &key), record("value", &value));
        Ok(Self { key, value, layout })
    }

    /// The records' layouts: key and value, not per-CPU (a side without
    /// selected members is an empty record).
    pub fn layout(&self) -> &MapLayout {
        &self.layout
    }

    /// The key record's description; `None` when no key member is
    /// selected (the records then have no key bytes).
    pub fn key_type(&self) -> Option<TypeInfo> {
        (!self.key.is_empty()).then(|| self.layout.key().describe())
    }

    /// The value record's description; `None` when no value member is
    /// selected.
    pub fn value_type(&self) -> Option<TypeInfo> {
        (!self.value.is_empty()).then(|| self.layout.value().describe())
    }

    /// Size of a key record.
    pub fn key_size(&self) -> usize {
        self.layout.key().size()
    }

    /// The path given for the key's (else the value's) record member
    /// `name`: `key.key` for a member named `key`, `key` for the whole key.
    pub fn member_path(&self, value: bool, name: &str) -> Option<&str> {
        let parts = if value { &self.value } else { &self.key };
        parts
            .iter()
            .find(|p| p.name() == name)
            .map(|p| p.path.as_str())
    }

    /// Size of a value record.
    pub fn value_size(&self) -> usize {
        self.layout.value().size()
    }

    /// Whether a key member is selected.
    pub fn selects_key(&self) -> bool {
        !self.key.is_empty()
    }

    /// Appends the key record and the value record of `e` to `keys` and
    /// `values`.
    pub fn write(&self, e: &EntryRef<'_>, keys: &mut Vec<u8>, values: &mut Vec<u8>) {
        for (parts, out, size) in [
            (&self.key, keys, self.key_size()),
            (&self.value, values, self.value_size()),
        ] {
            let start = out.len();
            out.resize(start + size, 0);
            let record = &mut out[start..];
            for p in parts {
                p.write(e, &mut record[p.out..p.out + p.out_size]);
            }
        }
    }

    /// Where each selected member is read and where its bytes go in the
    /// key record and the value record back to back (a group key): for
    /// code that builds the records elsewhere, such as a scan in the
    /// kernel. (source, offset, size).
    pub fn places(&self) -> Vec<(Source, usize, usize)> {
        let key = self.key.iter().map(|p| (p, p.out));
        let value = self.value.iter().map(|p| (p, self.key_size() + p.out));
        key.chain(value)
            .map(|(p, out)| {
                let source = match &p.read {
                    Read::Bytes { root, offset, len } => Source::Bytes {
                        root: *root,
                        offset: *offset,
                        len: *len,
                    },
                    Read::Int(int) => Source::Int(*int),
                };
                (source, out, p.out_size)
            })
            .collect()
    }

    /// The renderings the selected members keep, by their paths in the
    /// records ("key.daddr"; a whole key is "key.key").
    pub fn renderings(&self) -> std::collections::BTreeMap<String, String> {
        let key = self.key.iter().map(|p| ("key", p));
        let value = self.value.iter().map(|p| ("value", p));
        key.chain(value)
            .filter_map(|(root, p)| match &p.node {
                Node::Rendered { how, .. } => {
                    Some((format!("{root}.{}", p.name()), how.name().to_owned()))
                }
                _ => None,
            })
            .collect()
    }

    /// The integer members of the value record, named by their paths in
    /// the entries ("value.bytes", `"values[0].bytes"`), read from value
    /// records: what a watch of a projection computes deltas of.
    pub fn counters(&self) -> Vec<Counter> {
        let mut out = Vec::new();
        for p in &self.value {
            member::counters(&p.node, &p.path, p.out * 8, &mut out);
        }
        out
    }
}

impl Part {
    /// How `m` is read and what it becomes at `out` in its record.
    fn of(m: &Member<'_>, out: usize) -> Result<Self, TypeError> {
        // The bytes of an untyped key or value (unless rendered) are
        // opaque: shown in hex.
        let opaque = Node::Opaque { size: m.size() };
        let node = m.node().unwrap_or(&opaque);
        let (read, node, out_size) = if m.summed() {
            // Summed over the CPUs: a 128-bit integer.
            let int = m.int()?;
            (Read::Int(int), int_node(16, int.signed()), 16)
        } else if let Some(bits) = m.bitfield() {
            let int = m.int().or_else(|_| m.flag())?;
            let size = match bits {
                0..=8 => 1,
                9..=16 => 2,
                17..=32 => 4,
                33..=64 => 8,
                _ => 16,
            };
            let node = match node {
                Node::Enum(e) => Node::Enum(super::EnumNode { size, ..e.clone() }),
                _ => int_node(size, int.signed()),
            };
            (Read::Int(int), node, size)
        } else {
            let read = Read::Bytes {
                root: m.root(),
                offset: m.bit_offset() / 8,
                len: m.size(),
            };
            (read, node.clone(), m.size())
        };
        Ok(Self {
            path: m.path().to_owned(),
            read,
            node,
            out,
            out_size,
        })
    }

    fn write(&self, e: &EntryRef<'_>, dst: &mut [u8]) {
        match &self.read {
            Read::Bytes { root, offset, len } => {
                if let Some(src) = e.bytes(*root).and_then(|b| b.get(*offset..offset + len)) {
                    dst.copy_from_slice(src);
                }
            }
            Read::Int(int) => {
                if let Some(v) = int.read(e) {
                    IntField::whole(0, dst.len(), true, false).write(dst, v as u128);
                }
            }
        }
    }

    /// Its name in the record: its path below its root, or its full path
    /// for a whole key or value and for one CPU's value.
    fn name(&self) -> &str {
        ["key.", "value."]
            .iter()
            .find_map(|p| self.path.strip_prefix(p))
            .unwrap_or(&self.path)
    }
}

fn int_node(size: usize, signed: bool) -> Node {
    Node::Int {
        size,
        signed,
        big_endian: false,
        name: String::new(),
    }
}

/// The record of `parts`, named `name`.
fn record(name: &str, parts: &[Part]) -> Layout {
    let size = parts.last().map_or(0, |p| p.out + p.out_size);
    let fields = parts
        .iter()
        .map(|p| super::Field {
            name: p.name().to_owned(),
            key: FieldKey::new(p.name()),
            bit_offset: p.out * 8,
            bitfield_size: 0,
            node: p.node.clone(),
            size: p.out_size,
        })
        .collect();
    let node = Node::Record(super::RecordNode {
        union: false,
        name: name.to_owned(),
        size,
        fields,
    });
    Layout::of_node(node, size, name.to_owned())
}
