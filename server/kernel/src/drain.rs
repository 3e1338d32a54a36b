//! Drains a map: reads its entries and deletes them, chunk by chunk, with
//! `BPF_MAP_LOOKUP_AND_DELETE_BATCH`.
//!
//! Only the hash family has the command ([`drainable`]), and it needs a
//! descriptor opened for writing
//! ([`MapHandle::open_id_writable`](super::MapHandle::open_id_writable),
//! [`MapHandle::open_pinned_writable`](super::MapHandle::open_pinned_writable)).
//! What the kernel does (`__htab_map_lookup_and_delete_batch` in
//! kernel/bpf/hashtab.c):
//! - the position token is a u32 bucket index; buckets are copied and
//!   unlinked whole, under the bucket lock, so an entry is returned by one
//!   call only. An entry inserted into a bucket the pass has already left
//!   is returned by the next pass ([`Drainer::restart`]).
//! - ENOENT ends the pass; `count` holds the last entries.
//! - ENOSPC: the next bucket holds more entries than `count`, and nothing
//!   was deleted; the drainer doubles the batch and calls again from the
//!   same token.
//! - a bucket lock that fails ends the call with the entries copied
//!   before it, which are deleted already: the drainer hands them over and
//!   the next call starts at that bucket.
//! - the entries are deleted before they are copied to user space: if that
//!   copy faults they are gone unreturned. The drainer copies into buffers
//!   it owns and has written to.
//!
//! What a drain cannot prevent: a BPF program that looked an element up
//! before it was deleted keeps writing through its pointer, and those
//! writes are lost (in a preallocated map the element may meanwhile hold
//! another key).

use std::hint;

use super::{
    MapHandle, MapMeta, MapType, SysResult, SyscallError, elem_unsupported,
    walk::{self, Chunk, Position},
};

const CALL: &str = "BPF_MAP_LOOKUP_AND_DELETE_BATCH";

/// What a [`Drainer`] needs from a map: the kernel's
/// `BPF_MAP_LOOKUP_AND_DELETE_BATCH`, and how the map was opened. Implemented
/// by [`MapHandle`]; unit tests replace it to reach the
/// error paths the kernel will not produce on demand.
pub trait DrainOps {
    /// Whether the descriptor was opened for writing.
    fn is_writable(&self) -> bool;
    /// `BPF_MAP_LOOKUP_AND_DELETE_BATCH`, with the contract of
    /// `BPF_MAP_LOOKUP_BATCH` ([`MapOps::lookup_batch`](super::MapOps::lookup_batch)):
    /// `count` holds the capacity on entry and the entries copied (and
    /// deleted) on return, when the kernel writes it back.
    fn lookup_and_delete_batch(
        &self,
        in_batch: Option<&[u8]>,
        out_batch: &mut [u8],
        keys: &mut [u8],
        values: &mut [u8],
        count: &mut u32,
    ) -> SysResult<()>;
}

/// A map drained through a reference drains the map.
impl<T: DrainOps + ?Sized> DrainOps for &T {
    fn is_writable(&self) -> bool {
        (**self).is_writable()
    }

    fn lookup_and_delete_batch(
        &self,
        in_batch: Option<&[u8]>,
        out_batch: &mut [u8],
        keys: &mut [u8],
        values: &mut [u8],
        count: &mut u32,
    ) -> SysResult<()> {
        (**self).lookup_and_delete_batch(in_batch, out_batch, keys, values, count)
    }
}

/// Whether maps of `map_type` can be drained (read and deleted in batches):
/// `Ok` for the hash family (hash, lru_hash, percpu_hash, lru_percpu_hash,
/// hash_of_maps), else why not.
pub fn drainable(map_type: MapType) -> Result<(), &'static str> {
    Err(match map_type.name().as_ref() {
        "hash" | "lru_hash" | "percpu_hash" | "lru_percpu_hash" | "hash_of_maps" => {
            return Ok(());
        }
        "unspec" => "type 0 is not a map type",
        "array" | "percpu_array" | "array_of_maps" => "arrays cannot delete entries",
        "prog_array" | "perf_event_array" | "cgroup_array" => {
            "arrays of programs, perf events and cgroups have no lookup-and-delete batch"
        }
        "stack_trace" => "a stack_trace map has no lookup-and-delete batch",
        "lpm_trie" => "an lpm_trie has no lookup-and-delete batch",
        "devmap" | "devmap_hash" | "cpumap" | "xskmap" => {
            "device, CPU and AF_XDP socket maps have no lookup-and-delete batch"
        }
        "sockmap" | "sockhash" | "reuseport_sockarray" => {
            "socket maps have no lookup-and-delete batch"
        }
        "cgroup_storage"
        | "percpu_cgroup_storage"
        | "sk_storage"
        | "inode_storage"
        | "task_storage"
        | "cgrp_storage" => "storage attached to kernel objects has no lookup-and-delete batch",
        "queue" | "stack" => {
            "queues and stacks have no lookup-and-delete batch (they pop one element at a time)"
        }
        "struct_ops" => "struct_ops maps hold kernel callbacks, not entries",
        "ringbuf" | "user_ringbuf" => "ring buffers hold records, not entries",
        "bloom_filter" => "a bloom filter cannot delete entries",
        "arena" => "an arena is memory, not entries",
        _ => "the map type is newer than this daemon",
    })
}

/// Why maps of this type cannot be drained, for [`DrainError::NotDrainable`].
fn refusal(map_type: &MapType) -> &'static str {
    drainable(*map_type)
        .err()
        .unwrap_or("the kernel refused lookup-and-delete for it")
}

