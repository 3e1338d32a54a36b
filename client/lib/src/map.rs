//! Maps: how a call names one ([`MapName`]) and what a daemon says about it
//! ([`MapInfo`]).

use std::{fmt, str::FromStr};

use crate::{
    Error, MapTypes, pb,
    typed::{self, Renderings, TypeError},
};

/// A map, by pin path (relative to the daemon's root), by kernel id, by
/// kernel name, or as an inner map of a map of maps.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum MapName {
    /// A path relative to the daemon's bpffs root ("demo/flows").
    Path(String),
    /// A kernel map id (the daemon must allow access by id).
    Id(u32),
    /// A kernel name ("hists"), or `NAME@OWNER` to choose among maps of
    /// the same name, OWNER a program name, a process name or a pid
    /// ("start@runqlat"): `name:hists` as text. The daemon finds it among
    /// its pinned maps (every map where it allows access by id).
    Name(String),
    /// The map an outer map (array_of_maps, hash_of_maps) holds at a key,
    /// read with the outer map's access ([`MapName::inner`]).
    Inner {
        /// The outer map (not itself an inner map).
        outer: Box<MapName>,
        /// The outer map's key.
        key: InnerKey,
    },
    /// A map with its types declared in C, for a map whose BTF does not
    /// give them ([`MapName::with_types`]).
    Declared {
        /// The map.
        map: Box<MapName>,
        /// The key's type (`char[16]`); empty: not declared.
        key: String,
        /// The value's type ("__u64"); empty: not declared.
        value: String,
    },
}

/// The key of an inner map in its outer map.
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub enum InnerKey {
    /// The key's bytes.
    Bytes(Vec<u8>),
    /// JSON through the outer map's key type (a number for a key without a
    /// type of 1, 2, 4 or 8 bytes: an array of maps' index).
    Json(prost_types::Value),
}

impl InnerKey {
    /// The key's one binary form, to compare and hash by.
    fn bytes(&self) -> std::borrow::Cow<'_, [u8]> {
        match self {
            Self::Bytes(b) => std::borrow::Cow::Borrowed(b),
            Self::Json(v) => std::borrow::Cow::Owned(prost::Message::encode_to_vec(v)),
        }
    }
}

impl Eq for InnerKey {}

impl std::hash::Hash for InnerKey {
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        matches!(self, Self::Json(_)).hash(state);
        self.bytes().hash(state);
    }
}

impl From<u32> for InnerKey {
    /// An index or number key, as JSON.
    fn from(n: u32) -> Self {
        Self::Json(n.into())
    }
}

impl FromStr for MapName {
    type Err = Error;

    /// "id:12" names a map by id, "name:hists" (or "name:start@runqlat")
    /// by kernel name; anything else is a path.
    fn from_str(s: &str) -> Result<Self, Error> {
        if let Some(id) = s.strip_prefix("id:") {
            return id
                .parse()
                .map(Self::Id)
                .map_err(|_| Error::MapName(s.into()));
        }
        if let Some(name) = s.strip_prefix("name:") {
            if name.is_empty() || name.starts_with('@') || name.ends_with('@') {
                return Err(Error::MapName(s.into()));
            }
            return Ok(Self::Name(name.into()));
        }
        if s.is_empty() {
            return Err(Error::MapName(s.into()));
        }
        Ok(Self::Path(s.into()))
    }
}

impl fmt::Display for MapName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Path(p) => f.write_str(p),
            Self::Id(id) => write!(f, "id:{id}"),
            Self::Name(n) => write!(f, "name:{n}"),
            Self::Declared { map, .. } => map.fmt(f),
            Self::Inner { outer, key } => match key {
                InnerKey::Bytes(b) => {
                    write!(f, "{outer}[")?;
                    b.iter().try_for_each(|x| write!(f, "{x:02x}"))?;
                    f.write_str("]")
                }
                InnerKey::Json(v) => write!(f, "{outer}[{}]", bpfmap_proto::typed::value_brief(v)),
            },
        }
    }
}

impl MapName {
    /// The inner map this map (an array_of_maps or hash_of_maps) holds at
    /// `key`.
    pub fn inner(self, key: impl Into<InnerKey>) -> Self {
        Self::Inner {
            outer: Box::new(self),
            key: key.into(),
        }
    }

