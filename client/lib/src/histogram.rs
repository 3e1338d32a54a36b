//! Histograms computed where the map lives (HistogramMap): the buckets of
//! a map that keeps a histogram (libbpf-tools' `struct hist`, bpftrace's
//! hist() and lhist()), summed over its entries by the daemon, with their
//! bounds, the total, the mean and quantiles; merged exactly across hosts.

use std::collections::{BTreeMap, HashMap};

use bpfmap_proto::histogram as math;

use crate::{
    AggregateSummary, Client, Error, Fleet, FleetEvent, FleetRun, MapName, Target, TargetReport,
    pb::{self, histogram_layout::Buckets},
    typed,
};

/// How a map keeps its histogram, and what its buckets count. Unset in
/// [`HistogramOptions`], the daemon recognizes it from the map's types.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct HistogramLayout(pb::HistogramLayout);

impl HistogramLayout {
    /// libbpf-tools' log2 buckets: 0 counts 0 and 1, k counts [2^k, 2^(k+1)).
    pub fn log2() -> Self {
        Self::of(Buckets::Log2)
    }

    /// bpftrace's hist(): 0 counts values below 0, 1 counts 0, k >= 2
    /// counts [2^(k-2), 2^(k-1)).
    pub fn bpftrace_log2() -> Self {
        Self::of(Buckets::BpftraceLog2)
    }

    /// Bucket k counts [min + k*step, min + (k+1)*step).
    pub fn linear(min: i64, step: u64) -> Self {
        Self(pb::HistogramLayout {
            min,
            step,
            ..Self::of(Buckets::Linear).0
        })
    }

    /// bpftrace's lhist(value, min, max, step).
    pub fn bpftrace_linear(min: i64, max: i64, step: u64) -> Self {
        Self(pb::HistogramLayout {
            min,
            max,
            step,
            ..Self::of(Buckets::BpftraceLinear).0
        })
    }

    /// The buckets named as bpfmapctl's `--hist` spells them ("log2",
    /// "bpftrace-log2"; linear ones take their bounds from
    /// [`with_bounds`](Self::with_bounds)).
    pub fn named(name: &str) -> Option<Self> {
        math::parse_name(name).map(Self::of)
    }

    fn of(b: Buckets) -> Self {
        Self(pb::HistogramLayout {
            buckets: b as i32,
            ..Default::default()
        })
    }

    /// With the bounds of linear buckets.
    pub fn with_bounds(mut self, min: i64, max: i64, step: u64) -> Self {
        (self.0.min, self.0.max, self.0.step) = (min, max, step);
        self
    }

    /// The array of counts per entry ("value.slots").
    pub fn with_slots(mut self, path: impl Into<String>) -> Self {
        self.0.slots = path.into();
        self
    }

    /// The key member holding an entry's bucket number (default "key").
    pub fn with_bucket(mut self, path: impl Into<String>) -> Self {
        self.0.bucket = path.into();
        self
    }

    /// The member holding an entry's count (default "value").
    pub fn with_count(mut self, path: impl Into<String>) -> Self {
        self.0.count = path.into();
        self
    }

    /// What the values measure ("usecs"), as drawings head the buckets.
    pub fn with_unit(mut self, unit: impl Into<String>) -> Self {
        self.0.unit = unit.into();
        self
    }

    /// The buckets' name ("log2", "bpftrace-linear").
    pub fn name(&self) -> &'static str {
        math::name(self.0.buckets())
    }

    /// The message it travels in.
    pub fn as_proto(&self) -> &pb::HistogramLayout {
        &self.0
    }

    /// The layout of a message.
    pub fn from_proto(l: pb::HistogramLayout) -> Self {
        Self(l)
    }
}

/// Options of a histogram ([`Client::histogram`]).
#[derive(Debug, Clone, Default)]
#[non_exhaustive]
pub struct HistogramOptions {
    filter: String,
    layout: Option<HistogramLayout>,
    group_by: Vec<String>,
    limit: u32,
    render: BTreeMap<String, String>,
    batched: bool,
}

impl HistogramOptions {
    /// Only entries for which the CEL `filter` is true count.
    pub fn with_filter(mut self, filter: impl Into<String>) -> Self {
        self.filter = filter.into();
        self
    }

    /// The map's layout, when its types do not say it.
    pub fn with_layout(mut self, layout: HistogramLayout) -> Self {
        self.layout = Some(layout);
        self
    }

