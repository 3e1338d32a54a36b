//! One WatchMap call: the initial state (or the changes since its cursor),
//! then each scan's changes as this watch sees them (its filter, its
//! members, its decoding), with deltas and rates; or, for an aggregated
//! watch, the groups that changed.

use std::{
    collections::HashMap,
    sync::{Arc, atomic::Ordering},
    time::Duration,
};

use bpfmap_kernel::{MapMeta, walk::Chunk};
use bpfmap_proto::v1 as pb;

use super::{
    Ticket, WatchStats,
    scanner::{Scan, Scanner},
    state::Kind,
};
use crate::{
    cursor::Sealer,
    error::Error,
    maps::Decoder,
    query::{Acc, Counter, EntryRef, Filter, Projection, Spec},
    wire,
    wire::feed::{self, Fed, Feed},
};

/// Entries a message of events holds at most (it also stays below
/// [`MESSAGE_BYTES`]).
const MESSAGE_ENTRIES: usize = 4096;
/// Encoded bytes after which a message of events is sent.
const MESSAGE_BYTES: usize = 256 << 10;
/// Slots of the state copied per turn of the lock, for an initial state.
const SLOTS_PER_READ: usize = 4096;
/// Messages queued to the client beyond the one being sent.
const DEPTH: usize = 2;

/// What a watch asks, checked against the map when the call started.
#[derive(Debug)]
pub(crate) struct Watch {
    pub(crate) meta: MapMeta,
    pub(crate) filter: Option<Filter>,
    pub(crate) projection: Option<Projection>,
    /// Describes projected records (when there is a projection).
    pub(crate) projected: Option<MapMeta>,
    /// How entries are decoded (none: raw).
    pub(crate) decoder: Option<Decoder>,
    /// The integer members deltas are computed of.
    pub(crate) counters: Vec<Counter>,
    /// An aggregated watch's groups and aggregates.
    pub(crate) aggregate: Option<Spec>,
    pub(crate) sealer: Sealer,
    /// The scan the cursor was issued after, and by which scanner.
    pub(crate) resume: Option<(u64, u64)>,
    /// Why the cursor cannot be served (a resync), if it cannot.
    pub(crate) resync: Option<String>,
    pub(crate) stall_timeout: Duration,
    /// What decides the events (filter, fields, decoding): watches with the
    /// same share each scan's events.
    pub(crate) events_key: [u8; 16],
}

/// A watch cursor's position: the scanner's epoch and the revision.
pub(crate) fn position(epoch: u64, revision: u64) -> Vec<u8> {
    let mut t = Vec::with_capacity(17);
    t.push(b'W');
    t.extend_from_slice(&epoch.to_le_bytes());
    t.extend_from_slice(&revision.to_le_bytes());
    t
}

/// The epoch and revision of a watch cursor's position.
pub(crate) fn parse_position(t: &[u8]) -> Option<(u64, u64)> {
    if t.len() != 17 || t[0] != b'W' {
        return None;
    }
    Some((
        u64::from_le_bytes(t[1..9].try_into().ok()?),
        u64::from_le_bytes(t[9..17].try_into().ok()?),
    ))
}

/// The response stream of a WatchMap call.
pub(crate) type WatchStream = Fed<pb::WatchMapResponse>;

/// One change as a watch sees it.
struct Seen<'a> {
    kind: Kind,
    key: &'a [u8],
    value: &'a [u8],
    prev: Option<&'a [u8]>,
}

/// Why a watcher stops.
enum Stop {
    /// The client went away.
    Gone,
    /// An error to end the stream with.
    Error(Error),
    /// The watcher fell behind the history: start again.
    Behind(String),
}

impl From<Error> for Stop {
    fn from(e: Error) -> Self {
        Self::Error(e)
    }
}

/// Starts the watcher of a call; the audit record is finished when the
/// stream ends.
pub(crate) fn spawn(
    watch: Watch,
    ticket: Ticket,
    stats: Arc<WatchStats>,
    mut audit: crate::access::Record,
) -> WatchStream {
    let (tx, stream) = feed::channel(DEPTH);
    tokio::spawn(async move {
        let mut w = Watcher {
            watch: Arc::new(watch),
            scanner: ticket.scanner().clone(),
            tx,
            stats,
            sent: 0,
        };
        let result = w.run().await;
        audit.add_entries(w.sent);
        // A watch ends only when its client goes away, or with an error.
        let Watcher { tx, .. } = w;
        audit.finish(tx.finish(result, tonic::Code::Cancelled));
        drop(ticket);
    });
    stream
}

