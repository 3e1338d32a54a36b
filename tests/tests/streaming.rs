//! Resuming, cancelling, restarts, network cuts and concurrent writers.

use std::{sync::atomic::Ordering, time::Duration};

use bpfmap_client::{Client, ConnectOptions, DumpOptions, Entry, RetryPolicy};
use bpfmap_tests::*;

fn opts(chunk_size: u32, cursor: Option<String>) -> DumpOptions {
    DumpOptions::default()
        .with_chunk_size(chunk_size)
        .with_cursor(cursor.unwrap_or_default())
}

/// Reads a whole dump chunk by chunk: (entries of each chunk, its cursor).
async fn chunks(client: &Client, map: &str, options: DumpOptions) -> Vec<(Vec<Entry>, String)> {
    let mut dump = client.dump(&map.parse().unwrap(), options);
    let mut out = Vec::new();
    while let Some(c) = dump.next_chunk().await.unwrap() {
        assert_eq!(
            c.cursor(),
            dump.cursor(),
            "a chunk carries the dump's cursor"
        );
        out.push((c.to_entries(), c.cursor().to_owned()));
    }
    assert!(dump.complete());
    out
}

#[tokio::test]
async fn resuming_from_each_chunk_cursor_gives_exactly_the_rest() {
    let (fs, _state, daemon, client) = setup().await;
    let (_h, expected_hash) = u64_hash(&fs, "hash", 2000, 4096);
    // The generic (last-key) path: an array.
    let arr = create_map(MapType::ARRAY, 4, 4, 300);
    let mut expected_arr = Entries::new();
    for i in 0u32..300 {
        update(&arr, &i.to_le_bytes(), &(i * 2).to_le_bytes());
        expected_arr.insert(
            i.to_le_bytes().to_vec(),
            bpfmap_client::Value::Single((i * 2).to_le_bytes().to_vec()),
        );
    }
    fs.pin(&arr, "array");
    for (map, expected, chunk) in [("hash", &expected_hash, 100), ("array", &expected_arr, 32)] {
        let all = chunks(&client, map, opts(chunk, None)).await;
        assert!(all.len() > 5, "{map}: {} chunks", all.len());
        let flat = collect_unique(all.iter().flat_map(|(c, _)| c.clone()));
        assert_eq!(&flat, expected, "{map}");
        for i in 0..all.len() {
            let rest = chunks(&client, map, opts(chunk, Some(all[i].1.clone()))).await;
            let got = collect_unique(rest.into_iter().flat_map(|(c, _)| c));
            let want = collect_unique(all[i + 1..].iter().flat_map(|(c, _)| c.clone()));
            assert_eq!(got, want, "{map}: resuming after chunk {i}");
        }
    }
    daemon.stop().await;
}

#[tokio::test]
async fn a_cursor_survives_a_daemon_restart() {
    let fs = BpfFs::new();
    let state = tempfile::tempdir().unwrap();
    let (_fd, expected) = u64_hash(&fs, "m", 5000, 8192);
    let first = Daemon::start(fs.path(), state.path()).await;
    let mut dump = first
        .client()
        .await
        .dump(&"m".parse().unwrap(), opts(500, None));
    let mut got = Vec::new();
    for _ in 0..3 {
        got.extend(dump.next_chunk().await.unwrap().unwrap());
    }
    let cursor = dump.cursor().to_owned();
    drop(dump);
    first.stop().await;

    let second = Daemon::start(fs.path(), state.path()).await;
    assert_ne!(second.addr(), "", "new daemon");
    let client = second.client().await;
    got.extend(dump_entries(&client, "m", opts(500, Some(cursor))).await);
    assert_eq!(collect_unique(got), expected);
    second.stop().await;
}

#[tokio::test]
async fn the_client_resumes_by_itself_when_the_daemon_restarts_mid_stream() {
    let fs = BpfFs::new();
    let state = tempfile::tempdir().unwrap();
    // More than the client's HTTP/2 stream window (2 MiB): the dump cannot
    // be delivered whole while the client reads nothing.
    let (_fd, expected) = u64_hash(&fs, "m", 200_000, 262_144);
    let first = Daemon::start(fs.path(), state.path()).await;
    let addr = first.running.local_addr();
    let client = Client::connect(
        &first.addr(),
        ConnectOptions::default().with_retry(
            RetryPolicy::default()
                .with_max_attempts(50)
                .with_min_delay(Duration::from_millis(20))
                .with_max_delay(Duration::from_millis(200)),
        ),
    )
    .await
    .unwrap();
    let mut dump = client.dump(&"m".parse().unwrap(), opts(100, None));
    let mut got = Vec::new();
    for _ in 0..3 {
        got.extend(dump.next_chunk().await.unwrap().unwrap());
    }
    // The daemon goes away in the middle of the stream and comes back on the
    // same address.
    first.stop().await;
    let second = Daemon::start_with(bpfmapd::Config {
        listen: addr,
        ..Daemon::config(fs.path(), state.path())
    })
    .await;
    while let Some(c) = dump.next_chunk().await.unwrap() {
        got.extend(c);
    }
    assert!(dump.resumes() >= 1, "the dump should have resumed");
    assert_eq!(collect_unique(got), expected);
    second.stop().await;
}

