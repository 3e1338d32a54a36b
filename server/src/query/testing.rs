//! Types built by hand for the queries' unit tests: a flow key like the
//! demo's, and a value with a member of every kind a filter reads.

use bpfmap_proto::v1::{
    ArrayType, BoolType, CharType, EnumType, Enumerator, IntType, Member, RecordType, TypeInfo,
    type_info::Kind,
};

use super::{MapLayout, MapShape};

pub(crate) fn int(name: &str, size: u32, signed: bool) -> TypeInfo {
    TypeInfo {
        name: name.into(),
        size,
        kind: Some(Kind::Int(IntType {
            signed,
            big_endian: false,
        })),
    }
}

pub(crate) fn be(name: &str, size: u32) -> TypeInfo {
    TypeInfo {
        name: name.into(),
        size,
        kind: Some(Kind::Int(IntType {
            signed: false,
            big_endian: true,
        })),
    }
}

pub(crate) fn member(name: &str, bit_offset: u32, t: TypeInfo) -> Member {
    Member {
        name: name.into(),
        bit_offset,
        bitfield_size: 0,
        r#type: Some(t),
    }
}

pub(crate) fn bits(name: &str, bit_offset: u32, width: u32, t: TypeInfo) -> Member {
    Member {
        bitfield_size: width,
        ..member(name, bit_offset, t)
    }
}

pub(crate) fn record(name: &str, size: u32, members: Vec<Member>) -> TypeInfo {
    TypeInfo {
        name: name.into(),
        size,
        kind: Some(Kind::Struct(RecordType { members })),
    }
}

pub(crate) fn union(size: u32, members: Vec<Member>) -> TypeInfo {
    TypeInfo {
        name: String::new(),
        size,
        kind: Some(Kind::Union(RecordType { members })),
    }
}

pub(crate) fn array(elem: TypeInfo, length: u32) -> TypeInfo {
    TypeInfo {
        name: String::new(),
        size: elem.size * length,
        kind: Some(Kind::Array(Box::new(ArrayType {
            element: Some(Box::new(elem)),
            length,
        }))),
    }
}

pub(crate) fn chars(length: u32) -> TypeInfo {
    let c = TypeInfo {
        name: "char".into(),
        size: 1,
        kind: Some(Kind::Char(CharType { signed: true })),
    };
    array(c, length)
}

pub(crate) fn ip_proto() -> TypeInfo {
    let e = |name: &str, value| Enumerator {
        name: name.into(),
        value,
    };
    TypeInfo {
        name: "ip_proto".into(),
        size: 1,
        kind: Some(Kind::Enum(EnumType {
            signed: false,
            enumerators: vec![
                e("IPPROTO_ICMP", 1),
                e("IPPROTO_TCP", 6),
                e("IPPROTO_UDP", 17),
            ],
        })),
    }
}

/// `struct flow_key { __u32 saddr; __u32 daddr; __u16 sport; __u16 dport;
/// enum ip_proto proto; }` (16 bytes), as the demo's.
pub(crate) fn flow_key() -> TypeInfo {
    record(
        "flow_key",
        16,
        vec![
            member("saddr", 0, int("__u32", 4, false)),
            member("daddr", 32, int("__u32", 4, false)),
            member("sport", 64, int("__u16", 2, false)),
            member("dport", 80, int("__u16", 2, false)),
            member("proto", 96, ip_proto()),
        ],
    )
}

/// `struct flow_stats { __u64 packets; __u64 bytes; }`.
pub(crate) fn flow_stats() -> TypeInfo {
    record(
        "flow_stats",
        16,
        vec![
            member("packets", 0, int("__u64", 8, false)),
            member("bytes", 64, int("__u64", 8, false)),
        ],
    )
}

