//! `watch`: a map's changes on every target as JSON Lines; and `top
//! --interval`: the live top groups across the fleet by rate, full-screen
//! on a terminal, JSON Lines otherwise.

use std::{
    collections::{BTreeMap, HashMap},
    time::Duration,
};

use bpfmap_client::aggregate_values::{self as values, Op};
use bpfmap_client::{
    Aggregate, AggregateOp, Error, FleetEvent, FleetWatchOptions, Scan, Target, WatchOptions, pb,
};
use serde_json::{Value as Json, json};

use crate::{
    TopArgs, WatchArgs,
    drive::Io,
    live::{self, Cell, Row, Snapshot, ViewState},
    output::PerCpu,
    render_pairs,
    setup::Setup,
    usage,
};

fn json_of(v: Option<&prost_types::Value>) -> Json {
    use prost_types::value::Kind;
    let Some(v) = v else { return Json::Null };
    match &v.kind {
        Some(Kind::NumberValue(n)) if n.fract() == 0.0 && n.abs() < 9.0e15 => json!(*n as i64),
        Some(Kind::NumberValue(n)) => json!(n),
        Some(Kind::StringValue(s)) => json!(s),
        Some(Kind::BoolValue(b)) => json!(b),
        Some(Kind::StructValue(s)) => Json::Object(
            s.fields
                .iter()
                .map(|(k, v)| (k.clone(), json_of(Some(v))))
                .collect(),
        ),
        Some(Kind::ListValue(l)) => {
            Json::Array(l.values.iter().map(|v| json_of(Some(v))).collect())
        }
        _ => Json::Null,
    }
}

fn hex(b: &[u8]) -> String {
    faster_hex::hex_string(b)
}

/// The cursors to start from: `--cursor` is a cursor (every target) or a
/// file written by `--save-cursor`.
fn start_cursors(arg: Option<&str>, targets: &[Target]) -> anyhow::Result<HashMap<Target, String>> {
    let Some(arg) = arg else {
        return Ok(HashMap::new());
    };
    if let Ok(text) = std::fs::read_to_string(arg) {
        let saved: BTreeMap<String, String> = serde_json::from_str(&text)
            .map_err(|e| usage(format!("--cursor {arg}: not a file of cursors ({e})")))?;
        return Ok(targets
            .iter()
            .filter_map(|t| saved.get(&t.to_string()).map(|c| (t.clone(), c.clone())))
            .collect());
    }
    Ok(targets
        .iter()
        .map(|t| (t.clone(), arg.to_owned()))
        .collect())
}

fn save_cursors(path: &str, cursors: &BTreeMap<String, String>) -> anyhow::Result<()> {
    let tmp = format!("{path}.tmp");
    std::fs::write(&tmp, serde_json::to_vec_pretty(cursors)?)?;
    std::fs::rename(&tmp, path)?;
    Ok(())
}

/// `watch MAP`: every event and bookmark of every target, one JSON object
/// per line, until interrupted.
pub(crate) async fn watch(
    setup: Setup,
    io: Io<'_>,
    args: WatchArgs,
    per_cpu: PerCpu,
) -> anyhow::Result<()> {
    let map = setup.map_name(&args.map)?;
    let mut options = WatchOptions::default()
        .with_interval(args.interval)
        .with_fields(args.fields.iter().cloned())
        .with_render(render_pairs(&args.render))
        .with_per_cpu(per_cpu.into());
    if let Some(f) = &args.filter {
        options = options.with_filter(f);
    }
    let cursors = start_cursors(args.cursor.as_deref(), &setup.targets)?;
    let fleet_options = FleetWatchOptions::default()
        .with_watch(options)
        .with_cursors(cursors.clone());
    let mut run = setup.fleet().watch(&map, fleet_options);
    setup.progress.finish();
    let mut saved: BTreeMap<String, String> = cursors
        .iter()
        .map(|(t, c)| (t.to_string(), c.clone()))
        .collect();
    let (total, mut failed) = (setup.targets.len(), 0usize);
    while let Some(event) = futures::StreamExt::next(&mut run).await {
        match event {
            FleetEvent::Answer { target, answer } => {
                write_scan(io.out, &target, &answer)?;
                saved.insert(target.to_string(), answer.cursor().to_owned());
                if let Some(path) = &args.save_cursor {
                    save_cursors(path, &saved)?;
                }
            }
            FleetEvent::Retrying { target, error } => {
                writeln!(io.err, "{target}: {error} (retrying)")?;
            }
            FleetEvent::Done(report) => {
                if let Some(e) = &report.error {
                    writeln!(io.err, "{}: {e}", report.target)?;
                    failed += 1;
                }
            }
            _ => {}
        }
    }
    if failed > 0 {
        anyhow::bail!("the watch ended on {failed} of {total} targets");
    }
    Ok(())
}