    /// One histogram per value of these members ("key.pid").
    pub fn with_group_by(mut self, paths: impl IntoIterator<Item = impl Into<String>>) -> Self {
        self.group_by = paths.into_iter().map(Into::into).collect();
        self
    }

    /// At most this many histograms, the largest totals first (0: all).
    pub fn with_limit(mut self, histograms: u32) -> Self {
        self.limit = histograms;
        self
    }

    /// How group keys show members (`"key.daddr" => "ipv4"`).
    pub fn with_render<K: AsRef<str>, V: std::fmt::Display>(
        mut self,
        render: impl IntoIterator<Item = (K, V)>,
    ) -> Self {
        self.render = render
            .into_iter()
            .map(|(k, v)| (k.as_ref().to_owned(), v.to_string()))
            .collect();
        self
    }

    /// Read the map in batches, never inside the kernel.
    pub fn with_batched_scan(mut self) -> Self {
        self.batched = true;
        self
    }

    /// The options of a `HistogramMapRequest` as a caller wrote it (its
    /// map aside), for a program that forwards requests (a relay).
    pub fn from_proto(req: &pb::HistogramMapRequest) -> Self {
        Self {
            filter: req.filter.clone(),
            layout: req.layout.clone().map(HistogramLayout),
            group_by: req.group_by.clone(),
            limit: req.limit,
            render: req.render.clone().into_iter().collect(),
            batched: req.scan == pb::ScanMethod::ScanBatched as i32,
        }
    }

    /// The most histograms asked for (0: all).
    pub fn limit(&self) -> u32 {
        self.limit
    }

    pub(crate) fn request(&self, map: &MapName) -> pb::HistogramMapRequest {
        pb::HistogramMapRequest {
            map: Some(map.to_proto()),
            filter: self.filter.clone(),
            layout: self.layout.as_ref().map(|l| l.0.clone()),
            group_by: self.group_by.clone(),
            limit: self.limit,
            render: self.render.clone().into_iter().collect(),
            scan: if self.batched {
                pb::ScanMethod::ScanBatched
            } else {
                pb::ScanMethod::ScanAuto
            } as i32,
        }
    }
}

/// A HistogramMap answer: the histograms (largest totals first), the
/// layout read, what the walk did.
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub struct Histograms {
    /// Each with its key (empty without group-by), buckets, total, mean
    /// and quantiles.
    pub histograms: Vec<pb::Histogram>,
    /// The layout the daemon read: the one asked for, or recognized.
    pub layout: HistogramLayout,
    /// The walk's figures.
    pub summary: Option<AggregateSummary>,
}

impl Histograms {
    /// Histograms of `layout` (merged ones, for [`since`](Self::since)).
    pub fn from_parts(histograms: Vec<pb::Histogram>, layout: HistogramLayout) -> Self {
        Self {
            histograms,
            layout,
            summary: None,
        }
    }

    fn from_proto(r: pb::HistogramMapResponse) -> Self {
        Self {
            histograms: r.histograms,
            layout: HistogramLayout(r.layout.unwrap_or_default()),
            summary: r.summary.map(AggregateSummary::from_proto),
        }
    }

    /// The buckets of every histogram, by group key bytes: what two scans
    /// or two hosts add and subtract.
    pub fn counts(&self) -> HashMap<Vec<u8>, BTreeMap<u32, u64>> {
        let mut out: HashMap<Vec<u8>, BTreeMap<u32, u64>> = HashMap::new();
        for h in &self.histograms {
            math::add(out.entry(h.key_bytes.clone()).or_default(), h);
        }
        out
    }

    /// What was counted since `earlier` (an answer of the same map and
    /// layout): each bucket's increase (a bucket that went down was reset,
    /// and counts its new value), as `runqlat 1` shows each interval.
    pub fn since(&self, earlier: &Histograms) -> Histograms {
        let before = earlier.counts();
        let histograms = self
            .histograms
            .iter()
            .map(|h| {
                let mut now = BTreeMap::new();
                math::add(&mut now, h);
                let was = before.get(&h.key_bytes);
                let added: BTreeMap<u32, u64> = now
                    .into_iter()
                    .map(|(i, c)| {
                        let b = was.and_then(|w| w.get(&i)).copied().unwrap_or(0);
                        (i, if c >= b { c - b } else { c })
                    })
                    .collect();
                math::histogram(&self.layout.0, h.key.clone(), h.key_bytes.clone(), &added)
            })
            .collect();
        Histograms {
            histograms,
            layout: self.layout.clone(),
            summary: self.summary.clone(),
        }
    }
}

