//! `dump`: entries to stdout, a summary per target to stderr, and the
//! cursor file that a later run resumes from.

use std::{collections::HashMap, io, path::Path};

use bpfmap_client::{
    DumpOptions, Fleet, FleetChunk, FleetDumpOptions, RetryPolicy, Target, TargetReport,
};
use serde_json::json;

use crate::{
    DumpArgs, Interrupted, TargetsFailed, code_and_text,
    cursors::{CursorFile, SavedTarget},
    drive::{End, Io, drive, interrupted},
    output::Format,
    output::{Printer, Progress},
    refused_render, render_pairs,
    setup::Setup,
    usage,
};

/// Each target's state as far as stdout goes: entries written, and the
/// cursor right after the last one (the summary and the cursor file resume
/// from there).
type Written = HashMap<Target, (u64, String)>;

/// Which targets to read and from where, after a cursor file.
#[derive(Debug)]
struct Start {
    /// Targets the file says finished: not read again.
    finished: Vec<Target>,
    /// Targets to read.
    targets: Vec<Target>,
    /// The cursors of the file.
    cursors: HashMap<Target, String>,
}

impl Start {
    fn new(targets: Vec<Target>, saved: Option<CursorFile>) -> Self {
        let saved: HashMap<Target, SavedTarget> = saved
            .map(|f| {
                f.targets
                    .into_iter()
                    .filter_map(|(t, s)| t.parse().ok().map(|t| (t, s)))
                    .collect()
            })
            .unwrap_or_default();
        let (finished, targets) = targets
            .into_iter()
            .partition(|t| saved.get(t).is_some_and(|s| s.done));
        let cursors = saved
            .into_iter()
            .filter(|(_, s)| !s.done && !s.cursor.is_empty())
            .map(|(t, s)| (t, s.cursor))
            .collect();
        Self {
            finished,
            targets,
            cursors,
        }
    }

    /// Every target to read, at its starting cursor.
    fn written(&self, cursor: Option<&str>) -> Written {
        self.targets
            .iter()
            .map(|t| {
                let c = self.cursors.get(t).map(String::as_str).or(cursor);
                (t.clone(), (0, c.unwrap_or_default().to_owned()))
            })
            .collect()
    }
}

/// `dump MAP`.
pub(crate) async fn run(
    setup: Setup,
    io: Io<'_>,
    args: DumpArgs,
    saved: Option<CursorFile>,
    terminal: bool,
) -> anyhow::Result<()> {
    check(&args, &setup.targets, saved.as_ref())?;
    if !args.render.is_empty() && !setup.decode {
        return Err(usage(
            "--render shows decoded members: it cannot be combined with --raw or --format hex",
        ));
    }
    let map = setup.map_name(&args.map)?;
    let Setup {
        targets,
        mut connect,
        options,
        mut printer,
        progress,
        decode,
        relay,
        ..
    } = setup;
    let total = targets.len();
    let start = Start::new(targets, saved);
    let mut written = start.written(args.cursor.as_deref());
    if args.no_resume {
        connect = connect.with_retry(RetryPolicy::never());
    }
    let fleet = match relay {
        Some(relay) => relay.with_targets(start.targets.clone()),
        None => Fleet::new(start.targets.clone(), connect),
    };
    let run = fleet
        .with_options(options)
        .dump(&map, dump_options(&args, &start, decode));
    printer.start_arrow(&args.map);
    let mut file = output_file(&args, printer.format(), terminal)?;
    let out: &mut dyn io::Write = match &mut file {
        Some(f) => f,
        None => &mut *io.out,
    };
    let (reports, end) = drive(run, &progress, interrupted(), |target, chunk| {
        write_chunk(&mut printer, out, &progress, &mut written, target, chunk)
    })
    .await;
    match &end {
        // Nothing more reaches stdout: what was written is what the
        // summaries say.
        End::Failed(_) => {
            let _ = out.flush();
        }
        End::Done | End::Stopped(_) => {
            printer.finish(out, io.err)?;
            out.flush()?
        }
    }
    progress.finish();
    let summary = Summary {
        map: &args.map,
        written,
        finished: start.finished,
        total,
    };
    let failed = summary.write(io.err, reports, args.save_cursor.as_deref())?;
    outcome(end, failed, &args, total)
}

/// How `dump` ends, once its summaries are written.
fn outcome(
    end: End,
    failed: Vec<TargetReport>,
    args: &DumpArgs,
    total: usize,
) -> anyhow::Result<()> {
    match end {
        End::Failed(e) => Err(e.into()),
        End::Stopped(signal) => Err(Interrupted(signal).into()),
        // Renderings a target's types refuse: the command line's (a
        // daemon's own are that target's failure).
        End::Done if !failed.is_empty() => {
            let refused = match args.render.is_empty() {
                true => None,
                false => refused_render(&failed, total),
            };
            Err(refused.unwrap_or_else(|| TargetsFailed(failed, total).into()))
        }
        End::Done => Ok(()),
    }
}

/// The file of `-o FILE`; `--format arrow` to a terminal is refused.
fn output_file(
    args: &DumpArgs,
    format: Format,
    terminal: bool,
) -> anyhow::Result<Option<io::BufWriter<std::fs::File>>> {
    match &args.output {
        Some(path) => {
            let file = std::fs::File::create(path)
                .map_err(|e| usage(format!("-o {}: {e}", path.display())))?;
            Ok(Some(io::BufWriter::with_capacity(256 << 10, file)))
        }
        None if format == Format::Arrow && terminal => Err(usage(
            "--format arrow writes a binary Arrow IPC stream: give -o FILE, or redirect stdout",
        )),
        None => Ok(None),
    }
}

