//! The relay's command line and configuration file: where it listens (and
//! with which TLS), which daemons it fronts (bpfmapctl's target syntax),
//! how it reaches them, who may ask it what, and its limits (the daemon's
//! `[limits]` table: connections, streams, handshakes, message sizes).

use std::{
    io,
    net::SocketAddr,
    path::{Path, PathBuf},
    time::Duration,
};

use bpfmap_client::{ClientTls, TargetSpec};
use bpfmapd::{Limits, TlsFiles};
use serde::Deserialize;

use crate::policy::{RelayPolicy, RelayRule, RuleError};

/// What is wrong with a configuration, said before anything starts.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ConfigError {
    /// A file that cannot be read (the configuration, the targets file).
    #[error("cannot read {}: {error}", .path.display())]
    Read {
        /// The file.
        path: PathBuf,
        /// Why.
        #[source]
        error: io::Error,
    },
    /// A configuration file that does not parse.
    #[error("{} is not a valid configuration: {error}", .path.display())]
    File {
        /// The file.
        path: PathBuf,
        /// Why.
        #[source]
        error: toml::de::Error,
    },
    /// A configuration text that does not parse.
    #[error(transparent)]
    Toml(#[from] toml::de::Error),
    /// Plaintext on an address other hosts reach, not asked for.
    #[error("plaintext on {0} (not loopback): configure [tls] for callers, or set insecure = true")]
    Plaintext(SocketAddr),
    /// `concurrency = 0`.
    #[error("concurrency must be at least 1")]
    Concurrency,
    /// No target at all.
    #[error("no targets: give --target HOST:PORT (repeatable), targets = [...] or targets_file")]
    NoTargets,
    /// A target that is not one.
    #[error("target {spec:?}: {error}")]
    Target {
        /// The target as written.
        spec: String,
        /// Why.
        #[source]
        error: bpfmap_client::Error,
    },
    /// A targets file that cannot be read.
    #[error("cannot read the targets file {}: {error}", .path.display())]
    TargetsFile {
        /// The file.
        path: PathBuf,
        /// Why.
        #[source]
        error: io::Error,
    },
    /// A `[[rule]]` table that cannot be used.
    #[error(transparent)]
    Rule(#[from] RuleError),
    /// The relay's certificate for the daemons.
    #[error("[client_tls]: {0}")]
    ClientTls(#[source] io::Error),
    /// No resolver for DNS and SRV targets.
    #[error("cannot resolve targets: {0}")]
    Resolver(#[source] bpfmap_client::DiscoveryError),
    /// Targets that all failed to resolve.
    #[error("none of the targets resolved to an address")]
    NoTargetResolved,
}

/// The configuration (TOML file, then flags over it).
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Config {
    /// Where callers reach the relay.
    pub listen: SocketAddr,
    /// Plaintext on an address that is not loopback (never the default).
    pub insecure: bool,
    /// A plaintext listener for the health service only (kubelet's probes).
    pub health_listen: Option<SocketAddr>,
    /// The daemons: `HOST:PORT`, `dns:NAME:PORT`, `srv:NAME`, URLs.
    pub targets: Vec<String>,
    /// A file of targets, one per line (`#` starts a comment).
    pub targets_file: Option<PathBuf>,
    /// How often DNS and SRV targets are resolved again.
    #[serde(with = "humantime_serde")]
    pub refresh: Duration,
    /// Where the fleet cursors' key lives (shared by every replica that
    /// resumes the others' cursors).
    pub state_dir: PathBuf,
    /// Mutual TLS for callers.
    pub tls: Option<TlsFiles>,
    /// Mutual TLS to the daemons: the relay's certificate, which their
    /// policy grants.
    pub client_tls: Option<ClientTlsFiles>,
    /// Daemons asked at once per call.
    pub concurrency: usize,
    /// How long a daemon may take to answer (or between two chunks).
    #[serde(with = "humantime_serde")]
    pub answer_timeout: Duration,
    /// Who may ask what (`[[rule]]`: identities, maps, operations, targets).
    #[serde(rename = "rule")]
    pub rules: Vec<RelayRule>,
    /// Connections, streams, handshakes, message sizes (the daemon's
    /// `[limits]`).
    pub limits: Limits,
}

impl Default for Config {
    fn default() -> Self {
        Self {
            listen: "127.0.0.1:50061".parse().expect("a socket address"),
            insecure: false,
            health_listen: None,
            targets: Vec::new(),
            targets_file: None,
            refresh: Duration::from_secs(30),
            state_dir: PathBuf::from("/var/lib/bpfmap-relay"),
            tls: None,
            client_tls: None,
            concurrency: 64,
            answer_timeout: Duration::from_secs(5),
            rules: Vec::new(),
            limits: Limits::default(),
        }
    }
}

/// The relay's certificate for the daemons.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ClientTlsFiles {
    /// The CA bundle daemon certificates chain to.
    pub ca: PathBuf,
    /// The relay's certificate chain.
    pub cert: PathBuf,
    /// Its private key.
    pub key: PathBuf,
    /// The name every daemon certificate carries, when targets are
    /// addresses.
    pub server_name: Option<String>,
}

impl ClientTlsFiles {
    /// Loaded.
    pub fn load(&self) -> Result<ClientTls, ConfigError> {
        let tls = ClientTls::from_files(&self.ca, &self.cert, &self.key)
            .map_err(ConfigError::ClientTls)?;
        Ok(match &self.server_name {
            Some(name) => tls.with_server_name(name),
            None => tls,
        })
    }
}

/// The command line.
#[derive(Debug, Clone, Default, clap::Parser)]
#[command(
    name = "bpfmap-relay",
    version,
    about = "bpfmap-relay: one gRPC endpoint for a fleet of bpfmapd daemons"
)]
pub struct Args {
    /// TOML configuration file; flags override it.
    #[arg(long, short = 'c', env = "BPFMAP_RELAY_CONFIG")]
    pub config: Option<PathBuf>,
    /// Address to listen on [default: 127.0.0.1:50061].
    #[arg(long)]
    pub listen: Option<SocketAddr>,
    /// A daemon (repeatable): HOST:PORT, dns:NAME:PORT, srv:NAME, or a URL.
    #[arg(long = "target", short = 't')]
    pub targets: Vec<String>,
    /// A file of targets, one per line.
    #[arg(long)]
    pub targets_file: Option<PathBuf>,
    /// State directory for the fleet cursors' key [default:
    /// /var/lib/bpfmap-relay].
    #[arg(long)]
    pub state_dir: Option<PathBuf>,
    /// Allow plaintext on a non-loopback address.
    #[arg(long)]
    pub insecure: bool,
    /// Plaintext listener for the health service only (e.g.
    /// 127.0.0.1:50062).
    #[arg(long)]
    pub health_listen: Option<SocketAddr>,
    /// Server certificate chain (PEM); with --tls-key and --tls-client-ca
    /// enables mutual TLS for callers.
    #[arg(long, requires_all = ["tls_key", "tls_client_ca"])]
    pub tls_cert: Option<PathBuf>,
    /// Server private key (PEM).
    #[arg(long, requires_all = ["tls_cert", "tls_client_ca"])]
    pub tls_key: Option<PathBuf>,
    /// CA bundle for callers' certificates (PEM).
    #[arg(long, requires_all = ["tls_cert", "tls_key"])]
    pub tls_client_ca: Option<PathBuf>,
    /// CA bundle of the daemons' certificates; with --client-cert and
    /// --client-key, the relay reaches the daemons over mutual TLS.
    #[arg(long, requires_all = ["client_cert", "client_key"])]
    pub daemon_ca: Option<PathBuf>,
    /// The relay's certificate chain for the daemons (PEM).
    #[arg(long, requires_all = ["daemon_ca", "client_key"])]
    pub client_cert: Option<PathBuf>,
    /// Its private key (PEM).
    #[arg(long, requires_all = ["daemon_ca", "client_cert"])]
    pub client_key: Option<PathBuf>,
    /// The name daemon certificates carry when targets are addresses.
    #[arg(long)]
    pub server_name: Option<String>,
    /// Rotate the fleet cursors' key in the state directory and exit:
    /// cursors of the previous key keep resuming until the next rotation.
    /// A running relay picks the new key up by itself (every refresh).
    #[arg(long)]
    pub rotate_cursor_key: bool,
}

