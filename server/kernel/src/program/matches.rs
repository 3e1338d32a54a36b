//! The entries a walk inside the kernel took, in an order of their keys,
//! read as a map: a dump walks them with the same
//! [`Walker`](crate::walk::Walker) and the same cursors (the last key
//! delivered) as a map read in batches.

use std::cmp::Ordering;

use crate::{MapOps, sys::SyscallError, walk::Chunk};

/// An order of keys.
pub type KeyOrder = fn(&[u8], &[u8]) -> Ordering;

/// The order of an array's keys: their index.
pub fn index_order(a: &[u8], b: &[u8]) -> Ordering {
    let index = |k: &[u8]| k.try_into().map_or(0, u32::from_ne_bytes);
    index(a).cmp(&index(b))
}

/// The order of keys as bytes.
pub fn byte_order(a: &[u8], b: &[u8]) -> Ordering {
    a.cmp(b)
}

/// Entries sorted by their keys.
#[derive(Debug, Clone)]
pub struct Matches {
    chunk: Chunk,
    key_size: usize,
    value_size: usize,
    order: KeyOrder,
}

impl Matches {
    /// The entries of `chunk` (keys of `key_size` bytes, values of
    /// `value_size`), sorted by `order`.
    pub fn new(chunk: Chunk, key_size: usize, value_size: usize, order: KeyOrder) -> Self {
        let (ks, vs) = (key_size.max(1), value_size);
        let mut at: Vec<usize> = (0..chunk.count).collect();
        at.sort_unstable_by(|&a, &b| {
            order(
                &chunk.keys[a * ks..(a + 1) * ks],
                &chunk.keys[b * ks..(b + 1) * ks],
            )
        });
        let mut sorted = Chunk {
            count: chunk.count,
            keys: Vec::with_capacity(chunk.keys.len()),
            values: Vec::with_capacity(chunk.values.len()),
        };
        for i in at {
            sorted
                .keys
                .extend_from_slice(&chunk.keys[i * ks..(i + 1) * ks]);
            sorted
                .values
                .extend_from_slice(&chunk.values[i * vs..(i + 1) * vs]);
        }
        Self {
            chunk: sorted,
            key_size: ks,
            value_size: vs,
            order,
        }
    }

    /// How many entries there are.
    pub fn len(&self) -> usize {
        self.chunk.count
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.chunk.count == 0
    }

    /// Bytes their keys and values hold.
    pub fn bytes(&self) -> usize {
        self.chunk.keys.len() + self.chunk.values.len()
    }

    fn key(&self, i: usize) -> &[u8] {
        &self.chunk.keys[i * self.key_size..(i + 1) * self.key_size]
    }

    /// The index of the first entry whose key comes after `key` (the first
    /// entry for `None`).
    fn after(&self, key: Option<&[u8]>) -> usize {
        match key {
            None => 0,
            Some(k) => self.first(|key| (self.order)(key, k).is_gt()),
        }
    }

    /// The index of the first entry whose key is `past` (false for some
    /// first entries, true for all the others).
    fn first(&self, past: impl Fn(&[u8]) -> bool) -> usize {
        let (mut lo, mut hi) = (0, self.len());
        while lo < hi {
            let mid = lo + (hi - lo) / 2;
            if past(self.key(mid)) {
                hi = mid;
            } else {
                lo = mid + 1;
            }
        }
        lo
    }

    fn not_found(call: &'static str) -> SyscallError {
        SyscallError {
            call,
            io_error: std::io::Error::from_raw_os_error(libc::ENOENT),
        }
    }
}

impl MapOps for Matches {
    /// As the kernel's generic batch: the token is the last key copied,
    /// and ENOENT says the entries ended (with what was copied before).
    fn lookup_batch(
        &self,
        in_batch: Option<&[u8]>,
        out_batch: &mut [u8],
        keys: &mut [u8],
        values: &mut [u8],
        count: &mut u32,
    ) -> Result<(), SyscallError> {
        let (ks, vs) = (self.key_size, self.value_size);
        let from = self.after(in_batch);
        let room = (*count as usize)
            .min(keys.len() / ks)
            .min(values.len().checked_div(vs).unwrap_or(usize::MAX));
        let n = room.min(self.len() - from);
        keys[..n * ks].copy_from_slice(&self.chunk.keys[from * ks..(from + n) * ks]);
        values[..n * vs].copy_from_slice(&self.chunk.values[from * vs..(from + n) * vs]);
        *count = n as u32;
        if n > 0 {
            let last = self.key(from + n - 1);
            let len = out_batch.len().min(ks);
            out_batch[..len].copy_from_slice(&last[..len]);
        }
        if from + n == self.len() {
            return Err(Self::not_found("BPF_MAP_LOOKUP_BATCH"));
        }
        Ok(())
    }

