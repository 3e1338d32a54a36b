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

/// A validated map reference: a path relative to an exposed root, or a
/// kernel id. Its one text form (`Display`) is what policies match, what
/// messages and the audit log show: `demo/flows`, or `id:12`.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum MapRef {
    /// A normalized relative path ("demo/flows").
    Path(String),
    /// A kernel map id.
    Id(u32),
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

impl fmt::Display for MapRef {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Path(p) => f.write_str(p),
            Self::Id(id) => write!(f, "id:{id}"),
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
}
