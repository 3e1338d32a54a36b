//! `watch`: a map's changes on every target as JSON Lines; and `top
//! --interval`: the live top groups across the fleet by rate, full-screen
//! on a terminal, JSON Lines otherwise.

use std::{
    collections::{BTreeMap, HashMap},
    time::Duration,
};

use bpfmap_client::{Aggregate, AggregateOp, FleetScan, Target, WatchOptions, pb};
use serde_json::{Value as Json, json};

use crate::{
    TopArgs, WatchArgs,
    drive::Io,
    live::{self, Cell, Row, Snapshot, ViewState},
    output::PerCpu,
    render_pairs,
    setup::{Setup, map_name},
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
    let map = map_name(&args.map)?;
    let mut options = WatchOptions::default()
        .with_interval(args.interval)
        .with_fields(args.fields.iter().cloned())
        .with_render(render_pairs(&args.render))
        .with_per_cpu(match per_cpu {
            PerCpu::Sum => bpfmap_client::PerCpu::Sum,
            PerCpu::List => bpfmap_client::PerCpu::Each,
        });
    if let Some(f) = &args.filter {
        options = options.with_filter(f);
    }
    let cursors = start_cursors(args.cursor.as_deref(), &setup.targets)?;
    let mut fleet = setup.fleet().watch(&map, options, &cursors);
    setup.progress.finish();
    let mut saved: BTreeMap<String, String> = cursors
        .iter()
        .map(|(t, c)| (t.to_string(), c.clone()))
        .collect();
    let mut live = fleet.targets();
    let mut failed = 0usize;
    while live > 0 {
        let Some(FleetScan {
            target,
            scan,
            ended,
        }) = fleet.next().await
        else {
            break;
        };
        let t = target.to_string();
        match scan {
            Ok(scan) => {
                if let Some(why) = scan.resync() {
                    writeln!(io.out, "{}", json!({"target": t, "resync": why}))?;
                }
                for e in scan.events() {
                    let entry = e.entry.clone().unwrap_or_default();
                    let kind = pb::EventType::try_from(e.r#type)
                        .map_or("UNSPECIFIED", |k| k.as_str_name());
                    let mut line = json!({
                        "target": t,
                        "type": kind,
                        "key": if entry.decoded_key.is_some() { json_of(entry.decoded_key.as_ref()) } else { json!(hex(&entry.key)) },
                        "value": if entry.decoded_value.is_some() { json_of(entry.decoded_value.as_ref()) } else { json!(hex(&entry.value)) },
                    });
                    if !e.delta.is_empty() {
                        line["delta"] = json!(e.delta.iter().collect::<BTreeMap<_, _>>());
                        line["rate"] = json!(e.rate.iter().collect::<BTreeMap<_, _>>());
                    }
                    if !e.resets.is_empty() {
                        line["resets"] = json!(e.resets);
                    }
                    writeln!(io.out, "{line}")?;
                }
                let b = scan.bookmark();
                writeln!(
                    io.out,
                    "{}",
                    json!({"target": t, "bookmark": {
                        "revision": b.revision,
                        "events": b.events_sent,
                        "entries_scanned": b.entries_scanned,
                        "initial": b.initial_state_end,
                        "cursor": b.cursor,
                    }})
                )?;
                io.out.flush()?;
                saved.insert(t, b.cursor.clone());
                if let Some(path) = &args.save_cursor {
                    save_cursors(path, &saved)?;
                }
            }
            Err(e) => {
                writeln!(io.err, "{t}: {e}{}", if ended { "" } else { " (retrying)" })?;
                if ended {
                    live -= 1;
                    failed += 1;
                }
            }
        }
    }
    if failed > 0 {
        anyhow::bail!("the watch ended on {failed} of {} targets", fleet.targets());
    }
    Ok(())
}

/// A group added up over the targets: its key, values, rates, and how
/// many targets hold it.
type Merged<'a> = (&'a Json, Vec<f64>, Vec<f64>, usize);

/// One target's groups: key bytes to (key, values, rates).
type Groups = HashMap<Vec<u8>, (Json, Vec<f64>, Vec<f64>)>;

