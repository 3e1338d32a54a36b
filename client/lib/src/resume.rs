//! Resuming dump streams.

use std::{
    collections::{BTreeMap, VecDeque},
    fmt,
    time::Duration,
};

use backon::{BackoffBuilder, ExponentialBuilder};
use futures::Stream;
use tonic::{Code, Status, Streaming};

use crate::{
    Chunk, Entry, Error, MapName, pb,
    pb::map_service_client::MapServiceClient,
    typed::{self, Projection, TypeError},
};

/// How calls are retried and dumps resumed.
///
/// Retry is a decision per status code ([`RetryPolicy::should_retry`]):
///
/// | code | what a dump does | what a unary call does |
/// |---|---|---|
/// | UNAVAILABLE sent by the daemon (it is stopping, the stream stalled, the slot expired) | resume from the last cursor, after a backoff | retry, after a backoff |
/// | RESOURCE_EXHAUSTED (the daemon runs its maximum of dumps or lookups) | retry from the last cursor, after a backoff | retry, after a backoff |
/// | UNAVAILABLE, UNKNOWN, INTERNAL, CANCELLED raised by the transport (refused or reset connection, broken HTTP/2 stream, failed TLS handshake) | resume from the last cursor, after a backoff | retry once, then stop |
/// | ABORTED | stop: the map was replaced, the caller restarts the dump | stop |
/// | everything else (INVALID_ARGUMENT, NOT_FOUND, FAILED_PRECONDITION, INTERNAL from the server, ...) | stop | stop |
///
/// Backoff is exponential with jitter, from
/// [`with_min_delay`](Self::with_min_delay) up to
/// [`with_max_delay`](Self::with_max_delay), for at most
/// [`with_max_attempts`](Self::with_max_attempts) consecutive failures (a
/// dump that receives a chunk starts counting again). RESOURCE_EXHAUSTED is
/// not counted as an attempt: a busy daemon is asked again, at most
/// 1 s apart, until it has been busy for
/// [`with_busy_wait`](Self::with_busy_wait) (60 s by default); the daemon
/// reclaims a slot held for `limits.max_slot_hold` while others wait, so a
/// waiting caller gets one within seconds. A
/// [`Client`](crate::Client) takes its policy from its
/// [`ConnectOptions`](crate::ConnectOptions).
///
/// A status sent by the server arrives in trailers and carries no source
/// error; one made by the local transport does. That is how a server's
/// INTERNAL (a kernel error: retrying would repeat it) is told apart from a
/// connection that broke.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct RetryPolicy {
    max_attempts: usize,
    min_delay: Duration,
    max_delay: Duration,
    busy_wait: Duration,
}

/// The longest delay between two calls to a busy daemon
/// (RESOURCE_EXHAUSTED): refusals cost it nothing, and a slot it frees
/// should not sit unused for long.
pub(crate) const BUSY_MAX_DELAY: Duration = Duration::from_secs(1);

/// 8 attempts, 100 ms to 5 s apart; a busy daemon is waited for 60 s.
impl Default for RetryPolicy {
    fn default() -> Self {
        Self {
            max_attempts: 8,
            min_delay: Duration::from_millis(100),
            max_delay: Duration::from_secs(5),
            busy_wait: Duration::from_secs(60),
        }
    }
}

impl RetryPolicy {
    /// No retrying or resuming at all: the first error ends the call or
    /// the dump.
    pub fn never() -> Self {
        Self::default()
            .with_max_attempts(0)
            .with_busy_wait(Duration::ZERO)
    }

    /// The policy of each target of a [`Fleet`](crate::Fleet) unless its
    /// [`ConnectOptions`](crate::ConnectOptions) give one: 4 attempts,
    /// 100 ms to 2 s apart, so that a target that is down is reported soon
    /// (a busy daemon is still waited for 60 s).
    pub fn fleet() -> Self {
        Self::default()
            .with_max_attempts(4)
            .with_max_delay(Duration::from_secs(2))
    }

    /// Consecutive failed attempts (without receiving a chunk in between)
    /// before the call or the dump gives up (default 8).
    pub fn with_max_attempts(mut self, attempts: usize) -> Self {
        self.max_attempts = attempts;
        self
    }

    /// The first delay (default 100 ms).
    pub fn with_min_delay(mut self, delay: Duration) -> Self {
        self.min_delay = delay;
        self
    }

