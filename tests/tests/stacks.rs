//! Maps of counts keyed by stack ids read as stacks: libbpf-tools'
//! offcputime while a program of our own sleeps in a function of its own
//! (its frames and the kernel's named), bpftrace's @[kstack], folded as
//! flame graphs read them, through the library, bpfmapctl and grpcurl; the
//! policy's `symbolize`; the errors that say what to give.

use std::{collections::BTreeSet, path::Path, time::Duration};

use bpfmap_client::{Aggregate, Client, ClientTls, ConnectOptions, MapName, StackOptions, pb};
use bpfmap_kernel::{BtfBuilder, BtfMember as M, CreateMap, IntEncoding as E, OwnedBtf};
use bpfmap_tests::{
    pki::{Name, Pki, Validity},
    programs::*,
    *,
};
use bpfmapd::{Config, Operation, RuleConfig};
use serde_json::json;
use tonic::Code;

/// tests/c/sleeper.c compiled with its symbols and frame pointers into
/// `dir`.
fn sleeper(dir: &Path) -> std::path::PathBuf {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("c/sleeper.c");
    let bin = dir.join("bpfmap-sleeper");
    let clang = std::env::var("CLANG").unwrap_or_else(|_| "clang".into());
    let out = std::process::Command::new(&clang)
        .args(["-O0", "-g", "-fno-omit-frame-pointer", "-o"])
        .arg(&bin)
        .arg(&src)
        .output()
        .unwrap_or_else(|e| {
            panic!("cannot run {clang} ({e}): apt-get install clang (.ci/run does)")
        });
    assert!(
        out.status.success(),
        "clang failed on {}:\n{}",
        src.display(),
        String::from_utf8_lossy(&out.stderr)
    );
    bin
}

/// Every function /proc/kallsyms names.
fn kernel_functions() -> BTreeSet<String> {
    std::fs::read_to_string("/proc/kallsyms")
        .expect("/proc/kallsyms")
        .lines()
        .filter_map(|l| l.split_whitespace().nth(2).map(str::to_owned))
        .collect()
}

