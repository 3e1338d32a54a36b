//! One call on every host of a fleet.
//!
//! A [`Fleet`] is a list of targets and one way to connect to them. Each
//! operation runs on every target with at most
//! [`FleetOptions::concurrency`] targets in flight, each over a connection of
//! its own (so that a slow or stuck target never holds the flow-control
//! window of another), and yields [`FleetEvent`]s as answers arrive: the
//! answers of each target, then its [`TargetReport`]. A target that fails
//! never stops the others; a map absent on some hosts is NOT_FOUND for those
//! hosts. Dropping the stream cancels the run: every connection is closed
//! and every dump on the servers stops.

use std::{
    collections::{HashMap, HashSet},
    fmt,
    future::Future,
    pin::Pin,
    str::FromStr,
    sync::{Arc, Mutex},
    task::{Context, Poll},
    time::{Duration, Instant},
};

use futures::{FutureExt as _, Stream, StreamExt as _};
use tokio::{sync::mpsc, task::JoinHandle};
use tonic::{Code, Status};

use crate::{
    Chunk, Client, ConnectOptions, DumpOptions, Error, MapName, MapTypes, RetryPolicy, pb,
};

/// One daemon of a fleet: `host:port` (a name, an IPv4 address, or an IPv6
/// address in brackets). The scheme follows the connection: https with TLS.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Target(String);

impl Target {
    /// The URL to connect to.
    pub fn url(&self, tls: bool) -> String {
        format!("{}://{}", if tls { "https" } else { "http" }, self.0)
    }

    /// `host:port`.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// The target for an address.
    pub fn from_socket_addr(addr: std::net::SocketAddr) -> Self {
        Self(addr.to_string())
    }
}

impl fmt::Display for Target {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl FromStr for Target {
    type Err = Error;

    /// `host:port`, `[v6]:port`, or a URL `http(s)://host:port` (the scheme
    /// is dropped: TLS is a property of the fleet).
    fn from_str(s: &str) -> Result<Self, Error> {
        let bad = || Error::Target(s.to_owned());
        let rest = s
            .strip_prefix("http://")
            .or_else(|| s.strip_prefix("https://"))
            .unwrap_or(s)
            .trim_end_matches('/');
        let (host, port) = rest.rsplit_once(':').ok_or_else(bad)?;
        port.parse::<u16>().map_err(|_| bad())?;
        let host_ok = if let Some(v6) = host.strip_prefix('[') {
            v6.strip_suffix(']')
                .is_some_and(|a| a.parse::<std::net::Ipv6Addr>().is_ok())
        } else {
            !host.is_empty()
                && !host.contains(['/', '[', ']', ':', ' '])
                && host
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || "-._".contains(c))
        };
        if !host_ok {
            return Err(bad());
        }
        Ok(Self(rest.to_owned()))
    }
}

/// How a fleet run behaves.
#[derive(Debug, Clone)]
pub struct FleetOptions {
    /// Targets in flight at once (default 32).
    pub concurrency: usize,
    /// Time for a target to connect and give its first answer (default
    /// 5 s). A target that is up but frozen fails with DEADLINE_EXCEEDED.
    pub connect_timeout: Duration,
    /// Longest wait for the next chunk of a dump (default 30 s).
    pub idle_timeout: Duration,
    /// A deadline for the whole run: targets still going then end with
    /// DEADLINE_EXCEEDED (default none).
    pub deadline: Option<Duration>,
    /// How each target's calls are retried and dumps resumed (default: 4
    /// attempts, 100 ms to 2 s apart).
    pub retry: RetryPolicy,
}

impl Default for FleetOptions {
    fn default() -> Self {
        Self {
            concurrency: 32,
            connect_timeout: Duration::from_secs(5),
            idle_timeout: Duration::from_secs(30),
            deadline: None,
            retry: RetryPolicy {
                max_attempts: 4,
                min_delay: Duration::from_millis(100),
                max_delay: Duration::from_secs(2),
            },
        }
    }
}

/// How one target's part of a run ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TargetReport {
    /// The target.
    pub target: Target,
    /// OK, the status code the target answered with, or the code of the
    /// transport failure (UNAVAILABLE for a refused connection or a failed
    /// TLS handshake, DEADLINE_EXCEEDED for a target that did not answer in
    /// time).
    pub code: Code,
    /// The error's message (empty when OK).
    pub message: String,
    /// Entries received (a dump's entries, a lookup's found keys, the maps
    /// listed).
    pub entries: u64,
    /// For a dump: whether the map was read to the end.
    pub complete: bool,
    /// For a dump: how many times it resumed after a broken stream.
    pub resumes: u32,
    /// For a dump: the cursor after the last chunk received.
    pub cursor: String,
    /// Time from the target's start to its end.
    pub elapsed: Duration,
}

