use prost_types::{Value, value::Kind as V};
use serde_json::json;

use super::*;
use crate::v1::{
    ArrayType, BoolType, CharType, EnumType, Enumerator, FloatType, IntType, Member, OpaqueType,
    PointerType, RecordType,
};

fn ty(name: &str, size: u32, kind: Kind) -> TypeInfo {
    TypeInfo {
        name: name.into(),
        size,
        kind: Some(kind),
    }
}
fn int(name: &str, size: u32, signed: bool) -> TypeInfo {
    ty(
        name,
        size,
        Kind::Int(IntType {
            signed,
            big_endian: false,
        }),
    )
}
fn u(size: u32) -> TypeInfo {
    int(&format!("__u{}", size * 8), size, false)
}
fn s(size: u32) -> TypeInfo {
    int(&format!("__s{}", size * 8), size, true)
}
fn char_() -> TypeInfo {
    ty("char", 1, Kind::Char(CharType { signed: true }))
}
fn member(name: &str, byte: u32, t: TypeInfo) -> Member {
    Member {
        name: name.into(),
        bit_offset: byte * 8,
        bitfield_size: 0,
        r#type: Some(t),
    }
}
fn bits(name: &str, bit: u32, width: u32, t: TypeInfo) -> Member {
    Member {
        name: name.into(),
        bit_offset: bit,
        bitfield_size: width,
        r#type: Some(t),
    }
}
fn record(name: &str, size: u32, members: Vec<Member>) -> TypeInfo {
    ty(name, size, Kind::Struct(RecordType { members }))
}
fn union(name: &str, size: u32, members: Vec<Member>) -> TypeInfo {
    ty(name, size, Kind::Union(RecordType { members }))
}
fn array(element: TypeInfo, length: u32) -> TypeInfo {
    let size = element.size * length;
    ty(
        "",
        size,
        Kind::Array(Box::new(ArrayType {
            element: Some(Box::new(element)),
            length,
        })),
    )
}
fn enum_(name: &str, size: u32, signed: bool, values: &[(&str, i64)]) -> TypeInfo {
    ty(
        name,
        size,
        Kind::Enum(EnumType {
            signed,
            enumerators: values
                .iter()
                .map(|(n, v)| Enumerator {
                    name: (*n).into(),
                    value: *v,
                })
                .collect(),
        }),
    )
}
fn ip_proto() -> TypeInfo {
    enum_(
        "ip_proto",
        1,
        false,
        &[("IPPROTO_ICMP", 1), ("IPPROTO_TCP", 6), ("IPPROTO_UDP", 17)],
    )
}
fn flow_key() -> TypeInfo {
    record(
        "flow_key",
        16,
        vec![
            member("saddr", 0, u(4)),
            member("daddr", 4, u(4)),
            member("sport", 8, u(2)),
            member("dport", 10, u(2)),
            member("proto", 12, ip_proto()),
        ],
    )
}

fn layout(t: &TypeInfo) -> Layout {
    Layout::new(t, "value").unwrap()
}

/// A message whose field 4 is a `google.protobuf.Value`, as Entry's
/// decoded_key is.
#[derive(Clone, PartialEq, prost::Message)]
struct Holder {
    #[prost(message, optional, tag = "4")]
    v: Option<Value>,
}

/// What [`ValueWriter`] writes for `bytes`, read back by prost.
fn through_the_wire(l: &Layout, bytes: &[u8]) -> Value {
    use prost::Message as _;
    let mut wire = vec![0x0a, 0x01, 0x07]; // another field before it
    l.render(bytes, &mut ValueWriter::new(&mut wire, 4));
    let held = Holder::decode(wire.as_slice())
        .unwrap_or_else(|e| panic!("ValueWriter wrote an invalid message: {e}"));
    held.v.expect("the value")
}

/// The decoded JSON, checked to be the same through every sink.
fn decode(t: &TypeInfo, bytes: &[u8]) -> serde_json::Value {
    decode_layout(&layout(t), bytes)
}

fn to_json(v: &Value) -> serde_json::Value {
    match &v.kind {
        None | Some(V::NullValue(_)) => serde_json::Value::Null,
        Some(V::BoolValue(b)) => json!(b),
        Some(V::NumberValue(n)) if n.fract() == 0.0 && n.abs() < 1e15 => json!(*n as i64),
        Some(V::NumberValue(n)) => json!(n),
        Some(V::StringValue(s)) => json!(s),
        Some(V::ListValue(l)) => l.values.iter().map(to_json).collect(),
        Some(V::StructValue(s)) => s
            .fields
            .iter()
            .map(|(k, v)| (k.clone(), to_json(v)))
            .collect::<serde_json::Map<_, _>>()
            .into(),
    }
}

fn from_json(j: &serde_json::Value) -> Value {
    let kind = match j {
        serde_json::Value::Null => V::NullValue(0),
        serde_json::Value::Bool(b) => V::BoolValue(*b),
        serde_json::Value::Number(n) => V::NumberValue(n.as_f64().unwrap()),
        serde_json::Value::String(s) => V::StringValue(s.clone()),
        serde_json::Value::Array(a) => V::ListValue(prost_types::ListValue {
            values: a.iter().map(from_json).collect(),
        }),
        serde_json::Value::Object(o) => V::StructValue(prost_types::Struct {
            fields: o.iter().map(|(k, v)| (k.clone(), from_json(v))).collect(),
        }),
    };
    Value { kind: Some(kind) }
}

fn flow_bytes(saddr: u32, daddr: u32, sport: u16, dport: u16, proto: u8) -> Vec<u8> {
    let mut b = Vec::new();
    b.extend_from_slice(&saddr.to_le_bytes());
    b.extend_from_slice(&daddr.to_le_bytes());
    b.extend_from_slice(&sport.to_le_bytes());
    b.extend_from_slice(&dport.to_le_bytes());
    b.push(proto);
    b.extend_from_slice(&[0; 3]);
    b
}

#[test]
fn a_flow_key_reads_as_its_program_declared_it() {
    let bytes = flow_bytes(167772160, 3232235521, 1024, 443, 6);
    assert_eq!(
        decode(&flow_key(), &bytes),
        json!({"saddr": 167772160, "daddr": 3232235521u32, "sport": 1024, "dport": 443, "proto": "IPPROTO_TCP"})
    );
    // An enumerator nobody declared: its number.
    let bytes = flow_bytes(1, 2, 3, 4, 99);
    assert_eq!(decode(&flow_key(), &bytes)["proto"], json!(99));
    // JSON text keeps the declaration order.
    let mut text = Vec::new();
    layout(&flow_key()).write_json(&flow_bytes(1, 2, 3, 4, 17), &mut text);
    assert_eq!(
        String::from_utf8(text).unwrap(),
        r#"{"saddr":1,"daddr":2,"sport":3,"dport":4,"proto":"IPPROTO_UDP"}"#
    );
}

