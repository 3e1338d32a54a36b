//! Client library for bpfmapd: list, describe, look up and dump the eBPF
//! maps of one host ([`Client`]) or of many ([`Fleet`]).
//!
//! # One daemon
//!
//! ```no_run
//! # async fn demo() -> Result<(), bpfmap_client::Error> {
//! use bpfmap_client::{Client, ConnectOptions, DumpOptions, MapName};
//! use futures::TryStreamExt as _;
//!
//! let client = Client::connect("http://127.0.0.1:50051", ConnectOptions::default()).await?;
//! let map: MapName = "demo/flows".parse()?;
//! let mut entries = std::pin::pin!(client.dump(&map, DumpOptions::default()).into_entries());
//! while let Some(entry) = entries.try_next().await? {
//!     println!("{:02x?} => {:?}", entry.key, entry.value);
//! }
//! # Ok(()) }
//! ```
//!
//! Every call takes its options as a value built from `Default` with
//! `with_*` methods ([`ConnectOptions`], [`DumpOptions`],
//! [`LookupOptions`], [`AggregateOptions`], [`FleetOptions`],
//! [`FleetDumpOptions`], [`FleetAggregateOptions`]), and returns the
//! library's types ([`MapInfo`], [`LookupResult`], [`Chunk`],
//! [`DumpSummary`], [`AggregateResult`], [`FleetAggregate`]); the messages
//! they came in are there too (`as_proto()`, and the generated code in
//! [`pb`]).
//!
//! A [`MapName`] is a pin path (`"demo/flows"`), a kernel id (`"id:12"`),
//! a kernel name with an optional owner (`"name:hists"`,
//! `"name:start@runqlat"`: a program name, process name or pid), or an
//! inner map of a map of maps ([`MapName::inner`]); any of them may carry
//! types declared in C for a map whose BTF does not give them
//! ([`MapName::with_types`]: `"char[16]"`, `"__u64"`).
//! [`Client::list_maps_with`] narrows the list by name, type and owner, and
//! [`MapInfo`] says who holds each map ([`MapInfo::programs`],
//! [`MapInfo::owners`]).
//!
//! A dump resumes by itself from the last cursor it received when the
//! stream breaks (UNAVAILABLE, or a transport error such as a reset
//! connection), with exponential backoff; see [`RetryPolicy`] for the
//! decision per status code. [`Dump::next_chunk`] reads chunk by chunk: a
//! [`Chunk`] lends its entries in place, with no allocation or copy per
//! entry.
//!
//! # Mutual TLS, typed maps, lookups
//!
//! ```no_run
//! # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
//! use std::{collections::BTreeMap, path::Path};
//!
//! use bpfmap_client::{
//!     Client, ClientTls, ConnectOptions, DumpOptions, Key, LookupOptions, MapName,
//! };
//!
//! let tls = ClientTls::from_files(Path::new("ca.pem"), Path::new("me.pem"), Path::new("me.key"))?;
//! let options = ConnectOptions::default().with_tls(tls);
//! let client = Client::connect("https://node-1.example.org:50051", options).await?;
//! let map: MapName = "demo/flows".parse()?;
//! let types = client.get_map(&map).await?.types()?.expect("a map with BTF");
//! let mut dump = client.dump(&map, DumpOptions::default());
//! let mut line = Vec::new();
//! while let Some(chunk) = dump.next_chunk().await? {
//!     for entry in &chunk {
//!         let key: prost_types::Value = types.decode_key(entry.key);
//!         let value = types.decode_value(entry.value); // per-CPU: a list; types.sum_value() sums
//!         line.clear();
//!         types.write_entry_json(entry, &mut line); // JSON text without building values
//!     }
//! }
//! // Keys as bytes, or as JSON through the map's key type.
//! let key: BTreeMap<String, prost_types::Value> = BTreeMap::from([
//!     ("saddr".to_owned(), "10.0.0.0".into()), // in the rendered spelling
//!     ("daddr".to_owned(), "192.168.0.1".into()),
//!     ("sport".to_owned(), 1024u16.into()),
//!     ("dport".to_owned(), 443u16.into()),
//!     ("proto".to_owned(), "IPPROTO_TCP".into()),
//! ]);
//! let found = client.lookup(&map, [Key::Json(key.into())], LookupOptions::default()).await?;
//! println!("{:?}", found[0].decoded_value());
//! # Ok(()) }
//! ```
//!
//! # A fleet
//!
//! ```no_run
//! # async fn demo() -> Result<(), bpfmap_client::Error> {
//! use bpfmap_client::{ConnectOptions, Fleet, FleetDumpOptions, FleetEvent, Target};
//! use futures::StreamExt as _;
//!
//! let targets: Vec<Target> = vec!["10.0.0.7:50051".parse()?, "10.0.0.8:50051".parse()?];
//! let fleet = Fleet::new(targets, ConnectOptions::default());
//! let map = "tc/globals/cilium_ct4_global".parse()?;
//! let mut run = fleet.dump(&map, FleetDumpOptions::default());
//! while let Some(event) = run.next().await {
//!     match event {
//!         FleetEvent::Answer { target, answer } => {
//!             println!("{target}: {} entries", answer.chunk.len())
//!         }
//!         FleetEvent::Done(report) => match &report.error {
//!             None => println!("{}: OK, complete: {}", report.target, report.complete),
//!             Some(e) => println!("{}: {e}", report.target),
//!         },
//!         _ => {}
//!     }
//! }
//! # Ok(()) }
//! ```
//!
//! Every fleet call ([`Fleet::list_maps`], [`Fleet::get_map`],
//! [`Fleet::lookup`], [`Fleet::dump`], [`Fleet::watch`],
//! [`Fleet::aggregate`]) has this shape: a [`FleetRun`] of
//! [`FleetEvent`]s, each target's answers as they arrive, its retries
//! ([`FleetEvent::Retrying`]), then its one [`TargetReport`]: the error it
//! failed with, if it did (whose `code()` is the status code or the
//! transport failure's), what it sent, whether a dump read the map to the
//! end, its resumes, its last cursor, its time. A failed target never stops
//! the others. Every target gets a connection of its own (made when its turn
//! comes, so a stuck target never holds another's HTTP/2 flow-control
//! window) and retries as the [`RetryPolicy`] of the fleet's
//! [`ConnectOptions`] says. [`FleetOptions`] sets the targets in flight at
//! once (32), the time for a target to connect and answer (5 s), the
//! longest wait for a dump's next chunk (30 s) and a deadline for the run.
//! Dropping the run closes every connection and stops every call on the
//! daemons. [`FleetDumpOptions`] (and [`FleetWatchOptions`]) give each
//! target a cursor of its own to resume from, and
//! [`FleetDumpOptions::with_types`] each chunk with its target's
//! [`MapTypes`], read by a GetMap sent beside the dump on the same
//! connection. With latency, as across a network, the targets overlap: 25
//! daemons behind a 5 ms delay each way take 75 ms at concurrency 32,
//! against 0.95 s one after the other.
//!
//! A fleet behind a bpfmap-relay ([`Fleet::via_relay`]) answers the same
//! calls with the same runs: each is one call to the relay, which reaches
//! the daemons, resumes their dumps and watches and merges aggregates.
//!
//! # Queries where the map lives
//!
//! ```no_run
//! # async fn demo() -> Result<(), bpfmap_client::Error> {
//! use bpfmap_client::{
//!     Aggregate, AggregateOptions, Client, ConnectOptions, DumpOptions, Fleet,
//!     FleetAggregateOptions, MapName, Target,
//! };
//!
//! let client = Client::connect("http://127.0.0.1:50051", ConnectOptions::default()).await?;
//! let map: MapName = "demo/flows".parse()?;
//! // Only the matching entries, only two members of each.
//! let options = DumpOptions::default()
//!     .with_filter("key.dport == 443 && value.bytes > 1000000")
//!     .with_fields(["key.daddr", "value.bytes"]);
//! let mut dump = client.dump(&map, options);
//! while let Some(chunk) = dump.next_chunk().await? {
//!     let types = dump.projection().expect("described").types_with([("key.daddr", "ipv4")])?;
//!     for entry in &chunk {
//!         println!("{:?} {:?}", types.decode_key(entry.key), types.decode_value(entry.value));
//!     }
//! }
//! println!("{} of {} entries", dump.received(), dump.summary().map_or(0, |s| s.entries_scanned()));
//! // The five destinations with the most bytes, on one host ...
//! let top = AggregateOptions::default()
//!     .with_group_by(["key.daddr"])
//!     .with_aggregate(Aggregate::sum("value.bytes"))
//!     .with_aggregate(Aggregate::count())
//!     .with_limit(5);
//! for group in client.aggregate(&map, top.clone()).await?.groups() {
//!     println!("{:?}: {:?}", group.key(), group.values());
//! }
//! // ... and on many, exactly (the three-phase threshold top K).
//! let targets: Vec<Target> = vec!["10.0.0.7:50051".parse()?, "10.0.0.8:50051".parse()?];
//! let fleet = Fleet::new(targets, ConnectOptions::default());
//! let result = fleet.aggregate(&map, FleetAggregateOptions::default().with_aggregate(top)).await;
//! for g in &result.groups {
//!     println!("{:?}: {:?} on {} hosts", g.group.key(), g.group.values(), g.hosts.len());
//! }
//! println!("{}, missing: {:?}", result.method.as_str(), result.missing);
//! # Ok(()) }
//! ```
//!
//! Errors keep what caused them: [`Error::code`] is the gRPC code whatever
//! the error (the status's, DEADLINE_EXCEEDED for a target that did not
//! answer in time, ...), [`Error::status`] the status itself, and
//! [`source`](std::error::Error::source) the transport errors behind it.
#![forbid(unsafe_code)]
#![warn(missing_docs)]

