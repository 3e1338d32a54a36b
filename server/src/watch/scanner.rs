//! One watched map and interval: a task that walks the map every interval
//! on the blocking pool (one reader permit per walk, no dump slot), updates
//! its state, and keeps the changes of recent scans for the watchers.

use std::{
    collections::VecDeque,
    sync::{
        Arc, Mutex, Weak,
        atomic::{AtomicBool, Ordering},
    },
    time::{Duration, Instant, SystemTime},
};

use bpfmap_kernel::{
    MapMeta,
    walk::{Position, Walker},
};
use tokio::sync::watch;

use super::{
    ScanKey, Watches,
    state::{Changes, State},
};
use crate::{error::Error, model::MapRef};

/// Entries asked of the kernel per batched read.
const READ: u32 = 4096;

/// One scan: when, how long, and what changed since the previous one.
#[derive(Debug)]
pub(crate) struct Scan {
    pub(crate) revision: u64,
    pub(crate) time: SystemTime,
    pub(crate) at: Instant,
    /// When the previous scan started (none for the first).
    pub(crate) since: Option<Instant>,
    pub(crate) duration: Duration,
    pub(crate) scanned: u64,
    pub(crate) changes: Changes,
    /// The events built for the watches of each kind (by their events
    /// key), for the others of that kind.
    pub(crate) shared: Mutex<Vec<([u8; 16], SharedEvents)>>,
}

/// One kind of watch's events of a scan.
pub(crate) type SharedEvents = Arc<Vec<bpfmap_proto::v1::WatchEvent>>;

/// Kinds of watches whose events one scan keeps for sharing.
const SHARED_KINDS: usize = 4;
/// Events beyond which a scan's events are not kept for sharing (their
/// memory is not counted against max_watch_bytes).
const SHARED_EVENTS: usize = 65_536;

impl Scan {
    /// The events another watch of this kind built for this scan.
    pub(crate) fn shared_events(&self, key: &[u8; 16]) -> Option<SharedEvents> {
        let shared = self.shared.lock().expect("shared events");
        shared
            .iter()
            .find(|(k, _)| k == key)
            .map(|(_, e)| e.clone())
    }

    /// Keeps a watch's events of this scan for the others of its kind.
    pub(crate) fn share_events(&self, key: [u8; 16], events: SharedEvents) {
        if events.len() > SHARED_EVENTS {
            return;
        }
        let mut shared = self.shared.lock().expect("shared events");
        if shared.len() < SHARED_KINDS && !shared.iter().any(|(k, _)| *k == key) {
            shared.push((key, events));
        }
    }

    /// Seconds between the previous scan and this one (0 for the first).
    pub(crate) fn secs(&self) -> f64 {
        self.since
            .map_or(0.0, |s| self.at.saturating_duration_since(s).as_secs_f64())
    }
}

/// Why a scanner stopped; every watcher of it ends with this.
#[derive(Debug, Clone)]
pub(crate) enum Failure {
    Exhausted(String),
    NotFound(MapRef),
    Replaced(String),
    ShuttingDown,
    Other(String),
}

impl Failure {
    pub(crate) fn error(&self) -> Error {
        match self {
            Self::Exhausted(m) => Error::WatchTooLarge(m.clone()),
            Self::NotFound(m) => Error::MapNotFound(m.clone()),
            Self::Replaced(m) => Error::MapChanged(m.clone()),
            Self::ShuttingDown => Error::ShuttingDown,
            Self::Other(m) => Error::Internal {
                map: None,
                message: m.clone(),
            },
        }
    }

    fn of(e: Error) -> Self {
        match e {
            Error::MapNotFound(m) => Self::NotFound(m),
            Error::ShuttingDown => Self::ShuttingDown,
            e => Self::Other(e.to_string()),
        }
    }
}

/// The state with the revision of the scan it reflects.
#[derive(Debug)]
pub(crate) struct Locked {
    pub(crate) state: State,
    pub(crate) revision: u64,
}

