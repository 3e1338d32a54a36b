//! Aggregates: entries grouped by some members, with COUNT, SUM, MIN and
//! MAX per group, computed as the walk reads the chunks, in a table bounded
//! by `limits.max_groups`. Sums are exact (128 bits: a map of u64 counters
//! would need 2^64 entries to overflow one).

use std::collections::HashMap;

use bpfmap_kernel::program::{AggOp, GroupPart, Side};
use bpfmap_proto::{
    aggregate::{self as values, Op},
    typed::{EntryRef, IntMember, MapLayout, Projection, Root, Source},
    v1 as pb,
};

use super::scan::{Sizes, Untranslatable, int_read};

/// Most aggregates one request may ask for.
pub const MAX_AGGREGATES: usize = 16;

/// One aggregate, resolved.
#[derive(Debug, Clone)]
struct Agg {
    op: Op,
    /// The member (none for COUNT); for PER_CPU_EACH, one load per CPU.
    loads: Vec<IntMember>,
    /// Whether MIN and MAX are written as numbers (members of up to 32 bits).
    small: bool,
}

/// What a request asks to compute, checked against the map's types.
#[derive(Debug)]
pub struct Spec {
    /// The group-by members, whose records (with the call's renderings)
    /// decode a group's key: the key part, then the value part.
    group: Option<Projection>,
    aggs: Vec<Agg>,
    order_by: usize,
    ascending: bool,
    limit: usize,
    threshold: Option<i128>,
    only: Option<Vec<Vec<u8>>>,
    max_groups: usize,
}

/// The running totals of one group.
#[derive(Debug, Clone, PartialEq)]
pub struct Acc {
    count: u64,
    /// Per aggregate: the sum, or the smallest / largest value (None
    /// before the first).
    values: Vec<Option<i128>>,
    /// Per aggregate, for a watch: a SUM's increase counted per entry
    /// since the previous scan.
    increases: Vec<i128>,
}

/// A group table being filled.
#[derive(Debug)]
pub struct Table<'a> {
    spec: &'a Spec,
    groups: HashMap<Vec<u8>, Acc>,
    key_buf: Vec<u8>,
    value_buf: Vec<u8>,
    /// Groups seen when the table overflowed.
    overflowed: Option<usize>,
}

/// Why a request's aggregates cannot be computed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AggregateError {
    /// INVALID_ARGUMENT: the message says which part.
    #[error("{0}")]
    Invalid(String),
    /// RESOURCE_EXHAUSTED: more groups than the limit.
    #[error(
        "more than {limit} groups (limits.max_groups): {seen} seen before the walk stopped; group by fewer or coarser members, or filter"
    )]
    TooManyGroups { limit: usize, seen: usize },
}

impl Agg {
    /// Aggregate `i` of a request, checked against `layout` (`each`: each
    /// CPU's value of a per-CPU map counts as a value of its own).
    fn of(
        i: usize,
        a: &pb::Aggregate,
        layout: &MapLayout,
        each: bool,
    ) -> Result<Self, AggregateError> {
        let bad = AggregateError::Invalid;
        let op = Op::try_from(a.op).unwrap_or(Op::Unspecified);
        if op == Op::Unspecified {
            return Err(bad(format!(
                "aggregates[{i}]: op is COUNT, SUM, MIN or MAX"
            )));
        }
        if op == Op::Count {
            if !a.field.is_empty() {
                return Err(bad(format!(
                    "aggregates[{i}]: COUNT counts entries and takes no field"
                )));
            }
            return Ok(Agg {
                op,
                loads: Vec::new(),
                small: false,
            });
        }
        if a.field.is_empty() {
            return Err(bad(format!(
                "aggregates[{i}]: {} needs a field (\"value.bytes\")",
                op.as_str_name()
            )));
        }
        let m = layout
            .member(&a.field)
            .map_err(|e| bad(format!("aggregates[{i}]: {e}")))?;
        let load = m.int().map_err(|e| {
            bad(format!(
                "aggregates[{i}]: {e}: {} takes an integer member",
                op.as_str_name()
            ))
        })?;
        let loads = match (m.root(), layout.cpus()) {
            (Root::Value, Some(cpus)) if each => (0..cpus).map(|c| load.on_cpu(c)).collect(),
            _ => vec![load],
        };
        Ok(Agg {
            op,
            loads,
            small: load.field().bits() <= 32,
        })
    }
}

