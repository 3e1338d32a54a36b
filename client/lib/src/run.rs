//! A fleet run: the one shape of every fleet call. Each target's part of
//! it runs with a client of its own, sends what it answers and is retrying
//! after as [`FleetEvent`]s, and ends with exactly one [`TargetReport`].

use std::{
    collections::{HashMap, HashSet},
    pin::Pin,
    sync::{Arc, Mutex},
    task::{Context, Poll},
    time::{Duration, Instant},
};

use futures::{Stream, StreamExt as _};
use tokio::{
    sync::{OwnedSemaphorePermit, Semaphore, mpsc},
    task::JoinHandle,
};
use tonic::Code;

use crate::{Client, ConnectOptions, Error, Target};

/// How one target's part of a run ended: the one report type of every
/// fleet call.
#[derive(Debug)]
#[non_exhaustive]
pub struct TargetReport {
    /// The target.
    pub target: Target,
    /// Why the target failed; `None` when it answered OK. The error is the
    /// one its call ended with: a status keeps its code and the transport
    /// errors that caused it ([`Error::status`],
    /// [`source`](std::error::Error::source)).
    pub error: Option<Error>,
    /// What it sent: a dump's entries, a lookup's found keys, the maps
    /// listed, a watch's events and groups, an aggregate's groups.
    pub entries: u64,
    /// Entries its daemon read to answer (an aggregate's walks, over every
    /// call; a watch's scans).
    pub scanned: u64,
    /// Calls it answered: one, or for an aggregate one per phase it took
    /// part in, for a watch one per scan.
    pub calls: u32,
    /// For a dump: whether the map was read to the end.
    pub complete: bool,
    /// For a dump or a watch: how many times it resumed after a broken
    /// stream.
    pub resumes: u32,
    /// For a dump or a watch: the cursor after the last chunk or scan
    /// received (the cursor it started from before the first).
    pub cursor: String,
    /// Time from the target's start to its end.
    pub elapsed: Duration,
}

impl TargetReport {
    /// Whether the target answered OK.
    pub fn is_ok(&self) -> bool {
        self.error.is_none()
    }

    /// OK, or the code of the error ([`Error::code`]): the status code the
    /// target answered with, UNAVAILABLE for a refused connection or a
    /// failed TLS handshake, DEADLINE_EXCEEDED for a target that did not
    /// answer in time.
    pub fn code(&self) -> Code {
        self.error.as_ref().map_or(Code::Ok, Error::code)
    }
}

/// What a fleet run yields.
#[derive(Debug)]
#[non_exhaustive]
pub enum FleetEvent<T> {
    /// An answer from a target (a dump yields one per chunk, a watch one
    /// per scan).
    Answer {
        /// Where it came from.
        target: Target,
        /// What it said.
        answer: T,
    },
    /// A target is retrying, as its retry policy says, after this failure:
    /// its daemon is busy (RESOURCE_EXHAUSTED: all its slots in use,
    /// [`RetryPolicy::with_busy_wait`](crate::RetryPolicy::with_busy_wait)),
    /// or its watch broke and is started again. Sent once each time a
    /// target starts retrying.
    Retrying {
        /// The target.
        target: Target,
        /// What it failed with.
        error: Error,
    },
    /// A target is done: its report. Every target gets exactly one, after
    /// all its answers.
    Done(TargetReport),
    /// The fleet's own answer, for a call that merges the targets'
    /// answers ([`Fleet::aggregate`](crate::Fleet::aggregate)): last,
    /// after every report.
    Merged(T),
}

/// A run in progress: a stream of [`FleetEvent`]s. Dropping it cancels the
/// run: every target's call stops, every connection closes.
#[derive(Debug)]
pub struct FleetRun<T> {
    rx: mpsc::Receiver<FleetEvent<T>>,
    driver: JoinHandle<()>,
    /// Targets that have not sent their report yet (for rounds).
    live: HashSet<Target>,
}

impl<T> Stream for FleetRun<T> {
    type Item = FleetEvent<T>;

    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let this = self.get_mut();
        let next = this.rx.poll_recv(cx);
        if let Poll::Ready(Some(FleetEvent::Done(r))) = &next {
            this.live.remove(&r.target);
        }
        next
    }
}

impl<T> Drop for FleetRun<T> {
    fn drop(&mut self) {
        // Drops every target's future: their calls, clients and
        // connections.
        self.driver.abort();
    }
}