#[derive(Debug, Default)]
struct Inner {
    history: VecDeque<Arc<Scan>>,
    history_bytes: usize,
    state_bytes: usize,
    entries: usize,
    entry_bytes: usize,
    watchers: usize,
    idle_since: Option<Instant>,
    failure: Option<Failure>,
    /// Bytes counted against limits.max_watch_bytes.
    accounted: usize,
    stopped: bool,
}

/// A watched map and interval.
#[derive(Debug)]
pub(crate) struct Scanner {
    pub(crate) key: ScanKey,
    pub(crate) meta: MapMeta,
    /// Distinguishes this scanner's revisions from those of an earlier one
    /// (or of an earlier run of the daemon).
    pub(crate) epoch: u64,
    pub(crate) state: tokio::sync::Mutex<Locked>,
    inner: Mutex<Inner>,
    latest: watch::Sender<u64>,
    watches: Weak<Watches>,
    cancelled: AtomicBool,
}

impl Scanner {
    /// Starts scanning `key` (with one watcher).
    pub(super) fn start(watches: Arc<Watches>, key: ScanKey, meta: MapMeta) -> Arc<Self> {
        let mut epoch = [0u8; 8];
        ring::rand::SecureRandom::fill(&ring::rand::SystemRandom::new(), &mut epoch)
            .expect("system randomness");
        let kvs = meta.kernel_value_size();
        let s = Arc::new(Self {
            state: tokio::sync::Mutex::new(Locked {
                state: State::new(meta.key_size as usize, kvs),
                revision: 0,
            }),
            key,
            meta,
            epoch: u64::from_le_bytes(epoch),
            inner: Mutex::new(Inner {
                watchers: 1,
                ..Inner::default()
            }),
            latest: watch::channel(0).0,
            watches: Arc::downgrade(&watches),
            cancelled: AtomicBool::new(false),
        });
        watches.stats.scanners.fetch_add(1, Ordering::Relaxed);
        tokio::spawn(s.clone().run(watches));
        s
    }

    /// One more watcher; false when the scanner has stopped.
    pub(super) fn join(&self) -> bool {
        let mut i = self.inner.lock().expect("scanner");
        if i.stopped {
            return false;
        }
        i.watchers += 1;
        i.idle_since = None;
        true
    }

    /// One watcher fewer.
    pub(super) fn leave(&self) {
        let mut i = self.inner.lock().expect("scanner");
        i.watchers -= 1;
        if i.watchers == 0 {
            i.idle_since = Some(Instant::now());
        }
    }

    /// The latest revision, to wait on.
    pub(crate) fn subscribe(&self) -> watch::Receiver<u64> {
        self.latest.subscribe()
    }

    /// Why the scanner stopped, if it did.
    pub(crate) fn failure(&self) -> Option<Failure> {
        self.inner.lock().expect("scanner").failure.clone()
    }

    /// When the last scan started, unless the scanner stopped or has not
    /// finished a scan.
    pub(crate) fn last_scan(&self) -> Option<Instant> {
        let i = self.inner.lock().expect("scanner");
        if i.stopped || i.failure.is_some() {
            return None;
        }
        i.history.back().map(|s| s.at)
    }

    /// Calls `each` with every entry of the state as of the last scan
    /// (blocking: the state is locked meanwhile) until it returns false;
    /// the number of entries it was given.
    pub(crate) fn each_entry(&self, mut each: impl FnMut(&[u8], &[u8]) -> bool) -> u64 {
        let locked = self.state.blocking_lock();
        let mut n = 0;
        for slot in 0..locked.state.slots() {
            let Some((key, value)) = locked.state.get(slot) else {
                continue;
            };
            n += 1;
            if !each(key, value) {
                break;
            }
        }
        n
    }

