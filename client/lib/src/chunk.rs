//! A dump's chunks, read in place: entries are views into the message that
//! carried them, with no allocation or copy per entry.

use std::{fmt, iter::FusedIterator};

use bytes::Bytes;

use crate::{Error, pb};

/// One chunk of a dump: its entries, read in place from the message that
/// carried them, and the cursor that resumes the dump right after it.
///
/// Iterating `&chunk` gives [`EntryRef`]s (borrowed, nothing allocated);
/// iterating `chunk` by value gives owned [`Entry`]s.
#[derive(Clone)]
pub struct Chunk {
    data: Data,
    cursor: String,
}

#[derive(Clone)]
enum Data {
    Packed {
        count: usize,
        key_size: usize,
        stride: usize,
        /// The size of one CPU's value (stride / cpus), worked out once;
        /// 0 for maps that are not per-CPU.
        per_cpu: usize,
        keys: Bytes,
        values: Bytes,
    },
    Entries(Vec<pb::Entry>),
}

impl Chunk {
    /// A packed chunk's records as they lie, for a table's columns.
    #[cfg(feature = "arrow")]
    pub(crate) fn packed(&self) -> Option<bpfmap_proto::typed::arrow::Packed<'_>> {
        match &self.data {
            Data::Packed {
                count,
                key_size,
                stride,
                per_cpu,
                keys,
                values,
            } => Some(bpfmap_proto::typed::arrow::Packed {
                keys,
                key_size: *key_size,
                values,
                value_stride: *stride,
                cpu_stride: *per_cpu,
                count: *count,
            }),
            Data::Entries(_) => None,
        }
    }

    /// The chunk of a `DumpMapResponse`'s entries (either layout); a packed
    /// chunk whose sizes do not add up is a protocol error.
    pub(crate) fn new(
        entries: Vec<pb::Entry>,
        packed: Option<pb::PackedEntries>,
        cursor: String,
    ) -> Result<Self, Error> {
        let Some(p) = packed else {
            return Ok(Self {
                data: Data::Entries(entries),
                cursor,
            });
        };
        let (count, key_size, stride, cpus) = (
            p.count as usize,
            p.key_size as usize,
            p.value_stride as usize,
            p.cpus as usize,
        );
        if Some(p.keys.len()) != count.checked_mul(key_size)
            || Some(p.values.len()) != count.checked_mul(stride)
        {
            return Err(Error::Protocol(format!(
                "packed chunk of {count} entries has {} key bytes and {} value bytes",
                p.keys.len(),
                p.values.len()
            )));
        }
        if cpus > 0 && (stride == 0 || stride % cpus != 0) {
            return Err(Error::Protocol(format!(
                "packed value stride {stride} is not a multiple of {cpus} CPUs"
            )));
        }
        Ok(Self {
            data: Data::Packed {
                count,
                key_size,
                stride,
                per_cpu: stride.checked_div(cpus).unwrap_or(0),
                keys: p.keys,
                values: p.values,
            },
            cursor,
        })
    }

    /// The chunk a `DumpMapResponse` carries (either layout), as read from
    /// the daemon or a relay; a packed chunk whose sizes do not add up is
    /// [`Error::Protocol`].
    pub fn from_proto(msg: pb::DumpMapResponse) -> Result<Self, Error> {
        Self::new(msg.entries, msg.packed, msg.cursor)
    }

    /// The chunk as a `DumpMapResponse` carries it (its entries in the
    /// layout they came in, and its cursor; no summary or projection), for
    /// a program that forwards it.
    pub fn into_proto(self) -> pb::DumpMapResponse {
        let mut msg = pb::DumpMapResponse {
            cursor: self.cursor,
            ..Default::default()
        };
        match self.data {
            Data::Entries(entries) => msg.entries = entries,
            Data::Packed {
                count,
                key_size,
                stride,
                per_cpu,
                keys,
                values,
            } => {
                msg.packed = Some(pb::PackedEntries {
                    count: count as u32,
                    key_size: key_size as u32,
                    value_stride: stride as u32,
                    keys,
                    values,
                    cpus: stride.checked_div(per_cpu).unwrap_or(0) as u32,
                });
            }
        }
        msg
    }

    /// The number of entries.
    pub fn len(&self) -> usize {
        match &self.data {
            Data::Packed { count, .. } => *count,
            Data::Entries(e) => e.len(),
        }
    }

    /// Whether the chunk has no entries.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The cursor that resumes the dump right after this chunk.
    pub fn cursor(&self) -> &str {
        &self.cursor
    }

    /// Entry `i`, if there is one.
    #[inline]
    pub fn get(&self, i: usize) -> Option<EntryRef<'_>> {
        match &self.data {
            Data::Packed {
                count,
                key_size,
                stride,
                per_cpu,
                keys,
                values,
            } => (i < *count).then(|| {
                let raw = &values[i * stride..(i + 1) * stride];
                EntryRef {
                    key: &keys[i * key_size..(i + 1) * key_size],
                    value: match *per_cpu {
                        0 => ValueRef::Single(raw),
                        one => ValueRef::PerCpu(PerCpuValues(PerCpu::Packed { raw, one })),
                    },
                }
            }),
            Data::Entries(e) => e.get(i).map(|e| EntryRef {
                key: &e.key,
                value: if e.per_cpu_values.is_empty() {
                    ValueRef::Single(&e.value)
                } else {
                    ValueRef::PerCpu(PerCpuValues(PerCpu::Split(&e.per_cpu_values)))
                },
            }),
        }
    }

    /// Entry `i`'s key as the daemon decoded it: only in the entries layout
    /// when the daemon decodes, that is with renderings
    /// ([`DumpOptions::with_render`](crate::DumpOptions::with_render) and
    /// `with_packed(false)`), for a map with types; `None` otherwise
    /// (packed entries are decoded with [`MapTypes`](crate::MapTypes)).
    pub fn decoded_key(&self, i: usize) -> Option<&prost_types::Value> {
        match &self.data {
            Data::Entries(e) => e.get(i)?.decoded_key.as_ref(),
            Data::Packed { .. } => None,
        }
    }

    /// Entry `i`'s value as the daemon decoded it (per-CPU values as a
    /// list), when [`decoded_key`](Self::decoded_key) says it does.
    pub fn decoded_value(&self, i: usize) -> Option<&prost_types::Value> {
        match &self.data {
            Data::Entries(e) => e.get(i)?.decoded_value.as_ref(),
            Data::Packed { .. } => None,
        }
    }

    /// The first entry, if any.
    pub fn first(&self) -> Option<EntryRef<'_>> {
        self.get(0)
    }

    /// The last entry, if any.
    pub fn last(&self) -> Option<EntryRef<'_>> {
        self.len().checked_sub(1).and_then(|i| self.get(i))
    }

    /// The entries, borrowed.
    pub fn iter(&self) -> Iter<'_> {
        Iter {
            chunk: self,
            next: 0,
        }
    }

    /// The entries, copied out.
    pub fn to_entries(&self) -> Vec<Entry> {
        self.iter().map(|e| e.to_entry()).collect()
    }
}

