//! `hist`: a map that keeps a histogram, drawn as the program that keeps it
//! draws it (libbpf-tools' `usecs : count distribution`, bpftrace's
//! `[4, 8)  12 |@@@@ |`), or as JSON data; summed by each daemon, merged
//! exactly across the targets, per interval with `--interval`.

use std::{fmt::Write as _, io};

use bpfmap_client::{
    FleetHistograms, HistogramLayout, HistogramOptions, Histograms, histogram_math as math,
    pb::{self, histogram_layout::Buckets},
};
use serde_json::json;

use crate::{
    HistArgs, Interrupted, code_and_text,
    drive::{Io, interrupted},
    output::{Format, cell},
    render_pairs,
    setup::Setup,
    table::safe,
    usage,
};

/// `hist MAP [--hist KIND] ...`.
pub(crate) async fn run(setup: Setup, io: Io<'_>, mut args: HistArgs) -> anyhow::Result<()> {
    let mut map = setup.map_name(&args.map)?;
    let fleet = setup.fleet();
    // A bpftrace hist() or lhist() keyed by more than its bucket: its key
    // as the script says, the bucket last, one histogram per key.
    let undeclared = args.hist.is_none() && args.bucket.is_none() && args.slots.is_none();
    if undeclared
        && map.declared_key().is_none()
        && let Some(script) = bpftrace_script(&fleet, &map).await
        && let Some(keyed) = KeyedBpftrace::of(&script)
    {
        map = map.with_types(keyed.key, "");
        args.hist = Some(keyed.buckets.into());
        args.bucket = Some("key.bucket".into());
        if keyed.buckets == "bpftrace-linear" {
            (args.min, args.max, args.step) =
                (Some(script.min), Some(script.max), Some(script.step));
        }
        if args.group_by.is_empty() {
            args.group_by = keyed.members;
        }
    }
    let options = options(&args)?;
    let Some(every) = args.interval else {
        let merged = fleet.histogram(&map, options).await;
        setup.progress.finish();
        refused(&merged.reports)?;
        draw(
            io.out,
            &setup,
            &args,
            &merged.histograms,
            merged.layout.as_ref(),
        )?;
        return finish(io.err, &merged);
    };
    let mut before = fleet.histogram(&map, options.clone()).await;
    setup.progress.finish();
    refused(&before.reports)?;
    let mut shown = 0u64;
    loop {
        let signal = tokio::select! {
            () = tokio::time::sleep(every) => None,
            s = interrupted() => Some(s),
        };
        if let Some(s) = signal {
            return Err(Interrupted(s).into());
        }
        let now = fleet.histogram(&map, options.clone()).await;
        let (Some(layout), Some(_)) = (now.layout.clone(), before.layout.as_ref()) else {
            finish(io.err, &now)?;
            before = now;
            continue;
        };
        let added = since(&now, &before, &layout, args.limit);
        if setup.printer.format() == Format::Table {
            let stamp = humantime_serde::re::humantime::format_rfc3339_seconds(
                std::time::SystemTime::now(),
            );
            writeln!(io.out, "{stamp}")?;
        }
        draw(io.out, &setup, &args, &added, Some(&layout))?;
        io.out.flush()?;
        for r in now.reports.iter().filter(|r| !r.is_ok()) {
            report_error(io.err, r)?;
        }
        before = now;
        shown += 1;
        if args.count > 0 && shown >= args.count {
            return Ok(());
        }
    }
}

/// What the script of the bpftrace process holding `map` says of it,
/// from the first target that describes it.
async fn bpftrace_script(
    fleet: &bpfmap_client::Fleet,
    map: &bpfmap_client::MapName,
) -> Option<pb::BpftraceScript> {
    use futures::StreamExt as _;
    let mut run = fleet.get_map(map);
    while let Some(event) = run.next().await {
        if let bpfmap_client::FleetEvent::Answer { answer, .. } = event {
            return answer.as_proto().bpftrace.clone();
        }
    }
    None
}

