//! `dump --format arrow`: one Arrow IPC stream (what
//! `pyarrow.ipc.open_stream`, polars and DuckDB read), a `target` column
//! first, then the map's members as the daemon's Flight tables name them;
//! one record batch per chunk.

use std::io;

use arrow_ipc::writer::{
    DictionaryTracker, IpcDataGenerator, IpcWriteContext, IpcWriteOptions, write_message,
};
use arrow_schema::Schema;
use bpfmap_client::{
    FleetChunk, Target,
    table::{FleetTable, PerCpuColumns, RecordBatch},
};

/// The stream being written.
pub(crate) struct ArrowOut {
    table: FleetTable,
    /// Whether the schema was written.
    began: bool,
    generator: IpcDataGenerator,
    dictionaries: DictionaryTracker,
    options: IpcWriteOptions,
    context: IpcWriteContext,
}

impl std::fmt::Debug for ArrowOut {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ArrowOut")
            .field("table", &self.table)
            .finish()
    }
}

fn bad(e: impl std::fmt::Display) -> io::Error {
    io::Error::other(format!("--format arrow: {e}"))
}

impl ArrowOut {
    pub(crate) fn new(per_cpu: PerCpuColumns, map: &str) -> Self {
        Self {
            table: FleetTable::new(per_cpu, map),
            began: false,
            generator: IpcDataGenerator::default(),
            dictionaries: DictionaryTracker::new(false),
            options: IpcWriteOptions::default(),
            context: IpcWriteContext::default(),
        }
    }

    /// Writes a chunk's batch (and, first, the schema of its columns).
    pub(crate) fn chunk(
        &mut self,
        out: &mut dyn io::Write,
        target: &Target,
        answer: &FleetChunk,
    ) -> io::Result<()> {
        let batch = match self.table.batch(target.as_str(), answer) {
            Ok(Some(batch)) => batch,
            Ok(None) => return Ok(()),
            Err(e) => return Err(bad(format!("{target}: {e}"))),
        };
        if !self.began {
            let schema = batch.schema();
            self.schema(out, &schema)?;
        }
        self.write_batch(out, &batch)
    }

    fn schema(&mut self, out: &mut dyn io::Write, schema: &Schema) -> io::Result<()> {
        let encoded = self.generator.schema_to_bytes_with_dictionary_tracker(
            schema,
            &mut self.dictionaries,
            &self.options,
        );
        write_message(&mut *out, encoded, &self.options).map_err(bad)?;
        self.began = true;
        Ok(())
    }

    fn write_batch(&mut self, out: &mut dyn io::Write, batch: &RecordBatch) -> io::Result<()> {
        let (dictionaries, data) = self
            .generator
            .encode(
                batch,
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
    /// `target` column only).
    pub(crate) fn finish(&mut self, out: &mut dyn io::Write) -> io::Result<()> {
        if !self.began {
            self.schema(out, &FleetTable::empty_schema())?;
        }
        // The end of the stream: a continuation marker and a zero length.
        out.write_all(&[0xff, 0xff, 0xff, 0xff, 0, 0, 0, 0])
    }
}
