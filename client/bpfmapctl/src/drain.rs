//! `drain`: a map's entries read and deleted on every target, written to
//! stdout as JSON Lines chunk by chunk, each chunk acknowledged (and noted
//! in the ack file) only once it is written, flushed and, when stdout is a
//! file, fsync'd.

use std::{
    cell::RefCell,
    collections::BTreeMap,
    fs::File,
    io::{self, Write as _},
    path::{Path, PathBuf},
    time::Duration,
};

use anyhow::Context as _;
use bpfmap_client::{Client, Code, Drain, DrainChunk, DrainOptions, Error, MapName, Target};
use clap::Args;
use serde_json::json;

use crate::{
    Interrupted, code_and_text,
    drive::{Io, interrupted},
    error_line,
    output::{Format, PerCpu, Printer},
    setup::Setup,
    usage,
};

/// The arguments of `drain`.
#[derive(Debug, Args)]
pub struct DrainArgs {
    /// Map path relative to the daemon's root ("demo/flows"), or "id:N".
    pub map: String,
    /// Drain again DURATION after each call ends (a new call that
    /// acknowledges the last chunk written), until SIGINT or SIGTERM (exit
    /// 0; 1 if a target stopped on an error retrying cannot fix). Without
    /// it: one call per target, until its daemon says it is done.
    #[arg(long, value_name = "DURATION", value_parser = humantime_serde::re::humantime::parse_duration)]
    pub interval: Option<Duration>,
    /// Each target's last chunk written, as JSON (target to {"cursor",
    /// "sequence"}): read at the start (the first call acknowledges it and
    /// drops what the daemon sends again up to it), rewritten atomically
    /// after every chunk. Without it, the chunks of the last call are
    /// never acknowledged and come again on the next run.
    #[arg(long, value_name = "FILE")]
    pub ack_file: Option<PathBuf>,
    /// Drain at most this many entries per target and call (0: until the
    /// map is empty).
    #[arg(long, default_value_t = 0)]
    pub limit: u64,
}

/// A target's last durable chunk.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub(crate) struct Acked {
    pub(crate) cursor: String,
    pub(crate) sequence: u64,
    /// A chunk being written to stdout (a regular file) and not yet
    /// acknowledged: on the next start, what follows `output` in that file
    /// is cut, and the chunk, redelivered, written again. So a pipeline
    /// `>> FILE` killed at any point holds every chunk exactly once.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) pending: Option<Pending>,
}

/// Where a chunk's lines began in the output file.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub(crate) struct Pending {
    pub(crate) sequence: u64,
    /// The file's length before the chunk.
    pub(crate) output: u64,
    /// The file (device and inode), so that another file is never cut.
    pub(crate) dev: u64,
    pub(crate) ino: u64,
}

/// What --ack-file holds: every target's last durable chunk.
#[derive(Debug, Default, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(transparent)]
pub(crate) struct AckFile(pub(crate) BTreeMap<String, Acked>);

impl AckFile {
    /// The file's text.
    fn parse(text: &str) -> serde_json::Result<Self> {
        serde_json::from_str(text)
    }

    /// The file at `path`; empty if there is none.
    pub(crate) fn read(path: &Path) -> anyhow::Result<Self> {
        match std::fs::read_to_string(path) {
            Ok(text) => Self::parse(&text).map_err(|e| {
                usage(format!(
                    "{} is not an ack file (target to {{\"cursor\", \"sequence\"}}): {e}",
                    path.display()
                ))
            }),
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(Self::default()),
            Err(e) => Err(usage(format!("cannot read {}: {e}", path.display()))),
        }
    }

    /// The file's text: pretty JSON, a newline at the end.
    fn to_bytes(&self) -> Vec<u8> {
        let mut text = serde_json::to_vec_pretty(self).expect("strings and numbers");
        text.push(b'\n');
        text
    }

    /// Writes the file whole or not at all: FILE.tmp written and fsync'd,
    /// renamed over FILE, then the directory fsync'd (so that the rename
    /// survives a crash).
    pub(crate) fn write(&self, path: &Path) -> anyhow::Result<()> {
        write_atomically(path, &self.to_bytes())
            .with_context(|| format!("cannot write {}", path.display()))
    }
}

