//! Bounds on what callers can make the daemon hold: dump slots (how many
//! dumps run at once, in all and per caller), memory for what is queued to
//! clients, and lookups in flight.
//!
//! Memory (`limits.max_queued_bytes`) is split so that no client can take
//! another's: three quarters are shared out equally among the dump slots (a
//! dump's [`Share`]: its queued chunks never exceed it, and nobody else can
//! use it, so a new dump always has room), and one quarter is the [`Budget`]
//! pool for lookup responses and for entries larger than a dump's share.
//!
//! A slot is taken when DumpMap is accepted and held by the producer for the
//! whole life of the stream (tonic's own limits only cover the response
//! future, not the stream behind it). A slot held longer than the hold time
//! while other dumps were refused is given back: the stream ends with
//! UNAVAILABLE and the client resumes from its cursor.
#![forbid(unsafe_code)]

use std::{
    collections::HashMap,
    net::IpAddr,
    sync::{
        Arc, Mutex,
        atomic::{AtomicU64, AtomicUsize, Ordering},
    },
    time::{Duration, Instant},
};

use tokio::sync::{Notify, OwnedSemaphorePermit, Semaphore, TryAcquireError};

use crate::{
    auth::{Caller, Identity},
    error::Error,
};

/// Whose dumps count against the per-caller limit: the identity, or for
/// plaintext callers (all `anonymous`) the peer's address.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum SlotKey {
    /// An authenticated identity.
    Identity(Identity),
    /// An anonymous caller, by address.
    Peer(Option<IpAddr>),
}

impl SlotKey {
    /// The key of a caller.
    pub fn of(caller: &Caller) -> Self {
        match &caller.identity {
            Identity::Anonymous => Self::Peer(caller.peer.map(|p| p.ip())),
            id => Self::Identity(id.clone()),
        }
    }
}

impl std::fmt::Display for SlotKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Identity(id) => write!(f, "{id}"),
            Self::Peer(Some(ip)) => write!(f, "anonymous caller {ip}"),
            Self::Peer(None) => f.write_str("anonymous caller"),
        }
    }
}

/// How many dumps run at once, in all and per caller.
#[derive(Debug)]
pub struct DumpSlots {
    global: Arc<Semaphore>,
    global_max: usize,
    per_key_max: usize,
    per_key: Mutex<HashMap<SlotKey, Arc<Semaphore>>>,
    epoch: Instant,
    /// When a dump was last refused a global slot (ms since `epoch`, 0: never).
    refused_global: AtomicU64,
    /// When each key was last refused a slot of its own.
    refused_key: Mutex<HashMap<SlotKey, Instant>>,
    /// Dumps refused a slot since start.
    refusals: AtomicU64,
}

/// A running dump's claim on both limits; released on drop.
#[derive(Debug)]
pub struct Slot {
    _global: OwnedSemaphorePermit,
    _key: OwnedSemaphorePermit,
    key: SlotKey,
    taken: Instant,
}

impl Slot {
    /// How long the slot has been held.
    pub fn held(&self) -> Duration {
        self.taken.elapsed()
    }
}

impl DumpSlots {
    /// Slots for `global_max` dumps, at most `per_key_max` per caller.
    pub fn new(global_max: usize, per_key_max: usize) -> Self {
        Self {
            global: Arc::new(Semaphore::new(global_max)),
            global_max,
            per_key_max,
            per_key: Mutex::new(HashMap::new()),
            epoch: Instant::now(),
            refused_global: AtomicU64::new(0),
            refused_key: Mutex::new(HashMap::new()),
            refusals: AtomicU64::new(0),
        }
    }

    /// Dumps refused a slot since start.
    pub fn refused(&self) -> u64 {
        self.refusals.load(Ordering::Relaxed)
    }

    /// Slots held now.
    pub fn in_use(&self) -> usize {
        self.global_max - self.global.available_permits()
    }

    fn now_ms(&self) -> u64 {
        self.epoch.elapsed().as_millis() as u64 + 1
    }

