//! Aggregates walked inside the kernel by programs the daemon generates
//! (SCAN_AUTO) against the same aggregates read in batches
//! (SCAN_BATCHED): random filters, groups and aggregates over real maps
//! of every type a program walks give the same answer both ways,
//! including 128-bit sums, negative members, network-order members and
//! bitfields; what a program cannot compute falls back and says why.
//!
//! The random cases are reproducible: the seed is printed, and
//! `BPFMAP_SCAN_SEED=N` replays it (`Rng::from_env`).

use bpfmap_proto::v1 as pb;
use bpfmap_tests::{conns, *};
use serde_json::Value as Json;

const KEY: &str = "struct { __u32 id; __u8 kind; __u8 pad[3]; }";
const VALUE: &str = "struct { __u64 big; __s64 neg; __s32 small; __be32 addr; __u16 port; __be16 nport; __u8 proto; __u8 flags; __u16 pad; __u32 lo:3, mid:13, hi:16; __s32 sb:7, rest:25; char name[8]; }";
const VALUE_SIZE: u32 = 48;
const ENTRIES: u32 = 2_000;

/// Members a filter or an aggregate reads, as paths.
const INTS: &[&str] = &[
    "value.big",
    "value.neg",
    "value.small",
    "value.addr",
    "value.port",
    "value.nport",
    "value.proto",
    "value.flags",
    "value.lo",
    "value.mid",
    "value.sb",
];
/// Members groups are made of (few values each).
const GROUPS: &[&str] = &["value.proto", "value.lo", "value.sb", "value.flags"];
/// Constants filters compare with.
const CONSTANTS: &[i128] = &[
    0,
    1,
    3,
    -1,
    -64,
    100,
    255,
    4096,
    65_535,
    1 << 31,
    -(1 << 31),
    i64::MAX as i128,
    u64::MAX as i128,
    1 << 40,
];

/// A constant as CEL spells it (beyond i64: an unsigned literal).
fn literal(k: i128) -> String {
    if k > i128::from(i64::MAX) {
        format!("{k}u")
    } else {
        k.to_string()
    }
}

/// A random condition over the members.
fn filter(rng: &mut Rng, depth: usize) -> String {
    let leaf = depth == 0 || rng.below(3) == 0;
    if leaf {
        let path = rng.pick(INTS);
        if rng.below(5) == 0 {
            let list: Vec<String> = (0..3).map(|_| literal(*rng.pick(CONSTANTS))).collect();
            return format!("{path} in [{}]", list.join(", "));
        }
        let op = rng.pick(&["==", "!=", "<", "<=", ">", ">="]);
        let k = literal(*rng.pick(CONSTANTS));
        return if rng.below(4) == 0 {
            format!("{k} {op} {path}")
        } else {
            format!("{path} {op} {k}")
        };
    }
    match rng.below(3) {
        0 => format!("!({})", filter(rng, depth - 1)),
        1 => format!("({} && {})", filter(rng, depth - 1), filter(rng, depth - 1)),
        _ => format!("({} || {})", filter(rng, depth - 1), filter(rng, depth - 1)),
    }
}

/// A random AggregateMap request over `path`.
fn request(rng: &mut Rng, path: &str, key_members: bool) -> pb::AggregateMapRequest {
    let n = 1 + rng.below(4) as usize;
    let aggregates: Vec<pb::Aggregate> = (0..n)
        .map(|_| {
            let op = *rng.pick(&[
                pb::aggregate::Op::Count,
                pb::aggregate::Op::Sum,
                pb::aggregate::Op::Min,
                pb::aggregate::Op::Max,
            ]);
            pb::Aggregate {
                op: op as i32,
                field: if op == pb::aggregate::Op::Count {
                    String::new()
                } else {
                    rng.pick(INTS).to_string()
                },
            }
        })
        .collect();
    let mut group_by: Vec<String> = Vec::new();
    for _ in 0..rng.below(3) {
        let g = if key_members && rng.below(3) == 0 {
            "key.kind"
        } else {
            rng.pick(GROUPS)
        };
        if !group_by.iter().any(|x| x == g) {
            group_by.push(g.to_owned());
        }
    }
    pb::AggregateMapRequest {
        map: map_ref(path),
        filter: if rng.below(4) == 0 {
            String::new()
        } else {
            filter(rng, 3)
        },
        group_by,
        order_by: rng.below(n as u64) as u32,
        ascending: rng.below(2) == 0,
        limit: *rng.pick(&[0, 3, 10]),
        aggregates,
        ..Default::default()
    }
}

/// An answer's groups (key bytes and values), then its counts: entries
/// scanned and matched, groups.
type Answer = (Vec<(Vec<u8>, Vec<Json>)>, u64, u64, u64);

fn answer(r: &pb::AggregateMapResponse) -> Answer {
    let s = r.summary.clone().unwrap();
    (
        r.groups
            .iter()
            .map(|g| (g.key_bytes.clone(), g.values.iter().map(json_of).collect()))
            .collect(),
        s.entries_scanned,
        s.entries_matched,
        s.groups_total,
    )
}

