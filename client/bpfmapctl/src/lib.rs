//! The `bpfmapctl` command line: read eBPF maps from one bpfmapd or a whole
//! fleet. A library so that the tests can run it in-process; `main.rs` is the
//! binary.
#![forbid(unsafe_code)]

mod arrow_out;
mod bpftrace;
mod commands;
mod cursors;
mod drain;
mod drive;
mod dump;
mod hist;
mod keys;
mod live;
mod output;
mod setup;
mod stacks;
mod table;
mod top;
mod watching;

use std::{
    io::{self, IsTerminal as _},
    path::PathBuf,
};

use bpfmap_client::{
    Error, TargetReport, code_name,
    typed::{Rendering, Renderings},
};
use clap::{Args, Parser, Subcommand};

pub use crate::drain::DrainArgs;
use crate::output::{Format, PerCpu};

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
    /// Run the command through the bpfmap-relay at this address
    /// ("http://relay:50061", "https://..." with --ca, --cert and --key):
    /// the relay reaches the daemons, and --target names targets as the
    /// relay lists them (default: every target of the relay). Every
    /// command but `drain`, with the same output as direct fan-out.
    #[arg(long, value_name = "URL", env = "BPFMAP_RELAY", global = true)]
    pub relay: Option<String>,
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
    /// Seconds to keep asking a daemon that is busy (RESOURCE_EXHAUSTED:
    /// all its dump or lookup slots in use) before giving up on it; 0: give
    /// up at once.
    #[arg(long, default_value_t = 60.0, value_name = "SECS", global = true)]
    pub busy_wait: f64,
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
    /// Read the inner map the named map (an array_of_maps or
    /// hash_of_maps) holds at KEY (a key as `lookup` takes them: 3, 0x3,
    /// hex:03000000 or JSON), with the outer map's access: on show, dump,
    /// lookup, top and watch.
    #[arg(long, global = true, value_name = "KEY")]
    pub inner: Option<String>,
    /// The map's key type in C, for a map whose BTF does not give it
    /// (`char[16]`, `__u32`, `struct { __be32 addr; __u16 port; }`): the
    /// map is then decoded, filtered and grouped through it.
    #[arg(long, global = true, value_name = "C_TYPE")]
    pub key_type: Option<String>,
    /// The map's value type in C ("__u64"), as --key-type.
    #[arg(long, global = true, value_name = "C_TYPE")]
    pub value_type: Option<String>,
    /// What to do.
    #[command(subcommand)]
    pub command: Command,
}

