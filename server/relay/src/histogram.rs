//! A fleet histogram: every target's HistogramMap merged by the library
//! (the buckets of equal groups added), answered once with the targets that
//! answered, those that failed or whose buckets differ, and what each
//! daemon did.

use bpfmap_client::{HistogramOptions, pb};
use bpfmap_proto::status::Reason;
use bpfmapd::Operation;

use crate::{
    call::{Ask, Asker, Calls},
    error::Error,
};

/// Runs the histogram of `req` on its targets.
pub(crate) async fn run(
    calls: &Calls,
    asker: Asker,
    req: pb::FleetServiceHistogramMapRequest,
) -> Result<pb::FleetServiceHistogramMapResponse, Error> {
    let request = req.request.unwrap_or_default();
    let ask = Ask {
        op: Operation::Aggregate,
        map: request.map.as_ref(),
        targets: req.targets.as_ref(),
    };
    let call = calls.start(asker, ask)?;
    let options = HistogramOptions::from_proto(&request);
    let merged = calls
        .fleet(&call.asker, &call.targets)
        .histogram(&call.map, options)
        .await;
    let mut ends = call.ends(calls, &merged.reports);
    // A target whose buckets differ answered, and is left out.
    let differ: Vec<String> = merged
        .differ
        .iter()
        .map(|t| t.as_str().to_owned())
        .collect();
    ends.answered.retain(|t| !differ.contains(t));
    ends.failed
        .extend(differ.into_iter().map(|target| pb::TargetFailure {
            target,
            status: Some(differ_status()),
        }));
    Ok(pb::FleetServiceHistogramMapResponse {
        layout: merged.layout.map(|l| l.as_proto().clone()),
        histograms: merged.histograms,
        answered: ends.answered,
        failed: ends.failed,
        work: ends.work,
    })
}

/// The status of a target whose buckets differ from the first's.
fn differ_status() -> pb::TargetStatus {
    pb::TargetStatus {
        code: bpfmap_client::code_name(tonic::Code::FailedPrecondition).to_owned(),
        reason: Reason::HistogramsDiffer.as_str().to_owned(),
        message: "its histogram's buckets count other values (another layout or bounds) than the first answering target's: left out".into(),
    }
}
