//! The gRPC handlers of `bpfmap.v1.MapService`: authenticate, audit, call
//! the domain, turn its error into a status. Kernel work runs on the
//! blocking pool; nothing here holds a lock across maps.

use std::{sync::Arc, time::Duration};

use bpfmap_kernel::{MapHandle, MapMeta, walk::Position};
use bpfmap_proto::{
    typed::{MapLayout, Renderings},
    v1::{self as pb, map_service_server::MapService},
};
use tokio::sync::watch;
use tonic::{Request, Response, Status};

use super::{dump_stream::DumpStream, status::code_of};
use crate::{
    access,
    drain::{self as draining, DrainCall, DrainStream, Drains, Spool},
    dump::{self, DumpEnv, DumpJob, DumpLimits, Sealer},
    error::Error,
    limits::{Budget, DumpSlots, Held, LookupSlots, Trimmer},
    maps::{Catalog, Decoder, KnownTypes, RenderRules, Resolved, TypeCache},
    model::{Caller, MapRef, Operation, Rpc},
    net::caller_of,
    ops::{Metrics, SharedKeys, SharedPolicy},
    query::{AggregateError, EntryRef, Filter, Projection, Query, Spec},
    watch::{ScanKey, Ticket, Watch, WatchStream, Watches, parse_position, spawn as spawn_watch},
    wire::{self, IntoProto as _, LookupOutcome},
};

/// Most keys accepted in one Lookup call.
pub(crate) const MAX_LOOKUP_KEYS: usize = 4096;
/// Upper bound on a Lookup response, as for a dump chunk (below grpcurl's
/// 4 MiB default), unless one entry alone is larger.
pub(crate) const MAX_LOOKUP_RESPONSE: usize = dump::MAX_CHUNK_BYTES;
/// What a drain chunk's cursor binds in place of a query: it is a drain's.
const DRAIN_CURSORS: [u8; 16] = *b"DrainMap chunks.";
/// How long a call waits for room in the memory pool.
const POOL_WAIT: Duration = Duration::from_secs(2);

/// What the service is made of.
#[derive(Debug, Clone)]
pub(crate) struct ServiceParts {
    /// The exposed maps.
    pub(crate) catalog: Catalog,
    /// How members of the maps are shown unless a request says otherwise.
    pub(crate) renders: Arc<RenderRules>,
    /// The cursor keys in force.
    pub(crate) keys: SharedKeys,
    /// The policy in force.
    pub(crate) policy: SharedPolicy,
    /// Dumps at once.
    pub(crate) slots: Arc<DumpSlots>,
    /// Lookups at once.
    pub(crate) lookups: Arc<LookupSlots>,
    /// Groups one AggregateMap call may hold.
    pub(crate) max_groups: usize,
    /// The memory pool for lookup responses (shared with entries too large
    /// for a dump's share).
    pub(crate) pool: Budget,
    /// Dumps and lookups in flight (free memory is handed back when none
    /// are).
    pub(crate) trimmer: Trimmer,
    /// What every dump shares.
    pub(crate) dumps: DumpEnv,
    /// True once the server is shutting down: new calls get UNAVAILABLE.
    pub(crate) draining: watch::Receiver<bool>,
    /// Where denials and resumed dumps are counted.
    pub(crate) metrics: Metrics,
    /// Every watch.
    pub(crate) watches: Arc<Watches>,
    /// Every drain, and which maps may be drained.
    pub(crate) drains: Arc<Drains>,
}

/// `bpfmap.v1.MapService`.
#[derive(Debug, Clone)]
pub(crate) struct MapServiceImpl {
    parts: Arc<ServiceParts>,
    types: Arc<TypeCache>,
}

/// A map opened for a call, with its types when they were asked for.
struct Opened {
    map: MapRef,
    handle: MapHandle,
    types: KnownTypes,
}

impl MapServiceImpl {
    /// The service made of `parts`.
    pub(crate) fn new(parts: ServiceParts) -> Self {
        Self {
            parts: Arc::new(parts),
            types: Arc::default(),
        }
    }

    fn limits(&self) -> &DumpLimits {
        &self.parts.dumps.limits
    }

    fn accepting(&self) -> Result<(), Error> {
        if *self.parts.draining.borrow() {
            Err(Error::ShuttingDown)
        } else {
            Ok(())
        }
    }

    /// PERMISSION_DENIED unless the policy allows `op` on `map` (checked
    /// before the map is opened, so a denial says nothing about existence).
    fn authorize(
        &self,
        caller: &Caller,
        op: Operation,
        rpc: Rpc,
        map: &MapRef,
    ) -> Result<(), Error> {
        if self.parts.policy.load().allows(&caller.identity, op, map) {
            return Ok(());
        }
        self.parts.metrics.denied(rpc);
        Err(Error::PermissionDenied {
            identity: caller.identity.clone(),
            operation: op,
            map: map.clone(),
        })
    }

