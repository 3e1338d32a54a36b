//! A table's response stream (DoGet): the schema, then each dump chunk as
//! a record batch (its dictionaries before it) whose app_metadata says the
//! cursor after its last row, then the dump's summary as a message of
//! app_metadata only.

use std::{
    collections::VecDeque,
    pin::Pin,
    task::{Context, Poll},
};

use arrow_array::RecordBatch;
use arrow_flight::FlightData;
use arrow_ipc::writer::{DictionaryTracker, IpcDataGenerator, IpcWriteContext, IpcWriteOptions};
use bpfmap_proto::{
    typed::arrow::{Packed, TableLayout},
    v1 as pb,
};
use futures::Stream;
use tonic::Status;

use super::super::dump_stream::DumpStream;

/// Record batches as Flight messages, with the dictionaries each needs:
/// one per stream (it numbers the dictionaries of the schema it wrote).
pub struct Encoder {
    generator: IpcDataGenerator,
    dictionaries: DictionaryTracker,
    options: IpcWriteOptions,
    context: IpcWriteContext,
}

impl Default for Encoder {
    fn default() -> Self {
        Self::new()
    }
}

impl std::fmt::Debug for Encoder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("FlightEncoder")
    }
}

impl Encoder {
    /// An encoder for a new stream.
    pub fn new() -> Self {
        Self {
            generator: IpcDataGenerator::default(),
            // Each batch sends its dictionaries again (an enum's values
            // seen so far): a reader replaces them.
            dictionaries: DictionaryTracker::new(false),
            options: IpcWriteOptions::default(),
            context: IpcWriteContext::default(),
        }
    }

    /// The schema's message (numbering its dictionaries as the batches
    /// will, as an IPC stream does).
    pub fn schema(&mut self, schema: &arrow_schema::Schema) -> FlightData {
        self.generator
            .schema_to_bytes_with_dictionary_tracker(schema, &mut self.dictionaries, &self.options)
            .into()
    }

    /// A batch's messages: its dictionaries, then the batch, which carries
    /// `app_metadata`.
    pub fn batch(
        &mut self,
        batch: &RecordBatch,
        app_metadata: Vec<u8>,
        out: &mut VecDeque<FlightData>,
    ) -> Result<(), Status> {
        let (dictionaries, data) = self
            .generator
            .encode(
                batch,
                &mut self.dictionaries,
                &self.options,
                &mut self.context,
            )
            .map_err(|e| Status::internal(format!("a record batch could not be encoded: {e}")))?;
        out.extend(dictionaries.into_iter().map(FlightData::from));
        out.push_back(FlightData::from(data).with_app_metadata(app_metadata));
        Ok(())
    }
}

/// The app_metadata of a batch: the cursor after its last row, and its
/// rows.
fn batch_metadata(cursor: &str, rows: usize) -> Vec<u8> {
    serde_json::json!({ "cursor": cursor, "rows": rows })
        .to_string()
        .into_bytes()
}

/// The app_metadata of a dump's last message: its summary.
fn summary_metadata(cursor: &str, summary: &pb::DumpSummary) -> Vec<u8> {
    let elapsed = summary
        .elapsed
        .map_or(0.0, |d| d.seconds as f64 * 1e3 + f64::from(d.nanos) / 1e6);
    serde_json::json!({
        "done": true,
        "cursor": cursor,
        "entries": summary.entries,
        "complete": summary.complete,
        "entries_scanned": summary.entries_scanned,
        "scanned_in_kernel": summary.scanned_in_kernel,
        "scan_note": summary.scan_note,
        "elapsed_ms": elapsed,
    })
    .to_string()
    .into_bytes()
}

/// DoGet's response stream of a dump's table.
pub(crate) struct TableStream {
    dump: DumpStream,
    table: TableLayout,
    encoder: Encoder,
    queue: VecDeque<FlightData>,
    done: bool,
}

impl TableStream {
    /// The table `table` of the chunks `dump` streams.
    pub(crate) fn new(dump: DumpStream, table: TableLayout) -> Self {
        let mut encoder = Encoder::new();
        let queue = VecDeque::from([encoder.schema(table.schema())]);
        Self {
            dump,
            table,
            encoder,
            queue,
            done: false,
        }
    }

    /// Queues a chunk's batch, or the summary.
    fn queue(&mut self, msg: pb::DumpMapResponse) -> Result<(), Status> {
        if msg.done {
            let summary = msg.summary.unwrap_or_default();
            let data = FlightData::new().with_app_metadata(summary_metadata(&msg.cursor, &summary));
            self.queue.push_back(data);
            return Ok(());
        }
        let Some(p) = msg.packed else {
            return Ok(());
        };
        let (count, key_size, stride, cpus) = (
            p.count as usize,
            p.key_size as usize,
            p.value_stride as usize,
            p.cpus as usize,
        );
        let mut builder = self.table.builder();
        builder.push_packed(Packed {
            keys: &p.keys,
            key_size,
            values: &p.values,
            value_stride: stride,
            cpu_stride: stride.checked_div(cpus).unwrap_or(0),
            count,
        });
        let batch = builder
            .finish()
            .map_err(|e| Status::internal(format!("a record batch could not be made: {e}")))?;
        let metadata = batch_metadata(&msg.cursor, count);
        self.encoder.batch(&batch, metadata, &mut self.queue)
    }
}

impl Stream for TableStream {
    type Item = Result<FlightData, Status>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        loop {
            if let Some(data) = self.queue.pop_front() {
                return Poll::Ready(Some(Ok(data)));
            }
            if self.done {
                return Poll::Ready(None);
            }
            match Pin::new(&mut self.dump).poll_next(cx) {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(None) => self.done = true,
                Poll::Ready(Some(Err(status))) => {
                    self.done = true;
                    return Poll::Ready(Some(Err(status)));
                }
                Poll::Ready(Some(Ok(msg))) => {
                    if let Err(status) = self.queue(msg) {
                        self.done = true;
                        return Poll::Ready(Some(Err(status)));
                    }
                }
            }
        }
    }
}