fn write_atomically(path: &Path, bytes: &[u8]) -> io::Result<()> {
    let mut tmp = path.as_os_str().to_owned();
    tmp.push(".tmp");
    let tmp = PathBuf::from(tmp);
    let mut file = File::create(&tmp)?;
    file.write_all(bytes)?;
    file.sync_all()?;
    drop(file);
    std::fs::rename(&tmp, path)?;
    File::open(directory_of(path))?.sync_all()
}

/// The directory that holds `path`'s entry.
fn directory_of(path: &Path) -> &Path {
    match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    }
}

/// fd 1, when it is a regular file (fstat): fsync'd after each chunk. A
/// pipe or a terminal has nothing to make durable.
fn stdout_file() -> Option<File> {
    use std::os::fd::AsFd as _;
    let file = File::from(io::stdout().as_fd().try_clone_to_owned().ok()?);
    file.metadata().ok()?.is_file().then_some(file)
}

/// What the targets' drains share: stdout, stderr and the ack file. Each
/// target's drain borrows it between two awaits only, so a chunk is
/// written, made durable and acknowledged without another target's lines
/// in between.
struct Shared<'a> {
    out: &'a mut dyn io::Write,
    err: &'a mut dyn io::Write,
    /// stdout when it is a regular file.
    sync: Option<File>,
    printer: Printer,
    /// Each target's types, when its entries are decoded.
    types: std::collections::HashMap<Target, bpfmap_client::MapTypes>,
    /// One chunk's lines.
    lines: Vec<u8>,
    acks: AckFile,
    ack_file: Option<PathBuf>,
    /// The targets that stopped on an error.
    failed: Vec<(Target, Error)>,
}

impl Shared<'_> {
    /// Writes a chunk's entries in one write, flushes stdout, and fsyncs
    /// it when it is a file.
    fn write_chunk(&mut self, target: &Target, chunk: &DrainChunk) -> anyhow::Result<()> {
        if let (Some(f), Some(path)) = (&self.sync, &self.ack_file) {
            use std::os::unix::fs::MetadataExt as _;
            let m = f.metadata()?;
            let pending = Pending {
                sequence: chunk.sequence(),
                output: m.len(),
                dev: m.dev(),
                ino: m.ino(),
            };
            let entry = self
                .acks
                .0
                .entry(target.to_string())
                .or_insert_with(|| Acked {
                    cursor: String::new(),
                    sequence: 0,
                    pending: None,
                });
            entry.pending = Some(pending);
            self.acks.write(path)?;
        }
        self.lines.clear();
        let c = chunk.chunk();
        let types = self.types.get(target);
        for e in c.iter() {
            self.printer
                .typed_entry(&mut self.lines, target, e, types)?;
        }
        self.out.write_all(&self.lines)?;
        self.out.flush()?;
        if let Some(f) = &self.sync {
            f.sync_all()?;
        }
        Ok(())
    }

    /// Notes a target's last durable chunk, and rewrites the ack file.
    fn acked(&mut self, target: &Target, cursor: &str, sequence: u64) -> anyhow::Result<()> {
        let acked = Acked {
            cursor: cursor.to_owned(),
            sequence,
            pending: None,
        };
        self.acks.0.insert(target.to_string(), acked);
        match &self.ack_file {
            Some(path) => self.acks.write(path),
            None => Ok(()),
        }
    }

    /// One line on stderr, in one write.
    fn say(&mut self, line: &serde_json::Value) -> io::Result<()> {
        self.err.write_all(format!("{line}\n").as_bytes())
    }
}

/// The summary line of one call of one target.
fn call_line(
    target: &Target,
    call: u64,
    written: u64,
    drain: &Drain,
    failure: Option<&Error>,
) -> serde_json::Value {
    let mut line = json!({
        "target": target.as_str(),
        "call": call,
        "entries": written,
        "duplicates": drain.duplicates().1,
        "resumes": drain.resumes(),
        "sequence": drain.acked().map(|(_, s)| s),
    });
    if let Some(s) = drain.summary() {
        line["drained"] = json!(s.drained);
        line["redelivered"] = json!(s.redelivered);
        line["acknowledged"] = json!(s.acknowledged);
        line["spooled"] = json!(s.spooled);
        line["complete"] = json!(s.complete);
        if !s.paused.is_empty() {
            line["paused"] = json!(s.paused);
        }
    }
    match failure {
        None => line["code"] = json!("OK"),
        Some(e) => {
            let (code, text) = code_and_text(e);
            line["code"] = json!(code);
            line["error"] = json!(text);
        }
    }
    line
}

