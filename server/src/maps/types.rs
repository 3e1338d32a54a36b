//! Typed maps: a map's key and value types ([`MapTypes`], read from BTF by
//! [`TypeCache`](super::TypeCache)), what is known of them
//! ([`KnownTypes`]), the layout a call sees them through
//! ([`KnownTypes::layout`]: a `bpfmap_proto::typed::MapLayout`, with the
//! call's renderings), and the decoding a dump or a lookup asked for (the
//! rules themselves are `bpfmap_proto::typed`, shared with the client).

use std::{borrow::Cow, sync::Arc};

use bpfmap_proto::{
    typed::{
        Layout, MapLayout, MapShape, Projection, Renderings, Sink, TypeError, ValueBuilder,
        ValueWriter,
    },
    v1 as pb,
};

use bpfmap_kernel::MapMeta;

use crate::{error::Error, model::MapRef};

/// A map's key and value types: their descriptions (as MapInfo carries
/// them) and the layouts that decode and encode them, checked against each
/// other.
#[derive(Debug)]
pub struct MapTypes {
    /// The key type; `None` for maps without keys (bloom filter, and the
    /// keyless BTF of global data sections).
    pub key: Option<pb::TypeInfo>,
    /// The value type (one CPU's value for per-CPU maps).
    pub value: pb::TypeInfo,
    /// Ready to decode and encode keys.
    pub(crate) key_layout: Option<Arc<Layout>>,
    /// Ready to decode values.
    pub(crate) value_layout: Arc<Layout>,
    /// Declared in C rather than read from the map's BTF.
    pub(crate) declared: bool,
}

impl PartialEq for MapTypes {
    fn eq(&self, other: &Self) -> bool {
        // The layouts follow from the descriptions.
        self.key == other.key && self.value == other.value
    }
}

impl MapTypes {
    /// Builds the layouts of `key` and `value`; the error is the reason
    /// shown in MapInfo.types_unavailable.
    pub(crate) fn new(key: Option<pb::TypeInfo>, value: pb::TypeInfo) -> Result<Self, TypeError> {
        let key_layout = key
            .as_ref()
            .map(|k| Layout::new(k, "key").map(Arc::new))
            .transpose()?;
        let value_layout = Arc::new(Layout::new(&value, "value")?);
        Ok(Self {
            key,
            value,
            key_layout,
            value_layout,
            declared: false,
        })
    }
}

/// What a request asks of the decoding of its entries.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Decoding {
    /// Bytes only, nothing decoded.
    pub(crate) raw: bool,
    /// How per-CPU values are shown (`pb::PerCpu`, as the request gives it).
    pub(crate) per_cpu: i32,
    /// The entries go in the packed layout.
    pub(crate) packed: bool,
}

/// What is known of a map's types; cheap to clone.
#[derive(Debug, Clone)]
pub enum KnownTypes {
    /// The map carries no BTF.
    None,
    /// Its key and value types, checked against the map's sizes.
    Typed(Arc<MapTypes>),
    /// It carries BTF the server cannot use: why (for
    /// `MapInfo.types_unavailable`).
    Unavailable(Arc<str>),
}

impl KnownTypes {
    /// The types, when known.
    pub fn types(&self) -> Option<&Arc<MapTypes>> {
        match self {
            Self::Typed(t) => Some(t),
            _ => None,
        }
    }

    /// Why the types are unavailable, when they are.
    pub fn unavailable(&self) -> Option<&str> {
        match self {
            Self::Unavailable(why) => Some(why),
            _ => None,
        }
    }

    /// How a call reads the entries beyond the map's own BTF, when it
    /// does: the renderings in force (`shown`'s: a filter's `key == 443`
    /// means other bytes with `be16`) and types declared in C. `None` for
    /// the map's types as they are. A cursor binds it.
    pub(crate) fn reading(&self, shown: &MapLayout) -> Option<String> {
        let mut text = String::new();
        for (path, how) in shown.renderings().iter() {
            text.push_str(&format!("render {path}={how};"));
        }
        if let Some(t) = self.types().filter(|t| t.declared) {
            text.push_str(&format!("declared {:?} {:?};", t.key, t.value));
        }
        (!text.is_empty()).then_some(text)
    }

    /// Fills MapInfo's type fields.
    pub(crate) fn fill(&self, info: &mut pb::MapInfo) {
        match self {
            Self::None => {}
            Self::Typed(t) => {
                info.key_type = t.key.clone();
                info.value_type = Some(t.value.clone());
                info.types_declared = t.declared;
            }
            Self::Unavailable(why) => info.types_unavailable = why.to_string(),
        }
    }

