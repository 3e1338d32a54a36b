//! The maps of widely run networking programs, as `bpf/networking.bpf.c`
//! declares them (Cilium's connection tracking, load balancer and ipcache
//! maps, the XDP tutorial's per-CPU stats, a program's global data),
//! loaded into a bpffs and filled with known entries in network byte
//! order: for the networking tests, and for trying the documentation's
//! examples (`networking-maps DIR`).

use std::{
    net::{Ipv4Addr, Ipv6Addr},
    path::Path,
};

use bpfmap_kernel::{CreateMap, MapType, OwnedBtf, OwnedMap};

/// The program's maps, loaded and filled: Cilium's pinned by name under
/// `tc/globals/` (where Cilium pins them), the global data sections under
/// `globals/`. The pins outlive it; dropping it closes the descriptors.
#[derive(Debug)]
pub struct Loaded {
    /// The maps aya created.
    pub ebpf: aya::Ebpf,
    /// The `.bss` and `.data` maps made as libbpf makes them (with the
    /// sections' BTF), and the BTF they hold.
    pub globals: (OwnedBtf, OwnedMap, OwnedMap),
}

pub const CT4: &str = "tc/globals/cilium_ct4_global";
pub const CT6: &str = "tc/globals/cilium_ct6_global";
pub const LB4_SERVICES: &str = "tc/globals/cilium_lb4_services_v2";
pub const LB4_BACKENDS: &str = "tc/globals/cilium_lb4_backends_v3";
pub const IPCACHE: &str = "tc/globals/cilium_ipcache";
pub const XDP_STATS: &str = "tc/globals/xdp_stats_map";
/// aya's global data maps (no BTF; aya does not pin them: [`load`] does).
pub const BSS: &str = "globals/bss";
pub const DATA: &str = "globals/data";
/// The same sections made as libbpf makes them: keyless BTF, the value a
/// DATASEC of the section's variables.
pub const BSS_TYPED: &str = "globals/bss_typed";
pub const DATA_TYPED: &str = "globals/data_typed";

/// Every map [`load`] pins, relative to its root.
pub const PATHS: [&str; 10] = [
    CT4,
    CT6,
    LB4_SERVICES,
    LB4_BACKENDS,
    IPCACHE,
    XDP_STATS,
    BSS,
    DATA,
    BSS_TYPED,
    DATA_TYPED,
];

pub const AF_INET: u8 = 2;
pub const AF_INET6: u8 = 10;
pub const TCP: u8 = 6;
pub const UDP: u8 = 17;

/// 10.0.0.1:443 <- 192.168.0.2:51234, TCP: `struct ipv4_ct_tuple`.
pub fn ct4_key() -> [u8; 14] {
    let mut k = [0u8; 14];
    k[0..4].copy_from_slice(&Ipv4Addr::new(10, 0, 0, 1).octets());
    k[4..8].copy_from_slice(&Ipv4Addr::new(192, 168, 0, 2).octets());
    k[8..10].copy_from_slice(&443u16.to_be_bytes());
    k[10..12].copy_from_slice(&51234u16.to_be_bytes());
    k[12] = TCP;
    k
}

/// fe80::1:443 <- fe80::2:51234, TCP: `struct ipv6_ct_tuple`.
pub fn ct6_key() -> [u8; 38] {
    let mut k = [0u8; 38];
    k[0..16].copy_from_slice(&"fe80::1".parse::<Ipv6Addr>().unwrap().octets());
    k[16..32].copy_from_slice(&"fe80::2".parse::<Ipv6Addr>().unwrap().octets());
    k[32..34].copy_from_slice(&443u16.to_be_bytes());
    k[34..36].copy_from_slice(&51234u16.to_be_bytes());
    k[36] = TCP;
    k
}

/// `struct ct_entry`: 10 packets, 15000 bytes, lifetime 12345,
/// seen_non_syn and node_port set, rev_nat_index 7, SYN|ACK seen out, ACK
/// in, source identity 42.
pub fn ct_entry() -> [u8; 56] {
    let mut v = [0u8; 56];
    v[16..24].copy_from_slice(&10u64.to_le_bytes());
    v[24..32].copy_from_slice(&15000u64.to_le_bytes());
    v[32..36].copy_from_slice(&12345u32.to_le_bytes());
    v[36..38].copy_from_slice(&(1u16 << 4 | 1 << 5).to_le_bytes());
    v[38..40].copy_from_slice(&7u16.to_le_bytes());
    v[42] = 0x12;
    v[43] = 0x10;
    v[44..48].copy_from_slice(&42u32.to_le_bytes());
    v
}

