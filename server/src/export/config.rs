//! `[[export]]` tables: a map as Prometheus metrics, as an operator writes
//! it, and what is checked before the daemon starts (or takes a reload).

use std::{collections::BTreeMap, time::Duration};

use serde::Deserialize;

use bpfmap_proto::typed::TypeError;

use super::names::{LabelNames, UnknownNames};
use crate::model::{InvalidPath, MapName, MapRef, MapRequest, Requested};

/// One `[[export]]` table.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ExportConfig {
    /// The map: a path under a root, `id:N`, or `name:NAME[@OWNER]`.
    pub map: String,
    /// The metric's name (a counter's may end in `_total`).
    pub metric: String,
    /// Its help text.
    #[serde(default)]
    pub help: String,
    /// `counter`, `gauge` or `histogram`.
    pub kind: ExportKind,
    /// The member summed over the entries (and CPUs) of each series; for a
    /// histogram, an array of counts per bucket. Without it: the number of
    /// entries.
    #[serde(default)]
    pub value: Option<String>,
    /// Members whose values label the series ("key.daddr"); entries with
    /// the same labels are added up. The label's name is the member's last
    /// name ("daddr"), or the part before `=` ("dst=key.daddr").
    #[serde(default)]
    pub labels: Vec<String>,
    /// How members are shown ("key.daddr" = "ipv4"), over the configured
    /// `[[render]]` tables.
    #[serde(default)]
    pub render: BTreeMap<String, String>,
    /// Names for the values of label members (by member path, as in
    /// `labels`): the host's `syscall`, `ifname`, `ksym` or `cgroup`
    /// names, or a table of values (`{ "1" = "drop" }`). `decode`, its
    /// earlier name, is read too.
    #[serde(default, alias = "decode")]
    pub names: BTreeMap<String, LabelNames>,
    /// Only the entries for which this CEL expression is true.
    #[serde(default)]
    pub filter: String,
    /// A histogram's buckets: `exp2` (slot i counts values below
    /// 2^(i+1), as libbpf-tools) or `linear` (slot i counts values below
    /// (i+1) x `bucket_width`).
    #[serde(default)]
    pub buckets: Option<Buckets>,
    /// The width of a `linear` histogram's buckets.
    #[serde(default = "one")]
    pub bucket_width: u64,
    /// At most this many series (the largest kept); the others are counted
    /// in `bpfmapd_export_series_dropped_total`.
    #[serde(default = "default_max_series")]
    pub max_series: usize,
    /// A scrape within this long of the last scan of the map is served
    /// that scan.
    #[serde(default = "default_min_interval", with = "humantime_serde")]
    pub min_interval: Duration,
    /// How long one scan may take; a scrape serves the last scan (or
    /// nothing) when it takes longer.
    #[serde(default = "default_timeout", with = "humantime_serde")]
    pub timeout: Duration,
}

impl ExportConfig {
    /// An export of `map` as the metric `metric` of kind `kind`: the
    /// number of entries, one series, until the other fields say more.
    pub fn new(map: impl Into<String>, metric: impl Into<String>, kind: ExportKind) -> Self {
        Self {
            map: map.into(),
            metric: metric.into(),
            help: String::new(),
            kind,
            value: None,
            labels: Vec::new(),
            render: BTreeMap::new(),
            names: BTreeMap::new(),
            filter: String::new(),
            buckets: None,
            bucket_width: one(),
            max_series: default_max_series(),
            min_interval: default_min_interval(),
            timeout: default_timeout(),
        }
    }
}

fn one() -> u64 {
    1
}

fn default_max_series() -> usize {
    1000
}

fn default_min_interval() -> Duration {
    Duration::from_secs(5)
}

fn default_timeout() -> Duration {
    Duration::from_secs(10)
}

/// What kind of metric an export is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ExportKind {
    /// Only goes up (the sum of counts); `_total` is added to its samples.
    Counter,
    /// Goes up and down (entries, levels).
    Gauge,
    /// Counts per bucket, from an array member.
    Histogram,
}

/// A histogram's bucket bounds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Buckets {
    /// Slot i counts values below 2^(i+1).
    Exp2,
    /// Slot i counts values below (i+1) x bucket_width.
    Linear,
}

/// An `[[export]]` table that cannot be used: which one, and why.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("[[export]] {index} (metric {metric:?}): {why}")]
pub struct ExportConfigError {
    index: usize,
    metric: String,
    why: ExportProblem,
}

