//! The performance check, run before a change to the typed model, the dump
//! path, the scans, bpfmapctl's output or the relay closes:
//!
//!     cargo bench -p bpfmap-tests --bench dump -- check      (as root)
//!
//! The main cases at the size their targets are stated for (maps of
//! 1,000,000 entries; the relay's six daemons of 200,000), each timed
//! alternately with its baseline in the same run: what a user runs, as
//! whole processes (bpfmapctl, bpftool, bpfmapctl through the relay), and
//! the library in this process. Each ratio is printed next to its target
//! and the last figure recorded in tests/README.md ("The performance
//! check"), saying which are over; then the table to record, with the
//! commit measured.

use std::{path::Path, process::Command};

use bpfmap_client::{Client, ConnectOptions, DumpOptions, MapName};
use bpfmap_tests::{
    BpfFs, MapType, daemon_bin,
    local_fleet::{LocalFleet, RelayProcess},
    process::DaemonProcess,
    u64_hash,
};

use super::{
    batch_walk, bpfmapctl, bpftool_dump, bpftool_installed, conns_of, paired, paired_async,
    walk_process,
};

/// Entries of each map. (Smaller maps make the fixed costs of a process
/// and a call weigh more than the targets allow for.)
const N: u32 = 1_000_000;

/// One case's figure.
struct Figure {
    case: &'static str,
    measured: f64,
    /// At most this (a ratio of times), or at least it (a speed-up).
    target: Target,
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
    let load = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    let busy: f64 = load
        .split_whitespace()
        .next()
        .and_then(|l| l.parse().ok())
        .unwrap_or(0.0);
    if busy > 0.5 {
        println!(
            "the machine is busy (load average {busy} over the last minute): figures measured now are not comparable"
        );
    }
    println!(
        "the performance check: {N} entries per map, medians, each case alternated with its baseline"
    );
    let mut figures = Vec::new();
    maps(rt, &mut figures);
    relay(&mut figures);
    report(&figures);
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
    rt.block_on(library(&url, &fs.path().join("conns"), figures));
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
        let (_, measured) = paired(floor(map), ctl(args));
        figures.push(Figure {
            case,
            measured,
            target,
        });
    }
    if bpftool_installed() {
        let path = root.join("conns");
        let (_, measured) = paired(ctl(&["dump", "conns"]), || bpftool_dump(&path));
        figures.push(Figure {
            case: "bpftool map dump -j, against bpfmapctl dump (typed)",
            measured,
            target: Target::AtLeast(15.0),
        });
    } else {
        println!("  bpftool is not installed: its case is left out (apt-get install bpftool)");
    }
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
    let (_, measured) = paired_async(|| batch_walk(path), decoded).await;
    figures.push(Figure {
        case: "library dump, typed, decoded to JSON text",
        measured,
        target: Target::AtMost(1.05),
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
    let (_, measured) = paired(|| ctl_fleet(&direct), || ctl_fleet(&relayed));
    figures.push(Figure {
        case: "bpfmapctl --relay dump (6 daemons), against its direct fan-out",
        measured,
        target: Target::AtMost(1.2),
    });
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
        "\n{:<68} {:>8} {:>9} {:>9}",
        "case", "now", "target", "last"
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
            "{:<68} {:>7.2}x {:>9} {:>9}{over}",
            f.case,
            f.measured,
            f.target.to_string(),
            before
        );
    }
    let over = figures.iter().filter(|f| !f.target.met(f.measured)).count();
    println!("{over} of {} cases over their target", figures.len());
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
        "\nto record in tests/README.md:\n\n| case | target | figure | commit |\n|---|---|---|---|"
    );
    for f in figures {
        println!(
            "| {} | {} | {:.2}x | {commit} |",
            f.case, f.target, f.measured
        );
    }
}
