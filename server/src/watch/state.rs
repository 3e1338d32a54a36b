//! What a watched map held at its last scan: every entry's key and value,
//! in fixed-size records, indexed by key. A scan updates it in place and
//! returns the changes.

use std::hash::BuildHasher as _;

use hashbrown::{DefaultHashBuilder, HashTable};

/// What happened to an entry between two scans.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) enum Kind {
    Added,
    Changed,
    Removed,
}

/// One change: where the entry's record lives (its slot), and its bytes in
/// the scan's buffer: the key, the value (the last one for a removal), then
/// for a change the previous value.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Change {
    pub(crate) kind: Kind,
    pub(crate) slot: u32,
    at: u32,
}

/// The changes of one scan.
#[derive(Debug, Default)]
pub(crate) struct Changes {
    pub(crate) list: Vec<Change>,
    buf: Vec<u8>,
    key_size: usize,
    value_size: usize,
    /// False for a first scan: nobody needs its changes (a watcher's
    /// initial state comes from the state itself).
    record: bool,
}

impl Changes {
    /// The key, value and previous value (changes only) of `c`.
    pub(crate) fn parts(&self, c: &Change) -> (&[u8], &[u8], Option<&[u8]>) {
        let (ks, vs) = (self.key_size, self.value_size);
        let at = c.at as usize;
        let key = &self.buf[at..at + ks];
        let value = &self.buf[at + ks..at + ks + vs];
        let prev = (c.kind == Kind::Changed).then(|| &self.buf[at + ks + vs..at + ks + 2 * vs]);
        (key, value, prev)
    }

    /// Bytes held.
    pub(crate) fn bytes(&self) -> usize {
        self.buf.capacity() + self.list.capacity() * std::mem::size_of::<Change>()
    }

    fn push(&mut self, kind: Kind, slot: u32, parts: [&[u8]; 3]) {
        if !self.record {
            return;
        }
        let at = self.buf.len() as u32;
        for p in parts {
            self.buf.extend_from_slice(p);
        }
        self.list.push(Change { kind, slot, at });
    }
}

/// Per entry beyond its key and value: its index slot (4 bytes and a
/// control byte, at most 7/8 full) and its scan mark.
const PER_ENTRY: usize = 4 + 1 + 2 + 4;

/// The entries of a map at its last scan.
#[derive(Debug)]
pub(crate) struct State {
    key_size: usize,
    value_size: usize,
    records: Vec<u8>,
    /// Per slot: the scan that last saw it; 0 for a free slot.
    marks: Vec<u32>,
    free: Vec<u32>,
    index: HashTable<u32>,
    hasher: DefaultHashBuilder,
    len: usize,
    scan: u32,
    /// The slot after the last one seen: a walk reads a map in the same
    /// order every time, so the next entry is most often in this slot, found
    /// without hashing its key.
    next: usize,
}

impl State {
    /// An empty state for keys and values (in the kernel's layout: every
    /// CPU's value) of these sizes.
    pub(crate) fn new(key_size: usize, value_size: usize) -> Self {
        Self {
            key_size,
            value_size,
            records: Vec::new(),
            marks: Vec::new(),
            free: Vec::new(),
            index: HashTable::new(),
            hasher: DefaultHashBuilder::default(),
            len: 0,
            scan: 0,
            next: 0,
        }
    }

    /// Entries held.
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// Slots (held entries and free ones).
    pub(crate) fn slots(&self) -> usize {
        self.marks.len()
    }

    /// The bytes an entry costs.
    pub(crate) fn entry_bytes(&self) -> usize {
        self.key_size + self.value_size + PER_ENTRY
    }

    /// Bytes held (for limits.max_watch_bytes).
    pub(crate) fn bytes(&self) -> usize {
        self.records.capacity()
            + self.marks.capacity() * 4
            + self.free.capacity() * 4
            + self.index.capacity() * 5
    }

    /// The entry in `slot`, if it holds one.
    pub(crate) fn get(&self, slot: usize) -> Option<(&[u8], &[u8])> {
        (*self.marks.get(slot)? != 0).then(|| self.record(slot as u32))
    }

    fn record(&self, slot: u32) -> (&[u8], &[u8]) {
        let rec = self.key_size + self.value_size;
        let r = &self.records[slot as usize * rec..(slot as usize + 1) * rec];
        r.split_at(self.key_size)
    }

    /// Starts a scan: entries not seen by [`see`](Self::see) before
    /// [`end_scan`](Self::end_scan) are removed.
    pub(crate) fn begin_scan(&mut self) -> Changes {
        let first = self.scan == 0;
        self.scan = self.scan.wrapping_add(1).max(1);
        self.next = 0;
        Changes {
            key_size: self.key_size,
            value_size: self.value_size,
            record: !first,
            ..Changes::default()
        }
    }

