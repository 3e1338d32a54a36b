//! The gRPC handlers: validate, authorize, call the domain, map the error.
//! Kernel work runs on the blocking pool; nothing here holds a lock across
//! maps.
#![forbid(unsafe_code)]

use std::{sync::Arc, time::Duration};

use bpfmap_proto::v1::{self as pb, map_service_server::MapService};
use tonic::{Code, Request, Response, Status};

use crate::{
    audit::{self, Method},
    auth::{Caller, Operation},
    catalog::{Catalog, MapRef, Resolved},
    conn::Held,
    cursor::Sealer,
    dump::{self, DumpEnv, DumpJob, DumpLimits, DumpStream},
    error::Error,
    kernel::walk::Position,
    limits::{Budget, Busy, DumpSlots, LookupSlots},
    metrics::Metrics,
    proto::{self, IntoProto as _, LookupOutcome},
    reload::{SharedKeys, SharedPolicy},
    typed::{Decoder, Types},
};

/// Most keys accepted in one Lookup call.
pub const MAX_LOOKUP_KEYS: usize = 4096;
/// Upper bound on a Lookup response, as for a dump chunk (below grpcurl's
/// 4 MiB default), unless one entry alone is larger.
pub const MAX_LOOKUP_RESPONSE: usize = crate::dump::MAX_CHUNK_BYTES;
/// How long a call waits for room in the memory pool.
const POOL_WAIT: Duration = Duration::from_secs(2);

/// What the service bounds.
#[derive(Debug, Clone)]
pub struct ServiceLimits {
    /// Dumps at once.
    pub slots: Arc<DumpSlots>,
    /// Lookups at once.
    pub lookups: Arc<LookupSlots>,
    /// The memory pool for lookup responses (shared with entries too large
    /// for a dump's share).
    pub pool: Budget,
    /// Each dump's share of memory, and the largest message.
    pub dumps: DumpLimits,
    /// Dumps and lookups in flight (free memory is handed back when none
    /// are).
    pub busy: Busy,
}

/// `bpfmap.v1.MapService`.
#[derive(Debug, Clone)]
pub struct MapServiceImpl {
    catalog: Arc<Catalog>,
    keys: SharedKeys,
    policy: SharedPolicy,
    limits: ServiceLimits,
    env: DumpEnv,
    /// True once the server is shutting down: new calls get UNAVAILABLE.
    draining: tokio::sync::watch::Receiver<bool>,
    metrics: Metrics,
}

impl MapServiceImpl {
    /// The service over `catalog`.
    pub fn new(
        catalog: Catalog,
        keys: SharedKeys,
        policy: SharedPolicy,
        limits: ServiceLimits,
        env: DumpEnv,
        draining: tokio::sync::watch::Receiver<bool>,
        metrics: Metrics,
    ) -> Self {
        Self {
            catalog: Arc::new(catalog),
            keys,
            policy,
            limits,
            env,
            draining,
            metrics,
        }
    }

    /// A map's types (read from the kernel and cached).
    fn accepting(&self) -> Result<(), Error> {
        if *self.draining.borrow() {
            Err(Error::ShuttingDown)
        } else {
            Ok(())
        }
    }

    /// PERMISSION_DENIED unless the policy allows `op` on `map` (checked
    /// before the map is opened, so a denial says nothing about existence).
    fn authorize(&self, caller: &Caller, op: Operation, map: &MapRef) -> Result<(), Error> {
        if self.policy.load().allows(&caller.identity, op, map) {
            Ok(())
        } else {
            self.metrics.denied(match op {
                Operation::List => Method::GetMap,
                Operation::Dump => Method::DumpMap,
                Operation::Lookup => Method::Lookup,
            });
            Err(Error::PermissionDenied {
                identity: caller.identity.clone(),
                operation: op,
                map: map.clone(),
            })
        }
    }

    /// Authorizes, then opens; a path that resolves (through a symlink) to
    /// another map is authorized under that map's name too.
    /// Opens the map `caller` may `op`, with its types when `types` (read
    /// in the same trip to the blocking pool: a trip costs more than the
    /// syscalls).
    async fn open_for(
        &self,
        caller: &Caller,
        op: Operation,
        map: &MapRef,
        types: bool,
    ) -> Result<(Resolved, Types), Error> {
        self.authorize(caller, op, map)?;
        let catalog = self.catalog.clone();
        let r = map.clone();
        let (resolved, types) = blocking(move || {
            let resolved = catalog.open(&r)?;
            let types = if types {
                catalog.types().get(resolved.handle.meta())
            } else {
                Types::None
            };
            Ok((resolved, types))
        })
        .await?;
        if let Some(target) = &resolved.target {
            // Named as requested: the symlink's target is not revealed.
            self.authorize(caller, op, target)
                .map_err(|_| Error::PermissionDenied {
                    identity: caller.identity.clone(),
                    operation: op,
                    map: map.clone(),
                })?;
        }
        Ok((resolved, types))
    }