    /// The cap on one delay, jitter included (default 5 s).
    pub fn with_max_delay(mut self, delay: Duration) -> Self {
        self.max_delay = delay;
        self
    }

    /// How long a daemon that answers RESOURCE_EXHAUSTED (all its dump or
    /// lookup slots in use) is asked again before the call or the dump
    /// gives up with that status (default 60 s; zero: not at all).
    pub fn with_busy_wait(mut self, wait: Duration) -> Self {
        self.busy_wait = wait;
        self
    }

    /// How long a busy daemon is waited for.
    pub fn busy_wait(&self) -> Duration {
        self.busy_wait
    }

    /// The cap on one delay.
    pub(crate) fn max_delay(&self) -> Duration {
        self.max_delay
    }

    /// Whether a unary call that failed with `status` on attempt `attempt`
    /// (from 0) should be tried again after a backoff: when the daemon itself
    /// said so, and once after a transport failure (a connection the daemon
    /// closed as idle just as the call went out); a daemon that cannot be
    /// reached is reported after that one retry.
    pub fn should_retry_call(status: &Status, attempt: usize) -> bool {
        let from_transport = std::error::Error::source(status).is_some();
        match status.code() {
            Code::ResourceExhausted => true,
            Code::Unavailable if !from_transport => true,
            Code::Unavailable | Code::Unknown | Code::Internal | Code::Cancelled => {
                from_transport && attempt == 0
            }
            _ => false,
        }
    }

    /// Whether a dump that failed with `status` should be tried again from
    /// its last cursor after a backoff.
    pub fn should_retry(status: &Status) -> bool {
        match status.code() {
            Code::Unavailable | Code::ResourceExhausted => true,
            Code::Unknown | Code::Internal | Code::Cancelled => {
                std::error::Error::source(status).is_some()
            }
            _ => false,
        }
    }

    fn delays(
        &self,
        max: Duration,
        times: Option<usize>,
    ) -> impl Iterator<Item = Duration> + use<> {
        let b = ExponentialBuilder::default()
            .with_min_delay(self.min_delay.min(max))
            .with_max_delay(max)
            .with_jitter();
        let b = match times {
            Some(n) => b.with_max_times(n),
            None => b.without_max_times(),
        };
        b.build().map(move |d| d.min(max))
    }

    /// The delays before each retry of a call or a dump, from its first
    /// failure (or the last progress) on.
    pub(crate) fn backoff(&self) -> Backoff {
        Backoff {
            attempts: Box::new(self.delays(self.max_delay, Some(self.max_attempts))),
            busy: Box::new(self.delays(self.max_delay.min(BUSY_MAX_DELAY), None)),
            busy_wait: self.busy_wait,
            busy_since: None,
        }
    }
}

/// The delays of one call's or dump's retries: counted attempts, and a busy
/// daemon waited for until the policy's busy wait.
pub(crate) struct Backoff {
    attempts: Box<dyn Iterator<Item = Duration> + Send + Sync>,
    busy: Box<dyn Iterator<Item = Duration> + Send + Sync>,
    busy_wait: Duration,
    busy_since: Option<std::time::Instant>,
}

impl fmt::Debug for Backoff {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Backoff")
            .field("busy_since", &self.busy_since)
            .finish_non_exhaustive()
    }
}

impl Backoff {
    /// The delay before trying again after `status`, or `None` to give up
    /// (whether the status is worth retrying at all is the caller's
    /// decision).
    pub(crate) fn next(&mut self, status: &Status) -> Option<Duration> {
        if status.code() != Code::ResourceExhausted {
            self.busy_since = None;
            return self.attempts.next();
        }
        let since = *self.busy_since.get_or_insert_with(std::time::Instant::now);
        let left = self.busy_wait.checked_sub(since.elapsed())?;
        if left.is_zero() {
            return None;
        }
        self.busy.next().map(|d| d.min(left))
    }

    /// Whether the daemon has been answering RESOURCE_EXHAUSTED since the
    /// last progress, and for how long.
    pub(crate) fn busy_for(&self) -> Option<Duration> {
        self.busy_since.map(|t| t.elapsed())
    }
}

/// What a stream that resumes itself keeps between its calls: the retry
/// policy, the backoff since its last progress, the failure it is waiting
/// out and how many times it resumed.
#[derive(Debug)]
pub(crate) struct Resumer {
    retry: RetryPolicy,
    backoff: Option<Backoff>,
    pub(crate) last_failure: Option<Status>,
    pub(crate) resumes: u32,
}

