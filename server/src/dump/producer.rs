//! The producer of one dump: on a thread of the blocking pool, it reads
//! chunks from the kernel and queues them for the transport, within the
//! dump's memory share (see the module documentation of `dump`).

use std::{
    sync::{Arc, atomic::Ordering},
    time::{Duration, Instant},
};

use bpfmap_kernel::{
    MapMeta, MapOps,
    walk::{Chunk, Position, WalkError, WalkStats, Walker},
};
use bpfmap_proto::v1 as pb;
use tokio::sync::{mpsc, oneshot, watch};

use super::{CHANNEL_DEPTH, ChunkSizes, DumpJob, DumpLimits, DumpStats, job::per_entry};
use crate::cursor::Sealer;
use crate::{
    error::Error,
    limits::{DumpSlots, Reservation, Share, Slot},
    maps::Decoder,
    model::MapRef,
    query::{CostMeter, Query, projected_meta, projection_message},
    wire::{ChunkMessage, IntoProto as _},
};

/// How long a filtered dump may go without sending its cursor.
const HEARTBEAT: Duration = Duration::from_secs(1);

/// What every dump shares.
#[derive(Debug, Clone)]
pub(crate) struct DumpEnv {
    /// Becomes true when dumps in flight must end (after the shutdown grace).
    pub(crate) stop: watch::Receiver<bool>,
    /// Shared counters.
    pub(crate) stats: Arc<DumpStats>,
    /// End the stream when the client takes no chunk for this long.
    pub(crate) stall_timeout: Duration,
    /// Each dump's share of memory, and the largest message.
    pub(crate) limits: DumpLimits,
    /// The dump slots (to know when a slot is wanted by others).
    pub(crate) slots: Arc<DumpSlots>,
    /// How long a dump may hold its slot while others wait.
    pub(crate) max_slot_hold: Duration,
    /// How many times the walk a filter's evaluation may cost.
    pub(crate) max_filter_cost: u32,
    /// Producers reading and encoding at once: about one per CPU, so that
    /// many dumps filling their queues at once (clients that all stop
    /// reading) leave the CPUs to other calls, not to a crowd of threads.
    pub(crate) readers: Arc<tokio::sync::Semaphore>,
}

/// Producers reading at once: one per CPU.
pub(crate) fn reader_permits() -> usize {
    std::thread::available_parallelism().map_or(2, std::num::NonZero::get)
}

impl DumpEnv {
    /// A dump ended because its slot expired, counted.
    fn slot_expired(&self) -> Error {
        self.stats.slots_expired.fetch_add(1, Ordering::Relaxed);
        Error::SlotExpired {
            secs: self.max_slot_hold.as_secs(),
        }
    }

    /// Resolves with the error that must end a waiting dump: the server
    /// stops, or its slot (if it holds one) expired while it waited.
    async fn interrupted(&mut self, slot: Option<&Slot>) -> Error {
        let slots = self.slots.clone();
        let max_hold = self.max_slot_hold;
        let expiry = async {
            match slot {
                Some(slot) => slots.expiry(slot, max_hold).await,
                None => std::future::pending().await,
            }
        };
        let expired = tokio::select! {
            _ = self.stop.wait_for(|s| *s) => false,
            _ = expiry => true,
        };
        if expired {
            self.slot_expired()
        } else {
            Error::ShuttingDown
        }
    }
}

/// A queued message and the memory it holds.
pub(crate) type Queued = (pb::DumpMapResponse, Option<Reservation>);
/// Where a failed producer's error goes: after the chunks already queued.
pub(crate) type Tail = oneshot::Receiver<Error>;

/// What the response stream reads from a started producer.
#[derive(Debug)]
pub(crate) struct Started {
    /// The chunks, in order.
    pub(crate) rx: mpsc::Receiver<Queued>,
    /// The producer's error, if it fails, after the chunks.
    pub(crate) tail: Tail,
    /// The dump's memory share: told of every message taken, so that a
    /// producer waiting for room (or for an empty queue) looks again.
    pub(crate) share: Arc<Share>,
}