    /// Authorizes, then opens the map (with its types when `types`, read in
    /// the same trip to the blocking pool: a trip costs more than the
    /// syscalls). A path that resolves (through a symlink) to another map is
    /// authorized under that map's name too.
    async fn open_for(
        &self,
        caller: &Caller,
        (op, rpc): (Operation, Rpc),
        map: MapRef,
        types: bool,
    ) -> Result<Opened, Error> {
        self.authorize(caller, op, rpc, &map)?;
        let catalog = self.parts.catalog.clone();
        let cache = self.types.clone();
        let r = map.clone();
        let (resolved, types): (Resolved, KnownTypes) = blocking(move || {
            let resolved = catalog.open(&r)?;
            let types = if types {
                cache.map_types(resolved.handle.meta())
            } else {
                KnownTypes::None
            };
            Ok((resolved, types))
        })
        .await?;
        if let Some(target) = &resolved.target {
            // Named as requested: the symlink's target is not revealed.
            self.authorize(caller, op, rpc, target)
                .map_err(|_| Error::PermissionDenied {
                    identity: caller.identity.clone(),
                    operation: op,
                    map: map.clone(),
                })?;
        }
        Ok(Opened {
            map,
            handle: resolved.handle,
            types,
        })
    }

    /// The layout a call shows `opened`'s entries through: its types with
    /// the configured renderings for the map, overridden by the request's
    /// (`render`). `decodes` says whether the call decodes anything.
    fn call_layout(
        &self,
        opened: &Opened,
        render: &std::collections::HashMap<String, String>,
        decodes: bool,
    ) -> Result<MapLayout, Error> {
        let asked = Renderings::parse(render)
            .map_err(|e| Error::InvalidArgument(format!("render: {e}")))?;
        if !asked.is_empty() && !decodes {
            return Err(Error::InvalidArgument(
                "render shows decoded entries: it cannot be combined with LAYOUT_PACKED or raw = true (clients that decode packed entries apply renderings themselves)".into(),
            ));
        }
        let renderings = match &opened.types {
            KnownTypes::Typed(_) => self
                .parts
                .renders
                .for_map(&opened.map)
                .overridden_by(&asked),
            _ => asked,
        };
        opened
            .types
            .layout(&opened.map, opened.handle.meta(), &renderings)
    }

    /// The layout queries (filters, fields) of a call read `opened`'s
    /// entries through: its types as they are.
    fn query_layout(&self, opened: &Opened) -> Result<MapLayout, Error> {
        opened
            .types
            .layout(&opened.map, opened.handle.meta(), &Renderings::default())
    }

    async fn list(&self, caller: &Caller) -> Result<Vec<pb::MapInfo>, Error> {
        self.accepting()?;
        let catalog = self.parts.catalog.clone();
        let maps = blocking(move || Ok(catalog.list())).await?;
        let policy = self.parts.policy.load();
        Ok(maps
            .iter()
            .filter(|(map, _)| policy.allows(&caller.identity, Operation::List, map))
            .map(|(map, meta)| (map, meta).into_proto())
            .collect())
    }

    async fn get(&self, caller: &Caller, map: MapRef) -> Result<pb::MapInfo, Error> {
        self.accepting()?;
        let opened = self
            .open_for(caller, (Operation::List, Rpc::GetMap), map, true)
            .await?;
        let mut info = (&opened.map, opened.handle.meta()).into_proto();
        opened.types.fill(&mut info);
        info.render = self
            .parts
            .renders
            .for_map(&opened.map)
            .iter()
            .map(|(path, how)| (path.to_owned(), how.to_string()))
            .collect();
        Ok(info)
    }

