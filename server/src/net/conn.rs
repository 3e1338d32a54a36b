//! Connections: accepting them (TLS handshakes included) on the TCP
//! listener and on the Unix socket, bounding how many are open, closing
//! those that never speak or sit idle, and closing all of them when the
//! server stops.
//!
//! Every accepted connection is registered and watched:
//! - it must send its first bytes (the HTTP/2 preface) within the handshake
//!   timeout, after its TLS handshake if any;
//! - it is closed once no call has been open on it for the idle timeout;
//! - it is closed when a response has had data ready for twice the stall
//!   timeout (at least the stall timeout and 5 s) without the client taking
//!   any: a client that stops reading cannot keep what the daemon queued for
//!   it;
//! - beyond `max_connections`, new connections are closed at once, with a
//!   log line at most every few seconds;
//! - a connection whose client cancels more than `max_cancelled_calls`
//!   calls within [`CANCEL_WINDOW`] (streams reset after the daemon
//!   answered: the form of rapid reset that the HTTP/2 layer's own limit on
//!   streams reset before they are answered does not see) gets a GOAWAY
//!   with ENHANCE_YOUR_CALM, as that layer sends for the other form, and is
//!   closed;
//! - at shutdown, connections still open after the drain are closed.
//!
//! Closing goes through a kill switch in the connection's IO: reads and
//! writes fail, and hyper drops the connection (and with it every stream on
//! it).

use std::{
    collections::HashMap,
    io,
    net::SocketAddr,
    pin::Pin,
    sync::{
        Arc, Mutex, Weak,
        atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering},
    },
    task::{Context, Poll},
    time::{Duration, Instant},
};

use futures::task::AtomicWaker;
use tokio::{
    io::{AsyncRead, AsyncWrite, ReadBuf},
    net::{TcpListener, TcpStream, UnixListener, UnixStream},
    sync::{mpsc, watch},
};
use tonic::transport::server::Connected;

use super::{
    goaway::{self, Frames},
    tls::{self, SharedTls, Transport},
};
use crate::metrics::Metrics;

/// What the service layer learns about a connection.
#[derive(Debug, Clone, Default)]
pub(crate) struct ConnInfo {
    /// The peer's address.
    pub remote: Option<SocketAddr>,
    /// Plaintext, or TLS with the client's identity.
    pub transport: Transport,
    /// The connection's activity, for counting calls.
    pub(crate) state: Option<Arc<ConnState>>,
}

/// A connection's kill switch and activity.
#[derive(Debug)]
pub(crate) struct ConnState {
    killed: AtomicBool,
    read: AtomicWaker,
    write: AtomicWaker,
    /// Whether the client has sent anything (after the TLS handshake).
    heard: AtomicBool,
    /// Calls open now.
    calls: AtomicUsize,
    /// When the last call ended (ms since `epoch`).
    idle_since: AtomicU64,
    /// The open calls' response bodies, to notice one the client stopped
    /// taking.
    bodies: Mutex<Vec<Weak<BodyProgress>>>,
    epoch: Instant,
    /// Calls the client cancelled in the current window, and when the
    /// window began (ms since `epoch`).
    cancelled: Mutex<(u32, u64)>,
    max_cancelled: u32,
    /// When the connection was told to calm down (ms since `epoch`, plus
    /// one; 0: not).
    calm_since: AtomicU64,
}

/// The window in which a connection's cancelled calls are counted.
pub(crate) const CANCEL_WINDOW: Duration = Duration::from_secs(10);
/// How long a GOAWAY may wait for the transport to finish the frame it is
/// writing before the connection is closed without it.
const GOAWAY_GRACE: Duration = Duration::from_secs(1);
/// How long a closed abusive connection is read (and what it sends thrown
/// away) so that its client receives the GOAWAY rather than a reset.
const LINGER: Duration = Duration::from_secs(1);

/// Whether a response body is waiting for the client: since when it has had
/// data handed over without the transport asking for more (ms since the
/// connection's epoch, plus one; 0: not waiting).
#[derive(Debug, Default)]
pub(crate) struct BodyProgress {
    pub(super) waiting_since: AtomicU64,
}

