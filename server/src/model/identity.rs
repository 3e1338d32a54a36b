//! Who calls, and what they ask to do.
//!
//! An [`Identity`] is typed: a SPIFFE ID (URI SAN), a DNS name (DNS SAN), a
//! certificate subject CN, `anonymous` (plaintext TCP), or the user of a
//! local process on the Unix socket (from `SO_PEERCRED`). Its text form says
//! which: `spiffe://example.org/ops/alice`, `dns:bob.example.org`,
//! `cn:carol`, `anonymous`, `uid:1000`; policy patterns are written the
//! same way.

use std::{fmt, net::SocketAddr, sync::Arc};

use serde::Deserialize;

/// A verified caller identity.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Identity {
    /// A plaintext caller.
    Anonymous,
    /// A SPIFFE ID from a URI SAN (the whole URI, `spiffe://...`).
    Spiffe(Arc<str>),
    /// A DNS SAN.
    Dns(Arc<str>),
    /// The subject common name.
    Cn(Arc<str>),
    /// A local process on the Unix socket, by its user id (verified by the
    /// kernel: `SO_PEERCRED`).
    Uid(u32),
    /// The daemon itself, reading the maps its `[[export]]` tables name
    /// (never a caller's: no transport yields it).
    Daemon,
}

impl fmt::Display for Identity {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Anonymous => f.write_str("anonymous"),
            Self::Spiffe(uri) => f.write_str(uri),
            Self::Dns(name) => write!(f, "dns:{name}"),
            Self::Cn(name) => write!(f, "cn:{name}"),
            Self::Uid(uid) => write!(f, "uid:{uid}"),
            Self::Daemon => f.write_str("bpfmapd"),
        }
    }
}

/// The authenticated caller of a request.
#[derive(Debug, Clone)]
pub struct Caller {
    /// Who.
    pub identity: Identity,
    /// From where (TCP).
    pub peer: Option<SocketAddr>,
    /// The local process calling, on the Unix socket.
    pub process: Option<u32>,
}

impl Caller {
    /// Where the call comes from, for logs: the peer's address, or
    /// `pid:N` for a local process.
    pub fn origin(&self) -> String {
        match (self.peer, self.process) {
            (Some(addr), _) => addr.to_string(),
            (None, Some(pid)) => format!("pid:{pid}"),
            (None, None) => String::new(),
        }
    }
}

/// What a caller wants to do.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Operation {
    /// ListMaps and GetMap.
    List,
    /// DumpMap.
    Dump,
    /// Lookup.
    Lookup,
    /// AggregateMap: totals without the entries (implied by `dump`).
    Aggregate,
    /// DrainMap: read and delete (implied by nothing, never granted without
    /// a rule naming it).
    Drain,
    /// StackMap's frame names: read the host's kernel symbols and the
    /// binaries of its processes (implied by nothing).
    Symbolize,
}

impl Operation {
    /// The verb used in messages ("may not dump demo/flows").
    pub fn verb(self) -> &'static str {
        match self {
            Self::List => "list",
            Self::Dump => "dump",
            Self::Lookup => "look up keys in",
            Self::Aggregate => "aggregate",
            Self::Drain => "drain",
            Self::Symbolize => "name the stack frames of",
        }
    }
}