struct Watcher {
    watch: Arc<Watch>,
    scanner: Arc<Scanner>,
    tx: Feed<pb::WatchMapResponse>,
    stats: Arc<WatchStats>,
    sent: u64,
}

/// Messages being filled for the client.
#[derive(Default)]
struct Out {
    msg: pb::WatchMapResponse,
    bytes: usize,
    count: usize,
}

impl Watcher {
    /// Ok when the client went away; the error to end the stream with
    /// otherwise.
    async fn run(&mut self) -> Result<(), Error> {
        let mut first = pb::WatchMapResponse::default();
        if let Some(p) = &self.watch.projection {
            first.projection = Some(crate::query::projection_message(p));
        }
        let mut out = Out {
            msg: first,
            ..Out::default()
        };
        let mut resync = self.watch.resync.clone();
        let mut from = None;
        if resync.is_none()
            && let Some((epoch, revision)) = self.watch.resume
        {
            if epoch != self.scanner.epoch {
                resync = Some("the daemon restarted, or stopped watching this map, since this cursor was issued".into());
            } else if self.watch.aggregate.is_some() {
                resync = Some("an aggregated watch resumes with its groups' current values".into());
            } else {
                from = Some(revision);
            }
        }
        loop {
            let result = match (resync.take(), from.take()) {
                (None, Some(revision)) => match self.catch_up(revision, &mut out).await {
                    Err(Stop::Behind(_)) => Err(Stop::Behind(
                        "this cursor is older than the changes the server keeps (limits.watch_history_scans and watch_history_bytes)".into(),
                    )),
                    r => r,
                },
                (why, _) => {
                    if let Some(why) = why {
                        self.stats.resyncs.fetch_add(1, Ordering::Relaxed);
                        out.msg.resync = true;
                        out.msg.resync_reason = why;
                    }
                    if self.watch.aggregate.is_some() {
                        self.groups(&mut out).await
                    } else {
                        self.initial(&mut out).await
                    }
                }
            };
            let revision = match result {
                Ok(r) => r,
                Err(Stop::Gone) => return Ok(()),
                Err(Stop::Error(e)) => return Err(e),
                Err(Stop::Behind(why)) => {
                    resync = Some(why);
                    out = Out::default();
                    continue;
                }
            };
            if self.watch.aggregate.is_some() {
                // An aggregated watch goes on in `groups`, which returns
                // only when it stops.
                let _ = revision;
                return Ok(());
            }
            match self.live(revision, &mut out).await {
                Ok(()) | Err(Stop::Gone) => return Ok(()),
                Err(Stop::Error(e)) => return Err(e),
                Err(Stop::Behind(why)) => {
                    resync = Some(why);
                    out = Out::default();
                }
            }
        }
    }

    async fn send(&mut self, msg: pb::WatchMapResponse) -> Result<(), Stop> {
        match self.tx.send(msg, self.watch.stall_timeout).await {
            Ok(()) => Ok(()),
            Err(Error::Cancelled) => Err(Stop::Gone),
            Err(e) => Err(Stop::Error(e)),
        }
    }

    /// Adds an event (or a group) to the message, sending it when full.
    async fn push_event(&mut self, out: &mut Out, e: pb::WatchEvent) -> Result<(), Stop> {
        out.bytes += prost::Message::encoded_len(&e);
        out.count += 1;
        out.msg.events.push(e);
        self.sent += 1;
        self.flush_if_full(out).await
    }

    async fn push_group(&mut self, out: &mut Out, g: pb::WatchGroup) -> Result<(), Stop> {
        out.bytes += prost::Message::encoded_len(&g);
        out.count += 1;
        out.msg.groups.push(g);
        self.sent += 1;
        self.flush_if_full(out).await
    }

    async fn flush_if_full(&mut self, out: &mut Out) -> Result<(), Stop> {
        if out.bytes >= MESSAGE_BYTES || out.count >= MESSAGE_ENTRIES {
            let msg = std::mem::take(&mut out.msg);
            out.bytes = 0;
            out.count = 0;
            self.send(msg).await?;
        }
        Ok(())
    }

