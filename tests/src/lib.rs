//! Test support: private bpffs mounts, real kernel maps, an in-process
//! daemon. Everything here needs root and a kernel with BPF; when either is
//! missing the test fails with a message saying so, never passes silently.
#![deny(unsafe_code)]

use std::{
    collections::BTreeMap,
    path::{Path, PathBuf},
};

use bpfmap_client::{Client, ClientTls, ConnectOptions, DumpOptions, Entry, MapName, Value};
use bpfmap_kernel::{self as kernel, CreateMap};
use bpfmapd::{Config, Running};
use futures::TryStreamExt as _;
use tempfile::TempDir;

pub use bpfmap_kernel::{MapType, OwnedMap};

pub mod conns;
pub mod dns;
pub mod fleet;
pub mod fuzz;
pub mod h2;
pub mod local_fleet;
pub mod metrics;
pub mod netns;
pub mod networking;
pub mod pki;
pub mod process;
pub mod programs;
mod rng;
mod tools;

pub use rng::Rng;
pub use tools::{
    Example, ctl, grpcurl, json_lines, json_of, json_stream, map_ref, proto_of, readme_examples,
    shape,
};

/// A private bpffs mounted on a temporary directory; unmounted on drop.
#[derive(Debug)]
pub struct BpfFs {
    dir: TempDir,
}

impl BpfFs {
    pub fn new() -> Self {
        let dir = tempfile::Builder::new()
            .prefix("bpfmapd-test-")
            .tempdir()
            .expect("cannot create a temporary directory");
        if let Err(e) = kernel::mount_bpffs(dir.path()) {
            panic!(
                "these tests need root and BPF: cannot mount a private bpffs on {} ({e}); run them as root on a kernel with CONFIG_BPF_SYSCALL",
                dir.path().display()
            );
        }
        Self { dir }
    }

    pub fn path(&self) -> &Path {
        self.dir.path()
    }

    /// Pins `map` at `rel` (creating parent directories).
    pub fn pin(&self, map: &OwnedMap, rel: &str) -> PathBuf {
        let path = self.path().join(rel);
        if let Some(parent) = path.parent() {
            std::fs::create_dir_all(parent).expect("mkdir in bpffs");
        }
        map.pin(&path)
            .unwrap_or_else(|e| panic!("cannot pin {}: {e}", path.display()));
        path
    }
}

impl Default for BpfFs {
    fn default() -> Self {
        Self::new()
    }
}

impl Drop for BpfFs {
    fn drop(&mut self) {
        let _ = kernel::umount(self.dir.path());
    }
}

/// Creates a map (panics with the errno when the kernel refuses).
pub fn create_map(map_type: MapType, key_size: u32, value_size: u32, max_entries: u32) -> OwnedMap {
    create_map_with(&CreateMap {
        map_type: map_type.0,
        key_size,
        value_size,
        max_entries,
        name: "test",
        ..Default::default()
    })
}

/// Creates a map with every parameter given.
pub fn create_map_with(params: &CreateMap<'_>) -> OwnedMap {
    OwnedMap::create(params).unwrap_or_else(|e| {
        panic!(
            "cannot create a {} map ({e}); these tests need root and BPF",
            MapType(params.map_type)
        )
    })
}

/// Inserts or replaces one element.
pub fn update(map: &OwnedMap, key: &[u8], value: &[u8]) {
    map.update(key, value)
        .unwrap_or_else(|e| panic!("update: {e}"));
}

/// Deletes one key.
pub fn delete(map: &OwnedMap, key: &[u8]) {
    map.delete(key).unwrap_or_else(|e| panic!("delete: {e}"));
}

/// Fills a map with packed entries in one batch.
pub fn update_batch(map: &OwnedMap, keys: &[u8], values: &[u8]) {
    map.update_batch(keys, values)
        .unwrap_or_else(|e| panic!("update_batch: {e}"));
}

/// A hash map of `n` entries, key i (u64 LE) -> value i*3 (u64 LE), pinned.
pub fn u64_hash(fs: &BpfFs, rel: &str, n: u32, max_entries: u32) -> (OwnedMap, Entries) {
    u64_hash_of(fs, rel, 0..u64::from(n), |k| k * 3, max_entries)
}

