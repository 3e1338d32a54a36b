//! `bpfmap.v1.FleetService`: each handler names the caller and its
//! deadline, calls its domain (`info`, `dump`, `aggregate`, `watch`) and
//! turns the domain's error into a status (`status`); none holds domain
//! logic.

use bpfmap_client::pb;
use bpfmapd::frontend::caller_of;
use tonic::{Request, Response, Status};

use crate::{
    aggregate,
    call::{Answers, Asker, Calls},
    dump, histogram, info, stacks, watch,
};

/// `bpfmap.v1.FleetService`.
#[derive(Debug)]
pub(crate) struct FleetServiceImpl {
    pub(crate) calls: Calls,
}

#[tonic::async_trait]
impl pb::fleet_service_server::FleetService for FleetServiceImpl {
    async fn list_targets(
        &self,
        request: Request<pb::ListTargetsRequest>,
    ) -> Result<Response<pb::ListTargetsResponse>, Status> {
        caller_of(&request)?;
        Ok(Response::new(pb::ListTargetsResponse {
            targets: self.calls.targets.states(),
        }))
    }

    type ListMapsStream = Answers<pb::FleetServiceListMapsResponse>;

    async fn list_maps(
        &self,
        request: Request<pb::FleetServiceListMapsRequest>,
    ) -> Result<Response<Self::ListMapsStream>, Status> {
        let asker = Asker::of(&request)?;
        let answers = info::list_maps(&self.calls, asker, request.into_inner())?;
        Ok(Response::new(answers))
    }

    type GetMapStream = Answers<pb::FleetServiceGetMapResponse>;

    async fn get_map(
        &self,
        request: Request<pb::FleetServiceGetMapRequest>,
    ) -> Result<Response<Self::GetMapStream>, Status> {
        let asker = Asker::of(&request)?;
        let answers = info::get_map(&self.calls, asker, request.into_inner())?;
        Ok(Response::new(answers))
    }

    type LookupStream = Answers<pb::FleetServiceLookupResponse>;

    async fn lookup(
        &self,
        request: Request<pb::FleetServiceLookupRequest>,
    ) -> Result<Response<Self::LookupStream>, Status> {
        let asker = Asker::of(&request)?;
        let answers = info::lookup(&self.calls, asker, request.into_inner())?;
        Ok(Response::new(answers))
    }

    type DumpMapStream = Answers<pb::FleetServiceDumpMapResponse>;

    async fn dump_map(
        &self,
        request: Request<pb::FleetServiceDumpMapRequest>,
    ) -> Result<Response<Self::DumpMapStream>, Status> {
        let asker = Asker::of(&request)?;
        let answers = dump::start(&self.calls, asker, request.into_inner())?;
        Ok(Response::new(answers))
    }

    async fn aggregate_map(
        &self,
        request: Request<pb::FleetServiceAggregateMapRequest>,
    ) -> Result<Response<pb::FleetServiceAggregateMapResponse>, Status> {
        let asker = Asker::of(&request)?;
        let answer = aggregate::run(&self.calls, asker, request.into_inner()).await?;
        Ok(Response::new(answer))
    }

    async fn histogram_map(
        &self,
        request: Request<pb::FleetServiceHistogramMapRequest>,
    ) -> Result<Response<pb::FleetServiceHistogramMapResponse>, Status> {
        let asker = Asker::of(&request)?;
        let answer = histogram::run(&self.calls, asker, request.into_inner()).await?;
        Ok(Response::new(answer))
    }

    async fn stack_map(
        &self,
        request: Request<pb::FleetServiceStackMapRequest>,
    ) -> Result<Response<pb::FleetServiceStackMapResponse>, Status> {
        let asker = Asker::of(&request)?;
        let answer = stacks::run(&self.calls, asker, request.into_inner()).await?;
        Ok(Response::new(answer))
    }

    type WatchMapStream = Answers<pb::FleetServiceWatchMapResponse>;

    async fn watch_map(
        &self,
        request: Request<pb::FleetServiceWatchMapRequest>,
    ) -> Result<Response<Self::WatchMapStream>, Status> {
        let asker = Asker::of(&request)?;
        let answers = watch::start(&self.calls, asker, request.into_inner())?;
        Ok(Response::new(answers))
    }
}
