//! The value types every layer shares, and nothing else: how a map is
//! named ([`MapRef`], with path validation), who calls ([`Identity`],
//! [`Caller`]), what they ask to do ([`Operation`]), which RPC they call
//! ([`Rpc`]), and how request text is quoted in messages ([`quote`]).
//!
//! This is the leaf of the module tree: it uses no other module of the
//! daemon, so every layer above can point down to it.

mod declared;
mod identity;
mod map_ref;
mod quote;
mod rpc;

pub use declared::{Decl, Declared};
pub use identity::{Caller, Identity, Operation};
pub use map_ref::{InnerKey, InvalidPath, MapName, MapRef, MapRequest, Requested};
pub use quote::{MAX_QUOTE, quote};
pub use rpc::{FLIGHT_SERVICE_NAME, Rpc, RpcKind, SERVICE_NAME, VERSION_HEADER};
