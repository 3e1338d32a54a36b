//! Aggregates against a brute-force computation over the same entries.

use std::collections::BTreeMap;

use bpfmap_proto::v1::{self as pb, TypeInfo, aggregate::Op};

use super::*;
use crate::query::testing as t;
use bpfmap_proto::typed::MapShape;

fn agg(op: Op, field: &str) -> pb::Aggregate {
    pb::Aggregate {
        op: op as i32,
        field: field.into(),
    }
}

fn request(group_by: &[&str], aggregates: Vec<pb::Aggregate>) -> pb::AggregateMapRequest {
    pb::AggregateMapRequest {
        group_by: group_by.iter().map(|s| s.to_string()).collect(),
        aggregates,
        ..Default::default()
    }
}

/// 1,000 flows: daddr i % 7, packets i, bytes i * 100; sport i % 3.
fn flows() -> Vec<(Vec<u8>, Vec<u8>)> {
    (0..1000u32)
        .map(|i| {
            let key = t::flow(i, i % 7, (i % 3) as u16, 443, 6);
            (key, t::stats(u64::from(i), u64::from(i) * 100))
        })
        .collect()
}

struct Types {
    key: TypeInfo,
    value: TypeInfo,
}

impl Types {
    fn flows() -> Self {
        Self {
            key: t::flow_key(),
            value: t::flow_stats(),
        }
    }

    fn run(
        &self,
        req: &pb::AggregateMapRequest,
        max_groups: usize,
    ) -> Result<Answer, AggregateError> {
        let shape = t::layout(&self.key, &self.value, None);
        let spec = Spec::new(req, &shape, max_groups)?;
        let mut table = spec.table();
        for (k, v) in flows() {
            if !table.add(&EntryRef {
                key: &k,
                value: &v,
                stride: 0,
            }) {
                break;
            }
        }
        let (groups, total) = table.finish()?;
        Ok(Answer { groups, total })
    }
}

struct Answer {
    groups: Vec<pb::Group>,
    total: u64,
}

impl Answer {
    /// Each group as (its key as JSON, its values as JSON).
    fn rows(&self) -> Vec<(String, Vec<String>)> {
        self.groups
            .iter()
            .map(|g| {
                let key = g.key.as_ref().map(|k| {
                    k.fields
                        .iter()
                        .map(|(n, v)| format!("{n}={}", show(v)))
                        .collect::<Vec<_>>()
                        .join(",")
                });
                (key.unwrap_or_default(), g.values.iter().map(show).collect())
            })
            .collect()
    }
}

fn show(v: &prost_types::Value) -> String {
    use prost_types::value::Kind;
    match &v.kind {
        Some(Kind::NumberValue(n)) => format!("{n}"),
        Some(Kind::StringValue(s)) => format!("{s:?}"),
        Some(Kind::NullValue(_)) => "null".into(),
        other => format!("{other:?}"),
    }
}

/// Per daddr: count, sum of bytes, min and max of packets.
fn brute_force() -> BTreeMap<u32, (u64, u128, u64, u64)> {
    let mut out: BTreeMap<u32, (u64, u128, u64, u64)> = BTreeMap::new();
    for i in 0..1000u64 {
        let g = out.entry((i % 7) as u32).or_insert((0, 0, u64::MAX, 0));
        g.0 += 1;
        g.1 += u128::from(i * 100);
        g.2 = g.2.min(i);
        g.3 = g.3.max(i);
    }
    out
}

#[test]
fn groups_by_a_key_member_match_a_brute_force_computation() {
    let req = request(
        &["key.daddr"],
        vec![
            agg(Op::Count, ""),
            agg(Op::Sum, "value.bytes"),
            agg(Op::Min, "value.packets"),
            agg(Op::Max, "value.packets"),
        ],
    );
    let answer = Types::flows().run(&req, 100).unwrap();
    assert_eq!(answer.total, 7);
    // Ordered by COUNT, descending, then by key bytes (daddr little-endian).
    let mut want: Vec<(u32, (u64, u128, u64, u64))> = brute_force().into_iter().collect();
    want.sort_by(|a, b| {
        b.1.0
            .cmp(&a.1.0)
            .then(a.0.to_le_bytes().cmp(&b.0.to_le_bytes()))
    });
    let want: Vec<(String, Vec<String>)> = want
        .into_iter()
        .map(|(d, (c, s, mn, mx))| {
            (
                format!("key.daddr={d}"),
                vec![
                    format!("{:?}", c.to_string()),
                    format!("{:?}", s.to_string()),
                    format!("{:?}", mn.to_string()),
                    format!("{:?}", mx.to_string()),
                ],
            )
        })
        .collect();
    assert_eq!(answer.rows(), want);
    let g = &answer.groups[0];
    assert_eq!(g.key_bytes, 0u32.to_le_bytes().to_vec(), "group key bytes");
}

