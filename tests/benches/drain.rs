//! Drains: how fast DrainMap empties a map, against the kernel's own
//! lookup-and-delete in-process (the floor), both measured in the same run
//! on the same map; and what draining a map does to the increments of a BPF
//! program that writes it.
//!
//!     cargo bench -p bpfmap-tests --bench drain                 (as root)
//!     cargo bench -p bpfmap-tests --bench drain -- throughput   (or loss)
//!
//! Both parts load tests/bpf/drain_counter.bpf.c (clang and libbpf-dev:
//! `apt-get install clang libbpf-dev`). The loss part runs its programs
//! with BPF_PROG_TEST_RUN; the throughput part uses its fsync probes.
//! Nothing here asserts a timing: the figures are printed, with the target
//! of the issue met or missed.

use std::{
    os::raw::c_int,
    path::Path,
    sync::atomic::{AtomicBool, AtomicU64, Ordering},
    time::{Duration, Instant},
};

use aya::{
    Ebpf, TestRun as _, TestRunOptions,
    maps::{Array, MapData},
    programs::{RawTracePoint, SchedClassifier},
};
use bpfmap_kernel::{MapHandle, drain::Drainer};
use bpfmap_proto::v1::{self as pb, map_service_client::MapServiceClient};
use bpfmap_tests::{BpfFs, Daemon, MapType, OwnedMap, create_map, map_ref, median, update_batch};
use tonic::transport::Channel;

const SECTIONS: [&str; 2] = ["throughput", "loss"];

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

fn ratio(a: Duration, b: Duration) -> f64 {
    a.as_secs_f64() / b.as_secs_f64()
}

/// Loads the object (maps created, no program loaded yet), its fsync
/// probes set to count this process's calls.
fn load_object(object: &[u8]) -> Ebpf {
    let pid = std::process::id();
    aya::EbpfLoader::new()
        .override_global("target_tgid", &pid, true)
        .override_global("nr_fsync", &libc::SYS_fsync, true)
        .override_global("nr_fdatasync", &libc::SYS_fdatasync, true)
        .load(object)
        .unwrap_or_else(|e| panic!("loading drain_counter.bpf.c: {e}"))
}

/// Drains a map to its end, one chunk of up to `batch` entries per kernel
/// call; calls `each(key, value)` for every entry, with the value's bytes
/// (all CPUs' values of a per-CPU map).
fn drain_all(handle: &MapHandle, batch: u32, mut each: impl FnMut(&[u8], &[u8])) -> u64 {
    let mut d = Drainer::new(handle).unwrap_or_else(|e| panic!("a drain of the map: {e}"));
    let ks = handle.meta().key_size as usize;
    let vs = handle.meta().kernel_value_size();
    let mut n = 0;
    while let Some(c) = d
        .next_chunk(batch)
        .unwrap_or_else(|e| panic!("lookup-and-delete: {e}"))
    {
        for i in 0..c.count {
            each(
                &c.keys[i * ks..(i + 1) * ks],
                &c.values[i * vs..(i + 1) * vs],
            );
        }
        n += c.count as u64;
    }
    n
}

// ---------------------------------------------------------------------
// throughput

/// Entries of the map drained.
const ENTRIES: u32 = 1_000_000;
/// Entries per kernel call, the floor's and the requests' chunk_size.
const BATCH: u32 = 4096;
/// Samples per case: each needs the map refilled.
const RUNS: usize = 3;
/// Where the map is pinned, relative to the daemon's root.
const MAP: &str = "bench/flows";
/// The issue's target: a drain through the daemon, spool included, at most
/// this many times the floor.
const TARGET: f64 = 1.5;

const CONFIG: &str = r#"
[drain]
maps = ["bench/*"]

[[rule]]
identities = ["anonymous"]
maps = ["**"]
operations = ["list", "dump", "drain"]
"#;

/// The fsync and fdatasync calls of this process and their time, counted
/// in the kernel by the object's raw tracepoints on sys_enter and sys_exit
/// (only the daemon's spool calls fsync here). Attached for the whole
/// part: every syscall of the machine runs a few more instructions, the
/// floor's as the daemon's.
struct FsyncProbe {
    ebpf: Ebpf,
}