    async fn dump(
        &self,
        caller: &Caller,
        map: MapRef,
        req: pb::DumpMapRequest,
    ) -> Result<DumpJob, Error> {
        self.accepting()?;
        let layout = dump_layout(&req)?;
        // The cursor is checked before the map is touched: a bad cursor is a
        // bad request whatever state the map is in.
        let keys = self.parts.keys.load_full();
        let cursor = match req.cursor.as_str() {
            "" => None,
            token => Some(keys.open(token, &caller.identity, &map)?),
        };
        let packed = layout == pb::Layout::Packed;
        let queried = !req.filter.is_empty() || !req.fields.is_empty();
        let decodes = !(packed || req.raw) || req.per_cpu != pb::PerCpu::Each as i32 || queried;
        // The slot before the map: a dump that will be refused costs no
        // trip to the kernel (and a denied one takes no slot).
        self.authorize(caller, Operation::Dump, Rpc::DumpMap, &map)?;
        let slot = self.parts.slots.try_acquire(caller)?;
        let opened = self
            .open_for(caller, (Operation::Dump, Rpc::DumpMap), map, decodes)
            .await?;
        let meta = opened.handle.meta().clone();
        let query = Query::of_request(
            &req.filter,
            &req.fields,
            &meta,
            &self.query_layout(&opened)?,
        )?
        .map(Arc::new);
        let digest = query.as_ref().map(|q| q.digest());
        let position = match cursor {
            None => Position::Start,
            Some(c) => {
                self.parts.metrics.dump_resumed();
                c.check_query(digest)?;
                c.resume(&meta)?
            }
        };
        let sealer = Sealer::new(keys.as_ref().clone(), &caller.identity, &opened.map, &meta)
            .with_query(digest);
        let projection = query.as_ref().and_then(|q| q.projection.as_ref());
        let decoder = match projection {
            Some(p) => projected_decoder(p, &req, packed)?,
            None => {
                let layout = self.call_layout(&opened, &req.render, !(packed || req.raw))?;
                Decoder::for_request(
                    &opened.map,
                    &meta,
                    (&opened.types, &layout),
                    (req.raw, req.per_cpu),
                    packed,
                )?
            }
        };
        let options = dump::Options {
            layout,
            decoder,
            chunk_hint: req.chunk_size,
            limit: req.limit,
            query,
        };
        let mut job = DumpJob::new(
            opened.map,
            (opened.handle, meta),
            position,
            options,
            sealer,
            self.limits(),
        )?;
        job.reserve_memory(&self.parts.pool, POOL_WAIT).await?;
        Ok(job.with_slot(slot))
    }

    /// An AggregateMap call: one walk in the caller's dump slot, on the
    /// blocking pool, grouping as it reads.
    async fn aggregate(
        &self,
        caller: &Caller,
        map: MapRef,
        req: pb::AggregateMapRequest,
    ) -> Result<pb::AggregateMapResponse, Error> {
        self.accepting()?;
        let started = std::time::Instant::now();
        let rpc = (Operation::Aggregate, Rpc::AggregateMap);
        self.authorize(caller, rpc.0, rpc.1, &map)?;
        let slot = self.parts.slots.try_acquire(caller)?;
        let _trim = self.parts.trimmer.enter();
        let opened = self.open_for(caller, rpc, map, true).await?;
        let invalid = |e: AggregateError| match e {
            AggregateError::Invalid(m) => Error::InvalidArgument(m),
            e @ AggregateError::TooManyGroups { .. } => Error::ResourceExhausted(e.to_string()),
        };
        let shown = self.call_layout(&opened, &req.render, true)?;
        let spec = Spec::new(&req, &shown, self.parts.max_groups).map_err(invalid)?;
        let filter = match req.filter.as_str() {
            "" => None,
            f => Some(
                Filter::compile(f, &self.query_layout(&opened)?)
                    .map_err(|e| Error::InvalidArgument(e.to_string()))?,
            ),
        };
        let walk = AggregateWalk {
            map: opened.map,
            handle: opened.handle,
            spec,
            filter,
            stop: self.parts.dumps.stop.clone(),
            cancelled: Arc::default(),
            max_cost: self.parts.dumps.max_filter_cost,
        };
        let cancelled = CancelOnDrop(walk.cancelled.clone());
        let (groups, summary) = blocking(move || walk.run()).await?;
        drop((cancelled, slot));
        Ok(pb::AggregateMapResponse {
            groups,
            summary: Some(pb::AggregateSummary {
                elapsed: prost_types::Duration::try_from(started.elapsed()).ok(),
                ..summary
            }),
        })
    }

