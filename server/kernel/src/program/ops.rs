//! The kernel as a walk program sees it ([`ProgramOps`]): its maps created,
//! written and read, the program loaded with its verifier's log and run.
//! [`Kernel`] is the running kernel, through the syscalls of `sys`; unit
//! tests replace it with a scripted one
//! (`fake::ScriptedKernel`, with the `fake` feature) to reach the error
//! paths the kernel will not produce on demand.

use std::{
    ffi::CStr,
    fmt,
    io::{self, Read as _},
    os::fd::{AsFd, AsRawFd, OwnedFd, RawFd},
    path::Path,
    sync::OnceLock,
};

use aya_obj::generated::{BPF_F_SLEEPABLE, bpf_prog_type};

use super::{LoadError, Target};
use crate::{
    MAX_BTF_SIZE, MapMeta, OwnedBtf, OwnedMap, SysResult,
    btf::{Btf, Type},
    drain::DrainOps,
    sys::{self, CreateMap},
};

/// A program to load (`BPF_PROG_LOAD`, a sleepable syscall program), with
/// the BTF of its functions.
#[derive(Debug, Clone, Copy)]
pub struct ProgramLoad<'a> {
    /// Its kernel name (at most 15 bytes are kept).
    pub name: &'static str,
    /// The license it declares.
    pub license: &'static CStr,
    /// Its instructions, in the kernel's encoding.
    pub insns: &'a [u64],
    /// The raw BTF of its functions (from a
    /// [`BtfBuilder`](crate::BtfBuilder)).
    pub btf: &'a [u8],
    /// Per function: its first instruction and its `BTF_KIND_FUNC` id.
    pub funcs: &'a [[u32; 2]],
}

/// A map a walk program owns (its scratch value, its output), created
/// through [`ProgramOps::create_map`]: written and read by key, drained
/// ([`DrainOps`]).
pub trait ProgramMap: DrainOps + fmt::Debug {
    /// The descriptor the program's instructions name it by.
    fn fd(&self) -> RawFd;
    /// What the kernel says about it.
    fn meta(&self) -> &MapMeta;
    /// `BPF_MAP_UPDATE_ELEM` of one element, in the kernel's layout.
    fn update(&self, key: &[u8], value: &[u8]) -> SysResult<()>;
    /// `BPF_MAP_LOOKUP_ELEM`: the element, or `None` when there is none.
    fn lookup(&self, key: &[u8]) -> SysResult<Option<Vec<u8>>>;
    /// `BPF_MAP_DELETE_ELEM` of one element (none there is no error).
    fn delete(&self, key: &[u8]) -> SysResult<()>;
    /// The id the kernel gave it; `None` for a map of a script.
    fn kernel_id(&self) -> Option<u32>;
    /// The kernel memory charged for it (its fdinfo's `memlock`), in
    /// bytes; 0 when it cannot be read.
    fn memory(&self) -> u64;
    /// The map as a walk program's target (the probe walks one of its
    /// own).
    fn target(&self) -> Target<'_>;
}

/// What a walk program needs from the kernel. [`Kernel`] implements it with
/// the syscalls; unit tests with a script.
pub trait ProgramOps {
    /// A map the program owns.
    type Map: ProgramMap;
    /// A loaded program.
    type Program: fmt::Debug;

