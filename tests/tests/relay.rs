//! bpfmap-relay in front of real daemons: fleet dumps that resume from any
//! message's cursor (on the same relay, on another after the first was
//! killed, across a rotation of the cursor key), the exact fleet top K,
//! targets that fail named in-band with a stable reason, the policy,
//! grpcurl against the relay.

use std::{collections::BTreeMap, net::SocketAddr, time::Duration};

use bpfmap_client::pb::{self, fleet_service_client::FleetServiceClient};
use bpfmap_tests::{daemon_bin, *};
use serde_json::{Value as Json, json};
use tonic::{Code, transport::Channel};

const MAP: &str = "fleet/conns";

/// A host: its daemon and the entries of its map.
struct Host {
    _fs: BpfFs,
    _state: tempfile::TempDir,
    _map: bpfmap_kernel::OwnedMap,
    daemon: Daemon,
    entries: Entries,
}

/// `n` daemons on loopback, host `h` holding keys h * 1,000,000 + i for i
/// below `entries` (u64) -> key * 7.
async fn hosts(n: u64, entries: u64) -> Vec<Host> {
    let mut out = Vec::new();
    for h in 0..n {
        let (fs, state) = (BpfFs::new(), tempfile::tempdir().unwrap());
        let first = h * 1_000_000;
        let max = (entries as u32).next_power_of_two().max(64);
        let (map, expected) = u64_hash_of(&fs, MAP, first..first + entries, |k| k * 7, max);
        let daemon = Daemon::start(fs.path(), state.path()).await;
        out.push(Host {
            _fs: fs,
            _state: state,
            _map: map,
            daemon,
            entries: expected,
        });
    }
    out
}

/// An address where nothing listens.
fn dead_addr() -> SocketAddr {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
}

fn target_of(h: &Host) -> String {
    h.daemon.running.local_addr().to_string()
}

/// A relay in this process over `targets`.
async fn relay(targets: &[String], state: &std::path::Path) -> bpfmap_relay::Relay {
    let config = bpfmap_relay::Config {
        targets: targets.to_vec(),
        state_dir: state.to_owned(),
        answer_timeout: Duration::from_secs(2),
        ..Default::default()
    };
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    bpfmap_relay::Relay::start_on(&config, listener)
        .await
        .expect("the relay starts")
}

async fn client(addr: SocketAddr) -> FleetServiceClient<Channel> {
    FleetServiceClient::connect(format!("http://{addr}"))
        .await
        .expect("the relay answers")
}

fn dump_request(chunk_size: u32, cursor: &str) -> pb::FleetServiceDumpMapRequest {
    pb::FleetServiceDumpMapRequest {
        request: Some(pb::DumpMapRequest {
            map: map_ref(MAP),
            chunk_size,
            raw: true,
            ..Default::default()
        }),
        targets: None,
        cursor: cursor.into(),
        ..Default::default()
    }
}

/// Entries by target: (key, value) bytes, in the order delivered.
type PerTarget = BTreeMap<String, Vec<(Vec<u8>, Vec<u8>)>>;

/// What a fleet dump delivered, per target, and each target's end.
#[derive(Default)]
struct Delivered {
    entries: PerTarget,
    ends: BTreeMap<String, pb::TargetEnd>,
    /// The cursor of every message, in order.
    cursors: Vec<String>,
}

impl Delivered {
    fn add(&mut self, msg: pb::FleetServiceDumpMapResponse) {
        use pb::fleet_service_dump_map_response::Part;
        match msg.part.expect("a part") {
            Part::Chunk(c) => self.entries.entry(msg.target).or_default().extend(
                c.entries
                    .into_iter()
                    .map(|e| (e.key.to_vec(), e.value.to_vec())),
            ),
            Part::End(e) => {
                self.ends.insert(msg.target, e);
            }
        }
        self.cursors.push(msg.cursor);
    }
}

/// Reads a fleet dump, at most `max` messages.
async fn read(
    client: &mut FleetServiceClient<Channel>,
    req: pb::FleetServiceDumpMapRequest,
    max: usize,
) -> Delivered {
    let mut stream = client.dump_map(req).await.unwrap().into_inner();
    let mut got = Delivered::default();
    while got.cursors.len() < max {
        match stream.message().await.unwrap() {
            Some(m) => got.add(m),
            None => break,
        }
    }
    got
}

