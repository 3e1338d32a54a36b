//! One call on every host of a fleet.
//!
//! A [`Fleet`] is a list of targets and one way to connect to them. Every
//! call ([`list_maps`](Fleet::list_maps), [`get_map`](Fleet::get_map),
//! [`lookup`](Fleet::lookup), [`dump`](Fleet::dump),
//! [`watch`](Fleet::watch), [`aggregate`](Fleet::aggregate)) has the same
//! shape: it runs on every target with at most
//! [`FleetOptions::with_concurrency`] targets in flight, each over a
//! connection of its own (so that a slow or stuck target never holds the
//! flow-control window of another), each retrying as the
//! [`RetryPolicy`] of the fleet's [`ConnectOptions`] says, and returns a
//! [`FleetRun`]: a stream of [`FleetEvent`]s, the answers of each target
//! as they arrive, its retries, then its one [`TargetReport`] (and, for a
//! call that merges the targets' answers, the fleet's answer last).
//!
//! [`FleetEvent`]: crate::FleetEvent
//! [`TargetReport`]: crate::TargetReport
//!
//! A target that fails never stops the others; a map absent on some hosts
//! is NOT_FOUND for those hosts. Dropping the stream cancels the run:
//! every connection is closed and every call on the daemons stops.

use std::{
    collections::{BTreeMap, HashMap, HashSet},
    sync::Arc,
    time::Duration,
};

use futures::{FutureExt as _, future::RemoteHandle};

use crate::{
    Chunk, Client, ConnectOptions, Dump, DumpOptions, Error, FleetRun, Key, ListMapsOptions,
    LookupOptions, LookupResult, MapInfo, MapName, MapTypes, RetryPolicy, Target,
    lookup::LookupCall,
    pb,
    relay::{RelayLink, Scope},
    run::{Answers, Plan},
};

/// How a fleet run behaves.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct FleetOptions {
    concurrency: usize,
    answer_timeout: Duration,
    idle_timeout: Duration,
    deadline: Option<Duration>,
    buffer: Option<usize>,
}

/// 32 targets at once, 5 s for a first answer, 30 s between chunks, no
/// deadline.
impl Default for FleetOptions {
    fn default() -> Self {
        Self {
            concurrency: 32,
            answer_timeout: Duration::from_secs(5),
            idle_timeout: Duration::from_secs(30),
            deadline: None,
            buffer: None,
        }
    }
}

impl FleetOptions {
    /// The run's deadline, if any.
    pub(crate) fn deadline(&self) -> Option<Duration> {
        self.deadline
    }

    /// Time for a target to connect and give its first answer.
    pub(crate) fn answer_timeout(&self) -> Duration {
        self.answer_timeout
    }

    /// Answers a run holds for its reader before the targets wait (and
    /// their daemons with them).
    pub(crate) fn buffer(&self) -> usize {
        self.buffer.unwrap_or(self.concurrency.max(1) * 2)
    }

    /// Answers a run holds for a reader that has not taken them yet, before
    /// each target waits for room (and its daemon, through HTTP/2 flow
    /// control, with it); default: twice the concurrency. A program that
    /// forwards chunks (a relay) keeps it small, so that its memory follows
    /// the targets in flight rather than the answers waiting.
    pub fn with_buffer(mut self, answers: usize) -> Self {
        self.buffer = Some(answers.max(1));
        self
    }

    /// Targets in flight at once.
    pub fn concurrency(&self) -> usize {
        self.concurrency
    }

    /// Targets in flight at once (default 32; a watch, which never ends by
    /// itself, holds its place only until its first scan or failure).
    pub fn with_concurrency(mut self, targets: usize) -> Self {
        self.concurrency = targets;
        self
    }

    /// Time for a target to connect and give its first answer (default
    /// 5 s; for [`Fleet::aggregate`], each phase's answer, which comes after
    /// a whole walk of the map). A target that is up but frozen fails with
    /// DEADLINE_EXCEEDED ([`Error::Timeout`]).
    pub fn with_answer_timeout(mut self, timeout: Duration) -> Self {
        self.answer_timeout = timeout;
        self
    }

