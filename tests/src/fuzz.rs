//! The fuzz targets' bodies: the type-description builder (BTF bytes to
//! `TypeInfo`) and the decoder (a `TypeInfo` and bytes to JSON, back to
//! bytes, summed). Run by `tests/fuzz` (cargo-fuzz, libFuzzer) and, on
//! stable Rust in every test run, by `tests/tests/fuzz.rs` over mutated
//! seeds. Whatever the input, nothing may panic, hang or read outside the
//! bytes given; every decoded value must be valid JSON.

use bpfmap_proto::{
    typed::{JsonWriter, Layout, MapLayout, MapShape},
    v1::TypeInfo,
};
use prost::Message as _;

/// Largest value the targets decode (a description may claim more).
const MAX_BYTES: usize = 1 << 16;

/// Types are looked up by id up to this many.
const MAX_IDS: u32 = 64;

/// BTF bytes, as the kernel would hand them out: parsed, every type
/// described, every description decoded.
pub fn btf_describe(data: &[u8]) {
    let Ok(btf) = bpfmapd::btf::parse(data, None) else {
        return;
    };
    for id in 1..=MAX_IDS {
        if let Ok(info) = bpfmapd::btf::describe(&btf, id) {
            decode_through(&info, data);
        }
    }
}

/// A `TypeInfo` (protobuf, as a server might send it) followed by value
/// bytes.
pub fn typed_decode(data: &[u8]) {
    let (len, rest) = match data.split_first() {
        Some((&n, rest)) => (usize::from(n) * 4, rest),
        None => return,
    };
    let (head, tail) = rest.split_at(len.min(rest.len()));
    if let Ok(info) = TypeInfo::decode(head) {
        decode_through(&info, tail);
    }
}

/// Decodes `bytes` (cut or padded to the type's size) every way the
/// daemon, the library and bpfmapctl do.
pub fn decode_through(info: &TypeInfo, bytes: &[u8]) {
    let Ok(layout) = Layout::new(info, "value") else {
        return;
    };
    if layout.size() > MAX_BYTES {
        return;
    }
    let mut value = bytes.to_vec();
    value.resize(layout.size(), 0);
    let mut text = Vec::new();
    layout.write_json(&value, &mut text);
    if let Err(e) = serde_json::from_slice::<serde_json::Value>(&text) {
        panic!(
            "invalid JSON ({e}) for {info:?}: {}",
            String::from_utf8_lossy(&text)
        );
    }
    // The compiled plan decodes as the tree does, as text and as values.
    let mut tree = Vec::new();
    layout.render_from_tree(&value, &mut JsonWriter::new(&mut tree));
    assert_eq!(
        String::from_utf8_lossy(&text),
        String::from_utf8_lossy(&tree),
        "the plan's JSON for {info:?}"
    );
    let mut through_sink = Vec::new();
    layout.render(&value, &mut JsonWriter::new(&mut through_sink));
    assert_eq!(through_sink, tree, "the plan through a sink for {info:?}");
    let decoded = layout.to_value(&value);
    let mut tree_value = bpfmap_proto::typed::ValueBuilder::default();
    layout.render_from_tree(&value, &mut tree_value);
    assert_eq!(
        decoded,
        tree_value.finish(),
        "the plan's value for {info:?}"
    );
    let _ = layout.encode(&decoded, "key");
    let _ = layout.encoded_size_hint();
    let _ = layout.member_names();
    if layout.check_summable().is_ok() {
        let mut sum = Vec::new();
        layout.render_sum(&[&value, &value], &mut JsonWriter::new(&mut sum));
        serde_json::from_slice::<serde_json::Value>(&sum).expect("a sum is valid JSON");
        let mut tree = Vec::new();
        layout.render_sum_from_tree(&[&value, &value], &mut JsonWriter::new(&mut tree));
        assert_eq!(sum, tree, "the plan's sums for {info:?}");
    }
    let mut list = Vec::new();
    layout.render_per_cpu(
        [value.as_slice(), &value[..value.len() / 2]],
        &mut JsonWriter::new(&mut list),
    );
    serde_json::from_slice::<serde_json::Value>(&list).expect("a per-CPU list is valid JSON");
}

/// The map shapes the filter target compiles against.
pub mod shapes {
    use bpfmap_proto::v1::{
        ArrayType, BoolType, CharType, EnumType, Enumerator, IntType, Member, RecordType, TypeInfo,
        type_info::Kind,
    };

    fn int(size: u32, signed: bool, big_endian: bool) -> TypeInfo {
        TypeInfo {
            name: String::new(),
            size,
            kind: Some(Kind::Int(IntType { signed, big_endian })),
        }
    }

    fn member(name: &str, bit_offset: u32, bitfield_size: u32, t: TypeInfo) -> Member {
        Member {
            name: name.into(),
            bit_offset,
            bitfield_size,
            r#type: Some(t),
        }
    }

    fn record(name: &str, size: u32, members: Vec<Member>) -> TypeInfo {
        TypeInfo {
            name: name.into(),
            size,
            kind: Some(Kind::Struct(RecordType { members })),
        }
    }

    fn array(element: TypeInfo, length: u32) -> TypeInfo {
        TypeInfo {
            name: String::new(),
            size: element.size * length,
            kind: Some(Kind::Array(Box::new(ArrayType {
                element: Some(Box::new(element)),
                length,
            }))),
        }
    }