#[test]
fn integers_up_to_32_bits_are_numbers_and_wider_ones_decimal_strings() {
    let cases: Vec<(TypeInfo, Vec<u8>, serde_json::Value)> = vec![
        (u(1), vec![255], json!(255)),
        (s(1), vec![0x80], json!(-128)),
        (u(2), 65535u16.to_le_bytes().to_vec(), json!(65535)),
        (s(2), (-2i16).to_le_bytes().to_vec(), json!(-2)),
        (u(4), u32::MAX.to_le_bytes().to_vec(), json!(4294967295u32)),
        (s(4), i32::MIN.to_le_bytes().to_vec(), json!(-2147483648i64)),
        (
            u(8),
            u64::MAX.to_le_bytes().to_vec(),
            json!("18446744073709551615"),
        ),
        (
            s(8),
            i64::MIN.to_le_bytes().to_vec(),
            json!("-9223372036854775808"),
        ),
        (u(8), 5u64.to_le_bytes().to_vec(), json!("5")),
        (
            u(16),
            u128::MAX.to_le_bytes().to_vec(),
            json!("340282366920938463463374607431768211455"),
        ),
        (s(16), (-3i128).to_le_bytes().to_vec(), json!("-3")),
    ];
    for (t, bytes, want) in cases {
        assert_eq!(decode(&t, &bytes), want, "{t:?}");
    }
}

#[test]
fn bools_chars_floats_pointers_and_opaque_bytes() {
    let b = ty("_Bool", 1, Kind::Bool(BoolType {}));
    assert_eq!(decode(&b, &[1]), json!(true));
    assert_eq!(decode(&b, &[0]), json!(false));
    assert_eq!(decode(&char_(), b"A"), json!(65));
    let f32_ = ty("float", 4, Kind::Float(FloatType {}));
    let f64_ = ty("double", 8, Kind::Float(FloatType {}));
    assert_eq!(decode(&f32_, &1.5f32.to_le_bytes()), json!(1.5));
    assert_eq!(decode(&f64_, &(-0.25f64).to_le_bytes()), json!(-0.25));
    assert_eq!(decode(&f64_, &f64::NAN.to_le_bytes()), json!("NaN"));
    assert_eq!(
        decode(&f64_, &f64::NEG_INFINITY.to_le_bytes()),
        json!("-Infinity")
    );
    let p = ty(
        "",
        8,
        Kind::Pointer(PointerType {
            target: "node".into(),
        }),
    );
    assert_eq!(
        decode(&p, &0xffff_8881_0000_1234u64.to_le_bytes()),
        json!("0xffff888100001234")
    );
    let long_double = ty("long double", 16, Kind::Float(FloatType {}));
    assert_eq!(
        decode(&long_double, &[0xab; 16]),
        json!("abababababababababababababababab")
    );
    let opaque = ty(
        "opaque",
        3,
        Kind::Opaque(OpaqueType {
            reason: "forward declaration".into(),
        }),
    );
    assert_eq!(decode(&opaque, &[1, 2, 255]), json!("0102ff"));
}

#[test]
fn char_arrays_are_strings_when_they_hold_text() {
    let name = array(char_(), 8);
    assert_eq!(decode(&name, b"bpfmapd\0"), json!("bpfmapd"));
    assert_eq!(decode(&name, b"ab\0\0\0\0\0\0"), json!("ab"));
    assert_eq!(decode(&name, b"\0xxxxxxx"), json!(""));
    // Not text: a control character, or no NUL at all.
    assert_eq!(
        decode(&name, b"a\x01b\0\0\0\0\0"),
        json!([97, 1, 98, 0, 0, 0, 0, 0])
    );
    assert_eq!(
        decode(&name, b"abcdefgh"),
        json!([97, 98, 99, 100, 101, 102, 103, 104])
    );
    // Bytes (unsigned char arrays) are never strings.
    assert_eq!(decode(&array(u(1), 3), b"ab\0"), json!([97, 98, 0]));
    // Quotes and backslashes are escaped in the JSON text.
    assert_eq!(decode(&name, b"a\"b\\c\0\0\0"), json!("a\"b\\c"));
}

#[test]
fn structs_unions_anonymous_members_and_arrays_nest() {
    // struct outer { struct inner { __u16 a; __u16 b; } in; union { __u32 x; __u8 y[4]; }; struct { __s8 lo; __s8 hi; }; __u8 pad[2]; struct inner many[2]; }
    let inner = || record("inner", 4, vec![member("a", 0, u(2)), member("b", 2, u(2))]);
    let anon_union = union(
        "",
        4,
        vec![member("x", 0, u(4)), member("y", 0, array(u(1), 4))],
    );
    let anon_struct = record("", 2, vec![member("lo", 0, s(1)), member("hi", 1, s(1))]);
    let outer = record(
        "outer",
        20,
        vec![
            member("in", 0, inner()),
            member("", 4, anon_union),
            member("", 8, anon_struct),
            member("many", 12, array(inner(), 2)),
        ],
    );
    let mut bytes = vec![0u8; 20];
    bytes[0..2].copy_from_slice(&1u16.to_le_bytes());
    bytes[2..4].copy_from_slice(&2u16.to_le_bytes());
    bytes[4..8].copy_from_slice(&0x04030201u32.to_le_bytes());
    bytes[8] = 0xff;
    bytes[9] = 7;
    for (i, v) in [10u16, 11, 12, 13].iter().enumerate() {
        bytes[12 + 2 * i..14 + 2 * i].copy_from_slice(&v.to_le_bytes());
    }
    assert_eq!(
        decode(&outer, &bytes),
        json!({
            "in": {"a": 1, "b": 2},
            "x": 67305985, "y": [1, 2, 3, 4],
            "lo": -1, "hi": 7,
            "many": [{"a": 10, "b": 11}, {"a": 12, "b": 13}],
        })
    );
    assert_eq!(
        layout(&outer).member_names(),
        ["in", "x", "y", "lo", "hi", "many"]
    );
    // Arrays of arrays.
    let grid = array(array(u(1), 3), 2);
    assert_eq!(
        decode(&grid, &[1, 2, 3, 4, 5, 6]),
        json!([[1, 2, 3], [4, 5, 6]])
    );
}

#[test]
fn enums_signed_and_64_bit_known_and_unknown() {
    let color = enum_("color", 4, true, &[("RED", 0), ("NEG", -1)]);
    assert_eq!(decode(&color, &(-1i32).to_le_bytes()), json!("NEG"));
    assert_eq!(decode(&color, &(-7i32).to_le_bytes()), json!(-7));
    let big = enum_("big", 8, false, &[("SMALL", 1), ("HUGE", u64::MAX as i64)]);
    assert_eq!(decode(&big, &u64::MAX.to_le_bytes()), json!("HUGE"));
    assert_eq!(
        decode(&big, &(u64::MAX - 1).to_le_bytes()),
        json!("18446744073709551614")
    );
    let unsigned32 = enum_("flags", 4, false, &[("ALL", 0xffff_ffff)]);
    assert_eq!(decode(&unsigned32, &u32::MAX.to_le_bytes()), json!("ALL"));
    assert_eq!(decode(&unsigned32, &5u32.to_le_bytes()), json!(5));
}

#[test]
fn bitfields_are_extracted_with_their_sign_and_enum_names() {
    // struct bf { __u32 a:3; __s32 b:5; enum color c:2; __u64 wide:40; _Bool on:1; }
    let color = enum_("color", 4, false, &[("RED", 0), ("GREEN", 1), ("BLUE", 2)]);
    let b = ty("_Bool", 1, Kind::Bool(BoolType {}));
    let t = record(
        "bf",
        16,
        vec![
            bits("a", 0, 3, u(4)),
            bits("b", 3, 5, s(4)),
            bits("c", 8, 2, color),
            bits("wide", 10, 40, u(8)),
            bits("on", 50, 1, b),
        ],
    );
    let raw: u128 = 0b101 | (0b10110 << 3) | (2 << 8) | (0xAB_CDEF_0123 << 10) | (1 << 50);
    let bytes = raw.to_le_bytes();
    assert_eq!(
        decode(&t, &bytes),
        json!({"a": 5, "b": -10, "c": "BLUE", "wide": "737894400291", "on": true})
    );
    // And back.
    let l = layout(&t);
    let value = from_json(&decode(&t, &bytes));
    assert_eq!(l.encode(&value, "key").unwrap(), bytes.to_vec());
}