impl TargetReport {
    /// Whether the target answered OK.
    pub fn is_ok(&self) -> bool {
        self.code == Code::Ok
    }
}

/// What a fleet run yields.
#[derive(Debug)]
pub enum FleetEvent<T> {
    /// An answer from a target (a dump yields one per chunk).
    Answer {
        /// Where it came from.
        target: Target,
        /// What it said.
        answer: T,
    },
    /// A target is done: its report. Every target gets exactly one, after
    /// all its answers.
    Done(TargetReport),
}

/// A chunk of a dump, with the map's types on the target it came from
/// ([`Fleet::dump_typed_from`]).
#[derive(Debug, Clone)]
pub struct TypedChunk {
    /// The entries.
    pub chunk: Chunk,
    /// The map's key and value types on that target; `None` when it has
    /// none or they could not be read.
    pub types: Option<Arc<MapTypes>>,
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
struct Progress {
    entries: u64,
    complete: bool,
    resumes: u32,
    cursor: String,
}

type Progresses = Arc<Mutex<HashMap<Target, Progress>>>;

/// Where a target's operation sends its answers.
#[derive(Debug)]
struct Answers<T> {
    target: Target,
    tx: mpsc::Sender<FleetEvent<T>>,
    progress: Progresses,
}

impl<T> Answers<T> {
    /// Sends one answer; `false` when the run was dropped.
    async fn send(&self, answer: T) -> bool {
        self.tx
            .send(FleetEvent::Answer {
                target: self.target.clone(),
                answer,
            })
            .await
            .is_ok()
    }

    fn update(&self, f: impl FnOnce(&mut Progress)) {
        let mut all = self.progress.lock().expect("progress lock");
        f(all.entry(self.target.clone()).or_default());
    }
}

/// A status for an error of this library.
fn status_of(e: Error) -> Status {
    match e {
        Error::Status(s) => s,
        Error::Protocol(m) => Status::internal(format!("malformed answer: {m}")),
        other => Status::unavailable(other.to_string()),
    }
}

/// Many daemons, one way to reach them.
#[derive(Debug, Clone)]
pub struct Fleet {
    targets: Vec<Target>,
    connect: ConnectOptions,
    options: FleetOptions,
}

impl Fleet {
    /// A fleet of `targets` (duplicates dropped, order kept), reached with
    /// `connect` (with TLS, `server_name` is the name every certificate must
    /// carry when the targets are addresses).
    pub fn new(targets: impl IntoIterator<Item = Target>, connect: ConnectOptions) -> Self {
        let mut seen = HashSet::new();
        let targets = targets
            .into_iter()
            .filter(|t| seen.insert(t.clone()))
            .collect();
        Self {
            targets,
            connect,
            options: FleetOptions::default(),
        }
    }

    /// Sets how runs behave.
    pub fn with_options(mut self, options: FleetOptions) -> Self {
        self.options = options;
        self
    }

    /// The targets, deduplicated.
    pub fn targets(&self) -> &[Target] {
        &self.targets
    }

    /// Runs `op` on every target.
    fn run<T, F, Fut>(&self, op: F) -> FleetRun<T>
    where
        T: Send + 'static,
        F: Fn(Client, Answers<T>) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<(), Status>> + Send + 'static,
    {
        let (tx, rx) = mpsc::channel(self.options.concurrency.max(1) * 2);
        let targets = self.targets.clone();
        let connect = self.connect.clone();
        let options = self.options.clone();
        let progress: Progresses = Arc::new(Mutex::new(HashMap::new()));
        let started: Arc<Mutex<HashMap<Target, Instant>>> = Arc::default();
        let done: Arc<Mutex<HashSet<Target>>> = Arc::default();
        let op = Arc::new(op);
        let driver = tokio::spawn({
            let tx = tx.clone();
            let (progress, started, done) = (progress.clone(), started.clone(), done.clone());
            async move {
                let report = |target: &Target, status: Status| {
                    let p = progress
                        .lock()
                        .expect("progress lock")
                        .get(target)
                        .cloned()
                        .unwrap_or_default();
                    let since = started.lock().expect("started lock").get(target).copied();
                    TargetReport {
                        target: target.clone(),
                        code: status.code(),
                        message: crate::status_text(&status),
                        entries: p.entries,
                        complete: p.complete,
                        resumes: p.resumes,
                        cursor: p.cursor,
                        elapsed: since.map_or(Duration::ZERO, |s| s.elapsed()),
                    }
                };
                let work = futures::stream::iter(targets.clone()).for_each_concurrent(
                    options.concurrency.max(1),
                    |target| {
                        let (tx, op, connect, options) =
                            (tx.clone(), op.clone(), connect.clone(), options.clone());
                        let (progress, done, report) = (progress.clone(), done.clone(), &report);
                        started
                            .lock()
                            .expect("started lock")
                            .insert(target.clone(), Instant::now());
                        async move {
                            let url = target.url(connect.tls.is_some());
                            let result = match Client::connect_lazy_with(&url, &connect) {
                                Ok(client) => {
                                    let answers = Answers {
                                        target: target.clone(),
                                        tx: tx.clone(),
                                        progress,
                                    };
                                    op(client.with_retry(options.retry.clone()), answers).await
                                }
                                Err(e) => Err(Status::invalid_argument(e.to_string())),
                            };
                            let status = result.err().unwrap_or_else(|| Status::new(Code::Ok, ""));
                            done.lock().expect("done lock").insert(target.clone());
                            let _ = tx.send(FleetEvent::Done(report(&target, status))).await;
                        }
                    },
                );
                let finished = match options.deadline {
                    None => {
                        work.await;
                        true
                    }
                    Some(d) => tokio::time::timeout(d, work).await.is_ok(),
                };
                if !finished {
                    let secs = options.deadline.unwrap_or_default().as_secs_f64();
                    for target in &targets {
                        if done.lock().expect("done lock").contains(target) {
                            continue;
                        }
                        let status = Status::deadline_exceeded(format!(
                            "the run's deadline ({secs} s) passed before this target was done"
                        ));
                        if tx
                            .send(FleetEvent::Done(report(target, status)))
                            .await
                            .is_err()
                        {
                            return;
                        }
                    }
                }
            }
        });
        drop(tx);
        FleetRun { rx, driver }
    }

