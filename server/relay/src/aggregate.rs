//! A fleet aggregate: the library's exact merge (the top K by the
//! three-phase threshold algorithm where it applies) on the targets the
//! caller may aggregate on, answered once with the merged groups, the
//! method, the targets that answered and those that failed, and what each
//! daemon did.

use bpfmap_client::{AggregateOptions, FleetAggregateOptions, FleetGroup, pb};
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
    let ends = call.ends(calls, &answer.reports);
    Ok(pb::FleetServiceAggregateMapResponse {
        groups: answer.groups.iter().map(fleet_group).collect(),
        method: answer.method.as_str().to_owned(),
        answered: ends.answered,
        failed: ends.failed,
        work: ends.work,
    })
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
