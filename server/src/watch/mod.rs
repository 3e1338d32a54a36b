//! WatchMap: maps walked once per interval, compared with their previous
//! walk, and the changes sent to every watcher.
//!
//! - `state`: what a map held at its last scan, and the diff of a scan.
//! - `scanner`: one task per watched map and interval: the walk, the
//!   bounded history of recent scans' changes, the memory they take.
//! - `watcher`: one WatchMap call: its initial state (or the changes since
//!   its cursor), then each scan's changes filtered, projected and decoded,
//!   with deltas and rates; or, for an aggregated watch, its groups.
//!
//! A scanner is shared by every watcher of its map and interval and lives
//! for limits.watch_linger after its last watcher left, so that a client
//! that reconnects within it resumes exactly.

mod scanner;
mod start;
mod state;
mod watcher;

use std::{
    collections::HashMap,
    sync::{
        Arc, Mutex,
        atomic::{AtomicU64, AtomicUsize, Ordering},
    },
    time::Duration,
};

use tokio::sync::{Semaphore, watch};

pub(crate) use scanner::Scanner;
pub(crate) use start::start;
use watcher::parse_position;
pub(crate) use watcher::{Watch, WatchStream, spawn};

use crate::{
    error::Error,
    limits::SlotKey,
    maps::Catalog,
    model::{Caller, MapRef},
};

/// The bounds of watches (`limits.*watch*`).
#[derive(Debug, Clone, Copy)]
pub(crate) struct WatchLimits {
    /// The shortest interval a watch may ask for.
    pub(crate) min_interval: Duration,
    /// Memory for every watched map's state and history.
    pub(crate) max_bytes: usize,
    /// Scans whose changes are kept per map.
    pub(crate) history_scans: usize,
    /// Bytes of changes kept per map.
    pub(crate) history_bytes: usize,
    /// Watches at once, in all and per identity.
    pub(crate) max_watches: usize,
    pub(crate) max_per_identity: usize,
    /// How long a map stays watched after its last watcher left.
    pub(crate) linger: Duration,
    /// A watcher whose client takes nothing for this long is ended.
    pub(crate) stall_timeout: Duration,
}

/// What the metrics show of watches.
#[derive(Debug, Default)]
pub(crate) struct WatchStats {
    /// Walks made by scanners.
    pub(crate) scans: AtomicU64,
    /// Events and groups sent.
    pub(crate) events: AtomicU64,
    /// Watches that had to start again from a fresh state.
    pub(crate) resyncs: AtomicU64,
    /// Watch calls open.
    pub(crate) watchers: AtomicUsize,
    /// Maps (and intervals) being scanned.
    pub(crate) scanners: AtomicUsize,
    /// Bytes of state and history held.
    pub(crate) bytes: AtomicUsize,
}

/// Which scanner a watch shares: the kernel map and the interval.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub(crate) struct ScanKey {
    pub(crate) map: MapRef,
    pub(crate) map_id: u32,
    pub(crate) interval: Duration,
}

/// Every watch of the daemon.
#[derive(Debug)]
pub(crate) struct Watches {
    pub(crate) limits: WatchLimits,
    pub(crate) stats: Arc<WatchStats>,
    scanners: Mutex<HashMap<ScanKey, Arc<Scanner>>>,
    counts: Mutex<HashMap<SlotKey, usize>>,
    catalog: Catalog,
    readers: Arc<Semaphore>,
    stop: watch::Receiver<bool>,
}

/// A watch's place among the limits; released when dropped.
#[derive(Debug)]
pub(crate) struct Ticket {
    watches: Arc<Watches>,
    key: SlotKey,
    scanner: Arc<Scanner>,
}

impl Drop for Ticket {
    fn drop(&mut self) {
        let mut counts = self.watches.counts.lock().expect("watch counts");
        if let Some(n) = counts.get_mut(&self.key) {
            *n -= 1;
            if *n == 0 {
                counts.remove(&self.key);
            }
        }
        self.watches.stats.watchers.fetch_sub(1, Ordering::Relaxed);
        self.scanner.leave();
    }
}

impl Watches {
    pub(crate) fn new(
        limits: WatchLimits,
        catalog: Catalog,
        readers: Arc<Semaphore>,
        stop: watch::Receiver<bool>,
        stats: Arc<WatchStats>,
    ) -> Arc<Self> {
        Arc::new(Self {
            limits,
            stats,
            scanners: Mutex::default(),
            counts: Mutex::default(),
            catalog,
            readers,
            stop,
        })
    }

