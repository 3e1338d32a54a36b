//! A fleet reached through bpfmap-relay
//! ([`Fleet::via_relay`](crate::Fleet::via_relay)): the link to the relay,
//! and a run of one of its calls turned into the [`FleetRun`] a fleet
//! reached directly gives. Each fleet call is one call of
//! `bpfmap.v1.FleetService`; the relay fans out, resumes each target's
//! dump or watch and computes the exact top K, and each target's answers
//! and its end come back named. The calls whose answers are the fleet
//! modules' own (dumps, aggregates, watches) are turned into events there.

use std::{
    collections::{HashMap, HashSet},
    sync::Arc,
    time::{Duration, Instant},
};

use tokio::sync::mpsc;
use tonic::{Code, Status, Streaming, transport::Channel};

use crate::{
    Client, ConnectOptions, Error, FleetEvent, FleetRun, Key, ListMapsOptions, LookupOptions,
    LookupResult, MapInfo, MapName, Scan, Target, TargetReport, lookup::LookupCall, pb,
    pb::fleet_service_client::FleetServiceClient,
};

/// Largest message accepted from a relay.
const MAX_DECODE: usize = 64 << 20;

/// How a fleet reaches its relay.
#[derive(Debug, Clone)]
pub(crate) struct RelayLink {
    pub(crate) client: FleetServiceClient<Channel>,
}

type Events<T> = mpsc::Sender<FleetEvent<T>>;

/// What a call through the relay is made on: the fleet's targets, and the
/// run's deadline.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Scope<'a> {
    pub(crate) targets: &'a [Target],
    pub(crate) deadline: Option<Duration>,
}

impl RelayLink {
    /// Connects to the relay at `addr`: the link, and the targets the relay
    /// knows now.
    pub(crate) async fn connect(
        addr: &str,
        connect: ConnectOptions,
    ) -> Result<(Self, Vec<Target>), Error> {
        let channel = Client::connect(addr, connect).await?.channel().clone();
        let mut client = FleetServiceClient::new(channel).max_decoding_message_size(MAX_DECODE);
        let known: Vec<Target> = client
            .list_targets(pb::ListTargetsRequest {})
            .await?
            .into_inner()
            .targets
            .into_iter()
            .filter_map(|t| t.target.parse().ok())
            .collect();
        Ok((Self { client }, known))
    }
}

impl RelayLink {
    /// The selector of a call on `targets`.
    pub(crate) fn selector(targets: &[Target]) -> Option<pb::TargetSelector> {
        Some(pb::TargetSelector {
            targets: targets.iter().map(|t| t.as_str().to_owned()).collect(),
        })
    }

    pub(crate) fn list_maps(
        &self,
        scope: Scope<'_>,
        options: &ListMapsOptions,
    ) -> FleetRun<Vec<MapInfo>> {
        let req = pb::FleetServiceListMapsRequest {
            request: Some(options.to_proto()),
            targets: Self::selector(scope.targets),
        };
        let client = self.client.clone();
        per_target(
            scope,
            move |d| async move { client.clone().list_maps(d.request(req)).await },
            |msg| {
                use pb::fleet_service_list_maps_response::Answer;
                let answer = match msg.answer {
                    Some(Answer::Maps(m)) => Ok(m.maps.into_iter().map(MapInfo::from).collect()),
                    Some(Answer::Status(s)) => Err(status_error(&s)),
                    None => Err(no_answer()),
                };
                (msg.target, answer)
            },
        )
    }

    pub(crate) fn get_map(&self, scope: Scope<'_>, map: &MapName) -> FleetRun<MapInfo> {
        let req = pb::FleetServiceGetMapRequest {
            request: Some(pb::GetMapRequest {
                map: Some(map.to_proto()),
            }),
            targets: Self::selector(scope.targets),
        };
        let client = self.client.clone();
        per_target(
            scope,
            move |d| async move { client.clone().get_map(d.request(req)).await },
            |msg| {
                use pb::fleet_service_get_map_response::Answer;
                let answer = match msg.answer {
                    Some(Answer::Map(m)) => Ok(MapInfo::from(m)),
                    Some(Answer::Status(s)) => Err(status_error(&s)),
                    None => Err(no_answer()),
                };
                (msg.target, answer)
            },
        )
    }

