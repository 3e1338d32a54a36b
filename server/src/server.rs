//! Assembles the gRPC server: MapService, health, reflection (v1 and
//! v1alpha), mutual TLS, limits, reload, graceful shutdown.
#![forbid(unsafe_code)]

use std::{net::SocketAddr, sync::Arc, time::Duration};

use anyhow::Context as _;
use bpfmap_proto::v1::map_service_server::MapServiceServer;
use tokio::{
    net::TcpListener,
    sync::{mpsc, watch},
    task::JoinHandle,
};
use tokio_stream::wrappers::ReceiverStream;
use tonic::service::interceptor::InterceptedService;
use tonic_health::ServingStatus;

use crate::{
    auth::{self, Policy},
    catalog::Catalog,
    config::Config,
    cursor::CursorKey,
    dump::{DumpEnv, DumpStats},
    kernel,
    limits::DumpSlots,
    service::{MapServiceImpl, SharedPolicy},
    tls::{self, SharedTls},
};

/// Name of the service in the health protocol.
pub const SERVICE_NAME: &str = "bpfmap.v1.MapService";
/// Largest message the server sends; chunks stay below 3 MiB.
const MAX_RESPONSE_BYTES: usize = 4 << 20;

/// A running server.
#[derive(Debug)]
pub struct Running {
    addr: SocketAddr,
    health_addr: Option<SocketAddr>,
    stats: Arc<DumpStats>,
    policy: SharedPolicy,
    tls: Option<SharedTls>,
    shutdown: watch::Sender<bool>,
    tasks: Vec<JoinHandle<Result<(), tonic::transport::Error>>>,
}

impl Running {
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// The plaintext health-only listener, when configured.
    pub fn health_addr(&self) -> Option<SocketAddr> {
        self.health_addr
    }

    pub fn stats(&self) -> &Arc<DumpStats> {
        &self.stats
    }

    /// Applies a new configuration's certificates, client CA and policy
    /// without a restart. Everything is built first; on any error nothing
    /// changes and the error says why. Other settings need a restart.
    pub fn reload(&self, config: &Config) -> anyhow::Result<()> {
        config.validate()?;
        anyhow::ensure!(
            config.tls.is_some() == self.tls.is_some(),
            "turning TLS on or off needs a restart"
        );
        let policy = Policy::new(&config.rules, config.tls.is_some())?;
        let tls = match &config.tls {
            Some(files) => Some(tls::server_config(files)?),
            None => None,
        };
        if let (Some(shared), Some(new)) = (&self.tls, tls) {
            shared.store(new);
        }
        self.policy.store(Arc::new(policy));
        tracing::info!(
            rules = config.rules.len(),
            "reloaded certificates and policy"
        );
        Ok(())
    }

    /// Ends open dumps with UNAVAILABLE (clients resume elsewhere or later),
    /// reports NOT_SERVING, and waits for connections to close.
    pub async fn stop(self) -> anyhow::Result<()> {
        self.shutdown.send_replace(true);
        let all = futures::future::join_all(self.tasks);
        match tokio::time::timeout(Duration::from_secs(10), all).await {
            Ok(results) => {
                for r in results {
                    r.context("server task panicked")?
                        .context("server failed")?;
                }
                Ok(())
            }
            Err(_) => {
                tracing::warn!("connections still open after 10 s; stopping anyway");
                Ok(())
            }
        }
    }
}

/// Checks the process has the capabilities this configuration needs, and
/// says which one is missing and what for.
pub fn check_privileges(config: &Config) -> anyhow::Result<()> {
    use crate::privileges;
    let must_mount = config.mount_bpffs
        && config
            .roots
            .iter()
            .any(|r| !r.exists() || !kernel::is_bpffs(r).unwrap_or(false));
    let effective = privileges::effective().context("cannot read the capability set")?;
    let missing = privileges::missing(
        effective,
        privileges::unprivileged_bpf_allowed(),
        config.allow_by_id,
        must_mount,
    );
    if !missing.is_empty() {
        let all: Vec<String> = missing
            .iter()
            .map(|m| format!("{} (needed for {})", m.capability, m.needed_for))
            .collect();
        anyhow::bail!("missing capability: {}", all.join("; "));
    }
    Ok(())
}

/// Makes sure every root is a mounted bpffs, mounting one if allowed.
pub fn prepare_roots(config: &Config) -> anyhow::Result<()> {
    for root in &config.roots {
        if root.exists() && kernel::is_bpffs(root).unwrap_or(false) {
            continue;
        }
        anyhow::ensure!(
            config.mount_bpffs,
            "{} is not a mounted bpffs (mount it with `mount -t bpf bpf {0}`, or allow mount_bpffs)",
            root.display()
        );
        std::fs::create_dir_all(root)
            .with_context(|| format!("cannot create {}", root.display()))?;
        kernel::mount_bpffs(root).with_context(|| {
            format!(
                "cannot mount bpffs on {} (needs CAP_SYS_ADMIN)",
                root.display()
            )
        })?;
        tracing::info!(root = %root.display(), "mounted bpffs");
    }
    Ok(())
}

/// Binds `config.listen` and starts serving.
pub async fn start(config: &Config) -> anyhow::Result<Running> {
    let listener = TcpListener::bind(config.listen)
        .await
        .with_context(|| format!("cannot listen on {}", config.listen))?;
    start_on(config, listener).await
}

