//! Access: the policy that says which identity may do which operation on
//! which map (deny by default), and the audit log of every call.
//! Authenticating a connection's caller is `net`'s; this module only
//! decides and records.

mod audit;
mod policy;

pub(crate) use audit::{INTERVAL as AUDIT_INTERVAL, Record, flush_held_back};
pub use policy::RuleConfig;
pub use policy::{Policy, PolicyError};

/// The authorization policy in force (a reload replaces it).
pub(crate) type SharedPolicy = std::sync::Arc<arc_swap::ArcSwap<Policy>>;