/// Why a drain cannot start or go on.
#[derive(Debug, thiserror::Error)]
pub enum DrainError {
    /// The map type has no lookup-and-delete batch (refused before any
    /// call, or by the kernel with EINVAL / ENOTSUPP).
    #[error("maps of type {0} cannot be drained: {reason}", reason = refusal(.0))]
    NotDrainable(MapType),
    /// The map was opened read-only (refused before any call, or by the
    /// kernel with EPERM).
    #[error(
        "the map was opened read-only: draining deletes entries and needs a descriptor opened for writing"
    )]
    ReadOnly,
    /// EPERM on a descriptor opened for writing: the kernel refuses changes
    /// to the map from user space (a frozen map).
    #[error(
        "the kernel refused to delete from the map although it was opened for writing (a frozen map refuses every change from user space)"
    )]
    WriteDenied,
    /// The daemon cannot size this map's values.
    #[error("{0}")]
    Unsized(String),
    /// A hash bucket larger than the map could ever hold.
    #[error("the kernel kept answering ENOSPC up to a batch of {tried} entries")]
    BucketTooLarge {
        /// The largest batch tried.
        tried: u32,
    },
    /// Any other kernel error. Entries a failed call deleted are delivered
    /// before it is reported, except after EFAULT: then the kernel deleted
    /// entries it could not copy out.
    #[error(transparent)]
    Syscall(#[from] SyscallError),
}

/// What a drain cost, for tests and benchmarks.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct DrainStats {
    /// BPF_MAP_LOOKUP_AND_DELETE_BATCH calls made.
    pub syscalls: u64,
    /// Calls that failed with ENOSPC and were retried with a larger batch.
    pub enospc: u64,
    /// Calls retried after EINTR / EAGAIN / EBUSY.
    pub retries: u64,
    /// Entries read and deleted.
    pub entries: u64,
}

/// What `out_batch` holds before a call: never a bucket token (a hash map
/// has at most 2^31 buckets), so a token still equal to it after the call
/// means the kernel wrote nothing back, neither the token nor `count`.
const UNREPORTED: [u8; 4] = [0xff; 4];

/// A drain of one hash-family map: each call of [`Drainer::next_chunk`]
/// reads and deletes the next whole buckets.
#[derive(Debug)]
pub struct Drainer<O> {
    ops: O,
    meta: MapMeta,
    pos: Position,
    /// Where the kernel copies keys and values: owned here, and written to
    /// when allocated, so that the copy after the delete does not fault.
    keys: Vec<u8>,
    values: Vec<u8>,
    stats: DrainStats,
}

impl<'a> Drainer<&'a MapHandle> {
    /// A drain of `map` (opened writable), from its first bucket. Refuses,
    /// before any call, a map type without lookup-and-delete
    /// ([`drainable`]), values the daemon cannot size, and a map opened
    /// read-only.
    pub fn new(map: &'a MapHandle) -> Result<Self, DrainError> {
        Self::with_ops(map, map.meta().clone())
    }
}

impl<O: DrainOps> Drainer<O> {
    /// A drain of `meta`'s map through `ops` (a [`MapHandle`], or a
    /// stand-in in tests), from its first bucket, refusing what
    /// [`Drainer::new`] refuses.
    pub fn with_ops(ops: O, meta: MapMeta) -> Result<Self, DrainError> {
        if drainable(meta.map_type).is_err() {
            return Err(DrainError::NotDrainable(meta.map_type));
        }
        if let Some(reason) = meta.unsized_reason() {
            return Err(DrainError::Unsized(reason));
        }
        if !ops.is_writable() {
            return Err(DrainError::ReadOnly);
        }
        Ok(Self {
            ops,
            meta,
            pos: Position::Start,
            keys: Vec::new(),
            values: Vec::new(),
            stats: DrainStats::default(),
        })
    }

    /// The map being drained.
    pub fn meta(&self) -> &MapMeta {
        &self.meta
    }

    /// What the drain cost so far.
    pub fn stats(&self) -> DrainStats {
        self.stats
    }

    /// Where the pass stands: the bucket token the next call starts from,
    /// or [`Position::End`] once the pass is over.
    pub fn position(&self) -> &Position {
        &self.pos
    }

    /// Starts a new pass from the first bucket, to collect what was
    /// inserted since the pass began (into buckets it had already left).
    pub fn restart(&mut self) {
        self.pos = Position::Start;
    }

