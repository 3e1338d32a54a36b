//! Dump slots (how many dumps run at once, in all and per caller) and
//! lookup slots.

use std::{
    collections::HashMap,
    net::IpAddr,
    sync::{
        Arc, Mutex,
        atomic::{AtomicU64, Ordering},
    },
    time::Duration,
};

// The runtime's clock (the same as the system's outside tests that pause
// it), so that hold times can be tested without waiting.
use tokio::{
    sync::{Notify, OwnedSemaphorePermit, Semaphore},
    time::Instant,
};

use crate::{
    error::Error,
    model::{Caller, Identity},
};

/// Whose dumps count against the per-caller limit: the identity of a TLS
/// caller, the process of a local caller on the Unix socket, or for
/// plaintext TCP callers (all `anonymous`) the peer's address.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub(crate) enum SlotKey {
    /// An authenticated identity.
    Identity(Identity),
    /// An anonymous caller, by address.
    Peer(Option<IpAddr>),
    /// A local process (and its user).
    Process(u32, Option<u32>),
}

impl SlotKey {
    /// The key of a caller.
    pub(crate) fn of(caller: &Caller) -> Self {
        match &caller.identity {
            Identity::Anonymous => Self::Peer(caller.peer.map(|p| p.ip())),
            Identity::Uid(uid) => Self::Process(*uid, caller.process),
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
            Self::Process(uid, Some(pid)) => write!(f, "local process {pid} (uid:{uid})"),
            Self::Process(uid, None) => write!(f, "local caller uid:{uid}"),
        }
    }
}

/// How many dumps run at once, in all and per caller.
#[derive(Debug)]
pub(crate) struct DumpSlots {
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
    /// Told of every refusal: a holder waiting on its client looks at once
    /// whether its slot is wanted.
    refused: Notify,
}

/// A running dump's claim on both limits; released on drop.
#[derive(Debug)]
pub(crate) struct Slot {
    _global: OwnedSemaphorePermit,
    _key: OwnedSemaphorePermit,
    key: SlotKey,
    taken: Instant,
}

impl Slot {
    /// How long the slot has been held.
    pub(crate) fn held(&self) -> Duration {
        self.taken.elapsed()
    }
}

impl DumpSlots {
    /// Slots for `global_max` dumps, at most `per_key_max` per caller.
    pub(crate) fn new(global_max: usize, per_key_max: usize) -> Self {
        Self {
            global: Arc::new(Semaphore::new(global_max)),
            global_max,
            per_key_max,
            per_key: Mutex::new(HashMap::new()),
            epoch: Instant::now(),
            refused_global: AtomicU64::new(0),
            refused_key: Mutex::new(HashMap::new()),
            refusals: AtomicU64::new(0),
            refused: Notify::new(),
        }
    }

    /// Dumps refused a slot since start.
    pub(crate) fn refused(&self) -> u64 {
        self.refusals.load(Ordering::Relaxed)
    }

    /// Slots held now.
    pub(crate) fn in_use(&self) -> usize {
        self.global_max - self.global.available_permits()
    }

    fn now_ms(&self) -> u64 {
        self.epoch.elapsed().as_millis() as u64 + 1
    }

    /// Takes a slot, or RESOURCE_EXHAUSTED naming the limit that was hit.
    pub(crate) fn try_acquire(&self, caller: &Caller) -> Result<Slot, Error> {
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
            self.refused.notify_waiters();
            Error::ResourceExhausted(format!(
                "{key} already runs {} dumps (limits.max_dumps_per_identity); retry when one has finished",
                self.per_key_max
            ))
        })?;
        let global = self.global.clone().try_acquire_owned().map_err(|_| {
            self.refusals.fetch_add(1, Ordering::Relaxed);
            self.refused_global.store(self.now_ms(), Ordering::Relaxed);
            self.refused.notify_waiters();
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
    pub(crate) fn contended(&self, slot: &Slot, window: Duration) -> bool {
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

    /// Whether `slot` has been held for `max_hold` while a dump that would
    /// share its limits was refused within as long: it must be given up.
    pub(crate) fn expired(&self, slot: &Slot, max_hold: Duration) -> bool {
        slot.held() >= max_hold && self.contended(slot, max_hold)
    }

    /// Resolves once `slot` has [`expired`](Self::expired), whatever its
    /// holder is waiting on: at the end of its hold if someone was refused
    /// by then, or at the next refusal after that.
    pub(crate) async fn expiry(&self, slot: &Slot, max_hold: Duration) {
        loop {
            let refused = self.refused.notified();
            tokio::pin!(refused);
            // Registered before looking: no refusal is missed in between.
            refused.as_mut().enable();
            if self.expired(slot, max_hold) {
                return;
            }
            let left = max_hold.saturating_sub(slot.held());
            if left.is_zero() {
                refused.await;
            } else {
                tokio::time::sleep(left).await;
            }
        }
    }
}

/// One Lookup in flight ([`LookupSlots::try_acquire`]); released on drop.
#[derive(Debug)]
pub(crate) struct LookupSlot(
    #[expect(dead_code, reason = "held for its drop")] OwnedSemaphorePermit,
);

/// Lookups in flight.
#[derive(Debug)]
pub(crate) struct LookupSlots {
    sem: Arc<Semaphore>,
    max: usize,
}

impl LookupSlots {
    /// At most `max` lookups at once.
    pub(crate) fn new(max: usize) -> Self {
        Self {
            sem: Arc::new(Semaphore::new(max)),
            max,
        }
    }

    /// A slot, or RESOURCE_EXHAUSTED.
    pub(crate) fn try_acquire(&self) -> Result<LookupSlot, Error> {
        self.sem
            .clone()
            .try_acquire_owned()
            .map(LookupSlot)
            .map_err(|_| {
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
            process: None,
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

    #[tokio::test(start_paused = true)]
    async fn a_held_slot_expires_at_the_first_refusal_after_its_hold() {
        let slots = DumpSlots::new(4, 1);
        let a = caller(Identity::Cn("a".into()), "10.0.0.1:1");
        let held = slots.try_acquire(&a).unwrap();
        let hold = Duration::from_secs(5);
        {
            let expiry = slots.expiry(&held, hold);
            tokio::pin!(expiry);
            // Not wanted by anyone: kept past its hold.
            assert!(
                tokio::time::timeout(Duration::from_secs(30), expiry.as_mut())
                    .await
                    .is_err()
            );
            // A refusal of the same caller ends it at once.
            slots.try_acquire(&a).unwrap_err();
            tokio::time::timeout(Duration::from_millis(1), expiry)
                .await
                .expect("expired at the refusal");
        }
        // A slot refused to others while young lasts out its hold.
        drop(held);
        let young = slots.try_acquire(&a).unwrap();
        slots.try_acquire(&a).unwrap_err();
        let started = tokio::time::Instant::now();
        slots.expiry(&young, hold).await;
        assert_eq!(started.elapsed(), hold);
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
}