/// One scan of one target: its resync, its events, its bookmark.
fn write_scan(out: &mut dyn std::io::Write, target: &Target, scan: &Scan) -> anyhow::Result<()> {
    let t = target.as_str();
    if let Some(why) = scan.resync() {
        writeln!(out, "{}", json!({"target": t, "resync": why}))?;
    }
    for e in scan.events() {
        writeln!(out, "{}", event_line(t, e))?;
    }
    let b = scan.bookmark();
    let bookmark = json!({"target": t, "bookmark": {
        "revision": b.revision,
        "events": b.events_sent,
        "entries_scanned": b.entries_scanned,
        "initial": b.initial_state_end,
        "cursor": b.cursor,
    }});
    writeln!(out, "{bookmark}")?;
    out.flush()?;
    Ok(())
}

/// An event as a JSON line: its type, key and value (decoded, or hex),
/// deltas, rates and resets; deltas and rates in the members' natural
/// order (`slots[2]` before `slots[10]`).
fn event_line(target: &str, e: &pb::WatchEvent) -> String {
    let entry = e.entry.clone().unwrap_or_default();
    let kind = pb::EventType::try_from(e.r#type).map_or("UNSPECIFIED", |k| k.as_str_name());
    let key = match &entry.decoded_key {
        Some(k) => json_of(Some(k)),
        None => json!(hex(&entry.key)),
    };
    let mut line = json!({"target": target, "type": kind, "key": key});
    match &entry.decoded_value {
        Some(v) => line["value"] = json_of(Some(v)),
        // Per-CPU values in hex, as a dump prints them.
        None if !entry.per_cpu_values.is_empty() => {
            let values: Vec<String> = entry.per_cpu_values.iter().map(|v| hex(v)).collect();
            line["per_cpu_values"] = json!(values);
        }
        None => line["value"] = json!(hex(&entry.value)),
    }
    if !e.resets.is_empty() {
        line["resets"] = json!(e.resets);
    }
    let mut text = line.to_string();
    if !e.delta.is_empty() {
        let mut paths: Vec<&String> = e.delta.keys().collect();
        paths.sort_by_cached_key(|p| natural_key(p));
        let object = |values: &mut dyn FnMut(&str) -> Json| {
            let members: Vec<String> = paths
                .iter()
                .map(|p| format!("{}:{}", Json::from(p.as_str()), values(p)))
                .collect();
            format!("{{{}}}", members.join(","))
        };
        let delta = object(&mut |p| json!(e.delta[p]));
        let rate = object(&mut |p| json!(e.rate.get(p).copied().unwrap_or(0.0)));
        text.pop(); // the closing brace
        text.push_str(&format!(",\"delta\":{delta},\"rate\":{rate}}}"));
    }
    text
}

/// A sort key that orders the numbers in a path by value: `slots[2]`
/// before `slots[10]`.
fn natural_key(path: &str) -> Vec<(String, u64)> {
    let mut out = Vec::new();
    let mut text = String::new();
    let mut chars = path.chars().peekable();
    while let Some(c) = chars.next() {
        if c.is_ascii_digit() {
            let mut n = u64::from(c as u8 - b'0');
            while let Some(d) = chars.peek().and_then(|d| d.to_digit(10)) {
                n = n.saturating_mul(10).saturating_add(u64::from(d));
                chars.next();
            }
            out.push((std::mem::take(&mut text), n));
        } else {
            text.push(c);
        }
    }
    out.push((text, 0));
    out
}

/// One group as a target last reported it: its key, its values (exact),
/// its rates.
struct Reported {
    key: Json,
    values: Vec<Option<i128>>,
    rates: Vec<f64>,
}

/// A group merged over the targets: its key, its values (merged as the
/// daemons merge them: COUNT and SUM added, MIN of the minimums, MAX of
/// the maximums), its rates added up, and how many targets hold it.
struct Merged<'a> {
    key: &'a Json,
    values: Vec<Option<i128>>,
    rates: Vec<f64>,
    hosts: usize,
}

