//! The composition root: builds every part of the server from the
//! configuration, wires them together and starts the listeners (the main
//! one with MapService, health and reflection; the optional health-only
//! and metrics listeners).

use std::{
    net::SocketAddr,
    sync::{Arc, atomic::Ordering},
};

use anyhow::Context as _;
use arrow_flight::flight_service_server::FlightServiceServer;
use bpfmap_proto::v1::map_service_server::MapServiceServer;
use prometheus_client::{
    collector::Collector,
    encoding::{DescriptorEncoder, EncodeMetric},
    metrics::{counter::ConstCounter, gauge::ConstGauge},
};
use tokio::{net::TcpListener, sync::watch};
use tonic_health::{ServingStatus, server::HealthReporter};

use super::Running;
use crate::{
    access::{self, Policy, SharedPolicy},
    calls::Calls,
    config::{Config, Limits},
    cursor::{CursorKey, SharedKeys},
    drain::{DrainStats, Drains},
    dump::{DumpEnv, DumpLimits, DumpStats, Dumps, reader_permits},
    export::{ExportStats, Exporter, ExporterParts},
    limits::{Budget, DumpSlots, LookupSlots, Trimmer, split_memory},
    lookup::Lookups,
    maps::{Catalog, RenderRules},
    metrics::Metrics,
    model::{FLIGHT_SERVICE_NAME, SERVICE_NAME},
    net::{self, AcceptConfig, ConnRegistry, SharedTls},
    ops::{self, Exposition, Reloader},
    programs::WalkPrograms,
    rpc::{FlightServiceImpl, MapServiceImpl, ServiceParts},
    watch::{WatchLimits, WatchStats, Watches},
};

use crate::frontend::{self, Health, Listening, ServeTask};

/// The configured renderings; with the demo, its own first.
fn render_rules(config: &Config) -> anyhow::Result<RenderRules> {
    let demo = config.demo.then(crate::maps::Demo::renderings);
    let tables: Vec<_> = demo
        .into_iter()
        .chain(config.render.iter().cloned())
        .collect();
    Ok(RenderRules::new(&tables)?)
}

/// Checks the process has the capabilities this configuration needs, and
/// says which one is missing and what for.
pub fn check_privileges(config: &Config) -> anyhow::Result<()> {
    let must_mount = config.mount_bpffs
        && config
            .roots
            .iter()
            .any(|r| !r.exists() || !bpfmap_kernel::is_bpffs(r).unwrap_or(false));
    let effective = ops::effective().context("cannot read the capability set")?;
    let missing = ops::missing(
        effective,
        ops::unprivileged_bpf_allowed(),
        config.allow_by_id,
        must_mount,
    );
    if !missing.is_empty() {
        let all: Vec<String> = missing
            .iter()
            .map(|m| format!("{} (needed for {})", m.capability, m.needed_for))
            .collect();
        anyhow::bail!("missing capability: {}", all.join("; "));
    }
    Ok(())
}

