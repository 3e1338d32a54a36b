//! The gRPC handlers: validate, call the domain, map errors. Kernel work runs
//! on the blocking pool; nothing here holds a lock across maps.

use std::{
    sync::{Arc, RwLock},
    time::Instant,
};

use bpfmap_proto::v1::{self as pb, map_service_server::MapService};
use tonic::{Code, Request, Response, Status};

use crate::{
    audit,
    auth::{Caller, Operation, Policy},
    catalog::{Catalog, MapRef, Resolved},
    cursor::CursorKey,
    dump::{self, DumpEnv, DumpJob},
    error::Error,
    kernel::{self, MapMeta, Method, sys::ENOTSUPP, walk::Walker},
    limits::DumpSlots,
};

/// Most keys accepted in one Lookup call.
pub const MAX_LOOKUP_KEYS: usize = 4096;

#[derive(Debug, Clone)]
pub struct MapServiceImpl {
    catalog: Arc<Catalog>,
    key: CursorKey,
    policy: SharedPolicy,
    slots: Arc<DumpSlots>,
    env: DumpEnv,
}

/// The authorization policy in force; replaced on reload.
pub type SharedPolicy = Arc<RwLock<Arc<Policy>>>;

impl MapServiceImpl {
    pub fn new(
        catalog: Catalog,
        key: CursorKey,
        policy: SharedPolicy,
        slots: Arc<DumpSlots>,
        env: DumpEnv,
    ) -> Self {
        Self {
            catalog: Arc::new(catalog),
            key,
            policy,
            slots,
            env,
        }
    }

    async fn open(&self, r: &MapRef) -> Result<Resolved, Error> {
        let catalog = self.catalog.clone();
        let r = r.clone();
        blocking(move || catalog.open(&r)).await
    }

    fn policy(&self) -> Arc<Policy> {
        self.policy.read().expect("policy lock").clone()
    }

    /// PERMISSION_DENIED unless the policy allows `op` on `map` (checked
    /// before the map is opened, so a denial says nothing about existence).
    fn authorize(&self, caller: &Caller, op: Operation, map: &str) -> Result<(), Error> {
        if self.policy().allows(&caller.identity, op, map) {
            Ok(())
        } else {
            Err(Error::PermissionDenied {
                identity: caller.identity.to_string(),
                verb: op.verb(),
                map: map.to_owned(),
            })
        }
    }

    /// Authorizes, then opens; a path that resolves (through a symlink) to
    /// another map is authorized under that map's name too.
    async fn open_for(
        &self,
        caller: &Caller,
        op: Operation,
        r: &MapRef,
    ) -> Result<Resolved, Error> {
        self.authorize(caller, op, &r.policy_name())?;
        let resolved = self.open(r).await?;
        if let Some(real) = &resolved.real_path
            && Some(real) != resolved.path.as_ref()
            && !self.policy().allows(&caller.identity, op, real)
        {
            // Named as requested: the symlink's target is not revealed.
            return Err(Error::PermissionDenied {
                identity: caller.identity.to_string(),
                verb: op.verb(),
                map: r.policy_name(),
            });
        }
        Ok(resolved)
    }

    async fn get_map_inner(
        &self,
        caller: &Caller,
        map: Option<pb::MapRef>,
    ) -> Result<pb::MapInfo, Error> {
        let r = parse_ref(map)?;
        let resolved = self.open_for(caller, Operation::List, &r).await?;
        Ok(map_info(resolved.path, resolved.handle.meta()))
    }

