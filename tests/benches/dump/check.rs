//! The performance check, run before a change to the typed model, the dump
//! path, the scans, bpfmapctl's output or the relay closes:
//!
//!     cargo bench -p bpfmap-tests --bench dump -- check      (as root)
//!
//! The main cases at the size their targets are stated for (maps of
//! 1,000,000 entries; the relay's six daemons of 200,000), each timed
//! alternately with its baseline in the same run: what a user runs, as
//! whole processes (bpfmapctl, bpftool, bpfmapctl through the relay), the
//! library in this process, and a Python program reading the map as an
//! Arrow table (pyarrow; against grpcio and typed JSON), timed in its
//! process (`$BPFMAP_PYTHON_ARROW`: pyarrow, pandas, grpcio and
//! grpcio-tools). Each ratio is printed next to its target
//! and the last figure recorded in tests/README.md ("The performance
//! check"), saying which are over; then the table to record, with the
//! commit measured.

use std::{
    io::{BufRead as _, Read as _},
    net::TcpStream,
    path::Path,
    process::{Command, Stdio},
};

use bpfmap_client::{Client, ConnectOptions, DumpOptions, MapName, table::PerCpuColumns};
use bpfmap_kernel::MapHandle;
use bpfmap_tests::{
    BpfFs, MapType, daemon_bin,
    local_fleet::{LocalFleet, RelayProcess},
    median,
    process::{DaemonProcess, host_ticks, stat_ticks},
    u64_hash,
};

use super::{
    Pairing, batch_walk, bpfmapctl, bpftool_dump, bpftool_installed, conns_of, pairing,
    pairing_async, walk_process,
};

/// Entries of each map. (Smaller maps make the fixed costs of a process
/// and a call weigh more than the targets allow for.)
const N: u32 = 1_000_000;

/// One case's figure.
struct Figure {
    case: &'static str,
    measured: f64,
    /// The middle half of the ratios of the pairs it was measured in
    /// (none for a case timed once).
    spread: Option<(f64, f64)>,
    /// At most this (a ratio of times), or at least it (a speed-up).
    target: Target,
}

impl Figure {
    fn paired(case: &'static str, p: &Pairing, target: Target) -> Self {
        Self {
            case,
            measured: p.ratio,
            spread: Some(p.middle_half()),
            target,
        }
    }
}

#[derive(Clone, Copy)]
enum Target {
    AtMost(f64),
    AtLeast(f64),
}

impl Target {
    fn met(self, v: f64) -> bool {
        match self {
            Self::AtMost(t) => v <= t,
            Self::AtLeast(t) => v >= t,
        }
    }
}

impl std::fmt::Display for Target {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::AtMost(t) => write!(f, "<= {t}x"),
            Self::AtLeast(t) => write!(f, ">= {t}x"),
        }
    }
}

pub(crate) fn run(rt: &tokio::runtime::Runtime) {
    wait_until_quiet();
    println!(
        "the performance check: {N} entries per map, medians, each case alternated with its baseline"
    );
    let mut figures = Vec::new();
    maps(rt, &mut figures);
    relay(&mut figures);
    report(&figures);
}

/// The share of the CPUs others may use while the check runs.
const QUIET: f64 = 0.1;

/// Waits (up to a minute) until the other processes leave the CPUs idle
/// (less than [`QUIET`] of them busy over a second, from /proc/stat: the
/// load average lags a build that just ended by minutes), saying so.
fn wait_until_quiet() {
    for waited in 0..60 {
        let busy = busy_share();
        if busy < QUIET {
            return;
        }
        if waited == 0 {
            println!(
                "the CPUs are {:.0} % busy: waiting for them to be idle before measuring",
                busy * 100.0
            );
        }
    }
    println!(
        "the CPUs stayed busy for a minute: figures measured now are not comparable with others"
    );
}

/// The share of the CPUs' time spent busy over the next second.
fn busy_share() -> f64 {
    let (busy, total) = host_ticks();
    std::thread::sleep(std::time::Duration::from_secs(1));
    let (busy2, total2) = host_ticks();
    busy2.saturating_sub(busy) as f64 / total2.saturating_sub(total).max(1) as f64
}

