//! Walks inside the kernel for the daemon's callers: the walk programs
//! generated for a shape of map and a question (`bpfmap_kernel::program`),
//! cached per shape and plan: at most `MAX_PROGRAMS`, and at most the
//! configured bytes of kernel memory (their maps' and their own), the least
//! recently used unloaded first, and each unloaded once `IDLE` unused (a
//! sweep every minute). A cached program holds no map it walked: a map goes
//! into its slot for one run, and is taken out right after it (off the
//! answer's path). A plan the verifier refused is not tried
//! again for that shape, and its log is logged once. What cannot run in the
//! kernel is said (the note) and read in batches.

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
    program::{
        self, LoadError, RunError, Shape, Target, Unsupported, WalkOutput, WalkPlan, WalkProgram,
    },
};

/// Programs kept loaded, at most.
const MAX_PROGRAMS: usize = 256;
/// A program unused this long is unloaded.
pub(crate) const IDLE: Duration = Duration::from_secs(300);
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
#[derive(Debug)]
pub(crate) struct WalkPrograms {
    cache: Mutex<Cache>,
    refused: Mutex<HashSet<(Shape, WalkPlan)>>,
    pub(crate) stats: ProgramStats,
    /// Turned off (tests of the batched path): every walk falls back.
    disabled: bool,
    /// Kernel memory the cached programs may hold, in bytes.
    max_bytes: u64,
}

/// The programs kept loaded, and the kernel memory they hold.
#[derive(Debug, Default)]
struct Cache {
    programs: Vec<Cached>,
    bytes: u64,
}

#[derive(Debug)]
struct Cached {
    shape: Shape,
    plan: WalkPlan,
    program: Arc<Mutex<WalkProgram>>,
    used: Instant,
    /// Kernel memory it holds.
    bytes: u64,
}

impl Cache {
    /// Unloads the program at `i`.
    fn remove(&mut self, i: usize) {
        let c = self.programs.swap_remove(i);
        self.bytes -= c.bytes;
    }

    /// Unloads the programs unused for `IDLE`.
    fn sweep(&mut self) {
        while let Some(i) = self.programs.iter().position(|c| c.used.elapsed() >= IDLE) {
            self.remove(i);
        }
    }

    /// Unloads the least recently used programs until one more of `bytes`
    /// fits within `max_bytes` and `MAX_PROGRAMS`.
    fn make_room(&mut self, bytes: u64, max_bytes: u64) {
        while !self.programs.is_empty()
            && (self.programs.len() >= MAX_PROGRAMS || self.bytes + bytes > max_bytes)
        {
            let oldest = (0..self.programs.len())
                .min_by_key(|&i| self.programs[i].used)
                .expect("not empty");
            self.remove(oldest);
        }
    }
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

fn lock(program: &Mutex<WalkProgram>) -> std::sync::MutexGuard<'_, WalkProgram> {
    program.lock().unwrap_or_else(|e| e.into_inner())
}

