//! A fleet's aggregate: the groups of every host merged exactly, and its
//! top K without fetching every group from every host.
//!
//! When the ordering aggregate cannot be negative (a COUNT, or the SUM of
//! an unsigned member: the daemons say so) and the order is descending, the
//! top K is found with the three-phase uniform threshold algorithm (TPUT,
//! Cao and Wang, 2004):
//!
//! 1. every host sends its own top K; `tau1` is the K-th largest sum of
//!    what came (a host that did not send a group counts 0 for it);
//! 2. every host sends every group whose value there is at least
//!    `T = ceil(tau1 / n)` (n hosts). A group a host did not send is below
//!    T there, so each group's total lies between the sum of what was sent
//!    (its lower bound) and that plus T - 1 per host that did not send it
//!    (its upper bound; less when the host's own top K ended lower). Groups
//!    whose upper bound is below `tau2`, the K-th largest lower bound,
//!    cannot be in the top K; nor can a group nobody sent (at most
//!    n (T - 1) < tau1 <= tau2);
//! 3. every host that did not send one of the remaining groups is asked for
//!    exactly those, and the top K of the exact totals is the answer, each
//!    group with all its aggregates merged (COUNT and SUM added, the MIN of
//!    the minimums, the MAX of the maximums).
//!
//! The library checks that what it learnt proves the answer before giving
//! it (phases end early when it does), so a host that fails half-way never
//! makes a wrong answer: it is left out, the answer is that of the others,
//! and [`FleetAggregate::missing`] names it. Otherwise (MIN or MAX
//! ordering, ascending order, values that may be negative, no limit) every
//! host sends every group, up to [`FleetAggregateOptions::with_max_groups`],
//! and they are merged ([`MergeMethod::AllGroups`]).
//!
//! Exact for maps that do not change during the run: each phase walks the
//! maps again.

use std::{
    collections::{BTreeMap, HashMap, HashSet},
    future::{Future, IntoFuture},
    pin::Pin,
    sync::Arc,
    time::{Duration, Instant},
};

use futures::StreamExt as _;
use tokio::sync::mpsc;

use crate::{
    AggregateOp, AggregateOptions, AggregateResult, Error, Fleet, FleetEvent, FleetRun, Group,
    MapName, Target, TargetReport,
    fleet::timed,
    pb,
    relay::{Deadline, RelayLink, Run, copy, status_error},
    topk::{Bound, Merge, Ranked},
};

/// The default bound on the groups each host sends when every group is
/// merged.
pub const DEFAULT_MAX_GROUPS: usize = 100_000;

/// Options of a fleet aggregate ([`Fleet::aggregate`]).
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct FleetAggregateOptions {
    pub(crate) aggregate: AggregateOptions,
    max_groups: usize,
}

/// No aggregate yet; at most 100,000 groups per host when every group is
/// merged.
impl Default for FleetAggregateOptions {
    fn default() -> Self {
        Self {
            aggregate: AggregateOptions::default(),
            max_groups: DEFAULT_MAX_GROUPS,
        }
    }
}

impl FleetAggregateOptions {
    /// What every host computes; the limit is the fleet's top K (0: every
    /// group), a threshold applies to the merged values, and given groups
    /// ([`AggregateOptions::with_groups`]) are reported from every host.
    pub fn with_aggregate(mut self, aggregate: AggregateOptions) -> Self {
        self.aggregate = aggregate;
        self
    }

    /// The most groups one host may send when every group is merged
    /// ([`MergeMethod::AllGroups`]; default 100,000); a host with more fails
    /// (RESOURCE_EXHAUSTED), and the answer is partial.
    pub fn with_max_groups(mut self, groups: usize) -> Self {
        self.max_groups = groups;
        self
    }
}

/// How a fleet aggregate merged the hosts' groups. Its one spelling
/// ([`MergeMethod::as_str`], read back by `parse`) is what the relay sends
/// (`FleetServiceAggregateMapResponse.method`) and what bpfmapctl prints.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum MergeMethod {
    /// "top_k": the three-phase uniform threshold top K (TPUT): exact,
    /// without every group of every host.
    Threshold,
    /// "merge": every group of every host merged (MIN or MAX ordering,
    /// ascending, values that may be negative, or no limit).
    AllGroups,
    /// "groups": the groups asked for, from every host.
    Groups,
}

