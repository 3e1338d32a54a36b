//! The exact merge of many hosts' groups: what each host said about each
//! group, what bounds the groups it did not report, and when that proves a
//! top K. No I/O here: the fleet's aggregate run asks the hosts.
//!
//! Values are exact integers (i128, saturating far beyond any map's
//! counters); the ordering aggregate is assumed non-negative where bounds
//! are used (the daemons say so: `order_non_negative`).

use std::{cmp::Ordering, collections::BTreeMap};

use bpfmap_proto::aggregate::{self as values, Op};

use crate::{AggregateOp, AggregateOptions, AggregateResult, Target};

/// Merged groups, ordered: their key bytes and values.
pub(crate) type Ranked = Vec<(Vec<u8>, Vec<Option<i128>>)>;

/// One group as the hosts reported it.
#[derive(Debug, Clone)]
pub(crate) struct Seen {
    /// The decoded key (from the first host that reported it).
    pub(crate) key: BTreeMap<String, prost_types::Value>,
    /// Each reporting host's values (every aggregate, the hidden COUNT
    /// last), exact.
    pub(crate) from: BTreeMap<Target, Vec<Option<i128>>>,
}

/// What a host's answer says about the groups it did not report.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Bound {
    /// It reported every group it has: an unreported group has no entries
    /// there.
    Complete,
    /// An unreported group's ordering value there is at most this.
    AtMost(i128),
}

impl Bound {
    /// The tighter of two.
    fn and(self, other: Self) -> Self {
        match (self, other) {
            (Self::Complete, _) | (_, Self::Complete) => Self::Complete,
            (Self::AtMost(a), Self::AtMost(b)) => Self::AtMost(a.min(b)),
        }
    }

    /// What an unreported group may add to a sum.
    fn most(self) -> i128 {
        match self {
            Self::Complete => 0,
            Self::AtMost(b) => b.max(0),
        }
    }
}

/// Every host's answers so far.
#[derive(Debug, Clone)]
pub(crate) struct Merge {
    /// Each aggregate's operation, the hidden COUNT last; then, once an
    /// answer says how many, one per element of each aggregate over an
    /// array (groups' values are merged flat, by position).
    ops: Vec<AggregateOp>,
    /// The aggregates (the hidden COUNT included), before the elements.
    base: usize,
    /// Per aggregate, its elements (0 for one integer), from the first
    /// answer.
    shape: Option<crate::aggregate::Shape>,
    order_by: usize,
    ascending: bool,
    pub(crate) groups: BTreeMap<Vec<u8>, Seen>,
    /// The hosts still in the run, and what bounds what they did not
    /// report (absent: nothing yet).
    bounds: BTreeMap<Target, Bound>,
}

impl Merge {
    /// For `options` (whose last aggregate is the hidden COUNT).
    pub(crate) fn new(options: &AggregateOptions) -> Self {
        Self {
            ops: options.aggregates().iter().map(|a| a.op()).collect(),
            base: options.aggregates().len(),
            shape: None,
            order_by: options.order_by(),
            ascending: options.ascending(),
            groups: BTreeMap::new(),
            bounds: BTreeMap::new(),
        }
    }

    /// Adds `target`'s answer; `bound` is what it says about the groups it
    /// left out (`None`: nothing new, as for an answer about given groups).
    pub(crate) fn add(&mut self, target: &Target, result: AggregateResult, bound: Option<Bound>) {
        let complete = result.groups().len() as u64 >= result.summary().groups_total();
        let bound = if complete && bound.is_some() {
            Some(Bound::Complete)
        } else {
            bound
        };
        if let Some(b) = bound {
            let old = self.bounds.get(target).copied();
            self.bounds
                .insert(target.clone(), old.map_or(b, |old| old.and(b)));
        } else {
            self.bounds
                .entry(target.clone())
                .or_insert(Bound::AtMost(i128::MAX));
        }
        for g in result.into_groups() {
            if self.shape.is_none() {
                let shape = g.shape();
                for (i, n) in shape.iter().enumerate() {
                    let op = self.ops[i.min(self.base - 1)];
                    self.ops.extend(std::iter::repeat_n(op, *n));
                }
                self.shape = Some(shape);
            }
            let (key, values, key_bytes) = g.into_parts();
            let seen = self.groups.entry(key_bytes).or_insert_with(|| Seen {
                key,
                from: BTreeMap::new(),
            });
            seen.from.insert(target.clone(), values);
        }
    }