impl ConnState {
    fn new(max_cancelled: u32) -> Self {
        Self {
            killed: AtomicBool::new(false),
            read: AtomicWaker::new(),
            write: AtomicWaker::new(),
            heard: AtomicBool::new(false),
            calls: AtomicUsize::new(0),
            idle_since: AtomicU64::new(0),
            bodies: Mutex::new(Vec::new()),
            epoch: Instant::now(),
            cancelled: Mutex::new((0, 0)),
            max_cancelled,
            calm_since: AtomicU64::new(0),
        }
    }

    /// A call on the connection was cancelled by its client; past
    /// `max_cancelled_calls` within [`CANCEL_WINDOW`] the connection is told
    /// to calm down (`true` the first time).
    pub(crate) fn call_cancelled(&self) -> bool {
        if self.max_cancelled == 0 {
            return false;
        }
        let now = self.now_ms();
        let mut c = self.cancelled.lock().expect("cancelled lock");
        if now.saturating_sub(c.1) >= CANCEL_WINDOW.as_millis() as u64 {
            *c = (0, now);
        }
        c.0 += 1;
        c.0 > self.max_cancelled && self.calm_down()
    }

    /// Ends the connection with a GOAWAY (ENHANCE_YOUR_CALM) after the frame
    /// being written; `true` the first time.
    fn calm_down(&self) -> bool {
        let first = self
            .calm_since
            .compare_exchange(0, self.now_ms() + 1, Ordering::SeqCst, Ordering::SeqCst)
            .is_ok();
        self.read.wake();
        self.write.wake();
        first
    }

    fn calming(&self) -> bool {
        self.calm_since.load(Ordering::SeqCst) != 0
    }

    /// How long the connection has been calming down, if it is.
    fn calming_for(&self) -> Option<Duration> {
        match self.calm_since.load(Ordering::SeqCst) {
            0 => None,
            since => Some(Duration::from_millis(self.now_ms() + 1 - since)),
        }
    }

    pub(super) fn now_ms(&self) -> u64 {
        self.epoch.elapsed().as_millis() as u64
    }

    /// Makes every read and write of the connection fail from now on.
    pub(crate) fn kill(&self) {
        self.killed.store(true, Ordering::SeqCst);
        self.read.wake();
        self.write.wake();
    }

    fn idle_for(&self) -> Option<Duration> {
        if self.calls.load(Ordering::SeqCst) > 0 {
            return None;
        }
        let since = self.idle_since.load(Ordering::SeqCst);
        Some(Duration::from_millis(self.now_ms().saturating_sub(since)))
    }

    /// A call starts on the connection; it ends when the guard drops.
    pub(crate) fn call(self: &Arc<Self>) -> CallGuard {
        self.calls.fetch_add(1, Ordering::SeqCst);
        CallGuard(self.clone())
    }

    /// Watches a response body for a client that stopped taking it.
    pub(super) fn watch_body(&self) -> Arc<BodyProgress> {
        let progress = Arc::new(BodyProgress::default());
        let mut bodies = self.bodies.lock().expect("bodies lock");
        bodies.retain(|b| b.strong_count() > 0);
        bodies.push(Arc::downgrade(&progress));
        progress
    }

    /// How long the longest-waiting response body has waited for the client.
    fn longest_wait(&self) -> Duration {
        let now = self.now_ms() + 1;
        self.bodies
            .lock()
            .expect("bodies lock")
            .iter()
            .filter_map(Weak::upgrade)
            .map(|b| b.waiting_since.load(Ordering::SeqCst))
            .filter(|&since| since != 0)
            .map(|since| Duration::from_millis(now.saturating_sub(since)))
            .max()
            .unwrap_or_default()
    }
}

/// An open call; see [`ConnState::call`].
#[derive(Debug)]
pub(crate) struct CallGuard(Arc<ConnState>);

impl Drop for CallGuard {
    fn drop(&mut self) {
        self.0.idle_since.store(self.0.now_ms(), Ordering::SeqCst);
        self.0.calls.fetch_sub(1, Ordering::SeqCst);
    }
}

