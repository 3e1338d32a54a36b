//! Types an operator declares for maps whose BTF does not give them
//! (`[[types]]`: bpftrace's maps, maps created by sizes), matched by pin
//! path or kernel name, and how declarations make a map typed.

use std::sync::Arc;

use bpfmap_kernel::MapMeta;
use globset::{Glob, GlobBuilder, GlobSet, GlobSetBuilder};
use serde::Deserialize;

use super::{KnownTypes, MapTypes};
use crate::{
    error::Error,
    model::{Decl, Declared, MapRef},
};

/// One `[[types]]` table as written in the configuration.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TypesConfig {
    /// Map path globs, as in rules ("bpftrace/*").
    #[serde(default)]
    pub maps: Vec<String>,
    /// Kernel name globs ("AT_*"), for maps without pins too.
    #[serde(default)]
    pub names: Vec<String>,
    /// The key's type in C (`char[16]`); absent: not declared.
    #[serde(default)]
    pub key: String,
    /// The value's type in C ("__u64"); absent: not declared.
    #[serde(default)]
    pub value: String,
}

/// A `[[types]]` table that cannot be used: which one, and why.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("[[types]] {table}: {why}")]
pub(crate) struct TypesConfigError {
    table: usize,
    why: String,
}

/// The configured declarations, compiled.
#[derive(Debug, Default)]
pub(crate) struct TypeRules {
    rules: Vec<(GlobSet, GlobSet, Declared)>,
}

/// Compiles globs (`*` does not cross `/`).
pub(crate) fn glob_set(patterns: &[String]) -> Result<GlobSet, globset::Error> {
    let mut set = GlobSetBuilder::new();
    for p in patterns {
        let glob: Glob = GlobBuilder::new(p).literal_separator(true).build()?;
        set.add(glob);
    }
    set.build()
}

/// A glob that does not compile, in a configuration error.
pub(crate) fn glob_error(e: &globset::Error) -> String {
    match e.glob() {
        Some(glob) => format!("invalid pattern {glob:?}: {}", e.kind()),
        None => e.kind().to_string(),
    }
}

impl TypeRules {
    /// Compiles the `[[types]]` tables; the error names the table and what
    /// is wrong.
    pub(crate) fn new(tables: &[TypesConfig]) -> Result<Self, TypesConfigError> {
        let mut rules = Vec::new();
        for (table, t) in tables.iter().enumerate() {
            let fail = |why: String| TypesConfigError { table, why };
            if t.maps.is_empty() && t.names.is_empty() {
                return Err(fail(
                    "give maps (path globs) or names (kernel name globs)".into(),
                ));
            }
            let declared = Declared::parse(&t.key, &t.value).map_err(|e| fail(e.to_string()))?;
            if declared.is_empty() {
                return Err(fail(
                    "declare key, value or both (\"char[16]\", \"__u64\")".into(),
                ));
            }
            rules.push((
                glob_set(&t.maps).map_err(|e| fail(glob_error(&e)))?,
                glob_set(&t.names).map_err(|e| fail(glob_error(&e)))?,
                declared,
            ));
        }
        Ok(Self { rules })
    }

    /// The declarations for `map` (kernel name `name`): the last table that
    /// matches declares each side.
    pub(crate) fn for_map(&self, map: &MapRef, name: &str) -> Declared {
        let path = map.to_string();
        self.rules
            .iter()
            .filter(|(maps, names, _)| maps.is_match(&path) || names.is_match(name))
            .fold(Declared::default(), |acc, (_, _, d)| d.clone().or(acc))
    }
}

