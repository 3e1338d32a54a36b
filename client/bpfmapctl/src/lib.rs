//! The `bpfmapctl` command line: read eBPF maps from one bpfmapd or a whole
//! fleet. A library so that the tests can run it in-process; `main.rs` is the
//! binary.
#![forbid(unsafe_code)]

mod output;

use std::{
    collections::{BTreeMap, HashMap},
    io::{self, IsTerminal as _},
    path::PathBuf,
    time::Duration,
};

use anyhow::Context as _;
use bpfmap_client::{
    ClientTls, ConnectOptions, DumpOptions, Fleet, FleetEvent, FleetOptions, MapName, MapTypes,
    Resolver, RetryPolicy, Target, TargetReport, TargetSpec, TypedChunk, code_name,
};
use clap::{Parser, Subcommand};
use futures::StreamExt as _;
use serde_json::json;

use crate::output::{Format, PerCpu, Printer};

/// Read eBPF maps from bpfmapd daemons: one (--addr) or many (--target,
/// --targets-file, DNS). Output lines carry their target.
///
/// Exit codes: 0 every target answered OK; 1 some targets failed (a summary
/// on stderr names each and its error); 2 a usage or configuration error;
/// 130 a dump stopped by SIGINT or SIGTERM (its summary says where to
/// resume).
#[derive(Debug, Parser)]
#[command(name = "bpfmapctl", version)]
pub struct Cli {
    /// The daemon, when no --target is given.
    #[arg(
        long,
        short = 'a',
        env = "BPFMAP_ADDR",
        default_value = "http://127.0.0.1:50051"
    )]
    pub addr: String,
    /// A daemon (repeatable): HOST:PORT, dns:NAME:PORT (every A and AAAA
    /// record of NAME) or srv:NAME (its SRV records).
    #[arg(long = "target", short = 't', value_name = "SPEC", global = true)]
    pub targets: Vec<String>,
    /// A file of targets, one spec per line (# starts a comment).
    #[arg(long, value_name = "FILE", global = true)]
    pub targets_file: Option<PathBuf>,
    /// The name server for dns: and srv: targets (default: the system's).
    #[arg(long, value_name = "ADDR", global = true)]
    pub dns_server: Option<std::net::SocketAddr>,
    /// CA bundle (PEM) for the servers' certificates; enables mutual TLS
    /// together with --cert and --key.
    #[arg(long, env = "BPFMAP_CA", requires_all = ["cert", "key"])]
    pub ca: Option<PathBuf>,
    /// This client's certificate (PEM).
    #[arg(long, env = "BPFMAP_CERT", requires = "ca")]
    pub cert: Option<PathBuf>,
    /// This client's private key (PEM).
    #[arg(long, env = "BPFMAP_KEY", requires = "ca")]
    pub key: Option<PathBuf>,
    /// Name every server certificate must carry (default: the target's
    /// host).
    #[arg(long)]
    pub server_name: Option<String>,
    /// Targets in flight at once.
    #[arg(long, default_value_t = 32, value_parser = clap::value_parser!(u32).range(1..), global = true)]
    pub concurrency: u32,
    /// Seconds for a target to connect and give its first answer.
    #[arg(long, default_value_t = 5.0, value_name = "SECS", global = true)]
    pub connect_timeout: f64,
    /// Seconds for the whole run; targets still going then fail.
    #[arg(long, value_name = "SECS", global = true)]
    pub deadline: Option<f64>,
    /// Output format [default: table on a terminal, json otherwise].
    #[arg(long, value_enum, global = true)]
    pub format: Option<Format>,
    /// Per-CPU values: one per CPU, or summed (integers of 1, 2, 4 or 8
    /// bytes, little-endian, printed in decimal).
    #[arg(long, value_enum, default_value_t = PerCpu::List, global = true)]
    pub per_cpu: PerCpu,
    /// Keys and values as hex even when the map has types (BTF); by default
    /// they are decoded as the program declared them.
    #[arg(long, global = true)]
    pub raw: bool,
    /// What to do.
    #[command(subcommand)]
    pub command: Command,
}