/// Starts the producer of `job` on a thread of the blocking pool (the call
/// began at `started`, for the summary's elapsed time).
pub(crate) fn spawn<M: MapOps + Send + 'static>(
    job: DumpJob<M>,
    started: Instant,
    env: DumpEnv,
) -> Started {
    let (tx, rx) = mpsc::channel(CHANNEL_DEPTH);
    let (tail_tx, tail) = oneshot::channel();
    let share = Share::new(env.limits.share);
    let producer = Producer::new(job, started, tx, share.clone(), env);
    let runtime = tokio::runtime::Handle::current();
    tokio::task::spawn_blocking(move || {
        if let Err(e) = runtime.block_on(producer.run()) {
            // Delivered after the chunks already queued, even when the
            // channel is full (a client that stopped reading).
            let _ = tail_tx.send(e);
        }
    });
    Started { rx, tail, share }
}

/// One dump's producer and its progress.
struct Producer<M> {
    map: MapRef,
    meta: MapMeta,
    walker: Walker<M>,
    layout: pb::Layout,
    decoder: Option<Decoder>,
    chunk: ChunkSizes,
    limit: u64,
    /// A filter and a projection, and what they cost.
    query: Option<Arc<Query>>,
    meter: CostMeter,
    /// The description of projected records (a projection's messages are
    /// built with it).
    projected: Option<MapMeta>,
    sealer: Sealer,
    slot: Option<Slot>,
    large: bool,
    _large_memory: Option<Reservation>,
    per_entry: usize,
    started: Instant,
    tx: mpsc::Sender<Queued>,
    share: Arc<Share>,
    env: DumpEnv,
    /// Entries and chunks queued so far, and entries read.
    sent: u64,
    chunks: u64,
    scanned: u64,
    /// When a message was last queued (a filter that matches nothing for a
    /// while still sends its cursor).
    last_queued: Instant,
    /// The walker's counters when last added to the shared ones.
    seen: WalkStats,
    /// The next chunk's size (the slow start).
    next: u32,
    /// Whether the map was walked inside the kernel (and the memory of
    /// the entries taken), and why not.
    scan: super::kernel::ScanReport,
}

impl<M: MapOps> Producer<M> {
    fn new(
        job: DumpJob<M>,
        started: Instant,
        tx: mpsc::Sender<Queued>,
        share: Arc<Share>,
        env: DumpEnv,
    ) -> Self {
        let meta = job.walker.meta().clone();
        let projected = job
            .query
            .as_ref()
            .and_then(|q| q.projection.as_ref())
            .map(|p| projected_meta(&meta, p));
        let per_entry = per_entry(&meta, job.layout, job.decoder.as_ref());
        // A limit that fits one chunk is read at once: the slow start is
        // for the first entries of a long dump.
        let next = if job.limit != 0 && job.limit <= u64::from(job.chunk.steady) {
            job.chunk.steady
        } else {
            job.chunk.first
        };
        Self {
            seen: job.walker.stats(),
            map: job.map,
            meta,
            walker: job.walker,
            layout: job.layout,
            decoder: job.decoder,
            chunk: job.chunk,
            limit: job.limit,
            meter: CostMeter::new(env.max_filter_cost),
            projected,
            query: job.query,
            sealer: job.sealer,
            slot: job.slot,
            large: job.large.is_some(),
            _large_memory: job.large_memory,
            per_entry,
            started,
            tx,
            share,
            env,
            sent: 0,
            chunks: 0,
            scanned: 0,
            last_queued: Instant::now(),
            next,
            scan: job.scan,
        }
    }

    /// Runs the dump until the map ends, the limit is reached, the client
    /// leaves, stalls, the slot expires, or the server stops. A client that
    /// left is not an error. Runs on a thread where blocking is allowed: it
    /// reads the kernel in place.
    async fn run(mut self) -> Result<(), Error> {
        let stats = self.env.stats.clone();
        stats.active.fetch_add(1, Ordering::SeqCst);
        let _guard = ActiveGuard(stats.clone());
        let result = self.produce().await;
        if matches!(result, Err(Error::Stalled { .. })) {
            stats.stalled.fetch_add(1, Ordering::Relaxed);
        }
        result
    }

