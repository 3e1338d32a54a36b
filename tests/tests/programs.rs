//! The maps of programs this project did not write, as Debian ships them:
//! xdp-filter (xdp-tools) on a veth, libbpf-tools' syscount and runqlat,
//! a bpftrace one-liner. Found by name and owner, read right (addresses,
//! ports in network order, command names), checked against bpftool and
//! the tools' own state, through grpcurl, the library and bpfmapctl.

use std::{collections::BTreeMap, time::Duration};

use bpfmap_client::{Client, DumpOptions, ListMapsOptions, MapInfo, MapName, WatchOptions};
use bpfmap_tests::{ctl_bin, programs::*, *};
use serde_json::{Value as Json, json};
use tonic::Code;

/// Every map `pid` holds, by kernel name (waits until it holds `names`).
async fn maps_of(client: &Client, pid: u32, names: &[&str]) -> BTreeMap<String, MapInfo> {
    let owner = ListMapsOptions::default().with_owner(pid.to_string());
    wait_for(
        Duration::from_secs(30),
        "the program's maps and programs",
        async || {
            let maps = client.list_maps_with(&owner).await.ok()?;
            let by_name: BTreeMap<String, MapInfo> =
                maps.into_iter().map(|m| (m.name().to_owned(), m)).collect();
            // Held by the process, and used by its programs once they are
            // loaded (the tool opens its maps first).
            names
                .iter()
                .all(|n| by_name.get(*n).is_some_and(|m| !m.programs().is_empty()))
                .then_some(by_name)
        },
    )
    .await
}

/// How many processes run with command name `comm`.
fn processes_named(comm: &str) -> usize {
    std::fs::read_dir("/proc")
        .unwrap()
        .flatten()
        .filter(|e| {
            std::fs::read_to_string(e.path().join("comm")).is_ok_and(|c| c.trim_end() == comm)
        })
        .count()
}

/// The sum over the CPUs of the u64 values of a bpftool `map dump` entry.
fn bpftool_sum(entry: &Json) -> u64 {
    let values = entry["values"].as_array().expect("per-CPU values");
    values.iter().map(|v| hex_u64(&v["value"])).sum()
}

/// A little-endian u64 from bpftool's list of hex bytes.
fn hex_u64(bytes: &Json) -> u64 {
    let bytes: Vec<u8> = bytes
        .as_array()
        .expect("bytes")
        .iter()
        .map(|b| u8::from_str_radix(b.as_str().unwrap().trim_start_matches("0x"), 16).unwrap())
        .collect();
    let mut le = [0u8; 8];
    le[..bytes.len().min(8)].copy_from_slice(&bytes[..bytes.len().min(8)]);
    u64::from_le_bytes(le)
}

/// The text of a NUL-padded command name from bpftool's hex bytes.
fn hex_comm(bytes: &Json) -> String {
    let bytes: Vec<u8> = bytes
        .as_array()
        .expect("bytes")
        .iter()
        .map(|b| u8::from_str_radix(b.as_str().unwrap().trim_start_matches("0x"), 16).unwrap())
        .take_while(|b| *b != 0)
        .collect();
    String::from_utf8_lossy(&bytes).into_owned()
}