/// What is wrong with an `[[export]]` table.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub(crate) enum ExportProblem {
    #[error("{0:?} is not a metric name (letters, digits, '_' and ':', not starting with a digit)")]
    MetricName(String),
    #[error("names starting {0:?} are the daemon's own")]
    Reserved(&'static str),
    #[error("{0:?} leaves no name without `_total`")]
    NoFamily(String),
    #[error("a histogram needs `value`, the array of counts per bucket")]
    HistogramWithoutValue,
    #[error("a histogram needs `buckets` (\"exp2\" or \"linear\")")]
    HistogramWithoutBuckets,
    #[error("`buckets` is for histograms")]
    BucketsWithoutHistogram,
    #[error("bucket_width must be at least 1")]
    NoBucketWidth,
    #[error("max_series must be at least 1")]
    NoSeries,
    #[error("min_interval and timeout must be more than 0")]
    NoTime,
    #[error("a histogram's label cannot be named \"le\" (its buckets')")]
    LabelNamedLe,
    #[error("two labels are named {name:?}: name one NAME=PATH (\"dst={label}\")")]
    SameLabelName { name: String, label: String },
    #[error(
        "label {label:?}: {name:?} is not a label name (letters, digits and '_', not starting with a digit or \"__\"); name it NAME=PATH"
    )]
    LabelName { label: String, name: String },
    #[error("label {label:?}: {source}")]
    LabelPath { label: String, source: TypeError },
    #[error("names names {path:?}, which is not one of the labels")]
    NamesNotALabel { path: String },
    #[error("names {path:?}: {source}")]
    Names { path: String, source: UnknownNames },
    #[error("map {text:?}: {id:?} is not a map id")]
    MapId { text: String, id: String },
    #[error("map {text:?}: {source}")]
    Map { text: String, source: InvalidPath },
    #[error("[[export]] {other} already exports the family {family:?}")]
    SameFamily { other: usize, family: String },
}

/// An export, checked: its map, its metric's family name and its labels'
/// names.
#[derive(Debug, Clone)]
pub(crate) struct Checked {
    pub(crate) config: ExportConfig,
    pub(crate) map: MapRequest,
    /// The metric family's name (a counter's without `_total`).
    pub(crate) family: String,
    /// (label name, member path), in order.
    pub(crate) labels: Vec<(String, String)>,
}

/// Names the daemon's own metrics use.
const RESERVED: [&str; 3] = ["bpfmapd_", "grpc_", "process_"];

/// Checks every table: each alone, then that no two export one family.
pub(crate) fn check(exports: &[ExportConfig]) -> Result<Vec<Checked>, ExportConfigError> {
    let mut out: Vec<Checked> = Vec::new();
    for (index, e) in exports.iter().enumerate() {
        let bad = |why: ExportProblem| ExportConfigError {
            index,
            metric: e.metric.clone(),
            why,
        };
        let checked = check_one(e).map_err(bad)?;
        if let Some(other) = out.iter().position(|c| c.family == checked.family) {
            return Err(bad(ExportProblem::SameFamily {
                other,
                family: checked.family,
            }));
        }
        out.push(checked);
    }
    Ok(out)
}

fn check_one(e: &ExportConfig) -> Result<Checked, ExportProblem> {
    let family = family_of(e)?;
    match (e.kind, &e.value, e.buckets) {
        (ExportKind::Histogram, None, _) => return Err(ExportProblem::HistogramWithoutValue),
        (ExportKind::Histogram, _, None) => return Err(ExportProblem::HistogramWithoutBuckets),
        (ExportKind::Counter | ExportKind::Gauge, _, Some(_)) => {
            return Err(ExportProblem::BucketsWithoutHistogram);
        }
        _ => {}
    }
    if e.bucket_width == 0 {
        return Err(ExportProblem::NoBucketWidth);
    }
    if e.max_series == 0 {
        return Err(ExportProblem::NoSeries);
    }
    if e.min_interval.is_zero() || e.timeout.is_zero() {
        return Err(ExportProblem::NoTime);
    }
    let mut labels: Vec<(String, String)> = Vec::new();
    for l in &e.labels {
        let (name, path) = label(l)?;
        if e.kind == ExportKind::Histogram && name == "le" {
            return Err(ExportProblem::LabelNamedLe);
        }
        if labels.iter().any(|(n, _)| *n == name) {
            return Err(ExportProblem::SameLabelName {
                name,
                label: l.clone(),
            });
        }
        labels.push((name, path));
    }
    for (path, names) in &e.names {
        if !labels.iter().any(|(_, p)| p == path) {
            return Err(ExportProblem::NamesNotALabel { path: path.clone() });
        }
        names.check().map_err(|source| ExportProblem::Names {
            path: path.clone(),
            source,
        })?;
    }
    Ok(Checked {
        config: e.clone(),
        map: map_request(&e.map)?,
        family,
        labels,
    })
}

/// The family a metric name gives: a counter's `_total` taken off.
fn family_of(e: &ExportConfig) -> Result<String, ExportProblem> {
    let name = e.metric.as_str();
    let valid = !name.is_empty()
        && !name.starts_with(|c: char| c.is_ascii_digit())
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == ':');
    if !valid {
        return Err(ExportProblem::MetricName(name.to_owned()));
    }
    if let Some(prefix) = RESERVED.iter().find(|p| name.starts_with(**p)) {
        return Err(ExportProblem::Reserved(prefix));
    }
    let family = match e.kind {
        ExportKind::Counter => name.strip_suffix("_total").unwrap_or(name),
        _ => name,
    };
    if family.is_empty() {
        return Err(ExportProblem::NoFamily(name.to_owned()));
    }
    Ok(family.to_owned())
}

