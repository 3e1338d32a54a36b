//! bpfmapd and bpfmapctl as processes of their own, for what only a process
//! shows: its memory, its exit on SIGTERM, a `kill -9`, what it left on
//! stdout. The binaries are this package's `test-bpfmapd` and
//! `test-bpfmapctl` (the real entry points); name them with [`daemon_bin!`](crate::daemon_bin)
//! and [`ctl_bin!`](crate::ctl_bin) from an integration test.

use std::{
    io::{BufRead as _, BufReader},
    net::{SocketAddr, TcpListener, TcpStream},
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

/// The path of the daemon binary (expands in the calling test crate).
#[macro_export]
macro_rules! daemon_bin {
    () => {
        std::path::Path::new(env!("CARGO_BIN_EXE_test-bpfmapd"))
    };
}

/// The path of the bpfmapctl binary (expands in the calling test crate).
#[macro_export]
macro_rules! ctl_bin {
    () => {
        std::path::Path::new(env!("CARGO_BIN_EXE_test-bpfmapctl"))
    };
}

/// Fails, with its stderr, unless the process exited with success.
pub fn assert_success(out: &std::process::Output) {
    assert!(
        out.status.success(),
        "{}: {}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
}

/// A free TCP port on `ip` (bound, then released).
pub fn free_addr(ip: &str) -> SocketAddr {
    TcpListener::bind((ip, 0))
        .and_then(|l| l.local_addr())
        .expect("a free port")
}

/// A running bpfmapd process with a config file written for it; its log
/// (JSON lines on stderr) is collected. Killed on drop.
#[derive(Debug)]
pub struct DaemonProcess {
    child: Option<Child>,
    /// Where it listens.
    pub addr: SocketAddr,
    log: Arc<Mutex<Vec<String>>>,
    bin: PathBuf,
    config: PathBuf,
    launch: Launch,
}

/// How to run the daemon besides its config: environment variables to add,
/// and a command to run it through (e.g. `setpriv` with its options).
#[derive(Debug, Clone, Default)]
pub struct Launch {
    /// Added to the daemon's environment.
    pub env: Vec<(String, String)>,
    /// Program and arguments the daemon's command line is appended to.
    pub wrapper: Vec<String>,
}

impl DaemonProcess {
    /// Starts `bin` serving `root` on `addr`, with `state` as its state
    /// directory and `extra` appended to the config file (TOML, e.g. a
    /// `[limits]` table). Waits until it accepts connections.
    pub fn start(bin: &Path, root: &Path, state: &Path, addr: SocketAddr, extra: &str) -> Self {
        Self::launch(bin, root, state, addr, extra, Launch::default())
    }

    /// [`start`](Self::start) on a free loopback port, with the default
    /// configuration.
    pub fn local(bin: &Path, root: &Path, state: &Path) -> Self {
        Self::start(bin, root, state, free_addr("127.0.0.1"), "")
    }

    /// [`start`](Self::start), run as `launch` says.
    pub fn launch(
        bin: &Path,
        root: &Path,
        state: &Path,
        addr: SocketAddr,
        extra: &str,
        launch: Launch,
    ) -> Self {
        let config = state.join("bpfmapd-test.toml");
        let text = format!(
            "listen = \"{addr}\"\nroots = [\"{}\"]\nstate_dir = \"{}\"\nmount_bpffs = false\nlog_format = \"json\"\n{extra}\n",
            root.display(),
            state.display()
        );
        std::fs::write(&config, text).expect("write the daemon's config");
        let mut d = Self {
            child: None,
            addr,
            log: Arc::new(Mutex::new(Vec::new())),
            bin: bin.to_owned(),
            config,
            launch,
        };
        d.spawn();
        d
    }

    fn spawn(&mut self) {
        let mut command = match self.launch.wrapper.split_first() {
            Some((program, args)) => {
                let mut c = Command::new(program);
                c.args(args).arg(&self.bin);
                c
            }
            None => Command::new(&self.bin),
        };
        let mut child = command
            .arg("--config")
            .arg(&self.config)
            .env("RUST_LOG", "info")
            .envs(self.launch.env.iter().map(|(k, v)| (k, v)))
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap_or_else(|e| panic!("cannot run {}: {e}", self.bin.display()));
        let stderr = child.stderr.take().expect("piped stderr");
        let log = self.log.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                log.lock().unwrap().push(line);
            }
        });
        let started = Instant::now();
        while TcpStream::connect(self.addr).is_err() {
            if let Ok(Some(status)) = child.try_wait() {
                panic!(
                    "the daemon exited ({status}) before listening:\n{}",
                    self.log().join("\n")
                );
            }
            assert!(
                started.elapsed() < Duration::from_secs(20),
                "the daemon did not listen on {} within 20 s",
                self.addr
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        self.child = Some(child);
    }

    /// Starts the daemon again after it exited (same config, same address).
    pub fn restart(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
        self.spawn();
    }

    /// The config file it reads (rewrite it to change the configuration).
    pub fn config_path(&self) -> &Path {
        &self.config
    }

    /// The process id.
    pub fn pid(&self) -> u32 {
        self.child.as_ref().expect("running").id()
    }

    /// "http://ADDR".
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// The log lines so far.
    pub fn log(&self) -> Vec<String> {
        self.log.lock().unwrap().clone()
    }

    /// Resident memory now and at its peak, in KiB (VmRSS, VmHWM).
    pub fn rss_kib(&self) -> (u64, u64) {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.pid()))
            .expect("the daemon's /proc status");
        let field = |name: &str| {
            status
                .lines()
                .find_map(|l| l.strip_prefix(name))
                .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
                .unwrap_or_else(|| panic!("no {name} in /proc status"))
        };
        (field("VmRSS:"), field("VmHWM:"))
    }

    /// Sends `signal` (e.g. libc::SIGTERM).
    pub fn signal(&self, signal: i32) {
        send_signal(self.pid(), signal);
    }

    /// Kills the process at once (SIGKILL) and reaps it.
    pub fn kill9(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Waits up to `limit` for the process to exit; its exit status and how
    /// long it took, or `None` if it is still running.
    pub fn wait_exit(&mut self, limit: Duration) -> Option<(std::process::ExitStatus, Duration)> {
        let started = Instant::now();
        let child = self.child.as_mut()?;
        loop {
            if let Ok(Some(status)) = child.try_wait() {
                self.child = None;
                return Some((status, started.elapsed()));
            }
            if started.elapsed() > limit {
                return None;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    }
}

impl Drop for DaemonProcess {
    fn drop(&mut self) {
        self.kill9();
    }
}

/// Sends a signal to a process.
#[allow(unsafe_code, reason = "kill(2) has no safe wrapper in std")]
pub fn send_signal(pid: u32, signal: i32) {
    // SAFETY: kill(2) takes plain integers and touches no memory of ours.
    let ret = unsafe { libc::kill(pid as libc::pid_t, signal) };
    assert_eq!(ret, 0, "kill({pid}, {signal}) failed");
}

/// The fields of a /proc stat file (`/proc/PID/stat`,
/// `/proc/thread-self/stat`) after the name in parentheses: the first is
/// field 3 of proc(5). `None` when it cannot be read.
fn stat_fields(stat: &str) -> Option<Vec<String>> {
    let text = std::fs::read_to_string(stat).ok()?;
    let rest = text.rsplit_once(')')?.1;
    Some(rest.split_whitespace().map(str::to_owned).collect())
}

/// Field `n` of proc(5) among [`stat_fields`], as a number.
fn stat_number(fields: &[String], n: usize) -> Option<u64> {
    fields.get(n - 3)?.parse().ok()
}

/// The minor page faults of process `pid` so far (field 10 of
/// `/proc/PID/stat`): pages it touched for the first time, or again after
/// they were handed back.
pub fn minor_faults(pid: u32) -> u64 {
    stat_fields(&format!("/proc/{pid}/stat"))
        .and_then(|f| stat_number(&f, 10))
        .expect("the process's minor faults, from its stat")
}

/// A process's or a thread's user and system time so far, in clock ticks,
/// from its /proc stat file (`/proc/PID/stat`, `/proc/thread-self/stat`):
/// fields 14 and 15. `None` when it cannot be read.
pub fn stat_ticks(stat: &str) -> Option<(u64, u64)> {
    let f = stat_fields(stat)?;
    Some((stat_number(&f, 14)?, stat_number(&f, 15)?))
}

/// The machine's CPU time so far, in clock ticks: (busy, total), from
/// /proc/stat (idle and iowait are not busy; guest time is in user time).
pub fn host_ticks() -> (u64, u64) {
    let stat = std::fs::read_to_string("/proc/stat").unwrap_or_default();
    let v: Vec<u64> = stat
        .lines()
        .next()
        .unwrap_or_default()
        .split_whitespace()
        .skip(1)
        .filter_map(|x| x.parse().ok())
        .collect();
    let total: u64 = v.iter().take(8).sum();
    let idle = v.get(3).copied().unwrap_or(0) + v.get(4).copied().unwrap_or(0);
    (total - idle, total)
}
