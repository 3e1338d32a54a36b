//! A fleet dump's stream: each target's chunks and end, every message with
//! the fleet cursor that resumes the whole call right after it.

use std::sync::Arc;

use bpfmap_client::{
    FleetChunk, FleetEvent, FleetRun, TargetReport, pb, pb::fleet_service_dump_map_response::Part,
};
use futures::StreamExt as _;
use tokio::sync::mpsc;

use crate::{
    cursor::{CursorKey, FleetPosition, Standing},
    targets::{Targets, status_of},
};

/// Messages queued for a slow caller, per call (the fleet's own buffers
/// and the daemons' streams hold the rest: back-pressure, not buffering).
pub(crate) const QUEUED: usize = 8;

/// A streamed answer.
pub(crate) type Answers<T> =
    std::pin::Pin<Box<dyn futures::Stream<Item = Result<T, tonic::Status>> + Send>>;

/// What seals a fleet dump's cursors: the key, the caller, the dump, and
/// where every target stands.
pub(crate) struct Sealing {
    pub(crate) keys: Arc<CursorKey>,
    pub(crate) identity: String,
    pub(crate) dump: [u8; 16],
    pub(crate) position: FleetPosition,
}

impl Sealing {
    /// Records where `target` stands now, and seals the position.
    fn after(&mut self, target: &str, standing: Standing) -> String {
        if let Some((_, s)) = self.position.targets.iter_mut().find(|(t, _)| t == target) {
            *s = standing;
        }
        self.keys.seal(&self.identity, &self.dump, &self.position)
    }
}

/// The messages of `run`: the denied targets' ends first, then every
/// chunk and end as they come.
pub(crate) fn stream(
    targets: Arc<Targets>,
    (run, denied): (FleetRun<FleetChunk>, Vec<(String, pb::TargetStatus)>),
    mut sealing: Sealing,
) -> Answers<pb::FleetServiceDumpMapResponse> {
    let (tx, rx) = mpsc::channel(QUEUED);
    tokio::spawn(async move {
        for (target, status) in denied {
            // Left where they stood: a caller allowed later resumes them.
            let cursor = sealing
                .keys
                .seal(&sealing.identity, &sealing.dump, &sealing.position);
            let end = pb::TargetEnd {
                status: Some(status),
                entries: 0,
                complete: false,
            };
            if tx
                .send(Ok(message(target, Part::End(end), cursor)))
                .await
                .is_err()
            {
                return;
            }
        }
        let mut run = run;
        while let Some(event) = run.next().await {
            let msg = match event {
                FleetEvent::Answer { target, answer } => {
                    targets.record(&target, None);
                    let name = target.as_str().to_owned();
                    let cursor =
                        sealing.after(&name, Standing::At(answer.chunk.cursor().to_owned()));
                    let mut chunk = answer.chunk.into_proto();
                    chunk.projection = answer.projection;
                    message(name, Part::Chunk(chunk), cursor)
                }
                FleetEvent::Done(report) => end_of(&targets, &mut sealing, &report),
                _ => continue,
            };
            if tx.send(Ok(msg)).await.is_err() {
                return; // the caller left: dropping the run ends every target's dump
            }
        }
    });
    Box::pin(tokio_stream::wrappers::ReceiverStream::new(rx))
}

/// A target's end: done when its map was read to the end; otherwise it
/// resumes where it stood (a limit reached, a failure).
fn end_of(
    targets: &Targets,
    sealing: &mut Sealing,
    report: &TargetReport,
) -> pb::FleetServiceDumpMapResponse {
    targets.record(&report.target, report.error.as_ref());
    let standing = match (&report.error, report.complete, report.cursor.as_str()) {
        (None, true, _) => Standing::Done,
        (_, _, "") => Standing::Pending,
        (_, _, c) => Standing::At(c.to_owned()),
    };
    let name = report.target.as_str().to_owned();
    let cursor = sealing.after(&name, standing);
    let status = match &report.error {
        None => pb::TargetStatus {
            code: "OK".into(),
            ..Default::default()
        },
        Some(e) => status_of(e),
    };
    let end = pb::TargetEnd {
        status: Some(status),
        entries: report.entries,
        complete: report.complete,
    };
    message(name, Part::End(end), cursor)
}

fn message(target: String, part: Part, cursor: String) -> pb::FleetServiceDumpMapResponse {
    pb::FleetServiceDumpMapResponse {
        target,
        part: Some(part),
        cursor,
    }
}