    /// Reads and deletes about `want` entries (at least 1; no more than the
    /// map's capacity plus a margin of 1024): whole buckets, so fewer when the next bucket does
    /// not fit, and more when one bucket alone holds more. `Ok(None)` once
    /// the pass is at the end; a last chunk may come with the end, and then
    /// the next call gives `None`.
    pub fn next_chunk(&mut self, want: u32) -> Result<Option<Chunk>, DrainError> {
        let limit = self.largest_batch();
        let mut n = want.clamp(1, limit);
        let mut retries = 0;
        loop {
            let in_batch = match &self.pos {
                Position::End => return Ok(None),
                Position::Start => None,
                Position::After(token) => Some(token.clone()),
            };
            let (res, copied, out_batch) = self.call(in_batch.as_deref(), n);
            let errno = res.as_ref().err().and_then(SyscallError::errno);
            if errno == Some(libc::ENOENT) {
                self.pos = Position::End;
                return Ok((copied > 0).then(|| self.take(copied)));
            }
            if copied > 0 {
                // Deleted already: hand them over whatever the result. A
                // failed call stopped at a bucket it could not take, and
                // the next call starts there.
                self.pos = Position::After(out_batch.to_vec());
                return Ok(Some(self.take(copied)));
            }
            let Err(e) = res else {
                // Success with nothing copied (not what the kernel does):
                // go on only if the token moved.
                if in_batch.as_deref() == Some(&out_batch[..]) {
                    return Err(SyscallError::invalid_input(
                        CALL,
                        "the kernel returned no entries and did not move on".into(),
                    )
                    .into());
                }
                self.pos = Position::After(out_batch.to_vec());
                continue;
            };
            match errno {
                Some(libc::ENOSPC) => {
                    // The next bucket holds more than `n` entries; nothing
                    // was deleted.
                    if n >= limit {
                        return Err(DrainError::BucketTooLarge { tried: n });
                    }
                    n = n.saturating_mul(2).min(limit);
                    self.stats.enospc += 1;
                }
                Some(libc::EINTR | libc::EAGAIN | libc::EBUSY) if retries < walk::MAX_RETRIES => {
                    retries += 1;
                    self.stats.retries += 1;
                    walk::backoff(retries);
                }
                Some(libc::EPERM) if self.ops.is_writable() => {
                    return Err(DrainError::WriteDenied);
                }
                Some(libc::EPERM) => return Err(DrainError::ReadOnly),
                errno if elem_unsupported(errno) => {
                    return Err(DrainError::NotDrainable(self.meta.map_type));
                }
                _ => return Err(e.into()),
            }
        }
    }

    /// The largest batch ever asked for: a bucket never holds more than the
    /// map (the margin covers maps that briefly go past their capacity).
    fn largest_batch(&self) -> u32 {
        self.meta.max_entries.saturating_add(1024).max(2)
    }

    /// One call of up to `n` entries after `in_batch`: its result, how many
    /// entries it copied (0 when the kernel wrote nothing back) and the
    /// token it returned.
    fn call(&mut self, in_batch: Option<&[u8]>, n: u32) -> (SysResult<()>, usize, [u8; 4]) {
        let key_bytes = self.meta.key_size as usize * n as usize;
        let value_bytes = self.meta.kernel_value_size() * n as usize;
        grow_touched(&mut self.keys, key_bytes);
        grow_touched(&mut self.values, value_bytes);
        let mut out_batch = UNREPORTED;
        let mut count = n;
        self.stats.syscalls += 1;
        let res = self.ops.lookup_and_delete_batch(
            in_batch,
            &mut out_batch,
            &mut self.keys[..key_bytes],
            &mut self.values[..value_bytes],
            &mut count,
        );
        // Calls refused before the kernel started (EINVAL, ENOMEM, ENOENT
        // for a token past the last bucket) leave `count` as it was: the
        // capacity, not entries.
        let reported = res.is_ok() || out_batch != UNREPORTED;
        let copied = if reported { count.min(n) as usize } else { 0 };
        (res, copied, out_batch)
    }

    /// The first `count` entries of the buffers, as a chunk of their own.
    fn take(&mut self, count: usize) -> Chunk {
        let ks = self.meta.key_size as usize;
        let vs = self.meta.kernel_value_size();
        self.stats.entries += count as u64;
        Chunk {
            count,
            keys: self.keys[..count * ks].to_vec(),
            values: self.values[..count * vs].to_vec(),
        }
    }
}

/// Grows `buf` to at least `len` bytes, all written by this process: a
/// zeroed allocation may be fresh pages the kernel has not mapped yet.
fn grow_touched(buf: &mut Vec<u8>, len: usize) {
    if buf.len() < len {
        let mut fresh = vec![0u8; len];
        // black_box hides that the allocation is zeroed already, so the
        // fill really writes every page.
        hint::black_box(&mut fresh[..]).fill(0);
        *buf = fresh;
    }
}

#[cfg(test)]
mod tests {
    //! Error paths through the scripted fake of the syscall layer.
    use super::*;
    use crate::{
        ENOTSUPP,
        fake::{ScriptedMap as Fake, meta},
    };

    fn keys_of(c: &Chunk) -> Vec<u32> {
        c.keys
            .chunks(4)
            .map(|k| u32::from_le_bytes(k.try_into().unwrap()))
            .collect()
    }

    fn token(bucket: u32) -> Option<Vec<u8>> {
        Some(bucket.to_le_bytes().to_vec())
    }

    #[test]
    fn drainable_accepts_the_hash_family_only() {
        let family = [
            MapType::HASH,
            MapType::PERCPU_HASH,
            MapType::LRU_HASH,
            MapType::LRU_PERCPU_HASH,
            MapType::HASH_OF_MAPS,
        ];
        for t in (0..40).map(MapType) {
            match drainable(t) {
                Ok(()) => assert!(family.contains(&t), "{t:?} is not drainable"),
                Err(reason) => {
                    assert!(!family.contains(&t), "{t:?} is drainable");
                    assert!(!reason.is_empty());
                }
            }
        }
        assert_eq!(
            drainable(MapType::ARRAY),
            Err("arrays cannot delete entries")
        );
        assert_eq!(
            drainable(MapType::PERCPU_ARRAY),
            Err("arrays cannot delete entries")
        );
        assert_eq!(
            drainable(MapType::LPM_TRIE),
            Err("an lpm_trie has no lookup-and-delete batch")
        );
        assert_eq!(
            drainable(MapType(99)),
            Err("the map type is newer than this daemon")
        );
    }