impl Client {
    /// The histograms of a map that keeps one (see the module's
    /// documentation), computed by the daemon in one walk. Errors:
    /// INVALID_ARGUMENT for a map whose types hold no histogram the daemon
    /// recognizes (declare its layout: [`HistogramOptions::with_layout`]),
    /// for a layout or group-by path that does not fit; otherwise those of
    /// [`Client::aggregate`].
    pub async fn histogram(
        &self,
        map: &MapName,
        options: HistogramOptions,
    ) -> Result<Histograms, Error> {
        typed::parse_render(&options.render).map_err(Error::render)?;
        let req = options.request(map);
        let resp = self
            .call(|mut c| {
                let req = req.clone();
                async move { c.histogram_map(req).await }
            })
            .await?;
        Ok(Histograms::from_proto(resp))
    }
}

/// Histograms merged over a fleet: the buckets of equal groups added,
/// exactly.
#[derive(Debug)]
#[non_exhaustive]
pub struct FleetHistograms {
    /// The merged histograms, largest totals first, then by key bytes.
    pub histograms: Vec<pb::Histogram>,
    /// The layout of the first target (in target order) that answered;
    /// `None` when none did.
    pub layout: Option<HistogramLayout>,
    /// Every target's report, in the order they ended.
    pub reports: Vec<TargetReport>,
    /// Targets that failed.
    pub missing: Vec<Target>,
    /// Targets whose buckets count other values than the layout's (another
    /// bucket kind or bounds): left out of the merge.
    pub differ: Vec<Target>,
}

impl FleetHistograms {
    /// Whether some targets are missing from the merge.
    pub fn is_partial(&self) -> bool {
        !self.missing.is_empty() || !self.differ.is_empty()
    }

    /// Runs `run` to its end and merges its answers: at most `limit`
    /// histograms (0: all).
    pub(crate) async fn merge(mut run: FleetRun<Histograms>, limit: u32) -> Self {
        use futures::StreamExt;
        let mut answers: BTreeMap<Target, Histograms> = BTreeMap::new();
        let mut reports = Vec::new();
        while let Some(event) = run.next().await {
            match event {
                FleetEvent::Answer { target, answer } => {
                    answers.insert(target, answer);
                }
                FleetEvent::Done(r) => reports.push(r),
                FleetEvent::Merged(_) | FleetEvent::Retrying { .. } => {}
            }
        }
        let missing = reports
            .iter()
            .filter(|r| r.error.is_some())
            .map(|r| r.target.clone())
            .collect();
        let layout = answers.values().next().map(|a| a.layout.clone());
        let mut differ = Vec::new();
        let mut groups: HashMap<Vec<u8>, (prost_types::Struct, BTreeMap<u32, u64>)> =
            HashMap::new();
        for (target, answer) in answers {
            let Some(l) = layout.as_ref() else { break };
            if !math::same_buckets(&l.0, &answer.layout.0) {
                differ.push(target);
                continue;
            }
            for h in &answer.histograms {
                let (_, counts) = groups
                    .entry(h.key_bytes.clone())
                    .or_insert_with(|| (h.key.clone().unwrap_or_default(), BTreeMap::new()));
                math::add(counts, h);
            }
        }
        let mut histograms: Vec<pb::Histogram> = match &layout {
            Some(l) => groups
                .into_iter()
                .map(|(key_bytes, (key, counts))| {
                    math::histogram(&l.0, Some(key), key_bytes, &counts)
                })
                .collect(),
            None => Vec::new(),
        };
        histograms.sort_by(|a, b| {
            b.count
                .cmp(&a.count)
                .then_with(|| a.key_bytes.cmp(&b.key_bytes))
        });
        if limit > 0 {
            histograms.truncate(limit as usize);
        }
        Self {
            histograms,
            layout,
            reports,
            missing,
            differ,
        }
    }
}

impl Fleet {
    /// The histograms of `map` on every target, merged exactly (the
    /// buckets of equal groups added; [`FleetHistograms`]): through the
    /// relay, one call it merges; otherwise one call per target, each
    /// waiting at most the fleet's answer timeout.
    pub async fn histogram(&self, map: &MapName, options: HistogramOptions) -> FleetHistograms {
        if let Some(relay) = self.relay.as_ref().filter(|_| !self.targets().is_empty()) {
            return via_relay::histogram(relay, self, map, &options).await;
        }
        let limit = options.limit;
        FleetHistograms::merge(self.histograms(map, options), limit).await
    }

