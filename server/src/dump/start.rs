//! A DumpMap call checked and ready to run: its cursor, its slot, its map,
//! its query, its decoding, its memory.

use std::{sync::Arc, time::Duration};

use bpfmap_kernel::{MapMeta, walk::Position};
use bpfmap_proto::v1 as pb;

use super::{DumpEnv, DumpJob, MAX_CHUNK, Options, kernel};
use crate::{
    calls::{Call, Calls},
    cursor::{Opened, Sealer},
    error::Error,
    limits::{Budget, Slot, Trimmer},
    maps::{Decoder, Decoding},
    model::{Caller, Declared, MapRef, MapRequest, Operation, Rpc},
    query::{MapLayout, Query, QueryRequest},
};

/// How long a call waits for room in the memory pool.
pub(crate) const POOL_WAIT: Duration = Duration::from_secs(2);

/// What dumps (and the calls that walk maps as dumps do) share beyond what
/// every call does.
#[derive(Debug, Clone)]
pub(crate) struct Dumps {
    /// Their slots, limits, stop signal and statistics.
    pub(crate) env: DumpEnv,
    /// The memory pool for what a dump's share cannot hold.
    pub(crate) pool: Budget,
    /// Dumps and lookups in flight (free memory is handed back when none
    /// are).
    pub(crate) trimmer: Trimmer,
}

/// A call that dumps a map: who calls, the map, the request, the RPC it
/// comes in (for the audit log, the metrics and denials), and whether its
/// records become a table (Arrow Flight: the map's types are read and its
/// renderings apply whatever the request's layout).
#[derive(Debug)]
pub(crate) struct DumpCall<'a> {
    pub(crate) caller: &'a Caller,
    pub(crate) map: MapRequest,
    pub(crate) req: pb::DumpMapRequest,
    pub(crate) rpc: Rpc,
    pub(crate) table: bool,
}

/// What a dump's records are: the layout they are read through (the
/// projection's with `fields`, else the map's with its renderings), the
/// map as named, and what the kernel says of it.
#[derive(Debug, Clone)]
pub(crate) struct Records {
    pub(crate) layout: MapLayout,
    pub(crate) map: MapRef,
    pub(crate) meta: MapMeta,
}

/// A DumpMap call checked: its cursor (before the map is touched: a bad
/// cursor is a bad request whatever state the map is in), its slot (before
/// the map: a dump that will be refused costs no trip to the kernel), the
/// map opened, its query, its decoding and its memory reserved.
pub(crate) async fn start(
    calls: &Calls,
    dumps: &Dumps,
    caller: &Caller,
    map: MapRequest,
    req: pb::DumpMapRequest,
) -> Result<DumpJob, Error> {
    let call = DumpCall {
        caller,
        map,
        req,
        rpc: Rpc::DumpMap,
        table: false,
    };
    start_call(calls, dumps, call).await
}

/// [`start`] for any call that dumps a map.
pub(crate) async fn start_call(
    calls: &Calls,
    dumps: &Dumps,
    call: DumpCall<'_>,
) -> Result<DumpJob, Error> {
    let caller = call.caller;
    let Prepared {
        layout,
        scan,
        opened,
        query,
        decoder,
        records,
        slot,
        cursor,
        req,
    } = prepare(calls, dumps, call).await?;
    let meta = records.meta.clone();
    let digest = query.as_ref().map(|q| q.digest());
    let key_order_digest = digest.map(kernel::key_order_digest);
    let (position, key_order_cursor) = match cursor {
        None => (Position::Start, false),
        Some(c) => {
            calls.metrics.dump_resumed();
            resume(c, &meta, scan, digest, key_order_digest)?
        }
    };
    let walk = kernel::WalkRequest {
        map: &opened.map,
        query: query.as_deref(),
        scan,
        position: &position,
        key_order_cursor,
    };
    let decided = kernel::decide(calls, dumps, opened.handle, &walk).await?;
    let keys = calls.keys.load_full();
    let sealer = Sealer::new(keys.as_ref().clone(), &caller.identity, &opened.map, &meta)
        .with_query(if decided.key_order {
            key_order_digest
        } else {
            digest
        });
    let options = Options {
        layout,
        decoder,
        chunk_hint: req.chunk_size,
        limit: req.limit,
        query,
        scan: decided.report,
    };
    let limits = &dumps.env.limits;
    let mut job = DumpJob::new(
        opened.map,
        decided.source,
        meta,
        position,
        options,
        sealer,
        limits,
    )?;
    job.reserve_memory(&dumps.pool, POOL_WAIT).await?;
    Ok(job.with_slot(slot).with_records(records))
}