impl<T> FleetRun<T> {
    /// A run of `targets` whose events `drive` sends.
    pub(crate) fn spawn<D, Fut>(targets: Vec<Target>, buffer: usize, drive: D) -> Self
    where
        T: Send + 'static,
        D: FnOnce(mpsc::Sender<FleetEvent<T>>) -> Fut,
        Fut: Future<Output = ()> + Send + 'static,
    {
        let (tx, rx) = mpsc::channel(buffer.max(1));
        let driver = tokio::spawn(drive(tx));
        FleetRun {
            rx,
            driver,
            live: targets.into_iter().collect(),
        }
    }

    /// Runs to the end, keeping the answers: every target's answers (in
    /// arrival order) and report, in target order.
    pub async fn collect(mut self) -> Vec<(TargetReport, Vec<T>)> {
        let mut answers: HashMap<Target, Vec<T>> = HashMap::new();
        let mut reports = Vec::new();
        while let Some(event) = self.next().await {
            match event {
                FleetEvent::Answer { target, answer } => {
                    answers.entry(target).or_default().push(answer)
                }
                FleetEvent::Done(report) => reports.push(report),
                FleetEvent::Retrying { .. } | FleetEvent::Merged(_) => {}
            }
        }
        reports.sort_by(|a, b| a.target.cmp(&b.target));
        reports
            .into_iter()
            .map(|r| {
                let a = answers.remove(&r.target).unwrap_or_default();
                (r, a)
            })
            .collect()
    }

    /// The next round: the events from the next one on, until every target
    /// still running has sent an answer, or `window` has passed (half the
    /// interval suits a watch: each target scans once per interval, at its
    /// own phase); `None` once the run has ended.
    pub async fn next_round(&mut self, window: Duration) -> Option<Vec<FleetEvent<T>>> {
        let first = self.next().await?;
        let mut answered = HashSet::new();
        let note = |e: &FleetEvent<T>, answered: &mut HashSet<Target>| {
            if let FleetEvent::Answer { target, .. } = e {
                answered.insert(target.clone());
            }
        };
        note(&first, &mut answered);
        let mut round = vec![first];
        let deadline = tokio::time::Instant::now() + window;
        while self.live.iter().any(|t| !answered.contains(t)) {
            match tokio::time::timeout_at(deadline, self.next()).await {
                Ok(Some(e)) => {
                    note(&e, &mut answered);
                    round.push(e);
                }
                Ok(None) | Err(_) => break,
            }
        }
        Some(round)
    }
}

/// A target's progress, kept outside its future so that a report can be
/// written when the run's deadline drops the future.
#[derive(Debug, Default, Clone)]
pub(crate) struct Progress {
    pub(crate) entries: u64,
    pub(crate) scanned: u64,
    pub(crate) calls: u32,
    pub(crate) complete: bool,
    pub(crate) resumes: u32,
    pub(crate) cursor: String,
    pub(crate) elapsed: Duration,
    started: Option<Instant>,
}

/// What the targets of a run share: where events go, and every target's
/// progress.
#[derive(Debug)]
struct Shared<T> {
    tx: mpsc::Sender<FleetEvent<T>>,
    progress: Mutex<HashMap<Target, Progress>>,
    /// The targets whose report was sent.
    reported: Mutex<HashSet<Target>>,
}

impl<T> Shared<T> {
    fn update(&self, target: &Target, f: impl FnOnce(&mut Progress)) {
        let mut all = self.progress.lock().expect("progress lock");
        f(all.entry(target.clone()).or_default());
    }

    /// Sends `target`'s report, made of its progress and `error`.
    async fn report(&self, target: &Target, error: Option<Error>) -> bool {
        let p = self
            .progress
            .lock()
            .expect("progress lock")
            .get(target)
            .cloned()
            .unwrap_or_default();
        let report = TargetReport {
            target: target.clone(),
            error,
            entries: p.entries,
            scanned: p.scanned,
            calls: p.calls,
            complete: p.complete,
            resumes: p.resumes,
            cursor: p.cursor,
            elapsed: p.elapsed + p.started.map_or(Duration::ZERO, |s| s.elapsed()),
        };
        let sent = self.tx.send(FleetEvent::Done(report)).await.is_ok();
        // Marked once sent: a target whose future the deadline drops while
        // its report waits for room gets the deadline's report instead.
        self.reported
            .lock()
            .expect("reported lock")
            .insert(target.clone());
        sent
    }
}

