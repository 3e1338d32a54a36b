//! Walks a map chunk by chunk, from any position a cursor can name.
//!
//! Batch reads follow the kernel's contract (see `BPF_MAP_LOOKUP_BATCH` in
//! the README): ENOENT ends the walk and its count is valid, ENOSPC means the
//! next hash bucket does not fit and is retried with a larger batch from the
//! same token, EINTR and EBUSY are retried.

use std::{thread, time::Duration};

use super::{MapMeta, MapOps, MapType, Method, SyscallError, batch_unsupported, elem_unsupported};

/// Where a walk stands.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Position {
    /// Nothing read yet.
    Start,
    /// Continue after this token: a bucket index (4 bytes) for hash-family
    /// maps, the last key returned otherwise.
    After(Vec<u8>),
    /// The walk reached the end of the map.
    End,
}

/// Entries in the kernel's layout: `count` keys of `key_size` bytes, and
/// `count` values of the kernel element size (per-CPU values padded to 8
/// bytes per CPU).
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Chunk {
    pub count: usize,
    pub keys: Vec<u8>,
    pub values: Vec<u8>,
}

#[derive(Debug, thiserror::Error)]
pub enum WalkError {
    /// The type cannot be iterated, or the kernel refused the operation for
    /// this type.
    #[error("maps of type {0} cannot be iterated from user space")]
    NotIterable(MapType),
    /// The key a resumed walk continues after was deleted; the kernel would
    /// silently restart from the first key.
    #[error("the last key delivered before this cursor was deleted from the map; restart the dump")]
    ResumeKeyDeleted,
    /// A cursor token that does not fit this map.
    #[error("cursor position does not fit this map")]
    BadToken,
    /// A hash bucket larger than the map could ever hold.
    #[error("the kernel kept answering ENOSPC up to a batch of {tried} entries")]
    BucketTooLarge { tried: u32 },
    #[error(transparent)]
    Syscall(#[from] SyscallError),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Fit {
    /// Grow the batch until the next bucket fits.
    Grow,
    /// Never return more than asked for.
    Strict,
}

/// How many times EINTR / EBUSY are retried before giving up.
const MAX_RETRIES: u32 = 32;

#[derive(Debug)]
pub struct Walker<O> {
    ops: O,
    meta: MapMeta,
    method: Method,
    pos: Position,
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
}

impl<O: MapOps> Walker<O> {
    /// A walk of `meta`'s map from `pos`. The position must come from a
    /// cursor of the same map (the caller checks the binding).
    pub fn new(ops: O, meta: MapMeta, pos: Position) -> Result<Self, WalkError> {
        let method = meta.method();
        if method == Method::None {
            return Err(WalkError::NotIterable(meta.map_type));
        }
        if let Position::After(token) = &pos {
            let expected = match method {
                Method::BatchBucket => 4,
                _ => meta.key_size as usize,
            };
            if token.len() != expected {
                return Err(WalkError::BadToken);
            }
        }
        Ok(Self {
            ops,
            meta,
            method,
            pos,
            min_batch: 1,
            stats: WalkStats::default(),
        })
    }

    pub fn position(&self) -> &Position {
        &self.pos
    }

    pub fn meta(&self) -> &MapMeta {
        &self.meta
    }

    pub fn stats(&self) -> WalkStats {
        self.stats
    }

    /// Reads up to about `max` entries (a hash bucket is never split, so a
    /// little more when one bucket is larger). `Ok(None)` once the walk is at
    /// the end; a final chunk may also arrive together with the end.
    pub fn next_chunk(&mut self, max: u32) -> Result<Option<Chunk>, WalkError> {
        self.read(max, Fit::Grow)
    }

    /// Like [`Walker::next_chunk`], but never returns more than `max`
    /// entries: when the next hash bucket holds more, returns an empty chunk
    /// and leaves the position where it was.
    pub fn next_chunk_at_most(&mut self, max: u32) -> Result<Option<Chunk>, WalkError> {
        self.read(max, Fit::Strict)
    }

    fn read(&mut self, max: u32, fit: Fit) -> Result<Option<Chunk>, WalkError> {
        let max = max.max(1);
        loop {
            let chunk = match self.pos {
                Position::End => return Ok(None),
                _ => match self.method {
                    Method::BatchBucket | Method::BatchKey => match self.batch(max, fit)? {
                        Some(c) => c,
                        None => return Ok(Some(Chunk::default())),
                    },
                    Method::KeyByKey => self.key_by_key(max)?,
                    Method::None => unreachable!("rejected in new()"),
                },
            };
            if chunk.count > 0 || self.pos == Position::End {
                return Ok(Some(chunk).filter(|c| c.count > 0));
            }
        }
    }

