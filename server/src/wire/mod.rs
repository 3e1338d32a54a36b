//! What goes on the wire: the conversions between domain types and
//! `bpfmap.v1` messages that several calls share (map references, map
//! descriptions, entries and their sizes), and `feed`, the response stream
//! a task of its own feeds. A domain whose answers are its own (a watch's
//! events, a drain's chunks, an export's groups) builds those messages
//! where it computes them.

pub(crate) mod feed;

use bpfmap_kernel::{MapMeta, WalkMethod, walk::Chunk};
use bpfmap_proto::v1 as pb;

use crate::{
    error::Error,
    maps::Decoder,
    model::{Declared, InnerKey, MapName, MapRef, MapRequest, Requested},
};

/// Turns a domain value into its proto message.
pub(crate) trait IntoProto {
    type Output;
    fn into_proto(self) -> Self::Output;
}

/// About how many bytes one entry takes in a message of `layout` (the
/// fields' tags and lengths included), for sizing chunks and responses.
pub(crate) fn entry_bytes(meta: &MapMeta, layout: pb::Layout, decoder: Option<&Decoder>) -> usize {
    let data = meta.key_size as usize + meta.wire_value_size();
    let decoded = decoder.map_or(0, |d| d.extra_bytes(meta));
    match layout {
        pb::Layout::Packed => data.max(1),
        pb::Layout::Entries if meta.per_cpu() => {
            data + 8 + 4 * meta.possible_cpus as usize + decoded
        }
        pb::Layout::Entries => data + 12 + decoded,
    }
}

/// About how many bytes one entry holds in memory in a message of `layout`
/// until the transport has encoded it: in the packed layout the chunk's own
/// buffers; in the entries layout an [`pb::Entry`] each, with its key and
/// value allocated apart (the allocator's header and rounding counted), and
/// its decoded forms in one buffer for the chunk. Small entries take several
/// times their encoded size this way (a u64 -> u64 entry: 24 bytes encoded,
/// about 250 in memory), which is what a queued chunk really costs.
pub(crate) fn entry_memory(meta: &MapMeta, layout: pb::Layout, decoder: Option<&Decoder>) -> usize {
    /// What the allocator takes for `n` bytes (glibc: an 8-byte header,
    /// 16-byte granules, 32 bytes at least).
    fn heap(n: usize) -> usize {
        if n == 0 {
            0
        } else {
            (n + 8).next_multiple_of(16).max(32)
        }
    }
    let data = meta.key_size as usize + meta.wire_value_size();
    match layout {
        pb::Layout::Packed => data.max(1),
        pb::Layout::Entries => {
            let values = if meta.per_cpu() {
                let cpus = meta.possible_cpus.max(1) as usize;
                let each = meta.wire_value_size() / cpus;
                cpus * (std::mem::size_of::<Vec<u8>>() + heap(each))
            } else {
                heap(meta.wire_value_size())
            };
            std::mem::size_of::<pb::Entry>()
                + heap(meta.key_size as usize)
                + values
                + decoder.map_or(0, |d| d.extra_bytes(meta))
        }
    }
}

/// The map reference of a request, validated, with the types it declares
/// (names and inner maps are resolved later, by the catalog).
pub(crate) fn map_request(r: Option<&pb::MapRef>) -> Result<MapRequest, Error> {
    let declared = match r.and_then(|r| r.declare.as_ref()) {
        Some(d) => Declared::parse(&d.key, &d.value)
            .map_err(|e| Error::InvalidArgument(format!("map.declare: {e}")))?,
        None => Declared::default(),
    };
    Ok(MapRequest {
        map: map_ref(r)?,
        declared,
    })
}

