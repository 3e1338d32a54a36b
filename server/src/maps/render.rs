//! Renderings an operator configures per map (`[[render]]`), so that
//! grpcurl users see addresses without asking: the maps' path globs and
//! member renderings, matched in order (a later rule overrides an earlier
//! one for the same member), then overridden by a request's own.

use std::collections::BTreeMap;

use bpfmap_proto::typed::{Renderings, TypeError};
use globset::GlobSet;
use serde::Deserialize;

use super::declared::{glob_error, glob_set};
use crate::model::MapRef;

/// One `[[render]]` table as written in the configuration.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RenderConfig {
    /// Map path globs, as in rules ("tc/globals/cilium_ct4*").
    #[serde(default)]
    pub maps: Vec<String>,
    /// Kernel name globs ("filter_ipv4"), for maps without pins too.
    #[serde(default)]
    pub names: Vec<String>,
    /// Member path to rendering ("key.daddr" = "ipv4").
    pub members: BTreeMap<String, String>,
}

/// A `[[render]]` table that cannot be used: which one, and why.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub(crate) enum RenderConfigError {
    /// A pattern that is not a glob, or patterns missing.
    #[error("[[render]] {table}: {why}")]
    Patterns { table: usize, why: String },
    /// A member path or a rendering that is not one.
    #[error("[[render]] {table}: {why}")]
    Member { table: usize, why: TypeError },
}

/// The configured renderings, compiled.
#[derive(Debug, Default)]
pub(crate) struct RenderRules {
    rules: Vec<(GlobSet, GlobSet, Renderings)>,
}

impl RenderRules {
    /// Compiles the `[[render]]` tables; the error names the table and what
    /// is wrong.
    pub(crate) fn new(tables: &[RenderConfig]) -> Result<Self, RenderConfigError> {
        let mut rules = Vec::new();
        for (table, t) in tables.iter().enumerate() {
            if t.maps.is_empty() && t.names.is_empty() {
                return Err(RenderConfigError::Patterns {
                    table,
                    why: "give maps (path globs) or names (kernel name globs)".into(),
                });
            }
            let set = |patterns: &[String]| {
                glob_set(patterns).map_err(|e| RenderConfigError::Patterns {
                    table,
                    why: glob_error(&e),
                })
            };
            let (maps, names) = (set(&t.maps)?, set(&t.names)?);
            let renderings = Renderings::parse(&t.members)
                .map_err(|why| RenderConfigError::Member { table, why })?;
            rules.push((maps, names, renderings));
        }
        Ok(Self { rules })
    }

    /// The renderings configured for `map`, whose kernel name is `name`.
    pub(crate) fn for_map(&self, map: &MapRef, name: &str) -> Renderings {
        let path = map.to_string();
        self.rules
            .iter()
            .filter(|(maps, names, _)| maps.is_match(&path) || names.is_match(name))
            .fold(Renderings::default(), |acc, (_, _, r)| acc.overridden_by(r))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn table(maps: &[&str], members: &[(&str, &str)]) -> RenderConfig {
        RenderConfig {
            maps: maps.iter().map(|s| (*s).to_owned()).collect(),
            names: Vec::new(),
            members: members
                .iter()
                .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
                .collect(),
        }
    }

    #[test]
    fn later_tables_override_earlier_ones_for_the_maps_they_match() {
        let rules = RenderRules::new(&[
            table(
                &["tc/globals/cilium_ct4*"],
                &[("key.daddr", "ipv4"), ("key.saddr", "ipv4")],
            ),
            table(&["tc/globals/cilium_ct4_global"], &[("key.saddr", "hex")]),
        ])
        .unwrap();
        let of = |path: &str| -> Vec<(String, String)> {
            rules
                .for_map(&MapRef::Path(path.into()), "")
                .iter()
                .map(|(p, r)| (p.to_owned(), r.to_string()))
                .collect()
        };
        let pair = |p: &str, r: &str| (p.to_owned(), r.to_owned());
        assert_eq!(
            of("tc/globals/cilium_ct4_global"),
            [pair("key.daddr", "ipv4"), pair("key.saddr", "hex")]
        );
        assert_eq!(
            of("tc/globals/cilium_ct4_any"),
            [pair("key.daddr", "ipv4"), pair("key.saddr", "ipv4")]
        );
        assert!(of("tc/globals/cilium_lb4").is_empty());
        assert!(
            of("other/tc/globals/cilium_ct4_x").is_empty(),
            "globs match whole paths"
        );
        // By kernel name, for maps reached by id or name too.
        let by_name = RenderRules::new(&[RenderConfig {
            maps: Vec::new(),
            names: vec!["filter_ipv4".into()],
            members: [("key".to_owned(), "ipv4".to_owned())].into(),
        }])
        .unwrap();
        assert_eq!(
            by_name
                .for_map(&MapRef::Id(9), "filter_ipv4")
                .iter()
                .count(),
            1
        );
        assert!(by_name.for_map(&MapRef::Id(9), "filter_ipv6").is_empty());
    }

    #[test]
    fn bad_tables_are_refused_naming_them() {
        let e = RenderRules::new(&[table(&["a"], &[("key.x", "ipv9")])])
            .unwrap_err()
            .to_string();
        assert_eq!(
            e,
            "[[render]] 0: key.x: unknown rendering \"ipv9\"; use ipv4, ipv6, mac, hex, be16, be32 or string"
        );
        let e = RenderRules::new(&[table(&["a["], &[])])
            .unwrap_err()
            .to_string();
        assert!(e.starts_with("[[render]] 0: invalid pattern \"a[\""), "{e}");
        let e = RenderRules::new(&[table(&[], &[("key", "ipv4")])])
            .unwrap_err()
            .to_string();
        assert!(e.contains("give maps"), "{e}");
    }
}
