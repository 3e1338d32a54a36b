//! Readiness for systemd (`Type=notify`): one datagram to the socket named
//! by `$NOTIFY_SOCKET`, as sd_notify(3) sends it. Nothing happens when the
//! variable is not set (not started by systemd).

use std::os::unix::net::UnixDatagram;

/// Sends `state` ("READY=1", "RELOADING=1", "STOPPING=1", "STATUS=...") to
/// systemd, if it is listening. Failures are logged, never fatal.
pub(crate) fn notify(state: &str) {
    let Some(path) = std::env::var_os("NOTIFY_SOCKET") else {
        return;
    };
    if let Err(e) = send(&path, state) {
        tracing::warn!(error = %e, "cannot notify systemd");
    }
}

fn send(path: &std::ffi::OsStr, state: &str) -> std::io::Result<()> {
    use std::os::unix::ffi::OsStrExt as _;
    let socket = UnixDatagram::unbound()?;
    let bytes = path.as_bytes();
    // "@name" is a socket in the abstract namespace.
    if let Some(name) = bytes.strip_prefix(b"@") {
        use std::os::linux::net::SocketAddrExt as _;
        let addr = std::os::unix::net::SocketAddr::from_abstract_name(name)?;
        socket.send_to_addr(state.as_bytes(), &addr)?;
    } else {
        socket.send_to(state.as_bytes(), path)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_datagram_reaches_a_path_socket_and_an_abstract_one() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("notify");
        let listener = UnixDatagram::bind(&path).unwrap();
        send(path.as_os_str(), "READY=1").unwrap();
        let mut buf = [0u8; 64];
        let n = listener.recv(&mut buf).unwrap();
        assert_eq!(&buf[..n], b"READY=1");

        use std::os::linux::net::SocketAddrExt as _;
        let name = format!("bpfmapd-test-{}", std::process::id());
        let addr = std::os::unix::net::SocketAddr::from_abstract_name(name.as_bytes()).unwrap();
        let listener = UnixDatagram::bind_addr(&addr).unwrap();
        send(std::ffi::OsStr::new(&format!("@{name}")), "STOPPING=1").unwrap();
        let n = listener.recv(&mut buf).unwrap();
        assert_eq!(&buf[..n], b"STOPPING=1");
    }
}
