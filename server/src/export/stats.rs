//! What the daemon says of its exports and of the maps it exposes, as
//! metrics of its registry: each export's series, dropped series, walks,
//! walks a watch served, failures and last walk time, and every exposed
//! map's fill level (map pressure). A collector the composition root
//! registers reads them at every scrape.

use std::sync::{
    Arc, Mutex,
    atomic::{AtomicU64, Ordering},
};

use arc_swap::ArcSwap;
use prometheus_client::{
    collector::Collector,
    encoding::{DescriptorEncoder, EncodeMetric as _},
    metrics::{MetricType, counter::ConstCounter, gauge::ConstGauge},
};

/// The exports' figures and the maps' levels; clones share them.
#[derive(Debug, Clone, Default)]
pub(crate) struct ExportStats(Arc<Inner>);

#[derive(Debug, Default)]
struct Inner {
    /// The figures of the exports in force, in their tables' order.
    exports: ArcSwap<Vec<Arc<Figures>>>,
    /// The last reading of every exposed map.
    levels: Mutex<Arc<Vec<Level>>>,
}

/// One export's figures, updated as its walks end.
#[derive(Debug, Default)]
pub(super) struct Figures {
    /// The export's metric family.
    pub(super) name: String,
    /// Series it serves now.
    pub(super) series: AtomicU64,
    /// Series dropped beyond max_series, in all.
    pub(super) dropped: AtomicU64,
    /// Walks of its map.
    pub(super) walks: AtomicU64,
    /// Walks a watch's scan of the same map served.
    pub(super) shared: AtomicU64,
    /// Walks that failed or took longer than the export's timeout.
    pub(super) failures: AtomicU64,
    /// How long the last walk took, in seconds (f64 bits).
    pub(super) seconds: AtomicU64,
}

impl Figures {
    pub(super) fn new(name: &str) -> Self {
        Self {
            name: name.to_owned(),
            ..Self::default()
        }
    }

    pub(super) fn set_seconds(&self, seconds: f64) {
        self.seconds.store(seconds.to_bits(), Ordering::Relaxed);
    }
}

/// One map's fill level.
#[derive(Debug, Clone)]
pub(super) struct Level {
    pub(super) map: String,
    pub(super) name: String,
    pub(super) kind: String,
    pub(super) max_entries: u64,
    pub(super) memory: u64,
    /// `None` when the map cannot be walked (its type has no dump method)
    /// or its walk failed.
    pub(super) entries: Option<u64>,
}

impl ExportStats {
    /// The exports in force are now these.
    pub(super) fn set_exports(&self, figures: Vec<Arc<Figures>>) {
        self.0.exports.store(Arc::new(figures));
    }

    /// The maps' levels are now these.
    pub(super) fn set_levels(&self, levels: Vec<Level>) {
        *self.0.levels.lock().unwrap_or_else(|e| e.into_inner()) = Arc::new(levels);
    }

    fn levels(&self) -> Arc<Vec<Level>> {
        self.0
            .levels
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }
}

/// One of the exports' own families: name, help, and an export's value.
struct FigureFamily {
    name: &'static str,
    help: &'static str,
    value: fn(&Figures) -> Figure,
}

/// An export's value in one family.
enum Figure {
    Count(u64),
    Level(i64),
    Seconds(f64),
}

fn count(a: &AtomicU64) -> Figure {
    Figure::Count(a.load(Ordering::Relaxed))
}

const FIGURES: [FigureFamily; 6] = [
    FigureFamily {
        name: "bpfmapd_export_series",
        help: "Series an export serves.",
        value: |f| Figure::Level(f.series.load(Ordering::Relaxed) as i64),
    },
    FigureFamily {
        name: "bpfmapd_export_series_dropped",
        help: "Series an export dropped beyond its max_series.",
        value: |f| count(&f.dropped),
    },
    FigureFamily {
        name: "bpfmapd_export_scans",
        help: "Walks of an export's map.",
        value: |f| count(&f.walks),
    },
    FigureFamily {
        name: "bpfmapd_export_shared_scans",
        help: "Walks of an export served by a watch's scan of the same map within its min_interval.",
        value: |f| count(&f.shared),
    },
    FigureFamily {
        name: "bpfmapd_export_scan_failures",
        help: "Walks of an export's map that failed or took longer than its timeout.",
        value: |f| count(&f.failures),
    },
    FigureFamily {
        name: "bpfmapd_export_scan_seconds",
        help: "How long an export's last walk took.",
        value: |f| Figure::Seconds(f64::from_bits(f.seconds.load(Ordering::Relaxed))),
    },
];

