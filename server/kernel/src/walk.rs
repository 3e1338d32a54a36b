//! Walks a map chunk by chunk, from any position a cursor can name.
//!
//! Batch reads follow the kernel's contract (`BPF_MAP_LOOKUP_BATCH` in
//! kernel/bpf/hashtab.c and syscall.c): ENOENT ends the walk and its count
//! is valid, ENOSPC means the
//! next hash bucket does not fit and is retried with a larger batch from the
//! same token, EINTR and EBUSY are retried.
//!
//! Maps walked by key (the generic batch path of lpm_trie, and
//! get_next_key for stack_trace, devmap_hash, sockhash) have a trap: given a
//! key that no longer exists, the kernel silently starts again from the
//! first key, inside one batch call as well as between calls. Where the
//! order of the walk is known ([`trie_order`]: an lpm_trie is walked in
//! postorder; [`id_order`]: stack ids ascend), a restart shows as a key that
//! does not come after the one before it; the walker then skips every key up
//! to the last one it delivered, and continues from the most recent
//! delivered key that still exists. For devmap_hash and sockhash the order
//! is the kernel's bucket order, which user space cannot compute: a restart
//! is detected by comparing with the first key, and ends the walk with
//! [`WalkError::ResumeKeyDeleted`] rather than repeating entries; so does a
//! cgroup_storage walk whose key went away (the kernel then answers as if
//! the map had ended). See [`KeyWalk`].

use std::{cmp::Ordering, collections::VecDeque, thread, time::Duration};

use super::{
    KeyWalk, MapMeta, MapOps, MapType, SysResult, SyscallError, WalkMethod, batch_unsupported,
    elem_unsupported,
};

/// Where a walk stands.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Position {
    /// Nothing read yet.
    Start,
    /// Continue after this token: a bucket index (4 bytes) for hash-family
    /// maps, the last key delivered otherwise.
    After(Vec<u8>),
    /// The walk reached the end of the map.
    End,
}

/// Entries in the kernel's layout: `count` keys of `key_size` bytes, and
/// `count` values of the kernel element size (per-CPU values padded to 8
/// bytes per CPU).
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Chunk {
    /// Number of entries.
    pub count: usize,
    /// `count` keys, back to back.
    pub keys: Vec<u8>,
    /// `count` values, back to back.
    pub values: Vec<u8>,
}

/// Why a walk cannot go on.
#[derive(Debug, thiserror::Error)]
pub enum WalkError {
    /// The type cannot be iterated, or the kernel refused the operation for
    /// this type.
    #[error("maps of type {0} cannot be iterated from user space")]
    NotIterable(MapType),
    /// A key the walk stood on was deleted, and the map type restarts from
    /// its first key then: going on would repeat entries.
    #[error("a key the walk had reached was deleted from the map; restart the dump")]
    ResumeKeyDeleted,
    /// A cursor token that does not fit this map.
    #[error("cursor position does not fit this map")]
    BadToken,
    /// The daemon cannot size this map's values.
    #[error("{0}")]
    Unsized(String),
    /// A hash bucket larger than the map could ever hold.
    #[error("the kernel kept answering ENOSPC up to a batch of {tried} entries")]
    BucketTooLarge {
        /// The largest batch tried.
        tried: u32,
    },
    /// Any other kernel error.
    #[error(transparent)]
    Syscall(#[from] SyscallError),
}

/// How many times EINTR / EBUSY are retried before giving up.
pub(crate) const MAX_RETRIES: u32 = 32;
/// Delivered keys remembered by a trie walk, as places to continue from
/// after the kernel restarted.
const RECENT_KEYS: usize = 32;

/// The order in which the kernel walks an lpm_trie: keys are
/// `{ u32 prefixlen; u8 data[] }`, and the trie is walked in postorder,
/// so of two prefixes that differ within their common length the one with a
/// 0 bit there comes first, and a longer prefix comes before a shorter one
/// that contains it.
pub fn trie_order(a: &[u8], b: &[u8]) -> Ordering {
    fn split(k: &[u8]) -> (usize, &[u8]) {
        let (len, data) = k.split_at(4.min(k.len()));
        let prefix = len.try_into().map_or(0, u32::from_ne_bytes) as usize;
        (prefix.min(data.len() * 8), data)
    }
    let ((pa, da), (pb, db)) = (split(a), split(b));
    let common = pa.min(pb);
    for (i, (x, y)) in da.iter().zip(db).enumerate() {
        if i * 8 >= common {
            break;
        }
        let diff = x ^ y;
        if diff != 0 {
            let bit = i * 8 + diff.leading_zeros() as usize;
            if bit < common {
                return if x & (0x80 >> (bit % 8)) == 0 {
                    Ordering::Less
                } else {
                    Ordering::Greater
                };
            }
            break;
        }
    }
    pb.cmp(&pa)
}

/// An order of keys (`Less`: comes first in the kernel's walk).
type KeyOrder = fn(&[u8], &[u8]) -> Ordering;

/// The ascending order of u32 ids (stack_trace).
pub fn id_order(a: &[u8], b: &[u8]) -> Ordering {
    let id = |k: &[u8]| {
        k.get(..4)
            .and_then(|k| k.try_into().ok())
            .map(u32::from_ne_bytes)
    };
    id(a).cmp(&id(b))
}

/// The walk order of a map whose kernel walk restarts in a computable order.
fn order_of(meta: &MapMeta) -> Option<KeyOrder> {
    match meta.map_type.key_walk() {
        KeyWalk::RestartsInTrieOrder => Some(trie_order),
        KeyWalk::RestartsInIdOrder => Some(id_order),
        _ => None,
    }
}

/// A walk of one map.
#[derive(Debug)]
pub struct Walker<O> {
    ops: O,
    meta: MapMeta,
    method: WalkMethod,
    /// What a cursor resumes after: the bucket token, or the last key
    /// delivered.
    pos: Position,
    /// Trie walks: the key the kernel continues after (`None`: from the
    /// first key). Behind `pos` after the kernel restarted.
    from: Option<Vec<u8>>,
    /// Trie walks: recently delivered keys, newest last.
    recent: VecDeque<Vec<u8>>,
    /// Smallest batch known to fit the next bucket (grown after ENOSPC).
    min_batch: u32,
    stats: WalkStats,
}

/// What a walk cost, for tests and benchmarks.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct WalkStats {
    /// BPF_MAP_LOOKUP_BATCH calls made.
    pub syscalls: u64,
    /// Calls that failed with ENOSPC and were retried with a larger batch.
    pub enospc: u64,
    /// Times the kernel restarted a trie walk from its first key.
    pub restarts: u64,
    /// Entries read again after a restart and not delivered twice.
    pub skipped: u64,
}

