//! Which maps the server exposes, and how clients name them.
//!
//! A map is named by its pin path relative to one of the configured bpffs
//! roots, or by kernel id when `allow_by_id` is set. Paths never leave a
//! root: absolute paths and `..` are refused outright, and the resolved path
//! (symlinks followed) must still lie inside the root.

use std::{
    collections::BTreeMap,
    fs, io,
    path::{Path, PathBuf},
};

use bpfmap_kernel::{MapHandle, MapMeta, OpenError};

use crate::{
    error::Error,
    model::{MapRef, quote},
};

/// A map found in the catalog.
#[derive(Debug)]
pub(crate) struct Resolved {
    /// The map a path resolves to after following symlinks (relative to the
    /// same root), when that differs from the requested path.
    pub(crate) target: Option<MapRef>,
    /// The open map.
    pub(crate) handle: MapHandle,
}

#[derive(Debug, Clone)]
/// The exposed bpffs roots, and whether maps may be named by id.
pub(crate) struct Catalog {
    roots: Vec<PathBuf>,
    allow_by_id: bool,
}

impl Catalog {
    /// A catalog of the maps pinned under `roots`.
    pub(crate) fn new(roots: Vec<PathBuf>, allow_by_id: bool) -> Self {
        Self { roots, allow_by_id }
    }

    /// Opens the map a reference names, read-only.
    pub(crate) fn open(&self, r: &MapRef) -> Result<Resolved, Error> {
        self.open_as(r, false)
    }

    /// Opens the map a reference names for reading and writing: only for
    /// DrainMap, on a map the configuration names as drainable (the caller
    /// checks).
    pub(crate) fn open_writable(&self, r: &MapRef) -> Result<Resolved, Error> {
        self.open_as(r, true)
    }

    fn open_as(&self, r: &MapRef, writable: bool) -> Result<Resolved, Error> {
        match r {
            MapRef::Id(id) => {
                if !self.allow_by_id {
                    return Err(Error::ByIdDisabled);
                }
                let handle = if writable {
                    MapHandle::open_id_writable(*id)
                } else {
                    MapHandle::open_id(*id)
                }
                .map_err(|e| Error::from_open(r, e))?;
                Ok(Resolved {
                    target: None,
                    handle,
                })
            }
            MapRef::Path(p) => self.open_path(r, p, writable),
        }
    }

    /// Opens the map pinned at `p` under the first root that has it.
    fn open_path(&self, r: &MapRef, p: &str, writable: bool) -> Result<Resolved, Error> {
        MapRef::validate_path(p)?;
        for root in &self.roots {
            let Some(real) = resolve(r, p, &root.join(p))? else {
                continue;
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
            let opened = if writable {
                MapHandle::open_pinned_writable(&real)
            } else {
                MapHandle::open_pinned(&real)
            };
            match opened {
                Ok(handle) => {
                    return Ok(Resolved { target, handle });
                }
                Err(OpenError::NotFound) => continue,
                Err(e) => return Err(Error::from_open(r, e)),
            }
        }
        Err(Error::MapNotFound(r.clone()))
    }

    /// Every exposed map, sorted by path (then maps reachable only by id,
    /// sorted by id). Pins that cannot be opened are skipped and logged.
    pub(crate) fn list(&self) -> Vec<(MapRef, MapMeta)> {
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
            for id in bpfmap_kernel::map_ids() {
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

/// The path `joined` (map `p` under one root) resolves to, symlinks
/// followed; none when that root has nothing there.
fn resolve(r: &MapRef, p: &str, joined: &Path) -> Result<Option<PathBuf>, Error> {
    // Messages name the map as requested, never a host path.
    match fs::canonicalize(joined) {
        Ok(real) => Ok(Some(real)),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(None),
        Err(e) if e.raw_os_error() == Some(libc::ENOTDIR) => Ok(None),
        Err(e) => {
            let why = match e.raw_os_error() {
                Some(libc::ELOOP) => "leads through too many symbolic links (a loop?)",
                Some(libc::ENAMETOOLONG) => "is too long once its symbolic links are followed",
                _ => {
                    tracing::warn!(path = %joined.display(), error = %e, "cannot resolve a map path");
                    return Err(Error::Internal {
                        map: Some(r.clone()),
                        message: format!("cannot resolve the path: {e}"),
                    });
                }
            };
            Err(Error::InvalidArgument(format!(
                "map path {} {why}",
                quote(p)
            )))
        }
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
    use bpfmap_kernel::{self as kernel, CreateMap, MapType, OwnedMap};

    use super::*;

    struct BpfFs(tempfile::TempDir);

    impl Drop for BpfFs {
        fn drop(&mut self) {
            let _ = kernel::umount(self.0.path());
        }
    }

    #[test]
    fn maps_are_opened_read_only_unless_opened_for_a_drain() {
        let fs = BpfFs(tempfile::tempdir().expect("tempdir"));
        kernel::mount_bpffs(fs.0.path())
            .unwrap_or_else(|e| panic!("this test needs root and BPF: cannot mount a bpffs ({e})"));
        let map = OwnedMap::create(&CreateMap {
            map_type: MapType::HASH.0,
            key_size: 8,
            value_size: 8,
            max_entries: 4,
            name: "m",
            ..Default::default()
        })
        .expect("a map");
        map.pin(&fs.0.path().join("m")).expect("pinned");
        let catalog = Catalog::new(vec![fs.0.path().to_owned()], false);
        let r = MapRef::Path("m".into());
        // The kernel would refuse a write through this descriptor.
        assert!(!catalog.open(&r).expect("opens").handle.is_writable());
        assert!(
            catalog
                .open_writable(&r)
                .expect("opens")
                .handle
                .is_writable()
        );
    }
}
