//! Fleet dumps: wall time to dump a 10,000-entry map from 1, 10 and 25
//! daemons (each a process of its own on its own loopback address) with
//! concurrency 1, 8 and 32, and the client's peak memory for the 25-host
//! run. A fleet should take close to its slowest host, not the sum.
//!
//! On one machine every daemon shares the same CPUs, so without latency the
//! run is bound by the total CPU work. A second table puts each daemon
//! behind a proxy that delays every transfer by 5 ms each way, as a network
//! would: there the overlap shows.
//!
//! A third table dumps fleets of 100, 500 and 1,000 daemons with every
//! fault at once ([`FaultyFleet`]: addresses where nothing listens, frozen
//! daemons, certificates from another CA, black holes, 1 Mbit/s links,
//! daemons killed and restarted mid-dump): the wall time against the
//! slowest healthy target dumped alone, and the client's peak memory and
//! open descriptors.
//!
//! A fourth table compares a fleet top 10 (the library's three-phase
//! threshold algorithm, [`Fleet::aggregate`]) with full dumps merged in the
//! client, on 25 daemons with 20,000 typed flows each: wall time and bytes
//! received, directly and behind the 5 ms delay.
//!
//!     cargo bench -p bpfmap-tests --bench fleet              (as root)
//!     cargo bench -p bpfmap-tests --bench fleet -- faults 100    (one section, one size)
//!
//! Sections: `local` (the first table), `delay` (the second), `faults`
//! (the third), `topk` (the fourth); sizes of the third: numbers (default
//! 100 500 1000), or `FLEET_SIZES=100,500`. `FLEET_RUNS` runs per size
//! (default 3).

use std::time::{Duration, Instant};

use std::collections::HashMap;

use bpfmap_client::{
    ConnectOptions, DumpOptions, Fleet, FleetDumpOptions, FleetEvent, FleetOptions, Target,
    TargetReport,
};
use bpfmap_tests::{
    BpfFs, MapType, create_map,
    fleet::{FaultyFleet, FdSampler, Kind, Tally},
    median,
    process::DaemonProcess,
    update_batch,
};
use futures::StreamExt as _;

const RUNS: usize = 5;
const ENTRIES: u64 = 10_000;
const HOSTS: usize = 25;

/// A TCP proxy on `listen` to `target` that holds every transfer for
/// `delay` before passing it on, in both directions.
async fn delay_proxy(listen: std::net::SocketAddr, target: std::net::SocketAddr, delay: Duration) {
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    let listener = tokio::net::TcpListener::bind(listen).await.unwrap();
    tokio::spawn(async move {
        while let Ok((client, _)) = listener.accept().await {
            let Ok(server) = tokio::net::TcpStream::connect(target).await else {
                continue;
            };
            let _ = client.set_nodelay(true);
            let _ = server.set_nodelay(true);
            let (cr, cw) = client.into_split();
            let (sr, sw) = server.into_split();
            for (mut r, mut w) in [
                (
                    Box::new(cr) as Box<dyn tokio::io::AsyncRead + Unpin + Send>,
                    Box::new(sw) as Box<dyn tokio::io::AsyncWrite + Unpin + Send>,
                ),
                (Box::new(sr), Box::new(cw)),
            ] {
                tokio::spawn(async move {
                    let mut buf = vec![0u8; 64 << 10];
                    loop {
                        let n = match r.read(&mut buf).await {
                            Ok(0) | Err(_) => break,
                            Ok(n) => n,
                        };
                        tokio::time::sleep(delay).await;
                        if w.write_all(&buf[..n]).await.is_err() {
                            break;
                        }
                    }
                });
            }
        }
    });
}

async fn dump(targets: &[Target], concurrency: usize) -> (Duration, u64) {
    let fleet = Fleet::new(targets.iter().cloned(), ConnectOptions::default())
        .with_options(FleetOptions::default().with_concurrency(concurrency));
    let t = Instant::now();
    let mut run = fleet.dump(&"bench/m".parse().unwrap(), FleetDumpOptions::default());
    let mut entries = 0u64;
    while let Some(event) = run.next().await {
        match event {
            FleetEvent::Answer { answer, .. } => entries += answer.chunk.len() as u64,
            FleetEvent::Done(r) => assert!(r.is_ok(), "{}: {:?}", r.target, r.error),
            other => panic!("{other:?}"),
        }
    }
    (t.elapsed(), entries)
}