/// Makes sure every root is a mounted bpffs, mounting one if allowed.
pub fn prepare_roots(config: &Config) -> anyhow::Result<()> {
    for root in &config.roots {
        if root.exists() && bpfmap_kernel::is_bpffs(root).unwrap_or(false) {
            continue;
        }
        anyhow::ensure!(
            config.mount_bpffs,
            "{} is not a mounted bpffs (mount it with `mount -t bpf bpf {0}`, or allow mount_bpffs)",
            root.display()
        );
        std::fs::create_dir_all(root)
            .with_context(|| format!("cannot create {}", root.display()))?;
        bpfmap_kernel::mount_bpffs(root).with_context(|| {
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

/// What reloads replace: the cursor keys, the TLS configuration, the
/// policy.
struct Reloadable {
    keys: SharedKeys,
    tls: Option<SharedTls>,
    policy: SharedPolicy,
}

impl Reloadable {
    fn load(config: &Config) -> anyhow::Result<Self> {
        let keys = CursorKey::load_or_create(&config.state_dir)?;
        let tls = match &config.tls {
            Some(files) => Some(Arc::new(arc_swap::ArcSwap::new(crate::net::server_config(
                files,
            )?))),
            None => None,
        };
        let policy = Policy::new(&config.rules, tls.is_some())?;
        warn_about_access(config, &policy, tls.is_some());
        Ok(Self {
            keys: Arc::new(arc_swap::ArcSwap::from_pointee(keys)),
            tls,
            policy: Arc::new(arc_swap::ArcSwap::from_pointee(policy)),
        })
    }
}

/// Says at start what the access settings let through.
fn warn_about_access(config: &Config, policy: &Policy, tls: bool) {
    if !tls {
        if config.insecure && !config.listen.ip().is_loopback() {
            tracing::warn!(listen = %config.listen, "serving PLAINTEXT on a non-loopback address (insecure = true): anyone who can reach it reads the exposed maps");
        } else if policy.is_open() {
            tracing::warn!(
                "plaintext on loopback without rules: every local user can read every exposed map; configure [tls] and [[rule]] for anything else"
            );
        }
    } else if config.rules.is_empty() {
        tracing::warn!("TLS is on but no [[rule]] is configured: every request will be denied");
    }
    if let Some(off) = ops::effective().ok().and_then(ops::typed_maps_off) {
        tracing::warn!(
            "no {}: {} (the systemd drop-in cap-sys-admin.conf adds it: /usr/share/doc/bpfmapd/examples/bpfmapd.service.d/ of the package, deploy/systemd/bpfmapd.service.d/ of the source)",
            off.capability,
            off.needed_for
        );
    }
}

/// The signals of a stop: `draining` when the server stops taking calls,
/// `stop_dumps` when dumps in flight must end.
struct Stopping {
    draining: watch::Sender<bool>,
    stop_dumps: watch::Sender<bool>,
}

impl Stopping {
    fn new() -> Self {
        Self {
            draining: watch::channel(false).0,
            stop_dumps: watch::channel(false).0,
        }
    }

    /// Resolves once `signal` is set.
    fn when(signal: &watch::Sender<bool>) -> impl Future<Output = ()> + Send + 'static {
        let mut rx = signal.subscribe();
        async move {
            let _ = rx.wait_for(|s| *s).await;
        }
    }
}

/// The state every part shares: dump counters, slots, connections,
/// metrics, and the memory split.
struct Core {
    stats: Arc<DumpStats>,
    slots: Arc<DumpSlots>,
    conns: ConnRegistry,
    metrics: Metrics,
    export_stats: ExportStats,
    budget: Budget,
    dump_limits: DumpLimits,
    readers: Arc<tokio::sync::Semaphore>,
    watch_stats: Arc<WatchStats>,
    drain_stats: Arc<DrainStats>,
    programs: Arc<WalkPrograms>,
}

impl Core {
    fn new(limits: &Limits, kernel_scans: bool) -> Self {
        let stats = Arc::new(DumpStats::default());
        let slots = Arc::new(DumpSlots::new(
            limits.max_dumps,
            limits.max_dumps_per_identity,
        ));
        let conns = ConnRegistry::default();
        let watch_stats = Arc::new(WatchStats::default());
        let drain_stats = Arc::new(DrainStats::default());
        let programs = Arc::new(if kernel_scans {
            WalkPrograms::new(limits.max_kernel_scan_bytes)
        } else {
            WalkPrograms::disabled()
        });
        let export_stats = ExportStats::default();
        let live = Live {
            programs: programs.clone(),
            stats: stats.clone(),
            slots: slots.clone(),
            conns: conns.clone(),
            watches: watch_stats.clone(),
            drains: drain_stats.clone(),
        };
        let metrics = Metrics::new(vec![Box::new(live), Box::new(export_stats.clone())]);
        let (share, pool) = split_memory(limits.max_queued_bytes, limits.max_dumps);
        Self {
            stats,
            slots,
            conns,
            metrics,
            export_stats,
            budget: Budget::new(pool),
            readers: Arc::new(tokio::sync::Semaphore::new(reader_permits())),
            watch_stats,
            drain_stats,
            programs,
            dump_limits: DumpLimits {
                share,
                pool,
                max_message_bytes: limits.max_message_bytes,
            },
        }
    }

    fn service(
        &self,
        config: &Config,
        r: &Reloadable,
        stopping: &Stopping,
    ) -> anyhow::Result<(MapServiceImpl, Exporter)> {
        let limits = &config.limits;
        let catalog = Catalog::new(config.roots.clone(), config.allow_by_id);
        let trimmer = Trimmer::default();
        let calls = Calls {
            catalog: catalog.clone(),
            types: Arc::default(),
            renders: Arc::new(render_rules(config)?),
            declarations: Arc::new(crate::maps::TypeRules::new(&config.types)?),
            holders: Arc::default(),
            keys: r.keys.clone(),
            policy: r.policy.clone(),
            metrics: self.metrics.clone(),
            draining: stopping.draining.subscribe(),
            programs: self.programs.clone(),
        };
        let dumps = Dumps {
            env: DumpEnv {
                stop: stopping.stop_dumps.subscribe(),
                stats: self.stats.clone(),
                stall_timeout: limits.stall_timeout,
                limits: self.dump_limits,
                slots: self.slots.clone(),
                max_slot_hold: limits.max_slot_hold,
                max_filter_cost: limits.max_filter_cost,
                readers: self.readers.clone(),
            },
            pool: self.budget.clone(),
            trimmer: trimmer.clone(),
        };
        let watches = self.watches(limits, catalog, stopping);
        let exporter = Exporter::new(
            &config.exports,
            ExporterParts {
                calls: calls.clone(),
                dumps: dumps.clone(),
                max_groups: limits.max_groups,
                watches: watches.clone(),
                stats: self.export_stats.clone(),
            },
        )?;
        let service = MapServiceImpl::new(ServiceParts {
            calls,
            dumps,
            lookups: Lookups {
                slots: Arc::new(LookupSlots::new(limits.max_lookups)),
                pool: self.budget.clone(),
                trimmer,
                limits: self.dump_limits,
            },
            max_groups: limits.max_groups,
            watches: watches.clone(),
            drains: Drains::new(
                &config.drain.maps,
                &config.state_dir,
                limits.max_drain_spool_bytes,
                self.drain_stats.clone(),
            )?,
            symbols: Arc::new(
                crate::stacks::Symbols::start().context("cannot start the symbolizer's thread")?,
            ),
        });
        Ok((service, exporter))
    }

    /// The watches, within `limits`, of the maps `catalog` exposes.
    fn watches(&self, limits: &Limits, catalog: Catalog, stopping: &Stopping) -> Arc<Watches> {
        Watches::new(
            WatchLimits {
                min_interval: limits.min_watch_interval,
                max_bytes: limits.max_watch_bytes,
                history_scans: limits.watch_history_scans,
                history_bytes: limits.watch_history_bytes,
                max_watches: limits.max_watches,
                max_per_identity: limits.max_watches_per_identity,
                linger: limits.watch_linger,
                stall_timeout: limits.stall_timeout,
            },
            catalog,
            self.readers.clone(),
            stopping.draining.subscribe(),
            self.watch_stats.clone(),
        )
    }

    fn accept(&self, limits: &Limits, tls: Option<SharedTls>) -> AcceptConfig {
        frontend::accept_config(limits, tls, &self.metrics)
    }
}

/// Starts serving on an already bound listener.
pub async fn start_on(config: &Config, listener: TcpListener) -> anyhow::Result<Running> {
    config.validate()?;
    let addr = listener.local_addr()?;
    let reloadable = Reloadable::load(config)?;
    let stopping = Stopping::new();
    let limits = &config.limits;
    raise_fd_limit(limits.max_connections);
    let core = Core::new(limits, config.kernel_scans);
    let (service, exporter) = core.service(config, &reloadable, &stopping)?;
    let reporter = HealthReporter::new();
    set_health(&reporter, ServingStatus::Serving).await;
    let mut tasks = Vec::new();
    let health_addr = match config.health_listen {
        Some(listen) => Some(serve_health(listen, &reporter, &stopping, &mut tasks).await?),
        None => None,
    };
    let accept = core.accept(limits, reloadable.tls.clone());
    let unix = match &config.listen_unix {
        Some(path) => Some(net::bind_unix(path, config.listen_unix_group.as_deref())?),
        None => None,
    };
    let (unix_listener, unix_file) = unix.unzip();
    let health = Health {
        reporter: &reporter,
        services: &[SERVICE_NAME, FLIGHT_SERVICE_NAME],
    };
    let listening = Listening {
        listener,
        unix: unix_listener,
        routes: map_routes(service, limits, health, &stopping)?,
        limits,
        accept,
        health,
    };
    spawn_audit_flush(&stopping);
    spawn_program_sweep(core.programs.clone(), &stopping);
    tasks.push(frontend::serve_routes(
        listening,
        &stopping.draining,
        core.conns.clone(),
    ));
    let metrics_addr = match config.metrics_listen {
        Some(listen) => Some(serve_metrics(listen, config, &core, &exporter, &stopping).await?),
        None => None,
    };
    tracing::info!(
        %addr,
        unix = ?config.listen_unix,
        tls = reloadable.tls.is_some(),
        roots = ?config.roots,
        allow_by_id = config.allow_by_id,
        "bpfmapd listening"
    );
    Ok(Running {
        addr,
        health_addr,
        metrics_addr,
        stats: core.stats,
        reloader: Reloader {
            policy: reloadable.policy,
            tls: reloadable.tls,
            keys: reloadable.keys,
            state_dir: config.state_dir.clone(),
            metrics: core.metrics,
            exports: exporter,
        },
        watcher: None,
        seen: None,
        conns: core.conns,
        budget: core.budget,
        grace: limits.shutdown_grace,
        draining: stopping.draining,
        stop_dumps: stopping.stop_dumps,
        tasks,
        _unix: unix_file,
    })
}

async fn set_health(reporter: &HealthReporter, status: ServingStatus) {
    for name in [SERVICE_NAME, ""] {
        reporter.set_service_status(name, status).await;
    }
}

/// The plaintext health-only listener, until the dumps are cut.
async fn serve_health(
    listen: SocketAddr,
    reporter: &HealthReporter,
    stopping: &Stopping,
    tasks: &mut Vec<ServeTask>,
) -> anyhow::Result<SocketAddr> {
    let (addr, task) = frontend::serve_health(listen, reporter, &stopping.stop_dumps).await?;
    tasks.push(task);
    Ok(addr)
}

/// MapService, with health and reflection, as the main listener serves it.
fn map_routes(
    service: MapServiceImpl,
    limits: &Limits,
    health: Health<'_>,
    stopping: &Stopping,
) -> anyhow::Result<tonic::service::Routes> {
    let flight = FlightServiceServer::new(FlightServiceImpl::new(service.parts()))
        .max_decoding_message_size(limits.max_request_bytes)
        .max_encoding_message_size(limits.max_message_bytes + (64 << 10));
    let map_service = MapServiceServer::new(service)
        .max_decoding_message_size(limits.max_request_bytes)
        .max_encoding_message_size(limits.max_message_bytes + (64 << 10));
    let routes = tonic::service::Routes::new(frontend::authenticated(map_service))
        .add_service(frontend::authenticated(flight));
    frontend::with_health_and_reflection(
        routes,
        health,
        &[
            bpfmap_proto::v1::FILE_DESCRIPTOR_SET,
            bpfmap_proto::v1::FLIGHT_FILE_DESCRIPTOR_SET,
        ],
        stopping.stop_dumps.subscribe(),
    )
}

/// The audit lines of failed calls held back: summaries written each
/// interval, and once more at the end (when draining starts).
fn spawn_audit_flush(stopping: &Stopping) {
    let stopped = Stopping::when(&stopping.draining);
    tokio::spawn(async move {
        let mut every = tokio::time::interval(access::AUDIT_INTERVAL);
        tokio::pin!(stopped);
        loop {
            tokio::select! {
                _ = every.tick() => access::flush_held_back(),
                _ = &mut stopped => return access::flush_held_back(),
            }
        }
    });
}

/// Unloads the walk programs left unused for their idle time, every
/// minute, until the daemon stops: a program no call uses does not stay
/// until the next one loads.
fn spawn_program_sweep(programs: Arc<WalkPrograms>, stopping: &Stopping) {
    let stopped = Stopping::when(&stopping.draining);
    tokio::spawn(async move {
        let mut every = tokio::time::interval(std::time::Duration::from_secs(60));
        tokio::pin!(stopped);
        loop {
            tokio::select! {
                _ = every.tick() => programs.sweep(),
                _ = &mut stopped => return,
            }
        }
    });
}

/// The Prometheus endpoint on `listen`: the registry and the exports'
/// series, and the maps' fill levels read in the background.
async fn serve_metrics(
    listen: SocketAddr,
    config: &Config,
    core: &Core,
    exporter: &Exporter,
    stopping: &Stopping,
) -> anyhow::Result<SocketAddr> {
    if !config.map_pressure_interval.is_zero() {
        exporter.spawn_pressure(
            config.map_pressure_interval,
            stopping.stop_dumps.subscribe(),
        );
    }
    let exposition = Exposition {
        metrics: core.metrics.clone(),
        exports: Some(exporter.clone()),
    };
    let listener = TcpListener::bind(listen)
        .await
        .with_context(|| format!("cannot listen on {listen} (metrics_listen)"))?;
    let addr = listener.local_addr()?;
    tokio::spawn(exposition.serve(listener, stopping.stop_dumps.subscribe()));
    Ok(addr)
}

/// Raises the open-file limit to its maximum, and warns when it stays too
/// low for `max_connections` (every connection is a descriptor).
fn raise_fd_limit(max_connections: usize) {
    match rlimit::increase_nofile_limit(u64::MAX) {
        Ok(limit) if limit < max_connections as u64 + 64 => tracing::warn!(
            limit,
            max_connections,
            "the open-file limit is below limits.max_connections + 64: new connections will fail before the connection limit is reached"
        ),
        Ok(_) => {}
        Err(e) => tracing::warn!(error = %e, "cannot read or raise the open-file limit"),
    }
}

/// What the metrics read from the daemon at each scrape: the dumps'
/// counters, the dump slots, the open connections.
#[derive(Debug)]
struct Live {
    stats: Arc<DumpStats>,
    slots: Arc<DumpSlots>,
    conns: ConnRegistry,
    watches: Arc<WatchStats>,
    drains: Arc<DrainStats>,
    programs: Arc<WalkPrograms>,
}

impl Live {
    /// The counters of walks inside the kernel: name, help, value.
    fn walk_program_counters(&self) -> [(&'static str, &'static str, u64); 4] {
        let s = &self.programs.stats;
        [
            (
                "bpfmapd_kernel_scans",
                "Aggregates computed by a program walking the map inside the kernel",
                s.runs.load(Ordering::Relaxed),
            ),
            (
                "bpfmapd_kernel_scan_fallbacks",
                "Aggregates that could have walked the map inside the kernel and read it in batches (the kernel, the map type, the question)",
                s.fallbacks.load(Ordering::Relaxed),
            ),
            (
                "bpfmapd_kernel_scan_programs_loaded",
                "Scan programs loaded (accepted by the verifier)",
                s.loads.load(Ordering::Relaxed),
            ),
            (
                "bpfmapd_kernel_scan_programs_refused",
                "Scan programs the kernel's verifier refused",
                s.refusals.load(Ordering::Relaxed),
            ),
        ]
    }

    /// The drains' counters: name, help, value.
    fn drain_counters(&self) -> [(&'static str, &'static str, u64); 4] {
        let d = &self.drains;
        [
            (
                "bpfmapd_drain_entries",
                "Entries read and deleted from kernel maps by drains",
                d.drained.load(Ordering::Relaxed),
            ),
            (
                "bpfmapd_drain_spooled_entries",
                "Drained entries written (durably) to spools",
                d.spooled.load(Ordering::Relaxed),
            ),
            (
                "bpfmapd_drain_redelivered_entries",
                "Spooled entries sent again (not acknowledged before)",
                d.redelivered.load(Ordering::Relaxed),
            ),
            (
                "bpfmapd_drain_acknowledged_entries",
                "Spooled entries acknowledged by clients and removed",
                d.acknowledged.load(Ordering::Relaxed),
            ),
        ]
    }

    /// The watches' counters: name, help, value.
    fn watch_counters(&self) -> [(&'static str, &'static str, u64); 3] {
        let w = &self.watches;
        [
            (
                "bpfmapd_watch_scans",
                "Walks of watched maps (one per map and interval, whatever the number of watchers)",
                w.scans.load(Ordering::Relaxed),
            ),
            (
                "bpfmapd_watch_events",
                "Events and groups sent to watchers",
                w.events.load(Ordering::Relaxed),
            ),
            (
                "bpfmapd_watch_resyncs",
                "Watches that started again from a fresh state (a cursor too old, a daemon restart, a watcher behind)",
                w.resyncs.load(Ordering::Relaxed),
            ),
        ]
    }

    /// The dumps' counters: name, help, value.
    fn dump_counters(&self) -> [(&'static str, &'static str, u64); 8] {
        let s = &self.stats;
        [
            (
                "bpfmapd_dump_entries",
                "Entries handed to clients by dumps",
                s.entries_sent.load(Ordering::Relaxed),
            ),
            (
                "bpfmapd_dump_bytes",
                "Bytes of dump messages handed to clients",
                s.bytes_sent.load(Ordering::Relaxed),
            ),
            (
                "bpfmapd_kernel_batch_calls",
                "BPF_MAP_LOOKUP_BATCH calls made",
                s.batch_calls.load(Ordering::Relaxed),
            ),
            (
                "bpfmapd_enospc_retries",
                "Batch calls retried with a larger batch after ENOSPC",
                s.enospc.load(Ordering::Relaxed),
            ),
            (
                "bpfmapd_stalled_clients",
                "Dumps ended because the client took no chunk for the stall timeout",
                s.stalled.load(Ordering::Relaxed),
            ),
            (
                "bpfmapd_dump_slots_expired",
                "Dumps ended because they held their slot too long while others waited",
                s.slots_expired.load(Ordering::Relaxed),
            ),
            (
                "bpfmapd_walk_restarts",
                "Times a walk found the kernel had restarted it from the first key",
                s.walk_restarts.load(Ordering::Relaxed),
            ),
            (
                "bpfmapd_dump_slots_refused",
                "Dumps refused a slot (RESOURCE_EXHAUSTED)",
                self.slots.refused(),
            ),
        ]
    }

    /// The gauges: name, help, value.
    fn gauges(&self) -> [(&'static str, &'static str, i64); 8] {
        let s = &self.stats;
        let w = &self.watches;
        [
            (
                "bpfmapd_watchers",
                "WatchMap calls open",
                w.watchers.load(Ordering::Relaxed) as i64,
            ),
            (
                "bpfmapd_watched_maps",
                "Maps (and intervals) being scanned for watches",
                w.scanners.load(Ordering::Relaxed) as i64,
            ),
            (
                "bpfmapd_watch_bytes",
                "Bytes held for watches (entries and recent changes), against limits.max_watch_bytes",
                w.bytes.load(Ordering::Relaxed) as i64,
            ),
            (
                "bpfmapd_streams_active",
                "Dumps whose producer is running",
                s.active.load(Ordering::Relaxed) as i64,
            ),
            (
                "bpfmapd_dump_slots_in_use",
                "Dump slots held",
                self.slots.in_use() as i64,
            ),
            (
                "bpfmapd_connections_open",
                "Connections open on the main listener",
                self.conns.len() as i64,
            ),
            (
                "bpfmapd_kernel_scan_programs",
                "Walk programs kept loaded now (they hold no map they walked)",
                self.programs.loaded() as i64,
            ),
            (
                "bpfmapd_kernel_scan_program_bytes",
                "Kernel memory the walk programs kept loaded hold, against limits.max_kernel_scan_bytes",
                self.programs.bytes() as i64,
            ),
        ]
    }
}

impl Collector for Live {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let counters = self
            .drain_counters()
            .into_iter()
            .chain(self.watch_counters())
            .chain(self.walk_program_counters())
            .chain(self.dump_counters());
        for (name, help, value) in counters {
            let c = ConstCounter::new(value);
            c.encode(encoder.encode_descriptor(name, help, None, c.metric_type())?)?;
        }
        for (name, help, value) in self.gauges() {
            let g = ConstGauge::new(value);
            g.encode(encoder.encode_descriptor(name, help, None, g.metric_type())?)?;
        }
        Ok(())
    }
}