    /// This map read through types declared in C (`key`, `value`; an empty
    /// one is not declared), for a map whose BTF does not give them
    /// (bpftrace's maps): `"char[16]"`, `"__u64"`, `"struct { __be32 addr;
    /// __u16 port; }"`. Every call then decodes, filters, groups and
    /// computes deltas through them.
    pub fn with_types(self, key: impl Into<String>, value: impl Into<String>) -> Self {
        let map = match self {
            Self::Declared { map, .. } => map,
            m => Box::new(m),
        };
        Self::Declared {
            map,
            key: key.into(),
            value: value.into(),
        }
    }

    /// This map without declared types.
    pub fn without_types(self) -> Self {
        match self {
            Self::Declared { map, .. } => *map,
            m => m,
        }
    }

    /// The key type declared with [`with_types`](Self::with_types), if any.
    pub fn declared_key(&self) -> Option<&str> {
        match self {
            Self::Declared { key, .. } if !key.is_empty() => Some(key),
            _ => None,
        }
    }

    /// A map reference as a request carries it: [`Error::MapName`] when it
    /// names no map (an inner map's outer map included).
    pub fn from_proto(r: &pb::MapRef) -> Result<Self, Error> {
        let missing = || Error::MapName(String::new());
        let map = match r.r#ref.as_ref().ok_or_else(missing)? {
            pb::map_ref::Ref::Path(p) if !p.is_empty() => Self::Path(p.clone()),
            pb::map_ref::Ref::Path(_) => return Err(missing()),
            pb::map_ref::Ref::Id(id) => Self::Id(*id),
            pb::map_ref::Ref::Name(n) => Self::Name(n.clone()),
            pb::map_ref::Ref::Inner(inner) => {
                let outer = Self::from_proto(inner.outer.as_deref().ok_or_else(missing)?)?;
                let key = match &inner.json_key {
                    Some(v) => InnerKey::Json(v.clone()),
                    None => InnerKey::Bytes(inner.key.to_vec()),
                };
                outer.inner(key)
            }
        };
        Ok(match &r.declare {
            Some(d) => map.with_types(d.key.clone(), d.value.clone()),
            None => map,
        })
    }

    pub(crate) fn to_proto(&self) -> pb::MapRef {
        let r = match self {
            Self::Declared { map, key, value } => {
                let mut r = map.to_proto();
                r.declare = Some(pb::DeclaredTypes {
                    key: key.clone(),
                    value: value.clone(),
                });
                return r;
            }
            Self::Path(p) => pb::map_ref::Ref::Path(p.clone()),
            Self::Id(id) => pb::map_ref::Ref::Id(*id),
            Self::Name(n) => pb::map_ref::Ref::Name(n.clone()),
            Self::Inner { outer, key } => {
                let (key, json_key) = match key {
                    InnerKey::Bytes(b) => (b.clone(), None),
                    InnerKey::Json(v) => (Default::default(), Some(v.clone())),
                };
                pb::map_ref::Ref::Inner(Box::new(pb::InnerMapRef {
                    outer: Some(Box::new(outer.to_proto())),
                    key,
                    json_key,
                }))
            }
        };
        pb::MapRef {
            r#ref: Some(r),
            declare: None,
        }
    }
}

/// Which maps [`Client::list_maps_with`](crate::Client::list_maps_with)
/// lists.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ListMapsOptions {
    req: pb::ListMapsRequest,
}

impl ListMapsOptions {
    /// The options of a `ListMapsRequest` as a caller wrote it.
    pub fn from_proto(req: &pb::ListMapsRequest) -> Self {
        Self { req: req.clone() }
    }

    /// Only maps whose kernel name matches this glob ("AT_*").
    pub fn with_name(mut self, glob: impl Into<String>) -> Self {
        self.req.name = glob.into();
        self
    }

    /// Only maps of this type ("percpu_hash").
    pub fn with_type(mut self, type_name: impl Into<String>) -> Self {
        self.req.r#type = type_name.into();
        self
    }

