//! A response stream fed by a task of its own (WatchMap, DrainMap): its
//! messages through a small bounded channel, then the status the task ended
//! with. The task waits for room at most the stall timeout.

use std::{
    pin::Pin,
    sync::{Arc, Mutex},
    task::{Context, Poll},
    time::Duration,
};

use futures::Stream;
use tokio::sync::mpsc;
use tonic::{Code, Status};

use crate::error::Error;

/// How the stream ended, when not by its client.
type End = Arc<Mutex<Option<Status>>>;

/// The task's side.
#[derive(Debug)]
pub(crate) struct Feed<T> {
    tx: mpsc::Sender<T>,
    end: End,
}

/// The response stream: the messages, then the task's status.
#[derive(Debug)]
pub(crate) struct Fed<T> {
    rx: mpsc::Receiver<T>,
    end: End,
    done: bool,
}

/// A feed and its stream, `depth` messages queued beyond the one being
/// sent.
pub(crate) fn channel<T>(depth: usize) -> (Feed<T>, Fed<T>) {
    let (tx, rx) = mpsc::channel(depth);
    let end = End::default();
    (
        Feed {
            tx,
            end: end.clone(),
        },
        Fed {
            rx,
            end,
            done: false,
        },
    )
}

impl<T> Feed<T> {
    /// Queues a message, waiting at most `stall` for room: Cancelled when
    /// the client went away, Stalled when it took nothing for that long.
    pub(crate) async fn send(&self, msg: T, stall: Duration) -> Result<(), Error> {
        match self.tx.send_timeout(msg, stall).await {
            Ok(()) => Ok(()),
            Err(mpsc::error::SendTimeoutError::Closed(_)) => Err(Error::Cancelled),
            Err(mpsc::error::SendTimeoutError::Timeout(_)) => Err(Error::Stalled {
                secs: stall.as_secs(),
            }),
        }
    }

    /// Resolves when the client has gone away.
    pub(crate) async fn closed(&self) {
        self.tx.closed().await;
    }

    /// Ends the stream with the task's result (an error becomes the
    /// stream's status); the code, for the audit log (`ok`: what a result
    /// of `Ok` means for this call).
    pub(crate) fn finish(self, result: Result<(), Error>, ok: Code) -> Code {
        match result {
            Ok(()) => ok,
            Err(e) => {
                let status = Status::from(e);
                let code = status.code();
                *self.end.lock().expect("feed end") = Some(status);
                code
            }
        }
    }
}

impl<T> Stream for Fed<T> {
    type Item = Result<T, Status>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        if self.done {
            return Poll::Ready(None);
        }
        match self.rx.poll_recv(cx) {
            Poll::Ready(Some(m)) => Poll::Ready(Some(Ok(m))),
            Poll::Ready(None) => {
                self.done = true;
                let end = self.end.lock().expect("feed end").take();
                Poll::Ready(end.map(Err))
            }
            Poll::Pending => Poll::Pending,
        }
    }
}