    /// Sends the message with the bookmark of `revision`.
    async fn bookmark(
        &mut self,
        out: &mut Out,
        revision: u64,
        events: u64,
        initial: bool,
    ) -> Result<(), Stop> {
        let scan = self.scanner.scan(revision);
        let cursor = self
            .watch
            .sealer
            .seal(&bpfmap_kernel::walk::Position::After(position(
                self.scanner.epoch,
                revision,
            )));
        out.msg.bookmark = Some(pb::Bookmark {
            revision,
            cursor,
            scan_time: scan.as_ref().map(|s| prost_types::Timestamp::from(s.time)),
            scan_duration: scan
                .as_ref()
                .and_then(|s| prost_types::Duration::try_from(s.duration).ok()),
            entries_scanned: scan.as_ref().map_or(0, |s| s.scanned),
            events_sent: events,
            initial_state_end: initial,
        });
        self.stats.events.fetch_add(events, Ordering::Relaxed);
        let msg = std::mem::take(&mut out.msg);
        out.bytes = 0;
        out.count = 0;
        self.send(msg).await
    }

    fn matches(&self, key: &[u8], value: &[u8]) -> bool {
        let stride = if self.watch.meta.per_cpu() {
            self.watch.meta.cpu_stride()
        } else {
            0
        };
        self.watch
            .filter
            .as_ref()
            .is_none_or(|f| f.matches(&EntryRef { key, value, stride }))
    }