impl Config {
    /// Parses a configuration file's text.
    pub fn from_toml(text: &str) -> Result<Self, ConfigError> {
        Ok(toml::from_str(text)?)
    }

    /// The configuration of `args`: its file, then its flags over it.
    pub fn from_args(args: &Args) -> Result<Self, ConfigError> {
        let mut c = match &args.config {
            Some(path) => {
                let text = std::fs::read_to_string(path).map_err(|error| ConfigError::Read {
                    path: path.clone(),
                    error,
                })?;
                toml::from_str(&text).map_err(|error| ConfigError::File {
                    path: path.clone(),
                    error,
                })?
            }
            None => Self::default(),
        };
        if let Some(listen) = args.listen {
            c.listen = listen;
        }
        c.targets.extend(args.targets.iter().cloned());
        if args.targets_file.is_some() {
            c.targets_file.clone_from(&args.targets_file);
        }
        if let Some(dir) = &args.state_dir {
            c.state_dir.clone_from(dir);
        }
        c.insecure |= args.insecure;
        if args.health_listen.is_some() {
            c.health_listen = args.health_listen;
        }
        if let (Some(cert), Some(key), Some(client_ca)) =
            (&args.tls_cert, &args.tls_key, &args.tls_client_ca)
        {
            c.tls = Some(TlsFiles {
                cert: cert.clone(),
                key: key.clone(),
                client_ca: client_ca.clone(),
            });
        }
        if let (Some(ca), Some(cert), Some(key)) =
            (&args.daemon_ca, &args.client_cert, &args.client_key)
        {
            c.client_tls = Some(ClientTlsFiles {
                ca: ca.clone(),
                cert: cert.clone(),
                key: key.clone(),
                server_name: args.server_name.clone(),
            });
        }
        Ok(c)
    }

