//! Drains: a map's entries read and deleted by the daemon, chunk by chunk,
//! each chunk kept by the daemon until the caller acknowledges it.

use tonic::{Status, Streaming};

use crate::{
    Chunk, Error, MapName, PerCpu, RetryPolicy, pb, pb::map_service_client::MapServiceClient,
    resume::Resumer,
};

/// What a drain asks for.
#[derive(Debug, Clone, Default)]
#[non_exhaustive]
pub struct DrainOptions {
    ack: String,
    acked_sequence: Option<u64>,
    limit: u64,
    chunk_size: u32,
    per_cpu: PerCpu,
    raw: bool,
}

impl DrainOptions {
    /// The cursor of the last chunk made durable (by an earlier drain):
    /// the first call acknowledges it, and the daemon forgets it and every
    /// chunk before it. Default: nothing acknowledged.
    pub fn with_ack(mut self, cursor: impl Into<String>) -> Self {
        self.ack = cursor.into();
        self
    }

    /// The sequence of that durable chunk: redelivered chunks at or below
    /// it are dropped (the caller has them).
    pub fn with_acked_sequence(mut self, sequence: u64) -> Self {
        self.acked_sequence = Some(sequence);
        self
    }

    /// Drain at most this many entries (default 0: until the map is
    /// empty). Whole hash buckets: a drain may exceed it by a bucket.
    /// It counts newly drained entries over the resumed calls, not the
    /// redelivered ones; after a broken stream, the chunks that were in
    /// flight come again as redelivered, so a resumed drain may also
    /// exceed it by those.
    pub fn with_limit(mut self, entries: u64) -> Self {
        self.limit = entries;
        self
    }

    /// Entries per kernel call and chunk, a hint (default 0: the daemon's
    /// default; at most 65536).
    pub fn with_chunk_size(mut self, entries: u32) -> Self {
        self.chunk_size = entries;
        self
    }

    /// How the daemon decodes per-CPU values (one per CPU, or summed).
    pub fn with_per_cpu(mut self, per_cpu: PerCpu) -> Self {
        self.per_cpu = per_cpu;
        self
    }

    /// Leave out the decoded keys and values (the bytes always come).
    /// Default: decoded when the map has types
    /// ([`Chunk::decoded_key`], [`Chunk::decoded_value`]).
    pub fn with_raw(mut self, raw: bool) -> Self {
        self.raw = raw;
        self
    }

    /// The request of a call that acknowledges `ack` and drains at most
    /// `limit` entries (0: no limit).
    fn request(&self, map: &MapName, ack: &str, limit: u64) -> pb::DrainMapRequest {
        pb::DrainMapRequest {
            map: Some(map.to_proto()),
            ack: ack.to_owned(),
            limit,
            chunk_size: self.chunk_size,
            per_cpu: match self.per_cpu {
                PerCpu::Each => pb::PerCpu::Each,
                PerCpu::Sum => pb::PerCpu::Sum,
            } as i32,
            raw: self.raw,
        }
    }
}

/// One chunk of a drain: its entries (read as a dump's, in the entries
/// layout), its cursor and its place in the map's drain order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DrainChunk {
    chunk: Chunk,
    sequence: u64,
    redelivered: bool,
}

impl DrainChunk {
    /// The entries, and the cursor that acknowledges this chunk.
    pub fn chunk(&self) -> &Chunk {
        &self.chunk
    }

    /// The entries, owned.
    pub fn into_chunk(self) -> Chunk {
        self.chunk
    }

    /// The cursor to acknowledge once the chunk is durable
    /// ([`Drain::ack`], [`DrainOptions::with_ack`]).
    pub fn cursor(&self) -> &str {
        self.chunk.cursor()
    }

    /// The chunk's place in the map's drain order: one more than the
    /// chunk before it.
    pub fn sequence(&self) -> u64 {
        self.sequence
    }

    /// The daemon sent this chunk before (to this caller or an earlier
    /// one) and it was not acknowledged.
    pub fn redelivered(&self) -> bool {
        self.redelivered
    }

    /// The number of entries.
    pub fn len(&self) -> usize {
        self.chunk.len()
    }

    /// Whether the chunk has no entries.
    pub fn is_empty(&self) -> bool {
        self.chunk.is_empty()
    }
}

