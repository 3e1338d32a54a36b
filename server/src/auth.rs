//! Who is calling, and what they may do.
//!
//! The policy is a list of rules; a request is allowed when one rule names
//! the caller's identity, the map and the operation. Nothing else is allowed
//! (deny by default). Identities and maps are exact strings or globs: in map
//! patterns `*` stays within one path component and `**` crosses them; maps
//! reached by id are named `id:N` (`id:*` for all).
//!
//! Over plaintext every caller is `anonymous`. When no rule is configured and
//! TLS is off (the loopback default), `anonymous` may do everything; with TLS
//! and no rules, everything is denied.

use std::{net::SocketAddr, sync::Arc};

use globset::{Glob, GlobBuilder, GlobSet, GlobSetBuilder};
use serde::Deserialize;
use tonic::{Request, Status};

use crate::tls::ConnInfo;

/// The identity of plaintext callers.
pub const ANONYMOUS: &str = "anonymous";

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
    /// Identities (exact or glob): "spiffe://example.org/ns/ops/*".
    pub identities: Vec<String>,
    /// Maps: path globs ("demo/*", "cilium/**") or "id:N" / "id:*".
    pub maps: Vec<String>,
    pub operations: Vec<Operation>,
}

#[derive(Debug)]
struct Rule {
    identities: GlobSet,
    maps: GlobSet,
    operations: Vec<Operation>,
}

#[derive(Debug)]
pub struct Policy {
    rules: Vec<Rule>,
    open: bool,
}

#[derive(Debug, thiserror::Error)]
#[error("invalid pattern {pattern:?} in rule {rule}: {kind}")]
pub struct PolicyError {
    rule: usize,
    pattern: String,
    kind: globset::ErrorKind,
}

fn globs(
    patterns: &[String],
    rule: usize,
    build: impl Fn(&str) -> Result<Glob, globset::Error>,
) -> Result<GlobSet, PolicyError> {
    let mut set = GlobSetBuilder::new();
    for p in patterns {
        set.add(build(p).map_err(|e| PolicyError {
            rule,
            pattern: p.clone(),
            kind: e.kind().clone(),
        })?);
    }
    set.build().map_err(|e| PolicyError {
        rule,
        pattern: patterns.join(", "),
        kind: e.kind().clone(),
    })
}

impl Policy {
    /// `tls` decides what an empty rule list means (see the module docs).
    pub fn new(rules: &[RuleConfig], tls: bool) -> Result<Self, PolicyError> {
        let rules = rules
            .iter()
            .enumerate()
            .map(|(i, r)| {
                Ok(Rule {
                    identities: globs(&r.identities, i, Glob::new)?,
                    maps: globs(&r.maps, i, |p| {
                        GlobBuilder::new(p).literal_separator(true).build()
                    })?,
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

    pub fn allows(&self, identity: &str, op: Operation, map: &str) -> bool {
        self.open
            || self.rules.iter().any(|r| {
                r.operations.contains(&op)
                    && r.identities.is_match(identity)
                    && r.maps.is_match(map)
            })
    }
}

/// The authenticated caller of a request.
#[derive(Debug, Clone)]
pub struct Caller {
    pub identity: Arc<str>,
    pub peer: Option<SocketAddr>,
}

impl Caller {
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
    let identity = match (&info.identity, info.tls) {
        (Some(id), _) => id.clone(),
        (None, false) => Arc::from(ANONYMOUS),
        (None, true) => {
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

    #[test]
    fn rules_match_identity_map_and_operation() {
        use Operation::*;
        let p = Policy::new(
            &[
                rule(&["spiffe://ex.org/ops/*"], &["demo/*"], &[List, Dump]),
                rule(&["alice"], &["cilium/**", "id:7"], &[Lookup]),
            ],
            true,
        )
        .unwrap();
        assert!(p.allows("spiffe://ex.org/ops/a", Dump, "demo/flows"));
        assert!(
            p.allows("spiffe://ex.org/ops/team/b", List, "demo/x"),
            "* in identities crosses /"
        );
        assert!(
            !p.allows("spiffe://ex.org/ops/a", Lookup, "demo/flows"),
            "operation"
        );
        assert!(
            !p.allows("spiffe://ex.org/ops/a", Dump, "demo/a/b"),
            "* stays in one component"
        );
        assert!(
            !p.allows("spiffe://ex.org/dev/a", Dump, "demo/flows"),
            "identity"
        );
        assert!(p.allows("alice", Lookup, "cilium/a/b/c"));
        assert!(p.allows("alice", Lookup, "id:7"));
        assert!(!p.allows("alice", Lookup, "id:8"));
        assert!(!p.allows("alicex", Lookup, "id:7"));
        assert!(!p.allows(ANONYMOUS, List, "demo/flows"));
    }

    #[test]
    fn empty_policy_is_open_only_without_tls() {
        assert!(
            Policy::new(&[], false)
                .unwrap()
                .allows(ANONYMOUS, Operation::Dump, "x")
        );
        assert!(
            !Policy::new(&[], true)
                .unwrap()
                .allows("alice", Operation::Dump, "x")
        );
        let bad = Policy::new(&[rule(&["a"], &["demo/[x"], &[Operation::List])], true);
        assert!(bad.unwrap_err().to_string().contains("demo/[x"));
    }
}