impl Resumer {
    pub(crate) fn new(retry: RetryPolicy) -> Self {
        Self {
            retry,
            backoff: None,
            last_failure: None,
            resumes: 0,
        }
    }

    /// The stream made progress: the next failure starts a new backoff.
    pub(crate) fn progressed(&mut self) {
        self.last_failure = None;
        self.backoff = None;
    }

    /// How long the daemon has been busy while waiting, if it is.
    pub(crate) fn busy_for(&self) -> Option<Duration> {
        self.backoff.as_ref().and_then(Backoff::busy_for)
    }

    /// After the stream broke with `status`: waits out the backoff and
    /// returns to resume, or gives `status` back when it is not worth
    /// retrying ([`RetryPolicy::should_retry`]) or the retries are spent.
    /// `what` names the stream in the log.
    pub(crate) async fn wait(&mut self, status: Status, what: &str) -> Result<(), Status> {
        if !RetryPolicy::should_retry(&status) {
            return Err(status);
        }
        let backoff = self.backoff.get_or_insert_with(|| self.retry.backoff());
        let Some(delay) = backoff.next(&status) else {
            return Err(status);
        };
        tracing::debug!(code = ?status.code(), message = status.message(), ?delay, "{what} broke; resuming");
        self.last_failure = Some(status);
        tokio::time::sleep(delay).await;
        self.resumes += 1;
        Ok(())
    }
}

/// Options of one dump.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct DumpOptions {
    chunk_size: u32,
    limit: u64,
    cursor: Option<String>,
    packed: bool,
    render: BTreeMap<String, String>,
    filter: String,
    fields: Vec<String>,
    per_cpu: crate::PerCpu,
    /// How a filtered dump reads the map (`pb::ScanMethod`).
    scan: i32,
    /// Sent as given (a forwarded request) rather than worked out.
    raw: Option<bool>,
}

/// The whole map from the beginning, chunks sized by the daemon, packed.
impl Default for DumpOptions {
    fn default() -> Self {
        Self {
            chunk_size: 0,
            limit: 0,
            cursor: None,
            packed: true,
            render: BTreeMap::new(),
            filter: String::new(),
            fields: Vec::new(),
            per_cpu: crate::PerCpu::Each,
            scan: pb::ScanMethod::ScanAuto as i32,
            raw: None,
        }
    }
}

impl DumpOptions {
    /// The renderings asked for (member path to rendering).
    #[cfg(feature = "arrow")]
    pub(crate) fn render_map(&self) -> &BTreeMap<String, String> {
        &self.render
    }

    /// The options of a `DumpMapRequest` as a caller wrote it (its map
    /// aside), for a program that forwards requests (a relay): every field
    /// goes to the daemon as it came, `raw` and `render` included, and the
    /// dump still resumes by itself when a stream breaks.
    pub fn from_proto(req: &pb::DumpMapRequest) -> Self {
        Self {
            chunk_size: req.chunk_size,
            limit: req.limit,
            cursor: Some(req.cursor.clone()).filter(|c| !c.is_empty()),
            packed: req.layout == pb::Layout::Packed as i32,
            render: req.render.clone().into_iter().collect(),
            filter: req.filter.clone(),
            fields: req.fields.clone(),
            per_cpu: if req.per_cpu == pb::PerCpu::Sum as i32 {
                crate::PerCpu::Sum
            } else {
                crate::PerCpu::Each
            },
            scan: req.scan,
            raw: Some(req.raw),
        }
    }

    /// The request of this dump on `map`, from `cursor`, for at most
    /// `limit` entries more (0: all).
    pub(crate) fn request(&self, map: &MapName, cursor: &str, limit: u64) -> pb::DumpMapRequest {
        // The daemon sums where it decodes: in the entries layout (a
        // forwarded request goes as it came).
        let forwarded = self.raw.is_some();
        let sum = self.per_cpu == crate::PerCpu::Sum && (!self.packed || forwarded);
        let layout = if self.packed {
            pb::Layout::Packed
        } else {
            pb::Layout::Entries
        };
        // Entries are decoded here, from the bytes (see `typed`), unless
        // renderings are asked of the daemon (entries layout only), or a
        // projection (whose raw bytes it leaves out). A filter's literals and
        // the fields kept are read in the renderings' spellings: they go
        // along with a query in any layout.
        let queried = !self.filter.is_empty() || !self.fields.is_empty();
        let render: std::collections::HashMap<String, String> =
            if self.packed && !forwarded && !queried {
                Default::default()
            } else {
                self.render.clone().into_iter().collect()
            };
        let raw = self
            .raw
            .unwrap_or(render.is_empty() && !sum && (self.packed || !self.projected()));
        pb::DumpMapRequest {
            map: Some(map.to_proto()),
            cursor: cursor.to_owned(),
            chunk_size: self.chunk_size,
            limit,
            layout: layout as i32,
            raw,
            per_cpu: if sum {
                pb::PerCpu::Sum
            } else {
                pb::PerCpu::Each
            } as i32,
            render,
            filter: self.filter.clone(),
            fields: self.fields.clone(),
            scan: self.scan,
        }
    }

