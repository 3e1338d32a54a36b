//! Aggregates computed where the map lives (AggregateMap): groups of
//! entries with COUNT, SUM, MIN and MAX per group, ordered, cut to the top
//! groups.

use std::{collections::BTreeMap, fmt, str::FromStr, time::Duration};

use crate::{Error, MapName, PerCpu, pb, typed};

/// What an aggregate computes over a group's entries.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum AggregateOp {
    /// The number of entries.
    Count,
    /// The sum of an integer member (exact).
    Sum,
    /// The smallest value of an integer member.
    Min,
    /// The largest value of an integer member.
    Max,
}

impl AggregateOp {
    /// The name as bpfmapctl spells it: "count", "sum", "min", "max".
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Count => "count",
            Self::Sum => "sum",
            Self::Min => "min",
            Self::Max => "max",
        }
    }

    /// The operation as requests carry it.
    pub fn to_proto(self) -> pb::aggregate::Op {
        match self {
            Self::Count => pb::aggregate::Op::Count,
            Self::Sum => pb::aggregate::Op::Sum,
            Self::Min => pb::aggregate::Op::Min,
            Self::Max => pb::aggregate::Op::Max,
        }
    }
}

/// One aggregate: an operation and the integer member it reads
/// (`sum(value.bytes)`; COUNT reads none).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Aggregate {
    op: AggregateOp,
    field: String,
}

impl Aggregate {
    /// The number of entries of each group.
    pub fn count() -> Self {
        Self {
            op: AggregateOp::Count,
            field: String::new(),
        }
    }

    /// The sum of `field` ("value.bytes").
    pub fn sum(field: impl Into<String>) -> Self {
        Self::of(AggregateOp::Sum, field)
    }

    /// The smallest value of `field`.
    pub fn min(field: impl Into<String>) -> Self {
        Self::of(AggregateOp::Min, field)
    }

    /// The largest value of `field`.
    pub fn max(field: impl Into<String>) -> Self {
        Self::of(AggregateOp::Max, field)
    }

    fn of(op: AggregateOp, field: impl Into<String>) -> Self {
        Self {
            op,
            field: field.into(),
        }
    }

    /// The operation.
    pub fn op(&self) -> AggregateOp {
        self.op
    }

    /// The member it reads ("" for COUNT).
    pub fn field(&self) -> &str {
        &self.field
    }

    /// An aggregate as a request carries it; [`Error::Aggregate`] for an
    /// operation this library does not know.
    pub fn from_proto(a: &pb::Aggregate) -> Result<Self, Error> {
        let op = match pb::aggregate::Op::try_from(a.op) {
            Ok(pb::aggregate::Op::Count) => AggregateOp::Count,
            Ok(pb::aggregate::Op::Sum) => AggregateOp::Sum,
            Ok(pb::aggregate::Op::Min) => AggregateOp::Min,
            Ok(pb::aggregate::Op::Max) => AggregateOp::Max,
            _ => {
                return Err(Error::Aggregate {
                    spec: format!("op {}", a.op),
                    message: "use COUNT, SUM, MIN or MAX".into(),
                });
            }
        };
        Ok(Self::of(op, a.field.clone()))
    }

    pub(crate) fn to_proto(&self) -> pb::Aggregate {
        pb::Aggregate {
            op: self.op.to_proto() as i32,
            field: self.field.clone(),
        }
    }
}

/// `count()`, `sum(value.bytes)`, ...
impl fmt::Display for Aggregate {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}({})", self.op.as_str(), self.field)
    }
}

impl FromStr for Aggregate {
    type Err = Error;

    /// `count()`, `sum(FIELD)`, `min(FIELD)`, `max(FIELD)` (the operation
    /// in any case); [`Error::Aggregate`] says what is wrong.
    fn from_str(s: &str) -> Result<Self, Error> {
        let bad = |message: &str| Error::Aggregate {
            spec: s.to_owned(),
            message: message.to_owned(),
        };
        let text = s.trim();
        let (name, field) = match text.split_once('(') {
            Some((name, rest)) => match rest.strip_suffix(')') {
                Some(field) => (name.trim(), field.trim()),
                None => {
                    return Err(bad(
                        "a closing parenthesis is missing, as in sum(value.bytes)",
                    ));
                }
            },
            None => (text, ""),
        };
        let op = match name.to_ascii_lowercase().as_str() {
            "count" => AggregateOp::Count,
            "sum" => AggregateOp::Sum,
            "min" => AggregateOp::Min,
            "max" => AggregateOp::Max,
            _ => {
                return Err(bad(
                    "use count(), sum(FIELD), min(FIELD) or max(FIELD), FIELD an integer member such as value.bytes",
                ));
            }
        };
        match (op, field.is_empty()) {
            (AggregateOp::Count, false) => Err(bad("count() counts entries and takes no field")),
            (AggregateOp::Count, true) => Ok(Self::count()),
            (_, true) => Err(bad(&format!(
                "{}() needs an integer member, as in {}(value.bytes)",
                op.as_str(),
                op.as_str()
            ))),
            (_, false) if field.contains(['(', ')', ',', ' ']) => {
                Err(bad("the field is one member path, such as value.bytes"))
            }
            (_, false) => Ok(Self::of(op, field)),
        }
    }
}