fn key_text(key: &Json) -> String {
    match key.as_object() {
        Some(o) if o.len() == 1 => cell_text(o.values().next().expect("one member")),
        Some(o) if o.is_empty() => "(all)".into(),
        Some(o) => o
            .iter()
            .map(|(k, v)| format!("{}={}", k.rsplit('.').next().unwrap_or(k), cell_text(v)))
            .collect::<Vec<_>>()
            .join(" "),
        None => key.to_string(),
    }
}

fn cell_text(v: &Json) -> String {
    match v {
        Json::String(s) => s.clone(),
        v => v.to_string(),
    }
}

fn unit(a: &Aggregate) -> &'static str {
    match a.op() {
        AggregateOp::Sum if a.field().contains("bytes") => "B/s",
        _ => "/s",
    }
}

/// An exact value as JSON: a number when it fits 64 bits, a decimal
/// string beyond; null for the MIN or MAX of nothing.
fn exact(v: Option<i128>) -> Json {
    match v {
        None => Json::Null,
        Some(v) => i64::try_from(v)
            .map(Json::from)
            .or_else(|_| u64::try_from(v).map(Json::from))
            .unwrap_or_else(|_| json!(v.to_string())),
    }
}

/// The live view of `top --interval`: what every target last reported,
/// merged into rows.
struct LiveTop {
    by: Vec<Aggregate>,
    ops: Vec<Op>,
    /// Each target's groups: key bytes to what it reported.
    tables: HashMap<Target, HashMap<Vec<u8>, Reported>>,
    /// Targets failing now, and why.
    failing: BTreeMap<String, String>,
    /// Targets whose watch ended.
    ended: usize,
    /// Recent rates of the sort column, per group.
    history: HashMap<Vec<u8>, Vec<u64>>,
    headers: Vec<String>,
}

impl LiveTop {
    fn new(by: &[Aggregate]) -> Self {
        let mut headers = Vec::new();
        for a in by {
            headers.push(format!("rate({a})"));
            headers.push(a.to_string());
        }
        Self {
            by: by.to_vec(),
            ops: by.iter().map(|a| a.op().to_proto()).collect(),
            tables: HashMap::new(),
            failing: BTreeMap::new(),
            ended: 0,
            history: HashMap::new(),
            headers,
        }
    }

    /// Takes in one event of a round.
    fn apply(&mut self, event: FleetEvent<Scan>) {
        match event {
            FleetEvent::Answer { target, answer } => {
                self.failing.remove(target.as_str());
                let table = self.tables.entry(target).or_default();
                if answer.is_initial() || answer.resync().is_some() {
                    table.clear();
                }
                for g in answer.groups() {
                    apply_group(table, g);
                }
            }
            FleetEvent::Retrying { target, error } => self.fail(&target, &error),
            FleetEvent::Done(report) => {
                if let Some(e) = &report.error {
                    self.fail(&report.target, e);
                }
                self.tables.remove(&report.target);
                self.ended += 1;
            }
            _ => {}
        }
    }