    async fn dump_inner(
        &self,
        caller: &Caller,
        req: pb::DumpMapRequest,
        started: Instant,
    ) -> Result<dump::ChunkStream, Error> {
        let map_ref = parse_ref(req.map)?;
        let layout = pb::Layout::try_from(req.layout).map_err(|_| {
            Error::InvalidArgument(format!(
                "unknown layout {}; use LAYOUT_ENTRIES (0) or LAYOUT_PACKED (1)",
                req.layout
            ))
        })?;
        if req.chunk_size > dump::MAX_CHUNK {
            return Err(Error::InvalidArgument(format!(
                "chunk_size {} is too large; use 1 to {} (0 for the server default, {})",
                req.chunk_size,
                dump::MAX_CHUNK,
                dump::DEFAULT_CHUNK
            )));
        }
        // The cursor is checked before the map is touched: a bad cursor is a
        // bad request whatever state the map is in.
        let cursor = if req.cursor.is_empty() {
            None
        } else {
            let c = self.key.decode(&req.cursor)?;
            if c.identity != crate::cursor::identity_digest(&caller.identity) {
                return Err(Error::CursorOtherIdentity {
                    identity: caller.identity.to_string(),
                });
            }
            if c.map_ref != map_ref.canonical() {
                return Err(Error::CursorForAnotherMap {
                    cursor_ref: c.map_ref,
                    request_ref: map_ref.canonical(),
                });
            }
            Some(c)
        };
        let resolved = self.open_for(caller, Operation::Dump, &map_ref).await?;
        let meta = resolved.handle.meta().clone();
        let position = match cursor {
            None => kernel::walk::Position::Start,
            Some(c) => {
                if c.map_id != meta.id || c.fingerprint != meta.fingerprint() {
                    let detail = if c.map_id != meta.id {
                        format!("kernel id was {}, now {}", c.map_id, meta.id)
                    } else {
                        "its type, sizes, flags or name changed".to_owned()
                    };
                    return Err(Error::MapReplaced {
                        map: map_ref.to_string(),
                        detail,
                    });
                }
                c.position
            }
        };
        let chunk = dump::effective_chunk(req.chunk_size, &meta);
        let walker = Walker::new(resolved.handle, meta, position)
            .map_err(|e| Error::from_walk(&map_ref.to_string(), e))?;
        // Last: a slot is only taken by a dump that will run.
        let slot = self.slots.try_acquire(&caller.identity)?;
        let job = DumpJob {
            caller: caller.clone(),
            map_ref,
            walker,
            layout,
            chunk,
            limit: req.limit,
            key: self.key.clone(),
            slot,
            started,
        };
        Ok(dump::spawn(job, self.env.clone()))
    }

    async fn lookup_inner(
        &self,
        caller: &Caller,
        req: pb::LookupRequest,
    ) -> Result<Vec<pb::LookupResult>, Error> {
        let map_ref = parse_ref(req.map)?;
        if req.keys.is_empty() {
            return Err(Error::InvalidArgument(
                "no keys to look up; set keys".into(),
            ));
        }
        if req.keys.len() > MAX_LOOKUP_KEYS {
            return Err(Error::InvalidArgument(format!(
                "{} keys in one Lookup; at most {MAX_LOOKUP_KEYS} are allowed, split the request",
                req.keys.len()
            )));
        }
        let resolved = self.open_for(caller, Operation::Lookup, &map_ref).await?;
        let meta = resolved.handle.meta().clone();
        let name = map_ref.to_string();
        if meta.key_size == 0 {
            return Err(Error::LookupUnsupported {
                map: name,
                type_name: kernel::type_name(meta.map_type).into_owned(),
            });
        }
        if let Some((i, k)) = req
            .keys
            .iter()
            .enumerate()
            .find(|(_, k)| k.len() != meta.key_size as usize)
        {
            return Err(Error::InvalidArgument(format!(
                "key {i} is {} bytes; map {name} has {}-byte keys",
                k.len(),
                meta.key_size
            )));
        }
        blocking(move || {
            let handle = resolved.handle;
            let mut value = vec![0u8; meta.kernel_value_size()];
            let mut out = Vec::with_capacity(req.keys.len());
            for key in req.keys {
                match kernel::sys::lookup_elem(handle.fd(), &key, &mut value) {
                    Ok(()) => {
                        let (value, per_cpu_values) = if meta.per_cpu() {
                            (Vec::new(), dump::per_cpu_values(&meta, &value))
                        } else {
                            (value.clone(), Vec::new())
                        };
                        out.push(pb::LookupResult {
                            key,
                            found: true,
                            value,
                            per_cpu_values,
                        });
                    }
                    Err(e) if e.errno() == Some(libc::ENOENT) => out.push(pb::LookupResult {
                        key,
                        found: false,
                        ..Default::default()
                    }),
                    Err(e)
                        if matches!(
                            e.errno(),
                            Some(libc::EOPNOTSUPP) | Some(ENOTSUPP) | Some(libc::EINVAL)
                        ) =>
                    {
                        return Err(Error::LookupUnsupported {
                            map: name,
                            type_name: kernel::type_name(meta.map_type).into_owned(),
                        });
                    }
                    Err(source) => return Err(Error::Kernel { map: name, source }),
                }
            }
            Ok(out)
        })
        .await
    }
}

fn code_of<T>(r: &Result<T, Error>) -> Code {
    r.as_ref().map_or_else(Error::code, |_| Code::Ok)
}

/// The map a request names, for the audit log (whatever it looks like).
fn audit_name(r: &Option<pb::MapRef>) -> String {
    match r.as_ref().and_then(|r| r.r#ref.as_ref()) {
        Some(pb::map_ref::Ref::Path(p)) => p.clone(),
        Some(pb::map_ref::Ref::Id(id)) => format!("id:{id}"),
        None => String::new(),
    }
}

