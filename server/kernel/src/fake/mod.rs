//! Scripted stand-ins for the kernel, for unit tests of what is built on
//! it: each call answers what the script says next, so that the error
//! paths the kernel will not produce on demand can be reached.
//!
//! [`ScriptedMap`] answers a hash map's batch reads (ENOSPC, EINTR, a
//! failure after some entries) for the walker, and its drains
//! ([`DrainOps`]); [`ScriptedKernel`] answers what a walk program asks of
//! the kernel ([`ProgramOps`](crate::program::ProgramOps)): a verifier
//! that refuses, a test run that fails, a program that stops on an error.

mod kernel;

pub use kernel::{Call, Loaded, Run, ScriptedKernel, ScriptedProgram, ScriptedProgramMap};

use std::{
    collections::VecDeque,
    io,
    sync::{
        Mutex,
        atomic::{AtomicBool, Ordering},
    },
};

use crate::{MapOps, SysResult, SyscallError, drain::DrainOps, sys::BatchBuffers};

/// A syscall error with `errno`, as the kernel would report it.
pub fn err(errno: i32) -> SyscallError {
    SyscallError {
        call: "fake",
        io_error: io::Error::from_raw_os_error(errno),
    }
}

/// One scripted batch answer: entries (u32 key, u32 value) to copy if they
/// fit, the next bucket token, and the result; `reported: false` when the
/// call fails before writing anything back.
#[derive(Debug)]
struct Answer {
    entries: Vec<(u32, u32)>,
    next: u32,
    result: Result<(), i32>,
    reported: bool,
}

/// A hash map of u32 keys and u32 values read by bucket, whose batch calls
/// answer from a script ([`ScriptedMap::push`]). Key walks and lookups
/// answer ENOENT. Opened for writing unless [`ScriptedMap::set_read_only`].
#[derive(Debug, Default)]
pub struct ScriptedMap {
    answers: Mutex<VecDeque<Answer>>,
    calls: Mutex<Vec<(Option<Vec<u8>>, u32)>>,
    read_only: AtomicBool,
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
            reported: true,
        });
    }

    /// Scripts a call that fails with `errno` before the kernel writes
    /// anything back (neither the count nor the token), as when it refuses
    /// the call's arguments.
    pub fn push_unreported(&self, errno: i32) {
        self.answers.lock().expect("script").push_back(Answer {
            entries: Vec::new(),
            next: 0,
            result: Err(errno),
            reported: false,
        });
    }

    /// Makes the map look opened read-only ([`DrainOps::is_writable`]).
    pub fn set_read_only(&self, read_only: bool) {
        self.read_only.store(read_only, Ordering::Relaxed);
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

impl ScriptedMap {
    /// Answers one batch call from the script. The hash path writes the
    /// token back on ENOSPC; `enospc_token` says whether to.
    fn answer(&self, b: BatchBuffers<'_>, enospc_token: bool) -> SysResult<()> {
        let BatchBuffers {
            in_batch,
            out_batch,
            keys,
            values,
            count,
        } = b;
        self.calls
            .lock()
            .expect("script")
            .push((in_batch.map(<[u8]>::to_vec), *count));
        let a = self
            .answers
            .lock()
            .expect("script")
            .pop_front()
            .expect("unexpected extra batch call");
        if !a.reported {
            return a.result.map_err(err);
        }
        if a.result == Err(libc::ENOSPC) {
            *count = 0;
            if enospc_token {
                out_batch[..4].copy_from_slice(&a.next.to_le_bytes());
            }
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
        let b = BatchBuffers {
            in_batch,
            out_batch,
            keys,
            values,
            count,
        };
        self.answer(b, false)
    }

    fn get_next_key(&self, _key: Option<&[u8]>, _next: &mut [u8]) -> SysResult<()> {
        Err(err(libc::ENOENT))
    }

    fn lookup(&self, _key: &[u8], _value: &mut [u8]) -> SysResult<()> {
        Err(err(libc::ENOENT))
    }
}

impl DrainOps for ScriptedMap {
    fn is_writable(&self) -> bool {
        !self.read_only.load(Ordering::Relaxed)
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
        self.answer(b, true)
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
