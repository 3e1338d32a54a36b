//! What reading stacks costs. libbpf-tools' offcputime, run while the host
//! is busy, fills a real stack-trace map; then:
//!
//! - StackMap on its counts with frames named, cold (the daemon's first
//!   call: kernel symbols and binaries read) and warm (the next ones),
//!   against the same call with addresses only;
//! - a counts map of 100,000 entries over those stacks (offcputime's key
//!   and value types) drawn by bpfmapctl as a whole process, folded and as
//!   an SVG flame graph, against the kernel's batched walk of that map in
//!   the same run (the floor);
//! - the bytes three daemons send for the stacks of that map, against the
//!   relay's merged answer;
//! - over 100,000 distinct stacks: tests/c/tree.c walks every path of a
//!   binary tree of calls 17 deep, two functions a level (131,072 user
//!   stacks distinct by name, each under the
//!   kernel stack of its getppid(2)), counted by a program of our own
//!   (tests/bpf/stack_tree.bpf.c) into a stack-trace map of 2^19 entries;
//!   StackMap named cold (a daemon of its own, its first call) and warm,
//!   against addresses only, and `bpfmapctl stacks` folded as a process.
//!
//! Run as root:
//!
//!     cargo bench -p bpfmap-tests --bench stacks
//!     cargo bench -p bpfmap-tests --bench stacks -- distinct   # the last part alone
//!
//! Figures: tests/docs/performance.md, "Stacks".

use std::{
    path::Path,
    time::{Duration, Instant},
};

use bpfmap_client::{MapName, StackOptions, pb};
use bpfmap_kernel::{
    BtfBuilder, BtfMember as M, CreateMap, IntEncoding as E, MapHandle, OwnedBtf,
    walk::{Position, Walker},
};
use bpfmap_tests::{programs::*, *};
use prost::Message as _;

const N: u32 = 100_000;
const RUNS: usize = 5;

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

/// Work that puts many tasks off the CPU in many ways, for `secs`.
fn busy(secs: u64) {
    let until = Instant::now() + Duration::from_secs(secs);
    let mut children = Vec::new();
    for script in [
        "while :; do find /usr -xdev -type f > /dev/null 2>&1; done",
        "while :; do tar cf - /usr/share/doc 2>/dev/null | cat > /dev/null; done",
        "while :; do ls -R /proc/self > /dev/null 2>&1; sleep 0.01; done",
        "while :; do dd if=/dev/zero bs=64k count=64 2>/dev/null | gzip -1 > /dev/null; done",
    ] {
        children.push(
            std::process::Command::new("sh")
                .args(["-c", script])
                .spawn()
                .expect("sh"),
        );
    }
    std::thread::sleep(until.saturating_duration_since(Instant::now()));
    for mut c in children {
        let _ = std::process::Command::new("pkill")
            .args(["-P", &c.id().to_string()])
            .status();
        let _ = c.kill();
        let _ = c.wait();
    }
}

