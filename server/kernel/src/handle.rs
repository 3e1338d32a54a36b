//! [`MapHandle`]: an open map (read-only unless opened writable, for
//! drains), whose every buffer is checked against the map's sizes before it
//! reaches the kernel.
#![allow(
    unsafe_code,
    reason = "calls the syscall wrappers after checking their buffers"
)]

use std::{
    os::fd::{AsFd, OwnedFd},
    path::Path,
};

use super::{
    BtfInfo, LookupError, MapMeta, MapOps, OpenError, SysResult, SyscallError,
    drain::DrainOps,
    elem_unsupported,
    sys::{self, BatchBuffers},
};

/// Reads a BTF object by kernel id ([`MapMeta::btf_id`]): its raw data (at
/// most [`MAX_BTF_SIZE`](super::MAX_BTF_SIZE) bytes), name and kind. Needs
/// CAP_SYS_ADMIN (EPERM otherwise).
pub fn read_btf(btf_id: u32) -> SysResult<BtfInfo> {
    let fd = sys::btf_get_fd_by_id(btf_id)?;
    // SAFETY: BPF_BTF_GET_FD_BY_ID only returns descriptors of BTF objects.
    unsafe { sys::btf_info(fd.as_fd()) }
}

/// An open map. Every buffer handed to the kernel through it is checked
/// against the map's key and value sizes first.
///
/// [`open_pinned`](Self::open_pinned) and [`open_id`](Self::open_id) open
/// it read-only, so that the kernel itself refuses any change made through
/// it; that is what the read path uses. Only a drain
/// ([`Drainer`](super::drain::Drainer)) needs a map opened with
/// [`open_pinned_writable`](Self::open_pinned_writable) or
/// [`open_id_writable`](Self::open_id_writable).
#[derive(Debug)]
pub struct MapHandle {
    fd: OwnedFd,
    meta: MapMeta,
}

/// Refuses any call on a map whose element sizes the daemon cannot know.
fn sized(call: &'static str, meta: &MapMeta) -> SysResult<()> {
    match meta.unsized_reason() {
        None => Ok(()),
        Some(reason) => Err(SyscallError::invalid_input(call, reason)),
    }
}

fn check_len(call: &'static str, what: &str, got: usize, expected: usize) -> SysResult<()> {
    if got == expected {
        Ok(())
    } else {
        Err(SyscallError::invalid_input(
            call,
            format!("{what} buffer is {got} bytes; the map needs {expected}"),
        ))
    }
}

fn check_at_least(call: &'static str, what: &str, got: usize, needed: usize) -> SysResult<()> {
    if got >= needed {
        Ok(())
    } else {
        Err(SyscallError::invalid_input(
            call,
            format!("{what} buffer is {got} bytes; the map needs at least {needed}"),
        ))
    }
}

/// Checks the buffers of a batch call (`BPF_MAP_LOOKUP_BATCH`,
/// `BPF_MAP_LOOKUP_AND_DELETE_BATCH`) against the map's sizes.
pub(super) fn check_batch(call: &'static str, m: &MapMeta, b: &BatchBuffers<'_>) -> SysResult<()> {
    sized(call, m)?;
    let token = m.token_size().max(4);
    if let Some(t) = b.in_batch {
        check_at_least(call, "in_batch", t.len(), token)?;
    }
    check_at_least(call, "out_batch", b.out_batch.len(), token)?;
    let n = *b.count as usize;
    check_at_least(call, "keys", b.keys.len(), n * m.key_size as usize)?;
    check_at_least(call, "values", b.values.len(), n * m.kernel_value_size())
}

impl MapHandle {
    /// Opens the map pinned at `path`, read-only.
    pub fn open_pinned(path: &Path) -> Result<Self, OpenError> {
        let fd = sys::obj_get_rdonly(path).map_err(OpenError::from_sys)?;
        Self::from_fd(fd)
    }

    /// Opens a map by kernel id, read-only (needs CAP_SYS_ADMIN).
    pub fn open_id(id: u32) -> Result<Self, OpenError> {
        let fd = sys::map_get_fd_by_id_rdonly(id).map_err(OpenError::from_sys)?;
        Self::from_fd(fd)
    }

    /// Opens the map pinned at `path` for reading and writing (the pin must
    /// be readable and writable by this process: EACCES otherwise). Only
    /// drains need this; everything else opens read-only.
    pub fn open_pinned_writable(path: &Path) -> Result<Self, OpenError> {
        let fd = sys::obj_get_writable(path).map_err(OpenError::from_sys)?;
        Self::from_fd(fd)
    }

