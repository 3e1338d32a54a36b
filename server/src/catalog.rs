//! Which maps the server exposes, and how clients name them.
//!
//! A map is named by its pin path relative to one of the configured bpffs
//! roots, or by kernel id when `allow_by_id` is set. Paths never leave a
//! root: absolute paths and `..` are refused outright, and the resolved path
//! (symlinks followed) must still lie inside the root.

use std::{
    collections::BTreeMap,
    fs, io,
    path::{Component, Path, PathBuf},
};

use crate::{
    error::Error,
    kernel::{MapHandle, MapMeta, OpenError},
};

/// A validated map reference.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum MapRef {
    Path(String),
    Id(u32),
}

impl MapRef {
    /// The name policies match: "demo/flows" or "id:12".
    pub fn policy_name(&self) -> String {
        match self {
            Self::Path(p) => p.clone(),
            Self::Id(id) => format!("id:{id}"),
        }
    }

    /// The canonical form bound into cursors: "path:demo/flows" or "id:12".
    pub fn canonical(&self) -> String {
        match self {
            Self::Path(p) => format!("path:{p}"),
            Self::Id(id) => format!("id:{id}"),
        }
    }
}

impl std::fmt::Display for MapRef {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Path(p) => write!(f, "\"{p}\""),
            Self::Id(id) => write!(f, "id {id}"),
        }
    }
}

/// A map found in the catalog.
#[derive(Debug)]
pub struct Resolved {
    /// Path relative to its root, when the map was reached by path.
    pub path: Option<String>,
    /// The path after following symlinks, relative to the same root.
    pub real_path: Option<String>,
    pub handle: MapHandle,
}

#[derive(Debug, Clone)]
pub struct Catalog {
    roots: Vec<PathBuf>,
    allow_by_id: bool,
}

/// Longest relative path accepted.
const MAX_PATH_LEN: usize = 1024;

impl Catalog {
    pub fn new(roots: Vec<PathBuf>, allow_by_id: bool) -> Self {
        Self { roots, allow_by_id }
    }

    /// Checks the shape of a relative path: non-empty, relative, no `..`.
    pub fn validate_path(path: &str) -> Result<(), Error> {
        let bad = |why: &str| {
            Err(Error::InvalidArgument(format!(
                "map path {path:?} {why}; give a path relative to the exposed bpffs root, like \"demo/flows\""
            )))
        };
        if path.is_empty() {
            return bad("is empty");
        }
        if path.len() > MAX_PATH_LEN {
            return bad("is too long");
        }
        if path.contains('\0') {
            return bad("contains a NUL byte");
        }
        for c in Path::new(path).components() {
            match c {
                Component::Normal(_) | Component::CurDir => {}
                Component::ParentDir => return bad("contains \"..\""),
                Component::RootDir | Component::Prefix(_) => return bad("is absolute"),
            }
        }
        Ok(())
    }

    /// Validates a client's path and returns it normalized ("./a//b" -> "a/b").
    pub fn parse_path(path: &str) -> Result<MapRef, Error> {
        Self::validate_path(path)?;
        let parts: Vec<&str> = Path::new(path)
            .components()
            .filter_map(|c| match c {
                Component::Normal(s) => s.to_str(),
                _ => None,
            })
            .collect();
        if parts.is_empty() {
            return Err(Error::InvalidArgument(format!(
                "map path {path:?} names no map; give a path like \"demo/flows\""
            )));
        }
        Ok(MapRef::Path(parts.join("/")))
    }

