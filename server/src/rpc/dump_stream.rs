//! The response stream of DumpMap: the producer's chunks, then its error
//! as a status.

use std::{
    collections::VecDeque,
    future::Future as _,
    pin::Pin,
    sync::{Arc, atomic::Ordering},
    task::{Context, Poll},
};

use bpfmap_proto::v1 as pb;
use futures::Stream;
use tokio::sync::mpsc;
use tonic::Status;

use crate::{
    access,
    dump::{DumpStats, IN_TRANSPORT, Queued, Started, Tail},
    limits::{Reservation, Share, TrimGuard},
};

type Item = Result<pb::DumpMapResponse, Status>;

/// The response stream of a dump: the producer's chunks, then its error if
/// it failed. It owns the call's audit record, counts the entries handed to
/// the transport, and finishes the record when the stream ends or is dropped
/// (a client that went away before the end is CANCELLED). It keeps the
/// budget reservations of the last [`IN_TRANSPORT`] messages it handed over.
#[derive(Debug)]
pub(crate) struct DumpStream {
    rx: mpsc::Receiver<Queued>,
    tail: Option<Tail>,
    audit: Option<access::Record>,
    /// How the stream ended, once it has.
    ended: Option<tonic::Code>,
    held: VecDeque<Reservation>,
    /// Counts the dump as a call in flight until the stream is dropped.
    _trim: TrimGuard,
    /// The producer's share: told of every message taken, so that a
    /// producer waiting for room (or for an empty queue) looks again.
    share: Arc<Share>,
    stats: Arc<DumpStats>,
}

fn entries_in(msg: &pb::DumpMapResponse) -> u64 {
    msg.packed
        .as_ref()
        .map_or(msg.entries.len() as u64, |p| u64::from(p.count))
}

impl DumpStream {
    /// The stream of a started producer; it finishes `audit` when it ends,
    /// and counts the dump as a call in flight (`trim`) while it lives.
    pub(crate) fn new(
        started: Started,
        audit: access::Record,
        trim: TrimGuard,
        stats: Arc<DumpStats>,
    ) -> Self {
        Self {
            rx: started.rx,
            tail: Some(started.tail),
            audit: Some(audit),
            ended: None,
            held: VecDeque::new(),
            _trim: trim,
            share: started.share,
            stats,
        }
    }
}

impl Stream for DumpStream {
    type Item = Item;

    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Item>> {
        let this = self.get_mut();
        if this.ended.is_some() {
            this.held.clear();
            return Poll::Ready(None);
        }
        match this.rx.poll_recv(cx) {
            Poll::Pending => Poll::Pending,
            Poll::Ready(Some((msg, reservation))) => {
                this.share.wake();
                if let Some(r) = reservation {
                    this.held.push_back(r);
                    while this.held.len() > IN_TRANSPORT {
                        this.held.pop_front();
                    }
                }
                if let Some(a) = this.audit.as_mut() {
                    use prost::Message as _;
                    let n = entries_in(&msg);
                    a.add_entries(n);
                    this.stats.entries_sent.fetch_add(n, Ordering::Relaxed);
                    this.stats
                        .bytes_sent
                        .fetch_add(msg.encoded_len() as u64, Ordering::Relaxed);
                    if msg.done {
                        this.ended = Some(tonic::Code::Ok);
                    }
                }
                Poll::Ready(Some(Ok(msg)))
            }
            // The producer is done: its error, if any, follows.
            Poll::Ready(None) => {
                let Some(tail) = this.tail.as_mut() else {
                    return Poll::Ready(None);
                };
                match Pin::new(tail).poll(cx) {
                    Poll::Pending => Poll::Pending,
                    Poll::Ready(r) => {
                        this.tail = None;
                        match r {
                            Ok(e) => {
                                let status = Status::from(e);
                                this.ended = Some(status.code());
                                Poll::Ready(Some(Err(status)))
                            }
                            Err(_) => Poll::Ready(None),
                        }
                    }
                }
            }
        }
    }
}

impl Drop for DumpStream {
    fn drop(&mut self) {
        if let Some(a) = self.audit.take() {
            a.finish(self.ended.unwrap_or(tonic::Code::Cancelled));
        }
    }
}
