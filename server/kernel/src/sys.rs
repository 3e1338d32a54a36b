//! The only place that talks to `bpf(2)`, `mount(2)` and `statfs(2)` (and
//! tunes the C allocator). Every unsafe block of the daemon lives here or
//! in the two handle types that call it, each with its SAFETY note.
//!
//! Functions whose soundness depends on their arguments (buffers the kernel
//! writes into, sized by the map behind an fd; an fd that must be a BTF
//! object) are `unsafe fn` and visible only to the `kernel` module:
//! [`super::MapHandle`] and [`super::OwnedMap`] check every buffer against
//! the map's sizes before calling them, and BTF info is only asked of
//! descriptors that BTF commands returned. Everything else here is safe
//! whatever it is given.
#![allow(unsafe_code, reason = "the syscall seam")]

use std::{
    ffi::{CStr, CString},
    io,
    mem::{self, MaybeUninit},
    os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd},
    path::Path,
};

use aya_obj::generated::{
    BPF_F_RDONLY, bpf_attr, bpf_btf_info, bpf_cmd, bpf_func_info, bpf_map_info, bpf_prog_info,
};

/// A failed syscall: which command, and the errno it returned.
#[derive(Debug, thiserror::Error)]
#[error("{call} failed: {io_error}")]
pub struct SyscallError {
    /// The command, e.g. "BPF_MAP_LOOKUP_BATCH".
    pub call: &'static str,
    /// The error the kernel returned.
    pub io_error: io::Error,
}

impl SyscallError {
    /// The errno, when the error came from the kernel.
    pub fn errno(&self) -> Option<i32> {
        self.io_error.raw_os_error().or_else(|| {
            self.io_error
                .get_ref()
                .and_then(|e| e.downcast_ref::<KernelLog>())
                .map(|log| log.errno)
        })
    }

    pub(super) fn invalid_input(call: &'static str, message: String) -> Self {
        Self {
            call,
            io_error: io::Error::new(io::ErrorKind::InvalidInput, message),
        }
    }
}

/// An errno together with the log the kernel wrote for it (BTF loading), so
/// that [`SyscallError::errno`] still works when the message carries the log.
#[derive(Debug)]
struct KernelLog {
    errno: i32,
    log: String,
}

impl std::fmt::Display for KernelLog {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{}; kernel log: {}",
            io::Error::from_raw_os_error(self.errno),
            self.log
        )
    }
}

impl std::error::Error for KernelLog {}

/// The result of a syscall wrapper.
pub type SysResult<T> = Result<T, SyscallError>;

/// `ENOTSUPP` (524): the kernel-internal "operation not supported" that the
/// BPF syscall leaks to user space.
pub const ENOTSUPP: i32 = 524;

fn zeroed_attr() -> bpf_attr {
    // SAFETY: bpf_attr is a plain C union of integers and arrays; all-zero is
    // a valid value and what the kernel expects for unused fields.
    unsafe { mem::zeroed() }
}

/// Issues `bpf(cmd, attr)`.
///
/// # Safety
/// Every pointer stored in `attr` must refer to a live buffer at least as
/// large as what the kernel reads or writes through it for `cmd`, given the
/// other fields of `attr` and the object behind any fd in it.
unsafe fn bpf(call: &'static str, cmd: bpf_cmd, attr: &mut bpf_attr) -> SysResult<i64> {
    // SAFETY: `attr` is a valid bpf_attr that outlives the call; the caller
    // guarantees that the buffers it points to fit the command.
    let ret = unsafe {
        libc::syscall(
            libc::SYS_bpf,
            cmd as libc::c_long,
            attr as *mut bpf_attr,
            mem::size_of::<bpf_attr>() as libc::c_long,
        )
    };
    if ret < 0 {
        Err(SyscallError {
            call,
            io_error: io::Error::last_os_error(),
        })
    } else {
        Ok(ret)
    }
}

/// Takes ownership of a descriptor a bpf command just created.
///
/// # Safety
/// `ret` must be a new file descriptor that nothing else owns.
unsafe fn owned_fd(ret: i64) -> OwnedFd {
    // SAFETY: guaranteed by the caller.
    unsafe { OwnedFd::from_raw_fd(ret as RawFd) }
}

fn cstring(path: &Path, call: &'static str) -> SysResult<CString> {
    use std::os::unix::ffi::OsStrExt as _;
    CString::new(path.as_os_str().as_bytes())
        .map_err(|_| SyscallError::invalid_input(call, "path contains a NUL byte".into()))
}

fn ptr<T>(p: *const T) -> u64 {
    p as usize as u64
}

/// Opens a pinned object read-only (`BPF_OBJ_GET` with `BPF_F_RDONLY`).
pub(super) fn obj_get_rdonly(path: &Path) -> SysResult<OwnedFd> {
    obj_get(path, BPF_F_RDONLY)
}

/// Opens a pinned object for reading and writing (`BPF_OBJ_GET` with
/// `file_flags` 0): the pin must be readable and writable by the caller.
pub(super) fn obj_get_writable(path: &Path) -> SysResult<OwnedFd> {
    obj_get(path, 0)
}

fn obj_get(path: &Path, file_flags: u32) -> SysResult<OwnedFd> {
    let c = cstring(path, "BPF_OBJ_GET")?;
    let mut attr = zeroed_attr();
    attr.__bindgen_anon_4.pathname = ptr(c.as_ptr());
    attr.__bindgen_anon_4.file_flags = file_flags;
    // SAFETY: the only pointer is the NUL-terminated path, alive for the call.
    let ret = unsafe { bpf("BPF_OBJ_GET", bpf_cmd::BPF_OBJ_GET, &mut attr) }?;
    // SAFETY: BPF_OBJ_GET returns a new descriptor.
    Ok(unsafe { owned_fd(ret) })
}

