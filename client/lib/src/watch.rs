//! Watches: a map's changes, scan by scan, resumed by themselves.
//!
//! A [`Watch`] yields one [`Scan`] per scan of the daemon: the events (or,
//! for an aggregated watch, the groups) and the bookmark that ends it.
//! When the stream breaks it resumes from the last bookmark's cursor with
//! the dump's retry table ([`RetryPolicy`]); the daemon then sends, for
//! every key that changed since, its latest state once, so nothing is
//! missed or repeated. When the daemon cannot serve the cursor (its
//! history no longer reaches back that far, it restarted, the map was
//! replaced), the next scan has [`Scan::resync`] set and holds a fresh
//! initial state: forget what was shown and start again from it.

use std::{collections::BTreeMap, fmt, time::Duration};

use futures::Stream;
use tonic::{Status, Streaming, transport::Channel};

use crate::{
    Aggregate, Error, MapName, PerCpu, RetryPolicy, pb, pb::map_service_client::MapServiceClient,
    resume::Resumer, typed,
};

/// What a watch asks for.
#[derive(Debug, Clone, Default)]
#[non_exhaustive]
pub struct WatchOptions {
    interval: Option<Duration>,
    filter: String,
    fields: Vec<String>,
    group_by: Vec<String>,
    aggregates: Vec<Aggregate>,
    per_cpu: PerCpu,
    render: BTreeMap<String, String>,
    cursor: String,
}

impl WatchOptions {
    /// Time between two scans (the daemon's `limits.min_watch_interval`
    /// at least; its minimum when not set).
    pub fn with_interval(mut self, interval: Duration) -> Self {
        self.interval = Some(interval);
        self
    }

    /// Only entries for which this CEL expression is true (as
    /// [`DumpOptions::with_filter`](crate::DumpOptions::with_filter)).
    pub fn with_filter(mut self, filter: impl Into<String>) -> Self {
        self.filter = filter.into();
        self
    }

    /// Only these members of each entry.
    pub fn with_fields(mut self, fields: impl IntoIterator<Item = impl Into<String>>) -> Self {
        self.fields = fields.into_iter().map(Into::into).collect();
        self
    }

    /// An aggregated watch: groups by these members...
    pub fn with_group_by(mut self, paths: impl IntoIterator<Item = impl Into<String>>) -> Self {
        self.group_by = paths.into_iter().map(Into::into).collect();
        self
    }

    /// ... with these aggregates (their rates come with each scan).
    pub fn with_aggregates(mut self, aggregates: impl IntoIterator<Item = Aggregate>) -> Self {
        self.aggregates = aggregates.into_iter().collect();
        self
    }

    /// How per-CPU values are decoded.
    pub fn with_per_cpu(mut self, per_cpu: PerCpu) -> Self {
        self.per_cpu = per_cpu;
        self
    }

    /// How members are shown ("key.daddr" to "ipv4").
    pub fn with_render<K: AsRef<str>, V: fmt::Display>(
        mut self,
        render: impl IntoIterator<Item = (K, V)>,
    ) -> Self {
        self.render = render
            .into_iter()
            .map(|(k, v)| (k.as_ref().to_owned(), v.to_string()))
            .collect();
        self
    }

    /// Resume after the bookmark that carried this cursor.
    pub fn with_cursor(mut self, cursor: impl Into<String>) -> Self {
        self.cursor = cursor.into();
        self
    }

    fn request(&self, map: &MapName, cursor: &str) -> pb::WatchMapRequest {
        pb::WatchMapRequest {
            map: Some(map.to_proto()),
            interval: self
                .interval
                .and_then(|d| prost_types::Duration::try_from(d).ok()),
            filter: self.filter.clone(),
            fields: self.fields.clone(),
            per_cpu: match self.per_cpu {
                PerCpu::Sum => pb::PerCpu::Sum,
                _ => pb::PerCpu::Each,
            } as i32,
            raw: false,
            cursor: cursor.to_owned(),
            group_by: self.group_by.clone(),
            aggregates: self.aggregates.iter().map(Aggregate::to_proto).collect(),
            render: self.render.clone().into_iter().collect(),
        }
    }
}

/// One scan of a watched map: what changed, and where to resume after it.
#[derive(Debug, Clone)]
pub struct Scan {
    events: Vec<pb::WatchEvent>,
    groups: Vec<pb::WatchGroup>,
    bookmark: pb::Bookmark,
    resync: Option<String>,
}

impl Scan {
    /// The entries that were added, changed or removed (in an initial
    /// state: every entry, as added).
    pub fn events(&self) -> &[pb::WatchEvent] {
        &self.events
    }

    /// An aggregated watch's groups whose values or rates changed.
    pub fn groups(&self) -> &[pb::WatchGroup] {
        &self.groups
    }

