//! Who may ask the relay what: the daemon's policy (identities, maps,
//! operations; deny by default with TLS, open on plaintext loopback without
//! rules), each rule also naming the targets it covers.

use bpfmapd::{
    Operation, RuleConfig,
    frontend::{Identity, Policy, PolicyError},
};
use globset::{Glob, GlobSet, GlobSetBuilder};
use serde::Deserialize;

/// A `[[rule]]` table that cannot be used.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RuleError {
    /// Its identities, maps or operations, as the daemon's rules say.
    #[error("rule {rule}: {error}")]
    Daemon {
        /// Index of the rule (from 0).
        rule: usize,
        /// What is wrong with it.
        #[source]
        error: PolicyError,
    },
    /// A target pattern that is not a glob.
    #[error("rule {rule}: invalid target pattern {pattern:?}: {error}")]
    Target {
        /// Index of the rule (from 0).
        rule: usize,
        /// The pattern.
        pattern: String,
        /// What is wrong with it.
        #[source]
        error: globset::Error,
    },
}

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
    pub(crate) fn new(rules: &[RelayRule], tls: bool) -> Result<Self, RuleError> {
        let mut compiled = Vec::new();
        for (i, r) in rules.iter().enumerate() {
            let rule = RuleConfig {
                identities: r.identities.clone(),
                maps: r.maps.clone(),
                operations: r.operations.clone(),
            };
            let policy = Policy::new(std::slice::from_ref(&rule), tls)
                .map_err(|error| RuleError::Daemon { rule: i, error })?;
            let targets = match &r.targets {
                None => None,
                Some(patterns) => Some(target_globs(i, patterns)?),
            };
            compiled.push((policy, targets));
        }
        // No rule: open on plaintext, as the daemon's policy is.
        let open = rules.is_empty()
            && Policy::new(&[], tls)
                .map_err(|error| RuleError::Daemon { rule: 0, error })?
                .is_open();
        Ok(Self {
            rules: compiled,
            open,
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

/// The target patterns of rule `rule`.
fn target_globs(rule: usize, patterns: &[String]) -> Result<GlobSet, RuleError> {
    let invalid = |pattern: &str| {
        let pattern = pattern.to_owned();
        move |error| RuleError::Target {
            rule,
            pattern,
            error,
        }
    };
    let mut set = GlobSetBuilder::new();
    for p in patterns {
        set.add(Glob::new(p).map_err(invalid(p))?);
    }
    set.build().map_err(invalid(&patterns.join(", ")))
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
