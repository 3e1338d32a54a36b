//! Client library for bpfmapd.
//!
//! ```no_run
//! # async fn demo() -> Result<(), bpfmap_client::Error> {
//! use bpfmap_client::{Client, DumpOptions, MapName};
//! use futures::TryStreamExt as _;
//!
//! let client = Client::connect("http://127.0.0.1:50051").await?;
//! let map: MapName = "demo/flows".parse()?;
//! let mut entries = std::pin::pin!(client.dump(map, DumpOptions::default()).into_entries());
//! while let Some(entry) = entries.try_next().await? {
//!     println!("{:02x?} => {:?}", entry.key, entry.value);
//! }
//! # Ok(()) }
//! ```
//!
//! A dump resumes by itself from the last cursor it received when the stream
//! breaks (UNAVAILABLE, or a transport error such as a reset connection), with
//! exponential backoff; see [`RetryPolicy`] for the decision per status code.
#![forbid(unsafe_code)]
#![warn(missing_docs)]

mod chunk;
#[cfg(feature = "discovery")]
mod discovery;
mod fleet;
mod resume;
pub mod typed;

use std::{fmt, str::FromStr, time::Duration};

pub use bpfmap_proto::v1 as pb;
pub use chunk::{Chunk, EntryRef, Iter, PerCpuIter, PerCpuValues, ValueRef};
#[cfg(feature = "discovery")]
pub use discovery::{DiscoveryError, Resolver, TargetSpec};
pub use fleet::{Fleet, FleetEvent, FleetOptions, FleetRun, Target, TargetReport, TypedChunk};
use pb::map_service_client::MapServiceClient;
pub use resume::{Dump, DumpOptions, Entry, RetryPolicy, Value};
use tonic::transport::{Certificate, Channel, ClientTlsConfig, Endpoint, Identity};
pub use tonic::{Code, Status};
pub use typed::MapTypes;

/// Errors of the client library.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The address is not a valid URI, or the TLS material is unusable.
    #[error("invalid address {addr:?}: {source}")]
    Address {
        /// The address as given.
        addr: String,
        /// Why it cannot be used.
        #[source]
        source: tonic::transport::Error,
    },
    /// The connection (TCP or TLS handshake) failed.
    #[error("cannot connect to {addr}: {source}")]
    Connect {
        /// The address.
        addr: String,
        /// The transport error.
        #[source]
        source: tonic::transport::Error,
    },
    /// The server (or the transport) answered with a gRPC status.
    #[error("{}: {}", code_name(.0.code()), status_text(.0))]
    Status(tonic::Status),
    /// A map name that is neither a path nor `id:N`.
    #[error("invalid map name {0:?}: give a path like \"demo/flows\" or \"id:12\"")]
    MapName(String),
    /// A target that is not `host:port`.
    #[error("invalid target {0:?}: give host:port, [IPv6]:port or a URL like http://host:port")]
    Target(String),
    /// The server sent a chunk that does not add up.
    #[error("server sent a malformed chunk: {0}")]
    Protocol(String),
    /// The server described types that cannot be used.
    #[error("the map's types cannot be used: {0}")]
    Types(#[from] typed::TypeError),
}

impl From<tonic::Status> for Error {
    fn from(s: tonic::Status) -> Self {
        Self::Status(s)
    }
}

/// A status's message followed by the errors that caused it ("tcp connect
/// error: Connection refused (os error 111)").
pub(crate) fn status_text(status: &tonic::Status) -> String {
    let mut message = status.message().to_owned();
    let mut source = std::error::Error::source(status);
    while let Some(e) = source {
        let text = e.to_string();
        if !message.contains(&text) {
            message.push_str(": ");
            message.push_str(&text);
        }
        source = e.source();
    }
    message
}

pub use bpfmap_proto::status::code_name;

impl Error {
    /// The gRPC status, if the error came from the server or the transport.
    pub fn status(&self) -> Option<&tonic::Status> {
        match self {
            Self::Status(s) => Some(s),
            _ => None,
        }
    }
}

/// A map, by pin path (relative to the server's root) or by kernel id.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum MapName {
    /// A path relative to the server's bpffs root ("demo/flows").
    Path(String),
    /// A kernel map id (the server must allow access by id).
    Id(u32),
}

impl FromStr for MapName {
    type Err = Error;

    /// "id:12" names a map by id; anything else is a path.
    fn from_str(s: &str) -> Result<Self, Error> {
        if let Some(id) = s.strip_prefix("id:") {
            return id
                .parse()
                .map(Self::Id)
                .map_err(|_| Error::MapName(s.into()));
        }
        if s.is_empty() {
            return Err(Error::MapName(s.into()));
        }
        Ok(Self::Path(s.into()))
    }
}