impl MergeMethod {
    /// "top_k", "merge" or "groups".
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Threshold => "top_k",
            Self::AllGroups => "merge",
            Self::Groups => "groups",
        }
    }
}

impl std::fmt::Display for MergeMethod {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The method [`MergeMethod::as_str`] spells; [`Error::Protocol`] for any
/// other text.
impl std::str::FromStr for MergeMethod {
    type Err = Error;

    fn from_str(s: &str) -> Result<Self, Error> {
        [Self::Threshold, Self::AllGroups, Self::Groups]
            .into_iter()
            .find(|m| m.as_str() == s)
            .ok_or_else(|| Error::Protocol(format!("unknown merge method {s:?}")))
    }
}

/// One merged group.
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub struct FleetGroup {
    /// The group: its key, its values merged over the hosts (exact), its
    /// key bytes.
    pub group: Group,
    /// The hosts that hold entries of it, in the fleet's order.
    pub hosts: Vec<Target>,
}

/// What a target did over every phase, for its report.
#[derive(Debug, Default)]
struct Tally {
    error: Option<Error>,
    calls: u32,
    scanned: u64,
    groups: u64,
    elapsed: Duration,
}

impl Tally {
    fn is_ok(&self) -> bool {
        self.error.is_none()
    }

    fn into_report(self, target: Target) -> TargetReport {
        TargetReport {
            target,
            error: self.error,
            entries: self.groups,
            scanned: self.scanned,
            calls: self.calls,
            complete: false,
            resumes: 0,
            cursor: String::new(),
            elapsed: self.elapsed,
        }
    }
}

/// A fleet aggregate's answer.
#[derive(Debug)]
#[non_exhaustive]
pub struct FleetAggregate {
    /// The groups, ordered as asked (then by key bytes), cut at the limit.
    pub groups: Vec<FleetGroup>,
    /// How they were found.
    pub method: MergeMethod,
    /// Every target's report, in the fleet's order (its groups sent in
    /// `entries`, the entries its daemon read in `scanned`, its calls in
    /// `calls`), when the run was awaited; in the stream they come as
    /// [`FleetEvent::Done`] before the answer, and this is empty.
    pub reports: Vec<TargetReport>,
    /// The targets that failed, in the fleet's order: the answer is that
    /// of the others.
    pub missing: Vec<Target>,
}

/// Awaiting a fleet aggregate runs it to the end: the answer, with every
/// target's report.
impl IntoFuture for FleetRun<FleetAggregate> {
    type Output = FleetAggregate;
    type IntoFuture = Pin<Box<dyn Future<Output = FleetAggregate> + Send>>;