    /// The layout of the map `meta` describes, as a call sees it: its
    /// types (bytes when it has none, or none that can be used) with
    /// `renderings` (INVALID_ARGUMENT naming the member that cannot be
    /// shown so; FAILED_PRECONDITION for renderings of a map without
    /// types).
    pub(crate) fn layout(
        &self,
        map: &MapRef,
        meta: &MapMeta,
        renderings: &Renderings,
    ) -> Result<MapLayout, Error> {
        let cpus = meta.per_cpu().then_some(meta.possible_cpus as usize);
        let shape = MapShape::new(meta.key_size as usize, meta.value_size as usize).with_cpus(cpus);
        let layout = match self {
            Self::Typed(t) => {
                MapLayout::of_layouts(t.key_layout.clone(), t.value_layout.clone(), shape).map_err(
                    |e| Error::Internal {
                        map: Some(map.clone()),
                        message: format!("its types do not fit it: {e}"),
                    },
                )?
            }
            // Bytes, which renderings of the whole key or value can show.
            Self::None | Self::Unavailable(_) => MapLayout::untyped(shape),
        };
        layout
            .with_renderings(renderings)
            .map_err(|e| Error::InvalidArgument(format!("render: {e} (map {map})")))
    }

    /// The key layout for keys given as JSON (`layout`: the call's), or
    /// why there is none. A key without a type is read as the rendering of
    /// the whole key says ("key" = "string": `"bash"`), or, when it is 1,
    /// 2, 4 or 8 bytes, as an unsigned integer (an array's index).
    pub(crate) fn key_layout<'a>(
        &self,
        map: &MapRef,
        layout: &'a MapLayout,
    ) -> Result<Cow<'a, Layout>, Error> {
        let untyped = |why: String| {
            if layout.key_rendered() {
                return Ok(Cow::Borrowed(layout.key()));
            }
            Layout::unsigned(layout.key().size())
                .map(Cow::Owned)
                .ok_or_else(|| Error::Untyped {
                    map: map.clone(),
                    why,
                })
        };
        match self {
            // A typed map's key, or the index of one without a key type
            // (global data: its one entry's key is 0).
            Self::Typed(_) => Ok(Cow::Borrowed(layout.key())),
            Self::None => untyped(
                "it carries no BTF; give keys as bytes, or render the whole key (\"key\": \"string\")".into(),
            ),
            Self::Unavailable(why) => untyped(format!(
                "its types cannot be read ({why}); give keys as bytes"
            )),
        }
    }
}

/// How a call's entries are decoded (LAYOUT_ENTRIES and Lookup).
#[derive(Debug, Clone)]
pub(crate) struct Decoder {
    key: Option<Arc<Layout>>,
    /// Values: per CPU, summed, or (untyped) summed as unsigned integers.
    value: ValueDecoding,
}

#[derive(Debug, Clone)]
enum ValueDecoding {
    Typed(Arc<Layout>),
    Sum(Arc<Layout>),
    SumUnsigned(Arc<Layout>),
}

impl Decoder {
    /// The decoding a request asks for on a map with `types` shown as
    /// `layout` says; `None` when nothing is decoded. INVALID_ARGUMENT (or
    /// FAILED_PRECONDITION for types that cannot be read) for a sum that
    /// cannot be made.
    pub(crate) fn for_request(
        map: &MapRef,
        meta: &MapMeta,
        types: &KnownTypes,
        layout: &MapLayout,
        asked: Decoding,
    ) -> Result<Option<Self>, Error> {
        let Decoding {
            raw,
            per_cpu,
            packed,
        } = asked;
        // A map without types decodes when renderings show its key or value.
        let layouts = (layout.typed() || !layout.renderings().is_empty()).then_some(layout);
        let per_cpu = pb::PerCpu::try_from(per_cpu).map_err(|_| {
            Error::InvalidArgument(format!(
                "unknown per_cpu {per_cpu}; use PER_CPU_EACH (0) or PER_CPU_SUM (1)"
            ))
        })?;
        if per_cpu == pb::PerCpu::Each {
            if raw || packed {
                return Ok(None);
            }
            return Ok(layouts.map(|l| Self {
                key: Some(l.key_arc().clone()),
                value: ValueDecoding::Typed(l.value_arc().clone()),
            }));
        }
        // PER_CPU_SUM.
        if packed {
            return Err(Error::InvalidArgument(
                "per_cpu = PER_CPU_SUM needs LAYOUT_ENTRIES: packed entries are decoded, and summed, by the client".into(),
            ));
        }
        if raw {
            return Err(Error::InvalidArgument(
                "per_cpu = PER_CPU_SUM decodes values: it cannot be combined with raw = true"
                    .into(),
            ));
        }
        if !meta.per_cpu() {
            return Err(Error::InvalidArgument(format!(
                "per_cpu = PER_CPU_SUM: map {map} is not per-CPU (type {})",
                meta.map_type
            )));
        }
        let value = match (types, layouts) {
            (KnownTypes::Typed(_), Some(l)) => {
                l.value().check_summable().map_err(|e| {
                    Error::InvalidArgument(format!(
                        "per_cpu = PER_CPU_SUM: the values of map {map} cannot be summed: {e}"
                    ))
                })?;
                ValueDecoding::Sum(l.value_arc().clone())
            }
            (KnownTypes::Unavailable(why), _) => {
                return Err(Error::Untyped {
                    map: map.clone(),
                    why: format!(
                        "its types cannot be read ({why}), so its values cannot be summed"
                    ),
                });
            }
            _ => match Layout::unsigned(meta.value_size as usize) {
                Some(l) => ValueDecoding::SumUnsigned(Arc::new(l)),
                None => {
                    return Err(Error::InvalidArgument(format!(
                        "per_cpu = PER_CPU_SUM: map {map} has no types, and untyped values are summed only when they are 1, 2, 4 or 8 bytes (these are {})",
                        meta.value_size
                    )));
                }
            },
        };
        Ok(Some(Self {
            key: layouts.map(|l| l.key_arc().clone()),
            value,
        }))
    }

