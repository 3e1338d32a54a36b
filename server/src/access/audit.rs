//! One structured log record per RPC (target `bpfmapd::audit`): who, what,
//! on which map, how much, how it ended, how long it took.
//!
//! A call starts a [`Record`]; whoever ends the call finishes it: the handler
//! for unary calls, the dump stream for DumpMap. A record dropped without
//! being finished (the call's future was dropped because the client went
//! away) is logged as CANCELLED.
//!
//! Calls that fail cost a client nothing to make, so their lines are
//! bounded per peer address: at most [`FULL_LINES`] per [`INTERVAL`] are
//! written in full, and the rest are counted by status code and written as
//! one summary line per peer and interval (`"rpc lines held back"`, with
//! `calls` and `codes`). Successful calls are always written.

use std::{
    collections::{BTreeMap, HashMap},
    net::IpAddr,
    sync::{LazyLock, Mutex},
    time::{Duration, Instant},
};

use bpfmap_proto::v1 as pb;
use tonic::Code;

use crate::model::{Caller, MapRequest, Rpc, quote};

/// The audit record of one call.
#[derive(Debug)]
pub(crate) struct Record {
    caller: Caller,
    rpc: Rpc,
    map: String,
    started: Instant,
    entries: u64,
    finished: bool,
    /// Who a relay calls for, as it says (`bpfmap-on-behalf-of`): for the
    /// log only, never for a decision.
    on_behalf_of: Option<String>,
}

/// The header a relay names its own caller with.
pub(crate) const ON_BEHALF_OF: &str = "bpfmap-on-behalf-of";

impl Record {
    /// Starts the record of a call.
    pub(crate) fn start(caller: &Caller, rpc: Rpc) -> Self {
        Self {
            caller: caller.clone(),
            rpc,
            map: String::new(),
            started: Instant::now(),
            entries: 0,
            finished: false,
            on_behalf_of: None,
        }
    }

    /// Notes who the caller (a relay) says it calls for.
    pub(crate) fn on_behalf_of(&mut self, metadata: &tonic::metadata::MetadataMap) {
        self.on_behalf_of = metadata
            .get(ON_BEHALF_OF)
            .and_then(|v| v.to_str().ok())
            .map(quote);
    }

    /// The map the request names: its one text form when the reference is
    /// valid (`parsed`), else a bounded quote of what was sent (`sent`).
    pub(crate) fn request_map<E>(
        &mut self,
        parsed: &Result<MapRequest, E>,
        sent: Option<&pb::MapRef>,
    ) {
        self.map = match (parsed, sent.and_then(|r| r.r#ref.as_ref())) {
            (Ok(m), _) => m.to_string(),
            (Err(_), Some(pb::map_ref::Ref::Path(p))) => quote(p),
            (Err(_), _) => String::new(),
        };
    }

    /// When the call started.
    pub(crate) fn started(&self) -> Instant {
        self.started
    }

    /// Counts entries the client was given.
    pub(crate) fn add_entries(&mut self, n: u64) {
        self.entries += n;
    }

    /// Ends the record with the call's status code.
    pub(crate) fn finish(mut self, code: Code) {
        self.log(code);
        self.finished = true;
    }

    fn log(&self, code: Code) {
        if code != Code::Ok && !HELD_BACK.admit(origin_key(&self.caller), code) {
            return;
        }
        tracing::info!(
            target: "bpfmapd::audit",
            identity = %self.caller.identity,
            peer = self.caller.origin(),
            method = %self.rpc,
            map = %self.map,
            entries = self.entries,
            on_behalf_of = self.on_behalf_of.as_deref(),
            code = ?code,
            duration_ms = self.started.elapsed().as_secs_f64() * 1e3,
            "rpc"
        );
    }
}

impl Drop for Record {
    fn drop(&mut self) {
        if !self.finished {
            self.log(Code::Cancelled);
        }
    }
}

/// Lines of failed calls written in full per peer address and interval.
pub(crate) const FULL_LINES: u32 = 20;
/// The interval over which failed calls' lines are counted.
pub(crate) const INTERVAL: Duration = Duration::from_secs(10);
/// Peers tracked at once; beyond, every count is written out and forgotten.
const MAX_PEERS: usize = 4096;

/// Whose failed calls are counted together: a peer address (any port), or
/// a local process.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum Origin {
    Addr(IpAddr),
    Process(u32),
    Unknown,
}

