//! Dump speed: bpfmapd against the kernel's own batched walk (the floor a
//! remote dump can approach) and the usual tools, every case measured in the
//! same run on the same maps, with the ratios the performance targets are
//! stated in.
//!
//!     cargo bench -p bpfmap-tests --bench dump               (as root)
//!     cargo bench -p bpfmap-tests --bench dump -- 100000     (only these sizes)
//!     cargo bench -p bpfmap-tests --bench dump -- check      (the performance check)
//!
//! bpftool (`apt-get install bpftool`) gives the `bpftool map dump -j`
//! baseline; without it that row says so.

#[path = "dump/check.rs"]
mod check;

use std::{
    path::Path,
    process::Command,
    time::{Duration, Instant},
};

use bpfmap_client::{Client, DumpOptions, MapName};
use bpfmap_kernel::{
    MapHandle, MapOps as _,
    walk::{Position, Walker},
};
use bpfmap_proto::v1::{self as pb, map_service_client::MapServiceClient};
use bpfmap_tests::{BpfFs, Daemon, MapType, OwnedMap, create_map, median, u64_hash, update_batch};

/// Samples per case (more for cases under 100 ms). Cases compared with a
/// baseline are timed alternately with it, so that a machine that slows
/// down or speeds up during the run moves both alike.
const RUNS: usize = 7;

/// Samples for a case whose first sample took `first`.
fn runs(first: Duration) -> usize {
    if first < Duration::from_millis(100) {
        RUNS * 3
    } else {
        RUNS
    }
}

/// The output files of the processes timed last, deleted before the next
/// run is timed: deleting a file of a dump's 183 MB takes tens of
/// milliseconds, which are not the tool's.
static SPENT: std::sync::Mutex<Vec<tempfile::NamedTempFile>> = std::sync::Mutex::new(Vec::new());

/// A process's output file, kept until the next run is about to be timed.
fn spent(file: tempfile::NamedTempFile) {
    SPENT.lock().unwrap().push(file);
}

/// Deletes the output files of the runs before (outside any timing).
fn clear_spent() {
    SPENT.lock().unwrap().clear();
}

fn once(f: &mut dyn FnMut() -> u64) -> Duration {
    clear_spent();
    let t = Instant::now();
    std::hint::black_box(f());
    t.elapsed()
}

/// The median of RUNS timings of `f`.
fn time(mut f: impl FnMut() -> u64) -> Duration {
    let first = once(&mut f);
    let mut samples = vec![first];
    samples.extend((1..runs(first)).map(|_| once(&mut f)));
    median(samples)
}

/// A candidate timed alternately with its baseline.
struct Pairing {
    /// The candidate's median.
    time: Duration,
    /// Its ratio to the baseline's median (both taken over the same
    /// stretch of time).
    ratio: f64,
    /// Each pair's ratio, in the order taken.
    pairs: Vec<f64>,
}

impl Pairing {
    fn of(times: Vec<Duration>, bases: Vec<Duration>) -> Self {
        let pairs = times
            .iter()
            .zip(&bases)
            .map(|(c, b)| ratio(*c, *b))
            .collect();
        let time = median(times);
        Self {
            time,
            ratio: ratio(time, median(bases)),
            pairs,
        }
    }

    /// The middle half of the pairs' ratios (their quartiles): how much
    /// the figure moves from one pair to the next.
    fn middle_half(&self) -> (f64, f64) {
        let mut sorted = self.pairs.clone();
        sorted.sort_by(f64::total_cmp);
        let n = sorted.len();
        (sorted[n / 4], sorted[(3 * n / 4).min(n - 1)])
    }
}

/// `candidate` timed alternately with `baseline`: the candidate's median,
/// and its ratio to the baseline's median (both taken over the same
/// stretch of time).
fn paired(baseline: impl FnMut() -> u64, candidate: impl FnMut() -> u64) -> (Duration, f64) {
    let p = pairing(baseline, candidate);
    (p.time, p.ratio)
}

/// [`paired`], with each pair's ratio.
fn pairing(mut baseline: impl FnMut() -> u64, mut candidate: impl FnMut() -> u64) -> Pairing {
    let (mut times, mut bases) = (Vec::new(), Vec::new());
    let mut n = RUNS;
    while times.len() < n {
        let b = once(&mut baseline);
        let c = once(&mut candidate);
        n = runs(c.max(b));
        times.push(c);
        bases.push(b);
    }
    Pairing::of(times, bases)
}

/// [`paired`], for a candidate that runs on the runtime.
async fn paired_async<F: std::future::Future<Output = u64>>(
    baseline: impl FnMut() -> u64,
    candidate: impl FnMut() -> F,
) -> (Duration, f64) {
    let p = pairing_async(baseline, candidate).await;
    (p.time, p.ratio)
}

