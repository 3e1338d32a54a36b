//! Kernel maps: their types, opening them read-only, reading them, draining
//! them.
//!
//! `sys` holds every syscall. [`MapHandle`] is an open map (read-only
//! unless opened writable) that knows its key and value sizes and checks
//! every buffer against them, so no call made through it can let the kernel
//! write past a buffer. [`Walker`](walk::Walker) turns batch and key-by-key
//! reads into chunks through the [`MapOps`] seam, which unit tests replace
//! to reach the error paths the kernel will not produce on demand;
//! [`Drainer`](drain::Drainer) reads and deletes chunks the same way through
//! the [`DrainOps`](drain::DrainOps) seam, from a map opened writable.
//! Creating and writing maps (the demo, the tests) goes through
//! [`OwnedMap`], a separate type that the read path never sees; so does
//! loading BTF ([`OwnedBtf`], with data from [`BtfBuilder`]). The read path
//! only reads the BTF of existing maps ([`read_btf`]).

pub mod btf;
mod btf_build;
pub mod drain;
#[cfg(any(test, feature = "fake"))]
pub mod fake;
mod handle;
pub mod holders;
mod owned;
pub mod program;
mod sys;
pub mod walk;

use std::{borrow::Cow, fmt, sync::OnceLock};

use aya_obj::generated::bpf_map_type;

pub use btf_build::{BtfBuilder, BtfMember, IntEncoding};
pub use handle::{MapHandle, read_btf};
pub use owned::{OwnedBtf, OwnedMap};
pub use sys::{
    BtfInfo, CreateMap, ENOTSUPP, MAX_BTF_SIZE, MapBtf, SysResult, SyscallError, is_bpffs,
    mount_bpffs, release_free_memory, return_large_buffers_to_the_system, umount,
};

/// How a map of a given type can be walked from user space.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WalkMethod {
    /// `BPF_MAP_LOOKUP_BATCH`; the position token is a u32 bucket index.
    BatchBucket,
    /// `BPF_MAP_LOOKUP_BATCH` on the generic path; the token is the last key.
    BatchKey,
    /// get_next_key + lookup, one entry at a time; the token is the last key.
    KeyByKey,
    /// Cannot be iterated (queue, stack, ring buffer, bloom filter, ...).
    None,
}

/// What get_next_key does, for a map type walked by key, when the key it is
/// given no longer exists.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KeyWalk {
    /// Keys never go away (arrays: every index exists), or the type is
    /// walked by bucket.
    Stable,
    /// It restarts from the first key; the walk's order is the trie's
    /// postorder ([`walk::trie_order`]), so a restart can be detected and
    /// skipped.
    RestartsInTrieOrder,
    /// It restarts from the first key; keys come in ascending u32 order
    /// (stack_trace ids), so a restart can be detected and skipped.
    RestartsInIdOrder,
    /// It restarts from the first key, in an order user space cannot
    /// compute (hash buckets): a restart can be detected but not skipped.
    RestartsUnordered,
    /// It answers ENOENT, as at the end of the map (cgroup_storage).
    EndsEarly,
}

/// What the daemon knows about one kernel map type.
struct TypeRow {
    name: &'static str,
    method: WalkMethod,
    per_cpu: bool,
    walk: KeyWalk,
}

const fn row(name: &'static str, method: WalkMethod, per_cpu: bool, walk: KeyWalk) -> TypeRow {
    TypeRow {
        name,
        method,
        per_cpu,
        walk,
    }
}

use KeyWalk::{
    EndsEarly as ENDS, RestartsInIdOrder as IDS, RestartsInTrieOrder as TRIE,
    RestartsUnordered as UNORD, Stable as STABLE,
};
use WalkMethod::{BatchBucket as BUCKET, BatchKey as BKEY, KeyByKey as KBK, None as NONE};