    /// The limit asked (0: none).
    pub(crate) fn limit(&self) -> u64 {
        self.limit
    }

    /// Entries per chunk, a hint (default 0: the daemon sizes chunks).
    pub fn with_chunk_size(mut self, entries: u32) -> Self {
        self.chunk_size = entries;
        self
    }

    /// Stop after this many entries (default 0: the whole map). The dump
    /// is then not [`complete`](Dump::complete), and its
    /// [`cursor`](Dump::cursor) continues it.
    pub fn with_limit(mut self, entries: u64) -> Self {
        self.limit = entries;
        self
    }

    /// Start after this cursor (from [`Dump::cursor`] or
    /// [`Chunk::cursor`]) instead of at the beginning; an empty cursor is
    /// the beginning.
    pub fn with_cursor(mut self, cursor: impl Into<String>) -> Self {
        self.cursor = Some(cursor.into());
        self
    }

    /// Ask for the packed layout (the default: less work on both sides) or
    /// one message per entry. Chunks hold the same entries either way.
    pub fn with_packed(mut self, packed: bool) -> Self {
        self.packed = packed;
        self
    }

    /// Show members another way than their types say: (member path,
    /// rendering) pairs such as `("key.daddr", "ipv4")` or
    /// `("value.address", Rendering::Ipv4)` (see
    /// [`Rendering`](crate::typed::Rendering)), over the renderings the
    /// daemon's configuration gives the map. Added to those given before.
    ///
    /// The packed layout (the default) carries bytes, which the library
    /// decodes: the renderings apply to the types a fleet dump gives with
    /// each chunk ([`FleetDumpOptions::with_types`](crate::FleetDumpOptions::with_types));
    /// a caller that decodes a [`Dump`] itself makes its types with
    /// [`MapInfo::types_with`](crate::MapInfo::types_with). In the entries
    /// layout (`with_packed(false)`) they are sent to the daemon, which then
    /// decodes every entry with them ([`Chunk::decoded_key`],
    /// [`Chunk::decoded_value`]). An unknown rendering or a path that does
    /// not start with "key" or "value" ends the dump with
    /// [`Error::Render`] before anything is sent; a member the map does not
    /// have, or whose size does not fit, is [`Error::Render`] where the
    /// library decodes and INVALID_ARGUMENT from the daemon.
    pub fn with_render<K: AsRef<str>, V: fmt::Display>(
        mut self,
        render: impl IntoIterator<Item = (K, V)>,
    ) -> Self {
        self.render.extend(typed::render_map(render));
        self
    }

    /// Only the entries for which this CEL expression is true, evaluated
    /// by the daemon on each entry as it reads the map (`key.dport == 443
    /// && value.bytes > 1000000`; the language: the proto file's
    /// `DumpMapRequest.filter`). The limit counts matching entries, and
    /// [`DumpSummary::entries_scanned`] says how many were read. A dump that
    /// resumes passes the same filter (the daemon binds its cursors to it).
    /// An expression that does not fit the map's types is INVALID_ARGUMENT,
    /// naming the member or the operator.
    pub fn with_filter(mut self, filter: impl Into<String>) -> Self {
        self.filter = filter.into();
        self
    }

    /// Only these members of each entry ("key.daddr", "value.bytes",
    /// "key" or "value" whole), in this order; the map needs types. In the
    /// packed layout the records hold only their bytes, decoded through
    /// [`Dump::projection`]'s types (a fleet dump with types gives those
    /// with each chunk); in the entries layout the daemon decodes them
    /// ([`Chunk::decoded_key`], [`Chunk::decoded_value`]), and renderings
    /// cannot go with them. Unknown members are INVALID_ARGUMENT.
    pub fn with_fields(mut self, fields: impl IntoIterator<Item = impl Into<String>>) -> Self {
        self.fields = fields.into_iter().map(Into::into).collect();
        self
    }

