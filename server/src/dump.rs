//! One DumpMap stream: kernel reads off the async runtime, a bounded channel
//! to the client, a cursor on every chunk.
//!
//! The producer reads one chunk at a time on the blocking pool and hands it to
//! a channel of [`CHANNEL_DEPTH`] messages, so a stream holds at most a few
//! chunks in memory while the next kernel read overlaps with sending. When
//! the client goes away, `send` fails and the producer stops before its next
//! read. A client that takes no chunk for the stall timeout, and every stream
//! on shutdown, gets UNAVAILABLE after the chunks already queued, and resumes
//! from its last cursor.
#![forbid(unsafe_code)]

use std::{
    future::Future as _,
    pin::Pin,
    sync::{
        Arc,
        atomic::{AtomicU64, AtomicUsize, Ordering},
    },
    task::{Context, Poll},
    time::Duration,
};

use bpfmap_proto::v1 as pb;
use futures::Stream;
use tokio::sync::{mpsc, watch};
use tonic::Status;

use crate::{
    audit,
    catalog::MapRef,
    cursor::Sealer,
    error::Error,
    kernel::{
        MapHandle, MapMeta,
        walk::{Position, Walker},
    },
    limits::Slot,
    proto::{ChunkMessage, IntoProto as _},
};

/// Messages buffered between the kernel reader and the client.
pub const CHANNEL_DEPTH: usize = 4;
/// Entries per chunk when the request does not say.
pub const DEFAULT_CHUNK: u32 = 1024;
/// Upper bound on entries per chunk.
pub const MAX_CHUNK: u32 = 65_536;
/// Upper bound on a chunk's encoded size, well below grpcurl's 4 MiB default.
pub const MAX_CHUNK_BYTES: usize = 3 << 20;

/// Counters shared by all dumps, for tests and operators.
#[derive(Debug, Default)]
pub struct DumpStats {
    /// Dumps whose producer is running.
    pub active: AtomicUsize,
    /// Kernel chunk reads since start.
    pub chunks_read: AtomicU64,
}

/// The chunk size actually used: the hint, defaulted and clamped so that a
/// chunk stays below [`MAX_CHUNK_BYTES`].
pub fn effective_chunk(hint: u32, meta: &MapMeta) -> u32 {
    let per_entry = meta.key_size as usize + meta.wire_value_size() + 16;
    let by_bytes = (MAX_CHUNK_BYTES / per_entry).max(1) as u32;
    let want = if hint == 0 { DEFAULT_CHUNK } else { hint };
    want.min(MAX_CHUNK).min(by_bytes).max(1)
}

/// What a request asks of a dump.
#[derive(Debug, Clone, Copy)]
pub struct Options {
    /// How entries are laid out.
    pub layout: pb::Layout,
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
    chunk: u32,
    limit: u64,
    sealer: Sealer,
    slot: Option<Slot>,
}

impl DumpJob {
    /// A dump of `handle` (named `map` in the request) from `position`.
    pub fn new(
        map: MapRef,
        handle: MapHandle,
        position: Position,
        options: Options,
        sealer: Sealer,
    ) -> Result<Self, Error> {
        let meta = handle.meta().clone();
        let chunk = effective_chunk(options.chunk_hint, &meta);
        let walker = Walker::new(handle, meta, position).map_err(|e| Error::from_walk(&map, e))?;
        Ok(Self {
            map,
            walker,
            layout: options.layout,
            chunk,
            limit: options.limit,
            sealer,
            slot: None,
        })
    }

    /// Holds `slot` until the producer ends.
    pub fn with_slot(self, slot: Slot) -> Self {
        Self {
            slot: Some(slot),
            ..self
        }
    }
}

/// What every dump shares.
#[derive(Debug, Clone)]
pub struct DumpEnv {
    /// Becomes true when the server stops.
    pub shutdown: watch::Receiver<bool>,
    /// Shared counters.
    pub stats: Arc<DumpStats>,
    /// End the stream when the client takes no chunk for this long.
    pub stall_timeout: Duration,
}

type Item = Result<pb::DumpMapResponse, Status>;

