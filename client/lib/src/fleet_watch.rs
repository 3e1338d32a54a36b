//! A fleet's watch: one [`Watch`](crate::Watch) per target, each from its
//! own cursor, their scans yielded as one [`FleetRun`] of [`Scan`]s.
//!
//! A watch never ends by itself, so a target holds its place among the
//! targets started at once ([`FleetOptions::with_concurrency`]) only until
//! its first scan or failure. Each target's watch resumes by itself as
//! [`RetryPolicy`] says; when that gives up on a failure that can be
//! retried (the daemon is down, a frozen host gave no first scan within
//! the answer timeout), the target is reported [`FleetEvent::Retrying`]
//! and watched again from its last cursor after the policy's longest
//! delay, for as long as the run lasts (its deadline, if any). A map that
//! was replaced (ABORTED) is watched again from its state. A failure that
//! cannot be retried (INVALID_ARGUMENT, PERMISSION_DENIED, NOT_FOUND, a map
//! too large to watch) ends the target with its report.
//!
//! [`FleetOptions::with_concurrency`]: crate::FleetOptions::with_concurrency
//! [`RetryPolicy`]: crate::RetryPolicy
//! [`FleetEvent::Retrying`]: crate::FleetEvent::Retrying

use std::{collections::HashMap, sync::Arc, time::Duration};

use tonic::Code;

use crate::{
    Client, Error, Fleet, FleetRun, MapName, RetryPolicy, Scan, Target, WatchOptions, pb,
    relay::{Deadline, RelayLink, Run},
    run::Answers,
};

/// Options of a fleet watch ([`Fleet::watch`]).
#[derive(Debug, Clone, Default)]
#[non_exhaustive]
pub struct FleetWatchOptions {
    pub(crate) watch: WatchOptions,
    pub(crate) cursors: HashMap<Target, String>,
}

impl FleetWatchOptions {
    /// Every target's watch (its cursor is for the targets without one of
    /// their own).
    pub fn with_watch(mut self, watch: WatchOptions) -> Self {
        self.watch = watch;
        self
    }

    /// Each target resumes after its own cursor (a
    /// [`TargetReport::cursor`](crate::TargetReport::cursor) or a scan's
    /// [`Scan::cursor`] of an earlier run); the others start from their
    /// watch's cursor, if any.
    pub fn with_cursors(mut self, cursors: impl IntoIterator<Item = (Target, String)>) -> Self {
        self.cursors.extend(cursors);
        self
    }
}

impl Fleet {
    /// Watches `map` on every target, each from its own cursor: each
    /// target's scans as they come ([`FleetRun::next_round`] gathers one
    /// round of every target's), its failures as
    /// [`FleetEvent::Retrying`](crate::FleetEvent::Retrying) while it is
    /// watched again, its report when its watch ends. A target holds its
    /// place among those started at once
    /// ([`FleetOptions::with_concurrency`](crate::FleetOptions::with_concurrency))
    /// only until its first scan or failure; each resumes as the fleet's
    /// [`RetryPolicy`] says, then, on a failure that can be retried (its
    /// daemon is down, a first scan did not come within the answer
    /// timeout), is watched again from its last cursor after the policy's
    /// longest delay, for as long as the run lasts (its deadline, if any);
    /// a map that was replaced (ABORTED) is watched again from its state.
    /// A failure that cannot be retried (INVALID_ARGUMENT,
    /// PERMISSION_DENIED, NOT_FOUND, a map too large to watch) ends the
    /// target.
    pub fn watch(&self, map: &MapName, options: FleetWatchOptions) -> FleetRun<Scan> {
        if let Some(relay) = self.relay.as_ref().filter(|_| !self.targets().is_empty()) {
            return via_relay(relay, self, map, options);
        }
        let mut plan = self.plan();
        plan.release_on_answer = true;
        let first = self.options().answer_timeout();
        let (map, options) = (map.clone(), Arc::new(options));
        plan.run(move |client, answers| {
            let target = TargetWatch {
                client,
                answers,
                map: map.clone(),
                first,
            };
            target.run(options.clone())
        })
    }
}