    /// What is wrong with it, said before anything starts.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if self.tls.is_none() && !self.insecure && !self.listen.ip().is_loopback() {
            return Err(ConfigError::Plaintext(self.listen));
        }
        if self.concurrency == 0 {
            return Err(ConfigError::Concurrency);
        }
        self.target_specs()?;
        RelayPolicy::new(&self.rules, self.tls.is_some())?;
        Ok(())
    }

    /// The targets of the file and the list, parsed.
    pub fn target_specs(&self) -> Result<Vec<TargetSpec>, ConfigError> {
        let mut lines = self.targets.clone();
        if let Some(file) = &self.targets_file {
            lines.extend(read_targets_file(file)?);
        }
        if lines.is_empty() {
            return Err(ConfigError::NoTargets);
        }
        lines
            .iter()
            .map(|t| {
                t.parse::<TargetSpec>()
                    .map_err(|error| ConfigError::Target {
                        spec: t.clone(),
                        error,
                    })
            })
            .collect()
    }
}

/// A targets file's lines, comments and blanks left out.
fn read_targets_file(path: &Path) -> Result<Vec<String>, ConfigError> {
    let text = std::fs::read_to_string(path).map_err(|error| ConfigError::TargetsFile {
        path: path.to_owned(),
        error,
    })?;
    Ok(text
        .lines()
        .map(|l| l.split('#').next().unwrap_or("").trim().to_owned())
        .filter(|l| !l.is_empty())
        .collect())
}
