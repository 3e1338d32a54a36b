//! Domain errors, and the one place that turns them into gRPC statuses.
//!
//! Every status carries a google.rpc.ErrorInfo with a stable `reason` (domain
//! "bpfmapd") so that programs can branch on it without parsing messages.
#![forbid(unsafe_code)]

use tonic::{Code, Status};
use tonic_types::{ErrorDetails, StatusExt};

use crate::{
    auth::{Identity, Operation},
    catalog::MapRef,
    cursor::CursorError,
    kernel::{LookupError, MapType, OpenError, SyscallError, walk::WalkError},
};

/// Longest piece of a request quoted in a log line or an error message.
pub const MAX_QUOTE: usize = 64;

/// `s` as a quoted, escaped string of at most [`MAX_QUOTE`] characters
/// (followed by "..." when cut).
pub fn quote(s: &str) -> String {
    match s.char_indices().nth(MAX_QUOTE) {
        None => format!("{s:?}"),
        Some((at, _)) => format!("{:?}...", &s[..at]),
    }
}

/// The ErrorInfo domain of every status.
pub const DOMAIN: &str = "bpfmapd";

/// Everything a call can fail with.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A malformed request; the message says what to fix.
    #[error("{0}")]
    InvalidArgument(String),
    /// Nothing at that path or id.
    #[error("map {0} not found")]
    MapNotFound(MapRef),
    /// A directory, or a pinned program, link or BTF object.
    #[error("{map} is not a BPF map ({what})")]
    NotAMap {
        /// The reference.
        map: MapRef,
        /// What it is instead.
        what: &'static str,
    },
    /// The request names a map by id and the server does not allow it.
    #[error("access by map id is disabled on this server (enable `allow_by_id`)")]
    ByIdDisabled,
    /// The map's type cannot be iterated from user space.
    #[error(
        "map {map} cannot be dumped: maps of type {map_type} cannot be iterated from user space"
    )]
    NotIterable {
        /// The reference.
        map: MapRef,
        /// Its type.
        map_type: MapType,
    },
    /// The daemon cannot size the map's values.
    #[error("map {map} cannot be read: {reason}")]
    Unsized {
        /// The reference.
        map: MapRef,
        /// Why.
        reason: String,
    },
    /// The map's type has no lookup from user space.
    #[error("map {map} does not support lookups from user space (type {map_type})")]
    LookupUnsupported {
        /// The reference.
        map: MapRef,
        /// Its type.
        map_type: MapType,
    },
    /// The map's types are needed and it has none that can be used.
    #[error("map {map} has no types: {why}")]
    Untyped {
        /// The reference.
        map: MapRef,
        /// Why, and what to do instead.
        why: String,
    },
    /// A cursor that cannot be used (its variant says why).
    #[error(transparent)]
    Cursor(#[from] CursorError),
    /// The key a key-walked dump resumes after was deleted.
    #[error(
        "map {0}: the last key delivered before this cursor was deleted; restart the dump without a cursor"
    )]
    ResumeKeyDeleted(MapRef),
    /// The server is stopping.
    #[error("server is shutting down; resume from the last cursor received")]
    ShuttingDown,
    /// The client took no chunk for the stall timeout.
    #[error(
        "the client took no chunk for {secs} s, so the stream was ended; resume from the last cursor received"
    )]
    Stalled {
        /// The stall timeout.
        secs: u64,
    },
    /// A limit was reached; the message names it.
    #[error("{0}")]
    ResourceExhausted(String),
    /// The dump held its slot for the hold time while other dumps waited.
    #[error(
        "this dump held its slot for {secs} s while other dumps were waiting for one, so the stream was ended; resume from the last cursor received"
    )]
    SlotExpired {
        /// limits.max_slot_hold_secs.
        secs: u64,
    },
    /// An entry (or a hash bucket) too large for this server's limits.
    #[error("an entry of map {map} takes {bytes} bytes: {why}")]
    EntryTooLarge {
        /// The reference.
        map: MapRef,
        /// Bytes of one entry (or bucket) in a message.
        bytes: usize,
        /// Which limit, and what to raise.
        why: String,
    },
    /// The response to a Lookup would be too large.
    #[error(
        "the values of {keys} keys of map {map} would make a response of about {bytes} bytes; {}, split the request",
        if *fit == 1 { "only one key of this map fits in one Lookup".to_owned() } else { format!("at most {fit} keys of this map fit in one Lookup") }
    )]
    ResponseTooLarge {
        /// The reference.
        map: MapRef,
        /// Keys asked for.
        keys: usize,
        /// Estimated response size.
        bytes: usize,
        /// Keys that fit.
        fit: usize,
    },
    /// The policy does not allow this.
    #[error("{identity} may not {verb} {map}", verb = .operation.verb())]
    PermissionDenied {
        /// The caller.
        identity: Identity,
        /// What it asked to do.
        operation: Operation,
        /// To which map (as requested).
        map: MapRef,
    },
    /// An unexpected kernel error.
    #[error("map {map}: {source}")]
    Kernel {
        /// The reference.
        map: MapRef,
        /// The failed call.
        #[source]
        source: SyscallError,
    },
    /// Anything else that should not happen.
    #[error("{}{message}", map.as_ref().map(|m| format!("map {m}: ")).unwrap_or_default())]
    Internal {
        /// The map concerned, if any.
        map: Option<MapRef>,
        /// What happened.
        message: String,
    },
}