    fn key_token(&self) -> bool {
        self.method != Method::BatchBucket
    }

    /// For types whose get_next_key restarts on a missing key: refuses to
    /// continue after a key that was deleted.
    fn check_resume_key(&self) -> Result<(), WalkError> {
        let Position::After(last) = &self.pos else {
            return Ok(());
        };
        if !self.key_token() || !self.meta.map_type.restarts_on_missing_key() {
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

    /// `None` when `fit` is strict and the next bucket holds more than `max`.
    fn batch(&mut self, max: u32, fit: Fit) -> Result<Option<Chunk>, WalkError> {
        self.check_resume_key()?;
        let ks = self.meta.key_size as usize;
        let vs = self.meta.kernel_value_size();
        let token_len = if self.key_token() { ks } else { 4 };
        let mut want = max.max(self.min_batch);
        let mut retries = 0;
        loop {
            let in_batch = match &self.pos {
                Position::After(t) => Some(t.as_slice()),
                _ => None,
            };
            let mut out_batch = vec![0u8; token_len.max(4)];
            let mut keys = vec![0u8; ks * want as usize];
            let mut values = vec![0u8; vs * want as usize];
            let mut count = want;
            self.stats.syscalls += 1;
            let res =
                self.ops
                    .lookup_batch(in_batch, &mut out_batch, &mut keys, &mut values, &mut count);
            let count = count.min(want) as usize;
            let end = match res {
                Ok(()) => false,
                Err(e) => match e.errno() {
                    Some(libc::ENOENT) => true,
                    Some(libc::ENOSPC) if count == 0 => {
                        // The next bucket holds more than `want` entries.
                        if fit == Fit::Strict {
                            return Ok(None);
                        }
                        let limit = self.meta.max_entries.saturating_add(1024).max(2);
                        if want >= limit {
                            return Err(WalkError::BucketTooLarge { tried: want });
                        }
                        want = want.saturating_mul(2).min(limit);
                        self.stats.enospc += 1;
                        self.min_batch = want;
                        continue;
                    }
                    // The generic path answers EINTR when a key from
                    // get_next_key cannot be looked up three times in a row
                    // (deleted meanwhile, or an empty slot of an
                    // array_of_maps). What it copied before is valid; the
                    // missing key is stepped over one key at a time.
                    Some(libc::EINTR) if self.key_token() && count > 0 => false,
                    Some(libc::EINTR) if self.key_token() => {
                        return self.key_by_key(1).map(Some);
                    }
                    Some(libc::EINTR) | Some(libc::EAGAIN) | Some(libc::EBUSY)
                        if retries < MAX_RETRIES =>
                    {
                        retries += 1;
                        backoff(retries);
                        continue;
                    }
                    errno if batch_unsupported(errno) => {
                        return Err(WalkError::NotIterable(self.meta.map_type));
                    }
                    _ => return Err(e.into()),
                },
            };
            keys.truncate(ks * count);
            values.truncate(vs * count);
            self.pos = if end {
                Position::End
            } else if self.key_token() {
                if count == 0 {
                    // The generic path reports success only with entries.
                    return Err(WalkError::BadToken);
                }
                Position::After(keys[ks * (count - 1)..].to_vec())
            } else {
                out_batch.truncate(4);
                if count == 0 && Some(out_batch.as_slice()) == in_batch {
                    // No progress and no entries: the token is out of range.
                    return Err(WalkError::BadToken);
                }
                Position::After(out_batch)
            };
            // A bucket that fit once is likely to fit again: shrink back.
            self.min_batch = 1;
            return Ok(Some(Chunk {
                count,
                keys,
                values,
            }));
        }
    }

    fn key_by_key(&mut self, max: u32) -> Result<Chunk, WalkError> {
        self.check_resume_key()?;
        let ks = self.meta.key_size as usize;
        let vs = self.meta.kernel_value_size();
        let mut chunk = Chunk::default();
        let mut next = vec![0u8; ks];
        let mut value = vec![0u8; vs];
        let mut examined = 0;
        while examined < max {
            let prev = match &self.pos {
                Position::After(k) => Some(k.as_slice()),
                Position::Start => None,
                Position::End => break,
            };
            match retry(|| self.ops.get_next_key(prev, &mut next)) {
                Ok(()) => {}
                Err(e) if e.errno() == Some(libc::ENOENT) => {
                    self.pos = Position::End;
                    break;
                }
                Err(e) => return Err(self.not_iterable_or(e)),
            }
            examined += 1;
            match retry(|| self.ops.lookup(&next, &mut value)) {
                Ok(()) => {
                    chunk.keys.extend_from_slice(&next);
                    chunk.values.extend_from_slice(&value);
                    chunk.count += 1;
                }
                // Deleted since get_next_key, or an empty slot.
                Err(e) if e.errno() == Some(libc::ENOENT) => {}
                Err(e) => return Err(self.not_iterable_or(e)),
            }
            self.pos = Position::After(next.clone());
        }
        Ok(chunk)
    }

    fn not_iterable_or(&self, e: SyscallError) -> WalkError {
        if elem_unsupported(e.errno()) {
            WalkError::NotIterable(self.meta.map_type)
        } else {
            e.into()
        }
    }
}

fn backoff(attempt: u32) {
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
    use std::{cell::RefCell, collections::VecDeque, io};

    use super::*;
    use crate::kernel::{ENOTSUPP, SysResult};

    fn err(errno: i32) -> SyscallError {
        SyscallError {
            call: "fake",
            io_error: io::Error::from_raw_os_error(errno),
        }
    }

    /// One scripted batch answer: entries (u32 key, u32 value) to copy if they
    /// fit, the next bucket token, and the result.
    struct Answer {
        entries: Vec<(u32, u32)>,
        next: u32,
        result: Result<(), i32>,
    }

    #[derive(Default)]
    struct Fake {
        answers: RefCell<VecDeque<Answer>>,
        calls: RefCell<Vec<(Option<Vec<u8>>, u32)>>,
    }

    impl Fake {
        fn push(&self, entries: &[(u32, u32)], next: u32, result: Result<(), i32>) {
            self.answers.borrow_mut().push_back(Answer {
                entries: entries.to_vec(),
                next,
                result,
            });
        }
    }

    impl MapOps for &Fake {
        fn lookup_batch(
            &self,
            in_batch: Option<&[u8]>,
            out_batch: &mut [u8],
            keys: &mut [u8],
            values: &mut [u8],
            count: &mut u32,
        ) -> SysResult<()> {
            self.calls
                .borrow_mut()
                .push((in_batch.map(<[u8]>::to_vec), *count));
            let a = self
                .answers
                .borrow_mut()
                .pop_front()
                .expect("unexpected extra lookup_batch call");
            if a.result == Err(libc::ENOSPC) {
                *count = 0;
                return Err(err(libc::ENOSPC));
            }
            assert!(a.entries.len() as u32 <= *count, "script copies too much");
            for (i, (k, v)) in a.entries.iter().enumerate() {
                keys[i * 4..i * 4 + 4].copy_from_slice(&k.to_le_bytes());
                values[i * 4..i * 4 + 4].copy_from_slice(&v.to_le_bytes());
            }
            *count = a.entries.len() as u32;
            out_batch[..4].copy_from_slice(&a.next.to_le_bytes());
            a.result.map_err(err)
        }

        fn get_next_key(&self, _key: Option<&[u8]>, _next: &mut [u8]) -> SysResult<()> {
            Err(err(libc::ENOENT))
        }

        fn lookup(&self, _key: &[u8], _value: &mut [u8]) -> SysResult<()> {
            Err(err(libc::ENOENT))
        }
    }

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
        let calls = fake.calls.borrow();
        let token = Some(3u32.to_le_bytes().to_vec());
        // Same token each time, with count 1, 2, 4; then back to the hint.
        assert_eq!(
            calls[..3],
            [(token.clone(), 1), (token.clone(), 2), (token, 4)]
        );
        assert_eq!(calls[3], (Some(4u32.to_le_bytes().to_vec()), 1));
    }

    #[test]
    fn strict_reads_stop_before_a_bucket_that_does_not_fit() {
        let fake = Fake::default();
        fake.push(&[], 0, Err(libc::ENOSPC));
        let start = Position::After(2u32.to_le_bytes().into());
        let mut w = Walker::new(&fake, hash_meta(), start.clone()).unwrap();
        let c = w.next_chunk_at_most(1).unwrap().unwrap();
        assert_eq!(c.count, 0);
        assert_eq!(w.position(), &start, "position unchanged");
        assert_eq!(fake.calls.borrow().len(), 1, "no retry with a larger batch");
    }

    #[test]
    fn enospc_forever_is_an_error_not_a_loop() {
        let fake = Fake::default();
        for _ in 0..16 {
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
        assert_eq!(fake.calls.borrow().len(), 3);
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
}