/// What the records of a dump `req` of `map` are, without dumping: the map
/// resolved, its access checked and opened with its types (no slot taken).
pub(crate) async fn records(
    calls: &Calls,
    caller: &Caller,
    rpc: Rpc,
    map: MapRequest,
    req: &pb::DumpMapRequest,
) -> Result<Records, Error> {
    calls.accepting()?;
    let call = Call::new(Operation::Dump, rpc);
    let (map, declared) = calls.resolve(caller, call, map).await?;
    calls.authorize(caller, call, &map)?;
    let reading = Reading {
        caller,
        call,
        map,
        declared: &declared,
        req,
        table: true,
    };
    let read = read(calls, reading).await?;
    Ok(records_of(&read.opened, read.shown, read.query.as_deref()))
}

/// A dump call's map opened and its request read: what [`start_call`]
/// runs.
struct Prepared {
    layout: pb::Layout,
    scan: pb::ScanMethod,
    opened: crate::calls::Opened,
    query: Option<Arc<Query>>,
    decoder: Option<Decoder>,
    records: Records,
    slot: Slot,
    cursor: Option<Opened>,
    req: pb::DumpMapRequest,
}

/// Resolves the map, checks the request and its cursor, takes a slot,
/// opens the map and reads the request's query and decoding.
async fn prepare(calls: &Calls, dumps: &Dumps, call: DumpCall<'_>) -> Result<Prepared, Error> {
    calls.accepting()?;
    let DumpCall {
        caller,
        map,
        req,
        rpc,
        table,
    } = call;
    let call = Call::new(Operation::Dump, rpc);
    let (map, declared) = calls.resolve(caller, call, map).await?;
    let layout = layout_of(&req)?;
    let scan = kernel::scan_method(req.scan)?;
    let cursor = calls.cursor(&req.cursor, caller, &map)?;
    calls.authorize(caller, call, &map)?;
    let slot = dumps.env.slots.try_acquire(caller)?;
    let reading = Reading {
        caller,
        call,
        map,
        declared: &declared,
        req: &req,
        table,
    };
    let Read {
        opened,
        shown,
        query,
    } = read(calls, reading).await?;
    let decoder = decoder(&opened, &shown, query.as_deref(), &req)?;
    let records = records_of(&opened, shown, query.as_deref());
    Ok(Prepared {
        layout,
        scan,
        opened,
        query,
        decoder,
        records,
        slot,
        cursor,
        req,
    })
}

/// What opening a map for a dump reads with.
struct Reading<'a> {
    caller: &'a Caller,
    call: Call,
    map: MapRef,
    declared: &'a Declared,
    req: &'a pb::DumpMapRequest,
    /// The records become a table: types and renderings apply.
    table: bool,
}

/// A map opened for a dump: the layout its entries are shown with, and the
/// request's query.
struct Read {
    opened: crate::calls::Opened,
    shown: MapLayout,
    query: Option<Arc<Query>>,
}

