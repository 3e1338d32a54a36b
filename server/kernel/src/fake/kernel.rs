//! [`ScriptedKernel`]: the kernel as a walk program sees it, answering from
//! a script. Its maps hold their entries in memory; a load is accepted
//! unless the script refuses it (with an errno and a verifier's log); a
//! test run does what the script says: the figures it writes in the
//! program's scratch value, the entries it puts in its output map, the
//! errno it stores, the syscall's result. Errors carry the names of the
//! real calls, so that messages read as they would with the kernel.
//!
//! As the kernel does, it finds the maps a program uses in the program's
//! `ld_imm64` instructions: those it points into (first its scratch value,
//! then the array of a dense table), and the maps it names by descriptor
//! (first its slot, which holds the walked map while it runs, then its
//! output map).

use std::{
    collections::{BTreeMap, HashMap, VecDeque},
    io,
    os::fd::RawFd,
    sync::{Arc, Mutex, MutexGuard},
};

use aya_obj::generated::{BPF_DW, BPF_IMM, BPF_LD, BPF_PSEUDO_MAP_FD, BPF_PSEUDO_MAP_VALUE};

use crate::{
    MapMeta, MapType, SysResult, SyscallError,
    drain::DrainOps,
    program::{LoadError, ProgramLoad, ProgramMap, ProgramOps, Target, plan},
    sys::CreateMap,
};

/// A call the script can make fail ([`ScriptedKernel::fail`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Call {
    /// `BPF_MAP_CREATE`.
    MapCreate,
    /// `BPF_MAP_UPDATE_ELEM` on a program's map.
    MapUpdate,
    /// `BPF_MAP_LOOKUP_ELEM` on a program's map.
    MapLookup,
    /// `BPF_MAP_DELETE_ELEM` on a program's map.
    MapDelete,
    /// `BPF_MAP_LOOKUP_AND_DELETE_BATCH` on a program's map (it fails
    /// before the kernel writes anything back).
    Drain,
    /// `BPF_BTF_LOAD` of a program's BTF.
    BtfLoad,
}

impl Call {
    fn name(self) -> &'static str {
        match self {
            Self::MapCreate => "BPF_MAP_CREATE",
            Self::MapUpdate => "BPF_MAP_UPDATE_ELEM",
            Self::MapLookup => "BPF_MAP_LOOKUP_ELEM",
            Self::MapDelete => "BPF_MAP_DELETE_ELEM",
            Self::Drain => "BPF_MAP_LOOKUP_AND_DELETE_BATCH",
            Self::BtfLoad => "BPF_BTF_LOAD",
        }
    }
}

/// What one `BPF_PROG_TEST_RUN` does ([`ScriptedKernel::push_run`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Run {
    /// The syscall's result: the program's return value, or an errno.
    pub result: Result<u32, i32>,
    /// Entries visited, written to the scratch value.
    pub visited: u64,
    /// The error the program stores in its scratch value, as it stores it
    /// (a negative errno); 0 for none.
    pub error: i64,
    /// Entries it inserts into its output map: key and value bytes, of
    /// that map's sizes; for a dense table, the slot's index (a `u32`) and
    /// the slot's bytes.
    pub output: Vec<(Vec<u8>, Vec<u8>)>,
}

impl Run {
    /// A run that visits `visited` entries, takes none, and succeeds.
    pub fn visiting(visited: u64) -> Self {
        Self {
            result: Ok(0),
            visited,
            error: 0,
            output: Vec::new(),
        }
    }
}

/// A program load the script saw ([`ScriptedKernel::loads`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Loaded {
    /// Its kernel name ("bpfmapd_scan", "bpfmapd_count").
    pub name: &'static str,
    /// The license it declared.
    pub license: String,
    /// Its number of instructions.
    pub insns: usize,
    /// Whether the script accepted it.
    pub accepted: bool,
}

/// A kernel for walk programs that answers from a script. Loads are
/// accepted and calls succeed unless the script says otherwise; every test
/// run must be scripted.
#[derive(Debug, Default)]
pub struct ScriptedKernel {
    state: Arc<Mutex<State>>,
}