impl fmt::Display for MapName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Path(p) => f.write_str(p),
            Self::Id(id) => write!(f, "id:{id}"),
        }
    }
}

impl From<&MapName> for pb::MapRef {
    fn from(m: &MapName) -> Self {
        let r = match m {
            MapName::Path(p) => pb::map_ref::Ref::Path(p.clone()),
            MapName::Id(id) => pb::map_ref::Ref::Id(*id),
        };
        pb::MapRef { r#ref: Some(r) }
    }
}

/// Mutual TLS material, PEM-encoded.
#[derive(Clone, PartialEq, Eq)]
pub struct ClientTls {
    /// CA bundle that the server's certificate must chain to.
    pub ca: Vec<u8>,
    /// This client's certificate chain.
    pub cert: Vec<u8>,
    /// This client's private key.
    pub key: Vec<u8>,
    /// Name to verify the server certificate against (default: the host of
    /// the address).
    pub server_name: Option<String>,
}

impl std::fmt::Debug for ClientTls {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ClientTls")
            .field("server_name", &self.server_name)
            .finish_non_exhaustive()
    }
}

impl ClientTls {
    /// Reads the three PEM files.
    pub fn from_files(
        ca: &std::path::Path,
        cert: &std::path::Path,
        key: &std::path::Path,
    ) -> std::io::Result<Self> {
        let read = |p: &std::path::Path| {
            std::fs::read(p)
                .map_err(|e| std::io::Error::new(e.kind(), format!("{}: {e}", p.display())))
        };
        Ok(Self {
            ca: read(ca)?,
            cert: read(cert)?,
            key: read(key)?,
            server_name: None,
        })
    }
}

/// How a client reaches a daemon.
#[derive(Debug, Clone)]
pub struct ConnectOptions {
    /// Mutual TLS (use "https://" addresses); plaintext when `None`.
    pub tls: Option<ClientTls>,
    /// Time allowed to establish a connection (TCP and TLS). Default 5 s.
    pub connect_timeout: Duration,
}

impl Default for ConnectOptions {
    fn default() -> Self {
        Self {
            tls: None,
            connect_timeout: Duration::from_secs(5),
        }
    }
}

/// A connection to one bpfmapd. Cheap to clone; clones share the connection.
#[derive(Debug, Clone)]
pub struct Client {
    inner: MapServiceClient<Channel>,
    retry: RetryPolicy,
}

/// Largest message the client accepts: the server's default largest
/// message (chunks stay below 3 MiB unless one entry is larger).
const MAX_DECODE: usize = (64 << 20) + (64 << 10);

impl Client {
    /// Connects to `addr` ("http://host:port"), plaintext.
    pub async fn connect(addr: &str) -> Result<Self, Error> {
        Self::connect_with(addr, None).await
    }

    /// Connects to `addr` ("https://host:port" with TLS).
    pub async fn connect_with(addr: &str, tls: Option<&ClientTls>) -> Result<Self, Error> {
        let options = ConnectOptions {
            tls: tls.cloned(),
            ..ConnectOptions::default()
        };
        let channel = Self::endpoint(addr, &options)?
            .connect()
            .await
            .map_err(|source| Error::Connect {
                addr: addr.into(),
                source,
            })?;
        Ok(Self::from_channel(channel))
    }

    /// A client that connects on first use (and reconnects after failures).
    pub fn connect_lazy(addr: &str) -> Result<Self, Error> {
        Self::connect_lazy_with(addr, &ConnectOptions::default())
    }

    /// A client that connects on first use, with TLS and timeouts as given.
    pub fn connect_lazy_with(addr: &str, options: &ConnectOptions) -> Result<Self, Error> {
        Ok(Self::from_channel(
            Self::endpoint(addr, options)?.connect_lazy(),
        ))
    }

    fn endpoint(addr: &str, options: &ConnectOptions) -> Result<Endpoint, Error> {
        let bad = |source| Error::Address {
            addr: addr.into(),
            source,
        };
        let mut endpoint = Endpoint::from_shared(addr.to_owned())
            .map_err(bad)?
            .connect_timeout(options.connect_timeout)
            .tcp_nodelay(true)
            .initial_stream_window_size(2 << 20)
            .initial_connection_window_size(4 << 20)
            // Frames that hold a whole chunk (115 KiB with the daemon's
            // default limits), not 16 KiB pieces of it: a dump of 100K
            // 320-byte entries cost 78-83 ms of CPU (daemon and client
            // together) with 16 KiB frames, 65-66 ms with these. The
            // connection's read buffer grows to one frame.
            .max_frame_size(256 << 10)
            .http2_keep_alive_interval(Duration::from_secs(30))
            .keep_alive_timeout(Duration::from_secs(10));
        if let Some(tls) = &options.tls {
            let mut config = ClientTlsConfig::new()
                .ca_certificate(Certificate::from_pem(&tls.ca))
                .identity(Identity::from_pem(&tls.cert, &tls.key));
            if let Some(name) = &tls.server_name {
                config = config.domain_name(name.clone());
            }
            endpoint = endpoint.tls_config(config).map_err(bad)?;
        }
        Ok(endpoint)
    }

