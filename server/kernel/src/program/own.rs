//! The kernel objects this process's walk programs are made of (the
//! programs, their slots, scratch values and outputs), so that a reader of
//! the host's maps and programs can leave them out: they are the daemon's
//! own, not the host's. Each is listed from when its program is loaded
//! until a while after it is dropped: the kernel frees a sleepable
//! program, and then its maps, only after an RCU grace period.

use std::{
    collections::{HashMap, HashSet},
    sync::{Mutex, MutexGuard},
    time::{Duration, Instant},
};

/// How long a dropped program's objects stay listed as this process's.
const LINGER: Duration = Duration::from_secs(10);

/// Ids of this process's walk programs and of their maps.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct OwnIds {
    pub maps: HashSet<u32>,
    pub programs: HashSet<u32>,
}

/// How many walk programs use each id (a map id is one program's; kept as
/// counts so that a registration's end removes only its own), and the ids
/// of programs dropped lately.
#[derive(Debug, Default)]
struct Counts {
    maps: HashMap<u32, usize>,
    programs: HashMap<u32, usize>,
    dropped: Vec<(Instant, Vec<u32>, Option<u32>)>,
}

static OWN: Mutex<Option<Counts>> = Mutex::new(None);

fn counts() -> MutexGuard<'static, Option<Counts>> {
    OWN.lock().unwrap_or_else(|e| e.into_inner())
}

/// The ids of every walk program of this process alive now, and of its
/// maps.
pub fn own_ids() -> OwnIds {
    let mut counts = counts();
    let Some(c) = counts.as_mut() else {
        return OwnIds::default();
    };
    c.dropped.retain(|(at, _, _)| at.elapsed() < LINGER);
    let lingering = c.dropped.iter();
    OwnIds {
        maps: c
            .maps
            .keys()
            .copied()
            .chain(
                lingering
                    .clone()
                    .flat_map(|(_, maps, _)| maps.iter().copied()),
            )
            .collect(),
        programs: c
            .programs
            .keys()
            .copied()
            .chain(lingering.filter_map(|(_, _, p)| *p))
            .collect(),
    }
}

/// One walk program's objects, listed as this process's own until dropped.
#[derive(Debug)]
pub(super) struct Registration {
    maps: Vec<u32>,
    program: Option<u32>,
}

impl Registration {
    /// Lists `maps` and `program` (ids the kernel gave; those of a
    /// scripted kernel are not listed).
    pub(super) fn new(maps: Vec<u32>, program: Option<u32>) -> Self {
        let mut guard = counts();
        let c = guard.get_or_insert_with(Counts::default);
        for id in &maps {
            *c.maps.entry(*id).or_default() += 1;
        }
        if let Some(id) = program {
            *c.programs.entry(id).or_default() += 1;
        }
        Self { maps, program }
    }
}

impl Drop for Registration {
    fn drop(&mut self) {
        let mut guard = counts();
        let Some(c) = guard.as_mut() else { return };
        let release = |table: &mut HashMap<u32, usize>, id: u32| {
            if let Some(n) = table.get_mut(&id) {
                *n -= 1;
                if *n == 0 {
                    table.remove(&id);
                }
            }
        };
        for id in &self.maps {
            release(&mut c.maps, *id);
        }
        if let Some(id) = self.program {
            release(&mut c.programs, id);
        }
        c.dropped.retain(|(at, _, _)| at.elapsed() < LINGER);
        c.dropped
            .push((Instant::now(), std::mem::take(&mut self.maps), self.program));
    }
}