/// The subcommands.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// List the maps each daemon exposes, with their names and the
    /// processes (else programs) holding them.
    List(ListArgs),
    /// Describe one map on each daemon (NOT_FOUND where it is absent): its
    /// types, pins, programs, owners and memory.
    Show {
        /// Map path relative to the daemon's root ("demo/flows"), "id:N",
        /// or "name:NAME" (or "name:NAME@OWNER").
        map: String,
    },
    /// Dump a map's entries. A summary per target (with the cursor to
    /// resume from) goes to stderr.
    Dump(DumpArgs),
    /// Look keys up in a map on each daemon; absent keys print
    /// "found": false.
    Lookup {
        /// Map path relative to the daemon's root ("demo/flows"), "id:N", or
        /// "name:NAME" or "name:NAME@OWNER" (OWNER a program name, process name or pid).
        map: String,
        /// Keys, each spelled one way: a number (`12345`, `-1`, or in hex
        /// `0x1bb`: an integer key, an enum, an index), the key's bytes
        /// (`hex:0a000001`, two hex digits per byte in memory order), or
        /// JSON through the map's key type (starting with `{`, `[` or `"`,
        /// or after `json:`), e.g.
        /// '{"saddr":"10.0.0.0","daddr":"192.168.0.1","sport":1024,"dport":443,"proto":"IPPROTO_TCP"}'.
        /// Digits with a leading zero (`0102`) are refused: write `102` or
        /// `hex:0102`.
        #[arg(required = true)]
        keys: Vec<String>,
        /// Show members another way than their types say, and read JSON
        /// keys in that spelling (see `dump --render`).
        #[arg(long, value_name = "PATH=RENDERING", value_delimiter = ',', value_parser = parse_render)]
        render: Vec<RenderArg>,
    },
    /// The top groups of a map's entries, aggregated where the map lives
    /// and merged exactly across the targets (a group's values added up
    /// over every host), largest first by the first --by.
    Top(TopArgs),
    /// Draw a map that keeps a histogram (runqlat's, cpudist's,
    /// funclatency's `struct hist`, bpftrace's hist() and lhist()) as the
    /// program draws it, with its count, mean and p50/p90/p99; summed over
    /// the map's entries by each daemon and merged exactly across the
    /// targets. `--format json`: one line per histogram, as data.
    Hist(HistArgs),
    /// A map bpftrace keeps with count(), sum(), min(), max(), avg() or
    /// stats(), printed as bpftrace prints it (`@mn[7]: -3`, `@st: count
    /// 51, average 4, total 204`): min() undone and max() taken over the
    /// CPUs (not summed), avg() and stats() from their count and total;
    /// combined by each daemon and merged across the targets. The function
    /// and the key's type are read from the bpftrace process's script by
    /// the daemon, or given (`--as`, --key-type: `char[16]` for comm,
    /// without the index avg() and stats() append); keys without a type
    /// print as integers. hist() and lhist() maps are drawn by `hist`.
    Bpftrace(BpftraceArgs),
    /// The stacks of a map of counts keyed by stack ids (offcputime's,
    /// wakeuptime's, bpftrace's `@[kstack]`) with the stack-trace map its
    /// programs use, the frames named by the daemon, the heaviest first:
    /// folded (`--format folded`, the default: `root;frame;... value`, for
    /// flamegraph.pl, inferno and speedscope) or JSON; merged across the
    /// targets (stacks that name the same frames are one).
    Stacks(StacksArgs),
    /// Watch a map: every target's entries as ADDED, then what changes at
    /// each scan (ADDED, CHANGED with deltas and rates, REMOVED) and a
    /// bookmark per scan, as JSON Lines, until interrupted.
    Watch(WatchArgs),
    /// Drain a map: read and delete its entries on every target (a map the
    /// daemon's configuration makes drainable, with the `drain`
    /// permission), as JSON Lines like `dump`'s; each chunk is
    /// acknowledged once it is written (and fsync'd when stdout is a
    /// file). A summary line per target and call on stderr. SIGINT or
    /// SIGTERM stops it: exit 130 without --interval, 0 with it.
    Drain(DrainArgs),
}

/// The arguments of `list`.
#[derive(Debug, Args)]
pub struct ListArgs {
    /// Only maps whose kernel name matches this glob ("AT_*").
    #[arg(long, value_name = "GLOB")]
    pub name: Option<String>,
    /// Only maps of this type ("percpu_hash").
    #[arg(long = "type", value_name = "TYPE")]
    pub map_type: Option<String>,
    /// Only maps this owner holds: a program name, process name or pid.
    #[arg(long, value_name = "OWNER")]
    pub owner: Option<String>,
}

/// The arguments of `watch`.
#[derive(Debug, Args)]
pub struct WatchArgs {
    /// Map path relative to the daemon's root ("demo/flows"), "id:N", or
    /// "name:NAME" or "name:NAME@OWNER" (OWNER a program name, process name or pid).
    pub map: String,
    /// Time between two scans (at least the daemon's
    /// limits.min_watch_interval, 1s by default).
    #[arg(long, value_name = "DURATION", default_value = "1s", value_parser = humantime_serde::re::humantime::parse_duration)]
    pub interval: std::time::Duration,
    /// Only entries for which this CEL expression is true.
    #[arg(long, value_name = "EXPR")]
    pub filter: Option<String>,
    /// Only these members ("key.daddr,value.bytes").
    #[arg(long, value_name = "PATH", value_delimiter = ',')]
    pub fields: Vec<String>,
    /// Show members another way than their types say (see `dump --render`).
    #[arg(long, value_name = "PATH=RENDERING", value_delimiter = ',', value_parser = parse_render)]
    pub render: Vec<RenderArg>,
    /// Resume after a bookmark: its cursor (every target), or a file
    /// written by --save-cursor (each target its own).
    #[arg(long, value_name = "CURSOR|FILE")]
    pub cursor: Option<String>,
    /// After each scan, write every target's last cursor to FILE (JSON:
    /// target to cursor), for --cursor.
    #[arg(long, value_name = "FILE")]
    pub save_cursor: Option<String>,
}

