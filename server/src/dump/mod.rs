//! One DumpMap stream: a reader thread per dump, a bounded queue to the
//! client, a cursor on every chunk.
//!
//! The producer runs on a thread of the blocking pool for the whole dump: it
//! reads the next chunk from the kernel while the transport sends the ones
//! before it, with no hop between threads per chunk (a hop costs more than
//! reading a few thousand entries). It waits (for room, for the client)
//! through the runtime's handle, on its own thread.
//!
//! Memory is bounded in bytes, not messages. Every dump has a [`Share`] of
//! the daemon's memory for queued chunks, which nobody else can use. Before
//! each kernel read the producer reserves the chunk's size from it; the
//! reservation travels with the message and is given back only once the
//! transport has taken the message after it (by then the transport holds at
//! most its own send buffer of this message). Chunks are sized so that a
//! share holds a full pipeline ([`PIPELINE`] chunks); when it is full, the
//! producer waits for its client, and a client that takes nothing for the
//! stall timeout is cut off. An entry too large for a share travels alone,
//! its memory taken from the daemon's pool.
//!
//! When the client goes away, `send` fails and the producer stops before its
//! next read. A client that takes no chunk for the stall timeout, a dump that
//! held its slot too long while others waited, and every stream once the
//! shutdown grace is over get UNAVAILABLE after the chunks already queued,
//! and resume from their last cursor.

mod job;
mod kernel;
mod producer;
mod start;

use std::sync::atomic::{AtomicU64, AtomicUsize};

pub(crate) use job::{ChunkSizes, DumpJob, DumpLimits, Options};
pub(crate) use kernel::scan_method;
pub(crate) use producer::{DumpEnv, Queued, Started, Tail, reader_permits, spawn};
pub(crate) use start::{DumpCall, Dumps, POOL_WAIT, Records, records, start, start_call};

/// Messages queued between the kernel reader and the transport.
pub(crate) const CHANNEL_DEPTH: usize = 2;
/// Messages the transport has taken whose memory is still counted (it may
/// still be writing them: the HTTP/2 layer buffers a frame and up to 64 KiB
/// more per stream, the encoder's buffer holds the rest of a message).
pub(crate) const IN_TRANSPORT: usize = 3;
/// Chunks a dump can have in memory at once: queued, in the transport, and
/// the one being read.
pub(crate) const PIPELINE: usize = CHANNEL_DEPTH + IN_TRANSPORT + 1;
/// Messages a dump of large entries has in memory at once: it reads the next
/// entry only once nothing is queued (one being read, one queued), and the
/// transport holds the one it writes (its encoded copy, handed over in
/// frames) and what is left of the one before in its 64 KiB buffer.
pub(crate) const LARGE_PIPELINE: usize = 1 + 1 + 2;
/// A chunk's size when the request does not say: the largest a dump's share
/// allows (a sixth of it: 96 KiB with the default limits), up to
/// this. Large chunks cost the kernel nothing more per entry, and save the
/// hand-offs between threads and the message that every chunk costs.
pub(crate) const DEFAULT_CHUNK_BYTES: usize = 1 << 20;
/// The first chunk's size when the request does not say: small, so that the
/// first entries arrive at once; each chunk after it is four times the last one
/// until the default size (a slow start).
pub(crate) const FIRST_CHUNK_BYTES: usize = 4 << 10;
/// Upper bound on entries per chunk.
pub(crate) const MAX_CHUNK: u32 = 65_536;
/// Upper bound on a chunk's encoded size, well below grpcurl's 4 MiB default,
/// unless a single entry is larger.
pub(crate) const MAX_CHUNK_BYTES: usize = 3 << 20;

/// The most bytes of entries a chunk holds with a dump's `share`, whatever
/// chunk size its client asks for.
pub(crate) fn chunk_cap(share: usize) -> usize {
    MAX_CHUNK_BYTES.min(share / PIPELINE)
}

/// The largest chunk of a dump with `limits` (its buffers, and about the
/// size of its encoded message): the C allocator keeps buffers up to it in
/// the heap, where a dump's chunks reuse the same pages
/// ([`bpfmap_kernel::return_large_buffers_to_the_system`]).
pub(crate) fn largest_chunk(limits: &crate::config::Limits) -> usize {
    let (share, _) = crate::limits::split_memory(limits.max_queued_bytes, limits.max_dumps);
    chunk_cap(share)
}

/// Counters shared by all dumps, for tests and operators.
#[derive(Debug, Default)]
pub struct DumpStats {
    /// Dumps whose producer is running.
    pub active: AtomicUsize,
    /// Kernel chunk reads since start.
    pub chunks_read: AtomicU64,
    /// Dumps ended because they held their slot too long while others waited.
    pub slots_expired: AtomicU64,
    /// Times a walk found that the kernel had restarted it from the first
    /// key (and skipped what it had delivered).
    pub walk_restarts: AtomicU64,
    /// Entries handed to the transport.
    pub entries_sent: AtomicU64,
    /// Bytes of messages handed to the transport.
    pub bytes_sent: AtomicU64,
    /// BPF_MAP_LOOKUP_BATCH calls made.
    pub batch_calls: AtomicU64,
    /// Batch calls retried with a larger batch after ENOSPC.
    pub enospc: AtomicU64,
    /// Dumps ended because their client took no chunk for the stall timeout.
    pub stalled: AtomicU64,
}
