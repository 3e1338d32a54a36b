//! A raw HTTP/2 client for tests that misbehave on purpose: frames written
//! by hand (RFC 9113), so that a test can send what no well-behaved client
//! sends (streams reset as soon as they open, windows of one byte, endless
//! CONTINUATION frames, floods of SETTINGS and PING, headers of a megabyte)
//! and see, frame by frame, what the daemon answers.
//!
//! Frames are appended to an output buffer by [`Conn`]'s frame methods and
//! written by [`Conn::flush`], so that a burst goes out in few writes.
//! Header blocks are HPACK literals without indexing and without Huffman
//! coding ([`hpack`], RFC 7541 §6.2.2), which every decoder accepts.
//! Incoming frames are read by a task of their own (unless the connection
//! is made not to read at all) and taken with [`Conn::next`]; their header
//! blocks are not decoded: a test sees which frames came, on which stream,
//! with which flags, and GOAWAY's error code.

use std::{
    collections::HashSet,
    fmt, io,
    net::{IpAddr, SocketAddr},
    path::Path,
    sync::Arc,
    time::{Duration, Instant},
};

use bytes::BytesMut;
use prost::Message as _;
use tokio::{
    io::{AsyncRead, AsyncReadExt as _, AsyncWrite, AsyncWriteExt as _, ReadHalf, WriteHalf},
    net::{TcpSocket, TcpStream},
    sync::mpsc,
};

/// What a client sends first.
pub const PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";

/// The gRPC path of DumpMap.
pub const DUMP_MAP: &str = "/bpfmap.v1.MapService/DumpMap";
/// The gRPC path of GetMap.
pub const GET_MAP: &str = "/bpfmap.v1.MapService/GetMap";

/// Frame types.
pub mod kind {
    pub const DATA: u8 = 0x0;
    pub const HEADERS: u8 = 0x1;
    pub const RST_STREAM: u8 = 0x3;
    pub const SETTINGS: u8 = 0x4;
    pub const PING: u8 = 0x6;
    pub const GOAWAY: u8 = 0x7;
    pub const WINDOW_UPDATE: u8 = 0x8;
    pub const CONTINUATION: u8 = 0x9;
}

/// Frame flags.
pub mod flag {
    /// DATA, HEADERS: the last frame the sender sends on the stream.
    pub const END_STREAM: u8 = 0x1;
    /// SETTINGS, PING: an acknowledgement.
    pub const ACK: u8 = 0x1;
    /// HEADERS, CONTINUATION: the header block ends with this frame.
    pub const END_HEADERS: u8 = 0x4;
}

/// Error codes of RST_STREAM and GOAWAY.
pub mod code {
    pub const NO_ERROR: u32 = 0x0;
    pub const PROTOCOL_ERROR: u32 = 0x1;
    pub const FLOW_CONTROL_ERROR: u32 = 0x3;
    pub const FRAME_SIZE_ERROR: u32 = 0x6;
    pub const REFUSED_STREAM: u32 = 0x7;
    pub const CANCEL: u32 = 0x8;
    pub const COMPRESSION_ERROR: u32 = 0x9;
    pub const ENHANCE_YOUR_CALM: u32 = 0xb;
}

/// The name of an error code, for messages.
pub fn code_name(code: u32) -> &'static str {
    match code {
        0x0 => "NO_ERROR",
        0x1 => "PROTOCOL_ERROR",
        0x2 => "INTERNAL_ERROR",
        0x3 => "FLOW_CONTROL_ERROR",
        0x4 => "SETTINGS_TIMEOUT",
        0x5 => "STREAM_CLOSED",
        0x6 => "FRAME_SIZE_ERROR",
        0x7 => "REFUSED_STREAM",
        0x8 => "CANCEL",
        0x9 => "COMPRESSION_ERROR",
        0xa => "CONNECT_ERROR",
        0xb => "ENHANCE_YOUR_CALM",
        0xc => "INADEQUATE_SECURITY",
        0xd => "HTTP_1_1_REQUIRED",
        _ => "unknown",
    }
}