/// The most aggregates one call asks (the daemon's limit).
pub const MAX_AGGREGATES: usize = 16;

/// Options of an aggregate ([`Client::aggregate`](crate::Client::aggregate)).
#[derive(Debug, Clone, Default)]
#[non_exhaustive]
pub struct AggregateOptions {
    filter: String,
    group_by: Vec<String>,
    aggregates: Vec<Aggregate>,
    order_by: usize,
    ascending: bool,
    limit: u32,
    threshold: Option<i128>,
    groups: Vec<Vec<u8>>,
    per_cpu: PerCpu,
    render: BTreeMap<String, String>,
    batched: bool,
}

impl AggregateOptions {
    /// The options of an `AggregateMapRequest` as a caller wrote it (its
    /// map aside), for a program that forwards requests (a relay).
    /// [`Error::Aggregate`] for an operation or threshold that is not one.
    pub fn from_proto(req: &pb::AggregateMapRequest) -> Result<Self, Error> {
        let aggregates = req
            .aggregates
            .iter()
            .map(Aggregate::from_proto)
            .collect::<Result<Vec<_>, _>>()?;
        let threshold = match req.threshold.as_str() {
            "" => None,
            t => Some(t.parse().map_err(|_| Error::Aggregate {
                spec: format!("threshold {t}"),
                message: "the threshold is an integer".into(),
            })?),
        };
        Ok(Self {
            filter: req.filter.clone(),
            group_by: req.group_by.clone(),
            aggregates,
            order_by: req.order_by as usize,
            ascending: req.ascending,
            limit: req.limit,
            threshold,
            groups: req.groups.clone(),
            per_cpu: if req.per_cpu == pb::PerCpu::Sum as i32 {
                PerCpu::Sum
            } else {
                PerCpu::Each
            },
            render: req.render.clone().into_iter().collect(),
            batched: req.scan == pb::ScanMethod::ScanBatched as i32,
        })
    }

    /// Only the entries for which this CEL expression is true count (as
    /// [`DumpOptions::with_filter`](crate::DumpOptions::with_filter)).
    pub fn with_filter(mut self, filter: impl Into<String>) -> Self {
        self.filter = filter.into();
        self
    }

    /// The member paths whose values make a group ("key.daddr"); none
    /// (the default): one group for the whole map.
    pub fn with_group_by(mut self, paths: impl IntoIterator<Item = impl Into<String>>) -> Self {
        self.group_by = paths.into_iter().map(Into::into).collect();
        self
    }

    /// Adds an aggregate (at least one, at most [`MAX_AGGREGATES`]).
    pub fn with_aggregate(mut self, aggregate: Aggregate) -> Self {
        self.aggregates.push(aggregate);
        self
    }

    /// Adds aggregates.
    pub fn with_aggregates(mut self, aggregates: impl IntoIterator<Item = Aggregate>) -> Self {
        self.aggregates.extend(aggregates);
        self
    }

    /// Which aggregate orders the groups (an index, default 0: the first).
    pub fn with_order_by(mut self, index: usize) -> Self {
        self.order_by = index;
        self
    }

    /// Smallest first (default: largest first).
    pub fn with_ascending(mut self, ascending: bool) -> Self {
        self.ascending = ascending;
        self
    }

    /// The top this many groups (default 0: every group, up to the daemon's
    /// `limits.max_groups`).
    pub fn with_limit(mut self, groups: u32) -> Self {
        self.limit = groups;
        self
    }

    /// Only groups whose ordering aggregate is at least this (at most, in
    /// ascending order).
    pub fn with_threshold(mut self, threshold: i128) -> Self {
        self.threshold = Some(threshold);
        self
    }

