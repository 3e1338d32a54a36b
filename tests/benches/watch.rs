//! Watch cost: what WatchMap's scans of a 1M-entry typed hash map cost
//! against the kernel's own batched walk (the floor a scan can approach),
//! the bytes a scan sends against a full dump, the daemon's memory per
//! watched entry, and the CPU of 100 watchers of one map against one. Every
//! baseline is taken in the same run, on the same map. No target fails the
//! run: the table says which were met.
//!
//!     cargo bench -p bpfmap-tests --bench watch               (as root)
//!
//! The daemon runs in this process, on a runtime of its own (threads named
//! "bpfmapd"), so that its CPU time and the clients' can be told apart.
//! The writer of the cases with changes writes once after each scan: in
//! the CPU cases it is paced by a watch of its own whose filter matches
//! nothing (it shares the scans and receives no events), so that the
//! writes follow the scans however far the other watchers lag.
//!
//! Every case also says what other processes used of the machine's CPUs
//! and how long this process's threads waited for one (/proc/stat and
//! /proc/self/task/*/schedstat): figures taken while the machine was busy
//! with something else are not the daemon's.

use std::{
    collections::HashMap,
    net::SocketAddr,
    path::Path,
    sync::{
        Arc,
        atomic::{AtomicUsize, Ordering},
    },
    time::{Duration, Instant, SystemTime},
};

use bpfmap_client::{MapName, Scan, Watch, WatchOptions};
use bpfmap_kernel::{
    MapHandle,
    walk::{Position, Walker},
};
use bpfmap_proto::v1::{self as pb, map_service_client::MapServiceClient};
use bpfmap_tests::{BpfFs, Daemon, OwnedMap, median, metrics::Metrics, update_batch};
use prost::Message as _;
use tokio::sync::mpsc;

/// Entries of the watched map.
const N: u32 = 1_000_000;
/// Entries the writer changes between two scans (1 %).
const CHANGED: u32 = 10_000;
/// The watches' interval.
const INTERVAL: Duration = Duration::from_secs(1);
/// Scans measured per case; also the floor's samples.
const SCANS: usize = 5;
/// Entries per batched read, as the daemon's scanner reads.
const READ: u32 = 4096;
/// Watchers of the many-watchers case, and the connections they share.
const WATCHERS: usize = 100;
const CONNECTIONS: usize = 4;

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

fn ratio(a: Duration, b: Duration) -> f64 {
    a.as_secs_f64() / b.as_secs_f64()
}

/// The floor: the kernel's batched walk of the whole map, in-process,
/// `READ` entries a call; the entries read.
fn floor_walk(path: &Path) -> u64 {
    let handle = MapHandle::open_pinned(path).unwrap();
    let meta = handle.meta().clone();
    let mut w = Walker::new(handle, meta, Position::Start).unwrap();
    let mut n = 0;
    while let Some(c) = w.next_chunk(READ).unwrap() {
        n += c.count as u64;
    }
    n
}

/// One timed floor walk.
fn floor_sample(path: &Path) -> Duration {
    let t = Instant::now();
    let n = floor_walk(path);
    let d = t.elapsed();
    assert_eq!(
        n,
        u64::from(N),
        "the floor walk read the wrong number of entries"
    );
    d
}

/// Writes new values to the `CHANGED` known entries (every 100th flow):
/// packets i + 1 + round, bytes 1500 times that; one update_batch.
struct Writer {
    map: OwnedMap,
    keys: Vec<u8>,
    ids: Vec<u32>,
    round: u64,
}

impl Writer {
    fn new(map: OwnedMap) -> Self {
        let ids: Vec<u32> = (0..N).step_by((N / CHANGED) as usize).collect();
        assert_eq!(ids.len(), CHANGED as usize);
        let keys = ids.iter().flat_map(|&i| bpfmapd::flow_key(i)).collect();
        Self {
            map,
            keys,
            ids,
            round: 0,
        }
    }