impl<O: MapOps> Walker<O> {
    /// A walk of `meta`'s map from `pos`. The position must come from a
    /// cursor of the same map (the caller checks the binding).
    pub fn new(ops: O, meta: MapMeta, pos: Position) -> Result<Self, WalkError> {
        let method = meta.walk_method();
        if method == WalkMethod::None {
            return Err(WalkError::NotIterable(meta.map_type));
        }
        if let Some(reason) = meta.unsized_reason() {
            return Err(WalkError::Unsized(reason));
        }
        if let Position::After(token) = &pos
            && token.len() != meta.token_size()
        {
            return Err(WalkError::BadToken);
        }
        Ok(Self::with_method(ops, meta, pos, method))
    }

    /// A walk of entries read as the kernel's generic batch reads them
    /// (the token is the last key delivered), whatever the map's type: the
    /// entries a walk inside the kernel took (`program::Matches`), in
    /// their order.
    pub fn by_key(ops: O, meta: MapMeta, pos: Position) -> Result<Self, WalkError> {
        if let Position::After(token) = &pos
            && token.len() != meta.key_size as usize
        {
            return Err(WalkError::BadToken);
        }
        Ok(Self::with_method(ops, meta, pos, WalkMethod::BatchKey))
    }

    fn with_method(ops: O, meta: MapMeta, pos: Position, method: WalkMethod) -> Self {
        let from = match &pos {
            Position::After(k) if order_of(&meta).is_some() => Some(k.clone()),
            _ => None,
        };
        Self {
            ops,
            meta,
            method,
            pos,
            from,
            recent: VecDeque::new(),
            min_batch: 1,
            stats: WalkStats::default(),
        }
    }

    /// Where a cursor issued now resumes.
    pub fn position(&self) -> &Position {
        &self.pos
    }

    /// Goes back to `pos`, a position this walk stood at, to read again
    /// from there as a walk made from it would.
    pub fn rewind(&mut self, pos: Position) {
        self.from = match &pos {
            Position::After(k) if order_of(&self.meta).is_some() => Some(k.clone()),
            _ => None,
        };
        self.recent.clear();
        self.pos = pos;
    }

    /// The map being walked.
    pub fn meta(&self) -> &MapMeta {
        &self.meta
    }

    /// What the walk cost so far.
    pub fn stats(&self) -> WalkStats {
        self.stats
    }

    /// Reads about `want` entries (a hash bucket is never split, so more when
    /// one bucket is larger). `Ok(None)` once the walk is at the end; a final
    /// chunk may also arrive together with the end.
    pub fn next_chunk(&mut self, want: u32) -> Result<Option<Chunk>, WalkError> {
        self.read(want, None)
    }

    /// Like [`Walker::next_chunk`], but never returns more than `cap`
    /// entries: when the next hash bucket holds more, returns an empty chunk
    /// and leaves the position where it was.
    pub fn next_chunk_capped(&mut self, want: u32, cap: u32) -> Result<Option<Chunk>, WalkError> {
        self.read(want.min(cap), Some(cap.max(1)))
    }

    fn read(&mut self, want: u32, cap: Option<u32>) -> Result<Option<Chunk>, WalkError> {
        let want = want.max(1);
        loop {
            let chunk = match self.pos {
                Position::End => return Ok(None),
                _ => match self.method {
                    WalkMethod::BatchBucket | WalkMethod::BatchKey => {
                        match self.batch(want, cap)? {
                            Some(c) => c,
                            None => return Ok(Some(Chunk::default())),
                        }
                    }
                    WalkMethod::KeyByKey => self.key_by_key(want)?,
                    WalkMethod::None => unreachable!("rejected in new()"),
                },
            };
            if chunk.count > 0 || self.pos == Position::End {
                return Ok(Some(chunk).filter(|c| c.count > 0));
            }
        }
    }

    /// The order of the walk, for types whose kernel walk restarts but in
    /// an order that can be computed.
    fn order(&self) -> Option<KeyOrder> {
        order_of(&self.meta)
    }

    fn delivered(&self) -> Option<&[u8]> {
        match &self.pos {
            Position::After(k) => Some(k),
            _ => None,
        }
    }

    /// The token the kernel continues after.
    fn continue_after(&self) -> Option<&[u8]> {
        if self.order().is_some() {
            self.from.as_deref()
        } else {
            self.delivered()
        }
    }