    fn into_future(mut self) -> Self::IntoFuture {
        Box::pin(async move {
            let mut reports = Vec::new();
            while let Some(event) = self.next().await {
                match event {
                    FleetEvent::Done(r) => reports.push(r),
                    FleetEvent::Merged(mut answer) => {
                        answer.reports = reports;
                        return answer;
                    }
                    FleetEvent::Answer { .. } | FleetEvent::Retrying { .. } => {}
                }
            }
            // The run was cut short (its task failed): no answer.
            let missing = reports.iter().map(|r| r.target.clone()).collect();
            FleetAggregate {
                groups: Vec::new(),
                method: MergeMethod::AllGroups,
                reports,
                missing,
            }
        })
    }
}

impl FleetAggregate {
    /// Whether some targets are missing from the answer.
    pub fn is_partial(&self) -> bool {
        !self.missing.is_empty()
    }
}

impl Fleet {
    /// Aggregates `map` on every target and merges the groups exactly
    /// (groups with the same key bytes combined); a top K (a limit) is found
    /// without every group of every host where the ordering allows it (see
    /// [`MergeMethod`] and the module's documentation). Failed targets are
    /// left out and named ([`FleetAggregate::missing`]). Each call waits at
    /// most the fleet's answer timeout
    /// ([`FleetOptions::with_answer_timeout`](crate::FleetOptions::with_answer_timeout):
    /// the daemon walks the whole map before it answers); the fleet's
    /// deadline bounds the whole run.
    ///
    /// The run's events are each target's retries and its report, then
    /// the fleet's answer ([`FleetEvent::Merged`]); awaiting the run gives
    /// the answer with the reports in it.
    pub fn aggregate(
        &self,
        map: &MapName,
        options: FleetAggregateOptions,
    ) -> FleetRun<FleetAggregate> {
        if let Some(relay) = self.relay.as_ref().filter(|_| !self.targets().is_empty()) {
            return via_relay(relay, self, map, options);
        }
        let (fleet, map) = (self.clone(), map.clone());
        let buffer = self.targets().len() + 1;
        let hosts = self.targets().len();
        FleetRun::spawn(self.targets().to_vec(), buffer, move |tx| async move {
            let run = Runner {
                fleet,
                map,
                started: Instant::now(),
                reports: BTreeMap::new(),
                merge: Merge::new(&options.aggregate.with_hidden_count(hosts)),
                tx,
            };
            run.run(options).await;
        })
    }
}

impl Runner {
    /// Every phase, then every target's report and the answer.
    async fn run(mut self, options: FleetAggregateOptions) {
        let hosts = self.fleet.targets().len();
        let asked = options.aggregate.with_hidden_count(hosts);
        let shown = options.aggregate.aggregates().len();
        let k = asked.limit() as usize;
        let order = asked.aggregates().get(asked.order_by()).map(|a| a.op());
        let thresholdable = !asked.ascending()
            && k > 0
            && matches!(order, Some(AggregateOp::Count | AggregateOp::Sum));
        let (method, top) = if !asked.groups().is_empty() {
            (MergeMethod::Groups, self.given(&asked).await)
        } else if thresholdable {
            self.threshold(&asked, options.max_groups).await
        } else {
            let all: Vec<Target> = self.fleet.targets().to_vec();
            (
                MergeMethod::AllGroups,
                self.all(&asked, all, options.max_groups).await,
            )
        };
        self.finish(method, top, &asked, shown).await;
    }
}

/// Whether every group of an answer has one value per aggregate.
fn fits(result: &AggregateResult, aggregates: usize) -> bool {
    result
        .groups()
        .iter()
        .all(|g| g.values().len() == aggregates)
}

/// A fleet aggregate in progress.
struct Runner {
    fleet: Fleet,
    map: MapName,
    started: Instant,
    reports: BTreeMap<Target, Tally>,
    merge: Merge,
    /// Where the run's events go.
    tx: mpsc::Sender<FleetEvent<FleetAggregate>>,
}

impl Runner {
    /// The threshold top K, or every group when a daemon says the ordering
    /// values may be negative.
    async fn threshold(&mut self, asked: &AggregateOptions, max: usize) -> (MergeMethod, Ranked) {
        let k = asked.limit() as usize;
        let first = asked.phase(asked.limit(), None, Vec::new());
        let all = self.fleet.targets().iter().cloned();
        let answers = self.phase(all.map(|t| (t, first.clone())).collect()).await;
        if answers.values().any(|r| !r.summary().order_non_negative()) {
            let hosts = answers.into_keys().collect();
            return (MergeMethod::AllGroups, self.all(asked, hosts, max).await);
        }
        for (t, r) in answers {
            let last = r.groups().last();
            let bound = last.and_then(|g| g.values().get(asked.order_by()).copied().flatten());
            self.merge
                .add(&t, r, Some(Bound::AtMost(bound.unwrap_or(0))));
        }
        if let Some(top) = self.merge.proven_top(k) {
            return (MergeMethod::Threshold, top);
        }
        // One host's own top K is the answer.
        if self.merge.hosts().count() == 1 {
            let mut top = self.merge.ranked();
            top.truncate(k);
            return (MergeMethod::Threshold, top);
        }
        // Phase 2: every group at least tau1 / n, where the host's top K
        // left some out.
        let n = self.merge.hosts().count().max(1) as i128;
        let t = self.merge.kth_lower(k).saturating_add(n - 1) / n;
        let second = asked.phase(0, Some(t), Vec::new());
        let hosts: Vec<Target> = self.merge.incomplete().cloned().collect();
        let answers = self
            .phase(hosts.into_iter().map(|h| (h, second.clone())).collect())
            .await;
        for (h, r) in answers {
            self.merge.add(&h, r, Some(Bound::AtMost(t - 1)));
        }
        if let Some(top) = self.merge.proven_top(k) {
            return (MergeMethod::Threshold, top);
        }
        // Phase 3: the exact values of the groups that may still be in the
        // top K, from the hosts that did not send them.
        let asks = self.merge.to_ask(k);
        self.ask_groups(asked, asks).await;
        match self.merge.proven_top(k) {
            Some(top) => (MergeMethod::Threshold, top),
            // Only when hosts failed half-way (or the maps changed): every
            // group of the others.
            None => {
                let hosts = self.merge.hosts().cloned().collect();
                (MergeMethod::AllGroups, self.all(asked, hosts, max).await)
            }
        }
    }

