//! Calls on a connection: a tower layer that counts the calls open on each
//! connection (so that idle connections can be told apart), records each
//! call's metrics, hands response data over in bounded frames, and keeps
//! what a response holds ([`Held`]) until its body is done or dropped.

use std::{
    pin::Pin,
    sync::{Arc, atomic::Ordering},
    task::{Context, Poll},
    time::Instant,
};

use super::conn::{BodyProgress, CANCEL_WINDOW, CallGuard, ConnInfo, ConnState, Throttle};
use crate::{limits::Held, metrics::Metrics, model::Rpc};

/// A tower layer that counts the calls open on each connection (from the
/// request until its response body is done or dropped), so that idle
/// connections can be told apart, and records each call's metrics.
#[derive(Debug, Clone)]
pub(crate) struct CountCalls(pub(crate) Metrics);

impl<S> tower::Layer<S> for CountCalls {
    type Service = Counted<S>;

    fn layer(&self, inner: S) -> Counted<S> {
        Counted(inner, self.0.clone())
    }
}

/// See [`CountCalls`].
#[derive(Debug, Clone)]
pub(crate) struct Counted<S>(S, Metrics);

type BoxFuture<T> = Pin<Box<dyn std::future::Future<Output = T> + Send>>;

impl<S, B> tower::Service<http::Request<B>> for Counted<S>
where
    S: tower::Service<http::Request<B>, Response = http::Response<tonic::body::Body>>,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
{
    type Response = http::Response<tonic::body::Body>;
    type Error = S::Error;
    type Future = BoxFuture<Result<Self::Response, S::Error>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        self.0.poll_ready(cx)
    }

    fn call(&mut self, req: http::Request<B>) -> Self::Future {
        let info = req.extensions().get::<ConnInfo>();
        let state = info.and_then(|i| i.state.clone());
        let remote = info.and_then(|i| i.remote);
        let guard = state.as_ref().map(ConnState::call);
        let rpc = Rpc::of_path(req.uri().path());
        let metrics = self.1.clone();
        metrics.started(rpc);
        let call = CallMetrics {
            metrics,
            rpc,
            started: Instant::now(),
            code: None,
        };
        let fut = self.0.call(req);
        Box::pin(async move {
            let mut resp = fut.await?;
            resp.headers_mut().insert(
                crate::VERSION_HEADER,
                http::HeaderValue::from_static(env!("CARGO_PKG_VERSION")),
            );
            let held = resp.extensions_mut().remove::<Held>();
            let mut call = call;
            // A call that failed at once answers with its status in the
            // headers ("trailers only").
            call.code = grpc_status(resp.headers());
            Ok(match (guard, state) {
                (Some(guard), Some(state)) => resp.map(|body| {
                    tonic::body::Body::new(GuardedBody {
                        inner: body,
                        pending: bytes::Bytes::new(),
                        progress: state.watch_body(),
                        state,
                        remote,
                        call,
                        _held: held,
                        _guard: guard,
                    })
                }),
                _ => resp,
            })
        })
    }
}

/// Largest data frame handed to the transport at once. The transport takes
/// a whole frame whatever the client's flow-control window, and asks for the
/// next one only once its buffer has room: cutting a large message (a whole
/// Lookup response is one frame) keeps what it holds for a slow client small,
/// and keeps the body, with what it holds, alive until the message is
/// nearly written.
const MAX_FRAME: usize = 128 << 10;

/// The gRPC status in a header map (trailers, or trailers-only headers).
fn grpc_status(headers: &http::HeaderMap) -> Option<tonic::Code> {
    headers
        .get("grpc-status")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<i32>().ok())
        .map(tonic::Code::from_i32)
}

/// A call's metrics, recorded when its body ends or is dropped (a client
/// that went away: CANCELLED).
struct CallMetrics {
    metrics: Metrics,
    rpc: Option<Rpc>,
    started: Instant,
    code: Option<tonic::Code>,
}

impl Drop for CallMetrics {
    fn drop(&mut self) {
        let code = self.code.unwrap_or(tonic::Code::Cancelled);
        self.metrics.handled(self.rpc, code, self.started.elapsed());
    }
}

/// A response body that holds its call open until it is done or dropped,
/// with what it keeps, hands its data over in frames of at most
/// [`MAX_FRAME`], says when it waits for the client, and records the call's
/// metrics.
struct GuardedBody {
    inner: tonic::body::Body,
    /// The rest of a frame larger than [`MAX_FRAME`].
    pending: bytes::Bytes,
    progress: Arc<BodyProgress>,
    state: Arc<ConnState>,
    remote: Option<std::net::SocketAddr>,
    call: CallMetrics,
    _held: Option<Held>,
    _guard: CallGuard,
}

/// Lines about connections closed for their cancelled calls: at most one
/// every few seconds, saying how many were held back.
static CALM_LOG: std::sync::LazyLock<Throttle> =
    std::sync::LazyLock::new(|| Throttle::new(std::time::Duration::from_secs(5)));

impl Drop for GuardedBody {
    fn drop(&mut self) {
        // Dropped before its trailers: the client cancelled the call (or the
        // connection is going anyway).
        if self.call.code.is_some() || !self.state.call_cancelled() {
            return;
        }
        self.call.metrics.closed("cancelled_calls");
        if let Some(held_back) = CALM_LOG.hit() {
            tracing::warn!(
                remote = self.remote.map(|r| r.to_string()).unwrap_or_default(),
                window = ?CANCEL_WINDOW,
                held_back,
                "closing a connection whose client cancels call after call (limits.max_cancelled_calls): GOAWAY ENHANCE_YOUR_CALM"
            );
        }
    }
}

impl GuardedBody {
    /// The next piece of `data`, the rest kept for later.
    fn piece(&mut self, mut data: bytes::Bytes) -> http_body::Frame<bytes::Bytes> {
        if data.len() > MAX_FRAME {
            self.pending = data.split_off(MAX_FRAME);
        }
        let now = self.state.now_ms() + 1;
        // Until the transport asks again, the client has to take it.
        self.progress.waiting_since.store(now, Ordering::SeqCst);
        http_body::Frame::data(data)
    }
}

impl http_body::Body for GuardedBody {
    type Data = bytes::Bytes;
    type Error = tonic::Status;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<bytes::Bytes>, tonic::Status>>> {
        // The transport asks for more: it is not waiting for the client.
        self.progress.waiting_since.store(0, Ordering::SeqCst);
        if !self.pending.is_empty() {
            let rest = std::mem::take(&mut self.pending);
            return Poll::Ready(Some(Ok(self.piece(rest))));
        }
        match Pin::new(&mut self.inner).poll_frame(cx) {
            Poll::Ready(Some(Ok(f))) if f.is_data() => {
                let data = f.into_data().unwrap_or_default();
                Poll::Ready(Some(Ok(self.piece(data))))
            }
            Poll::Ready(Some(Ok(f))) => {
                if let Some(code) = f.trailers_ref().and_then(grpc_status) {
                    self.call.code = Some(code);
                }
                Poll::Ready(Some(Ok(f)))
            }
            other => other,
        }
    }

    fn is_end_stream(&self) -> bool {
        self.pending.is_empty() && self.inner.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        if self.pending.is_empty() {
            self.inner.size_hint()
        } else {
            http_body::SizeHint::default()
        }
    }
}