impl FsyncProbe {
    fn attach(object: &[u8]) -> Result<Self, String> {
        let mut ebpf = load_object(object);
        for (prog, tp) in [("fsync_enter", "sys_enter"), ("fsync_exit", "sys_exit")] {
            let p: &mut RawTracePoint = ebpf
                .program_mut(prog)
                .expect("the object has its fsync probes")
                .try_into()
                .map_err(|e| format!("{prog}: {e}"))?;
            p.load().map_err(|e| format!("loading {prog}: {e}"))?;
            p.attach(tp)
                .map_err(|e| format!("attaching {prog} to {tp}: {e}"))?;
        }
        Ok(Self { ebpf })
    }

    /// Calls and time so far.
    fn totals(&self) -> (u64, Duration) {
        let stats: Array<&MapData, [u64; 2]> =
            Array::try_from(self.ebpf.map("fsync_stats").expect("fsync_stats")).unwrap();
        let [calls, ns] = stats.get(&0, 0).unwrap();
        (calls, Duration::from_nanos(ns))
    }
}

/// What the probe counted over a stretch: calls and time.
#[derive(Clone, Copy, Default)]
struct Fsyncs {
    calls: u64,
    time: Duration,
}

/// The keys and values the map is refilled with: i -> i * 3 (u64 LE).
struct Contents {
    keys: Vec<u8>,
    values: Vec<u8>,
}

impl Contents {
    fn new(n: u32) -> Self {
        let (mut keys, mut values) = (Vec::new(), Vec::new());
        for k in 0..u64::from(n) {
            keys.extend_from_slice(&k.to_le_bytes());
            values.extend_from_slice(&(k * 3).to_le_bytes());
        }
        Self { keys, values }
    }

    fn fill(&self, map: &OwnedMap) {
        for (k, v) in self
            .keys
            .chunks(8 * 50_000)
            .zip(self.values.chunks(8 * 50_000))
        {
            update_batch(map, k, v);
        }
    }
}

/// The floor: the map drained in-process with the kernel's lookup-and-delete
/// batch, BATCH entries a call.
fn floor_drain(path: &Path) -> u64 {
    let handle = MapHandle::open_pinned_writable(path).unwrap();
    drain_all(&handle, BATCH, |_, _| {})
}

type Grpc = MapServiceClient<Channel>;

/// One DrainMap call read to its summary: the entries received, the last
/// chunk's cursor, and the summary.
struct Call {
    entries: u64,
    cursor: String,
    summary: pb::DrainSummary,
}

async fn drain_call(c: &mut Grpc, ack: &str) -> Call {
    drain_call_of(c, ack, BATCH).await
}

/// The same, with `chunk_size` entries per chunk (0: the server's default).
async fn drain_call_of(c: &mut Grpc, ack: &str, chunk_size: u32) -> Call {
    let request = pb::DrainMapRequest {
        map: map_ref(MAP),
        ack: ack.into(),
        chunk_size,
        raw: true,
        ..Default::default()
    };
    let mut stream = c
        .drain_map(request)
        .await
        .unwrap_or_else(|e| panic!("DrainMap: {e}"))
        .into_inner();
    let (mut entries, mut cursor) = (0u64, String::new());
    while let Some(m) = stream
        .message()
        .await
        .unwrap_or_else(|e| panic!("DrainMap: {e}"))
    {
        if m.done {
            let summary = m.summary.expect("the last message carries the summary");
            return Call {
                entries,
                cursor,
                summary,
            };
        }
        entries += m.entries.len() as u64;
        cursor = m.cursor;
    }
    panic!("DrainMap ended without its summary");
}

/// A DrainMap of the full map: every entry received, the map empty.
fn check_drained(call: &Call) {
    let s = &call.summary;
    assert_eq!(call.entries, u64::from(ENTRIES), "entries received");
    assert_eq!(s.drained, u64::from(ENTRIES), "entries drained: {s:?}");
    assert_eq!(s.redelivered, 0, "nothing redelivered: {s:?}");
    assert!(s.complete, "the map was drained to its end: {s:?}");
}

/// A call acknowledging a whole drain: the spool empty again.
fn check_acknowledged(call: &Call) {
    let s = &call.summary;
    assert_eq!(s.acknowledged, u64::from(ENTRIES), "acknowledged: {s:?}");
    assert_eq!(s.spooled, 0, "the spool is empty: {s:?}");
    assert_eq!(s.drained, 0, "nothing left to drain: {s:?}");
}

