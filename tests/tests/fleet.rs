//! A fleet of real daemons on this machine, each its own "host": its own
//! loopback address (127.0.0.N), its own bpffs root holding maps whose
//! contents differ per host, its own state directory; all with mutual TLS
//! from one CA and certificates that carry a shared name. Faults, each
//! asserted: a daemon that is not listening, one that is frozen (SIGSTOP),
//! one with a certificate from another CA, one that denies the caller, one
//! without the map, one killed and restarted mid-dump, and connections cut
//! again and again by a proxy.

use std::{
    collections::{BTreeMap, BTreeSet, HashMap},
    sync::atomic::Ordering,
    time::{Duration, Instant},
};

use bpfmap_client::{
    ClientTls, Code, ConnectOptions, DumpOptions, Fleet, FleetDumpOptions, FleetEvent,
    FleetOptions, LookupOptions, MapName, RetryPolicy, Target, TargetReport, Value,
};
use bpfmap_tests::{
    dns::{DnsServer, Zone},
    pki::{Name, Pki, Validity},
    process::DaemonProcess,
    *,
};
use bpfmapd::{Config, Operation, RuleConfig};
use futures::StreamExt as _;
use serde_json::Value as Json;

use bpfmap_tests::fleet::{FaultyFleet, Kind, READER};
const MAP: &str = "fleet/conns";

fn rules() -> Vec<RuleConfig> {
    vec![RuleConfig {
        identities: vec![READER.into()],
        maps: vec!["fleet/**".into()],
        operations: vec![Operation::List, Operation::Dump, Operation::Lookup],
    }]
}

/// Host `n`'s map: `entries` keys n * 1,000,000 + i (u64 LE) -> key * 7.
fn host_map(fs: &BpfFs, n: u64, entries: u64) -> (OwnedMap, Entries) {
    let first = n * 1_000_000;
    let max_entries = (entries as u32).next_power_of_two().max(64);
    u64_hash_of(fs, MAP, first..first + entries, |k| k * 7, max_entries)
}

/// One host: its bpffs, state, daemon (in process or a process of its own).
struct Host {
    _fs: BpfFs,
    _state: tempfile::TempDir,
    _map: Option<OwnedMap>,
    expected: Entries,
    daemon: Option<Daemon>,
    process: Option<DaemonProcess>,
}

async fn in_process(
    ip: &str,
    port: u16,
    pki: &Pki,
    rules: Vec<RuleConfig>,
    map: Option<(u64, u64)>,
) -> Host {
    let fs = BpfFs::new();
    let state = tempfile::tempdir().unwrap();
    let (map, expected) = match map {
        Some((n, entries)) => {
            let (m, e) = host_map(&fs, n, entries);
            (Some(m), e)
        }
        None => (None, Entries::new()),
    };
    let daemon = Daemon::start_with(Config {
        listen: format!("{ip}:{port}").parse().unwrap(),
        tls: Some(pki.server_files()),
        rules,
        ..Daemon::config(fs.path(), state.path())
    })
    .await;
    Host {
        _fs: fs,
        _state: state,
        _map: map,
        expected,
        daemon: Some(daemon),
        process: None,
    }
}

fn process_host(ip: &str, port: u16, pki: &Pki, n: u64, entries: u64) -> Host {
    let fs = BpfFs::new();
    let state = tempfile::tempdir().unwrap();
    let (map, expected) = host_map(&fs, n, entries);
    let extra = bpfmap_tests::fleet::tls_config(pki);
    let process = DaemonProcess::start(
        daemon_bin!(),
        fs.path(),
        state.path(),
        format!("{ip}:{port}").parse().unwrap(),
        &extra,
    );
    Host {
        _fs: fs,
        _state: state,
        _map: Some(map),
        expected,
        daemon: None,
        process: Some(process),
    }
}

/// A port free on every address used here.
fn common_port() -> u16 {
    for _ in 0..50 {
        let port = process::free_addr("127.0.0.1").port();
        let free = (2..=60).all(|n| {
            std::net::TcpListener::bind(("127.0.0.".to_owned() + &n.to_string(), port)).is_ok()
        });
        if free {
            return port;
        }
    }
    panic!("no port free on 127.0.0.2-60");
}

