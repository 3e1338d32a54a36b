//! The only place that talks to `bpf(2)` and `mount(2)`. Every unsafe block of
//! the daemon lives here, each with its SAFETY note. Everything above this
//! module speaks in slices, file descriptors and [`SyscallError`]s.

use std::{
    ffi::{CStr, CString},
    io,
    mem::{self, MaybeUninit},
    os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd},
    path::Path,
};

use aya_obj::generated::{BPF_F_RDONLY, bpf_attr, bpf_cmd, bpf_map_info};

/// A failed syscall: which command, and the errno it returned.
#[derive(Debug, thiserror::Error)]
#[error("{call} failed: {io_error}")]
pub struct SyscallError {
    pub call: &'static str,
    pub io_error: io::Error,
}

impl SyscallError {
    pub fn errno(&self) -> Option<i32> {
        self.io_error.raw_os_error()
    }
}

pub type SysResult<T> = Result<T, SyscallError>;

/// `ENOTSUPP` (524): the kernel-internal "operation not supported" that the
/// BPF syscall leaks to user space.
pub const ENOTSUPP: i32 = 524;

const BPF_FS_MAGIC: i64 = 0xcafe_4a11;

fn zeroed_attr() -> bpf_attr {
    // SAFETY: bpf_attr is a plain C union of integers and arrays; all-zero is
    // a valid value and what the kernel expects for unused fields.
    unsafe { mem::zeroed() }
}

