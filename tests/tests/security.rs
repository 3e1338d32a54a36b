//! Remote access done safely: mutual TLS, per-identity authorization,
//! bounded resources and hostile input, against a daemon with certificates
//! made at test time.

use std::{sync::atomic::Ordering, time::Duration};

use bpfmap_client::{
    Client, ClientTls, ConnectOptions, DumpOptions, LookupOptions, MapInfo, MapName, RetryPolicy,
    pb,
};
use bpfmap_tests::{
    pki::{Name, Pki, Validity},
    *,
};
use bpfmapd::{Config, Limits, Operation, RuleConfig};
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tonic::Code;

const OPS: &str = "spiffe://example.org/ops/alice";
const OPS2: &str = "spiffe://example.org/ops/bob";

fn rule(ids: &[&str], maps: &[&str], ops: &[Operation]) -> RuleConfig {
    RuleConfig {
        identities: ids.iter().map(|s| s.to_string()).collect(),
        maps: maps.iter().map(|s| s.to_string()).collect(),
        operations: ops.to_vec(),
    }
}

fn all_ops() -> Vec<Operation> {
    vec![Operation::List, Operation::Dump, Operation::Lookup]
}

struct Secure {
    fs: BpfFs,
    _state: tempfile::TempDir,
    pki: Pki,
    daemon: Daemon,
}

impl Secure {
    async fn start(rules: Vec<RuleConfig>, limits: Limits) -> Self {
        let fs = BpfFs::new();
        let state = tempfile::tempdir().unwrap();
        let pki = Pki::new();
        let daemon = Daemon::start_with(Config {
            tls: Some(pki.server_files()),
            rules,
            limits,
            health_listen: Some("127.0.0.1:0".parse().unwrap()),
            ..Daemon::config(fs.path(), state.path())
        })
        .await;
        Self {
            fs,
            _state: state,
            pki,
            daemon,
        }
    }

    async fn client(&self, stem: &str, name: Name<'_>) -> Client {
        let tls = self.pki.client(stem, name, Validity::Now);
        let options = ConnectOptions::default()
            .with_tls(tls)
            .with_retry(RetryPolicy::never());
        Client::connect(&self.daemon.tls_addr(), options)
            .await
            .unwrap()
    }
}

/// Whether the daemon refuses a client with this certificate (at the
/// handshake, or at the first call: with TLS 1.3 the client learns of the
/// server's rejection only then).
async fn refused(daemon: &Daemon, tls: &ClientTls) -> bool {
    match daemon.tls_client(tls).await {
        Err(_) => true,
        Ok(c) => c.list_maps().await.is_err(),
    }
}

/// A TLS channel that trusts the server but presents no certificate.
async fn anonymous_tls(pki: &Pki, daemon: &Daemon) -> tonic::transport::Channel {
    let ca = std::fs::read(pki.path("ca.pem")).unwrap();
    tonic::transport::Endpoint::from_shared(daemon.tls_addr())
        .unwrap()
        .tls_config(
            tonic::transport::ClientTlsConfig::new()
                .ca_certificate(tonic::transport::Certificate::from_pem(ca)),
        )
        .unwrap()
        .connect()
        .await
        .expect("TLS without a client certificate connects")
}

async fn health(channel: tonic::transport::Channel) -> i32 {
    let mut h = tonic_health::pb::health_client::HealthClient::new(channel);
    h.check(tonic_health::pb::HealthCheckRequest {
        service: "bpfmap.v1.MapService".into(),
    })
    .await
    .unwrap()
    .into_inner()
    .status
}