/// The map a reference names.
fn map_ref(r: Option<&pb::MapRef>) -> Result<Requested, Error> {
    match r.and_then(|r| r.r#ref.as_ref()) {
        Some(pb::map_ref::Ref::Path(p)) => Ok(Requested::Ref(MapRef::parse(p)?)),
        Some(pb::map_ref::Ref::Id(id)) => Ok(Requested::Ref(MapRef::Id(*id))),
        Some(pb::map_ref::Ref::Name(n)) => Ok(Requested::Name(MapName::parse(n)?)),
        Some(pb::map_ref::Ref::Inner(inner)) => {
            if inner.outer.as_ref().is_some_and(|o| o.declare.is_some()) {
                return Err(Error::InvalidArgument(
                    "inner.outer.declare: declare the inner map's types on the map reference itself".into(),
                ));
            }
            let outer = map_ref(inner.outer.as_deref()).map_err(|e| match e {
                Error::InvalidArgument(m) => Error::InvalidArgument(format!("inner.outer: {m}")),
                e => e,
            })?;
            if matches!(outer, Requested::Inner { .. }) {
                return Err(Error::InvalidArgument(
                    "inner.outer names an inner map: maps of maps do not nest; name the outer map by path, id or name".into(),
                ));
            }
            let key = match (&inner.json_key, inner.key.is_empty()) {
                (Some(v), true) => InnerKey::Json(v.clone()),
                (None, false) => InnerKey::Bytes(inner.key.to_vec()),
                _ => {
                    return Err(Error::InvalidArgument(
                        "inner needs exactly one of key (the outer map's key bytes) and json_key (e.g. {\"inner\":{\"outer\":{\"path\":\"outer\"},\"jsonKey\":1}})".into(),
                    ));
                }
            };
            Ok(Requested::Inner {
                outer: Box::new(outer),
                key,
            })
        }
        None => Err(Error::InvalidArgument(
            "the request names no map: set map.path (e.g. {\"map\":{\"path\":\"demo/flows\"}}), map.id, map.name or map.inner".into(),
        )),
    }
}

/// A map as listed: how it is named, and what the kernel says of it.
impl IntoProto for (&MapRef, &MapMeta) {
    type Output = pb::MapInfo;

    fn into_proto(self) -> pb::MapInfo {
        let (map, m) = self;
        let dump_method = match m.walk_method() {
            WalkMethod::BatchBucket | WalkMethod::BatchKey => pb::DumpMethod::Batch,
            WalkMethod::KeyByKey => pb::DumpMethod::KeyByKey,
            WalkMethod::None => pb::DumpMethod::None,
        };
        pb::MapInfo {
            path: match map {
                MapRef::Path(p) => p.clone(),
                MapRef::Id(_) | MapRef::Inner { .. } => String::new(),
            },
            id: m.id,
            name: m.name.clone(),
            r#type: m.map_type.0 as i32,
            type_name: m.map_type.name().into_owned(),
            key_size: m.key_size,
            value_size: m.value_size,
            max_entries: m.max_entries,
            flags: m.flags,
            per_cpu: m.per_cpu(),
            possible_cpus: m.possible_cpus,
            btf_id: m.btf_id,
            btf_key_type_id: m.btf_key_type_id,
            btf_value_type_id: m.btf_value_type_id,
            dump_method: dump_method as i32,
            ..Default::default()
        }
    }
}

/// The outcome of looking one key up: the value in the wire layout, or
/// `None` when the key is absent.
pub(crate) struct LookupOutcome<'a> {
    pub(crate) meta: &'a MapMeta,
    pub(crate) key: Vec<u8>,
    pub(crate) value: Option<Vec<u8>>,
    pub(crate) decoder: Option<&'a Decoder>,
}

