//! Who is calling, and what they may do.
//!
//! An [`Identity`] is typed: a SPIFFE ID (URI SAN), a DNS name (DNS SAN), a
//! certificate subject CN, or `anonymous` (plaintext). Its text form says
//! which: `spiffe://example.org/ops/alice`, `dns:bob.example.org`,
//! `cn:carol`, `anonymous`. A rule's identity pattern is written the same way,
//! so a pattern for one kind never matches a name of another (a certificate
//! whose CN reads `spiffe://...` is `cn:spiffe://...`, not that SPIFFE ID).
//!
//! The policy is a list of rules; a request is allowed when one rule names
//! the caller's identity, the map and the operation. Nothing else is allowed
//! (deny by default). Patterns are globs: `*` matches within one `/`-separated
//! segment, `**` across segments, `?` one character, `[ab]` a class. Maps are
//! named by path ("demo/flows") or, when reached by id, `id:N`.
//!
//! When no rule is configured and TLS is off (the loopback default),
//! `anonymous` may do everything; with TLS and no rules, everything is denied.
#![forbid(unsafe_code)]

use std::{fmt, net::SocketAddr, sync::Arc};

use globset::{GlobBuilder, GlobSet, GlobSetBuilder};
use serde::Deserialize;
use tonic::{Request, Status};

use crate::{catalog::MapRef, conn::ConnInfo};

/// A verified caller identity.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Identity {
    /// A plaintext caller.
    Anonymous,
    /// A SPIFFE ID from a URI SAN (the whole URI, `spiffe://...`).
    Spiffe(Arc<str>),
    /// A DNS SAN.
    Dns(Arc<str>),
    /// The subject common name.
    Cn(Arc<str>),
}

impl fmt::Display for Identity {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Anonymous => f.write_str("anonymous"),
            Self::Spiffe(uri) => f.write_str(uri),
            Self::Dns(name) => write!(f, "dns:{name}"),
            Self::Cn(name) => write!(f, "cn:{name}"),
        }
    }
}

/// What a caller wants to do.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Operation {
    /// ListMaps and GetMap.
    List,
    /// DumpMap.
    Dump,
    /// Lookup.
    Lookup,
}

impl Operation {
    /// The verb used in messages ("may not dump demo/flows").
    pub fn verb(self) -> &'static str {
        match self {
            Self::List => "list",
            Self::Dump => "dump",
            Self::Lookup => "look up keys in",
        }
    }
}

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
        "identity pattern {pattern:?} in rule {rule} does not say which kind of name it matches: write spiffe://..., dns:NAME, cn:NAME or anonymous"
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
        || pattern.starts_with("cn:");
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
        if self.open {
            return true;
        }
        let (identity, map) = (identity.to_string(), map.to_string());
        self.rules.iter().any(|r| {
            r.operations.contains(&op) && r.identities.is_match(&identity) && r.maps.is_match(&map)
        })
    }
}

/// The authenticated caller of a request.
#[derive(Debug, Clone)]
pub struct Caller {
    /// Who.
    pub identity: Identity,
    /// From where.
    pub peer: Option<SocketAddr>,
}

impl Caller {
    /// The caller the [`authenticate`] interceptor stored in the request.
    pub fn of<T>(req: &Request<T>) -> Result<Caller, Status> {
        req.extensions()
            .get::<Caller>()
            .cloned()
            .ok_or_else(|| Status::unauthenticated("no caller identity"))
    }
}

/// Interceptor for every service but health: resolves the caller's identity
/// (UNAUTHENTICATED without one on TLS) and stores it in the request.
pub fn authenticate(mut req: Request<()>) -> Result<Request<()>, Status> {
    let info = req
        .extensions()
        .get::<ConnInfo>()
        .cloned()
        .unwrap_or_default();
    let identity = match info.transport {
        crate::tls::Transport::Plaintext => Identity::Anonymous,
        crate::tls::Transport::Tls {
            identity: Some(id), ..
        } => id,
        crate::tls::Transport::Tls { identity: None } => {
            tracing::info!(
                target: "bpfmapd::audit",
                identity = "",
                peer = info.remote.map(|p| p.to_string()).unwrap_or_default(),
                code = ?tonic::Code::Unauthenticated,
                "rpc rejected: no client certificate"
            );
            return Err(Status::unauthenticated(
                "a client certificate signed by the server's client CA is required",
            ));
        }
    };
    req.extensions_mut().insert(Caller {
        identity,
        peer: info.remote,
    });
    Ok(req)
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
