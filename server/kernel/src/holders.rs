//! Who holds a map: the programs that use it (`bpf_prog_info.map_ids`, as
//! `bpftool prog show` prints them) and the processes with a descriptor to
//! it (`/proc/PID/fdinfo`, as bpftool's `pids`).

use std::{
    fs,
    os::fd::{AsRawFd, BorrowedFd},
    path::Path,
};

/// A loaded program and the maps it uses.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProgramUse {
    /// Kernel program id.
    pub id: u32,
    /// Kernel name of the program (at most 15 bytes, may be empty).
    pub name: String,
    /// Its type as bpftool names it ("xdp", "kprobe", "tracepoint").
    pub prog_type: String,
    /// The maps it uses.
    pub map_ids: Vec<u32>,
}

/// Every loaded program (`BPF_PROG_GET_NEXT_ID`, needs CAP_SYS_ADMIN) with
/// the maps it uses. A program unloaded during the scan is left out; the
/// error is why programs cannot be listed at all.
pub fn programs() -> Result<Vec<ProgramUse>, String> {
    let mut out = Vec::new();
    for info in aya::programs::loaded_programs() {
        let info = match info {
            Ok(info) => info,
            // The first call failing means none can be listed (EPERM
            // without CAP_SYS_ADMIN); a later one, a program just unloaded.
            Err(e) if out.is_empty() => return Err(format!("cannot list programs: {e}")),
            Err(_) => continue,
        };
        let Ok(map_ids) = info.map_ids() else {
            continue; // unloaded between the two calls
        };
        let prog_type = format!("{:?}", info.program_type());
        out.push(ProgramUse {
            id: info.id(),
            name: String::from_utf8_lossy(info.name()).into_owned(),
            prog_type: prog_type
                .strip_prefix("BPF_PROG_TYPE_")
                .unwrap_or(&prog_type)
                .to_ascii_lowercase(),
            map_ids: map_ids.unwrap_or_default(),
        });
    }
    Ok(out)
}

/// A process and the maps it holds descriptors to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProcessUse {
    /// Its pid.
    pub pid: u32,
    /// Its command name (`/proc/PID/comm`).
    pub comm: String,
    /// The maps it holds, each once.
    pub map_ids: Vec<u32>,
}

/// What a scan of `/proc` found.
#[derive(Debug, Clone, Default)]
pub struct ProcessScan {
    /// Processes holding at least one map.
    pub processes: Vec<ProcessUse>,
    /// Processes whose descriptors could not be read (another user's,
    /// without CAP_SYS_PTRACE or CAP_DAC_READ_SEARCH).
    pub unreadable: usize,
}

/// The processes under `proc` (normally `/proc`) that hold map descriptors,
/// except `skip` (this process: the daemon's own descriptors are not an
/// owner's).
pub fn processes(proc: &Path, skip: u32) -> ProcessScan {
    let mut scan = ProcessScan::default();
    let Ok(dir) = fs::read_dir(proc) else {
        return scan;
    };
    for entry in dir.flatten() {
        let Some(pid) = entry
            .file_name()
            .to_str()
            .and_then(|n| n.parse::<u32>().ok())
        else {
            continue;
        };
        if pid == skip {
            continue;
        }
        let base = entry.path();
        let Ok(fds) = fs::read_dir(base.join("fd")) else {
            // Gone, or not ours to read.
            if base.exists() {
                scan.unreadable += 1;
            }
            continue;
        };
        let mut map_ids = Vec::new();
        for fd in fds.flatten() {
            let is_map =
                fs::read_link(fd.path()).is_ok_and(|t| t.as_os_str() == "anon_inode:bpf-map");
            if !is_map {
                continue;
            }
            let info = base.join("fdinfo").join(fd.file_name());
            if let Some(id) = fs::read_to_string(info)
                .ok()
                .and_then(|text| fdinfo_field(&text, "map_id"))
                .and_then(|id| u32::try_from(id).ok())
                && !map_ids.contains(&id)
            {
                map_ids.push(id);
            }
        }
        if map_ids.is_empty() {
            continue;
        }
        let comm = fs::read_to_string(base.join("comm")).unwrap_or_default();
        map_ids.sort_unstable();
        scan.processes.push(ProcessUse {
            pid,
            comm: comm.trim_end().to_owned(),
            map_ids,
        });
    }
    scan.processes.sort_by_key(|p| p.pid);
    scan
}

/// The kernel's memory charge of the map `fd` refers to (`memlock` in its
/// fdinfo), in bytes.
pub(crate) fn memlock(fd: BorrowedFd<'_>) -> Option<u64> {
    let text = fs::read_to_string(format!("/proc/self/fdinfo/{}", fd.as_raw_fd())).ok()?;
    fdinfo_field(&text, "memlock")
}

/// A numeric field of an fdinfo file ("map_id:\t12").
fn fdinfo_field(text: &str, name: &str) -> Option<u64> {
    text.lines().find_map(|line| {
        let (k, v) = line.split_once(':')?;
        (k == name).then(|| v.trim().parse().ok())?
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fdinfo_fields_are_read_by_name() {
        let text = "pos:\t0\nflags:\t02000002\nmap_type:\t1\nmemlock:\t1312\nmap_id:\t42\n";
        assert_eq!(fdinfo_field(text, "map_id"), Some(42));
        assert_eq!(fdinfo_field(text, "memlock"), Some(1312));
        assert_eq!(fdinfo_field(text, "map"), None);
    }
}