fn names(frames: &[pb::Frame]) -> Vec<&str> {
    frames.iter().map(|f| f.function.as_str()).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn offcputime_stacks_name_our_functions_and_the_kernels() {
    let offcputime = require("offcputime", "libbpf-tools");
    mount_tracefs();
    let build = tempfile::tempdir().unwrap();
    let bin = sleeper(build.path());
    let mut sleeping = Program::start(&bin, &[], &[]);
    let pid = sleeping.pid();
    let tool = Program::start(&offcputime, &["-p", &pid.to_string(), "60"], &[]);
    let (fs, state) = (BpfFs::new(), tempfile::tempdir().unwrap());
    let daemon = Daemon::start_with(Config {
        allow_by_id: true,
        ..Daemon::config(fs.path(), state.path())
    })
    .await;
    let client = daemon.client().await;
    let map: MapName = format!("name:info@{}", tool.pid()).parse().unwrap();
    let options = StackOptions::default()
        .with_roots(["value.comm"])
        .with_filter(format!("key.tgid == {pid}"));
    // offcputime counts a sleep once the sleeper runs again.
    let stacks = wait_for(
        Duration::from_secs(30),
        "offcputime to count the sleeper",
        async || {
            let s = client.stacks(&map, options.clone()).await.ok()?;
            s.stacks.iter().any(|s| !s.user.is_empty()).then_some(s)
        },
    )
    .await;
    sleeping.check_running();
    assert_eq!(
        stacks.ids,
        Some(pb::StackIds {
            kernel: "key.kern_stack_id".into(),
            user: "key.user_stack_id".into(),
            pid: "key.tgid".into(),
            bpftrace: false,
        })
    );
    assert!(stacks.stack_map.starts_with("id:"), "{}", stacks.stack_map);
    let s = stacks.stacks.iter().find(|s| !s.user.is_empty()).unwrap();
    assert_eq!(s.roots, ["bpfmap-sleeper"]);
    assert_eq!(s.pid, pid);
    // Its own frames, outermost first, in its binary.
    let user = names(&s.user);
    let at = |f: &str| {
        user.iter()
            .position(|n| *n == f)
            .unwrap_or_else(|| panic!("{f} not in {user:?}"))
    };
    assert!(
        at("main") < at("bpfmap_test_loop") && at("bpfmap_test_loop") < at("bpfmap_test_wait_here"),
        "{user:?}"
    );
    let own = &s.user[at("bpfmap_test_wait_here")];
    assert!(own.module.ends_with("bpfmap-sleeper"), "{own:?}");
    // The kernel's: from the system call's entry to schedule, each a
    // function the kernel has.
    let kernel = names(&s.kernel);
    let known = kernel_functions();
    for f in &kernel {
        assert!(
            known.contains(*f),
            "{f} is not in /proc/kallsyms: {kernel:?}"
        );
    }
    assert!(kernel[0].starts_with("entry_SYSCALL_64"), "{kernel:?}");
    assert!(kernel.contains(&"schedule"), "{kernel:?}");
    assert!(kernel.iter().any(|f| f.contains("nanosleep")), "{kernel:?}");
    assert!(
        s.kernel
            .iter()
            .all(|f| f.module == "[kernel]" || f.module == "[bpf]")
    );
    // The weight: offcputime's delta summed, no more than bpftool reads
    // after.
    let weight: u128 = s.value.parse().unwrap();
    assert!(weight > 0);
    // Folded by bpfmapctl as flamegraph.pl reads it.
    let (r, out, err) = ctl(&[
        "--addr",
        &daemon.addr(),
        "stacks",
        &map.to_string(),
        "--root",
        "value.comm",
        "--filter",
        &format!("key.tgid == {pid} && key.user_stack_id >= 0"),
    ])
    .await;
    assert!(r.is_ok(), "{r:?} {err}");
    let line = out.lines().next().expect("a folded stack");
    assert!(
        line.starts_with("bpfmap-sleeper;")
            && line.contains(";main;bpfmap_test_loop;bpfmap_test_wait_here;entry_SYSCALL_64"),
        "{line}"
    );
    assert!(line.contains(";schedule_[k];"), "{line}");
    let (folded, value) = line.rsplit_once(' ').unwrap();
    assert!(
        value.parse::<u64>().is_ok() && !folded.contains(' '),
        "{line}"
    );
    pprof_and_svg_of(&daemon, &map.to_string(), pid).await;
    // Addresses only: the same stacks, nothing named.
    let bare = client
        .stacks(&map, options.clone().with_addresses_only())
        .await
        .unwrap();
    assert!(bare.stacks.iter().all(|s| {
        s.user
            .iter()
            .chain(&s.kernel)
            .all(|f| f.function.is_empty() && f.address != 0)
    }));
    drop((tool, sleeping));
    drop(client);
    daemon.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bpftrace_kstack_counts_read_as_named_kernel_stacks() {
    let bpftrace = require("bpftrace", "bpftrace");
    mount_tracefs();
    let program = Program::start(
        &bpftrace,
        &[
            "-e",
            "tracepoint:sched:sched_switch { @ks[kstack] = count(); @pids[pid] = count(); }",
        ],
        &[],
    );
    let (fs, state) = (BpfFs::new(), tempfile::tempdir().unwrap());
    let daemon = Daemon::start_with(Config {
        allow_by_id: true,
        ..Daemon::config(fs.path(), state.path())
    })
    .await;
    let client = daemon.client().await;
    let name = format!("name:AT_ks@{}", program.pid());
    let map: MapName = name.parse().unwrap();
    wait_for(Duration::from_secs(30), "bpftrace's @ks", async || {
        client.get_map(&map).await.ok()
    })
    .await;
    // A map keyed by something else is not read as stacks: the message
    // says how to declare the ids.
    let pids: MapName = format!("name:AT_pids@{}", program.pid()).parse().unwrap();
    let e = client
        .stacks(&pids, StackOptions::default())
        .await
        .unwrap_err();
    assert_eq!(code_of(&e), Code::InvalidArgument);
    assert!(e.to_string().contains("--kernel-id key --bpftrace"), "{e}");
    // The daemon reads @ks[kstack] in bpftrace's script: no declaration.
    let info = client.get_map(&map).await.unwrap();
    let script = info.as_proto().bpftrace.clone().unwrap();
    assert_eq!(
        (
            script.function.as_str(),
            script.key.as_str(),
            script.key_type.as_str(),
            script.script.as_str()
        ),
        ("count", "kstack", "__u64", "-e")
    );
    let stacks = wait_for(Duration::from_secs(30), "bpftrace to count", async || {
        let s = client.stacks(&map, StackOptions::default()).await.ok()?;
        (!s.stacks.is_empty()).then_some(s)
    })
    .await;
    // Declared as before, the same stacks.
    let declared = client
        .stacks(&map, StackOptions::default().with_ids("key", "", "", true))
        .await
        .unwrap();
    assert!(!declared.stacks.is_empty());
    let known = kernel_functions();
    let top = &stacks.stacks[0];
    let kernel = names(&top.kernel);
    assert!(
        !kernel.is_empty() && kernel.iter().all(|f| known.contains(*f)),
        "{kernel:?}"
    );
    assert!(kernel.iter().any(|f| f.contains("schedule")), "{kernel:?}");
    // The counts: summed over the CPUs, every stack's at most its total
    // after, and the stacks ordered.
    let values: Vec<u128> = stacks
        .stacks
        .iter()
        .map(|s| s.value.parse().unwrap())
        .collect();
    assert!(values.windows(2).all(|w| w[0] >= w[1]), "{values:?}");
    // The stack-trace map itself: each stack once, with its id.
    let stack_map: MapName = format!("name:stack@{}", program.pid()).parse().unwrap();
    let itself = client
        .stacks(&stack_map, StackOptions::default())
        .await
        .unwrap();
    assert!(!itself.stacks.is_empty());
    let ids: BTreeSet<i64> = itself.stacks.iter().map(|s| s.stack_id).collect();
    assert_eq!(ids.len(), itself.stacks.len());
    for s in &itself.stacks {
        assert!(s.stack_id >= 0 && s.value == "1", "{s:?}");
        let kernel = names(&s.kernel);
        assert!(
            !kernel.is_empty() && kernel.iter().all(|f| known.contains(*f)),
            "{kernel:?}"
        );
    }
    // grpcurl: the same call by hand.
    let body = json!({"map": {"name": name.strip_prefix("name:").unwrap()}, "ids": {"kernel": "key", "bpftrace": true}, "limit": 1});
    let (ok, out, err) = grpcurl(
        &["-plaintext", "-d", &body.to_string()],
        &daemon.running.local_addr().to_string(),
        &["bpfmap.v1.MapService/StackMap"],
    )
    .await;
    assert!(ok, "{err}");
    let answer = &json_stream(&out)[0];
    assert_eq!(answer["stacks"].as_array().unwrap().len(), 1, "{out}");
    assert_eq!(
        answer["stacks"][0]["kernel"][0]["module"], "[kernel]",
        "{out}"
    );
    assert!(answer["stackMap"].as_str().unwrap().starts_with("id:"));
    drop(program);
    drop(client);
    daemon.stop().await;
}

/// A counts map keyed as offcputime keys it, typed, and an empty
/// stack-trace map, pinned at `counts` and `stacks`.
fn offcputime_like(fs: &BpfFs, weights: [u64; 2]) -> (OwnedMap, OwnedMap) {
    let mut b = BtfBuilder::new();
    let u32_ = b.add_int("unsigned int", 4, E::Unsigned);
    let s32 = b.add_int("int", 4, E::Signed);
    let u64_ = b.add_int("unsigned long long", 8, E::Unsigned);
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
    let btf = OwnedBtf::load(&b.to_bytes()).unwrap_or_else(|e| panic!("BPF_BTF_LOAD: {e}"));
    let counts = OwnedMap::create(&CreateMap {
        map_type: MapType::HASH.0,
        key_size: 16,
        value_size: 8,
        max_entries: 16,
        name: "counts",
        btf: Some(btf.for_map(key, u64_)),
        ..Default::default()
    })
    .unwrap_or_else(|e| panic!("BPF_MAP_CREATE with BTF: {e}"));
    for (pid, user, kern, n) in [(7u32, -14i32, 3i32, weights[0]), (8, -1, -17, weights[1])] {
        let mut k = Vec::new();
        for v in [
            pid.to_le_bytes(),
            pid.to_le_bytes(),
            user.to_le_bytes(),
            kern.to_le_bytes(),
        ] {
            k.extend_from_slice(&v);
        }
        update(&counts, &k, &n.to_le_bytes());
    }
    fs.pin(&counts, "counts");
    let stacks = create_map(MapType::STACK_TRACE, 4, 127 * 8, 16);
    fs.pin(&stacks, "stacks");
    (counts, stacks)
}

#[tokio::test]
async fn naming_frames_is_its_own_permission_and_stack_maps_are_named_or_found() {
    const WHO: &str = "spiffe://example.org/perf/carol";
    let fs = BpfFs::new();
    let state = tempfile::tempdir().unwrap();
    let pki = Pki::new();
    let rules = vec![RuleConfig {
        identities: vec![WHO.into()],
        maps: vec!["**".into()],
        operations: vec![Operation::List, Operation::Dump],
    }];
    let daemon = Daemon::start_with(Config {
        tls: Some(pki.server_files()),
        rules,
        ..Daemon::config(fs.path(), state.path())
    })
    .await;
    let _maps = offcputime_like(&fs, [5, 2]);
    let tls: ClientTls = pki.client("carol", Name::Spiffe(WHO), Validity::Now);
    let client = Client::connect(&daemon.tls_addr(), ConnectOptions::default().with_tls(tls))
        .await
        .unwrap();
    let map: MapName = "counts".parse().unwrap();
    let named = StackOptions::default().with_stack_map("stacks".parse().unwrap());
    // `dump` implies `aggregate`, never `symbolize`.
    let e = client.stacks(&map, named.clone()).await.unwrap_err();
    assert_eq!(code_of(&e), Code::PermissionDenied);
    assert!(
        e.to_string()
            .contains(&format!("{WHO} may not name the stack frames of counts")),
        "{e}"
    );
    // Addresses need no more: lost stacks said as such.
    let bare = client
        .stacks(
            &map,
            named
                .clone()
                .with_addresses_only()
                .with_by(Aggregate::sum("value")),
        )
        .await
        .unwrap();
    assert_eq!(bare.stack_map, "stacks");
    let lost: Vec<(i32, i32, &str)> = bare
        .stacks
        .iter()
        .map(|s| (s.user_lost, s.kernel_lost, s.value.as_str()))
        .collect();
    assert_eq!(
        lost,
        [
            (
                pb::LostStack::NoStack as i32,
                pb::LostStack::Other as i32,
                "5"
            ),
            (
                pb::LostStack::NoStack as i32,
                pb::LostStack::Eexist as i32,
                "2"
            ),
        ]
    );
    // A stack map that is not one, and none to find (no program uses it).
    let e = client
        .stacks(
            &map,
            StackOptions::default()
                .with_stack_map("counts".parse().unwrap())
                .with_addresses_only(),
        )
        .await
        .unwrap_err();
    assert_eq!(
        (code_of(&e), reason_of(&e).as_str()),
        (Code::FailedPrecondition, "NO_STACK_MAP")
    );
    assert!(e.to_string().contains("not a stack-trace map"), "{e}");
    let e = client
        .stacks(&map, StackOptions::default().with_addresses_only())
        .await
        .unwrap_err();
    assert_eq!(code_of(&e), Code::FailedPrecondition);
    assert!(
        e.to_string().contains("name the stack map in stack_map"),
        "{e}"
    );
    daemon.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stacks_merge_over_the_targets_directly_and_through_the_relay() {
    let (mut daemons, mut keep) = (Vec::new(), Vec::new());
    for i in 0..3u64 {
        let (fs, state, daemon, _client) = setup().await;
        keep.push((offcputime_like(&fs, [5 + i, 2]), fs, state));
        daemons.push(daemon);
    }
    let targets: Vec<String> = daemons
        .iter()
        .map(|d| d.running.local_addr().to_string())
        .collect();
    let mut args: Vec<&str> = Vec::new();
    for t in &targets {
        args.extend(["-t", t.as_str()]);
    }
    let stacks = ["stacks", "counts", "--stack-map", "stacks", "--addresses"];
    let mut cmd = args.clone();
    cmd.extend(["--format", "json"]);
    cmd.extend(stacks);
    let (r, out, err) = ctl(&cmd).await;
    assert!(r.is_ok(), "{r:?} {err}");
    let lines = json_lines(&out);
    let seen: Vec<(&str, &str, &str)> = lines
        .iter()
        .map(|l| {
            (
                l["value"].as_str().unwrap(),
                l["user_lost"].as_str().unwrap(),
                l["kernel_lost"].as_str().unwrap(),
            )
        })
        .collect();
    assert_eq!(
        seen,
        [("18", "NO_STACK", "OTHER"), ("6", "NO_STACK", "EEXIST")]
    );
    // Folded: a dropped kernel stack as bcc writes it.
    let mut cmd = args.clone();
    cmd.extend(stacks);
    let (r, out, _) = ctl(&cmd).await;
    assert!(r.is_ok());
    assert_eq!(
        out.lines().collect::<Vec<_>>(),
        ["[Missed Kernel Stack] 18", "[Missed Kernel Stack] 6"]
    );
    // Through the relay, with a dead target named.
    let dead = format!(
        "127.0.0.1:{}",
        bpfmap_tests::fleet::port_free_on(&["127.0.0.1".parse().unwrap()])
    );
    let mut all = targets.clone();
    all.push(dead.clone());
    let relay_state = tempfile::tempdir().unwrap();
    let relay = bpfmap_relay::Relay::start_on(
        &bpfmap_relay::Config {
            targets: all,
            state_dir: relay_state.path().to_owned(),
            answer_timeout: Duration::from_secs(2),
            ..Default::default()
        },
        tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap(),
    )
    .await
    .expect("the relay starts");
    let relay_addr = format!("http://{}", relay.local_addr());
    let mut cmd = vec!["--relay", relay_addr.as_str()];
    cmd.extend(stacks);
    let (r, out, err) = ctl(&cmd).await;
    assert!(
        r.unwrap_err().to_string().contains("1 of 4 targets"),
        "{err}"
    );
    assert!(err.contains(&dead), "{err}");
    assert_eq!(
        out.lines().collect::<Vec<_>>(),
        ["[Missed Kernel Stack] 18", "[Missed Kernel Stack] 6"]
    );
    let body = json!({"request": {"map": {"path": "counts"}, "stackMap": {"path": "stacks"}, "addressesOnly": true}});
    let (ok, out, err) = grpcurl(
        &["-plaintext", "-d", &body.to_string()],
        &relay.local_addr().to_string(),
        &["bpfmap.v1.FleetService/StackMap"],
    )
    .await;
    assert!(ok, "{err}");
    let answer = &json_stream(&out)[0];
    assert_eq!(answer["stacks"][0]["value"], "18", "{out}");
    assert_eq!(answer["stacks"][1]["kernelLost"], "LOST_STACK_EEXIST");
    assert_eq!(answer["answered"].as_array().unwrap().len(), 3);
    assert_eq!(answer["failed"][0]["target"], json!(dead));
    relay.stop().await.unwrap();
    for d in daemons {
        d.stop().await;
    }
}

/// The sleeper's stacks as a pprof profile read back by the protobuf
/// package with pprof's profile.proto, and as an SVG flame graph.
async fn pprof_and_svg_of(daemon: &Daemon, map: &str, pid: u32) {
    let addr = daemon.addr();
    let dir = tempfile::tempdir().unwrap();
    let profile = dir.path().join("offcpu.pb.gz");
    let filter = format!("key.tgid == {pid} && key.user_stack_id >= 0");
    let common = [
        "stacks",
        map,
        "--root",
        "value.comm",
        "--filter",
        &filter,
        "--unit",
        "microseconds",
    ];
    let mut cmd = vec!["--addr", &addr, "--format", "pprof"];
    cmd.extend(common);
    cmd.extend(["-o", profile.to_str().unwrap()]);
    let (r, _, err) = ctl(&cmd).await;
    assert!(r.is_ok(), "{r:?} {err}");
    let python = std::env::var("BPFMAP_PYTHON_GRPC").unwrap_or_else(|_| "python3".into());
    let here = concat!(env!("CARGO_MANIFEST_DIR"), "/python");
    let out = std::process::Command::new(&python)
        .args(["-m", "grpc_tools.protoc", "-I", here])
        .arg(format!("--python_out={}", dir.path().display()))
        .arg(format!("{here}/profile.proto"))
        .output()
        .unwrap_or_else(|e| panic!("cannot run {python} ({e}): set $BPFMAP_PYTHON_GRPC to a Python with grpcio-tools (.ci/run does)"));
    assert!(
        out.status.success(),
        "protoc (needs grpcio-tools): {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let out = std::process::Command::new(&python)
        .arg(format!("{here}/pprof_read.py"))
        .arg(dir.path())
        .arg(&profile)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let read: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(read["sample_type"], json!([["weight", "microseconds"]]));
    let sample = &read["samples"][0];
    let frames: Vec<&str> = sample["frames"]
        .as_array()
        .unwrap()
        .iter()
        .map(|f| f.as_str().unwrap())
        .collect();
    // Leaf first: the kernel's innermost frames, ours, the root last.
    let at = |f: &str| {
        frames
            .iter()
            .position(|n| *n == f)
            .unwrap_or_else(|| panic!("{f} not in {frames:?}"))
    };
    assert!(at("schedule") < at("bpfmap_test_wait_here"), "{frames:?}");
    assert!(
        at("bpfmap_test_wait_here") < at("bpfmap_test_loop") && at("bpfmap_test_loop") < at("main"),
        "{frames:?}"
    );
    assert_eq!(frames.last(), Some(&"bpfmap-sleeper"));
    assert!(sample["value"][0].as_i64().unwrap() > 0);
    assert!(
        read["modules"]
            .as_array()
            .unwrap()
            .iter()
            .any(|m| m == "[kernel]"),
        "{read}"
    );
    // A flame graph, drawn.
    let svg = dir.path().join("offcpu.svg");
    let mut cmd = vec!["--addr", &addr, "--format", "svg"];
    cmd.extend(common);
    cmd.extend(["-o", svg.to_str().unwrap()]);
    let (r, _, err) = ctl(&cmd).await;
    assert!(r.is_ok(), "{r:?} {err}");
    let drawn = std::fs::read_to_string(&svg).unwrap();
    assert!(
        drawn.starts_with("<?xml") && drawn.contains("<svg"),
        "{}",
        &drawn[..200.min(drawn.len())]
    );
    assert!(
        drawn.contains("<title>bpfmap_test_wait_here (") && drawn.contains("<title>schedule (")
    );
}

/// The GNU build ID note of an ELF file, in hex.
fn build_id_of(bin: &Path) -> String {
    let bytes = std::fs::read(bin).unwrap();
    // namesz 4, descsz 20, type NT_GNU_BUILD_ID (3), "GNU\0".
    let note: [u8; 16] = [4, 0, 0, 0, 20, 0, 0, 0, 3, 0, 0, 0, b'G', b'N', b'U', 0];
    let at = bytes
        .windows(16)
        .position(|w| w == note)
        .unwrap_or_else(|| panic!("{} has no GNU build ID", bin.display()));
    bytes[at + 16..at + 36]
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// The sleeper's user frames of the heaviest stack, innermost last.
fn sleeper_frames(stacks: &bpfmap_client::Stacks) -> Vec<&pb::Frame> {
    stacks.stacks[0]
        .user
        .iter()
        .filter(|f| f.function.starts_with("bpfmap_test") || f.function == "main")
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn frames_are_named_after_the_process_exits_from_its_binaries_and_build_ids() {
    use aya::programs::RawTracePoint;
    let build = tempfile::tempdir().unwrap();
    let bin = sleeper(build.path());
    let build_id = build_id_of(&bin);
    let sleeping = Program::start(&bin, &[], &[]);
    let pid = sleeping.pid();
    let object = compile_bpf_object("build_id_stacks.bpf.c", build.path());
    let (fs, state) = (BpfFs::new(), tempfile::tempdir().unwrap());
    // The counts maps pinned by name in the daemon's root.
    let mut ebpf = aya::EbpfLoader::new()
        .override_global("target_tgid", &pid, true)
        .default_map_pin_directory(fs.path())
        .load(&object)
        .unwrap_or_else(|e| panic!("loading build_id_stacks.bpf.c: {e}"));
    for name in ["on_enter", "on_enter_plain"] {
        let p: &mut RawTracePoint = ebpf.program_mut(name).unwrap().try_into().unwrap();
        p.load().unwrap();
        p.attach("sys_enter").unwrap();
    }
    let config = || Config {
        allow_by_id: true,
        ..Daemon::config(fs.path(), state.path())
    };
    let daemon = Daemon::start_with(config()).await;
    let client = daemon.client().await;
    let (by_id, plain): (MapName, MapName) =
        ("counts".parse().unwrap(), "plain_counts".parse().unwrap());
    let named = async |client: &Client, map: &MapName| {
        wait_for(
            Duration::from_secs(30),
            "the sleeper's stacks",
            async || {
                let s = client.stacks(map, StackOptions::default()).await;
                match &s {
                    Err(e) => eprintln!("DEBUG {e}"),
                    Ok(s) => eprintln!("DEBUG {:?} {:?}", s.summary, s.notes),
                }
                let s = s.ok()?;
                (!s.stacks.is_empty()).then_some(s)
            },
        )
        .await
    };
    let expected = ["main", "bpfmap_test_loop", "bpfmap_test_wait_here"];
    // Kept by build ID: no addresses, the sleeper's binary found by its
    // build ID among the running processes'.
    let s = named(&client, &by_id).await;
    assert!(s.stack_map.starts_with("id:"), "{}", s.stack_map);
    let frames = sleeper_frames(&s);
    assert_eq!(
        frames
            .iter()
            .map(|f| f.function.as_str())
            .collect::<Vec<_>>(),
        expected,
        "{:?}",
        s.stacks[0]
    );
    // Named: no build ID needed, the offset in the binary kept.
    for f in &frames {
        assert_eq!(
            (f.address, f.build_id.as_str(), f.module.as_str()),
            (0, "", bin.to_str().unwrap()),
            "{f:?}"
        );
        assert!(f.file_offset > 0, "{f:?}");
    }
    // By address, while it runs: the same functions, each with its offset
    // in its binary.
    let live = named(&client, &plain).await;
    let live_frames = sleeper_frames(&live);
    assert_eq!(
        live_frames
            .iter()
            .map(|f| f.function.as_str())
            .collect::<Vec<_>>(),
        expected
    );
    for (f, g) in live_frames.iter().zip(&frames) {
        assert!(f.address != 0, "{f:?}");
        assert_eq!(f.file_offset, g.file_offset, "{f:?}");
    }
    // The process exits and its binary is deleted: both maps still name
    // its frames, from the binary the daemon holds since it saw it.
    drop(sleeping);
    std::fs::remove_file(&bin).unwrap();
    let after = client
        .stacks(&plain, StackOptions::default())
        .await
        .unwrap();
    assert_eq!(
        sleeper_frames(&after)
            .iter()
            .map(|f| (f.function.as_str(), f.address))
            .collect::<Vec<_>>(),
        live_frames
            .iter()
            .map(|f| (f.function.as_str(), f.address))
            .collect::<Vec<_>>()
    );
    assert!(
        after
            .notes
            .iter()
            .any(|n| n.contains("were named from the binaries they mapped")
                && n.contains(&pid.to_string())),
        "{:?}",
        after.notes
    );
    let after = client
        .stacks(&by_id, StackOptions::default())
        .await
        .unwrap();
    assert_eq!(
        sleeper_frames(&after)
            .iter()
            .map(|f| f.function.as_str())
            .collect::<Vec<_>>(),
        expected
    );
    // A daemon that never saw the process: addresses, and offsets in a
    // build ID nothing maps, each said.
    drop(client);
    daemon.stop().await;
    let fresh = Daemon::start_with(config()).await;
    let client = fresh.client().await;
    let s = client
        .stacks(&plain, StackOptions::default())
        .await
        .unwrap();
    assert!(sleeper_frames(&s).is_empty(), "{:?}", s.stacks[0]);
    assert!(
        s.notes
            .iter()
            .any(|n| n.contains("exited before their stacks were read")),
        "{:?}",
        s.notes
    );
    let s = client
        .stacks(&by_id, StackOptions::default())
        .await
        .unwrap();
    // Its own frames are offsets in its binary (libc's are named: other
    // processes map it).
    let own: Vec<&pb::Frame> = s.stacks[0]
        .user
        .iter()
        .filter(|f| f.build_id == build_id)
        .collect();
    assert_eq!(own.len(), 3, "{:?}", s.stacks[0].user);
    assert!(
        own.iter()
            .all(|f| f.function.is_empty() && f.file_offset > 0),
        "{own:?}"
    );
    assert!(
        s.notes
            .iter()
            .any(|n| n.contains(&format!("frames of build ID {build_id} are offsets"))),
        "{:?}",
        s.notes
    );
    // Folded, such a frame is its build ID and offset.
    let folded = bpfmap_client::stack_folding::folded_line(&s.stacks[0]);
    assert!(folded.contains(&format!("{build_id}+0x")), "{folded}");
    drop(client);
    fresh.stop().await;
}