/// A counts map of `N` entries keyed as offcputime keys its own, each
/// (tgid, user id, kernel id) one of `stacks` in turn, pinned at `rel`.
fn counts_map(fs: &BpfFs, rel: &str, stacks: &[(u32, i32, i32)]) -> OwnedMap {
    let mut b = BtfBuilder::new();
    let u32_ = b.add_int("unsigned int", 4, E::Unsigned);
    let s32 = b.add_int("int", 4, E::Signed);
    let u64_ = b.add_int("unsigned long long", 8, E::Unsigned);
    let char_ = b.add_int("char", 1, E::Signed);
    let comm = b.add_array(char_, 16);
    let key = b.add_struct(
        "key_t",
        16,
        &[
            M::new("pid", u32_, 0),
            M::new("tgid", u32_, 32),
            M::new("user_stack_id", s32, 64),
            M::new("kern_stack_id", s32, 96),
        ],
    );
    let value = b.add_struct(
        "val_t",
        24,
        &[M::new("delta", u64_, 0), M::new("comm", comm, 64)],
    );
    let btf = OwnedBtf::load(&b.to_bytes()).unwrap_or_else(|e| panic!("BPF_BTF_LOAD: {e}"));
    let map = OwnedMap::create(&CreateMap {
        map_type: MapType::HASH.0,
        key_size: 16,
        value_size: 24,
        max_entries: N,
        name: "counts",
        btf: Some(btf.for_map(key, value)),
        ..Default::default()
    })
    .unwrap_or_else(|e| panic!("BPF_MAP_CREATE with BTF: {e}"));
    let (mut keys, mut values) = (Vec::new(), Vec::new());
    for i in 0..N {
        let (tgid, user, kern) = stacks[i as usize % stacks.len()];
        keys.extend_from_slice(&(1_000_000 + i).to_le_bytes());
        keys.extend_from_slice(&tgid.to_le_bytes());
        keys.extend_from_slice(&user.to_le_bytes());
        keys.extend_from_slice(&kern.to_le_bytes());
        values.extend_from_slice(&u64::from(i % 1000 + 1).to_le_bytes());
        let mut comm = [0u8; 16];
        comm[..5].copy_from_slice(b"bench");
        values.extend_from_slice(&comm);
    }
    update_batch(&map, &keys, &values);
    fs.pin(&map, rel);
    map
}

/// The kernel's batched walk of the map at `path`.
fn floor(path: &Path) -> Duration {
    let t = Instant::now();
    let handle = MapHandle::open_pinned(path).unwrap();
    let meta = handle.meta().clone();
    let mut w = Walker::new(handle, meta, Position::Start).unwrap();
    let mut n = 0u64;
    while let Some(c) = w.next_chunk(4096).unwrap() {
        n += c.count as u64;
    }
    assert_eq!(n, u64::from(N));
    t.elapsed()
}