/// SETTINGS identifiers.
pub mod setting {
    pub const HEADER_TABLE_SIZE: u16 = 0x1;
    pub const ENABLE_PUSH: u16 = 0x2;
    pub const MAX_CONCURRENT_STREAMS: u16 = 0x3;
    pub const INITIAL_WINDOW_SIZE: u16 = 0x4;
    pub const MAX_FRAME_SIZE: u16 = 0x5;
    pub const MAX_HEADER_LIST_SIZE: u16 = 0x6;
}

/// The largest frame payload a peer must accept before it says otherwise
/// (SETTINGS_MAX_FRAME_SIZE); the daemon never says otherwise.
pub const DEFAULT_MAX_FRAME: usize = 16_384;

/// One frame received.
#[derive(Debug, Clone)]
pub struct Frame {
    pub kind: u8,
    pub flags: u8,
    pub stream: u32,
    pub payload: Vec<u8>,
    /// When it was read.
    pub at: Instant,
}

impl Frame {
    /// Whether `flag` is set.
    pub fn has(&self, flag: u8) -> bool {
        self.flags & flag != 0
    }

    /// A GOAWAY's error code.
    pub fn goaway_code(&self) -> Option<u32> {
        (self.kind == kind::GOAWAY && self.payload.len() >= 8).then(|| be32(&self.payload[4..8]))
    }

    /// A RST_STREAM's error code.
    pub fn rst_code(&self) -> Option<u32> {
        (self.kind == kind::RST_STREAM && self.payload.len() >= 4).then(|| be32(&self.payload))
    }

    /// Whether this frame ends its stream from the server's side: HEADERS
    /// or DATA with END_STREAM (a trailers-only answer, a 431, trailers), or
    /// RST_STREAM.
    pub fn ends_stream(&self) -> bool {
        self.stream != 0
            && (self.kind == kind::RST_STREAM
                || (matches!(self.kind, kind::HEADERS | kind::DATA) && self.has(flag::END_STREAM)))
    }
}

fn be32(b: &[u8]) -> u32 {
    u32::from_be_bytes([b[0], b[1], b[2], b[3]])
}

/// What the reading task reports.
#[derive(Debug)]
pub enum Event {
    Frame(Frame),
    /// The server closed the connection (end of stream, or a read error
    /// such as a reset), and when.
    Closed(String, Instant),
}

/// A GOAWAY received.
#[derive(Debug, Clone)]
pub struct GoAway {
    pub code: u32,
    pub last_stream: u32,
    /// Its debug data, as text.
    pub debug: String,
    pub at: Instant,
}

impl fmt::Display for GoAway {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "GOAWAY {} (0x{:x}), last stream {}, debug {:?}",
            code_name(self.code),
            self.code,
            self.last_stream,
            self.debug
        )
    }
}

// ---------------------------------------------------------------------------
// Encoding

/// An HPACK integer with an `prefix_bits`-bit prefix, the first byte's other
/// bits being `first` (RFC 7541 §5.1).
fn hpack_int(out: &mut Vec<u8>, mut value: usize, prefix_bits: u8, first: u8) {
    let max = (1usize << prefix_bits) - 1;
    if value < max {
        out.push(first | value as u8);
        return;
    }
    out.push(first | max as u8);
    value -= max;
    while value >= 128 {
        out.push((value % 128) as u8 | 0x80);
        value /= 128;
    }
    out.push(value as u8);
}

/// An HPACK string literal, not Huffman-coded.
fn hpack_str(out: &mut Vec<u8>, s: &[u8]) {
    hpack_int(out, s.len(), 7, 0x00);
    out.extend_from_slice(s);
}

/// A header block: each header a literal without indexing, with a literal
/// name (RFC 7541 §6.2.2), so that no dynamic table is involved.
pub fn hpack(headers: &[(&str, &str)]) -> Vec<u8> {
    let mut out = Vec::new();
    for (name, value) in headers {
        hpack_header(&mut out, name.as_bytes(), value.as_bytes());
    }
    out
}

