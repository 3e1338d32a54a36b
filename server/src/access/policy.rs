//! What callers may do: the policy.
//!
//! A rule's identity pattern is written as an [`Identity`]'s text form
//! (`spiffe://...`, `dns:NAME`, `cn:NAME`, `anonymous`, `uid:N` for local
//! processes on the Unix socket), so a pattern for
//! one kind never matches a name of another (a certificate whose CN reads
//! `spiffe://...` is `cn:spiffe://...`, not that SPIFFE ID).
//!
//! The policy is a list of rules; a request is allowed when one rule names
//! the caller's identity, the map and the operation. Nothing else is allowed
//! (deny by default). Patterns are globs: `*` matches within one `/`-separated
//! segment, `**` across segments, `?` one character, `[ab]` a class. Maps are
//! named by path ("demo/flows") or, when reached by id, `id:N`.
//!
//! When no rule is configured and TLS is off (the loopback default),
//! `anonymous` and local processes on the Unix socket may do everything;
//! with TLS and no rules, everything is denied (local processes included:
//! a rule for `uid:0` or `uid:*` lets them in).

use globset::{GlobBuilder, GlobSet, GlobSetBuilder};
use serde::Deserialize;

use crate::model::{Identity, MapRef, Operation};

/// One rule as written in the configuration.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RuleConfig {
    /// Identity patterns: "spiffe://example.org/ns/ops/*", "dns:*.example.org",
    /// "cn:carol", "anonymous".
    pub identities: Vec<String>,
    /// Map patterns: path globs ("demo/*", "cilium/**") or "id:N" / "id:*".
    pub maps: Vec<String>,
    /// What the rule allows.
    pub operations: Vec<Operation>,
}

#[derive(Debug)]
struct Rule {
    identities: GlobSet,
    maps: GlobSet,
    operations: Vec<Operation>,
}

/// The authorization policy.
#[derive(Debug)]
pub struct Policy {
    rules: Vec<Rule>,
    open: bool,
}

/// A rule that cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum PolicyError {
    /// A pattern that is not a valid glob.
    #[error("invalid pattern {pattern:?} in rule {rule}: {kind}")]
    Glob {
        /// Index of the rule (from 0).
        rule: usize,
        /// The pattern.
        pattern: String,
        /// What is wrong with it.
        kind: globset::ErrorKind,
    },
    /// An identity pattern that does not say which kind of name it matches.
    #[error(
        "identity pattern {pattern:?} in rule {rule} does not say which kind of name it matches: write spiffe://..., dns:NAME, cn:NAME, uid:N or anonymous"
    )]
    IdentityKind {
        /// Index of the rule (from 0).
        rule: usize,
        /// The pattern.
        pattern: String,
    },
}

fn globs(patterns: &[String], rule: usize) -> Result<GlobSet, PolicyError> {
    let mut set = GlobSetBuilder::new();
    for p in patterns {
        let glob = GlobBuilder::new(p)
            .literal_separator(true)
            .build()
            .map_err(|e| PolicyError::Glob {
                rule,
                pattern: p.clone(),
                kind: e.kind().clone(),
            })?;
        set.add(glob);
    }
    set.build().map_err(|e| PolicyError::Glob {
        rule,
        pattern: patterns.join(", "),
        kind: e.kind().clone(),
    })
}

fn check_identity_kind(pattern: &str, rule: usize) -> Result<(), PolicyError> {
    let typed = pattern == "anonymous"
        || pattern.starts_with("spiffe://")
        || pattern.starts_with("dns:")
        || pattern.starts_with("cn:")
        || pattern.starts_with("uid:");
    if typed {
        Ok(())
    } else {
        Err(PolicyError::IdentityKind {
            rule,
            pattern: pattern.to_owned(),
        })
    }
}

impl Policy {
    /// `tls` decides what an empty rule list means (see the module docs).
    pub fn new(rules: &[RuleConfig], tls: bool) -> Result<Self, PolicyError> {
        let rules = rules
            .iter()
            .enumerate()
            .map(|(i, r)| {
                for p in &r.identities {
                    check_identity_kind(p, i)?;
                }
                Ok(Rule {
                    identities: globs(&r.identities, i)?,
                    maps: globs(&r.maps, i)?,
                    operations: r.operations.clone(),
                })
            })
            .collect::<Result<Vec<_>, PolicyError>>()?;
        Ok(Self {
            open: rules.is_empty() && !tls,
            rules,
        })
    }

    /// Whether the policy lets every caller do everything.
    pub fn is_open(&self) -> bool {
        self.open
    }

    /// Whether `identity` may do `op` to `map`.
    pub fn allows(&self, identity: &Identity, op: Operation, map: &MapRef) -> bool {
        self.allows_named(identity, op, &map.authorized_as().to_string())
    }