/// What one message of a call gives.
#[derive(Debug, PartialEq)]
enum Step {
    /// A chunk for the caller.
    Chunk(DrainChunk),
    /// A redelivered chunk the caller already has: dropped.
    Duplicate,
    /// The call's last message, with its summary.
    Done(Option<pb::DrainSummary>),
}

/// Which chunks the caller has been given: the state that drops
/// redelivered ones, apart from the stream.
#[derive(Debug, Clone, Default)]
struct Delivered {
    /// The sequence of the last chunk handed to the caller (or the acked
    /// sequence given before the first).
    last: Option<u64>,
    /// Entries of newly drained (not redelivered) chunks, for the limit.
    drained: u64,
    /// Entries and chunks handed to the caller.
    entries: u64,
    chunks: u64,
    /// Redelivered chunks dropped, and their entries.
    duplicate_chunks: u64,
    duplicate_entries: u64,
}

impl Delivered {
    fn new(acked_sequence: Option<u64>) -> Self {
        Self {
            last: acked_sequence,
            ..Self::default()
        }
    }

    /// Whether a chunk is the caller's to see: every chunk drained by this
    /// call is; a redelivered one only above the last sequence handed out.
    /// A new chunk below it (the daemon's sequences started again) is
    /// handed out and becomes the last.
    fn admit(&mut self, sequence: u64, redelivered: bool) -> bool {
        if redelivered && self.last.is_some_and(|last| sequence <= last) {
            return false;
        }
        self.last = Some(sequence);
        true
    }

    fn receive(&mut self, msg: pb::DrainMapResponse) -> Result<Step, Error> {
        if msg.done {
            return Ok(Step::Done(msg.summary));
        }
        let n = msg.entries.len() as u64;
        if !msg.redelivered {
            self.drained += n;
        }
        if !self.admit(msg.sequence, msg.redelivered) {
            self.duplicate_chunks += 1;
            self.duplicate_entries += n;
            return Ok(Step::Duplicate);
        }
        self.chunks += 1;
        self.entries += n;
        Ok(Step::Chunk(DrainChunk {
            chunk: Chunk::new(msg.entries, None, msg.cursor)?,
            sequence: msg.sequence,
            redelivered: msg.redelivered,
        }))
    }
}

/// A drain in progress: [`Drain::next_chunk`] until `None`, and
/// [`Drain::ack`] for each chunk once it is durable.
///
/// A drain is one call (or, after broken streams, a chain of calls) that
/// ends when the daemon says it is done: the map was found empty, the limit
/// was reached, or the daemon's spool is full
/// ([`summary`](Self::summary)`.paused` says which). The acknowledgements
/// reach the daemon with the next call: start the next drain with
/// [`acked`](Self::acked).
///
/// # What is guaranteed
///
/// At least once. The daemon writes every chunk it drains to a spool (made
/// durable before the chunk is sent) and keeps it there until a later call
/// acknowledges its cursor, or a later one. A call first sends the chunks
/// of the spool that were not acknowledged, with their original cursor and
/// sequence ([`DrainChunk::redelivered`]), then drains new ones. A client
/// that crashed, a cut connection, a daemon that was killed and restarted:
/// nothing is lost, but what the client had received and not acknowledged
/// comes again.
///
/// Within one [`Drain`] the caller sees each chunk once: when the stream
/// breaks, the drain resumes by itself (per [`RetryPolicy::should_retry`],
/// with the dump's backoff) with a new call that acknowledges the last
/// chunk the caller confirmed with [`Drain::ack`], and drops the chunks
/// that call redelivers up to the last sequence it had already handed out.
///
/// Exactly once, for a caller that persists the cursor and the sequence of
/// its last durable chunk (with what it made durable) and passes them back
/// to the next drain with [`DrainOptions::with_ack`] and
/// [`DrainOptions::with_acked_sequence`]: the daemon forgets every chunk up
/// to that cursor, and the library drops any redelivered chunk at or below
/// that sequence.
///
/// ```no_run
/// # async fn demo(client: bpfmap_client::Client) -> Result<(), bpfmap_client::Error> {
/// use bpfmap_client::DrainOptions;
///
/// let map = "demo/flows".parse()?;
/// // From the last run: the cursor and sequence of its last durable chunk.
/// let (cursor, sequence) = ("...".to_owned(), 41);
/// let options = DrainOptions::default().with_ack(cursor).with_acked_sequence(sequence);
/// let mut drain = client.drain(&map, options);
/// while let Some(chunk) = drain.next_chunk().await? {
///     for entry in chunk.chunk() {
///         // write the entry somewhere durable ...
/// #       let _ = entry;
///     }
///     // ... make it durable, persist (cursor, sequence), then:
///     drain.ack(chunk.cursor(), chunk.sequence());
/// }
/// if let Some(s) = drain.summary() {
///     println!("drained {}, {} spooled, paused: {:?}", s.drained, s.spooled, s.paused);
/// }
/// # Ok(()) }
/// ```
#[derive(Debug)]
pub struct Drain {
    client: MapServiceClient<crate::transport::Transport>,
    map: MapName,
    options: DrainOptions,
    resumer: Resumer,
    stream: Option<Streaming<pb::DrainMapResponse>>,
    delivered: Delivered,
    /// The last chunk the caller confirmed (the options' before any).
    ack: String,
    ack_sequence: Option<u64>,
    summary: Option<pb::DrainSummary>,
    finished: bool,
}

