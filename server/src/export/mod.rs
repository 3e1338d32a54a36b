//! `[[export]]`: maps as Prometheus metrics. An export is an aggregate of
//! one map, run by the daemon itself: its labels are group-by members, its
//! value the SUM of a member (for a histogram, of each bucket of an array
//! member) or the COUNT of entries. A scrape within `min_interval` of the
//! last scan is served that scan; a later one walks the map again (one
//! walk at a time per export, whoever scrapes), so series of entries that
//! are gone disappear at the next scan. A watch of the same map whose last
//! scan is that recent serves it instead of a walk. Each export keeps its largest
//! `max_series` series; what it dropped, how long its scans take and
//! whether they fail are metrics of their own. The fill level of every
//! exposed map (map pressure) is served with them (`pressure`).

mod config;
mod encode;
mod names;
mod pressure;
mod stats;

use std::{
    sync::{Arc, atomic::Ordering},
    time::{Duration, Instant},
};

use bpfmap_proto::{
    typed::{MapLayout, MapShape},
    v1 as pb,
};

use crate::{
    aggregate,
    calls::Calls,
    dump::Dumps,
    error::Error,
    model::{Caller, Identity},
    watch::Watches,
};

pub use config::{Buckets, ExportConfig, ExportConfigError, ExportKind};
pub use names::LabelNames;
pub(crate) use stats::ExportStats;

use config::Checked;
use encode::{Bounds, Family, Series, SeriesValue};
use stats::Figures;

/// Buckets summed per walk of a histogram's map (an aggregate takes at
/// most 16 values, one of them the COUNT that orders the series).
const BUCKETS_PER_WALK: usize = 15;

/// The exports of a daemon, replaced whole by a reload.
#[derive(Debug, Clone)]
pub(crate) struct Exporter {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    calls: Calls,
    dumps: Dumps,
    max_groups: usize,
    watches: Arc<Watches>,
    exports: arc_swap::ArcSwap<Vec<Arc<Export>>>,
    stats: ExportStats,
}

impl Inner {
    /// What the exports' walks read maps with.
    fn aggregator(&self) -> aggregate::Aggregator<'_> {
        aggregate::Aggregator {
            calls: &self.calls,
            dumps: &self.dumps,
            max_groups: self.max_groups,
        }
    }
}

/// What exports read maps with, and where their figures go.
#[derive(Debug)]
pub(crate) struct ExporterParts {
    /// What every call starts from.
    pub(crate) calls: Calls,
    /// The dump slots and memory their walks take.
    pub(crate) dumps: Dumps,
    /// limits.max_groups.
    pub(crate) max_groups: usize,
    /// The watches, whose recent scans may serve an export.
    pub(crate) watches: Arc<Watches>,
    /// The exports' figures and the maps' levels, in the registry.
    pub(crate) stats: ExportStats,
}

/// One export, its last walk and its figures.
#[derive(Debug)]
struct Export {
    checked: Checked,
    last: tokio::sync::Mutex<Last>,
    figures: Arc<Figures>,
}

/// What an export's last walk left.
#[derive(Debug, Default)]
struct Last {
    at: Option<Instant>,
    series: Arc<Vec<Series>>,
}

/// Checks `exports` (what start and reload refuse).
pub(crate) fn check(exports: &[ExportConfig]) -> Result<(), ExportConfigError> {
    config::check(exports).map(drop)
}

impl Exporter {
    /// The exports of `configs` (checked), reading maps with `parts`
    /// (through its calls and dump slots, or taking the last scan of a
    /// watch of the same map when it is recent enough).
    pub(crate) fn new(
        configs: &[ExportConfig],
        parts: ExporterParts,
    ) -> Result<Self, ExportConfigError> {
        let exporter = Self {
            inner: Arc::new(Inner {
                calls: parts.calls,
                dumps: parts.dumps,
                max_groups: parts.max_groups,
                watches: parts.watches,
                exports: Default::default(),
                stats: parts.stats,
            }),
        };
        exporter.replace(configs)?;
        Ok(exporter)
    }

