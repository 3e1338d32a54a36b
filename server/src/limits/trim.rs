//! Handing free memory back to the system once the daemon is idle.

use std::{
    sync::{
        Arc,
        atomic::{AtomicU64, AtomicUsize, Ordering},
    },
    time::Duration,
};

/// Calls that allocate much (dumps, lookups) in flight. When the last one
/// ends, and no other starts for [`TRIM_DELAY`] (not between the calls of a
/// burst, and after the transport dropped its last buffers), the
/// allocator's free memory goes back to the system: glibc keeps what dumps
/// free for reuse, so a daemon that served many slow clients at once would
/// otherwise keep their memory. While calls run, freed buffers are reused
/// at once (no page faults per chunk).
#[derive(Debug, Clone, Default)]
pub(crate) struct Trimmer(Arc<TrimCounts>);

#[derive(Debug, Default)]
struct TrimCounts {
    /// Calls in flight.
    active: AtomicUsize,
    /// Calls started since the daemon started.
    started: AtomicU64,
}

/// How long the daemon waits, after its last call that allocated much
/// ended, before handing free memory back.
pub(crate) const TRIM_DELAY: Duration = Duration::from_secs(1);

impl Trimmer {
    /// A call starts; it ends when the token is dropped.
    pub(crate) fn enter(&self) -> TrimGuard {
        self.0.started.fetch_add(1, Ordering::SeqCst);
        self.0.active.fetch_add(1, Ordering::SeqCst);
        TrimGuard(self.0.clone())
    }
}

/// One call in flight ([`Trimmer::enter`]).
#[derive(Debug)]
pub(crate) struct TrimGuard(Arc<TrimCounts>);

impl Drop for TrimGuard {
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
                    let _ = tokio::task::spawn_blocking(bpfmap_kernel::release_free_memory).await;
                }
            });
        }
    }
}
