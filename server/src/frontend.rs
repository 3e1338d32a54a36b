//! The daemon's front door, for servers built on it (bpfmap-relay): one
//! listener with TLS when configured, the connection limits and HTTP/2
//! bounds of [`Limits`] (connections, streams, handshake and idle
//! timeouts, rapid resets, stalled readers), each call's caller named from
//! its connection ([`caller_of`]: a certificate's SPIFFE ID, DNS name or
//! CN, or `anonymous`), the standard health service and reflection, and a
//! graceful stop. The daemon's own main listener is served by the same
//! code (`serve_routes`).

use std::{net::SocketAddr, time::Duration};

use tokio::{
    net::{TcpListener, UnixListener},
    sync::{mpsc, watch},
    task::JoinHandle,
};
use tonic::service::{Routes, interceptor::InterceptedService};
use tonic_health::{ServingStatus, server::HealthReporter};

pub use crate::access::{Policy, PolicyError};
use crate::{
    config::Limits,
    metrics::Metrics,
    net::{
        self, AcceptConfig, ConnRegistry, CountCalls, TlsFiles, accept_loop, accept_unix_loop,
        authenticate,
    },
    rpc::health_service,
};
pub use crate::{
    model::{Caller, Identity},
    net::caller_of,
};

/// The task serving a listener.
pub(crate) type ServeTask = JoinHandle<Result<(), tonic::transport::Error>>;

/// Streams reset by their client before they were answered, pending at once
/// on one connection (HTTP/2's own rapid-reset bound).
const MAX_PENDING_RESETS: usize = 20;
/// The largest header list of one request.
const MAX_HEADER_LIST_BYTES: u32 = 16 << 10;
/// How long a stop waits for connections to end before closing them.
const DRAIN: Duration = Duration::from_secs(5);

/// A service whose calls know their caller ([`caller_of`]).
pub type Authenticated<S> =
    InterceptedService<S, fn(tonic::Request<()>) -> Result<tonic::Request<()>, tonic::Status>>;

/// `service` with its caller named on every call.
pub fn authenticated<S>(service: S) -> Authenticated<S> {
    InterceptedService::new(service, authenticate)
}

/// What a front door serves, and how.
#[derive(Debug)]
pub struct FrontendConfig<'a> {
    /// Mutual TLS; plaintext without it.
    pub tls: Option<&'a TlsFiles>,
    /// The connection limits and HTTP/2 bounds (the daemon's `[limits]`).
    pub limits: &'a Limits,
    /// The encoded descriptor sets reflection serves (besides health's and
    /// google.rpc's).
    pub descriptors: &'a [&'static [u8]],
    /// The services health reports SERVING ("" is added).
    pub services: &'a [&'static str],
    /// A plaintext listener for the health service only (kubelet's gRPC
    /// probes, which cannot present a client certificate).
    pub health_listen: Option<SocketAddr>,
}

/// The health service of a server: its reporter, and the services it
/// reports on ("" is added).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Health<'a> {
    pub(crate) reporter: &'a HealthReporter,
    pub(crate) services: &'a [&'static str],
}

/// A server's listeners, what it serves on them and within which limits.
#[derive(Debug)]
pub(crate) struct Listening<'a> {
    pub(crate) listener: TcpListener,
    /// A Unix socket beside it, if there is one.
    pub(crate) unix: Option<UnixListener>,
    /// The services, with health and reflection.
    pub(crate) routes: Routes,
    /// The HTTP/2 bounds.
    pub(crate) limits: &'a Limits,
    /// The connection settings.
    pub(crate) accept: AcceptConfig,
    /// Told NOT_SERVING once draining closes the listener.
    pub(crate) health: Health<'a>,
}

/// A front door serving: its address, and how to stop it.
#[derive(Debug)]
pub struct Frontend {
    addr: SocketAddr,
    health_addr: Option<SocketAddr>,
    draining: watch::Sender<bool>,
    conns: ConnRegistry,
    task: ServeTask,
    health: Option<ServeTask>,
}