    /// `BPF_MAP_CREATE`.
    fn create_map(&self, params: &CreateMap<'_>) -> SysResult<Self::Map>;
    /// `BPF_BTF_LOAD` of the program's BTF, then `BPF_PROG_LOAD`: a BTF
    /// the kernel refuses is [`LoadError::Sys`]; a program it refuses,
    /// [`LoadError::Refused`] with the verifier's log.
    fn load(&self, program: &ProgramLoad<'_>) -> Result<Self::Program, LoadError>;
    /// `BPF_PROG_TEST_RUN` of a program that takes no context: its return
    /// value.
    fn test_run(&self, program: &Self::Program) -> SysResult<u32>;
    /// The BTF id of the kernel function `bpf_map_sum_elem_count` (Linux
    /// 6.6), when this kernel has it.
    fn sum_elem_count(&self) -> Option<u32>;
    /// The id the kernel gave a loaded program; `None` for a script's.
    fn program_id(&self, program: &Self::Program) -> Option<u32>;
    /// The kernel memory charged for a loaded program (its fdinfo's
    /// `memlock`), in bytes; 0 when it cannot be read.
    fn program_memory(&self, program: &Self::Program) -> u64;
}

/// A kernel used through a reference is the kernel.
impl<T: ProgramOps + ?Sized> ProgramOps for &T {
    type Map = T::Map;
    type Program = T::Program;

    fn create_map(&self, params: &CreateMap<'_>) -> SysResult<Self::Map> {
        (**self).create_map(params)
    }

    fn load(&self, program: &ProgramLoad<'_>) -> Result<Self::Program, LoadError> {
        (**self).load(program)
    }

    fn test_run(&self, program: &Self::Program) -> SysResult<u32> {
        (**self).test_run(program)
    }

    fn sum_elem_count(&self) -> Option<u32> {
        (**self).sum_elem_count()
    }

    fn program_id(&self, program: &Self::Program) -> Option<u32> {
        (**self).program_id(program)
    }

    fn program_memory(&self, program: &Self::Program) -> u64 {
        (**self).program_memory(program)
    }
}

/// The running kernel.
#[derive(Debug, Clone, Copy, Default)]
pub struct Kernel;

impl ProgramOps for Kernel {
    type Map = OwnedMap;
    type Program = OwnedFd;

    fn create_map(&self, params: &CreateMap<'_>) -> SysResult<OwnedMap> {
        OwnedMap::create(params)
    }

    fn load(&self, p: &ProgramLoad<'_>) -> Result<OwnedFd, LoadError> {
        let btf = OwnedBtf::load(p.btf)?;
        sys::prog_load(&sys::ProgLoad {
            prog_type: bpf_prog_type::BPF_PROG_TYPE_SYSCALL as u32,
            flags: BPF_F_SLEEPABLE,
            insns: p.insns,
            license: p.license,
            name: p.name,
            btf: btf.as_fd(),
            funcs: p.funcs,
        })
        .map_err(|(error, log)| LoadError::Refused { error, log })
    }

    fn test_run(&self, program: &OwnedFd) -> SysResult<u32> {
        sys::prog_test_run(program.as_fd())
    }

    fn sum_elem_count(&self) -> Option<u32> {
        static ID: OnceLock<Option<u32>> = OnceLock::new();
        *ID.get_or_init(|| find_in_vmlinux("bpf_map_sum_elem_count"))
    }

    fn program_id(&self, program: &OwnedFd) -> Option<u32> {
        sys::prog_id(program.as_fd()).ok()
    }

    fn program_memory(&self, program: &OwnedFd) -> u64 {
        crate::holders::memlock(program.as_fd()).unwrap_or(0)
    }
}

impl ProgramMap for OwnedMap {
    fn fd(&self) -> RawFd {
        self.as_fd().as_raw_fd()
    }

    fn meta(&self) -> &MapMeta {
        OwnedMap::meta(self)
    }

    fn update(&self, key: &[u8], value: &[u8]) -> SysResult<()> {
        OwnedMap::update(self, key, value)
    }

    fn lookup(&self, key: &[u8]) -> SysResult<Option<Vec<u8>>> {
        OwnedMap::lookup(self, key)
    }

    fn delete(&self, key: &[u8]) -> SysResult<()> {
        match OwnedMap::delete(self, key) {
            Err(e) if e.errno() == Some(libc::ENOENT) => Ok(()),
            r => r,
        }
    }

    fn kernel_id(&self) -> Option<u32> {
        Some(self.id())
    }

    fn memory(&self) -> u64 {
        crate::holders::memlock(self.as_fd()).unwrap_or(0)
    }

    fn target(&self) -> Target<'_> {
        Target::of_owned(self)
    }
}

/// The kernel's BTF.
const VMLINUX: &str = "/sys/kernel/btf/vmlinux";

/// The BTF id of the kernel function `name`, looked up in the kernel's BTF
/// (about 6 MB, read and parsed in about 10 ms); `None` when the kernel
/// has no such function or no BTF.
fn find_in_vmlinux(name: &str) -> Option<u32> {
    let raw = read_bounded(VMLINUX.as_ref(), MAX_BTF_SIZE).ok()?;
    let vmlinux = Btf::parse(&raw, None).ok()?;
    vmlinux.find(name, |t| matches!(t, Type::Func(_)))
}

/// The bytes of the file at `path`, at most `max` of them (an error past
/// that).
fn read_bounded(path: &Path, max: usize) -> io::Result<Vec<u8>> {
    let mut raw = Vec::new();
    std::fs::File::open(path)?
        .take(max as u64 + 1)
        .read_to_end(&mut raw)?;
    if raw.len() > max {
        return Err(io::Error::other(format!(
            "{} is larger than {max} bytes",
            path.display()
        )));
    }
    Ok(raw)
}