/// A map of `map_type` pinned at `path` with random entries.
fn random_map(fs: &BpfFs, path: &str, map_type: MapType, rng: &mut Rng) -> OwnedMap {
    let array = matches!(map_type, MapType::ARRAY | MapType::PERCPU_ARRAY);
    let key_size = if array { 4 } else { 8 };
    let map = create_map(map_type, key_size, VALUE_SIZE, ENTRIES * 2);
    let cpus = if map.meta().per_cpu() {
        map.meta().possible_cpus as usize
    } else {
        1
    };
    let entries = if array { ENTRIES * 2 } else { ENTRIES };
    for id in 0..entries {
        let mut key = id.to_ne_bytes().to_vec();
        if !array {
            key.extend([rng.below(5) as u8, 0, 0, 0]);
        }
        let mut value = Vec::new();
        for _ in 0..cpus {
            let mut v: Vec<u8> = (0..VALUE_SIZE / 8)
                .flat_map(|_| rng.next().to_ne_bytes())
                .collect();
            // Few distinct protocols and flags, so that groups repeat.
            v[28] = rng.below(6) as u8;
            v[29] = rng.below(4) as u8;
            value.extend(v);
        }
        update(&map, &key, &value);
    }
    fs.pin(&map, path);
    map
}

fn types(maps: &[&str], key: &str) -> bpfmapd::TypesConfig {
    bpfmapd::TypesConfig {
        maps: maps.iter().map(|m| m.to_string()).collect(),
        names: Vec::new(),
        key: key.into(),
        value: VALUE.into(),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn random_aggregates_in_the_kernel_equal_the_batched_reads() {
    let mut rng = Rng::from_env("BPFMAP_SCAN_SEED");
    let (fs, state) = (BpfFs::new(), tempfile::tempdir().unwrap());
    let kinds = [
        ("s/hash", MapType::HASH),
        ("s/lru", MapType::LRU_HASH),
        ("s/array", MapType::ARRAY),
    ];
    let _maps: Vec<_> = kinds
        .iter()
        .map(|(p, t)| random_map(&fs, p, *t, &mut rng))
        .collect();
    let daemon = Daemon::start_with(bpfmapd::Config {
        types: vec![
            types(&["s/hash", "s/lru", "s/percpu"], KEY),
            types(&["s/array"], "__u32"),
        ],
        ..Daemon::config(fs.path(), state.path())
    })
    .await;
    let mut c = grpc(&daemon.addr()).await;
    let mut in_kernel = 0;
    for (path, _) in kinds {
        for case in 0..60 {
            let req = request(&mut rng, path, path != "s/array");
            let auto = c.aggregate_map(req.clone()).await;
            let batched = c
                .aggregate_map(pb::AggregateMapRequest {
                    scan: pb::ScanMethod::ScanBatched as i32,
                    ..req.clone()
                })
                .await;
            let (auto, batched) = match (auto, batched) {
                (Ok(a), Ok(b)) => (a.into_inner(), b.into_inner()),
                (Err(a), Err(b)) => {
                    eprintln!("case {case} of {path}: {}", a.message());
                    assert_eq!((a.code(), a.message()), (b.code(), b.message()), "{req:?}");
                    continue;
                }
                (a, b) => panic!("case {case} of {path}: {a:?} against {b:?}: {req:?}"),
            };
            assert_eq!(
                answer(&auto),
                answer(&batched),
                "case {case} of {path}: {req:?}"
            );
            let s = auto.summary.unwrap();
            assert!(s.scanned_in_kernel, "{}: {req:?}", s.scan_note);
            assert!(!batched.summary.unwrap().scanned_in_kernel);
            in_kernel += 1;
        }
    }
    assert!(in_kernel >= 170, "only {in_kernel} cases of 180 answered");
    daemon.stop().await;
}

/// A member of one CPU's value or of the sum, as a path.
fn per_cpu_path(rng: &mut Rng, cpus: u64) -> String {
    let member = rng.pick(INTS).trim_start_matches("value.");
    if rng.below(4) == 0 {
        format!("values[{}].{member}", rng.below(cpus))
    } else {
        format!("value.{member}")
    }
}

/// [`request`] for a per-CPU map: its members summed (`value.x`) or one
/// CPU's (`values[i].x`), each CPU's value taken alone or the sums
/// (per_cpu).
fn per_cpu_request(rng: &mut Rng, path: &str, cpus: u64) -> pb::AggregateMapRequest {
    let mut req = request(rng, path, path != "p/array");
    for a in &mut req.aggregates {
        if !a.field.is_empty() {
            a.field = per_cpu_path(rng, cpus);
        }
    }
    if rng.below(3) == 0 {
        let cpu = rng.below(cpus);
        let k = literal(*rng.pick(CONSTANTS));
        req.filter = format!("values[{cpu}].flags < 2 || value.small >= {k}");
    }
    req.per_cpu = if rng.below(2) == 0 {
        pb::PerCpu::Each
    } else {
        pb::PerCpu::Sum
    } as i32;
    req
}

/// Per-CPU maps walked inside the kernel (every CPU's value looked up in
/// the callback) answer as the batched read: random filters on sums and on
/// one CPU's value, groups by summed members, every aggregate with
/// PER_CPU_EACH and PER_CPU_SUM, over per-CPU hash, LRU per-CPU hash and
/// per-CPU array maps.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn random_aggregates_of_per_cpu_maps_in_the_kernel_equal_the_batched_reads() {
    let mut rng = Rng::from_env("BPFMAP_SCAN_SEED");
    let (fs, state) = (BpfFs::new(), tempfile::tempdir().unwrap());
    let kinds = [
        ("p/hash", MapType::PERCPU_HASH),
        ("p/lru", MapType::LRU_PERCPU_HASH),
        ("p/array", MapType::PERCPU_ARRAY),
    ];
    let maps: Vec<_> = kinds
        .iter()
        .map(|(p, t)| random_map(&fs, p, *t, &mut rng))
        .collect();
    let cpus = u64::from(maps[0].meta().possible_cpus);
    let daemon = Daemon::start_with(bpfmapd::Config {
        types: vec![
            types(&["p/hash", "p/lru"], KEY),
            types(&["p/array"], "__u32"),
        ],
        ..Daemon::config(fs.path(), state.path())
    })
    .await;
    let mut c = grpc(&daemon.addr()).await;
    let (mut in_kernel, mut cases) = (0, 0);
    for (path, _) in kinds {
        for case in 0..50 {
            let req = per_cpu_request(&mut rng, path, cpus);
            let Some((auto, batched)) = both_ways(&mut c, &req).await else {
                continue;
            };
            assert_eq!(
                answer(&auto),
                answer(&batched),
                "case {case} of {path}: {req:?}"
            );
            cases += 1;
            let s = auto.summary.unwrap();
            if s.scanned_in_kernel {
                in_kernel += 1;
            } else {
                assert!(!s.scan_note.is_empty(), "case {case} of {path}: {req:?}");
            }
        }
    }
    eprintln!("{in_kernel} of {cases} aggregates of per-CPU maps walked inside the kernel");
    assert!(in_kernel >= cases * 9 / 10, "only {in_kernel} of {cases}");
    daemon.stop().await;
}

/// `req` answered with SCAN_AUTO and with SCAN_BATCHED; `None` when both
/// fail alike (the same code and message).
async fn both_ways(
    c: &mut Grpc,
    req: &pb::AggregateMapRequest,
) -> Option<(pb::AggregateMapResponse, pb::AggregateMapResponse)> {
    let auto = c.aggregate_map(req.clone()).await;
    let batched = c
        .aggregate_map(pb::AggregateMapRequest {
            scan: pb::ScanMethod::ScanBatched as i32,
            ..req.clone()
        })
        .await;
    match (auto, batched) {
        (Ok(a), Ok(b)) => Some((a.into_inner(), b.into_inner())),
        (Err(a), Err(b)) => {
            assert_eq!((a.code(), a.message()), (b.code(), b.message()), "{req:?}");
            None
        }
        (a, b) => panic!("{a:?} against {b:?}: {req:?}"),
    }
}

/// Group keys of the connections (`bpfmap_tests::conns`), from an enum
/// to several members: the narrow ones (at most 16 bits) go to a dense
/// table inside the program, the others to a hash map.
const CONN_GROUPS: &[&[&str]] = &[
    &["key.proto"],
    &["key.dport"],
    &["value.lo"],
    &["value.hi"],
    &["key.proto", "value.lo"],
    &["value.lo", "key.proto", "key.pad"],
    &["key.dport", "key.proto"],
    &["key.saddr"],
    &["value.delta"],
    &["value.comm"],
];

/// Members of the connections aggregates and filters read.
const CONN_INTS: &[&str] = &[
    "value.packets",
    "value.bytes",
    "value.delta",
    "value.lo",
    "value.hi",
    "key.dport",
    "key.proto",
];

/// `n` random connections, pinned at `path`: few protocols and ports, a
/// signed delta, every bit of the bitfields.
fn random_conns(fs: &BpfFs, path: &str, n: u32, rng: &mut Rng) -> OwnedMap {
    let map = conns::map(MapType::HASH, n * 2);
    let rows: Vec<conns::Conn> = (0..n)
        .map(|i| conns::Conn {
            saddr: i,
            dport: rng.below(3000) as u16,
            proto: rng.pick(&conns::PROTOS).1,
            packets: rng.next() >> rng.below(64),
            bytes: rng.next(),
            comm: *b"conn\0\0\0\0",
            delta: rng.next() as i32 >> rng.below(31),
            lo: rng.below(16) as u32,
            hi: rng.below(4096) as u32,
        })
        .collect();
    conns::fill(&map, n, |i, _| rows[i as usize]);
    fs.pin(&map, path);
    map
}

/// A random aggregate of the connections.
fn conn_request(rng: &mut Rng, path: &str) -> pb::AggregateMapRequest {
    let n = 1 + rng.below(3) as usize;
    let aggregates = (0..n)
        .map(|_| {
            let op = *rng.pick(&[
                pb::aggregate::Op::Count,
                pb::aggregate::Op::Sum,
                pb::aggregate::Op::Min,
                pb::aggregate::Op::Max,
            ]);
            let field = match op {
                pb::aggregate::Op::Count => String::new(),
                _ => rng.pick(CONN_INTS).to_string(),
            };
            pb::Aggregate {
                op: op as i32,
                field,
            }
        })
        .collect();
    let member = rng.pick(CONN_INTS);
    let k = *rng.pick(&[0i128, 6, 17, 100, 1000, -5, 1 << 40]);
    pb::AggregateMapRequest {
        map: map_ref(path),
        filter: match rng.below(3) {
            0 => String::new(),
            1 => format!("{member} > {k}"),
            _ => format!("!({member} <= {k}) || key.dport < 1000"),
        },
        group_by: rng
            .pick(CONN_GROUPS)
            .iter()
            .map(|g| g.to_string())
            .collect(),
        order_by: rng.below(n as u64) as u32,
        ascending: rng.below(2) == 0,
        limit: *rng.pick(&[0, 3, 10]),
        aggregates,
        ..Default::default()
    }
}

/// Aggregates of connections with BTF (an enum, bitfields, a char array)
/// grouped by narrow keys (a dense table inside the program: an enum, a
/// __u16, bitfields, several members of 16 bits in all) and wide ones (a
/// hash map: 24 and 32 bits, 5,000 groups, bytes) answer as the batched
/// read, all inside the kernel.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn random_aggregates_by_narrow_and_wide_keys_in_the_kernel_equal_the_batched_reads() {
    let mut rng = Rng::from_env("BPFMAP_SCAN_SEED");
    let (fs, state) = (BpfFs::new(), tempfile::tempdir().unwrap());
    let _conns = random_conns(&fs, "c/conns", 5000, &mut rng);
    let daemon = Daemon::start(fs.path(), state.path()).await;
    let mut c = grpc(&daemon.addr()).await;
    for case in 0..80 {
        let req = conn_request(&mut rng, "c/conns");
        let (auto, batched) = both_ways(&mut c, &req)
            .await
            .unwrap_or_else(|| panic!("case {case} failed: {req:?}"));
        assert_eq!(answer(&auto), answer(&batched), "case {case}: {req:?}");
        let s = auto.summary.unwrap();
        assert!(s.scanned_in_kernel, "case {case}: {}: {req:?}", s.scan_note);
    }
    // Every group of the 32-bit member: 5,000 of them.
    let by_saddr = pb::AggregateMapRequest {
        group_by: vec!["key.saddr".into()],
        aggregates: vec![pb::Aggregate {
            op: pb::aggregate::Op::Count as i32,
            field: String::new(),
        }],
        order_by: 0,
        ..conn_request(&mut rng, "c/conns")
    };
    let (auto, batched) = both_ways(
        &mut c,
        &pb::AggregateMapRequest {
            filter: String::new(),
            ..by_saddr
        },
    )
    .await
    .expect("an aggregate of every group answers");
    assert_eq!(auto.summary.as_ref().unwrap().groups_total, 5000);
    assert_eq!(answer(&auto), answer(&batched));
    daemon.stop().await;
}