/// [`pairing`], for a candidate that runs on the runtime.
async fn pairing_async<F: std::future::Future<Output = u64>>(
    mut baseline: impl FnMut() -> u64,
    mut candidate: impl FnMut() -> F,
) -> Pairing {
    let (mut times, mut bases) = (Vec::new(), Vec::new());
    let mut n = RUNS;
    while times.len() < n {
        let b = once(&mut baseline);
        clear_spent();
        let t = Instant::now();
        std::hint::black_box(candidate().await);
        let c = t.elapsed();
        n = runs(c.max(b));
        times.push(c);
        bases.push(b);
    }
    Pairing::of(times, bases)
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

fn ratio(a: Duration, b: Duration) -> f64 {
    a.as_secs_f64() / b.as_secs_f64()
}

fn key_by_key(path: &Path) -> u64 {
    let handle = MapHandle::open_pinned(path).unwrap();
    let ks = handle.meta().key_size as usize;
    let vs = handle.meta().kernel_value_size();
    let (mut key, mut next, mut value) = (vec![0u8; ks], vec![0u8; ks], vec![0u8; vs]);
    let mut first = true;
    let mut n = 0;
    loop {
        let prev = if first { None } else { Some(key.as_slice()) };
        if handle.get_next_key(prev, &mut next).is_err() {
            return n;
        }
        if handle.lookup(&next, &mut value).is_ok() {
            n += 1;
        }
        std::mem::swap(&mut key, &mut next);
        first = false;
    }
}

/// The floor: the kernel's batched walk, in-process, 5,000 entries a call.
fn batch_walk(path: &Path) -> u64 {
    batch_walk_by(path, 5000)
}

fn batch_walk_by(path: &Path, batch: u32) -> u64 {
    let handle = MapHandle::open_pinned(path).unwrap();
    let meta = handle.meta().clone();
    let mut w = Walker::new(handle, meta, Position::Start).unwrap();
    let mut n = 0;
    while let Some(c) = w.next_chunk(batch).unwrap() {
        n += c.count as u64;
    }
    n
}

async fn library_dump(client: &Client, map: &str, options: DumpOptions) -> u64 {
    let map: MapName = map.parse().unwrap();
    let mut dump = client.dump(&map, options);
    while dump.next_chunk().await.unwrap().is_some() {}
    dump.received()
}

/// The results: a line per case as it is measured, and the targets, met or
/// missed, at the end.
struct Report {
    lines: Vec<String>,
    missed: Vec<String>,
}

impl Report {
    /// A case: its median time, per entry, and its ratio to a baseline.
    fn row(&mut self, name: &str, d: Duration, n: u64, against: Option<(&str, f64)>) {
        let mut line = format!(
            "  {name:<58} {:>9.1} ms {:>8.3} us/entry",
            ms(d),
            d.as_secs_f64() * 1e6 / n.max(1) as f64
        );
        if let Some((what, r)) = against {
            line.push_str(&format!("  {r:>6.2}x {what}"));
        }
        println!("{line}");
    }

    fn target(&mut self, what: &str, measured: f64, unit: &str, limit: f64, at_most: bool) {
        let met = if at_most {
            measured <= limit
        } else {
            measured >= limit
        };
        let line = format!(
            "  {} {what}: {measured:.2}{unit} (target {} {limit}{unit})",
            if met { "met   " } else { "MISSED" },
            if at_most { "<=" } else { ">=" }
        );
        if !met {
            self.missed.push(line.clone());
        }
        self.lines.push(line);
    }
}

fn bpftool_installed() -> bool {
    Command::new("bpftool")
        .arg("version")
        .output()
        .is_ok_and(|o| o.status.success())
}

/// `bpftool map dump -j` of a pinned map, whole process, its output to a
/// file; returns the file's size.
fn bpftool_dump(path: &Path) -> u64 {
    let file = tempfile::NamedTempFile::new().unwrap();
    let status = Command::new("bpftool")
        .args(["map", "dump", "-j", "pinned"])
        .arg(path)
        .stdout(file.reopen().unwrap())
        .status()
        .unwrap();
    assert!(status.success());
    let len = file.as_file().metadata().unwrap().len();
    spent(file);
    len
}

/// Runs bpfmapctl as a user would, its output going to a file (deleted
/// before the next run is timed); returns the file's size.
fn bpfmapctl(url: &str, args: &[&str]) -> u64 {
    let ctl = Path::new(env!("CARGO_BIN_EXE_test-bpfmapctl"));
    let file = tempfile::NamedTempFile::new().unwrap();
    let out = Command::new(ctl)
        .args(["--addr", url])
        .args(args)
        .stdout(file.reopen().unwrap())
        .output()
        .unwrap();
    bpfmap_tests::process::assert_success(&out);
    let len = file.as_file().metadata().unwrap().len();
    spent(file);
    len
}

const FLOOR: &str = "BPF_MAP_LOOKUP_BATCH, 5000/call (the floor)";

/// A u64 -> u64 hash map of `n` entries: every client and tool against the
/// floor.
fn u64_hash_case(n: u32, rt: &tokio::runtime::Runtime, report: &mut Report) {
    let fs = BpfFs::new();
    let (fd, _) = u64_hash(&fs, "m", n, n);
    let path = fs.path().join("m");
    let n64 = u64::from(n);
    let floor = || {
        assert_eq!(batch_walk(&path), n64);
        n64
    };
    println!("{n} entries, hash, u64 -> u64:");
    report.row(FLOOR, time(floor), n64, None);
    let (d, r) = paired(floor, || {
        assert_eq!(key_by_key(&path), n64);
        n64
    });
    report.row("get_next_key + lookup", d, n64, Some(("the floor", r)));
    // Tools are whole processes: their floor is the walk in a process of
    // its own.
    let process_floor = || {
        assert_eq!(walk_process(&path), n64);
        n64
    };
    let (d, r) = paired(floor, process_floor);
    report.row(
        "the floor in a process of its own (the tools' floor)",
        d,
        n64,
        Some(("the floor", r)),
    );
    let bpftool = bpftool_installed().then(|| {
        let (d, r) = paired(process_floor, || bpftool_dump(&path));
        report.row(
            "bpftool map dump -j > file (whole process)",
            d,
            n64,
            Some(("the tools' floor", r)),
        );
        r
    });
    if bpftool.is_none() {
        println!("  bpftool map dump -j: bpftool not installed (apt-get install bpftool)");
    }

    rt.block_on(async {
        let state = tempfile::tempdir().unwrap();
        // 32 clients dump at once below: as many as one identity may
        // (plaintext callers from one address share an identity).
        let config = Daemon::config(fs.path(), state.path());
        let daemon = Daemon::start_with(bpfmapd::Config {
            limits: bpfmapd::Limits {
                max_dumps_per_identity: 32,
                ..config.limits.clone()
            },
            ..config
        })
        .await;
        let client = daemon.client().await;
        let (default, r) =
            paired_async(floor, || library_dump(&client, "m", DumpOptions::default())).await;
        report.row(
            "library, default options",
            default,
            n64,
            Some(("the floor", r)),
        );
        report.target(
            &format!("library, default options, {n} entries, vs the floor"),
            r,
            "x",
            1.10,
            true,
        );
        for (name, options) in [
            (
                "library, chunk_size 1024 (the old default)",
                DumpOptions::default().with_chunk_size(1024),
            ),
            (
                "library, entries layout (grpcurl's)",
                DumpOptions::default().with_packed(false),
            ),
        ] {
            let (d, r) = paired_async(floor, || library_dump(&client, "m", options.clone())).await;
            report.row(name, d, n64, Some(("the floor", r)));
        }

        // bpfmapctl to a file, whole process.
        let url = daemon.addr();
        let (ctl, r) = tokio::task::block_in_place(|| {
            paired(process_floor, || bpfmapctl(&url, &["dump", "m"]))
        });
        report.row(
            "bpfmapctl dump > file (JSON Lines, whole process)",
            ctl,
            n64,
            Some(("the tools' floor", r)),
        );
        report.target(
            &format!("bpfmapctl dump, {n} entries, vs the tools' floor"),
            r,
            "x",
            1.5,
            true,
        );
        if let Some(b) = bpftool {
            report.target(
                &format!("bpfmapctl dump, {n} entries, faster than bpftool map dump -j"),
                b / r,
                "x",
                10.0,
                false,
            );
        }

        if n >= 1_000_000 {
            // Time to the first chunk, default options, each sample on a
            // client of its own, connected and idle (a GetMap first), once
            // the dump before has ended; beside an RPC that does nothing.
            // (On one connection, what the cancelled dump before had in
            // flight, up to the 4 MiB connection window, comes first.)
            let stats = daemon.running.stats().clone();
            let mut samples = Vec::new();
            for _ in 0..21 {
                let fresh = daemon.client().await;
                fresh.get_map(&"m".parse().unwrap()).await.unwrap();
                let t = Instant::now();
                let mut dump = fresh.dump(&"m".parse().unwrap(), DumpOptions::default());
                assert!(dump.next_chunk().await.unwrap().is_some());
                samples.push(t.elapsed());
                drop(dump);
                while stats.active.load(std::sync::atomic::Ordering::SeqCst) > 0 {
                    tokio::time::sleep(Duration::from_millis(1)).await;
                }
            }
            let first = median(samples);
            let rpc = rpc_round_trip(&daemon.addr()).await;
            println!(
                "  {:<58} {:>9.3} ms   (an RPC that does nothing: {:.3} ms)",
                "time to the first chunk (median of 21)",
                ms(first),
                ms(rpc)
            );
            report.target(
                &format!("time to the first chunk, {n} entries"),
                ms(first),
                " ms",
                1.0,
                true,
            );
        }

        if n <= 100_000 {
            // 32 clients at once, each the whole map, each on its own
            // connection, against one client alone.
            let mut clients = Vec::new();
            for _ in 0..32 {
                clients.push(daemon.client().await);
            }
            let (mut alls, mut ones) = (Vec::new(), Vec::new());
            for _ in 0..RUNS {
                let t = Instant::now();
                library_dump(&client, "m", DumpOptions::default()).await;
                let one = t.elapsed();
                let t = Instant::now();
                let tasks: Vec<_> = clients
                    .iter()
                    .map(|c| {
                        let c = c.clone();
                        tokio::spawn(
                            async move { library_dump(&c, "m", DumpOptions::default()).await },
                        )
                    })
                    .collect();
                for task in tasks {
                    assert_eq!(task.await.unwrap(), n64);
                }
                let all = t.elapsed();
                alls.push(all);
                ones.push(one);
            }
            let (all, one) = (median(alls), median(ones));
            let rate = 32.0 * ratio(one, all);
            println!(
                "  {:<58} {:>9.1} ms   {:.2} M entries/s in all: {rate:.2}x one client's rate",
                "32 clients at once, each the whole map",
                ms(all),
                32.0 * n64 as f64 / all.as_secs_f64() / 1e6,
            );
            report.target(
                &format!("32 concurrent clients, {n} entries, aggregate rate vs one client"),
                rate,
                "x",
                1.0,
                false,
            );
        }
        daemon.stop().await;

        // The same over mutual TLS (rustls, ring).
        let pki = bpfmap_tests::pki::Pki::new();
        let (config, tls) = mtls(&pki, fs.path(), state.path());
        let tls_daemon = Daemon::start_with(config).await;
        let client = tls_daemon.tls_client(&tls).await.unwrap();
        let (d, r) =
            paired_async(floor, || library_dump(&client, "m", DumpOptions::default())).await;
        report.row(
            "library over mutual TLS, default options",
            d,
            n64,
            Some(("the floor", r)),
        );
        report.target(
            &format!("library over mTLS, default options, {n} entries, vs the floor"),
            r,
            "x",
            1.10,
            true,
        );
        tls_daemon.stop().await;
    });
    drop(fd);
}

/// The kernel's walk at several batch sizes, for the largest u64 hash and
/// for wide entries: what a chunk's size costs before anything is sent.
fn batch_case(sizes: &[u32], report: &mut Report) {
    let fs = BpfFs::new();
    let n = sizes.iter().copied().max().unwrap_or(1_000_000);
    let (fd, _) = u64_hash(&fs, "m", n, n);
    let wide = create_map(MapType::HASH, 64, 256, 100_000);
    fill(&wide, 100_000);
    fs.pin(&wide, "wide");
    for (map, what, entries) in [
        ("m", format!("{n} entries, hash, u64 -> u64"), u64::from(n)),
        (
            "wide",
            "wide entries (64-byte key, 256-byte value), 100K".to_string(),
            100_000,
        ),
    ] {
        let path = fs.path().join(map);
        let floor = || {
            assert_eq!(batch_walk(&path), entries);
            entries
        };
        println!("the kernel's walk by batch size, {what}:");
        report.row(FLOOR, time(floor), entries, None);
        for batch in [256, 1024, 4096, 16384, 65536] {
            let (d, r) = paired(floor, || {
                assert_eq!(batch_walk_by(&path, batch), entries);
                entries
            });
            report.row(
                &format!("BPF_MAP_LOOKUP_BATCH, {batch}/call"),
                d,
                entries,
                Some(("the floor", r)),
            );
        }
    }
    drop((fd, wide));
}

/// Fills `map` with `n` entries: key i (little-endian, zero-padded), the
/// value bytes all i % 251 (every CPU's, for per-CPU maps).
fn fill(map: &OwnedMap, n: u32) {
    let ks = map.meta().key_size as usize;
    let vs = map.meta().kernel_value_size();
    for start in (0..n).step_by(20_000) {
        let end = (start + 20_000).min(n);
        let (mut keys, mut values) = (Vec::new(), Vec::new());
        for i in start..end {
            let mut k = vec![0u8; ks];
            k[..4].copy_from_slice(&i.to_le_bytes());
            keys.extend_from_slice(&k);
            values.extend(std::iter::repeat_n((i % 251) as u8, vs));
        }
        update_batch(map, &keys, &values);
    }
}

/// A daemon configuration with mutual TLS that lets the client "bench"
/// dump every map, and that client's TLS files.
fn mtls(
    pki: &bpfmap_tests::pki::Pki,
    root: &Path,
    state: &Path,
) -> (bpfmapd::Config, bpfmap_client::ClientTls) {
    let config = bpfmapd::Config {
        tls: Some(pki.server_files()),
        rules: vec![bpfmapd::RuleConfig {
            identities: vec!["cn:bench".into()],
            maps: vec!["**".into()],
            operations: vec![bpfmapd::Operation::Dump],
        }],
        ..Daemon::config(root, state)
    };
    let tls = pki.client(
        "bench",
        bpfmap_tests::pki::Name::Cn("bench"),
        bpfmap_tests::pki::Validity::Now,
    );
    (config, tls)
}

/// Map shapes other than u64 -> u64: each against its own floor.
fn shapes(rt: &tokio::runtime::Runtime, report: &mut Report) {
    let fs = BpfFs::new();
    let n = 100_000u32;
    // A sparse hash: room for 4M, 1K entries. The walk visits every bucket.
    let sparse = create_map(MapType::HASH, 8, 8, 4 << 20);
    fill(&sparse, 1000);
    fs.pin(&sparse, "sparse");
    let wide = create_map(MapType::HASH, 64, 256, n);
    fill(&wide, n);
    fs.pin(&wide, "wide");
    let pcpu = create_map(MapType::PERCPU_HASH, 8, 8, n);
    fill(&pcpu, n);
    fs.pin(&pcpu, "percpu");
    let array = create_map(MapType::ARRAY, 4, 8, n);
    fill(&array, n);
    fs.pin(&array, "array");

    rt.block_on(async {
        let state = tempfile::tempdir().unwrap();
        let daemon = Daemon::start(fs.path(), state.path()).await;
        let client = daemon.client().await;
        // The same with more memory for queued data: each dump's share
        // (max_queued_bytes * 3/4 / max_dumps) holds five chunks of 1 MiB.
        let state_big = tempfile::tempdir().unwrap();
        let config = Daemon::config(fs.path(), state_big.path());
        let big = Daemon::start_with(bpfmapd::Config {
            limits: bpfmapd::Limits {
                max_queued_bytes: 512 << 20,
                ..config.limits.clone()
            },
            ..config
        })
        .await;
        let big_client = big.client().await;
        for (map, entries, what, limit) in [
            (
                "sparse",
                1000u64,
                "a sparse hash (4M max_entries, 1K entries)",
                1.5,
            ),
            (
                "wide",
                u64::from(n),
                "wide entries (64-byte key, 256-byte value), 100K",
                1.25,
            ),
            (
                "percpu",
                u64::from(n),
                "a per-CPU hash (u64 per CPU), 100K",
                1.25,
            ),
            ("array", u64::from(n), "an array (u64), 100K", 1.25),
        ] {
            let path = fs.path().join(map);
            let floor = || {
                assert_eq!(batch_walk(&path), entries);
                entries
            };
            println!("{what}:");
            report.row(FLOOR, time(floor), entries, None);
            let (d, r) =
                paired_async(floor, || library_dump(&client, map, DumpOptions::default())).await;
            report.row(
                "library, default options",
                d,
                entries,
                Some(("the floor", r)),
            );
            report.target(&format!("{what}, vs the floor"), r, "x", limit, true);
            let (d, r) = paired_async(floor, || {
                library_dump(&big_client, map, DumpOptions::default())
            })
            .await;
            report.row(
                "library, max_queued_bytes 512 MiB (1 MiB chunks)",
                d,
                entries,
                Some(("the floor", r)),
            );
        }
        daemon.stop().await;
        big.stop().await;
    });
}

/// ListMaps over 2,000 pinned maps, and GetMap of one of them.
fn catalog(rt: &tokio::runtime::Runtime, report: &mut Report) {
    let fs = BpfFs::new();
    let maps: Vec<OwnedMap> = (0..2000)
        .map(|i| {
            let m = create_map(MapType::HASH, 8, 8, 16);
            fs.pin(&m, &format!("app{}/map{i}", i % 20));
            m
        })
        .collect();
    println!("2,000 pinned maps:");
    rt.block_on(async {
        let state = tempfile::tempdir().unwrap();
        let daemon = Daemon::start(fs.path(), state.path()).await;
        let client = daemon.client().await;
        let mut lists = Vec::new();
        let mut gets = Vec::new();
        let map: MapName = "app7/map1007".parse().unwrap();
        for _ in 0..RUNS {
            let t = Instant::now();
            assert_eq!(client.list_maps().await.unwrap().len(), 2000);
            lists.push(t.elapsed());
            let t = Instant::now();
            assert_eq!(
                client.get_map(&map).await.unwrap().path(),
                Some("app7/map1007")
            );
            gets.push(t.elapsed());
        }
        let (list, get) = (median(lists), median(gets));
        let rpc = rpc_round_trip(&daemon.addr()).await;
        println!("  {:<58} {:>9.2} ms", "ListMaps", ms(list));
        println!(
            "  {:<58} {:>9.3} ms   (an RPC that does nothing: {:.3} ms)",
            "GetMap of one",
            ms(get),
            ms(rpc)
        );
        report.target("ListMaps over 2,000 maps", ms(list), " ms", 50.0, true);
        report.target("GetMap of one among 2,000", ms(get), " ms", 1.0, true);
        daemon.stop().await;
    });
    drop(maps);
}

/// A hash map of `n` entries with Cilium's IPv4 connection tracking layout
/// (`struct ipv4_ct_tuple` with its network-order members, `struct
/// ct_entry` with its bitfields), filled with distinct tuples.
fn cilium_ct4(n: u32) -> OwnedMap {
    use bpfmap_kernel::{BtfBuilder, BtfMember as M, CreateMap, IntEncoding::Unsigned, OwnedBtf};
    let mut b = BtfBuilder::new();
    let u8_ = b.add_int("unsigned char", 1, Unsigned);
    let u16_ = b.add_int("unsigned short", 2, Unsigned);
    let u32_ = b.add_int("unsigned int", 4, Unsigned);
    let u64_ = b.add_int("unsigned long long", 8, Unsigned);
    let (u8_t, u16_t) = (b.add_typedef("__u8", u8_), b.add_typedef("__u16", u16_));
    let (u32_t, u64_t) = (b.add_typedef("__u32", u32_), b.add_typedef("__u64", u64_));
    let (be16, be32) = (
        b.add_typedef("__be16", u16_t),
        b.add_typedef("__be32", u32_t),
    );
    let tuple = b.add_struct(
        "ipv4_ct_tuple",
        14,
        &[
            M::new("daddr", be32, 0),
            M::new("saddr", be32, 32),
            M::new("dport", be16, 64),
            M::new("sport", be16, 80),
            M::new("nexthdr", u8_t, 96),
            M::new("flags", u8_t, 104),
        ],
    );
    let mut members = Vec::new();
    for (i, name) in ["reserved0", "backend_id", "packets", "bytes"]
        .iter()
        .enumerate()
    {
        members.push(M::new(name, u64_t, 64 * i as u32));
    }
    members.push(M::new("lifetime", u32_t, 256));
    let flags = [
        "rx_closing",
        "tx_closing",
        "reserved1",
        "lb_loopback",
        "seen_non_syn",
        "node_port",
    ];
    for (i, name) in flags.iter().enumerate() {
        members.push(M::bitfield(name, u16_t, 288 + i as u32, 1));
    }
    members.push(M::bitfield("reserved3", u16_t, 294, 10));
    for (name, ty, bit) in [
        ("rev_nat_index", u16_t, 304),
        ("reserved4", u16_t, 320),
        ("tx_flags_seen", u8_t, 336),
        ("rx_flags_seen", u8_t, 344),
        ("src_sec_id", u32_t, 352),
        ("last_tx_report", u32_t, 384),
        ("last_rx_report", u32_t, 416),
    ] {
        members.push(M::new(name, ty, bit));
    }
    let entry = b.add_struct("ct_entry", 56, &members);
    let btf = OwnedBtf::load(&b.to_bytes()).unwrap();
    let map = OwnedMap::create(&CreateMap {
        map_type: MapType::HASH.0,
        key_size: 14,
        value_size: 56,
        max_entries: n.max(1),
        name: "cilium_ct4",
        btf: Some(btf.for_map(tuple, entry)),
        ..Default::default()
    })
    .unwrap();
    let (mut keys, mut values) = (Vec::new(), Vec::new());
    for i in 0..n {
        keys.extend_from_slice(&[10, (i >> 16) as u8, (i >> 8) as u8, i as u8]);
        keys.extend_from_slice(&[192, 168, 0, 2, 0x01, 0xbb]);
        keys.extend_from_slice(&((i % 50_000) as u16 + 1024).to_be_bytes());
        keys.extend_from_slice(&[6, 0]);
        let mut v = [0u8; 56];
        v[16..24].copy_from_slice(&u64::from(i).to_le_bytes());
        v[24..32].copy_from_slice(&(u64::from(i) * 1500).to_le_bytes());
        v[32..36].copy_from_slice(&3600u32.to_le_bytes());
        values.extend_from_slice(&v);
    }
    for (k, v) in keys.chunks(14 << 15).zip(values.chunks(56 << 15)) {
        update_batch(&map, k, v);
    }
    map
}

/// [`conns_of`] a hash map.
fn conns(n: u32) -> OwnedMap {
    conns_of(n, MapType::HASH)
}

/// `n` connections, a map of mixed members: key `{__u32 saddr; __u16
/// dport; enum proto (u8); __u8 pad}` (8 bytes), value `{__u64 packets,
/// bytes; char comm[8]; __s32 delta; __u32 lo:4, hi:12}` (32 bytes).
/// Connection i: saddr i, dport i % 50,000, proto TCP, UDP or ICMP,
/// packets i, bytes 1500 i, comm "proc" and i % 1000, delta -(i % 100),
/// lo i % 16, hi i % 4096; in a map of `map_type` (a per-CPU map has the
/// same value on every CPU).
fn conns_of(n: u32, map_type: MapType) -> OwnedMap {
    use bpfmap_kernel::{
        BtfBuilder, BtfMember as M, CreateMap,
        IntEncoding::{Char, Signed, Unsigned},
        OwnedBtf,
    };
    let mut b = BtfBuilder::new();
    let u8_ = b.add_int("unsigned char", 1, Unsigned);
    let u16_ = b.add_int("unsigned short", 2, Unsigned);
    let u32_ = b.add_int("unsigned int", 4, Unsigned);
    let u64_ = b.add_int("unsigned long long", 8, Unsigned);
    let s32 = b.add_int("int", 4, Signed);
    let char_ = b.add_int("char", 1, Char);
    let comm = b.add_array(char_, 8);
    let proto = b.add_enum("proto", 1, false, &[("TCP", 6), ("UDP", 17), ("ICMP", 1)]);
    let key = b.add_struct(
        "conn_key",
        8,
        &[
            M::new("saddr", u32_, 0),
            M::new("dport", u16_, 32),
            M::new("proto", proto, 48),
            M::new("pad", u8_, 56),
        ],
    );
    let value = b.add_struct(
        "conn_stats",
        32,
        &[
            M::new("packets", u64_, 0),
            M::new("bytes", u64_, 64),
            M::new("comm", comm, 128),
            M::new("delta", s32, 192),
            M::bitfield("lo", u32_, 224, 4),
            M::bitfield("hi", u32_, 228, 12),
        ],
    );
    let btf = OwnedBtf::load(&b.to_bytes()).unwrap();
    let map = OwnedMap::create(&CreateMap {
        map_type: map_type.0,
        key_size: 8,
        value_size: 32,
        max_entries: n.max(1),
        name: "conns",
        btf: Some(btf.for_map(key, value)),
        ..Default::default()
    })
    .unwrap();
    let cpus = match map_type {
        MapType::PERCPU_HASH | MapType::LRU_PERCPU_HASH | MapType::PERCPU_ARRAY => {
            bpfmap_kernel::possible_cpus() as usize
        }
        _ => 1,
    };
    let (mut keys, mut values) = (Vec::new(), Vec::new());
    for i in 0..n {
        keys.extend_from_slice(&i.to_le_bytes());
        keys.extend_from_slice(&((i % 50_000) as u16).to_le_bytes());
        keys.extend_from_slice(&[[6, 17, 1][i as usize % 3], 0]);
        let mut value = Vec::with_capacity(32);
        value.extend_from_slice(&u64::from(i).to_le_bytes());
        value.extend_from_slice(&(u64::from(i) * 1500).to_le_bytes());
        value.extend_from_slice(format!("proc{:03}\0", i % 1000).as_bytes());
        value.extend_from_slice(&(-((i % 100) as i32)).to_le_bytes());
        value.extend_from_slice(&((i % 16) | ((i % 4096) << 4)).to_le_bytes());
        for _ in 0..cpus {
            values.extend_from_slice(&value);
        }
    }
    for (k, v) in keys.chunks(8 << 15).zip(values.chunks((32 * cpus) << 15)) {
        update_batch(&map, k, v);
    }
    map
}

/// A typed map of `n` entries (the demo's flows, then a Cilium-shaped
/// connection tracking map): the tools against the kernel's walk of the
/// same map in a process of their own (bpfmapctl's typed JSON Lines,
/// bpftool's dump, which prints its `formatted` form too), then the
/// library: the packed transfer, decoded to JSON text on the client, and
/// decoded by the daemon (grpcurl's entries layout).
fn typed(n: u32, rt: &tokio::runtime::Runtime, report: &mut Report) {
    let flows = bpfmapd::typed_flows(n).unwrap();
    typed_case(
        n,
        TypedMap {
            name: "flows",
            what: "demo/flows types: 16-byte struct key, 16-byte struct value",
            map: &flows,
        },
        rt,
        report,
    );
    drop(flows);
    let ct = cilium_ct4(n);
    typed_case(
        n,
        TypedMap {
            name: "cilium_ct4",
            what: "Cilium's ipv4_ct_tuple -> ct_entry: 14 and 56 bytes, network order, bitfields",
            map: &ct,
        },
        rt,
        report,
    );
    drop(ct);
    let conns = conns(n);
    typed_case(
        n,
        TypedMap {
            name: "conns",
            what: "connections: 8-byte key with an enum, 32-byte value with text, a signed integer, bitfields",
            map: &conns,
        },
        rt,
        report,
    );
}

/// A typed map of the dump benchmark: its pin name, what it is, the map.
struct TypedMap<'a> {
    name: &'a str,
    what: &'a str,
    map: &'a OwnedMap,
}