/// Every map type, indexed by its number in the kernel's enum bpf_map_type
/// (what each can do: "Which maps can be dumped" in proto/docs/dumps.md).
const TYPES: [TypeRow; 34] = [
    row("unspec", NONE, false, STABLE),
    row("hash", BUCKET, false, STABLE),
    row("array", BKEY, false, STABLE),
    row("prog_array", KBK, false, STABLE),
    row("perf_event_array", NONE, false, STABLE),
    row("percpu_hash", BUCKET, true, STABLE),
    row("percpu_array", BKEY, true, STABLE),
    row("stack_trace", KBK, false, IDS),
    row("cgroup_array", NONE, false, STABLE),
    row("lru_hash", BUCKET, false, STABLE),
    row("lru_percpu_hash", BUCKET, true, STABLE),
    row("lpm_trie", BKEY, false, TRIE),
    row("array_of_maps", BKEY, false, STABLE),
    row("hash_of_maps", BUCKET, false, STABLE),
    row("devmap", KBK, false, STABLE),
    row("sockmap", KBK, false, STABLE),
    row("cpumap", KBK, false, STABLE),
    row("xskmap", NONE, false, STABLE),
    row("sockhash", KBK, false, UNORD),
    row("cgroup_storage", KBK, false, ENDS),
    row("reuseport_sockarray", KBK, false, STABLE),
    row("percpu_cgroup_storage", KBK, true, ENDS),
    row("queue", NONE, false, STABLE),
    row("stack", NONE, false, STABLE),
    row("sk_storage", NONE, false, STABLE),
    row("devmap_hash", KBK, false, UNORD),
    row("struct_ops", KBK, false, STABLE),
    row("ringbuf", NONE, false, STABLE),
    row("inode_storage", NONE, false, STABLE),
    row("task_storage", NONE, false, STABLE),
    row("bloom_filter", NONE, false, STABLE),
    row("user_ringbuf", NONE, false, STABLE),
    row("cgrp_storage", NONE, false, STABLE),
    row("arena", NONE, false, STABLE),
];

/// A kernel map type (its number in enum bpf_map_type); the constants are
/// the kernel's (`aya_obj::generated::bpf_map_type`).
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct MapType(pub u32);

#[allow(missing_docs, reason = "the kernel's names")]
impl MapType {
    pub const HASH: Self = Self(bpf_map_type::BPF_MAP_TYPE_HASH as u32);
    pub const ARRAY: Self = Self(bpf_map_type::BPF_MAP_TYPE_ARRAY as u32);
    pub const PROG_ARRAY: Self = Self(bpf_map_type::BPF_MAP_TYPE_PROG_ARRAY as u32);
    pub const PERF_EVENT_ARRAY: Self = Self(bpf_map_type::BPF_MAP_TYPE_PERF_EVENT_ARRAY as u32);
    pub const PERCPU_HASH: Self = Self(bpf_map_type::BPF_MAP_TYPE_PERCPU_HASH as u32);
    pub const PERCPU_ARRAY: Self = Self(bpf_map_type::BPF_MAP_TYPE_PERCPU_ARRAY as u32);
    pub const STACK_TRACE: Self = Self(bpf_map_type::BPF_MAP_TYPE_STACK_TRACE as u32);
    pub const CGROUP_ARRAY: Self = Self(bpf_map_type::BPF_MAP_TYPE_CGROUP_ARRAY as u32);
    pub const LRU_HASH: Self = Self(bpf_map_type::BPF_MAP_TYPE_LRU_HASH as u32);
    pub const LRU_PERCPU_HASH: Self = Self(bpf_map_type::BPF_MAP_TYPE_LRU_PERCPU_HASH as u32);
    pub const LPM_TRIE: Self = Self(bpf_map_type::BPF_MAP_TYPE_LPM_TRIE as u32);
    pub const ARRAY_OF_MAPS: Self = Self(bpf_map_type::BPF_MAP_TYPE_ARRAY_OF_MAPS as u32);
    pub const HASH_OF_MAPS: Self = Self(bpf_map_type::BPF_MAP_TYPE_HASH_OF_MAPS as u32);
    pub const DEVMAP: Self = Self(bpf_map_type::BPF_MAP_TYPE_DEVMAP as u32);
    pub const SOCKMAP: Self = Self(bpf_map_type::BPF_MAP_TYPE_SOCKMAP as u32);
    pub const CPUMAP: Self = Self(bpf_map_type::BPF_MAP_TYPE_CPUMAP as u32);
    pub const XSKMAP: Self = Self(bpf_map_type::BPF_MAP_TYPE_XSKMAP as u32);
    pub const SOCKHASH: Self = Self(bpf_map_type::BPF_MAP_TYPE_SOCKHASH as u32);
    pub const CGROUP_STORAGE: Self = Self(bpf_map_type::BPF_MAP_TYPE_CGROUP_STORAGE as u32);
    pub const REUSEPORT_SOCKARRAY: Self =
        Self(bpf_map_type::BPF_MAP_TYPE_REUSEPORT_SOCKARRAY as u32);
    pub const PERCPU_CGROUP_STORAGE: Self =
        Self(bpf_map_type::BPF_MAP_TYPE_PERCPU_CGROUP_STORAGE as u32);
    pub const QUEUE: Self = Self(bpf_map_type::BPF_MAP_TYPE_QUEUE as u32);
    pub const STACK: Self = Self(bpf_map_type::BPF_MAP_TYPE_STACK as u32);
    pub const SK_STORAGE: Self = Self(bpf_map_type::BPF_MAP_TYPE_SK_STORAGE as u32);
    pub const DEVMAP_HASH: Self = Self(bpf_map_type::BPF_MAP_TYPE_DEVMAP_HASH as u32);
    pub const STRUCT_OPS: Self = Self(bpf_map_type::BPF_MAP_TYPE_STRUCT_OPS as u32);
    pub const RINGBUF: Self = Self(bpf_map_type::BPF_MAP_TYPE_RINGBUF as u32);
    pub const INODE_STORAGE: Self = Self(bpf_map_type::BPF_MAP_TYPE_INODE_STORAGE as u32);
    pub const TASK_STORAGE: Self = Self(bpf_map_type::BPF_MAP_TYPE_TASK_STORAGE as u32);
    pub const BLOOM_FILTER: Self = Self(bpf_map_type::BPF_MAP_TYPE_BLOOM_FILTER as u32);
    pub const USER_RINGBUF: Self = Self(bpf_map_type::BPF_MAP_TYPE_USER_RINGBUF as u32);
    pub const CGRP_STORAGE: Self = Self(bpf_map_type::BPF_MAP_TYPE_CGRP_STORAGE as u32);
    pub const ARENA: Self = Self(bpf_map_type::BPF_MAP_TYPE_ARENA as u32);
}

