//! Walks inside the kernel for the daemon's callers: the walk programs
//! generated for a map and a question (`bpfmap_kernel::program`), cached
//! per map and plan, at most `MAX_PROGRAMS` and each unloaded after `IDLE`
//! unused (a loaded program keeps its map alive); a plan the verifier
//! refused is not tried again for that map, and its log is logged once.
//! What cannot run in the kernel is said (the note) and read in batches.

use std::{
    collections::HashSet,
    sync::{
        Arc, Mutex, OnceLock,
        atomic::{AtomicU64, Ordering},
    },
    time::{Duration, Instant},
};

use bpfmap_kernel::{
    MapHandle, MapMeta, MapType, SyscallError,
    program::{self, LoadError, RunError, Unsupported, WalkOutput, WalkPlan, WalkProgram},
};

/// Programs kept loaded.
const MAX_PROGRAMS: usize = 256;
/// A program unused this long is unloaded.
const IDLE: Duration = Duration::from_secs(300);
/// Refused plans remembered.
const MAX_REFUSED: usize = 1024;

/// What the metrics show of walks inside the kernel.
#[derive(Debug, Default)]
pub(crate) struct ProgramStats {
    /// Walks run inside the kernel.
    pub(crate) runs: AtomicU64,
    /// Programs loaded (the verifier accepted them).
    pub(crate) loads: AtomicU64,
    /// Programs the verifier refused.
    pub(crate) refusals: AtomicU64,
    /// Aggregates that asked for a walk inside the kernel (SCAN_AUTO) and read
    /// the map in batches.
    pub(crate) fallbacks: AtomicU64,
}

/// The daemon's walk programs.
#[derive(Debug, Default)]
pub(crate) struct WalkPrograms {
    programs: Mutex<Vec<Cached>>,
    refused: Mutex<HashSet<(u32, [u8; 8], WalkPlan)>>,
    pub(crate) stats: ProgramStats,
    /// Turned off (tests of the batched path): every walk falls back.
    disabled: bool,
}

#[derive(Debug)]
struct Cached {
    map: (u32, [u8; 8]),
    plan: WalkPlan,
    program: Arc<Mutex<WalkProgram>>,
    used: Instant,
}

/// Why a walk program does not run for a map and a question: said to the
/// caller (a summary's note) and the map read in batches.
#[derive(Debug, thiserror::Error)]
pub(crate) enum Unavailable {
    /// The daemon runs none (`kernel_scans = false`).
    #[error("scans in the kernel are turned off")]
    TurnedOff,
    /// This kernel runs none (probed once).
    #[error(transparent)]
    Kernel(&'static Unsupported),
    /// `bpf_for_each_map_elem` does not walk maps of this type.
    #[error("bpf_for_each_map_elem does not walk {0} maps")]
    NotWalked(MapType),
    /// The verifier refused this plan's program for this map before.
    #[error("the kernel's verifier refused this scan's program")]
    RefusedBefore,
    /// The verifier refused this plan's program for this map now.
    #[error("the kernel's verifier refused this scan's program ({0})")]
    Refused(SyscallError),
    /// The program could not be loaded otherwise.
    #[error(transparent)]
    Load(LoadError),
    /// The program failed while it ran.
    #[error("the scan program failed: {0}")]
    Failed(RunError),
}

/// Whether this kernel runs walk programs (probed once).
fn kernel_support() -> Result<(), &'static Unsupported> {
    static SUPPORT: OnceLock<Result<(), Unsupported>> = OnceLock::new();
    SUPPORT
        .get_or_init(|| {
            let r = program::supported();
            if let Err(e) = &r {
                tracing::info!(reason = %e, "scans in the kernel are unavailable; aggregates read maps in batches");
            }
            r
        })
        .as_ref()
        .map(|_| ())
}

impl WalkPrograms {
    /// Walk programs that always fall back (for comparing both paths).
    pub(crate) fn disabled() -> Self {
        Self {
            disabled: true,
            ..Self::default()
        }
    }

    /// Why aggregates of a map like `meta`'s cannot run in the kernel,
    /// whatever they ask; `None` when they can.
    pub(crate) fn unavailable(&self, meta: &MapMeta) -> Option<Unavailable> {
        if self.disabled {
            return Some(Unavailable::TurnedOff);
        }
        if let Err(e) = kernel_support() {
            return Some(Unavailable::Kernel(e));
        }
        (!program::walks(meta.map_type)).then_some(Unavailable::NotWalked(meta.map_type))
    }

    /// Number of programs loaded.
    pub(crate) fn loaded(&self) -> usize {
        self.programs.lock().expect("walk programs").len()
    }

    /// Runs `plan` over `handle`'s map in the kernel (blocking), or says
    /// why it cannot (the caller then reads the map in batches).
    pub(crate) fn run(
        &self,
        handle: &MapHandle,
        plan: &WalkPlan,
    ) -> Result<WalkOutput, Unavailable> {
        let result = self.program(handle, plan).and_then(|p| {
            let p = p.lock().expect("walk program");
            p.run().map_err(Unavailable::Failed)
        });
        match &result {
            Ok(_) => self.stats.runs.fetch_add(1, Ordering::Relaxed),
            Err(_) => self.stats.fallbacks.fetch_add(1, Ordering::Relaxed),
        };
        result
    }