    /// Takes a slot, or RESOURCE_EXHAUSTED naming the limit that was hit.
    pub fn try_acquire(&self, caller: &Caller) -> Result<Slot, Error> {
        let key = SlotKey::of(caller);
        let key_permit = {
            let mut map = self.per_key.lock().expect("slots lock");
            // Forget callers with nothing running, so the map stays small.
            // (Under the lock, as is the acquisition below: a semaphore is
            // never dropped while a permit of it is being taken.)
            if map.len() > 1024 {
                let max = self.per_key_max;
                map.retain(|_, s| s.available_permits() < max);
            }
            map.entry(key.clone())
                .or_insert_with(|| Arc::new(Semaphore::new(self.per_key_max)))
                .clone()
                .try_acquire_owned()
        };
        let key_permit = key_permit.map_err(|_| {
            self.refusals.fetch_add(1, Ordering::Relaxed);
            let mut refused = self.refused_key.lock().expect("slots lock");
            if refused.len() > 1024 {
                refused.retain(|_, t| t.elapsed() < Duration::from_secs(600));
            }
            refused.insert(key.clone(), Instant::now());
            Error::ResourceExhausted(format!(
                "{key} already runs {} dumps (limits.max_dumps_per_identity); retry when one has finished",
                self.per_key_max
            ))
        })?;
        let global = self.global.clone().try_acquire_owned().map_err(|_| {
            self.refusals.fetch_add(1, Ordering::Relaxed);
            self.refused_global.store(self.now_ms(), Ordering::Relaxed);
            Error::ResourceExhausted(format!(
                "the server already runs {} dumps (limits.max_dumps); retry later",
                self.global_max
            ))
        })?;
        Ok(Slot {
            _global: global,
            _key: key_permit,
            key,
            taken: Instant::now(),
        })
    }

    /// Whether a dump that would share `slot`'s limits was refused within
    /// the last `window`: the slot is wanted by someone else.
    pub fn contended(&self, slot: &Slot, window: Duration) -> bool {
        let last = self.refused_global.load(Ordering::Relaxed);
        if last != 0 && self.now_ms().saturating_sub(last) <= window.as_millis() as u64 {
            return true;
        }
        self.refused_key
            .lock()
            .expect("slots lock")
            .get(&slot.key)
            .is_some_and(|t| t.elapsed() <= window)
    }
}

/// How `limits.max_queued_bytes` is split: each dump's share, and the pool.
pub fn split_memory(max_queued_bytes: usize, max_dumps: usize) -> (usize, usize) {
    let dumps = max_queued_bytes / 4 * 3;
    let share = dumps / max_dumps.max(1);
    (share.max(64 << 10), max_queued_bytes - dumps)
}

/// A pool of bytes for lookup responses being built and for entries larger
/// than a dump's share.
#[derive(Debug, Clone)]
pub struct Budget {
    sem: Arc<Semaphore>,
    total: u32,
}

/// Memory that one dump may hold queued: its chunks from the kernel read
/// until the transport has taken them.
#[derive(Debug)]
pub struct Share {
    cap: usize,
    held: AtomicUsize,
    freed: Notify,
}

/// Bytes taken from a [`Budget`] or a [`Share`]; given back on drop.
#[derive(Debug)]
pub struct Reservation {
    kind: Kind,
}

#[derive(Debug)]
enum Kind {
    Pool(Option<OwnedSemaphorePermit>),
    Share(usize, Arc<Share>),
}

impl Reservation {
    /// Bytes held.
    pub fn bytes(&self) -> usize {
        match &self.kind {
            Kind::Pool(p) => p.as_ref().map_or(0, |p| p.num_permits()),
            Kind::Share(n, _) => *n,
        }
    }
}

impl Drop for Reservation {
    fn drop(&mut self) {
        if let Kind::Share(n, share) = &self.kind {
            share.held.fetch_sub(*n, Ordering::SeqCst);
            share.freed.notify_one();
        }
    }
}

impl Share {
    /// A share of `cap` bytes.
    pub fn new(cap: usize) -> Arc<Self> {
        Arc::new(Self {
            cap,
            held: AtomicUsize::new(0),
            freed: Notify::new(),
        })
    }

    /// Takes up to `want` bytes and at least `floor` (at most the share)
    /// of what is free of the share; `None` when less than `floor` is free.
    pub fn try_reserve(self: &Arc<Self>, want: usize, floor: usize) -> Option<Reservation> {
        let floor = floor.clamp(1, self.cap);
        let free = self.cap.saturating_sub(self.held.load(Ordering::SeqCst));
        (free >= floor).then(|| self.force(want.clamp(floor, free)))
    }

    /// Takes `bytes`, over the share if need be (a hash bucket larger than
    /// asked for, or a dump whose queue is empty while the transport still
    /// holds its chunks).
    pub fn force(self: &Arc<Self>, bytes: usize) -> Reservation {
        self.held.fetch_add(bytes, Ordering::SeqCst);
        Reservation {
            kind: Kind::Share(bytes, self.clone()),
        }
    }

    /// Adds `bytes` to a reservation of this share, over the share if need
    /// be.
    pub fn grow(self: &Arc<Self>, r: &mut Reservation, bytes: usize) {
        if let Kind::Share(n, _) = &mut r.kind {
            *n += bytes;
            self.held.fetch_add(bytes, Ordering::SeqCst);
        }
    }

    /// Resolves once some of the share was given back, or [`Share::wake`]
    /// was called, since the last call (at once if that already happened: no
    /// wake-up is missed).
    pub async fn released(&self) {
        self.freed.notified().await;
    }