#[derive(Debug)]
struct State {
    sum_elem_count: Option<u32>,
    /// Answers to the next loads: `Err((errno, log))` refuses one.
    loads: VecDeque<Result<(), (i32, String)>>,
    runs: VecDeque<Run>,
    /// The next call of each kind in here fails with its errno, after
    /// the number of such calls given succeed.
    faults: Vec<(Call, usize, i32)>,
    /// The entries of the maps created, by descriptor.
    maps: HashMap<RawFd, BTreeMap<Vec<u8>, Vec<u8>>>,
    next_fd: RawFd,
    loaded: Vec<Loaded>,
    /// The map in the program's slot at each test run.
    walked: Vec<Option<RawFd>>,
    /// The maps created as slots (arrays of maps).
    slots: Vec<RawFd>,
    /// The value size of each map created.
    sizes: HashMap<RawFd, usize>,
}

impl Default for State {
    fn default() -> Self {
        Self {
            sum_elem_count: None,
            loads: VecDeque::new(),
            runs: VecDeque::new(),
            faults: Vec::new(),
            maps: HashMap::new(),
            // Far from the descriptors tests give their target maps.
            next_fd: 1000,
            loaded: Vec::new(),
            walked: Vec::new(),
            slots: Vec::new(),
            sizes: HashMap::new(),
        }
    }
}

impl State {
    /// The errno of the next fault scripted for `call`, taken.
    fn fault(&mut self, call: Call) -> SysResult<()> {
        match self.faults.iter().position(|(c, _, _)| *c == call) {
            Some(at) if self.faults[at].1 > 0 => {
                self.faults[at].1 -= 1;
                Ok(())
            }
            Some(at) => Err(error(call.name(), self.faults.remove(at).2)),
            None => Ok(()),
        }
    }
}

/// An error of `call` with `errno`, as the kernel would report it.
fn error(call: &'static str, errno: i32) -> SyscallError {
    SyscallError {
        call,
        io_error: io::Error::from_raw_os_error(errno),
    }
}

impl State {
    /// Puts what a run outputs into the program's output map: the map it
    /// names after its slot, or the dense table it points into after its
    /// scratch value.
    fn output(&mut self, program: &ScriptedProgram, output: Vec<(Vec<u8>, Vec<u8>)>) {
        let named = program
            .maps
            .iter()
            .skip(1)
            .find(|fd| self.maps.contains_key(fd));
        if let Some(fd) = named {
            let entries = self.maps.get_mut(fd).expect("a map of this kernel");
            entries.extend(output);
            return;
        }
        let scratch = program.values.first();
        let dense = program.values.iter().find(|fd| Some(*fd) != scratch);
        let Some(dense) = dense.filter(|fd| self.maps.contains_key(fd)) else {
            assert!(output.is_empty(), "the program has no output map");
            return;
        };
        let size = self.sizes[dense];
        let table = self
            .maps
            .get_mut(dense)
            .expect("a map of this kernel")
            .entry(0u32.to_ne_bytes().to_vec())
            .or_insert_with(|| vec![0; size]);
        for (index, slot) in output {
            let at = u32::from_ne_bytes(index[..4].try_into().expect("an index")) as usize;
            let at = at * slot.len();
            table[at..at + slot.len()].copy_from_slice(&slot);
        }
    }
}

impl ScriptedKernel {
    /// A kernel without `bpf_map_sum_elem_count` (before Linux 6.6).
    pub fn new() -> Self {
        Self::default()
    }

    /// A kernel whose `bpf_map_sum_elem_count` has BTF id `id`.
    pub fn with_sum_elem_count(self, id: u32) -> Self {
        self.state().sum_elem_count = Some(id);
        self
    }

