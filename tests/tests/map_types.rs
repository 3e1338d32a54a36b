//! Dumps of every map type against real kernel maps: the exact entries, in
//! both layouts.

use std::os::fd::AsFd;

use bpfmap_client::{
    DumpMethod, DumpOptions, LookupOptions, MapName, PerCpuValues, Value, ValueRef,
};
use bpfmap_kernel::{
    CreateMap, MapHandle, possible_cpus,
    walk::{Position, Walker},
};
use bpfmap_tests::*;

fn cpus() -> usize {
    possible_cpus() as usize
}

/// A per-CPU value in the kernel's layout (8-byte aligned per CPU), and the
/// per-CPU list a client should receive.
fn per_cpu(value_size: usize, f: impl Fn(usize) -> Vec<u8>) -> (Vec<u8>, Value) {
    let stride = value_size.div_ceil(8) * 8;
    let mut raw = vec![0u8; stride * cpus()];
    let mut list = Vec::new();
    for cpu in 0..cpus() {
        let v = f(cpu);
        assert_eq!(v.len(), value_size);
        raw[cpu * stride..cpu * stride + value_size].copy_from_slice(&v);
        list.push(v);
    }
    (raw, Value::PerCpu(list))
}

fn map_id(fd: &OwnedMap) -> u32 {
    fd.id()
}

struct Case {
    name: &'static str,
    fd: OwnedMap,
    expected: Entries,
    type_name: &'static str,
    method: DumpMethod,
    /// Inner maps that must stay alive while the outer map references them.
    _keep: Vec<OwnedMap>,
}

fn case(name: &'static str, fd: OwnedMap, expected: Entries, type_name: &'static str) -> Case {
    Case {
        name,
        fd,
        expected,
        type_name,
        method: DumpMethod::Batch,
        _keep: Vec::new(),
    }
}

fn hash_like(map_type: MapType, max: u32, n: u32, name: &'static str, tn: &'static str) -> Case {
    let fd = create_map(map_type, 8, 8, max);
    let mut expected = Entries::new();
    for i in 0..u64::from(n) {
        let (k, v) = ((i * 7919).to_le_bytes(), (i ^ 0xabcdef).to_le_bytes());
        update(&fd, &k, &v);
        expected.insert(k.to_vec(), Value::Single(v.to_vec()));
    }
    case(name, fd, expected, tn)
}

fn per_cpu_hash(
    map_type: MapType,
    max: u32,
    n: u32,
    vs: usize,
    name: &'static str,
    tn: &'static str,
) -> Case {
    let fd = create_map(map_type, 4, vs as u32, max);
    let mut expected = Entries::new();
    for i in 0..n {
        let (raw, value) = per_cpu(vs, |cpu| {
            let x = i * 100 + cpu as u32 + 1;
            x.to_le_bytes().iter().copied().cycle().take(vs).collect()
        });
        update(&fd, &i.to_le_bytes(), &raw);
        expected.insert(i.to_le_bytes().to_vec(), value);
    }
    case(name, fd, expected, tn)
}

fn inner_template() -> OwnedMap {
    create_map(MapType::ARRAY, 4, 4, 1)
}

/// A map of maps with inner maps at `keys`; its entries are their ids.
fn map_of_maps(map_type: MapType, max_entries: u32, keys: &[u32], name: &'static str) -> Case {
    let template = inner_template();
    let outer = create_map_with(&CreateMap {
        map_type: map_type.0,
        key_size: 4,
        value_size: 4,
        max_entries,
        name: "outer",
        inner_map: Some(template.as_fd()),
        ..Default::default()
    });
    let mut expected = Entries::new();
    let mut keep = vec![template];
    for k in keys {
        let inner = inner_template();
        update(&outer, &k.to_le_bytes(), &(inner.as_fd_raw()).to_le_bytes());
        expected.insert(
            k.to_le_bytes().to_vec(),
            Value::Single(map_id(&inner).to_le_bytes().to_vec()),
        );
        keep.push(inner);
    }
    Case {
        _keep: keep,
        ..case(name, outer, expected, name)
    }
}