    /// Takes the exports of a new configuration (all or none); an export
    /// whose table did not change keeps its last scan and its counts.
    pub(crate) fn replace(&self, configs: &[ExportConfig]) -> Result<(), ExportConfigError> {
        let checked = config::check(configs)?;
        let old = self.inner.exports.load();
        let exports = checked
            .into_iter()
            .map(|c| {
                old.iter()
                    .find(|e| e.checked.config == c.config)
                    .cloned()
                    .unwrap_or_else(|| {
                        Arc::new(Export {
                            figures: Arc::new(Figures::new(&c.family)),
                            checked: c,
                            last: Default::default(),
                        })
                    })
            })
            .collect::<Vec<_>>();
        let figures = exports.iter().map(|e| e.figures.clone()).collect();
        self.inner.exports.store(Arc::new(exports));
        self.inner.stats.set_exports(figures);
        Ok(())
    }

    /// Every export's family, in OpenMetrics text (no `# EOF`); walks end
    /// by `deadline` (the scraper's), the exports not walked by then
    /// served their last walk. Their figures (the registry's) are then
    /// those of this scrape.
    pub(crate) async fn series(&self, deadline: Option<Instant>) -> String {
        let exports = self.inner.exports.load_full();
        let mut out = String::new();
        for e in exports.iter() {
            let series = e.current(&self.inner, deadline).await;
            let c = &e.checked;
            Family {
                name: &c.family,
                help: &c.config.help,
                kind: c.config.kind,
                bounds: Bounds {
                    buckets: c.config.buckets.unwrap_or(Buckets::Exp2),
                    width: c.config.bucket_width,
                },
                label_names: c.labels.iter().map(|(n, _)| n.as_str()).collect(),
                series: &series,
            }
            .write(&mut out);
        }
        out
    }

    /// Reads the fill level of every exposed map every `every` (the first
    /// reading now), for the scrapes, until `stop`.
    pub(crate) fn spawn_pressure(&self, every: Duration, stop: tokio::sync::watch::Receiver<bool>) {
        pressure::spawn(self.inner.clone(), every, stop);
    }
}

impl Export {
    /// The series of the last walk, walking again first when it is older
    /// than `min_interval` and the scrape's `deadline` leaves time for it:
    /// a walk cut by the scrape's deadline leaves the last series served.
    async fn current(&self, inner: &Inner, deadline: Option<Instant>) -> Arc<Vec<Series>> {
        let config = &self.checked.config;
        let mut last = self.last.lock().await;
        let fresh = last.at.is_some_and(|at| at.elapsed() < config.min_interval);
        let left = deadline.map(|d| d.saturating_duration_since(Instant::now()));
        if !fresh && left.is_none_or(|l| !l.is_zero()) {
            let budget = left.map_or(config.timeout, |l| l.min(config.timeout));
            let started = Instant::now();
            let outcome = tokio::time::timeout(budget, self.walk_all(inner)).await;
            let f = &self.figures;
            f.walks.fetch_add(1, Ordering::Relaxed);
            f.set_seconds(started.elapsed().as_secs_f64());
            match outcome {
                Ok(Ok(Walked {
                    series,
                    dropped,
                    shared,
                })) => {
                    last.at = Some(Instant::now());
                    last.series = Arc::new(series);
                    f.dropped.fetch_add(dropped, Ordering::Relaxed);
                    f.shared.fetch_add(u64::from(shared), Ordering::Relaxed);
                }
                Ok(Err(e)) => {
                    last.at = Some(Instant::now());
                    self.failed(&mut last, &e.to_string());
                }
                Err(_) if budget < config.timeout => {
                    f.failures.fetch_add(1, Ordering::Relaxed);
                    tracing::warn!(
                        export = %self.checked.family,
                        "export: the scrape's deadline cut the walk; the last series are served"
                    );
                }
                Err(_) => {
                    last.at = Some(Instant::now());
                    self.failed(
                        &mut last,
                        &format!("the walk took longer than {:?}", config.timeout),
                    );
                }
            }
        }
        let series = last.series.len() as u64;
        self.figures.series.store(series, Ordering::Relaxed);
        last.series.clone()
    }