/// The typed, untyped and per-CPU maps of the check, read by bpfmapctl,
/// bpftool and the library.
fn maps(rt: &tokio::runtime::Runtime, figures: &mut Vec<Figure>) {
    let fs = BpfFs::new();
    let conns = conns_of(N, MapType::HASH);
    fs.pin(&conns, "conns");
    let per_cpu = conns_of(N, MapType::PERCPU_HASH);
    fs.pin(&per_cpu, "pconns");
    let (_hash, _) = u64_hash(&fs, "hash", N, N);
    let state = tempfile::tempdir().unwrap();
    // The daemon is a process of its own, as on a host.
    let daemon = DaemonProcess::local(daemon_bin!(), fs.path(), state.path());
    let url = daemon.url();
    processes(fs.path(), &url, figures);
    daemon_cpu(&daemon, &fs.path().join("conns"));
    bare_transfer(&fs.path().join("conns"));
    rt.block_on(library(&url, &fs.path().join("conns"), figures));
    rt.block_on(library_table(&url, &fs.path().join("conns"), figures));
    arrow(&daemon, &fs.path().join("conns"), figures);
}

/// The cases of whole processes, against the walk in a process of its own
/// (the tools' floor) of the same map.
fn processes(root: &Path, url: &str, figures: &mut Vec<Figure>) {
    let floor = |map: &'static str| {
        let path = root.join(map);
        move || walk_process(&path)
    };
    let ctl = |args: &'static [&'static str]| move || bpfmapctl(url, args);
    let cases: [(&str, &str, &[&str], Target); 5] = [
        (
            "bpfmapctl dump, typed, JSON Lines",
            "conns",
            &["dump", "conns"],
            Target::AtMost(1.1),
        ),
        (
            "bpfmapctl dump, untyped u64 hash",
            "hash",
            &["dump", "hash"],
            Target::AtMost(1.1),
        ),
        (
            "bpfmapctl top 10 by sum, 50,000 groups (a __u16)",
            "conns",
            &[
                "top",
                "conns",
                "--by",
                "sum(value.packets)",
                "--group-by",
                "key.dport",
                "-n",
                "10",
            ],
            Target::AtMost(0.6),
        ),
        (
            "bpfmapctl dump filtered to 1 %, --scan kernel",
            "conns",
            &[
                "dump",
                "conns",
                "--filter",
                "value.packets < 10000",
                "--scan",
                "kernel",
            ],
            Target::AtMost(0.45),
        ),
        (
            "bpfmapctl top by sum, per-CPU hash, summed",
            "pconns",
            &[
                "top",
                "pconns",
                "--by",
                "sum(value.packets)",
                "--group-by",
                "key.proto",
            ],
            Target::AtMost(0.6),
        ),
    ];
    for (case, map, args, target) in cases {
        let p = pairing(floor(map), ctl(args));
        figures.push(Figure::paired(case, &p, target));
    }
    if bpftool_installed() {
        let path = root.join("conns");
        let p = pairing(ctl(&["dump", "conns"]), || bpftool_dump(&path));
        figures.push(Figure::paired(
            "bpftool map dump -j, against bpfmapctl dump (typed)",
            &p,
            Target::AtLeast(15.0),
        ));
    } else {
        println!("  bpftool is not installed: its case is left out (apt-get install bpftool)");
    }
}

/// Typed dumps by bpfmapctl, and the walk in this process, this many times
/// for the CPU times below.
const CPU_RUNS: u32 = 7;

/// What the daemon's CPU does with a typed dump (its user and system time,
/// from /proc), against the CPU of the batched walk in this process: what
/// is left of a whole process's ratio once the daemon is at the walk's
/// cost. Printed, not a target.
fn daemon_cpu(daemon: &DaemonProcess, path: &Path) {
    let url = daemon.url();
    let before = stat_ticks(&format!("/proc/{}/stat", daemon.pid())).expect("the daemon's stat");
    for _ in 0..CPU_RUNS {
        bpfmapctl(&url, &["dump", "conns"]);
        super::clear_spent();
    }
    let after = stat_ticks(&format!("/proc/{}/stat", daemon.pid())).expect("the daemon's stat");
    let walk_before = stat_ticks("/proc/thread-self/stat").expect("this thread's stat");
    for _ in 0..CPU_RUNS {
        batch_walk(path);
    }
    let walk_after = stat_ticks("/proc/thread-self/stat").expect("this thread's stat");
    let tick = clock_tick_ms();
    let per_run = |ticks: u64| ticks as f64 * tick / f64::from(CPU_RUNS);
    let (user, system) = (per_run(after.0 - before.0), per_run(after.1 - before.1));
    let walk = per_run(walk_after.0 + walk_after.1 - walk_before.0 - walk_before.1);
    println!(
        "  the daemon's CPU per typed dump of {N} entries: {:.0} ms (user {user:.0} ms, system {system:.0} ms), against {walk:.0} ms for the batched walk in this process ({:.2}x); {CPU_RUNS} of each",
        user + system,
        (user + system) / walk
    );
}