    /// The longest wait for the next chunk of a dump (default 30 s; a
    /// watch's scans come once per its interval, whatever this says).
    pub fn with_idle_timeout(mut self, timeout: Duration) -> Self {
        self.idle_timeout = timeout;
        self
    }

    /// A deadline for the whole run: targets still going then end with
    /// [`Error::Deadline`] (default none).
    pub fn with_deadline(mut self, deadline: Duration) -> Self {
        self.deadline = Some(deadline);
        self
    }
}

/// Options of a fleet dump ([`Fleet::dump`]).
#[derive(Debug, Clone, Default)]
#[non_exhaustive]
pub struct FleetDumpOptions {
    pub(crate) dump: DumpOptions,
    pub(crate) cursors: HashMap<Target, String>,
    pub(crate) types: bool,
}

impl FleetDumpOptions {
    /// Every target's dump (chunk size, limit, layout; its cursor is for the
    /// targets without one of their own).
    pub fn with_dump(mut self, dump: DumpOptions) -> Self {
        self.dump = dump;
        self
    }

    /// Each target resumes after its own cursor (from a
    /// [`TargetReport::cursor`](crate::TargetReport::cursor) of an earlier
    /// run); the others start from the beginning.
    pub fn with_cursors(mut self, cursors: impl IntoIterator<Item = (Target, String)>) -> Self {
        self.cursors.extend(cursors);
        self
    }

    /// Give each chunk with its target's [`MapTypes`], to decode it with
    /// (default: no types). They come from a GetMap sent beside the dump
    /// on the same connection (no round trip of its own), and show members
    /// as the target's configuration renders them
    /// ([`MapInfo::render`](crate::MapInfo::render)), overridden by the
    /// dump's renderings ([`DumpOptions::with_render`]); renderings that do
    /// not fit a target's types fail that target with [`Error::Render`].
    /// For a projected dump ([`DumpOptions::with_fields`]) they are the
    /// projection's instead, from the dump's first message, with the dump's
    /// renderings only.
    pub fn with_types(mut self, types: bool) -> Self {
        self.types = types;
        self
    }
}

/// A chunk of a fleet dump.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct FleetChunk {
    /// The entries.
    pub chunk: Chunk,
    /// With [`FleetDumpOptions::with_types`]: the map's key and value types
    /// on the target the chunk came from; `None` when it has none, when
    /// they could not be read (the dump then says why, if it fails too), or
    /// when they were not asked for.
    pub types: Option<Arc<MapTypes>>,
    /// On a projected dump's first chunk from a target: the records'
    /// types, as the daemon described them (`DumpMapResponse.projection`).
    pub projection: Option<pb::Projection>,
}

/// Many daemons, one way to reach them.
#[derive(Debug, Clone)]
pub struct Fleet {
    targets: Vec<Target>,
    pub(crate) connect: ConnectOptions,
    pub(crate) options: FleetOptions,
    /// Set when the fleet is reached through a relay ([`Fleet::via_relay`]).
    pub(crate) relay: Option<crate::relay::RelayLink>,
}

