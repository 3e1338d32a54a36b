//! Maps as Arrow tables in a Rust program (feature `arrow`): a dump's
//! packed chunks as record batches, one per chunk, with the columns the
//! daemon's Arrow Flight service gives (`bpfmap_proto::typed::arrow`).
//! The dump resumes by itself as any [`Dump`] does; each batch is followed
//! by the cursor after its last row ([`TableDump::cursor`]).

use std::collections::BTreeMap;

pub use arrow_array::RecordBatch;
pub use arrow_schema::SchemaRef;
/// An entry's bytes as a [`TableBuilder`] reads them: the key, and the
/// value (per-CPU values back to back, `stride` bytes each).
pub use bpfmap_proto::typed::EntryRef as Record;
pub use bpfmap_proto::typed::arrow::{PerCpuColumns, TableBuilder, TableInfo, TableLayout};
use bpfmap_proto::typed::{EntryRef, MapLayout, MapShape};

use crate::{
    Client, Dump, DumpOptions, DumpSummary, Error, MapInfo, MapName, ValueRef, typed::MapTypes,
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
    /// limit and the scan apply. Reads the map's types first
    /// ([`get_map`](Self::get_map)).
    pub async fn dump_table(
        &self,
        map: &MapName,
        options: DumpOptions,
        per_cpu: PerCpuColumns,
    ) -> Result<TableDump, Error> {
        let info = self.get_map(map).await?;
        let render = options.render_map().clone();
        let dump = self.dump(map, options.with_packed(true));
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
        let (table, scratch) = (self.table.as_ref().expect("made above"), &mut self.scratch);
        let mut builder = table.builder();
        for e in &chunk {
            let (value, stride) = match e.value {
                ValueRef::Single(v) => (v, 0),
                ValueRef::PerCpu(cpus) => {
                    scratch.clear();
                    let one = cpus.get(0).map_or(0, <[u8]>::len);
                    cpus.iter().for_each(|v| scratch.extend_from_slice(v));
                    (scratch.as_slice(), one)
                }
            };
            builder.push(EntryRef {
                key: e.key,
                value,
                stride,
            });
        }
        builder
            .finish()
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