fn row(name: &str, d: Duration, against: Option<f64>) {
    let mut line = format!(
        "  {name:<62} {:>8.1} ms {:>7.3} us/entry",
        ms(d),
        d.as_secs_f64() * 1e6 / f64::from(ENTRIES)
    );
    if let Some(r) = against {
        line.push_str(&format!("  {r:>5.2}x the floor"));
    }
    println!("{line}");
}

fn fsync_row(f: Fsyncs, of: Duration) {
    println!(
        "  {:<62} {:>8.1} ms in {} fsync calls ({:.2} ms each, {:.0}% of the call)",
        "  of which fsync (the spool)",
        ms(f.time),
        f.calls,
        ms(f.time) / f.calls.max(1) as f64,
        100.0 * f.time.as_secs_f64() / of.as_secs_f64()
    );
}

fn throughput(object: &[u8], rt: &tokio::runtime::Runtime) {
    let fs = BpfFs::new();
    let map = create_map(MapType::HASH, 8, 8, ENTRIES);
    let path = fs.pin(&map, MAP);
    let contents = Contents::new(ENTRIES);
    // The spool on the disk the workspace is on (target/tmp), not on a
    // tmpfs where fsync costs nothing.
    let state = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let probe = FsyncProbe::attach(object);
    println!(
        "throughput: {ENTRIES} entries, hash u64 -> u64, {BATCH} entries per kernel call and chunk; medians of {RUNS} runs, the map refilled before each; spool in {}",
        state.path().display()
    );
    if let Err(e) = &probe {
        println!("  fsync calls not measured: {e}");
    }
    let fsyncs = || probe.as_ref().ok().map(FsyncProbe::totals);
    let since = |before: Option<(u64, Duration)>| {
        before
            .zip(fsyncs())
            .map(|((c0, t0), (c1, t1))| Fsyncs {
                calls: c1 - c0,
                time: t1 - t0,
            })
            .unwrap_or_default()
    };
    rt.block_on(async {
        let mut config = bpfmapd::Config::from_toml(CONFIG).expect("a valid configuration");
        let base = Daemon::config(fs.path(), state.path());
        config.listen = base.listen;
        config.roots = base.roots;
        config.state_dir = base.state_dir;
        config.mount_bpffs = false;
        let daemon = Daemon::start_with(config).await;
        let channel = tonic::transport::Endpoint::from_shared(daemon.addr())
            .unwrap()
            .tcp_nodelay(true)
            .connect()
            .await
            .unwrap();
        let mut c = MapServiceClient::new(channel).max_decoding_message_size(64 << 20);
        let (mut floor, mut drain, mut both) = (Vec::new(), Vec::new(), Vec::new());
        let (mut drain_fsync, mut both_fsync) = (Vec::new(), Vec::new());
        let (mut large, mut large_fsync) = (Vec::new(), Vec::new());
        let mut daemon_elapsed = Vec::new();
        // The cases alternate, so that a machine that slows down or speeds
        // up during the run moves them alike.
        for _ in 0..RUNS {
            contents.fill(&map);
            let t = Instant::now();
            assert_eq!(floor_drain(&path), u64::from(ENTRIES));
            floor.push(t.elapsed());

            contents.fill(&map);
            let before = fsyncs();
            let t = Instant::now();
            let call = drain_call(&mut c, "").await;
            drain.push(t.elapsed());
            drain_fsync.push(since(before));
            check_drained(&call);
            daemon_elapsed.push(
                call.summary
                    .elapsed
                    .and_then(|d| Duration::try_from(d).ok())
                    .unwrap_or_default(),
            );
            // Untimed: the spool emptied for the next run.
            check_acknowledged(&drain_call(&mut c, &call.cursor).await);

            contents.fill(&map);
            let before = fsyncs();
            let t = Instant::now();
            let call = drain_call(&mut c, "").await;
            let acked = drain_call(&mut c, &call.cursor).await;
            both.push(t.elapsed());
            both_fsync.push(since(before));
            check_drained(&call);
            check_acknowledged(&acked);

            // The server's default chunks (512 KiB of entries): fewer
            // fsyncs.
            contents.fill(&map);
            let before = fsyncs();
            let t = Instant::now();
            let call = drain_call_of(&mut c, "", 0).await;
            large.push(t.elapsed());
            large_fsync.push(since(before));
            check_drained(&call);
            check_acknowledged(&drain_call_of(&mut c, &call.cursor, 0).await);
        }
        let floor = median(floor);
        row(
            "in-process Drainer, lookup-and-delete batch (the floor)",
            floor,
            None,
        );
        let d = median(drain.clone());
        row(
            "DrainMap over gRPC, raw, spooled, read to the summary",
            d,
            Some(ratio(d, floor)),
        );
        if probe.is_ok() {
            let f = fsync_median(&drain, &drain_fsync);
            fsync_row(f, d);
            let rest = d.saturating_sub(f.time);
            println!(
                "  {:<62} {:>8.1} ms {:>18}  {:>5.2}x the floor",
                "  the call without its fsync time",
                ms(rest),
                "",
                ratio(rest, floor)
            );
        }
        println!(
            "  {:<62} {:>8.1} ms",
            "  the daemon's own time (summary.elapsed)",
            ms(median(daemon_elapsed))
        );
        let b = median(both.clone());
        row(
            "the same, then a call acknowledging every chunk",
            b,
            Some(ratio(b, floor)),
        );
        if probe.is_ok() {
            fsync_row(fsync_median(&both, &both_fsync), b);
        }
        let l = median(large.clone());
        row(
            "DrainMap, the server's default chunks (chunk_size 0: 512 KiB)",
            l,
            Some(ratio(l, floor)),
        );
        if probe.is_ok() {
            fsync_row(fsync_median(&large, &large_fsync), l);
        }
        for (name, r) in [("4096-entry chunks", ratio(d, floor)), ("default chunks", ratio(l, floor))] {
            println!(
                "  {} DrainMap of {ENTRIES} entries, {name}, vs the floor: {r:.2}x (target <= {TARGET}x)",
                if r <= TARGET { "met   " } else { "MISSED" },
            );
        }
        daemon.stop().await;
    });
}

