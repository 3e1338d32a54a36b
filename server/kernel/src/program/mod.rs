//! Walks inside the kernel: a walk program generated for one map and one
//! question ([`WalkPlan`]: which entries, grouped how, with which
//! aggregates), loaded as a syscall program and run once per walk with
//! `BPF_PROG_TEST_RUN`. It walks the map with `bpf_for_each_map_elem` and
//! keeps only the answer: its groups in a hash map of its own, its figures
//! in a one-element array. The verifier checks every program; one it
//! refuses is reported with its log, and the caller reads the map as
//! before.
//!
//! The walk holds no bucket lock: an entry replaced (deleted and inserted
//! again) while the walk runs can be missed or seen twice; an entry
//! updated in place is seen once. Needs Linux 5.13 (syscall programs,
//! `bpf_for_each_map_elem`) and CAP_BPF.
//!
//! Everything a walk program asks of the kernel (creating, writing,
//! reading and draining its own maps; loading it, with the verifier's log;
//! running it) goes through [`ProgramOps`]: the running [`Kernel`], or in
//! unit tests a script
//! (`fake::ScriptedKernel`, with the `fake` feature) that refuses, fails
//! and stops where the kernel will not on demand.

mod asm;
mod code;
mod cpus;
mod matches;
mod ops;
mod own;
pub(crate) mod plan;

use std::{
    ffi::CStr,
    io,
    os::fd::{BorrowedFd, RawFd},
};

pub use asm::AsmError;
pub use matches::{KeyOrder, Matches, byte_order, index_order};
pub use ops::{Kernel, ProgramLoad, ProgramMap, ProgramOps};
pub use own::{OwnIds, own_ids};
pub use plan::{
    AggOp, CmpOp, Cond, GroupPart, GroupTable, IntRead, IntSpec, MAX_DENSE_BYTES, Output,
    PlanError, Side, WalkPlan,
};

use aya_obj::generated::BPF_F_NO_PREALLOC;
use code::MapFds;

use crate::{
    BtfBuilder, IntEncoding, MapHandle, MapMeta, MapType,
    drain::{DrainError, Drainer},
    sys::{CreateMap, SyscallError},
    walk::Chunk,
};

/// The license the generated programs declare (they use no GPL-only
/// helper).
const LICENSE: &CStr = c"Apache-2.0";
/// The license of the program that counts a hash map's elements: the
/// kernel lets only programs of a GPL-compatible license call kernel
/// functions, and that program's six instructions are offered under
/// either license.
const COUNT_LICENSE: &CStr = c"Dual MIT/GPL";

