//! Configuration: a TOML file (optional) overridden by command-line flags.
//! With neither, bpfmapd serves /sys/fs/bpf on 127.0.0.1:50051.

use std::{
    net::SocketAddr,
    path::{Path, PathBuf},
    time::Duration,
};

use anyhow::Context as _;
use clap::Parser;
use serde::Deserialize;

use crate::{
    access::RuleConfig,
    maps::{RenderConfig, TypesConfig},
    net::TlsFiles,
};

#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Config {
    /// Address to listen on.
    pub listen: SocketAddr,
    /// A Unix socket to listen on as well (plaintext, mode 0660): local
    /// callers are `uid:N`, one caller per process.
    pub listen_unix: Option<PathBuf>,
    /// The group of the Unix socket (a name or a number), whose members may
    /// connect to it.
    pub listen_unix_group: Option<String>,
    /// bpffs directories whose pinned maps are exposed; map paths are relative
    /// to them. An earlier root wins when two hold the same relative path.
    pub roots: Vec<PathBuf>,
    /// Where the cursor signing key lives (created 0700 on first start).
    pub state_dir: PathBuf,
    /// Allow naming maps by kernel id (reaches maps nobody pinned; needs
    /// CAP_SYS_ADMIN).
    pub allow_by_id: bool,
    /// Mount bpffs on a root that is not one yet.
    pub mount_bpffs: bool,
    /// Create and pin demo maps under `<first root>/demo` and keep them
    /// changing; they are removed again on shutdown.
    pub demo: bool,
    /// Log format: "text" or "json".
    pub log_format: LogFormat,
    /// Serve without TLS on a non-loopback address (every start warns).
    pub insecure: bool,
    /// Mutual TLS. Without it the daemon speaks plaintext.
    pub tls: Option<TlsFiles>,
    /// An extra plaintext listener serving only the health service (for
    /// probes that cannot present client certificates). Keep it on loopback.
    pub health_listen: Option<SocketAddr>,
    /// A plaintext HTTP listener serving Prometheus metrics at /metrics.
    pub metrics_listen: Option<SocketAddr>,
    /// Check the configuration file, the TLS files and the cursor keys for
    /// changes this often, and reload when one changed ("0s": only on
    /// SIGHUP).
    #[serde(with = "humantime_serde")]
    pub watch_files: Duration,
    /// Deprecated spelling of `watch_files`, in seconds.
    pub watch_files_secs: Option<u64>,
    pub limits: Limits,
    /// Authorization rules (`[[rule]]` tables); see deploy/docs/security.md.
    #[serde(rename = "rule")]
    pub rules: Vec<RuleConfig>,
    /// How members of matching maps are shown to every caller (`[[render]]`
    /// tables: `maps` globs and `members` renderings).
    pub render: Vec<RenderConfig>,
    /// Types declared in C for maps whose BTF does not give them
    /// (`[[types]]` tables: `maps` path globs or `names` kernel name
    /// globs, `key` and `value` declarations).
    pub types: Vec<TypesConfig>,
    /// The maps DrainMap may read and delete (`[drain] maps`): the only
    /// maps ever opened read-write.
    pub drain: DrainConfig,
    /// Maps served as Prometheus metrics on `metrics_listen` (`[[export]]`
    /// tables); see deploy/docs/metrics.md.
    #[serde(rename = "export")]
    pub exports: Vec<crate::export::ExportConfig>,
    /// How often the fill level of every exposed map (entries, max_entries,
    /// memory) is read for the metrics listener; counting entries walks
    /// each map. "0s": never.
    #[serde(with = "humantime_serde")]
    pub map_pressure_interval: Duration,
    /// Whether aggregates (AggregateMap, exports, map pressure) may walk
    /// maps inside the kernel with programs the daemon generates, where
    /// the kernel allows it; `false`: always batched reads.
    pub kernel_scans: bool,
    /// What the configuration file spelled in a deprecated way, to warn of
    /// once logging is on.
    #[serde(skip)]
    pub deprecated: Vec<String>,
}

/// `[drain]`: which maps may be drained.
#[derive(Debug, Clone, PartialEq, Eq, Default, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct DrainConfig {
    /// Path globs of drainable maps ("flows/*"); none by default.
    pub maps: Vec<String>,
}