    /// Every group of `hosts`, merged, cut at the limit.
    async fn all(&mut self, asked: &AggregateOptions, hosts: Vec<Target>, max: usize) -> Ranked {
        self.merge = Merge::new(asked);
        let cap = u32::try_from(max).unwrap_or(u32::MAX);
        let every = asked.phase(cap, None, Vec::new());
        let answers = self
            .phase(hosts.into_iter().map(|h| (h, every.clone())).collect())
            .await;
        for (h, r) in answers {
            if r.summary().groups_total() > r.groups().len() as u64 {
                let e = tonic::Status::resource_exhausted(format!(
                    "{} groups, more than the {max} a fleet merges from one host when it merges every group (FleetAggregateOptions::with_max_groups); filter, or group by coarser members",
                    r.summary().groups_total()
                ));
                self.fail(&h, e.into());
                continue;
            }
            self.merge.add(&h, r, Some(Bound::Complete));
        }
        let mut top = self.merge.ranked();
        if asked.limit() > 0 {
            top.truncate(asked.limit() as usize);
        }
        top
    }

    /// The groups asked for, from every host.
    async fn given(&mut self, asked: &AggregateOptions) -> Ranked {
        let asks = self
            .fleet
            .targets()
            .iter()
            .map(|t| (t.clone(), asked.groups().to_vec()))
            .collect();
        self.ask_groups(asked, asks).await;
        let wanted: std::collections::HashSet<&[u8]> =
            asked.groups().iter().map(Vec::as_slice).collect();
        let hosts: Vec<Target> = self.merge.hosts().cloned().collect();
        // Every host answered for every group: each is known exactly.
        let mut exact = self.merge.clone();
        for h in &hosts {
            exact.add(h, AggregateResult::empty(), Some(Bound::Complete));
        }
        let mut top = exact.ranked();
        top.retain(|(k, _)| wanted.contains(k.as_slice()));
        top
    }

    /// Asks each host for its groups, in requests of at most 1 MiB of keys.
    async fn ask_groups(
        &mut self,
        asked: &AggregateOptions,
        mut asks: BTreeMap<Target, Vec<Vec<u8>>>,
    ) {
        while !asks.is_empty() {
            let mut round = BTreeMap::new();
            for (t, keys) in asks.iter_mut() {
                let mut bytes = 0;
                let n = keys
                    .iter()
                    .take_while(|k| {
                        bytes += k.len() + 4;
                        bytes <= 1 << 20
                    })
                    .count()
                    .max(1);
                let batch: Vec<Vec<u8>> = keys.drain(..n.min(keys.len())).collect();
                round.insert(t.clone(), asked.phase(0, None, batch));
            }
            asks.retain(|_, keys| !keys.is_empty());
            for (t, r) in self.phase(round).await {
                self.merge.add(&t, r, None);
            }
            asks.retain(|t, _| self.reports.get(t).is_none_or(Tally::is_ok));
        }
    }

