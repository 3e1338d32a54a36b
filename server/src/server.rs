//! Assembles the gRPC server: MapService, health, reflection (v1 and
//! v1alpha), mutual TLS, limits, reload, graceful shutdown.
#![forbid(unsafe_code)]

use std::{
    net::SocketAddr,
    sync::{Arc, atomic::Ordering},
    time::{Duration, Instant},
};

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
    conn::{self, AcceptConfig, CountCalls, Registry},
    cursor::CursorKey,
    dump::{DumpEnv, DumpLimits, DumpStats},
    kernel,
    limits::{Budget, Busy, DumpSlots, LookupSlots, split_memory},
    metrics::Metrics,
    reload::{Reloader, SharedKeys, SharedPolicy},
    service::{MapServiceImpl, ServiceLimits},
    tls::{self, SharedTls},
};

/// Name of the service in the health protocol.
pub const SERVICE_NAME: &str = "bpfmap.v1.MapService";
/// After the shutdown grace, how long connections get to deliver the last
/// statuses and close before they are closed by force.
const DRAIN: Duration = Duration::from_millis(500);

/// A running server.
#[derive(Debug)]
pub struct Running {
    addr: SocketAddr,
    health_addr: Option<SocketAddr>,
    metrics_addr: Option<SocketAddr>,
    stats: Arc<DumpStats>,
    reloader: Reloader,
    watcher: Option<JoinHandle<()>>,
    registry: Registry,
    budget: Budget,
    grace: Duration,
    /// Set when the server stops taking calls (health NOT_SERVING, GOAWAY).
    draining: watch::Sender<bool>,
    /// Set when dumps in flight must end.
    stop_dumps: watch::Sender<bool>,
    tasks: Vec<JoinHandle<Result<(), tonic::transport::Error>>>,
}

impl Running {
    /// The address the server listens on.
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// The plaintext health-only listener, when configured.
    pub fn health_addr(&self) -> Option<SocketAddr> {
        self.health_addr
    }

    /// The Prometheus endpoint, when configured.
    pub fn metrics_addr(&self) -> Option<SocketAddr> {
        self.metrics_addr
    }

    /// Counters of the dumps.
    pub fn stats(&self) -> &Arc<DumpStats> {
        &self.stats
    }

    /// Connections open now (on the main listener).
    pub fn open_connections(&self) -> usize {
        self.registry.len()
    }

    /// Bytes of the memory pool (lookups, oversized entries) in use now.
    pub fn pool_in_use(&self) -> usize {
        self.budget.in_use()
    }

    /// Applies a new configuration's certificates, client CA, policy and
    /// cursor keys without a restart. Everything is built first; on any
    /// error nothing changes and the error says why. Other settings need a
    /// restart.
    pub fn reload(&self, config: &Config) -> anyhow::Result<()> {
        self.reloader.reload(config)
    }

    /// Reloads by itself whenever a file the configuration depends on
    /// changes on disk (the configuration file `config_file`, the TLS files,
    /// the cursor keys), checked every `interval`. `load` reads the
    /// configuration as at start; `current` is the one in force.
    pub fn watch_files(
        &mut self,
        config_file: Option<std::path::PathBuf>,
        current: Config,
        load: impl Fn() -> anyhow::Result<Config> + Send + 'static,
        interval: Duration,
    ) {
        if let Some(old) = self.watcher.take() {
            old.abort();
        }
        self.watcher = Some(crate::reload::watch_files(
            self.reloader.clone(),
            config_file,
            current,
            load,
            interval,
            self.draining.subscribe(),
        ));
    }