/// Whether a call that failed so is worth making again at the next
/// interval: not when the request, the permissions, the daemon's
/// configuration or its spool are what is wrong.
fn worth_retrying(e: &Error) -> bool {
    !matches!(
        e.code(),
        Code::InvalidArgument
            | Code::PermissionDenied
            | Code::Unauthenticated
            | Code::FailedPrecondition
            | Code::DataLoss
            | Code::Unimplemented
    )
}

/// One target's drain: its client (or why it has none), the map, the
/// options of every call, and the interval between calls.
struct TargetDrain<'a> {
    client: Result<Client, Error>,
    target: Target,
    map: &'a MapName,
    base: &'a DrainOptions,
    interval: Option<Duration>,
}

/// One target: calls until its daemon is done (or, with an interval,
/// until stopped); the error it stops on goes to `shared.failed`. Errors
/// writing stdout or the ack file end the whole command.
async fn drain_target(
    shared: &RefCell<Shared<'_>>,
    drain: TargetDrain<'_>,
    turns: &tokio::sync::Semaphore,
) -> anyhow::Result<()> {
    let TargetDrain {
        client,
        target,
        map,
        base,
        interval,
    } = drain;
    let client = match client {
        Ok(c) => c,
        Err(e) => {
            let (code, text) = code_and_text(&e);
            let line = json!({"target": target.as_str(), "code": code, "error": text});
            let mut shared = shared.borrow_mut();
            shared.say(&line)?;
            shared.failed.push((target, e));
            return Ok(());
        }
    };
    let mut acked = shared.borrow().acks.0.get(target.as_str()).cloned();
    let mut call = 0;
    loop {
        call += 1;
        let mut options = base.clone();
        if let Some(a) = acked.as_ref().filter(|a| !a.cursor.is_empty()) {
            options = options
                .with_ack(a.cursor.clone())
                .with_acked_sequence(a.sequence);
        }
        // At most --concurrency targets drain at once; a target waits for
        // its turn before each call, never for another target's lifetime.
        let turn = turns.acquire().await?;
        let mut drain = client.drain(map, options);
        let mut written = 0;
        let failure = loop {
            match drain.next_chunk().await {
                Ok(Some(chunk)) => {
                    let mut shared = shared.borrow_mut();
                    shared.write_chunk(&target, &chunk)?;
                    drain.ack(chunk.cursor(), chunk.sequence());
                    shared.acked(&target, chunk.cursor(), chunk.sequence())?;
                    written += chunk.len() as u64;
                }
                Ok(None) => break None,
                Err(e) => break Some(e),
            }
        };
        if let Some((cursor, sequence)) = drain.acked() {
            acked = Some(Acked {
                cursor: cursor.to_owned(),
                sequence,
                pending: None,
            });
        }
        drop(turn);
        let line = call_line(&target, call, written, &drain, failure.as_ref());
        shared.borrow_mut().say(&line)?;
        let every = match (interval, failure) {
            (None, None) => return Ok(()),
            (Some(every), None) => every,
            (Some(every), Some(e)) if worth_retrying(&e) => every,
            (_, Some(e)) => {
                shared.borrow_mut().failed.push((target, e));
                return Ok(());
            }
        };
        tokio::time::sleep(every).await;
    }
}

/// Cuts from the output file what a chunk left unacknowledged at the last
/// run wrote (at most one chunk: chunks are written one at a time), so that
/// its redelivery is written once.
fn cut_pending(f: &File, acks: &mut AckFile) -> anyhow::Result<bool> {
    use std::os::unix::fs::MetadataExt as _;
    let m = f.metadata()?;
    let mut changed = false;
    for a in acks.0.values_mut() {
        let Some(p) = a.pending.take() else { continue };
        changed = true;
        if (p.dev, p.ino) == (m.dev(), m.ino()) && m.len() > p.output {
            f.set_len(p.output)
                .context("cannot cut the unacknowledged chunk from the output")?;
            f.sync_all()?;
        }
    }
    Ok(changed)
}