/// Runs kernel work on the blocking pool.
async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> Result<T, Error> + Send + 'static,
) -> Result<T, Error> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| Error::Internal {
            map: String::new(),
            message: format!("worker failed: {e}"),
        })?
}

fn parse_ref(r: Option<pb::MapRef>) -> Result<MapRef, Error> {
    match r.and_then(|r| r.r#ref) {
        Some(pb::map_ref::Ref::Path(p)) => Catalog::parse_path(&p),
        Some(pb::map_ref::Ref::Id(id)) => Ok(MapRef::Id(id)),
        None => Err(Error::InvalidArgument(
            "the request names no map: set map.path (e.g. {\"map\":{\"path\":\"demo/flows\"}}) or map.id".into(),
        )),
    }
}

pub fn map_info(path: Option<String>, m: &MapMeta) -> pb::MapInfo {
    let dump_method = match m.method() {
        Method::BatchBucket | Method::BatchKey => pb::DumpMethod::Batch,
        Method::KeyByKey => pb::DumpMethod::KeyByKey,
        Method::None => pb::DumpMethod::None,
    };
    pb::MapInfo {
        path: path.unwrap_or_default(),
        id: m.id,
        name: m.name.clone(),
        r#type: m.map_type as i32,
        type_name: kernel::type_name(m.map_type).into_owned(),
        key_size: m.key_size,
        value_size: m.value_size,
        max_entries: m.max_entries,
        flags: m.flags,
        per_cpu: m.per_cpu(),
        possible_cpus: m.possible_cpus,
        btf_id: m.btf_id,
        btf_key_type_id: m.btf_key_type_id,
        btf_value_type_id: m.btf_value_type_id,
        dump_method: dump_method as i32,
    }
}

#[tonic::async_trait]
impl MapService for MapServiceImpl {
    async fn list_maps(
        &self,
        request: Request<pb::ListMapsRequest>,
    ) -> Result<Response<pb::ListMapsResponse>, Status> {
        let started = Instant::now();
        let caller = Caller::of(&request)?;
        let catalog = self.catalog.clone();
        let listed = blocking(move || Ok(catalog.list())).await;
        let policy = self.policy();
        let result = listed.map(|maps| {
            maps.into_iter()
                .filter(|(path, m)| {
                    let name = path.clone().unwrap_or_else(|| format!("id:{}", m.id));
                    policy.allows(&caller.identity, Operation::List, &name)
                })
                .map(|(p, m)| map_info(p, &m))
                .collect::<Vec<_>>()
        });
        let n = result.as_ref().map_or(0, |m| m.len() as u64);
        audit::record(&caller, "ListMaps", "", n, code_of(&result), started);
        Ok(Response::new(pb::ListMapsResponse { maps: result? }))
    }

    async fn get_map(
        &self,
        request: Request<pb::GetMapRequest>,
    ) -> Result<Response<pb::MapInfo>, Status> {
        let started = Instant::now();
        let caller = Caller::of(&request)?;
        let map = request.into_inner().map;
        let name = audit_name(&map);
        let result = self.get_map_inner(&caller, map).await;
        audit::record(&caller, "GetMap", &name, 0, code_of(&result), started);
        Ok(Response::new(result?))
    }

    type DumpMapStream = dump::ChunkStream;

    async fn dump_map(
        &self,
        request: Request<pb::DumpMapRequest>,
    ) -> Result<Response<Self::DumpMapStream>, Status> {
        let started = Instant::now();
        let caller = Caller::of(&request)?;
        let req = request.into_inner();
        let name = audit_name(&req.map);
        match self.dump_inner(&caller, req, started).await {
            // The producer writes the audit record when the stream ends.
            Ok(stream) => Ok(Response::new(stream)),
            Err(e) => {
                audit::record(&caller, "DumpMap", &name, 0, e.code(), started);
                Err(e.into())
            }
        }
    }

    async fn lookup(
        &self,
        request: Request<pb::LookupRequest>,
    ) -> Result<Response<pb::LookupResponse>, Status> {
        let started = Instant::now();
        let caller = Caller::of(&request)?;
        let req = request.into_inner();
        let name = audit_name(&req.map);
        let result = self.lookup_inner(&caller, req).await;
        let found = result
            .as_ref()
            .map_or(0, |r| r.iter().filter(|x| x.found).count() as u64);
        audit::record(&caller, "Lookup", &name, found, code_of(&result), started);
        Ok(Response::new(pb::LookupResponse { results: result? }))
    }
}