fn main() {
    let args: Vec<String> = std::env::args()
        .skip(1)
        .filter(|a| !a.starts_with("--"))
        .collect();
    let sections: Vec<&str> = args
        .iter()
        .map(String::as_str)
        .filter(|a| a.parse::<usize>().is_err())
        .collect();
    let mut sizes: Vec<usize> = args.iter().filter_map(|a| a.parse().ok()).collect();
    if sizes.is_empty() {
        sizes = std::env::var("FLEET_SIZES")
            .unwrap_or_else(|_| "100,500,1000".into())
            .split(',')
            .map(|s| {
                s.trim()
                    .parse()
                    .expect("FLEET_SIZES: numbers, comma-separated")
            })
            .collect();
    }
    let runs: usize =
        std::env::var("FLEET_RUNS").map_or(3, |r| r.parse().expect("FLEET_RUNS: a number"));
    let wants = |s: &str| sections.is_empty() || sections.contains(&s);
    let runtime = tokio::runtime::Runtime::new().unwrap();
    if wants("local") || wants("delay") {
        local(&runtime, wants("local"), wants("delay"));
    }
    if wants("topk") {
        topk::run(&runtime);
    }
    if wants("faults") {
        let limit = bpfmap_tests::fleet::raise_fd_limit();
        println!();
        println!(
            "fleets with every fault at once (4 addresses where nothing listens; among the daemons 4 frozen, 4 with a certificate from another CA, 3 behind a black hole, 3 behind a 1 Mbit/s link, 3 killed and restarted mid-dump); maps of 200-1,000 entries (8,000 behind the slow links, 200,000 on the restarted daemons); mutual TLS, concurrency {CONCURRENCY}, connect timeout 1 s, answer timeout 3 s; median of {runs} runs (descriptor limit {limit})"
        );
        for &n in &sizes {
            faults(&runtime, n, runs);
        }
    }
}