/// Resource bounds.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Limits {
    /// Dumps running at once, in all.
    pub max_dumps: usize,
    /// Dumps running at once for one identity (for plaintext callers, one
    /// peer address).
    pub max_dumps_per_identity: usize,
    /// A dump that has held its slot this long while other dumps were
    /// refused one ends with UNAVAILABLE (the client resumes from its
    /// cursor), so that slow clients cannot keep everyone else out.
    #[serde(with = "humantime_serde")]
    pub max_slot_hold: Duration,
    /// Deprecated spelling of `max_slot_hold`, in seconds.
    pub max_slot_hold_secs: Option<u64>,
    /// HTTP/2 streams (calls) open at once on one connection.
    pub max_streams_per_connection: u32,
    /// Connections open at once; further ones are closed at once.
    pub max_connections: usize,
    /// Calls a connection's client may cancel (reset its stream before the
    /// response ended) within 10 s; one more and the connection gets a
    /// GOAWAY with ENHANCE_YOUR_CALM and is closed (0: no limit).
    pub max_cancelled_calls: u32,
    /// A dump whose client has not taken a chunk for this long is ended
    /// (UNAVAILABLE; the client resumes from its last cursor).
    #[serde(with = "humantime_serde")]
    pub stall_timeout: Duration,
    /// Deprecated spelling of `stall_timeout`, in seconds.
    pub stall_timeout_secs: Option<u64>,
    /// Time allowed for a connection's TLS handshake and HTTP/2 preface.
    #[serde(with = "humantime_serde")]
    pub handshake_timeout: Duration,
    /// Deprecated spelling of `handshake_timeout`, in seconds.
    pub handshake_timeout_secs: Option<u64>,
    /// A connection with no call open for this long is closed.
    #[serde(with = "humantime_serde")]
    pub idle_timeout: Duration,
    /// Deprecated spelling of `idle_timeout`, in seconds.
    pub idle_timeout_secs: Option<u64>,
    /// Largest request message accepted.
    pub max_request_bytes: usize,
    /// Memory for what is queued to clients, in all. Three quarters are
    /// shared out equally among the dump slots (each dump's queued chunks
    /// stay within max_queued_bytes * 3/4 / max_dumps, and chunks are sized
    /// to fit); one quarter serves lookup responses and entries larger than
    /// a dump's share.
    pub max_queued_bytes: usize,
    /// Largest message sent. Chunks and lookup responses stay below 3 MiB
    /// (grpcurl's default limit is 4 MiB) unless one entry is larger; such
    /// an entry travels alone, up to this size.
    pub max_message_bytes: usize,
    /// Lookups running at once.
    pub max_lookups: usize,
    /// A filter whose evaluation costs more than this many times the walk
    /// it filters (past 200 ms of evaluation) ends its call with
    /// RESOURCE_EXHAUSTED (0: no bound).
    pub max_filter_cost: u32,
    /// Groups one AggregateMap call may hold (RESOURCE_EXHAUSTED beyond).
    pub max_groups: usize,
    /// Kernel memory the walk programs kept loaded between calls may hold
    /// (their maps' and their own), in all: the least recently used are
    /// unloaded past it; one larger runs once and is not kept.
    pub max_kernel_scan_bytes: u64,
    /// The shortest interval a WatchMap call may ask for.
    #[serde(with = "humantime_serde")]
    pub min_watch_interval: Duration,
    /// Memory for what watches keep of the maps they watch (each entry's
    /// key and value, and the changes of recent scans), in all; a watch
    /// that would need more ends with RESOURCE_EXHAUSTED.
    pub max_watch_bytes: usize,
    /// Scans whose changes are kept per watched map, so that a watch
    /// resumes exactly from a cursor that recent.
    pub watch_history_scans: usize,
    /// Bytes of changes kept per watched map (the oldest scans go first).
    pub watch_history_bytes: usize,
    /// WatchMap calls open at once, in all and for one identity (for
    /// plaintext callers, one peer address).
    pub max_watches: usize,
    pub max_watches_per_identity: usize,
    /// How long a map stays watched (and its history kept) after its last
    /// watcher left, so that a client that reconnects resumes exactly.
    #[serde(with = "humantime_serde")]
    pub watch_linger: Duration,
    /// Bytes of drained chunks kept in the state directory until their
    /// client acknowledges them, per map; when full, draining pauses (the
    /// entries stay in the kernel map).
    pub max_drain_spool_bytes: u64,
    /// On shutdown, dumps in flight get this long to finish before they end
    /// with UNAVAILABLE.
    #[serde(with = "humantime_serde")]
    pub shutdown_grace: Duration,
    /// Deprecated spelling of `shutdown_grace`, in seconds.
    pub shutdown_grace_secs: Option<u64>,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            max_dumps: 64,
            max_dumps_per_identity: 8,
            max_slot_hold: Duration::from_secs(5),
            max_slot_hold_secs: None,
            max_streams_per_connection: 64,
            max_connections: 1024,
            max_cancelled_calls: 50,
            stall_timeout: Duration::from_secs(30),
            stall_timeout_secs: None,
            handshake_timeout: Duration::from_secs(10),
            handshake_timeout_secs: None,
            idle_timeout: Duration::from_secs(120),
            idle_timeout_secs: None,
            max_request_bytes: 4 << 20,
            max_queued_bytes: 48 << 20,
            max_message_bytes: 64 << 20,
            max_lookups: 16,
            max_filter_cost: 8,
            max_groups: 100_000,
            max_kernel_scan_bytes: 64 << 20,
            min_watch_interval: Duration::from_secs(1),
            max_watch_bytes: 32 << 20,
            watch_history_scans: 60,
            watch_history_bytes: 4 << 20,
            max_watches: 64,
            max_watches_per_identity: 8,
            watch_linger: Duration::from_secs(30),
            max_drain_spool_bytes: 256 << 20,
            shutdown_grace: Duration::from_secs(2),
            shutdown_grace_secs: None,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, clap::ValueEnum, Default)]