    /// Opens a map by kernel id for reading and writing (needs
    /// CAP_SYS_ADMIN). Only drains need this; everything else opens
    /// read-only.
    pub fn open_id_writable(id: u32) -> Result<Self, OpenError> {
        let fd = sys::map_get_fd_by_id_writable(id).map_err(OpenError::from_sys)?;
        Self::from_fd(fd)
    }

    /// A handle on a map this process created (a copy of its descriptor,
    /// with the same access): no capability beyond creating it.
    pub(crate) fn of_owned(fd: std::os::fd::BorrowedFd<'_>) -> Result<Self, OpenError> {
        let fd = fd.try_clone_to_owned().map_err(|e| {
            OpenError::from_sys(SyscallError {
                call: "fcntl(F_DUPFD_CLOEXEC)",
                io_error: e,
            })
        })?;
        Self::from_fd(fd)
    }

    /// Whether the descriptor was opened for writing, as the kernel records
    /// it (`fcntl(F_GETFL)`): false for [`open_pinned`](Self::open_pinned)
    /// and [`open_id`](Self::open_id), true for their `_writable` forms.
    pub fn is_writable(&self) -> bool {
        match sys::access_mode(self.fd.as_fd()) {
            Ok(mode) => mode == libc::O_RDWR || mode == libc::O_WRONLY,
            Err(e) => {
                tracing::warn!(error = %e, map_id = self.meta.id, "cannot read the descriptor's access mode");
                false
            }
        }
    }

    fn from_fd(fd: OwnedFd) -> Result<Self, OpenError> {
        if !sys::is_map_fd(fd.as_fd()) {
            return Err(OpenError::NotAMap);
        }
        let info = sys::map_info(fd.as_fd())?;
        Ok(Self {
            fd,
            meta: MapMeta::from_info(&info),
        })
    }

    /// The kernel's memory charge for the map (`memlock` in its fdinfo),
    /// in bytes; `None` when it cannot be read.
    pub fn memlock(&self) -> Option<u64> {
        crate::holders::memlock(self.fd.as_fd())
    }

    /// Its descriptor, for the kernel calls that name the map by it.
    pub(crate) fn fd(&self) -> std::os::fd::BorrowedFd<'_> {
        self.fd.as_fd()
    }

    /// Its descriptor's number, for programs that reference the map.
    pub(crate) fn raw_fd(&self) -> std::os::fd::RawFd {
        use std::os::fd::AsRawFd as _;
        self.fd.as_raw_fd()
    }

    /// What the kernel said about the map when it was opened.
    pub fn meta(&self) -> &MapMeta {
        &self.meta
    }

    /// Looks one key up. `Ok(None)` when the key is absent; the value comes
    /// in the wire layout (per-CPU values back to back, padding removed).
    pub fn lookup_value(&self, key: &[u8]) -> Result<Option<Vec<u8>>, LookupError> {
        let m = &self.meta;
        if let Some(reason) = m.unsized_reason() {
            return Err(LookupError::Unsized(reason));
        }
        if m.key_size == 0 {
            return Err(LookupError::Unsupported(m.map_type));
        }
        if key.len() != m.key_size as usize {
            return Err(LookupError::KeySize {
                expected: m.key_size as usize,
                got: key.len(),
            });
        }
        let mut value = vec![0u8; m.kernel_value_size()];
        match self.lookup(key, &mut value) {
            Ok(()) => {
                if m.per_cpu() {
                    let mut wire = Vec::with_capacity(m.wire_value_size());
                    m.append_wire_values(&value, &mut wire);
                    Ok(Some(wire))
                } else {
                    Ok(Some(value))
                }
            }
            Err(e) if e.errno() == Some(libc::ENOENT) => Ok(None),
            Err(e) if elem_unsupported(e.errno()) => Err(LookupError::Unsupported(m.map_type)),
            Err(e) => Err(e.into()),
        }
    }
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
        let b = BatchBuffers {
            in_batch,
            out_batch,
            keys,
            values,
            count,
        };
        check_batch("BPF_MAP_LOOKUP_BATCH", &self.meta, &b)?;
        // SAFETY: the buffers were just checked against this map's sizes.
        unsafe { sys::lookup_batch(self.fd.as_fd(), b) }
    }

    fn get_next_key(&self, key: Option<&[u8]>, next: &mut [u8]) -> SysResult<()> {
        const CALL: &str = "BPF_MAP_GET_NEXT_KEY";
        sized(CALL, &self.meta)?;
        let ks = self.meta.key_size as usize;
        if let Some(k) = key {
            check_len(CALL, "key", k.len(), ks)?;
        }
        check_len(CALL, "next key", next.len(), ks)?;
        // SAFETY: both buffers are exactly one key of this map.
        unsafe { sys::get_next_key(self.fd.as_fd(), key, next) }
    }

    fn lookup(&self, key: &[u8], value: &mut [u8]) -> SysResult<()> {
        const CALL: &str = "BPF_MAP_LOOKUP_ELEM";
        sized(CALL, &self.meta)?;
        check_len(CALL, "key", key.len(), self.meta.key_size as usize)?;
        check_len(CALL, "value", value.len(), self.meta.kernel_value_size())?;
        // SAFETY: the buffers are exactly one key and one element of this map.
        unsafe { sys::lookup_elem(self.fd.as_fd(), key, value) }
    }
}

