//! Which maps the server exposes, and how clients name them.
//!
//! A map is named by its pin path relative to one of the configured bpffs
//! roots, or by kernel id when `allow_by_id` is set. Paths never leave a
//! root: absolute paths and `..` are refused outright, and the resolved path
//! (symlinks followed) must still lie inside the root.
#![forbid(unsafe_code)]

use std::{
    collections::BTreeMap,
    fs, io,
    path::{Component, Path, PathBuf},
};

use crate::{
    error::{Error, quote},
    kernel::{MapHandle, MapMeta, OpenError},
};

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

impl MapRef {
    /// Validates a client's path and normalizes it ("./a//b" -> "a/b").
    pub fn parse(path: &str) -> Result<Self, Error> {
        Catalog::validate_path(path)?;
        let parts: Vec<&str> = Path::new(path)
            .components()
            .filter_map(|c| match c {
                Component::Normal(s) => s.to_str(),
                _ => None,
            })
            .collect();
        if parts.is_empty() {
            return Err(Error::InvalidArgument(format!(
                "map path {} names no map; give a path like \"demo/flows\"",
                quote(path)
            )));
        }
        if parts[0].starts_with("id:") {
            return Err(Error::InvalidArgument(format!(
                "map path {} starts with \"id:\", which names maps by kernel id; name it {{\"id\": N}}",
                quote(path)
            )));
        }
        Ok(Self::Path(parts.join("/")))
    }
}

impl std::fmt::Display for MapRef {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Path(p) => f.write_str(p),
            Self::Id(id) => write!(f, "id:{id}"),
        }
    }
}

/// A map found in the catalog.
#[derive(Debug)]
pub struct Resolved {
    /// The reference as requested.
    pub map: MapRef,
    /// The map a path resolves to after following symlinks (relative to the
    /// same root), when that differs from the requested path.
    pub target: Option<MapRef>,
    /// The open map.
    pub handle: MapHandle,
}

#[derive(Debug, Clone)]
/// The exposed bpffs roots, and whether maps may be named by id.
pub struct Catalog {
    roots: Vec<PathBuf>,
    allow_by_id: bool,
    types: std::sync::Arc<crate::typed::TypeRegistry>,
}

/// Longest relative path accepted.
const MAX_PATH_LEN: usize = 1024;
/// Longest path component a file system accepts (NAME_MAX).
const MAX_NAME_LEN: usize = 255;

impl Catalog {
    /// A catalog of the maps pinned under `roots`.
    pub fn new(roots: Vec<PathBuf>, allow_by_id: bool) -> Self {
        Self {
            roots,
            allow_by_id,
            types: std::sync::Arc::default(),
        }
    }

    /// The maps' types (from their BTF, cached).
    pub fn types(&self) -> &crate::typed::TypeRegistry {
        &self.types
    }

    /// Checks the shape of a relative path: non-empty, relative, no `..`.
    pub fn validate_path(path: &str) -> Result<(), Error> {
        let bad = |why: &str| {
            Err(Error::InvalidArgument(format!(
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

    /// Opens the map a reference names.
    pub fn open(&self, r: &MapRef) -> Result<Resolved, Error> {
        match r {
            MapRef::Id(id) => {
                if !self.allow_by_id {
                    return Err(Error::ByIdDisabled);
                }
                let handle = MapHandle::open_id(*id).map_err(|e| Error::from_open(r, e))?;
                Ok(Resolved {
                    map: r.clone(),
                    target: None,
                    handle,
                })
            }
            MapRef::Path(p) => {
                Self::validate_path(p)?;
                for root in &self.roots {
                    let joined = root.join(p);
                    // Messages name the map as requested, never a host path.
                    let real = match fs::canonicalize(&joined) {
                        Ok(real) => real,
                        Err(e) if e.kind() == io::ErrorKind::NotFound => continue,
                        Err(e) if e.raw_os_error() == Some(libc::ENOTDIR) => continue,
                        Err(e) => {
                            let why = match e.raw_os_error() {
                                Some(libc::ELOOP) => {
                                    "leads through too many symbolic links (a loop?)"
                                }
                                Some(libc::ENAMETOOLONG) => {
                                    "is too long once its symbolic links are followed"
                                }
                                _ => {
                                    tracing::warn!(path = %joined.display(), error = %e, "cannot resolve a map path");
                                    return Err(Error::Internal {
                                        map: Some(r.clone()),
                                        message: format!("cannot resolve the path: {e}"),
                                    });
                                }
                            };
                            return Err(Error::InvalidArgument(format!(
                                "map path {} {why}",
                                quote(p)
                            )));
                        }
                    };
                    let real_root = fs::canonicalize(root).unwrap_or_else(|_| root.clone());
                    if !real.starts_with(&real_root) {
                        return Err(Error::InvalidArgument(format!(
                            "map path {} leads outside the exposed root (through a symlink)",
                            quote(p)
                        )));
                    }
                    if real.is_dir() {
                        return Err(Error::NotAMap {
                            map: r.clone(),
                            what: "a directory; list its maps with ListMaps",
                        });
                    }
                    let target = real
                        .strip_prefix(&real_root)
                        .ok()
                        .and_then(|t| t.to_str())
                        .filter(|t| *t != p)
                        .map(|t| MapRef::Path(t.to_owned()));
                    match MapHandle::open_pinned(&real) {
                        Ok(handle) => {
                            return Ok(Resolved {
                                map: r.clone(),
                                target,
                                handle,
                            });
                        }
                        Err(OpenError::NotFound) => continue,
                        Err(e) => return Err(Error::from_open(r, e)),
                    }
                }
                Err(Error::MapNotFound(r.clone()))
            }
        }
    }

    /// Every exposed map, sorted by path (then maps reachable only by id,
    /// sorted by id). Pins that cannot be opened are skipped and logged.
    pub fn list(&self) -> Vec<(MapRef, MapMeta)> {
        let mut by_path: BTreeMap<String, MapMeta> = BTreeMap::new();
        for root in &self.roots {
            let mut found = Vec::new();
            walk_dir(root, root, &mut found, 0);
            for (rel, abs) in found {
                if by_path.contains_key(&rel) {
                    continue; // an earlier root wins
                }
                if rel.starts_with("id:") {
                    // Its name would read as a map id.
                    tracing::warn!(path = %abs.display(), "skipping a pin whose path starts with \"id:\"");
                    continue;
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
        let mut out: Vec<(MapRef, MapMeta)> = by_path
            .into_iter()
            .map(|(p, m)| (MapRef::Path(p), m))
            .collect();
        if self.allow_by_id {
            let pinned: std::collections::HashSet<u32> = out.iter().map(|(_, m)| m.id).collect();
            for id in crate::kernel::map_ids() {
                let id = match id {
                    Ok(id) => id,
                    Err(e) => {
                        tracing::warn!(error = %e, "cannot enumerate maps by id");
                        break;
                    }
                };
                if pinned.contains(&id) {
                    continue;
                }
                match MapHandle::open_id(id) {
                    Ok(h) => out.push((MapRef::Id(id), h.meta().clone())),
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
        for bad in ["id:7", "./id:7/x"] {
            let e = MapRef::parse(bad).unwrap_err();
            assert!(e.to_string().contains("by kernel id"), "{e}");
        }
        assert_eq!(MapRef::parse("a/id:7").unwrap().to_string(), "a/id:7");
    }
}
