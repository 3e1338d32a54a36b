//! Connection maps with BTF, of the shape the scan benchmarks and tests
//! use: key `struct conn_key { __u32 saddr; __u16 dport; enum proto
//! proto; __u8 pad; }` (8 bytes, a 1-byte enum), value `struct conn_stats
//! { __u64 packets, bytes; char comm[8]; __s32 delta; __u32 lo:4, hi:12;
//! }` (32 bytes), as hash, LRU hash, array or their per-CPU kinds.

use bpfmap_kernel::{BtfBuilder, BtfMember, CreateMap, IntEncoding, OwnedBtf};

use crate::{MapType, OwnedMap, create_map_with, update_batch};

/// Bytes of a key and of one value.
pub const KEY_SIZE: u32 = 8;
pub const VALUE_SIZE: u32 = 32;

/// `enum proto`'s values, in the order the benchmark's connections cycle through them.
pub const PROTOS: [(&str, u8); 3] = [("TCP", 6), ("UDP", 17), ("ICMP", 1)];

/// One entry's members, as [`Conn::bytes`] lays them out.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Conn {
    pub saddr: u32,
    pub dport: u16,
    pub proto: u8,
    pub packets: u64,
    pub bytes: u64,
    pub comm: [u8; 8],
    pub delta: i32,
    /// 4 bits.
    pub lo: u32,
    /// 12 bits.
    pub hi: u32,
}

impl Conn {
    /// The key's bytes.
    pub fn key(&self) -> [u8; 8] {
        let mut k = [0u8; 8];
        k[..4].copy_from_slice(&self.saddr.to_ne_bytes());
        k[4..6].copy_from_slice(&self.dport.to_ne_bytes());
        k[6] = self.proto;
        k
    }

    /// The value's bytes.
    pub fn value(&self) -> [u8; 32] {
        let mut v = [0u8; 32];
        v[..8].copy_from_slice(&self.packets.to_ne_bytes());
        v[8..16].copy_from_slice(&self.bytes.to_ne_bytes());
        v[16..24].copy_from_slice(&self.comm);
        v[24..28].copy_from_slice(&self.delta.to_ne_bytes());
        let bits = (self.lo & 0xf) | ((self.hi & 0xfff) << 4);
        v[28..32].copy_from_slice(&bits.to_ne_bytes());
        v
    }
}

/// The BTF of the two types, loaded, and their ids.
struct Types {
    btf: OwnedBtf,
    key: u32,
    value: u32,
}

fn types() -> Types {
    let mut b = BtfBuilder::new();
    let u8_ = b.add_int("unsigned char", 1, IntEncoding::Unsigned);
    let u16_ = b.add_int("unsigned short", 2, IntEncoding::Unsigned);
    let u32_ = b.add_int("unsigned int", 4, IntEncoding::Unsigned);
    let u64_ = b.add_int("unsigned long long", 8, IntEncoding::Unsigned);
    let s32 = b.add_int("int", 4, IntEncoding::Signed);
    let char_ = b.add_int("char", 1, IntEncoding::Signed);
    let comm = b.add_array(char_, 8);
    let (u8_t, u16_t, u32_t, u64_t) = (
        b.add_typedef("__u8", u8_),
        b.add_typedef("__u16", u16_),
        b.add_typedef("__u32", u32_),
        b.add_typedef("__u64", u64_),
    );
    let s32_t = b.add_typedef("__s32", s32);
    let protos: Vec<(&str, i64)> = PROTOS.iter().map(|(n, v)| (*n, i64::from(*v))).collect();
    let proto = b.add_enum("proto", 1, false, &protos);
    let key = b.add_struct(
        "conn_key",
        KEY_SIZE,
        &[
            BtfMember::new("saddr", u32_t, 0),
            BtfMember::new("dport", u16_t, 32),
            BtfMember::new("proto", proto, 48),
            BtfMember::new("pad", u8_t, 56),
        ],
    );
    let value = b.add_struct(
        "conn_stats",
        VALUE_SIZE,
        &[
            BtfMember::new("packets", u64_t, 0),
            BtfMember::new("bytes", u64_t, 64),
            BtfMember::new("comm", comm, 128),
            BtfMember::new("delta", s32_t, 192),
            BtfMember::bitfield("lo", u32_t, 224, 4),
            BtfMember::bitfield("hi", u32_t, 228, 12),
        ],
    );
    let btf = OwnedBtf::load(&b.to_bytes())
        .unwrap_or_else(|e| panic!("cannot load the conns' BTF ({e}); these need root and BPF"));
    Types { btf, key, value }
}

/// An empty connection map of `map_type` holding at most `max_entries`.
pub fn map(map_type: MapType, max_entries: u32) -> OwnedMap {
    let t = types();
    create_map_with(&CreateMap {
        map_type: map_type.0,
        key_size: if matches!(map_type, MapType::ARRAY | MapType::PERCPU_ARRAY) {
            4
        } else {
            KEY_SIZE
        },
        value_size: VALUE_SIZE,
        max_entries,
        name: "conns",
        btf: Some(t.btf.for_map(t.key, t.value)),
        ..Default::default()
    })
}

/// Writes entries `0..n` of `map` (a hash of conn keys): entry `i` holds
/// `conn(i, cpu)` on each CPU (once for a map that is not per-CPU).
pub fn fill(map: &OwnedMap, n: u32, conn: impl Fn(u32, u32) -> Conn) {
    let meta = map.meta();
    let cpus = if meta.per_cpu() {
        meta.possible_cpus
    } else {
        1
    };
    let stride = meta.cpu_stride();
    let (mut keys, mut values) = (Vec::new(), Vec::new());
    for i in 0..n {
        keys.extend_from_slice(&conn(i, 0).key());
        for cpu in 0..cpus {
            let start = values.len();
            values.extend_from_slice(&conn(i, cpu).value());
            values.resize(start + stride, 0);
        }
    }
    const BATCH: usize = 1 << 16;
    let ks = KEY_SIZE as usize;
    let vs = values.len() / (n.max(1) as usize);
    for (k, v) in keys.chunks(BATCH * ks).zip(values.chunks(BATCH * vs)) {
        update_batch(map, k, v);
    }
}
