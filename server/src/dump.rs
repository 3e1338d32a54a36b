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
#![forbid(unsafe_code)]

use std::{
    collections::VecDeque,
    future::Future as _,
    pin::Pin,
    sync::{
        Arc,
        atomic::{AtomicU64, AtomicUsize, Ordering},
    },
    task::{Context, Poll},
    time::{Duration, Instant},
};

use bpfmap_proto::v1 as pb;
use futures::Stream;
use tokio::sync::{mpsc, oneshot, watch};
use tonic::Status;

use crate::{
    audit,
    catalog::MapRef,
    cursor::Sealer,
    error::Error,
    kernel::{
        MapHandle, MapMeta,
        walk::{Chunk, Position, WalkError, Walker},
    },
    limits::{Budget, BusyToken, DumpSlots, Reservation, Share, Slot},
    proto::{self, ChunkMessage, IntoProto as _},
    typed::Decoder,
};

/// Messages queued between the kernel reader and the transport.
pub const CHANNEL_DEPTH: usize = 2;
/// Messages the transport has taken whose memory is still counted (it may
/// still be writing them).
pub const IN_TRANSPORT: usize = 2;
/// Chunks a dump can have in memory at once: queued, in the transport, and
/// the one being read.
pub const PIPELINE: usize = CHANNEL_DEPTH + IN_TRANSPORT + 1;
/// Messages a dump of large entries has in memory at once: it reads the next
/// entry only once nothing is queued.
pub const LARGE_PIPELINE: usize = 1 + 1 + IN_TRANSPORT;
/// A chunk's size when the request does not say: the largest a dump's share
/// allows (a fifth of it: about 115 KiB with the default limits), up to
/// this. Large chunks cost the kernel nothing more per entry, and save the
/// hand-offs between threads and the message that every chunk costs.
pub const DEFAULT_CHUNK_BYTES: usize = 1 << 20;
/// The first chunk's size when the request does not say: small, so that the
/// first entries arrive at once; each chunk after it is four times the last one
/// until the default size (a slow start).
pub const FIRST_CHUNK_BYTES: usize = 4 << 10;
/// Upper bound on entries per chunk.
pub const MAX_CHUNK: u32 = 65_536;
/// Upper bound on a chunk's encoded size, well below grpcurl's 4 MiB default,
/// unless a single entry is larger.
pub const MAX_CHUNK_BYTES: usize = 3 << 20;

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