/// One group more than limits.max_groups ends the call as the batched read
/// does, whether the program keeps its groups in a dense table (a 12-bit
/// member, 4,096 slots) or a hash map (a 32-bit member).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_scan_in_the_kernel_keeps_to_max_groups_in_either_table() {
    let mut rng = Rng(5);
    let (fs, state) = (BpfFs::new(), tempfile::tempdir().unwrap());
    let _conns = random_conns(&fs, "c/conns", 5000, &mut rng);
    let mut config = Daemon::config(fs.path(), state.path());
    config.limits.max_groups = 100;
    let daemon = Daemon::start_with(config).await;
    let mut c = grpc(&daemon.addr()).await;
    for group_by in ["value.hi", "key.saddr"] {
        let req = pb::AggregateMapRequest {
            map: map_ref("c/conns"),
            group_by: vec![group_by.into()],
            aggregates: vec![pb::Aggregate {
                op: pb::aggregate::Op::Sum as i32,
                field: "value.packets".into(),
            }],
            ..Default::default()
        };
        let auto = c.aggregate_map(req.clone()).await.unwrap_err();
        let batched = c
            .aggregate_map(pb::AggregateMapRequest {
                scan: pb::ScanMethod::ScanBatched as i32,
                ..req
            })
            .await
            .unwrap_err();
        assert_eq!(auto.code(), tonic::Code::ResourceExhausted);
        assert_eq!(
            auto.message(),
            "more than 100 groups (limits.max_groups): 101 seen before the walk stopped; group by fewer or coarser members, or filter"
        );
        assert_eq!(
            (auto.code(), auto.message()),
            (batched.code(), batched.message())
        );
    }
    daemon.stop().await;
}