/// A bpftrace hist() or lhist() map keyed by more than its bucket, as its
/// script declares it: the key in C with the bucket (an 8-byte index)
/// last, the buckets, and the key's members.
#[derive(Debug, PartialEq)]
struct KeyedBpftrace {
    key: String,
    buckets: &'static str,
    members: Vec<String>,
}

impl KeyedBpftrace {
    fn of(script: &pb::BpftraceScript) -> Option<Self> {
        let buckets = match (script.function.as_str(), script.step) {
            ("hist", _) => "bpftrace-log2",
            ("lhist", 1..) => "bpftrace-linear",
            _ => return None,
        };
        let ty = script.key_type.trim();
        if script.key.is_empty() || ty.is_empty() {
            return None;
        }
        let (key, members) = match ty
            .strip_prefix("struct {")
            .and_then(|t| t.strip_suffix('}'))
        {
            Some(body) => {
                let info = bpfmap_client::typed::parse_c_type(ty, "key").ok()?;
                let Some(pb::type_info::Kind::Struct(r)) = info.kind else {
                    return None;
                };
                let members = r
                    .members
                    .iter()
                    .map(|m| format!("key.{}", m.name))
                    .collect();
                (
                    format!("struct {{ {} __u64 bucket; }}", body.trim()),
                    members,
                )
            }
            None => {
                // "char[16]": a member named as the script's key (`comm`).
                let name = match script.key.trim() {
                    k if k.starts_with(|c: char| c.is_ascii_alphabetic())
                        && k.chars().all(|c| c.is_ascii_alphanumeric() || c == '_')
                        && k != "bucket" =>
                    {
                        k
                    }
                    _ => "key",
                };
                let (base, dims) = ty.split_at(ty.find('[').unwrap_or(ty.len()));
                (
                    format!("struct {{ {} {name}{dims}; __u64 bucket; }}", base.trim()),
                    vec![format!("key.{name}")],
                )
            }
        };
        Some(Self {
            key,
            buckets,
            members,
        })
    }
}

/// The request `args` make.
fn options(args: &HistArgs) -> anyhow::Result<HistogramOptions> {
    let mut o = HistogramOptions::default()
        .with_group_by(args.group_by.iter().cloned())
        .with_limit(if args.interval.is_some() {
            0
        } else {
            args.limit
        })
        .with_render(render_pairs(&args.render));
    if let Some(f) = &args.filter {
        o = o.with_filter(f);
    }
    let declared = args.slots.is_some() || args.bucket.is_some() || args.count_member.is_some();
    let layout = match &args.hist {
        Some(name) => {
            let l = HistogramLayout::named(name).ok_or_else(|| {
                usage(format!(
                    "--hist {name:?}: log2 (libbpf-tools), linear, bpftrace-log2 (hist()) or bpftrace-linear (lhist())"
                ))
            })?;
            let linear = matches!(name.as_str(), "linear" | "bpftrace-linear");
            match (linear, args.min, args.max, args.step) {
                (false, None, None, None) => Some(l),
                (false, ..) => {
                    return Err(usage(format!(
                        "--min, --max and --step are the bounds of linear buckets, not of {name}"
                    )));
                }
                (true, min, max, Some(step)) => {
                    Some(l.with_bounds(min.unwrap_or(0), max.unwrap_or(0), step))
                }
                (true, _, _, None) => {
                    return Err(usage(format!(
                        "--hist {name} needs --step (the width of a bucket) and --min{}",
                        if name == "bpftrace-linear" {
                            " and --max, as in lhist(value, min, max, step)"
                        } else {
                            ""
                        }
                    )));
                }
            }
        }
        None if declared => Some(HistogramLayout::log2()),
        None => None,
    };
    let layout = layout.map(|mut l| {
        if let Some(s) = &args.slots {
            l = l.with_slots(s);
        }
        if let Some(b) = &args.bucket {
            l = l.with_bucket(b);
        }
        if let Some(c) = &args.count_member {
            l = l.with_count(c);
        }
        l
    });
    let layout = match (layout, &args.unit) {
        (Some(l), Some(u)) => Some(l.with_unit(u)),
        // The buckets as the map's types say, named.
        (None, Some(u)) => Some(HistogramLayout::default().with_unit(u)),
        (l, None) => l,
    };
    if let Some(l) = layout {
        o = o.with_layout(l);
    }
    Ok(o)
}

