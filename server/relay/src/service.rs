//! `bpfmap.v1.FleetService`: each call checks its caller against the
//! policy, picks its targets, runs the library's fleet call on them and
//! streams what each target answers, a failing target named in-band.

use std::{collections::HashMap, sync::Arc, time::Duration};

use bpfmap_client::{
    AggregateOptions, ConnectOptions, DumpOptions, Fleet, FleetAggregateOptions, FleetDumpOptions,
    FleetEvent, FleetOptions, FleetRun, ListMapsOptions, LookupOptions, MapName, Target,
    TargetReport, pb,
};
use bpfmapd::{
    Operation,
    frontend::{Caller, caller_of},
};
use futures::StreamExt as _;
use tokio::sync::mpsc;
use tonic::{Request, Response, Status};

use crate::{
    cursor::{CursorKey, FleetPosition, Standing, short_digest},
    dump::Answers,
    dump::QUEUED,
    policy::RelayPolicy,
    targets::{Targets, status_of},
};

/// What every call shares.
#[derive(Debug)]
pub(crate) struct FleetServiceImpl {
    pub(crate) targets: Arc<Targets>,
    pub(crate) connect: ConnectOptions,
    pub(crate) options: FleetOptions,
    pub(crate) policy: Arc<RelayPolicy>,
    pub(crate) keys: Arc<CursorKey>,
}

/// A call's caller, map and targets, checked.
struct Call {
    caller: Caller,
    map: MapName,
    /// The targets asked, in order.
    targets: Vec<Target>,
    /// The targets the policy keeps from this caller.
    denied: Vec<Target>,
    /// The caller's deadline (`grpc-timeout`), if it set one.
    deadline: Option<Duration>,
}

impl FleetServiceImpl {
    /// The caller, map and targets of a call, or why it cannot be made.
    fn call<T>(
        &self,
        request: &Request<T>,
        (op, map): (Operation, Option<&pb::MapRef>),
        targets: Option<&pb::TargetSelector>,
    ) -> Result<Call, Status> {
        let caller = caller_of(request)?;
        let map = match map {
            Some(r) => MapName::from_proto(r)
                .map_err(|e| Status::invalid_argument(format!("request.map: {e}")))?,
            None => {
                return Err(Status::invalid_argument(
                    "the request names no map: set request.map (e.g. {\"request\":{\"map\":{\"path\":\"demo/flows\"}}})",
                ));
            }
        };
        let names = targets.map(|t| t.targets.as_slice()).unwrap_or_default();
        let selected = self.targets.select(names)?;
        let mut call = self.checked(caller, map, selected, op)?;
        call.deadline = deadline_of(request);
        Ok(call)
    }

    /// Splits `selected` into the targets the policy lets `caller` ask and
    /// those it does not; PERMISSION_DENIED when none is left.
    fn checked(
        &self,
        caller: Caller,
        map: MapName,
        selected: Vec<Target>,
        op: Operation,
    ) -> Result<Call, Status> {
        let text = map.to_string();
        let (targets, denied): (Vec<Target>, Vec<Target>) = selected
            .into_iter()
            .partition(|t| self.policy.allows(&caller.identity, op, &text, t.as_str()));
        if targets.is_empty() {
            return Err(Status::permission_denied(format!(
                "{} may not {} {text} on any of the targets asked",
                caller.identity,
                op.verb()
            )));
        }
        Ok(Call {
            caller,
            map,
            targets,
            denied,
            deadline: None,
        })
    }

    /// A fleet of `targets`, each call naming `caller` to the daemons (for
    /// their audit logs); with the caller's deadline, the targets not done
    /// shortly before it are ended with DEADLINE_EXCEEDED, so that the
    /// caller still receives the others' answers and their names.
    fn fleet(&self, targets: &[Target], caller: &Caller, deadline: Option<Duration>) -> Fleet {
        let connect = self
            .connect
            .clone()
            .with_on_behalf_of(caller.identity.to_string());
        let mut options = self.options.clone();
        if let Some(d) = deadline {
            options = options.with_deadline(d.mul_f64(0.9));
        }
        Fleet::new(targets.to_vec(), connect).with_options(options)
    }
}

