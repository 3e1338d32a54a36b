//! A soak run: one daemon (the real binary, mutual TLS, a policy that is
//! reloaded while it runs) under a mix of work for a while (10 minutes by
//! default), sampled once a second: its resident memory, open descriptors,
//! threads, open connections, the latency of GetMap from a client of its
//! own, and the operations done and failed of every kind. Writes `soak.csv`
//! (one row per second) and `soak.png` (the series over time), prints a
//! summary, and exits nonzero if the daemon died.
//!
//!     cargo bench -p bpfmap-tests --bench soak                            (as root)
//!     cargo bench -p bpfmap-tests --bench soak -- --duration 1m --out DIR
//!
//! The mix, each from tasks of its own with an identity of its own: full
//! dumps (a 1,000,000-entry hash every few seconds, the small maps every
//! second), lookups, slow readers (raw streams of the large map read a
//! chunk at a time with sleeps, dropped after a while), connection churn
//! (connect, one call, drop), TLS handshakes (good certificates, and ones
//! the daemon must refuse: another CA, expired), and policy reloads (the
//! rules rewritten, SIGHUP or the file watch, the change checked by a call
//! it allows or denies).
//!
//! Text in the chart is drawn with a TrueType font read at run time
//! (`--font`, by default DejaVu Sans from Debian's `fonts-dejavu-core`);
//! no system font lookup (fontconfig, freetype) is involved.

use std::{
    collections::BTreeMap,
    fmt::Display,
    io::Write as _,
    net::SocketAddr,
    path::{Path, PathBuf},
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, AtomicU64, Ordering},
    },
    time::{Duration, Instant},
};

use anyhow::{Context as _, anyhow, bail, ensure};
use bpfmap_client::{
    Client, ClientTls, Code, ConnectOptions, DumpOptions, LookupOptions, MapName, RetryPolicy,
    ValueRef, pb,
};
use bpfmap_tests::{
    BpfFs, MapType, Rng, create_map, map_ref,
    pki::{Name, Pki, Validity},
    process::{DaemonProcess, free_addr, host_ticks, send_signal, stat_ticks},
    u64_hash, update_batch,
};
use clap::Parser;
use tokio::io::AsyncReadExt as _;

/// The large map: key i (u64 LE) -> i * 3 (u64 LE).
const BIG: &str = "big/flows";
const BIG_ENTRIES: u64 = 1_000_000;
/// The small maps (u64 hashes of the same contents) and their sizes.
const SMALL: [(&str, u32); 3] = [("small/a", 100), ("small/b", 1_000), ("small/c", 10_000)];
/// A small array (u32 i -> u64 i * 7).
const ARRAY: &str = "small/array";
const ARRAY_ENTRIES: u32 = 256;

const READER: &str = "spiffe://soak.test/reader";
const SLOW: &str = "spiffe://soak.test/slow";
const PROBER: &str = "spiffe://soak.test/prober";
const CHURN: &str = "spiffe://soak.test/churn";
const GUEST: &str = "spiffe://soak.test/guest";

/// The soak run's options.
#[derive(Debug, Parser)]
#[command(name = "soak")]
struct Args {
    /// How long the mix runs ("90s", "10m", "1h", or seconds).
    #[arg(long, default_value = "10m", value_parser = parse_duration)]
    duration: Duration,
    /// Where soak.csv and soak.png go [default: TARGET_DIR/soak].
    #[arg(long)]
    out: Option<PathBuf>,
    /// The TrueType font for the chart's text.
    #[arg(
        long,
        default_value = "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf"
    )]
    font: PathBuf,
    /// Passed by `cargo bench`; ignored.
    #[arg(long, hide = true)]
    bench: bool,
}

fn parse_duration(s: &str) -> Result<Duration, String> {
    let bad = || format!("not a duration: {s:?} (e.g. 90s, 10m, 1h)");
    let (number, unit) = s
        .find(|c: char| !c.is_ascii_digit() && c != '.')
        .map_or((s, "s"), |i| s.split_at(i));
    let n: f64 = number.parse().map_err(|_| bad())?;
    let secs = match unit {
        "s" => n,
        "m" => n * 60.0,
        "h" => n * 3600.0,
        _ => return Err(bad()),
    };
    (secs.is_finite() && secs > 0.0)
        .then(|| Duration::from_secs_f64(secs))
        .ok_or_else(bad)
}

/// The kinds of operation the mix does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Dump,
    Lookup,
    SlowRead,
    Churn,
    Handshake,
    BadCert,
    Reload,
    GetMap,
}

const KINDS: [Kind; 8] = [
    Kind::Dump,
    Kind::Lookup,
    Kind::SlowRead,
    Kind::Churn,
    Kind::Handshake,
    Kind::BadCert,
    Kind::Reload,
    Kind::GetMap,
];

impl Kind {
    fn name(self) -> &'static str {
        match self {
            Kind::Dump => "dump",
            Kind::Lookup => "lookup",
            Kind::SlowRead => "slow_read",
            Kind::Churn => "churn",
            Kind::Handshake => "handshake",
            Kind::BadCert => "bad_cert",
            Kind::Reload => "reload",
            Kind::GetMap => "getmap",
        }
    }

    fn what(self) -> &'static str {
        match self {
            Kind::Dump => "full dumps (the 1M map and the small ones)",
            Kind::Lookup => "lookups (100 keys of the 1M map, 20 of a small one)",
            Kind::SlowRead => "slow readers (streams read with sleeps, then dropped)",
            Kind::Churn => "connection churn (TLS connect, ListMaps, drop)",
            Kind::Handshake => "TLS handshakes with a good certificate",
            Kind::BadCert => "connections with a bad certificate, refused",
            Kind::Reload => "policy reloads, checked by a call",
            Kind::GetMap => "GetMap probes (every 10 ms)",
        }
    }
}

/// What the tasks share with the sampler.
#[derive(Debug, Default)]
struct Shared {
    done: [AtomicU64; KINDS.len()],
    failed: [AtomicU64; KINDS.len()],
    /// "kind: message" -> how often.
    errors: Mutex<BTreeMap<String, u64>>,
    /// GetMap latencies (ms) since the sampler last took them.
    latencies: Mutex<Vec<f64>>,
    /// Entries received by dumps and slow readers.
    entries: AtomicU64,
    stop: AtomicBool,
}

impl Shared {
    fn index(kind: Kind) -> usize {
        KINDS.iter().position(|k| *k == kind).expect("a kind")
    }

    fn ok(&self, kind: Kind) {
        self.done[Self::index(kind)].fetch_add(1, Ordering::Relaxed);
    }

