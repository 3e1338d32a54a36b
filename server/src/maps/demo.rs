//! Demo maps, so that a newcomer sees real data at once. They carry BTF, so
//! their entries read as JSON with named members:
//!
//! - `demo/flows`: hash, 100,000 flows. Key `struct flow_key { __u32 saddr;
//!   __u32 daddr; __u16 sport; __u16 dport; enum ip_proto proto; }` (16
//!   bytes: a 1-byte enum, 3 bytes of padding; addresses and ports are
//!   integers in host byte order), value `struct flow_stats { __u64 packets;
//!   __u64 bytes; }`;
//! - `demo/cpu_counters`: per-CPU array, `__u32` -> `struct cpu_counters`
//!   (8 `__u64` counters, [`CPU_COUNTERS`]), 8 entries that a background
//!   thread keeps incrementing;
//! - `demo/recent`: LRU hash (`__u32` -> `__u64`, 1024 slots) that the
//!   background thread keeps inserting into, so old entries are evicted;
//! - `demo/events`: a queue, untyped, which cannot be iterated (DumpMap
//!   answers FAILED_PRECONDITION).
//!
//! The pins are removed when the demo is dropped.

use std::{
    path::{Path, PathBuf},
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    thread,
    time::Duration,
};

use anyhow::Context as _;

use bpfmap_kernel::{
    BtfBuilder, BtfMember, CreateMap, IntEncoding, MapBtf, MapType, OwnedBtf, OwnedMap,
    possible_cpus,
};

pub(super) const FLOWS: usize = 100_000;

/// `enum ip_proto` values used by `demo/flows`.
const IPPROTO_TCP: u8 = 6;
const IPPROTO_UDP: u8 = 17;

/// Members of `struct cpu_counters`, the value of `demo/cpu_counters`.
pub(super) const CPU_COUNTERS: [&str; 8] = [
    "rx_packets",
    "rx_bytes",
    "tx_packets",
    "tx_bytes",
    "rx_dropped",
    "tx_dropped",
    "rx_errors",
    "tx_errors",
];

/// Entries of `demo/cpu_counters`.
const COUNTER_SETS: u32 = 8;

/// The flow key of `demo/flows` entry `i`, fields in host byte order:
/// saddr 10.0.0.0 + i (`0x0A00_0000 | i`), daddr 192.168.0.(i % 250 + 1)
/// (`0xC0A8_0000 | (i % 250 + 1)`), sport 1024 + i % 60000, dport 443, proto
/// UDP (17) when i % 4 == 3, else TCP (6); then 3 bytes of zero padding.
pub fn flow_key(i: u32) -> [u8; 16] {
    let mut k = [0u8; 16];
    k[0..4].copy_from_slice(&(0x0A00_0000 | i).to_ne_bytes());
    k[4..8].copy_from_slice(&(0xC0A8_0000 | (i % 250 + 1)).to_ne_bytes());
    k[8..10].copy_from_slice(&(1024 + (i % 60_000) as u16).to_ne_bytes());
    k[10..12].copy_from_slice(&443u16.to_ne_bytes());
    k[12] = if i % 4 == 3 { IPPROTO_UDP } else { IPPROTO_TCP };
    k
}

/// The value of `demo/flows` entry `i`: packets i + 1 and bytes
/// (i + 1) * 1500, u64 in host byte order.
pub fn flow_value(i: u32) -> [u8; 16] {
    let mut v = [0u8; 16];
    v[0..8].copy_from_slice(&u64::from(i + 1).to_ne_bytes());
    v[8..16].copy_from_slice(&(u64::from(i + 1) * 1500).to_ne_bytes());
    v
}

/// The demo maps' BTF, loaded, and the ids of the types they use.
struct DemoTypes {
    btf: OwnedBtf,
    u32_t: u32,
    u64_t: u32,
    flow_key: u32,
    flow_stats: u32,
    cpu_counters: u32,
}