/// Starts serving on an already bound listener.
pub async fn start_on(config: &Config, listener: TcpListener) -> anyhow::Result<Running> {
    config.validate()?;
    let key = CursorKey::load_or_create(&config.state_dir)?;
    let addr = listener.local_addr()?;
    let tls: Option<SharedTls> = match &config.tls {
        Some(files) => Some(Arc::new(arc_swap::ArcSwap::new(tls::server_config(files)?))),
        None => None,
    };
    let policy = Policy::new(&config.rules, tls.is_some())?;
    if tls.is_none() {
        if config.insecure && !config.listen.ip().is_loopback() {
            tracing::warn!(listen = %config.listen, "serving PLAINTEXT on a non-loopback address (insecure = true): anyone who can reach it reads the exposed maps");
        } else if policy.is_open() {
            tracing::warn!(
                "plaintext on loopback without rules: every local user can read every exposed map; configure [tls] and [[rule]] for anything else"
            );
        }
    } else if config.rules.is_empty() {
        tracing::warn!("TLS is on but no [[rule]] is configured: every request will be denied");
    }
    let policy: SharedPolicy = Arc::new(arc_swap::ArcSwap::from_pointee(policy));
    let (shutdown, shutdown_rx) = watch::channel(false);
    let stats = Arc::new(DumpStats::default());
    let limits = &config.limits;
    let service = MapServiceImpl::new(
        Catalog::new(config.roots.clone(), config.allow_by_id),
        key,
        policy.clone(),
        Arc::new(DumpSlots::new(
            limits.max_dumps,
            limits.max_dumps_per_identity,
        )),
        DumpEnv {
            shutdown: shutdown_rx.clone(),
            stats: stats.clone(),
            stall_timeout: Duration::from_secs(limits.stall_timeout_secs),
        },
    );
    let map_service = MapServiceServer::new(service)
        .max_decoding_message_size(limits.max_request_bytes)
        .max_encoding_message_size(MAX_RESPONSE_BYTES);

    let (health_reporter, health) = tonic_health::server::health_reporter();
    for name in [SERVICE_NAME, ""] {
        health_reporter
            .set_service_status(name, ServingStatus::Serving)
            .await;
    }
    let reflection = || {
        tonic_reflection::server::Builder::configure()
            .register_encoded_file_descriptor_set(bpfmap_proto::v1::FILE_DESCRIPTOR_SET)
            .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
            // google.rpc.ErrorInfo, so grpcurl can show error details.
            .register_encoded_file_descriptor_set(tonic_types::pb::FILE_DESCRIPTOR_SET)
    };
    let reflection_v1 = reflection().build_v1()?;
    let reflection_v1alpha = reflection().build_v1alpha()?;

    let mut tasks = Vec::new();
    let mut health_addr = None;
    if let Some(health_listen) = config.health_listen {
        let health_listener = TcpListener::bind(health_listen)
            .await
            .with_context(|| format!("cannot listen on {health_listen} (health_listen)"))?;
        health_addr = Some(health_listener.local_addr()?);
        let mut rx = shutdown_rx.clone();
        let incoming =
            tonic::transport::server::TcpIncoming::from(health_listener).with_nodelay(Some(true));
        // Reflection of the health schema only, so grpcurl works here too.
        let probe_reflection = tonic_reflection::server::Builder::configure()
            .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
            .build_v1alpha()?;
        tasks.push(tokio::spawn(
            tonic::transport::Server::builder()
                .add_service(health.clone())
                .add_service(probe_reflection)
                .serve_with_incoming_shutdown(incoming, async move {
                    let _ = rx.wait_for(|s| *s).await;
                }),
        ));
    }

    let mut rx = shutdown_rx.clone();
    let signal = async move {
        let _ = rx.wait_for(|s| *s).await;
        for name in [SERVICE_NAME, ""] {
            health_reporter
                .set_service_status(name, ServingStatus::NotServing)
                .await;
        }
    };
    let router = tonic::transport::Server::builder()
        .max_concurrent_streams(Some(limits.max_streams_per_connection))
        .http2_keepalive_interval(Some(Duration::from_secs(30)))
        .http2_keepalive_timeout(Some(Duration::from_secs(10)))
        .add_service(InterceptedService::new(map_service, auth::authenticate))
        .add_service(health)
        .add_service(InterceptedService::new(reflection_v1, auth::authenticate))
        .add_service(InterceptedService::new(
            reflection_v1alpha,
            auth::authenticate,
        ));
    let (conn_tx, conn_rx) = mpsc::channel(64);
    tokio::spawn(tls::accept_loop(
        listener,
        tls.clone(),
        Duration::from_secs(limits.handshake_timeout_secs),
        conn_tx,
        shutdown_rx,
    ));
    tasks.push(tokio::spawn(router.serve_with_incoming_shutdown(
        ReceiverStream::new(conn_rx),
        signal,
    )));
    tracing::info!(
        %addr,
        tls = tls.is_some(),
        roots = ?config.roots,
        allow_by_id = config.allow_by_id,
        "bpfmapd listening"
    );
    Ok(Running {
        addr,
        health_addr,
        stats,
        policy,
        tls,
        shutdown,
        tasks,
    })
}