    fn write(&mut self) {
        self.round += 1;
        let mut values = Vec::with_capacity(self.ids.len() * 16);
        for &i in &self.ids {
            let packets = u64::from(i) + 1 + self.round;
            values.extend_from_slice(&packets.to_ne_bytes());
            values.extend_from_slice(&(packets * 1500).to_ne_bytes());
        }
        update_batch(&self.map, &self.keys, &values);
    }
}

/// The daemon's metrics.
async fn scrape(addr: SocketAddr) -> Metrics {
    bpfmap_tests::metrics::scrape(addr).await
}

/// A series by name (counters may carry the `_total` suffix).
fn metric(m: &Metrics, name: &str) -> f64 {
    m.get(name, &[])
}

/// The CPU time (user and system) of the whole process so far.
fn process_cpu() -> Duration {
    // SAFETY: struct rusage is plain integers: all zeroes is a valid one.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: getrusage writes a struct rusage into the one given.
    let rc = unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut ru) };
    assert_eq!(rc, 0, "getrusage");
    let tv = |t: libc::timeval| Duration::new(t.tv_sec as u64, t.tv_usec as u32 * 1000);
    tv(ru.ru_utime) + tv(ru.ru_stime)
}

/// What this process and the machine have used so far.
struct Load {
    at: Instant,
    /// This process's CPU time (getrusage).
    ours: Duration,
    /// Every CPU's busy time (/proc/stat; 10 ms ticks).
    machine: Duration,
    /// Per thread: whether it is the daemon's (named "bpfmapd"), its CPU
    /// time in ticks of 10 ms, and the time it waited for a CPU (ns).
    threads: HashMap<u64, (bool, u64, u64)>,
}

/// The load between two [`Load`]s.
#[derive(Debug, Clone, Copy, Default)]
struct Used {
    wall: Duration,
    ours: Duration,
    /// The daemon's threads' CPU time (threads that exited in between are
    /// not counted).
    daemon: Duration,
    /// Other processes' CPU time.
    others: Duration,
    /// The time this process's threads were runnable but waited for a CPU.
    waited: Duration,
}

impl Load {
    fn now() -> Self {
        let stat = std::fs::read_to_string("/proc/stat").unwrap();
        let cpu = stat.lines().next().unwrap();
        // user nice system idle iowait irq softirq steal
        let f: Vec<u64> = cpu
            .split_whitespace()
            .skip(1)
            .map(|v| v.parse().unwrap())
            .collect();
        let busy = f[0] + f[1] + f[2] + f[5] + f[6] + f[7];
        let mut threads = HashMap::new();
        for task in std::fs::read_dir("/proc/self/task").unwrap().flatten() {
            let Ok(tid) = task.file_name().to_string_lossy().parse::<u64>() else {
                continue;
            };
            let (Ok(stat), Ok(sched)) = (
                std::fs::read_to_string(task.path().join("stat")),
                std::fs::read_to_string(task.path().join("schedstat")),
            ) else {
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
            // schedstat: time on a CPU, time waiting on a run queue (ns).
            let waited = sched
                .split_whitespace()
                .nth(1)
                .and_then(|v| v.parse().ok())
                .unwrap_or(0);
            threads.insert(tid, (name == "bpfmapd", ticks, waited));
        }
        Self {
            at: Instant::now(),
            ours: process_cpu(),
            machine: Duration::from_millis(busy * 10),
            threads,
        }
    }

    fn since(&self, before: &Self) -> Used {
        let (mut daemon, mut waited) = (0u64, 0u64);
        for (tid, &(is_daemon, ticks, wait)) in &self.threads {
            let (t0, w0) = before.threads.get(tid).map_or((0, 0), |b| (b.1, b.2));
            if is_daemon {
                daemon += ticks.saturating_sub(t0);
            }
            waited += wait.saturating_sub(w0);
        }
        let ours = self.ours - before.ours;
        Used {
            wall: self.at - before.at,
            ours,
            daemon: Duration::from_millis(daemon * 10),
            others: (self.machine - before.machine).saturating_sub(ours),
            waited: Duration::from_nanos(waited),
        }
    }
}

impl Used {
    /// "CPU time (the daemon's), others' CPU, run-queue wait", per `per`.
    fn show(&self, per: u32) -> String {
        let cpus = bpfmap_kernel::possible_cpus() as f64;
        format!(
            "CPU {:.1} ms ({:.0} ms of it the daemon's); other processes {:.0} % of the CPUs; our threads waited {:.1} ms for a CPU",
            ms(self.ours / per),
            ms(self.daemon / per),
            100.0 * self.others.as_secs_f64() / (cpus * self.wall.as_secs_f64()),
            ms(self.waited / per),
        )
    }
}

/// The bytes of the WatchMapResponse messages of a scan (prost's
/// encoded_len; without gRPC's 5 bytes of framing per message): the
/// events as one message and the bookmark, which encodes to the same sum
/// as the messages the daemon split them into.
fn scan_bytes(scan: &Scan) -> u64 {
    pb::WatchMapResponse {
        events: scan.events().to_vec(),
        bookmark: Some(scan.bookmark().clone()),
        ..Default::default()
    }
    .encoded_len() as u64
}

fn scan_duration(scan: &Scan) -> Duration {
    scan.bookmark()
        .scan_duration
        .and_then(|d| Duration::try_from(d).ok())
        .unwrap_or_default()
}

/// What a bookmark said of a scan, and the bytes of its messages.
#[derive(Debug, Clone)]
struct ScanInfo {
    revision: u64,
    time: Option<SystemTime>,
    duration: Duration,
    scanned: u64,
    events_sent: u64,
    received: usize,
    bytes: u64,
}

impl ScanInfo {
    fn of(s: &Scan) -> Self {
        Self {
            revision: s.revision(),
            time: s.scan_time(),
            duration: scan_duration(s),
            scanned: s.bookmark().entries_scanned,
            events_sent: s.bookmark().events_sent,
            received: s.events().len(),
            bytes: scan_bytes(s),
        }
    }