    /// A failed walk: no series (the map's entries are not known), logged.
    fn failed(&self, last: &mut Last, why: &str) {
        self.figures.failures.fetch_add(1, Ordering::Relaxed);
        last.series = Arc::new(Vec::new());
        tracing::warn!(
            export = %self.checked.family,
            map = %self.checked.config.map,
            error = %why,
            "export: cannot walk the map"
        );
    }

    /// Walks the map (or takes a watch's recent scan of it): its series
    /// (the largest `max_series`), and how many it dropped.
    async fn walk_all(&self, inner: &Inner) -> Result<Walked, Error> {
        let c = &self.checked;
        let value = c.config.value.clone();
        let plans: Vec<Vec<pb::Aggregate>> = match (c.config.kind, value) {
            (ExportKind::Histogram, Some(v)) => {
                let slots = self.slots(inner, &v).await?;
                (0..slots)
                    .collect::<Vec<_>>()
                    .chunks(BUCKETS_PER_WALK)
                    .map(|chunk| {
                        let sums = chunk.iter().map(|i| sum(&format!("{v}[{i}]")));
                        std::iter::once(count()).chain(sums).collect()
                    })
                    .collect()
            }
            (_, Some(v)) => vec![vec![sum(&v)]],
            (_, None) => vec![vec![count()]],
        };
        let mut merged: Vec<(Vec<u8>, Vec<String>, Vec<i128>)> = Vec::new();
        let mut lookups = names::Lookups::default();
        let (mut dropped, mut shared) = (0, true);
        for aggregates in plans {
            let histogram = c.config.kind == ExportKind::Histogram;
            let (answer, watched) = self.walk(inner, aggregates).await?;
            shared &= watched;
            let total = answer.summary.map_or(0, |s| s.groups_total);
            dropped = total.saturating_sub(answer.groups.len() as u64);
            for (i, g) in answer.groups.into_iter().enumerate() {
                let values = values_of(&g, histogram)?;
                let known = merged.len();
                match merged.get_mut(i) {
                    Some(m) if m.0 == g.key_bytes => m.2.extend(values),
                    None if known == i => {
                        let labels = self.labels_of(&g, &mut lookups);
                        merged.push((g.key_bytes, labels, values));
                    }
                    _ => {
                        return Err(Error::Internal {
                            map: None,
                            message: "the histogram's walks found other series".into(),
                        });
                    }
                }
            }
        }
        let series = merged
            .into_iter()
            .map(|(_, labels, values)| Series {
                labels,
                value: match c.config.kind {
                    ExportKind::Histogram => SeriesValue::Buckets(values),
                    _ => SeriesValue::Number(values.first().copied().unwrap_or(0)),
                },
            })
            .collect();
        Ok(Walked {
            series,
            dropped,
            shared,
        })
    }

    /// One AggregateMap walk of the export's map, as the daemon itself,
    /// or over the last scan of a watch of the map when that scan started
    /// within `min_interval` (true then).
    async fn walk(
        &self,
        inner: &Inner,
        aggregates: Vec<pb::Aggregate>,
    ) -> Result<(pb::AggregateMapResponse, bool), Error> {
        let c = &self.checked;
        let req = pb::AggregateMapRequest {
            map: None,
            filter: c.config.filter.clone(),
            group_by: c.labels.iter().map(|(_, p)| p.clone()).collect(),
            aggregates,
            order_by: 0,
            ascending: false,
            limit: u32::try_from(c.config.max_series).unwrap_or(u32::MAX),
            per_cpu: pb::PerCpu::Sum as i32,
            threshold: String::new(),
            groups: Vec::new(),
            render: c.config.render.clone().into_iter().collect(),
            scan: pb::ScanMethod::ScanAuto as i32,
        };
        let caller = exporter_caller();
        let prepared = aggregate::prepare(inner.aggregator(), &caller, c.map.clone(), req).await?;
        let watched = inner.watches.fresh(prepared.meta(), c.config.min_interval);
        let shared = watched.is_some();
        Ok((prepared.run(watched).await?, shared))
    }

