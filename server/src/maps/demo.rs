//! Demo maps, so that a newcomer sees real data at once. They carry BTF, so
//! their entries read as JSON with named members:
//!
//! - `demo/flows`: hash (131,072 slots), 100,000 base flows `flow_key(i)` ->
//!   `flow_value(i)` for i in 0..100,000. Key `struct flow_key { __u32
//!   saddr; __u32 daddr; __u16 sport; __u16 dport; enum ip_proto proto; }`
//!   (16 bytes: a 1-byte enum, 3 bytes of padding; the addresses hold their
//!   bytes in network order, as real programs keep what came off the wire,
//!   and `bpfmapd --demo` renders them as addresses: [`Demo::renderings`];
//!   ports are integers in host byte order), value `struct flow_stats {
//!   __u64 packets; __u64 bytes; }`;
//! - `demo/cpu_counters`: per-CPU array, `__u32` -> `struct cpu_counters`
//!   (8 `__u64` counters, [`CPU_COUNTERS`]), 8 entries that a background
//!   thread keeps incrementing every 100 ms;
//! - `demo/recent`: LRU hash (`__u32` -> `__u64`, 1024 slots) that the
//!   background thread keeps inserting into (one key every 100 ms), so old
//!   entries are evicted;
//! - `demo/events`: a queue, untyped, which cannot be iterated (DumpMap
//!   answers FAILED_PRECONDITION);
//! - `demo/drainable`: hash (65,536 slots) of the same types as `demo/flows`
//!   that the background thread fills with 20 new flows every 100 ms
//!   (`flow_key(1,000,000 + n)` -> `flow_value(n)`, n counting up): a map
//!   for DrainMap to empty, once the configuration makes it drainable
//!   (`[drain] maps = ["demo/drainable"]` and a rule granting `drain`).
//!   When full it stops filling until drained;
//! - `demo/latency`: hash, `__u32 pid` -> `struct hist { __u32 slots[20];
//!   char comm[16]; }` as libbpf-tools' runqlat -P keeps it (slot k counts
//!   latencies in [2^k, 2^(k+1)) microseconds), two processes with fixed
//!   counts ([`LATENCY`]): a map for HistogramMap to draw.
//!
//! [`Demo::start`] leaves `demo/flows` as it was filled. [`Demo::start_live`]
//! (what `bpfmapd --demo` runs) also moves it, every 100 ms (a tick), in
//! one `BPF_MAP_UPDATE_BATCH` of about 2,200 entries and 10 deletes:
//!
//! - hot destinations: every tick, each of the 400 base flows of daddr
//!   192.168.0.1 (i % 250 == 0) gets 3 more packets, of 192.168.0.2
//!   (i % 250 == 1) 2 more, of 192.168.0.3 (i % 250 == 2) 1 more: 12,000,
//!   8,000 and 4,000 packets/s (18, 12 and 6 MB/s) per destination;
//! - the other 98,800 base flows: every tick, those in a window of 1,000
//!   consecutive ids (0..1,000, then 1,000..2,000, ..., back to 0 after 100
//!   ticks; the 12 hot flows in it skipped) get 1 more packet each. So each
//!   of these flows grows by 1 packet every 10 s, and each of the other 247
//!   destinations (4 flows per window) by 40 packets/s (60,000 B/s);
//! - every increment adds 1,500 bytes per packet, so bytes stay packets *
//!   1500 in every flow;
//! - churn: 1,000 churn flows `flow_key(i)` -> `{ packets: 1, bytes: 1500 }`
//!   for i from 100,000 up are added at the start; every tick the next 10
//!   ids are added and the 10 oldest churn flows are deleted, so each lives
//!   10 s and the map holds 101,000 entries (101,010 for a moment, never
//!   near 131,072). Ids stay below 2^24 (they start again at 100,000 after
//!   about 46 hours), so saddr (10.0.0.0 + i) is unique and a churn key
//!   never collides with a base flow's (or another churn flow's).
//!
//! The writer counts the flows' packets in memory and writes its counts:
//! what anyone else writes into a flow it moves is overwritten. The pins are
//! removed when the demo is dropped.

