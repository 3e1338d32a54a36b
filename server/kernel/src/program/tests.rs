//! Walk programs against real maps: what they count, group and add up
//! equals what the entries hold.

use std::collections::BTreeMap;

use super::*;
use crate::{MapOps, OwnedMap};

fn hash(n: u32) -> OwnedMap {
    // key: u32; value: u64 bytes, i32 delta, __be16 port, u8 proto, u8 flags
    let map = OwnedMap::new(MapType::HASH, 4, 16, n.max(1), "scan_test").unwrap();
    for i in 0..n {
        let mut v = Vec::new();
        v.extend((u64::from(i) * 1000).to_ne_bytes());
        v.extend((i as i32 - 50).to_ne_bytes());
        v.extend(((i % 3) as u16 * 1000).to_be_bytes());
        v.push((i % 2) as u8);
        v.push((i % 16) as u8);
        map.update(&i.to_ne_bytes(), &v).unwrap();
    }
    map
}

/// A handle without CAP_SYS_ADMIN (a copy of the creator's descriptor):
/// these tests pass with CAP_BPF alone, as the daemon's walk programs do.
fn open(map: &OwnedMap) -> MapHandle {
    map.handle().unwrap()
}

fn int(side: Side, bit_offset: usize, bits: usize, signed: bool, be: bool) -> IntRead {
    let size = if side == Side::Key { 4 } else { 16 };
    let member = IntSpec {
        side,
        bit_offset,
        bits,
        signed,
        big_endian: be,
    };
    IntRead::new(member, size).unwrap()
}

#[test]
fn this_kernel_runs_walk_programs() {
    supported().expect("walk programs on this kernel");
}

#[test]
fn a_count_program_counts_every_entry() {
    let map = hash(1000);
    let p_map = open(&map);

    let p = WalkProgram::load(&p_map, &WalkPlan::count()).unwrap();
    let out = p.walk(&p_map).unwrap();
    assert_eq!(out.visited, 1000);
    assert_eq!(p.walk(&p_map).unwrap().visited, 1000);
}

#[test]
fn groups_and_aggregates_equal_the_entries() {
    let map = hash(100);
    let proto = int(Side::Value, 14 * 8, 8, false, false);
    let port = int(Side::Value, 12 * 8, 16, false, true);
    let delta = int(Side::Value, 8 * 8, 32, true, false);
    let bytes = int(Side::Value, 0, 64, false, false);
    let low_flags = int(Side::Value, 15 * 8, 3, false, false);
    let plan = WalkPlan {
        output: Output::Groups,
        // port != 0 && (delta < 0 || proto == 1)
        filter: Cond::All(vec![
            Cond::Not(Box::new(Cond::Cmp(port, CmpOp::Eq, 0))),
            Cond::Any(vec![
                Cond::Cmp(delta, CmpOp::Lt, 0),
                Cond::Cmp(proto, CmpOp::Eq, 1),
            ]),
        ]),
        group: vec![GroupPart::Int {
            read: port,
            out: 0,
            size: 2,
        }],
        key_len: 2,
        aggs: vec![
            AggOp::Count,
            AggOp::Sum(delta),
            AggOp::Min(delta),
            AggOp::Max(bytes),
            AggOp::Sum(low_flags),
        ],
        max_groups: 10,
    };
    let p_map = open(&map);

    let p = WalkProgram::load(&p_map, &plan).unwrap();
    let out = p.walk(&p_map).unwrap();
    assert_eq!(out.visited, 100);
    let mut want: std::collections::BTreeMap<u16, (u64, i128, i128, i128, i128)> =
        Default::default();
    let mut matched = 0;
    for i in 0..100u32 {
        let (port, delta, proto) = ((i % 3) as u16 * 1000, i as i128 - 50, i % 2);
        if port == 0 || !(delta < 0 || proto == 1) {
            continue;
        }
        matched += 1;
        let g = want.entry(port).or_insert((0, 0, i128::MAX, 0, 0));
        g.0 += 1;
        g.1 += delta;
        g.2 = g.2.min(delta);
        g.3 = g.3.max(i128::from(i) * 1000);
        g.4 += i128::from((i % 16) & 7);
    }
    assert_eq!(out.matched, matched);
    let mut got: std::collections::BTreeMap<u16, (u64, i128, i128, i128, i128)> =
        Default::default();
    for g in &out.groups {
        let v = |a: usize| plan.aggs[a].value(g.count, g.words[a]);
        got.insert(
            u16::from_le_bytes([g.key[0], g.key[1]]),
            (g.count, v(1), v(2), v(3), v(4)),
        );
    }
    assert_eq!(got, want);
    // The groups map is empty again: a second run finds the same.
    assert_eq!(p.walk(&p_map).unwrap().groups.len(), want.len());
}

