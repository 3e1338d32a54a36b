//! Map pressure: the fill level of every exposed map (entries, max
//! entries, memory), read in the background every `map_pressure_interval`
//! (counting entries walks each map once) and served from the last reading
//! at every scrape, so a scrape never waits for a walk.

use std::{sync::Arc, time::Duration};

use bpfmap_proto::v1 as pb;
use tokio::sync::watch;

use super::{Inner, count, exporter_caller, stats::Level};
use crate::aggregate;

/// Reads every exposed map's level now, then every `every`, until `stop`,
/// into the exports' stats (the registry serves the last reading).
pub(super) fn spawn(inner: Arc<Inner>, every: Duration, mut stop: watch::Receiver<bool>) {
    tokio::spawn(async move {
        loop {
            let levels = read(&inner).await;
            inner.stats.set_levels(levels);
            tokio::select! {
                _ = tokio::time::sleep(every) => {}
                _ = stop.wait_for(|s| *s) => return,
            }
        }
    });
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
    let answer = aggregate::run(inner.aggregator(), &exporter_caller(), request, req).await;
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
