//! `arrow.flight.protocol.FlightService`: maps as Arrow tables, on the
//! daemon's listener behind the same front door as MapService (TLS,
//! callers, policy, limits, audit, metrics). Thin handlers over `tables`
//! and `dump`: a descriptor's command (or a path naming a map) is read,
//! the domain answers, its error becomes a status.

mod table_stream;

use std::collections::VecDeque;

use arrow_flight::{
    Action, ActionType, Criteria, Empty, FlightData, FlightDescriptor, FlightEndpoint, FlightInfo,
    HandshakeRequest, HandshakeResponse, PollInfo, PutResult, SchemaAsIpc, SchemaResult, Ticket,
    flight_descriptor::DescriptorType, flight_service_server::FlightService,
};
use arrow_ipc::writer::IpcWriteOptions;
use bpfmap_proto::v1 as pb;
use futures::stream::{self, BoxStream, StreamExt as _};
use tonic::{Request, Response, Status, Streaming};

pub use table_stream::Encoder as FlightEncoder;
use table_stream::{Encoder, TableStream};

use super::{ServiceParts, dump_stream::DumpStream, status::code_of, streamed};
use crate::{
    access,
    aggregate::Aggregator,
    dump::{self, DumpCall},
    error::Error,
    info,
    model::{Caller, Rpc},
    net::caller_of,
    tables::{self, Command, Described, GroupsCall, TableDump},
    wire,
};

/// `arrow.flight.protocol.FlightService`.
#[derive(Debug, Clone)]
pub(crate) struct FlightServiceImpl(std::sync::Arc<ServiceParts>);

impl FlightServiceImpl {
    /// The service made of `parts` (the map service's).
    pub(crate) fn new(parts: std::sync::Arc<ServiceParts>) -> Self {
        Self(parts)
    }
}

/// A call's caller and audit record.
fn start<T>(request: &Request<T>, rpc: Rpc) -> Result<(Caller, access::Record), Status> {
    let caller = caller_of(request)?;
    let mut audit = access::Record::start(&caller, rpc);
    audit.on_behalf_of(request.metadata());
    Ok((caller, audit))
}

/// The command a descriptor names: its `cmd`, or a path naming one map
/// (`["demo/flows"]`, or its parts `["demo", "flows"]`) to read whole.
fn command_of(d: &FlightDescriptor) -> Result<Command, Error> {
    match DescriptorType::try_from(d.r#type) {
        Ok(DescriptorType::Path) if !d.path.is_empty() => {
            let map = Some(pb::MapRef {
                r#ref: Some(pb::map_ref::Ref::Path(d.path.join("/"))),
                declare: None,
            });
            Ok(Command::Dump(pb::DumpMapRequest {
                map,
                ..Default::default()
            }))
        }
        Ok(DescriptorType::Cmd) => Command::parse(&d.cmd),
        _ => Err(Error::InvalidArgument(
            "a descriptor names a map by its path, or carries a bpfmap.v1.FlightCommand (CMD)"
                .into(),
        )),
    }
}

/// The map a command reads, for the audit log and the call.
fn map_of(command: &Command) -> Option<&pb::MapRef> {
    match command {
        Command::Dump(d) => d.map.as_ref(),
        Command::Aggregate(a) => a.map.as_ref(),
    }
}

impl FlightServiceImpl {
    /// A descriptor's table described, its call audited.
    async fn described(
        &self,
        request: Request<FlightDescriptor>,
        rpc: Rpc,
    ) -> Result<(Command, Described), Status> {
        let (caller, mut audit) = start(&request, rpc)?;
        let described = async {
            let command = command_of(request.get_ref())?;
            let map = wire::map_request(map_of(&command));
            audit.request_map(&map, map_of(&command));
            let table = tables::describe(&self.0.calls, &caller, rpc, map?, &command).await?;
            Ok::<_, Error>((command, table))
        }
        .await;
        audit.finish(code_of(&described));
        Ok(described?)
    }

