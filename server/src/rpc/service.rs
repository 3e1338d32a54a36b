//! The gRPC handlers of `bpfmap.v1.MapService`. Each one starts the call's
//! audit record, calls its domain (`info`, `lookup`, `dump`, `aggregate`,
//! `watch`, `drain`) and turns the domain's error into a status; none holds
//! domain logic.

use std::sync::Arc;

use bpfmap_proto::v1::{self as pb, map_service_server::MapService};
use tonic::{Request, Response, Status};

use super::{dump_stream::DumpStream, status::code_of};
use crate::{
    access, aggregate,
    calls::Calls,
    drain::{self as draining, DrainStream, Drains},
    dump::{self, Dumps},
    error::Error,
    info,
    lookup::{self, Lookups},
    model::{Caller, MapRequest, Rpc},
    net::caller_of,
    watch::{self, WatchStream, Watches},
    wire,
};

/// What the service is made of: what every call shares, and what each
/// domain does.
#[derive(Debug, Clone)]
pub(crate) struct ServiceParts {
    /// What every call starts from.
    pub(crate) calls: Calls,
    /// Dumps (and aggregates, which walk maps in dump slots).
    pub(crate) dumps: Dumps,
    /// Lookups.
    pub(crate) lookups: Lookups,
    /// Groups one AggregateMap call (or aggregated watch) may hold.
    pub(crate) max_groups: usize,
    /// Every watch.
    pub(crate) watches: Arc<Watches>,
    /// Every drain, and which maps may be drained.
    pub(crate) drains: Arc<Drains>,
    /// The daemon's symbolizer (StackMap's frame names).
    pub(crate) symbols: Arc<crate::stacks::Symbols>,
}

/// `bpfmap.v1.MapService`.
#[derive(Debug, Clone)]
pub(crate) struct MapServiceImpl(Arc<ServiceParts>);

impl MapServiceImpl {
    /// The service made of `parts`.
    pub(crate) fn new(parts: ServiceParts) -> Self {
        Self(Arc::new(parts))
    }

    /// What it is made of (Arrow Flight's service shares it).
    pub(crate) fn parts(&self) -> Arc<ServiceParts> {
        self.0.clone()
    }
}

impl ServiceParts {
    /// What aggregates and histograms read with.
    pub(crate) fn aggregator(&self) -> aggregate::Aggregator<'_> {
        aggregate::Aggregator {
            calls: &self.calls,
            dumps: &self.dumps,
            max_groups: self.max_groups,
        }
    }
}

/// Starts a call: its caller, its audit record, and the map its request
/// names (parsed once, for the audit log and the handler).
fn start_call<T>(
    request: &Request<T>,
    rpc: Rpc,
    map: Option<&pb::MapRef>,
) -> Result<(Caller, access::Record, Result<MapRequest, Error>), Status> {
    let caller = caller_of(request)?;
    let mut audit = access::Record::start(&caller, rpc);
    audit.on_behalf_of(request.metadata());
    let parsed = wire::map_request(map);
    audit.request_map(&parsed, map);
    Ok((caller, audit, parsed))
}

/// A streaming call's response, or its error recorded and turned into a
/// status.
pub(crate) fn streamed<S, O>(
    started: Result<S, Error>,
    audit: access::Record,
    stream: impl FnOnce(S, access::Record) -> Response<O>,
) -> Result<Response<O>, Status> {
    match started {
        // The stream finishes the audit record when it ends.
        Ok(s) => Ok(stream(s, audit)),
        Err(e) => {
            audit.finish(super::code(&e));
            Err(e.into())
        }
    }
}

#[tonic::async_trait]
impl MapService for MapServiceImpl {
    async fn list_maps(
        &self,
        request: Request<pb::ListMapsRequest>,
    ) -> Result<Response<pb::ListMapsResponse>, Status> {
        let caller = caller_of(&request)?;
        let mut audit = access::Record::start(&caller, Rpc::ListMaps);
        audit.on_behalf_of(request.metadata());
        let result = info::list(&self.0.calls, &caller, request.into_inner()).await;
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
            Ok(map) => info::get(&self.0.calls, &caller, map).await,
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
        let p = &self.0;
        let result = match map {
            Ok(map) => aggregate::answer(p.aggregator(), &caller, map, req).await,
            Err(e) => Err(e),
        };
        if let Ok(r) = &result {
            audit.add_entries(r.summary.as_ref().map_or(0, |s| s.entries_matched));
        }
        audit.finish(code_of(&result));
        Ok(Response::new(result?))
    }