impl Spec {
    /// Checks `req` against `layout` (the map's, with the call's
    /// renderings: group keys show members as they say). `max_groups`
    /// bounds the table.
    pub fn new(
        req: &pb::AggregateMapRequest,
        layout: &MapLayout,
        max_groups: usize,
    ) -> Result<Self, AggregateError> {
        Self::within(req, layout, max_groups, MAX_AGGREGATES)
    }

    /// As [`new`](Self::new), with at most `max_aggregates` aggregates (a
    /// histogram sums one per bucket).
    pub fn within(
        req: &pb::AggregateMapRequest,
        layout: &MapLayout,
        max_groups: usize,
        max_aggregates: usize,
    ) -> Result<Self, AggregateError> {
        let bad = AggregateError::Invalid;
        if req.aggregates.is_empty() {
            return Err(bad(
                "no aggregates: give at least one, e.g. {\"op\":\"COUNT\"} or {\"op\":\"SUM\",\"field\":\"value.bytes\"}".into(),
            ));
        }
        if req.aggregates.len() > max_aggregates {
            return Err(bad(format!(
                "{} aggregates: at most {max_aggregates}",
                req.aggregates.len()
            )));
        }
        if req.order_by as usize >= req.aggregates.len() {
            return Err(bad(format!(
                "order_by {} names no aggregate (there are {}; indexes start at 0)",
                req.order_by,
                req.aggregates.len()
            )));
        }
        let each = req.per_cpu == pb::PerCpu::Each as i32;
        let aggs = req
            .aggregates
            .iter()
            .enumerate()
            .map(|(i, a)| Agg::of(i, a, layout, each))
            .collect::<Result<Vec<_>, _>>()?;
        let group = if req.group_by.is_empty() {
            None
        } else {
            Some(
                Projection::new(&req.group_by, layout)
                    .map_err(|e| bad(format!("group_by: {e}")))?,
            )
        };
        let only = given_groups(&req.groups, group.as_ref())?;
        let threshold = match req.threshold.as_str() {
            "" => None,
            t => Some(
                t.parse::<i128>()
                    .map_err(|_| bad(format!("threshold {t:?} is not a decimal integer")))?,
            ),
        };
        Ok(Self {
            group,
            aggs,
            order_by: req.order_by as usize,
            ascending: req.ascending,
            limit: if req.limit == 0 {
                usize::MAX
            } else {
                req.limit as usize
            },
            threshold,
            only,
            max_groups,
        })
    }

    /// An empty table.
    pub fn table(&self) -> Table<'_> {
        Table {
            spec: self,
            groups: HashMap::new(),
            key_buf: Vec::new(),
            value_buf: Vec::new(),
            overflowed: None,
        }
    }

    /// Number of aggregates asked for.
    pub fn aggregates(&self) -> usize {
        self.aggs.len()
    }

    /// The group key's parts, its length and the aggregates of a walk
    /// inside the kernel, or why they are computed in user space.
    pub(crate) fn kernel_parts(
        &self,
        sizes: Sizes,
    ) -> Result<(Vec<GroupPart>, u16, Vec<AggOp>), Untranslatable> {
        let mut parts = Vec::new();
        let mut key_len = 0;
        if let Some(g) = &self.group {
            key_len = g.key_size() + g.value_size();
            for (source, out, size) in g.places() {
                let out = u16::try_from(out).map_err(|_| Untranslatable::GroupKeyTooLong)?;
                parts.push(group_part(source, out, size, sizes)?);
            }
        }
        let key_len = u16::try_from(key_len).map_err(|_| Untranslatable::GroupKeyTooLong)?;
        let aggs = self
            .aggs
            .iter()
            .map(|a| a.kernel_op(sizes))
            .collect::<Result<Vec<_>, _>>()?;
        Ok((parts, key_len, aggs))
    }

    /// Whether the ordering aggregate's values are never negative (COUNT,
    /// or a SUM of an unsigned member): what an exact threshold top K
    /// across hosts needs.
    pub fn non_negative_order(&self) -> bool {
        let a = &self.aggs[self.order_by];
        a.op == Op::Count || (a.op == Op::Sum && a.loads.iter().all(|l| !l.signed()))
    }
}