/// Appends one header (a literal without indexing) to a block.
pub fn hpack_header(out: &mut Vec<u8>, name: &[u8], value: &[u8]) {
    out.push(0x00);
    hpack_str(out, name);
    hpack_str(out, value);
}

/// The header block of a gRPC request to `path` (e.g. [`DUMP_MAP`]).
pub fn grpc_headers(scheme: &str, authority: &str, path: &str) -> Vec<u8> {
    hpack(&grpc_header_list(scheme, authority, path))
}

/// The headers of a gRPC request, in order (pseudo-headers first).
pub fn grpc_header_list<'a>(
    scheme: &'a str,
    authority: &'a str,
    path: &'a str,
) -> [(&'a str, &'a str); 6] {
    [
        (":method", "POST"),
        (":scheme", scheme),
        (":path", path),
        (":authority", authority),
        ("content-type", "application/grpc"),
        ("te", "trailers"),
    ]
}

/// A gRPC message: not compressed, its length, its bytes.
pub fn grpc_message(message: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(5 + message.len());
    out.push(0);
    out.extend_from_slice(&(message.len() as u32).to_be_bytes());
    out.extend_from_slice(message);
    out
}

fn map_ref(path: &str) -> Option<bpfmap_proto::v1::MapRef> {
    Some(bpfmap_proto::v1::MapRef {
        r#ref: Some(bpfmap_proto::v1::map_ref::Ref::Path(path.into())),
        declare: None,
    })
}

/// A DumpMapRequest of the whole map at `path`, with every other field at
/// its default (the entries layout, as grpcurl asks), encoded.
pub fn dump_request(path: &str) -> Vec<u8> {
    dump_request_in(path, bpfmap_proto::v1::Layout::Entries)
}

/// A DumpMapRequest of the whole map at `path` in `layout`, encoded.
pub fn dump_request_in(path: &str, layout: bpfmap_proto::v1::Layout) -> Vec<u8> {
    bpfmap_proto::v1::DumpMapRequest {
        map: map_ref(path),
        layout: layout as i32,
        ..Default::default()
    }
    .encode_to_vec()
}

/// A GetMapRequest of the map at `path`, encoded.
pub fn get_map_request(path: &str) -> Vec<u8> {
    bpfmap_proto::v1::GetMapRequest { map: map_ref(path) }.encode_to_vec()
}

// ---------------------------------------------------------------------------
// Connections

/// What a connection runs over: TCP, or TLS over TCP.
pub trait Io: AsyncRead + AsyncWrite + Send + Unpin {}
impl<T: AsyncRead + AsyncWrite + Send + Unpin> Io for T {}

/// A TCP connection to `addr` from `source` (e.g. 127.0.0.7, so that the
/// daemon sees another peer).
pub async fn tcp(addr: SocketAddr, source: IpAddr) -> io::Result<TcpStream> {
    let socket = match source {
        IpAddr::V4(_) => TcpSocket::new_v4()?,
        IpAddr::V6(_) => TcpSocket::new_v6()?,
    };
    socket.bind(SocketAddr::new(source, 0))?;
    let tcp = socket.connect(addr).await?;
    tcp.set_nodelay(true)?;
    Ok(tcp)
}

/// A rustls client configuration for mutual TLS with ALPN "h2": trusting
/// `ca`, presenting `cert` and `key` (PEM files).
pub fn tls_config(ca: &Path, cert: &Path, key: &Path) -> Arc<rustls::ClientConfig> {
    use rustls::pki_types::{CertificateDer, PrivateKeyDer, pem::PemObject as _};
    let mut roots = rustls::RootCertStore::empty();
    for c in CertificateDer::pem_file_iter(ca).expect("the CA file") {
        roots
            .add(c.expect("a CA certificate"))
            .expect("a usable CA");
    }
    let chain: Vec<CertificateDer<'static>> = CertificateDer::pem_file_iter(cert)
        .expect("the certificate file")
        .map(|c| c.expect("a certificate"))
        .collect();
    let key = PrivateKeyDer::from_pem_file(key).expect("the key file");
    let mut config = rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .expect("TLS versions")
    .with_root_certificates(roots)
    .with_client_auth_cert(chain, key)
    .expect("a client certificate and its key");
    config.alpn_protocols = vec![b"h2".to_vec()];
    Arc::new(config)
}