#[test]
fn order_limit_threshold_and_exact_groups() {
    let types = Types::flows();
    let mut req = request(&["key.daddr"], vec![agg(Op::Sum, "value.bytes")]);
    req.limit = 3;
    let sums: Vec<u128> = {
        let mut s: Vec<u128> = brute_force().values().map(|g| g.1).collect();
        s.sort_by(|a, b| b.cmp(a));
        s
    };
    let got = types.run(&req, 100).unwrap();
    let top: Vec<String> = got.rows().into_iter().map(|r| r.1[0].clone()).collect();
    let want: Vec<String> = sums[..3]
        .iter()
        .map(|s| format!("{:?}", s.to_string()))
        .collect();
    assert_eq!(top, want);
    assert_eq!(got.total, 7, "groups_total counts before the limit");

    req.ascending = true;
    let got = types.run(&req, 100).unwrap();
    let bottom: Vec<String> = got.rows().into_iter().map(|r| r.1[0].clone()).collect();
    let mut asc = sums.clone();
    asc.reverse();
    let want: Vec<String> = asc[..3]
        .iter()
        .map(|s| format!("{:?}", s.to_string()))
        .collect();
    assert_eq!(bottom, want);

    req.ascending = false;
    req.limit = 0;
    req.threshold = sums[2].to_string();
    let got = types.run(&req, 100).unwrap();
    assert_eq!(got.groups.len(), 3, "threshold at the third largest sum");

    req.threshold = String::new();
    req.groups = vec![3u32.to_le_bytes().to_vec(), 99u32.to_le_bytes().to_vec()];
    req.aggregates = vec![
        agg(Op::Sum, "value.bytes"),
        agg(Op::Count, ""),
        agg(Op::Min, "value.packets"),
    ];
    let got = types.run(&req, 100).unwrap();
    let rows = got.rows();
    let g3 = brute_force()[&3];
    assert_eq!(rows[0].0, "key.daddr=3");
    assert_eq!(
        rows[0].1,
        vec![
            format!("{:?}", g3.1.to_string()),
            format!("{:?}", g3.0.to_string()),
            format!("{:?}", g3.2.to_string())
        ]
    );
    assert_eq!(rows[1].0, "key.daddr=99", "a group asked for with no entry");
    assert_eq!(
        rows[1].1,
        vec!["\"0\"".to_owned(), "\"0\"".to_owned(), "null".to_owned()]
    );

    // A group asked for twice is reported once, with its values.
    req.groups = vec![3u32.to_le_bytes().to_vec(), 3u32.to_le_bytes().to_vec()];
    let got = types.run(&req, 100).unwrap();
    assert_eq!(got.groups.len(), 1);
    assert_eq!(got.rows()[0].1[0], format!("{:?}", g3.1.to_string()));
    // A group key of the wrong length is refused, saying the right one.
    req.groups = vec![vec![0]];
    let Err(e) = types.run(&req, 100) else {
        panic!("a 1-byte group key was accepted");
    };
    assert_eq!(
        e.to_string(),
        "groups[0] is 1 bytes: a group's key_bytes are 4 bytes here (the group_by members' bytes, back to back, as answers give them)"
    );
}

#[test]
fn groups_by_several_members_and_by_nothing() {
    let types = Types::flows();
    let req = request(&["key.sport", "key.daddr"], vec![agg(Op::Count, "")]);
    let got = types.run(&req, 100).unwrap();
    assert_eq!(got.total, 21);
    let counts: u64 = got
        .rows()
        .iter()
        .map(|r| r.1[0].trim_matches('"').parse::<u64>().unwrap())
        .sum();
    assert_eq!(counts, 1000);
    assert_eq!(got.groups[0].key_bytes.len(), 2 + 4, "sport then daddr");
    let whole = types
        .run(&request(&[], vec![agg(Op::Sum, "value.packets")]), 100)
        .unwrap();
    assert_eq!(
        whole.rows(),
        vec![(String::new(), vec!["\"499500\"".to_owned()])]
    );
}

#[test]
fn more_groups_than_the_limit_is_resource_exhausted_naming_it() {
    let req = request(&["key.saddr"], vec![agg(Op::Count, "")]);
    let Err(e) = Types::flows().run(&req, 10) else {
        panic!("1,000 groups fit a table of 10");
    };
    assert_eq!(
        e,
        AggregateError::TooManyGroups {
            limit: 10,
            seen: 11
        }
    );
    assert_eq!(
        e.to_string(),
        "more than 10 groups (limits.max_groups): 11 seen before the walk stopped; group by fewer or coarser members, or filter"
    );
}

