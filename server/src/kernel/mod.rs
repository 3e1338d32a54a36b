//! Kernel maps: opening them read-only, describing them, walking them.
//!
//! `sys` holds every syscall; `walk` turns batch and key-by-key reads into
//! chunks through the [`MapOps`] seam, which unit tests replace to reach the
//! error paths the kernel will not produce on demand.

pub mod sys;
pub mod walk;

use std::{
    borrow::Cow,
    os::fd::{AsFd, BorrowedFd, OwnedFd},
    path::Path,
    sync::OnceLock,
};

pub use sys::{SysResult, SyscallError};

/// Kernel map type numbers (enum bpf_map_type) used in this crate.
pub mod map_type {
    pub const HASH: u32 = 1;
    pub const ARRAY: u32 = 2;
    pub const PROG_ARRAY: u32 = 3;
    pub const PERF_EVENT_ARRAY: u32 = 4;
    pub const PERCPU_HASH: u32 = 5;
    pub const PERCPU_ARRAY: u32 = 6;
    pub const STACK_TRACE: u32 = 7;
    pub const CGROUP_ARRAY: u32 = 8;
    pub const LRU_HASH: u32 = 9;
    pub const LRU_PERCPU_HASH: u32 = 10;
    pub const LPM_TRIE: u32 = 11;
    pub const ARRAY_OF_MAPS: u32 = 12;
    pub const HASH_OF_MAPS: u32 = 13;
    pub const DEVMAP: u32 = 14;
    pub const SOCKMAP: u32 = 15;
    pub const CPUMAP: u32 = 16;
    pub const XSKMAP: u32 = 17;
    pub const SOCKHASH: u32 = 18;
    pub const CGROUP_STORAGE: u32 = 19;
    pub const REUSEPORT_SOCKARRAY: u32 = 20;
    pub const PERCPU_CGROUP_STORAGE: u32 = 21;
    pub const QUEUE: u32 = 22;
    pub const STACK: u32 = 23;
    pub const DEVMAP_HASH: u32 = 25;
    pub const STRUCT_OPS: u32 = 26;
    pub const RINGBUF: u32 = 27;
    pub const BLOOM_FILTER: u32 = 30;
}

const TYPE_NAMES: &[&str] = &[
    "unspec",
    "hash",
    "array",
    "prog_array",
    "perf_event_array",
    "percpu_hash",
    "percpu_array",
    "stack_trace",
    "cgroup_array",
    "lru_hash",
    "lru_percpu_hash",
    "lpm_trie",
    "array_of_maps",
    "hash_of_maps",
    "devmap",
    "sockmap",
    "cpumap",
    "xskmap",
    "sockhash",
    "cgroup_storage",
    "reuseport_sockarray",
    "percpu_cgroup_storage",
    "queue",
    "stack",
    "sk_storage",
    "devmap_hash",
    "struct_ops",
    "ringbuf",
    "inode_storage",
    "task_storage",
    "bloom_filter",
    "user_ringbuf",
    "cgrp_storage",
    "arena",
];

/// Readable name of a kernel map type ("hash", "percpu_array", ...).
pub fn type_name(map_type: u32) -> Cow<'static, str> {
    match TYPE_NAMES.get(map_type as usize) {
        Some(name) => Cow::Borrowed(name),
        None => Cow::Owned(format!("unknown({map_type})")),
    }
}

/// How a map of a given type can be walked from user space.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Method {
    /// `BPF_MAP_LOOKUP_BATCH`; the position token is a u32 bucket index.
    BatchBucket,
    /// `BPF_MAP_LOOKUP_BATCH` on the generic path; the token is the last key.
    BatchKey,
    /// get_next_key + lookup, one entry at a time; the token is the last key.
    KeyByKey,
    /// Cannot be iterated (queue, stack, ring buffer, bloom filter, ...).
    None,
}