fn local(runtime: &tokio::runtime::Runtime, local: bool, delayed_section: bool) {
    let port = bpfmap_tests::process::free_addr("127.0.0.1").port();
    let mut hosts = Vec::new();
    for n in 0..HOSTS {
        let fs = BpfFs::new();
        let state = tempfile::tempdir().unwrap();
        let map = create_map(MapType::HASH, 8, 8, 16_384);
        let keys: Vec<u8> = (0..ENTRIES).flat_map(|i| i.to_le_bytes()).collect();
        let values: Vec<u8> = (0..ENTRIES)
            .flat_map(|i| (i * n as u64).to_le_bytes())
            .collect();
        update_batch(&map, &keys, &values);
        fs.pin(&map, "bench/m");
        let ip = format!("127.0.0.{}", n + 2);
        let daemon = DaemonProcess::start(
            bpfmap_tests::daemon_bin!(),
            fs.path(),
            state.path(),
            format!("{ip}:{port}").parse().unwrap(),
            "",
        );
        let target: Target = format!("{ip}:{port}").parse().unwrap();
        hosts.push((fs, state, map, daemon, target));
    }
    let targets: Vec<Target> = hosts.iter().map(|h| h.4.clone()).collect();
    println!(
        "fleet dump of a {ENTRIES}-entry hash map per daemon (median of {RUNS} runs; daemons are release builds, one process each, 2 CPUs)"
    );
    runtime.block_on(async {
        // Warm up every daemon and connection path once.
        dump(&targets, 32).await;
        if local {
        let mut single = Vec::new();
        for t in &targets {
            single.push(dump(std::slice::from_ref(t), 1).await.0);
        }
        let slowest_single = *single.iter().max().unwrap();
        let sum_single: Duration = single.iter().sum();
        println!(
            "  one daemon at a time: median {:.1} ms, slowest {:.1} ms, sum of all 25 {:.1} ms",
            median(single.clone()).as_secs_f64() * 1e3,
            slowest_single.as_secs_f64() * 1e3,
            sum_single.as_secs_f64() * 1e3
        );
        println!("  {:>7} {:>11} {:>10} {:>12} {:>16}", "daemons", "concurrency", "time", "entries/s", "vs slowest host");
        let mut peak = 0;
        for &n in &[1usize, 10, 25] {
            for &c in &[1usize, 8, 32] {
                if n == 25 && c == 32 {
                    bpfmap_tests::fleet::reset_peak();
                }
                let mut times = Vec::new();
                let mut entries = 0;
                for _ in 0..RUNS {
                    let (d, e) = dump(&targets[..n], c).await;
                    times.push(d);
                    entries = e;
                }
                if n == 25 && c == 32 {
                    peak = bpfmap_tests::fleet::peak_kib();
                }
                assert_eq!(entries, ENTRIES * n as u64);
                let d = median(times);
                println!(
                    "  {n:>7} {c:>11} {:>8.1} ms {:>12.0} {:>15.2}x",
                    d.as_secs_f64() * 1e3,
                    entries as f64 / d.as_secs_f64(),
                    d.as_secs_f64() / slowest_single.as_secs_f64()
                );
            }
        }
        println!("  client peak resident memory during the 25-daemon runs (concurrency 32): {} MiB", peak / 1024);
        }
        if !delayed_section {
            return;
        }

        // The same daemons behind proxies that delay every transfer by 5 ms
        // each way.
        let mut delayed = Vec::new();
        for (n, t) in targets.iter().enumerate() {
            let listen: std::net::SocketAddr = format!("127.0.0.{}:{}", n + 2, port + 1).parse().unwrap();
            delay_proxy(listen, t.as_str().parse().unwrap(), Duration::from_millis(5)).await;
            delayed.push(Target::from_socket_addr(listen));
        }
        dump(&delayed, 32).await;
        let mut single = Vec::new();
        for t in &delayed {
            single.push(dump(std::slice::from_ref(t), 1).await.0);
        }
        let slowest = *single.iter().max().unwrap();
        println!(
            "  behind a 5 ms delay each way: one daemon at a time: median {:.1} ms, slowest {:.1} ms, sum of all 25 {:.1} ms",
            median(single.clone()).as_secs_f64() * 1e3,
            slowest.as_secs_f64() * 1e3,
            single.iter().sum::<Duration>().as_secs_f64() * 1e3
        );
        println!("  {:>7} {:>11} {:>10} {:>16}", "daemons", "concurrency", "time", "vs slowest host");
        for &n in &[1usize, 10, 25] {
            for &c in &[1usize, 8, 32] {
                let mut times = Vec::new();
                for _ in 0..RUNS {
                    times.push(dump(&delayed[..n], c).await.0);
                }
                let d = median(times);
                println!(
                    "  {n:>7} {c:>11} {:>8.1} ms {:>15.2}x",
                    d.as_secs_f64() * 1e3,
                    d.as_secs_f64() / slowest.as_secs_f64()
                );
            }
        }
    });
}

/// Targets of the fault tables in flight at once.
const CONCURRENCY: usize = 32;

/// One fleet dump of `fleet` with the fault table's options, restarting
/// its daemons of kind [`Kind::Restarted`] mid-dump: the time, each
/// target's report and tally, and the most descriptors this process had
/// open (before, and at the most) and its resident memory (before, and
/// its peak) during the run.
struct FaultRun {
    took: Duration,
    reports: HashMap<Target, TargetReport>,
    tallies: HashMap<Target, Tally>,
    fds: (usize, usize),
    rss_kib: (u64, u64),
}

async fn fault_run(faulty: &mut FaultyFleet, targets: &[Target]) -> FaultRun {
    let fleet = Fleet::new(
        targets.iter().cloned(),
        ConnectOptions::default()
            .with_tls(faulty.client_tls())
            .with_connect_timeout(Duration::from_secs(1)),
    )
    .with_options(
        FleetOptions::default()
            .with_concurrency(CONCURRENCY)
            .with_answer_timeout(Duration::from_secs(3)),
    );
    let mut tallies = faulty.tallies();
    let mut reports = HashMap::new();
    let mut restarts = faulty.restarts();
    let fds_before = bpfmap_tests::fleet::open_fds();
    let rss_before = bpfmap_tests::fleet::rss_kib();
    bpfmap_tests::fleet::reset_peak();
    let sampler = FdSampler::start();
    let t = Instant::now();
    let mut run = fleet.dump(
        &"fleet/conns".parse().unwrap(),
        FleetDumpOptions::default().with_dump(DumpOptions::default().with_chunk_size(500)),
    );
    while let Some(event) = run.next().await {
        match event {
            FleetEvent::Answer { target, answer } => {
                restarts.chunk_from(&target);
                tallies
                    .get_mut(&target)
                    .expect("a target")
                    .add(&answer.chunk);
            }
            FleetEvent::Done(r) => {
                reports.insert(r.target.clone(), r);
            }
            other => panic!("{other:?}"),
        }
    }
    let took = t.elapsed();
    let (fds_peak, _) = sampler.stop();
    let rss_peak = bpfmap_tests::fleet::peak_kib();
    faulty.finish(restarts);
    FaultRun {
        took,
        reports,
        tallies,
        fds: (fds_before, fds_peak),
        rss_kib: (rss_before, rss_peak),
    }
}

