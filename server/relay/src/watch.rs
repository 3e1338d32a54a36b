//! A fleet watch: where each target starts (after the bookmark a fleet
//! cursor holds for it, or the one the caller kept), and its stream. Each
//! target is watched on its own (the library's fleet watch of that one
//! target: resumes, retries, the first scan's timeout), so that targets
//! join and leave while the call lasts; their scans are gathered into
//! rounds, and every round's end carries the fleet cursor of every
//! target's bookmark.

use std::{
    collections::{BTreeSet, HashMap},
    time::Duration,
};

use bpfmap_client::{
    Fleet, FleetEvent, FleetWatchOptions, Scan, Target, WatchOptions, pb,
    pb::fleet_service_watch_map_response::Part,
};
use bpfmapd::Operation;
use tokio::{
    sync::mpsc,
    task::{AbortHandle, JoinSet},
    time::Instant,
};

use crate::{
    call::{Answers, Ask, Asker, Call, Calls, Ended, QUEUED},
    cursor::{Binding, FleetPosition, Standing, TargetPosition},
    error::Error,
    status,
};

/// Largest scan part sent in one message, in bytes: a scan larger than
/// this takes several (grpcurl's default limit on a message is 4 MiB).
const PART_BYTES: usize = 2 << 20;

/// How often a watch that follows the relay's targets looks at them.
const FOLLOW_EVERY: Duration = Duration::from_secs(1);

/// Starts a fleet watch: a plain one is a dump's operation, one that
/// groups an aggregate's. Without targets named, it follows the relay's.
pub(crate) fn start(
    calls: &Calls,
    asker: Asker,
    req: pb::FleetServiceWatchMapRequest,
) -> Result<Answers<pb::FleetServiceWatchMapResponse>, Error> {
    let request = req.request.unwrap_or_default();
    let op = if request.group_by.is_empty() && request.aggregates.is_empty() {
        Operation::Dump
    } else {
        Operation::Aggregate
    };
    let selector = req.targets.unwrap_or_default();
    let ask = Ask {
        op,
        map: request.map.as_ref(),
        targets: Some(&selector),
    };
    let call = calls.start(asker, ask)?;
    let options = WatchOptions::from_proto(&request)
        .map_err(Error::Request)?
        .with_cursor("");
    let binding = Binding::watch(&call.asker.caller.identity, &request);
    let mut bookmarks = match req.cursor.as_str() {
        "" => HashMap::new(),
        cursor => bookmarks(calls.keys.open(cursor, &binding)?),
    };
    bookmarks.extend(call.target_cursors(req.target_cursors)?);
    let watch = FleetWatch {
        calls: calls.clone(),
        follow: selector.targets.is_empty(),
        ended: call.denials(),
        call,
        options,
        bookmarks,
        binding,
    };
    let (tx, rx) = mpsc::channel(QUEUED);
    tokio::spawn(async move {
        let _ = Watcher::new(watch, tx).run().await;
    });
    Ok(Box::pin(tokio_stream::wrappers::ReceiverStream::new(rx)))
}

/// Each target's bookmark in a fleet watch's cursor.
fn bookmarks(position: FleetPosition) -> HashMap<String, String> {
    position
        .targets
        .into_iter()
        .filter_map(|t| match t.standing {
            Standing::At(c) => Some((t.target, c)),
            _ => None,
        })
        .collect()
}

/// What a fleet watch needs to run.
struct FleetWatch {
    calls: Calls,
    /// The caller, the map, the targets watched from the start and those
    /// the policy keeps from the caller.
    call: Call,
    /// Follow the relay's targets (no selector) rather than a fixed set.
    follow: bool,
    /// The targets that end before they are watched.
    ended: Vec<Ended>,
    options: WatchOptions,
    /// Each target's bookmark to resume after.
    bookmarks: HashMap<String, String>,
    /// What the round ends' cursors are bound to.
    binding: Binding,
}

impl FleetWatch {
    /// A fleet of one target, calling for the caller: one scan held per
    /// target while the caller reads (a watch holds a stream to every
    /// target it watches).
    fn fleet(&self, target: &Target) -> Fleet {
        Fleet::new(
            vec![target.clone()],
            self.calls.connect_for(&self.call.asker),
        )
        .with_options(self.calls.options.clone().with_buffer(1))
    }
}

type Out = mpsc::Sender<Result<pb::FleetServiceWatchMapResponse, tonic::Status>>;

/// An event of one target's watch.
type TargetEvent = (Target, FleetEvent<Scan>);

/// The caller left.
struct Gone;

/// A fleet watch in progress.
struct Watcher {
    setup: FleetWatch,
    out: Out,
    events: (mpsc::Sender<TargetEvent>, mpsc::Receiver<TargetEvent>),
    tasks: JoinSet<()>,
    /// The targets watched, each with its task.
    running: HashMap<Target, AbortHandle>,
    /// Every target's last bookmark.
    bookmarks: HashMap<String, String>,
    failing: BTreeSet<String>,
    /// Targets whose watch ended for good (not taken up again).
    ended: BTreeSet<String>,
    round: Round,
    window: Duration,
}