/// The open connections.
#[derive(Debug, Clone, Default)]
pub(crate) struct ConnRegistry {
    inner: Arc<ConnRegistryInner>,
}

#[derive(Debug, Default)]
struct ConnRegistryInner {
    conns: Mutex<HashMap<u64, Weak<ConnState>>>,
    next: AtomicU64,
}

/// A connection's place in the registry, and its state; leaves the
/// registry on drop.
#[derive(Debug)]
struct Registration {
    id: u64,
    registry: Arc<ConnRegistryInner>,
    state: Arc<ConnState>,
}

impl Drop for Registration {
    fn drop(&mut self) {
        self.registry
            .conns
            .lock()
            .expect("registry lock")
            .remove(&self.id);
    }
}

impl ConnRegistry {
    /// Connections open now.
    pub(crate) fn len(&self) -> usize {
        self.inner.conns.lock().expect("registry lock").len()
    }

    fn register(&self, max: usize, max_cancelled: u32) -> Option<Registration> {
        let mut conns = self.inner.conns.lock().expect("registry lock");
        if conns.len() >= max {
            return None;
        }
        let id = self.inner.next.fetch_add(1, Ordering::Relaxed);
        let state = Arc::new(ConnState::new(max_cancelled));
        conns.insert(id, Arc::downgrade(&state));
        Some(Registration {
            id,
            registry: self.inner.clone(),
            state,
        })
    }

    /// Closes every open connection.
    pub(crate) fn kill_all(&self) -> usize {
        let conns = self.inner.conns.lock().expect("registry lock");
        let mut n = 0;
        for state in conns.values().filter_map(Weak::upgrade) {
            state.kill();
            n += 1;
        }
        n
    }
}

enum Io {
    Plain(TcpStream),
    Tls(Box<tokio_rustls::server::TlsStream<TcpStream>>),
    Unix(UnixStream),
    /// Handed over to be closed.
    Gone,
}

/// An accepted connection, plaintext or TLS.
pub(crate) struct Conn {
    io: Io,
    info: ConnInfo,
    state: Arc<ConnState>,
    /// The frames the daemon writes and the client's.
    written: Frames,
    read: Frames,
    /// The GOAWAY being written, and how much of it is.
    goaway: Option<([u8; 17], usize)>,
    _registration: Registration,
}

impl std::fmt::Debug for Conn {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Conn").field("info", &self.info).finish()
    }
}

impl Connected for Conn {
    type ConnectInfo = ConnInfo;

    fn connect_info(&self) -> ConnInfo {
        self.info.clone()
    }
}

fn killed() -> io::Error {
    io::Error::new(
        io::ErrorKind::ConnectionAborted,
        "connection closed by the server",
    )
}

impl AsyncRead for Conn {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        this.state.read.register(cx.waker());
        if this.state.killed.load(Ordering::SeqCst) {
            return Poll::Ready(Err(killed()));
        }
        if this.state.calming() && this.written.at_boundary() {
            return this.poll_goaway(cx).map(|r| r.and(Err(killed())));
        }
        let before = buf.filled().len();
        let res = match &mut this.io {
            Io::Plain(s) => Pin::new(s).poll_read(cx, buf),
            Io::Tls(s) => Pin::new(s.as_mut()).poll_read(cx, buf),
            Io::Unix(s) => Pin::new(s).poll_read(cx, buf),
            Io::Gone => return Poll::Ready(Err(killed())),
        };
        if matches!(res, Poll::Ready(Ok(()))) && buf.filled().len() > before {
            this.state.heard.store(true, Ordering::Relaxed);
            this.read.pass(&buf.filled()[before..]);
        }
        res
    }
}

impl Conn {
    fn check_write(&self, cx: &Context<'_>) -> Result<(), io::Error> {
        self.state.write.register(cx.waker());
        if self.state.killed.load(Ordering::SeqCst) {
            Err(killed())
        } else {
            Ok(())
        }
    }

