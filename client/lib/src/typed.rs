//! Typed maps on the client: entries decoded through the key and value types
//! GetMap describes (from the map's BTF), by the same rules the daemon uses
//! for `Entry.decoded_key` (see [`Layout`]). Bulk dumps stay packed: the
//! daemon sends bytes and the client decodes them.
//!
//! ```no_run
//! # async fn demo() -> Result<(), bpfmap_client::Error> {
//! use bpfmap_client::{Client, ConnectOptions, DumpOptions, MapName};
//!
//! let client = Client::connect("http://127.0.0.1:50051", ConnectOptions::default()).await?;
//! let map: MapName = "demo/flows".parse()?;
//! let types = client.get_map(&map).await?.types()?.expect("a map with BTF");
//! let mut dump = client.dump(&map, DumpOptions::default());
//! let mut line = Vec::new();
//! while let Some(chunk) = dump.next_chunk().await? {
//!     for entry in &chunk {
//!         line.clear();
//!         types.write_entry_json(entry, &mut line);
//!         println!("{}", String::from_utf8_lossy(&line));
//!     }
//! }
//! # Ok(()) }
//! ```

use std::fmt;

pub use bpfmap_proto::typed::{
    EncodeError, JsonWriter, Layout, Sink, TypeError, ValueBuilder, write_json_string,
};

use crate::{EntryRef, ValueRef, pb};

/// A map's key and value types, checked and ready to decode.
#[derive(Debug, Clone)]
pub struct MapTypes {
    key: Layout,
    value: Layout,
}

impl MapTypes {
    /// The types GetMap described; `None` when the map has none.
    pub(crate) fn from_proto(info: &pb::MapInfo) -> Result<Option<Self>, TypeError> {
        let (Some(key), Some(value)) = (&info.key_type, &info.value_type) else {
            return Ok(None);
        };
        Ok(Some(Self {
            key: Layout::new(key, "key")?,
            value: Layout::new(value, "value")?,
        }))
    }

    /// The key's layout.
    pub fn key(&self) -> &Layout {
        &self.key
    }

    /// The value's layout (one CPU's value for per-CPU maps).
    pub fn value(&self) -> &Layout {
        &self.value
    }

    /// Decodes an entry's key.
    pub fn decode_key(&self, key: &[u8]) -> prost_types::Value {
        self.key.to_value(key)
    }

    /// Decodes a value: per-CPU values as a list, one per CPU.
    pub fn decode_value(&self, value: ValueRef<'_>) -> prost_types::Value {
        let mut b = ValueBuilder::default();
        self.render_value(value, &mut b);
        b.finish()
    }

    /// Sums per-CPU values member by member (integers only; the error says
    /// which member is not one). A value that is not per-CPU is decoded as
    /// it is.
    pub fn sum_value(&self, value: ValueRef<'_>) -> Result<prost_types::Value, TypeError> {
        let mut b = ValueBuilder::default();
        self.render_sum(value, &mut b)?;
        Ok(b.finish())
    }

    /// Writes a value into `sink`: per-CPU values as a list.
    pub fn render_value(&self, value: ValueRef<'_>, sink: &mut impl Sink) {
        match value {
            ValueRef::Single(v) => self.value.render(v, sink),
            ValueRef::PerCpu(vs) => self.value.render_per_cpu(vs, sink),
        }
    }

    /// Writes the per-CPU sum of a value into `sink`.
    pub fn render_sum(&self, value: ValueRef<'_>, sink: &mut impl Sink) -> Result<(), TypeError> {
        match value {
            ValueRef::Single(v) => self.value.render(v, sink),
            ValueRef::PerCpu(vs) => {
                self.value.check_summable()?;
                let cpus: Vec<&[u8]> = vs.iter().collect();
                self.value.render_sum(&cpus, sink);
            }
        }
        Ok(())
    }

    /// Appends `{"key":...,"value":...}` (per-CPU values under
    /// `"per_cpu_values"`) as JSON text.
    pub fn write_entry_json(&self, entry: EntryRef<'_>, out: &mut Vec<u8>) {
        out.extend_from_slice(b"{\"key\":");
        self.key.write_json(entry.key, out);
        match entry.value {
            ValueRef::Single(v) => {
                out.extend_from_slice(b",\"value\":");
                self.value.write_json(v, out);
            }
            ValueRef::PerCpu(_) => {
                out.extend_from_slice(b",\"per_cpu_values\":");
                self.render_value(entry.value, &mut JsonWriter::new(out));
            }
        }
        out.push(b'}');
    }

    /// Encodes a key written as JSON (the form [`decode_key`](Self::decode_key)
    /// gives).
    pub fn encode_key(&self, key: &prost_types::Value) -> Result<Vec<u8>, EncodeError> {
        self.key.encode(key, "key")
    }
}

impl fmt::Display for MapTypes {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "key {}, value {}", self.key, self.value)
    }
}
