//! bpfmapd: a privileged per-host daemon that streams eBPF maps to remote
//! clients over gRPC, with batched kernel reads and resumable cursors.
//!
//! The binary is `bpfmapd`; this library is what it is made of, exposed for
//! the end-to-end tests and the benchmark: the configuration and the server,
//! and the [`kernel`] layer (reading maps, and creating the maps tests use).
//! All unsafe code lives in `kernel` (the syscall seam and the two handle
//! types that check buffers before calling it).
#![deny(unsafe_code)]

mod audit;
mod auth;
pub mod btf;
mod catalog;
mod config;
mod conn;
mod cursor;
pub mod daemon;
mod demo;
mod dump;
mod error;
mod health;
pub mod kernel;
mod limits;
mod metrics;
mod notify;
mod privileges;
mod proto;
mod reload;
mod server;
mod service;
mod tls;
mod typed;

pub use auth::{Operation, RuleConfig};
pub use config::{Args, Config, Limits, LogFormat};
pub use demo::{Demo, flow_key, flow_value, typed_flows};
pub use dump::DumpStats;
pub use server::{Running, SERVICE_NAME, check_privileges, prepare_roots, start, start_on};
pub use tls::TlsFiles;

/// Rotates the cursor key in `state_dir` (see `bpfmapd --rotate-cursor-key`):
/// the current key becomes the previous one, whose cursors stay valid until
/// the next rotation, and a new key becomes current.
pub fn rotate_cursor_key(state_dir: &std::path::Path) -> anyhow::Result<()> {
    Ok(cursor::CursorKey::rotate(state_dir)?)
}