/// A daemon on a private bpffs that reaches every map (libbpf-tools and
/// bpftrace do not pin theirs).
async fn daemon_by_id(fs: &BpfFs, state: &std::path::Path) -> Daemon {
    Daemon::start_with(bpfmapd::Config {
        allow_by_id: true,
        ..Daemon::config(fs.path(), state)
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bpftrace_counts_by_command_come_from_one_top() {
    let bpftrace = require("bpftrace", "bpftrace");
    mount_tracefs();
    let mut program = Program::start(
        &bpftrace,
        &[
            "-e",
            "tracepoint:raw_syscalls:sys_enter { @[comm] = count(); }",
        ],
        &[],
    );
    let (fs, state) = (BpfFs::new(), tempfile::tempdir().unwrap());
    let daemon = daemon_by_id(&fs, state.path()).await;
    let client = daemon.client().await;
    let maps = maps_of(&client, program.pid(), &["AT_"]).await;
    program.check_running();
    let at = &maps["AT_"];
    assert_eq!(
        (at.type_name(), at.key_size(), at.value_size()),
        ("percpu_hash", 16, 8)
    );
    assert_eq!(at.owners()[0].comm, "bpftrace");
    assert!(
        at.types().unwrap().is_none(),
        "bpftrace's maps carry no types"
    );
    let name = format!("name:AT_@{}", program.pid());
    // What bpftool says first; counts only grow after.
    let counts = || -> BTreeMap<String, u64> {
        bpftool(&["map", "dump", "id", &at.id().to_string()])
            .as_array()
            .unwrap()
            .iter()
            .map(|e| (hex_comm(&e["key"]), bpftool_sum(e)))
            .collect()
    };
    let before = counts();
    assert!(before.contains_key("bpftrace"), "{before:?}");
    // The top commands by count: one `top`, per-CPU counts summed, the
    // comm shown as text.
    let (r, out, err) = ctl(&[
        "--addr",
        &daemon.addr(),
        "top",
        &name,
        "--by",
        "sum(value)",
        "--group-by",
        "key",
        "--render",
        "key=string",
        "-n",
        "5",
    ])
    .await;
    assert!(r.is_ok(), "{err}");
    // Every command name bpftool saw, before and after: a key shown any
    // other way (hex) is none of them.
    let mut comms: std::collections::BTreeSet<String> = before.keys().cloned().collect();
    comms.extend(counts().into_keys());
    let top = json_lines(&out);
    assert_eq!(top.len(), 5.min(before.len()), "{out}");
    for line in &top {
        let comm = line["key"]["key"].as_str().expect("a command name");
        assert!(
            comms.contains(comm),
            "{comm:?} is not a command bpftool saw: {comms:?}"
        );
        let count: u64 = line["values"]["sum(value)"]
            .as_str()
            .unwrap()
            .parse()
            .unwrap();
        if let Some(earlier) = before.get(comm) {
            assert!(count >= *earlier, "{comm}: {count} < bpftool's {earlier}");
        }
    }
    let counts: Vec<u64> = top
        .iter()
        .map(|l| l["values"]["sum(value)"].as_str().unwrap().parse().unwrap())
        .collect();
    assert!(counts.windows(2).all(|w| w[0] >= w[1]), "{counts:?}");
    bpftrace_through_grpcurl_and_the_library(&daemon, &client, &name, &comms).await;
    drop(program);
    daemon.stop().await;
}

/// The same map through grpcurl (AggregateMap by name, the key rendered
/// as text) and the library (declared types).
async fn bpftrace_through_grpcurl_and_the_library(
    daemon: &Daemon,
    client: &Client,
    name: &str,
    comms: &std::collections::BTreeSet<String>,
) {
    let host = daemon.running.local_addr().to_string();
    let by_name = name.strip_prefix("name:").unwrap();
    let body = json!({
        "map": {"name": by_name},
        "groupBy": ["key"],
        "aggregates": [{"op": "SUM", "field": "value"}],
        "render": {"key": "string"},
        "limit": 3,
    });
    let (ok, out, err) = grpcurl(
        &["-plaintext", "-d", &body.to_string()],
        &host,
        &["bpfmap.v1.MapService/AggregateMap"],
    )
    .await;
    assert!(ok, "{err}");
    let groups = &json_stream(&out)[0]["groups"];
    assert_eq!(groups.as_array().unwrap().len(), 3, "{out}");
    // Command names bpftool sees now, after the call.
    let mut comms = comms.clone();
    let id = client.get_map(&name.parse().unwrap()).await.unwrap().id();
    for e in bpftool(&["map", "dump", "id", &id.to_string()])
        .as_array()
        .unwrap()
    {
        comms.insert(hex_comm(&e["key"]));
    }
    for g in groups.as_array().unwrap() {
        let comm = g["key"]["key"].as_str().unwrap_or_default();
        assert!(
            comms.contains(comm),
            "{comm:?} is not a command bpftool saw: {out}"
        );
    }
    // Declared in C, the map is typed for every call: a filter on the
    // command name, its count summed over the CPUs.
    let map: MapName = name
        .parse::<MapName>()
        .unwrap()
        .with_types("char[16]", "__u64");
    let info = client.get_map(&map).await.unwrap();
    assert!(info.as_proto().types_declared);
    let options = DumpOptions::default()
        .with_filter(r#"key == "bpftrace""#)
        .with_per_cpu(bpfmap_client::PerCpu::Sum);
    let mut dump = client.dump(&map, options);
    let mut found = Vec::new();
    while let Some(chunk) = dump.next_chunk().await.unwrap() {
        for e in &chunk {
            found.push(e.key.to_vec());
        }
    }
    let mut want = b"bpftrace".to_vec();
    want.resize(16, 0);
    assert_eq!(found, [want]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn libbpf_tools_maps_are_found_by_name_and_owner() {
    let (syscount, runqlat) = (
        require("syscount", "libbpf-tools"),
        require("runqlat", "libbpf-tools"),
    );
    mount_tracefs();
    let mut sc = Program::start(&syscount, &["-d", "120"], &[]);
    let mut rq = Program::start(&runqlat, &["60", "2"], &[]);
    let (fs, state) = (BpfFs::new(), tempfile::tempdir().unwrap());
    let daemon = daemon_by_id(&fs, state.path()).await;
    let client = daemon.client().await;
    let sc_maps = maps_of(&client, sc.pid(), &["start", "data"]).await;
    let rq_maps = maps_of(&client, rq.pid(), &["start", "hists"]).await;
    sc.check_running();
    rq.check_running();
    // Two tools name a map "start": the name alone is refused, naming
    // both by id and owner.
    let e = client
        .get_map(&"name:start".parse().unwrap())
        .await
        .unwrap_err();
    assert_eq!(
        (code_of(&e), reason_of(&e).as_str()),
        (Code::FailedPrecondition, "MAP_NAME_AMBIGUOUS")
    );
    for (maps, pid, comm) in [
        (&sc_maps, sc.pid(), "syscount"),
        (&rq_maps, rq.pid(), "runqlat"),
    ] {
        let id = maps["start"].id();
        assert!(
            e.to_string().contains(&format!("id:{id} ("))
                && e.to_string().contains(&format!("{comm}[{pid}]")),
            "{e}"
        );
        // With its owner, by pid, and by process name unless another copy
        // of the tool runs on this host.
        let mut owners = vec![pid.to_string()];
        if processes_named(comm) == 1 {
            owners.push(comm.to_owned());
        }
        for owner in owners {
            let info = client
                .get_map(&format!("name:start@{owner}").parse().unwrap())
                .await
                .unwrap_or_else(|e| panic!("name:start@{owner}: {e}"));
            assert_eq!(info.id(), id);
        }
        let info = client
            .get_map(&format!("name:start@{pid}").parse().unwrap())
            .await
            .unwrap();
        assert_eq!(
            info.owners()
                .iter()
                .map(|o| (o.pid, o.comm.as_str()))
                .collect::<Vec<_>>(),
            [(pid, comm)]
        );
        assert!(!info.programs().is_empty(), "{:?}", info.as_proto());
        assert!(info.memlock().is_some_and(|m| m > 0));
    }
    // A name that is none says which is close.
    let e = client
        .get_map(&format!("name:hist@{}", rq.pid()).parse().unwrap())
        .await
        .unwrap_err();
    assert_eq!(code_of(&e), Code::NotFound);
    assert!(e.to_string().contains(r#"close: "hists" (id:"#), "{e}");
    syscount_counts_match_bpftool(&client, &sc_maps["data"], sc.pid()).await;
    runqlat_watch_sorts_its_slots(&daemon, &rq_maps["hists"], rq.pid()).await;
    list_narrows_by_name_type_and_owner(&daemon, sc.pid()).await;
    daemon.stop().await;
}

/// syscount's `data` (syscall number -> count, total time, comm), typed by
/// its BTF: every count at least bpftool's, read before.
async fn syscount_counts_match_bpftool(client: &Client, data: &MapInfo, pid: u32) {
    let before: BTreeMap<u64, u64> = bpftool(&["map", "dump", "id", &data.id().to_string()])
        .as_array()
        .unwrap()
        .iter()
        .map(|e| {
            let f = &e["formatted"];
            (
                f["key"].as_u64().unwrap(),
                f["value"]["count"].as_u64().unwrap(),
            )
        })
        .collect();
    assert!(!before.is_empty());
    let map: MapName = format!("name:data@{pid}").parse().unwrap();
    let types = client
        .get_map(&map)
        .await
        .unwrap()
        .types()
        .unwrap()
        .expect("typed by BTF");
    let mut dump = client.dump(&map, DumpOptions::default());
    let mut seen = 0;
    while let Some(chunk) = dump.next_chunk().await.unwrap() {
        for e in &chunk {
            let key = json_of(&types.decode_key(e.key));
            let value = json_of(&types.decode_value(e.value));
            let count: u64 = value["count"].as_str().unwrap().parse().unwrap();
            if let Some(earlier) = before.get(&key.as_u64().unwrap()) {
                assert!(count >= *earlier, "syscall {key}: {count} < {earlier}");
                seen += 1;
            }
            assert!(value["comm"].is_string(), "{value}");
        }
    }
    assert_eq!(
        seen,
        before.len(),
        "every syscall bpftool saw is still there"
    );
}

/// runqlat's `hists` watched with bpfmapctl: deltas only of the slots
/// that changed, in their natural order (slots[2] before slots[10]).
async fn runqlat_watch_sorts_its_slots(daemon: &Daemon, hists: &MapInfo, pid: u32) {
    assert_eq!(hists.type_name(), "hash");
    let addr = daemon.running.local_addr().to_string();
    let name = format!("name:hists@{pid}");
    let out = tokio::task::spawn_blocking(move || {
        let out = std::process::Command::new("timeout")
            .arg("5")
            .arg(ctl_bin!())
            .args(["--target", &addr, "watch", &name, "--interval", "1s"])
            .output()
            .unwrap();
        String::from_utf8(out.stdout).unwrap()
    })
    .await
    .unwrap();
    let changed: Vec<&str> = out
        .lines()
        .filter(|l| l.contains(r#""deltas":{"#))
        .collect();
    assert!(!changed.is_empty(), "no slot changed in 4 scans: {out}");
    for line in changed {
        let e: Json = serde_json::from_str(line).unwrap();
        let deltas = e["deltas"].as_object().unwrap();
        assert!(
            deltas.values().all(|d| d != "0"),
            "zero deltas are left out: {line}"
        );
        // The order as printed.
        let text = &line[line.find(r#""deltas":{"#).unwrap() + 10..];
        let text = &text[..text.find('}').unwrap()];
        let slots: Vec<u32> = text
            .split(',')
            .map(|kv| {
                let path = kv.split(':').next().unwrap().trim_matches('"');
                let n = path
                    .strip_prefix("value.slots[")
                    .and_then(|r| r.strip_suffix(']'));
                n.unwrap_or_else(|| panic!("{path}")).parse().unwrap()
            })
            .collect();
        assert!(slots.windows(2).all(|w| w[0] < w[1]), "{line}");
    }
}

/// ListMaps narrowed by name glob, type and owner.
async fn list_narrows_by_name_type_and_owner(daemon: &Daemon, pid: u32) {
    let (r, out, err) = ctl(&[
        "--addr",
        &daemon.addr(),
        "list",
        "--owner",
        &pid.to_string(),
        "--type",
        "hash",
        "--name",
        "st*",
    ])
    .await;
    assert!(r.is_ok(), "{err}");
    let lines = json_lines(&out);
    assert_eq!(lines.len(), 1, "{out}");
    assert_eq!(
        (lines[0]["name"].as_str(), lines[0]["type"].as_str()),
        (Some("start"), Some("hash"))
    );
    assert_eq!(lines[0]["owners"][0]["pid"], json!(pid));
    let (r, _, err) = ctl(&["--addr", &daemon.addr(), "list", "--type", "hashes"]).await;
    assert!(r.is_err());
    assert!(
        err.contains(r#"type \"hashes\" is not a map type"#),
        "{err}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn xdp_filter_maps_read_addresses_and_ports_as_written() {
    let xdp_filter = require("xdp-filter", "xdp-tools");
    let net = VethPair::new("xf");
    let fs = BpfFs::new();
    net.exec(&net.a, fs.path(), &xdp_filter, &["load", "va", "-m", "skb"]);
    net.exec(&net.a, fs.path(), &xdp_filter, &["ip", "10.0.0.1"]);
    net.exec(&net.a, fs.path(), &xdp_filter, &["port", "443"]);
    let state = tempfile::tempdir().unwrap();
    let daemon = Daemon::start(fs.path(), state.path()).await;
    let client = daemon.client().await;
    // Found by name among the pins, with the program that uses it.
    let info = client
        .get_map(&"name:filter_ipv4".parse().unwrap())
        .await
        .unwrap();
    assert_eq!(info.path(), Some("xdp-filter/filter_ipv4"));
    assert_eq!(info.pins(), ["xdp-filter/filter_ipv4"]);
    assert!(
        info.programs().iter().any(|p| p.r#type == "xdp"),
        "{:?}",
        info.programs()
    );
    xdp_filter_address_and_port(&daemon).await;
    xdp_stats_deltas_of_anonymous_unions(&daemon, &net).await;
    net.exec(&net.a, fs.path(), &xdp_filter, &["unload", "va"]);
    daemon.stop().await;
}

/// 10.0.0.1 in filter_ipv4 (network-order bytes in a __u32) and port 443 in
/// filter_ports (indexed by the network-order port, 47873).
async fn xdp_filter_address_and_port(daemon: &Daemon) {
    // The library: the key in its rendered spelling, the bytes as written.
    let client = daemon.client().await;
    let options = bpfmap_client::LookupOptions::default().with_render([("key", "ipv4")]);
    let found = client
        .lookup(
            &"name:filter_ipv4@xdpfilt_alw_all".parse().unwrap(),
            [bpfmap_client::Key::Json("10.0.0.1".into())],
            options,
        )
        .await
        .unwrap();
    assert!(found[0].found());
    assert_eq!(found[0].key(), [10, 0, 0, 1]);
    assert_eq!(json_of(found[0].decoded_key().unwrap()), json!("10.0.0.1"));
    let host = daemon.running.local_addr().to_string();
    let body = r#"{"map":{"path":"xdp-filter/filter_ipv4"},"jsonKeys":["10.0.0.1"],"render":{"key":"ipv4"},"perCpu":"PER_CPU_SUM"}"#;
    let (ok, out, err) = grpcurl(
        &["-plaintext", "-d", body],
        &host,
        &["bpfmap.v1.MapService/Lookup"],
    )
    .await;
    assert!(ok, "{err}");
    let result = &json_stream(&out)[0]["results"][0];
    assert_eq!(
        (&result["found"], &result["decodedKey"]),
        (&json!(true), &json!("10.0.0.1")),
        "{out}"
    );
    let (r, out, err) = ctl(&[
        "--addr",
        &daemon.addr(),
        "lookup",
        "xdp-filter/filter_ipv4",
        r#""10.0.0.1""#,
        "--render",
        "key=ipv4",
    ])
    .await;
    assert!(r.is_ok(), "{err}");
    assert_eq!(json_lines(&out)[0]["found"], json!(true), "{out}");
    // The one port set, shown as 443 with be16, found by a filter on the
    // rendered number; bpftool's key of it is 47873 (0xbb01).
    let (r, out, err) = ctl(&[
        "--addr",
        &daemon.addr(),
        "--per-cpu",
        "sum",
        "dump",
        "xdp-filter/filter_ports",
        "--render",
        "key=be16",
        "--filter",
        "value != 0",
    ])
    .await;
    assert!(r.is_ok(), "{err}");
    let lines = json_lines(&out);
    assert_eq!(lines.len(), 1, "{out}");
    assert_eq!(lines[0]["key"], json!(443));
    let (r, out, err) = ctl(&[
        "--addr",
        &daemon.addr(),
        "--per-cpu",
        "sum",
        "lookup",
        "xdp-filter/filter_ports",
        "47873",
    ])
    .await;
    assert!(r.is_ok(), "{err}");
    assert_eq!(
        (&json_lines(&out)[0]["key"], &json_lines(&out)[0]["found"]),
        (&json!(47873), &json!(true)),
        "{out}"
    );
}

/// xdp_stats_map's record is two anonymous unions (packets/rx_packets,
/// bytes/rx_bytes): a watch gives deltas of each member, and per-CPU sums
/// equal bpftool's.
async fn xdp_stats_deltas_of_anonymous_unions(daemon: &Daemon, net: &VethPair) {
    let client = daemon.client().await;
    let map: MapName = "xdp-filter/xdp_stats_map".parse().unwrap();
    let mut watch = client.watch(
        &map,
        WatchOptions::default().with_interval(Duration::from_secs(1)),
    );
    // UDP datagrams from the other end (bash's /dev/udp: no tool needed).
    let pinger = Program::start(
        std::path::Path::new("ip"),
        &[
            "netns",
            "exec",
            &net.b,
            "bash",
            "-c",
            "for i in $(seq 200); do echo x >/dev/udp/10.201.0.1/9; sleep 0.1; done",
        ],
        &[],
    );
    let changed = wait_for(
        Duration::from_secs(20),
        "a CHANGED event of XDP_PASS",
        async || {
            let scan = watch.next_scan().await.ok()?;
            scan.events()
                .iter()
                .find(|e| e.delta.contains_key("value.rx_packets"))
                .cloned()
        },
    )
    .await;
    drop(pinger);
    assert_eq!(
        changed.delta.get("value.packets"),
        changed.delta.get("value.rx_packets")
    );
    assert_eq!(
        changed.delta.get("value.bytes"),
        changed.delta.get("value.rx_bytes")
    );
    // Sums over the CPUs equal bpftool's, once the datagrams stopped (a
    // stray packet between the two reads is retried).
    let pin = daemon.config.roots[0].join("xdp-filter/xdp_stats_map");
    let pin = pin.to_str().unwrap();
    let mut last = None;
    for _ in 0..10 {
        tokio::time::sleep(Duration::from_millis(300)).await;
        let entries =
            dump_entries(&client, "xdp-filter/xdp_stats_map", DumpOptions::default()).await;
        let ours: BTreeMap<u32, u64> = entries
            .iter()
            .map(|e| {
                let bpfmap_client::Value::PerCpu(cpus) = &e.value else {
                    panic!("per-CPU")
                };
                let packets = cpus
                    .iter()
                    .map(|v| u64::from_le_bytes(v[..8].try_into().unwrap()));
                (
                    u32::from_le_bytes(e.key[..4].try_into().unwrap()),
                    packets.sum(),
                )
            })
            .collect();
        let theirs: BTreeMap<u32, u64> = bpftool(&["map", "dump", "pinned", pin])
            .as_array()
            .unwrap()
            .iter()
            .map(|e| (hex_u64(&e["key"]) as u32, bpftool_sum(e)))
            .collect();
        if ours == theirs {
            assert!(ours[&2] > 0, "XDP_PASS counted the datagrams: {ours:?}");
            return;
        }
        last = Some((ours, theirs));
    }
    panic!("per-CPU sums differ from bpftool's: {last:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn syscount_and_runqlat_maps_become_metrics_with_configuration_alone() {
    use bpfmapd::{Buckets, ExportConfig, ExportKind, LabelNames};
    let (syscount, runqlat) = (
        require("syscount", "libbpf-tools"),
        require("runqlat", "libbpf-tools"),
    );
    mount_tracefs();
    let mut sc = Program::start(&syscount, &["-d", "120"], &[]);
    let mut rq = Program::start(&runqlat, &["60", "2"], &[]);
    let mut calls = ExportConfig::new(
        format!("name:data@{}", sc.pid()),
        "syscount_calls_total",
        ExportKind::Counter,
    );
    calls.value = Some("value.count".into());
    calls.labels = vec!["syscall=key".into()];
    calls.names = [("key".to_owned(), LabelNames::Host("syscall".into()))].into();
    calls.min_interval = Duration::from_millis(200);
    let mut latency = ExportConfig::new(
        format!("name:hists@{}", rq.pid()),
        "runq_latency_usecs",
        ExportKind::Histogram,
    );
    latency.value = Some("value.slots".into());
    latency.buckets = Some(Buckets::Exp2);
    latency.min_interval = Duration::from_millis(200);
    let (fs, state) = (BpfFs::new(), tempfile::tempdir().unwrap());
    let daemon = Daemon::start_with(bpfmapd::Config {
        allow_by_id: true,
        metrics_listen: Some("127.0.0.1:0".parse().unwrap()),
        exports: vec![calls, latency],
        ..Daemon::config(fs.path(), state.path())
    })
    .await;
    let client = daemon.client().await;
    let sc_maps = maps_of(&client, sc.pid(), &["data"]).await;
    let rq_maps = maps_of(&client, rq.pid(), &["hists"]).await;
    let addr = daemon.running.metrics_addr().unwrap();
    // Both exports answer once the tools have counted something.
    let text = wait_for(
        Duration::from_secs(30),
        "both exports' series",
        async || {
            let m = metrics::try_scrape(addr).await.ok()?;
            let ready = m.0.contains("syscount_calls_total{syscall=\"")
                && m.sum("runq_latency_usecs_count", &[]) > 0.0;
            ready.then_some(m.0)
        },
    )
    .await;
    sc.check_running();
    rq.check_running();
    // Every syscall by its name, and no more calls than the map holds
    // after the scrape.
    let mut exported = 0u64;
    for line in text
        .lines()
        .filter(|l| l.starts_with("syscount_calls_total{"))
    {
        let (series, value) = line.rsplit_once(' ').unwrap();
        let name = series
            .strip_prefix("syscount_calls_total{syscall=\"")
            .and_then(|s| s.strip_suffix("\"}"))
            .unwrap();
        assert!(
            !name.is_empty() && !name.chars().all(|c| c.is_ascii_digit()),
            "a syscall not decoded: {line}"
        );
        exported += value.parse::<u64>().unwrap();
    }
    let held: u64 = dumped_sum(&client, &sc_maps["data"], "value.count").await;
    assert!(
        exported > 0 && exported <= held,
        "exported {exported}, the map holds {held}"
    );
    // The histogram's count is what its slots held at the scrape.
    let count: u64 = text
        .lines()
        .find_map(|l| l.strip_prefix("runq_latency_usecs_count "))
        .unwrap()
        .parse()
        .unwrap();
    let held: u64 = dumped_slots(&client, &rq_maps["hists"]).await;
    assert!(
        count > 0 && count <= held,
        "exported {count}, the map holds {held}"
    );
}

/// The sum of `member` over a map's entries, through AggregateMap.
async fn dumped_sum(client: &Client, map: &MapInfo, member: &str) -> u64 {
    let options = bpfmap_client::AggregateOptions::default()
        .with_aggregate(bpfmap_client::Aggregate::sum(member));
    let result = client.aggregate(&map.map_name(), options).await.unwrap();
    result.groups()[0].values()[0].unwrap() as u64
}

/// The sum of every slot of runqlat's histograms (`struct hist { __u32
/// slots[N]; char comm[16]; }`), through AggregateMap.
async fn dumped_slots(client: &Client, map: &MapInfo) -> u64 {
    let slots = (map.value_size() as usize - 16) / 4;
    let mut total = 0u64;
    for chunk in (0..slots).collect::<Vec<_>>().chunks(16) {
        let mut options = bpfmap_client::AggregateOptions::default();
        for i in chunk {
            options =
                options.with_aggregate(bpfmap_client::Aggregate::sum(format!("value.slots[{i}]")));
        }
        let result = client.aggregate(&map.map_name(), options).await.unwrap();
        total += result.groups()[0]
            .values()
            .iter()
            .map(|v| v.unwrap() as u64)
            .sum::<u64>();
    }
    total
}

/// A walk inside the kernel keeps no map of another program alive: its
/// program holds a tool's map only while it runs, is listed neither among
/// the map's programs nor (with its own maps) among the host's maps, and
/// once the tool exits its map is gone, as bpftool sees it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_walk_inside_the_kernel_keeps_no_map_of_a_tool_alive() {
    let runqlat = require("runqlat", "libbpf-tools");
    mount_tracefs();
    let mut rq = Program::start(&runqlat, &["60", "2"], &[]);
    let (fs, state) = (BpfFs::new(), tempfile::tempdir().unwrap());
    let daemon = daemon_by_id(&fs, state.path()).await;
    let client = daemon.client().await;
    let hists = maps_of(&client, rq.pid(), &["hists"]).await["hists"].clone();
    rq.check_running();
    let map: MapName = format!("id:{}", hists.id()).parse().unwrap();
    let answer = client
        .aggregate(
            &map,
            bpfmap_client::AggregateOptions::default()
                .with_group_by(["key"])
                .with_aggregates([bpfmap_client::Aggregate::count()]),
        )
        .await
        .unwrap();
    let summary = answer.summary();
    assert!(summary.scanned_in_kernel(), "{}", summary.scan_note());
    // The walk program is loaded and kept; it is not one of the map's
    // programs, nor its maps the host's.
    let info = client.get_map(&map).await.unwrap();
    let programs: Vec<&str> = info.programs().iter().map(|p| p.name.as_str()).collect();
    assert!(!programs.is_empty(), "runqlat's own programs");
    assert!(
        !programs.iter().any(|p| p.starts_with("bpfmapd")),
        "{programs:?}"
    );
    let listed = client.list_maps().await.unwrap();
    let own = bpfmap_kernel::program::own_ids();
    assert!(
        !own.maps.is_empty(),
        "the walk program is kept, with its maps"
    );
    let shown: Vec<(&str, u32)> = listed
        .iter()
        .filter(|m| own.maps.contains(&m.id()))
        .map(|m| (m.name(), m.id()))
        .collect();
    assert!(
        shown.is_empty(),
        "the daemon's own maps are listed: {shown:?}"
    );
    // The tool exits: its map goes with it, while the daemon runs on.
    drop(rq);
    let id = hists.id().to_string();
    let bpftool_bin = require("bpftool", "bpftool");
    wait_for(
        Duration::from_secs(10),
        "runqlat's map to be freed after it exits",
        async || {
            let shown = std::process::Command::new(&bpftool_bin)
                .args(["map", "show", "id", &id])
                .output()
                .unwrap();
            (!shown.status.success()).then_some(())
        },
    )
    .await;
    daemon.stop().await;
}
