//! Running bpfmapd as operators do: metrics scraped over HTTP after known
//! work, certificates and policy rotated on disk the way a Kubernetes Secret
//! volume rotates them, the cursor key rotated, SIGTERM and a restart in the
//! middle of a client's dump, readiness reported to systemd, and the daemon
//! run with only the identity and capabilities its systemd unit gives it.
//!
//! The checks of the deployment files themselves (systemd-analyze,
//! kubernetes-validate, checkov) are in `deploy.rs`.

use std::{
    net::SocketAddr,
    os::unix::net::UnixDatagram,
    path::{Path, PathBuf},
    time::{Duration, Instant},
};

use bpfmap_client::{
    Client, ClientTls, ConnectOptions, DumpOptions, Entry, MapName, RetryPolicy, Value, ValueRef,
    pb,
};
use bpfmap_tests::{
    metrics::{Metrics, http_get, scrape},
    pki::{Name, Pki, Validity},
    process::{DaemonProcess, Launch, free_addr, minor_faults},
    *,
};
use bpfmapd::{Config, Limits, Operation, RuleConfig};
use tonic::Code;
use tonic_health::pb::{
    HealthCheckRequest, health_check_response::ServingStatus, health_client::HealthClient,
};

const ALICE: &str = "spiffe://example.org/ops/alice";

fn dump_request(path: &str, chunk_size: u32, cursor: &str) -> pb::DumpMapRequest {
    pb::DumpMapRequest {
        map: map_ref(path),
        chunk_size,
        cursor: cursor.into(),
        ..Default::default()
    }
}

/// A per-method gRPC series (`code`: its `grpc_code` label too).
fn rpc(m: &Metrics, name: &str, method: &str, code: Option<&str>) -> f64 {
    let mut labels = vec![("grpc_method", method)];
    labels.extend(code.map(|c| ("grpc_code", c)));
    m.get(name, &labels)
}

/// An array of `n` entries, key i (u32 LE) -> i*7 (u64 LE), pinned.
fn u64_array(fs: &BpfFs, rel: &str, n: u32) -> (OwnedMap, Entries) {
    let map = create_map(MapType::ARRAY, 4, 8, n);
    let (mut keys, mut values, mut expected) = (Vec::new(), Vec::new(), Entries::new());
    for i in 0..n {
        keys.extend_from_slice(&i.to_le_bytes());
        let v = (u64::from(i) * 7).to_le_bytes();
        values.extend_from_slice(&v);
        expected.insert(i.to_le_bytes().to_vec(), Value::Single(v.to_vec()));
    }
    update_batch(&map, &keys, &values);
    fs.pin(&map, rel);
    (map, expected)
}

