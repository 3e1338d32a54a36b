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
//!
//! # Renderings
//!
//! A member can be shown another way than its type says ([`Rendering`]): an
//! IPv4 or IPv6 address, a MAC address, hex. The daemon's configuration
//! gives a map's members renderings (`[[render]]`, in
//! [`MapInfo::render`](crate::MapInfo::render)), which
//! [`MapInfo::types`](crate::MapInfo::types) applies, so that entries decode
//! here as the daemon shows them; [`MapInfo::types_with`](crate::MapInfo::types_with)
//! applies a caller's renderings over those. Rendered members decode to
//! strings (`"10.0.0.1"`), and JSON keys take that spelling
//! ([`MapTypes::encode_key`] here, [`LookupOptions::with_render`](crate::LookupOptions::with_render)
//! for the daemon). Renderings that do not fit are [`Error::Render`],
//! naming the member:
//!
//! ```no_run
//! # async fn demo() -> Result<(), bpfmap_client::Error> {
//! use std::collections::BTreeMap;
//!
//! use bpfmap_client::{Client, ConnectOptions, DumpOptions, Key, LookupOptions, MapName};
//!
//! let client = Client::connect("http://127.0.0.1:50051", ConnectOptions::default()).await?;
//! let map: MapName = "tc/globals/cilium_ct4_global".parse()?;
//! let render = [("key.daddr", "ipv4"), ("key.saddr", "ipv4")];
//! // Packed chunks decoded here: the configured renderings, then these.
//! let types = client.get_map(&map).await?.types_with(render)?.expect("a map with BTF");
//! let mut dump = client.dump(&map, DumpOptions::default());
//! while let Some(chunk) = dump.next_chunk().await? {
//!     for entry in &chunk {
//!         // {"daddr": "10.0.0.1", "saddr": "192.168.0.2", "dport": 443, ...}
//!         println!("{:?}", types.decode_key(entry.key));
//!     }
//! }
//! // A JSON key in the rendered spelling.
//! let key: BTreeMap<String, prost_types::Value> = BTreeMap::from([
//!     ("daddr".to_owned(), "10.0.0.1".into()),
//!     ("saddr".to_owned(), "192.168.0.2".into()),
//!     ("dport".to_owned(), 443u16.into()),
//!     ("sport".to_owned(), 51234u16.into()),
//!     ("nexthdr".to_owned(), 6u32.into()),
//!     ("flags".to_owned(), 0u32.into()),
//! ]);
//! let options = LookupOptions::default().with_render(render);
//! let found = client.lookup(&map, [Key::Json(key.into())], options).await?;
//! println!("{:?}", found[0].decoded_value());
//! # Ok(()) }
//! ```

use std::{collections::BTreeMap, fmt};

pub use bpfmap_proto::typed::{
    EncodeError, JsonWriter, Layout, MapLayout, MapShape, Rendering, Renderings, Sink, TypeError,
    ValueBuilder, parse_c_type, write_json_string,
};

use crate::{EntryRef, Error, ValueRef, pb};

/// A map's key and value types, checked and ready to decode (with the
/// renderings they were made with: [`renderings`](Self::renderings)).
#[derive(Debug, Clone)]
pub struct MapTypes {
    layout: MapLayout,
}

/// Renderings given as (member path, rendering) pairs ("key.daddr",
/// "ipv4"), as options carry them.
pub(crate) fn render_map<K: AsRef<str>, V: fmt::Display>(
    render: impl IntoIterator<Item = (K, V)>,
) -> BTreeMap<String, String> {
    render
        .into_iter()
        .map(|(path, how)| (path.as_ref().to_owned(), how.to_string()))
        .collect()
}

/// Parses renderings given by a caller; the error names the member.
pub(crate) fn parse_render(render: &BTreeMap<String, String>) -> Result<Renderings, TypeError> {
    Renderings::parse(render)
}

impl MapTypes {
    /// The types GetMap described, with `renderings` applied; `None` when
    /// the map has none and no renderings show its bytes (a map without
    /// types has renderings of its whole key or value: "key" = "string").
    /// A map without a key type (the keyless BTF of a
    /// global data section) gets its key as an unsigned integer of the key
    /// size (the index, 0), or as hex. Errors: [`Error::Types`] for a
    /// description that cannot be used, [`Error::Render`] for renderings
    /// that do not fit it.
    pub(crate) fn from_proto(
        info: &pb::MapInfo,
        renderings: &Renderings,
    ) -> Result<Option<Self>, Error> {
        let cpus = info.per_cpu.then_some(info.possible_cpus as usize);
        let shape = MapShape::new(info.key_size as usize, info.value_size as usize).with_cpus(cpus);
        // A map without types has bytes, which renderings can show.
        if info.value_type.is_none() && renderings.is_empty() {
            return Ok(None);
        }
        let layout = MapLayout::new(info.key_type.as_ref(), info.value_type.as_ref(), shape)?;
        Self::rendered(layout, renderings).map(Some)
    }