#[test]
fn per_cpu_values_are_listed_or_summed_exactly() {
    let t = record(
        "counters",
        24,
        vec![
            member("packets", 0, u(8)),
            member("errors", 8, u(4)),
            member("delta", 12, s(4)),
            member("hist", 16, array(u(2), 4)),
        ],
    );
    let l = layout(&t);
    let cpu = |p: u64, e: u32, d: i32, h: u16| {
        let mut b = Vec::new();
        b.extend_from_slice(&p.to_le_bytes());
        b.extend_from_slice(&e.to_le_bytes());
        b.extend_from_slice(&d.to_le_bytes());
        for _ in 0..4 {
            b.extend_from_slice(&h.to_le_bytes());
        }
        b
    };
    let cpus = [
        cpu(u64::MAX, u32::MAX, -5, 65535),
        cpu(u64::MAX, u32::MAX, 2, 65535),
        cpu(1, 1, -1, 1),
    ];
    let slices: Vec<&[u8]> = cpus.iter().map(Vec::as_slice).collect();
    let mut text = Vec::new();
    l.render_sum(&slices, &mut JsonWriter::new(&mut text));
    let sum: serde_json::Value = serde_json::from_slice(&text).unwrap();
    assert_eq!(
        sum,
        json!({"packets": "36893488147419103231", "errors": 8589934591u64, "delta": -4, "hist": [131071, 131071, 131071, 131071]})
    );
    let mut text = Vec::new();
    l.render_per_cpu(slices.iter().copied(), &mut JsonWriter::new(&mut text));
    let each: serde_json::Value = serde_json::from_slice(&text).unwrap();
    assert_eq!(each.as_array().unwrap().len(), 3);
    assert_eq!(
        each[2],
        json!({"packets": "1", "errors": 1, "delta": -1, "hist": [1, 1, 1, 1]})
    );

    // What cannot be summed, and why.
    l.check_summable().unwrap();
    let e = layout(&record("s", 8, vec![member("name", 0, array(char_(), 8))]))
        .check_summable()
        .unwrap_err();
    assert_eq!(
        e.to_string(),
        "value.name: an array is not an integer: only integers are summed"
    );
    let e = layout(&flow_key()).check_summable().unwrap_err();
    assert_eq!(e.path, "value.proto");
    assert!(
        layout(&union("u", 4, vec![member("x", 0, u(4))]))
            .check_summable()
            .is_err()
    );
    assert!(layout(&u(16)).check_summable().is_err());
    assert!(Layout::unsigned(8).unwrap().check_summable().is_ok());
    assert!(Layout::unsigned(3).is_none());
}

#[test]
fn json_keys_encode_to_the_bytes_the_program_uses() {
    let l = Layout::new(&flow_key(), "key").unwrap();
    let key = json!({"saddr": 167772160, "daddr": 3232235521u32, "sport": 1024, "dport": 443, "proto": "IPPROTO_TCP"});
    assert_eq!(
        l.encode(&from_json(&key), "key").unwrap(),
        flow_bytes(167772160, 3232235521, 1024, 443, 6)
    );
    // Numbers as strings, enums as numbers, hex.
    let key =
        json!({"saddr": "0x0a000001", "daddr": "3232235521", "sport": 1, "dport": 2, "proto": 17});
    assert_eq!(
        l.encode(&from_json(&key), "key").unwrap(),
        flow_bytes(0x0a000001, 3232235521, 1, 2, 17)
    );
    let err = |j: serde_json::Value| l.encode(&from_json(&j), "key").unwrap_err().to_string();
    assert_eq!(
        err(json!({"saddr": 1, "daddr": 2, "sport": 3, "dport": 4})),
        "key.proto: missing"
    );
    assert_eq!(
        err(json!({"saddr": 1, "daddr": 2, "sport": 70000, "dport": 4, "proto": 6})),
        "key.sport: 70000 is out of range for a 16-bit unsigned integer (0 to 65535)"
    );
    assert_eq!(
        err(json!({"saddr": 1, "daddr": 2, "sport": 3, "dport": 4, "proto": "IPPROTO_SCTP"})),
        "key.proto: \"IPPROTO_SCTP\" is not an enumerator of enum ip_proto (one of IPPROTO_ICMP, IPPROTO_TCP, IPPROTO_UDP, or a number)"
    );
    assert_eq!(
        err(json!({"saddr": 1, "daddr": 2, "sport": 3, "dport": 4, "proto": 6, "vlan": 1})),
        "key: no member named \"vlan\" (members: saddr, daddr, sport, dport, proto)"
    );
    assert_eq!(
        err(json!({"saddr": -1, "daddr": 2, "sport": 3, "dport": 4, "proto": 6})),
        "key.saddr: -1 is out of range for a 32-bit unsigned integer (0 to 4294967295)"
    );
    assert_eq!(
        err(json!({"saddr": 1.5, "daddr": 2, "sport": 3, "dport": 4, "proto": 6})),
        "key.saddr: 1.5 is not an integer"
    );
    assert_eq!(err(json!([1, 2])), "key: expected an object, got a list");

    // 64-bit values beyond 2^53 must be strings.
    let l64 = Layout::new(&u(8), "key").unwrap();
    assert_eq!(
        l64.encode(&from_json(&json!("18446744073709551615")), "key")
            .unwrap(),
        u64::MAX.to_le_bytes()
    );
    assert!(
        l64.encode(&from_json(&json!(1e17)), "key")
            .unwrap_err()
            .message
            .contains("write it as a string")
    );
    // Char arrays from strings, with room for the NUL.
    let name = Layout::new(&array(char_(), 4), "key").unwrap();
    assert_eq!(
        name.encode(&from_json(&json!("abc")), "key").unwrap(),
        b"abc\0"
    );
    assert!(name.encode(&from_json(&json!("abcd")), "key").is_err());
    // Arrays need every element; unions exactly one member.
    let pair = Layout::new(&array(u(2), 2), "key").unwrap();
    assert_eq!(
        pair.encode(&from_json(&json!([1])), "key")
            .unwrap_err()
            .to_string(),
        "key: expected 2 elements, got 1"
    );
    let un = Layout::new(
        &union("u", 4, vec![member("x", 0, u(4)), member("y", 0, u(2))]),
        "key",
    )
    .unwrap();
    assert_eq!(
        un.encode(&from_json(&json!({"y": 7})), "key").unwrap(),
        [7, 0, 0, 0]
    );
    assert!(
        un.encode(&from_json(&json!({"x": 1, "y": 7})), "key")
            .is_err()
    );
}