/// The status of a target the policy keeps from the caller.
fn denied_status(call: &Call, op: Operation) -> pb::TargetStatus {
    pb::TargetStatus {
        code: "PERMISSION_DENIED".into(),
        reason: "PERMISSION_DENIED".into(),
        message: format!(
            "{} may not {} {} on this target",
            call.caller.identity,
            op.verb(),
            call.map
        ),
    }
}

/// Streams what a fleet run answers, one message per target (`answer`
/// turns an answer into its message, `failed` a failure), recording each
/// target's state; the denied targets first.
fn per_target<T: Send + 'static, M: Send + 'static>(
    targets: Arc<Targets>,
    (run, denied): (FleetRun<T>, Vec<(String, pb::TargetStatus)>),
    answer: impl Fn(String, T) -> M + Send + 'static,
    failed: impl Fn(String, pb::TargetStatus) -> M + Send + 'static,
) -> Answers<M> {
    let (tx, rx) = mpsc::channel(QUEUED);
    tokio::spawn(async move {
        for (target, status) in denied {
            if tx.send(Ok(failed(target, status))).await.is_err() {
                return;
            }
        }
        let mut run = run;
        while let Some(event) = run.next().await {
            let msg = match event {
                FleetEvent::Answer { target, answer: a } => {
                    targets.record(&target, None);
                    answer(target.as_str().to_owned(), a)
                }
                FleetEvent::Done(report) => match ended(&targets, &report) {
                    Some(status) => failed(report.target.as_str().to_owned(), status),
                    None => continue,
                },
                _ => continue,
            };
            if tx.send(Ok(msg)).await.is_err() {
                return; // the caller left: dropping the run ends every target's call
            }
        }
    });
    Box::pin(tokio_stream::wrappers::ReceiverStream::new(rx))
}

/// A target's end: recorded, and its status when it failed.
fn ended(targets: &Targets, report: &TargetReport) -> Option<pb::TargetStatus> {
    targets.record(&report.target, report.error.as_ref());
    report.error.as_ref().map(status_of)
}

#[tonic::async_trait]
impl pb::fleet_service_server::FleetService for FleetServiceImpl {
    async fn list_targets(
        &self,
        request: Request<pb::ListTargetsRequest>,
    ) -> Result<Response<pb::ListTargetsResponse>, Status> {
        caller_of(&request)?;
        Ok(Response::new(pb::ListTargetsResponse {
            targets: self.targets.states(),
        }))
    }

    type ListMapsStream = Answers<pb::FleetServiceListMapsResponse>;

    async fn list_maps(
        &self,
        request: Request<pb::FleetServiceListMapsRequest>,
    ) -> Result<Response<Self::ListMapsStream>, Status> {
        let caller = caller_of(&request)?;
        let deadline = deadline_of(&request);
        let req = request.into_inner();
        let names = req
            .targets
            .as_ref()
            .map(|t| t.targets.clone())
            .unwrap_or_default();
        let targets = self.targets.select(&names)?;
        let options = ListMapsOptions::from_proto(&req.request.unwrap_or_default());
        let run = self
            .fleet(&targets, &caller, deadline)
            .list_maps_with(options);
        let (policy_caller, policy) = (caller.identity.clone(), self.policy_view());
        Ok(Response::new(per_target(
            self.targets.clone(),
            (run, Vec::new()),
            move |target, maps| pb::FleetServiceListMapsResponse {
                answer: Some(pb::fleet_service_list_maps_response::Answer::Maps(
                    pb::ListMapsResponse {
                        maps: maps
                            .into_iter()
                            .filter(|m| policy(&policy_caller, &m.map_name().to_string(), &target))
                            .map(|m| m.into_proto())
                            .collect(),
                    },
                )),
                target,
            },
            |target, status| pb::FleetServiceListMapsResponse {
                target,
                answer: Some(pb::fleet_service_list_maps_response::Answer::Status(status)),
            },
        )))
    }

