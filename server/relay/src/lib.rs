//! bpfmap-relay: one gRPC endpoint for a fleet of bpfmapd daemons. It
//! serves `bpfmap.v1.FleetService`, fanning each MapService call out to its
//! targets with the client library's fleet calls (bounded concurrency,
//! per-target errors, resumable dumps, the exact top K), behind the
//! daemon's own front door (`bpfmapd::frontend`: TLS, connection limits,
//! HTTP/2 bounds, callers, health, reflection).
//!
//! - `config`: the command line and the configuration file.
//! - `targets`: the targets, resolved again every refresh, and their states.
//! - `policy`: who may ask what, on which targets.
//! - `cursor`: fleet cursors, sealed so that any replica resumes them.
//! - `service`: the FleetService calls; `dump`: a fleet dump's stream;
//!   `watch`: a fleet watch's rounds.
#![forbid(unsafe_code)]

pub mod config;
mod cursor;
mod dump;
pub mod policy;
mod service;
mod targets;
mod watch;

use std::{net::SocketAddr, process::ExitCode, sync::Arc};

use anyhow::Context as _;
use bpfmap_client::{ConnectOptions, FleetOptions, RetryPolicy};
use bpfmap_proto::v1::fleet_service_server::FleetServiceServer;
use bpfmapd::frontend::{Frontend, FrontendConfig, authenticated};
use tokio::net::TcpListener;

pub use config::{Args, ClientTlsFiles, Config};
pub use policy::RelayRule;

/// The service's name, as health reports it.
pub const SERVICE_NAME: &str = "bpfmap.v1.FleetService";

/// A running relay.
#[derive(Debug)]
pub struct Relay {
    frontend: Frontend,
    stop: tokio::sync::watch::Sender<bool>,
}

impl Relay {
    /// Binds `config.listen` and starts serving.
    pub async fn start(config: &Config) -> anyhow::Result<Self> {
        let listener = TcpListener::bind(config.listen)
            .await
            .with_context(|| format!("cannot listen on {}", config.listen))?;
        Self::start_on(config, listener).await
    }

    /// Serves on a bound listener.
    pub async fn start_on(config: &Config, listener: TcpListener) -> anyhow::Result<Self> {
        config.validate()?;
        let mut connect = ConnectOptions::default().with_retry(RetryPolicy::fleet());
        if let Some(tls) = &config.client_tls {
            connect = connect.with_tls(tls.load()?);
        }
        let source = config.clone();
        let targets = targets::Targets::new(Box::new(move || source.target_specs())).await?;
        let (stop, stopped) = tokio::sync::watch::channel(false);
        targets.spawn_upkeep(config.refresh, connect.clone(), stopped);
        let service = service::FleetServiceImpl {
            targets,
            connect,
            options: FleetOptions::default()
                .with_concurrency(config.concurrency)
                .with_buffer(dump::QUEUED)
                .with_answer_timeout(config.answer_timeout),
            policy: Arc::new(policy::RelayPolicy::new(
                &config.rules,
                config.tls.is_some(),
            )?),
            keys: Arc::new(cursor::CursorKey::load_or_create(&config.state_dir)?),
        };
        let server = FleetServiceServer::new(service)
            .max_decoding_message_size(config.limits.max_request_bytes)
            .max_encoding_message_size(config.limits.max_message_bytes + (64 << 10));
        let frontend = Frontend::start(
            listener,
            FrontendConfig {
                tls: config.tls.as_ref(),
                limits: &config.limits,
                descriptors: &[bpfmap_proto::v1::FILE_DESCRIPTOR_SET],
                services: &[SERVICE_NAME],
                health_listen: config.health_listen,
            },
            tonic::service::Routes::new(authenticated(server)),
        )
        .await?;
        tracing::info!(addr = %frontend.local_addr(), tls = config.tls.is_some(), "bpfmap-relay listening");
        Ok(Self { frontend, stop })
    }

    /// Where it listens.
    pub fn local_addr(&self) -> SocketAddr {
        self.frontend.local_addr()
    }

    /// Where its health-only listener listens, if it has one.
    pub fn health_addr(&self) -> Option<SocketAddr> {
        self.frontend.health_addr()
    }

    /// Stops: no new calls, calls in flight end, connections close.
    pub async fn stop(self) -> anyhow::Result<()> {
        self.stop.send_replace(true);
        self.frontend.stop().await
    }
}

/// The binary: the configuration from the command line, the relay until
/// SIGTERM or SIGINT.
pub fn main() -> ExitCode {
    use clap::Parser as _;
    let args = Args::parse();
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()),
        )
        .with_writer(std::io::stderr)
        .init();
    let runtime = match tokio::runtime::Runtime::new() {
        Ok(r) => r,
        Err(e) => {
            eprintln!("bpfmap-relay: cannot start the runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(run(&args)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            tracing::error!("{e:#}");
            ExitCode::FAILURE
        }
    }
}

async fn run(args: &Args) -> anyhow::Result<()> {
    let config = Config::from_args(args)?;
    let relay = Relay::start(&config).await?;
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    tokio::select! {
        _ = term.recv() => {}
        _ = tokio::signal::ctrl_c() => {}
    }
    tracing::info!("stopping");
    relay.stop().await
}