    #[test]
    fn types_without_lookup_and_delete_are_refused_before_any_call() {
        let fake = Fake::default();
        for t in [
            MapType::ARRAY,
            MapType::PERCPU_ARRAY,
            MapType::LPM_TRIE,
            MapType::QUEUE,
        ] {
            let m = MapMeta {
                map_type: t,
                ..meta()
            };
            let e = Drainer::with_ops(&fake, m).unwrap_err();
            assert!(
                matches!(e, DrainError::NotDrainable(got) if got == t),
                "{e:?}"
            );
            assert!(
                e.to_string().contains(drainable(t).unwrap_err()),
                "the message gives the reason: {e}"
            );
        }
        let e = Drainer::with_ops(
            &fake,
            MapMeta {
                map_type: MapType::PERCPU_HASH,
                possible_cpus: 0,
                ..meta()
            },
        )
        .unwrap_err();
        assert!(matches!(e, DrainError::Unsized(_)), "{e:?}");
        assert!(fake.calls().is_empty(), "no call was made");
    }

    #[test]
    fn a_read_only_map_is_refused_before_any_call() {
        let fake = Fake::default();
        fake.set_read_only(true);
        let e = Drainer::with_ops(&fake, meta()).unwrap_err();
        assert!(matches!(e, DrainError::ReadOnly), "{e:?}");
        assert!(e.to_string().contains("opened read-only"), "{e}");
        assert!(fake.calls().is_empty(), "no call was made");
    }

    #[test]
    fn enospc_grows_the_buffer_and_retries_from_the_same_token() {
        let fake = Fake::default();
        fake.push(&[(1, 10)], 3, Ok(()));
        fake.push(&[], 3, Err(libc::ENOSPC));
        fake.push(&[], 3, Err(libc::ENOSPC));
        fake.push(&[(2, 20), (3, 30), (4, 40)], 4, Ok(()));
        fake.push(&[(5, 50)], 8, Err(libc::ENOENT));
        let mut d = Drainer::with_ops(&fake, meta()).unwrap();
        assert_eq!(keys_of(&d.next_chunk(1).unwrap().unwrap()), [1]);
        let c = d.next_chunk(1).unwrap().unwrap();
        assert_eq!(keys_of(&c), [2, 3, 4], "the whole bucket");
        assert_eq!(
            c.values.chunks(4).map(|v| v[0]).collect::<Vec<_>>(),
            [20, 30, 40]
        );
        assert_eq!(d.position(), &Position::After(token(4).unwrap()));
        assert_eq!(keys_of(&d.next_chunk(1).unwrap().unwrap()), [5]);
        assert!(d.next_chunk(1).unwrap().is_none());
        assert_eq!(
            fake.calls(),
            [
                (None, 1),
                (token(3), 1),
                (token(3), 2),
                (token(3), 4),
                (token(4), 1)
            ],
            "same token with count 1, 2, 4; then back to what was asked"
        );
        let s = d.stats();
        assert_eq!((s.syscalls, s.enospc, s.entries), (5, 2, 5));
    }

    #[test]
    fn enospc_forever_is_an_error_not_a_loop() {
        let fake = Fake::default();
        for _ in 0..16 {
            fake.push(&[], 0, Err(libc::ENOSPC));
        }
        let mut d = Drainer::with_ops(&fake, meta()).unwrap();
        let e = d.next_chunk(8).unwrap_err();
        assert!(
            matches!(e, DrainError::BucketTooLarge { tried } if tried == 64 + 1024),
            "{e:?}"
        );
        let counts: Vec<u32> = fake.calls().iter().map(|c| c.1).collect();
        assert_eq!(counts, [8, 16, 32, 64, 128, 256, 512, 1024, 1088]);
    }

    #[test]
    fn the_last_entries_come_with_enoent_and_none_follows() {
        let fake = Fake::default();
        fake.push(&[(5, 50), (6, 60)], 64, Err(libc::ENOENT));
        let mut d = Drainer::with_ops(&fake, meta()).unwrap();
        let c = d.next_chunk(8).unwrap().unwrap();
        assert_eq!(keys_of(&c), [5, 6]);
        assert_eq!(d.position(), &Position::End);
        assert!(d.next_chunk(8).unwrap().is_none());
        assert!(d.next_chunk(8).unwrap().is_none());
        assert_eq!(fake.calls().len(), 1, "no call after the end");
        d.restart();
        fake.push(&[], 64, Err(libc::ENOENT));
        assert!(d.next_chunk(8).unwrap().is_none());
        assert_eq!(fake.calls()[1], (None, 8), "a new pass from the start");
    }

    #[test]
    fn entries_deleted_before_an_error_are_delivered_first() {
        let fake = Fake::default();
        // A bucket lock that fails after two entries were taken.
        fake.push(&[(1, 10), (2, 20)], 5, Err(libc::EBUSY));
        // The same bucket, busy again, then taken.
        fake.push(&[], 5, Err(libc::EBUSY));
        fake.push(&[(3, 30)], 6, Ok(()));
        // A lock error that is not retried, after one entry.
        fake.push(&[(7, 70)], 9, Err(libc::EDEADLK));
        fake.push(&[], 9, Err(libc::EDEADLK));
        let mut d = Drainer::with_ops(&fake, meta()).unwrap();
        assert_eq!(keys_of(&d.next_chunk(8).unwrap().unwrap()), [1, 2]);
        assert_eq!(d.position(), &Position::After(token(5).unwrap()));
        assert_eq!(keys_of(&d.next_chunk(8).unwrap().unwrap()), [3]);
        assert_eq!(d.stats().retries, 1);
        assert_eq!(keys_of(&d.next_chunk(8).unwrap().unwrap()), [7]);
        match d.next_chunk(8).unwrap_err() {
            DrainError::Syscall(e) => assert_eq!(e.errno(), Some(libc::EDEADLK)),
            other => panic!("expected a syscall error, got {other:?}"),
        }
        assert_eq!(
            d.position(),
            &Position::After(token(9).unwrap()),
            "a retry starts at the bucket that failed"
        );
        let calls: Vec<_> = fake.calls().into_iter().map(|c| c.0).collect();
        assert_eq!(calls, [None, token(5), token(5), token(6), token(9)]);
    }