/// A hash map of `keys` (u64 LE), each -> `value(key)` (u64 LE), pinned.
pub fn u64_hash_of(
    fs: &BpfFs,
    rel: &str,
    keys: impl IntoIterator<Item = u64>,
    value: impl Fn(u64) -> u64,
    max_entries: u32,
) -> (OwnedMap, Entries) {
    let fd = create_map(MapType::HASH, 8, 8, max_entries);
    let (mut packed_keys, mut values, mut expected) = (Vec::new(), Vec::new(), Entries::new());
    for k in keys {
        let v = value(k).to_le_bytes();
        packed_keys.extend_from_slice(&k.to_le_bytes());
        values.extend_from_slice(&v);
        expected.insert(k.to_le_bytes().to_vec(), Value::Single(v.to_vec()));
    }
    for (k, v) in packed_keys
        .chunks(8 * 50_000)
        .zip(values.chunks(8 * 50_000))
    {
        update_batch(&fd, k, v);
    }
    fs.pin(&fd, rel);
    (fd, expected)
}

/// The median of `samples` (the upper one of an even count), for the
/// benchmarks.
pub fn median<T: PartialOrd + Copy>(mut samples: Vec<T>) -> T {
    samples.sort_by(|a, b| a.partial_cmp(b).expect("comparable"));
    samples[samples.len() / 2]
}

/// Entries keyed by key bytes.
pub type Entries = BTreeMap<Vec<u8>, Value>;

/// Collects entries, failing on a key delivered twice.
pub fn collect_unique(entries: impl IntoIterator<Item = Entry>) -> Entries {
    let mut out = Entries::new();
    for e in entries {
        if let Some(old) = out.insert(e.key.clone(), e.value) {
            panic!("key {:02x?} delivered twice (first value {old:?})", e.key);
        }
    }
    out
}

/// Compiles `tests/bpf/FILE` (e.g. "typed.bpf.c") with clang into `dir`,
/// as libbpf programs are built (`-g`: the compiler emits BTF), and returns
/// the object. `$CLANG` names the compiler (default `clang`).
pub fn compile_bpf_object(file: &str, dir: &Path) -> Vec<u8> {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("bpf").join(file);
    let obj = dir.join(file).with_extension("o");
    let clang = std::env::var("CLANG").unwrap_or_else(|_| "clang".into());
    let multiarch = format!("/usr/include/{}-linux-gnu", std::env::consts::ARCH);
    let out = std::process::Command::new(&clang)
        .args(["-g", "-O2", "-target", "bpf", "-I", &multiarch, "-c"])
        .arg(&src)
        .arg("-o")
        .arg(&obj)
        .output()
        .unwrap_or_else(|e| {
            panic!(
                "cannot run {clang} ({e}): this test compiles a BPF object; install clang and libbpf-dev (`apt-get install clang libbpf-dev`; .ci/run does)"
            )
        });
    assert!(
        out.status.success(),
        "clang failed on {} (is libbpf-dev installed, for bpf/bpf_helpers.h?):\n{}",
        src.display(),
        String::from_utf8_lossy(&out.stderr)
    );
    std::fs::read(&obj).unwrap_or_else(|e| panic!("cannot read {}: {e}", obj.display()))
}

/// A daemon serving `roots` on 127.0.0.1 (a free port).
#[derive(Debug)]
pub struct Daemon {
    pub running: Running,
    pub config: Config,
}

impl Daemon {
    /// The test configuration: a free loopback port, one root.
    pub fn config(root: &Path, state_dir: &Path) -> Config {
        Config {
            listen: "127.0.0.1:0".parse().unwrap(),
            roots: vec![root.to_owned()],
            state_dir: state_dir.to_owned(),
            mount_bpffs: false,
            ..Config::default()
        }
    }

    pub async fn start(root: &Path, state_dir: &Path) -> Self {
        Self::start_with(Self::config(root, state_dir)).await
    }

    pub async fn start_with(config: Config) -> Self {
        let running = bpfmapd::start(&config).await.expect("daemon starts");
        Self { running, config }
    }

    pub fn addr(&self) -> String {
        format!("http://{}", self.running.local_addr())
    }