#[test]
fn a_walk_with_more_groups_than_allowed_says_it_overflowed() {
    let map = hash(50);
    let plan = WalkPlan {
        output: Output::Groups,
        filter: Cond::Const(true),
        group: vec![GroupPart::Bytes {
            side: Side::Key,
            offset: 0,
            len: 4,
            out: 0,
        }],
        key_len: 4,
        aggs: vec![AggOp::Count],
        max_groups: 10,
    };
    let handle = open(&map);
    let out = WalkProgram::load(&handle, &plan)
        .unwrap()
        .walk(&handle)
        .unwrap();
    assert!(out.overflowed);
    assert_eq!(out.groups.len(), 10);
}

#[test]
fn a_walk_of_entries_copies_the_entries_it_takes() {
    let map = hash(1000);
    // delta >= 900 - 50: entries 900..999
    let delta = int(Side::Value, 8 * 8, 32, true, false);
    let plan = WalkPlan::entries(Cond::Cmp(delta, CmpOp::Ge, 850), 1000);
    let p_map = open(&map);

    let p = WalkProgram::load(&p_map, &plan).unwrap();
    let out = p.walk(&p_map).unwrap();
    assert_eq!(
        (out.visited, out.matched, out.overflowed),
        (1000, 100, false)
    );
    let m = Matches::new(out.entries, 4, 16, byte_order);
    let mut got = Vec::new();
    for i in 0..m.len() as u32 {
        let key = (900 + i).to_ne_bytes();
        let mut v = [0u8; 16];
        m.lookup(&key, &mut v).unwrap();
        let want = map.lookup(&key).unwrap().unwrap();
        assert_eq!(v[..], want[..], "entry {}", 900 + i);
        got.push(900 + i);
    }
    assert_eq!(got.len(), 100);
    // Run again: the same entries, the output emptied between runs.
    assert_eq!(p.walk(&p_map).unwrap().entries.count, 100);
    // At most max_groups: the walk stops and says so.
    let small_map = open(&map);

    let small = WalkProgram::load(&small_map, &WalkPlan::entries(Cond::Const(true), 10)).unwrap();
    let out = small.walk(&small_map).unwrap();
    assert!(out.overflowed);
    assert_eq!(out.entries.count, 10);
}

#[test]
fn a_walk_of_entries_of_a_per_cpu_map_is_refused_before_loading() {
    let map = OwnedMap::new(MapType::PERCPU_HASH, 4, 8, 4, "scan_test").unwrap();
    let e_map = open(&map);

    let e = WalkProgram::load(&e_map, &WalkPlan::entries(Cond::Const(true), 4)).unwrap_err();
    assert!(
        matches!(e, LoadError::Plan(PlanError::PerCpuEntries)),
        "{e}"
    );
}