    /// Exactly these groups ([`Group::key_bytes`] of an earlier answer;
    /// duplicates dropped), whatever the limit and threshold; a group
    /// without matching entries comes back with COUNT 0, SUM 0 and no MIN
    /// or MAX.
    pub fn with_groups(mut self, groups: impl IntoIterator<Item = Vec<u8>>) -> Self {
        let mut seen = std::collections::HashSet::new();
        self.groups = groups
            .into_iter()
            .filter(|g| seen.insert(g.clone()))
            .collect();
        self
    }

    /// For per-CPU maps: each CPU's value is a value of its own
    /// ([`PerCpu::Each`], the default) or each entry's sum over the CPUs
    /// counts ([`PerCpu::Sum`]).
    pub fn with_per_cpu(mut self, per_cpu: PerCpu) -> Self {
        self.per_cpu = per_cpu;
        self
    }

    /// Read the map with batched lookups, which lock each hash bucket as
    /// they copy it, rather than let the daemon walk it inside the kernel
    /// (the default where it can), whose walk takes no lock: an entry
    /// deleted and inserted again meanwhile can then be missed or counted
    /// twice.
    pub fn with_batched_scan(mut self) -> Self {
        self.batched = true;
        self
    }

    /// Show the group keys' members another way ((member path, rendering)
    /// pairs, as [`LookupOptions::with_render`](crate::LookupOptions::with_render)).
    pub fn with_render<K: AsRef<str>, V: fmt::Display>(
        mut self,
        render: impl IntoIterator<Item = (K, V)>,
    ) -> Self {
        self.render.extend(typed::render_map(render));
        self
    }

    pub(crate) fn render(&self) -> &BTreeMap<String, String> {
        &self.render
    }

    /// The aggregates asked for.
    pub fn aggregates(&self) -> &[Aggregate] {
        &self.aggregates
    }

    pub(crate) fn order_by(&self) -> usize {
        self.order_by
    }

    pub(crate) fn ascending(&self) -> bool {
        self.ascending
    }

    pub(crate) fn limit(&self) -> u32 {
        self.limit
    }

    pub(crate) fn threshold(&self) -> Option<i128> {
        self.threshold
    }

    pub(crate) fn groups(&self) -> &[Vec<u8>] {
        &self.groups
    }

    /// The options with the limit, threshold and groups a fleet phase asks.
    pub(crate) fn phase(&self, limit: u32, threshold: Option<i128>, groups: Vec<Vec<u8>>) -> Self {
        Self {
            limit,
            threshold,
            groups,
            ..self.clone()
        }
    }

    /// The options a fleet asks of its hosts: with a COUNT, its way of
    /// knowing which hosts hold a group. The caller's own COUNT serves;
    /// else one is added last, unless the fleet is one host (a group it
    /// reports is one it holds) or the caller's aggregates are already as
    /// many as a call takes (then the hosts that report a group hold it).
    pub(crate) fn with_hidden_count(&self, hosts: usize) -> Self {
        let counts = self.aggregates.iter().any(|a| a.op() == AggregateOp::Count);
        if counts || hosts <= 1 || self.aggregates.len() >= MAX_AGGREGATES {
            return self.clone();
        }
        self.clone().with_aggregate(Aggregate::count())
    }

    pub(crate) fn request(&self, map: &MapName) -> pb::AggregateMapRequest {
        pb::AggregateMapRequest {
            map: Some(map.to_proto()),
            filter: self.filter.clone(),
            group_by: self.group_by.clone(),
            aggregates: self.aggregates.iter().map(Aggregate::to_proto).collect(),
            order_by: self.order_by as u32,
            ascending: self.ascending,
            limit: self.limit,
            per_cpu: match self.per_cpu {
                PerCpu::Sum => pb::PerCpu::Sum,
                _ => pb::PerCpu::Each,
            } as i32,
            threshold: self.threshold.map(|t| t.to_string()).unwrap_or_default(),
            groups: self.groups.clone(),
            render: self.render.clone().into_iter().collect(),
            scan: if self.batched {
                pb::ScanMethod::ScanBatched
            } else {
                pb::ScanMethod::ScanAuto
            } as i32,
        }
    }
}

/// One group of an aggregate's answer.
#[derive(Debug, Clone, PartialEq)]
pub struct Group {
    key: BTreeMap<String, prost_types::Value>,
    values: Vec<Option<i128>>,
    /// Per aggregate over an array, its elements' values (empty for the
    /// others).
    elements: Vec<Vec<Option<i128>>>,
    key_bytes: Vec<u8>,
}