    /// For devmap_hash and sockhash: refuses to continue after a key that
    /// was deleted (the kernel would silently restart from the first key).
    fn check_resume_key(&self) -> Result<(), WalkError> {
        let Some(last) = self.delivered() else {
            return Ok(());
        };
        if self.meta.map_type.key_walk() != KeyWalk::RestartsUnordered {
            return Ok(());
        }
        let ks = self.meta.key_size as usize;
        let mut after_last = vec![0; ks];
        let mut first = vec![0; ks];
        let next = retry(|| self.ops.get_next_key(Some(last), &mut after_last));
        let head = retry(|| self.ops.get_next_key(None, &mut first));
        match (next, head) {
            (Ok(()), Ok(())) if after_last == first && first != *last => {
                Err(WalkError::ResumeKeyDeleted)
            }
            (Err(e), _) | (_, Err(e)) if e.errno() != Some(libc::ENOENT) => Err(e.into()),
            _ => Ok(()),
        }
    }

    /// Keeps the keys of an ordered walk's raw chunk that come after the
    /// last key delivered; notices a restart (a key that does not come after
    /// the one before it) and picks where the kernel goes on from:
    /// `examined` (the last key it returned) without a restart, else the
    /// newest delivered key that still leads forward.
    fn accept_ordered(
        &mut self,
        order: KeyOrder,
        raw: Chunk,
        after: Option<Vec<u8>>,
        examined: Option<Vec<u8>>,
    ) -> Chunk {
        let ks = self.meta.key_size as usize;
        let vs = self.meta.kernel_value_size();
        let mut out = Chunk::default();
        let mut prev = after;
        let mut restarted = false;
        for i in 0..raw.count {
            let key = &raw.keys[i * ks..(i + 1) * ks];
            if prev
                .as_deref()
                .is_some_and(|p| order(key, p) != Ordering::Greater)
            {
                restarted = true;
            }
            prev = Some(key.to_vec());
            let fresh = self
                .delivered()
                .is_none_or(|d| order(key, d) == Ordering::Greater);
            if !fresh {
                self.stats.skipped += 1;
                continue;
            }
            out.keys.extend_from_slice(key);
            out.values
                .extend_from_slice(&raw.values[i * vs..(i + 1) * vs]);
            out.count += 1;
            self.pos = Position::After(key.to_vec());
            self.recent.push_back(key.to_vec());
            if self.recent.len() > RECENT_KEYS {
                self.recent.pop_front();
            }
        }
        // A key examined after the last one copied that does not come after
        // it is a restart too.
        if let (Some(p), Some(e)) = (prev.as_deref(), examined.as_deref())
            && order(e, p) == Ordering::Less
        {
            restarted = true;
        }
        if examined.is_some() {
            self.from = examined;
        }
        if restarted {
            self.stats.restarts += 1;
            // Go on from the newest delivered key that still leads forward,
            // unless the kernel's restarted walk is already past it.
            if let Some(anchor) = self.usable_anchor(order)
                && self
                    .from
                    .as_deref()
                    .is_none_or(|f| order(&anchor, f) == Ordering::Greater)
            {
                self.from = Some(anchor);
            }
        }
        out
    }

    /// The newest recently delivered key whose successor comes after it
    /// (it still exists, or nothing that precedes it does).
    fn usable_anchor(&mut self, order: KeyOrder) -> Option<Vec<u8>> {
        let ks = self.meta.key_size as usize;
        let mut next = vec![0u8; ks];
        while let Some(candidate) = self.recent.pop_back() {
            match retry(|| self.ops.get_next_key(Some(&candidate), &mut next)) {
                Ok(()) if order(&next, &candidate) == Ordering::Greater => {
                    self.recent.push_back(candidate.clone());
                    return Some(candidate);
                }
                Err(e) if e.errno() == Some(libc::ENOENT) => {
                    self.recent.push_back(candidate.clone());
                    return Some(candidate);
                }
                _ => {}
            }
        }
        None
    }

    /// `None` when the next hash bucket holds more than `cap` entries.
    fn batch(&mut self, want: u32, cap: Option<u32>) -> Result<Option<Chunk>, WalkError> {
        let mut attempt = Attempt {
            n: want.max(self.min_batch),
            cap,
            retries: 0,
        };
        if let Some(cap) = cap {
            if self.min_batch > cap {
                return Ok(None);
            }
            attempt.n = attempt.n.min(cap);
        }
        loop {
            let after = self.continue_after().map(<[u8]>::to_vec);
            let (res, raw, out_batch) = self.batch_call(after.as_deref(), attempt.n);
            let end = match res {
                Ok(()) => false,
                Err(e) => match self.after_batch_error(e, raw.count, &mut attempt) {
                    AfterError::Retry => continue,
                    AfterError::End => true,
                    AfterError::Keep => false,
                    AfterError::StepOver => return self.key_by_key(1).map(Some),
                    AfterError::Stop(result) => return result,
                },
            };
            // A bucket that fit once is likely to fit again: shrink back.
            self.min_batch = 1;
            return self.accept_batch(raw, after, out_batch, end).map(Some);
        }
    }

    /// One `BPF_MAP_LOOKUP_BATCH` of up to `n` entries after `after`: its
    /// result, the entries it copied, and the token it returned.
    fn batch_call(&mut self, after: Option<&[u8]>, n: u32) -> (SysResult<()>, Chunk, Vec<u8>) {
        let ks = self.meta.key_size as usize;
        let vs = self.meta.kernel_value_size();
        let token = match self.method {
            WalkMethod::BatchBucket => 4,
            _ => self.meta.key_size as usize,
        };
        let mut out_batch = vec![0u8; token.max(4)];
        let mut keys = vec![0u8; ks * n as usize];
        let mut values = vec![0u8; vs * n as usize];
        let mut count = n;
        self.stats.syscalls += 1;
        let res = self
            .ops
            .lookup_batch(after, &mut out_batch, &mut keys, &mut values, &mut count);
        let count = count.min(n) as usize;
        keys.truncate(ks * count);
        values.truncate(vs * count);
        let raw = Chunk {
            count,
            keys,
            values,
        };
        (res, raw, out_batch)
    }

