//! WatchMap against real kernel maps: the initial state then exactly the
//! changes a writer makes (deltas exact, rates within the scans' timing,
//! counter resets flagged), filters and aggregated watches, resuming from
//! a bookmark (exactly the keys changed since, once), resyncs (a daemon
//! restart, a cursor older than the history), one walk per interval for
//! 100 watchers, the limits, and grpcurl on the live demo.

use std::{
    collections::{BTreeMap, BTreeSet},
    time::Duration,
};

use bpfmap_client::{Aggregate, Client, MapName, Scan, Watch, WatchOptions, pb};
use bpfmap_tests::*;
use serde_json::{Value as Json, json};
use tonic::Code;

const INTERVAL: Duration = Duration::from_millis(300);

/// A client that reports RESOURCE_EXHAUSTED at once.
fn no_retry() -> bpfmap_client::ConnectOptions {
    bpfmap_client::ConnectOptions::default().with_retry(bpfmap_client::RetryPolicy::never())
}

fn config(fs: &BpfFs, state: &std::path::Path) -> bpfmapd::Config {
    let mut c = Daemon::config(fs.path(), state);
    c.limits.min_watch_interval = Duration::from_millis(200);
    c.metrics_listen = Some("127.0.0.1:0".parse().unwrap());
    c
}

/// `n` demo flows (`flow_key(i)` -> `flow_value(i)`: packets i + 1, bytes
/// 1500 (i + 1)) pinned at "flows".
fn flows(fs: &BpfFs, n: u32) -> bpfmap_kernel::OwnedMap {
    let map = bpfmapd::typed_flows(n).expect("the flows map");
    fs.pin(&map, "flows");
    map
}

fn value(packets: u64, bytes: u64) -> [u8; 16] {
    let mut v = [0u8; 16];
    v[..8].copy_from_slice(&packets.to_ne_bytes());
    v[8..].copy_from_slice(&bytes.to_ne_bytes());
    v
}

fn watch(client: &Client, options: WatchOptions) -> Watch {
    let map: MapName = "flows".parse().unwrap();
    client.watch(&map, options.with_interval(INTERVAL))
}

async fn next(w: &mut Watch) -> Scan {
    tokio::time::timeout(Duration::from_secs(20), w.next_scan())
        .await
        .expect("a scan within 20 s")
        .expect("the watch goes on")
}

/// The flow number of an event (from its decoded key's saddr).
fn flow_of(e: &pb::WatchEvent) -> u32 {
    let key = json_of(e.entry.as_ref().unwrap().decoded_key.as_ref().unwrap());
    // The demo keeps addresses in network order, as programs do.
    u32::from_be(key["saddr"].as_u64().unwrap() as u32) - 0x0A00_0000
}

