//! The fleet's tables: one table of every target's entries, a
//! `target` column first (the columns of a daemon's table after it), each
//! target's end and failure in-band in `app_metadata`, never failing the
//! call; the fleet cursor after every batch. An aggregate's table is the
//! fleet's merged groups. The commands are the daemon's
//! (`bpfmap.v1.FlightCommand`), with `targets` and `fleet_cursor`.

use std::{
    collections::{BTreeSet, HashMap, VecDeque},
    pin::Pin,
    sync::Arc,
    task::{Context, Poll},
};

use arrow_array::{ArrayRef, RecordBatch, RecordBatchOptions, StringArray};
use arrow_flight::{
    FlightData, FlightDescriptor, FlightEndpoint, FlightInfo, Ticket,
    flight_descriptor::DescriptorType,
};
use arrow_schema::{DataType, Field, Schema, SchemaRef};
use bpfmap_client::{
    FleetEvent, MapInfo, MapName, pb,
    table::{
        FleetTable, FleetTableError, PerCpuColumns, Record, TableInfo, TableLayout,
        aggregate_array, aggregate_decimal, aggregate_field, with_target,
    },
};
use bpfmap_proto::{
    flight,
    status::Reason,
    typed::{MapLayout, MapShape, Projection},
};
use bpfmapd::{FlightEncoder, Operation};
use futures::{Stream, StreamExt as _, stream::BoxStream};
use prost::Message as _;
use serde_json::json;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Code, Status};

use crate::{
    aggregate,
    call::{Ask, Asker, Calls},
    dump::{self, Sealed, SealedPart},
    error::Error,
};

/// A table's response stream.
pub(crate) type Table = BoxStream<'static, Result<FlightData, Status>>;

/// A command as the relay reads it.
#[derive(Debug, Clone)]
pub(crate) struct Command {
    command: pb::flight_command::Command,
    targets: Option<pb::TargetSelector>,
    fleet_cursor: String,
}

impl Command {
    /// The command in a ticket's bytes.
    pub(crate) fn parse(bytes: &[u8]) -> Result<Self, Error> {
        let c = flight::command(bytes)?;
        Ok(Self {
            command: c.command.expect("a command checked"),
            targets: c.targets,
            fleet_cursor: c.fleet_cursor,
        })
    }

    /// A descriptor's command, or a path naming one map read whole.
    pub(crate) fn of_descriptor(d: &FlightDescriptor) -> Result<Self, Error> {
        match DescriptorType::try_from(d.r#type) {
            Ok(DescriptorType::Path) if !d.path.is_empty() => Ok(Self::of_path(&d.path.join("/"))),
            Ok(DescriptorType::Cmd) => Self::parse(&d.cmd),
            _ => Err(Error::Descriptor),
        }
    }

    fn of_path(path: &str) -> Self {
        let map = pb::MapRef {
            r#ref: Some(pb::map_ref::Ref::Path(path.to_owned())),
            declare: None,
        };
        Self {
            command: pb::flight_command::Command::Dump(pb::DumpMapRequest {
                map: Some(map),
                ..Default::default()
            }),
            targets: None,
            fleet_cursor: String::new(),
        }
    }

    /// The command as protobuf bytes (a ticket).
    fn to_bytes(&self) -> Vec<u8> {
        pb::FlightCommand {
            command: Some(self.command.clone()),
            targets: self.targets.clone(),
            fleet_cursor: self.fleet_cursor.clone(),
        }
        .encode_to_vec()
    }

    fn ask(&self) -> Ask<'_> {
        use pb::flight_command::Command as C;
        let (op, map) = match &self.command {
            C::Dump(d) => (Operation::Dump, d.map.as_ref()),
            C::Aggregate(a) => (Operation::Aggregate, a.map.as_ref()),
        };
        Ask {
            op,
            map,
            targets: self.targets.as_ref(),
        }
    }
}

/// The dump a table runs (packed, each CPU's value) and how its per-CPU
/// values become columns.
fn table_dump(req: pb::DumpMapRequest) -> Result<(pb::DumpMapRequest, PerCpuColumns), Error> {
    Ok(flight::table_request(req)?)
}