mod aggregate;
pub mod bpftrace;
mod chunk;
mod client;
mod connect;
#[cfg(feature = "discovery")]
mod discovery;
mod drain;
mod error;
mod fleet;
mod fleet_aggregate;
mod fleet_watch;
mod histogram;
mod lookup;
mod map;
pub mod pprof;
mod relay;
mod resume;
mod run;
mod stacks;
#[cfg(feature = "arrow")]
pub mod table;
mod target;
mod topk;
mod transport;
pub mod typed;
mod watch;

pub use aggregate::{
    Aggregate, AggregateOp, AggregateOptions, AggregateResult, AggregateSummary, Group,
    MAX_AGGREGATES,
};
/// How aggregate values (COUNT, SUM, MIN, MAX) combine, exactly: what
/// the daemons and [`Fleet::aggregate`] merge groups with.
pub use bpfmap_proto::aggregate as aggregate_values;
/// Histograms' arithmetic: the values a bucket of each layout counts.
pub use bpfmap_proto::histogram as histogram_math;
/// Stacks' folded form and merge.
pub use bpfmap_proto::stacks as stack_folding;
/// The canonical name of a gRPC code ("NOT_FOUND").
pub use bpfmap_proto::status::code_name;
/// The generated messages and gRPC stubs of `bpfmap.v1`, for what the
/// library's types do not cover (their `as_proto()` gives the message they
/// came in).
pub use bpfmap_proto::v1 as pb;
pub use chunk::{Chunk, Entry, EntryRef, Iter, PerCpuIter, PerCpuValues, Value, ValueRef};
pub use client::Client;
pub use connect::{ClientTls, ConnectOptions};
#[cfg(feature = "discovery")]
pub use discovery::{DiscoveryError, Resolver, TargetSpec};
pub use drain::{Drain, DrainChunk, DrainOptions};
pub use error::Error;
pub use fleet::{Fleet, FleetChunk, FleetDumpOptions, FleetOptions};
pub use fleet_aggregate::{
    DEFAULT_MAX_GROUPS, FleetAggregate, FleetAggregateOptions, FleetGroup, MergeMethod,
};
pub use fleet_watch::FleetWatchOptions;
pub use histogram::{FleetHistograms, HistogramLayout, HistogramOptions, Histograms};
pub use lookup::{Key, LookupOptions, LookupResult, PerCpu};
pub use map::{DumpMethod, InnerKey, ListMapsOptions, MapInfo, MapName};
pub use resume::{Dump, DumpOptions, DumpSummary, RetryPolicy};
pub use run::{FleetEvent, FleetRun, TargetReport};
pub use stacks::{FleetStacks, StackOptions, Stacks};
pub use target::Target;
pub use tonic::{Code, Status};
pub use typed::{MapTypes, Projection};
pub use watch::{Scan, Watch, WatchOptions};
