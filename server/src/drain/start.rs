//! A DrainMap call checked: allowed, drainable, the map free of other
//! drains, its acknowledgement read, the map opened for writing, its spool
//! read and the acknowledgement applied.

use bpfmap_kernel::walk::Position;
use bpfmap_proto::v1 as pb;

use super::{DEFAULT_CHUNK, DrainCall, Drains, Spool, identity_digest, parse_position};
use crate::{
    calls::{Call, Calls, Opened, blocking},
    cursor::Sealer,
    dump::{Dumps, MAX_CHUNK},
    error::Error,
    maps::{Decoder, Decoding, KnownTypes, Resolved},
    model::{Caller, Declared, MapRef, MapRequest, Operation, Rpc},
};

/// What a drain chunk's cursor binds in place of a query: it is a drain's.
const DRAIN_CURSORS: [u8; 16] = *b"DrainMap chunks.";

/// A DrainMap call ready to run.
pub(crate) async fn start(
    calls: &Calls,
    drains: &std::sync::Arc<Drains>,
    dumps: &Dumps,
    caller: &Caller,
    map: MapRequest,
    req: pb::DrainMapRequest,
) -> Result<DrainCall, Error> {
    calls.accepting()?;
    let call = Call::new(Operation::Drain, Rpc::DrainMap);
    let (map, declared) = calls.resolve(caller, call, map).await?;
    calls.authorize(caller, call, &map)?;
    drains.check_drainable(&map)?;
    if req.chunk_size > MAX_CHUNK {
        return Err(Error::InvalidArgument(format!(
            "chunk_size {} is too large; use 1 to {MAX_CHUNK}, or 0 for the server's default",
            req.chunk_size,
        )));
    }
    let ack = acknowledged(calls, caller, &map, &req.ack)?;
    let busy = drains.start(&map).await?;
    let opened = open_writable(calls, drains, caller, map, &declared).await?;
    let meta = opened.handle.meta().clone();
    let layout = calls.layout(&opened, &Default::default(), !req.raw)?;
    let decoder = Decoder::for_request(
        &opened.map,
        &meta,
        &opened.types,
        &layout,
        Decoding {
            raw: req.raw,
            per_cpu: req.per_cpu,
            packed: false,
        },
    )?;
    let dir = drains.spool_dir(&opened.map);
    let (spool, acknowledged) = blocking(move || {
        let mut spool = Spool::open(&dir)?;
        let acknowledged = match ack {
            Some(seq) => spool.ack(seq).map_err(super::SpoolError::from)?,
            None => 0,
        };
        Ok((spool, acknowledged))
    })
    .await?;
    drains
        .stats
        .acknowledged
        .fetch_add(acknowledged, std::sync::atomic::Ordering::Relaxed);
    let keys = calls.keys.load_full();
    let sealer = Sealer::new(keys.as_ref().clone(), &caller.identity, &opened.map, &meta)
        .with_query(Some(DRAIN_CURSORS));
    Ok(DrainCall {
        identity: identity_digest(&caller.identity),
        map: opened.map,
        handle: opened.handle,
        meta,
        decoder,
        sealer,
        spool,
        acknowledged,
        limit: req.limit,
        chunk: match req.chunk_size {
            0 => DEFAULT_CHUNK,
            n => n,
        },
        max_spool_bytes: drains.max_spool_bytes,
        stats: drains.stats.clone(),
        stop: dumps.env.stop.clone(),
        stall_timeout: dumps.env.stall_timeout,
        _busy: busy,
    })
}

/// The sequence a request's `ack` acknowledges (none when empty);
/// INVALID_ARGUMENT for a cursor that is not a drain chunk's.
fn acknowledged(
    calls: &Calls,
    caller: &Caller,
    map: &MapRef,
    ack: &str,
) -> Result<Option<u64>, Error> {
    let Some(c) = calls.cursor(ack, caller, map)? else {
        return Ok(None);
    };
    let not_a_drain = || {
        Error::InvalidArgument(
            "ack is not a drain's cursor: acknowledge with the cursor of a DrainMap chunk".into(),
        )
    };
    c.check_query(Some(DRAIN_CURSORS))
        .map_err(|_| not_a_drain())?;
    match c.into_position() {
        Position::After(t) => parse_position(&t).map(Some).ok_or_else(not_a_drain),
        _ => Err(not_a_drain()),
    }
}

/// The map opened for writing, with its types; a symlink to another map
/// needs that map drainable and allowed too, and the map's type must be one
/// the kernel drains.
async fn open_writable(
    calls: &Calls,
    drains: &Drains,
    caller: &Caller,
    map: MapRef,
    declared: &Declared,
) -> Result<Opened, Error> {
    let (catalog, typer, r) = (calls.catalog.clone(), calls.typer(declared), map.clone());
    let (resolved, types): (Resolved, KnownTypes) = blocking(move || {
        let resolved = catalog.open_writable(&r)?;
        let types = typer.types(&r, resolved.handle.meta())?;
        Ok((resolved, types))
    })
    .await?;
    if let Some(target) = &resolved.target {
        drains.check_drainable(target)?;
        calls.authorize_target(
            caller,
            Call::new(Operation::Drain, Rpc::DrainMap),
            &map,
            target,
        )?;
    }
    let map_type = resolved.handle.meta().map_type;
    bpfmap_kernel::drain::drainable(map_type).map_err(|why| {
        Error::NotDrainable(format!(
            "map {map} cannot be drained: {why} (type {map_type})"
        ))
    })?;
    Ok(Opened {
        map,
        handle: resolved.handle,
        types,
        types_read: true,
    })
}
