//! The library's one error type.

use std::time::Duration;

use bpfmap_proto::status::code_name;
use tonic::{Code, Status};

use bpfmap_proto::typed::TypeError;

/// Errors of the client library.
///
/// An error that came from a daemon or the transport keeps its
/// [`Status`] ([`Error::status`]) and the errors that caused it
/// ([`source`](std::error::Error::source)); [`Error::code`] gives the gRPC
/// code for every error, so that a caller can act on it the same way
/// whether it came from one [`Client`](crate::Client) or from a target of a
/// [`Fleet`](crate::Fleet).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The address is not a valid URI, or the TLS material is unusable.
    #[error("invalid address {addr:?}: {source}")]
    Address {
        /// The address as given.
        addr: String,
        /// Why it cannot be used.
        #[source]
        source: tonic::transport::Error,
    },
    /// The connection (TCP or TLS handshake) failed.
    #[error("cannot connect to {addr}: {source}")]
    Connect {
        /// The address.
        addr: String,
        /// The transport error.
        #[source]
        source: tonic::transport::Error,
    },
    /// The daemon (or the transport) answered with a gRPC status. The text
    /// is the code's name, the status's message and the errors that caused
    /// it ("UNAVAILABLE: tcp connect error: Connection refused (os error
    /// 111)").
    #[error("{}: {}", code_name(.0.code()), status_text(.0))]
    Status(#[source] Status),
    /// No answer in the time allowed (a [`Fleet`](crate::Fleet)'s answer or
    /// idle timeout).
    #[error("{}", timeout_text(*.after, .retrying.as_ref()))]
    Timeout {
        /// How long the call waited.
        after: Duration,
        /// The failure the call was retrying after when the time ran out,
        /// if it was retrying.
        #[source]
        retrying: Option<Status>,
    },
    /// The deadline of a [`Fleet`](crate::Fleet) run passed before this
    /// target was done.
    #[error("the run's deadline ({} s) passed before this target was done", .deadline.as_secs_f64())]
    Deadline {
        /// The run's deadline.
        deadline: Duration,
    },
    /// A map name that is neither a path nor `id:N`.
    #[error("invalid map name {0:?}: give a path like \"demo/flows\" or \"id:12\"")]
    MapName(String),
    /// A target that is neither `host:port` nor `unix:///PATH`.
    #[error(
        "invalid target {0:?}: give host:port, [IPv6]:port, a URL like http://host:port, or unix:///PATH for a Unix socket"
    )]
    Target(String),
    /// The daemon sent a chunk that does not add up.
    #[error("server sent a malformed chunk: {0}")]
    Protocol(String),
    /// The daemon described types that cannot be used.
    #[error("the map's types cannot be used: {0}")]
    Types(#[from] TypeError),
    /// A map that cannot be a table as asked (per-CPU sums of a member
    /// that is not an integer).
    #[cfg(feature = "arrow")]
    #[error(transparent)]
    Table(#[from] bpfmap_proto::typed::arrow::TableError),
    /// Renderings that cannot be applied: an unknown rendering, a path
    /// that does not start with "key" or "value", a member the map's type
    /// does not have, a bitfield, or a member whose size or kind does not
    /// fit the rendering ("render: key.dport: ipv4 needs a member of 4
    /// bytes; this one (an integer) has 2").
    #[error("render: {path}: {message}")]
    Render {
        /// The member ("key.dport").
        path: String,
        /// What is wrong.
        message: String,
    },
    /// An aggregate that cannot be read ("avg(value.bytes)": the message
    /// says which ones exist).
    #[error("invalid aggregate {spec:?}: {message}")]
    Aggregate {
        /// The aggregate as given.
        spec: String,
        /// What is wrong.
        message: String,
    },
    /// A bpftrace map whose keys do not fit the function or the key type
    /// named ([`crate::bpftrace`]): the message says what the map holds.
    #[error("bpftrace map: {0}")]
    Bpftrace(String),
}

impl From<Status> for Error {
    fn from(s: Status) -> Self {
        Self::Status(s)
    }
}

impl Error {
    /// The [`Render`](Error::Render) error of a rendering `e` refused.
    pub(crate) fn render(e: TypeError) -> Self {
        Self::Render {
            path: e.path,
            message: e.message,
        }
    }

    /// The gRPC status the daemon or the transport answered with: the
    /// error's own, or for a [`Timeout`](Error::Timeout), the one the call
    /// was retrying after.
    pub fn status(&self) -> Option<&Status> {
        match self {
            Self::Status(s) => Some(s),
            Self::Timeout { retrying, .. } => retrying.as_ref(),
            _ => None,
        }
    }

    /// The gRPC code that describes the error: the status's code; for a
    /// timeout, the code of the failure it was retrying after, else
    /// DEADLINE_EXCEEDED; INVALID_ARGUMENT for what the caller gave
    /// (address, map name, target, renderings); UNAVAILABLE for a failed connection;
    /// INTERNAL for what the daemon sent that cannot be used.
    pub fn code(&self) -> Code {
        match self {
            Self::Status(s) => s.code(),
            Self::Timeout {
                retrying: Some(s), ..
            } => s.code(),
            Self::Timeout { retrying: None, .. } | Self::Deadline { .. } => Code::DeadlineExceeded,
            Self::Address { .. }
            | Self::MapName(_)
            | Self::Target(_)
            | Self::Render { .. }
            | Self::Aggregate { .. }
            | Self::Bpftrace(_) => Code::InvalidArgument,
            Self::Connect { .. } => Code::Unavailable,
            Self::Protocol(_) | Self::Types(_) => Code::Internal,
            #[cfg(feature = "arrow")]
            Self::Table(_) => Code::FailedPrecondition,
        }
    }
}

/// A status's message followed by the errors that caused it ("tcp connect
/// error: Connection refused (os error 111)").
fn status_text(status: &Status) -> String {
    let mut message = status.message().to_owned();
    let mut source = std::error::Error::source(status);
    while let Some(e) = source {
        let text = e.to_string();
        if !message.contains(&text) {
            message.push_str(": ");
            message.push_str(&text);
        }
        source = e.source();
    }
    message
}

fn timeout_text(after: Duration, retrying: Option<&Status>) -> String {
    let secs = after.as_secs_f64();
    match retrying {
        Some(s) => format!(
            "{}: {} (still failing after {secs} s)",
            code_name(s.code()),
            status_text(s)
        ),
        None => format!("no answer within {secs} s"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_status_keeps_its_code_and_its_cause() {
        let io = std::io::Error::from(std::io::ErrorKind::ConnectionRefused);
        let mut status = Status::unavailable("tcp connect error");
        status.set_source(std::sync::Arc::new(io));
        let e = Error::from(status);
        assert_eq!(e.code(), Code::Unavailable);
        assert!(
            e.to_string()
                .starts_with("UNAVAILABLE: tcp connect error: "),
            "{e}"
        );
        let cause = std::iter::successors(std::error::Error::source(&e), |e| e.source())
            .find_map(|e| e.downcast_ref::<std::io::Error>())
            .expect("the io error in the chain");
        assert_eq!(cause.kind(), std::io::ErrorKind::ConnectionRefused);
    }

    #[test]
    fn timeouts_say_what_they_were_retrying() {
        let after = Duration::from_secs(2);
        let plain = Error::Timeout {
            after,
            retrying: None,
        };
        assert_eq!(plain.code(), Code::DeadlineExceeded);
        assert_eq!(plain.to_string(), "no answer within 2 s");
        let retrying = Error::Timeout {
            after,
            retrying: Some(Status::resource_exhausted("busy")),
        };
        assert_eq!(retrying.code(), Code::ResourceExhausted);
        assert_eq!(
            retrying.to_string(),
            "RESOURCE_EXHAUSTED: busy (still failing after 2 s)"
        );
        assert_eq!(retrying.status().map(Status::message), Some("busy"));
    }
}