    pub(crate) fn lookup(
        &self,
        scope: Scope<'_>,
        map: &MapName,
        keys: Vec<Key>,
        options: &LookupOptions,
    ) -> FleetRun<Vec<LookupResult>> {
        let call = Arc::new(LookupCall::new(map, keys, options));
        let req = pb::FleetServiceLookupRequest {
            request: Some(call.request.clone()),
            targets: Self::selector(scope.targets),
        };
        let client = self.client.clone();
        let checked = call.check();
        per_target(
            scope,
            move |d| async move {
                checked.map_err(|e| Status::invalid_argument(e.to_string()))?;
                client.clone().lookup(d.request(req)).await
            },
            move |msg| {
                use pb::fleet_service_lookup_response::Answer;
                let answer = match msg.answer {
                    Some(Answer::Results(r)) => call.results(r.results),
                    Some(Answer::Status(s)) => Err(status_error(&s)),
                    None => Err(no_answer()),
                };
                (msg.target, answer)
            },
        )
    }
}

/// A call's deadline: how long it may take, and when that passes.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Deadline {
    length: Option<Duration>,
    end: Option<tokio::time::Instant>,
}

impl Deadline {
    pub(crate) fn start(length: Option<Duration>) -> Self {
        let end = length.and_then(|d| tokio::time::Instant::now().checked_add(d));
        Self { length, end }
    }

    /// `msg` as a request telling the relay the time left (`grpc-timeout`:
    /// the relay then ends the targets not done in time in-band).
    pub(crate) fn request<T>(&self, msg: T) -> tonic::Request<T> {
        let mut req = tonic::Request::new(msg);
        if let Some(end) = self.end {
            req.set_timeout(end.saturating_duration_since(tokio::time::Instant::now()));
        }
        req
    }

    /// Runs `fut` until the deadline.
    pub(crate) async fn within<T>(
        &self,
        fut: impl Future<Output = Result<T, Status>>,
    ) -> Result<T, Error> {
        match self.end {
            None => Ok(fut.await?),
            Some(end) => match tokio::time::timeout_at(end, fut).await {
                Ok(result) => Ok(result?),
                Err(_) => Err(self.passed()),
            },
        }
    }

    fn passed(&self) -> Error {
        Error::Deadline {
            deadline: self.length.unwrap_or_default(),
        }
    }
}

/// The same error again, for each target it ends.
pub(crate) fn copy(e: &Error) -> Error {
    match e {
        Error::Status(s) => Error::Status(s.clone()),
        Error::Deadline { deadline } => Error::Deadline {
            deadline: *deadline,
        },
        Error::Protocol(p) => Error::Protocol(p.clone()),
        other => Error::Status(Status::new(other.code(), other.to_string())),
    }
}

