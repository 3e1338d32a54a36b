//! A scripted stand-in for a hash map's batch reads, for unit tests of the
//! walker and of what is built on it: each call answers what the script
//! says next, so that the error paths the kernel will not produce on demand
//! (ENOSPC, EINTR, a failure after some entries) can be reached.

use std::{collections::VecDeque, io, sync::Mutex};

use crate::{MapOps, SysResult, SyscallError};

/// A syscall error with `errno`, as the kernel would report it.
pub fn err(errno: i32) -> SyscallError {
    SyscallError {
        call: "fake",
        io_error: io::Error::from_raw_os_error(errno),
    }
}

/// One scripted batch answer: entries (u32 key, u32 value) to copy if they
/// fit, the next bucket token, and the result.
#[derive(Debug)]
struct Answer {
    entries: Vec<(u32, u32)>,
    next: u32,
    result: Result<(), i32>,
}

/// A hash map of u32 keys and u32 values read by bucket, whose batch calls
/// answer from a script ([`ScriptedMap::push`]). Key walks and lookups
/// answer ENOENT.
#[derive(Debug, Default)]
pub struct ScriptedMap {
    answers: Mutex<VecDeque<Answer>>,
    calls: Mutex<Vec<(Option<Vec<u8>>, u32)>>,
}

impl ScriptedMap {
    /// Scripts the next batch call: copy `entries` (when they fit the
    /// caller's count), set the next token to `next`, and return `result`
    /// (an errno). ENOSPC copies nothing.
    pub fn push(&self, entries: &[(u32, u32)], next: u32, result: Result<(), i32>) {
        self.answers.lock().expect("script").push_back(Answer {
            entries: entries.to_vec(),
            next,
            result,
        });
    }

    /// The batch calls made so far: their input token and count.
    pub fn calls(&self) -> Vec<(Option<Vec<u8>>, u32)> {
        self.calls.lock().expect("script").clone()
    }

    /// Scripted answers not used yet.
    pub fn unused(&self) -> usize {
        self.answers.lock().expect("script").len()
    }
}

impl MapOps for ScriptedMap {
    fn lookup_batch(
        &self,
        in_batch: Option<&[u8]>,
        out_batch: &mut [u8],
        keys: &mut [u8],
        values: &mut [u8],
        count: &mut u32,
    ) -> SysResult<()> {
        self.calls
            .lock()
            .expect("script")
            .push((in_batch.map(<[u8]>::to_vec), *count));
        let a = self
            .answers
            .lock()
            .expect("script")
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

/// What [`ScriptedMap`] pretends to be: a hash map of 64 u32 -> u32 entries
/// (kernel id 7, name "t", no BTF, 2 possible CPUs).
pub fn meta() -> crate::MapMeta {
    crate::MapMeta {
        id: 7,
        name: "t".into(),
        map_type: crate::MapType::HASH,
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