    /// The bookmark that ends the scan (its revision, time, cursor).
    pub fn bookmark(&self) -> &pb::Bookmark {
        &self.bookmark
    }

    /// The revision of the scan.
    pub fn revision(&self) -> u64 {
        self.bookmark.revision
    }

    /// The cursor that resumes after this scan.
    pub fn cursor(&self) -> &str {
        &self.bookmark.cursor
    }

    /// Whether this ends an initial state (the first scan, a resync, or the
    /// changes sent on resuming).
    pub fn is_initial(&self) -> bool {
        self.bookmark.initial_state_end
    }

    /// Set when the daemon could not resume from the cursor: why. The scan
    /// then holds a fresh initial state that replaces what came before.
    pub fn resync(&self) -> Option<&str> {
        self.resync.as_deref()
    }

    /// When the daemon started the scan.
    pub fn scan_time(&self) -> Option<std::time::SystemTime> {
        self.bookmark
            .scan_time
            .and_then(|t| std::time::SystemTime::try_from(t).ok())
    }
}

/// A watch in progress: [`Watch::next_scan`] until the caller stops.
#[derive(Debug)]
pub struct Watch {
    client: MapServiceClient<Channel>,
    map: MapName,
    options: WatchOptions,
    resumer: Resumer,
    cursor: String,
    stream: Option<Streaming<pb::WatchMapResponse>>,
    projection: Option<typed::Projection>,
}

impl Watch {
    pub(crate) fn new(
        client: MapServiceClient<Channel>,
        map: MapName,
        options: WatchOptions,
        retry: RetryPolicy,
    ) -> Self {
        Self {
            client,
            map,
            cursor: options.cursor.clone(),
            options,
            resumer: Resumer::new(retry),
            stream: None,
            projection: None,
        }
    }

    /// The cursor of the last scan received (the one given before the
    /// first).
    pub fn cursor(&self) -> &str {
        &self.cursor
    }

    /// How many times the watch resumed after a broken stream.
    pub fn resumes(&self) -> u32 {
        self.resumer.resumes
    }

    /// The failure the watch is retrying after, if it is.
    pub fn last_failure(&self) -> Option<&Status> {
        self.resumer.last_failure.as_ref()
    }

    /// With fields: the projected types, from the daemon's first message.
    pub fn projection(&self) -> Option<&typed::Projection> {
        self.projection.as_ref()
    }

    /// The next scan. Errors are those retrying could not get past (the
    /// retry table of [`RetryPolicy`]); a watch never ends by itself.
    pub async fn next_scan(&mut self) -> Result<Scan, Error> {
        let mut events = Vec::new();
        let mut groups = Vec::new();
        let mut resync = None;
        loop {
            let result = match self.stream.as_mut() {
                Some(stream) => stream.message().await,
                None => {
                    let req = self.options.request(&self.map, &self.cursor);
                    match self.client.watch_map(req).await {
                        Ok(r) => {
                            self.stream = Some(r.into_inner());
                            continue;
                        }
                        Err(status) => Err(status),
                    }
                }
            };
            let status = match result {
                Ok(Some(msg)) => {
                    if let Some(p) = msg.projection {
                        self.projection = Some(typed::Projection::from(p));
                    }
                    if msg.resync {
                        // A fresh state replaces whatever this call sent.
                        events.clear();
                        groups.clear();
                        resync = Some(msg.resync_reason);
                    }
                    events.extend(msg.events);
                    groups.extend(msg.groups);
                    if let Some(bookmark) = msg.bookmark {
                        self.resumer.progressed();
                        self.cursor.clone_from(&bookmark.cursor);
                        return Ok(Scan {
                            events,
                            groups,
                            bookmark,
                            resync,
                        });
                    }
                    continue;
                }
                Ok(None) => Status::unavailable("the watch stream ended"),
                Err(status) => status,
            };
            // What this call sent since its last bookmark comes again.
            self.stream = None;
            events.clear();
            groups.clear();
            // A map too large for the daemon's watch memory stays so.
            let too_large =
                bpfmap_proto::status::reason(&status).as_deref() == Some("WATCH_TOO_LARGE");
            if too_large {
                return Err(status.into());
            }
            let what = format!("the watch stream of map {}", self.map);
            self.resumer.wait(status, &what).await?;
        }
    }

    /// The scans as a stream (it ends after the first error).
    pub fn into_scans(self) -> impl Stream<Item = Result<Scan, Error>> {
        futures::stream::unfold(Some(self), |w| async move {
            let mut w = w?;
            match w.next_scan().await {
                Ok(s) => Some((Ok(s), Some(w))),
                Err(e) => Some((Err(e), None)),
            }
        })
    }
}

