//! Applying a new configuration without a restart: certificates, key,
//! client CA, policy, cursor keys and exports (`[[export]]`), on SIGHUP or when the files change on
//! disk (Kubernetes Secret volumes swap a symlink; cert-manager renews).
//! Everything is built first; on any error nothing changes and the old
//! configuration stays in force.

use std::{
    path::{Path, PathBuf},
    sync::{Arc, Mutex},
    time::Duration,
};

use tokio::{sync::watch, task::JoinHandle};

use crate::metrics::Metrics;
use crate::{
    access::{Policy, SharedPolicy},
    config::Config,
    cursor::{CursorKey, SharedKeys},
    net::{SharedTls, server_config},
};

/// What a reload replaces; clones share it with the service and the accept
/// loop.
#[derive(Debug, Clone)]
pub(crate) struct Reloader {
    pub(crate) policy: SharedPolicy,
    pub(crate) tls: Option<SharedTls>,
    pub(crate) keys: SharedKeys,
    pub(crate) state_dir: PathBuf,
    pub(crate) metrics: Metrics,
    pub(crate) exports: crate::export::Exporter,
}

impl Reloader {
    /// Applies `config`'s certificates, client CA, policy and cursor keys.
    /// Other settings need a restart.
    pub(crate) fn reload(&self, config: &Config) -> anyhow::Result<()> {
        let result = self.try_reload(config);
        self.metrics.reloaded(result.is_ok());
        result
    }

    fn try_reload(&self, config: &Config) -> anyhow::Result<()> {
        config.validate()?;
        anyhow::ensure!(
            config.tls.is_some() == self.tls.is_some(),
            "turning TLS on or off needs a restart"
        );
        anyhow::ensure!(
            config.state_dir == self.state_dir,
            "moving the state directory needs a restart"
        );
        let policy = Policy::new(&config.rules, config.tls.is_some())?;
        let tls = match &config.tls {
            Some(files) => Some(server_config(files)?),
            None => None,
        };
        let keys = CursorKey::load_or_create(&config.state_dir)?;
        if let (Some(shared), Some(new)) = (&self.tls, tls) {
            shared.store(new);
        }
        self.policy.store(Arc::new(policy));
        self.keys.store(Arc::new(keys));
        self.exports.replace(&config.exports)?;
        tracing::info!(
            rules = config.rules.len(),
            "reloaded certificates, policy and cursor keys"
        );
        Ok(())
    }
}

/// The files a configuration depends on: the file itself, the TLS files,
/// the cursor keys.
fn watched(config_file: Option<&Path>, config: &Config) -> Vec<PathBuf> {
    let mut files: Vec<PathBuf> = config_file.map(Path::to_owned).into_iter().collect();
    if let Some(t) = &config.tls {
        files.extend([t.cert.clone(), t.key.clone(), t.client_ca.clone()]);
    }
    files.extend(CursorKey::files(&config.state_dir));
    files
}

/// A digest of the files' contents (through symlinks), "missing" for one
/// that cannot be read.
fn fingerprint(files: &[PathBuf]) -> [u8; 32] {
    let mut ctx = ring::digest::Context::new(&ring::digest::SHA256);
    for f in files {
        ctx.update(f.as_os_str().as_encoded_bytes());
        match std::fs::read(f) {
            Ok(bytes) => {
                ctx.update(&(bytes.len() as u64).to_le_bytes());
                ctx.update(&bytes);
            }
            Err(_) => ctx.update(b"missing"),
        }
    }
    let mut out = [0; 32];
    out.copy_from_slice(ctx.finish().as_ref());
    out
}

/// What the file watch last saw of the files a configuration depends on,
/// shared with reloads made another way (SIGHUP), so that a change one of
/// them applied is not applied again by the other.
#[derive(Debug, Clone)]
pub(crate) struct Seen {
    config_file: Option<PathBuf>,
    last: Arc<Mutex<[u8; 32]>>,
}

impl Seen {
    /// The files of `config` as they are now.
    pub(crate) fn new(config_file: Option<PathBuf>, config: &Config) -> Self {
        let last = fingerprint(&watched(config_file.as_deref(), config));
        Self {
            config_file,
            last: Arc::new(Mutex::new(last)),
        }
    }

    /// The files of `config` as they are now (to be noted once it is
    /// applied).
    pub(crate) fn look(&self, config: &Config) -> [u8; 32] {
        fingerprint(&watched(self.config_file.as_deref(), config))
    }

    /// Notes that the files as they were at `seen` are applied.
    pub(crate) fn note(&self, seen: [u8; 32]) {
        *self.last.lock().expect("seen lock") = seen;
    }

    fn changed(&self, now: [u8; 32]) -> bool {
        *self.last.lock().expect("seen lock") != now
    }
}

/// Checks every `interval` whether a file the configuration depends on
/// changed, and reloads when one did. `load` reads the configuration as at
/// start (file and flags); a configuration that does not load, or does not
/// apply, is logged and the old one stays in force until the files change
/// again.
pub(crate) fn watch_files(
    reloader: Reloader,
    seen: Seen,
    current: Config,
    load: impl Fn() -> anyhow::Result<Config> + Send + 'static,
    interval: Duration,
    mut stop: watch::Receiver<bool>,
) -> JoinHandle<()> {
    tokio::spawn(async move {
        let mut config = current;
        loop {
            tokio::select! {
                _ = tokio::time::sleep(interval) => {}
                _ = stop.wait_for(|s| *s) => return,
            }
            let loaded = load();
            let basis = loaded.as_ref().unwrap_or(&config);
            let now = seen.look(basis);
            if !seen.changed(now) {
                continue;
            }
            seen.note(now);
            match loaded.and_then(|c| reloader.reload(&c).map(|()| c)) {
                Ok(c) => {
                    tracing::info!("configuration files changed on disk: reloaded");
                    config = c;
                }
                Err(e) => tracing::error!(
                    "configuration files changed on disk, but the reload was rejected; keeping the old configuration: {e:#}"
                ),
            }
        }
    })
}