    async fn produce(&mut self) -> Result<(), Error> {
        let filtered = self.query.as_ref().is_some_and(|q| q.filter.is_some());
        loop {
            if !self.may_go_on()? {
                return Ok(());
            }
            let remaining = (self.limit != 0).then(|| self.limit - self.sent);
            // A filtered dump reads whole chunks whatever its limit: the
            // limit counts matches.
            let asked = if filtered { None } else { remaining };
            let (want, reservation) = self.reserve_next(asked).await?;
            // Past the first chunk of a limited call, stop short of a hash
            // bucket that would overshoot the limit: the next call gets it
            // whole.
            let cap = asked
                .filter(|_| self.sent > 0)
                .map(|r| r.min(u64::from(u32::MAX)) as u32);
            // One of the CPUs' turns to read and encode, let go before
            // waiting for the client.
            let turn = self.env.readers.clone().acquire_owned().await;
            let chunk = self.read(want, cap, remaining)?;
            let position = self.walker.position().clone();
            let complete = position == Position::End;
            let got = chunk.as_ref().map_or(0, |c| c.count as u64);
            // Unfiltered, an empty chunk short of the end: the next bucket
            // would overshoot.
            let limit_reached = self.limit != 0
                && (self.sent + got >= self.limit || !filtered && got == 0 && !complete);
            let cursor = self.sealer.seal(&position);
            // A filter that matched nothing for a while still sends where
            // the walk stands, so that a resumed dump does not read it again.
            let heartbeat = filtered && self.last_queued.elapsed() >= HEARTBEAT;
            let chunk = chunk.filter(|c| c.count > 0 || heartbeat && !complete && !limit_reached);
            if let Some(c) = chunk
                && !self
                    .queue_chunk(c, cursor.clone(), reservation, turn)
                    .await?
            {
                return Ok(());
            }
            if complete || limit_reached {
                return self.queue_summary(cursor, complete).await;
            }
        }
    }

    /// Reads the next chunk, filtered: at most `remaining` matches (the
    /// walk goes back and reads only up to the last of them when one read
    /// finds more), within what the filter may cost.
    fn read(
        &mut self,
        want: u32,
        cap: Option<u32>,
        remaining: Option<u64>,
    ) -> Result<Option<Chunk>, Error> {
        let before = self.query.is_some().then(|| self.walker.position().clone());
        let started = Instant::now();
        let read = read_chunk(&mut self.walker, want, cap);
        let reading = started.elapsed();
        self.count_reads();
        let mut chunk = read.map_err(|e| Error::from_walk(&self.map, e))?;
        let (Some(q), Some(c)) = (self.query.clone(), chunk.as_mut()) else {
            self.scanned += chunk.as_ref().map_or(0, |c| c.count as u64);
            return Ok(chunk);
        };
        let read_count = c.count;
        let evaluating = Instant::now();
        let looked = q.keep_matching(c, remaining);
        let mut scanned = read_count;
        if looked < read_count
            && let Some(before) = before
        {
            // The limit was reached inside the chunk: read again up to the
            // last match, so that the cursor resumes right after it. Not
            // capped: a hash bucket larger than that is read whole (a
            // capped read would return nothing, and the walk would stand
            // still); one that straddles it is left to the next read.
            self.walker.rewind(before);
            let again = read_chunk(&mut self.walker, looked as u32, None);
            self.count_reads();
            chunk = again.map_err(|e| Error::from_walk(&self.map, e))?;
            scanned = chunk.as_ref().map_or(0, |c| c.count);
            if let Some(c) = chunk.as_mut() {
                q.keep_matching(c, None);
            }
        }
        self.scanned += scanned as u64;
        self.meter.add(reading, evaluating.elapsed())?;
        Ok(chunk.map(|c| q.project(c, &self.meta).0))
    }