    fn fail(&self, kind: Kind, e: impl Display) {
        self.failed[Self::index(kind)].fetch_add(1, Ordering::Relaxed);
        let mut msg = format!("{}: {e:#}", kind.name());
        if msg.len() > 200 {
            let mut end = 200;
            while !msg.is_char_boundary(end) {
                end -= 1;
            }
            msg.truncate(end);
        }
        *self.errors.lock().unwrap().entry(msg).or_default() += 1;
    }

    fn record(&self, kind: Kind, result: anyhow::Result<()>) {
        match result {
            Ok(()) => self.ok(kind),
            Err(e) => self.fail(kind, e),
        }
    }

    fn stopped(&self) -> bool {
        self.stop.load(Ordering::Relaxed)
    }

    /// Sleeps for `d`, or less if the run ends; whether it ended.
    async fn pause(&self, d: Duration) -> bool {
        let until = Instant::now() + d;
        while !self.stopped() {
            let left = until.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return false;
            }
            tokio::time::sleep(left.min(Duration::from_millis(100))).await;
        }
        true
    }
}

/// PEM files of one client certificate.
#[derive(Debug, Clone)]
struct Pem {
    ca: Vec<u8>,
    cert: Vec<u8>,
    key: Vec<u8>,
}

impl Pem {
    fn of(pki: &Pki, stem: &str, trusted_ca: &Pki) -> Self {
        let read =
            |p: PathBuf| std::fs::read(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
        Self {
            ca: read(trusted_ca.path("ca.pem")),
            cert: read(pki.path(&format!("{stem}.pem"))),
            key: read(pki.path(&format!("{stem}.key"))),
        }
    }

    fn client_tls(&self) -> ClientTls {
        ClientTls::new(self.ca.clone(), self.cert.clone(), self.key.clone())
    }

    /// A rustls client configuration for raw handshakes: this certificate,
    /// no session resumption (every handshake is a full one).
    fn rustls(&self) -> Arc<rustls::ClientConfig> {
        use rustls::pki_types::{CertificateDer, PrivateKeyDer, pem::PemObject as _};
        let mut roots = rustls::RootCertStore::empty();
        for c in CertificateDer::pem_slice_iter(&self.ca) {
            roots.add(c.unwrap()).unwrap();
        }
        let chain: Vec<CertificateDer<'static>> = CertificateDer::pem_slice_iter(&self.cert)
            .map(Result::unwrap)
            .collect();
        let key = PrivateKeyDer::from_pem_slice(&self.key).unwrap();
        let mut config = rustls::ClientConfig::builder_with_provider(Arc::new(
            rustls::crypto::ring::default_provider(),
        ))
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(roots)
        .with_client_auth_cert(chain, key)
        .unwrap();
        config.resumption = rustls::client::Resumption::disabled();
        Arc::new(config)
    }
}

/// The daemon's TLS address.
fn https(addr: SocketAddr) -> String {
    format!("https://127.0.0.1:{}", addr.port())
}

/// A new mutual-TLS client (no retries: every failure shows).
async fn connect(addr: SocketAddr, tls: &ClientTls) -> anyhow::Result<Client> {
    let options = ConnectOptions::default()
        .with_tls(tls.clone())
        .with_retry(RetryPolicy::never());
    Ok(Client::connect(&https(addr), options).await?)
}

/// The rules of policy generation `generation`: the mix's identities, the
/// guest's rule in even generations only, and rules for other teams (their
/// number changes from one generation to the next).
fn rules(generation: u64) -> String {
    let mut s = format!("# policy generation {generation}\n");
    let rule = |s: &mut String, ids: &[&str], maps: &[&str], ops: &[&str]| {
        let list = |v: &[&str]| {
            v.iter()
                .map(|x| format!("\"{x}\""))
                .collect::<Vec<_>>()
                .join(", ")
        };
        s.push_str(&format!(
            "[[rule]]\nidentities = [{}]\nmaps = [{}]\noperations = [{}]\n",
            list(ids),
            list(maps),
            list(ops)
        ));
    };
    rule(
        &mut s,
        &[READER, SLOW],
        &["**"],
        &["list", "dump", "lookup"],
    );
    rule(&mut s, &[PROBER, CHURN], &["**"], &["list"]);
    if generation.is_multiple_of(2) {
        rule(&mut s, &[GUEST], &["small/*"], &["list", "lookup"]);
    }
    for team in 0..20 + generation % 10 {
        let id = format!("spiffe://soak.test/team{team}/*");
        let maps = format!("team{team}/**");
        rule(&mut s, &[&id], &[&maps], &["list", "dump"]);
    }
    s
}

/// GET /metrics; the value of each series, by its name and labels as
/// written ("bpfmapd_reloads_total{result=\"ok\"}").
async fn scrape(addr: SocketAddr) -> anyhow::Result<BTreeMap<String, f64>> {
    Ok(bpfmap_tests::metrics::try_scrape(addr).await?.series())
}

/// Every few seconds the 1M map, every second the small maps, all in full.
async fn dumps(shared: Arc<Shared>, addr: SocketAddr, tls: ClientTls, big: bool) {
    let mut client = None;
    let mut n = 0u64;
    loop {
        n += 1;
        let maps: Vec<(&str, u64)> = if big {
            vec![(BIG, BIG_ENTRIES)]
        } else {
            SMALL
                .iter()
                .map(|(p, n)| (*p, u64::from(*n)))
                .chain([(ARRAY, u64::from(ARRAY_ENTRIES))])
                .collect()
        };
        // A new connection now and then, else the same one.
        let mut reconnect = n.is_multiple_of(20);
        for (path, expected) in maps {
            let result = async {
                if client.is_none() || reconnect {
                    client = Some(connect(addr, &tls).await?);
                    reconnect = false;
                }
                let c = client.as_ref().expect("connected");
                let mut dump = c.dump(&path.parse::<MapName>()?, DumpOptions::default());
                let mut got = 0u64;
                while let Some(chunk) = dump.next_chunk().await? {
                    got += chunk.len() as u64;
                }
                shared.entries.fetch_add(got, Ordering::Relaxed);
                ensure!(got == expected, "{path}: {got} entries, not {expected}");
                Ok(())
            }
            .await;
            if result.is_err() {
                client = None;
            }
            shared.record(Kind::Dump, result);
        }
        if shared
            .pause(Duration::from_secs(if big { 3 } else { 1 }))
            .await
        {
            return;
        }
    }
}

/// Lookups of keys present and absent, their values checked.
async fn lookups(shared: Arc<Shared>, addr: SocketAddr, tls: ClientTls) {
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    let mut client = None;
    loop {
        let result = async {
            if client.is_none() {
                client = Some(connect(addr, &tls).await?);
            }
            let c = client.as_ref().expect("connected");
            for (path, n, count) in [(BIG, BIG_ENTRIES, 100), ("small/b", 1_000, 20)] {
                // Keys below n are present; the last few are absent.
                let keys: Vec<u64> = (0..count)
                    .map(|i| {
                        if i < count - 5 {
                            rng.below(n)
                        } else {
                            n + rng.below(1 << 40)
                        }
                    })
                    .collect();
                let results = c
                    .lookup(
                        &path.parse::<MapName>()?,
                        keys.iter().map(|k| k.to_le_bytes().to_vec()),
                        LookupOptions::default(),
                    )
                    .await?;
                ensure!(
                    results.len() == keys.len(),
                    "{path}: {} results",
                    results.len()
                );
                for (k, r) in keys.iter().zip(&results) {
                    let want = (*k < n).then(|| (k * 3).to_le_bytes());
                    let got = match r.value() {
                        Some(ValueRef::Single(v)) if r.found() => Some(v.to_vec()),
                        _ => None,
                    };
                    ensure!(
                        got.as_deref() == want.as_ref().map(|w| &w[..]),
                        "{path}: key {k} gave {got:?}"
                    );
                }
            }
            Ok(())
        }
        .await;
        if result.is_err() {
            client = None;
        }
        shared.record(Kind::Lookup, result);
        if shared.pause(Duration::from_millis(500)).await {
            return;
        }
    }
}

/// Streams of the 1M map read a chunk at a time with `sleep` between
/// chunks, through a raw tonic client on a TLS connection of its own,
/// dropped after 4 to 12 s (or read to the end).
async fn slow_reader(shared: Arc<Shared>, addr: SocketAddr, pem: Pem, sleep: Duration, seed: u64) {
    use tonic::transport::{Certificate, ClientTlsConfig, Endpoint, Identity};
    let mut rng = Rng(seed);
    loop {
        let hold = Duration::from_millis(4_000 + rng.below(8_000));
        let result = async {
            let tls = ClientTlsConfig::new()
                .ca_certificate(Certificate::from_pem(&pem.ca))
                .identity(Identity::from_pem(&pem.cert, &pem.key));
            let channel = Endpoint::from_shared(https(addr))?
                .tls_config(tls)?
                .connect()
                .await?;
            let mut grpc = pb::map_service_client::MapServiceClient::new(channel)
                .max_decoding_message_size(64 << 20);
            let mut stream = grpc
                .dump_map(pb::DumpMapRequest {
                    map: map_ref(BIG),
                    layout: pb::Layout::Packed as i32,
                    ..Default::default()
                })
                .await?
                .into_inner();
            let started = Instant::now();
            let mut got = 0u64;
            while let Some(msg) = stream.message().await? {
                got += msg.packed.map_or(0, |p| u64::from(p.count)) + msg.entries.len() as u64;
                if msg.done {
                    ensure!(got == BIG_ENTRIES, "read to the end: {got} entries");
                    break;
                }
                if started.elapsed() > hold || shared.stopped() {
                    break;
                }
                tokio::time::sleep(sleep).await;
            }
            shared.entries.fetch_add(got, Ordering::Relaxed);
            ensure!(got > 0, "no entries");
            Ok(())
        }
        .await;
        shared.record(Kind::SlowRead, result);
        if shared.pause(Duration::from_millis(500)).await {
            return;
        }
    }
}

/// Every 2 s, 10 new connections one after another: connect, ListMaps,
/// drop.
async fn churn(shared: Arc<Shared>, addr: SocketAddr, tls: ClientTls) {
    loop {
        for _ in 0..10 {
            let result = async {
                let c = connect(addr, &tls).await?;
                let maps = c.list_maps().await?;
                ensure!(maps.len() == 5, "ListMaps: {} maps", maps.len());
                Ok(())
            }
            .await;
            shared.record(Kind::Churn, result);
        }
        if shared.pause(Duration::from_secs(2)).await {
            return;
        }
    }
}

/// One TCP connection and TLS handshake with `config`, then a read: the
/// server's first HTTP/2 bytes after a handshake it accepted, its alert
/// after one it refused (TLS 1.3 tells a client of a refused certificate
/// only after its side of the handshake).
async fn handshake(addr: SocketAddr, config: Arc<rustls::ClientConfig>) -> anyhow::Result<()> {
    let attempt = async {
        let tcp = tokio::net::TcpStream::connect(addr).await?;
        let name = rustls::pki_types::ServerName::try_from("localhost").unwrap();
        let mut tls = tokio_rustls::TlsConnector::from(config)
            .connect(name, tcp)
            .await?;
        let mut buf = [0u8; 1];
        match tls.read(&mut buf).await? {
            0 => bail!("closed without a word"),
            _ => Ok(()),
        }
    };
    tokio::time::timeout(Duration::from_secs(10), attempt)
        .await
        .map_err(|_| anyhow!("no answer within 10 s"))?
}

/// Every 2 s: 4 handshakes with a good certificate; one with a certificate
/// of another CA and one with an expired one, both raw handshakes; and a
/// library connection with the other CA's certificate, whose call must
/// fail.
async fn handshakes(shared: Arc<Shared>, addr: SocketAddr, good: Pem, stranger: Pem, expired: Pem) {
    let (good_config, stranger_config, expired_config) =
        (good.rustls(), stranger.rustls(), expired.rustls());
    let stranger_tls = stranger.client_tls();
    loop {
        for _ in 0..4 {
            let r = handshake(addr, good_config.clone()).await;
            shared.record(Kind::Handshake, r);
        }
        for (what, config) in [
            ("another CA's certificate", &stranger_config),
            ("an expired certificate", &expired_config),
        ] {
            let r = match handshake(addr, config.clone()).await {
                Ok(()) => Err(anyhow!("{what} was accepted")),
                Err(_) => Ok(()),
            };
            shared.record(Kind::BadCert, r);
        }
        let r = match connect(addr, &stranger_tls).await {
            Ok(c) => match c.list_maps().await {
                Ok(_) => Err(anyhow!("a call with another CA's certificate was served")),
                Err(_) => Ok(()),
            },
            Err(_) => Ok(()),
        };
        shared.record(Kind::BadCert, r);
        if shared.pause(Duration::from_secs(2)).await {
            return;
        }
    }
}

/// Every 5 s: the rules rewritten (the guest's rule there in even
/// generations, gone in odd ones), then SIGHUP (every other time; else the
/// file watch finds the change), then waits until the daemon counted a
/// reload and the guest's call is allowed or denied as the new rules say.
async fn reloads(
    shared: Arc<Shared>,
    addr: SocketAddr,
    metrics: SocketAddr,
    pid: u32,
    config: PathBuf,
    base: String,
    guest: ClientTls,
) {
    let mut generation = 0u64;
    loop {
        if shared.pause(Duration::from_secs(5)).await {
            return;
        }
        generation += 1;
        let result = async {
            let count = |m: &BTreeMap<String, f64>, result: &str| {
                m.get(&format!("bpfmapd_reloads_total{{result=\"{result}\"}}"))
                    .copied()
                    .unwrap_or(0.0)
            };
            let before = scrape(metrics).await?;
            let tmp = config.with_extension("tmp");
            std::fs::write(&tmp, format!("{base}{}", rules(generation)))?;
            std::fs::rename(&tmp, &config)?;
            if generation.is_multiple_of(2) {
                send_signal(pid, libc::SIGHUP);
            }
            let allowed = generation.is_multiple_of(2);
            let started = Instant::now();
            loop {
                let now = scrape(metrics).await?;
                ensure!(
                    count(&now, "failed") == count(&before, "failed"),
                    "a reload failed"
                );
                if count(&now, "ok") > count(&before, "ok") {
                    let c = connect(addr, &guest).await?;
                    let answer = c.get_map(&"small/a".parse::<MapName>()?).await;
                    match (&answer, allowed) {
                        (Ok(_), true) => return Ok(()),
                        (Err(e), false) if e.code() == Code::PermissionDenied => return Ok(()),
                        (Err(e), _) if e.code() != Code::PermissionDenied => bail!("guest: {e}"),
                        _ => {}
                    }
                }
                ensure!(
                    started.elapsed() < Duration::from_secs(15),
                    "generation {generation} ({}) not in force after 15 s",
                    if allowed {
                        "guest allowed"
                    } else {
                        "guest denied"
                    }
                );
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
        .await;
        shared.record(Kind::Reload, result);
    }
}

/// GetMap every 10 ms on a connection of its own; each call's latency.
async fn prober(shared: Arc<Shared>, addr: SocketAddr, tls: ClientTls, all: Arc<Mutex<Vec<f64>>>) {
    let map: MapName = "small/a".parse().unwrap();
    let mut client = None;
    let mut tick = tokio::time::interval(Duration::from_millis(10));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    while !shared.stopped() {
        tick.tick().await;
        let result = async {
            if client.is_none() {
                client = Some(connect(addr, &tls).await?);
            }
            let c = client.as_ref().expect("connected");
            let t = Instant::now();
            tokio::time::timeout(Duration::from_secs(10), c.get_map(&map))
                .await
                .map_err(|_| anyhow!("no answer within 10 s"))??;
            let ms = t.elapsed().as_secs_f64() * 1e3;
            shared.latencies.lock().unwrap().push(ms);
            all.lock().unwrap().push(ms);
            Ok(())
        }
        .await;
        if result.is_err() {
            client = None;
        }
        shared.record(Kind::GetMap, result);
    }
}

/// One second's sample.
#[derive(Debug, Clone, Default)]
struct Row {
    t: f64,
    rss_kib: u64,
    hwm_kib: u64,
    fds: u64,
    threads: u64,
    /// The daemon's CPU time in the last second, % of one CPU.
    daemon_cpu: f64,
    /// The whole machine's CPUs busy in the last second (%), and its load.
    host_busy: f64,
    load1: f64,
    connections: Option<f64>,
    dump_slots: Option<f64>,
    getmap_calls: usize,
    p50: Option<f64>,
    p99: Option<f64>,
    max: Option<f64>,
    done: [u64; KINDS.len()],
    failed: [u64; KINDS.len()],
}

/// The `q` quantile (0..=1) of sorted samples, nearest rank.
fn quantile(sorted: &[f64], q: f64) -> Option<f64> {
    if sorted.is_empty() {
        return None;
    }
    let rank = ((q * sorted.len() as f64).ceil() as usize).clamp(1, sorted.len());
    Some(sorted[rank - 1])
}

/// (fds, threads) of a process.
fn fds_and_threads(pid: u32) -> anyhow::Result<(u64, u64)> {
    let fds = std::fs::read_dir(format!("/proc/{pid}/fd"))?.count() as u64;
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    let threads = status
        .lines()
        .find_map(|l| l.strip_prefix("Threads:"))
        .and_then(|v| v.trim().parse().ok())
        .context("no Threads: in /proc status")?;
    Ok((fds, threads))
}

/// A process's CPU time so far (user and system), in clock ticks.
fn cpu_ticks(pid: u32) -> u64 {
    stat_ticks(&format!("/proc/{pid}/stat")).map_or(0, |(user, system)| user + system)
}

fn load1() -> f64 {
    std::fs::read_to_string("/proc/loadavg")
        .ok()
        .and_then(|s| s.split_whitespace().next()?.parse().ok())
        .unwrap_or(0.0)
}

/// The daemon's own time for each GetMap of the prober, from its audit
/// log (JSON lines), in ms.
fn server_getmap_ms(log: &[String]) -> Vec<f64> {
    log.iter()
        .filter(|l| l.contains("GetMap") && l.contains(PROBER))
        .filter_map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).ok()?;
            let f = v.get("fields").unwrap_or(&v);
            (f.get("message")?.as_str()? == "rpc").then_some(())?;
            f.get("duration_ms")?.as_f64()
        })
        .collect()
}