impl MapType {
    fn row(self) -> Option<&'static TypeRow> {
        TYPES.get(self.0 as usize)
    }

    /// Whether this daemon knows the type (and so the size of its values).
    pub fn is_known(self) -> bool {
        self.row().is_some()
    }

    /// Readable name ("hash", "percpu_array", ...); "unknown(N)" for a type
    /// newer than this daemon.
    pub fn name(self) -> Cow<'static, str> {
        match self.row() {
            Some(r) => Cow::Borrowed(r.name),
            None => Cow::Owned(format!("unknown({})", self.0)),
        }
    }

    /// The type of a readable name ("hash"); `None` for a name this
    /// daemon does not know.
    pub fn by_name(name: &str) -> Option<Self> {
        (1..TYPES.len())
            .find(|&i| TYPES[i].name == name)
            .map(|i| Self(i as u32))
    }

    /// Every type's readable name, in the kernel's order.
    pub fn names() -> impl Iterator<Item = &'static str> {
        TYPES[1..].iter().map(|r| r.name)
    }

    /// How maps of this type are walked.
    pub fn walk_method(self) -> WalkMethod {
        self.row().map_or(WalkMethod::None, |r| r.method)
    }

    /// Whether the type stores one value per possible CPU.
    pub fn is_per_cpu(self) -> bool {
        self.row().is_some_and(|r| r.per_cpu)
    }

    /// What get_next_key does after a key that no longer exists.
    pub fn key_walk(self) -> KeyWalk {
        self.row().map_or(KeyWalk::Stable, |r| r.walk)
    }
}

impl fmt::Display for MapType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.name())
    }
}

impl fmt::Debug for MapType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}({})", self.name(), self.0)
    }
}

/// Number of possible CPUs (`/sys/devices/system/cpu/possible`), the length
/// of per-CPU value lists; 0 when it cannot be read. Never guessed: per-CPU
/// values are sized by it, and a wrong size would let the kernel write past
/// a buffer. With 0, per-CPU maps are refused.
pub fn possible_cpus() -> u32 {
    static CPUS: OnceLock<u32> = OnceLock::new();
    *CPUS.get_or_init(|| match aya::util::nr_cpus() {
        Ok(n) => n as u32,
        Err((path, e)) => {
            tracing::error!(path, error = %e, "cannot read the number of possible CPUs: per-CPU maps cannot be read");
            0
        }
    })
}