/// One target's scan, or why its watch is failing, in a [`FleetWatch`].
#[derive(Debug)]
pub struct FleetScan {
    /// The target.
    pub target: crate::Target,
    /// Its next scan, or the failure its watch is retrying after (or ended
    /// with, when [`FleetScan::ended`]).
    pub scan: Result<Scan, Error>,
    /// The target's watch has ended: the failure cannot be retried
    /// (INVALID_ARGUMENT, PERMISSION_DENIED, NOT_FOUND, ...).
    pub ended: bool,
}

/// Watches of one map on every target of a fleet, each with its own
/// cursor, their scans merged in the order they arrive (for each target,
/// the order of its scans). A target that fails is retried (every 5 s at
/// most, from its last cursor) until its failure cannot be retried; the
/// others go on. Dropping the stream ends every watch.
#[derive(Debug)]
pub struct FleetWatch {
    rx: tokio::sync::mpsc::Receiver<FleetScan>,
    _tasks: Vec<tokio::task::JoinHandle<()>>,
    targets: usize,
}

impl Drop for FleetWatch {
    fn drop(&mut self) {
        for t in &self._tasks {
            t.abort();
        }
    }
}

impl FleetWatch {
    pub(crate) fn start(
        targets: &[crate::Target],
        connect: &crate::ConnectOptions,
        map: &MapName,
        options: &WatchOptions,
        cursors: &std::collections::HashMap<crate::Target, String>,
    ) -> Self {
        let (tx, rx) = tokio::sync::mpsc::channel(targets.len().max(1) * 2);
        let tasks = targets
            .iter()
            .map(|target| {
                let (tx, target, connect, map) =
                    (tx.clone(), target.clone(), connect.clone(), map.clone());
                let mut options = options.clone();
                if let Some(c) = cursors.get(&target) {
                    options.cursor.clone_from(c);
                }
                tokio::spawn(async move { watch_target(target, connect, map, options, tx).await })
            })
            .collect();
        Self {
            rx,
            _tasks: tasks,
            targets: targets.len(),
        }
    }

    /// The number of targets watched.
    pub fn targets(&self) -> usize {
        self.targets
    }

    /// The next scan of any target; `None` once every target's watch has
    /// ended.
    pub async fn next(&mut self) -> Option<FleetScan> {
        self.rx.recv().await
    }

    /// The next round: what arrives from the first item on until every
    /// target still watched has sent one, or `window` has passed (half the
    /// interval suits: each target scans once per interval, at its own
    /// phase); `None` once every target's watch has ended. Rounds follow
    /// the targets' scan times, one per interval.
    pub async fn next_round(&mut self, window: Duration) -> Option<Vec<FleetScan>> {
        let first = self.rx.recv().await?;
        let mut seen = std::collections::HashSet::new();
        seen.insert(first.target.clone());
        let mut round = vec![first];
        let deadline = tokio::time::Instant::now() + window;
        while seen.len() < self.targets {
            match tokio::time::timeout_at(deadline, self.rx.recv()).await {
                Ok(Some(item)) => {
                    seen.insert(item.target.clone());
                    round.push(item);
                }
                Ok(None) | Err(_) => break,
            }
        }
        Some(round)
    }
}

/// The delay before a failing target is watched again.
const FLEET_RETRY: Duration = Duration::from_secs(5);

async fn watch_target(
    target: crate::Target,
    connect: crate::ConnectOptions,
    map: MapName,
    mut options: WatchOptions,
    tx: tokio::sync::mpsc::Sender<FleetScan>,
) {
    let url = target.url(connect.uses_tls());
    loop {
        let client = match crate::Client::connect_lazy(&url, connect.clone()) {
            Ok(c) => c,
            Err(e) => {
                let _ = tx
                    .send(FleetScan {
                        target,
                        scan: Err(e),
                        ended: true,
                    })
                    .await;
                return;
            }
        };
        let mut watch = client.watch(&map, options.clone());
        let error = loop {
            match watch.next_scan().await {
                Ok(scan) => {
                    let item = FleetScan {
                        target: target.clone(),
                        scan: Ok(scan),
                        ended: false,
                    };
                    if tx.send(item).await.is_err() {
                        return;
                    }
                }
                Err(e) => break e,
            }
        };
        options.cursor = watch.cursor().to_owned();
        let ended = !error
            .status()
            .is_some_and(|s| RetryPolicy::should_retry(s) || s.code() == tonic::Code::Aborted);
        if error
            .status()
            .is_some_and(|s| s.code() == tonic::Code::Aborted)
        {
            // The map was replaced: watch the new one from its state.
            options.cursor.clear();
        }
        let item = FleetScan {
            target: target.clone(),
            scan: Err(error),
            ended,
        };
        if tx.send(item).await.is_err() || ended {
            return;
        }
        tokio::time::sleep(FLEET_RETRY).await;
    }
}