impl Frontend {
    /// Serves `routes` (each service wrapped with [`authenticated`]) with
    /// health and reflection on `listener`.
    pub async fn start(
        listener: TcpListener,
        config: FrontendConfig<'_>,
        routes: Routes,
    ) -> anyhow::Result<Self> {
        let addr = listener.local_addr()?;
        let tls = match config.tls {
            Some(files) => Some(std::sync::Arc::new(arc_swap::ArcSwap::new(
                net::server_config(files)?,
            ))),
            None => None,
        };
        let metrics = Metrics::new(Vec::new());
        let accept = accept_config(config.limits, tls, &metrics);
        let reporter = HealthReporter::new();
        for name in config.services.iter().copied().chain([""]) {
            reporter
                .set_service_status(name, ServingStatus::Serving)
                .await;
        }
        let (draining, _) = watch::channel(false);
        let conns = ConnRegistry::default();
        let health = Health {
            reporter: &reporter,
            services: config.services,
        };
        let routes =
            with_health_and_reflection(routes, health, config.descriptors, draining.subscribe())?;
        let listening = Listening {
            listener,
            unix: None,
            routes,
            limits: config.limits,
            accept,
            health,
        };
        let task = serve_routes(listening, &draining, conns.clone());
        let (health_addr, health) = match config.health_listen {
            Some(listen) => {
                let (addr, task) = serve_health(listen, &reporter, &draining).await?;
                (Some(addr), Some(task))
            }
            None => (None, None),
        };
        Ok(Self {
            addr,
            health_addr,
            draining,
            conns,
            task,
            health,
        })
    }

    /// Where it listens.
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// Where the health-only listener listens, if there is one.
    pub fn health_addr(&self) -> Option<SocketAddr> {
        self.health_addr
    }

    /// Stops taking connections, tells each open one to end (GOAWAY) once
    /// its calls are done, and closes those still open after a few
    /// seconds.
    pub async fn stop(self) -> anyhow::Result<()> {
        self.draining.send_replace(true);
        let mut task = self.task;
        if tokio::time::timeout(DRAIN, &mut task).await.is_err() {
            self.conns.kill_all();
            task.await??;
        }
        if let Some(health) = self.health {
            health.await??;
        }
        Ok(())
    }
}

/// A plaintext listener on `listen` for the health service only (with
/// reflection of its schema, so that grpcurl works there too), answering
/// until `stop` is set.
pub(crate) async fn serve_health(
    listen: SocketAddr,
    reporter: &HealthReporter,
    stop: &watch::Sender<bool>,
) -> anyhow::Result<(SocketAddr, ServeTask)> {
    use anyhow::Context as _;
    let listener = TcpListener::bind(listen)
        .await
        .with_context(|| format!("cannot listen on {listen} (health_listen)"))?;
    let addr = listener.local_addr()?;
    let incoming = tonic::transport::server::TcpIncoming::from(listener).with_nodelay(Some(true));
    let probe_reflection = tonic_reflection::server::Builder::configure()
        .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
        .build_v1alpha()?;
    let health = health_service(reporter.clone(), stop.subscribe());
    let mut stopped = stop.subscribe();
    let task = tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(health)
            .add_service(probe_reflection)
            .serve_with_incoming_shutdown(incoming, async move {
                let _ = stopped.wait_for(|s| *s).await;
            }),
    );
    Ok((addr, task))
}

/// The connection settings of `limits`.
pub(crate) fn accept_config(
    limits: &Limits,
    tls: Option<net::SharedTls>,
    metrics: &Metrics,
) -> AcceptConfig {
    AcceptConfig {
        stall_timeout: limits.stall_timeout,
        tls,
        handshake_timeout: limits.handshake_timeout,
        idle_timeout: limits.idle_timeout,
        max_connections: limits.max_connections,
        max_cancelled_calls: limits.max_cancelled_calls,
        metrics: metrics.clone(),
    }
}

