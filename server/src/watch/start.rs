//! A WatchMap call checked: what it asks (filter, fields or groups, its
//! decoding and counters), where its cursor resumes, its place among the
//! watches, and its map's first scan made (so that a map too large to
//! watch is refused with a status, before any message).

use std::{sync::Arc, time::Duration};

use bpfmap_kernel::{MapMeta, walk::Position};
use bpfmap_proto::v1 as pb;

use super::{ScanKey, Ticket, Watch, Watches, parse_position};
use crate::{
    calls::{Call, Calls, Opened},
    cursor::{CursorError, Sealer},
    error::Error,
    maps::{Decoder, Decoding},
    model::{Caller, MapRequest, Operation, Rpc},
    query::{Counter, Filter, Projection, Query, QueryRequest, Spec},
};

/// What a watch shows of each entry: how entries are decoded, the integer
/// members deltas are computed of, the projection and the description of
/// its records.
struct View {
    decoder: Option<Decoder>,
    counters: Vec<Counter>,
    projection: Option<Projection>,
    projected: Option<MapMeta>,
}

/// A WatchMap call checked and joined to its map's scanner.
pub(crate) async fn start(
    calls: &Calls,
    watches: &Arc<Watches>,
    max_groups: usize,
    caller: &Caller,
    map: MapRequest,
    req: pb::WatchMapRequest,
) -> Result<(Watch, Ticket), Error> {
    calls.accepting()?;
    let interval = watches.interval(req.interval.as_ref())?;
    let aggregated = check(&req)?;
    let op = if aggregated {
        Operation::Aggregate
    } else {
        Operation::Dump
    };
    let (map, declared) = calls
        .resolve(caller, Call::new(op, Rpc::WatchMap), map)
        .await?;
    let cursor = calls.cursor(&req.cursor, caller, &map)?;
    let opened = calls
        .open(caller, Call::new(op, Rpc::WatchMap), map, &declared, true)
        .await?;
    let meta = opened.handle.meta().clone();
    // A map that cannot be iterated is refused now.
    bpfmap_kernel::walk::Walker::new(&opened.handle, meta.clone(), Position::Start)
        .map_err(|e| Error::from_walk(&opened.map, e))?;
    let (filter, view) = view(calls, &opened, &req)?;
    let aggregate = match aggregated {
        true => Some(spec(calls, &opened, &req, max_groups)?),
        false => None,
    };
    let shown = calls.layout(&opened, &req.render, !req.raw)?;
    let reading = opened.types.reading(&shown);
    let digest = digest(&req, interval, reading.as_deref());
    let (resume, resync) = match cursor {
        Some(c) => {
            c.check_query(Some(digest))?;
            position(c.resume(&meta))?
        }
        None => (None, None),
    };
    let keys = calls.keys.load_full();
    let sealer = Sealer::new(keys.as_ref().clone(), &caller.identity, &opened.map, &meta)
        .with_query(Some(digest));
    let ticket = first_scan(watches, caller, &opened, interval).await?;
    let watch = Watch {
        meta,
        filter,
        projection: view.projection,
        projected: view.projected,
        decoder: view.decoder,
        counters: view.counters,
        aggregate,
        sealer,
        resume,
        resync,
        stall_timeout: watches.limits.stall_timeout,
        events_key: events_key(&req),
    };
    Ok((watch, ticket))
}

/// Whether the watch is aggregated; INVALID_ARGUMENT for a request that
/// mixes what cannot go together.
fn check(req: &pb::WatchMapRequest) -> Result<bool, Error> {
    let aggregated = !req.group_by.is_empty() || !req.aggregates.is_empty();
    if aggregated && !req.fields.is_empty() {
        return Err(Error::InvalidArgument(
            "fields select members of entries; an aggregated watch (group_by, aggregates) sends groups: use one or the other".into(),
        ));
    }
    if aggregated && req.aggregates.is_empty() {
        return Err(Error::InvalidArgument(
            "group_by needs at least one aggregate ({\"op\":\"SUM\",\"field\":\"value.bytes\"})"
                .into(),
        ));
    }
    Ok(aggregated)
}

