//! Maps as Arrow tables: the daemon's Arrow Flight service read as a
//! Python user reads it (pyarrow.flight, DuckDB, polars; the script is
//! `python/arrow_tables.py`), the library's record batches and
//! bpfmapctl's Arrow IPC files, against real kernel maps.

use std::collections::BTreeMap;

use arrow_flight::{
    FlightData, FlightDescriptor, Ticket, flight_service_client::FlightServiceClient,
};
use base64::Engine as _;
use bpfmap_client::{Aggregate, AggregateOptions, DumpOptions, MapName, pb, table::PerCpuColumns};
use bpfmap_tests::{
    pki::{Name, Pki, Validity},
    *,
};
use prost::Message as _;
use serde_json::{Value as Json, json};
use tonic::Code;

/// A Python with pyarrow, polars and duckdb: `$BPFMAP_PYTHON_ARROW`, or
/// python3 when it has them.
fn python() -> String {
    let python = std::env::var("BPFMAP_PYTHON_ARROW").unwrap_or_else(|_| "python3".into());
    let found = std::process::Command::new(&python)
        .args(["-c", "import pyarrow.flight, polars, duckdb"])
        .output()
        .is_ok_and(|o| o.status.success());
    assert!(
        found,
        "{python} cannot import pyarrow.flight, polars and duckdb: this test needs a Python with them (set $BPFMAP_PYTHON_ARROW; install them with `pip install pyarrow polars duckdb`; .ci/run does)"
    );
    python
}

