//! DrainMap: a map's entries read and deleted in batches, each chunk
//! spooled durably before it is sent and kept until acknowledged.
//!
//! - `spool`: the chunk files of one map's drain.
//! - this module: which maps may be drained, one drain per map at a time,
//!   and the call itself (redeliver the spool, then drain).

mod spool;
mod start;

use std::{
    collections::HashSet,
    path::PathBuf,
    sync::{
        Arc, Mutex,
        atomic::{AtomicU64, Ordering},
    },
    time::{Duration, Instant},
};

use bpfmap_kernel::{
    MapHandle, MapMeta,
    walk::{Chunk, Position},
};
use bpfmap_proto::v1 as pb;
use globset::{GlobSet, GlobSetBuilder};
use tokio::sync::watch;

use crate::{
    cursor::Sealer,
    error::Error,
    maps::Decoder,
    model::{Identity, MapRef},
    wire,
    wire::feed::{self, Fed, Feed},
};

use spool::Spooled;
pub(crate) use spool::{Spool, SpoolError};
pub(crate) use start::start;

/// Entries per kernel call unless the request asks for fewer (and within
/// [`CHUNK_BYTES`]).
pub(crate) const DEFAULT_CHUNK: u32 = 65536;
/// How long a call waits for another call on the same map to end.
pub(crate) const BUSY_WAIT: Duration = Duration::from_secs(2);
/// The most bytes of entries (in the kernel's layout) one chunk holds:
/// each chunk costs an fsync of its spool file and of the directory.
const CHUNK_BYTES: usize = 512 << 10;

/// What the metrics show of drains.
#[derive(Debug, Default)]
pub(crate) struct DrainStats {
    /// Entries read and deleted from kernel maps.
    pub(crate) drained: AtomicU64,
    /// Entries written to spools.
    pub(crate) spooled: AtomicU64,
    /// Entries sent again from spools.
    pub(crate) redelivered: AtomicU64,
    /// Entries acknowledged (removed from spools).
    pub(crate) acknowledged: AtomicU64,
}

/// Every drain of the daemon.
#[derive(Debug)]
pub(crate) struct Drains {
    drainable: GlobSet,
    patterns: Vec<String>,
    dir: PathBuf,
    busy: Mutex<HashSet<String>>,
    pub(crate) max_spool_bytes: u64,
    pub(crate) stats: Arc<DrainStats>,
}

/// A map's drain in progress; the map is free again when dropped.
#[derive(Debug)]
pub(crate) struct Busy {
    drains: Arc<Drains>,
    key: String,
}

impl Drop for Busy {
    fn drop(&mut self) {
        self.drains.busy.lock().expect("drains").remove(&self.key);
    }
}

/// A digest of an identity, as spool files keep it.
pub(crate) fn identity_digest(identity: &Identity) -> [u8; 16] {
    let d = ring::digest::digest(&ring::digest::SHA256, identity.to_string().as_bytes());
    d.as_ref()[..16].try_into().expect("16 bytes")
}

impl Drains {
    /// The drains of a daemon whose configuration names `patterns` as
    /// drainable, spooling under `state_dir/spool`.
    pub(crate) fn new(
        patterns: &[String],
        state_dir: &std::path::Path,
        max_spool_bytes: u64,
        stats: Arc<DrainStats>,
    ) -> anyhow::Result<Arc<Self>> {
        let mut b = GlobSetBuilder::new();
        for p in patterns {
            b.add(
                globset::GlobBuilder::new(p)
                    .literal_separator(true)
                    .build()
                    .map_err(|e| anyhow::anyhow!("drain.maps: {p:?}: {e}"))?,
            );
        }
        Ok(Arc::new(Self {
            drainable: b.build()?,
            patterns: patterns.to_vec(),
            dir: state_dir.join("spool"),
            busy: Mutex::default(),
            max_spool_bytes,
            stats,
        }))
    }

