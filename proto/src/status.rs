//! gRPC status codes by their canonical names, for the daemon's metrics
//! and the clients' reports alike.

use tonic::Code;

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

/// The stable reason a bpfmapd status carries (its google.rpc.ErrorInfo
/// with domain "bpfmapd": "LIMIT_REACHED", "WATCH_TOO_LARGE", ...), if any.
pub fn reason(status: &tonic::Status) -> Option<String> {
    use prost::Message as _;
    let details = RpcStatus::decode(status.details()).ok()?;
    details
        .details
        .iter()
        .filter(|a| a.type_url == "type.googleapis.com/google.rpc.ErrorInfo")
        .filter_map(|a| ErrorInfo::decode(a.value.as_slice()).ok())
        .find(|i| i.domain == "bpfmapd")
        .map(|i| i.reason)
}

#[cfg(test)]
mod tests {
    use super::*;

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
