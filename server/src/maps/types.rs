//! Typed maps in the service: a map's types as checked layouts, and the
//! decoding a dump or a lookup asked for (the rules themselves are
//! `bpfmap_proto::typed`, shared with the client).

use std::sync::Arc;

use bpfmap_proto::{
    typed::{Layout, ValueBuilder},
    v1 as pb,
};

use bpfmap_kernel::MapMeta;

use crate::{error::Error, model::MapRef};

/// A map's key and value types, described and checked.
#[derive(Debug)]
pub(crate) struct TypedMap {
    /// As sent in MapInfo; `None` for maps without keys (bloom filter).
    pub(crate) key: Option<pb::TypeInfo>,
    /// As sent in MapInfo (one CPU's value for per-CPU maps).
    pub(crate) value: pb::TypeInfo,
    /// Ready to decode and encode keys.
    pub(crate) key_layout: Option<Layout>,
    /// Ready to decode values.
    pub(crate) value_layout: Layout,
}

impl TypedMap {
    /// Checks the descriptions against each other and against the map's
    /// sizes; the error is the reason shown in MapInfo.types_unavailable.
    pub(crate) fn new(
        meta: &MapMeta,
        key: Option<pb::TypeInfo>,
        value: pb::TypeInfo,
    ) -> Result<Self, String> {
        let key_layout = key
            .as_ref()
            .map(|k| Layout::new(k, "key"))
            .transpose()
            .map_err(|e| e.to_string())?;
        let value_layout = Layout::new(&value, "value").map_err(|e| e.to_string())?;
        if let Some(k) = &key_layout
            && k.size() != meta.key_size as usize
        {
            return Err(format!(
                "the key type is {} bytes, the map's keys {}",
                k.size(),
                meta.key_size
            ));
        }
        if value_layout.size() != meta.value_size as usize {
            return Err(format!(
                "the value type is {} bytes, the map's values {}",
                value_layout.size(),
                meta.value_size
            ));
        }
        Ok(Self {
            key,
            value,
            key_layout,
            value_layout,
        })
    }
}

/// A map's types, read from the kernel's BTF (cached by BTF object) and
/// checked.
#[derive(Debug, Default)]
pub(crate) struct TypeCache {
    cache: super::btf::TypeCache,
}

impl TypeCache {
    /// The types of the map `meta` describes. Blocks (syscalls, parsing)
    /// the first time a BTF object is seen.
    pub(crate) fn get(&self, meta: &MapMeta) -> Types {
        use super::btf::MapTypes;
        match self.cache.map_types(meta) {
            MapTypes::None => Types::None,
            MapTypes::Unavailable(why) => Types::Unavailable(why),
            MapTypes::Typed(kv) => match TypedMap::new(meta, kv.key.clone(), kv.value.clone()) {
                Ok(t) => Types::Typed(Arc::new(t)),
                Err(why) => Types::Unavailable(why.into()),
            },
        }
    }
}

/// What the service knows of a map's types.
#[derive(Debug, Clone)]
pub(crate) enum Types {
    /// The map carries no BTF.
    None,
    /// Its key and value types.
    Typed(Arc<TypedMap>),
    /// It carries BTF the server cannot use; why.
    Unavailable(Arc<str>),
}

impl Types {
    /// Fills MapInfo's type fields.
    pub(crate) fn fill(&self, info: &mut pb::MapInfo) {
        match self {
            Types::None => {}
            Types::Typed(t) => {
                info.key_type = t.key.clone();
                info.value_type = Some(t.value.clone());
            }
            Types::Unavailable(why) => info.types_unavailable = why.to_string(),
        }
    }

    fn typed(&self) -> Option<&Arc<TypedMap>> {
        match self {
            Types::Typed(t) => Some(t),
            _ => None,
        }
    }

    /// The key layout for keys given as JSON, or why there is none.
    pub(crate) fn key_layout(&self, map: &MapRef) -> Result<&Layout, Error> {
        match self {
            Types::Typed(t) => t.key_layout.as_ref().ok_or_else(|| Error::Untyped {
                map: map.clone(),
                why: "it has no keys".into(),
            }),
            Types::None => Err(Error::Untyped {
                map: map.clone(),
                why: "it carries no BTF; give keys as bytes".into(),
            }),
            Types::Unavailable(why) => Err(Error::Untyped {
                map: map.clone(),
                why: format!("its types cannot be read ({why}); give keys as bytes"),
            }),
        }
    }
}

/// How a call's entries are decoded (LAYOUT_ENTRIES and Lookup).
#[derive(Debug, Clone)]
pub(crate) struct Decoder {
    key: Option<Arc<TypedMap>>,
    /// Values: per CPU, summed, or (untyped) summed as unsigned integers.
    value: ValueDecoding,
}

#[derive(Debug, Clone)]
enum ValueDecoding {
    Typed(Arc<TypedMap>),
    Sum(Arc<TypedMap>),
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
        types: &Types,
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
            return Ok(types.typed().map(|t| Self {
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
            Types::Typed(t) => {
                t.value_layout.check_summable().map_err(|e| {
                    Error::InvalidArgument(format!(
                        "per_cpu = PER_CPU_SUM: the values of map {map} cannot be summed: {e}"
                    ))
                })?;
                ValueDecoding::Sum(t.clone())
            }
            Types::None => match Layout::unsigned(meta.value_size as usize) {
                Some(l) => ValueDecoding::SumUnsigned(Arc::new(l)),
                None => {
                    return Err(Error::InvalidArgument(format!(
                        "per_cpu = PER_CPU_SUM: map {map} has no types, and untyped values are summed only when they are 1, 2, 4 or 8 bytes (these are {})",
                        meta.value_size
                    )));
                }
            },
            Types::Unavailable(why) => {
                return Err(Error::Untyped {
                    map: map.clone(),
                    why: format!(
                        "its types cannot be read ({why}), so its values cannot be summed"
                    ),
                });
            }
        };
        Ok(Some(Self {
            key: types.typed().cloned(),
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