impl Drain {
    pub(crate) fn new(
        client: MapServiceClient<crate::transport::Transport>,
        map: MapName,
        options: DrainOptions,
        retry: RetryPolicy,
    ) -> Self {
        Self {
            client,
            map,
            delivered: Delivered::new(options.acked_sequence),
            ack: options.ack.clone(),
            ack_sequence: options.acked_sequence,
            options,
            resumer: Resumer::new(retry),
            stream: None,
            summary: None,
            finished: false,
        }
    }

    /// The caller has made the chunk of this cursor and sequence durable
    /// (and every chunk before it). The next call, the one a broken stream
    /// resumes with or the next drain's, acknowledges it.
    pub fn ack(&mut self, cursor: &str, sequence: u64) {
        cursor.clone_into(&mut self.ack);
        self.ack_sequence = Some(sequence);
    }

    /// The last chunk acknowledged: its cursor and sequence (0 when only a
    /// cursor was given, with [`DrainOptions::with_ack`]); `None` before
    /// any. What the next drain starts with.
    pub fn acked(&self) -> Option<(&str, u64)> {
        (!self.ack.is_empty()).then(|| (self.ack.as_str(), self.ack_sequence.unwrap_or(0)))
    }

    /// The daemon's summary of the last call, once the drain has ended.
    pub fn summary(&self) -> Option<&pb::DrainSummary> {
        self.summary.as_ref()
    }

    /// Whether the daemon found the map empty at the end.
    pub fn complete(&self) -> bool {
        self.summary.as_ref().is_some_and(|s| s.complete)
    }

    /// The sequence of the last chunk handed out (or the acked sequence
    /// given, before the first).
    pub fn last_sequence(&self) -> Option<u64> {
        self.delivered.last
    }

    /// Entries handed out so far, over the resumed calls.
    pub fn received(&self) -> u64 {
        self.delivered.entries
    }

    /// Redelivered chunks dropped because the caller had them, and their
    /// entries.
    pub fn duplicates(&self) -> (u64, u64) {
        (
            self.delivered.duplicate_chunks,
            self.delivered.duplicate_entries,
        )
    }

    /// How many times the drain resumed after a broken stream.
    pub fn resumes(&self) -> u32 {
        self.resumer.resumes
    }

    /// The failure the drain is retrying after, if it is.
    pub fn last_failure(&self) -> Option<&Status> {
        self.resumer.last_failure.as_ref()
    }

    /// The entries a new call may still drain: `None` when the limit is
    /// reached.
    fn limit_left(&self) -> Option<u64> {
        match self.options.limit {
            0 => Some(0),
            l => l
                .checked_sub(self.delivered.drained)
                .filter(|left| *left > 0),
        }
    }

