//! `dump --format arrow`: one Arrow IPC stream (what
//! `pyarrow.ipc.open_stream`, polars and DuckDB read), a `target` column
//! first, then the map's members as the daemon's Flight tables name them;
//! one record batch per chunk.

use std::{io, sync::Arc};

use arrow_array::{ArrayRef, RecordBatch, StringArray};
use arrow_ipc::writer::{
    DictionaryTracker, IpcDataGenerator, IpcWriteContext, IpcWriteOptions, write_message,
};
use arrow_schema::{DataType, Field, Schema, SchemaRef};
use bpfmap_client::{
    FleetChunk, MapTypes, Target, ValueRef,
    table::{PerCpuColumns, Record, TableInfo, TableLayout},
    typed::{MapLayout, MapShape},
};

/// The stream being written.
pub(crate) struct ArrowOut {
    per_cpu: PerCpuColumns,
    map: String,
    /// The columns, made from the first chunk's types; the schema with
    /// `target` first.
    table: Option<(TableLayout, SchemaRef)>,
    generator: IpcDataGenerator,
    dictionaries: DictionaryTracker,
    options: IpcWriteOptions,
    context: IpcWriteContext,
    /// Per-CPU values of an entry, back to back.
    scratch: Vec<u8>,
}

impl std::fmt::Debug for ArrowOut {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ArrowOut").field("map", &self.map).finish()
    }
}

fn bad(e: impl std::fmt::Display) -> io::Error {
    io::Error::other(format!("--format arrow: {e}"))
}

impl ArrowOut {
    pub(crate) fn new(per_cpu: PerCpuColumns, map: &str) -> Self {
        Self {
            per_cpu,
            map: map.to_owned(),
            table: None,
            generator: IpcDataGenerator::default(),
            dictionaries: DictionaryTracker::new(false),
            options: IpcWriteOptions::default(),
            context: IpcWriteContext::default(),
            scratch: Vec::new(),
        }
    }

    /// Writes a chunk's batch (and, first, the schema of its columns).
    pub(crate) fn chunk(
        &mut self,
        out: &mut dyn io::Write,
        target: &Target,
        answer: &FleetChunk,
    ) -> io::Result<()> {
        let Some(first) = answer.chunk.first() else {
            return Ok(());
        };
        let table = self.table_of(answer.types.as_deref(), first)?;
        if self.table.is_none() {
            let schema = with_target(table.schema());
            let encoded = self.generator.schema_to_bytes_with_dictionary_tracker(
                &schema,
                &mut self.dictionaries,
                &self.options,
            );
            write_message(&mut *out, encoded, &self.options).map_err(bad)?;
            self.table = Some((table, schema));
        } else if self
            .table
            .as_ref()
            .is_some_and(|(t, _)| t.schema() != table.schema())
        {
            return Err(bad(format!(
                "{target}'s map has other types than the first target's: one table cannot hold both (dump them one at a time)"
            )));
        }
        let batch = self.batch(target, answer)?;
        let (dictionaries, data) = self
            .generator
            .encode(
                &batch,
                &mut self.dictionaries,
                &self.options,
                &mut self.context,
            )
            .map_err(bad)?;
        for d in dictionaries {
            write_message(&mut *out, d, &self.options).map_err(bad)?;
        }
        write_message(&mut *out, data, &self.options).map_err(bad)?;
        Ok(())
    }

    /// Ends the stream: an empty table when no entry came (with the
    /// `target` column only when no target gave types).
    pub(crate) fn finish(&mut self, out: &mut dyn io::Write) -> io::Result<()> {
        if self.table.is_none() {
            let schema = Schema::new(vec![Field::new("target", DataType::Utf8, false)]);
            let encoded = self.generator.schema_to_bytes_with_dictionary_tracker(
                &schema,
                &mut self.dictionaries,
                &self.options,
            );
            write_message(&mut *out, encoded, &self.options).map_err(bad)?;
        }
        // The end of the stream: a continuation marker and a zero length.
        out.write_all(&[0xff, 0xff, 0xff, 0xff, 0, 0, 0, 0])
    }

    /// The columns of a chunk with these types (or of its bytes).
    fn table_of(
        &self,
        types: Option<&MapTypes>,
        first: bpfmap_client::EntryRef<'_>,
    ) -> io::Result<TableLayout> {
        let layout = match types {
            Some(t) => t.layout().clone(),
            None => {
                let (value, cpus) = match first.value {
                    ValueRef::Single(v) => (v.len(), None),
                    ValueRef::PerCpu(c) => (c.get(0).map_or(0, <[u8]>::len), Some(c.len())),
                };
                MapLayout::untyped(MapShape::new(first.key.len(), value).with_cpus(cpus))
            }
        };
        let info = TableInfo {
            map: self.map.clone(),
            ..Default::default()
        };
        TableLayout::new(&layout, self.per_cpu, &info).map_err(bad)
    }

    fn batch(&mut self, target: &Target, answer: &FleetChunk) -> io::Result<RecordBatch> {
        let Self { table, scratch, .. } = self;
        let (table, schema) = table.as_ref().expect("a schema written");
        let mut builder = table.builder();
        for e in &answer.chunk {
            let (value, stride) = match e.value {
                ValueRef::Single(v) => (v, 0),
                ValueRef::PerCpu(cpus) => {
                    scratch.clear();
                    cpus.iter().for_each(|v| scratch.extend_from_slice(v));
                    (scratch.as_slice(), cpus.get(0).map_or(0, <[u8]>::len))
                }
            };
            builder.push(Record {
                key: e.key,
                value,
                stride,
            });
        }
        let rows = builder.finish().map_err(bad)?;
        let targets: ArrayRef = Arc::new(StringArray::from(vec![target.as_str(); rows.num_rows()]));
        let mut columns = vec![targets];
        columns.extend(rows.columns().iter().cloned());
        RecordBatch::try_new(schema.clone(), columns).map_err(bad)
    }
}

/// `schema` with a `target` column first.
fn with_target(schema: &SchemaRef) -> SchemaRef {
    let mut fields = vec![Arc::new(Field::new("target", DataType::Utf8, false))];
    fields.extend(schema.fields().iter().cloned());
    Arc::new(Schema::new_with_metadata(fields, schema.metadata().clone()))
}