    /// A filtered dump of a hash map walked inside the kernel
    /// (`SCAN_KERNEL`): the daemon's program tests the filter there and
    /// copies out only the matching entries, at a fraction of the batched
    /// read's cost. That walk takes no bucket lock: an entry deleted and
    /// inserted again while it runs can be missed. Entries then come in the
    /// order of their key bytes; a resumed dump keeps this option. Arrays
    /// are walked inside the kernel without it (each index is visited
    /// once); [`DumpSummary::scanned_in_kernel`] says which walk ran.
    pub fn with_kernel_scan(mut self) -> Self {
        self.scan = pb::ScanMethod::ScanKernel as i32;
        self
    }

    /// Always read with batched lookups (`SCAN_BATCHED`), never inside the
    /// kernel.
    pub fn with_batched_scan(mut self) -> Self {
        self.scan = pb::ScanMethod::ScanBatched as i32;
        self
    }

    /// How per-CPU values are decoded, as for a lookup, a watch or an
    /// aggregate: [`PerCpu::Sum`](crate::PerCpu::Sum) has the daemon sum
    /// every integer member over the CPUs where it decodes, in the entries
    /// layout (`with_packed(false)`): [`Chunk::decoded_value`] is then the
    /// sum. The packed layout carries each CPU's bytes, summed where they
    /// are decoded ([`MapTypes::sum_value`](crate::MapTypes::sum_value)).
    /// A map that is not per-CPU, or whose values cannot be summed, is
    /// INVALID_ARGUMENT.
    pub fn with_per_cpu(mut self, per_cpu: crate::PerCpu) -> Self {
        self.per_cpu = per_cpu;
        self
    }

    pub(crate) fn cursor(&self) -> Option<&str> {
        self.cursor.as_deref()
    }

    /// Whether the dump is projected (`with_fields`).
    pub(crate) fn projected(&self) -> bool {
        !self.fields.is_empty()
    }

    /// The renderings asked for.
    pub(crate) fn render(&self) -> &BTreeMap<String, String> {
        &self.render
    }
}

/// The daemon's summary of a dump's last call.
#[derive(Debug, Clone, PartialEq)]
pub struct DumpSummary(pb::DumpSummary);

impl DumpSummary {
    /// Entries sent by the last call (not by the earlier calls of a resumed
    /// dump: [`Dump::received`] counts those).
    pub fn entries(&self) -> u64 {
        self.0.entries
    }

    /// Chunks sent by the last call.
    pub fn chunks(&self) -> u64 {
        self.0.chunks
    }

    /// The time the daemon took for the last call.
    pub fn elapsed(&self) -> Option<Duration> {
        self.0.elapsed.and_then(|d| Duration::try_from(d).ok())
    }

    /// Whether the walk reached the end of the map (false when the limit
    /// stopped it).
    pub fn complete(&self) -> bool {
        self.0.complete
    }

    /// Entries the last call read; with a filter, [`entries`](Self::entries)
    /// counts those that matched.
    pub fn entries_scanned(&self) -> u64 {
        self.0.entries_scanned
    }

    /// Whether the daemon walked the map inside the kernel (see
    /// [`DumpOptions::with_kernel_scan`]).
    pub fn scanned_in_kernel(&self) -> bool {
        self.0.scanned_in_kernel
    }

    /// Why a filtered dump was read in batches, or what of its filter the
    /// daemon tested in user space after a walk inside the kernel.
    pub fn scan_note(&self) -> &str {
        &self.0.scan_note
    }

    /// The message it came in.
    pub fn as_proto(&self) -> &pb::DumpSummary {
        &self.0
    }

    /// The message it came in, owned.
    pub fn into_proto(self) -> pb::DumpSummary {
        self.0
    }
}

impl From<pb::DumpSummary> for DumpSummary {
    fn from(s: pb::DumpSummary) -> Self {
        Self(s)
    }
}