    /// Rows of the scans' details; with `writes`, when each scan started
    /// after the write before it (negative: before it).
    fn rows(report: &Report, scans: &[Self], writes: Option<&[SystemTime]>) {
        let list = |f: &dyn Fn(usize, &Self) -> String| {
            scans
                .iter()
                .enumerate()
                .map(|(i, s)| f(i, s))
                .collect::<Vec<_>>()
                .join(", ")
        };
        report.row(
            "   revision: scan_duration ms",
            list(&|_, s| format!("{}: {:.1}", s.revision, ms(s.duration))),
        );
        report.row(
            "   entries_scanned | events_sent | events received",
            format!(
                "{} | {} | {}",
                list(&|_, s| s.scanned.to_string()),
                list(&|_, s| s.events_sent.to_string()),
                list(&|_, s| s.received.to_string()),
            ),
        );
        if let Some(writes) = writes {
            report.row(
                "   scan start after the write before it, ms",
                list(&|i, s| match (s.time, writes.get(i)) {
                    (Some(t), Some(w)) => format!(
                        "{:+.0}",
                        match t.duration_since(*w) {
                            Ok(d) => ms(d),
                            Err(e) => -ms(e.duration()),
                        }
                    ),
                    _ => "?".into(),
                }),
            );
        }
    }
}

/// The bytes of the messages of a full DumpMap (encoded_len), and the
/// entries it sent.
async fn dump_bytes(addr: &str, layout: pb::Layout, raw: bool) -> (u64, u64) {
    let mut c = MapServiceClient::connect(addr.to_owned())
        .await
        .unwrap()
        .max_decoding_message_size(64 << 20);
    let req = pb::DumpMapRequest {
        map: bpfmap_tests::map_ref("flows"),
        layout: layout as i32,
        raw,
        ..Default::default()
    };
    let mut stream = c.dump_map(req).await.unwrap().into_inner();
    let (mut bytes, mut n) = (0u64, 0u64);
    while let Some(m) = stream.message().await.unwrap() {
        bytes += m.encoded_len() as u64;
        n += m.entries.len() as u64 + m.packed.map_or(0, |p| u64::from(p.count));
    }
    (bytes, n)
}

/// What a watcher task reports of each scan.
#[derive(Debug)]
struct Seen {
    watcher: usize,
    result: Result<Bookmarked, String>,
}

#[derive(Debug)]
struct Bookmarked {
    revision: u64,
    initial: bool,
    events_sent: u64,
    events: usize,
    cursor: String,
    /// The pacer wrote after this scan.
    wrote: bool,
}

/// Reads a watch for ever, reporting each scan (its events dropped).
fn spawn_watcher(
    watcher: usize,
    mut watch: Watch,
    tx: mpsc::UnboundedSender<Seen>,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        loop {
            let result = watch
                .next_scan()
                .await
                .map(|s| Bookmarked {
                    revision: s.revision(),
                    initial: s.is_initial(),
                    events_sent: s.bookmark().events_sent,
                    events: s.events().len(),
                    cursor: s.cursor().to_owned(),
                    wrote: false,
                })
                .map_err(|e| e.to_string());
            let failed = result.is_err();
            if tx.send(Seen { watcher, result }).is_err() || failed {
                return;
            }
        }
    })
}