/// Entries per chunk, the first chunk's and every later one's: the hint
/// for both, or (hint 0) [`FIRST_CHUNK_BYTES`] then [`DEFAULT_CHUNK_BYTES`]
/// worth of entries; clamped so that a chunk stays below
/// [`MAX_CHUNK_BYTES`] and a dump's share holds [`PIPELINE`] chunks (at
/// least one entry).
pub fn effective_chunk(hint: u32, meta: &MapMeta, options: &Options, share: usize) -> ChunkSizes {
    let per_entry = per_entry(meta, options.layout, options.decoder.as_ref());
    let entries = |bytes: usize| (bytes / per_entry).clamp(1, MAX_CHUNK as usize) as u32;
    let max = entries(MAX_CHUNK_BYTES.min(share / PIPELINE));
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
pub struct ChunkSizes {
    /// The first chunk's.
    pub first: u32,
    /// Every chunk's once the slow start is over.
    pub steady: u32,
}

/// Bytes one entry takes while queued: in the message, or in the kernel's
/// layout while it is read, whichever is larger.
fn per_entry(meta: &MapMeta, layout: pb::Layout, decoder: Option<&Decoder>) -> usize {
    proto::entry_bytes(meta, layout, decoder).max(meta.key_size as usize + meta.kernel_value_size())
}

/// What a request asks of a dump.
#[derive(Debug, Clone)]
pub struct Options {
    /// How entries are laid out.
    pub layout: pb::Layout,
    /// How entries are decoded (LAYOUT_ENTRIES of a typed map).
    pub decoder: Option<Decoder>,
    /// Entries per chunk, a hint (0: the default).
    pub chunk_hint: u32,
    /// Stop after this many entries (0: no limit).
    pub limit: u64,
}

/// A dump ready to run.
#[derive(Debug)]
pub struct DumpJob {
    map: MapRef,
    walker: Walker<MapHandle>,
    layout: pb::Layout,
    decoder: Option<Decoder>,
    chunk: ChunkSizes,
    limit: u64,
    sealer: Sealer,
    slot: Option<Slot>,
    /// For entries too large for a dump's share: their memory, from the
    /// pool, for the whole dump.
    large: Option<usize>,
    large_memory: Option<Reservation>,
}

impl DumpJob {
    /// A dump of `handle` (named `map` in the request) from `position`.
    /// FAILED_PRECONDITION when one entry is larger than the largest message
    /// the server sends.
    pub fn new(
        map: MapRef,
        handle: MapHandle,
        position: Position,
        options: Options,
        sealer: Sealer,
        limits: &DumpLimits,
    ) -> Result<Self, Error> {
        let meta = handle.meta().clone();
        let entry = proto::entry_bytes(&meta, options.layout, options.decoder.as_ref());
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
        let walker = Walker::new(handle, meta, position).map_err(|e| Error::from_walk(&map, e))?;
        Ok(Self {
            map,
            walker,
            layout: options.layout,
            decoder: options.decoder,
            chunk,
            limit: options.limit,
            sealer,
            slot: None,
            large,
            large_memory: None,
        })
    }

    /// For a dump of entries too large for a share: takes their memory from
    /// the pool, waiting at most `wait` (RESOURCE_EXHAUSTED after that).
    pub async fn reserve_memory(&mut self, pool: &Budget, wait: Duration) -> Result<(), Error> {
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
    pub fn with_slot(self, slot: Slot) -> Self {
        Self {
            slot: Some(slot),
            ..self
        }
    }
}

/// Sizes every dump works within.
#[derive(Debug, Clone, Copy)]
pub struct DumpLimits {
    /// Each dump's share of memory for queued chunks.
    pub share: usize,
    /// The pool's size (lookups, and dumps of entries too large for a
    /// share).
    pub pool: usize,
    /// Largest message sent.
    pub max_message_bytes: usize,
}

/// What every dump shares.
#[derive(Debug, Clone)]
pub struct DumpEnv {
    /// Becomes true when dumps in flight must end (after the shutdown grace).
    pub stop: watch::Receiver<bool>,
    /// Shared counters.
    pub stats: Arc<DumpStats>,
    /// End the stream when the client takes no chunk for this long.
    pub stall_timeout: Duration,
    /// Each dump's share of memory, and the largest message.
    pub limits: DumpLimits,
    /// The dump slots (to know when a slot is wanted by others).
    pub slots: Arc<DumpSlots>,
    /// How long a dump may hold its slot while others wait.
    pub max_slot_hold: Duration,
}

type Item = Result<pb::DumpMapResponse, Status>;
type Queued = (Item, Option<Reservation>);

/// Starts the producer and returns the response stream: the chunks, then
/// (when the dump ends in an error) the error status. The stream finishes
/// the call's audit record.
pub fn spawn(job: DumpJob, audit: audit::Record, env: DumpEnv) -> DumpStream {
    let (tx, rx) = mpsc::channel(CHANNEL_DEPTH);
    let (tail_tx, tail_rx) = oneshot::channel::<Status>();
    let started = audit.started();
    let share = Share::new(env.limits.share);
    let producer_share = share.clone();
    let stats = env.stats.clone();
    let producer_stats = stats.clone();
    let runtime = tokio::runtime::Handle::current();
    tokio::task::spawn_blocking(move || {
        if let Err(e) = runtime.block_on(run(job, started, &tx, &producer_share, env)) {
            if matches!(e, Error::Stalled { .. }) {
                producer_stats.stalled.fetch_add(1, Ordering::Relaxed);
            }
            // Delivered after the chunks already queued, even when the
            // channel is full (a client that stopped reading).
            let _ = tail_tx.send(e.into());
        }
    });
    DumpStream {
        rx,
        tail: Some(tail_rx),
        audit: Some(audit),
        ended: None,
        held: VecDeque::new(),
        busy: None,
        share,
        stats,
    }
}

/// Runs a dump until the map ends, the limit is reached, the client leaves,
/// stalls, the slot expires, or the server stops. A client that left is not
/// an error. Runs on a thread where blocking is allowed: it reads the kernel
/// in place.
async fn run(
    job: DumpJob,
    started: Instant,
    tx: &mpsc::Sender<Queued>,
    share: &Arc<Share>,
    mut env: DumpEnv,
) -> Result<(), Error> {
    env.stats.active.fetch_add(1, Ordering::SeqCst);
    let _guard = ActiveGuard(env.stats.clone());
    let DumpJob {
        map,
        mut walker,
        layout,
        decoder,
        chunk,
        limit,
        sealer,
        slot,
        large,
        large_memory: _large_memory,
    } = job;
    let meta = walker.meta().clone();
    let per_entry = per_entry(&meta, layout, decoder.as_ref());
    let (mut sent, mut chunks) = (0u64, 0u64);
    let mut seen = walker.stats();
    // A limit that fits one chunk is read at once: the slow start is for
    // the first entries of a long dump.
    let mut next = if limit != 0 && limit <= u64::from(chunk.steady) {
        chunk.steady
    } else {
        chunk.first
    };
    loop {
        if *env.stop.borrow() {
            return Err(Error::ShuttingDown);
        }
        // The client left (its stream was dropped): no more reads.
        if tx.is_closed() {
            return Ok(());
        }
        if let Some(slot) = &slot
            && slot.held() >= env.max_slot_hold
            && env.slots.contended(slot, env.max_slot_hold)
        {
            env.stats.slots_expired.fetch_add(1, Ordering::Relaxed);
            return Err(Error::SlotExpired {
                secs: env.max_slot_hold.as_secs(),
            });
        }
        let remaining = (limit != 0).then(|| limit - sent);
        let mut want = remaining.map_or(next, |r| r.min(u64::from(next)) as u32);
        next = next.saturating_mul(4).min(chunk.steady);
        let mut reservation = match large {
            // Memory taken for the whole dump: one entry at a time, read
            // once nothing is queued.
            Some(_) => {
                wait_until_drained(share, tx, &mut env).await?;
                None
            }
            None => Some(reserve(share, want as usize * per_entry, per_entry, tx, &mut env).await?),
        };
        if let Some(r) = &reservation {
            want = want.min((r.bytes() / per_entry).max(1) as u32);
        }
        // Past the first chunk of a limited call, stop short of a hash
        // bucket that would overshoot the limit: the next call gets it whole.
        let cap = remaining
            .filter(|_| sent > 0)
            .map(|r| r.min(u64::from(u32::MAX)) as u32);
        let res = read_chunk(&mut walker, want, cap);
        env.stats.chunks_read.fetch_add(1, Ordering::Relaxed);
        let w = walker.stats();
        env.stats
            .walk_restarts
            .fetch_add(w.restarts - seen.restarts, Ordering::Relaxed);
        env.stats
            .batch_calls
            .fetch_add(w.syscalls - seen.syscalls, Ordering::Relaxed);
        env.stats
            .enospc
            .fetch_add(w.enospc - seen.enospc, Ordering::Relaxed);
        seen = w;
        let chunk_read = res.map_err(|e| Error::from_walk(&map, e))?;
        let position = walker.position().clone();
        let complete = position == Position::End;
        // An empty chunk short of the end: the next bucket would overshoot.
        let limit_reached = limit != 0
            && (sent + chunk_read.as_ref().map_or(0, |c| c.count as u64) >= limit
                || chunk_read.as_ref().is_some_and(|c| c.count == 0) && !complete);
        let cursor = sealer.seal(&position);
        if let Some(c) = chunk_read.filter(|c| c.count > 0) {
            let count = c.count as u64;
            // A hash bucket is never split: it may hold more than asked for.
            let bytes = c.count * per_entry;
            if bytes > env.limits.max_message_bytes {
                return Err(Error::EntryTooLarge {
                    map,
                    bytes,
                    why: format!(
                        "a hash bucket holds {} entries, more than the largest message this server sends ({} bytes, limits.max_message_bytes)",
                        c.count, env.limits.max_message_bytes
                    ),
                });
            }
            if let Some(r) = reservation.as_mut() {
                share.grow(r, bytes.saturating_sub(r.bytes()));
            }
            let msg = ChunkMessage {
                meta: &meta,
                chunk: c,
                layout,
                decoder: decoder.as_ref(),
                cursor: cursor.clone(),
            }
            .into_proto();
            if !send(tx, &mut env, msg, reservation).await? {
                return Ok(());
            }
            sent += count;
            chunks += 1;
        }
        if complete || limit_reached {
            let summary = pb::DumpSummary {
                entries: sent,
                chunks,
                elapsed: prost_types::Duration::try_from(started.elapsed()).ok(),
                complete,
            };
            let last = pb::DumpMapResponse {
                cursor,
                done: true,
                summary: Some(summary),
                ..Default::default()
            };
            send(tx, &mut env, last, None).await?;
            return Ok(());
        }
    }
}

/// Entries read from the kernel per call at most. A batched read runs in the
/// kernel without yielding the CPU, and the threads that send the chunks
/// before it may be waiting for that CPU: calls of this size keep them
/// waiting for at most a fraction of a millisecond, and cost the kernel no
/// more per entry than larger ones (see the benchmark's batch section).
const MAX_READ: u32 = 1024;

/// Reads a chunk of `want` entries (at most `cap` when capped) in calls of
/// at most [`MAX_READ`] entries. Only the first call may take a hash bucket
/// larger than asked for; the others stop before a bucket that would
/// overshoot `want`, as one call of `want` entries would. A call that fails
/// after others succeeded ends the chunk; the next read meets the failure
/// again.
fn read_chunk(
    walker: &mut Walker<MapHandle>,
    want: u32,
    cap: Option<u32>,
) -> Result<Option<Chunk>, WalkError> {
    let mut acc: Option<Chunk> = None;
    let mut got = 0u32;
    while got < want {
        let n = (want - got).min(MAX_READ);
        let read = match (cap, acc.is_some()) {
            (Some(cap), false) => walker.next_chunk_capped(n, cap),
            (None, false) => walker.next_chunk(n),
            (cap, true) => {
                let left = cap.map_or(want, |c| c.min(want)).saturating_sub(got);
                if left == 0 {
                    break;
                }
                walker.next_chunk_capped(n.min(left), left)
            }
        };
        let c = match read {
            Ok(Some(c)) => c,
            Ok(None) => break,
            Err(e) if acc.is_none() => return Err(e),
            Err(_) => break,
        };
        if c.count == 0 {
            // The next bucket would overshoot the cap.
            if acc.is_none() {
                acc = Some(c);
            }
            break;
        }
        got = got.saturating_add(c.count as u32);
        match acc.as_mut() {
            None => acc = Some(c),
            Some(a) => {
                if a.keys.capacity() == a.keys.len() {
                    // Room for the whole chunk at once, not a growth per call.
                    let rest = (want as usize).saturating_sub(a.count).max(c.count);
                    a.keys.reserve(rest * (c.keys.len() / c.count));
                    a.values.reserve(rest * (c.values.len() / c.count));
                }
                a.count += c.count;
                a.keys.extend_from_slice(&c.keys);
                a.values.extend_from_slice(&c.values);
            }
        }
        if cap.is_some_and(|cap| got >= cap) {
            break;
        }
    }
    Ok(acc)
}

/// Reserves a chunk's memory from the dump's share, waiting for the client
/// to take queued chunks when the share is full (at most the stall
/// timeout). When nothing is queued, what the share holds is in the
/// transport: the producer goes on rather than wait on it.
async fn reserve(
    share: &Arc<Share>,
    want: usize,
    floor: usize,
    tx: &mpsc::Sender<Queued>,
    env: &mut DumpEnv,
) -> Result<Reservation, Error> {
    let deadline = tokio::time::Instant::now() + env.stall_timeout;
    loop {
        if let Some(r) = share.try_reserve(want, floor) {
            return Ok(r);
        }
        if tx.capacity() == tx.max_capacity() {
            return Ok(share.force(floor));
        }
        tokio::select! {
            _ = share.released() => {}
            _ = tokio::time::sleep_until(deadline) => return Err(Error::Stalled {
                secs: env.stall_timeout.as_secs(),
            }),
            _ = env.stop.wait_for(|s| *s) => return Err(Error::ShuttingDown),
        }
    }
}

/// Waits (at most the stall timeout) until nothing this dump produced is
/// queued any more.
async fn wait_until_drained(
    share: &Arc<Share>,
    tx: &mpsc::Sender<Queued>,
    env: &mut DumpEnv,
) -> Result<(), Error> {
    let deadline = tokio::time::Instant::now() + env.stall_timeout;
    while tx.capacity() < tx.max_capacity() {
        tokio::select! {
            _ = share.released() => {}
            _ = tokio::time::sleep_until(deadline) => return Err(Error::Stalled {
                secs: env.stall_timeout.as_secs(),
            }),
            _ = env.stop.wait_for(|s| *s) => return Err(Error::ShuttingDown),
        }
    }
    Ok(())
}

/// Queues one message, waiting at most the stall timeout for room. `false`
/// when the client went away.
async fn send(
    tx: &mpsc::Sender<Queued>,
    env: &mut DumpEnv,
    msg: pb::DumpMapResponse,
    reservation: Option<Reservation>,
) -> Result<bool, Error> {
    tokio::select! {
        r = tx.send((Ok(msg), reservation)) => Ok(r.is_ok()),
        _ = tokio::time::sleep(env.stall_timeout) => Err(Error::Stalled {
            secs: env.stall_timeout.as_secs(),
        }),
        _ = env.stop.wait_for(|s| *s) => Err(Error::ShuttingDown),
    }
}

struct ActiveGuard(Arc<DumpStats>);

impl Drop for ActiveGuard {
    fn drop(&mut self) {
        self.0.active.fetch_sub(1, Ordering::SeqCst);
    }
}

/// The response stream of a dump: the producer's chunks, then its error if
/// it failed. It owns the call's audit record, counts the entries handed to
/// the transport, and finishes the record when the stream ends or is dropped
/// (a client that went away before the end is CANCELLED). It keeps the
/// budget reservations of the last [`IN_TRANSPORT`] messages it handed over.
#[derive(Debug)]
pub struct DumpStream {
    rx: mpsc::Receiver<Queued>,
    tail: Option<oneshot::Receiver<Status>>,
    audit: Option<audit::Record>,
    /// How the stream ended, once it has.
    ended: Option<tonic::Code>,
    held: VecDeque<Reservation>,
    /// Counts the dump as a call in flight until the stream is dropped.
    busy: Option<BusyToken>,
    /// The producer's share: told of every message taken, so that a
    /// producer waiting for room (or for an empty queue) looks again.
    share: Arc<Share>,
    stats: Arc<DumpStats>,
}

fn entries_in(msg: &pb::DumpMapResponse) -> u64 {
    msg.packed
        .as_ref()
        .map_or(msg.entries.len() as u64, |p| u64::from(p.count))
}

impl DumpStream {
    /// Counts the dump as a call in flight while the stream lives.
    pub fn with_busy(mut self, token: BusyToken) -> Self {
        self.busy = Some(token);
        self
    }
}

impl Stream for DumpStream {
    type Item = Item;

    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Item>> {
        let this = self.get_mut();
        if this.ended.is_some() {
            this.held.clear();
            return Poll::Ready(None);
        }
        match this.rx.poll_recv(cx) {
            Poll::Pending => Poll::Pending,
            Poll::Ready(Some((item, reservation))) => {
                this.share.wake();
                if let Some(r) = reservation {
                    this.held.push_back(r);
                    while this.held.len() > IN_TRANSPORT {
                        this.held.pop_front();
                    }
                }
                if let (Ok(msg), Some(a)) = (&item, this.audit.as_mut()) {
                    use prost::Message as _;
                    let n = entries_in(msg);
                    a.add_entries(n);
                    this.stats.entries_sent.fetch_add(n, Ordering::Relaxed);
                    this.stats
                        .bytes_sent
                        .fetch_add(msg.encoded_len() as u64, Ordering::Relaxed);
                    if msg.done {
                        this.ended = Some(tonic::Code::Ok);
                    }
                }
                Poll::Ready(Some(item))
            }
            // The producer is done: its error, if any, follows.
            Poll::Ready(None) => {
                let Some(tail) = this.tail.as_mut() else {
                    return Poll::Ready(None);
                };
                match Pin::new(tail).poll(cx) {
                    Poll::Pending => Poll::Pending,
                    Poll::Ready(r) => {
                        this.tail = None;
                        match r {
                            Ok(status) => {
                                this.ended = Some(status.code());
                                Poll::Ready(Some(Err(status)))
                            }
                            Err(_) => Poll::Ready(None),
                        }
                    }
                }
            }
        }
    }
}

impl Drop for DumpStream {
    fn drop(&mut self) {
        if let Some(a) = self.audit.take() {
            a.finish(self.ended.unwrap_or(tonic::Code::Cancelled));
        }
    }
}