/// The watch's filter, and what it shows of each entry.
fn view(
    calls: &Calls,
    opened: &Opened,
    req: &pb::WatchMapRequest,
) -> Result<(Option<Filter>, View), Error> {
    let meta = opened.handle.meta();
    let base = calls.query_layout(opened)?;
    let shown = calls.layout(opened, &req.render, !req.raw)?;
    let reading = opened.types.reading(&shown);
    let query = Query::of_request(
        QueryRequest {
            filter: &req.filter,
            fields: &req.fields,
            shown: &shown,
            reading: reading.as_deref(),
        },
        meta,
    )?;
    let (filter, projection) = match query {
        Some(q) => (q.filter, q.projection),
        None => (None, None),
    };
    let view = match projection {
        Some(p) => {
            let mut decoder = Decoder::projected(&p, req.raw);
            let mut projected = crate::query::projected_meta(meta, &p);
            if !p.selects_key() {
                // No member of the key selected: events still say which
                // entry changed, with the whole key.
                projected.key_size = meta.key_size;
                let layout = calls.layout(opened, &req.render, !req.raw)?;
                let key = layout.typed().then(|| layout.key_arc().clone());
                decoder = decoder.map(|d| d.with_key(key));
            }
            View {
                decoder,
                counters: p.counters(),
                projection: Some(p),
                projected: Some(projected),
            }
        }
        None => {
            let layout = calls.layout(opened, &req.render, !req.raw)?;
            let decoder = Decoder::for_request(
                &opened.map,
                meta,
                &opened.types,
                &layout,
                Decoding {
                    raw: req.raw,
                    per_cpu: req.per_cpu,
                    packed: false,
                },
            )?;
            View {
                decoder,
                counters: base.counters(),
                projection: None,
                projected: None,
            }
        }
    };
    Ok((filter, view))
}

/// An aggregated watch's groups and aggregates.
fn spec(
    calls: &Calls,
    opened: &Opened,
    req: &pb::WatchMapRequest,
    max_groups: usize,
) -> Result<Spec, Error> {
    let shown = calls.layout(opened, &req.render, true)?;
    let groups = pb::AggregateMapRequest {
        group_by: req.group_by.clone(),
        aggregates: req.aggregates.clone(),
        per_cpu: req.per_cpu,
        ..Default::default()
    };
    Ok(Spec::new(&groups, &shown, max_groups)?)
}

/// Where a watch cursor resumes: the scanner's epoch and revision, or why
/// the watch must start again from the map's state.
type Resume = (Option<(u64, u64)>, Option<String>);

/// The resume point of a watch's cursor, as its opening gave it.
fn position(opened: Result<Position, CursorError>) -> Result<Resume, Error> {
    let not_a_watch = || {
        Error::InvalidArgument(
            "this cursor is a dump's, not a watch's: resume a watch with the cursor of one of its bookmarks".into(),
        )
    };
    match opened {
        Ok(Position::After(token)) => {
            Ok((Some(parse_position(&token).ok_or_else(not_a_watch)?), None))
        }
        Ok(_) => Err(not_a_watch()),
        Err(CursorError::MapReplaced { detail, .. }) => Ok((
            None,
            Some(format!(
                "the map was replaced since this cursor was issued ({detail})"
            )),
        )),
        Err(e) => Err(e.into()),
    }
}

/// The watch's place among the watches, once its scanner has made its
/// first scan (or the failure that prevented it).
async fn first_scan(
    watches: &Arc<Watches>,
    caller: &Caller,
    opened: &Opened,
    interval: Duration,
) -> Result<Ticket, Error> {
    let meta = opened.handle.meta().clone();
    let key = ScanKey {
        map: opened.map.clone(),
        map_id: meta.id,
        interval,
    };
    let ticket = watches.join(caller, key, meta)?;
    let scanner = ticket.scanner().clone();
    let mut first = scanner.subscribe();
    let _ = first
        .wait_for(|&r| r > 0 || scanner.failure().is_some())
        .await;
    if let Some(f) = scanner.failure() {
        return Err(f.error());
    }
    Ok(ticket)
}

/// A digest of length-framed parts.
fn framed(parts: impl FnOnce(&mut dyn FnMut(&[u8]))) -> [u8; 16] {
    let mut ctx = ring::digest::Context::new(&ring::digest::SHA256);
    parts(&mut |b: &[u8]| {
        ctx.update(&(b.len() as u64).to_le_bytes());
        ctx.update(b);
    });
    let mut out = [0u8; 16];
    out.copy_from_slice(&ctx.finish().as_ref()[..16]);
    out
}

/// What decides a watch's events: watches with the same share them.
fn events_key(req: &pb::WatchMapRequest) -> [u8; 16] {
    framed(|put| {
        put(req.filter.as_bytes());
        for f in &req.fields {
            put(f.as_bytes());
        }
        put(b"|");
        put(&req.per_cpu.to_le_bytes());
        put(&[u8::from(req.raw)]);
        let render: std::collections::BTreeMap<_, _> = req.render.iter().collect();
        for (k, v) in render {
            put(k.as_bytes());
            put(v.as_bytes());
        }
    })
}

/// What a watch cursor binds: the interval and everything that decides
/// which events a watch sends.
fn digest(req: &pb::WatchMapRequest, interval: Duration, reading: Option<&str>) -> [u8; 16] {
    framed(|put| {
        put(b"watch");
        put(&interval.as_nanos().to_le_bytes());
        put(req.filter.as_bytes());
        for f in req.fields.iter().chain(&req.group_by) {
            put(f.as_bytes());
        }
        put(b"|");
        for a in &req.aggregates {
            put(&a.op.to_le_bytes());
            put(a.field.as_bytes());
        }
        // How the entries are read, when not by the map's BTF alone.
        if let Some(r) = reading {
            put(b"|reading");
            put(r.as_bytes());
        }
    })
}
