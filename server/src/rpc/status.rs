//! The one place that turns the daemon's errors into gRPC statuses.
//!
//! Every status carries a google.rpc.ErrorInfo with a stable `reason`
//! (domain "bpfmapd") so that programs can branch on it without parsing
//! messages; the reasons are `bpfmap_proto::status::Reason`, shared with
//! bpfmap-relay.

use bpfmap_proto::status::{DOMAIN, Reason};
use tonic::{Code, Status};
use tonic_types::{ErrorDetails, StatusExt};

use crate::{cursor::CursorError, error::Error};

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
        Error::NotDrainable(_) | Error::KernelWalkUnavailable(_) | Error::NoStackMap(_) => {
            Code::FailedPrecondition
        }
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
pub(crate) fn reason(e: &Error) -> Reason {
    match e {
        Error::InvalidArgument(_) | Error::InvalidPath(_) | Error::Query(_) => {
            Reason::InvalidRequest
        }
        Error::ResponseTooLarge { .. } => Reason::ResponseTooLarge,
        Error::SlotExpired { .. } => Reason::SlotExpired,
        Error::EntryTooLarge { .. } => Reason::EntryTooLarge,
        Error::MapNotFound(_) | Error::NameNotFound { .. } | Error::NoInnerMap { .. } => {
            Reason::MapNotFound
        }
        Error::NameAmbiguous { .. } => Reason::MapNameAmbiguous,
        Error::NotMapOfMaps { .. } => Reason::NotAMapOfMaps,
        Error::NotAMap { .. } => Reason::NotAMap,
        Error::ByIdDisabled => Reason::ByIdDisabled,
        Error::NotIterable { .. } => Reason::MapNotIterable,
        Error::Unsized { .. } => Reason::MapNotSized,
        Error::LookupUnsupported { .. } => Reason::LookupUnsupported,
        Error::Untyped { .. } => Reason::MapUntyped,
        Error::TypedByBtf { .. } => Reason::MapTyped,
        Error::Cursor(c) => match c {
            CursorError::OtherIdentity(_) => Reason::CursorOtherIdentity,
            CursorError::OtherMap { .. } => Reason::CursorOtherMap,
            CursorError::OtherQuery => Reason::CursorOtherQuery,
            CursorError::MapReplaced { .. } => Reason::MapReplaced,
            CursorError::Encoding
            | CursorError::NotAuthentic
            | CursorError::Malformed
            | CursorError::TooLong => Reason::CursorInvalid,
        },
        Error::ResumeKeyDeleted(_) => Reason::ResumeKeyDeleted,
        Error::MapChanged(_) => Reason::MapReplaced,
        Error::NotDrainable(_) => Reason::NotDrainable,
        Error::KernelWalkUnavailable(_) => Reason::KernelWalkUnavailable,
        Error::NoStackMap(_) => Reason::NoStackMap,
        Error::DrainBusy(_) => Reason::DrainBusy,
        Error::SpoolCorrupt(_) => Reason::SpoolCorrupt,
        Error::ShuttingDown => Reason::ShuttingDown,
        Error::Cancelled => Reason::Cancelled,
        Error::Stalled { .. } => Reason::ClientStalled,
        Error::ResourceExhausted(_) | Error::FilterTooCostly(_) => Reason::LimitReached,
        Error::WatchTooLarge(_) => Reason::WatchTooLarge,
        Error::PermissionDenied { .. } => Reason::PermissionDenied,
        Error::Kernel { .. } => Reason::KernelError,
        Error::Internal { .. } => Reason::Internal,
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
            ErrorDetails::with_error_info(reason(&e).as_str(), DOMAIN, []),
        )
    }
}

/// The code of a call's result (OK for a success).
pub(crate) fn code_of<T>(r: &Result<T, Error>) -> Code {
    r.as_ref().map_or_else(code, |_| Code::Ok)
}