/// The records' layout of a dump on a target with `info`: its projection
/// (with `fields`) or its types, with the request's renderings.
fn layout_of(
    info: &MapInfo,
    fields: &[String],
    render: &HashMap<String, String>,
) -> Result<MapLayout, Error> {
    let layout = match info.types_with(render).map_err(Error::Request)? {
        Some(t) => t.layout().clone(),
        None => {
            let p = info.as_proto();
            let cpus = p.per_cpu.then_some(p.possible_cpus as usize);
            let shape = MapShape::new(p.key_size as usize, p.value_size as usize);
            MapLayout::untyped(shape.with_cpus(cpus))
        }
    };
    match fields.is_empty() {
        true => Ok(layout),
        false => Ok(Projection::new(fields, &layout)?.layout().clone()),
    }
}

fn table_of(layout: &MapLayout, per_cpu: PerCpuColumns, map: &str) -> Result<TableLayout, Error> {
    let info = TableInfo {
        map: map.to_owned(),
        ..Default::default()
    };
    TableLayout::new(layout, per_cpu, &info).map_err(|error| Error::Columns {
        map: map.to_owned(),
        error,
    })
}

/// A map's description, from the first of the call's targets that gives
/// one, and the map as the call names it.
struct Described {
    info: MapInfo,
    map: String,
}

/// Describes the map of `ask`: GetMap on its targets, the answer of the
/// first target in the call's order that gives one (whichever answers
/// first, the table is the same).
async fn describe(calls: &Calls, asker: &Asker, ask: Ask<'_>) -> Result<Described, Error> {
    let call = calls.start(
        asker.clone(),
        Ask {
            op: Operation::List,
            ..ask
        },
    )?;
    let map = call.map.to_string();
    let mut run = calls.fleet(&call.asker, &call.targets).get_map(&call.map);
    let (mut answers, mut failed) = (HashMap::new(), HashMap::new());
    while let Some(event) = run.next().await {
        match event {
            FleetEvent::Answer { target, answer } => {
                answers.insert(target, answer);
            }
            FleetEvent::Done(report) => {
                if let Some(e) = report.error {
                    failed.insert(report.target, e);
                }
            }
            _ => continue,
        }
        for t in &call.targets {
            if let Some(info) = answers.remove(t) {
                return Ok(Described { info, map });
            }
            if !failed.contains_key(t) {
                break; // not answered yet
            }
        }
    }
    let failures = call
        .targets
        .iter()
        .filter_map(|t| failed.remove(t))
        .collect();
    Err(Error::Undescribed { map, failures })
}

/// The schema of a command's table.
pub(crate) async fn schema(
    calls: &Calls,
    asker: &Asker,
    command: &Command,
) -> Result<SchemaRef, Error> {
    use pb::flight_command::Command as C;
    let d = describe(calls, asker, command.ask()).await?;
    match &command.command {
        C::Dump(req) => {
            let (req, per_cpu) = table_dump(req.clone())?;
            let layout = layout_of(&d.info, &req.fields, &req.render)?;
            Ok(with_target(table_of(&layout, per_cpu, &d.map)?.schema()))
        }
        C::Aggregate(req) => Ok(GroupColumns::of(&d, req)?.schema),
    }
}

/// The FlightInfo of a command's table: its schema, one endpoint whose
/// ticket is the command (on this relay).
pub(crate) fn flight_info(command: &Command, schema: &Schema) -> Result<FlightInfo, Status> {
    let bytes = command.to_bytes();
    let endpoint = FlightEndpoint::new().with_ticket(Ticket::new(bytes.clone()));
    let info = FlightInfo::new()
        .try_with_schema(schema)
        .map_err(|e| Status::internal(format!("the schema could not be encoded: {e}")))?
        .with_descriptor(FlightDescriptor::new_cmd(bytes))
        .with_endpoint(endpoint)
        .with_total_records(-1)
        .with_total_bytes(-1)
        .with_ordered(false);
    Ok(info)
}

/// A command's table, streamed.
pub(crate) async fn table(calls: &Calls, asker: Asker, command: Command) -> Result<Table, Error> {
    use pb::flight_command::Command as C;
    match command.command.clone() {
        C::Dump(req) => dump_table(calls, asker, command, req).await,
        C::Aggregate(req) => groups_table(calls, asker, command, req).await,
    }
}

