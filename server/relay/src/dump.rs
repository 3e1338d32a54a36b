//! A fleet dump: where each target starts (fresh, where a fleet cursor
//! left it, or at the cursor a caller kept for it), and its stream: each
//! target's chunks and end, every message with the fleet cursor that
//! resumes the whole call right after it.

use std::{collections::HashMap, sync::Arc};

use bpfmap_client::{
    DumpOptions, FleetChunk, FleetDumpOptions, FleetEvent, FleetRun, Target, TargetReport, pb,
    pb::fleet_service_dump_map_response::Part,
};
use bpfmapd::Operation;
use futures::StreamExt as _;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;

use crate::{
    call::{Answers, Ask, Asker, Call, Calls, Ended, QUEUED},
    cursor::{Binding, CursorError, CursorKeys, FleetPosition, Standing, TargetPosition},
    error::{Error, InBand},
    status,
    targets::Targets,
};

/// Starts a fleet dump: from the request's fleet cursor (its targets
/// become the call's), or each target from the cursor the caller kept for
/// it, or from the start.
pub(crate) fn start(
    calls: &Calls,
    asker: Asker,
    req: pb::FleetServiceDumpMapRequest,
) -> Result<Answers<pb::FleetServiceDumpMapResponse>, Error> {
    let events = events(calls, asker, req, false)?;
    Ok(Box::pin(events.map(|e| Ok(e.into_message()))))
}

/// One event of a fleet dump: a target's chunk (with its types, when they
/// were asked for) or its end, and the fleet cursor right after it.
#[derive(Debug)]
pub(crate) struct Sealed {
    pub(crate) target: String,
    pub(crate) part: SealedPart,
    pub(crate) cursor: String,
}

/// What a [`Sealed`] event carries.
#[derive(Debug)]
pub(crate) enum SealedPart {
    Chunk(Box<FleetChunk>),
    End(pb::TargetEnd),
}

impl Sealed {
    /// The event as DumpMap's message.
    fn into_message(self) -> pb::FleetServiceDumpMapResponse {
        let part = match self.part {
            SealedPart::Chunk(answer) => {
                let FleetChunk {
                    chunk, projection, ..
                } = *answer;
                let mut chunk = chunk.into_proto();
                chunk.projection = projection;
                Part::Chunk(chunk)
            }
            SealedPart::End(end) => Part::End(end),
        };
        message(self.target, part, self.cursor)
    }
}

/// [`start`]'s events, each chunk with its target's types when `types`
/// (what a table of the fleet is made from).
pub(crate) fn events(
    calls: &Calls,
    asker: Asker,
    req: pb::FleetServiceDumpMapRequest,
    types: bool,
) -> Result<ReceiverStream<Sealed>, Error> {
    let request = req.request.unwrap_or_default();
    let ask = Ask {
        op: Operation::Dump,
        map: request.map.as_ref(),
        targets: req.targets.as_ref(),
    };
    let mut call = calls.start(asker, ask)?;
    let binding = Binding::dump(&call.asker.caller.identity, &request);
    let mut position = match req.cursor.as_str() {
        "" => FleetPosition {
            targets: call.targets.iter().map(pending).collect(),
        },
        cursor => resume(calls, &mut call, cursor, &binding)?,
    };
    let mut ended = call.denials();
    ended.extend(gone(&call, &position));
    let given = call.target_cursors(req.target_cursors)?;
    if !given.is_empty() && !req.cursor.is_empty() {
        return Err(Error::TwoCursors);
    }
    let cursors = resumed_at(&mut position, &given);
    let running: Vec<Target> = call
        .targets
        .iter()
        .filter(|t| position.standing(t.as_str()) != Some(&Standing::Done))
        .cloned()
        .collect();
    let options = FleetDumpOptions::default()
        .with_dump(DumpOptions::from_proto(&request).with_cursor(""))
        .with_cursors(cursors)
        .with_types(types);
    let dump = FleetDump {
        run: calls.fleet(&call.asker, &running).dump(&call.map, options),
        ended,
        sealing: Sealing {
            keys: calls.keys.clone(),
            binding,
            position,
        },
    };
    Ok(dump.stream(calls.targets.clone()))
}

fn pending(target: &Target) -> TargetPosition {
    TargetPosition {
        target: target.as_str().to_owned(),
        standing: Standing::Pending,
    }
}

/// The position a fleet cursor holds; its targets become the call's (each
/// checked against the policy again). Targets the relay no longer has
/// (gone from discovery) are left out of the call; the cursor keeps them
/// where they stood.
fn resume(
    calls: &Calls,
    call: &mut Call,
    cursor: &str,
    binding: &Binding,
) -> Result<FleetPosition, Error> {
    let position = calls.keys.open(cursor, binding)?;
    let current = calls.targets.current();
    let mut targets = Vec::new();
    for t in &position.targets {
        let target: Target = t.target.parse().map_err(|_| CursorError::NotATarget)?;
        if current.contains(&target) {
            targets.push(target);
        }
    }
    call.targets = targets;
    call.denied.clear();
    *call = calls.checked(call.clone())?;
    Ok(position)
}