    pub async fn client(&self) -> Client {
        self.client_with(ConnectOptions::default()).await
    }

    /// A client connected with `options` (plaintext).
    pub async fn client_with(&self, options: ConnectOptions) -> Client {
        Client::connect(&self.addr(), options)
            .await
            .expect("client connects")
    }

    /// The TLS address ("https://127.0.0.1:PORT").
    pub fn tls_addr(&self) -> String {
        format!("https://127.0.0.1:{}", self.running.local_addr().port())
    }

    /// A mutual-TLS client.
    pub async fn tls_client(&self, tls: &ClientTls) -> Result<Client, bpfmap_client::Error> {
        let options = ConnectOptions::default().with_tls(tls.clone());
        Client::connect(&self.tls_addr(), options).await
    }

    pub async fn stop(self) {
        self.running.stop().await.expect("clean shutdown");
    }
}

/// A daemon serving a private bpffs (with its own state directory), and a
/// client connected to it.
pub async fn setup() -> (BpfFs, TempDir, Daemon, Client) {
    let fs = BpfFs::new();
    let state = tempfile::tempdir().unwrap();
    let daemon = Daemon::start(fs.path(), state.path()).await;
    let client = daemon.client().await;
    (fs, state, daemon, client)
}

/// A channel whose connection comes from `source` (a loopback address such
/// as "127.0.0.5"), so that the daemon sees another peer.
pub async fn channel_from(addr: &str, source: &str) -> tonic::transport::Channel {
    tonic::transport::Endpoint::from_shared(addr.to_owned())
        .expect("a valid address")
        .local_address(Some(source.parse().expect("an IP address")))
        .connect()
        .await
        .unwrap_or_else(|e| panic!("cannot connect to {addr} from {source}: {e}"))
}

/// The raw gRPC stub of `MapService`.
pub type Grpc = bpfmap_proto::v1::map_service_client::MapServiceClient<tonic::transport::Channel>;

/// A raw gRPC stub connected to `addr` (a plaintext daemon on loopback), for
/// the requests and statuses themselves; it decodes messages of up to
/// 64 MiB.
pub async fn grpc(addr: &str) -> Grpc {
    Grpc::new(channel_from(addr, "127.0.0.1").await).max_decoding_message_size(64 << 20)
}

/// A client whose connection comes from `source`, with the retry policy
/// of `options`.
pub async fn client_from(addr: &str, source: &str, options: ConnectOptions) -> Client {
    Client::from_channel(channel_from(addr, source).await, options)
}

/// Sends `body` as the request of a server-streaming call to `path` and
/// returns the messages as they come, undecoded: what a call costs the
/// daemon and the transport, without the client's decoding.
pub async fn raw_stream(
    addr: &str,
    path: &str,
    body: Vec<u8>,
) -> Result<tonic::Streaming<Vec<u8>>, tonic::Status> {
    let channel = tonic::transport::Endpoint::from_shared(addr.to_owned())
        .expect("a valid address")
        .connect()
        .await
        .expect("connects");
    let mut grpc = tonic::client::Grpc::new(channel).max_decoding_message_size(64 << 20);
    grpc.ready().await.expect("ready");
    let path = http::uri::PathAndQuery::try_from(path).expect("a valid path");
    grpc.server_streaming(tonic::Request::new(body), path, RawCodec)
        .await
        .map(tonic::Response::into_inner)
}

/// Sends `body` as the request message of a unary call to `path` (e.g.
/// "/bpfmap.v1.MapService/GetMap"), bytes as they are: for requests no
/// well-behaved client would send.
pub async fn raw_call(addr: &str, path: &str, body: Vec<u8>) -> Result<Vec<u8>, tonic::Status> {
    let channel = tonic::transport::Endpoint::from_shared(addr.to_owned())
        .expect("a valid address")
        .connect()
        .await
        .expect("connects");
    let mut grpc = tonic::client::Grpc::new(channel);
    grpc.ready().await.expect("ready");
    let path = http::uri::PathAndQuery::try_from(path).expect("a valid path");
    grpc.unary(tonic::Request::new(body), path, RawCodec)
        .await
        .map(tonic::Response::into_inner)
}