/// `drain MAP`.
pub(crate) async fn run(
    setup: Setup,
    io: Io<'_>,
    args: DrainArgs,
    per_cpu: PerCpu,
    tls: bool,
) -> anyhow::Result<()> {
    let map = setup.map_name(&args.map)?;
    let acks = match &args.ack_file {
        Some(path) => AckFile::read(path)?,
        None => AckFile::default(),
    };
    // Entries are decoded here through each target's types, as a dump's
    // are (members in declaration order).
    let types = if setup.decode {
        crate::commands::map_types(&setup.fleet(), &map, &[]).await?
    } else {
        std::collections::HashMap::new()
    };
    let options = DrainOptions::default()
        .with_limit(args.limit)
        .with_raw(true)
        .with_per_cpu(per_cpu.into());
    setup.progress.finish();
    let sync = stdout_file();
    let mut acks = acks;
    if let (Some(f), Some(path)) = (&sync, &args.ack_file)
        && cut_pending(f, &mut acks)?
    {
        acks.write(path)?;
    }
    let shared = RefCell::new(Shared {
        out: io.out,
        err: io.err,
        sync,
        printer: Printer::new(Format::Json, per_cpu),
        types,
        lines: Vec::with_capacity(64 << 10),
        acks,
        ack_file: args.ack_file.clone(),
        failed: Vec::new(),
    });
    // Every target runs (with an interval, for as long as the command
    // does); at most --concurrency of them are in a call at once.
    let turns = tokio::sync::Semaphore::new(setup.options.concurrency().max(1));
    let drains = futures::future::try_join_all(setup.targets.iter().map(|t| {
        let client = Client::connect_lazy(&t.url(tls), setup.connect.clone());
        let drain = TargetDrain {
            client,
            target: t.clone(),
            map: &map,
            base: &options,
            interval: args.interval,
        };
        drain_target(&shared, drain, &turns)
    }));
    let stopped = tokio::select! {
        ended = drains => {
            ended?;
            None
        }
        signal = interrupted() => Some(signal),
    };
    finish(
        shared.into_inner(),
        &setup.targets,
        stopped,
        args.interval.is_none(),
    )
}

/// Ends the command, once every target is done or a signal stopped it
/// (`stopped`): where each target stands, the totals of several targets,
/// and the error to exit with (with `once`, no --interval, a signal is an
/// error).
fn finish(
    mut shared: Shared<'_>,
    targets: &[Target],
    stopped: Option<&'static str>,
    once: bool,
) -> anyhow::Result<()> {
    let total = targets.len();
    shared.out.flush()?;
    if let Some(signal) = stopped {
        // Where each target stands: its last chunk written.
        for t in targets {
            let sequence = shared.acks.0.get(t.as_str()).map(|a| a.sequence);
            let line = json!({"target": t.as_str(), "stopped": signal, "sequence": sequence});
            shared.say(&line)?;
        }
        if once {
            return Err(Interrupted(signal).into());
        }
    }
    let failed = shared.failed;
    if total > 1 {
        let totals = json!({"targets": total, "ok": total - failed.len(), "failed": failed.len()});
        shared.err.write_all(format!("{totals}\n").as_bytes())?;
    }
    match failed.as_slice() {
        [] => Ok(()),
        [(_, e)] if total == 1 => Err(anyhow::anyhow!(error_line(e))),
        _ => Err(anyhow::anyhow!(
            "{} of {total} targets failed",
            failed.len()
        )),
    }
}

#[cfg(test)]
mod tests {
    use clap::Parser as _;

    use super::*;
    use crate::{Cli, Command};

    /// A directory of its own under the system's temporary one, removed
    /// when dropped.
    struct TempDir(PathBuf);

    impl TempDir {
        fn new(name: &str) -> Self {
            let dir =
                std::env::temp_dir().join(format!("bpfmapctl-drain-{}-{name}", std::process::id()));
            let _ = std::fs::remove_dir_all(&dir);
            std::fs::create_dir_all(&dir).unwrap();
            Self(dir)
        }
    }

    impl Drop for TempDir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    fn files(dir: &Path) -> Vec<String> {
        let mut names: Vec<String> = std::fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        names.sort();
        names
    }