impl fmt::Debug for Chunk {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Chunk")
            .field("entries", &self.iter().collect::<Vec<_>>())
            .field("cursor", &self.cursor)
            .finish()
    }
}

/// Same entries, same cursor (whichever layout carried them).
impl PartialEq for Chunk {
    fn eq(&self, other: &Self) -> bool {
        self.cursor == other.cursor && self.iter().eq(other.iter())
    }
}

impl Eq for Chunk {}

impl<'a> IntoIterator for &'a Chunk {
    type Item = EntryRef<'a>;
    type IntoIter = Iter<'a>;

    fn into_iter(self) -> Iter<'a> {
        self.iter()
    }
}

/// Owned entries: each key and value is copied out of the chunk (moved,
/// for the entries layout).
impl IntoIterator for Chunk {
    type Item = Entry;
    type IntoIter = std::vec::IntoIter<Entry>;

    fn into_iter(self) -> Self::IntoIter {
        match self.data {
            Data::Entries(e) => e
                .into_iter()
                .map(|e| Entry {
                    key: e.key,
                    value: if e.per_cpu_values.is_empty() {
                        Value::Single(e.value)
                    } else {
                        Value::PerCpu(e.per_cpu_values)
                    },
                })
                .collect::<Vec<_>>()
                .into_iter(),
            Data::Packed { .. } => self.to_entries().into_iter(),
        }
    }
}

/// A map value.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Value {
    /// The value of a map that is not per-CPU.
    Single(Vec<u8>),
    /// One value per possible CPU, in CPU order.
    PerCpu(Vec<Vec<u8>>),
}