/// The fault table's row for `n` daemons.
fn faults(runtime: &tokio::runtime::Runtime, n: usize, runs: usize) {
    let t = Instant::now();
    let mut faulty = FaultyFleet::start(bpfmap_tests::daemon_bin!(), n, "fleet/conns");
    let started = t.elapsed();
    let targets = faulty.targets();
    runtime.block_on(async {
        // Every healthy target alone (the restarted ones killed mid-dump
        // too): the slowest.
        let mut slowest = (Duration::ZERO, None);
        let healthy: Vec<(Target, Kind)> = faulty
            .hosts
            .iter()
            .filter(|h| h.kind.healthy())
            .map(|h| (h.target.clone(), h.kind))
            .collect();
        for (t, kind) in &healthy {
            let r = fault_run(&mut faulty, std::slice::from_ref(t)).await;
            let report = &r.reports[t];
            assert!(report.is_ok(), "{t} alone: {:?}", report.error);
            if r.took > slowest.0 {
                slowest = (r.took, Some(*kind));
            }
        }
        let mut times = Vec::new();
        // The most over the runs: (before the run, at the most, the most
        // added during a run).
        let (mut fds, mut rss) = ((0, 0, 0), (0, 0, 0));
        let mut failed = 0;
        for _ in 0..runs {
            let r = fault_run(&mut faulty, &targets).await;
            for host in &faulty.hosts {
                let report = &r.reports[&host.target];
                let tally = &r.tallies[&host.target];
                if host.kind.healthy() {
                    assert!(report.is_ok(), "{:?} {}: {:?}", host.kind, host.target, report.error);
                    assert!(tally.exact(), "{:?} {}: {} of {} entries: {:?}", host.kind, host.target, tally.delivered, tally.expected(), tally.wrong);
                } else {
                    assert!(!report.is_ok(), "{:?} {}: no error", host.kind, host.target);
                }
            }
            failed = r.reports.values().filter(|r| !r.is_ok()).count();
            times.push(r.took);
            fds = (
                fds.0.max(r.fds.0),
                fds.1.max(r.fds.1),
                fds.2.max(r.fds.1.saturating_sub(r.fds.0)),
            );
            rss = (
                rss.0.max(r.rss_kib.0),
                rss.1.max(r.rss_kib.1),
                rss.2.max(r.rss_kib.1.saturating_sub(r.rss_kib.0)),
            );
        }
        let took = median(times);
        println!(
            "  {n:>5} daemons, {} targets (started in {:.1} s): {:.2} s, slowest healthy target alone {:.2} s ({:?}): {:.2}x; {failed} failed, each with its cause",
            targets.len(),
            started.as_secs_f64(),
            took.as_secs_f64(),
            slowest.0.as_secs_f64(),
            slowest.1.expect("a healthy target"),
            took.as_secs_f64() / slowest.0.as_secs_f64(),
        );
        println!(
            "        client: peak resident memory {:.1} MiB, at most {:.1} MiB more than before a run; descriptors at most {}, at most {} more than before a run ({} before: the maps and the daemons' log pipes)",
            rss.1 as f64 / 1024.0,
            rss.2 as f64 / 1024.0,
            fds.1,
            fds.2,
            fds.0,
        );
    });
}

/// The fourth table: a fleet top K against full dumps.
mod topk {
    use std::{
        collections::HashMap,
        time::{Duration, Instant},
    };

