//! Projections: the records they write, and that the types they describe
//! decode those records.

use bpfmap_proto::typed::Layout;

use super::*;
use crate::query::testing::{self as t, at};

fn fields(f: &[&str]) -> Vec<String> {
    f.iter().map(|s| s.to_string()).collect()
}

/// A decoded value, compactly: `{a:1,b:"x"}` (members in name order).
fn show(v: &prost_types::Value) -> String {
    use prost_types::value::Kind;
    match &v.kind {
        Some(Kind::NumberValue(n)) => format!("{n}"),
        Some(Kind::StringValue(s)) => format!("{s:?}"),
        Some(Kind::BoolValue(b)) => b.to_string(),
        Some(Kind::StructValue(s)) => {
            let m: Vec<String> = s
                .fields
                .iter()
                .map(|(k, v)| format!("{k}:{}", show(v)))
                .collect();
            format!("{{{}}}", m.join(","))
        }
        Some(Kind::ListValue(l)) => {
            let m: Vec<String> = l.values.iter().map(show).collect();
            format!("[{}]", m.join(","))
        }
        _ => "null".into(),
    }
}

/// The projected key and value of one entry, decoded through the
/// projection's own types.
fn decoded(p: &Projection, key: &[u8], value: &[u8], stride: usize) -> (String, String) {
    let (mut k, mut v) = (Vec::new(), Vec::new());
    p.write(&EntryRef { key, value, stride }, &mut k, &mut v);
    assert_eq!((k.len(), v.len()), (p.key_size(), p.value_size()));
    let json = |t: &Option<pb::TypeInfo>, bytes: &[u8], what: &str| match t {
        None => "null".to_owned(),
        Some(t) => show(&Layout::new(t, what).unwrap().to_value(bytes)),
    };
    (
        json(&p.key_type(), &k, "key"),
        json(&p.value_type(), &v, "value"),
    )
}

#[test]
fn selected_members_are_packed_in_request_order_and_decode_by_name() {
    let key = t::flow_key();
    let value = t::everything();
    let shape = t::layout(&key, &value, None);
    let p = Projection::new(
        &fields(&[
            "value.inner.x",
            "key.dport",
            "value.flags",
            "value.level",
            "value.comm",
            "value.counters[1]",
            "value.anon_b",
            "value.port",
            "key.proto",
        ]),
        &shape,
    )
    .unwrap();
    assert_eq!(p.key_size(), 2 + 1);
    // x, flags and level (bitfields: one byte each), comm, counters[1],
    // anon_b, port.
    assert_eq!(p.value_size(), 4 + 1 + 1 + 16 + 4 + 2 + 2);
    let mut v = vec![0u8; at::SIZE];
    t::put(&mut v, at::INNER, &7u32.to_le_bytes());
    t::put(&mut v, at::BITS, &[0b101 | (0b11101 << 3)]);
    t::put(&mut v, at::COMM, b"curl");
    t::put(&mut v, at::COUNTERS + 4, &9u32.to_le_bytes());
    t::put(&mut v, at::ANON, &0x0005_0006u32.to_le_bytes());
    t::put(&mut v, at::PORT, &443u16.to_be_bytes());
    let k = t::flow(1, 2, 3, 8080, 17);
    let (k, v) = decoded(&p, &k, &v, 0);
    assert_eq!(k, r#"{dport:8080,proto:"IPPROTO_UDP"}"#);
    assert_eq!(
        v,
        r#"{anon_b:6,comm:"curl",counters[1]:9,flags:5,inner.x:7,level:-3,port:443}"#
    );
}

#[test]
fn whole_keys_and_values_keep_their_names() {
    let key = t::flow_key();
    let value = t::flow_stats();
    let shape = t::layout(&key, &value, None);
    let p = Projection::new(&fields(&["value", "key.saddr"]), &shape).unwrap();
    let (k, v) = decoded(&p, &t::flow(5, 6, 7, 8, 6), &t::stats(1, 2), 0);
    assert_eq!(k, "{saddr:5}");
    assert_eq!(v, r#"{value:{bytes:"2",packets:"1"}}"#);
    let p = Projection::new(&fields(&["value.bytes"]), &shape).unwrap();
    assert!(
        p.key_type().is_none() && p.key_size() == 0,
        "no key member selected"
    );
}

#[test]
fn per_cpu_values_project_summed_or_one_cpu() {
    let key = t::flow_key();
    let value = t::flow_stats();
    let shape = t::layout(&key, &value, Some(3));
    let p = Projection::new(&fields(&["value.bytes", "values[2].packets"]), &shape).unwrap();
    assert_eq!(p.value_size(), 16 + 8);
    let mut v = Vec::new();
    for c in 0..3u64 {
        v.extend_from_slice(&t::stats(c + 1, u64::MAX - c));
    }
    let (_, v) = decoded(&p, &t::flow(1, 2, 3, 4, 6), &v, 16);
    let sum = 3 * u128::from(u64::MAX) - 3;
    assert_eq!(v, format!(r#"{{bytes:"{sum}",values[2].packets:"3"}}"#));
}

#[test]
fn fields_that_do_not_fit_are_refused_naming_them() {
    let key = t::flow_key();
    let value = t::everything();
    let shape = t::layout(&key, &value, None);
    let refused = |f: &[&str]| Projection::new(&fields(f), &shape).unwrap_err().to_string();
    assert_eq!(
        refused(&["key.dport", "key.dport"]),
        "key.dport: given twice"
    );
    assert_eq!(
        refused(&["key.dprt"]),
        "key.dprt: no such member of struct flow_key (members: saddr, daddr, sport, dport, proto)"
    );
    assert_eq!(
        refused(&["flow.dport"]),
        "\"flow.dport\": a member path starts with key, value or values[i]"
    );
    let many: Vec<String> = (0..65).map(|i| format!("value.counters[{i}]")).collect();
    assert_eq!(
        Projection::new(&many, &shape).unwrap_err().to_string(),
        "at most 64 fields"
    );
    let per_cpu = t::layout(&key, &value, Some(2));
    let e = Projection::new(&fields(&["value.comm"]), &per_cpu)
        .unwrap_err()
        .to_string();
    assert!(
        e.starts_with("value.comm: per-CPU values are summed"),
        "{e}"
    );
    let untyped = MapLayout::untyped(MapShape::new(4, 8));
    assert_eq!(
        Projection::new(&fields(&["key.x"]), &untyped)
            .unwrap_err()
            .to_string(),
        "key.x: the map has no types (BTF): its key is bytes"
    );
}