/// Byte offsets of [`everything`]'s members.
pub(crate) mod at {
    pub(crate) const U8: usize = 0;
    pub(crate) const S8: usize = 1;
    pub(crate) const U16: usize = 2;
    pub(crate) const S16: usize = 4;
    pub(crate) const U32: usize = 8;
    pub(crate) const S32: usize = 12;
    pub(crate) const U64: usize = 16;
    pub(crate) const S64: usize = 24;
    pub(crate) const PORT: usize = 32;
    pub(crate) const ADDR: usize = 36;
    /// flags:3 at bit 0, level:5 (signed) at bit 3 of this byte.
    pub(crate) const BITS: usize = 40;
    pub(crate) const PROTO: usize = 42;
    pub(crate) const OK: usize = 43;
    pub(crate) const COMM: usize = 44;
    pub(crate) const INNER: usize = 60;
    pub(crate) const COUNTERS: usize = 68;
    pub(crate) const ANON: usize = 84;
    pub(crate) const U128: usize = 88;
    pub(crate) const SIZE: usize = 104;
}

/// `struct everything`: every kind of member a filter reads.
pub(crate) fn everything() -> TypeInfo {
    let b = |byte: usize| (byte * 8) as u32;
    let inner = record(
        "inner",
        8,
        vec![
            member("x", 0, int("__u32", 4, false)),
            member("y", 32, int("__s32", 4, true)),
        ],
    );
    let anon = union(
        4,
        vec![
            member("anon_a", 0, int("__u32", 4, false)),
            member("anon_b", 0, int("__u16", 2, false)),
        ],
    );
    let bool_t = TypeInfo {
        name: "_Bool".into(),
        size: 1,
        kind: Some(Kind::Bool(BoolType {})),
    };
    record(
        "everything",
        at::SIZE as u32,
        vec![
            member("u8", b(at::U8), int("__u8", 1, false)),
            member("s8", b(at::S8), int("__s8", 1, true)),
            member("u16", b(at::U16), int("__u16", 2, false)),
            member("s16", b(at::S16), int("__s16", 2, true)),
            member("u32", b(at::U32), int("__u32", 4, false)),
            member("s32", b(at::S32), int("__s32", 4, true)),
            member("u64", b(at::U64), int("__u64", 8, false)),
            member("s64", b(at::S64), int("__s64", 8, true)),
            member("port", b(at::PORT), be("__be16", 2)),
            member("addr", b(at::ADDR), be("__be32", 4)),
            bits("flags", b(at::BITS), 3, int("__u8", 1, false)),
            bits("level", b(at::BITS) + 3, 5, int("__s8", 1, true)),
            member("proto", b(at::PROTO), ip_proto()),
            member("ok", b(at::OK), bool_t),
            member("comm", b(at::COMM), chars(16)),
            member("inner", b(at::INNER), inner),
            member(
                "counters",
                b(at::COUNTERS),
                array(int("__u32", 4, false), 4),
            ),
            member("", b(at::ANON), anon),
            member("u128", b(at::U128), int("__u128", 16, false)),
        ],
    )
}

/// The layout of a map of `key` to `value` (per-CPU with `cpus`).
pub(crate) fn layout(key: &TypeInfo, value: &TypeInfo, cpus: Option<usize>) -> MapLayout {
    let shape = MapShape::new(key.size as usize, value.size as usize).with_cpus(cpus);
    MapLayout::new(Some(key), Some(value), shape).expect("a valid layout")
}

/// The bytes of a flow key.
pub(crate) fn flow(saddr: u32, daddr: u32, sport: u16, dport: u16, proto: u8) -> Vec<u8> {
    let mut k = Vec::new();
    k.extend_from_slice(&saddr.to_le_bytes());
    k.extend_from_slice(&daddr.to_le_bytes());
    k.extend_from_slice(&sport.to_le_bytes());
    k.extend_from_slice(&dport.to_le_bytes());
    k.extend_from_slice(&[proto, 0, 0, 0]);
    k
}

/// The bytes of a flow's stats.
pub(crate) fn stats(packets: u64, bytes: u64) -> Vec<u8> {
    let mut v = packets.to_le_bytes().to_vec();
    v.extend_from_slice(&bytes.to_le_bytes());
    v
}

/// Writes `bytes` at `offset` of `buf`.
pub(crate) fn put(buf: &mut [u8], offset: usize, bytes: &[u8]) {
    buf[offset..offset + bytes.len()].copy_from_slice(bytes);
}