/// Whether an errno from `BPF_MAP_LOOKUP_BATCH` means "this map type has no
/// batch lookup" rather than a failure.
pub fn batch_unsupported(errno: Option<i32>) -> bool {
    matches!(errno, Some(libc::EOPNOTSUPP) | Some(ENOTSUPP))
}

/// Whether an errno from get_next_key or an element lookup means "this map
/// type does not support the operation from user space" (some types answer
/// EINVAL rather than ENOTSUPP).
pub fn elem_unsupported(errno: Option<i32>) -> bool {
    batch_unsupported(errno) || errno == Some(libc::EINVAL)
}

/// What the kernel says about a map (`BPF_OBJ_GET_INFO_BY_FD`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MapMeta {
    /// Kernel map id.
    pub id: u32,
    /// Kernel name (at most 15 bytes).
    pub name: String,
    /// The map's type.
    pub map_type: MapType,
    /// Key size in bytes.
    pub key_size: u32,
    /// Value size in bytes (one CPU's value for per-CPU maps).
    pub value_size: u32,
    /// Capacity.
    pub max_entries: u32,
    /// `map_flags` as given at creation.
    pub flags: u32,
    /// BTF object id, 0 when the map has none.
    pub btf_id: u32,
    /// Key type id inside the BTF object.
    pub btf_key_type_id: u32,
    /// Value type id inside the BTF object.
    pub btf_value_type_id: u32,
    /// Possible CPUs on this host.
    pub possible_cpus: u32,
}

impl MapMeta {
    /// Whether entries carry one value per possible CPU.
    pub fn per_cpu(&self) -> bool {
        self.map_type.is_per_cpu()
    }

    /// How the map is walked.
    pub fn walk_method(&self) -> WalkMethod {
        self.map_type.walk_method()
    }

    /// Bytes of one CPU's value inside kernel buffers (8-byte aligned).
    pub fn cpu_stride(&self) -> usize {
        (self.value_size as usize).div_ceil(8) * 8
    }

