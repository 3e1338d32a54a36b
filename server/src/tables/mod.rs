//! Maps as Arrow tables, served over Arrow Flight: a command's table (its
//! schema from the dump's records, or the groups of an aggregate), the
//! tables a caller may read, and a dump's chunks as record batches. The
//! columns are `bpfmap_proto::typed::arrow`'s.

pub(crate) mod command;

use std::sync::Arc;

use arrow_array::{ArrayRef, RecordBatch, RecordBatchOptions};
use arrow_schema::{Field, Schema, SchemaRef};
use bpfmap_kernel::MapMeta;
use bpfmap_proto::{
    typed::{
        EntryRef, MapLayout, MapShape,
        arrow::{
            PerCpuColumns, TableError, TableInfo, TableLayout, aggregate_array, aggregate_decimal,
            aggregate_field,
        },
    },
    v1 as pb,
};

pub(crate) use command::Command;

use crate::{
    aggregate::{self, Aggregator},
    calls::Calls,
    dump::{self, Records},
    error::Error,
    model::{Caller, MapRequest, Rpc},
};

/// The dump a table command runs, and how its per-CPU values become
/// columns.
#[derive(Debug, Clone)]
pub(crate) struct TableDump {
    /// Packed records, each CPU's value (the table sums them when asked).
    pub(crate) req: pb::DumpMapRequest,
    pub(crate) per_cpu: PerCpuColumns,
}

/// The dump of a table command's request.
pub(crate) fn dump_of(req: pb::DumpMapRequest) -> Result<TableDump, Error> {
    let (req, per_cpu) = bpfmap_proto::flight::table_request(req)
        .map_err(|e| Error::InvalidArgument(e.to_string()))?;
    Ok(TableDump { req, per_cpu })
}

/// The table of a dump's records.
pub(crate) fn table_of(records: &Records, per_cpu: PerCpuColumns) -> Result<TableLayout, Error> {
    if per_cpu == PerCpuColumns::Sum && !records.meta.per_cpu() {
        return Err(Error::InvalidArgument(format!(
            "per_cpu = PER_CPU_SUM: map {} is not per-CPU (type {})",
            records.map, records.meta.map_type
        )));
    }
    TableLayout::new(&records.layout, per_cpu, &info(records)).map_err(|e| match e {
        TableError::NotSummable(member) => Error::InvalidArgument(format!(
            "per_cpu = PER_CPU_SUM: the values of map {} cannot be summed: {member} is not an integer",
            records.map
        )),
    })
}

/// What a table says of its map.
fn info(records: &Records) -> TableInfo {
    TableInfo {
        map: records.map.to_string(),
        id: records.meta.id,
        map_type: records.meta.map_type.to_string(),
    }
}

/// A command's table before it is read: its schema, and how many rows it
/// has when that is known without reading (an array without a filter).
#[derive(Debug)]
pub(crate) struct Described {
    pub(crate) schema: SchemaRef,
    pub(crate) rows: Option<u64>,
}

/// Describes `command`'s table, reading the map's types (no slot taken).
pub(crate) async fn describe(
    calls: &Calls,
    caller: &Caller,
    rpc: Rpc,
    map: MapRequest,
    command: &Command,
) -> Result<Described, Error> {
    match command {
        Command::Dump(req) => {
            let TableDump { req, per_cpu } = dump_of(req.clone())?;
            let records = dump::records(calls, caller, rpc, map, &req).await?;
            let table = table_of(&records, per_cpu)?;
            let rows = (req.filter.is_empty() && req.limit == 0 && is_array(&records.meta))
                .then_some(u64::from(records.meta.max_entries));
            Ok(Described {
                schema: table.schema().clone(),
                rows,
            })
        }
        Command::Aggregate(req) => {
            let groups = group_records(calls, caller, rpc, map, req).await?;
            Ok(Described {
                schema: groups_schema(&groups, req)?,
                rows: None,
            })
        }
    }
}

fn is_array(meta: &MapMeta) -> bool {
    use bpfmap_kernel::MapType;
    matches!(meta.map_type, MapType::ARRAY | MapType::PERCPU_ARRAY)
}

/// The records of an aggregate's group keys: its group-by members as a
/// dump's `fields` selects them (one record of the key's, one of the
/// value's, back to back in `Group.key_bytes`).
async fn group_records(
    calls: &Calls,
    caller: &Caller,
    rpc: Rpc,
    map: MapRequest,
    req: &pb::AggregateMapRequest,
) -> Result<Records, Error> {
    let dump = pb::DumpMapRequest {
        map: req.map.clone(),
        fields: req.group_by.clone(),
        render: req.render.clone(),
        layout: pb::Layout::Packed as i32,
        ..Default::default()
    };
    dump::records(calls, caller, rpc, map, &dump).await
}