/// A run of calls answered once per target (ListMaps, GetMap, Lookup):
/// each message's target and answer, as `answer` reads them.
fn per_target<M, T, C, Fut, F>(scope: Scope<'_>, call: C, mut answer: F) -> FleetRun<T>
where
    M: Send + 'static,
    T: Send + 'static,
    C: FnOnce(Deadline) -> Fut + Send + 'static,
    Fut: Future<Output = Result<tonic::Response<Streaming<M>>, Status>> + Send,
    F: FnMut(M) -> (String, Result<T, Error>) + Send + 'static,
{
    let targets = scope.targets.to_vec();
    let deadline = Deadline::start(scope.deadline);
    FleetRun::spawn(targets.clone(), 16, move |tx| async move {
        let mut run = Run::new(targets, tx);
        let mut call = Some(call);
        let once = move |_resume: String, d: Deadline| {
            let call = call.take();
            async move {
                match call {
                    Some(call) => call(d).await,
                    None => Err(Status::unavailable("the relay's answer broke off")),
                }
            }
        };
        run.drive(deadline, once, |run, msg| {
            let (target, result) = answer(msg);
            run.answered(target, result)
        })
        .await;
    })
}

/// What a run through the relay tracks: the targets, each one's progress
/// until its report, and the fleet cursor that resumes the call.
pub(crate) struct Run<T> {
    pub(crate) targets: Vec<Target>,
    tx: Events<T>,
    started: Instant,
    pub(crate) progress: HashMap<String, Progress>,
    reported: HashSet<String>,
    /// The last fleet cursor the relay sent (a dump's message, a watch's
    /// round end): where the call resumes when its stream breaks.
    pub(crate) resume: String,
    /// Times the call was resumed.
    resumes: u32,
}

/// A target's progress, for its report.
#[derive(Default)]
pub(crate) struct Progress {
    pub(crate) entries: u64,
    pub(crate) scanned: u64,
    pub(crate) calls: u32,
    pub(crate) cursor: String,
}

/// The events one message of the relay turns into.
pub(crate) type Step<T> = Vec<FleetEvent<T>>;

/// Resumes of a broken call to the relay before its targets fail.
const RESUMES: u32 = 5;

impl<T: Send + 'static> Run<T> {
    pub(crate) fn new(targets: Vec<Target>, tx: Events<T>) -> Self {
        Self {
            targets,
            tx,
            started: Instant::now(),
            progress: HashMap::new(),
            reported: HashSet::new(),
            resume: String::new(),
            resumes: 0,
        }
    }

    /// The target the relay names `name`.
    pub(crate) fn target(&self, name: &str) -> Target {
        self.targets
            .iter()
            .find(|t| t.as_str() == name)
            .cloned()
            .or_else(|| name.parse().ok())
            .unwrap_or_else(|| Target::from_socket_addr(([0, 0, 0, 0], 0).into()))
    }

    /// Whether `name` is one of the run's targets not reported yet (a
    /// message about any other is left out).
    pub(crate) fn open(&self, name: &str) -> bool {
        !self.reported.contains(name) && self.targets.iter().any(|t| t.as_str() == name)
    }

    /// The report of `name`, with `error`, and notes it sent.
    pub(crate) fn report(
        &mut self,
        name: &str,
        error: Option<Error>,
        complete: bool,
    ) -> FleetEvent<T> {
        self.reported.insert(name.to_owned());
        let p = self.progress.remove(name).unwrap_or_default();
        FleetEvent::Done(TargetReport {
            target: self.target(name),
            error,
            entries: p.entries,
            scanned: p.scanned,
            calls: p.calls,
            complete,
            resumes: self.resumes,
            cursor: p.cursor,
            elapsed: self.started.elapsed(),
        })
    }

    /// One target's single answer, then its report.
    fn answered(&mut self, target: String, result: Result<T, Error>) -> Step<T> {
        if !self.open(&target) {
            return Vec::new();
        }
        match result {
            Ok(answer) => {
                self.progress.entry(target.clone()).or_default().calls = 1;
                let t = self.target(&target);
                vec![
                    FleetEvent::Answer { target: t, answer },
                    self.report(&target, None, false),
                ]
            }
            Err(e) => vec![self.report(&target, Some(e), false)],
        }
    }

    /// Calls the relay (`call`, given the fleet cursor to resume from, empty
    /// at first) and reads its stream, sending what `step` makes of each
    /// message; a stream that breaks as retrying can help (the relay
    /// restarts) is called again from the last fleet cursor, up to
    /// [`RESUMES`] times; targets without a report in the end get one.
    pub(crate) async fn drive<M, C, Fut>(
        &mut self,
        deadline: Deadline,
        mut call: C,
        mut step: impl FnMut(&mut Self, M) -> Step<T>,
    ) where
        C: FnMut(String, Deadline) -> Fut,
        Fut: Future<Output = Result<tonic::Response<Streaming<M>>, Status>>,
    {
        loop {
            let stream = deadline.within(call(self.resume.clone(), deadline)).await;
            let failure = match stream {
                Ok(s) => match self.read(s.into_inner(), deadline, &mut step).await {
                    Some(failure) => failure,
                    None => return, // the run was dropped
                },
                Err(e) => e,
            };
            // Every target has its report: how the stream ended changes
            // nothing (a resumed call would only wait and find nothing).
            if self.all_reported() {
                return;
            }
            let again = failure
                .status()
                .is_some_and(crate::RetryPolicy::should_retry);
            if !again || self.resume.is_empty() || self.resumes >= RESUMES {
                return self.fail_all(|| copy(&failure)).await;
            }
            self.resumes += 1;
            let pause = Duration::from_millis(250 << self.resumes);
            if deadline
                .within(async {
                    tokio::time::sleep(pause).await;
                    Ok(())
                })
                .await
                .is_err()
            {
                return self.fail_all(|| deadline.passed()).await;
            }
        }
    }

    /// Whether every target has its report.
    fn all_reported(&self) -> bool {
        self.targets
            .iter()
            .all(|t| self.reported.contains(t.as_str()))
    }

    /// Reads one stream of the relay: `None` when the run was dropped or
    /// every target has its report (the stream's end is not waited for),
    /// else how the stream ended.
    async fn read<M>(
        &mut self,
        mut stream: Streaming<M>,
        deadline: Deadline,
        step: &mut impl FnMut(&mut Self, M) -> Step<T>,
    ) -> Option<Error> {
        loop {
            let next = match deadline.within(stream.message()).await {
                Ok(next) => next,
                Err(e) => return Some(e),
            };
            let Some(msg) = next else {
                return Some(Error::Status(Status::unavailable(
                    "the relay ended the call without this target's end",
                )));
            };
            for event in step(self, msg) {
                if self.tx.send(event).await.is_err() {
                    return None;
                }
            }
            if self.all_reported() {
                return None;
            }
        }
    }

    /// Sends `events` in order, until the run is dropped.
    pub(crate) async fn send_all(&mut self, events: Step<T>) {
        for event in events {
            if self.tx.send(event).await.is_err() {
                return;
            }
        }
    }

    /// Reports every target not reported yet with the error `error`
    /// makes.
    pub(crate) async fn fail_all(&mut self, error: impl Fn() -> Error) {
        for t in self.targets.clone() {
            if !self.reported.contains(t.as_str()) {
                let event = self.report(t.as_str(), Some(error()), false);
                if self.tx.send(event).await.is_err() {
                    return;
                }
            }
        }
    }
}