    /// The demo's `struct flow_key` (16 bytes).
    pub fn flow_key() -> TypeInfo {
        let proto = TypeInfo {
            name: "ip_proto".into(),
            size: 1,
            kind: Some(Kind::Enum(EnumType {
                signed: false,
                enumerators: [("IPPROTO_ICMP", 1), ("IPPROTO_TCP", 6), ("IPPROTO_UDP", 17)]
                    .into_iter()
                    .map(|(name, value)| Enumerator {
                        name: name.into(),
                        value,
                    })
                    .collect(),
            })),
        };
        record(
            "flow_key",
            16,
            vec![
                member("saddr", 0, 0, int(4, false, false)),
                member("daddr", 32, 0, int(4, false, false)),
                member("sport", 64, 0, int(2, false, false)),
                member("dport", 80, 0, int(2, false, true)),
                member("proto", 96, 0, proto),
            ],
        )
    }

    /// A value of every kind of member (48 bytes).
    pub fn stats() -> TypeInfo {
        let char_t = TypeInfo {
            name: "char".into(),
            size: 1,
            kind: Some(Kind::Char(CharType { signed: true })),
        };
        let bool_t = TypeInfo {
            name: "_Bool".into(),
            size: 1,
            kind: Some(Kind::Bool(BoolType {})),
        };
        let range = record(
            "",
            8,
            vec![
                member("lo", 0, 0, int(4, false, false)),
                member("hi", 32, 0, int(4, true, false)),
            ],
        );
        record(
            "stats",
            48,
            vec![
                member("packets", 0, 0, int(8, false, false)),
                member("bytes", 64, 0, int(8, true, false)),
                member("comm", 128, 0, array(char_t, 16)),
                member("", 256, 0, range),
                member("flags", 320, 3, int(1, false, false)),
                member("level", 323, 5, int(1, true, false)),
                member("ok", 328, 0, bool_t),
                member("counters", 336, 0, array(int(2, false, false), 3)),
                member("wide", 0, 0, int(16, false, false)),
            ],
        )
    }
}

/// Filter sources the stable runner and the fuzzer start from.
pub const FILTER_SEEDS: &[&str] = &[
    "key.dport == 443 && value.bytes > 1000000",
    "key.proto == \"IPPROTO_UDP\" || key.proto in [\"IPPROTO_TCP\", 1]",
    "value.comm.startsWith(\"ng\") && value.comm.endsWith(\"x\") && value.comm.contains(\"i\")",
    "value.comm.matches(\"^(a|b)*c+$\") && size(value.comm) < 10",
    "value.lo + value.hi * 2 - 1 >= -5 ? value.ok : !value.ok",
    "value.flags == 5 && value.level < 0 && value.counters[2] != 0",
    "value.wide > 18446744073709551615u || value.packets % 7 == 3",
    "key.saddr / (key.daddr - key.daddr) == 1",
    "values[1].packets > values[0].packets",
    "key.u32(0) == 7 && value.be16(4) == 443 && u64(value, 8) > 0",
    "key in [b\"abc\", b\"\\x00\\x01\"] && value.startsWith(b\"\\xff\")",
];

/// The layouts filters are tried on: 0 typed, 1 per-CPU on 3 CPUs, 2
/// untyped (8-byte keys, 16-byte values).
pub fn filter_layout(which: u8) -> MapLayout {
    let (key, value) = (shapes::flow_key(), shapes::stats());
    match which % 3 {
        0 => MapLayout::new(Some(&key), Some(&value), MapShape::new(16, 48)),
        1 => MapLayout::new(
            Some(&key),
            Some(&value),
            MapShape::new(16, 48).with_cpus(Some(3)),
        ),
        _ => Ok(MapLayout::untyped(MapShape::new(8, 16))),
    }
    .expect("the fuzz shapes are valid")
}

/// A shape selector, a filter's source and, after a NUL, entry bytes:
/// compiled against the shape and, when it compiles, evaluated on the
/// bytes at the right sizes and on bytes too short.
pub fn filter_eval(data: &[u8]) {
    let Some((&which, rest)) = data.split_first() else {
        return;
    };
    let (source, bytes) = match rest.iter().position(|&b| b == 0) {
        Some(n) => (&rest[..n], &rest[n + 1..]),
        None => (rest, &[][..]),
    };
    let source = String::from_utf8_lossy(source);
    let layout = filter_layout(which);
    let Ok(filter) = bpfmapd::query::Filter::compile(&source, &layout) else {
        return;
    };
    let (key_size, value_size) = (layout.key().size(), layout.value().size());
    let cpus = layout.cpus().unwrap_or(1);
    let stride = if layout.cpus().is_some() {
        value_size
    } else {
        0
    };
    let mut entry: Vec<u8> = bytes.to_vec();
    entry.resize(key_size + value_size * cpus, 0);
    let (key, value) = entry.split_at(key_size);
    let _ = filter.matches(&bpfmapd::query::EntryRef { key, value, stride });
    // Bytes too short for the shape: reads past them are errors, never
    // reads outside them.
    let half = bytes.len() / 2;
    let _ = filter.matches(&bpfmapd::query::EntryRef {
        key: &bytes[..half],
        value: &bytes[half..],
        stride,
    });
}