#[tokio::test]
async fn the_client_resumes_after_a_network_cut() {
    let (fs, _state, daemon, _) = setup().await;
    let (_fd, expected) = u64_hash(&fs, "m", 20_000, 32_768);
    // Cut the first connection after about 64 KiB from the server.
    let proxy = CutProxy::start(daemon.running.local_addr(), 64 * 1024).await;
    let client = Client::connect(
        &format!("http://{}", proxy.addr),
        ConnectOptions::default().with_retry(
            RetryPolicy::default()
                .with_max_attempts(20)
                .with_min_delay(Duration::from_millis(10))
                .with_max_delay(Duration::from_millis(100)),
        ),
    )
    .await
    .unwrap();
    let mut dump = client.dump(&"m".parse().unwrap(), opts(200, None));
    let mut got = Vec::new();
    while let Some(c) = dump.next_chunk().await.unwrap() {
        got.extend(c);
    }
    assert!(dump.resumes() >= 1, "the cut should have forced a resume");
    assert_eq!(collect_unique(got), expected);
    daemon.stop().await;
}

#[tokio::test]
async fn cancelling_a_stream_stops_the_kernel_reads() {
    let (fs, _state, daemon, client) = setup().await;
    let (_fd, _) = u64_hash(&fs, "m", 200_000, 262_144);
    let stats = daemon.running.stats().clone();
    let before = stats.chunks_read.load(Ordering::SeqCst);
    let mut dump = client.dump(&"m".parse().unwrap(), opts(10, None));
    for _ in 0..2 {
        dump.next_chunk().await.unwrap().unwrap();
    }
    assert_eq!(stats.active.load(Ordering::SeqCst), 1);
    drop(dump);
    let mut waited = 0;
    while stats.active.load(Ordering::SeqCst) != 0 && waited < 100 {
        tokio::time::sleep(Duration::from_millis(20)).await;
        waited += 1;
    }
    assert_eq!(
        stats.active.load(Ordering::SeqCst),
        0,
        "producer still running"
    );
    let read = stats.chunks_read.load(Ordering::SeqCst) - before;
    // About 20,000 chunks in the map; the reader stopped after a few beyond
    // what was buffered (the channel, HTTP/2 windows).
    eprintln!("{read} chunks read before the producer stopped");
    assert!(read < 2_000, "{read} chunks read after cancelling");
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(
        stats.chunks_read.load(Ordering::SeqCst) - before,
        read,
        "reads went on"
    );
    daemon.stop().await;
}

#[tokio::test]
async fn a_hash_map_updated_during_a_dump_yields_no_duplicates() {
    let (fs, _state, daemon, client) = setup().await;
    // Keys 0..10,000 churn (deleted and re-inserted); 10,000..50,000 stay.
    let (fd, expected) = u64_hash(&fs, "m", 50_000, 65_536);
    let mut i = 0u64;
    let writer = Churn::start(move || {
        let k = (i % 10_000).to_le_bytes();
        let _ = fd.delete(&k);
        update(&fd, &k, &(i * 3).to_le_bytes());
        i += 1;
    });
    for pass in 0..5 {
        // collect_unique fails on any key seen twice.
        let got = dump_all(&client, "m", opts(64, None)).await;
        for (k, v) in expected.range(10_000u64.to_le_bytes().to_vec()..) {
            let key = u64::from_le_bytes(k.as_slice().try_into().unwrap());
            if key >= 10_000 {
                assert_eq!(got.get(k), Some(v), "pass {pass}: stable key {key} missing");
            }
        }
    }
    let writes = writer.stop();
    assert!(
        writes > 1000,
        "the writer ran concurrently ({writes} writes)"
    );
    daemon.stop().await;
}