#[tokio::test]
async fn without_a_client_certificate_only_health_answers() {
    let s = Secure::start(vec![rule(&[OPS], &["**"], &all_ops())], Limits::default()).await;
    let channel = anonymous_tls(&s.pki, &s.daemon).await;
    let mut raw = pb::map_service_client::MapServiceClient::new(channel.clone());
    let e = raw
        .list_maps(pb::ListMapsRequest::default())
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::Unauthenticated, "{e:?}");
    assert!(
        e.message().contains("client certificate"),
        "{}",
        e.message()
    );
    // Reflection too.
    let mut refl = tonic_reflection::pb::v1::server_reflection_client::ServerReflectionClient::new(
        channel.clone(),
    );
    let req = tonic_reflection::pb::v1::ServerReflectionRequest {
        host: String::new(),
        message_request: Some(
            tonic_reflection::pb::v1::server_reflection_request::MessageRequest::ListServices(
                String::new(),
            ),
        ),
    };
    let e = refl
        .server_reflection_info(futures::stream::iter([req]))
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::Unauthenticated);
    // Health is open, over TLS and on the plaintext probe port.
    assert_eq!(health(channel).await, 1 /* SERVING */);
    let probe = tonic::transport::Endpoint::from_shared(format!(
        "http://{}",
        s.daemon.running.health_addr().unwrap()
    ))
    .unwrap()
    .connect()
    .await
    .unwrap();
    assert_eq!(health(probe.clone()).await, 1);
    // The probe port serves nothing else.
    let e = pb::map_service_client::MapServiceClient::new(probe)
        .list_maps(pb::ListMapsRequest::default())
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::Unimplemented);
    s.daemon.stop().await;
}

#[tokio::test]
async fn certificates_from_another_ca_expired_or_not_yet_valid_are_refused() {
    let s = Secure::start(
        vec![rule(&["spiffe://**"], &["**"], &all_ops())],
        Limits::default(),
    )
    .await;
    let other = Pki::new();
    other.client("foreign", Name::Spiffe(OPS), Validity::Now);
    // Trust our CA for the server, present the other CA's certificate.
    let foreign = s
        .pki
        .client_tls(&other.path("foreign.pem"), &other.path("foreign.key"));
    let expired = s
        .pki
        .client("expired", Name::Spiffe(OPS), Validity::Expired);
    let future = s
        .pki
        .client("future", Name::Spiffe(OPS), Validity::NotYetValid);
    for (what, tls) in [
        ("another CA", foreign),
        ("expired", expired),
        ("not yet valid", future),
    ] {
        assert!(
            refused(&s.daemon, &tls).await,
            "a certificate from {what} was accepted"
        );
    }
    // The same identity with a good certificate works.
    s.client("good", Name::Spiffe(OPS))
        .await
        .list_maps()
        .await
        .unwrap();
    s.daemon.stop().await;
}