/// The fsyncs of the run whose time is the median.
fn fsync_median(times: &[Duration], fsyncs: &[Fsyncs]) -> Fsyncs {
    let m = median(times.to_vec());
    let i = times
        .iter()
        .position(|t| *t == m)
        .expect("the median is a sample");
    fsyncs[i]
}

// ---------------------------------------------------------------------
// loss

/// Program runs per measurement, unless `LOSS_RUNS` says otherwise.
const LOSS_RUNS: u64 = 2_000_000;

fn loss_runs() -> u64 {
    std::env::var("LOSS_RUNS")
        .ok()
        .and_then(|r| r.parse().ok())
        .unwrap_or(LOSS_RUNS)
}
/// Runs per BPF_PROG_TEST_RUN call (its `repeat`), all on one key.
const REPEAT: u32 = 1000;
/// The keys the program increments, one per call in turn.
const KEYS: u32 = 16;

/// Swaps of the pair per measurement at least: each waits for an RCU grace
/// period, far longer than the runs of the other variants take.
const PAIR_SWAPS: u64 = 20;

/// A way of counting: the program, the maps it writes.
struct Variant {
    label: &'static str,
    program: &'static str,
    /// One map, or the double-buffered pair (the `active` map says which).
    maps: &'static [&'static str],
    /// Its index in the object's `vanished` array.
    index: u32,
    /// The program runs until the collector has drained this many times,
    /// however many runs that takes.
    min_drains: u64,
}

const VARIANTS: [Variant; 4] = [
    Variant {
        label: "hash, preallocated (default)",
        program: "count_prealloc",
        maps: &["counters"],
        index: 0,
        min_drains: 0,
    },
    Variant {
        label: "hash, BPF_F_NO_PREALLOC",
        program: "count_no_prealloc",
        maps: &["counters_no_prealloc"],
        index: 1,
        min_drains: 0,
    },
    Variant {
        label: "percpu_hash (sum of the CPUs)",
        program: "count_percpu",
        maps: &["counters_percpu"],
        index: 2,
        min_drains: 0,
    },
    Variant {
        label: "two hashes swapped by the collector",
        program: "count_double",
        maps: &["counters_a", "counters_b"],
        index: 3,
        min_drains: PAIR_SWAPS,
    },
];

/// What the drains returned: the sum of the values (of every CPU's).
struct Tally {
    total: u64,
}

impl Tally {
    fn new() -> Self {
        Self { total: 0 }
    }

