//! How clients name maps, and the validation of those names.
//!
//! A map is named by its pin path relative to one of the exposed bpffs
//! roots, or by kernel id. Paths never leave a root: absolute paths and
//! `..` are refused outright (the catalog checks symlinks when it opens).

use std::{
    fmt,
    path::{Component, Path},
};

use super::quote;

/// Longest relative path accepted.
const MAX_PATH_LEN: usize = 1024;
/// Longest path component a file system accepts (NAME_MAX).
const MAX_NAME_LEN: usize = 255;

/// A validated map reference: a path relative to an exposed root, a
/// kernel id, or an inner map of a map of maps. Its one text form
/// (`Display`) is what policies match, what messages and the audit log
/// show: `demo/flows`, `id:12`, `demo/outer[01000000]` (an inner map, with
/// its outer map's key in hex; policies match its outer map).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum MapRef {
    /// A normalized relative path ("demo/flows").
    Path(String),
    /// A kernel map id.
    Id(u32),
    /// The map an outer map (array_of_maps, hash_of_maps; named by path or
    /// id) holds at `key`.
    Inner {
        /// The outer map: a path or an id.
        outer: Box<MapRef>,
        /// The outer map's key, its bytes.
        key: Vec<u8>,
    },
}

/// A map as a request names it, before the catalog resolves it to a
/// [`MapRef`]: also by its kernel name, and an inner map by its outer
/// map's key written as JSON.
#[derive(Debug, Clone, PartialEq)]
pub enum Requested {
    /// A path or an id.
    Ref(MapRef),
    /// A kernel name, and which owner's map of that name.
    Name(MapName),
    /// An inner map of the outer map at `key`.
    Inner {
        /// The outer map.
        outer: Box<Requested>,
        /// The outer map's key.
        key: InnerKey,
    },
}

/// A map as a request names it, with the types it declares for it.
#[derive(Debug, Clone, PartialEq)]
pub struct MapRequest {
    /// The map.
    pub map: Requested,
    /// Types declared in C for a map whose BTF does not give them.
    pub declared: super::Declared,
}

impl fmt::Display for MapRequest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.map.fmt(f)
    }
}

/// A map named by its kernel name: `NAME` or `NAME@OWNER`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MapName {
    /// The kernel's name of the map (at most 15 bytes are kept by the
    /// kernel; a longer name matches by its first 15).
    pub name: String,
    /// A program name, a process name or a pid holding the map.
    pub owner: Option<String>,
}

/// The key of an inner map in its outer map, as a request gives it.
#[derive(Debug, Clone, PartialEq)]
pub enum InnerKey {
    /// The key's bytes.
    Bytes(Vec<u8>),
    /// JSON through the outer map's key type (a number for an untyped key
    /// of 1, 2, 4 or 8 bytes).
    Json(prost_types::Value),
}

/// Longest map name accepted in a request.
const MAX_MAP_NAME: usize = 256;

impl MapName {
    /// Parses `NAME` or `NAME@OWNER`.
    pub fn parse(text: &str) -> Result<Self, InvalidPath> {
        let (name, owner) = match text.rsplit_once('@') {
            Some((name, owner)) => (name, Some(owner)),
            None => (text, None),
        };
        let bad = |why: &str| {
            Err(InvalidPath(format!(
                "map name {} {why}; give a map's kernel name, like \"hists\", or NAME@OWNER (a program name, process name or pid), like \"hists@runqlat\"",
                quote(text)
            )))
        };
        if name.is_empty() {
            return bad("is empty");
        }
        if text.len() > MAX_MAP_NAME || text.contains('\0') {
            return bad(&format!(
                "is longer than {MAX_MAP_NAME} bytes or holds a NUL byte"
            ));
        }
        if owner.is_some_and(str::is_empty) {
            return bad("has an empty owner after '@'");
        }
        Ok(Self {
            name: name.to_owned(),
            owner: owner.map(str::to_owned),
        })
    }
}

impl fmt::Display for MapName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.owner {
            Some(owner) => write!(f, "name:{}@{owner}", self.name),
            None => write!(f, "name:{}", self.name),
        }
    }
}

impl fmt::Display for Requested {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Ref(r) => r.fmt(f),
            Self::Name(n) => n.fmt(f),
            Self::Inner { outer, key } => match key {
                InnerKey::Bytes(b) => write!(f, "{outer}[{}]", hex(b)),
                InnerKey::Json(v) => write!(f, "{outer}[{}]", bpfmap_proto::typed::value_brief(v)),
            },
        }
    }
}

