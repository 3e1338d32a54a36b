//! The maps: which are exposed and how clients name them (the catalog),
//! their key and value types (read from BTF and checked), how a call's
//! entries are decoded, and the demo maps.

mod bpftrace;
pub mod btf;
mod catalog;
mod declared;
mod demo;
mod holders;
mod render;
mod types;

pub(crate) use btf::TypeCache;
pub(crate) use catalog::{Catalog, Listed, Resolved};
pub(crate) use declared::TypeRules;
pub use declared::TypesConfig;
pub use demo::{Demo, flow_key, flow_types, flow_value, typed_flows};
pub(crate) use holders::{Holders, HoldersCache};
pub use render::RenderConfig;
pub(crate) use render::RenderRules;
pub(crate) use types::{Decoder, Decoding};
pub(crate) use types::{KnownTypes, MapTypes};