    /// Only maps this owner holds: a program name, a process name or a pid.
    pub fn with_owner(mut self, owner: impl Into<String>) -> Self {
        self.req.owner = owner.into();
        self
    }

    pub(crate) fn to_proto(&self) -> pb::ListMapsRequest {
        self.req.clone()
    }
}

/// How a daemon reads a map's entries.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum DumpMethod {
    /// `BPF_MAP_LOOKUP_BATCH`, many entries per syscall.
    Batch,
    /// get_next_key + lookup, one entry at a time (types without batch
    /// support).
    KeyByKey,
    /// The map cannot be iterated from user space: a dump is
    /// FAILED_PRECONDITION.
    Unsupported,
    /// A method newer than this library.
    Unknown,
}

impl DumpMethod {
    /// The method's name: "batch", "key_by_key", "none" or "unknown".
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Batch => "batch",
            Self::KeyByKey => "key_by_key",
            Self::Unsupported => "none",
            Self::Unknown => "unknown",
        }
    }
}

impl fmt::Display for DumpMethod {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A map as a daemon describes it (ListMaps, GetMap).
///
/// The message it came in is [`as_proto`](Self::as_proto): it also holds
/// the kernel's BTF type ids and the key and value [`pb::TypeInfo`].
#[derive(Debug, Clone, PartialEq)]
pub struct MapInfo(pb::MapInfo);

impl MapInfo {
    /// The name to give calls about this map: its path, or `id:N` for a map
    /// reached by id that has no pin under an exposed root.
    pub fn map_name(&self) -> MapName {
        match self.path() {
            Some(p) => MapName::Path(p.to_owned()),
            None => MapName::Id(self.0.id),
        }
    }

    /// The path relative to the exposed root it was found under.
    pub fn path(&self) -> Option<&str> {
        Some(self.0.path.as_str()).filter(|p| !p.is_empty())
    }

    /// The kernel map id (it changes when the map is recreated).
    pub fn id(&self) -> u32 {
        self.0.id
    }

    /// The kernel's name of the map (at most 15 bytes, may be empty).
    pub fn name(&self) -> &str {
        &self.0.name
    }

    /// The map type's name: "hash", "percpu_array", ...; "unknown(N)" for a
    /// type newer than the daemon.
    pub fn type_name(&self) -> &str {
        &self.0.type_name
    }

    /// The size of a key, in bytes.
    pub fn key_size(&self) -> u32 {
        self.0.key_size
    }

    /// The size of a value, in bytes; for per-CPU maps, one CPU's value.
    pub fn value_size(&self) -> u32 {
        self.0.value_size
    }

    /// The map's capacity.
    pub fn max_entries(&self) -> u32 {
        self.0.max_entries
    }

    /// `map_flags` as given at creation (`BPF_F_NO_PREALLOC` = 1, ...).
    pub fn flags(&self) -> u32 {
        self.0.flags
    }

    /// Whether entries carry one value per possible CPU.
    pub fn per_cpu(&self) -> bool {
        self.0.per_cpu
    }

    /// The host's number of possible CPUs (the length of per-CPU values).
    pub fn possible_cpus(&self) -> u32 {
        self.0.possible_cpus
    }

    /// The id of the map's BTF object, if it has one.
    pub fn btf_id(&self) -> Option<u32> {
        Some(self.0.btf_id).filter(|id| *id != 0)
    }

    /// How the daemon reads the map.
    pub fn dump_method(&self) -> DumpMethod {
        match pb::DumpMethod::try_from(self.0.dump_method) {
            Ok(pb::DumpMethod::Batch) => DumpMethod::Batch,
            Ok(pb::DumpMethod::KeyByKey) => DumpMethod::KeyByKey,
            Ok(pb::DumpMethod::None) => DumpMethod::Unsupported,
            _ => DumpMethod::Unknown,
        }
    }

    /// The key and value types, to decode entries with (see
    /// [`typed`](crate::typed)), showing members as the daemon's
    /// configuration renders them ([`render`](Self::render)), so that
    /// entries decode as the daemon shows them; `None` when the map has none
    /// (see [`types_unavailable`](Self::types_unavailable)).
    /// [`Error::Types`] is a description that cannot be used,
    /// [`Error::Render`] a configured rendering that does not fit it.
    pub fn types(&self) -> Result<Option<MapTypes>, Error> {
        self.types_with(std::iter::empty::<(&str, &str)>())
    }