/// A dump's table: every target's batches and ends, its columns those of
/// the first target (in the call's order) that describes the map. When
/// none does, the targets' dumps say why in-band (an empty table).
async fn dump_table(
    calls: &Calls,
    asker: Asker,
    command: Command,
    req: pb::DumpMapRequest,
) -> Result<Table, Error> {
    let (req, per_cpu) = table_dump(req)?;
    let described = match describe(calls, &asker, command.ask()).await {
        Ok(d) => Some(d),
        Err(Error::Undescribed { .. }) => None,
        Err(e) => return Err(e),
    };
    let mut table = FleetTable::new(per_cpu, &map_text(req.map.as_ref()));
    if let Some(d) = described {
        let layout = layout_of(&d.info, &req.fields, &req.render)?;
        table = table
            .with_layout(&layout)
            .map_err(|error| Error::Columns { map: d.map, error })?;
    }
    let fleet = pb::FleetServiceDumpMapRequest {
        request: Some(req),
        targets: command.targets,
        cursor: command.fleet_cursor,
        target_cursors: Default::default(),
    };
    let events = dump::events(calls, asker, fleet, true)?;
    Ok(FleetFlight::new(events, table).boxed())
}

/// A map as a request names it ("" when it names none).
fn map_text(map: Option<&pb::MapRef>) -> String {
    map.and_then(|m| MapName::from_proto(m).ok())
        .map(|m| m.to_string())
        .unwrap_or_default()
}

/// An aggregate's table: the fleet's merged groups, one batch, with what
/// the fleet call says of its targets in its `app_metadata`.
async fn groups_table(
    calls: &Calls,
    asker: Asker,
    command: Command,
    req: pb::AggregateMapRequest,
) -> Result<Table, Error> {
    let d = describe(calls, &asker, command.ask()).await?;
    let columns = GroupColumns::of(&d, &req)?;
    let fleet = pb::FleetServiceAggregateMapRequest {
        request: Some(req.clone()),
        targets: command.targets,
    };
    let answer = aggregate::run(calls, asker, fleet).await?;
    let batch = columns.batch(&req, &answer);
    let batch = batch.map_err(|e| Status::internal(format!("the groups' table: {e}")));
    let failed: Vec<_> = answer.failed.iter().map(failure_json).collect();
    let metadata = json!({
        "done": true,
        "method": answer.method,
        "answered": answer.answered,
        "failed": failed,
    });
    let mut encoder = FlightEncoder::new();
    let messages = batch.and_then(|batch| {
        let mut out = VecDeque::from([encoder.schema(&batch.schema())]);
        encoder.batch(&batch, metadata.to_string().into_bytes(), &mut out)?;
        Ok(out)
    });
    let messages: Vec<Result<FlightData, Status>> = match messages {
        Ok(out) => out.into_iter().map(Ok).collect(),
        Err(status) => vec![Err(status)],
    };
    Ok(futures::stream::iter(messages).boxed())
}

/// The columns of an aggregate's groups: the group-by members (decoded
/// from a group's key bytes: a record of the key's members, then one of
/// the value's), each aggregate by its spelling, then the targets holding
/// the group.
struct GroupColumns {
    key: TableLayout,
    /// Where a group's key bytes split into the two records.
    split: usize,
    schema: SchemaRef,
}

impl GroupColumns {
    fn of(d: &Described, req: &pb::AggregateMapRequest) -> Result<Self, Error> {
        let layout = match req.group_by.is_empty() {
            true => MapLayout::untyped(MapShape::new(0, 0)),
            false => layout_of(&d.info, &req.group_by, &req.render)?,
        };
        let key = table_of(&layout, PerCpuColumns::List, &d.map)?;
        let mut fields: Vec<Field> = key
            .schema()
            .fields()
            .iter()
            .map(|f| f.as_ref().clone())
            .collect();
        fields.extend(req.aggregates.iter().map(aggregate_field));
        fields.push(Field::new("targets", DataType::Utf8, false));
        let metadata = key.schema().metadata().clone();
        Ok(Self {
            split: layout.key().size(),
            schema: Arc::new(Schema::new_with_metadata(fields, metadata)),
            key,
        })
    }