    /// A WatchMap call checked, its place among the watches taken, and the
    /// first scan of its map made (so that a map too large to watch is
    /// refused with a status, before any message).
    async fn watch(
        &self,
        caller: &Caller,
        map: MapRef,
        req: pb::WatchMapRequest,
    ) -> Result<(Watch, Ticket), Error> {
        self.accepting()?;
        let watches = &self.parts.watches;
        let interval = watches.interval(req.interval.as_ref())?;
        let aggregated = !req.group_by.is_empty() || !req.aggregates.is_empty();
        if aggregated && !req.fields.is_empty() {
            return Err(Error::InvalidArgument(
                "fields select members of entries; an aggregated watch (group_by, aggregates) sends groups: use one or the other".into(),
            ));
        }
        if aggregated && req.aggregates.is_empty() {
            return Err(Error::InvalidArgument(
                "group_by needs at least one aggregate ({\"op\":\"SUM\",\"field\":\"value.bytes\"})".into(),
            ));
        }
        let op = if aggregated {
            Operation::Aggregate
        } else {
            Operation::Dump
        };
        let keys = self.parts.keys.load_full();
        let cursor = match req.cursor.as_str() {
            "" => None,
            token => Some(keys.open(token, &caller.identity, &map)?),
        };
        let opened = self
            .open_for(caller, (op, Rpc::WatchMap), map, true)
            .await?;
        let meta = opened.handle.meta().clone();
        // A map that cannot be iterated is refused now.
        bpfmap_kernel::walk::Walker::new(&opened.handle, meta.clone(), Position::Start)
            .map_err(|e| Error::from_walk(&opened.map, e))?;
        let base = self.query_layout(&opened)?;
        let query = Query::of_request(&req.filter, &req.fields, &meta, &base)
            .map_err(|e| Error::InvalidArgument(e.to_string()))?;
        let (filter, projection) = match query {
            Some(q) => (q.filter, q.projection),
            None => (None, None),
        };
        let as_dump = pb::DumpMapRequest {
            raw: req.raw,
            per_cpu: req.per_cpu,
            render: req.render.clone(),
            ..Default::default()
        };
        let (decoder, counters, projected) = match &projection {
            Some(p) => {
                let mut decoder = projected_decoder(p, &as_dump, false)?;
                let mut projected = crate::query::projected_meta(&meta, p);
                if !p.selects_key() {
                    // No member of the key selected: events still say
                    // which entry changed, with the whole key.
                    projected.key_size = meta.key_size;
                    let layout = self.call_layout(&opened, &req.render, !req.raw)?;
                    let key = layout.typed().then(|| layout.key_arc().clone());
                    decoder = decoder.map(|d| d.with_key(key));
                }
                (decoder, p.counters(), Some(projected))
            }
            None => {
                let layout = self.call_layout(&opened, &req.render, !req.raw)?;
                let decoder = Decoder::for_request(
                    &opened.map,
                    &meta,
                    (&opened.types, &layout),
                    (req.raw, req.per_cpu),
                    false,
                )?;
                (decoder, base.counters(), None)
            }
        };
        let aggregate = if aggregated {
            let as_aggregate = pb::AggregateMapRequest {
                group_by: req.group_by.clone(),
                aggregates: req.aggregates.clone(),
                per_cpu: req.per_cpu,
                ..Default::default()
            };
            let shown = self.call_layout(&opened, &req.render, true)?;
            let spec =
                Spec::new(&as_aggregate, &shown, self.parts.max_groups).map_err(|e| match e {
                    AggregateError::Invalid(m) => Error::InvalidArgument(m),
                    e => Error::ResourceExhausted(e.to_string()),
                })?;
            Some(spec)
        } else {
            None
        };
        let digest = watch_digest(&req, interval);
        let (mut resume, mut resync) = (None, None);
        if let Some(c) = cursor {
            c.check_query(Some(digest))?;
            match c.resume(&meta) {
                Ok(Position::After(token)) => {
                    resume = Some(parse_position(&token).ok_or_else(|| {
                        Error::InvalidArgument(
                            "this cursor is a dump's, not a watch's: resume a watch with the cursor of one of its bookmarks".into(),
                        )
                    })?);
                }
                Ok(_) => {
                    return Err(Error::InvalidArgument(
                        "this cursor is a dump's, not a watch's".into(),
                    ));
                }
                Err(crate::dump::CursorError::MapReplaced { detail, .. }) => {
                    resync = Some(format!(
                        "the map was replaced since this cursor was issued ({detail})"
                    ));
                }
                Err(e) => return Err(e.into()),
            }
        }
        let sealer = Sealer::new(keys.as_ref().clone(), &caller.identity, &opened.map, &meta)
            .with_query(Some(digest));
        let key = ScanKey {
            map: opened.map.clone(),
            map_id: meta.id,
            interval,
        };
        let ticket = watches.join(caller, key, meta.clone())?;
        let scanner = ticket.scanner().clone();
        let mut first = scanner.subscribe();
        // The first scan, or why there is none.
        let _ = first
            .wait_for(|&r| r > 0 || scanner.failure().is_some())
            .await;
        if let Some(f) = scanner.failure() {
            return Err(f.error());
        }
        Ok((
            Watch {
                meta,
                filter,
                projection,
                projected,
                decoder,
                counters,
                aggregate,
                sealer,
                resume,
                resync,
                stall_timeout: watches.limits.stall_timeout,
                events_key: events_key(&req),
            },
            ticket,
        ))
    }