#[test]
fn everything_decoded_encodes_back_to_the_same_bytes() {
    let t = record(
        "all",
        48,
        vec![
            member("key", 0, flow_key()),
            member("name", 16, array(char_(), 8)),
            member("neg", 24, s(8)),
            member("f", 32, ty("double", 8, Kind::Float(FloatType {}))),
            member("on", 40, ty("_Bool", 1, Kind::Bool(BoolType {}))),
            member("c", 41, char_()),
            member("bytes", 42, array(u(1), 6)),
        ],
    );
    let l = layout(&t);
    let mut bytes = vec![0u8; 48];
    bytes[..16].copy_from_slice(&flow_bytes(9, 8, 7, 6, 1));
    bytes[16..20].copy_from_slice(b"xyz\0");
    bytes[24..32].copy_from_slice(&(-42i64).to_le_bytes());
    bytes[32..40].copy_from_slice(&3.25f64.to_le_bytes());
    bytes[40] = 1;
    bytes[41] = b'q';
    bytes[42..48].copy_from_slice(&[1, 2, 3, 4, 5, 6]);
    let decoded = decode(&t, &bytes);
    assert_eq!(l.encode(&from_json(&decoded), "value").unwrap(), bytes);
}

#[test]
fn descriptions_that_would_read_outside_their_bytes_are_refused() {
    let e = Layout::new(&record("s", 4, vec![member("x", 2, u(4))]), "value").unwrap_err();
    assert_eq!(
        e.to_string(),
        "value.x: ends at bit 48, past the end of its 4-byte record"
    );
    let mut bad_array = array(u(4), 4);
    bad_array.size = 12;
    assert!(Layout::new(&bad_array, "value").is_err());
    let e = Layout::new(
        &record("s", 8, vec![member("x", 0, u(4)), member("x", 4, u(4))]),
        "value",
    )
    .unwrap_err();
    assert_eq!(e.to_string(), "value.x: a second member of that name");
    let mut deep = u(4);
    for _ in 0..MAX_DEPTH + 1 {
        deep = record("n", 4, vec![member("n", 0, deep)]);
    }
    assert!(
        Layout::new(&deep, "value")
            .unwrap_err()
            .message
            .contains("levels deep")
    );
    assert!(Layout::new(&TypeInfo::default(), "value").is_err());
    assert!(Layout::new(&int("odd", 3, false), "value").is_err());
    let e = Layout::new(
        &record("s", 4, vec![bits("f", 0, 3, array(u(1), 4))]),
        "value",
    )
    .unwrap_err();
    assert_eq!(e.to_string(), "value.f: a bitfield of an array");
    // Bytes of the wrong size decode as null.
    assert_eq!(decode(&u(4), &[1, 2]), serde_json::Value::Null);
}

#[test]
fn descriptions_that_would_decode_into_millions_of_values_are_refused() {
    // An array of four billion empty structs takes no bytes at all.
    let empty = record("empty", 0, vec![]);
    let huge = ty(
        "",
        0,
        Kind::Array(Box::new(ArrayType {
            element: Some(Box::new(empty)),
            length: u32::MAX,
        })),
    );
    let e = Layout::new(&huge, "value").unwrap_err();
    assert!(e.message.contains("more than 1048576 values"), "{e}");
    // A 64 KiB buffer is fine.
    assert!(Layout::new(&array(u(1), 65536), "value").is_ok());
}

fn be(name: &str, size: u32) -> TypeInfo {
    ty(
        name,
        size,
        Kind::Int(IntType {
            signed: false,
            big_endian: true,
        }),
    )
}

/// Cilium's `struct ipv4_ct_tuple`.
fn ct_tuple() -> TypeInfo {
    record(
        "ipv4_ct_tuple",
        14,
        vec![
            member("daddr", 0, be("__be32", 4)),
            member("saddr", 4, be("__be32", 4)),
            member("dport", 8, be("__be16", 2)),
            member("sport", 10, be("__be16", 2)),
            member("nexthdr", 12, u(1)),
            member("flags", 13, u(1)),
        ],
    )
}

/// 10.0.0.1:443 <- 192.168.0.2:51234, TCP, as the kernel stores it.
fn ct_bytes() -> Vec<u8> {
    let mut b = vec![10, 0, 0, 1, 192, 168, 0, 2];
    b.extend_from_slice(&443u16.to_be_bytes());
    b.extend_from_slice(&51234u16.to_be_bytes());
    b.extend_from_slice(&[6, 0]);
    b
}

fn renderings(pairs: &[(&str, &str)]) -> Renderings {
    let map: std::collections::BTreeMap<String, String> = pairs
        .iter()
        .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
        .collect();
    Renderings::parse(&map).unwrap()
}

/// `t`'s layout as the key (or value) of a map, with `r` applied.
fn rendered(t: &TypeInfo, root: &str, r: &Renderings) -> Result<Layout, TypeError> {
    let other = u(1);
    let size = t.size as usize;
    if root == "key" {
        let l = MapLayout::new(Some(t), Some(&other), MapShape::new(size, 1))?;
        Ok(l.with_renderings(r)?.key().clone())
    } else {
        let l = MapLayout::new(Some(&other), Some(t), MapShape::new(1, size))?;
        Ok(l.with_renderings(r)?.value().clone())
    }
}

fn decode_layout(l: &Layout, bytes: &[u8]) -> serde_json::Value {
    let mut text = Vec::new();
    l.write_json(bytes, &mut text);
    let j: serde_json::Value = serde_json::from_slice(&text)
        .unwrap_or_else(|e| panic!("invalid JSON {}: {e}", String::from_utf8_lossy(&text)));
    let built = l.to_value(bytes);
    assert_eq!(j, to_json(&built), "the JSON and Value sinks differ");
    assert_eq!(
        through_the_wire(l, bytes),
        built,
        "the wire and Value sinks differ"
    );
    j
}

#[test]
fn long_values_take_lengths_of_several_bytes() {
    let t = array(
        record("r", 8, vec![member("a", 0, u(4)), member("b", 4, s(4))]),
        64,
    );
    let bytes: Vec<u8> = (0..512u32).map(|i| i as u8).collect();
    let l = layout(&t);
    assert_eq!(through_the_wire(&l, &bytes), l.to_value(&bytes));
    let text = layout(&array(char_(), 300));
    let mut chars = vec![b'x'; 299];
    chars.push(0);
    assert_eq!(through_the_wire(&text, &chars), text.to_value(&chars));
}

#[test]
fn network_order_integers_read_and_encode_as_numbers() {
    let t = ct_tuple();
    assert_eq!(
        decode(&t, &ct_bytes()),
        json!({"daddr": 167772161, "saddr": 3232235522u32, "dport": 443, "sport": 51234, "nexthdr": 6, "flags": 0})
    );
    let key = json!({"daddr": 167772161, "saddr": 3232235522u32, "dport": 443, "sport": 51234, "nexthdr": 6, "flags": 0});
    assert_eq!(
        layout(&t).encode(&from_json(&key), "key").unwrap(),
        ct_bytes()
    );
    // 64 bits, and sums of per-CPU network-order counters.
    let t64 = be("__be64", 8);
    let bytes = 0x0102_0304_0506_0708u64.to_be_bytes();
    assert_eq!(decode(&t64, &bytes), json!("72623859790382856"));
    let l = layout(&be("__be16", 2));
    let cpus: [&[u8]; 2] = [&[0x01, 0x00], &[0x00, 0x02]];
    let mut sum = Vec::new();
    l.render_sum(&cpus, &mut JsonWriter::new(&mut sum));
    assert_eq!(String::from_utf8(sum).unwrap(), "258");
}