/// The service 10.96.0.10:53/UDP, its master slot: `struct lb4_key`.
pub fn lb4_key() -> [u8; 12] {
    let mut k = [0u8; 12];
    k[0..4].copy_from_slice(&Ipv4Addr::new(10, 96, 0, 10).octets());
    k[4..6].copy_from_slice(&53u16.to_be_bytes());
    k[8] = UDP;
    k
}

/// `struct lb4_service`: one backend, rev_nat_index 5.
pub fn lb4_service() -> [u8; 12] {
    let mut v = [0u8; 12];
    v[4..6].copy_from_slice(&1u16.to_le_bytes());
    v[6..8].copy_from_slice(&5u16.to_le_bytes());
    v
}

/// Backend 1: 10.0.1.5:8053/UDP, `struct lb4_backend`.
pub fn lb4_backend() -> [u8; 12] {
    let mut v = [0u8; 12];
    v[0..4].copy_from_slice(&Ipv4Addr::new(10, 0, 1, 5).octets());
    v[4..6].copy_from_slice(&8053u16.to_be_bytes());
    v[6] = UDP;
    v
}

/// The data of `struct ipcache_key` after its `bpf_lpm_trie_key` header:
/// cluster 0, the family, the address. Its prefix length counts the 32
/// bits of cluster_id, pad1 and family too (Cilium's
/// IPCACHE_PREFIX_LEN).
pub fn ipcache_data(family: u8, addr: &[u8]) -> [u8; 20] {
    let mut d = [0u8; 20];
    d[3] = family;
    d[4..4 + addr.len()].copy_from_slice(addr);
    d
}

/// `struct remote_endpoint_info`.
pub fn endpoint_info(identity: u32, tunnel: Ipv4Addr, has_tunnel: bool) -> [u8; 12] {
    let mut v = [0u8; 12];
    v[0..4].copy_from_slice(&identity.to_le_bytes());
    v[4..8].copy_from_slice(&tunnel.octets());
    v[11] = u8::from(has_tunnel) << 1;
    v
}

/// `struct datarec` of CPU `cpu`: `cpu + 1` packets of 100 bytes.
pub fn datarec(cpu: usize) -> [u8; 16] {
    let mut v = [0u8; 16];
    v[0..8].copy_from_slice(&(cpu as u64 + 1).to_le_bytes());
    v[8..16].copy_from_slice(&((cpu as u64 + 1) * 100).to_le_bytes());
    v
}

pub fn cpus() -> usize {
    bpfmap_kernel::possible_cpus() as usize
}