fn bpf(call: &'static str, cmd: bpf_cmd, attr: &mut bpf_attr) -> SysResult<i64> {
    // SAFETY: `attr` is a valid, fully initialised bpf_attr that outlives the
    // call; every pointer stored in it by our callers refers to a live buffer
    // of the size the kernel will write for this command.
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

fn owned_fd(ret: i64) -> OwnedFd {
    // SAFETY: the bpf commands that create an fd return a new descriptor that
    // nothing else owns.
    unsafe { OwnedFd::from_raw_fd(ret as RawFd) }
}

fn cstring(path: &Path, call: &'static str) -> SysResult<CString> {
    use std::os::unix::ffi::OsStrExt as _;
    CString::new(path.as_os_str().as_bytes()).map_err(|_| SyscallError {
        call,
        io_error: io::Error::new(io::ErrorKind::InvalidInput, "path contains a NUL byte"),
    })
}

fn ptr<T>(p: *const T) -> u64 {
    p as usize as u64
}

/// Opens a pinned object read-only (`BPF_OBJ_GET` with `BPF_F_RDONLY`).
pub fn obj_get_rdonly(path: &Path) -> SysResult<OwnedFd> {
    let c = cstring(path, "BPF_OBJ_GET")?;
    let mut attr = zeroed_attr();
    attr.__bindgen_anon_4.pathname = ptr(c.as_ptr());
    attr.__bindgen_anon_4.file_flags = BPF_F_RDONLY;
    bpf("BPF_OBJ_GET", bpf_cmd::BPF_OBJ_GET, &mut attr).map(owned_fd)
}

/// Opens a map by kernel id, read-only. Needs CAP_SYS_ADMIN.
pub fn map_get_fd_by_id_rdonly(id: u32) -> SysResult<OwnedFd> {
    let mut attr = zeroed_attr();
    attr.__bindgen_anon_6.__bindgen_anon_1.map_id = id;
    attr.__bindgen_anon_6.open_flags = BPF_F_RDONLY;
    bpf(
        "BPF_MAP_GET_FD_BY_ID",
        bpf_cmd::BPF_MAP_GET_FD_BY_ID,
        &mut attr,
    )
    .map(owned_fd)
}

/// The next map id after `start` (`BPF_MAP_GET_NEXT_ID`); `None` at the end.
pub fn map_get_next_id(start: u32) -> SysResult<Option<u32>> {
    let mut attr = zeroed_attr();
    attr.__bindgen_anon_6.__bindgen_anon_1.start_id = start;
    match bpf(
        "BPF_MAP_GET_NEXT_ID",
        bpf_cmd::BPF_MAP_GET_NEXT_ID,
        &mut attr,
    ) {
        // SAFETY: reading a u32 field of the union the kernel just wrote.
        Ok(_) => Ok(Some(unsafe { attr.__bindgen_anon_6.next_id })),
        Err(e) if e.errno() == Some(libc::ENOENT) => Ok(None),
        Err(e) => Err(e),
    }
}

/// Whether `fd` refers to a BPF map (and not a program, link or BTF object).
pub fn is_map_fd(fd: BorrowedFd<'_>) -> bool {
    std::fs::read_link(format!("/proc/self/fd/{}", fd.as_raw_fd()))
        .map(|target| target.as_os_str() == "anon_inode:bpf-map")
        .unwrap_or(false)
}

/// `BPF_OBJ_GET_INFO_BY_FD` for a map.
pub fn map_info(fd: BorrowedFd<'_>) -> SysResult<bpf_map_info> {
    let mut info = MaybeUninit::<bpf_map_info>::zeroed();
    let mut attr = zeroed_attr();
    attr.info.bpf_fd = fd.as_raw_fd() as u32;
    attr.info.info_len = mem::size_of::<bpf_map_info>() as u32;
    attr.info.info = ptr(info.as_mut_ptr());
    bpf(
        "BPF_OBJ_GET_INFO_BY_FD",
        bpf_cmd::BPF_OBJ_GET_INFO_BY_FD,
        &mut attr,
    )?;
    // SAFETY: the buffer was zero-initialised (a valid bpf_map_info) and the
    // kernel wrote at most info_len bytes of it.
    Ok(unsafe { info.assume_init() })
}

/// `BPF_MAP_LOOKUP_BATCH`. `count` holds the capacity on entry and the number
/// of entries copied on return, also when the call fails with ENOENT (the end
/// of the map).
pub fn lookup_batch(
    fd: BorrowedFd<'_>,
    in_batch: Option<&[u8]>,
    out_batch: &mut [u8],
    keys: &mut [u8],
    values: &mut [u8],
    count: &mut u32,
) -> SysResult<()> {
    let mut attr = zeroed_attr();
    attr.batch.map_fd = fd.as_raw_fd() as u32;
    attr.batch.in_batch = in_batch.map_or(0, |b| ptr(b.as_ptr()));
    attr.batch.out_batch = ptr(out_batch.as_mut_ptr());
    attr.batch.keys = ptr(keys.as_mut_ptr());
    attr.batch.values = ptr(values.as_mut_ptr());
    attr.batch.count = *count;
    let ret = bpf(
        "BPF_MAP_LOOKUP_BATCH",
        bpf_cmd::BPF_MAP_LOOKUP_BATCH,
        &mut attr,
    );
    // SAFETY: the kernel writes `count` back in both success and failure.
    *count = unsafe { attr.batch.count };
    ret.map(drop)
}

/// `BPF_MAP_GET_NEXT_KEY`: `key = None` asks for the first key.
pub fn get_next_key(fd: BorrowedFd<'_>, key: Option<&[u8]>, next: &mut [u8]) -> SysResult<()> {
    let mut attr = zeroed_attr();
    attr.__bindgen_anon_2.map_fd = fd.as_raw_fd() as u32;
    attr.__bindgen_anon_2.key = key.map_or(0, |k| ptr(k.as_ptr()));
    attr.__bindgen_anon_2.__bindgen_anon_1.next_key = ptr(next.as_mut_ptr());
    bpf(
        "BPF_MAP_GET_NEXT_KEY",
        bpf_cmd::BPF_MAP_GET_NEXT_KEY,
        &mut attr,
    )
    .map(drop)
}

/// `BPF_MAP_LOOKUP_ELEM`. `value` must hold the kernel's element size (for
/// per-CPU maps: round_up(value_size, 8) * possible CPUs).
pub fn lookup_elem(fd: BorrowedFd<'_>, key: &[u8], value: &mut [u8]) -> SysResult<()> {
    let mut attr = zeroed_attr();
    attr.__bindgen_anon_2.map_fd = fd.as_raw_fd() as u32;
    attr.__bindgen_anon_2.key = ptr(key.as_ptr());
    attr.__bindgen_anon_2.__bindgen_anon_1.value = ptr(value.as_mut_ptr());
    bpf(
        "BPF_MAP_LOOKUP_ELEM",
        bpf_cmd::BPF_MAP_LOOKUP_ELEM,
        &mut attr,
    )
    .map(drop)
}

/// `BPF_MAP_UPDATE_ELEM` with `BPF_ANY`. Used by the demo and by tests; the
/// read path never writes (its fds are read-only).
pub fn update_elem(fd: BorrowedFd<'_>, key: &[u8], value: &[u8]) -> SysResult<()> {
    let mut attr = zeroed_attr();
    attr.__bindgen_anon_2.map_fd = fd.as_raw_fd() as u32;
    attr.__bindgen_anon_2.key = ptr(key.as_ptr());
    attr.__bindgen_anon_2.__bindgen_anon_1.value = ptr(value.as_ptr());
    bpf(
        "BPF_MAP_UPDATE_ELEM",
        bpf_cmd::BPF_MAP_UPDATE_ELEM,
        &mut attr,
    )
    .map(drop)
}

/// `BPF_MAP_UPDATE_BATCH`: `keys` and `values` hold `count` packed elements.
pub fn update_batch(fd: BorrowedFd<'_>, keys: &[u8], values: &[u8], count: u32) -> SysResult<()> {
    let mut attr = zeroed_attr();
    attr.batch.map_fd = fd.as_raw_fd() as u32;
    attr.batch.keys = ptr(keys.as_ptr());
    attr.batch.values = ptr(values.as_ptr());
    attr.batch.count = count;
    bpf(
        "BPF_MAP_UPDATE_BATCH",
        bpf_cmd::BPF_MAP_UPDATE_BATCH,
        &mut attr,
    )
    .map(drop)
}

/// `BPF_MAP_DELETE_ELEM`. Used by tests and the demo.
pub fn delete_elem(fd: BorrowedFd<'_>, key: &[u8]) -> SysResult<()> {
    let mut attr = zeroed_attr();
    attr.__bindgen_anon_2.map_fd = fd.as_raw_fd() as u32;
    attr.__bindgen_anon_2.key = ptr(key.as_ptr());
    bpf(
        "BPF_MAP_DELETE_ELEM",
        bpf_cmd::BPF_MAP_DELETE_ELEM,
        &mut attr,
    )
    .map(drop)
}

/// Parameters of `BPF_MAP_CREATE`.
#[derive(Debug, Clone, Copy, Default)]
pub struct CreateMap<'a> {
    pub map_type: u32,
    pub key_size: u32,
    pub value_size: u32,
    pub max_entries: u32,
    pub flags: u32,
    pub name: &'a str,
    /// The template inner map, for array_of_maps and hash_of_maps.
    pub inner_map: Option<BorrowedFd<'a>>,
}

