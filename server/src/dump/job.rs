//! A dump ready to run: its walker, its chunk sizes, its limits.

use std::{sync::Arc, time::Duration};

use bpfmap_kernel::{
    MapMeta, MapOps,
    walk::{Position, Walker},
};
use bpfmap_proto::v1 as pb;

use super::{
    DEFAULT_CHUNK_BYTES, FIRST_CHUNK_BYTES, LARGE_PIPELINE, MAX_CHUNK, PIPELINE, chunk_cap,
    kernel::{ScanReport, Source},
};
use crate::{
    cursor::Sealer,
    error::Error,
    limits::{Budget, Reservation, Slot},
    maps::Decoder,
    model::MapRef,
    query::Query,
    wire::{entry_bytes, entry_memory},
};

/// Entries per chunk, the first chunk's and every later one's: the hint
/// for both, or (hint 0) [`FIRST_CHUNK_BYTES`] then [`DEFAULT_CHUNK_BYTES`]
/// worth of entries; clamped so that a chunk stays below
/// [`super::MAX_CHUNK_BYTES`] and a dump's share holds [`PIPELINE`] chunks (at
/// least one entry).
pub(crate) fn effective_chunk(
    hint: u32,
    meta: &MapMeta,
    options: &Options,
    share: usize,
) -> ChunkSizes {
    let per_entry = per_entry(meta, options.layout, options.decoder.as_ref());
    let entries = |bytes: usize| (bytes / per_entry).clamp(1, MAX_CHUNK as usize) as u32;
    let max = entries(chunk_cap(share));
    if hint == 0 {
        let steady = entries(DEFAULT_CHUNK_BYTES).min(max);
        ChunkSizes {
            first: entries(FIRST_CHUNK_BYTES).min(steady),
            steady,
        }
    } else {
        let steady = hint.min(MAX_CHUNK).min(max);
        ChunkSizes {
            first: steady,
            steady,
        }
    }
}

/// Entries per chunk: the first chunk's, then four times more each time up
/// to `steady`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct ChunkSizes {
    /// The first chunk's.
    pub(crate) first: u32,
    /// Every chunk's once the slow start is over.
    pub(crate) steady: u32,
}

/// Bytes one entry takes while queued: in the message (in memory, or
/// encoded), or in the kernel's layout while it is read, whichever is
/// larger.
pub(super) fn per_entry(meta: &MapMeta, layout: pb::Layout, decoder: Option<&Decoder>) -> usize {
    entry_bytes(meta, layout, decoder)
        .max(entry_memory(meta, layout, decoder))
        .max(meta.key_size as usize + meta.kernel_value_size())
}

/// What a request asks of a dump.
#[derive(Debug)]
pub(crate) struct Options {
    /// How entries are laid out.
    pub(crate) layout: pb::Layout,
    /// How entries are decoded (LAYOUT_ENTRIES of a typed map).
    pub(crate) decoder: Option<Decoder>,
    /// Entries per chunk, a hint (0: the default).
    pub(crate) chunk_hint: u32,
    /// Stop after this many entries (0: no limit); with a filter, this many
    /// matching entries.
    pub(crate) limit: u64,
    /// A filter and a projection, if the request has them.
    pub(crate) query: Option<Arc<Query>>,
    /// Whether the map was walked inside the kernel (the source then holds
    /// the entries taken), and why not.
    pub(crate) scan: ScanReport,
}

/// A dump ready to run, of a map read through `M` (the kernel's map; a
/// scripted one in unit tests).
#[derive(Debug)]
pub(crate) struct DumpJob<M = Source> {
    pub(super) map: MapRef,
    pub(super) walker: Walker<M>,
    pub(super) layout: pb::Layout,
    pub(super) decoder: Option<Decoder>,
    pub(super) chunk: ChunkSizes,
    pub(super) limit: u64,
    pub(super) query: Option<Arc<Query>>,
    pub(super) sealer: Sealer,
    pub(super) slot: Option<Slot>,
    /// For entries too large for a dump's share: their memory, from the
    /// pool, for the whole dump.
    pub(super) large: Option<usize>,
    pub(super) large_memory: Option<Reservation>,
    pub(super) scan: ScanReport,
    /// What its records are (a table's schema is made from them).
    pub(super) records: Option<super::Records>,
}