    use bpfmap_client::{
        Aggregate, AggregateOptions, ConnectOptions, Fleet, FleetAggregateOptions,
        FleetDumpOptions, FleetEvent, MergeMethod, Target, ValueRef,
    };
    use bpfmap_kernel::{BtfBuilder, CreateMap, OwnedBtf};
    use bpfmap_tests::{
        BpfFs, CountingProxy, MapType, OwnedMap, median, process::DaemonProcess, update_batch,
    };
    use futures::StreamExt as _;

    use super::{HOSTS, RUNS, delay_proxy};

    const FLOWS: u32 = 20_000;

    /// A typed flow map (the demo's types) of `FLOWS` flows whose
    /// destinations follow a skewed law (a few take most bytes), pinned.
    fn flow_map(fs: &BpfFs, host: u32) -> OwnedMap {
        let mut b = BtfBuilder::new();
        let (key, value) = bpfmapd::flow_types(&mut b);
        let btf = OwnedBtf::load(&b.to_bytes()).expect("BPF_BTF_LOAD");
        let map = OwnedMap::create(&CreateMap {
            map_type: MapType::HASH.0,
            key_size: 16,
            value_size: 16,
            max_entries: FLOWS,
            name: "flows",
            btf: Some(btf.for_map(key, value)),
            ..Default::default()
        })
        .expect("BPF_MAP_CREATE");
        let mut seed = u64::from(host) * 0x9E37_79B9_7F4A_7C15 + 1;
        let mut next = move || {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed
        };
        let (mut keys, mut values) = (Vec::new(), Vec::new());
        for i in 0..FLOWS {
            // Destination d with probability about 1 / (d + 1).
            let d = (5000f64.powf((next() % 10_000) as f64 / 10_000.0) as u32).min(4999);
            keys.extend_from_slice(&((host << 16) | i).to_le_bytes());
            keys.extend_from_slice(&(0xC0A8_0000 | d).to_le_bytes());
            keys.extend_from_slice(&[0xbb, 0x01, 0xbb, 0x01, 0, 0, 0, 0]);
            values.extend_from_slice(&(1 + next() % 1000).to_le_bytes());
            values.extend_from_slice(&(1 + next() % 1_000_000).to_le_bytes());
        }
        update_batch(&map, &keys, &values);
        fs.pin(&map, "bench/flows");
        map
    }

    /// The top 10 destinations by bytes from full dumps, merged here.
    async fn by_dumps(targets: &[Target]) -> Vec<(u32, u128)> {
        let fleet = Fleet::new(targets.iter().cloned(), ConnectOptions::default());
        let mut run = fleet.dump(&"bench/flows".parse().unwrap(), FleetDumpOptions::default());
        let mut sums: HashMap<u32, u128> = HashMap::new();
        while let Some(event) = run.next().await {
            match event {
                FleetEvent::Answer { answer, .. } => {
                    for e in &answer.chunk {
                        let ValueRef::Single(v) = e.value else {
                            panic!("a hash value")
                        };
                        let daddr = u32::from_le_bytes(e.key[4..8].try_into().unwrap());
                        let bytes = u64::from_le_bytes(v[8..16].try_into().unwrap());
                        *sums.entry(daddr).or_default() += u128::from(bytes);
                    }
                }
                FleetEvent::Done(r) => assert!(r.is_ok(), "{}: {:?}", r.target, r.error),
                _ => {}
            }
        }
        let mut top: Vec<(u32, u128)> = sums.into_iter().collect();
        top.sort_by(|a, b| {
            b.1.cmp(&a.1)
                .then(a.0.to_le_bytes().cmp(&b.0.to_le_bytes()))
        });
        top.truncate(10);
        top
    }

    /// The fleet top 10 by `aggregate`, and how it was found.
    async fn by_aggregate(
        targets: &[Target],
        aggregate: Aggregate,
    ) -> (Vec<(u32, u128)>, MergeMethod) {
        let fleet = Fleet::new(targets.iter().cloned(), ConnectOptions::default());
        let options = AggregateOptions::default()
            .with_group_by(["key.daddr"])
            .with_aggregate(aggregate)
            .with_limit(10);
        let options = FleetAggregateOptions::default().with_aggregate(options);
        let result = fleet
            .aggregate(&"bench/flows".parse().unwrap(), options)
            .await;
        assert!(!result.is_partial(), "{:?}", result.missing);
        let top = result
            .groups
            .iter()
            .map(|g| {
                let k: [u8; 4] = g.group.key_bytes().try_into().unwrap();
                (u32::from_le_bytes(k), g.group.values()[0].unwrap() as u128)
            })
            .collect();
        (top, result.method)
    }