    #[test]
    fn a_call_refused_before_the_kernel_wrote_back_delivers_nothing() {
        let fake = Fake::default();
        // `count` is left at the capacity: not entries.
        fake.push_unreported(libc::ENOMEM);
        fake.push_unreported(libc::ENOENT);
        let mut d = Drainer::with_ops(&fake, meta()).unwrap();
        match d.next_chunk(8).unwrap_err() {
            DrainError::Syscall(e) => assert_eq!(e.errno(), Some(libc::ENOMEM)),
            other => panic!("expected a syscall error, got {other:?}"),
        }
        assert_eq!(d.position(), &Position::Start);
        assert!(d.next_chunk(8).unwrap().is_none(), "no entries made up");
        assert_eq!(d.stats().entries, 0);
    }

    #[test]
    fn eperm_means_read_only_or_denied() {
        let fake = Fake::default();
        fake.push(&[], 0, Err(libc::EPERM));
        fake.push(&[], 0, Err(libc::EPERM));
        let mut d = Drainer::with_ops(&fake, meta()).unwrap();
        assert!(matches!(d.next_chunk(8), Err(DrainError::WriteDenied)));
        fake.set_read_only(true);
        assert!(matches!(d.next_chunk(8), Err(DrainError::ReadOnly)));
    }

    #[test]
    fn einval_and_enotsupp_mean_not_drainable() {
        for errno in [libc::EINVAL, ENOTSUPP, libc::EOPNOTSUPP] {
            let fake = Fake::default();
            fake.push(&[], 0, Err(errno));
            let mut d = Drainer::with_ops(&fake, meta()).unwrap();
            let e = d.next_chunk(8).unwrap_err();
            assert!(
                matches!(e, DrainError::NotDrainable(MapType::HASH)),
                "{errno}: {e:?}"
            );
            assert!(e.to_string().contains("the kernel refused"), "{e}");
        }
    }
}

#[cfg(test)]
mod kernel_tests {
    //! Drains of real kernel maps. These need root and a kernel with BPF;
    //! without them they fail saying so.
    use std::{
        collections::{BTreeMap, HashMap, HashSet},
        os::fd::AsRawFd as _,
        thread,
    };

    use aya_obj::generated::{BPF_F_NO_PREALLOC, BPF_F_ZERO_SEED};

    use super::*;
    use crate::{
        CreateMap, MapHandle, OwnedMap, possible_cpus,
        walk::{Position, Walker},
    };

    fn create(params: CreateMap<'_>) -> OwnedMap {
        OwnedMap::create(&params).unwrap_or_else(|e| {
            panic!(
                "cannot create a {} map ({e}); these tests need root and a kernel with BPF",
                MapType(params.map_type)
            )
        })
    }

    fn map(map_type: MapType, key_size: u32, value_size: u32, max_entries: u32) -> OwnedMap {
        create(CreateMap {
            map_type: map_type.0,
            key_size,
            value_size,
            max_entries,
            name: "drain_test",
            ..Default::default()
        })
    }

    fn writable(map: &OwnedMap) -> MapHandle {
        MapHandle::open_id_writable(map.id()).unwrap_or_else(|e| {
            panic!(
                "cannot open map {} for writing ({e}); these tests need root",
                map.id()
            )
        })
    }

    fn read_only(map: &OwnedMap) -> MapHandle {
        MapHandle::open_id(map.id()).unwrap_or_else(|e| {
            panic!(
                "cannot open map {} read-only ({e}); these tests need root",
                map.id()
            )
        })
    }

    fn cpus() -> usize {
        let n = possible_cpus();
        assert!(n > 0, "cannot read /sys/devices/system/cpu/possible");
        n as usize
    }

    /// Every entry of the map, read through the walker (nothing deleted).
    fn walk_all(map: &OwnedMap) -> BTreeMap<Vec<u8>, Vec<u8>> {
        let h = read_only(map);
        let mut w = Walker::new(&h, h.meta().clone(), Position::Start).expect("walker");
        let mut out = BTreeMap::new();
        while let Some(c) = w.next_chunk(256).expect("walk") {
            for (k, v) in entries(&c, h.meta()) {
                assert!(out.insert(k, v).is_none(), "walked a key twice");
            }
        }
        out
    }

    /// A chunk's entries as (key, kernel-layout value) pairs.
    fn entries(c: &Chunk, meta: &MapMeta) -> Vec<(Vec<u8>, Vec<u8>)> {
        let (ks, vs) = (meta.key_size as usize, meta.kernel_value_size());
        assert_eq!(c.keys.len(), c.count * ks);
        assert_eq!(c.values.len(), c.count * vs);
        c.keys
            .chunks(ks)
            .zip(c.values.chunks(vs))
            .map(|(k, v)| (k.to_vec(), v.to_vec()))
            .collect()
    }

