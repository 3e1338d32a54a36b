//! Maps that keep histograms, read as histograms: libbpf-tools' `struct
//! hist { __u32 slots[N]; }` values recognized from their BTF and summed
//! element by element; bpftrace's hist() and lhist() maps (one per-CPU
//! entry per bucket, no types) declared; drawn as the programs draw them,
//! as JSON data, through the library, bpfmapctl and grpcurl, merged over
//! several daemons; the real runqlat and bpftrace against bpftool; and
//! bpftrace's count(), sum(), min(), max(), avg() and stats() maps printed
//! as bpftrace prints them.

use std::collections::BTreeMap;

use bpfmap_client::{Aggregate, AggregateOptions, HistogramLayout, HistogramOptions, MapName, pb};
use bpfmap_kernel::{BtfBuilder, BtfMember as M, CreateMap, IntEncoding as E, OwnedBtf};
use bpfmap_tests::{programs::*, *};
use serde_json::{Value as Json, json};
use tonic::Code;

/// Slots of runqlat's `struct hist`.
const SLOTS: usize = 26;

/// One entry of a `struct hist` map: a pid, its command, its slots' counts.
struct Row<'a> {
    pid: u32,
    comm: &'a str,
    slots: &'a [(usize, u32)],
}

/// A hash of `__u32 pid` to `struct hist { __u32 slots[26]; char comm[16]; }`
/// (runqlat -P's), pinned at `rel`, holding `entries`.
fn hist_map(fs: &BpfFs, rel: &str, entries: &[Row<'_>]) -> OwnedMap {
    let mut b = BtfBuilder::new();
    let u32_ = b.add_int("unsigned int", 4, E::Unsigned);
    let u32_t = b.add_typedef("__u32", u32_);
    let char_ = b.add_int("char", 1, E::Signed);
    let slots = b.add_array(u32_t, SLOTS as u32);
    let comm = b.add_array(char_, 16);
    let hist = b.add_struct(
        "hist",
        (SLOTS * 4 + 16) as u32,
        &[
            M::new("slots", slots, 0),
            M::new("comm", comm, (SLOTS * 32) as u32),
        ],
    );
    let btf = OwnedBtf::load(&b.to_bytes()).unwrap_or_else(|e| panic!("BPF_BTF_LOAD: {e}"));
    let map = OwnedMap::create(&CreateMap {
        map_type: MapType::HASH.0,
        key_size: 4,
        value_size: (SLOTS * 4 + 16) as u32,
        max_entries: 64,
        name: "hists",
        btf: Some(btf.for_map(u32_t, hist)),
        ..Default::default()
    })
    .unwrap_or_else(|e| panic!("BPF_MAP_CREATE with BTF: {e}"));
    for row in entries {
        let mut value = vec![0u8; SLOTS * 4 + 16];
        for (slot, c) in row.slots {
            value[slot * 4..slot * 4 + 4].copy_from_slice(&c.to_le_bytes());
        }
        value[SLOTS * 4..SLOTS * 4 + row.comm.len()].copy_from_slice(row.comm.as_bytes());
        update(&map, &row.pid.to_le_bytes(), &value);
    }
    fs.pin(&map, rel);
    map
}

/// A per-CPU hash of u64 bucket to u64 count without types, as bpftrace
/// keeps `@x = hist(v)`: each (bucket, per-CPU counts).
fn bpftrace_map(fs: &BpfFs, rel: &str, buckets: &[(u64, &[u64])]) -> OwnedMap {
    let map = create_map(MapType::PERCPU_HASH, 8, 8, 128);
    let cpus = bpfmap_kernel::possible_cpus() as usize;
    for (bucket, counts) in buckets {
        let mut value = vec![0u8; 8 * cpus];
        for (cpu, c) in counts.iter().enumerate().take(cpus) {
            value[cpu * 8..cpu * 8 + 8].copy_from_slice(&c.to_le_bytes());
        }
        update(&map, &bucket.to_le_bytes(), &value);
    }
    fs.pin(&map, rel);
    map
}

/// (index, count) of every bucket.
fn counts(h: &pb::Histogram) -> Vec<(u32, u64)> {
    h.buckets.iter().map(|b| (b.index, b.count)).collect()
}

/// Three commands' histograms: pid 1 "a", pid 2 "b", pid 3 "c".
const THREE: [Row<'static>; 3] = [
    Row {
        pid: 1,
        comm: "a",
        slots: &[(0, 1), (3, 4)],
    },
    Row {
        pid: 2,
        comm: "b",
        slots: &[(3, 6), (5, 10)],
    },
    Row {
        pid: 3,
        comm: "c",
        slots: &[(1, 2)],
    },
];

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_libbpf_tools_histogram_is_recognized_summed_and_estimated() {
    let (fs, _state, daemon, client) = setup().await;
    let _map = hist_map(&fs, "hists", &THREE);
    let map: MapName = "hists".parse().unwrap();
    // Recognized from the BTF: value.slots, log2; every entry summed.
    let all = client
        .histogram(&map, HistogramOptions::default())
        .await
        .unwrap();
    assert_eq!(all.layout.name(), "log2");
    assert_eq!(all.layout.as_proto().slots, "value.slots");
    let [h] = all.histograms.as_slice() else {
        panic!("one histogram: {all:?}")
    };
    assert_eq!(
        counts(h),
        [(0, 1), (1, 2), (2, 0), (3, 10), (4, 0), (5, 10)]
    );
    assert_eq!(h.count, 23);
    let bounds: Vec<(Option<i64>, Option<i64>)> =
        h.buckets.iter().map(|b| (b.low, b.high)).collect();
    assert_eq!(bounds[0], (Some(0), Some(2)));
    assert_eq!(bounds[3], (Some(8), Some(16)));
    assert_eq!(bounds[5], (Some(32), Some(64)));
    // The mean at the buckets' middles; p50 interpolated in [8, 16): the
    // 11.5th of 23 values is the 8.5th of that bucket's 10.
    assert!((h.mean - 607.0 / 23.0).abs() < 1e-9, "{}", h.mean);
    assert_eq!(h.quantiles[0].q, 0.5);
    assert!(
        (h.quantiles[0].value - 14.8).abs() < 1e-9,
        "{:?}",
        h.quantiles
    );
    let summary = all.summary.as_ref().unwrap();
    assert_eq!(
        (summary.entries_scanned(), summary.entries_matched()),
        (3, 3)
    );
    // One per pid, the largest first, cut at the limit; filtered.
    let per_pid = client
        .histogram(
            &map,
            HistogramOptions::default()
                .with_group_by(["key"])
                .with_limit(2),
        )
        .await
        .unwrap();
    let keys: Vec<Json> = per_pid
        .histograms
        .iter()
        .map(|h| json_of(&h.key.as_ref().unwrap().fields["key"]))
        .collect();
    assert_eq!(keys, [json!(2), json!(1)]);
    // Three histograms, two answered.
    assert_eq!(per_pid.summary.as_ref().unwrap().groups_total(), 3);
    assert_eq!(counts(&per_pid.histograms[0]), [(3, 6), (4, 0), (5, 10)]);
    let filtered = client
        .histogram(&map, HistogramOptions::default().with_filter("key != 2"))
        .await
        .unwrap();
    assert_eq!(
        counts(&filtered.histograms[0]),
        [(0, 1), (1, 2), (2, 0), (3, 4)]
    );
    // By command name, as text.
    let by_comm = client
        .histogram(
            &map,
            HistogramOptions::default().with_group_by(["value.comm"]),
        )
        .await
        .unwrap();
    let comms: Vec<Json> = by_comm
        .histograms
        .iter()
        .map(|h| json_of(&h.key.as_ref().unwrap().fields["value.comm"]))
        .collect();
    assert_eq!(comms, [json!("b"), json!("a"), json!("c")]);
    aggregates_over_the_slots(&client, &map).await;
    histogram_errors_say_what_to_give(&client, &map).await;
    drop(client);
    daemon.stop().await;
}

/// The slots summed (and their largest) element by element per command
/// by AggregateMap: one list per aggregate, groups ordered by the total.
async fn aggregates_over_the_slots(client: &bpfmap_client::Client, map: &MapName) {
    let options = AggregateOptions::default()
        .with_aggregates([Aggregate::sum("value.slots"), Aggregate::max("value.slots")])
        .with_group_by(["value.comm"])
        .with_limit(0);
    let r = client.aggregate(map, options.clone()).await.unwrap();
    let comms: Vec<Json> = r
        .groups()
        .iter()
        .map(|g| json_of(&g.key()["value.comm"]))
        .collect();
    assert_eq!(comms, [json!("b"), json!("a"), json!("c")]);
    let b = &r.groups()[0];
    let mut want = vec![Some(0); SLOTS];
    (want[3], want[5]) = (Some(6), Some(10));
    assert_eq!(b.elements(0), want.as_slice());
    assert_eq!(b.values()[0], Some(16));
    assert_eq!(b.elements(1)[5], Some(10));
    assert_eq!(b.values()[1], Some(10));
    // Over the whole map, the smallest first, cut at the limit.
    let whole = client
        .aggregate(
            map,
            AggregateOptions::default().with_aggregate(Aggregate::sum("value.slots")),
        )
        .await
        .unwrap();
    let mut sums = vec![Some(0); SLOTS];
    (sums[0], sums[1], sums[3], sums[5]) = (Some(1), Some(2), Some(10), Some(10));
    assert_eq!(whole.groups()[0].elements(0), sums.as_slice());
    let last = client
        .aggregate(map, options.with_ascending(true).with_limit(1))
        .await
        .unwrap();
    assert_eq!(json_of(&last.groups()[0].key()["value.comm"]), json!("c"));
}

/// Layouts and groups that do not fit: INVALID_ARGUMENT naming them.
async fn histogram_errors_say_what_to_give(client: &bpfmap_client::Client, map: &MapName) {
    let invalid = async |options: HistogramOptions, says: &str| {
        let e = client.histogram(map, options).await.unwrap_err();
        assert_eq!(code_of(&e), Code::InvalidArgument, "{e}");
        assert!(e.to_string().contains(says), "{says:?} not in {e}");
    };
    invalid(
        HistogramOptions::default().with_layout(HistogramLayout::log2().with_slots("value.comm")),
        "value.comm is char[16], not an array of integers",
    )
    .await;
    invalid(
        HistogramOptions::default().with_layout(HistogramLayout::log2().with_slots("value.nope")),
        "layout.slots",
    )
    .await;
    invalid(
        HistogramOptions::default().with_group_by(["value.slots"]),
        "the histogram's buckets are not a group",
    )
    .await;
    invalid(
        HistogramOptions::default().with_layout(HistogramLayout::linear(0, 0)),
        "step >= 1",
    )
    .await;
    invalid(
        HistogramOptions::default()
            .with_layout(HistogramLayout::bpftrace_log2().with_bucket("value.slots[3]")),
        "value.slots[3] is not in the key",
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn libbpf_histograms_are_drawn_by_bpfmapctl_as_the_tools_draw_them() {
    let (fs, _state, daemon, _client) = setup().await;
    let _map = hist_map(&fs, "hists", &THREE);
    let addr = daemon.addr();
    let (r, out, err) = ctl(&[
        "--addr", &addr, "--format", "table", "hist", "hists", "--hist", "log2", "--unit", "usecs",
    ])
    .await;
    assert!(r.is_ok(), "{r:?} {err}");
    let bar = |n: usize| format!("|{}{}|", "*".repeat(n), " ".repeat(40 - n));
    let row = |lo: u64, hi: u64, c: u64, stars: usize| {
        format!("{lo:>10} -> {hi:<10} : {c:<8} {}", bar(stars))
    };
    let want = [
        "     usecs               : count    distribution".to_owned(),
        row(0, 1, 1, 4),
        row(2, 3, 2, 8),
        row(4, 7, 0, 0),
        row(8, 15, 10, 40),
        row(16, 31, 0, 0),
        row(32, 63, 10, 40),
        "count 23  mean 26.391  p50 14.800  p90 56.640  p99 63.264".to_owned(),
    ];
    assert_eq!(out.lines().collect::<Vec<_>>(), want, "{out}");
    // As data: one JSON line per histogram, by group.
    let (r, out, err) = ctl(&[
        "--addr",
        &addr,
        "--format",
        "json",
        "hist",
        "hists",
        "--group-by",
        "value.comm",
        "-n",
        "2",
    ])
    .await;
    assert!(r.is_ok(), "{r:?} {err}");
    let lines = json_lines(&out);
    assert_eq!(lines.len(), 2, "{out}");
    assert_eq!(lines[0]["key"], json!({"value.comm": "b"}));
    assert_eq!(lines[0]["layout"], "log2");
    assert_eq!(lines[0]["count"], 16);
    assert_eq!(
        lines[0]["buckets"],
        json!([
            {"index": 3, "low": 8, "high": 16, "count": 6},
            {"index": 4, "low": 16, "high": 32, "count": 0},
            {"index": 5, "low": 32, "high": 64, "count": 10},
        ])
    );
    for q in ["p50", "p90", "p99"] {
        assert!(lines[0][q].is_f64(), "{q}: {out}");
    }
    // A command line that cannot be right is a usage error (exit 2).
    let (r, _, _) = ctl(&["--addr", &addr, "hist", "hists", "--hist", "linear"]).await;
    let e = r.unwrap_err();
    assert!(e.is::<bpfmapctl::Usage>(), "{e}");
    assert!(e.to_string().contains("needs --step"), "{e}");
    let (r, _, _) = ctl(&["--addr", &addr, "hist", "hists", "--hist", "log10"]).await;
    assert!(r.unwrap_err().to_string().contains("bpftrace-log2"));
    let (r, _, _) = ctl(&["--addr", &addr, "hist", "hists", "--slots", "value.comm"]).await;
    let e = r.unwrap_err();
    assert!(e.is::<bpfmapctl::Usage>(), "{e}");
    assert!(e.to_string().contains("not an array of integers"), "{e}");
    daemon.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bpftrace_hist_and_lhist_maps_are_read_as_bpftrace_prints_them() {
    let (fs, _state, daemon, client) = setup().await;
    // hist(): 5 zeros (over two CPUs), 7 values in [4, 8), one in [1K, 2K).
    let _hist = bpftrace_map(&fs, "hist", &[(1, &[3, 2]), (4, &[7]), (12, &[0, 1])]);
    // lhist(v, 0, 100, 10): one below 0, two in [20, 30), one at 100 or more.
    let _lhist = bpftrace_map(&fs, "lhist", &[(0, &[1]), (3, &[1, 1]), (11, &[1])]);
    // Keys that are pids, not bucket numbers.
    let _pids = bpftrace_map(&fs, "pids", &[(1_000_000, &[1])]);
    let e = client
        .histogram(
            &"pids".parse().unwrap(),
            HistogramOptions::default().with_layout(HistogramLayout::bpftrace_log2()),
        )
        .await
        .unwrap_err();
    assert_eq!(code_of(&e), Code::InvalidArgument);
    assert!(
        e.to_string()
            .contains("key holds 1000000 in an entry: not a bucket number (0 to 4095)"),
        "{e}"
    );
    let hist: MapName = "hist".parse().unwrap();
    // Without types or a declaration it is not a histogram.
    let e = client
        .histogram(&hist, HistogramOptions::default())
        .await
        .unwrap_err();
    assert_eq!(code_of(&e), Code::InvalidArgument);
    assert!(e.to_string().contains("declare its layout"), "{e}");
    let h = client
        .histogram(
            &hist,
            HistogramOptions::default().with_layout(HistogramLayout::bpftrace_log2()),
        )
        .await
        .unwrap();
    let [one] = h.histograms.as_slice() else {
        panic!("{h:?}")
    };
    assert_eq!(one.count, 13);
    assert_eq!(
        (
            one.buckets[0].index,
            one.buckets[0].low,
            one.buckets[0].high,
            one.buckets[0].count
        ),
        (1, Some(0), Some(1), 5)
    );
    assert_eq!(
        one.buckets.last().map(|b| (b.low, b.high)),
        Some((Some(1024), Some(2048)))
    );
    // Drawn as bpftrace draws it.
    let (r, out, err) = ctl(&[
        "--addr",
        &daemon.addr(),
        "--format",
        "table",
        "hist",
        "hist",
        "--hist",
        "bpftrace-log2",
    ])
    .await;
    assert!(r.is_ok(), "{r:?} {err}");
    let lines: Vec<&str> = out.lines().collect();
    let at = |n: usize| format!("|{}{}|", "@".repeat(n), " ".repeat(52 - n));
    assert_eq!(lines[0], format!("{:<16}{:>8} {}", "[0]", 5, at(37)));
    assert_eq!(lines[1], format!("{:<16}{:>8} {}", "[1]", 0, at(0)));
    assert_eq!(lines[3], format!("{:<16}{:>8} {}", "[4, 8)", 7, at(52)));
    assert_eq!(lines[11], format!("{:<16}{:>8} {}", "[1K, 2K)", 1, at(7)));
    assert!(lines[12].starts_with("count 13  mean "), "{out}");
    // lhist through grpcurl: bounds as data, the open ends left out.
    let body = json!({
        "map": {"path": "lhist"},
        "layout": {"buckets": "BPFTRACE_LINEAR", "min": 0, "max": 100, "step": 10},
    });
    let (ok, out, err) = grpcurl(
        &["-plaintext", "-d", &body.to_string()],
        &daemon.running.local_addr().to_string(),
        &["bpfmap.v1.MapService/HistogramMap"],
    )
    .await;
    assert!(ok, "{err}");
    let answer = &json_stream(&out)[0];
    let buckets = answer["histograms"][0]["buckets"].as_array().unwrap();
    assert_eq!(buckets[0], json!({"high": "0", "count": "1"}), "{out}");
    assert_eq!(
        buckets[3],
        json!({"index": 3, "low": "20", "high": "30", "count": "2"})
    );
    assert_eq!(
        buckets[11],
        json!({"index": 11, "low": "100", "count": "1"})
    );
    assert_eq!(answer["histograms"][0]["count"], "4");
    assert_eq!(answer["layout"]["buckets"], "BPFTRACE_LINEAR");
    assert_eq!(answer["layout"]["bucket"], "key");
    drop(client);
    daemon.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn histograms_merge_exactly_over_the_targets_and_name_the_missing() {
    let mut daemons = Vec::new();
    let mut keep = Vec::new();
    for i in 0..3u32 {
        let (fs, state, daemon, _client) = setup().await;
        // Host i: pid 1 counts i+1 in slot 2, pid 7 counts 10 in slot i.
        let slot2 = [(2usize, i + 1)];
        let sloti = [(i as usize, 10u32)];
        let rows = [
            Row {
                pid: 1,
                comm: "a",
                slots: &slot2,
            },
            Row {
                pid: 7,
                comm: "z",
                slots: &sloti,
            },
        ];
        let map = hist_map(&fs, "hists", &rows);
        keep.push((fs, state, map));
        daemons.push(daemon);
    }
    let dead = format!(
        "127.0.0.1:{}",
        bpfmap_tests::fleet::port_free_on(&["127.0.0.1".parse().unwrap()])
    );
    let mut args: Vec<String> = Vec::new();
    for d in &daemons {
        args.extend(["-t".into(), d.running.local_addr().to_string()]);
    }
    let all: Vec<&str> = args.iter().map(String::as_str).collect();
    let mut cmd = all.clone();
    cmd.extend(["--format", "json", "hist", "hists", "--group-by", "key"]);
    let (r, out, err) = ctl(&cmd).await;
    assert!(r.is_ok(), "{r:?} {err}");
    let lines = json_lines(&out);
    // pid 7: 10 in each of slots 0, 1, 2; pid 1: 1 + 2 + 3 in slot 2.
    assert_eq!(lines.len(), 2, "{out}");
    assert_eq!(lines[0]["key"], json!({"key": 7}));
    let buckets = |l: &Json| -> Vec<(u64, u64)> {
        l["buckets"]
            .as_array()
            .unwrap()
            .iter()
            .map(|b| (b["index"].as_u64().unwrap(), b["count"].as_u64().unwrap()))
            .collect()
    };
    assert_eq!(buckets(&lines[0]), [(0, 10), (1, 10), (2, 10)]);
    assert_eq!(lines[1]["key"], json!({"key": 1}));
    assert_eq!(buckets(&lines[1]), [(2, 6)]);
    // The slots summed element by element across the hosts by `top`: the
    // exact top K, ordered by the totals.
    let mut cmd = all.clone();
    cmd.extend([
        "top",
        "hists",
        "--by",
        "sum(value.slots)",
        "--group-by",
        "key",
        "-n",
        "1",
    ]);
    let (r, out, err) = ctl(&cmd).await;
    assert!(r.is_ok(), "{r:?} {err}");
    let top = json_lines(&out);
    assert_eq!(top[0]["key"], json!({"key": 7}));
    let mut want = vec![json!("0"); SLOTS];
    (want[0], want[1], want[2]) = (json!("10"), json!("10"), json!("10"));
    assert_eq!(top[0]["values"]["sum(value.slots)"], json!(want), "{out}");
    // A target that does not answer is named; the others are merged.
    let mut cmd = all.clone();
    cmd.extend(["-t", &dead, "--format", "json", "hist", "hists"]);
    let (r, out, err) = ctl(&cmd).await;
    let e = r.unwrap_err();
    assert!(e.to_string().contains("1 of 4 targets"), "{e}");
    assert!(err.contains(&dead) && err.contains("UNAVAILABLE"), "{err}");
    let merged = json_lines(&out);
    assert_eq!(buckets(&merged[0]), [(0, 10), (1, 10), (2, 16)]);
    // Through the relay: the same sums, the dead target named in-band.
    let relay_state = tempfile::tempdir().unwrap();
    let mut targets: Vec<String> = daemons
        .iter()
        .map(|d| d.running.local_addr().to_string())
        .collect();
    targets.push(dead.clone());
    let relay = bpfmap_relay::Relay::start_on(
        &bpfmap_relay::Config {
            targets: targets.clone(),
            state_dir: relay_state.path().to_owned(),
            answer_timeout: std::time::Duration::from_secs(2),
            ..Default::default()
        },
        tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap(),
    )
    .await
    .expect("the relay starts");
    let relay_addr = format!("http://{}", relay.local_addr());
    let (r, out, err) = ctl(&[
        "--relay",
        &relay_addr,
        "--format",
        "json",
        "hist",
        "hists",
        "--group-by",
        "key",
    ])
    .await;
    let e = r.unwrap_err();
    assert!(e.to_string().contains("1 of 4 targets"), "{e}");
    assert!(err.contains(&dead), "{err}");
    let lines = json_lines(&out);
    assert_eq!(buckets(&lines[0]), [(0, 10), (1, 10), (2, 10)]);
    assert_eq!(buckets(&lines[1]), [(2, 6)]);
    // grpcurl: FleetService/HistogramMap, the failure in-band.
    let body = json!({"request": {"map": {"path": "hists"}}});
    let (ok, out, err) = grpcurl(
        &["-plaintext", "-d", &body.to_string()],
        &relay.local_addr().to_string(),
        &["bpfmap.v1.FleetService/HistogramMap"],
    )
    .await;
    assert!(ok, "{err}");
    let answer = &json_stream(&out)[0];
    assert_eq!(answer["histograms"][0]["count"], "36", "{out}");
    assert_eq!(answer["layout"]["slots"], "value.slots");
    assert_eq!(answer["answered"].as_array().unwrap().len(), 3, "{out}");
    assert_eq!(answer["failed"][0]["target"], json!(dead));
    assert_eq!(
        answer["failed"][0]["status"]["reason"],
        "TARGET_UNREACHABLE"
    );
    // AggregateMap over the slots through the relay: lists merged exactly.
    let body = json!({"request": {"map": {"path": "hists"}, "groupBy": ["key"], "aggregates": [{"op": "SUM", "field": "value.slots"}]}});
    let (ok, out, err) = grpcurl(
        &["-plaintext", "-d", &body.to_string()],
        &relay.local_addr().to_string(),
        &["bpfmap.v1.FleetService/AggregateMap"],
    )
    .await;
    assert!(ok, "{err}");
    let answer = &json_stream(&out)[0];
    assert_eq!(
        answer["groups"][0]["group"]["values"][0],
        json!(want),
        "{out}"
    );
    assert_eq!(answer["groups"][1]["group"]["values"][0][2], "6", "{out}");
    relay.stop().await.unwrap();
    for d in daemons {
        d.stop().await;
    }
}

/// The counts of runqlat's `hists` from bpftool: slot to count, summed
/// over its entries.
fn bpftool_slots(id: u32) -> BTreeMap<u32, u64> {
    let mut out = BTreeMap::new();
    for e in bpftool(&["map", "dump", "id", &id.to_string()])
        .as_array()
        .unwrap()
    {
        let slots = e["formatted"]["value"]["slots"]
            .as_array()
            .unwrap_or_else(|| panic!("bpftool shows no slots: {e}"));
        for (i, c) in slots.iter().enumerate() {
            *out.entry(i as u32).or_insert(0) += c.as_u64().unwrap();
        }
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn runqlat_and_bpftrace_histograms_match_bpftool() {
    let runqlat = require("runqlat", "libbpf-tools");
    let bpftrace = require("bpftrace", "bpftrace");
    mount_tracefs();
    let rq = Program::start(&runqlat, &["60", "2"], &[]);
    let bt = Program::start(
        &bpftrace,
        &[
            "-e",
            "tracepoint:raw_syscalls:sys_exit { @ret = hist(args->ret); }",
        ],
        &[],
    );
    let (fs, state) = (BpfFs::new(), tempfile::tempdir().unwrap());
    let daemon = Daemon::start_with(bpfmapd::Config {
        allow_by_id: true,
        ..Daemon::config(fs.path(), state.path())
    })
    .await;
    let client = daemon.client().await;
    let name = format!("name:hists@{}", rq.pid());
    let map: MapName = name.parse().unwrap();
    let info = wait_for(
        std::time::Duration::from_secs(30),
        "runqlat's hists",
        async || client.get_map(&map).await.ok(),
    )
    .await;
    // runqlat counts as the test runs: bpftool before <= ours <= bpftool after.
    let counted = |c: &BTreeMap<u32, u64>| c.values().sum::<u64>();
    let before = wait_for(
        std::time::Duration::from_secs(30),
        "runqlat to count",
        async || {
            let c = bpftool_slots(info.id());
            (counted(&c) > 0).then_some(c)
        },
    )
    .await;
    let ours = client
        .histogram(&map, HistogramOptions::default())
        .await
        .unwrap();
    let after = bpftool_slots(info.id());
    assert_eq!(ours.layout.as_proto().slots, "value.slots");
    let h = &ours.histograms[0];
    for b in &h.buckets {
        let (lo, hi) = (before.get(&b.index).copied().unwrap_or(0), after[&b.index]);
        assert!(
            lo <= b.count && b.count <= hi,
            "slot {}: {lo} <= {} <= {hi}",
            b.index,
            b.count
        );
    }
    assert!(h.count >= counted(&before) && h.count <= counted(&after));
    // Drawn as runqlat draws it (usecs, 0 -> 1 first).
    let (r, out, err) = ctl(&[
        "--addr",
        &daemon.addr(),
        "--format",
        "table",
        "hist",
        &name,
        "--unit",
        "usecs",
        "--hist",
        "log2",
    ])
    .await;
    assert!(r.is_ok(), "{r:?} {err}");
    assert!(
        out.starts_with(
            "     usecs               : count    distribution\n         0 -> 1          : "
        ),
        "{out}"
    );
    // bpftrace's @ret: keyed by bucket, per-CPU; declared.
    let ret = format!("name:AT_ret@{}", bt.pid());
    let ret_map: MapName = ret.parse().unwrap();
    let info = wait_for(
        std::time::Duration::from_secs(30),
        "bpftrace's @ret",
        async || client.get_map(&ret_map).await.ok(),
    )
    .await;
    let bpftool_buckets = || -> BTreeMap<u32, u64> {
        bpftool(&["map", "dump", "id", &info.id().to_string()])
            .as_array()
            .unwrap()
            .iter()
            .map(|e| {
                let key = e["key"].as_array().unwrap();
                let k = u8::from_str_radix(key[0].as_str().unwrap().trim_start_matches("0x"), 16)
                    .unwrap();
                let sum: u64 = e["values"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|v| {
                        let b: Vec<u8> = v["value"]
                            .as_array()
                            .unwrap()
                            .iter()
                            .map(|x| {
                                u8::from_str_radix(x.as_str().unwrap().trim_start_matches("0x"), 16)
                                    .unwrap()
                            })
                            .collect();
                        u64::from_le_bytes(b[..8].try_into().unwrap())
                    })
                    .sum();
                (u32::from(k), sum)
            })
            .collect()
    };
    let before = wait_for(
        std::time::Duration::from_secs(30),
        "bpftrace to count",
        async || {
            let c = bpftool_buckets();
            (!c.is_empty()).then_some(c)
        },
    )
    .await;
    let ours = client
        .histogram(
            &ret_map,
            HistogramOptions::default().with_layout(HistogramLayout::bpftrace_log2()),
        )
        .await
        .unwrap();
    let after = bpftool_buckets();
    for b in &ours.histograms[0].buckets {
        let (lo, hi) = (
            before.get(&b.index).copied().unwrap_or(0),
            after.get(&b.index).copied().unwrap_or(0),
        );
        assert!(
            lo <= b.count && b.count <= hi,
            "bucket {}: {lo} <= {} <= {hi}",
            b.index,
            b.count
        );
    }
    // Syscalls that fail return below 0: bucket 0, drawn as bpftrace does.
    let (r, out, err) = ctl(&[
        "--addr",
        &daemon.addr(),
        "--format",
        "table",
        "hist",
        &ret,
        "--hist",
        "bpftrace-log2",
    ])
    .await;
    assert!(r.is_ok(), "{r:?} {err}");
    assert!(out.lines().any(|l| l.starts_with("[0]")), "{out}");
    drop((rq, bt));
    drop(client);
    daemon.stop().await;
}

/// Seeks a file from a thread named `bpfmap-lseek` (what the script
/// below filters on), each (whence, offset) once; the negative and odd
/// ones fail, but their syscall is traced all the same.
fn seeks(calls: &[(u8, i64)]) {
    use std::io::{Seek as _, SeekFrom};
    let calls = calls.to_vec();
    std::thread::Builder::new()
        .name("bpfmap-lseek".into())
        .spawn(move || {
            let mut f = std::fs::File::open("/proc/self/exe").unwrap();
            for (whence, offset) in calls {
                let _ = f.seek(match whence {
                    0 => SeekFrom::Start(offset as u64),
                    1 => SeekFrom::Current(offset),
                    _ => SeekFrom::End(offset),
                });
            }
        })
        .unwrap()
        .join()
        .unwrap();
}

/// bpftrace's printed maps: each `@name` to its lines, in order.
fn printed_maps(text: &str) -> BTreeMap<String, Vec<String>> {
    let mut maps: BTreeMap<String, Vec<String>> = BTreeMap::new();
    // Histograms' headers (`@h: `) are left out: their drawings follow.
    for line in text
        .lines()
        .filter(|l| l.starts_with('@') && !l.ends_with(": "))
    {
        let name = line.split(['[', ':']).next().unwrap().to_owned();
        maps.entry(name).or_default().push(line.to_owned());
    }
    maps
}

/// The values of printed lines, in order (bpftrace orders ties as its
/// hash map iterates; values must come in the same order).
fn printed_values(lines: &[String]) -> Vec<String> {
    lines
        .iter()
        .map(|l| {
            l.rsplit_once("]: ")
                .or(l.split_once(": "))
                .unwrap()
                .1
                .to_owned()
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bpftrace_aggregations_print_as_bpftrace_prints_them() {
    let bpftrace = require("bpftrace", "bpftrace");
    mount_tracefs();
    let script = "tracepoint:syscalls:sys_enter_lseek /comm == \"bpfmap-lseek\"/ { \
        @c[args->whence] = count(); @s[args->whence] = sum(args->offset); \
        @mn[args->whence] = min(args->offset); @mx[args->whence] = max(args->offset); \
        @av[args->whence] = avg(args->offset); @st[args->whence] = stats(args->offset); \
        @bycomm[comm] = count(); @all = stats(args->offset); @least = min(args->offset); \
        @h = hist(args->offset); @l = lhist(args->offset, 0, 400, 100); \
        @hk[comm] = hist(args->offset); }";
    let mut bt = Program::start(&bpftrace, &["-e", script], &[]);
    let (fs, state) = (BpfFs::new(), tempfile::tempdir().unwrap());
    let daemon = Daemon::start_with(bpfmapd::Config {
        allow_by_id: true,
        ..Daemon::config(fs.path(), state.path())
    })
    .await;
    let client = daemon.client().await;
    let map = |name: &str| format!("name:AT_{name}@{}", bt.pid());
    // Seek until the probe counts (it attaches after its maps exist).
    let all: MapName = map("all").parse().unwrap();
    wait_for(
        std::time::Duration::from_secs(30),
        "bpftrace to count seeks",
        async || {
            seeks(&[(0, 1)]);
            let m = client
                .bpftrace(
                    &all,
                    bpfmap_client::bpftrace::BpftraceOptions::new(
                        bpfmap_client::bpftrace::Function::Stats,
                    ),
                )
                .await
                .ok()?;
            (!m.entries.is_empty()).then_some(())
        },
    )
    .await;
    seeks(&[
        (0, 5),
        (0, 300),
        (1, -3),
        (1, 9),
        (1, -20),
        (2, -5_000_000_000),
        (2, 6_000_000_000),
        (2, -7),
    ]);
    let addr = daemon.addr();
    let read = async |name: &str, extra: &[&str]| {
        let m = map(name);
        let mut args = vec!["--addr", &addr, "--format", "table", "bpftrace", &m];
        args.extend_from_slice(extra);
        let (r, out, err) = ctl(&args).await;
        assert!(r.is_ok(), "{name} {extra:?}: {r:?} {err}");
        out
    };
    // The daemon reads the functions and the key types in the script.
    let mut ours = String::new();
    for name in ["c", "s", "mn", "mx", "av", "st", "all", "least", "bycomm"] {
        ours.push_str(&read(name, &[]).await);
    }
    let info = client
        .get_map(&map("bycomm").parse().unwrap())
        .await
        .unwrap();
    let script = info.as_proto().bpftrace.clone().unwrap();
    assert_eq!(
        (
            script.function.as_str(),
            script.key.as_str(),
            script.key_type.as_str()
        ),
        ("count", "comm", "char[16]")
    );
    // Named by hand, the same.
    assert_eq!(
        read("bycomm", &["--key-type", "char[16]", "--as", "count"]).await,
        read("bycomm", &[]).await
    );
    // hist() and lhist() maps are histograms: drawn by `hist` without
    // declaring their buckets (lhist's bounds from the script).
    let (r, _, _) = ctl(&["--addr", &addr, "bpftrace", &map("h")]).await;
    let e = r.unwrap_err().to_string();
    assert!(e.contains("hist() map: draw it with bpfmapctl hist"), "{e}");
    let drawn = async |name: &str| {
        let (r, out, err) = ctl(&["--addr", &addr, "--format", "table", "hist", &map(name)]).await;
        assert!(r.is_ok(), "{name}: {r:?} {err}");
        out
    };
    let h = drawn("h").await;
    let l = drawn("l").await;
    // Keyed by comm: one histogram per key, the key declared from the
    // script.
    let hk = drawn("hk").await;
    assert!(hk.starts_with("key.comm = bpfmap-lseek\n"), "{hk}");
    // JSON: one object per key, exact.
    let (r, out, _) = ctl(&[
        "--addr",
        &addr,
        "--format",
        "json",
        "bpftrace",
        &map("st"),
        "--as",
        "stats",
    ])
    .await;
    assert!(r.is_ok(), "{r:?}");
    let rows: Vec<Json> = out
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert!(
        rows.contains(&json!({"map": "@st", "key": "2", "count": "3", "average": "333333331", "total": "999999993"})),
        "{out}"
    );
    // Two targets reading the same map merge as bpftrace merges CPUs.
    let (r, twice, err) = ctl(&[
        "--target",
        &addr,
        "--target",
        &addr,
        "--format",
        "table",
        "bpftrace",
        &map("mn"),
        "--as",
        "min",
    ])
    .await;
    assert!(r.is_ok(), "{r:?} {err}");
    // A key type that does not fit, and an unknown function, are said.
    let (r, _, _) = ctl(&[
        "--addr",
        &addr,
        "--key-type",
        "__u32",
        "bpftrace",
        &map("c"),
        "--as",
        "count",
    ])
    .await;
    let e = r.unwrap_err().to_string();
    assert!(e.contains("4 bytes; the map's keys are 8 bytes"), "{e}");
    let (r, _, _) = ctl(&["--addr", &addr, "bpftrace", &map("c"), "--as", "median"]).await;
    let e = r.unwrap_err().to_string();
    assert!(e.contains("count, sum, min, max, avg or stats"), "{e}");

    // bpftrace prints the same maps when interrupted.
    let theirs = printed_maps(&bt.interrupt());
    let ours = printed_maps(&ours);
    assert_eq!(
        ours.keys().collect::<Vec<_>>(),
        theirs.keys().collect::<Vec<_>>(),
        "ours:\n{ours:?}\ntheirs:\n{theirs:?}"
    );
    for (name, lines) in &theirs {
        let (mut a, mut b) = (ours[name].clone(), lines.clone());
        assert_eq!(printed_values(&a), printed_values(&b), "{name}");
        a.sort();
        b.sort();
        assert_eq!(a, b, "{name}");
    }
    // What the test wrote, as bpftrace printed it.
    for line in [
        "@mn[1]: -20",
        "@mn[2]: -5000000000",
        "@mx[2]: 6000000000",
        "@st[1]: count 3, average -4, total -14",
        "@least: -5000000000",
        "@bycomm[bpfmap-lseek]: ",
    ] {
        assert!(
            theirs.values().flatten().any(|l| l.starts_with(line)),
            "{line}: {theirs:?}"
        );
    }
    assert_eq!(
        twice.lines().collect::<Vec<_>>(),
        ours["@mn"],
        "a min over two targets"
    );
    // The histograms as bpftrace drew them.
    let drawing = |text: &str| -> Vec<String> {
        text.lines()
            .filter(|l| l.starts_with(['[', '(']))
            .map(str::to_owned)
            .collect()
    };
    let theirs_text = bt.output();
    let section = |name: &str| {
        let from = theirs_text.find(&format!("{name}: \n")).unwrap();
        let rest = &theirs_text[from..];
        let end = rest.find("\n\n").unwrap_or(rest.len());
        drawing(&rest[..end])
    };
    assert_eq!(drawing(&h), section("@h"), "hist()");
    assert_eq!(drawing(&l), section("@l"), "lhist()");
    assert_eq!(drawing(&hk), section("@hk[bpfmap-lseek]"), "hist() keyed");
    drop(client);
    daemon.stop().await;
}