/// Lowercase hex of `b`.
fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// A map path that cannot name a map; the message says what to send instead.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct InvalidPath(String);

impl MapRef {
    /// Validates a client's path and normalizes it ("./a//b" -> "a/b").
    pub fn parse(path: &str) -> Result<Self, InvalidPath> {
        Self::validate_path(path)?;
        let parts: Vec<&str> = Path::new(path)
            .components()
            .filter_map(|c| match c {
                Component::Normal(s) => s.to_str(),
                _ => None,
            })
            .collect();
        if parts.is_empty() {
            return Err(InvalidPath(format!(
                "map path {} names no map; give a path like \"demo/flows\"",
                quote(path)
            )));
        }
        if parts[0].starts_with("id:") {
            return Err(InvalidPath(format!(
                "map path {} starts with \"id:\", which names maps by kernel id; name it {{\"id\": N}}",
                quote(path)
            )));
        }
        Ok(Self::Path(parts.join("/")))
    }

    /// Checks the shape of a relative path: non-empty, bounded, relative,
    /// no `..`.
    pub fn validate_path(path: &str) -> Result<(), InvalidPath> {
        let bad = |why: &str| {
            Err(InvalidPath(format!(
                "map path {} {why}; give a path relative to the exposed bpffs root, like \"demo/flows\"",
                quote(path)
            )))
        };
        if path.is_empty() {
            return bad("is empty");
        }
        if path.len() > MAX_PATH_LEN {
            return bad(&format!("is longer than {MAX_PATH_LEN} bytes"));
        }
        if path.contains('\0') {
            return bad("contains a NUL byte");
        }
        for c in Path::new(path).components() {
            match c {
                Component::Normal(name) if name.len() > MAX_NAME_LEN => {
                    return bad(&format!("has a component longer than {MAX_NAME_LEN} bytes"));
                }
                Component::Normal(_) | Component::CurDir => {}
                Component::ParentDir => return bad("contains \"..\""),
                Component::RootDir | Component::Prefix(_) => return bad("is absolute"),
            }
        }
        Ok(())
    }
}

impl MapRef {
    /// The reference policies decide on: an inner map is allowed what its
    /// outer map is.
    pub fn authorized_as(&self) -> &MapRef {
        match self {
            Self::Inner { outer, .. } => outer.authorized_as(),
            r => r,
        }
    }
}

impl fmt::Display for MapRef {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Path(p) => f.write_str(p),
            Self::Id(id) => write!(f, "id:{id}"),
            Self::Inner { outer, key } => write!(f, "{outer}[{}]", hex(key)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn path_validation() {
        for ok in ["demo/flows", "a", "./a/b", "a/./b"] {
            MapRef::validate_path(ok).unwrap();
        }
        for bad in ["", "/etc/passwd", "../x", "a/../../b", "a/..", "a\0b"] {
            let e = MapRef::validate_path(bad).unwrap_err();
            assert!(e.to_string().starts_with("map path"), "{bad:?}: {e}");
        }
        for bad in ["id:7", "./id:7/x"] {
            let e = MapRef::parse(bad).unwrap_err();
            assert!(e.to_string().contains("by kernel id"), "{e}");
        }
        assert_eq!(MapRef::parse("a/id:7").unwrap().to_string(), "a/id:7");
        assert_eq!(MapRef::parse("./a//b").unwrap().to_string(), "a/b");
    }

    #[test]
    fn names_take_an_owner_after_the_last_at() {
        let n = MapName::parse("start@runqlat").unwrap();
        assert_eq!(
            (n.name.as_str(), n.owner.as_deref()),
            ("start", Some("runqlat"))
        );
        assert_eq!(n.to_string(), "name:start@runqlat");
        assert_eq!(MapName::parse("AT_").unwrap().owner, None);
        for bad in ["", "@x", "a@"] {
            let e = MapName::parse(bad).unwrap_err();
            assert!(e.to_string().starts_with("map name"), "{bad:?}: {e}");
        }
        let inner = MapRef::Inner {
            outer: Box::new(MapRef::Path("o".into())),
            key: vec![1, 0, 0, 0],
        };
        assert_eq!(inner.to_string(), "o[01000000]");
        assert_eq!(inner.authorized_as(), &MapRef::Path("o".into()));
    }
}
