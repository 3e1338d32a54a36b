//! The bpfmapd daemon.
#![forbid(unsafe_code)]

use anyhow::Context as _;
use bpfmapd::{Args, Config, Demo, LogFormat};
use clap::Parser as _;
use tokio::signal::unix::{SignalKind, signal};
use tracing_subscriber::EnvFilter;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let config = Config::from_args(&args)?;
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    match config.log_format {
        LogFormat::Text => tracing_subscriber::fmt().with_env_filter(filter).init(),
        LogFormat::Json => tracing_subscriber::fmt()
            .json()
            .with_env_filter(filter)
            .init(),
    }
    if let Err(e) = run(args, config).await {
        tracing::error!("{e:#}");
        std::process::exit(1);
    }
    Ok(())
}

async fn run(args: Args, config: Config) -> anyhow::Result<()> {
    bpfmapd::check_privileges(&config)?;
    bpfmapd::prepare_roots(&config)?;
    let demo = if config.demo {
        Some(Demo::start(&config.roots[0]).context("cannot start the demo")?)
    } else {
        None
    };
    let running = bpfmapd::start(&config).await?;
    let mut term = signal(SignalKind::terminate())?;
    let mut int = signal(SignalKind::interrupt())?;
    let mut hup = signal(SignalKind::hangup())?;
    loop {
        tokio::select! {
            _ = term.recv() => { tracing::info!("SIGTERM: shutting down"); break; }
            _ = int.recv() => { tracing::info!("SIGINT: shutting down"); break; }
            _ = hup.recv() => {
                // Re-read the config file and the files it names; a bad one
                // is logged and the old configuration stays in force.
                match Config::from_args(&args).and_then(|c| running.reload(&c)) {
                    Ok(()) => {}
                    Err(e) => tracing::error!("SIGHUP: reload rejected, keeping the old configuration: {e:#}"),
                }
            }
        }
    }
    running.stop().await?;
    drop(demo);
    tracing::info!("stopped");
    Ok(())
}
