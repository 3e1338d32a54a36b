//! One structured log record per RPC (target `bpfmapd::audit`): who, what,
//! on which map, how much, how it ended, how long it took.
//!
//! A call starts a [`Record`]; whoever ends the call finishes it: the handler
//! for unary calls, the dump stream for DumpMap. A record dropped without
//! being finished (the call's future was dropped because the client went
//! away) is logged as CANCELLED.

use std::time::Instant;

use bpfmap_proto::v1 as pb;
use tonic::Code;

use crate::model::{Caller, MapRef, Rpc, quote};

/// The audit record of one call.
#[derive(Debug)]
pub(crate) struct Record {
    caller: Caller,
    rpc: Rpc,
    map: String,
    started: Instant,
    entries: u64,
    finished: bool,
}

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
        }
    }

    /// The map the request names: its one text form when the reference is
    /// valid (`parsed`), else a bounded quote of what was sent (`sent`).
    pub(crate) fn request_map<E>(&mut self, parsed: &Result<MapRef, E>, sent: Option<&pb::MapRef>) {
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
        tracing::info!(
            target: "bpfmapd::audit",
            identity = %self.caller.identity,
            peer = self.caller.peer.map(|p| p.to_string()).unwrap_or_default(),
            method = %self.rpc,
            map = %self.map,
            entries = self.entries,
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