/// Refuses what does not go together.
fn check(args: &DumpArgs, targets: &[Target], saved: Option<&CursorFile>) -> anyhow::Result<()> {
    if args.cursor.is_some() && targets.len() > 1 {
        return Err(usage(
            "--cursor resumes one target; for a fleet use --save-cursor and --resume",
        ));
    }
    if let Some(file) = saved
        && file.map != args.map
    {
        return Err(usage(format!(
            "the cursor file is for map {:?}, not {:?}",
            file.map, args.map
        )));
    }
    Ok(())
}

fn dump_options(args: &DumpArgs, start: &Start, decode: bool) -> FleetDumpOptions {
    let mut dump = DumpOptions::default()
        .with_chunk_size(args.chunk_size)
        .with_limit(args.limit)
        .with_render(render_pairs(&args.render))
        .with_fields(args.fields.iter().cloned());
    if let Some(filter) = &args.filter {
        dump = dump.with_filter(filter);
    }
    if let Some(cursor) = &args.cursor {
        dump = dump.with_cursor(cursor);
    }
    dump = match args.scan {
        crate::ScanArg::Auto => dump,
        crate::ScanArg::Kernel => dump.with_kernel_scan(),
        crate::ScanArg::Batched => dump.with_batched_scan(),
    };
    FleetDumpOptions::default()
        .with_dump(dump)
        .with_cursors(start.cursors.clone())
        // The types come with the chunks (GetMap beside the dump, on its
        // connection).
        .with_types(decode)
}

/// Writes one chunk's entries, and notes them as written.
fn write_chunk(
    printer: &mut Printer,
    out: &mut dyn io::Write,
    progress: &Progress,
    written: &mut Written,
    target: Target,
    answer: FleetChunk,
) -> io::Result<()> {
    match printer.arrow() {
        Some(arrow) => arrow.chunk(out, &target, &answer)?,
        None => match answer.types.as_deref() {
            Some(types) => printer.typed_entries(out, &target, &answer.chunk, types)?,
            None => {
                for e in &answer.chunk {
                    printer.typed_entry(out, &target, e, None)?;
                }
            }
        },
    }
    let n = answer.chunk.len() as u64;
    let w = written.entry(target).or_default();
    w.0 += n;
    answer.chunk.cursor().clone_into(&mut w.1);
    progress.entries(n);
    Ok(())
}

/// What a dump's summary is made of.
#[derive(Debug)]
struct Summary<'a> {
    map: &'a str,
    written: Written,
    finished: Vec<Target>,
    total: usize,
}

impl Summary<'_> {
    /// Writes one line per target (then totals for a fleet) to `err`, and
    /// the cursor file to `save`; returns the targets that failed.
    fn write(
        self,
        err: &mut dyn io::Write,
        reports: Vec<TargetReport>,
        save: Option<&Path>,
    ) -> anyhow::Result<Vec<TargetReport>> {
        let mut by_target: HashMap<Target, TargetReport> =
            reports.into_iter().map(|r| (r.target.clone(), r)).collect();
        let mut file = CursorFile {
            map: self.map.to_owned(),
            ..CursorFile::default()
        };
        let mut targets: Vec<&Target> = self.written.keys().collect();
        targets.sort();
        let (mut failed, mut entries, mut ok) = (Vec::new(), 0, 0);
        for t in targets {
            let (n, cursor) = &self.written[t];
            entries += n;
            let report = by_target.remove(t);
            let (line, done) = target_line(t, *n, cursor, report.as_ref());
            // One write per line: stderr is unbuffered, and a formatted
            // value would reach it in dozens of pieces.
            err.write_all(format!("{line}\n").as_bytes())?;
            let saved = SavedTarget {
                cursor: cursor.clone(),
                done,
            };
            file.targets.insert(t.to_string(), saved);
            match report {
                Some(r) if r.is_ok() => ok += 1,
                Some(r) => failed.push(r),
                None => {}
            }
        }
        for t in &self.finished {
            let saved = SavedTarget {
                cursor: String::new(),
                done: true,
            };
            file.targets.insert(t.to_string(), saved);
        }
        if self.total > 1 {
            let totals = json!({
                "targets": self.total,
                "ok": ok,
                "failed": failed.len(),
                "skipped": self.finished.len(),
                "entries": entries,
            });
            writeln!(err, "{totals}")?;
        }
        if let Some(path) = save {
            file.write(path)?;
        }
        Ok(failed)
    }
}

/// A target's summary line, and whether it read the map to the end.
fn target_line(
    t: &Target,
    n: u64,
    cursor: &str,
    report: Option<&TargetReport>,
) -> (serde_json::Value, bool) {
    let done = report.is_some_and(|r| r.is_ok() && r.complete);
    let mut line = json!({
        "target": t.as_str(),
        "entries": n,
        "complete": done,
        "resumes": report.map_or(0, |r| r.resumes),
        "cursor": cursor,
    });
    match report.map(|r| (r, &r.error)) {
        Some((_, None)) => line["code"] = json!("OK"),
        Some((_, Some(e))) => {
            let (code, text) = code_and_text(e);
            line["code"] = json!(code);
            line["error"] = json!(text);
        }
        None => line["code"] = json!("CANCELLED"),
    }
    if let Some(r) = report {
        line["elapsed_ms"] = json!(r.elapsed.as_millis() as u64);
    }
    (line, done)
}