/// The arguments of `top`.
#[derive(Debug, Args)]
pub struct TopArgs {
    /// Map path relative to the daemon's root ("demo/flows"), "id:N", or
    /// "name:NAME" or "name:NAME@OWNER" (OWNER a program name, process name or pid).
    pub map: String,
    /// An aggregate: count(), sum(FIELD), min(FIELD) or max(FIELD), FIELD
    /// an integer member ("value.bytes"); repeatable. The first orders the
    /// groups, largest first.
    #[arg(long = "by", value_name = "AGG", required = true, value_parser = parse_aggregate)]
    pub by: Vec<bpfmap_client::Aggregate>,
    /// The members whose values make a group ("key.daddr,key.dport");
    /// none: one group for the whole map.
    #[arg(long, value_name = "PATH", value_delimiter = ',')]
    pub group_by: Vec<String>,
    /// How many groups (0: every group).
    #[arg(short = 'n', long = "limit", value_name = "K", default_value_t = 10)]
    pub limit: u32,
    /// Only entries for which this CEL expression is true count
    /// ('key.dport == 443 && value.bytes > 1000000').
    #[arg(long, value_name = "EXPR")]
    pub filter: Option<String>,
    /// A TARGETS column in tables: the targets that hold entries of each
    /// group (JSON lines always carry them, as `targets`).
    #[arg(long)]
    pub hosts: bool,
    /// Show a group-by member another way than its type says (see `dump
    /// --render`).
    #[arg(long, value_name = "PATH=RENDERING", value_delimiter = ',', value_parser = parse_render)]
    pub render: Vec<RenderArg>,
    /// Live: watch the map, scanned every DURATION, and show the top
    /// groups by the rate of the first --by (full-screen on a terminal,
    /// keys s/r/p/q; JSON Lines per row and scan otherwise).
    #[arg(long, value_name = "DURATION", value_parser = humantime_serde::re::humantime::parse_duration)]
    pub interval: Option<std::time::Duration>,
}

/// The arguments of `hist`.
#[derive(Debug, Args)]
pub struct HistArgs {
    /// Map path relative to the daemon's root ("demo/flows"), "id:N", or
    /// "name:NAME" or "name:NAME@OWNER" (OWNER a program name, process name or pid).
    pub map: String,
    /// What the buckets count, when the map's types do not say it: log2
    /// (libbpf-tools: bucket 0 counts 0 and 1, k counts [2^k, 2^(k+1))),
    /// linear (--min, --step), bpftrace-log2 (a hist() map: one entry per
    /// bucket), bpftrace-linear (an lhist() map: --min, --max, --step as
    /// given to lhist). Without it, an array of integers named slots or
    /// hist in the value is a log2 histogram.
    #[arg(long = "hist", value_name = "KIND")]
    pub hist: Option<String>,
    /// The array of counts in each entry ("value.slots").
    #[arg(long, value_name = "PATH")]
    pub slots: Option<String>,
    /// For a map of one entry per bucket: the key member holding the
    /// bucket number (default: the key).
    #[arg(long, value_name = "PATH")]
    pub bucket: Option<String>,
    /// For a map of one entry per bucket: the member holding the count
    /// (default: the value, summed over the CPUs).
    #[arg(long = "count-member", value_name = "PATH")]
    pub count_member: Option<String>,
    /// Linear buckets: the lowest value, the highest (bpftrace-linear), the
    /// width of a bucket.
    #[arg(long, allow_hyphen_values = true)]
    pub min: Option<i64>,
    #[arg(long, allow_hyphen_values = true)]
    pub max: Option<i64>,
    #[arg(long)]
    pub step: Option<u64>,
    /// What the values measure, heading the drawing ("usecs").
    #[arg(long)]
    pub unit: Option<String>,
    /// One histogram per value of these members ("key.pid", "value.comm");
    /// none: one for the whole map.
    #[arg(long, value_name = "PATH", value_delimiter = ',')]
    pub group_by: Vec<String>,
    /// How many histograms, the largest totals first (0: all).
    #[arg(short = 'n', long = "limit", value_name = "K", default_value_t = 10)]
    pub limit: u32,
    /// Only entries for which this CEL expression is true count.
    #[arg(long, value_name = "EXPR")]
    pub filter: Option<String>,
    /// Show a group-by member another way than its type says (see `dump
    /// --render`).
    #[arg(long, value_name = "PATH=RENDERING", value_delimiter = ',', value_parser = parse_render)]
    pub render: Vec<RenderArg>,
    /// Draw what each DURATION added (as `runqlat 1` does), until
    /// interrupted or --count drawings.
    #[arg(long, value_name = "DURATION", value_parser = humantime_serde::re::humantime::parse_duration)]
    pub interval: Option<std::time::Duration>,
    /// With --interval: stop after this many drawings (0: never).
    #[arg(long, default_value_t = 0)]
    pub count: u64,
}