/// Where a target's operation sends its answers and notes its progress.
#[derive(Debug)]
pub(crate) struct Answers<T> {
    pub(crate) target: Target,
    shared: Arc<Shared<T>>,
    /// The target's place among those running at once; for a watch, given
    /// back at its first answer.
    slot: Mutex<Option<OwnedSemaphorePermit>>,
    release_on_answer: bool,
}

impl<T> Answers<T> {
    /// Sends one answer; `false` when the run was dropped.
    pub(crate) async fn send(&self, answer: T) -> bool {
        if self.release_on_answer {
            self.slot.lock().expect("slot lock").take();
        }
        self.shared
            .tx
            .send(FleetEvent::Answer {
                target: self.target.clone(),
                answer,
            })
            .await
            .is_ok()
    }

    /// Says that the target retries after `error`.
    pub(crate) async fn retrying(&self, error: Error) {
        if self.release_on_answer {
            self.slot.lock().expect("slot lock").take();
        }
        let _ = self
            .shared
            .tx
            .send(FleetEvent::Retrying {
                target: self.target.clone(),
                error,
            })
            .await;
    }

    /// Notes progress, for the report.
    pub(crate) fn update(&self, f: impl FnOnce(&mut Progress)) {
        self.shared.update(&self.target, f);
    }

    /// The cursor noted last.
    pub(crate) fn cursor(&self) -> String {
        let mut cursor = String::new();
        self.update(|p| cursor.clone_from(&p.cursor));
        cursor
    }
}

/// How a run goes: the targets, how to reach them, how many at once, and
/// the deadline.
#[derive(Debug, Clone)]
pub(crate) struct Plan {
    pub(crate) targets: Vec<Target>,
    pub(crate) connect: ConnectOptions,
    pub(crate) concurrency: usize,
    /// Answers held for the run's reader.
    pub(crate) buffer: usize,
    pub(crate) deadline: Option<Duration>,
    /// A target gives its place back at its first answer (a watch, which
    /// never ends by itself), not when it is done.
    pub(crate) release_on_answer: bool,
}

impl Plan {
    /// Runs `op` on every target.
    pub(crate) fn run<T, F, Fut>(self, op: F) -> FleetRun<T>
    where
        T: Send + 'static,
        F: Fn(Client, Answers<T>) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<(), Error>> + Send + 'static,
    {
        let targets = self.targets.clone();
        let buffer = self.buffer;
        FleetRun::spawn(targets, buffer, move |tx| async move {
            let shared = Arc::new(Shared {
                tx,
                progress: Mutex::default(),
                reported: Mutex::default(),
            });
            self.drive(shared, op).await;
        })
    }

    async fn drive<T, F, Fut>(self, shared: Arc<Shared<T>>, op: F)
    where
        F: Fn(Client, Answers<T>) -> Fut,
        Fut: Future<Output = Result<(), Error>>,
    {
        let slots = Arc::new(Semaphore::new(self.concurrency.max(1)));
        let work = futures::stream::iter(&self.targets)
            .for_each_concurrent(None, |t| self.one(t, &shared, &slots, &op));
        let Some(deadline) = self.deadline else {
            return work.await;
        };
        if tokio::time::timeout(deadline, work).await.is_ok() {
            return;
        }
        for target in &self.targets {
            if shared
                .reported
                .lock()
                .expect("reported lock")
                .contains(target)
            {
                continue;
            }
            if !shared
                .report(target, Some(Error::Deadline { deadline }))
                .await
            {
                return;
            }
        }
    }

    /// One target's part: its place among those running at once, a client
    /// of its own, the operation, the report.
    async fn one<T, F, Fut>(
        &self,
        target: &Target,
        shared: &Arc<Shared<T>>,
        slots: &Arc<Semaphore>,
        op: &F,
    ) where
        F: Fn(Client, Answers<T>) -> Fut,
        Fut: Future<Output = Result<(), Error>>,
    {
        let Ok(slot) = slots.clone().acquire_owned().await else {
            return;
        };
        shared.update(target, |p| p.started = Some(Instant::now()));
        let url = target.url(self.connect.uses_tls());
        let result = match Client::connect_lazy(&url, self.connect.clone()) {
            Ok(client) => {
                let answers = Answers {
                    target: target.clone(),
                    shared: shared.clone(),
                    slot: Mutex::new(Some(slot)),
                    release_on_answer: self.release_on_answer,
                };
                op(client, answers).await
            }
            Err(e) => Err(e),
        };
        shared.report(target, result.err()).await;
    }
}