/// Reads a whole dump with the raw API: its messages' entries and encoded
/// sizes, and the cursor after message `cursor_after` (1-based).
async fn raw_dump(
    client: &mut pb::map_service_client::MapServiceClient<tonic::transport::Channel>,
    request: pb::DumpMapRequest,
    cursor_after: usize,
) -> (u64, u64, String) {
    use prost::Message as _;
    let mut stream = client.dump_map(request).await.unwrap().into_inner();
    let (mut entries, mut bytes, mut cursor, mut n) = (0u64, 0u64, String::new(), 0);
    while let Some(msg) = stream.message().await.unwrap() {
        n += 1;
        entries += msg
            .packed
            .as_ref()
            .map_or(msg.entries.len() as u64, |p| u64::from(p.count));
        bytes += msg.encoded_len() as u64;
        if n == cursor_after {
            cursor = msg.cursor.clone();
        }
    }
    (entries, bytes, cursor)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_count_exactly_the_work_done() {
    use Operation::*;
    let fs = BpfFs::new();
    let state = tempfile::tempdir().unwrap();
    let (_a, _) = u64_array(&fs, "demo/a", 1000);
    let (_b, _) = u64_hash(&fs, "demo/b", 10, 16);
    // Larger than every buffer between the daemon and a client that does
    // not read: a dump of it holds its slot.
    // (Dumped, not listed.)
    let (_big, _) = u64_hash(&fs, "held/big", 200_000, 262_144);
    let rules = vec![
        RuleConfig {
            identities: vec!["anonymous".into()],
            maps: vec!["demo/a".into()],
            operations: vec![List, Dump],
        },
        RuleConfig {
            identities: vec!["anonymous".into()],
            maps: vec!["held/big".into()],
            operations: vec![Dump],
        },
        RuleConfig {
            identities: vec!["anonymous".into()],
            maps: vec!["demo/b".into()],
            operations: vec![List],
        },
    ];
    let config = Config {
        metrics_listen: Some("127.0.0.1:0".parse().unwrap()),
        rules,
        limits: Limits {
            max_dumps: 1,
            ..Limits::default()
        },
        ..Daemon::config(fs.path(), state.path())
    };
    let daemon = Daemon::start_with(config.clone()).await;
    let metrics = daemon
        .running
        .metrics_addr()
        .expect("metrics_listen is set");
    let before = scrape(metrics).await;
    assert_eq!(before.get("bpfmapd_dump_entries_total", &[]), 0.0);

    let channel = channel_from(&daemon.addr(), "127.0.0.1").await;
    let mut raw = pb::map_service_client::MapServiceClient::new(channel);
    assert_eq!(
        raw.list_maps(pb::ListMapsRequest::default())
            .await
            .unwrap()
            .into_inner()
            .maps
            .len(),
        2
    );
    // A whole dump in chunks of 100, then the rest of it again from the
    // cursor after its third chunk.
    let (e1, b1, cursor) = raw_dump(&mut raw, dump_request("demo/a", 100, ""), 3).await;
    assert_eq!(e1, 1000);
    let (e2, b2, _) = raw_dump(&mut raw, dump_request("demo/a", 100, &cursor), 0).await;
    assert_eq!(e2, 700);
    // Refusals: the policy (dump of b, lookup anywhere), a forged cursor.
    let denied = raw
        .dump_map(dump_request("demo/b", 0, ""))
        .await
        .unwrap_err();
    assert_eq!(denied.code(), Code::PermissionDenied);
    let denied = raw
        .lookup(pb::LookupRequest {
            map: map_ref("demo/a"),
            keys: vec![vec![0; 4]],
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(denied.code(), Code::PermissionDenied);
    let forged = raw
        .dump_map(dump_request("demo/a", 0, "cAAAAAAAAAAAAAAAAAAAAAA"))
        .await
        .unwrap_err();
    assert_eq!(forged.code(), Code::InvalidArgument);
    // Reloads: one good, one rejected.
    daemon.running.reload(&config).unwrap();
    let mut bad = config.clone();
    bad.rules[0].maps = vec!["demo/[".into()];
    daemon.running.reload(&bad).unwrap_err();

    let m = scrape(metrics).await;
    let started = "grpc_server_started_total";
    let handled = "grpc_server_handled_total";
    assert_eq!(rpc(&m, started, "ListMaps", None), 1.0);
    assert_eq!(rpc(&m, started, "DumpMap", None), 4.0);
    assert_eq!(rpc(&m, started, "Lookup", None), 1.0);
    assert_eq!(rpc(&m, handled, "ListMaps", Some("OK")), 1.0);
    assert_eq!(rpc(&m, handled, "DumpMap", Some("OK")), 2.0);
    assert_eq!(rpc(&m, handled, "DumpMap", Some("PERMISSION_DENIED")), 1.0);
    assert_eq!(rpc(&m, handled, "DumpMap", Some("INVALID_ARGUMENT")), 1.0);
    assert_eq!(rpc(&m, handled, "Lookup", Some("PERMISSION_DENIED")), 1.0);
    assert_eq!(
        m.get(
            "grpc_server_handling_seconds_count",
            &[("grpc_method", "DumpMap"), ("grpc_type", "server_stream")]
        ),
        4.0
    );
    assert_eq!(m.get("bpfmapd_dump_entries_total", &[]), (e1 + e2) as f64);
    assert_eq!(m.get("bpfmapd_dump_bytes_total", &[]), (b1 + b2) as f64);
    // An array walk of n entries in batches of 100 takes ceil(n / 100)
    // calls, and one more that finds no next key (ENOENT, count 0).
    assert_eq!(m.get("bpfmapd_kernel_batch_calls_total", &[]), 11.0 + 8.0);
    assert_eq!(m.get("bpfmapd_enospc_retries_total", &[]), 0.0);
    assert_eq!(m.get("bpfmapd_dumps_resumed_total", &[]), 1.0);
    assert_eq!(
        m.get(
            "bpfmapd_policy_denials_total",
            &[("grpc_method", "DumpMap")]
        ),
        1.0
    );
    assert_eq!(
        m.get("bpfmapd_policy_denials_total", &[("grpc_method", "Lookup")]),
        1.0
    );
    assert_eq!(m.get("bpfmapd_reloads_total", &[("result", "ok")]), 1.0);
    assert_eq!(m.get("bpfmapd_reloads_total", &[("result", "failed")]), 1.0);
    assert_eq!(m.get("bpfmapd_connections_open", &[]), 1.0);
    assert_eq!(m.get("bpfmapd_dump_slots_in_use", &[]), 0.0);
    assert_eq!(m.get("bpfmapd_streams_active", &[]), 0.0);
    // No label of the calls' metrics carries an identity, a map or a key
    // (map pressure names each map: that is what it is about).
    let calls: String =
        m.0.lines()
            .filter(|l| !l.starts_with("bpfmapd_map_"))
            .collect();
    for forbidden in ["demo/", "anonymous", "127.0.0.1"] {
        assert!(!calls.contains(forbidden), "{forbidden} in\n{}", m.0);
    }

    // The only dump slot held by a stream that is not read (on a connection
    // whose flow-control windows hold a few of its 100 chunks, so that it
    // cannot all be in flight); the next dump is refused.
    let narrow = tonic::transport::Endpoint::from_shared(daemon.addr())
        .unwrap()
        .initial_stream_window_size(Some(2048))
        .initial_connection_window_size(Some(2048))
        .connect()
        .await
        .unwrap();
    let mut held = pb::map_service_client::MapServiceClient::new(narrow)
        .dump_map(dump_request("held/big", 10, ""))
        .await
        .unwrap()
        .into_inner();
    assert!(held.message().await.unwrap().is_some());
    let refused = raw
        .dump_map(dump_request("demo/a", 0, ""))
        .await
        .unwrap_err();
    assert_eq!(refused.code(), Code::ResourceExhausted);
    let m = scrape(metrics).await;
    assert_eq!(m.get("bpfmapd_dump_slots_in_use", &[]), 1.0);
    assert_eq!(m.get("bpfmapd_dump_slots_refused_total", &[]), 1.0);
    assert_eq!(rpc(&m, handled, "DumpMap", Some("RESOURCE_EXHAUSTED")), 1.0);
    assert_eq!(rpc(&m, started, "DumpMap", None), 6.0);

    let (status, _, _) = http_get(metrics, "/").await.unwrap();
    assert_eq!(status, "HTTP/1.1 404 Not Found");
    drop(held);
    daemon.stop().await;
}

/// A directory laid out as kubelet lays out a Secret volume: each version
/// of the files in a directory of its own, `..data` pointing at the
/// current one (swapped atomically), and every file a symlink through
/// `..data`.
struct SecretVolume {
    dir: tempfile::TempDir,
    version: u32,
}

impl SecretVolume {
    fn new() -> Self {
        Self {
            dir: tempfile::tempdir().unwrap(),
            version: 0,
        }
    }

    fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    /// Publishes a new version: (file name, contents from this file).
    fn publish(&mut self, files: &[(&str, PathBuf)]) {
        self.version += 1;
        let version = format!("..2026_11_30_{:04}", self.version);
        std::fs::create_dir(self.path(&version)).unwrap();
        for (name, from) in files {
            std::fs::copy(from, self.path(&version).join(name)).unwrap();
        }
        let tmp = self.path("..data_tmp");
        std::os::unix::fs::symlink(&version, &tmp).unwrap();
        std::fs::rename(&tmp, self.path("..data")).unwrap();
        for (name, _) in files {
            if std::fs::symlink_metadata(self.path(name)).is_err() {
                std::os::unix::fs::symlink(format!("..data/{name}"), self.path(name)).unwrap();
            }
        }
    }

    fn publish_server(&mut self, cert: &Pki, key: &Pki, client_ca: &Pki) {
        self.publish(&[
            ("tls.crt", cert.path("server.pem")),
            ("tls.key", key.path("server.key")),
            ("ca.crt", client_ca.path("ca.pem")),
        ]);
    }
}

async fn tls_client(addr: SocketAddr, tls: &ClientTls) -> Result<Client, bpfmap_client::Error> {
    let options = ConnectOptions::default()
        .with_tls(tls.clone())
        .with_retry(RetryPolicy::never());
    Client::connect(&format!("https://127.0.0.1:{}", addr.port()), options).await
}

/// Whether a new connection with `tls` is served (TLS 1.3 reports the
/// server's rejection of a client certificate at the first call).
async fn served(addr: SocketAddr, tls: &ClientTls) -> bool {
    match tls_client(addr, tls).await {
        Ok(c) => c.list_maps().await.is_ok(),
        Err(_) => false,
    }
}

/// One TLS connection with the certificate `cert` and its `key` (PEM),
/// trusting `ca`: a handshake, then a read; the error the server's
/// rejection gives (with TLS 1.3 a client learns of it only after its
/// handshake).
async fn one_handshake(
    addr: SocketAddr,
    ca: &[u8],
    cert: &[u8],
    key: &[u8],
) -> std::io::Result<()> {
    use rustls::pki_types::{CertificateDer, PrivateKeyDer, pem::PemObject as _};
    use tokio::io::AsyncReadExt as _;
    let mut roots = rustls::RootCertStore::empty();
    for c in CertificateDer::pem_slice_iter(ca) {
        roots.add(c.unwrap()).unwrap();
    }
    let chain: Vec<CertificateDer<'static>> = CertificateDer::pem_slice_iter(cert)
        .map(Result::unwrap)
        .collect();
    let key = PrivateKeyDer::from_pem_slice(key).unwrap();
    let config = rustls::ClientConfig::builder_with_provider(std::sync::Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .unwrap()
    .with_root_certificates(roots)
    .with_client_auth_cert(chain, key)
    .unwrap();
    let tcp = tokio::net::TcpStream::connect(addr).await?;
    let name = rustls::pki_types::ServerName::try_from("localhost").unwrap();
    let mut tls = tokio_rustls::TlsConnector::from(std::sync::Arc::new(config))
        .connect(name, tcp)
        .await?;
    let mut buf = [0u8; 1];
    match tls.read(&mut buf).await? {
        0 => Err(std::io::Error::other("closed without a word")),
        _ => Ok(()),
    }
}

async fn wait_for(what: &str, mut check: impl AsyncFnMut() -> bool) {
    let started = Instant::now();
    while !check().await {
        assert!(
            started.elapsed() < Duration::from_secs(15),
            "waited 15 s for {what}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    eprintln!("{what}: {:?}", started.elapsed());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn certificates_and_policy_rotate_on_disk_without_cutting_streams() {
    let fs = BpfFs::new();
    let state = tempfile::tempdir().unwrap();
    let (_m, expected) = u64_hash(&fs, "m", 100_000, 131_072);
    let (old, new, other) = (Pki::new(), Pki::new(), Pki::new());
    let mut secret = SecretVolume::new();
    secret.publish_server(&old, &old, &old);
    let metrics = free_addr("127.0.0.1");
    let extra = format!(
        "metrics_listen = \"{metrics}\"\nwatch_files = \"1s\"\n\
         [tls]\ncert = \"{}\"\nkey = \"{}\"\nclient_ca = \"{}\"\n\
         [[rule]]\nidentities = [\"{ALICE}\"]\nmaps = [\"**\"]\noperations = [\"list\", \"dump\"]\n",
        secret.path("tls.crt").display(),
        secret.path("tls.key").display(),
        secret.path("ca.crt").display(),
    );
    let daemon = DaemonProcess::start(
        daemon_bin!(),
        fs.path(),
        state.path(),
        free_addr("127.0.0.1"),
        &extra,
    );
    let alice_old = old.client("alice", Name::Spiffe(ALICE), Validity::Now);
    let alice_new = new.client("alice", Name::Spiffe(ALICE), Validity::Now);
    let client = tls_client(daemon.addr, &alice_old).await.unwrap();
    let mut dump = client.dump(
        &"m".parse().unwrap(),
        DumpOptions::default().with_chunk_size(1000),
    );
    let mut got: Vec<Entry> = Vec::new();
    for _ in 0..3 {
        got.extend(dump.next_chunk().await.unwrap().unwrap());
    }

    // One TLS handshake with a certificate the server does not trust.
    other.client("stranger", Name::Spiffe(ALICE), Validity::Now);
    let read = |pki: &Pki, file: &str| std::fs::read(pki.path(file)).unwrap();
    let refused = one_handshake(
        daemon.addr,
        &read(&old, "ca.pem"),
        &read(&other, "stranger.pem"),
        &read(&other, "stranger.key"),
    )
    .await;
    assert!(
        refused.is_err(),
        "the server accepted a stranger: {refused:?}"
    );
    wait_for("the failed handshake counted", async || {
        scrape(metrics).await.get(
            "bpfmapd_tls_handshake_failures_total",
            &[("reason", "bad_certificate")],
        ) >= 1.0
    })
    .await;
    let m = scrape(metrics).await;
    for (reason, n) in [
        ("bad_certificate", 1.0),
        ("protocol", 0.0),
        ("timeout", 0.0),
    ] {
        assert_eq!(
            m.get(
                "bpfmapd_tls_handshake_failures_total",
                &[("reason", reason)]
            ),
            n,
            "{reason}"
        );
    }

    // cert-manager renews everything (a new CA too) and kubelet swaps the
    // symlink: new connections get the new certificate and need client
    // certificates from the new CA.
    secret.publish_server(&new, &new, &new);
    wait_for("the new certificate in use", async || {
        served(daemon.addr, &alice_new).await
    })
    .await;
    assert!(
        !served(daemon.addr, &alice_old).await,
        "a client of the old CA still gets in"
    );
    let m = scrape(metrics).await;
    assert_eq!(m.get("bpfmapd_reloads_total", &[("result", "ok")]), 1.0);

    // The stream opened before the rotation is not cut.
    while let Some(chunk) = dump.next_chunk().await.unwrap() {
        got.extend(chunk);
    }
    assert_eq!(dump.resumes(), 0, "the open stream was cut");
    assert_eq!(collect_unique(got), expected);

    // A certificate that does not match its key is rejected; the daemon
    // keeps serving the one it had.
    secret.publish_server(&other, &new, &new);
    wait_for("the broken rotation to be rejected", async || {
        scrape(metrics)
            .await
            .get("bpfmapd_reloads_total", &[("result", "failed")])
            == 1.0
    })
    .await;
    assert!(served(daemon.addr, &alice_new).await);
    assert!(
        daemon
            .log()
            .iter()
            .any(|l| l.contains("reload was rejected")),
        "{:?}",
        daemon.log()
    );

    // The policy in the config file changes: Alice may no longer dump.
    // Fixing the certificate at the same time makes the reload whole.
    secret.publish_server(&new, &new, &new);
    let text = std::fs::read_to_string(daemon.config_path()).unwrap();
    let narrowed = text.replace(
        r#"operations = ["list", "dump"]"#,
        r#"operations = ["list"]"#,
    );
    assert_ne!(text, narrowed);
    let tmp = daemon.config_path().with_extension("tmp");
    std::fs::write(&tmp, narrowed).unwrap();
    std::fs::rename(&tmp, daemon.config_path()).unwrap();
    let alice = tls_client(daemon.addr, &alice_new).await.unwrap();
    wait_for("the narrower policy in force", async || {
        let mut d = alice.dump(&"m".parse().unwrap(), DumpOptions::default());
        matches!(d.next_chunk().await, Err(e) if code_of(&e) == Code::PermissionDenied)
    })
    .await;
    assert_eq!(alice.list_maps().await.unwrap().len(), 1);
    let m = scrape(metrics).await;
    assert_eq!(m.get("bpfmapd_reloads_total", &[("result", "ok")]), 2.0);
    assert_eq!(
        m.get(
            "bpfmapd_policy_denials_total",
            &[("grpc_method", "DumpMap")]
        ),
        1.0
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_cursor_key_rotates_and_the_previous_key_stays_valid_once() {
    let fs = BpfFs::new();
    let state = tempfile::tempdir().unwrap();
    let (_a, expected) = u64_array(&fs, "a", 1000);
    let daemon = DaemonProcess::local(daemon_bin!(), fs.path(), state.path());
    let client = Client::connect(
        &daemon.url(),
        ConnectOptions::default().with_retry(RetryPolicy::never()),
    )
    .await
    .unwrap();
    let options = |cursor: Option<String>| match cursor {
        Some(c) => DumpOptions::default().with_chunk_size(100).with_cursor(c),
        None => DumpOptions::default().with_chunk_size(100),
    };
    let mut dump = client.dump(&"a".parse().unwrap(), options(None));
    let mut got = Vec::new();
    for _ in 0..3 {
        got.extend(dump.next_chunk().await.unwrap().unwrap());
    }
    let first_key_cursor = dump.cursor().to_owned();
    drop(dump);

    // The operator's steps: rotate, then reload (SIGHUP; the file watch
    // would pick the new key up by itself within watch_files).
    let reloads = || {
        daemon
            .log()
            .iter()
            .filter(|l| l.contains("reloaded certificates, policy and cursor keys"))
            .count()
    };
    let rotate = async || {
        let before = reloads();
        let out = std::process::Command::new(daemon_bin!())
            .arg("--config")
            .arg(daemon.config_path())
            .arg("--rotate-cursor-key")
            .output()
            .unwrap();
        process::assert_success(&out);
        assert!(
            String::from_utf8_lossy(&out.stdout).contains("rotated the cursor key"),
            "{out:?}"
        );
        daemon.signal(libc::SIGHUP);
        wait_for("the reload after rotating", async || reloads() > before).await;
    };
    rotate().await;
    // A cursor of the previous key resumes exactly where it was.
    let mut dump = client.dump(
        &"a".parse().unwrap(),
        options(Some(first_key_cursor.clone())),
    );
    let mut rest: Vec<Entry> = dump
        .next_chunk()
        .await
        .unwrap()
        .unwrap()
        .into_iter()
        .collect();
    let second_key_cursor = dump.cursor().to_owned();
    while let Some(chunk) = dump.next_chunk().await.unwrap() {
        rest.extend(chunk);
    }
    got.extend(rest);
    assert_eq!(collect_unique(got), expected);
    assert_ne!(first_key_cursor, second_key_cursor);

    // After a second rotation the first key's cursors are refused; the
    // second key's still work.
    rotate().await;
    let mut d = client.dump(&"a".parse().unwrap(), options(Some(first_key_cursor)));
    let e = d.next_chunk().await.unwrap_err();
    assert_eq!(code_of(&e), Code::InvalidArgument, "{e}");
    assert!(e.to_string().contains("not issued by this server"), "{e}");
    let mut d = client.dump(&"a".parse().unwrap(), options(Some(second_key_cursor)));
    let mut n = 0;
    while let Some(chunk) = d.next_chunk().await.unwrap() {
        n += chunk.len();
    }
    assert_eq!(n, 600, "the rest after 4 chunks of 100");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_and_a_restart_mid_dump_cost_the_client_nothing() {
    let fs = BpfFs::new();
    let state = tempfile::tempdir().unwrap();
    let (_m, expected) = u64_hash(&fs, "m", 300_000, 393_216);
    let health = free_addr("127.0.0.1");
    let mut daemon = DaemonProcess::start(
        daemon_bin!(),
        fs.path(),
        state.path(),
        free_addr("127.0.0.1"),
        &format!("health_listen = \"{health}\"\n[limits]\nshutdown_grace = \"1s\"\n"),
    );
    let retry = RetryPolicy::default()
        .with_max_attempts(100)
        .with_min_delay(Duration::from_millis(50))
        .with_max_delay(Duration::from_millis(300));
    let client = Client::connect(&daemon.url(), ConnectOptions::default().with_retry(retry))
        .await
        .unwrap();
    let mut dump = client.dump(
        &"m".parse().unwrap(),
        DumpOptions::default().with_chunk_size(1000),
    );
    let mut got = Vec::new();
    for _ in 0..5 {
        got.extend(dump.next_chunk().await.unwrap().unwrap());
    }
    let mut probe = HealthClient::new(channel_from(&format!("http://{health}"), "127.0.0.1").await);
    let mut watch = probe
        .watch(HealthCheckRequest {
            service: String::new(),
        })
        .await
        .unwrap()
        .into_inner();
    let first = watch.message().await.unwrap().unwrap();
    assert_eq!(first.status(), ServingStatus::Serving);

    daemon.signal(libc::SIGTERM);
    let signalled = Instant::now();
    // Health turns NOT_SERVING at once, and new calls are refused.
    let next = tokio::time::timeout(Duration::from_secs(1), watch.message())
        .await
        .unwrap_or_else(|_| {
            panic!(
                "health did not change within a second of SIGTERM:\n{}",
                daemon.log().join("\n")
            )
        });
    let next = next.expect("the health stream").expect("a status");
    assert_eq!(next.status(), ServingStatus::NotServing);
    eprintln!("SIGTERM to NOT_SERVING: {:?}", signalled.elapsed());
    let mut fresh = pb::map_service_client::MapServiceClient::new(
        tonic::transport::Endpoint::from_shared(daemon.url())
            .unwrap()
            .connect_lazy(),
    );
    let e = fresh
        .list_maps(pb::ListMapsRequest::default())
        .await
        .expect_err("a call after SIGTERM");
    assert_eq!(e.code(), Code::Unavailable, "{e:?}");

    // The client reads nothing during the grace period: its dump is cut.
    let (status, took) = daemon
        .wait_exit(Duration::from_secs(10))
        .expect("the daemon exits after its grace period");
    assert!(status.success(), "{status}");
    eprintln!("SIGTERM to exit: {took:?}");
    std::thread::sleep(Duration::from_millis(100)); // the last of its log
    let log = daemon.log();
    let stopped = log
        .iter()
        .find(|l| l.contains("server stopped"))
        .unwrap_or_else(|| panic!("no 'server stopped' log line:\n{}", log.join("\n")));
    assert!(stopped.contains("\"dumps_cut\":1"), "{stopped}");

    daemon.restart();
    while let Some(chunk) = dump.next_chunk().await.unwrap() {
        got.extend(chunk);
    }
    assert!(dump.resumes() >= 1, "the dump should have resumed");
    assert_eq!(collect_unique(got), expected);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readiness_reloads_and_stopping_are_reported_to_systemd() {
    let fs = BpfFs::new();
    let state = tempfile::tempdir().unwrap();
    let sock_dir = tempfile::tempdir().unwrap();
    let path = sock_dir.path().join("notify");
    let socket = UnixDatagram::bind(&path).unwrap();
    socket
        .set_read_timeout(Some(Duration::from_secs(20)))
        .unwrap();
    let recv = || {
        let mut buf = [0u8; 512];
        let n = socket.recv(&mut buf).expect("a notification");
        String::from_utf8_lossy(&buf[..n]).into_owned()
    };
    let mut daemon = DaemonProcess::launch(
        daemon_bin!(),
        fs.path(),
        state.path(),
        free_addr("127.0.0.1"),
        "",
        Launch {
            env: vec![("NOTIFY_SOCKET".into(), path.display().to_string())],
            ..Launch::default()
        },
    );
    assert_eq!(
        recv(),
        format!("READY=1\nSTATUS=serving on {}", daemon.addr)
    );
    daemon.signal(libc::SIGHUP);
    assert_eq!(recv(), "RELOADING=1");
    assert_eq!(recv(), "READY=1");
    daemon.signal(libc::SIGTERM);
    assert_eq!(recv(), "STOPPING=1");
    let (status, _) = daemon.wait_exit(Duration::from_secs(10)).unwrap();
    assert!(status.success(), "{status}");
}

/// Capability numbers (linux/capability.h).
const CAP_DAC_READ_SEARCH: u32 = 2;
const CAP_BPF: u32 = 39;

fn status_field(pid: u32, field: &str) -> String {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap()
        .lines()
        .find_map(|l| l.strip_prefix(field).map(|v| v.trim().to_owned()))
        .unwrap_or_else(|| panic!("no {field} in /proc/{pid}/status"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_daemon_serves_with_only_the_units_user_and_capabilities() {
    // What deploy/systemd/bpfmapd.service grants: a user other than root,
    // ambient CAP_BPF and CAP_DAC_READ_SEARCH, nothing else in the bounding
    // set, no_new_privs. The maps are root's, 0600, in a 0700 bpffs.
    let fs = BpfFs::new();
    let state = tempfile::tempdir().unwrap();
    let (_m, expected) = u64_hash(&fs, "m", 5000, 8192);
    let nobody = 65534;
    std::os::unix::fs::chown(state.path(), Some(nobody), Some(nobody)).unwrap();
    let caps = "-all,+bpf,+dac_read_search";
    let setpriv = "setpriv";
    let launch = Launch {
        wrapper: vec![
            setpriv.into(),
            format!("--reuid={nobody}"),
            format!("--regid={nobody}"),
            "--clear-groups".into(),
            format!("--inh-caps={caps}"),
            format!("--ambient-caps={caps}"),
            format!("--bounding-set={caps}"),
            "--no-new-privs".into(),
        ],
        ..Launch::default()
    };
    assert!(
        std::process::Command::new(setpriv)
            .arg("--version")
            .output()
            .is_ok_and(|o| o.status.success()),
        "setpriv (util-linux) is needed to run the daemon with the unit's capabilities"
    );
    let daemon = DaemonProcess::launch(
        daemon_bin!(),
        fs.path(),
        state.path(),
        free_addr("127.0.0.1"),
        "",
        launch,
    );
    let pid = daemon.pid();
    let uid = status_field(pid, "Uid:");
    assert!(
        uid.split_whitespace().all(|u| u == nobody.to_string()),
        "{uid}"
    );
    let wanted = (1u64 << CAP_BPF) | (1u64 << CAP_DAC_READ_SEARCH);
    let eff = u64::from_str_radix(&status_field(pid, "CapEff:"), 16).unwrap();
    let bnd = u64::from_str_radix(&status_field(pid, "CapBnd:"), 16).unwrap();
    assert_eq!(
        (eff, bnd),
        (wanted, wanted),
        "CapEff {eff:x}, CapBnd {bnd:x}"
    );
    assert_eq!(status_field(pid, "NoNewPrivs:"), "1");

    let client = Client::connect(&daemon.url(), ConnectOptions::default())
        .await
        .unwrap();
    assert_eq!(client.list_maps().await.unwrap().len(), 1);
    let entries = dump_all(&client, "m", DumpOptions::default()).await;
    assert_eq!(entries, expected);
    let key = std::fs::metadata(state.path().join("cursor.key")).unwrap();
    use std::os::unix::fs::{MetadataExt as _, PermissionsExt as _};
    assert_eq!(
        (key.uid(), key.permissions().mode() & 0o777),
        (nobody, 0o600)
    );
}

#[test]
fn the_daemon_runs_under_systemd_with_the_units_sandbox() {
    // Only where systemd is the init system; this machine's checks of the
    // unit are otherwise the offline ones in deploy.rs and the setpriv run
    // above.
    if !Path::new("/run/systemd/system").exists() {
        eprintln!(
            "skipped: systemd is not running here (no /run/systemd/system); the unit is checked offline and its user and capabilities with setpriv"
        );
        return;
    }
    systemd::run_the_unit();
}

mod systemd {
    //! The unit from deploy/systemd run by systemd itself (as a transient
    //! copy with the test's binary, a dynamic user and a map pinned in the
    //! host's /sys/fs/bpf, which the unit makes read-only).

    use std::{path::Path, process::Command, time::Duration};

    use bpfmap_tests::*;

    fn run(cmd: &mut Command) -> String {
        let out = cmd.output().expect("run systemctl/systemd-run");
        assert!(
            out.status.success(),
            "{cmd:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    pub(crate) fn run_the_unit() {
        let id = std::process::id();
        let unit = format!("bpfmapd-test-{id}");
        let pins = Path::new("/sys/fs/bpf").join(&unit);
        std::fs::create_dir_all(&pins).unwrap();
        let (map, expected) = {
            let map = create_map(MapType::HASH, 8, 8, 64);
            let mut expected = Entries::new();
            for i in 0u64..50 {
                update(&map, &i.to_le_bytes(), &(i * 3).to_le_bytes());
                expected.insert(
                    i.to_le_bytes().to_vec(),
                    bpfmap_client::Value::Single((i * 3).to_le_bytes().to_vec()),
                );
            }
            map.pin(&pins.join("m")).expect("pin in /sys/fs/bpf");
            (map, expected)
        };
        let addr = process::free_addr("127.0.0.1");
        // The unit's [Service] settings, but for how it is started.
        let text = std::fs::read_to_string(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../deploy/systemd/bpfmapd.service"
        ))
        .unwrap();
        let mut args = vec![
            format!("--unit={unit}"),
            "--property=DynamicUser=yes".into(),
        ];
        let mut in_service = false;
        for line in text.lines().map(str::trim) {
            if line.starts_with('[') {
                in_service = line == "[Service]";
                continue;
            }
            let skip = ["ExecStart=", "ExecReload=", "User=", "Group=", "Restart"];
            if in_service
                && !line.is_empty()
                && !line.starts_with('#')
                && !skip.iter().any(|s| line.starts_with(s))
            {
                args.push(format!("--property={line}"));
            }
        }
        let bin = Path::new(env!("CARGO_BIN_EXE_test-bpfmapd"));
        let mut start = Command::new("systemd-run");
        start.args(&args).arg(bin).args([
            "--listen",
            &addr.to_string(),
            "--root",
            &pins.display().to_string(),
            "--state-dir",
            "/var/lib/bpfmapd-test",
        ]);
        // Type=notify: systemd-run returns once the daemon is ready.
        run(&mut start);
        let result = std::panic::catch_unwind(|| {
            let rt = tokio::runtime::Runtime::new().unwrap();
            rt.block_on(async {
                let client = bpfmap_client::Client::connect(
                    &format!("http://{addr}"),
                    bpfmap_client::ConnectOptions::default(),
                )
                .await
                .unwrap();
                let got = dump_all(&client, "m", bpfmap_client::DumpOptions::default()).await;
                assert_eq!(got, expected);
            });
        });
        run(Command::new("systemctl").args(["stop", &unit]));
        std::thread::sleep(Duration::from_millis(100));
        drop(map);
        let _ = std::fs::remove_dir_all(&pins);
        if let Err(p) = result {
            std::panic::resume_unwind(p);
        }
    }
}

/// A change that SIGHUP applied is not applied again by the file watch
/// (and the other way round): one change, one reload.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_change_is_reloaded_once_by_sighup_or_the_file_watch() {
    let fs = BpfFs::new();
    let state = tempfile::tempdir().unwrap();
    let (_a, _) = u64_array(&fs, "a", 10);
    let daemon = DaemonProcess::start(
        daemon_bin!(),
        fs.path(),
        state.path(),
        process::free_addr("127.0.0.1"),
        "watch_files = \"1s\"\n",
    );
    let reloads = || {
        daemon
            .log()
            .iter()
            .filter(|l| l.contains("reloaded certificates, policy and cursor keys"))
            .count()
    };
    let config = daemon.config_path().to_owned();
    let text = std::fs::read_to_string(&config).unwrap();
    // Changed and signalled at once: SIGHUP applies it.
    std::fs::write(&config, format!("{text}\n# changed once\n")).unwrap();
    daemon.signal(libc::SIGHUP);
    wait_for("the SIGHUP reload", async || reloads() >= 1).await;
    tokio::time::sleep(Duration::from_millis(3500)).await;
    assert_eq!(reloads(), 1, "the file watch saw the change SIGHUP applied");
    // Changed without a signal: the file watch applies it, once.
    std::fs::write(&config, format!("{text}\n# changed twice\n")).unwrap();
    wait_for("the file watch's reload", async || reloads() >= 2).await;
    tokio::time::sleep(Duration::from_millis(3500)).await;
    assert_eq!(reloads(), 2);
}

/// A log written to a file (journald, `bpfmapd 2> log`) carries no terminal
/// colour codes: only a terminal gets them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_text_log_written_to_a_file_has_no_colour_codes() {
    let fs = BpfFs::new();
    let state = tempfile::tempdir().unwrap();
    let addr = free_addr("127.0.0.1");
    let config = state.path().join("bpfmapd.toml");
    std::fs::write(
        &config,
        format!(
            "listen = \"{addr}\"\nroots = [\"{}\"]\nstate_dir = \"{}\"\nmount_bpffs = false\nlog_format = \"text\"\n",
            fs.path().display(),
            state.path().display()
        ),
    )
    .unwrap();
    let log_path = state.path().join("bpfmapd.log");
    let mut child = std::process::Command::new(daemon_bin!())
        .arg("--config")
        .arg(&config)
        .env("RUST_LOG", "info")
        .stderr(std::fs::File::create(&log_path).unwrap())
        .spawn()
        .unwrap();
    let started = Instant::now();
    while std::net::TcpStream::connect(addr).is_err() {
        assert!(
            started.elapsed() < Duration::from_secs(20),
            "the daemon did not listen: {}",
            std::fs::read_to_string(&log_path).unwrap_or_default()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let _ = child.kill();
    let _ = child.wait();
    let log = std::fs::read_to_string(&log_path).unwrap();
    assert!(log.contains("bpfmapd listening"), "{log}");
    assert!(
        !log.contains('\x1b'),
        "colour codes in a log file:\n{log:?}"
    );
}

/// A daemon given more memory for dumps (`limits.max_queued_bytes` 192 MiB:
/// chunks of 384 KiB) keeps its chunks' buffers in the heap, where each
/// chunk reuses the pages of the one before: a dump does not fault its
/// data's pages in afresh (mapped afresh, as buffers of 128 KiB and up
/// were, they cost nearly a fault per page of the map's data, and 5-9 % of
/// a dump's time), and every entry arrives.
#[tokio::test]
async fn large_chunks_reuse_the_heap_rather_than_fault_pages_in() {
    const N: u32 = 200_000;
    const VALUE: usize = 56;
    let fs = BpfFs::new();
    let state = tempfile::tempdir().unwrap();
    let map = create_map(MapType::HASH, 8, VALUE as u32, N);
    let keys: Vec<u8> = (0..u64::from(N)).flat_map(u64::to_le_bytes).collect();
    let values: Vec<u8> = (0..u64::from(N))
        .flat_map(|k| {
            let mut v = [0u8; VALUE];
            v[..8].copy_from_slice(&(k * 7).to_le_bytes());
            v
        })
        .collect();
    update_batch(&map, &keys, &values);
    fs.pin(&map, "wide");
    let daemon = DaemonProcess::start(
        daemon_bin!(),
        fs.path(),
        state.path(),
        free_addr("127.0.0.1"),
        &format!("[limits]\nmax_queued_bytes = {}\n", 192u64 << 20),
    );
    let client = Client::connect(&daemon.url(), ConnectOptions::default())
        .await
        .unwrap();
    let name: MapName = "wide".parse().unwrap();
    let dump = || async {
        let mut dump = client.dump(&name, DumpOptions::default());
        let (mut n, mut key_sum, mut largest) = (0u64, 0u64, 0);
        while let Some(chunk) = dump.next_chunk().await.unwrap() {
            largest = largest.max(chunk.len());
            for e in &chunk {
                let k = u64::from_le_bytes(e.key.try_into().unwrap());
                let ValueRef::Single(value) = e.value else {
                    panic!("a hash map's value is single")
                };
                let v = u64::from_le_bytes(value[..8].try_into().unwrap());
                assert_eq!(v, k * 7, "the value of key {k}");
                key_sum += k;
                n += 1;
            }
        }
        assert_eq!(n, u64::from(N));
        assert_eq!(key_sum, u64::from(N) * u64::from(N - 1) / 2);
        largest
    };
    // The first dump grows the heap.
    let largest = dump().await;
    assert_eq!(
        largest,
        (384 << 10) / (8 + VALUE),
        "chunks fill a sixth of the dump's share (2.25 MiB)"
    );
    let before = minor_faults(daemon.pid());
    const DUMPS: u64 = 3;
    for _ in 0..DUMPS {
        dump().await;
    }
    let per_dump = (minor_faults(daemon.pid()) - before) / DUMPS;
    let pages = u64::from(N) * (8 + VALUE as u64) / 4096;
    println!("{per_dump} page faults per dump of {pages} pages of entries");
    assert!(
        per_dump < pages / 4,
        "the daemon faulted {per_dump} pages in per dump of {pages} pages of entries: its chunks' buffers were not reused"
    );
}
