//! DrainMap against real kernel maps: every entry delivered once and the
//! map left empty; unacknowledged chunks delivered again (a client that
//! went away, a cut connection, a daemon killed with SIGKILL), acknowledged
//! ones never; a writer inserting during repeated drains; the spool's bound,
//! its corruption refused, one drainer per map, a map replaced; the policy
//! (`drain` is never implied nor open) and the configuration's globs.

use std::{
    collections::{BTreeMap, BTreeSet},
    path::Path,
    time::Duration,
};

use bpfmap_proto::v1 as pb;
use bpfmap_tests::{
    process::{DaemonProcess, free_addr},
    *,
};
use tonic::Code;

const RULES: &str = r#"
[drain]
maps = ["flows/*"]

[[rule]]
identities = ["anonymous"]
maps = ["**"]
operations = ["list", "dump", "drain"]
"#;

fn config(fs: &BpfFs, state: &Path) -> bpfmapd::Config {
    config_of(fs, state, RULES)
}

/// The test configuration (a free port, the private bpffs, `state`) with
/// the tables of `toml`.
fn config_of(fs: &BpfFs, state: &Path, toml: &str) -> bpfmapd::Config {
    let base = Daemon::config(fs.path(), state);
    bpfmapd::Config {
        listen: base.listen,
        roots: base.roots,
        state_dir: base.state_dir,
        mount_bpffs: false,
        ..toml_config(toml)
    }
}

fn toml_config(text: &str) -> bpfmapd::Config {
    bpfmapd::Config::from_toml(text).expect("a valid configuration")
}

fn request(path: &str, ack: &str, chunk_size: u32) -> pb::DrainMapRequest {
    pb::DrainMapRequest {
        map: map_ref(path),
        ack: ack.into(),
        chunk_size,
        raw: true,
        ..Default::default()
    }
}

/// One chunk as received.
#[derive(Debug, Clone)]
struct Got {
    keys: Vec<u64>,
    cursor: String,
    sequence: u64,
    redelivered: bool,
}

/// Reads a drain call: its chunks (at most `take`, then the stream is
/// dropped, as by a client that dies), and its summary or error.
async fn drain(
    c: &mut Grpc,
    req: pb::DrainMapRequest,
    take: usize,
) -> (Vec<Got>, Result<Option<pb::DrainSummary>, tonic::Status>) {
    let mut stream = match c.drain_map(req).await {
        Ok(r) => r.into_inner(),
        Err(s) => return (Vec::new(), Err(s)),
    };
    let mut got = Vec::new();
    loop {
        if got.len() >= take {
            return (got, Ok(None));
        }
        match stream.message().await {
            Ok(Some(m)) if m.done => return (got, Ok(m.summary)),
            Ok(Some(m)) => got.push(Got {
                keys: m
                    .entries
                    .iter()
                    .map(|e| u64::from_le_bytes(e.key[..8].try_into().unwrap()))
                    .collect(),
                cursor: m.cursor,
                sequence: m.sequence,
                redelivered: m.redelivered,
            }),
            Ok(None) => return (got, Err(tonic::Status::unavailable("ended early"))),
            Err(s) => return (got, Err(s)),
        }
    }
}

/// A client that remembers its last durable chunk: drains until the map is
/// empty, acknowledging as it goes, dropping chunks it already has.
struct Collector {
    ack: String,
    acked: u64,
    keys: Vec<u64>,
}

impl Collector {
    fn new() -> Self {
        Self {
            ack: String::new(),
            acked: 0,
            keys: Vec::new(),
        }
    }

    fn keep(&mut self, got: &[Got]) {
        for g in got {
            if g.sequence <= self.acked {
                continue;
            }
            self.keys.extend(&g.keys);
            self.ack.clone_from(&g.cursor);
            self.acked = g.sequence;
        }
    }

    /// One call to its end; its summary.
    async fn call(&mut self, c: &mut Grpc, path: &str) -> pb::DrainSummary {
        let (got, end) = drain(c, request(path, &self.ack, 256), usize::MAX).await;
        self.keep(&got);
        end.expect("the drain succeeds").expect("a summary")
    }
}

