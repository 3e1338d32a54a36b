//! The daemon: its entry point (parse the command line, start logging,
//! serve until SIGTERM or SIGINT, reload on SIGHUP), and the composition
//! root that builds a running server from a configuration.

mod running;
mod start;

pub use running::Running;
pub use start::{check_privileges, prepare_roots, start, start_on};

use std::process::ExitCode;

use anyhow::Context as _;
use clap::Parser as _;
use tokio::signal::unix::{SignalKind, signal};
use tracing_subscriber::EnvFilter;

use crate::{
    config::{Args, Config, LogFormat},
    maps::Demo,
    ops::notify,
};

/// Runs bpfmapd as the `bpfmapd` binary does.
pub fn main() -> ExitCode {
    let args = Args::parse();
    let config = match Config::from_args(&args) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("bpfmapd: {e:#}");
            return ExitCode::from(2);
        }
    };
    if args.rotate_cursor_key {
        return match crate::rotate_cursor_key(&config.state_dir) {
            Ok(()) => {
                println!(
                    "rotated the cursor key in {}; cursors of the previous key stay valid until the next rotation",
                    config.state_dir.display()
                );
                ExitCode::SUCCESS
            }
            Err(e) => {
                eprintln!("bpfmapd: cannot rotate the cursor key: {e:#}");
                ExitCode::FAILURE
            }
        };
    }
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    // Logs go to stderr (journald and kubectl logs collect it), in colour
    // only on a terminal.
    match config.log_format {
        LogFormat::Text => tracing_subscriber::fmt()
            .with_env_filter(filter)
            .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
            .with_writer(std::io::stderr)
            .init(),
        LogFormat::Json => tracing_subscriber::fmt()
            .json()
            .with_env_filter(filter)
            .with_writer(std::io::stderr)
            .init(),
    }
    for note in &config.deprecated {
        tracing::warn!("{note}");
    }
    bpfmap_kernel::return_large_buffers_to_the_system(crate::dump::largest_chunk(&config.limits));
    let runtime = match tokio::runtime::Runtime::new() {
        Ok(r) => r,
        Err(e) => {
            tracing::error!("cannot start the runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(run(args, config)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            tracing::error!("{e:#}");
            ExitCode::FAILURE
        }
    }
}

async fn run(args: Args, config: Config) -> anyhow::Result<()> {
    // Handlers first: a SIGHUP (systemctl reload) or SIGTERM that arrives
    // while starting must not take the default action and kill the process.
    let mut term = signal(SignalKind::terminate())?;
    let mut int = signal(SignalKind::interrupt())?;
    let mut hup = signal(SignalKind::hangup())?;
    check_privileges(&config)?;
    prepare_roots(&config)?;
    let demo = if config.demo {
        Some(Demo::start_live(&config.roots[0]).context("cannot start the demo")?)
    } else {
        None
    };
    let mut running = start(&config).await?;
    if let Some(interval) = config.watch_files() {
        let load_args = args.clone();
        running.watch_files(
            args.config.clone(),
            config.clone(),
            move || Config::from_args(&load_args),
            interval,
        );
    }
    notify(&format!(
        "READY=1\nSTATUS=serving on {}",
        running.local_addr()
    ));
    loop {
        tokio::select! {
            _ = term.recv() => { tracing::info!("SIGTERM: shutting down"); break; }
            _ = int.recv() => { tracing::info!("SIGINT: shutting down"); break; }
            _ = hup.recv() => {
                // Re-read the config file and the files it names; a bad one
                // is logged and the old configuration stays in force.
                notify("RELOADING=1");
                match Config::from_args(&args).and_then(|c| running.reload(&c)) {
                    Ok(()) => {}
                    Err(e) => tracing::error!("SIGHUP: reload rejected, keeping the old configuration: {e:#}"),
                }
                notify("READY=1");
            }
        }
    }
    notify("STOPPING=1");
    running.stop().await?;
    drop(demo);
    tracing::info!("stopped");
    Ok(())
}