#[tokio::test]
async fn the_policy_decides_who_sees_and_reads_what() {
    use Operation::*;
    let s = Secure::start(
        vec![
            rule(&["spiffe://example.org/ops/*"], &["demo/*"], &[List, Dump]),
            rule(&["dns:reader.example.org"], &["other/*"], &[Lookup]),
            rule(&["cn:dumper"], &["demo/a"], &[Dump]),
        ],
        Limits::default(),
    )
    .await;
    let (_a, expected_a) = u64_hash(&s.fs, "demo/a", 100, 128);
    let _b = u64_hash(&s.fs, "demo/b", 10, 16);
    let _c = u64_hash(&s.fs, "other/c", 10, 16);
    std::os::unix::fs::symlink(s.fs.path().join("other/c"), s.fs.path().join("demo/link")).unwrap();

    let ops = s.client("ops", Name::Spiffe(OPS)).await;
    let reader = s.client("reader", Name::Dns("reader.example.org")).await;
    let nobody = s.client("nobody", Name::Cn("mallory")).await;

    // ListMaps shows only what the caller may list.
    let paths = |maps: Vec<MapInfo>| {
        maps.iter()
            .map(|m| m.path().unwrap_or_default().to_owned())
            .collect::<Vec<_>>()
    };
    // (Symlinks are not listed; they resolve when named.)
    assert_eq!(paths(ops.list_maps().await.unwrap()), ["demo/a", "demo/b"]);
    assert!(nobody.list_maps().await.unwrap().is_empty());
    assert!(reader.list_maps().await.unwrap().is_empty());

    assert_eq!(
        dump_all(&ops, "demo/a", DumpOptions::default()).await,
        expected_a
    );
    // Dumping needs no other permission, in either layout.
    let dumper = s.client("dumper", Name::Cn("dumper")).await;
    for packed in [true, false] {
        let options = DumpOptions::default().with_packed(packed);
        assert_eq!(dump_all(&dumper, "demo/a", options).await, expected_a);
    }
    assert!(dumper.list_maps().await.unwrap().is_empty());
    let denied = |e: bpfmap_client::Error| {
        assert_eq!(code_of(&e), Code::PermissionDenied, "{e}");
        e.to_string()
    };
    let dump = |c: &Client, m: &str| {
        let c = c.clone();
        let m: MapName = m.parse().unwrap();
        async move {
            let mut d = c.dump(&m, DumpOptions::default());
            d.next_chunk().await.map(|_| ())
        }
    };
    // A map outside the rule, and one that does not exist: the same answer.
    let e1 = denied(dump(&ops, "other/c").await.unwrap_err());
    let e2 = denied(dump(&ops, "other/nope").await.unwrap_err());
    assert_eq!(
        e1.replace("other/c", "X"),
        e2.replace("other/nope", "X"),
        "existence leaks"
    );
    assert!(e1.contains(OPS), "{e1}");
    // Inside the rule, a missing map is NOT_FOUND.
    assert_eq!(
        code_of(&dump(&ops, "demo/nope").await.unwrap_err()),
        Code::NotFound
    );
    // A symlink inside an allowed directory to a map outside it.
    denied(dump(&ops, "demo/link").await.unwrap_err());
    // Operation not granted; identity without rules.
    let key = vec![0u8; 8];
    denied(
        ops.lookup(
            &"demo/a".parse().unwrap(),
            vec![key.clone()],
            LookupOptions::default(),
        )
        .await
        .unwrap_err(),
    );
    denied(dump(&nobody, "demo/a").await.unwrap_err());
    // A certificate whose only name is a CN that reads like an allowed SPIFFE
    // ID is a CN identity: it gets nothing.
    let impostor = s.client("impostor", Name::Cn(OPS)).await;
    let e = denied(dump(&impostor, "demo/a").await.unwrap_err());
    assert!(e.contains(&format!("cn:{OPS}")), "{e}");
    assert!(impostor.list_maps().await.unwrap().is_empty());
    denied(
        nobody
            .get_map(&"demo/a".parse().unwrap())
            .await
            .unwrap_err(),
    );
    // The DNS-named identity may look up in other/*, nothing else.
    let r = reader
        .lookup(
            &"other/c".parse().unwrap(),
            vec![key],
            LookupOptions::default(),
        )
        .await
        .unwrap();
    assert!(r[0].found());
    denied(dump(&reader, "other/c").await.unwrap_err());
    s.daemon.stop().await;
}

#[tokio::test]
async fn a_cursor_replayed_by_another_identity_is_rejected() {
    let s = Secure::start(
        vec![rule(&["spiffe://example.org/ops/*"], &["**"], &all_ops())],
        Limits::default(),
    )
    .await;
    let (_m, expected) = u64_hash(&s.fs, "m", 500, 1024);
    let alice = s.client("alice", Name::Spiffe(OPS)).await;
    let bob = s.client("bob", Name::Spiffe(OPS2)).await;
    let mut d = alice.dump(
        &"m".parse().unwrap(),
        DumpOptions::default().with_chunk_size(100),
    );
    let first = d.next_chunk().await.unwrap().unwrap();
    let cursor = d.cursor().to_owned();
    drop(d);
    let options = DumpOptions::default().with_cursor(cursor.clone());
    let mut stolen = bob.dump(&"m".parse().unwrap(), options.clone());
    let e = stolen.next_chunk().await.unwrap_err();
    assert_eq!(code_of(&e), Code::PermissionDenied, "{e}");
    assert_eq!(reason_of(&e), "CURSOR_OTHER_IDENTITY");
    // Its owner can still use it.
    let rest = dump_all(&alice, "m", options).await;
    let mut all = collect_unique(first);
    all.extend(rest);
    assert_eq!(all, expected);
    s.daemon.stop().await;
}