    /// A DrainMap call checked: allowed, drainable, its map opened for
    /// writing, its spool read and its acknowledgement applied.
    async fn drain(
        &self,
        caller: &Caller,
        map: MapRef,
        req: pb::DrainMapRequest,
    ) -> Result<DrainCall, Error> {
        self.accepting()?;
        self.authorize(caller, Operation::Drain, Rpc::DrainMap, &map)?;
        let drains = self.parts.drains.clone();
        drains.check_drainable(&map)?;
        if req.chunk_size > dump::MAX_CHUNK {
            return Err(Error::InvalidArgument(format!(
                "chunk_size {} is too large; use 1 to {}, or 0 for the server's default",
                req.chunk_size,
                dump::MAX_CHUNK
            )));
        }
        let keys = self.parts.keys.load_full();
        let ack = match req.ack.as_str() {
            "" => None,
            token => {
                let c = keys.open(token, &caller.identity, &map)?;
                c.check_query(Some(DRAIN_CURSORS)).map_err(|_| {
                    Error::InvalidArgument(
                        "ack is not a drain's cursor: acknowledge with the cursor of a DrainMap chunk".into(),
                    )
                })?;
                match c.into_position() {
                    Position::After(t) => Some(draining::parse_position(&t).ok_or_else(|| {
                        Error::InvalidArgument(
                            "ack is not a drain's cursor: acknowledge with the cursor of a DrainMap chunk".into(),
                        )
                    })?),
                    _ => {
                        return Err(Error::InvalidArgument(
                            "ack is not a drain's cursor: acknowledge with the cursor of a DrainMap chunk".into(),
                        ));
                    }
                }
            }
        };
        let busy = drains.start(&map).await?;
        let catalog = self.parts.catalog.clone();
        let cache = self.types.clone();
        let r = map.clone();
        let (resolved, types): (Resolved, KnownTypes) = blocking(move || {
            let resolved = catalog.open_writable(&r)?;
            let types = cache.map_types(resolved.handle.meta());
            Ok((resolved, types))
        })
        .await?;
        if let Some(target) = &resolved.target {
            // A symlink to another map: that map too must be drainable and
            // allowed.
            drains.check_drainable(target)?;
            self.authorize(caller, Operation::Drain, Rpc::DrainMap, target)
                .map_err(|_| Error::PermissionDenied {
                    identity: caller.identity.clone(),
                    operation: Operation::Drain,
                    map: map.clone(),
                })?;
        }
        let meta = resolved.handle.meta().clone();
        bpfmap_kernel::drain::drainable(meta.map_type).map_err(|why| {
            Error::NotDrainable(format!(
                "map {map} cannot be drained: {why} (type {})",
                meta.map_type
            ))
        })?;
        let opened = Opened {
            map,
            handle: resolved.handle,
            types,
        };
        let layout = self.call_layout(&opened, &Default::default(), !req.raw)?;
        let decoder = Decoder::for_request(
            &opened.map,
            &meta,
            (&opened.types, &layout),
            (req.raw, req.per_cpu),
            false,
        )?;
        let dir = drains.spool_dir(&opened.map);
        let (spool, acknowledged) = blocking(move || {
            let io = |e: std::io::Error| Error::Internal {
                map: None,
                message: format!("the drain spool cannot be read: {e}"),
            };
            let mut spool = Spool::open(&dir)
                .map_err(io)?
                .map_err(Error::SpoolCorrupt)?;
            let acknowledged = match ack {
                Some(seq) => spool.ack(seq).map_err(io)?,
                None => 0,
            };
            Ok((spool, acknowledged))
        })
        .await?;
        drains
            .stats
            .acknowledged
            .fetch_add(acknowledged, std::sync::atomic::Ordering::Relaxed);
        let sealer = Sealer::new(keys.as_ref().clone(), &caller.identity, &opened.map, &meta)
            .with_query(Some(DRAIN_CURSORS));
        Ok(DrainCall {
            identity: draining::identity_digest(&caller.identity),
            map: opened.map,
            handle: opened.handle,
            meta,
            decoder,
            sealer,
            spool,
            acknowledged,
            limit: req.limit,
            chunk: if req.chunk_size == 0 {
                draining::DEFAULT_CHUNK
            } else {
                req.chunk_size
            },
            max_spool_bytes: drains.max_spool_bytes,
            stats: drains.stats.clone(),
            stop: self.parts.dumps.stop.clone(),
            stall_timeout: self.parts.dumps.stall_timeout,
            _busy: busy,
        })
    }

    /// The results, and what the response keeps until it is sent: its
    /// memory and its lookup slot.
    async fn lookup(
        &self,
        caller: &Caller,
        map: MapRef,
        mut req: pb::LookupRequest,
    ) -> Result<(Vec<pb::LookupResult>, Held), Error> {
        self.accepting()?;
        check_key_count(&req)?;
        let slot = self.parts.lookups.try_acquire()?;
        let trim = self.parts.trimmer.enter();
        let decodes = !req.raw || req.per_cpu != pb::PerCpu::Each as i32;
        let opened = self
            .open_for(
                caller,
                (Operation::Lookup, Rpc::Lookup),
                map,
                decodes || !req.json_keys.is_empty(),
            )
            .await?;
        let layout =
            self.call_layout(&opened, &req.render, !req.raw || !req.json_keys.is_empty())?;
        let Opened { map, handle, types } = opened;
        let meta = handle.meta();
        let decoder =
            Decoder::for_request(&map, meta, (&types, &layout), (req.raw, req.per_cpu), false)?;
        encode_json_keys(&map, (&types, &layout), &mut req)?;
        for (i, k) in req.keys.iter().enumerate() {
            Error::check_key_size(&map, meta, Some(i), k)?;
        }
        let bytes = self.lookup_response_bytes(&map, meta, decoder.as_ref(), req.keys.len())?;
        let memory = tokio::time::timeout(POOL_WAIT, self.parts.pool.reserve(bytes, bytes))
            .await
            .map_err(|_| {
                Error::ResourceExhausted(
                    "the server's memory for responses is in use (limits.max_queued_bytes); retry later".into(),
                )
            })?;
        let results = blocking(move || look_up(&map, &handle, decoder.as_ref(), req.keys)).await?;
        Ok((results, Held::new(slot, memory, trim)))
    }