    /// Median time and bytes of `runs` of `f`.
    async fn measure<T, F: Future<Output = T>>(
        proxies: &[CountingProxy],
        mut f: impl FnMut() -> F,
    ) -> (Duration, u64, T) {
        let count = || proxies.iter().map(CountingProxy::bytes).sum::<u64>();
        let (mut times, mut bytes, mut last) = (Vec::new(), Vec::new(), None);
        for _ in 0..RUNS {
            let before = count();
            let t = Instant::now();
            last = Some(f().await);
            times.push(t.elapsed());
            // Connections close as each run ends: let the counts settle.
            tokio::time::sleep(Duration::from_millis(100)).await;
            bytes.push(count() - before);
        }
        (median(times), median(bytes), last.unwrap())
    }

    pub(super) fn run(runtime: &tokio::runtime::Runtime) {
        let port = bpfmap_tests::process::free_addr("127.0.0.1").port();
        let mut hosts = Vec::new();
        for n in 0..HOSTS {
            let fs = BpfFs::new();
            let state = tempfile::tempdir().unwrap();
            let map = flow_map(&fs, n as u32);
            let addr: std::net::SocketAddr = format!("127.0.1.{}:{port}", n + 2).parse().unwrap();
            let daemon = DaemonProcess::start(
                bpfmap_tests::daemon_bin!(),
                fs.path(),
                state.path(),
                addr,
                "",
            );
            hosts.push((fs, state, map, daemon, addr));
        }
        println!();
        println!(
            "top 10 destinations by bytes over {HOSTS} daemons of {FLOWS} typed flows each (median of {RUNS} runs): full dumps merged in the client, the fleet top 10 (threshold algorithm), and by MAX (every group merged)"
        );
        println!(
            "  {:>10} {:>22} {:>10} {:>12}",
            "latency", "how", "time", "received"
        );
        runtime.block_on(async {
            for delay in [None, Some(Duration::from_millis(5))] {
                let mut proxies = Vec::new();
                for (n, h) in hosts.iter().enumerate() {
                    let upstream = match delay {
                        None => h.4,
                        Some(d) => {
                            let listen: std::net::SocketAddr =
                                format!("127.0.1.{}:{}", n + 2, port + 1).parse().unwrap();
                            delay_proxy(listen, h.4, d).await;
                            listen
                        }
                    };
                    proxies.push(CountingProxy::start("127.0.0.1:0", upstream).await);
                }
                let targets: Vec<Target> = proxies
                    .iter()
                    .map(|p| Target::from_socket_addr(p.addr))
                    .collect();
                let latency = delay.map_or("none".to_owned(), |d| format!("{} ms", d.as_millis()));
                let (t, b, want) = measure(&proxies, || by_dumps(&targets)).await;
                println!(
                    "  {latency:>10} {:>22} {:>8.1} ms {:>9} KiB",
                    "full dumps",
                    t.as_secs_f64() * 1e3,
                    b / 1024
                );
                let (t2, b2, (got, method)) = measure(&proxies, || {
                    by_aggregate(&targets, Aggregate::sum("value.bytes"))
                })
                .await;
                assert_eq!((got, method), (want, MergeMethod::Threshold));
                println!(
                    "  {latency:>10} {:>22} {:>8.1} ms {:>9} KiB  ({:.1}x fewer bytes)",
                    "fleet top 10 (sum)",
                    t2.as_secs_f64() * 1e3,
                    b2 / 1024,
                    b as f64 / b2 as f64
                );
                let (t3, b3, (_, method)) = measure(&proxies, || {
                    by_aggregate(&targets, Aggregate::max("value.bytes"))
                })
                .await;
                assert_eq!(method, MergeMethod::AllGroups);
                println!(
                    "  {latency:>10} {:>22} {:>8.1} ms {:>9} KiB",
                    "fleet top 10 (max)",
                    t3.as_secs_f64() * 1e3,
                    b3 / 1024
                );
            }
        });
        drop(hosts);
    }
}
