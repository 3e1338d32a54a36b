//! Maps as Arrow tables in a Rust program (feature `arrow`): a dump's
//! packed chunks as record batches, one per chunk, with the columns the
//! daemon's Arrow Flight service gives (`bpfmap_proto::typed::arrow`).
//! The dump resumes by itself as any [`Dump`] does; each batch is followed
//! by the cursor after its last row ([`TableDump::cursor`]).

use std::{
    collections::{BTreeMap, HashMap},
    sync::Arc,
};

pub use arrow_array::RecordBatch;
use arrow_array::{ArrayRef, StringArray};
pub use arrow_schema::SchemaRef;
use arrow_schema::{ArrowError, DataType, Field, Schema};
/// An entry's bytes as a [`TableBuilder`] reads them: the key, and the
/// value (per-CPU values back to back, `stride` bytes each).
pub use bpfmap_proto::typed::EntryRef as Record;
pub use bpfmap_proto::typed::arrow::{
    PerCpuColumns, TableBuilder, TableError, TableInfo, TableLayout, aggregate_array,
    aggregate_decimal, aggregate_field, with_target,
};
use bpfmap_proto::typed::{EntryRef, MapLayout, MapShape};

use crate::{
    Chunk, Client, Dump, DumpOptions, DumpSummary, Error, FleetChunk, MapInfo, MapName, ValueRef,
    typed::MapTypes,
};

/// A dump read as record batches.
#[derive(Debug)]
pub struct TableDump {
    dump: Dump,
    info: MapInfo,
    render: BTreeMap<String, String>,
    per_cpu: PerCpuColumns,
    table: Option<TableLayout>,
    /// Per-CPU values of a chunk in the entries layout, back to back.
    scratch: Vec<u8>,
}

impl Client {
    /// A dump of `map` as Arrow record batches (packed chunks, decoded
    /// here), its per-CPU values as `per_cpu` says; `options` as for
    /// [`dump`](Self::dump): a filter, fields, renderings, a cursor, a
    /// limit and the scan apply. Reads the map's types
    /// ([`get_map`](Self::get_map)) while the dump's call opens: the
    /// daemon is reading the map by the time they are known, one round trip
    /// sooner than after them.
    pub async fn dump_table(
        &self,
        map: &MapName,
        options: DumpOptions,
        per_cpu: PerCpuColumns,
    ) -> Result<TableDump, Error> {
        let render = options.render_map().clone();
        let mut dump = self.dump(map, options.with_packed(true));
        let (info, ()) = tokio::join!(self.get_map(map), dump.open_now());
        let info = info?;
        Ok(TableDump {
            dump,
            info,
            render,
            per_cpu,
            table: None,
            scratch: Vec::new(),
        })
    }
}

impl TableDump {
    /// The next chunk's batch; `None` once the dump has ended.
    pub async fn next_batch(&mut self) -> Result<Option<RecordBatch>, Error> {
        let Some(chunk) = self.dump.next_chunk().await? else {
            return Ok(None);
        };
        self.table()?;
        let table = self.table.as_ref().expect("made above");
        push_chunk(table, &chunk, &mut self.scratch)
            .map(Some)
            .map_err(|e| Error::Protocol(format!("a record batch could not be made: {e}")))
    }

    /// The table's schema, once it is known: at once for a map's entries,
    /// after the first batch for a dump with fields (the daemon describes
    /// its projection).
    pub fn schema(&mut self) -> Result<Option<SchemaRef>, Error> {
        if self.dump.selects_fields() && self.dump.projection().is_none() {
            return Ok(None);
        }
        Ok(Some(self.table()?.schema().clone()))
    }

    /// The cursor after the last batch.
    pub fn cursor(&self) -> &str {
        self.dump.cursor()
    }

    /// The daemon's summary, once the dump has ended.
    pub fn summary(&self) -> Option<&DumpSummary> {
        self.dump.summary()
    }

    /// The table layout, made when first needed.
    fn table(&mut self) -> Result<&TableLayout, Error> {
        if self.table.is_none() {
            let layout = self.layout()?;
            let info = TableInfo {
                map: self.info.path().unwrap_or_default().to_owned(),
                id: self.info.id(),
                map_type: self.info.type_name().to_owned(),
            };
            let table = TableLayout::new(&layout, self.per_cpu, &info)?;
            self.table = Some(table);
        }
        Ok(self.table.as_ref().expect("made above"))
    }

    /// The layout of the records: the projection's, the map's types, or
    /// its bytes.
    fn layout(&self) -> Result<MapLayout, Error> {
        let render = self.render.iter();
        if let Some(p) = self.dump.projection() {
            return Ok(p.types_with(render)?.layout().clone());
        }
        Ok(match self.info.types_with(render)? {
            Some(types) => MapTypes::layout(&types).clone(),
            None => {
                let p = self.info.as_proto();
                let cpus = p.per_cpu.then_some(p.possible_cpus as usize);
                let shape = MapShape::new(p.key_size as usize, p.value_size as usize);
                MapLayout::untyped(shape.with_cpus(cpus))
            }
        })
    }
}