    /// The types as [`types`](Self::types) gives them, with the caller's
    /// renderings over the configured ones: (member path, rendering) pairs
    /// such as `("key.daddr", "ipv4")` or `("key.daddr", Rendering::Ipv4)`.
    /// [`Error::Render`] names a member that cannot be shown so;
    /// [`Error::Types`] is a description that cannot be used.
    pub fn types_with<K: AsRef<str>, V: fmt::Display>(
        &self,
        render: impl IntoIterator<Item = (K, V)>,
    ) -> Result<Option<MapTypes>, Error> {
        let asked = typed::parse_render(&typed::render_map(render)).map_err(Error::render)?;
        let configured = self.render().map_err(Error::render)?;
        MapTypes::from_proto(&self.0, &configured.overridden_by(&asked))
    }

    /// The renderings the daemon's configuration gives this map's members
    /// (`[[render]]`: member path to rendering), which the daemon applies
    /// to the entries it decodes.
    pub fn render(&self) -> Result<Renderings, TypeError> {
        Renderings::parse(&self.0.render)
    }

    /// Why a map with BTF comes without types ("reading BTF needs
    /// CAP_SYS_ADMIN").
    pub fn types_unavailable(&self) -> Option<&str> {
        Some(self.0.types_unavailable.as_str()).filter(|s| !s.is_empty())
    }

    /// Every pin of the map under the daemon's exposed roots.
    pub fn pins(&self) -> &[String] {
        &self.0.pins
    }

    /// The programs that use the map (id, name, type).
    pub fn programs(&self) -> &[pb::MapProgram] {
        &self.0.programs
    }

    /// The processes holding a descriptor to the map (pid, command name).
    pub fn owners(&self) -> &[pb::MapOwner] {
        &self.0.owners
    }

    /// The kernel's memory charge for the map, in bytes, when known.
    pub fn memlock(&self) -> Option<u64> {
        Some(self.0.memlock).filter(|m| *m != 0)
    }

    /// Why [`programs`](Self::programs) or [`owners`](Self::owners) may be
    /// incomplete (the daemon lacks a capability).
    pub fn holders_incomplete(&self) -> Option<&str> {
        Some(self.0.holders_incomplete.as_str()).filter(|s| !s.is_empty())
    }

    /// The message it came in.
    pub fn as_proto(&self) -> &pb::MapInfo {
        &self.0
    }