/// Takes the map a run left in `program`'s slot out of it, on a thread of
/// its own: taking a map out of a map of maps waits for an RCU grace
/// period (milliseconds), which the answer need not wait for. A run that
/// takes the program first puts its own map in the slot (the one left
/// there is replaced) and this takes that one out after it.
fn release_later(program: Arc<Mutex<WalkProgram>>) {
    let release = |p: &Mutex<WalkProgram>| {
        if let Err(error) = lock(p).release() {
            tracing::warn!(%error, "a scan program's slot could not be emptied: it holds the map it walked until its next run or until it is unloaded");
        }
    };
    let held = program.clone();
    let spawned = std::thread::Builder::new()
        .name("bpfmapd-slot".into())
        .spawn(move || release(&held));
    if spawned.is_err() {
        release(&program);
    }
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
    /// Walk programs holding at most `max_bytes` of kernel memory while
    /// cached.
    pub(crate) fn new(max_bytes: u64) -> Self {
        Self {
            cache: Mutex::default(),
            refused: Mutex::default(),
            stats: ProgramStats::default(),
            disabled: false,
            max_bytes,
        }
    }

    /// Walk programs that always fall back (for comparing both paths).
    pub(crate) fn disabled() -> Self {
        Self {
            disabled: true,
            ..Self::new(0)
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

    fn cache(&self) -> std::sync::MutexGuard<'_, Cache> {
        self.cache.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Number of programs loaded.
    pub(crate) fn loaded(&self) -> usize {
        self.cache().programs.len()
    }

    /// Kernel memory the loaded programs hold, in bytes.
    pub(crate) fn bytes(&self) -> u64 {
        self.cache().bytes
    }

    /// Unloads the programs unused for `IDLE`.
    pub(crate) fn sweep(&self) {
        self.cache().sweep();
    }

    /// Runs `plan` over `handle`'s map in the kernel (blocking), or says
    /// why it cannot (the caller then reads the map in batches).
    pub(crate) fn run(
        &self,
        handle: &MapHandle,
        plan: &WalkPlan,
    ) -> Result<WalkOutput, Unavailable> {
        let result = self.program(handle, plan).and_then(|p| {
            let out = lock(&p).run_held(Target::of(handle));
            release_later(p);
            out.map_err(Unavailable::Failed)
        });
        match &result {
            Ok(_) => self.stats.runs.fetch_add(1, Ordering::Relaxed),
            Err(_) => self.stats.fallbacks.fetch_add(1, Ordering::Relaxed),
        };
        result
    }

    /// The program of `plan` for maps of `handle`'s shape: cached, or
    /// loaded (and cached when it fits the cache's bytes).
    fn program(
        &self,
        handle: &MapHandle,
        plan: &WalkPlan,
    ) -> Result<Arc<Mutex<WalkProgram>>, Unavailable> {
        if let Some(why) = self.unavailable(handle.meta()) {
            return Err(why);
        }
        let shape = Shape::of(handle.meta());
        {
            let mut cache = self.cache();
            cache.sweep();
            let hit = cache
                .programs
                .iter_mut()
                .find(|c| c.shape == shape && c.plan == *plan);
            if let Some(c) = hit {
                c.used = Instant::now();
                return Ok(c.program.clone());
            }
        }
        let program = self.load(handle, plan, shape)?;
        let bytes = program.memory();
        let program = Arc::new(Mutex::new(program));
        let mut cache = self.cache();
        // One larger than the whole cache runs once, uncached.
        if bytes <= self.max_bytes {
            cache.make_room(bytes, self.max_bytes);
            cache.bytes += bytes;
            cache.programs.push(Cached {
                shape,
                plan: plan.clone(),
                program: program.clone(),
                used: Instant::now(),
                bytes,
            });
        }
        Ok(program)
    }

    /// Loads the program of `plan` for maps of `shape` (`handle`'s map
    /// the kernel's template), remembering a refusal.
    fn load(
        &self,
        handle: &MapHandle,
        plan: &WalkPlan,
        shape: Shape,
    ) -> Result<WalkProgram, Unavailable> {
        let refused_key = (shape, plan.clone());
        if self.refused.lock().expect("refused").contains(&refused_key) {
            return Err(Unavailable::RefusedBefore);
        }
        match WalkProgram::load(handle, plan) {
            Ok(p) => {
                self.stats.loads.fetch_add(1, Ordering::Relaxed);
                Ok(p)
            }
            Err(LoadError::Refused { error, log }) => {
                self.stats.refusals.fetch_add(1, Ordering::Relaxed);
                let mut refused = self.refused.lock().expect("refused");
                if refused.len() >= MAX_REFUSED {
                    refused.clear();
                }
                refused.insert(refused_key);
                let map = handle.meta().id;
                tracing::warn!(map, %error, verifier_log = %log, "the kernel's verifier refused a scan program; this aggregate reads the map in batches");
                Err(Unavailable::Refused(error))
            }
            Err(e) => Err(Unavailable::Load(e)),
        }
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
        let programs = WalkPrograms::new(u64::MAX);
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
    fn programs_are_shared_by_maps_of_a_shape_and_bounded_in_kernel_memory() {
        let maps: Vec<OwnedMap> = (0..2)
            .map(|_| OwnedMap::new(MapType::HASH, 4, 4, 256, "scans_test").unwrap())
            .collect();
        for (n, map) in maps.iter().enumerate() {
            for i in 0..(10 * (n as u32 + 1)) {
                map.update(&i.to_ne_bytes(), &[0; 4]).unwrap();
            }
        }
        let handles: Vec<MapHandle> = maps.iter().map(|m| m.handle().unwrap()).collect();
        // Two maps of one shape: one program, each map's own answer.
        let programs = WalkPrograms::new(u64::MAX);
        let count = |p: &WalkPrograms, h: &MapHandle, k: i128| p.run(h, &below(k)).unwrap().matched;
        assert_eq!(count(&programs, &handles[0], 100), 10);
        assert_eq!(count(&programs, &handles[1], 100), 20);
        assert_eq!(programs.stats.loads.load(Ordering::Relaxed), 1);
        let one = programs.bytes();
        assert!(one > 0, "a loaded program holds kernel memory");
        // A bound of three programs' memory: never more held, the least
        // recently used unloaded first.
        let bounded = WalkPrograms::new(3 * one + one / 2);
        for k in 0..10 {
            assert_eq!(count(&bounded, &handles[0], k), k.min(10) as u64);
            assert!(
                bounded.bytes() <= 3 * one + one / 2,
                "{} bytes",
                bounded.bytes()
            );
        }
        assert_eq!(bounded.loaded(), 3);
        assert_eq!(bounded.stats.loads.load(Ordering::Relaxed), 10);
        // One larger than the bound runs, and is not kept.
        let tiny = WalkPrograms::new(one / 2);
        assert_eq!(count(&tiny, &handles[1], 5), 5);
        assert_eq!((tiny.loaded(), tiny.bytes()), (0, 0));
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