impl Value {
    /// The value, borrowed.
    pub fn view(&self) -> ValueRef<'_> {
        match self {
            Self::Single(v) => ValueRef::Single(v),
            Self::PerCpu(v) => ValueRef::PerCpu(PerCpuValues::from_slices(v)),
        }
    }
}

/// One entry of a map, owned (a [`Chunk`] lends [`EntryRef`]s without
/// copying).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Entry {
    /// The key, `key_size` bytes.
    pub key: Vec<u8>,
    /// The value.
    pub value: Value,
}

impl Entry {
    /// The entry, borrowed.
    pub fn view(&self) -> EntryRef<'_> {
        EntryRef {
            key: &self.key,
            value: self.value.view(),
        }
    }
}

/// The entries of a [`Chunk`], borrowed.
#[derive(Debug, Clone)]
pub struct Iter<'a> {
    chunk: &'a Chunk,
    next: usize,
}

impl<'a> Iterator for Iter<'a> {
    type Item = EntryRef<'a>;

    #[inline]
    fn next(&mut self) -> Option<EntryRef<'a>> {
        let e = self.chunk.get(self.next)?;
        self.next += 1;
        Some(e)
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        let n = self.chunk.len().saturating_sub(self.next);
        (n, Some(n))
    }
}

impl ExactSizeIterator for Iter<'_> {}
impl FusedIterator for Iter<'_> {}

/// One entry of a map, borrowed from a [`Chunk`] (or from an [`Entry`]:
/// [`Entry::view`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EntryRef<'a> {
    /// The key, `key_size` bytes.
    pub key: &'a [u8],
    /// The value.
    pub value: ValueRef<'a>,
}

impl EntryRef<'_> {
    /// The entry, copied out.
    pub fn to_entry(&self) -> Entry {
        Entry {
            key: self.key.to_vec(),
            value: self.value.to_value(),
        }
    }
}

/// A map value, borrowed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ValueRef<'a> {
    /// The value of a map that is not per-CPU.
    Single(&'a [u8]),
    /// One value per possible CPU, in CPU order.
    PerCpu(PerCpuValues<'a>),
}

impl ValueRef<'_> {
    /// The value, copied out.
    pub fn to_value(&self) -> Value {
        match self {
            Self::Single(v) => Value::Single(v.to_vec()),
            Self::PerCpu(v) => Value::PerCpu(v.iter().map(<[u8]>::to_vec).collect()),
        }
    }
}

/// The values of a per-CPU map's entry, one per possible CPU, borrowed.
#[derive(Clone, Copy)]
pub struct PerCpuValues<'a>(PerCpu<'a>);

#[derive(Clone, Copy)]
enum PerCpu<'a> {
    /// Back to back, `one` bytes each (`one` > 0).
    Packed {
        raw: &'a [u8],
        one: usize,
    },
    Split(&'a [Vec<u8>]),
}

impl<'a> PerCpuValues<'a> {
    /// Values given one per CPU.
    pub fn from_slices(values: &'a [Vec<u8>]) -> Self {
        Self(PerCpu::Split(values))
    }

    /// The number of CPUs.
    pub fn len(&self) -> usize {
        match self.0 {
            PerCpu::Packed { raw, one } => raw.len() / one,
            PerCpu::Split(v) => v.len(),
        }
    }

    /// Whether there is no value.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// CPU `cpu`'s value.
    pub fn get(&self, cpu: usize) -> Option<&'a [u8]> {
        match self.0 {
            PerCpu::Packed { raw, one } => raw.get(cpu * one..(cpu + 1) * one),
            PerCpu::Split(v) => v.get(cpu).map(Vec::as_slice),
        }
    }

    /// The values in CPU order.
    pub fn iter(&self) -> PerCpuIter<'a> {
        PerCpuIter {
            values: *self,
            next: 0,
        }
    }
}

impl fmt::Debug for PerCpuValues<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_list().entries(self.iter()).finish()
    }
}

impl PartialEq for PerCpuValues<'_> {
    fn eq(&self, other: &Self) -> bool {
        self.iter().eq(other.iter())
    }
}

impl Eq for PerCpuValues<'_> {}

impl<'a> IntoIterator for PerCpuValues<'a> {
    type Item = &'a [u8];
    type IntoIter = PerCpuIter<'a>;