#[tokio::test]
async fn many_dumps_at_once_each_get_exactly_their_map() {
    let (fs, _state, daemon, client) = setup().await;
    let (_a, expected_a) = u64_hash(&fs, "a", 30_000, 32_768);
    let (_b, expected_b) = u64_hash(&fs, "b", 7_000, 8_192);
    let mut tasks = Vec::new();
    for i in 0..8 {
        let client = client.clone();
        let (map, expected) = if i % 2 == 0 {
            ("a", expected_a.clone())
        } else {
            ("b", expected_b.clone())
        };
        tasks.push(tokio::spawn(async move {
            let got = dump_all(&client, map, opts(100 + i * 37, None)).await;
            assert_eq!(got, expected, "dump {i} of {map}");
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    daemon.stop().await;
}

#[tokio::test]
async fn a_limited_dump_with_small_chunks_reaches_its_limit_and_resumes_exactly() {
    let (fs, _state, daemon, client) = setup().await;
    // 5000 keys in 8192 buckets: many buckets hold several keys.
    let (_m, expected) = u64_hash(&fs, "m", 5000, 8192);
    let mut dump = client.dump(
        &"m".parse().unwrap(),
        DumpOptions::default().with_chunk_size(1).with_limit(500),
    );
    let mut got = Vec::new();
    while let Some(c) = dump.next_chunk().await.unwrap() {
        got.extend(c);
    }
    assert!(!dump.complete());
    // A hash bucket is never split, so the call stops before a bucket that
    // would overshoot: a few entries short of the limit at most.
    assert!((495..=500).contains(&got.len()), "{} entries", got.len());
    let rest = opts(64, Some(dump.cursor().to_owned()));
    got.extend(dump_entries(&client, "m", rest).await);
    assert_eq!(collect_unique(got), expected);
    daemon.stop().await;
}

#[tokio::test]
async fn default_chunks_start_small_and_grow_to_the_dumps_share() {
    let fs = BpfFs::new();
    let state = tempfile::tempdir().unwrap();
    let (_fd, expected) = u64_hash(&fs, "m", 100_000, 131_072);
    let daemon = Daemon::start(fs.path(), state.path()).await;
    let client = daemon.client().await;
    let mut dump = client.dump(&"m".parse().unwrap(), DumpOptions::default());
    let (mut sizes, mut got) = (Vec::new(), Vec::new());
    while let Some(c) = dump.next_chunk().await.unwrap() {
        sizes.push(c.len());
        got.extend(c);
    }
    assert_eq!(collect_unique(got), expected);
    // 16-byte entries: 4 KiB first (256 entries), then four times the last,
    // up to a sixth of the dump's share (576 KiB with the default limits:
    // 6,144 entries). A hash bucket is never split, so a chunk may hold a
    // few entries more or less than asked for.
    let near = |n: usize, want: usize| n.abs_diff(want) <= 16;
    assert!(near(sizes[0], 256), "{sizes:?}");
    assert!(near(sizes[1], 1024), "{sizes:?}");
    assert!(near(sizes[2], 4096), "{sizes:?}");
    // Later chunks are that size, or smaller when the client has not yet
    // taken the chunks before them (their memory is still held).
    let steady = (576 << 10) / 6 / 16;
    assert!(sizes.iter().all(|&n| n <= steady + 16), "{sizes:?}");
    assert!(sizes.iter().any(|&n| near(n, steady)), "{sizes:?}");
    assert!(sizes.len() < 20, "{} chunks", sizes.len());
    daemon.stop().await;
}

#[tokio::test]
async fn limited_dumps_with_default_chunks_never_exceed_their_limit_and_resume_exactly() {
    let fs = BpfFs::new();
    let state = tempfile::tempdir().unwrap();
    let (_fd, expected) = u64_hash(&fs, "m", 30_000, 32_768);
    let daemon = Daemon::start(fs.path(), state.path()).await;
    let client = daemon.client().await;
    let (mut got, mut cursor, mut calls) = (Vec::new(), None, 0);
    loop {
        let mut dump = client.dump(
            &"m".parse().unwrap(),
            DumpOptions::default()
                .with_limit(1025)
                .with_cursor(cursor.clone().unwrap_or_default()),
        );
        let mut n = 0;
        while let Some(c) = dump.next_chunk().await.unwrap() {
            n += c.len();
            got.extend(c);
        }
        // A call stops before a bucket that would overshoot its limit.
        assert!(n <= 1025, "a call with limit 1025 gave {n} entries");
        calls += 1;
        if dump.complete() {
            break;
        }
        assert!(n > 0 && calls < 100, "no progress");
        cursor = Some(dump.cursor().to_owned());
    }
    assert_eq!(collect_unique(got), expected);
    assert!(calls >= 10, "{calls} calls");
    daemon.stop().await;
}
