//! The one place that turns the daemon's errors into gRPC statuses.
//!
//! Every status carries a google.rpc.ErrorInfo with a stable `reason`
//! (domain "bpfmapd") so that programs can branch on it without parsing
//! messages.

use tonic::{Code, Status};
use tonic_types::{ErrorDetails, StatusExt};

use crate::{cursor::CursorError, error::Error};

/// The ErrorInfo domain of every status.
pub(crate) const DOMAIN: &str = "bpfmapd";

/// The gRPC code a client acts on.
pub(crate) fn code(e: &Error) -> Code {
    match e {
        Error::InvalidArgument(_)
        | Error::InvalidPath(_)
        | Error::Query(_)
        | Error::ResponseTooLarge { .. } => Code::InvalidArgument,
        Error::SlotExpired { .. } => Code::Unavailable,
        Error::EntryTooLarge { .. } => Code::FailedPrecondition,
        Error::Cursor(c) => match c {
            CursorError::OtherIdentity(_) => Code::PermissionDenied,
            CursorError::MapReplaced { .. } => Code::Aborted,
            CursorError::Encoding
            | CursorError::NotAuthentic
            | CursorError::Malformed
            | CursorError::TooLong
            | CursorError::OtherMap { .. }
            | CursorError::OtherQuery => Code::InvalidArgument,
        },
        Error::MapNotFound(_) | Error::NameNotFound { .. } | Error::NoInnerMap { .. } => {
            Code::NotFound
        }
        Error::NameAmbiguous { .. } | Error::NotMapOfMaps { .. } => Code::FailedPrecondition,
        Error::NotAMap { .. }
        | Error::ByIdDisabled
        | Error::NotIterable { .. }
        | Error::Unsized { .. }
        | Error::LookupUnsupported { .. }
        | Error::Untyped { .. }
        | Error::TypedByBtf { .. } => Code::FailedPrecondition,
        Error::ResumeKeyDeleted(_) | Error::MapChanged(_) | Error::DrainBusy(_) => Code::Aborted,
        Error::NotDrainable(_) | Error::KernelWalkUnavailable(_) => Code::FailedPrecondition,
        Error::SpoolCorrupt(_) => Code::DataLoss,
        Error::ShuttingDown | Error::Stalled { .. } => Code::Unavailable,
        Error::Cancelled => Code::Cancelled,
        Error::ResourceExhausted(_) | Error::FilterTooCostly(_) | Error::WatchTooLarge(_) => {
            Code::ResourceExhausted
        }
        Error::PermissionDenied { .. } => Code::PermissionDenied,
        Error::Kernel { source, .. } => match source.errno() {
            Some(libc::EPERM) | Some(libc::EACCES) => Code::FailedPrecondition,
            _ => Code::Internal,
        },
        Error::Internal { .. } => Code::Internal,
    }
}

/// Stable machine-readable reason (google.rpc.ErrorInfo.reason).
pub(crate) fn reason(e: &Error) -> &'static str {
    match e {
        Error::InvalidArgument(_) | Error::InvalidPath(_) | Error::Query(_) => "INVALID_REQUEST",
        Error::ResponseTooLarge { .. } => "RESPONSE_TOO_LARGE",
        Error::SlotExpired { .. } => "SLOT_EXPIRED",
        Error::EntryTooLarge { .. } => "ENTRY_TOO_LARGE",
        Error::MapNotFound(_) | Error::NameNotFound { .. } | Error::NoInnerMap { .. } => {
            "MAP_NOT_FOUND"
        }
        Error::NameAmbiguous { .. } => "MAP_NAME_AMBIGUOUS",
        Error::NotMapOfMaps { .. } => "NOT_A_MAP_OF_MAPS",
        Error::NotAMap { .. } => "NOT_A_MAP",
        Error::ByIdDisabled => "BY_ID_DISABLED",
        Error::NotIterable { .. } => "MAP_NOT_ITERABLE",
        Error::Unsized { .. } => "MAP_NOT_SIZED",
        Error::LookupUnsupported { .. } => "LOOKUP_UNSUPPORTED",
        Error::Untyped { .. } => "MAP_UNTYPED",
        Error::TypedByBtf { .. } => "MAP_TYPED",
        Error::Cursor(c) => match c {
            CursorError::OtherIdentity(_) => "CURSOR_OTHER_IDENTITY",
            CursorError::OtherMap { .. } => "CURSOR_OTHER_MAP",
            CursorError::OtherQuery => "CURSOR_OTHER_QUERY",
            CursorError::MapReplaced { .. } => "MAP_REPLACED",
            CursorError::Encoding
            | CursorError::NotAuthentic
            | CursorError::Malformed
            | CursorError::TooLong => "CURSOR_INVALID",
        },
        Error::ResumeKeyDeleted(_) => "RESUME_KEY_DELETED",
        Error::MapChanged(_) => "MAP_REPLACED",
        Error::NotDrainable(_) => "NOT_DRAINABLE",
        Error::KernelWalkUnavailable(_) => "KERNEL_WALK_UNAVAILABLE",
        Error::DrainBusy(_) => "DRAIN_BUSY",
        Error::SpoolCorrupt(_) => "SPOOL_CORRUPT",
        Error::ShuttingDown => "SHUTTING_DOWN",
        Error::Cancelled => "CANCELLED",
        Error::Stalled { .. } => "CLIENT_STALLED",
        Error::ResourceExhausted(_) | Error::FilterTooCostly(_) => "LIMIT_REACHED",
        Error::WatchTooLarge(_) => "WATCH_TOO_LARGE",
        Error::PermissionDenied { .. } => "PERMISSION_DENIED",
        Error::Kernel { .. } => "KERNEL_ERROR",
        Error::Internal { .. } => "INTERNAL",
    }
}

impl From<Error> for Status {
    fn from(e: Error) -> Self {
        let code = code(&e);
        if code == Code::Internal {
            tracing::error!(error = %e, "internal error");
        }
        Status::with_error_details(
            code,
            e.to_string(),
            ErrorDetails::with_error_info(reason(&e), DOMAIN, []),
        )
    }
}

/// The code of a call's result (OK for a success).
pub(crate) fn code_of<T>(r: &Result<T, Error>) -> Code {
    r.as_ref().map_or_else(code, |_| Code::Ok)
}