    /// Up to this batch size, a batch too small for the next bucket grows by
    /// one entry at a time (beyond, it doubles).
    const SMALL_BUCKET: u32 = 64;

    /// What to do after a batch call that failed with `e` having copied
    /// `count` entries: the batch size grows on ENOSPC up to the cap, and
    /// the retries are counted.
    fn after_batch_error(&mut self, e: SyscallError, count: usize, a: &mut Attempt) -> AfterError {
        let Attempt { n, cap, retries } = a;
        let cap = *cap;
        let bucket = self.method == WalkMethod::BatchBucket;
        match e.errno() {
            Some(libc::ENOENT) => AfterError::End,
            Some(libc::ENOSPC) if count == 0 => {
                // The next bucket holds more than `n` entries.
                let limit = self.meta.max_entries.saturating_add(1024).max(2);
                let ceiling = cap.unwrap_or(limit).min(limit);
                if *n >= ceiling {
                    return AfterError::Stop(match cap {
                        Some(c) if c < limit => Ok(None),
                        _ => Err(WalkError::BucketTooLarge { tried: *n }),
                    });
                }
                // One more at a time while buckets are small (the kernel
                // does not say how big the bucket is): the batch that
                // fits then holds that bucket alone, so that a call with a
                // limit exceeds it by no more than the first bucket's
                // excess. Doubling beyond, for buckets of many colliding
                // keys.
                *n = if *n < Self::SMALL_BUCKET {
                    *n + 1
                } else {
                    n.saturating_mul(2)
                }
                .min(ceiling);
                self.stats.enospc += 1;
                self.min_batch = *n;
                AfterError::Retry
            }
            // The generic path answers EINTR when a key from get_next_key
            // cannot be looked up three times in a row (deleted meanwhile,
            // or an empty slot of an array_of_maps). What it copied before
            // is valid; the missing key is stepped over one key at a time.
            Some(libc::EINTR) if !bucket && count > 0 => AfterError::Keep,
            Some(libc::EINTR) if !bucket => AfterError::StepOver,
            Some(libc::EINTR) | Some(libc::EAGAIN) | Some(libc::EBUSY)
                if *retries < MAX_RETRIES =>
            {
                *retries += 1;
                backoff(*retries);
                AfterError::Retry
            }
            errno if batch_unsupported(errno) => {
                AfterError::Stop(Err(WalkError::NotIterable(self.meta.map_type)))
            }
            _ => AfterError::Stop(Err(e.into())),
        }
    }

    /// Takes the entries of a batch call (made after `after`, returning the
    /// token `out_batch`; `end` when the map ended) and moves the position.
    fn accept_batch(
        &mut self,
        raw: Chunk,
        after: Option<Vec<u8>>,
        mut out_batch: Vec<u8>,
        end: bool,
    ) -> Result<Chunk, WalkError> {
        let ks = self.meta.key_size as usize;
        let count = raw.count;
        if self.method == WalkMethod::BatchBucket {
            out_batch.truncate(4);
            if !end && count == 0 && after.as_deref() == Some(out_batch.as_slice()) {
                // No progress and no entries: the token is out of range.
                return Err(WalkError::BadToken);
            }
            self.pos = if end {
                Position::End
            } else {
                Position::After(out_batch)
            };
            return Ok(raw);
        }
        if !end && count == 0 {
            // The generic path reports success only with entries.
            return Err(WalkError::BadToken);
        }
        let chunk = if let Some(order) = self.order() {
            let last = (count > 0).then(|| raw.keys[ks * (count - 1)..].to_vec());
            self.accept_ordered(order, raw, after, last)
        } else {
            if count > 0 {
                self.pos = Position::After(raw.keys[ks * (count - 1)..].to_vec());
            }
            raw
        };
        if end {
            self.pos = Position::End;
        }
        Ok(chunk)
    }

    fn key_by_key(&mut self, max: u32) -> Result<Chunk, WalkError> {
        self.check_resume_key()?;
        let order = self.order();
        let ks = self.meta.key_size as usize;
        let start = self.continue_after().map(<[u8]>::to_vec);
        let mut prev = start.clone();
        let mut raw = Chunk::default();
        let mut next = vec![0u8; ks];
        let mut value = vec![0u8; self.meta.kernel_value_size()];
        let mut examined = 0;
        let mut end = false;
        while examined < max {
            if !self.next_key(prev.as_deref(), &mut next, &mut value)? {
                end = true;
                break;
            }
            examined += 1;
            if self.look_up(&next, &mut value)? {
                raw.keys.extend_from_slice(&next);
                raw.values.extend_from_slice(&value);
                raw.count += 1;
            }
            prev = Some(next.clone());
            if order.is_none() {
                self.pos = Position::After(next.clone());
            }
        }
        let examined = prev.filter(|p| Some(p) != start.as_ref());
        let chunk = match order {
            Some(order) => self.accept_ordered(order, raw, start, examined),
            None => raw,
        };
        if end {
            self.pos = Position::End;
        }
        Ok(chunk)
    }