    /// The next chunk; `None` once the call's last message said it is done.
    pub async fn next_chunk(&mut self) -> Result<Option<DrainChunk>, Error> {
        loop {
            if self.finished {
                return Ok(None);
            }
            let result = match self.stream.as_mut() {
                Some(stream) => stream.message().await,
                None => {
                    // The stream broke after the limit was reached but
                    // before the end was said: nothing is left to ask for.
                    let Some(limit) = self.limit_left() else {
                        self.finished = true;
                        return Ok(None);
                    };
                    let req = self.options.request(&self.map, &self.ack, limit);
                    match self.client.drain_map(req).await {
                        Ok(r) => {
                            self.stream = Some(r.into_inner());
                            continue;
                        }
                        Err(status) => Err(status),
                    }
                }
            };
            let status = match result {
                Ok(Some(msg)) => match self.delivered.receive(msg)? {
                    Step::Chunk(chunk) => {
                        self.resumer.progressed();
                        return Ok(Some(chunk));
                    }
                    Step::Duplicate => continue,
                    Step::Done(summary) => {
                        self.summary = summary;
                        self.finished = true;
                        self.stream = None;
                        return Ok(None);
                    }
                },
                // The stream ended without its final message: broken.
                Ok(None) => Status::unavailable("stream ended before the drain finished"),
                Err(status) => status,
            };
            self.stream = None;
            let what = format!("the drain stream of map {}", self.map);
            self.resumer.wait(status, &what).await?;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(key: u8) -> pb::Entry {
        pb::Entry {
            key: vec![key],
            value: vec![key, 0],
            ..Default::default()
        }
    }

    fn chunk(sequence: u64, redelivered: bool, keys: &[u8]) -> pb::DrainMapResponse {
        pb::DrainMapResponse {
            entries: keys.iter().copied().map(entry).collect(),
            cursor: format!("c{sequence}"),
            sequence,
            redelivered,
            ..Default::default()
        }
    }

    fn done(drained: u64, redelivered: u64, spooled: u64) -> pb::DrainMapResponse {
        pb::DrainMapResponse {
            done: true,
            summary: Some(pb::DrainSummary {
                drained,
                redelivered,
                spooled,
                ..Default::default()
            }),
            ..Default::default()
        }
    }

    /// What each message gives, as (sequence, keys) for chunks, "dup" and
    /// "done".
    fn steps(d: &mut Delivered, msgs: Vec<pb::DrainMapResponse>) -> Vec<String> {
        msgs.into_iter()
            .map(|m| match d.receive(m).unwrap() {
                Step::Chunk(c) => {
                    let keys: Vec<u8> = c.chunk().iter().map(|e| e.key[0]).collect();
                    format!(
                        "{}{}:{keys:?}:{}",
                        c.sequence(),
                        if c.redelivered() { "r" } else { "" },
                        c.cursor()
                    )
                }
                Step::Duplicate => "dup".to_owned(),
                Step::Done(s) => format!("done:{}", s.unwrap().drained),
            })
            .collect()
    }

    #[test]
    fn options_map_to_the_request() {
        let map: MapName = "demo/flows".parse().unwrap();
        let options = DrainOptions::default()
            .with_ack("c7")
            .with_acked_sequence(7)
            .with_limit(1000)
            .with_chunk_size(256)
            .with_per_cpu(PerCpu::Sum)
            .with_raw(true);
        assert_eq!(
            options.request(&map, "c9", 400),
            pb::DrainMapRequest {
                map: Some(pb::MapRef {
                    r#ref: Some(pb::map_ref::Ref::Path("demo/flows".into())),
                    declare: None,
                }),
                ack: "c9".into(),
                limit: 400,
                chunk_size: 256,
                per_cpu: pb::PerCpu::Sum as i32,
                raw: true,
            }
        );
        let by_id: MapName = "id:12".parse().unwrap();
        assert_eq!(
            DrainOptions::default().request(&by_id, "", 0),
            pb::DrainMapRequest {
                map: Some(pb::MapRef {
                    r#ref: Some(pb::map_ref::Ref::Id(12)),
                    declare: None,
                }),
                ack: String::new(),
                limit: 0,
                chunk_size: 0,
                per_cpu: pb::PerCpu::Each as i32,
                raw: false,
            }
        );
    }

    #[tokio::test]
    async fn a_new_drain_starts_from_the_options_ack() {
        let channel = tonic::transport::Endpoint::from_static("http://127.0.0.1:1").connect_lazy();
        let client =
            MapServiceClient::with_interceptor(channel, crate::transport::OnBehalfOf::default());
        let map: MapName = "m".parse().unwrap();
        let fresh = Drain::new(
            client.clone(),
            map.clone(),
            DrainOptions::default(),
            RetryPolicy::never(),
        );
        assert_eq!(fresh.acked(), None);
        assert_eq!(fresh.last_sequence(), None);
        assert_eq!(fresh.limit_left(), Some(0));
        let options = DrainOptions::default()
            .with_ack("c41")
            .with_acked_sequence(41)
            .with_limit(10);
        let mut d = Drain::new(client.clone(), map.clone(), options, RetryPolicy::never());
        assert_eq!(d.acked(), Some(("c41", 41)));
        assert_eq!(d.last_sequence(), Some(41));
        assert_eq!(d.limit_left(), Some(10));
        d.ack("c43", 43);
        assert_eq!(d.acked(), Some(("c43", 43)));
        // A resumed call acknowledges the last chunk confirmed.
        let limit = d.limit_left().unwrap();
        assert_eq!(d.options.request(&d.map, &d.ack, limit).ack, "c43");
        // Only a cursor: its sequence is not known.
        let cursor_only = Drain::new(
            client,
            map,
            DrainOptions::default().with_ack("c5"),
            RetryPolicy::never(),
        );
        assert_eq!(cursor_only.acked(), Some(("c5", 0)));
        assert_eq!(cursor_only.last_sequence(), None);
    }

    #[test]
    fn a_resumed_call_drops_what_was_handed_out() {
        let mut d = Delivered::new(None);
        // The first call: two chunks left from an earlier client, then new
        // ones; the stream breaks after sequence 4.
        let first = steps(
            &mut d,
            vec![
                chunk(1, true, &[1, 2]),
                chunk(2, true, &[3]),
                chunk(3, false, &[4, 5]),
                chunk(4, false, &[6]),
            ],
        );
        assert_eq!(
            first,
            ["1r:[1, 2]:c1", "2r:[3]:c2", "3:[4, 5]:c3", "4:[6]:c4"]
        );
        // The resumed call (acknowledging c2): 3 and 4 come again and are
        // dropped; 5 was in flight when the stream broke, the caller never
        // had it; then new chunks.
        let second = steps(
            &mut d,
            vec![
                chunk(3, true, &[4, 5]),
                chunk(4, true, &[6]),
                chunk(5, true, &[7]),
                chunk(6, false, &[8, 9]),
                done(2, 4, 9),
            ],
        );
        assert_eq!(second, ["dup", "dup", "5r:[7]:c5", "6:[8, 9]:c6", "done:2"]);
        assert_eq!(d.last, Some(6));
        assert_eq!((d.chunks, d.entries), (6, 9));
        assert_eq!((d.duplicate_chunks, d.duplicate_entries), (2, 3));
        // Newly drained entries only: 4, 5, 6 and 8, 9.
        assert_eq!(d.drained, 5);
    }

    #[test]
    fn the_acked_sequence_drops_redelivered_chunks_at_or_below_it() {
        let mut d = Delivered::new(Some(11));
        let got = steps(
            &mut d,
            vec![
                chunk(10, true, &[1]),
                chunk(11, true, &[2]),
                chunk(12, true, &[3]),
                chunk(13, false, &[4]),
                done(1, 1, 2),
            ],
        );
        assert_eq!(got, ["dup", "dup", "12r:[3]:c12", "13:[4]:c13", "done:1"]);
        assert_eq!(d.last, Some(13));
    }

    #[test]
    fn a_new_chunk_is_never_dropped() {
        // The daemon's sequences started again (a new spool): a newly
        // drained chunk below the last sequence is handed out, and the
        // count goes on from it.
        let mut d = Delivered::new(Some(50));
        let got = steps(
            &mut d,
            vec![
                chunk(1, false, &[1]),
                chunk(2, false, &[2]),
                chunk(2, true, &[2]),
                chunk(3, true, &[3]),
            ],
        );
        assert_eq!(got, ["1:[1]:c1", "2:[2]:c2", "dup", "3r:[3]:c3"]);
        assert_eq!(d.last, Some(3));
    }

    #[test]
    fn admit_is_at_or_below_the_last() {
        let mut d = Delivered::new(None);
        assert!(d.admit(5, true));
        assert!(!d.admit(5, true));
        assert!(!d.admit(4, true));
        assert!(d.admit(6, true));
        assert!(d.admit(6, false));
        assert_eq!(d.last, Some(6));
    }

    /// A daemon that answers DrainMap from a script (one list of messages
    /// per call; an error ends the call's stream), and notes the requests.
    mod daemon {
        use std::{
            collections::VecDeque,
            sync::{Arc, Mutex},
        };

        use futures::{StreamExt as _, stream::BoxStream};
        use tonic::{Request, Response, Status};

        use crate::pb::{self, map_service_server::MapService};

        type Call = Vec<Result<pb::DrainMapResponse, Status>>;

        #[derive(Default)]
        pub(super) struct Fake {
            pub(super) calls: Mutex<VecDeque<Call>>,
            pub(super) requests: Mutex<Vec<pb::DrainMapRequest>>,
        }

        fn unimplemented<T>() -> Result<T, Status> {
            Err(Status::unimplemented("not in this test"))
        }

        #[tonic::async_trait]
        impl MapService for Fake {
            async fn list_maps(
                &self,
                _: Request<pb::ListMapsRequest>,
            ) -> Result<Response<pb::ListMapsResponse>, Status> {
                unimplemented()
            }
            async fn get_map(
                &self,
                _: Request<pb::GetMapRequest>,
            ) -> Result<Response<pb::MapInfo>, Status> {
                unimplemented()
            }
            type DumpMapStream = BoxStream<'static, Result<pb::DumpMapResponse, Status>>;
            async fn dump_map(
                &self,
                _: Request<pb::DumpMapRequest>,
            ) -> Result<Response<Self::DumpMapStream>, Status> {
                unimplemented()
            }
            async fn lookup(
                &self,
                _: Request<pb::LookupRequest>,
            ) -> Result<Response<pb::LookupResponse>, Status> {
                unimplemented()
            }
            async fn aggregate_map(
                &self,
                _: Request<pb::AggregateMapRequest>,
            ) -> Result<Response<pb::AggregateMapResponse>, Status> {
                unimplemented()
            }
            async fn histogram_map(
                &self,
                _: Request<pb::HistogramMapRequest>,
            ) -> Result<Response<pb::HistogramMapResponse>, Status> {
                unimplemented()
            }
            async fn stack_map(
                &self,
                _: Request<pb::StackMapRequest>,
            ) -> Result<Response<pb::StackMapResponse>, Status> {
                unimplemented()
            }
            type WatchMapStream = BoxStream<'static, Result<pb::WatchMapResponse, Status>>;
            async fn watch_map(
                &self,
                _: Request<pb::WatchMapRequest>,
            ) -> Result<Response<Self::WatchMapStream>, Status> {
                unimplemented()
            }
            type DrainMapStream = BoxStream<'static, Result<pb::DrainMapResponse, Status>>;
            async fn drain_map(
                &self,
                request: Request<pb::DrainMapRequest>,
            ) -> Result<Response<Self::DrainMapStream>, Status> {
                self.requests.lock().unwrap().push(request.into_inner());
                let call = self.calls.lock().unwrap().pop_front();
                let call = call.ok_or_else(|| Status::internal("no call left in the script"))?;
                Ok(Response::new(futures::stream::iter(call).boxed()))
            }
        }

        /// Serves `fake` on a local port; a client of it that resumes
        /// within milliseconds.
        pub(super) async fn serve(fake: Arc<Fake>) -> crate::Client {
            let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
            let addr = listener.local_addr().unwrap();
            let incoming = futures::stream::unfold(listener, |l| async move {
                let conn = l.accept().await.map(|(s, _)| s);
                Some((conn, l))
            });
            tokio::spawn(
                tonic::transport::Server::builder()
                    .add_service(pb::map_service_server::MapServiceServer::from_arc(fake))
                    .serve_with_incoming(incoming),
            );
            let retry = crate::RetryPolicy::default()
                .with_min_delay(std::time::Duration::from_millis(1))
                .with_max_delay(std::time::Duration::from_millis(5));
            let options = crate::ConnectOptions::default().with_retry(retry);
            crate::Client::connect_lazy(&format!("http://{addr}"), options).unwrap()
        }
    }

    /// (sequence, redelivered, keys) of a chunk.
    fn seen(c: &DrainChunk) -> (u64, bool, Vec<u8>) {
        let keys = c.chunk().iter().map(|e| e.key[0]).collect();
        (c.sequence(), c.redelivered(), keys)
    }

    #[tokio::test]
    async fn a_broken_stream_resumes_with_the_last_ack_and_drops_what_was_seen() {
        let fake = std::sync::Arc::new(daemon::Fake::default());
        fake.calls.lock().unwrap().extend([
            vec![
                Ok(chunk(7, true, &[1])),
                Ok(chunk(8, false, &[2, 3])),
                Err(Status::unavailable("the daemon is stopping")),
            ],
            vec![
                Ok(chunk(8, true, &[2, 3])),
                Ok(chunk(9, true, &[4])),
                Ok(chunk(10, false, &[5])),
                Ok(done(1, 3, 4)),
            ],
        ]);
        let client = daemon::serve(fake.clone()).await;
        let map: MapName = "demo/flows".parse().unwrap();
        let options = DrainOptions::default()
            .with_ack("c6")
            .with_acked_sequence(6)
            .with_limit(100)
            .with_chunk_size(64);
        let mut drain = client.drain(&map, options);
        let mut got = Vec::new();
        while let Some(c) = drain.next_chunk().await.unwrap() {
            got.push(seen(&c));
            // Only chunk 7 is durable when the stream breaks.
            if c.sequence() == 7 {
                drain.ack(c.cursor(), c.sequence());
            }
        }
        assert_eq!(
            got,
            [
                (7, true, vec![1]),
                (8, false, vec![2, 3]),
                (9, true, vec![4]),
                (10, false, vec![5]),
            ]
        );
        let requests = fake.requests.lock().unwrap().clone();
        let request = |ack: &str, limit| pb::DrainMapRequest {
            map: Some(map.to_proto()),
            ack: ack.into(),
            limit,
            chunk_size: 64,
            per_cpu: pb::PerCpu::Each as i32,
            raw: false,
        };
        // The resumed call acknowledges chunk 7, and drains what the limit
        // leaves after chunk 8's two entries.
        assert_eq!(requests, [request("c6", 100), request("c7", 98)]);
        assert_eq!(drain.resumes(), 1);
        assert_eq!(drain.duplicates(), (1, 2));
        assert_eq!(drain.received(), 5);
        assert_eq!(drain.last_sequence(), Some(10));
        assert_eq!(drain.acked(), Some(("c7", 7)));
        let summary = drain.summary().unwrap();
        assert_eq!(
            (summary.drained, summary.redelivered, summary.spooled),
            (1, 3, 4)
        );
        // Done: nothing more, and no other call.
        assert!(drain.next_chunk().await.unwrap().is_none());
        assert_eq!(fake.requests.lock().unwrap().len(), 2);
    }

    #[tokio::test]
    async fn a_stream_that_ends_without_done_is_resumed_and_a_refusal_is_not() {
        let fake = std::sync::Arc::new(daemon::Fake::default());
        fake.calls.lock().unwrap().extend([
            vec![Ok(chunk(1, false, &[1]))],
            vec![Ok(chunk(1, true, &[1])), Ok(done(0, 1, 1))],
            vec![Err(Status::failed_precondition(
                "demo/flows is not drainable",
            ))],
        ]);
        let client = daemon::serve(fake.clone()).await;
        let map: MapName = "demo/flows".parse().unwrap();
        let mut drain = client.drain(&map, DrainOptions::default());
        let first = drain.next_chunk().await.unwrap().unwrap();
        assert_eq!(seen(&first), (1, false, vec![1]));
        assert!(drain.next_chunk().await.unwrap().is_none());
        assert_eq!(drain.resumes(), 1);
        assert_eq!(drain.duplicates(), (1, 1));
        // Nothing was acknowledged: the resumed call sends no ack.
        let acks: Vec<String> = fake
            .requests
            .lock()
            .unwrap()
            .iter()
            .map(|r| r.ack.clone())
            .collect();
        assert_eq!(acks, ["", ""]);
        assert_eq!(drain.acked(), None);
        // FAILED_PRECONDITION ends the next drain at once.
        let mut refused = client.drain(&map, DrainOptions::default().with_ack("c1"));
        let e = refused.next_chunk().await.unwrap_err();
        assert_eq!(e.code(), tonic::Code::FailedPrecondition);
        assert_eq!(refused.resumes(), 0);
        assert_eq!(fake.requests.lock().unwrap().len(), 3);
        assert_eq!(fake.requests.lock().unwrap()[2].ack, "c1");
    }
}