    /// HistogramMap on every target, each target's answer as it comes.
    fn histograms(&self, map: &MapName, options: HistogramOptions) -> FleetRun<Histograms> {
        let timeout = self.options().answer_timeout();
        let map = map.clone();
        self.plan().run(move |client, answers| {
            let (map, options) = (map.clone(), options.clone());
            async move {
                let h = crate::fleet::timed(timeout, client.histogram(&map, options)).await?;
                answers.update(|p| {
                    p.entries = h.histograms.len() as u64;
                    p.scanned = h.summary.as_ref().map_or(0, |s| s.entries_scanned());
                    p.calls = 1;
                });
                answers.send(h).await;
                Ok(())
            }
        })
    }
}

/// Fleet histograms through a relay.
mod via_relay {
    use bpfmap_proto::status::Reason;

    use super::{FleetHistograms, HistogramLayout, HistogramOptions};
    use crate::{
        Fleet, MapName, TargetReport, pb,
        relay::{Deadline, OneAnswer, RelayLink},
    };

    /// One HistogramMap call to the relay: its merged histograms, a report
    /// per target of the fleet (in its order).
    pub(super) async fn histogram(
        link: &RelayLink,
        fleet: &Fleet,
        map: &MapName,
        options: &HistogramOptions,
    ) -> FleetHistograms {
        let req = pb::FleetServiceHistogramMapRequest {
            request: Some(options.request(map)),
            targets: RelayLink::selector(fleet.targets()),
        };
        let started = std::time::Instant::now();
        let deadline = Deadline::start(fleet.options().deadline());
        let mut client = link.client.clone();
        let answer = deadline
            .within(async move { client.histogram_map(deadline.request(req)).await })
            .await
            .map(tonic::Response::into_inner);
        let answer = answer.unwrap_or_else(|e| pb::FleetServiceHistogramMapResponse {
            failed: fleet
                .targets()
                .iter()
                .map(|t| pb::TargetFailure {
                    target: t.as_str().to_owned(),
                    status: Some(pb::TargetStatus {
                        code: crate::code_name(e.code()).to_owned(),
                        reason: String::new(),
                        message: e.to_string(),
                    }),
                })
                .collect(),
            ..Default::default()
        });
        let ends = OneAnswer {
            answered: &answer.answered,
            failed: &answer.failed,
            work: &answer.work,
        };
        let mut reports: Vec<TargetReport> = Vec::new();
        let (mut missing, mut differ) = (Vec::new(), Vec::new());
        for (mut report, status) in ends.reports(fleet.targets(), started) {
            if status.is_some_and(|s| s.reason == Reason::HistogramsDiffer.as_str()) {
                report.error = None;
                differ.push(report.target.clone());
            } else if report.error.is_some() {
                missing.push(report.target.clone());
            }
            reports.push(report);
        }
        FleetHistograms {
            histograms: answer.histograms,
            layout: answer.layout.map(HistogramLayout::from_proto),
            reports,
            missing,
            differ,
        }
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use super::*;

    fn answer(groups: &[(u8, &[(u32, u64)])]) -> Histograms {
        let layout = HistogramLayout::log2();
        let histograms = groups
            .iter()
            .map(|(key, counts)| {
                let counts: BTreeMap<u32, u64> = counts.iter().copied().collect();
                math::histogram(layout.as_proto(), None, vec![*key], &counts)
            })
            .collect();
        Histograms::from_parts(histograms, layout)
    }

    #[test]
    fn an_interval_counts_what_each_bucket_added() {
        let before = answer(&[(1, &[(2, 10), (3, 5)]), (2, &[(0, 4)])]);
        // Group 1 grew in buckets 3 and 5; group 2's bucket 0 went down
        // (its program restarted): its new count; group 3 is new.
        let now = answer(&[
            (1, &[(2, 10), (3, 8), (5, 1)]),
            (2, &[(0, 1)]),
            (3, &[(4, 2)]),
        ]);
        let added = now.since(&before);
        let by_key: BTreeMap<u8, Vec<(u32, u64)>> = added
            .histograms
            .iter()
            .map(|h| {
                (
                    h.key_bytes[0],
                    h.buckets.iter().map(|b| (b.index, b.count)).collect(),
                )
            })
            .collect();
        assert_eq!(by_key[&1], [(3, 3), (4, 0), (5, 1)]);
        assert_eq!(by_key[&2], [(0, 1)]);
        assert_eq!(by_key[&3], [(4, 2)]);
        assert_eq!(added.histograms[0].count, 4);
    }
}