    /// The key after `prev` into `next`; `false` at the end of the map.
    /// (`value` is room for a lookup.)
    fn next_key(
        &self,
        prev: Option<&[u8]>,
        next: &mut [u8],
        value: &mut [u8],
    ) -> Result<bool, WalkError> {
        let walk = self.meta.map_type.key_walk();
        match retry(|| self.ops.get_next_key(prev, next)) {
            Ok(()) => {}
            Err(e) if e.errno() == Some(libc::ENOENT) => {
                // cgroup_storage answers ENOENT after a key that went
                // away, as at the end: tell the two apart.
                if walk == KeyWalk::EndsEarly
                    && let Some(p) = prev
                    && let Err(e) = retry(|| self.ops.lookup(p, value))
                    && e.errno() == Some(libc::ENOENT)
                {
                    return Err(WalkError::ResumeKeyDeleted);
                }
                return Ok(false);
            }
            Err(e) => return Err(self.not_iterable_or(e)),
        }
        if walk == KeyWalk::RestartsUnordered && prev.is_some() {
            // A successor is never the first key: if it is, the key we
            // stood on was deleted and the kernel started over.
            let mut head = vec![0u8; next.len()];
            match retry(|| self.ops.get_next_key(None, &mut head)) {
                Ok(()) if head == next => return Err(WalkError::ResumeKeyDeleted),
                Ok(()) => {}
                Err(e) if e.errno() == Some(libc::ENOENT) => {}
                Err(e) => return Err(self.not_iterable_or(e)),
            }
        }
        Ok(true)
    }

    /// The value of `key` into `value`; `false` when it is gone (deleted
    /// since get_next_key, or an empty slot).
    fn look_up(&self, key: &[u8], value: &mut [u8]) -> Result<bool, WalkError> {
        // A stack_trace bucket is briefly empty while another reader copies
        // it: look again before taking it for deleted.
        let tries = if self.meta.map_type.key_walk() == KeyWalk::RestartsInIdOrder {
            4
        } else {
            1
        };
        let mut looked = retry(|| self.ops.lookup(key, value));
        for _ in 1..tries {
            if !matches!(&looked, Err(e) if e.errno() == Some(libc::ENOENT)) {
                break;
            }
            thread::sleep(Duration::from_micros(200));
            looked = retry(|| self.ops.lookup(key, value));
        }
        match looked {
            Ok(()) => Ok(true),
            Err(e) if e.errno() == Some(libc::ENOENT) => Ok(false),
            Err(e) => Err(self.not_iterable_or(e)),
        }
    }

    fn not_iterable_or(&self, e: SyscallError) -> WalkError {
        if elem_unsupported(e.errno()) {
            WalkError::NotIterable(self.meta.map_type)
        } else {
            e.into()
        }
    }
}

/// The batch calls of one read: the size of the next, the most a read
/// with a limit takes, and how many times EINTR / EBUSY were retried.
struct Attempt {
    n: u32,
    cap: Option<u32>,
    retries: u32,
}

/// What a walk does after a failed batch call.
enum AfterError {
    /// Call again (with a larger batch after ENOSPC, or after a pause).
    Retry,
    /// The map ended: take what was copied.
    End,
    /// Take what was copied and go on.
    Keep,
    /// Step over a key that cannot be read, one key at a time.
    StepOver,
    /// Stop the read with this result.
    Stop(Result<Option<Chunk>, WalkError>),
}

/// Pauses before a retry: not at all for the first few, then longer.
pub(crate) fn backoff(attempt: u32) {
    if attempt > 4 {
        thread::sleep(Duration::from_micros(50 << attempt.min(10)));
    }
}

/// Retries a call on EINTR / EAGAIN / EBUSY.
fn retry(mut f: impl FnMut() -> Result<(), SyscallError>) -> Result<(), SyscallError> {
    let mut attempt = 0;
    loop {
        match f() {
            Err(e)
                if matches!(
                    e.errno(),
                    Some(libc::EINTR) | Some(libc::EAGAIN) | Some(libc::EBUSY)
                ) && attempt < MAX_RETRIES =>
            {
                attempt += 1;
                backoff(attempt);
            }
            other => return other,
        }
    }
}

#[cfg(test)]
mod tests {
    //! Error paths through a scripted fake of the syscall layer. The happy
    //! paths are tested against real kernel maps in the `tests` crate.
    use std::cell::RefCell;

    use super::*;
    use crate::ENOTSUPP;

    use crate::fake::{ScriptedMap as Fake, err};

    fn hash_meta() -> MapMeta {
        MapMeta {
            id: 7,
            name: "t".into(),
            map_type: MapType::HASH,
            key_size: 4,
            value_size: 4,
            max_entries: 64,
            flags: 0,
            btf_id: 0,
            btf_key_type_id: 0,
            btf_value_type_id: 0,
            possible_cpus: 2,
        }
    }

    fn keys_of(c: &Chunk) -> Vec<u32> {
        c.keys
            .chunks(4)
            .map(|k| u32::from_le_bytes(k.try_into().unwrap()))
            .collect()
    }

    #[test]
    fn enospc_grows_the_batch_and_retries_from_the_same_token() {
        let fake = Fake::default();
        fake.push(&[], 3, Err(libc::ENOSPC));
        fake.push(&[], 3, Err(libc::ENOSPC));
        fake.push(&[(1, 10), (2, 20), (3, 30)], 4, Ok(()));
        fake.push(&[(4, 40)], 0, Err(libc::ENOENT));
        let mut w = Walker::new(
            &fake,
            hash_meta(),
            Position::After(3u32.to_le_bytes().into()),
        )
        .unwrap();
        let c = w.next_chunk(1).unwrap().unwrap();
        assert_eq!(keys_of(&c), [1, 2, 3]);
        assert_eq!(w.position(), &Position::After(4u32.to_le_bytes().into()));
        let c = w.next_chunk(1).unwrap().unwrap();
        assert_eq!(keys_of(&c), [4]);
        assert_eq!(w.position(), &Position::End);
        assert!(w.next_chunk(1).unwrap().is_none());
        let calls = fake.calls();
        let token = Some(3u32.to_le_bytes().to_vec());
        // Same token each time, with count 1, 2, 3; then back to the hint.
        assert_eq!(
            calls[..3],
            [(token.clone(), 1), (token.clone(), 2), (token, 3)]
        );
        assert_eq!(calls[3], (Some(4u32.to_le_bytes().to_vec()), 1));
    }