/// A usage error when every target refused the request as malformed (a
/// map that is not a histogram, a layout or member that does not fit).
pub(crate) fn refused(reports: &[bpfmap_client::TargetReport]) -> anyhow::Result<()> {
    let invalid = |r: &bpfmap_client::TargetReport| {
        r.error
            .as_ref()
            .is_some_and(|e| e.code() == bpfmap_client::Code::InvalidArgument)
    };
    if reports.is_empty() || !reports.iter().all(invalid) {
        return Ok(());
    }
    let first = &reports[0];
    let (_, text) = first.error.as_ref().map(code_and_text).unwrap_or_default();
    Err(match reports {
        [_] => usage(text),
        _ => usage(format!("{}: {text}", first.target)),
    })
}

/// What each histogram counted between two merged answers.
fn since(
    now: &FleetHistograms,
    before: &FleetHistograms,
    layout: &HistogramLayout,
    limit: u32,
) -> Vec<pb::Histogram> {
    let as_answer =
        |m: &FleetHistograms| Histograms::from_parts(m.histograms.clone(), layout.clone());
    let mut added = as_answer(now).since(&as_answer(before)).histograms;
    added.sort_by(|a, b| {
        b.count
            .cmp(&a.count)
            .then_with(|| a.key_bytes.cmp(&b.key_bytes))
    });
    if limit > 0 {
        added.truncate(limit as usize);
    }
    added
}

/// The histograms, drawn or as JSON lines.
fn draw(
    out: &mut dyn io::Write,
    setup: &Setup,
    args: &HistArgs,
    histograms: &[pb::Histogram],
    layout: Option<&HistogramLayout>,
) -> io::Result<()> {
    let Some(layout) = layout else { return Ok(()) };
    let l = layout.as_proto();
    for (i, h) in histograms.iter().enumerate() {
        if setup.printer.format() == Format::Table {
            if i > 0 {
                writeln!(out)?;
            }
            out.write_all(drawing(l, h, &args.group_by).as_bytes())?;
        } else {
            writeln!(out, "{}", json_line(l, h, &args.group_by))?;
        }
    }
    out.flush()
}

/// A histogram as data: its key, layout, total, mean, quantiles, buckets.
pub(crate) fn json_line(l: &pb::HistogramLayout, h: &pb::Histogram, group_by: &[String]) -> String {
    let key: serde_json::Map<String, serde_json::Value> = group_by
        .iter()
        .map(|p| {
            let v = h
                .key
                .as_ref()
                .and_then(|k| k.fields.get(p))
                .map(value_json)
                .unwrap_or(serde_json::Value::Null);
            (p.clone(), v)
        })
        .collect();
    let buckets: Vec<serde_json::Value> = h
        .buckets
        .iter()
        .map(|b| json!({"index": b.index, "low": b.low, "high": b.high, "count": b.count}))
        .collect();
    let mut line = json!({
        "key": key,
        "layout": math::name(l.buckets()),
        "unit": l.unit,
        "count": h.count,
        "mean": h.mean,
    });
    for q in &h.quantiles {
        line[format!("p{}", (q.q * 100.0).round() as u32)] = json!(q.value);
    }
    line["buckets"] = json!(buckets);
    line.to_string()
}

fn value_json(v: &prost_types::Value) -> serde_json::Value {
    let mut out = Vec::new();
    crate::output::write_value(v, &mut out);
    serde_json::from_slice(&out).unwrap_or(serde_json::Value::Null)
}