    /// A dump's table streamed.
    async fn dump_table(
        &self,
        caller: &Caller,
        mut audit: access::Record,
        req: pb::DumpMapRequest,
    ) -> Result<Response<BoxStream<'static, Result<FlightData, Status>>>, Status> {
        let p = &self.0;
        let started = async {
            let TableDump { req, per_cpu } = tables::dump_of(req)?;
            let map = wire::map_request(req.map.as_ref());
            audit.request_map(&map, req.map.as_ref());
            let call = DumpCall {
                caller,
                map: map?,
                req,
                rpc: Rpc::FlightDoGet,
                table: true,
            };
            let job = dump::start_call(&p.calls, &p.dumps, call).await?;
            let records = job.records().expect("a started dump's records").clone();
            Ok::<_, Error>((job, tables::table_of(&records, per_cpu)?))
        }
        .await;
        streamed(started, audit, |(job, table), audit| {
            let env = p.dumps.env.clone();
            let stats = env.stats.clone();
            let started = dump::spawn(job, audit.started(), env);
            let trim = p.dumps.trimmer.enter();
            let dump = DumpStream::new(started, audit, trim, stats);
            Response::new(TableStream::new(dump, table).boxed())
        })
    }

    /// An aggregate's table: one batch of its groups.
    async fn groups_table(
        &self,
        caller: &Caller,
        mut audit: access::Record,
        req: pb::AggregateMapRequest,
    ) -> Result<Response<BoxStream<'static, Result<FlightData, Status>>>, Status> {
        let p = &self.0;
        let map = wire::map_request(req.map.as_ref());
        audit.request_map(&map, req.map.as_ref());
        let call = GroupsCall {
            aggregator: Aggregator {
                calls: &p.calls,
                dumps: &p.dumps,
                max_groups: p.max_groups,
            },
            caller,
            rpc: Rpc::FlightDoGet,
        };
        let result = match map {
            Ok(map) => tables::groups(call, map, req).await,
            Err(e) => Err(e),
        };
        audit.add_entries(result.as_ref().map_or(0, |(b, _)| b.num_rows() as u64));
        audit.finish(code_of(&result));
        let (batch, summary) = result?;
        let mut encoder = Encoder::new();
        let mut messages = VecDeque::from([encoder.schema(&batch.schema())]);
        let metadata = serde_json::json!({
            "done": true,
            "groups_total": summary.groups_total,
            "entries_scanned": summary.entries_scanned,
            "entries_matched": summary.entries_matched,
            "scanned_in_kernel": summary.scanned_in_kernel,
        });
        encoder.batch(&batch, metadata.to_string().into_bytes(), &mut messages)?;
        Ok(Response::new(
            stream::iter(messages.into_iter().map(Ok)).boxed(),
        ))
    }
}

fn unimplemented<T>(what: &str) -> Result<T, Status> {
    Err(Status::unimplemented(format!(
        "{what}: bpfmapd serves tables of maps (GetFlightInfo, GetSchema, DoGet, ListFlights); callers are identified by their TLS client certificate, not a handshake"
    )))
}

#[tonic::async_trait]
impl FlightService for FlightServiceImpl {
    type HandshakeStream = BoxStream<'static, Result<HandshakeResponse, Status>>;
    type ListFlightsStream = BoxStream<'static, Result<FlightInfo, Status>>;
    type DoGetStream = BoxStream<'static, Result<FlightData, Status>>;
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
        let (caller, mut audit) = start(&request, Rpc::FlightListFlights)?;
        let p = &self.0;
        let listed = async {
            let criteria = tables::command::criteria(&request.get_ref().expression)?;
            let maps = info::list(&p.calls, &caller, criteria).await?;
            Ok::<_, Error>(tables::flights(&p.calls, &caller, maps).await)
        }
        .await;
        audit.add_entries(listed.as_ref().map_or(0, |l| l.len() as u64));
        audit.finish(code_of(&listed));
        let infos = listed?
            .into_iter()
            .map(|(command, described)| flight_info(&command, &described));
        let infos: Vec<_> = infos.collect::<Result<_, _>>()?;
        Ok(Response::new(
            stream::iter(infos.into_iter().map(Ok)).boxed(),
        ))
    }

    async fn get_flight_info(
        &self,
        request: Request<FlightDescriptor>,
    ) -> Result<Response<FlightInfo>, Status> {
        let (command, described) = self.described(request, Rpc::FlightGetFlightInfo).await?;
        Ok(Response::new(flight_info(&command, &described)?))
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
        let (_, described) = self.described(request, Rpc::FlightGetSchema).await?;
        let options = IpcWriteOptions::default();
        let schema = SchemaAsIpc::new(&described.schema, &options);
        let result = SchemaResult::try_from(schema)
            .map_err(|e| Status::internal(format!("the schema could not be encoded: {e}")))?;
        Ok(Response::new(result))
    }

    async fn do_get(
        &self,
        request: Request<Ticket>,
    ) -> Result<Response<Self::DoGetStream>, Status> {
        let (caller, audit) = start(&request, Rpc::FlightDoGet)?;
        match Command::parse(&request.get_ref().ticket) {
            Ok(Command::Dump(req)) => self.dump_table(&caller, audit, req).await,
            Ok(Command::Aggregate(req)) => self.groups_table(&caller, audit, req).await,
            Err(e) => {
                audit.finish(super::code(&e));
                Err(e.into())
            }
        }
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

/// The FlightInfo of a command's table: its schema, one endpoint whose
/// ticket is the command (on this server), its rows when known.
fn flight_info(command: &Command, described: &Described) -> Result<FlightInfo, Status> {
    let bytes = command.to_bytes();
    let endpoint = FlightEndpoint::new().with_ticket(Ticket::new(bytes.clone()));
    let info = FlightInfo::new()
        .try_with_schema(&described.schema)
        .map_err(|e| Status::internal(format!("the schema could not be encoded: {e}")))?
        .with_descriptor(FlightDescriptor::new_cmd(bytes))
        .with_endpoint(endpoint)
        .with_total_records(described.rows.map_or(-1, |r| r as i64))
        .with_total_bytes(-1)
        .with_ordered(true);
    Ok(info)
}