    /// One entry as the walk read it.
    pub(crate) fn see(&mut self, key: &[u8], value: &[u8], out: &mut Changes) {
        let rec = self.key_size + self.value_size;
        let ks = self.key_size;
        let guess = self.next;
        let in_order = self.marks.get(guess).is_some_and(|&m| m != 0)
            && &self.records[guess * rec..guess * rec + ks] == key;
        let found = if in_order {
            Some(guess as u32)
        } else {
            let hash = self.hasher.hash_one(key);
            let records = &self.records;
            self.index
                .find(hash, |&s| {
                    &records[s as usize * rec..s as usize * rec + ks] == key
                })
                .copied()
        };
        if let Some(slot) = found {
            self.next = slot as usize + 1;
        }
        match found {
            Some(slot) => {
                if self.marks[slot as usize] == self.scan {
                    // Seen twice in one walk: the second copy is the same
                    // entry read again.
                    return;
                }
                self.marks[slot as usize] = self.scan;
                let at = slot as usize * rec + ks;
                let old = &self.records[at..at + self.value_size];
                if old != value {
                    out.push(Kind::Changed, slot, [key, value, old]);
                    self.records[at..at + self.value_size].copy_from_slice(value);
                }
            }
            None => {
                let hash = self.hasher.hash_one(key);
                let slot = match self.free.pop() {
                    Some(s) => {
                        let at = s as usize * rec;
                        self.records[at..at + ks].copy_from_slice(key);
                        self.records[at + ks..at + rec].copy_from_slice(value);
                        self.marks[s as usize] = self.scan;
                        s
                    }
                    None => {
                        self.records.extend_from_slice(key);
                        self.records.extend_from_slice(value);
                        self.marks.push(self.scan);
                        (self.marks.len() - 1) as u32
                    }
                };
                let (records, hasher) = (&self.records, &self.hasher);
                self.index.insert_unique(hash, slot, |&s| {
                    hasher.hash_one(&records[s as usize * rec..s as usize * rec + ks])
                });
                self.len += 1;
                out.push(Kind::Added, slot, [key, value, &[]]);
            }
        }
    }

    /// Ends a scan: what it did not see is removed.
    pub(crate) fn end_scan(&mut self, out: &mut Changes) {
        let rec = self.key_size + self.value_size;
        let ks = self.key_size;
        for slot in 0..self.marks.len() {
            let mark = self.marks[slot];
            if mark == 0 || mark == self.scan {
                continue;
            }
            let at = slot * rec;
            let (key, value) = self.records[at..at + rec].split_at(ks);
            out.push(Kind::Removed, slot as u32, [key, value, &[]]);
            let hash = self.hasher.hash_one(key);
            if let Ok(e) = self.index.find_entry(hash, |&s| s as usize == slot) {
                e.remove();
            }
            self.marks[slot] = 0;
            self.free.push(slot as u32);
            self.len -= 1;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scan(s: &mut State, entries: &[(u32, u64)]) -> Vec<(Kind, u32, u64, Option<u64>)> {
        let mut c = s.begin_scan();
        for (k, v) in entries {
            s.see(&k.to_le_bytes(), &v.to_le_bytes(), &mut c);
        }
        s.end_scan(&mut c);
        let mut out: Vec<_> = c
            .list
            .iter()
            .map(|ch| {
                let (k, v, p) = c.parts(ch);
                (
                    ch.kind,
                    u32::from_le_bytes(k.try_into().unwrap()),
                    u64::from_le_bytes(v.try_into().unwrap()),
                    p.map(|p| u64::from_le_bytes(p.try_into().unwrap())),
                )
            })
            .collect();
        out.sort_by_key(|x| x.1);
        out
    }

    #[test]
    fn a_scan_reports_exactly_what_changed() {
        let mut s = State::new(4, 8);
        // The first scan fills the state; its changes are not kept.
        assert_eq!(scan(&mut s, &[(1, 10), (2, 20)]), []);
        assert_eq!(s.len(), 2);
        assert_eq!(
            scan(&mut s, &[(1, 10), (2, 20), (5, 50)]),
            [(Kind::Added, 5, 50, None)]
        );
        assert_eq!(
            scan(&mut s, &[(1, 10), (2, 20)]),
            [(Kind::Removed, 5, 50, None)]
        );
        assert_eq!(scan(&mut s, &[(2, 20), (1, 10)]), []);
        assert_eq!(
            scan(&mut s, &[(1, 11), (3, 30)]),
            [
                (Kind::Changed, 1, 11, Some(10)),
                (Kind::Removed, 2, 20, None),
                (Kind::Added, 3, 30, None)
            ]
        );
        assert_eq!(s.len(), 2);
        // The freed slot is reused.
        assert_eq!(scan(&mut s, &[(1, 11), (3, 30), (4, 40)]).len(), 1);
        assert_eq!(s.slots(), 3);
        assert_eq!(scan(&mut s, &[]).len(), 3);
        assert_eq!(s.len(), 0);
    }
}