/// The targets of `position` not done that the call no longer has: they
/// end in-band (NOT_FOUND), where they stood.
fn gone(call: &Call, position: &FleetPosition) -> Vec<Ended> {
    let has = |name: &str| {
        call.targets
            .iter()
            .chain(&call.denied)
            .any(|t| t.as_str() == name)
    };
    position
        .targets
        .iter()
        .filter(|t| t.standing != Standing::Done && !has(&t.target))
        .map(|t| Ended {
            target: t.target.clone(),
            status: status::in_band(&InBand::Gone),
        })
        .collect()
}

/// Each target's own cursor (`given`) set in `position`: the daemons'
/// cursors the dump resumes from.
fn resumed_at(
    position: &mut FleetPosition,
    given: &HashMap<String, String>,
) -> HashMap<Target, String> {
    for t in &mut position.targets {
        if let Some(c) = given.get(&t.target) {
            t.standing = Standing::At(c.clone());
        }
    }
    position
        .targets
        .iter()
        .filter_map(|t| match (&t.standing, t.target.parse::<Target>()) {
            (Standing::At(c), Ok(target)) => Some((target, c.clone())),
            _ => None,
        })
        .collect()
}

/// What seals a fleet dump's cursors: the key, what the cursors are bound
/// to, and where every target stands.
struct Sealing {
    keys: Arc<CursorKeys>,
    binding: Binding,
    position: FleetPosition,
}

impl Sealing {
    /// The cursor of the position as it stands.
    fn seal(&self) -> String {
        self.keys.seal(&self.binding, &self.position)
    }

    /// Records where `target` stands now, and seals the position.
    fn after(&mut self, target: &str, standing: Standing) -> String {
        self.position.set(target, standing);
        self.seal()
    }
}

/// A fleet dump under way: the run, the targets that ended before it, and
/// the sealing of its cursors.
struct FleetDump {
    run: FleetRun<FleetChunk>,
    ended: Vec<Ended>,
    sealing: Sealing,
}

impl FleetDump {
    /// The events of the dump: the ends of the targets that ended before
    /// it first, then every chunk and end as they come.
    fn stream(self, targets: Arc<Targets>) -> ReceiverStream<Sealed> {
        let (tx, rx) = mpsc::channel(QUEUED);
        let Self {
            mut run,
            ended,
            mut sealing,
        } = self;
        tokio::spawn(async move {
            for e in ended {
                // Left where they stood: a caller allowed later resumes them.
                let end = pb::TargetEnd {
                    status: Some(e.status),
                    entries: 0,
                    complete: false,
                };
                let event = Sealed {
                    target: e.target,
                    part: SealedPart::End(end),
                    cursor: sealing.seal(),
                };
                if tx.send(event).await.is_err() {
                    return;
                }
            }
            while let Some(event) = run.next().await {
                let event = match event {
                    FleetEvent::Answer { target, answer } => {
                        targets.record(&target, None);
                        let name = target.as_str().to_owned();
                        let at = Standing::At(answer.chunk.cursor().to_owned());
                        let cursor = sealing.after(&name, at);
                        Sealed {
                            target: name,
                            part: SealedPart::Chunk(Box::new(answer)),
                            cursor,
                        }
                    }
                    FleetEvent::Done(report) => end_of(&targets, &mut sealing, &report),
                    _ => continue,
                };
                if tx.send(event).await.is_err() {
                    return; // the caller left: dropping the run ends every target's dump
                }
            }
        });
        ReceiverStream::new(rx)
    }
}

/// A target's end: done when its map was read to the end; otherwise it
/// resumes where it stood (a limit reached, a failure).
fn end_of(targets: &Targets, sealing: &mut Sealing, report: &TargetReport) -> Sealed {
    let failed = targets.record_end(report);
    let standing = match (failed.is_none(), report.complete, report.cursor.as_str()) {
        (true, true, _) => Standing::Done,
        (_, _, "") => Standing::Pending,
        (_, _, c) => Standing::At(c.to_owned()),
    };
    let name = report.target.as_str().to_owned();
    let cursor = sealing.after(&name, standing);
    let end = pb::TargetEnd {
        status: Some(failed.unwrap_or_else(status::ok)),
        entries: report.entries,
        complete: report.complete,
    };
    Sealed {
        target: name,
        part: SealedPart::End(end),
        cursor,
    }
}

fn message(target: String, part: Part, cursor: String) -> pb::FleetServiceDumpMapResponse {
    pb::FleetServiceDumpMapResponse {
        target,
        part: Some(part),
        cursor,
    }
}