/// The arguments of `bpftrace`.
#[derive(Debug, Args)]
pub struct BpftraceArgs {
    /// The map: path, "id:N", `name:NAME[@OWNER]` (bpftrace 0.17 names
    /// `@x` `AT_x`: `name:AT_x@bpftrace`).
    pub map: String,
    /// The function that keeps it: count, sum, min, max, avg or stats.
    /// Default: what the script of the bpftrace process holding the map
    /// assigns it, as the daemon reads it (the map itself does not say).
    #[arg(long = "as", value_name = "FUNCTION")]
    pub function: Option<String>,
    /// The name to print (`@x`); default: the map's kernel name, `AT_`
    /// made `@`.
    #[arg(long)]
    pub name: Option<String>,
}

/// The arguments of `stacks`.
#[derive(Debug, Args)]
pub struct StacksArgs {
    /// The map of counts: path, "id:N", `name:NAME[@OWNER]`.
    pub map: String,
    /// The stack-trace map its ids refer to (default: the one its programs
    /// use).
    #[arg(long, value_name = "MAP")]
    pub stack_map: Option<String>,
    /// What a stack weighs: sum(FIELD) or count() (default: the sum of the
    /// value's integer, else the count).
    #[arg(long = "by", value_name = "AGG", value_parser = parse_aggregate)]
    pub by: Option<bpfmap_client::Aggregate>,
    /// Members shown as root frames, outermost first ("value.comm").
    #[arg(long = "root", value_name = "PATH", value_delimiter = ',')]
    pub roots: Vec<String>,
    /// The member holding a kernel stack id (default: key.kern_stack_id).
    #[arg(long, value_name = "PATH")]
    pub kernel_id: Option<String>,
    /// The member holding a user stack id (default: key.user_stack_id).
    #[arg(long, value_name = "PATH")]
    pub user_id: Option<String>,
    /// The member holding the process of the user stacks (default: key.tgid).
    #[arg(long, value_name = "PATH")]
    pub pid: Option<String>,
    /// The ids are bpftrace's (kstack, ustack: the process in the high 32
    /// bits).
    #[arg(long)]
    pub bpftrace: bool,
    /// Only entries for which this CEL expression is true count.
    #[arg(long, value_name = "EXPR")]
    pub filter: Option<String>,
    /// Frames as addresses: nothing named (no `symbolize` permission
    /// needed).
    #[arg(long)]
    pub addresses: bool,
    /// How many stacks, the heaviest first (0: all).
    #[arg(short = 'n', long = "limit", value_name = "K", default_value_t = 0)]
    pub limit: u32,
    /// Show a root member another way than its type says (see `dump
    /// --render`).
    #[arg(long, value_name = "PATH=RENDERING", value_delimiter = ',', value_parser = parse_render)]
    pub render: Vec<RenderArg>,
    /// Write to FILE instead of stdout (a pprof profile goes to a file or a
    /// pipe, not a terminal).
    #[arg(short = 'o', long = "output", value_name = "FILE")]
    pub output: Option<PathBuf>,
    /// What the weights measure, for pprof's sample type and the SVG's
    /// counts ("microseconds" for offcputime's delta; default "count").
    #[arg(long, default_value = "count")]
    pub unit: String,
    /// The flame graph's title (SVG).
    #[arg(long, default_value = "Flame Graph")]
    pub title: String,
}

