//! Queries evaluated in the daemon, against real kernel maps with BTF:
//! filtered dumps (exactly the entries a brute force over the full dump
//! selects), `limit` counting matches, projections in both layouts,
//! filtered cursors across a restart and bound to their query,
//! AggregateMap against the same brute force, the policy's `aggregate`,
//! hostile expressions, and grpcurl on the demo.

use std::{
    collections::{BTreeMap, BTreeSet},
    time::{Duration, Instant},
};

use bpfmap_kernel::{BtfBuilder, CreateMap, OwnedBtf};
use bpfmap_proto::{
    typed::Layout,
    v1::{self as pb, aggregate::Op, map_service_client::MapServiceClient},
};
use bpfmap_tests::*;
use serde_json::{Value as Json, json};
use tonic::{Code, transport::Channel};
use tonic_types::StatusExt as _;

/// One flow as the brute force sees it.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
struct Flow {
    saddr: u32,
    daddr: u32,
    sport: u16,
    dport: u16,
    proto: u8,
    /// Per CPU for per-CPU maps (one element otherwise): packets, bytes.
    cpus: Vec<(u64, u64)>,
}

impl Flow {
    /// Flow `i`: daddr i % 250, dport 80, 443 or 53, UDP when i % 4 == 3;
    /// on CPU c: packets i + c + 1, bytes (i + c + 1) * 1500.
    fn nth(i: u32, cpus: usize) -> Self {
        Self {
            saddr: 0x0A00_0000 | i,
            daddr: i % 250,
            sport: 1024 + (i % 60_000) as u16,
            dport: [80, 443, 53][i as usize % 3],
            proto: if i % 4 == 3 { 17 } else { 6 },
            cpus: (0..cpus as u64)
                .map(|c| {
                    let p = u64::from(i) + c + 1;
                    (p, p * 1500)
                })
                .collect(),
        }
    }

    fn key(&self) -> Vec<u8> {
        let mut k = Vec::with_capacity(16);
        k.extend_from_slice(&self.saddr.to_le_bytes());
        k.extend_from_slice(&self.daddr.to_le_bytes());
        k.extend_from_slice(&self.sport.to_le_bytes());
        k.extend_from_slice(&self.dport.to_le_bytes());
        k.extend_from_slice(&[self.proto, 0, 0, 0]);
        k
    }

    fn value(&self) -> Vec<u8> {
        let mut v = Vec::new();
        for (p, b) in &self.cpus {
            v.extend_from_slice(&p.to_le_bytes());
            v.extend_from_slice(&b.to_le_bytes());
        }
        v
    }

    fn parse(key: &[u8], value: &[u8]) -> Self {
        let u16_at = |o: usize| u16::from_le_bytes([key[o], key[o + 1]]);
        let u32_at = |o: usize| u32::from_le_bytes(key[o..o + 4].try_into().unwrap());
        let u64_at = |o: usize| u64::from_le_bytes(value[o..o + 8].try_into().unwrap());
        Self {
            saddr: u32_at(0),
            daddr: u32_at(4),
            sport: u16_at(8),
            dport: u16_at(10),
            proto: key[12],
            cpus: (0..value.len() / 16)
                .map(|c| (u64_at(16 * c), u64_at(16 * c + 8)))
                .collect(),
        }
    }

    fn packets(&self) -> u64 {
        self.cpus.iter().map(|c| c.0).sum()
    }

    fn bytes(&self) -> u64 {
        self.cpus.iter().map(|c| c.1).sum()
    }
}

/// A map of `n` flows of `map_type` with the demo's types, pinned at `rel`.
fn flows_map(fs: &BpfFs, rel: &str, map_type: MapType, n: u32) -> OwnedMap {
    let mut b = BtfBuilder::new();
    let (key, value) = bpfmapd::flow_types(&mut b);
    let btf = OwnedBtf::load(&b.to_bytes()).unwrap_or_else(|e| panic!("BPF_BTF_LOAD: {e}"));
    let map = OwnedMap::create(&CreateMap {
        map_type: map_type.0,
        key_size: 16,
        value_size: 16,
        max_entries: n.max(1),
        name: "flows",
        btf: Some(btf.for_map(key, value)),
        ..Default::default()
    })
    .unwrap_or_else(|e| panic!("BPF_MAP_CREATE with BTF: {e}"));
    let cpus = cpus_of(map_type);
    let (mut keys, mut values) = (Vec::new(), Vec::new());
    for i in 0..n {
        let f = Flow::nth(i, cpus);
        keys.extend(f.key());
        values.extend(f.value());
    }
    if n > 0 {
        update_batch(&map, &keys, &values);
    }
    fs.pin(&map, rel);
    map
}

fn cpus_of(map_type: MapType) -> usize {
    if map_type == MapType::PERCPU_HASH {
        bpfmap_kernel::possible_cpus() as usize
    } else {
        1
    }
}

fn dump_request(path: &str, filter: &str, fields: &[&str], packed: bool) -> pb::DumpMapRequest {
    pb::DumpMapRequest {
        map: map_ref(path),
        filter: filter.into(),
        fields: fields.iter().map(|s| s.to_string()).collect(),
        layout: if packed {
            pb::Layout::Packed as i32
        } else {
            pb::Layout::Entries as i32
        },
        ..Default::default()
    }
}

/// What one DumpMap call sent.
#[derive(Debug, Default)]
struct Dumped {
    /// Keys and values (per-CPU values back to back), in order.
    entries: Vec<(Vec<u8>, Vec<u8>)>,
    /// The decoded key and value of each entry (entries layout).
    decoded: Vec<(Json, Json)>,
    summary: pb::DumpSummary,
    projection: Option<pb::Projection>,
    cursor: String,
    messages: usize,
}

/// One DumpMap call to its end.
async fn dump(c: &mut Grpc, req: pb::DumpMapRequest) -> Result<Dumped, tonic::Status> {
    let mut stream = c.dump_map(req).await?.into_inner();
    let mut d = Dumped::default();
    while let Some(m) = stream.message().await? {
        d.messages += 1;
        if d.projection.is_none() {
            d.projection = m.projection;
        }
        if let Some(p) = &m.packed {
            let (ks, vs) = (p.key_size as usize, p.value_stride as usize);
            for i in 0..p.count as usize {
                let k = p.keys[i * ks..(i + 1) * ks].to_vec();
                d.entries.push((k, p.values[i * vs..(i + 1) * vs].to_vec()));
            }
        }
        for e in m.entries {
            let value = if e.per_cpu_values.is_empty() {
                e.value.clone()
            } else {
                e.per_cpu_values.concat()
            };
            let decoded = |v: &Option<prost_types::Value>| v.as_ref().map_or(Json::Null, json_of);
            d.decoded
                .push((decoded(&e.decoded_key), decoded(&e.decoded_value)));
            d.entries.push((e.key, value));
        }
        d.cursor = m.cursor;
        if m.done {
            d.summary = m.summary.unwrap_or_default();
        }
    }
    Ok(d)
}

/// The whole map, unfiltered, as flows.
async fn all_flows(c: &mut Grpc, path: &str) -> Vec<Flow> {
    let d = dump(c, dump_request(path, "", &[], true)).await.unwrap();
    d.entries.iter().map(|(k, v)| Flow::parse(k, v)).collect()
}

