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

use std::{
    pin::Pin,
    sync::{
        Arc,
        atomic::{AtomicU64, AtomicUsize, Ordering},
    },
    time::{Duration, Instant},
};

use bpfmap_proto::v1 as pb;
use futures::{Stream, StreamExt as _};
use tokio::sync::{mpsc, oneshot, watch};
use tokio_stream::wrappers::ReceiverStream;
use tonic::Status;

use crate::{
    audit,
    auth::Caller,
    catalog::MapRef,
    cursor::{Cursor, CursorKey, identity_digest},
    error::Error,
    kernel::{
        MapHandle, MapMeta,
        walk::{Chunk, Position, Walker},
    },
    limits::Slot,
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

/// Everything a dump needs, validated by the service.
#[derive(Debug)]
pub struct DumpJob {
    pub caller: Caller,
    pub map_ref: MapRef,
    pub walker: Walker<MapHandle>,
    pub layout: pb::Layout,
    pub chunk: u32,
    pub limit: u64,
    pub key: CursorKey,
    /// The dump's slot, held until the producer ends.
    pub slot: Slot,
    pub started: Instant,
}

/// What every dump shares.
#[derive(Debug, Clone)]
pub struct DumpEnv {
    pub shutdown: watch::Receiver<bool>,
    pub stats: Arc<DumpStats>,
    /// End the stream when the client takes no chunk for this long.
    pub stall_timeout: Duration,
}

pub type ChunkStream = Pin<Box<dyn Stream<Item = Result<pb::DumpMapResponse, Status>> + Send>>;

/// Starts the producer and returns the response stream: the chunks, then
/// (when the dump ends in an error) the error status.
pub fn spawn(job: DumpJob, env: DumpEnv) -> ChunkStream {
    let (tx, rx) = mpsc::channel(CHANNEL_DEPTH);
    let (tail_tx, tail_rx) = oneshot::channel::<Status>();
    tokio::spawn(async move {
        let (caller, map, started) = (job.caller.clone(), job.map_ref.policy_name(), job.started);
        let (entries, result) = run(job, &tx, env).await;
        let code = result
            .as_ref()
            .map_or_else(Error::code, |()| tonic::Code::Ok);
        audit::record(&caller, "DumpMap", &map, entries, code, started);
        if let Err(e) = result {
            // Delivered after the chunks already queued, even when the
            // channel is full (a client that stopped reading).
            let _ = tail_tx.send(e.into());
        }
    });
    let tail = futures::stream::once(tail_rx).filter_map(|r| std::future::ready(r.ok().map(Err)));
    Box::pin(ReceiverStream::new(rx).chain(tail))
}

/// Runs a dump until the map ends, the limit is reached, the client leaves,
/// stalls, or the server shuts down. Returns the entries sent and how it
/// ended (a client that left is not an error).
async fn run(
    job: DumpJob,
    tx: &mpsc::Sender<Result<pb::DumpMapResponse, Status>>,
    mut env: DumpEnv,
) -> (u64, Result<(), Error>) {
    env.stats.active.fetch_add(1, Ordering::SeqCst);
    let _guard = ActiveGuard(env.stats.clone());
    let DumpJob {
        caller,
        map_ref,
        mut walker,
        layout,
        chunk,
        limit,
        key,
        slot: _slot,
        started,
    } = job;
    let name = map_ref.to_string();
    let canonical = map_ref.canonical();
    let meta = walker.meta().clone();
    let (mut sent, mut chunks) = (0u64, 0u64);
    loop {
        if *env.shutdown.borrow() {
            return (sent, Err(Error::ShuttingDown));
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
        let (w, res) = match read {
            Ok(r) => r,
            Err(e) => {
                let e = Error::Internal {
                    map: name,
                    message: format!("reader task failed: {e}"),
                };
                return (sent, Err(e));
            }
        };
        walker = w;
        env.stats.chunks_read.fetch_add(1, Ordering::Relaxed);
        let chunk_read = match res {
            Ok(c) => c,
            Err(e) => return (sent, Err(Error::from_walk(&name, e))),
        };
        let position = walker.position().clone();
        let complete = position == Position::End;
        // An empty chunk short of the end: the next bucket would overshoot.
        let limit_reached = limit != 0
            && (sent + chunk_read.as_ref().map_or(0, |c| c.count as u64) >= limit
                || chunk_read.as_ref().is_some_and(|c| c.count == 0) && !complete);
        let cursor = key.encode(&Cursor {
            identity: identity_digest(&caller.identity),
            map_ref: canonical.clone(),
            map_id: meta.id,
            fingerprint: meta.fingerprint(),
            position,
        });
        if let Some(c) = chunk_read.filter(|c| c.count > 0) {
            let count = c.count as u64;
            let msg = chunk_message(&meta, c, layout, cursor.clone());
            match send(tx, &mut env, msg).await {
                Sent::Yes => {}
                Sent::ClientGone => return (sent, Ok(())),
                Sent::Failed(e) => return (sent, Err(e)),
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
            return match send(tx, &mut env, last).await {
                Sent::Yes | Sent::ClientGone => (sent, Ok(())),
                Sent::Failed(e) => (sent, Err(e)),
            };
        }
    }
}

enum Sent {
    Yes,
    ClientGone,
    Failed(Error),
}

/// Queues one message, waiting at most the stall timeout for room.
async fn send(
    tx: &mpsc::Sender<Result<pb::DumpMapResponse, Status>>,
    env: &mut DumpEnv,
    msg: pb::DumpMapResponse,
) -> Sent {
    tokio::select! {
        r = tx.send(Ok(msg)) => if r.is_ok() { Sent::Yes } else { Sent::ClientGone },
        _ = tokio::time::sleep(env.stall_timeout) => Sent::Failed(Error::Stalled {
            secs: env.stall_timeout.as_secs(),
        }),
        _ = env.shutdown.wait_for(|s| *s) => Sent::Failed(Error::ShuttingDown),
    }
}

struct ActiveGuard(Arc<DumpStats>);

impl Drop for ActiveGuard {
    fn drop(&mut self) {
        self.0.active.fetch_sub(1, Ordering::SeqCst);
    }
}

/// Splits a kernel element value into the values of each possible CPU.
pub fn per_cpu_values(meta: &MapMeta, value: &[u8]) -> Vec<Vec<u8>> {
    let (stride, vs) = (meta.cpu_stride(), meta.value_size as usize);
    value.chunks(stride).map(|v| v[..vs].to_vec()).collect()
}

fn chunk_message(
    meta: &MapMeta,
    c: Chunk,
    layout: pb::Layout,
    cursor: String,
) -> pb::DumpMapResponse {
    let ks = meta.key_size as usize;
    let kvs = meta.kernel_value_size();
    let mut msg = pb::DumpMapResponse {
        cursor,
        ..Default::default()
    };
    match layout {
        pb::Layout::Entries => {
            msg.entries = (0..c.count)
                .map(|i| {
                    let key = c.keys[i * ks..(i + 1) * ks].to_vec();
                    let value = &c.values[i * kvs..(i + 1) * kvs];
                    if meta.per_cpu() {
                        pb::Entry {
                            key,
                            value: Vec::new(),
                            per_cpu_values: per_cpu_values(meta, value),
                        }
                    } else {
                        pb::Entry {
                            key,
                            value: value.to_vec(),
                            per_cpu_values: Vec::new(),
                        }
                    }
                })
                .collect();
        }
        pb::Layout::Packed => {
            let values = if meta.per_cpu() {
                let (stride, vs) = (meta.cpu_stride(), meta.value_size as usize);
                let mut out = Vec::with_capacity(c.count * meta.wire_value_size());
                for cpu_value in c.values.chunks(stride) {
                    out.extend_from_slice(&cpu_value[..vs]);
                }
                out
            } else {
                c.values
            };
            msg.packed = Some(pb::PackedEntries {
                count: c.count as u32,
                key_size: meta.key_size,
                value_stride: meta.wire_value_size() as u32,
                keys: c.keys,
                values,
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