/// The subcommands.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// List the maps each daemon exposes.
    List,
    /// Describe one map on each daemon (NOT_FOUND where it is absent).
    Show {
        /// Map path relative to the daemon's root ("demo/flows"), or "id:N".
        map: String,
    },
    /// Dump a map's entries. A summary per target (with the cursor to
    /// resume from) goes to stderr.
    Dump {
        /// Map path relative to the daemon's root ("demo/flows"), or "id:N".
        map: String,
        /// Entries per chunk (server default when 0).
        #[arg(long, default_value_t = 0)]
        chunk_size: u32,
        /// Stop after this many entries per target (0 = all).
        #[arg(long, default_value_t = 0)]
        limit: u64,
        /// Resume after this cursor (one target only; from an earlier
        /// summary).
        #[arg(long, allow_hyphen_values = true)]
        cursor: Option<String>,
        /// Do not resume automatically when a stream breaks.
        #[arg(long)]
        no_resume: bool,
        /// Write every target's cursor (and whether it finished) to FILE at
        /// the end, also when stopped or failing.
        #[arg(long, value_name = "FILE")]
        save_cursor: Option<PathBuf>,
        /// Continue from a file written by --save-cursor: each target from
        /// its own cursor; targets that finished are skipped. Without
        /// --target, the file's targets.
        #[arg(long, value_name = "FILE")]
        resume: Option<PathBuf>,
    },
    /// Look keys up in a map on each daemon; absent keys print
    /// "found": false.
    Lookup {
        /// Map path relative to the daemon's root ("demo/flows"), or "id:N".
        map: String,
        /// Keys: hex strings of exactly the map's key size, or JSON through
        /// the map's key type (an argument starting with `{`, `[` or `"`,
        /// or any JSON after `json:`), e.g.
        /// '{"saddr":167772160,"daddr":3232235521,"sport":1024,"dport":443,"proto":"IPPROTO_TCP"}'.
        #[arg(required = true)]
        keys: Vec<String>,
    },
}

/// Whether stdout and stderr are terminals (the output format and the
/// progress display follow).
#[derive(Debug, Clone, Copy, Default)]
pub struct Terminals {
    /// stdout is a terminal.
    pub stdout: bool,
    /// stderr is a terminal.
    pub stderr: bool,
}

/// Some targets failed; the summary on stderr names them.
#[derive(Debug, thiserror::Error)]
#[error("{}", describe(.0, *.1))]
pub struct TargetsFailed(pub Vec<TargetReport>, pub usize);

fn describe(failed: &[TargetReport], total: usize) -> String {
    match failed {
        [one] if total == 1 => format!("{}: {}", code_name(one.code), one.message),
        _ => format!("{} of {total} targets failed", failed.len()),
    }
}

/// A usage or configuration error (exit code 2).
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct Usage(pub String);