    /// A client over an existing channel.
    pub fn from_channel(channel: Channel) -> Self {
        Self {
            inner: MapServiceClient::new(channel).max_decoding_message_size(MAX_DECODE),
            retry: RetryPolicy::default(),
        }
    }

    /// Sets how calls are retried and dumps resumed (see [`RetryPolicy`]).
    pub fn with_retry(mut self, retry: RetryPolicy) -> Self {
        self.retry = retry;
        self
    }

    /// Runs a unary call, retrying it as [`RetryPolicy::should_retry_call`]
    /// says.
    async fn call<T, F, Fut>(&self, mut f: F) -> Result<T, Error>
    where
        F: FnMut(MapServiceClient<Channel>) -> Fut,
        Fut: std::future::Future<Output = Result<tonic::Response<T>, tonic::Status>>,
    {
        let mut delays = self.retry.delays();
        let mut attempt = 0;
        loop {
            match f(self.inner.clone()).await {
                Ok(resp) => return Ok(resp.into_inner()),
                Err(status) => match delays.next() {
                    Some(delay) if RetryPolicy::should_retry_call(&status, attempt) => {
                        attempt += 1;
                        tracing::debug!(code = ?status.code(), message = status.message(), ?delay, "call failed; retrying");
                        tokio::time::sleep(delay).await;
                    }
                    _ => return Err(status.into()),
                },
            }
        }
    }

    /// The maps the server exposes to this client.
    pub async fn list_maps(&self) -> Result<Vec<pb::MapInfo>, Error> {
        let resp = self
            .call(|mut c| async move { c.list_maps(pb::ListMapsRequest {}).await })
            .await?;
        Ok(resp.maps)
    }

    /// One map's description.
    pub async fn get_map(&self, map: &MapName) -> Result<pb::MapInfo, Error> {
        let req = pb::GetMapRequest {
            map: Some(map.into()),
        };
        self.call(|mut c| {
            let req = req.clone();
            async move { c.get_map(req).await }
        })
        .await
    }

    /// The map's key and value types, for decoding its entries (see
    /// [`typed`]); `None` when the map has none.
    pub async fn map_types(&self, map: &MapName) -> Result<Option<MapTypes>, Error> {
        Ok(MapTypes::from_info(&self.get_map(map).await?)?)
    }

    /// Looks up keys; absent keys come back with `found == false`. Typed
    /// maps' results carry the decoded key and value too.
    pub async fn lookup(
        &self,
        map: &MapName,
        keys: Vec<Vec<u8>>,
    ) -> Result<Vec<pb::LookupResult>, Error> {
        self.lookup_request(pb::LookupRequest {
            map: Some(map.into()),
            keys,
            ..Default::default()
        })
        .await
    }

    /// Looks up keys written as JSON, which the daemon encodes through the
    /// map's key type (`{"saddr": 167772160, "proto": "IPPROTO_TCP", ...}`);
    /// a key that does not fit is INVALID_ARGUMENT naming the member.
    pub async fn lookup_json(
        &self,
        map: &MapName,
        keys: Vec<prost_types::Value>,
    ) -> Result<Vec<pb::LookupResult>, Error> {
        self.lookup_request(pb::LookupRequest {
            map: Some(map.into()),
            json_keys: keys,
            ..Default::default()
        })
        .await
    }

    /// Sends a Lookup as given (raw, per-CPU sums, bytes and JSON keys).
    pub async fn lookup_request(
        &self,
        req: pb::LookupRequest,
    ) -> Result<Vec<pb::LookupResult>, Error> {
        let resp = self
            .call(|mut c| {
                let req = req.clone();
                async move { c.lookup(req).await }
            })
            .await?;
        Ok(resp.results)
    }

    /// Dumps a map; see [`Dump`].
    pub fn dump(&self, map: MapName, options: DumpOptions) -> Dump {
        Dump::new(self.inner.clone(), map, options, self.retry.clone())
    }
}