#[tokio::test]
async fn dumps_beyond_the_limit_get_resource_exhausted_and_the_rest_are_served() {
    let fs = BpfFs::new();
    let state = tempfile::tempdir().unwrap();
    let (_m, expected) = u64_hash(&fs, "m", 50_000, 65_536);
    let daemon = Daemon::start_with(Config {
        limits: Limits {
            max_dumps: 4,
            max_dumps_per_identity: 100,
            ..Limits::default()
        },
        ..Daemon::config(fs.path(), state.path())
    })
    .await;
    let client = daemon
        .client_with(ConnectOptions::default().with_retry(RetryPolicy::never()))
        .await;
    // Twice the limit, at once; each reads one chunk and holds its stream.
    let opened = futures::future::join_all((0..8).map(|_| {
        let client = client.clone();
        async move {
            let options = DumpOptions::default().with_chunk_size(10);
            let mut d = client.dump(&"m".parse().unwrap(), options);
            d.next_chunk().await.map(|c| (d, c.unwrap()))
        }
    }))
    .await;
    let (mut running, mut refused) = (Vec::new(), 0);
    for r in opened {
        match r {
            Ok(x) => running.push(x),
            Err(e) => {
                assert_eq!(code_of(&e), Code::ResourceExhausted, "{e}");
                assert!(e.to_string().contains("max_dumps"), "{e}");
                refused += 1;
            }
        }
    }
    assert_eq!((running.len(), refused), (4, 4));
    // Still healthy: another client's calls work while the slots are taken
    // (this client's connection window is full of unread chunks).
    let other = daemon.client().await;
    assert_eq!(other.list_maps().await.unwrap().len(), 1);
    // The running dumps finish with exactly the map's entries (read
    // together: on one HTTP/2 connection, a stream nobody reads holds the
    // connection window).
    let finished =
        futures::future::join_all(running.into_iter().map(|(mut d, first)| async move {
            let mut got = first.to_entries();
            while let Some(c) = d.next_chunk().await.unwrap() {
                got.extend(c);
            }
            collect_unique(got)
        }))
        .await;
    for got in finished {
        assert_eq!(got, expected);
    }
    // Slots are free again.
    assert_eq!(daemon.running.stats().active.load(Ordering::SeqCst), 0);
    dump_all(&other, "m", DumpOptions::default()).await;
    daemon.stop().await;
}

#[tokio::test]
async fn a_client_that_never_reads_is_cut_off_and_can_resume() {
    let fs = BpfFs::new();
    let state = tempfile::tempdir().unwrap();
    let (_m, expected) = u64_hash(&fs, "m", 1_000_000, 1_000_000);
    let daemon = Daemon::start_with(Config {
        limits: Limits {
            stall_timeout: Duration::from_secs(1),
            ..Limits::default()
        },
        ..Daemon::config(fs.path(), state.path())
    })
    .await;
    let stats = daemon.running.stats().clone();
    let channel = tonic::transport::Endpoint::from_shared(daemon.addr())
        .unwrap()
        .connect()
        .await
        .unwrap();
    let mut raw = pb::map_service_client::MapServiceClient::new(channel);
    let req = pb::DumpMapRequest {
        map: Some(pb::MapRef {
            r#ref: Some(pb::map_ref::Ref::Path("m".into())),
            declare: None,
        }),
        layout: pb::Layout::Packed as i32,
        ..Default::default()
    };
    let mut stream = raw.dump_map(req.clone()).await.unwrap().into_inner();
    // Read nothing for a while.
    let mut waited = 0;
    while stats.active.load(Ordering::SeqCst) != 0 || waited < 10 {
        tokio::time::sleep(Duration::from_millis(100)).await;
        waited += 1;
        assert!(waited < 100, "the stalled stream was not ended");
    }
    let read = stats.chunks_read.load(Ordering::SeqCst);
    eprintln!("{read} of ~977 chunks read before the stall timeout");
    assert!(read < 500, "the reader kept going: {read} chunks");
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(
        stats.chunks_read.load(Ordering::SeqCst),
        read,
        "reads after the stall"
    );

    // The client wakes up: it gets what was queued, then UNAVAILABLE.
    let mut got = Entries::new();
    let mut cursor = String::new();
    let status = loop {
        match stream.message().await {
            Ok(Some(m)) => {
                let p = m.packed.unwrap();
                for i in 0..p.count as usize {
                    let k = p.keys[i * 8..i * 8 + 8].to_vec();
                    let v = bpfmap_client::Value::Single(p.values[i * 8..i * 8 + 8].to_vec());
                    assert!(got.insert(k, v).is_none());
                }
                cursor = m.cursor;
            }
            Ok(None) => panic!("stream ended without a status"),
            Err(s) => break s,
        }
    };
    assert_eq!(status.code(), Code::Unavailable, "{status:?}");
    assert!(status.message().contains("resume"), "{}", status.message());
    // ... and resumes from its last cursor.
    let client = daemon.client().await;
    let rest = dump_all(&client, "m", DumpOptions::default().with_cursor(cursor)).await;
    got.extend(rest);
    assert!(got == expected, "resumed dump differs from the map");
    daemon.stop().await;
}

