//! Label names: what programs store as numbers, as people read them (an
//! export table's `names`). `syscall` (a number to its name on this host's
//! architecture, as syscount's keys), `ifname` (an ifindex to the
//! interface's name), `ksym` (a kernel address to the symbol it falls in,
//! from `/proc/kallsyms`), `cgroup` (a cgroup v2 id to its path under
//! `/sys/fs/cgroup`), or a table given in the configuration. A value none
//! names is left as it is.

use std::{
    collections::{BTreeMap, HashMap},
    path::Path,
};

use serde::Deserialize;

/// Where a label's values find their names, as a table says.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(untagged)]
pub enum LabelNames {
    /// The host's names: `syscall`, `ifname`, `ksym` or `cgroup`.
    Host(String),
    /// Values to what they stand for ("1" = "drop").
    Table(BTreeMap<String, String>),
}

/// The host's names a table can ask for.
pub(crate) const HOST_NAMES: [&str; 4] = ["syscall", "ifname", "ksym", "cgroup"];

/// Names a table asks for that the daemon does not have.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0:?} is not a kind of names: syscall, ifname, ksym, cgroup or a table of values")]
pub(crate) struct UnknownNames(String);

impl LabelNames {
    /// Whether the daemon has them.
    pub(crate) fn check(&self) -> Result<(), UnknownNames> {
        match self {
            Self::Host(n) if !HOST_NAMES.contains(&n.as_str()) => Err(UnknownNames(n.clone())),
            _ => Ok(()),
        }
    }
}

/// What the names of one walk read from the host, once per walk.
#[derive(Debug, Default)]
pub(crate) struct Lookups {
    ifnames: Option<HashMap<u64, String>>,
    kallsyms: Option<Vec<(u64, String)>>,
    cgroups: Option<HashMap<u64, String>>,
}

impl Lookups {
    /// The name of `value` in `names`, or `value` when it has none.
    pub(crate) fn name(&mut self, names: &LabelNames, value: &str) -> String {
        let named = match names {
            LabelNames::Table(t) => t.get(value).cloned(),
            LabelNames::Host(name) => {
                let n = value.parse::<u64>().ok();
                n.and_then(|n| match name.as_str() {
                    "syscall" => syscall(n),
                    "ifname" => self.ifnames.get_or_insert_with(ifnames).get(&n).cloned(),
                    "ksym" => symbol(self.kallsyms.get_or_insert_with(kallsyms), n),
                    "cgroup" => self
                        .cgroups
                        .get_or_insert_with(|| cgroups(Path::new("/sys/fs/cgroup")))
                        .get(&n)
                        .cloned(),
                    _ => None,
                })
            }
        };
        named.unwrap_or_else(|| value.to_owned())
    }
}

/// A system call's name on this host's architecture.
fn syscall(n: u64) -> Option<String> {
    let n = std::ffi::c_long::try_from(n).ok()?;
    syscall_numbers::native::sys_call_name(n).map(str::to_owned)
}

/// Every interface's index and name (`/sys/class/net/NAME/ifindex`).
fn ifnames() -> HashMap<u64, String> {
    let Ok(dir) = std::fs::read_dir("/sys/class/net") else {
        return HashMap::new();
    };
    dir.flatten()
        .filter_map(|e| {
            let index = std::fs::read_to_string(e.path().join("ifindex")).ok()?;
            Some((
                index.trim().parse().ok()?,
                e.file_name().to_string_lossy().into_owned(),
            ))
        })
        .collect()
}

/// The kernel's symbols by address, sorted (`/proc/kallsyms`; text
/// symbols only).
fn kallsyms() -> Vec<(u64, String)> {
    let text = std::fs::read_to_string("/proc/kallsyms").unwrap_or_default();
    let mut symbols: Vec<(u64, String)> = text
        .lines()
        .filter_map(|l| {
            let mut parts = l.split_whitespace();
            let address = u64::from_str_radix(parts.next()?, 16).ok()?;
            let kind = parts.next()?;
            let name = parts.next()?;
            (address != 0 && matches!(kind, "t" | "T")).then(|| (address, name.to_owned()))
        })
        .collect();
    symbols.sort();
    symbols
}

/// The symbol an address falls in: the last one at or below it.
fn symbol(symbols: &[(u64, String)], address: u64) -> Option<String> {
    let i = symbols.partition_point(|(a, _)| *a <= address);
    i.checked_sub(1).map(|i| symbols[i].1.clone())
}

/// Every cgroup v2 directory's id (its inode number) and path under
/// `root` ("/" for the root).
fn cgroups(root: &Path) -> HashMap<u64, String> {
    use std::os::unix::fs::MetadataExt as _;
    let mut out = HashMap::new();
    let mut stack = vec![root.to_owned()];
    while let Some(dir) = stack.pop() {
        if let Ok(meta) = std::fs::metadata(&dir) {
            let rel = dir.strip_prefix(root).unwrap_or(&dir);
            out.insert(meta.ino(), format!("/{}", rel.display()));
        }
        if let Ok(entries) = std::fs::read_dir(&dir) {
            stack.extend(
                entries
                    .flatten()
                    .filter(|e| e.file_type().is_ok_and(|t| t.is_dir()))
                    .map(|e| e.path()),
            );
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn numbers_become_names_and_unknown_values_stay() {
        let mut l = Lookups::default();
        let syscall = LabelNames::Host("syscall".into());
        // read is 0 on x86_64, 63 on aarch64.
        let read = if cfg!(target_arch = "aarch64") {
            "63"
        } else {
            "0"
        };
        assert_eq!(l.name(&syscall, read), "read");
        assert_eq!(l.name(&syscall, "99999"), "99999");
        assert_eq!(l.name(&syscall, "not a number"), "not a number");
        assert_eq!(l.name(&LabelNames::Host("ifname".into()), "1"), "lo");
        let table = LabelNames::Table([("1".to_owned(), "drop".to_owned())].into());
        assert_eq!(l.name(&table, "1"), "drop");
        assert_eq!(l.name(&table, "2"), "2");
        let symbols = vec![(0x1000, "a".to_owned()), (0x2000, "b".to_owned())];
        assert_eq!(symbol(&symbols, 0x1fff).as_deref(), Some("a"));
        assert_eq!(symbol(&symbols, 0x2000).as_deref(), Some("b"));
        assert_eq!(symbol(&symbols, 0x10), None);
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(dir.path().join("system.slice/a.service")).unwrap();
        let ids = cgroups(dir.path());
        let ino = |p: &str| {
            use std::os::unix::fs::MetadataExt as _;
            std::fs::metadata(dir.path().join(p)).unwrap().ino()
        };
        assert_eq!(
            ids[&ino("system.slice/a.service")],
            "/system.slice/a.service"
        );
        assert_eq!(ids[&ino("")], "/");
        assert_eq!(
            LabelNames::Host("sycall".into())
                .check()
                .unwrap_err()
                .to_string(),
            "\"sycall\" is not a kind of names: syscall, ifname, ksym, cgroup or a table of values"
        );
    }
}
