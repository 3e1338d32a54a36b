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

mod asm;
mod matches;
mod plan;

use std::{
    ffi::CStr,
    os::fd::{AsFd, AsRawFd, OwnedFd},
};

pub use matches::{KeyOrder, Matches, byte_order, index_order};
pub use plan::{AggOp, CmpOp, Cond, GroupPart, IntRead, IntSpec, Output, Side, WalkPlan};

use aya_obj::generated::{BPF_F_NO_PREALLOC, BPF_F_SLEEPABLE, bpf_prog_type};
use plan::MapFds;

use crate::{
    BtfBuilder, IntEncoding, MapHandle, MapMeta, MapType, OwnedBtf, OwnedMap,
    btf::{Btf, Type},
    drain::Drainer,
    sys::{self, CreateMap, SyscallError},
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
    /// The map or the question is beyond what a generated program does.
    #[error("{0}")]
    Unsupported(String),
    /// The verifier refused the program (its log kept).
    #[error("the kernel's verifier refused the scan program: {error}")]
    Refused { error: SyscallError, log: String },
    /// Creating its maps or BTF failed.
    #[error(transparent)]
    Sys(#[from] SyscallError),
}

/// A walk program, loaded for one map.
#[derive(Debug)]
pub struct WalkProgram {
    plan: WalkPlan,
    prog: OwnedFd,
    scratch: OwnedMap,
    /// The groups, and a writable handle to drain them.
    groups: Option<(OwnedMap, MapHandle)>,
    /// Whether its condition takes every entry (matched = visited).
    unfiltered: bool,
    /// Whether it counts a hash map's entries from the kernel's counters,
    /// without walking them.
    counter: bool,
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
pub fn supported() -> Result<(), String> {
    // An array of one: its count is a walk (a hash map's, on newer
    // kernels, reads counters).
    let map = OwnedMap::new(MapType::ARRAY, 4, 4, 1, "bpfmapd_probe")
        .map_err(|e| format!("cannot create a map: {e}"))?;
    let handle = map
        .handle()
        .map_err(|e| format!("cannot open a map: {e}"))?;
    let p = WalkProgram::load(&handle, &WalkPlan::count()).map_err(|e| match e {
        LoadError::Refused { error, .. } => {
            format!("this kernel refuses scan programs ({error}): they need Linux 5.13 and CAP_BPF")
        }
        e => e.to_string(),
    })?;
    match p.run() {
        Ok(out) if out.visited == 1 => Ok(()),
        Ok(out) => Err(format!(
            "a scan program counted {} entries of a map of 1",
            out.visited
        )),
        Err(e) => Err(format!("cannot run a scan program: {e}")),
    }
}

impl WalkProgram {
    /// Generates, loads and checks the program of `plan` over `target`.
    pub fn load(target: &MapHandle, plan: &WalkPlan) -> Result<Self, LoadError> {
        let meta = target.meta();
        if !walks(meta.map_type) {
            return Err(LoadError::Unsupported(format!(
                "bpf_for_each_map_elem does not walk {} maps",
                meta.map_type
            )));
        }
        plan.check(
            meta.key_size as usize,
            meta.value_size as usize,
            meta.per_cpu(),
        )
        .map_err(LoadError::Unsupported)?;
        let scratch = OwnedMap::create(&CreateMap {
            map_type: MapType::ARRAY.0,
            key_size: 4,
            value_size: plan.scratch_size() as u32,
            max_entries: 1,
            name: "bpfmapd_scan",
            ..Default::default()
        })?;
        let groups = if plan.counts_only() {
            None
        } else {
            Some(output_map(plan, meta)?)
        };
        if plan.counts_only()
            && let Some(prog) = count_program(target, &scratch)
        {
            return Ok(Self {
                plan: plan.clone(),
                prog,
                scratch,
                groups: None,
                unfiltered: true,
                counter: true,
            });
        }
        let fds = MapFds {
            target: target.raw_fd(),
            groups: groups.as_ref().map(|(m, _)| m.as_fd().as_raw_fd()),
            scratch: scratch.as_fd().as_raw_fd(),
        };
        let (insns, callback) = plan
            .assemble(fds)
            .map_err(|e| LoadError::Unsupported(e.to_string()))?;
        let (btf, funcs) = functions(callback as u32)?;
        let prog = sys::prog_load(&sys::ProgLoad {
            prog_type: bpf_prog_type::BPF_PROG_TYPE_SYSCALL as u32,
            flags: BPF_F_SLEEPABLE,
            insns: &insns,
            license: LICENSE,
            name: "bpfmapd_scan",
            btf: btf.as_fd(),
            funcs: &funcs,
        })
        .map_err(|(error, log)| LoadError::Refused { error, log })?;
        Ok(Self {
            plan: plan.clone(),
            prog,
            scratch,
            groups,
            unfiltered: plan.filter.clone().simplified() == Cond::Const(true),
            counter: false,
        })
    }

    /// Whether it counts the entries from the kernel's counters of a hash
    /// map's elements rather than by walking them.
    pub fn counts_without_walking(&self) -> bool {
        self.counter
    }

    /// Runs the walk once (blocking: the walk of the whole map), leaving
    /// its groups map empty for the next run.
    pub fn run(&self) -> Result<WalkOutput, SyscallError> {
        let zero = 0u32.to_ne_bytes();
        self.scratch
            .update(&zero, &vec![0u8; self.plan.scratch_size()])?;
        let ran = sys::prog_test_run(self.prog.as_fd());
        let drained = self.drain()?;
        ran?;
        let scratch = self.scratch.lookup(&zero)?.unwrap_or_default();
        let word = |at: i16| {
            let at = at as usize;
            scratch
                .get(at..at + 8)
                .map_or(0, |b| u64::from_ne_bytes(b.try_into().expect("8 bytes")))
        };
        let error = word(plan::ERROR) as i64;
        if error != 0 && error != -i64::from(libc::E2BIG) {
            return Err(SyscallError {
                call: "bpf_map_update_elem (in the scan program)",
                io_error: std::io::Error::from_raw_os_error(-error as i32),
            });
        }
        let visited = word(plan::VISITED);
        let (groups, entries) = match self.plan.output {
            Output::Groups => (self.groups_of(&drained), Chunk::default()),
            Output::Entries => (Vec::new(), drained),
        };
        Ok(WalkOutput {
            visited,
            matched: if self.unfiltered {
                visited
            } else {
                word(plan::MATCHED)
            },
            groups,
            entries,
            overflowed: error == -i64::from(libc::E2BIG),
        })
    }

    /// The groups in what the groups map held.
    fn groups_of(&self, drained: &Chunk) -> Vec<WalkGroup> {
        let Some((_, handle)) = &self.groups else {
            return Vec::new();
        };
        let (ks, vs) = (
            handle.meta().key_size as usize,
            handle.meta().value_size as usize,
        );
        let key_len = usize::from(self.plan.key_len);
        (0..drained.count)
            .map(|i| {
                let v = &drained.values[i * vs..(i + 1) * vs];
                let word = |at: usize| u64::from_ne_bytes(v[at..at + 8].try_into().expect("8"));
                WalkGroup {
                    key: drained.keys[i * ks..i * ks + key_len].to_vec(),
                    count: word(0),
                    words: (0..self.plan.aggs.len())
                        .map(|a| (word(8 + 16 * a), word(16 + 16 * a)))
                        .collect(),
                }
            })
            .collect()
    }

    /// Reads and deletes every entry of the groups map.
    fn drain(&self) -> Result<Chunk, SyscallError> {
        let Some((_, handle)) = &self.groups else {
            return Ok(Chunk::default());
        };
        let mut drainer = Drainer::new(handle).map_err(|e| {
            SyscallError::invalid_input("BPF_MAP_LOOKUP_AND_DELETE_BATCH", e.to_string())
        })?;
        let mut out = Chunk::default();
        while let Some(c) = drainer.next_chunk(4096).map_err(|e| {
            SyscallError::invalid_input("BPF_MAP_LOOKUP_AND_DELETE_BATCH", e.to_string())
        })? {
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

/// The hash map a program keeps its groups (or the entries it takes) in,
/// and a writable handle to drain it.
fn output_map(plan: &WalkPlan, target: &MapMeta) -> Result<(OwnedMap, MapHandle), SyscallError> {
    let (key_size, value_size) = match plan.output {
        Output::Groups => (plan.group_key_size() as u32, plan.group_value_size() as u32),
        Output::Entries => (target.key_size, target.value_size),
    };
    let map = OwnedMap::create(&CreateMap {
        map_type: MapType::HASH.0,
        key_size,
        value_size,
        max_entries: plan.max_groups.max(1),
        flags: BPF_F_NO_PREALLOC,
        name: "bpfmapd_groups",
        ..Default::default()
    })?;
    let handle = map
        .handle()
        .map_err(|e| SyscallError::invalid_input("dup", e.to_string()))?;
    Ok((map, handle))
}

/// The kernel's BTF.
const VMLINUX: &str = "/sys/kernel/btf/vmlinux";

/// The BTF id of the function `bpf_map_sum_elem_count` in this kernel
/// (Linux 6.6), if it has one: looked up once, in the kernel's BTF read
/// and parsed once (about 6 MB, 10 ms).
fn sum_elem_count() -> Option<u32> {
    static ID: std::sync::OnceLock<Option<u32>> = std::sync::OnceLock::new();
    *ID.get_or_init(|| {
        let raw = read_bounded(VMLINUX.as_ref(), crate::MAX_BTF_SIZE).ok()?;
        let vmlinux = Btf::parse(&raw, None).ok()?;
        vmlinux.find("bpf_map_sum_elem_count", |t| matches!(t, Type::Func(_)))
    })
}

/// The bytes of the file at `path`, at most `max` of them (an error past
/// that).
fn read_bounded(path: &std::path::Path, max: usize) -> std::io::Result<Vec<u8>> {
    use std::io::Read as _;
    let mut raw = Vec::new();
    std::fs::File::open(path)?
        .take(max as u64 + 1)
        .read_to_end(&mut raw)?;
    if raw.len() > max {
        return Err(std::io::Error::other(format!(
            "{} is larger than {max} bytes",
            path.display()
        )));
    }
    Ok(raw)
}

/// The program that counts the entries of `target`, a hash map, from the
/// kernel's counters of its elements, when this kernel has them (hash
/// maps count their elements since Linux 6.6, when the function that sums
/// them came) and accepts the program; `None` otherwise (the entries are
/// then counted by walking them).
fn count_program(target: &MapHandle, scratch: &OwnedMap) -> Option<OwnedFd> {
    if !matches!(
        target.meta().map_type,
        MapType::HASH | MapType::PERCPU_HASH | MapType::LRU_HASH | MapType::LRU_PERCPU_HASH
    ) {
        return None;
    }
    let kfunc = sum_elem_count()?;
    let insns =
        WalkPlan::assemble_count(target.raw_fd(), scratch.as_fd().as_raw_fd(), kfunc).ok()?;
    let mut b = BtfBuilder::new();
    let long = b.add_int("long", 8, IntEncoding::Signed);
    let ptr = b.add_ptr(0);
    let proto = b.add_func_proto(long, &[("ctx", ptr)]);
    let main = b.add_func("bpfmapd_count", proto, 1);
    let btf = OwnedBtf::load(&b.to_bytes()).ok()?;
    sys::prog_load(&sys::ProgLoad {
        prog_type: bpf_prog_type::BPF_PROG_TYPE_SYSCALL as u32,
        flags: BPF_F_SLEEPABLE,
        insns: &insns,
        license: COUNT_LICENSE,
        name: "bpfmapd_count",
        btf: btf.as_fd(),
        funcs: &[[0, main]],
    })
    .ok()
}

/// The BTF of the program's two functions (the walk, global; its
/// callback, static, as the verifier wants a callback) and their records.
fn functions(callback: u32) -> Result<(OwnedBtf, [[u32; 2]; 2]), SyscallError> {
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
    let btf = OwnedBtf::load(&b.to_bytes())?;
    Ok((btf, [[0, main], [callback, each]]))
}

#[cfg(test)]
mod tests;
