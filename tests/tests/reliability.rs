//! The promise at the edges, tried as an adversarial user would: memory that
//! hostile clients make the daemon spend, connections that never speak,
//! slow clients that hold the dump slots, SIGTERM with stuck clients, maps
//! churning under a dump, and bpfmapctl cut off by a failing daemon.
//!
//! Where only a process shows it (resident memory, exit time, kill -9, what
//! is left on stdout), the daemon and bpfmapctl run as processes of their
//! own. Figures are printed (`cargo test -- --nocapture` shows them); the
//! assertions are bounds with a wide margin, not timings to the millisecond.

use std::{
    collections::BTreeSet,
    io::Read as _,
    net::TcpStream,
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    time::{Duration, Instant},
};

use bpfmap_client::{ConnectOptions, DumpOptions, Entry, LookupOptions, RetryPolicy, ValueRef, pb};
use bpfmap_kernel::{MapHandle, MapOps as _, walk::trie_order};
use bpfmap_tests::{
    process::{DaemonProcess, free_addr},
    *,
};
use bpfmapd::{Config, Limits};
use futures::TryStreamExt as _;
use tonic::Code;

const MIB: u64 = 1024;

/// An array of `n` values of `value_size` bytes (value i filled with i).
fn big_array(fs: &BpfFs, rel: &str, n: u32, value_size: u32) -> OwnedMap {
    let map = create_map(MapType::ARRAY, 4, value_size, n);
    for i in 0..n {
        update(&map, &i.to_le_bytes(), &vec![i as u8; value_size as usize]);
    }
    fs.pin(&map, rel);
    map
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hostile_lookups_and_slow_streams_stay_within_the_memory_budget() {
    let fs = BpfFs::new();
    let state = tempfile::tempdir().unwrap();
    // 512 values of 64 KiB: a chunk holds one (a dump's share is 576 KiB).
    let _big = big_array(&fs, "big", 512, 64 << 10);
    let daemon = DaemonProcess::local(daemon_bin!(), fs.path(), state.path());
    tokio::time::sleep(Duration::from_millis(300)).await;
    let (base, _) = daemon.rss_kib();

    // Four Lookups at once, each 4096 copies of one key: 268 MB of values.
    let mut calls = Vec::new();
    for _ in 0..4 {
        let channel = channel_from(&daemon.url(), "127.0.0.1").await;
        calls.push(tokio::spawn(async move {
            let mut raw = pb::map_service_client::MapServiceClient::new(channel);
            raw.lookup(pb::LookupRequest {
                map: map_ref("big"),
                keys: vec![0u32.to_le_bytes().to_vec(); 4096],
                ..Default::default()
            })
            .await
        }));
    }
    for c in calls {
        let e = c.await.unwrap().unwrap_err();
        assert_eq!(e.code(), Code::InvalidArgument, "{e:?}");
        assert!(e.message().contains("at most 47 keys"), "{}", e.message());
    }
    // 48 Lookups at once that are allowed: 47 keys each, responses of 3 MiB.
    // They share the pool (12 MiB) and 16 lookup slots: the others wait or
    // are told to retry.
    let mut calls = Vec::new();
    for i in 0..48u32 {
        let channel = channel_from(&daemon.url(), "127.0.0.1").await;
        calls.push(tokio::spawn(async move {
            let mut raw = pb::map_service_client::MapServiceClient::new(channel);
            raw.lookup(pb::LookupRequest {
                map: map_ref("big"),
                keys: (0..47u32)
                    .map(|k| ((k + i) % 512).to_le_bytes().to_vec())
                    .collect(),
                ..Default::default()
            })
            .await
        }));
    }
    let (mut served, mut busy) = (0, 0);
    for c in calls {
        match c.await.unwrap() {
            Ok(r) => {
                let r = r.into_inner();
                assert_eq!(r.results.len(), 47);
                assert!(
                    r.results
                        .iter()
                        .all(|x| x.found && x.value.len() == 64 << 10)
                );
                served += 1;
            }
            Err(e) => {
                assert_eq!(e.code(), Code::ResourceExhausted, "{e:?}");
                busy += 1;
            }
        }
    }
    eprintln!("48 Lookups of 3 MiB at once: {served} served, {busy} told to retry");
    assert!(served >= 16, "{served} served");
    let (after_lookups, peak_lookups) = daemon.rss_kib();

    // 64 streams (the default max_dumps) from 8 addresses (8 per address,
    // the per-caller limit), each reading one chunk and then nothing. Each
    // has a connection of its own: streams that are not read would fill a
    // shared connection's flow-control window and block each other.
    let mut streams = Vec::new();
    for host in 2..10 {
        for _ in 0..8 {
            let channel = channel_from(&daemon.url(), &format!("127.0.0.{host}")).await;
            let mut raw = pb::map_service_client::MapServiceClient::new(channel);
            let mut s = raw
                .dump_map(pb::DumpMapRequest {
                    map: map_ref("big"),
                    layout: pb::Layout::Packed as i32,
                    ..Default::default()
                })
                .await
                .unwrap()
                .into_inner();
            assert!(s.message().await.unwrap().is_some());
            streams.push(s);
        }
    }
    let mut peak_streams = 0;
    for _ in 0..20 {
        tokio::time::sleep(Duration::from_millis(150)).await;
        peak_streams = peak_streams.max(daemon.rss_kib().0);
    }
    let (_, hwm) = daemon.rss_kib();
    drop(streams);
    tokio::time::sleep(Duration::from_secs(2)).await;
    let (after_streams, _) = daemon.rss_kib();
    eprintln!(
        "daemon RSS: start {} MiB; after the Lookups: {} MiB (peak {} MiB); 64 slow streams of 64 KiB values: peak {} MiB (high-water {} MiB); 2 s after they left: {} MiB",
        base / MIB,
        after_lookups / MIB,
        peak_lookups / MIB,
        peak_streams / MIB,
        hwm / MIB,
        after_streams / MIB,
    );
    // The pool is 12 MiB; allow as much again for encoding and the transport.
    assert!(
        peak_lookups < base + 32 * MIB,
        "lookups grew the daemon by {} MiB",
        (peak_lookups - base) / MIB
    );
    // The dumps' shares are 36 MiB in all; allow as much again for the
    // transport's own buffers and the allocator.
    assert!(
        hwm < base + 96 * MIB,
        "64 slow streams grew the daemon by {} MiB",
        (hwm - base) / MIB
    );
    assert!(
        after_streams < base + 20 * MIB,
        "{} MiB were kept after the streams left",
        (after_streams.saturating_sub(base)) / MIB
    );

    // The audit log counts what each client was given, and says it left.
    let audits: Vec<serde_json::Value> = daemon
        .log()
        .iter()
        .filter_map(|l| serde_json::from_str(l).ok())
        .filter(|v: &serde_json::Value| v["fields"]["method"] == "DumpMap")
        .collect();
    assert_eq!(audits.len(), 64, "one audit record per dump");
    for a in &audits {
        let entries = a["fields"]["entries"].as_u64().unwrap();
        assert_eq!(a["fields"]["code"], "Cancelled", "{a}");
        assert!(
            entries < 512,
            "{entries} entries counted for a client that read one chunk"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn silent_connections_are_closed_and_new_clients_still_get_in() {
    let fs = BpfFs::new();
    let state = tempfile::tempdir().unwrap();
    let (_m, expected) = u64_hash(&fs, "m", 1000, 1024);
    let daemon = DaemonProcess::start(
        daemon_bin!(),
        fs.path(),
        state.path(),
        free_addr("127.0.0.1"),
        "[limits]\nhandshake_timeout = \"1s\"\nmax_connections = 100\n",
    );
    // 300 connections that never send a byte: 100 fill the limit, the rest
    // are closed at once.
    let silent: Vec<TcpStream> = (0..300)
        .map(|_| TcpStream::connect(daemon.addr).unwrap())
        .collect();
    tokio::time::sleep(Duration::from_millis(1800)).await;
    let mut closed = 0;
    for mut s in silent {
        // The server speaks first (its HTTP/2 settings); closed means EOF or
        // a reset after that. Still open: a read times out.
        s.set_read_timeout(Some(Duration::from_millis(500)))
            .unwrap();
        let mut buf = [0u8; 256];
        loop {
            match s.read(&mut buf) {
                Ok(0) => break closed += 1,
                Ok(_) => continue,
                Err(e)
                    if matches!(
                        e.kind(),
                        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                    ) =>
                {
                    break;
                }
                Err(_) => break closed += 1,
            }
        }
    }
    assert_eq!(closed, 300, "every silent connection is closed");
    // A new client is served.
    let client = daemon_client(&daemon).await;
    assert_eq!(
        dump_all(&client, "m", DumpOptions::default()).await,
        expected
    );

    let log = daemon.log();
    let limit_lines = log
        .iter()
        .filter(|l| l.contains("connection limit reached"))
        .count();
    eprintln!(
        "{} log lines in all; {limit_lines} say the connection limit was reached (200 connections refused)",
        log.len()
    );
    assert!(
        (1..=2).contains(&limit_lines),
        "connection-limit lines are rate-limited: {limit_lines}"
    );
}

async fn daemon_client(d: &DaemonProcess) -> bpfmap_client::Client {
    bpfmap_client::Client::connect(&d.url(), ConnectOptions::default())
        .await
        .expect("client connects")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_clients_cannot_keep_everyone_else_out() {
    let fs = BpfFs::new();
    let state = tempfile::tempdir().unwrap();
    // Larger than what the transport buffers for a stream, so that a slow
    // reader's producer keeps its slot.
    let (_m, expected) = u64_hash(&fs, "m", 300_000, 524_288);
    let daemon = Daemon::start_with(Config {
        limits: Limits {
            max_slot_hold: Duration::from_secs(2),
            ..Limits::default()
        },
        ..Daemon::config(fs.path(), state.path())
    })
    .await;
    let stats = daemon.running.stats().clone();
    // Eight slow readers from one address (its whole per-caller quota), each
    // taking a chunk every 50 ms: never stalled, but slow. Once the others
    // are served they read on at full speed to the end.
    let hurry = Arc::new(AtomicBool::new(false));
    let mut slow = Vec::new();
    for _ in 0..8 {
        let client = client_from(&daemon.addr(), "127.0.0.1", ConnectOptions::default()).await;
        let hurry = hurry.clone();
        slow.push(tokio::spawn(async move {
            let mut dump = client.dump(
                &"m".parse().unwrap(),
                DumpOptions::default().with_chunk_size(1000),
            );
            let mut got = Vec::new();
            while let Some(c) = dump.next_chunk().await.unwrap() {
                got.extend(c);
                if !hurry.load(Ordering::Relaxed) {
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            }
            (collect_unique(got), dump.resumes())
        }));
    }
    let t = Instant::now();
    while stats.active.load(Ordering::SeqCst) < 8 {
        assert!(
            t.elapsed() < Duration::from_secs(10),
            "the slow readers did not start"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    // Another address has slots of its own: served at the first try.
    let never = ConnectOptions::default().with_retry(RetryPolicy::never());
    let other = client_from(&daemon.addr(), "127.0.0.2", never).await;
    let t = Instant::now();
    assert_eq!(
        dump_all(&other, "m", DumpOptions::default()).await,
        expected
    );
    eprintln!("a client from another address dumped in {:?}", t.elapsed());
    assert_eq!(
        stats.active.load(Ordering::SeqCst),
        8,
        "the slow readers still hold their slots"
    );
    // The same address: refused at first, then served once a slow reader's
    // slot expires (the library retries RESOURCE_EXHAUSTED with backoff).
    let same = client_from(&daemon.addr(), "127.0.0.1", ConnectOptions::default()).await;
    let t = Instant::now();
    assert_eq!(dump_all(&same, "m", DumpOptions::default()).await, expected);
    let expired = stats.slots_expired.load(Ordering::SeqCst);
    eprintln!(
        "a client from the slow readers' address dumped in {:?}; {expired} slots had expired",
        t.elapsed()
    );
    assert!(expired >= 1);
    // The slow readers resumed after losing their slots, and each got every
    // entry exactly once.
    hurry.store(true, Ordering::Relaxed);
    let mut resumes = 0;
    for s in slow {
        let (got, r) = s.await.unwrap();
        assert_eq!(got, expected);
        resumes += r;
    }
    eprintln!("the slow readers resumed {resumes} times in all");
    assert!(
        resumes >= 1,
        "the slow readers resumed after their slots expired"
    );
    daemon.stop().await;
}

/// Eight callers on one address that open a dump each and stop reading
/// (the address's whole quota, their producers parked waiting for room):
/// a ninth local `bpfmapctl dump` of a small map still gets a slot, within
/// seconds, with the default limits and bpfmapctl's default retrying.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readers_that_stop_reading_give_their_slots_to_a_waiting_caller() {
    let fs = BpfFs::new();
    let state = tempfile::tempdir().unwrap();
    let (_big, _) = u64_hash(&fs, "big", 300_000, 524_288);
    let (_small, small) = u64_hash(&fs, "small", 100, 128);
    let daemon = Daemon::start(fs.path(), state.path()).await;
    let stats = daemon.running.stats().clone();
    let mut held = Vec::new();
    for _ in 0..8 {
        let client = client_from(&daemon.addr(), "127.0.0.1", ConnectOptions::default()).await;
        let mut dump = client.dump(&"big".parse().unwrap(), DumpOptions::default());
        dump.next_chunk().await.unwrap().expect("a first chunk");
        // Read no further.
        held.push((client, dump));
    }
    let t = Instant::now();
    while stats.active.load(Ordering::SeqCst) < 8 {
        assert!(
            t.elapsed() < Duration::from_secs(10),
            "the dumps did not start"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let t = Instant::now();
    let (result, out, err) = ctl(&["--target", &daemon.addr(), "dump", "small"]).await;
    let took = t.elapsed();
    eprintln!(
        "bpfmapctl dumped in {took:?} while 8 readers held the address's slots; stderr: {err}"
    );
    result.unwrap_or_else(|e| panic!("bpfmapctl failed after {took:?}: {e:#}\n{err}"));
    let keys: BTreeSet<Vec<u8>> = json_lines(&out)
        .iter()
        .map(|l| {
            let hex = l["key"]
                .as_str()
                .unwrap_or_else(|| panic!("a hex key: {l}"));
            faster_hex::hex_decode_vec(hex.as_bytes()).unwrap()
        })
        .collect();
    let expected: BTreeSet<Vec<u8>> = small.keys().cloned().collect();
    assert_eq!(keys, expected, "every entry of the small map once");
    assert!(
        took < Duration::from_secs(15),
        "a waiting caller gets a slot within seconds (limits.max_slot_hold is 5 s): {took:?}"
    );
    assert!(
        stats.slots_expired.load(Ordering::SeqCst) >= 1,
        "a parked reader's slot was reclaimed"
    );
    drop(held);
    daemon.stop().await;
}

#[tokio::test]
async fn idle_connections_are_closed_and_clients_reconnect() {
    let fs = BpfFs::new();
    let state = tempfile::tempdir().unwrap();
    let daemon = Daemon::start_with(Config {
        limits: Limits {
            idle_timeout: Duration::from_secs(1),
            ..Limits::default()
        },
        ..Daemon::config(fs.path(), state.path())
    })
    .await;
    let client = daemon.client().await;
    client.list_maps().await.unwrap();
    assert_eq!(daemon.running.open_connections(), 1);
    tokio::time::sleep(Duration::from_millis(2500)).await;
    assert_eq!(
        daemon.running.open_connections(),
        0,
        "the idle connection was closed"
    );
    client.list_maps().await.expect("the client reconnects");
    assert_eq!(daemon.running.open_connections(), 1);
    daemon.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_stops_the_daemon_quickly_whatever_its_clients_do() {
    let fs = BpfFs::new();
    let state = tempfile::tempdir().unwrap();
    let (_m, _) = u64_hash(&fs, "m", 200_000, 262_144);
    let mut daemon = DaemonProcess::local(daemon_bin!(), fs.path(), state.path());
    // A reader that stopped reading, an idle connection, a silent one.
    let channel = channel_from(&daemon.url(), "127.0.0.1").await;
    let mut raw = pb::map_service_client::MapServiceClient::new(channel);
    let mut stalled = raw
        .dump_map(pb::DumpMapRequest {
            map: map_ref("m"),
            chunk_size: 100,
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    assert!(stalled.message().await.unwrap().is_some());
    let idle = daemon_client(&daemon).await;
    idle.list_maps().await.unwrap();
    let _silent = TcpStream::connect(daemon.addr).unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await;

    daemon.signal(libc::SIGTERM);
    let (status, took) = daemon
        .wait_exit(Duration::from_secs(15))
        .expect("the daemon exits after SIGTERM");
    eprintln!("SIGTERM to exit: {took:?} ({status})");
    assert!(status.success(), "{status}");
    assert!(took < Duration::from_secs(5), "took {took:?}");
    // The stalled reader, when it reads again, gets what was queued and then
    // an error it can resume from; it is not left hanging.
    let end = tokio::time::timeout(Duration::from_secs(5), async {
        loop {
            match stalled.message().await {
                Ok(Some(_)) => continue,
                Ok(None) => return None,
                Err(s) => return Some(s.code()),
            }
        }
    })
    .await
    .expect("the stalled stream ends");
    assert!(
        matches!(
            end,
            Some(Code::Unavailable) | Some(Code::Unknown) | Some(Code::Internal)
        ),
        "{end:?}"
    );
}

/// lpm_trie key: prefix length (host order) and an IPv4 address.
fn trie_key(len: u32, addr: [u8; 4]) -> Vec<u8> {
    let mut k = len.to_ne_bytes().to_vec();
    k.extend_from_slice(&addr);
    k
}

fn new_trie(max_entries: u32) -> OwnedMap {
    create_map_with(&bpfmap_kernel::CreateMap {
        map_type: MapType::LPM_TRIE.0,
        key_size: 8,
        value_size: 8,
        max_entries,
        flags: 1, // BPF_F_NO_PREALLOC, required for tries
        name: "trie",
        ..Default::default()
    })
}

#[test]
fn the_kernel_walks_a_trie_in_the_order_the_daemon_expects() {
    let fs = BpfFs::new();
    let trie = new_trie(4096);
    // Prefixes of every length, nested and disjoint, in a scrambled order.
    let mut x: u32 = 0x9e37_79b9;
    let mut keys = BTreeSet::new();
    while keys.len() < 2000 {
        x ^= x << 13;
        x ^= x >> 17;
        x ^= x << 5;
        let len = x % 33;
        let addr = (x.rotate_left(7) & (u32::MAX.checked_shl(32 - len).unwrap_or(0))).to_be_bytes();
        keys.insert(trie_key(len, addr));
    }
    for k in &keys {
        update(&trie, k, &[1; 8]);
    }
    let path = fs.pin(&trie, "t");
    let handle = MapHandle::open_pinned(&path).unwrap();
    let mut walk = Vec::new();
    let mut next = vec![0u8; 8];
    let mut prev: Option<Vec<u8>> = None;
    while handle.get_next_key(prev.as_deref(), &mut next).is_ok() {
        walk.push(next.clone());
        prev = Some(next.clone());
    }
    assert_eq!(walk.len(), keys.len());
    for w in walk.windows(2) {
        assert_eq!(
            trie_order(&w[0], &w[1]),
            std::cmp::Ordering::Less,
            "{:?} then {:?}",
            w[0],
            w[1]
        );
    }
}

/// Deletes and re-inserts `keys` of `map` over and over.
fn churn(map: Arc<OwnedMap>, keys: Vec<Vec<u8>>) -> Churn {
    Churn::start(move || {
        for k in &keys {
            let _ = map.delete(k);
            let _ = map.update(k, &[7; 8]);
        }
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn trie_and_hash_dumps_under_a_churning_writer_deliver_stable_keys_exactly_once() {
    let (fs, _state, daemon, client) = setup().await;
    // A trie: 10,000 stable prefixes and 10,000 that churn, interleaved in
    // the walk (each churning /32 sits inside a stable /24).
    let trie = Arc::new(new_trie(30_000));
    let (mut stable, mut churning) = (Vec::new(), Vec::new());
    for i in 0..10_000u32 {
        let [a, b, c, _] = (i << 8).to_be_bytes();
        stable.push(trie_key(24, [a, b, c, 0]));
        churning.push(trie_key(32, [a, b, c, 1]));
    }
    for k in stable.iter().chain(&churning) {
        update(&trie, k, &[1; 8]);
    }
    fs.pin(&trie, "trie");
    // A hash map: 40,000 stable keys, 10,000 churning.
    let (hash, expected_hash) = u64_hash(&fs, "hash", 50_000, 65_536);
    let hash = Arc::new(hash);
    let hash_churn: Vec<Vec<u8>> = (0..10_000u64).map(|i| i.to_le_bytes().to_vec()).collect();

    let writers = [
        churn(trie.clone(), churning.clone()),
        churn(hash.clone(), hash_churn),
    ];
    let stable: BTreeSet<Vec<u8>> = stable.into_iter().collect();
    for (i, chunk) in [
        1, 7, 64, 1024, 1024, 1024, 1024, 5000, 0, 0, 1, 3, 256, 2048, 0, 0, 0, 0, 100, 10,
    ]
    .into_iter()
    .enumerate()
    {
        for map in ["trie", "hash"] {
            let entries: Vec<Entry> = client
                .dump(
                    &map.parse().unwrap(),
                    DumpOptions::default().with_chunk_size(chunk),
                )
                .into_entries()
                .try_collect()
                .await
                .unwrap_or_else(|e| panic!("dump {i} of {map} (chunk {chunk}): {e}"));
            // collect_unique fails on a key delivered twice.
            let got = collect_unique(entries);
            if map == "trie" {
                for k in &stable {
                    assert!(
                        got.contains_key(k),
                        "dump {i} (chunk {chunk}): stable prefix {k:?} missing"
                    );
                }
            } else {
                for (k, v) in expected_hash.range(10_000u64.to_le_bytes().to_vec()..) {
                    if u64::from_le_bytes(k.as_slice().try_into().unwrap()) >= 10_000 {
                        assert_eq!(
                            got.get(k),
                            Some(v),
                            "dump {i} (chunk {chunk}): stable key missing"
                        );
                    }
                }
            }
        }
    }
    for w in writers {
        let passes = w.stop();
        assert!(
            passes >= 1,
            "the writer ran concurrently ({passes} passes over its 10,000 keys)"
        );
    }
    daemon.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bpfmapctl_cut_off_by_a_failing_daemon_keeps_every_line_and_resumes_exactly() {
    let fs = BpfFs::new();
    let state = tempfile::tempdir().unwrap();
    let (_m, expected) = u64_hash(&fs, "m", 1_500_000, 2_000_000);
    let mut daemon = DaemonProcess::local(daemon_bin!(), fs.path(), state.path());
    let out = tempfile::tempdir().unwrap();
    let url = daemon.url();
    let ctl = |args: &[&str], stdout: &std::path::Path| {
        std::process::Command::new(ctl_bin!())
            .arg("--addr")
            .arg(&url)
            .args(args)
            .stdout(std::fs::File::create(stdout).unwrap())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap()
    };
    let first = out.path().join("first.jsonl");
    let child = ctl(&["dump", "m", "--no-resume"], &first);
    // Kill the daemon once a good part is on disk.
    let t = Instant::now();
    while std::fs::metadata(&first).map_or(0, |m| m.len()) < 4 << 20 {
        assert!(
            t.elapsed() < Duration::from_secs(60),
            "bpfmapctl wrote too little"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    daemon.kill9();
    let result = child.wait_with_output().unwrap();
    assert_eq!(
        result.status.code(),
        Some(1),
        "bpfmapctl fails when the daemon dies"
    );
    let stderr = String::from_utf8_lossy(&result.stderr);
    let summary: serde_json::Value = stderr
        .lines()
        .find_map(|l| serde_json::from_str(l).ok())
        .unwrap_or_else(|| panic!("no summary on stderr: {stderr}"));
    let text = std::fs::read_to_string(&first).unwrap();
    assert!(text.ends_with('\n'), "the last line is whole");
    let mut keys = BTreeSet::new();
    for line in text.lines() {
        let v: serde_json::Value =
            serde_json::from_str(line).unwrap_or_else(|e| panic!("cut line {line:?}: {e}"));
        assert!(
            keys.insert(v["key"].as_str().unwrap().to_owned()),
            "duplicate line"
        );
    }
    assert_eq!(
        summary["entries"].as_u64().unwrap(),
        keys.len() as u64,
        "{summary}"
    );
    assert_eq!(summary["complete"], false);
    eprintln!(
        "bpfmapctl wrote {} lines before the daemon died",
        keys.len()
    );
    assert!(keys.len() < expected.len());

    // Resume from the summary's cursor with a new daemon.
    daemon.restart();
    let cursor = summary["cursor"].as_str().unwrap().to_owned();
    let second = out.path().join("second.jsonl");
    let rest = ctl(&["dump", "m", "--cursor", &cursor], &second)
        .wait_with_output()
        .unwrap();
    process::assert_success(&rest);
    for line in std::fs::read_to_string(&second).unwrap().lines() {
        let v: serde_json::Value = serde_json::from_str(line).unwrap();
        assert!(
            keys.insert(v["key"].as_str().unwrap().to_owned()),
            "a key came again after resuming"
        );
    }
    let all: BTreeSet<String> = expected.keys().map(|k| faster_hex::hex_string(k)).collect();
    assert_eq!(keys, all, "the two runs hold every entry exactly once");
}

#[tokio::test]
async fn entries_larger_than_a_chunk_travel_alone_and_lookups_are_bounded() {
    let fs = BpfFs::new();
    let state = tempfile::tempdir().unwrap();
    // 3.5 MB values: more than a chunk, less than the largest message.
    let value_size = 3_500_000u32;
    let _big = big_array(&fs, "big", 3, value_size);
    // With the default memory (a 12 MiB pool), a dump of such entries, which
    // holds up to four of them, is refused, saying what to raise.
    let daemon = Daemon::start(fs.path(), state.path()).await;
    let client = daemon
        .client_with(ConnectOptions::default().with_retry(RetryPolicy::never()))
        .await;
    let mut dump = client.dump(&"big".parse().unwrap(), DumpOptions::default());
    let e = dump.next_chunk().await.unwrap_err();
    assert_eq!(code_of(&e), Code::FailedPrecondition, "{e}");
    assert_eq!(reason_of(&e), "ENTRY_TOO_LARGE");
    assert!(
        e.to_string().contains("raise limits.max_queued_bytes"),
        "{e}"
    );
    // One at a time, a Lookup can still read one.
    let map = "big".parse().unwrap();
    let one = client
        .lookup(
            &map,
            vec![1u32.to_le_bytes().to_vec()],
            LookupOptions::default(),
        )
        .await
        .unwrap();
    let want = vec![1u8; value_size as usize];
    assert!(one[0].value() == Some(ValueRef::Single(&want)));
    daemon.stop().await;

    // With more memory they are served, one per message.
    let daemon = Daemon::start_with(Config {
        limits: Limits {
            max_queued_bytes: 64 << 20,
            ..Limits::default()
        },
        ..Daemon::config(fs.path(), state.path())
    })
    .await;
    let client = daemon.client().await;
    let mut dump = client.dump(&"big".parse().unwrap(), DumpOptions::default());
    let mut seen = 0;
    while let Some(chunk) = dump.next_chunk().await.unwrap() {
        assert_eq!(chunk.len(), 1, "one entry per message");
        let e = chunk.get(0).unwrap();
        let ValueRef::Single(v) = e.value else {
            panic!("not per-CPU")
        };
        assert_eq!(v.len(), value_size as usize);
        assert!(v.iter().all(|&b| b == e.key[0]));
        seen += 1;
    }
    assert_eq!(seen, 3);
    let keys: Vec<Vec<u8>> = (0u32..3).map(|i| i.to_le_bytes().to_vec()).collect();
    let e = client
        .lookup(&map, keys.clone(), LookupOptions::default())
        .await
        .unwrap_err();
    assert_eq!(code_of(&e), Code::InvalidArgument, "{e}");
    assert_eq!(reason_of(&e), "RESPONSE_TOO_LARGE");
    assert!(
        e.to_string().contains("only one key of this map fits"),
        "{e}"
    );
    let one = client
        .lookup(&map, keys[2..].to_vec(), LookupOptions::default())
        .await
        .unwrap();
    let Some(ValueRef::Single(v)) = one[0].value() else {
        panic!("found, not per-CPU")
    };
    assert_eq!(v.len(), value_size as usize);
    daemon.stop().await;
}