    fn drain(&mut self, handle: &MapHandle) {
        drain_all(handle, 4096, |k, v| {
            let key = u32::from_le_bytes(k.try_into().expect("u32 keys"));
            assert!(key < KEYS, "key {key} was never incremented");
            self.total += v
                .chunks(8)
                .map(|c| u64::from_le_bytes(c.try_into().expect("u64 values")))
                .sum::<u64>();
        });
    }
}

/// How the collector waits, after swapping the maps, for the programs that
/// may still write the old one: membarrier(MEMBARRIER_CMD_GLOBAL), which is
/// synchronize_rcu() (non-sleepable BPF programs run inside an RCU read-side
/// section), or a sleep where the kernel has no such command.
#[derive(Clone, Copy)]
enum Grace {
    Membarrier,
    Sleep(Duration),
}

const MEMBARRIER_CMD_QUERY: c_int = 0;
const MEMBARRIER_CMD_GLOBAL: c_int = 1;

fn membarrier(cmd: c_int) -> i64 {
    // SAFETY: membarrier takes two integers and no pointers.
    unsafe { libc::syscall(libc::SYS_membarrier, cmd, 0, 0) }
}

impl Grace {
    fn detect() -> Self {
        if membarrier(MEMBARRIER_CMD_QUERY) & i64::from(MEMBARRIER_CMD_GLOBAL) != 0 {
            Self::Membarrier
        } else {
            Self::Sleep(Duration::from_millis(10))
        }
    }

    fn wait(self) {
        match self {
            Self::Membarrier => assert_eq!(membarrier(MEMBARRIER_CMD_GLOBAL), 0, "membarrier"),
            Self::Sleep(d) => std::thread::sleep(d),
        }
    }

    fn describe(self) -> String {
        match self {
            Self::Membarrier => "membarrier(MEMBARRIER_CMD_GLOBAL), an RCU grace period".into(),
            Self::Sleep(d) => format!(
                "a sleep of {} ms (no MEMBARRIER_CMD_GLOBAL here)",
                d.as_millis()
            ),
        }
    }
}

/// The CPUs this thread may run on.
fn affinity() -> libc::cpu_set_t {
    // SAFETY: cpu_set_t is a bit array; all zeroes is the empty set.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    // SAFETY: the set is as large as the size given, and outlives the call.
    let r = unsafe { libc::sched_getaffinity(0, size_of::<libc::cpu_set_t>(), &mut set) };
    assert_eq!(
        r,
        0,
        "sched_getaffinity: {}",
        std::io::Error::last_os_error()
    );
    set
}

/// Restricts this thread to `set`.
fn set_affinity(set: &libc::cpu_set_t) {
    // SAFETY: the set is as large as the size given, and outlives the call.
    let r = unsafe { libc::sched_setaffinity(0, size_of::<libc::cpu_set_t>(), set) };
    assert_eq!(
        r,
        0,
        "sched_setaffinity: {}",
        std::io::Error::last_os_error()
    );
}

/// The set of one CPU.
fn only(cpu: usize) -> libc::cpu_set_t {
    // SAFETY: cpu_set_t is a bit array; all zeroes is the empty set.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    // SAFETY: CPU_SET ignores CPUs beyond the set's size.
    unsafe { libc::CPU_SET(cpu, &mut set) };
    set
}

/// The first two CPUs of `set`: where the program and the collector run.
fn two_cpus(set: &libc::cpu_set_t) -> Option<(usize, usize)> {
    let mut cpus = (0..libc::CPU_SETSIZE as usize)
        // SAFETY: CPU_ISSET only reads the set, within its size.
        .filter(|&c| unsafe { libc::CPU_ISSET(c, set) });
    Some((cpus.next()?, cpus.next()?))
}

/// One measurement's results.
struct Outcome {
    runs: u64,
    drains: u64,
    drained: u64,
    vanished: u64,
    writing: Duration,
}

impl Outcome {
    /// Runs whose increment no drain returned.
    fn lost(&self) -> i64 {
        self.runs as i64 - self.drained as i64
    }
}

