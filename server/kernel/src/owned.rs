//! Maps this process creates and writes: the demo maps, and the maps the
//! tests build, with the BTF objects that type them. The daemon's read path
//! never holds one of these: it only ever opens maps read-only through
//! [`MapHandle`](super::MapHandle).
#![allow(
    unsafe_code,
    reason = "calls the syscall wrappers after checking their buffers"
)]

use std::{
    os::fd::{AsFd, BorrowedFd, OwnedFd},
    path::Path,
};

use super::{
    BtfInfo, MapBtf, MapMeta, MapType, SysResult, SyscallError,
    drain::DrainOps,
    handle::check_batch,
    sys::{self, BatchBuffers},
};

/// A map created by this process, writable, with its sizes checked on every
/// write.
#[derive(Debug)]
pub struct OwnedMap {
    fd: OwnedFd,
    meta: MapMeta,
}

impl OwnedMap {
    /// `BPF_MAP_CREATE`.
    pub fn create(params: &sys::CreateMap<'_>) -> SysResult<Self> {
        let fd = sys::create_map(params)?;
        let info = sys::map_info(fd.as_fd())?;
        Ok(Self {
            fd,
            meta: MapMeta::from_info(&info),
        })
    }

    /// A map of `map_type` with no flags and no inner map.
    pub fn new(
        map_type: MapType,
        key_size: u32,
        value_size: u32,
        max_entries: u32,
        name: &str,
    ) -> SysResult<Self> {
        Self::create(&sys::CreateMap {
            map_type: map_type.0,
            key_size,
            value_size,
            max_entries,
            name,
            ..Default::default()
        })
    }

    /// What the kernel says about the map.
    pub fn meta(&self) -> &MapMeta {
        &self.meta
    }

    /// Kernel map id.
    pub fn id(&self) -> u32 {
        self.meta.id
    }

    fn check(&self, call: &'static str, keys: &[u8], values: &[u8], count: usize) -> SysResult<()> {
        if let Some(reason) = self.meta.unsized_reason() {
            return Err(SyscallError::invalid_input(call, reason));
        }
        let (ks, vs) = (self.meta.key_size as usize, self.meta.kernel_value_size());
        if keys.len() != ks * count || values.len() != vs * count {
            return Err(SyscallError::invalid_input(
                call,
                format!(
                    "{count} elements need {} key and {} value bytes (kernel layout); got {} and {}",
                    ks * count,
                    vs * count,
                    keys.len(),
                    values.len()
                ),
            ));
        }
        Ok(())
    }

    /// Inserts or replaces one element (`value` in the kernel's layout: for
    /// per-CPU maps, one 8-byte-aligned value per possible CPU).
    pub fn update(&self, key: &[u8], value: &[u8]) -> SysResult<()> {
        self.check("BPF_MAP_UPDATE_ELEM", key, value, 1)?;
        // SAFETY: the buffers are exactly one key and one element of this map.
        unsafe { sys::update_elem(self.fd.as_fd(), key, value) }
    }

    /// One element (in the kernel's layout), or `None` when there is none.
    pub fn lookup(&self, key: &[u8]) -> SysResult<Option<Vec<u8>>> {
        let mut value = vec![0u8; self.meta.kernel_value_size()];
        self.check("BPF_MAP_LOOKUP_ELEM", key, &value, 1)?;
        // SAFETY: the buffers are exactly one key and one element of this map.
        match unsafe { sys::lookup_elem(self.fd.as_fd(), key, &mut value) } {
            Ok(()) => Ok(Some(value)),
            Err(e) if e.errno() == Some(libc::ENOENT) => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// Inserts or replaces `keys.len() / key_size` packed elements.
    pub fn update_batch(&self, keys: &[u8], values: &[u8]) -> SysResult<()> {
        let count = keys.len() / (self.meta.key_size as usize).max(1);
        self.check("BPF_MAP_UPDATE_BATCH", keys, values, count)?;
        let n = u32::try_from(count).map_err(|_| {
            SyscallError::invalid_input("BPF_MAP_UPDATE_BATCH", "too many elements".into())
        })?;
        // SAFETY: the buffers hold exactly `count` keys and elements of this map.
        unsafe { sys::update_batch(self.fd.as_fd(), keys, values, n) }
    }

    /// Deletes one key.
    pub fn delete(&self, key: &[u8]) -> SysResult<()> {
        if let Some(reason) = self.meta.unsized_reason() {
            return Err(SyscallError::invalid_input("BPF_MAP_DELETE_ELEM", reason));
        }
        if key.len() != self.meta.key_size as usize {
            return Err(SyscallError::invalid_input(
                "BPF_MAP_DELETE_ELEM",
                format!(
                    "key is {} bytes; the map has {}-byte keys",
                    key.len(),
                    self.meta.key_size
                ),
            ));
        }
        // SAFETY: the key is exactly one key of this map.
        unsafe { sys::delete_elem(self.fd.as_fd(), key) }
    }

    /// A handle that reads (and drains) this map through a copy of its
    /// descriptor.
    pub fn handle(&self) -> Result<crate::MapHandle, crate::OpenError> {
        crate::MapHandle::of_owned(self.fd.as_fd())
    }

    /// Pins the map at `path` (inside a bpffs).
    pub fn pin(&self, path: &Path) -> SysResult<()> {
        sys::obj_pin(self.fd.as_fd(), path)
    }
}

impl AsFd for OwnedMap {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }
}

/// A map this process created is drained through its own descriptor,
/// which is writable.
impl DrainOps for OwnedMap {
    fn is_writable(&self) -> bool {
        true
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

/// A BTF object loaded by this process (`BPF_BTF_LOAD`), to type the maps it
/// creates. Maps keep their BTF alive: this can be dropped once they exist.
#[derive(Debug)]
pub struct OwnedBtf {
    fd: OwnedFd,
}

impl OwnedBtf {
    /// Loads raw BTF (e.g. from [`BtfBuilder::to_bytes`](super::BtfBuilder::to_bytes)).
    /// When the kernel refuses it, the error carries the end of its log.
    pub fn load(data: &[u8]) -> SysResult<Self> {
        Ok(Self {
            fd: sys::btf_load(data)?,
        })
    }

    /// The key and value types of a map to create with this BTF.
    pub fn for_map(&self, key_type_id: u32, value_type_id: u32) -> MapBtf<'_> {
        MapBtf {
            fd: self.fd.as_fd(),
            key_type_id,
            value_type_id,
        }
    }

    /// The object as the kernel holds it (id, data).
    pub fn info(&self) -> SysResult<BtfInfo> {
        // SAFETY: the descriptor came from BPF_BTF_LOAD: it is a BTF object.
        unsafe { sys::btf_info(self.fd.as_fd()) }
    }
}

impl AsFd for OwnedBtf {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }
}