    /// What a change is to this watch (its filter), if anything.
    fn see<'a>(
        &self,
        kind: Kind,
        key: &'a [u8],
        value: &'a [u8],
        prev: Option<&'a [u8]>,
    ) -> Option<Seen<'a>> {
        let kind = match kind {
            Kind::Added => self.matches(key, value).then_some(Kind::Added)?,
            Kind::Removed => self.matches(key, value).then_some(Kind::Removed)?,
            Kind::Changed => {
                let before = self.matches(key, prev.expect("a changed entry's previous value"));
                match (before, self.matches(key, value)) {
                    (true, true) => Kind::Changed,
                    (false, true) => Kind::Added,
                    (true, false) => Kind::Removed,
                    (false, false) => return None,
                }
            }
        };
        Some(Seen {
            kind,
            key,
            value,
            prev: if kind == Kind::Changed { prev } else { None },
        })
    }

    /// What this watch shows of `seen`: the entries (projected, when it
    /// has a projection), the layout that describes them, and the previous
    /// values as shown.
    fn shown(&self, seen: &[Seen<'_>]) -> (Chunk, &MapMeta, Vec<Option<Vec<u8>>>) {
        let w = &self.watch;
        let meta = &w.meta;
        let (ks, vs) = (meta.key_size as usize, meta.kernel_value_size());
        let mut chunk = Chunk {
            count: seen.len(),
            keys: Vec::with_capacity(seen.len() * ks),
            values: Vec::with_capacity(seen.len() * vs),
        };
        for s in seen {
            chunk.keys.extend_from_slice(s.key);
            chunk.values.extend_from_slice(s.value);
        }
        let stride = if meta.per_cpu() { meta.cpu_stride() } else { 0 };
        match &w.projection {
            Some(p) => {
                let (mut keys, mut values) = (Vec::new(), Vec::new());
                let entry = |key, value| EntryRef { key, value, stride };
                for s in seen {
                    p.write(&entry(s.key, s.value), &mut keys, &mut values);
                }
                if !p.selects_key() {
                    keys = chunk.keys;
                }
                let mut prevs = Vec::with_capacity(seen.len());
                for s in seen {
                    prevs.push(s.prev.map(|prev| {
                        let (mut k, mut v) = (Vec::new(), Vec::new());
                        p.write(&entry(s.key, prev), &mut k, &mut v);
                        v
                    }));
                }
                let c = Chunk {
                    count: seen.len(),
                    keys,
                    values,
                };
                (c, w.projected.as_ref().unwrap_or(meta), prevs)
            }
            None => (
                chunk,
                meta,
                seen.iter().map(|s| s.prev.map(<[u8]>::to_vec)).collect(),
            ),
        }
    }

    /// Events for `seen` (in order), with deltas over `secs` seconds.
    fn events(&self, seen: &[Seen<'_>], secs: f64) -> Vec<pb::WatchEvent> {
        let w = &self.watch;
        let (chunk, shown_meta, prevs) = self.shown(seen);
        let value_stride = if shown_meta.per_cpu() {
            shown_meta.cpu_stride()
        } else {
            0
        };
        let svs = shown_meta.kernel_value_size();
        let sks = shown_meta.key_size as usize;
        let mut entries = wire::entries(shown_meta, &chunk, w.decoder.as_ref());
        if w.decoder.is_some() && w.projection.is_some() {
            for e in &mut entries {
                e.key = Vec::new();
                e.value = Vec::new();
                e.per_cpu_values = Vec::new();
            }
        }
        let mut out = Vec::with_capacity(entries.len());
        for (i, (entry, s)) in entries.into_iter().zip(seen).enumerate() {
            let mut ev = pb::WatchEvent {
                r#type: match s.kind {
                    Kind::Added => pb::EventType::Added,
                    Kind::Changed => pb::EventType::Changed,
                    Kind::Removed => pb::EventType::Removed,
                } as i32,
                entry: Some(entry),
                ..Default::default()
            };
            if let (Some(prev), true) = (&prevs[i], w.decoder.is_some()) {
                let now = EntryRef {
                    key: &chunk.keys[i * sks..(i + 1) * sks],
                    value: &chunk.values[i * svs..(i + 1) * svs],
                    stride: value_stride,
                };
                let before = EntryRef {
                    key: now.key,
                    value: prev,
                    stride: value_stride,
                };
                deltas(&w.counters, &now, &before, secs, &mut ev);
            }
            out.push(ev);
        }
        out
    }

    /// Whether a change to an entry changes what this watch shows of it.
    fn shows_change(&self, s: &Seen<'_>) -> bool {
        let (Some(p), Some(prev), Kind::Changed) = (&self.watch.projection, s.prev, s.kind) else {
            return true;
        };
        let stride = if self.watch.meta.per_cpu() {
            self.watch.meta.cpu_stride()
        } else {
            0
        };
        let (mut k, mut a, mut b) = (Vec::new(), Vec::new(), Vec::new());
        let entry = |value| EntryRef {
            key: s.key,
            value,
            stride,
        };
        p.write(&entry(s.value), &mut k, &mut a);
        k.clear();
        p.write(&entry(prev), &mut k, &mut b);
        a != b
    }

    /// Sends events for `seen`, in messages of bounded size.
    async fn send_seen(
        &mut self,
        out: &mut Out,
        seen: Vec<Seen<'_>>,
        secs: f64,
    ) -> Result<u64, Stop> {
        let seen: Vec<Seen<'_>> = seen.into_iter().filter(|s| self.shows_change(s)).collect();
        let mut n = 0u64;
        for part in seen.chunks(MESSAGE_ENTRIES) {
            for e in self.events(part, secs) {
                self.push_event(out, e).await?;
                n += 1;
            }
        }
        Ok(n)
    }

    /// The initial state: every entry as ADDED, read from the scanner's
    /// state a part at a time, with the changes of scans made meanwhile to
    /// the parts already sent; returns the revision it ends at.
    async fn initial(&mut self, out: &mut Out) -> Result<u64, Stop> {
        let mut p = 0usize;
        // (revision, progress): scans up to this revision (after the one
        // before) were applied when the first `progress` slots were sent.
        let mut cuts: Vec<(u64, usize)> = Vec::new();
        let mut first: Option<u64> = None;
        let mut sent = 0u64;
        loop {
            let (keys, values, done, r) = {
                let locked = self.scanner.state.lock().await;
                let r = locked.revision;
                match first {
                    None => first = Some(r),
                    Some(_) if cuts.last().map_or(first, |c| Some(c.0)) < Some(r) => {
                        cuts.push((r, p));
                    }
                    Some(_) => {}
                }
                let end = (p + SLOTS_PER_READ).min(locked.state.slots());
                let (mut keys, mut values) = (Vec::new(), Vec::new());
                for slot in p..end {
                    if let Some((k, v)) = locked.state.get(slot) {
                        keys.extend_from_slice(k);
                        values.extend_from_slice(v);
                    }
                }
                p = end;
                (keys, values, end >= locked.state.slots(), r)
            };
            let meta = &self.watch.meta;
            let (ks, vs) = (meta.key_size as usize, meta.kernel_value_size());
            let n = keys.len() / ks.max(1);
            let seen: Vec<Seen<'_>> = (0..n)
                .filter_map(|i| {
                    self.see(
                        Kind::Added,
                        &keys[i * ks..(i + 1) * ks],
                        &values[i * vs..(i + 1) * vs],
                        None,
                    )
                })
                .collect();
            sent += self.send_seen(out, seen, 0.0).await?;
            if done {
                let start = first.unwrap_or(r);
                let end = cuts.last().map_or(start, |c| c.0);
                if end > start {
                    let scans = self
                        .scanner
                        .scans_after(start)
                        .ok_or_else(|| Stop::Behind(BEHIND.into()))?;
                    for scan in scans.iter().filter(|s| s.revision <= end) {
                        let cut = cuts
                            .iter()
                            .find(|c| c.0 >= scan.revision)
                            .map_or(usize::MAX, |c| c.1);
                        sent += self.send_scan(out, scan, Some(cut)).await?;
                    }
                }
                self.bookmark(out, end, sent, true).await?;
                return Ok(end);
            }
        }
    }

    /// The events of one scan (of its changes to slots below `cut`, if
    /// given).
    async fn send_scan(
        &mut self,
        out: &mut Out,
        scan: &Scan,
        cut: Option<usize>,
    ) -> Result<u64, Stop> {
        // Watchers that ask the same share a scan's events: built once.
        let shared = cut
            .is_none()
            .then(|| scan.shared_events(&self.watch.events_key));
        if let Some(Some(events)) = &shared {
            for e in events.iter() {
                self.push_event(out, e.clone()).await?;
            }
            return Ok(events.len() as u64);
        }
        let c = &scan.changes;
        let seen: Vec<Seen<'_>> = c
            .list
            .iter()
            .filter(|ch| cut.is_none_or(|cut| (ch.slot as usize) < cut))
            .filter_map(|ch| {
                let (k, v, prev) = c.parts(ch);
                self.see(ch.kind, k, v, prev)
            })
            .filter(|s| self.shows_change(s))
            .collect();
        let secs = scan.secs();
        let mut events = Vec::with_capacity(seen.len());
        for part in seen.chunks(MESSAGE_ENTRIES) {
            events.extend(self.events(part, secs));
        }
        let events = Arc::new(events);
        if shared.is_some() {
            scan.share_events(self.watch.events_key, events.clone());
        }
        for e in events.iter() {
            self.push_event(out, e.clone()).await?;
        }
        Ok(events.len() as u64)
    }

    /// After a cursor: every key that changed since `revision`, once, in
    /// its latest state; returns the revision it ends at.
    async fn catch_up(&mut self, revision: u64, out: &mut Out) -> Result<u64, Stop> {
        let scans = self
            .scanner
            .scans_after(revision)
            .ok_or_else(|| Stop::Behind(BEHIND.into()))?;
        let Some(last) = scans.last() else {
            self.bookmark(out, revision, 0, true).await?;
            return Ok(revision);
        };
        let end = last.revision;
        // Per key: its value at `revision` (none: absent) and now.
        let mut order: Vec<&[u8]> = Vec::new();
        let mut keys: HashMap<&[u8], Span<'_>> = HashMap::new();
        for scan in &scans {
            let c = &scan.changes;
            for ch in &c.list {
                let (k, v, prev) = c.parts(ch);
                let e = keys.entry(k).or_insert_with(|| {
                    order.push(k);
                    let before = match ch.kind {
                        Kind::Added => None,
                        Kind::Changed => prev,
                        Kind::Removed => Some(v),
                    };
                    (before, None)
                });
                e.1 = (ch.kind != Kind::Removed).then_some(v);
            }
        }
        let secs = match (scans.first().and_then(|s| s.since), last.at) {
            (Some(since), at) => at.saturating_duration_since(since).as_secs_f64(),
            (None, _) => 0.0,
        };
        let seen: Vec<Seen<'_>> = order
            .iter()
            .filter_map(|k| {
                let (before, now) = keys[k];
                match (before, now) {
                    (None, Some(v)) => self.see(Kind::Added, k, v, None),
                    (Some(b), Some(v)) if b != v => self.see(Kind::Changed, k, v, Some(b)),
                    (Some(b), None) => self.see(Kind::Removed, k, b, None),
                    _ => None,
                }
            })
            .collect();
        let n = self.send_seen(out, seen, secs).await?;
        self.bookmark(out, end, n, true).await?;
        Ok(end)
    }

    /// The live stream after `revision`.
    async fn live(&mut self, mut revision: u64, out: &mut Out) -> Result<(), Stop> {
        let mut latest = self.scanner.subscribe();
        loop {
            tokio::select! {
                r = latest.wait_for(|&l| l > revision) => {
                    if r.is_err() {
                        return Err(Stop::Error(Error::ShuttingDown));
                    }
                }
                _ = self.tx.closed() => return Err(Stop::Gone),
            }
            if let Some(f) = self.scanner.failure() {
                return Err(Stop::Error(f.error()));
            }
            let scans = self
                .scanner
                .scans_after(revision)
                .ok_or_else(|| Stop::Behind(BEHIND.into()))?;
            for scan in scans {
                let n = self.send_scan(out, &scan, None).await?;
                self.bookmark(out, scan.revision, n, false).await?;
                revision = scan.revision;
            }
        }
    }

    /// An aggregated watch: every group at first, then per scan the groups
    /// whose values or rates changed. Returns only when it stops.
    async fn groups(&mut self, out: &mut Out) -> Result<u64, Stop> {
        let mut prev = Groups::default();
        let mut latest = self.scanner.subscribe();
        let mut revision: Option<u64> = None;
        loop {
            let (r, totals, secs) = self.totals(revision).await?;
            let spec = self.watch.aggregate.as_ref().expect("an aggregated watch");
            let first = revision.is_none();
            let changed = prev.update(spec, totals, secs, first);
            let mut n = 0u64;
            for g in changed {
                self.push_group(out, g).await?;
                n += 1;
            }
            self.bookmark(out, r, n, first).await?;
            revision = Some(r);
            tokio::select! {
                w = latest.wait_for(|&l| l > r) => {
                    if w.is_err() {
                        return Err(Stop::Error(Error::ShuttingDown));
                    }
                }
                _ = self.tx.closed() => return Err(Stop::Gone),
            }
            if let Some(f) = self.scanner.failure() {
                return Err(Stop::Error(f.error()));
            }
        }
    }

    /// The groups as they are now, with the increases of the scans after
    /// `since` (on the blocking pool).
    async fn totals(&self, since: Option<u64>) -> Result<Totals, Stop> {
        let watch = self.watch.clone();
        let scanner = self.scanner.clone();
        tokio::task::spawn_blocking(move || totals(&watch, &scanner, since))
            .await
            .map_err(|e| {
                Stop::Error(Error::Internal {
                    map: None,
                    message: format!("aggregate failed: {e}"),
                })
            })?
    }
}

