//! `watch`: a map's changes on every target as JSON Lines; and `top
//! --interval`: the live top groups across the fleet by rate, full-screen
//! on a terminal, JSON Lines otherwise.

use std::{
    collections::{BTreeMap, HashMap},
    time::Duration,
};

use bpfmap_client::aggregate_values::{self as values, Op};
use bpfmap_client::{
    Aggregate, AggregateOp, EntryRef, Error, FleetEvent, FleetWatchOptions, PerCpuValues, Scan,
    Target, ValueRef, WatchOptions, pb,
};
use serde_json::{Value as Json, json};

use crate::{
    TopArgs, WatchArgs,
    drive::Io,
    live::{self, Cell, Row, Snapshot, ViewState},
    output::{Change, PerCpu, Printer, cell, push_object},
    render_pairs,
    setup::Setup,
    table::Table,
    usage,
};

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
    // Entries are decoded here through each target's types, as a dump's
    // are (members in declaration order); a projection's records through
    // the types its first scan describes.
    let mut types = if setup.decode && args.fields.is_empty() {
        crate::commands::map_types(&setup.fleet(), &map, &args.render).await?
    } else {
        HashMap::new()
    };
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
    let mut printer = setup.printer;
    let mut saved: BTreeMap<String, String> = cursors
        .iter()
        .map(|(t, c)| (t.to_string(), c.clone()))
        .collect();
    let (total, mut failed) = (setup.targets.len(), 0usize);
    while let Some(event) = futures::StreamExt::next(&mut run).await {
        match event {
            FleetEvent::Answer { target, answer } => {
                if let Some(p) = answer.projection().filter(|_| setup.decode)
                    && let Ok(t) = p.types_with(render_pairs(&args.render))
                {
                    types.insert(target.clone(), t);
                }
                let scan = Written {
                    printer: &mut printer,
                    types: types.get(&target),
                };
                scan.write(io.out, io.err, &target, &answer)?;
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

/// What a scan is written with: the printer, and the target's types.
struct Written<'a> {
    printer: &'a mut Printer,
    types: Option<&'a bpfmap_client::MapTypes>,
}

impl Written<'_> {
    /// One scan of one target: its resync, its events, its bookmark (JSON
    /// lines); a table has its events, and a resync said on `err`.
    fn write(
        mut self,
        out: &mut dyn std::io::Write,
        err: &mut dyn std::io::Write,
        target: &Target,
        scan: &Scan,
    ) -> anyhow::Result<()> {
        let t = target.as_str();
        let table = self.printer.format() == crate::output::Format::Table;
        if let Some(why) = scan.resync() {
            match table {
                true => writeln!(err, "{t}: started again from a fresh state: {why}")?,
                false => out.write_all(&crate::output::ordered_line(&[
                    ("target", json!(t)),
                    ("resync", json!(why)),
                ]))?,
            }
        }
        for e in scan.events() {
            self.event(out, target, e)?;
        }
        if !table {
            let b = scan.bookmark();
            let bookmark = json!({
                "revision": b.revision,
                "events": b.events_sent,
                "entries_scanned": b.entries_scanned,
                "initial": b.initial_state_end,
                "cursor": b.cursor,
            });
            let fields = [("target", json!(t)), ("bookmark", bookmark)];
            out.write_all(&crate::output::ordered_line(&fields))?;
        }
        out.flush()?;
        Ok(())
    }

    /// One event, its deltas in the members' declaration order (else
    /// their natural order: `slots[2]` before `slots[10]`).
    fn event(
        &mut self,
        out: &mut dyn std::io::Write,
        target: &Target,
        e: &pb::WatchEvent,
    ) -> anyhow::Result<()> {
        let entry = e.entry.clone().unwrap_or_default();
        let kind = pb::EventType::try_from(e.r#type).map_or("UNSPECIFIED", |k| k.as_str_name());
        let mut paths: Vec<&String> = e.delta.keys().collect();
        match self.types {
            Some(t) => {
                let order: Vec<String> =
                    t.layout().counters().into_iter().map(|c| c.path).collect();
                paths.sort_by_key(|p| order.iter().position(|o| o == *p).unwrap_or(usize::MAX));
            }
            None => paths.sort_by_cached_key(|p| natural_key(p)),
        }
        let deltas = paths
            .iter()
            .map(|p| {
                (
                    p.as_str(),
                    e.delta[*p].as_str(),
                    e.rate.get(*p).copied().unwrap_or(0.0),
                )
            })
            .collect();
        // A projection's records come decoded only: their bytes again,
        // from their decoded members, so that they print as a dump's do.
        let records = match (self.types, &entry.decoded_key, &entry.decoded_value) {
            (Some(t), Some(k), Some(v)) if entry.key.is_empty() => t
                .key()
                .encode(k, "key")
                .ok()
                .zip(t.value().encode(v, "value").ok()),
            _ => None,
        };
        let (key, value): (&[u8], ValueRef<'_>) = match &records {
            Some((k, v)) => (k, ValueRef::Single(v)),
            None if entry.per_cpu_values.is_empty() => (&entry.key, ValueRef::Single(&entry.value)),
            None => (
                &entry.key,
                ValueRef::PerCpu(PerCpuValues::from_slices(&entry.per_cpu_values)),
            ),
        };
        let change = Change {
            kind,
            entry: EntryRef { key, value },
            decoded: (entry.decoded_key.as_ref(), entry.decoded_value.as_ref()),
            deltas,
            resets: &e.resets,
        };
        let decodable = !entry.key.is_empty() || records.is_some();
        let types = self.types.filter(|_| decodable);
        Ok(self.printer.change(out, target, &change, types)?)
    }
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

/// A group's key: each group-by path to its member's value.
type GroupKey = BTreeMap<String, prost_types::Value>;

/// One group as a target last reported it: its key, its values (exact),
/// its rates.
struct Reported {
    key: GroupKey,
    values: Vec<Option<i128>>,
    rates: Vec<f64>,
}

/// A group merged over the targets: its key, its values (merged as the
/// daemons merge them: COUNT and SUM added, MIN of the minimums, MAX of
/// the maximums), its rates added up, and the targets that hold it.
struct Merged<'a> {
    key: &'a GroupKey,
    values: Vec<Option<i128>>,
    rates: Vec<f64>,
    targets: Vec<&'a Target>,
}

/// A group's key as the screen shows it: its one member's value, or
/// `name=value` pairs in `group_by`'s order.
fn key_text(key: &GroupKey, group_by: &[String]) -> String {
    match group_by {
        [] => "(all)".into(),
        [one] => key.get(one).map(cell).unwrap_or_default(),
        paths => paths
            .iter()
            .map(|p| {
                let name = p.rsplit('.').next().unwrap_or(p);
                format!("{name}={}", key.get(p).map(cell).unwrap_or_default())
            })
            .collect::<Vec<_>>()
            .join(" "),
    }
}

fn unit(a: &Aggregate) -> &'static str {
    match a.op() {
        AggregateOp::Sum if a.field().contains("bytes") => "B/s",
        _ => "/s",
    }
}

/// The live view of `top --interval`: what every target last reported,
/// merged into rows.
struct LiveTop {
    by: Vec<Aggregate>,
    group_by: Vec<String>,
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
    fn new(by: &[Aggregate], group_by: &[String]) -> Self {
        let mut headers = Vec::new();
        for a in by {
            headers.push(format!("rate({a})"));
            headers.push(a.to_string());
        }
        Self {
            by: by.to_vec(),
            group_by: group_by.to_vec(),
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
        for (target, table) in &self.tables {
            for (k, r) in table {
                let m = merged.entry(k.as_slice()).or_insert_with(|| Merged {
                    key: &r.key,
                    values: vec![None; self.ops.len()],
                    rates: vec![0.0; self.ops.len()],
                    targets: Vec::new(),
                });
                values::merge(&self.ops, &mut m.values, &r.values);
                for (sum, rate) in m.rates.iter_mut().zip(&r.rates) {
                    *sum += rate;
                }
                m.targets.push(target);
            }
        }
        for m in merged.values_mut() {
            m.targets.sort();
        }
        merged
    }

    /// The rows, largest rate of the first aggregate first, each with its
    /// key bytes and how many targets hold it.
    fn rows(&mut self) -> Vec<(Vec<u8>, Row, usize)> {
        let mut rows: Vec<(Vec<u8>, Row, usize)> = self
            .merged()
            .into_iter()
            .map(|(k, m)| (k.to_vec(), self.row(&m), m.targets.len()))
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
            key: key_text(m.key, &self.group_by),
            cells,
            history: Vec::new(),
        }
    }

    /// A round's rows off a terminal: a JSON line each (the targets that
    /// hold the group, the scan's time, its key, its exact values, its
    /// rates), or a table of them.
    fn write_round(
        &self,
        out: &mut dyn std::io::Write,
        rows: &[(Vec<u8>, Row, usize)],
        limit: usize,
        when: Option<f64>,
        table: bool,
    ) -> anyhow::Result<()> {
        let merged = self.merged();
        let names: Vec<String> = self.by.iter().map(ToString::to_string).collect();
        let mut t = table.then(|| {
            let mut header = self.group_by.clone();
            header.extend(self.headers.iter().cloned());
            header.push("TARGETS".into());
            Table::new(header)
        });
        for (k, row, _) in rows.iter().take(limit) {
            let m = &merged[k.as_slice()];
            if let Some(t) = &mut t {
                let mut cells: Vec<String> = self
                    .group_by
                    .iter()
                    .map(|p| m.key.get(p).map(cell).unwrap_or_default())
                    .collect();
                cells.extend(row.cells.iter().map(|c| c.text.clone()));
                cells.push(m.targets.len().to_string());
                t.row(out, &cells)?;
                continue;
            }
            out.write_all(&live_line(m, &self.group_by, &names, when))?;
        }
        if let Some(t) = &mut t {
            t.finish(out)?;
            writeln!(out)?;
        }
        out.flush()?;
        Ok(())
    }
}

/// `{"targets":[..],"scan_time":T,"key":{..},"values":{..},"rates":{..}}`:
/// a live top's row, its values as exact decimal strings (as a one-shot
/// top's), its rates per second.
fn live_line(m: &Merged<'_>, group_by: &[String], names: &[String], when: Option<f64>) -> Vec<u8> {
    let mut line = b"{\"targets\":".to_vec();
    let targets: Vec<&str> = m.targets.iter().map(|t| t.as_str()).collect();
    line.extend_from_slice(json!(targets).to_string().as_bytes());
    line.extend_from_slice(b",\"scan_time\":");
    line.extend_from_slice(json!(when).to_string().as_bytes());
    line.extend_from_slice(b",\"key\":");
    crate::top::key_object(&mut line, group_by, m.key);
    let values = names.iter().zip(&m.values).map(|(n, v)| {
        let v = v.map_or(Json::Null, |v| json!(v.to_string()));
        (n.as_str(), v)
    });
    line.extend_from_slice(b",\"values\":");
    push_object(&mut line, values);
    let rates = names
        .iter()
        .zip(&m.rates)
        .map(|(n, r)| (n.as_str(), json!(r)));
    line.extend_from_slice(b",\"rates\":");
    push_object(&mut line, rates);
    line.extend_from_slice(b"}\n");
    line
}

/// One group of a target's scan into its table (a removed group out).
fn apply_group(table: &mut HashMap<Vec<u8>, Reported>, g: &pb::WatchGroup) {
    let Some(group) = &g.group else { return };
    if g.removed {
        table.remove(&group.key_bytes);
        return;
    }
    let key = group.key.clone().unwrap_or_default().fields;
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
    let table = setup.printer.format() == crate::output::Format::Table;
    let options = top_watch(&args, interval, per_cpu);
    let mut run = setup
        .fleet()
        .watch(&map, FleetWatchOptions::default().with_watch(options));
    setup.progress.finish();
    let total = setup.targets.len();
    let mut view = LiveTop::new(&args.by, &args.group_by);
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
            view.write_round(io.out, &rows, limit, when, table)?;
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