/// A dump in progress. Read it chunk by chunk with [`Dump::next_chunk`] or
/// as a stream of entries with [`Dump::into_entries`]. After any chunk,
/// [`Dump::cursor`] is where a later dump can resume.
#[derive(Debug)]
pub struct Dump {
    client: MapServiceClient<crate::transport::Transport>,
    map: MapName,
    options: DumpOptions,
    cursor: String,
    stream: Option<Streaming<pb::DumpMapResponse>>,
    summary: Option<DumpSummary>,
    received: u64,
    finished: bool,
    /// The retries since the last chunk, the failure waited out and the
    /// resumes (kept across calls of [`Dump::next_chunk`], which a caller
    /// may drop and call again).
    resumer: Resumer,
    /// Renderings that cannot be parsed: the first call ends with them.
    bad_render: Option<TypeError>,
    /// The projection's types, from the first message that described them.
    projection: Option<Projection>,
}

impl Dump {
    /// Whether it selects fields (its records are a projection's).
    #[cfg(feature = "arrow")]
    pub(crate) fn selects_fields(&self) -> bool {
        !self.options.fields.is_empty()
    }

    pub(crate) fn new(
        client: MapServiceClient<crate::transport::Transport>,
        map: MapName,
        options: DumpOptions,
        retry: RetryPolicy,
    ) -> Self {
        let bad_render = typed::parse_render(&options.render).err();
        Self {
            bad_render,
            client,
            map,
            cursor: options.cursor().unwrap_or_default().to_owned(),
            options,
            resumer: Resumer::new(retry),
            stream: None,
            summary: None,
            received: 0,
            finished: false,
            projection: None,
        }
    }

    /// With [`DumpOptions::with_fields`]: the types of the projected
    /// records, from the daemon's first message (`None` before it). Packed
    /// chunks decode through [`Projection::types_with`].
    pub fn projection(&self) -> Option<&Projection> {
        self.projection.as_ref()
    }

    /// The cursor of the last chunk received ("" before the first).
    pub fn cursor(&self) -> &str {
        &self.cursor
    }

    /// Entries received so far, over all resumed calls.
    pub fn received(&self) -> u64 {
        self.received
    }

    /// The failure the dump is retrying after, if it is (for a caller that
    /// gives up waiting).
    pub fn last_failure(&self) -> Option<&Status> {
        self.resumer.last_failure.as_ref()
    }

    /// How long the daemon has been answering RESOURCE_EXHAUSTED (all its
    /// dump slots in use) while the dump waits for a slot, if it is.
    pub fn busy_for(&self) -> Option<Duration> {
        self.resumer.busy_for()
    }

    /// How many times the dump resumed after a broken stream.
    pub fn resumes(&self) -> u32 {
        self.resumer.resumes
    }

    /// The server's summary of the last call, once the dump has ended.
    pub fn summary(&self) -> Option<&DumpSummary> {
        self.summary.as_ref()
    }

    /// Whether the whole map was read (false when the limit stopped it).
    pub fn complete(&self) -> bool {
        self.summary.as_ref().is_some_and(DumpSummary::complete)
    }

    async fn open(&mut self) -> Result<Streaming<pb::DumpMapResponse>, Status> {
        let limit = match self.options.limit {
            0 => 0,
            l => l - self.received,
        };
        let req = self.options.request(&self.map, &self.cursor, limit);
        Ok(self.client.dump_map(req).await?.into_inner())
    }

    /// Opens the call now rather than at the first [`Dump::next_chunk`],
    /// for a caller with another call to make meanwhile: the daemon starts
    /// reading while it runs. A call that cannot be opened is left to
    /// `next_chunk`, which retries it or says why.
    #[cfg(feature = "arrow")]
    pub(crate) async fn open_now(&mut self) {
        if self.stream.is_some() || self.finished || self.bad_render.is_some() {
            return;
        }
        if let Ok(stream) = self.open().await {
            self.stream = Some(stream);
        }
    }