/// A member of a group key as a walk inside the kernel writes it (`size`
/// bytes at `out`): bytes of the key or of a value that is not per-CPU, an
/// integer of up to 64 bits, a per-CPU map's member summed in 128.
fn group_part(
    source: Source,
    out: u16,
    size: usize,
    sizes: Sizes,
) -> Result<GroupPart, Untranslatable> {
    Ok(match source {
        Source::Bytes { root, offset, len } => GroupPart::Bytes {
            side: match root {
                Root::Key => Side::Key,
                Root::Value if sizes.cpus.is_none() => Side::Value,
                Root::Value | Root::Cpu(_) => return Err(Untranslatable::GroupCpuValue),
            },
            offset: u16::try_from(offset).map_err(|_| Untranslatable::MemberTooFar)?,
            len: u16::try_from(len).map_err(|_| Untranslatable::MemberTooLong)?,
            out,
        },
        Source::Int(m) => {
            let read = int_read(&m, sizes)?;
            let summed = m.root() == Root::Value && sizes.cpus.is_some();
            if !(matches!(size, 1 | 2 | 4 | 8) || (summed && size == 16)) {
                return Err(Untranslatable::WideGroupMember);
            }
            GroupPart::Int {
                read,
                out,
                size: size as u8,
            }
        }
    })
}

impl Agg {
    /// The aggregate as a walk inside the kernel computes it: of a
    /// per-CPU map's `value` member, SUM over every CPU's value, MIN and
    /// MAX of the sums (PER_CPU_SUM) or of each CPU's value (PER_CPU_EACH).
    fn kernel_op(&self, sizes: Sizes) -> Result<AggOp, Untranslatable> {
        let read = match self.loads.as_slice() {
            [] => return Ok(AggOp::Count),
            [load] => int_read(load, sizes)?,
            loads => {
                let every_cpu = loads
                    .iter()
                    .enumerate()
                    .all(|(i, l)| l.root() == Root::Cpu(i))
                    && sizes.cpus.is_some_and(|n| usize::from(n) == loads.len());
                if !every_cpu {
                    return Err(Untranslatable::SomeCpus);
                }
                // One CPU's value of the member, as a program reads it.
                let one = IntMember::new(Root::Value, loads[0].field());
                let one = int_read(
                    &one,
                    Sizes {
                        cpus: None,
                        ..sizes
                    },
                )?;
                return Ok(match self.op {
                    Op::Min => AggOp::MinOfEach(one),
                    Op::Max => AggOp::MaxOfEach(one),
                    _ => AggOp::Sum(one.summed_over(loads.len() as u16)),
                });
            }
        };
        Ok(match self.op {
            Op::Sum => AggOp::Sum(read),
            Op::Min => AggOp::Min(read),
            Op::Max => AggOp::Max(read),
            _ => AggOp::Count,
        })
    }
}

/// The groups a request names (`groups`), each once, in order: INVALID_ARGUMENT
/// for one whose length is not a group key's (the group-by members' bytes,
/// back to back; none without group_by).
fn given_groups(
    groups: &[Vec<u8>],
    group: Option<&Projection>,
) -> Result<Option<Vec<Vec<u8>>>, AggregateError> {
    if groups.is_empty() {
        return Ok(None);
    }
    let len = group.map_or(0, |g| g.key_size() + g.value_size());
    let mut seen = std::collections::HashSet::new();
    let mut out = Vec::new();
    for (i, g) in groups.iter().enumerate() {
        if g.len() != len {
            return Err(AggregateError::Invalid(format!(
                "groups[{i}] is {} bytes: a group's key_bytes are {len} bytes here (the group_by members' bytes, back to back, as answers give them)",
                g.len()
            )));
        }
        if seen.insert(g.as_slice()) {
            out.push(g.clone());
        }
    }
    Ok(Some(out))
}

impl Acc {
    fn new(n: usize) -> Self {
        Self {
            count: 0,
            values: vec![None; n],
            increases: Vec::new(),
        }
    }
}