    fn fail(&mut self, target: &Target, error: &Error) {
        self.failing.insert(target.to_string(), error.to_string());
    }

    /// Every group merged over the targets.
    fn merged(&self) -> HashMap<&[u8], Merged<'_>> {
        let mut merged: HashMap<&[u8], Merged<'_>> = HashMap::new();
        for table in self.tables.values() {
            for (k, r) in table {
                let m = merged.entry(k.as_slice()).or_insert_with(|| Merged {
                    key: &r.key,
                    values: vec![None; self.ops.len()],
                    rates: vec![0.0; self.ops.len()],
                    hosts: 0,
                });
                values::merge(&self.ops, &mut m.values, &r.values);
                for (sum, rate) in m.rates.iter_mut().zip(&r.rates) {
                    *sum += rate;
                }
                m.hosts += 1;
            }
        }
        merged
    }

    /// The rows, largest rate of the first aggregate first, each with its
    /// key bytes and its hosts.
    fn rows(&mut self) -> Vec<(Vec<u8>, Row, usize)> {
        let mut rows: Vec<(Vec<u8>, Row, usize)> = self
            .merged()
            .into_iter()
            .map(|(k, m)| (k.to_vec(), self.row(&m), m.hosts))
            .collect();
        for (k, row, _) in &mut rows {
            let h = self.history.entry(k.clone()).or_default();
            h.push(row.cells[0].sort.max(0.0) as u64);
            if h.len() > 60 {
                h.remove(0);
            }
            row.history = h.clone();
        }
        self.history
            .retain(|k, _| rows.iter().any(|(r, ..)| r == k));
        rows.sort_by(|a, b| b.1.cells[0].sort.total_cmp(&a.1.cells[0].sort));
        rows
    }

    fn row(&self, m: &Merged<'_>) -> Row {
        let mut cells = Vec::new();
        for (i, a) in self.by.iter().enumerate() {
            cells.push(Cell {
                text: live::human_rate(m.rates[i], unit(a)),
                sort: m.rates[i],
            });
            cells.push(Cell {
                text: m.values[i].map_or_else(|| "-".to_owned(), |v| v.to_string()),
                sort: m.values[i].map_or(f64::NAN, |v| v as f64),
            });
        }
        Row {
            key: key_text(m.key),
            cells,
            history: Vec::new(),
        }
    }

    /// A JSON line per row (off a terminal): its key, the scan's time,
    /// its hosts, each rate and each exact value.
    fn write_lines(
        &self,
        out: &mut dyn std::io::Write,
        rows: &[(Vec<u8>, Row, usize)],
        limit: usize,
        when: Option<f64>,
    ) -> anyhow::Result<()> {
        let merged = self.merged();
        for (k, row, hosts) in rows.iter().take(limit) {
            let mut line = json!({"key": row.key, "scan_time": when, "hosts": hosts});
            for (i, a) in self.by.iter().enumerate() {
                line[&self.headers[2 * i]] = json!(row.cells[2 * i].sort);
                line[&a.to_string()] = exact(merged[k.as_slice()].values[i]);
            }
            writeln!(out, "{line}")?;
        }
        out.flush()?;
        Ok(())
    }
}

/// One group of a target's scan into its table (a removed group out).
fn apply_group(table: &mut HashMap<Vec<u8>, Reported>, g: &pb::WatchGroup) {
    let Some(group) = &g.group else { return };
    if g.removed {
        table.remove(&group.key_bytes);
        return;
    }
    let key = json_of(Some(&prost_types::Value {
        kind: Some(prost_types::value::Kind::StructValue(
            group.key.clone().unwrap_or_default(),
        )),
    }));
    let values = group
        .values
        .iter()
        .map(|v| values::parse(v).ok().flatten())
        .collect();
    let reported = Reported {
        key,
        values,
        rates: g.rates.clone(),
    };
    table.insert(group.key_bytes.clone(), reported);
}