    /// Whether to read on: not once the server stops (UNAVAILABLE), the
    /// client left (`false`), or the slot was held too long while others
    /// waited (UNAVAILABLE: resume later).
    fn may_go_on(&self) -> Result<bool, Error> {
        if *self.env.stop.borrow() {
            return Err(Error::ShuttingDown);
        }
        if self.tx.is_closed() {
            return Ok(false);
        }
        if let Some(slot) = &self.slot
            && self.env.slots.expired(slot, self.env.max_slot_hold)
        {
            return Err(self.env.slot_expired());
        }
        Ok(true)
    }

    /// The next chunk's entries and its memory (none for large entries,
    /// whose memory was taken for the whole dump: one at a time, read once
    /// nothing is queued).
    async fn reserve_next(
        &mut self,
        remaining: Option<u64>,
    ) -> Result<(u32, Option<Reservation>), Error> {
        let next = self.next;
        let mut want = remaining.map_or(next, |r| r.min(u64::from(next)) as u32);
        self.next = next.saturating_mul(4).min(self.chunk.steady);
        if self.large {
            let waiter = Waiter {
                tx: &self.tx,
                env: &mut self.env,
                slot: self.slot.as_ref(),
            };
            wait_until_drained(&self.share, waiter).await?;
            return Ok((want, None));
        }
        let bytes = want as usize * self.per_entry;
        let waiter = Waiter {
            tx: &self.tx,
            env: &mut self.env,
            slot: self.slot.as_ref(),
        };
        let r = reserve(&self.share, bytes, self.per_entry, waiter).await?;
        want = want.min((r.bytes() / self.per_entry).max(1) as u32);
        Ok((want, Some(r)))
    }

    /// Adds the walker's counters since the last read to the shared ones.
    fn count_reads(&mut self) {
        let stats = &self.env.stats;
        stats.chunks_read.fetch_add(1, Ordering::Relaxed);
        let w = self.walker.stats();
        let seen = std::mem::replace(&mut self.seen, w);
        stats
            .walk_restarts
            .fetch_add(w.restarts - seen.restarts, Ordering::Relaxed);
        stats
            .batch_calls
            .fetch_add(w.syscalls - seen.syscalls, Ordering::Relaxed);
        stats
            .enospc
            .fetch_add(w.enospc - seen.enospc, Ordering::Relaxed);
    }

    /// Queues a chunk with its cursor; `false` when the client left.
    async fn queue_chunk(
        &mut self,
        c: Chunk,
        cursor: String,
        mut reservation: Option<Reservation>,
        turn: Result<tokio::sync::OwnedSemaphorePermit, tokio::sync::AcquireError>,
    ) -> Result<bool, Error> {
        let count = c.count as u64;
        // A hash bucket is never split: it may hold more than asked for.
        let bytes = c.count * self.per_entry;
        let max = self.env.limits.max_message_bytes;
        if bytes > max {
            return Err(Error::EntryTooLarge {
                map: self.map.clone(),
                bytes,
                why: format!(
                    "a hash bucket holds {} entries, more than the largest message this server sends ({max} bytes, limits.max_message_bytes)",
                    c.count
                ),
            });
        }
        if let Some(r) = reservation.as_mut() {
            self.share.grow(r, bytes.saturating_sub(r.bytes()));
        }
        let mut msg = ChunkMessage {
            meta: self.projected.as_ref().unwrap_or(&self.meta),
            chunk: c,
            layout: self.layout,
            decoder: self.decoder.as_ref(),
            cursor,
        }
        .into_proto();
        if self.decoder.is_some() && self.query.as_ref().is_some_and(|q| q.projection.is_some()) {
            // A projection's entries are their decoded members: the
            // projected records' bytes are left out (kept with `raw`).
            for e in &mut msg.entries {
                e.key = Vec::new();
                e.value = Vec::new();
                e.per_cpu_values = Vec::new();
            }
        }
        if self.chunks == 0
            && let Some(p) = self.query.as_ref().and_then(|q| q.projection.as_ref())
        {
            msg.projection = Some(projection_message(p));
        }
        self.last_queued = Instant::now();
        drop(turn);
        let waiter = Waiter {
            tx: &self.tx,
            env: &mut self.env,
            slot: self.slot.as_ref(),
        };
        if !send(waiter, msg, reservation).await? {
            return Ok(false);
        }
        self.sent += count;
        self.chunks += 1;
        Ok(true)
    }