/// Compiles and loads bpf/networking.bpf.c as a loader does (the object's
/// BTF with the maps, pinned by name under `root`, a bpffs), fills every
/// map with the entries of this module, and pins the global data sections.
pub fn load(root: &Path) -> Loaded {
    let build = tempfile::tempdir().unwrap();
    let object = crate::compile_bpf_object("networking.bpf.c", build.path());
    let pins = root.join("tc/globals");
    std::fs::create_dir_all(&pins).unwrap();
    let mut ebpf = aya::EbpfLoader::new()
        .default_map_pin_directory(&pins)
        .load(&object)
        .unwrap_or_else(|e| panic!("loading the object: {e}"));
    let mut ct4: aya::maps::HashMap<_, [u8; 14], [u8; 56]> =
        aya::maps::HashMap::try_from(ebpf.map_mut("cilium_ct4_global").unwrap()).unwrap();
    ct4.insert(ct4_key(), ct_entry(), 0).unwrap();
    let mut ct6: aya::maps::HashMap<_, [u8; 38], [u8; 56]> =
        aya::maps::HashMap::try_from(ebpf.map_mut("cilium_ct6_global").unwrap()).unwrap();
    ct6.insert(ct6_key(), ct_entry(), 0).unwrap();
    let mut services: aya::maps::HashMap<_, [u8; 12], [u8; 12]> =
        aya::maps::HashMap::try_from(ebpf.map_mut("cilium_lb4_services_v2").unwrap()).unwrap();
    services.insert(lb4_key(), lb4_service(), 0).unwrap();
    let mut backends: aya::maps::HashMap<_, u32, [u8; 12]> =
        aya::maps::HashMap::try_from(ebpf.map_mut("cilium_lb4_backends_v3").unwrap()).unwrap();
    backends.insert(1, lb4_backend(), 0).unwrap();
    let mut ipcache: aya::maps::LpmTrie<_, [u8; 20], [u8; 12]> =
        aya::maps::LpmTrie::try_from(ebpf.map_mut("cilium_ipcache").unwrap()).unwrap();
    let v4 = ipcache_data(AF_INET, &Ipv4Addr::new(10, 0, 0, 0).octets());
    let v6 = ipcache_data(AF_INET6, &"fe80::".parse::<Ipv6Addr>().unwrap().octets());
    let tunnel = Ipv4Addr::new(192, 168, 1, 10);
    ipcache
        .insert(
            &aya::maps::lpm_trie::Key::new(32 + 24, v4),
            endpoint_info(1234, tunnel, true),
            0,
        )
        .unwrap();
    ipcache
        .insert(
            &aya::maps::lpm_trie::Key::new(32 + 64, v6),
            endpoint_info(5678, Ipv4Addr::UNSPECIFIED, false),
            0,
        )
        .unwrap();
    let mut stats: aya::maps::PerCpuArray<_, [u8; 16]> =
        aya::maps::PerCpuArray::try_from(ebpf.map_mut("xdp_stats_map").unwrap()).unwrap();
    let per_cpu: Vec<[u8; 16]> = (0..cpus()).map(datarec).collect();
    stats
        .set(2, aya::maps::PerCpuValues::try_from(per_cpu).unwrap(), 0)
        .unwrap();

    // aya makes the global data maps without pinning them: pinned here.
    std::fs::create_dir_all(root.join("globals")).unwrap();
    for (section, rel) in [(".bss", BSS), (".data", DATA)] {
        ebpf.map(section)
            .unwrap_or_else(|| panic!("aya made no map of {section}"))
            .pin(root.join(rel))
            .unwrap_or_else(|e| panic!("pinning {section}: {e}"));
    }
    let globals = libbpf_globals(root, &object);
    Loaded { ebpf, globals }
}

/// The `.bss` and `.data` maps as libbpf makes them: the object's BTF
/// (fixed up as loaders fix it: the sections' sizes and the variables'
/// offsets) loaded into the kernel, each section an array of one entry
/// whose value type is the section's DATASEC and whose key has no type.
/// `.bss` gets packets_seen = 1000 and drops = 3; `.data` keeps its
/// initial contents.
fn libbpf_globals(root: &Path, object: &[u8]) -> (OwnedBtf, OwnedMap, OwnedMap) {
    use aya_obj::btf::{BtfFeatures, BtfKind};
    let mut obj = aya_obj::Object::parse(object).expect("the object parses");
    let data = obj.maps[".data"].data().to_vec();
    let features = BtfFeatures::new(true, true, true, true, true, true, true, true);
    let btf = obj
        .fixup_and_sanitize_btf(&features)
        .expect("the object's BTF fixes up")
        .expect("the object has BTF");
    let id = |section: &str| {
        btf.id_by_type_name_kind(section, BtfKind::DataSec)
            .unwrap_or_else(|e| panic!("no DATASEC {section}: {e}"))
    };
    let (bss_id, data_id) = (id(".bss"), id(".data"));
    let loaded = OwnedBtf::load(&btf.to_bytes()).unwrap_or_else(|e| panic!("BPF_BTF_LOAD: {e}"));
    let section = |name: &str, value_type: u32, value_size: u32| {
        crate::create_map_with(&CreateMap {
            map_type: MapType::ARRAY.0,
            key_size: 4,
            value_size,
            max_entries: 1,
            name,
            btf: Some(loaded.for_map(0, value_type)),
            ..Default::default()
        })
    };
    let bss = section(".bss", bss_id, 12);
    let mut value = [0u8; 12];
    value[0..8].copy_from_slice(&1000u64.to_le_bytes());
    value[8..12].copy_from_slice(&3u32.to_le_bytes());
    crate::update(&bss, &0u32.to_le_bytes(), &value);
    pin(&bss, &root.join(BSS_TYPED));
    let data_map = section(".data", data_id, data.len() as u32);
    crate::update(&data_map, &0u32.to_le_bytes(), &data);
    pin(&data_map, &root.join(DATA_TYPED));
    (loaded, bss, data_map)
}

fn pin(map: &OwnedMap, path: &Path) {
    map.pin(path)
        .unwrap_or_else(|e| panic!("cannot pin {}: {e}", path.display()));
}
