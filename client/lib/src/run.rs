//! A fleet run: every target's part of it, what it yields, and how each
//! target's report is written.

use std::{
    collections::{HashMap, HashSet},
    pin::Pin,
    sync::{Arc, Mutex},
    task::{Context, Poll},
    time::{Duration, Instant},
};

use futures::{Stream, StreamExt as _};
use tokio::{sync::mpsc, task::JoinHandle};
use tonic::Code;

use crate::{Client, ConnectOptions, Error, Target};

/// How one target's part of a run ended.
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
    /// Entries received (a dump's entries, a lookup's found keys, the maps
    /// listed).
    pub entries: u64,
    /// For a dump: whether the map was read to the end.
    pub complete: bool,
    /// For a dump: how many times it resumed after a broken stream.
    pub resumes: u32,
    /// For a dump: the cursor after the last chunk received (the cursor it
    /// started from before the first).
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
    /// An answer from a target (a dump yields one per chunk).
    Answer {
        /// Where it came from.
        target: Target,
        /// What it said.
        answer: T,
    },
    /// A target's daemon is busy (RESOURCE_EXHAUSTED: all its dump slots in
    /// use) and the target waits for a slot, as its retry policy says
    /// ([`RetryPolicy::with_busy_wait`](crate::RetryPolicy::with_busy_wait)).
    /// Sent once each time a target starts waiting.
    Waiting {
        /// The target.
        target: Target,
        /// What the daemon said.
        status: tonic::Status,
    },
    /// A target is done: its report. Every target gets exactly one, after
    /// all its answers.
    Done(TargetReport),
}

/// A run in progress: a stream of [`FleetEvent`]s. Dropping it cancels the
/// run.
#[derive(Debug)]
pub struct FleetRun<T> {
    rx: mpsc::Receiver<FleetEvent<T>>,
    driver: JoinHandle<()>,
}

impl<T> Stream for FleetRun<T> {
    type Item = FleetEvent<T>;

    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        self.get_mut().rx.poll_recv(cx)
    }
}

impl<T> Drop for FleetRun<T> {
    fn drop(&mut self) {
        // Drops every target's future: their dumps, clients and connections.
        self.driver.abort();
    }
}

impl<T> FleetRun<T> {
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
                FleetEvent::Waiting { .. } => {}
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
}

/// A target's progress, kept outside its future so that a report can be
/// written when the run's deadline drops the future.
#[derive(Debug, Default, Clone)]
pub(crate) struct Progress {
    pub(crate) entries: u64,
    pub(crate) complete: bool,
    pub(crate) resumes: u32,
    pub(crate) cursor: String,
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
            complete: p.complete,
            resumes: p.resumes,
            cursor: p.cursor,
            elapsed: p.started.map_or(Duration::ZERO, |s| s.elapsed()),
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
}

impl<T> Answers<T> {
    /// Sends one answer; `false` when the run was dropped.
    pub(crate) async fn send(&self, answer: T) -> bool {
        self.shared
            .tx
            .send(FleetEvent::Answer {
                target: self.target.clone(),
                answer,
            })
            .await
            .is_ok()
    }

    /// Says that the target waits for its busy daemon.
    pub(crate) async fn waiting(&self, status: tonic::Status) {
        let _ = self
            .shared
            .tx
            .send(FleetEvent::Waiting {
                target: self.target.clone(),
                status,
            })
            .await;
    }

    /// Notes progress, for the report.
    pub(crate) fn update(&self, f: impl FnOnce(&mut Progress)) {
        self.shared.update(&self.target, f);
    }
}

/// How a run goes: the targets, how to reach them, how many at once, and
/// the deadline.
#[derive(Debug, Clone)]
pub(crate) struct Plan {
    pub(crate) targets: Vec<Target>,
    pub(crate) connect: ConnectOptions,
    pub(crate) concurrency: usize,
    pub(crate) deadline: Option<Duration>,
}

impl Plan {
    /// Runs `op` on every target.
    pub(crate) fn run<T, F, Fut>(self, op: F) -> FleetRun<T>
    where
        T: Send + 'static,
        F: Fn(Client, Answers<T>) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<(), Error>> + Send + 'static,
    {
        let (tx, rx) = mpsc::channel(self.concurrency.max(1) * 2);
        let shared = Arc::new(Shared {
            tx,
            progress: Mutex::default(),
            reported: Mutex::default(),
        });
        let driver = tokio::spawn(self.drive(shared, op));
        FleetRun { rx, driver }
    }

    async fn drive<T, F, Fut>(self, shared: Arc<Shared<T>>, op: F)
    where
        F: Fn(Client, Answers<T>) -> Fut,
        Fut: Future<Output = Result<(), Error>>,
    {
        let work = futures::stream::iter(&self.targets)
            .for_each_concurrent(self.concurrency.max(1), |t| self.one(t, &shared, &op));
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

    /// One target's part: a client of its own, the operation, the report.
    async fn one<T, F, Fut>(&self, target: &Target, shared: &Arc<Shared<T>>, op: &F)
    where
        F: Fn(Client, Answers<T>) -> Fut,
        Fut: Future<Output = Result<(), Error>>,
    {
        shared.update(target, |p| p.started = Some(Instant::now()));
        let url = target.url(self.connect.uses_tls());
        let result = match Client::connect_lazy(&url, self.connect.clone()) {
            Ok(client) => {
                let answers = Answers {
                    target: target.clone(),
                    shared: shared.clone(),
                };
                op(client, answers).await
            }
            Err(e) => Err(e),
        };
        shared.report(target, result.err()).await;
    }
}
