//! One structured log record per RPC (target `bpfmapd::audit`): who, what,
//! on which map, how much, how it ended, how long it took.

use std::time::Instant;

use crate::auth::Caller;

pub fn record(
    caller: &Caller,
    method: &str,
    map: &str,
    entries: u64,
    code: tonic::Code,
    started: Instant,
) {
    tracing::info!(
        target: "bpfmapd::audit",
        identity = %caller.identity,
        peer = caller.peer.map(|p| p.to_string()).unwrap_or_default(),
        method,
        map,
        entries,
        code = ?code,
        duration_ms = started.elapsed().as_secs_f64() * 1e3,
        "rpc"
    );
}