/// An aggregated watch's groups at its last scan, with their rates.
#[derive(Default)]
struct Groups(HashMap<Vec<u8>, (Acc, Vec<f64>)>);

impl Groups {
    /// Replaces the groups with `totals` (their rates over `secs` seconds,
    /// none at the `first` scan); returns the groups that changed, removed
    /// ones included, sorted by key.
    fn update(
        &mut self,
        spec: &Spec,
        totals: HashMap<Vec<u8>, Acc>,
        secs: f64,
        first: bool,
    ) -> Vec<pb::WatchGroup> {
        let prev = &self.0;
        let mut changed = Vec::new();
        for (k, acc) in &totals {
            let before = prev.get(k);
            let rates = if first {
                Vec::new()
            } else {
                spec.rates(acc, before.map(|b| &b.0), secs)
            };
            let same =
                before.is_some_and(|(b, rb)| Spec::same_values(acc, b) && same_rates(rb, &rates));
            if !same {
                changed.push(pb::WatchGroup {
                    group: Some(spec.message(k.clone(), acc)),
                    rates,
                    removed: false,
                });
            }
        }
        for (k, (acc, _)) in prev {
            if !totals.contains_key(k) {
                changed.push(pb::WatchGroup {
                    group: Some(spec.message(k.clone(), acc)),
                    rates: Vec::new(),
                    removed: true,
                });
            }
        }
        let new_prev = totals
            .into_iter()
            .map(|(k, acc)| {
                let rates = if first {
                    Vec::new()
                } else {
                    spec.rates(&acc, prev.get(&k).map(|b| &b.0), secs)
                };
                (k, (acc, rates))
            })
            .collect();
        self.0 = new_prev;
        changed.sort_by(|a, b| {
            let key = |g: &pb::WatchGroup| g.group.as_ref().map(|g| g.key_bytes.clone());
            key(a).cmp(&key(b))
        });
        changed
    }
}