/// The round being gathered.
#[derive(Default)]
struct Round {
    number: u64,
    started: Option<Instant>,
    answered: BTreeSet<String>,
    recovered: BTreeSet<String>,
    added: Vec<String>,
    dropped: Vec<String>,
}

impl Watcher {
    fn new(setup: FleetWatch, out: Out) -> Self {
        let interval = setup.options.interval().unwrap_or(Duration::from_secs(1));
        Self {
            bookmarks: setup.bookmarks.clone(),
            setup,
            out,
            events: mpsc::channel(QUEUED),
            tasks: JoinSet::new(),
            running: HashMap::new(),
            failing: BTreeSet::new(),
            ended: BTreeSet::new(),
            round: Round {
                number: 1,
                ..Round::default()
            },
            window: interval / 2,
        }
    }

    async fn run(mut self) -> Result<(), Gone> {
        for e in std::mem::take(&mut self.setup.ended) {
            self.ended.insert(e.target.clone());
            self.send(e.target, Part::Ended(e.status)).await?;
        }
        for target in std::mem::take(&mut self.setup.call.targets) {
            self.watch(target);
        }
        let mut follow = tokio::time::interval(FOLLOW_EVERY);
        loop {
            let deadline = self.round.started.map(|s| s + self.window);
            tokio::select! {
                event = self.events.1.recv() => {
                    let (target, event) = event.expect("the watcher holds a sender");
                    self.on_event(target, event).await?;
                }
                _ = follow.tick(), if self.setup.follow => self.follow().await?,
                Some(_) = self.tasks.join_next(), if !self.tasks.is_empty() => {}
                _ = sleep_until(deadline) => self.end_round().await?,
                _ = self.out.closed() => return Err(Gone),
            }
            if self.round.started.is_some() && self.everyone_answered() {
                self.end_round().await?;
            }
            if !self.setup.follow && self.running.is_empty() {
                return Ok(()); // every target of a fixed set ended
            }
        }
    }

    /// Starts watching `target`, from its bookmark if it has one.
    fn watch(&mut self, target: Target) {
        let mut options = FleetWatchOptions::default().with_watch(self.setup.options.clone());
        if let Some(c) = self.bookmarks.get(target.as_str()) {
            options = options.with_cursors([(target.clone(), c.clone())]);
        }
        let mut run = self
            .setup
            .fleet(&target)
            .watch(&self.setup.call.map, options);
        let (tx, name) = (self.events.0.clone(), target.clone());
        let handle = self.tasks.spawn(async move {
            use futures::StreamExt as _;
            while let Some(event) = run.next().await {
                if tx.send((name.clone(), event)).await.is_err() {
                    return;
                }
            }
        });
        self.running.insert(target, handle);
    }

    /// Takes up the relay's new targets and drops those gone.
    async fn follow(&mut self) -> Result<(), Gone> {
        let now = self.setup.calls.targets.current();
        let gone: Vec<Target> = self
            .running
            .keys()
            .filter(|t| !now.contains(t))
            .cloned()
            .collect();
        // A target that ended and left may come back: watched anew then.
        self.ended
            .retain(|name| now.iter().any(|t| t.as_str() == name));
        for target in gone {
            if let Some(h) = self.running.remove(&target) {
                h.abort();
            }
            self.failing.remove(target.as_str());
            self.bookmarks.remove(target.as_str());
            self.round.dropped.push(target.as_str().to_owned());
        }
        for target in now {
            let name = target.as_str().to_owned();
            if self.running.contains_key(&target) || self.ended.contains(&name) {
                continue;
            }
            self.round.added.push(name.clone());
            if self.setup.calls.allows(&self.setup.call, &target) {
                self.watch(target);
            } else {
                self.ended.insert(name.clone());
                let status = status::in_band(&self.setup.call.denial());
                self.send(name, Part::Ended(status)).await?;
            }
        }
        Ok(())
    }