/// Past 2^17 groups in a hash map, a walk inside the kernel costs more
/// than the batched read (tests/docs/performance.md): with SCAN_AUTO it
/// stops there and the map is read in batches, saying why; SCAN_KERNEL
/// walks inside the kernel still. The answers are the same.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn past_the_groups_where_the_kernel_stops_paying_auto_reads_in_batches() {
    let mut rng = Rng(11);
    let (fs, state) = (BpfFs::new(), tempfile::tempdir().unwrap());
    let _conns = random_conns(&fs, "c/conns", 140_000, &mut rng);
    let mut config = Daemon::config(fs.path(), state.path());
    config.limits.max_groups = 200_000;
    let daemon = Daemon::start_with(config).await;
    let c = grpc(&daemon.addr()).await;
    let req = pb::AggregateMapRequest {
        map: map_ref("c/conns"),
        group_by: vec!["key.saddr".into()],
        aggregates: vec![pb::Aggregate {
            op: pb::aggregate::Op::Sum as i32,
            field: "value.packets".into(),
        }],
        limit: 10,
        ..Default::default()
    };
    let ask = |scan: pb::ScanMethod| {
        let mut c = c.clone();
        let req = pb::AggregateMapRequest {
            scan: scan as i32,
            ..req.clone()
        };
        async move { c.aggregate_map(req).await.unwrap().into_inner() }
    };
    let auto = ask(pb::ScanMethod::ScanAuto).await;
    let kernel = ask(pb::ScanMethod::ScanKernel).await;
    let batched = ask(pb::ScanMethod::ScanBatched).await;
    let s = auto.summary.clone().unwrap();
    assert!(!s.scanned_in_kernel, "{s:?}");
    assert_eq!(
        s.scan_note,
        "more than 131072 groups: beyond that a walk inside the kernel costs more than the batched read (SCAN_KERNEL walks inside the kernel still)"
    );
    assert_eq!(s.groups_total, 140_000);
    assert!(kernel.summary.as_ref().unwrap().scanned_in_kernel);
    assert_eq!(answer(&auto), answer(&batched));
    assert_eq!(answer(&kernel), answer(&batched));
    daemon.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn what_a_program_cannot_compute_is_read_in_batches_and_said() {
    let mut rng = Rng(7);
    let (fs, state) = (BpfFs::new(), tempfile::tempdir().unwrap());
    let _hash = random_map(&fs, "s/hash", MapType::HASH, &mut rng);
    let _percpu = random_map(&fs, "s/percpu", MapType::PERCPU_HASH, &mut rng);
    let trie = create_map_with(&bpfmap_kernel::CreateMap {
        map_type: MapType::LPM_TRIE.0,
        key_size: 8,
        value_size: 4,
        max_entries: 16,
        flags: 1,
        name: "trie",
        ..Default::default()
    });
    fs.pin(&trie, "s/trie");
    let daemon = Daemon::start_with(bpfmapd::Config {
        types: vec![types(&["s/hash", "s/percpu"], KEY)],
        ..Daemon::config(fs.path(), state.path())
    })
    .await;
    let mut c = grpc(&daemon.addr()).await;
    let sum = |path: &str, field: &str, filter: &str| pb::AggregateMapRequest {
        map: map_ref(path),
        filter: filter.into(),
        aggregates: vec![pb::Aggregate {
            op: pb::aggregate::Op::Sum as i32,
            field: field.into(),
        }],
        ..Default::default()
    };
    for (req, note) in [
        (
            sum("s/hash", "value.big", "value.name == \"x\""),
            "the filter reads text or bytes",
        ),
        (
            sum("s/hash", "value.big", "value.small + 1 > 0"),
            "the filter computes arithmetic",
        ),
        (
            pb::AggregateMapRequest {
                group_by: vec!["values[0].name".into()],
                ..sum("s/percpu", "value.big", "")
            },
            "a group by bytes of a per-CPU map's value is computed in user space",
        ),
    ] {
        let auto = c.aggregate_map(req.clone()).await.unwrap().into_inner();
        let s = auto.summary.clone().unwrap();
        assert!(!s.scanned_in_kernel, "{req:?}");
        assert_eq!(s.scan_note, note);
        let batched = c
            .aggregate_map(pb::AggregateMapRequest {
                scan: pb::ScanMethod::ScanBatched as i32,
                ..req
            })
            .await
            .unwrap()
            .into_inner();
        assert_eq!(answer(&auto), answer(&batched));
    }
    // A per-CPU map's keys are read in the kernel: counts by key member.
    let by_kind = pb::AggregateMapRequest {
        map: map_ref("s/percpu"),
        group_by: vec!["key.kind".into()],
        aggregates: vec![pb::Aggregate {
            op: pb::aggregate::Op::Count as i32,
            field: String::new(),
        }],
        ..Default::default()
    };
    let r = c.aggregate_map(by_kind).await.unwrap().into_inner();
    assert!(r.summary.unwrap().scanned_in_kernel);
    let counted: u64 = r
        .groups
        .iter()
        .map(|g| {
            json_of(&g.values[0])
                .as_str()
                .unwrap()
                .parse::<u64>()
                .unwrap()
        })
        .sum();
    assert_eq!(counted, u64::from(ENTRIES));
    // GetMap says which maps a program walks.
    let info = |path: &str| pb::GetMapRequest { map: map_ref(path) };
    let hash = c.get_map(info("s/hash")).await.unwrap().into_inner();
    assert_eq!(hash.kernel_scans_unavailable, "");
    let t = c.get_map(info("s/trie")).await.unwrap().into_inner();
    assert_eq!(
        t.kernel_scans_unavailable,
        "bpf_for_each_map_elem does not walk lpm_trie maps"
    );
    // The metrics count the scans and the fallbacks.
    daemon.stop().await;
}