/// Why a walk program cannot be loaded.
#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    /// `bpf_for_each_map_elem` does not walk maps of this type.
    #[error("bpf_for_each_map_elem does not walk {0} maps")]
    NotWalked(MapType),
    /// The question reads what a program cannot on this map.
    #[error(transparent)]
    Plan(#[from] PlanError),
    /// The program's code cannot be assembled.
    #[error(transparent)]
    Asm(#[from] AsmError),
    /// The kernel refused the program (`BPF_PROG_LOAD`: the verifier, or
    /// the kernel before it), its log kept.
    #[error("the kernel's verifier refused the scan program: {error}")]
    Refused {
        /// The error `BPF_PROG_LOAD` returned.
        error: SyscallError,
        /// The verifier's log (the end of it when it is long).
        log: String,
    },
    /// Creating its maps or loading its BTF failed.
    #[error(transparent)]
    Sys(#[from] SyscallError),
}

/// Why a run of a walk program failed.
#[derive(Debug, thiserror::Error)]
pub enum RunError {
    /// Writing or reading its scratch value, or the test run, failed.
    #[error(transparent)]
    Sys(#[from] SyscallError),
    /// Its output map could not be drained.
    #[error("BPF_MAP_LOOKUP_AND_DELETE_BATCH failed: {0}")]
    Drain(DrainError),
    /// The map is not of the shape the program was loaded for.
    #[error("the map is a {map:?}, the program walks a {program:?}")]
    OtherShape {
        /// The map's.
        map: Shape,
        /// The program's.
        program: Shape,
    },
    /// The program stopped on an error of its own: inserting into its
    /// output map failed with `errno` (other than E2BIG, a full map, which
    /// is [`WalkOutput::overflowed`]); ENOENT when its slot was empty.
    #[error(
        "bpf_map_update_elem (in the scan program) failed: {}",
        io::Error::from_raw_os_error(*errno)
    )]
    Program {
        /// The errno the program wrote in its scratch value.
        errno: i32,
    },
}

/// Why this kernel runs no walk program (the answer of [`supported`]).
#[derive(Debug, thiserror::Error)]
pub enum Unsupported {
    /// The probe's map could not be created.
    #[error("cannot create a map: {0}")]
    CreateMap(SyscallError),
    /// The kernel refused the probe's program.
    #[error("this kernel refuses scan programs ({error}): they need Linux 5.13 and CAP_BPF")]
    Refused {
        /// The error `BPF_PROG_LOAD` returned.
        error: SyscallError,
        /// The verifier's log.
        log: String,
    },
    /// The probe's program could not be loaded otherwise.
    #[error(transparent)]
    Load(LoadError),
    /// The probe's program counted its map of one entry wrong.
    #[error("a scan program counted {0} entries of a map of 1")]
    Miscounted(u64),
    /// The probe's program could not run.
    #[error("cannot run a scan program: {0}")]
    Run(RunError),
}

/// The map a walk program walks: its descriptor, and what the kernel says
/// about it.
#[derive(Debug, Clone, Copy)]
pub struct Target<'a> {
    fd: RawFd,
    /// The open descriptor (none for a map a script knows by number).
    open: Option<BorrowedFd<'a>>,
    meta: &'a MapMeta,
}

impl<'a> Target<'a> {
    /// An open map.
    pub fn of(map: &'a MapHandle) -> Self {
        Self {
            fd: map.raw_fd(),
            open: Some(map.fd()),
            meta: map.meta(),
        }
    }

    /// A map this process created.
    pub fn of_owned(map: &'a crate::OwnedMap) -> Self {
        use std::os::fd::{AsFd as _, AsRawFd as _};
        Self {
            fd: map.as_fd().as_raw_fd(),
            open: Some(map.as_fd()),
            meta: map.meta(),
        }
    }

    /// A map known by the number of its descriptor, for a [`ProgramOps`]
    /// other than the kernel (a script) that resolves it.
    pub fn new(fd: RawFd, meta: &'a MapMeta) -> Self {
        Self {
            fd,
            open: None,
            meta,
        }
    }
}

/// What of a map a walk program depends on: a map of the same shape is
/// walked by the same program (the kernel checks it when the map goes
/// into the program's slot).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Shape {
    pub map_type: MapType,
    pub key_size: u32,
    pub value_size: u32,
    pub flags: u32,
    /// An array's number of entries (the kernel's template of an array
    /// holds it); 0 for the other types.
    pub array_entries: u32,
    /// Its possible CPUs, for per-CPU maps.
    pub cpus: u32,
}

impl Shape {
    /// The shape of the map `meta` describes.
    pub fn of(meta: &MapMeta) -> Self {
        let array = matches!(meta.map_type, MapType::ARRAY | MapType::PERCPU_ARRAY);
        Self {
            map_type: meta.map_type,
            key_size: meta.key_size,
            value_size: meta.value_size,
            flags: meta.flags,
            array_entries: if array { meta.max_entries } else { 0 },
            cpus: if meta.per_cpu() {
                meta.possible_cpus
            } else {
                0
            },
        }
    }
}

/// A walk program, loaded for maps of one shape (by the running kernel,
/// unless `O` is another [`ProgramOps`]). It holds no reference to the
/// maps it walks: each run puts its map in the program's slot, and takes
/// it out again, so a map is kept alive by no cached program.
#[derive(Debug)]
pub struct WalkProgram<O: ProgramOps = Kernel> {
    ops: O,
    plan: WalkPlan,
    shape: Shape,
    prog: O::Program,
    /// An array of one map, holding the walked map while a run lasts.
    slot: O::Map,
    scratch: O::Map,
    /// The groups (or the entries taken), drained after each run; or the
    /// one-element array of a dense table, read and zeroed after each run.
    groups: Option<O::Map>,
    /// Whether it counts a hash map's entries from the kernel's counters,
    /// without walking them.
    counter: bool,
    /// Its program and maps listed as this process's own.
    _own: own::Registration,
}