/// Opens a map by kernel id, read-only. Needs CAP_SYS_ADMIN.
pub(super) fn map_get_fd_by_id_rdonly(id: u32) -> SysResult<OwnedFd> {
    map_get_fd_by_id(id, BPF_F_RDONLY)
}

/// Opens a map by kernel id for reading and writing (`open_flags` 0). Needs
/// CAP_SYS_ADMIN.
pub(super) fn map_get_fd_by_id_writable(id: u32) -> SysResult<OwnedFd> {
    map_get_fd_by_id(id, 0)
}

fn map_get_fd_by_id(id: u32, open_flags: u32) -> SysResult<OwnedFd> {
    let mut attr = zeroed_attr();
    attr.__bindgen_anon_6.__bindgen_anon_1.map_id = id;
    attr.__bindgen_anon_6.open_flags = open_flags;
    // SAFETY: no pointers in the attribute.
    let ret = unsafe {
        bpf(
            "BPF_MAP_GET_FD_BY_ID",
            bpf_cmd::BPF_MAP_GET_FD_BY_ID,
            &mut attr,
        )
    }?;
    // SAFETY: BPF_MAP_GET_FD_BY_ID returns a new descriptor.
    Ok(unsafe { owned_fd(ret) })
}

/// The access mode `fd` was opened with (`fcntl(F_GETFL) & O_ACCMODE`):
/// `O_RDONLY`, `O_WRONLY` or `O_RDWR`. A map opened with `BPF_F_RDONLY`
/// is `O_RDONLY`; one opened with no flags (or created) is `O_RDWR`.
pub(super) fn access_mode(fd: BorrowedFd<'_>) -> SysResult<libc::c_int> {
    // SAFETY: F_GETFL takes no argument and only reads the flags of the
    // descriptor, which `fd` keeps open for the call.
    let ret = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_GETFL) };
    if ret < 0 {
        return Err(SyscallError {
            call: "fcntl(F_GETFL)",
            io_error: io::Error::last_os_error(),
        });
    }
    Ok(ret & libc::O_ACCMODE)
}

/// The next map id after `start` (`BPF_MAP_GET_NEXT_ID`); `None` at the end.
pub(super) fn map_get_next_id(start: u32) -> SysResult<Option<u32>> {
    get_next_id("BPF_MAP_GET_NEXT_ID", bpf_cmd::BPF_MAP_GET_NEXT_ID, start)
}

/// The next program id after `start` (`BPF_PROG_GET_NEXT_ID`); `None` at
/// the end. Needs CAP_SYS_ADMIN.
pub(super) fn prog_get_next_id(start: u32) -> SysResult<Option<u32>> {
    get_next_id("BPF_PROG_GET_NEXT_ID", bpf_cmd::BPF_PROG_GET_NEXT_ID, start)
}

/// The next id after `start` of the objects `cmd` walks (one of the
/// `BPF_*_GET_NEXT_ID` commands); `None` at the end.
fn get_next_id(call: &'static str, cmd: bpf_cmd, start: u32) -> SysResult<Option<u32>> {
    let mut attr = zeroed_attr();
    attr.__bindgen_anon_6.__bindgen_anon_1.start_id = start;
    // SAFETY: no pointers in the attribute.
    match unsafe { bpf(call, cmd, &mut attr) } {
        // SAFETY: reading a u32 field of the union the kernel just wrote.
        Ok(_) => Ok(Some(unsafe { attr.__bindgen_anon_6.next_id })),
        Err(e) if e.errno() == Some(libc::ENOENT) => Ok(None),
        Err(e) => Err(e),
    }
}

/// A descriptor of a loaded program. Only [`prog_get_fd_by_id`] makes one,
/// so it always refers to a program: the kernel reads and writes a
/// `bpf_prog_info` for it.
#[derive(Debug)]
pub(super) struct ProgFd(OwnedFd);

/// Opens a program by kernel id (`BPF_PROG_GET_FD_BY_ID`). Needs
/// CAP_SYS_ADMIN.
pub(super) fn prog_get_fd_by_id(id: u32) -> SysResult<ProgFd> {
    let mut attr = zeroed_attr();
    attr.__bindgen_anon_6.__bindgen_anon_1.prog_id = id;
    // SAFETY: no pointers in the attribute.
    let ret = unsafe {
        bpf(
            "BPF_PROG_GET_FD_BY_ID",
            bpf_cmd::BPF_PROG_GET_FD_BY_ID,
            &mut attr,
        )
    }?;
    // SAFETY: BPF_PROG_GET_FD_BY_ID returns a new descriptor.
    Ok(ProgFd(unsafe { owned_fd(ret) }))
}

/// `BPF_OBJ_GET_INFO_BY_FD` for a program, without its arrays: among the
/// rest, how many maps it uses (`nr_map_ids`, for [`prog_map_ids`]).
pub(super) fn prog_info(fd: &ProgFd) -> SysResult<bpf_prog_info> {
    let mut info = MaybeUninit::<bpf_prog_info>::zeroed();
    let mut attr = zeroed_attr();
    attr.info.bpf_fd = fd.0.as_raw_fd() as u32;
    attr.info.info_len = mem::size_of::<bpf_prog_info>() as u32;
    attr.info.info = ptr(info.as_mut_ptr());
    // SAFETY: `fd` is a program (see `ProgFd`), so the kernel fills `info`
    // as a bpf_prog_info, a writable one of exactly info_len bytes; its
    // array pointers are all 0, so the kernel writes no array.
    unsafe {
        bpf(
            "BPF_OBJ_GET_INFO_BY_FD",
            bpf_cmd::BPF_OBJ_GET_INFO_BY_FD,
            &mut attr,
        )
    }?;
    // SAFETY: the buffer was zero-initialised (a valid bpf_prog_info: plain
    // integers) and the kernel wrote at most info_len bytes of it.
    Ok(unsafe { info.assume_init() })
}