const BEHIND: &str = "this watch fell behind the changes the server keeps (limits.watch_history_scans and watch_history_bytes): its client reads too slowly for the map's rate of change";

type Totals = (u64, HashMap<Vec<u8>, Acc>, f64);

/// A key's value at a cursor's revision and now (`None`: absent).
type Span<'a> = (Option<&'a [u8]>, Option<&'a [u8]>);

/// The groups of the state as it is now (blocking: a pass over every
/// entry), with the increases of the scans after `since`.
fn totals(watch: &Watch, scanner: &Scanner, since: Option<u64>) -> Result<Totals, Stop> {
    let spec = watch.aggregate.as_ref().expect("an aggregated watch");
    let locked = scanner.state.blocking_lock();
    let r = locked.revision;
    let stride = if watch.meta.per_cpu() {
        watch.meta.cpu_stride()
    } else {
        0
    };
    let mut table = spec.table();
    for slot in 0..locked.state.slots() {
        let Some((key, value)) = locked.state.get(slot) else {
            continue;
        };
        let e = EntryRef { key, value, stride };
        if watch.filter.as_ref().is_some_and(|f| !f.matches(&e)) {
            continue;
        }
        if !table.add(&e) {
            break;
        }
    }
    drop(locked);
    let mut secs = 0.0;
    if let Some(since) = since {
        let scans = scanner
            .scans_after(since)
            .ok_or_else(|| Stop::Behind(BEHIND.into()))?;
        let scans: Vec<_> = scans.into_iter().filter(|s| s.revision <= r).collect();
        if let (Some(f), Some(l)) = (scans.first(), scans.last()) {
            secs = f
                .since
                .map_or(0.0, |s| l.at.saturating_duration_since(s).as_secs_f64());
        }
        for scan in &scans {
            let c = &scan.changes;
            for ch in &c.list {
                if ch.kind == Kind::Removed {
                    continue;
                }
                let (key, value, prev) = c.parts(ch);
                let now = EntryRef { key, value, stride };
                if watch.filter.as_ref().is_some_and(|f| !f.matches(&now)) {
                    continue;
                }
                let before = prev
                    .map(|value| EntryRef { key, value, stride })
                    .filter(|b| watch.filter.as_ref().is_none_or(|f| f.matches(b)));
                if !table.add_increase(&now, before.as_ref()) {
                    break;
                }
            }
        }
    }
    let totals = table
        .totals()
        .map_err(|e| Stop::Error(Error::ResourceExhausted(e.to_string())))?;
    Ok((r, totals, secs))
}

fn same_rates(a: &[f64], b: &[f64]) -> bool {
    a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits())
}

/// The delta and rate of every counter between two values of an entry.
fn deltas(
    counters: &[Counter],
    now: &EntryRef<'_>,
    before: &EntryRef<'_>,
    secs: f64,
    ev: &mut pb::WatchEvent,
) {
    for c in counters {
        let (Some(x), Some(b)) = (c.int.read(now), c.int.read(before)) else {
            continue;
        };
        let (d, reset) = if x >= b || c.int.signed() {
            (x - b, false)
        } else {
            (x, true)
        };
        if d == 0 && !reset {
            continue; // only the members that changed
        }
        ev.delta.insert(c.path.clone(), d.to_string());
        ev.rate.insert(
            c.path.clone(),
            if secs > 0.0 { d as f64 / secs } else { 0.0 },
        );
        if reset {
            ev.resets.push(c.path.clone());
        }
    }
}
