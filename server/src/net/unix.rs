//! The Unix socket listener: the local transport of a per-host daemon.
//!
//! Who may connect is decided by the socket file's permissions (mode 0660:
//! its owner, root, and its group, `listen_unix_group` when set); who calls
//! is what the kernel says of the connecting process (`SO_PEERCRED`): the
//! identity `uid:N`, and for dump slots one caller per process.

use std::{
    io,
    os::unix::fs::{FileTypeExt as _, PermissionsExt as _},
    path::{Path, PathBuf},
};

use anyhow::Context as _;
use tokio::net::UnixListener;

/// The socket's file, removed when dropped (the daemon stopped).
#[derive(Debug)]
pub(crate) struct SocketFile(PathBuf);

impl Drop for SocketFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// Binds the socket at `path` (replacing a stale socket file that nobody
/// listens on), mode 0660, in `group` if given (a name from /etc/group, or
/// a number).
pub(crate) fn bind(path: &Path, group: Option<&str>) -> anyhow::Result<(UnixListener, SocketFile)> {
    let gid = group.map(group_id).transpose()?;
    match std::fs::symlink_metadata(path) {
        Ok(m) if m.file_type().is_socket() => {
            if std::os::unix::net::UnixStream::connect(path).is_ok() {
                anyhow::bail!(
                    "cannot listen on {} (listen_unix): another process listens there",
                    path.display()
                );
            }
            std::fs::remove_file(path)
                .with_context(|| format!("cannot remove the stale socket {}", path.display()))?;
        }
        Ok(_) => anyhow::bail!(
            "cannot listen on {} (listen_unix): the path exists and is not a socket",
            path.display()
        ),
        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
        Err(e) => return Err(e).with_context(|| format!("cannot look at {}", path.display())),
    }
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir)
            .with_context(|| format!("cannot create {} (listen_unix)", dir.display()))?;
    }
    let listener = UnixListener::bind(path)
        .with_context(|| format!("cannot listen on {} (listen_unix)", path.display()))?;
    let file = SocketFile(path.to_owned());
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o660))
        .with_context(|| format!("cannot set the mode of {}", path.display()))?;
    if let Some(gid) = gid {
        std::os::unix::fs::chown(path, None, Some(gid))
            .with_context(|| format!("cannot give {} to group {gid}", path.display()))?;
    }
    Ok((listener, file))
}

/// The id of a group: a number, or a name looked up in /etc/group.
fn group_id(group: &str) -> anyhow::Result<u32> {
    if let Ok(gid) = group.parse() {
        return Ok(gid);
    }
    let groups = std::fs::read_to_string("/etc/group").context("cannot read /etc/group")?;
    group_in(&groups, group).with_context(|| {
        format!("no group {group:?} in /etc/group (listen_unix_group): give its name or number")
    })
}

fn group_in(groups: &str, name: &str) -> Option<u32> {
    groups.lines().find_map(|line| {
        let mut fields = line.split(':');
        (fields.next()? == name)
            .then(|| fields.nth(1)?.parse().ok())
            .flatten()
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn groups_are_found_by_name() {
        let groups = "root:x:0:\nbpfmap:x:997:alice,bob\n# odd\nbad:x:\n";
        assert_eq!(group_in(groups, "bpfmap"), Some(997));
        assert_eq!(group_in(groups, "root"), Some(0));
        assert_eq!(group_in(groups, "bad"), None);
        assert_eq!(group_in(groups, "nobody"), None);
        assert_eq!(group_id("12").unwrap(), 12);
    }

    #[tokio::test]
    async fn a_stale_socket_is_replaced_and_a_live_one_refused() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("run/bpfmapd.sock");
        let (listener, file) = bind(&path, None).unwrap();
        let mode = std::fs::metadata(&path).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o660);
        let e = bind(&path, None).unwrap_err();
        assert!(
            format!("{e:#}").contains("another process listens there"),
            "{e:#}"
        );
        drop(listener);
        std::mem::forget(file);
        let (_l, _f) = bind(&path, None).expect("a stale socket is replaced");
        std::fs::write(dir.path().join("plain"), "x").unwrap();
        let e = bind(&dir.path().join("plain"), None).unwrap_err();
        assert!(format!("{e:#}").contains("is not a socket"), "{e:#}");
    }
}
