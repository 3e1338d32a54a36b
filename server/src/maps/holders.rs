//! Who holds the maps: the programs that use each map and the processes
//! with a descriptor to it, read for the calls that need them (GetMap,
//! ListMaps, a name with an owner, the candidates of a name) at most once
//! per [`FRESH_FOR`]: reading them walks every process's descriptors.

use std::{
    collections::HashMap,
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

use bpfmap_kernel::holders::{self, ProcessScan};
use bpfmap_proto::v1 as pb;

use super::bpftrace::Script;

/// How long one reading of the holders serves the calls that follow.
pub(crate) const FRESH_FOR: Duration = Duration::from_secs(1);

/// The last reading of the holders, shared by the calls of the next
/// [`FRESH_FOR`].
#[derive(Debug, Default)]
pub(crate) struct HoldersCache(Mutex<Option<(Instant, Arc<Holders>)>>);

impl HoldersCache {
    /// The holders, read now unless a reading is fresh; blocking.
    pub(crate) fn get(&self) -> Arc<Holders> {
        let mut last = self.0.lock().unwrap_or_else(|e| e.into_inner());
        match &*last {
            Some((at, h)) if at.elapsed() < FRESH_FOR => h.clone(),
            _ => {
                let h = Arc::new(Holders::scan());
                *last = Some((Instant::now(), h.clone()));
                h
            }
        }
    }
}

/// The programs and processes holding each map, by map id.
#[derive(Debug, Default)]
pub(crate) struct Holders {
    programs: HashMap<u32, Vec<pb::MapProgram>>,
    owners: HashMap<u32, Vec<pb::MapOwner>>,
    /// The scripts of the bpftrace processes among the owners, by pid.
    scripts: HashMap<u32, Script>,
    /// Why some may be missing; empty when none is.
    incomplete: String,
}

impl Holders {
    /// Reads every loaded program's maps and every process's map
    /// descriptors (this process's left out, its walk programs too).
    pub(crate) fn scan() -> Self {
        let mut out = Self::default();
        let mut missing = Vec::new();
        match holders::programs() {
            Ok(programs) => {
                let own = bpfmap_kernel::program::own_ids().programs;
                for p in programs.into_iter().filter(|p| !own.contains(&p.id)) {
                    for id in &p.map_ids {
                        out.programs.entry(*id).or_default().push(pb::MapProgram {
                            id: p.id,
                            name: p.name.clone(),
                            r#type: p.prog_type.clone(),
                        });
                    }
                }
            }
            Err(e) => missing.push(format!("{e} (needs CAP_SYS_ADMIN)")),
        }
        let ProcessScan {
            processes,
            unreadable,
        } = holders::processes("/proc".as_ref(), std::process::id());
        for p in processes {
            if p.comm == "bpftrace"
                && let Some(script) = Script::of_process("/proc".as_ref(), p.pid)
            {
                out.scripts.insert(p.pid, script);
            }
            for id in p.map_ids {
                out.owners.entry(id).or_default().push(pb::MapOwner {
                    pid: p.pid,
                    comm: p.comm.clone(),
                });
            }
        }
        if unreadable > 0 {
            missing.push(format!(
                "the descriptors of {unreadable} processes could not be read (needs CAP_SYS_PTRACE, or running as their user)"
            ));
        }
        out.incomplete = missing.join("; ");
        out
    }

    /// Fills the holders of `info`'s map.
    pub(crate) fn fill(&self, info: &mut pb::MapInfo) {
        info.programs = self.programs.get(&info.id).cloned().unwrap_or_default();
        info.owners = self.owners.get(&info.id).cloned().unwrap_or_default();
        info.holders_incomplete.clone_from(&self.incomplete);
        info.bpftrace = self.bpftrace(info.id, &info.name, info.key_size);
    }

    /// What the script of a bpftrace process holding map `id` (named
    /// `name`, with keys of `key_size` bytes) says of it.
    pub(crate) fn bpftrace(
        &self,
        id: u32,
        name: &str,
        key_size: u32,
    ) -> Option<pb::BpftraceScript> {
        self.owners
            .get(&id)?
            .iter()
            .find_map(|o| self.scripts.get(&o.pid)?.map(name, key_size))
    }

    /// Whether `owner` (a program name, a process name or a pid) holds map
    /// `id`. Names compare as the kernel keeps them: their first 15 bytes.
    pub(crate) fn holds(&self, id: u32, owner: &str) -> bool {
        let name = kernel_name(owner);
        let pid: Option<u32> = owner.parse().ok();
        let by_program = self
            .programs
            .get(&id)
            .is_some_and(|ps| ps.iter().any(|p| p.name == owner || p.name == name));
        let by_process = self.owners.get(&id).is_some_and(|os| {
            os.iter()
                .any(|o| Some(o.pid) == pid || o.comm == owner || o.comm == name)
        });
        by_program || by_process
    }

    /// Who holds map `id`, for messages: "programs sys_enter, sys_exit;
    /// processes syscount[812]", or "no program or process".
    pub(crate) fn describe(&self, id: u32) -> String {
        let mut parts = Vec::new();
        if let Some(ps) = self.programs.get(&id) {
            let names: Vec<String> = ps.iter().map(program_label).collect();
            parts.push(format!("programs {}", names.join(", ")));
        }
        if let Some(os) = self.owners.get(&id) {
            let names: Vec<String> = os
                .iter()
                .map(|o| format!("{}[{}]", o.comm, o.pid))
                .collect();
            parts.push(format!("processes {}", names.join(", ")));
        }
        if parts.is_empty() {
            "no program or process".to_owned()
        } else {
            parts.join("; ")
        }
    }
}

/// A program in messages: its name, or its id when it has none.
fn program_label(p: &pb::MapProgram) -> String {
    if p.name.is_empty() {
        format!("prog id {}", p.id)
    } else {
        p.name.clone()
    }
}

/// `name` as the kernel keeps names: at most 15 bytes (cut at a character
/// boundary).
pub(crate) fn kernel_name(name: &str) -> &str {
    let mut end = name.len().min(15);
    while !name.is_char_boundary(end) {
        end -= 1;
    }
    &name[..end]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn owners_match_by_program_process_or_pid() {
        let mut h = Holders::default();
        h.programs.insert(
            7,
            vec![pb::MapProgram {
                id: 3,
                name: "handle_sched_wa".into(),
                r#type: "tracing".into(),
            }],
        );
        h.owners.insert(
            7,
            vec![pb::MapOwner {
                pid: 1234,
                comm: "runqlat".into(),
            }],
        );
        // Program names are kept to 15 bytes, as the kernel keeps them.
        for owner in ["runqlat", "1234", "handle_sched_wa", "handle_sched_wakeup"] {
            assert!(h.holds(7, owner), "{owner}");
        }
        for owner in ["syscount", "123", "handle", "handle_sched_w"] {
            assert!(!h.holds(7, owner), "{owner}");
        }
        assert!(!h.holds(8, "runqlat"));
        assert_eq!(
            h.describe(7),
            "programs handle_sched_wa; processes runqlat[1234]"
        );
        assert_eq!(h.describe(8), "no program or process");
    }
}