/// Parses `--by`; the error says which aggregates exist.
fn parse_aggregate(arg: &str) -> Result<bpfmap_client::Aggregate, String> {
    arg.parse().map_err(|e: Error| e.to_string())
}

/// A member shown another way than its type says (`--render
/// key.daddr=ipv4`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RenderArg {
    /// The member: "key.daddr", "value.stats.bytes", "key" for the whole
    /// key.
    pub path: String,
    /// How it is shown.
    pub rendering: Rendering,
}

/// `--render`'s long help: every rendering the typed model knows, and
/// what it shows (a test checks it names each of `Rendering::ALL`).
const RENDER_HELP: &str = "Show a member another way than its type says: PATH=RENDERING, PATH a \
member (\"key.daddr\", \"value.stats.bytes\", \"key\" for the whole key), repeatable or \
comma-separated, over the renderings the daemon's configuration gives the map. Renderings: \
ipv4 (4 bytes: 10.0.0.1), ipv6 (16 bytes), mac (6 bytes: 02:42:ac:11:00:02), hex (an integer \
as 0x1bb, other bytes as 0x0a0b), be16 and be32 (a number the program wrote in network \
order: a port), string (bytes as text up to their NULs, other bytes as \\xNN). A member that \
does not exist or fit is a usage error.";

/// Parses `PATH=RENDERING`; the error names what is wrong.
fn parse_render(arg: &str) -> Result<RenderArg, String> {
    let Some((path, how)) = arg.split_once('=') else {
        let names: Vec<&str> = Rendering::ALL.iter().map(|r| r.name()).collect();
        return Err(format!(
            "expected PATH=RENDERING, like key.daddr=ipv4 (renderings: {}), not {arg:?}",
            names.join(", ")
        ));
    };
    let one = std::collections::BTreeMap::from([(path.to_owned(), how.to_owned())]);
    let parsed = Renderings::parse(&one).map_err(|e| e.to_string())?;
    let (path, rendering) = parsed.iter().next().expect("one rendering parsed");
    Ok(RenderArg {
        path: path.to_owned(),
        rendering,
    })
}

/// The (path, rendering) pairs of `--render`.
pub(crate) fn render_pairs(render: &[RenderArg]) -> impl Iterator<Item = (&str, Rendering)> {
    render.iter().map(|r| (r.path.as_str(), r.rendering))
}

/// The arguments of `dump`.
#[derive(Debug, Args)]
pub struct DumpArgs {
    /// Map path relative to the daemon's root ("demo/flows"), "id:N", or
    /// "name:NAME" or "name:NAME@OWNER" (OWNER a program name, process name or pid).
    pub map: String,
    /// Entries per chunk (server default when 0).
    #[arg(long, default_value_t = 0)]
    pub chunk_size: u32,
    /// Stop after this many entries per target (0 = all).
    #[arg(long, default_value_t = 0)]
    pub limit: u64,
    /// Resume after this cursor (one target only; from an earlier
    /// summary).
    #[arg(long, allow_hyphen_values = true)]
    pub cursor: Option<String>,
    /// Do not resume automatically when a stream breaks.
    #[arg(long)]
    pub no_resume: bool,
    /// Write every target's cursor (and whether it finished) to FILE at
    /// the end, also when stopped or failing.
    #[arg(long, value_name = "FILE")]
    pub save_cursor: Option<PathBuf>,
    /// Continue from a file written by --save-cursor: each target from
    /// its own cursor; targets that finished are skipped. Without
    /// --target, the file's targets.
    #[arg(long, value_name = "FILE")]
    pub resume: Option<PathBuf>,
    /// Show a member another way than its type says: PATH=RENDERING, PATH
    /// a member ("key.daddr", "value.stats.bytes", "key" for the whole
    /// key), RENDERING one of those below (repeatable, or comma-separated).
    /// Over the renderings the daemon's configuration gives the map; a
    /// member that does not exist or fit is a usage error.
    #[arg(long, value_name = "PATH=RENDERING", value_delimiter = ',', value_parser = parse_render, long_help = RENDER_HELP)]
    pub render: Vec<RenderArg>,
    /// Only the entries for which this CEL expression is true, evaluated by
    /// each daemon ('key.dport == 443 && value.bytes > 1000000'); --limit
    /// counts matching entries.
    #[arg(long, value_name = "EXPR")]
    pub filter: Option<String>,
    /// Only these members of each entry ("key.daddr,value.bytes"; "key" or
    /// "value" whole), in this order.
    #[arg(long, value_name = "PATH", value_delimiter = ',')]
    pub fields: Vec<String>,
    /// How a filtered dump reads the map: auto (inside the kernel where
    /// each entry still comes exactly once: arrays), kernel (hash maps
    /// too, where an entry replaced during the walk can be missed; entries
    /// in key-byte order) or batched.
    #[arg(long, value_enum, default_value_t = ScanArg::Auto)]
    pub scan: ScanArg,
    /// Write the entries to FILE instead of stdout (the summaries still go
    /// to stderr).
    #[arg(long, short = 'o', value_name = "FILE")]
    pub output: Option<PathBuf>,
}