    fn state(&self) -> MutexGuard<'_, State> {
        self.state.lock().expect("script")
    }

    /// Scripts the next load: refused with `errno`, the verifier writing
    /// `log`.
    pub fn refuse(&self, errno: i32, log: &str) {
        self.state().loads.push_back(Err((errno, log.to_owned())));
    }

    /// Scripts the next load: accepted (as are loads nothing was scripted
    /// for).
    pub fn accept(&self) {
        self.state().loads.push_back(Ok(()));
    }

    /// Makes the next `call` fail with `errno`.
    pub fn fail(&self, call: Call, errno: i32) {
        self.fail_after(call, 0, errno);
    }

    /// Makes the call of `call` after the next `calls` fail with `errno`.
    pub fn fail_after(&self, call: Call, calls: usize, errno: i32) {
        self.state().faults.push((call, calls, errno));
    }

    /// Scripts the next test run.
    pub fn push_run(&self, run: Run) {
        self.state().runs.push_back(run);
    }

    /// The loads seen so far, in order.
    pub fn loads(&self) -> Vec<Loaded> {
        self.state().loaded.clone()
    }

    /// Scripted answers not used yet (loads, runs, faults).
    /// The map in the program's slot at each test run so far (`None`: the
    /// slot was empty).
    pub fn walked(&self) -> Vec<Option<RawFd>> {
        self.state().walked.clone()
    }

    /// Whether every slot is empty: no map is held between runs.
    pub fn slots_empty(&self) -> bool {
        let s = self.state();
        s.slots
            .iter()
            .all(|fd| s.maps.get(fd).is_none_or(BTreeMap::is_empty))
    }

    pub fn unused(&self) -> usize {
        let s = self.state();
        s.loads.len() + s.runs.len() + s.faults.len()
    }
}

/// A program the script loaded: the maps its instructions use.
#[derive(Debug)]
pub struct ScriptedProgram {
    /// Maps named by descriptor (`BPF_PSEUDO_MAP_FD`).
    maps: Vec<RawFd>,
    /// Maps whose value it points into (`BPF_PSEUDO_MAP_VALUE`).
    values: Vec<RawFd>,
}

impl ScriptedProgram {
    /// The maps `insns` use, from their `ld_imm64` instructions.
    fn of(insns: &[u64]) -> Self {
        const LD_IMM64: u64 = (BPF_LD | BPF_IMM | BPF_DW) as u64;
        let mut p = Self {
            maps: Vec::new(),
            values: Vec::new(),
        };
        let mut at = 0;
        while let Some(&insn) = insns.get(at) {
            if insn & 0xff != LD_IMM64 {
                at += 1;
                continue;
            }
            let (src, imm) = ((insn >> 12) & 0xf, (insn >> 32) as u32 as RawFd);
            match src as u32 {
                BPF_PSEUDO_MAP_FD => p.maps.push(imm),
                BPF_PSEUDO_MAP_VALUE => p.values.push(imm),
                _ => {}
            }
            at += 2;
        }
        p
    }
}

/// A map of a [`ScriptedKernel`].
#[derive(Debug)]
pub struct ScriptedProgramMap {
    fd: RawFd,
    meta: MapMeta,
    state: Arc<Mutex<State>>,
}

impl ScriptedProgramMap {
    fn state(&self) -> MutexGuard<'_, State> {
        self.state.lock().expect("script")
    }
}

impl ProgramOps for ScriptedKernel {
    type Map = ScriptedProgramMap;
    type Program = ScriptedProgram;

    fn create_map(&self, params: &CreateMap<'_>) -> SysResult<ScriptedProgramMap> {
        let mut s = self.state();
        s.fault(Call::MapCreate)?;
        let fd = s.next_fd;
        s.next_fd += 1;
        s.maps.insert(fd, BTreeMap::new());
        s.sizes.insert(fd, params.value_size as usize);
        if params.map_type == MapType::ARRAY_OF_MAPS.0 {
            s.slots.push(fd);
        }
        let meta = MapMeta {
            id: fd as u32,
            name: params.name.chars().take(15).collect(),
            map_type: MapType(params.map_type),
            key_size: params.key_size,
            value_size: params.value_size,
            max_entries: params.max_entries,
            flags: params.flags,
            btf_id: 0,
            btf_key_type_id: 0,
            btf_value_type_id: 0,
            possible_cpus: 2,
        };
        Ok(ScriptedProgramMap {
            fd,
            meta,
            state: self.state.clone(),
        })
    }

    fn load(&self, p: &ProgramLoad<'_>) -> Result<ScriptedProgram, LoadError> {
        let mut s = self.state();
        s.fault(Call::BtfLoad)?;
        let answer = s.loads.pop_front().unwrap_or(Ok(()));
        s.loaded.push(Loaded {
            name: p.name,
            license: p.license.to_string_lossy().into_owned(),
            insns: p.insns.len(),
            accepted: answer.is_ok(),
        });
        match answer {
            Ok(()) => Ok(ScriptedProgram::of(p.insns)),
            Err((errno, log)) => Err(LoadError::Refused {
                error: error("BPF_PROG_LOAD", errno),
                log,
            }),
        }
    }