    /// The scans after `revision` up to the latest, or `None` when the
    /// history no longer holds all of them.
    pub(crate) fn scans_after(&self, revision: u64) -> Option<Vec<Arc<Scan>>> {
        let i = self.inner.lock().expect("scanner");
        let latest = i.history.back().map_or(0, |s| s.revision);
        if revision >= latest {
            return Some(Vec::new());
        }
        let first = i.history.front()?.revision;
        if first > revision + 1 {
            return None;
        }
        Some(
            i.history
                .iter()
                .filter(|s| s.revision > revision)
                .cloned()
                .collect(),
        )
    }

    /// Scan `revision`, if the history still holds it.
    pub(crate) fn scan(&self, revision: u64) -> Option<Arc<Scan>> {
        let i = self.inner.lock().expect("scanner");
        let first = i.history.front()?.revision;
        i.history
            .get(revision.checked_sub(first)? as usize)
            .filter(|s| s.revision == revision)
            .cloned()
    }

    async fn run(self: Arc<Self>, watches: Arc<Watches>) {
        let mut ticker = tokio::time::interval(self.key.interval);
        ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut stop = watches.stop.clone();
        let linger = watches.limits.linger;
        let failure = loop {
            tokio::select! {
                _ = ticker.tick() => {}
                _ = stop.wait_for(|s| *s) => break Some(Failure::ShuttingDown),
            }
            {
                let mut i = self.inner.lock().expect("scanner");
                if i.watchers == 0 && i.idle_since.is_some_and(|t| t.elapsed() >= linger) {
                    i.stopped = true;
                    break None;
                }
            }
            let Ok(permit) = watches.readers.clone().acquire_owned().await else {
                break Some(Failure::ShuttingDown);
            };
            let me = self.clone();
            let catalog = watches.catalog.clone();
            let result = tokio::task::spawn_blocking(move || me.scan_once(&catalog)).await;
            drop(permit);
            match result {
                Ok(Ok(scan)) => {
                    watches.stats.scans.fetch_add(1, Ordering::Relaxed);
                    if let Err(f) = self.publish(scan) {
                        break Some(f);
                    }
                }
                Ok(Err(f)) => break Some(f),
                Err(e) => break Some(Failure::Other(format!("scan failed: {e}"))),
            }
        };
        let freed = {
            let mut i = self.inner.lock().expect("scanner");
            i.stopped = true;
            i.failure = failure.or(i.failure.take());
            i.history.clear();
            std::mem::take(&mut i.accounted)
        };
        self.cancelled.store(true, Ordering::Relaxed);
        watches.shrink(freed);
        watches.remove(&self);
        watches.stats.scanners.fetch_sub(1, Ordering::Relaxed);
        // Wake every watcher: they find the failure.
        self.latest.send_modify(|_| {});
        // The state's memory goes with the last reference.
        let mut locked = self.state.lock().await;
        locked.state = State::new(0, 0);
    }

    /// Counts `need` bytes against the limit (growing or shrinking what
    /// this scanner has counted).
    fn account(&self, need: usize, entries: usize, entry_bytes: usize) -> Result<(), Failure> {
        let Some(watches) = self.watches.upgrade() else {
            return Err(Failure::ShuttingDown);
        };
        let mut i = self.inner.lock().expect("scanner");
        if need > i.accounted {
            let more = need - i.accounted;
            watches.grow(more).map_err(|used| {
                let max = watches.limits.max_bytes;
                Failure::Exhausted(format!(
                    "watching map {} needs more than {} bytes for its state and recent changes ({entries} entries read so far at about {entry_bytes} bytes each; up to {} for a full map of {} entries), beyond limits.max_watch_bytes ({max} bytes, {} in use by other watches); raise it or watch a smaller map",
                    self.key.map,
                    need,
                    entry_bytes * self.meta.max_entries as usize,
                    self.meta.max_entries,
                    used.saturating_sub(i.accounted),
                ))
            })?;
            i.accounted = need;
        } else if need < i.accounted {
            watches.shrink(i.accounted - need);
            i.accounted = need;
        }
        Ok(())
    }

