//! Queries across a fleet: the fleet top K (three-phase uniform threshold,
//! TPUT) against the brute-force answer from full dumps of the same maps,
//! on 24 daemons with seeded random typed flows built so that merging each
//! host's own top K would be wrong; a host down; COUNT ordering; the
//! fallback that merges every group; the bytes a top K costs against full
//! dumps; filtered and projected dumps through the library; and bpfmapctl
//! `top` and `dump --filter --fields`.

use std::collections::{BTreeMap, BTreeSet};

use bpfmap_client::{
    Aggregate, AggregateOptions, ConnectOptions, DumpOptions, Fleet, FleetAggregate,
    FleetAggregateOptions, FleetDumpOptions, FleetEvent, MergeMethod, Target, Value,
};
use bpfmap_kernel::{BtfBuilder, BtfMember as M, CreateMap, IntEncoding as E, OwnedBtf};
use bpfmap_tests::*;
use futures::StreamExt as _;
use serde_json::{Value as Json, json};
use tonic::Code;

/// Hosts of the fleet tests.
const HOSTS: usize = 24;

/// One flow: its key's and value's members.
#[derive(Debug, Clone, Copy)]
struct Flow {
    saddr: u32,
    daddr: u32,
    sport: u16,
    dport: u16,
    proto: u8,
    packets: u64,
    bytes: u64,
}

impl Flow {
    fn key(&self) -> [u8; 16] {
        let mut k = [0u8; 16];
        k[0..4].copy_from_slice(&self.saddr.to_le_bytes());
        k[4..8].copy_from_slice(&self.daddr.to_le_bytes());
        k[8..10].copy_from_slice(&self.sport.to_le_bytes());
        k[10..12].copy_from_slice(&self.dport.to_le_bytes());
        k[12] = self.proto;
        k
    }

    fn value(&self) -> [u8; 16] {
        let mut v = [0u8; 16];
        v[0..8].copy_from_slice(&self.packets.to_le_bytes());
        v[8..16].copy_from_slice(&self.bytes.to_le_bytes());
        v
    }
}

/// A typed hash map of `flows`, pinned at `rel`.
fn flow_map(fs: &BpfFs, rel: &str, flows: &[Flow]) -> OwnedMap {
    let mut b = BtfBuilder::new();
    let (key, value) = bpfmapd::flow_types(&mut b);
    let btf = OwnedBtf::load(&b.to_bytes()).unwrap_or_else(|e| panic!("BPF_BTF_LOAD: {e}"));
    let map = create_map_with(&CreateMap {
        map_type: MapType::HASH.0,
        key_size: 16,
        value_size: 16,
        max_entries: flows.len().max(1) as u32,
        name: "flows",
        btf: Some(btf.for_map(key, value)),
        ..Default::default()
    });
    let keys: Vec<u8> = flows.iter().flat_map(|f| f.key()).collect();
    let values: Vec<u8> = flows.iter().flat_map(|f| f.value()).collect();
    if !flows.is_empty() {
        update_batch(&map, &keys, &values);
    }
    fs.pin(&map, rel);
    map
}

/// splitmix64: a seeded generator, the same numbers on every run.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

/// Destinations of the fleet data: 10.H.0.X local to host H, 172.16.0.X on
/// every host, 192.168.X.Y in the background.
const HIDDEN_BYTES: u32 = 0xAC10_0000;
const HIDDEN_COUNT: u32 = 0xAC10_0100;
const MEDIUM: u32 = 0xAC10_0200;

/// Host `h`'s flows, built so that merging each host's own top K is wrong:
/// - 60 destinations of its own with about 1e9 bytes in one flow each (every
///   host's top 50 by bytes), and 55 of its own with 30 small flows each
///   (its top 50 by count);
/// - 5 destinations on every host with about 2e8 bytes there (in no host's
///   top 50, the top 5 of the fleet: about 4.9e9 in all), 10 on every other
///   host with 2e8 to 3e8 (about 3e9 in all), and one with 25 small flows
///   on every host (in no host's top 50 by count, the fleet's largest
///   count);
/// - 1,000 small background flows to 400 shared destinations.
fn host_flows(h: usize, rng: &mut Rng) -> Vec<Flow> {
    let h32 = h as u32;
    let mut flows = Vec::new();
    let mut n = 0u32;
    let mut flow = |daddr: u32, bytes: u64, rng: &mut Rng| {
        n += 1;
        Flow {
            saddr: 0x0A00_0000 | (h32 << 16) | n,
            daddr,
            sport: 1024 + (rng.below(60_000) as u16),
            dport: [443, 80, 53][rng.below(3) as usize],
            proto: [6, 17][rng.below(2) as usize],
            packets: 1 + rng.below(1_000_000),
            bytes,
        }
    };
    for x in 0..60 {
        let bytes = 1_000_000_000 + rng.below(100_000_000);
        flows.push(flow(0x0A00_0000 | (h32 << 16) | x, bytes, rng));
    }
    for x in 0..55 {
        for _ in 0..30 {
            let bytes = 1 + rng.below(100);
            flows.push(flow(0x0A00_0000 | (h32 << 16) | (1000 + x), bytes, rng));
        }
    }
    for x in 0..5 {
        let bytes = 200_000_000 + rng.below(10_000_000);
        flows.push(flow(HIDDEN_BYTES + x, bytes, rng));
    }
    for x in 0..10u32 {
        if (h as u32 + x).is_multiple_of(2) {
            let bytes = 200_000_000 + rng.below(100_000_000);
            flows.push(flow(MEDIUM + x, bytes, rng));
        }
    }
    for _ in 0..25 {
        let bytes = 1 + rng.below(100);
        flows.push(flow(HIDDEN_COUNT, bytes, rng));
    }
    for _ in 0..1000 {
        let bytes = 1_000 + rng.below(1_000_000);
        flows.push(flow(0xC0A8_0000 + rng.below(400) as u32, bytes, rng));
    }
    flows
}