fn cases() -> Vec<Case> {
    let mut cases = vec![
        hash_like(MapType::HASH, 2048, 1000, "hash", "hash"),
        hash_like(MapType::LRU_HASH, 4096, 500, "lru_hash", "lru_hash"),
        per_cpu_hash(
            MapType::PERCPU_HASH,
            1024,
            300,
            8,
            "percpu_hash",
            "percpu_hash",
        ),
        // value_size 3: the kernel pads each CPU's value to 8 bytes.
        per_cpu_hash(
            MapType::PERCPU_HASH,
            64,
            40,
            3,
            "percpu_hash_odd",
            "percpu_hash",
        ),
        per_cpu_hash(
            MapType::LRU_PERCPU_HASH,
            4096,
            300,
            8,
            "lru_percpu_hash",
            "lru_percpu_hash",
        ),
    ];

    // hash_of_maps: values come back as inner map ids.
    cases.push(map_of_maps(
        MapType::HASH_OF_MAPS,
        16,
        &[3, 9, 12],
        "hash_of_maps",
    ));

    // array: every index is an entry.
    let fd = create_map(MapType::ARRAY, 4, 8, 100);
    let mut expected = Entries::new();
    for i in 0u32..100 {
        let v = (u64::from(i) * 7).to_le_bytes();
        if i % 3 == 0 {
            update(&fd, &i.to_le_bytes(), &v);
            expected.insert(i.to_le_bytes().to_vec(), Value::Single(v.to_vec()));
        } else {
            expected.insert(i.to_le_bytes().to_vec(), Value::Single(vec![0; 8]));
        }
    }
    cases.push(case("array", fd, expected, "array"));

    let fd = create_map(MapType::PERCPU_ARRAY, 4, 8, 16);
    let mut expected = Entries::new();
    for i in 0u32..16 {
        let (raw, value) = per_cpu(8, |cpu| {
            (u64::from(i) << 32 | cpu as u64).to_le_bytes().to_vec()
        });
        update(&fd, &i.to_le_bytes(), &raw);
        expected.insert(i.to_le_bytes().to_vec(), value);
    }
    cases.push(case("percpu_array", fd, expected, "percpu_array"));

    // array_of_maps with empty slots: only the set slots are entries.
    cases.push(map_of_maps(
        MapType::ARRAY_OF_MAPS,
        8,
        &[1, 4, 6],
        "array_of_maps",
    ));

    // lpm_trie: key = prefixlen (u32) + IPv4 address.
    let fd = create_map_with(&CreateMap {
        map_type: MapType::LPM_TRIE.0,
        key_size: 8,
        value_size: 8,
        max_entries: 128,
        flags: 1, // BPF_F_NO_PREALLOC, required for tries
        name: "trie",
        ..Default::default()
    });
    let mut expected = Entries::new();
    for i in 0u8..40 {
        let mut k = (8 + u32::from(i % 25)).to_le_bytes().to_vec();
        k.extend_from_slice(&[10, i, 0, 0]);
        // Mask the address to the prefix, as the trie stores it.
        let plen = 8 + u32::from(i % 25);
        let addr = u32::from_be_bytes([10, i, 0, 0]) & (!0u32 << (32 - plen));
        k[4..].copy_from_slice(&addr.to_be_bytes());
        let v = u64::from(i).to_le_bytes();
        update(&fd, &k, &v);
        expected.insert(k, Value::Single(v.to_vec()));
    }
    cases.push(case("lpm_trie", fd, expected, "lpm_trie"));

    // Types without batch support, walked key by key.
    let fd = create_map(MapType::DEVMAP, 4, 4, 8);
    let mut expected = Entries::new();
    for k in [0u32, 5] {
        update(&fd, &k.to_le_bytes(), &1u32.to_le_bytes()); // ifindex 1: lo
        expected.insert(
            k.to_le_bytes().to_vec(),
            Value::Single(1u32.to_le_bytes().to_vec()),
        );
    }
    cases.push(Case {
        method: DumpMethod::KeyByKey,
        ..case("devmap", fd, expected, "devmap")
    });
    let fd = create_map(MapType::DEVMAP_HASH, 4, 4, 8);
    let mut expected = Entries::new();
    for k in [77u32, 1000, 3] {
        update(&fd, &k.to_le_bytes(), &1u32.to_le_bytes());
        expected.insert(
            k.to_le_bytes().to_vec(),
            Value::Single(1u32.to_le_bytes().to_vec()),
        );
    }
    cases.push(Case {
        method: DumpMethod::KeyByKey,
        ..case("devmap_hash", fd, expected, "devmap_hash")
    });
    cases
}