    async fn list(&self, caller: &Caller) -> Result<Vec<pb::MapInfo>, Error> {
        self.accepting()?;
        let catalog = self.catalog.clone();
        let maps = blocking(move || Ok(catalog.list())).await?;
        let policy = self.policy.load();
        Ok(maps
            .iter()
            .filter(|(map, _)| policy.allows(&caller.identity, Operation::List, map))
            .map(|(map, meta)| (map, meta).into_proto())
            .collect())
    }

    async fn get(&self, caller: &Caller, map: Option<pb::MapRef>) -> Result<pb::MapInfo, Error> {
        self.accepting()?;
        let map = proto::map_ref(map)?;
        let (resolved, types) = self.open_for(caller, Operation::List, &map, true).await?;
        let meta = resolved.handle.meta();
        let mut info = (&resolved.map, meta).into_proto();
        types.fill(&mut info);
        Ok(info)
    }

    async fn dump(&self, caller: &Caller, req: pb::DumpMapRequest) -> Result<DumpJob, Error> {
        self.accepting()?;
        let map = proto::map_ref(req.map)?;
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
        // The cursor is checked before the map is touched: a bad cursor is a
        // bad request whatever state the map is in.
        let keys = self.keys.load_full();
        let opened = match req.cursor.as_str() {
            "" => None,
            token => Some(keys.open(token, &caller.identity, &map)?),
        };
        let packed = layout == pb::Layout::Packed;
        let decodes = !(packed || req.raw) || req.per_cpu != pb::PerCpu::Each as i32;
        let (resolved, types) = self
            .open_for(caller, Operation::Dump, &map, decodes)
            .await?;
        let meta = resolved.handle.meta().clone();
        let position = match opened {
            None => Position::Start,
            Some(o) => {
                self.metrics.dump_resumed();
                o.resume(&meta)?
            }
        };
        let sealer = Sealer::new(keys.as_ref().clone(), &caller.identity, &map, &meta);
        let decoder = Decoder::for_request(&map, &meta, &types, req.raw, req.per_cpu, packed)?;
        let options = dump::Options {
            layout,
            decoder,
            chunk_hint: req.chunk_size,
            limit: req.limit,
        };
        let mut job = DumpJob::new(
            map,
            resolved.handle,
            position,
            options,
            sealer,
            &self.limits.dumps,
        )?;
        // Last: a slot is only taken by a dump that will run.
        let slot = self.limits.slots.try_acquire(caller)?;
        job.reserve_memory(&self.limits.pool, POOL_WAIT).await?;
        Ok(job.with_slot(slot))
    }

