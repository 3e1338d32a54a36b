//! Who may ask the relay what: the daemon's policy (identities, maps,
//! operations; deny by default with TLS, open on plaintext loopback without
//! rules), each rule also naming the targets it covers.

use bpfmapd::{
    Operation, RuleConfig,
    frontend::{Identity, Policy},
};
use globset::{Glob, GlobSet, GlobSetBuilder};

use serde::Deserialize;

/// One `[[rule]]`: the daemon's rule, and the targets it covers.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RelayRule {
    /// Identity patterns, as in the daemon's rules.
    pub identities: Vec<String>,
    /// Map patterns, matched against the reference as requested (a path,
    /// `id:N`, `name:NAME@OWNER`; an inner map as its outer map).
    pub maps: Vec<String>,
    /// What they may do.
    pub operations: Vec<Operation>,
    /// Target patterns (globs of target names); absent: every target.
    #[serde(default)]
    pub targets: Option<Vec<String>>,
}

/// The relay's rules, compiled.
#[derive(Debug)]
pub(crate) struct RelayPolicy {
    /// Each rule, and the targets it covers (`None`: every target).
    rules: Vec<(Policy, Option<GlobSet>)>,
    /// No rule and plaintext: every caller may read everything.
    open: bool,
}

impl RelayPolicy {
    /// Compiles `rules`; `tls` decides what an empty list means, as for the
    /// daemon.
    pub(crate) fn new(rules: &[RelayRule], tls: bool) -> anyhow::Result<Self> {
        let open = Policy::new(&[], tls)?.is_open();
        let mut compiled = Vec::new();
        for (i, r) in rules.iter().enumerate() {
            let rule = RuleConfig {
                identities: r.identities.clone(),
                maps: r.maps.clone(),
                operations: r.operations.clone(),
            };
            let policy = Policy::new(std::slice::from_ref(&rule), tls)
                .map_err(|e| anyhow::anyhow!("rule {i}: {e}"))?;
            let targets = match &r.targets {
                None => None,
                Some(patterns) => {
                    let mut set = GlobSetBuilder::new();
                    for p in patterns {
                        set.add(Glob::new(p).map_err(|e| {
                            anyhow::anyhow!("rule {i}: invalid target pattern {p:?}: {e}")
                        })?);
                    }
                    Some(set.build()?)
                }
            };
            compiled.push((policy, targets));
        }
        Ok(Self {
            rules: compiled,
            open: open && rules.is_empty(),
        })
    }

    /// Whether `identity` may do `op` on `map` (as requested) on `target`.
    pub(crate) fn allows(
        &self,
        identity: &Identity,
        op: Operation,
        map: &str,
        target: &str,
    ) -> bool {
        if self.open {
            return op != Operation::Drain;
        }
        self.rules.iter().any(|(policy, targets)| {
            policy.allows_named(identity, op, map)
                && targets.as_ref().is_none_or(|t| t.is_match(target))
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rule(ids: &[&str], maps: &[&str], targets: Option<&[&str]>) -> RelayRule {
        RelayRule {
            identities: ids.iter().map(|s| s.to_string()).collect(),
            maps: maps.iter().map(|s| s.to_string()).collect(),
            operations: vec![Operation::Dump, Operation::List],
            targets: targets.map(|t| t.iter().map(|s| s.to_string()).collect()),
        }
    }

    #[test]
    fn rules_cover_their_targets() {
        let ops = Identity::Cn("ops".into());
        let p = RelayPolicy::new(
            &[
                rule(&["cn:ops"], &["fleet/*"], Some(&["10.0.0.*"])),
                rule(&["cn:ops"], &["demo/*"], None),
            ],
            true,
        )
        .unwrap();
        assert!(p.allows(&ops, Operation::Dump, "fleet/conns", "10.0.0.7:50051"));
        assert!(!p.allows(&ops, Operation::Dump, "fleet/conns", "10.0.1.7:50051"));
        assert!(p.allows(&ops, Operation::Dump, "demo/flows", "10.0.1.7:50051"));
        assert!(!p.allows(&ops, Operation::Lookup, "demo/flows", "10.0.1.7:50051"));
        assert!(!p.allows(&Identity::Anonymous, Operation::Dump, "demo/flows", "x"));
        // Plaintext without rules: open, but never drains.
        let open = RelayPolicy::new(&[], false).unwrap();
        assert!(open.allows(&Identity::Anonymous, Operation::Dump, "any", "t"));
        assert!(!open.allows(&Identity::Anonymous, Operation::Drain, "any", "t"));
        // TLS without rules: closed.
        let closed = RelayPolicy::new(&[], true).unwrap();
        assert!(!closed.allows(&ops, Operation::Dump, "demo/flows", "t"));
    }
}
