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
//! - `cursor`: fleet cursors, sealed with the daemon's cursor keys so that
//!   any replica resumes them.
//! - `error`: what a call can fail with, and how a target ends in-band
//!   when the relay says so; `status`: the one mapping of both to gRPC
//!   codes, messages and stable reasons.
//! - `call`: what every call starts from (caller, deadline, map, targets
//!   split by the policy, the fleet that runs it).
//! - One module per call's domain: `info` (ListMaps, GetMap, Lookup),
//!   `dump`, `aggregate`, `watch`.
//! - `service`: the FleetService handlers (name the caller, call the
//!   domain, map the error).
#![forbid(unsafe_code)]

mod aggregate;
mod call;
pub mod config;
mod cursor;
mod dump;
mod error;
mod flight;
mod histogram;
mod info;
pub mod policy;
mod service;
mod stacks;
mod status;
mod targets;
mod watch;

use std::{io, net::SocketAddr, process::ExitCode, sync::Arc};

use arrow_flight::flight_service_server::FlightServiceServer;
use bpfmap_client::{ConnectOptions, FleetOptions, RetryPolicy};
use bpfmap_proto::v1::fleet_service_server::FleetServiceServer;
use bpfmapd::{
    KeyError,
    frontend::{Frontend, FrontendConfig, authenticated},
};
use tokio::net::TcpListener;

pub use config::{Args, ClientTlsFiles, Config, ConfigError};
pub use policy::{RelayRule, RuleError};

/// The service's name, as health reports it.
pub const SERVICE_NAME: &str = "bpfmap.v1.FleetService";

/// Why the relay cannot start, run or stop.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RelayError {
    /// The address to listen on cannot be bound.
    #[error("cannot listen on {addr}: {error}")]
    Listen {
        /// The address.
        addr: SocketAddr,
        /// Why.
        #[source]
        error: io::Error,
    },
    /// A configuration that cannot be used.
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// The fleet cursors' key cannot be read or made.
    #[error(transparent)]
    CursorKey(#[from] KeyError),
    /// The front door (listener, TLS, health) cannot start or stop.
    #[error("{0}")]
    Frontend(String),
    /// The signals that stop the relay cannot be listened to.
    #[error("cannot listen to signals: {0}")]
    Signals(#[source] io::Error),
}

/// A running relay.
#[derive(Debug)]
pub struct Relay {
    frontend: Frontend,
    stop: tokio::sync::watch::Sender<bool>,
}

impl Relay {
    /// Binds `config.listen` and starts serving.
    pub async fn start(config: &Config) -> Result<Self, RelayError> {
        let listener =
            TcpListener::bind(config.listen)
                .await
                .map_err(|error| RelayError::Listen {
                    addr: config.listen,
                    error,
                })?;
        Self::start_on(config, listener).await
    }

    /// Serves on a bound listener.
    pub async fn start_on(config: &Config, listener: TcpListener) -> Result<Self, RelayError> {
        config.validate()?;
        let mut connect = ConnectOptions::default().with_retry(RetryPolicy::fleet());
        if let Some(tls) = &config.client_tls {
            connect = connect.with_tls(tls.load()?);
        }
        let source = config.clone();
        let targets = targets::Targets::new(Box::new(move || source.target_specs())).await?;
        let (stop, stopped) = tokio::sync::watch::channel(false);
        targets.spawn_upkeep(config.refresh, connect.clone(), stopped.clone());
        let keys = Arc::new(cursor::CursorKeys::load_or_create(&config.state_dir)?);
        keys.spawn_reload(config.refresh, stopped);
        let policy = policy::RelayPolicy::new(&config.rules, config.tls.is_some())
            .map_err(ConfigError::from)?;
        let calls = call::Calls {
            targets,
            connect,
            options: FleetOptions::default()
                .with_concurrency(config.concurrency)
                .with_buffer(call::QUEUED)
                .with_answer_timeout(config.answer_timeout),
            policy: Arc::new(policy),
            keys,
            max_message_bytes: config.limits.max_message_bytes,
        };
        let (max_in, max_out) = (
            config.limits.max_request_bytes,
            config.limits.max_message_bytes + (64 << 10),
        );
        let flight = FlightServiceServer::new(flight::RelayFlight {
            calls: calls.clone(),
        })
        .max_decoding_message_size(max_in)
        .max_encoding_message_size(max_out);
        let server = FleetServiceServer::new(service::FleetServiceImpl { calls })
            .max_decoding_message_size(max_in)
            .max_encoding_message_size(max_out);
        let frontend = Frontend::start(
            listener,
            FrontendConfig {
                tls: config.tls.as_ref(),
                limits: &config.limits,
                descriptors: &[
                    bpfmap_proto::v1::FILE_DESCRIPTOR_SET,
                    bpfmap_proto::v1::FLIGHT_FILE_DESCRIPTOR_SET,
                ],
                services: &[SERVICE_NAME, bpfmapd::FLIGHT_SERVICE_NAME],
                health_listen: config.health_listen,
            },
            tonic::service::Routes::new(authenticated(server)).add_service(authenticated(flight)),
        )
        .await
        .map_err(|e| RelayError::Frontend(format!("{e:#}")))?;
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
    pub async fn stop(self) -> Result<(), RelayError> {
        self.stop.send_replace(true);
        self.frontend
            .stop()
            .await
            .map_err(|e| RelayError::Frontend(format!("{e:#}")))
    }
}

/// The binary: the configuration from the command line, the relay until
/// SIGTERM or SIGINT.
pub fn main() -> ExitCode {
    use clap::Parser as _;
    let args = Args::parse();
    if args.rotate_cursor_key {
        return rotate_cursor_key(&args);
    }
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()),
        )
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
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
            tracing::error!("{e}");
            ExitCode::FAILURE
        }
    }
}

/// `--rotate-cursor-key`: rotates the fleet cursors' key in the state
/// directory and exits (2 for a configuration that cannot be read).
fn rotate_cursor_key(args: &Args) -> ExitCode {
    let config = match Config::from_args(args) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("bpfmap-relay: {e}");
            return ExitCode::from(2);
        }
    };
    match cursor::CursorKeys::rotate(&config.state_dir) {
        Ok(()) => {
            println!(
                "rotated the fleet cursor key in {}; cursors of the previous key keep resuming until the next rotation",
                config.state_dir.display()
            );
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("bpfmap-relay: cannot rotate the cursor key: {e}");
            ExitCode::FAILURE
        }
    }
}

async fn run(args: &Args) -> Result<(), RelayError> {
    let config = Config::from_args(args)?;
    let relay = Relay::start(&config).await?;
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        .map_err(RelayError::Signals)?;
    tokio::select! {
        _ = term.recv() => {}
        _ = tokio::signal::ctrl_c() => {}
    }
    tracing::info!("stopping");
    relay.stop().await
}