#[serde(rename_all = "lowercase")]
pub enum LogFormat {
    #[default]
    Text,
    Json,
}

impl Default for Config {
    fn default() -> Self {
        Self {
            listen: "127.0.0.1:50051".parse().expect("valid address"),
            roots: vec![PathBuf::from("/sys/fs/bpf")],
            state_dir: PathBuf::from("/var/lib/bpfmapd"),
            allow_by_id: false,
            mount_bpffs: true,
            demo: false,
            log_format: LogFormat::Text,
            insecure: false,
            tls: None,
            health_listen: None,
            metrics_listen: None,
            listen_unix: None,
            listen_unix_group: None,
            watch_files: Duration::from_secs(5),
            watch_files_secs: None,
            limits: Limits::default(),
            rules: Vec::new(),
            render: Vec::new(),
            types: Vec::new(),
            drain: DrainConfig::default(),
            exports: Vec::new(),
            map_pressure_interval: Duration::from_secs(60),
            kernel_scans: true,
            deprecated: Vec::new(),
        }
    }
}

/// bpfmapd: serves eBPF maps over gRPC, read-only, with resumable dumps.
#[derive(Debug, Clone, Parser)]
#[command(name = "bpfmapd", version)]
pub struct Args {
    /// TOML configuration file (see deploy/bpfmapd.toml); flags override it.
    #[arg(long, short = 'c', env = "BPFMAPD_CONFIG")]
    pub config: Option<PathBuf>,
    /// Address to listen on [default: 127.0.0.1:50051].
    #[arg(long)]
    pub listen: Option<SocketAddr>,
    /// bpffs root to expose (repeatable) [default: /sys/fs/bpf].
    #[arg(long = "root")]
    pub roots: Vec<PathBuf>,
    /// State directory for the cursor key [default: /var/lib/bpfmapd].
    #[arg(long)]
    pub state_dir: Option<PathBuf>,
    /// Allow naming maps by kernel id.
    #[arg(long)]
    pub allow_by_id: bool,
    /// Do not mount bpffs on a root that is not one.
    #[arg(long)]
    pub no_mount: bool,
    /// Create demo maps under ROOT/demo (the first root) and keep them changing.
    #[arg(long)]
    pub demo: bool,
    /// Log format.
    #[arg(long, value_enum)]
    pub log_format: Option<LogFormat>,
    /// Server certificate chain (PEM); with --tls-key and --tls-client-ca
    /// enables mutual TLS.
    #[arg(long, requires_all = ["tls_key", "tls_client_ca"])]
    pub tls_cert: Option<PathBuf>,
    /// Server private key (PEM).
    #[arg(long, requires_all = ["tls_cert", "tls_client_ca"])]
    pub tls_key: Option<PathBuf>,
    /// CA bundle for client certificates (PEM).
    #[arg(long, requires_all = ["tls_cert", "tls_key"])]
    pub tls_client_ca: Option<PathBuf>,
    /// Allow plaintext on a non-loopback address.
    #[arg(long)]
    pub insecure: bool,
    /// Plaintext listener for the health service only (e.g. 127.0.0.1:50052).
    #[arg(long)]
    pub health_listen: Option<SocketAddr>,
    /// Listen on this Unix socket as well (e.g. /run/bpfmapd.sock).
    #[arg(long, value_name = "PATH")]
    pub listen_unix: Option<PathBuf>,
    /// Plaintext listener for Prometheus metrics (e.g. 127.0.0.1:9464).
    #[arg(long)]
    pub metrics_listen: Option<SocketAddr>,
    /// Rotate the cursor key in the state directory and exit: cursors of the
    /// previous key stay valid until the next rotation. A running daemon
    /// picks the new key up by itself.
    #[arg(long)]
    pub rotate_cursor_key: bool,
}