/// The kernel id of the program `fd` refers to (`BPF_OBJ_GET_INFO_BY_FD`),
/// such as one [`prog_load`] returned.
pub(super) fn prog_id(fd: BorrowedFd<'_>) -> SysResult<u32> {
    let mut info = MaybeUninit::<bpf_prog_info>::zeroed();
    let mut attr = zeroed_attr();
    attr.info.bpf_fd = fd.as_raw_fd() as u32;
    attr.info.info_len = mem::size_of::<bpf_prog_info>() as u32;
    attr.info.info = ptr(info.as_mut_ptr());
    // SAFETY: `info` is a writable, zeroed bpf_prog_info of exactly
    // info_len bytes, and the kernel writes at most info_len bytes into it
    // whatever the object behind `fd` (the info of a map or a BTF object is
    // smaller); its array pointers are all 0, so the kernel writes no array.
    unsafe {
        bpf(
            "BPF_OBJ_GET_INFO_BY_FD",
            bpf_cmd::BPF_OBJ_GET_INFO_BY_FD,
            &mut attr,
        )
    }?;
    // SAFETY: the buffer was zero-initialised (a valid bpf_prog_info: plain
    // integers) and the kernel wrote at most info_len bytes of it.
    Ok(unsafe { info.assume_init() }.id)
}

/// The ids of the maps a program uses: `BPF_OBJ_GET_INFO_BY_FD` with room
/// for `count` of them (its `nr_map_ids`, from [`prog_info`]). A program
/// given more maps since (`BPF_PROG_BIND_MAP`) has its first `count`
/// returned.
pub(super) fn prog_map_ids(fd: &ProgFd, count: u32) -> SysResult<Vec<u32>> {
    let mut ids = vec![0u32; count as usize];
    // SAFETY: bpf_prog_info is plain integers: all-zero is a valid value.
    let mut info: bpf_prog_info = unsafe { mem::zeroed() };
    info.nr_map_ids = count;
    info.map_ids = ptr(ids.as_mut_ptr());
    let mut attr = zeroed_attr();
    attr.info.bpf_fd = fd.0.as_raw_fd() as u32;
    attr.info.info_len = mem::size_of::<bpf_prog_info>() as u32;
    attr.info.info = ptr(&mut info as *mut bpf_prog_info);
    // SAFETY: `fd` is a program (see `ProgFd`): the kernel fills `info`, a
    // writable bpf_prog_info of exactly info_len bytes, and copies at most
    // nr_map_ids u32s to map_ids, which points to `ids`, `count` u32s long.
    // Every other array pointer is 0.
    unsafe {
        bpf(
            "BPF_OBJ_GET_INFO_BY_FD",
            bpf_cmd::BPF_OBJ_GET_INFO_BY_FD,
            &mut attr,
        )
    }?;
    // The kernel says how many the program has; it copied no more than
    // `count`.
    ids.truncate(info.nr_map_ids.min(count) as usize);
    Ok(ids)
}

/// Whether `fd` refers to a BPF map (and not a program, link or BTF object).
pub(super) fn is_map_fd(fd: BorrowedFd<'_>) -> bool {
    std::fs::read_link(format!("/proc/self/fd/{}", fd.as_raw_fd()))
        .map(|target| target.as_os_str() == "anon_inode:bpf-map")
        .unwrap_or(false)
}

/// `BPF_OBJ_GET_INFO_BY_FD` for a map.
pub(super) fn map_info(fd: BorrowedFd<'_>) -> SysResult<bpf_map_info> {
    let mut info = MaybeUninit::<bpf_map_info>::zeroed();
    let mut attr = zeroed_attr();
    attr.info.bpf_fd = fd.as_raw_fd() as u32;
    attr.info.info_len = mem::size_of::<bpf_map_info>() as u32;
    attr.info.info = ptr(info.as_mut_ptr());
    // SAFETY: `info` is a writable bpf_map_info of exactly info_len bytes.
    unsafe {
        bpf(
            "BPF_OBJ_GET_INFO_BY_FD",
            bpf_cmd::BPF_OBJ_GET_INFO_BY_FD,
            &mut attr,
        )
    }?;
    // SAFETY: the buffer was zero-initialised (a valid bpf_map_info) and the
    // kernel wrote at most info_len bytes of it.
    Ok(unsafe { info.assume_init() })
}

/// The buffers of a batch read (`BPF_MAP_LOOKUP_BATCH`,
/// `BPF_MAP_LOOKUP_AND_DELETE_BATCH`): the position token to continue
/// after (none: from the first entry), room for the token the kernel
/// returns, for keys and for values, and `count`: the capacity on entry,
/// the entries copied on return.
#[derive(Debug)]
pub(super) struct BatchBuffers<'a> {
    pub(super) in_batch: Option<&'a [u8]>,
    pub(super) out_batch: &'a mut [u8],
    pub(super) keys: &'a mut [u8],
    pub(super) values: &'a mut [u8],
    pub(super) count: &'a mut u32,
}

/// `BPF_MAP_LOOKUP_BATCH`. `count` holds the capacity on entry and the number
/// of entries copied on return, also when the call fails with ENOENT (the end
/// of the map).
///
/// # Safety
/// `fd` must be a map whose batch token is at most `out_batch.len()` bytes
/// (4 for hash-family maps, the key size otherwise), and `keys` and `values`
/// must hold `*count` keys and `*count` kernel-sized values of that map.
/// `in_batch`, when given, must be as large as the token.
pub(super) unsafe fn lookup_batch(fd: BorrowedFd<'_>, b: BatchBuffers<'_>) -> SysResult<()> {
    // SAFETY: the caller's guarantees are those of `read_batch`.
    unsafe { read_batch("BPF_MAP_LOOKUP_BATCH", bpf_cmd::BPF_MAP_LOOKUP_BATCH, fd, b) }
}

