//! One structured log record per RPC (target `bpfmapd::audit`): who, what,
//! on which map, how much, how it ended, how long it took.
//!
//! A call starts a [`Record`]; whoever ends the call finishes it: the handler
//! for unary calls, the dump stream for DumpMap. A record dropped without
//! being finished (the call's future was dropped because the client went
//! away) is logged as CANCELLED.
#![forbid(unsafe_code)]

use std::{fmt, time::Instant};

use bpfmap_proto::v1 as pb;
use tonic::Code;

use crate::{auth::Caller, catalog::MapRef, error::quote};

/// The audited methods.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Method {
    /// MapService/ListMaps.
    ListMaps,
    /// MapService/GetMap.
    GetMap,
    /// MapService/DumpMap.
    DumpMap,
    /// MapService/Lookup.
    Lookup,
}

impl Method {
    /// The RPC's name ("DumpMap").
    pub fn name(self) -> &'static str {
        match self {
            Self::ListMaps => "ListMaps",
            Self::GetMap => "GetMap",
            Self::DumpMap => "DumpMap",
            Self::Lookup => "Lookup",
        }
    }
}

impl fmt::Display for Method {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// The audit record of one call.
#[derive(Debug)]
pub struct Record {
    caller: Caller,
    method: Method,
    map: String,
    started: Instant,
    entries: u64,
    finished: bool,
}

impl Record {
    /// Starts the record of a call.
    pub fn start(caller: &Caller, method: Method) -> Self {
        Self {
            caller: caller.clone(),
            method,
            map: String::new(),
            started: Instant::now(),
            entries: 0,
            finished: false,
        }
    }

    /// The map the request names: its one text form when the reference is
    /// valid, else a bounded quote of what was sent.
    pub fn request_map(&mut self, r: &Option<pb::MapRef>) {
        self.map = match r.as_ref().and_then(|r| r.r#ref.as_ref()) {
            Some(pb::map_ref::Ref::Path(p)) => match MapRef::parse(p) {
                Ok(m) => m.to_string(),
                Err(_) => quote(p),
            },
            Some(pb::map_ref::Ref::Id(id)) => MapRef::Id(*id).to_string(),
            None => String::new(),
        };
    }

    /// When the call started.
    pub fn started(&self) -> Instant {
        self.started
    }

    /// Counts entries the client was given.
    pub fn add_entries(&mut self, n: u64) {
        self.entries += n;
    }

    /// Ends the record with the call's status code.
    pub fn finish(mut self, code: Code) {
        self.log(code);
        self.finished = true;
    }

    fn log(&self, code: Code) {
        tracing::info!(
            target: "bpfmapd::audit",
            identity = %self.caller.identity,
            peer = self.caller.peer.map(|p| p.to_string()).unwrap_or_default(),
            method = %self.method,
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