fn typed_case(n: u32, typed: TypedMap<'_>, rt: &tokio::runtime::Runtime, report: &mut Report) {
    let TypedMap { name, what, map } = typed;
    let fs = BpfFs::new();
    fs.pin(map, name);
    let path = fs.path().join(name);
    let n64 = u64::from(n);
    println!("{n} typed entries ({what}):");
    let process_floor = || {
        assert_eq!(walk_process(&path), n64);
        n64
    };
    report.row(
        "the walk in a process of its own (the tools' floor)",
        time(process_floor),
        n64,
        None,
    );
    let bpftool = bpftool_installed().then(|| {
        let (d, r) = paired(process_floor, || bpftool_dump(&path));
        report.row(
            "bpftool map dump -j > file (whole process)",
            d,
            n64,
            Some(("the tools' floor", r)),
        );
        r
    });
    rt.block_on(async {
        let state = tempfile::tempdir().unwrap();
        let daemon = Daemon::start(fs.path(), state.path()).await;
        let url = daemon.addr();
        let (ctl, r) = tokio::task::block_in_place(|| {
            paired(process_floor, || bpfmapctl(&url, &["dump", name]))
        });
        report.row(
            "bpfmapctl dump > file (typed JSON Lines)",
            ctl,
            n64,
            Some(("the tools' floor", r)),
        );
        report.target(
            &format!("bpfmapctl typed dump of {name}, {n} entries, vs the tools' floor"),
            r,
            "x",
            1.1,
            true,
        );
        if let Some(b) = bpftool {
            report.target(
                &format!(
                    "bpfmapctl typed dump of {name}, {n} entries, faster than bpftool map dump -j"
                ),
                b / r,
                "x",
                15.0,
                false,
            );
        }
        typed_library(n, name, &daemon, report).await;
        daemon.stop().await;
    });
}