#[test]
fn requests_that_do_not_fit_are_refused_saying_why() {
    let types = Types::flows();
    let many: Vec<pb::Aggregate> = (0..17).map(|_| agg(Op::Count, "")).collect();
    let cases = [
        (request(&[], vec![]), "no aggregates: give at least one"),
        (request(&[], many), "17 aggregates: at most 16"),
        (
            pb::AggregateMapRequest {
                order_by: 1,
                ..request(&[], vec![agg(Op::Count, "")])
            },
            "order_by 1 names no aggregate (there are 1; indexes start at 0)",
        ),
        (
            request(&[], vec![agg(Op::Unspecified, "")]),
            "aggregates[0]: op is COUNT, SUM, MIN or MAX",
        ),
        (
            request(&[], vec![agg(Op::Count, "value.bytes")]),
            "aggregates[0]: COUNT counts entries and takes no field",
        ),
        (
            request(&[], vec![agg(Op::Sum, "")]),
            "aggregates[0]: SUM needs a field (\"value.bytes\")",
        ),
        (
            request(&[], vec![agg(Op::Max, "value.byts")]),
            "aggregates[0]: value.byts: no such member of struct flow_stats",
        ),
        (
            request(&[], vec![agg(Op::Sum, "key")]),
            "aggregates[0]: key: not an integer (struct flow_key): SUM takes an integer member",
        ),
        (
            request(&["key.dprt"], vec![agg(Op::Count, "")]),
            "group_by: key.dprt: no such member of struct flow_key",
        ),
        (
            pb::AggregateMapRequest {
                threshold: "1e6".into(),
                ..request(&[], vec![agg(Op::Count, "")])
            },
            "threshold \"1e6\" is not a decimal integer",
        ),
    ];
    for (req, want) in cases {
        match types.run(&req, 100) {
            Err(AggregateError::Invalid(m)) => assert!(m.starts_with(want), "{want:?}: {m}"),
            Err(e) => panic!("{want:?}: {e}"),
            Ok(_) => panic!("{want:?}: accepted"),
        }
    }
}

#[test]
fn small_members_min_and_max_are_numbers_wide_ones_strings() {
    let key = t::flow_key();
    let value = t::flow_stats();
    let shape = t::layout(&key, &value, None);
    let req = request(
        &[],
        vec![agg(Op::Min, "key.sport"), agg(Op::Max, "value.bytes")],
    );
    let spec = Spec::new(&req, &shape, 10).unwrap();
    let mut table = spec.table();
    for (k, v) in flows() {
        table.add(&EntryRef {
            key: &k,
            value: &v,
            stride: 0,
        });
    }
    let (groups, _) = table.finish().unwrap();
    let values: Vec<String> = groups[0].values.iter().map(show).collect();
    assert_eq!(values, vec!["0".to_owned(), "\"99900\"".to_owned()]);
}

/// Per-CPU flows on 3 CPUs: CPU c holds packets i + c, bytes 10 * (i + c).
fn per_cpu_table(req: &pb::AggregateMapRequest) -> Vec<pb::Group> {
    let key = t::flow_key();
    let value = t::flow_stats();
    let shape = t::layout(&key, &value, Some(3));
    let spec = Spec::new(req, &shape, 100).unwrap();
    let mut table = spec.table();
    for i in 0..10u64 {
        let k = t::flow(i as u32, (i % 2) as u32, 0, 443, 6);
        let mut v = Vec::new();
        for c in 0..3 {
            v.extend_from_slice(&t::stats(i + c, 10 * (i + c)));
        }
        table.add(&EntryRef {
            key: &k,
            value: &v,
            stride: 16,
        });
    }
    table.finish().unwrap().0
}