/// More groups than limits.max_groups: the program's groups map is that
/// large, and the call fails as the batched read does, with the same
/// message.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_scan_in_the_kernel_keeps_to_max_groups() {
    let mut rng = Rng(11);
    let (fs, state) = (BpfFs::new(), tempfile::tempdir().unwrap());
    let _hash = random_map(&fs, "s/hash", MapType::HASH, &mut rng);
    let mut config = bpfmapd::Config {
        types: vec![types(&["s/hash"], KEY)],
        ..Daemon::config(fs.path(), state.path())
    };
    config.limits.max_groups = 4;
    let daemon = Daemon::start_with(config).await;
    let mut c = grpc(&daemon.addr()).await;
    let req = |group_by: &str, scan: pb::ScanMethod| pb::AggregateMapRequest {
        map: map_ref("s/hash"),
        group_by: vec![group_by.into()],
        aggregates: vec![pb::Aggregate {
            op: pb::aggregate::Op::Count as i32,
            field: String::new(),
        }],
        scan: scan as i32,
        ..Default::default()
    };
    // value.proto takes 6 values.
    let auto = c
        .aggregate_map(req("value.proto", pb::ScanMethod::ScanAuto))
        .await
        .unwrap_err();
    let batched = c
        .aggregate_map(req("value.proto", pb::ScanMethod::ScanBatched))
        .await
        .unwrap_err();
    assert_eq!(auto.code(), tonic::Code::ResourceExhausted);
    assert_eq!(
        auto.message(),
        "more than 4 groups (limits.max_groups): 5 seen before the walk stopped; group by fewer or coarser members, or filter"
    );
    assert_eq!(
        (auto.code(), auto.message()),
        (batched.code(), batched.message())
    );
    // value.flags takes 4: within the limit, in the kernel.
    let r = c
        .aggregate_map(req("value.flags", pb::ScanMethod::ScanAuto))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(r.groups.len(), 4);
    assert!(r.summary.unwrap().scanned_in_kernel);
    daemon.stop().await;
}