    /// The message it came in, owned.
    pub fn into_proto(self) -> pb::MapInfo {
        self.0
    }
}

impl From<pb::MapInfo> for MapInfo {
    fn from(info: pb::MapInfo) -> Self {
        Self(info)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_parse_and_print_back() {
        for s in ["demo/flows", "id:12", "name:hists", "name:start@runqlat"] {
            assert_eq!(s.parse::<MapName>().unwrap().to_string(), s);
        }
        assert_eq!("id:12".parse::<MapName>().unwrap(), MapName::Id(12));
        assert_eq!(
            "name:AT_@bpftrace".parse::<MapName>().unwrap(),
            MapName::Name("AT_@bpftrace".into())
        );
        let inner = MapName::Path("outer".into()).inner(3);
        assert_eq!(inner.to_string(), "outer[3]");
        // As a request carries them, and back.
        let names = [
            MapName::Path("demo/flows".into()),
            MapName::Id(7),
            MapName::Name("start@runqlat".into()),
            MapName::Name("AT_".into()).with_types("char[16]", "__u64"),
            MapName::Path("outer".into()).inner(InnerKey::Bytes(vec![1, 0, 0, 0])),
            MapName::Path("outer".into()).inner(1),
        ];
        for name in names {
            assert_eq!(MapName::from_proto(&name.to_proto()).unwrap(), name);
        }
        assert!(MapName::from_proto(&pb::MapRef::default()).is_err());
        for bad in ["", "id:", "id:x", "name:", "name:@x", "name:x@"] {
            assert!(bad.parse::<MapName>().is_err(), "{bad:?}");
        }
    }

    /// A map keyed by `struct { __be32 daddr; __be16 dport; }` whose
    /// configuration renders daddr as ipv4, with a value of one __u32
    /// (`key_type`: `None` for a map whose key has no type).
    fn rendered_info(key_type: bool) -> MapInfo {
        let int = |name: &str, size, big_endian| pb::TypeInfo {
            name: name.into(),
            size,
            kind: Some(pb::type_info::Kind::Int(pb::IntType {
                signed: false,
                big_endian,
            })),
        };
        let member = |name: &str, bit_offset, ty| pb::Member {
            name: name.into(),
            bit_offset,
            bitfield_size: 0,
            r#type: Some(ty),
        };
        let key = pb::TypeInfo {
            name: "tuple".into(),
            size: 6,
            kind: Some(pb::type_info::Kind::Struct(pb::RecordType {
                members: vec![
                    member("daddr", 0, int("__be32", 4, true)),
                    member("dport", 32, int("__be16", 2, true)),
                ],
            })),
        };
        MapInfo::from(pb::MapInfo {
            key_size: if key_type { 6 } else { 4 },
            value_size: 4,
            key_type: key_type.then_some(key),
            value_type: Some(int("__u32", 4, false)),
            render: [("key.daddr".into(), "ipv4".into())].into(),
            ..Default::default()
        })
    }

    #[test]
    fn types_show_the_configured_renderings_and_the_callers_over_them() {
        let info = rendered_info(true);
        let key = [10, 0, 0, 1, 1, 187];
        let decoded = |t: &MapTypes| {
            let mut out = Vec::new();
            t.key().write_json(&key, &mut out);
            String::from_utf8(out).unwrap()
        };
        let configured = info.types().unwrap().unwrap();
        assert_eq!(decoded(&configured), r#"{"daddr":"10.0.0.1","dport":443}"#);
        let asked = info
            .types_with([("key.daddr", "hex"), ("key.dport", "hex")])
            .unwrap()
            .unwrap();
        assert_eq!(decoded(&asked), r#"{"daddr":"0xa000001","dport":"0x1bb"}"#);
        assert_eq!(asked.renderings().iter().count(), 2);
        // The rendered spelling encodes back.
        let json = prost_types::Value {
            kind: Some(prost_types::value::Kind::StructValue(prost_types::Struct {
                fields: [
                    ("daddr".to_owned(), "10.0.0.1".into()),
                    ("dport".to_owned(), 443u32.into()),
                ]
                .into(),
            })),
        };
        assert_eq!(configured.encode_key(&json).unwrap(), key);
        match info.types_with([("key.dport", "ipv6")]) {
            Err(e @ Error::Render { .. }) => assert_eq!(
                e.to_string(),
                "render: key.dport: ipv6 needs a member of 16 bytes; this one (an integer) has 2"
            ),
            other => panic!("{other:?}"),
        }
        assert!(matches!(
            info.types_with([("value", "mac")]),
            Err(Error::Render { path, .. }) if path == "value"
        ));
    }

    #[test]
    fn a_key_without_a_type_decodes_as_its_index() {
        let mut info = rendered_info(false).into_proto();
        info.render.clear();
        let info = MapInfo::from(info);
        let types = info.types().unwrap().expect("the value is typed");
        assert_eq!(types.decode_key(&[0, 0, 0, 0]), 0u32.into());
        match info.types_with([("key", "hex")]) {
            Err(e) => assert_eq!(
                e.to_string(),
                "render: key: the map's keys have no type (only its value is typed)"
            ),
            Ok(_) => panic!("rendered a key without a type"),
        }
    }

    #[test]
    fn info_without_path_or_types() {
        let info = MapInfo::from(pb::MapInfo {
            id: 7,
            dump_method: pb::DumpMethod::KeyByKey as i32,
            ..Default::default()
        });
        assert_eq!(info.map_name(), MapName::Id(7));
        assert_eq!(info.path(), None);
        assert_eq!(info.btf_id(), None);
        assert_eq!(info.dump_method().as_str(), "key_by_key");
        assert!(info.types().unwrap().is_none());
        assert_eq!(info.types_unavailable(), None);
    }
}
