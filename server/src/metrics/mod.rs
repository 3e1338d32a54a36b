//! The daemon's own metrics: one prometheus-client registry, which every
//! part records into and the metrics listener (`ops::exposition`) encodes;
//! what the daemon's state says at each scrape is read by collectors the
//! composition root registers.
//!
//! gRPC calls in the usual naming (`grpc_server_started_total`,
//! `grpc_server_handled_total`, `grpc_server_handling_seconds`, labelled by
//! service, method and type), and the daemon's own under `bpfmapd_`. No label
//! carries an identity, a key, a value or a map path: every label's values
//! are a fixed set (an unknown RPC path is "unknown").

use std::{sync::Arc, time::Duration};

use prometheus_client::{
    collector::Collector,
    encoding::EncodeLabelSet,
    metrics::{
        counter::Counter,
        family::Family,
        histogram::{Histogram, exponential_buckets},
    },
    registry::Registry,
};

use crate::model::Rpc;

/// Why a TLS handshake failed (`reason` of bpfmapd_tls_handshake_failures).
pub(crate) const TLS_FAILURE_REASONS: [&str; 6] = [
    "bad_certificate",
    "alert_received",
    "protocol",
    "connection_closed",
    "timeout",
    "other",
];

/// Why the daemon closed a connection (`reason` of
/// bpfmapd_connections_closed).
pub(crate) const CLOSE_REASONS: [&str; 5] =
    ["limit", "silent", "idle", "stalled", "cancelled_calls"];

/// The labels of an RPC ("unknown" for a path that names none).
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RpcLabels {
    grpc_service: &'static str,
    grpc_method: &'static str,
    grpc_type: &'static str,
}

impl RpcLabels {
    fn of(rpc: Option<Rpc>) -> Self {
        match rpc {
            Some(r) => Self {
                grpc_service: r.service(),
                grpc_method: r.method(),
                grpc_type: r.kind().name(),
            },
            None => Self {
                grpc_service: "unknown",
                grpc_method: "unknown",
                grpc_type: "unknown",
            },
        }
    }
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct Handled {
    grpc_service: &'static str,
    grpc_method: &'static str,
    grpc_type: &'static str,
    grpc_code: &'static str,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct Reason {
    reason: &'static str,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct MethodLabel {
    grpc_method: &'static str,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct Outcome {
    result: &'static str,
}

type HistogramFamily = Family<RpcLabels, Histogram, fn() -> Histogram>;

fn handling_histogram() -> Histogram {
    // 100 µs to about 100 s.
    Histogram::new(exponential_buckets(0.0001, 4.0, 11))
}

#[derive(Debug)]
struct Inner {
    registry: Registry,
    started: Family<RpcLabels, Counter>,
    handled: Family<Handled, Counter>,
    handling: HistogramFamily,
    tls_failures: Family<Reason, Counter>,
    closed: Family<Reason, Counter>,
    denials: Family<MethodLabel, Counter>,
    reloads: Family<Outcome, Counter>,
    resumed: Counter,
}

/// The daemon's metrics; clones share them.
#[derive(Debug, Clone)]
pub(crate) struct Metrics(Arc<Inner>);

/// A metric family registered under `name`.
fn registered<L, M>(registry: &mut Registry, name: &str, help: &str) -> Family<L, M>
where
    Family<L, M>: Default + prometheus_client::registry::Metric + Clone,
{
    let family = Family::default();
    registry.register(name, help, family.clone());
    family
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new(Vec::new())
    }
}

impl Metrics {
    /// The daemon's metrics; `collectors` (the daemon's state, read at
    /// each scrape) are wired by the composition root.
    pub(crate) fn new(collectors: Vec<Box<dyn Collector>>) -> Self {
        let mut registry = Registry::default();
        for c in collectors {
            registry.register_collector(c);
        }
        let started: Family<RpcLabels, Counter> = registered(
            &mut registry,
            "grpc_server_started",
            "RPCs started on the server",
        );
        let handled: Family<Handled, Counter> = registered(
            &mut registry,
            "grpc_server_handled",
            "RPCs completed on the server, by status code",
        );
        let handling: HistogramFamily = Family::new_with_constructor(handling_histogram);
        registry.register(
            "grpc_server_handling_seconds",
            "Time from an RPC's start to its last message (seconds)",
            handling.clone(),
        );
        let tls_failures: Family<Reason, Counter> = registered(
            &mut registry,
            "bpfmapd_tls_handshake_failures",
            "TLS handshakes that failed, by reason",
        );
        let closed: Family<Reason, Counter> = registered(
            &mut registry,
            "bpfmapd_connections_closed",
            "Connections the daemon closed, by reason",
        );
        let denials: Family<MethodLabel, Counter> = registered(
            &mut registry,
            "bpfmapd_policy_denials",
            "Calls the policy denied (PERMISSION_DENIED), by method",
        );
        let reloads: Family<Outcome, Counter> = registered(
            &mut registry,
            "bpfmapd_reloads",
            "Configuration reloads, by result",
        );
        let resumed = Counter::default();
        registry.register(
            "bpfmapd_dumps_resumed",
            "Dumps started from a cursor",
            resumed.clone(),
        );
        // Every series with a known, fixed label set starts at 0, so that
        // rate() and alerts see it before its first event.
        for reason in TLS_FAILURE_REASONS {
            drop(tls_failures.get_or_create(&Reason { reason }));
        }
        for reason in CLOSE_REASONS {
            drop(closed.get_or_create(&Reason { reason }));
        }
        for rpc in [Rpc::ListMaps, Rpc::GetMap, Rpc::DumpMap, Rpc::Lookup] {
            drop(denials.get_or_create(&MethodLabel {
                grpc_method: rpc.method(),
            }));
            drop(started.get_or_create(&RpcLabels::of(Some(rpc))));
        }
        for result in ["ok", "failed"] {
            drop(reloads.get_or_create(&Outcome { result }));
        }
        Self(Arc::new(Inner {
            registry,
            started,
            handled,
            handling,
            tls_failures,
            closed,
            denials,
            reloads,
            resumed,
        }))
    }