#[test]
fn renderings_show_addresses_and_hex_and_accept_them_back() {
    let l = rendered(
        &ct_tuple(),
        "key",
        &renderings(&[
            ("key.daddr", "ipv4"),
            ("key.saddr", "ipv4"),
            ("key.flags", "hex"),
        ]),
    )
    .unwrap();
    let shown = json!({"daddr": "10.0.0.1", "saddr": "192.168.0.2", "dport": 443, "sport": 51234, "nexthdr": 6, "flags": "0x0"});
    assert_eq!(decode_layout(&l, &ct_bytes()), shown);
    assert_eq!(l.encode(&from_json(&shown), "key").unwrap(), ct_bytes());
    // Numbers are still accepted for a rendered integer.
    let numeric = json!({"daddr": 167772161, "saddr": "192.168.0.2", "dport": 443, "sport": 51234, "nexthdr": 6, "flags": 0});
    assert_eq!(l.encode(&from_json(&numeric), "key").unwrap(), ct_bytes());
    // A plain __u32 holding the bytes as they came off the wire (as
    // xdp-filter keeps its addresses) shows them in memory order, as
    // inet_ntop does.
    let host = rendered(
        &record("k", 4, vec![member("saddr", 0, u(4))]),
        "key",
        &renderings(&[("key.saddr", "ipv4")]),
    )
    .unwrap();
    let bytes = [10u8, 0, 0, 1];
    assert_eq!(decode_layout(&host, &bytes), json!({"saddr": "10.0.0.1"}));
    assert_eq!(
        host.encode(&from_json(&json!({"saddr": "10.0.0.1"})), "key")
            .unwrap(),
        bytes
    );
}

#[test]
fn ipv6_unions_mac_arrays_and_whole_keys_render() {
    // Cilium's union v6addr.
    let words = record(
        "",
        16,
        (0..4)
            .map(|i| member(&format!("p{}", i + 1), i * 4, u(4)))
            .collect(),
    );
    let v6addr = union(
        "v6addr",
        16,
        vec![member("", 0, words), member("addr", 0, array(u(1), 16))],
    );
    let t = record(
        "k",
        22,
        vec![member("addr", 0, v6addr), member("mac", 16, array(u(1), 6))],
    );
    let l = rendered(
        &t,
        "value",
        &renderings(&[("value.addr", "ipv6"), ("value.mac", "mac")]),
    )
    .unwrap();
    let mut bytes = "fe80::1"
        .parse::<std::net::Ipv6Addr>()
        .unwrap()
        .octets()
        .to_vec();
    bytes.extend_from_slice(&[0x02, 0x42, 0xac, 0x11, 0x00, 0x02]);
    let shown = json!({"addr": "fe80::1", "mac": "02:42:ac:11:00:02"});
    assert_eq!(decode_layout(&l, &bytes), shown);
    assert_eq!(l.encode(&from_json(&shown), "value").unwrap(), bytes);
    // The whole key, and hex of bytes.
    let whole = rendered(&be("__be32", 4), "key", &renderings(&[("key", "ipv4")])).unwrap();
    assert_eq!(decode_layout(&whole, &[10, 1, 2, 3]), json!("10.1.2.3"));
    let hex = rendered(&array(u(1), 3), "value", &renderings(&[("value", "hex")])).unwrap();
    assert_eq!(decode_layout(&hex, &[0xde, 0xad, 0x01]), json!("0xdead01"));
    assert_eq!(
        hex.encode(&from_json(&json!("0xdead01")), "value").unwrap(),
        [0xde, 0xad, 0x01]
    );
    // Renderings under the other root do not apply.
    let both = MapLayout::new(Some(&ct_tuple()), Some(&ct_tuple()), MapShape::new(14, 14))
        .unwrap()
        .with_renderings(&renderings(&[("value.daddr", "ipv4")]))
        .unwrap();
    assert_eq!(
        decode_layout(both.key(), &ct_bytes())["daddr"],
        json!(167772161)
    );
    assert_eq!(
        decode_layout(both.value(), &ct_bytes())["daddr"],
        json!("10.0.0.1")
    );
}

#[test]
fn network_order_numbers_and_text_render_and_encode_back() {
    // xdp-filter's port index: 443 off the wire is index 47873 of a __u32
    // key, and a __be16 holds the same bytes.
    let index = rendered(&u(4), "key", &renderings(&[("key", "be16")])).unwrap();
    let bytes = 47873u32.to_le_bytes();
    assert_eq!(decode_layout(&index, &bytes), json!(443));
    assert_eq!(index.encode(&from_json(&json!(443)), "key").unwrap(), bytes);
    let port = rendered(&be("__be16", 2), "key", &renderings(&[("key", "be16")])).unwrap();
    assert_eq!(decode_layout(&port, &[0x01, 0xbb]), json!(443));
    let addr = rendered(&u(4), "key", &renderings(&[("key", "be32")])).unwrap();
    assert_eq!(decode_layout(&addr, &[10, 0, 0, 1]), json!(167772161));
    // bpftrace's comm keys: untyped bytes up to the first NUL.
    let untyped = MapLayout::untyped(MapShape::new(16, 8).with_cpus(Some(2)))
        .with_renderings(&renderings(&[("key", "string")]))
        .unwrap();
    let mut comm = [0u8; 16];
    comm[..4].copy_from_slice(b"bash");
    assert_eq!(decode_layout(untyped.key(), &comm), json!("bash"));
    assert_eq!(
        untyped
            .key()
            .encode(&from_json(&json!("bash")), "key")
            .unwrap(),
        comm
    );
    let e = untyped
        .key()
        .encode(&from_json(&json!("a-name-longer-than-16")), "key")
        .unwrap_err();
    assert!(e.to_string().contains("does not fit 16 bytes"), "{e}");
    // Renderings that do not fit say why.
    let e = rendered(&u(1), "key", &renderings(&[("key", "be16")])).unwrap_err();
    assert_eq!(
        e.to_string(),
        "key: be16 needs a member of at least 2 bytes; this one (an integer) has 1"
    );
    let e = rendered(&u(4), "key", &renderings(&[("key", "string")])).unwrap_err();
    assert_eq!(e.to_string(), "key: string cannot show an integer");
    let e = MapLayout::untyped(MapShape::new(16, 8))
        .with_renderings(&renderings(&[("key.comm", "string")]))
        .unwrap_err();
    assert_eq!(
        e.to_string(),
        "key.comm: the map has no types (BTF): its key is bytes"
    );
}

#[test]
fn renderings_that_cannot_work_name_the_member() {
    let t = record(
        "k",
        8,
        vec![
            member("a", 0, be("__be32", 4)),
            member("b", 4, u(2)),
            bits("c", 48, 4, u(2)),
        ],
    );
    let e = |pairs: &[(&str, &str)]| {
        rendered(&t, "key", &renderings(pairs))
            .unwrap_err()
            .to_string()
    };
    assert_eq!(
        e(&[("key.x", "ipv4")]),
        "key.x: no such member of struct k (members: a, b, c)"
    );
    assert_eq!(
        e(&[("key.b", "ipv4")]),
        "key.b: ipv4 needs a member of 4 bytes; this one (an integer) has 2"
    );
    assert_eq!(
        e(&[("key.c", "hex")]),
        "key.c: a bitfield cannot be rendered"
    );
    assert_eq!(
        e(&[("key.a.z", "hex")]),
        "key.a.z: key.a is __be32, which has no members"
    );
    let map: std::collections::BTreeMap<String, String> =
        [("key.a".to_owned(), "ipv5".to_owned())].into();
    assert_eq!(
        Renderings::parse(&map).unwrap_err().to_string(),
        "key.a: unknown rendering \"ipv5\"; use ipv4, ipv6, mac, hex, be16, be32 or string"
    );
    let map: std::collections::BTreeMap<String, String> =
        [("daddr".to_owned(), "ipv4".to_owned())].into();
    assert!(
        Renderings::parse(&map)
            .unwrap_err()
            .to_string()
            .contains("starts with \"key\"")
    );
    // A bad spelling in a JSON key names the member and the expected form.
    let l = rendered(&t, "key", &renderings(&[("key.a", "ipv4")])).unwrap();
    let err = l
        .encode(&from_json(&json!({"a": "10.0.0", "b": 1, "c": 1})), "key")
        .unwrap_err()
        .to_string();
    assert_eq!(
        err,
        "key.a: expected ipv4 like \"10.0.0.1\", got \"10.0.0\""
    );
}