    fn io(&mut self) -> Result<Pin<&mut (dyn AsyncWrite + Unpin + Send)>, io::Error> {
        match &mut self.io {
            Io::Plain(s) => Ok(Pin::new(s)),
            Io::Tls(s) => Ok(Pin::new(s.as_mut())),
            Io::Unix(s) => Ok(Pin::new(s)),
            Io::Gone => Err(killed()),
        }
    }

    /// Writes the GOAWAY (at a frame boundary), flushes it, then closes the
    /// connection.
    fn poll_goaway(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let last = self.read.last_stream();
        let (frame, done) = self
            .goaway
            .get_or_insert_with(|| (goaway::goaway(last, goaway::ENHANCE_YOUR_CALM), 0));
        let (frame, mut at) = (*frame, *done);
        while at < frame.len() {
            match self.io()?.poll_write(cx, &frame[at..]) {
                Poll::Ready(Ok(0)) => return Poll::Ready(Err(io::ErrorKind::WriteZero.into())),
                Poll::Ready(Ok(n)) => at += n,
                Poll::Ready(Err(e)) => return Poll::Ready(Err(e)),
                Poll::Pending => {
                    self.goaway = Some((frame, at));
                    return Poll::Pending;
                }
            }
        }
        self.goaway = Some((frame, at));
        std::task::ready!(self.io()?.poll_flush(cx))?;
        self.state.kill();
        Poll::Ready(Ok(()))
    }

    /// Of `buf`, what may be written now: while calming down, no more than
    /// the rest of the frame being written.
    fn writable<'b>(&self, buf: &'b [u8]) -> &'b [u8] {
        if self.state.calming() {
            &buf[..buf.len().min(self.written.room())]
        } else {
            buf
        }
    }
}

impl Drop for Conn {
    fn drop(&mut self) {
        // A connection closed after a GOAWAY is read a little longer, so
        // that its client gets the GOAWAY, not a reset.
        if self.goaway.is_none() {
            return;
        }
        let io = std::mem::replace(&mut self.io, Io::Gone);
        if let Ok(rt) = tokio::runtime::Handle::try_current() {
            rt.spawn(linger(io));
        }
    }
}

/// Ends the sending side of `io`, then reads (and throws away) what its
/// client still sends for at most [`LINGER`].
async fn linger(io: Io) {
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    async fn drain<S: AsyncRead + AsyncWrite + Unpin>(mut s: S) {
        let _ = s.shutdown().await;
        let mut buf = [0u8; 4096];
        while matches!(s.read(&mut buf).await, Ok(n) if n > 0) {}
    }
    let drained = async {
        match io {
            Io::Plain(s) => drain(s).await,
            Io::Tls(s) => drain(*s).await,
            Io::Unix(s) => drain(s).await,
            Io::Gone => {}
        }
    };
    let _ = tokio::time::timeout(LINGER, drained).await;
}

impl AsyncWrite for Conn {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        this.check_write(cx)?;
        if this.state.calming() && this.written.at_boundary() {
            return this.poll_goaway(cx).map(|r| r.and(Err(killed())));
        }
        let buf = this.writable(buf);
        let n = std::task::ready!(this.io()?.poll_write(cx, buf))?;
        this.written.pass(&buf[..n]);
        Poll::Ready(Ok(n))
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        this.check_write(cx)?;
        if this.state.calming() && this.written.at_boundary() {
            return this.poll_goaway(cx).map(|r| r.and(Err(killed())));
        }
        this.io()?.poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        this.check_write(cx)?;
        this.io()?.poll_shutdown(cx)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        this.check_write(cx)?;
        if this.state.calming() {
            // One frame at a time: the first slice, cut at the frame's end.
            let first = bufs
                .iter()
                .find(|b| !b.is_empty())
                .map_or(&[][..], |b| &b[..]);
            return Pin::new(this).poll_write(cx, first);
        }
        let n = std::task::ready!(this.io()?.poll_write_vectored(cx, bufs))?;
        let mut left = n;
        for b in bufs {
            let k = left.min(b.len());
            this.written.pass(&b[..k]);
            left -= k;
            if left == 0 {
                break;
            }
        }
        Poll::Ready(Ok(n))
    }

    fn is_write_vectored(&self) -> bool {
        match &self.io {
            Io::Plain(s) => s.is_write_vectored(),
            Io::Tls(s) => s.is_write_vectored(),
            Io::Unix(s) => s.is_write_vectored(),
            Io::Gone => false,
        }
    }
}

