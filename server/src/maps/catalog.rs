//! Which maps the server exposes, and how clients name them.
//!
//! A map is named by its pin path relative to one of the configured bpffs
//! roots, or by kernel id when `allow_by_id` is set. Paths never leave a
//! root: absolute paths and `..` are refused outright, and the resolved path
//! (symlinks followed) must still lie inside the root. A map is also found
//! by its kernel name (among the maps the catalog reaches), and an inner
//! map through its outer map.

use std::{
    collections::{BTreeMap, HashMap},
    fs, io,
    path::{Path, PathBuf},
};

use bpfmap_kernel::{MapHandle, MapMeta, MapType, OpenError};

use super::holders::{Holders, HoldersCache, kernel_name};
use crate::{
    error::Error,
    model::{MapName, MapRef, quote},
};

/// Most close names a message suggests.
const MAX_CLOSE_NAMES: usize = 5;

/// A map as the catalog lists it: how it is named (a pin path, or its id
/// when it has no pin and maps are reachable by id), what the kernel says of
/// it, and its memory charge.
#[derive(Debug, Clone)]
pub(crate) struct Listed {
    pub(crate) map: MapRef,
    pub(crate) meta: MapMeta,
    /// `memlock` from its fdinfo.
    pub(crate) memlock: Option<u64>,
}

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
            MapRef::Inner { outer, key } => {
                if writable {
                    return Err(Error::NotDrainable(format!(
                        "map {r} is an inner map: only maps pinned under an exposed root can be drained"
                    )));
                }
                let outer_map = self.open_as(outer, false)?;
                let handle = open_inner(r, outer, &outer_map.handle, key)?;
                // An outer map reached through a symlink: the inner map is
                // allowed what the symlink's target is.
                let target = outer_map.target.map(|t| MapRef::Inner {
                    outer: Box::new(t),
                    key: key.clone(),
                });
                Ok(Resolved { target, handle })
            }
            MapRef::Id(id) => {
                if !self.allow_by_id {
                    return Err(Error::ByIdDisabled);
                }
                // The daemon's own walk programs' maps are not the host's.
                if bpfmap_kernel::program::own_ids().maps.contains(id) {
                    return Err(Error::MapNotFound(r.clone()));
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
            if is_bpffs_own(&real_root, &real) {
                return Err(Error::NotAMap {
                    map: r.clone(),
                    what: "a file of bpffs itself (its iterators of maps and programs)",
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

    /// The map named `name` among the maps the catalog reaches (pinned, and
    /// every map with `allow_by_id`) that `allowed` lets the caller use: its
    /// first allowed pin path, or its id when it has none. Several is
    /// [`Error::NameAmbiguous`], none [`Error::NameNotFound`] with the close
    /// names.
    pub(crate) fn find_name(
        &self,
        name: &MapName,
        allowed: impl Fn(&MapRef) -> bool,
        holders: &HoldersCache,
    ) -> Result<MapRef, Error> {
        // Each reachable map once, by id: how it is named, and its name.
        let mut by_id: BTreeMap<u32, (MapRef, String)> = BTreeMap::new();
        for l in self.list(false) {
            if allowed(&l.map) {
                by_id.entry(l.meta.id).or_insert((l.map, l.meta.name));
            }
        }
        let wanted = kernel_name(&name.name);
        let named: Vec<(u32, &MapRef)> = by_id
            .iter()
            .filter(|(_, (_, n))| n == wanted)
            .map(|(id, (r, _))| (*id, r))
            .collect();
        let holders = (name.owner.is_some() || named.len() > 1).then(|| holders.get());
        let matching: Vec<(u32, &MapRef)> = match (&name.owner, &holders) {
            (Some(owner), Some(h)) => named
                .iter()
                .copied()
                .filter(|(id, _)| h.holds(*id, owner))
                .collect(),
            _ => named.clone(),
        };
        match (matching.as_slice(), &holders) {
            ([(_, r)], _) => Ok((*r).clone()),
            ([], Some(h)) if !named.is_empty() => Err(Error::NameNotFound {
                what: format!(
                    "named {} is held by {}",
                    quote(&name.name),
                    quote(name.owner.as_deref().unwrap_or_default())
                ),
                close: format!("; maps of that name: {}", candidates(&named, h)),
            }),
            ([], _) => Err(Error::NameNotFound {
                what: format!("is named {}", quote(&name.name)),
                close: self.close_names(wanted, &by_id),
            }),
            (many, Some(h)) => Err(Error::NameAmbiguous {
                name: name.clone(),
                count: many.len(),
                candidates: candidates(many, h),
            }),
            (_, None) => unreachable!("holders are read when several maps match"),
        }
    }

    /// The names close to `wanted` among `by_id`, the closest first (then
    /// by id), for a message.
    fn close_names(&self, wanted: &str, by_id: &BTreeMap<u32, (MapRef, String)>) -> String {
        let mut close: Vec<(usize, &MapRef, &String)> = by_id
            .values()
            .filter(|(_, n)| !n.is_empty())
            .filter_map(|(r, n)| {
                let distance = strsim::levenshtein(n, wanted);
                let near = distance <= 2 || n.contains(wanted) || wanted.contains(n.as_str());
                near.then_some((distance, r, n))
            })
            .collect();
        // Stable: maps at the same distance stay in id order.
        close.sort_by_key(|(distance, ..)| *distance);
        let mut close: Vec<String> = close
            .into_iter()
            .map(|(_, r, n)| format!("{} ({r})", quote(n)))
            .collect();
        close.truncate(MAX_CLOSE_NAMES);
        if !close.is_empty() {
            return format!("; close: {}", close.join(", "));
        }
        let scope = if self.allow_by_id {
            "every map on the host"
        } else {
            "the maps pinned under the exposed roots (every map only with allow_by_id)"
        };
        format!("; names find {scope}: ListMaps lists them with their names")
    }

    /// Every pin of each map under the exposed roots, by map id.
    pub(crate) fn pins<'a>(
        listed: impl IntoIterator<Item = &'a Listed>,
    ) -> HashMap<u32, Vec<String>> {
        let mut pins: HashMap<u32, Vec<String>> = HashMap::new();
        for l in listed {
            if let MapRef::Path(p) = &l.map {
                pins.entry(l.meta.id).or_default().push(p.clone());
            }
        }
        pins
    }

    /// The pins of map `id` under the exposed roots, sorted.
    pub(crate) fn pins_of(&self, id: u32) -> Vec<String> {
        self.pinned(false)
            .into_iter()
            .filter(|l| l.meta.id == id)
            .map(|l| l.map.to_string())
            .collect()
    }

    /// Every exposed map, sorted by path (then maps reachable only by id,
    /// sorted by id), with their memory charge when `memlock`. Pins that
    /// cannot be opened are skipped and logged.
    pub(crate) fn list(&self, memlock: bool) -> Vec<Listed> {
        let mut out = self.pinned(memlock);
        if self.allow_by_id {
            let pinned: std::collections::HashSet<u32> = out.iter().map(|l| l.meta.id).collect();
            // The daemon's own walk programs' maps are not the host's.
            let own = bpfmap_kernel::program::own_ids().maps;
            for id in bpfmap_kernel::map_ids() {
                let id = match id {
                    Ok(id) => id,
                    Err(e) => {
                        tracing::warn!(error = %e, "cannot enumerate maps by id");
                        break;
                    }
                };
                if pinned.contains(&id) || own.contains(&id) {
                    continue;
                }
                match MapHandle::open_id(id) {
                    Ok(h) => out.push(Listed::of(MapRef::Id(id), &h, memlock)),
                    Err(OpenError::NotFound) => {}
                    Err(e) => tracing::warn!(id, error = %e, "skipping map"),
                }
            }
        }
        out
    }

    /// Every map pinned under the exposed roots, sorted by path.
    fn pinned(&self, memlock: bool) -> Vec<Listed> {
        let mut by_path: BTreeMap<String, MapHandle> = BTreeMap::new();
        for root in &self.roots {
            let mut found = Vec::new();
            walk_dir(root, root, &mut found, 0);
            let real_root = fs::canonicalize(root).unwrap_or_else(|_| root.clone());
            for (rel, abs) in found {
                if is_bpffs_own(root, &abs) || is_bpffs_own(&real_root, &abs) {
                    continue;
                }
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
                        by_path.insert(rel, h);
                    }
                    // Not a map, or unpinned since the directory was read.
                    Err(OpenError::NotAMap | OpenError::NotFound) => {}
                    Err(e) => tracing::warn!(path = %abs.display(), error = %e, "skipping pin"),
                }
            }
        }
        by_path
            .into_iter()
            .map(|(p, h)| Listed::of(MapRef::Path(p), &h, memlock))
            .collect()
    }
}

impl Listed {
    fn of(map: MapRef, h: &MapHandle, memlock: bool) -> Self {
        Self {
            map,
            meta: h.meta().clone(),
            memlock: memlock.then(|| h.memlock()).flatten(),
        }
    }
}

/// Maps of one name, for a message: each by path or id, with who holds it.
fn candidates(maps: &[(u32, &MapRef)], holders: &Holders) -> String {
    maps.iter()
        .map(|(id, r)| format!("{r} ({})", holders.describe(*id)))
        .collect::<Vec<_>>()
        .join(", ")
}

/// The inner map `outer` holds at `key`, opened read-only (by its id, which
/// an outer map's value is: no `allow_by_id` needed, the outer map's policy
/// applies).
fn open_inner(
    r: &MapRef,
    outer: &MapRef,
    outer_map: &MapHandle,
    key: &[u8],
) -> Result<MapHandle, Error> {
    let meta = outer_map.meta();
    if meta.map_type != MapType::ARRAY_OF_MAPS && meta.map_type != MapType::HASH_OF_MAPS {
        return Err(Error::NotMapOfMaps {
            map: outer.clone(),
            map_type: meta.map_type,
        });
    }
    Error::check_key_size(outer, meta, None, key)?;
    let none = || Error::NoInnerMap {
        outer: outer.clone(),
        key: faster_hex::hex_string(key),
    };
    let value = outer_map
        .lookup_value(key)
        .map_err(|e| Error::from_lookup(outer, e))?
        .ok_or_else(none)?;
    let id = value
        .get(..4)
        .and_then(|b| b.try_into().ok())
        .map(u32::from_le_bytes)
        .ok_or_else(none)?;
    MapHandle::open_id(id).map_err(|e| match e {
        // Replaced or removed since the lookup.
        OpenError::NotFound => none(),
        e => Error::from_open(r, e),
    })
}

/// Whether `path` is one of the files a bpffs mount makes itself at its
/// top (`maps.debug` and `progs.debug`, iterators the kernel's preloaded
/// programs pin), which no program pinned and which are not maps.
fn is_bpffs_own(root: &Path, path: &Path) -> bool {
    path.parent() == Some(root)
        && matches!(
            path.file_name().and_then(|n| n.to_str()),
            Some("maps.debug" | "progs.debug")
        )
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