/// One group a walk program found: its key, its count, its aggregates'
/// words.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WalkGroup {
    pub key: Vec<u8>,
    pub count: u64,
    pub words: Vec<(u64, u64)>,
}

/// What one run found.
#[derive(Debug, Clone, Default)]
pub struct WalkOutput {
    /// Entries the walk visited.
    pub visited: u64,
    /// Entries the condition took.
    pub matched: u64,
    pub groups: Vec<WalkGroup>,
    /// The entries taken ([`Output::Entries`]), each once, in no order.
    pub entries: Chunk,
    /// The groups (entries) reached `max_groups` and the walk stopped.
    pub overflowed: bool,
}

/// Map types `bpf_for_each_map_elem` walks.
pub fn walks(map_type: MapType) -> bool {
    matches!(
        map_type,
        MapType::HASH
            | MapType::ARRAY
            | MapType::PERCPU_HASH
            | MapType::PERCPU_ARRAY
            | MapType::LRU_HASH
            | MapType::LRU_PERCPU_HASH
    )
}

/// Whether this kernel runs walk programs (one that walks a map of its
/// own); the reason when not.
pub fn supported() -> Result<(), Unsupported> {
    supported_with(Kernel)
}

/// Whether the kernel behind `ops` runs walk programs: a program that
/// counts an array of one entry (an array's count is a walk; a hash map's,
/// on newer kernels, reads counters) loads, runs and counts 1.
pub fn supported_with<O: ProgramOps>(ops: O) -> Result<(), Unsupported> {
    let map = ops
        .create_map(&CreateMap {
            map_type: MapType::ARRAY.0,
            key_size: 4,
            value_size: 4,
            max_entries: 1,
            name: "bpfmapd_probe",
            ..Default::default()
        })
        .map_err(Unsupported::CreateMap)?;
    let target = map.target();
    let p = WalkProgram::load_with(&ops, target, &WalkPlan::count()).map_err(|e| match e {
        LoadError::Refused { error, log } => Unsupported::Refused { error, log },
        e => Unsupported::Load(e),
    })?;
    match p.run(target) {
        Ok(out) if out.visited == 1 => Ok(()),
        Ok(out) => Err(Unsupported::Miscounted(out.visited)),
        Err(e) => Err(Unsupported::Run(e)),
    }
}

impl WalkProgram {
    /// Generates, loads and checks the program of `plan` for maps of
    /// `target`'s shape.
    pub fn load(target: &MapHandle, plan: &WalkPlan) -> Result<Self, LoadError> {
        Self::load_with(Kernel, Target::of(target), plan)
    }

    /// Runs the walk of `map` once ([`run`](Self::run)).
    pub fn walk(&self, map: &MapHandle) -> Result<WalkOutput, RunError> {
        self.run(Target::of(map))
    }
}

