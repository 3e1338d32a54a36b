//! `arrow.flight.protocol.FlightService` of the relay: each handler names
//! the caller and its deadline, reads the command, calls `table` and turns
//! its error into a status; none holds domain logic.

mod table;

use arrow_flight::{
    Action, ActionType, Criteria, Empty, FlightData, FlightDescriptor, FlightInfo,
    HandshakeRequest, HandshakeResponse, PollInfo, PutResult, SchemaAsIpc, SchemaResult, Ticket,
    flight_service_server::FlightService,
};
use arrow_ipc::writer::IpcWriteOptions;
use futures::stream::{self, BoxStream, StreamExt as _};
use tonic::{Request, Response, Status, Streaming};

use crate::{
    call::{Asker, Calls},
    error::Error,
};
use table::Command;

/// `arrow.flight.protocol.FlightService`.
#[derive(Debug)]
pub(crate) struct RelayFlight {
    pub(crate) calls: Calls,
}

fn unimplemented<T>(what: &str) -> Result<T, Status> {
    Err(Status::unimplemented(format!(
        "{what}: bpfmap-relay serves tables of the fleet's maps (GetFlightInfo, GetSchema, DoGet, ListFlights); callers are identified by their TLS client certificate, not a handshake"
    )))
}

#[tonic::async_trait]
impl FlightService for RelayFlight {
    type HandshakeStream = BoxStream<'static, Result<HandshakeResponse, Status>>;
    type ListFlightsStream = BoxStream<'static, Result<FlightInfo, Status>>;
    type DoGetStream = table::Table;
    type DoPutStream = BoxStream<'static, Result<PutResult, Status>>;
    type DoExchangeStream = BoxStream<'static, Result<FlightData, Status>>;
    type DoActionStream = BoxStream<'static, Result<arrow_flight::Result, Status>>;
    type ListActionsStream = BoxStream<'static, Result<ActionType, Status>>;

    async fn handshake(
        &self,
        _: Request<Streaming<HandshakeRequest>>,
    ) -> Result<Response<Self::HandshakeStream>, Status> {
        unimplemented("Handshake")
    }

    async fn list_flights(
        &self,
        request: Request<Criteria>,
    ) -> Result<Response<Self::ListFlightsStream>, Status> {
        let asker = Asker::of(&request)?;
        let criteria =
            bpfmap_proto::flight::criteria(&request.get_ref().expression).map_err(Error::from)?;
        let infos = table::flights(&self.calls, &asker, criteria).await?;
        Ok(Response::new(
            stream::iter(infos.into_iter().map(Ok)).boxed(),
        ))
    }

    async fn get_flight_info(
        &self,
        request: Request<FlightDescriptor>,
    ) -> Result<Response<FlightInfo>, Status> {
        let asker = Asker::of(&request)?;
        let command = Command::of_descriptor(request.get_ref())?;
        let schema = table::schema(&self.calls, &asker, &command).await?;
        Ok(Response::new(table::flight_info(&command, &schema)?))
    }

    async fn poll_flight_info(
        &self,
        _: Request<FlightDescriptor>,
    ) -> Result<Response<PollInfo>, Status> {
        unimplemented("PollFlightInfo")
    }

    async fn get_schema(
        &self,
        request: Request<FlightDescriptor>,
    ) -> Result<Response<SchemaResult>, Status> {
        let asker = Asker::of(&request)?;
        let command = Command::of_descriptor(request.get_ref())?;
        let schema = table::schema(&self.calls, &asker, &command).await?;
        let options = IpcWriteOptions::default();
        let result = SchemaResult::try_from(SchemaAsIpc::new(&schema, &options))
            .map_err(|e| Status::internal(format!("the schema could not be encoded: {e}")))?;
        Ok(Response::new(result))
    }

    async fn do_get(
        &self,
        request: Request<Ticket>,
    ) -> Result<Response<Self::DoGetStream>, Status> {
        let asker = Asker::of(&request)?;
        let command = Command::parse(&request.get_ref().ticket)?;
        Ok(Response::new(
            table::table(&self.calls, asker, command).await?,
        ))
    }

    async fn do_put(
        &self,
        _: Request<Streaming<FlightData>>,
    ) -> Result<Response<Self::DoPutStream>, Status> {
        unimplemented("DoPut (maps are read, not written)")
    }

    async fn do_exchange(
        &self,
        _: Request<Streaming<FlightData>>,
    ) -> Result<Response<Self::DoExchangeStream>, Status> {
        unimplemented("DoExchange")
    }

    async fn do_action(
        &self,
        _: Request<Action>,
    ) -> Result<Response<Self::DoActionStream>, Status> {
        unimplemented("DoAction (there are no actions)")
    }

    async fn list_actions(
        &self,
        _: Request<Empty>,
    ) -> Result<Response<Self::ListActionsStream>, Status> {
        Ok(Response::new(stream::empty().boxed()))
    }
}