    async fn histogram_map(
        &self,
        request: Request<pb::HistogramMapRequest>,
    ) -> Result<Response<pb::HistogramMapResponse>, Status> {
        let (caller, mut audit, map) =
            start_call(&request, Rpc::HistogramMap, request.get_ref().map.as_ref())?;
        let req = request.into_inner();
        let p = &self.0;
        let result = match map {
            Ok(map) => aggregate::histogram::run(p.aggregator(), &caller, map, req).await,
            Err(e) => Err(e),
        };
        if let Ok(r) = &result {
            audit.add_entries(r.summary.as_ref().map_or(0, |s| s.entries_matched));
        }
        audit.finish(code_of(&result));
        Ok(Response::new(result?))
    }

    async fn stack_map(
        &self,
        request: Request<pb::StackMapRequest>,
    ) -> Result<Response<pb::StackMapResponse>, Status> {
        let (caller, mut audit, map) =
            start_call(&request, Rpc::StackMap, request.get_ref().map.as_ref())?;
        let req = request.into_inner();
        let p = &self.0;
        let stack_map = req
            .stack_map
            .as_ref()
            .map(|m| wire::map_request(Some(m)))
            .transpose();
        let with = crate::stacks::Stacker {
            aggregator: p.aggregator(),
            symbols: &p.symbols,
        };
        let result = match (map, stack_map) {
            (Ok(map), Ok(stack_map)) => {
                crate::stacks::run(with, &caller, map, stack_map, req).await
            }
            (Err(e), _) | (_, Err(e)) => Err(e),
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
        let p = &self.0;
        let call = match map {
            Ok(map) => draining::start(&p.calls, &p.drains, &p.dumps, &caller, map, req).await,
            Err(e) => Err(e),
        };
        streamed(call, audit, |call, audit| {
            Response::new(draining::spawn(call, audit))
        })
    }

    async fn watch_map(
        &self,
        request: Request<pb::WatchMapRequest>,
    ) -> Result<Response<Self::WatchMapStream>, Status> {
        let (caller, audit, map) =
            start_call(&request, Rpc::WatchMap, request.get_ref().map.as_ref())?;
        let req = request.into_inner();
        let p = &self.0;
        let started = match map {
            Ok(map) => watch::start(&p.calls, &p.watches, p.max_groups, &caller, map, req).await,
            Err(e) => Err(e),
        };
        let stats = p.watches.stats.clone();
        streamed(started, audit, |(watch, ticket), audit| {
            Response::new(watch::spawn(watch, ticket, stats, audit))
        })
    }

    async fn dump_map(
        &self,
        request: Request<pb::DumpMapRequest>,
    ) -> Result<Response<Self::DumpMapStream>, Status> {
        let (caller, audit, map) =
            start_call(&request, Rpc::DumpMap, request.get_ref().map.as_ref())?;
        let req = request.into_inner();
        let p = &self.0;
        let job = match map {
            Ok(map) => dump::start(&p.calls, &p.dumps, &caller, map, req).await,
            Err(e) => Err(e),
        };
        streamed(job, audit, |job, audit| {
            let env = p.dumps.env.clone();
            let stats = env.stats.clone();
            let started = dump::spawn(job, audit.started(), env);
            let trim = p.dumps.trimmer.enter();
            Response::new(DumpStream::new(started, audit, trim, stats))
        })
    }

    async fn lookup(
        &self,
        request: Request<pb::LookupRequest>,
    ) -> Result<Response<pb::LookupResponse>, Status> {
        let (caller, mut audit, map) =
            start_call(&request, Rpc::Lookup, request.get_ref().map.as_ref())?;
        let req = request.into_inner();
        let result = match map {
            Ok(map) => lookup::run(&self.0.calls, &self.0.lookups, &caller, map, req).await,
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
