//! The one place that turns what the relay says into statuses: a call's
//! [`Error`] into its gRPC status (code, message, and a google.rpc.ErrorInfo
//! with a stable reason, domain "bpfmapd"), and a target's end into the
//! in-band `TargetStatus` that names it (the daemon's reason when its
//! daemon gave one, the relay's otherwise). The reasons are the daemon's
//! vocabulary ([`Reason`], bpfmap-proto), with the few the relay adds.

use bpfmap_client::pb;
use bpfmap_proto::status::{DOMAIN, Reason};
use tonic::{Code, Status};
use tonic_types::{ErrorDetails, StatusExt as _};

use crate::{
    cursor::CursorError,
    error::{Error, InBand},
};

/// The code a caller acts on.
pub(crate) fn code(e: &Error) -> Code {
    match e {
        Error::NoMap
        | Error::Map(_)
        | Error::Request(_)
        | Error::TwoCursors
        | Error::UnknownTarget { .. }
        | Error::NotACallTarget(_)
        | Error::TargetCursorTooLong { .. }
        | Error::Command(_)
        | Error::Descriptor
        | Error::NotATable(_)
        | Error::Fields(_)
        | Error::Columns { .. } => Code::InvalidArgument,
        Error::Undescribed { failures, .. } => undescribed(failures).0,
        Error::Denied { .. } => Code::PermissionDenied,
        Error::Cursor(c) => match c {
            CursorError::OtherIdentity => Code::PermissionDenied,
            CursorError::Invalid | CursorError::OtherCall | CursorError::NotATarget => {
                Code::InvalidArgument
            }
        },
    }
}

/// The stable reason.
pub(crate) fn reason(e: &Error) -> Reason {
    match e {
        Error::NoMap
        | Error::Map(_)
        | Error::Request(_)
        | Error::TwoCursors
        | Error::Command(_)
        | Error::Descriptor
        | Error::NotATable(_)
        | Error::Fields(_)
        | Error::Columns { .. } => Reason::InvalidRequest,
        Error::Undescribed { failures, .. } => undescribed(failures).1,
        Error::UnknownTarget { .. } | Error::NotACallTarget(_) => Reason::TargetUnknown,
        Error::TargetCursorTooLong { .. } => Reason::CursorInvalid,
        Error::Denied { .. } => Reason::PermissionDenied,
        Error::Cursor(c) => match c {
            CursorError::OtherIdentity => Reason::CursorOtherIdentity,
            CursorError::OtherCall => Reason::CursorOtherCall,
            CursorError::Invalid | CursorError::NotATarget => Reason::CursorInvalid,
        },
    }
}

/// A map no target described: NOT_FOUND when every target said so,
/// UNAVAILABLE (no answer to read) otherwise.
fn undescribed(failures: &[bpfmap_client::Error]) -> (Code, Reason) {
    let not_found = |e: &bpfmap_client::Error| e.code() == Code::NotFound;
    match !failures.is_empty() && failures.iter().all(not_found) {
        true => (Code::NotFound, Reason::MapNotFound),
        false => (Code::Unavailable, Reason::TargetUnreachable),
    }
}

impl From<Error> for Status {
    fn from(e: Error) -> Self {
        Status::with_error_details(
            code(&e),
            e.to_string(),
            ErrorDetails::with_error_info(reason(&e).as_str(), DOMAIN, []),
        )
    }
}

/// A target's end the relay decides: its code and reason.
fn in_band_code(e: &InBand) -> (Code, Reason) {
    match e {
        InBand::Denied { .. } => (Code::PermissionDenied, Reason::PermissionDenied),
        InBand::Gone => (Code::NotFound, Reason::TargetGone),
        InBand::NotProbed => (Code::Unknown, Reason::TargetNotProbed),
        InBand::ProbeTimeout(_) => (Code::DeadlineExceeded, Reason::TargetTimeout),
        InBand::NotServing => (Code::Unavailable, Reason::ShuttingDown),
    }
}

/// A target's end the relay decides, as answers carry it.
pub(crate) fn in_band(e: &InBand) -> pb::TargetStatus {
    let (code, reason) = in_band_code(e);
    target_status(code, reason.as_str(), e.to_string())
}

/// A target that ended well.
pub(crate) fn ok() -> pb::TargetStatus {
    pb::TargetStatus {
        code: bpfmap_client::code_name(Code::Ok).to_owned(),
        ..Default::default()
    }
}

/// A target's failure, as answers carry it: its daemon's reason when the
/// daemon gave one (passed on as sent, even one this relay does not know),
/// the relay's own when the failure came before the daemon answered or
/// from the fleet call itself.
pub(crate) fn of_target(e: &bpfmap_client::Error) -> pb::TargetStatus {
    let code = e.code();
    let name = bpfmap_client::code_name(code);
    let text = e.to_string();
    let message = match text.strip_prefix(name).and_then(|t| t.strip_prefix(": ")) {
        Some(rest) => rest.to_owned(),
        None => text,
    };
    match e.status().and_then(bpfmap_proto::status::reason) {
        Some(daemon) => target_status(code, &daemon, message),
        None => target_status(code, relay_reason(e).as_str(), message),
    }
}