/// An HTTP/2 connection driven frame by frame.
pub struct Conn {
    writer: WriteHalf<Box<dyn Io>>,
    out: Vec<u8>,
    /// Frames read by the reading task (None: the connection never reads).
    events: Option<mpsc::UnboundedReceiver<Event>>,
    /// The reading task (aborted on drop, which closes the connection).
    reading: Option<tokio::task::JoinHandle<()>>,
    /// The read side, kept unread, of a connection that never reads.
    _unread: Option<ReadHalf<Box<dyn Io>>>,
    scheme: &'static str,
    authority: String,
    next_stream: u32,
    /// DATA bytes received and not yet given back to the connection's
    /// window ([`return_connection_window`](Self::return_connection_window)).
    unreturned: u64,
    /// The GOAWAY received, if any.
    pub goaway: Option<GoAway>,
    /// Why and when the connection closed, if it did.
    pub closed: Option<(String, Instant)>,
    /// Streams the server ended (HEADERS or DATA with END_STREAM, or
    /// RST_STREAM), as read so far.
    pub ended: HashSet<u32>,
    /// Frames read so far, by type (index: the frame type, up to 9).
    pub counts: [u64; 10],
    /// DATA payload bytes read so far.
    pub data_bytes: u64,
}

impl fmt::Debug for Conn {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Conn")
            .field("authority", &self.authority)
            .field("next_stream", &self.next_stream)
            .field("goaway", &self.goaway)
            .field("closed", &self.closed)
            .finish_non_exhaustive()
    }
}

impl Conn {
    /// A plaintext connection to `addr` from `source`; `read`: whether a
    /// task reads what the server sends (a peer that never reads leaves it
    /// in the socket).
    pub async fn plain(addr: SocketAddr, source: IpAddr, read: bool) -> io::Result<Self> {
        let tcp = tcp(addr, source).await?;
        Ok(Self::new(Box::new(tcp), "http", addr.to_string(), read))
    }

    /// A TLS connection (server name "localhost") to `addr` from `source`.
    pub async fn tls(
        addr: SocketAddr,
        source: IpAddr,
        config: Arc<rustls::ClientConfig>,
        read: bool,
    ) -> io::Result<Self> {
        let tcp = tcp(addr, source).await?;
        let name = rustls::pki_types::ServerName::try_from("localhost").expect("a name");
        let tls = tokio_rustls::TlsConnector::from(config)
            .connect(name, tcp)
            .await?;
        let alpn = tls.get_ref().1.alpn_protocol().map(<[u8]>::to_vec);
        if alpn.as_deref() != Some(b"h2") {
            return Err(io::Error::other(format!(
                "the server chose ALPN {alpn:?}, not h2"
            )));
        }
        Ok(Self::new(
            Box::new(tls),
            "https",
            format!("localhost:{}", addr.port()),
            read,
        ))
    }

    /// A connection over `io`.
    pub fn new(io: Box<dyn Io>, scheme: &'static str, authority: String, read: bool) -> Self {
        let (reader, writer) = tokio::io::split(io);
        let (events, reading, unread) = if read {
            let (tx, rx) = mpsc::unbounded_channel();
            let task = tokio::spawn(read_frames(reader, tx));
            (Some(rx), Some(task), None)
        } else {
            (None, None, Some(reader))
        };
        Self {
            writer,
            out: Vec::new(),
            events,
            reading,
            _unread: unread,
            scheme,
            authority,
            next_stream: 1,
            unreturned: 0,
            goaway: None,
            closed: None,
            ended: HashSet::new(),
            counts: [0; 10],
            data_bytes: 0,
        }
    }