    /// Calls with the connect timeout; DEADLINE_EXCEEDED past it.
    async fn timed<T>(
        timeout: Duration,
        fut: impl Future<Output = Result<T, Error>>,
    ) -> Result<T, Status> {
        match tokio::time::timeout(timeout, fut).await {
            Ok(r) => r.map_err(status_of),
            Err(_) => Err(Status::deadline_exceeded(format!(
                "no answer within {} s",
                timeout.as_secs_f64()
            ))),
        }
    }

    /// ListMaps on every target.
    pub fn list_maps(&self) -> FleetRun<Vec<pb::MapInfo>> {
        let timeout = self.options.connect_timeout;
        self.run(move |client, answers| async move {
            let maps = Self::timed(timeout, client.list_maps()).await?;
            answers.update(|p| p.entries = maps.len() as u64);
            answers.send(maps).await;
            Ok(())
        })
    }

    /// GetMap on every target (NOT_FOUND where the map is absent).
    pub fn get_map(&self, map: &MapName) -> FleetRun<pb::MapInfo> {
        let timeout = self.options.connect_timeout;
        let map = map.clone();
        self.run(move |client, answers| {
            let map = map.clone();
            async move {
                let info = Self::timed(timeout, client.get_map(&map)).await?;
                answers.update(|p| p.entries = 1);
                answers.send(info).await;
                Ok(())
            }
        })
    }

    /// Lookup of the same keys on every target.
    pub fn lookup(&self, map: &MapName, keys: Vec<Vec<u8>>) -> FleetRun<Vec<pb::LookupResult>> {
        self.lookup_request(pb::LookupRequest {
            map: Some(map.into()),
            keys,
            ..Default::default()
        })
    }

    /// The same Lookup request (bytes or JSON keys, raw, per-CPU sums) on
    /// every target.
    pub fn lookup_request(&self, request: pb::LookupRequest) -> FleetRun<Vec<pb::LookupResult>> {
        let timeout = self.options.connect_timeout;
        let request = Arc::new(request);
        self.run(move |client, answers| {
            let request = request.clone();
            async move {
                let results =
                    Self::timed(timeout, client.lookup_request(request.as_ref().clone())).await?;
                answers.update(|p| p.entries = results.iter().filter(|r| r.found).count() as u64);
                answers.send(results).await;
                Ok(())
            }
        })
    }

    /// Dumps `map` on every target, each from the beginning.
    pub fn dump(&self, map: &MapName, options: DumpOptions) -> FleetRun<Chunk> {
        self.dump_from(map, options, HashMap::new())
    }

    /// Dumps `map` on every target, each resuming after its own cursor in
    /// `cursors` (from the beginning when it has none). Every target resumes
    /// by itself after a broken stream, as a single dump does.
    pub fn dump_from(
        &self,
        map: &MapName,
        options: DumpOptions,
        cursors: HashMap<Target, String>,
    ) -> FleetRun<Chunk> {
        self.dump_run(map, options, cursors, false, |chunk, _| chunk)
    }