impl DrainOps for MapHandle {
    fn is_writable(&self) -> bool {
        MapHandle::is_writable(self)
    }

    fn lookup_and_delete_batch(
        &self,
        in_batch: Option<&[u8]>,
        out_batch: &mut [u8],
        keys: &mut [u8],
        values: &mut [u8],
        count: &mut u32,
    ) -> SysResult<()> {
        let b = BatchBuffers {
            in_batch,
            out_batch,
            keys,
            values,
            count,
        };
        check_batch("BPF_MAP_LOOKUP_AND_DELETE_BATCH", &self.meta, &b)?;
        // SAFETY: the buffers were just checked against this map's sizes.
        unsafe { sys::lookup_and_delete_batch(self.fd.as_fd(), b) }
    }
}

#[cfg(test)]
mod tests {
    //! Opening real maps. These need root and a kernel with BPF; without
    //! them they fail saying so.
    use std::{
        path::PathBuf,
        sync::atomic::{AtomicU32, Ordering},
    };

    use super::*;
    use crate::{MapType, OwnedMap, mount_bpffs, umount};

    /// A bpffs mounted on a fresh directory of its own; unmounted and
    /// removed on drop.
    struct PrivateBpffs(PathBuf);

    impl PrivateBpffs {
        fn new() -> Self {
            static SEQ: AtomicU32 = AtomicU32::new(0);
            let dir = std::env::temp_dir().join(format!(
                "bpfmap-kernel-test-{}-{}",
                std::process::id(),
                SEQ.fetch_add(1, Ordering::Relaxed)
            ));
            std::fs::create_dir(&dir)
                .unwrap_or_else(|e| panic!("cannot create {} ({e})", dir.display()));
            if let Err(e) = mount_bpffs(&dir) {
                let _ = std::fs::remove_dir(&dir);
                panic!(
                    "these tests need root and BPF: cannot mount a private bpffs on {} ({e})",
                    dir.display()
                );
            }
            Self(dir)
        }
    }

    impl Drop for PrivateBpffs {
        fn drop(&mut self) {
            let _ = umount(&self.0);
            let _ = std::fs::remove_dir(&self.0);
        }
    }

    #[test]
    fn is_writable_tells_how_the_map_was_opened() {
        let fs = PrivateBpffs::new();
        let map = OwnedMap::new(MapType::HASH, 4, 4, 8, "open_modes").unwrap_or_else(|e| {
            panic!("cannot create a hash map ({e}); these tests need root and a kernel with BPF")
        });
        let pin = fs.0.join("m");
        map.pin(&pin).expect("pin");
        let opened = [
            ("open_pinned", MapHandle::open_pinned(&pin), false),
            (
                "open_pinned_writable",
                MapHandle::open_pinned_writable(&pin),
                true,
            ),
            ("open_id", MapHandle::open_id(map.id()), false),
            (
                "open_id_writable",
                MapHandle::open_id_writable(map.id()),
                true,
            ),
        ];
        for (how, handle, writable) in opened {
            let handle = handle.unwrap_or_else(|e| panic!("{how}: {e}"));
            assert_eq!(handle.meta().id, map.id(), "{how}: the same map");
            assert_eq!(handle.is_writable(), writable, "{how}");
        }
        assert!(
            MapHandle::open_pinned_writable(&fs.0.join("missing"))
                .is_err_and(|e| matches!(e, OpenError::NotFound))
        );
    }
}
