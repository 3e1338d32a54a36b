//! The gRPC handlers: validate, call the domain, map errors. Kernel work runs
//! on the blocking pool; nothing here holds a lock across maps.

use std::{pin::Pin, sync::Arc};

use bpfmap_proto::v1::{self as pb, map_service_server::MapService};
use tokio::sync::{mpsc, watch};
use tokio_stream::{Stream, wrappers::ReceiverStream};
use tonic::{Request, Response, Status};

use crate::{
    catalog::{Catalog, MapRef, Resolved},
    cursor::CursorKey,
    dump::{self, DumpJob, DumpStats},
    error::Error,
    kernel::{self, MapMeta, Method, sys::ENOTSUPP, walk::Walker},
};

/// Most keys accepted in one Lookup call.
pub const MAX_LOOKUP_KEYS: usize = 4096;

#[derive(Debug, Clone)]
pub struct MapServiceImpl {
    catalog: Arc<Catalog>,
    key: CursorKey,
    shutdown: watch::Receiver<bool>,
    stats: Arc<DumpStats>,
}

impl MapServiceImpl {
    pub fn new(
        catalog: Catalog,
        key: CursorKey,
        shutdown: watch::Receiver<bool>,
        stats: Arc<DumpStats>,
    ) -> Self {
        Self {
            catalog: Arc::new(catalog),
            key,
            shutdown,
            stats,
        }
    }

    async fn open(&self, r: &MapRef) -> Result<Resolved, Error> {
        let catalog = self.catalog.clone();
        let r = r.clone();
        blocking(move || catalog.open(&r)).await
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

type DumpStream = Pin<Box<dyn Stream<Item = Result<pb::DumpMapResponse, Status>> + Send>>;

#[tonic::async_trait]
impl MapService for MapServiceImpl {
    async fn list_maps(
        &self,
        _request: Request<pb::ListMapsRequest>,
    ) -> Result<Response<pb::ListMapsResponse>, Status> {
        let catalog = self.catalog.clone();
        let maps = blocking(move || Ok(catalog.list())).await?;
        Ok(Response::new(pb::ListMapsResponse {
            maps: maps.into_iter().map(|(p, m)| map_info(p, &m)).collect(),
        }))
    }

    async fn get_map(
        &self,
        request: Request<pb::GetMapRequest>,
    ) -> Result<Response<pb::MapInfo>, Status> {
        let r = parse_ref(request.into_inner().map)?;
        let resolved = self.open(&r).await?;
        Ok(Response::new(map_info(
            resolved.path,
            resolved.handle.meta(),
        )))
    }

    type DumpMapStream = DumpStream;

    async fn dump_map(
        &self,
        request: Request<pb::DumpMapRequest>,
    ) -> Result<Response<Self::DumpMapStream>, Status> {
        let req = request.into_inner();
        let map_ref = parse_ref(req.map)?;
        let layout = pb::Layout::try_from(req.layout).map_err(|_| {
            Error::InvalidArgument(format!(
                "unknown layout {}; use LAYOUT_ENTRIES (0) or LAYOUT_PACKED (1)",
                req.layout
            ))
        })?;
        // The cursor is checked before the map is touched: a bad cursor is a
        // bad request whatever state the map is in.
        let cursor = if req.cursor.is_empty() {
            None
        } else {
            let c = self.key.decode(&req.cursor).map_err(Error::from)?;
            if c.map_ref != map_ref.canonical() {
                return Err(Error::CursorForAnotherMap {
                    cursor_ref: c.map_ref,
                    request_ref: map_ref.canonical(),
                }
                .into());
            }
            Some(c)
        };
        let resolved = self.open(&map_ref).await?;
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
                    }
                    .into());
                }
                c.position
            }
        };
        let chunk = dump::effective_chunk(req.chunk_size, &meta);
        let walker = Walker::new(resolved.handle, meta, position)
            .map_err(|e| Error::from_walk(&map_ref.to_string(), e))?;
        let job = DumpJob {
            map_ref,
            walker,
            layout,
            chunk,
            limit: req.limit,
            key: self.key.clone(),
        };
        let (tx, rx) = mpsc::channel(dump::CHANNEL_DEPTH);
        tokio::spawn(dump::run(
            job,
            tx,
            self.shutdown.clone(),
            self.stats.clone(),
        ));
        Ok(Response::new(Box::pin(ReceiverStream::new(rx))))
    }

    async fn lookup(
        &self,
        request: Request<pb::LookupRequest>,
    ) -> Result<Response<pb::LookupResponse>, Status> {
        let req = request.into_inner();
        let map_ref = parse_ref(req.map)?;
        if req.keys.is_empty() {
            return Err(Error::InvalidArgument("no keys to look up; set keys".into()).into());
        }
        if req.keys.len() > MAX_LOOKUP_KEYS {
            return Err(Error::InvalidArgument(format!(
                "{} keys in one Lookup; at most {MAX_LOOKUP_KEYS} are allowed, split the request",
                req.keys.len()
            ))
            .into());
        }
        let resolved = self.open(&map_ref).await?;
        let meta = resolved.handle.meta().clone();
        let name = map_ref.to_string();
        if meta.key_size == 0 {
            return Err(Error::LookupUnsupported {
                map: name,
                type_name: kernel::type_name(meta.map_type).into_owned(),
            }
            .into());
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
            ))
            .into());
        }
        let results = blocking(move || {
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
        .await?;
        Ok(Response::new(pb::LookupResponse { results }))
    }
}