/// What a walk inside the kernel misses or counts twice while a writer
/// replaces entries (every update of a hash entry from user space links a
/// new element and unlinks the old one): each replacement during a scan
/// can make it miss that entry or count it twice, no more; the batched
/// read, which locks each bucket as it copies it, counts exactly. The
/// figures are printed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_scan_in_the_kernel_misses_or_repeats_at_most_the_entries_replaced_meanwhile() {
    const N: u32 = 50_000;
    let (fs, state) = (BpfFs::new(), tempfile::tempdir().unwrap());
    let map = std::sync::Arc::new(create_map(MapType::HASH, 4, 8, N));
    for i in 0..N {
        update(&map, &i.to_ne_bytes(), &0u64.to_ne_bytes());
    }
    fs.pin(&map, "s/replaced");
    let daemon = Daemon::start(fs.path(), state.path()).await;
    let mut c = grpc(&daemon.addr()).await;
    let replaced = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0));
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let writer = {
        let (map, replaced, stop) = (map.clone(), replaced.clone(), stop.clone());
        std::thread::spawn(move || {
            let mut i = 0u32;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                i = (i + 7919) % N;
                update(&map, &i.to_ne_bytes(), &u64::from(i).to_ne_bytes());
                replaced.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            }
        })
    };
    let count = |scan: pb::ScanMethod| pb::AggregateMapRequest {
        map: map_ref("s/replaced"),
        aggregates: vec![pb::Aggregate {
            op: pb::aggregate::Op::Count as i32,
            field: String::new(),
        }],
        scan: scan as i32,
        ..Default::default()
    };
    let (mut off, mut worst, mut during) = (0u32, 0i64, 0u64);
    for _ in 0..40 {
        let before = replaced.load(std::sync::atomic::Ordering::Relaxed);
        let r = c
            .aggregate_map(count(pb::ScanMethod::ScanAuto))
            .await
            .unwrap();
        let meanwhile = replaced.load(std::sync::atomic::Ordering::Relaxed) - before;
        let r = r.into_inner();
        assert!(r.summary.unwrap().scanned_in_kernel);
        let counted: i64 = json_of(&r.groups[0].values[0])
            .as_str()
            .unwrap()
            .parse()
            .unwrap();
        let deviation = counted - i64::from(N);
        assert!(
            deviation.unsigned_abs() <= meanwhile,
            "counted {counted} of {N} with {meanwhile} replacements during the scan"
        );
        off += u32::from(deviation != 0);
        if deviation.abs() > worst.abs() {
            worst = deviation;
        }
        during += meanwhile;
        let b = c
            .aggregate_map(count(pb::ScanMethod::ScanBatched))
            .await
            .unwrap()
            .into_inner();
        let counted: u64 = json_of(&b.groups[0].values[0])
            .as_str()
            .unwrap()
            .parse()
            .unwrap();
        assert_eq!(counted, u64::from(N), "the batched read counts exactly");
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    writer.join().unwrap();
    eprintln!(
        "kernel scans of {N} entries under replacement: {off} of 40 scans off, the worst by {worst}, {} replacements per scan on average",
        during / 40
    );
    assert!(
        during > 0,
        "the writer replaced entries while the scans ran"
    );
    daemon.stop().await;
}

/// A packed dump's entries (key, value), its last cursor and its summary.
async fn dump(
    c: &mut Grpc,
    req: pb::DumpMapRequest,
) -> Result<(Vec<(Vec<u8>, Vec<u8>)>, String, pb::DumpSummary), tonic::Status> {
    let req = pb::DumpMapRequest {
        layout: pb::Layout::Packed as i32,
        ..req
    };
    let mut stream = c.dump_map(req).await?.into_inner();
    let (mut entries, mut cursor, mut summary) = (Vec::new(), String::new(), None);
    while let Some(m) = stream.message().await? {
        if let Some(p) = m.packed {
            let (ks, vs) = (p.key_size as usize, p.value_stride as usize);
            for i in 0..p.count as usize {
                entries.push((
                    p.keys[i * ks..(i + 1) * ks].to_vec(),
                    p.values[i * vs..(i + 1) * vs].to_vec(),
                ));
            }
        }
        cursor = m.cursor;
        summary = m.summary.or(summary);
    }
    Ok((entries, cursor, summary.expect("a summary")))
}