/// A codec that sends and receives message bytes as they are.
#[derive(Debug, Clone, Copy, Default)]
pub struct RawCodec;

impl tonic::codec::Codec for RawCodec {
    type Encode = Vec<u8>;
    type Decode = Vec<u8>;
    type Encoder = RawCodec;
    type Decoder = RawCodec;

    fn encoder(&mut self) -> RawCodec {
        RawCodec
    }

    fn decoder(&mut self) -> RawCodec {
        RawCodec
    }
}

impl tonic::codec::Encoder for RawCodec {
    type Item = Vec<u8>;
    type Error = tonic::Status;

    fn encode(
        &mut self,
        item: Vec<u8>,
        dst: &mut tonic::codec::EncodeBuf<'_>,
    ) -> Result<(), tonic::Status> {
        use bytes::BufMut as _;
        dst.put_slice(&item);
        Ok(())
    }
}

impl tonic::codec::Decoder for RawCodec {
    type Item = Vec<u8>;
    type Error = tonic::Status;

    fn decode(
        &mut self,
        src: &mut tonic::codec::DecodeBuf<'_>,
    ) -> Result<Option<Vec<u8>>, tonic::Status> {
        use bytes::Buf as _;
        let mut out = vec![0; src.remaining()];
        src.copy_to_slice(&mut out);
        Ok(Some(out))
    }
}

/// Dumps a whole map through the client library: every entry, each key
/// once (a key delivered twice fails).
pub async fn dump_all(client: &Client, map: &str, options: DumpOptions) -> Entries {
    collect_unique(dump_entries(client, map, options).await)
}

/// Dumps a map through the client library: the entries as they came.
pub async fn dump_entries(client: &Client, map: &str, options: DumpOptions) -> Vec<Entry> {
    let map: MapName = map.parse().unwrap();
    client
        .dump(&map, options)
        .into_entries()
        .try_collect()
        .await
        .unwrap_or_else(|e| panic!("dump of {map}: {e}"))
}

/// The gRPC status code of a client error.
pub fn code_of(e: &bpfmap_client::Error) -> tonic::Code {
    e.status()
        .unwrap_or_else(|| panic!("expected a gRPC status, got {e}"))
        .code()
}

/// The google.rpc.ErrorInfo reason of a status, if any.
pub fn reason_of(e: &bpfmap_client::Error) -> String {
    use tonic_types::StatusExt as _;
    e.status()
        .and_then(|s| s.get_details_error_info())
        .map(|i| i.reason)
        .unwrap_or_default()
}

/// A TCP proxy that counts the bytes the server sends (as they pass, so
/// that a connection kept open is counted too), and, with
/// [`allowing`](Self::allowing), closes every connection after the first
/// `allow` at once (a host that goes down).
#[derive(Debug)]
pub struct CountingProxy {
    /// Where it listens.
    pub addr: std::net::SocketAddr,
    /// Bytes the server sent through it so far.
    pub from_server: std::sync::Arc<std::sync::atomic::AtomicU64>,
    task: tokio::task::JoinHandle<()>,
}

impl CountingProxy {
    /// Listens on `listen` ("127.0.0.1:0") in front of `target`.
    pub async fn start(listen: &str, target: std::net::SocketAddr) -> Self {
        Self::allowing(listen, target, usize::MAX).await
    }

    /// The same, closing every connection after the first `allow`.
    pub async fn allowing(listen: &str, target: std::net::SocketAddr, allow: usize) -> Self {
        use std::sync::atomic::Ordering;
        use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
        let listener = tokio::net::TcpListener::bind(listen)
            .await
            .unwrap_or_else(|e| panic!("cannot listen on {listen}: {e}"));
        let addr = listener.local_addr().unwrap();
        let from_server = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0));
        let count = from_server.clone();
        let task = tokio::spawn(async move {
            let mut accepted = 0;
            while let Ok((client, _)) = listener.accept().await {
                accepted += 1;
                if accepted > allow {
                    continue;
                }
                let Ok(server) = tokio::net::TcpStream::connect(target).await else {
                    continue;
                };
                let count = count.clone();
                tokio::spawn(async move {
                    let (mut cr, mut cw) = client.into_split();
                    let (mut sr, mut sw) = server.into_split();
                    let up = tokio::spawn(async move {
                        let _ = tokio::io::copy(&mut cr, &mut sw).await;
                    });
                    let mut buf = vec![0u8; 64 << 10];
                    loop {
                        let n = match sr.read(&mut buf).await {
                            Ok(0) | Err(_) => break,
                            Ok(n) => n,
                        };
                        count.fetch_add(n as u64, Ordering::Relaxed);
                        if cw.write_all(&buf[..n]).await.is_err() {
                            break;
                        }
                    }
                    up.abort();
                });
            }
        });
        Self {
            addr,
            from_server,
            task,
        }
    }

    /// Bytes the server sent through it so far.
    pub fn bytes(&self) -> u64 {
        self.from_server.load(std::sync::atomic::Ordering::Relaxed)
    }
}

