//! gRPC status codes by their canonical names, for the daemon's metrics
//! and the clients' reports alike, and the stable reasons the daemon's and
//! the relay's statuses carry ([`Reason`]), defined once for both.

use tonic::Code;

/// The google.rpc.ErrorInfo domain of every reason the daemon and the
/// relay send.
pub const DOMAIN: &str = "bpfmapd";

/// Defines [`Reason`]: each variant with its string, written once.
macro_rules! reasons {
    ($($(#[$doc:meta])* $variant:ident => $text:literal,)*) => {
        /// A stable, machine-readable reason (google.rpc.ErrorInfo.reason,
        /// domain [`DOMAIN`]) carried by the daemon's statuses, the relay's,
        /// and the relay's in-band `TargetStatus.reason`: what programs
        /// branch on instead of parsing messages. Each is listed with its
        /// code in proto/docs/errors.md. A server newer than this crate may
        /// send a reason it does not know: [`reason`] gives the string
        /// whatever it is, `parse` tells whether it is known.
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
        #[non_exhaustive]
        pub enum Reason {
            $($(#[$doc])* $variant,)*
        }

        impl Reason {
            /// Every reason, in the order of proto/docs/errors.md.
            pub const ALL: &'static [Reason] = &[$(Reason::$variant,)*];

            /// The reason as it travels ("MAP_NOT_FOUND").
            pub fn as_str(self) -> &'static str {
                match self {
                    $(Reason::$variant => $text,)*
                }
            }
        }
    };
}

reasons! {
    /// A malformed request; the message says what to fix.
    InvalidRequest => "INVALID_REQUEST",
    /// A Lookup for more keys than fit in one response.
    ResponseTooLarge => "RESPONSE_TOO_LARGE",
    /// A cursor that is not valid, altered, sealed under a key no longer
    /// held, unreadable or too long.
    CursorInvalid => "CURSOR_INVALID",
    /// A cursor issued for another map reference.
    CursorOtherMap => "CURSOR_OTHER_MAP",
    /// A cursor issued for a dump with another filter or other fields.
    CursorOtherQuery => "CURSOR_OTHER_QUERY",
    /// A cursor issued to another identity.
    CursorOtherIdentity => "CURSOR_OTHER_IDENTITY",
    /// The policy does not allow the call.
    PermissionDenied => "PERMISSION_DENIED",
    /// A limit on dumps, lookups, watches or memory: retry later.
    LimitReached => "LIMIT_REACHED",
    /// A map too large to watch: retrying cannot help.
    WatchTooLarge => "WATCH_TOO_LARGE",
    /// No such map.
    MapNotFound => "MAP_NOT_FOUND",
    /// A name that matches several maps.
    MapNameAmbiguous => "MAP_NAME_AMBIGUOUS",
    /// An inner map asked of a map that holds no maps.
    NotAMapOfMaps => "NOT_A_MAP_OF_MAPS",
    /// Not a map.
    NotAMap => "NOT_A_MAP",
    /// A map named by id while that is turned off.
    ByIdDisabled => "BY_ID_DISABLED",
    /// A dump of a type that cannot be iterated.
    MapNotIterable => "MAP_NOT_ITERABLE",
    /// A Lookup on a type without lookups from user space.
    LookupUnsupported => "LOOKUP_UNSUPPORTED",
    /// Values the daemon cannot size.
    MapNotSized => "MAP_NOT_SIZED",
    /// JSON keys for a map without usable types.
    MapUntyped => "MAP_UNTYPED",
    /// A type declared for a key or value whose type the map's BTF gives.
    MapTyped => "MAP_TYPED",
    /// An entry or bucket too large for the daemon's limits.
    EntryTooLarge => "ENTRY_TOO_LARGE",
    /// The map behind a cursor's reference was replaced.
    MapReplaced => "MAP_REPLACED",
    /// Another DrainMap call drains the map.
    DrainBusy => "DRAIN_BUSY",
    /// A map that may not, or cannot, be drained.
    NotDrainable => "NOT_DRAINABLE",
    /// A cursor of a walk inside the kernel that cannot run now.
    KernelWalkUnavailable => "KERNEL_WALK_UNAVAILABLE",
    /// A drain spool that does not read back as written.
    SpoolCorrupt => "SPOOL_CORRUPT",
    /// The key a key-by-key walk stood on was deleted.
    ResumeKeyDeleted => "RESUME_KEY_DELETED",
    /// The server is stopping.
    ShuttingDown => "SHUTTING_DOWN",
    /// The client took no chunk for the stall timeout.
    ClientStalled => "CLIENT_STALLED",
    /// A dump held its slot too long while others waited.
    SlotExpired => "SLOT_EXPIRED",
    /// The call was cancelled.
    Cancelled => "CANCELLED",
    /// A kernel call failed.
    KernelError => "KERNEL_ERROR",
    /// Anything else that should not happen.
    Internal => "INTERNAL",
    /// StackMap found no stack-trace map for the counts map, several, or
    /// was named a map that is not one.
    NoStackMap => "NO_STACK_MAP",
    /// A fleet cursor issued for another fleet call (the relay).
    CursorOtherCall => "CURSOR_OTHER_CALL",
    /// A target the relay does not know, or not one of the call's (the
    /// relay).
    TargetUnknown => "TARGET_UNKNOWN",
    /// The relay got no answer from a target's daemon: no connection, a
    /// broken one, a failed handshake (in-band).
    TargetUnreachable => "TARGET_UNREACHABLE",
    /// A target's daemon did not answer in time (in-band).
    TargetTimeout => "TARGET_TIMEOUT",
    /// The caller's deadline came before a target was done (in-band).
    CallDeadline => "CALL_DEADLINE",
    /// A target of a fleet cursor the relay no longer has (in-band).
    TargetGone => "TARGET_GONE",
    /// A target the relay has neither probed nor called yet (in-band,
    /// ListTargets).
    TargetNotProbed => "TARGET_NOT_PROBED",
    /// A target whose map has other types than the rest of a fleet table
    /// (in-band, the relay's Arrow Flight).
    TypesDiffer => "TYPES_DIFFER",
    /// A target whose histogram's buckets count other values than the
    /// rest of a fleet histogram's (in-band, the relay's HistogramMap).
    HistogramsDiffer => "HISTOGRAMS_DIFFER",
}

impl std::fmt::Display for Reason {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A reason this crate does not know.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown reason {0:?}")]
pub struct UnknownReason(pub String);

impl std::str::FromStr for Reason {
    type Err = UnknownReason;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Reason::ALL
            .iter()
            .copied()
            .find(|r| r.as_str() == s)
            .ok_or_else(|| UnknownReason(s.to_owned()))
    }
}

/// The canonical name of a status code ("NOT_FOUND"), as gRPC's
/// documentation and the usual `grpc_code` metric label spell it.
pub fn code_name(code: Code) -> &'static str {
    use Code::*;
    match code {
        Ok => "OK",
        Cancelled => "CANCELLED",
        Unknown => "UNKNOWN",
        InvalidArgument => "INVALID_ARGUMENT",
        DeadlineExceeded => "DEADLINE_EXCEEDED",
        NotFound => "NOT_FOUND",
        AlreadyExists => "ALREADY_EXISTS",
        PermissionDenied => "PERMISSION_DENIED",
        ResourceExhausted => "RESOURCE_EXHAUSTED",
        FailedPrecondition => "FAILED_PRECONDITION",
        Aborted => "ABORTED",
        OutOfRange => "OUT_OF_RANGE",
        Unimplemented => "UNIMPLEMENTED",
        Internal => "INTERNAL",
        Unavailable => "UNAVAILABLE",
        DataLoss => "DATA_LOSS",
        Unauthenticated => "UNAUTHENTICATED",
    }
}

/// `google.rpc.Status`, as far as the reason of its ErrorInfo.
#[derive(Clone, PartialEq, prost::Message)]
struct RpcStatus {
    #[prost(message, repeated, tag = "3")]
    details: Vec<prost_types::Any>,
}

/// `google.rpc.ErrorInfo`'s reason and domain.
#[derive(Clone, PartialEq, prost::Message)]
struct ErrorInfo {
    #[prost(string, tag = "1")]
    reason: String,
    #[prost(string, tag = "2")]
    domain: String,
}

/// The stable reason a bpfmapd or bpfmap-relay status carries (its
/// google.rpc.ErrorInfo with domain "bpfmapd": "LIMIT_REACHED",
/// "WATCH_TOO_LARGE", ...), if any, as sent (see [`Reason`]).
pub fn reason(status: &tonic::Status) -> Option<String> {
    use prost::Message as _;
    let details = RpcStatus::decode(status.details()).ok()?;
    details
        .details
        .iter()
        .filter(|a| a.type_url == "type.googleapis.com/google.rpc.ErrorInfo")
        .filter_map(|a| ErrorInfo::decode(a.value.as_slice()).ok())
        .find(|i| i.domain == DOMAIN)
        .map(|i| i.reason)
}

/// A status carrying `reason` as bpfmapd's statuses do (a
/// google.rpc.ErrorInfo of domain [`DOMAIN`]): what a client makes of a
/// status a relay passed on in-band, so that [`reason`] reads it as it
/// reads the daemon's own.
pub fn with_reason(code: Code, message: impl Into<String>, reason: &str) -> tonic::Status {
    use prost::Message as _;
    let info = ErrorInfo {
        reason: reason.to_owned(),
        domain: DOMAIN.to_owned(),
    };
    let details = RpcStatus {
        details: vec![prost_types::Any {
            type_url: "type.googleapis.com/google.rpc.ErrorInfo".into(),
            value: info.encode_to_vec(),
        }],
    };
    tonic::Status::with_details(code, message, details.encode_to_vec().into())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_reason_is_spelled_once_and_parses_back() {
        // The daemon's reasons, byte for byte as it has always sent them:
        // clients branch on these strings.
        let daemon = [
            "INVALID_REQUEST",
            "RESPONSE_TOO_LARGE",
            "CURSOR_INVALID",
            "CURSOR_OTHER_MAP",
            "CURSOR_OTHER_QUERY",
            "CURSOR_OTHER_IDENTITY",
            "PERMISSION_DENIED",
            "LIMIT_REACHED",
            "WATCH_TOO_LARGE",
            "MAP_NOT_FOUND",
            "MAP_NAME_AMBIGUOUS",
            "NOT_A_MAP_OF_MAPS",
            "NOT_A_MAP",
            "BY_ID_DISABLED",
            "MAP_NOT_ITERABLE",
            "LOOKUP_UNSUPPORTED",
            "MAP_NOT_SIZED",
            "MAP_UNTYPED",
            "MAP_TYPED",
            "ENTRY_TOO_LARGE",
            "MAP_REPLACED",
            "DRAIN_BUSY",
            "NOT_DRAINABLE",
            "KERNEL_WALK_UNAVAILABLE",
            "SPOOL_CORRUPT",
            "RESUME_KEY_DELETED",
            "SHUTTING_DOWN",
            "CLIENT_STALLED",
            "SLOT_EXPIRED",
            "CANCELLED",
            "KERNEL_ERROR",
            "INTERNAL",
        ];
        for text in daemon {
            let reason: Reason = text.parse().unwrap();
            assert_eq!(reason.as_str(), text);
        }
        let mut seen = std::collections::HashSet::new();
        for r in Reason::ALL {
            assert!(seen.insert(r.as_str()), "{r} twice");
            assert_eq!(r.as_str().parse::<Reason>(), Ok(*r));
            assert_eq!(r.to_string(), r.as_str());
        }
        assert_eq!(
            "NO_SUCH_REASON".parse::<Reason>(),
            Err(UnknownReason("NO_SUCH_REASON".into()))
        );
    }

    #[test]
    fn a_reason_given_to_a_status_is_read_back() {
        let s = with_reason(Code::NotFound, "no map", "MAP_NOT_FOUND");
        assert_eq!((s.code(), s.message()), (Code::NotFound, "no map"));
        assert_eq!(reason(&s).as_deref(), Some("MAP_NOT_FOUND"));
        assert_eq!(reason(&tonic::Status::not_found("no map")), None);
    }

    #[test]
    fn every_code_has_its_canonical_name() {
        for (n, name) in (0..=16).zip([
            "OK",
            "CANCELLED",
            "UNKNOWN",
            "INVALID_ARGUMENT",
            "DEADLINE_EXCEEDED",
            "NOT_FOUND",
            "ALREADY_EXISTS",
            "PERMISSION_DENIED",
            "RESOURCE_EXHAUSTED",
            "FAILED_PRECONDITION",
            "ABORTED",
            "OUT_OF_RANGE",
            "UNIMPLEMENTED",
            "INTERNAL",
            "UNAVAILABLE",
            "DATA_LOSS",
            "UNAUTHENTICATED",
        ]) {
            assert_eq!(code_name(Code::from_i32(n)), name);
        }
    }
}
