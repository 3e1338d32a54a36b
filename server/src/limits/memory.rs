//! Memory for what is queued to clients: each dump's [`Share`], the
//! [`Budget`] pool, and what a Lookup response keeps until it is written
//! ([`Held`]).

use std::sync::{
    Arc,
    atomic::{AtomicUsize, Ordering},
};

use tokio::sync::{Notify, OwnedSemaphorePermit, Semaphore, TryAcquireError};

use super::{LookupSlot, TrimGuard};

/// How `limits.max_queued_bytes` is split: each dump's share, and the pool.
pub(crate) fn split_memory(max_queued_bytes: usize, max_dumps: usize) -> (usize, usize) {
    let dumps = max_queued_bytes / 4 * 3;
    let share = dumps / max_dumps.max(1);
    (share.max(64 << 10), max_queued_bytes - dumps)
}

/// A pool of bytes for lookup responses being built and for entries larger
/// than a dump's share.
#[derive(Debug, Clone)]
pub(crate) struct Budget {
    sem: Arc<Semaphore>,
    total: u32,
}

/// Memory that one dump may hold queued: its chunks from the kernel read
/// until the transport has taken them.
#[derive(Debug)]
pub(crate) struct Share {
    cap: usize,
    held: AtomicUsize,
    freed: Notify,
}

/// Bytes taken from a [`Budget`] or a [`Share`]; given back on drop.
#[derive(Debug)]
pub(crate) struct Reservation {
    kind: Kind,
}

#[derive(Debug)]
enum Kind {
    Pool(Option<OwnedSemaphorePermit>),
    Share(usize, Arc<Share>),
}

impl Reservation {
    /// Bytes held.
    pub(crate) fn bytes(&self) -> usize {
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
    pub(crate) fn new(cap: usize) -> Arc<Self> {
        Arc::new(Self {
            cap,
            held: AtomicUsize::new(0),
            freed: Notify::new(),
        })
    }

    /// Takes up to `want` bytes and at least `floor` (at most the share)
    /// of what is free of the share; `None` when less than `floor` is free.
    pub(crate) fn try_reserve(self: &Arc<Self>, want: usize, floor: usize) -> Option<Reservation> {
        let floor = floor.clamp(1, self.cap);
        let free = self.cap.saturating_sub(self.held.load(Ordering::SeqCst));
        (free >= floor).then(|| self.force(want.clamp(floor, free)))
    }

    /// Takes `bytes`, over the share if need be (a hash bucket larger than
    /// asked for, or a dump whose queue is empty while the transport still
    /// holds its chunks).
    pub(crate) fn force(self: &Arc<Self>, bytes: usize) -> Reservation {
        self.held.fetch_add(bytes, Ordering::SeqCst);
        Reservation {
            kind: Kind::Share(bytes, self.clone()),
        }
    }

    /// Adds `bytes` to a reservation of this share, over the share if need
    /// be.
    pub(crate) fn grow(self: &Arc<Self>, r: &mut Reservation, bytes: usize) {
        if let Kind::Share(n, _) = &mut r.kind {
            *n += bytes;
            self.held.fetch_add(bytes, Ordering::SeqCst);
        }
    }

    /// Resolves once some of the share was given back, or [`Share::wake`]
    /// was called, since the last call (at once if that already happened: no
    /// wake-up is missed).
    pub(crate) async fn released(&self) {
        self.freed.notified().await;
    }

    /// Wakes the producer waiting in [`Share::released`].
    pub(crate) fn wake(&self) {
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
    pub(crate) fn new(total: usize) -> Self {
        let total = u32::try_from(total).unwrap_or(u32::MAX).max(1);
        Self {
            sem: Arc::new(Semaphore::new(total as usize)),
            total,
        }
    }

    /// Bytes reserved now.
    pub(crate) fn in_use(&self) -> usize {
        self.total as usize - self.sem.available_permits()
    }

    fn clamp(&self, bytes: usize) -> u32 {
        u32::try_from(bytes)
            .unwrap_or(u32::MAX)
            .clamp(1, self.total)
    }

    /// Takes `bytes` (capped at the whole budget) if they are free now.
    pub(crate) fn try_reserve(&self, bytes: usize) -> Option<Reservation> {
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
    pub(crate) async fn reserve(&self, want: usize, floor: usize) -> Reservation {
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

/// What a Lookup response keeps until the transport has written it or
/// dropped it: its lookup slot, the memory of the response, and its count
/// as a call in flight. So a response that waits in the transport for a
/// slow client still counts. (Clone, as the response's extensions require;
/// clones share one hold.)
#[derive(Debug, Clone)]
pub(crate) struct Held(#[expect(dead_code, reason = "kept for its drop")] Arc<HeldParts>);

#[derive(Debug)]
struct HeldParts {
    _slot: LookupSlot,
    _memory: Reservation,
    _trim: TrimGuard,
}

impl Held {
    /// Keeps `slot`, `memory` and `trim` until the last clone is dropped.
    pub(crate) fn new(slot: LookupSlot, memory: Reservation, trim: TrimGuard) -> Self {
        Self(Arc::new(HeldParts {
            _slot: slot,
            _memory: memory,
            _trim: trim,
        }))
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

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