impl DemoTypes {
    fn load() -> anyhow::Result<Self> {
        let mut b = BtfBuilder::new();
        let u16_ = b.add_int("unsigned short", 2, IntEncoding::Unsigned);
        let u32_ = b.add_int("unsigned int", 4, IntEncoding::Unsigned);
        let u64_ = b.add_int("unsigned long long", 8, IntEncoding::Unsigned);
        let u16_t = b.add_typedef("__u16", u16_);
        let u32_t = b.add_typedef("__u32", u32_);
        let u64_t = b.add_typedef("__u64", u64_);
        let ip_proto = b.add_enum(
            "ip_proto",
            1,
            false,
            &[
                ("IPPROTO_ICMP", 1),
                ("IPPROTO_TCP", IPPROTO_TCP.into()),
                ("IPPROTO_UDP", IPPROTO_UDP.into()),
            ],
        );
        let flow_key = b.add_struct(
            "flow_key",
            16,
            &[
                BtfMember::new("saddr", u32_t, 0),
                BtfMember::new("daddr", u32_t, 32),
                BtfMember::new("sport", u16_t, 64),
                BtfMember::new("dport", u16_t, 80),
                BtfMember::new("proto", ip_proto, 96),
            ],
        );
        let flow_stats = b.add_struct(
            "flow_stats",
            16,
            &[
                BtfMember::new("packets", u64_t, 0),
                BtfMember::new("bytes", u64_t, 64),
            ],
        );
        let counters: Vec<BtfMember<'_>> = CPU_COUNTERS
            .iter()
            .zip(0..)
            .map(|(name, i)| BtfMember::new(name, u64_t, 64 * i))
            .collect();
        let cpu_counters = b.add_struct("cpu_counters", 64, &counters);
        let btf = OwnedBtf::load(&b.to_bytes()).context("cannot load the demo maps' BTF")?;
        Ok(Self {
            btf,
            u32_t,
            u64_t,
            flow_key,
            flow_stats,
            cpu_counters,
        })
    }
}

/// The running demo: its pins and the thread that keeps them changing.
#[derive(Debug)]
pub struct Demo {
    dir: PathBuf,
    pins: Vec<PathBuf>,
    stop: Arc<AtomicBool>,
    writer: Option<thread::JoinHandle<()>>,
}

fn create(
    map_type: MapType,
    (key_size, value_size): (u32, u32),
    max_entries: u32,
    name: &str,
    btf: Option<MapBtf<'_>>,
) -> anyhow::Result<OwnedMap> {
    OwnedMap::create(&CreateMap {
        map_type: map_type.0,
        key_size,
        value_size,
        max_entries,
        name,
        btf,
        ..Default::default()
    })
    .with_context(|| format!("cannot create demo map {name}"))
}

fn fill_flows(flows: OwnedMap, n: u32) -> anyhow::Result<OwnedMap> {
    let (mut keys, mut values) = (Vec::new(), Vec::new());
    for i in 0..n {
        keys.extend_from_slice(&flow_key(i));
        values.extend_from_slice(&flow_value(i));
    }
    for (k, v) in keys.chunks(16 << 16).zip(values.chunks(16 << 16)) {
        flows.update_batch(k, v).context("cannot fill the flows")?;
    }
    Ok(flows)
}

/// A hash map like `demo/flows` (the same types, `flow_key(i)` to
/// `flow_value(i)`) of `n` flows, not pinned: for benchmarks.
pub fn typed_flows(n: u32) -> anyhow::Result<OwnedMap> {
    let types = DemoTypes::load()?;
    let map = create(
        MapType::HASH,
        (16, 16),
        n.max(1),
        "flows",
        Some(types.btf.for_map(types.flow_key, types.flow_stats)),
    )?;
    fill_flows(map, n)
}