    /// The number of values of each group (the aggregates and the hidden
    /// COUNT).
    pub(crate) fn width(&self) -> usize {
        self.base
    }

    /// A group's merged flat values split back: one value per aggregate,
    /// and each aggregate's elements.
    pub(crate) fn split(
        &self,
        mut flat: Vec<Option<i128>>,
    ) -> (Vec<Option<i128>>, Vec<Vec<Option<i128>>>) {
        let rest = flat.split_off(self.base.min(flat.len()));
        let mut rest = rest.into_iter();
        let elements = match &self.shape {
            Some(shape) => shape
                .iter()
                .map(|n| rest.by_ref().take(*n).collect())
                .collect(),
            None => vec![Vec::new(); flat.len()],
        };
        (flat, elements)
    }

    /// Forgets `target` (it failed): its values and its bound.
    pub(crate) fn drop_host(&mut self, target: &Target) {
        self.bounds.remove(target);
        for seen in self.groups.values_mut() {
            seen.from.remove(target);
        }
        self.groups.retain(|_, s| !s.from.is_empty());
    }

    /// The hosts still in the run.
    pub(crate) fn hosts(&self) -> impl Iterator<Item = &Target> {
        self.bounds.keys()
    }

    /// The hosts that did not report every group they have.
    pub(crate) fn incomplete(&self) -> impl Iterator<Item = &Target> {
        self.bounds
            .iter()
            .filter(|(_, b)| **b != Bound::Complete)
            .map(|(t, _)| t)
    }

    /// The ordering value among a host's values.
    fn order(&self, values: &[Option<i128>]) -> Option<i128> {
        values.get(self.order_by).copied().flatten()
    }

    /// The sum of the ordering values known (a lower bound of the total).
    fn lower(&self, seen: &Seen) -> i128 {
        seen.from
            .values()
            .filter_map(|v| self.order(v))
            .fold(0, i128::saturating_add)
    }

    /// The most the total can be: the known values, and each other host's
    /// bound.
    fn upper(&self, seen: &Seen) -> i128 {
        self.bounds
            .iter()
            .filter(|(t, _)| !seen.from.contains_key(*t))
            .map(|(_, b)| b.most())
            .fold(self.lower(seen), i128::saturating_add)
    }

    /// Whether every host's value of the group is known.
    fn exact(&self, seen: &Seen) -> bool {
        self.bounds
            .iter()
            .all(|(t, b)| *b == Bound::Complete || seen.from.contains_key(t))
    }

    /// The K-th largest lower bound (0 when fewer than K groups were seen).
    pub(crate) fn kth_lower(&self, k: usize) -> i128 {
        let mut lows: Vec<i128> = self.groups.values().map(|s| self.lower(s)).collect();
        lows.sort_unstable_by(|a, b| b.cmp(a));
        lows.get(k.saturating_sub(1)).copied().unwrap_or(0)
    }

    /// The groups that may still be in the top K (upper bound at least the
    /// K-th largest lower bound) and are not known exactly: for each host,
    /// those of them it did not report.
    pub(crate) fn to_ask(&self, k: usize) -> BTreeMap<Target, Vec<Vec<u8>>> {
        let tau = self.kth_lower(k);
        let mut asks: BTreeMap<Target, Vec<Vec<u8>>> = BTreeMap::new();
        for (key, seen) in &self.groups {
            if self.exact(seen) || self.upper(seen) < tau {
                continue;
            }
            for t in self.incomplete() {
                if !seen.from.contains_key(t) {
                    asks.entry(t.clone()).or_default().push(key.clone());
                }
            }
        }
        asks
    }