    /// The size of a Lookup response of `keys` keys, bounded before anything
    /// is read: every value has the map's fixed size.
    fn lookup_response_bytes(
        &self,
        map: &MapRef,
        meta: &MapMeta,
        decoder: Option<&Decoder>,
        keys: usize,
    ) -> Result<usize, Error> {
        let per_key = wire::entry_bytes(meta, pb::Layout::Entries, decoder)
            .max(wire::entry_memory(meta, pb::Layout::Entries, decoder));
        let max = self.limits().max_message_bytes.min(self.limits().pool);
        if per_key > max {
            return Err(Error::EntryTooLarge {
                map: map.clone(),
                bytes: per_key,
                why: format!(
                    "more than the largest Lookup response this server builds ({max} bytes: limits.max_message_bytes, and a quarter of limits.max_queued_bytes)"
                ),
            });
        }
        let fit = (MAX_LOOKUP_RESPONSE / per_key).max(1);
        let bytes = keys * per_key;
        if keys > fit {
            return Err(Error::ResponseTooLarge {
                map: map.clone(),
                keys,
                bytes,
                fit,
            });
        }
        Ok(bytes)
    }
}

/// Sets its flag when dropped: the call's future was dropped (the client
/// went away), and the walk on the blocking pool stops at its next chunk.
struct CancelOnDrop(Arc<std::sync::atomic::AtomicBool>);

impl Drop for CancelOnDrop {
    fn drop(&mut self) {
        self.0.store(true, std::sync::atomic::Ordering::Relaxed);
    }
}

/// The walk of an AggregateMap call.
struct AggregateWalk {
    map: MapRef,
    handle: MapHandle,
    spec: Spec,
    filter: Option<Filter>,
    stop: watch::Receiver<bool>,
    cancelled: Arc<std::sync::atomic::AtomicBool>,
    max_cost: u32,
}

/// Entries read per kernel call of an aggregate.
const AGGREGATE_READ: u32 = 1024;

impl AggregateWalk {
    /// Reads the whole map (blocking), grouping the matching entries.
    fn run(self) -> Result<(Vec<pb::Group>, pb::AggregateSummary), Error> {
        let meta = self.handle.meta().clone();
        let stride = if meta.per_cpu() { meta.cpu_stride() } else { 0 };
        let (ks, vs) = (meta.key_size as usize, meta.kernel_value_size());
        let mut walker = bpfmap_kernel::walk::Walker::new(&self.handle, meta, Position::Start)
            .map_err(|e| Error::from_walk(&self.map, e))?;
        let mut table = self.spec.table();
        let mut meter = crate::query::CostMeter::new(self.max_cost);
        let (mut scanned, mut matched) = (0u64, 0u64);
        'walk: loop {
            if *self.stop.borrow() {
                return Err(Error::ShuttingDown);
            }
            if self.cancelled.load(std::sync::atomic::Ordering::Relaxed) {
                return Err(Error::Cancelled);
            }
            let read_at = std::time::Instant::now();
            let Some(c) = walker
                .next_chunk(AGGREGATE_READ)
                .map_err(|e| Error::from_walk(&self.map, e))?
            else {
                break;
            };
            let eval_at = std::time::Instant::now();
            let reading = eval_at - read_at;
            for i in 0..c.count {
                let e = EntryRef {
                    key: &c.keys[i * ks..(i + 1) * ks],
                    value: &c.values[i * vs..(i + 1) * vs],
                    stride,
                };
                scanned += 1;
                if self.filter.as_ref().is_some_and(|f| !f.matches(&e)) {
                    continue;
                }
                matched += 1;
                if !table.add(&e) {
                    break 'walk;
                }
            }
            // What the filter costs (with the grouping of what it let
            // through); grouping alone is bounded by limits.max_groups.
            if self.filter.is_some() {
                meter.add(reading, eval_at.elapsed())?;
            }
            if *walker.position() == Position::End {
                break;
            }
        }
        let order_non_negative = self.spec.non_negative_order();
        let (groups, total) = table
            .finish()
            .map_err(|e| Error::ResourceExhausted(e.to_string()))?;
        Ok((
            groups,
            pb::AggregateSummary {
                entries_scanned: scanned,
                entries_matched: matched,
                groups_total: total,
                elapsed: None,
                order_non_negative,
            },
        ))
    }
}