impl<M: MapOps> DumpJob<M> {
    /// A dump of the map `ops` reads (named `map` in the request, described
    /// by `meta`) from `position`. FAILED_PRECONDITION when one entry is
    /// larger than the largest message the server sends.
    pub(crate) fn new(
        map: MapRef,
        ops: M,
        meta: MapMeta,
        position: Position,
        options: Options,
        sealer: Sealer,
        limits: &DumpLimits,
    ) -> Result<Self, Error> {
        let entry = entry_bytes(&meta, options.layout, options.decoder.as_ref());
        if entry > limits.max_message_bytes {
            return Err(Error::EntryTooLarge {
                map,
                bytes: entry,
                why: format!(
                    "more than the largest message this server sends ({} bytes, limits.max_message_bytes)",
                    limits.max_message_bytes
                ),
            });
        }
        let per_entry = per_entry(&meta, options.layout, options.decoder.as_ref());
        // Entries too large for a share travel one per message, with the
        // memory of LARGE_PIPELINE of them taken from the pool.
        let large = (per_entry * PIPELINE > limits.share).then_some(per_entry * LARGE_PIPELINE);
        if let Some(need) = large
            && need > limits.pool
        {
            return Err(Error::EntryTooLarge {
                map,
                bytes: entry,
                why: format!(
                    "a dump of such entries holds up to {LARGE_PIPELINE} of them ({need} bytes) and the server keeps {} bytes for large entries (a quarter of limits.max_queued_bytes); raise limits.max_queued_bytes to at least {}",
                    limits.pool,
                    need * 4
                ),
            });
        }
        let chunk = match large {
            Some(_) => ChunkSizes {
                first: 1,
                steady: 1,
            },
            None => effective_chunk(options.chunk_hint, &meta, &options, limits.share),
        };
        // Entries taken inside the kernel are walked by key, as the kernel's
        // generic batch walks them.
        let walker = if options.scan.visited.is_some() {
            Walker::by_key(ops, meta, position)
        } else {
            Walker::new(ops, meta, position)
        }
        .map_err(|e| Error::from_walk(&map, e))?;
        Ok(Self {
            map,
            walker,
            layout: options.layout,
            decoder: options.decoder,
            chunk,
            limit: options.limit,
            query: options.query,
            sealer,
            slot: None,
            large,
            large_memory: None,
            scan: options.scan,
            records: None,
        })
    }

    /// For a dump of entries too large for a share: takes their memory from
    /// the pool, waiting at most `wait` (RESOURCE_EXHAUSTED after that).
    pub(crate) async fn reserve_memory(
        &mut self,
        pool: &Budget,
        wait: Duration,
    ) -> Result<(), Error> {
        let Some(need) = self.large else {
            return Ok(());
        };
        let r = tokio::time::timeout(wait, pool.reserve(need, need))
            .await
            .map_err(|_| {
                Error::ResourceExhausted(format!(
                    "map {}'s entries are large, and the server's memory for large entries is in use (limits.max_queued_bytes); retry later",
                    self.map
                ))
            })?;
        self.large_memory = Some(r);
        Ok(())
    }

    /// Holds `slot` until the producer ends.
    pub(crate) fn with_slot(self, slot: Slot) -> Self {
        Self {
            slot: Some(slot),
            ..self
        }
    }

    /// The same, its records being `records`.
    pub(crate) fn with_records(self, records: super::Records) -> Self {
        Self {
            records: Some(records),
            ..self
        }
    }

    /// What its records are, when it was started by [`start`](super::start).
    pub(crate) fn records(&self) -> Option<&super::Records> {
        self.records.as_ref()
    }
}

/// Sizes every dump works within.
#[derive(Debug, Clone, Copy)]
pub(crate) struct DumpLimits {
    /// Each dump's share of memory for queued chunks.
    pub(crate) share: usize,
    /// The pool's size (lookups, and dumps of entries too large for a
    /// share).
    pub(crate) pool: usize,
    /// Largest message sent.
    pub(crate) max_message_bytes: usize,
}
