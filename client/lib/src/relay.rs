//! A fleet reached through bpfmap-relay ([`Fleet::via_relay`]): the same
//! calls and the same [`FleetRun`]s as a fleet reached directly, each
//! served by one call of `bpfmap.v1.FleetService` over one connection. The
//! relay fans out, resumes each target's dump or watch, and computes the
//! exact top K; each target's answers and its end come back named, and are
//! turned into the same [`FleetEvent`]s.

use std::{
    collections::{HashMap, HashSet},
    sync::Arc,
    time::{Duration, Instant},
};

use tokio::sync::mpsc;
use tonic::{Code, Status, Streaming, transport::Channel};

use crate::{
    Chunk, Client, ConnectOptions, Error, Fleet, FleetAggregate, FleetAggregateOptions, FleetChunk,
    FleetDumpOptions, FleetEvent, FleetGroup, FleetRun, FleetWatchOptions, Group, Key,
    ListMapsOptions, LookupOptions, LookupResult, MapInfo, MapName, MapTypes, MergeMethod, Scan,
    Target, TargetReport, lookup::LookupCall, pb, pb::fleet_service_client::FleetServiceClient,
};

/// Largest message accepted from a relay.
const MAX_DECODE: usize = 64 << 20;

/// How a fleet reaches its relay.
#[derive(Debug, Clone)]
pub(crate) struct RelayLink {
    client: FleetServiceClient<Channel>,
}

type Events<T> = mpsc::Sender<FleetEvent<T>>;

impl Fleet {
    /// A fleet behind the bpfmap-relay at `addr` ("http://relay:50061",
    /// or "https://..." with TLS in `connect`): every call of the fleet is
    /// one call to the relay, which reaches the targets with its own
    /// certificate, resumes their dumps and watches, and merges aggregates.
    /// `targets` are target names as the relay lists them
    /// (`ListTargets`); none: every target the relay knows now. A target
    /// the relay does not know is INVALID_ARGUMENT. The fleet's options
    /// ([`FleetOptions`](crate::FleetOptions)) are the relay's own
    /// (concurrency, answer timeout); its deadline, if any, bounds each
    /// call.
    pub async fn via_relay(
        addr: &str,
        connect: ConnectOptions,
        targets: impl IntoIterator<Item = Target>,
    ) -> Result<Self, Error> {
        let channel = Client::connect(addr, connect.clone())
            .await?
            .channel()
            .clone();
        let mut client = FleetServiceClient::new(channel).max_decoding_message_size(MAX_DECODE);
        let known: Vec<Target> = client
            .list_targets(pb::ListTargetsRequest {})
            .await?
            .into_inner()
            .targets
            .into_iter()
            .filter_map(|t| t.target.parse().ok())
            .collect();
        let mut chosen: Vec<Target> = targets.into_iter().collect();
        if let Some(t) = chosen.iter().find(|t| !known.contains(t)) {
            return Err(Status::invalid_argument(format!(
                "target {t} is not one of the relay's ({} targets; `ListTargets` lists them)",
                known.len()
            ))
            .into());
        }
        if chosen.is_empty() {
            chosen = known;
        }
        let mut fleet = Fleet::new(chosen, connect);
        fleet.relay = Some(RelayLink { client });
        Ok(fleet)
    }

    /// The same fleet on `targets` only (for a relay: target names as it
    /// lists them).
    pub fn with_targets(mut self, targets: impl IntoIterator<Item = Target>) -> Self {
        let relay = self.relay.take();
        let mut fleet = Fleet::new(targets, self.connect.clone()).with_options(self.options);
        fleet.relay = relay;
        fleet
    }
}

impl RelayLink {
    fn selector(targets: &[Target]) -> Option<pb::TargetSelector> {
        Some(pb::TargetSelector {
            targets: targets.iter().map(|t| t.as_str().to_owned()).collect(),
        })
    }