/// How a projected dump's entries are decoded: through the projection's
/// records (LAYOUT_ENTRIES, unless raw).
fn projected_decoder(
    p: &Projection,
    req: &pb::DumpMapRequest,
    packed: bool,
) -> Result<Option<Decoder>, Error> {
    if !req.render.is_empty() {
        return Err(Error::InvalidArgument(
            "render cannot be combined with fields: the projected members are shown as their types say".into(),
        ));
    }
    if packed || req.raw {
        return Ok(None);
    }
    let records = p.layout();
    Ok(Some(Decoder::typed(
        Some(records.key_arc().clone()),
        records.value_arc().clone(),
    )))
}

/// What decides a watch's events: watches with the same share them.
fn events_key(req: &pb::WatchMapRequest) -> [u8; 16] {
    let mut ctx = ring::digest::Context::new(&ring::digest::SHA256);
    let mut put = |b: &[u8]| {
        ctx.update(&(b.len() as u64).to_le_bytes());
        ctx.update(b);
    };
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
    let mut out = [0u8; 16];
    out.copy_from_slice(&ctx.finish().as_ref()[..16]);
    out
}

/// What a watch cursor binds: the interval and everything that decides
/// which events a watch sends.
fn watch_digest(req: &pb::WatchMapRequest, interval: Duration) -> [u8; 16] {
    let mut ctx = ring::digest::Context::new(&ring::digest::SHA256);
    let mut put = |b: &[u8]| {
        ctx.update(&(b.len() as u64).to_le_bytes());
        ctx.update(b);
    };
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
    let mut out = [0u8; 16];
    out.copy_from_slice(&ctx.finish().as_ref()[..16]);
    out
}

/// The layout a dump asks for, and its chunk size checked.
fn dump_layout(req: &pb::DumpMapRequest) -> Result<pb::Layout, Error> {
    let layout = pb::Layout::try_from(req.layout).map_err(|_| {
        Error::InvalidArgument(format!(
            "unknown layout {}; use LAYOUT_ENTRIES (0) or LAYOUT_PACKED (1)",
            req.layout
        ))
    })?;
    if req.chunk_size > dump::MAX_CHUNK {
        return Err(Error::InvalidArgument(format!(
            "chunk_size {} is too large; use 1 to {}, or 0 for the server's default (chunks as large as the dump's memory allows)",
            req.chunk_size,
            dump::MAX_CHUNK,
        )));
    }
    Ok(layout)
}

fn check_key_count(req: &pb::LookupRequest) -> Result<(), Error> {
    let count = req.keys.len() + req.json_keys.len();
    if count == 0 {
        return Err(Error::InvalidArgument(
            "no keys to look up; set keys (bytes) or json_keys".into(),
        ));
    }
    if count > MAX_LOOKUP_KEYS {
        return Err(Error::InvalidArgument(format!(
            "{count} keys in one Lookup; at most {MAX_LOOKUP_KEYS} are allowed, split the request"
        )));
    }
    Ok(())
}

/// Adds the request's JSON keys, encoded through the key's type, to its
/// byte keys.
fn encode_json_keys(
    map: &MapRef,
    (types, layout): (&KnownTypes, &MapLayout),
    req: &mut pb::LookupRequest,
) -> Result<(), Error> {
    if req.json_keys.is_empty() {
        return Ok(());
    }
    let layout = types.key_layout(map, layout)?;
    for (i, k) in req.json_keys.iter().enumerate() {
        let key = layout.encode(k, "key").map_err(|e| {
            Error::InvalidArgument(format!("json_keys[{i}] does not fit map {map}: {e}"))
        })?;
        req.keys.push(key);
    }
    Ok(())
}

/// Looks every key up (blocking).
fn look_up(
    map: &MapRef,
    handle: &MapHandle,
    decoder: Option<&Decoder>,
    keys: Vec<Vec<u8>>,
) -> Result<Vec<pb::LookupResult>, Error> {
    let meta = handle.meta();
    keys.into_iter()
        .map(|key| {
            let value = handle
                .lookup_value(&key)
                .map_err(|e| Error::from_lookup(map, e))?;
            Ok(LookupOutcome {
                meta,
                key,
                value,
                decoder,
            }
            .into_proto())
        })
        .collect()
}

/// Runs kernel work on the blocking pool.
async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> Result<T, Error> + Send + 'static,
) -> Result<T, Error> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| Error::Internal {
            map: None,
            message: format!("worker failed: {e}"),
        })?
}

/// Starts a call: its caller, its audit record, and the map its request
/// names (parsed once, for the audit log and the handler).
fn start_call<T>(
    request: &Request<T>,
    rpc: Rpc,
    map: Option<&pb::MapRef>,
) -> Result<(Caller, access::Record, Result<MapRef, Error>), Status> {
    let caller = caller_of(request)?;
    let mut audit = access::Record::start(&caller, rpc);
    let parsed = wire::map_ref(map);
    audit.request_map(&parsed, map);
    Ok((caller, audit, parsed))
}

