//! bpfmapd: a privileged per-host daemon that streams eBPF maps to remote
//! clients over gRPC, with batched kernel reads and resumable cursors.
//!
//! The binary is `bpfmapd`; this library is what it is made of, exposed for
//! the end-to-end tests and the benchmark: the configuration, the server
//! and the demo maps. Kernel access (every syscall and all unsafe code) is
//! the crate `bpfmap-kernel`.
//!
//! The modules, each a folder (or a file) whose first comment says what it
//! owns; `crate::` imports between them form no cycle (a test in the
//! `tests` crate checks). server/README.md is the map: the crates, these
//! folders, the path of one call.
//! - [`model`]: the shared value types (map references, identities,
//!   operations, RPC names); it uses no other module.
//! - `metrics`: the daemon's registry, which every part records into.
//! - `error`: what a call can fail with, in the daemon's terms (no gRPC).
//! - `config`: the command line and the configuration file.
//! - `cursor`: opaque, authenticated resume tokens; its key handling and
//!   sealing ([`SealingKeys`]) are what bpfmap-relay's fleet cursors use.
//! - `maps`: which maps are exposed, their types (BTF), the demo.
//! - `limits`: dump slots, memory shares and the pool, allocator trimming.
//! - `access`: the policy and the audit log.
//! - [`query`]: filters, the query of a dump, aggregate groups.
//! - `programs`: the walk programs run inside the kernel, cached per shape
//!   of map and question, bounded in kernel memory.
//! - `calls`: what every call starts from (authorization, the map opened,
//!   its layouts, its cursor, the blocking pool).
//! - `info`, `lookup`, `dump`, `aggregate`, `watch`, `drain`: one RPC's
//!   domain each.
//! - `wire`: domain values to `bpfmap.v1` messages, and the response stream
//!   a task of its own feeds.
//! - `export`: maps as Prometheus metrics (`[[export]]`), map pressure.
//! - `net`: connections, TLS, authentication of a connection's caller.
//! - `ops`: the metrics listener, reload, sd_notify, capabilities.
//! - `rpc`: the gRPC handlers, the mapping of errors to statuses, health.
//! - `daemon`: the composition root (start, stop, reload) and `main`.
//! - [`frontend`]: the listener, TLS, connection limits, callers, health
//!   and reflection, for the daemon and for servers built on it.
#![forbid(unsafe_code)]

mod access;
mod aggregate;
mod calls;
mod config;
mod cursor;
pub mod daemon;
mod drain;
mod dump;
mod error;
mod export;
pub mod frontend;
mod info;
mod limits;
mod lookup;
mod maps;
mod metrics;
pub mod model;
mod net;
mod ops;
mod programs;
pub mod query;
mod rpc;
mod stacks;
mod tables;
mod watch;
mod wire;

pub use access::RuleConfig;
pub use config::{Args, Config, DrainConfig, Limits, LogFormat};
pub use cursor::keys::{KeyError, KeyFiles, SealingKeys, Unsealed, binding_digest};
pub use daemon::{Running, check_privileges, prepare_roots, start, start_on};
pub use dump::DumpStats;
pub use export::{Buckets, ExportConfig, ExportConfigError, ExportKind, LabelNames};
pub use maps::{
    Demo, RenderConfig, TypesConfig, btf, flow_key, flow_types, flow_value, typed_flows,
};
pub use model::{FLIGHT_SERVICE_NAME, Operation, SERVICE_NAME, VERSION_HEADER};
pub use net::TlsFiles;
pub use rpc::FlightEncoder;

/// Rotates the cursor key in `state_dir` (see `bpfmapd --rotate-cursor-key`):
/// the current key becomes the previous one, whose cursors stay valid until
/// the next rotation, and a new key becomes current.
pub fn rotate_cursor_key(state_dir: &std::path::Path) -> anyhow::Result<()> {
    Ok(cursor::CursorKey::rotate(state_dir)?)
}
