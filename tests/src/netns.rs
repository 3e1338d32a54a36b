//! Network namespaces joined to this one by a veth pair: a "host" reached
//! over a link of its own, which can be slowed down (`tbf`) or turned into
//! a black hole that drops every packet silently. Made with iproute2's
//! `ip` and `tc`; a test that needs them fails saying so when they are
//! missing. Dropping a [`NetNs`] deletes the namespace and its veth pair.
//!
//! The black hole is a classic BPF filter in direct-action mode that
//! answers every packet with TC_ACT_SHOT (`tc filter ... bpf da bytecode
//! '1,6 0 0 2,'`), on both directions of the host's end of the pair: it
//! needs only `clsact` and `cls_bpf`, not the `matchall` classifier or the
//! `gact` action, which not every kernel has.

use std::{
    net::Ipv4Addr,
    process::Command,
    sync::{
        Once,
        atomic::{AtomicU32, Ordering},
    },
};

use crate::process::Launch;

/// What the tests need from iproute2, and how to get it.
const MISSING: &str = "this test needs iproute2's `ip` and `tc` (network namespaces, veth pairs, tbf and cls_bpf): apt-get install iproute2";

/// Runs `program args`, failing with its stderr unless it succeeds.
fn run(program: &str, args: &[&str]) {
    let out = Command::new(program)
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("cannot run {program} ({e}): {MISSING}"));
    assert!(
        out.status.success(),
        "`{program} {}` failed ({}): {}",
        args.join(" "),
        out.status,
        String::from_utf8_lossy(&out.stderr).trim()
    );
}

/// Runs `program args`, ignoring how it ends (for cleanup).
fn run_quietly(program: &str, args: &[&str]) {
    let _ = Command::new(program).args(args).output();
}

/// Fails with a message naming the package (iproute2) unless `ip` and `tc`
/// can be run.
pub fn require_iproute2() {
    for program in ["ip", "tc"] {
        match Command::new(program).arg("-V").output() {
            Ok(out) if out.status.success() => {}
            Ok(out) => panic!("`{program} -V` failed ({}): {MISSING}", out.status),
            Err(e) => panic!("cannot run {program} ({e}): {MISSING}"),
        }
    }
}

/// Deletes the namespaces that earlier test processes (named after their
/// process id) left behind when they were killed.
fn delete_stale() {
    let Ok(out) = Command::new("ip").args(["netns", "list"]).output() else {
        return;
    };
    for line in String::from_utf8_lossy(&out.stdout).lines() {
        let name = line.split_whitespace().next().unwrap_or_default();
        let Some(pid) = name
            .strip_prefix("bpfmap-")
            .and_then(|rest| rest.split('-').next())
            .and_then(|pid| pid.parse::<u32>().ok())
        else {
            continue;
        };
        if !std::path::Path::new(&format!("/proc/{pid}")).exists() {
            run_quietly("ip", &["netns", "del", name]);
        }
    }
}

/// A network namespace joined to this one by a veth pair on a /30 of
/// their own: `host_addr` on this side, `addr` inside.
#[derive(Debug)]
pub struct NetNs {
    name: String,
    host_if: String,
    inner_if: String,
    /// This side's address.
    pub host_addr: Ipv4Addr,
    /// The namespace's address: where a daemon run in it listens.
    pub addr: Ipv4Addr,
}

impl NetNs {
    /// A new namespace with its veth pair up and addressed
    /// (10.200-249.X.Y/30, chosen from this process's id and a counter).
    pub fn new() -> Self {
        static STALE: Once = Once::new();
        static NEXT: AtomicU32 = AtomicU32::new(0);
        require_iproute2();
        STALE.call_once(delete_stale);
        let pid = std::process::id();
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        assert!(n < 64 * 256, "too many namespaces in one process");
        let (second, third, fourth) = (200 + (pid % 50) as u8, (n / 64) as u8, (n % 64 * 4) as u8);
        let ns = Self {
            name: format!("bpfmap-{pid}-{n}"),
            host_if: format!("bmh{pid:x}-{n}"),
            inner_if: format!("bmn{pid:x}-{n}"),
            host_addr: Ipv4Addr::new(10, second, third, fourth + 1),
            addr: Ipv4Addr::new(10, second, third, fourth + 2),
        };
        run("ip", &["netns", "add", &ns.name]);
        // From here on, a failure deletes what was made (Drop).
        run(
            "ip",
            &[
                "link",
                "add",
                &ns.host_if,
                "type",
                "veth",
                "peer",
                "name",
                &ns.inner_if,
                "netns",
                &ns.name,
            ],
        );
        run(
            "ip",
            &[
                "addr",
                "add",
                &format!("{}/30", ns.host_addr),
                "dev",
                &ns.host_if,
            ],
        );
        run("ip", &["link", "set", &ns.host_if, "up"]);
        run(
            "ip",
            &[
                "-n",
                &ns.name,
                "addr",
                "add",
                &format!("{}/30", ns.addr),
                "dev",
                &ns.inner_if,
            ],
        );
        run("ip", &["-n", &ns.name, "link", "set", &ns.inner_if, "up"]);
        run("ip", &["-n", &ns.name, "link", "set", "lo", "up"]);
        ns
    }

    /// The namespace's name (for `ip netns exec`).
    pub fn name(&self) -> &str {
        &self.name
    }

    /// How to run a daemon inside the namespace
    /// ([`DaemonProcess::launch`](crate::process::DaemonProcess::launch)):
    /// through `ip netns exec`, which execs it (its process id is the
    /// daemon's).
    pub fn launch(&self) -> Launch {
        Launch {
            wrapper: vec![
                "ip".into(),
                "netns".into(),
                "exec".into(),
                self.name.clone(),
            ],
            ..Launch::default()
        }
    }

    /// Limits both directions of the link to `rate` (tc's notation, e.g.
    /// "1mbit") with a token bucket filter.
    pub fn limit_rate(&self, rate: &str) {
        let tbf = [
            "root", "tbf", "rate", rate, "burst", "16kb", "latency", "500ms",
        ];
        let mut host = vec!["qdisc", "add", "dev", &self.host_if];
        host.extend(tbf);
        run("tc", &host);
        let mut inner = vec!["-n", &self.name, "qdisc", "add", "dev", &self.inner_if];
        inner.extend(tbf);
        run("tc", &inner);
    }

    /// Drops every packet on the link, both ways, saying nothing to either
    /// side: connections to the namespace hang until their timeout.
    pub fn black_hole(&self) {
        run("tc", &["qdisc", "add", "dev", &self.host_if, "clsact"]);
        for direction in ["ingress", "egress"] {
            run(
                "tc",
                &[
                    "filter",
                    "add",
                    "dev",
                    &self.host_if,
                    direction,
                    "bpf",
                    "da",
                    "bytecode",
                    "1,6 0 0 2,",
                ],
            );
        }
    }

    /// Lets packets through again after [`black_hole`](Self::black_hole).
    pub fn restore(&self) {
        run("tc", &["qdisc", "del", "dev", &self.host_if, "clsact"]);
    }
}

impl Default for NetNs {
    fn default() -> Self {
        Self::new()
    }
}

impl Drop for NetNs {
    fn drop(&mut self) {
        // Deleting the namespace destroys its end of the pair, and with it
        // this end; the link is deleted too in case a process still holds
        // the namespace.
        run_quietly("ip", &["netns", "del", &self.name]);
        run_quietly("ip", &["link", "del", &self.host_if]);
    }
}