impl Config {
    /// Parses a configuration file's text. Durations are written as
    /// "30s", "5m", "1h 30m"; the older `*_secs` keys (whole seconds) still
    /// work, each noted in [`Config::deprecated`].
    pub fn from_toml(text: &str) -> anyhow::Result<Self> {
        let mut c: Self = toml::from_str(text)?;
        let table: toml::Table = toml::from_str(text)?;
        c.fold_deprecated(&table)?;
        Ok(c)
    }

    /// Moves the deprecated `*_secs` keys into their durations; `table` is
    /// the file as written, to tell which spellings it uses.
    fn fold_deprecated(&mut self, table: &toml::Table) -> anyhow::Result<()> {
        let limits = table.get("limits").and_then(toml::Value::as_table);
        let l = &mut self.limits;
        let keys: [(&str, Option<&toml::Table>, &mut Option<u64>, &mut Duration); 6] = [
            (
                "watch_files",
                Some(table),
                &mut self.watch_files_secs,
                &mut self.watch_files,
            ),
            (
                "limits.max_slot_hold",
                limits,
                &mut l.max_slot_hold_secs,
                &mut l.max_slot_hold,
            ),
            (
                "limits.stall_timeout",
                limits,
                &mut l.stall_timeout_secs,
                &mut l.stall_timeout,
            ),
            (
                "limits.handshake_timeout",
                limits,
                &mut l.handshake_timeout_secs,
                &mut l.handshake_timeout,
            ),
            (
                "limits.idle_timeout",
                limits,
                &mut l.idle_timeout_secs,
                &mut l.idle_timeout,
            ),
            (
                "limits.shutdown_grace",
                limits,
                &mut l.shutdown_grace_secs,
                &mut l.shutdown_grace,
            ),
        ];
        for (key, section, secs, duration) in keys {
            let Some(n) = secs.take() else { continue };
            let name = key.rsplit('.').next().unwrap_or(key);
            anyhow::ensure!(
                !section.is_some_and(|t| t.contains_key(name)),
                "both {key} and {key}_secs are set: keep {key} = \"{n}s\" only"
            );
            *duration = Duration::from_secs(n);
            self.deprecated.push(format!(
                "{key}_secs is deprecated: write {key} = \"{n}s\" (durations like \"30s\", \"5m\")"
            ));
        }
        Ok(())
    }

    /// How often to look for changed files, if at all.
    pub fn watch_files(&self) -> Option<Duration> {
        (!self.watch_files.is_zero()).then_some(self.watch_files)
    }