/// The library's rows of a typed case.
async fn typed_library(n: u32, name: &str, daemon: &Daemon, report: &mut Report) {
    let n64 = u64::from(n);
    let client = daemon.client().await;
    let map: MapName = name.parse().unwrap();
    let types = client
        .get_map(&map)
        .await
        .unwrap()
        .types()
        .unwrap()
        .expect("typed");
    let transfer = time_dump(&client, name).await;
    let mut decodes = Vec::new();
    for _ in 0..RUNS {
        let t = Instant::now();
        let mut dump = client.dump(&map, DumpOptions::default());
        let mut out = Vec::with_capacity(1 << 20);
        while let Some(chunk) = dump.next_chunk().await.unwrap() {
            for e in &chunk {
                types.write_entry_json(e, &mut out);
                out.push(b'\n');
            }
            out.clear();
        }
        assert_eq!(dump.received(), n64);
        decodes.push(t.elapsed());
    }
    let decoded = median(decodes);
    report.row(
        "library, packed, bytes only (the transfer)",
        transfer,
        n64,
        None,
    );
    report.row(
        "library, packed, decoded to JSON text on the client",
        decoded,
        n64,
        Some(("the transfer", ratio(decoded, transfer))),
    );
    let mut by_daemons = Vec::new();
    for _ in 0..RUNS {
        by_daemons.push(entries_dump(&daemon.addr(), name, n64).await);
    }
    let by_daemon = median(by_daemons);
    let mut undecoded = Vec::new();
    for _ in 0..RUNS {
        undecoded.push(entries_bytes(&daemon.addr(), name).await);
    }
    let undecoded = median(undecoded);
    report.row(
        "entries layout, received as bytes (no client decoding)",
        undecoded,
        n64,
        Some(("the transfer", ratio(undecoded, transfer))),
    );
    let r = ratio(by_daemon, transfer);
    report.row(
        "entries layout, decoded by the daemon (grpcurl's)",
        by_daemon,
        n64,
        Some(("the transfer", r)),
    );
    report.target(
        &format!("entries layout of {name}, {n} entries, vs the packed transfer"),
        r,
        "x",
        2.0,
        true,
    );
}

