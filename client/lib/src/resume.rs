//! Resuming dump streams.

use std::{collections::VecDeque, time::Duration};

use backon::{BackoffBuilder, ExponentialBuilder};
use futures::Stream;
use tonic::{Code, Status, Streaming, transport::Channel};

use crate::{
    Chunk, EntryRef, Error, MapName, PerCpuValues, ValueRef, pb,
    pb::map_service_client::MapServiceClient,
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
/// Backoff is exponential with jitter, from `min_delay` up to `max_delay`,
/// for at most `max_attempts` consecutive failures (a dump that receives a
/// chunk starts counting again).
///
/// A status sent by the server arrives in trailers and carries no source
/// error; one made by the local transport does. That is how a server's
/// INTERNAL (a kernel error: retrying would repeat it) is told apart from a
/// connection that broke.
#[derive(Debug, Clone)]
pub struct RetryPolicy {
    /// Consecutive failed attempts (without receiving a chunk in between)
    /// before the dump gives up.
    pub max_attempts: usize,
    /// First delay.
    pub min_delay: Duration,
    /// Cap on one delay (jitter included).
    pub max_delay: Duration,
}

impl Default for RetryPolicy {
    fn default() -> Self {
        Self {
            max_attempts: 8,
            min_delay: Duration::from_millis(100),
            max_delay: Duration::from_secs(5),
        }
    }
}

impl RetryPolicy {
    /// No resuming at all: the first error ends the dump.
    pub fn never() -> Self {
        Self {
            max_attempts: 0,
            ..Self::default()
        }
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

    pub(crate) fn delays(&self) -> impl Iterator<Item = Duration> + use<> {
        let max = self.max_delay;
        ExponentialBuilder::default()
            .with_min_delay(self.min_delay)
            .with_max_delay(max)
            .with_max_times(self.max_attempts)
            .with_jitter()
            .build()
            .map(move |d| d.min(max))
    }
}

/// Options of one dump.
#[derive(Debug, Clone)]
pub struct DumpOptions {
    /// Entries per chunk (a hint; 0 = server default).
    pub chunk_size: u32,
    /// Stop after this many entries (0 = the whole map).
    pub limit: u64,
    /// Start after this cursor instead of at the beginning.
    pub cursor: Option<String>,
    /// Ask for the packed layout (less work on both sides). Chunks hold the
    /// same entries either way.
    pub packed: bool,
}

impl Default for DumpOptions {
    fn default() -> Self {
        Self {
            chunk_size: 0,
            limit: 0,
            cursor: None,
            packed: true,
        }
    }
}

/// A map value.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Value {
    /// The value of a map that is not per-CPU.
    Single(Vec<u8>),
    /// One value per possible CPU, in CPU order.
    PerCpu(Vec<Vec<u8>>),
}

impl Value {
    /// The value, borrowed.
    pub fn view(&self) -> ValueRef<'_> {
        match self {
            Self::Single(v) => ValueRef::Single(v),
            Self::PerCpu(v) => ValueRef::PerCpu(PerCpuValues::from_slices(v)),
        }
    }
}

/// One entry of a map, owned (a [`Chunk`] lends [`EntryRef`]s without
/// copying).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Entry {
    /// The key, `key_size` bytes.
    pub key: Vec<u8>,
    /// The value.
    pub value: Value,
}

impl Entry {
    /// The entry, borrowed.
    pub fn view(&self) -> EntryRef<'_> {
        EntryRef {
            key: &self.key,
            value: self.value.view(),
        }
    }
}

/// A dump in progress. Read it chunk by chunk with [`Dump::next_chunk`] or
/// as a stream of entries with [`Dump::into_entries`]. After any chunk,
/// [`Dump::cursor`] is where a later dump can resume.
#[derive(Debug)]
pub struct Dump {
    client: MapServiceClient<Channel>,
    map: MapName,
    options: DumpOptions,
    retry: RetryPolicy,
    cursor: String,
    stream: Option<Streaming<pb::DumpMapResponse>>,
    summary: Option<pb::DumpSummary>,
    received: u64,
    resumes: u32,
    finished: bool,
    /// The last failure retried (code and message), while retrying.
    last_failure: Option<(Code, String)>,
}

impl Dump {
    pub(crate) fn new(
        client: MapServiceClient<Channel>,
        map: MapName,
        options: DumpOptions,
        retry: RetryPolicy,
    ) -> Self {
        Self {
            client,
            map,
            cursor: options.cursor.clone().unwrap_or_default(),
            options,
            retry,
            stream: None,
            summary: None,
            received: 0,
            resumes: 0,
            finished: false,
            last_failure: None,
        }
    }

    /// The cursor of the last chunk received ("" before the first).
    pub fn cursor(&self) -> &str {
        &self.cursor
    }

    /// Entries received so far, over all resumed calls.
    pub fn received(&self) -> u64 {
        self.received
    }

    /// The failure the dump is retrying after, if it is: its code and
    /// message (for a caller that gives up waiting).
    pub fn last_failure(&self) -> Option<(Code, &str)> {
        self.last_failure.as_ref().map(|(c, m)| (*c, m.as_str()))
    }

    /// How many times the dump resumed after a broken stream.
    pub fn resumes(&self) -> u32 {
        self.resumes
    }

    /// The server's summary of the last call, once the dump has ended.
    pub fn summary(&self) -> Option<&pb::DumpSummary> {
        self.summary.as_ref()
    }

    /// Whether the whole map was read (false when the limit stopped it).
    pub fn complete(&self) -> bool {
        self.summary.as_ref().is_some_and(|s| s.complete)
    }

    async fn open(&mut self) -> Result<Streaming<pb::DumpMapResponse>, Status> {
        let limit = match self.options.limit {
            0 => 0,
            l => l - self.received,
        };
        let layout = if self.options.packed {
            pb::Layout::Packed
        } else {
            pb::Layout::Entries
        };
        let req = pb::DumpMapRequest {
            map: Some((&self.map).into()),
            cursor: self.cursor.clone(),
            chunk_size: self.options.chunk_size,
            limit,
            layout: layout as i32,
            // Entries are decoded here, from the bytes (see `typed`).
            raw: true,
            ..Default::default()
        };
        Ok(self.client.dump_map(req).await?.into_inner())
    }

    /// The next chunk; `None` once the dump has ended.
    pub async fn next_chunk(&mut self) -> Result<Option<Chunk>, Error> {
        let mut delays = self.retry.delays();
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
                Ok(Some(msg)) => {
                    if msg.done {
                        self.cursor = msg.cursor;
                        self.summary = msg.summary;
                        self.finished = true;
                        self.stream = None;
                        return Ok(None);
                    }
                    self.last_failure = None;
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
            if !RetryPolicy::should_retry(&status) {
                return Err(status.into());
            }
            self.last_failure = Some((status.code(), crate::status_text(&status)));
            match delays.next() {
                Some(delay) => {
                    tracing::debug!(map = %self.map, code = ?status.code(), message = status.message(), ?delay, "dump stream broke; resuming from the last cursor");
                    tokio::time::sleep(delay).await;
                    self.resumes += 1;
                }
                None => return Err(status.into()),
            }
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
        let p = RetryPolicy {
            max_attempts: 20,
            min_delay: Duration::from_millis(100),
            max_delay: Duration::from_millis(800),
        };
        let d: Vec<_> = p.delays().collect();
        assert_eq!(d.len(), 20);
        assert!(d.iter().all(|d| *d <= Duration::from_millis(800)), "{d:?}");
        assert_eq!(RetryPolicy::never().delays().count(), 0);
    }
}