    fn scan_once(&self, catalog: &crate::maps::Catalog) -> Result<Scan, Failure> {
        let at = Instant::now();
        let time = SystemTime::now();
        let handle = catalog.open(&self.key.map).map_err(Failure::of)?.handle;
        if handle.meta().id != self.key.map_id {
            return Err(Failure::Replaced(format!(
                "map {} was replaced while watched (kernel id {} is now {}); watch it again",
                self.key.map,
                self.key.map_id,
                handle.meta().id
            )));
        }
        if handle.meta().fingerprint() != self.meta.fingerprint() {
            return Err(Failure::Replaced(format!(
                "map {} changed while watched (its type, sizes, flags or name); watch it again",
                self.key.map
            )));
        }
        let (history, since) = {
            let i = self.inner.lock().expect("scanner");
            (i.history_bytes, i.history.back().map(|s| s.at))
        };
        let mut locked = self.state.blocking_lock();
        let (ks, vs) = (self.meta.key_size as usize, self.meta.kernel_value_size());
        let entry_bytes = locked.state.entry_bytes();
        let mut changes = locked.state.begin_scan();
        let mut walker = Walker::new(&handle, self.meta.clone(), Position::Start)
            .map_err(|e| Failure::of(Error::from_walk(&self.key.map, e)))?;
        let mut scanned = 0u64;
        loop {
            if self.cancelled.load(Ordering::Relaxed) {
                return Err(Failure::ShuttingDown);
            }
            let Some(c) = walker
                .next_chunk(READ)
                .map_err(|e| Failure::of(Error::from_walk(&self.key.map, e)))?
            else {
                break;
            };
            for i in 0..c.count {
                locked.state.see(
                    &c.keys[i * ks..(i + 1) * ks],
                    &c.values[i * vs..(i + 1) * vs],
                    &mut changes,
                );
            }
            scanned += c.count as u64;
            self.account(
                locked.state.bytes() + changes.bytes() + history,
                locked.state.len(),
                entry_bytes,
            )?;
            if *walker.position() == Position::End {
                break;
            }
        }
        locked.state.end_scan(&mut changes);
        locked.revision += 1;
        let (state_bytes, entries) = (locked.state.bytes(), locked.state.len());
        let revision = locked.revision;
        drop(locked);
        {
            let mut i = self.inner.lock().expect("scanner");
            i.state_bytes = state_bytes;
            i.entries = entries;
            i.entry_bytes = entry_bytes;
        }
        Ok(Scan {
            revision,
            time,
            at,
            since,
            duration: at.elapsed(),
            scanned,
            changes,
            shared: Mutex::default(),
        })
    }

    /// Adds a scan to the history (dropping the oldest beyond its bounds)
    /// and wakes the watchers.
    fn publish(&self, scan: Scan) -> Result<(), Failure> {
        let Some(watches) = self.watches.upgrade() else {
            return Err(Failure::ShuttingDown);
        };
        let (max_scans, max_bytes) = (
            watches.limits.history_scans.max(1),
            watches.limits.history_bytes,
        );
        let revision = scan.revision;
        let (need, entries) = {
            let mut i = self.inner.lock().expect("scanner");
            i.history_bytes += scan.changes.bytes();
            i.history.push_back(Arc::new(scan));
            while i.history.len() > max_scans
                || (i.history.len() > 1 && i.history_bytes > max_bytes)
            {
                let old = i.history.pop_front().expect("a scan");
                i.history_bytes -= old.changes.bytes();
            }
            (i.state_bytes + i.history_bytes, (i.entries, i.entry_bytes))
        };
        self.account(need, entries.0, entries.1)?;
        self.latest.send_replace(revision);
        Ok(())
    }
}