    /// Checks a requested interval against the minimum.
    pub(crate) fn interval(
        &self,
        asked: Option<&prost_types::Duration>,
    ) -> Result<Duration, Error> {
        let min = self.limits.min_interval;
        let Some(d) = asked else { return Ok(min) };
        let d = Duration::try_from(*d).map_err(|_| {
            Error::InvalidArgument("interval must be a positive duration, like \"1s\"".into())
        })?;
        if d < min {
            return Err(Error::InvalidArgument(format!(
                "interval {} is shorter than this server's minimum, {} (limits.min_watch_interval)",
                humantime_serde::re::humantime::format_duration(d),
                humantime_serde::re::humantime::format_duration(min)
            )));
        }
        if d > Duration::from_secs(3600) {
            return Err(Error::InvalidArgument(format!(
                "interval {} is longer than the maximum, 1h",
                humantime_serde::re::humantime::format_duration(d)
            )));
        }
        Ok(d)
    }

    /// A place for `caller`'s new watch of `key` (the scanner started if
    /// no other watch shares it), or RESOURCE_EXHAUSTED naming the limit.
    pub(crate) fn join(
        self: &Arc<Self>,
        caller: &Caller,
        key: ScanKey,
        meta: bpfmap_kernel::MapMeta,
    ) -> Result<Ticket, Error> {
        let slot = SlotKey::of(caller);
        {
            let mut counts = self.counts.lock().expect("watch counts");
            let total: usize = counts.values().sum();
            if total >= self.limits.max_watches {
                return Err(Error::ResourceExhausted(format!(
                    "the server runs its maximum of {} watches (limits.max_watches); retry later",
                    self.limits.max_watches
                )));
            }
            let mine = counts.entry(slot.clone()).or_default();
            if *mine >= self.limits.max_per_identity {
                return Err(Error::ResourceExhausted(format!(
                    "{slot} runs its maximum of {} watches (limits.max_watches_per_identity); end one first",
                    self.limits.max_per_identity
                )));
            }
            *mine += 1;
        }
        self.stats.watchers.fetch_add(1, Ordering::Relaxed);
        let scanner = {
            let mut scanners = self.scanners.lock().expect("scanners");
            let live = scanners.get(&key).filter(|s| s.join()).cloned();
            match live {
                Some(s) => s,
                None => {
                    let s = Scanner::start(self.clone(), key.clone(), meta);
                    scanners.insert(key, s.clone());
                    s
                }
            }
        };
        Ok(Ticket {
            watches: self.clone(),
            key: slot,
            scanner,
        })
    }

    /// A live scanner of kernel map `map_id` (any interval) whose last
    /// scan started within `max_age` and that still reads the map `meta`
    /// describes: its state can serve a reader that accepts a scan that
    /// old instead of walking the map again.
    pub(crate) fn fresh(
        &self,
        meta: &bpfmap_kernel::MapMeta,
        max_age: Duration,
    ) -> Option<Arc<Scanner>> {
        let scanners = self.scanners.lock().expect("scanners");
        scanners
            .iter()
            .filter(|(k, s)| k.map_id == meta.id && s.meta.fingerprint() == meta.fingerprint())
            .map(|(_, s)| s)
            .filter(|s| s.last_scan().is_some_and(|at| at.elapsed() <= max_age))
            .max_by_key(|s| s.last_scan())
            .cloned()
    }

    /// Forgets a scanner that stopped.
    fn remove(&self, s: &Scanner) {
        let mut scanners = self.scanners.lock().expect("scanners");
        if scanners
            .get(&s.key)
            .is_some_and(|x| std::ptr::eq(Arc::as_ptr(x), s))
        {
            scanners.remove(&s.key);
        }
    }

    /// Grows the memory in use by `n` bytes, unless that passes the limit.
    fn grow(&self, n: usize) -> Result<(), usize> {
        let max = self.limits.max_bytes;
        self.stats
            .bytes
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |used| {
                (used + n <= max).then_some(used + n)
            })
            .map(drop)
    }

    fn shrink(&self, n: usize) {
        self.stats.bytes.fetch_sub(n, Ordering::AcqRel);
    }
}

impl Ticket {
    pub(crate) fn scanner(&self) -> &Arc<Scanner> {
        &self.scanner
    }
}