    #[test]
    fn strict_reads_stop_before_a_bucket_that_does_not_fit() {
        let fake = Fake::default();
        fake.push(&[], 0, Err(libc::ENOSPC));
        let start = Position::After(2u32.to_le_bytes().into());
        let mut w = Walker::new(&fake, hash_meta(), start.clone()).unwrap();
        let c = w.next_chunk_capped(1, 1).unwrap().unwrap();
        assert_eq!(c.count, 0);
        assert_eq!(w.position(), &start, "position unchanged");
        assert_eq!(fake.calls().len(), 1, "no retry with a larger batch");
    }

    #[test]
    fn enospc_forever_is_an_error_not_a_loop() {
        let fake = Fake::default();
        // One more at a time up to 64, then doubling to the ceiling.
        for _ in 0..(64 - 8) + 16 {
            fake.push(&[], 0, Err(libc::ENOSPC));
        }
        let mut w = Walker::new(&fake, hash_meta(), Position::Start).unwrap();
        let e = w.next_chunk(8).unwrap_err();
        assert!(
            matches!(e, WalkError::BucketTooLarge { tried } if tried >= 64),
            "{e:?}"
        );
    }

    #[test]
    fn eintr_and_ebusy_are_retried() {
        let fake = Fake::default();
        fake.push(&[], 0, Err(libc::EINTR));
        fake.push(&[], 0, Err(libc::EBUSY));
        fake.push(&[(9, 90)], 0, Err(libc::ENOENT));
        let mut w = Walker::new(&fake, hash_meta(), Position::Start).unwrap();
        let c = w.next_chunk(8).unwrap().unwrap();
        assert_eq!(keys_of(&c), [9]);
        assert_eq!(
            c.values,
            90u32.to_le_bytes().to_vec(),
            "value copied with its key"
        );
        assert_eq!(w.position(), &Position::End);
        assert_eq!(fake.calls().len(), 3);
    }

    #[test]
    fn enoent_with_a_count_delivers_the_last_entries() {
        let fake = Fake::default();
        fake.push(&[(5, 50), (6, 60)], 0, Err(libc::ENOENT));
        let mut w = Walker::new(&fake, hash_meta(), Position::Start).unwrap();
        let c = w.next_chunk(8).unwrap().unwrap();
        assert_eq!(keys_of(&c), [5, 6]);
        assert!(w.next_chunk(8).unwrap().is_none());
    }

    #[test]
    fn unexpected_errno_is_reported_with_the_call() {
        let fake = Fake::default();
        fake.push(&[], 0, Err(libc::EFAULT));
        let mut w = Walker::new(&fake, hash_meta(), Position::Start).unwrap();
        match w.next_chunk(8).unwrap_err() {
            WalkError::Syscall(e) => assert_eq!(e.errno(), Some(libc::EFAULT)),
            other => panic!("expected a syscall error, got {other:?}"),
        }
        // The position did not move: a retry would read the same entries.
        assert_eq!(w.position(), &Position::Start);
    }

    #[test]
    fn enotsupp_means_not_iterable() {
        let fake = Fake::default();
        fake.push(&[], 0, Err(ENOTSUPP));
        let mut w = Walker::new(&fake, hash_meta(), Position::Start).unwrap();
        assert!(matches!(
            w.next_chunk(8).unwrap_err(),
            WalkError::NotIterable(MapType::HASH)
        ));
    }

    #[test]
    fn non_iterable_types_and_bad_tokens_are_refused_up_front() {
        let fake = Fake::default();
        let mut meta = hash_meta();
        meta.map_type = MapType::QUEUE;
        assert!(matches!(
            Walker::new(&fake, meta, Position::Start),
            Err(WalkError::NotIterable(MapType::QUEUE))
        ));
        assert!(matches!(
            Walker::new(&fake, hash_meta(), Position::After(vec![1, 2])),
            Err(WalkError::BadToken)
        ));
    }

    /// An lpm_trie key: prefix length and 4 bytes of address.
    fn tkey(len: u32, addr: [u8; 4]) -> Vec<u8> {
        let mut k = len.to_ne_bytes().to_vec();
        k.extend_from_slice(&addr);
        k
    }

    #[test]
    fn trie_order_is_the_kernels_postorder() {
        // The example in kernel/bpf/lpm_trie.c, in the order get_next_key
        // returns it.
        let walk = [
            tkey(24, [192, 168, 0, 0]),
            tkey(24, [192, 168, 1, 0]),
            tkey(24, [192, 168, 128, 0]),
            tkey(16, [192, 168, 0, 0]),
        ];
        for w in walk.windows(2) {
            assert_eq!(trie_order(&w[0], &w[1]), Ordering::Less, "{w:?}");
            assert_eq!(trie_order(&w[1], &w[0]), Ordering::Greater, "{w:?}");
        }
        let k = tkey(8, [10, 0, 0, 0]);
        assert_eq!(trie_order(&k, &k), Ordering::Equal);
        // Bits beyond the prefix length do not count.
        assert_eq!(
            trie_order(&tkey(8, [10, 0, 0, 0]), &tkey(8, [10, 9, 9, 9])),
            Ordering::Equal
        );
        assert_eq!(
            trie_order(&tkey(0, [0; 4]), &tkey(1, [0; 4])),
            Ordering::Greater,
            "the default route comes last"
        );
    }