impl<O: ProgramOps> WalkProgram<O> {
    /// Generates the program of `plan` over `target` and loads it through
    /// `ops`: refused before any call when the map's type is not walked or
    /// the plan reads past its key or value.
    pub fn load_with(ops: O, target: Target<'_>, plan: &WalkPlan) -> Result<Self, LoadError> {
        let meta = target.meta;
        if !walks(meta.map_type) {
            return Err(LoadError::NotWalked(meta.map_type));
        }
        let cpus = cpus_of(meta)?;
        plan.check(meta.key_size as usize, meta.value_size as usize, cpus)?;
        let scratch = ops.create_map(&CreateMap {
            map_type: MapType::ARRAY.0,
            key_size: 4,
            value_size: plan.scratch_size() as u32,
            max_entries: 1,
            name: "bpfmapd_scan",
            ..Default::default()
        })?;
        // The map is the kernel's template of what goes into the slot; the
        // slot keeps its shape, not the map.
        let slot = ops.create_map(&CreateMap {
            map_type: MapType::ARRAY_OF_MAPS.0,
            key_size: 4,
            value_size: 4,
            max_entries: 1,
            name: "bpfmapd_slot",
            inner_map: target.open,
            ..Default::default()
        })?;
        let groups = match output_map(plan, meta) {
            Some(params) => Some(ops.create_map(&params)?),
            None => None,
        };
        if plan.counts_only()
            && let Some(prog) = count_program(&ops, meta, &slot, &scratch)
        {
            let own = register(&ops, &prog, &[Some(&slot), Some(&scratch)]);
            return Ok(Self {
                ops,
                plan: plan.clone(),
                shape: Shape::of(meta),
                prog,
                slot,
                scratch,
                groups: None,
                counter: true,
                _own: own,
            });
        }
        let fds = MapFds {
            slot: slot.fd(),
            groups: groups.as_ref().map(ProgramMap::fd),
            scratch: scratch.fd(),
        };
        let (insns, callback) = plan.assemble(fds, cpus)?;
        let (btf, funcs) = functions(callback as u32);
        let prog = ops.load(&ProgramLoad {
            name: "bpfmapd_scan",
            license: LICENSE,
            insns: &insns,
            btf: &btf,
            funcs: &funcs,
        })?;
        let own = register(&ops, &prog, &[Some(&slot), Some(&scratch), groups.as_ref()]);
        Ok(Self {
            ops,
            plan: plan.clone(),
            shape: Shape::of(meta),
            prog,
            slot,
            scratch,
            groups,
            counter: false,
            _own: own,
        })
    }

    /// Whether it counts the entries from the kernel's counters of a hash
    /// map's elements rather than by walking them.
    pub fn counts_without_walking(&self) -> bool {
        self.counter
    }

    /// The shape of the maps it walks.
    pub fn shape(&self) -> Shape {
        self.shape
    }

    /// The kernel memory it holds while loaded: the program's, and its
    /// maps' (the output map's buckets, allocated when it was made, among
    /// them), in bytes.
    pub fn memory(&self) -> u64 {
        let maps = [Some(&self.slot), Some(&self.scratch), self.groups.as_ref()];
        let maps: u64 = maps.into_iter().flatten().map(ProgramMap::memory).sum();
        maps + self.ops.program_memory(&self.prog)
    }

    /// Runs the walk of `target` once (blocking: the walk of the whole
    /// map), leaving its groups map empty and its slot empty for the next
    /// run (also when the run failed).
    pub fn run(&self, target: Target<'_>) -> Result<WalkOutput, RunError> {
        let out = self.run_held(target);
        let emptied = self.release();
        let out = out?;
        emptied?;
        Ok(out)
    }

    /// Runs the walk of `target` once, as [`run`](Self::run) does, but
    /// leaves the map in the slot: the caller takes it out with
    /// [`release`](Self::release) before anything else runs the program.
    /// Taking a map out of a map of maps waits for an RCU grace period
    /// (milliseconds): a caller can wait for it off the path of the answer.
    pub fn run_held(&self, target: Target<'_>) -> Result<WalkOutput, RunError> {
        let shape = Shape::of(target.meta);
        if shape != self.shape {
            return Err(RunError::OtherShape {
                map: shape,
                program: self.shape,
            });
        }
        let zero = 0u32.to_ne_bytes();
        self.scratch
            .update(&zero, &vec![0u8; self.plan.scratch_size()])?;
        self.slot.update(&zero, &(target.fd as u32).to_ne_bytes())?;
        let ran = self.ops.test_run(&self.prog);
        let taken = self.take()?;
        ran?;
        let scratch = self.scratch.lookup(&zero)?.unwrap_or_default();
        let word = |at: i16| {
            let at = at as usize;
            scratch
                .get(at..at + 8)
                .map_or(0, |b| u64::from_ne_bytes(b.try_into().expect("8 bytes")))
        };
        let error = word(plan::ERROR) as i64;
        let full = -i64::from(libc::E2BIG);
        if error != 0 && error != full {
            return Err(RunError::Program {
                errno: -error as i32,
            });
        }
        let visited = word(plan::VISITED);
        let (groups, entries) = match taken {
            Taken::Entries(c) if self.plan.output == Output::Entries => (Vec::new(), c),
            Taken::Entries(c) => (self.groups_of(&c), Chunk::default()),
            Taken::Dense(table) => (self.dense_groups(&table), Chunk::default()),
        };
        // Each entry taken is counted in its group, or copied.
        let matched = match self.plan.table() {
            GroupTable::None => visited,
            _ if self.plan.output == Output::Entries => entries.count as u64,
            _ => groups.iter().map(|g| g.count).sum(),
        };
        Ok(WalkOutput {
            visited,
            matched,
            groups,
            entries,
            overflowed: error == full,
        })
    }

