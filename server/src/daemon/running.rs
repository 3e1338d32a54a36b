//! A running server: its addresses, reloading it, stopping it.

use std::{
    net::SocketAddr,
    sync::{Arc, atomic::Ordering},
    time::{Duration, Instant},
};

use anyhow::Context as _;
use tokio::{sync::watch, task::JoinHandle};

use crate::{
    config::Config,
    dump::DumpStats,
    limits::Budget,
    net::ConnRegistry,
    ops::{Reloader, Seen, watch_files},
};

/// After the shutdown grace, how long connections get to deliver the last
/// statuses and close before they are closed by force.
const DRAIN: Duration = Duration::from_millis(500);

/// A running server.
#[derive(Debug)]
pub struct Running {
    pub(super) addr: SocketAddr,
    pub(super) health_addr: Option<SocketAddr>,
    pub(super) metrics_addr: Option<SocketAddr>,
    pub(super) stats: Arc<DumpStats>,
    pub(super) reloader: Reloader,
    pub(super) watcher: Option<JoinHandle<()>>,
    /// What the file watch last saw, when it is on.
    pub(super) seen: Option<Seen>,
    pub(super) conns: ConnRegistry,
    pub(super) budget: Budget,
    pub(super) grace: Duration,
    /// Set when the server stops taking calls (health NOT_SERVING, GOAWAY).
    pub(super) draining: watch::Sender<bool>,
    /// Set when dumps in flight must end.
    pub(super) stop_dumps: watch::Sender<bool>,
    pub(super) tasks: Vec<JoinHandle<Result<(), tonic::transport::Error>>>,
    /// The Unix socket's file, removed when the daemon is gone.
    pub(super) _unix: Option<crate::net::SocketFile>,
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
        self.conns.len()
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
        // The files as read now: once applied, the file watch (if on) does
        // not apply the same change again.
        let seen = self.seen.as_ref().map(|s| (s, s.look(config)));
        self.reloader.reload(config)?;
        if let Some((s, now)) = seen {
            s.note(now);
        }
        Ok(())
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
        let seen = Seen::new(config_file, &current);
        self.seen = Some(seen.clone());
        self.watcher = Some(watch_files(
            self.reloader.clone(),
            seen,
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
                let closed = self.conns.kill_all();
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