/// Filtered dumps walked inside the kernel (hash and LRU hash with
/// SCAN_KERNEL, arrays by default) send exactly the entries the batched
/// read sends, for random filters over every kind of integer member, some
/// with a part only user space tests (text).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn random_filtered_dumps_in_the_kernel_send_the_batched_reads_entries() {
    let mut rng = Rng::from_env("BPFMAP_SCAN_SEED");
    let (fs, state) = (BpfFs::new(), tempfile::tempdir().unwrap());
    let kinds = [
        ("s/hash", MapType::HASH, pb::ScanMethod::ScanKernel),
        ("s/lru", MapType::LRU_HASH, pb::ScanMethod::ScanKernel),
        ("s/array", MapType::ARRAY, pb::ScanMethod::ScanAuto),
    ];
    let _maps: Vec<_> = kinds
        .iter()
        .map(|(p, t, _)| random_map(&fs, p, *t, &mut rng))
        .collect();
    let daemon = Daemon::start_with(bpfmapd::Config {
        types: vec![
            types(&["s/hash", "s/lru"], KEY),
            types(&["s/array"], "__u32"),
        ],
        ..Daemon::config(fs.path(), state.path())
    })
    .await;
    let mut c = grpc(&daemon.addr()).await;
    let (mut in_kernel, mut partial, mut cases) = (0, 0, 0);
    for (path, _, scan) in kinds {
        for case in 0..40 {
            let mut f = filter(&mut rng, 3);
            let text = rng.below(4) == 0;
            if text {
                f = format!("({f}) && value.name != \"x\"");
            }
            let req = pb::DumpMapRequest {
                map: map_ref(path),
                filter: f,
                scan: scan as i32,
                ..Default::default()
            };
            let (mut got, _, s) = dump(&mut c, req.clone()).await.unwrap();
            let batched = pb::DumpMapRequest {
                scan: pb::ScanMethod::ScanBatched as i32,
                ..req.clone()
            };
            let (mut want, _, b) = dump(&mut c, batched).await.unwrap();
            assert!(!b.scanned_in_kernel);
            assert_eq!((s.entries, s.complete), (want.len() as u64, true));
            assert_eq!(s.entries_scanned, b.entries_scanned, "{req:?}");
            cases += 1;
            if s.scanned_in_kernel {
                in_kernel += 1;
                // In the order of their keys: indexes, or key bytes.
                let mut sorted = got.clone();
                if path == "s/array" {
                    sorted.sort_by_key(|(k, _)| u32::from_ne_bytes(k[..4].try_into().unwrap()));
                } else {
                    sorted.sort();
                }
                assert_eq!(got, sorted, "case {case} of {path}: {req:?}");
                if text {
                    partial += 1;
                    assert_eq!(
                        s.scan_note,
                        "part of the filter is tested in user space: the filter reads text or bytes"
                    );
                }
            } else {
                // Random filters often take every entry once folded
                // (`value.flags >= -64`): those read in batches.
                assert!(!s.scan_note.is_empty(), "case {case} of {path}: {req:?}");
            }
            got.sort();
            want.sort();
            assert_eq!(got, want, "case {case} of {path}: {}", s.scan_note);
        }
    }
    eprintln!(
        "{in_kernel} of {cases} dumps walked inside the kernel, {partial} with part of the filter in user space"
    );
    assert!(in_kernel >= cases / 2, "only {in_kernel} of {cases}");
    assert!(partial > 0);
    daemon.stop().await;
}

/// A dump walked inside the kernel resumes from each of its cursors with
/// nothing lost or sent twice; a hash map's cursors so issued resume only
/// with SCAN_KERNEL, an array's with either walk. SCAN_AUTO keeps hash
/// maps to the batched read, and says why.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dump_in_the_kernel_resumes_from_its_cursors_exactly_once() {
    let mut rng = Rng(11);
    let (fs, state) = (BpfFs::new(), tempfile::tempdir().unwrap());
    let _hash = random_map(&fs, "s/hash", MapType::HASH, &mut rng);
    let _array = random_map(&fs, "s/array", MapType::ARRAY, &mut rng);
    let daemon = Daemon::start_with(bpfmapd::Config {
        types: vec![types(&["s/hash"], KEY), types(&["s/array"], "__u32")],
        ..Daemon::config(fs.path(), state.path())
    })
    .await;
    let mut c = grpc(&daemon.addr()).await;
    let req = |path: &str, scan: pb::ScanMethod| pb::DumpMapRequest {
        map: map_ref(path),
        filter: "value.proto < 3".into(),
        scan: scan as i32,
        ..Default::default()
    };
    let (mut all, _, _) = dump(&mut c, req("s/hash", pb::ScanMethod::ScanBatched))
        .await
        .unwrap();
    all.sort();
    assert!(all.len() > 500, "{} entries match", all.len());
    // Pages of 97 entries, each call resuming from the last cursor.
    let (mut pages, mut cursor, mut got) = (0, String::new(), Vec::new());
    loop {
        let (entries, next, s) = dump(
            &mut c,
            pb::DumpMapRequest {
                limit: 97,
                chunk_size: 10,
                cursor: cursor.clone(),
                ..req("s/hash", pb::ScanMethod::ScanKernel)
            },
        )
        .await
        .unwrap();
        assert!(s.scanned_in_kernel, "{}", s.scan_note);
        got.extend(entries);
        cursor = next;
        pages += 1;
        if s.complete {
            break;
        }
    }
    assert_eq!(pages, all.len().div_ceil(97));
    assert_eq!(
        got, all,
        "every entry once, in key order, across {pages} calls"
    );
    // A key-order cursor with another scan: refused, saying how to resume.
    let (_, mid, _) = dump(
        &mut c,
        pb::DumpMapRequest {
            limit: 10,
            ..req("s/hash", pb::ScanMethod::ScanKernel)
        },
    )
    .await
    .unwrap();
    for scan in [pb::ScanMethod::ScanAuto, pb::ScanMethod::ScanBatched] {
        let e = dump(
            &mut c,
            pb::DumpMapRequest {
                cursor: mid.clone(),
                ..req("s/hash", scan)
            },
        )
        .await
        .unwrap_err();
        assert_eq!(e.code(), tonic::Code::InvalidArgument);
        assert_eq!(
            e.message(),
            "this cursor comes from a dump walked inside the kernel (scan SCAN_KERNEL); resume it with the same scan"
        );
    }
    // SCAN_AUTO reads a hash map in batches, and says why.
    let (_, _, s) = dump(&mut c, req("s/hash", pb::ScanMethod::ScanAuto))
        .await
        .unwrap();
    assert!(!s.scanned_in_kernel);
    assert_eq!(
        s.scan_note,
        "a walk inside the kernel can miss an entry of a hash map replaced while it runs, which a dump's cursors rule out; SCAN_KERNEL accepts that"
    );
    // An array: the first 100 inside the kernel, the rest in batches.
    let (array, _, _) = dump(&mut c, req("s/array", pb::ScanMethod::ScanBatched))
        .await
        .unwrap();
    let (mut first, cursor, s) = dump(
        &mut c,
        pb::DumpMapRequest {
            limit: 100,
            ..req("s/array", pb::ScanMethod::ScanAuto)
        },
    )
    .await
    .unwrap();
    assert!(s.scanned_in_kernel && !s.complete, "{}", s.scan_note);
    let (rest, _, s) = dump(
        &mut c,
        pb::DumpMapRequest {
            cursor,
            ..req("s/array", pb::ScanMethod::ScanBatched)
        },
    )
    .await
    .unwrap();
    assert!(!s.scanned_in_kernel && s.complete);
    first.extend(rest);
    assert_eq!(
        first, array,
        "the array's entries once each, in index order"
    );
    // bpfmapctl: --scan kernel prints the entries --scan batched prints,
    // in key order.
    let mut printed = Vec::new();
    for scan in ["kernel", "batched"] {
        let args = [
            "--addr",
            &daemon.addr(),
            "dump",
            "s/hash",
            "--filter",
            "value.proto < 3",
            "--scan",
            scan,
        ];
        let (r, out, err) = ctl(&args).await;
        assert!(r.is_ok(), "{err}");
        printed.push(out.lines().map(str::to_owned).collect::<Vec<_>>());
    }
    assert_eq!(printed[0].len(), all.len());
    let mut batched = printed[1].clone();
    batched.sort();
    let mut kernel = printed[0].clone();
    kernel.sort();
    assert_eq!(kernel, batched);
    // An unknown scan method.
    let e = dump(
        &mut c,
        pb::DumpMapRequest {
            scan: 9,
            ..req("s/hash", pb::ScanMethod::ScanAuto)
        },
    )
    .await
    .unwrap_err();
    assert_eq!(e.code(), tonic::Code::InvalidArgument);
    assert_eq!(
        e.message(),
        "unknown scan method 9; use SCAN_AUTO (0), SCAN_BATCHED (1) or SCAN_KERNEL (2)"
    );
    daemon.stop().await;
}