#[test]
fn a_count_of_a_hash_map_reads_the_kernels_element_counters() {
    for (map_type, flags) in [
        (MapType::HASH, 0u32),
        (MapType::HASH, BPF_F_NO_PREALLOC),
        (MapType::LRU_HASH, 0),
        (MapType::PERCPU_HASH, 0),
        (MapType::LRU_PERCPU_HASH, 0),
    ] {
        let map = OwnedMap::create(&CreateMap {
            map_type: map_type.0,
            key_size: 4,
            value_size: 8,
            max_entries: 2000,
            flags,
            name: "scan_test",
            ..Default::default()
        })
        .unwrap();
        let value = vec![0u8; map.meta().kernel_value_size()];
        for i in 0u32..1000 {
            map.update(&i.to_ne_bytes(), &value).unwrap();
        }
        // Deleted, and replaced.
        for i in 0u32..100 {
            map.delete(&i.to_ne_bytes()).unwrap();
        }
        for i in 100u32..200 {
            map.update(&i.to_ne_bytes(), &value).unwrap();
        }
        let p_map = open(&map);

        let p = WalkProgram::load(&p_map, &WalkPlan::count()).unwrap();
        assert!(p.counts_without_walking(), "{map_type:?}");
        let out = p.walk(&p_map).unwrap();
        assert_eq!((out.visited, out.matched), (900, 900), "{map_type:?}");
    }
    // An array is walked.
    let array = OwnedMap::new(MapType::ARRAY, 4, 8, 64, "scan_test").unwrap();
    let p_map = open(&array);

    let p = WalkProgram::load(&p_map, &WalkPlan::count()).unwrap();
    assert!(!p.counts_without_walking());
    assert_eq!(p.walk(&p_map).unwrap().visited, 64);
}

/// Groups by key: their count and the values of their aggregates.
type Groups = BTreeMap<Vec<u8>, (u64, Vec<i128>)>;

/// The groups of `out` by key, with their count and the values of `aggs`.
fn groups_of(out: &WalkOutput, aggs: &[AggOp]) -> Groups {
    out.groups
        .iter()
        .map(|g| {
            let values = aggs
                .iter()
                .zip(&g.words)
                .map(|(a, w)| a.value(g.count, *w))
                .collect();
            (g.key.clone(), (g.count, values))
        })
        .collect()
}

/// COUNT, SUM and MIN of `delta`, MAX of `bytes` of [`hash`]'s values, of
/// the entries whose delta is not 7, grouped by `group` (`key_len` bytes).
fn grouped(group: Vec<GroupPart>, key_len: u16, max_groups: u32) -> WalkPlan {
    let delta = int(Side::Value, 8 * 8, 32, true, false);
    let bytes = int(Side::Value, 0, 64, false, false);
    WalkPlan {
        output: Output::Groups,
        filter: Cond::Cmp(delta, CmpOp::Ne, 7),
        group,
        key_len,
        aggs: vec![
            AggOp::Count,
            AggOp::Sum(delta),
            AggOp::Min(delta),
            AggOp::Max(bytes),
        ],
        max_groups,
    }
}

#[test]
fn a_dense_table_of_small_members_holds_their_groups() {
    let map = hash(3000);
    let handle = open(&map);
    let proto = int(Side::Value, 14 * 8, 8, false, false);
    // The low 4 bits of flags, signed: -8..7.
    let signed_flags = int(Side::Value, 15 * 8, 4, true, false);
    let parts = vec![
        GroupPart::Int {
            read: proto,
            out: 0,
            size: 1,
        },
        GroupPart::Int {
            read: signed_flags,
            out: 1,
            size: 1,
        },
    ];
    let plan = grouped(parts.clone(), 2, 100);
    assert_eq!(plan.table(), GroupTable::Dense { slots: 4096 });
    let out = WalkProgram::load(&handle, &plan)
        .unwrap()
        .walk(&handle)
        .unwrap();
    let mut want = Groups::new();
    for i in 0..3000u32 {
        let d = i as i128 - 50;
        if d == 7 {
            continue;
        }
        let low = (i % 16) as i8;
        let flags = if low >= 8 { low - 16 } else { low };
        let g = want
            .entry(vec![(i % 2) as u8, flags as u8])
            .or_insert((0, vec![0, 0, i128::MAX, 0]));
        g.0 += 1;
        g.1[0] = i128::from(g.0);
        g.1[1] += d;
        g.1[2] = g.1[2].min(d);
        g.1[3] = g.1[3].max(i128::from(i) * 1000);
    }
    assert_eq!(groups_of(&out, &plan.aggs), want);
    assert_eq!((out.visited, out.matched), (3000, 2999));
    // More groups than allowed: the walk stops at the first one too many
    // and says so.
    let few = grouped(parts, 2, 2);
    assert_eq!(few.table(), GroupTable::Dense { slots: 4096 });
    let out = WalkProgram::load(&handle, &few)
        .unwrap()
        .walk(&handle)
        .unwrap();
    assert!(out.overflowed);
    assert_eq!(out.groups.len(), 2);
}

