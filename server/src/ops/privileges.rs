//! Least privilege: which capabilities the daemon needs, checked at start-up
//! so that a missing one is named instead of surfacing later as EPERM.
//!
//! | capability | needed for |
//! |---|---|
//! | CAP_BPF (or CAP_SYS_ADMIN on kernels before 5.8) | any bpf(2) call while `kernel.unprivileged_bpf_disabled` is set (the default on most distributions): opening pins read-only, batch lookups, map info |
//! | CAP_SYS_ADMIN | `allow_by_id` (BPF_MAP_GET_FD_BY_ID, BPF_MAP_GET_NEXT_ID), mounting bpffs on a root; typed maps (BPF_BTF_GET_FD_BY_ID, to read a map's BTF): without it maps are served untyped |
//!
//! Reading a pin also needs read permission on the pin file (pins are
//! usually root-owned and 0600: run as root with a reduced capability set,
//! or grant CAP_DAC_READ_SEARCH).

const CAP_SYS_ADMIN: u32 = 21;
const CAP_BPF: u32 = 39;

/// A capability the configuration needs and the process lacks.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Missing {
    pub capability: &'static str,
    pub needed_for: &'static str,
}

/// Pure decision: what is missing from `effective` (a CapEff bit mask).
pub(crate) fn missing(
    effective: u64,
    unprivileged_bpf_allowed: bool,
    allow_by_id: bool,
    must_mount: bool,
) -> Vec<Missing> {
    let has = |bit: u32| effective & (1u64 << bit) != 0;
    let mut out = Vec::new();
    if !unprivileged_bpf_allowed && !has(CAP_BPF) && !has(CAP_SYS_ADMIN) {
        out.push(Missing {
            capability: "CAP_BPF",
            needed_for: "opening and reading maps (kernel.unprivileged_bpf_disabled is set)",
        });
    }
    if allow_by_id && !has(CAP_SYS_ADMIN) {
        out.push(Missing {
            capability: "CAP_SYS_ADMIN",
            needed_for: "allow_by_id (opening maps by kernel id)",
        });
    }
    if must_mount && !has(CAP_SYS_ADMIN) {
        out.push(Missing {
            capability: "CAP_SYS_ADMIN",
            needed_for: "mounting bpffs on a root that is not mounted",
        });
    }
    out
}

/// What the daemon goes without when it cannot read BTF: not needed for any
/// configuration, so a warning at start-up rather than a refusal; `None`
/// when `effective` (a CapEff bit mask) has CAP_SYS_ADMIN.
pub(crate) fn typed_maps_off(effective: u64) -> Option<Missing> {
    (effective & (1u64 << CAP_SYS_ADMIN) == 0).then_some(Missing {
        capability: "CAP_SYS_ADMIN",
        needed_for: "typed maps (reading a map's BTF: key and value types, decoded entries); maps are served untyped",
    })
}

/// The effective capability set of this process.
pub(crate) fn effective() -> std::io::Result<u64> {
    let status = std::fs::read_to_string("/proc/self/status")?;
    status
        .lines()
        .find_map(|l| l.strip_prefix("CapEff:"))
        .and_then(|hex| u64::from_str_radix(hex.trim(), 16).ok())
        .ok_or_else(|| std::io::Error::other("no CapEff line in /proc/self/status"))
}

/// Whether `kernel.unprivileged_bpf_disabled` is 0.
pub(crate) fn unprivileged_bpf_allowed() -> bool {
    std::fs::read_to_string("/proc/sys/kernel/unprivileged_bpf_disabled")
        .map(|s| s.trim() == "0")
        .unwrap_or(false)
}

#[cfg(test)]
mod tests {
    use super::*;

    const BPF: u64 = 1 << CAP_BPF;
    const ADMIN: u64 = 1 << CAP_SYS_ADMIN;

    #[test]
    fn names_exactly_what_is_missing() {
        assert_eq!(missing(BPF, false, false, false), []);
        assert_eq!(missing(ADMIN, false, true, true), []);
        let m = missing(0, false, false, false);
        assert_eq!(m.len(), 1);
        assert_eq!(m[0].capability, "CAP_BPF");
        assert_eq!(
            missing(0, true, false, false),
            [],
            "unprivileged BPF allowed"
        );
        let m = missing(BPF, false, true, false);
        assert_eq!(m[0].capability, "CAP_SYS_ADMIN");
        assert!(m[0].needed_for.contains("allow_by_id"));
        let m = missing(BPF, false, false, true);
        assert!(m[0].needed_for.contains("mounting"));
    }

    #[test]
    fn typed_maps_need_cap_sys_admin() {
        assert_eq!(typed_maps_off(ADMIN), None);
        assert_eq!(typed_maps_off(ADMIN | BPF), None);
        let m = typed_maps_off(BPF).expect("off without CAP_SYS_ADMIN");
        assert_eq!(m.capability, "CAP_SYS_ADMIN");
        assert!(m.needed_for.starts_with("typed maps"));
    }
}