fn write_csv(rows: &[Row], path: &Path) -> anyhow::Result<()> {
    let mut out = std::io::BufWriter::new(std::fs::File::create(path)?);
    let mut header = vec![
        "t_s",
        "rss_kib",
        "hwm_kib",
        "fds",
        "threads",
        "daemon_cpu_pct",
        "host_cpu_busy_pct",
        "load1",
        "connections_open",
        "dump_slots_in_use",
        "getmap_calls",
        "getmap_p50_ms",
        "getmap_p99_ms",
        "getmap_max_ms",
    ]
    .into_iter()
    .map(str::to_owned)
    .collect::<Vec<_>>();
    for k in KINDS {
        header.push(format!("{}_done", k.name()));
        header.push(format!("{}_failed", k.name()));
    }
    writeln!(out, "{}", header.join(","))?;
    let opt = |v: Option<f64>, digits: usize| v.map_or(String::new(), |v| format!("{v:.digits$}"));
    for r in rows {
        let mut cells = vec![
            format!("{:.0}", r.t),
            r.rss_kib.to_string(),
            r.hwm_kib.to_string(),
            r.fds.to_string(),
            r.threads.to_string(),
            format!("{:.1}", r.daemon_cpu),
            format!("{:.1}", r.host_busy),
            format!("{:.2}", r.load1),
            opt(r.connections, 0),
            opt(r.dump_slots, 0),
            r.getmap_calls.to_string(),
            opt(r.p50, 3),
            opt(r.p99, 3),
            opt(r.max, 3),
        ];
        for i in 0..KINDS.len() {
            cells.push(r.done[i].to_string());
            cells.push(r.failed[i].to_string());
        }
        writeln!(out, "{}", cells.join(","))?;
    }
    out.flush()?;
    Ok(())
}