impl Run<Scan> {
    pub(crate) fn watch_message(
        &mut self,
        msg: pb::FleetServiceWatchMapResponse,
        parts: &mut HashMap<String, Vec<pb::WatchMapResponse>>,
    ) -> Step<Scan> {
        use pb::fleet_service_watch_map_response::Part;
        if let Some(Part::RoundEnd(end)) = &msg.part {
            // Scans after a round's end are sent again when the call
            // resumes from its cursor: what is pending is dropped.
            self.resume.clone_from(&end.cursor);
            return Vec::new();
        }
        if !self.open(&msg.target) {
            return Vec::new();
        }
        match msg.part {
            Some(Part::Scan(part)) => {
                let ends = part.bookmark.is_some();
                let pending = parts.entry(msg.target.clone()).or_default();
                pending.push(part);
                if !ends {
                    return Vec::new();
                }
                let scan = Scan::from_parts(parts.remove(&msg.target).unwrap_or_default());
                let p = self.progress.entry(msg.target.clone()).or_default();
                p.entries += (scan.events().len() + scan.groups().len()) as u64;
                p.scanned += scan.bookmark().entries_scanned;
                p.calls += 1;
                p.cursor = scan.cursor().to_owned();
                vec![FleetEvent::Answer {
                    target: self.target(&msg.target),
                    answer: scan,
                }]
            }
            Some(Part::Failing(s)) => {
                parts.remove(&msg.target);
                vec![FleetEvent::Retrying {
                    target: self.target(&msg.target),
                    error: status_error(&s),
                }]
            }
            Some(Part::Ended(s)) => {
                let error = (s.code != "OK").then(|| status_error(&s));
                vec![self.report(&msg.target, error, false)]
            }
            Some(Part::RoundEnd(_)) | None => Vec::new(),
        }
    }
}

/// A target's status, as the relay names it, as the error it stands for
/// (with its reason, as a daemon's own status carries it).
pub(crate) fn status_error(s: &pb::TargetStatus) -> Error {
    let code = (0..=16)
        .map(Code::from_i32)
        .find(|c| crate::code_name(*c) == s.code)
        .unwrap_or(Code::Unknown);
    Error::Status(match s.reason.as_str() {
        "" => Status::new(code, s.message.clone()),
        reason => bpfmap_proto::status::with_reason(code, s.message.clone(), reason),
    })
}

/// What a one-answer fleet call through the relay (HistogramMap, StackMap)
/// says of its targets: those it answered for, those that failed and
/// their statuses, what each daemon did.
pub(crate) struct OneAnswer<'a> {
    pub(crate) answered: &'a [String],
    pub(crate) failed: &'a [pb::TargetFailure],
    pub(crate) work: &'a [pb::TargetWork],
}

impl OneAnswer<'_> {
    /// A report per target of `targets`, in their order (a target the
    /// answer does not name is reported UNAVAILABLE), with the status its
    /// failure came with.
    pub(crate) fn reports(
        &self,
        targets: &[crate::Target],
        started: std::time::Instant,
    ) -> Vec<(crate::TargetReport, Option<pb::TargetStatus>)> {
        targets
            .iter()
            .map(|t| {
                let name = t.as_str();
                let status = self
                    .failed
                    .iter()
                    .find(|f| f.target == name)
                    .map(|f| f.status.clone().unwrap_or_default());
                let error = match (self.answered.iter().any(|a| a == name), &status) {
                    (true, _) => None,
                    (false, Some(s)) => Some(status_error(s)),
                    (false, None) => Some(Error::Status(Status::unavailable(
                        "the relay said nothing of this target",
                    ))),
                };
                let w = self.work.iter().find(|w| w.target == name);
                let report = crate::TargetReport {
                    target: t.clone(),
                    error,
                    entries: w.map_or(0, |w| w.groups),
                    scanned: w.map_or(0, |w| w.entries_scanned),
                    calls: w.map_or(0, |w| w.calls),
                    complete: false,
                    resumes: 0,
                    cursor: String::new(),
                    elapsed: started.elapsed(),
                };
                (report, status)
            })
            .collect()
    }
}

fn no_answer() -> Error {
    Error::Protocol("the relay sent a message without an answer".into())
}