/// The writer's pace: a watch of the same map and interval whose filter
/// matches nothing (it shares the scans, and its bookmarks come at once
/// after each scan, whatever the other watchers do); after each of its
/// scans while `armed` is above 0, it writes and counts down.
fn spawn_pacer(
    mut watch: Watch,
    mut writer: Writer,
    armed: Arc<AtomicUsize>,
    tx: mpsc::UnboundedSender<Seen>,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        loop {
            let result = watch.next_scan().await.map_err(|e| e.to_string());
            let result = result.map(|s| {
                let wrote = !s.is_initial()
                    && armed
                        .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
                        .is_ok();
                if wrote {
                    writer.write();
                }
                Bookmarked {
                    revision: s.revision(),
                    initial: s.is_initial(),
                    events_sent: s.bookmark().events_sent,
                    events: s.events().len(),
                    cursor: s.cursor().to_owned(),
                    wrote,
                }
            });
            let failed = result.is_err();
            if tx
                .send(Seen {
                    watcher: PACER,
                    result,
                })
                .is_err()
                || failed
            {
                return;
            }
        }
    })
}

/// The pacer's number among the watchers' reports.
const PACER: usize = usize::MAX;

/// What `SCANS` scans with changes cost with some watchers.
#[derive(Debug)]
struct Window {
    watchers: usize,
    used: Used,
    scans: f64,
    /// The revisions of the scans with changes.
    revisions: (u64, u64),
    /// Events received by each watcher in those scans, in all.
    events: Vec<u64>,
    /// (watcher, revision, events_sent, events received) of the scans with
    /// changes that did not carry `CHANGED` events.
    wrong: Vec<(usize, u64, u64, usize)>,
    errors: Vec<String>,
    resyncs: f64,
}

/// The watchers' latest revisions, kept up to date from their reports.
struct Watchers {
    rx: mpsc::UnboundedReceiver<Seen>,
    latest: Vec<Option<u64>>,
    cursor: String,
    errors: Vec<String>,
}

impl Watchers {
    /// The next report; a failed watch is counted as done. Panics after
    /// 60 s without any.
    async fn recv(&mut self) -> Option<(usize, Bookmarked)> {
        let seen = tokio::time::timeout(Duration::from_secs(60), self.rx.recv())
            .await
            .ok()
            .flatten()
            .unwrap_or_else(|| {
                panic!(
                    "no scan from any watcher within 60 s (latest revisions {:?}; failures {:?})",
                    self.latest, self.errors
                )
            });
        match seen.result {
            Ok(b) => {
                if seen.watcher == 0 {
                    self.cursor.clone_from(&b.cursor);
                }
                if !b.initial && seen.watcher != PACER {
                    self.latest[seen.watcher] = Some(b.revision);
                }
                Some((seen.watcher, b))
            }
            Err(e) => {
                if seen.watcher == PACER {
                    panic!("the pacer's watch failed: {e}");
                }
                self.errors.push(format!("watcher {}: {e}", seen.watcher));
                self.latest[seen.watcher] = Some(u64::MAX);
                None
            }
        }
    }

