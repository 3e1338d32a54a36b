//! `[[export]]`: maps as Prometheus metrics, scraped from the daemon's
//! metrics listener and by a real Prometheus: counters, gauges and
//! histograms exactly as the map holds them, series of entries that are
//! gone forgotten at the next scan, the series limit, both exposition
//! formats through promtool, tables refused at start and at a reload.

use std::{net::SocketAddr, time::Duration};

use bpfmap_client::WatchOptions;
use bpfmap_tests::*;
use bpfmapd::{Buckets, ExportConfig, ExportKind};

const MAP: &str = "t/flows";

/// The map's types, declared: key (dst, port), value (packets, bytes,
/// slots[4]).
fn types() -> bpfmapd::TypesConfig {
    bpfmapd::TypesConfig {
        maps: vec![MAP.into()],
        names: Vec::new(),
        key: "struct { __u32 dst; __u32 port; }".into(),
        value: "struct { __u64 packets; __u64 bytes; __u64 slots[4]; }".into(),
    }
}

fn key(dst: [u8; 4], port: u32) -> Vec<u8> {
    let mut k = dst.to_vec();
    k.extend(port.to_le_bytes());
    k
}

fn value(packets: u64, bytes: u64, slots: [u64; 4]) -> Vec<u8> {
    let mut v = Vec::new();
    for n in [packets, bytes].into_iter().chain(slots) {
        v.extend(n.to_le_bytes());
    }
    v
}

fn exports() -> Vec<ExportConfig> {
    let mut bytes = ExportConfig::new(MAP, "flows_bytes_total", ExportKind::Counter);
    bytes.help = "Bytes per destination".into();
    bytes.value = Some("value.bytes".into());
    bytes.labels = vec!["key.dst".into()];
    bytes.render = [("key.dst".to_owned(), "ipv4".to_owned())].into();
    bytes.min_interval = Duration::from_millis(200);
    let mut entries = ExportConfig::new(MAP, "flows_entries", ExportKind::Gauge);
    entries.help = "Flows per port".into();
    entries.labels = vec!["key.port".into()];
    entries.min_interval = Duration::from_millis(200);
    let mut latency = ExportConfig::new(MAP, "flows_latency", ExportKind::Histogram);
    latency.help = "Latency per port".into();
    latency.value = Some("value.slots".into());
    latency.buckets = Some(Buckets::Exp2);
    latency.labels = vec!["key.port".into()];
    latency.min_interval = Duration::from_millis(200);
    let mut top = ExportConfig::new(MAP, "flows_top_packets", ExportKind::Gauge);
    top.help = "Packets of the busiest destination".into();
    top.value = Some("value.packets".into());
    top.labels = vec!["dst=key.dst".into()];
    top.render = [("key.dst".to_owned(), "ipv4".to_owned())].into();
    top.filter = "value.packets > 0".into();
    top.max_series = 1;
    top.min_interval = Duration::from_millis(200);
    vec![bytes, entries, latency, top]
}

/// A scrape in the format `accept` asks for: (content type, body).
async fn scrape_as(addr: SocketAddr, accept: &str) -> (String, String) {
    let (status, content_type, body) = metrics::http_get_accepting(addr, "/metrics", accept)
        .await
        .unwrap();
    assert_eq!(status, "HTTP/1.1 200 OK", "{body}");
    (content_type, body)
}

/// The lines of `body` that are samples of `family`, sorted.
fn samples(body: &str, family: &str) -> Vec<String> {
    let mut lines: Vec<String> = body
        .lines()
        .filter(|l| !l.starts_with('#') && l.starts_with(family))
        .map(str::to_owned)
        .collect();
    lines.sort();
    lines
}