/// A fleet of in-process daemons, each on an address of its own
/// (127.0.NET.H), each serving a map `flows` of its own.
struct TestFleet {
    fs: BpfFs,
    _states: Vec<tempfile::TempDir>,
    _maps: Vec<OwnedMap>,
    daemons: Vec<Daemon>,
}

impl TestFleet {
    async fn start(net: u8, hosts: &[Vec<Flow>]) -> Self {
        let fs = BpfFs::new();
        let (mut states, mut maps, mut daemons) = (Vec::new(), Vec::new(), Vec::new());
        for (h, flows) in hosts.iter().enumerate() {
            maps.push(flow_map(&fs, &format!("host{h}/flows"), flows));
            let state = tempfile::tempdir().unwrap();
            let config = bpfmapd::Config {
                listen: format!("127.0.{net}.{}:0", h + 1).parse().unwrap(),
                ..Daemon::config(&fs.path().join(format!("host{h}")), state.path())
            };
            daemons.push(Daemon::start_with(config).await);
            states.push(state);
        }
        Self {
            fs,
            _states: states,
            _maps: maps,
            daemons,
        }
    }

    fn targets(&self) -> Vec<Target> {
        self.daemons
            .iter()
            .map(|d| d.running.local_addr().to_string().parse().unwrap())
            .collect()
    }

    fn fleet(&self) -> Fleet {
        Fleet::new(self.targets(), ConnectOptions::default())
    }

    async fn stop(self) {
        for d in self.daemons {
            d.stop().await;
        }
    }
}

/// The fleet data of `seed`.
fn fleet_data(seed: u64) -> Vec<Vec<Flow>> {
    let mut rng = Rng(seed);
    (0..HOSTS).map(|h| host_flows(h, &mut rng)).collect()
}

/// A group as the tests compare them: daddr, values, hosts.
type Row = (u32, Vec<i128>, Vec<String>);

/// Every host's entries, as (key, value) bytes.
type Dumps = BTreeMap<Target, Vec<(Vec<u8>, Vec<u8>)>>;

/// Every host's entries, by a full dump of each (through the library).
async fn full_dumps(fleet: &Fleet) -> Dumps {
    let map = "flows".parse().unwrap();
    let mut run = fleet.dump(&map, FleetDumpOptions::default());
    let mut out = Dumps::new();
    while let Some(event) = run.next().await {
        match event {
            FleetEvent::Answer { target, answer } => {
                let rows = out.entry(target).or_default();
                for e in answer.chunk.to_entries() {
                    let Value::Single(v) = e.value else {
                        panic!("a hash map's value")
                    };
                    rows.push((e.key, v));
                }
            }
            FleetEvent::Done(r) => assert!(r.is_ok() && r.complete, "{}: {:?}", r.target, r.error),
            _ => {}
        }
    }
    out
}

/// What brute force orders by.
#[derive(Debug, Clone, Copy)]
enum By {
    Bytes,
    Count,
    MaxPackets,
}

/// Each destination's (sum of bytes, count, max of packets) on one host.
fn per_host(entries: &[(Vec<u8>, Vec<u8>)]) -> BTreeMap<u32, [i128; 3]> {
    let mut groups: BTreeMap<u32, [i128; 3]> = BTreeMap::new();
    for (k, v) in entries {
        let daddr = u32::from_le_bytes(k[4..8].try_into().unwrap());
        let packets = i128::from(u64::from_le_bytes(v[0..8].try_into().unwrap()));
        let bytes = i128::from(u64::from_le_bytes(v[8..16].try_into().unwrap()));
        let g = groups.entry(daddr).or_insert([0, 0, 0]);
        g[0] += bytes;
        g[1] += 1;
        g[2] = g[2].max(packets);
    }
    groups
}

/// Orders (daddr, values) as the daemons do: by the value, largest first,
/// then by key bytes (the daddr's, little-endian).
fn rank(rows: &mut [(u32, [i128; 3])], by: By) {
    let at = match by {
        By::Bytes => 0,
        By::Count => 1,
        By::MaxPackets => 2,
    };
    rows.sort_by(|a, b| {
        b.1[at]
            .cmp(&a.1[at])
            .then_with(|| a.0.to_le_bytes().cmp(&b.0.to_le_bytes()))
    });
}

/// The fleet's top `k` by brute force over full dumps: every group summed
/// over every host, with the hosts that hold it; values in the order of
/// `by`'s aggregates (see `aggregates`).
fn brute_top(dumps: &Dumps, by: By, k: usize) -> Vec<Row> {
    let mut total: BTreeMap<u32, ([i128; 3], Vec<String>)> = BTreeMap::new();
    for (t, entries) in dumps {
        for (daddr, g) in per_host(entries) {
            let e = total.entry(daddr).or_insert(([0, 0, 0], Vec::new()));
            e.0[0] += g[0];
            e.0[1] += g[1];
            e.0[2] = e.0[2].max(g[2]);
            e.1.push(t.to_string());
            e.1.sort();
        }
    }
    let mut rows: Vec<(u32, [i128; 3])> = total.iter().map(|(d, (v, _))| (*d, *v)).collect();
    rank(&mut rows, by);
    rows.truncate(k);
    rows.into_iter()
        .map(|(d, v)| (d, order_values(by, v), total[&d].1.clone()))
        .collect()
}

/// The naive answer: each host's own top `k`, added up.
fn naive_top(dumps: &Dumps, by: By, k: usize) -> Vec<u32> {
    let mut total: BTreeMap<u32, [i128; 3]> = BTreeMap::new();
    for entries in dumps.values() {
        let mut rows: Vec<(u32, [i128; 3])> = per_host(entries).into_iter().collect();
        rank(&mut rows, by);
        for (d, g) in rows.into_iter().take(k) {
            let e = total.entry(d).or_insert([0, 0, 0]);
            e[0] += g[0];
            e[1] += g[1];
            e[2] = e[2].max(g[2]);
        }
    }
    let mut rows: Vec<(u32, [i128; 3])> = total.into_iter().collect();
    rank(&mut rows, by);
    rows.into_iter().take(k).map(|(d, _)| d).collect()
}