#[test]
fn a_16_bit_member_groups_alike_in_a_dense_table_and_a_hash_map() {
    let map = hash(3000);
    let handle = open(&map);
    // The network-order port, as bytes.
    let by_port = |max_groups| {
        let port = GroupPart::Bytes {
            side: Side::Value,
            offset: 12,
            len: 2,
            out: 0,
        };
        grouped(vec![port], 2, max_groups)
    };
    // Dense when the table may hold enough groups, a hash map otherwise.
    let (dense, hashed) = (by_port(4096), by_port(100));
    assert_eq!(dense.table(), GroupTable::Dense { slots: 65536 });
    assert_eq!(hashed.table(), GroupTable::Hash);
    let run = |plan: &WalkPlan| {
        let p = WalkProgram::load(&handle, plan).unwrap();
        groups_of(&p.walk(&handle).unwrap(), &plan.aggs)
    };
    let got = run(&dense);
    let ports: Vec<&[u8]> = got.keys().map(Vec::as_slice).collect();
    assert_eq!(ports, [[0, 0], [3, 0xe8], [7, 0xd0]]);
    assert_eq!(got, run(&hashed));
}

/// One CPU's value of an entry of [`per_cpu_hash`].
#[derive(Debug, Clone, Copy)]
struct CpuValue {
    bytes: u64,
    delta: i32,
    flags: u8,
}

/// A per-CPU hash map of `n` entries (at most 512): key u32 i, on CPU c
/// the value `{ u64 bytes: 2^64 - 1 - i * 2^55; i32 delta: i * (c + 1) -
/// 50 * c; u8 flags: (i + c) % 8 }` (16 bytes): sums of `bytes` pass 64
/// bits. Returns each entry's values, CPU by CPU.
fn per_cpu_hash(n: u32) -> (OwnedMap, Vec<Vec<CpuValue>>) {
    let map = OwnedMap::new(MapType::PERCPU_HASH, 4, 16, n, "scan_test").unwrap();
    let cpus = map.meta().possible_cpus;
    let mut all = Vec::new();
    for i in 0..n {
        let mut value = Vec::new();
        let each: Vec<CpuValue> = (0..cpus)
            .map(|c| CpuValue {
                bytes: u64::MAX - (u64::from(i) << 55),
                delta: i as i32 * (c as i32 + 1) - 50 * c as i32,
                flags: ((i + c) % 8) as u8,
            })
            .collect();
        for v in &each {
            value.extend(v.bytes.to_ne_bytes());
            value.extend(v.delta.to_ne_bytes());
            value.extend([v.flags, 0, 0, 0]);
        }
        map.update(&i.to_ne_bytes(), &value).unwrap();
        all.push(each);
    }
    (map, all)
}

/// A member of [`per_cpu_hash`]'s values, in `side`.
fn cpu_member(side: Side, bit_offset: usize, bits: usize, signed: bool) -> IntRead {
    let member = IntSpec {
        side,
        bit_offset,
        bits,
        signed,
        big_endian: false,
    };
    IntRead::new(member, 16).unwrap()
}