    fn batch(
        &self,
        req: &pb::AggregateMapRequest,
        answer: &pb::FleetServiceAggregateMapResponse,
    ) -> Result<RecordBatch, arrow_schema::ArrowError> {
        let groups: Vec<(&pb::Group, &[String])> = answer
            .groups
            .iter()
            .filter_map(|g| Some((g.group.as_ref()?, g.targets.as_slice())))
            .collect();
        let mut builder = self.key.builder();
        for (g, _) in &groups {
            let (key, value) = g.key_bytes.split_at(self.split.min(g.key_bytes.len()));
            builder.push(Record {
                key,
                value,
                stride: 0,
            });
        }
        let mut columns: Vec<ArrayRef> = builder.finish()?.columns().to_vec();
        for i in 0..req.aggregates.len() {
            let values = groups
                .iter()
                .map(|(g, _)| g.values.get(i).and_then(aggregate_decimal));
            columns.push(aggregate_array(values)?);
        }
        let holders = groups.iter().map(|(_, t)| t.join(","));
        columns.push(Arc::new(StringArray::from_iter_values(holders)));
        let options = RecordBatchOptions::new().with_row_count(Some(groups.len()));
        RecordBatch::try_new_with_options(self.schema.clone(), columns, &options)
    }
}

fn failure_json(f: &pb::TargetFailure) -> serde_json::Value {
    let s = f.status.clone().unwrap_or_default();
    json!({"target": f.target, "code": s.code, "reason": s.reason, "error": s.message})
}

/// The tables of the maps the caller may read on the fleet: one per map
/// path (maps without one differ by id from host to host), described by
/// the first target listing it, each as the command that reads it whole
/// from every target.
pub(crate) async fn flights(
    calls: &Calls,
    asker: &Asker,
    criteria: pb::ListMapsRequest,
) -> Result<Vec<FlightInfo>, Status> {
    let targets = calls.targets.select(&[])?;
    let options = bpfmap_client::ListMapsOptions::from_proto(&criteria);
    let mut run = calls.fleet(asker, &targets).list_maps_with(options);
    let mut seen = BTreeSet::new();
    let mut out = Vec::new();
    let identity = &asker.caller.identity;
    while let Some(event) = run.next().await {
        let FleetEvent::Answer { target, answer } = event else {
            continue;
        };
        for info in answer {
            let Some(path) = info.path().map(str::to_owned) else {
                continue;
            };
            let readable = info.as_proto().dump_method != pb::DumpMethod::None as i32;
            if !readable
                || !calls
                    .policy
                    .allows(identity, Operation::Dump, &path, target.as_str())
                || !seen.insert(path.clone())
            {
                continue;
            }
            let Ok(layout) = layout_of(&info, &[], &HashMap::new()) else {
                continue;
            };
            let Ok(table) = table_of(&layout, PerCpuColumns::List, &path) else {
                continue;
            };
            let command = Command::of_path(&path);
            out.push(flight_info(&command, &with_target(table.schema()))?);
        }
    }
    Ok(out)
}

/// DoGet's stream of a fleet dump's table: the schema (made by the first
/// chunk with entries, or the `target` column alone when none comes), a
/// batch per chunk whose `app_metadata` names its target and the fleet
/// cursor after it, each target's end as a message of `app_metadata`
/// only, and a last message with the fleet cursor.
struct FleetFlight {
    events: ReceiverStream<Sealed>,
    table: FleetTable,
    encoder: FlightEncoder,
    /// Messages ready to send.
    queue: VecDeque<FlightData>,
    /// The `app_metadata` of ends not yet sent (before the schema).
    held: Vec<Vec<u8>>,
    /// The schema, once sent.
    schema: Option<SchemaRef>,
    /// Rows of each target in the table.
    rows: HashMap<String, u64>,
    /// Targets left out: their maps' types differ from the table's.
    differ: HashMap<String, String>,
    /// The fleet cursor after the last event.
    cursor: String,
    done: bool,
}

impl FleetFlight {
    fn new(events: ReceiverStream<Sealed>, table: FleetTable) -> Self {
        let schema = table.schema().cloned();
        let mut flight = Self {
            events,
            table,
            encoder: FlightEncoder::new(),
            queue: VecDeque::new(),
            held: Vec::new(),
            schema: None,
            rows: HashMap::new(),
            differ: HashMap::new(),
            cursor: String::new(),
            done: false,
        };
        if let Some(schema) = schema {
            flight.begin(schema).expect("nothing held yet");
        }
        flight
    }