impl Table<'_> {
    /// Adds one (matching) entry. `false` once the table is full.
    #[inline]
    pub fn add(&mut self, e: &EntryRef<'_>) -> bool {
        let spec = self.spec;
        self.key_buf.clear();
        self.value_buf.clear();
        if let Some(g) = &spec.group {
            g.write(e, &mut self.key_buf, &mut self.value_buf);
            self.key_buf.extend_from_slice(&self.value_buf);
        }
        let acc = match self.groups.get_mut(self.key_buf.as_slice()) {
            Some(acc) => acc,
            None => {
                if self.groups.len() >= spec.max_groups {
                    self.overflowed = Some(self.groups.len() + 1);
                    return false;
                }
                self.groups
                    .entry(self.key_buf.clone())
                    .or_insert_with(|| Acc::new(spec.aggs.len()))
            }
        };
        acc.count += 1;
        for (a, v) in spec.aggs.iter().zip(acc.values.iter_mut()) {
            for l in &a.loads {
                *v = values::combine(a.op, *v, l.read(e));
            }
        }
        true
    }

    /// Adds a group computed elsewhere (a walk inside the kernel): its key,
    /// its count, each aggregate's value. `false` once the table is full.
    pub fn add_group(&mut self, key: Vec<u8>, count: u64, values: Vec<Option<i128>>) -> bool {
        if !self.groups.contains_key(&key) && self.groups.len() >= self.spec.max_groups {
            self.overflowed = Some(self.groups.len() + 1);
            return false;
        }
        let acc = Acc {
            count,
            values,
            increases: Vec::new(),
        };
        self.groups.insert(key, acc);
        true
    }

    /// Marks the table as overflowed with `seen` groups.
    pub fn overflow(&mut self, seen: usize) {
        self.overflowed = Some(seen);
    }

    /// For a watch: adds the increase of each SUM between `prev` (none
    /// for an entry that appeared) and `now`, counted as a counter: a value
    /// that went down was reset, and increased by its new value.
    pub fn add_increase(&mut self, now: &EntryRef<'_>, prev: Option<&EntryRef<'_>>) -> bool {
        let spec = self.spec;
        if !self.add_uncounted(now) {
            return false;
        }
        let Some(acc) = self.groups.get_mut(self.key_buf.as_slice()) else {
            return true;
        };
        if acc.increases.is_empty() {
            acc.increases = vec![0; spec.aggs.len()];
        }
        for (a, inc) in spec.aggs.iter().zip(acc.increases.iter_mut()) {
            if a.op != Op::Sum {
                continue;
            }
            for l in &a.loads {
                let Some(x) = l.read(now) else { continue };
                let before = prev.and_then(|p| l.read(p));
                let d = match before {
                    Some(b) if x >= b => x - b,
                    _ => x,
                };
                *inc = inc.saturating_add(d);
            }
        }
        true
    }

    /// Makes sure the group of `e` exists without counting `e` in it.
    fn add_uncounted(&mut self, e: &EntryRef<'_>) -> bool {
        let spec = self.spec;
        self.key_buf.clear();
        self.value_buf.clear();
        if let Some(g) = &spec.group {
            g.write(e, &mut self.key_buf, &mut self.value_buf);
            self.key_buf.extend_from_slice(&self.value_buf);
        }
        if !self.groups.contains_key(self.key_buf.as_slice()) {
            if self.groups.len() >= spec.max_groups {
                self.overflowed = Some(self.groups.len() + 1);
                return false;
            }
            self.groups
                .insert(self.key_buf.clone(), Acc::new(spec.aggs.len()));
        }
        true
    }

    /// For a watch: every group's totals, unordered.
    pub fn totals(self) -> Result<HashMap<Vec<u8>, Acc>, AggregateError> {
        if let Some(seen) = self.overflowed {
            return Err(AggregateError::TooManyGroups {
                limit: self.spec.max_groups,
                seen,
            });
        }
        Ok(self.groups)
    }

    /// The answer: groups ordered, cut at the threshold and the limit (or
    /// exactly the groups asked for), and how many there were.
    pub fn finish(self) -> Result<(Vec<pb::Group>, u64), AggregateError> {
        let spec = self.spec;
        if let Some(seen) = self.overflowed {
            return Err(AggregateError::TooManyGroups {
                limit: spec.max_groups,
                seen,
            });
        }
        let total = self.groups.len() as u64;
        let mut groups: Vec<(Vec<u8>, Acc)> = match &spec.only {
            Some(only) => {
                let mut table = self.groups;
                only.iter()
                    .map(|k| {
                        let acc = table.remove(k).unwrap_or_else(|| Acc::new(spec.aggs.len()));
                        (k.clone(), acc)
                    })
                    .collect()
            }
            None => self.groups.into_iter().collect(),
        };
        let order = |acc: &Acc| spec.order_value(acc);
        groups.sort_by(|(ka, a), (kb, b)| {
            let (x, y) = (order(a), order(b));
            let by = match (x, y) {
                (Some(x), Some(y)) if spec.ascending => x.cmp(&y),
                (Some(x), Some(y)) => y.cmp(&x),
                (Some(_), None) => std::cmp::Ordering::Less,
                (None, Some(_)) => std::cmp::Ordering::Greater,
                (None, None) => std::cmp::Ordering::Equal,
            };
            by.then_with(|| ka.cmp(kb))
        });
        if spec.only.is_none() {
            if let Some(t) = spec.threshold {
                groups.retain(|(_, a)| {
                    order(a).is_some_and(|v| if spec.ascending { v <= t } else { v >= t })
                });
            }
            groups.truncate(spec.limit);
        }
        Ok((
            groups
                .into_iter()
                .map(|(k, a)| spec.group_message(k, &a))
                .collect(),
            total,
        ))
    }
}