#[tokio::test]
async fn garbage_plaintext_and_silent_clients_on_the_tls_port() {
    let s = Secure::start(
        vec![rule(&[OPS], &["**"], &all_ops())],
        Limits {
            handshake_timeout: Duration::from_secs(1),
            ..Limits::default()
        },
    )
    .await;
    let addr = s.daemon.running.local_addr();
    // Garbage bytes: the server hangs up.
    let mut tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
    tcp.write_all(b"\x16\x03\x01\xff\xffGET / HTTP/1.1\r\n\r\ngarbage")
        .await
        .unwrap();
    let mut buf = [0u8; 1024];
    let read = tokio::time::timeout(Duration::from_secs(5), async {
        loop {
            match tcp.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(_) => {} // a TLS alert
            }
        }
    })
    .await;
    assert!(read.is_ok(), "connection with garbage was not closed");
    // A client that sends nothing: closed after the handshake timeout.
    let mut silent = tokio::net::TcpStream::connect(addr).await.unwrap();
    let closed = tokio::time::timeout(Duration::from_secs(5), silent.read(&mut buf)).await;
    assert!(
        matches!(closed, Ok(Ok(0)) | Ok(Err(_))),
        "silent connection kept open"
    );
    // A plaintext gRPC client.
    let plain = Client::connect_lazy(&s.daemon.addr(), ConnectOptions::default()).unwrap();
    let e = plain.list_maps().await.unwrap_err();
    assert!(
        matches!(
            code_of(&e),
            Code::Unavailable | Code::Unknown | Code::Internal
        ),
        "{e}"
    );
    // The daemon still serves.
    s.client("ok", Name::Spiffe(OPS))
        .await
        .list_maps()
        .await
        .unwrap();
    s.daemon.stop().await;
}

#[tokio::test]
async fn oversized_requests_and_bad_bounds_are_refused_with_what_is_allowed() {
    let fs = BpfFs::new();
    let state = tempfile::tempdir().unwrap();
    let _m = u64_hash(&fs, "m", 10, 16);
    let daemon = Daemon::start_with(Config {
        limits: Limits {
            max_request_bytes: 16 * 1024,
            ..Limits::default()
        },
        ..Daemon::config(fs.path(), state.path())
    })
    .await;
    let client = daemon
        .client_with(ConnectOptions::default().with_retry(RetryPolicy::never()))
        .await;
    let map: MapName = "m".parse().unwrap();
    // 4000 keys of 8 bytes: over 16 KiB.
    let e = client
        .lookup(&map, vec![vec![0; 8]; 4000], LookupOptions::default())
        .await
        .unwrap_err();
    assert_eq!(code_of(&e), Code::OutOfRange, "{e}");
    assert!(e.to_string().contains("16384"), "{e}");
    // Within the size, over the key count.
    let daemon_ok = client
        .lookup(&map, vec![vec![0; 8]; 1000], LookupOptions::default())
        .await
        .unwrap();
    assert_eq!(daemon_ok.len(), 1000);
    let mut d = client.dump(&map, DumpOptions::default().with_chunk_size(1_000_000));
    let e = d.next_chunk().await.unwrap_err();
    assert_eq!(code_of(&e), Code::InvalidArgument);
    assert!(e.to_string().contains("65536"), "{e}");
    daemon.stop().await;
}