/// One target's part of a fleet watch: its client, where its scans go, the
/// map, and how long its first scan may take.
struct TargetWatch {
    client: Client,
    answers: Answers<Scan>,
    map: MapName,
    first: Duration,
}

impl TargetWatch {
    /// Watches until a failure that cannot be retried.
    async fn run(self, options: Arc<FleetWatchOptions>) -> Result<(), Error> {
        let (client, answers) = (&self.client, &self.answers);
        let mut watch_options = options.watch.clone();
        if let Some(c) = options.cursors.get(&answers.target) {
            watch_options = watch_options.with_cursor(c.clone());
        }
        let pause = client.retry().max_delay();
        let mut resumes = 0u32;
        loop {
            let start = watch_options.cursor().to_owned();
            answers.update(|p| p.cursor.clone_from(&start));
            let error = self.scans(&watch_options, resumes).await;
            let code = error.code();
            let retry = code == Code::Aborted
                || code == Code::DeadlineExceeded
                || error.status().is_some_and(RetryPolicy::should_retry);
            if !retry {
                return Err(error);
            }
            answers.retrying(error).await;
            resumes += 1;
            // The map was replaced: watch the new one from its state.
            let cursor = if code == Code::Aborted {
                String::new()
            } else {
                answers.cursor()
            };
            watch_options = watch_options.with_cursor(cursor);
            tokio::time::sleep(pause).await;
        }
    }

    /// Sends the scans of one watch (with `options`) until it fails: the
    /// failure.
    async fn scans(&self, options: &WatchOptions, resumed: u32) -> Error {
        let mut watch = self.client.watch(&self.map, options.clone());
        let mut wait = Some(self.first);
        loop {
            let next = match wait {
                Some(w) => match tokio::time::timeout(w, watch.next_scan()).await {
                    Ok(next) => next,
                    Err(_) => {
                        return Error::Timeout {
                            after: w,
                            retrying: watch.last_failure().cloned(),
                        };
                    }
                },
                None => watch.next_scan().await,
            };
            let scan = match next {
                Ok(scan) => scan,
                Err(e) => return e,
            };
            wait = None;
            let b = scan.bookmark();
            let (events, scanned) = (
                (scan.events().len() + scan.groups().len()) as u64,
                b.entries_scanned,
            );
            let cursor = scan.cursor().to_owned();
            let resumes = resumed + watch.resumes();
            self.answers.update(|p| {
                p.entries += events;
                p.scanned += scanned;
                p.calls += 1;
                p.cursor = cursor;
                p.resumes = resumes;
            });
            if !self.answers.send(scan).await {
                return tonic::Status::cancelled("the run was dropped").into();
            }
        }
    }
}

/// A fleet watch through the relay.
fn via_relay(
    link: &RelayLink,
    fleet: &Fleet,
    map: &MapName,
    options: FleetWatchOptions,
) -> FleetRun<Scan> {
    let first = pb::FleetServiceWatchMapRequest {
        request: Some(options.watch.request(map, "")),
        targets: RelayLink::selector(fleet.targets()),
        cursor: String::new(),
        target_cursors: options
            .cursors
            .iter()
            .map(|(t, c)| (t.as_str().to_owned(), c.clone()))
            .collect(),
    };
    let (client, targets) = (link.client.clone(), fleet.targets().to_vec());
    let deadline = Deadline::start(fleet.options().deadline());
    FleetRun::spawn(targets.clone(), 16, move |tx| async move {
        let mut run = Run::new(targets, tx);
        let call = move |resume: String, d: Deadline| {
            let mut req = first.clone();
            if !resume.is_empty() {
                (req.cursor, req.target_cursors) = (resume, HashMap::new());
            }
            let mut client = client.clone();
            async move { client.watch_map(d.request(req)).await }
        };
        let mut parts: HashMap<String, Vec<pb::WatchMapResponse>> = HashMap::new();
        run.drive(deadline, call, |run, msg| {
            run.watch_message(msg, &mut parts)
        })
        .await;
    })
}