impl Drop for CountingProxy {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// A TCP proxy that forwards to `target`, cutting connections after
/// `cut_after` bytes from the server: a network failure in the middle of a
/// stream, once or again and again.
#[derive(Debug)]
pub struct CutProxy {
    /// Where it listens.
    pub addr: std::net::SocketAddr,
    accepted: std::sync::Arc<std::sync::atomic::AtomicUsize>,
    task: tokio::task::JoinHandle<()>,
}

impl CutProxy {
    /// Cuts only the first connection.
    pub async fn start(target: std::net::SocketAddr, cut_after: usize) -> Self {
        Self::start_on("127.0.0.1:0".parse().unwrap(), target, cut_after, false).await
    }

    /// Listens on `listen`, cutting the first connection (`every`: every
    /// connection) after `cut_after` bytes from the server.
    pub async fn start_on(
        listen: std::net::SocketAddr,
        target: std::net::SocketAddr,
        cut_after: usize,
        every: bool,
    ) -> Self {
        use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
        let listener = tokio::net::TcpListener::bind(listen)
            .await
            .unwrap_or_else(|e| panic!("cannot listen on {listen}: {e}"));
        let addr = listener.local_addr().unwrap();
        let accepted = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let counter = accepted.clone();
        let task = tokio::spawn(async move {
            let mut first = true;
            while let Ok((client, _)) = listener.accept().await {
                counter.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                let Ok(server) = tokio::net::TcpStream::connect(target).await else {
                    continue;
                };
                let limit = (first || every).then_some(cut_after);
                first = false;
                tokio::spawn(async move {
                    let (mut cr, mut cw) = client.into_split();
                    let (mut sr, mut sw) = server.into_split();
                    let up = tokio::spawn(async move {
                        let _ = tokio::io::copy(&mut cr, &mut sw).await;
                    });
                    let mut sent = 0usize;
                    let mut buf = vec![0u8; 16 * 1024];
                    loop {
                        let n = match sr.read(&mut buf).await {
                            Ok(0) | Err(_) => break,
                            Ok(n) => n,
                        };
                        if cw.write_all(&buf[..n]).await.is_err() {
                            break;
                        }
                        sent += n;
                        if limit.is_some_and(|l| sent >= l) {
                            break; // cut: both directions are dropped
                        }
                    }
                    up.abort();
                });
            }
        });
        Self {
            addr,
            accepted,
            task,
        }
    }

    /// The connections accepted so far.
    pub fn connections(&self) -> usize {
        self.accepted.load(std::sync::atomic::Ordering::SeqCst)
    }
}

impl Drop for CutProxy {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// A writer thread that changes maps while a test reads them: it runs its
/// step over and over until stopped.
#[derive(Debug)]
pub struct Churn {
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    thread: std::thread::JoinHandle<u64>,
}

impl Churn {
    /// Runs `step` until [`stop`](Self::stop) (each step may sleep to pace
    /// itself).
    pub fn start(mut step: impl FnMut() + Send + 'static) -> Self {
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let flag = stop.clone();
        let thread = std::thread::spawn(move || {
            let mut steps = 0u64;
            while !flag.load(std::sync::atomic::Ordering::Relaxed) {
                step();
                steps += 1;
            }
            steps
        });
        Self { stop, thread }
    }

    /// Stops the writer; how many steps it made.
    pub fn stop(self) -> u64 {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
        self.thread.join().expect("the churning writer")
    }
}