    async fn on_event(&mut self, target: Target, event: FleetEvent<Scan>) -> Result<(), Gone> {
        if !self.running.contains_key(&target) {
            return Ok(()); // dropped while its event was queued
        }
        let name = target.as_str().to_owned();
        self.round.started.get_or_insert_with(Instant::now);
        match event {
            FleetEvent::Answer { answer, .. } => {
                self.setup.calls.targets.record(&target, None);
                if self.failing.remove(&name) {
                    self.round.recovered.insert(name.clone());
                }
                self.round.answered.insert(name.clone());
                self.bookmarks
                    .insert(name.clone(), answer.cursor().to_owned());
                for part in parts(answer.into_proto()) {
                    self.send(name.clone(), Part::Scan(part)).await?;
                }
            }
            FleetEvent::Retrying { error, .. } => {
                self.setup.calls.targets.record(&target, Some(&error));
                self.failing.insert(name.clone());
                let status = status::of_target(&error);
                self.send(name, Part::Failing(status)).await?;
            }
            FleetEvent::Done(report) => {
                let failed = self.setup.calls.targets.record_end(&report);
                self.running.remove(&target);
                self.failing.remove(&name);
                self.ended.insert(name.clone());
                let status = failed.unwrap_or_else(status::ok);
                self.send(name, Part::Ended(status)).await?;
            }
            _ => {}
        }
        Ok(())
    }

    /// Whether every target watched and not failing has sent a scan in
    /// this round.
    fn everyone_answered(&self) -> bool {
        self.running
            .keys()
            .all(|t| self.round.answered.contains(t.as_str()) || self.failing.contains(t.as_str()))
    }

    async fn end_round(&mut self) -> Result<(), Gone> {
        let round = std::mem::take(&mut self.round);
        self.round.number = round.number + 1;
        let position = FleetPosition {
            targets: self
                .bookmarks
                .iter()
                .map(|(t, c)| TargetPosition {
                    target: t.clone(),
                    standing: Standing::At(c.clone()),
                })
                .collect(),
        };
        let end = pb::RoundEnd {
            answered: round.answered.into_iter().collect(),
            failing: self.failing.iter().cloned().collect(),
            recovered: round.recovered.into_iter().collect(),
            added: round.added,
            dropped: round.dropped,
            cursor: self.setup.calls.keys.seal(&self.setup.binding, &position),
        };
        self.message(round.number, String::new(), Part::RoundEnd(end))
            .await
    }

    async fn send(&mut self, target: String, part: Part) -> Result<(), Gone> {
        self.message(self.round.number, target, part).await
    }

    async fn message(&self, round: u64, target: String, part: Part) -> Result<(), Gone> {
        let msg = pb::FleetServiceWatchMapResponse {
            target,
            round,
            part: Some(part),
        };
        self.out.send(Ok(msg)).await.map_err(|_| Gone)
    }
}

async fn sleep_until(deadline: Option<Instant>) {
    match deadline {
        Some(d) => tokio::time::sleep_until(d).await,
        None => std::future::pending().await,
    }
}

/// A scan cut into messages of at most [`PART_BYTES`] of events or
/// groups: the resync and the projection on the first, the bookmark on
/// the last.
fn parts(scan: pb::WatchMapResponse) -> Vec<pb::WatchMapResponse> {
    use prost::Message as _;
    let mut out = vec![pb::WatchMapResponse {
        resync: scan.resync,
        resync_reason: scan.resync_reason,
        projection: scan.projection,
        ..Default::default()
    }];
    let mut size = 0;
    for event in scan.events {
        let n = framed(event.encoded_len());
        if size + n > PART_BYTES && size > 0 {
            out.push(pb::WatchMapResponse::default());
            size = 0;
        }
        size += n;
        out.last_mut().expect("one part").events.push(event);
    }
    for group in scan.groups {
        let n = framed(group.encoded_len());
        if size + n > PART_BYTES && size > 0 {
            out.push(pb::WatchMapResponse::default());
            size = 0;
        }
        size += n;
        out.last_mut().expect("one part").groups.push(group);
    }
    out.last_mut().expect("one part").bookmark = scan.bookmark;
    out
}

/// The bytes of a repeated field's element of `len` bytes in its message
/// (its tag, its length, itself).
fn framed(len: usize) -> usize {
    1 + prost::length_delimiter_len(len) + len
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_large_scan_is_cut_into_parts_with_the_bookmark_on_the_last() {
        let event = pb::WatchEvent {
            entry: Some(pb::Entry {
                key: vec![0; 1000],
                value: vec![0; 1000],
                ..Default::default()
            }),
            ..Default::default()
        };
        let scan = pb::WatchMapResponse {
            events: vec![event; 5000],
            bookmark: Some(pb::Bookmark {
                revision: 7,
                ..Default::default()
            }),
            resync: true,
            resync_reason: "history".into(),
            ..Default::default()
        };
        let parts = parts(scan);
        assert_eq!(parts.len(), 5, "10 MB in parts of at most 2 MiB");
        assert_eq!(parts.iter().map(|p| p.events.len()).sum::<usize>(), 5000);
        assert!(
            parts
                .iter()
                .all(|p| prost::Message::encoded_len(p) <= PART_BYTES + 16)
        );
        assert!(parts[0].resync && parts[1..].iter().all(|p| !p.resync));
        assert_eq!(parts[4].bookmark.as_ref().unwrap().revision, 7);
        assert!(parts[..4].iter().all(|p| p.bookmark.is_none()));
    }
}