impl Spec {
    /// For a watch: the group message of `key` with totals `acc`.
    pub fn message(&self, key: Vec<u8>, acc: &Acc) -> pb::Group {
        self.group_message(key, acc)
    }

    /// For a watch: per aggregate, its rate between two scans `secs` apart
    /// (COUNT: the change of the count; SUM: the increase counted per
    /// entry; NaN for MIN and MAX).
    pub fn rates(&self, now: &Acc, prev: Option<&Acc>, secs: f64) -> Vec<f64> {
        self.aggs
            .iter()
            .enumerate()
            .map(|(i, a)| match a.op {
                Op::Count => (now.count as f64 - prev.map_or(0.0, |p| p.count as f64)) / secs,
                Op::Sum => now.increases.get(i).copied().unwrap_or(0) as f64 / secs,
                _ => f64::NAN,
            })
            .collect()
    }

    /// For a watch: whether a group's values differ between two scans.
    pub fn same_values(a: &Acc, b: &Acc) -> bool {
        a.count == b.count && a.values == b.values
    }

    fn order_value(&self, acc: &Acc) -> Option<i128> {
        match self.aggs[self.order_by].op {
            Op::Count => Some(i128::from(acc.count)),
            _ => acc.values[self.order_by],
        }
    }

    fn group_message(&self, key_bytes: Vec<u8>, acc: &Acc) -> pb::Group {
        let mut fields = std::collections::BTreeMap::new();
        if let Some(g) = &self.group {
            let (k, v) = key_bytes.split_at(g.key_size().min(key_bytes.len()));
            let records = g.layout();
            for (layout, bytes, side) in [(records.key(), k, false), (records.value(), v, true)] {
                if let Some(prost_types::value::Kind::StructValue(s)) = layout.to_value(bytes).kind
                {
                    for (name, value) in s.fields {
                        // The path as the request gave it (a member named
                        // `key` is `key.key`, the whole key `key`).
                        let path = g
                            .member_path(side, &name)
                            .map_or_else(|| name.clone(), str::to_owned);
                        fields.insert(path, value);
                    }
                }
            }
        }
        let values = self
            .aggs
            .iter()
            .zip(&acc.values)
            .map(|(a, v)| match a.op {
                Op::Count => values::to_wire(a.op, Some(i128::from(acc.count)), false),
                _ => values::to_wire(a.op, *v, a.small),
            })
            .collect();
        pb::Group {
            key: Some(prost_types::Struct { fields }),
            values,
            key_bytes,
        }
    }
}

#[cfg(test)]
#[path = "aggregate_tests.rs"]
mod tests;