fn flows_of(d: &Dumped) -> BTreeSet<Flow> {
    d.entries.iter().map(|(k, v)| Flow::parse(k, v)).collect()
}

/// The reason of an error status.
fn reason(s: &tonic::Status) -> String {
    s.get_details_error_info()
        .map(|i| i.reason)
        .unwrap_or_default()
}

/// Filters and what they select, as Rust says it.
type Case = (&'static str, fn(&Flow) -> bool);

fn cases() -> Vec<Case> {
    vec![
        ("key.dport == 443 && value.bytes > 15000000", |f| {
            f.dport == 443 && f.bytes() > 15_000_000
        }),
        ("key.proto == \"IPPROTO_UDP\"", |f| f.proto == 17),
        ("key.saddr % 100 == 7 || key.daddr in [3, 5, 249]", |f| {
            f.saddr % 100 == 7 || [3, 5, 249].contains(&f.daddr)
        }),
        (
            "key.proto != \"IPPROTO_UDP\" ? key.sport < 2000 : value.packets >= 9990",
            |f| {
                if f.proto != 17 {
                    f.sport < 2000
                } else {
                    f.packets() >= 9990
                }
            },
        ),
        ("key.dport == 1", |_| false),
        ("key.sport >= 0", |_| true),
    ]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn filtered_dumps_send_exactly_the_entries_a_brute_force_selects() {
    let (fs, _state, daemon, _client) = setup().await;
    let _map = flows_map(&fs, "flows", MapType::HASH, 10_000);
    let mut c = grpc(&daemon.addr()).await;
    let all = all_flows(&mut c, "flows").await;
    assert_eq!(all.len(), 10_000);
    for (filter, pick) in cases() {
        let want: BTreeSet<Flow> = all.iter().filter(|f| pick(f)).cloned().collect();
        for packed in [true, false] {
            let d = dump(&mut c, dump_request("flows", filter, &[], packed))
                .await
                .unwrap_or_else(|e| panic!("{filter}: {e}"));
            assert_eq!(d.entries.len(), want.len(), "{filter} (packed: {packed})");
            assert_eq!(flows_of(&d), want, "{filter} (packed: {packed})");
            let s = &d.summary;
            assert_eq!(
                (s.entries, s.entries_scanned, s.complete),
                (want.len() as u64, 10_000, true),
                "{filter} (packed: {packed}): summary {s:?}"
            );
        }
    }
}

/// Calls of `limit` matches each, every one resuming from the last cursor:
/// the entries of all calls, and the calls' summaries.
async fn dump_in_calls(
    c: &mut Grpc,
    req: &pb::DumpMapRequest,
    limit: u64,
) -> (Vec<Flow>, Vec<pb::DumpSummary>) {
    let (mut flows, mut summaries) = (Vec::new(), Vec::new());
    let mut cursor = String::new();
    loop {
        let call = pb::DumpMapRequest {
            limit,
            cursor: cursor.clone(),
            ..req.clone()
        };
        let d = tokio::time::timeout(Duration::from_secs(20), dump(c, call))
            .await
            .unwrap_or_else(|_| panic!("call {} with limit {limit} hangs", summaries.len()))
            .unwrap();
        flows.extend(d.entries.iter().map(|(k, v)| Flow::parse(k, v)));
        let done = d.summary.complete;
        summaries.push(d.summary);
        cursor = d.cursor;
        if done {
            return (flows, summaries);
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn limit_counts_matches_and_each_entry_is_scanned_once_across_calls() {
    let (fs, _state, daemon, _client) = setup().await;
    let _map = flows_map(&fs, "flows", MapType::HASH, 10_000);
    let mut c = grpc(&daemon.addr()).await;
    let all = all_flows(&mut c, "flows").await;
    let filter = "key.proto == \"IPPROTO_UDP\" && key.dport == 443";
    let want: BTreeSet<Flow> = all
        .iter()
        .filter(|f| f.proto == 17 && f.dport == 443)
        .cloned()
        .collect();
    for (limit, packed) in [(37, true), (100, false), (1, true)] {
        let req = dump_request("flows", filter, &[], packed);
        let (flows, summaries) = dump_in_calls(&mut c, &req, limit).await;
        let got: BTreeSet<Flow> = flows.iter().cloned().collect();
        assert_eq!(
            got.len(),
            flows.len(),
            "limit {limit}: an entry delivered twice"
        );
        assert_eq!(got, want, "limit {limit}");
        let scanned: u64 = summaries.iter().map(|s| s.entries_scanned).sum();
        assert_eq!(
            scanned, 10_000,
            "limit {limit}: entries scanned in all calls"
        );
        for s in &summaries[..summaries.len() - 1] {
            // A hash bucket is never split: a call may take more when the
            // first bucket it reads holds more matches.
            assert!(
                s.entries >= limit && s.entries <= limit + 8,
                "limit {limit}: a call sent {}",
                s.entries
            );
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_limit_of_one_on_colliding_hash_buckets_moves_on() {
    // 4,000 entries in a hash sized for them: buckets of two and three
    // entries are common, and every entry matches.
    let (fs, _state, daemon, _client) = setup().await;
    let _map = flows_map(&fs, "flows", MapType::HASH, 4_000);
    let mut c = grpc(&daemon.addr()).await;
    let req = dump_request("flows", "value.packets > 0", &[], true);
    let (flows, summaries) = dump_in_calls(&mut c, &req, 1).await;
    let got: BTreeSet<Flow> = flows.iter().cloned().collect();
    assert_eq!((flows.len(), got.len()), (4_000, 4_000));
    assert!(
        summaries.iter().any(|s| s.entries > 1),
        "no bucket of two entries in {} calls",
        summaries.len()
    );
}

/// Decodes a packed record through a projection type, as JSON.
fn decode(t: &Option<pb::TypeInfo>, bytes: &[u8], what: &str) -> Json {
    let t = t.as_ref().unwrap_or_else(|| panic!("no {what} type"));
    let layout = Layout::new(t, what).unwrap_or_else(|e| panic!("{what} type: {e}"));
    assert_eq!(layout.size(), bytes.len(), "{what} record size");
    let mut out = Vec::new();
    layout.write_json(bytes, &mut out);
    serde_json::from_slice(&out).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn projections_send_only_the_fields_in_both_layouts() {
    let (fs, _state, daemon, _client) = setup().await;
    let _map = flows_map(&fs, "flows", MapType::HASH, 2_000);
    let mut c = grpc(&daemon.addr()).await;
    let filter = "key.daddr == 7";
    let fields = ["value.bytes", "key.daddr", "key.proto"];
    let want: BTreeSet<String> = all_flows(&mut c, "flows")
        .await
        .iter()
        .filter(|f| f.daddr == 7)
        .map(|f| {
            let proto = if f.proto == 17 {
                "IPPROTO_UDP"
            } else {
                "IPPROTO_TCP"
            };
            json!([{"daddr": 7, "proto": proto}, {"bytes": f.bytes().to_string()}]).to_string()
        })
        .collect();
    assert_eq!(want.len(), 8);
    let packed = dump(&mut c, dump_request("flows", filter, &fields, true))
        .await
        .unwrap();
    let p = packed
        .projection
        .clone()
        .expect("the first message describes the projection");
    let got: BTreeSet<String> = packed
        .entries
        .iter()
        .map(|(k, v)| {
            json!([
                decode(&p.key_type, k, "key"),
                decode(&p.value_type, v, "value")
            ])
            .to_string()
        })
        .collect();
    assert_eq!(
        got, want,
        "packed records through DumpMapResponse.projection"
    );
    assert_eq!(
        packed.entries[0].0.len(),
        4 + 1,
        "a key record: daddr, proto"
    );
    let entries = dump(&mut c, dump_request("flows", filter, &fields, false))
        .await
        .unwrap();
    let got: BTreeSet<String> = entries
        .decoded
        .iter()
        .map(|(k, v)| json!([k, v]).to_string())
        .collect();
    assert_eq!(got, want, "decoded entries hold only the fields");
    assert!(
        entries
            .entries
            .iter()
            .all(|(k, v)| k.is_empty() && v.is_empty()),
        "raw key and value bytes are left out"
    );
    assert!(entries.projection.is_some());
    // A projected member keeps its rendering, and the filter takes its
    // rendered spelling: daddr 7 holds the bytes 07 00 00 00.
    let mut rendered = dump_request("flows", r#"key.daddr == "7.0.0.0""#, &fields, false);
    rendered.render.insert("key.daddr".into(), "ipv4".into());
    let entries = dump(&mut c, rendered).await.unwrap();
    let got: BTreeSet<String> = entries
        .decoded
        .iter()
        .map(|(k, v)| json!([k, v]).to_string())
        .collect();
    let want: BTreeSet<String> = want
        .iter()
        .map(|w| w.replace(r#""daddr":7"#, r#""daddr":"7.0.0.0""#))
        .collect();
    assert_eq!(got, want, "projected members keep their renderings");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn per_cpu_maps_filter_and_project_on_sums_and_single_cpus() {
    let (fs, _state, daemon, _client) = setup().await;
    let _map = flows_map(&fs, "pc", MapType::PERCPU_HASH, 1_000);
    let cpus = cpus_of(MapType::PERCPU_HASH) as u64;
    let mut c = grpc(&daemon.addr()).await;
    let all = all_flows(&mut c, "pc").await;
    assert_eq!(all[0].cpus.len() as u64, cpus);
    // Sum of packets over the CPUs: cpus * (i + 1) + cpus * (cpus - 1) / 2.
    let bound = 500 * cpus;
    let filter = format!("value.packets > {bound} && values[0].packets % 2 == 0");
    let want: BTreeSet<Flow> = all
        .iter()
        .filter(|f| f.packets() > bound && f.cpus[0].0 % 2 == 0)
        .cloned()
        .collect();
    assert!(!want.is_empty());
    for packed in [true, false] {
        let d = dump(&mut c, dump_request("pc", &filter, &[], packed))
            .await
            .unwrap();
        assert_eq!(flows_of(&d), want, "{filter} (packed: {packed})");
    }
    let last = format!("values[{}].bytes", cpus - 1);
    let d = dump(
        &mut c,
        dump_request("pc", &filter, &["value.bytes", &last], true),
    )
    .await
    .unwrap();
    let p = d.projection.unwrap();
    assert!(p.key_type.is_none(), "no key member selected");
    let got: BTreeSet<String> = d
        .entries
        .iter()
        .map(|(_, v)| decode(&p.value_type, v, "value").to_string())
        .collect();
    let want: BTreeSet<String> = want
        .iter()
        .map(|f| {
            let one = f.cpus[cpus as usize - 1].1;
            json!({"bytes": f.bytes().to_string(), last.as_str(): one.to_string()}).to_string()
        })
        .collect();
    assert_eq!(got, want);
}

fn daemon_bin() -> &'static std::path::Path {
    std::path::Path::new(env!("CARGO_BIN_EXE_test-bpfmapd"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_filtered_cursor_resumes_across_a_restart_and_only_with_its_own_query() {
    let fs = BpfFs::new();
    let state = tempfile::tempdir().unwrap();
    let _map = flows_map(&fs, "flows", MapType::HASH, 10_000);
    let mut daemon = process::DaemonProcess::local(daemon_bin(), fs.path(), state.path());
    let mut c = grpc(&daemon.url()).await;
    let all = all_flows(&mut c, "flows").await;
    let filter = "key.daddr < 50 && key.dport == 53";
    let want: BTreeSet<Flow> = all
        .iter()
        .filter(|f| f.daddr < 50 && f.dport == 53)
        .cloned()
        .collect();
    let req = pb::DumpMapRequest {
        limit: 100,
        ..dump_request("flows", filter, &["key.saddr"], true)
    };
    let first = dump(&mut c, req.clone()).await.unwrap();
    assert!(!first.summary.complete && first.entries.len() >= 100);
    daemon.restart();
    let mut c = grpc(&daemon.url()).await;
    let refused = |req: pb::DumpMapRequest| {
        let mut c = c.clone();
        async move { dump(&mut c, req).await.unwrap_err() }
    };
    let others = [
        dump_request("flows", "key.daddr < 50", &["key.saddr"], true),
        dump_request("flows", filter, &["key.daddr"], true),
        dump_request("flows", filter, &[], true),
        dump_request("flows", "", &[], true),
    ];
    for other in others {
        let what = format!("filter {:?}, fields {:?}", other.filter, other.fields);
        let e = refused(pb::DumpMapRequest {
            cursor: first.cursor.clone(),
            ..other
        })
        .await;
        assert_eq!(e.code(), Code::InvalidArgument, "{what}: {e:?}");
        assert_eq!(reason(&e), "CURSOR_OTHER_QUERY", "{what}: {}", e.message());
    }
    let rest = dump(
        &mut c,
        pb::DumpMapRequest {
            limit: 0,
            cursor: first.cursor.clone(),
            ..req
        },
    )
    .await
    .unwrap();
    assert!(rest.summary.complete);
    let saddrs = |d: &Dumped| -> Vec<u32> {
        d.entries
            .iter()
            .map(|(k, _)| u32::from_le_bytes(k[..4].try_into().unwrap()))
            .collect()
    };
    let mut got = saddrs(&first);
    got.extend(saddrs(&rest));
    let unique: BTreeSet<u32> = got.iter().copied().collect();
    assert_eq!(unique.len(), got.len(), "an entry delivered twice");
    assert_eq!(
        unique,
        want.iter().map(|f| f.saddr).collect::<BTreeSet<_>>()
    );
    assert_eq!(
        first.summary.entries_scanned + rest.summary.entries_scanned,
        10_000
    );
}

fn agg(op: Op, field: &str) -> pb::Aggregate {
    pb::Aggregate {
        op: op as i32,
        field: field.into(),
    }
}

fn aggregate_request(
    path: &str,
    group_by: &[&str],
    aggregates: Vec<pb::Aggregate>,
) -> pb::AggregateMapRequest {
    pb::AggregateMapRequest {
        map: map_ref(path),
        group_by: group_by.iter().map(|s| s.to_string()).collect(),
        aggregates,
        ..Default::default()
    }
}

/// The groups of an answer: key, values and key bytes, as JSON.
fn groups_of(r: &pb::AggregateMapResponse) -> Vec<(Json, Vec<Json>, Vec<u8>)> {
    r.groups
        .iter()
        .map(|g| {
            let key = g.key.as_ref().map_or(Json::Null, |k| {
                k.fields
                    .iter()
                    .map(|(n, v)| (n.clone(), json_of(v)))
                    .collect::<serde_json::Map<_, _>>()
                    .into()
            });
            (
                key,
                g.values.iter().map(json_of).collect(),
                g.key_bytes.clone(),
            )
        })
        .collect()
}

/// Per daddr: the group's JSON values (SUM bytes, COUNT, MIN and MAX
/// packets) and its key bytes, from the flows the brute force reads.
fn by_daddr(flows: &[Flow]) -> Vec<(Json, Vec<Json>, Vec<u8>, u128)> {
    let mut g: BTreeMap<u32, (u128, u64, u64, u64)> = BTreeMap::new();
    for f in flows {
        let e = g.entry(f.daddr).or_insert((0, 0, u64::MAX, 0));
        e.0 += u128::from(f.bytes());
        e.1 += 1;
        e.2 = e.2.min(f.packets());
        e.3 = e.3.max(f.packets());
    }
    let mut rows: Vec<_> = g
        .into_iter()
        .map(|(d, (sum, n, lo, hi))| {
            let values = vec![
                json!(sum.to_string()),
                json!(n.to_string()),
                json!(lo.to_string()),
                json!(hi.to_string()),
            ];
            (
                json!({"key.daddr": d}),
                values,
                d.to_le_bytes().to_vec(),
                sum,
            )
        })
        .collect();
    rows.sort_by(|a, b| b.3.cmp(&a.3).then(a.2.cmp(&b.2)));
    rows
}

fn top(rows: &[(Json, Vec<Json>, Vec<u8>, u128)], n: usize) -> Vec<(Json, Vec<Json>, Vec<u8>)> {
    rows.iter()
        .take(n)
        .map(|(k, v, b, _)| (k.clone(), v.clone(), b.clone()))
        .collect()
}

fn daddr_aggregates(path: &str) -> pb::AggregateMapRequest {
    aggregate_request(
        path,
        &["key.daddr"],
        vec![
            agg(Op::Sum, "value.bytes"),
            agg(Op::Count, ""),
            agg(Op::Min, "value.packets"),
            agg(Op::Max, "value.packets"),
        ],
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn aggregates_match_a_brute_force_over_the_full_dump() {
    let (fs, _state, daemon, _client) = setup().await;
    let _map = flows_map(&fs, "flows", MapType::HASH, 10_000);
    let mut c = grpc(&daemon.addr()).await;
    let all = all_flows(&mut c, "flows").await;
    let rows = by_daddr(&all);
    let req = pb::AggregateMapRequest {
        limit: 10,
        ..daddr_aggregates("flows")
    };
    let r = c.aggregate_map(req.clone()).await.unwrap().into_inner();
    assert_eq!(groups_of(&r), top(&rows, 10), "top 10 daddr by bytes");
    let s = r.summary.unwrap();
    assert_eq!(
        (
            s.entries_scanned,
            s.entries_matched,
            s.groups_total,
            s.order_non_negative
        ),
        (10_000, 10_000, 250, true)
    );
    // Every group, ascending, down to a threshold.
    let threshold = rows[200].3;
    let asc = pb::AggregateMapRequest {
        ascending: true,
        limit: 0,
        threshold: threshold.to_string(),
        ..req.clone()
    };
    let r = c.aggregate_map(asc).await.unwrap().into_inner();
    let mut want: Vec<_> = rows.iter().filter(|r| r.3 <= threshold).cloned().collect();
    want.sort_by(|a, b| a.3.cmp(&b.3).then(a.2.cmp(&b.2)));
    assert_eq!(
        groups_of(&r),
        top(&want, usize::MAX),
        "ascending to {threshold}"
    );
    // Exactly the groups asked for, one of them with no entry.
    let asked = vec![
        rows[5].2.clone(),
        9999u32.to_le_bytes().to_vec(),
        rows[0].2.clone(),
    ];
    let exact = pb::AggregateMapRequest {
        groups: asked,
        ..req.clone()
    };
    let got = groups_of(&c.aggregate_map(exact).await.unwrap().into_inner());
    let empty = (
        json!({"key.daddr": 9999}),
        vec![json!("0"), json!("0"), Json::Null, Json::Null],
        9999u32.to_le_bytes().to_vec(),
    );
    assert_eq!(
        got,
        vec![
            top(&rows, 1)[0].clone(),
            top(&rows[5..], 1)[0].clone(),
            empty
        ]
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn aggregates_filter_and_group_by_value_members_and_several_members() {
    let (fs, _state, daemon, _client) = setup().await;
    let _map = flows_map(&fs, "flows", MapType::HASH, 10_000);
    let mut c = grpc(&daemon.addr()).await;
    let all = all_flows(&mut c, "flows").await;
    let filter = "key.proto == \"IPPROTO_UDP\"";
    let mut req = pb::AggregateMapRequest {
        limit: 5,
        ..daddr_aggregates("flows")
    };
    req.filter = filter.into();
    let udp: Vec<Flow> = all.iter().filter(|f| f.proto == 17).cloned().collect();
    let r = c.aggregate_map(req).await.unwrap().into_inner();
    assert_eq!(groups_of(&r), top(&by_daddr(&udp), 5), "{filter}");
    let s = r.summary.unwrap();
    assert_eq!(
        (s.entries_scanned, s.entries_matched),
        (10_000, udp.len() as u64)
    );
    // By a value member: each flow of daddr 3 has packets of its own.
    let mut by_value = aggregate_request("flows", &["value.packets"], vec![agg(Op::Count, "")]);
    by_value.filter = "key.daddr == 3".into();
    let r = c.aggregate_map(by_value).await.unwrap().into_inner();
    let mut want: Vec<u64> = all
        .iter()
        .filter(|f| f.daddr == 3)
        .map(Flow::packets)
        .collect();
    want.sort_by_key(|p| p.to_le_bytes());
    let got: Vec<Json> = groups_of(&r).into_iter().map(|g| g.0).collect();
    let want: Vec<Json> = want
        .iter()
        .map(|p| json!({"value.packets": p.to_string()}))
        .collect();
    assert_eq!(got, want, "ties (COUNT 1) in key_bytes order");
    // By two key members, smallest count first.
    let mut two = aggregate_request(
        "flows",
        &["key.proto", "key.dport"],
        vec![agg(Op::Count, "")],
    );
    two.ascending = true;
    let r = c.aggregate_map(two).await.unwrap().into_inner();
    let mut counts: BTreeMap<(u8, u16), u64> = BTreeMap::new();
    for f in &all {
        *counts.entry((f.proto, f.dport)).or_default() += 1;
    }
    let got: BTreeMap<(u8, u16), u64> = groups_of(&r)
        .iter()
        .map(|(_, v, b)| {
            (
                (b[0], u16::from_le_bytes([b[1], b[2]])),
                v[0].as_str().unwrap().parse().unwrap(),
            )
        })
        .collect();
    assert_eq!(got, counts);
    let order: Vec<u64> = groups_of(&r)
        .iter()
        .map(|g| g.1[0].as_str().unwrap().parse().unwrap())
        .collect();
    assert!(
        order.windows(2).all(|w| w[0] <= w[1]),
        "ascending: {order:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn per_cpu_aggregates_take_each_cpu_or_each_entrys_sum() {
    let (fs, _state, daemon, _client) = setup().await;
    let _map = flows_map(&fs, "pc", MapType::PERCPU_HASH, 1_000);
    let mut c = grpc(&daemon.addr()).await;
    let all = all_flows(&mut c, "pc").await;
    let aggs = vec![
        agg(Op::Sum, "value.bytes"),
        agg(Op::Min, "value.packets"),
        agg(Op::Max, "values[0].packets"),
    ];
    let mut req = aggregate_request("pc", &[], aggs);
    let each = c.aggregate_map(req.clone()).await.unwrap().into_inner();
    let bytes: u128 = all.iter().map(|f| u128::from(f.bytes())).sum();
    let lo_each = all
        .iter()
        .flat_map(|f| f.cpus.iter().map(|c| c.0))
        .min()
        .unwrap();
    let hi0 = all.iter().map(|f| f.cpus[0].0).max().unwrap();
    let values = |r: &pb::AggregateMapResponse| groups_of(r)[0].1.clone();
    assert_eq!(
        values(&each),
        [
            json!(bytes.to_string()),
            json!(lo_each.to_string()),
            json!(hi0.to_string())
        ]
    );
    req.per_cpu = pb::PerCpu::Sum as i32;
    let sum = c.aggregate_map(req).await.unwrap().into_inner();
    let lo_sum = all.iter().map(Flow::packets).min().unwrap();
    assert_eq!(
        values(&sum),
        [
            json!(bytes.to_string()),
            json!(lo_sum.to_string()),
            json!(hi0.to_string())
        ]
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn more_groups_than_max_groups_is_resource_exhausted_naming_the_limit() {
    let fs = BpfFs::new();
    let state = tempfile::tempdir().unwrap();
    let _map = flows_map(&fs, "flows", MapType::HASH, 1_000);
    let mut config = Daemon::config(fs.path(), state.path());
    config.limits.max_groups = 100;
    let daemon = Daemon::start_with(config).await;
    let mut c = grpc(&daemon.addr()).await;
    let req = aggregate_request("flows", &["key.saddr"], vec![agg(Op::Count, "")]);
    let e = c.aggregate_map(req).await.unwrap_err();
    assert_eq!(e.code(), Code::ResourceExhausted, "{e:?}");
    assert_eq!(
        e.message(),
        "more than 100 groups (limits.max_groups): 101 seen before the walk stopped; group by fewer or coarser members, or filter"
    );
    // 250 daddr groups do not fit either; 3 dports do.
    let ok = aggregate_request("flows", &["key.dport"], vec![agg(Op::Count, "")]);
    let r = c.aggregate_map(ok).await.unwrap().into_inner();
    assert_eq!(r.groups.len(), 3);
}

/// A mutual-TLS channel with the certificate `stem` of `pki`.
async fn tls_grpc(addr: &str, pki: &pki::Pki, stem: &str) -> Grpc {
    use tonic::transport::{Certificate, ClientTlsConfig, Identity};
    let read = |f: &str| std::fs::read(pki.path(f)).unwrap();
    let tls = ClientTlsConfig::new()
        .ca_certificate(Certificate::from_pem(read("ca.pem")))
        .identity(Identity::from_pem(
            read(&format!("{stem}.pem")),
            read(&format!("{stem}.key")),
        ))
        .domain_name("localhost");
    let channel = Channel::from_shared(addr.to_owned())
        .unwrap()
        .tls_config(tls)
        .unwrap()
        .connect()
        .await
        .unwrap_or_else(|e| panic!("cannot connect to {addr}: {e}"));
    MapServiceClient::new(channel)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_aggregate_operation_allows_aggregates_but_not_dumps_and_dump_implies_it() {
    use bpfmapd::{Operation, RuleConfig};
    let rule = |id: &str, ops: Vec<Operation>| RuleConfig {
        identities: vec![id.into()],
        maps: vec!["team/*".into()],
        operations: ops,
    };
    let fs = BpfFs::new();
    let state = tempfile::tempdir().unwrap();
    let pki = pki::Pki::new();
    let _map = flows_map(&fs, "team/flows", MapType::HASH, 100);
    let daemon = Daemon::start_with(bpfmapd::Config {
        tls: Some(pki.server_files()),
        rules: vec![
            rule("cn:totals", vec![Operation::Aggregate]),
            rule("cn:dumper", vec![Operation::Dump]),
            rule("cn:reader", vec![Operation::List, Operation::Lookup]),
        ],
        ..Daemon::config(fs.path(), state.path())
    })
    .await;
    let addr = daemon.tls_addr();
    let mut clients = BTreeMap::new();
    for who in ["totals", "dumper", "reader"] {
        pki.client(who, pki::Name::Cn(who), pki::Validity::Now);
        clients.insert(who, tls_grpc(&addr, &pki, who).await);
    }
    let req = aggregate_request("team/flows", &["key.dport"], vec![agg(Op::Count, "")]);
    let dump_req = dump_request("team/flows", "", &[], true);
    for (who, aggregates, dumps) in [
        ("totals", true, false),
        ("dumper", true, true),
        ("reader", false, false),
    ] {
        let c = clients.get_mut(who).unwrap();
        let a = c.aggregate_map(req.clone()).await;
        assert_eq!(
            a.as_ref().map(|_| ()).map_err(tonic::Status::code),
            if aggregates {
                Ok(())
            } else {
                Err(Code::PermissionDenied)
            },
            "{who}: AggregateMap {a:?}"
        );
        if let Ok(r) = a {
            assert_eq!(r.into_inner().groups.len(), 3, "{who}");
        }
        let d = dump(c, dump_req.clone()).await;
        match (dumps, d) {
            (true, Ok(d)) => assert_eq!(d.entries.len(), 100, "{who}"),
            (false, Err(e)) => {
                assert_eq!(e.code(), Code::PermissionDenied, "{who}: {e:?}");
                assert_eq!(reason(&e), "PERMISSION_DENIED");
            }
            (want, got) => panic!("{who}: DumpMap allowed should be {want}: {got:?}"),
        }
    }
}

/// An untyped array of `n` values of 4,096 bytes of `a`.
fn letters(fs: &BpfFs, rel: &str, n: u32) -> OwnedMap {
    let map = create_map(MapType::ARRAY, 4, 4096, n);
    let keys: Vec<u8> = (0..n).flat_map(u32::to_le_bytes).collect();
    let values = vec![b'a'; 4096 * n as usize];
    update_batch(&map, &keys, &values);
    fs.pin(&map, rel);
    map
}

/// Hostile filters, and the start of the message each gets.
fn hostile() -> Vec<(String, &'static str)> {
    let nested = format!("{}true{}", "(".repeat(1000), ")".repeat(1000));
    let list = format!("key.dport in [{}1]", "1,".repeat(20_000));
    vec![
        (nested, "filter: nested too deeply: at most 32 levels"),
        (
            format!("{}true", "!".repeat(4000)),
            "filter: nested too deeply",
        ),
        (
            format!("{}1 == 1", "-".repeat(2000)),
            "filter: nested too deeply",
        ),
        (list, "filter: 40016 bytes: a filter is at most 4096"),
        (
            format!("key.dport == 1 {}", " ".repeat(1 << 20)),
            "filter: 1048591 bytes: a filter is at most 4096",
        ),
        (
            "key.saddr == \"10.0.0.1\"".into(),
            "filter: key.saddr == \"10.0.0.1\" (column 1): cannot compare __u32 with string",
        ),
        (
            "value.bytes.startsWith(\"1\")".into(),
            "filter: value.bytes (column 1): is __u64: startsWith() is for strings (char arrays) and bytes",
        ),
        (
            "key + 1 == 2".into(),
            "filter: key (column 1): key is struct flow_key, which a filter cannot compare",
        ),
        (
            "key.proto > true".into(),
            "filter: key.proto > true (column 1): cannot compare enum ip_proto with bool",
        ),
        (
            "system(\"reboot\")".into(),
            "filter: system(\"reboot\") (column 1): unknown function or operator \"system\" in a filter",
        ),
        (
            "key.dport.toString() == \"443\"".into(),
            "filter: key.dport.toString() (column 1): unknown function or operator \"toString\"",
        ),
        (
            "[1, 2].all(x, x > 0)".into(),
            "filter: [1, 2].all(x, x > 0) (column 1): comprehensions (all, exists, exists_one, map, filter) are not supported",
        ),
        (
            "[key.dport].exists(x, x == 443)".into(),
            "filter: [key.dport].exists(x, x == 443) (column 1): comprehensions",
        ),
        ("key.dport ==".into(), "filter: Syntax error: "),
        ("   ".into(), "filter: Syntax error: "),
        (
            "value.bytes".into(),
            "filter: the expression is __u64, not bool",
        ),
    ]
}

/// A call that must succeed right after a refused one.
async fn still_healthy(c: &mut Grpc) {
    let d = dump(c, dump_request("flows", "key.dport == 443", &[], true))
        .await
        .unwrap_or_else(|e| panic!("the daemon after a hostile filter: {e:?}"));
    assert_eq!(d.entries.len(), 667);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hostile_filters_are_refused_saying_why_and_the_daemon_stays_healthy() {
    let (fs, _state, daemon, _client) = setup().await;
    let _map = flows_map(&fs, "flows", MapType::HASH, 2_000);
    let mut c = grpc(&daemon.addr()).await;
    for (filter, want) in hostile() {
        let shown: String = filter.chars().take(60).collect();
        let e = dump(&mut c, dump_request("flows", &filter, &[], true))
            .await
            .unwrap_err();
        assert_eq!(e.code(), Code::InvalidArgument, "{shown}: {e:?}");
        assert!(
            e.message().starts_with(want),
            "{shown}: {:?} does not start with {want:?}",
            e.message()
        );
        assert!(
            e.message().len() < 400,
            "{shown}: a message of {} bytes",
            e.message().len()
        );
        let mut req = aggregate_request("flows", &[], vec![agg(Op::Count, "")]);
        req.filter = filter.clone();
        let e = c.aggregate_map(req).await.unwrap_err();
        assert_eq!(
            e.code(),
            Code::InvalidArgument,
            "AggregateMap {shown}: {e:?}"
        );
        assert!(
            e.message().starts_with(want),
            "AggregateMap {shown}: {}",
            e.message()
        );
        still_healthy(&mut c).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pathological_regexes_stay_linear() {
    let fs = BpfFs::new();
    let state = tempfile::tempdir().unwrap();
    let _letters = letters(&fs, "letters", 4_000);
    // Unoptimized test builds run the regex engine many times slower than
    // a release daemon: the cost bound is lifted to time the regexes.
    let mut config = Daemon::config(fs.path(), state.path());
    config.limits.max_filter_cost = 0;
    let daemon = Daemon::start_with(config).await;
    let mut c = grpc(&daemon.addr()).await;
    for re in ["(a*)*b", "(a|aa)*c$", "(a+)+$x", "^(a|a?)+b"] {
        let filter = format!("value.matches(r\"{re}\")");
        let started = Instant::now();
        let d = dump(&mut c, dump_request("letters", &filter, &[], true))
            .await
            .unwrap();
        let took = started.elapsed();
        println!("{filter} over 4,000 values of 4 KiB: {took:?}");
        assert_eq!(
            (d.entries.len(), d.summary.entries_scanned),
            (0, 4_000),
            "{filter}"
        );
        assert!(
            took < Duration::from_secs(10),
            "{filter} over 4,000 x 4 KiB took {took:?}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn costly_filters_end_with_resource_exhausted() {
    let (fs, _state, daemon, _client) = setup().await;
    let _map = flows_map(&fs, "flows", MapType::HASH, 2_000);
    let _letters = letters(&fs, "letters", 4_000);
    let mut c = grpc(&daemon.addr()).await;
    // Eight regular expressions without literals to look for, none of which matches:
    // far more than 8 times the walk (in an unoptimized build too).
    let costly: Vec<String> = (1..=8)
        .map(|k| format!(r#"value.matches(r"\pL+\pN{{{k}}}")"#))
        .collect();
    let costly = costly.join(" || ");
    let nine = format!("{costly} || value.matches(r\"x\")");
    let e = dump(&mut c, dump_request("letters", &nine, &[], true))
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument, "{e:?}");
    assert!(
        e.message()
            .ends_with("at most 8 regular expressions in a filter"),
        "{}",
        e.message()
    );
    let e = dump(&mut c, dump_request("letters", &costly, &[], true))
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::ResourceExhausted, "{e:?}");
    assert!(
        e.message().starts_with("the filter costs "),
        "{}",
        e.message()
    );
    assert!(
        e.message()
            .ends_with("times the walk it filters (limits.max_filter_cost is 8): simplify it"),
        "{}",
        e.message()
    );
    let mut req = aggregate_request("letters", &[], vec![agg(Op::Count, "")]);
    req.filter = costly;
    let e = c.aggregate_map(req).await.unwrap_err();
    assert_eq!(e.code(), Code::ResourceExhausted, "AggregateMap: {e:?}");
    assert!(
        e.message().starts_with("the filter costs "),
        "{}",
        e.message()
    );
    still_healthy(&mut c).await;
}

/// The demo's flows that `pick` selects (flow i, its key and value).
fn demo_flows(pick: impl Fn(u32) -> bool) -> Vec<u32> {
    (0..100_000).filter(|&i| pick(i)).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_readme_examples_on_the_demo_through_grpcurl() {
    let fs = BpfFs::new();
    let state = tempfile::tempdir().unwrap();
    let _demo = bpfmapd::Demo::start(fs.path()).expect("the demo starts");
    let daemon = Daemon::start(fs.path(), state.path()).await;
    let host = daemon.running.local_addr().to_string();
    let request = r#"{"map":{"path":"demo/flows"},"filter":"key.proto == \"IPPROTO_UDP\" && value.bytes > 149990000","fields":["key.saddr","value.bytes"]}"#;
    let (ok, out, err) = grpcurl(
        &["-plaintext", "-d", request],
        &host,
        &["bpfmap.v1.MapService/DumpMap"],
    )
    .await;
    assert!(ok, "{err}");
    let messages = json_stream(&out);
    let entries: Vec<Json> = messages
        .iter()
        .flat_map(|m| m["entries"].as_array().cloned().unwrap_or_default())
        .collect();
    let want: Vec<Json> = demo_flows(|i| i % 4 == 3 && u64::from(i + 1) * 1500 > 149_990_000)
        .into_iter()
        .map(|i| {
            // The demo keeps its addresses in network order, in a __u32.
            let saddr = u32::from_le_bytes((0x0A00_0000 | i).to_be_bytes());
            json!({
                "decodedKey": {"saddr": saddr},
                "decodedValue": {"bytes": (u64::from(i + 1) * 1500).to_string()},
            })
        })
        .collect();
    let mut got = entries.clone();
    got.sort_by_key(|e| e["decodedValue"]["bytes"].as_str().map(str::to_owned));
    assert_eq!(got, want, "{out}");
    let last = messages.last().unwrap();
    assert_eq!(last["summary"]["entries"], json!("2"), "{out}");
    assert_eq!(last["summary"]["entriesScanned"], json!("100000"), "{out}");
    assert!(
        messages[0]["projection"]["keyType"]["struct"].is_object(),
        "{out}"
    );

    let request = r#"{"map":{"path":"demo/flows"},"groupBy":["key.daddr"],"aggregates":[{"op":"SUM","field":"value.bytes"},{"op":"COUNT"}],"limit":3,"render":{"key.daddr":"ipv4"}}"#;
    let (ok, out, err) = grpcurl(
        &["-plaintext", "-d", request],
        &host,
        &["bpfmap.v1.MapService/AggregateMap"],
    )
    .await;
    assert!(ok, "{err}");
    let answer: Json = serde_json::from_str(&out).unwrap();
    let mut sums: BTreeMap<u32, u64> = BTreeMap::new();
    for i in 0..100_000u32 {
        *sums.entry(i % 250 + 1).or_default() += u64::from(i + 1) * 1500;
    }
    let mut top: Vec<(u32, u64)> = sums.into_iter().collect();
    top.sort_by_key(|t| std::cmp::Reverse(t.1));
    let groups: Vec<Json> = top[..3]
        .iter()
        .map(|(d, sum)| {
            use base64::Engine as _;
            let bytes = (0xC0A8_0000u32 | d).to_be_bytes();
            json!({
                "key": {"key.daddr": format!("192.168.0.{d}")},
                "values": [sum.to_string(), "400"],
                "keyBytes": base64::engine::general_purpose::STANDARD.encode(bytes),
            })
        })
        .collect();
    assert_eq!(answer["groups"], Json::Array(groups), "{out}");
    let s = &answer["summary"];
    assert_eq!(
        (
            &s["entriesScanned"],
            &s["entriesMatched"],
            &s["groupsTotal"]
        ),
        (&json!("100000"), &json!("100000"), &json!("250")),
        "{out}"
    );
    assert_eq!(s["orderNonNegative"], json!(true), "{out}");
}

/// The clang-compiled object's maps, loaded as libbpf loaders do, with two
/// flows and a per-CPU counter set on every CPU.
fn load_object(fs: &BpfFs, build: &std::path::Path) -> aya::Ebpf {
    let object = compile_bpf_object("typed.bpf.c", build);
    let mut ebpf = aya::EbpfLoader::new()
        .default_map_pin_directory(fs.path())
        .load(&object)
        .unwrap_or_else(|e| panic!("loading the object: {e}"));
    let mut flows: aya::maps::HashMap<_, [u8; 16], [u8; 48]> =
        aya::maps::HashMap::try_from(ebpf.map_mut("flows").expect("map flows")).unwrap();
    for (i, (proto, comm, delta)) in [(17u8, b"resolvd\0", -2i8), (6, b"nginx\0\0\0", 3)]
        .into_iter()
        .enumerate()
    {
        let mut key = [0u8; 16];
        key[0..4].copy_from_slice(&(i as u32 + 1).to_le_bytes());
        key[10..12].copy_from_slice(&53u16.to_le_bytes());
        key[12] = proto;
        let mut value = [0u8; 48];
        value[0..8].copy_from_slice(&3u64.to_le_bytes());
        value[16..24].copy_from_slice(comm);
        value[32..36].copy_from_slice(&10u32.to_le_bytes());
        value[36..40].copy_from_slice(&20u32.to_le_bytes());
        value[40..44].copy_from_slice(&0x0403_0201u32.to_le_bytes());
        value[44] = 1;
        value[45] = delta as u8;
        flows.insert(key, value, 0).unwrap();
    }
    let cpus = bpfmap_kernel::possible_cpus() as usize;
    let mut counters: aya::maps::PerCpuArray<_, [u8; 24]> =
        aya::maps::PerCpuArray::try_from(ebpf.map_mut("counters").expect("map counters")).unwrap();
    let mut counter = [0u8; 24];
    counter[0..8].copy_from_slice(&100u64.to_le_bytes());
    counter[20..24].copy_from_slice(&(5u32 | 1 << 31).to_le_bytes());
    let set = aya::maps::PerCpuValues::try_from(vec![counter; cpus]).unwrap();
    counters.set(2, set, 0).unwrap();
    ebpf
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn filters_projections_and_aggregates_on_a_clang_compiled_object() {
    let fs = BpfFs::new();
    let state = tempfile::tempdir().unwrap();
    let build = tempfile::tempdir().unwrap();
    let _ebpf = load_object(&fs, build.path());
    let daemon = Daemon::start(fs.path(), state.path()).await;
    let mut c = grpc(&daemon.addr()).await;
    // An enum bitfield by name, a char array, an anonymous struct's and an
    // anonymous union's members, a bool, a signed byte.
    let filter = "key.proto == \"L4_UDP\" && value.comm.startsWith(\"resolv\") && value.range.lo == 10 && value.as_bytes[0] == 1 && value.active && value.delta < 0";
    let fields = ["key.proto", "value.comm", "value.range.hi", "value.delta"];
    let d = dump(&mut c, dump_request("flows", filter, &fields, true))
        .await
        .unwrap();
    assert_eq!(d.entries.len(), 1, "{filter}");
    let p = d.projection.clone().unwrap();
    let (k, v) = &d.entries[0];
    assert_eq!(decode(&p.key_type, k, "key"), json!({"proto": "L4_UDP"}));
    assert_eq!(
        decode(&p.value_type, v, "value"),
        json!({"comm": "resolvd", "range.hi": 20, "delta": -2})
    );
    let d = dump(
        &mut c,
        dump_request("flows", "value.comm == \"nginx\"", &fields, false),
    )
    .await
    .unwrap();
    assert_eq!(
        d.decoded,
        vec![(
            json!({"proto": "L4_TCP"}),
            json!({"comm": "nginx", "range.hi": 20, "delta": 3})
        )]
    );
    // The per-CPU counters: a summed bitfield, and sums over the CPUs.
    let cpus = bpfmap_kernel::possible_cpus() as u64;
    let sum_filter = format!("value.flag == {cpus} && value.errors == {}", 5 * cpus);
    let d = dump(&mut c, dump_request("counters", &sum_filter, &[], true))
        .await
        .unwrap();
    assert_eq!(d.entries.len(), 1, "{sum_filter}");
    assert_eq!(d.entries[0].0, 2u32.to_le_bytes());
    let mut req = aggregate_request(
        "counters",
        &["key"],
        vec![agg(Op::Sum, "value.rx"), agg(Op::Max, "values[0].errors")],
    );
    req.filter = "value.rx > 0".into();
    let r = c.aggregate_map(req).await.unwrap().into_inner();
    let got = groups_of(&r);
    assert_eq!(got.len(), 1);
    assert_eq!(got[0].0, json!({"key": 2}));
    assert_eq!(got[0].1, vec![json!((100 * cpus).to_string()), json!(5)]);
}

/// The messages of one DumpMap call: (entries, cursor, done, summary).
async fn messages(
    c: &mut Grpc,
    req: pb::DumpMapRequest,
) -> Vec<(u32, String, Option<pb::DumpSummary>)> {
    let mut stream = c.dump_map(req).await.unwrap().into_inner();
    let mut out = Vec::new();
    while let Some(m) = stream.message().await.unwrap() {
        let n = m.packed.as_ref().map_or(0, |p| p.count);
        out.push((n, m.cursor, m.summary));
    }
    out
}

/// Entries of the slow filter's map: 0.3 to 0.7 ms each in an unoptimized
/// build, so that the walk takes several heartbeats (a second apart).
const LETTERS: u32 = 10_000;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_filter_that_matches_nothing_for_a_second_still_sends_its_cursor() {
    let fs = BpfFs::new();
    let state = tempfile::tempdir().unwrap();
    let _letters = letters(&fs, "letters", LETTERS);
    let mut config = Daemon::config(fs.path(), state.path());
    config.limits.max_filter_cost = 0;
    let daemon = Daemon::start_with(config).await;
    let mut c = grpc(&daemon.addr()).await;
    let slow = (0..3)
        .map(|i| format!("value.matches(r\"(a+)+$x{i}\")"))
        .collect::<Vec<_>>()
        .join(" || ");
    let started = Instant::now();
    let got = messages(&mut c, dump_request("letters", &slow, &[], true)).await;
    let took = started.elapsed();
    assert!(
        took > Duration::from_millis(1500),
        "the walk took {took:?}: too fast to need a heartbeat; give the filter more work"
    );
    let (last, heartbeats) = got.split_last().unwrap();
    assert!(!heartbeats.is_empty(), "no empty chunk in {took:?}");
    assert!(heartbeats.iter().all(|h| h.0 == 0 && !h.1.is_empty()));
    assert_eq!(last.2.as_ref().unwrap().entries_scanned, u64::from(LETTERS));
    // Resumed from a heartbeat's cursor, the walk goes on from there.
    let req = pb::DumpMapRequest {
        cursor: heartbeats[0].1.clone(),
        ..dump_request("letters", &slow, &[], true)
    };
    let rest = messages(&mut c, req).await;
    let scanned = rest.last().unwrap().2.as_ref().unwrap().entries_scanned;
    assert!(
        scanned > 0 && scanned < u64::from(LETTERS),
        "the rest scanned {scanned}"
    );
}

/// An array of `n` u32 -> u64 entries (value i * 3), a trie of `n / 10`
/// /32 prefixes and an LRU hash of `n` u32 -> u64: untyped maps walked in
/// other ways than by hash bucket.
fn other_walks(fs: &BpfFs, n: u32) -> Vec<OwnedMap> {
    let array = create_map(MapType::ARRAY, 4, 8, n);
    let keys: Vec<u8> = (0..n).flat_map(u32::to_le_bytes).collect();
    let values: Vec<u8> = (0..n)
        .flat_map(|i| u64::from(i * 3).to_le_bytes())
        .collect();
    update_batch(&array, &keys, &values);
    fs.pin(&array, "array");
    let lru = create_map(MapType::LRU_HASH, 4, 8, n);
    update_batch(&lru, &keys, &values);
    fs.pin(&lru, "lru");
    let trie = create_map_with(&CreateMap {
        map_type: MapType::LPM_TRIE.0,
        key_size: 8,
        value_size: 8,
        max_entries: n,
        flags: 1, // BPF_F_NO_PREALLOC, required for tries
        name: "trie",
        ..Default::default()
    });
    for i in 0..n / 10 {
        let mut k = 32u32.to_le_bytes().to_vec();
        k.extend_from_slice(&(0x0A00_0000 | i).to_be_bytes());
        update(&trie, &k, &u64::from(i * 3).to_le_bytes());
    }
    fs.pin(&trie, "trie");
    vec![array, lru, trie]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn filtered_limited_dumps_resume_exactly_on_arrays_lru_hashes_and_tries() {
    let (fs, _state, daemon, _client) = setup().await;
    let _maps = other_walks(&fs, 3_000);
    let mut c = grpc(&daemon.addr()).await;
    for (map, filter, n) in [
        ("array", "value.u64(0) % 7 == 1", 3_000u64),
        ("lru", "value.u64(0) % 7 == 1", 3_000),
        ("trie", "key.be32(4) % 7 == 2 && value.u64(0) > 0", 300),
    ] {
        let all = dump(&mut c, dump_request(map, "", &[], true))
            .await
            .unwrap();
        // An LRU hash may have evicted some of its entries already.
        let held = all.entries.len() as u64;
        assert!(
            held == n || map == "lru" && held <= n,
            "{map}: {held} entries"
        );
        let n = held;
        let want: BTreeSet<(Vec<u8>, Vec<u8>)> = all
            .entries
            .into_iter()
            .filter(|(k, v)| {
                let v = u64::from_le_bytes(v[..8].try_into().unwrap());
                match map {
                    "trie" => u32::from_be_bytes(k[4..8].try_into().unwrap()) % 7 == 2 && v > 0,
                    _ => v % 7 == 1,
                }
            })
            .collect();
        let (mut got, mut scanned, mut cursor) = (Vec::new(), 0, String::new());
        loop {
            let req = pb::DumpMapRequest {
                limit: 11,
                cursor: cursor.clone(),
                ..dump_request(map, filter, &[], true)
            };
            let d = dump(&mut c, req).await.unwrap();
            got.extend(d.entries);
            scanned += d.summary.entries_scanned;
            cursor = d.cursor;
            if d.summary.complete {
                break;
            }
            // A hash bucket is never split: an LRU hash may exceed the limit.
            let entries = d.summary.entries;
            assert!(
                entries == 11 || map == "lru" && entries > 11,
                "{map}: a call sent {entries} with a limit of 11"
            );
        }
        let unique: BTreeSet<_> = got.iter().cloned().collect();
        assert_eq!(unique.len(), got.len(), "{map}: an entry delivered twice");
        assert_eq!(unique, want, "{map}: {filter}");
        assert_eq!(scanned, n, "{map}: entries scanned in all calls");
    }
}