/// `l`'s decoding of `bytes` through its plan (as text and as values)
/// equals the tree's: the JSON text.
fn planned_as_tree(l: &Layout, bytes: &[u8]) -> String {
    let mut planned = Vec::new();
    l.write_json(bytes, &mut planned);
    let mut tree = Vec::new();
    l.render_from_tree(bytes, &mut JsonWriter::new(&mut tree));
    let (planned, tree) = (
        String::from_utf8(planned).unwrap(),
        String::from_utf8(tree).unwrap(),
    );
    assert_eq!(planned, tree, "{l}");
    let mut value = ValueBuilder::default();
    l.render_from_tree(bytes, &mut value);
    assert_eq!(l.to_value(bytes), value.finish(), "{l}");
    planned
}

#[test]
fn compiled_plans_decode_renderings_enums_text_and_bitfields_as_the_tree() {
    let r = renderings(&[
        ("key.daddr", "ipv4"),
        ("key.saddr", "hex"),
        ("key.dport", "be16"),
    ]);
    let ct = rendered(&ct_tuple(), "key", &r).unwrap();
    assert_eq!(
        planned_as_tree(&ct, &ct_bytes()),
        r#"{"daddr":"10.0.0.1","saddr":"0xc0a80002","dport":443,"sport":51234,"nexthdr":6,"flags":0}"#
    );
    // A rendering replaced on a layout that decoded: its plan is made
    // again.
    let shape = MapShape::new(14, 1);
    let first = MapLayout::new(Some(&ct_tuple()), Some(&u(1)), shape)
        .unwrap()
        .with_renderings(&r)
        .unwrap();
    assert!(planned_as_tree(first.key(), &ct_bytes()).starts_with(r#"{"daddr":"10.0.0.1","#));
    let again = first
        .with_renderings(&renderings(&[("key.daddr", "hex")]))
        .unwrap();
    assert!(planned_as_tree(again.key(), &ct_bytes()).starts_with(r#"{"daddr":"0xa000001","#));
    let mixed = record(
        "mixed",
        24,
        vec![
            member("proto", 0, ip_proto()),
            bits("lo", 8, 3, s(4)),
            bits("hi", 11, 13, u(4)),
            bits("kind", 24, 4, ip_proto()),
            member("comm", 4, array(char_(), 4)),
            member("big", 8, s(8)),
            member("wide", 16, array(u(2), 4)),
        ],
    );
    let l = layout(&mixed);
    let mut bytes: Vec<u8> = (0..24u8).map(|i| i.wrapping_mul(37)).collect();
    planned_as_tree(&l, &bytes);
    bytes[0] = 6;
    bytes[4..8].copy_from_slice(b"ab\0\0");
    assert!(planned_as_tree(&l, &bytes).starts_with(r#"{"proto":"IPPROTO_TCP","#));
    let text = rendered(&mixed, "value", &renderings(&[("value.comm", "string")])).unwrap();
    bytes[4..8].copy_from_slice(b"\x1b[\xff\0");
    assert!(planned_as_tree(&text, &bytes).contains(r#""comm":"\\x1b[\\xff""#));
    // Too short: null, as the tree says.
    assert_eq!(planned_as_tree(&l, &bytes[..3]), "null");
}

/// The integers the JSON text writes in one step (unsigned bytes, 16, 32
/// and 64 bits, signed 32 bits, unsigned bitfields up to 32 bits, enums of
/// one unsigned byte, named or not) decode as the tree does, at the edges
/// of their ranges.
#[test]
fn json_text_of_common_integers_equals_the_tree() {
    let t = record(
        "common",
        32,
        vec![
            member("b", 0, u(1)),
            member("w", 2, u(2)),
            member("d", 4, u(4)),
            member("i", 8, s(4)),
            member("q", 16, u(8)),
            bits("one", 96, 1, u(4)),
            bits("mid", 97, 13, u(4)),
            bits("all", 128, 32, u(4)),
            member("e", 1, enum_("e", 1, false, &[("A", 0), ("B", 255)])),
        ],
    );
    let l = layout(&t);
    for bytes in [
        vec![0u8; 32],
        vec![0xff; 32],
        (0..32u8).map(|i| i.wrapping_mul(37)).collect(),
        (0..32u8).map(|i| 0x80 | i).collect(),
    ] {
        let text = planned_as_tree(&l, &bytes);
        serde_json::from_str::<serde_json::Value>(&text).expect("JSON");
    }
    let mut bytes = vec![0xff; 32];
    bytes[1] = 7;
    assert_eq!(
        planned_as_tree(&l, &bytes),
        r#"{"b":255,"w":65535,"d":4294967295,"i":-1,"q":"18446744073709551615","one":1,"mid":8191,"all":4294967295,"e":7}"#
    );
    bytes[1] = 255;
    assert!(planned_as_tree(&l, &bytes).ends_with(r#""e":"B"}"#));
}

#[test]
fn layouts_too_long_for_a_plan_decode_from_their_tree() {
    // 20,000 records of two members: more steps than a plan holds.
    let t = array(
        record("r", 2, vec![member("a", 0, u(1)), member("b", 1, s(1))]),
        20_000,
    );
    let l = layout(&t);
    let bytes: Vec<u8> = (0..40_000u32).map(|i| i as u8).collect();
    let text = planned_as_tree(&l, &bytes);
    assert!(
        text.starts_with(r#"[{"a":0,"b":1},{"a":2,"b":3},"#),
        "{}",
        &text[..40]
    );
    assert!(format!("{:?}", l).contains("decoded from its tree"));
}

#[cfg(feature = "arrow")]
mod arrow_tables {
    use arrow_array::{Array, cast::AsArray, types as t};
    use arrow_schema::DataType;

    use super::*;
    use crate::typed::arrow::{PerCpuColumns, TableInfo, TableLayout};

    /// A value of every kind a column takes.
    fn stats() -> TypeInfo {
        record(
            "stats",
            48,
            vec![
                member("packets", 0, u(8)),
                member("delta", 8, s(4)),
                bits("lo", 96, 4, u(4)),
                bits("hi", 100, 12, s(4)),
                member("proto", 14, ip_proto()),
                member("up", 15, ty("_Bool", 1, Kind::Bool(BoolType {}))),
                member("comm", 16, array(char_(), 8)),
                member("ports", 24, array(be("__be16", 2), 2)),
                member(
                    "",
                    28,
                    union(
                        "",
                        4,
                        vec![member("word", 0, u(4)), member("half", 0, u(2))],
                    ),
                ),
                member(
                    "pairs",
                    32,
                    array(
                        record("pair", 8, vec![member("a", 0, u(4)), member("b", 4, s(4))]),
                        2,
                    ),
                ),
            ],
        )
    }

    fn stats_bytes(i: u8) -> Vec<u8> {
        let mut v = vec![0u8; 48];
        v[..8].copy_from_slice(&(u64::MAX - u64::from(i)).to_le_bytes());
        v[8..12].copy_from_slice(&(-i32::from(i)).to_le_bytes());
        // lo = 5, hi = -3 (12 bits).
        let bits: u16 = 5 | ((-3i16 as u16 & 0x0fff) << 4);
        v[12..14].copy_from_slice(&bits.to_le_bytes());
        v[14] = if i.is_multiple_of(2) { 6 } else { 99 };
        v[15] = 1;
        v[16..24].copy_from_slice(b"bash\x1b\0\0\0");
        v[24..26].copy_from_slice(&443u16.to_be_bytes());
        v[26..28].copy_from_slice(&80u16.to_be_bytes());
        v[28..32].copy_from_slice(&0x0001_0002u32.to_le_bytes());
        for (j, x) in [(32, 7u32), (40, 9)] {
            v[j..j + 4].copy_from_slice(&x.to_le_bytes());
            v[j + 4..j + 8].copy_from_slice(&(-(x as i32)).to_le_bytes());
        }
        v
    }

    fn table(layout: &MapLayout, per_cpu: PerCpuColumns) -> TableLayout {
        let info = TableInfo {
            map: "m".into(),
            id: 7,
            map_type: "hash".into(),
        };
        TableLayout::new(layout, per_cpu, &info).unwrap()
    }

    #[test]
    fn typed_entries_become_columns_of_their_members() {
        let r = renderings(&[("key.daddr", "ipv4")]);
        let layout = MapLayout::new(Some(&ct_tuple()), Some(&stats()), MapShape::new(14, 48))
            .unwrap()
            .with_renderings(&r)
            .unwrap();
        let t = table(&layout, PerCpuColumns::List);
        let names: Vec<&str> = t
            .schema()
            .fields()
            .iter()
            .map(|f| f.name().as_str())
            .collect();
        assert_eq!(
            names,
            [
                "key.daddr",
                "key.saddr",
                "key.dport",
                "key.sport",
                "key.nexthdr",
                "key.flags",
                "value.packets",
                "value.delta",
                "value.lo",
                "value.hi",
                "value.proto",
                "value.up",
                "value.comm",
                "value.ports",
                "value.word",
                "value.half",
                "value.pairs",
            ]
        );
        let meta = t.schema().metadata();
        assert_eq!(meta["bpfmap.key_type"], "ipv4_ct_tuple");
        assert_eq!(meta["bpfmap.map_id"], "7");
        let mut b = t.builder();
        let key = ct_bytes();
        for i in 0..2 {
            let value = stats_bytes(i);
            b.push(EntryRef {
                key: &key,
                value: &value,
                stride: 0,
            });
        }
        let batch = b.finish().unwrap();
        assert_eq!(batch.num_rows(), 2);
        let col = |name: &str| batch.column_by_name(name).unwrap().clone();
        assert_eq!(col("key.daddr").as_string::<i32>().value(0), "10.0.0.1");
        assert_eq!(
            col("key.saddr").as_primitive::<t::UInt32Type>().value(0),
            0xc0a8_0002
        );
        assert_eq!(
            col("key.dport").as_primitive::<t::UInt16Type>().value(1),
            443
        );
        assert_eq!(
            col("value.packets")
                .as_primitive::<t::UInt64Type>()
                .value(1),
            u64::MAX - 1
        );
        assert_eq!(
            col("value.delta").as_primitive::<t::Int32Type>().value(1),
            -1
        );
        assert_eq!(col("value.lo").as_primitive::<t::UInt32Type>().value(0), 5);
        assert_eq!(col("value.hi").as_primitive::<t::Int32Type>().value(0), -3);
        let proto = col("value.proto");
        let proto = proto.as_dictionary::<t::Int32Type>();
        let names = proto.values().as_string::<i32>();
        let name = |i: usize| names.value(proto.keys().value(i) as usize).to_owned();
        assert_eq!(
            (name(0), name(1)),
            ("IPPROTO_TCP".to_owned(), "99".to_owned())
        );
        assert!(col("value.up").as_boolean().value(0));
        assert_eq!(col("value.comm").as_string::<i32>().value(0), "bash\\x1b");
        let ports = col("value.ports");
        let ports = ports.as_fixed_size_list();
        let first = ports.value(0);
        assert_eq!(first.as_primitive::<t::UInt16Type>().values(), &[443, 80]);
        assert_eq!(
            col("value.word").as_primitive::<t::UInt32Type>().value(0),
            0x0001_0002
        );
        assert_eq!(
            col("value.half").as_primitive::<t::UInt16Type>().value(0),
            2
        );
        let pairs = col("value.pairs");
        let pair = pairs.as_fixed_size_list().value(1);
        let pair = pair.as_struct();
        assert_eq!(
            pair.column(0).as_primitive::<t::UInt32Type>().values(),
            &[7, 9]
        );
        assert_eq!(
            pair.column(1).as_primitive::<t::Int32Type>().values(),
            &[-7, -9]
        );
    }

    #[test]
    fn per_cpu_values_are_lists_or_sums_and_bytes_stay_bytes() {
        let value = record("v", 16, vec![member("n", 0, u(8)), member("m", 8, u(4))]);
        let layout = MapLayout::new(
            Some(&u(4)),
            Some(&value),
            MapShape::new(4, 16).with_cpus(Some(2)),
        )
        .unwrap();
        let mut values = Vec::new();
        for (n, m) in [(u64::MAX, 1u32), (5, 2)] {
            values.extend_from_slice(&n.to_le_bytes());
            values.extend_from_slice(&m.to_le_bytes());
            values.extend_from_slice(&[0; 4]);
        }
        let entry = EntryRef {
            key: &3u32.to_le_bytes(),
            value: &values,
            stride: 16,
        };
        let lists = table(&layout, PerCpuColumns::List);
        let mut b = lists.builder();
        b.push(entry);
        let batch = b.finish().unwrap();
        assert_eq!(batch.schema().field(1).name(), "values.n");
        let n = batch.column(1).as_fixed_size_list().value(0);
        assert_eq!(n.as_primitive::<t::UInt64Type>().values(), &[u64::MAX, 5]);
        let sums = table(&layout, PerCpuColumns::Sum);
        let mut b = sums.builder();
        b.push(entry);
        let batch = b.finish().unwrap();
        assert_eq!(batch.schema().field(1).name(), "value.n");
        assert_eq!(
            batch.schema().field(1).data_type(),
            &DataType::Decimal128(38, 0)
        );
        let n = batch.column(1).as_primitive::<t::Decimal128Type>();
        assert_eq!(n.value(0), i128::from(u64::MAX) + 5);
        assert_eq!(batch.column(2).as_primitive::<t::Int64Type>().value(0), 3);
        // A map without types: its bytes.
        let untyped = MapLayout::untyped(MapShape::new(4, 3));
        let t = table(&untyped, PerCpuColumns::List);
        let mut b = t.builder();
        b.push(EntryRef {
            key: &[1, 2, 3, 4],
            value: &[5, 6, 7],
            stride: 0,
        });
        let batch = b.finish().unwrap();
        assert_eq!(batch.column(1).as_fixed_size_binary().value(0), &[5, 6, 7]);
        assert_eq!(batch.column(0).len(), 1);
    }

    /// `entries` appended one by one and as packed records: the same batch.
    fn both_ways(
        t: &TableLayout,
        keys: &[u8],
        key_size: usize,
        values: &[u8],
        stride: usize,
        cpus: usize,
    ) {
        let count = keys.len() / key_size;
        let mut one_by_one = t.builder();
        for i in 0..count {
            one_by_one.push(EntryRef {
                key: &keys[i * key_size..(i + 1) * key_size],
                value: &values[i * stride..(i + 1) * stride],
                stride: stride / cpus.max(1) * usize::from(cpus > 0),
            });
        }
        let mut packed = t.builder();
        packed.push_packed(crate::typed::arrow::Packed {
            keys,
            key_size,
            values,
            value_stride: stride,
            cpu_stride: stride / cpus.max(1) * usize::from(cpus > 0),
            count,
        });
        let (a, b) = (one_by_one.finish().unwrap(), packed.finish().unwrap());
        assert_eq!(a.num_rows(), count);
        assert_eq!(a, b);
    }

    /// Enum columns (of one byte, of a bitfield, signed, of 64 bits past
    /// i64::MAX), with values named and not, over two batches of one
    /// builder, entry by entry and from packed records: the dictionaries
    /// arrow's own builder makes, keys and values in the same order.
    #[test]
    fn enum_columns_are_the_dictionaries_arrows_builder_makes() {
        use arrow_array::{builder::StringDictionaryBuilder, cast::AsArray};
        let byte = enum_("e8", 1, false, &[("A", 1), ("B", 2)]);
        let wide = enum_("e32", 4, true, &[("NEG", -5), ("POS", 5)]);
        let big = enum_("e64", 8, false, &[("BIG", i64::MAX)]);
        let value = record(
            "v",
            16,
            vec![
                member("b", 0, byte.clone()),
                bits("f", 12, 4, byte.clone()),
                member("s", 4, wide),
                member("q", 8, big),
            ],
        );
        let layout = MapLayout::new(Some(&u(4)), Some(&value), MapShape::new(4, 16)).unwrap();
        let t = table(&layout, PerCpuColumns::List);
        let rows: [(u8, u8, i32, u64); 9] = [
            (2, 1, -5, 0),
            (1, 2, 7, u64::MAX),
            (2, 9, 5, i64::MAX as u64),
            (200, 1, -5, u64::MAX),
            (1, 0, 7, 3),
            (2, 15, 5, 0),
            (9, 2, 5, 3),
            (1, 1, -1, u64::MAX),
            (9, 9, -5, 0),
        ];
        let bytes = |(b, f, s, q): (u8, u8, i32, u64)| {
            let mut v = vec![b, f << 4, 0, 0];
            v.extend_from_slice(&s.to_le_bytes());
            v.extend_from_slice(&q.to_le_bytes());
            v
        };
        // What arrow's builder makes of a column's values.
        let expected = |values: &mut dyn Iterator<Item = (i128, Option<&str>)>| {
            let mut d = StringDictionaryBuilder::<t::Int32Type>::new();
            for (v, name) in values {
                d.append_value(name.map_or_else(|| v.to_string(), str::to_owned));
            }
            d.finish()
        };
        let name = |v: i128, names: &[(&'static str, i128)]| {
            names.iter().find(|(_, n)| *n == v).map(|(s, _)| *s)
        };
        let ab = [("A", 1), ("B", 2)];
        for packed in [false, true] {
            let mut b = t.builder();
            for batch in [&rows[..6], &rows[6..]] {
                let keys = vec![0u8; 4 * batch.len()];
                let values: Vec<u8> = batch.iter().flat_map(|r| bytes(*r)).collect();
                if packed {
                    b.push_packed(crate::typed::arrow::Packed {
                        keys: &keys,
                        key_size: 4,
                        values: &values,
                        value_stride: 16,
                        cpu_stride: 0,
                        count: batch.len(),
                    });
                } else {
                    for v in values.chunks(16) {
                        b.push(EntryRef {
                            key: &[0; 4],
                            value: v,
                            stride: 0,
                        });
                    }
                }
                let got = b.finish().unwrap();
                let column = |c: &str| {
                    got.column_by_name(c)
                        .unwrap()
                        .as_dictionary::<t::Int32Type>()
                        .clone()
                };
                let want = [
                    (
                        "value.b",
                        expected(
                            &mut batch
                                .iter()
                                .map(|r| (i128::from(r.0), name(i128::from(r.0), &ab))),
                        ),
                    ),
                    (
                        "value.f",
                        expected(
                            &mut batch
                                .iter()
                                .map(|r| (i128::from(r.1), name(i128::from(r.1), &ab))),
                        ),
                    ),
                    (
                        "value.s",
                        expected(&mut batch.iter().map(|r| {
                            (
                                i128::from(r.2),
                                name(i128::from(r.2), &[("NEG", -5), ("POS", 5)]),
                            )
                        })),
                    ),
                    (
                        "value.q",
                        expected(&mut batch.iter().map(|r| {
                            (
                                i128::from(r.3),
                                name(i128::from(r.3), &[("BIG", i128::from(i64::MAX))]),
                            )
                        })),
                    ),
                ];
                for (c, want) in want {
                    let got = column(c);
                    assert_eq!(got.keys(), want.keys(), "{c}, packed: {packed}");
                    assert_eq!(
                        got.values().as_string::<i32>(),
                        want.values().as_string::<i32>(),
                        "{c}, packed: {packed}"
                    );
                }
            }
        }
    }

    #[test]
    fn packed_records_make_the_batch_entries_make() {
        let r = renderings(&[("key.daddr", "ipv4")]);
        let layout = MapLayout::new(Some(&ct_tuple()), Some(&stats()), MapShape::new(14, 48))
            .unwrap()
            .with_renderings(&r)
            .unwrap();
        let (mut keys, mut values) = (Vec::new(), Vec::new());
        for i in 0..20u8 {
            let mut key = ct_bytes();
            key[4] = i;
            keys.extend_from_slice(&key);
            let mut value = stats_bytes(i);
            value[16..24].copy_from_slice(if i % 3 == 0 {
                b"a\\b\0\0\0\0\0"
            } else {
                b"sshd\0\0\0\0"
            });
            values.extend_from_slice(&value);
        }
        for per_cpu in [PerCpuColumns::List, PerCpuColumns::Sum] {
            both_ways(&table(&layout, per_cpu), &keys, 14, &values, 48, 0);
        }
        // Per-CPU values, listed and summed; a projection's two records.
        let value = record(
            "v",
            16,
            vec![
                member("n", 0, u(8)),
                member("m", 8, s(2)),
                member("b", 10, be("__be16", 2)),
            ],
        );
        let layout = MapLayout::new(
            Some(&u(4)),
            Some(&value),
            MapShape::new(4, 16).with_cpus(Some(2)),
        )
        .unwrap();
        let keys: Vec<u8> = (0..9u32).flat_map(u32::to_le_bytes).collect();
        let values: Vec<u8> = (0..9 * 32).map(|i| (i * 37 % 251) as u8).collect();
        for per_cpu in [PerCpuColumns::List, PerCpuColumns::Sum] {
            both_ways(&table(&layout, per_cpu), &keys, 4, &values, 32, 2);
        }
        let untyped = MapLayout::untyped(MapShape::new(4, 3));
        let values: Vec<u8> = (0..27).collect();
        both_ways(
            &table(&untyped, PerCpuColumns::List),
            &keys,
            4,
            &values,
            3,
            0,
        );
    }
}