/// A dump in the entries layout received as bytes (the messages framed,
/// not decoded): the daemon's share of the entries layout.
async fn entries_bytes(addr: &str, name: &str) -> Duration {
    use bpfmap_client::pb;
    use prost::Message as _;
    let t = Instant::now();
    let request = pb::DumpMapRequest {
        map: Some(pb::MapRef {
            r#ref: Some(pb::map_ref::Ref::Path(name.into())),
            declare: None,
        }),
        ..Default::default()
    };
    let mut s = bpfmap_tests::raw_stream(
        addr,
        "/bpfmap.v1.MapService/DumpMap",
        request.encode_to_vec(),
    )
    .await
    .unwrap();
    let mut bytes = 0usize;
    while let Some(m) = s.message().await.unwrap() {
        bytes += m.len();
    }
    assert!(bytes > 0);
    t.elapsed()
}

/// A dump in the entries layout, as grpcurl asks for it, read with the
/// generated client: its time.
async fn entries_dump(addr: &str, name: &str, n: u64) -> Duration {
    use bpfmap_client::pb;
    let t = Instant::now();
    let channel = tonic::transport::Endpoint::from_shared(addr.to_owned())
        .unwrap()
        .connect()
        .await
        .unwrap();
    let mut raw =
        pb::map_service_client::MapServiceClient::new(channel).max_decoding_message_size(64 << 20);
    let mut s = raw
        .dump_map(pb::DumpMapRequest {
            map: Some(pb::MapRef {
                r#ref: Some(pb::map_ref::Ref::Path(name.into())),
                declare: None,
            }),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    let mut count = 0u64;
    while let Some(m) = s.message().await.unwrap() {
        count += m
            .entries
            .iter()
            .filter(|e| e.decoded_value.is_some())
            .count() as u64;
    }
    assert_eq!(count, n);
    t.elapsed()
}

/// The median round trip of a health check on a connected channel: what
/// any call costs here before it does anything.
async fn rpc_round_trip(addr: &str) -> Duration {
    use tonic_health::pb::{HealthCheckRequest, health_client::HealthClient};
    let channel = tonic::transport::Endpoint::from_shared(addr.to_owned())
        .unwrap()
        .tcp_nodelay(true)
        .connect()
        .await
        .unwrap();
    let mut health = HealthClient::new(channel);
    let mut samples = Vec::new();
    for _ in 0..21 {
        let t = Instant::now();
        health.check(HealthCheckRequest::default()).await.unwrap();
        samples.push(t.elapsed());
    }
    median(samples)
}

async fn time_dump(client: &Client, map: &str) -> Duration {
    let mut samples = Vec::new();
    for _ in 0..RUNS {
        let t = Instant::now();
        library_dump(client, map, DumpOptions::default()).await;
        samples.push(t.elapsed());
    }
    median(samples)
}

const SECTIONS: [&str; 8] = [
    "hash", "batch", "shapes", "catalog", "typed", "query", "profile", "check",
];

/// Only library dumps of a u64 hash, default options, over and over: a
/// steady load to run under a profiler (`perf record -g`), not part of the
/// default run.
fn profile(n: u32, rt: &tokio::runtime::Runtime) {
    let fs = BpfFs::new();
    // PROFILE_MAP=wide: 64-byte keys and 256-byte values instead of u64s.
    let fd = if std::env::var("PROFILE_MAP").is_ok_and(|m| m == "wide") {
        let wide = create_map(MapType::HASH, 64, 256, n);
        fill(&wide, n);
        fs.pin(&wide, "m");
        wide
    } else {
        u64_hash(&fs, "m", n, n).0
    };
    // The daemon on a runtime of its own (threads named "bpfmapd"), so that
    // its CPU time and the client's can be told apart.
    let daemon_rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .thread_name("bpfmapd")
        .enable_all()
        .build()
        .unwrap();
    let state = tempfile::tempdir().unwrap();
    let path = fs.path().join("m");
    let daemon = daemon_rt.block_on(Daemon::start(fs.path(), state.path()));
    rt.block_on(async {
        let client = daemon.client().await;
        profile_dumps(&client, &path, n, "library dumps").await;
    });
    daemon_rt.block_on(daemon.stop());
    let pki = bpfmap_tests::pki::Pki::new();
    let (config, tls) = mtls(&pki, fs.path(), state.path());
    let tls_daemon = daemon_rt.block_on(Daemon::start_with(config));
    rt.block_on(async {
        let client = tls_daemon.tls_client(&tls).await.unwrap();
        profile_dumps(&client, &path, n, "library dumps over mutual TLS").await;
    });
    daemon_rt.block_on(tls_daemon.stop());
    drop(fd);
}

/// Dumps over and over (`PROFILE_RUNS`, default 20), each followed by the
/// floor; prints the medians of the parts of a dump.
async fn profile_dumps(client: &Client, path: &Path, n: u32, what: &str) {
    let runs: usize = std::env::var("PROFILE_RUNS")
        .ok()
        .and_then(|r| r.parse().ok())
        .unwrap_or(20);
    let t = Instant::now();
    let (mut first, mut total, mut daemon_time, mut floor) = (vec![], vec![], vec![], vec![]);
    let (mut daemon_cpu, mut client_cpu, mut floor_cpu) =
        (Duration::ZERO, Duration::ZERO, Duration::ZERO);
    for _ in 0..runs {
        let cpu = thread_cpu();
        let start = Instant::now();
        let mut dump = client.dump(&"m".parse().unwrap(), DumpOptions::default());
        dump.next_chunk().await.unwrap();
        first.push(start.elapsed());
        while dump.next_chunk().await.unwrap().is_some() {}
        total.push(start.elapsed());
        assert_eq!(dump.received(), u64::from(n));
        let elapsed = dump.summary().and_then(|s| s.elapsed());
        daemon_time.push(elapsed.unwrap_or_default());
        let between = thread_cpu();
        daemon_cpu += between.0 - cpu.0;
        client_cpu += between.1 - cpu.1;
        floor.push(once(&mut || batch_walk(path)));
        let after = thread_cpu();
        floor_cpu += (after.0 + after.1) - (between.0 + between.1);
    }
    println!(
        "profile: {runs} {what} of {n} entries in {:.1} ms (medians: a dump {:.2} ms, \
         its first chunk {:.2} ms, the daemon's time {:.2} ms; the floor {:.2} ms)",
        ms(t.elapsed()),
        ms(median(total)),
        ms(median(first)),
        ms(median(daemon_time)),
        ms(median(floor)),
    );
    println!(
        "  CPU time per dump: the daemon's {:.1} ms, the client's {:.1} ms; per floor {:.1} ms",
        ms(daemon_cpu / runs as u32),
        ms(client_cpu / runs as u32),
        ms(floor_cpu / runs as u32),
    );
}

/// The CPU time (user and system) of this process's threads so far: those
/// of the daemon's runtime (named "bpfmapd") and the others. In clock ticks
/// of /proc (10 ms each): sum many runs.
fn thread_cpu() -> (Duration, Duration) {
    let (mut daemon, mut others) = (0, 0);
    for task in std::fs::read_dir("/proc/self/task").unwrap().flatten() {
        let Ok(stat) = std::fs::read_to_string(task.path().join("stat")) else {
            continue; // the thread exited
        };
        let name = &stat[stat.find('(').unwrap() + 1..stat.rfind(')').unwrap()];
        // utime and stime are the 12th and 13th fields after the name.
        let ticks: u64 = stat[stat.rfind(')').unwrap() + 2..]
            .split_whitespace()
            .skip(11)
            .take(2)
            .map(|v| v.parse::<u64>().unwrap())
            .sum();
        if name == "bpfmapd" {
            daemon += ticks;
        } else {
            others += ticks;
        }
    }
    (
        Duration::from_millis(daemon * 10),
        Duration::from_millis(others * 10),
    )
}

/// The floor as a process of its own: this program, asked to walk a map
/// and exit (`__walk PATH`).
fn walk_process(path: &Path) -> u64 {
    let out = Command::new(std::env::current_exe().unwrap())
        .arg("__walk")
        .arg(path)
        .output()
        .unwrap();
    assert!(out.status.success());
    String::from_utf8(out.stdout)
        .unwrap()
        .trim()
        .parse()
        .unwrap()
}

/// Entries per `BPF_MAP_LOOKUP_BATCH` call of the daemon's dumps, and the
/// size of its chunks with the default limits: [`send_walks`] reads and
/// sends as the daemon does.
const DAEMON_READ: u32 = 1024;
const DAEMON_CHUNK_BYTES: usize = 96 << 10;

/// Listens on a loopback port (printed on the first line of stdout) and
/// sends each connection the map at `path`, walked with batched calls on
/// one thread and written by another, the keys and values of each chunk
/// as they come from the kernel: a transfer with no RPC and no encoding,
/// about the least a daemon's dump can take on this machine. Runs until
/// killed.
fn send_walks(path: &Path) {
    use std::io::Write as _;
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("a loopback port");
    println!("{}", listener.local_addr().unwrap().port());
    std::io::stdout().flush().unwrap();
    for conn in listener.incoming() {
        let mut conn = conn.expect("a connection");
        conn.set_nodelay(true).unwrap();
        let (tx, rx) = std::sync::mpsc::sync_channel::<Vec<u8>>(4);
        let writer = std::thread::spawn(move || {
            for chunk in rx {
                conn.write_all(&chunk).expect("the reader takes the map");
            }
        });
        let handle = MapHandle::open_pinned(path).unwrap();
        let meta = handle.meta().clone();
        let mut walk = Walker::new(handle, meta, Position::Start).unwrap();
        let mut chunk = Vec::with_capacity(2 * DAEMON_CHUNK_BYTES);
        while let Some(c) = walk.next_chunk(DAEMON_READ).unwrap() {
            chunk.extend_from_slice(&c.keys);
            chunk.extend_from_slice(&c.values);
            if chunk.len() >= DAEMON_CHUNK_BYTES {
                let next = Vec::with_capacity(2 * DAEMON_CHUNK_BYTES);
                tx.send(std::mem::replace(&mut chunk, next)).unwrap();
            }
        }
        tx.send(chunk).unwrap();
        drop(tx);
        writer.join().unwrap();
    }
}

fn main() {
    // `cargo bench` adds `--bench`.
    let argv: Vec<String> = std::env::args().filter(|a| a != "--bench").collect();
    if let [_, walk, path] = &argv[..]
        && walk == "__walk"
    {
        println!("{}", batch_walk(Path::new(path)));
        return;
    }
    // `__send PATH`: the walk sent over loopback TCP, for the check's
    // reference (see `send_walks`).
    if let [_, send, path] = &argv[..]
        && send == "__send"
    {
        send_walks(Path::new(path));
        return;
    }
    // `-- __pin SHAPE N PATH`: one of the typed maps (flows, cilium_ct4,
    // conns, pconns: conns as a per-CPU hash) pinned at PATH on a bpffs,
    // for profiling by hand.
    if let [_, pin, shape, n, path] = &argv[..]
        && pin == "__pin"
    {
        let n: u32 = n.parse().expect("N: a number of entries");
        let map = match shape.as_str() {
            "flows" => bpfmapd::typed_flows(n).unwrap(),
            "cilium_ct4" => cilium_ct4(n),
            "conns" => conns(n),
            "pconns" => conns_of(n, MapType::PERCPU_HASH),
            other => panic!("unknown shape {other:?}: flows, cilium_ct4, conns or pconns"),
        };
        map.pin(Path::new(path)).expect("pin the map");
        return;
    }
    let args: Vec<String> = std::env::args()
        .skip(1)
        .filter(|a| !a.starts_with('-'))
        .collect();
    let mut sizes: Vec<u32> = args.iter().filter_map(|a| a.parse().ok()).collect();
    if sizes.is_empty() {
        sizes = vec![100_000, 1_000_000];
    }
    let mut sections: Vec<&str> = args
        .iter()
        .filter(|a| a.parse::<u32>().is_err())
        .map(|a| {
            SECTIONS
                .iter()
                .copied()
                .find(|s| s == a)
                .unwrap_or_else(|| panic!("unknown section {a:?}: one of {SECTIONS:?}"))
        })
        .collect();
    if sections.is_empty() {
        sections = SECTIONS.to_vec();
        sections.retain(|s| !matches!(*s, "profile" | "check"));
    }
    let rt = tokio::runtime::Runtime::new().unwrap();
    if sections == ["check"] {
        check::run(&rt);
        clear_spent();
        return;
    }
    println!(
        "medians of {RUNS} runs ({} under 100 ms); {} CPUs; a case and its baseline run alternately, and its ratio is of their medians",
        RUNS * 3,
        bpfmap_kernel::possible_cpus()
    );
    let mut report = Report {
        lines: Vec::new(),
        missed: Vec::new(),
    };
    if sections.contains(&"profile") {
        for &n in &sizes {
            profile(n, &rt);
        }
    }
    if sections.contains(&"hash") {
        for &n in &sizes {
            u64_hash_case(n, &rt, &mut report);
        }
    }
    if sections.contains(&"batch") {
        batch_case(&sizes, &mut report);
    }
    if sections.contains(&"shapes") {
        shapes(&rt, &mut report);
    }
    if sections.contains(&"catalog") {
        catalog(&rt, &mut report);
    }
    if sections.contains(&"typed") {
        for &n in &sizes {
            typed(n, &rt, &mut report);
        }
    }
    if sections.contains(&"query") {
        for &n in &sizes {
            queries(n, &rt, &mut report);
        }
    }
    println!("\ntargets:");
    for l in &report.lines {
        println!("{l}");
    }
    println!(
        "{} of {} targets met",
        report.lines.len() - report.missed.len(),
        report.lines.len()
    );
    clear_spent();
}

/// The filter of the filtered dump: 1 % of the query flows.
const ONE_PERCENT: &str = "key.sport < 1624 && key.dport == 443";

/// `n` flows with the demo's types (`bpfmapd::typed_flows`), but `n / 100`
/// destinations (10,000 at 1M: the aggregate's groups): flow i has daddr
/// 192.168.0.0 + i % (n / 100), sport 1024 + i % 60,000, dport 443, the
/// demo's values. Made from the demo's map, emptied and filled again.
fn query_flows(n: u32) -> OwnedMap {
    let map = bpfmapd::typed_flows(n).unwrap();
    for i in 0..n {
        map.delete(&bpfmapd::flow_key(i)).unwrap();
    }
    let groups = (n / 100).max(1);
    let (mut keys, mut values) = (Vec::new(), Vec::new());
    for i in 0..n {
        let mut k = bpfmapd::flow_key(i);
        k[4..8].copy_from_slice(&(0xC0A8_0000 | (i % groups)).to_ne_bytes());
        keys.extend_from_slice(&k);
        values.extend_from_slice(&bpfmapd::flow_value(i));
    }
    for (k, v) in keys.chunks(16 << 16).zip(values.chunks(16 << 16)) {
        update_batch(&map, k, v);
    }
    map
}

/// How many query flows [`ONE_PERCENT`] selects.
fn one_percent(n: u32) -> u64 {
    (0..n).filter(|i| i % 60_000 < 600).count() as u64
}

type Grpc = MapServiceClient<tonic::transport::Channel>;

/// A filtered packed dump of the query flows, walked inside the kernel
/// (`kernel`: SCAN_KERNEL) or read in batches; the entries it sent.
async fn filtered_dump(mut c: Grpc, want: u64, kernel: bool) -> u64 {
    let req = pb::DumpMapRequest {
        map: bpfmap_tests::map_ref("flows"),
        filter: ONE_PERCENT.into(),
        layout: pb::Layout::Packed as i32,
        scan: if kernel {
            pb::ScanMethod::ScanKernel
        } else {
            pb::ScanMethod::ScanAuto
        } as i32,
        ..Default::default()
    };
    let mut stream = c.dump_map(req).await.unwrap().into_inner();
    let mut n = 0;
    while let Some(m) = stream.message().await.unwrap() {
        n += m.packed.map_or(0, |p| u64::from(p.count));
        if let Some(s) = m.summary {
            assert_eq!(s.scanned_in_kernel, kernel, "{}", s.scan_note);
        }
    }
    assert_eq!(n, want);
    n
}

/// The ten destinations with the most bytes, walked inside the kernel
/// (`kernel`) or read in batches; the entries it grouped.
async fn top_destinations(mut c: Grpc, groups: u64, kernel: bool) -> u64 {
    let req = pb::AggregateMapRequest {
        map: bpfmap_tests::map_ref("flows"),
        group_by: vec!["key.daddr".into()],
        aggregates: vec![pb::Aggregate {
            op: pb::aggregate::Op::Sum as i32,
            field: "value.bytes".into(),
        }],
        limit: 10,
        scan: scan_method(kernel),
        ..Default::default()
    };
    let r = c.aggregate_map(req).await.unwrap().into_inner();
    let s = r.summary.unwrap();
    assert_eq!((r.groups.len(), s.groups_total), (10, groups));
    assert_eq!(s.scanned_in_kernel, kernel, "{}", s.scan_note);
    s.entries_matched
}

fn scan_method(kernel: bool) -> i32 {
    if kernel {
        pb::ScanMethod::ScanAuto as i32
    } else {
        pb::ScanMethod::ScanBatched as i32
    }
}

/// COUNT of the entries `filter` takes (all without one), walked inside
/// the kernel or read in batches.
async fn count_entries(mut c: Grpc, filter: &str, want: u64, kernel: bool) -> u64 {
    let req = pb::AggregateMapRequest {
        map: bpfmap_tests::map_ref("flows"),
        filter: filter.into(),
        aggregates: vec![pb::Aggregate {
            op: pb::aggregate::Op::Count as i32,
            field: String::new(),
        }],
        scan: scan_method(kernel),
        ..Default::default()
    };
    let r = c.aggregate_map(req).await.unwrap().into_inner();
    let s = r.summary.unwrap();
    assert_eq!(s.entries_matched, want);
    assert_eq!(s.scanned_in_kernel, kernel, "{}", s.scan_note);
    want
}

/// CPU time (user and system) of this process, the daemon's included.
fn cpu_time() -> Duration {
    let mut u = std::mem::MaybeUninit::<libc::rusage>::zeroed();
    // SAFETY: getrusage fills the struct it is given.
    #[allow(unsafe_code)]
    let u = unsafe {
        libc::getrusage(libc::RUSAGE_SELF, u.as_mut_ptr());
        u.assume_init()
    };
    let tv = |t: libc::timeval| Duration::new(t.tv_sec as u64, t.tv_usec as u32 * 1000);
    tv(u.ru_utime) + tv(u.ru_stime)
}

/// Scans in the kernel against the same questions read in batches, each
/// against the floor walk in the same run: the top 10, a count, a count
/// filtered to 1 %; then CPU seconds per scan both ways.
async fn kernel_scans(n: u32, c: &Grpc, floor: &impl Fn() -> u64, report: &mut Report) {
    let n64 = u64::from(n);
    let groups = u64::from((n / 100).max(1));
    let want = one_percent(n);
    let cases: [(String, f64, f64); 3] = [
        (format!("AggregateMap top 10 of {groups} groups"), 1.5, 0.6),
        ("COUNT of the entries".into(), 1.2, 0.3),
        (format!("COUNT filtered to 1 % ({ONE_PERCENT})"), 1.2, 0.6),
    ];
    for (i, (what, batched_target, kernel_target)) in cases.iter().enumerate() {
        for kernel in [false, true] {
            let run = || {
                let c = c.clone();
                async move {
                    match i {
                        0 => top_destinations(c, groups, kernel).await,
                        1 => count_entries(c, "", n64, kernel).await,
                        _ => count_entries(c, ONE_PERCENT, want, kernel).await,
                    }
                }
            };
            let (d, r) = paired_async(floor, run).await;
            let how = if kernel { "in the kernel" } else { "batched" };
            report.row(&format!("{what}, {how}"), d, n64, Some(("the floor", r)));
            // The batched reads' one target is the top 10's, from before.
            let target = if kernel {
                Some(*kernel_target)
            } else {
                (i == 0).then_some(*batched_target)
            };
            if let Some(target) = target {
                report.target(
                    &format!("{what}, {how}, {n} typed flows, vs the floor"),
                    r,
                    "x",
                    target,
                    true,
                );
            }
            let before = cpu_time();
            for _ in 0..3 {
                run().await;
            }
            let cpu = (cpu_time() - before) / 3;
            println!("  {:<58} {:>9.1} ms CPU per scan", "", ms(cpu));
        }
    }
}

/// Queries in the daemon on `n` demo-shaped typed flows: a dump filtered
/// to 1 % of the entries and a top 10 by bytes of `n / 100` destinations,
/// each timed alternately with the floor walk of the same map; then the
/// compiled filter alone, in entries per second on one core.
fn queries(n: u32, rt: &tokio::runtime::Runtime, report: &mut Report) {
    let fs = BpfFs::new();
    let map = query_flows(n);
    fs.pin(&map, "flows");
    let path = fs.path().join("flows");
    let n64 = u64::from(n);
    let groups = u64::from((n / 100).max(1));
    println!("{n} typed flows, {groups} destinations: queries in the daemon");
    let floor = || {
        assert_eq!(batch_walk(&path), n64);
        n64
    };
    report.row(FLOOR, time(floor), n64, None);
    rt.block_on(async {
        let state = tempfile::tempdir().unwrap();
        let daemon = Daemon::start(fs.path(), state.path()).await;
        let c = MapServiceClient::connect(daemon.addr())
            .await
            .unwrap()
            .max_decoding_message_size(64 << 20);
        let want = one_percent(n);
        for kernel in [false, true] {
            let (d, r) = paired_async(floor, || filtered_dump(c.clone(), want, kernel)).await;
            let how = if kernel { "in the kernel" } else { "batched" };
            let what = format!("DumpMap, packed, filtered to 1 % ({want}: {ONE_PERCENT}), {how}");
            report.row(&what, d, n64, Some(("the floor", r)));
            report.target(
                &format!("dump filtered to 1 %, {n} typed flows, {how}, vs the floor"),
                r,
                "x",
                if kernel { 0.6 } else { 1.25 },
                true,
            );
        }
        kernel_scans(n, &c, &floor, report).await;
        let info = c
            .clone()
            .get_map(pb::GetMapRequest {
                map: bpfmap_tests::map_ref("flows"),
            })
            .await
            .unwrap()
            .into_inner();
        filter_rates(n, &map, &info, report);
        daemon.stop().await;
    });
    scan_shapes(n, rt, report);
}

/// Filters evaluated on the compiled path over the map's entries in
/// memory, one thread: entries per second per core.
fn filter_rates(n: u32, map: &OwnedMap, info: &pb::MapInfo, report: &mut Report) {
    let path_walk = {
        let fs = BpfFs::new();
        fs.pin(map, "m");
        let handle = MapHandle::open_pinned(&fs.path().join("m")).unwrap();
        let meta = handle.meta().clone();
        let mut w = Walker::new(handle, meta, Position::Start).unwrap();
        let (mut keys, mut values) = (Vec::new(), Vec::new());
        while let Some(c) = w.next_chunk(5000).unwrap() {
            keys.extend_from_slice(&c.keys);
            values.extend_from_slice(&c.values);
        }
        (keys, values)
    };
    let (keys, values) = path_walk;
    let shape = bpfmapd::query::MapLayout::new(
        info.key_type.as_ref(),
        info.value_type.as_ref(),
        bpfmap_proto::typed::MapShape::new(16, 16),
    )
    .expect("the flows' layout");
    group_table_rate(n, &keys, &values, &shape, report);
    let filters = [
        ONE_PERCENT,
        "key.proto == \"IPPROTO_UDP\"",
        "value.bytes > 1000000 && key.dport in [80, 443, 8080] || key.saddr % 7 == 3",
    ];
    for (i, source) in filters.into_iter().enumerate() {
        let filter = bpfmapd::query::Filter::compile(source, &shape).unwrap();
        let run = || {
            let mut matched = 0u64;
            for (k, v) in keys.chunks_exact(16).zip(values.chunks_exact(16)) {
                let e = bpfmapd::query::EntryRef {
                    key: k,
                    value: v,
                    stride: 0,
                };
                matched += u64::from(filter.matches(std::hint::black_box(&e)));
            }
            matched
        };
        let d = time(run);
        let rate = f64::from(n) / d.as_secs_f64() / 1e6;
        report.row(
            &format!("Filter::matches, one core: {source}"),
            d,
            u64::from(n),
            None,
        );
        println!("  {:<58} {rate:>9.1} M entries/s", "");
        if i < 2 {
            report.target(
                &format!("filter evaluation ({source}), M entries/s per core"),
                rate,
                "M/s",
                20.0,
                false,
            );
        }
    }
}

/// The aggregate's group table alone over the entries in memory, one
/// thread: what AggregateMap adds to the walk.
fn group_table_rate(
    n: u32,
    keys: &[u8],
    values: &[u8],
    shape: &bpfmapd::query::MapLayout,
    report: &mut Report,
) {
    let req = pb::AggregateMapRequest {
        group_by: vec!["key.daddr".into()],
        aggregates: vec![pb::Aggregate {
            op: pb::aggregate::Op::Sum as i32,
            field: "value.bytes".into(),
        }],
        limit: 10,
        ..Default::default()
    };
    let spec = bpfmapd::query::Spec::new(&req, shape, 100_000).unwrap();
    let run = || {
        let mut table = spec.table();
        for (k, v) in keys.chunks_exact(16).zip(values.chunks_exact(16)) {
            table.add(&bpfmapd::query::EntryRef {
                key: k,
                value: v,
                stride: 0,
            });
        }
        table.finish().unwrap().1
    };
    let d = time(run);
    report.row(
        "the group table alone, one core (key.daddr, SUM(value.bytes))",
        d,
        u64::from(n),
        None,
    );
}

/// Distinct `key.dport` values of the scan-shape connections.
const CONN_PORTS: u32 = 50_000;

/// The filter of the scan-shape filtered dump: about 1 % of the
/// connections.
const FEW_PACKETS: &str = "value.packets < 10000";

/// Connection `i` of the scan-shape maps (`bpfmap_tests::conns`), on CPU
/// `cpu`: saddr 10.0.0.0 + i, dport i % 50,000, proto TCP, UDP, ICMP in
/// turn, packets a permutation of 0..1,000,000 (plus the CPU), bytes 1,500
/// a packet, delta -1,000..1,000, lo and hi bitfields.
fn conn(i: u32, cpu: u32) -> bpfmap_tests::conns::Conn {
    let packets = (u64::from(i) * 7919) % 1_000_000 + u64::from(cpu);
    bpfmap_tests::conns::Conn {
        saddr: 0x0A00_0000 | i,
        dport: (i % CONN_PORTS) as u16,
        proto: bpfmap_tests::conns::PROTOS[(i % 3) as usize].1,
        packets,
        bytes: packets * 1500,
        comm: *b"conn\0\0\0\0",
        delta: (i % 2001) as i32 - 1000,
        lo: i % 16,
        hi: (i / 16) % 4096,
    }
}

/// A connection map of `n` entries of `map_type`, pinned at `name`.
fn conn_map(fs: &BpfFs, name: &str, map_type: MapType, n: u32) -> OwnedMap {
    let map = bpfmap_tests::conns::map(map_type, n);
    bpfmap_tests::conns::fill(&map, n, conn);
    fs.pin(&map, name);
    map
}

/// A top 10 of connections: the groups of `group_by` (there are `groups`)
/// by SUM(`sum`), of the map pinned at `map`.
#[derive(Debug, Clone, Copy)]
struct ConnTop {
    map: &'static str,
    group_by: &'static str,
    sum: &'static str,
    groups: u64,
}

/// [`ConnTop`] through AggregateMap, read as `scan` says; its summary.
async fn top_conns(mut c: Grpc, top: ConnTop, scan: pb::ScanMethod) -> pb::AggregateSummary {
    let req = pb::AggregateMapRequest {
        map: bpfmap_tests::map_ref(top.map),
        group_by: vec![top.group_by.into()],
        aggregates: vec![pb::Aggregate {
            op: pb::aggregate::Op::Sum as i32,
            field: top.sum.into(),
        }],
        limit: 10,
        scan: scan as i32,
        ..Default::default()
    };
    let r = c.aggregate_map(req).await.unwrap().into_inner();
    let s = r.summary.unwrap();
    assert_eq!(
        (r.groups.len() as u64, s.groups_total),
        (top.groups.min(10), top.groups)
    );
    if scan == pb::ScanMethod::ScanBatched {
        assert!(!s.scanned_in_kernel);
    }
    s
}

/// How a scan ran, for a row's name.
fn walked(s: &pb::AggregateSummary) -> String {
    if s.scanned_in_kernel {
        "in the kernel".into()
    } else if s.scan_note.is_empty() {
        "batched".into()
    } else {
        format!("batched: {}", s.scan_note)
    }
}

/// The floor walks of the scan-shape maps: the hash, the per-CPU hash.
struct ConnFloors<'a> {
    hash: &'a dyn Fn() -> u64,
    per_cpu: &'a dyn Fn() -> u64,
}

impl ConnFloors<'_> {
    /// The floor of the map pinned at `map`.
    fn of(&self, map: &str) -> &dyn Fn() -> u64 {
        if map == "pconns" {
            self.per_cpu
        } else {
            self.hash
        }
    }
}

