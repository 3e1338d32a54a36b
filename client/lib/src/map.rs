//! Maps: how a call names one ([`MapName`]) and what a daemon says about it
//! ([`MapInfo`]).

use std::{fmt, str::FromStr};

use crate::{Error, MapTypes, pb, typed::TypeError};

/// A map, by pin path (relative to the daemon's root) or by kernel id.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum MapName {
    /// A path relative to the daemon's bpffs root ("demo/flows").
    Path(String),
    /// A kernel map id (the daemon must allow access by id).
    Id(u32),
}

impl FromStr for MapName {
    type Err = Error;

    /// "id:12" names a map by id; anything else is a path.
    fn from_str(s: &str) -> Result<Self, Error> {
        if let Some(id) = s.strip_prefix("id:") {
            return id
                .parse()
                .map(Self::Id)
                .map_err(|_| Error::MapName(s.into()));
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
        }
    }
}

impl MapName {
    pub(crate) fn to_proto(&self) -> pb::MapRef {
        let r = match self {
            Self::Path(p) => pb::map_ref::Ref::Path(p.clone()),
            Self::Id(id) => pb::map_ref::Ref::Id(*id),
        };
        pb::MapRef { r#ref: Some(r) }
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
    /// [`typed`](crate::typed)); `None` when the map has none (see
    /// [`types_unavailable`](Self::types_unavailable)).
    pub fn types(&self) -> Result<Option<MapTypes>, TypeError> {
        MapTypes::from_proto(&self.0)
    }

    /// Why a map with BTF comes without types ("reading BTF needs
    /// CAP_SYS_ADMIN").
    pub fn types_unavailable(&self) -> Option<&str> {
        Some(self.0.types_unavailable.as_str()).filter(|s| !s.is_empty())
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
        for s in ["demo/flows", "id:12"] {
            assert_eq!(s.parse::<MapName>().unwrap().to_string(), s);
        }
        assert_eq!("id:12".parse::<MapName>().unwrap(), MapName::Id(12));
        for bad in ["", "id:", "id:x"] {
            assert!(bad.parse::<MapName>().is_err(), "{bad:?}");
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
