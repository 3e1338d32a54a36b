//! Real programs whose maps the tests read: xdp-filter (xdp-tools),
//! libbpf-tools' syscount and runqlat, bpftrace, run as children that are
//! killed when dropped; bpftool to say what the kernel says; the network
//! namespaces xdp-filter is loaded in. A missing tool fails the test,
//! naming the Debian package that brings it.

use std::{
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    time::{Duration, Instant},
};

use serde_json::Value as Json;

/// The path of `tool` (on PATH, or in /usr/sbin where libbpf-tools put
/// theirs); fails naming `package` when it is missing.
pub fn require(tool: &str, package: &str) -> PathBuf {
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .chain([PathBuf::from("/usr/sbin"), PathBuf::from("/sbin")])
        .map(|dir| dir.join(tool))
        .find(|p| p.is_file())
        .unwrap_or_else(|| {
            panic!("this test needs {tool} ({package}): apt-get install {package} (.ci/run does)")
        })
}

/// Mounts tracefs at /sys/kernel/tracing unless it is (libbpf-tools and
/// bpftrace attach through it).
pub fn mount_tracefs() {
    let dir = Path::new("/sys/kernel/tracing");
    if dir.join("events").is_dir() {
        return;
    }
    let out = Command::new("mount")
        .args(["-t", "tracefs", "tracefs"])
        .arg(dir)
        .output()
        .unwrap_or_else(|e| panic!("cannot run mount ({e})"));
    assert!(
        out.status.success() || dir.join("events").is_dir(),
        "this test needs tracefs: mount -t tracefs tracefs /sys/kernel/tracing failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// A program running as a child, its output in a file; killed when
/// dropped.
#[derive(Debug)]
pub struct Program {
    child: Child,
    name: String,
    output: tempfile::NamedTempFile,
}

impl Program {
    /// Starts `bin args` (with `env`).
    pub fn start(bin: &Path, args: &[&str], env: &[(&str, &Path)]) -> Self {
        let output = tempfile::NamedTempFile::new().expect("a file for the program's output");
        let child = Command::new(bin)
            .args(args)
            .envs(env.iter().map(|(k, v)| (*k, *v)))
            .stdin(Stdio::null())
            .stdout(output.reopen().expect("the output file"))
            .stderr(output.reopen().expect("the output file"))
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {}: {e}", bin.display()));
        Self {
            child,
            name: bin.display().to_string(),
            output,
        }
    }

    /// Its pid.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// What it printed so far.
    pub fn output(&self) -> String {
        std::fs::read_to_string(self.output.path()).unwrap_or_default()
    }

    /// Interrupts it (SIGINT, as Ctrl-C does: bpftrace prints its maps),
    /// waits up to 20 s for it to end and gives everything it printed.
    pub fn interrupt(&mut self) -> String {
        let sent = Command::new("kill")
            .args(["-INT", &self.child.id().to_string()])
            .status()
            .expect("kill(1) runs");
        assert!(sent.success(), "kill -INT {} failed", self.child.id());
        let start = std::time::Instant::now();
        while !matches!(self.child.try_wait(), Ok(Some(_))) {
            assert!(
                start.elapsed() < Duration::from_secs(20),
                "{} did not end on SIGINT: {}",
                self.name,
                self.output()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        self.output()
    }

    /// Fails, with its output, if it has exited.
    pub fn check_running(&mut self) {
        if let Ok(Some(status)) = self.child.try_wait() {
            panic!("{} exited ({status}): {}", self.name, self.output());
        }
    }
}

impl Drop for Program {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Waits up to `limit` for `f` to give a value, checking every 100 ms;
/// fails saying `what`.
pub async fn wait_for<T>(limit: Duration, what: &str, mut f: impl AsyncFnMut() -> Option<T>) -> T {
    let start = Instant::now();
    loop {
        if let Some(v) = f().await {
            return v;
        }
        assert!(start.elapsed() < limit, "waited {limit:?} for {what}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// `bpftool -j ARGS`, parsed.
pub fn bpftool(args: &[&str]) -> Json {
    let bin = require("bpftool", "bpftool");
    let out = Command::new(bin)
        .arg("-j")
        .args(args)
        .output()
        .expect("bpftool runs");
    assert!(
        out.status.success(),
        "bpftool {}: {}",
        args.join(" "),
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("bpftool prints JSON")
}

/// Runs `program args`, failing with its output unless it succeeds.
pub fn run(program: &Path, args: &[&str], env: &[(&str, &Path)]) -> String {
    let out = Command::new(program)
        .args(args)
        .envs(env.iter().map(|(k, v)| (*k, *v)))
        .output()
        .unwrap_or_else(|e| panic!("cannot run {} ({e})", program.display()));
    assert!(
        out.status.success(),
        "`{} {}` failed ({}): {}{}",
        program.display(),
        args.join(" "),
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Two network namespaces joined by a veth pair (`va` in the first at
/// 10.201.0.1/24, `vb` in the second at 10.201.0.2/24), for a program
/// attached to `va` to see the packets the second sends; deleted when
/// dropped.
#[derive(Debug)]
pub struct VethPair {
    /// The namespace of `va`.
    pub a: String,
    /// The namespace of `vb`.
    pub b: String,
}

impl VethPair {
    /// Makes them (named after this process and `tag`).
    pub fn new(tag: &str) -> Self {
        crate::netns::require_iproute2();
        let pid = std::process::id();
        let pair = Self {
            a: format!("bpfmap-{pid}-{tag}a"),
            b: format!("bpfmap-{pid}-{tag}b"),
        };
        let ip = Path::new("ip");
        for ns in [&pair.a, &pair.b] {
            let _ = Command::new("ip").args(["netns", "del", ns]).output();
            run(ip, &["netns", "add", ns], &[]);
        }
        run(
            ip,
            &[
                "-n", &pair.a, "link", "add", "va", "type", "veth", "peer", "name", "vb", "netns",
                &pair.b,
            ],
            &[],
        );
        for (ns, dev, addr) in [
            (&pair.a, "va", "10.201.0.1/24"),
            (&pair.b, "vb", "10.201.0.2/24"),
        ] {
            run(ip, &["-n", ns, "addr", "add", addr, "dev", dev], &[]);
            run(ip, &["-n", ns, "link", "set", dev, "up"], &[]);
        }
        pair
    }

    /// Runs `program args` in namespace `ns`, with `bpffs` at
    /// /sys/fs/bpf in a mount namespace of its own (xdp-tools pin where
    /// /sys/fs/bpf is, else under the first bpffs mounted anywhere, and
    /// `ip netns exec` mounts a sysfs without one).
    pub fn exec(&self, ns: &str, bpffs: &Path, program: &Path, args: &[&str]) -> String {
        let (bpffs, program) = (
            bpffs.to_str().expect("a UTF-8 path"),
            program.to_str().expect("a UTF-8 path"),
        );
        let script = "mount --bind \"$0\" /sys/fs/bpf && exec \"$@\"";
        let mut all = vec![
            "netns", "exec", ns, "unshare", "-m", "sh", "-c", script, bpffs, program,
        ];
        all.extend_from_slice(args);
        run(Path::new("ip"), &all, &[("LIBXDP_BPFFS", Path::new(bpffs))])
    }
}

impl Drop for VethPair {
    fn drop(&mut self) {
        for ns in [&self.a, &self.b] {
            let _ = Command::new("ip").args(["netns", "del", ns]).output();
        }
    }
}