    /// Every host's values of a group merged: COUNT and SUM added, the MIN
    /// of the minimums, the MAX of the maximums.
    fn merged(&self, seen: &Seen) -> Vec<Option<i128>> {
        let ops: Vec<Op> = self.ops.iter().map(|o| o.to_proto()).collect();
        let mut out: Vec<Option<i128>> = ops
            .iter()
            .map(|op| matches!(op, Op::Count | Op::Sum).then_some(0))
            .collect();
        for v in seen.from.values() {
            values::merge(&ops, &mut out, v);
        }
        out
    }

    /// Orders (value, key bytes) pairs as the daemons do: by the value
    /// (largest first unless ascending; no value last), then by key bytes.
    fn cmp(&self, a: (Option<i128>, &[u8]), b: (Option<i128>, &[u8])) -> Ordering {
        let by = match (a.0, b.0) {
            (Some(x), Some(y)) if self.ascending => x.cmp(&y),
            (Some(x), Some(y)) => y.cmp(&x),
            (Some(_), None) => Ordering::Less,
            (None, Some(_)) => Ordering::Greater,
            (None, None) => Ordering::Equal,
        };
        by.then_with(|| a.1.cmp(b.1))
    }

    /// Every group known exactly, merged and ordered.
    pub(crate) fn ranked(&self) -> Ranked {
        let mut out: Ranked = self
            .groups
            .iter()
            .filter(|(_, s)| self.exact(s))
            .map(|(k, s)| (k.clone(), self.merged(s)))
            .collect();
        out.sort_by(|a, b| {
            let (x, y) = (a.1.get(self.order_by), b.1.get(self.order_by));
            self.cmp((x.copied().flatten(), &a.0), (y.copied().flatten(), &b.0))
        });
        out
    }

    /// The exact top `k` (largest first), if what is known proves it: every
    /// group that is not known exactly, seen or not, is below the K-th.
    pub(crate) fn proven_top(&self, k: usize) -> Option<Ranked> {
        let mut top = self.ranked();
        top.truncate(k);
        let unseen_possible = self.bounds.values().any(|b| *b != Bound::Complete);
        let unseen = self
            .bounds
            .values()
            .map(|b| b.most())
            .fold(0, i128::saturating_add);
        let mut open = self.groups.iter().filter(|(_, s)| !self.exact(s));
        if top.len() < k {
            return (!unseen_possible && open.next().is_none()).then_some(top);
        }
        let (last_key, last) = top.last().map(|(key, v)| (key, self.order(v)))?;
        let last = last?;
        let below = |ub: i128, key: Option<&Vec<u8>>| {
            ub < last || (ub == last && key.is_some_and(|key| key > last_key))
        };
        let proven = (!unseen_possible || below(unseen, None))
            && open.all(|(key, s)| below(self.upper(s), Some(key)));
        proven.then_some(top)
    }

