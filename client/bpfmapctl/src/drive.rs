//! The one event loop of every command: answers to the printer, reports to
//! the progress display, until the run ends, a signal stops it or stdout
//! fails.

use std::io;

use bpfmap_client::{FleetEvent, FleetRun, Target, TargetReport};
use futures::StreamExt as _;
use serde_json::json;

use crate::{TargetsFailed, code_and_text, output::Progress, refused_render};

/// Where a command writes: results to `out`, summaries to `err`.
pub(crate) struct Io<'a> {
    pub(crate) out: &'a mut dyn io::Write,
    pub(crate) err: &'a mut dyn io::Write,
}

/// How a run's events ended.
#[derive(Debug)]
pub(crate) enum End {
    /// Every target is done.
    Done,
    /// Stopped by a signal.
    Stopped(&'static str),
    /// An answer could not be written; nothing more was.
    Failed(io::Error),
}

/// Runs `run` to its end: each answer to `answer`, each report to
/// `progress` and into the reports returned. Stops at `stop` (a signal's
/// name), or at the first answer that cannot be written. The run is dropped
/// on return, which cancels what is left of it.
pub(crate) async fn drive<T>(
    mut run: FleetRun<T>,
    progress: &Progress,
    stop: impl Future<Output = &'static str>,
    mut answer: impl FnMut(Target, T) -> io::Result<()>,
) -> (Vec<TargetReport>, End) {
    let mut reports = Vec::new();
    let mut stop = std::pin::pin!(stop);
    loop {
        let event = tokio::select! {
            e = run.next() => e,
            signal = &mut stop => return (reports, End::Stopped(signal)),
        };
        match event {
            None => return (reports, End::Done),
            Some(FleetEvent::Answer { target, answer: a }) => {
                if let Err(e) = answer(target, a) {
                    return (reports, End::Failed(e));
                }
            }
            Some(FleetEvent::Retrying { target, error }) => {
                progress.say(&match error.status() {
                    Some(s) if s.code() == bpfmap_client::Code::ResourceExhausted => format!(
                        "{target}: the daemon is busy ({}); waiting for a slot",
                        s.message()
                    ),
                    _ => format!("{target}: {error}; retrying"),
                });
            }
            Some(FleetEvent::Done(r)) => {
                progress.done(&r);
                reports.push(r);
            }
            Some(_) => {}
        }
    }
}

/// Ends a command that is not a dump: one line on stderr per target that
/// failed (and totals for a fleet); an error when any did.
pub(crate) fn finish(
    io: Io<'_>,
    progress: &Progress,
    reports: Vec<TargetReport>,
    end: End,
) -> anyhow::Result<()> {
    if let End::Failed(e) = end {
        return Err(e.into());
    }
    progress.finish();
    io.out.flush()?;
    let total = reports.len();
    let failed: Vec<TargetReport> = reports.into_iter().filter(|r| !r.is_ok()).collect();
    for r in &failed {
        let (code, text) = r.error.as_ref().map(code_and_text).unwrap_or_default();
        let line = json!({"target": r.target.as_str(), "code": code, "error": text});
        io.err.write_all(format!("{line}\n").as_bytes())?;
    }
    if total > 1 {
        writeln!(
            io.err,
            "{}",
            json!({"targets": total, "ok": total - failed.len(), "failed": failed.len()})
        )?;
    }
    if failed.is_empty() {
        Ok(())
    } else {
        Err(refused_render(&failed, total).unwrap_or_else(|| TargetsFailed(failed, total).into()))
    }
}

/// Resolves when the process gets SIGINT or SIGTERM, with the signal's name.
pub(crate) async fn interrupted() -> &'static str {
    use tokio::signal::unix::{SignalKind, signal};
    match (
        signal(SignalKind::interrupt()),
        signal(SignalKind::terminate()),
    ) {
        (Ok(mut int), Ok(mut term)) => tokio::select! {
            _ = int.recv() => "SIGINT",
            _ = term.recv() => "SIGTERM",
        },
        _ => std::future::pending().await,
    }
}