use std::{
    collections::VecDeque,
    path::{Path, PathBuf},
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    thread,
    time::{Duration, Instant},
};

use anyhow::Context as _;

use bpfmap_kernel::{
    BtfBuilder, BtfMember, CreateMap, IntEncoding, MapBtf, MapType, OwnedBtf, OwnedMap,
    possible_cpus,
};

use super::RenderConfig;

pub(super) const FLOWS: usize = 100_000;

/// Slots of `demo/drainable`, the flows it gains per tick, and how many ids
/// it counts through (below 2^24 - 1,000,000: saddr stays unique).
const DRAINABLE_SLOTS: u32 = 65_536;
const DRAINABLE_PER_TICK: u32 = 20;
const DRAINABLE_IDS: u32 = 15_000_000;

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

/// How often the demo writer changes the maps.
const TICK: Duration = Duration::from_millis(100);

/// Slots of `demo/flows`.
const FLOW_SLOTS: u32 = 131_072;

/// Bytes per packet of the live flows' increments.
const PACKET_BYTES: u64 = 1500;

/// Packets per tick that each base flow of a hot destination gets, by
/// `i % 250` (daddr 192.168.0.(i % 250 + 1)).
const HOT: [(u32, u64); 3] = [(0, 3), (1, 2), (2, 1)];

/// Base flows per tick in the window of the other flows (each gets 1
/// packet). A divisor of [`FLOWS`] and a multiple of 250, so every window
/// holds the same number of flows of each destination.
const COLD_PER_TICK: u32 = 1_000;

/// Churn flows alive at any time.
const CHURN_FLOWS: usize = 1_000;

/// Churn flows added (and removed) per tick.
const CHURN_PER_TICK: usize = 10;

/// Churn ids are in `FLOWS..CHURN_END`: below 2^24, `0x0A00_0000 | i` keeps
/// i whole, so every id has its own saddr.
const CHURN_END: u32 = 1 << 24;

/// The flow key of `demo/flows` entry `i`: the addresses as they came off
/// the wire (network byte order in their `__u32`, as real programs keep
/// them), saddr 10.0.0.0 + i (`0x0A00_0000 | i`), daddr
/// 192.168.0.(i % 250 + 1) (`0xC0A8_0000 | (i % 250 + 1)`); the rest in
/// host byte order: sport 1024 + i % 60000, dport 443, proto UDP (17) when
/// i % 4 == 3, else TCP (6); then 3 bytes of zero padding.
pub fn flow_key(i: u32) -> [u8; 16] {
    let mut k = [0u8; 16];
    k[0..4].copy_from_slice(&(0x0A00_0000 | i).to_be_bytes());
    k[4..8].copy_from_slice(&(0xC0A8_0000 | (i % 250 + 1)).to_be_bytes());
    k[8..10].copy_from_slice(&(1024 + (i % 60_000) as u16).to_ne_bytes());
    k[10..12].copy_from_slice(&443u16.to_ne_bytes());
    k[12] = if i % 4 == 3 { IPPROTO_UDP } else { IPPROTO_TCP };
    k
}

/// The value of `demo/flows` entry `i`: packets i + 1 and bytes
/// (i + 1) * 1500, u64 in host byte order.
pub fn flow_value(i: u32) -> [u8; 16] {
    flow_stats(u64::from(i) + 1)
}

/// A `struct flow_stats` of `packets` packets of 1500 bytes.
fn flow_stats(packets: u64) -> [u8; 16] {
    let mut v = [0u8; 16];
    v[0..8].copy_from_slice(&packets.to_ne_bytes());
    v[8..16].copy_from_slice(&(packets * PACKET_BYTES).to_ne_bytes());
    v
}

/// Packets per tick of base flow `i` when it is one of a hot destination's.
fn hot_packets(i: u32) -> Option<u64> {
    HOT.iter()
        .find(|(rest, _)| i % 250 == *rest)
        .map(|(_, packets)| *packets)
}