/// What the groups of an answer are made of: per aggregate, the number of
/// elements of an aggregate over an array (0 for the others).
pub(crate) type Shape = Vec<usize>;

impl Group {
    /// A group from its message, its aggregates `ops` (in order): an
    /// aggregate over an array is a list of its elements' values, whose
    /// value is its elements folded as `ops` says (a SUM's total); a value
    /// that is not an integer (or such a list) is a protocol error.
    pub(crate) fn from_proto(g: pb::Group, ops: &[AggregateOp]) -> Result<Self, Error> {
        let mut values = Vec::with_capacity(g.values.len());
        let mut elements = Vec::with_capacity(g.values.len());
        for (i, v) in g.values.iter().enumerate() {
            match &v.kind {
                Some(prost_types::value::Kind::ListValue(l)) => {
                    let each = l
                        .values
                        .iter()
                        .map(integer)
                        .collect::<Result<Vec<_>, _>>()?;
                    let op = ops.get(i).copied().unwrap_or(AggregateOp::Sum).to_proto();
                    values.push(
                        each.iter()
                            .fold(None, |a, b| bpfmap_proto::aggregate::combine(op, a, *b)),
                    );
                    elements.push(each);
                }
                _ => {
                    values.push(integer(v)?);
                    elements.push(Vec::new());
                }
            }
        }
        Ok(Self {
            key: g
                .key
                .map(|k| k.fields.into_iter().collect())
                .unwrap_or_default(),
            values,
            elements,
            key_bytes: g.key_bytes,
        })
    }

    pub(crate) fn new(
        key: BTreeMap<String, prost_types::Value>,
        values: Vec<Option<i128>>,
        elements: Vec<Vec<Option<i128>>>,
        key_bytes: Vec<u8>,
    ) -> Self {
        Self {
            key,
            values,
            elements,
            key_bytes,
        }
    }

    /// The values of an aggregate over an array (`sum(value.slots)`), one
    /// per element, exact; empty for an aggregate of one integer (its
    /// value is in [`values`](Self::values): for an array, its elements
    /// folded as the aggregate folds them, a SUM's total).
    pub fn elements(&self, aggregate: usize) -> &[Option<i128>] {
        self.elements.get(aggregate).map_or(&[], Vec::as_slice)
    }

    /// Per aggregate, its elements (0 for an aggregate of one integer).
    pub(crate) fn shape(&self) -> Shape {
        self.elements.iter().map(Vec::len).collect()
    }

    /// The group's key: each group-by path ("key.daddr") to its decoded
    /// value.
    pub fn key(&self) -> &BTreeMap<String, prost_types::Value> {
        &self.key
    }

    /// One value per aggregate, in request order, exact; `None` for the
    /// MIN and MAX of a group without entries.
    pub fn values(&self) -> &[Option<i128>] {
        &self.values
    }

    /// The group's identity: the bytes of its members, the same on every
    /// host ([`AggregateOptions::with_groups`] takes them).
    pub fn key_bytes(&self) -> &[u8] {
        &self.key_bytes
    }

    /// Its key, its values and then every element's value (flat, for
    /// merging by position), its key bytes.
    pub(crate) fn into_parts(
        self,
    ) -> (
        BTreeMap<String, prost_types::Value>,
        Vec<Option<i128>>,
        Vec<u8>,
    ) {
        let mut flat = self.values;
        flat.extend(self.elements.into_iter().flatten());
        (self.key, flat, self.key_bytes)
    }
}

/// An aggregate's value: a decimal string, an integral number, or null.
fn integer(v: &prost_types::Value) -> Result<Option<i128>, Error> {
    bpfmap_proto::aggregate::parse(v).map_err(|e| Error::Protocol(e.to_string()))
}

/// What the daemon says about an aggregate's walk.
#[derive(Debug, Clone, PartialEq)]
pub struct AggregateSummary(pb::AggregateSummary);

impl AggregateSummary {
    pub(crate) fn from_proto(s: pb::AggregateSummary) -> Self {
        Self(s)
    }

    /// Entries the walk read.
    pub fn entries_scanned(&self) -> u64 {
        self.0.entries_scanned
    }

    /// Entries that matched the filter (all of them without one).
    pub fn entries_matched(&self) -> u64 {
        self.0.entries_matched
    }

