//! `networking-maps DIR`: loads the maps of `tests/bpf/networking.bpf.c`
//! (Cilium's connection tracking, load balancer and ipcache maps, the XDP
//! tutorial's per-CPU stats, a program's global data) into the bpffs at DIR
//! (mounting one there if DIR is not one), fills them with the entries the
//! networking tests read, and leaves them pinned, for trying the
//! documentation's examples against a daemon serving DIR (`bpfmapd --root
//! DIR`). Needs root and clang; `umount DIR` removes them.
#![forbid(unsafe_code)]

use std::{path::PathBuf, process::ExitCode};

fn main() -> ExitCode {
    let mut args = std::env::args_os().skip(1);
    let (Some(dir), None) = (args.next(), args.next()) else {
        eprintln!("usage: networking-maps DIR");
        return ExitCode::from(2);
    };
    let dir = PathBuf::from(dir);
    if let Err(e) = std::fs::create_dir_all(&dir) {
        eprintln!("networking-maps: cannot create {}: {e}", dir.display());
        return ExitCode::FAILURE;
    }
    match bpfmap_kernel::is_bpffs(&dir) {
        Ok(true) => {}
        Ok(false) => {
            if let Err(e) = bpfmap_kernel::mount_bpffs(&dir) {
                eprintln!(
                    "networking-maps: cannot mount bpffs on {}: {e}",
                    dir.display()
                );
                return ExitCode::FAILURE;
            }
        }
        Err(e) => {
            eprintln!("networking-maps: {}: {e}", dir.display());
            return ExitCode::FAILURE;
        }
    }
    let _maps = bpfmap_tests::networking::load(&dir);
    for map in bpfmap_tests::networking::PATHS {
        println!("{}", dir.join(map).display());
    }
    ExitCode::SUCCESS
}