/// `BPF_MAP_LOOKUP_AND_DELETE_BATCH`: as [`lookup_batch`], and the entries
/// copied are deleted from the map. Needs a writable descriptor (EPERM on a
/// read-only one). The kernel deletes the entries before it copies them to
/// `keys` and `values`: if that copy faults, they are gone without being
/// returned (EFAULT, `count` not written), so the buffers must be memory
/// the caller has touched.
///
/// On the hash path the kernel writes `count` and `out_batch` together, at
/// the end of every call that got past its argument checks (success,
/// ENOENT, ENOSPC, a bucket lock that failed); calls refused before that
/// (ENOENT for a token past the last bucket, EINVAL, ENOMEM) write neither.
///
/// # Safety
/// As [`lookup_batch`].
pub(super) unsafe fn lookup_and_delete_batch(
    fd: BorrowedFd<'_>,
    b: BatchBuffers<'_>,
) -> SysResult<()> {
    // SAFETY: the caller's guarantees are those of `read_batch`.
    unsafe {
        read_batch(
            "BPF_MAP_LOOKUP_AND_DELETE_BATCH",
            bpf_cmd::BPF_MAP_LOOKUP_AND_DELETE_BATCH,
            fd,
            b,
        )
    }
}

/// A batch command that copies entries out (`BPF_MAP_LOOKUP_BATCH`,
/// `BPF_MAP_LOOKUP_AND_DELETE_BATCH`).
///
/// # Safety
/// As [`lookup_batch`].
unsafe fn read_batch(
    call: &'static str,
    cmd: bpf_cmd,
    fd: BorrowedFd<'_>,
    b: BatchBuffers<'_>,
) -> SysResult<()> {
    let mut attr = zeroed_attr();
    attr.batch.map_fd = fd.as_raw_fd() as u32;
    attr.batch.in_batch = b.in_batch.map_or(0, |t| ptr(t.as_ptr()));
    attr.batch.out_batch = ptr(b.out_batch.as_mut_ptr());
    attr.batch.keys = ptr(b.keys.as_mut_ptr());
    attr.batch.values = ptr(b.values.as_mut_ptr());
    attr.batch.count = *b.count;
    // SAFETY: the caller guarantees the buffers fit `count` elements of the map.
    let ret = unsafe { bpf(call, cmd, &mut attr) };
    // SAFETY: reading a u32 field of the union; the kernel writes `count`
    // back in both success and failure (or leaves it as it was).
    *b.count = unsafe { attr.batch.count };
    ret.map(drop)
}

/// `BPF_MAP_GET_NEXT_KEY`: `key = None` asks for the first key.
///
/// # Safety
/// `fd` must be a map whose keys are `next.len()` bytes (and `key.len()`).
pub(super) unsafe fn get_next_key(
    fd: BorrowedFd<'_>,
    key: Option<&[u8]>,
    next: &mut [u8],
) -> SysResult<()> {
    let mut attr = zeroed_attr();
    attr.__bindgen_anon_2.map_fd = fd.as_raw_fd() as u32;
    attr.__bindgen_anon_2.key = key.map_or(0, |k| ptr(k.as_ptr()));
    attr.__bindgen_anon_2.__bindgen_anon_1.next_key = ptr(next.as_mut_ptr());
    // SAFETY: the caller guarantees both buffers are one key of the map.
    unsafe {
        bpf(
            "BPF_MAP_GET_NEXT_KEY",
            bpf_cmd::BPF_MAP_GET_NEXT_KEY,
            &mut attr,
        )
    }
    .map(drop)
}

/// `BPF_MAP_LOOKUP_ELEM`.
///
/// # Safety
/// `fd` must be a map whose keys are `key.len()` bytes and whose elements are
/// `value.len()` bytes in the kernel's layout (for per-CPU maps:
/// round_up(value_size, 8) * possible CPUs).
pub(super) unsafe fn lookup_elem(
    fd: BorrowedFd<'_>,
    key: &[u8],
    value: &mut [u8],
) -> SysResult<()> {
    let mut attr = zeroed_attr();
    attr.__bindgen_anon_2.map_fd = fd.as_raw_fd() as u32;
    attr.__bindgen_anon_2.key = ptr(key.as_ptr());
    attr.__bindgen_anon_2.__bindgen_anon_1.value = ptr(value.as_mut_ptr());
    // SAFETY: the caller guarantees the buffers fit the map.
    unsafe {
        bpf(
            "BPF_MAP_LOOKUP_ELEM",
            bpf_cmd::BPF_MAP_LOOKUP_ELEM,
            &mut attr,
        )
    }
    .map(drop)
}

/// `BPF_MAP_UPDATE_ELEM` with `BPF_ANY`.
///
/// # Safety
/// As [`lookup_elem`]: the buffers must be one key and one element of the map.
pub(super) unsafe fn update_elem(fd: BorrowedFd<'_>, key: &[u8], value: &[u8]) -> SysResult<()> {
    let mut attr = zeroed_attr();
    attr.__bindgen_anon_2.map_fd = fd.as_raw_fd() as u32;
    attr.__bindgen_anon_2.key = ptr(key.as_ptr());
    attr.__bindgen_anon_2.__bindgen_anon_1.value = ptr(value.as_ptr());
    // SAFETY: the caller guarantees the buffers fit the map.
    unsafe {
        bpf(
            "BPF_MAP_UPDATE_ELEM",
            bpf_cmd::BPF_MAP_UPDATE_ELEM,
            &mut attr,
        )
    }
    .map(drop)
}