    /// Wakes the producer waiting in [`Share::released`].
    pub fn wake(&self) {
        self.freed.notify_one();
    }

    /// Bytes held now.
    #[cfg(test)]
    fn held(&self) -> usize {
        self.held.load(Ordering::SeqCst)
    }
}

impl Budget {
    /// A budget of `total` bytes (at most 4 GiB).
    pub fn new(total: usize) -> Self {
        let total = u32::try_from(total).unwrap_or(u32::MAX).max(1);
        Self {
            sem: Arc::new(Semaphore::new(total as usize)),
            total,
        }
    }

    /// Bytes reserved now.
    pub fn in_use(&self) -> usize {
        self.total as usize - self.sem.available_permits()
    }

    fn clamp(&self, bytes: usize) -> u32 {
        u32::try_from(bytes)
            .unwrap_or(u32::MAX)
            .clamp(1, self.total)
    }

    /// Takes `bytes` (capped at the whole budget) if they are free now.
    pub fn try_reserve(&self, bytes: usize) -> Option<Reservation> {
        match self.sem.clone().try_acquire_many_owned(self.clamp(bytes)) {
            Ok(p) => Some(Reservation {
                kind: Kind::Pool(Some(p)),
            }),
            Err(TryAcquireError::NoPermits) | Err(TryAcquireError::Closed) => None,
        }
    }

    /// Takes up to `want` bytes and at least `floor`: all of `want` when it
    /// is free; when the budget is tight, half of what is free (so that
    /// others get the rest), as long as that is at least `floor`; otherwise
    /// waits for `floor` bytes. Both are capped at the whole budget.
    pub async fn reserve(&self, want: usize, floor: usize) -> Reservation {
        let floor = self.clamp(floor);
        let want = self.clamp(want).max(floor);
        if let Some(r) = self.try_reserve(want as usize) {
            return r;
        }
        let half = (self.sem.available_permits() / 2) as u32;
        if half >= floor
            && let Ok(p) = self.sem.clone().try_acquire_many_owned(half.min(want))
        {
            return Reservation {
                kind: Kind::Pool(Some(p)),
            };
        }
        let permit = self
            .sem
            .clone()
            .acquire_many_owned(floor)
            .await
            .expect("the budget is never closed");
        Reservation {
            kind: Kind::Pool(Some(permit)),
        }
    }
}

/// Calls that allocate much (dumps, lookups) in flight. When the last one
/// ends, and no other starts for [`TRIM_DELAY`] (not between the calls of a
/// burst, and after the transport dropped its last buffers), the
/// allocator's free memory goes back to the system: glibc keeps what dumps
/// free for reuse, so a daemon that served many slow clients at once would
/// otherwise keep their memory. While calls run, freed buffers are reused
/// at once (no page faults per chunk).
#[derive(Debug, Clone, Default)]
pub struct Busy(Arc<BusyCounts>);

#[derive(Debug, Default)]
struct BusyCounts {
    /// Calls in flight.
    active: AtomicUsize,
    /// Calls started since the daemon started.
    started: AtomicU64,
}

/// How long the daemon waits, after its last call that allocated much
/// ended, before handing free memory back.
pub const TRIM_DELAY: Duration = Duration::from_secs(1);

impl Busy {
    /// A call starts; it ends when the token is dropped.
    pub fn enter(&self) -> BusyToken {
        self.0.started.fetch_add(1, Ordering::SeqCst);
        self.0.active.fetch_add(1, Ordering::SeqCst);
        BusyToken(self.0.clone())
    }
}

/// One call in flight ([`Busy::enter`]).
#[derive(Debug)]
pub struct BusyToken(Arc<BusyCounts>);

impl Drop for BusyToken {
    fn drop(&mut self) {
        if self.0.active.fetch_sub(1, Ordering::SeqCst) != 1 {
            return;
        }
        // Handed back only if no call started during the delay: a steady
        // stream of calls never trims.
        let (counts, started) = (self.0.clone(), self.0.started.load(Ordering::SeqCst));
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            runtime.spawn(async move {
                tokio::time::sleep(TRIM_DELAY).await;
                if counts.started.load(Ordering::SeqCst) == started
                    && counts.active.load(Ordering::SeqCst) == 0
                {
                    let _ = tokio::task::spawn_blocking(crate::kernel::release_free_memory).await;
                }
            });
        }
    }
}

/// Lookups in flight.
#[derive(Debug)]
pub struct LookupSlots {
    sem: Arc<Semaphore>,
    max: usize,
}

impl LookupSlots {
    /// At most `max` lookups at once.
    pub fn new(max: usize) -> Self {
        Self {
            sem: Arc::new(Semaphore::new(max)),
            max,
        }
    }