/// The reason of a target's failure its daemon gave none for (a timeout
/// while retrying has the reason of the failure it retried after).
fn relay_reason(e: &bpfmap_client::Error) -> Reason {
    use bpfmap_client::Error as E;
    match e {
        E::Deadline { .. } => Reason::CallDeadline,
        E::Timeout { retrying: None, .. } => Reason::TargetTimeout,
        E::Protocol(_) | E::Types(_) => Reason::Internal,
        E::MapName(_) | E::Target(_) | E::Render { .. } | E::Aggregate { .. } => {
            Reason::InvalidRequest
        }
        _ => match e.code() {
            Code::DeadlineExceeded => Reason::TargetTimeout,
            Code::InvalidArgument => Reason::InvalidRequest,
            Code::ResourceExhausted => Reason::LimitReached,
            Code::Cancelled => Reason::Cancelled,
            // No connection, a broken one, a failed handshake, a status of
            // the transport rather than of the daemon's service.
            _ => Reason::TargetUnreachable,
        },
    }
}

fn target_status(code: Code, reason: &str, message: String) -> pb::TargetStatus {
    pb::TargetStatus {
        code: bpfmap_client::code_name(code).to_owned(),
        reason: reason.to_owned(),
        message,
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use bpfmapd::{Operation, frontend::Identity};
    use tonic_types::StatusExt as _;

    use super::*;

    #[test]
    fn every_error_has_its_code_its_reason_and_its_message() {
        let cases = [
            (Error::NoMap, Code::InvalidArgument, "INVALID_REQUEST"),
            (
                Error::UnknownTarget {
                    name: "x:1".into(),
                    known: 2,
                },
                Code::InvalidArgument,
                "TARGET_UNKNOWN",
            ),
            (
                Error::Denied {
                    identity: Identity::Cn("ops".into()),
                    op: Operation::Dump,
                    map: "demo/flows".into(),
                },
                Code::PermissionDenied,
                "PERMISSION_DENIED",
            ),
            (
                Error::Cursor(CursorError::OtherIdentity),
                Code::PermissionDenied,
                "CURSOR_OTHER_IDENTITY",
            ),
            (
                Error::Cursor(CursorError::OtherCall),
                Code::InvalidArgument,
                "CURSOR_OTHER_CALL",
            ),
            (
                Error::Cursor(CursorError::Invalid),
                Code::InvalidArgument,
                "CURSOR_INVALID",
            ),
        ];
        for (e, want_code, want_reason) in cases {
            let message = e.to_string();
            let status = Status::from(e);
            assert_eq!(status.code(), want_code, "{message}");
            assert_eq!(status.message(), message);
            let info = status.get_details_error_info().expect("an ErrorInfo");
            assert_eq!(
                (info.reason.as_str(), info.domain.as_str()),
                (want_reason, "bpfmapd")
            );
        }
    }

    #[test]
    fn a_target_s_status_has_its_daemon_s_reason_or_the_relay_s() {
        let daemon = bpfmap_client::Error::Status(Status::with_error_details(
            Code::NotFound,
            "no map at demo/x",
            ErrorDetails::with_error_info("MAP_NOT_FOUND", DOMAIN, []),
        ));
        let s = of_target(&daemon);
        assert_eq!(
            (s.code.as_str(), s.reason.as_str(), s.message.as_str()),
            ("NOT_FOUND", "MAP_NOT_FOUND", "no map at demo/x")
        );
        let refused = bpfmap_client::Error::Status(Status::unavailable("tcp connect error"));
        assert_eq!(of_target(&refused).reason, "TARGET_UNREACHABLE");
        let retried = bpfmap_client::Error::Timeout {
            after: Duration::from_secs(5),
            retrying: Some(Status::unavailable("tcp connect error")),
        };
        assert_eq!(
            (
                of_target(&retried).code.as_str(),
                of_target(&retried).reason.as_str()
            ),
            ("UNAVAILABLE", "TARGET_UNREACHABLE")
        );
        let frozen = bpfmap_client::Error::Timeout {
            after: Duration::from_secs(5),
            retrying: None,
        };
        assert_eq!(of_target(&frozen).reason, "TARGET_TIMEOUT");
        let late = bpfmap_client::Error::Deadline {
            deadline: Duration::from_secs(2),
        };
        assert_eq!(
            (
                of_target(&late).code.as_str(),
                of_target(&late).reason.as_str()
            ),
            ("DEADLINE_EXCEEDED", "CALL_DEADLINE")
        );
        let gone = in_band(&InBand::Gone);
        assert_eq!(
            (
                gone.code.as_str(),
                gone.reason.as_str(),
                gone.message.as_str()
            ),
            (
                "NOT_FOUND",
                "TARGET_GONE",
                "no longer one of the relay's targets"
            )
        );
        assert_eq!(in_band(&InBand::NotProbed).reason, "TARGET_NOT_PROBED");
        assert_eq!(ok().code, "OK");
    }
}