    /// How a projected call's entries are decoded: through the
    /// projection's records (whose members keep the call's renderings);
    /// nothing is decoded for a `raw` call (or a packed dump).
    pub(crate) fn projected(p: &Projection, raw: bool) -> Option<Self> {
        if raw {
            return None;
        }
        let records = p.layout();
        Some(Self::typed(
            Some(records.key_arc().clone()),
            records.value_arc().clone(),
        ))
    }

    /// Decodes keys and values (not per-CPU) through these layouts: a
    /// projection's records.
    pub(crate) fn typed(key: Option<Arc<Layout>>, value: Arc<Layout>) -> Self {
        Self {
            key,
            value: ValueDecoding::Typed(value),
        }
    }

    /// The same, with keys decoded through `key`.
    pub(crate) fn with_key(self, key: Option<Arc<Layout>>) -> Self {
        Self { key, ..self }
    }

    /// About how many more bytes an entry takes with its decoded forms.
    pub(crate) fn extra_bytes(&self, meta: &MapMeta) -> usize {
        let key = self.key.as_ref().map_or(0, |l| l.encoded_size_hint());
        let value = match &self.value {
            ValueDecoding::Typed(l) if meta.per_cpu() => {
                l.encoded_size_hint() * meta.possible_cpus as usize + 8
            }
            ValueDecoding::Typed(l) | ValueDecoding::Sum(l) => l.encoded_size_hint(),
            ValueDecoding::SumUnsigned(l) => l.encoded_size_hint(),
        };
        key + value + 8
    }

    /// The decoded key and value of one entry (`value` in the wire layout:
    /// per-CPU values back to back).
    pub(crate) fn decode(
        &self,
        meta: &MapMeta,
        key: &[u8],
        value: &[u8],
    ) -> (Option<prost_types::Value>, Option<prost_types::Value>) {
        let key = self.key.as_ref().map(|l| l.to_value(key));
        let mut b = ValueBuilder::default();
        self.render_value(meta, value, &mut b);
        (key, Some(b.finish()))
    }

    /// The decoded key and value of one entry written straight into `out`
    /// as fields 4 and 5 of `bpfmap.v1.Entry`: the values
    /// [`decode`](Self::decode) builds, without building them.
    pub(crate) fn write_encoded(
        &self,
        meta: &MapMeta,
        key: &[u8],
        value: &[u8],
        out: &mut Vec<u8>,
    ) {
        if let Some(l) = &self.key {
            l.render(key, &mut ValueWriter::new(out, 4));
        }
        self.render_value(meta, value, &mut ValueWriter::new(out, 5));
    }

    /// One value (in the wire layout: per-CPU values back to back) into
    /// `sink`: per CPU, or summed.
    fn render_value(&self, meta: &MapMeta, value: &[u8], sink: &mut impl Sink) {
        match &self.value {
            ValueDecoding::Typed(l) if meta.per_cpu() => {
                l.render_per_cpu(meta.split_cpus(value), sink)
            }
            ValueDecoding::Typed(l) => l.render(value, sink),
            ValueDecoding::Sum(l) | ValueDecoding::SumUnsigned(l) => {
                let cpus: Vec<&[u8]> = meta.split_cpus(value).collect();
                l.render_sum(&cpus, sink);
            }
        }
    }
}