#[tokio::test]
async fn certificates_and_policy_reload_without_a_restart() {
    use Operation::*;
    let s = Secure::start(
        vec![rule(&[OPS], &["demo/a"], &[List, Dump])],
        Limits::default(),
    )
    .await;
    let _a = u64_hash(&s.fs, "demo/a", 10, 16);
    let _b = u64_hash(&s.fs, "demo/b", 10, 16);
    let ops = s.client("ops", Name::Spiffe(OPS)).await;
    assert_eq!(ops.list_maps().await.unwrap().len(), 1);

    let mut config = s.daemon.config.clone();
    // A bad rule: rejected, the old policy stays.
    config.rules = vec![rule(&[OPS], &["demo/[b"], &[List])];
    let e = s.daemon.running.reload(&config).unwrap_err();
    assert!(e.to_string().contains("demo/[b"), "{e}");
    assert_eq!(ops.list_maps().await.unwrap().len(), 1);
    // A good one takes effect for calls on existing connections.
    config.rules = vec![rule(&[OPS], &["demo/*"], &[List, Dump])];
    s.daemon.running.reload(&config).unwrap();
    assert_eq!(ops.list_maps().await.unwrap().len(), 2);

    // A new client CA: new connections need certificates from it.
    let pki2 = Pki::new();
    let mut files = s.pki.server_files();
    files.client_ca = pki2.path("ca.pem");
    config.tls = Some(files.clone());
    // A missing file is rejected and changes nothing.
    let mut broken = config.clone();
    broken.tls.as_mut().unwrap().cert = s.pki.path("missing.pem");
    assert!(s.daemon.running.reload(&broken).is_err());
    s.client("still", Name::Spiffe(OPS))
        .await
        .list_maps()
        .await
        .unwrap();

    s.daemon.running.reload(&config).unwrap();
    let old = s.pki.client("old", Name::Spiffe(OPS), Validity::Now);
    assert!(
        refused(&s.daemon, &old).await,
        "a certificate from the old CA is still accepted"
    );
    pki2.client("new", Name::Spiffe(OPS), Validity::Now);
    // The server's certificate is unchanged: trust its CA.
    let new = s
        .pki
        .client_tls(&pki2.path("new.pem"), &pki2.path("new.key"));
    s.daemon
        .tls_client(&new)
        .await
        .unwrap()
        .list_maps()
        .await
        .unwrap();
    s.daemon.stop().await;
}

#[tokio::test]
async fn plaintext_on_a_public_address_is_refused_at_start() {
    let fs = BpfFs::new();
    let state = tempfile::tempdir().unwrap();
    let config = Config {
        listen: "0.0.0.0:0".parse().unwrap(),
        ..Daemon::config(fs.path(), state.path())
    };
    let e = bpfmapd::start(&config).await.unwrap_err();
    assert!(e.to_string().contains("refusing to serve plaintext"), "{e}");
    let running = bpfmapd::start(&Config {
        insecure: true,
        ..config
    })
    .await
    .unwrap();
    running.stop().await.unwrap();
}

#[tokio::test(flavor = "multi_thread")]
async fn grpcurl_with_a_client_certificate_lists_and_dumps() {
    let s = Secure::start(vec![rule(&[OPS], &["**"], &all_ops())], Limits::default()).await;
    let (_m, _) = u64_hash(&s.fs, "demo/m", 30, 64);
    s.pki.client("grpcurl", Name::Spiffe(OPS), Validity::Now);
    s.pki.client(
        "stranger",
        Name::Spiffe("spiffe://example.org/x"),
        Validity::Now,
    );
    let addr = s.daemon.running.local_addr().to_string();
    let dir = s.pki.path("");
    let run = async |stem: &str, flags: &[&str], args: &[&str]| {
        let file = |f: String| dir.join(f).into_os_string();
        let mut argv = vec![
            "-cacert".into(),
            file("ca.pem".into()),
            "-cert".into(),
            file(format!("{stem}.pem")),
            "-key".into(),
            file(format!("{stem}.key")),
        ];
        argv.extend(flags.iter().map(Into::into));
        grpcurl(&argv, &addr, args).await
    };
    let (ok, out, err) = run("grpcurl", &[], &["list"]).await;
    assert!(ok, "{err}");
    assert!(out.contains("bpfmap.v1.MapService"), "{out}");
    let (ok, out, err) = run(
        "grpcurl",
        &["-d", r#"{"map":{"path":"demo/m"}}"#],
        &["bpfmap.v1.MapService/DumpMap"],
    )
    .await;
    assert!(ok, "{err}");
    assert_eq!(out.matches("\"key\"").count(), 30, "{out}");
    let (ok, _, err) = run(
        "stranger",
        &["-d", r#"{"map":{"path":"demo/m"}}"#],
        &["bpfmap.v1.MapService/DumpMap"],
    )
    .await;
    assert!(!ok);
    assert!(err.contains("PermissionDenied"), "{err}");
    s.daemon.stop().await;
}