    /// [`dump_from`](Self::dump_from), each chunk with the map's types on
    /// its target, to decode it with. The types come from a GetMap sent
    /// beside the dump on the same connection (no round trip of its own);
    /// `None` for a map without types, or when GetMap failed (the dump then
    /// says why, if it fails too).
    pub fn dump_typed_from(
        &self,
        map: &MapName,
        options: DumpOptions,
        cursors: HashMap<Target, String>,
    ) -> FleetRun<TypedChunk> {
        self.dump_run(map, options, cursors, true, |chunk, types| TypedChunk {
            chunk,
            types,
        })
    }

    fn dump_run<T: Send + 'static>(
        &self,
        map: &MapName,
        options: DumpOptions,
        cursors: HashMap<Target, String>,
        typed: bool,
        answer: fn(Chunk, Option<Arc<MapTypes>>) -> T,
    ) -> FleetRun<T> {
        let (connect_timeout, idle_timeout) =
            (self.options.connect_timeout, self.options.idle_timeout);
        let map = map.clone();
        let cursors = Arc::new(cursors);
        self.run(move |client, answers| {
            let cursor = cursors.get(&answers.target).cloned();
            let options = DumpOptions {
                cursor: cursor.clone().or(options.cursor.clone()),
                ..options.clone()
            };
            let map = map.clone();
            async move {
                answers.update(|p| p.cursor = cursor.unwrap_or_default());
                // GetMap goes out first, on the dump's connection; the
                // first chunk waits for its answer.
                // Dropping the handle (the run was dropped) cancels it.
                let mut types = typed.then(|| {
                    let (client, map) = (client.clone(), map.clone());
                    let (task, handle) = async move {
                        let info = Self::timed(connect_timeout, client.get_map(&map)).await;
                        info.ok()
                            .and_then(|i| MapTypes::from_info(&i).ok().flatten())
                            .map(Arc::new)
                    }
                    .remote_handle();
                    tokio::spawn(task);
                    handle
                });
                let mut known: Option<Arc<MapTypes>> = None;
                let mut dump = client.dump(map, options);
                let mut wait = connect_timeout;
                loop {
                    let chunk = match tokio::time::timeout(wait, dump.next_chunk()).await {
                        Ok(c) => c.map_err(status_of)?,
                        // Still retrying: the failure it retries after says
                        // more than the time it took.
                        Err(_) => match dump.last_failure() {
                            Some((code, message)) => {
                                return Err(Status::new(
                                    code,
                                    format!(
                                        "{message} (still failing after {} s)",
                                        wait.as_secs_f64()
                                    ),
                                ));
                            }
                            None => {
                                return Err(Status::deadline_exceeded(format!(
                                    "no answer within {} s",
                                    wait.as_secs_f64()
                                )));
                            }
                        },
                    };
                    wait = idle_timeout;
                    let resumes = dump.resumes();
                    let Some(chunk) = chunk else { break };
                    let cursor = chunk.cursor().to_owned();
                    let n = chunk.len() as u64;
                    if let Some(task) = types.take() {
                        known = task.await;
                    }
                    if !answers.send(answer(chunk, known.clone())).await {
                        return Err(Status::cancelled("the run was dropped"));
                    }
                    answers.update(|p| {
                        p.entries += n;
                        p.cursor = cursor;
                        p.resumes = resumes;
                    });
                }
                let (complete, resumes, cursor) =
                    (dump.complete(), dump.resumes(), dump.cursor().to_owned());
                answers.update(|p| {
                    p.complete = complete;
                    p.resumes = resumes;
                    p.cursor = cursor;
                });
                Ok(())
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn targets_parse_and_refuse_what_is_not_host_port() {
        for (s, want) in [
            ("10.0.0.7:50051", "10.0.0.7:50051"),
            (
                "http://node-1.example.org:50051",
                "node-1.example.org:50051",
            ),
            ("https://[fd00::1]:50051/", "[fd00::1]:50051"),
            ("localhost:1", "localhost:1"),
        ] {
            assert_eq!(s.parse::<Target>().unwrap().as_str(), want, "{s}");
        }
        for bad in [
            "10.0.0.7",
            "10.0.0.7:",
            ":50051",
            "host:99999",
            "fd00::1:50051",
            "a b:1",
            "x:y",
            "",
        ] {
            assert!(bad.parse::<Target>().is_err(), "{bad:?}");
        }
        let t: Target = "10.0.0.7:50051".parse().unwrap();
        assert_eq!(t.url(true), "https://10.0.0.7:50051");
        assert_eq!(t.url(false), "http://10.0.0.7:50051");
    }

    #[test]
    fn a_fleet_drops_duplicate_targets_and_keeps_the_order() {
        let t = |s: &str| s.parse::<Target>().unwrap();
        let fleet = Fleet::new(
            [t("b:1"), t("a:1"), t("http://b:1"), t("a:2")],
            ConnectOptions::default(),
        );
        assert_eq!(fleet.targets(), [t("b:1"), t("a:1"), t("a:2")]);
    }
}