    pub fn from_file(path: &Path) -> anyhow::Result<Self> {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("cannot read config file {}", path.display()))?;
        Self::from_toml(&text).with_context(|| format!("invalid config file {}", path.display()))
    }

    /// The file named by `--config` (or the defaults), then the flags.
    pub fn from_args(args: &Args) -> anyhow::Result<Self> {
        let mut c = match &args.config {
            Some(path) => Self::from_file(path)?,
            None => Self::default(),
        };
        if let Some(l) = args.listen {
            c.listen = l;
        }
        if !args.roots.is_empty() {
            c.roots = args.roots.clone();
        }
        if let Some(s) = &args.state_dir {
            c.state_dir = s.clone();
        }
        c.allow_by_id |= args.allow_by_id;
        c.mount_bpffs &= !args.no_mount;
        c.demo |= args.demo;
        if let Some(f) = args.log_format {
            c.log_format = f;
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
        c.insecure |= args.insecure;
        if let Some(h) = args.health_listen {
            c.health_listen = Some(h);
        }
        if let Some(u) = &args.listen_unix {
            c.listen_unix = Some(u.clone());
        }
        if let Some(m) = args.metrics_listen {
            c.metrics_listen = Some(m);
        }
        c.validate()?;
        Ok(c)
    }

    pub fn validate(&self) -> anyhow::Result<()> {
        anyhow::ensure!(!self.roots.is_empty(), "at least one root is needed");
        crate::export::check(&self.exports)?;
        anyhow::ensure!(
            self.exports.is_empty() || self.metrics_listen.is_some(),
            "[[export]] tables are served on the metrics listener: set metrics_listen"
        );
        for r in &self.roots {
            anyhow::ensure!(
                r.is_absolute(),
                "root {} must be an absolute path",
                r.display()
            );
        }
        anyhow::ensure!(
            self.tls.is_some() || self.listen.ip().is_loopback() || self.insecure,
            "refusing to serve plaintext on {}: configure [tls] (cert, key, client_ca), listen on a loopback address, or set insecure = true",
            self.listen
        );
        let l = &self.limits;
        anyhow::ensure!(
            l.max_dumps > 0
                && l.max_dumps_per_identity > 0
                && l.max_streams_per_connection > 0
                && l.max_connections > 0
                && l.max_lookups > 0
                && l.max_watches > 0
                && l.max_watches_per_identity > 0,
            "limits.max_dumps, max_dumps_per_identity, max_streams_per_connection, max_connections, max_lookups, max_watches and max_watches_per_identity must be at least 1"
        );
        anyhow::ensure!(
            [
                l.stall_timeout,
                l.handshake_timeout,
                l.idle_timeout,
                l.max_slot_hold
            ]
            .iter()
            .all(|d| *d >= Duration::from_secs(1)),
            "limits.stall_timeout, handshake_timeout, idle_timeout and max_slot_hold must be at least 1s"
        );
        anyhow::ensure!(
            l.min_watch_interval >= Duration::from_millis(100),
            "limits.min_watch_interval must be at least 100ms"
        );
        anyhow::ensure!(
            l.watch_history_scans >= 1,
            "limits.watch_history_scans must be at least 1"
        );
        anyhow::ensure!(
            l.max_queued_bytes >= 4 << 20 && l.max_queued_bytes <= u32::MAX as usize,
            "limits.max_queued_bytes must be between 4 MiB and 4 GiB"
        );
        anyhow::ensure!(
            l.max_message_bytes >= 4 << 20,
            "limits.max_message_bytes must be at least 4 MiB"
        );
        anyhow::ensure!(
            l.max_queued_bytes / 4 * 3 / l.max_dumps >= 64 << 10,
            "limits.max_queued_bytes ({}) leaves each of the {} dump slots less than 64 KiB (three quarters of it are shared out among them); raise max_queued_bytes to at least {} or lower max_dumps",
            l.max_queued_bytes,
            l.max_dumps,
            (64usize << 10) * l.max_dumps * 4 / 3 + 4
        );
        crate::access::Policy::new(&self.rules, self.tls.is_some())?;
        crate::maps::RenderRules::new(&self.render)?;
        crate::maps::TypeRules::new(&self.types)?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_are_humantime_and_the_old_seconds_still_work() {
        let c = Config::from_toml(
            "watch_files = \"0s\"\n[limits]\nstall_timeout = \"1m 30s\"\nidle_timeout = \"500ms\"\n",
        )
        .unwrap();
        assert_eq!(c.watch_files(), None);
        assert_eq!(c.limits.stall_timeout, Duration::from_secs(90));
        assert_eq!(c.limits.idle_timeout, Duration::from_millis(500));
        assert!(c.deprecated.is_empty());
        let e = c.validate().unwrap_err().to_string();
        assert!(e.contains("at least 1s"), "{e}");

        let c =
            Config::from_toml("watch_files_secs = 7\n[limits]\nshutdown_grace_secs = 3\n").unwrap();
        assert_eq!(c.watch_files(), Some(Duration::from_secs(7)));
        assert_eq!(c.limits.shutdown_grace, Duration::from_secs(3));
        assert_eq!(
            c.deprecated,
            [
                "watch_files_secs is deprecated: write watch_files = \"7s\" (durations like \"30s\", \"5m\")",
                "limits.shutdown_grace_secs is deprecated: write limits.shutdown_grace = \"3s\" (durations like \"30s\", \"5m\")",
            ]
        );

        // Even when the new spelling holds the default value.
        let e = Config::from_toml("[limits]\nstall_timeout = \"30s\"\nstall_timeout_secs = 5\n")
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("both limits.stall_timeout and limits.stall_timeout_secs"),
            "{e}"
        );
        let e = Config::from_toml("[limits]\nstall_timeout = \"soon\"\n")
            .unwrap_err()
            .to_string();
        assert!(e.contains("stall_timeout"), "{e}");
    }

    #[test]
    fn example_config_parses() {
        let text = include_str!("../../deploy/bpfmapd.toml");
        let c = Config::from_toml(text).unwrap();
        c.validate().unwrap();
        assert_eq!(c.listen, "127.0.0.1:50051".parse().unwrap());
        assert_eq!(c.roots, [PathBuf::from("/sys/fs/bpf")]);
        assert_eq!(c.limits, Limits::default());
        assert!(c.deprecated.is_empty(), "{:?}", c.deprecated);
        assert_eq!(c.watch_files, Config::default().watch_files);
        assert_eq!(c.metrics_listen, None);

        let text = include_str!("../../deploy/bpfmapd-mtls.toml");
        let c = Config::from_toml(text).unwrap();
        c.validate().unwrap();
        assert_eq!(
            c.tls.unwrap().client_ca,
            PathBuf::from("/etc/bpfmapd/client-ca.pem")
        );
        assert_eq!(c.rules.len(), 2);
        assert_eq!(c.limits.max_dumps_per_identity, 4);
        let policy = crate::access::Policy::new(&c.rules, true).unwrap();
        use crate::model::{Identity, MapRef, Operation::*};
        let collector =
            Identity::Spiffe("spiffe://example.org/ns/observability/sa/collector".into());
        let alice = Identity::Spiffe("spiffe://example.org/ns/ops/alice".into());
        let ct = MapRef::parse("tc/globals/cilium_ct4_global").unwrap();
        let abc = MapRef::parse("a/b/c").unwrap();
        assert!(policy.allows(&collector, Dump, &ct));
        assert!(!policy.allows(&collector, Lookup, &ct));
        assert!(policy.allows(&alice, Lookup, &abc));
        assert!(!policy.allows(&alice, Dump, &abc));
    }

    #[test]
    fn flags_override_the_file_and_unknown_keys_are_refused() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("c.toml");
        std::fs::write(&file, "listen = \"0.0.0.0:1\"\nallow_by_id = true\n").unwrap();
        let args = Args::parse_from([
            "bpfmapd",
            "--config",
            file.to_str().unwrap(),
            "--listen",
            "127.0.0.1:2",
            "--root",
            "/tmp/x",
        ]);
        let c = Config::from_args(&args).unwrap();
        assert_eq!(c.listen, "127.0.0.1:2".parse().unwrap());
        assert!(c.allow_by_id);
        assert_eq!(c.roots, [PathBuf::from("/tmp/x")]);
        assert!(Config::from_toml("lissten = \"x\"").is_err());
        // Plaintext off loopback needs `insecure`.
        let c = Config::from_toml("listen = \"0.0.0.0:1\"").unwrap();
        let e = c.validate().unwrap_err().to_string();
        assert!(e.contains("refusing to serve plaintext"), "{e}");
        Config {
            insecure: true,
            ..c
        }
        .validate()
        .unwrap();
        assert_eq!(
            Config::from_args(&Args::parse_from(["bpfmapd"])).unwrap(),
            Config::default()
        );
    }
}