/// Opens the map (with its types when anything is decoded) and reads the
/// request's renderings and query.
async fn read(calls: &Calls, reading: Reading<'_>) -> Result<Read, Error> {
    let Reading {
        caller,
        call,
        map,
        declared,
        req,
        table,
    } = reading;
    let packed = req.layout == pb::Layout::Packed as i32;
    let queried = !req.filter.is_empty() || !req.fields.is_empty();
    let decodes = !(packed || req.raw) || req.per_cpu != pb::PerCpu::Each as i32 || queried;
    let opened = calls
        .open(caller, call, map, declared, decodes || table)
        .await?;
    let meta = opened.handle.meta().clone();
    // Renderings show decoded entries, and give a query's literals and
    // fields their spellings: a packed or raw dump with neither has no use
    // for them.
    let shown = calls.layout(
        &opened,
        &req.render,
        !(packed || req.raw) || queried || table,
    )?;
    let reading = opened.types.reading(&shown);
    let request = QueryRequest {
        filter: &req.filter,
        fields: &req.fields,
        shown: &shown,
        reading: reading.as_deref(),
    };
    let query = Query::of_request(request, &meta)?.map(Arc::new);
    Ok(Read {
        opened,
        shown,
        query,
    })
}

/// The records a dump reads: its projection's, or the map's entries as
/// shown.
fn records_of(opened: &crate::calls::Opened, shown: MapLayout, query: Option<&Query>) -> Records {
    let layout = match query.and_then(|q| q.projection.as_ref()) {
        Some(p) => p.layout().clone(),
        None => shown,
    };
    Records {
        layout,
        map: opened.map.clone(),
        meta: opened.handle.meta().clone(),
    }
}

/// How a dump's entries are decoded: its projection's records, or the
/// map's entries as the request asks.
fn decoder(
    opened: &crate::calls::Opened,
    shown: &MapLayout,
    query: Option<&Query>,
    req: &pb::DumpMapRequest,
) -> Result<Option<Decoder>, Error> {
    let packed = req.layout == pb::Layout::Packed as i32;
    match query.and_then(|q| q.projection.as_ref()) {
        Some(p) => Ok(Decoder::projected(p, packed || req.raw)),
        None => {
            let asked = Decoding {
                raw: req.raw,
                per_cpu: req.per_cpu,
                packed,
            };
            let meta = opened.handle.meta();
            Decoder::for_request(&opened.map, meta, &opened.types, shown, asked)
        }
    }
}

/// Where a cursor resumes, and whether it comes from a dump in key-byte
/// order (walked inside the kernel with SCAN_KERNEL: it resumes only so).
/// `digests`: the query's binding, and that of a dump in key-byte order.
fn resume(
    cursor: Opened,
    meta: &MapMeta,
    scan: pb::ScanMethod,
    digest: Option<[u8; 16]>,
    key_order_digest: Option<[u8; 16]>,
) -> Result<(Position, bool), Error> {
    let key_order = key_order_digest.is_some() && cursor.check_query(key_order_digest).is_ok();
    if !key_order {
        cursor.check_query(digest)?;
    } else if scan != pb::ScanMethod::ScanKernel {
        return Err(Error::InvalidArgument(
            "this cursor comes from a dump walked inside the kernel (scan SCAN_KERNEL); resume it with the same scan".into(),
        ));
    }
    Ok((cursor.resume(meta)?, key_order))
}

/// The layout a dump asks for, and its chunk size checked.
fn layout_of(req: &pb::DumpMapRequest) -> Result<pb::Layout, Error> {
    let layout = pb::Layout::try_from(req.layout).map_err(|_| {
        Error::InvalidArgument(format!(
            "unknown layout {}; use LAYOUT_ENTRIES (0) or LAYOUT_PACKED (1)",
            req.layout
        ))
    })?;
    if req.chunk_size > MAX_CHUNK {
        return Err(Error::InvalidArgument(format!(
            "chunk_size {} is too large; use 1 to {MAX_CHUNK}, or 0 for the server's default (chunks as large as the dump's memory allows)",
            req.chunk_size,
        )));
    }
    Ok(layout)
}