/// The daemon of the scan-shape cases: groups up to 1,000,000
/// (limits.max_groups), for the sweep of [`group_sweep`].
async fn sweep_daemon(fs: &BpfFs, state: &Path) -> Daemon {
    let mut config = Daemon::config(fs.path(), state);
    config.limits.max_groups = 1_000_000;
    Daemon::start_with(config).await
}

/// The shapes of scans inside the kernel on `n` connections
/// (`bpfmap_tests::conns`, 32-byte values): a top 10 of 50,000 groups by
/// a `__u16` member and of 3 by an enum, a dump filtered to 1 %, a top 10
/// of a per-CPU hash, each against the floor walk of its own map in the
/// same run; the two tops also as a user runs them (bpfmapctl, a process
/// of its own); then where a hash group table stops paying.
fn scan_shapes(n: u32, rt: &tokio::runtime::Runtime, report: &mut Report) {
    let fs = BpfFs::new();
    let hash = conn_map(&fs, "conns", MapType::HASH, n);
    let _per_cpu = conn_map(&fs, "pconns", MapType::PERCPU_HASH, n);
    let n64 = u64::from(n);
    println!("{n} connections (32-byte values), and as a per-CPU hash: scan shapes");
    let floor_of = |name: &str| {
        let path = fs.path().join(name);
        move || {
            assert_eq!(batch_walk(&path), n64);
            n64
        }
    };
    let (floor, per_cpu_floor) = (floor_of("conns"), floor_of("pconns"));
    report.row(FLOOR, time(&floor), n64, None);
    let per_cpu_name = format!("{FLOOR}, per-CPU");
    report.row(&per_cpu_name, time(&per_cpu_floor), n64, None);
    let floors = ConnFloors {
        hash: &floor,
        per_cpu: &per_cpu_floor,
    };
    rt.block_on(async {
        let state = tempfile::tempdir().unwrap();
        let daemon = sweep_daemon(&fs, state.path()).await;
        let c = MapServiceClient::connect(daemon.addr())
            .await
            .unwrap()
            .max_decoding_message_size(64 << 20);
        conn_tops(n, &c, &floors, report).await;
        conn_dumps(n, &c, &floor, report).await;
        conn_tops_by_process(n, &daemon.addr(), &floors, report);
        group_sweep(n, &hash, &c, &floor, report).await;
        daemon.stop().await;
    });
}

