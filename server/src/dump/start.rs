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
    limits::{Budget, Trimmer},
    maps::{Decoder, Decoding},
    model::{Caller, MapRequest, Operation, Rpc},
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
    calls.accepting()?;
    let (map, declared) = calls
        .resolve(caller, Call::new(Operation::Dump, Rpc::DumpMap), map)
        .await?;
    let layout = layout_of(&req)?;
    let scan = kernel::scan_method(req.scan)?;
    let cursor = calls.cursor(&req.cursor, caller, &map)?;
    let packed = layout == pb::Layout::Packed;
    let queried = !req.filter.is_empty() || !req.fields.is_empty();
    let decodes = !(packed || req.raw) || req.per_cpu != pb::PerCpu::Each as i32 || queried;
    let call = Call::new(Operation::Dump, Rpc::DumpMap);
    calls.authorize(caller, call, &map)?;
    let slot = dumps.env.slots.try_acquire(caller)?;
    let opened = calls.open(caller, call, map, &declared, decodes).await?;
    let meta = opened.handle.meta().clone();
    // Renderings show decoded entries, and give a query's literals and
    // fields their spellings: a packed or raw dump with neither has no use
    // for them.
    let shown = calls.layout(&opened, &req.render, !(packed || req.raw) || queried)?;
    let reading = opened.types.reading(&shown);
    let request = QueryRequest {
        filter: &req.filter,
        fields: &req.fields,
        shown: &shown,
        reading: reading.as_deref(),
    };
    let query = Query::of_request(request, &meta)?.map(Arc::new);
    let decoder = decoder(&opened, &shown, query.as_deref(), &req)?;
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
    let mut job = DumpJob::new(
        opened.map,
        decided.source,
        meta,
        position,
        options,
        sealer,
        &dumps.env.limits,
    )?;
    job.reserve_memory(&dumps.pool, POOL_WAIT).await?;
    Ok(job.with_slot(slot))
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