/// bpfmapctl as a process: `args` after the daemon's address, its time.
fn ctl(addr: &str, args: &[&str]) -> Duration {
    let t = Instant::now();
    let out = std::process::Command::new(ctl_bin!())
        .args(["--addr", addr])
        .args(args)
        .output()
        .expect("bpfmapctl runs");
    let took = t.elapsed();
    assert!(
        out.status.success(),
        "bpfmapctl {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    took
}

/// Distinct addresses of `stacks`: (kernel, user).
fn addresses(stacks: &[pb::Stack]) -> (usize, usize) {
    let set = |f: fn(&pb::Stack) -> &Vec<pb::Frame>| {
        stacks
            .iter()
            .flat_map(|s| f(s).iter().map(|fr| fr.address))
            .collect::<std::collections::BTreeSet<u64>>()
            .len()
    };
    (set(|s| &s.kernel), set(|s| &s.user))
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    // `-- distinct`: only the part over 100,000 distinct stacks.
    if std::env::args().any(|a| a == "distinct") {
        distinct_stacks().await;
        return;
    }
    let offcputime = require("offcputime", "libbpf-tools");
    mount_tracefs();
    let tool = Program::start(&offcputime, &["--stack-storage-size", "65536", "120"], &[]);
    let (fs, state) = (BpfFs::new(), tempfile::tempdir().unwrap());
    let daemon = Daemon::start_with(bpfmapd::Config {
        allow_by_id: true,
        ..Daemon::config(fs.path(), state.path())
    })
    .await;
    let client = daemon.client().await;
    let info: MapName = format!("name:info@{}", tool.pid()).parse().unwrap();
    wait_for(Duration::from_secs(30), "offcputime's maps", async || {
        client.get_map(&info).await.ok()
    })
    .await;
    tokio::task::spawn_blocking(|| busy(8)).await.unwrap();
    let named = StackOptions::default().with_roots(["value.comm"]);
    let bare = named.clone().with_addresses_only();
    // Cold: the daemon's first names.
    let t = Instant::now();
    let cold = client.stacks(&info, named.clone()).await.unwrap();
    let cold_t = t.elapsed();
    let mut warm_t = Vec::new();
    let mut bare_t = Vec::new();
    for _ in 0..RUNS {
        let t = Instant::now();
        client.stacks(&info, named.clone()).await.unwrap();
        warm_t.push(t.elapsed());
        let t = Instant::now();
        client.stacks(&info, bare.clone()).await.unwrap();
        bare_t.push(t.elapsed());
    }
    let (k, u) = addresses(&cold.stacks);
    let entries = cold.summary.as_ref().map_or(0, |s| s.entries_scanned());
    println!(
        "offcputime: {entries} entries, {} stacks, {k} kernel and {u} user addresses, {} notes",
        cold.stacks.len(),
        cold.notes.len()
    );
    let (bare_ms, warm_ms) = (ms(median(bare_t)), ms(median(warm_t)));
    println!(
        "StackMap named cold {:.1} ms, warm {warm_ms:.1} ms, addresses only {bare_ms:.1} ms (warm {:.2}x, cold {:.2}x the addresses)",
        ms(cold_t),
        warm_ms / bare_ms,
        ms(cold_t) / bare_ms
    );
    // The (tgid, user id, kernel id) of offcputime's stacks, for a map of
    // N entries over them.
    let ids = tokio::task::spawn_blocking({
        let id = cold.stack_map.clone();
        move || stack_ids(&id)
    })
    .await
    .unwrap();
    let triples = triples(&client, &info).await;
    println!(
        "{} stack ids in {}, {} distinct keys",
        ids,
        cold.stack_map,
        triples.len()
    );
    let _counts = counts_map(&fs, "bench/counts", &triples);
    let path = fs.path().join("bench/counts");
    let addr = daemon.addr();
    let out = tempfile::tempdir().unwrap();
    let svg = out.path().join("f.svg");
    let folded_args = [
        "stacks",
        "bench/counts",
        "--stack-map",
        &cold.stack_map,
        "--root",
        "value.comm",
        "-o",
        "/dev/null",
    ];
    let mut svg_args = vec!["--format", "svg"];
    svg_args.extend(&folded_args[..6]);
    svg_args.extend(["-o", svg.to_str().unwrap()]);
    let (mut f, mut fo, mut sv) = (Vec::new(), Vec::new(), Vec::new());
    for _ in 0..RUNS {
        f.push(
            tokio::task::spawn_blocking({
                let path = path.clone();
                move || floor(&path)
            })
            .await
            .unwrap(),
        );
        let (a, args) = (addr.clone(), folded_args.map(str::to_owned));
        fo.push(
            tokio::task::spawn_blocking(move || {
                ctl(&a, &args.iter().map(String::as_str).collect::<Vec<_>>())
            })
            .await
            .unwrap(),
        );
        let (a, args): (String, Vec<String>) = (
            addr.clone(),
            svg_args.iter().map(|s| s.to_string()).collect(),
        );
        sv.push(
            tokio::task::spawn_blocking(move || {
                ctl(&a, &args.iter().map(String::as_str).collect::<Vec<_>>())
            })
            .await
            .unwrap(),
        );
    }
    let (f, fo, sv) = (ms(median(f)), ms(median(fo)), ms(median(sv)));
    println!(
        "{N} entries: batched walk {f:.1} ms; bpfmapctl stacks folded {fo:.1} ms ({:.2}x), svg {sv:.1} ms ({:.2}x)",
        fo / f,
        sv / f
    );
    fleet_bytes(&daemon, &cold.stack_map).await;
    drop(tool);
    drop(client);
    daemon.stop().await;
    distinct_stacks().await;
}

/// StackMap over more than 100,000 distinct stacks of one process.
async fn distinct_stacks() {
    use aya::programs::RawTracePoint;
    let build = tempfile::tempdir().unwrap();
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("c/tree.c");
    let bin = build.path().join("bpfmap-tree");
    let clang = std::env::var("CLANG").unwrap_or_else(|_| "clang".into());
    let built = std::process::Command::new(&clang)
        .args(["-O0", "-g", "-fno-omit-frame-pointer", "-o"])
        .arg(&bin)
        .arg(&src)
        .status()
        .unwrap_or_else(|e| panic!("cannot run {clang} ({e}): apt-get install clang"));
    assert!(built.success(), "clang failed on {}", src.display());
    let object = compile_bpf_object("stack_tree.bpf.c", build.path());
    let (fs, state) = (BpfFs::new(), tempfile::tempdir().unwrap());
    let mut ebpf = aya::EbpfLoader::new()
        .map_max_entries("stacks", 1 << 19)
        .default_map_pin_directory(fs.path())
        .load(&object)
        .unwrap_or_else(|e| panic!("loading stack_tree.bpf.c: {e}"));
    let p: &mut RawTracePoint = ebpf.program_mut("on_enter").unwrap().try_into().unwrap();
    p.load().unwrap();
    p.attach("sys_enter").unwrap();
    let mut tree = Program::start(&bin, &[], &[]);
    let t = Instant::now();
    while !tree.output().contains("walked") {
        tree.check_running();
        assert!(
            t.elapsed() < Duration::from_secs(120),
            "tree.c did not walk its tree"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    // 131,072 groups (stacks): over the default limits.max_groups.
    let mut config = bpfmapd::Config {
        allow_by_id: true,
        ..Daemon::config(fs.path(), state.path())
    };
    config.limits.max_groups = 1 << 20;
    let daemon = Daemon::start_with(config).await;
    let client = daemon.client().await;
    let counts: MapName = "counts".parse().unwrap();
    let named = StackOptions::default();
    let bare = named.clone().with_addresses_only();
    let t = Instant::now();
    let cold = client.stacks(&counts, named.clone()).await.unwrap();
    let cold_t = t.elapsed();
    let (mut warm_t, mut bare_t) = (Vec::new(), Vec::new());
    for _ in 0..RUNS {
        let t = Instant::now();
        client.stacks(&counts, named.clone()).await.unwrap();
        warm_t.push(t.elapsed());
        let t = Instant::now();
        client.stacks(&counts, bare.clone()).await.unwrap();
        bare_t.push(t.elapsed());
    }
    let user_named = cold
        .stacks
        .iter()
        .filter(|s| s.user.iter().any(|f| f.function == "bpfmap_tree_leaf"))
        .count();
    let (k, u) = addresses(&cold.stacks);
    let entries = cold.summary.as_ref().map_or(0, |s| s.entries_scanned());
    println!(
        "tree.c: {entries} entries ({} lost stacks: the stack map's hash collisions), {} distinct stacks, {user_named} named down to bpfmap_tree_leaf; {k} kernel and {u} user addresses",
        cold.stacks
            .iter()
            .filter(|s| s.user_lost != 0 || s.kernel_lost != 0)
            .count(),
        cold.stacks.len()
    );
    let (bare_ms, warm_ms) = (ms(median(bare_t)), ms(median(warm_t)));
    println!(
        "StackMap over them named cold {:.1} ms, warm {warm_ms:.1} ms, addresses only {bare_ms:.1} ms (warm {:.2}x, cold {:.2}x the addresses); {:.2} us a stack warm",
        ms(cold_t),
        warm_ms / bare_ms,
        ms(cold_t) / bare_ms,
        warm_ms * 1e3 / cold.stacks.len().max(1) as f64
    );
    let addr = daemon.addr();
    let mut fo = Vec::new();
    for _ in 0..RUNS {
        let a = addr.clone();
        fo.push(
            tokio::task::spawn_blocking(move || {
                ctl(&a, &["stacks", "counts", "-n", "0", "-o", "/dev/null"])
            })
            .await
            .unwrap(),
        );
    }
    println!(
        "bpfmapctl stacks counts (folded, every stack) {:.1} ms",
        ms(median(fo))
    );
    drop(tree);
    drop(client);
    daemon.stop().await;
}

/// How many stacks the stack-trace map `id` ("id:N") holds.
fn stack_ids(id: &str) -> usize {
    let id: u32 = id.trim_start_matches("id:").parse().unwrap();
    let handle = MapHandle::open_id(id).unwrap();
    let meta = handle.meta().clone();
    let mut w = Walker::new(handle, meta, Position::Start).unwrap();
    let mut n = 0;
    while let Some(c) = w.next_chunk(1024).unwrap() {
        n += c.count;
    }
    n
}

/// offcputime's distinct (tgid, user id, kernel id).
async fn triples(client: &bpfmap_client::Client, info: &MapName) -> Vec<(u32, i32, i32)> {
    let options = bpfmap_client::AggregateOptions::default()
        .with_group_by(["key.tgid", "key.user_stack_id", "key.kern_stack_id"])
        .with_aggregates([bpfmap_client::Aggregate::count()])
        .with_limit(0);
    let answer = client.aggregate(info, options).await.unwrap();
    answer
        .groups()
        .iter()
        .map(|g| {
            let int = |p: &str| {
                g.key()[p].kind.as_ref().map_or(0, |k| match k {
                    prost_types::value::Kind::NumberValue(n) => *n as i64,
                    _ => 0,
                })
            };
            (
                int("key.tgid") as u32,
                int("key.user_stack_id") as i32,
                int("key.kern_stack_id") as i32,
            )
        })
        .collect()
}

/// Three daemons' answers for the counts map against the relay's merge of
/// them: bytes of the messages (as protobuf encodes them).
async fn fleet_bytes(first: &Daemon, stack_map: &str) {
    let mut others = Vec::new();
    for _ in 0..2 {
        let state = tempfile::tempdir().unwrap();
        let d = Daemon::start_with(bpfmapd::Config {
            allow_by_id: true,
            ..Daemon::config(&first.config.roots[0], state.path())
        })
        .await;
        others.push((d, state));
    }
    let mut targets = vec![first.running.local_addr().to_string()];
    targets.extend(
        others
            .iter()
            .map(|(d, _)| d.running.local_addr().to_string()),
    );
    let request = pb::StackMapRequest {
        map: map_ref("bench/counts"),
        stack_map: Some(pb::MapRef {
            r#ref: Some(pb::map_ref::Ref::Id(
                stack_map.trim_start_matches("id:").parse().unwrap(),
            )),
            declare: None,
        }),
        roots: vec!["value.comm".into()],
        ..Default::default()
    };
    let mut sent = 0usize;
    for t in &targets {
        let mut g = grpc(&format!("http://{t}")).await;
        sent += g
            .stack_map(request.clone())
            .await
            .unwrap()
            .into_inner()
            .encoded_len();
    }
    let relay_state = tempfile::tempdir().unwrap();
    let relay = bpfmap_relay::Relay::start_on(
        &bpfmap_relay::Config {
            targets: targets.clone(),
            state_dir: relay_state.path().to_owned(),
            answer_timeout: Duration::from_secs(30),
            ..Default::default()
        },
        tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap(),
    )
    .await
    .unwrap();
    let mut fleet = pb::fleet_service_client::FleetServiceClient::connect(format!(
        "http://{}",
        relay.local_addr()
    ))
    .await
    .unwrap()
    .max_decoding_message_size(256 << 20);
    let merged = fleet
        .stack_map(pb::FleetServiceStackMapRequest {
            request: Some(request),
            targets: None,
        })
        .await
        .unwrap()
        .into_inner();
    println!(
        "3 hosts: their answers {} KiB, the relay's merge {} KiB ({} stacks): {:.2}x less",
        sent / 1024,
        merged.encoded_len() / 1024,
        merged.stacks.len(),
        sent as f64 / merged.encoded_len() as f64
    );
    relay.stop().await.unwrap();
    for (d, _) in others {
        d.stop().await;
    }
}