    fn get_next_key(&self, key: Option<&[u8]>, next: &mut [u8]) -> Result<(), SyscallError> {
        let i = self.after(key);
        if i == self.len() {
            return Err(Self::not_found("BPF_MAP_GET_NEXT_KEY"));
        }
        next.copy_from_slice(self.key(i));
        Ok(())
    }

    fn lookup(&self, key: &[u8], value: &mut [u8]) -> Result<(), SyscallError> {
        let i = self.first(|k| (self.order)(k, key).is_ge());
        if i == self.len() || (self.order)(self.key(i), key).is_ne() {
            return Err(Self::not_found("BPF_MAP_LOOKUP_ELEM"));
        }
        let vs = self.value_size;
        value.copy_from_slice(&self.chunk.values[i * vs..(i + 1) * vs]);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{
        MapMeta,
        walk::{Position, Walker},
    };

    fn matches(keys: &[u32]) -> Matches {
        let chunk = Chunk {
            count: keys.len(),
            keys: keys.iter().flat_map(|k| k.to_ne_bytes()).collect(),
            values: keys
                .iter()
                .flat_map(|k| (u64::from(*k) * 10).to_ne_bytes())
                .collect(),
        };
        Matches::new(chunk, 4, 8, index_order)
    }

    fn meta() -> MapMeta {
        MapMeta {
            value_size: 8,
            ..crate::fake::meta()
        }
    }

    fn keys(c: &Chunk) -> Vec<u32> {
        c.keys
            .chunks(4)
            .map(|k| u32::from_ne_bytes(k.try_into().unwrap()))
            .collect()
    }

    #[test]
    fn a_walk_reads_them_in_order_and_resumes_after_the_last_key() {
        let m = matches(&[300, 7, 256, 1, 90]);
        let mut w = Walker::by_key(&m, meta(), Position::Start).unwrap();
        let c = w.next_chunk(2).unwrap().unwrap();
        assert_eq!(keys(&c), [1, 7]);
        assert_eq!(c.values[8..16], 70u64.to_ne_bytes());
        assert_eq!(*w.position(), Position::After(7u32.to_ne_bytes().to_vec()));
        // A cursor at 7 resumes at 90, whatever follows 7 now.
        let mut again = Walker::by_key(&m, meta(), w.position().clone()).unwrap();
        let rest = again.next_chunk(10).unwrap().unwrap();
        assert_eq!(keys(&rest), [90, 256, 300]);
        assert_eq!(*again.position(), Position::End);
        // After a key that is no longer there: the next one.
        let gone = Position::After(100u32.to_ne_bytes().to_vec());
        let mut w = Walker::by_key(&m, meta(), gone).unwrap();
        assert_eq!(keys(&w.next_chunk(10).unwrap().unwrap()), [256, 300]);
        let mut none = Walker::by_key(matches(&[]), meta(), Position::Start).unwrap();
        assert_eq!(none.next_chunk(10).unwrap(), None);
    }

    #[test]
    fn keys_as_bytes_sort_as_bytes_and_lookups_find_them() {
        let chunk = Chunk {
            count: 3,
            keys: [[2u8, 0], [1, 9], [1, 3]].concat(),
            values: vec![20, 19, 13],
        };
        let m = Matches::new(chunk, 2, 1, byte_order);
        let mut v = [0u8];
        m.lookup(&[1, 9], &mut v).unwrap();
        assert_eq!(v, [19]);
        assert!(m.lookup(&[1, 4], &mut v).is_err());
        let mut next = [0u8; 2];
        m.get_next_key(Some(&[1, 3]), &mut next).unwrap();
        assert_eq!(next, [1, 9]);
        assert_eq!(m.len(), 3);
        assert_eq!(m.bytes(), 9);
    }
}