    /// The program of `plan` for the map, loaded if it is not.
    fn program(
        &self,
        handle: &MapHandle,
        plan: &WalkPlan,
    ) -> Result<Arc<Mutex<WalkProgram>>, Unavailable> {
        if let Some(why) = self.unavailable(handle.meta()) {
            return Err(why);
        }
        let meta = handle.meta();
        let map = (meta.id, meta.fingerprint());
        {
            let mut programs = self.programs.lock().expect("walk programs");
            programs.retain(|c| c.used.elapsed() < IDLE);
            let hit = programs
                .iter_mut()
                .find(|c| c.map == map && c.plan == *plan);
            if let Some(c) = hit {
                c.used = Instant::now();
                return Ok(c.program.clone());
            }
        }
        let refused_key = (map.0, map.1, plan.clone());
        if self.refused.lock().expect("refused").contains(&refused_key) {
            return Err(Unavailable::RefusedBefore);
        }
        let program = match WalkProgram::load(handle, plan) {
            Ok(p) => Arc::new(Mutex::new(p)),
            Err(LoadError::Refused { error, log }) => {
                self.stats.refusals.fetch_add(1, Ordering::Relaxed);
                let mut refused = self.refused.lock().expect("refused");
                if refused.len() >= MAX_REFUSED {
                    refused.clear();
                }
                refused.insert(refused_key);
                tracing::warn!(map = meta.id, %error, verifier_log = %log, "the kernel's verifier refused a scan program; this aggregate reads the map in batches");
                return Err(Unavailable::Refused(error));
            }
            Err(e) => return Err(Unavailable::Load(e)),
        };
        self.stats.loads.fetch_add(1, Ordering::Relaxed);
        let mut programs = self.programs.lock().expect("walk programs");
        if programs.len() >= MAX_PROGRAMS
            && let Some(oldest) = (0..programs.len()).min_by_key(|&i| programs[i].used)
        {
            programs.swap_remove(oldest);
        }
        programs.push(Cached {
            map,
            plan: plan.clone(),
            program: program.clone(),
            used: Instant::now(),
        });
        Ok(program)
    }
}

#[cfg(test)]
mod tests {
    use bpfmap_kernel::{
        MapType, OwnedMap,
        program::{CmpOp, Cond, IntRead, IntSpec, Side, WalkPlan},
    };

    use super::*;

    /// The plan that counts the entries whose key is below `k`.
    fn below(k: i128) -> WalkPlan {
        let member = IntSpec {
            side: Side::Key,
            bit_offset: 0,
            bits: 32,
            signed: false,
            big_endian: false,
        };
        let key = IntRead::new(member, 4).unwrap();
        WalkPlan {
            output: bpfmap_kernel::program::Output::Groups,
            filter: Cond::Cmp(key, CmpOp::Lt, k),
            group: Vec::new(),
            key_len: 0,
            aggs: vec![bpfmap_kernel::program::AggOp::Count],
            max_groups: 1,
        }
    }

    #[test]
    fn programs_are_cached_per_plan_and_bounded_in_number() {
        let map = OwnedMap::new(MapType::HASH, 4, 4, 256, "scans_test")
            .expect("a hash map: these tests need root and BPF");
        for i in 0u32..100 {
            map.update(&i.to_ne_bytes(), &[0; 4]).unwrap();
        }
        let handle = map.handle().unwrap();
        let programs = WalkPrograms::default();
        let count = |k: i128| programs.run(&handle, &below(k)).unwrap().matched;
        assert_eq!(count(10), 10);
        assert_eq!(count(10), 10);
        assert_eq!(
            programs.stats.loads.load(Ordering::Relaxed),
            1,
            "the same plan runs the cached program"
        );
        for k in 0..MAX_PROGRAMS as i128 + 6 {
            assert_eq!(count(k), k.min(100) as u64);
        }
        assert_eq!(programs.loaded(), MAX_PROGRAMS);
        assert_eq!(
            programs.stats.runs.load(Ordering::Relaxed),
            2 + MAX_PROGRAMS as u64 + 6
        );
        // The least recently used went first: plan 0, run again, is loaded again.
        let loads = programs.stats.loads.load(Ordering::Relaxed);
        assert_eq!(count(0), 0);
        assert_eq!(programs.stats.loads.load(Ordering::Relaxed), loads + 1);
        assert_eq!(programs.loaded(), MAX_PROGRAMS);
    }

    #[test]
    fn turned_off_every_walk_falls_back_and_says_why() {
        let map = OwnedMap::new(MapType::HASH, 4, 4, 4, "scans_test").unwrap();
        let programs = WalkPrograms::disabled();
        let e = programs.run(&map.handle().unwrap(), &below(1)).unwrap_err();
        assert!(matches!(e, Unavailable::TurnedOff), "{e:?}");
        assert_eq!(e.to_string(), "scans in the kernel are turned off");
        assert_eq!(programs.stats.fallbacks.load(Ordering::Relaxed), 1);
        assert_eq!(programs.loaded(), 0);
    }
}