    /// Whether the policy allows `op` on the map whose text form is `map`
    /// (a reference as a request wrote it: a path, `id:N`,
    /// `name:NAME@OWNER`).
    pub fn allows_named(&self, identity: &Identity, op: Operation, map: &str) -> bool {
        if self.open || *identity == Identity::Daemon {
            // Writes are never open: a rule must name `drain`. The daemon
            // reads the maps its operator named for export.
            return op != Operation::Drain;
        }
        let identity = identity.to_string();
        // Totals are less than the entries they total: `dump` implies
        // `aggregate`.
        let grants = |ops: &[Operation]| {
            ops.contains(&op) || op == Operation::Aggregate && ops.contains(&Operation::Dump)
        };
        self.rules.iter().any(|r| {
            grants(&r.operations) && r.identities.is_match(&identity) && r.maps.is_match(map)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rule(ids: &[&str], maps: &[&str], ops: &[Operation]) -> RuleConfig {
        RuleConfig {
            identities: ids.iter().map(|s| s.to_string()).collect(),
            maps: maps.iter().map(|s| s.to_string()).collect(),
            operations: ops.to_vec(),
        }
    }

    fn spiffe(s: &str) -> Identity {
        Identity::Spiffe(s.into())
    }

    fn map(p: &str) -> MapRef {
        MapRef::parse(p).unwrap()
    }

    #[test]
    fn rules_match_identity_map_and_operation() {
        use Operation::*;
        let p = Policy::new(
            &[
                rule(&["spiffe://ex.org/ops/*"], &["demo/*"], &[List, Dump]),
                rule(&["cn:alice"], &["cilium/**", "id:7"], &[Lookup]),
                rule(&["spiffe://ex.org/all/**"], &["**"], &[List]),
            ],
            true,
        )
        .unwrap();
        assert!(p.allows(&spiffe("spiffe://ex.org/ops/a"), Dump, &map("demo/flows")));
        assert!(
            !p.allows(&spiffe("spiffe://ex.org/ops/team/b"), List, &map("demo/x")),
            "* in identities stays within one segment"
        );
        assert!(
            p.allows(&spiffe("spiffe://ex.org/all/team/b"), List, &map("demo/x")),
            "** crosses segments"
        );
        assert!(
            !p.allows(&spiffe("spiffe://ex.org/ops/a"), Lookup, &map("demo/flows")),
            "operation"
        );
        assert!(
            !p.allows(&spiffe("spiffe://ex.org/ops/a"), Dump, &map("demo/a/b")),
            "* stays in one component"
        );
        assert!(
            !p.allows(&spiffe("spiffe://ex.org/dev/a"), Dump, &map("demo/flows")),
            "identity"
        );
        let alice = Identity::Cn("alice".into());
        assert!(p.allows(&alice, Lookup, &map("cilium/a/b/c")));
        assert!(p.allows(&alice, Lookup, &MapRef::Id(7)));
        assert!(!p.allows(&alice, Lookup, &MapRef::Id(8)));
        assert!(!p.allows(&Identity::Cn("alicex".into()), Lookup, &MapRef::Id(7)));
        assert!(
            !p.allows(&Identity::Dns("alice".into()), Lookup, &MapRef::Id(7)),
            "a DNS name is not a CN"
        );
        assert!(!p.allows(&Identity::Anonymous, List, &map("demo/flows")));
    }

    #[test]
    fn a_cn_that_looks_like_a_spiffe_id_does_not_get_its_rights() {
        let p = Policy::new(
            &[rule(
                &["spiffe://fleet.example/ops/alice"],
                &["**"],
                &[Operation::Dump],
            )],
            true,
        )
        .unwrap();
        let real = spiffe("spiffe://fleet.example/ops/alice");
        let impostor = Identity::Cn("spiffe://fleet.example/ops/alice".into());
        assert!(p.allows(&real, Operation::Dump, &map("a")));
        assert!(!p.allows(&impostor, Operation::Dump, &map("a")));
        assert_eq!(impostor.to_string(), "cn:spiffe://fleet.example/ops/alice");
    }

    #[test]
    fn untyped_identity_patterns_and_bad_globs_are_refused() {
        let e = Policy::new(&[rule(&["alice"], &["**"], &[Operation::List])], true).unwrap_err();
        assert!(e.to_string().contains("cn:NAME"), "{e}");
        let bad = Policy::new(&[rule(&["cn:a"], &["demo/[x"], &[Operation::List])], true);
        assert!(bad.unwrap_err().to_string().contains("demo/[x"));
    }

    #[test]
    fn empty_policy_is_open_only_without_tls() {
        let anon = Identity::Anonymous;
        assert!(
            Policy::new(&[], false)
                .unwrap()
                .allows(&anon, Operation::Dump, &map("x"))
        );
        assert!(!Policy::new(&[], true).unwrap().allows(
            &Identity::Cn("alice".into()),
            Operation::Dump,
            &map("x")
        ));
    }
}