/// `BPF_MAP_CREATE`. Used by the demo and by tests.
pub fn create_map(params: &CreateMap<'_>) -> SysResult<OwnedFd> {
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
        btf_fd: 0,
        btf_key_type_id: 0,
        btf_value_type_id: 0,
        btf_vmlinux_value_type_id: 0,
        map_extra: 0,
        value_type_btf_obj_fd: 0,
        map_token_fd: 0,
    };
    for (dst, src) in create.map_name.iter_mut().zip(params.name.bytes().take(15)) {
        *dst = src as libc::c_char;
    }
    attr.__bindgen_anon_1 = create;
    bpf("BPF_MAP_CREATE", bpf_cmd::BPF_MAP_CREATE, &mut attr).map(owned_fd)
}

/// `BPF_OBJ_PIN`: pins `fd` at `path` (inside a bpffs).
pub fn obj_pin(fd: BorrowedFd<'_>, path: &Path) -> SysResult<()> {
    let c = cstring(path, "BPF_OBJ_PIN")?;
    let mut attr = zeroed_attr();
    attr.__bindgen_anon_4.pathname = ptr(c.as_ptr());
    attr.__bindgen_anon_4.bpf_fd = fd.as_fd().as_raw_fd() as u32;
    bpf("BPF_OBJ_PIN", bpf_cmd::BPF_OBJ_PIN, &mut attr).map(drop)
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
        reason = "f_type is i64 on x86_64 but u32 or i32 elsewhere"
    )]
    let f_type = st.f_type as i64;
    Ok(f_type == BPF_FS_MAGIC)
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