    type GetMapStream = Answers<pb::FleetServiceGetMapResponse>;

    async fn get_map(
        &self,
        request: Request<pb::FleetServiceGetMapRequest>,
    ) -> Result<Response<Self::GetMapStream>, Status> {
        let req = request.get_ref().request.clone().unwrap_or_default();
        let call = self.call(
            &request,
            (Operation::List, req.map.as_ref()),
            request.get_ref().targets.as_ref(),
        )?;
        let denied = denials(&call, Operation::List);
        let run = self
            .fleet(&call.targets, &call.caller, call.deadline)
            .get_map(&call.map);
        Ok(Response::new(per_target(
            self.targets.clone(),
            (run, denied),
            |target, info| pb::FleetServiceGetMapResponse {
                target,
                answer: Some(pb::fleet_service_get_map_response::Answer::Map(
                    info.into_proto(),
                )),
            },
            |target, status| pb::FleetServiceGetMapResponse {
                target,
                answer: Some(pb::fleet_service_get_map_response::Answer::Status(status)),
            },
        )))
    }

    type LookupStream = Answers<pb::FleetServiceLookupResponse>;

    async fn lookup(
        &self,
        request: Request<pb::FleetServiceLookupRequest>,
    ) -> Result<Response<Self::LookupStream>, Status> {
        let req = request.get_ref().request.clone().unwrap_or_default();
        let call = self.call(
            &request,
            (Operation::Lookup, req.map.as_ref()),
            request.get_ref().targets.as_ref(),
        )?;
        let denied = denials(&call, Operation::Lookup);
        let (options, keys) = LookupOptions::from_proto(&req);
        let run = self
            .fleet(&call.targets, &call.caller, call.deadline)
            .lookup(&call.map, keys, options);
        Ok(Response::new(per_target(
            self.targets.clone(),
            (run, denied),
            |target, results| pb::FleetServiceLookupResponse {
                target,
                answer: Some(pb::fleet_service_lookup_response::Answer::Results(
                    pb::LookupResponse {
                        results: results.into_iter().map(|r| r.into_proto()).collect(),
                    },
                )),
            },
            |target, status| pb::FleetServiceLookupResponse {
                target,
                answer: Some(pb::fleet_service_lookup_response::Answer::Status(status)),
            },
        )))
    }

    type DumpMapStream = Answers<pb::FleetServiceDumpMapResponse>;

    async fn dump_map(
        &self,
        request: Request<pb::FleetServiceDumpMapRequest>,
    ) -> Result<Response<Self::DumpMapStream>, Status> {
        let req = request.get_ref().request.clone().unwrap_or_default();
        let cursor = request.get_ref().cursor.clone();
        let mut call = self.call(
            &request,
            (Operation::Dump, req.map.as_ref()),
            request.get_ref().targets.as_ref(),
        )?;
        let dump = dump_digest(&req);
        let identity = call.caller.identity.to_string();
        let mut position = match cursor.as_str() {
            "" => FleetPosition {
                targets: call
                    .targets
                    .iter()
                    .map(|t| (t.as_str().to_owned(), Standing::Pending))
                    .collect(),
            },
            c => self.resume(&mut call, c, (&identity, &dump))?,
        };
        let mut denied = denials(&call, Operation::Dump);
        // A cursor's targets the relay no longer has end in-band.
        for (name, standing) in &position.targets {
            let asked = call.targets.iter().chain(&call.denied);
            if *standing != Standing::Done && !asked.into_iter().any(|t| t.as_str() == name) {
                let status = pb::TargetStatus {
                    code: "NOT_FOUND".into(),
                    reason: String::new(),
                    message: "no longer one of the relay's targets".into(),
                };
                denied.push((name.clone(), status));
            }
        }
        let given = target_cursors(request.get_ref().target_cursors.clone(), &call.targets)?;
        if !given.is_empty() && !cursor.is_empty() {
            return Err(Status::invalid_argument(
                "give a fleet cursor (cursor) or each target's own (targetCursors), not both",
            ));
        }
        let mut cursors = HashMap::new();
        for (target, standing) in position.targets.iter_mut() {
            if let Some(c) = given.get(target.as_str()) {
                *standing = Standing::At(c.clone());
            }
        }
        for (target, standing) in &position.targets {
            if let (Standing::At(c), Ok(t)) = (standing, target.parse::<Target>()) {
                cursors.insert(t, c.clone());
            }
        }
        let running: Vec<Target> = call
            .targets
            .iter()
            .filter(|t| !matches!(standing_of(&position, t), Some(Standing::Done)))
            .cloned()
            .collect();
        let mut options = DumpOptions::from_proto(&req);
        options = options.with_cursor("");
        let run = self.fleet(&running, &call.caller, call.deadline).dump(
            &call.map,
            FleetDumpOptions::default()
                .with_dump(options)
                .with_cursors(cursors),
        );
        Ok(Response::new(crate::dump::stream(
            self.targets.clone(),
            (run, denied),
            crate::dump::Sealing {
                keys: self.keys.clone(),
                identity,
                dump,
                position,
            },
        )))
    }