    /// An in-memory lpm_trie with the kernel's get_next_key semantics (a
    /// missing key restarts from the first key), and a churn hook that
    /// deletes the key just returned every `every` steps and puts back a key
    /// deleted earlier.
    struct FakeTrie {
        keys: RefCell<Vec<Vec<u8>>>,
        churn: RefCell<Vec<Vec<u8>>>,
        stable: Vec<Vec<u8>>,
        steps: RefCell<u64>,
        every: u64,
        order: KeyOrder,
        /// Churn on get_next_key too (key-by-key walks).
        churn_on_next: bool,
    }

    impl FakeTrie {
        fn new(stable: Vec<Vec<u8>>, churning: Vec<Vec<u8>>, every: u64) -> Self {
            Self::ordered(trie_order, stable, churning, every)
        }

        fn ordered(
            order: KeyOrder,
            stable: Vec<Vec<u8>>,
            churning: Vec<Vec<u8>>,
            every: u64,
        ) -> Self {
            let mut keys: Vec<Vec<u8>> = stable.iter().chain(&churning).cloned().collect();
            keys.sort_by(|a, b| order(a, b));
            Self {
                keys: RefCell::new(keys),
                churn: RefCell::new(churning),
                stable,
                steps: RefCell::new(0),
                every,
                order,
                churn_on_next: false,
            }
        }

        fn succ(&self, key: Option<&[u8]>) -> Option<Vec<u8>> {
            let keys = self.keys.borrow();
            match key {
                Some(k) if keys.iter().any(|x| x == k) => keys
                    .iter()
                    .find(|x| (self.order)(x, k) == Ordering::Greater)
                    .cloned(),
                // Missing (or no key): the first key.
                _ => keys.first().cloned(),
            }
        }

        /// After a step returned `key`: maybe delete it (when it churns) and
        /// put back an earlier victim.
        fn step(&self, key: &[u8]) {
            let mut steps = self.steps.borrow_mut();
            *steps += 1;
            if self.every == 0
                || !steps.is_multiple_of(self.every)
                || self.stable.iter().any(|s| s == key)
            {
                return;
            }
            let mut keys = self.keys.borrow_mut();
            keys.retain(|x| x != key);
            let mut churn = self.churn.borrow_mut();
            churn.retain(|x| x != key);
            if let Some(back) = churn.first().cloned()
                && !keys.contains(&back)
            {
                keys.push(back);
                keys.sort_by(|a, b| (self.order)(a, b));
            }
            churn.push(key.to_vec());
        }
    }

    impl MapOps for &FakeTrie {
        fn lookup_batch(
            &self,
            in_batch: Option<&[u8]>,
            out_batch: &mut [u8],
            keys: &mut [u8],
            values: &mut [u8],
            count: &mut u32,
        ) -> SysResult<()> {
            let mut prev = in_batch.map(<[u8]>::to_vec);
            let want = *count as usize;
            for i in 0..want {
                let Some(next) = self.succ(prev.as_deref()) else {
                    *count = i as u32;
                    return Err(err(libc::ENOENT));
                };
                keys[i * 8..(i + 1) * 8].copy_from_slice(&next);
                values[i * 8..(i + 1) * 8].copy_from_slice(&next);
                out_batch[..8].copy_from_slice(&next);
                self.step(&next);
                prev = Some(next);
            }
            Ok(())
        }

        fn get_next_key(&self, key: Option<&[u8]>, next: &mut [u8]) -> SysResult<()> {
            match self.succ(key) {
                Some(k) => {
                    next.copy_from_slice(&k);
                    if self.churn_on_next && key.is_some() {
                        self.step(&k);
                    }
                    Ok(())
                }
                None => Err(err(libc::ENOENT)),
            }
        }

        fn lookup(&self, key: &[u8], value: &mut [u8]) -> SysResult<()> {
            if self.keys.borrow().iter().any(|k| k == key) {
                value.copy_from_slice(key);
                Ok(())
            } else {
                Err(err(libc::ENOENT))
            }
        }
    }

    fn trie_meta() -> MapMeta {
        MapMeta {
            map_type: MapType::LPM_TRIE,
            key_size: 8,
            value_size: 8,
            max_entries: 4096,
            ..hash_meta()
        }
    }

    /// Walks to the end in chunks of `chunk`, resuming through a fresh
    /// walker from the position every `resume_every` chunks.
    fn walk_trie(trie: &FakeTrie, chunk: u32, resume_every: usize) -> (Vec<Vec<u8>>, u64) {
        let mut got = Vec::new();
        let mut restarts = 0;
        let mut w = Walker::new(trie, trie_meta(), Position::Start).unwrap();
        let mut chunks = 0;
        while let Some(c) = w.next_chunk(chunk).unwrap() {
            got.extend(c.keys.chunks(8).map(<[u8]>::to_vec));
            chunks += 1;
            if resume_every > 0 && chunks % resume_every == 0 {
                restarts += w.stats().restarts;
                let pos = w.position().clone();
                if pos == Position::End {
                    break;
                }
                w = Walker::new(trie, trie_meta(), pos).unwrap();
            }
        }
        (got, restarts + w.stats().restarts)
    }