/// Logs a line at most once per period, saying how many were held back.
#[derive(Debug)]
pub(super) struct Throttle {
    every: Duration,
    last: Mutex<Option<Instant>>,
    held_back: AtomicU64,
}

impl Throttle {
    pub(super) fn new(every: Duration) -> Self {
        Self {
            every,
            last: Mutex::new(None),
            held_back: AtomicU64::new(0),
        }
    }

    /// `Some(n)`: log now, `n` lines were held back since the last one.
    pub(super) fn hit(&self) -> Option<u64> {
        let mut last = self.last.lock().expect("throttle lock");
        if last.is_some_and(|t| t.elapsed() < self.every) {
            self.held_back.fetch_add(1, Ordering::Relaxed);
            return None;
        }
        *last = Some(Instant::now());
        Some(self.held_back.swap(0, Ordering::Relaxed))
    }
}

/// Connection settings.
#[derive(Debug, Clone)]
pub(crate) struct AcceptConfig {
    /// Where closed connections and failed handshakes are counted.
    pub metrics: Metrics,
    /// Close a connection whose client has taken nothing of a response that
    /// had data ready for this long.
    pub stall_timeout: Duration,
    /// TLS, when configured.
    pub tls: Option<SharedTls>,
    /// Time for the TLS handshake, and then for the first bytes.
    pub handshake_timeout: Duration,
    /// Close a connection with no call open for this long.
    pub idle_timeout: Duration,
    /// Connections open at once.
    pub max_connections: usize,
    /// Calls a connection's client may cancel within [`CANCEL_WINDOW`]
    /// before the connection is closed (0: any number).
    pub max_cancelled_calls: u32,
}