/// The aggregates of a query ordered by `by`, the ordering one first.
fn aggregates(by: By) -> Vec<Aggregate> {
    let (bytes, count, max) = (
        Aggregate::sum("value.bytes"),
        Aggregate::count(),
        Aggregate::max("value.packets"),
    );
    match by {
        By::Bytes => vec![bytes, count, max],
        By::Count => vec![count, bytes, max],
        By::MaxPackets => vec![max, bytes, count],
    }
}

/// (bytes, count, max) in the order of `aggregates(by)`.
fn order_values(by: By, v: [i128; 3]) -> Vec<i128> {
    match by {
        By::Bytes => vec![v[0], v[1], v[2]],
        By::Count => vec![v[1], v[0], v[2]],
        By::MaxPackets => vec![v[2], v[0], v[1]],
    }
}

/// The fleet's top `k` by destination.
async fn fleet_top(fleet: &Fleet, by: By, k: u32) -> FleetAggregate {
    let options = AggregateOptions::default()
        .with_group_by(["key.daddr"])
        .with_aggregates(aggregates(by))
        .with_limit(k);
    let map = "flows".parse().unwrap();
    fleet
        .aggregate(
            &map,
            FleetAggregateOptions::default().with_aggregate(options),
        )
        .await
}

/// A fleet answer as rows, checking each group's key and key bytes.
fn rows(result: &FleetAggregate) -> Vec<Row> {
    result
        .groups
        .iter()
        .map(|g| {
            let daddr = json_of(&g.group.key()["key.daddr"]).as_u64().unwrap() as u32;
            assert_eq!(g.group.key().len(), 1);
            assert_eq!(g.group.key_bytes(), daddr.to_le_bytes());
            let values = g.group.values().iter().map(|v| v.unwrap()).collect();
            let mut hosts: Vec<String> = g.hosts.iter().map(ToString::to_string).collect();
            hosts.sort();
            (daddr, values, hosts)
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_fleet_top_k_is_exact_where_merging_each_hosts_top_k_is_wrong() {
    let data = fleet_data(7);
    let fleet_of = TestFleet::start(101, &data).await;
    let fleet = fleet_of.fleet();
    let dumps = full_dumps(&fleet).await;
    for (h, t) in fleet_of.targets().iter().enumerate() {
        assert_eq!(dumps[t].len(), data[h].len(), "{t}: every flow dumped");
    }
    for (by, k) in [
        (By::Bytes, 1),
        (By::Bytes, 3),
        (By::Bytes, 10),
        (By::Bytes, 50),
        (By::Count, 1),
        (By::Count, 3),
        (By::Count, 10),
        (By::Count, 50),
    ] {
        let result = fleet_top(&fleet, by, k).await;
        let want = brute_top(&dumps, by, k as usize);
        assert_eq!(result.method, MergeMethod::Threshold, "{by:?} top {k}");
        assert!(!result.is_partial(), "{:?}", result.missing);
        assert_eq!(rows(&result), want, "{by:?} top {k}");
        let naive = naive_top(&dumps, by, k as usize);
        let exact: Vec<u32> = want.iter().map(|r| r.0).collect();
        assert_ne!(
            naive, exact,
            "{by:?} top {k}: the data must defeat naive merging"
        );
        // The groups at the top are in no host's own top K.
        let hidden = match by {
            By::Count => HIDDEN_COUNT..HIDDEN_COUNT + 1,
            _ => HIDDEN_BYTES..HIDDEN_BYTES + 5,
        };
        assert!(
            hidden.clone().any(|d| exact.contains(&d)),
            "{by:?} top {k}: {exact:x?}"
        );
        assert!(
            !hidden.clone().any(|d| naive.contains(&d)),
            "{by:?} top {k}"
        );
        let sent: u64 = result.reports.iter().map(|r| r.entries).sum();
        let calls: u32 = result.reports.iter().map(|r| r.calls).sum();
        for (r, flows) in result.reports.iter().zip(&data) {
            assert!(r.is_ok() && (1..=3).contains(&r.calls), "{r:?}");
            let walks = u64::from(r.calls) * flows.len() as u64;
            assert_eq!(r.scanned, walks, "{r:?}: whole walks");
        }
        println!("{by:?} top {k}: {calls} calls, {sent} groups sent");
    }
    fleet_of.stop().await;
}

/// An address with nothing listening: a host that is down.
fn dead_target(ip: &str) -> Target {
    let listener = std::net::TcpListener::bind(format!("{ip}:0")).unwrap();
    let addr = listener.local_addr().unwrap();
    drop(listener);
    addr.to_string().parse().unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_a_host_down_the_top_k_is_that_of_the_others_and_names_it() {
    let data = fleet_data(11);
    let fleet_of = TestFleet::start(102, &data).await;
    let alive = full_dumps(&fleet_of.fleet()).await;
    let dead = dead_target("127.0.102.250");
    let mut targets = fleet_of.targets();
    targets.insert(5, dead.clone());
    let fleet = Fleet::new(targets, ConnectOptions::default());
    for (by, k) in [(By::Bytes, 10), (By::Count, 3)] {
        let result = fleet_top(&fleet, by, k).await;
        assert!(result.is_partial());
        assert_eq!(result.missing, std::slice::from_ref(&dead));
        assert_eq!(result.method, MergeMethod::Threshold);
        assert_eq!(
            rows(&result),
            brute_top(&alive, by, k as usize),
            "{by:?} top {k}"
        );
        let down = result.reports.iter().find(|r| r.target == dead).unwrap();
        let e = down.error.as_ref().expect("the host that is down failed");
        assert_eq!(e.code(), Code::Unavailable, "{e}");
        assert_eq!((down.calls, down.entries), (0, 0));
        assert_eq!(result.reports.len(), HOSTS + 1);
        assert_eq!(result.reports.iter().filter(|r| r.is_ok()).count(), HOSTS);
    }
    fleet_of.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn max_ordering_and_every_group_merge_every_group_exactly() {
    let data = fleet_data(13);
    let fleet_of = TestFleet::start(103, &data).await;
    let fleet = fleet_of.fleet();
    let dumps = full_dumps(&fleet).await;
    let result = fleet_top(&fleet, By::MaxPackets, 10).await;
    assert_eq!(result.method, MergeMethod::AllGroups);
    assert!(!result.is_partial());
    assert_eq!(rows(&result), brute_top(&dumps, By::MaxPackets, 10));
    // No limit: every group, merged.
    let every = fleet_top(&fleet, By::Bytes, 0).await;
    assert_eq!(every.method, MergeMethod::AllGroups);
    let want = brute_top(&dumps, By::Bytes, usize::MAX);
    assert_eq!(want.len(), HOSTS * 115 + 5 + 10 + 1 + 400);
    assert_eq!(rows(&every), want);
    // A bound on the groups each host may send: every host has more.
    let options = AggregateOptions::default()
        .with_group_by(["key.daddr"])
        .with_aggregate(Aggregate::max("value.packets"))
        .with_limit(10);
    let bounded = FleetAggregateOptions::default()
        .with_aggregate(options)
        .with_max_groups(100);
    let result = fleet.aggregate(&"flows".parse().unwrap(), bounded).await;
    assert_eq!(result.missing, fleet_of.targets());
    assert!(result.groups.is_empty());
    let e = result.reports[0].error.as_ref().unwrap();
    assert_eq!(e.code(), Code::ResourceExhausted);
    assert!(
        e.to_string().contains("more than the 100 a fleet merges"),
        "{e}"
    );
    fleet_of.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fleet_top_10_receives_a_fraction_of_the_bytes_of_full_dumps() {
    let data = fleet_data(17);
    let fleet_of = TestFleet::start(105, &data).await;
    let mut proxies = Vec::new();
    for (h, d) in fleet_of.daemons.iter().enumerate() {
        let listen = format!("127.0.106.{}:0", h + 1);
        proxies.push(CountingProxy::start(&listen, d.running.local_addr()).await);
    }
    let targets: Vec<Target> = proxies
        .iter()
        .map(|p| p.addr.to_string().parse().unwrap())
        .collect();
    let fleet = Fleet::new(targets, ConnectOptions::default());
    let received = || -> u64 { proxies.iter().map(|p| p.bytes()).sum() };
    let dumps = full_dumps(&fleet).await;
    // Connections close when each target is done: wait for the counts.
    tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    let dump_bytes = received();
    let result = fleet_top(&fleet, By::Bytes, 10).await;
    tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    let top_bytes = received() - dump_bytes;
    assert_eq!(rows(&result), brute_top(&dumps, By::Bytes, 10));
    let entries: usize = data.iter().map(Vec::len).sum();
    println!(
        "{HOSTS} hosts, {entries} entries: full dumps {dump_bytes} bytes, fleet top 10 {top_bytes} bytes ({:.1}x fewer)",
        dump_bytes as f64 / top_bytes as f64
    );
    assert!(
        top_bytes * 4 < dump_bytes,
        "{top_bytes} against {dump_bytes}"
    );
    fleet_of.stop().await;
}

/// The small fleet of the library and bpfmapctl tests: 3 hosts, 7 flows.
/// An address as programs keep it: its bytes in network order, in a
/// `__u32` (what the ipv4 rendering reads).
fn net(addr: u32) -> u32 {
    u32::from_le_bytes(addr.to_be_bytes())
}

fn small_fleet() -> Vec<Vec<Flow>> {
    let f = |saddr, daddr, sport, dport, proto, packets, bytes| Flow {
        saddr: net(saddr),
        daddr: net(daddr),
        sport,
        dport,
        proto,
        packets,
        bytes,
    };
    vec![
        vec![
            f(0x0a00_0001, 0xc0a8_0001, 1000, 443, 6, 10, 5_000_000),
            f(0x0a00_0002, 0xc0a8_0002, 1001, 80, 17, 20, 2_000),
            f(0x0a00_0003, 0xc0a8_0001, 1002, 443, 17, 30, 500),
        ],
        vec![
            f(0x0a01_0001, 0xc0a8_0002, 2000, 443, 6, 5, 3_000_000),
            f(0x0a01_0002, 0xc0a8_0003, 2001, 443, 6, 7, 4_000_000),
        ],
        vec![
            f(0x0a02_0001, 0xc0a8_0001, 3000, 53, 17, 1, 100),
            f(0x0a02_0002, 0xc0a8_0003, 3001, 443, 6, 9, 4_500_000),
        ],
    ]
}

/// The entries of a dump of `map` on `client`, as (key, value) bytes, and
/// its summary's (entries, entries scanned).
async fn dump_of(
    client: &bpfmap_client::Client,
    map: &str,
    options: DumpOptions,
) -> (BTreeSet<(Vec<u8>, Vec<u8>)>, (u64, u64), String) {
    let mut dump = client.dump(&map.parse().unwrap(), options);
    let mut got = BTreeSet::new();
    while let Some(chunk) = dump.next_chunk().await.unwrap() {
        for e in &chunk {
            let bpfmap_client::ValueRef::Single(v) = e.value else {
                panic!("a single value")
            };
            assert!(got.insert((e.key.to_vec(), v.to_vec())), "twice: {e:?}");
        }
    }
    let s = dump.summary().expect("a summary");
    (
        got,
        (s.entries(), s.entries_scanned()),
        dump.cursor().to_owned(),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn filtered_and_projected_dumps_through_the_library() {
    let data = small_fleet();
    let fleet_of = TestFleet::start(104, &data).await;
    let host0 = fleet_of.daemons[0].client().await;
    let host1 = fleet_of.daemons[1].client().await;
    let filter = "key.dport == 443 && value.bytes > 1000000";
    let bytes = |f: &Flow| (f.key().to_vec(), f.value().to_vec());
    let (got, counts, _) =
        dump_of(&host0, "flows", DumpOptions::default().with_filter(filter)).await;
    assert_eq!(got, BTreeSet::from([bytes(&data[0][0])]));
    assert_eq!(counts, (1, 3));
    // The entries layout, the same entries.
    let entries = DumpOptions::default()
        .with_filter(filter)
        .with_packed(false);
    assert_eq!(dump_of(&host0, "flows", entries).await.0, got);
    // A filtered dump resumed with the same filter gives the rest: 200
    // flows, every other one to port 443, 10,000 bytes more each.
    let many: Vec<Flow> = (0..200u32)
        .map(|i| Flow {
            saddr: 0x0a05_0000 + i,
            dport: if i % 2 == 0 { 443 } else { 80 },
            bytes: u64::from(i) * 10_000,
            ..data[1][0]
        })
        .collect();
    let _many = flow_map(&fleet_of.fs, "host1/many", &many);
    let want: BTreeSet<_> = many
        .iter()
        .filter(|f| f.dport == 443 && f.bytes > 1_000_000)
        .map(bytes)
        .collect();
    assert_eq!(want.len(), 49);
    let limited = DumpOptions::default().with_filter(filter).with_limit(10);
    let (first, counts, cursor) = dump_of(&host1, "many", limited).await;
    assert!((10..20).contains(&counts.0), "{counts:?}");
    let rest = DumpOptions::default()
        .with_filter(filter)
        .with_cursor(cursor.as_str());
    let (second, counts, _) = dump_of(&host1, "many", rest).await;
    assert_eq!(counts.0 as usize, 49 - first.len());
    assert!(first.is_disjoint(&second));
    let all: BTreeSet<_> = first.union(&second).cloned().collect();
    assert_eq!(all, want);
    let other = DumpOptions::default()
        .with_filter("value.bytes > 0")
        .with_cursor(cursor);
    let mut dump = host1.dump(&"many".parse().unwrap(), other);
    let e = dump.next_chunk().await.unwrap_err();
    assert_eq!(code_of(&e), Code::InvalidArgument, "{e}");
    projected_dumps(&host0).await;
    fleet_dump_with_fields(&fleet_of).await;
    fleet_of.stop().await;
}

/// A projected dump: packed records of the selected members, decoded
/// through the projection's types; and the daemon's decoding of them.
async fn projected_dumps(client: &bpfmap_client::Client) {
    let map = "flows".parse().unwrap();
    let fields = ["key.daddr", "value.bytes", "key.proto"];
    let options = DumpOptions::default()
        .with_filter("value.packets >= 20")
        .with_fields(fields);
    let mut dump = client.dump(&map, options.clone());
    let mut got = Vec::new();
    while let Some(chunk) = dump.next_chunk().await.unwrap() {
        let types = dump
            .projection()
            .expect("the first message describes the projection")
            .types_with([("key.daddr", "ipv4")])
            .unwrap();
        for e in &chunk {
            let bpfmap_client::ValueRef::Single(v) = e.value else {
                panic!("a single value")
            };
            // daddr and proto; bytes.
            assert_eq!((e.key.len(), v.len()), (5, 8));
            let mut line = Vec::new();
            types.write_entry_json(e, &mut line);
            got.push(serde_json::from_slice::<Json>(&line).unwrap());
        }
    }
    got.sort_by_key(|j| {
        j["value"]["bytes"]
            .as_str()
            .unwrap()
            .parse::<u64>()
            .unwrap()
    });
    assert_eq!(
        got,
        [
            json!({"key": {"daddr": "192.168.0.1", "proto": "IPPROTO_UDP"}, "value": {"bytes": "500"}}),
            json!({"key": {"daddr": "192.168.0.2", "proto": "IPPROTO_UDP"}, "value": {"bytes": "2000"}}),
        ]
    );
    let p = dump.projection().unwrap();
    let names = |t: Option<&bpfmap_client::pb::TypeInfo>| -> Vec<String> {
        match t.and_then(|t| t.kind.clone()) {
            Some(bpfmap_client::pb::type_info::Kind::Struct(r)) => {
                r.members.into_iter().map(|m| m.name).collect()
            }
            other => panic!("a record: {other:?}"),
        }
    };
    assert_eq!(names(p.key_type()), ["daddr", "proto"]);
    assert_eq!(names(p.value_type()), ["bytes"]);
    assert_eq!(dump.summary().unwrap().entries_scanned(), 3);
    // The entries layout: the daemon decodes the selected members.
    let mut dump = client.dump(&map, options.with_packed(false));
    let mut decoded = Vec::new();
    while let Some(chunk) = dump.next_chunk().await.unwrap() {
        for i in 0..chunk.len() {
            let key = json_of(chunk.decoded_key(i).unwrap());
            decoded.push((key, json_of(chunk.decoded_value(i).unwrap())));
        }
    }
    decoded.sort_by_key(|(_, v)| v["bytes"].as_str().unwrap().parse::<u64>().unwrap());
    assert_eq!(
        decoded,
        [
            (
                json!({"daddr": net(0xc0a8_0001), "proto": "IPPROTO_UDP"}),
                json!({"bytes": "500"})
            ),
            (
                json!({"daddr": net(0xc0a8_0002), "proto": "IPPROTO_UDP"}),
                json!({"bytes": "2000"})
            ),
        ]
    );
}

/// A fleet dump with fields: each chunk comes with the projection's types.
async fn fleet_dump_with_fields(fleet_of: &TestFleet) {
    let dump = DumpOptions::default()
        .with_filter("key.dport == 443 && value.bytes > 1000000")
        .with_fields(["key.daddr", "value.bytes"]);
    let options = FleetDumpOptions::default().with_dump(dump).with_types(true);
    let mut run = fleet_of.fleet().dump(&"flows".parse().unwrap(), options);
    let mut got = BTreeSet::new();
    while let Some(event) = run.next().await {
        match event {
            FleetEvent::Answer { target, answer } => {
                let types = answer.types.expect("the projection's types");
                for e in &answer.chunk {
                    let mut line = Vec::new();
                    types.write_entry_json(e, &mut line);
                    got.insert((target.to_string(), String::from_utf8(line).unwrap()));
                }
            }
            FleetEvent::Done(r) => assert!(r.is_ok() && r.complete, "{:?}", r.error),
            _ => {}
        }
    }
    let t = fleet_of.targets();
    let line = |daddr: u32, bytes: u64| {
        let daddr = net(daddr);
        format!(r#"{{"key":{{"daddr":{daddr}}},"value":{{"bytes":"{bytes}"}}}}"#)
    };
    let want = BTreeSet::from([
        (t[0].to_string(), line(0xc0a8_0001, 5_000_000)),
        (t[1].to_string(), line(0xc0a8_0002, 3_000_000)),
        (t[1].to_string(), line(0xc0a8_0003, 4_000_000)),
        (t[2].to_string(), line(0xc0a8_0003, 4_500_000)),
    ]);
    assert_eq!(got, want);
}

/// `bpfmapctl` with the fleet's targets, then `args`.
async fn ctl_on(targets: &[Target], args: &[&str]) -> (anyhow::Result<()>, String, String) {
    let mut argv: Vec<String> = Vec::new();
    for t in targets {
        argv.extend(["--target".to_owned(), t.to_string()]);
    }
    argv.extend(args.iter().map(|a| (*a).to_owned()));
    let argv: Vec<&str> = argv.iter().map(String::as_str).collect();
    ctl(&argv).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bpfmapctl_top_and_dump_with_filter_and_fields() {
    let data = small_fleet();
    let fleet_of = TestFleet::start(107, &data).await;
    let t = fleet_of.targets();
    let by = [
        "--by",
        "sum(value.bytes)",
        "--by",
        "count()",
        "--by",
        "max(value.packets)",
    ];
    let top = [
        &["top", "flows"][..],
        &by,
        &["--group-by", "key.daddr", "-n", "2", "--hosts"],
    ]
    .concat();
    let (result, out, err) = ctl_on(&t, &top).await;
    result.unwrap();
    let values = |sum: &str, count: &str, max: &str| json!({"sum(value.bytes)": sum, "count()": count, "max(value.packets)": max});
    assert_eq!(
        json_lines(&out),
        [
            json!({"targets": [t[1].as_str(), t[2].as_str()], "key": {"key.daddr": net(0xc0a8_0003)}, "values": values("8500000", "2", "9")}),
            json!({"targets": [t[0].as_str(), t[2].as_str()], "key": {"key.daddr": net(0xc0a8_0001)}, "values": values("5000600", "3", "30")}),
        ]
    );
    assert_eq!(
        json_lines(&err),
        [
            json!({"targets": 3, "ok": 3, "failed": 0, "method": "top_k", "groups": 2, "groups_sent": 6, "entries_scanned": 7})
        ]
    );
    top_table_with_a_host_down(&t).await;
    top_usage_errors(&t).await;
    dump_with_filter_and_fields(&t).await;
    fleet_of.stop().await;
}

/// `top` as a table, rendered and filtered, with one host down: the
/// others' groups, and its failure on stderr.
async fn top_table_with_a_host_down(t: &[Target]) {
    // A table, rendered; one host down: the others' groups, and its failure.
    let dead = dead_target("127.0.107.250");
    let with_dead = [t.to_vec(), vec![dead.clone()]].concat();
    let table = [
        &[
            "--format",
            "table",
            "top",
            "flows",
            "--by",
            "sum(value.bytes)",
            "--by",
            "count()",
        ][..],
        &[
            "--group-by",
            "key.daddr",
            "-n",
            "5",
            "--render",
            "key.daddr=ipv4",
            "--filter",
            "key.dport == 443",
        ],
    ]
    .concat();
    let (result, out, err) = ctl_on(&with_dead, &table).await;
    assert_eq!(
        result.unwrap_err().to_string(),
        "1 of 4 targets failed; the groups are those of the others"
    );
    assert_eq!(
        out,
        "key.daddr    sum(value.bytes)  count()\n\
         192.168.0.3  8500000           2\n\
         192.168.0.1  5000500           2\n\
         192.168.0.2  3000000           1\n"
    );
    let lines = json_lines(&err);
    assert_eq!(lines[0]["target"], json!(dead.as_str()));
    assert_eq!(lines[0]["code"], json!("UNAVAILABLE"));
    assert_eq!(lines[1]["failed"], json!(1));
}

/// Aggregates that do not fit the map, or that do not exist: usage errors
/// that say what to write.
async fn top_usage_errors(t: &[Target]) {
    // A field the map does not have: a usage error, the daemons' words.
    let bad = ["top", "flows", "--by", "sum(value.byts)"];
    let (result, _, _) = ctl_on(t, &bad).await;
    let e = result.unwrap_err();
    assert!(e.is::<bpfmapctl::Usage>(), "{e}");
    assert!(
        e.to_string()
            .ends_with(
                "aggregates[0]: value.byts: no such member of struct flow_stats (members: packets, bytes)"
            ),
        "{e}"
    );
    // Spellings of aggregates that do not exist, refused with the ones that do.
    for (arg, says) in [
        (
            "avg(value.bytes)",
            "use count(), sum(FIELD), min(FIELD) or max(FIELD)",
        ),
        (
            "sum()",
            "sum() needs an integer member, as in sum(value.bytes)",
        ),
        (
            "count(value.bytes)",
            "count() counts entries and takes no field",
        ),
    ] {
        use clap::Parser as _;
        let e =
            bpfmapctl::Cli::try_parse_from(["bpfmapctl", "top", "flows", "--by", arg]).unwrap_err();
        assert_eq!(e.exit_code(), 2);
        assert!(e.to_string().contains(says), "{arg}: {e}");
    }
}

/// `dump --filter --fields` across the fleet: exactly the matching entries'
/// selected members, and summaries that count them.
async fn dump_with_filter_and_fields(t: &[Target]) {
    let args = [
        "dump",
        "flows",
        "--filter",
        "key.dport == 443 && value.bytes > 1000000",
        "--fields",
        "key.daddr,value.bytes",
    ];
    let (result, out, err) = ctl_on(t, &args).await;
    result.unwrap();
    let mut lines: Vec<String> = out.lines().map(str::to_owned).collect();
    lines.sort();
    let line = |t: &Target, daddr: u32, bytes: u64| {
        let daddr = net(daddr);
        format!(r#"{{"target":"{t}","key":{{"daddr":{daddr}}},"value":{{"bytes":"{bytes}"}}}}"#)
    };
    let mut want = vec![
        line(&t[0], 0xc0a8_0001, 5_000_000),
        line(&t[1], 0xc0a8_0002, 3_000_000),
        line(&t[1], 0xc0a8_0003, 4_000_000),
        line(&t[2], 0xc0a8_0003, 4_500_000),
    ];
    want.sort();
    assert_eq!(lines, want);
    let summaries = json_lines(&err);
    let entries: Vec<u64> = summaries[..3]
        .iter()
        .map(|s| s["entries"].as_u64().unwrap())
        .collect();
    let mut by_target: Vec<(String, u64)> = summaries[..3]
        .iter()
        .map(|s| s["target"].as_str().unwrap().to_owned())
        .zip(entries)
        .collect();
    by_target.sort();
    let mut want: Vec<(String, u64)> = vec![
        (t[0].to_string(), 1),
        (t[1].to_string(), 2),
        (t[2].to_string(), 1),
    ];
    want.sort();
    assert_eq!(by_target, want);
    assert_eq!(summaries[3]["entries"], json!(4));
    // Table, rendered: the projected members as columns.
    let table = [
        &["--format", "table", "--target", t[1].as_str()][..],
        &[
            "dump",
            "flows",
            "--filter",
            "value.bytes > 3500000",
            "--fields",
            "key.daddr,value.bytes,key.dport",
            "--render",
            "key.daddr=ipv4",
        ],
    ]
    .concat();
    let (result, out, _) = ctl(&table).await;
    result.unwrap();
    assert_eq!(
        out,
        format!(
            "TARGET{}  daddr        dport  bytes\n{}  192.168.0.3  443    4000000\n",
            " ".repeat(t[1].as_str().len() - 6),
            t[1]
        )
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_host_that_fails_between_phases_is_left_out_and_the_answer_stays_exact() {
    let data = fleet_data(19);
    let fleet_of = TestFleet::start(108, &data).await;
    let direct = fleet_of.targets();
    // Every host but the fourth, by full dumps: the answer to expect.
    let others: Vec<Target> = direct
        .iter()
        .filter(|t| **t != direct[3])
        .cloned()
        .collect();
    let alive = full_dumps(&Fleet::new(others, ConnectOptions::default())).await;
    // The fourth answers the first phase (allow 1) or the first two.
    for allow in [1, 2] {
        let listen = format!("127.0.109.{allow}:0");
        let addr = fleet_of.daemons[3].running.local_addr();
        let proxy = CountingProxy::allowing(&listen, addr, allow).await;
        let flaky: Target = proxy.addr.to_string().parse().unwrap();
        let mut targets = direct.clone();
        targets[3] = flaky.clone();
        let fleet = Fleet::new(targets, ConnectOptions::default());
        let result = fleet_top(&fleet, By::Bytes, 10).await;
        assert_eq!(
            result.missing,
            std::slice::from_ref(&flaky),
            "allow {allow}"
        );
        assert_eq!(
            rows(&result),
            brute_top(&alive, By::Bytes, 10),
            "allow {allow}"
        );
        let report = &result.reports[3];
        assert_eq!(report.calls, allow as u32, "{report:?}");
        let code = report.error.as_ref().map(|e| e.code());
        assert!(
            matches!(
                code,
                Some(Code::Unavailable | Code::Unknown | Code::Internal | Code::Cancelled)
            ),
            "{report:?}"
        );
        println!("allow {allow}: {:?}", result.method);
    }
    fleet_of.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn aggregates_on_one_daemon_and_given_groups_across_the_fleet() {
    let data = small_fleet();
    let fleet_of = TestFleet::start(110, &data).await;
    let map = "flows".parse().unwrap();
    let options = AggregateOptions::default()
        .with_group_by(["key.daddr"])
        .with_aggregates(aggregates(By::Bytes))
        .with_render([("key.daddr", "ipv4")]);
    let host0 = fleet_of.daemons[0].client().await;
    let result = host0.aggregate(&map, options.clone()).await.unwrap();
    let groups: Vec<(Json, Vec<Option<i128>>, Vec<u8>)> = result
        .groups()
        .iter()
        .map(|g| {
            let key = json_of(&g.key()["key.daddr"]);
            (key, g.values().to_vec(), g.key_bytes().to_vec())
        })
        .collect();
    assert_eq!(
        groups,
        [
            (
                json!("192.168.0.1"),
                vec![Some(5_000_500), Some(2), Some(30)],
                0xc0a8_0001u32.to_be_bytes().to_vec()
            ),
            (
                json!("192.168.0.2"),
                vec![Some(2_000), Some(1), Some(20)],
                0xc0a8_0002u32.to_be_bytes().to_vec()
            ),
        ]
    );
    let s = result.summary();
    assert_eq!(
        (
            s.entries_scanned(),
            s.entries_matched(),
            s.groups_total(),
            s.order_non_negative()
        ),
        (3, 3, 2, true)
    );
    // Given groups, from every host: one held by two hosts, one by none
    // (and the first again: asked once).
    let given = options.with_groups([
        0xc0a8_0003u32.to_be_bytes().to_vec(),
        0xc0a8_0009u32.to_be_bytes().to_vec(),
        0xc0a8_0003u32.to_be_bytes().to_vec(),
    ]);
    let fleet = fleet_of.fleet();
    let result = fleet
        .aggregate(&map, FleetAggregateOptions::default().with_aggregate(given))
        .await;
    assert_eq!(result.method, MergeMethod::Groups);
    let t = fleet_of.targets();
    let got: Vec<(Json, Vec<Option<i128>>, Vec<Target>)> = result
        .groups
        .iter()
        .map(|g| {
            (
                json_of(&g.group.key()["key.daddr"]),
                g.group.values().to_vec(),
                g.hosts.clone(),
            )
        })
        .collect();
    assert_eq!(
        got,
        [
            (
                json!("192.168.0.3"),
                vec![Some(8_500_000), Some(2), Some(9)],
                vec![t[1].clone(), t[2].clone()]
            ),
            (json!("192.168.0.9"), vec![Some(0), Some(0), None], vec![]),
        ]
    );
    assert!(
        result
            .reports
            .iter()
            .all(|r| r.is_ok() && r.calls == 1 && r.entries == 2)
    );
    fleet_of.stop().await;
}

/// A map keyed by `__u32 daddr` with `struct { __s64 delta; }` values:
/// sums that may be negative.
fn signed_map(fs: &BpfFs, rel: &str, entries: &[(u32, i64)]) -> OwnedMap {
    let mut b = BtfBuilder::new();
    let u32_ = b.add_int("unsigned int", 4, E::Unsigned);
    let s64 = b.add_int("long long", 8, E::Signed);
    let key = b.add_struct("dst", 4, &[M::new("daddr", u32_, 0)]);
    let value = b.add_struct("change", 8, &[M::new("delta", s64, 0)]);
    let btf = OwnedBtf::load(&b.to_bytes()).unwrap_or_else(|e| panic!("BPF_BTF_LOAD: {e}"));
    let map = create_map_with(&CreateMap {
        map_type: MapType::HASH.0,
        key_size: 4,
        value_size: 8,
        max_entries: 64,
        name: "signed",
        btf: Some(btf.for_map(key, value)),
        ..Default::default()
    });
    for (daddr, delta) in entries {
        update(&map, &daddr.to_le_bytes(), &delta.to_le_bytes());
    }
    fs.pin(&map, rel);
    map
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sums_that_may_be_negative_merge_every_group() {
    let fleet_of = TestFleet::start(111, &small_fleet()).await;
    let per_host: [&[(u32, i64)]; 3] = [
        &[(1, 100), (2, -50), (3, 7)],
        &[(1, -120), (2, 60), (4, 5)],
        &[(3, 1), (4, -1), (5, -1_000_000_000_000)],
    ];
    let _maps: Vec<OwnedMap> = per_host
        .iter()
        .enumerate()
        .map(|(h, e)| signed_map(&fleet_of.fs, &format!("host{h}/signed"), e))
        .collect();
    let options = AggregateOptions::default()
        .with_group_by(["key.daddr"])
        .with_aggregate(Aggregate::sum("value.delta"))
        .with_aggregate(Aggregate::min("value.delta"))
        .with_limit(3);
    let map = "signed".parse().unwrap();
    let one = fleet_of.daemons[0].client().await;
    let s = one.aggregate(&map, options.clone()).await.unwrap();
    assert!(!s.summary().order_non_negative());
    let result = fleet_of
        .fleet()
        .aggregate(
            &map,
            FleetAggregateOptions::default().with_aggregate(options),
        )
        .await;
    assert_eq!(result.method, MergeMethod::AllGroups);
    let got: Vec<(Json, Vec<Option<i128>>)> = result
        .groups
        .iter()
        .map(|g| {
            (
                json_of(&g.group.key()["key.daddr"]),
                g.group.values().to_vec(),
            )
        })
        .collect();
    // Totals: 1 -> -20, 2 -> 10, 3 -> 8, 4 -> 4, 5 -> -1e12.
    assert_eq!(
        got,
        [
            (json!(2), vec![Some(10), Some(-50)]),
            (json!(3), vec![Some(8), Some(1)]),
            (json!(4), vec![Some(4), Some(-1)]),
        ]
    );
    fleet_of.stop().await;
}

/// An address that accepts connections and never answers: a frozen host.
async fn black_hole(ip: &str) -> (Target, tokio::task::JoinHandle<()>) {
    let listener = tokio::net::TcpListener::bind(format!("{ip}:0"))
        .await
        .unwrap();
    let target = listener.local_addr().unwrap().to_string().parse().unwrap();
    let task = tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((c, _)) = listener.accept().await {
            held.push(c);
        }
    });
    (target, task)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_frozen_host_fails_at_the_answer_timeout_or_the_deadline() {
    use bpfmap_client::FleetOptions;
    let fleet_of = TestFleet::start(112, &small_fleet()).await;
    let (frozen, task) = black_hole("127.0.112.200").await;
    let targets = [fleet_of.targets(), vec![frozen.clone()]].concat();
    let alive = full_dumps(&fleet_of.fleet()).await;
    let want = brute_top(&alive, By::Bytes, 2);
    for (options, code, says) in [
        (
            FleetOptions::default().with_answer_timeout(std::time::Duration::from_millis(500)),
            Code::DeadlineExceeded,
            "no answer within 0.5 s",
        ),
        (
            FleetOptions::default().with_deadline(std::time::Duration::from_millis(700)),
            Code::DeadlineExceeded,
            "the run's deadline (0.7 s) passed before this target was done",
        ),
    ] {
        let fleet = Fleet::new(targets.clone(), ConnectOptions::default()).with_options(options);
        let started = std::time::Instant::now();
        let result = fleet_top(&fleet, By::Bytes, 2).await;
        assert!(
            started.elapsed() < std::time::Duration::from_secs(3),
            "{:?}",
            started.elapsed()
        );
        assert_eq!(result.missing, std::slice::from_ref(&frozen));
        assert_eq!(rows(&result), want);
        let e = result.reports[3].error.as_ref().unwrap();
        assert_eq!((e.code(), e.to_string()), (code, says.to_owned()));
    }
    task.abort();
    fleet_of.stop().await;
}