/// Runs `python/arrow_tables.py ARGS` off the runtime's threads (the
/// daemon runs on them): the JSON it prints.
async fn py(args: &[&str]) -> Json {
    let python = python();
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/python/arrow_tables.py");
    let args: Vec<String> = args.iter().map(|s| s.to_string()).collect();
    let out = tokio::task::spawn_blocking(move || {
        std::process::Command::new(&python)
            .arg(script)
            .args(&args)
            .output()
            .unwrap()
    })
    .await
    .unwrap();
    assert!(
        out.status.success(),
        "arrow_tables.py failed:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("not JSON ({e}): {}", String::from_utf8_lossy(&out.stdout)))
}

/// A daemon's Flight URL for pyarrow.
fn grpc_url(daemon: &Daemon) -> String {
    daemon.addr().replace("http://", "grpc://")
}

fn dump_command(path: &str) -> String {
    json!({"dump": {"map": {"path": path}}}).to_string()
}

/// The clang-compiled object of the typed-maps test, its maps pinned:
/// flows (an enum bitfield, a char array, a nested struct, an anonymous
/// union, a bool) and ports (a `__be16`, nested arrays, an array of
/// structs), one entry each.
fn typed_object(fs: &BpfFs) -> aya::Ebpf {
    let build = tempfile::tempdir().unwrap();
    let object = compile_bpf_object("typed.bpf.c", build.path());
    let mut ebpf = aya::EbpfLoader::new()
        .default_map_pin_directory(fs.path())
        .load(&object)
        .unwrap_or_else(|e| panic!("loading the object: {e}"));
    let mut key = [0u8; 16];
    key[0..4].copy_from_slice(&167772161u32.to_le_bytes());
    key[4..8].copy_from_slice(&3232235522u32.to_le_bytes());
    key[8..10].copy_from_slice(&40000u16.to_le_bytes());
    key[10..12].copy_from_slice(&53u16.to_le_bytes());
    key[12] = 17;
    let mut value = [0u8; 48];
    value[0..8].copy_from_slice(&u64::MAX.to_le_bytes());
    value[8..16].copy_from_slice(&180u64.to_le_bytes());
    value[16..24].copy_from_slice(b"resolvd\0");
    value[32..36].copy_from_slice(&10u32.to_le_bytes());
    value[36..40].copy_from_slice(&20u32.to_le_bytes());
    value[40..44].copy_from_slice(&0x0403_0201u32.to_le_bytes());
    value[44] = 1;
    value[45] = (-2i8) as u8;
    let mut flows: aya::maps::HashMap<_, [u8; 16], [u8; 48]> =
        aya::maps::HashMap::try_from(ebpf.map_mut("flows").expect("map flows")).unwrap();
    flows.insert(key, value, 0).unwrap();
    let mut port = [0u8; 32];
    port[0..2].copy_from_slice(&443u16.to_be_bytes());
    for (i, h) in [1u16, 2, 3, 4, 5, 6].iter().enumerate() {
        port[2 + 2 * i..4 + 2 * i].copy_from_slice(&h.to_le_bytes());
    }
    for (i, (a, b)) in [(7u32, -7i32), (9, -9)].iter().enumerate() {
        port[16 + 8 * i..20 + 8 * i].copy_from_slice(&a.to_le_bytes());
        port[20 + 8 * i..24 + 8 * i].copy_from_slice(&b.to_le_bytes());
    }
    let mut ports: aya::maps::HashMap<_, u32, [u8; 32]> =
        aya::maps::HashMap::try_from(ebpf.map_mut("ports").expect("map ports")).unwrap();
    ports.insert(5, port, 0).unwrap();
    ebpf
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn typed_maps_read_into_pyarrow_as_the_program_wrote_them() {
    let fs = BpfFs::new();
    let state = tempfile::tempdir().unwrap();
    let _ebpf = typed_object(&fs);
    let daemon = Daemon::start(fs.path(), state.path()).await;
    let url = grpc_url(&daemon);
    let flows = py(&["table", &url, &dump_command("flows")]).await;
    assert_eq!(
        flows["schema"],
        json!([
            ["key.saddr", "uint32"],
            ["key.daddr", "uint32"],
            ["key.sport", "uint16"],
            ["key.dport", "uint16"],
            [
                "key.proto",
                "dictionary<values=string, indices=int32, ordered=0>"
            ],
            ["key.pad", "fixed_size_list<item: uint8 not null>[3]"],
            ["value.packets", "uint64"],
            ["value.bytes", "uint64"],
            ["value.comm", "string"],
            ["value.range.lo", "uint32"],
            ["value.range.hi", "uint32"],
            ["value.as_u32", "uint32"],
            ["value.as_bytes", "fixed_size_list<item: uint8 not null>[4]"],
            ["value.active", "bool"],
            ["value.delta", "int8"],
        ]),
        "{flows}"
    );
    assert_eq!(flows["read_schema"], flows["schema"]);
    assert_eq!(
        flows["rows"],
        json!([{
            "key.saddr": 167772161, "key.daddr": 3232235522u32, "key.sport": 40000, "key.dport": 53,
            "key.proto": "L4_UDP", "key.pad": [0, 0, 0],
            "value.packets": u64::MAX, "value.bytes": 180, "value.comm": "resolvd",
            "value.range.lo": 10, "value.range.hi": 20,
            "value.as_u32": 67305985, "value.as_bytes": [1, 2, 3, 4],
            "value.active": true, "value.delta": -2,
        }])
    );
    let meta = &flows["metadata"];
    assert_eq!(meta[0]["rows"], 1, "{meta}");
    assert!(!meta[0]["cursor"].as_str().unwrap().is_empty());
    assert_eq!(meta[1]["done"], true);
    assert_eq!(meta[1]["entries"], 1);
    let ports = py(&["table", &url, &dump_command("ports")]).await;
    assert_eq!(
        ports["schema"],
        json!([
            ["key", "uint32"],
            ["value.port", "uint16"],
            [
                "value.hist",
                "fixed_size_list<item: fixed_size_list<item: uint16 not null>[3] not null>[2]"
            ],
            [
                "value.pairs",
                "fixed_size_list<item: struct<a: uint32 not null, b: int32 not null> not null>[2]"
            ],
        ]),
        "{ports}"
    );
    assert_eq!(
        ports["rows"],
        json!([{
            "key": 5, "value.port": 443, "value.hist": [[1, 2, 3], [4, 5, 6]],
            "value.pairs": [{"a": 7, "b": -7}, {"a": 9, "b": -9}],
        }])
    );
    daemon.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_table_cut_after_a_batch_resumes_from_its_cursor_with_every_entry_once() {
    let fs = BpfFs::new();
    let state = tempfile::tempdir().unwrap();
    let (_map, _) = u64_hash(&fs, "m", 5_000, 8192);
    let daemon = Daemon::start(fs.path(), state.path()).await;
    let command = json!({"dump": {"map": {"path": "m"}, "chunk_size": 400}}).to_string();
    let out = py(&["resume", &grpc_url(&daemon), &command, "3"]).await;
    let keys = |rows: &Json| -> Vec<u64> {
        rows.as_array()
            .unwrap()
            .iter()
            .map(|r| {
                let hex = r["key"].as_str().unwrap();
                u64::from_le_bytes(
                    faster_hex::hex_decode_vec(hex.as_bytes())
                        .unwrap()
                        .try_into()
                        .unwrap(),
                )
            })
            .collect()
    };
    let (before, after) = (keys(&out["before"]), keys(&out["after"]));
    // A batch of a hash map holds whole buckets: up to 400 entries.
    assert!(
        (1_000..=1_200).contains(&before.len()),
        "three batches of at most 400: {}",
        before.len()
    );
    let mut all = [before, after].concat();
    all.sort();
    assert_eq!(all, (0..5_000).collect::<Vec<u64>>(), "every entry once");
    daemon.stop().await;
}

/// The map `flows` of `n` typed flows pinned on a private bpffs, kept
/// while the daemon that [`serve_flows`] starts serves it.
struct Flows {
    _map: OwnedMap,
    _state: tempfile::TempDir,
    _fs: BpfFs,
}

/// A daemon serving `n` typed flows as the map `flows`.
async fn serve_flows(n: u32) -> (Daemon, Flows) {
    let fs = BpfFs::new();
    let state = tempfile::tempdir().unwrap();
    let map = bpfmapd::typed_flows(n).unwrap();
    fs.pin(&map, "flows");
    let daemon = Daemon::start(fs.path(), state.path()).await;
    let flows = Flows {
        _map: map,
        _state: state,
        _fs: fs,
    };
    (daemon, flows)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn duckdb_groups_a_table_as_aggregate_map_does() {
    let (daemon, _flows) = serve_flows(10_000).await;
    let url = grpc_url(&daemon);
    let sql =
        r#"SELECT "key.daddr", sum("value.bytes") AS s FROM t GROUP BY 1 ORDER BY s DESC LIMIT 10"#;
    let duck = py(&["sql", &url, &dump_command("flows"), sql]).await;
    let client = daemon.client().await;
    let options = AggregateOptions::default()
        .with_group_by(["key.daddr"])
        .with_aggregate(Aggregate::sum("value.bytes"))
        .with_limit(10);
    let answer = client
        .aggregate(&"flows".parse().unwrap(), options)
        .await
        .unwrap();
    let want: Vec<Json> = answer
        .as_proto()
        .groups
        .iter()
        .map(|g| {
            let daddr = json_of(&g.key.as_ref().unwrap().fields["key.daddr"]);
            let sum: u64 = json_of(&g.values[0]).as_str().unwrap().parse().unwrap();
            json!([daddr, sum])
        })
        .collect();
    assert_eq!(duck, json!(want));
    // The same groups as an aggregate's table.
    let command = json!({"aggregate": {
        "map": {"path": "flows"}, "group_by": ["key.daddr"],
        "aggregates": [{"op": "SUM", "field": "value.bytes"}, {"op": "COUNT"}], "limit": 10,
    }});
    let groups = py(&["table", &url, &command.to_string()]).await;
    assert_eq!(
        groups["schema"],
        json!([
            ["key.daddr", "uint32"],
            ["sum(value.bytes)", "decimal128(38, 0)"],
            ["count()", "decimal128(38, 0)"]
        ])
    );
    let rows: Vec<Json> = groups["rows"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| {
            let sum: u64 = r["sum(value.bytes)"].as_str().unwrap().parse().unwrap();
            json!([r["key.daddr"], sum])
        })
        .collect();
    assert_eq!(json!(rows), json!(want));
    assert!(
        groups["rows"]
            .as_array()
            .unwrap()
            .iter()
            .all(|r| r["count()"] == "40")
    );
    daemon.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn polars_reads_the_ipc_file_bpfmapctl_writes() {
    let (daemon, _flows) = serve_flows(2_000).await;
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("flows.arrow");
    let (r, _, err) = ctl(&[
        "--addr",
        &daemon.addr(),
        "--format",
        "arrow",
        "dump",
        "flows",
        "--filter",
        "value.packets <= 100",
        "-o",
        file.to_str().unwrap(),
    ])
    .await;
    assert!(r.is_ok(), "{err}");
    let frame = py(&["ipc", file.to_str().unwrap()]).await;
    assert_eq!(frame["shape"], json!([100, 8]));
    assert_eq!(
        frame["columns"],
        json!([
            "target",
            "key.saddr",
            "key.daddr",
            "key.sport",
            "key.dport",
            "key.proto",
            "value.packets",
            "value.bytes"
        ])
    );
    let target = daemon.addr().trim_start_matches("http://").to_owned();
    let mut packets: Vec<u64> = frame["rows"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| {
            assert_eq!(r["target"], json!(target));
            assert_eq!(
                r["value.bytes"],
                json!(r["value.packets"].as_u64().unwrap() * 1500)
            );
            r["value.packets"].as_u64().unwrap()
        })
        .collect();
    packets.sort();
    assert_eq!(packets, (1..=100).collect::<Vec<u64>>());
    // A terminal gets no binary stream.
    let (r, _, _) = ctl(&["--addr", &daemon.addr(), "--format", "arrow", "list"]).await;
    let e = r.unwrap_err().to_string();
    assert!(
        e.contains("--format arrow writes the table of a dump"),
        "{e}"
    );
    daemon.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn flight_over_mutual_tls_reads_what_the_policy_allows() {
    use bpfmapd::{Config, Operation, RuleConfig};
    const OPS: &str = "spiffe://example.org/ops/alice";
    let fs = BpfFs::new();
    let state = tempfile::tempdir().unwrap();
    let pki = Pki::new();
    let (_open, _) = u64_hash(&fs, "open/m", 10, 64);
    let (_closed, _) = u64_hash(&fs, "closed/m", 10, 64);
    let daemon = Daemon::start_with(Config {
        tls: Some(pki.server_files()),
        rules: vec![
            RuleConfig {
                identities: vec![OPS.into()],
                maps: vec!["open/*".into()],
                operations: vec![Operation::List, Operation::Dump],
            },
            RuleConfig {
                identities: vec![OPS.into()],
                maps: vec!["closed/*".into()],
                operations: vec![Operation::List],
            },
        ],
        ..Daemon::config(fs.path(), state.path())
    })
    .await;
    pki.client("alice", Name::Spiffe(OPS), Validity::Now);
    let url = daemon.tls_addr().replace("https://", "grpc+tls://");
    let tls = [
        pki.path("ca.pem"),
        pki.path("alice.pem"),
        pki.path("alice.key"),
    ];
    let tls: Vec<&str> = tls.iter().map(|p| p.to_str().unwrap()).collect();
    let mut args = vec!["table", &url];
    let open = dump_command("open/m");
    args.push(&open);
    args.extend(&tls);
    let table = py(&args).await;
    assert_eq!(table["rows"].as_array().unwrap().len(), 10, "{table}");
    let closed = dump_command("closed/m");
    args[2] = &closed;
    let denied = py(&args).await;
    assert_eq!(denied["error"], "FlightUnauthorizedError", "{denied}");
    assert!(
        denied["message"].as_str().unwrap().contains("closed/m"),
        "{denied}"
    );
    // ListFlights lists what the caller may read, not all it may list.
    let mut list = vec!["list", url.as_str()];
    list.extend(&tls);
    let flights = py(&list).await;
    let maps: Vec<String> = flights
        .as_array()
        .unwrap()
        .iter()
        .map(|f| command_map(&f["command"]))
        .collect();
    assert_eq!(maps, ["open/m"], "{flights}");
    daemon.stop().await;
}

/// The map path a ListFlights command names.
fn command_map(b64: &Json) -> String {
    let bytes = base64::engine::general_purpose::STANDARD
        .decode(b64.as_str().unwrap())
        .unwrap();
    let command = pb::FlightCommand::decode(bytes.as_slice()).unwrap();
    match command.command {
        Some(pb::flight_command::Command::Dump(d)) => match d.map.unwrap().r#ref.unwrap() {
            pb::map_ref::Ref::Path(p) => p,
            other => panic!("{other:?}"),
        },
        other => panic!("{other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn flight_calls_say_what_is_wrong_with_status_codes() {
    let fs = BpfFs::new();
    let state = tempfile::tempdir().unwrap();
    let (_map, _) = u64_hash(&fs, "m", 10, 64);
    let daemon = Daemon::start(fs.path(), state.path()).await;
    let mut c = FlightServiceClient::new(channel_from(&daemon.addr(), "127.0.0.1").await);
    for (ticket, code, says) in [
        (dump_command("nope"), Code::NotFound, "map nope not found"),
        (
            "{\"dump\": {\"mapp\": 1}}".into(),
            Code::InvalidArgument,
            "not a bpfmap.v1.FlightCommand in JSON",
        ),
        (
            "{}".into(),
            Code::InvalidArgument,
            "neither dump nor aggregate",
        ),
        (
            json!({"dump": {"map": {"path": "m"}, "layout": "LAYOUT_PACKED"}}).to_string(),
            Code::InvalidArgument,
            "leave layout and raw out",
        ),
        (
            json!({"dump": {"map": {"path": "m"}, "perCpu": "PER_CPU_SUM"}}).to_string(),
            Code::InvalidArgument,
            "map m is not per-CPU",
        ),
        (
            json!({"dump": {"map": {"path": "m"}}, "targets": {"targets": ["a"]}}).to_string(),
            Code::InvalidArgument,
            "targets and fleet_cursor are the relay's",
        ),
    ] {
        let e = match c.do_get(Ticket::new(ticket.clone())).await {
            Err(e) => e,
            Ok(stream) => {
                let mut s = stream.into_inner();
                let mut got = None;
                while let Some(m) = s.message().await.transpose() {
                    if let Err(e) = m {
                        got = Some(e);
                        break;
                    }
                }
                got.unwrap_or_else(|| panic!("{ticket}: no error"))
            }
        };
        assert_eq!(e.code(), code, "{ticket}: {e:?}");
        assert!(e.message().contains(says), "{ticket}: {}", e.message());
    }
    // A descriptor may name a map by its path.
    let info = c
        .get_flight_info(FlightDescriptor::new_path(vec!["m".into()]))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(
        info.total_records, -1,
        "a hash map's size is not known before it is read"
    );
    let e = c
        .do_put(futures::stream::iter(Vec::<FlightData>::new()))
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::Unimplemented, "{e:?}");
    // grpcurl finds the service by reflection.
    let host = daemon.running.local_addr().to_string();
    let (ok, out, err) = grpcurl(&["-plaintext"], &host, &["list"]).await;
    assert!(ok, "{err}");
    assert!(
        out.lines()
            .any(|l| l == "arrow.flight.protocol.FlightService"),
        "{out}"
    );
    daemon.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_library_reads_dumps_as_record_batches() {
    use arrow_array::{Array as _, cast::AsArray as _, types::UInt64Type};
    let (daemon, _flows) = serve_flows(3_000).await;
    let client = daemon.client().await;
    let map: MapName = "flows".parse().unwrap();
    let options = DumpOptions::default()
        .with_fields(["value.packets", "key.daddr"])
        .with_render([("key.daddr", "ipv4")]);
    let mut dump = client
        .dump_table(&map, options, PerCpuColumns::List)
        .await
        .unwrap();
    let mut packets = Vec::new();
    let mut daddrs = BTreeMap::<String, usize>::new();
    while let Some(batch) = dump.next_batch().await.unwrap() {
        assert_eq!(batch.schema().field(0).name(), "key.daddr");
        assert_eq!(batch.schema().field(1).name(), "value.packets");
        let d = batch.column(0).as_string::<i32>();
        for i in 0..d.len() {
            *daddrs.entry(d.value(i).to_owned()).or_default() += 1;
        }
        packets.extend(
            batch
                .column(1)
                .as_primitive::<UInt64Type>()
                .values()
                .iter()
                .copied(),
        );
    }
    packets.sort();
    assert_eq!(packets, (1..=3_000).collect::<Vec<u64>>());
    assert_eq!(daddrs.len(), 250);
    assert_eq!(daddrs["192.168.0.1"], 12);
    assert!(dump.summary().unwrap().complete());
    daemon.stop().await;
}

/// `dump_table` opens the dump's call while it asks for the map's types:
/// the daemon is reading before the first batch is asked for (one round
/// trip sooner on a distant host), and the batches hold every entry once.
/// A map that is not there is NOT_FOUND from `dump_table` itself.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dump_table_opens_the_dump_while_it_reads_the_types() {
    let (daemon, _flows) = serve_flows(3_000).await;
    let client = daemon.client().await;
    let stats = daemon.running.stats().clone();
    let read = || stats.chunks_read.load(std::sync::atomic::Ordering::Relaxed);
    assert_eq!(read(), 0, "no dump before the call");
    let map: MapName = "flows".parse().unwrap();
    let mut dump = client
        .dump_table(&map, DumpOptions::default(), PerCpuColumns::List)
        .await
        .unwrap();
    // No batch asked for yet: the daemon reads all the same.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while read() == 0 {
        assert!(
            std::time::Instant::now() < deadline,
            "the daemon read nothing before the first batch was asked for: the dump's call was not opened by dump_table"
        );
        tokio::time::sleep(std::time::Duration::from_millis(5)).await;
    }
    let mut rows = 0;
    while let Some(batch) = dump.next_batch().await.unwrap() {
        rows += batch.num_rows();
    }
    assert_eq!(rows, 3_000);
    assert!(dump.summary().unwrap().complete());
    let e = client
        .dump_table(
            &"nope".parse().unwrap(),
            DumpOptions::default(),
            PerCpuColumns::List,
        )
        .await
        .unwrap_err();
    assert_eq!(code_of(&e), Code::NotFound, "{e}");
    daemon.stop().await;
}

/// A host of the relay's fleet: its daemon, and the map `m` it holds
/// (keys from `first`, value key * 7).
struct FleetHost {
    _fs: BpfFs,
    _state: tempfile::TempDir,
    _map: bpfmap_kernel::OwnedMap,
    daemon: Daemon,
}

/// A daemon whose map `m` holds `n` keys from `first`; declared as
/// `__u64` keys and values when `typed` (without types its columns are
/// bytes).
async fn fleet_host(first: u64, n: u64, typed: bool) -> FleetHost {
    let (fs, state) = (BpfFs::new(), tempfile::tempdir().unwrap());
    let (map, _) = u64_hash_of(&fs, "m", first..first + n, |k| k * 7, 4096);
    let types = match typed {
        true => vec![bpfmapd::TypesConfig {
            maps: vec!["m".into()],
            names: Vec::new(),
            key: "__u64".into(),
            value: "__u64".into(),
        }],
        false => Vec::new(),
    };
    let daemon = Daemon::start_with(bpfmapd::Config {
        types,
        ..Daemon::config(fs.path(), state.path())
    })
    .await;
    FleetHost {
        _fs: fs,
        _state: state,
        _map: map,
        daemon,
    }
}

/// The relay's Arrow Flight, read with pyarrow: one table of three
/// daemons' entries with a `target` column; a target nothing listens on
/// and one whose map has other types named in-band, the call going on;
/// a table cut after three batches resumed from the fleet cursor with
/// every entry once; an aggregate's merged groups with the targets that
/// hold them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_relay_serves_the_fleet_as_one_table_with_failures_in_band() {
    let mut hosts = Vec::new();
    for h in 0..3 {
        hosts.push(fleet_host(h * 1_000_000, 1_000, true).await);
    }
    let untyped = fleet_host(9_000_000, 10, false).await;
    let dead = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap();
    let target = |d: &Daemon| d.running.local_addr().to_string();
    let good: Vec<String> = hosts.iter().map(|h| target(&h.daemon)).collect();
    let all: Vec<String> = good
        .iter()
        .cloned()
        .chain([dead.to_string(), target(&untyped.daemon)])
        .collect();
    let state = tempfile::tempdir().unwrap();
    let config = bpfmap_relay::Config {
        targets: all.clone(),
        state_dir: state.path().to_owned(),
        answer_timeout: std::time::Duration::from_secs(2),
        ..Default::default()
    };
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let relay = bpfmap_relay::Relay::start_on(&config, listener)
        .await
        .unwrap();
    let url = format!("grpc://{}", relay.local_addr());
    let expected: BTreeMap<(String, u64), u64> = good
        .iter()
        .enumerate()
        .flat_map(|(h, t)| {
            let first = h as u64 * 1_000_000;
            (first..first + 1_000).map(move |k| ((t.clone(), k), k * 7))
        })
        .collect();

    // The whole table: its schema, the exact rows, every target's end.
    let command =
        json!({"dump": {"map": {"path": "m"}, "chunk_size": 250}, "targets": {"targets": all}});
    let out = py(&["table", &url, &command.to_string()]).await;
    let columns = json!([["target", "string"], ["key", "uint64"], ["value", "uint64"]]);
    assert_eq!(out["schema"], columns, "{out}");
    assert_eq!(out["read_schema"], columns);
    let rows: BTreeMap<(String, u64), u64> = out["rows"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| {
            let t = r["target"].as_str().unwrap().to_owned();
            let k = r["key"].as_u64().unwrap();
            ((t, k), r["value"].as_u64().unwrap())
        })
        .collect();
    assert_eq!(out["rows"].as_array().unwrap().len(), 3_000, "no row twice");
    assert_eq!(rows, expected);
    let metadata = out["metadata"].as_array().unwrap();
    let ends: BTreeMap<&str, &Json> = metadata
        .iter()
        .filter(|m| m.get("code").is_some())
        .map(|m| (m["target"].as_str().unwrap(), m))
        .collect();
    assert_eq!(ends.len(), 5, "an end per target: {metadata:?}");
    for t in &good {
        let end = ends[t.as_str()];
        assert_eq!(
            (end["code"].as_str(), end["entries"].as_u64()),
            (Some("OK"), Some(1_000))
        );
        assert_eq!(end["complete"], true);
    }
    let gone = ends[dead.to_string().as_str()];
    assert_eq!(gone["code"], "UNAVAILABLE", "{gone}");
    assert_eq!(gone["reason"], "TARGET_UNREACHABLE", "{gone}");
    let other = ends[target(&untyped.daemon).as_str()];
    assert_eq!(
        (other["code"].as_str(), other["reason"].as_str()),
        (Some("FAILED_PRECONDITION"), Some("TYPES_DIFFER")),
        "{other}"
    );
    assert!(
        other["error"].as_str().unwrap().contains("other types"),
        "{other}"
    );
    assert_eq!(other["entries"], 0);
    let batches = metadata.iter().filter(|m| m.get("rows").is_some());
    for m in batches {
        assert!(
            good.contains(&m["target"].as_str().unwrap().to_owned()),
            "{m}"
        );
        assert!(!m["cursor"].as_str().unwrap().is_empty(), "{m}");
    }
    let last = metadata.last().unwrap();
    assert_eq!(
        (last["done"].as_bool(), last["entries"].as_u64()),
        (Some(true), Some(3_000))
    );

    // Cut after three batches, resumed from the fleet cursor.
    let command =
        json!({"dump": {"map": {"path": "m"}, "chunk_size": 250}, "targets": {"targets": good}});
    let out = py(&["resume", &url, &command.to_string(), "3"]).await;
    let keys = |rows: &Json| -> Vec<(String, u64)> {
        rows.as_array()
            .unwrap()
            .iter()
            .map(|r| {
                (
                    r["target"].as_str().unwrap().to_owned(),
                    r["key"].as_u64().unwrap(),
                )
            })
            .collect()
    };
    let (before, after) = (keys(&out["before"]), keys(&out["after"]));
    assert!(
        (500..=750).contains(&before.len()),
        "three batches of at most 250: {}",
        before.len()
    );
    let (kept, resumed) = (before.len(), after.len());
    let got = [before, after].concat();
    let once: std::collections::BTreeSet<_> = got.iter().cloned().collect();
    let missing = expected.keys().filter(|k| !once.contains(*k)).count();
    assert_eq!(
        (got.len() - once.len(), missing),
        (0, 0),
        "duplicates and missing entries: {kept} before the cut, {resumed} after: {:?}",
        got.iter()
            .fold(BTreeMap::<&str, usize>::new(), |mut m, (t, _)| {
                *m.entry(t.as_str()).or_default() += 1;
                m
            })
    );

    // The fleet's merged aggregate as a table.
    let command = json!({"aggregate": {
        "map": {"path": "m"},
        "aggregates": [{"op": "COUNT"}, {"op": "SUM", "field": "value"}],
    }, "targets": {"targets": [good[0], good[1], good[2], dead.to_string()]}});
    let out = py(&["table", &url, &command.to_string()]).await;
    assert_eq!(
        out["schema"],
        json!([
            ["count()", "decimal128(38, 0)"],
            ["sum(value)", "decimal128(38, 0)"],
            ["targets", "string"]
        ]),
        "{out}"
    );
    let sum: u64 = expected.values().sum();
    let mut holders = good.clone();
    holders.sort();
    let row = &out["rows"][0];
    assert_eq!(out["rows"].as_array().unwrap().len(), 1, "{out}");
    assert_eq!(
        (row["count()"].as_str(), row["sum(value)"].as_str()),
        (Some("3000"), Some(sum.to_string().as_str()))
    );
    let mut held: Vec<&str> = row["targets"].as_str().unwrap().split(',').collect();
    held.sort();
    assert_eq!(held, holders);
    let done = out["metadata"].as_array().unwrap().last().unwrap().clone();
    assert_eq!(done["failed"][0]["target"], dead.to_string(), "{done}");
    assert_eq!(done["failed"][0]["code"], "UNAVAILABLE", "{done}");

    // A map no target has: NOT_FOUND from GetFlightInfo, every target
    // having said so.
    let command = json!({"dump": {"map": {"path": "nothing"}}, "targets": {"targets": good}});
    let out = py(&["table", &url, &command.to_string()]).await;
    let said = out["message"].as_str().unwrap_or_default();
    assert!(said.contains("no target described nothing"), "{out}");
    let relay_url = format!("http://{}", relay.local_addr());
    let mut flight = FlightServiceClient::new(channel_from(&relay_url, "127.0.0.1").await);
    let status = flight
        .get_schema(FlightDescriptor::new_cmd(command.to_string()))
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::NotFound, "{status:?}");
    assert!(
        status.message().contains("no target described nothing"),
        "{status:?}"
    );
    let status = flight
        .do_get(Ticket::new(r#"{"dump": {}}"#))
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::InvalidArgument, "{status:?}");
    // The daemon's rules for a table's dump, read in one place.
    for (command, says) in [
        (
            r#"{"dump": {"map": {"path": "m"}, "perCpu": 7}}"#,
            "unknown per_cpu 7",
        ),
        (
            r#"{"dump": {"map": {"path": "m"}, "raw": true}}"#,
            "leave layout and raw out",
        ),
    ] {
        let status = flight.do_get(Ticket::new(command)).await.unwrap_err();
        assert_eq!(
            status.code(),
            Code::InvalidArgument,
            "{command}: {status:?}"
        );
        assert!(status.message().contains(says), "{command}: {status:?}");
    }
    relay.stop().await.unwrap();
    for h in hosts {
        h.daemon.stop().await;
    }
    untyped.daemon.stop().await;
}