fn exactly_once(keys: &[u64], want: impl IntoIterator<Item = u64>) {
    let mut counts: BTreeMap<u64, usize> = BTreeMap::new();
    for k in keys {
        *counts.entry(*k).or_default() += 1;
    }
    let twice: Vec<_> = counts.iter().filter(|(_, n)| **n > 1).collect();
    assert!(twice.is_empty(), "delivered more than once: {twice:?}");
    let want: BTreeSet<u64> = want.into_iter().collect();
    let got: BTreeSet<u64> = counts.keys().copied().collect();
    let missing: Vec<_> = want.difference(&got).take(10).collect();
    let extra: Vec<_> = got.difference(&want).take(10).collect();
    assert!(
        missing.is_empty() && extra.is_empty(),
        "missing {missing:?}, extra {extra:?}"
    );
}

async fn dumped(addr: &str, path: &str) -> usize {
    let client = bpfmap_client::Client::connect(addr, Default::default())
        .await
        .unwrap();
    dump_all(&client, path, Default::default()).await.len()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_drain_delivers_every_entry_once_and_empties_the_map() {
    let fs = BpfFs::new();
    let state = tempfile::tempdir().unwrap();
    let (_map, _) = u64_hash(&fs, "flows/a", 10_000, 16_384);
    let daemon = Daemon::start_with(config(&fs, state.path())).await;
    let mut c = grpc(&daemon.addr()).await;
    let mut col = Collector::new();
    let s = col.call(&mut c, "flows/a").await;
    assert!(s.complete, "{s:?}");
    assert_eq!((s.drained, s.redelivered, s.spooled), (10_000, 0, 10_000));
    exactly_once(&col.keys, 0..10_000);
    assert_eq!(dumped(&daemon.addr(), "flows/a").await, 0);
    // The next call acknowledges everything: the spool empties.
    let s = col.call(&mut c, "flows/a").await;
    assert_eq!(
        (s.drained, s.acknowledged, s.spooled),
        (0, 10_000, 0),
        "{s:?}"
    );
    assert!(s.complete);
    daemon.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unacknowledged_chunks_come_again_with_their_cursors_and_acknowledged_ones_never() {
    let fs = BpfFs::new();
    let state = tempfile::tempdir().unwrap();
    let (_map, _) = u64_hash(&fs, "flows/a", 5_000, 8_192);
    let daemon = Daemon::start_with(config(&fs, state.path())).await;
    let mut c = grpc(&daemon.addr()).await;
    // A client that dies after three chunks, having made two durable.
    let (first, _) = drain(&mut c, request("flows/a", "", 256), 3).await;
    assert_eq!(first.len(), 3);
    assert!(first.iter().all(|g| !g.redelivered));
    let seqs: Vec<u64> = first.iter().map(|g| g.sequence).collect();
    assert_eq!(seqs, [seqs[0], seqs[0] + 1, seqs[0] + 2]);
    // The call has ended (its drained chunks are spooled); the next one
    // acknowledges the second chunk.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let (again, end) = drain(
        &mut c,
        request("flows/a", &first[1].cursor, 256),
        usize::MAX,
    )
    .await;
    let summary = end.unwrap().unwrap();
    // The third chunk comes again, first, as it was.
    assert!(again[0].redelivered);
    assert_eq!(again[0].sequence, first[2].sequence);
    assert_eq!(again[0].cursor, first[2].cursor);
    assert_eq!(again[0].keys, first[2].keys);
    assert!(
        again
            .iter()
            .all(|g| g.sequence != first[0].sequence && g.sequence != first[1].sequence)
    );
    let mut keys: Vec<u64> = first[..2].iter().flat_map(|g| g.keys.clone()).collect();
    keys.extend(again.iter().flat_map(|g| g.keys.clone()));
    exactly_once(&keys, 0..5_000);
    assert_eq!(
        summary.acknowledged as usize,
        first[0].keys.len() + first[1].keys.len()
    );
    // A dump's cursor is no acknowledgement.
    let client = bpfmap_client::Client::connect(&daemon.addr(), Default::default())
        .await
        .unwrap();
    let (_map2, _) = u64_hash(&fs, "other", 10, 16);
    let mut d = client.dump(&"flows/a".parse().unwrap(), Default::default());
    while d.next_chunk().await.unwrap().is_some() {}
    let (_, end) = drain(&mut c, request("flows/a", d.cursor(), 0), usize::MAX).await;
    assert_eq!(end.unwrap_err().code(), Code::InvalidArgument);
    daemon.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keys_inserted_during_repeated_drains_are_each_delivered_once() {
    let fs = BpfFs::new();
    let state = tempfile::tempdir().unwrap();
    let map = create_map(bpfmap_kernel::MapType::HASH, 8, 8, 65_536);
    fs.pin(&map, "flows/live");
    let daemon = Daemon::start_with(config(&fs, state.path())).await;
    let mut c = grpc(&daemon.addr()).await;
    const N: u64 = 60_000;
    let writer = std::thread::spawn(move || {
        for start in (0..N).step_by(500) {
            let (mut keys, mut values) = (Vec::new(), Vec::new());
            for k in start..start + 500 {
                keys.extend_from_slice(&k.to_le_bytes());
                values.extend_from_slice(&(k * 3).to_le_bytes());
            }
            update_batch(&map, &keys, &values);
            std::thread::sleep(Duration::from_millis(2));
        }
        map
    });
    let mut col = Collector::new();
    let mut calls = 0;
    while !writer.is_finished() {
        col.call(&mut c, "flows/live").await;
        calls += 1;
    }
    let _map = writer.join().unwrap();
    let s = col.call(&mut c, "flows/live").await;
    assert!(s.complete);
    exactly_once(&col.keys, 0..N);
    assert!(
        calls > 1,
        "the drains ran during the writes ({calls} calls)"
    );
    daemon.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_daemon_killed_mid_drain_loses_nothing_and_a_corrupt_spool_is_refused() {
    let fs = BpfFs::new();
    let state = tempfile::tempdir().unwrap();
    let (_map, _) = u64_hash(&fs, "flows/a", 20_000, 32_768);
    let mut daemon = DaemonProcess::start(
        daemon_bin!(),
        fs.path(),
        state.path(),
        free_addr("127.0.0.1"),
        RULES,
    );
    let mut c = grpc(&daemon.url()).await;
    let mut col = Collector::new();
    // Five chunks received and made durable, then the daemon dies (once it
    // waits for its client: a kill while it writes a chunk to the spool
    // loses that chunk, as documented).
    let (got, _) = drain(&mut c, request("flows/a", "", 512), 5).await;
    col.keep(&got);
    settled(state.path()).await;
    daemon.kill9();
    daemon.restart();
    let mut c = grpc(&daemon.url()).await;
    let s = col.call(&mut c, "flows/a").await;
    assert!(s.complete);
    assert!(s.redelivered > 0, "{s:?}");
    exactly_once(&col.keys, 0..20_000);

    // A spool file damaged while the daemon was down is refused by name.
    let (_map2, _) = u64_hash(&fs, "flows/b", 3_000, 4_096);
    let (got, _) = drain(&mut c, request("flows/b", "", 512), 2).await;
    assert_eq!(got.len(), 2);
    settled(state.path()).await;
    daemon.kill9();
    let spooled: Vec<_> = walk(&state.path().join("spool"))
        .into_iter()
        .filter(|p| p.extension().is_some_and(|e| e == "chunk"))
        .collect();
    assert!(!spooled.is_empty());
    let victim = spooled.iter().max().unwrap().clone();
    let bytes = std::fs::read(&victim).unwrap();
    std::fs::write(&victim, &bytes[..bytes.len() / 2]).unwrap();
    daemon.restart();
    let mut c = grpc(&daemon.url()).await;
    let (_, end) = drain(&mut c, request("flows/b", "", 512), usize::MAX).await;
    let e = end.unwrap_err();
    assert_eq!(e.code(), Code::DataLoss, "{e:?}");
    assert!(
        e.message()
            .contains(victim.file_name().unwrap().to_str().unwrap()),
        "{e:?}"
    );
}

/// Waits until the spool under `state` stops changing: no chunk being
/// written, the same chunks for 300 ms (the daemon waits for its client).
async fn settled(state: &Path) {
    settle(state, false).await
}

/// The same, an empty spool included (every chunk acknowledged).
async fn quiet(state: &Path) {
    settle(state, true).await
}

async fn settle(state: &Path, empty_ok: bool) {
    let spool = state.join("spool");
    let mut last = None;
    for _ in 0..100 {
        let mut now = if spool.exists() {
            walk(&spool)
        } else {
            Vec::new()
        };
        now.sort();
        let writing = now
            .iter()
            .any(|p| p.extension().is_some_and(|e| e == "tmp"));
        if !writing && (empty_ok || !now.is_empty()) && last.as_ref() == Some(&now) {
            return;
        }
        last = Some(now);
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    panic!("the spool under {} never settled", state.display());
}

fn walk(dir: &Path) -> Vec<std::path::PathBuf> {
    let mut out = Vec::new();
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        if p.is_dir() {
            out.extend(walk(&p));
        } else {
            out.push(p);
        }
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_spool_pauses_one_drainer_at_a_time_and_a_replaced_map_aborts() {
    let fs = BpfFs::new();
    let state = tempfile::tempdir().unwrap();
    let (_map, _) = u64_hash(&fs, "flows/a", 10_000, 16_384);
    let mut cfg = config(&fs, state.path());
    cfg.limits.max_drain_spool_bytes = 64 << 10;
    let daemon = Daemon::start_with(cfg).await;
    let mut c = grpc(&daemon.addr()).await;
    let mut col = Collector::new();
    let s = col.call(&mut c, "flows/a").await;
    assert!(!s.complete);
    assert!(s.paused.contains("limits.max_drain_spool_bytes"), "{s:?}");
    assert!(s.drained > 0 && s.drained < 10_000, "{s:?}");
    // Nothing lost: what was not drained is still in the map.
    assert_eq!(
        dumped(&daemon.addr(), "flows/a").await as u64,
        10_000 - s.drained
    );
    let mut calls = 1;
    while !col.call(&mut c, "flows/a").await.complete {
        calls += 1;
        assert!(calls < 100);
    }
    exactly_once(&col.keys, 0..10_000);
    daemon.stop().await;

    // One drainer at a time: a call that holds the map (its client does
    // not read) makes the next wait, then ABORTED.
    let state = tempfile::tempdir().unwrap();
    let daemon = Daemon::start_with(config(&fs, state.path())).await;
    let mut c = grpc(&daemon.addr()).await;
    // 300,000 entries: more than the client's flow-control windows hold,
    // so the call cannot end before its client reads.
    let (_held, _) = u64_hash(&fs, "flows/b", 300_000, 524_288);
    let mut slow = c
        .drain_map(request("flows/b", "", 4096))
        .await
        .unwrap()
        .into_inner();
    let _ = slow.message().await.unwrap();
    let mut other = grpc(&daemon.addr()).await;
    let (_, end) = drain(&mut other, request("flows/b", "", 16), usize::MAX).await;
    let e = end.unwrap_err();
    assert_eq!(e.code(), Code::Aborted, "{e:?}");
    assert!(e.message().contains("one drain per map"), "{e:?}");
    drop(slow);
    tokio::time::sleep(Duration::from_millis(500)).await;

    // A map replaced while its spool holds chunks: the spool is delivered,
    // then ABORTED.
    let (map_c, _) = u64_hash(&fs, "flows/c", 2_000, 4_096);
    let (got, _) = drain(&mut c, request("flows/c", "", 256), 2).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    drop(map_c);
    std::fs::remove_file(fs.path().join("flows/c")).unwrap();
    let (_new, _) = u64_hash(&fs, "flows/c", 10, 16);
    let (again, end) = drain(&mut c, request("flows/c", &got[0].cursor, 256), usize::MAX).await;
    let e = end.unwrap_err();
    assert_eq!(e.code(), Code::Aborted, "{e:?}");
    assert!(e.message().contains("replaced"), "{e:?}");
    assert!(!again.is_empty() && again.iter().all(|g| g.redelivered));
    assert_eq!(again[0].sequence, got[1].sequence);
    daemon.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn drain_is_its_own_operation_on_configured_maps_only() {
    let fs = BpfFs::new();
    let state = tempfile::tempdir().unwrap();
    let (_a, _) = u64_hash(&fs, "flows/a", 100, 128);
    let (_o, _) = u64_hash(&fs, "other", 100, 128);
    let arr = create_map(bpfmap_kernel::MapType::ARRAY, 4, 8, 16);
    fs.pin(&arr, "flows/array");

    // Plaintext without rules: everything is allowed but drain.
    let mut open = Daemon::config(fs.path(), state.path());
    open.drain.maps = vec!["flows/*".into()];
    let daemon = Daemon::start_with(open).await;
    let mut c = grpc(&daemon.addr()).await;
    let (_, end) = drain(&mut c, request("flows/a", "", 0), usize::MAX).await;
    let e = end.unwrap_err();
    assert_eq!(e.code(), Code::PermissionDenied, "{e:?}");
    assert!(e.message().contains("may not drain flows/a"), "{e:?}");
    daemon.stop().await;

    // `dump` does not imply `drain`.
    let daemon = Daemon::start_with(config_of(
        &fs,
        state.path(),
        "[drain]\nmaps = [\"flows/*\"]\n[[rule]]\nidentities = [\"anonymous\"]\nmaps = [\"**\"]\noperations = [\"list\", \"dump\"]\n",
    ))
    .await;
    let mut c = grpc(&daemon.addr()).await;
    let (_, end) = drain(&mut c, request("flows/a", "", 0), usize::MAX).await;
    assert_eq!(end.unwrap_err().code(), Code::PermissionDenied);
    daemon.stop().await;

    // Allowed to drain: only the configured maps, of a drainable type.
    let daemon = Daemon::start_with(config(&fs, state.path())).await;
    let mut c = grpc(&daemon.addr()).await;
    let (_, end) = drain(&mut c, request("other", "", 0), usize::MAX).await;
    let e = end.unwrap_err();
    assert_eq!(e.code(), Code::FailedPrecondition, "{e:?}");
    assert!(
        e.message().contains("not drainable") && e.message().contains("read-only"),
        "{e:?}"
    );
    let (_, end) = drain(&mut c, request("flows/array", "", 0), usize::MAX).await;
    let e = end.unwrap_err();
    assert_eq!(e.code(), Code::FailedPrecondition, "{e:?}");
    assert!(e.message().contains("array"), "{e:?}");
    // The map that may not be drained is whole.
    assert_eq!(dumped(&daemon.addr(), "other").await, 100);
    daemon.stop().await;
}

/// The keys in `bpfmapctl drain`'s output (untyped u64 keys, in hex).
fn output_keys(path: &Path) -> Vec<u64> {
    let text = std::fs::read_to_string(path).unwrap();
    text.lines()
        .map(|l| {
            let v: serde_json::Value =
                serde_json::from_str(l).unwrap_or_else(|e| panic!("a broken line {l:?}: {e}"));
            let hex = v["key"].as_str().unwrap_or_else(|| panic!("no key in {l}"));
            let bytes = faster_hex_decode(hex);
            u64::from_le_bytes(bytes[..8].try_into().unwrap())
        })
        .collect()
}

fn faster_hex_decode(hex: &str) -> Vec<u8> {
    (0..hex.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&hex[i..i + 2], 16).unwrap())
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_drain_pipeline_killed_at_random_points_delivers_every_entry_exactly_once() {
    let fs = BpfFs::new();
    let state = tempfile::tempdir().unwrap();
    let work = tempfile::tempdir().unwrap();
    let map = create_map(bpfmap_kernel::MapType::HASH, 8, 8, 65_536);
    fs.pin(&map, "flows/live");
    let mut daemon = DaemonProcess::start(
        daemon_bin!(),
        fs.path(),
        state.path(),
        free_addr("127.0.0.1"),
        RULES,
    );
    const N: u64 = 40_000;
    let writer = std::thread::spawn(move || {
        for start in (0..N).step_by(100) {
            let (mut keys, mut values) = (Vec::new(), Vec::new());
            for k in start..start + 100 {
                keys.extend_from_slice(&k.to_le_bytes());
                values.extend_from_slice(&k.to_le_bytes());
            }
            update_batch(&map, &keys, &values);
            std::thread::sleep(Duration::from_millis(8));
        }
        map
    });
    let out = work.path().join("flows.jsonl");
    let ack = work.path().join("ack.json");
    let ctl = |interval: bool, addr: &str| {
        let file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&out)
            .unwrap();
        let mut c = std::process::Command::new(ctl_bin!());
        c.args(["--target", addr, "drain", "flows/live", "--ack-file"])
            .arg(&ack)
            .stdout(file)
            .stderr(std::process::Stdio::null());
        if interval {
            c.args(["--interval", "50ms"]);
        }
        c.spawn().unwrap()
    };
    let mut rng = Rng::from_env("DRAIN_SEED");
    let (mut ctl_kills, mut daemon_kills) = (0, 0);
    while !writer.is_finished() {
        let addr = daemon.addr.to_string();
        let mut child = ctl(true, &addr);
        tokio::time::sleep(Duration::from_millis(50 + rng.below(400))).await;
        if rng.below(4) == 0 {
            // bpfmapctl dies mid-drain, then the daemon, its spool holding
            // what was not acknowledged, and it comes back. (Killed while
            // it writes a chunk to the spool, between the kernel's delete
            // and the file, it would lose that chunk, as documented: it
            // is killed once its spool has settled.)
            let _ = child.kill();
            let _ = child.wait();
            quiet(state.path()).await;
            daemon.kill9();
            daemon_kills += 1;
            daemon.restart();
        } else {
            let _ = child.kill();
            let _ = child.wait();
            ctl_kills += 1;
        }
    }
    let _map = writer.join().unwrap();
    // Once more, to the end, acknowledging everything.
    for _ in 0..2 {
        let status = ctl(false, &daemon.addr.to_string()).wait().unwrap();
        assert!(status.success(), "the last drain failed: {status}");
    }
    eprintln!("{ctl_kills} bpfmapctl kills, {daemon_kills} daemon kills");
    assert!(
        ctl_kills + daemon_kills >= 5,
        "too few kills to mean anything"
    );
    exactly_once(&output_keys(&out), 0..N);
    assert_eq!(dumped(&daemon.url(), "flows/live").await, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_library_drains_through_connections_cut_again_and_again() {
    let fs = BpfFs::new();
    let state = tempfile::tempdir().unwrap();
    let (_map, _) = u64_hash(&fs, "flows/a", 30_000, 32_768);
    let daemon = Daemon::start_with(config(&fs, state.path())).await;
    // Every connection is cut after 40 KB from the server.
    let proxy = CutProxy::start_on(
        "127.0.0.1:0".parse().unwrap(),
        daemon.running.local_addr(),
        40_000,
        true,
    )
    .await;
    let options = bpfmap_client::ConnectOptions::default().with_retry(
        bpfmap_client::RetryPolicy::default()
            .with_max_attempts(1000)
            .with_min_delay(Duration::from_millis(5))
            .with_max_delay(Duration::from_millis(20)),
    );
    let client = bpfmap_client::Client::connect(&format!("http://{}", proxy.addr), options)
        .await
        .unwrap();
    let map: bpfmap_client::MapName = "flows/a".parse().unwrap();
    let mut drain = client.drain(
        &map,
        bpfmap_client::DrainOptions::default()
            .with_chunk_size(500)
            .with_raw(true),
    );
    let mut keys = Vec::new();
    while let Some(chunk) = drain.next_chunk().await.expect("the drain goes on") {
        for e in chunk.chunk().iter() {
            keys.push(u64::from_le_bytes(e.key[..8].try_into().unwrap()));
        }
        // Durable as soon as received, here.
        drain.ack(chunk.cursor(), chunk.sequence());
    }
    assert!(drain.resumes() >= 3, "{} resumes", drain.resumes());
    assert!(proxy.connections() >= 4);
    exactly_once(&keys, 0..30_000);
    assert_eq!(dumped(&daemon.addr(), "flows/a").await, 0);
    daemon.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grpcurl_drains_the_demo_and_acknowledges() {
    let fs = BpfFs::new();
    let state = tempfile::tempdir().unwrap();
    let _demo = bpfmapd::Demo::start_live(fs.path()).expect("the demo starts");
    let cfg = config_of(
        &fs,
        state.path(),
        "[drain]\nmaps = [\"demo/drainable\"]\n[[rule]]\nidentities = [\"anonymous\"]\nmaps = [\"**\"]\noperations = [\"list\", \"dump\", \"drain\"]\n",
    );
    let daemon = Daemon::start_with(cfg).await;
    let host = daemon.running.local_addr().to_string();
    tokio::time::sleep(Duration::from_millis(500)).await;
    let call = |body: String| {
        let host = host.clone();
        async move {
            let (ok, out, err) = grpcurl(
                &["-plaintext", "-d", &body],
                &host,
                &["bpfmap.v1.MapService/DrainMap"],
            )
            .await;
            assert!(ok, "{err}");
            json_stream(&out)
        }
    };
    let first = call(r#"{"map":{"path":"demo/drainable"}}"#.into()).await;
    let chunks: Vec<&serde_json::Value> =
        first.iter().filter(|m| m.get("cursor").is_some()).collect();
    assert!(!chunks.is_empty(), "{first:?}");
    let entries: usize = chunks
        .iter()
        .map(|m| m["entries"].as_array().unwrap().len())
        .sum();
    let e = &chunks[0]["entries"][0];
    assert!(e["decodedKey"]["saddr"].is_number(), "{e}");
    assert!(e["decodedValue"]["bytes"].is_string(), "{e}");
    let summary = &first.last().unwrap()["summary"];
    assert_eq!(
        summary["drained"],
        serde_json::json!(entries.to_string()),
        "{summary}"
    );
    assert_eq!(summary["complete"], serde_json::json!(true));
    let last = chunks.last().unwrap()["cursor"].as_str().unwrap();
    let second = call(format!(
        r#"{{"map":{{"path":"demo/drainable"}},"ack":"{last}"}}"#
    ))
    .await;
    let summary = &second.last().unwrap()["summary"];
    assert_eq!(
        summary["acknowledged"],
        serde_json::json!(entries.to_string()),
        "{summary}"
    );
    assert!(summary.get("redelivered").is_none(), "{summary}");
    assert!(second.iter().all(|m| m.get("redelivered").is_none()));
    daemon.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_spool_is_delivered_only_to_the_identity_that_drained_it() {
    use bpfmap_tests::pki::{Name, Pki, Validity};
    let fs = BpfFs::new();
    let state = tempfile::tempdir().unwrap();
    let (_map, _) = u64_hash(&fs, "flows/a", 5_000, 8_192);
    let pki = Pki::new();
    let mut cfg = config_of(
        &fs,
        state.path(),
        "[drain]\nmaps = [\"flows/*\"]\n[[rule]]\nidentities = [\"spiffe://example.org/ops/*\"]\nmaps = [\"**\"]\noperations = [\"list\", \"dump\", \"drain\"]\n",
    );
    cfg.tls = Some(pki.server_files());
    let daemon = Daemon::start_with(cfg).await;
    let addr = daemon.tls_addr();
    let client = |stem: &str, who: &str| {
        let tls = pki.client(stem, Name::Spiffe(who), Validity::Now);
        let options = bpfmap_client::ConnectOptions::default()
            .with_tls(tls)
            .with_retry(bpfmap_client::RetryPolicy::never());
        bpfmap_client::Client::connect(&addr, options)
    };
    let alice = client("alice", "spiffe://example.org/ops/alice")
        .await
        .unwrap();
    let bob = client("bob", "spiffe://example.org/ops/bob").await.unwrap();
    let map: bpfmap_client::MapName = "flows/a".parse().unwrap();
    let options = bpfmap_client::DrainOptions::default()
        .with_chunk_size(500)
        .with_raw(true);
    // Alice drains two chunks and goes away without acknowledging.
    let mut d = alice.drain(&map, options.clone());
    let mut first = Vec::new();
    for _ in 0..2 {
        let c = d.next_chunk().await.unwrap().unwrap();
        first.push(c.sequence());
    }
    drop(d);
    tokio::time::sleep(Duration::from_millis(300)).await;
    // Bob may drain, but not Alice's spool.
    let mut d = bob.drain(&map, options.clone());
    let e = d.next_chunk().await.unwrap_err();
    assert_eq!(code_of(&e), Code::FailedPrecondition, "{e}");
    assert!(e.to_string().contains("another identity"), "{e}");
    // Alice gets her chunks again, then the rest.
    let mut d = alice.drain(&map, options);
    let c = d.next_chunk().await.unwrap().unwrap();
    assert!(c.redelivered());
    assert_eq!(c.sequence(), first[0]);
    daemon.stop().await;
}