/// Width of the bars: libbpf-tools draws 40 stars, bpftrace 52 @.
const LIBBPF_BAR: usize = 40;
const BPFTRACE_BAR: usize = 52;

/// A histogram drawn as its program draws it, under a line naming its
/// group, over a line with its total, mean and quantiles.
pub(crate) fn drawing(l: &pb::HistogramLayout, h: &pb::Histogram, group_by: &[String]) -> String {
    let mut s = String::new();
    if !group_by.is_empty() {
        let parts: Vec<String> = group_by
            .iter()
            .map(|p| {
                let v = h.key.as_ref().and_then(|k| k.fields.get(p));
                format!("{p} = {}", safe(&v.map(cell).unwrap_or_default()))
            })
            .collect();
        let _ = writeln!(s, "{}", parts.join(", "));
    }
    match l.buckets() {
        Buckets::BpftraceLog2 | Buckets::BpftraceLinear => bpftrace(&mut s, l, h),
        _ => libbpf(&mut s, l, h),
    }
    let q: Vec<String> = h
        .quantiles
        .iter()
        .map(|q| format!("p{} {}", (q.q * 100.0).round() as u32, number(q.value)))
        .collect();
    let _ = writeln!(
        s,
        "count {}  mean {}  {}",
        h.count,
        number(h.mean),
        q.join("  ")
    );
    s
}

/// A figure to three significant decimals at most.
fn number(v: f64) -> String {
    if v.fract() == 0.0 && v.abs() < 1e15 {
        format!("{v:.0}")
    } else if v.abs() >= 100.0 {
        format!("{v:.1}")
    } else {
        format!("{v:.3}")
    }
}

/// libbpf-tools' print_log2_hist (and print_linear_hist): from bucket 0
/// (the first bucket for linear ones) to the last that counts something.
fn libbpf(s: &mut String, l: &pb::HistogramLayout, h: &pb::Histogram) {
    let last = h.buckets.last().map_or(0, |b| b.index);
    let first = match l.buckets() {
        Buckets::Log2 => 0,
        _ => h.buckets.first().map_or(0, |b| b.index),
    };
    let count = |i: u32| {
        h.buckets
            .iter()
            .find(|b| b.index == i)
            .map_or(0, |b| b.count)
    };
    let max = (first..=last).map(count).max().unwrap_or(0);
    let (pad, width, head) = if last <= 32 {
        (5, 10, 19)
    } else {
        (15, 20, 29)
    };
    let _ = writeln!(s, "{:pad$}{:<head$} : count    distribution", "", l.unit);
    for i in first..=last {
        let (low, high) = math::bounds(l, i);
        let (lo, hi) = (low.unwrap_or(0), high.map_or(i128::MAX, |h| h - 1));
        let c = count(i);
        let _ = writeln!(
            s,
            "{lo:>width$} -> {hi:<width$} : {c:<8} |{}|",
            bar(c, max, LIBBPF_BAR, '*')
        );
    }
}

/// bpftrace's print of hist() and lhist(): from the first bucket that
/// counts something to the last.
fn bpftrace(s: &mut String, l: &pb::HistogramLayout, h: &pb::Histogram) {
    let max = h.buckets.iter().map(|b| b.count).max().unwrap_or(0);
    for b in &h.buckets {
        let label = bpftrace_label(l, b.index);
        let _ = writeln!(
            s,
            "{label:<16}{:>8} |{}|",
            b.count,
            bar(b.count, max, BPFTRACE_BAR, '@')
        );
    }
}

/// A bucket as bpftrace names it: `(..., 0)`, `[0]`, `[4, 8)`, `[1K, 2K)`.
fn bpftrace_label(l: &pb::HistogramLayout, index: u32) -> String {
    let (low, high) = math::bounds(l, index);
    let log2 = l.buckets() == Buckets::BpftraceLog2;
    match (low, high) {
        (None, Some(h)) => format!("(..., {})", short(h, log2)),
        (Some(lo), Some(hi)) if log2 && hi - lo == 1 => format!("[{}]", short(lo, log2)),
        (Some(lo), Some(hi)) => format!("[{}, {})", short(lo, log2), short(hi, log2)),
        (Some(lo), None) => format!("[{}, ...)", short(lo, log2)),
        (None, None) => "?".into(),
    }
}