    /// FAILED_PRECONDITION unless the configuration names `map` as
    /// drainable.
    pub(crate) fn check_drainable(&self, map: &MapRef) -> Result<(), Error> {
        let named = match map {
            MapRef::Path(p) => self.drainable.is_match(p),
            MapRef::Id(_) | MapRef::Inner { .. } => false,
        };
        if named {
            return Ok(());
        }
        let which = if self.patterns.is_empty() {
            "names no map (`[drain] maps` is empty)".to_owned()
        } else {
            format!("names only {:?}", self.patterns)
        };
        Err(Error::NotDrainable(format!(
            "map {map} is not drainable: the server's configuration {which}{}; every other map is opened read-only",
            if !matches!(map, MapRef::Path(_)) {
                " (drains name maps by path)"
            } else {
                ""
            }
        )))
    }

    /// The map's drain. A call that finds another draining the map waits
    /// for it up to [`BUSY_WAIT`] (a client resuming after a cut connection
    /// finds its old call ending), then gets ABORTED.
    pub(crate) async fn start(self: &Arc<Self>, map: &MapRef) -> Result<Busy, Error> {
        let key = map.to_string();
        let deadline = Instant::now() + BUSY_WAIT;
        while !self.busy.lock().expect("drains").insert(key.clone()) {
            if Instant::now() >= deadline {
                return Err(Error::DrainBusy(format!(
                    "another DrainMap call is draining map {map}: one drain per map at a time; retry when it ends"
                )));
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        Ok(Busy {
            drains: self.clone(),
            key,
        })
    }

    /// The spool directory of `map`.
    pub(crate) fn spool_dir(&self, map: &MapRef) -> PathBuf {
        let d = ring::digest::digest(&ring::digest::SHA256, map.to_string().as_bytes());
        let hex: String = d.as_ref()[..12]
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect();
        self.dir.join(hex)
    }
}

/// A drain cursor's position: the chunk's sequence.
pub(crate) fn position(sequence: u64) -> Vec<u8> {
    let mut t = vec![b'D'];
    t.extend_from_slice(&sequence.to_le_bytes());
    t
}

/// The sequence of a drain cursor's position.
pub(crate) fn parse_position(t: &[u8]) -> Option<u64> {
    (t.len() == 9 && t[0] == b'D').then(|| u64::from_le_bytes(t[1..9].try_into().expect("8")))
}

/// A DrainMap call, checked and its map opened for writing.
pub(crate) struct DrainCall {
    pub(crate) map: MapRef,
    pub(crate) handle: MapHandle,
    pub(crate) meta: MapMeta,
    pub(crate) decoder: Option<Decoder>,
    pub(crate) sealer: Sealer,
    pub(crate) identity: [u8; 16],
    pub(crate) spool: Spool,
    pub(crate) acknowledged: u64,
    pub(crate) limit: u64,
    pub(crate) chunk: u32,
    pub(crate) max_spool_bytes: u64,
    pub(crate) stats: Arc<DrainStats>,
    pub(crate) stop: watch::Receiver<bool>,
    pub(crate) stall_timeout: Duration,
    /// Held for the call: one drain per map.
    pub(crate) _busy: Busy,
}

impl std::fmt::Debug for DrainCall {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DrainCall").field("map", &self.map).finish()
    }
}

/// The response stream of a DrainMap call.
pub(crate) type DrainStream = Fed<pb::DrainMapResponse>;

/// What the call did, for its summary and the audit log.
#[derive(Debug, Default, Clone, Copy)]
pub(crate) struct Totals {
    pub(crate) entries: u64,
    pub(crate) chunks: u64,
    pub(crate) drained: u64,
    pub(crate) redelivered: u64,
}

fn io_error(e: std::io::Error) -> Error {
    Error::Internal {
        map: None,
        message: format!("the drain spool cannot be written: {e}"),
    }
}

/// Starts the call's task.
pub(crate) fn spawn(call: DrainCall, mut audit: crate::access::Record) -> DrainStream {
    let (tx, stream) = feed::channel(2);
    tokio::spawn(async move {
        let started = Instant::now();
        let map = call.map.clone();
        let acknowledged = call.acknowledged;
        let rt = tokio::runtime::Handle::current();
        let tx = Arc::new(tx);
        let feed = tx.clone();
        let (result, totals) = tokio::task::spawn_blocking(move || {
            let mut call = call;
            let mut totals = Totals::default();
            let r = run(&mut call, &rt, &feed, &mut totals, started);
            drop(call);
            (r, totals)
        })
        .await
        .unwrap_or_else(|e| {
            (
                Err(Error::Internal {
                    map: None,
                    message: format!("drain worker failed: {e}"),
                }),
                Totals::default(),
            )
        });
        audit.add_entries(totals.entries);
        tracing::info!(
            target: "bpfmapd::audit",
            map = %map,
            drained = totals.drained,
            acknowledged,
            redelivered = totals.redelivered,
            "drain"
        );
        // The blocking task has ended: this is the last reference.
        let tx = Arc::into_inner(tx).expect("the drain's only feed");
        audit.finish(tx.finish(result, tonic::Code::Ok));
    });
    stream
}

/// Queues a message for the client (blocking: the call runs on the
/// blocking pool), waiting at most the stall timeout.
fn send(
    rt: &tokio::runtime::Handle,
    tx: &Feed<pb::DrainMapResponse>,
    msg: pb::DrainMapResponse,
    stall: Duration,
) -> Result<(), Error> {
    rt.block_on(tx.send(msg, stall))
}

/// The message of a spooled chunk, its entries decoded as `decoder` says.
fn message(
    meta: &MapMeta,
    s: Spooled,
    decoder: Option<&Decoder>,
    redelivered: bool,
) -> pb::DrainMapResponse {
    let chunk = Chunk {
        count: s.count as usize,
        keys: s.keys,
        values: s.values,
    };
    // A chunk spooled from an earlier map of another shape is sent as bytes.
    let same = meta.key_size == s.key_size && meta.kernel_value_size() == s.value_size as usize;
    let entries = if same {
        wire::entries(meta, &chunk, decoder)
    } else {
        let mut m = meta.clone();
        m.key_size = s.key_size;
        m.value_size = s.value_size;
        m.map_type = bpfmap_kernel::MapType::HASH;
        wire::entries(&m, &chunk, None)
    };
    pb::DrainMapResponse {
        entries,
        cursor: s.cursor,
        sequence: s.sequence,
        redelivered,
        ..Default::default()
    }
}

/// The call (blocking): the spool, then the drain.
fn run(
    call: &mut DrainCall,
    rt: &tokio::runtime::Handle,
    tx: &Feed<pb::DrainMapResponse>,
    totals: &mut Totals,
    started: Instant,
) -> Result<(), Error> {
    // The spool first, as it was sent.
    redeliver(call, rt, tx, totals)?;
    let (paused, complete) = drain(call, rt, tx, totals)?;
    let summary = pb::DrainSummary {
        entries: totals.entries,
        chunks: totals.chunks,
        drained: totals.drained,
        redelivered: totals.redelivered,
        acknowledged: call.acknowledged,
        spooled: call.spool.entries(),
        complete,
        elapsed: prost_types::Duration::try_from(started.elapsed()).ok(),
        paused,
    };
    let msg = pb::DrainMapResponse {
        done: true,
        summary: Some(summary),
        ..Default::default()
    };
    send(rt, tx, msg, call.stall_timeout)
}

/// Sends the spool again, as it was sent; MapChanged when it held chunks
/// of a map since replaced.
fn redeliver(
    call: &mut DrainCall,
    rt: &tokio::runtime::Handle,
    tx: &Feed<pb::DrainMapResponse>,
    totals: &mut Totals,
) -> Result<(), Error> {
    let stall = call.stall_timeout;
    let mut replaced = false;
    let pending: Vec<_> = call.spool.pending().to_vec();
    for e in &pending {
        let s = call.spool.read(e)?;
        if s.identity != call.identity {
            return Err(Error::NotDrainable(format!(
                "the spool of map {} holds chunks drained by another identity: they are delivered only to it",
                call.map
            )));
        }
        replaced |= s.map_id != call.meta.id;
        let n = u64::from(s.count);
        send(
            rt,
            tx,
            message(&call.meta, s, call.decoder.as_ref(), true),
            stall,
        )?;
        totals.entries += n;
        totals.redelivered += n;
        totals.chunks += 1;
        call.stats.redelivered.fetch_add(n, Ordering::Relaxed);
    }
    if replaced {
        return Err(Error::MapChanged(format!(
            "map {} was replaced (its kernel id is now {}) while its spool held chunks of the old map: they were delivered; acknowledge them, then drain again",
            call.map, call.meta.id
        )));
    }
    Ok(())
}

/// Drains the map a chunk at a time, each spooled before it is sent,
/// until it is empty, the call's limit is reached or the spool is full;
/// returns why it paused (empty if it did not) and whether the map was
/// emptied.
fn drain(
    call: &mut DrainCall,
    rt: &tokio::runtime::Handle,
    tx: &Feed<pb::DrainMapResponse>,
    totals: &mut Totals,
) -> Result<(String, bool), Error> {
    let (ks, vs) = (call.meta.key_size as usize, call.meta.kernel_value_size());
    let per_chunk = call
        .chunk
        .min((CHUNK_BYTES / (ks + vs).max(1)).max(1) as u32)
        .max(1);
    let mut drainer = bpfmap_kernel::drain::Drainer::new(&call.handle)
        .map_err(|e| Error::NotDrainable(format!("map {}: {e}", call.map)))?;
    loop {
        if *call.stop.borrow() {
            return Err(Error::ShuttingDown);
        }
        if call.limit != 0 && totals.drained >= call.limit {
            return Ok(("limit reached".into(), false));
        }
        let room = call.max_spool_bytes.saturating_sub(call.spool.bytes());
        let want_bytes = u64::from(per_chunk) * (ks + vs) as u64;
        if room < want_bytes.min(call.max_spool_bytes) {
            let paused = format!(
                "spool full ({} bytes unacknowledged, limits.max_drain_spool_bytes is {}): acknowledge what you received; the rest stays in the map",
                call.spool.bytes(),
                call.max_spool_bytes
            );
            return Ok((paused, false));
        }
        let chunk = drainer.next_chunk(per_chunk).map_err(|e| Error::Internal {
            map: Some(call.map.clone()),
            message: format!("lookup-and-delete failed: {e}"),
        })?;
        let Some(c) = chunk else {
            return Ok((String::new(), true));
        };
        let s = spooled(call, c);
        // Durable before it is sent.
        call.spool.write(&s).map_err(io_error)?;
        let n = u64::from(s.count);
        call.stats.drained.fetch_add(n, Ordering::Relaxed);
        call.stats.spooled.fetch_add(n, Ordering::Relaxed);
        totals.drained += n;
        send(
            rt,
            tx,
            message(&call.meta, s, call.decoder.as_ref(), false),
            call.stall_timeout,
        )?;
        totals.entries += n;
        totals.chunks += 1;
    }
}

/// A drained chunk as the spool keeps it, with the next sequence and its
/// cursor.
fn spooled(call: &DrainCall, c: Chunk) -> Spooled {
    let sequence = call.spool.next_sequence();
    Spooled {
        sequence,
        map_id: call.meta.id,
        key_size: call.meta.key_size,
        value_size: call.meta.kernel_value_size() as u32,
        count: c.count as u32,
        identity: call.identity,
        cursor: call.sealer.seal(&Position::After(position(sequence))),
        keys: c.keys,
        values: c.values,
    }
}