/// The loaded object, its maps pinned and opened writable.
struct Counters {
    ebpf: Ebpf,
    active: Array<MapData, u32>,
    _fs: BpfFs,
    handles: Vec<(&'static str, MapHandle)>,
}

impl Counters {
    fn load(object: &[u8]) -> Self {
        let mut ebpf = load_object(object);
        for v in &VARIANTS {
            let p: &mut SchedClassifier = ebpf.program_mut(v.program).unwrap().try_into().unwrap();
            p.load()
                .unwrap_or_else(|e| panic!("loading {}: {e}", v.program));
        }
        let fs = BpfFs::new();
        let mut handles = Vec::new();
        for name in VARIANTS.iter().flat_map(|v| v.maps) {
            let path = fs.path().join(name);
            ebpf.map(name).unwrap().pin(&path).unwrap();
            handles.push((*name, MapHandle::open_pinned_writable(&path).unwrap()));
        }
        let active = Array::try_from(ebpf.take_map("active").unwrap()).unwrap();
        Self {
            ebpf,
            active,
            _fs: fs,
            handles,
        }
    }

    fn vanished(&self, index: u32) -> u64 {
        let a: Array<&MapData, u64> = Array::try_from(self.ebpf.map("vanished").unwrap()).unwrap();
        a.get(&index, 0).unwrap()
    }