    /// Why the daemon cannot size buffers for this map's elements: a type
    /// newer than this daemon, or per-CPU values with an unknown CPU count.
    pub fn unsized_reason(&self) -> Option<String> {
        if !self.map_type.is_known() {
            Some(format!(
                "map type {} is newer than this daemon: the size of its values is unknown",
                self.map_type.0
            ))
        } else if self.per_cpu() && self.possible_cpus == 0 {
            Some("the number of possible CPUs is unknown (/sys/devices/system/cpu/possible cannot be read), so per-CPU values cannot be sized".into())
        } else {
            None
        }
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

    /// Bytes of the batch position token (a u32 bucket index for hash-family
    /// maps, the last key otherwise).
    pub fn token_size(&self) -> usize {
        match self.walk_method() {
            WalkMethod::BatchBucket => 4,
            _ => self.key_size as usize,
        }
    }

    /// Appends kernel-layout values (per-CPU values padded to 8 bytes) to
    /// `out` in the wire layout (padding removed).
    pub fn append_wire_values(&self, kernel_values: &[u8], out: &mut Vec<u8>) {
        if self.per_cpu() {
            let (stride, vs) = (self.cpu_stride(), self.value_size as usize);
            for cpu_value in kernel_values.chunks(stride) {
                out.extend_from_slice(&cpu_value[..vs]);
            }
        } else {
            out.extend_from_slice(kernel_values);
        }
    }

    /// A wire-layout per-CPU value split into the values of each CPU.
    pub fn split_cpus<'a>(&self, wire_value: &'a [u8]) -> impl Iterator<Item = &'a [u8]> {
        wire_value.chunks((self.value_size as usize).max(1))
    }

    /// A digest of what makes a map "the same map" apart from its id: type,
    /// sizes, flags and name. A cursor carries it so that a map replaced under
    /// the same path (or a recycled id) is detected.
    pub fn fingerprint(&self) -> [u8; 8] {
        let mut ctx = ring::digest::Context::new(&ring::digest::SHA256);
        for v in [
            self.map_type.0,
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
            map_type: MapType(info.type_),
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

/// Why a map could not be opened.
#[derive(Debug, thiserror::Error)]
pub enum OpenError {
    /// Nothing at that path or id.
    #[error("no such map")]
    NotFound,
    /// The object is a program, link or BTF object.
    #[error("the object is not a BPF map")]
    NotAMap,
    /// Any other kernel error.
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

/// Why a lookup failed.
#[derive(Debug, thiserror::Error)]
pub enum LookupError {
    /// The map type has no lookup from user space.
    #[error("maps of type {0} do not support lookups from user space")]
    Unsupported(MapType),
    /// The daemon cannot size this map's values.
    #[error("{0}")]
    Unsized(String),
    /// A key whose length is not the map's key size.
    #[error("the key is {got} bytes; the map has {expected}-byte keys")]
    KeySize {
        /// The map's key size.
        expected: usize,
        /// The key's length.
        got: usize,
    },
    /// Any other kernel error.
    #[error(transparent)]
    Syscall(#[from] SyscallError),
}

/// The operations a walk needs, with buffers the implementation checks
/// against the map's sizes. The daemon uses [`MapHandle`]; unit tests replace
/// it with a scripted fake.
pub trait MapOps {
    /// `BPF_MAP_LOOKUP_BATCH`; see [`Walker`](walk::Walker) for the contract.
    fn lookup_batch(
        &self,
        in_batch: Option<&[u8]>,
        out_batch: &mut [u8],
        keys: &mut [u8],
        values: &mut [u8],
        count: &mut u32,
    ) -> SysResult<()>;
    /// The key after `key` (the first key for `None`), into `next`.
    fn get_next_key(&self, key: Option<&[u8]>, next: &mut [u8]) -> SysResult<()>;
    /// The value of `key`, in the kernel's layout, into `value`.
    fn lookup(&self, key: &[u8], value: &mut [u8]) -> SysResult<()>;
}

/// A map read through a reference reads the map.
impl<T: MapOps + ?Sized> MapOps for &T {
    fn lookup_batch(
        &self,
        in_batch: Option<&[u8]>,
        out_batch: &mut [u8],
        keys: &mut [u8],
        values: &mut [u8],
        count: &mut u32,
    ) -> SysResult<()> {
        (**self).lookup_batch(in_batch, out_batch, keys, values, count)
    }

    fn get_next_key(&self, key: Option<&[u8]>, next: &mut [u8]) -> SysResult<()> {
        (**self).get_next_key(key, next)
    }

    fn lookup(&self, key: &[u8], value: &mut [u8]) -> SysResult<()> {
        (**self).lookup(key, value)
    }
}

/// The maps the kernel knows, by id (`BPF_MAP_GET_NEXT_ID`; needs
/// CAP_SYS_ADMIN). Stops at the first error, which it yields.
pub fn map_ids() -> impl Iterator<Item = SysResult<u32>> {
    let mut id = 0;
    let mut done = false;
    std::iter::from_fn(move || {
        if done {
            return None;
        }
        match sys::map_get_next_id(id) {
            Ok(Some(next)) => {
                id = next;
                Some(Ok(next))
            }
            Ok(None) => {
                done = true;
                None
            }
            Err(e) => {
                done = true;
                Some(Err(e))
            }
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_table_of_types_follows_the_kernels_numbering() {
        let named = [
            (MapType::HASH, "hash"),
            (MapType::ARRAY, "array"),
            (MapType::PERCPU_HASH, "percpu_hash"),
            (MapType::LRU_PERCPU_HASH, "lru_percpu_hash"),
            (MapType::LPM_TRIE, "lpm_trie"),
            (MapType::CGROUP_STORAGE, "cgroup_storage"),
            (MapType::PERCPU_CGROUP_STORAGE, "percpu_cgroup_storage"),
            (MapType::QUEUE, "queue"),
            (MapType::DEVMAP_HASH, "devmap_hash"),
            (MapType::RINGBUF, "ringbuf"),
            (MapType::BLOOM_FILTER, "bloom_filter"),
            (MapType::ARENA, "arena"),
        ];
        for (t, name) in named {
            assert_eq!(t.name(), name, "{t:?}");
            assert_eq!(MapType::by_name(name), Some(t));
        }
        assert_eq!(
            MapType::names().count(),
            bpf_map_type::__MAX_BPF_MAP_TYPE as usize - 1
        );
    }
}