    async fn aggregate_map(
        &self,
        request: Request<pb::FleetServiceAggregateMapRequest>,
    ) -> Result<Response<pb::FleetServiceAggregateMapResponse>, Status> {
        let req = request.get_ref().request.clone().unwrap_or_default();
        let call = self.call(
            &request,
            (Operation::Aggregate, req.map.as_ref()),
            request.get_ref().targets.as_ref(),
        )?;
        let options = AggregateOptions::from_proto(&req)
            .map_err(|e| Status::invalid_argument(format!("request: {e}")))?;
        let answer = self
            .fleet(&call.targets, &call.caller, call.deadline)
            .aggregate(
                &call.map,
                FleetAggregateOptions::default().with_aggregate(options),
            )
            .await;
        let mut failed: Vec<pb::TargetFailure> = denials(&call, Operation::Aggregate)
            .into_iter()
            .map(|(target, status)| pb::TargetFailure {
                target,
                status: Some(status),
            })
            .collect();
        let mut answered = Vec::new();
        let work = answer
            .reports
            .iter()
            .map(|r| pb::TargetWork {
                target: r.target.as_str().to_owned(),
                entries_scanned: r.scanned,
                groups: r.entries,
                calls: r.calls,
            })
            .collect();
        for report in &answer.reports {
            match ended(&self.targets, report) {
                Some(status) => failed.push(pb::TargetFailure {
                    target: report.target.as_str().to_owned(),
                    status: Some(status),
                }),
                None => answered.push(report.target.as_str().to_owned()),
            }
        }
        Ok(Response::new(pb::FleetServiceAggregateMapResponse {
            groups: answer.groups.iter().map(fleet_group).collect(),
            method: answer.method.as_str().to_owned(),
            answered,
            failed,
            work,
        }))
    }

    type WatchMapStream = Answers<pb::FleetServiceWatchMapResponse>;