/// `--scan`: how a filtered dump reads the map.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum ScanArg {
    Auto,
    Kernel,
    Batched,
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
        [one] if total == 1 => one.error.as_ref().map(error_line).unwrap_or_default(),
        _ => format!("{} of {total} targets failed", failed.len()),
    }
}

/// An error as the summaries show it: the name of its code, and its text
/// without that name.
pub(crate) fn code_and_text(e: &Error) -> (&'static str, String) {
    let code = code_name(e.code());
    let text = e.to_string();
    let text = match text.strip_prefix(code).and_then(|t| t.strip_prefix(": ")) {
        Some(rest) => rest.to_owned(),
        None => text,
    };
    (code, text)
}

/// `CODE: text`.
fn error_line(e: &Error) -> String {
    let (code, text) = code_and_text(e);
    format!("{code}: {text}")
}

/// A usage error for the renderings some targets refused (a member their
/// types do not have, or that does not fit), if any did: the command line
/// needs fixing, not the targets.
pub(crate) fn refused_render(failed: &[TargetReport], total: usize) -> Option<anyhow::Error> {
    let (target, e) = failed.iter().find_map(|r| match &r.error {
        Some(e @ Error::Render { .. }) => Some((&r.target, e)),
        _ => None,
    })?;
    Some(if total == 1 {
        usage(e.to_string())
    } else {
        usage(format!("{target}: {e}"))
    })
}

/// A usage or configuration error (exit code 2).
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct Usage(pub String);

pub(crate) fn usage(message: impl Into<String>) -> anyhow::Error {
    Usage(message.into()).into()
}

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
    // Printing runs on this thread (`block_on`) and the connections on a
    // worker of their own: the transport keeps reading (and granting the
    // daemon flow-control window) while entries are decoded and written.
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
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

/// Runs one command, writing results to `out` and summaries to `err`.
pub async fn run_with(
    cli: Cli,
    out: &mut dyn io::Write,
    err: &mut dyn io::Write,
    terminals: Terminals,
) -> anyhow::Result<()> {
    let saved = match &cli.command {
        Command::Dump(args) => cursors::CursorFile::read(args)?,
        _ => None,
    };
    if cli.format == Some(Format::Arrow) && !matches!(cli.command, Command::Dump(_)) {
        return Err(usage(
            "--format arrow writes the table of a dump: use it with dump (json, table or hex elsewhere)",
        ));
    }
    if let Some(f) = cli.format.filter(|f| f.stacks_only())
        && !matches!(cli.command, Command::Stacks(_))
    {
        return Err(usage(format!(
            "--format {} writes stacks: use it with stacks (json, table or hex elsewhere)",
            format!("{f:?}").to_lowercase()
        )));
    }
    let setup = setup::Setup::new(&cli, saved.as_ref(), terminals).await?;
    let io = drive::Io { out, err };
    match cli.command {
        Command::List(args) => commands::list(setup, io, &args).await,
        Command::Show { map } => commands::show(setup, io, &map).await,
        Command::Lookup { map, keys, render } => {
            commands::lookup(setup, io, &map, &keys, &render).await
        }
        Command::Dump(args) => dump::run(setup, io, args, saved, terminals.stdout).await,
        Command::Top(args) => match args.interval {
            Some(every) => {
                watching::top(setup, io, args, every, cli.per_cpu, terminals.stdout).await
            }
            None => top::run(setup, io, args, cli.per_cpu).await,
        },
        Command::Hist(args) => hist::run(setup, io, args).await,
        Command::Bpftrace(args) => bpftrace::run(setup, io, args).await,
        Command::Stacks(args) => stacks::run(setup, io, args, cli.format, terminals.stdout).await,
        Command::Watch(args) => watching::watch(setup, io, args, cli.per_cpu).await,
        Command::Drain(_) if cli.relay.is_some() => Err(usage(
            "drain is not served by the relay: name the daemons with --target instead of --relay",
        )),
        Command::Drain(args) => drain::run(setup, io, args, cli.per_cpu, cli.ca.is_some()).await,
    }
}

