//! Assembles the gRPC server: MapService, health, reflection (v1 and
//! v1alpha), graceful shutdown.

use std::{net::SocketAddr, path::Path, sync::Arc, time::Duration};

use anyhow::Context as _;
use bpfmap_proto::v1::map_service_server::MapServiceServer;
use tokio::{net::TcpListener, sync::watch, task::JoinHandle};
use tonic::transport::server::TcpIncoming;
use tonic_health::ServingStatus;

use crate::{
    catalog::Catalog, config::Config, cursor::CursorKey, dump::DumpStats, kernel::sys,
    service::MapServiceImpl,
};

/// Name of the service in the health protocol.
pub const SERVICE_NAME: &str = "bpfmap.v1.MapService";

/// A running server.
#[derive(Debug)]
pub struct Running {
    addr: SocketAddr,
    stats: Arc<DumpStats>,
    shutdown: watch::Sender<bool>,
    task: JoinHandle<Result<(), tonic::transport::Error>>,
}

impl Running {
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    pub fn stats(&self) -> &Arc<DumpStats> {
        &self.stats
    }

    /// Ends open dumps with UNAVAILABLE (clients resume elsewhere or later),
    /// reports NOT_SERVING, and waits for connections to close.
    pub async fn stop(self) -> anyhow::Result<()> {
        self.shutdown.send_replace(true);
        match tokio::time::timeout(Duration::from_secs(10), self.task).await {
            Ok(joined) => joined
                .context("server task panicked")?
                .context("server failed"),
            Err(_) => {
                tracing::warn!("connections still open after 10 s; stopping anyway");
                Ok(())
            }
        }
    }
}

/// Makes sure every root is a mounted bpffs, mounting one if allowed.
pub fn prepare_roots(config: &Config) -> anyhow::Result<()> {
    for root in &config.roots {
        if root.exists() && sys::is_bpffs(root).unwrap_or(false) {
            continue;
        }
        anyhow::ensure!(
            config.mount_bpffs,
            "{} is not a mounted bpffs (mount it with `mount -t bpf bpf {0}`, or allow mount_bpffs)",
            root.display()
        );
        std::fs::create_dir_all(root)
            .with_context(|| format!("cannot create {}", root.display()))?;
        sys::mount_bpffs(root).with_context(|| {
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
    let key = load_key(&config.state_dir)?;
    let addr = listener.local_addr()?;
    let (shutdown, shutdown_rx) = watch::channel(false);
    let stats = Arc::new(DumpStats::default());
    let catalog = Catalog::new(config.roots.clone(), config.allow_by_id);
    let service = MapServiceImpl::new(catalog, key, shutdown_rx.clone(), stats.clone());

    let (health_reporter, health) = tonic_health::server::health_reporter();
    health_reporter
        .set_service_status(SERVICE_NAME, ServingStatus::Serving)
        .await;
    health_reporter
        .set_service_status("", ServingStatus::Serving)
        .await;
    let reflection = || {
        tonic_reflection::server::Builder::configure()
            .register_encoded_file_descriptor_set(bpfmap_proto::v1::FILE_DESCRIPTOR_SET)
            .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
            // google.rpc.ErrorInfo, so grpcurl can show error details.
            .register_encoded_file_descriptor_set(tonic_types::pb::FILE_DESCRIPTOR_SET)
    };
    let reflection_v1 = reflection().build_v1()?;
    let reflection_v1alpha = reflection().build_v1alpha()?;

    let mut rx = shutdown_rx;
    let signal = async move {
        let _ = rx.wait_for(|s| *s).await;
        health_reporter
            .set_service_status(SERVICE_NAME, ServingStatus::NotServing)
            .await;
        health_reporter
            .set_service_status("", ServingStatus::NotServing)
            .await;
    };
    let router = tonic::transport::Server::builder()
        .http2_keepalive_interval(Some(Duration::from_secs(30)))
        .http2_keepalive_timeout(Some(Duration::from_secs(10)))
        .add_service(MapServiceServer::new(service))
        .add_service(health)
        .add_service(reflection_v1)
        .add_service(reflection_v1alpha);
    let incoming = TcpIncoming::from(listener)
        .with_nodelay(Some(true))
        .with_keepalive(Some(Duration::from_secs(60)));
    let task = tokio::spawn(router.serve_with_incoming_shutdown(incoming, signal));
    tracing::info!(%addr, roots = ?config.roots, allow_by_id = config.allow_by_id, "bpfmapd listening");
    Ok(Running {
        addr,
        stats,
        shutdown,
        task,
    })
}

fn load_key(state_dir: &Path) -> anyhow::Result<CursorKey> {
    CursorKey::load_or_create(state_dir).map_err(Into::into)
}