/// `BPF_MAP_UPDATE_BATCH`: `keys` and `values` hold `count` packed elements.
///
/// # Safety
/// `keys` and `values` must hold `count` keys and `count` kernel-sized
/// elements of the map behind `fd`.
pub(super) unsafe fn update_batch(
    fd: BorrowedFd<'_>,
    keys: &[u8],
    values: &[u8],
    count: u32,
) -> SysResult<()> {
    let mut attr = zeroed_attr();
    attr.batch.map_fd = fd.as_raw_fd() as u32;
    attr.batch.keys = ptr(keys.as_ptr());
    attr.batch.values = ptr(values.as_ptr());
    attr.batch.count = count;
    // SAFETY: the caller guarantees the buffers hold `count` elements.
    unsafe {
        bpf(
            "BPF_MAP_UPDATE_BATCH",
            bpf_cmd::BPF_MAP_UPDATE_BATCH,
            &mut attr,
        )
    }
    .map(drop)
}

/// `BPF_MAP_DELETE_ELEM`.
///
/// # Safety
/// `key` must be one key of the map behind `fd`.
pub(super) unsafe fn delete_elem(fd: BorrowedFd<'_>, key: &[u8]) -> SysResult<()> {
    let mut attr = zeroed_attr();
    attr.__bindgen_anon_2.map_fd = fd.as_raw_fd() as u32;
    attr.__bindgen_anon_2.key = ptr(key.as_ptr());
    // SAFETY: the caller guarantees the key fits the map.
    unsafe {
        bpf(
            "BPF_MAP_DELETE_ELEM",
            bpf_cmd::BPF_MAP_DELETE_ELEM,
            &mut attr,
        )
    }
    .map(drop)
}

/// Parameters of `BPF_MAP_CREATE`.
#[derive(Debug, Clone, Copy, Default)]
pub struct CreateMap<'a> {
    /// Kernel map type number.
    pub map_type: u32,
    /// Key size in bytes.
    pub key_size: u32,
    /// Value size in bytes (one CPU's value for per-CPU maps).
    pub value_size: u32,
    /// Capacity.
    pub max_entries: u32,
    /// `map_flags` (BPF_F_NO_PREALLOC, ...).
    pub flags: u32,
    /// Kernel name (at most 15 bytes are kept).
    pub name: &'a str,
    /// The template inner map, for array_of_maps and hash_of_maps.
    pub inner_map: Option<BorrowedFd<'a>>,
    /// Key and value types; the kernel checks that they have the map's sizes.
    pub btf: Option<MapBtf<'a>>,
}

/// The BTF of a map being created: a loaded BTF object and the ids of the
/// key and value types in it.
#[derive(Debug, Clone, Copy)]
pub struct MapBtf<'a> {
    /// The BTF object (from `BPF_BTF_LOAD`).
    pub fd: BorrowedFd<'a>,
    /// Key type id; 0 for maps without keys (bloom filter).
    pub key_type_id: u32,
    /// Value type id.
    pub value_type_id: u32,
}

/// `BPF_MAP_CREATE`.
pub(super) fn create_map(params: &CreateMap<'_>) -> SysResult<OwnedFd> {
    let mut attr = zeroed_attr();
    let mut create = aya_obj::generated::bpf_attr__bindgen_ty_1 {
        map_type: params.map_type,
        key_size: params.key_size,
        value_size: params.value_size,
        max_entries: params.max_entries,
        map_flags: params.flags,
        inner_map_fd: params.inner_map.map_or(0, |fd| fd.as_raw_fd() as u32),
        numa_node: 0,
        map_name: [0; 16],
        map_ifindex: 0,
        btf_fd: params.btf.map_or(0, |b| b.fd.as_raw_fd() as u32),
        btf_key_type_id: params.btf.map_or(0, |b| b.key_type_id),
        btf_value_type_id: params.btf.map_or(0, |b| b.value_type_id),
        btf_vmlinux_value_type_id: 0,
        map_extra: 0,
        value_type_btf_obj_fd: 0,
        map_token_fd: 0,
    };
    for (dst, src) in create.map_name.iter_mut().zip(params.name.bytes().take(15)) {
        *dst = src as libc::c_char;
    }
    attr.__bindgen_anon_1 = create;
    // SAFETY: no pointers in the attribute (the name is inline).
    let ret = unsafe { bpf("BPF_MAP_CREATE", bpf_cmd::BPF_MAP_CREATE, &mut attr) }?;
    // SAFETY: BPF_MAP_CREATE returns a new descriptor.
    Ok(unsafe { owned_fd(ret) })
}

/// Largest BTF object read from the kernel (vmlinux is about 6 MiB).
pub const MAX_BTF_SIZE: usize = 64 << 20;

/// Longest BTF object name read (kernel names are module names, < 64).
const MAX_BTF_NAME: u32 = 4096;

/// Opens a BTF object by kernel id (`BPF_BTF_GET_FD_BY_ID`). Needs
/// CAP_SYS_ADMIN.
pub(super) fn btf_get_fd_by_id(id: u32) -> SysResult<OwnedFd> {
    let mut attr = zeroed_attr();
    attr.__bindgen_anon_6.__bindgen_anon_1.btf_id = id;
    // SAFETY: no pointers in the attribute.
    let ret = unsafe {
        bpf(
            "BPF_BTF_GET_FD_BY_ID",
            bpf_cmd::BPF_BTF_GET_FD_BY_ID,
            &mut attr,
        )
    }?;
    // SAFETY: BPF_BTF_GET_FD_BY_ID returns a new descriptor.
    Ok(unsafe { owned_fd(ret) })
}