#[cfg(test)]
mod tests {
    use bpfmap_client::Status;

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
            "top",
            "--target",
            "Exit codes",
            "130",
        ] {
            assert!(help.contains(word), "{word}: {help}");
        }
    }

    #[test]
    fn help_names_what_the_code_accepts() {
        use clap::CommandFactory as _;
        let mut cli = Cli::command();
        let dump = cli.find_subcommand_mut("dump").expect("dump");
        let help = dump.render_long_help().to_string();
        for r in Rendering::ALL {
            assert!(
                RENDER_HELP.contains(&format!("{} (", r.name()))
                    || RENDER_HELP.contains(&format!("{} and", r.name())),
                "--render's help does not name {r}"
            );
            assert!(help.contains(r.name()), "{r}: {help}");
        }
        for scan in ["auto", "kernel", "batched"] {
            assert!(help.contains(scan), "--scan {scan}: {help}");
        }
        let e = parse_render("key").unwrap_err();
        assert!(
            e.contains("ipv4, ipv6, mac, hex, be16, be32, string"),
            "{e}"
        );
    }

    #[test]
    fn render_takes_paths_and_renderings_repeated_or_comma_separated() {
        let cli = Cli::try_parse_from([
            "bpfmapctl",
            "dump",
            "m",
            "--render",
            "key.daddr=ipv4,key.saddr=ipv4",
            "--render",
            "value.mac=mac",
        ])
        .unwrap();
        let Command::Dump(args) = cli.command else {
            panic!("dump")
        };
        let pairs: Vec<(&str, Rendering)> = render_pairs(&args.render).collect();
        assert_eq!(
            pairs,
            [
                ("key.daddr", Rendering::Ipv4),
                ("key.saddr", Rendering::Ipv4),
                ("value.mac", Rendering::Mac)
            ]
        );
        let cli =
            Cli::try_parse_from(["bpfmapctl", "lookup", "m", "00", "--render", "key=hex"]).unwrap();
        let Command::Lookup { render, .. } = cli.command else {
            panic!("lookup")
        };
        assert_eq!(
            render,
            [RenderArg {
                path: "key".into(),
                rendering: Rendering::Hex
            }]
        );
        assert_eq!(
            parse_render("key.x=ipv9").unwrap_err(),
            "key.x: unknown rendering \"ipv9\"; use ipv4, ipv6, mac, hex, be16, be32 or string"
        );
        assert!(parse_render("x=ipv4").is_err());
        assert!(parse_render("key.x").is_err());
    }

    #[test]
    fn failures_are_described_by_their_code_and_text() {
        assert_eq!(
            error_line(&Status::not_found("gone").into()),
            "NOT_FOUND: gone"
        );
        let timeout = Error::Timeout {
            after: std::time::Duration::from_secs(2),
            retrying: None,
        };
        assert_eq!(
            error_line(&timeout),
            "DEADLINE_EXCEEDED: no answer within 2 s"
        );
        assert_eq!(
            code_and_text(&Status::unavailable("refused").into()),
            ("UNAVAILABLE", "refused".to_owned())
        );
        assert_eq!(describe(&[], 5), "0 of 5 targets failed");
    }
}