impl IntoProto for LookupOutcome<'_> {
    type Output = pb::LookupResult;

    fn into_proto(self) -> pb::LookupResult {
        let Some(value) = self.value else {
            let decoded_key = self
                .decoder
                .and_then(|d| d.decode(self.meta, &self.key, &[]).0);
            return pb::LookupResult {
                key: self.key,
                found: false,
                decoded_key,
                ..Default::default()
            };
        };
        let (decoded_key, decoded_value) = self
            .decoder
            .map_or((None, None), |d| d.decode(self.meta, &self.key, &value));
        let (value, per_cpu_values) = if self.meta.per_cpu() {
            let cpus = self.meta.split_cpus(&value).map(<[u8]>::to_vec).collect();
            (Vec::new(), cpus)
        } else {
            (value, Vec::new())
        };
        pb::LookupResult {
            key: self.key,
            found: true,
            value,
            per_cpu_values,
            decoded_key,
            decoded_value,
        }
    }
}

/// A chunk read from the kernel, with the cursor that resumes after it.
pub(crate) struct ChunkMessage<'a> {
    pub(crate) meta: &'a MapMeta,
    pub(crate) chunk: Chunk,
    pub(crate) layout: pb::Layout,
    pub(crate) decoder: Option<&'a Decoder>,
    pub(crate) cursor: String,
}

impl IntoProto for ChunkMessage<'_> {
    type Output = pb::DumpMapResponse;

    fn into_proto(self) -> pb::DumpMapResponse {
        let Self {
            meta,
            chunk: c,
            layout,
            decoder,
            cursor,
        } = self;
        let mut msg = pb::DumpMapResponse {
            cursor,
            ..Default::default()
        };
        match layout {
            pb::Layout::Entries => msg.entries = entries(meta, &c, decoder),
            pb::Layout::Packed => {
                let values = if meta.per_cpu() {
                    let mut out = Vec::with_capacity(c.count * meta.wire_value_size());
                    meta.append_wire_values(&c.values, &mut out);
                    out
                } else {
                    c.values
                };
                msg.packed = Some(pb::PackedEntries {
                    count: c.count as u32,
                    key_size: meta.key_size,
                    value_stride: meta.wire_value_size() as u32,
                    keys: c.keys.into(),
                    values: values.into(),
                    cpus: if meta.per_cpu() {
                        meta.possible_cpus
                    } else {
                        0
                    },
                });
            }
        }
        msg
    }
}

/// A chunk's entries in the entries layout. Decoded forms are written
/// straight into one buffer for the chunk (no `Value` tree per entry), and
/// each entry carries its slice of it.
pub(crate) fn entries(meta: &MapMeta, c: &Chunk, decoder: Option<&Decoder>) -> Vec<pb::Entry> {
    let ks = meta.key_size as usize;
    let kvs = meta.kernel_value_size();
    let per_cpu = meta.per_cpu();
    let mut decoded = Vec::with_capacity(decoder.map_or(0, |d| c.count * d.extra_bytes(meta)));
    let mut ends = Vec::with_capacity(c.count);
    let mut out: Vec<pb::Entry> = (0..c.count)
        .map(|i| {
            let key = c.keys[i * ks..(i + 1) * ks].to_vec();
            let kernel_value = &c.values[i * kvs..(i + 1) * kvs];
            let (value, per_cpu_values) = if per_cpu {
                let mut wire = Vec::with_capacity(meta.wire_value_size());
                meta.append_wire_values(kernel_value, &mut wire);
                if let Some(d) = decoder {
                    d.write_encoded(meta, &key, &wire, &mut decoded);
                }
                (
                    Vec::new(),
                    meta.split_cpus(&wire).map(<[u8]>::to_vec).collect(),
                )
            } else {
                if let Some(d) = decoder {
                    d.write_encoded(meta, &key, kernel_value, &mut decoded);
                }
                (kernel_value.to_vec(), Vec::new())
            };
            ends.push(decoded.len());
            pb::Entry {
                key,
                value,
                per_cpu_values,
                ..Default::default()
            }
        })
        .collect();
    let decoded = bytes::Bytes::from(decoded);
    let mut start = 0;
    for (e, end) in out.iter_mut().zip(ends) {
        e.encoded_decoded = decoded.slice(start..end);
        start = end;
    }
    out
}