    #[test]
    fn a_trie_walk_under_churn_delivers_each_stable_key_exactly_once() {
        let stable: Vec<_> = (0..120u8).map(|i| tkey(24, [10, i, 0, 0])).collect();
        let churning: Vec<_> = (0..120u8).map(|i| tkey(32, [10, i, 0, 1])).collect();
        for (chunk, every, resume_every) in
            [(1, 3, 0), (7, 5, 0), (64, 11, 0), (5, 5, 3), (1, 3, 1)]
        {
            let trie = FakeTrie::new(stable.clone(), churning.clone(), every);
            let (got, restarts) = walk_trie(&trie, chunk, resume_every);
            let mut seen = std::collections::HashSet::new();
            for k in &got {
                assert!(
                    seen.insert(k.clone()),
                    "chunk {chunk}: {k:?} delivered twice"
                );
            }
            for k in &stable {
                assert!(seen.contains(k), "chunk {chunk}: stable key {k:?} missing");
            }
            assert!(
                got.windows(2)
                    .all(|w| trie_order(&w[0], &w[1]) == Ordering::Less),
                "delivered in the kernel's order"
            );
            assert!(
                restarts > 0,
                "chunk {chunk}: the churn should force restarts"
            );
        }
    }

    #[test]
    fn a_trie_resumed_after_a_deleted_key_skips_what_was_delivered() {
        let keys: Vec<_> = (0..50u8).map(|i| tkey(24, [10, i, 0, 0])).collect();
        let trie = FakeTrie::new(keys.clone(), Vec::new(), 0);
        let mut w = Walker::new(&trie, trie_meta(), Position::Start).unwrap();
        let first = w.next_chunk(20).unwrap().unwrap();
        assert_eq!(first.count, 20);
        let pos = w.position().clone();
        // The last key delivered goes away before the dump resumes.
        trie.keys.borrow_mut().retain(|k| *k != keys[19]);
        let mut w = Walker::new(&trie, trie_meta(), pos).unwrap();
        let mut rest = Vec::new();
        while let Some(c) = w.next_chunk(8).unwrap() {
            rest.extend(c.keys.chunks(8).map(<[u8]>::to_vec));
        }
        assert_eq!(rest, keys[20..], "exactly the keys after the cursor");
        assert_eq!(w.stats().restarts, 1);
        assert_eq!(
            w.stats().skipped,
            19,
            "the restart re-read what was delivered"
        );
    }

    fn id_key(id: u32) -> Vec<u8> {
        let mut k = id.to_ne_bytes().to_vec();
        k.extend_from_slice(&[0; 4]);
        k
    }

    #[test]
    fn a_stack_trace_walk_under_churn_delivers_each_stable_id_exactly_once() {
        let meta = MapMeta {
            map_type: MapType::STACK_TRACE, // key by key, ids ascending
            ..trie_meta()
        };
        assert_eq!(meta.walk_method(), WalkMethod::KeyByKey);
        let stable: Vec<_> = (0..100u32).map(|i| id_key(2 * i)).collect();
        let churning: Vec<_> = (0..100u32).map(|i| id_key(2 * i + 1)).collect();
        let mut trie = FakeTrie::ordered(id_order, stable.clone(), churning, 3);
        trie.churn_on_next = true;
        let mut w = Walker::new(&trie, meta, Position::Start).unwrap();
        let mut got = Vec::new();
        while let Some(c) = w.next_chunk(16).unwrap() {
            got.extend(c.keys.chunks(8).map(<[u8]>::to_vec));
        }
        let mut seen = std::collections::HashSet::new();
        for k in &got {
            assert!(seen.insert(k.clone()), "{k:?} delivered twice");
        }
        for k in &stable {
            assert!(seen.contains(k), "stable id {k:?} missing");
        }
        assert!(w.stats().restarts > 0, "the churn should force restarts");
    }

    #[test]
    fn a_cgroup_storage_walk_whose_key_went_away_is_aborted_not_ended() {
        let meta = MapMeta {
            map_type: MapType::CGROUP_STORAGE,
            ..trie_meta()
        };
        // A fake whose get_next_key answers ENOENT after a missing key, as
        // cgroup_storage does.
        struct Ends(RefCell<Vec<Vec<u8>>>);
        impl MapOps for &Ends {
            fn lookup_batch(
                &self,
                _: Option<&[u8]>,
                _: &mut [u8],
                _: &mut [u8],
                _: &mut [u8],
                _: &mut u32,
            ) -> SysResult<()> {
                unreachable!("walked key by key")
            }
            fn get_next_key(&self, key: Option<&[u8]>, next: &mut [u8]) -> SysResult<()> {
                let keys = self.0.borrow();
                let at = match key {
                    None => 0,
                    Some(k) => match keys.iter().position(|x| x == k) {
                        Some(i) => i + 1,
                        None => return Err(err(libc::ENOENT)),
                    },
                };
                match keys.get(at) {
                    Some(k) => {
                        next.copy_from_slice(k);
                        Ok(())
                    }
                    None => Err(err(libc::ENOENT)),
                }
            }
            fn lookup(&self, key: &[u8], value: &mut [u8]) -> SysResult<()> {
                if self.0.borrow().iter().any(|k| k == key) {
                    value.copy_from_slice(key);
                    Ok(())
                } else {
                    Err(err(libc::ENOENT))
                }
            }
        }
        let fake = Ends(RefCell::new((0..10u32).map(id_key).collect()));
        let mut w = Walker::new(&fake, meta.clone(), Position::Start).unwrap();
        let first = w.next_chunk(4).unwrap().unwrap();
        assert_eq!(first.count, 4);
        let pos = w.position().clone();
        // The key the walk stands on goes away.
        fake.0.borrow_mut().retain(|k| *k != id_key(3));
        let mut w = Walker::new(&fake, meta.clone(), pos).unwrap();
        assert!(matches!(w.next_chunk(4), Err(WalkError::ResumeKeyDeleted)));
        // Walking to a real end still ends.
        let mut w = Walker::new(&fake, meta, Position::Start).unwrap();
        let mut n = 0;
        while let Some(c) = w.next_chunk(4).unwrap() {
            n += c.count;
        }
        assert_eq!(n, 9);
    }
}
