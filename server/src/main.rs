use anyhow::Context as _;
use bpfmapd::{
    Config,
    config::{Args, LogFormat},
    demo::Demo,
};
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
    if let Err(e) = run(config).await {
        tracing::error!("{e:#}");
        std::process::exit(1);
    }
    Ok(())
}

async fn run(config: Config) -> anyhow::Result<()> {
    bpfmapd::prepare_roots(&config)?;
    let demo = if config.demo {
        Some(Demo::start(&config.roots[0]).context("cannot start the demo")?)
    } else {
        None
    };
    let running = bpfmapd::start(&config).await?;
    let mut term = signal(SignalKind::terminate())?;
    let mut int = signal(SignalKind::interrupt())?;
    tokio::select! {
        _ = term.recv() => tracing::info!("SIGTERM: shutting down"),
        _ = int.recv() => tracing::info!("SIGINT: shutting down"),
    }
    running.stop().await?;
    drop(demo);
    tracing::info!("stopped");
    Ok(())
}