    fn rendered(layout: MapLayout, renderings: &Renderings) -> Result<Self, Error> {
        let layout = layout.with_renderings(renderings).map_err(Error::render)?;
        Ok(Self { layout })
    }

    /// The renderings the layouts show members with (the daemon's
    /// configured ones, overridden by the caller's).
    pub fn renderings(&self) -> &Renderings {
        self.layout.renderings()
    }

    /// The map's layout: keys, values, and members by path.
    pub fn layout(&self) -> &MapLayout {
        &self.layout
    }

    /// The key's layout.
    pub fn key(&self) -> &Layout {
        self.layout.key()
    }

    /// The value's layout (one CPU's value for per-CPU maps).
    pub fn value(&self) -> &Layout {
        self.layout.value()
    }

    /// Decodes an entry's key.
    pub fn decode_key(&self, key: &[u8]) -> prost_types::Value {
        self.key().to_value(key)
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
            ValueRef::Single(v) => self.value().render(v, sink),
            ValueRef::PerCpu(vs) => self.value().render_per_cpu(vs, sink),
        }
    }

    /// Writes the per-CPU sum of a value into `sink`.
    pub fn render_sum(&self, value: ValueRef<'_>, sink: &mut impl Sink) -> Result<(), TypeError> {
        match value {
            ValueRef::Single(v) => self.value().render(v, sink),
            ValueRef::PerCpu(vs) => {
                let value = self.layout.value_for_sums();
                value.check_summable()?;
                let cpus: Vec<&[u8]> = vs.iter().collect();
                value.render_sum(&cpus, sink);
            }
        }
        Ok(())
    }

    /// Appends `{"key":...,"value":...}` (per-CPU values under
    /// `"per_cpu_values"`) as JSON text.
    pub fn write_entry_json(&self, entry: EntryRef<'_>, out: &mut Vec<u8>) {
        out.extend_from_slice(b"{\"key\":");
        self.key().write_json(entry.key, out);
        match entry.value {
            ValueRef::Single(v) => {
                out.extend_from_slice(b",\"value\":");
                self.value().write_json(v, out);
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
        self.key().encode(key, "key")
    }
}

/// The types of a projected dump's records
/// ([`DumpOptions::with_fields`](crate::DumpOptions::with_fields)): the key
/// and the value each a record of the selected members, named by their path
/// below "key" or "value" ("daddr" for "key.daddr"; a whole key or value
/// keeps its name).
#[derive(Debug, Clone, PartialEq)]
pub struct Projection(pb::Projection);

impl Projection {
    /// The record of the selected key members; `None` when none was
    /// selected (the records then have no key bytes).
    pub fn key_type(&self) -> Option<&pb::TypeInfo> {
        self.0.key_type.as_ref()
    }

    /// The record of the selected value members; `None` when none was
    /// selected.
    pub fn value_type(&self) -> Option<&pb::TypeInfo> {
        self.0.value_type.as_ref()
    }

    /// The types to decode the records with: a side without selected
    /// members decodes as `{}`, members with the renderings the daemon
    /// showed them with (its configured ones), overridden by `render`:
    /// (member path, rendering) pairs, paths as in the request
    /// ("key.daddr"). [`Error::Render`] names one that does not fit,
    /// [`Error::Types`] is a description that cannot be used.
    pub fn types_with<K: AsRef<str>, V: fmt::Display>(
        &self,
        render: impl IntoIterator<Item = (K, V)>,
    ) -> Result<MapTypes, Error> {
        let mut all: BTreeMap<String, String> = render_map(&self.0.render);
        all.extend(render_map(render));
        let renderings = parse_render(&all).map_err(Error::render)?;
        let empty = |what: &str| pb::TypeInfo {
            name: what.into(),
            size: 0,
            kind: Some(pb::type_info::Kind::Struct(pb::RecordType::default())),
        };
        let (key, value) = (empty("key"), empty("value"));
        let key = self.key_type().unwrap_or(&key);
        let value = self.value_type().unwrap_or(&value);
        let shape = MapShape::new(key.size as usize, value.size as usize);
        let layout = MapLayout::new(Some(key), Some(value), shape)?;
        MapTypes::rendered(layout, &renderings)
    }

    /// The message it came in.
    pub fn as_proto(&self) -> &pb::Projection {
        &self.0
    }
}

impl From<pb::Projection> for Projection {
    fn from(p: pb::Projection) -> Self {
        Self(p)
    }
}

impl fmt::Display for MapTypes {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "key {}, value {}", self.key(), self.value())
    }
}
