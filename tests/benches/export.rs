//! What a scrape of `[[export]]` tables costs: one export over a 1M-entry
//! typed hash (the demo's flows) grouped to 375 series, and one keeping
//! 1,000 of 60,000 groups, each scrape walking the map, against the
//! kernel's own batched walk of the same map in the same run (the floor);
//! then 100 exports over 100 maps of 1,000 entries: a scrape that walks
//! them all, and one served the last walks. No target fails the run: the
//! table says which were met.
//!
//! Run as root:
//!
//!     cargo bench -p bpfmap-tests --bench export
//!
//! The daemon runs in this process; scrapes are HTTP GETs of its metrics
//! listener, as Prometheus makes them.

use std::{net::SocketAddr, path::Path, time::Duration};

use bpfmap_kernel::{
    MapHandle,
    walk::{Position, Walker},
};
use bpfmap_tests::{BpfFs, Daemon, median, metrics};
use bpfmapd::{ExportConfig, ExportKind};

const N: u32 = 1_000_000;
const RUNS: usize = 5;

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

/// The kernel's batched walk of the map at `path` (4,096 a call).
fn floor(path: &Path) -> Duration {
    let t = std::time::Instant::now();
    let handle = MapHandle::open_pinned(path).unwrap();
    let meta = handle.meta().clone();
    let mut w = Walker::new(handle, meta, Position::Start).unwrap();
    let mut n = 0u64;
    while let Some(c) = w.next_chunk(4096).unwrap() {
        n += c.count as u64;
    }
    assert_eq!(n, u64::from(N));
    t.elapsed()
}

/// One scrape: its time and its body.
async fn scrape(addr: SocketAddr) -> (Duration, String) {
    let t = std::time::Instant::now();
    let (status, _, body) =
        metrics::http_get_accepting(addr, "/metrics", "application/openmetrics-text")
            .await
            .unwrap();
    assert!(status.contains("200"), "{status}");
    (t.elapsed(), body)
}

fn export(map: &str, metric: &str, labels: &[&str], max_series: usize) -> ExportConfig {
    let mut e = ExportConfig::new(map, metric, ExportKind::Counter);
    e.value = Some("value.bytes".into());
    e.labels = labels.iter().map(|l| l.to_string()).collect();
    e.max_series = max_series;
    e.min_interval = Duration::from_millis(1);
    e.timeout = Duration::from_secs(60);
    e
}

/// Series lines of `family` in a scrape.
fn series(body: &str, family: &str) -> usize {
    body.lines()
        .filter(|l| l.starts_with(family) && !l.starts_with('#'))
        .count()
}

async fn big_map() {
    let (fs, state) = (BpfFs::new(), tempfile::tempdir().unwrap());
    let map = bpfmapd::typed_flows(N).unwrap();
    fs.pin(&map, "bench/flows");
    let path = fs.path().join("bench/flows");
    for (name, labels, max_series) in [
        (
            "by destination and protocol",
            &["key.daddr", "key.proto"][..],
            1000,
        ),
        (
            "by source port, largest 1,000 of 60,000",
            &["key.sport"][..],
            1000,
        ),
    ] {
        let daemon = Daemon::start_with(bpfmapd::Config {
            metrics_listen: Some("127.0.0.1:0".parse().unwrap()),
            map_pressure_interval: Duration::ZERO,
            exports: vec![export(
                "bench/flows",
                "bench_bytes_total",
                labels,
                max_series,
            )],
            ..Daemon::config(fs.path(), state.path())
        })
        .await;
        let addr = daemon.running.metrics_addr().unwrap();
        scrape(addr).await;
        let (mut floors, mut scrapes, mut body) = (Vec::new(), Vec::new(), String::new());
        for _ in 0..RUNS {
            floors.push(floor(&path));
            let (t, b) = scrape(addr).await;
            scrapes.push(t);
            body = b;
        }
        let (f, s) = (median(floors), median(scrapes));
        println!(
            "1M-entry map, {name}: scrape {:.1} ms, floor (batched walk) {:.1} ms: {:.2}x (target 1.5x); {} series, {} bytes a scrape",
            ms(s),
            ms(f),
            s.as_secs_f64() / f.as_secs_f64(),
            series(&body, "bench_bytes_total"),
            body.len()
        );
        daemon.stop().await;
    }
}

async fn many_maps() {
    let (fs, state) = (BpfFs::new(), tempfile::tempdir().unwrap());
    let mut maps = Vec::new();
    let mut exports = Vec::new();
    for i in 0..100 {
        let map = bpfmapd::typed_flows(1000).unwrap();
        fs.pin(&map, &format!("bench/m{i}"));
        maps.push(map);
        exports.push(export(
            &format!("bench/m{i}"),
            &format!("bench_m{i}_bytes_total"),
            &["key.proto"],
            1000,
        ));
    }
    let mut cached = exports.clone();
    for e in &mut cached {
        e.min_interval = Duration::from_secs(3600);
    }
    for (name, exports) in [
        ("each scrape walks every map", exports),
        ("served the last walks", cached),
    ] {
        let daemon = Daemon::start_with(bpfmapd::Config {
            metrics_listen: Some("127.0.0.1:0".parse().unwrap()),
            map_pressure_interval: Duration::ZERO,
            exports,
            ..Daemon::config(fs.path(), state.path())
        })
        .await;
        let addr = daemon.running.metrics_addr().unwrap();
        scrape(addr).await;
        let (mut times, mut body) = (Vec::new(), String::new());
        for _ in 0..RUNS {
            let (t, b) = scrape(addr).await;
            times.push(t);
            body = b;
        }
        let series: usize = (0..100)
            .map(|i| series(&body, &format!("bench_m{i}_bytes")))
            .sum();
        println!(
            "100 exports over 100 maps of 1,000 entries, {name}: scrape {:.1} ms (median of {RUNS}), {series} series, {} bytes a scrape",
            ms(median(times)),
            body.len()
        );
        daemon.stop().await;
    }
}

fn main() {
    let sections: Vec<String> = std::env::args()
        .skip(1)
        .filter(|a| !a.starts_with("--"))
        .collect();
    let wants = |s: &str| sections.is_empty() || sections.iter().any(|a| a == s);
    let runtime = tokio::runtime::Runtime::new().unwrap();
    if wants("big") {
        runtime.block_on(big_map());
    }
    if wants("many") {
        runtime.block_on(many_maps());
    }
}