fn kind(e: &pb::WatchEvent) -> pb::EventType {
    pb::EventType::try_from(e.r#type).unwrap()
}

fn decoded_value(e: &pb::WatchEvent) -> Json {
    json_of(e.entry.as_ref().unwrap().decoded_value.as_ref().unwrap())
}

/// Scans until `want` events have arrived (the writer's changes may fall
/// into two scans); every event's flow, type and the scan's length.
async fn events_until(
    w: &mut Watch,
    want: usize,
    since: Option<std::time::SystemTime>,
) -> Vec<(pb::WatchEvent, f64)> {
    let mut out = Vec::new();
    let mut last = since;
    for _ in 0..20 {
        let s = next(w).await;
        assert!(s.resync().is_none(), "{:?}", s.resync());
        let t = s.scan_time().unwrap();
        let secs = last.map_or(0.0, |l| t.duration_since(l).unwrap().as_secs_f64());
        last = Some(t);
        assert_eq!(
            s.bookmark().events_sent,
            s.events().len() as u64,
            "{:?}",
            s.bookmark()
        );
        out.extend(s.events().iter().cloned().map(|e| (e, secs)));
        if out.len() >= want {
            break;
        }
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_watch_sends_the_state_then_exactly_the_changes_with_deltas_and_rates() {
    let fs = BpfFs::new();
    let state = tempfile::tempdir().unwrap();
    let map = flows(&fs, 1000);
    let daemon = Daemon::start_with(config(&fs, state.path())).await;
    let client = daemon.client().await;
    let mut w = watch(&client, WatchOptions::default());

    let first = next(&mut w).await;
    assert!(first.is_initial() && first.resync().is_none());
    let got: BTreeSet<u32> = first.events().iter().map(flow_of).collect();
    assert_eq!(got, (0..1000).collect::<BTreeSet<_>>());
    assert!(
        first
            .events()
            .iter()
            .all(|e| kind(e) == pb::EventType::Added)
    );
    assert_eq!(first.bookmark().entries_scanned, 1000);
    let e7 = first.events().iter().find(|e| flow_of(e) == 7).unwrap();
    assert_eq!(decoded_value(e7), json!({"packets": "8", "bytes": "12000"}));

    // A scan with no change sends its bookmark only.
    let quiet = next(&mut w).await;
    assert!(quiet.events().is_empty() && !quiet.is_initial());
    assert_eq!(quiet.revision(), first.revision() + 1);

    // The writer: flows 0..10 grow by 5 packets, 7500 bytes; 10..15 go;
    // 2000..2003 come; flow 20 is reset to 1 packet.
    let (mut keys, mut values) = (Vec::new(), Vec::new());
    for i in 0..10u32 {
        keys.extend_from_slice(&bpfmapd::flow_key(i));
        values.extend_from_slice(&value(u64::from(i) + 6, 1500 * (u64::from(i) + 1) + 7500));
    }
    for i in 2000..2003u32 {
        keys.extend_from_slice(&bpfmapd::flow_key(i));
        values.extend_from_slice(&value(1, 100));
    }
    keys.extend_from_slice(&bpfmapd::flow_key(20));
    values.extend_from_slice(&value(1, 1500));
    // (The map is full: the deletions first.)
    for i in 10..15u32 {
        delete(&map, &bpfmapd::flow_key(i));
    }
    update_batch(&map, &keys, &values);
    let events = events_until(&mut w, 19, quiet.scan_time()).await;
    let mut by_flow: BTreeMap<u32, (pb::EventType, Json, pb::WatchEvent, f64)> = BTreeMap::new();
    for (e, secs) in events {
        let f = flow_of(&e);
        assert!(
            by_flow
                .insert(f, (kind(&e), decoded_value(&e), e, secs))
                .is_none(),
            "flow {f} twice"
        );
    }
    let want: BTreeSet<u32> = (0..15).chain(2000..2003).chain([20]).collect();
    assert_eq!(by_flow.keys().copied().collect::<BTreeSet<_>>(), want);
    for i in 0..10u32 {
        let (t, v, e, secs) = &by_flow[&i];
        assert_eq!(*t, pb::EventType::Changed);
        let i = u64::from(i);
        assert_eq!(
            *v,
            json!({"packets": (i + 6).to_string(), "bytes": (1500 * (i + 1) + 7500).to_string()})
        );
        assert_eq!(e.delta["value.packets"], "5");
        assert_eq!(e.delta["value.bytes"], "7500");
        assert!(e.resets.is_empty());
        // The rate is the delta over the time between the two scans.
        let rate = e.rate["value.bytes"];
        assert!(
            (rate * secs - 7500.0).abs() < 7500.0 * 0.05,
            "rate {rate} over {secs} s"
        );
    }
    for i in 10..15u32 {
        let (t, v, ..) = &by_flow[&i];
        assert_eq!(*t, pb::EventType::Removed);
        let i = u64::from(i);
        assert_eq!(
            *v,
            json!({"packets": (i + 1).to_string(), "bytes": (1500 * (i + 1)).to_string()})
        );
    }
    for i in 2000..2003u32 {
        let (t, v, e, _) = &by_flow[&i];
        assert_eq!(*t, pb::EventType::Added);
        assert_eq!(*v, json!({"packets": "1", "bytes": "100"}));
        assert!(e.delta.is_empty());
    }
    // Flow 20 went from 21 packets to 1: a reset, its delta the new value.
    let (t, _, e, _) = &by_flow[&20];
    assert_eq!(*t, pb::EventType::Changed);
    assert_eq!(e.resets, ["value.packets", "value.bytes"]);
    assert_eq!(e.delta["value.packets"], "1");
    assert_eq!(e.delta["value.bytes"], "1500");
    daemon.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn filters_fields_and_aggregated_watches() {
    let fs = BpfFs::new();
    let state = tempfile::tempdir().unwrap();
    let map = flows(&fs, 1000);
    let daemon = Daemon::start_with(config(&fs, state.path())).await;
    let client = daemon.client().await;
    let mut filtered = watch(
        &client,
        WatchOptions::default()
            .with_filter("value.packets > 500")
            .with_fields(["key.saddr", "value.packets"]),
    );
    let totals = || {
        WatchOptions::default()
            .with_group_by(["key.proto"])
            .with_aggregates([Aggregate::sum("value.bytes"), Aggregate::count()])
    };
    let mut grouped = watch(&client, totals());
    let first = next(&mut filtered).await;
    let got: BTreeSet<u32> = first.events().iter().map(flow_of).collect();
    assert_eq!(got, (500..1000).collect::<BTreeSet<_>>());
    let e = &first.events()[0];
    let i = u64::from(flow_of(e));
    assert_eq!(decoded_value(e), json!({"packets": (i + 1).to_string()}));
    assert_eq!(first.bookmark().entries_scanned, 1000);

    // Per proto: flows i % 4 == 3 are UDP.
    let sums = |extra: &dyn Fn(u32) -> u64| {
        let mut s: BTreeMap<&str, (u64, u64)> = BTreeMap::new();
        for i in 0..1000u32 {
            let p = if i % 4 == 3 {
                "IPPROTO_UDP"
            } else {
                "IPPROTO_TCP"
            };
            let e = s.entry(p).or_default();
            e.0 += 1500 * (u64::from(i) + 1) + extra(i);
            e.1 += 1;
        }
        s
    };
    let groups = |s: &Scan| -> BTreeMap<String, (Json, Vec<f64>)> {
        s.groups()
            .iter()
            .map(|g| {
                let group = g.group.as_ref().unwrap();
                let key = json_of(&prost_types::Value {
                    kind: Some(prost_types::value::Kind::StructValue(
                        group.key.clone().unwrap(),
                    )),
                });
                let values: Vec<Json> = group.values.iter().map(json_of).collect();
                (
                    key["key.proto"].as_str().unwrap().to_owned(),
                    (Json::Array(values), g.rates.clone()),
                )
            })
            .collect()
    };
    let g0 = next(&mut grouped).await;
    assert!(g0.is_initial());
    let want = sums(&|_| 0);
    let got = groups(&g0);
    for (p, (bytes, count)) in &want {
        assert_eq!(
            got[*p].0,
            json!([bytes.to_string(), count.to_string()]),
            "{p}"
        );
        assert!(got[*p].1.is_empty(), "no rates in the initial state");
    }

    // Flow 100 starts matching, 700 stops, 800 changes; UDP flow 3 and
    // TCP flow 4 gain bytes.
    let set = |i: u32, packets: u64, bytes: u64| {
        update(&map, &bpfmapd::flow_key(i), &value(packets, bytes));
    };
    set(100, 600, 1500 * 101);
    set(700, 10, 1500 * 701);
    set(800, 900, 1500 * 801);
    set(3, 4, 1500 * 4 + 1_000_000);
    set(4, 5, 1500 * 5 + 2_000_000);
    let events = events_until(&mut filtered, 3, None).await;
    let mut seen: BTreeMap<u32, (pb::EventType, Json)> = BTreeMap::new();
    for (e, _) in &events {
        seen.insert(flow_of(e), (kind(e), decoded_value(e)));
    }
    assert_eq!(
        seen,
        BTreeMap::from([
            (100, (pb::EventType::Added, json!({"packets": "600"}))),
            (700, (pb::EventType::Removed, json!({"packets": "10"}))),
            (800, (pb::EventType::Changed, json!({"packets": "900"}))),
        ])
    );
    let changed = events.iter().find(|(e, _)| flow_of(e) == 800).unwrap();
    assert_eq!(changed.0.delta["value.packets"], "99");

    // The groups' sums and their rates (increases counted per entry).
    let extra = |i: u32| match i {
        3 => 1_000_000,
        4 => 2_000_000,
        _ => 0,
    };
    let want = sums(&extra);
    let mut last = g0.scan_time().unwrap();
    let mut increase: BTreeMap<String, f64> = BTreeMap::new();
    for _ in 0..20 {
        let s = next(&mut grouped).await;
        let t = s.scan_time().unwrap();
        let secs = t.duration_since(last).unwrap().as_secs_f64();
        last = t;
        for (p, (values, rates)) in groups(&s) {
            *increase.entry(p.clone()).or_default() += rates[0] * secs;
            let _ = values;
        }
        let now = groups(&s);
        if now
            .get("IPPROTO_UDP")
            .is_some_and(|g| g.0 == json!([want["IPPROTO_UDP"].0.to_string(), "250"]))
            && increase.len() == 2
        {
            break;
        }
    }
    assert!(
        (increase["IPPROTO_UDP"] - 1_000_000.0).abs() < 1000.0,
        "{increase:?}"
    );
    assert!(
        (increase["IPPROTO_TCP"] - 2_000_000.0).abs() < 2000.0,
        "{increase:?}"
    );
    daemon.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bookmark_resumes_exactly_and_a_restart_or_an_old_cursor_resyncs() {
    let fs = BpfFs::new();
    let state = tempfile::tempdir().unwrap();
    let map = flows(&fs, 100);
    let mut cfg = config(&fs, state.path());
    cfg.limits.watch_history_scans = 8;
    let daemon = Daemon::start_with(cfg.clone()).await;
    let client = daemon.client().await;
    let mut w = watch(&client, WatchOptions::default());
    let first = next(&mut w).await;
    assert_eq!(first.events().len(), 100);
    let cursor = first.cursor().to_owned();
    drop(w);

    // While no one watches (the map stays watched for watch_linger): flow
    // 1 changes twice, 2 goes, 500 comes and goes, 600 comes.
    update(&map, &bpfmapd::flow_key(1), &value(10, 10));
    tokio::time::sleep(INTERVAL * 2).await;
    update(&map, &bpfmapd::flow_key(1), &value(20, 20));
    delete(&map, &bpfmapd::flow_key(2));
    update(&map, &bpfmapd::flow_key(500), &value(1, 1));
    tokio::time::sleep(INTERVAL * 2).await;
    delete(&map, &bpfmapd::flow_key(500));
    update(&map, &bpfmapd::flow_key(600), &value(6, 6));
    tokio::time::sleep(INTERVAL * 2).await;

    let mut w = watch(&client, WatchOptions::default().with_cursor(&cursor));
    let caught_up = next(&mut w).await;
    assert!(caught_up.resync().is_none(), "{:?}", caught_up.resync());
    assert!(caught_up.is_initial());
    let got: BTreeMap<u32, (pb::EventType, Json)> = caught_up
        .events()
        .iter()
        .map(|e| (flow_of(e), (kind(e), decoded_value(e))))
        .collect();
    assert_eq!(
        got,
        BTreeMap::from([
            (
                1,
                (
                    pb::EventType::Changed,
                    json!({"packets": "20", "bytes": "20"})
                )
            ),
            (
                2,
                (
                    pb::EventType::Removed,
                    json!({"packets": "3", "bytes": "4500"})
                )
            ),
            (
                600,
                (pb::EventType::Added, json!({"packets": "6", "bytes": "6"}))
            ),
        ])
    );
    // Then the live stream goes on from there.
    update(&map, &bpfmapd::flow_key(3), &value(7, 7));
    let live = events_until(&mut w, 1, None).await;
    assert_eq!(live.len(), 1);
    assert_eq!(flow_of(&live[0].0), 3);
    let cursor = w.cursor().to_owned();
    drop(w);

    // A cursor from before a restart: a resync with a fresh state.
    daemon.stop().await;
    let daemon = Daemon::start_with(cfg.clone()).await;
    let client = daemon.client().await;
    let mut w = watch(&client, WatchOptions::default().with_cursor(&cursor));
    let s = next(&mut w).await;
    assert!(
        s.resync().is_some_and(|r| r.contains("restarted")),
        "{:?}",
        s.resync()
    );
    assert_eq!(s.events().len(), 100);
    let old = s.cursor().to_owned();
    drop(w);
    // A cursor older than the history (8 scans): a resync, not a loss.
    tokio::time::sleep(INTERVAL * 14).await;
    let mut w = watch(&client, WatchOptions::default().with_cursor(&old));
    let s = next(&mut w).await;
    assert!(
        s.resync()
            .is_some_and(|r| r.contains("watch_history_scans")),
        "{:?}",
        s.resync()
    );
    assert_eq!(s.events().len(), 100);
    // Another query's cursor is refused.
    let mut other = watch(
        &client,
        WatchOptions::default()
            .with_filter("key.dport == 443")
            .with_cursor(&old),
    );
    let e = other.next_scan().await.unwrap_err();
    assert_eq!(code_of(&e), Code::InvalidArgument, "{e}");
    daemon.stop().await;
}

/// The one series `name` of the daemon's metrics.
async fn metric(addr: std::net::SocketAddr, name: &str) -> f64 {
    bpfmap_tests::metrics::scrape(addr).await.get(name, &[])
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hundred_watchers_share_one_walk_per_interval() {
    let fs = BpfFs::new();
    let state = tempfile::tempdir().unwrap();
    let _map = flows(&fs, 500);
    let mut cfg = config(&fs, state.path());
    cfg.limits.max_watches = 100;
    cfg.limits.max_watches_per_identity = 100;
    let daemon = Daemon::start_with(cfg).await;
    let metrics = daemon.running.metrics_addr().unwrap();
    // Four connections (a connection carries 64 calls at most).
    let mut clients = Vec::new();
    for _ in 0..4 {
        clients.push(daemon.client().await);
    }
    let mut watches = Vec::new();
    for i in 0..100 {
        let mut w = watch(&clients[i % 4], WatchOptions::default());
        assert_eq!(next(&mut w).await.events().len(), 500);
        watches.push(w);
    }
    assert_eq!(metric(metrics, "bpfmapd_watchers").await, 100.0);
    assert_eq!(metric(metrics, "bpfmapd_watched_maps").await, 1.0);
    let before = metric(metrics, "bpfmapd_watch_scans_total").await;
    let started = std::time::Instant::now();
    // Every watcher sees the same scans.
    let mut revisions = BTreeSet::new();
    for w in &mut watches {
        revisions.insert(next(w).await.revision());
    }
    tokio::time::sleep(INTERVAL * 5).await;
    let scans = metric(metrics, "bpfmapd_watch_scans_total").await - before;
    let intervals = started.elapsed().as_secs_f64() / INTERVAL.as_secs_f64();
    assert!(
        scans <= intervals + 2.0,
        "{scans} walks in {intervals:.1} intervals for 100 watchers"
    );
    // The 101st watch is refused (the library would wait for room).
    let impatient = daemon.client_with(no_retry()).await;
    let mut extra = watch(&impatient, WatchOptions::default());
    let e = extra.next_scan().await.unwrap_err();
    assert_eq!(code_of(&e), Code::ResourceExhausted, "{e}");
    assert!(e.to_string().contains("limits.max_watches"), "{e}");
    drop(watches);
    daemon.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn watch_limits_are_named_and_dumps_go_on() {
    let fs = BpfFs::new();
    let state = tempfile::tempdir().unwrap();
    let _map = flows(&fs, 20_000);
    let mut cfg = config(&fs, state.path());
    cfg.limits.max_watch_bytes = 256 << 10;
    cfg.limits.max_watches_per_identity = 2;
    let daemon = Daemon::start_with(cfg).await;
    let client = daemon.client_with(no_retry()).await;
    let map: MapName = "flows".parse().unwrap();

    let mut fast = client.watch(
        &map,
        WatchOptions::default().with_interval(Duration::from_millis(50)),
    );
    let e = fast.next_scan().await.unwrap_err();
    assert_eq!(code_of(&e), Code::InvalidArgument, "{e}");
    assert!(e.to_string().contains("minimum, 200ms"), "{e}");

    // 20,000 entries need about 860 KB: more than max_watch_bytes. Not
    // something to wait for: the library (retrying by default) says so at
    // once.
    let patient = daemon.client().await;
    let started = std::time::Instant::now();
    let mut big = watch(&patient, WatchOptions::default());
    let e = big.next_scan().await.unwrap_err();
    assert_eq!(code_of(&e), Code::ResourceExhausted, "{e}");
    assert_eq!(reason_of(&e), "WATCH_TOO_LARGE", "{e}");
    assert!(e.to_string().contains("limits.max_watch_bytes"), "{e}");
    assert!(
        started.elapsed() < Duration::from_secs(10),
        "{:?}",
        started.elapsed()
    );

    // Two watches per identity, then RESOURCE_EXHAUSTED naming the limit.
    let small = create_map(bpfmap_kernel::MapType::HASH, 8, 8, 16);
    fs.pin(&small, "small");
    let small_ref: MapName = "small".parse().unwrap();
    let mut held = Vec::new();
    for _ in 0..2 {
        let mut w = client.watch(&small_ref, WatchOptions::default().with_interval(INTERVAL));
        next(&mut w).await;
        held.push(w);
    }
    let mut third = client.watch(&small_ref, WatchOptions::default().with_interval(INTERVAL));
    let e = third.next_scan().await.unwrap_err();
    assert_eq!(code_of(&e), Code::ResourceExhausted, "{e}");
    assert!(
        e.to_string().contains("limits.max_watches_per_identity"),
        "{e}"
    );
    drop(held);

    // Queues cannot be watched.
    let queue = create_map(bpfmap_kernel::MapType::QUEUE, 0, 8, 4);
    fs.pin(&queue, "queue");
    let mut q = client.watch(&"queue".parse().unwrap(), WatchOptions::default());
    let e = q.next_scan().await.unwrap_err();
    assert_eq!(code_of(&e), Code::FailedPrecondition, "{e}");

    // Dumps are served meanwhile, and the memory went back.
    let entries = dump_all(&client, "flows", Default::default()).await;
    assert_eq!(entries.len(), 20_000);
    daemon.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grpcurl_watches_the_live_demo() {
    let fs = BpfFs::new();
    let state = tempfile::tempdir().unwrap();
    let _demo = bpfmapd::Demo::start_live(fs.path()).expect("the demo starts");
    let daemon = Daemon::start(fs.path(), state.path()).await;
    let host = daemon.running.local_addr().to_string();
    let (_, out, err) = grpcurl(
        &[
            "-plaintext",
            "-max-time",
            "6",
            "-d",
            r#"{"map":{"path":"demo/flows"},"interval":"1s","filter":"key.daddr == \"192.168.0.1\"","fields":["key.daddr","value.bytes"],"render":{"key.daddr":"ipv4"}}"#,
        ],
        &host,
        &["bpfmap.v1.MapService/WatchMap"],
    )
    .await;
    let messages = json_stream(&out);
    let bookmarks: Vec<&Json> = messages.iter().filter_map(|m| m.get("bookmark")).collect();
    assert!(
        bookmarks.len() >= 2,
        "{err}\n{}",
        &out[..out.len().min(2000)]
    );
    assert_eq!(bookmarks[0]["initialStateEnd"], json!(true));
    let changed: Vec<&Json> = messages
        .iter()
        .flat_map(|m| m["events"].as_array().into_iter().flatten())
        .filter(|e| e["type"] == "CHANGED")
        .collect();
    assert!(!changed.is_empty(), "{err}");
    let e = changed[0];
    assert_eq!(
        e["entry"]["decodedKey"]["daddr"],
        json!("192.168.0.1"),
        "{e}"
    );
    assert!(e["delta"]["value.bytes"].is_string(), "{e}");
    assert!(e["rate"]["value.bytes"].as_f64().unwrap() > 0.0, "{e}");
    daemon.stop().await;
}

/// Flows 0..n rewritten every `every`, with a new value each time.
fn churn(map: bpfmap_kernel::OwnedMap, n: u32, every: Duration) -> Churn {
    let mut tick = 1000u64;
    Churn::start(move || {
        tick += 1;
        let (mut keys, mut values) = (Vec::new(), Vec::new());
        for i in 0..n {
            keys.extend_from_slice(&bpfmapd::flow_key(i));
            values.extend_from_slice(&value(tick, tick * 1500));
        }
        update_batch(&map, &keys, &values);
        std::thread::sleep(every);
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_watcher_that_falls_behind_the_history_resyncs() {
    let fs = BpfFs::new();
    let state = tempfile::tempdir().unwrap();
    let map = flows(&fs, 20_000);
    let mut cfg = config(&fs, state.path());
    cfg.limits.watch_history_scans = 2;
    let daemon = Daemon::start_with(cfg).await;
    let client = daemon.client().await;
    let mut w = watch(&client, WatchOptions::default());
    assert_eq!(next(&mut w).await.events().len(), 20_000);
    // Every entry changes at every scan: some 3 MB of events per scan.
    let writer = churn(map, 20_000, Duration::from_millis(100));
    // The client stops reading for 3 s (10 scans; the daemon keeps 2).
    tokio::time::sleep(Duration::from_secs(3)).await;
    let mut resynced = None;
    for _ in 0..20 {
        let s = next(&mut w).await;
        if s.resync().is_some() {
            resynced = Some(s);
            break;
        }
    }
    writer.stop();
    let s = resynced.expect("a resync within 20 scans");
    assert!(
        s.resync().unwrap().contains("fell behind"),
        "{:?}",
        s.resync()
    );
    // The fresh state holds every entry: nothing is silently lost.
    let added: BTreeSet<u32> = s
        .events()
        .iter()
        .filter(|e| kind(e) == pb::EventType::Added)
        .map(flow_of)
        .collect();
    assert_eq!(added, (0..20_000).collect::<BTreeSet<_>>());
    assert!(s.is_initial());
    daemon.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn watchers_that_never_read_stay_within_the_budget_and_end() {
    let fs = BpfFs::new();
    let state = tempfile::tempdir().unwrap();
    let map = flows(&fs, 50_000);
    let mut cfg = config(&fs, state.path());
    cfg.limits.max_watch_bytes = 4 << 20;
    cfg.limits.max_watches = 16;
    cfg.limits.max_watches_per_identity = 16;
    cfg.limits.stall_timeout = Duration::from_secs(2);
    let daemon = Daemon::start_with(cfg).await;
    let metrics = daemon.running.metrics_addr().unwrap();
    let writer = churn(map, 5_000, Duration::from_millis(50));
    let request = prost::Message::encode_to_vec(&pb::WatchMapRequest {
        map: map_ref("flows"),
        interval: Some(prost_types::Duration {
            seconds: 0,
            nanos: 200_000_000,
        }),
        ..Default::default()
    });
    // Twelve watchers, each on a connection of its own, that never read.
    let mut idle = Vec::new();
    for _ in 0..12 {
        idle.push(
            raw_stream(
                &daemon.addr(),
                "/bpfmap.v1.MapService/WatchMap",
                request.clone(),
            )
            .await
            .expect("the watch starts"),
        );
    }
    let client = daemon.client().await;
    let mut peak = 0.0f64;
    for _ in 0..4 {
        let bytes = metric(metrics, "bpfmapd_watch_bytes").await;
        peak = peak.max(bytes);
        assert!(bytes <= f64::from(4u32 << 20), "{bytes} bytes held");
        // Dumps are served meanwhile.
        let entries = dump_all(&client, "flows", Default::default()).await;
        assert_eq!(entries.len(), 50_000);
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    assert!(peak > 0.0);
    // Past the stall timeout every one of them has ended...
    let mut watchers = f64::NAN;
    for _ in 0..50 {
        watchers = metric(metrics, "bpfmapd_watchers").await;
        if watchers == 0.0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert_eq!(watchers, 0.0);
    // ... with UNAVAILABLE after what was queued.
    let mut stream = idle.pop().unwrap();
    let status = loop {
        match stream.message().await {
            Ok(Some(_)) => continue,
            Ok(None) => panic!("the stream ended without a status"),
            Err(s) => break s,
        }
    };
    assert_eq!(status.code(), Code::Unavailable, "{status:?}");
    writer.stop();
    drop(idle);
    daemon.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bpfmapctl_watch_resumes_from_its_saved_cursor_and_top_prints_rates() {
    let fs = BpfFs::new();
    let state = tempfile::tempdir().unwrap();
    let work = tempfile::tempdir().unwrap();
    let map = flows(&fs, 100);
    let daemon = Daemon::start_with(config(&fs, state.path())).await;
    let addr = daemon.running.local_addr().to_string();
    let saved = work.path().join("cursors.json");
    let run = {
        let addr = addr.clone();
        move |args: Vec<String>, secs: f64| {
            let out = std::process::Command::new("timeout")
                .arg(format!("{secs}"))
                .arg(ctl_bin!())
                .args(["--target", &addr])
                .args(&args)
                .output()
                .unwrap();
            String::from_utf8(out.stdout).unwrap()
        }
    };
    let watch_args = |extra: &[&str]| {
        let mut a: Vec<String> = ["watch", "flows", "--interval", "300ms", "--save-cursor"]
            .iter()
            .map(|s| s.to_string())
            .collect();
        a.push(saved.display().to_string());
        a.extend(extra.iter().map(|s| s.to_string()));
        a
    };
    let out = tokio::task::spawn_blocking({
        let a = watch_args(&[]);
        let run = run.clone();
        move || run(a, 1.5)
    })
    .await
    .unwrap();
    let lines = json_lines(&out);
    let added = lines.iter().filter(|l| l["type"] == "ADDED").count();
    assert_eq!(added, 100, "{out}");
    assert!(
        lines
            .iter()
            .any(|l| l["bookmark"]["initial"] == json!(true)),
        "{out}"
    );
    assert!(std::fs::read_to_string(&saved).unwrap().contains(&addr));

    // A change while nobody watched comes first, alone, on resuming.
    update(&map, &bpfmapd::flow_key(5), &value(77, 77));
    tokio::time::sleep(INTERVAL * 2).await;
    let cursor_file = saved.display().to_string();
    let out = tokio::task::spawn_blocking({
        let a = watch_args(&["--cursor", &cursor_file]);
        let run = run.clone();
        move || run(a, 1.0)
    })
    .await
    .unwrap();
    let lines = json_lines(&out);
    let events: Vec<&Json> = lines.iter().filter(|l| l.get("type").is_some()).collect();
    assert_eq!(events.len(), 1, "{out}");
    assert_eq!(events[0]["type"], "CHANGED", "{out}");
    assert_eq!(events[0]["deltas"]["value.packets"], "71", "{out}");
    assert!(lines.iter().all(|l| l.get("resync").is_none()), "{out}");

    // top --interval off a terminal: a JSON line per group and scan.
    let out = tokio::task::spawn_blocking({
        let run = run.clone();
        let a: Vec<String> = [
            "top",
            "flows",
            "--by",
            "sum(value.bytes)",
            "--group-by",
            "key.proto",
            "--interval",
            "300ms",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        move || run(a, 1.2)
    })
    .await
    .unwrap();
    let lines = json_lines(&out);
    assert!(lines.len() >= 4, "{out}");
    let l = &lines[0];
    let proto = &l["key"]["key.proto"];
    assert!(proto == "IPPROTO_TCP" || proto == "IPPROTO_UDP", "{out}");
    // Sums are exact decimal strings, as one-shot top writes them (not
    // 33.0); rates are numbers.
    assert!(
        l["values"]["sum(value.bytes)"]
            .as_str()
            .is_some_and(|s| s.parse::<u64>().is_ok())
            && l["rates"]["sum(value.bytes)"].is_number(),
        "{out}"
    );
    daemon.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bpfmapctl_watch_prints_the_per_cpu_values_of_a_map_without_types() {
    let fs = BpfFs::new();
    let state = tempfile::tempdir().unwrap();
    let map = create_map(bpfmap_kernel::MapType::PERCPU_HASH, 4, 8, 16);
    let cpus = bpfmap_kernel::possible_cpus() as usize;
    let per_cpu: Vec<u8> = (0..cpus as u64)
        .flat_map(|c| (c + 1).to_le_bytes())
        .collect();
    update(&map, &7u32.to_le_bytes(), &per_cpu);
    fs.pin(&map, "counts");
    let daemon = Daemon::start(fs.path(), state.path()).await;
    let addr = daemon.running.local_addr().to_string();
    let watch = |extra: &'static [&'static str]| {
        let addr = addr.clone();
        tokio::task::spawn_blocking(move || {
            let mut args = vec!["watch", "counts", "--interval", "1s"];
            args.extend_from_slice(extra);
            bpfmapctl_for(&[addr], &args, 2.5)
        })
    };
    let out = watch(&[]).await.unwrap();
    let added = json_lines(&out)
        .into_iter()
        .find(|l| l["type"] == "ADDED")
        .expect(&out);
    let want: Vec<String> = (0..cpus as u64)
        .map(|c| faster_hex::hex_string(&(c + 1).to_le_bytes()))
        .collect();
    assert_eq!(added["key"], json!("07000000"), "{out}");
    assert_eq!(added["per_cpu_values"], json!(want), "{out}");
    let out = watch(&["--per-cpu", "sum"]).await.unwrap();
    let added = json_lines(&out)
        .into_iter()
        .find(|l| l["type"] == "ADDED")
        .expect(&out);
    let sum = (1..=cpus as u64).sum::<u64>();
    assert_eq!(added["value"], json!(sum.to_string()), "{out}");
    daemon.stop().await;
}

/// Runs bpfmapctl against `targets` for at most `secs` seconds; its
/// stdout.
fn bpfmapctl_for(targets: &[String], args: &[&str], secs: f64) -> String {
    let mut cmd = std::process::Command::new("timeout");
    cmd.arg(format!("{secs}")).arg(ctl_bin!());
    for t in targets {
        cmd.args(["--target", t]);
    }
    let out = cmd.args(args).output().unwrap();
    String::from_utf8(out.stdout).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn live_top_across_two_daemons_merges_min_and_max_as_one_shot_top_does() {
    // Host a: flows 0..100 (packets i + 1). Host b: flows 0..300, the first
    // eight raised to 500 packets. Per protocol, the fleet's MAX is the
    // larger host's and its MIN the smaller's: adding them up is wrong.
    let (fs_a, fs_b) = (BpfFs::new(), BpfFs::new());
    let (state_a, state_b) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let _a = flows(&fs_a, 100);
    let b = flows(&fs_b, 300);
    for i in 0..8 {
        update(&b, &bpfmapd::flow_key(i), &value(500, 500 * 1500));
    }
    let packets = |n: u32, raised: u32| {
        (0..n).map(move |i| (i % 4 == 3, if i < raised { 500 } else { u64::from(i) + 1 }))
    };
    let mut want: BTreeMap<&str, (u64, u64, u64)> = BTreeMap::new();
    for (udp, p) in packets(100, 0).chain(packets(300, 8)) {
        let proto = if udp { "IPPROTO_UDP" } else { "IPPROTO_TCP" };
        let e = want.entry(proto).or_insert((u64::MAX, 0, 0));
        *e = (e.0.min(p), e.1.max(p), e.2 + p);
    }
    let daemon_a = Daemon::start_with(config(&fs_a, state_a.path())).await;
    let daemon_b = Daemon::start_with(config(&fs_b, state_b.path())).await;
    let targets = [&daemon_a, &daemon_b].map(|d| d.running.local_addr().to_string());
    let by = [
        "--by",
        "max(value.packets)",
        "--by",
        "min(value.packets)",
        "--by",
        "sum(value.packets)",
        "--group-by",
        "key.proto",
    ];
    // One-shot top: the library's exact merge.
    let one_shot = {
        let (targets, by) = (targets.clone(), by);
        tokio::task::spawn_blocking(move || {
            let mut args = vec!["top", "flows"];
            args.extend(by);
            bpfmapctl_for(&targets, &args, 20.0)
        })
        .await
        .unwrap()
    };
    let one_shot: BTreeMap<String, Json> = json_lines(&one_shot)
        .into_iter()
        .map(|l| {
            (
                l["key"]["key.proto"].as_str().unwrap().to_owned(),
                l["values"].clone(),
            )
        })
        .collect();
    // Live top, off a terminal: a line per group and round.
    let live = {
        let (targets, by) = (targets.clone(), by);
        tokio::task::spawn_blocking(move || {
            let mut args = vec!["top", "flows", "--interval", "300ms"];
            args.extend(by);
            bpfmapctl_for(&targets, &args, 2.0)
        })
        .await
        .unwrap()
    };
    let lines = json_lines(&live);
    let both: Vec<&Json> = lines
        .iter()
        .filter(|l| l["targets"].as_array().is_some_and(|t| t.len() == 2))
        .collect();
    assert!(both.len() >= 2, "no round of both hosts: {live}");
    for (proto, (min, max, sum)) in &want {
        let shot = &one_shot[*proto];
        assert_eq!(shot["max(value.packets)"], max.to_string(), "{proto}");
        assert_eq!(shot["min(value.packets)"], min.to_string(), "{proto}");
        assert_eq!(shot["sum(value.packets)"], sum.to_string(), "{proto}");
        for l in both.iter().filter(|l| l["key"]["key.proto"] == *proto) {
            let values = &l["values"];
            assert_eq!(
                values["max(value.packets)"],
                max.to_string(),
                "{proto}: {live}"
            );
            assert_eq!(
                values["min(value.packets)"],
                min.to_string(),
                "{proto}: {live}"
            );
            assert_eq!(
                values["sum(value.packets)"],
                sum.to_string(),
                "{proto}: {live}"
            );
        }
    }
    daemon_a.stop().await;
    daemon_b.stop().await;
}