/// The tops of the scan shapes, batched and with SCAN_AUTO, against the
/// floor of their map.
async fn conn_tops(n: u32, c: &Grpc, floors: &ConnFloors<'_>, report: &mut Report) {
    let ports = u64::from(CONN_PORTS.min(n));
    let tops = [
        ("50,000 groups (key.dport)", "conns", "key.dport", ports),
        ("3 groups (key.proto)", "conns", "key.proto", 3),
        (
            "per-CPU hash, 50,000 groups (key.dport)",
            "pconns",
            "key.dport",
            ports,
        ),
    ];
    for (what, map, group_by, groups) in tops {
        let top = ConnTop {
            map,
            group_by,
            sum: "value.packets",
            groups,
        };
        for scan in [pb::ScanMethod::ScanBatched, pb::ScanMethod::ScanAuto] {
            let run = || top_conns(c.clone(), top, scan);
            let how = walked(&run().await);
            let (d, r) =
                paired_async(floors.of(map), || async { run().await.entries_scanned }).await;
            let name = format!("top 10 of {what}, {how}");
            report.row(&name, d, u64::from(n), Some(("its floor", r)));
            if scan == pb::ScanMethod::ScanAuto {
                report.target(
                    &format!("top 10 of {what}, {n} entries, SCAN_AUTO ({how}), vs its floor"),
                    r,
                    "x",
                    0.6,
                    true,
                );
            }
        }
    }
}