/// A map of `n` `__u32` keys whose values all have protocol 1.
fn matching_map(fs: &BpfFs, path: &str, n: u32) -> OwnedMap {
    let map = create_map(MapType::HASH, 4, VALUE_SIZE, n);
    for i in 0..n {
        let mut v = vec![0u8; VALUE_SIZE as usize];
        v[..8].copy_from_slice(&u64::from(i).to_ne_bytes());
        v[28] = 1;
        update(&map, &i.to_ne_bytes(), &v);
    }
    fs.pin(&map, path);
    map
}

/// The entries a walk inside the kernel takes are held for the whole call,
/// from the pool for large entries (a quarter of limits.max_queued_bytes,
/// 8 MiB here): a client that stops reading holds them, and another dump
/// meanwhile reads in batches, saying so, with the same entries; once the
/// client is gone the memory is back. More matches than the pool holds:
/// read in batches. (The held dump is larger than the client's stream
/// window, 2 MiB, so that the stalled call cannot end by itself.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dump_in_the_kernel_holds_its_entries_within_the_pool_whoever_stops_reading() {
    let (fs, state) = (BpfFs::new(), tempfile::tempdir().unwrap());
    // 90,000 entries of 52 bytes: 4.7 MB, more than half the pool.
    let _held = matching_map(&fs, "s/held", 90_000);
    // 170,000: more than the pool holds (161,319 entries).
    let _large = matching_map(&fs, "s/large", 170_000);
    let daemon = Daemon::start_with(bpfmapd::Config {
        types: vec![types(&["s/held", "s/large"], "__u32")],
        limits: bpfmapd::Limits {
            max_queued_bytes: 32 << 20,
            max_dumps: 4,
            ..bpfmapd::Limits::default()
        },
        ..Daemon::config(fs.path(), state.path())
    })
    .await;
    let mut c = grpc(&daemon.addr()).await;
    let req = |path: &str| pb::DumpMapRequest {
        map: map_ref(path),
        filter: "value.proto == 1".into(),
        scan: pb::ScanMethod::ScanKernel as i32,
        layout: pb::Layout::Packed as i32,
        ..Default::default()
    };
    // A client that takes the first chunk and no more.
    let mut stalled = c
        .clone()
        .dump_map(pb::DumpMapRequest {
            chunk_size: 10,
            ..req("s/held")
        })
        .await
        .unwrap()
        .into_inner();
    assert!(stalled.message().await.unwrap().unwrap().packed.is_some());
    let (entries, _, s) = dump(&mut c, req("s/held")).await.unwrap();
    assert!(!s.scanned_in_kernel);
    assert_eq!(s.scan_note, "the server's memory for dumps is in use");
    assert_eq!(entries.len(), 90_000);
    // Gone: its memory comes back once its producer notices.
    drop(stalled);
    let mut tries = 0;
    loop {
        let (entries, _, s) = dump(&mut c, req("s/held")).await.unwrap();
        assert_eq!(entries.len(), 90_000);
        if s.scanned_in_kernel {
            break;
        }
        tries += 1;
        assert!(tries < 50, "the memory never came back: {}", s.scan_note);
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    let (entries, _, s) = dump(&mut c, req("s/large")).await.unwrap();
    assert_eq!(entries.len(), 170_000);
    assert!(!s.scanned_in_kernel);
    assert_eq!(
        s.scan_note,
        "more than 161319 entries match, more than a dump walked inside the kernel holds (a quarter of limits.max_queued_bytes)"
    );
    daemon.stop().await;
}