    /// Opens the map a reference names.
    pub fn open(&self, r: &MapRef) -> Result<Resolved, Error> {
        match r {
            MapRef::Id(id) => {
                if !self.allow_by_id {
                    return Err(Error::ByIdDisabled);
                }
                let handle =
                    MapHandle::open_id(*id).map_err(|e| Error::from_open(&r.to_string(), e))?;
                Ok(Resolved {
                    path: None,
                    real_path: None,
                    handle,
                })
            }
            MapRef::Path(p) => {
                Self::validate_path(p)?;
                let name = r.to_string();
                for root in &self.roots {
                    let joined = root.join(p);
                    let real = match fs::canonicalize(&joined) {
                        Ok(real) => real,
                        Err(e) if e.kind() == io::ErrorKind::NotFound => continue,
                        Err(e) if e.raw_os_error() == Some(libc::ENOTDIR) => continue,
                        Err(e) => {
                            return Err(Error::Internal {
                                map: name,
                                message: format!("cannot resolve {}: {e}", joined.display()),
                            });
                        }
                    };
                    let real_root = fs::canonicalize(root).unwrap_or_else(|_| root.clone());
                    if !real.starts_with(&real_root) {
                        return Err(Error::InvalidArgument(format!(
                            "map path {p:?} leads outside the exposed root {} (through a symlink)",
                            root.display()
                        )));
                    }
                    if real.is_dir() {
                        return Err(Error::NotAMap {
                            map: name,
                            what: "a directory; list its maps with ListMaps",
                        });
                    }
                    let real_path = real
                        .strip_prefix(&real_root)
                        .ok()
                        .and_then(|r| r.to_str())
                        .map(str::to_owned);
                    match MapHandle::open_pinned(&real) {
                        Ok(handle) => {
                            return Ok(Resolved {
                                path: Some(p.clone()),
                                real_path,
                                handle,
                            });
                        }
                        Err(OpenError::NotFound) => continue,
                        Err(e) => return Err(Error::from_open(&name, e)),
                    }
                }
                Err(Error::MapNotFound(name))
            }
        }
    }

    /// Every exposed map, sorted by path (then maps reachable only by id,
    /// sorted by id). Pins that cannot be opened are skipped and logged.
    pub fn list(&self) -> Vec<(Option<String>, MapMeta)> {
        let mut by_path: BTreeMap<String, MapMeta> = BTreeMap::new();
        for root in &self.roots {
            let mut found = Vec::new();
            walk_dir(root, root, &mut found, 0);
            for (rel, abs) in found {
                if by_path.contains_key(&rel) {
                    continue; // an earlier root wins
                }
                match MapHandle::open_pinned(&abs) {
                    Ok(h) => {
                        by_path.insert(rel, h.meta().clone());
                    }
                    Err(OpenError::NotAMap) => {}
                    Err(e) => tracing::warn!(path = %abs.display(), error = %e, "skipping pin"),
                }
            }
        }
        let mut out: Vec<(Option<String>, MapMeta)> =
            by_path.into_iter().map(|(p, m)| (Some(p), m)).collect();
        if self.allow_by_id {
            let pinned: std::collections::HashSet<u32> = out.iter().map(|(_, m)| m.id).collect();
            let mut id = 0;
            loop {
                match crate::kernel::sys::map_get_next_id(id) {
                    Ok(Some(next)) => id = next,
                    Ok(None) => break,
                    Err(e) => {
                        tracing::warn!(error = %e, "cannot enumerate maps by id");
                        break;
                    }
                }
                if pinned.contains(&id) {
                    continue;
                }
                match MapHandle::open_id(id) {
                    Ok(h) => out.push((None, h.meta().clone())),
                    Err(OpenError::NotFound) => {}
                    Err(e) => tracing::warn!(id, error = %e, "skipping map"),
                }
            }
        }
        out
    }
}

/// Collects regular files below `dir` (not following symlinks).
fn walk_dir(root: &Path, dir: &Path, out: &mut Vec<(String, PathBuf)>, depth: usize) {
    if depth > 16 {
        return;
    }
    let Ok(entries) = fs::read_dir(dir) else {
        return;
    };
    for entry in entries.flatten() {
        let Ok(ft) = entry.file_type() else { continue };
        let path = entry.path();
        if ft.is_dir() {
            walk_dir(root, &path, out, depth + 1);
        } else if ft.is_file()
            && let Ok(rel) = path.strip_prefix(root)
            && let Some(rel) = rel.to_str()
        {
            out.push((rel.to_owned(), path.clone()));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn path_validation() {
        for ok in ["demo/flows", "a", "./a/b", "a/./b"] {
            Catalog::validate_path(ok).unwrap();
        }
        for bad in ["", "/etc/passwd", "../x", "a/../../b", "a/..", "a\0b"] {
            let e = Catalog::validate_path(bad).unwrap_err();
            assert_eq!(e.code(), tonic::Code::InvalidArgument, "{bad:?}");
        }
    }
}