/// A label as written: `PATH` (named after its last member) or
/// `NAME=PATH`.
fn label(text: &str) -> Result<(String, String), ExportProblem> {
    let (name, path) = match text.split_once('=') {
        Some((n, p)) => (n.trim().to_owned(), p.trim().to_owned()),
        None => (default_name(text), text.trim().to_owned()),
    };
    let valid = !name.is_empty()
        && !name.starts_with(|c: char| c.is_ascii_digit())
        && !name.starts_with("__")
        && name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_');
    if !valid {
        return Err(ExportProblem::LabelName {
            label: text.to_owned(),
            name,
        });
    }
    bpfmap_proto::typed::parse_path(&path).map_err(|source| ExportProblem::LabelPath {
        label: text.to_owned(),
        source,
    })?;
    Ok((name, path))
}

/// A member path's last name, as a label name: "key.daddr" is "daddr",
/// "key.addr[1]" is "addr_1", "key" is "key".
fn default_name(path: &str) -> String {
    let last = path.trim().rsplit('.').next().unwrap_or(path);
    last.chars()
        .map(|c| if c.is_ascii_alphanumeric() { c } else { '_' })
        .collect::<String>()
        .trim_end_matches('_')
        .to_owned()
}

/// The map an export names.
fn map_request(text: &str) -> Result<MapRequest, ExportProblem> {
    let invalid = |source| ExportProblem::Map {
        text: text.to_owned(),
        source,
    };
    let map = if let Some(id) = text.strip_prefix("id:") {
        let id: u32 = id.parse().map_err(|_| ExportProblem::MapId {
            text: text.to_owned(),
            id: id.to_owned(),
        })?;
        Requested::Ref(MapRef::Id(id))
    } else if let Some(name) = text.strip_prefix("name:") {
        Requested::Name(MapName::parse(name).map_err(invalid)?)
    } else {
        Requested::Ref(MapRef::parse(text).map_err(invalid)?)
    };
    Ok(MapRequest {
        map,
        declared: Default::default(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn export(toml_text: &str) -> ExportConfig {
        toml::from_str(toml_text).unwrap()
    }

    const COUNTER: &str = r#"
        map = "tc/globals/ct"
        metric = "ct_bytes_total"
        kind = "counter"
        value = "value.bytes"
        labels = ["key.daddr", "proto=key.nexthdr"]
    "#;

    #[test]
    fn a_counter_loses_its_total_and_labels_take_their_last_name() {
        let c = check(&[export(COUNTER)]).unwrap().remove(0);
        assert_eq!(c.family, "ct_bytes");
        assert_eq!(
            c.labels,
            [
                ("daddr".to_owned(), "key.daddr".to_owned()),
                ("proto".to_owned(), "key.nexthdr".to_owned())
            ]
        );
        assert_eq!(c.config.max_series, 1000);
        assert_eq!(c.config.min_interval, Duration::from_secs(5));
        assert_eq!(default_name("key.addr[1]"), "addr_1");
    }

    #[test]
    fn bad_tables_are_refused_naming_the_table_and_why() {
        let cases = [
            (
                r#"map = "m"
                metric = "9x"
                kind = "gauge""#,
                "is not a metric name",
            ),
            (
                r#"map = "m"
                metric = "bpfmapd_x"
                kind = "gauge""#,
                "the daemon's own",
            ),
            (
                r#"map = "m"
                metric = "h"
                kind = "histogram"
                value = "value.slots""#,
                "needs `buckets`",
            ),
            (
                r#"map = "m"
                metric = "g"
                kind = "gauge"
                buckets = "exp2""#,
                "for histograms",
            ),
            (
                r#"map = "m"
                metric = "g"
                kind = "gauge"
                labels = ["key.a.x", "value.x"]"#,
                "two labels are named \"x\"",
            ),
            (
                r#"map = "id:x"
                metric = "g"
                kind = "gauge""#,
                "is not a map id",
            ),
            (
                r#"map = "../etc"
                metric = "g"
                kind = "gauge""#,
                "map \"../etc\"",
            ),
            (
                r#"map = "m"
                metric = "g"
                kind = "gauge"
                labels = ["key.daddr["]"#,
                "label \"key.daddr[\"",
            ),
        ];
        for (text, why) in cases {
            let e = check(&[export(text)]).unwrap_err().to_string();
            assert!(e.starts_with("[[export]] 0 (metric"), "{e}");
            assert!(e.contains(why), "{e} (wanted {why:?})");
        }
        let e = check(&[export(COUNTER), export(COUNTER)])
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("[[export]] 0 already exports the family \"ct_bytes\""),
            "{e}"
        );
        assert!(
            toml::from_str::<ExportConfig>(
                "map = \"m\"\nmetric = \"g\"\nkind = \"gauge\"\nlables = []"
            )
            .is_err()
        );
    }
}