    /// The hosts that hold a group: their COUNT of it is not 0 (the last
    /// COUNT asked: a fleet's own, else the caller's); without a COUNT, the
    /// hosts that reported it.
    pub(crate) fn holders(&self, key: &[u8]) -> Vec<Target> {
        let count = self.ops.iter().rposition(|op| *op == AggregateOp::Count);
        self.groups.get(key).map_or_else(Vec::new, |s| {
            s.from
                .iter()
                .filter(|(_, v)| count.is_none_or(|c| v.get(c).copied().flatten().unwrap_or(0) > 0))
                .map(|(t, _)| t.clone())
                .collect()
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Aggregate, pb};

    fn options() -> AggregateOptions {
        AggregateOptions::default()
            .with_aggregate(Aggregate::sum("value.bytes"))
            .with_hidden_count(2)
    }

    /// An answer of `(key, sum, count)` groups out of `total`.
    fn answer(groups: &[(u8, i128, u64)], total: u64) -> AggregateResult {
        AggregateResult::from_proto(
            pb::AggregateMapResponse {
                groups: groups
                    .iter()
                    .map(|(k, sum, count)| pb::Group {
                        key: None,
                        values: vec![sum.to_string().into(), count.to_string().into()],
                        key_bytes: vec![*k],
                    })
                    .collect(),
                summary: Some(pb::AggregateSummary {
                    groups_total: total,
                    order_non_negative: true,
                    ..Default::default()
                }),
            },
            &[AggregateOp::Sum, AggregateOp::Count],
        )
        .unwrap()
    }

    fn t(s: &str) -> Target {
        s.parse().unwrap()
    }

    #[test]
    fn complete_answers_prove_the_top_at_once() {
        let mut m = Merge::new(&options());
        m.add(
            &t("a:1"),
            answer(&[(1, 10, 1), (2, 5, 1)], 2),
            Some(Bound::AtMost(5)),
        );
        m.add(&t("b:1"), answer(&[(2, 7, 2)], 1), Some(Bound::AtMost(7)));
        let top = m.proven_top(1).unwrap();
        assert_eq!(top, [(vec![2], vec![Some(12), Some(3)])]);
        assert_eq!(m.holders(&[2]), [t("a:1"), t("b:1")]);
        assert_eq!(m.holders(&[1]), [t("a:1")]);
    }

    #[test]
    fn a_group_in_no_hosts_top_keeps_the_top_unproven_until_asked() {
        // a: 1=10, 3=6 (not reported); b: 2=10, 3=6 (not reported).
        let mut m = Merge::new(&options());
        m.add(&t("a:1"), answer(&[(1, 10, 1)], 2), Some(Bound::AtMost(10)));
        m.add(&t("b:1"), answer(&[(2, 10, 1)], 2), Some(Bound::AtMost(10)));
        assert_eq!(m.proven_top(1), None);
        assert_eq!(m.kth_lower(1), 10);
        // Threshold ceil(10 / 2) = 5: both report group 3, and have more
        // groups below 5.
        m.add(
            &t("a:1"),
            answer(&[(1, 10, 1), (3, 6, 1)], 3),
            Some(Bound::AtMost(4)),
        );
        m.add(
            &t("b:1"),
            answer(&[(2, 10, 1), (3, 6, 1)], 3),
            Some(Bound::AtMost(4)),
        );
        // Group 3 is 12 exactly, but 1 and 2 may be 14.
        assert_eq!(m.proven_top(1), None);
        let asks = m.to_ask(1);
        assert_eq!(asks[&t("a:1")], [vec![2]]);
        assert_eq!(asks[&t("b:1")], [vec![1]]);
        m.add(&t("a:1"), answer(&[(2, 0, 0)], 3), None);
        m.add(&t("b:1"), answer(&[(1, 0, 0)], 3), None);
        let top = m.proven_top(2).unwrap();
        assert_eq!(
            top,
            [
                (vec![3], vec![Some(12), Some(2)]),
                (vec![1], vec![Some(10), Some(1)])
            ]
        );
        assert_eq!(m.holders(&[1]), [t("a:1")]);
    }

    #[test]
    fn a_dropped_host_is_forgotten() {
        let mut m = Merge::new(&options());
        m.add(&t("a:1"), answer(&[(1, 10, 1)], 1), Some(Bound::AtMost(10)));
        m.add(
            &t("b:1"),
            answer(&[(1, 3, 1), (2, 4, 1)], 2),
            Some(Bound::AtMost(3)),
        );
        m.drop_host(&t("a:1"));
        assert_eq!(m.hosts().collect::<Vec<_>>(), [&t("b:1")]);
        let top = m.proven_top(1).unwrap();
        assert_eq!(top, [(vec![2], vec![Some(4), Some(1)])]);
    }

    /// A host as a daemon answers: its groups' (sum, count).
    type Host = BTreeMap<u8, (i128, u64)>;

    /// A daemon's answer: the top `limit` (0: all) at least `threshold`, or
    /// exactly `groups`.
    fn serve(
        host: &Host,
        limit: usize,
        threshold: Option<i128>,
        groups: &[Vec<u8>],
    ) -> AggregateResult {
        let mut rows: Vec<(u8, i128, u64)> = if groups.is_empty() {
            host.iter().map(|(k, (s, c))| (*k, *s, *c)).collect()
        } else {
            groups
                .iter()
                .map(|g| (g[0], host.get(&g[0]).map_or((0, 0), |v| *v)))
                .map(|(k, (s, c))| (k, s, c))
                .collect()
        };
        rows.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(&b.0)));
        if groups.is_empty() {
            rows.retain(|r| threshold.is_none_or(|t| r.1 >= t));
            if limit > 0 {
                rows.truncate(limit);
            }
        }
        answer(
            &rows.iter().map(|r| (r.0, r.1, r.2)).collect::<Vec<_>>(),
            host.len() as u64,
        )
    }

