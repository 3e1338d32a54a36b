//! bpfmapd: a privileged per-host daemon that streams eBPF maps to remote
//! clients over gRPC, with batched kernel reads and resumable cursors.

pub mod audit;
pub mod auth;
pub mod catalog;
pub mod config;
pub mod cursor;
pub mod demo;
pub mod dump;
pub mod error;
pub mod kernel;
pub mod limits;
pub mod privileges;
pub mod server;
pub mod service;
pub mod tls;

pub use config::Config;
pub use server::{Running, prepare_roots, start, start_on};
