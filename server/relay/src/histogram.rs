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
    let mut failed: Vec<pb::TargetFailure> = call
        .denials()
        .into_iter()
        .map(|e| pb::TargetFailure {
            target: e.target,
            status: Some(e.status),
        })
        .collect();
    let mut answered = Vec::new();
    for report in &merged.reports {
        let target = report.target.as_str().to_owned();
        match calls.targets.record_end(report) {
            Some(status) => failed.push(pb::TargetFailure {
                target,
                status: Some(status),
            }),
            None if merged.differ.contains(&report.target) => failed.push(pb::TargetFailure {
                target,
                status: Some(differ()),
            }),
            None => answered.push(target),
        }
    }
    Ok(pb::FleetServiceHistogramMapResponse {
        work: merged
            .reports
            .iter()
            .map(|r| pb::TargetWork {
                target: r.target.as_str().to_owned(),
                entries_scanned: r.scanned,
                groups: r.entries,
                calls: r.calls,
            })
            .collect(),
        layout: merged.layout.map(|l| l.as_proto().clone()),
        histograms: merged.histograms,
        answered,
        failed,
    })
}

/// The status of a target whose buckets differ from the first's.
fn differ() -> pb::TargetStatus {
    pb::TargetStatus {
        code: bpfmap_client::code_name(tonic::Code::FailedPrecondition).to_owned(),
        reason: Reason::HistogramsDiffer.as_str().to_owned(),
        message: "its histogram's buckets count other values (another layout or bounds) than the first answering target's: left out".into(),
    }
}