impl Demo {
    /// Creates the demo maps under `root/demo`, replacing old demo pins.
    pub fn start(root: &Path) -> anyhow::Result<Self> {
        let dir = root.join("demo");
        std::fs::create_dir_all(&dir)
            .with_context(|| format!("cannot create {}", dir.display()))?;
        let mut demo = Self {
            dir: dir.clone(),
            pins: Vec::new(),
            stop: Arc::new(AtomicBool::new(false)),
            writer: None,
        };
        let types = DemoTypes::load()?;
        let typed = |key, value| Some(types.btf.for_map(key, value));

        let flows = fill_flows(
            create(
                MapType::HASH,
                (16, 16),
                131_072,
                "flows",
                typed(types.flow_key, types.flow_stats),
            )?,
            FLOWS as u32,
        )?;
        demo.pin(&flows, "flows")?;

        let counters = create(
            MapType::PERCPU_ARRAY,
            (4, 64),
            COUNTER_SETS,
            "cpu_counters",
            typed(types.u32_t, types.cpu_counters),
        )?;
        demo.pin(&counters, "cpu_counters")?;
        let recent = create(
            MapType::LRU_HASH,
            (4, 8),
            1024,
            "recent",
            typed(types.u32_t, types.u64_t),
        )?;
        demo.pin(&recent, "recent")?;
        let events = create(MapType::QUEUE, (0, 8), 64, "events", None)?;
        demo.pin(&events, "events")?;

        let stop = demo.stop.clone();
        demo.writer = Some(
            thread::Builder::new()
                .name("demo-writer".into())
                .spawn(move || write_loop(&counters, &recent, &stop))?,
        );
        tracing::info!(dir = %dir.display(), "demo maps pinned: flows, cpu_counters, recent, events");
        Ok(demo)
    }

    fn pin(&mut self, map: &OwnedMap, name: &str) -> anyhow::Result<()> {
        let path = self.dir.join(name);
        let _ = std::fs::remove_file(&path);
        map.pin(&path)
            .with_context(|| format!("cannot pin {}", path.display()))?;
        self.pins.push(path);
        Ok(())
    }
}

/// One `struct cpu_counters` per possible CPU, in the kernel's per-CPU
/// layout: counter j of entry `set` on CPU c is tick * (set + 1) * (j + 1) + c.
fn counter_values(tick: u64, set: u32, cpus: usize) -> Vec<u8> {
    let mut value = Vec::with_capacity(64 * cpus);
    for cpu in 0..cpus as u64 {
        for j in 0..CPU_COUNTERS.len() as u64 {
            let v = tick * u64::from(set + 1) * (j + 1) + cpu;
            value.extend_from_slice(&v.to_ne_bytes());
        }
    }
    value
}

fn write_loop(counters: &OwnedMap, recent: &OwnedMap, stop: &AtomicBool) {
    let cpus = possible_cpus() as usize;
    let mut tick: u64 = 0;
    while !stop.load(Ordering::Relaxed) {
        tick += 1;
        for set in 0..COUNTER_SETS {
            if let Err(e) = counters.update(&set.to_ne_bytes(), &counter_values(tick, set, cpus)) {
                tracing::warn!(error = %e, "demo writer stopped");
                return;
            }
        }
        let key = (tick as u32).to_ne_bytes();
        let _ = recent.update(&key, &tick.to_ne_bytes());
        thread::sleep(Duration::from_millis(100));
    }
}

impl Drop for Demo {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(w) = self.writer.take() {
            let _ = w.join();
        }
        for p in &self.pins {
            let _ = std::fs::remove_file(p);
        }
        let _ = std::fs::remove_dir(&self.dir);
    }
}

#[cfg(test)]
mod tests {
    use bpfmap_proto::v1::{
        EnumType, Enumerator, IntType, Member, RecordType, TypeInfo, type_info::Kind,
    };

    use bpfmap_kernel::{self as kernel, MapHandle};

    use super::*;
    use crate::maps::{KnownTypes, TypeCache};