/// The walk sent over loopback TCP by a process of its own and read by this
/// one (`__send`: read as the daemon reads, written by another thread),
/// against the walk in this process: a transfer with no RPC, no encoding
/// and no decoding, about the least a remote dump takes on this machine.
/// What the library's dumps take beyond it is the RPC's and the client's.
/// Printed, not a target.
fn bare_transfer(path: &Path) {
    /// The sending process, killed when the check is done with it (or
    /// fails).
    struct Sender(std::process::Child);
    impl Drop for Sender {
        fn drop(&mut self) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
    let mut sender = Sender(
        Command::new(std::env::current_exe().unwrap())
            .arg("__send")
            .arg(path)
            .stdout(Stdio::piped())
            .spawn()
            .expect("the sender starts"),
    );
    let mut line = String::new();
    std::io::BufReader::new(sender.0.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    let port: u16 = line.trim().parse().expect("the sender's port");
    let meta = MapHandle::open_pinned(path).unwrap().meta().clone();
    let bytes = u64::from(N) * (u64::from(meta.key_size) + meta.kernel_value_size() as u64);
    let read = || {
        let mut conn = TcpStream::connect(("127.0.0.1", port)).expect("the sender accepts");
        let mut buf = vec![0u8; 256 << 10];
        let mut total = 0;
        loop {
            let n = conn.read(&mut buf).unwrap();
            if n == 0 {
                break;
            }
            total += n as u64;
        }
        assert_eq!(total, bytes, "the whole map is sent");
        total
    };
    let p = pairing(|| batch_walk(path), read);
    drop(sender);
    let (low, high) = p.middle_half();
    println!(
        "  the walk sent over loopback TCP by a process of its own and read by this one (no RPC, no encoding): {:.2}x the walk in this process (pairs {low:.2}-{high:.2}x), about the least a remote dump takes here",
        p.ratio
    );
}

/// Milliseconds per clock tick of /proc's CPU times.
fn clock_tick_ms() -> f64 {
    let out = Command::new("getconf").arg("CLK_TCK").output();
    let hz = out
        .ok()
        .and_then(|o| String::from_utf8(o.stdout).ok())
        .and_then(|s| s.trim().parse::<f64>().ok())
        .unwrap_or(100.0);
    1000.0 / hz
}

/// The library's typed dump decoded to JSON text, against the batched walk
/// in this process.
async fn library(url: &str, path: &Path, figures: &mut Vec<Figure>) {
    let client = Client::connect(url, ConnectOptions::default())
        .await
        .expect("the daemon answers");
    let map: MapName = "conns".parse().unwrap();
    let types = client
        .get_map(&map)
        .await
        .unwrap()
        .types()
        .unwrap()
        .expect("typed");
    let decoded = || {
        let (client, map, types) = (&client, &map, &types);
        async move {
            let mut dump = client.dump(map, DumpOptions::default());
            let mut out = Vec::with_capacity(1 << 20);
            while let Some(chunk) = dump.next_chunk().await.unwrap() {
                for e in &chunk {
                    types.write_entry_json(e, &mut out);
                    out.push(b'\n');
                }
                out.clear();
            }
            dump.received()
        }
    };
    let p = pairing_async(|| batch_walk(path), decoded).await;
    figures.push(Figure::paired(
        "library dump, typed, decoded to JSON text",
        &p,
        Target::AtMost(1.05),
    ));
}

/// The library's typed dump as Arrow record batches, against the batched
/// walk in this process.
async fn library_table(url: &str, path: &Path, figures: &mut Vec<Figure>) {
    let client = Client::connect(url, ConnectOptions::default())
        .await
        .expect("the daemon answers");
    let map: MapName = "conns".parse().unwrap();
    let batches = || {
        let (client, map) = (&client, &map);
        async move {
            let options = DumpOptions::default();
            let mut table = client
                .dump_table(map, options, PerCpuColumns::List)
                .await
                .unwrap();
            let mut rows = 0;
            while let Some(batch) = table.next_batch().await.unwrap() {
                rows += batch.num_rows() as u64;
            }
            rows
        }
    };
    let p = pairing_async(|| batch_walk(path), batches).await;
    figures.push(Figure::paired(
        "library dump_table, typed record batches",
        &p,
        Target::AtMost(1.05),
    ));
}

/// A Python with pyarrow, pandas, grpcio and grpcio-tools
/// (`$BPFMAP_PYTHON_ARROW`, or python3).
fn arrow_python() -> Option<String> {
    let python = std::env::var("BPFMAP_PYTHON_ARROW").unwrap_or_else(|_| "python3".into());
    Command::new(&python)
        .args(["-c", "import pyarrow.flight, pandas, grpc, grpc_tools"])
        .output()
        .is_ok_and(|o| o.status.success())
        .then_some(python)
}

/// The Python process of the Arrow cases (`dump/arrow_read.py`), which
/// times each read itself.
struct PythonReader {
    child: std::process::Child,
    lines: std::io::Lines<std::io::BufReader<std::process::ChildStdout>>,
}

impl PythonReader {
    fn start(python: &str, url: &str, stubs: &Path) -> Self {
        let script = concat!(env!("CARGO_MANIFEST_DIR"), "/benches/dump/arrow_read.py");
        let mut child = Command::new(python)
            .args([script, url, "conns"])
            .arg(stubs)
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .spawn()
            .expect("python starts");
        let stdout = child.stdout.take().unwrap();
        let lines = std::io::BufRead::lines(std::io::BufReader::new(stdout));
        Self { child, lines }
    }

    /// One read (`flight`, `pandas` or `grpc`): the time it took.
    fn read(&mut self, what: &str) -> std::time::Duration {
        use std::io::Write as _;
        let stdin = self.child.stdin.as_mut().unwrap();
        writeln!(stdin, "{what}").unwrap();
        let line = self.lines.next().expect("an answer").unwrap();
        let (secs, rows) = line.split_once(' ').expect("SECONDS ROWS");
        assert_eq!(rows.parse::<u32>().unwrap(), N, "{what}: rows");
        std::time::Duration::from_secs_f64(secs.parse().unwrap())
    }
}

/// Stubs of MapService for grpcio, generated from the proto as a user of
/// Python would.
fn grpc_stubs(python: &str, dir: &Path) {
    let proto = concat!(env!("CARGO_MANIFEST_DIR"), "/../proto");
    let out = Command::new(python)
        .args(["-m", "grpc_tools.protoc", "-I", proto])
        .arg(format!("--python_out={}", dir.display()))
        .arg(format!("--grpc_python_out={}", dir.display()))
        .arg(format!("{proto}/bpfmap/v1/map_service.proto"))
        .output()
        .unwrap();
    bpfmap_tests::process::assert_success(&out);
}

/// pyarrow's read of the typed map's table (timed in the Python process),
/// against the batched walk in this process; grpcio's DumpMap with typed
/// JSON into a DataFrame, against pyarrow's table into one; the daemon's
/// peak memory before and after.
fn arrow(daemon: &DaemonProcess, path: &Path, figures: &mut Vec<Figure>) {
    let Some(python) = arrow_python() else {
        println!(
            "  no Python with pyarrow, pandas, grpcio and grpcio-tools: the Arrow cases are left out (set $BPFMAP_PYTHON_ARROW; pip install pyarrow pandas grpcio grpcio-tools)"
        );
        return;
    };
    let stubs = tempfile::tempdir().unwrap();
    grpc_stubs(&python, stubs.path());
    let mut reader = PythonReader::start(&python, &daemon.url(), stubs.path());
    let (_, peak_before) = daemon.rss_kib();
    let (mut reads, mut walks) = (Vec::new(), Vec::new());
    for _ in 0..super::RUNS {
        walks.push(super::once(&mut || batch_walk(path)));
        reads.push(reader.read("flight"));
    }
    let (_, peak_after) = daemon.rss_kib();
    figures.push(Figure::paired(
        "pyarrow.flight do_get().read_all(), typed (timed in Python)",
        &Pairing::of(reads, walks),
        Target::AtMost(1.3),
    ));
    let pandas = median((0..3).map(|_| reader.read("pandas")).collect());
    let grpc = reader.read("grpc");
    println!(
        "  into a pandas DataFrame: Flight {:.0} ms, grpcio DumpMap with typed JSON {:.0} ms; the daemon's peak RSS {} MiB before the Flight reads, {} MiB after",
        super::ms(pandas),
        super::ms(grpc),
        peak_before / 1024,
        peak_after / 1024
    );
    figures.push(Figure {
        case: "grpcio DumpMap typed JSON into a DataFrame, against Flight into one",
        measured: super::ratio(grpc, pandas),
        spread: None,
        target: Target::AtLeast(10.0),
    });
}

/// bpfmapctl through the relay against its own fan-out to the same
/// daemons.
fn relay(figures: &mut Vec<Figure>) {
    const DAEMONS: usize = 6;
    let fleet = LocalFleet::start(daemon_bin!(), DAEMONS, "bench/m", 200_000);
    let relay = RelayProcess::start(
        Path::new(env!("CARGO_BIN_EXE_test-bpfmap-relay")),
        &fleet.targets,
        32,
    );
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("targets");
    let listed: Vec<&str> = fleet.targets.iter().map(|t| t.as_str()).collect();
    std::fs::write(&file, listed.join("\n")).unwrap();
    let url = format!("http://{}", relay.addr);
    let direct = ["--targets-file", file.to_str().unwrap()];
    let relayed = ["--relay", url.as_str()];
    let p = pairing(|| ctl_fleet(&direct), || ctl_fleet(&relayed));
    figures.push(Figure::paired(
        "bpfmapctl --relay dump (6 daemons), against its direct fan-out",
        &p,
        Target::AtMost(1.2),
    ));
}

/// `bpfmapctl ARGS dump bench/m` as JSON Lines: the bytes it printed.
fn ctl_fleet(args: &[&str]) -> u64 {
    let out = Command::new(env!("CARGO_BIN_EXE_test-bpfmapctl"))
        .args(args)
        .args(["--format", "json", "dump", "bench/m"])
        .output()
        .unwrap();
    bpfmap_tests::process::assert_success(&out);
    out.stdout.len() as u64
}

/// The middle half of a case's pairs, as the report prints it.
fn spread_text(spread: Option<(f64, f64)>) -> String {
    spread.map_or_else(|| "-".to_owned(), |(lo, hi)| format!("{lo:.2}-{hi:.2}x"))
}

/// The figures last recorded: (case, figure) from the table of
/// tests/README.md's "The performance check".
fn recorded() -> Vec<(String, String)> {
    let readme = Path::new(env!("CARGO_MANIFEST_DIR")).join("README.md");
    let text = std::fs::read_to_string(readme).unwrap_or_default();
    let Some((_, section)) = text.split_once("## The performance check") else {
        return Vec::new();
    };
    section
        .lines()
        .skip_while(|l| !l.starts_with('|'))
        .take_while(|l| l.starts_with('|'))
        .filter_map(|l| {
            let cells: Vec<&str> = l.split('|').map(str::trim).collect();
            // | case | target | figure | commit |
            (cells.len() >= 5 && cells[3].ends_with('x'))
                .then(|| (cells[1].to_owned(), cells[3].to_owned()))
        })
        .collect()
}

fn report(figures: &[Figure]) {
    let last = recorded();
    println!(
        "\n{:<68} {:>8} {:>13} {:>9} {:>9}",
        "case", "now", "pairs", "target", "last"
    );
    for f in figures {
        let before = last
            .iter()
            .find(|(case, _)| case == f.case)
            .map_or("-", |(_, figure)| figure.as_str());
        let over = if f.target.met(f.measured) {
            ""
        } else {
            "  OVER"
        };
        println!(
            "{:<68} {:>7.2}x {:>13} {:>9} {:>9}{over}",
            f.case,
            f.measured,
            spread_text(f.spread),
            f.target.to_string(),
            before
        );
    }
    let over = figures.iter().filter(|f| !f.target.met(f.measured)).count();
    println!("{over} of {} cases over their target", figures.len());
    println!(
        "(now: the ratio of the medians; pairs: the middle half of the ratios of the pairs, how far one pair is from the next)"
    );
    let commit = Command::new("git")
        .args(["rev-parse", "--short=12", "HEAD"])
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map_or_else(
            || "(no git)".to_owned(),
            |o| String::from_utf8_lossy(&o.stdout).trim().to_owned(),
        );
    println!(
        "\nto record in tests/README.md:\n\n| case | target | figure | pairs | commit |\n|---|---|---|---|---|"
    );
    for f in figures {
        println!(
            "| {} | {} | {:.2}x | {} | {commit} |",
            f.case,
            f.target,
            f.measured,
            spread_text(f.spread)
        );
    }
}