    #[test]
    fn drain_parses_its_arguments() {
        let cli = Cli::try_parse_from([
            "bpfmapctl",
            "drain",
            "demo/flows",
            "--interval",
            "30s",
            "--ack-file",
            "/var/lib/collector/acks.json",
            "--limit",
            "5000",
        ])
        .unwrap();
        let Command::Drain(args) = cli.command else {
            panic!("drain")
        };
        assert_eq!(args.map, "demo/flows");
        assert_eq!(args.interval, Some(Duration::from_secs(30)));
        assert_eq!(
            args.ack_file,
            Some(PathBuf::from("/var/lib/collector/acks.json"))
        );
        assert_eq!(args.limit, 5000);

        let cli =
            Cli::try_parse_from(["bpfmapctl", "-t", "10.0.0.7:50051", "drain", "id:12"]).unwrap();
        assert_eq!(cli.targets, ["10.0.0.7:50051"]);
        let Command::Drain(args) = cli.command else {
            panic!("drain")
        };
        assert_eq!(
            (args.map.as_str(), args.interval, args.ack_file, args.limit),
            ("id:12", None, None, 0)
        );
        let cli = Cli::try_parse_from(["bpfmapctl", "drain", "m", "--interval", "1m30s"]).unwrap();
        let Command::Drain(args) = cli.command else {
            panic!("drain")
        };
        assert_eq!(args.interval, Some(Duration::from_secs(90)));

        let bad = Cli::try_parse_from(["bpfmapctl", "drain", "m", "--interval", "soon"]);
        assert_eq!(
            bad.unwrap_err().kind(),
            clap::error::ErrorKind::ValueValidation
        );
        let missing = Cli::try_parse_from(["bpfmapctl", "drain"]);
        assert_eq!(
            missing.unwrap_err().kind(),
            clap::error::ErrorKind::MissingRequiredArgument
        );
    }