impl std::fmt::Display for Origin {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Addr(ip) => write!(f, "{ip}"),
            Self::Process(pid) => write!(f, "pid:{pid}"),
            Self::Unknown => Ok(()),
        }
    }
}

fn origin_key(caller: &Caller) -> Origin {
    match (caller.peer, caller.process) {
        (Some(addr), _) => Origin::Addr(addr.ip()),
        (None, Some(pid)) => Origin::Process(pid),
        (None, None) => Origin::Unknown,
    }
}

static HELD_BACK: LazyLock<HeldBack> = LazyLock::new(HeldBack::default);

/// Writes the summaries of intervals that are over (call it every
/// [`INTERVAL`]: a peer that stopped calling still gets its summary).
pub(crate) fn flush_held_back() {
    HELD_BACK.flush(false);
}

/// Failed calls' lines per peer: how many were written in the current
/// interval, and how many held back, by code.
#[derive(Debug, Default)]
struct HeldBack {
    peers: Mutex<HashMap<Origin, PeerLines>>,
}

#[derive(Debug)]
struct PeerLines {
    since: Instant,
    written: u32,
    held: BTreeMap<&'static str, u64>,
}

impl HeldBack {
    /// Whether a failed call's line may be written; if not, it is counted.
    fn admit(&self, peer: Origin, code: Code) -> bool {
        let mut peers = self.peers.lock().expect("audit lock");
        if peers.len() >= MAX_PEERS && !peers.contains_key(&peer) {
            drain(&mut peers, true);
        }
        let lines = peers.entry(peer).or_insert_with(|| PeerLines {
            since: Instant::now(),
            written: 0,
            held: BTreeMap::new(),
        });
        if lines.since.elapsed() >= INTERVAL {
            lines.summarize(peer);
            lines.since = Instant::now();
            lines.written = 0;
        }
        if lines.written < FULL_LINES {
            lines.written += 1;
            return true;
        }
        *lines
            .held
            .entry(bpfmap_proto::status::code_name(code))
            .or_default() += 1;
        false
    }

    fn flush(&self, all: bool) {
        drain(&mut self.peers.lock().expect("audit lock"), all);
    }
}

/// Writes the summaries of the intervals that are over (all of them if
/// `all`), and forgets those peers.
fn drain(peers: &mut HashMap<Origin, PeerLines>, all: bool) {
    peers.retain(|peer, lines| {
        if !all && lines.since.elapsed() < INTERVAL {
            return true;
        }
        lines.summarize(*peer);
        false
    });
}

impl PeerLines {
    fn summarize(&mut self, peer: Origin) {
        if self.held.is_empty() {
            return;
        }
        let calls: u64 = self.held.values().sum();
        let codes = self
            .held
            .iter()
            .map(|(code, n)| format!("{code}={n}"))
            .collect::<Vec<_>>()
            .join(" ");
        tracing::info!(
            target: "bpfmapd::audit",
            peer = %peer,
            calls,
            codes,
            interval_s = self.since.elapsed().as_secs_f64().min(INTERVAL.as_secs_f64() * 2.0),
            "rpc lines held back"
        );
        self.held.clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn failed_calls_are_written_in_full_up_to_a_bound_per_peer() {
        let held = HeldBack::default();
        let a = Origin::Addr("10.0.0.1".parse().unwrap());
        let b = Origin::Process(7);
        let written = (0..100).filter(|_| held.admit(a, Code::Cancelled)).count();
        assert_eq!(written, FULL_LINES as usize);
        assert!(
            held.admit(b, Code::ResourceExhausted),
            "another peer has its own"
        );
        {
            let peers = held.peers.lock().unwrap();
            assert_eq!(peers[&a].held["CANCELLED"], 100 - u64::from(FULL_LINES));
        }
        // A new interval writes the summary and starts counting again.
        held.peers.lock().unwrap().get_mut(&a).unwrap().since -= INTERVAL;
        assert!(held.admit(a, Code::Cancelled));
        assert!(held.peers.lock().unwrap()[&a].held.is_empty());
        held.flush(true);
        assert!(held.peers.lock().unwrap().is_empty());
    }
}