/// Dump method for a map type (see the support table in the README).
pub fn method_for(map_type: u32) -> Method {
    use map_type::*;
    match map_type {
        HASH | LRU_HASH | PERCPU_HASH | LRU_PERCPU_HASH | HASH_OF_MAPS => Method::BatchBucket,
        ARRAY | PERCPU_ARRAY | ARRAY_OF_MAPS | LPM_TRIE => Method::BatchKey,
        PROG_ARRAY
        | PERF_EVENT_ARRAY
        | STACK_TRACE
        | CGROUP_ARRAY
        | DEVMAP
        | SOCKMAP
        | CPUMAP
        | XSKMAP
        | SOCKHASH
        | CGROUP_STORAGE
        | REUSEPORT_SOCKARRAY
        | PERCPU_CGROUP_STORAGE
        | DEVMAP_HASH
        | STRUCT_OPS => Method::KeyByKey,
        _ => Method::None,
    }
}

/// Types whose get_next_key silently restarts from the first key when given a
/// key that no longer exists. Resuming after a deleted key must be refused for
/// them, or entries would repeat.
pub fn restarts_on_missing_key(map_type: u32) -> bool {
    use map_type::*;
    // Hash-family maps are walked by bucket index, not by key.
    matches!(map_type, LPM_TRIE | DEVMAP_HASH | SOCKHASH)
}

/// Whether a map type stores one value per possible CPU.
pub fn is_per_cpu(map_type: u32) -> bool {
    use map_type::*;
    matches!(
        map_type,
        PERCPU_HASH | PERCPU_ARRAY | LRU_PERCPU_HASH | PERCPU_CGROUP_STORAGE
    )
}

/// Number of possible CPUs (`/sys/devices/system/cpu/possible`), the length
/// of per-CPU value lists.
pub fn possible_cpus() -> u32 {
    static CPUS: OnceLock<u32> = OnceLock::new();
    *CPUS.get_or_init(|| aya::util::nr_cpus().map_or(1, |n| n as u32))
}

/// What the kernel says about a map (`BPF_OBJ_GET_INFO_BY_FD`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MapMeta {
    pub id: u32,
    pub name: String,
    pub map_type: u32,
    pub key_size: u32,
    pub value_size: u32,
    pub max_entries: u32,
    pub flags: u32,
    pub btf_id: u32,
    pub btf_key_type_id: u32,
    pub btf_value_type_id: u32,
    pub possible_cpus: u32,
}

impl MapMeta {
    pub fn per_cpu(&self) -> bool {
        is_per_cpu(self.map_type)
    }

    pub fn method(&self) -> Method {
        method_for(self.map_type)
    }

    /// Bytes of one CPU's value inside kernel buffers (8-byte aligned).
    pub fn cpu_stride(&self) -> usize {
        (self.value_size as usize).div_ceil(8) * 8
    }

    /// Bytes of one element's value in kernel buffers.
    pub fn kernel_value_size(&self) -> usize {
        if self.per_cpu() {
            self.cpu_stride() * self.possible_cpus as usize
        } else {
            self.value_size as usize
        }
    }

    /// Bytes of one element's value as sent to clients (per-CPU padding
    /// removed).
    pub fn wire_value_size(&self) -> usize {
        if self.per_cpu() {
            self.value_size as usize * self.possible_cpus as usize
        } else {
            self.value_size as usize
        }
    }

    /// A digest of what makes a map "the same map" apart from its id: type,
    /// sizes, flags and name. A cursor carries it so that a map replaced under
    /// the same path (or a recycled id) is detected.
    pub fn fingerprint(&self) -> [u8; 8] {
        let mut ctx = ring::digest::Context::new(&ring::digest::SHA256);
        for v in [
            self.map_type,
            self.key_size,
            self.value_size,
            self.max_entries,
            self.flags,
        ] {
            ctx.update(&v.to_le_bytes());
        }
        ctx.update(self.name.as_bytes());
        let digest = ctx.finish();
        let mut out = [0; 8];
        out.copy_from_slice(&digest.as_ref()[..8]);
        out
    }