    /// `runs` runs of the variant's program (more until the collector has
    /// drained `min_drains` times), its maps drained over and over by
    /// another thread while they run (`concurrent`) or not, then drained
    /// once more.
    fn measure(
        &mut self,
        v: &Variant,
        runs: u64,
        concurrent: bool,
        grace: Grace,
        collector_cpu: Option<usize>,
    ) -> Outcome {
        let vanished_before = self.vanished(v.index);
        let prog: &SchedClassifier = self.ebpf.program(v.program).unwrap().try_into().unwrap();
        let handles: Vec<&MapHandle> = v
            .maps
            .iter()
            .map(|name| &self.handles.iter().find(|(n, _)| n == name).unwrap().1)
            .collect();
        let active = &mut self.active;
        let stop = AtomicBool::new(false);
        let drained_times = AtomicU64::new(0);
        let (mut tally, drains, done, writing) = std::thread::scope(|s| {
            let collector = s.spawn(|| {
                if let Some(cpu) = collector_cpu {
                    set_affinity(&only(cpu));
                }
                let mut tally = Tally::new();
                let mut drains = 0u64;
                let mut side = 0u32;
                while concurrent && !stop.load(Ordering::Acquire) {
                    if let [a, b] = handles[..] {
                        // Double-buffered: the program now writes the other
                        // map; once it can no longer be writing the old one,
                        // that one is drained.
                        let old = if side == 0 { a } else { b };
                        side ^= 1;
                        active.set(0, side, 0).unwrap();
                        grace.wait();
                        tally.drain(old);
                    } else {
                        tally.drain(handles[0]);
                    }
                    drains += 1;
                    drained_times.store(drains, Ordering::Release);
                }
                (tally, drains)
            });
            let mut packet = [0u8; 64];
            let t = Instant::now();
            let (mut done, mut call) = (0u64, 0u64);
            while done < runs
                || (concurrent && drained_times.load(Ordering::Acquire) < v.min_drains)
            {
                let key = (call % u64::from(KEYS)) as u32;
                packet[..4].copy_from_slice(&key.to_le_bytes());
                prog.test_run(TestRunOptions {
                    data_in: Some(&packet),
                    repeat: REPEAT,
                    ..TestRunOptions::new()
                })
                .unwrap_or_else(|e| panic!("BPF_PROG_TEST_RUN of {}: {e}", v.program));
                done += u64::from(REPEAT);
                call += 1;
            }
            let writing = t.elapsed();
            stop.store(true, Ordering::Release);
            let (tally, drains) = collector.join().unwrap();
            (tally, drains, done, writing)
        });
        // No program runs now: what is left is drained once more.
        for h in &handles {
            tally.drain(h);
        }
        Outcome {
            runs: done,
            drains,
            drained: tally.total,
            vanished: self.vanished(v.index) - vanished_before,
            writing,
        }
    }
}

/// Concurrent measurements per variant: the row shows the median by lost
/// increments, and the range of the rounds.
const LOSS_ROUNDS: usize = 3;

fn loss_header() {
    println!(
        "  {:<48} {:>9} {:>6} {:>8} {:>8} {:>8} {:>7} {:>15} {:>9} {:>8}",
        "map",
        "runs",
        "ns/run",
        "drains",
        "drains/s",
        "lost",
        "lost %",
        "rounds' lost %",
        "lost/drain",
        "vanished"
    );
}

fn loss_row(label: &str, o: &Outcome, range: &str) {
    let per_drain = if o.drains == 0 {
        "-".to_owned()
    } else {
        format!("{:.3}", o.lost() as f64 / o.drains as f64)
    };
    println!(
        "  {label:<48} {:>9} {:>6.0} {:>8} {:>8.0} {:>8} {:>6.3}% {range:>15} {per_drain:>10} {:>8}",
        o.runs,
        o.writing.as_secs_f64() * 1e9 / o.runs as f64,
        o.drains,
        o.drains as f64 / o.writing.as_secs_f64(),
        o.lost(),
        100.0 * o.lost() as f64 / o.runs as f64,
        o.vanished,
    );
}

fn loss(object: &[u8]) {
    let runs = loss_runs() / u64::from(REPEAT) * u64::from(REPEAT);
    let grace = Grace::detect();
    let mut counters = Counters::load(object);
    let saved = affinity();
    let cpus = two_cpus(&saved);
    if let Some((program, _)) = cpus {
        set_affinity(&only(program));
    }
    println!(
        "loss: {runs} runs (the pair: until the collector swapped {PAIR_SWAPS} times) of a tc program (BPF_PROG_TEST_RUN, {REPEAT} repeats a call, \
         one key a call, {KEYS} keys in turn), each: lookup, insert 0 if absent (BPF_NOEXIST) \
         and look up again, __sync_fetch_and_add(value, 1)"
    );
    println!(
        "  no drain: the map drained once, after the runs (the setup's check: 0 lost); \
         concurrent: another thread drains the map as fast as it can \
         (BPF_MAP_LOOKUP_AND_DELETE_BATCH through Drainer, 4096 a call) while the program runs, \
         then once more; lost = runs - the sum of what the drains returned; \
         median of {LOSS_ROUNDS} rounds"
    );
    println!(
        "  the swapped pair: the collector flips `active`, waits with {}, \
         then drains the map no longer written",
        grace.describe()
    );
    match cpus {
        Some((program, collector)) => {
            println!("  the program runs on CPU {program}, the collector on CPU {collector}")
        }
        None => println!("  one CPU: the program and the collector share it"),
    }
    let collector_cpu = cpus.map(|(_, c)| c);
    loss_header();
    for v in &VARIANTS {
        let o = counters.measure(v, runs, false, grace, collector_cpu);
        loss_row(&format!("{}, no drain", v.label), &o, "");
        if o.lost() != 0 {
            println!(
                "  SETUP BROKEN: {} increments lost with no concurrent drain: the program does not count every run",
                o.lost()
            );
        }
        let mut rounds: Vec<Outcome> = (0..LOSS_ROUNDS)
            .map(|_| counters.measure(v, runs, true, grace, collector_cpu))
            .collect();
        rounds.sort_by_key(|o| o.lost() * 1_000_000 / o.runs as i64);
        let pct = |o: &Outcome| 100.0 * o.lost() as f64 / o.runs as f64;
        let range = format!(
            "{:.3}-{:.3}",
            pct(&rounds[0]),
            pct(&rounds[LOSS_ROUNDS - 1])
        );
        loss_row(
            &format!("{}, concurrent", v.label),
            &rounds[LOSS_ROUNDS / 2],
            &range,
        );
    }
    println!(
        "  vanished: runs that found their key gone between their insert and their second \
         lookup (among the lost)"
    );
    set_affinity(&saved);
}

fn main() {
    let args: Vec<String> = std::env::args()
        .skip(1)
        .filter(|a| !a.starts_with('-'))
        .collect();
    let mut sections: Vec<&str> = args
        .iter()
        .map(|a| {
            SECTIONS
                .iter()
                .copied()
                .find(|s| s == a)
                .unwrap_or_else(|| panic!("unknown part {a:?}: one of {SECTIONS:?}"))
        })
        .collect();
    if sections.is_empty() {
        sections = SECTIONS.to_vec();
    }
    let build = tempfile::tempdir().unwrap();
    let object = bpfmap_tests::compile_bpf_object("drain_counter.bpf.c", build.path());
    println!(
        "{} CPUs; kernel {}",
        bpfmap_kernel::possible_cpus(),
        std::fs::read_to_string("/proc/sys/kernel/osrelease")
            .unwrap_or_default()
            .trim()
    );
    if sections.contains(&"throughput") {
        let rt = tokio::runtime::Runtime::new().unwrap();
        throughput(&object, &rt);
    }
    if sections.contains(&"loss") {
        loss(&object);
    }
}