    /// A slot, or RESOURCE_EXHAUSTED.
    pub fn try_acquire(&self) -> Result<OwnedSemaphorePermit, Error> {
        self.sem.clone().try_acquire_owned().map_err(|_| {
            Error::ResourceExhausted(format!(
                "the server already runs {} lookups (limits.max_lookups); retry later",
                self.max
            ))
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn caller(identity: Identity, peer: &str) -> Caller {
        Caller {
            identity,
            peer: Some(peer.parse().unwrap()),
        }
    }

    #[test]
    fn limits_per_identity_and_in_all() {
        let slots = DumpSlots::new(3, 2);
        let a = caller(Identity::Cn("a".into()), "10.0.0.1:1");
        let b = caller(Identity::Cn("b".into()), "10.0.0.1:2");
        let a1 = slots.try_acquire(&a).unwrap();
        let _a2 = slots.try_acquire(&a).unwrap();
        assert!(!slots.contended(&a1, Duration::from_secs(60)));
        let e = slots.try_acquire(&a).unwrap_err();
        assert!(e.to_string().contains("max_dumps_per_identity"), "{e}");
        assert!(
            slots.contended(&a1, Duration::from_secs(60)),
            "a was refused"
        );
        let b1 = slots.try_acquire(&b).unwrap();
        assert!(!slots.contended(&b1, Duration::from_secs(60)), "b was not");
        let e = slots.try_acquire(&b).unwrap_err();
        assert!(e.to_string().contains("limits.max_dumps)"), "{e}");
        assert!(
            slots.contended(&b1, Duration::from_secs(60)),
            "global refusal"
        );
        drop(a1);
        slots
            .try_acquire(&b)
            .expect("a released slot is free again");
    }

    #[test]
    fn anonymous_callers_are_limited_per_address() {
        let slots = DumpSlots::new(10, 1);
        let one = caller(Identity::Anonymous, "127.0.0.1:1000");
        let same_host = caller(Identity::Anonymous, "127.0.0.1:2000");
        let other_host = caller(Identity::Anonymous, "127.0.0.2:1000");
        let _s = slots.try_acquire(&one).unwrap();
        let e = slots.try_acquire(&same_host).unwrap_err();
        assert!(e.to_string().contains("anonymous caller 127.0.0.1"), "{e}");
        slots
            .try_acquire(&other_host)
            .expect("another address has its own slots");
    }

    #[tokio::test]
    async fn the_budget_shrinks_reservations_when_tight_and_waits_when_empty() {
        let budget = Budget::new(1000);
        let a = budget.reserve(600, 10).await;
        assert_eq!(a.bytes(), 600);
        // 400 free: a request for 600 gets half of what is free.
        let b = budget.reserve(600, 10).await;
        assert_eq!(b.bytes(), 200);
        assert_eq!(budget.in_use(), 800);
        // 200 free, floor 300: waits until enough is given back.
        let waiting = tokio::spawn({
            let budget = budget.clone();
            async move { budget.reserve(300, 300).await.bytes() }
        });
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert!(!waiting.is_finished());
        drop(a);
        assert_eq!(waiting.await.unwrap(), 300);
        // Larger than the whole budget: capped at it.
        drop(b);
        assert_eq!(budget.reserve(5000, 5000).await.bytes(), 1000);
        assert_eq!(budget.in_use(), 0);
    }

    #[tokio::test]
    async fn a_share_gives_what_is_free_and_says_when_more_is() {
        let share = Share::new(1000);
        let a = share.try_reserve(700, 100).unwrap();
        assert_eq!(a.bytes(), 700);
        // 300 free: a request for 700 with a floor of 100 gets the 300.
        let mut b = share.try_reserve(700, 100).unwrap();
        assert_eq!(b.bytes(), 300);
        share.grow(&mut b, 50);
        assert_eq!(
            share.held(),
            1050,
            "a larger bucket is counted, over the share"
        );
        assert!(share.try_reserve(500, 200).is_none(), "nothing free");
        let waiting = tokio::spawn({
            let share = share.clone();
            async move { share.released().await }
        });
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert!(!waiting.is_finished(), "nothing released yet");
        drop(a);
        waiting.await.unwrap();
        assert_eq!(share.try_reserve(500, 200).unwrap().bytes(), 500);
        drop(b);
        assert_eq!(share.held(), 0);
        assert_eq!(share.force(3000).bytes(), 3000, "forced over the share");
        assert_eq!(share.held(), 0);
    }

    #[test]
    fn memory_is_split_between_the_dumps_and_the_pool() {
        assert_eq!(split_memory(48 << 20, 64), (576 << 10, 12 << 20));
        assert_eq!(split_memory(1 << 20, 1000), (64 << 10, 256 << 10));
    }
}