trait RawFd {
    fn as_fd_raw(&self) -> u32;
}

impl RawFd for OwnedMap {
    fn as_fd_raw(&self) -> u32 {
        use std::os::fd::AsRawFd as _;
        self.as_fd().as_raw_fd() as u32
    }
}

#[tokio::test]
async fn every_map_type_dumps_exactly_its_entries_in_both_layouts() {
    let (fs, _state, daemon, client) = setup().await;
    let cases = cases();
    for c in &cases {
        fs.pin(&c.fd, &format!("types/{}", c.name));
    }
    for c in &cases {
        let path = format!("types/{}", c.name);
        let info = client.get_map(&path.parse().unwrap()).await.unwrap();
        assert_eq!(info.type_name(), c.type_name, "{path}");
        assert_eq!(info.dump_method(), c.method, "{path}");
        assert_eq!(info.path(), Some(path.as_str()));
        assert_eq!(info.possible_cpus() as usize, cpus());
        for (packed, chunk_size) in [(true, 0), (false, 0), (true, 7), (false, 1)] {
            let options = DumpOptions::default()
                .with_packed(packed)
                .with_chunk_size(chunk_size);
            let got = dump_all(&client, &path, options).await;
            assert_eq!(
                got, c.expected,
                "{path} packed={packed} chunk_size={chunk_size}"
            );
        }
    }
    daemon.stop().await;
}

#[tokio::test]
async fn empty_maps_give_no_entries_and_a_complete_summary() {
    let (fs, _state, daemon, client) = setup().await;
    let template = inner_template();
    let maps = [
        ("hash", create_map(MapType::HASH, 8, 8, 16)),
        ("percpu_hash", create_map(MapType::PERCPU_HASH, 8, 8, 16)),
        (
            "lpm",
            create_map_with(&CreateMap {
                map_type: MapType::LPM_TRIE.0,
                key_size: 8,
                value_size: 8,
                max_entries: 16,
                flags: 1,
                name: "lpm",
                ..Default::default()
            }),
        ),
        (
            "aom",
            create_map_with(&CreateMap {
                map_type: MapType::ARRAY_OF_MAPS.0,
                key_size: 4,
                value_size: 4,
                max_entries: 4,
                name: "aom",
                inner_map: Some(template.as_fd()),
                ..Default::default()
            }),
        ),
        ("devmap_hash", create_map(MapType::DEVMAP_HASH, 4, 4, 8)),
    ];
    for (name, fd) in &maps {
        fs.pin(fd, &format!("empty/{name}"));
    }
    for (name, _) in &maps {
        let map: MapName = format!("empty/{name}").parse().unwrap();
        let mut dump = client.dump(&map, DumpOptions::default());
        assert_eq!(dump.next_chunk().await.unwrap(), None, "{name}");
        let s = dump.summary().expect("summary");
        assert!(s.complete(), "{name}");
        assert_eq!((s.entries(), s.chunks()), (0, 0), "{name}");
    }
    daemon.stop().await;
}

