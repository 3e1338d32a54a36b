//! Serving HTTP/2 on the accepted connections: each connection's hyper
//! session, with the daemon's settings, and a graceful end for all of them.
//!
//! tonic's own server loop leaves one bound out that a daemon facing
//! clients that stop reading needs: how much a stream may have buffered in
//! the HTTP/2 layer beyond what the client's window let through (hyper's
//! default is 400 KiB per stream, uncounted). Here it is set to 64 KiB (and
//! the frame being written), which the dump's memory share counts.

use std::{convert::Infallible, future::Future, pin::pin, time::Duration};

use hyper_util::{
    rt::{TokioExecutor, TokioIo, TokioTimer},
    service::TowerToHyperService,
};
use tokio::sync::{mpsc, watch};
use tonic::transport::server::Connected as _;
use tower::{Service, ServiceExt as _};

use super::conn::Conn;

/// The HTTP/2 settings of every connection.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Http2Settings {
    /// Streams open at once.
    pub(crate) max_streams: u32,
    /// Streams reset before they were answered, pending at once.
    pub(crate) max_pending_resets: usize,
    /// Streams the daemon may reset for protocol errors.
    pub(crate) max_local_error_resets: usize,
    /// The largest header list of one request.
    pub(crate) max_header_list: u32,
    /// What one stream may buffer beyond the client's window.
    pub(crate) max_send_buf: usize,
    /// Keepalive pings: how often, and how long to wait for the answer.
    pub(crate) keepalive: (Duration, Duration),
}

/// Serves `service` on every connection `incoming` hands over, until
/// `shutdown`: then no connection is taken any more, each open one is told
/// to end (GOAWAY) once its calls are done, and this returns when all have.
pub(crate) async fn serve<S>(
    service: S,
    settings: Http2Settings,
    mut incoming: mpsc::Receiver<std::io::Result<Conn>>,
    shutdown: impl Future<Output = ()>,
) -> Result<(), tonic::transport::Error>
where
    S: Service<
            http::Request<tonic::body::Body>,
            Response = http::Response<tonic::body::Body>,
            Error = Infallible,
        > + Clone
        + Send
        + 'static,
    S::Future: Send + 'static,
{
    let mut builder = hyper::server::conn::http2::Builder::new(TokioExecutor::new());
    builder
        .timer(TokioTimer::new())
        .max_concurrent_streams(settings.max_streams)
        .max_pending_accept_reset_streams(settings.max_pending_resets)
        .max_local_error_reset_streams(settings.max_local_error_resets)
        .max_header_list_size(settings.max_header_list)
        .max_send_buf_size(settings.max_send_buf)
        .keep_alive_interval(settings.keepalive.0)
        .keep_alive_timeout(settings.keepalive.1);
    // Every connection task holds a receiver: when all are gone, all
    // connections have ended.
    let (stop_tx, stop_rx) = watch::channel(false);
    let mut shutdown = pin!(shutdown);
    loop {
        let conn = tokio::select! {
            c = incoming.recv() => c,
            () = &mut shutdown => break,
        };
        let Some(Ok(conn)) = conn else {
            if conn.is_none() {
                break;
            }
            continue;
        };
        let info = conn.connect_info();
        let service = service.clone();
        let per_request = tower::service_fn(move |req: http::Request<hyper::body::Incoming>| {
            let mut req = req.map(tonic::body::Body::new);
            req.extensions_mut().insert(info.clone());
            service.clone().oneshot(req)
        });
        let session =
            builder.serve_connection(TokioIo::new(conn), TowerToHyperService::new(per_request));
        let mut stop = stop_rx.clone();
        // The session, until it ends; a graceful end once `stop` is set.
        tokio::spawn(async move {
            let mut session = pin!(session);
            let mut told = false;
            loop {
                tokio::select! {
                    r = session.as_mut() => {
                        if let Err(e) = r {
                            tracing::debug!(error = %e, "connection ended");
                        }
                        return;
                    }
                    _ = stop.wait_for(|s| *s), if !told => {
                        told = true;
                        session.as_mut().graceful_shutdown();
                    }
                }
            }
        });
    }
    drop(incoming);
    stop_tx.send_replace(true);
    drop(stop_rx);
    stop_tx.closed().await;
    Ok(())
}
