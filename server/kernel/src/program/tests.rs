//! Walk programs against real maps: what they count, group and add up
//! equals what the entries hold.

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
    assert!(e.to_string().contains("one CPU's value"), "{e}");
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