    /// The next chunk; `None` once the dump has ended.
    pub async fn next_chunk(&mut self) -> Result<Option<Chunk>, Error> {
        if let Some(e) = self.bad_render.take() {
            self.finished = true;
            return Err(Error::render(e));
        }
        loop {
            if self.finished {
                return Ok(None);
            }
            let result = match self.stream.as_mut() {
                Some(stream) => stream.message().await,
                // The stream broke after the last entry the limit allowed
                // but before the end was said: nothing is left to ask for.
                None if self.options.limit != 0 && self.received >= self.options.limit => {
                    self.finished = true;
                    return Ok(None);
                }
                None => match self.open().await {
                    Ok(stream) => {
                        self.stream = Some(stream);
                        continue;
                    }
                    Err(status) => Err(status),
                },
            };
            let status = match result {
                Ok(Some(mut msg)) => {
                    if let Some(p) = msg.projection.take() {
                        self.projection = Some(Projection::from(p));
                    }
                    if msg.done {
                        self.cursor = msg.cursor;
                        self.summary = msg.summary.map(DumpSummary);
                        self.finished = true;
                        self.stream = None;
                        return Ok(None);
                    }
                    self.resumer.progressed();
                    let chunk = Chunk::new(msg.entries, msg.packed, msg.cursor)?;
                    self.cursor.clear();
                    self.cursor.push_str(chunk.cursor());
                    self.received += chunk.len() as u64;
                    return Ok(Some(chunk));
                }
                // The stream ended without its final message: broken.
                Ok(None) => Status::unavailable("stream ended before the dump finished"),
                Err(status) => status,
            };
            self.stream = None;
            let what = format!("the dump stream of map {}", self.map);
            self.resumer.wait(status, &what).await?;
        }
    }

    /// All remaining entries as a stream.
    pub fn into_entries(self) -> impl Stream<Item = Result<Entry, Error>> {
        futures::stream::try_unfold(
            (self, VecDeque::new()),
            |(mut dump, mut pending)| async move {
                loop {
                    if let Some(e) = pending.pop_front() {
                        return Ok(Some((e, (dump, pending))));
                    }
                    match dump.next_chunk().await? {
                        Some(chunk) => pending.extend(chunk),
                        None => return Ok(None),
                    }
                }
            },
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn resume_decision_per_code() {
        assert!(RetryPolicy::should_retry(&Status::unavailable("x")));
        assert!(RetryPolicy::should_retry(&Status::resource_exhausted("x")));
        for code in [
            Code::Aborted,
            Code::InvalidArgument,
            Code::NotFound,
            Code::FailedPrecondition,
            Code::PermissionDenied,
            Code::OutOfRange,
            Code::Unauthenticated,
        ] {
            assert!(
                !RetryPolicy::should_retry(&Status::new(code, "x")),
                "{code:?}"
            );
        }
        // From the server (no source): not retried.
        assert!(!RetryPolicy::should_retry(&Status::internal(
            "kernel said EFAULT"
        )));
        assert!(!RetryPolicy::should_retry(&Status::unknown("x")));
        // From the transport (with a source): retried.
        let io = std::io::Error::new(std::io::ErrorKind::ConnectionReset, "reset");
        let mut s = Status::unknown("h2 protocol error");
        s.set_source(std::sync::Arc::new(io));
        assert!(RetryPolicy::should_retry(&s));
        // Unary calls: what the server says; a transport failure once.
        assert!(RetryPolicy::should_retry_call(&s, 0));
        assert!(!RetryPolicy::should_retry_call(&s, 1));
        let mut refused = Status::unavailable("connection refused");
        refused.set_source(std::sync::Arc::new(std::io::Error::from(
            std::io::ErrorKind::ConnectionRefused,
        )));
        assert!(RetryPolicy::should_retry_call(&refused, 0));
        assert!(!RetryPolicy::should_retry_call(&refused, 1));
        let stopping = Status::unavailable("stopping");
        assert!(RetryPolicy::should_retry_call(&stopping, 3));
        let busy = Status::resource_exhausted("busy");
        assert!(RetryPolicy::should_retry_call(&busy, 3));
        assert!(!RetryPolicy::should_retry_call(&Status::not_found("x"), 0));
        assert!(!RetryPolicy::should_retry_call(
            &Status::internal("EFAULT"),
            0
        ));
    }

    #[test]
    fn delays_are_capped_and_counted() {
        let p = RetryPolicy::default()
            .with_max_attempts(20)
            .with_max_delay(Duration::from_millis(800));
        let mut b = p.backoff();
        let broken = Status::unavailable("x");
        let d: Vec<_> = std::iter::from_fn(|| b.next(&broken)).collect();
        assert_eq!(d.len(), 20);
        assert!(d.iter().all(|d| *d <= Duration::from_millis(800)), "{d:?}");
        assert_eq!(RetryPolicy::never().backoff().next(&broken), None);
        let busy = Status::resource_exhausted("busy");
        assert_eq!(RetryPolicy::never().backoff().next(&busy), None);
    }
}