    /// Queues the last message: the cursor and the summary.
    async fn queue_summary(&mut self, cursor: String, complete: bool) -> Result<(), Error> {
        let summary = pb::DumpSummary {
            entries: self.sent,
            chunks: self.chunks,
            elapsed: prost_types::Duration::try_from(self.started.elapsed()).ok(),
            complete,
            // A walk inside the kernel visited every entry.
            entries_scanned: self.scan.visited.unwrap_or(self.scanned),
            scanned_in_kernel: self.scan.visited.is_some(),
            scan_note: self.scan.note.clone(),
        };
        let last = pb::DumpMapResponse {
            cursor,
            done: true,
            summary: Some(summary),
            // A projection that sent no chunk still says what it is.
            projection: self
                .query
                .as_ref()
                .and_then(|q| q.projection.as_ref())
                .filter(|_| self.chunks == 0)
                .map(projection_message),
            ..Default::default()
        };
        // The slot is kept until the summary is queued: its memory share
        // still holds what the client has not taken.
        send(
            Waiter {
                tx: &self.tx,
                env: &mut self.env,
                slot: self.slot.as_ref(),
            },
            last,
            None,
        )
        .await?;
        Ok(())
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
fn read_chunk<M: MapOps>(
    walker: &mut Walker<M>,
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
    waiter: Waiter<'_>,
) -> Result<Reservation, Error> {
    let Waiter { tx, env, slot } = waiter;
    let deadline = tokio::time::Instant::now() + env.stall_timeout;
    loop {
        if let Some(r) = share.try_reserve(want, floor) {
            return Ok(r);
        }
        if tx.capacity() == tx.max_capacity() {
            return Ok(share.force(floor));
        }
        let stall = env.stall_timeout;
        tokio::select! {
            _ = share.released() => {}
            _ = tokio::time::sleep_until(deadline) => return Err(Error::Stalled {
                secs: stall.as_secs(),
            }),
            e = env.interrupted(slot) => return Err(e),
        }
    }
}

/// Waits (at most the stall timeout) until nothing this dump produced is
/// queued any more.
async fn wait_until_drained(share: &Arc<Share>, waiter: Waiter<'_>) -> Result<(), Error> {
    let Waiter { tx, env, slot } = waiter;
    let deadline = tokio::time::Instant::now() + env.stall_timeout;
    while tx.capacity() < tx.max_capacity() {
        let stall = env.stall_timeout;
        tokio::select! {
            _ = share.released() => {}
            _ = tokio::time::sleep_until(deadline) => return Err(Error::Stalled {
                secs: stall.as_secs(),
            }),
            e = env.interrupted(slot) => return Err(e),
        }
    }
    Ok(())
}

/// Queues one message, waiting at most the stall timeout for room. `false`
/// when the client went away.
async fn send(
    waiter: Waiter<'_>,
    msg: pb::DumpMapResponse,
    reservation: Option<Reservation>,
) -> Result<bool, Error> {
    let Waiter { tx, env, slot } = waiter;
    let stall = env.stall_timeout;
    tokio::select! {
        r = tx.send((msg, reservation)) => Ok(r.is_ok()),
        _ = tokio::time::sleep(stall) => Err(Error::Stalled {
            secs: stall.as_secs(),
        }),
        e = env.interrupted(slot) => Err(e),
    }
}

/// What a producer waiting for its client needs: its queue, the shared
/// environment, and its slot (which may expire while it waits).
struct Waiter<'a> {
    tx: &'a mpsc::Sender<Queued>,
    env: &'a mut DumpEnv,
    slot: Option<&'a Slot>,
}

struct ActiveGuard(Arc<DumpStats>);

impl Drop for ActiveGuard {
    fn drop(&mut self) {
        self.0.active.fetch_sub(1, Ordering::SeqCst);
    }
}

#[cfg(test)]
mod tests {
    //! The producer over a scripted map: the paths a real map will not take
    //! on demand (a failure after some chunks, ENOSPC, a bucket past the
    //! limit, a client that leaves or stops reading, shutdown). Real maps
    //! are dumped in the `tests` crate.
    use bpfmap_kernel::fake::{self, ScriptedMap};