/// The dump of the connections filtered to 1 % ([`FEW_PACKETS`]), packed,
/// walked inside the kernel (SCAN_KERNEL) and read in batches.
async fn conn_dumps(n: u32, c: &Grpc, floor: &impl Fn() -> u64, report: &mut Report) {
    let want = (0..n).filter(|&i| conn(i, 0).packets < 10_000).count() as u64;
    for scan in [pb::ScanMethod::ScanBatched, pb::ScanMethod::ScanKernel] {
        let run = || {
            let mut c = c.clone();
            async move {
                let req = pb::DumpMapRequest {
                    map: bpfmap_tests::map_ref("conns"),
                    filter: FEW_PACKETS.into(),
                    layout: pb::Layout::Packed as i32,
                    scan: scan as i32,
                    ..Default::default()
                };
                let mut stream = c.dump_map(req).await.unwrap().into_inner();
                let mut got = 0;
                while let Some(m) = stream.message().await.unwrap() {
                    got += m.packed.map_or(0, |p| u64::from(p.count));
                    if let Some(s) = m.summary {
                        let kernel = scan == pb::ScanMethod::ScanKernel;
                        assert_eq!(s.scanned_in_kernel, kernel, "{}", s.scan_note);
                    }
                }
                assert_eq!(got, want);
                got
            }
        };
        let (d, r) = paired_async(floor, run).await;
        let how = if scan == pb::ScanMethod::ScanKernel {
            "SCAN_KERNEL"
        } else {
            "batched"
        };
        let what = format!("DumpMap, packed, filtered to 1 % ({want}: {FEW_PACKETS}), {how}");
        report.row(&what, d, u64::from(n), Some(("the floor", r)));
        if scan == pb::ScanMethod::ScanKernel {
            report.target(
                &format!("connections dump filtered to 1 %, {n} entries, {how}, vs the floor"),
                r,
                "x",
                0.45,
                true,
            );
        }
    }
}

/// `bpfmapctl top` of the connections' 50,000 ports by packets, and of the
/// per-CPU map's, each a process of its own against the daemon, timed
/// alternately with the floor walk of its map.
fn conn_tops_by_process(n: u32, url: &str, floors: &ConnFloors<'_>, report: &mut Report) {
    for map in ["conns", "pconns"] {
        let args = [
            "top",
            map,
            "--by",
            "sum(value.packets)",
            "--group-by",
            "key.dport",
            "-n",
            "10",
        ];
        let (d, r) = paired(floors.of(map), || bpfmapctl(url, &args));
        let what = format!("bpfmapctl {}", args.join(" "));
        report.row(&what, d, u64::from(n), Some(("its floor", r)));
        report.target(
            &format!("{what}, {n} entries, a process, vs its floor"),
            r,
            "x",
            0.6,
            true,
        );
    }
}

/// Where a walk inside the kernel with a hash group table stops paying:
/// the connections grouped by `value.delta` (32 bits: a hash table) taking
/// from 2,000 to 1,000,000 values, inside the kernel (SCAN_KERNEL) and
/// batched, each against the floor.
async fn group_sweep(
    n: u32,
    map: &OwnedMap,
    c: &Grpc,
    floor: &impl Fn() -> u64,
    report: &mut Report,
) {
    let sweep = [
        2_000u32, 10_000, 20_000, 50_000, 100_000, 200_000, 500_000, 1_000_000,
    ];
    for groups in sweep.into_iter().filter(|g| *g <= n) {
        bpfmap_tests::conns::fill(map, n, |i, cpu| bpfmap_tests::conns::Conn {
            delta: ((u64::from(i) * 7919) % u64::from(groups)) as i32,
            ..conn(i, cpu)
        });
        let top = ConnTop {
            map: "conns",
            group_by: "value.delta",
            sum: "value.packets",
            groups: u64::from(groups),
        };
        let mut ratios = Vec::new();
        for scan in [pb::ScanMethod::ScanBatched, pb::ScanMethod::ScanKernel] {
            let run = || top_conns(c.clone(), top, scan);
            let (d, r) = paired_async(floor, || async { run().await.entries_scanned }).await;
            let how = if scan == pb::ScanMethod::ScanKernel {
                "SCAN_KERNEL"
            } else {
                "batched"
            };
            report.row(
                &format!("top 10 of {groups} groups (value.delta, a hash), {how}"),
                d,
                u64::from(n),
                Some(("the floor", r)),
            );
            ratios.push(r);
        }
        println!(
            "  {:<58} {:>9.2} kernel / batched",
            "",
            ratios[1] / ratios[0]
        );
    }
    bpfmap_tests::conns::fill(map, n, conn);
}
