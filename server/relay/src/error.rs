//! What a relay call can fail with, and how a target of a call can end
//! in-band when the relay (not the target's daemon) says so: the relay's
//! own terms, no gRPC (`status` turns each into its code, message and
//! stable reason).

use std::time::Duration;

use bpfmapd::{Operation, frontend::Identity};

use bpfmap_client::table::TableError;
use bpfmap_proto::{
    flight::{CommandError, TableRequestError},
    typed::ProjectionError,
};

use crate::cursor::CursorError;

/// Why a fleet call cannot be made.
#[derive(Debug, thiserror::Error)]
pub(crate) enum Error {
    /// The request names no map.
    #[error(
        "the request names no map: set request.map (e.g. {{\"request\":{{\"map\":{{\"path\":\"demo/flows\"}}}}}})"
    )]
    NoMap,
    /// A map reference that is not one.
    #[error("request.map: {0}")]
    Map(bpfmap_client::Error),
    /// A request the fleet cannot make (an aggregate or a watch that does
    /// not read).
    #[error("request: {0}")]
    Request(bpfmap_client::Error),
    /// A fleet cursor and the targets' own cursors, both.
    #[error("give a fleet cursor (cursor) or each target's own (targetCursors), not both")]
    TwoCursors,
    /// A target name the relay does not know.
    #[error("target {name:?} is not one of the relay's ({known}); ListTargets lists them")]
    UnknownTarget {
        /// The name asked.
        name: String,
        /// How many targets the relay knows.
        known: usize,
    },
    /// A target's own cursor for a target the call does not have.
    #[error("targetCursors names {0:?}, which is not one of the call's targets")]
    NotACallTarget(String),
    /// A target's own cursor longer than any a daemon issues.
    #[error("targetCursors[{name:?}] is longer than a daemon's cursor ({max} characters)")]
    TargetCursorTooLong {
        /// The target.
        name: String,
        /// The longest a daemon's cursor is.
        max: usize,
    },
    /// The policy keeps every target of the call from the caller.
    #[error("{identity} may not {} {map} on any of the targets asked", .op.verb())]
    Denied {
        /// The caller.
        identity: Identity,
        /// What it asked to do.
        op: Operation,
        /// The map, as requested.
        map: String,
    },
    /// A fleet cursor that cannot be used.
    #[error("cursor: {0}")]
    Cursor(#[from] CursorError),
    /// A Flight ticket or descriptor whose command is not one.
    #[error("{0}")]
    Command(#[from] CommandError),
    /// A Flight descriptor that names no map and carries no command.
    #[error(
        "a descriptor names a map by its path, or carries a bpfmap.v1.FlightCommand (CMD); for example {}",
        bpfmap_proto::flight::EXAMPLE
    )]
    Descriptor,
    /// A dump command that is not one of a table (raw bytes, another
    /// layout, an unknown per_cpu).
    #[error("{0}")]
    NotATable(#[from] TableRequestError),
    /// A table's `fields` that select no members of the map.
    #[error("fields: {0}")]
    Fields(#[from] ProjectionError),
    /// The values of a map cannot be columns as asked (a sum of members
    /// that are not integers).
    #[error("per_cpu = PER_CPU_SUM: the values of {map} cannot be summed: {error}")]
    Columns {
        /// The map, as requested.
        map: String,
        /// Why.
        error: TableError,
    },
    /// No target of the call described the map (a table's schema comes
    /// from a target's types).
    #[error("no target described {map}: {}", failures_text(.failures))]
    Undescribed {
        /// The map, as requested.
        map: String,
        /// Each target's failure.
        failures: Vec<bpfmap_client::Error>,
    },
}

fn failures_text(failures: &[bpfmap_client::Error]) -> String {
    match failures.first() {
        None => "no target was asked".into(),
        Some(first) if failures.len() == 1 => first.to_string(),
        Some(first) => format!("{first} (and {} more)", failures.len() - 1),
    }
}

/// How a target ends in-band when the relay says so.
#[derive(Debug, Clone, thiserror::Error)]
pub(crate) enum InBand {
    /// The policy keeps this target from the caller.
    #[error("{identity} may not {} {map} on this target", .op.verb())]
    Denied {
        /// The caller.
        identity: Identity,
        /// What it asked to do.
        op: Operation,
        /// The map, as requested.
        map: String,
    },
    /// A target of a fleet cursor that the relay no longer has.
    #[error("no longer one of the relay's targets")]
    Gone,
    /// A target neither probed nor called yet.
    #[error("not asked yet")]
    NotProbed,
    /// A probe without an answer in time.
    #[error("no health answer in {} s", .0.as_secs())]
    ProbeTimeout(Duration),
    /// A daemon whose health says it is not serving.
    #[error("not serving (stopping)")]
    NotServing,
}