    /// Stops: health turns NOT_SERVING and new calls get UNAVAILABLE at
    /// once (connections are sent GOAWAY); dumps in flight get the shutdown
    /// grace to finish, then end with UNAVAILABLE (clients resume from their
    /// cursor); connections still open shortly after are closed.
    pub async fn stop(self) -> anyhow::Result<()> {
        let started = Instant::now();
        self.draining.send_replace(true);
        if let Some(w) = &self.watcher {
            w.abort();
        }
        while self.stats.active.load(Ordering::SeqCst) > 0 && started.elapsed() < self.grace {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let cut = self.stats.active.load(Ordering::SeqCst);
        self.stop_dumps.send_replace(true);
        let mut all = futures::future::join_all(self.tasks);
        let results = match tokio::time::timeout(DRAIN, &mut all).await {
            Ok(results) => results,
            Err(_) => {
                let closed = self.registry.kill_all();
                tracing::info!(closed, "closed connections still open after the drain");
                match tokio::time::timeout(DRAIN, all).await {
                    Ok(results) => results,
                    Err(_) => {
                        tracing::warn!("the server did not stop in time; stopping anyway");
                        return Ok(());
                    }
                }
            }
        };
        tracing::info!(
            dumps_cut = cut,
            took_ms = started.elapsed().as_millis() as u64,
            "server stopped"
        );
        for r in results {
            r.context("server task panicked")?
                .context("server failed")?;
        }
        Ok(())
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
    let keys: SharedKeys = Arc::new(arc_swap::ArcSwap::from_pointee(CursorKey::load_or_create(
        &config.state_dir,
    )?));
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
    if let Some(off) = crate::privileges::effective()
        .ok()
        .and_then(crate::privileges::typed_maps_off)
    {
        tracing::warn!(
            "no {}: {} (the systemd drop-in deploy/systemd/bpfmapd.service.d/cap-sys-admin.conf adds it)",
            off.capability,
            off.needed_for
        );
    }
    let policy: SharedPolicy = Arc::new(arc_swap::ArcSwap::from_pointee(policy));
    let (draining, draining_rx) = watch::channel(false);
    let (stop_dumps, stop_dumps_rx) = watch::channel(false);
    let stats = Arc::new(DumpStats::default());
    let limits = &config.limits;
    raise_fd_limit(limits.max_connections);
    let slots = Arc::new(DumpSlots::new(
        limits.max_dumps,
        limits.max_dumps_per_identity,
    ));
    let registry = Registry::default();
    let metrics = Metrics::new(Some((stats.clone(), slots.clone(), registry.clone())));
    let reloader = Reloader {
        policy: policy.clone(),
        tls: tls.clone(),
        keys: keys.clone(),
        state_dir: config.state_dir.clone(),
        metrics: metrics.clone(),
    };
    let (share, pool_bytes) = split_memory(limits.max_queued_bytes, limits.max_dumps);
    let budget = Budget::new(pool_bytes);
    let dump_limits = DumpLimits {
        share,
        pool: pool_bytes,
        max_message_bytes: limits.max_message_bytes,
    };
    let service = MapServiceImpl::new(
        Catalog::new(config.roots.clone(), config.allow_by_id),
        keys,
        policy.clone(),
        ServiceLimits {
            slots: slots.clone(),
            lookups: Arc::new(LookupSlots::new(limits.max_lookups)),
            pool: budget.clone(),
            dumps: dump_limits,
            busy: Busy::default(),
        },
        DumpEnv {
            stop: stop_dumps_rx.clone(),
            stats: stats.clone(),
            stall_timeout: Duration::from_secs(limits.stall_timeout_secs),
            limits: dump_limits,
            slots,
            max_slot_hold: Duration::from_secs(limits.max_slot_hold_secs),
        },
        draining_rx.clone(),
        metrics.clone(),
    );
    let map_service = MapServiceServer::new(service)
        .max_decoding_message_size(limits.max_request_bytes)
        .max_encoding_message_size(limits.max_message_bytes + (64 << 10));

    let health_reporter = tonic_health::server::HealthReporter::new();
    let health = crate::health::service(health_reporter.clone(), stop_dumps_rx.clone());
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
        // The probe port answers (NOT_SERVING) until the dumps are cut.
        let mut rx = stop_dumps_rx.clone();
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

    let mut rx = draining_rx.clone();
    let signal = async move {
        let _ = rx.wait_for(|s| *s).await;
    };
    let router = tonic::transport::Server::builder()
        .layer(CountCalls(metrics.clone()))
        .max_concurrent_streams(Some(limits.max_streams_per_connection))
        .http2_max_local_error_reset_streams(Some(1024))
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
    let accepting = tokio::spawn(conn::accept_loop(
        listener,
        AcceptConfig {
            stall_timeout: Duration::from_secs(limits.stall_timeout_secs),
            tls: tls.clone(),
            handshake_timeout: Duration::from_secs(limits.handshake_timeout_secs),
            idle_timeout: Duration::from_secs(limits.idle_timeout_secs),
            max_connections: limits.max_connections,
            metrics: metrics.clone(),
        },
        registry.clone(),
        conn_tx,
        draining_rx.clone(),
    ));
    // NOT_SERVING as soon as draining starts and the listener is closed, in
    // a task of its own (the router may stop polling its shutdown signal
    // once the accept loop has ended its stream of connections): a client
    // told NOT_SERVING that connects again is refused (UNAVAILABLE), never
    // taken into the backlog of a listener about to close and reset.
    let mut rx = draining_rx.clone();
    tokio::spawn(async move {
        let _ = rx.wait_for(|s| *s).await;
        let _ = accepting.await;
        for name in [SERVICE_NAME, ""] {
            health_reporter
                .set_service_status(name, ServingStatus::NotServing)
                .await;
        }
    });
    tasks.push(tokio::spawn(router.serve_with_incoming_shutdown(
        ReceiverStream::new(conn_rx),
        signal,
    )));
    let mut metrics_addr = None;
    if let Some(listen) = config.metrics_listen {
        let listener = TcpListener::bind(listen)
            .await
            .with_context(|| format!("cannot listen on {listen} (metrics_listen)"))?;
        metrics_addr = Some(listener.local_addr()?);
        tokio::spawn(crate::metrics::serve(
            listener,
            metrics.clone(),
            stop_dumps_rx.clone(),
        ));
    }
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
        metrics_addr,
        stats,
        reloader,
        watcher: None,
        registry,
        budget,
        grace: Duration::from_secs(limits.shutdown_grace_secs),
        draining,
        stop_dumps,
        tasks,
    })
}

/// Raises the open-file limit to its maximum, and warns when it stays too
/// low for `max_connections` (every connection is a descriptor).
fn raise_fd_limit(max_connections: usize) {
    match rlimit::increase_nofile_limit(u64::MAX) {
        Ok(limit) if limit < max_connections as u64 + 64 => tracing::warn!(
            limit,
            max_connections,
            "the open-file limit is below limits.max_connections + 64: new connections will fail before the connection limit is reached"
        ),
        Ok(_) => {}
        Err(e) => tracing::warn!(error = %e, "cannot read or raise the open-file limit"),
    }
}