    use super::*;
    use crate::{cursor::CursorKey, dump::Options, model::Identity};

    const MAP: &str = "t";

    fn env(stall: Duration) -> (DumpEnv, watch::Sender<bool>) {
        let (stop_tx, stop) = watch::channel(false);
        let env = DumpEnv {
            stop,
            stats: Arc::default(),
            stall_timeout: stall,
            limits: DumpLimits {
                share: 1 << 20,
                pool: 1 << 20,
                max_message_bytes: 4 << 20,
            },
            slots: Arc::new(DumpSlots::new(4, 4)),
            max_slot_hold: Duration::from_secs(60),
            max_filter_cost: 8,
            readers: Arc::new(tokio::sync::Semaphore::new(2)),
        };
        (env, stop_tx)
    }

    /// Starts a packed dump of `script` with chunks of `chunk` entries.
    fn start(
        script: ScriptedMap,
        chunk: u32,
        limit: u64,
        env: DumpEnv,
    ) -> (Started, &'static ScriptedMap) {
        let script: &'static ScriptedMap = Box::leak(Box::new(script));
        let map = MapRef::Path(MAP.into());
        let meta = fake::meta();
        let sealer = Sealer::new(
            CursorKey::from_bytes(b"k"),
            &Identity::Anonymous,
            &map,
            &meta,
        );
        let options = Options {
            layout: pb::Layout::Packed,
            decoder: None,
            chunk_hint: chunk,
            limit,
            query: None,
            scan: Default::default(),
        };
        let job = DumpJob::new(
            map,
            script,
            meta,
            Position::Start,
            options,
            sealer,
            &env.limits,
        )
        .expect("job");
        (spawn(job, Instant::now(), env), script)
    }

    /// Where a cursor of [`start`]'s dumps resumes.
    fn position(cursor: &str) -> Position {
        CursorKey::from_bytes(b"k")
            .open(cursor, &Identity::Anonymous, &MapRef::Path(MAP.into()))
            .expect("a cursor of this dump")
            .resume(&fake::meta())
            .expect("its position")
    }

    fn keys_of(msg: &pb::DumpMapResponse) -> Vec<u32> {
        msg.packed.as_ref().map_or_else(Vec::new, |p| {
            p.keys
                .chunks(4)
                .map(|k| u32::from_le_bytes(k.try_into().unwrap()))
                .collect()
        })
    }

    /// Every message until the producer is done, then its error if any.
    async fn drain(mut started: Started) -> (Vec<pb::DumpMapResponse>, Option<Error>) {
        let mut msgs = Vec::new();
        while let Some((msg, _)) = started.rx.recv().await {
            started.share.wake();
            msgs.push(msg);
        }
        (msgs, started.tail.await.ok())
    }