#[test]
fn per_cpu_each_takes_each_cpu_and_per_cpu_sum_each_entry() {
    let aggs = vec![
        agg(Op::Count, ""),
        agg(Op::Sum, "value.bytes"),
        agg(Op::Min, "value.packets"),
        agg(Op::Max, "value.packets"),
    ];
    let each = per_cpu_table(&request(&["key.daddr"], aggs.clone()));
    // daddr 0: i = 0, 2, 4, 6, 8; CPUs add 0, 1, 2.
    let shown: Vec<String> = each[0].values.iter().map(show).collect();
    assert_eq!(shown, ["\"5\"", "\"750\"", "\"0\"", "\"10\""]);
    let mut req = request(&["key.daddr"], aggs);
    req.per_cpu = pb::PerCpu::Sum as i32;
    let sum = per_cpu_table(&req);
    let shown: Vec<String> = sum[0].values.iter().map(show).collect();
    // Sums per entry: 3i + 3 packets; min at i = 0, max at i = 8.
    assert_eq!(shown, ["\"5\"", "\"750\"", "\"3\"", "\"27\""]);
    // Grouped by a value member: its sum over the CPUs.
    let by_value = per_cpu_table(&request(&["value.packets"], vec![agg(Op::Count, "")]));
    assert_eq!(by_value.len(), 10);
    let key = by_value
        .iter()
        .map(|g| show(&g.key.as_ref().unwrap().fields["value.packets"]))
        .collect::<Vec<_>>();
    assert!(key.contains(&"\"3\"".to_owned()), "{key:?}");
}

#[test]
fn the_order_is_non_negative_for_counts_and_unsigned_sums_only() {
    let key = t::flow_key();
    let value = t::everything();
    let shape = t::layout(&key, &value, None);
    let spec = |a: pb::Aggregate| Spec::new(&request(&[], vec![a]), &shape, 10).unwrap();
    assert!(spec(agg(Op::Count, "")).non_negative_order());
    assert!(spec(agg(Op::Sum, "value.u64")).non_negative_order());
    assert!(!spec(agg(Op::Sum, "value.s64")).non_negative_order());
    assert!(!spec(agg(Op::Max, "value.u64")).non_negative_order());
}

#[test]
fn untyped_maps_aggregate_and_group_by_whole_keys_and_values() {
    let shape = MapLayout::untyped(MapShape::new(4, 8));
    let req = request(&[], vec![agg(Op::Sum, "value"), agg(Op::Max, "key")]);
    let spec = Spec::new(&req, &shape, 10).unwrap();
    let mut table = spec.table();
    for i in 0..10u32 {
        let (k, v) = (i.to_le_bytes(), (u64::MAX - u64::from(i)).to_le_bytes());
        table.add(&EntryRef {
            key: &k,
            value: &v,
            stride: 0,
        });
    }
    let (groups, _) = table.finish().unwrap();
    let sum = 10 * u128::from(u64::MAX) - 45;
    let values: Vec<String> = groups[0].values.iter().map(show).collect();
    assert_eq!(values, [format!("{:?}", sum.to_string()), "9".to_owned()]);
    let req = request(&["key.x"], vec![agg(Op::Count, "")]);
    let Err(AggregateError::Invalid(e)) = Spec::new(&req, &shape, 10) else {
        panic!("grouped by a member of bytes");
    };
    assert_eq!(
        e,
        "group_by: key.x: the map has no types (BTF): its key is bytes"
    );
    let wide = MapLayout::untyped(MapShape::new(4, 16));
    let req = request(&[], vec![agg(Op::Sum, "value")]);
    let Err(AggregateError::Invalid(e)) = Spec::new(&req, &wide, 10) else {
        panic!("a 16-byte untyped value summed");
    };
    assert_eq!(
        e,
        "aggregates[0]: value: not an integer (16 bytes): SUM takes an integer member"
    );
}

#[test]
fn a_member_named_key_is_grouped_by_its_own_path() {
    // bpftrace's @h[comm] = hist(), declared with the key's member `key`.
    let key =
        bpfmap_proto::typed::parse_c_type("struct { char key[16]; __u64 bucket; }", "key").unwrap();
    let value = bpfmap_proto::typed::parse_c_type("__u64", "value").unwrap();
    let shape = t::layout(&key, &value, None);
    for (group_by, path) in [("key.key", "key.key"), ("key", "key")] {
        let req = request(&[group_by], vec![agg(Op::Count, "")]);
        let spec = Spec::new(&req, &shape, 10).unwrap();
        let mut table = spec.table();
        let mut k = b"bash".to_vec();
        k.resize(16, 0);
        k.extend(3u64.to_le_bytes());
        assert!(table.add(&EntryRef {
            key: &k,
            value: &1u64.to_le_bytes(),
            stride: 0,
        }));
        let (groups, _) = table.finish().unwrap();
        let fields = &groups[0].key.as_ref().unwrap().fields;
        assert_eq!(fields.keys().collect::<Vec<_>>(), [path], "{group_by}");
        if group_by == "key.key" {
            assert_eq!(
                fields[path].kind,
                Some(prost_types::value::Kind::StringValue("bash".into()))
            );
        }
    }
}