fn tls(pki: &Pki) -> ClientTls {
    // Every daemon's certificate carries "localhost": the fleet's shared
    // name, checked whatever address a target has.
    pki.client("reader", Name::Spiffe(READER), Validity::Now)
        .with_server_name("localhost")
}

/// A report's error as text ("" when OK).
fn text(r: &TargetReport) -> String {
    r.error
        .as_ref()
        .map(ToString::to_string)
        .unwrap_or_default()
}

fn target(ip: &str, port: u16) -> Target {
    format!("{ip}:{port}").parse().unwrap()
}

/// Collects a fleet dump: each target's entries (failing on a key twice)
/// and report.
async fn dump(
    fleet: &Fleet,
    mut on_chunk: impl FnMut(&Target),
) -> BTreeMap<Target, (Entries, TargetReport)> {
    let options =
        FleetDumpOptions::default().with_dump(DumpOptions::default().with_chunk_size(500));
    let mut run = fleet.dump(&MAP.parse::<MapName>().unwrap(), options);
    let mut entries: HashMap<Target, Vec<bpfmap_client::Entry>> = HashMap::new();
    let mut out = BTreeMap::new();
    while let Some(event) = run.next().await {
        match event {
            FleetEvent::Answer { target, answer } => {
                on_chunk(&target);
                entries.entry(target).or_default().extend(answer.chunk);
            }
            FleetEvent::Done(report) => {
                let got = collect_unique(entries.remove(&report.target).unwrap_or_default());
                assert!(
                    out.insert(report.target.clone(), (got, report)).is_none(),
                    "two reports"
                );
            }
            other => panic!("{other:?}"),
        }
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fleet_of_daemons_with_faults_delivers_each_host_exactly_its_entries() {
    let _shared = MEASURED.read().await;
    let pki = Pki::new();
    let port = common_port();
    // 20 healthy hosts, 127.0.0.2 to .21, each with its own entries.
    let mut hosts: BTreeMap<Target, Host> = BTreeMap::new();
    for n in 2..=21u64 {
        let ip = format!("127.0.0.{n}");
        hosts.insert(
            target(&ip, port),
            in_process(&ip, port, &pki, rules(), Some((n, 2000 + n * 37))).await,
        );
    }
    // A daemon that is not listening.
    let stopped = target("127.0.0.30", port);
    // A frozen daemon.
    let frozen_host = process_host("127.0.0.31", port, &pki, 31, 1000);
    frozen_host.process.as_ref().unwrap().signal(libc::SIGSTOP);
    let frozen = target("127.0.0.31", port);
    // A daemon whose certificate comes from another CA.
    let other_ca = Pki::new();
    let _foreign = in_process("127.0.0.32", port, &other_ca, rules(), Some((32, 100))).await;
    let foreign = target("127.0.0.32", port);
    // A daemon that denies the caller.
    let deny_rules = vec![RuleConfig {
        identities: vec!["spiffe://example.org/fleet/someone-else".into()],
        ..rules()[0].clone()
    }];
    let _denier = in_process("127.0.0.33", port, &pki, deny_rules, Some((33, 100))).await;
    let denier = target("127.0.0.33", port);
    // A daemon without the map.
    let _bare = in_process("127.0.0.34", port, &pki, rules(), None).await;
    let bare = target("127.0.0.34", port);
    // A daemon killed and restarted in the middle of its dump.
    let mut restarted_host = process_host("127.0.0.35", port, &pki, 35, 200_000);
    let restarted = target("127.0.0.35", port);
    // Three hosts reached through proxies that cut every connection after
    // 48 KiB from the daemon.
    let mut proxies = Vec::new();
    for (n, proxy_n) in [(39u64, 36u8), (40, 37), (41, 38)] {
        let ip = format!("127.0.0.{n}");
        let host = in_process(&ip, port, &pki, rules(), Some((n, 20_000))).await;
        let proxy = CutProxy::start_on(
            format!("127.0.0.{proxy_n}:{port}").parse().unwrap(),
            format!("{ip}:{port}").parse().unwrap(),
            48 << 10,
            true,
        )
        .await;
        hosts.insert(target(&format!("127.0.0.{proxy_n}"), port), host);
        proxies.push(proxy);
    }
    let proxied: Vec<Target> = (36..=38)
        .map(|n| target(&format!("127.0.0.{n}"), port))
        .collect();

    let mut targets: Vec<Target> = hosts.keys().cloned().collect();
    targets.extend([
        stopped.clone(),
        frozen.clone(),
        foreign.clone(),
        denier.clone(),
        bare.clone(),
        restarted.clone(),
    ]);
    // The same target twice is one target.
    targets.push(targets[0].clone());
    let fleet = Fleet::new(
        targets,
        ConnectOptions::default()
            .with_tls(tls(&pki))
            .with_connect_timeout(Duration::from_secs(1))
            .with_retry(
                RetryPolicy::default()
                    .with_max_attempts(20)
                    .with_min_delay(Duration::from_millis(50))
                    .with_max_delay(Duration::from_millis(500)),
            ),
    )
    .with_options(
        FleetOptions::default()
            .with_concurrency(8)
            .with_answer_timeout(Duration::from_secs(2)),
    );
    assert_eq!(fleet.targets().len(), hosts.len() + 6);

    // Kill the restarting daemon once its first chunk has arrived; bring it
    // back half a second later.
    let (restart_tx, restart_rx) = std::sync::mpsc::channel::<()>();
    let restarter = std::thread::spawn(move || {
        let killed = restart_rx.recv().is_ok();
        if killed {
            restarted_host.process.as_mut().unwrap().kill9();
            std::thread::sleep(Duration::from_millis(500));
            restarted_host.process.as_mut().unwrap().restart();
        }
        (restarted_host, killed)
    });
    let t = Instant::now();
    let results = {
        let restarted = restarted.clone();
        let mut sent = false;
        dump(&fleet, move |target| {
            if *target == restarted && !sent {
                sent = true;
                let _ = restart_tx.send(());
            }
        })
        .await
    };
    let took = t.elapsed();
    let (restarted_host, killed) = restarter.join().unwrap();
    eprintln!("{} targets dumped in {took:?}", results.len());
    assert!(killed, "the restarting daemon sent a chunk");

    let report = |t: &Target| {
        &results
            .get(t)
            .unwrap_or_else(|| panic!("no report for {t}"))
            .1
    };
    for (t, host) in &hosts {
        let (got, r) = &results[t];
        assert_eq!(r.code(), Code::Ok, "{t}: {}", text(r));
        assert!(r.complete, "{t}");
        assert_eq!(r.entries, host.expected.len() as u64, "{t}");
        assert_eq!(
            got, &host.expected,
            "{t}: the entries of its own map, each once"
        );
    }
    for t in &proxied {
        assert!(report(t).resumes >= 1, "{t}: the cuts forced resumes");
    }
    let (got, r) = &results[&restarted];
    assert_eq!(r.code(), Code::Ok, "restarted: {}", text(r));
    assert!(r.resumes >= 1, "the restarted daemon's dump resumed");
    assert_eq!(
        got, &restarted_host.expected,
        "the restarted daemon's entries, each once"
    );

    let r = report(&stopped);
    assert_eq!(r.code(), Code::Unavailable, "stopped: {}", text(r));
    assert!(text(r).to_lowercase().contains("connect"), "{}", text(r));
    // The report holds the error as the call ended with it: the transport's
    // status, and under it the refused connection.
    let e = r.error.as_ref().unwrap();
    assert_eq!(e.status().map(|s| s.code()), Some(Code::Unavailable));
    let refused = std::iter::successors(std::error::Error::source(e), |e| e.source())
        .find_map(|e| e.downcast_ref::<std::io::Error>());
    assert_eq!(
        refused.map(std::io::Error::kind),
        Some(std::io::ErrorKind::ConnectionRefused),
        "{e:?}"
    );
    let r = report(&frozen);
    assert_eq!(r.code(), Code::DeadlineExceeded, "frozen: {}", text(r));
    let r = report(&foreign);
    assert_eq!(r.code(), Code::Unavailable, "another CA: {}", text(r));
    assert!(
        text(r).to_lowercase().contains("certificate"),
        "{}",
        text(r)
    );
    assert_eq!(
        report(&denier).code(),
        Code::PermissionDenied,
        "{}",
        text(report(&denier))
    );
    assert_eq!(
        report(&bare).code(),
        Code::NotFound,
        "{}",
        text(report(&bare))
    );
    // The frozen host cost its timeout, not the run: the others went on.
    assert!(took < Duration::from_secs(60), "{took:?}");

    // One Lookup everywhere: each host finds only its own key.
    let keys: Vec<Vec<u8>> = [2u64, 7, 21]
        .iter()
        .map(|n| (n * 1_000_000).to_le_bytes().to_vec())
        .collect();
    let run = Fleet::new(
        hosts.keys().cloned(),
        ConnectOptions::default().with_tls(tls(&pki)),
    )
    .lookup(
        &MAP.parse().unwrap(),
        keys.clone(),
        LookupOptions::default(),
    );
    for (report, answers) in run.collect().await {
        assert!(report.is_ok(), "{}: {}", report.target, text(&report));
        let found: Vec<bool> = answers[0].iter().map(|r| r.found()).collect();
        let n: u64 = report
            .target
            .as_str()
            .split(['.', ':'])
            .nth(3)
            .unwrap()
            .parse()
            .unwrap();
        let want: Vec<bool> = [2u64, 7, 21].iter().map(|k| *k == n).collect();
        if (36..=38).contains(&n) {
            assert_eq!(found, [false, false, false]);
        } else {
            assert_eq!(found, want, "{}", report.target);
        }
    }
    let mut frozen_host = frozen_host;
    frozen_host.process.as_ref().unwrap().signal(libc::SIGCONT);
    frozen_host.process.as_mut().unwrap().kill9();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropping_a_fleet_dump_stops_every_daemon_s_dump() {
    let _shared = MEASURED.read().await;
    let pki = Pki::new();
    let port = common_port();
    let mut hosts = Vec::new();
    for n in 2..=6u64 {
        hosts.push(
            in_process(
                &format!("127.0.0.{n}"),
                port,
                &pki,
                rules(),
                Some((n, 200_000)),
            )
            .await,
        );
    }
    let fleet = Fleet::new(
        (2..=6).map(|n| target(&format!("127.0.0.{n}"), port)),
        ConnectOptions::default().with_tls(tls(&pki)),
    );
    let options =
        FleetDumpOptions::default().with_dump(DumpOptions::default().with_chunk_size(100));
    let mut run = fleet.dump(&MAP.parse().unwrap(), options);
    let mut chunks = 0;
    while chunks < 20 {
        if let Some(FleetEvent::Answer { .. }) = run.next().await {
            chunks += 1;
        }
    }
    let active = || {
        hosts
            .iter()
            .map(|h| {
                h.daemon
                    .as_ref()
                    .unwrap()
                    .running
                    .stats()
                    .active
                    .load(Ordering::SeqCst)
            })
            .sum::<usize>()
    };
    assert!(active() > 0, "dumps are running");
    drop(run);
    let t = Instant::now();
    while active() > 0 {
        assert!(
            t.elapsed() < Duration::from_secs(5),
            "{} dumps still running",
            active()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // And the connections are closed.
    let t = Instant::now();
    while hosts
        .iter()
        .map(|h| h.daemon.as_ref().unwrap().running.open_connections())
        .sum::<usize>()
        > 0
    {
        assert!(
            t.elapsed() < Duration::from_secs(5),
            "connections still open"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bpfmapctl_reads_a_fleet_found_by_dns_and_names_each_failure() {
    let _shared = MEASURED.read().await;
    let pki = Pki::new();
    let port = common_port();
    // 22 daemons on one port, found by one name (A records); one more name
    // whose addresses include one where nothing listens.
    let mut hosts: BTreeMap<String, Host> = BTreeMap::new();
    let mut zone = Zone::default();
    for n in 2..=23u64 {
        let ip = format!("127.0.0.{n}");
        hosts.insert(
            format!("{ip}:{port}"),
            in_process(&ip, port, &pki, rules(), Some((n, 300 + n))).await,
        );
        zone = zone.address("nodes.fleet.test.", ip.parse().unwrap());
    }
    zone = zone
        .address("some.fleet.test.", "127.0.0.2".parse().unwrap())
        .address("some.fleet.test.", "127.0.0.40".parse().unwrap());
    // SRV: three hosts under their own names.
    for n in 2..=4 {
        zone = zone
            .address(
                &format!("node-{n}.fleet.test."),
                format!("127.0.0.{n}").parse().unwrap(),
            )
            .srv(
                "_bpfmap._tcp.fleet.test.",
                &format!("node-{n}.fleet.test."),
                port,
            );
    }
    let dns = DnsServer::start("fleet.test.", zone).await;
    let dns_addr = dns.addr.to_string();
    let certs: Vec<String> = ["ca.pem", "reader.pem", "reader.key"]
        .iter()
        .map(|f| pki.path(f).to_str().unwrap().to_owned())
        .collect();
    let _ = tls(&pki); // writes reader.pem / reader.key
    let base = |more: &[&str]| {
        let mut v: Vec<String> = vec![
            "--dns-server".into(),
            dns_addr.clone(),
            "--ca".into(),
            certs[0].clone(),
            "--cert".into(),
            certs[1].clone(),
            "--key".into(),
            certs[2].clone(),
            "--server-name".into(),
            "localhost".into(),
            "--connect-timeout".into(),
            "2".into(),
        ];
        v.extend(more.iter().map(|s| s.to_string()));
        v
    };
    let run = |args: Vec<String>| async move {
        let refs: Vec<&str> = args.iter().map(String::as_str).collect();
        ctl(&refs).await
    };

    // dns:NAME:PORT finds all 22; every line carries its target.
    let dns_target = format!("dns:nodes.fleet.test.:{port}");
    let (r, out, err) = run(base(&["--target", &dns_target, "dump", MAP])).await;
    r.unwrap_or_else(|e| panic!("{e}: {err}"));
    let mut per_target: BTreeMap<String, Entries> = BTreeMap::new();
    for line in json_lines(&out) {
        let t = line["target"].as_str().unwrap().to_owned();
        let k = faster_hex::hex_decode_vec(line["key"].as_str().unwrap().as_bytes()).unwrap();
        let v = faster_hex::hex_decode_vec(line["value"].as_str().unwrap().as_bytes()).unwrap();
        assert!(
            per_target
                .entry(t)
                .or_default()
                .insert(k, Value::Single(v))
                .is_none(),
            "a line twice"
        );
    }
    assert_eq!(per_target.len(), 22);
    for (t, host) in &hosts {
        assert_eq!(per_target[t], host.expected, "{t}");
    }
    let summaries = json_lines(&err);
    assert_eq!(summaries.len(), 23, "a line per target and the totals");
    assert_eq!(summaries[22]["targets"], 22);
    assert_eq!(summaries[22]["failed"], 0);

    // srv:NAME finds the three.
    let (r, out, _) = run(base(&["--target", "srv:_bpfmap._tcp.fleet.test.", "list"])).await;
    r.unwrap();
    let targets: BTreeSet<String> = json_lines(&out)
        .iter()
        .map(|l| l["target"].as_str().unwrap().to_owned())
        .collect();
    let want: BTreeSet<String> = (2..=4).map(|n| format!("127.0.0.{n}:{port}")).collect();
    assert_eq!(targets, want);

    // A target that fails makes the run fail, and the summary names it; the
    // others still answer. (127.0.0.2 comes from both names: once.)
    let some = format!("dns:some.fleet.test.:{port}");
    let (r, out, err) = run(base(&[
        "--target",
        &some,
        "--target",
        &dns_target,
        "show",
        MAP,
    ]))
    .await;
    let e = r.unwrap_err();
    assert_eq!(e.to_string(), "1 of 23 targets failed");
    assert!(e.is::<bpfmapctl::TargetsFailed>());
    assert_eq!(json_lines(&out).len(), 22);
    let summaries = json_lines(&err);
    let failed: Vec<&Json> = summaries
        .iter()
        .filter(|l| l.get("code").is_some())
        .collect();
    assert_eq!(failed.len(), 1);
    assert_eq!(failed[0]["target"], format!("127.0.0.40:{port}"));
    assert_eq!(failed[0]["code"], "UNAVAILABLE");

    // A file of targets, with comments; hex output for scripts.
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("targets");
    std::fs::write(
        &file,
        format!("# the first two\n127.0.0.2:{port}\n127.0.0.3:{port}  # second\n\n"),
    )
    .unwrap();
    let (r, out, _) = run(base(&[
        "--targets-file",
        file.to_str().unwrap(),
        "--format",
        "hex",
        "lookup",
        MAP,
        &format!(
            "hex:{}",
            faster_hex::hex_string(&2_000_000u64.to_le_bytes())
        ),
    ]))
    .await;
    r.unwrap();
    let mut lines: Vec<&str> = out.lines().collect();
    lines.sort();
    assert_eq!(
        lines,
        [
            format!(
                "127.0.0.2:{port} {} {}",
                faster_hex::hex_string(&2_000_000u64.to_le_bytes()),
                faster_hex::hex_string(&14_000_000u64.to_le_bytes())
            ),
            format!(
                "127.0.0.3:{port} {} -",
                faster_hex::hex_string(&2_000_000u64.to_le_bytes())
            ),
        ]
    );
    // A name that does not exist is a usage error, before any call.
    let (r, _, _) = run(base(&[
        "--target",
        &format!("dns:nope.fleet.test.:{port}"),
        "list",
    ]))
    .await;
    let e = r.unwrap_err();
    assert!(e.is::<bpfmapctl::Usage>(), "{e}");
    assert!(e.to_string().contains("no such name"), "{e}");
    drop(dns);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_interrupted_fleet_dump_completes_later_from_another_process() {
    let _shared = MEASURED.read().await;
    // Plaintext on loopback: the daemons run in this process, bpfmapctl as a
    // process of its own (interrupted with SIGINT, then started again).
    let port = common_port();
    let mut hosts = BTreeMap::new();
    for n in 2..=6u64 {
        let ip = format!("127.0.0.{n}");
        let fs = BpfFs::new();
        let state = tempfile::tempdir().unwrap();
        let (map, expected) = host_map(&fs, n, 150_000);
        let daemon = Daemon::start_with(Config {
            listen: format!("{ip}:{port}").parse().unwrap(),
            ..Daemon::config(fs.path(), state.path())
        })
        .await;
        hosts.insert(format!("{ip}:{port}"), (fs, state, map, expected, daemon));
    }
    let dir = tempfile::tempdir().unwrap();
    let cursors = dir.path().join("cursors.json");
    let ctl = |extra: &[&str], out: &std::path::Path| {
        let mut cmd = std::process::Command::new(ctl_bin!());
        for t in hosts.keys() {
            cmd.arg("--target").arg(t);
        }
        cmd.arg("--concurrency")
            .arg("2")
            .args(["dump", MAP, "--chunk-size", "1000", "--save-cursor"])
            .arg(&cursors)
            .args(extra)
            .stdout(std::fs::File::create(out).unwrap())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap()
    };
    let first = dir.path().join("first.jsonl");
    let child = ctl(&[], &first);
    let t = Instant::now();
    while std::fs::metadata(&first).map_or(0, |m| m.len()) < 4 << 20 {
        assert!(
            t.elapsed() < Duration::from_secs(60),
            "bpfmapctl wrote too little"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    process::send_signal(child.id(), libc::SIGINT);
    let result = child.wait_with_output().unwrap();
    assert_eq!(
        result.status.code(),
        Some(130),
        "{}",
        String::from_utf8_lossy(&result.stderr)
    );
    let saved: Json = serde_json::from_slice(&std::fs::read(&cursors).unwrap()).unwrap();
    assert_eq!(saved["map"], MAP);
    let done = saved["targets"]
        .as_object()
        .unwrap()
        .values()
        .filter(|t| t["done"] == true)
        .count();
    eprintln!("interrupted with {done} of 5 targets done");
    assert!(done < 5, "interrupted before the end");

    let second = dir.path().join("second.jsonl");
    let result = ctl(&["--resume", cursors.to_str().unwrap()], &second)
        .wait_with_output()
        .unwrap();
    process::assert_success(&result);
    let mut got: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for f in [&first, &second] {
        for line in std::fs::read_to_string(f).unwrap().lines() {
            let v: Json =
                serde_json::from_str(line).unwrap_or_else(|e| panic!("a cut line {line:?}: {e}"));
            let key = v["key"].as_str().unwrap().to_owned();
            assert!(
                got.entry(v["target"].as_str().unwrap().to_owned())
                    .or_default()
                    .insert(key),
                "a key written twice"
            );
        }
    }
    for (t, (_, _, _, expected, _)) in &hosts {
        let want: BTreeSet<String> = expected.keys().map(|k| faster_hex::hex_string(k)).collect();
        assert_eq!(
            got.get(t),
            Some(&want),
            "{t}: every entry exactly once over the two runs"
        );
    }
    let saved: Json = serde_json::from_slice(&std::fs::read(&cursors).unwrap()).unwrap();
    assert!(
        saved["targets"]
            .as_object()
            .unwrap()
            .values()
            .all(|t| t["done"] == true)
    );
}

/// The tests that measure this process (its memory, its descriptors) run
/// alone; the others share.
static MEASURED: tokio::sync::RwLock<()> = tokio::sync::RwLock::const_new(());

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_hundred_daemons_with_every_fault_at_once_each_named_with_its_cause() {
    let _alone = MEASURED.write().await;
    bpfmap_tests::netns::require_iproute2();
    const CONCURRENCY: usize = 32;
    const ANSWER_TIMEOUT: Duration = Duration::from_secs(3);
    // 204 targets: 200 daemons, 4 addresses where nothing listens.
    let t = Instant::now();
    let mut faulty = FaultyFleet::start(daemon_bin!(), 200, MAP);
    eprintln!(
        "{} daemons started in {:?}",
        faulty.hosts.iter().filter(|h| h.process.is_some()).count(),
        t.elapsed()
    );
    let mut restarts = faulty.restarts();
    let fleet = Fleet::new(
        faulty.targets(),
        ConnectOptions::default()
            .with_tls(faulty.client_tls())
            .with_connect_timeout(Duration::from_secs(1)),
    )
    .with_options(
        FleetOptions::default()
            .with_concurrency(CONCURRENCY)
            .with_answer_timeout(ANSWER_TIMEOUT),
    );
    let mut tallies = faulty.tallies();
    let mut results: HashMap<Target, TargetReport> = HashMap::new();
    let fds_before = bpfmap_tests::fleet::fd_kinds();
    let fds_count: usize = fds_before.values().sum();
    let rss_before = bpfmap_tests::fleet::rss_kib();
    bpfmap_tests::fleet::reset_peak();
    let sampler = bpfmap_tests::fleet::FdSampler::start();
    let t = Instant::now();
    let mut run = fleet.dump(
        &MAP.parse::<MapName>().unwrap(),
        FleetDumpOptions::default().with_dump(DumpOptions::default().with_chunk_size(500)),
    );
    while let Some(event) = run.next().await {
        match event {
            FleetEvent::Answer { target, answer } => {
                restarts.chunk_from(&target);
                tallies
                    .get_mut(&target)
                    .expect("a target of the fleet")
                    .add(&answer.chunk);
            }
            FleetEvent::Done(report) => {
                let target = report.target.clone();
                assert!(results.insert(target, report).is_none(), "two reports");
            }
            other => panic!("{other:?}"),
        }
    }
    let took = t.elapsed();
    let (fds_peak, fds_at_peak) = sampler.stop();
    let rss_peak = bpfmap_tests::fleet::peak_kib();
    let not_killed = faulty.finish(restarts);
    assert!(
        not_killed.is_empty(),
        "{not_killed:?}: the daemons to kill mid-dump sent no chunk"
    );
    let hosts = &faulty.hosts;
    let slowest = hosts
        .iter()
        .filter(|h| h.kind.healthy())
        .map(|h| (results[&h.target].elapsed, &h.target))
        .max()
        .unwrap();
    eprintln!(
        "{} targets in {took:?} (slowest healthy target {} {:?}); client: {} more descriptors at most ({} before: {fds_before:?}; at the most: {fds_at_peak:?}), peak resident memory {} MiB ({} MiB before)",
        results.len(),
        slowest.1,
        slowest.0,
        fds_peak.saturating_sub(fds_count),
        fds_count,
        rss_peak / 1024,
        rss_before / 1024
    );
    for host in hosts.iter().filter(|h| h.kind != Kind::Healthy) {
        let r = results
            .get(&host.target)
            .unwrap_or_else(|| panic!("{}: no report", host.target));
        eprintln!(
            "  {:?} {} {:?} after {:?}: {}",
            host.kind,
            host.target,
            r.code(),
            r.elapsed,
            text(r)
        );
    }
    assert_eq!(results.len(), hosts.len(), "a report per target");

    // Every healthy host: its own entries, each once.
    for host in hosts.iter().filter(|h| h.kind.healthy()) {
        let (r, tally) = (&results[&host.target], &tallies[&host.target]);
        let t = &host.target;
        assert_eq!(r.code(), Code::Ok, "{:?} {t}: {}", host.kind, text(r));
        assert!(r.complete, "{t}");
        assert_eq!(r.entries, host.keys.count, "{t}");
        assert!(
            tally.exact(),
            "{:?} {t}: {} entries delivered, not its map's {} each once: {:?}",
            host.kind,
            tally.delivered,
            host.keys.count,
            tally.wrong
        );
        if host.kind == Kind::Restarted {
            assert!(r.resumes >= 1, "{t}: killed mid-dump, yet no resume");
        }
    }
    // Every failure, named with its cause.
    let chain = |e: &bpfmap_client::Error| -> Vec<String> {
        std::iter::successors(Some(e as &dyn std::error::Error), |e| e.source())
            .map(|e| format!("{e} / {e:?}"))
            .collect()
    };
    for host in hosts.iter().filter(|h| !h.kind.healthy()) {
        let r = &results[&host.target];
        let (t, why) = (&host.target, text(r));
        let e = r
            .error
            .as_ref()
            .unwrap_or_else(|| panic!("{:?} {t}: no error", host.kind));
        let io_kind = std::iter::successors(std::error::Error::source(e), |e| e.source())
            .find_map(|e| e.downcast_ref::<std::io::Error>())
            .map(std::io::Error::kind);
        match host.kind {
            Kind::Dead => {
                assert_eq!(r.code(), Code::Unavailable, "dead {t}: {why}");
                assert_eq!(
                    io_kind,
                    Some(std::io::ErrorKind::ConnectionRefused),
                    "dead {t}: {why}: {:?}",
                    chain(e)
                );
            }
            Kind::Frozen => {
                assert_eq!(r.code(), Code::DeadlineExceeded, "frozen {t}: {why}");
                assert!(why.contains("no answer within 3 s"), "frozen {t}: {why}");
            }
            Kind::BlackHole => {
                // Connecting timed out (the connect timeout), again and
                // again until the answer timeout.
                assert_eq!(r.code(), Code::Unavailable, "black hole {t}: {why}");
                assert_eq!(
                    io_kind,
                    Some(std::io::ErrorKind::TimedOut),
                    "black hole {t}: {why}: {:?}",
                    chain(e)
                );
                assert!(
                    why.contains("tcp connect error") && why.contains("still failing after 3 s"),
                    "black hole {t}: {why}"
                );
            }
            Kind::OtherCa => {
                assert_eq!(r.code(), Code::Unavailable, "another CA {t}: {why}");
                assert!(
                    why.contains("invalid peer certificate"),
                    "another CA {t}: {why}"
                );
            }
            _ => unreachable!(),
        }
        assert!(
            r.elapsed <= ANSWER_TIMEOUT + Duration::from_secs(1),
            "{:?} {t} held its slot for {:?}",
            host.kind,
            r.elapsed
        );
    }

    // The run: a failing target costs its answer timeout, in parallel with
    // the rest, not after it.
    let bound = ANSWER_TIMEOUT + slowest.0 + Duration::from_secs(5);
    assert!(
        took <= bound,
        "the run took {took:?}: more than the answer timeout ({ANSWER_TIMEOUT:?}) and the slowest healthy target ({:?}) and 5 s",
        slowest.0
    );
    // The client's descriptors and memory follow the targets in flight, not
    // the targets.
    let more_fds = fds_peak.saturating_sub(fds_count);
    assert!(
        more_fds <= CONCURRENCY + 16,
        "{more_fds} descriptors opened at once by a run of {} targets, {CONCURRENCY} at a time (before: {fds_before:?}; at the most: {fds_at_peak:?})",
        hosts.len()
    );
    let more_kib = rss_peak.saturating_sub(rss_before);
    assert!(
        more_kib <= 64 << 10,
        "the client's resident memory grew by {} MiB during a run of {} targets, {CONCURRENCY} at a time",
        more_kib / 1024,
        hosts.len()
    );
}