    /// The number of buckets of a histogram's array member `path`.
    async fn slots(&self, inner: &Inner, path: &str) -> Result<usize, Error> {
        let caller = exporter_caller();
        let info = crate::info::get(&inner.calls, &caller, self.checked.map.clone()).await?;
        let shape = MapShape::new(info.key_size as usize, info.value_size as usize);
        let layout = MapLayout::new(info.key_type.as_ref(), info.value_type.as_ref(), shape)
            .map_err(|e| Error::InvalidArgument(format!("the map's types: {e}")))?;
        let member = layout
            .member(path)
            .map_err(|e| Error::InvalidArgument(e.to_string()))?;
        match member.describe().and_then(|t| t.kind) {
            Some(pb::type_info::Kind::Array(a)) if a.length > 0 => Ok(a.length as usize),
            _ => Err(Error::InvalidArgument(format!(
                "{path} is a {}, not an array of counts per bucket",
                member.type_name()
            ))),
        }
    }

    /// A group's label values, in the export's label order, named as the
    /// table says.
    fn labels_of(&self, g: &pb::Group, lookups: &mut names::Lookups) -> Vec<String> {
        let fields = g.key.as_ref().map(|k| &k.fields);
        self.checked
            .labels
            .iter()
            .map(|(_, path)| {
                let value = fields
                    .and_then(|f| f.get(path))
                    .map(label_value)
                    .unwrap_or_default();
                match self.checked.config.names.get(path) {
                    Some(names) => lookups.name(names, &value),
                    None => value,
                }
            })
            .collect()
    }
}

/// What one walk of an export found.
struct Walked {
    series: Vec<Series>,
    /// Series beyond max_series.
    dropped: u64,
    /// Whether a watch's scan served it.
    shared: bool,
}

/// Who reads the maps of exports: the daemon itself, which the policy does
/// not restrict (the operator chose the maps).
fn exporter_caller() -> Caller {
    Caller {
        identity: Identity::Daemon,
        peer: None,
        process: None,
    }
}

fn count() -> pb::Aggregate {
    pb::Aggregate {
        op: pb::aggregate::Op::Count as i32,
        field: String::new(),
    }
}

fn sum(path: &str) -> pb::Aggregate {
    pb::Aggregate {
        op: pb::aggregate::Op::Sum as i32,
        field: path.to_owned(),
    }
}

/// A group's values as integers: a histogram's walk without its leading
/// COUNT.
fn values_of(g: &pb::Group, histogram: bool) -> Result<Vec<i128>, Error> {
    let skip = usize::from(histogram);
    g.values
        .iter()
        .skip(skip)
        .map(|v| {
            bpfmap_proto::aggregate::parse(v)
                .map(|n| n.unwrap_or(0))
                .map_err(|e| Error::Internal {
                    map: None,
                    message: format!("an aggregate's value: {e}"),
                })
        })
        .collect()
}

/// A decoded member as a label value: text as it is, numbers without a
/// fraction when they have none.
fn label_value(v: &prost_types::Value) -> String {
    use prost_types::value::Kind;
    match &v.kind {
        Some(Kind::StringValue(s)) => s.clone(),
        Some(Kind::NumberValue(n)) if n.fract() == 0.0 && n.abs() < 1e15 => {
            format!("{}", *n as i64)
        }
        Some(Kind::NumberValue(n)) => n.to_string(),
        Some(Kind::BoolValue(b)) => b.to_string(),
        Some(Kind::NullValue(_)) | None => String::new(),
        Some(other) => format!("{other:?}"),
    }
}