impl KnownTypes {
    /// These types with declarations over them: a map without BTF types (or
    /// without a key type) becomes typed. A request's declaration of a side
    /// the map's BTF types is FAILED_PRECONDITION, one of the wrong size
    /// INVALID_ARGUMENT; a configured one (or one a map's type implies)
    /// that does either is left out, so that a table matching more maps
    /// than it fits leaves the others as they are.
    pub(crate) fn declared(
        self,
        request: &Declared,
        configured: &Declared,
        map: &MapRef,
        meta: &MapMeta,
    ) -> Result<Self, Error> {
        if request.is_empty() && configured.is_empty() {
            return Ok(self);
        }
        let (btf_key, btf_value) = match &self {
            Self::Typed(t) => (t.key.clone(), Some(t.value.clone())),
            _ => (None, None),
        };
        let mut sides = [
            (None, "key", meta.key_size),
            (None, "value", meta.value_size),
        ];
        let asked = [request.key.as_ref(), request.value.as_ref()];
        let set = [configured.key.as_ref(), configured.value.as_ref()];
        let btf = [btf_key.as_ref(), btf_value.as_ref()];
        let typed = [btf_key.is_some(), btf_value.is_some()];
        for (i, (decl, side, size)) in sides.iter_mut().enumerate() {
            if let Some(d) = asked[i] {
                if let Some(t) = btf[i] {
                    return Err(Error::TypedByBtf {
                        map: map.clone(),
                        side,
                        name: match t.name.as_str() {
                            "" => format!("an unnamed type of {} bytes", t.size),
                            name => name.to_owned(),
                        },
                    });
                }
                check_size(map, side, d, *size)?;
                *decl = Some(d);
            } else if let Some(d) = set[i].filter(|d| !typed[i] && d.info.size == *size) {
                *decl = Some(d);
            }
        }
        let [(key, ..), (value, ..)] = sides;
        if key.is_none() && value.is_none() {
            return Ok(self);
        }
        let key = key.map(|d| d.info.clone()).or(btf_key);
        let value = match value.map(|d| d.info.clone()).or(btf_value) {
            Some(v) => v,
            None => bytes_type(meta.value_size),
        };
        let types = MapTypes::new(key, value).map_err(|e| {
            Error::InvalidArgument(format!("map {map}: the declared types cannot be used: {e}"))
        })?;
        Ok(Self::Typed(Arc::new(MapTypes {
            declared: true,
            ..types
        })))
    }
}

/// INVALID_ARGUMENT unless a declared side has the map's size.
fn check_size(map: &MapRef, side: &str, d: &Decl, size: u32) -> Result<(), Error> {
    if d.info.size == size {
        return Ok(());
    }
    Err(Error::InvalidArgument(format!(
        "map {map}: the declared {side} type {:?} is {} bytes; the map's {side}s are {size} bytes",
        d.text, d.info.size
    )))
}

/// An undeclared value: an unsigned integer of 1, 2, 4 or 8 bytes (a
/// counter), else bytes.
fn bytes_type(size: u32) -> bpfmap_proto::v1::TypeInfo {
    use bpfmap_proto::v1::{IntType, OpaqueType, TypeInfo, type_info::Kind};
    let kind = match size {
        1 | 2 | 4 | 8 => Kind::Int(IntType {
            signed: false,
            big_endian: false,
        }),
        _ => Kind::Opaque(OpaqueType {
            reason: "not declared".into(),
        }),
    };
    TypeInfo {
        name: String::new(),
        size,
        kind: Some(kind),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn table(maps: &[&str], names: &[&str], key: &str, value: &str) -> TypesConfig {
        TypesConfig {
            maps: maps.iter().map(|s| (*s).to_owned()).collect(),
            names: names.iter().map(|s| (*s).to_owned()).collect(),
            key: key.into(),
            value: value.into(),
        }
    }

    #[test]
    fn tables_match_by_path_or_name_and_later_ones_win() {
        let rules = TypeRules::new(&[
            table(&[], &["AT_*"], "char[16]", "__u64"),
            table(&["bt/counts"], &[], "", "__s64"),
        ])
        .unwrap();
        let by_id = rules.for_map(&MapRef::Id(7), "AT_");
        assert_eq!(
            (by_id.key.unwrap().text, by_id.value.unwrap().text),
            ("char[16]".to_owned(), "__u64".to_owned())
        );
        let both = rules.for_map(&MapRef::Path("bt/counts".into()), "AT_x");
        assert_eq!(both.value.unwrap().text, "__s64");
        assert_eq!(both.key.unwrap().text, "char[16]");
        assert!(rules.for_map(&MapRef::Id(8), "flows").is_empty());
    }

    #[test]
    fn bad_tables_are_named() {
        let e = TypeRules::new(&[table(&["a"], &[], "char[", "")]).unwrap_err();
        assert!(e.to_string().starts_with("[[types]] 0: key: "), "{e}");
        let e = TypeRules::new(&[table(&[], &[], "__u32", "")]).unwrap_err();
        assert!(e.to_string().contains("give maps"), "{e}");
        let e = TypeRules::new(&[table(&["a"], &[], "", "")]).unwrap_err();
        assert!(e.to_string().contains("declare key, value or both"), "{e}");
    }
}