/// The chart: memory, descriptors and threads, GetMap latency, and the
/// operations per second, over time; a PNG at `path`.
fn write_chart(rows: &[Row], path: &Path, title: &str) -> anyhow::Result<()> {
    use plotters::prelude::*;
    const W: u32 = 1600;
    const H: u32 = 1500;
    let plot = |e: &dyn Display| anyhow!("drawing the chart: {e}");
    let mut buf = vec![255u8; (W * H * 3) as usize];
    {
        let root = BitMapBackend::with_buffer(&mut buf, (W, H)).into_drawing_area();
        root.fill(&WHITE).map_err(|e| plot(&e))?;
        let root = root
            .titled(title, ("sans-serif", 26))
            .map_err(|e| plot(&e))?;
        let panels = root.split_evenly((4, 1));
        let t_max = rows.last().map_or(1.0, |r| r.t).max(1.0);
        let font = |size: i32| ("sans-serif", size);
        let legend = |c: RGBColor| {
            move |(x, y): (i32, i32)| PathElement::new(vec![(x, y), (x + 24, y)], c.stroke_width(3))
        };
        let max_of = |f: &dyn Fn(&Row) -> f64| rows.iter().map(f).fold(0.0f64, f64::max);

        // Memory.
        let top = max_of(&|r| r.rss_kib as f64 / 1024.0) * 1.15 + 1.0;
        let mut c = ChartBuilder::on(&panels[0])
            .margin(12)
            .caption("daemon resident memory (VmRSS)", font(22))
            .x_label_area_size(35)
            .y_label_area_size(70)
            .build_cartesian_2d(0f64..t_max, 0f64..top)
            .map_err(|e| plot(&e))?;
        c.configure_mesh()
            .y_desc("MiB")
            .label_style(font(16))
            .draw()
            .map_err(|e| plot(&e))?;
        c.draw_series(LineSeries::new(
            rows.iter().map(|r| (r.t, r.rss_kib as f64 / 1024.0)),
            BLUE.stroke_width(2),
        ))
        .map_err(|e| plot(&e))?
        .label("VmRSS, MiB")
        .legend(legend(BLUE));
        c.configure_series_labels()
            .position(SeriesLabelPosition::LowerRight)
            .label_font(font(16))
            .background_style(WHITE.mix(0.85))
            .border_style(BLACK)
            .draw()
            .map_err(|e| plot(&e))?;

        // Descriptors, threads, connections.
        let top = max_of(&|r| {
            (r.fds as f64)
                .max(r.threads as f64)
                .max(r.connections.unwrap_or(0.0))
        }) * 1.15
            + 1.0;
        let mut c = ChartBuilder::on(&panels[1])
            .margin(12)
            .caption(
                "daemon descriptors (/proc/PID/fd), threads, open connections",
                font(22),
            )
            .x_label_area_size(35)
            .y_label_area_size(70)
            .build_cartesian_2d(0f64..t_max, 0f64..top)
            .map_err(|e| plot(&e))?;
        c.configure_mesh()
            .label_style(font(16))
            .draw()
            .map_err(|e| plot(&e))?;
        let green = RGBColor(0, 140, 0);
        for (name, color, f) in [
            (
                "open descriptors",
                RED,
                (|r: &Row| r.fds as f64) as fn(&Row) -> f64,
            ),
            ("threads", BLUE, |r: &Row| r.threads as f64),
            ("connections open (metrics)", green, |r: &Row| {
                r.connections.unwrap_or(f64::NAN)
            }),
        ] {
            c.draw_series(LineSeries::new(
                rows.iter()
                    .map(|r| (r.t, f(r)))
                    .filter(|(_, v)| v.is_finite()),
                color.stroke_width(2),
            ))
            .map_err(|e| plot(&e))?
            .label(name)
            .legend(legend(color));
        }
        c.configure_series_labels()
            .position(SeriesLabelPosition::UpperLeft)
            .label_font(font(16))
            .background_style(WHITE.mix(0.85))
            .border_style(BLACK)
            .draw()
            .map_err(|e| plot(&e))?;

        // GetMap latency, log scale.
        let low = rows
            .iter()
            .filter_map(|r| r.p50)
            .fold(f64::INFINITY, f64::min)
            .min(1.0)
            * 0.7;
        let high = rows.iter().filter_map(|r| r.max).fold(1.0f64, f64::max) * 1.5;
        let mut c = ChartBuilder::on(&panels[2])
            .margin(12)
            .caption(
                "GetMap latency per second, from a client of its own (every 10 ms)",
                font(22),
            )
            .x_label_area_size(35)
            .y_label_area_size(70)
            .build_cartesian_2d(0f64..t_max, (low..high).log_scale())
            .map_err(|e| plot(&e))?;
        c.configure_mesh()
            .y_desc("ms (log)")
            .label_style(font(16))
            .draw()
            .map_err(|e| plot(&e))?;
        let orange = RGBColor(230, 120, 0);
        for (name, color, f) in [
            ("max", RED, (|r: &Row| r.max) as fn(&Row) -> Option<f64>),
            ("p99", orange, |r: &Row| r.p99),
            ("p50", BLUE, |r: &Row| r.p50),
        ] {
            c.draw_series(LineSeries::new(
                rows.iter().filter_map(|r| f(r).map(|v| (r.t, v))),
                color.stroke_width(2),
            ))
            .map_err(|e| plot(&e))?
            .label(name)
            .legend(legend(color));
        }
        c.configure_series_labels()
            .position(SeriesLabelPosition::UpperLeft)
            .label_font(font(16))
            .background_style(WHITE.mix(0.85))
            .border_style(BLACK)
            .draw()
            .map_err(|e| plot(&e))?;

        // Operations per second (over 10 s windows), done and failed.
        let window = |i: usize, f: &dyn Fn(&Row) -> u64| {
            let from = i.saturating_sub(9);
            rows[from..=i].iter().map(f).sum::<u64>() as f64 / (i - from + 1) as f64
        };
        type Pick = fn(&Row) -> u64;
        let series: Vec<(&str, RGBColor, Pick)> = vec![
            ("dumps and slow reads", BLUE, |r| {
                r.done[Shared::index(Kind::Dump)] + r.done[Shared::index(Kind::SlowRead)]
            }),
            ("lookups", green, |r| r.done[Shared::index(Kind::Lookup)]),
            (
                "connections (churn, handshakes, bad certificates)",
                orange,
                |r| {
                    r.done[Shared::index(Kind::Churn)]
                        + r.done[Shared::index(Kind::Handshake)]
                        + r.done[Shared::index(Kind::BadCert)]
                },
            ),
            ("policy reloads x10", MAGENTA, |r| {
                r.done[Shared::index(Kind::Reload)] * 10
            }),
            ("failed, all kinds", RED, |r| r.failed.iter().sum()),
        ];
        let top = (0..rows.len())
            .flat_map(|i| series.iter().map(move |(_, _, f)| (i, f)))
            .map(|(i, f)| window(i, f))
            .fold(1.0f64, f64::max)
            * 1.3;
        let mut c = ChartBuilder::on(&panels[3])
            .margin(12)
            .caption(
                "operations per second (10 s averages); GetMap probes not included",
                font(22),
            )
            .x_label_area_size(45)
            .y_label_area_size(70)
            .build_cartesian_2d(0f64..t_max, 0f64..top)
            .map_err(|e| plot(&e))?;
        c.configure_mesh()
            .x_desc("seconds since the start")
            .label_style(font(16))
            .draw()
            .map_err(|e| plot(&e))?;
        for (name, color, f) in &series {
            c.draw_series(LineSeries::new(
                (0..rows.len()).map(|i| (rows[i].t, window(i, f))),
                color.stroke_width(2),
            ))
            .map_err(|e| plot(&e))?
            .label(*name)
            .legend(legend(*color));
        }
        c.configure_series_labels()
            .position(SeriesLabelPosition::UpperLeft)
            .label_font(font(16))
            .background_style(WHITE.mix(0.85))
            .border_style(BLACK)
            .draw()
            .map_err(|e| plot(&e))?;
        root.present().map_err(|e| plot(&e))?;
    }
    let file = std::io::BufWriter::new(std::fs::File::create(path)?);
    let mut encoder = png::Encoder::new(file, W, H);
    encoder.set_color(png::ColorType::Rgb);
    encoder.set_depth(png::BitDepth::Eight);
    encoder.set_compression(png::Compression::High);
    let mut writer = encoder.write_header()?;
    writer.write_image_data(&buf)?;
    writer.finish()?;
    Ok(())
}