    /// Drains the map to the end in chunks of `want`: every entry (each key
    /// once, or the test fails), the size of each chunk, and the stats.
    fn drain_all(h: &MapHandle, want: u32) -> (BTreeMap<Vec<u8>, Vec<u8>>, Vec<usize>, DrainStats) {
        let mut d = Drainer::new(h).expect("drainer");
        let mut out = BTreeMap::new();
        let mut sizes = Vec::new();
        while let Some(c) = d.next_chunk(want).expect("drain") {
            assert!(c.count > 0, "no empty chunks");
            sizes.push(c.count);
            for (k, v) in entries(&c, h.meta()) {
                assert!(out.insert(k.clone(), v).is_none(), "{k:?} drained twice");
            }
        }
        assert!(d.next_chunk(want).expect("after the end").is_none());
        (out, sizes, d.stats())
    }

    fn u32_key(k: &[u8]) -> u32 {
        u32::from_ne_bytes(k.try_into().expect("4-byte key"))
    }

    #[test]
    fn draining_a_hash_of_10000_entries_returns_each_once_and_empties_it() {
        const N: u32 = 10_000;
        let m = map(MapType::HASH, 4, 8, N);
        let keys: Vec<u8> = (0..N).flat_map(u32::to_ne_bytes).collect();
        let values: Vec<u8> = (0..N)
            .flat_map(|k| (u64::from(k) * 7 + 1).to_ne_bytes())
            .collect();
        m.update_batch(&keys, &values).expect("fill");
        let h = writable(&m);
        assert!(h.is_writable());
        let (got, sizes, stats) = drain_all(&h, 500);
        assert_eq!(got.len(), N as usize, "every entry");
        for (k, v) in &got {
            let k = u32_key(k);
            assert!(k < N, "unknown key {k}");
            assert_eq!(
                u64::from_ne_bytes(v[..].try_into().unwrap()),
                u64::from(k) * 7 + 1,
                "value of {k}"
            );
        }
        assert!(sizes.iter().all(|&n| n <= 500), "{sizes:?}");
        assert!(sizes.len() >= 20, "chunks of at most 500: {sizes:?}");
        assert_eq!(stats.entries, u64::from(N));
        assert_eq!(stats.syscalls, sizes.len() as u64 + stats.enospc);
        assert!(walk_all(&m).is_empty(), "the map is empty");
        let mut again = Drainer::new(&h).unwrap();
        assert!(again.next_chunk(500).unwrap().is_none());
    }

    #[test]
    fn per_cpu_values_come_back_per_cpu_as_the_walker_gives_them() {
        let cpus = cpus();
        for t in [MapType::PERCPU_HASH, MapType::LRU_PERCPU_HASH] {
            const N: u32 = 1000;
            // 4-byte values: each CPU's value is padded to 8 bytes.
            let m = map(t, 4, 4, 4096);
            let keys: Vec<u8> = (0..N).flat_map(u32::to_ne_bytes).collect();
            let mut values = vec![0u8; N as usize * cpus * 8];
            for k in 0..N as usize {
                for c in 0..cpus {
                    let at = (k * cpus + c) * 8;
                    values[at..at + 4].copy_from_slice(&((k * 100 + c) as u32).to_ne_bytes());
                }
            }
            m.update_batch(&keys, &values).expect("fill");
            let walked = walk_all(&m);
            assert_eq!(walked.len(), N as usize, "{t}: every entry is in the map");
            let h = writable(&m);
            assert_eq!(h.meta().kernel_value_size(), cpus * 8);
            let (got, _, _) = drain_all(&h, 64);
            assert_eq!(got, walked, "{t}: the walker's keys and values");
            for (k, v) in &got {
                let k = u32_key(k) as usize;
                for (c, cpu_value) in v.chunks(8).enumerate() {
                    assert_eq!(
                        u32::from_ne_bytes(cpu_value[..4].try_into().unwrap()),
                        (k * 100 + c) as u32,
                        "{t}: key {k}, cpu {c}"
                    );
                }
            }
            assert!(walk_all(&m).is_empty(), "{t}: the map is empty");
        }
    }

    #[test]
    fn an_lru_hash_drains_each_entry_once_and_empties_it() {
        const N: u32 = 1000;
        let m = map(MapType::LRU_HASH, 4, 4, 4096);
        let keys: Vec<u8> = (0..N).flat_map(u32::to_ne_bytes).collect();
        let values: Vec<u8> = (0..N).flat_map(|k| (k ^ 0x5a5a).to_ne_bytes()).collect();
        m.update_batch(&keys, &values).expect("fill");
        let walked = walk_all(&m);
        assert_eq!(walked.len(), N as usize, "nothing evicted");
        let h = writable(&m);
        let (got, sizes, _) = drain_all(&h, 100);
        assert_eq!(got, walked);
        assert!(sizes.iter().all(|&n| n <= 100), "{sizes:?}");
        assert!(walk_all(&m).is_empty());
    }

    /// The kernel's hash of a 4-byte key (`jhash2` of one word,
    /// include/linux/jhash.h), as a hash map computes it.
    fn jhash_word(k: u32, seed: u32) -> u32 {
        let mut a = 0xdead_beef_u32.wrapping_add(4).wrapping_add(seed);
        let (mut b, mut c) = (a, a);
        a = a.wrapping_add(k);
        c ^= b;
        c = c.wrapping_sub(b.rotate_left(14));
        a ^= c;
        a = a.wrapping_sub(c.rotate_left(11));
        b ^= a;
        b = b.wrapping_sub(a.rotate_left(25));
        c ^= b;
        c = c.wrapping_sub(b.rotate_left(16));
        a ^= c;
        a = a.wrapping_sub(c.rotate_left(4));
        b ^= a;
        b = b.wrapping_sub(a.rotate_left(14));
        c ^= b;
        c = c.wrapping_sub(b.rotate_left(24));
        c
    }