impl Fleet {
    /// A fleet of `targets` (duplicates dropped, order kept), reached with
    /// `connect` (with TLS, the server name of [`ClientTls`] is the name
    /// every certificate must carry when the targets are addresses).
    ///
    /// [`ClientTls`]: crate::ClientTls
    pub fn new(targets: impl IntoIterator<Item = Target>, connect: ConnectOptions) -> Self {
        let mut seen = HashSet::new();
        let targets = targets
            .into_iter()
            .filter(|t| seen.insert(t.clone()))
            .collect();
        let retry = connect.retry_or(RetryPolicy::fleet);
        Self {
            targets,
            connect: connect.with_retry(retry),
            options: FleetOptions::default(),
            relay: None,
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

    pub(crate) fn plan(&self) -> Plan {
        self.plan_of(self.targets.clone(), self.options.deadline)
    }

    /// A run on `targets` with its own deadline.
    pub(crate) fn plan_of(&self, targets: Vec<Target>, deadline: Option<Duration>) -> Plan {
        Plan {
            targets,
            connect: self.connect.clone(),
            concurrency: self.options.concurrency,
            buffer: self.options.buffer(),
            deadline,
            release_on_answer: false,
        }
    }

    /// How runs behave.
    pub(crate) fn options(&self) -> &FleetOptions {
        &self.options
    }

    /// What a call through the relay is made on.
    fn scope(&self) -> Scope<'_> {
        Scope {
            targets: self.targets(),
            deadline: self.options.deadline(),
        }
    }

    /// ListMaps on every target.
    pub fn list_maps(&self) -> FleetRun<Vec<MapInfo>> {
        self.list_maps_with(ListMapsOptions::default())
    }

    /// ListMaps on every target, narrowed as `options` say (name glob,
    /// type, owner).
    pub fn list_maps_with(&self, options: ListMapsOptions) -> FleetRun<Vec<MapInfo>> {
        if let Some(relay) = self.relay.as_ref().filter(|_| !self.targets().is_empty()) {
            return relay.list_maps(self.scope(), &options);
        }
        let timeout = self.options.answer_timeout;
        self.plan().run(move |client, answers| {
            let options = options.clone();
            async move {
                let maps = timed(timeout, client.list_maps_with(&options)).await?;
                answers.update(|p| {
                    p.entries = maps.len() as u64;
                    p.calls = 1;
                });
                answers.send(maps).await;
                Ok(())
            }
        })
    }

    /// GetMap on every target (NOT_FOUND where the map is absent).
    pub fn get_map(&self, map: &MapName) -> FleetRun<MapInfo> {
        if let Some(relay) = self.relay.as_ref().filter(|_| !self.targets().is_empty()) {
            return relay.get_map(self.scope(), map);
        }
        let timeout = self.options.answer_timeout;
        let map = map.clone();
        self.plan().run(move |client, answers| {
            let map = map.clone();
            async move {
                let info = timed(timeout, client.get_map(&map)).await?;
                answers.update(|p| {
                    p.entries = 1;
                    p.calls = 1;
                });
                answers.send(info).await;
                Ok(())
            }
        })
    }

    /// The same lookup on every target (see [`Client::lookup`]).
    pub fn lookup(
        &self,
        map: &MapName,
        keys: impl IntoIterator<Item = impl Into<Key>>,
        options: LookupOptions,
    ) -> FleetRun<Vec<LookupResult>> {
        if let Some(relay) = self.relay.as_ref().filter(|_| !self.targets().is_empty()) {
            let keys = keys.into_iter().map(Into::into).collect();
            return relay.lookup(self.scope(), map, keys, &options);
        }
        let timeout = self.options.answer_timeout;
        let call = Arc::new(LookupCall::new(map, keys, &options));
        self.plan().run(move |client, answers| {
            let call = call.clone();
            async move {
                let results = timed(timeout, client.lookup_call(&call)).await?;
                let found = results.iter().filter(|r| r.found()).count() as u64;
                answers.update(|p| {
                    p.entries = found;
                    p.calls = 1;
                });
                answers.send(results).await;
                Ok(())
            }
        })
    }

    /// Dumps `map` on every target, each from its own cursor
    /// ([`FleetDumpOptions::with_cursors`]), each chunk with the target's
    /// types if asked. Every target resumes by itself after a broken stream,
    /// as a single [`Dump`] does.
    pub fn dump(&self, map: &MapName, options: FleetDumpOptions) -> FleetRun<FleetChunk> {
        if let Some(relay) = self.relay.as_ref().filter(|_| !self.targets().is_empty()) {
            return via_relay::dump(relay, self, map, options);
        }
        let waits = Waits {
            first: self.options.answer_timeout,
            idle: self.options.idle_timeout,
        };
        let map = map.clone();
        let options = Arc::new(options);
        self.plan().run(move |client, answers| {
            dump_target(client, answers, map.clone(), options.clone(), waits)
        })
    }
}

/// Runs `fut` for at most `timeout`.
pub(crate) async fn timed<T>(
    timeout: Duration,
    fut: impl Future<Output = Result<T, Error>>,
) -> Result<T, Error> {
    tokio::time::timeout(timeout, fut)
        .await
        .unwrap_or(Err(Error::Timeout {
            after: timeout,
            retrying: None,
        }))
}

/// How long a fleet dump waits for its first chunk and for each next one.
#[derive(Debug, Clone, Copy)]
struct Waits {
    first: Duration,
    idle: Duration,
}

/// One target's part of a fleet dump.
async fn dump_target(
    client: Client,
    answers: Answers<FleetChunk>,
    map: MapName,
    options: Arc<FleetDumpOptions>,
    waits: Waits,
) -> Result<(), Error> {
    let mut dump_options = options.dump.clone();
    let cursor = options.cursors.get(&answers.target).cloned();
    if let Some(cursor) = cursor {
        dump_options = dump_options.with_cursor(cursor);
    }
    let start = dump_options.cursor().unwrap_or_default().to_owned();
    answers.update(|p| p.cursor = start);
    // A projection's records decode through the types its first message
    // gives; the map's come from a GetMap beside the dump.
    let projected = options.dump.projected();
    let mut types = (options.types && !projected)
        .then(|| types_beside(&client, &map, options.dump.render(), waits.first));
    let mut known = None;
    let mut dump = client.dump(&map, dump_options);
    let mut wait = waits.first;
    let mut described = false;
    while let Some(chunk) = next_within(&mut dump, wait, &answers).await? {
        wait = waits.idle;
        let projection = match described {
            true => None,
            false => dump.projection().map(|p| p.as_proto().clone()),
        };
        described = true;
        let (cursor, n, resumes) = (chunk.cursor().to_owned(), chunk.len(), dump.resumes());
        if let Some(task) = types.take() {
            known = task.await?;
        }
        if options.types && projected && known.is_none() {
            known = projection_types(&dump, options.dump.render())?;
        }
        let answer = FleetChunk {
            chunk,
            types: known.clone(),
            projection,
        };
        if !answers.send(answer).await {
            return Err(tonic::Status::cancelled("the run was dropped").into());
        }
        answers.update(|p| {
            p.entries += n as u64;
            p.cursor = cursor;
            p.resumes = resumes;
        });
    }
    // An empty map: renderings that do not fit still fail the target.
    if let Some(task) = types.take() {
        task.await?;
    }
    if options.types && projected && known.is_none() {
        projection_types(&dump, options.dump.render())?;
    }
    answers.update(|p| {
        p.complete = dump.complete();
        p.resumes = dump.resumes();
        p.calls = 1;
        dump.cursor().clone_into(&mut p.cursor);
    });
    Ok(())
}

/// The next chunk of `dump`, waiting at most `wait`: a dump still retrying
/// then ends with the failure it retries after, which says more than the
/// time it took.
///
/// A daemon that answers RESOURCE_EXHAUSTED (busy) is waited for as long as
/// the retry policy says ([`RetryPolicy::with_busy_wait`]), not `wait`.
async fn next_within(
    dump: &mut Dump,
    wait: Duration,
    answers: &Answers<FleetChunk>,
) -> Result<Option<Chunk>, Error> {
    let mut said = false;
    loop {
        match tokio::time::timeout(wait, dump.next_chunk()).await {
            Ok(chunk) => return chunk,
            Err(_) if dump.busy_for().is_some() => {
                if !said && let Some(status) = dump.last_failure() {
                    answers.retrying(status.clone().into()).await;
                    said = true;
                }
            }
            Err(_) => {
                return Err(Error::Timeout {
                    after: wait,
                    retrying: dump.last_failure().cloned(),
                });
            }
        }
    }
}

/// The types of a projected dump's records, with the dump's renderings,
/// once its first message described them.
fn projection_types(
    dump: &Dump,
    render: &BTreeMap<String, String>,
) -> Result<Option<Arc<MapTypes>>, Error> {
    dump.projection()
        .map(|p| p.types_with(render).map(Arc::new))
        .transpose()
}

/// The map's types, from a GetMap that goes out before the dump on the
/// dump's connection (the first chunk waits for its answer), with the
/// dump's renderings over the configured ones; `None` when the map has
/// none or GetMap failed (the dump says why, if it fails too). Renderings
/// that do not fit the types fail the target ([`Error::Render`]). Dropping
/// the handle (the run was dropped) cancels it.
fn types_beside(
    client: &Client,
    map: &MapName,
    render: &BTreeMap<String, String>,
    timeout: Duration,
) -> RemoteHandle<Result<Option<Arc<MapTypes>>, Error>> {
    let (client, map, render) = (client.clone(), map.clone(), render.clone());
    let (task, handle) = async move {
        let Ok(info) = timed(timeout, client.get_map(&map)).await else {
            return Ok(None);
        };
        match info.types_with(&render) {
            Ok(types) => Ok(types.map(Arc::new)),
            Err(e @ Error::Render { .. }) => Err(e),
            Err(_) => Ok(None),
        }
    }
    .remote_handle();
    tokio::spawn(task);
    handle
}

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
        let (link, known) = RelayLink::connect(addr, connect.clone()).await?;
        let mut chosen: Vec<Target> = targets.into_iter().collect();
        if let Some(t) = chosen.iter().find(|t| !known.contains(t)) {
            return Err(tonic::Status::invalid_argument(format!(
                "target {t} is not one of the relay's ({} targets; `ListTargets` lists them)",
                known.len()
            ))
            .into());
        }
        if chosen.is_empty() {
            chosen = known;
        }
        let mut fleet = Fleet::new(chosen, connect);
        fleet.relay = Some(link);
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

/// Fleet dumps through a relay.
mod via_relay {
    use std::collections::{BTreeMap, HashMap};
    use std::sync::Arc;