/// Accepts connections until shutdown, doing TLS handshakes concurrently
/// (each bounded by the handshake timeout), and hands ready connections to
/// `tx`.
pub(crate) async fn accept_loop(
    listener: TcpListener,
    config: AcceptConfig,
    registry: ConnRegistry,
    tx: mpsc::Sender<io::Result<Conn>>,
    mut shutdown: watch::Receiver<bool>,
) {
    let accept_errors = Throttle::new(Duration::from_secs(5));
    let over_limit = Throttle::new(Duration::from_secs(5));
    loop {
        let accepted = tokio::select! {
            r = listener.accept() => r,
            _ = shutdown.wait_for(|s| *s) => return,
        };
        let (tcp, remote) = match accepted {
            Ok(x) => x,
            Err(e) => {
                // EMFILE and friends: back off instead of spinning.
                if let Some(held_back) = accept_errors.hit() {
                    tracing::warn!(error = %e, held_back, "accept failed");
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let Some(registration) =
            registry.register(config.max_connections, config.max_cancelled_calls)
        else {
            config.metrics.closed("limit");
            if let Some(held_back) = over_limit.hit() {
                tracing::warn!(
                    %remote,
                    limit = config.max_connections,
                    held_back,
                    "connection limit reached (limits.max_connections): closing new connections"
                );
            }
            drop(tcp);
            continue;
        };
        let _ = tcp.set_nodelay(true);
        let keepalive = socket2::TcpKeepalive::new()
            .with_time(Duration::from_secs(60))
            .with_interval(Duration::from_secs(10));
        let _ = socket2::SockRef::from(&tcp).set_tcp_keepalive(&keepalive);
        tokio::spawn(handshake(
            tcp,
            remote,
            registration,
            config.clone(),
            tx.clone(),
        ));
    }
}

/// Makes an accepted connection ready (its TLS handshake, bounded by the
/// handshake timeout), starts watching it, and hands it to `tx`.
async fn handshake(
    tcp: TcpStream,
    remote: SocketAddr,
    registration: Registration,
    config: AcceptConfig,
    tx: mpsc::Sender<io::Result<Conn>>,
) {
    let (io, transport) = match &config.tls {
        None => (Io::Plain(tcp), Transport::Plaintext),
        Some(tls) => {
            let acceptor = tokio_rustls::TlsAcceptor::from(tls.load_full());
            let stream = match tokio::time::timeout(config.handshake_timeout, acceptor.accept(tcp))
                .await
            {
                Ok(Ok(s)) => s,
                Ok(Err(e)) => {
                    config.metrics.tls_failure(handshake_failure(&e));
                    tracing::info!(%remote, error = %e, "TLS handshake failed");
                    return;
                }
                Err(_) => {
                    config.metrics.tls_failure("timeout");
                    tracing::info!(%remote, timeout = ?config.handshake_timeout, "TLS handshake timed out");
                    return;
                }
            };
            let identity = stream
                .get_ref()
                .1
                .peer_certificates()
                .and_then(|c| c.first())
                .and_then(|leaf| tls::identity_of(leaf));
            (Io::Tls(Box::new(stream)), Transport::Tls { identity })
        }
    };
    let info = ConnInfo {
        remote: Some(remote),
        transport,
        state: Some(registration.state.clone()),
    };
    let conn = Conn::ready(io, info, registration, &config);
    let _ = tx.send(Ok(conn)).await;
}

impl Conn {
    /// A connection ready for HTTP/2, watched from now on.
    fn ready(io: Io, info: ConnInfo, registration: Registration, config: &AcceptConfig) -> Self {
        let state = registration.state.clone();
        let peer = match (&info.remote, &info.transport) {
            (Some(addr), _) => addr.to_string(),
            (None, Transport::Unix { pid: Some(pid), .. }) => format!("pid:{pid}"),
            (None, _) => "local".to_owned(),
        };
        tokio::spawn(watch_conn(
            Arc::downgrade(&state),
            peer,
            config.handshake_timeout,
            config.idle_timeout,
            config.stall_timeout,
            config.metrics.clone(),
        ));
        Self {
            io,
            info,
            state,
            written: Frames::from_server(),
            read: Frames::from_client(),
            goaway: None,
            _registration: registration,
        }
    }
}

/// Accepts connections on the Unix socket until shutdown and hands them to
/// `tx`, each with its client's user and process as the kernel gives them
/// (`SO_PEERCRED`). Connections count against the same limit as TCP ones.
pub(crate) async fn accept_unix_loop(
    listener: UnixListener,
    config: AcceptConfig,
    registry: ConnRegistry,
    tx: mpsc::Sender<io::Result<Conn>>,
    mut shutdown: watch::Receiver<bool>,
) {
    let accept_errors = Throttle::new(Duration::from_secs(5));
    loop {
        let accepted = tokio::select! {
            r = listener.accept() => r,
            _ = shutdown.wait_for(|s| *s) => return,
        };
        let stream = match accepted.and_then(|(s, _)| s.peer_cred().map(|c| (s, c))) {
            Ok((s, cred)) => (s, cred),
            Err(e) => {
                if let Some(held_back) = accept_errors.hit() {
                    tracing::warn!(error = %e, held_back, "accept on the Unix socket failed");
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let (stream, cred) = stream;
        let Some(registered) =
            registry.register(config.max_connections, config.max_cancelled_calls)
        else {
            config.metrics.closed("limit");
            continue;
        };
        let transport = Transport::Unix {
            uid: cred.uid(),
            pid: cred.pid().and_then(|p| u32::try_from(p).ok()),
        };
        let info = ConnInfo {
            remote: None,
            transport,
            state: Some(registered.state.clone()),
        };
        let conn = Conn::ready(Io::Unix(stream), info, registered, &config);
        if tx.send(Ok(conn)).await.is_err() {
            return;
        }
    }
}

/// Closes a connection that sends nothing within `preface`, that has no call
/// open for `idle`, or whose client has taken nothing of a ready response
/// for `stall`. Ends when the connection is gone.
async fn watch_conn(
    state: Weak<ConnState>,
    remote: String,
    preface: Duration,
    idle: Duration,
    stall: Duration,
    metrics: Metrics,
) {
    let check = (preface.min(idle).min(stall) / 4)
        .clamp(Duration::from_millis(100), Duration::from_secs(5));
    let started = Instant::now();
    loop {
        tokio::time::sleep(check).await;
        let Some(s) = state.upgrade() else { return };
        if s.calming_for().is_some_and(|d| d >= GOAWAY_GRACE) {
            // The transport never reached the end of its frame (a client
            // that reads nothing): closed without the GOAWAY.
            s.kill();
            return;
        }
        if !s.heard.load(Ordering::Relaxed) && started.elapsed() >= preface {
            tracing::debug!(%remote, timeout = ?preface, "closing a connection that sent nothing");
            metrics.closed("silent");
            s.kill();
            return;
        }
        if s.idle_for().is_some_and(|d| d >= idle) {
            tracing::debug!(%remote, ?idle, "closing an idle connection");
            metrics.closed("idle");
            s.kill();
            return;
        }
        // The stream's producer gives up after `stall` and queues its
        // status; the connection goes after as long again (5 s at least) if
        // the client still takes nothing.
        let waited = s.longest_wait();
        if waited >= stall + stall.max(Duration::from_secs(5)) {
            tracing::info!(%remote, ?waited, "closing the connection of a client that stopped reading");
            metrics.closed("stalled");
            s.kill();
            return;
        }
    }
}

/// Why a TLS handshake failed, as a metric label.
fn handshake_failure(e: &io::Error) -> &'static str {
    match e
        .get_ref()
        .and_then(|inner| inner.downcast_ref::<rustls::Error>())
    {
        Some(rustls::Error::InvalidCertificate(_))
        | Some(rustls::Error::NoCertificatesPresented) => "bad_certificate",
        Some(rustls::Error::AlertReceived(_)) => "alert_received",
        Some(_) => "protocol",
        None if matches!(
            e.kind(),
            io::ErrorKind::UnexpectedEof
                | io::ErrorKind::ConnectionReset
                | io::ErrorKind::BrokenPipe
        ) =>
        {
            "connection_closed"
        }
        None => "other",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_registry_caps_connections_and_forgets_closed_ones() {
        let r = ConnRegistry::default();
        let a = r.register(2, 0).unwrap();
        let sa = a.state.clone();
        let _b = r.register(2, 0).unwrap();
        assert!(r.register(2, 0).is_none(), "over the limit");
        assert_eq!(r.len(), 2);
        drop(a);
        assert_eq!(r.len(), 1);
        assert!(r.register(2, 0).is_some());
        assert_eq!(r.kill_all(), 1, "the dropped connection is gone");
        assert!(!sa.killed.load(Ordering::SeqCst));
    }

    #[test]
    fn too_many_cancelled_calls_calm_the_connection_down() {
        let s = ConnState::new(3);
        for _ in 0..3 {
            assert!(!s.call_cancelled());
        }
        assert!(!s.calming());
        assert!(s.call_cancelled(), "the fourth within the window");
        assert!(s.calming());
        assert!(!s.call_cancelled(), "told once");
        // A new window starts from zero.
        let later = ConnState {
            epoch: Instant::now() - CANCEL_WINDOW,
            ..ConnState::new(3)
        };
        *later.cancelled.lock().unwrap() = (3, 0);
        assert!(
            !later.call_cancelled(),
            "the old window's calls are forgotten"
        );
        assert!(!ConnState::new(0).call_cancelled(), "0: no limit");
    }

    #[test]
    fn the_throttle_holds_back_lines_within_its_period() {
        let t = Throttle::new(Duration::from_secs(3600));
        assert_eq!(t.hit(), Some(0));
        assert_eq!(t.hit(), None);
        assert_eq!(t.hit(), None);
        *t.last.lock().unwrap() = Some(Instant::now() - Duration::from_secs(7200));
        assert_eq!(t.hit(), Some(2));
    }

    #[test]
    fn a_connection_is_idle_only_with_no_call_open() {
        let s = Arc::new(ConnState::new(0));
        assert!(s.idle_for().is_some());
        let call = s.call();
        assert!(s.idle_for().is_none());
        drop(call);
        assert!(s.idle_for().unwrap() < Duration::from_secs(1));
    }
}