    fn uint(name: &str, size: u32) -> TypeInfo {
        TypeInfo {
            name: name.into(),
            size,
            kind: Some(Kind::Int(IntType {
                signed: false,
                big_endian: false,
            })),
        }
    }

    fn record(name: &str, size: u32, members: &[(&str, u32, TypeInfo)]) -> TypeInfo {
        let members = members
            .iter()
            .map(|(name, bit_offset, t)| Member {
                name: (*name).into(),
                bit_offset: *bit_offset,
                bitfield_size: 0,
                r#type: Some(t.clone()),
            })
            .collect();
        TypeInfo {
            name: name.into(),
            size,
            kind: Some(Kind::Struct(RecordType { members })),
        }
    }

    /// A private bpffs, unmounted on drop.
    struct BpfFs(tempfile::TempDir);

    impl Drop for BpfFs {
        fn drop(&mut self) {
            let _ = kernel::umount(self.0.path());
        }
    }

    #[test]
    fn the_demo_maps_are_typed() {
        let fs = BpfFs(tempfile::tempdir().expect("tempdir"));
        kernel::mount_bpffs(fs.0.path())
            .unwrap_or_else(|e| panic!("this test needs root and BPF: cannot mount a bpffs ({e})"));
        let demo = Demo::start(fs.0.path()).expect("demo");
        let open = |name: &str| {
            MapHandle::open_pinned(&fs.0.path().join("demo").join(name)).expect("open pin")
        };
        let cache = TypeCache::new();
        let types = |map: &MapHandle| match cache.map_types(map.meta()) {
            KnownTypes::Typed(t) => (t.key.clone().expect("key type"), t.value.clone()),
            other => panic!("{}: {other:?}", map.meta().name),
        };

        let flows = open("flows");
        let (key, value) = types(&flows);
        let proto = TypeInfo {
            name: "ip_proto".into(),
            size: 1,
            kind: Some(Kind::Enum(EnumType {
                signed: false,
                enumerators: [("IPPROTO_ICMP", 1), ("IPPROTO_TCP", 6), ("IPPROTO_UDP", 17)]
                    .map(|(name, value)| Enumerator {
                        name: name.into(),
                        value,
                    })
                    .to_vec(),
            })),
        };
        assert_eq!(
            key,
            record(
                "flow_key",
                16,
                &[
                    ("saddr", 0, uint("__u32", 4)),
                    ("daddr", 32, uint("__u32", 4)),
                    ("sport", 64, uint("__u16", 2)),
                    ("dport", 80, uint("__u16", 2)),
                    ("proto", 96, proto),
                ],
            )
        );
        assert_eq!(
            value,
            record(
                "flow_stats",
                16,
                &[
                    ("packets", 0, uint("__u64", 8)),
                    ("bytes", 64, uint("__u64", 8))
                ],
            )
        );
        assert_eq!(
            flows.lookup_value(&flow_key(7)).unwrap(),
            Some(flow_value(7).to_vec())
        );
        let k = flow_key(7);
        assert_eq!(u32::from_ne_bytes(k[0..4].try_into().unwrap()), 167_772_167);
        assert_eq!(u32::from_ne_bytes(k[4..8].try_into().unwrap()), 0xC0A8_0008);
        assert_eq!((k[12], flow_key(8)[12]), (IPPROTO_UDP, IPPROTO_TCP));

        let (key, value) = types(&open("cpu_counters"));
        assert_eq!(key, uint("__u32", 4));
        let counters: Vec<(&str, u32, TypeInfo)> = CPU_COUNTERS
            .iter()
            .zip(0..)
            .map(|(name, i)| (*name, 64 * i, uint("__u64", 8)))
            .collect();
        assert_eq!(value, record("cpu_counters", 64, &counters));

        assert_eq!(types(&open("recent")), (uint("__u32", 4), uint("__u64", 8)));
        assert!(matches!(
            cache.map_types(open("events").meta()),
            KnownTypes::None
        ));
        drop(demo);
    }
}
