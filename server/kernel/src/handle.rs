//! [`MapHandle`]: a map opened read-only, whose every buffer is checked
//! against the map's sizes before it reaches the kernel.
#![allow(
    unsafe_code,
    reason = "calls the syscall wrappers after checking their buffers"
)]

use std::{
    os::fd::{AsFd, OwnedFd},
    path::Path,
};

use super::{
    BtfInfo, LookupError, MapMeta, MapOps, OpenError, SysResult, SyscallError, elem_unsupported,
    sys,
};

/// Reads a BTF object by kernel id ([`MapMeta::btf_id`]): its raw data (at
/// most [`MAX_BTF_SIZE`](super::MAX_BTF_SIZE) bytes), name and kind. Needs
/// CAP_SYS_ADMIN (EPERM otherwise).
pub fn read_btf(btf_id: u32) -> SysResult<BtfInfo> {
    let fd = sys::btf_get_fd_by_id(btf_id)?;
    // SAFETY: BPF_BTF_GET_FD_BY_ID only returns descriptors of BTF objects.
    unsafe { sys::btf_info(fd.as_fd()) }
}

/// An open, read-only map. Every buffer handed to the kernel through it is
/// checked against the map's key and value sizes first.
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
        const CALL: &str = "BPF_MAP_LOOKUP_BATCH";
        let m = &self.meta;
        sized(CALL, m)?;
        let token = m.token_size().max(4);
        if let Some(b) = in_batch {
            check_at_least(CALL, "in_batch", b.len(), token)?;
        }
        check_at_least(CALL, "out_batch", out_batch.len(), token)?;
        let n = *count as usize;
        check_at_least(CALL, "keys", keys.len(), n * m.key_size as usize)?;
        check_at_least(CALL, "values", values.len(), n * m.kernel_value_size())?;
        // SAFETY: the buffers were just checked against this map's sizes.
        unsafe { sys::lookup_batch(self.fd.as_fd(), in_batch, out_batch, keys, values, count) }
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