    /// An RPC started.
    pub(crate) fn started(&self, rpc: Option<Rpc>) {
        self.0.started.get_or_create(&RpcLabels::of(rpc)).inc();
    }

    /// An RPC ended with `code` after `elapsed`.
    pub(crate) fn handled(&self, rpc: Option<Rpc>, code: tonic::Code, elapsed: Duration) {
        let rpc = RpcLabels::of(rpc);
        self.0
            .handled
            .get_or_create(&Handled {
                grpc_service: rpc.grpc_service,
                grpc_method: rpc.grpc_method,
                grpc_type: rpc.grpc_type,
                grpc_code: bpfmap_proto::status::code_name(code),
            })
            .inc();
        self.0
            .handling
            .get_or_create(&rpc)
            .observe(elapsed.as_secs_f64());
    }

    /// A TLS handshake failed.
    pub(crate) fn tls_failure(&self, reason: &'static str) {
        debug_assert!(TLS_FAILURE_REASONS.contains(&reason), "{reason}");
        self.0.tls_failures.get_or_create(&Reason { reason }).inc();
    }

    /// The daemon closed a connection.
    pub(crate) fn closed(&self, reason: &'static str) {
        debug_assert!(CLOSE_REASONS.contains(&reason), "{reason}");
        self.0.closed.get_or_create(&Reason { reason }).inc();
    }

    /// The policy denied a call.
    pub(crate) fn denied(&self, rpc: Rpc) {
        self.0
            .denials
            .get_or_create(&MethodLabel {
                grpc_method: rpc.method(),
            })
            .inc();
    }

    /// A reload was applied (`ok`) or rejected.
    pub(crate) fn reloaded(&self, ok: bool) {
        let result = if ok { "ok" } else { "failed" };
        self.0.reloads.get_or_create(&Outcome { result }).inc();
    }

    /// A dump started from a cursor.
    pub(crate) fn dump_resumed(&self) {
        self.0.resumed.inc();
    }

    /// The text exposition.
    pub(crate) fn encode(&self) -> String {
        let mut out = String::new();
        // Writing into a String does not fail.
        let _ = prometheus_client::encoding::text::encode(&mut out, &self.0.registry);
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rpc_paths_map_to_a_fixed_set_of_labels() {
        let r = RpcLabels::of(Rpc::of_path("/bpfmap.v1.MapService/DumpMap"));
        assert_eq!(
            (r.grpc_service, r.grpc_method, r.grpc_type),
            ("bpfmap.v1.MapService", "DumpMap", "server_stream")
        );
        let u = RpcLabels::of(Rpc::of_path("/evil/../../etc/passwd"));
        assert_eq!((u.grpc_service, u.grpc_method), ("unknown", "unknown"));
    }

    #[test]
    fn the_exposition_has_the_grpc_and_daemon_metrics() {
        let m = Metrics::new(Vec::new());
        let rpc = Rpc::of_path("/bpfmap.v1.MapService/Lookup");
        m.started(rpc);
        m.handled(rpc, tonic::Code::NotFound, Duration::from_millis(3));
        m.reloaded(false);
        let text = m.encode();
        assert!(text.contains("grpc_server_started_total{grpc_service=\"bpfmap.v1.MapService\",grpc_method=\"Lookup\",grpc_type=\"unary\"} 1"), "{text}");
        assert!(text.contains("grpc_code=\"NOT_FOUND\"} 1"), "{text}");
        assert!(
            text.contains("grpc_server_handling_seconds_bucket"),
            "{text}"
        );
        assert!(
            text.contains("bpfmapd_reloads_total{result=\"failed\"} 1"),
            "{text}"
        );
        assert!(text.ends_with("# EOF\n"), "{text}");
    }
}
