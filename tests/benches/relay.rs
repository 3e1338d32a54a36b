//! bpfmap-relay against the library's direct fan-out, in one run:
//!
//! - `dump`: a fleet dump of 100 daemons (each a process on its own
//!   loopback address, a 10,000-entry map each) through the relay (a
//!   process of its own) against the library reading them directly, both
//!   at concurrency 32, packed; median of 5 runs each, alternated; the
//!   relay's peak resident memory.
//! - `topk`: the bytes a caller receives for the fleet's top 10 (the same
//!   maps, grouped by key, summed), through the relay and directly (the
//!   sum of every daemon's answers, counted by proxies).
//! - `ctl`: what a person runs: `bpfmapctl dump` of 6 daemons x 200,000
//!   entries (JSON Lines to /dev/null, whole processes) through the relay (`--relay`)
//!   against directly (`--targets-file`); median of 5 runs each,
//!   alternated. Target: through the relay at most 1.2x.
//! - `thousand`: 1,000 daemons (1,000 entries each) through one relay: the
//!   dump's wall time and the relay's peak resident memory.
//!
//! Run as root:
//!
//!     cargo bench -p bpfmap-tests --bench relay                (as root)
//!     cargo bench -p bpfmap-tests --bench relay -- thousand    (one section)

use std::{
    process::{Command, Stdio},
    time::{Duration, Instant},
};

use bpfmap_client::{
    Aggregate, AggregateOptions, ConnectOptions, Fleet, FleetAggregateOptions, FleetDumpOptions,
    FleetEvent, FleetOptions, Target, pb, pb::fleet_service_client::FleetServiceClient,
};
use bpfmap_tests::{
    CountingProxy,
    local_fleet::{LocalFleet, RelayProcess},
    map_ref, median,
};
use futures::StreamExt as _;

const RUNS: usize = 5;
const CONCURRENCY: usize = 32;
const MAP: &str = "bench/m";

fn relay_bin() -> &'static std::path::Path {
    std::path::Path::new(env!("CARGO_BIN_EXE_test-bpfmap-relay"))
}

/// The fleet dump read directly: (time, entries).
async fn direct(targets: &[Target]) -> (Duration, u64) {
    let fleet = Fleet::new(targets.to_vec(), ConnectOptions::default())
        .with_options(FleetOptions::default().with_concurrency(CONCURRENCY));
    let t = Instant::now();
    let mut run = fleet.dump(&MAP.parse().unwrap(), FleetDumpOptions::default());
    let mut entries = 0;
    while let Some(event) = run.next().await {
        match event {
            FleetEvent::Answer { answer, .. } => entries += answer.chunk.len() as u64,
            FleetEvent::Done(r) => assert!(r.is_ok(), "{}: {:?}", r.target, r.error),
            _ => {}
        }
    }
    (t.elapsed(), entries)
}

/// The fleet dump read through the relay: (time, entries).
async fn relayed(relay: &RelayProcess) -> (Duration, u64) {
    let mut c = relay.client().await;
    let t = Instant::now();
    let req = pb::FleetServiceDumpMapRequest {
        request: Some(pb::DumpMapRequest {
            map: map_ref(MAP),
            layout: pb::Layout::Packed as i32,
            raw: true,
            ..Default::default()
        }),
        ..Default::default()
    };
    let mut stream = c.dump_map(req).await.unwrap().into_inner();
    let mut entries = 0;
    while let Some(msg) = stream.message().await.unwrap() {
        match msg.part.unwrap() {
            pb::fleet_service_dump_map_response::Part::Chunk(c) => {
                entries += u64::from(c.packed.map_or(0, |p| p.count));
            }
            pb::fleet_service_dump_map_response::Part::End(e) => {
                assert_eq!(e.status.unwrap().code, "OK", "{}", msg.target)
            }
        }
    }
    (t.elapsed(), entries)
}

fn dump_section(runtime: &tokio::runtime::Runtime, d: &LocalFleet) {
    let relay = RelayProcess::start(relay_bin(), &d.targets, CONCURRENCY);
    runtime.block_on(async {
        direct(&d.targets).await;
        relayed(&relay).await;
        let (mut a, mut b) = (Vec::new(), Vec::new());
        for _ in 0..RUNS {
            let (t, n) = direct(&d.targets).await;
            assert_eq!(n, 1_000_000);
            a.push(t);
            let (t, n) = relayed(&relay).await;
            assert_eq!(n, 1_000_000);
            b.push(t);
        }
        let (a, b) = (median(a), median(b));
        println!(
            "fleet dump, 100 daemons x 10,000 entries, concurrency {CONCURRENCY}, median of {RUNS}: directly {:.0} ms, through the relay {:.0} ms: {:.2}x; relay peak resident memory {:.1} MiB",
            a.as_secs_f64() * 1e3,
            b.as_secs_f64() * 1e3,
            b.as_secs_f64() / a.as_secs_f64(),
            relay.peak_mib()
        );
    });
}