/// The default output directory: `soak` in the target directory this
/// binary was built in (TARGET/release/deps/soak-HASH).
fn default_out() -> PathBuf {
    std::env::current_exe()
        .ok()
        .and_then(|exe| exe.ancestors().nth(3).map(|t| t.join("soak")))
        .unwrap_or_else(|| PathBuf::from("soak"))
}

fn mib(kib: u64) -> String {
    format!("{:.1} MiB", kib as f64 / 1024.0)
}

fn main() {
    let args = Args::parse();
    let out = args.out.clone().unwrap_or_else(default_out);
    // The font first: a chart that cannot be drawn should not cost a run.
    let font = std::fs::read(&args.font).unwrap_or_else(|e| {
        panic!(
            "the chart's font {}: {e} (install fonts-dejavu-core, or name a .ttf file with --font)",
            args.font.display()
        )
    });
    if plotters::style::register_font(
        "sans-serif",
        plotters::style::FontStyle::Normal,
        Box::leak(font.into_boxed_slice()),
    )
    .is_err()
    {
        panic!("{} is not a TrueType font", args.font.display());
    }
    std::fs::create_dir_all(&out)
        .unwrap_or_else(|e| panic!("cannot create {}: {e}", out.display()));

    // The maps.
    let setup = Instant::now();
    let fs = BpfFs::new();
    let state = tempfile::tempdir().unwrap();
    let big = create_map(MapType::HASH, 8, 8, 1 << 20);
    for from in (0..BIG_ENTRIES).step_by(50_000) {
        let to = (from + 50_000).min(BIG_ENTRIES);
        let keys: Vec<u8> = (from..to).flat_map(|i| i.to_le_bytes()).collect();
        let values: Vec<u8> = (from..to).flat_map(|i| (i * 3).to_le_bytes()).collect();
        update_batch(&big, &keys, &values);
    }
    fs.pin(&big, BIG);
    let _small: Vec<_> = SMALL
        .iter()
        .map(|(path, n)| u64_hash(&fs, path, *n, n.next_power_of_two()).0)
        .collect();
    let array = create_map(MapType::ARRAY, 4, 8, ARRAY_ENTRIES);
    let keys: Vec<u8> = (0..ARRAY_ENTRIES).flat_map(|i| i.to_le_bytes()).collect();
    let values: Vec<u8> = (0..ARRAY_ENTRIES)
        .flat_map(|i| (u64::from(i) * 7).to_le_bytes())
        .collect();
    update_batch(&array, &keys, &values);
    fs.pin(&array, ARRAY);

    // Certificates: one identity per part of the mix, and bad ones.
    let (pki, other) = (Pki::new(), Pki::new());
    let mut pems = BTreeMap::new();
    for (stem, id) in [
        ("reader", READER),
        ("slow", SLOW),
        ("prober", PROBER),
        ("churn", CHURN),
        ("guest", GUEST),
    ] {
        pki.client(stem, Name::Spiffe(id), Validity::Now);
        pems.insert(stem, Pem::of(&pki, stem, &pki));
    }
    pki.client("expired", Name::Spiffe(CHURN), Validity::Expired);
    let expired = Pem::of(&pki, "expired", &pki);
    other.client("stranger", Name::Spiffe(READER), Validity::Now);
    let stranger = Pem::of(&other, "stranger", &pki);
    let tls = |stem: &str| pems[stem].client_tls();

    // The daemon.
    let metrics = free_addr("127.0.0.1");
    let files = pki.server_files();
    let extra = format!(
        "metrics_listen = \"{metrics}\"\nwatch_files = \"2s\"\n\
         [tls]\ncert = \"{}\"\nkey = \"{}\"\nclient_ca = \"{}\"\n\n{}",
        files.cert.display(),
        files.key.display(),
        files.client_ca.display(),
        rules(0)
    );
    let mut daemon = DaemonProcess::start(
        bpfmap_tests::daemon_bin!(),
        fs.path(),
        state.path(),
        free_addr("127.0.0.1"),
        &extra,
    );
    let (addr, pid) = (daemon.addr, daemon.pid());
    let config = daemon.config_path().to_owned();
    let text = std::fs::read_to_string(&config).unwrap();
    let base = text[..text.find("# policy generation").unwrap()].to_owned();
    let cpus = std::thread::available_parallelism().map_or(0, |n| n.get());
    println!(
        "soak: {:?} of mixed work on bpfmapd (pid {pid}, {addr}, mutual TLS), {cpus} CPUs shared with the client tasks; maps ready in {:.1} s; output in {}",
        args.duration,
        setup.elapsed().as_secs_f64(),
        out.display()
    );

    let runtime = tokio::runtime::Runtime::new().unwrap();
    let shared = Arc::new(Shared::default());
    let all_latencies = Arc::new(Mutex::new(Vec::new()));
    let mut rows: Vec<Row> = Vec::new();
    let mut died = None;
    let mut final_metrics = None;
    let run_started = Instant::now();
    runtime.block_on(async {
        let mut tasks = Vec::new();
        let s = &shared;
        tasks.push(tokio::spawn(prober(
            s.clone(),
            addr,
            tls("prober"),
            all_latencies.clone(),
        )));
        tasks.push(tokio::spawn(dumps(s.clone(), addr, tls("reader"), true)));
        tasks.push(tokio::spawn(dumps(s.clone(), addr, tls("reader"), false)));
        tasks.push(tokio::spawn(lookups(s.clone(), addr, tls("reader"))));
        for (i, ms) in [100u64, 250, 500].into_iter().enumerate() {
            tasks.push(tokio::spawn(slow_reader(
                s.clone(),
                addr,
                pems["slow"].clone(),
                Duration::from_millis(ms),
                0x5eed + i as u64,
            )));
        }
        tasks.push(tokio::spawn(churn(s.clone(), addr, tls("churn"))));
        tasks.push(tokio::spawn(handshakes(
            s.clone(),
            addr,
            pems["churn"].clone(),
            stranger.clone(),
            expired.clone(),
        )));
        tasks.push(tokio::spawn(reloads(
            s.clone(),
            addr,
            metrics,
            pid,
            config.clone(),
            base.clone(),
            tls("guest"),
        )));

        let mut tick = tokio::time::interval(Duration::from_secs(1));
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
        let mut last_done = [0u64; KINDS.len()];
        let mut last_failed = [0u64; KINDS.len()];
        let (mut last_cpu, mut last_host, mut last_t) = (cpu_ticks(pid), host_ticks(), 0.0);
        loop {
            tick.tick().await;
            let t = run_started.elapsed().as_secs_f64();
            if let Some((status, _)) = daemon.wait_exit(Duration::ZERO) {
                died = Some(format!("the daemon exited ({status}) after {t:.0} s"));
                break;
            }
            let (rss_kib, hwm_kib) = daemon.rss_kib();
            let (fds, threads) = fds_and_threads(pid).unwrap_or((0, 0));
            let (cpu, host) = (cpu_ticks(pid), host_ticks());
            // Clock ticks are 1/100 s (USER_HZ).
            let daemon_cpu = if t > last_t {
                (cpu - last_cpu) as f64 / (t - last_t)
            } else {
                0.0
            };
            let host_busy = if host.1 > last_host.1 {
                (host.0 - last_host.0) as f64 * 100.0 / (host.1 - last_host.1) as f64
            } else {
                0.0
            };
            (last_cpu, last_host, last_t) = (cpu, host, t);
            let m = scrape(metrics).await.ok();
            let gauge = |name: &str| m.as_ref().and_then(|m| m.get(name).copied());
            let mut lat = std::mem::take(&mut *shared.latencies.lock().unwrap());
            lat.sort_by(f64::total_cmp);
            let mut row = Row {
                t,
                rss_kib,
                hwm_kib,
                fds,
                threads,
                daemon_cpu,
                host_busy,
                load1: load1(),
                connections: gauge("bpfmapd_connections_open"),
                dump_slots: gauge("bpfmapd_dump_slots_in_use"),
                getmap_calls: lat.len(),
                p50: quantile(&lat, 0.50),
                p99: quantile(&lat, 0.99),
                max: lat.last().copied(),
                ..Row::default()
            };
            for i in 0..KINDS.len() {
                let (d, f) = (
                    shared.done[i].load(Ordering::Relaxed),
                    shared.failed[i].load(Ordering::Relaxed),
                );
                row.done[i] = d - last_done[i];
                row.failed[i] = f - last_failed[i];
                (last_done[i], last_failed[i]) = (d, f);
            }
            rows.push(row);
            if run_started.elapsed() >= args.duration {
                break;
            }
        }
        shared.stop.store(true, Ordering::Relaxed);
        for task in tasks {
            let abort = task.abort_handle();
            match tokio::time::timeout(Duration::from_secs(30), task).await {
                Ok(Ok(())) => {}
                Ok(Err(e)) if e.is_panic() => {
                    *shared
                        .errors
                        .lock()
                        .unwrap()
                        .entry(format!("a task panicked: {e}"))
                        .or_default() += 1;
                }
                Ok(Err(_)) => {}
                Err(_) => {
                    abort.abort();
                    eprintln!("a task did not stop within 30 s");
                }
            }
        }
        if died.is_none() {
            if let Some((status, _)) = daemon.wait_exit(Duration::ZERO) {
                died = Some(format!("the daemon exited ({status}) at the end"));
            } else {
                final_metrics = scrape(metrics).await.ok();
            }
        }
    });

    let csv = out.join("soak.csv");
    let png = out.join("soak.png");
    write_csv(&rows, &csv).unwrap_or_else(|e| panic!("{}: {e:#}", csv.display()));
    let title = format!(
        "bpfmapd soak: {:.0} s of dumps, lookups, slow readers, connection churn, TLS handshakes and policy reloads ({cpus} CPUs, shared)",
        rows.last().map_or(0.0, |r| r.t)
    );
    write_chart(&rows, &png, &title).unwrap_or_else(|e| panic!("{}: {e:#}", png.display()));

    // The summary.
    let first = rows.first().cloned().unwrap_or_default();
    let last = rows.last().cloned().unwrap_or_default();
    let max = |f: fn(&Row) -> u64| rows.iter().map(f).max().unwrap_or(0);
    println!("\nsoak summary: {:.0} s, {} samples", last.t, rows.len());
    println!(
        "  RSS: start {}, end {}, max {} (VmHWM {})",
        mib(first.rss_kib),
        mib(last.rss_kib),
        mib(max(|r| r.rss_kib)),
        mib(last.hwm_kib)
    );
    println!(
        "  open descriptors: start {}, end {}, max {}",
        first.fds,
        last.fds,
        max(|r| r.fds)
    );
    println!(
        "  threads: start {}, end {}, max {}",
        first.threads,
        last.threads,
        max(|r| r.threads)
    );
    let conns: Vec<f64> = rows.iter().filter_map(|r| r.connections).collect();
    println!(
        "  connections open (metrics): start {}, end {}, max {}",
        conns.first().copied().unwrap_or(0.0),
        conns.last().copied().unwrap_or(0.0),
        conns.iter().copied().fold(0.0, f64::max)
    );
    // Growth: the second quarter against the last (the first quarter is
    // warm-up: allocator arenas, thread pools, TLS sessions).
    if rows.len() >= 8 {
        let q = rows.len() / 4;
        let median_of = |rs: &[Row], f: fn(&Row) -> u64| {
            let mut v: Vec<u64> = rs.iter().map(f).collect();
            v.sort_unstable();
            v[v.len() / 2]
        };
        let (a, b) = (&rows[q..2 * q], &rows[3 * q..]);
        println!(
            "  medians, second quarter -> last quarter: RSS {} -> {}, descriptors {} -> {}, threads {} -> {}",
            mib(median_of(a, |r| r.rss_kib)),
            mib(median_of(b, |r| r.rss_kib)),
            median_of(a, |r| r.fds),
            median_of(b, |r| r.fds),
            median_of(a, |r| r.threads),
            median_of(b, |r| r.threads),
        );
    }
    let mut all = std::mem::take(&mut *all_latencies.lock().unwrap());
    all.sort_by(f64::total_cmp);
    let ms = |v: Option<f64>| v.map_or("-".to_owned(), |v| format!("{v:.2} ms"));
    println!(
        "  GetMap latency over {} calls: p50 {}, p90 {}, p99 {}, p99.9 {}, max {}",
        all.len(),
        ms(quantile(&all, 0.5)),
        ms(quantile(&all, 0.9)),
        ms(quantile(&all, 0.99)),
        ms(quantile(&all, 0.999)),
        ms(all.last().copied())
    );
    let mut server = server_getmap_ms(&daemon.log());
    server.sort_by(f64::total_cmp);
    println!(
        "  the same calls as the daemon timed them (audit log, {} calls): p50 {}, p99 {}, p99.9 {}, max {}",
        server.len(),
        ms(quantile(&server, 0.5)),
        ms(quantile(&server, 0.99)),
        ms(quantile(&server, 0.999)),
        ms(server.last().copied())
    );
    let mean = |f: fn(&Row) -> f64| rows.iter().map(f).sum::<f64>() / rows.len().max(1) as f64;
    let peak = |f: fn(&Row) -> f64| rows.iter().map(f).fold(0.0, f64::max);
    println!(
        "  daemon CPU: mean {:.0} %, max {:.0} % of one CPU; the machine: mean {:.0} % busy, load average (1 min) mean {:.1}, max {:.1}",
        mean(|r| r.daemon_cpu),
        peak(|r| r.daemon_cpu),
        mean(|r| r.host_busy),
        mean(|r| r.load1),
        peak(|r| r.load1)
    );
    let worst = rows
        .iter()
        .filter_map(|r| r.max.map(|m| (m, r.t)))
        .max_by(|a, b| a.0.total_cmp(&b.0));
    if let Some((m, t)) = worst {
        println!("  slowest GetMap: {m:.1} ms, in second {t:.0}");
    }
    let p99s: Vec<f64> = rows.iter().filter_map(|r| r.p99).collect();
    let over = |limit: f64| p99s.iter().filter(|p| **p > limit).count();
    println!(
        "  seconds whose p99 exceeded 5 / 20 / 100 ms: {} / {} / {} of {}",
        over(5.0),
        over(20.0),
        over(100.0),
        p99s.len()
    );
    println!(
        "  operations ({} entries received by dumps and slow readers):",
        shared.entries.load(Ordering::Relaxed)
    );
    for (i, k) in KINDS.iter().enumerate() {
        println!(
            "    {:<10} {:>8} done {:>6} failed   {}",
            k.name(),
            shared.done[i].load(Ordering::Relaxed),
            shared.failed[i].load(Ordering::Relaxed),
            k.what()
        );
    }
    let errors = shared.errors.lock().unwrap();
    if !errors.is_empty() {
        println!("  failures, by message:");
        for (msg, n) in errors.iter() {
            println!("    {n:>6}x {msg}");
        }
    }
    if let Some(m) = &final_metrics {
        let get = |k: &str| m.get(k).copied().unwrap_or(0.0);
        println!(
            "  daemon metrics: reloads ok {} failed {}; TLS handshake failures: {}; policy denials {}; stalled clients {}; dump slots refused {}",
            get("bpfmapd_reloads_total{result=\"ok\"}"),
            get("bpfmapd_reloads_total{result=\"failed\"}"),
            m.iter()
                .filter_map(|(k, v)| {
                    let reason =
                        k.strip_prefix("bpfmapd_tls_handshake_failures_total{reason=\"")?;
                    Some(format!("{} {v}", reason.trim_end_matches("\"}")))
                })
                .collect::<Vec<_>>()
                .join(", "),
            m.iter()
                .filter(|(k, _)| k.starts_with("bpfmapd_policy_denials_total"))
                .map(|(_, v)| v)
                .sum::<f64>(),
            get("bpfmapd_stalled_clients_total"),
            get("bpfmapd_dump_slots_refused_total"),
        );
    }
    println!("  wrote {} and {}", csv.display(), png.display());
    if let Some(why) = died {
        eprintln!("FAILED: {why}");
        let log = daemon.log();
        // Its last words, without the audit lines of the calls.
        let words: Vec<&String> = log
            .iter()
            .filter(|l| !l.contains("\"bpfmapd::audit\""))
            .collect();
        for line in words.iter().rev().take(20).rev() {
            eprintln!("  {line}");
        }
        std::process::exit(1);
    }
}