/// Reflection (v1 and v1alpha: grpcurl 1.8 speaks only v1alpha) of
/// `descriptors`, health and google.rpc.ErrorInfo (so that grpcurl can show
/// error details), advertising `services` (the descriptors may describe
/// others, which this server does not serve), health and reflection.
fn reflection(
    descriptors: &[&'static [u8]],
    services: &[&'static str],
) -> tonic_reflection::server::Builder<'static> {
    let builder = tonic_reflection::server::Builder::configure()
        .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
        .register_encoded_file_descriptor_set(tonic_types::pb::FILE_DESCRIPTOR_SET);
    let builder = descriptors
        .iter()
        .fold(builder, |b, d| b.register_encoded_file_descriptor_set(d));
    services
        .iter()
        .copied()
        .chain([
            "grpc.health.v1.Health",
            "grpc.reflection.v1alpha.ServerReflection",
        ])
        .fold(builder, |b, name| b.with_service_name(name))
}

/// `routes` with the health service (its Watch streams ending once `stop`
/// is set) and reflection of `descriptors`, advertising `services`.
pub(crate) fn with_health_and_reflection(
    routes: Routes,
    health: Health<'_>,
    descriptors: &[&'static [u8]],
    stop: watch::Receiver<bool>,
) -> anyhow::Result<Routes> {
    let services = health.services;
    Ok(routes
        .add_service(health_service(health.reporter.clone(), stop))
        .add_service(authenticated(reflection(descriptors, services).build_v1()?))
        .add_service(authenticated(
            reflection(descriptors, services).build_v1alpha()?,
        )))
}

/// Serves what `listening` says behind the connection limits on the
/// connections of its listeners (recorded in `conns`), until `draining` is
/// set: then health says NOT_SERVING once the listener is closed, and each
/// connection ends (GOAWAY) once its calls are done.
pub(crate) fn serve_routes(
    listening: Listening<'_>,
    draining: &watch::Sender<bool>,
    conns: ConnRegistry,
) -> ServeTask {
    let Listening {
        listener,
        unix,
        routes,
        limits,
        accept,
        health,
    } = listening;
    let service = tower::ServiceBuilder::new()
        .layer(CountCalls(accept.metrics.clone()))
        .service(routes);
    let (conn_tx, conn_rx) = mpsc::channel(64);
    if let Some(unix) = unix {
        tokio::spawn(accept_unix_loop(
            unix,
            accept.clone(),
            conns.clone(),
            conn_tx.clone(),
            draining.subscribe(),
        ));
    }
    let accepting = tokio::spawn(accept_loop(
        listener,
        accept,
        conns,
        conn_tx,
        draining.subscribe(),
    ));
    // NOT_SERVING as soon as draining starts and the listener is closed, in
    // a task of its own (the router may stop polling its shutdown signal
    // once the accept loop has ended its stream of connections): a client
    // told NOT_SERVING that connects again is refused (UNAVAILABLE), never
    // taken into the backlog of a listener about to close and reset.
    let (reporter, services) = (health.reporter.clone(), health.services.to_vec());
    let mut told = draining.subscribe();
    tokio::spawn(async move {
        let _ = told.wait_for(|d| *d).await;
        let _ = accepting.await;
        for name in services.into_iter().chain([""]) {
            reporter
                .set_service_status(name, ServingStatus::NotServing)
                .await;
        }
    });
    let mut stop = draining.subscribe();
    tokio::spawn(net::serve(
        service,
        http2_settings(limits),
        conn_rx,
        async move {
            let _ = stop.wait_for(|d| *d).await;
        },
    ))
}

/// The HTTP/2 settings of a listener's connections.
fn http2_settings(limits: &Limits) -> net::Http2Settings {
    net::Http2Settings {
        max_streams: limits.max_streams_per_connection,
        // Streams a client resets before the server answered them, pending
        // at once (the burst form of rapid reset: GOAWAY ENHANCE_YOUR_CALM
        // past it; those reset after the answer are max_cancelled_calls'),
        // and the headers of one request (431 or a reset above).
        max_pending_resets: MAX_PENDING_RESETS,
        max_local_error_resets: 1024,
        max_header_list: MAX_HEADER_LIST_BYTES,
        // What a stream may have buffered beyond the client's window (with
        // the frame being written), which a dump's share counts
        // (IN_TRANSPORT).
        max_send_buf: 64 << 10,
        keepalive: (Duration::from_secs(30), Duration::from_secs(10)),
    }
}