impl Error {
    /// The gRPC code a client acts on.
    pub fn code(&self) -> Code {
        match self {
            Self::InvalidArgument(_) | Self::ResponseTooLarge { .. } => Code::InvalidArgument,
            Self::SlotExpired { .. } => Code::Unavailable,
            Self::EntryTooLarge { .. } => Code::FailedPrecondition,
            Self::Cursor(c) => match c {
                CursorError::OtherIdentity(_) => Code::PermissionDenied,
                CursorError::MapReplaced { .. } => Code::Aborted,
                CursorError::Encoding
                | CursorError::NotAuthentic
                | CursorError::Malformed
                | CursorError::TooLong
                | CursorError::OtherMap { .. } => Code::InvalidArgument,
            },
            Self::MapNotFound(_) => Code::NotFound,
            Self::NotAMap { .. }
            | Self::ByIdDisabled
            | Self::NotIterable { .. }
            | Self::Unsized { .. }
            | Self::LookupUnsupported { .. }
            | Self::Untyped { .. } => Code::FailedPrecondition,
            Self::ResumeKeyDeleted(_) => Code::Aborted,
            Self::ShuttingDown | Self::Stalled { .. } => Code::Unavailable,
            Self::ResourceExhausted(_) => Code::ResourceExhausted,
            Self::PermissionDenied { .. } => Code::PermissionDenied,
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
            Self::ResponseTooLarge { .. } => "RESPONSE_TOO_LARGE",
            Self::SlotExpired { .. } => "SLOT_EXPIRED",
            Self::EntryTooLarge { .. } => "ENTRY_TOO_LARGE",
            Self::MapNotFound(_) => "MAP_NOT_FOUND",
            Self::NotAMap { .. } => "NOT_A_MAP",
            Self::ByIdDisabled => "BY_ID_DISABLED",
            Self::NotIterable { .. } => "MAP_NOT_ITERABLE",
            Self::Unsized { .. } => "MAP_NOT_SIZED",
            Self::LookupUnsupported { .. } => "LOOKUP_UNSUPPORTED",
            Self::Untyped { .. } => "MAP_UNTYPED",
            Self::Cursor(c) => match c {
                CursorError::OtherIdentity(_) => "CURSOR_OTHER_IDENTITY",
                CursorError::OtherMap { .. } => "CURSOR_OTHER_MAP",
                CursorError::MapReplaced { .. } => "MAP_REPLACED",
                CursorError::Encoding
                | CursorError::NotAuthentic
                | CursorError::Malformed
                | CursorError::TooLong => "CURSOR_INVALID",
            },
            Self::ResumeKeyDeleted(_) => "RESUME_KEY_DELETED",
            Self::ShuttingDown => "SHUTTING_DOWN",
            Self::Stalled { .. } => "CLIENT_STALLED",
            Self::ResourceExhausted(_) => "LIMIT_REACHED",
            Self::PermissionDenied { .. } => "PERMISSION_DENIED",
            Self::Kernel { .. } => "KERNEL_ERROR",
            Self::Internal { .. } => "INTERNAL",
        }
    }

    /// A map that could not be opened.
    pub fn from_open(map: &MapRef, e: OpenError) -> Self {
        match e {
            OpenError::NotFound => Self::MapNotFound(map.clone()),
            OpenError::NotAMap => Self::NotAMap {
                map: map.clone(),
                what: "a pinned program, link or BTF object",
            },
            OpenError::Syscall(source) => Self::Kernel {
                map: map.clone(),
                source,
            },
        }
    }

    /// A walk that failed.
    pub fn from_walk(map: &MapRef, e: WalkError) -> Self {
        match e {
            WalkError::NotIterable(map_type) => Self::NotIterable {
                map: map.clone(),
                map_type,
            },
            WalkError::ResumeKeyDeleted => Self::ResumeKeyDeleted(map.clone()),
            WalkError::Unsized(reason) => Self::Unsized {
                map: map.clone(),
                reason,
            },
            WalkError::BadToken => Self::Cursor(CursorError::MapReplaced {
                map: map.clone(),
                detail: "the cursor's position no longer fits it".into(),
            }),
            WalkError::BucketTooLarge { .. } => Self::Internal {
                map: Some(map.clone()),
                message: e.to_string(),
            },
            WalkError::Syscall(source) => Self::Kernel {
                map: map.clone(),
                source,
            },
        }
    }

    /// A lookup that failed.
    pub fn from_lookup(map: &MapRef, e: LookupError) -> Self {
        match e {
            LookupError::Unsupported(map_type) => Self::LookupUnsupported {
                map: map.clone(),
                map_type,
            },
            LookupError::Unsized(reason) => Self::Unsized {
                map: map.clone(),
                reason,
            },
            LookupError::KeySize { expected, got } => Self::InvalidArgument(format!(
                "a key is {got} bytes; map {map} has {expected}-byte keys"
            )),
            LookupError::Syscall(source) => Self::Kernel {
                map: map.clone(),
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quotes_are_bounded_and_escaped() {
        assert_eq!(quote("demo/flows"), "\"demo/flows\"");
        assert_eq!(quote("a\nb"), "\"a\\nb\"");
        let long = "x".repeat(10_000);
        let q = quote(&long);
        assert_eq!(q.len(), MAX_QUOTE + 2 + 3);
        assert!(q.ends_with("\"..."));
        let wide = "é".repeat(100);
        assert!(quote(&wide).starts_with("\"éé"));
    }
}