/// The dump was stopped by SIGINT or SIGTERM (the summary says where to
/// resume).
#[derive(Debug, thiserror::Error)]
#[error("stopped by {0}")]
pub struct Interrupted(pub &'static str);

/// Runs bpfmapctl as the `bpfmapctl` binary does; see [`Cli`] for the exit
/// codes.
pub fn main() -> std::process::ExitCode {
    use std::{io::Write as _, process::ExitCode};
    let cli = Cli::parse();
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(r) => r,
        Err(e) => {
            eprintln!("bpfmapctl: cannot start the runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    let terminals = Terminals {
        stdout: io::stdout().is_terminal(),
        stderr: io::stderr().is_terminal(),
    };
    let stdout = io::stdout();
    let mut out = io::BufWriter::with_capacity(256 << 10, stdout.lock());
    let result = runtime.block_on(run_with(cli, &mut out, &mut io::stderr(), terminals));
    // Whatever happened, what was printed reaches stdout before exiting.
    let flushed = out.flush();
    let result = result.and_then(|()| flushed.map_err(Into::into));
    match result {
        Ok(()) => ExitCode::SUCCESS,
        // A closed pipe (`| head`) is not an error.
        Err(e)
            if e.downcast_ref::<io::Error>()
                .is_some_and(|io| io.kind() == io::ErrorKind::BrokenPipe) =>
        {
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("bpfmapctl: {e:#}");
            if e.is::<Interrupted>() {
                ExitCode::from(130)
            } else if e.is::<Usage>() {
                ExitCode::from(2)
            } else {
                ExitCode::FAILURE
            }
        }
    }
}

/// Runs one command as if neither stdout nor stderr were a terminal.
pub async fn run(cli: Cli, out: &mut dyn io::Write, err: &mut dyn io::Write) -> anyhow::Result<()> {
    run_with(cli, out, err, Terminals::default()).await
}

/// Resolves when the process gets SIGINT or SIGTERM, with the signal's name.
async fn interrupted() -> &'static str {
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

fn usage(message: impl Into<String>) -> anyhow::Error {
    Usage(message.into()).into()
}

/// What --save-cursor writes and --resume reads.
#[derive(Debug, Default, serde::Serialize, serde::Deserialize)]
struct CursorFile {
    map: String,
    targets: BTreeMap<String, SavedTarget>,
}

#[derive(Debug, Default, Clone, serde::Serialize, serde::Deserialize)]
struct SavedTarget {
    cursor: String,
    done: bool,
}

fn read_specs(cli: &Cli) -> anyhow::Result<Vec<TargetSpec>> {
    let mut lines: Vec<String> = cli.targets.clone();
    if let Some(file) = &cli.targets_file {
        let text = std::fs::read_to_string(file)
            .map_err(|e| usage(format!("cannot read {}: {e}", file.display())))?;
        for line in text.lines() {
            let line = line.split('#').next().unwrap_or("").trim();
            if !line.is_empty() {
                lines.push(line.to_owned());
            }
        }
    }
    lines
        .iter()
        .map(|s| s.parse::<TargetSpec>().map_err(|e| usage(e.to_string())))
        .collect()
}

async fn resolve(cli: &Cli, specs: &[TargetSpec]) -> anyhow::Result<Vec<Target>> {
    let needs_dns = specs.iter().any(|s| !matches!(s, TargetSpec::Addr(_)));
    if !needs_dns {
        return Ok(specs
            .iter()
            .filter_map(|s| match s {
                TargetSpec::Addr(t) => Some(t.clone()),
                _ => None,
            })
            .collect());
    }
    let resolver = match cli.dns_server {
        Some(addr) => Resolver::with_name_server(addr),
        None => Resolver::system(),
    }
    .map_err(|e| usage(e.to_string()))?;
    resolver
        .resolve(specs)
        .await
        .map_err(|e| usage(format!("cannot find the targets: {e}")))
}

fn seconds(what: &str, s: f64) -> anyhow::Result<Duration> {
    Duration::try_from_secs_f64(s)
        .ok()
        .filter(|d| !d.is_zero())
        .ok_or_else(|| {
            usage(format!(
                "{what} must be a positive number of seconds, not {s}"
            ))
        })
}

/// Runs one command, writing results to `out` and summaries to `err`.
pub async fn run_with(
    cli: Cli,
    out: &mut dyn io::Write,
    err: &mut dyn io::Write,
    terminals: Terminals,
) -> anyhow::Result<()> {
    let tls = match (&cli.ca, &cli.cert, &cli.key) {
        (Some(ca), Some(cert), Some(key)) => Some(ClientTls {
            server_name: cli.server_name.clone(),
            ..ClientTls::from_files(ca, cert, key).map_err(|e| usage(e.to_string()))?
        }),
        _ => None,
    };
    let mut resume_file = None;
    if let Command::Dump {
        resume: Some(path), ..
    } = &cli.command
    {
        let text = std::fs::read_to_string(path)
            .map_err(|e| usage(format!("cannot read {}: {e}", path.display())))?;
        let file: CursorFile = serde_json::from_str(&text)
            .map_err(|e| usage(format!("{} is not a cursor file: {e}", path.display())))?;
        resume_file = Some(file);
    }
    let specs = read_specs(&cli)?;
    let targets = if !specs.is_empty() {
        resolve(&cli, &specs).await?
    } else if let Some(file) = &resume_file {
        file.targets
            .keys()
            .map(|t| {
                t.parse()
                    .map_err(|e: bpfmap_client::Error| usage(e.to_string()))
            })
            .collect::<anyhow::Result<_>>()?
    } else {
        vec![
            cli.addr
                .parse()
                .map_err(|e: bpfmap_client::Error| usage(e.to_string()))?,
        ]
    };
    if targets.is_empty() {
        return Err(usage("no targets"));
    }
    let connect = ConnectOptions {
        tls,
        connect_timeout: seconds("--connect-timeout", cli.connect_timeout)?,
    };
    let mut options = FleetOptions {
        concurrency: cli.concurrency as usize,
        connect_timeout: connect.connect_timeout,
        deadline: cli.deadline.map(|d| seconds("--deadline", d)).transpose()?,
        ..FleetOptions::default()
    };
    let format = cli.format.unwrap_or(if terminals.stdout {
        Format::Table
    } else {
        Format::Json
    });
    let width = targets.iter().map(|t| t.as_str().len()).max().unwrap_or(0);
    let mut printer = Printer::new(format, cli.per_cpu, width);
    let total = targets.len();
    let progress = output::Progress::new(terminals.stderr, total);
    let map_name = |m: &str| m.parse::<MapName>().map_err(|e| usage(e.to_string()));
    let reports = match cli.command {
        Command::List => {
            let fleet = Fleet::new(targets, connect).with_options(options);
            let mut run = fleet.list_maps();
            let mut reports = Vec::new();
            while let Some(event) = run.next().await {
                match event {
                    FleetEvent::Answer { target, answer } => {
                        printer.maps(out, &target, &answer)?;
                    }
                    FleetEvent::Done(r) => {
                        progress.done(&r);
                        reports.push(r);
                    }
                }
            }
            reports
        }
        Command::Show { map } => {
            let map = map_name(&map)?;
            let fleet = Fleet::new(targets, connect).with_options(options);
            let mut run = fleet.get_map(&map);
            let mut reports = Vec::new();
            while let Some(event) = run.next().await {
                match event {
                    FleetEvent::Answer { target, answer } => {
                        printer.maps(out, &target, std::slice::from_ref(&answer))?;
                    }
                    FleetEvent::Done(r) => {
                        progress.done(&r);
                        reports.push(r);
                    }
                }
            }
            reports
        }
        Command::Lookup { map, keys } => {
            let map = map_name(&map)?;
            let mut request = bpfmap_client::pb::LookupRequest {
                map: Some((&map).into()),
                raw: true,
                ..Default::default()
            };
            for k in &keys {
                match json_key(k) {
                    Some(json) => request.json_keys.push(json.map_err(usage)?),
                    None => request
                        .keys
                        .push(output::unhex(k).map_err(|e| usage(e.to_string()))?),
                }
            }
            let fleet = Fleet::new(targets, connect).with_options(options);
            let types = if cli.raw || format == Format::Hex {
                HashMap::new()
            } else {
                map_types(&fleet, &map).await
            };
            let mut run = fleet.lookup_request(request);
            let mut reports = Vec::new();
            while let Some(event) = run.next().await {
                match event {
                    FleetEvent::Answer { target, answer } => {
                        let types = types.get(&target);
                        for r in &answer {
                            printer.typed_lookup(out, &target, r, types)?;
                        }
                    }
                    FleetEvent::Done(r) => {
                        progress.done(&r);
                        reports.push(r);
                    }
                }
            }
            reports
        }
        Command::Dump {
            map,
            chunk_size,
            limit,
            cursor,
            no_resume,
            save_cursor,
            resume: _,
        } => {
            if cursor.is_some() && targets.len() > 1 {
                return Err(usage(
                    "--cursor resumes one target; for a fleet use --save-cursor and --resume",
                ));
            }
            if let Some(file) = &resume_file
                && file.map != map
            {
                return Err(usage(format!(
                    "the cursor file is for map {:?}, not {map:?}",
                    file.map
                )));
            }
            let map_ref = map_name(&map)?;
            if no_resume {
                options.retry = RetryPolicy::never();
            }
            let saved: HashMap<Target, SavedTarget> = resume_file
                .map(|f| {
                    f.targets
                        .into_iter()
                        .filter_map(|(t, s)| t.parse().ok().map(|t| (t, s)))
                        .collect()
                })
                .unwrap_or_default();
            // Targets that finished before are not read again.
            let (finished, targets): (Vec<Target>, Vec<Target>) = targets
                .into_iter()
                .partition(|t| saved.get(t).is_some_and(|s| s.done));
            let cursors: HashMap<Target, String> = saved
                .iter()
                .filter(|(_, s)| !s.done && !s.cursor.is_empty())
                .map(|(t, s)| (t.clone(), s.cursor.clone()))
                .collect();
            let fleet = Fleet::new(targets.clone(), connect).with_options(options);
            let typed = !(cli.raw || format == Format::Hex);
            let dump_options = DumpOptions {
                chunk_size,
                limit,
                cursor,
                packed: true,
            };
            // Each target's state as far as stdout goes: the summary and the
            // cursor file resume right after the last line written.
            let mut written: HashMap<Target, (u64, String)> = targets
                .iter()
                .map(|t| {
                    let c = cursors
                        .get(t)
                        .cloned()
                        .or_else(|| dump_options.cursor.clone())
                        .unwrap_or_default();
                    (t.clone(), (0, c))
                })
                .collect();
            let mut reports = Vec::new();
            let mut stop = std::pin::pin!(interrupted());
            // The types come with the chunks (GetMap beside the dump, on its
            // connection).
            let mut run = if typed {
                fleet
                    .dump_typed_from(&map_ref, dump_options, cursors)
                    .boxed()
            } else {
                fleet
                    .dump_from(&map_ref, dump_options, cursors)
                    .map(|e| match e {
                        FleetEvent::Answer { target, answer } => FleetEvent::Answer {
                            target,
                            answer: TypedChunk {
                                chunk: answer,
                                types: None,
                            },
                        },
                        FleetEvent::Done(r) => FleetEvent::Done(r),
                    })
                    .boxed()
            };
            let mut stopped = None;
            loop {
                let event = tokio::select! {
                    e = run.next() => e,
                    signal = &mut stop => { stopped = Some(signal); break; }
                };
                let Some(event) = event else { break };
                match event {
                    FleetEvent::Answer {
                        target,
                        answer:
                            TypedChunk {
                                chunk: answer,
                                types,
                            },
                    } => {
                        let mut result = Ok(());
                        let types = types.as_deref();
                        for e in &answer {
                            result = printer.typed_entry(out, &target, e, types);
                            if result.is_err() {
                                break;
                            }
                        }
                        if let Err(e) = result {
                            // Nothing more reaches stdout: what was written
                            // is what the summaries say.
                            drop(run);
                            let _ = out.flush();
                            finish_dump(
                                err,
                                &map,
                                &written,
                                &reports,
                                &finished,
                                save_cursor.as_ref(),
                                total,
                            )?;
                            return Err(e.into());
                        }
                        let w = written.entry(target).or_default();
                        w.0 += answer.len() as u64;
                        w.1 = answer.cursor().to_owned();
                        progress.entries(answer.len() as u64);
                    }
                    FleetEvent::Done(r) => {
                        progress.done(&r);
                        reports.push(r);
                    }
                }
            }
            drop(run);
            out.flush()?;
            progress.finish();
            let failed = finish_dump(
                err,
                &map,
                &written,
                &reports,
                &finished,
                save_cursor.as_ref(),
                total,
            )?;
            if let Some(signal) = stopped {
                return Err(Interrupted(signal).into());
            }
            if !failed.is_empty() {
                return Err(TargetsFailed(failed, total).into());
            }
            return Ok(());
        }
    };
    progress.finish();
    out.flush()?;
    let failed: Vec<TargetReport> = reports.iter().filter(|r| !r.is_ok()).cloned().collect();
    if total > 1 || !failed.is_empty() {
        for r in &failed {
            let line =
                json!({"target": r.target.as_str(), "code": code_name(r.code), "error": r.message});
            err.write_all(format!("{line}\n").as_bytes())?;
        }
        if total > 1 {
            writeln!(
                err,
                "{}",
                json!({"targets": total, "ok": total - failed.len(), "failed": failed.len()})
            )?;
        }
    }
    if failed.is_empty() {
        Ok(())
    } else {
        Err(TargetsFailed(failed, total).into())
    }
}

/// A lookup key given as JSON: an argument starting with `{`, `[` or `"`,
/// or anything after `json:`; `None` for a hex key.
fn json_key(arg: &str) -> Option<Result<prost_types::Value, String>> {
    let text = match arg.strip_prefix("json:") {
        Some(rest) => rest,
        None if arg.starts_with(['{', '[', '"']) => arg,
        None => return None,
    };
    Some(
        serde_json::from_str::<serde_json::Value>(text)
            .map(|v| to_proto_value(&v))
            .map_err(|e| format!("key {text:?} is not valid JSON: {e}")),
    )
}

fn to_proto_value(v: &serde_json::Value) -> prost_types::Value {
    use prost_types::value::Kind;
    let kind = match v {
        serde_json::Value::Null => Kind::NullValue(0),
        serde_json::Value::Bool(b) => Kind::BoolValue(*b),
        // Integers beyond 2^53 keep every digit as strings, which the
        // daemon reads as exactly.
        serde_json::Value::Number(n) => match n.as_f64() {
            Some(f) if n.is_f64() || f.abs() <= 9_007_199_254_740_992.0 => Kind::NumberValue(f),
            _ => Kind::StringValue(n.to_string()),
        },
        serde_json::Value::String(s) => Kind::StringValue(s.clone()),
        serde_json::Value::Array(a) => Kind::ListValue(prost_types::ListValue {
            values: a.iter().map(to_proto_value).collect(),
        }),
        serde_json::Value::Object(o) => Kind::StructValue(prost_types::Struct {
            fields: o
                .iter()
                .map(|(k, v)| (k.clone(), to_proto_value(v)))
                .collect(),
        }),
    };
    prost_types::Value { kind: Some(kind) }
}

/// Every target's types for `map` (GetMap); targets that fail or have no
/// types are left out, and print hex.
async fn map_types(fleet: &Fleet, map: &MapName) -> HashMap<Target, MapTypes> {
    let mut run = fleet.get_map(map);
    let mut types = HashMap::new();
    while let Some(event) = run.next().await {
        if let FleetEvent::Answer { target, answer } = event
            && let Ok(Some(t)) = MapTypes::from_info(&answer)
        {
            types.insert(target, t);
        }
    }
    types
}

/// Writes a dump's summaries (one line per target, then totals for a fleet)
/// and the cursor file; returns the targets that failed.
fn finish_dump(
    err: &mut dyn io::Write,
    map: &str,
    written: &HashMap<Target, (u64, String)>,
    reports: &[TargetReport],
    finished: &[Target],
    save_cursor: Option<&PathBuf>,
    total: usize,
) -> anyhow::Result<Vec<TargetReport>> {
    let by_target: HashMap<&Target, &TargetReport> =
        reports.iter().map(|r| (&r.target, r)).collect();
    let mut file = CursorFile {
        map: map.to_owned(),
        ..CursorFile::default()
    };
    let mut targets: Vec<&Target> = written.keys().collect();
    targets.sort();
    let (mut failed, mut entries) = (Vec::new(), 0);
    for t in targets {
        let (n, cursor) = &written[t];
        entries += n;
        let report = by_target.get(t);
        let done = report.is_some_and(|r| r.is_ok() && r.complete);
        let mut line = json!({
            "target": t.as_str(),
            "entries": n,
            "complete": done,
            "resumes": report.map_or(0, |r| r.resumes),
            "cursor": cursor,
        });
        match report {
            Some(r) if r.is_ok() => line["code"] = json!("OK"),
            Some(r) => {
                line["code"] = json!(code_name(r.code));
                line["error"] = json!(r.message);
                failed.push((*r).clone());
            }
            None => line["code"] = json!("CANCELLED"),
        }
        if let Some(r) = report {
            line["elapsed_ms"] = json!(r.elapsed.as_millis() as u64);
        }
        // One write per line: stderr is unbuffered, and a formatted value
        // would reach it in dozens of pieces.
        err.write_all(format!("{line}\n").as_bytes())?;
        file.targets.insert(
            t.to_string(),
            SavedTarget {
                cursor: cursor.clone(),
                done,
            },
        );
    }
    for t in finished {
        file.targets.insert(
            t.to_string(),
            SavedTarget {
                cursor: String::new(),
                done: true,
            },
        );
    }
    if total > 1 {
        writeln!(
            err,
            "{}",
            json!({
                "targets": total,
                "ok": reports.iter().filter(|r| r.is_ok()).count(),
                "failed": failed.len(),
                "skipped": finished.len(),
                "entries": entries,
            })
        )?;
    }
    if let Some(path) = save_cursor {
        let tmp = path.with_extension("tmp");
        std::fs::write(&tmp, serde_json::to_vec_pretty(&file)?)
            .with_context(|| format!("cannot write {}", tmp.display()))?;
        std::fs::rename(&tmp, path).with_context(|| format!("cannot write {}", path.display()))?;
    }
    Ok(failed)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn help_lists_the_commands_and_the_exit_codes() {
        use clap::CommandFactory as _;
        let help = Cli::command().render_long_help().to_string();
        for word in [
            "list",
            "show",
            "dump",
            "lookup",
            "--target",
            "Exit codes",
            "130",
        ] {
            assert!(help.contains(word), "{word}: {help}");
        }
    }

    #[test]
    fn failures_are_described_by_target() {
        let report = |t: &str, code| TargetReport {
            target: t.parse().unwrap(),
            code,
            message: "gone".into(),
            entries: 0,
            complete: false,
            resumes: 0,
            cursor: String::new(),
            elapsed: Duration::ZERO,
        };
        let one = TargetsFailed(vec![report("a:1", tonic_code::NotFound)], 1);
        assert_eq!(one.to_string(), "NOT_FOUND: gone");
        let some = TargetsFailed(
            vec![
                report("a:1", tonic_code::NotFound),
                report("b:1", tonic_code::Unavailable),
            ],
            5,
        );
        assert_eq!(some.to_string(), "2 of 5 targets failed");
    }

    use bpfmap_client::Code as tonic_code;
}
