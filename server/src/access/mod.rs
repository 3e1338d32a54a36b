//! Access: the policy that says which identity may do which operation on
//! which map (deny by default), and the audit log of every call.
//! Authenticating a connection's caller is `net`'s; this module only
//! decides and records.

mod audit;
mod policy;

pub(crate) use audit::{INTERVAL as AUDIT_INTERVAL, Record, flush_held_back};
pub(crate) use policy::Policy;
pub use policy::RuleConfig;

/// The authorization policy in force (a reload replaces it).
pub(crate) type SharedPolicy = std::sync::Arc<arc_swap::ArcSwap<Policy>>;