    /// The three phases as the fleet runs them, on simulated hosts.
    fn tput(hosts: &[Host], k: usize) -> Ranked {
        let names: Vec<Target> = (0..hosts.len()).map(|i| t(&format!("h{i}:1"))).collect();
        let mut m = Merge::new(&options());
        for (name, host) in names.iter().zip(hosts) {
            let r = serve(host, k, None, &[]);
            let last = r.groups().last().and_then(|g| g.values()[0]).unwrap_or(0);
            m.add(name, r, Some(Bound::AtMost(last)));
        }
        if let Some(top) = m.proven_top(k) {
            return top;
        }
        let n = hosts.len() as i128;
        let threshold = (m.kth_lower(k) + n - 1) / n;
        for (name, host) in names.iter().zip(hosts) {
            let r = serve(host, 0, Some(threshold), &[]);
            m.add(name, r, Some(Bound::AtMost(threshold - 1)));
        }
        if let Some(top) = m.proven_top(k) {
            return top;
        }
        for (name, keys) in m.to_ask(k) {
            let host = &hosts[names.iter().position(|n| *n == name).unwrap()];
            m.add(&name, serve(host, 0, None, &keys), None);
        }
        m.proven_top(k).expect("three phases prove the top K")
    }

    #[test]
    fn three_phases_give_the_exact_top_k_with_many_ties() {
        let mut seed = 0x2545_F491_4F6C_DD1Du64;
        let mut next = move |n: u64| {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed % n
        };
        for case in 0..2000 {
            let (n, groups, range) = (1 + next(6) as usize, 1 + next(40), 1 + next(12) as i128);
            let mut hosts: Vec<Host> = Vec::new();
            for _ in 0..n {
                let mut host = Host::new();
                for g in 0..groups {
                    if next(3) != 0 {
                        host.insert(g as u8, (next(range as u64) as i128, 1 + next(3)));
                    }
                }
                hosts.push(host);
            }
            let mut total: BTreeMap<u8, (i128, u64)> = BTreeMap::new();
            for h in &hosts {
                for (g, (s, c)) in h {
                    let e = total.entry(*g).or_default();
                    e.0 += s;
                    e.1 += c;
                }
            }
            let mut want: Vec<(u8, i128, u64)> =
                total.iter().map(|(g, (s, c))| (*g, *s, *c)).collect();
            want.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(&b.0)));
            let k = 1 + next(12) as usize;
            want.truncate(k);
            let want: Ranked = want
                .into_iter()
                .map(|(g, s, c)| (vec![g], vec![Some(s), Some(c as i128)]))
                .collect();
            assert_eq!(tput(&hosts, k), want, "case {case}: {n} hosts, top {k}");
        }
    }
}