/// A chunk's entries as a batch of `table`'s columns (`scratch` holds an
/// entry's per-CPU values back to back).
fn push_chunk(
    table: &TableLayout,
    chunk: &Chunk,
    scratch: &mut Vec<u8>,
) -> Result<RecordBatch, ArrowError> {
    let mut builder = table.builder();
    if let Some(records) = chunk.packed() {
        builder.push_packed(records);
        return builder.finish();
    }
    for e in chunk {
        let (value, stride) = match e.value {
            ValueRef::Single(v) => (v, 0),
            ValueRef::PerCpu(cpus) => {
                scratch.clear();
                cpus.iter().for_each(|v| scratch.extend_from_slice(v));
                (scratch.as_slice(), cpus.get(0).map_or(0, <[u8]>::len))
            }
        };
        builder.push(EntryRef {
            key: e.key,
            value,
            stride,
        });
    }
    builder.finish()
}

/// A fleet dump's chunks as one table: a `target` column first, then the
/// columns of the map's types (or of its bytes, without types), which
/// every target's map must have: the types given
/// ([`with_layout`](Self::with_layout)), or else the first chunk's. Each
/// target's entries are decoded by its own types (its members may lie
/// elsewhere in its bytes). What bpfmapctl's `--format arrow` writes and
/// the relay's Arrow Flight serves.
#[derive(Debug)]
pub struct FleetTable {
    per_cpu: PerCpuColumns,
    map: String,
    /// The schema, `target` first, once known.
    schema: Option<SchemaRef>,
    /// Each target's columns, made from its first chunk's types.
    targets: HashMap<String, TableLayout>,
    scratch: Vec<u8>,
}

/// Why a chunk has no place in a [`FleetTable`].
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum FleetTableError {
    /// Its target's map has other columns than the table's.
    #[error(
        "its map has other types than the table's (made from another target's): one table cannot hold both (read this target alone)"
    )]
    TypesDiffer,
    /// Its map's values cannot be columns as asked.
    #[error("{0}")]
    Columns(#[from] TableError),
    /// Arrow refused the batch.
    #[error("a record batch could not be made: {0}")]
    Arrow(#[from] ArrowError),
}

impl FleetTable {
    /// A table of `map` (its name as the call gave it, in the schema's
    /// metadata), per-CPU values as `per_cpu` says.
    pub fn new(per_cpu: PerCpuColumns, map: &str) -> Self {
        Self {
            per_cpu,
            map: map.to_owned(),
            schema: None,
            targets: HashMap::new(),
            scratch: Vec::new(),
        }
    }

    /// The table with the columns of `layout` (a map's types, or a
    /// projection's), which every target's must match.
    pub fn with_layout(mut self, layout: &MapLayout) -> Result<Self, TableError> {
        let table = self.table(layout)?;
        self.schema = Some(with_target(table.schema()));
        Ok(self)
    }

    /// The schema, once known.
    pub fn schema(&self) -> Option<&SchemaRef> {
        self.schema.as_ref()
    }

    /// The schema of a table no entry came for: the `target` column alone.
    pub fn empty_schema() -> SchemaRef {
        Arc::new(Schema::new(vec![Field::new(
            "target",
            DataType::Utf8,
            false,
        )]))
    }

    /// `answer`'s entries from `target` as a batch (the first chunk with
    /// entries makes the schema if none was given); `None` for a chunk
    /// without entries.
    pub fn batch(
        &mut self,
        target: &str,
        answer: &FleetChunk,
    ) -> Result<Option<RecordBatch>, FleetTableError> {
        let Some(first) = answer.chunk.first() else {
            return Ok(None);
        };
        if !self.targets.contains_key(target) {
            let table = self.table(&layout_of(answer.types.as_deref(), first))?;
            match &self.schema {
                None => self.schema = Some(with_target(table.schema())),
                Some(s) if s.fields()[1..] != table.schema().fields()[..] => {
                    return Err(FleetTableError::TypesDiffer);
                }
                Some(_) => {}
            }
            self.targets.insert(target.to_owned(), table);
        }
        let (table, schema) = (&self.targets[target], self.schema.as_ref().expect("made"));
        let rows = push_chunk(table, &answer.chunk, &mut self.scratch)?;
        let targets: ArrayRef = Arc::new(StringArray::from(vec![target; rows.num_rows()]));
        let mut columns = vec![targets];
        columns.extend(rows.columns().iter().cloned());
        Ok(Some(RecordBatch::try_new(schema.clone(), columns)?))
    }

    fn table(&self, layout: &MapLayout) -> Result<TableLayout, TableError> {
        let info = TableInfo {
            map: self.map.clone(),
            ..Default::default()
        };
        TableLayout::new(layout, self.per_cpu, &info)
    }
}

/// The layout of a chunk with these types (or of its bytes).
fn layout_of(types: Option<&MapTypes>, first: crate::EntryRef<'_>) -> MapLayout {
    match types {
        Some(t) => t.layout().clone(),
        None => {
            let (value, cpus) = match first.value {
                ValueRef::Single(v) => (v.len(), None),
                ValueRef::PerCpu(c) => (c.get(0).map_or(0, <[u8]>::len), Some(c.len())),
            };
            MapLayout::untyped(MapShape::new(first.key.len(), value).with_cpus(cpus))
        }
    }
}