    /// Takes the walked map out of the slot (a slot already empty is
    /// left so): after it, the program holds no reference to the map.
    pub fn release(&self) -> Result<(), RunError> {
        Ok(self.slot.delete(&0u32.to_ne_bytes())?)
    }

    /// The groups in what the groups map held.
    fn groups_of(&self, drained: &Chunk) -> Vec<WalkGroup> {
        let Some(map) = &self.groups else {
            return Vec::new();
        };
        let (ks, vs) = (map.meta().key_size as usize, map.meta().value_size as usize);
        let key_len = usize::from(self.plan.key_len);
        (0..drained.count)
            .map(|i| {
                let v = &drained.values[i * vs..(i + 1) * vs];
                WalkGroup {
                    key: drained.keys[i * ks..i * ks + key_len].to_vec(),
                    ..self.group_of(v)
                }
            })
            .collect()
    }

    /// The groups of a dense table: the slots that counted entries, their
    /// keys made again from their indexes.
    fn dense_groups(&self, table: &[u8]) -> Vec<WalkGroup> {
        let size = self.plan.group_value_size();
        table
            .chunks_exact(size)
            .enumerate()
            .filter(|(_, v)| v[..8] != [0; 8])
            .map(|(index, v)| WalkGroup {
                key: self.plan.dense_key(index as u32),
                ..self.group_of(v)
            })
            .collect()
    }

    /// A group's count and words, from its value (its key left empty).
    fn group_of(&self, v: &[u8]) -> WalkGroup {
        let word = |at: usize| u64::from_ne_bytes(v[at..at + 8].try_into().expect("8"));
        WalkGroup {
            key: Vec::new(),
            count: word(0),
            words: (0..self.plan.aggs.len())
                .map(|a| (word(8 + 16 * a), word(16 + 16 * a)))
                .collect(),
        }
    }

    /// What the run left in its groups map, which is empty (a dense table
    /// zeroed) for the next run.
    fn take(&self) -> Result<Taken, RunError> {
        let Some(map) = &self.groups else {
            return Ok(Taken::Entries(Chunk::default()));
        };
        if !matches!(self.plan.table(), GroupTable::Dense { .. }) {
            return self.drain(map).map(Taken::Entries);
        }
        let zero = 0u32.to_ne_bytes();
        let size = map.meta().value_size as usize;
        let table = map.lookup(&zero)?.unwrap_or_else(|| vec![0; size]);
        map.update(&zero, &vec![0; size])?;
        Ok(Taken::Dense(table))
    }

    /// Reads and deletes every entry of the groups map.
    fn drain(&self, map: &O::Map) -> Result<Chunk, RunError> {
        let mut drainer = Drainer::with_ops(map, map.meta().clone()).map_err(RunError::Drain)?;
        let mut out = Chunk::default();
        while let Some(c) = drainer.next_chunk(4096).map_err(RunError::Drain)? {
            if c.count == 0 {
                break;
            }
            out.count += c.count;
            out.keys.extend_from_slice(&c.keys);
            out.values.extend_from_slice(&c.values);
        }
        Ok(out)
    }
}

/// What a run left in its groups map.
enum Taken {
    /// The entries of a hash map: groups, or the entries taken.
    Entries(Chunk),
    /// The value of a dense table.
    Dense(Vec<u8>),
}