    #[tokio::test]
    async fn a_failure_after_some_chunks_comes_after_them_with_their_cursors() {
        let script = ScriptedMap::default();
        script.push(&[(1, 10), (2, 20)], 3, Ok(()));
        // The next bucket holds 3: ENOSPC, then the walker retries with room.
        script.push(&[], 3, Err(libc::ENOSPC));
        script.push(&[(3, 30), (4, 40), (5, 50)], 6, Ok(()));
        script.push(&[], 6, Err(libc::EIO));
        let (env, _stop) = env(Duration::from_secs(5));
        let stats = env.stats.clone();
        let (started, script) = start(script, 2, 0, env);
        let (msgs, err) = drain(started).await;
        let keys: Vec<Vec<u32>> = msgs.iter().map(keys_of).collect();
        assert_eq!(keys, [vec![1, 2], vec![3, 4, 5]]);
        assert!(msgs.iter().all(|m| !m.cursor.is_empty() && !m.done));
        assert_ne!(msgs[0].cursor, msgs[1].cursor);
        match err {
            Some(Error::Kernel { map, source }) => {
                assert_eq!(map.to_string(), MAP);
                assert_eq!(source.errno(), Some(libc::EIO));
            }
            other => panic!("expected the kernel's EIO, got {other:?}"),
        }
        assert_eq!(script.unused(), 0);
        assert_eq!(stats.enospc.load(Ordering::Relaxed), 1);
        assert_eq!(stats.active.load(Ordering::SeqCst), 0, "the producer ended");
    }

    #[tokio::test]
    async fn a_bucket_past_the_limit_ends_the_call_short_of_it() {
        let script = ScriptedMap::default();
        script.push(&[(1, 10), (2, 20)], 1, Ok(()));
        // One entry left under the limit; the next bucket holds two.
        script.push(&[], 1, Err(libc::ENOSPC));
        let (env, _stop) = env(Duration::from_secs(5));
        let (started, _) = start(script, 2, 3, env);
        let (msgs, err) = drain(started).await;
        assert!(err.is_none(), "{err:?}");
        assert_eq!(msgs.len(), 2);
        assert_eq!(keys_of(&msgs[0]), [1, 2]);
        let summary = msgs[1].summary.as_ref().expect("summary");
        assert!(msgs[1].done);
        assert_eq!(
            (summary.entries, summary.chunks, summary.complete),
            (2, 1, false)
        );
        assert_eq!(
            position(&msgs[1].cursor),
            position(&msgs[0].cursor),
            "the next call starts at that bucket"
        );
        assert_eq!(
            position(&msgs[0].cursor),
            Position::After(1u32.to_le_bytes().into())
        );
    }

    #[tokio::test]
    async fn a_client_that_leaves_costs_only_the_reads_under_way() {
        let script = ScriptedMap::default();
        for i in 0..50 {
            script.push(&[(i, i)], i + 1, Ok(()));
        }
        let (env, _stop) = env(Duration::from_secs(5));
        let (mut started, script) = start(script, 1, 0, env);
        let (first, _) = started.rx.recv().await.expect("a chunk");
        assert_eq!(keys_of(&first), [0]);
        drop(started.rx);
        assert!(started.tail.await.is_err(), "leaving is not an error");
        let reads = script.calls().len();
        assert!(
            reads <= 1 + CHANNEL_DEPTH + 2,
            "{reads} reads for a client that took one chunk"
        );
        assert_eq!(script.unused(), 50 - reads);
    }

    #[tokio::test]
    async fn a_client_that_stops_reading_is_cut_off_after_the_stall_timeout() {
        let script = ScriptedMap::default();
        for i in 0..50 {
            script.push(&[(i, i)], i + 1, Ok(()));
        }
        let (env, _stop) = env(Duration::from_millis(200));
        let stats = env.stats.clone();
        let (started, _) = start(script, 1, 0, env);
        let t = Instant::now();
        match started.tail.await {
            Ok(Error::Stalled { .. }) => {}
            other => panic!("expected a stall, got {other:?}"),
        }
        assert!(t.elapsed() >= Duration::from_millis(200));
        assert_eq!(stats.stalled.load(Ordering::Relaxed), 1);
    }

    #[tokio::test]
    async fn a_stopping_server_reads_nothing() {
        let script = ScriptedMap::default();
        let (env, stop) = env(Duration::from_secs(5));
        stop.send_replace(true);
        let (started, script) = start(script, 1, 0, env);
        let (msgs, err) = drain(started).await;
        assert!(msgs.is_empty());
        assert!(matches!(err, Some(Error::ShuttingDown)), "{err:?}");
        assert!(script.calls().is_empty());
    }
}