    /// Queues what an event says.
    fn event(&mut self, event: Sealed) -> Result<(), Status> {
        let Sealed {
            target,
            part,
            cursor,
        } = event;
        self.cursor = cursor;
        match part {
            SealedPart::Chunk(chunk) if !self.differ.contains_key(&target) => {
                match self.table.batch(&target, &chunk) {
                    Ok(Some(batch)) => self.batch(&target, &batch)?,
                    Ok(None) => {}
                    Err(FleetTableError::Arrow(e)) => {
                        return Err(Status::internal(format!("{target}: {e}")));
                    }
                    Err(e) => {
                        self.differ.insert(target, e.to_string());
                    }
                }
            }
            SealedPart::Chunk(_) => {}
            SealedPart::End(end) => {
                let metadata = self.end(&target, end);
                self.held.push(metadata);
                if self.schema.is_some() {
                    self.release()?;
                }
            }
        }
        Ok(())
    }

    /// The ends held, each as a batch without rows: a reader that stops at
    /// the first message without a batch (pyarrow's `read_all`) reads on.
    fn release(&mut self) -> Result<(), Status> {
        let schema = self.schema.clone().expect("begun");
        let empty = RecordBatch::new_empty(schema);
        for metadata in std::mem::take(&mut self.held) {
            self.encoder.batch(&empty, metadata, &mut self.queue)?;
        }
        Ok(())
    }

    fn batch(&mut self, target: &str, batch: &RecordBatch) -> Result<(), Status> {
        if self.schema.is_none() {
            self.begin(batch.schema())?;
        }
        let rows = batch.num_rows();
        *self.rows.entry(target.to_owned()).or_default() += rows as u64;
        let metadata = json!({"target": target, "cursor": self.cursor, "rows": rows});
        let bytes = metadata.to_string().into_bytes();
        self.encoder.batch(batch, bytes, &mut self.queue)
    }

    /// The schema, then the ends held until it was sent.
    fn begin(&mut self, schema: SchemaRef) -> Result<(), Status> {
        self.queue.push_back(self.encoder.schema(&schema));
        self.schema = Some(schema);
        self.release()
    }

    /// A target's end (`app_metadata`): how it ended (left out when its
    /// types differ) and the rows it gave.
    fn end(&self, target: &str, end: pb::TargetEnd) -> Vec<u8> {
        let status = match self.differ.get(target) {
            Some(why) => pb::TargetStatus {
                code: bpfmap_client::code_name(Code::FailedPrecondition).to_owned(),
                reason: Reason::TypesDiffer.as_str().to_owned(),
                message: why.clone(),
            },
            None => end.status.unwrap_or_default(),
        };
        let metadata = json!({
            "target": target,
            "code": status.code,
            "reason": status.reason,
            "error": status.message,
            "entries": self.rows.get(target).copied().unwrap_or(0),
            "complete": end.complete && !self.differ.contains_key(target),
            "cursor": self.cursor,
        });
        metadata.to_string().into_bytes()
    }

    /// The last message: the fleet cursor and the rows.
    fn finish(&mut self) -> Result<(), Status> {
        if self.schema.is_none() {
            self.begin(FleetTable::empty_schema())?;
        }
        let entries: u64 = self.rows.values().sum();
        let metadata = json!({"done": true, "cursor": self.cursor, "entries": entries});
        let data = FlightData::new().with_app_metadata(metadata.to_string().into_bytes());
        self.queue.push_back(data);
        Ok(())
    }
}

impl Stream for FleetFlight {
    type Item = Result<FlightData, Status>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        loop {
            if let Some(data) = self.queue.pop_front() {
                return Poll::Ready(Some(Ok(data)));
            }
            if self.done {
                return Poll::Ready(None);
            }
            match Pin::new(&mut self.events).poll_next(cx) {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(None) => {
                    self.done = true;
                    if let Err(status) = self.finish() {
                        return Poll::Ready(Some(Err(status)));
                    }
                }
                Poll::Ready(Some(event)) => {
                    if let Err(status) = self.event(event) {
                        self.done = true;
                        return Poll::Ready(Some(Err(status)));
                    }
                }
            }
        }
    }
}