    use crate::{
        Chunk, FleetChunk, FleetDumpOptions, FleetEvent, FleetRun, MapInfo, MapName, MapTypes,
        Target, pb,
        relay::{Deadline, RelayLink, Run, Step, status_error},
    };

    use super::Fleet;

    /// A dump through the relay.
    pub(crate) fn dump(
        link: &RelayLink,
        fleet: &Fleet,
        map: &MapName,
        options: FleetDumpOptions,
    ) -> FleetRun<FleetChunk> {
        let (link, map) = (link.clone(), map.clone());
        let targets = fleet.targets().to_vec();
        let deadline = Deadline::start(fleet.options().deadline());
        FleetRun::spawn(targets.clone(), 16, move |tx| async move {
            let mut run = Run::new(targets, tx);
            let types = if options.types {
                let asked = TypesAsked {
                    targets: &run.targets,
                    map: &map,
                    render: options.dump.render(),
                };
                types(&link, asked, deadline).await
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
                targets: RelayLink::selector(&run.targets),
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

    /// The types a dump through the relay asks for: its targets', of its
    /// map, with its renderings.
    struct TypesAsked<'a> {
        targets: &'a [Target],
        map: &'a MapName,
        render: &'a BTreeMap<String, String>,
    }

    /// Each target's types for the map, through the relay's GetMap, with
    /// the dump's renderings.
    async fn types(
        link: &RelayLink,
        asked: TypesAsked<'_>,
        deadline: Deadline,
    ) -> HashMap<String, Arc<MapTypes>> {
        let req = pb::FleetServiceGetMapRequest {
            request: Some(pb::GetMapRequest {
                map: Some(asked.map.to_proto()),
            }),
            targets: RelayLink::selector(asked.targets),
        };
        let mut types = HashMap::new();
        let Ok(answer) = link.client.clone().get_map(deadline.request(req)).await else {
            return types;
        };
        let mut stream = answer.into_inner();
        while let Ok(Some(msg)) = stream.message().await {
            if let Some(pb::fleet_service_get_map_response::Answer::Map(info)) = msg.answer
                && let Ok(Some(t)) = MapInfo::from(info).types_with(asked.render)
            {
                types.insert(msg.target, Arc::new(t));
            }
        }
        types
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
}

#[cfg(test)]
mod tests {
    use super::*;

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