    fn into_iter(self) -> PerCpuIter<'a> {
        self.iter()
    }
}

/// The values of a [`PerCpuValues`], in CPU order.
#[derive(Debug, Clone)]
pub struct PerCpuIter<'a> {
    values: PerCpuValues<'a>,
    next: usize,
}

impl<'a> Iterator for PerCpuIter<'a> {
    type Item = &'a [u8];

    fn next(&mut self) -> Option<&'a [u8]> {
        let v = self.values.get(self.next)?;
        self.next += 1;
        Some(v)
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        let n = self.values.len().saturating_sub(self.next);
        (n, Some(n))
    }
}

impl ExactSizeIterator for PerCpuIter<'_> {}
impl FusedIterator for PerCpuIter<'_> {}

#[cfg(test)]
mod tests {
    use super::*;

    fn packed(
        count: u32,
        key_size: u32,
        stride: u32,
        cpus: u32,
        keys: &[u8],
        values: &[u8],
    ) -> pb::PackedEntries {
        pb::PackedEntries {
            count,
            key_size,
            value_stride: stride,
            keys: Bytes::copy_from_slice(keys),
            values: Bytes::copy_from_slice(values),
            cpus,
        }
    }

    #[test]
    fn packed_and_entries_layouts_give_the_same_entries() {
        // Two entries of a per-CPU map with 2 CPUs, 2-byte values.
        let p = packed(2, 1, 4, 2, &[7, 9], &[1, 0, 2, 0, 3, 0, 4, 0]);
        let a = Chunk::new(Vec::new(), Some(p), "c".into()).unwrap();
        let e = vec![
            pb::Entry {
                key: vec![7],
                per_cpu_values: vec![vec![1, 0], vec![2, 0]],
                ..Default::default()
            },
            pb::Entry {
                key: vec![9],
                per_cpu_values: vec![vec![3, 0], vec![4, 0]],
                ..Default::default()
            },
        ];
        let b = Chunk::new(e, None, "c".into()).unwrap();
        assert_eq!(a, b);
        assert_eq!(a.len(), 2);
        let first = a.get(0).unwrap();
        assert_eq!(first.key, &[7]);
        let ValueRef::PerCpu(v) = first.value else {
            panic!("per-CPU")
        };
        assert_eq!(v.iter().collect::<Vec<_>>(), vec![&[1u8, 0][..], &[2, 0]]);
        assert_eq!(v.get(2), None);
        assert!(a.get(2).is_none());
        let owned: Vec<Entry> = a.into_iter().collect();
        assert_eq!(owned, b.clone().into_iter().collect::<Vec<_>>());
        assert_eq!(
            owned[1],
            Entry {
                key: vec![9],
                value: Value::PerCpu(vec![vec![3, 0], vec![4, 0]])
            }
        );
        assert_eq!(owned[1].view(), b.get(1).unwrap());
    }

    #[test]
    fn single_values_and_a_different_cursor() {
        let a = Chunk::new(
            Vec::new(),
            Some(packed(1, 2, 1, 0, &[1, 2], &[3])),
            "x".into(),
        )
        .unwrap();
        assert_eq!(
            a.iter().next(),
            Some(EntryRef {
                key: &[1, 2],
                value: ValueRef::Single(&[3])
            })
        );
        let b = Chunk::new(
            Vec::new(),
            Some(packed(1, 2, 1, 0, &[1, 2], &[3])),
            "y".into(),
        )
        .unwrap();
        assert_ne!(a, b, "same entries, another cursor");
        assert_eq!(a.iter().len(), 1);
    }

    #[test]
    fn sizes_that_do_not_add_up_are_protocol_errors() {
        for (p, says) in [
            (packed(2, 2, 1, 0, &[1, 2, 3], &[1, 2]), "3 key bytes"),
            (
                packed(1, 1, 3, 2, &[1], &[1, 2, 3]),
                "not a multiple of 2 CPUs",
            ),
            (packed(1, 1, 0, 2, &[1], &[]), "not a multiple of 2 CPUs"),
            (packed(u32::MAX, u32::MAX, 1, 0, &[], &[]), "0 key bytes"),
        ] {
            match Chunk::new(Vec::new(), Some(p), String::new()) {
                Err(Error::Protocol(m)) => assert!(m.contains(says), "{m}"),
                other => panic!("{other:?}"),
            }
        }
    }
}