/// A log2 bound as bpftrace writes it: powers of 1024 as K, M, G, T, P.
fn short(v: i128, log2: bool) -> String {
    if !log2 || v < 1024 {
        return v.to_string();
    }
    let mut n = v;
    for unit in ["K", "M", "G", "T", "P", "E"] {
        n /= 1024;
        if n < 1024 || unit == "E" {
            return format!("{n}{unit}");
        }
    }
    v.to_string()
}

/// `count` as a bar of `width` characters at most, the largest full.
fn bar(count: u64, max: u64, width: usize, mark: char) -> String {
    let n = if max == 0 {
        0
    } else {
        (u128::from(count) * width as u128 / u128::from(max)) as usize
    };
    let mut b: String = std::iter::repeat_n(mark, n).collect();
    b.extend(std::iter::repeat_n(' ', width - n));
    b
}

/// The failed targets and those whose buckets differ, on stderr; an error
/// when any.
fn finish(err: &mut dyn io::Write, merged: &FleetHistograms) -> anyhow::Result<()> {
    for r in merged.reports.iter().filter(|r| !r.is_ok()) {
        report_error(err, r)?;
    }
    for t in &merged.differ {
        let line = json!({
            "target": t.as_str(),
            "code": "FAILED_PRECONDITION",
            "error": "its histogram's buckets count other values than the first target's: left out of the merge",
        });
        writeln!(err, "{line}")?;
    }
    let failed = merged.missing.len() + merged.differ.len();
    if failed > 0 {
        let total = merged.reports.len();
        if let ([one], true) = (merged.reports.as_slice(), merged.differ.is_empty()) {
            let (code, text) = one.error.as_ref().map(code_and_text).unwrap_or_default();
            return Err(anyhow::anyhow!("{code}: {text}"));
        }
        return Err(anyhow::anyhow!(
            "{failed} of {total} targets are not in the histograms; they are those of the others"
        ));
    }
    Ok(())
}

