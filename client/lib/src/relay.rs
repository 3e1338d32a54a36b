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
        let mut client = self.client.clone();
        per_target(fleet, async move { client.list_maps(req).await }, |msg| {
            use pb::fleet_service_list_maps_response::Answer;
            let answer = match msg.answer {
                Some(Answer::Maps(m)) => Ok(m.maps.into_iter().map(MapInfo::from).collect()),
                Some(Answer::Status(s)) => Err(status_error(&s)),
                None => Err(no_answer()),
            };
            (msg.target, answer)
        })
    }

    pub(crate) fn get_map(&self, fleet: &Fleet, map: &MapName) -> FleetRun<MapInfo> {
        let req = pb::FleetServiceGetMapRequest {
            request: Some(pb::GetMapRequest {
                map: Some(map.to_proto()),
            }),
            targets: Self::selector(fleet.targets()),
        };
        let mut client = self.client.clone();
        per_target(fleet, async move { client.get_map(req).await }, |msg| {
            use pb::fleet_service_get_map_response::Answer;
            let answer = match msg.answer {
                Some(Answer::Map(m)) => Ok(MapInfo::from(m)),
                Some(Answer::Status(s)) => Err(status_error(&s)),
                None => Err(no_answer()),
            };
            (msg.target, answer)
        })
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
        let mut client = self.client.clone();
        let checked = call.check();
        per_target(
            fleet,
            async move {
                checked.map_err(|e| Status::invalid_argument(e.to_string()))?;
                client.lookup(req).await
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
        let deadline = fleet.options().deadline();
        FleetRun::spawn(targets.clone(), 16, move |tx| async move {
            let mut run = Run::new(targets, tx);
            let types = if options.types {
                link.types(&run.targets, &map, &options).await
            } else {
                HashMap::new()
            };
            let req = pb::FleetServiceDumpMapRequest {
                request: Some(options.dump.request(&map, "", options.dump.limit())),
                targets: Self::selector(&run.targets),
                cursor: String::new(),
                target_cursors: options
                    .cursors
                    .iter()
                    .map(|(t, c)| (t.as_str().to_owned(), c.clone()))
                    .collect(),
            };
            let mut client = link.client.clone();
            let stream = within(deadline, async move { client.dump_map(req).await }).await;
            run.stream(stream, deadline, |run, msg| run.dump_message(msg, &types))
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
    ) -> HashMap<String, Arc<MapTypes>> {
        let req = pb::FleetServiceGetMapRequest {
            request: Some(pb::GetMapRequest {
                map: Some(map.to_proto()),
            }),
            targets: Self::selector(targets),
        };
        let mut types = HashMap::new();
        let Ok(answer) = self.client.clone().get_map(req).await else {
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
        let deadline = fleet.options().deadline();
        let buffer = targets.len() + 1;
        FleetRun::spawn(targets.clone(), buffer, move |tx| async move {
            let mut run = Run::new(targets, tx);
            let answer = within(deadline, async move { client.aggregate_map(req).await }).await;
            let answer = match answer.map(tonic::Response::into_inner) {
                Ok(a) => a,
                Err(e) => return run.fail_all(|| copy(&e)).await,
            };
            run.aggregate_answer(answer).await;
        })
    }

    pub(crate) fn watch(
        &self,
        fleet: &Fleet,
        map: &MapName,
        options: FleetWatchOptions,
    ) -> FleetRun<Scan> {
        let req = pb::FleetServiceWatchMapRequest {
            request: Some(options.watch.request(map, "")),
            targets: Self::selector(fleet.targets()),
            cursor: String::new(),
            target_cursors: options
                .cursors
                .iter()
                .map(|(t, c)| (t.as_str().to_owned(), c.clone()))
                .collect(),
        };
        let (mut client, targets) = (self.client.clone(), fleet.targets().to_vec());
        let deadline = fleet.options().deadline();
        FleetRun::spawn(targets.clone(), 16, move |tx| async move {
            let mut run = Run::new(targets, tx);
            let stream = within(deadline, async move { client.watch_map(req).await }).await;
            let mut parts: HashMap<String, Vec<pb::WatchMapResponse>> = HashMap::new();
            run.stream(stream, deadline, |run, msg| {
                run.watch_message(msg, &mut parts)
            })
            .await;
        })
    }
}

/// Runs `fut`, within `deadline` if there is one.
async fn within<T>(
    deadline: Option<Duration>,
    fut: impl Future<Output = Result<T, Status>>,
) -> Result<T, Error> {
    match deadline {
        None => Ok(fut.await?),
        Some(d) => match tokio::time::timeout(d, fut).await {
            Ok(result) => Ok(result?),
            Err(_) => Err(Error::Deadline { deadline: d }),
        },
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

/// The error of a run whose deadline passed.
fn past(deadline: Option<Duration>) -> Error {
    Error::Deadline {
        deadline: deadline.unwrap_or_default(),
    }
}

/// A run of calls answered once per target (ListMaps, GetMap, Lookup):
/// each message's target and answer, as `answer` reads them.
fn per_target<M, T, F>(
    fleet: &Fleet,
    call: impl Future<Output = Result<tonic::Response<Streaming<M>>, Status>> + Send + 'static,
    mut answer: F,
) -> FleetRun<T>
where
    M: Send + 'static,
    T: Send + 'static,
    F: FnMut(M) -> (String, Result<T, Error>) + Send + 'static,
{
    let targets = fleet.targets().to_vec();
    let deadline = fleet.options().deadline();
    FleetRun::spawn(targets.clone(), 16, move |tx| async move {
        let mut run = Run::new(targets, tx);
        let stream = within(deadline, call).await;
        run.stream(stream, deadline, |run, msg| {
            let (target, result) = answer(msg);
            run.answered(target, result)
        })
        .await;
    })
}

/// What a run through the relay tracks: the targets, and each one's
/// progress until its report.
struct Run<T> {
    targets: Vec<Target>,
    tx: Events<T>,
    started: Instant,
    progress: HashMap<String, Progress>,
    reported: HashSet<String>,
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

impl<T: Send + 'static> Run<T> {
    fn new(targets: Vec<Target>, tx: Events<T>) -> Self {
        Self {
            targets,
            tx,
            started: Instant::now(),
            progress: HashMap::new(),
            reported: HashSet::new(),
        }
    }

    fn target(&self, name: &str) -> Target {
        self.targets
            .iter()
            .find(|t| t.as_str() == name)
            .cloned()
            .or_else(|| name.parse().ok())
            .unwrap_or_else(|| self.targets[0].clone())
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
            resumes: 0,
            cursor: p.cursor,
            elapsed: self.started.elapsed(),
        })
    }

    /// One target's single answer, then its report.
    fn answered(&mut self, target: String, result: Result<T, Error>) -> Step<T> {
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

    /// Reads the relay's stream to its end, sending what `step` makes of
    /// each message; targets without a report then get one (the call's
    /// error, or that the relay said nothing of them).
    async fn stream<M>(
        &mut self,
        stream: Result<tonic::Response<Streaming<M>>, Error>,
        deadline: Option<Duration>,
        mut step: impl FnMut(&mut Self, M) -> Step<T>,
    ) {
        let mut stream = match stream {
            Ok(s) => s.into_inner(),
            Err(e) => return self.fail_all(|| copy(&e)).await,
        };
        let end = deadline.map(|d| tokio::time::Instant::now() + d);
        let failure = loop {
            let next = match end {
                Some(end) => match tokio::time::timeout_at(end, stream.message()).await {
                    Ok(next) => next,
                    Err(_) => break past(deadline),
                },
                None => stream.message().await,
            };
            match next {
                Ok(Some(msg)) => {
                    for event in step(self, msg) {
                        if self.tx.send(event).await.is_err() {
                            return; // the run was dropped
                        }
                    }
                }
                Ok(None) => {
                    break Error::Status(Status::unavailable(
                        "the relay ended the call without this target's end",
                    ));
                }
                Err(status) => break Error::Status(status),
            }
        };
        self.fail_all(|| copy(&failure)).await;
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
    /// The targets' reports, then the fleet's answer.
    async fn aggregate_answer(&mut self, answer: pb::FleetServiceAggregateMapResponse) {
        for w in &answer.work {
            let p = self.progress.entry(w.target.clone()).or_default();
            (p.entries, p.scanned, p.calls) = (w.groups, w.entries_scanned, w.calls);
        }
        let mut events = Vec::new();
        for t in &answer.answered {
            events.push(self.report(t, None, false));
        }
        let mut missing = Vec::new();
        for f in &answer.failed {
            let status = f.status.clone().unwrap_or_default();
            missing.push(self.target(&f.target));
            events.push(self.report(&f.target, Some(status_error(&status)), false));
        }
        let groups: Result<Vec<FleetGroup>, Error> = answer
            .groups
            .into_iter()
            .map(|g| {
                Ok(FleetGroup {
                    group: Group::from_proto(g.group.unwrap_or_default())?,
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
        let method = match answer.method.as_str() {
            "top_k" => MergeMethod::Threshold,
            "merge" => MergeMethod::AllGroups,
            _ => MergeMethod::Groups,
        };
        for t in self.targets.clone() {
            if !self.reported.contains(t.as_str()) {
                let silent = Status::unavailable("the relay said nothing of this target");
                events.push(self.report(t.as_str(), Some(Error::Status(silent)), false));
            }
        }
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
