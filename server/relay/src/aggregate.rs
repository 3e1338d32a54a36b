//! A fleet aggregate: the library's exact merge (the top K by the
//! three-phase threshold algorithm where it applies) on the targets the
//! caller may aggregate on, answered once with the merged groups, the
//! method, the targets that answered and those that failed, and what each
//! daemon did.

use bpfmap_client::{AggregateOptions, FleetAggregate, FleetAggregateOptions, FleetGroup, pb};
use bpfmapd::Operation;

use crate::{
    call::{Ask, Asker, Calls},
    error::Error,
};

/// Runs the aggregate of `req` on its targets.
pub(crate) async fn run(
    calls: &Calls,
    asker: Asker,
    req: pb::FleetServiceAggregateMapRequest,
) -> Result<pb::FleetServiceAggregateMapResponse, Error> {
    let request = req.request.unwrap_or_default();
    let ask = Ask {
        op: Operation::Aggregate,
        map: request.map.as_ref(),
        targets: req.targets.as_ref(),
    };
    let call = calls.start(asker, ask)?;
    let options = AggregateOptions::from_proto(&request).map_err(Error::Request)?;
    let answer = calls
        .fleet(&call.asker, &call.targets)
        .aggregate(
            &call.map,
            FleetAggregateOptions::default().with_aggregate(options),
        )
        .await;
    let failed = call
        .denials()
        .into_iter()
        .map(|e| pb::TargetFailure {
            target: e.target,
            status: Some(e.status),
        })
        .collect();
    Ok(Answer { answer, failed }.into_proto(calls))
}

/// The library's answer, and the targets that failed before it ran.
struct Answer {
    answer: FleetAggregate,
    failed: Vec<pb::TargetFailure>,
}

impl Answer {
    /// The answer as the relay sends it, each target's end recorded.
    fn into_proto(self, calls: &Calls) -> pb::FleetServiceAggregateMapResponse {
        let Self { answer, mut failed } = self;
        let mut answered = Vec::new();
        for report in &answer.reports {
            let target = report.target.as_str().to_owned();
            match calls.targets.record_end(report) {
                Some(status) => failed.push(pb::TargetFailure {
                    target,
                    status: Some(status),
                }),
                None => answered.push(target),
            }
        }
        pb::FleetServiceAggregateMapResponse {
            groups: answer.groups.iter().map(fleet_group).collect(),
            method: answer.method.as_str().to_owned(),
            answered,
            failed,
            work: answer
                .reports
                .iter()
                .map(|r| pb::TargetWork {
                    target: r.target.as_str().to_owned(),
                    entries_scanned: r.scanned,
                    groups: r.entries,
                    calls: r.calls,
                })
                .collect(),
        }
    }
}

/// A fleet group as answers carry it: values as exact decimal strings
/// (null for the MIN and MAX of a group without entries), an aggregate over
/// an array as a list of them.
fn fleet_group(g: &FleetGroup) -> pb::FleetGroup {
    use prost_types::value::Kind;
    let decimal = |v: &Option<i128>| prost_types::Value {
        kind: Some(match v {
            Some(v) => Kind::StringValue(v.to_string()),
            None => Kind::NullValue(0),
        }),
    };
    let values = g
        .group
        .values()
        .iter()
        .enumerate()
        .map(|(i, v)| match g.group.elements(i) {
            [] => decimal(v),
            each => prost_types::Value {
                kind: Some(Kind::ListValue(prost_types::ListValue {
                    values: each.iter().map(decimal).collect(),
                })),
            },
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