    pub(crate) fn list_maps(
        &self,
        fleet: &Fleet,
        options: &ListMapsOptions,
    ) -> FleetRun<Vec<MapInfo>> {
        let req = pb::FleetServiceListMapsRequest {
            request: Some(options.to_proto()),
            targets: Self::selector(fleet.targets()),
        };
        let client = self.client.clone();
        per_target(
            fleet,
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

    pub(crate) fn get_map(&self, fleet: &Fleet, map: &MapName) -> FleetRun<MapInfo> {
        let req = pb::FleetServiceGetMapRequest {
            request: Some(pb::GetMapRequest {
                map: Some(map.to_proto()),
            }),
            targets: Self::selector(fleet.targets()),
        };
        let client = self.client.clone();
        per_target(
            fleet,
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
        fleet: &Fleet,
        map: &MapName,
        keys: Vec<Key>,
        options: &LookupOptions,
    ) -> FleetRun<Vec<LookupResult>> {
        let call = Arc::new(LookupCall::new(map, keys, options));
        let req = pb::FleetServiceLookupRequest {
            request: Some(call.request.clone()),
            targets: Self::selector(fleet.targets()),
        };
        let client = self.client.clone();
        let checked = call.check();
        per_target(
            fleet,
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

    pub(crate) fn dump(
        &self,
        fleet: &Fleet,
        map: &MapName,
        options: FleetDumpOptions,
    ) -> FleetRun<FleetChunk> {
        let (link, map) = (self.clone(), map.clone());
        let targets = fleet.targets().to_vec();
        let deadline = Deadline::start(fleet.options().deadline());
        FleetRun::spawn(targets.clone(), 16, move |tx| async move {
            let mut run = Run::new(targets, tx);
            let types = if options.types {
                link.types(&run.targets, &map, &options, deadline).await
            } else {
                HashMap::new()
            };
            // Each target from its own cursor, else the dump's.
            let start = options.dump.cursor().unwrap_or_default().to_owned();
            let mut cursors: HashMap<String, String> = HashMap::new();
            for t in &run.targets {
                let c = options
                    .cursors
                    .get(t)
                    .cloned()
                    .unwrap_or_else(|| start.clone());
                run.progress
                    .entry(t.as_str().to_owned())
                    .or_default()
                    .cursor = c.clone();
                if !c.is_empty() {
                    cursors.insert(t.as_str().to_owned(), c);
                }
            }
            let first = pb::FleetServiceDumpMapRequest {
                request: Some(options.dump.request(&map, "", options.dump.limit())),
                targets: Self::selector(&run.targets),
                cursor: String::new(),
                target_cursors: cursors,
            };
            let client = link.client.clone();
            let call = move |resume: String, d: Deadline| {
                let mut req = first.clone();
                if !resume.is_empty() {
                    (req.cursor, req.target_cursors) = (resume, HashMap::new());
                }
                let mut client = client.clone();
                async move { client.dump_map(d.request(req)).await }
            };
            run.drive(deadline, call, |run, msg| run.dump_message(msg, &types))
                .await;
        })
    }

    /// Each target's types for `map`, through the relay's GetMap, with the
    /// dump's renderings.
    async fn types(
        &self,
        targets: &[Target],
        map: &MapName,
        options: &FleetDumpOptions,
        deadline: Deadline,
    ) -> HashMap<String, Arc<MapTypes>> {
        let req = pb::FleetServiceGetMapRequest {
            request: Some(pb::GetMapRequest {
                map: Some(map.to_proto()),
            }),
            targets: Self::selector(targets),
        };
        let mut types = HashMap::new();
        let Ok(answer) = self.client.clone().get_map(deadline.request(req)).await else {
            return types;
        };
        let mut stream = answer.into_inner();
        while let Ok(Some(msg)) = stream.message().await {
            if let Some(pb::fleet_service_get_map_response::Answer::Map(info)) = msg.answer
                && let Ok(Some(t)) = MapInfo::from(info).types_with(options.dump.render())
            {
                types.insert(msg.target, Arc::new(t));
            }
        }
        types
    }

    pub(crate) fn aggregate(
        &self,
        fleet: &Fleet,
        map: &MapName,
        options: FleetAggregateOptions,
    ) -> FleetRun<FleetAggregate> {
        let req = pb::FleetServiceAggregateMapRequest {
            request: Some(options.aggregate.request(map)),
            targets: Self::selector(fleet.targets()),
        };
        let (mut client, targets) = (self.client.clone(), fleet.targets().to_vec());
        let deadline = Deadline::start(fleet.options().deadline());
        let buffer = targets.len() + 1;
        FleetRun::spawn(targets.clone(), buffer, move |tx| async move {
            let mut run = Run::new(targets, tx);
            let answer = deadline
                .within(async move { client.aggregate_map(deadline.request(req)).await })
                .await;
            match answer.map(tonic::Response::into_inner) {
                Ok(a) => run.aggregate_answer(a).await,
                Err(e) => run.fail_all(|| copy(&e)).await,
            }
        })
    }

    pub(crate) fn watch(
        &self,
        fleet: &Fleet,
        map: &MapName,
        options: FleetWatchOptions,
    ) -> FleetRun<Scan> {
        let first = pb::FleetServiceWatchMapRequest {
            request: Some(options.watch.request(map, "")),
            targets: Self::selector(fleet.targets()),
            cursor: String::new(),
            target_cursors: options
                .cursors
                .iter()
                .map(|(t, c)| (t.as_str().to_owned(), c.clone()))
                .collect(),
        };
        let (client, targets) = (self.client.clone(), fleet.targets().to_vec());
        let deadline = Deadline::start(fleet.options().deadline());
        FleetRun::spawn(targets.clone(), 16, move |tx| async move {
            let mut run = Run::new(targets, tx);
            let call = move |resume: String, d: Deadline| {
                let mut req = first.clone();
                if !resume.is_empty() {
                    (req.cursor, req.target_cursors) = (resume, HashMap::new());
                }
                let mut client = client.clone();
                async move { client.watch_map(d.request(req)).await }
            };
            let mut parts: HashMap<String, Vec<pb::WatchMapResponse>> = HashMap::new();
            run.drive(deadline, call, |run, msg| {
                run.watch_message(msg, &mut parts)
            })
            .await;
        })
    }
}

/// A call's deadline: how long it may take, and when that passes.
#[derive(Debug, Clone, Copy)]
struct Deadline {
    length: Option<Duration>,
    end: Option<tokio::time::Instant>,
}

impl Deadline {
    fn start(length: Option<Duration>) -> Self {
        let end = length.and_then(|d| tokio::time::Instant::now().checked_add(d));
        Self { length, end }
    }

    /// `msg` as a request telling the relay the time left (`grpc-timeout`:
    /// the relay then ends the targets not done in time in-band).
    fn request<T>(&self, msg: T) -> tonic::Request<T> {
        let mut req = tonic::Request::new(msg);
        if let Some(end) = self.end {
            req.set_timeout(end.saturating_duration_since(tokio::time::Instant::now()));
        }
        req
    }

    /// Runs `fut` until the deadline.
    async fn within<T>(&self, fut: impl Future<Output = Result<T, Status>>) -> Result<T, Error> {
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
fn copy(e: &Error) -> Error {
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
fn per_target<M, T, C, Fut, F>(fleet: &Fleet, call: C, mut answer: F) -> FleetRun<T>
where
    M: Send + 'static,
    T: Send + 'static,
    C: FnOnce(Deadline) -> Fut + Send + 'static,
    Fut: Future<Output = Result<tonic::Response<Streaming<M>>, Status>> + Send,
    F: FnMut(M) -> (String, Result<T, Error>) + Send + 'static,
{
    let targets = fleet.targets().to_vec();
    let deadline = Deadline::start(fleet.options().deadline());
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
struct Run<T> {
    targets: Vec<Target>,
    tx: Events<T>,
    started: Instant,
    progress: HashMap<String, Progress>,
    reported: HashSet<String>,
    /// The last fleet cursor the relay sent (a dump's message, a watch's
    /// round end): where the call resumes when its stream breaks.
    resume: String,
    /// Times the call was resumed.
    resumes: u32,
}

#[derive(Default)]
struct Progress {
    entries: u64,
    scanned: u64,
    calls: u32,
    cursor: String,
}

/// The events one message of the relay turns into.
type Step<T> = Vec<FleetEvent<T>>;

/// Resumes of a broken call to the relay before its targets fail.
const RESUMES: u32 = 5;

impl<T: Send + 'static> Run<T> {
    fn new(targets: Vec<Target>, tx: Events<T>) -> Self {
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
    fn target(&self, name: &str) -> Target {
        self.targets
            .iter()
            .find(|t| t.as_str() == name)
            .cloned()
            .or_else(|| name.parse().ok())
            .unwrap_or_else(|| Target::from_socket_addr(([0, 0, 0, 0], 0).into()))
    }

    /// Whether `name` is one of the run's targets not reported yet (a
    /// message about any other is left out).
    fn open(&self, name: &str) -> bool {
        !self.reported.contains(name) && self.targets.iter().any(|t| t.as_str() == name)
    }

    /// The report of `name`, with `error`, and notes it sent.
    fn report(&mut self, name: &str, error: Option<Error>, complete: bool) -> FleetEvent<T> {
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
    async fn drive<M, C, Fut>(
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

    /// Reads one stream of the relay: `None` when the run was dropped, else
    /// how the stream ended.
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
        }
    }

    /// Reports every target not reported yet with the error `error`
    /// makes.
    async fn fail_all(&mut self, error: impl Fn() -> Error) {
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

impl Run<FleetChunk> {
    fn dump_message(
        &mut self,
        msg: pb::FleetServiceDumpMapResponse,
        types: &HashMap<String, Arc<MapTypes>>,
    ) -> Step<FleetChunk> {
        use pb::fleet_service_dump_map_response::Part;
        if !msg.cursor.is_empty() {
            self.resume.clone_from(&msg.cursor);
        }
        if !self.open(&msg.target) {
            return Vec::new();
        }
        match msg.part {
            Some(Part::Chunk(mut c)) => {
                let projection = c.projection.take();
                let chunk = match Chunk::from_proto(c) {
                    Ok(chunk) => chunk,
                    Err(e) => return vec![self.report(&msg.target, Some(e), false)],
                };
                let p = self.progress.entry(msg.target.clone()).or_default();
                p.entries += chunk.len() as u64;
                p.calls = 1;
                p.cursor = chunk.cursor().to_owned();
                let answer = FleetChunk {
                    chunk,
                    types: types.get(&msg.target).cloned(),
                    projection,
                };
                vec![FleetEvent::Answer {
                    target: self.target(&msg.target),
                    answer,
                }]
            }
            Some(Part::End(end)) => {
                let status = end.status.unwrap_or_default();
                let error = (status.code != "OK").then(|| status_error(&status));
                vec![self.report(&msg.target, error, end.complete)]
            }
            None => Vec::new(),
        }
    }
}

impl Run<Scan> {
    fn watch_message(
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

impl Run<FleetAggregate> {
    /// The targets' reports, then the fleet's answer; targets the answer
    /// does not name are reported failed and missing.
    async fn aggregate_answer(&mut self, answer: pb::FleetServiceAggregateMapResponse) {
        let groups: Result<Vec<FleetGroup>, Error> = answer
            .groups
            .iter()
            .map(|g| {
                Ok(FleetGroup {
                    group: Group::from_proto(g.group.clone().unwrap_or_default())?,
                    hosts: g.targets.iter().map(|t| self.target(t)).collect(),
                })
            })
            .collect();
        let groups = match groups {
            Ok(g) => g,
            Err(e) => {
                let bad = format!("the relay's answer: {e}");
                return self.fail_all(|| Error::Protocol(bad.clone())).await;
            }
        };
        for w in &answer.work {
            let p = self.progress.entry(w.target.clone()).or_default();
            (p.entries, p.scanned, p.calls) = (w.groups, w.entries_scanned, w.calls);
        }
        let answered: HashSet<&str> = answer.answered.iter().map(String::as_str).collect();
        let failed: HashMap<&str, pb::TargetStatus> = answer
            .failed
            .iter()
            .map(|f| (f.target.as_str(), f.status.clone().unwrap_or_default()))
            .collect();
        // Reports in the fleet's order, as a fleet reached directly.
        let (mut events, mut missing) = (Vec::new(), Vec::new());
        for t in self.targets.clone() {
            let name = t.as_str();
            let error = match (answered.contains(name), failed.get(name)) {
                (true, _) => None,
                (false, Some(status)) => Some(status_error(status)),
                (false, None) => Some(Error::Status(Status::unavailable(
                    "the relay said nothing of this target",
                ))),
            };
            if error.is_some() {
                missing.push(t.clone());
            }
            events.push(self.report(name, error, false));
        }
        let method = match answer.method.as_str() {
            "top_k" => MergeMethod::Threshold,
            "merge" => MergeMethod::AllGroups,
            _ => MergeMethod::Groups,
        };
        events.push(FleetEvent::Merged(FleetAggregate {
            groups,
            method,
            reports: Vec::new(),
            missing,
        }));
        for event in events {
            if self.tx.send(event).await.is_err() {
                return;
            }
        }
    }
}

/// A target's status, as the relay names it, as the error it stands for.
fn status_error(s: &pb::TargetStatus) -> Error {
    let code = (0..=16)
        .map(Code::from_i32)
        .find(|c| crate::code_name(*c) == s.code)
        .unwrap_or(Code::Unknown);
    Error::Status(Status::new(code, s.message.clone()))
}

fn no_answer() -> Error {
    Error::Protocol("the relay sent a message without an answer".into())
}