    /// One call on each target, each with its own options; the answers of
    /// those that answered. A target that fails is dropped from the merge.
    async fn phase(
        &mut self,
        asks: BTreeMap<Target, AggregateOptions>,
    ) -> BTreeMap<Target, AggregateResult> {
        let asks: BTreeMap<Target, AggregateOptions> = asks
            .into_iter()
            .filter(|(t, _)| self.reports.get(t).is_none_or(Tally::is_ok))
            .collect();
        if asks.is_empty() {
            return BTreeMap::new();
        }
        let deadline = self.fleet.options().deadline();
        let left = deadline.map(|d| d.saturating_sub(self.started.elapsed()));
        if let (Some(deadline), Some(Duration::ZERO)) = (deadline, left) {
            for t in asks.keys() {
                self.fail(t, Error::Deadline { deadline });
            }
            return BTreeMap::new();
        }
        let plan = self.fleet.plan_of(asks.keys().cloned().collect(), left);
        let wait = self.fleet.options().answer_timeout();
        let (map, asks) = (self.map.clone(), Arc::new(asks));
        let mut run = plan.run(move |client, answers| {
            let (map, asks) = (map.clone(), asks.clone());
            async move {
                let options = asks.get(&answers.target).cloned().unwrap_or_default();
                let result = timed(wait, client.aggregate(&map, options)).await?;
                answers.update(|p| p.entries = result.groups().len() as u64);
                answers.send(result).await;
                Ok(())
            }
        });
        let (mut answered, mut reports) = (BTreeMap::new(), Vec::new());
        while let Some(event) = run.next().await {
            match event {
                FleetEvent::Answer { target, answer } => {
                    answered.insert(target, answer);
                }
                FleetEvent::Retrying { target, error } => {
                    let _ = self.tx.send(FleetEvent::Retrying { target, error }).await;
                }
                FleetEvent::Done(report) => reports.push(report),
                FleetEvent::Merged(_) => {}
            }
        }
        let want = self.merge.width();
        let mut out = BTreeMap::new();
        for report in reports {
            let t = report.target.clone();
            let mut results: Vec<AggregateResult> = answered.remove(&t).into_iter().collect();
            let r = self.report(&t);
            r.elapsed += report.elapsed;
            match (report.error, results.pop()) {
                (Some(Error::Deadline { .. }), _) => {
                    let deadline = deadline.unwrap_or_default();
                    self.fail(&t, Error::Deadline { deadline })
                }
                (Some(e), _) => self.fail(&t, e),
                (None, Some(result)) if !fits(&result, want) => {
                    let e = Error::Protocol(format!(
                        "a group without one value per aggregate ({want} asked)"
                    ));
                    self.fail(&t, e)
                }
                (None, Some(result)) => {
                    r.calls += 1;
                    r.scanned += result.summary().entries_scanned();
                    r.groups += result.groups().len() as u64;
                    out.insert(t, result);
                }
                (None, None) => self.fail(&t, Error::Protocol("no answer".into())),
            }
        }
        out
    }

    fn report(&mut self, t: &Target) -> &mut Tally {
        self.reports.entry(t.clone()).or_default()
    }

    /// Notes `t`'s failure and leaves it out of the answer.
    fn fail(&mut self, t: &Target, e: Error) {
        self.report(t).error = Some(e);
        self.merge.drop_host(t);
    }

