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
use tonic::{Status, Streaming};

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
    raw: bool,
}

impl WatchOptions {
    /// The options of a `WatchMapRequest` as a caller wrote it (its map
    /// aside), for a program that forwards requests (a relay): every field
    /// goes to the daemon as it came, `raw` included; INVALID_ARGUMENT for
    /// an aggregate that is not one.
    pub fn from_proto(req: &pb::WatchMapRequest) -> Result<Self, Error> {
        Ok(Self {
            interval: req
                .interval
                .and_then(|d| Duration::try_from(d).ok())
                .filter(|d| !d.is_zero()),
            filter: req.filter.clone(),
            fields: req.fields.clone(),
            group_by: req.group_by.clone(),
            aggregates: req
                .aggregates
                .iter()
                .map(Aggregate::from_proto)
                .collect::<Result<_, _>>()?,
            per_cpu: if req.per_cpu == pb::PerCpu::Sum as i32 {
                PerCpu::Sum
            } else {
                PerCpu::Each
            },
            render: req.render.clone().into_iter().collect(),
            cursor: req.cursor.clone(),
            raw: req.raw,
        })
    }

    /// The interval asked, if any.
    pub fn interval(&self) -> Option<Duration> {
        self.interval
    }

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

    /// How members are shown ("key.daddr" to "ipv4"), over the daemon's
    /// configured renderings; repeated calls add up (a later one wins for
    /// the same member), as for every call's options.
    pub fn with_render<K: AsRef<str>, V: fmt::Display>(
        mut self,
        render: impl IntoIterator<Item = (K, V)>,
    ) -> Self {
        self.render.extend(typed::render_map(render));
        self
    }

    /// Resume after the bookmark that carried this cursor.
    pub fn with_cursor(mut self, cursor: impl Into<String>) -> Self {
        self.cursor = cursor.into();
        self
    }

    /// Entries (or a projection's records) as bytes only, not decoded by
    /// the daemon: for a caller that decodes them itself, through the map's
    /// types (or the projection's). Renderings need the daemon's decoding:
    /// a raw watch that asks for some is INVALID_ARGUMENT.
    pub fn with_raw(mut self, raw: bool) -> Self {
        self.raw = raw;
        self
    }

    /// The cursor to start from.
    pub(crate) fn cursor(&self) -> &str {
        &self.cursor
    }

    pub(crate) fn request(&self, map: &MapName, cursor: &str) -> pb::WatchMapRequest {
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
            raw: self.raw,
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
    projection: Option<pb::Projection>,
}

impl Scan {
    /// A scan from the messages that carry it (the last with its
    /// bookmark), as a relay forwards them.
    pub(crate) fn from_parts(parts: Vec<pb::WatchMapResponse>) -> Self {
        let mut scan = Scan {
            events: Vec::new(),
            groups: Vec::new(),
            bookmark: pb::Bookmark::default(),
            resync: None,
            projection: None,
        };
        for part in parts {
            if part.resync {
                scan.resync = Some(part.resync_reason);
            }
            if part.projection.is_some() {
                scan.projection = part.projection;
            }
            scan.events.extend(part.events);
            scan.groups.extend(part.groups);
            if let Some(b) = part.bookmark {
                scan.bookmark = b;
            }
        }
        scan
    }

    /// The scan as one message of the daemon's protocol (events or groups,
    /// its bookmark, the resync and the projection it came with), for a
    /// program that forwards scans (a relay).
    pub fn into_proto(self) -> pb::WatchMapResponse {
        pb::WatchMapResponse {
            events: self.events,
            groups: self.groups,
            bookmark: Some(self.bookmark),
            resync: self.resync.is_some(),
            resync_reason: self.resync.unwrap_or_default(),
            projection: self.projection,
        }
    }

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

    /// The projection its records are made of (a watch with fields), on
    /// the first scan of a watch.
    pub fn projection(&self) -> Option<typed::Projection> {
        self.projection.clone().map(typed::Projection::from)
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
    client: MapServiceClient<crate::transport::Transport>,
    map: MapName,
    options: WatchOptions,
    resumer: Resumer,
    cursor: String,
    stream: Option<Streaming<pb::WatchMapResponse>>,
    projection: Option<typed::Projection>,
}

impl Watch {
    pub(crate) fn new(
        client: MapServiceClient<crate::transport::Transport>,
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
        let mut projection = None;
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
                        self.projection = Some(typed::Projection::from(p.clone()));
                        projection = Some(p);
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
                            projection,
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
            use bpfmap_proto::status::{Reason, reason};
            let too_large = reason(&status).as_deref() == Some(Reason::WatchTooLarge.as_str());
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