/// `struct flow_key { __u32 saddr, daddr; __u16 sport, dport; enum ip_proto
/// proto; }` and `struct flow_stats { __u64 packets, bytes; }`, as
/// `demo/flows` declares them, added to `b`: their ids.
pub fn flow_types(b: &mut BtfBuilder) -> (u32, u32) {
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
    (flow_key, flow_stats)
}

/// Slots of `demo/latency`'s `struct hist`.
const LATENCY_SLOTS: usize = 20;

/// One process's latencies in `demo/latency`.
#[derive(Debug, Clone, Copy)]
pub(super) struct Latency {
    /// Its key.
    pub(super) pid: u32,
    /// Its command (`value.comm`).
    pub(super) comm: &'static str,
    /// (slot, count) of its non-empty slots.
    pub(super) slots: &'static [(usize, u32)],
}

/// `demo/latency`'s entries.
pub(super) const LATENCY: [Latency; 2] = [
    Latency {
        pid: 4242,
        comm: "nginx",
        slots: &[(2, 3), (3, 18), (4, 40), (5, 22), (6, 9), (7, 4), (10, 1)],
    },
    Latency {
        pid: 4343,
        comm: "redis",
        slots: &[(0, 12), (1, 30), (2, 11), (3, 2), (8, 1)],
    },
];

/// The demo maps' BTF, loaded, and the ids of the types they use.
struct DemoTypes {
    btf: OwnedBtf,
    u32_t: u32,
    u64_t: u32,
    flow_key: u32,
    flow_stats: u32,
    cpu_counters: u32,
    hist: u32,
}

