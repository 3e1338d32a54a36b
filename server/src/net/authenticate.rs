//! Authentication of a call: who the connection's peer is (its client
//! certificate's identity on TLS, `anonymous` on plaintext), stored in the
//! request for the handlers.

use tonic::{Request, Status};

use super::{ConnInfo, Transport};
use crate::model::{Caller, Identity};

/// Interceptor for every service but health: resolves the caller's identity
/// (UNAUTHENTICATED without one on TLS) and stores it in the request.
pub(crate) fn authenticate(mut req: Request<()>) -> Result<Request<()>, Status> {
    let info = req
        .extensions()
        .get::<ConnInfo>()
        .cloned()
        .unwrap_or_default();
    let process = match info.transport {
        Transport::Unix { pid, .. } => pid,
        _ => None,
    };
    let identity = match info.transport {
        Transport::Plaintext => Identity::Anonymous,
        Transport::Unix { uid, .. } => Identity::Uid(uid),
        Transport::Tls {
            identity: Some(id), ..
        } => id,
        Transport::Tls { identity: None } => {
            tracing::info!(
                target: "bpfmapd::audit",
                identity = "",
                peer = info.remote.map(|p| p.to_string()).unwrap_or_default(),
                code = ?tonic::Code::Unauthenticated,
                "rpc rejected: no client certificate"
            );
            return Err(Status::unauthenticated(
                "a client certificate signed by the server's client CA is required",
            ));
        }
    };
    req.extensions_mut().insert(Caller {
        identity,
        peer: info.remote,
        process,
    });
    Ok(req)
}

/// The caller stored in the request when its connection was authenticated
/// (by a service wrapped with `frontend::authenticated`).
pub fn caller_of<T>(req: &Request<T>) -> Result<Caller, Status> {
    req.extensions()
        .get::<Caller>()
        .cloned()
        .ok_or_else(|| Status::unauthenticated("no caller identity"))
}