    /// Waits until every one of the first `n` watchers has had a live scan
    /// of `revision` or later (or failed).
    async fn all_at(&mut self, n: usize, revision: u64) {
        while !self.latest[..n]
            .iter()
            .all(|r| r.is_some_and(|r| r >= revision))
        {
            self.recv().await;
        }
    }
}

/// `SCANS` scans with `CHANGED` changes each (the pacer writes after each
/// scan), measured from the first write (as soon as it is reported) to the
/// moment every one of the first `n` watchers had the last scan with
/// changes.
async fn window(n: usize, ws: &mut Watchers, armed: &AtomicUsize, metrics: SocketAddr) -> Window {
    let errors = ws.errors.len();
    armed.store(SCANS, Ordering::SeqCst);
    // The pacer's first write: the scans after it carry the changes.
    let r0 = loop {
        if let Some((PACER, b)) = ws.recv().await
            && b.wrote
        {
            break b.revision;
        }
    };
    let l0 = Load::now();
    let m0 = scrape(metrics).await;
    let last = r0 + SCANS as u64;
    let mut wrong = Vec::new();
    let mut events = vec![0u64; n];
    while !ws.latest[..n].iter().all(|r| r.is_some_and(|r| r >= last)) {
        let Some((w, b)) = ws.recv().await else {
            continue;
        };
        if w == PACER || w >= n || b.initial || !(r0 + 1..=last).contains(&b.revision) {
            continue;
        }
        events[w] += b.events_sent;
        if b.events_sent != u64::from(CHANGED) || b.events != CHANGED as usize {
            wrong.push((w, b.revision, b.events_sent, b.events));
        }
    }
    let used = Load::now().since(&l0);
    let m1 = scrape(metrics).await;
    let errors: Vec<String> = ws.errors[errors..].to_vec();
    Window {
        watchers: n,
        used,
        scans: metric(&m1, "bpfmapd_watch_scans") - metric(&m0, "bpfmapd_watch_scans"),
        revisions: (r0 + 1, last),
        events,
        wrong,
        errors,
        resyncs: metric(&m1, "bpfmapd_watch_resyncs") - metric(&m0, "bpfmapd_watch_resyncs"),
    }
}

/// The table.
struct Report {
    targets: Vec<String>,
}

impl Report {
    fn row(&self, name: &str, value: String) {
        println!("  {name:<64} {value}");
    }

    fn target(&mut self, what: &str, measured: f64, limit: f64) {
        let met = measured <= limit;
        self.targets.push(format!(
            "  {} {what}: {measured:.2}x (target <= {limit}x)",
            if met { "met   " } else { "MISSED" },
        ));
    }
}

/// Reads scans until one that started after `after`; returns it.
async fn fresh_scan(watch: &mut Watch, after: SystemTime) -> Scan {
    loop {
        let s = watch.next_scan().await.expect("a scan");
        if s.scan_time().is_some_and(|t| t >= after) {
            return s;
        }
    }
}