/// Lists a loaded program and its maps as this process's own.
fn register<O: ProgramOps>(
    ops: &O,
    prog: &O::Program,
    maps: &[Option<&O::Map>],
) -> own::Registration {
    let ids = maps
        .iter()
        .flatten()
        .filter_map(|m| m.kernel_id())
        .collect();
    own::Registration::new(ids, ops.program_id(prog))
}

/// The map a program keeps its groups (or the entries it takes) in: a
/// hash map, or for a dense table an array of one element holding every
/// slot (the program points into it); none when it only counts.
fn output_map(plan: &WalkPlan, target: &MapMeta) -> Option<CreateMap<'static>> {
    let (key_size, value_size) = match plan.output {
        Output::Groups => (plan.group_key_size() as u32, plan.group_value_size() as u32),
        Output::Entries => (target.key_size, target.value_size),
    };
    let hash = CreateMap {
        map_type: MapType::HASH.0,
        key_size,
        value_size,
        max_entries: plan.max_groups.max(1),
        flags: BPF_F_NO_PREALLOC,
        name: "bpfmapd_groups",
        ..Default::default()
    };
    match plan.table() {
        GroupTable::None => None,
        GroupTable::Hash => Some(hash),
        GroupTable::Dense { slots } => Some(CreateMap {
            map_type: MapType::ARRAY.0,
            key_size: 4,
            value_size: slots * value_size,
            max_entries: 1,
            flags: 0,
            ..hash
        }),
    }
}

/// The possible CPUs of a per-CPU map, which a program reads every value
/// of (by their numbers: the possible CPUs must be numbered from 0 without
/// gaps); `None` for a map that is not per-CPU.
fn cpus_of(meta: &MapMeta) -> Result<Option<u16>, PlanError> {
    if !meta.per_cpu() {
        return Ok(None);
    }
    let cpus = u16::try_from(meta.possible_cpus).map_err(|_| PlanError::OtherCpus)?;
    if !cpus::numbered_from_zero() {
        return Err(PlanError::CpuNumbers);
    }
    Ok(Some(cpus))
}

/// The program that counts the entries of `target`, a hash map, from the
/// kernel's counters of its elements, when this kernel has them (hash
/// maps count their elements since Linux 6.6, when the function that sums
/// them came) and accepts the program; `None` otherwise (the entries are
/// then counted by walking them).
fn count_program<O: ProgramOps>(
    ops: &O,
    target: &MapMeta,
    slot: &O::Map,
    scratch: &O::Map,
) -> Option<O::Program> {
    if !matches!(
        target.map_type,
        MapType::HASH | MapType::PERCPU_HASH | MapType::LRU_HASH | MapType::LRU_PERCPU_HASH
    ) {
        return None;
    }
    let kfunc = ops.sum_elem_count()?;
    let insns = WalkPlan::assemble_count(slot.fd(), scratch.fd(), kfunc).ok()?;
    let mut b = BtfBuilder::new();
    let long = b.add_int("long", 8, IntEncoding::Signed);
    let ptr = b.add_ptr(0);
    let proto = b.add_func_proto(long, &[("ctx", ptr)]);
    let main = b.add_func("bpfmapd_count", proto, 1);
    ops.load(&ProgramLoad {
        name: "bpfmapd_count",
        license: COUNT_LICENSE,
        insns: &insns,
        btf: &b.to_bytes(),
        funcs: &[[0, main]],
    })
    .ok()
}

/// The BTF of the program's two functions (the walk, global; its
/// callback, static, as the verifier wants a callback) and their records.
fn functions(callback: u32) -> (Vec<u8>, [[u32; 2]; 2]) {
    let mut b = BtfBuilder::new();
    let long = b.add_int("long", 8, IntEncoding::Signed);
    let ptr = b.add_ptr(0);
    let main_proto = b.add_func_proto(long, &[("ctx", ptr)]);
    let main = b.add_func("bpfmapd_scan", main_proto, 1);
    let each_proto = b.add_func_proto(
        long,
        &[("map", ptr), ("key", ptr), ("value", ptr), ("ctx", ptr)],
    );
    let each = b.add_func("bpfmapd_each", each_proto, 0);
    (b.to_bytes(), [[0, main], [callback, each]])
}

#[cfg(test)]
mod fake_tests;
#[cfg(test)]
mod tests;
