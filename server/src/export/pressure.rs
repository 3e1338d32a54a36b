//! Map pressure: the fill level of every exposed map (entries, max
//! entries, memory), read in the background every `map_pressure_interval`
//! (counting entries walks each map once) and served from the last reading
//! at every scrape, so a scrape never waits for a walk.

use std::{fmt::Write as _, sync::Arc, time::Duration};

use bpfmap_proto::v1 as pb;
use tokio::sync::watch;

use super::{Inner, count, encode::escape_label, exporter_caller};
use crate::aggregate;

/// One map's fill level.
#[derive(Debug, Clone)]
struct Level {
    map: String,
    name: String,
    kind: String,
    max_entries: u64,
    memory: u64,
    /// `None` when the map cannot be walked (its type has no dump method)
    /// or its walk failed.
    entries: Option<u64>,
}

/// One of the pressure families: name, help, each map's value.
type LevelFamily = (&'static str, &'static str, fn(&Level) -> Option<u64>);

/// The last reading of every map.
#[derive(Debug, Default)]
pub(super) struct Pressure {
    levels: std::sync::Mutex<Arc<Vec<Level>>>,
}

impl Pressure {
    /// Reads every map's level now, then every `every`, until `stop`.
    pub(super) fn spawn(inner: Arc<Inner>, every: Duration, mut stop: watch::Receiver<bool>) {
        tokio::spawn(async move {
            loop {
                let levels = read(&inner).await;
                *inner
                    .pressure
                    .levels
                    .lock()
                    .unwrap_or_else(|e| e.into_inner()) = Arc::new(levels);
                tokio::select! {
                    _ = tokio::time::sleep(every) => {}
                    _ = stop.wait_for(|s| *s) => return,
                }
            }
        });
    }

    /// The last reading, in OpenMetrics text; nothing before the first.
    pub(super) fn write(&self, out: &mut String) {
        let levels = self
            .levels
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone();
        if levels.is_empty() {
            return;
        }
        let families: [LevelFamily; 3] = [
            (
                "bpfmapd_map_entries",
                "Entries in the map, at the last reading",
                |l| l.entries,
            ),
            ("bpfmapd_map_max_entries", "The map's max_entries", |l| {
                Some(l.max_entries)
            }),
            (
                "bpfmapd_map_memory_bytes",
                "The kernel's memory charge for the map",
                |l| Some(l.memory),
            ),
        ];
        for (name, help, value) in families {
            let _ = writeln!(out, "# TYPE {name} gauge\n# HELP {name} {help}.");
            for l in levels.iter() {
                if let Some(v) = value(l) {
                    let _ = writeln!(
                        out,
                        "{name}{{map=\"{}\",name=\"{}\",type=\"{}\"}} {v}",
                        escape_label(&l.map),
                        escape_label(&l.name),
                        escape_label(&l.kind)
                    );
                }
            }
        }
    }
}

/// Every exposed map's level: the listing, and a COUNT walk of each map
/// that can be walked.
async fn read(inner: &Inner) -> Vec<Level> {
    let caller = exporter_caller();
    let listed = match crate::info::list(&inner.calls, &caller, Default::default()).await {
        Ok(l) => l,
        Err(e) => {
            tracing::warn!(error = %e, "map pressure: cannot list the maps");
            return Vec::new();
        }
    };
    let mut levels = Vec::with_capacity(listed.len());
    for info in listed {
        let map = match info.path.as_str() {
            "" => format!("id:{}", info.id),
            p => p.to_owned(),
        };
        let walkable = info.dump_method != pb::DumpMethod::None as i32;
        let entries = if walkable {
            entries_of(inner, &map).await
        } else {
            None
        };
        levels.push(Level {
            map,
            name: info.name,
            kind: info.type_name,
            max_entries: u64::from(info.max_entries),
            memory: info.memlock,
            entries,
        });
    }
    levels
}

/// The number of entries of `map` (one walk), `None` when it fails.
async fn entries_of(inner: &Inner, map: &str) -> Option<u64> {
    let request = crate::wire::map_request(Some(&pb::MapRef {
        r#ref: Some(match map.strip_prefix("id:") {
            Some(id) => pb::map_ref::Ref::Id(id.parse().ok()?),
            None => pb::map_ref::Ref::Path(map.to_owned()),
        }),
        declare: None,
    }))
    .ok()?;
    let req = pb::AggregateMapRequest {
        aggregates: vec![count()],
        ..Default::default()
    };
    let answer = aggregate::run(
        &inner.calls,
        (&inner.dumps, inner.max_groups),
        &exporter_caller(),
        request,
        req,
    )
    .await;
    match answer {
        Ok(a) => a
            .groups
            .first()
            .and_then(|g| g.values.first())
            .and_then(|v| bpfmap_proto::aggregate::parse(v).ok().flatten())
            .and_then(|n| u64::try_from(n).ok())
            .or(Some(0)),
        Err(e) => {
            tracing::debug!(%map, error = %e, "map pressure: cannot count the entries");
            None
        }
    }
}