fn main() {
    let mut report = Report {
        targets: Vec::new(),
    };
    let started = Instant::now();
    let fs = BpfFs::new();
    let map = bpfmapd::typed_flows(N).expect("the typed flows");
    fs.pin(&map, "flows");
    let path = fs.path().join("flows");
    println!(
        "{N} typed flows (bpfmapd::typed_flows), hash, 16 -> 16 bytes; {} CPUs; watch interval {INTERVAL:?}; {CHANGED} entries changed per scan in the cases with changes",
        bpfmap_kernel::possible_cpus()
    );

    // 1. The floor, before any watch runs.
    let l0 = Load::now();
    let floor_samples: Vec<Duration> = (0..SCANS).map(|_| floor_sample(&path)).collect();
    let floor_used = Load::now().since(&l0);
    let floor = median(floor_samples.clone());
    report.row(
        &format!("1. floor: BPF_MAP_LOOKUP_BATCH, {READ}/call, median of {SCANS}"),
        format!(
            "{:>9.1} ms  (walks {} ms)",
            ms(floor),
            floor_samples
                .iter()
                .map(|d| format!("{:.1}", ms(*d)))
                .collect::<Vec<_>>()
                .join(", "),
        ),
    );
    report.row("   per walk", floor_used.show(SCANS as u32));

    let daemon_rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .thread_name("bpfmapd")
        .enable_all()
        .build()
        .unwrap();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .thread_name("clients")
        .enable_all()
        .build()
        .unwrap();
    let state = tempfile::tempdir().unwrap();
    let base = Daemon::config(fs.path(), state.path());
    // Cases 2 to 4: the default limits but max_watch_bytes (the default,
    // 32 MiB, cannot hold a million entries).
    let config = bpfmapd::Config {
        metrics_listen: Some("127.0.0.1:0".parse().unwrap()),
        limits: bpfmapd::Limits {
            max_watch_bytes: 512 << 20,
            ..base.limits.clone()
        },
        ..base.clone()
    };
    let daemon = daemon_rt.block_on(Daemon::start_with(config.clone()));
    let metrics = daemon.running.metrics_addr().expect("a metrics listener");
    let addr = daemon.addr();
    let name: MapName = "flows".parse().unwrap();
    let options = WatchOptions::default().with_interval(INTERVAL);
    let mut writer = Writer::new(map);

    rt.block_on(async {
        // A full dump's bytes, before any watch runs: as the watch's events
        // (entries, decoded) and packed (the library's default).
        let (entries_dump, n) = dump_bytes(&addr, pb::Layout::Entries, false).await;
        assert_eq!(n, u64::from(N), "the dump sent the wrong number of entries");
        let (packed_dump, n) = dump_bytes(&addr, pb::Layout::Packed, true).await;
        assert_eq!(n, u64::from(N), "the packed dump sent the wrong number of entries");

        // 2. One watch, its initial state, then scans with no change.
        let client = daemon.client().await;
        let mut watch = client.watch(&name, options.clone());
        let t = Instant::now();
        let initial = watch.next_scan().await.expect("the initial state");
        let initial_wall = t.elapsed();
        let b = initial.bookmark();
        report.row(
            "   initial state: first scan (builds the state) | state received",
            format!(
                "{:>9.1} ms | {:.1} ms; {} events, events_sent {}, entries_scanned {}, {:.1} MB",
                ms(scan_duration(&initial)),
                ms(initial_wall),
                initial.events().len(),
                b.events_sent,
                b.entries_scanned,
                scan_bytes(&initial) as f64 / 1e6
            ),
        );
        if initial.events().len() != N as usize || b.events_sent != u64::from(N) {
            println!("  !! the initial state should hold {N} events");
        }
        drop(initial);
        let idle_bytes = metric(&scrape(metrics).await, "bpfmapd_watch_bytes");

        // Scans made while the initial state was on its way, or before now,
        // are left out: the first scan that starts after now is the mark
        // the next SCANS are measured from.
        fresh_scan(&mut watch, SystemTime::now()).await;
        let l0 = Load::now();
        let mut idle: Vec<ScanInfo> = Vec::new();
        while idle.len() < SCANS {
            idle.push(ScanInfo::of(&watch.next_scan().await.expect("a scan")));
        }
        let idle_used = Load::now().since(&l0);
        let idle_scan = median(idle.iter().map(|s| s.duration).collect());
        let r = ratio(idle_scan, floor);
        report.row(
            &format!("2. watch scan, no change: scan_duration, median of {SCANS}"),
            format!("{:>9.1} ms  {r:>5.2}x the floor", ms(idle_scan)),
        );
        ScanInfo::rows(&report, &idle, None);
        report.row("   per scan (and interval)", idle_used.show(SCANS as u32));
        if idle
            .iter()
            .any(|s| s.events_sent != 0 || s.scanned != u64::from(N))
        {
            println!("  !! a scan with no change should send 0 events and scan {N} entries");
        }
        report.target("watch scan with no change, vs the floor", r, 1.3);

        // 3. Scans with 1 % changed, the writer writing after each scan.
        let (mut busy, mut writes) = (Vec::new(), Vec::new());
        let l0 = Load::now();
        while busy.len() < SCANS {
            writes.push(SystemTime::now());
            writer.write();
            busy.push(ScanInfo::of(&watch.next_scan().await.expect("a scan")));
        }
        let busy_used = Load::now().since(&l0);
        let busy_scan = median(busy.iter().map(|s| s.duration).collect());
        let r = ratio(busy_scan, floor);
        report.row(
            &format!("3. watch scan, {CHANGED} changed: scan_duration, median of {SCANS}"),
            format!("{:>9.1} ms  {r:>5.2}x the floor", ms(busy_scan)),
        );
        ScanInfo::rows(&report, &busy, Some(&writes));
        report.row("   per scan (and interval)", busy_used.show(SCANS as u32));
        if busy
            .iter()
            .any(|s| s.events_sent != u64::from(CHANGED) || s.received != CHANGED as usize)
        {
            println!("  !! every scan with changes should send exactly {CHANGED} events");
        }
        report.target("watch scan with 1 % changed, vs the floor", r, 1.5);
        let scan_b = median(busy.iter().map(|s| s.bytes).collect());
        report.row(
            "   WatchMapResponse bytes of such a scan (median)",
            format!(
                "{:>9.0} B   {:.1} B/event sent; {:.2} % of a full DumpMap (entries, decoded) {:.1} MB; {:.2} % of a packed DumpMap {:.1} MB",
                scan_b as f64,
                scan_b as f64 / busy.iter().map(|s| s.events_sent).max().unwrap_or(0).max(1) as f64,
                100.0 * scan_b as f64 / entries_dump as f64,
                entries_dump as f64 / 1e6,
                100.0 * scan_b as f64 / packed_dump as f64,
                packed_dump as f64 / 1e6,
            ),
        );

        // 4. Memory.
        let busy_mem = metric(&scrape(metrics).await, "bpfmapd_watch_bytes");
        report.row(
            "4. bpfmapd_watch_bytes, one watched map: no change | after the scans with changes",
            format!(
                "{:.1} MiB = {:.1} B/entry | {:.1} MiB = {:.1} B/entry (with the history of recent scans)",
                idle_bytes / f64::from(1 << 20),
                idle_bytes / f64::from(N),
                busy_mem / f64::from(1 << 20),
                busy_mem / f64::from(N),
            ),
        );

    });
    daemon_rt.block_on(daemon.stop());

    // Case 5, on a daemon allowed WATCHERS watches (one identity: plaintext
    // callers from one address share one) and enough history that watchers
    // behind by a few scans of 10,000 changes catch up rather than start
    // again.
    let config = bpfmapd::Config {
        limits: bpfmapd::Limits {
            watch_history_bytes: 64 << 20,
            max_watches: 2 * WATCHERS,
            max_watches_per_identity: 2 * WATCHERS,
            ..config.limits.clone()
        },
        ..config
    };
    let daemon = daemon_rt.block_on(Daemon::start_with(config));
    let metrics = daemon.running.metrics_addr().expect("a metrics listener");
    rt.block_on(async {
        // 5. CPU of 1 watcher, then 100, with 1 % changing per scan; the
        // writer paced by a watch of its own that receives no events.
        let (tx, rx) = mpsc::unbounded_channel();
        let mut ws = Watchers {
            rx,
            latest: vec![None; WATCHERS],
            cursor: String::new(),
            errors: Vec::new(),
        };
        let client = daemon.client().await;
        let mut tasks = vec![spawn_watcher(0, client.watch(&name, options.clone()), tx.clone())];
        // Watcher 0's initial state, then a live scan.
        ws.all_at(1, 1).await;
        let held = metric(&scrape(metrics).await, "bpfmapd_watch_bytes");
        report.row(
            "   bpfmapd_watch_bytes on case 5's daemon (watch_history_bytes 64 MiB), one watcher",
            format!(
                "{:.1} MiB = {:.1} B/entry",
                held / f64::from(1 << 20),
                held / f64::from(N),
            ),
        );
        let armed = Arc::new(AtomicUsize::new(0));
        let pacer = daemon
            .client()
            .await
            .watch(&name, options.clone().with_filter("key.dport == 1"));
        tasks.push(spawn_pacer(pacer, writer, armed.clone(), tx.clone()));
        let one = window(1, &mut ws, &armed, metrics).await;
        let mut clients = vec![client];
        for _ in 1..CONNECTIONS {
            clients.push(daemon.client().await);
        }
        // The others resume from watcher 0's latest cursor: the changes
        // since, not a million-entry initial state each.
        let cursor = ws.cursor.clone();
        for w in 1..WATCHERS {
            let c = &clients[w % CONNECTIONS];
            let watch = c.watch(&name, options.clone().with_cursor(cursor.clone()));
            tasks.push(spawn_watcher(w, watch, tx.clone()));
        }
        let joined = ws.latest[0].unwrap_or(0) + 2;
        ws.all_at(WATCHERS, joined).await;
        let watchers = metric(&scrape(metrics).await, "bpfmapd_watchers");
        let many = window(WATCHERS, &mut ws, &armed, metrics).await;
        for w in [&one, &many] {
            report.row(
                &format!(
                    "5. {} watcher(s) (+ the pacer), {SCANS} scans with {CHANGED} changed (revisions {}-{})",
                    w.watchers, w.revisions.0, w.revisions.1
                ),
                format!(
                    "{:.2} s, {:.0} scans: {:.2} scans/interval; events per watcher {}",
                    w.used.wall.as_secs_f64(),
                    w.scans,
                    w.scans / (w.used.wall.as_secs_f64() / INTERVAL.as_secs_f64()),
                    {
                        let (lo, hi) = (
                            w.events.iter().min().copied().unwrap_or(0),
                            w.events.iter().max().copied().unwrap_or(0),
                        );
                        if lo == hi {
                            format!("{lo}")
                        } else {
                            format!("{lo} to {hi}")
                        }
                    },
                ),
            );
            report.row("   in all", w.used.show(1));
            if !w.wrong.is_empty() || !w.errors.is_empty() || w.resyncs > 0.0 {
                let mut revisions: Vec<u64> = w.wrong.iter().map(|x| x.1).collect();
                revisions.sort_unstable();
                revisions.dedup();
                let watchers: std::collections::BTreeSet<usize> =
                    w.wrong.iter().map(|x| x.0).collect();
                println!(
                    "  !! {} scans without {CHANGED} events, of {} watchers, revisions {revisions:?} (watcher, revision, events_sent, received; first 10: {:?}), {} resyncs, errors: {:?}",
                    w.wrong.len(),
                    watchers.len(),
                    &w.wrong[..w.wrong.len().min(10)],
                    w.resyncs,
                    w.errors
                );
            }
        }
        report.row(
            &format!("   {WATCHERS} watchers : 1, CPU (bpfmapd_watchers {watchers}, the pacer included)"),
            format!(
                "{:>9.2}x  (the daemon's CPU {:.2}x); per watcher and scan {:.2} ms ({:.2} ms of it the daemon's)",
                ratio(many.used.ours, one.used.ours),
                ratio(many.used.daemon, one.used.daemon),
                ms(many.used.ours) / (WATCHERS * SCANS) as f64,
                ms(many.used.daemon) / (WATCHERS * SCANS) as f64,
            ),
        );
        for t in tasks {
            t.abort();
        }
    });
    daemon_rt.block_on(daemon.stop());
    let after: Vec<Duration> = (0..SCANS).map(|_| floor_sample(&path)).collect();
    println!(
        "  the floor again, once the daemon stopped (median of {SCANS}): {:.1} ms",
        ms(median(after))
    );
    println!("\ntargets:");
    for t in &report.targets {
        println!("{t}");
    }
    println!("total {:.1} s", started.elapsed().as_secs_f64());
}