/// What [`per_cpu_question`] answers, computed from the values: groups by
/// (key % 4, the sum of flags) of the entries whose bytes sum to more than
/// `threshold` and whose last CPU's delta is not 60: COUNT, SUM and MIN of
/// the bytes' sums, MAX of the deltas' sums, MIN of each CPU's delta, MAX
/// of each CPU's flags, SUM of the last CPU's delta.
fn per_cpu_answer(values: &[Vec<CpuValue>], threshold: i128) -> Groups {
    let mut want = Groups::new();
    for (i, each) in values.iter().enumerate() {
        let sum = |f: &dyn Fn(&CpuValue) -> i128| each.iter().map(f).sum::<i128>();
        let total = sum(&|v| i128::from(v.bytes));
        let last_delta = each.last().unwrap().delta;
        if total <= threshold || last_delta == 60 {
            continue;
        }
        let mut key = vec![(i % 4) as u8];
        key.extend(sum(&|v| i128::from(v.flags)).to_le_bytes());
        let g = want
            .entry(key)
            .or_insert((0, vec![0, 0, i128::MAX, i128::MIN, i128::MAX, 0, 0]));
        g.0 += 1;
        let v = &mut g.1;
        v[0] = i128::from(g.0);
        v[1] += total;
        v[2] = v[2].min(total);
        v[3] = v[3].max(sum(&|v| i128::from(v.delta)));
        v[4] = v[4].min(each.iter().map(|v| i128::from(v.delta)).min().unwrap());
        v[5] = v[5].max(each.iter().map(|v| i128::from(v.flags)).max().unwrap());
        v[6] += i128::from(last_delta);
    }
    want
}

/// The question [`per_cpu_answer`] answers, over `cpus` CPUs.
fn per_cpu_question(cpus: u16, threshold: i128) -> WalkPlan {
    let bytes = cpu_member(Side::Value, 0, 64, false);
    let delta = cpu_member(Side::Value, 64, 32, true);
    let flags = cpu_member(Side::Value, 96, 8, false);
    let last = cpu_member(Side::Cpu(cpus - 1), 64, 32, true);
    WalkPlan {
        output: Output::Groups,
        filter: Cond::All(vec![
            Cond::Cmp(bytes.summed_over(cpus), CmpOp::Gt, threshold),
            Cond::Cmp(last, CmpOp::Ne, 60),
        ]),
        group: vec![
            GroupPart::Int {
                read: int(Side::Key, 0, 2, false, false),
                out: 0,
                size: 1,
            },
            GroupPart::Int {
                read: flags.summed_over(cpus),
                out: 1,
                size: 16,
            },
        ],
        key_len: 17,
        aggs: vec![
            AggOp::Count,
            AggOp::Sum(bytes.summed_over(cpus)),
            AggOp::Min(bytes.summed_over(cpus)),
            AggOp::Max(delta.summed_over(cpus)),
            AggOp::MinOfEach(delta),
            AggOp::MaxOfEach(flags),
            AggOp::Sum(last),
        ],
        max_groups: 1000,
    }
}

#[test]
fn a_per_cpu_map_is_summed_over_its_cpus_and_each_cpu_taken_alone() {
    let (map, values) = per_cpu_hash(500);
    let handle = open(&map);
    let cpus = map.meta().possible_cpus as u16;
    // Entries whose bytes sum to more than (2^64 - 250 * 2^55) per CPU
    // (i < 250; more than 2^64 on 2 CPUs).
    let threshold = i128::from(cpus) * ((1i128 << 64) - (250 << 55));
    let plan = per_cpu_question(cpus, threshold);
    let out = WalkProgram::load(&handle, &plan)
        .unwrap()
        .walk(&handle)
        .unwrap();
    let want = per_cpu_answer(&values, threshold);
    assert!(want.len() > 4, "{} groups", want.len());
    assert_eq!(groups_of(&out, &plan.aggs), want);
}