/// One of the pressure families: name, help, a map's value.
struct LevelFamily {
    name: &'static str,
    help: &'static str,
    value: fn(&Level) -> Option<u64>,
}

const LEVELS: [LevelFamily; 3] = [
    LevelFamily {
        name: "bpfmapd_map_entries",
        help: "Entries in the map, at the last reading.",
        value: |l| l.entries,
    },
    LevelFamily {
        name: "bpfmapd_map_max_entries",
        help: "The map's max_entries.",
        value: |l| Some(l.max_entries),
    },
    LevelFamily {
        name: "bpfmapd_map_memory_bytes",
        help: "The kernel's memory charge for the map.",
        value: |l| Some(l.memory),
    },
];

impl Collector for ExportStats {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let exports = self.0.exports.load();
        if !exports.is_empty() {
            for family in &FIGURES {
                let kind = match (family.value)(&exports[0]) {
                    Figure::Count(_) => MetricType::Counter,
                    Figure::Level(_) | Figure::Seconds(_) => MetricType::Gauge,
                };
                let mut metric = encoder.encode_descriptor(family.name, family.help, None, kind)?;
                for f in exports.iter() {
                    let labels = [("export", f.name.as_str())];
                    let series = metric.encode_family(&labels)?;
                    match (family.value)(f) {
                        Figure::Count(n) => ConstCounter::new(n).encode(series)?,
                        Figure::Level(n) => ConstGauge::new(n).encode(series)?,
                        Figure::Seconds(s) => ConstGauge::new(s).encode(series)?,
                    }
                }
            }
        }
        let levels = self.levels();
        if levels.is_empty() {
            return Ok(());
        }
        for family in &LEVELS {
            let mut metric =
                encoder.encode_descriptor(family.name, family.help, None, MetricType::Gauge)?;
            for l in levels.iter() {
                let Some(v) = (family.value)(l) else { continue };
                let labels = [
                    ("map", l.map.as_str()),
                    ("name", l.name.as_str()),
                    ("type", l.kind.as_str()),
                ];
                ConstGauge::new(v as i64).encode(metric.encode_family(&labels)?)?;
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::metrics::Metrics;

    #[test]
    fn the_exports_figures_and_the_maps_levels_are_metrics_of_the_registry() {
        let stats = ExportStats::default();
        let metrics = Metrics::new(vec![Box::new(stats.clone())]);
        assert!(
            !metrics.encode().contains("bpfmapd_export"),
            "no export yet"
        );
        let f = Arc::new(Figures::new("ct_bytes"));
        f.series.store(3, Ordering::Relaxed);
        f.walks.store(2, Ordering::Relaxed);
        f.set_seconds(0.25);
        stats.set_exports(vec![f]);
        stats.set_levels(vec![Level {
            map: "demo/flows".into(),
            name: "flows".into(),
            kind: "hash".into(),
            max_entries: 1024,
            memory: 4096,
            entries: Some(7),
        }]);
        let text = metrics.encode();
        for line in [
            "bpfmapd_export_series{export=\"ct_bytes\"} 3",
            "bpfmapd_export_scans_total{export=\"ct_bytes\"} 2",
            "bpfmapd_export_scan_seconds{export=\"ct_bytes\"} 0.25",
            "bpfmapd_export_series_dropped_total{export=\"ct_bytes\"} 0",
            "bpfmapd_map_entries{map=\"demo/flows\",name=\"flows\",type=\"hash\"} 7",
            "bpfmapd_map_max_entries{map=\"demo/flows\",name=\"flows\",type=\"hash\"} 1024",
        ] {
            assert!(text.lines().any(|l| l == line), "{line} not in\n{text}");
        }
        assert!(text.ends_with("# EOF\n"), "{text}");
    }
}
