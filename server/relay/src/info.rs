//! The calls each target answers once: ListMaps, GetMap and Lookup, one
//! message per target (its answer or its status), the targets the policy
//! keeps from the caller first.

use std::sync::Arc;

use bpfmap_client::{FleetEvent, FleetRun, ListMapsOptions, LookupOptions, pb};
use bpfmapd::Operation;
use futures::StreamExt as _;
use tokio::sync::mpsc;

use crate::{
    call::{Answers, Ask, Asker, Calls, Ended, QUEUED},
    error::Error,
    targets::Targets,
};

/// ListMaps on the targets asked (all the relay's when none is named),
/// each target's maps filtered by what the policy lets the caller list
/// there.
pub(crate) fn list_maps(
    calls: &Calls,
    asker: Asker,
    req: pb::FleetServiceListMapsRequest,
) -> Result<Answers<pb::FleetServiceListMapsResponse>, Error> {
    use pb::fleet_service_list_maps_response::Answer;
    let names = req.targets.map(|t| t.targets).unwrap_or_default();
    let targets = calls.targets.select(&names)?;
    let options = ListMapsOptions::from_proto(&req.request.unwrap_or_default());
    let run = calls.fleet(&asker, &targets).list_maps_with(options);
    let (policy, identity) = (calls.policy.clone(), asker.caller.identity);
    let answers = PerTarget {
        run,
        ended: Vec::new(),
    };
    Ok(answers.stream(
        calls.targets.clone(),
        move |target, maps| pb::FleetServiceListMapsResponse {
            answer: Some(Answer::Maps(pb::ListMapsResponse {
                maps: maps
                    .into_iter()
                    .filter(|m| {
                        let map = m.map_name().to_string();
                        policy.allows(&identity, Operation::List, &map, &target)
                    })
                    .map(|m| m.into_proto())
                    .collect(),
            })),
            target,
        },
        |target, status| pb::FleetServiceListMapsResponse {
            target,
            answer: Some(Answer::Status(status)),
        },
    ))
}

/// GetMap on every target the caller may list the map on.
pub(crate) fn get_map(
    calls: &Calls,
    asker: Asker,
    req: pb::FleetServiceGetMapRequest,
) -> Result<Answers<pb::FleetServiceGetMapResponse>, Error> {
    use pb::fleet_service_get_map_response::Answer;
    let request = req.request.unwrap_or_default();
    let ask = Ask {
        op: Operation::List,
        map: request.map.as_ref(),
        targets: req.targets.as_ref(),
    };
    let call = calls.start(asker, ask)?;
    let answers = PerTarget {
        run: calls.fleet(&call.asker, &call.targets).get_map(&call.map),
        ended: call.denials(),
    };
    Ok(answers.stream(
        calls.targets.clone(),
        |target, info| pb::FleetServiceGetMapResponse {
            target,
            answer: Some(Answer::Map(info.into_proto())),
        },
        |target, status| pb::FleetServiceGetMapResponse {
            target,
            answer: Some(Answer::Status(status)),
        },
    ))
}

/// Lookup on every target the caller may look the map up on.
pub(crate) fn lookup(
    calls: &Calls,
    asker: Asker,
    req: pb::FleetServiceLookupRequest,
) -> Result<Answers<pb::FleetServiceLookupResponse>, Error> {
    use pb::fleet_service_lookup_response::Answer;
    let request = req.request.unwrap_or_default();
    let ask = Ask {
        op: Operation::Lookup,
        map: request.map.as_ref(),
        targets: req.targets.as_ref(),
    };
    let call = calls.start(asker, ask)?;
    let (options, keys) = LookupOptions::from_proto(&request);
    let fleet = calls.fleet(&call.asker, &call.targets);
    let answers = PerTarget {
        run: fleet.lookup(&call.map, keys, options),
        ended: call.denials(),
    };
    Ok(answers.stream(
        calls.targets.clone(),
        |target, results| pb::FleetServiceLookupResponse {
            target,
            answer: Some(Answer::Results(pb::LookupResponse {
                results: results.into_iter().map(|r| r.into_proto()).collect(),
            })),
        },
        |target, status| pb::FleetServiceLookupResponse {
            target,
            answer: Some(Answer::Status(status)),
        },
    ))
}

/// A fleet run answered once per target, and the targets that ended before
/// it started.
struct PerTarget<T> {
    run: FleetRun<T>,
    ended: Vec<Ended>,
}

impl<T: Send + 'static> PerTarget<T> {
    /// One message per target (`answer` turns an answer into its message,
    /// `failed` a failure), recording each target's state; the targets
    /// that ended before the run first.
    fn stream<M: Send + 'static>(
        self,
        targets: Arc<Targets>,
        answer: impl Fn(String, T) -> M + Send + 'static,
        failed: impl Fn(String, pb::TargetStatus) -> M + Send + 'static,
    ) -> Answers<M> {
        let (tx, rx) = mpsc::channel(QUEUED);
        let Self { mut run, ended } = self;
        tokio::spawn(async move {
            for e in ended {
                if tx.send(Ok(failed(e.target, e.status))).await.is_err() {
                    return;
                }
            }
            while let Some(event) = run.next().await {
                let msg = match event {
                    FleetEvent::Answer { target, answer: a } => {
                        targets.record(&target, None);
                        answer(target.as_str().to_owned(), a)
                    }
                    FleetEvent::Done(report) => match targets.record_end(&report) {
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
}
