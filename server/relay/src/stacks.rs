//! A fleet's stacks: every target's StackMap merged by the library (stacks
//! that name the same frames are one), answered once with the targets that
//! answered, those that failed, what each daemon did and why some frames
//! have no names.

use bpfmap_client::{StackOptions, pb};
use bpfmapd::Operation;

use crate::{
    call::{Ask, Asker, Calls},
    error::Error,
};

/// Runs the stacks of `req` on its targets.
pub(crate) async fn run(
    calls: &Calls,
    asker: Asker,
    req: pb::FleetServiceStackMapRequest,
) -> Result<pb::FleetServiceStackMapResponse, Error> {
    let request = req.request.unwrap_or_default();
    let ask = Ask {
        op: Operation::Aggregate,
        map: request.map.as_ref(),
        targets: req.targets.as_ref(),
    };
    let call = calls.start(asker, ask)?;
    let options = StackOptions::from_proto(&request).map_err(Error::Request)?;
    let merged = calls
        .fleet(&call.asker, &call.targets)
        .stacks(&call.map, options)
        .await;
    let ends = call.ends(calls, &merged.reports);
    let mut stacks = merged.stacks;
    let mut notes: Vec<String> = merged
        .notes
        .iter()
        .map(|(t, n)| format!("{t}: {n}"))
        .collect();
    notes.extend(bpfmap_client::stack_folding::fit(
        &mut stacks,
        calls.max_message_bytes,
    ));
    Ok(pb::FleetServiceStackMapResponse {
        notes,
        stacks,
        answered: ends.answered,
        failed: ends.failed,
        work: ends.work,
    })
}