    fn from_info(info: &aya_obj::generated::bpf_map_info) -> Self {
        let name_bytes: Vec<u8> = info
            .name
            .iter()
            .take_while(|&&c| c != 0)
            .map(|&c| c as u8)
            .collect();
        Self {
            id: info.id,
            name: String::from_utf8_lossy(&name_bytes).into_owned(),
            map_type: info.type_,
            key_size: info.key_size,
            value_size: info.value_size,
            max_entries: info.max_entries,
            flags: info.map_flags,
            btf_id: info.btf_id,
            btf_key_type_id: info.btf_key_type_id,
            btf_value_type_id: info.btf_value_type_id,
            possible_cpus: possible_cpus(),
        }
    }
}

/// An open, read-only map.
#[derive(Debug)]
pub struct MapHandle {
    fd: OwnedFd,
    meta: MapMeta,
}

/// Why a map could not be opened.
#[derive(Debug, thiserror::Error)]
pub enum OpenError {
    #[error("no such map")]
    NotFound,
    #[error("the object is not a BPF map")]
    NotAMap,
    #[error(transparent)]
    Syscall(#[from] SyscallError),
}

impl OpenError {
    fn from_sys(e: SyscallError) -> Self {
        match e.errno() {
            Some(libc::ENOENT) => Self::NotFound,
            _ => Self::Syscall(e),
        }
    }
}

impl MapHandle {
    /// Opens the map pinned at `path`, read-only.
    pub fn open_pinned(path: &Path) -> Result<Self, OpenError> {
        let fd = sys::obj_get_rdonly(path).map_err(OpenError::from_sys)?;
        Self::from_fd(fd)
    }

    /// Opens a map by kernel id, read-only.
    pub fn open_id(id: u32) -> Result<Self, OpenError> {
        let fd = sys::map_get_fd_by_id_rdonly(id).map_err(OpenError::from_sys)?;
        Self::from_fd(fd)
    }

    /// Wraps an fd (which must refer to a map).
    pub fn from_fd(fd: OwnedFd) -> Result<Self, OpenError> {
        if !sys::is_map_fd(fd.as_fd()) {
            return Err(OpenError::NotAMap);
        }
        let info = sys::map_info(fd.as_fd())?;
        Ok(Self {
            fd,
            meta: MapMeta::from_info(&info),
        })
    }

    pub fn meta(&self) -> &MapMeta {
        &self.meta
    }

    pub fn fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }
}

/// The operations a walk needs. The daemon uses [`MapHandle`]; unit tests
/// replace it with a scripted fake.
pub trait MapOps {
    fn lookup_batch(
        &self,
        in_batch: Option<&[u8]>,
        out_batch: &mut [u8],
        keys: &mut [u8],
        values: &mut [u8],
        count: &mut u32,
    ) -> SysResult<()>;
    fn get_next_key(&self, key: Option<&[u8]>, next: &mut [u8]) -> SysResult<()>;
    fn lookup(&self, key: &[u8], value: &mut [u8]) -> SysResult<()>;
}

impl MapOps for MapHandle {
    fn lookup_batch(
        &self,
        in_batch: Option<&[u8]>,
        out_batch: &mut [u8],
        keys: &mut [u8],
        values: &mut [u8],
        count: &mut u32,
    ) -> SysResult<()> {
        sys::lookup_batch(self.fd(), in_batch, out_batch, keys, values, count)
    }

    fn get_next_key(&self, key: Option<&[u8]>, next: &mut [u8]) -> SysResult<()> {
        sys::get_next_key(self.fd(), key, next)
    }

    fn lookup(&self, key: &[u8], value: &mut [u8]) -> SysResult<()> {
        sys::lookup_elem(self.fd(), key, value)
    }
}