/// `top MAP --by AGG --interval D`: the live top groups across the
/// fleet, by the rate of the first aggregate.
pub(crate) async fn top(
    setup: Setup,
    io: Io<'_>,
    args: TopArgs,
    interval: Duration,
    per_cpu: PerCpu,
    terminal: bool,
) -> anyhow::Result<()> {
    let map = setup.map_name(&args.map)?;
    let options = top_watch(&args, interval, per_cpu);
    let mut run = setup
        .fleet()
        .watch(&map, FleetWatchOptions::default().with_watch(options));
    setup.progress.finish();
    let total = setup.targets.len();
    let mut view = LiveTop::new(&args.by);
    let (tx, rx) = tokio::sync::watch::channel(snapshot(&args, &view, interval, total));
    let state = ViewState {
        sort: 0,
        ascending: false,
        limit: args.limit as usize,
        paused: false,
    };
    let mut screen = terminal.then(|| tokio::spawn(live::run(rx, state)));
    loop {
        let next = run.next_round(interval / 2);
        let round = match screen.as_mut() {
            // The user quits: the screen's task ends.
            Some(s) => tokio::select! {
                r = next => r,
                done = s => return Ok(done??),
            },
            None => next.await,
        };
        let Some(round) = round else { break };
        let scan_time = round_time(&round);
        for event in round {
            view.apply(event);
        }
        if view.ended == total {
            if let Some(s) = screen {
                s.abort();
            }
            let why = view.failing.iter().next().map(|(t, e)| format!("{t}: {e}"));
            anyhow::bail!(
                "{}",
                why.unwrap_or_else(|| "every target's watch ended".into())
            );
        }
        let rows = view.rows();
        if screen.is_none() {
            let limit = if args.limit == 0 {
                rows.len()
            } else {
                args.limit as usize
            };
            let when = scan_time.map(|t| {
                t.duration_since(std::time::UNIX_EPOCH)
                    .unwrap_or_default()
                    .as_secs_f64()
            });
            view.write_lines(io.out, &rows, limit, when)?;
        }
        let mut snap = snapshot(&args, &view, interval, total);
        snap.rows = rows.into_iter().map(|(_, r, _)| r).collect();
        snap.scan_time = scan_time;
        let _ = tx.send(snap);
    }
    if let Some(s) = screen {
        s.await??;
    }
    Ok(())
}

/// The aggregated watch a live top runs.
fn top_watch(args: &TopArgs, interval: Duration, per_cpu: PerCpu) -> WatchOptions {
    let options = WatchOptions::default()
        .with_interval(interval)
        .with_group_by(args.group_by.iter().cloned())
        .with_aggregates(args.by.iter().cloned())
        .with_per_cpu(per_cpu.into())
        .with_render(render_pairs(&args.render));
    match &args.filter {
        Some(f) => options.with_filter(f),
        None => options,
    }
}

/// The latest scan time of a round.
fn round_time(round: &[FleetEvent<Scan>]) -> Option<std::time::SystemTime> {
    round
        .iter()
        .filter_map(|e| match e {
            FleetEvent::Answer { answer, .. } => answer.scan_time(),
            _ => None,
        })
        .max()
}

/// What the screen shows, without rows.
fn snapshot(args: &TopArgs, view: &LiveTop, interval: Duration, total: usize) -> Snapshot {
    let per = if args.group_by.is_empty() {
        String::new()
    } else {
        format!(" per {}", args.group_by.join(","))
    };
    Snapshot {
        title: format!("{} by rate({}){per}", args.map, args.by[0]),
        key_header: args.group_by.join(","),
        headers: view.headers.clone(),
        rows: Vec::new(),
        hosts_ok: view.tables.len().saturating_sub(view.failing.len()),
        hosts_total: total,
        failing: view
            .failing
            .iter()
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect(),
        scan_time: None,
        interval,
    }
}