    /// Sends the preface and SETTINGS with `settings`, and, on a
    /// connection that reads, waits (up to 5 s) for the server's SETTINGS
    /// and acknowledges them.
    pub async fn handshake(&mut self, settings: &[(u16, u32)]) -> io::Result<()> {
        self.preface().settings(settings);
        self.flush().await?;
        if self.events.is_none() {
            return Ok(());
        }
        let deadline = Instant::now() + Duration::from_secs(5);
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.next(left).await {
                Some(f) if f.kind == kind::SETTINGS && !f.has(flag::ACK) => break,
                Some(_) => {}
                None => {
                    return Err(io::Error::other(format!(
                        "no SETTINGS from the server within 5 s ({:?}, {:?})",
                        self.goaway, self.closed
                    )));
                }
            }
        }
        self.flush().await // the ACK that next() queued
    }

    // --- frames -----------------------------------------------------------

    /// Appends a frame.
    pub fn frame(&mut self, kind: u8, flags: u8, stream: u32, payload: &[u8]) -> &mut Self {
        let len = payload.len() as u32;
        assert!(len < 1 << 24, "a frame payload of {len} bytes");
        self.out.extend_from_slice(&len.to_be_bytes()[1..]);
        self.out.push(kind);
        self.out.push(flags);
        self.out
            .extend_from_slice(&(stream & 0x7fff_ffff).to_be_bytes());
        self.out.extend_from_slice(payload);
        self
    }

    /// Appends the client preface.
    pub fn preface(&mut self) -> &mut Self {
        self.out.extend_from_slice(PREFACE);
        self
    }

    /// Appends SETTINGS with these (identifier, value) pairs.
    pub fn settings(&mut self, settings: &[(u16, u32)]) -> &mut Self {
        let mut payload = Vec::with_capacity(6 * settings.len());
        for (id, value) in settings {
            payload.extend_from_slice(&id.to_be_bytes());
            payload.extend_from_slice(&value.to_be_bytes());
        }
        self.frame(kind::SETTINGS, 0, 0, &payload)
    }

    /// Appends an acknowledgement of the server's SETTINGS.
    pub fn settings_ack(&mut self) -> &mut Self {
        self.frame(kind::SETTINGS, flag::ACK, 0, &[])
    }

    /// Appends HEADERS carrying `block` (flags: END_STREAM, END_HEADERS).
    pub fn headers(&mut self, stream: u32, block: &[u8], flags: u8) -> &mut Self {
        self.frame(kind::HEADERS, flags, stream, block)
    }

    /// Appends CONTINUATION carrying `block`.
    pub fn continuation(&mut self, stream: u32, block: &[u8], end_headers: bool) -> &mut Self {
        let flags = if end_headers { flag::END_HEADERS } else { 0 };
        self.frame(kind::CONTINUATION, flags, stream, block)
    }

    /// Appends a header block of any size: HEADERS, then CONTINUATION
    /// frames, each at most [`DEFAULT_MAX_FRAME`].
    pub fn header_block(&mut self, stream: u32, block: &[u8], end_stream: bool) -> &mut Self {
        let mut pieces = block.chunks(DEFAULT_MAX_FRAME).peekable();
        let first = pieces.next().unwrap_or_default();
        let mut flags = if end_stream { flag::END_STREAM } else { 0 };
        if pieces.peek().is_none() {
            flags |= flag::END_HEADERS;
        }
        self.headers(stream, first, flags);
        while let Some(piece) = pieces.next() {
            let last = pieces.peek().is_none();
            self.continuation(stream, piece, last);
        }
        self
    }

    /// Appends DATA.
    pub fn data(&mut self, stream: u32, payload: &[u8], end_stream: bool) -> &mut Self {
        let flags = if end_stream { flag::END_STREAM } else { 0 };
        self.frame(kind::DATA, flags, stream, payload)
    }

    /// Appends RST_STREAM with `code` (e.g. [`code::CANCEL`]).
    pub fn rst_stream(&mut self, stream: u32, code: u32) -> &mut Self {
        self.frame(kind::RST_STREAM, 0, stream, &code.to_be_bytes())
    }

    /// Appends WINDOW_UPDATE (`stream` 0: the connection's window).
    pub fn window_update(&mut self, stream: u32, increment: u32) -> &mut Self {
        self.frame(kind::WINDOW_UPDATE, 0, stream, &increment.to_be_bytes())
    }

    /// Appends PING.
    pub fn ping(&mut self, payload: [u8; 8], ack: bool) -> &mut Self {
        let flags = if ack { flag::ACK } else { 0 };
        self.frame(kind::PING, flags, 0, &payload)
    }

    /// Appends GOAWAY.
    pub fn goaway(&mut self, last_stream: u32, code: u32) -> &mut Self {
        let mut payload = last_stream.to_be_bytes().to_vec();
        payload.extend_from_slice(&code.to_be_bytes());
        self.frame(kind::GOAWAY, 0, 0, &payload)
    }

    /// A new client stream id (1, 3, 5, ...).
    pub fn open_stream(&mut self) -> u32 {
        let id = self.next_stream;
        self.next_stream += 2;
        id
    }

    /// The header block of a gRPC request to `path` on this connection.
    pub fn request_headers(&self, path: &str) -> Vec<u8> {
        grpc_headers(self.scheme, &self.authority, path)
    }

    /// Appends a whole gRPC request to `path` on a new stream: HEADERS,
    /// then DATA with the message and END_STREAM. Its stream id.
    pub fn request(&mut self, path: &str, message: &[u8]) -> u32 {
        let id = self.open_stream();
        let block = self.request_headers(path);
        self.headers(id, &block, flag::END_HEADERS);
        self.data(id, &grpc_message(message), true);
        id
    }

    /// Appends a WINDOW_UPDATE of the connection giving back every DATA
    /// byte read since the last one (none if there were none).
    pub fn return_connection_window(&mut self) -> &mut Self {
        if self.unreturned > 0 {
            let n = self.unreturned.min(0x7fff_ffff) as u32;
            self.unreturned -= u64::from(n);
            self.window_update(0, n);
        }
        self
    }

    /// Bytes appended and not yet written.
    pub fn pending(&self) -> usize {
        self.out.len()
    }

    /// Writes what was appended.
    pub async fn flush(&mut self) -> io::Result<()> {
        if self.out.is_empty() {
            return Ok(());
        }
        let out = std::mem::take(&mut self.out);
        let result = self.writer.write_all(&out).await;
        let mut out = out;
        out.clear();
        self.out = out;
        result?;
        self.writer.flush().await
    }

    // --- reading ----------------------------------------------------------

    /// The next frame, waiting up to `timeout`; None when none came in time
    /// or the connection closed (see [`closed`](Self::closed)). Notes GOAWAY,
    /// streams ended and DATA read, and queues the acknowledgement of the
    /// server's SETTINGS and PINGs for the next [`flush`](Self::flush), as
    /// any client does.
    pub async fn next(&mut self, timeout: Duration) -> Option<Frame> {
        let events = self.events.as_mut().expect("a connection that reads");
        let event = match tokio::time::timeout(timeout, events.recv()).await {
            Err(_) => return None,
            Ok(None) => return None,
            Ok(Some(e)) => e,
        };
        self.note(event)
    }

    /// The next frame already read, without waiting.
    pub fn try_next(&mut self) -> Option<Frame> {
        let event = self.events.as_mut()?.try_recv().ok()?;
        self.note(event)
    }

    /// Takes every frame already read, without waiting.
    pub fn drain(&mut self) {
        while self.try_next().is_some() {}
    }

    fn note(&mut self, event: Event) -> Option<Frame> {
        let frame = match event {
            Event::Closed(why, at) => {
                self.closed.get_or_insert((why, at));
                return None;
            }
            Event::Frame(f) => f,
        };
        if let Some(c) = self.counts.get_mut(usize::from(frame.kind)) {
            *c += 1;
        }
        match frame.kind {
            kind::SETTINGS if !frame.has(flag::ACK) => {
                self.settings_ack();
            }
            kind::PING if !frame.has(flag::ACK) => {
                let mut payload = [0; 8];
                let n = frame.payload.len().min(8);
                payload[..n].copy_from_slice(&frame.payload[..n]);
                self.ping(payload, true);
            }
            kind::DATA => {
                self.unreturned += frame.payload.len() as u64;
                self.data_bytes += frame.payload.len() as u64;
            }
            kind::GOAWAY => {
                if let Some(code) = frame.goaway_code() {
                    self.goaway.get_or_insert(GoAway {
                        code,
                        last_stream: be32(&frame.payload) & 0x7fff_ffff,
                        debug: String::from_utf8_lossy(&frame.payload[8..]).into_owned(),
                        at: frame.at,
                    });
                }
            }
            _ => {}
        }
        if frame.ends_stream() {
            self.ended.insert(frame.stream);
        }
        Some(frame)
    }

    /// Reads until a frame for which `wanted` holds, up to `timeout`; None
    /// when none came in time or the connection closed.
    pub async fn wait_for(
        &mut self,
        timeout: Duration,
        mut wanted: impl FnMut(&Frame) -> bool,
    ) -> Option<Frame> {
        let deadline = Instant::now() + timeout;
        loop {
            let left = deadline.checked_duration_since(Instant::now())?;
            let frame = self.next(left).await?;
            if wanted(&frame) {
                return Some(frame);
            }
        }
    }

    /// Reads until the connection closes, up to `timeout`: whether it did.
    pub async fn wait_closed(&mut self, timeout: Duration) -> bool {
        let deadline = Instant::now() + timeout;
        while self.closed.is_none() {
            let Some(left) = deadline.checked_duration_since(Instant::now()) else {
                break;
            };
            if self.next(left).await.is_none() && self.closed.is_none() {
                break;
            }
        }
        self.closed.is_some()
    }
}