/// Every host's entries exactly once (no duplicate, none missing).
fn assert_exactly(hosts: &[Host], got: &PerTarget) {
    for h in hosts {
        let delivered = got.get(&target_of(h)).cloned().unwrap_or_default();
        let unique: BTreeMap<Vec<u8>, Vec<u8>> = delivered.iter().cloned().collect();
        assert_eq!(
            unique.len(),
            delivered.len(),
            "{}: an entry twice",
            target_of(h)
        );
        let want: BTreeMap<Vec<u8>, Vec<u8>> = h
            .entries
            .iter()
            .map(|(k, v)| match v {
                bpfmap_client::Value::Single(v) => (k.clone(), v.clone()),
                _ => unreachable!("a hash map"),
            })
            .collect();
        assert_eq!(unique, want, "{}", target_of(h));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fleet_dump_resumes_from_any_message_with_every_entry_once() {
    let hosts = hosts(3, 400).await;
    let (relay, dead, _, _state) = relay_with_dead(&hosts).await;
    let mut c = client(relay.local_addr()).await;
    let all = read(&mut c, dump_request(64, ""), usize::MAX).await;
    assert_exactly(&hosts, &all.entries);
    let refused = all.ends[&dead].status.as_ref().unwrap();
    assert_eq!(
        (refused.code.as_str(), refused.reason.as_str()),
        ("UNAVAILABLE", "TARGET_UNREACHABLE")
    );
    for h in &hosts {
        let end = &all.ends[&target_of(h)];
        assert_eq!(
            (
                end.status.as_ref().unwrap().code.as_str(),
                end.complete,
                end.entries
            ),
            ("OK", true, 400)
        );
    }
    // Cut after message k, resumed from its cursor: the rest, once.
    for k in [1, 4, 9, all.cursors.len() - 1] {
        let first = read(&mut c, dump_request(64, ""), k).await;
        let rest = read(&mut c, dump_request(64, &first.cursors[k - 1]), usize::MAX).await;
        let mut both = first.entries.clone();
        for (t, e) in rest.entries {
            both.entry(t).or_default().extend(e);
        }
        assert_exactly(&hosts, &both);
        // The dead target is tried again; the finished ones are not.
        assert!(rest.ends.contains_key(&dead), "cut at {k}");
    }
    // A cursor that is not the relay's, or of another dump; a target the
    // relay does not know; no map; both kinds of cursors.
    let mut other = dump_request(64, &all.cursors[0]);
    other.request.as_mut().unwrap().filter = "key != 0".into();
    let mut unknown = dump_request(64, "");
    unknown.targets = Some(pb::TargetSelector {
        targets: vec!["10.9.9.9:1".into()],
    });
    let mut mapless = dump_request(64, "");
    mapless.request.as_mut().unwrap().map = None;
    let mut both = dump_request(64, &all.cursors[0]);
    both.target_cursors = [(dead.clone(), "c".to_owned())].into();
    let total = hosts.len() + 1;
    for (req, reason, message) in [
        (
            dump_request(64, "fXXXX"),
            "CURSOR_INVALID",
            "cursor: the cursor is not a fleet cursor of this relay (altered, truncated, or sealed under another key)".to_owned(),
        ),
        (
            other,
            "CURSOR_OTHER_CALL",
            "cursor: the cursor was issued for another call (a dump's map, filter or fields; a watch's map, query or interval)".to_owned(),
        ),
        (
            unknown,
            "TARGET_UNKNOWN",
            format!("target \"10.9.9.9:1\" is not one of the relay's ({total}); ListTargets lists them"),
        ),
        (
            mapless,
            "INVALID_REQUEST",
            r#"the request names no map: set request.map (e.g. {"request":{"map":{"path":"demo/flows"}}})"#.to_owned(),
        ),
        (
            both,
            "INVALID_REQUEST",
            "give a fleet cursor (cursor) or each target's own (targetCursors), not both".to_owned(),
        ),
    ] {
        let e = c.dump_map(req).await.map(|_| ()).unwrap_err();
        assert_eq!(e.code(), Code::InvalidArgument, "{e:?}");
        assert_eq!(bpfmap_proto::status::reason(&e).as_deref(), Some(reason), "{e:?}");
        assert_eq!(e.message(), message);
    }
    relay.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grpcurl_gets_the_exact_fleet_top_k_and_the_targets_that_failed() {
    // Every host holds the same keys with values that differ by host: the
    // fleet's sums are the hosts' added up.
    let mut hosts = Vec::new();
    for h in 0..3u64 {
        let (fs, state) = (BpfFs::new(), tempfile::tempdir().unwrap());
        let (map, entries) = u64_hash_of(&fs, MAP, 0..50, move |k| k * (h + 1) % 97, 64);
        let daemon = Daemon::start(fs.path(), state.path()).await;
        hosts.push(Host {
            _fs: fs,
            _state: state,
            _map: map,
            daemon,
            entries,
        });
    }
    let (relay, dead, _, _state) = relay_with_dead(&hosts).await;
    let mut sums: BTreeMap<u64, u64> = BTreeMap::new();
    for h in 0..3u64 {
        for k in 0..50u64 {
            *sums.entry(k).or_default() += k * (h + 1) % 97;
        }
    }
    let mut want: Vec<(u64, u64)> = sums.into_iter().collect();
    want.sort_by(|a, b| {
        b.1.cmp(&a.1)
            .then(a.0.to_le_bytes().cmp(&b.0.to_le_bytes()))
    });
    want.truncate(5);
    let body = json!({"request": {"map": {"path": MAP}, "groupBy": ["key"], "aggregates": [{"op": "SUM", "field": "value"}], "limit": 5}});
    let (ok, out, err) = grpcurl(
        &["-plaintext", "-d", &body.to_string()],
        &relay.local_addr().to_string(),
        &["bpfmap.v1.FleetService/AggregateMap"],
    )
    .await;
    assert!(ok, "{err}");
    let answer = &json_stream(&out)[0];
    let got: Vec<(u64, u64)> = answer["groups"]
        .as_array()
        .unwrap()
        .iter()
        .map(|g| {
            let key = u64::from_le_bytes(
                base64_decode(g["group"]["keyBytes"].as_str().unwrap())[..8]
                    .try_into()
                    .unwrap(),
            );
            (
                key,
                g["group"]["values"][0].as_str().unwrap().parse().unwrap(),
            )
        })
        .collect();
    assert_eq!(got, want, "{out}");
    assert_eq!(answer["method"], json!("top_k"));
    assert_eq!(answer["failed"][0]["target"], json!(dead));
    assert_eq!(answer["failed"][0]["status"]["code"], json!("UNAVAILABLE"));
    // grpcurl sees the relay's services only.
    let (ok, out, _) = grpcurl(&["-plaintext"], &relay.local_addr().to_string(), &["list"]).await;
    assert!(ok);
    assert!(
        out.contains("bpfmap.v1.FleetService") && !out.contains("MapService"),
        "{out}"
    );
    relay.stop().await.unwrap();
}

fn base64_decode(s: &str) -> Vec<u8> {
    use base64::Engine as _;
    base64::engine::general_purpose::STANDARD.decode(s).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dump_cut_when_its_relay_is_killed_resumes_on_another_relay() {
    let hosts = hosts(4, 300).await;
    let dir = tempfile::tempdir().unwrap();
    let addr_a = process::free_addr("127.0.0.1");
    let a = relay_process(&hosts, dir.path(), addr_a);
    let mut c = wait_connect(addr_a).await;
    let first = read(&mut c, dump_request(32, ""), 6).await;
    drop(a);
    // Another relay process, sharing the first's cursor key.
    let addr_b = process::free_addr("127.0.0.1");
    let _b = relay_process(&hosts, dir.path(), addr_b);
    let mut c = wait_connect(addr_b).await;
    let rest = read(
        &mut c,
        dump_request(32, first.cursors.last().unwrap()),
        usize::MAX,
    )
    .await;
    let mut both = first.entries.clone();
    for (t, e) in rest.entries {
        both.entry(t).or_default().extend(e);
    }
    assert_exactly(&hosts, &both);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rotated_cursor_key_is_picked_up_and_the_previous_key_s_cursors_still_resume() {
    use std::os::unix::fs::PermissionsExt as _;
    let hosts = hosts(2, 300).await;
    let targets: Vec<String> = hosts.iter().map(target_of).collect();
    let state = tempfile::tempdir().unwrap();
    let config = bpfmap_relay::Config {
        targets: targets.clone(),
        state_dir: state.path().to_owned(),
        refresh: Duration::from_millis(200),
        ..Default::default()
    };
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let rotating = bpfmap_relay::Relay::start_on(&config, listener)
        .await
        .unwrap();
    let mut c = client(rotating.local_addr()).await;
    let before = read(&mut c, dump_request(32, ""), 3).await;
    // bpfmap-relay --rotate-cursor-key, beside the running relay.
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_test-bpfmap-relay"))
        .arg("--state-dir")
        .arg(state.path())
        .arg("--rotate-cursor-key")
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    assert!(
        String::from_utf8_lossy(&out.stdout).starts_with("rotated the fleet cursor key in "),
        "{out:?}"
    );
    let previous = state.path().join("fleet-cursor.key.previous");
    let mode = std::fs::metadata(&previous).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode, 0o600);
    // The running relay reads the keys again within a refresh: its new
    // cursors are sealed with the new key alone, which a relay holding only
    // that key opens.
    tokio::time::sleep(Duration::from_millis(600)).await;
    let after = read(&mut c, dump_request(32, ""), 1).await;
    let only_new = tempfile::tempdir().unwrap();
    let key = only_new.path().join("fleet-cursor.key");
    std::fs::copy(state.path().join("fleet-cursor.key"), &key).unwrap();
    std::fs::set_permissions(&key, std::fs::Permissions::from_mode(0o600)).unwrap();
    let other = relay(&targets, only_new.path()).await;
    let mut o = client(other.local_addr()).await;
    let resumed = read(&mut o, dump_request(32, &after.cursors[0]), usize::MAX).await;
    assert_eq!(resumed.ends.len(), 2, "{:?}", resumed.ends);
    let e = o
        .dump_map(dump_request(32, before.cursors.last().unwrap()))
        .await
        .map(|_| ())
        .unwrap_err();
    assert_eq!(
        (e.code(), bpfmap_proto::status::reason(&e).as_deref()),
        (Code::InvalidArgument, Some("CURSOR_INVALID")),
        "the previous key's cursor, where that key is not held"
    );
    // The relay that holds the previous key resumes its cursors: the rest,
    // once.
    let rest = read(
        &mut c,
        dump_request(32, before.cursors.last().unwrap()),
        usize::MAX,
    )
    .await;
    let mut both = before.entries.clone();
    for (t, e) in rest.entries {
        both.entry(t).or_default().extend(e);
    }
    assert_exactly(&hosts, &both);
    other.stop().await.unwrap();
    rotating.stop().await.unwrap();
}

/// A relay process (`test-bpfmap-relay`) over `hosts`, listening on
/// `addr`, its configuration and state (the cursor key) in `dir`: killed
/// when dropped.
fn relay_process(hosts: &[Host], dir: &std::path::Path, addr: SocketAddr) -> Reaped {
    let targets: Vec<Json> = hosts.iter().map(|h| json!(target_of(h))).collect();
    let config = dir.join(format!("relay-{}.toml", addr.port()));
    std::fs::write(
        &config,
        format!(
            "listen = \"{addr}\"\nstate_dir = \"{}\"\ntargets = {}\n",
            dir.display(),
            Json::Array(targets)
        ),
    )
    .unwrap();
    Reaped(
        std::process::Command::new(env!("CARGO_BIN_EXE_test-bpfmap-relay"))
            .arg("--config")
            .arg(&config)
            .stderr(std::process::Stdio::null())
            .spawn()
            .unwrap(),
    )
}

/// A relay in this process over `hosts` and an address where nothing
/// listens: the relay, that address, every target, the relay's state
/// directory.
async fn relay_with_dead(
    hosts: &[Host],
) -> (bpfmap_relay::Relay, String, Vec<String>, tempfile::TempDir) {
    let dead = dead_addr().to_string();
    let mut targets: Vec<String> = hosts.iter().map(target_of).collect();
    targets.push(dead.clone());
    let state = tempfile::tempdir().unwrap();
    let relay = relay(&targets, state.path()).await;
    (relay, dead, targets, state)
}

/// A client of the relay at `addr`, once it listens.
async fn wait_connect(addr: SocketAddr) -> FleetServiceClient<Channel> {
    for _ in 0..100 {
        if let Ok(c) = FleetServiceClient::connect(format!("http://{addr}")).await {
            return c;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    panic!("the relay at {addr} did not start");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fifty_daemons_with_every_fault_through_one_relay() {
    use bpfmap_tests::fleet::{FaultyFleet, Kind};
    let mut faulty = FaultyFleet::start(daemon_bin!(), 50, MAP_OF_FLEET);
    let mut restarts = faulty.restarts();
    let state = tempfile::tempdir().unwrap();
    let config = bpfmap_relay::Config {
        targets: faulty
            .targets()
            .iter()
            .map(|t| t.as_str().to_owned())
            .collect(),
        state_dir: state.path().to_owned(),
        client_tls: Some(faulty.relay_client_tls()),
        answer_timeout: Duration::from_secs(3),
        concurrency: 32,
        ..Default::default()
    };
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let relay = bpfmap_relay::Relay::start_on(&config, listener)
        .await
        .unwrap();
    let mut c = client(relay.local_addr()).await;
    let mut req = dump_request(500, "");
    req.request.as_mut().unwrap().map = map_ref(MAP_OF_FLEET);
    let mut stream = c.dump_map(req).await.unwrap().into_inner();
    let mut tallies = faulty.tallies();
    let mut ends = BTreeMap::new();
    while let Some(msg) = stream.message().await.unwrap() {
        let target: bpfmap_client::Target = msg.target.parse().unwrap();
        match msg.part.unwrap() {
            pb::fleet_service_dump_map_response::Part::Chunk(chunk) => {
                restarts.chunk_from(&target);
                let chunk = chunk_of(chunk);
                tallies.get_mut(&target).unwrap().add(&chunk);
            }
            pb::fleet_service_dump_map_response::Part::End(end) => {
                ends.insert(target, end);
            }
        }
    }
    let not_killed = faulty.finish(restarts);
    assert!(
        not_killed.is_empty(),
        "daemons never killed: {not_killed:?}"
    );
    for host in &faulty.hosts {
        let end = &ends[&host.target];
        let status = end.status.as_ref().unwrap();
        let code = (status.code.as_str(), status.reason.as_str());
        let tally = &tallies[&host.target];
        match host.kind {
            Kind::Healthy | Kind::Slow | Kind::Restarted => {
                assert_eq!(code, ("OK", ""), "{}: {end:?}", host.target);
                assert!(tally.exact(), "{}: {:?}", host.target, tally.wrong);
            }
            // Never answered: the relay's reasons (no daemon gave one).
            Kind::Dead | Kind::OtherCa => assert_eq!(
                code,
                ("UNAVAILABLE", "TARGET_UNREACHABLE"),
                "{}: {end:?}",
                host.target
            ),
            Kind::Frozen | Kind::BlackHole => assert_eq!(
                code,
                ("DEADLINE_EXCEEDED", "TARGET_TIMEOUT"),
                "{}: {end:?}",
                host.target
            ),
        }
    }
    // ListTargets names the failing targets, and why.
    let states = c
        .list_targets(pb::ListTargetsRequest {})
        .await
        .unwrap()
        .into_inner()
        .targets;
    for host in &faulty.hosts {
        let state = states
            .iter()
            .find(|s| s.target == host.target.as_str())
            .unwrap();
        assert_eq!(state.answering, host.kind.healthy(), "{state:?}");
    }
    relay.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn targets_the_policy_keeps_from_a_caller_end_in_band_with_a_stable_reason() {
    use bpfmap_client::{ConnectOptions, Fleet, FleetDumpOptions, FleetEvent};
    use futures::StreamExt as _;
    let hosts = hosts(2, 10).await;
    let (h0, h1) = (target_of(&hosts[0]), target_of(&hosts[1]));
    let state = tempfile::tempdir().unwrap();
    let config = bpfmap_relay::Config {
        targets: vec![h0.clone(), h1.clone()],
        state_dir: state.path().to_owned(),
        answer_timeout: Duration::from_secs(2),
        rules: vec![bpfmap_relay::RelayRule {
            identities: vec!["anonymous".into()],
            maps: vec!["**".into()],
            operations: vec![bpfmapd::Operation::Dump],
            targets: Some(vec![h0.clone()]),
        }],
        ..Default::default()
    };
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let relay = bpfmap_relay::Relay::start_on(&config, listener)
        .await
        .unwrap();
    let mut c = client(relay.local_addr()).await;
    // h1 is kept from the caller: its end says so, in-band.
    let got = read(&mut c, dump_request(64, ""), usize::MAX).await;
    assert_eq!(got.entries[&h0].len(), 10);
    let denied = got.ends[&h1].status.as_ref().unwrap();
    assert_eq!(
        (
            denied.code.as_str(),
            denied.reason.as_str(),
            denied.message.as_str()
        ),
        (
            "PERMISSION_DENIED",
            "PERMISSION_DENIED",
            "anonymous may not dump fleet/conns on this target"
        )
    );
    // Only h1, or an operation no rule grants: the call is refused.
    let mut only_h1 = dump_request(64, "");
    only_h1.targets = Some(pb::TargetSelector {
        targets: vec![h1.clone()],
    });
    let e = c.dump_map(only_h1).await.map(|_| ()).unwrap_err();
    assert_eq!(
        (
            e.code(),
            bpfmap_proto::status::reason(&e).as_deref(),
            e.message()
        ),
        (
            Code::PermissionDenied,
            Some("PERMISSION_DENIED"),
            "anonymous may not dump fleet/conns on any of the targets asked"
        )
    );
    let lookup = pb::FleetServiceLookupRequest {
        request: Some(pb::LookupRequest {
            map: map_ref(MAP),
            keys: vec![0u64.to_le_bytes().to_vec()],
            ..Default::default()
        }),
        targets: None,
    };
    let e = c.lookup(lookup).await.map(|_| ()).unwrap_err();
    assert_eq!(e.code(), Code::PermissionDenied, "{e:?}");
    // The library through the relay reads the reason as a daemon's own.
    let fleet = Fleet::via_relay(
        &format!("http://{}", relay.local_addr()),
        ConnectOptions::default(),
        [],
    )
    .await
    .unwrap();
    let mut run = fleet.dump(&MAP.parse().unwrap(), FleetDumpOptions::default());
    let mut reports = BTreeMap::new();
    while let Some(event) = run.next().await {
        if let FleetEvent::Done(r) = event {
            reports.insert(r.target.as_str().to_owned(), r);
        }
    }
    assert!(reports[&h0].is_ok(), "{:?}", reports[&h0]);
    let e = reports[&h1].error.as_ref().expect("h1 denied");
    assert_eq!(
        (e.code(), reason_of(e)),
        (Code::PermissionDenied, "PERMISSION_DENIED".to_owned())
    );
    relay.stop().await.unwrap();
}

/// The map of each host of a faulty fleet.
const MAP_OF_FLEET: &str = "fleet/conns";

/// A chunk of a fleet dump as the library reads it.
fn chunk_of(msg: pb::DumpMapResponse) -> bpfmap_client::Chunk {
    bpfmap_client::Chunk::from_proto(msg).expect("a well-formed chunk")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_daemons_audit_log_names_who_the_relay_calls_for() {
    let (fs, state) = (BpfFs::new(), tempfile::tempdir().unwrap());
    let (_map, _) = u64_hash_of(&fs, MAP, 0..10, |k| k, 16);
    let daemon = process::DaemonProcess::local(daemon_bin!(), fs.path(), state.path());
    let relay_state = tempfile::tempdir().unwrap();
    let relay = relay(&[daemon.addr.to_string()], relay_state.path()).await;
    let mut c = client(relay.local_addr()).await;
    let mut answers = c
        .get_map(pb::FleetServiceGetMapRequest {
            request: Some(pb::GetMapRequest { map: map_ref(MAP) }),
            targets: None,
        })
        .await
        .unwrap()
        .into_inner();
    let answer = answers.message().await.unwrap().unwrap();
    assert!(matches!(
        answer.answer,
        Some(pb::fleet_service_get_map_response::Answer::Map(_))
    ));
    // The relay called as itself (anonymous on plaintext), for its caller
    // (anonymous too): the daemon logs both.
    let line = wait_for_line(&daemon, "\"method\":\"GetMap\"").await;
    assert!(line.contains(r#""on_behalf_of":"\"anonymous\"""#), "{line}");
    relay.stop().await.unwrap();
}

/// The first line of the daemon's log containing `needle`.
async fn wait_for_line(daemon: &process::DaemonProcess, needle: &str) -> String {
    for _ in 0..50 {
        if let Some(l) = daemon.log().into_iter().find(|l| l.contains(needle)) {
            return l;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    panic!("no log line with {needle}: {:?}", daemon.log());
}

/// A fleet watch of every target, raw, from `cursor`.
fn watch_request(cursor: &str) -> pb::FleetServiceWatchMapRequest {
    pb::FleetServiceWatchMapRequest {
        request: Some(pb::WatchMapRequest {
            map: map_ref(MAP),
            raw: true,
            ..Default::default()
        }),
        targets: None,
        cursor: cursor.into(),
        ..Default::default()
    }
}

/// A fleet watch read round by round.
struct Rounds {
    stream: tonic::Streaming<pb::FleetServiceWatchMapResponse>,
}

/// An event: its type, key and value bytes.
type Event = (i32, Vec<u8>, Vec<u8>);

/// One round: each target's events (key, value bytes) and its other
/// messages, then the round's end.
#[derive(Debug, Default)]
struct Round {
    number: u64,
    events: BTreeMap<String, Vec<Event>>,
    resynced: Vec<String>,
    failing: BTreeMap<String, String>,
    end: pb::RoundEnd,
}

impl Rounds {
    async fn start(c: &mut FleetServiceClient<Channel>, cursor: &str) -> Self {
        let stream = c
            .watch_map(watch_request(cursor))
            .await
            .unwrap()
            .into_inner();
        Self { stream }
    }

    async fn next(&mut self) -> Round {
        use pb::fleet_service_watch_map_response::Part;
        let mut round = Round::default();
        loop {
            let msg = tokio::time::timeout(Duration::from_secs(30), self.stream.message())
                .await
                .expect("a message within 30 s")
                .expect("the watch goes on")
                .expect("the watch goes on");
            round.number = msg.round;
            match msg.part.expect("a part") {
                Part::Scan(s) => {
                    if s.resync {
                        round.resynced.push(msg.target.clone());
                    }
                    round
                        .events
                        .entry(msg.target)
                        .or_default()
                        .extend(s.events.into_iter().map(|e| {
                            let entry = e.entry.unwrap();
                            (e.r#type, entry.key.to_vec(), entry.value.to_vec())
                        }));
                }
                Part::Failing(s) | Part::Ended(s) => {
                    round.failing.insert(msg.target, s.code);
                }
                Part::RoundEnd(end) => {
                    round.end = end;
                    return round;
                }
            }
        }
    }

    /// Rounds until one for which `done` holds (at most 40).
    async fn until(&mut self, what: &str, mut done: impl FnMut(&Round) -> bool) -> Vec<Round> {
        let mut seen = Vec::new();
        for _ in 0..40 {
            let r = self.next().await;
            let stop = done(&r);
            seen.push(r);
            if stop {
                return seen;
            }
        }
        panic!("no round {what} in 40: {seen:#?}");
    }
}

fn key_value(k: u64, v: u64) -> (Vec<u8>, Vec<u8>) {
    (k.to_le_bytes().to_vec(), v.to_le_bytes().to_vec())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fleet_watch_follows_its_targets_names_failures_and_resumes_from_a_round() {
    let mut hosts = hosts(3, 10).await;
    let dead = dead_addr().to_string();
    let (h0, h1, h2) = (
        target_of(&hosts[0]),
        target_of(&hosts[1]),
        target_of(&hosts[2]),
    );
    let state = tempfile::tempdir().unwrap();
    let file = state.path().join("targets");
    std::fs::write(&file, format!("{h0}\n{h1}\n{dead}\n")).unwrap();
    let config = bpfmap_relay::Config {
        targets_file: Some(file.clone()),
        state_dir: state.path().to_owned(),
        refresh: Duration::from_secs(1),
        answer_timeout: Duration::from_secs(2),
        ..Default::default()
    };
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let relay = bpfmap_relay::Relay::start_on(&config, listener)
        .await
        .unwrap();
    let mut c = client(relay.local_addr()).await;
    let mut rounds = Rounds::start(&mut c, "").await;

    // The initial state of each target, named; the dead one failing.
    let first = rounds.next().await;
    assert_eq!(first.number, 1);
    for (h, t) in [(0, &h0), (1, &h1)] {
        let mut got: Vec<(Vec<u8>, Vec<u8>)> = first.events[t]
            .iter()
            .map(|(_, k, v)| (k.clone(), v.clone()))
            .collect();
        got.sort();
        let want: Vec<(Vec<u8>, Vec<u8>)> = (0..10)
            .map(|i| key_value(h * 1_000_000 + i, (h * 1_000_000 + i) * 7))
            .collect();
        assert_eq!(got, want, "{t}");
        assert!(
            first.events[t]
                .iter()
                .all(|e| e.0 == pb::EventType::Added as i32)
        );
    }
    // ListTargets: each daemon's version once probed, the dead one none.
    let mut states = Vec::new();
    for _ in 0..50 {
        states = c
            .list_targets(pb::ListTargetsRequest {})
            .await
            .unwrap()
            .into_inner()
            .targets;
        if states
            .iter()
            .any(|s| s.target == h0 && !s.version.is_empty())
        {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let version_of = |t: &str| {
        states
            .iter()
            .find(|s| s.target == t)
            .map(|s| s.version.clone())
            .unwrap()
    };
    assert_eq!(version_of(&h0), env!("CARGO_PKG_VERSION"));
    assert_eq!(version_of(&dead), "");
    let seen = rounds
        .until("naming the dead target failing", |r| {
            r.end.failing.contains(&dead)
        })
        .await;
    assert!(
        seen.iter()
            .any(|r| r.failing.get(&dead).map(String::as_str) == Some("UNAVAILABLE"))
    );

    // A change on one host: in one round, that entry only.
    update(&hosts[0]._map, &5u64.to_le_bytes(), &555u64.to_le_bytes());
    let seen = rounds
        .until("with the change", |r| {
            r.events.get(&h0).is_some_and(|e| !e.is_empty())
        })
        .await;
    let changes: Vec<_> = seen
        .iter()
        .flat_map(|r| r.events.values().flatten())
        .cloned()
        .collect();
    assert_eq!(
        changes,
        vec![(
            pb::EventType::Changed as i32,
            5u64.to_le_bytes().to_vec(),
            555u64.to_le_bytes().to_vec()
        )]
    );

    // A target added to the targets file is taken up, one removed dropped.
    let early = read(&mut c, dump_request(64, ""), 1).await.cursors[0].clone();
    std::fs::write(&file, format!("{h0}\n{h2}\n{dead}\n")).unwrap();
    let (mut added, mut dropped) = (false, false);
    let seen = rounds
        .until("adding h2 and dropping h1", |r| {
            added |= r.end.added.contains(&h2);
            dropped |= r.end.dropped.contains(&h1);
            added && dropped && r.events.contains_key(&h2)
        })
        .await;
    let h2_events: Vec<_> = seen
        .iter()
        .filter_map(|r| r.events.get(&h2))
        .flatten()
        .collect();
    assert_eq!(h2_events.len(), 10, "h2's initial state: {h2_events:?}");
    let after = rounds.next().await;
    assert!(!after.events.contains_key(&h1) && !after.end.answered.contains(&h1));

    // A daemon stopped is failing; started again on its address, recovered.
    let restarted = {
        let h = hosts.remove(0);
        let mut config = h.daemon.config.clone();
        config.listen = h.daemon.running.local_addr();
        h.daemon.stop().await;
        rounds
            .until("with h0 failing", |r| r.end.failing.contains(&h0))
            .await;
        let daemon = Daemon::start_with(config).await;
        hosts.insert(0, Host { daemon, ..h });
        rounds
            .until("with h0 recovered", |r| r.end.recovered.contains(&h0))
            .await
    };
    assert!(
        restarted.last().unwrap().resynced.contains(&h0),
        "a restarted daemon sends its state again"
    );

    // Cut, two changes, resumed from the last round's cursor: the changes
    // since, once each, nothing else.
    let last = rounds
        .until("steady", |r| {
            r.end.answered.contains(&h0) && r.end.answered.contains(&h2)
        })
        .await;
    let cursor = last.last().unwrap().end.cursor.clone();
    drop(rounds);
    update(&hosts[0]._map, &6u64.to_le_bytes(), &666u64.to_le_bytes());
    update(
        &hosts[2]._map,
        &2_000_003u64.to_le_bytes(),
        &777u64.to_le_bytes(),
    );
    let mut resumed = Rounds::start(&mut c, &cursor).await;
    // The two changes come in one round or in two (each daemon scans on
    // its own clock).
    let (mut h0_changed, mut h2_changed) = (false, false);
    let seen = resumed
        .until("with both changes", |r| {
            h0_changed |= r.events.get(&h0).is_some_and(|e| !e.is_empty());
            h2_changed |= r.events.get(&h2).is_some_and(|e| !e.is_empty());
            h0_changed && h2_changed
        })
        .await;
    let mut got: PerTarget = BTreeMap::new();
    for r in &seen {
        for (t, events) in &r.events {
            got.entry(t.clone())
                .or_default()
                .extend(events.iter().map(|(_, k, v)| (k.clone(), v.clone())));
        }
    }
    assert_eq!(got[&h0], vec![key_value(6, 666)]);
    assert_eq!(got[&h2], vec![key_value(2_000_003, 777)]);
    assert!(
        !got.contains_key(&h1),
        "a dropped target is not watched again"
    );

    // A dump resumed from a cursor of before h1 was dropped: h1 ends
    // in-band, NOT_FOUND, where it stood.
    let resumed = read(&mut c, dump_request(64, &early), usize::MAX).await;
    let gone = resumed.ends[&h1].status.as_ref().unwrap();
    assert_eq!(
        (
            gone.code.as_str(),
            gone.reason.as_str(),
            gone.message.as_str()
        ),
        (
            "NOT_FOUND",
            "TARGET_GONE",
            "no longer one of the relay's targets"
        )
    );
    assert!(!resumed.ends.contains_key(&h2), "not one of the cursor's");

    // A cursor that is not the relay's, or a dump's.
    let dump_cursor = read(&mut c, dump_request(64, ""), 1).await.cursors[0].clone();
    for (bad, reason) in [
        ("fXXXX", "CURSOR_INVALID"),
        (dump_cursor.as_str(), "CURSOR_OTHER_CALL"),
    ] {
        let e = c
            .watch_map(watch_request(bad))
            .await
            .map(|_| ())
            .unwrap_err();
        assert_eq!(e.code(), Code::InvalidArgument, "{e:?}");
        assert_eq!(
            bpfmap_proto::status::reason(&e).as_deref(),
            Some(reason),
            "{e:?}"
        );
    }
    relay.stop().await.unwrap();
}

/// A Python with grpcio and grpcio-tools: `$BPFMAP_PYTHON_GRPC`, or
/// python3 when it has them.
fn python_with_grpc() -> String {
    let python = std::env::var("BPFMAP_PYTHON_GRPC").unwrap_or_else(|_| "python3".into());
    let found = std::process::Command::new(&python)
        .args(["-c", "import grpc, grpc_tools"])
        .output()
        .is_ok_and(|o| o.status.success());
    assert!(
        found,
        "{python} cannot import grpc and grpc_tools: this test needs a Python with grpcio and grpcio-tools (set $BPFMAP_PYTHON_GRPC; install them with `pip install grpcio grpcio-tools`; .ci/run does)"
    );
    python
}

/// Runs `cmd` to its end off the runtime's threads (the relay runs on them).
async fn run_blocking(mut cmd: std::process::Command) -> std::process::Output {
    tokio::task::spawn_blocking(move || cmd.output().unwrap())
        .await
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_python_client_dumps_the_fleet_and_resumes_it_with_the_cursor() {
    let python = python_with_grpc();
    let hosts = hosts(3, 300).await;
    let (relay, dead, _, _state) = relay_with_dead(&hosts).await;
    // Stubs generated from the proto, as a user of another language would.
    let stubs = tempfile::tempdir().unwrap();
    let proto = concat!(env!("CARGO_MANIFEST_DIR"), "/../proto");
    let mut protoc = std::process::Command::new(&python);
    protoc
        .args(["-m", "grpc_tools.protoc", "-I", proto])
        .arg(format!("--python_out={}", stubs.path().display()))
        .arg(format!("--grpc_python_out={}", stubs.path().display()))
        .arg(format!("{proto}/bpfmap/v1/map_service.proto"))
        .arg(format!("{proto}/bpfmap/v1/fleet_service.proto"));
    let out = run_blocking(protoc).await;
    assert!(
        out.status.success(),
        "protoc: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/python/fleet_dump.py");
    let mut client = std::process::Command::new(&python);
    client
        .arg(script)
        .arg(stubs.path())
        .arg(relay.local_addr().to_string())
        .args([MAP, "5"]);
    let out = run_blocking(client).await;
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let got: Json = serde_json::from_slice(&out.stdout).unwrap();
    // Every host's entries exactly once across the cut.
    let mut entries = PerTarget::new();
    for (target, list) in got["entries"].as_object().unwrap() {
        let decode = |v: &Json| {
            let s = v.as_str().unwrap();
            (0..s.len())
                .step_by(2)
                .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
                .collect::<Vec<u8>>()
        };
        entries.insert(
            target.clone(),
            list.as_array()
                .unwrap()
                .iter()
                .map(|kv| (decode(&kv[0]), decode(&kv[1])))
                .collect(),
        );
    }
    assert_exactly(&hosts, &entries);
    let first: usize = got["first_ends"].as_object().unwrap().len();
    assert!(first < 4, "the cut came before every target ended");
    for h in &hosts {
        assert_eq!(
            got["ends"][target_of(h)],
            json!({"code": "OK", "entries": got["ends"][target_of(h)]["entries"], "complete": true})
        );
    }
    assert_eq!(got["ends"][&dead]["code"], "UNAVAILABLE");
    assert_eq!(got["bad_cursor"], "INVALID_ARGUMENT", "{got}");
    relay.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bpfmapctl_through_the_relay_prints_what_direct_fan_out_prints() {
    let hosts = hosts(3, 50).await;
    let (relay, dead, targets, _state) = relay_with_dead(&hosts).await;
    let relay_url = format!("http://{}", relay.local_addr());
    let typed = ["--key-type", "__u64", "--value-type", "__u64"];
    let key = format!("{}", 1_000_007u64);
    let commands: Vec<Vec<&str>> = vec![
        vec!["list"],
        vec!["show", MAP],
        [&typed[..], &["lookup", MAP, key.as_str()]].concat(),
        vec!["dump", MAP],
        [&typed[..], &["dump", MAP, "--filter", "value % 2 == 0"]].concat(),
        [
            &typed[..],
            &[
                "top",
                MAP,
                "--by",
                "sum(value)",
                "--group-by",
                "key",
                "--limit",
                "3",
            ],
        ]
        .concat(),
        // Each target's initial state, until the deadline.
        [&typed[..], &["--deadline", "4", "watch", MAP]].concat(),
    ];
    for command in commands {
        let mut direct: Vec<&str> = Vec::new();
        for t in &targets {
            direct.extend(["--target", t.as_str()]);
        }
        direct.extend(["--connect-timeout", "2"]);
        direct.extend(&command);
        let mut relayed = vec!["--relay", relay_url.as_str()];
        relayed.extend(&command);
        let (r1, out1, err1) = ctl(&direct).await;
        let (r2, out2, err2) = ctl(&relayed).await;
        // Lines in any order; a watch's bookmarks (cursors and revisions
        // of their own) left out.
        let sorted = |s: &str| {
            let mut lines: Vec<String> = s
                .lines()
                .filter(|l| !l.contains("\"bookmark\":{"))
                .map(str::to_owned)
                .collect();
            lines.sort();
            lines
        };
        let (a, b) = (sorted(&out1), sorted(&out2));
        assert!(!a.is_empty(), "{command:?}: {err1}");
        let differ = a.iter().zip(&b).find(|(x, y)| x != y);
        assert!(
            a.len() == b.len() && differ.is_none(),
            "{command:?}: {} lines directly, {} through the relay; first difference {differ:?}\n{err1}\n{err2}",
            a.len(),
            b.len()
        );
        assert_eq!(
            r1.as_ref().map_err(|e| e.to_string()).err(),
            r2.as_ref().map_err(|e| e.to_string()).err(),
            "{command:?}: {err2}"
        );
        // A top K's summaries: the same work, the same failure.
        if command.contains(&"top") {
            assert_eq!(sorted(&err2), sorted(&err1), "{command:?}");
        }
        // The dead target is named in both summaries.
        if command.contains(&"dump") || command.contains(&"list") {
            assert!(
                err1.contains(&dead) && err2.contains(&dead),
                "{err1}\n{err2}"
            );
        }
    }
    // One target of the relay's, by its name; one it does not know.
    let one = target_of(&hosts[1]);
    let started = std::time::Instant::now();
    let (r, out, err) = ctl(&["--relay", &relay_url, "--target", &one, "dump", MAP]).await;
    let took = started.elapsed();
    r.unwrap_or_else(|e| panic!("{e}: {err}"));
    let lines = json_lines(&out);
    assert_eq!(lines.len(), 50);
    assert!(lines.iter().all(|l| l["target"] == one.as_str()));
    // The command ends with its target's end, not after retrying a
    // finished call (it once waited 15.5 s for nothing); the margin is
    // wide for a busy machine.
    assert!(
        took < std::time::Duration::from_secs(5),
        "a 50-entry dump through the relay took {took:?}"
    );
    let (r, _, _) = ctl(&["--relay", &relay_url, "--target", "10.9.9.9:1", "list"]).await;
    let e = r.unwrap_err().to_string();
    assert!(e.contains("not one of the relay's"), "{e}");
    let (r, _, _) = ctl(&["--relay", &relay_url, "drain", MAP]).await;
    assert!(
        r.unwrap_err()
            .to_string()
            .contains("drain is not served by the relay")
    );
    relay.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_caller_that_reads_slowly_holds_the_relay_to_its_bounds() {
    const ENTRIES: u64 = 400_000;
    let hosts = hosts(4, ENTRIES).await;
    let work = tempfile::tempdir().unwrap();
    let addr = process::free_addr("127.0.0.1");
    let child = relay_process(&hosts, work.path(), addr);
    let mut c = wait_connect(addr).await.max_decoding_message_size(64 << 20);
    let (_, before) = bpfmap_tests::fleet::memory_mib_of(child.0.id());
    // One message, then nothing read for 3 s: the relay stops reading the
    // daemons instead of queueing their entries.
    let mut stream = c.dump_map(dump_request(0, "")).await.unwrap().into_inner();
    let mut got = Delivered::default();
    got.add(stream.message().await.unwrap().unwrap());
    tokio::time::sleep(Duration::from_secs(3)).await;
    let (stalled, _) = bpfmap_tests::fleet::memory_mib_of(child.0.id());
    let mut bytes = 0usize;
    while let Some(msg) = stream.message().await.unwrap() {
        bytes += prost::Message::encoded_len(&msg);
        got.add(msg);
    }
    let (_, peak) = bpfmap_tests::fleet::memory_mib_of(child.0.id());
    drop(child);
    assert_exactly(&hosts, &got.entries);
    let sent = bytes as f64 / (1 << 20) as f64;
    println!(
        "relay: {before:.1} MiB before, {stalled:.1} MiB while the caller read nothing, peak {peak:.1} MiB; {sent:.1} MiB sent"
    );
    // Stalled, it holds what HTTP/2 lets each target's stream send (2 MiB
    // windows) and a few chunks queued: not the dump.
    assert!(
        stalled - before < sent / 2.0,
        "the relay grew by {:.1} MiB while its caller read nothing, for {sent:.1} MiB to send",
        stalled - before
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_callers_deadline_ends_slow_targets_in_band_before_it_passes() {
    let hosts = hosts(2, 100).await;
    // Accepts connections (the kernel's backlog) and never answers.
    let frozen = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let frozen_target = frozen.local_addr().unwrap().to_string();
    let mut targets: Vec<String> = hosts.iter().map(target_of).collect();
    targets.push(frozen_target.clone());
    let state = tempfile::tempdir().unwrap();
    let config = bpfmap_relay::Config {
        targets,
        state_dir: state.path().to_owned(),
        answer_timeout: Duration::from_secs(30),
        ..Default::default()
    };
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let relay = bpfmap_relay::Relay::start_on(&config, listener)
        .await
        .unwrap();
    let mut c = client(relay.local_addr()).await;
    let mut req = tonic::Request::new(pb::FleetServiceAggregateMapRequest {
        request: Some(pb::AggregateMapRequest {
            map: map_ref(MAP),
            aggregates: vec![pb::Aggregate {
                op: pb::aggregate::Op::Count as i32,
                field: String::new(),
            }],
            ..Default::default()
        }),
        targets: None,
    });
    req.set_timeout(Duration::from_secs(2));
    let started = std::time::Instant::now();
    let answer = c
        .aggregate_map(req)
        .await
        .expect("an answer before the deadline")
        .into_inner();
    assert!(started.elapsed() < Duration::from_secs(2));
    assert_eq!(answer.failed.len(), 1, "{answer:?}");
    assert_eq!(answer.failed[0].target, frozen_target);
    let late = answer.failed[0].status.as_ref().unwrap();
    assert_eq!(
        (late.code.as_str(), late.reason.as_str()),
        ("DEADLINE_EXCEEDED", "CALL_DEADLINE")
    );
    assert_eq!(
        answer.method, "merge",
        "no limit: every group of every target"
    );
    let mut answered = answer.answered.clone();
    answered.sort();
    let mut want: Vec<String> = hosts.iter().map(target_of).collect();
    want.sort();
    assert_eq!(answered, want);
    // One group (no group-by): the count of both hosts' entries.
    assert_eq!(answer.groups.len(), 1);
    let count = &answer.groups[0].group.as_ref().unwrap().values[0];
    assert_eq!(
        count.kind,
        Some(prost_types::value::Kind::StringValue("200".into()))
    );
    drop(frozen);
    relay.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_library_resumes_a_dump_through_a_relay_that_restarts() {
    use bpfmap_client::{ConnectOptions, DumpOptions, Fleet, FleetDumpOptions, FleetEvent};
    use futures::StreamExt as _;
    let hosts = hosts(3, 100_000).await;
    let work = tempfile::tempdir().unwrap();
    let addr = process::free_addr("127.0.0.1");
    let start = || relay_process(&hosts, work.path(), addr);
    let mut first = Some(start());
    wait_connect(addr).await;
    let fleet = Fleet::via_relay(&format!("http://{addr}"), ConnectOptions::default(), [])
        .await
        .unwrap();
    assert_eq!(fleet.targets().len(), 3);
    let options =
        FleetDumpOptions::default().with_dump(DumpOptions::default().with_chunk_size(1000));
    let mut run = fleet.dump(&MAP.parse().unwrap(), options);
    let mut got = PerTarget::new();
    let mut reports = Vec::new();
    let mut second = None;
    let mut answers = 0;
    while let Some(event) = run.next().await {
        match event {
            FleetEvent::Answer { target, answer } => {
                answers += 1;
                got.entry(target.as_str().to_owned())
                    .or_default()
                    .extend(answer.chunk.iter().map(|e| match e.value {
                        bpfmap_client::ValueRef::Single(v) => (e.key.to_vec(), v.to_vec()),
                        _ => unreachable!("a hash map"),
                    }));
                if answers == 5 {
                    // The relay dies and comes back on its address.
                    drop(first.take());
                    second = Some(start());
                }
            }
            FleetEvent::Done(report) => reports.push(report),
            _ => {}
        }
    }
    assert!(second.is_some(), "the relay was restarted");
    drop(second);
    assert_exactly(&hosts, &got);
    assert_eq!(reports.len(), 3);
    for r in &reports {
        assert!(r.is_ok() && r.complete, "{r:?}");
    }
    // The relay's restart cut the dump: it resumed from a fleet cursor.
    assert!(reports.iter().any(|r| r.resumes >= 1), "{reports:?}");
}

/// A child process killed and reaped when dropped.
struct Reaped(std::process::Child);

impl Drop for Reaped {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}
