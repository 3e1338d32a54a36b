//! Who holds a map: the programs that use it (`bpf_prog_info.map_ids`, as
//! `bpftool prog show` prints them) and the processes with a descriptor to
//! it (`/proc/PID/fdinfo`, as bpftool's `pids`).

use std::{
    fs,
    os::fd::{AsRawFd, BorrowedFd},
    path::Path,
};

use aya_obj::generated::{bpf_prog_info, bpf_prog_type};

use crate::sys::{self, SyscallError};

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

/// Why no program can be listed (EPERM without CAP_SYS_ADMIN).
#[derive(Debug, thiserror::Error)]
#[error("cannot list programs: {0}")]
pub struct ProgramsError(pub SyscallError);

/// Every loaded program (`BPF_PROG_GET_NEXT_ID`, needs CAP_SYS_ADMIN) with
/// the maps it uses. A program unloaded while they are listed is left out;
/// the error is why programs cannot be listed at all.
pub fn programs() -> Result<Vec<ProgramUse>, ProgramsError> {
    let mut out = Vec::new();
    let mut id = 0;
    loop {
        // The first call failing means none can be listed (EPERM without
        // CAP_SYS_ADMIN); a later one, a program just unloaded.
        id = match sys::prog_get_next_id(id) {
            Ok(Some(next)) => next,
            Ok(None) => break,
            Err(e) if out.is_empty() => return Err(ProgramsError(e)),
            Err(_) => break,
        };
        let (fd, info) = match open_program(id) {
            Ok(opened) => opened,
            Err(e) if out.is_empty() => return Err(ProgramsError(e)),
            Err(_) => continue,
        };
        let map_ids = match info.nr_map_ids {
            0 => Vec::new(),
            n => match sys::prog_map_ids(&fd, n) {
                Ok(ids) => ids,
                Err(_) => continue,
            },
        };
        out.push(ProgramUse {
            id: info.id,
            name: String::from_utf8_lossy(&name_bytes(&info.name)).into_owned(),
            prog_type: type_name(info.type_),
            map_ids,
        });
    }
    Ok(out)
}

/// Program `id` and what the kernel says about it (how many maps it uses,
/// not which).
fn open_program(id: u32) -> Result<(sys::ProgFd, bpf_prog_info), SyscallError> {
    let fd = sys::prog_get_fd_by_id(id)?;
    let info = sys::prog_info(&fd)?;
    Ok((fd, info))
}

/// A kernel object name's bytes: up to its last non-NUL byte.
fn name_bytes(name: &[libc::c_char; 16]) -> Vec<u8> {
    let len = name.iter().rposition(|&c| c != 0).map_or(0, |at| at + 1);
    name[..len].iter().map(|&c| c as u8).collect()
}

/// A program type as bpftool names it ("xdp", "kprobe"); a type newer than
/// this daemon is "__max_bpf_prog_type".
fn type_name(prog_type: u32) -> String {
    let t = bpf_prog_type::try_from(prog_type).unwrap_or(bpf_prog_type::__MAX_BPF_PROG_TYPE);
    let debug = format!("{t:?}");
    debug
        .strip_prefix("BPF_PROG_TYPE_")
        .unwrap_or(&debug)
        .to_ascii_lowercase()
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
    fn program_types_are_named_as_bpftool_names_them() {
        assert_eq!(type_name(bpf_prog_type::BPF_PROG_TYPE_XDP as u32), "xdp");
        assert_eq!(
            type_name(bpf_prog_type::BPF_PROG_TYPE_SYSCALL as u32),
            "syscall"
        );
        assert_eq!(type_name(1000), "__max_bpf_prog_type");
    }

    #[test]
    fn program_names_end_at_their_last_byte() {
        let mut name = [0 as libc::c_char; 16];
        for (d, s) in name.iter_mut().zip(b"sys_enter") {
            *d = *s as libc::c_char;
        }
        assert_eq!(name_bytes(&name), b"sys_enter");
        assert_eq!(name_bytes(&[0; 16]), b"");
    }

    #[test]
    fn loaded_programs_are_listed_with_their_maps() {
        use crate::program::{WalkPlan, WalkProgram, own_ids};
        // A walk program of this process's, for a map of its own.
        let map = crate::OwnedMap::new(crate::MapType::ARRAY, 4, 4, 1, "holders_test")
            .expect("an array: these tests need root and BPF");
        let handle = map.handle().unwrap();
        let p = WalkProgram::load(&handle, &WalkPlan::count()).unwrap();
        p.walk(&handle).unwrap();
        let listed = programs().expect("programs, as root");
        let own = own_ids();
        let walk = listed
            .iter()
            .find(|p| own.programs.contains(&p.id))
            .unwrap_or_else(|| panic!("the walk program is not listed: {listed:?} {own:?}"));
        assert_eq!(
            (walk.name.as_str(), walk.prog_type.as_str()),
            ("bpfmapd_scan", "syscall")
        );
        // Its slot and scratch value: its own maps, never the map it
        // walked, which only its slot held while it ran.
        assert_eq!(walk.map_ids.len(), 2, "{walk:?}");
        assert!(
            walk.map_ids.iter().all(|id| own.maps.contains(id)),
            "{own:?}"
        );
        assert!(
            listed.iter().all(|p| !p.map_ids.contains(&map.id())),
            "a program holds the walked map: {listed:?}"
        );
        // Dropped, its objects stay listed while the kernel frees them.
        drop(p);
        assert!(own_ids().maps.contains(&walk.map_ids[0]));
    }

    #[test]
    fn fdinfo_fields_are_read_by_name() {
        let text = "pos:\t0\nflags:\t02000002\nmap_type:\t1\nmemlock:\t1312\nmap_id:\t42\n";
        assert_eq!(fdinfo_field(text, "map_id"), Some(42));
        assert_eq!(fdinfo_field(text, "memlock"), Some(1312));
        assert_eq!(fdinfo_field(text, "map"), None);
    }
}