    /// Sends every target's report, then the answer: the groups (cut at
    /// the threshold, if any), with their keys and hosts, and the `shown`
    /// values the caller asked (not the COUNT a fleet adds).
    async fn finish(
        mut self,
        method: MergeMethod,
        top: Ranked,
        asked: &AggregateOptions,
        shown: usize,
    ) {
        let within = |v: Option<i128>| match (asked.threshold(), v) {
            (None, _) => true,
            (Some(t), Some(v)) if asked.ascending() => v <= t,
            (Some(t), Some(v)) => v >= t,
            (Some(_), None) => false,
        };
        let order: std::collections::HashMap<&Target, usize> = self
            .fleet
            .targets()
            .iter()
            .enumerate()
            .map(|(i, t)| (t, i))
            .collect();
        // Given groups are reported whatever the threshold, as a daemon
        // reports them.
        let given = method == MergeMethod::Groups;
        let groups = top
            .into_iter()
            .filter(|(_, v)| given || within(v.get(asked.order_by()).copied().flatten()))
            .map(|(key_bytes, flat)| {
                let (mut values, mut elements) = self.merge.split(flat);
                values.truncate(shown);
                elements.truncate(shown);
                let key = self.merge.groups.get(&key_bytes).map(|s| s.key.clone());
                let mut hosts = self.merge.holders(&key_bytes);
                hosts.sort_by_key(|t| order.get(t).copied());
                FleetGroup {
                    hosts,
                    group: Group::new(key.unwrap_or_default(), values, elements, key_bytes),
                }
            })
            .collect();
        let mut missing = Vec::new();
        for t in self.fleet.targets() {
            let tally = self.reports.remove(t).unwrap_or_default();
            if !tally.is_ok() {
                missing.push(t.clone());
            }
            if self
                .tx
                .send(FleetEvent::Done(tally.into_report(t.clone())))
                .await
                .is_err()
            {
                return;
            }
        }
        let answer = FleetAggregate {
            groups,
            method,
            reports: Vec::new(),
            missing,
        };
        let _ = self.tx.send(FleetEvent::Merged(answer)).await;
    }
}

/// An aggregate through the relay.
fn via_relay(
    link: &RelayLink,
    fleet: &Fleet,
    map: &MapName,
    options: FleetAggregateOptions,
) -> FleetRun<FleetAggregate> {
    let req = pb::FleetServiceAggregateMapRequest {
        request: Some(options.aggregate.request(map)),
        targets: RelayLink::selector(fleet.targets()),
    };
    let (mut client, targets) = (link.client.clone(), fleet.targets().to_vec());
    let ops: Vec<AggregateOp> = options
        .aggregate
        .aggregates()
        .iter()
        .map(|a| a.op())
        .collect();
    let deadline = Deadline::start(fleet.options().deadline());
    let buffer = targets.len() + 1;
    FleetRun::spawn(targets.clone(), buffer, move |tx| async move {
        let mut run = Run::new(targets, tx);
        let answer = deadline
            .within(async move { client.aggregate_map(deadline.request(req)).await })
            .await;
        match answer.map(tonic::Response::into_inner) {
            Ok(a) => run.aggregate_answer(a, &ops).await,
            Err(e) => run.fail_all(|| copy(&e)).await,
        }
    })
}

impl Run<FleetAggregate> {
    /// The targets' reports, then the fleet's answer; targets the answer
    /// does not name are reported failed and missing.
    async fn aggregate_answer(
        &mut self,
        answer: pb::FleetServiceAggregateMapResponse,
        ops: &[AggregateOp],
    ) {
        let groups: Result<Vec<FleetGroup>, Error> = answer
            .groups
            .iter()
            .map(|g| {
                Ok(FleetGroup {
                    group: Group::from_proto(g.group.clone().unwrap_or_default(), ops)?,
                    hosts: g.targets.iter().map(|t| self.target(t)).collect(),
                })
            })
            .collect();
        let (groups, method) = match (groups, answer.method.parse::<MergeMethod>()) {
            (Ok(groups), Ok(method)) => (groups, method),
            (Err(e), _) => {
                let bad = format!("the relay's answer: {e}");
                return self.fail_all(|| Error::Protocol(bad.clone())).await;
            }
            (_, Err(e)) => return self.fail_all(|| copy(&e)).await,
        };
        for w in &answer.work {
            let p = self.progress.entry(w.target.clone()).or_default();
            (p.entries, p.scanned, p.calls) = (w.groups, w.entries_scanned, w.calls);
        }
        let answered: HashSet<&str> = answer.answered.iter().map(String::as_str).collect();
        let failed: HashMap<&str, pb::TargetStatus> = answer
            .failed
            .iter()
            .map(|f| (f.target.as_str(), f.status.clone().unwrap_or_default()))
            .collect();
        // Reports in the fleet's order, as a fleet reached directly.
        let (mut events, mut missing) = (Vec::new(), Vec::new());
        for t in self.targets.clone() {
            let name = t.as_str();
            let error = match (answered.contains(name), failed.get(name)) {
                (true, _) => None,
                (false, Some(status)) => Some(status_error(status)),
                (false, None) => Some(Error::Status(tonic::Status::unavailable(
                    "the relay said nothing of this target",
                ))),
            };
            if error.is_some() {
                missing.push(t.clone());
            }
            events.push(self.report(name, error, false));
        }
        events.push(FleetEvent::Merged(FleetAggregate {
            groups,
            method,
            reports: Vec::new(),
            missing,
        }));
        self.send_all(events).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_merge_method_has_one_spelling_read_back_as_written() {
        for (method, text) in [
            (MergeMethod::Threshold, "top_k"),
            (MergeMethod::AllGroups, "merge"),
            (MergeMethod::Groups, "groups"),
        ] {
            assert_eq!(method.as_str(), text);
            assert_eq!(method.to_string(), text);
            assert_eq!(text.parse::<MergeMethod>().unwrap(), method);
        }
        assert!(matches!(
            "threshold".parse::<MergeMethod>(),
            Err(Error::Protocol(m)) if m == "unknown merge method \"threshold\""
        ));
    }
}