/// A BTF object as the kernel holds it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BtfInfo {
    /// Kernel BTF object id.
    pub id: u32,
    /// "vmlinux" or a module name for kernel BTF; empty for loaded BTF.
    pub name: String,
    /// Whether this is the kernel's own BTF (vmlinux or a module's, which is
    /// split BTF on top of vmlinux).
    pub kernel_btf: bool,
    /// The raw BTF, exactly as loaded.
    pub data: Vec<u8>,
}

/// `BPF_OBJ_GET_INFO_BY_FD` for a BTF object, with its data and name.
///
/// # Safety
/// `fd` must refer to a BTF object: for another kind of object the kernel
/// reads the same buffer as that object's info struct, whose pointer fields
/// sit where this one's lengths are.
pub(super) unsafe fn btf_info(fd: BorrowedFd<'_>) -> SysResult<BtfInfo> {
    const CALL: &str = "BPF_OBJ_GET_INFO_BY_FD";
    // SAFETY: `info` is a zeroed bpf_btf_info: no buffers, so the kernel
    // only reports the sizes.
    let sizes = unsafe { btf_info_call(fd, bpf_btf_info_zeroed()) }?;
    let size = sizes.btf_size as usize;
    if size > MAX_BTF_SIZE {
        return Err(SyscallError::invalid_input(
            CALL,
            format!(
                "BTF object {} is {size} bytes, more than the {MAX_BTF_SIZE} this daemon reads",
                sizes.id
            ),
        ));
    }
    if sizes.name_len > MAX_BTF_NAME {
        return Err(SyscallError::invalid_input(
            CALL,
            format!("BTF object {} has a {}-byte name", sizes.id, sizes.name_len),
        ));
    }
    let mut data = vec![0u8; size];
    let mut name = vec![0u8; sizes.name_len as usize + 1];
    let mut info = bpf_btf_info_zeroed();
    info.btf = ptr(data.as_mut_ptr());
    info.btf_size = size as u32;
    info.name = ptr(name.as_mut_ptr());
    info.name_len = name.len() as u32;
    // SAFETY: `data` and `name` are writable buffers of exactly btf_size
    // and name_len bytes; the kernel copies at most that much into them.
    let info = match unsafe { btf_info_call(fd, info) } {
        // Before 5.11 the kernel has no name fields and refuses non-zero
        // bytes past the fields it knows.
        Err(e) if e.errno() == Some(libc::E2BIG) => {
            info.name = 0;
            info.name_len = 0;
            // SAFETY: as above, without the name buffer.
            unsafe { btf_info_call(fd, info) }?
        }
        other => other?,
    };
    if info.btf_size as usize != size {
        return Err(SyscallError::invalid_input(
            CALL,
            format!(
                "BTF object {} changed size while being read ({size} then {} bytes)",
                info.id, info.btf_size
            ),
        ));
    }
    let name_end = name.iter().position(|&b| b == 0).unwrap_or(name.len());
    name.truncate(name_end);
    Ok(BtfInfo {
        id: info.id,
        name: String::from_utf8_lossy(&name).into_owned(),
        kernel_btf: info.kernel_btf != 0,
        data,
    })
}

fn bpf_btf_info_zeroed() -> bpf_btf_info {
    bpf_btf_info {
        btf: 0,
        btf_size: 0,
        id: 0,
        name: 0,
        name_len: 0,
        kernel_btf: 0,
    }
}

/// One `BPF_OBJ_GET_INFO_BY_FD` call with `info` as given.
///
/// # Safety
/// `fd` must be a BTF object, and `info.btf` / `info.name` either 0 or
/// writable buffers of `info.btf_size` / `info.name_len` bytes.
unsafe fn btf_info_call(fd: BorrowedFd<'_>, mut info: bpf_btf_info) -> SysResult<bpf_btf_info> {
    let mut attr = zeroed_attr();
    attr.info.bpf_fd = fd.as_raw_fd() as u32;
    attr.info.info_len = mem::size_of::<bpf_btf_info>() as u32;
    attr.info.info = ptr(&mut info as *mut bpf_btf_info);
    // SAFETY: `info` is a writable bpf_btf_info of exactly info_len bytes,
    // and the caller guarantees the buffers it points to.
    unsafe {
        bpf(
            "BPF_OBJ_GET_INFO_BY_FD",
            bpf_cmd::BPF_OBJ_GET_INFO_BY_FD,
            &mut attr,
        )
    }?;
    Ok(info)
}

/// Size of the log buffer of a failed `BPF_BTF_LOAD`'s second attempt.
const BTF_LOG_SIZE: usize = 64 << 10;

/// `BPF_BTF_LOAD`. When the kernel refuses the data, the load is retried
/// with a log buffer and the error carries the kernel's explanation (the
/// first attempt has none: a log that does not fit makes the load fail).
pub(super) fn btf_load(data: &[u8]) -> SysResult<OwnedFd> {
    const CALL: &str = "BPF_BTF_LOAD";
    let size = u32::try_from(data.len())
        .map_err(|_| SyscallError::invalid_input(CALL, "BTF larger than 4 GiB".into()))?;
    let load = |log: Option<&mut [u8]>| -> SysResult<OwnedFd> {
        let mut attr = zeroed_attr();
        attr.__bindgen_anon_7.btf = ptr(data.as_ptr());
        attr.__bindgen_anon_7.btf_size = size;
        if let Some(log) = log {
            attr.__bindgen_anon_7.btf_log_buf = ptr(log.as_mut_ptr());
            attr.__bindgen_anon_7.btf_log_size = log.len() as u32;
            attr.__bindgen_anon_7.btf_log_level = 1;
        }
        // SAFETY: `data` is readable for btf_size bytes and the log buffer,
        // when given, writable for btf_log_size bytes.
        let ret = unsafe { bpf(CALL, bpf_cmd::BPF_BTF_LOAD, &mut attr) }?;
        // SAFETY: BPF_BTF_LOAD returns a new descriptor.
        Ok(unsafe { owned_fd(ret) })
    };
    let first = match load(None) {
        Ok(fd) => return Ok(fd),
        Err(e) => e,
    };
    let Some(errno) = first.errno() else {
        return Err(first);
    };
    let mut log = vec![0u8; BTF_LOG_SIZE];
    match load(Some(&mut log)) {
        Ok(fd) => Ok(fd),
        Err(_) => {
            let text = btf_log_text(&log);
            if text.is_empty() {
                return Err(first);
            }
            Err(SyscallError {
                call: CALL,
                io_error: io::Error::new(
                    io::Error::from_raw_os_error(errno).kind(),
                    KernelLog { errno, log: text },
                ),
            })
        }
    }
}