impl DemoTypes {
    fn load() -> anyhow::Result<Self> {
        let mut b = BtfBuilder::new();
        let (flow_key, flow_stats) = flow_types(&mut b);
        let u32_ = b.add_int("unsigned int", 4, IntEncoding::Unsigned);
        let u64_ = b.add_int("unsigned long long", 8, IntEncoding::Unsigned);
        let u32_t = b.add_typedef("__u32", u32_);
        let u64_t = b.add_typedef("__u64", u64_);
        let counters: Vec<BtfMember<'_>> = CPU_COUNTERS
            .iter()
            .zip(0..)
            .map(|(name, i)| BtfMember::new(name, u64_t, 64 * i))
            .collect();
        let cpu_counters = b.add_struct("cpu_counters", 64, &counters);
        let char_ = b.add_int("char", 1, IntEncoding::Signed);
        let slots = b.add_array(u32_t, LATENCY_SLOTS as u32);
        let comm = b.add_array(char_, 16);
        let hist = b.add_struct(
            "hist",
            (LATENCY_SLOTS * 4 + 16) as u32,
            &[
                BtfMember::new("slots", slots, 0),
                BtfMember::new("comm", comm, (LATENCY_SLOTS * 32) as u32),
            ],
        );
        let btf = OwnedBtf::load(&b.to_bytes()).context("cannot load the demo maps' BTF")?;
        Ok(Self {
            btf,
            u32_t,
            u64_t,
            flow_key,
            flow_stats,
            cpu_counters,
            hist,
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
    key_size: u32,
    value_size: u32,
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
        16,
        16,
        n.max(1),
        "flows",
        Some(types.btf.for_map(types.flow_key, types.flow_stats)),
    )?;
    fill_flows(map, n)
}

impl Demo {
    /// How `bpfmapd --demo` shows the demo maps' addresses (its first
    /// `[[render]]` table, which the configuration's own override).
    pub fn renderings() -> RenderConfig {
        RenderConfig {
            names: Vec::new(),
            maps: vec!["demo/flows".into(), "demo/drainable".into()],
            members: [("key.saddr", "ipv4"), ("key.daddr", "ipv4")]
                .into_iter()
                .map(|(k, v)| (k.to_owned(), v.to_owned()))
                .collect(),
        }
    }

    /// Creates the demo maps under `root/demo`, replacing old demo pins.
    /// `demo/flows` keeps the values it was filled with (`flow_value(i)`);
    /// `demo/cpu_counters` and `demo/recent` change every 100 ms.
    pub fn start(root: &Path) -> anyhow::Result<Self> {
        Self::launch(root, false)
    }

    /// Like [`Demo::start`], and `demo/flows` moves too, every 100 ms:
    /// each base flow of daddr 192.168.0.1, .2 and .3 gets 3, 2 and 1
    /// packets, the base flows in a window of 1,000 ids that moves on by
    /// 1,000 every time get 1 packet each (1,500 bytes per packet), and 10
    /// churn flows (`flow_key(i)` for i from 100,000 up, about 1,000 of them
    /// at any time) are added and the 10 oldest removed.
    pub fn start_live(root: &Path) -> anyhow::Result<Self> {
        Self::launch(root, true)
    }

    fn launch(root: &Path, live: bool) -> anyhow::Result<Self> {
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
                16,
                16,
                FLOW_SLOTS,
                "flows",
                typed(types.flow_key, types.flow_stats),
            )?,
            FLOWS as u32,
        )?;
        demo.pin(&flows, "flows")?;
        let flows = if live {
            Some(LiveFlows::new(flows)?)
        } else {
            None
        };

        let counters = create(
            MapType::PERCPU_ARRAY,
            4,
            64,
            COUNTER_SETS,
            "cpu_counters",
            typed(types.u32_t, types.cpu_counters),
        )?;
        demo.pin(&counters, "cpu_counters")?;
        let recent = create(
            MapType::LRU_HASH,
            4,
            8,
            1024,
            "recent",
            typed(types.u32_t, types.u64_t),
        )?;
        demo.pin(&recent, "recent")?;
        let events = create(MapType::QUEUE, 0, 8, 64, "events", None)?;
        demo.pin(&events, "events")?;
        let drainable = create(
            MapType::HASH,
            16,
            16,
            DRAINABLE_SLOTS,
            "drainable",
            typed(types.flow_key, types.flow_stats),
        )?;
        demo.pin(&drainable, "drainable")?;
        let latency = latency_map(&types)?;
        demo.pin(&latency, "latency")?;

        let stop = demo.stop.clone();
        demo.writer = Some(
            thread::Builder::new()
                .name("demo-writer".into())
                .spawn(move || {
                    let maps = Written {
                        counters: &counters,
                        recent: &recent,
                        flows,
                        drainable: &drainable,
                    };
                    write_loop(maps, &stop)
                })?,
        );
        tracing::info!(dir = %dir.display(), live, "demo maps pinned: flows, cpu_counters, recent, events, drainable, latency");
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

/// `demo/latency`, filled with [`LATENCY`].
fn latency_map(types: &DemoTypes) -> anyhow::Result<OwnedMap> {
    let latency = create(
        MapType::HASH,
        4,
        (LATENCY_SLOTS * 4 + 16) as u32,
        64,
        "latency",
        Some(types.btf.for_map(types.u32_t, types.hist)),
    )?;
    for l in LATENCY {
        let mut value = vec![0u8; LATENCY_SLOTS * 4 + 16];
        for (slot, c) in l.slots {
            value[slot * 4..slot * 4 + 4].copy_from_slice(&c.to_le_bytes());
        }
        value[LATENCY_SLOTS * 4..][..l.comm.len()].copy_from_slice(l.comm.as_bytes());
        latency
            .update(&l.pid.to_le_bytes(), &value)
            .context("cannot fill demo/latency")?;
    }
    Ok(latency)
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

/// What the live demo writes into `demo/flows`, and the counters it keeps.
struct LiveFlows {
    map: OwnedMap,
    /// Packets of base flow i (bytes are packets * 1500).
    packets: Vec<u64>,
    /// The first base id of the next tick's window.
    window: u32,
    /// Live churn ids, oldest first.
    churn: VecDeque<u32>,
    /// The next churn id.
    next_churn: u32,
    keys: Vec<u8>,
    values: Vec<u8>,
}

impl LiveFlows {
    /// Takes over `map`, filled with the base flows, and adds the first
    /// churn flows.
    fn new(map: OwnedMap) -> anyhow::Result<Self> {
        let mut live = Self {
            map,
            packets: (1..=FLOWS as u64).collect(),
            window: 0,
            churn: VecDeque::with_capacity(CHURN_FLOWS + CHURN_PER_TICK),
            next_churn: FLOWS as u32,
            keys: Vec::new(),
            values: Vec::new(),
        };
        for _ in 0..CHURN_FLOWS {
            live.add_churn();
        }
        live.write().context("cannot add the churn flows")?;
        Ok(live)
    }

    fn push(&mut self, key: [u8; 16], value: [u8; 16]) {
        self.keys.extend_from_slice(&key);
        self.values.extend_from_slice(&value);
    }

    /// Queues the next churn flow.
    fn add_churn(&mut self) {
        let id = self.next_churn;
        self.next_churn = if id + 1 >= CHURN_END {
            FLOWS as u32
        } else {
            id + 1
        };
        self.churn.push_back(id);
        self.push(flow_key(id), flow_stats(1));
    }

    /// Writes what is queued, in one batch.
    fn write(&mut self) -> bpfmap_kernel::SysResult<()> {
        let written = self.map.update_batch(&self.keys, &self.values);
        self.keys.clear();
        self.values.clear();
        written
    }

    /// One tick: counters grow, churn flows come and go.
    fn tick(&mut self) -> bpfmap_kernel::SysResult<()> {
        for (rest, packets) in HOT {
            for i in (rest..FLOWS as u32).step_by(250) {
                self.bump(i, packets);
            }
        }
        for i in self.window..self.window + COLD_PER_TICK {
            if hot_packets(i).is_none() {
                self.bump(i, 1);
            }
        }
        self.window = (self.window + COLD_PER_TICK) % FLOWS as u32;
        for _ in 0..CHURN_PER_TICK {
            self.add_churn();
        }
        self.write()?;
        while self.churn.len() > CHURN_FLOWS
            && let Some(id) = self.churn.pop_front()
        {
            if let Err(e) = self.map.delete(&flow_key(id))
                && e.errno() != Some(libc::ENOENT)
            {
                return Err(e);
            }
        }
        Ok(())
    }

    fn bump(&mut self, i: u32, packets: u64) {
        let p = &mut self.packets[i as usize];
        *p += packets;
        let value = flow_stats(*p);
        self.push(flow_key(i), value);
    }
}

/// The demo's maps the writer changes.
struct Written<'a> {
    counters: &'a OwnedMap,
    recent: &'a OwnedMap,
    flows: Option<LiveFlows>,
    drainable: &'a OwnedMap,
}

fn write_loop(maps: Written<'_>, stop: &AtomicBool) {
    let Written {
        counters,
        recent,
        mut flows,
        drainable,
    } = maps;
    let cpus = possible_cpus() as usize;
    let mut tick: u64 = 0;
    let mut drainable_next: u32 = 0;
    while !stop.load(Ordering::Relaxed) {
        let began = Instant::now();
        tick += 1;
        for set in 0..COUNTER_SETS {
            if let Err(e) = counters.update(&set.to_ne_bytes(), &counter_values(tick, set, cpus)) {
                tracing::warn!(error = %e, "demo writer stopped");
                return;
            }
        }
        let key = (tick as u32).to_ne_bytes();
        let _ = recent.update(&key, &tick.to_ne_bytes());
        // New flows for DrainMap; a full map takes none until drained.
        for _ in 0..DRAINABLE_PER_TICK {
            let n = drainable_next % DRAINABLE_IDS;
            if drainable
                .update(&flow_key(1_000_000 + n), &flow_value(n))
                .is_err()
            {
                break;
            }
            drainable_next = drainable_next.wrapping_add(1);
        }
        if let Some(live) = &mut flows
            && let Err(e) = live.tick()
        {
            tracing::warn!(error = %e, "demo flows stopped moving");
            flows = None;
        }
        thread::sleep(TICK.saturating_sub(began.elapsed()));
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

    use std::collections::{HashMap, HashSet};

    use bpfmap_kernel::{
        self as kernel, MapHandle,
        walk::{Position, Walker},
    };

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
        assert_eq!(k[0..4], [10, 0, 0, 7]);
        assert_eq!(u32::from_be_bytes(k[4..8].try_into().unwrap()), 0xC0A8_0008);
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

    /// Every entry of `demo/flows`: key -> (packets, bytes).
    fn read_flows(map: &MapHandle) -> HashMap<[u8; 16], (u64, u64)> {
        let mut walk = Walker::new(map, map.meta().clone(), Position::Start).expect("walk");
        let mut flows = HashMap::new();
        while let Some(c) = walk.next_chunk(4096).expect("read demo/flows") {
            for (k, v) in c.keys.chunks_exact(16).zip(c.values.chunks_exact(16)) {
                let u64_at = |at: usize| u64::from_ne_bytes(v[at..at + 8].try_into().unwrap());
                flows.insert(k.try_into().unwrap(), (u64_at(0), u64_at(8)));
            }
        }
        flows
    }

    /// The id `i` of `flow_key(i)`.
    fn flow_id(key: &[u8; 16]) -> u32 {
        u32::from_be_bytes(key[0..4].try_into().unwrap()) & 0x00FF_FFFF
    }

    #[test]
    fn the_live_demo_moves_its_flows() {
        let fs = BpfFs(tempfile::tempdir().expect("tempdir"));
        kernel::mount_bpffs(fs.0.path())
            .unwrap_or_else(|e| panic!("this test needs root and BPF: cannot mount a bpffs ({e})"));
        let demo = Demo::start_live(fs.0.path()).expect("live demo");
        let map = MapHandle::open_pinned(&fs.0.path().join("demo/flows")).expect("open pin");
        let before = read_flows(&map);
        thread::sleep(Duration::from_millis(500));
        let after = read_flows(&map);
        drop(demo);

        let base: Vec<[u8; 16]> = (0..FLOWS as u32).map(flow_key).collect();
        for flows in [&before, &after] {
            for (i, k) in base.iter().enumerate() {
                assert!(flows.contains_key(k), "base flow {i} is missing");
            }
            assert!(
                flows.len() <= FLOW_SLOTS as usize,
                "{} entries",
                flows.len()
            );
            for (k, (packets, bytes)) in flows {
                assert_eq!(*bytes, packets * PACKET_BYTES, "flow {}", flow_id(k));
            }
        }

        // Base flows: hot destinations grow, and faster than any other.
        let grew: Vec<u32> = (0..FLOWS as u32)
            .filter(|&i| after[&base[i as usize]].1 > before[&base[i as usize]].1)
            .collect();
        assert!(grew.contains(&0), "the hot flow 0 did not grow");
        assert!(
            grew.iter().any(|&i| hot_packets(i).is_none()),
            "no other base flow grew"
        );
        let mut by_daddr = [0u64; 250];
        for i in 0..FLOWS as u32 {
            let k = &base[i as usize];
            by_daddr[(i % 250) as usize] += after[k].1 - before[k].1;
        }
        let coldest_hot = HOT.iter().map(|(d, _)| by_daddr[*d as usize]).min();
        let hottest_cold = (HOT.len()..250).map(|d| by_daddr[d]).max();
        assert!(
            coldest_hot > hottest_cold,
            "bytes per destination: {by_daddr:?}"
        );

        // Churn flows: flow_key(i) for ids from FLOWS up, about 1,000 of
        // them, some added and some removed in between.
        let churn = |flows: &HashMap<[u8; 16], (u64, u64)>| -> HashSet<[u8; 16]> {
            flows
                .keys()
                .filter(|k| flow_id(k) >= FLOWS as u32)
                .copied()
                .collect()
        };
        let (old, new) = (churn(&before), churn(&after));
        for flows in [&before, &after] {
            assert_eq!(flows.len(), FLOWS + churn(flows).len());
        }
        for k in old.iter().chain(&new) {
            assert_eq!(*k, flow_key(flow_id(k)));
        }
        for set in [&old, &new] {
            assert!(
                (900..=1_100).contains(&set.len()),
                "{} churn flows",
                set.len()
            );
        }
        assert!(
            new.difference(&old).next().is_some(),
            "no churn flow was added"
        );
        assert!(
            old.difference(&new).next().is_some(),
            "no churn flow was removed"
        );
    }
}