    /// The results, and what the response keeps until it is sent: its
    /// memory and its lookup slot.
    async fn lookup(
        &self,
        caller: &Caller,
        mut req: pb::LookupRequest,
    ) -> Result<(Vec<pb::LookupResult>, Held), Error> {
        self.accepting()?;
        let map = proto::map_ref(req.map.take())?;
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
        let held = Held::default();
        held.keep(self.limits.lookups.try_acquire()?);
        held.keep(self.limits.busy.enter());
        let decodes = !req.raw || req.per_cpu != pb::PerCpu::Each as i32;
        let (resolved, types) = self
            .open_for(
                caller,
                Operation::Lookup,
                &map,
                decodes || !req.json_keys.is_empty(),
            )
            .await?;
        let handle = resolved.handle;
        let meta = handle.meta();
        let decoder = Decoder::for_request(&map, meta, &types, req.raw, req.per_cpu, false)?;
        if !req.json_keys.is_empty() {
            let layout = types.key_layout(&map)?;
            for (i, k) in req.json_keys.iter().enumerate() {
                let key = layout.encode(k, "key").map_err(|e| {
                    Error::InvalidArgument(format!("json_keys[{i}] does not fit map {map}: {e}"))
                })?;
                req.keys.push(key);
            }
        }
        if let Some((i, k)) = req
            .keys
            .iter()
            .enumerate()
            .find(|(_, k)| meta.key_size != 0 && k.len() != meta.key_size as usize)
        {
            return Err(Error::InvalidArgument(format!(
                "key {i} is {} bytes; map {map} has {}-byte keys",
                k.len(),
                meta.key_size
            )));
        }
        // The response is bounded before anything is read: every value has
        // the map's fixed size.
        let per_key = proto::entry_bytes(meta, pb::Layout::Entries, decoder.as_ref());
        let max = self
            .limits
            .dumps
            .max_message_bytes
            .min(self.limits.dumps.pool);
        if per_key > max {
            return Err(Error::EntryTooLarge {
                map,
                bytes: per_key,
                why: format!(
                    "more than the largest Lookup response this server builds ({max} bytes: limits.max_message_bytes, and a quarter of limits.max_queued_bytes)"
                ),
            });
        }
        let fit = (MAX_LOOKUP_RESPONSE / per_key).max(1);
        let bytes = req.keys.len() * per_key;
        if req.keys.len() > fit {
            return Err(Error::ResponseTooLarge {
                map,
                keys: req.keys.len(),
                bytes,
                fit,
            });
        }
        let reserved = tokio::time::timeout(POOL_WAIT, self.limits.pool.reserve(bytes, bytes))
            .await
            .map_err(|_| {
                Error::ResourceExhausted(
                    "the server's memory for responses is in use (limits.max_queued_bytes); retry later".into(),
                )
            })?;
        held.keep(reserved);
        let results = blocking(move || {
            let meta = handle.meta();
            req.keys
                .into_iter()
                .map(|key| {
                    let value = handle
                        .lookup_value(&key)
                        .map_err(|e| Error::from_lookup(&map, e))?;
                    Ok(LookupOutcome {
                        meta,
                        key,
                        value,
                        decoder: decoder.as_ref(),
                    }
                    .into_proto())
                })
                .collect()
        })
        .await?;
        Ok((results, held))
    }
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

fn code_of<T>(r: &Result<T, Error>) -> Code {
    r.as_ref().map_or_else(Error::code, |_| Code::Ok)
}

#[tonic::async_trait]
impl MapService for MapServiceImpl {
    async fn list_maps(
        &self,
        request: Request<pb::ListMapsRequest>,
    ) -> Result<Response<pb::ListMapsResponse>, Status> {
        let caller = Caller::of(&request)?;
        let mut audit = audit::Record::start(&caller, Method::ListMaps);
        let result = self.list(&caller).await;
        audit.add_entries(result.as_ref().map_or(0, |m| m.len() as u64));
        audit.finish(code_of(&result));
        Ok(Response::new(pb::ListMapsResponse { maps: result? }))
    }

    async fn get_map(
        &self,
        request: Request<pb::GetMapRequest>,
    ) -> Result<Response<pb::MapInfo>, Status> {
        let caller = Caller::of(&request)?;
        let mut audit = audit::Record::start(&caller, Method::GetMap);
        let map = request.into_inner().map;
        audit.request_map(&map);
        let result = self.get(&caller, map).await;
        audit.finish(code_of(&result));
        Ok(Response::new(result?))
    }

    type DumpMapStream = DumpStream;

    async fn dump_map(
        &self,
        request: Request<pb::DumpMapRequest>,
    ) -> Result<Response<Self::DumpMapStream>, Status> {
        let caller = Caller::of(&request)?;
        let mut audit = audit::Record::start(&caller, Method::DumpMap);
        let req = request.into_inner();
        audit.request_map(&req.map);
        match self.dump(&caller, req).await {
            // The stream finishes the audit record when it ends.
            Ok(job) => {
                let stream = dump::spawn(job, audit, self.env.clone());
                Ok(Response::new(stream.with_busy(self.limits.busy.enter())))
            }
            Err(e) => {
                audit.finish(e.code());
                Err(e.into())
            }
        }
    }

    async fn lookup(
        &self,
        request: Request<pb::LookupRequest>,
    ) -> Result<Response<pb::LookupResponse>, Status> {
        let caller = Caller::of(&request)?;
        let mut audit = audit::Record::start(&caller, Method::Lookup);
        let req = request.into_inner();
        audit.request_map(&req.map);
        let result = self.lookup(&caller, req).await;
        audit.add_entries(
            result
                .as_ref()
                .map_or(0, |(r, _)| r.iter().filter(|x| x.found).count() as u64),
        );
        audit.finish(code_of(&result));
        let (results, held) = result?;
        let mut response = Response::new(pb::LookupResponse { results });
        response.extensions_mut().insert(held);
        Ok(response)
    }
}