/// The end of a BTF verifier log, where the kernel names what it refused
/// (before that it echoes the header and every type it accepted).
fn btf_log_text(log: &[u8]) -> String {
    const LINES: usize = 3;
    let end = log.iter().position(|&b| b == 0).unwrap_or(log.len());
    let text = String::from_utf8_lossy(&log[..end]);
    let lines: Vec<&str> = text
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .collect();
    lines[lines.len().saturating_sub(LINES)..].join("; ")
}

/// `BPF_OBJ_PIN`: pins `fd` at `path` (inside a bpffs).
pub(super) fn obj_pin(fd: BorrowedFd<'_>, path: &Path) -> SysResult<()> {
    let c = cstring(path, "BPF_OBJ_PIN")?;
    let mut attr = zeroed_attr();
    attr.__bindgen_anon_4.pathname = ptr(c.as_ptr());
    attr.__bindgen_anon_4.bpf_fd = fd.as_raw_fd() as u32;
    // SAFETY: the only pointer is the NUL-terminated path, alive for the call.
    unsafe { bpf("BPF_OBJ_PIN", bpf_cmd::BPF_OBJ_PIN, &mut attr) }.map(drop)
}

/// Whether `path` is the root of (or inside) a mounted bpffs.
pub fn is_bpffs(path: &Path) -> SysResult<bool> {
    let c = cstring(path, "statfs")?;
    let mut buf = MaybeUninit::<libc::statfs>::zeroed();
    // SAFETY: `c` is a NUL-terminated path and `buf` a writable statfs.
    let ret = unsafe { libc::statfs(c.as_ptr(), buf.as_mut_ptr()) };
    if ret != 0 {
        return Err(SyscallError {
            call: "statfs",
            io_error: io::Error::last_os_error(),
        });
    }
    // SAFETY: statfs succeeded and filled the buffer.
    let st = unsafe { buf.assume_init() };
    #[allow(
        clippy::unnecessary_cast,
        reason = "f_type and the magic are i64 on x86_64 but u32 or i32 elsewhere"
    )]
    let (f_type, bpffs) = (st.f_type as i64, libc::BPF_FS_MAGIC as i64);
    Ok(f_type == bpffs)
}

/// `mount -t bpf bpf PATH` (mode 0700 at the root).
pub fn mount_bpffs(path: &Path) -> SysResult<()> {
    let target = cstring(path, "mount")?;
    let fstype: &CStr = c"bpf";
    let opts: &CStr = c"mode=0700";
    // SAFETY: all arguments are NUL-terminated strings that outlive the call.
    let ret = unsafe {
        libc::mount(
            fstype.as_ptr(),
            target.as_ptr(),
            fstype.as_ptr(),
            0,
            opts.as_ptr().cast(),
        )
    };
    if ret != 0 {
        return Err(SyscallError {
            call: "mount",
            io_error: io::Error::last_os_error(),
        });
    }
    Ok(())
}

/// Lazily detaches the mount at `path` (`umount2(MNT_DETACH)`).
pub fn umount(path: &Path) -> SysResult<()> {
    let target = cstring(path, "umount2")?;
    // SAFETY: `target` is a NUL-terminated string that outlives the call.
    let ret = unsafe { libc::umount2(target.as_ptr(), libc::MNT_DETACH) };
    if ret != 0 {
        return Err(SyscallError {
            call: "umount2",
            io_error: io::Error::last_os_error(),
        });
    }
    Ok(())
}

/// Makes glibc's malloc hand large buffers back to the system when they
/// are freed, and keep in the heap those of up to about twice `kept` bytes,
/// the largest chunk of a dump with the daemon's limits (an encoder's buffer
/// grows to twice a message). By default glibc raises its mmap threshold as
/// large buffers are freed, after which they come from the heap and stay in
/// the process: after 64 slow streams left, the daemon kept about 15 MiB
/// more than with this. The heap keeps twice the threshold at its top when
/// it shrinks, so that a dump's chunks and their messages, allocated and
/// freed one after the other, do not fault their pages in again each time.
/// Measured: a dump of 100K 320-byte entries, 3,500 page faults without
/// any of this and 250 with a threshold of 128 KiB; a dump of 1M 40-byte
/// entries with `max_queued_bytes` 192 MiB (chunks of 384 KiB), 8,000
/// faults with 128 KiB and 40-150 with 864 KiB, and with the default limits
/// (216 KiB) 22-76 instead of 122-930. What calls leave free is handed back
/// when the daemon is idle ([`release_free_memory`]).
pub fn return_large_buffers_to_the_system(kept: usize) {
    #[cfg(target_env = "gnu")]
    {
        let threshold = heap_threshold(kept);
        // SAFETY: mallopt takes two integers; these parameters are valid for
        // glibc and only change where later allocations come from.
        unsafe {
            libc::mallopt(libc::M_MMAP_THRESHOLD, threshold);
            libc::mallopt(libc::M_TRIM_THRESHOLD, threshold);
            libc::mallopt(libc::M_TOP_PAD, 2 * threshold);
        }
    }
    #[cfg(not(target_env = "gnu"))]
    let _ = kept;
}