    #[test]
    fn a_small_want_drains_whole_buckets_each_exactly_once() {
        // With BPF_F_ZERO_SEED the bucket of every key is known, so the
        // map can be filled with chosen collisions: buckets 0..512 hold
        // `b % 8` entries, and three of them more than a chunk of 7.
        const BUCKETS: u32 = 4096;
        let big = [(100u32, 20usize), (250, 9), (400, 8)];
        let quota = |b: u32| match big.iter().find(|(x, _)| *x == b) {
            Some(&(_, n)) => n,
            None if b < 512 => (b % 8) as usize,
            None => 0,
        };
        let bucket_of = |k: u32| jhash_word(k, 0) & (BUCKETS - 1);
        let mut by_bucket: BTreeMap<u32, Vec<u32>> = BTreeMap::new();
        let needed: usize = (0..BUCKETS).map(quota).sum();
        let mut placed = 0;
        for k in 0u32.. {
            let b = bucket_of(k);
            let slot = by_bucket.entry(b).or_default();
            if slot.len() < quota(b) {
                slot.push(k);
                placed += 1;
                if placed == needed {
                    break;
                }
            }
        }
        let m = create(CreateMap {
            map_type: MapType::HASH.0,
            key_size: 4,
            value_size: 4,
            max_entries: BUCKETS,
            flags: BPF_F_ZERO_SEED,
            name: "drain_buckets",
            ..Default::default()
        });
        let all: Vec<u32> = by_bucket.values().flatten().copied().collect();
        let keys: Vec<u8> = all.iter().flat_map(|k| k.to_ne_bytes()).collect();
        let values: Vec<u8> = all.iter().flat_map(|k| (!k).to_ne_bytes()).collect();
        m.update_batch(&keys, &values).expect("fill");

        let h = writable(&m);
        let mut d = Drainer::new(&h).expect("drainer");
        let mut seen = HashSet::new();
        let mut last_bucket = None;
        while let Some(c) = d.next_chunk(7).expect("drain") {
            let chunk_keys: Vec<u32> = c.keys.chunks(4).map(u32_key).collect();
            let chunk_buckets: HashSet<u32> = chunk_keys.iter().map(|&k| bucket_of(k)).collect();
            for &b in &chunk_buckets {
                for k in &by_bucket[&b] {
                    assert!(
                        chunk_keys.contains(k),
                        "bucket {b} split: {k} not in the chunk {chunk_keys:?}"
                    );
                }
            }
            let has_big = chunk_buckets.iter().any(|b| quota(*b) > 7);
            assert!(
                c.count <= 7 || has_big,
                "a chunk of {} entries without a large bucket",
                c.count
            );
            for (i, &k) in chunk_keys.iter().enumerate() {
                let b = bucket_of(k);
                assert!(
                    last_bucket.is_none_or(|l| l <= b),
                    "buckets come in order: {b} after {last_bucket:?}"
                );
                last_bucket = Some(b);
                assert!(seen.insert(k), "{k} drained twice");
                assert_eq!(
                    u32::from_ne_bytes(c.values[i * 4..i * 4 + 4].try_into().unwrap()),
                    !k
                );
            }
        }
        assert_eq!(seen.len(), all.len(), "every entry drained");
        // 20 entries: ENOSPC with 7 and 14; 9 and 8 entries: with 7.
        assert_eq!(d.stats().enospc, 4, "{:?}", d.stats());
        assert!(walk_all(&m).is_empty());
    }

    #[test]
    fn an_array_is_not_drainable_and_keeps_its_entries() {
        let m = map(MapType::ARRAY, 4, 8, 4);
        for i in 0..4u32 {
            m.update(&i.to_ne_bytes(), &(u64::from(i) + 10).to_ne_bytes())
                .expect("set");
        }
        let h = writable(&m);
        let e = Drainer::new(&h).unwrap_err();
        assert!(
            matches!(e, DrainError::NotDrainable(MapType::ARRAY)),
            "{e:?}"
        );
        assert!(
            e.to_string().contains("arrays cannot delete entries"),
            "{e}"
        );
        for i in 0..4u32 {
            assert_eq!(
                h.lookup_value(&i.to_ne_bytes()).unwrap(),
                Some((u64::from(i) + 10).to_ne_bytes().to_vec())
            );
        }
    }

