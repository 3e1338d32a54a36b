//! Domain errors, and the one place that turns them into gRPC statuses.
//!
//! Every status carries a google.rpc.ErrorInfo with a stable `reason` (domain
//! "bpfmapd") so that programs can branch on it without parsing messages.

use tonic::{Code, Status};
use tonic_types::{ErrorDetails, StatusExt};

use crate::{
    cursor::CursorError,
    kernel::{OpenError, SyscallError, walk::WalkError},
};

pub const DOMAIN: &str = "bpfmapd";

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("{0}")]
    InvalidArgument(String),
    #[error("map {0} not found")]
    MapNotFound(String),
    #[error("{map} is not a BPF map ({what})")]
    NotAMap { map: String, what: &'static str },
    #[error("access by map id is disabled on this server (enable `allow_by_id`)")]
    ByIdDisabled,
    #[error(
        "map {map} cannot be dumped: maps of type {type_name} cannot be iterated from user space"
    )]
    NotIterable { map: String, type_name: String },
    #[error("map {map} does not support lookups from user space (type {type_name})")]
    LookupUnsupported { map: String, type_name: String },
    #[error("invalid cursor: {0}")]
    BadCursor(#[from] CursorError),
    #[error("cursor was issued for {cursor_ref}, not for {request_ref}")]
    CursorForAnotherMap {
        cursor_ref: String,
        request_ref: String,
    },
    #[error(
        "map {map} was replaced since the cursor was issued ({detail}); restart the dump without a cursor"
    )]
    MapReplaced { map: String, detail: String },
    #[error(
        "map {map}: the last key delivered before this cursor was deleted; restart the dump without a cursor"
    )]
    ResumeKeyDeleted { map: String },
    #[error("server is shutting down; resume from the last cursor received")]
    ShuttingDown,
    #[error(
        "the client took no chunk for {secs} s, so the stream was ended; resume from the last cursor received"
    )]
    Stalled { secs: u64 },
    #[error("{0}")]
    ResourceExhausted(String),
    #[error("{identity} may not {verb} {map}")]
    PermissionDenied {
        identity: String,
        verb: &'static str,
        map: String,
    },
    #[error("cursor was issued to another identity, not to {identity}")]
    CursorOtherIdentity { identity: String },
    #[error("map {map}: {source}")]
    Kernel {
        map: String,
        #[source]
        source: SyscallError,
    },
    #[error("map {map}: {message}")]
    Internal { map: String, message: String },
}

impl Error {
    pub fn code(&self) -> Code {
        match self {
            Self::InvalidArgument(_) | Self::BadCursor(_) | Self::CursorForAnotherMap { .. } => {
                Code::InvalidArgument
            }
            Self::MapNotFound(_) => Code::NotFound,
            Self::NotAMap { .. }
            | Self::ByIdDisabled
            | Self::NotIterable { .. }
            | Self::LookupUnsupported { .. } => Code::FailedPrecondition,
            Self::MapReplaced { .. } | Self::ResumeKeyDeleted { .. } => Code::Aborted,
            Self::ShuttingDown | Self::Stalled { .. } => Code::Unavailable,
            Self::ResourceExhausted(_) => Code::ResourceExhausted,
            Self::PermissionDenied { .. } | Self::CursorOtherIdentity { .. } => {
                Code::PermissionDenied
            }
            Self::Kernel { source, .. } => match source.errno() {
                Some(libc::EPERM) | Some(libc::EACCES) => Code::FailedPrecondition,
                _ => Code::Internal,
            },
            Self::Internal { .. } => Code::Internal,
        }
    }

    /// Stable machine-readable reason (google.rpc.ErrorInfo.reason).
    pub fn reason(&self) -> &'static str {
        match self {
            Self::InvalidArgument(_) => "INVALID_REQUEST",
            Self::MapNotFound(_) => "MAP_NOT_FOUND",
            Self::NotAMap { .. } => "NOT_A_MAP",
            Self::ByIdDisabled => "BY_ID_DISABLED",
            Self::NotIterable { .. } => "MAP_NOT_ITERABLE",
            Self::LookupUnsupported { .. } => "LOOKUP_UNSUPPORTED",
            Self::BadCursor(_) => "CURSOR_INVALID",
            Self::CursorForAnotherMap { .. } => "CURSOR_OTHER_MAP",
            Self::MapReplaced { .. } => "MAP_REPLACED",
            Self::ResumeKeyDeleted { .. } => "RESUME_KEY_DELETED",
            Self::ShuttingDown => "SHUTTING_DOWN",
            Self::Stalled { .. } => "CLIENT_STALLED",
            Self::ResourceExhausted(_) => "LIMIT_REACHED",
            Self::PermissionDenied { .. } => "PERMISSION_DENIED",
            Self::CursorOtherIdentity { .. } => "CURSOR_OTHER_IDENTITY",
            Self::Kernel { .. } => "KERNEL_ERROR",
            Self::Internal { .. } => "INTERNAL",
        }
    }

    pub fn from_open(map: &str, e: OpenError) -> Self {
        match e {
            OpenError::NotFound => Self::MapNotFound(map.to_owned()),
            OpenError::NotAMap => Self::NotAMap {
                map: map.to_owned(),
                what: "a pinned program, link or BTF object",
            },
            OpenError::Syscall(source) => Self::Kernel {
                map: map.to_owned(),
                source,
            },
        }
    }

    pub fn from_walk(map: &str, e: WalkError) -> Self {
        match e {
            WalkError::NotIterable { type_name } => Self::NotIterable {
                map: map.to_owned(),
                type_name,
            },
            WalkError::ResumeKeyDeleted => Self::ResumeKeyDeleted {
                map: map.to_owned(),
            },
            WalkError::BadToken => Self::MapReplaced {
                map: map.to_owned(),
                detail: "the cursor's position no longer fits it".into(),
            },
            WalkError::BucketTooLarge { .. } => Self::Internal {
                map: map.to_owned(),
                message: e.to_string(),
            },
            WalkError::Syscall(source) => Self::Kernel {
                map: map.to_owned(),
                source,
            },
        }
    }
}

impl From<Error> for Status {
    fn from(e: Error) -> Self {
        let code = e.code();
        if code == Code::Internal {
            tracing::error!(error = %e, "internal error");
        }
        Status::with_error_details(
            code,
            e.to_string(),
            ErrorDetails::with_error_info(e.reason(), DOMAIN, []),
        )
    }
}