    fn test_run(&self, program: &ScriptedProgram) -> SysResult<u32> {
        let mut s = self.state();
        let in_slot = program
            .maps
            .first()
            .and_then(|slot| s.maps.get(slot))
            .and_then(|m| m.get(&0u32.to_ne_bytes()[..]))
            .map(|fd| RawFd::from_ne_bytes(fd[..4].try_into().expect("a descriptor")));
        s.walked.push(in_slot);
        let run = s
            .runs
            .pop_front()
            .expect("a test run the script did not expect");
        let words = [
            (plan::VISITED, run.visited),
            (plan::ERROR, run.error as u64),
        ];
        let scratch = program
            .values
            .first()
            .and_then(|fd| s.maps.get_mut(fd))
            .and_then(|m| m.get_mut(&0u32.to_ne_bytes()[..]))
            .expect("the scratch value is written before the program runs");
        for (at, word) in words {
            let at = at as usize;
            scratch[at..at + 8].copy_from_slice(&word.to_ne_bytes());
        }
        s.output(program, run.output);
        run.result
            .map_err(|errno| error("BPF_PROG_TEST_RUN", errno))
    }

    fn sum_elem_count(&self) -> Option<u32> {
        self.state().sum_elem_count
    }

    fn program_id(&self, _: &ScriptedProgram) -> Option<u32> {
        None
    }

    fn program_memory(&self, _: &ScriptedProgram) -> u64 {
        4096
    }
}

impl ProgramMap for ScriptedProgramMap {
    fn fd(&self) -> RawFd {
        self.fd
    }

    fn meta(&self) -> &MapMeta {
        &self.meta
    }

    fn update(&self, key: &[u8], value: &[u8]) -> SysResult<()> {
        let mut s = self.state();
        s.fault(Call::MapUpdate)?;
        s.maps
            .get_mut(&self.fd)
            .expect("a map of this kernel")
            .insert(key.to_vec(), value.to_vec());
        Ok(())
    }

    fn lookup(&self, key: &[u8]) -> SysResult<Option<Vec<u8>>> {
        let mut s = self.state();
        s.fault(Call::MapLookup)?;
        Ok(s.maps.get(&self.fd).and_then(|m| m.get(key)).cloned())
    }

    fn delete(&self, key: &[u8]) -> SysResult<()> {
        let mut s = self.state();
        s.fault(Call::MapDelete)?;
        if let Some(m) = s.maps.get_mut(&self.fd) {
            m.remove(key);
        }
        Ok(())
    }

    fn kernel_id(&self) -> Option<u32> {
        None
    }

    /// Its entries' bytes as the map holds them.
    fn memory(&self) -> u64 {
        u64::from(self.meta.max_entries) * u64::from(self.meta.key_size + self.meta.value_size)
    }

    fn target(&self) -> Target<'_> {
        Target::new(self.fd, &self.meta)
    }
}

/// Drains copy the map's first entries (in key order), the token counting
/// the calls; the last ones come with ENOENT, as from the kernel.
impl DrainOps for ScriptedProgramMap {
    fn is_writable(&self) -> bool {
        true
    }

    fn lookup_and_delete_batch(
        &self,
        _in_batch: Option<&[u8]>,
        out_batch: &mut [u8],
        keys: &mut [u8],
        values: &mut [u8],
        count: &mut u32,
    ) -> SysResult<()> {
        let mut s = self.state();
        s.fault(Call::Drain)?;
        let entries = s.maps.get_mut(&self.fd).expect("a map of this kernel");
        let (ks, vs) = (self.meta.key_size as usize, self.meta.value_size as usize);
        let mut n = 0;
        while n < *count as usize {
            let Some((k, v)) = entries.pop_first() else {
                break;
            };
            assert_eq!((k.len(), v.len()), (ks, vs), "an entry of the map's sizes");
            keys[n * ks..(n + 1) * ks].copy_from_slice(&k);
            values[n * vs..(n + 1) * vs].copy_from_slice(&v);
            n += 1;
        }
        *count = n as u32;
        out_batch[..4].copy_from_slice(&(n as u32).to_ne_bytes());
        if entries.is_empty() {
            return Err(error("BPF_MAP_LOOKUP_AND_DELETE_BATCH", libc::ENOENT));
        }
        Ok(())
    }
}