/// The allocator's threshold for chunks of up to `kept` bytes: twice that
/// (the encoder's buffer) and an eighth more for each message's framing,
/// 128 KiB at least.
fn heap_threshold(kept: usize) -> libc::c_int {
    const AT_LEAST: usize = 128 << 10;
    const AT_MOST: usize = 64 << 20;
    (2 * (kept + kept / 8)).clamp(AT_LEAST, AT_MOST) as libc::c_int
}

/// Hands the C allocator's free memory back to the system, including free
/// pages inside the heap (glibc's `malloc_trim`): buffers under the mmap
/// threshold (a dump's chunks with the default limits) come from the heap,
/// where a burst of calls leaves free memory that the heap's top alone
/// cannot return.
pub fn release_free_memory() {
    #[cfg(target_env = "gnu")]
    // SAFETY: malloc_trim takes the padding to keep; it only releases free
    // memory of the allocator.
    unsafe {
        libc::malloc_trim(0);
    }
}

/// A program to load: its type, flags, instructions (8 bytes each, in the
/// kernel's encoding), license, name, and the BTF and function records a
/// program with callbacks needs.
pub(super) struct ProgLoad<'a> {
    pub(super) prog_type: u32,
    pub(super) flags: u32,
    pub(super) insns: &'a [u64],
    pub(super) license: &'a CStr,
    pub(super) name: &'a str,
    pub(super) btf: BorrowedFd<'a>,
    /// (instruction offset, BTF FUNC type id) per function: a
    /// `bpf_func_info` each.
    pub(super) funcs: &'a [[u32; 2]],
}

const _: () = assert!(mem::size_of::<bpf_func_info>() == mem::size_of::<[u32; 2]>());

/// Bytes of the verifier's log kept when it refuses a program.
const VERIFIER_LOG: usize = 256 << 10;

/// `BPF_PROG_LOAD`. When the verifier refuses the program, the load is
/// made again with its log, returned with the error.
pub(super) fn prog_load(p: &ProgLoad<'_>) -> Result<OwnedFd, (SyscallError, String)> {
    let load = |log: Option<&mut Vec<u8>>| {
        let mut attr = zeroed_attr();
        attr.__bindgen_anon_3.prog_type = p.prog_type;
        attr.__bindgen_anon_3.prog_flags = p.flags;
        attr.__bindgen_anon_3.insn_cnt = p.insns.len() as u32;
        attr.__bindgen_anon_3.insns = ptr(p.insns.as_ptr());
        attr.__bindgen_anon_3.license = ptr(p.license.as_ptr());
        attr.__bindgen_anon_3.prog_btf_fd = p.btf.as_raw_fd() as u32;
        attr.__bindgen_anon_3.func_info_rec_size = mem::size_of::<bpf_func_info>() as u32;
        attr.__bindgen_anon_3.func_info = ptr(p.funcs.as_ptr());
        attr.__bindgen_anon_3.func_info_cnt = p.funcs.len() as u32;
        let mut name = [0 as libc::c_char; 16];
        for (dst, src) in name.iter_mut().zip(p.name.bytes().take(15)) {
            *dst = src as libc::c_char;
        }
        attr.__bindgen_anon_3.prog_name = name;
        if let Some(log) = log {
            attr.__bindgen_anon_3.log_level = 1;
            attr.__bindgen_anon_3.log_size = log.len() as u32;
            attr.__bindgen_anon_3.log_buf = ptr(log.as_mut_ptr());
        }
        // SAFETY: the instructions, license, function records and log are
        // live buffers of the sizes given; the kernel only reads the first
        // three and writes at most log_size bytes of the log.
        unsafe { bpf("BPF_PROG_LOAD", bpf_cmd::BPF_PROG_LOAD, &mut attr) }
    };
    match load(None) {
        // SAFETY: BPF_PROG_LOAD returns a new descriptor.
        Ok(ret) => Ok(unsafe { owned_fd(ret) }),
        Err(e) => {
            let mut log = vec![0u8; VERIFIER_LOG];
            // The log's own errors (ENOSPC for a long log) do not matter:
            // what it holds is kept.
            let _ = load(Some(&mut log));
            let end = log.iter().position(|&b| b == 0).unwrap_or(log.len());
            Err((e, String::from_utf8_lossy(&log[..end]).into_owned()))
        }
    }
}

/// `BPF_PROG_TEST_RUN` of a program that takes no context and no data
/// (a syscall program): its return value.
pub(super) fn prog_test_run(fd: BorrowedFd<'_>) -> SysResult<u32> {
    let mut attr = zeroed_attr();
    attr.test.prog_fd = fd.as_raw_fd() as u32;
    // SAFETY: no pointers in the attribute (no context, no data).
    unsafe { bpf("BPF_PROG_TEST_RUN", bpf_cmd::BPF_PROG_TEST_RUN, &mut attr) }?;
    // SAFETY: the kernel wrote the return value into the same union member.
    Ok(unsafe { attr.test.retval })
}

#[cfg(test)]
mod heap_tests {
    use super::heap_threshold;

    #[test]
    fn the_heap_keeps_a_dumps_largest_chunk_and_its_framing() {
        // The default limits' chunks (96 KiB).
        assert_eq!(heap_threshold(96 << 10), 216 << 10);
        // max_queued_bytes 192 MiB: chunks of 384 KiB.
        assert_eq!(heap_threshold(384 << 10), 864 << 10);
        // Never under glibc's own 128 KiB, nor past 64 MiB.
        assert_eq!(heap_threshold(16 << 10), 128 << 10);
        assert_eq!(heap_threshold(usize::MAX / 16), 64 << 20);
    }
}