pub(crate) fn report_error(
    err: &mut dyn io::Write,
    r: &bpfmap_client::TargetReport,
) -> io::Result<()> {
    let (code, text) = r.error.as_ref().map(code_and_text).unwrap_or_default();
    let line = json!({"target": r.target.as_str(), "code": code, "error": text});
    writeln!(err, "{line}")
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use super::*;

    fn layout(b: Buckets) -> pb::HistogramLayout {
        pb::HistogramLayout {
            buckets: b as i32,
            unit: "usecs".into(),
            ..Default::default()
        }
    }

    #[test]
    fn keyed_bpftrace_histograms_are_declared_from_their_script() {
        let script = |function: &str, key: &str, key_type: &str| pb::BpftraceScript {
            function: function.into(),
            key: key.into(),
            key_type: key_type.into(),
            step: 50,
            ..Default::default()
        };
        assert_eq!(
            KeyedBpftrace::of(&script("hist", "comm", "char[16]")),
            Some(KeyedBpftrace {
                key: "struct { char comm[16]; __u64 bucket; }".into(),
                buckets: "bpftrace-log2",
                members: vec!["key.comm".into()],
            })
        );
        assert_eq!(
            KeyedBpftrace::of(&script("hist", "args->fd", "__s64")).map(|k| k.key),
            Some("struct { __s64 key; __u64 bucket; }".into())
        );
        assert_eq!(
            KeyedBpftrace::of(&script(
                "lhist",
                "comm, pid",
                "struct { char comm[16]; __s64 pid; }"
            )),
            Some(KeyedBpftrace {
                key: "struct { char comm[16]; __s64 pid; __u64 bucket; }".into(),
                buckets: "bpftrace-linear",
                members: vec!["key.comm".into(), "key.pid".into()],
            })
        );
        // Without keys (the daemon reads those), without a known key type,
        // or not a histogram: nothing to declare.
        assert_eq!(KeyedBpftrace::of(&script("hist", "", "")), None);
        assert_eq!(KeyedBpftrace::of(&script("hist", "probe", "")), None);
        assert_eq!(
            KeyedBpftrace::of(&script("count", "comm", "char[16]")),
            None
        );
    }

    #[test]
    fn log2_histograms_are_drawn_as_libbpf_tools_draws_them() {
        let l = layout(Buckets::Log2);
        let h = math::histogram(&l, None, Vec::new(), &BTreeMap::from([(1, 2), (3, 8)]));
        let d = drawing(&l, &h, &[]);
        let lines: Vec<&str> = d.lines().collect();
        assert_eq!(lines[0], "     usecs               : count    distribution");
        assert_eq!(
            lines[1],
            format!("{:>10} -> {:<10} : {:<8} |{}|", 0, 1, 0, " ".repeat(40))
        );
        assert_eq!(
            lines[2],
            format!(
                "{:>10} -> {:<10} : {:<8} |{}{}|",
                2,
                3,
                2,
                "*".repeat(10),
                " ".repeat(30)
            )
        );
        assert_eq!(
            lines[4],
            format!("{:>10} -> {:<10} : {:<8} |{}|", 8, 15, 8, "*".repeat(40))
        );
        assert!(lines[5].starts_with("count 10  mean "), "{d}");
        assert!(lines[5].contains("p50 "), "{d}");
    }

    #[test]
    fn bpftrace_histograms_are_drawn_as_bpftrace_draws_them() {
        let l = layout(Buckets::BpftraceLog2);
        let counts = BTreeMap::from([(0, 1), (1, 2), (2, 4), (4, 8), (12, 1)]);
        let h = math::histogram(&l, None, Vec::new(), &counts);
        let d = drawing(&l, &h, &[]);
        let labels: Vec<&str> = d
            .lines()
            .map(|l| l.split_whitespace().next().unwrap())
            .collect();
        assert_eq!(labels[..5], ["(...,", "[0]", "[1]", "[2,", "[4,"]);
        assert!(d.contains("[1K, 2K)"), "{d}");
        let four = d.lines().find(|l| l.starts_with("[4, 8)")).unwrap();
        assert_eq!(
            four,
            format!("{:<16}{:>8} |{}|", "[4, 8)", 8, "@".repeat(52))
        );
        let lh = pb::HistogramLayout {
            min: 0,
            max: 100,
            step: 10,
            ..layout(Buckets::BpftraceLinear)
        };
        assert_eq!(bpftrace_label(&lh, 0), "(..., 0)");
        assert_eq!(bpftrace_label(&lh, 1), "[0, 10)");
        assert_eq!(bpftrace_label(&lh, 11), "[100, ...)");
    }

    #[test]
    fn group_keys_are_named_and_made_safe_for_a_terminal() {
        let l = layout(Buckets::Log2);
        let key = prost_types::Struct {
            fields: [(
                "value.comm".to_owned(),
                prost_types::Value::from("ev\u{1b}[2Jil"),
            )]
            .into(),
        };
        let h = math::histogram(&l, Some(key), vec![1], &BTreeMap::from([(0, 1)]));
        let d = drawing(&l, &h, &["value.comm".to_owned()]);
        assert!(d.starts_with("value.comm = ev\\x1b[2Jil\n"), "{d}");
        let j: serde_json::Value =
            serde_json::from_str(&json_line(&l, &h, &["value.comm".into()])).unwrap();
        assert_eq!(j["key"]["value.comm"], "ev\u{1b}[2Jil");
        assert_eq!(
            j["buckets"][0],
            json!({"index": 0, "low": 0, "high": 2, "count": 1})
        );
        assert_eq!(j["layout"], "log2");
        assert_eq!(j["count"], 1);
    }
}
