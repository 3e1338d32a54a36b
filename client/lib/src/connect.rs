//! How a client reaches a daemon: TLS, timeouts, retry.

use std::{fmt, path::Path, time::Duration};

use tonic::transport::{Certificate, ClientTlsConfig, Endpoint, Identity};

use crate::{Error, RetryPolicy, transport::OnBehalfOf};

/// Mutual TLS material, PEM-encoded.
#[derive(Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct ClientTls {
    ca: Vec<u8>,
    cert: Vec<u8>,
    key: Vec<u8>,
    server_name: Option<String>,
}

impl fmt::Debug for ClientTls {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ClientTls")
            .field("server_name", &self.server_name)
            .finish_non_exhaustive()
    }
}

impl ClientTls {
    /// The CA bundle that the daemon's certificate must chain to, and this
    /// client's certificate chain and private key.
    pub fn new(ca: impl Into<Vec<u8>>, cert: impl Into<Vec<u8>>, key: impl Into<Vec<u8>>) -> Self {
        Self {
            ca: ca.into(),
            cert: cert.into(),
            key: key.into(),
            server_name: None,
        }
    }

    /// Reads the three PEM files (see [`new`](Self::new)).
    pub fn from_files(ca: &Path, cert: &Path, key: &Path) -> std::io::Result<Self> {
        let read = |p: &Path| {
            std::fs::read(p)
                .map_err(|e| std::io::Error::new(e.kind(), format!("{}: {e}", p.display())))
        };
        Ok(Self::new(read(ca)?, read(cert)?, read(key)?))
    }

    /// The name to verify the daemon's certificate against (default: the
    /// host of the address). For a [`Fleet`](crate::Fleet) whose targets
    /// are addresses, the name every daemon's certificate must carry.
    pub fn with_server_name(mut self, name: impl Into<String>) -> Self {
        self.server_name = Some(name.into());
        self
    }
}

/// How a client reaches a daemon: TLS, the connect timeout, and how calls
/// are retried and dumps resumed.
///
/// ```
/// use std::time::Duration;
/// use bpfmap_client::{ConnectOptions, RetryPolicy};
///
/// let options = ConnectOptions::default()
///     .with_connect_timeout(Duration::from_secs(2))
///     .with_retry(RetryPolicy::default().with_max_attempts(3));
/// # let _ = options;
/// ```
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct ConnectOptions {
    tls: Option<ClientTls>,
    connect_timeout: Duration,
    retry: Option<RetryPolicy>,
    on_behalf_of: Option<String>,
}

/// Plaintext, a 5 s connect timeout, the default retry policy.
impl Default for ConnectOptions {
    fn default() -> Self {
        Self {
            tls: None,
            connect_timeout: Duration::from_secs(5),
            retry: None,
            on_behalf_of: None,
        }
    }
}

/// Largest message the client accepts: the daemon's default largest
/// message (chunks stay below 3 MiB unless one entry is larger).
pub(crate) const MAX_DECODE: usize = (64 << 20) + (64 << 10);

impl ConnectOptions {
    /// Mutual TLS (give "https://" addresses). Default: plaintext.
    pub fn with_tls(mut self, tls: ClientTls) -> Self {
        self.tls = Some(tls);
        self
    }

    /// The time allowed to establish a connection, TCP and TLS (default
    /// 5 s).
    pub fn with_connect_timeout(mut self, timeout: Duration) -> Self {
        self.connect_timeout = timeout;
        self
    }

    /// How calls are retried and dumps resumed. Default:
    /// [`RetryPolicy::default`] for a [`Client`](crate::Client) (8
    /// attempts, 100 ms to 5 s apart); for each target of a
    /// [`Fleet`](crate::Fleet), 4 attempts 100 ms to 2 s apart, so that a
    /// target that is down is reported soon.
    pub fn with_retry(mut self, retry: RetryPolicy) -> Self {
        self.retry = Some(retry);
        self
    }

    /// Name, in every call, the identity this client calls for (a relay's
    /// caller): the daemon writes it in its audit log beside the client's
    /// own identity, and decides nothing on it. A name that is not
    /// printable ASCII is left out.
    pub fn with_on_behalf_of(mut self, identity: impl Into<String>) -> Self {
        self.on_behalf_of = Some(identity.into());
        self
    }

    /// What every call carries besides its message.
    pub(crate) fn headers(&self) -> OnBehalfOf {
        OnBehalfOf(
            self.on_behalf_of
                .as_deref()
                .and_then(|v| v.parse::<tonic::metadata::AsciiMetadataValue>().ok()),
        )
    }

    /// Whether the daemons are reached over TLS (targets' URLs are then
    /// `https://`).
    pub fn uses_tls(&self) -> bool {
        self.tls.is_some()
    }

    /// The retry policy given, or `default`.
    pub(crate) fn retry_or(&self, default: impl FnOnce() -> RetryPolicy) -> RetryPolicy {
        self.retry.clone().unwrap_or_else(default)
    }

    /// The endpoint of `addr` with these options.
    pub(crate) fn endpoint(&self, addr: &str) -> Result<Endpoint, Error> {
        let bad = |source| Error::Address {
            addr: addr.into(),
            source,
        };
        let mut endpoint = Endpoint::from_shared(addr.to_owned())
            .map_err(bad)?
            .connect_timeout(self.connect_timeout)
            .tcp_nodelay(true)
            .initial_stream_window_size(2 << 20)
            .initial_connection_window_size(4 << 20)
            // Frames that hold a whole chunk (96 KiB with the daemon's
            // default limits), not 16 KiB pieces of it: a dump of 100K
            // 320-byte entries cost 78-83 ms of CPU (daemon and client
            // together) with 16 KiB frames, 65-66 ms with these. The
            // connection's read buffer grows to one frame.
            .max_frame_size(256 << 10)
            .http2_keep_alive_interval(Duration::from_secs(30))
            .keep_alive_timeout(Duration::from_secs(10));
        if let Some(tls) = &self.tls {
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
}