    async fn watch_map(
        &self,
        request: Request<pb::FleetServiceWatchMapRequest>,
    ) -> Result<Response<Self::WatchMapStream>, Status> {
        let req = request.get_ref().request.clone().unwrap_or_default();
        let op = if req.group_by.is_empty() && req.aggregates.is_empty() {
            Operation::Dump
        } else {
            Operation::Aggregate
        };
        let selector = request.get_ref().targets.clone().unwrap_or_default();
        let cursor = request.get_ref().cursor.clone();
        let call = self.call(&request, (op, req.map.as_ref()), Some(&selector))?;
        let options = bpfmap_client::WatchOptions::from_proto(&req)
            .map_err(|e| Status::invalid_argument(format!("request: {e}")))?
            .with_cursor("");
        let identity = call.caller.identity.to_string();
        let digest = watch_digest(&req);
        let mut cursors = self.bookmarks(&cursor, &identity, &digest)?;
        cursors.extend(target_cursors(
            request.get_ref().target_cursors.clone(),
            &call.targets,
        )?);
        let denied = denials(&call, op);
        let (policy, who, map_text) = (
            self.policy.clone(),
            call.caller.identity.clone(),
            call.map.to_string(),
        );
        let denial_call = Call {
            caller: call.caller.clone(),
            map: call.map.clone(),
            targets: Vec::new(),
            denied: Vec::new(),
            deadline: None,
        };
        let (connect, options_fleet, caller) = (
            self.connect.clone(),
            self.options.clone(),
            call.caller.clone(),
        );
        Ok(Response::new(crate::watch::stream(
            crate::watch::WatchCall {
                targets: self.targets.clone(),
                follow: selector.targets.is_empty(),
                start: call.targets,
                denied,
                allowed: Box::new(move |t| policy.allows(&who, op, &map_text, t.as_str())),
                denial: Box::new(move |_| denied_status(&denial_call, op)),
                fleet: Box::new(move |t| {
                    let connect = connect
                        .clone()
                        .with_on_behalf_of(caller.identity.to_string());
                    // One scan held per target while the caller reads: a
                    // watch holds a stream to every target it watches.
                    Fleet::new(vec![t.clone()], connect)
                        .with_options(options_fleet.clone().with_buffer(1))
                }),
                map: call.map,
                options,
                cursors,
                keys: self.keys.clone(),
                identity,
                digest,
            },
        )))
    }
}

impl FleetServiceImpl {
    /// Each target's bookmark in a fleet watch's cursor (none for no
    /// cursor).
    fn bookmarks(
        &self,
        cursor: &str,
        identity: &str,
        digest: &[u8; 16],
    ) -> Result<HashMap<String, String>, Status> {
        if cursor.is_empty() {
            return Ok(HashMap::new());
        }
        let position = self
            .keys
            .open(cursor, identity, digest)
            .map_err(|e| Status::invalid_argument(format!("cursor: {e}")))?;
        Ok(position
            .targets
            .into_iter()
            .filter_map(|(t, s)| match s {
                Standing::At(c) => Some((t, c)),
                _ => None,
            })
            .collect())
    }

    /// A view of the policy for filtering listed maps: whether the caller
    /// may list a map on a target.
    fn policy_view(
        &self,
    ) -> impl Fn(&bpfmapd::frontend::Identity, &str, &str) -> bool + Send + 'static {
        let policy = self.policy.clone();
        move |identity, map, target| policy.allows(identity, Operation::List, map, target)
    }

    /// The targets and standings of a fleet cursor; its targets become the
    /// call's (each still checked against the policy).
    fn resume(
        &self,
        call: &mut Call,
        cursor: &str,
        (identity, dump): (&str, &[u8; 16]),
    ) -> Result<FleetPosition, Status> {
        let position = self
            .keys
            .open(cursor, identity, dump)
            .map_err(|e| Status::invalid_argument(format!("cursor: {e}")))?;
        // Targets the relay no longer has (gone from discovery) are left
        // out; the cursor keeps them where they stood.
        let current = self.targets.current();
        let selected = position
            .targets
            .iter()
            .map(|(t, _)| {
                t.parse::<Target>()
                    .map_err(|_| Status::invalid_argument("cursor: a target that is not one"))
            })
            .filter(|t| t.as_ref().map_or(true, |t| current.contains(t)))
            .collect::<Result<Vec<_>, _>>()?;
        let caller = call.caller.clone();
        *call = self.checked(caller, call.map.clone(), selected, Operation::Dump)?;
        Ok(position)
    }
}