impl Drop for Conn {
    fn drop(&mut self) {
        // The reading task holds the other half of the connection.
        if let Some(task) = self.reading.take() {
            task.abort();
        }
    }
}

/// Reads frames until the connection closes, sending each as it comes.
async fn read_frames(mut reader: ReadHalf<Box<dyn Io>>, tx: mpsc::UnboundedSender<Event>) {
    let mut buf = BytesMut::with_capacity(64 << 10);
    loop {
        while buf.len() >= 9 {
            let len =
                (usize::from(buf[0]) << 16) | (usize::from(buf[1]) << 8) | usize::from(buf[2]);
            if buf.len() < 9 + len {
                buf.reserve(9 + len - buf.len());
                break;
            }
            let head = buf.split_to(9);
            let frame = Frame {
                kind: head[3],
                flags: head[4],
                stream: be32(&head[5..9]) & 0x7fff_ffff,
                payload: buf.split_to(len).to_vec(),
                at: Instant::now(),
            };
            if tx.send(Event::Frame(frame)).is_err() {
                return;
            }
        }
        match reader.read_buf(&mut buf).await {
            Ok(0) => {
                let _ = tx.send(Event::Closed("end of stream".into(), Instant::now()));
                return;
            }
            Ok(_) => {}
            Err(e) => {
                let _ = tx.send(Event::Closed(e.to_string(), Instant::now()));
                return;
            }
        }
        if buf.capacity() - buf.len() < 16 << 10 {
            buf.reserve(64 << 10);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hpack_integers_follow_rfc7541() {
        // C.1.1, C.1.2, C.1.3 of RFC 7541.
        let mut out = Vec::new();
        hpack_int(&mut out, 10, 5, 0);
        assert_eq!(out, [0x0a]);
        out.clear();
        hpack_int(&mut out, 1337, 5, 0);
        assert_eq!(out, [0x1f, 0x9a, 0x0a]);
        out.clear();
        hpack_int(&mut out, 42, 8, 0);
        assert_eq!(out, [0x2a]);
    }

    #[test]
    fn a_literal_header_is_encoded_without_indexing() {
        // RFC 7541 C.2.1's example, without indexing: 0x00 where C.2.1,
        // with incremental indexing, has 0x40.
        let block = hpack(&[("custom-key", "custom-header")]);
        let mut expected = vec![0x00, 0x0a];
        expected.extend_from_slice(b"custom-key");
        expected.push(0x0d);
        expected.extend_from_slice(b"custom-header");
        assert_eq!(block, expected);
    }
}