fn topk_section(runtime: &tokio::runtime::Runtime, d: &LocalFleet) {
    let relay = RelayProcess::start(relay_bin(), &d.targets, CONCURRENCY);
    runtime.block_on(async {
        let options = AggregateOptions::default()
            .with_group_by(["key"])
            .with_aggregate(Aggregate::sum("value"))
            .with_limit(10);
        // Directly: every daemon's answers, counted in front of each.
        let mut proxies = Vec::new();
        for t in &d.targets {
            proxies.push(CountingProxy::start("127.0.0.1:0", t.as_str().parse().unwrap()).await);
        }
        let proxied: Vec<Target> = proxies
            .iter()
            .map(|p| Target::from_socket_addr(p.addr))
            .collect();
        let fleet = Fleet::new(proxied, ConnectOptions::default());
        let direct = fleet
            .aggregate(
                &MAP.parse().unwrap(),
                FleetAggregateOptions::default().with_aggregate(options),
            )
            .await;
        assert!(direct.missing.is_empty());
        // Through the relay: what the relay sends its caller.
        let front = CountingProxy::start("127.0.0.1:0", relay.addr).await;
        let mut c = FleetServiceClient::connect(format!("http://{}", front.addr))
            .await
            .unwrap();
        let answer = c
            .aggregate_map(pb::FleetServiceAggregateMapRequest {
                request: Some(pb::AggregateMapRequest {
                    map: map_ref(MAP),
                    group_by: vec!["key".into()],
                    aggregates: vec![pb::Aggregate {
                        op: pb::aggregate::Op::Sum as i32,
                        field: "value".into(),
                    }],
                    limit: 10,
                    ..Default::default()
                }),
                targets: None,
            })
            .await
            .unwrap()
            .into_inner();
        assert_eq!(answer.groups.len(), 10);
        assert_eq!(answer.method, "top_k");
        tokio::time::sleep(Duration::from_millis(200)).await;
        let a: u64 = proxies.iter().map(CountingProxy::bytes).sum();
        let b = front.bytes();
        println!(
            "fleet top 10 of 100 daemons x 10,000 groups: the caller receives {b} bytes through the relay, {a} bytes directly (every daemon's answers): {:.3}x",
            b as f64 / a as f64
        );
    });
}

/// The wall time of `bpfmapctl ARGS dump bench/m`, its output discarded.
fn ctl_dump(args: &[&str]) -> Duration {
    let t = Instant::now();
    let status = Command::new(env!("CARGO_BIN_EXE_test-bpfmapctl"))
        .args(args)
        .args(["--format", "json", "dump", MAP])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .expect("run bpfmapctl");
    assert!(status.success(), "bpfmapctl {args:?} dump {MAP}: {status}");
    t.elapsed()
}

fn ctl_section(d: &LocalFleet) {
    let relay = RelayProcess::start(relay_bin(), &d.targets, CONCURRENCY);
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("targets");
    let listed: Vec<&str> = d.targets.iter().map(Target::as_str).collect();
    std::fs::write(&file, listed.join("\n")).unwrap();
    let url = format!("http://{}", relay.addr);
    let direct = ["--targets-file", file.to_str().unwrap()];
    let relayed = ["--relay", url.as_str()];
    ctl_dump(&direct);
    ctl_dump(&relayed);
    let (mut a, mut b) = (Vec::new(), Vec::new());
    for _ in 0..RUNS {
        a.push(ctl_dump(&direct));
        b.push(ctl_dump(&relayed));
    }
    let (a, b) = (median(a), median(b));
    println!(
        "bpfmapctl dump, 6 daemons x 200,000 entries (JSON Lines), median of {RUNS}: directly {:.0} ms, through the relay {:.0} ms: {:.2}x (target 1.2x)",
        a.as_secs_f64() * 1e3,
        b.as_secs_f64() * 1e3,
        b.as_secs_f64() / a.as_secs_f64(),
    );
}

fn thousand_section(runtime: &tokio::runtime::Runtime) {
    let limit = bpfmap_tests::fleet::raise_fd_limit();
    let t = Instant::now();
    let d = LocalFleet::start(bpfmap_tests::daemon_bin!(), 1000, MAP, 1000);
    let started = t.elapsed();
    let relay = RelayProcess::start(relay_bin(), &d.targets, CONCURRENCY);
    runtime.block_on(async {
        relayed(&relay).await;
        let mut times = Vec::new();
        for _ in 0..3 {
            let (t, n) = relayed(&relay).await;
            assert_eq!(n, 1_000_000);
            times.push(t);
        }
        println!(
            "1,000 daemons x 1,000 entries through one relay (started in {:.1} s; descriptor limit {limit}): {:.2} s, median of 3; relay peak resident memory {:.1} MiB",
            started.as_secs_f64(),
            median(times).as_secs_f64(),
            relay.peak_mib()
        );
    });
}

fn main() {
    let sections: Vec<String> = std::env::args()
        .skip(1)
        .filter(|a| !a.starts_with("--"))
        .collect();
    let wants = |s: &str| sections.is_empty() || sections.iter().any(|a| a == s);
    let runtime = tokio::runtime::Runtime::new().unwrap();
    if wants("dump") || wants("topk") {
        let d = LocalFleet::start(bpfmap_tests::daemon_bin!(), 100, MAP, 10_000);
        if wants("dump") {
            dump_section(&runtime, &d);
        }
        if wants("topk") {
            topk_section(&runtime, &d);
        }
    }
    if wants("ctl") {
        ctl_section(&LocalFleet::start(
            bpfmap_tests::daemon_bin!(),
            6,
            MAP,
            200_000,
        ));
    }
    if wants("thousand") {
        thousand_section(&runtime);
    }
}