#[tonic::async_trait]
impl MapService for MapServiceImpl {
    async fn list_maps(
        &self,
        request: Request<pb::ListMapsRequest>,
    ) -> Result<Response<pb::ListMapsResponse>, Status> {
        let caller = caller_of(&request)?;
        let mut audit = access::Record::start(&caller, Rpc::ListMaps);
        let result = self.list(&caller).await;
        audit.add_entries(result.as_ref().map_or(0, |m| m.len() as u64));
        audit.finish(code_of(&result));
        Ok(Response::new(pb::ListMapsResponse { maps: result? }))
    }

    async fn get_map(
        &self,
        request: Request<pb::GetMapRequest>,
    ) -> Result<Response<pb::MapInfo>, Status> {
        let (caller, audit, map) =
            start_call(&request, Rpc::GetMap, request.get_ref().map.as_ref())?;
        let result = match map {
            Ok(map) => self.get(&caller, map).await,
            Err(e) => Err(e),
        };
        audit.finish(code_of(&result));
        Ok(Response::new(result?))
    }

    async fn aggregate_map(
        &self,
        request: Request<pb::AggregateMapRequest>,
    ) -> Result<Response<pb::AggregateMapResponse>, Status> {
        let (caller, mut audit, map) =
            start_call(&request, Rpc::AggregateMap, request.get_ref().map.as_ref())?;
        let req = request.into_inner();
        let result = match map {
            Ok(map) => self.aggregate(&caller, map, req).await,
            Err(e) => Err(e),
        };
        if let Ok(r) = &result {
            audit.add_entries(r.summary.as_ref().map_or(0, |s| s.entries_matched));
        }
        audit.finish(code_of(&result));
        Ok(Response::new(result?))
    }

    type DumpMapStream = DumpStream;

    type WatchMapStream = WatchStream;

    type DrainMapStream = DrainStream;

    async fn drain_map(
        &self,
        request: Request<pb::DrainMapRequest>,
    ) -> Result<Response<Self::DrainMapStream>, Status> {
        let (caller, audit, map) =
            start_call(&request, Rpc::DrainMap, request.get_ref().map.as_ref())?;
        let req = request.into_inner();
        let call = match map {
            Ok(map) => self.drain(&caller, map, req).await,
            Err(e) => Err(e),
        };
        match call {
            Ok(call) => Ok(Response::new(draining::spawn(call, audit))),
            Err(e) => {
                audit.finish(super::code(&e));
                Err(e.into())
            }
        }
    }

    async fn watch_map(
        &self,
        request: Request<pb::WatchMapRequest>,
    ) -> Result<Response<Self::WatchMapStream>, Status> {
        let (caller, audit, map) =
            start_call(&request, Rpc::WatchMap, request.get_ref().map.as_ref())?;
        let req = request.into_inner();
        let watch = match map {
            Ok(map) => self.watch(&caller, map, req).await,
            Err(e) => Err(e),
        };
        match watch {
            // The stream finishes the audit record when it ends.
            Ok((watch, ticket)) => Ok(Response::new(spawn_watch(
                watch,
                ticket,
                self.parts.watches.stats.clone(),
                audit,
            ))),
            Err(e) => {
                audit.finish(super::code(&e));
                Err(e.into())
            }
        }
    }

    async fn dump_map(
        &self,
        request: Request<pb::DumpMapRequest>,
    ) -> Result<Response<Self::DumpMapStream>, Status> {
        let (caller, audit, map) =
            start_call(&request, Rpc::DumpMap, request.get_ref().map.as_ref())?;
        let req = request.into_inner();
        let job = match map {
            Ok(map) => self.dump(&caller, map, req).await,
            Err(e) => Err(e),
        };
        match job {
            // The stream finishes the audit record when it ends.
            Ok(job) => {
                let env = self.parts.dumps.clone();
                let stats = env.stats.clone();
                let started = dump::spawn(job, audit.started(), env);
                let trim = self.parts.trimmer.enter();
                Ok(Response::new(DumpStream::new(started, audit, trim, stats)))
            }
            Err(e) => {
                audit.finish(super::code(&e));
                Err(e.into())
            }
        }
    }

    async fn lookup(
        &self,
        request: Request<pb::LookupRequest>,
    ) -> Result<Response<pb::LookupResponse>, Status> {
        let (caller, mut audit, map) =
            start_call(&request, Rpc::Lookup, request.get_ref().map.as_ref())?;
        let req = request.into_inner();
        let result = match map {
            Ok(map) => self.lookup(&caller, map, req).await,
            Err(e) => Err(e),
        };
        let found = result
            .as_ref()
            .map_or(0, |(r, _)| r.iter().filter(|x| x.found).count());
        audit.add_entries(found as u64);
        audit.finish(code_of(&result));
        let (results, held) = result?;
        let mut response = Response::new(pb::LookupResponse { results });
        response.extensions_mut().insert(held);
        Ok(response)
    }
}