    #[test]
    fn the_kernel_has_no_lookup_and_delete_where_drainable_says_no() {
        let lpm_key = |len: u32, addr: [u8; 4]| {
            let mut k = len.to_ne_bytes().to_vec();
            k.extend_from_slice(&addr);
            k
        };
        let cases = [
            (MapType::ARRAY, 4, 8, 0, 4),
            (MapType::PERCPU_ARRAY, 4, 8, 0, 4),
            (MapType::LPM_TRIE, 8, 8, BPF_F_NO_PREALLOC, 16),
            (MapType::QUEUE, 0, 8, 0, 4),
        ];
        for (t, key_size, value_size, flags, max_entries) in cases {
            assert!(drainable(t).is_err());
            let m = create(CreateMap {
                map_type: t.0,
                key_size,
                value_size,
                max_entries,
                flags,
                name: "drain_refused",
                ..Default::default()
            });
            if t == MapType::LPM_TRIE {
                m.update(&lpm_key(24, [10, 1, 2, 0]), &7u64.to_ne_bytes())
                    .expect("insert");
            }
            let h = writable(&m);
            let vs = h.meta().kernel_value_size();
            let mut out_batch = vec![0u8; (key_size as usize).max(4)];
            let mut keys = vec![0u8; 4 * key_size as usize];
            let mut values = vec![0u8; 4 * vs];
            let mut count = 4;
            let e = DrainOps::lookup_and_delete_batch(
                &h,
                None,
                &mut out_batch,
                &mut keys,
                &mut values,
                &mut count,
            )
            .expect_err("the kernel has no lookup-and-delete for this type");
            assert!(
                elem_unsupported(e.errno()),
                "{t}: {e} (expected EINVAL, ENOTSUPP or EOPNOTSUPP)"
            );
            if t == MapType::LPM_TRIE {
                assert_eq!(
                    h.lookup_value(&lpm_key(24, [10, 1, 2, 0])).unwrap(),
                    Some(7u64.to_ne_bytes().to_vec()),
                    "nothing deleted"
                );
            }
        }
    }

    #[test]
    fn a_read_only_handle_is_refused_and_the_kernel_agrees() {
        let m = map(MapType::HASH, 4, 4, 128);
        let keys: Vec<u8> = (0..100u32).flat_map(u32::to_ne_bytes).collect();
        m.update_batch(&keys, &keys).expect("fill");
        let ro = read_only(&m);
        assert!(!ro.is_writable());
        let e = Drainer::new(&ro).unwrap_err();
        assert!(matches!(e, DrainError::ReadOnly), "{e:?}");
        // Through the seam, without the drainer's check: EPERM.
        let (mut out_batch, mut k, mut v, mut count) = ([0u8; 4], [0u8; 32], [0u8; 32], 8);
        let e = DrainOps::lookup_and_delete_batch(
            &ro,
            None,
            &mut out_batch,
            &mut k,
            &mut v,
            &mut count,
        )
        .unwrap_err();
        assert_eq!(e.errno(), Some(libc::EPERM), "{e}");
        assert_eq!(walk_all(&m).len(), 100, "nothing deleted");
    }

    #[test]
    fn a_hash_of_maps_drains_to_inner_map_ids() {
        let inner: Vec<OwnedMap> = (0..5).map(|_| map(MapType::ARRAY, 4, 4, 1)).collect();
        let outer = create(CreateMap {
            map_type: MapType::HASH_OF_MAPS.0,
            key_size: 4,
            value_size: 4,
            max_entries: 8,
            name: "drain_outer",
            inner_map: Some(std::os::fd::AsFd::as_fd(&inner[0])),
            ..Default::default()
        });
        for (i, m) in inner.iter().enumerate() {
            let fd = std::os::fd::AsFd::as_fd(m).as_raw_fd() as u32;
            outer
                .update(&(i as u32).to_ne_bytes(), &fd.to_ne_bytes())
                .expect("insert inner map");
        }
        let h = writable(&outer);
        let (got, _, _) = drain_all(&h, 2);
        let ids: HashMap<u32, u32> = got.iter().map(|(k, v)| (u32_key(k), u32_key(v))).collect();
        let want: HashMap<u32, u32> = inner
            .iter()
            .enumerate()
            .map(|(i, m)| (i as u32, m.id()))
            .collect();
        assert_eq!(ids, want, "values are the inner maps' ids");
        assert!(walk_all(&outer).is_empty());
    }

    #[test]
    fn entries_inserted_during_repeated_drains_are_each_drained_once() {
        const N: u32 = 20_000;
        let m = map(MapType::HASH, 4, 8, N);
        let h = writable(&m);
        let mut drained: HashMap<u32, u64> = HashMap::new();
        let mut passes = 0;
        let mut while_inserting = 0;
        thread::scope(|s| {
            let inserter = s.spawn(|| {
                for k in 0..N {
                    m.update(&k.to_ne_bytes(), &(u64::from(k) * 3).to_ne_bytes())
                        .expect("insert");
                    if k % 512 == 0 {
                        thread::yield_now();
                    }
                }
            });
            let mut d = Drainer::new(&h).expect("drainer");
            loop {
                // Observed before the pass: a pass that starts after the
                // last insert finds everything still in the map.
                let done = inserter.is_finished();
                d.restart();
                while let Some(c) = d.next_chunk(64).expect("drain") {
                    for (k, v) in entries(&c, h.meta()) {
                        let k = u32_key(&k);
                        let v = u64::from_ne_bytes(v[..].try_into().unwrap());
                        assert!(drained.insert(k, v).is_none(), "{k} drained twice");
                        if !done {
                            while_inserting += 1;
                        }
                    }
                }
                passes += 1;
                if done {
                    break;
                }
            }
            inserter.join().expect("inserter");
        });
        let mut last = Drainer::new(&h).unwrap();
        assert!(
            last.next_chunk(64).unwrap().is_none(),
            "a final drain finds nothing"
        );
        assert_eq!(drained.len(), N as usize, "every key");
        for k in 0..N {
            assert_eq!(drained.get(&k), Some(&(u64::from(k) * 3)), "key {k}");
        }
        assert!(
            passes > 1,
            "the drains overlapped the inserts ({passes} passes)"
        );
        assert!(
            while_inserting > 0,
            "entries were drained while others were being inserted"
        );
    }
}
