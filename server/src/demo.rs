//! Demo maps, so that a newcomer sees real data at once:
//!
//! - `demo/flows`: hash, 100,000 flows (16-byte 5-tuple key, 16-byte
//!   packets/bytes value);
//! - `demo/cpu_counters`: per-CPU array of 8 u64 counters that a background
//!   thread keeps incrementing;
//! - `demo/recent`: LRU hash (u32 -> u64, 1024 slots) that the background
//!   thread keeps inserting into, so old entries are evicted;
//! - `demo/events`: a queue, which cannot be iterated (DumpMap answers
//!   FAILED_PRECONDITION).
//!
//! The pins are removed when the demo is dropped.
#![forbid(unsafe_code)]

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

use crate::kernel::{MapType, OwnedMap, possible_cpus};

pub const FLOWS: usize = 100_000;

/// The flow key of `demo/flows` entry `i` (saddr, daddr, sport, dport,
/// proto, 3 bytes padding; addresses and ports in network byte order).
pub fn flow_key(i: u32) -> [u8; 16] {
    let mut k = [0u8; 16];
    k[0..4].copy_from_slice(&[10, (i >> 16) as u8, (i >> 8) as u8, i as u8]);
    k[4..8].copy_from_slice(&[192, 168, 0, (i % 250) as u8 + 1]);
    k[8..10].copy_from_slice(&(1024 + (i % 60_000) as u16).to_be_bytes());
    k[10..12].copy_from_slice(&443u16.to_be_bytes());
    k[12] = 6; // TCP
    k
}

/// The value of `demo/flows` entry `i`: packets and bytes, u64 little-endian.
pub fn flow_value(i: u32) -> [u8; 16] {
    let mut v = [0u8; 16];
    v[0..8].copy_from_slice(&u64::from(i + 1).to_le_bytes());
    v[8..16].copy_from_slice(&(u64::from(i + 1) * 1500).to_le_bytes());
    v
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
) -> anyhow::Result<OwnedMap> {
    OwnedMap::new(map_type, key_size, value_size, max_entries, name)
        .with_context(|| format!("cannot create demo map {name}"))
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

        let flows = create(MapType::HASH, 16, 16, 131_072, "flows")?;
        let (mut keys, mut values) = (Vec::new(), Vec::new());
        for i in 0..FLOWS as u32 {
            keys.extend_from_slice(&flow_key(i));
            values.extend_from_slice(&flow_value(i));
        }
        flows
            .update_batch(&keys, &values)
            .context("cannot fill demo/flows")?;
        demo.pin(&flows, "flows")?;

        let counters = create(MapType::PERCPU_ARRAY, 4, 8, 8, "cpu_counters")?;
        demo.pin(&counters, "cpu_counters")?;
        let recent = create(MapType::LRU_HASH, 4, 8, 1024, "recent")?;
        demo.pin(&recent, "recent")?;
        let events = create(MapType::QUEUE, 0, 8, 64, "events")?;
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

fn write_loop(counters: &OwnedMap, recent: &OwnedMap, stop: &AtomicBool) {
    let cpus = possible_cpus() as usize;
    let mut tick: u64 = 0;
    while !stop.load(Ordering::Relaxed) {
        tick += 1;
        for idx in 0u32..8 {
            // One u64 per possible CPU: counter idx on cpu c is tick*(idx+1)+c.
            let mut value = Vec::with_capacity(8 * cpus);
            for cpu in 0..cpus as u64 {
                value.extend_from_slice(&(tick * u64::from(idx + 1) + cpu).to_le_bytes());
            }
            if let Err(e) = counters.update(&idx.to_le_bytes(), &value) {
                tracing::warn!(error = %e, "demo writer stopped");
                return;
            }
        }
        let key = (tick as u32).to_le_bytes();
        let _ = recent.update(&key, &tick.to_le_bytes());
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