/// Starts the producer and returns the response stream: the chunks, then
/// (when the dump ends in an error) the error status. The stream finishes
/// the call's audit record.
pub fn spawn(job: DumpJob, audit: audit::Record, env: DumpEnv) -> DumpStream {
    let (tx, rx) = mpsc::channel(CHANNEL_DEPTH);
    let (tail_tx, tail_rx) = tokio::sync::oneshot::channel::<Status>();
    let started = audit.started();
    tokio::spawn(async move {
        if let Err(e) = run(job, started, &tx, env).await {
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
    }
}

/// Runs a dump until the map ends, the limit is reached, the client leaves,
/// stalls, or the server shuts down. A client that left is not an error.
async fn run(
    job: DumpJob,
    started: std::time::Instant,
    tx: &mpsc::Sender<Item>,
    mut env: DumpEnv,
) -> Result<(), Error> {
    env.stats.active.fetch_add(1, Ordering::SeqCst);
    let _guard = ActiveGuard(env.stats.clone());
    let DumpJob {
        map,
        mut walker,
        layout,
        chunk,
        limit,
        sealer,
        slot: _slot,
    } = job;
    let meta = walker.meta().clone();
    let (mut sent, mut chunks) = (0u64, 0u64);
    loop {
        if *env.shutdown.borrow() {
            return Err(Error::ShuttingDown);
        }
        let want = if limit == 0 {
            chunk
        } else {
            (limit - sent).min(u64::from(chunk)) as u32
        };
        // Past the first chunk of a limited call, stop short of a hash
        // bucket that would overshoot the limit: the next call gets it whole.
        let strict = limit != 0 && sent > 0;
        let read = tokio::task::spawn_blocking(move || {
            let res = if strict {
                walker.next_chunk_at_most(want)
            } else {
                walker.next_chunk(want)
            };
            (walker, res)
        })
        .await;
        let (w, res) = read.map_err(|e| Error::Internal {
            map: Some(map.clone()),
            message: format!("reader task failed: {e}"),
        })?;
        walker = w;
        env.stats.chunks_read.fetch_add(1, Ordering::Relaxed);
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
            let msg = ChunkMessage {
                meta: &meta,
                chunk: c,
                layout,
                cursor: cursor.clone(),
            }
            .into_proto();
            if !send(tx, &mut env, msg).await? {
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
            send(tx, &mut env, last).await?;
            return Ok(());
        }
    }
}

/// Queues one message, waiting at most the stall timeout for room. `false`
/// when the client went away.
async fn send(
    tx: &mpsc::Sender<Item>,
    env: &mut DumpEnv,
    msg: pb::DumpMapResponse,
) -> Result<bool, Error> {
    tokio::select! {
        r = tx.send(Ok(msg)) => Ok(r.is_ok()),
        _ = tokio::time::sleep(env.stall_timeout) => Err(Error::Stalled {
            secs: env.stall_timeout.as_secs(),
        }),
        _ = env.shutdown.wait_for(|s| *s) => Err(Error::ShuttingDown),
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
/// (a client that went away before the end is CANCELLED).
#[derive(Debug)]
pub struct DumpStream {
    rx: mpsc::Receiver<Item>,
    tail: Option<tokio::sync::oneshot::Receiver<Status>>,
    audit: Option<audit::Record>,
    /// How the stream ended, once it has.
    ended: Option<tonic::Code>,
}

fn entries_in(msg: &pb::DumpMapResponse) -> u64 {
    msg.packed
        .as_ref()
        .map_or(msg.entries.len() as u64, |p| u64::from(p.count))
}

impl Stream for DumpStream {
    type Item = Item;

    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Item>> {
        let this = self.get_mut();
        if this.ended.is_some() {
            return Poll::Ready(None);
        }
        if let Poll::Ready(item) = this.rx.poll_recv(cx) {
            if let Some(item) = item {
                if let (Ok(msg), Some(a)) = (&item, this.audit.as_mut()) {
                    a.add_entries(entries_in(msg));
                    if msg.done {
                        this.ended = Some(tonic::Code::Ok);
                    }
                }
                return Poll::Ready(Some(item));
            }
            // The producer is done: its error, if any, follows.
            let Some(tail) = this.tail.as_mut() else {
                return Poll::Ready(None);
            };
            return match Pin::new(tail).poll(cx) {
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
            };
        }
        Poll::Pending
    }
}

impl Drop for DumpStream {
    fn drop(&mut self) {
        if let Some(a) = self.audit.take() {
            a.finish(self.ended.unwrap_or(tonic::Code::Cancelled));
        }
    }
}