/// promtool's verdict on an exposition in the text format.
fn promtool_check(body: &str) {
    use std::io::Write as _;
    let promtool = std::env::var("PROMTOOL").unwrap_or_else(|_| "promtool".into());
    let mut child = std::process::Command::new(&promtool)
        .args(["check", "metrics"])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| {
            panic!("{promtool} is needed for this test ({e}): install Debian's `prometheus` (.ci/run does), or set $PROMTOOL")
        });
    child
        .stdin
        .take()
        .unwrap()
        .write_all(body.as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "promtool check metrics: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exports_serve_a_map_exactly_and_forget_entries_that_are_gone() {
    let (fs, state) = (BpfFs::new(), tempfile::tempdir().unwrap());
    let map = create_map(MapType::HASH, 8, 48, 64);
    fs.pin(&map, MAP);
    update(
        &map,
        &key([10, 0, 0, 1], 443),
        &value(5, 1000, [1, 2, 0, 0]),
    );
    update(&map, &key([10, 0, 0, 1], 80), &value(0, 24, [0, 0, 0, 7]));
    update(&map, &key([10, 0, 0, 2], 443), &value(9, 100, [3, 0, 1, 0]));
    let daemon = Daemon::start_with(bpfmapd::Config {
        metrics_listen: Some("127.0.0.1:0".parse().unwrap()),
        types: vec![types()],
        exports: exports(),
        map_pressure_interval: Duration::from_millis(200),
        ..Daemon::config(fs.path(), state.path())
    })
    .await;
    let addr = daemon.running.metrics_addr().unwrap();
    // Map pressure, without a table: entries, max_entries, memory.
    let mut pressure = Vec::new();
    for _ in 0..50 {
        let (_, om) = scrape_as(addr, "application/openmetrics-text").await;
        pressure = samples(&om, "bpfmapd_map_");
        if !pressure.is_empty() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let labels = "{map=\"t/flows\",name=\"test\",type=\"hash\"}";
    assert_eq!(
        pressure[0],
        format!("bpfmapd_map_entries{labels} 3"),
        "{pressure:?}"
    );
    assert_eq!(pressure[1], format!("bpfmapd_map_max_entries{labels} 64"));
    let memory: u64 = pressure[2]
        .strip_prefix(&format!("bpfmapd_map_memory_bytes{labels} "))
        .unwrap()
        .parse()
        .unwrap();
    assert!(memory > 0, "{pressure:?}");
    let (content_type, om) = scrape_as(addr, "application/openmetrics-text;version=1.0.0").await;
    assert!(content_type.starts_with("application/openmetrics-text"));
    assert!(om.ends_with("# EOF\n"));
    assert_eq!(
        samples(&om, "flows_bytes"),
        [
            "flows_bytes_total{dst=\"10.0.0.1\"} 1024",
            "flows_bytes_total{dst=\"10.0.0.2\"} 100"
        ]
    );
    assert_eq!(
        samples(&om, "flows_entries"),
        [
            "flows_entries{port=\"443\"} 2",
            "flows_entries{port=\"80\"} 1"
        ]
    );
    assert_eq!(
        samples(&om, "flows_latency"),
        [
            "flows_latency_bucket{port=\"443\",le=\"+Inf\"} 7",
            "flows_latency_bucket{port=\"443\",le=\"16.0\"} 7",
            "flows_latency_bucket{port=\"443\",le=\"2.0\"} 4",
            "flows_latency_bucket{port=\"443\",le=\"4.0\"} 6",
            "flows_latency_bucket{port=\"443\",le=\"8.0\"} 7",
            "flows_latency_bucket{port=\"80\",le=\"+Inf\"} 7",
            "flows_latency_bucket{port=\"80\",le=\"16.0\"} 7",
            "flows_latency_bucket{port=\"80\",le=\"2.0\"} 0",
            "flows_latency_bucket{port=\"80\",le=\"4.0\"} 0",
            "flows_latency_bucket{port=\"80\",le=\"8.0\"} 0",
            "flows_latency_count{port=\"443\"} 7",
            "flows_latency_count{port=\"80\"} 7",
        ]
    );
    // One series kept (the busiest destination), one dropped.
    assert_eq!(
        samples(&om, "flows_top_packets"),
        ["flows_top_packets{dst=\"10.0.0.2\"} 9"]
    );
    assert!(
        om.contains("bpfmapd_export_series_dropped_total{export=\"flows_top_packets\"} 1\n"),
        "{om}"
    );
    assert!(
        om.contains("bpfmapd_export_series{export=\"flows_bytes\"} 2\n"),
        "{om}"
    );
    // The text format, for scrapers that do not ask for OpenMetrics, clean
    // for promtool.
    let (content_type, text) = scrape_as(addr, "").await;
    assert!(
        content_type.starts_with("text/plain; version=0.0.4"),
        "{content_type}"
    );
    assert!(
        text.contains("# TYPE flows_bytes_total counter\n"),
        "{text}"
    );
    assert!(!text.contains("# EOF"));
    promtool_check(&text);
    // An entry that is gone: its series are gone at the next scan.
    delete(&map, &key([10, 0, 0, 1], 80));
    tokio::time::sleep(Duration::from_millis(300)).await;
    let (_, om) = scrape_as(addr, "application/openmetrics-text").await;
    assert_eq!(
        samples(&om, "flows_entries"),
        ["flows_entries{port=\"443\"} 2"]
    );
    assert!(!om.contains("port=\"80\""), "{om}");
    assert_eq!(
        samples(&om, "flows_bytes"),
        [
            "flows_bytes_total{dst=\"10.0.0.1\"} 1000",
            "flows_bytes_total{dst=\"10.0.0.2\"} 100"
        ]
    );
    // A scrape within min_interval of the last is served that scan.
    update(&map, &key([10, 0, 0, 3], 22), &value(1, 1, [0, 0, 0, 0]));
    let (_, soon) = scrape_as(addr, "application/openmetrics-text").await;
    assert!(!soon.contains("10.0.0.3"), "{soon}");
    // A scrape whose deadline (Prometheus' header) leaves no time to walk
    // is served the last walk.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let hurried = "application/openmetrics-text\r\nX-Prometheus-Scrape-Timeout-Seconds: 0.000001";
    let (_, hurried) = scrape_as(addr, hurried).await;
    assert!(!hurried.contains("10.0.0.3"), "{hurried}");
    assert!(
        hurried.contains("flows_bytes_total{dst=\"10.0.0.1\"} 1000\n"),
        "{hurried}"
    );
    // A bad table at a reload is refused, the exports in force stay.
    let mut bad = daemon.config.clone();
    bad.exports[0].buckets = Some(Buckets::Exp2);
    let e = daemon.running.reload(&bad).unwrap_err().to_string();
    assert!(
        e.contains("[[export]] 0 (metric \"flows_bytes_total\"): `buckets` is for histograms"),
        "{e}"
    );
    tokio::time::sleep(Duration::from_millis(300)).await;
    let (_, om) = scrape_as(addr, "application/openmetrics-text").await;
    assert!(
        om.contains("flows_bytes_total{dst=\"10.0.0.3\"} 1\n"),
        "{om}"
    );
    // A good one replaces them.
    let mut fewer = daemon.config.clone();
    fewer.exports.truncate(1);
    daemon.running.reload(&fewer).unwrap();
    let (_, om) = scrape_as(addr, "application/openmetrics-text").await;
    assert!(!om.contains("flows_entries"), "{om}");
    daemon.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_export_takes_a_watchs_recent_scan_of_its_map_instead_of_walking_it() {
    let (fs, state) = (BpfFs::new(), tempfile::tempdir().unwrap());
    let map = create_map(MapType::HASH, 8, 48, 64);
    fs.pin(&map, MAP);
    update(&map, &key([10, 0, 0, 1], 443), &value(5, 1000, [0; 4]));
    let mut bytes = exports().swap_remove(0);
    bytes.min_interval = Duration::from_secs(600);
    let daemon = Daemon::start_with(bpfmapd::Config {
        metrics_listen: Some("127.0.0.1:0".parse().unwrap()),
        types: vec![types()],
        exports: vec![bytes],
        ..Daemon::config(fs.path(), state.path())
    })
    .await;
    let addr = daemon.running.metrics_addr().unwrap();
    // A watch of the map, scanning every 10 minutes: its first scan now.
    let client = daemon.client().await;
    let mut watch = client.watch(
        &MAP.parse().unwrap(),
        WatchOptions::default().with_interval(Duration::from_secs(600)),
    );
    tokio::time::timeout(Duration::from_secs(20), watch.next_scan())
        .await
        .expect("the watch's first scan within 20 s")
        .expect("the watch goes on");
    // An entry written after the watch's scan: the export's first scan is
    // the watch's (within its min_interval), which has not seen it.
    update(&map, &key([10, 0, 0, 2], 80), &value(1, 7, [0; 4]));
    let (_, om) = scrape_as(addr, "application/openmetrics-text").await;
    assert_eq!(
        samples(&om, "flows_bytes"),
        ["flows_bytes_total{dst=\"10.0.0.1\"} 1000"],
        "{om}"
    );
    assert!(
        om.contains("bpfmapd_export_shared_scans_total{export=\"flows_bytes\"} 1\n"),
        "{om}"
    );
    assert!(
        om.contains("bpfmapd_export_scans_total{export=\"flows_bytes\"} 1\n"),
        "{om}"
    );
    drop(watch);
    let config = daemon.config.clone();
    daemon.stop().await;

    // Without a watch, the export walks the map and sees every entry.
    let daemon = Daemon::start_with(config).await;
    let addr = daemon.running.metrics_addr().unwrap();
    let (_, om) = scrape_as(addr, "application/openmetrics-text").await;
    assert_eq!(
        samples(&om, "flows_bytes"),
        [
            "flows_bytes_total{dst=\"10.0.0.1\"} 1000",
            "flows_bytes_total{dst=\"10.0.0.2\"} 7"
        ]
    );
    assert!(
        om.contains("bpfmapd_export_shared_scans_total{export=\"flows_bytes\"} 0\n"),
        "{om}"
    );
    daemon.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bad_export_table_refuses_to_start() {
    let (fs, state) = (BpfFs::new(), tempfile::tempdir().unwrap());
    let mut config = Daemon::config(fs.path(), state.path());
    config.metrics_listen = Some("127.0.0.1:0".parse().unwrap());
    let mut bad = ExportConfig::new(MAP, "lat", ExportKind::Histogram);
    bad.value = Some("value.slots".into());
    config.exports = vec![bad];
    let e = bpfmapd::start(&config).await.unwrap_err().to_string();
    assert_eq!(
        e,
        "[[export]] 0 (metric \"lat\"): a histogram needs `buckets` (\"exp2\" or \"linear\")"
    );
    config.exports[0].buckets = Some(Buckets::Exp2);
    config.metrics_listen = None;
    let e = bpfmapd::start(&config).await.unwrap_err().to_string();
    assert!(e.contains("set metrics_listen"), "{e}");
}

/// A Prometheus server of the test's own scraping `target` every second;
/// killed when dropped.
struct Prometheus {
    child: std::process::Child,
    addr: SocketAddr,
    _dir: tempfile::TempDir,
}

impl Prometheus {
    async fn start(target: SocketAddr) -> Self {
        let bin = std::env::var("PROMETHEUS").unwrap_or_else(|_| "prometheus".into());
        let dir = tempfile::tempdir().unwrap();
        let config = dir.path().join("prometheus.yml");
        std::fs::write(
            &config,
            format!(
                "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\nscrape_configs:\n  - job_name: bpfmapd\n    static_configs:\n      - targets: [\"{target}\"]\n"
            ),
        )
        .unwrap();
        let addr = process::free_addr("127.0.0.1");
        let child = std::process::Command::new(&bin)
            .arg(format!("--config.file={}", config.display()))
            .arg(format!("--storage.tsdb.path={}", dir.path().join("data").display()))
            .arg(format!("--web.listen-address={addr}"))
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .unwrap_or_else(|e| {
                panic!("{bin} is needed for this test ({e}): install Debian's `prometheus` (.ci/run does), or set $PROMETHEUS")
            });
        let p = Self {
            child,
            addr,
            _dir: dir,
        };
        for _ in 0..100 {
            if let Ok((status, _, _)) = metrics::http_get_accepting(addr, "/-/ready", "").await
                && status.contains("200")
            {
                return p;
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        panic!("prometheus did not get ready on {addr}");
    }

    /// An instant query: each result's labels and value.
    async fn query(&self, promql: &str) -> Vec<(serde_json::Value, String)> {
        let encoded: String = promql
            .bytes()
            .map(|b| match b {
                b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' => {
                    (b as char).to_string()
                }
                _ => format!("%{b:02X}"),
            })
            .collect();
        let path = format!("/api/v1/query?query={encoded}");
        let (_, _, body) = metrics::http_get_accepting(self.addr, &path, "")
            .await
            .unwrap();
        let body = body
            .split_once("\r\n")
            .map_or(body.as_str(), |(_, rest)| rest);
        let start = body.find('{').unwrap_or(0);
        let end = body.rfind('}').map_or(body.len(), |i| i + 1);
        let answer: serde_json::Value = serde_json::from_str(&body[start..end])
            .unwrap_or_else(|e| panic!("{promql}: not JSON ({e}): {body}"));
        assert_eq!(answer["status"], "success", "{promql}: {answer}");
        answer["data"]["result"]
            .as_array()
            .unwrap()
            .iter()
            .map(|r| {
                (
                    r["metric"].clone(),
                    r["value"][1].as_str().unwrap().to_owned(),
                )
            })
            .collect()
    }

    /// Waits (30 s at most) until `promql` answers one result of value
    /// `want`.
    async fn wait_for(&self, promql: &str, want: &str) {
        let mut last = Vec::new();
        for _ in 0..150 {
            last = self.query(promql).await;
            if last.len() == 1 && last[0].1 == want {
                return;
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        panic!("{promql}: wanted {want}, Prometheus answers {last:?}");
    }
}

impl Drop for Prometheus {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Where `histogram_quantile(q, ...)` falls for counts per bucket `counts`
/// with upper bounds `bounds`: Prometheus' linear interpolation within
/// the bucket (the first one starting at 0).
fn quantile(q: f64, bounds: &[f64], counts: &[u64]) -> f64 {
    let total: u64 = counts.iter().sum();
    let rank = q * total as f64;
    let mut below = 0u64;
    for (i, c) in counts.iter().enumerate() {
        if (below + c) as f64 >= rank && *c > 0 {
            let lower = if i == 0 { 0.0 } else { bounds[i - 1] };
            return lower + (bounds[i] - lower) * (rank - below as f64) / *c as f64;
        }
        below += c;
    }
    bounds[bounds.len() - 1]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_real_prometheus_scrapes_exports_and_queries_them_exactly() {
    let (fs, state) = (BpfFs::new(), tempfile::tempdir().unwrap());
    let map = create_map(MapType::HASH, 8, 48, 64);
    fs.pin(&map, MAP);
    let (a, b) = (key([10, 0, 0, 1], 443), key([10, 0, 0, 2], 443));
    update(&map, &a, &value(1, 0, [2, 4, 1, 1]));
    update(&map, &b, &value(1, 0, [0, 1, 0, 3]));
    let daemon = Daemon::start_with(bpfmapd::Config {
        metrics_listen: Some("127.0.0.1:0".parse().unwrap()),
        types: vec![types()],
        exports: exports(),
        ..Daemon::config(fs.path(), state.path())
    })
    .await;
    let prometheus = Prometheus::start(daemon.running.metrics_addr().unwrap()).await;
    // A writer advances one counter by 1,000 bytes every 100 ms.
    let start = std::time::Instant::now();
    let mut written = 0u64;
    while start.elapsed() < Duration::from_secs(10) {
        written += 1000;
        update(&map, &a, &value(1, written, [2, 4, 1, 1]));
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let actual = written as f64 / start.elapsed().as_secs_f64();
    let rate: f64 = prometheus
        .query("rate(flows_bytes_total{dst=\"10.0.0.1\"}[6s])")
        .await
        .first()
        .map(|(_, v)| v.parse().unwrap())
        .unwrap_or(0.0);
    // rate() extrapolates from the samples of its window (a scrape a
    // second, late when the machine is busy): near the writer's pace, not
    // equal to it; the values themselves are checked exactly below.
    assert!(
        (rate - actual).abs() < actual * 0.5,
        "rate() {rate} of a counter advancing {actual:.0} bytes a second"
    );
    // Stopped: the value Prometheus stores is what the map holds.
    prometheus
        .wait_for("flows_bytes_total{dst=\"10.0.0.1\"}", &written.to_string())
        .await;
    prometheus
        .wait_for("sum(flows_bytes_total)", &written.to_string())
        .await;
    // The histogram of both flows: counts [2, 5, 1, 4] below 2, 4, 8, 16.
    let want = quantile(0.5, &[2.0, 4.0, 8.0, 16.0], &[2, 5, 1, 4]);
    let got = prometheus
        .query("histogram_quantile(0.5, sum by (le) (flows_latency_bucket))")
        .await;
    assert_eq!(got.len(), 1, "{got:?}");
    let got: f64 = got[0].1.parse().unwrap();
    assert!((got - want).abs() < 1e-9, "median {got}, wanted {want}");
    let want = quantile(0.9, &[2.0, 4.0, 8.0, 16.0], &[2, 5, 1, 4]);
    prometheus
        .wait_for(
            "histogram_quantile(0.9, sum by (le) (flows_latency_bucket))",
            &format!("{want}"),
        )
        .await;
    // A flow that is gone leaves Prometheus' instant answers once its
    // series are no longer scraped (staleness).
    delete(&map, &b);
    prometheus.wait_for("count(flows_bytes_total)", "1").await;
    daemon.stop().await;
}