/// Each target's own cursor, as a caller gave them: names of the call's
/// targets, cursors of at most the daemon's length; INVALID_ARGUMENT
/// otherwise. (A daemon binds its cursors to the relay's identity: the
/// relay decides who may use them, by the policy of the map on each
/// target.)
fn target_cursors(
    given: HashMap<String, String>,
    targets: &[Target],
) -> Result<HashMap<String, String>, Status> {
    const MAX_LEN: usize = 4096;
    for (name, cursor) in &given {
        if !targets.iter().any(|t| t.as_str() == name) {
            return Err(Status::invalid_argument(format!(
                "targetCursors names {name:?}, which is not one of the call's targets"
            )));
        }
        if cursor.len() > MAX_LEN {
            return Err(Status::invalid_argument(format!(
                "targetCursors[{name:?}] is longer than a daemon's cursor ({MAX_LEN} characters)"
            )));
        }
    }
    Ok(given)
}

/// The deadline a caller set (`grpc-timeout`: digits and a unit, H, M, S,
/// m, u or n).
fn deadline_of<T>(request: &Request<T>) -> Option<Duration> {
    let text = request.metadata().get("grpc-timeout")?.to_str().ok()?;
    let (digits, unit) = text.split_at(text.len().checked_sub(1)?);
    let n: u64 = digits.parse().ok()?;
    Some(match unit {
        "H" => Duration::from_secs(n.saturating_mul(3600)),
        "M" => Duration::from_secs(n.saturating_mul(60)),
        "S" => Duration::from_secs(n),
        "m" => Duration::from_millis(n),
        "u" => Duration::from_micros(n),
        "n" => Duration::from_nanos(n),
        _ => return None,
    })
}

/// The targets the policy keeps from a call's caller, with their status.
fn denials(call: &Call, op: Operation) -> Vec<(String, pb::TargetStatus)> {
    call.denied
        .iter()
        .map(|t| (t.as_str().to_owned(), denied_status(call, op)))
        .collect()
}

/// Where `target` stands in `position`.
fn standing_of<'a>(position: &'a FleetPosition, target: &Target) -> Option<&'a Standing> {
    position
        .targets
        .iter()
        .find(|(t, _)| t == target.as_str())
        .map(|(_, s)| s)
}

/// What a fleet cursor is bound to: the dump's map, filter and fields.
fn dump_digest(req: &pb::DumpMapRequest) -> [u8; 16] {
    let bound = pb::DumpMapRequest {
        map: req.map.clone(),
        filter: req.filter.clone(),
        fields: req.fields.clone(),
        ..Default::default()
    };
    short_digest(&prost::Message::encode_to_vec(&bound))
}

/// What a fleet watch's cursor is bound to: the watch's map, query,
/// interval and how it reads entries (a dump's cursor is never a watch's).
fn watch_digest(req: &pb::WatchMapRequest) -> [u8; 16] {
    let bound = pb::WatchMapRequest {
        map: req.map.clone(),
        interval: req.interval,
        filter: req.filter.clone(),
        fields: req.fields.clone(),
        group_by: req.group_by.clone(),
        aggregates: req.aggregates.clone(),
        per_cpu: req.per_cpu,
        raw: req.raw,
        render: req.render.clone(),
        cursor: String::new(),
    };
    let mut bytes = b"watch".to_vec();
    bytes.extend(prost::Message::encode_to_vec(&bound));
    short_digest(&bytes)
}

/// A fleet group as answers carry it: values as exact decimal strings
/// (null for the MIN and MAX of a group without entries).
fn fleet_group(g: &bpfmap_client::FleetGroup) -> pb::FleetGroup {
    use prost_types::value::Kind;
    let values = g
        .group
        .values()
        .iter()
        .map(|v| prost_types::Value {
            kind: Some(match v {
                Some(v) => Kind::StringValue(v.to_string()),
                None => Kind::NullValue(0),
            }),
        })
        .collect();
    pb::FleetGroup {
        group: Some(pb::Group {
            key: Some(prost_types::Struct {
                fields: g.group.key().clone().into_iter().collect(),
            }),
            values,
            key_bytes: g.group.key_bytes().to_vec(),
        }),
        targets: g.hosts.iter().map(|t| t.as_str().to_owned()).collect(),
    }
}