#[tokio::test]
async fn a_million_entry_hash_map_dumps_completely() {
    let (fs, _state, daemon, client) = setup().await;
    let (_fd, expected) = u64_hash(&fs, "big", 1_000_000, 1_000_000);
    let map: MapName = "big".parse().unwrap();
    let mut dump = client.dump(&map, DumpOptions::default());
    let mut got = Entries::new();
    while let Some(chunk) = dump.next_chunk().await.unwrap() {
        for e in chunk {
            assert!(got.insert(e.key, e.value).is_none(), "duplicate key");
        }
    }
    assert_eq!(got.len(), 1_000_000);
    assert!(got == expected, "entries differ from what was written");
    let s = dump.summary().unwrap();
    assert_eq!(s.entries(), 1_000_000);
    assert!(s.complete());
    daemon.stop().await;
}

#[test]
fn colliding_keys_with_batch_size_one_take_the_enospc_path_and_lose_nothing() {
    let fs = BpfFs::new();
    // 512 keys in 512 buckets: many buckets hold two or more.
    let (_fd, expected) = u64_hash(&fs, "collide", 512, 512);
    let handle = MapHandle::open_pinned(&fs.path().join("collide")).unwrap();
    let meta = handle.meta().clone();
    let mut walker = Walker::new(handle, meta, Position::Start).unwrap();
    let mut got = Entries::new();
    while let Some(c) = walker.next_chunk(1).unwrap() {
        for i in 0..c.count {
            let k = c.keys[i * 8..i * 8 + 8].to_vec();
            let v = Value::Single(c.values[i * 8..i * 8 + 8].to_vec());
            assert!(got.insert(k, v).is_none(), "duplicate key");
        }
    }
    assert_eq!(got, expected);
    assert!(
        walker.stats().enospc > 0,
        "expected the kernel to answer ENOSPC for multi-entry buckets: {:?}",
        walker.stats()
    );
}

#[tokio::test]
async fn chunk_size_one_over_grpc_gives_every_entry_of_colliding_buckets() {
    let (fs, _state, daemon, client) = setup().await;
    let (_fd, expected) = u64_hash(&fs, "collide", 512, 512);
    for packed in [true, false] {
        let options = DumpOptions::default()
            .with_chunk_size(1)
            .with_packed(packed);
        assert_eq!(dump_all(&client, "collide", options).await, expected);
    }
    daemon.stop().await;
}

#[tokio::test]
async fn lookup_reports_present_and_absent_keys_in_order() {
    let (fs, _state, daemon, client) = setup().await;
    let (_fd, _) = u64_hash(&fs, "m", 100, 128);
    let pc = per_cpu_hash(MapType::PERCPU_HASH, 16, 2, 8, "pc", "percpu_hash");
    fs.pin(&pc.fd, "pc");
    let map: MapName = "m".parse().unwrap();
    let keys = vec![5u64.to_le_bytes().to_vec(), 500u64.to_le_bytes().to_vec()];
    let r = client
        .lookup(&map, keys.clone(), LookupOptions::default())
        .await
        .unwrap();
    assert_eq!(r.len(), 2);
    assert_eq!((r[0].key(), r[0].found()), (&keys[0][..], true));
    assert_eq!(r[0].value(), Some(ValueRef::Single(&15u64.to_le_bytes())));
    assert_eq!((r[1].key(), r[1].found()), (&keys[1][..], false));
    assert_eq!(r[1].value(), None);

    let r = client
        .lookup(
            &"pc".parse().unwrap(),
            vec![1u32.to_le_bytes().to_vec()],
            LookupOptions::default(),
        )
        .await
        .unwrap();
    let Value::PerCpu(expected) = &pc.expected[&1u32.to_le_bytes().to_vec()] else {
        unreachable!()
    };
    assert_eq!(
        r[0].value(),
        Some(ValueRef::PerCpu(PerCpuValues::from_slices(expected)))
    );
    daemon.stop().await;
}