/// The columns of an aggregate's groups: the group-by members, then each
/// aggregate by its spelling ("sum(value.bytes)"), exact decimals.
fn groups_schema(groups: &Records, req: &pb::AggregateMapRequest) -> Result<SchemaRef, Error> {
    let key = group_table(groups, req)?;
    let mut fields: Vec<Field> = key
        .schema()
        .fields()
        .iter()
        .map(|f| f.as_ref().clone())
        .collect();
    fields.extend(req.aggregates.iter().map(aggregate_field));
    let metadata = key.schema().metadata().clone();
    Ok(Arc::new(Schema::new_with_metadata(fields, metadata)))
}

/// The table of a group key's records (no per-CPU values: they are
/// projections); no columns for the one group of an aggregate without
/// group-by members.
fn group_table(groups: &Records, req: &pb::AggregateMapRequest) -> Result<TableLayout, Error> {
    let layout = match req.group_by.is_empty() {
        true => MapLayout::untyped(MapShape::new(0, 0)),
        false => groups.layout.clone(),
    };
    let records = Records {
        layout,
        ..groups.clone()
    };
    table_of(&records, PerCpuColumns::List)
}

/// What an aggregate's table is read with.
#[derive(Debug, Clone, Copy)]
pub(crate) struct GroupsCall<'a> {
    pub(crate) aggregator: Aggregator<'a>,
    pub(crate) caller: &'a Caller,
    pub(crate) rpc: Rpc,
}

/// Runs an aggregate and returns its groups as one batch: each group's
/// members decoded from its key bytes, then its aggregates.
pub(crate) async fn groups(
    call: GroupsCall<'_>,
    map: MapRequest,
    req: pb::AggregateMapRequest,
) -> Result<(RecordBatch, pb::AggregateSummary), Error> {
    let GroupsCall {
        aggregator,
        caller,
        rpc,
    } = call;
    let records = group_records(aggregator.calls, caller, rpc, map.clone(), &req).await?;
    let schema = groups_schema(&records, &req)?;
    let key = group_table(&records, &req)?;
    let aggregates = req.aggregates.len();
    let req_had_groups = !req.group_by.is_empty();
    let answer = aggregate::run(aggregator, caller, map, req).await?;
    let mut builder = key.builder();
    let split = match req_had_groups {
        true => key_split(&records.layout),
        false => 0,
    };
    for g in &answer.groups {
        let (k, v) = g.key_bytes.split_at(split.min(g.key_bytes.len()));
        builder.push(EntryRef {
            key: k,
            value: v,
            stride: 0,
        });
    }
    let keys = builder.finish().map_err(internal)?;
    let mut columns: Vec<ArrayRef> = keys.columns().to_vec();
    for i in 0..aggregates {
        let values = answer
            .groups
            .iter()
            .map(|g| g.values.get(i).and_then(aggregate_decimal));
        columns.push(aggregate_array(values).map_err(internal)?);
    }
    let options = RecordBatchOptions::new().with_row_count(Some(answer.groups.len()));
    let batch = RecordBatch::try_new_with_options(schema, columns, &options).map_err(internal)?;
    Ok((batch, answer.summary.unwrap_or_default()))
}

/// Where a group's key bytes split into the key record and the value
/// record.
fn key_split(layout: &MapLayout) -> usize {
    layout.key().size()
}

fn internal(e: arrow_schema::ArrowError) -> Error {
    Error::Internal {
        map: None,
        message: format!("a table could not be made: {e}"),
    }
}

/// The tables of `maps` the caller may read (a map it may list but not
/// dump is left out, as is one that cannot be walked: a queue, a ring
/// buffer), each as the command that reads it whole.
pub(crate) async fn flights(
    calls: &Calls,
    caller: &Caller,
    maps: Vec<pb::MapInfo>,
) -> Vec<(Command, Described)> {
    let mut out = Vec::with_capacity(maps.len());
    let readable = |m: &pb::MapInfo| m.dump_method != pb::DumpMethod::None as i32;
    for m in maps.into_iter().filter(readable) {
        let r#ref = match m.path.is_empty() {
            true => pb::map_ref::Ref::Id(m.id),
            false => pb::map_ref::Ref::Path(m.path),
        };
        let map = Some(pb::MapRef {
            r#ref: Some(r#ref),
            declare: None,
        });
        let command = Command::Dump(pb::DumpMapRequest {
            map: map.clone(),
            ..Default::default()
        });
        let Ok(request) = crate::wire::map_request(map.as_ref()) else {
            continue;
        };
        if let Ok(described) =
            describe(calls, caller, Rpc::FlightListFlights, request, &command).await
        {
            out.push((command, described));
        }
    }
    out
}