    /// Groups before the threshold and the limit.
    pub fn groups_total(&self) -> u64 {
        self.0.groups_total
    }

    /// The time the daemon took.
    pub fn elapsed(&self) -> Option<Duration> {
        self.0.elapsed.and_then(|d| Duration::try_from(d).ok())
    }

    /// Whether the daemon walked the map inside the kernel.
    pub fn scanned_in_kernel(&self) -> bool {
        self.0.scanned_in_kernel
    }

    /// Why the daemon read the map in batches when it could have walked it
    /// inside the kernel (empty when it did, or when batches were asked).
    pub fn scan_note(&self) -> &str {
        &self.0.scan_note
    }

    /// Whether the ordering aggregate can never be negative (a COUNT, or
    /// the SUM of an unsigned member): what a fleet's exact threshold top K
    /// needs.
    pub fn order_non_negative(&self) -> bool {
        self.0.order_non_negative
    }

    /// The message it came in.
    pub fn as_proto(&self) -> &pb::AggregateSummary {
        &self.0
    }
}

/// The answer of one daemon's aggregate.
#[derive(Debug, Clone, PartialEq)]
pub struct AggregateResult {
    groups: Vec<Group>,
    summary: AggregateSummary,
    proto: pb::AggregateMapResponse,
}

impl AggregateResult {
    /// The answer to a request of aggregates `ops`.
    pub(crate) fn from_proto(
        resp: pb::AggregateMapResponse,
        ops: &[AggregateOp],
    ) -> Result<Self, Error> {
        let groups = resp
            .groups
            .iter()
            .cloned()
            .map(|g| Group::from_proto(g, ops))
            .collect::<Result<_, _>>()?;
        Ok(Self {
            groups,
            summary: AggregateSummary(resp.summary.clone().unwrap_or_default()),
            proto: resp,
        })
    }

    /// An answer without groups.
    pub(crate) fn empty() -> Self {
        Self {
            groups: Vec::new(),
            summary: AggregateSummary(pb::AggregateSummary::default()),
            proto: pb::AggregateMapResponse::default(),
        }
    }

    /// The groups, ordered by the ordering aggregate, then by key bytes.
    pub fn groups(&self) -> &[Group] {
        &self.groups
    }

    /// The daemon's summary.
    pub fn summary(&self) -> &AggregateSummary {
        &self.summary
    }

    /// The message it came in.
    pub fn as_proto(&self) -> &pb::AggregateMapResponse {
        &self.proto
    }

    pub(crate) fn into_groups(self) -> Vec<Group> {
        self.groups
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn aggregates_parse_and_print_back() {
        for s in [
            "count()",
            "sum(value.bytes)",
            "min(value.packets)",
            "max(key.dport)",
        ] {
            assert_eq!(s.parse::<Aggregate>().unwrap().to_string(), s);
        }
        assert_eq!("COUNT".parse::<Aggregate>().unwrap(), Aggregate::count());
        assert_eq!(
            " Sum( value.bytes ) ".parse::<Aggregate>().unwrap(),
            Aggregate::sum("value.bytes")
        );
        for (bad, says) in [
            ("avg(value.bytes)", "use count(), sum(FIELD)"),
            (
                "sum()",
                "sum() needs an integer member, as in sum(value.bytes)",
            ),
            ("count(value.bytes)", "takes no field"),
            ("sum(value.bytes", "closing parenthesis"),
            ("sum(value.bytes, value.packets)", "one member path"),
        ] {
            let e = bad.parse::<Aggregate>().unwrap_err();
            assert!(e.to_string().contains(says), "{bad}: {e}");
            assert_eq!(e.code(), tonic::Code::InvalidArgument);
        }
    }

    #[test]
    fn values_are_exact_integers_or_null() {
        let g = pb::Group {
            key: None,
            values: vec![
                "170141183460469231731687303715884105727".into(),
                prost_types::Value {
                    kind: Some(prost_types::value::Kind::NumberValue(443.0)),
                },
                prost_types::Value {
                    kind: Some(prost_types::value::Kind::NullValue(0)),
                },
            ],
            key_bytes: vec![1],
        };
        let g = Group::from_proto(g, &[]).unwrap();
        assert_eq!(g.values(), [Some(i128::MAX), Some(443), None]);
        let bad = pb::Group {
            values: vec!["1.5".into()],
            ..Default::default()
        };
        assert!(matches!(
            Group::from_proto(bad, &[]),
            Err(Error::Protocol(_))
        ));
    }
}