    #[test]
    fn the_ack_file_is_targets_to_cursor_and_sequence() {
        let text = r#"{
            "10.0.0.7:50051": {"cursor": "Q1VSU09S", "sequence": 42},
            "unix:///run/bpfmapd.sock": {"cursor": "", "sequence": 0}
        }"#;
        let file = AckFile::parse(text).unwrap();
        assert_eq!(
            file,
            AckFile(BTreeMap::from([
                (
                    "10.0.0.7:50051".to_owned(),
                    Acked {
                        cursor: "Q1VSU09S".into(),
                        sequence: 42,
                        pending: None,
                    }
                ),
                (
                    "unix:///run/bpfmapd.sock".to_owned(),
                    Acked {
                        cursor: String::new(),
                        sequence: 0,
                        pending: None,
                    }
                ),
            ]))
        );
        assert_eq!(
            String::from_utf8(file.to_bytes()).unwrap(),
            "{\n  \"10.0.0.7:50051\": {\n    \"cursor\": \"Q1VSU09S\",\n    \"sequence\": 42\n  },\n  \"unix:///run/bpfmapd.sock\": {\n    \"cursor\": \"\",\n    \"sequence\": 0\n  }\n}\n"
        );
        assert_eq!(
            AckFile::parse(&String::from_utf8(file.to_bytes()).unwrap()).unwrap(),
            file
        );
        assert_eq!(AckFile::parse("{}").unwrap(), AckFile::default());
        // A cursor file of `dump --save-cursor`, or a sequence that is not
        // a number, is not an ack file.
        assert!(AckFile::parse(r#"{"map": "m", "targets": {}}"#).is_err());
        assert!(AckFile::parse(r#"{"t:1": {"cursor": "c", "sequence": "7"}}"#).is_err());
        assert!(AckFile::parse(r#"{"t:1": {"cursor": "c"}}"#).is_err());
    }

    #[test]
    fn the_ack_file_is_read_if_it_exists() {
        let dir = TempDir::new("read");
        let path = dir.0.join("acks.json");
        assert_eq!(AckFile::read(&path).unwrap(), AckFile::default());
        std::fs::write(&path, r#"{"t:1": {"cursor": "c9", "sequence": 9}}"#).unwrap();
        let file = AckFile::read(&path).unwrap();
        assert_eq!(
            file.0.get("t:1"),
            Some(&Acked {
                cursor: "c9".into(),
                sequence: 9,
                pending: None,
            })
        );
        std::fs::write(&path, "not json").unwrap();
        let e = AckFile::read(&path).unwrap_err();
        assert!(e.is::<crate::Usage>());
        assert_eq!(
            e.to_string(),
            format!(
                "{} is not an ack file (target to {{\"cursor\", \"sequence\"}}): expected ident at line 1 column 2",
                path.display()
            )
        );
    }

    #[test]
    fn the_ack_file_is_replaced_whole() {
        let dir = TempDir::new("write");
        let path = dir.0.join("acks.json");
        let mut file = AckFile::default();
        file.0.insert(
            "t:1".into(),
            Acked {
                cursor: "c1".into(),
                sequence: 1,
                pending: None,
            },
        );
        file.write(&path).unwrap();
        assert_eq!(files(&dir.0), ["acks.json"]);
        assert_eq!(AckFile::read(&path).unwrap(), file);
        // A stale temporary file from a crash is replaced, not appended to.
        std::fs::write(dir.0.join("acks.json.tmp"), "x".repeat(4096)).unwrap();
        file.0.insert(
            "t:2".into(),
            Acked {
                cursor: "d7".into(),
                sequence: 7,
                pending: None,
            },
        );
        file.write(&path).unwrap();
        assert_eq!(files(&dir.0), ["acks.json"]);
        assert_eq!(std::fs::read(&path).unwrap(), file.to_bytes());
        // The directory fsync'd after the rename.
        assert_eq!(directory_of(Path::new("acks.json")), Path::new("."));
        assert_eq!(directory_of(Path::new("./acks.json")), Path::new("."));
        assert_eq!(
            directory_of(Path::new("/var/lib/c/acks.json")),
            Path::new("/var/lib/c")
        );
        assert_eq!(directory_of(&path), dir.0.as_path());
        let e = file.write(&dir.0.join("missing/acks.json")).unwrap_err();
        assert_eq!(
            e.to_string(),
            format!("cannot write {}", dir.0.join("missing/acks.json").display())
        );
    }

    #[test]
    fn retrying_at_the_next_interval_is_for_what_may_pass() {
        let e = |code| Error::from(bpfmap_client::Status::new(code, "x"));
        for code in [
            Code::Unavailable,
            Code::ResourceExhausted,
            Code::Aborted,
            Code::NotFound,
            Code::DeadlineExceeded,
            Code::Internal,
        ] {
            assert!(worth_retrying(&e(code)), "{code:?}");
        }
        for code in [
            Code::InvalidArgument,
            Code::PermissionDenied,
            Code::Unauthenticated,
            Code::FailedPrecondition,
            Code::DataLoss,
            Code::Unimplemented,
        ] {
            assert!(!worth_retrying(&e(code)), "{code:?}");
        }
    }

    #[tokio::test]
    async fn a_target_that_cannot_be_reached_fails_and_acknowledges_nothing() {
        let dir = TempDir::new("unreachable");
        let acks = dir.0.join("acks.json");
        let cli = Cli::try_parse_from([
            "bpfmapctl",
            "--addr",
            "127.0.0.1:1",
            "--busy-wait",
            "0",
            "drain",
            "demo/flows",
            "--ack-file",
            acks.to_str().unwrap(),
        ])
        .unwrap();
        let (mut out, mut err) = (Vec::new(), Vec::new());
        let e = crate::run(cli, &mut out, &mut err).await.unwrap_err();
        assert_eq!(
            e.to_string(),
            "UNAVAILABLE: tcp connect error: transport error: Connection refused (os error 111)"
        );
        assert!(out.is_empty());
        let err = String::from_utf8(err).unwrap();
        let lines: Vec<serde_json::Value> = err
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect();
        assert_eq!(lines.len(), 1, "{err}");
        // RetryPolicy::fleet: four resumes, then the error.
        assert_eq!(
            lines[0],
            json!({
                "target": "127.0.0.1:1",
                "call": 1,
                "entries": 0,
                "duplicates": 0,
                "resumes": 4,
                "sequence": null,
                "code": "UNAVAILABLE",
                "error": "tcp connect error: transport error: Connection refused (os error 111)",
            })
        );
        // Nothing was written: no ack file.
        assert_eq!(files(&dir.0), Vec::<String>::new());
    }
}
