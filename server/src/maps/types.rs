//! Typed maps: a map's key and value types ([`MapTypes`], read from BTF by
//! [`TypeCache`](super::TypeCache)), what is known of them
//! ([`KnownTypes`]), and the decoding a dump or a lookup asked for (the
//! rules themselves are `bpfmap_proto::typed`, shared with the client).

use std::sync::Arc;

use bpfmap_proto::{
    typed::{Layout, ValueBuilder},
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
    pub(crate) key_layout: Option<Layout>,
    /// Ready to decode values.
    pub(crate) value_layout: Layout,
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
    pub(crate) fn new(key: Option<pb::TypeInfo>, value: pb::TypeInfo) -> Result<Self, String> {
        let key_layout = key
            .as_ref()
            .map(|k| Layout::new(k, "key"))
            .transpose()
            .map_err(|e| e.to_string())?;
        let value_layout = Layout::new(&value, "value").map_err(|e| e.to_string())?;
        Ok(Self {
            key,
            value,
            key_layout,
            value_layout,
        })
    }
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

    /// Fills MapInfo's type fields.
    pub(crate) fn fill(&self, info: &mut pb::MapInfo) {
        match self {
            Self::None => {}
            Self::Typed(t) => {
                info.key_type = t.key.clone();
                info.value_type = Some(t.value.clone());
            }
            Self::Unavailable(why) => info.types_unavailable = why.to_string(),
        }
    }

    /// The key layout for keys given as JSON, or why there is none.
    pub(crate) fn key_layout(&self, map: &MapRef) -> Result<&Layout, Error> {
        match self {
            Self::Typed(t) => t.key_layout.as_ref().ok_or_else(|| Error::Untyped {
                map: map.clone(),
                why: "it has no keys".into(),
            }),
            Self::None => Err(Error::Untyped {
                map: map.clone(),
                why: "it carries no BTF; give keys as bytes".into(),
            }),
            Self::Unavailable(why) => Err(Error::Untyped {
                map: map.clone(),
                why: format!("its types cannot be read ({why}); give keys as bytes"),
            }),
        }
    }
}

/// How a call's entries are decoded (LAYOUT_ENTRIES and Lookup).
#[derive(Debug, Clone)]
pub(crate) struct Decoder {
    key: Option<Arc<MapTypes>>,
    /// Values: per CPU, summed, or (untyped) summed as unsigned integers.
    value: ValueDecoding,
}

#[derive(Debug, Clone)]
enum ValueDecoding {
    Typed(Arc<MapTypes>),
    Sum(Arc<MapTypes>),
    SumUnsigned(Arc<Layout>),
}

impl Decoder {
    /// The decoding a request asks for (`raw`, `per_cpu`) on a map with
    /// `types`; `None` when nothing is decoded. INVALID_ARGUMENT (or
    /// FAILED_PRECONDITION for types that cannot be read) for a sum that
    /// cannot be made.
    pub(crate) fn for_request(
        map: &MapRef,
        meta: &MapMeta,
        types: &KnownTypes,
        (raw, per_cpu): (bool, i32),
        packed: bool,
    ) -> Result<Option<Self>, Error> {
        let per_cpu = pb::PerCpu::try_from(per_cpu).map_err(|_| {
            Error::InvalidArgument(format!(
                "unknown per_cpu {per_cpu}; use PER_CPU_EACH (0) or PER_CPU_SUM (1)"
            ))
        })?;
        if per_cpu == pb::PerCpu::Each {
            if raw || packed {
                return Ok(None);
            }
            return Ok(types.types().map(|t| Self {
                key: Some(t.clone()),
                value: ValueDecoding::Typed(t.clone()),
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
        let value = match types {
            KnownTypes::Typed(t) => {
                t.value_layout.check_summable().map_err(|e| {
                    Error::InvalidArgument(format!(
                        "per_cpu = PER_CPU_SUM: the values of map {map} cannot be summed: {e}"
                    ))
                })?;
                ValueDecoding::Sum(t.clone())
            }
            KnownTypes::None => match Layout::unsigned(meta.value_size as usize) {
                Some(l) => ValueDecoding::SumUnsigned(Arc::new(l)),
                None => {
                    return Err(Error::InvalidArgument(format!(
                        "per_cpu = PER_CPU_SUM: map {map} has no types, and untyped values are summed only when they are 1, 2, 4 or 8 bytes (these are {})",
                        meta.value_size
                    )));
                }
            },
            KnownTypes::Unavailable(why) => {
                return Err(Error::Untyped {
                    map: map.clone(),
                    why: format!(
                        "its types cannot be read ({why}), so its values cannot be summed"
                    ),
                });
            }
        };
        Ok(Some(Self {
            key: types.types().cloned(),
            value,
        }))
    }

    /// About how many more bytes an entry takes with its decoded forms.
    pub(crate) fn extra_bytes(&self, meta: &MapMeta) -> usize {
        let key = self
            .key
            .as_ref()
            .and_then(|t| t.key_layout.as_ref())
            .map_or(0, Layout::encoded_size_hint);
        let value = match &self.value {
            ValueDecoding::Typed(t) if meta.per_cpu() => {
                t.value_layout.encoded_size_hint() * meta.possible_cpus as usize + 8
            }
            ValueDecoding::Typed(t) | ValueDecoding::Sum(t) => t.value_layout.encoded_size_hint(),
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
        let key = self
            .key
            .as_ref()
            .and_then(|t| t.key_layout.as_ref())
            .map(|l| l.to_value(key));
        let value = match &self.value {
            ValueDecoding::Typed(t) if meta.per_cpu() => {
                let mut b = ValueBuilder::default();
                t.value_layout
                    .render_per_cpu(meta.split_cpus(value), &mut b);
                Some(b.finish())
            }
            ValueDecoding::Typed(t) => Some(t.value_layout.to_value(value)),
            ValueDecoding::Sum(t) => Some(sum(&t.value_layout, meta, value)),
            ValueDecoding::SumUnsigned(l) => Some(sum(l, meta, value)),
        };
        (key, value)
    }
}

fn sum(layout: &Layout, meta: &MapMeta, value: &[u8]) -> prost_types::Value {
    let cpus: Vec<&[u8]> = meta.split_cpus(value).collect();
    let mut b = ValueBuilder::default();
    layout.render_sum(&cpus, &mut b);
    b.finish()
}