fn number(v: &prost_types::Value) -> f64 {
    match &v.kind {
        Some(prost_types::value::Kind::StringValue(s)) => s.parse().unwrap_or(f64::NAN),
        Some(prost_types::value::Kind::NumberValue(n)) => *n,
        _ => f64::NAN,
    }
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

/// `top MAP --by AGG --interval D`: the live top groups across the
/// fleet, by the rate of the first aggregate.
pub(crate) async fn top(
    setup: Setup,
    io: Io<'_>,
    args: TopArgs,
    interval: Duration,
    terminal: bool,
) -> anyhow::Result<()> {
    let map = map_name(&args.map)?;
    let mut options = WatchOptions::default()
        .with_interval(interval)
        .with_group_by(args.group_by.iter().cloned())
        .with_aggregates(args.by.iter().cloned())
        .with_render(render_pairs(&args.render));
    if let Some(f) = &args.filter {
        options = options.with_filter(f);
    }
    let mut fleet = setup.fleet().watch(&map, options, &HashMap::new());
    setup.progress.finish();
    let total = fleet.targets();
    let mut tables: HashMap<Target, Groups> = HashMap::new();
    let mut failing: BTreeMap<String, String> = BTreeMap::new();
    let mut history: HashMap<Vec<u8>, Vec<u64>> = HashMap::new();
    let mut headers = Vec::new();
    for a in &args.by {
        headers.push(format!("rate({a})"));
        headers.push(a.to_string());
    }
    let title = format!(
        "{} by rate({}){}",
        args.map,
        args.by[0],
        if args.group_by.is_empty() {
            String::new()
        } else {
            format!(" per {}", args.group_by.join(","))
        }
    );
    let (tx, rx) = tokio::sync::watch::channel(Snapshot {
        title: title.clone(),
        key_header: args.group_by.join(","),
        headers: headers.clone(),
        rows: Vec::new(),
        hosts_ok: 0,
        hosts_total: total,
        failing: Vec::new(),
        scan_time: None,
        interval,
    });
    let view = ViewState {
        sort: 0,
        ascending: false,
        limit: args.limit as usize,
        paused: false,
    };
    let mut screen = terminal.then(|| tokio::spawn(live::run(rx, view)));
    let mut ended = 0usize;
    loop {
        let next = fleet.next_round(interval / 2);
        let round = match screen.as_mut() {
            // The user quits: the screen's task ends.
            Some(s) => tokio::select! {
                r = next => r,
                done = s => return Ok(done??),
            },
            None => next.await,
        };
        let Some(round) = round else { break };
        let mut scan_time = None;
        for FleetScan {
            target,
            scan,
            ended: over,
        } in round
        {
            let name = target.to_string();
            let scan = match scan {
                Ok(s) => {
                    failing.remove(&name);
                    s
                }
                Err(e) => {
                    failing.insert(name.clone(), e.to_string());
                    if over {
                        tables.remove(&target);
                        ended += 1;
                        if ended == total {
                            if let Some(s) = screen {
                                s.abort();
                            }
                            anyhow::bail!("{name}: {e}");
                        }
                    }
                    continue;
                }
            };
            scan_time = scan_time.max(scan.scan_time());
            let table = tables.entry(target.clone()).or_default();
            if scan.is_initial() || scan.resync().is_some() {
                table.clear();
            }
            for g in scan.groups() {
                let Some(group) = &g.group else { continue };
                if g.removed {
                    table.remove(&group.key_bytes);
                    continue;
                }
                let key = json_of(Some(&prost_types::Value {
                    kind: Some(prost_types::value::Kind::StructValue(
                        group.key.clone().unwrap_or_default(),
                    )),
                }));
                let values = group.values.iter().map(number).collect();
                table.insert(group.key_bytes.clone(), (key, values, g.rates.clone()));
            }
        }
        // Merge: values and rates added up over the targets.
        let mut merged: HashMap<&[u8], Merged<'_>> = HashMap::new();
        for t in tables.values() {
            for (k, (key, values, rates)) in t {
                let e = merged
                    .entry(k.as_slice())
                    .or_insert_with(|| (key, vec![0.0; values.len()], vec![0.0; values.len()], 0));
                for (i, v) in values.iter().enumerate() {
                    e.1[i] += v;
                    e.2[i] += rates.get(i).copied().unwrap_or(0.0);
                }
                e.3 += 1;
            }
        }
        let mut rows: Vec<(Vec<u8>, Row, usize)> = merged
            .into_iter()
            .map(|(k, (key, values, rates, hosts))| {
                let mut cells = Vec::new();
                for (i, a) in args.by.iter().enumerate() {
                    let r = rates[i];
                    cells.push(Cell {
                        text: live::human_rate(r, unit(a)),
                        sort: r,
                    });
                    cells.push(Cell {
                        text: format!("{:.0}", values[i]),
                        sort: values[i],
                    });
                }
                (
                    k.to_vec(),
                    Row {
                        key: key_text(key),
                        cells,
                        history: Vec::new(),
                    },
                    hosts,
                )
            })
            .collect();
        for (k, row, _) in &mut rows {
            let h = history.entry(k.clone()).or_default();
            h.push(row.cells[0].sort.max(0.0) as u64);
            if h.len() > 60 {
                h.remove(0);
            }
            row.history = h.clone();
        }
        history.retain(|k, _| rows.iter().any(|(r, ..)| r == k));
        rows.sort_by(|a, b| b.1.cells[0].sort.total_cmp(&a.1.cells[0].sort));
        if screen.is_none() {
            let when = scan_time.map(|t| {
                t.duration_since(std::time::UNIX_EPOCH)
                    .unwrap_or_default()
                    .as_secs_f64()
            });
            let limit = if args.limit == 0 {
                rows.len()
            } else {
                args.limit as usize
            };
            for (_, row, hosts) in rows.iter().take(limit) {
                let mut line = json!({"key": row.key, "scan_time": when, "hosts": hosts});
                for (i, h) in headers.iter().enumerate() {
                    line[h] = json!(row.cells[i].sort);
                }
                writeln!(io.out, "{line}")?;
            }
            io.out.flush()?;
        }
        let _ = tx.send(Snapshot {
            title: title.clone(),
            key_header: args.group_by.join(","),
            headers: headers.clone(),
            rows: rows.into_iter().map(|(_, r, _)| r).collect(),
            hosts_ok: tables.len().saturating_sub(failing.len()),
            hosts_total: total,
            failing: failing
                .iter()
                .map(|(k, v)| (k.clone(), v.clone()))
                .collect(),
            scan_time,
            interval,
        });
    }
    if let Some(s) = screen {
        s.await??;
    }
    Ok(())
}
