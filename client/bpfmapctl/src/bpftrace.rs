//! `bpftrace MAP --as FUNCTION`: a map bpftrace keeps with count(),
//! sum(), min(), max(), avg() or stats(), printed as bpftrace prints it
//! (`@mn[7]: -3`, `@st: count 51, average 4, total 204`), combined by each
//! daemon and merged across the targets.

use std::io;

use bpfmap_client::{
    FleetEvent, MapName,
    bpftrace::{BpftraceMap, BpftraceOptions, BpftraceValue, Function, script_name},
    pb,
};
use futures::StreamExt as _;
use serde_json::json;

use crate::{
    BpftraceArgs,
    drive::Io,
    hist::{refused, report_error},
    output::Format,
    setup::Setup,
    table::safe,
    usage,
};

/// `bpftrace MAP [--as FUNCTION]`.
pub(crate) async fn run(setup: Setup, io: Io<'_>, args: BpftraceArgs) -> anyhow::Result<()> {
    let map = setup.map_name(&args.map)?;
    let fleet = setup.fleet();
    let described = describe(&fleet, &map).await;
    let said = described.as_ref().and_then(|(_, s)| s.as_ref());
    let function: Function = match (&args.function, said) {
        (Some(f), _) => f.parse().map_err(|e| usage(format!("--as: {e}")))?,
        (None, Some(s)) if matches!(s.function.as_str(), "hist" | "lhist") => {
            return Err(usage(format!(
                "{} is a bpftrace {}() map: draw it with bpfmapctl hist",
                args.map, s.function
            )));
        }
        (None, Some(s)) if !s.function.is_empty() => s
            .function
            .parse()
            .map_err(|e| usage(format!("the script's {}: {e}", s.function)))?,
        (None, _) => {
            return Err(usage(format!(
                "name the function that keeps {} with --as (count, sum, min, max, avg or stats): {}",
                args.map,
                match (&described, said) {
                    (None, _) => "no target describes the map".to_owned(),
                    (Some(_), Some(s)) => format!(
                        "its script ({}) assigns it plain values, not an aggregation",
                        s.script
                    ),
                    (Some(_), None) => {
                        "no bpftrace script that assigns it was found on the daemon's host"
                            .to_owned()
                    }
                }
            )));
        }
    };
    let mut options = BpftraceOptions::new(function);
    match (map.declared_key(), said) {
        (Some(k), _) => options = options.with_key_type(k),
        (None, Some(s)) if !s.key_type.is_empty() => options = options.with_key_type(&s.key_type),
        _ => {}
    }
    let merged = fleet.bpftrace(&map, options).await;
    setup.progress.finish();
    refused(&merged.reports)?;
    if let Some(e) = merged.error {
        return Err(usage(e.to_string()));
    }
    if let Some(m) = &merged.map {
        let name = match (&args.name, &described) {
            (Some(n), _) => n.clone(),
            (None, Some((kernel, _))) => kernel.clone(),
            (None, None) => args.map.clone(),
        };
        print(io.out, setup.printer.format(), &script_name(&name), m)?;
    }
    for r in merged.reports.iter().filter(|r| !r.is_ok()) {
        report_error(io.err, r)?;
    }
    match (merged.missing.len(), merged.reports.len()) {
        (0, _) => Ok(()),
        (_, 1) => {
            let r = &merged.reports[0];
            let (code, text) = r
                .error
                .as_ref()
                .map(crate::code_and_text)
                .unwrap_or_default();
            Err(anyhow::anyhow!("{code}: {text}"))
        }
        (failed, total) => Err(anyhow::anyhow!(
            "{failed} of {total} targets are not in the map; it is that of the others"
        )),
    }
}

/// The map's kernel name ("AT_mn") and what its bpftrace script says of
/// it, from the first target that describes it; `None` when none does.
async fn describe(
    fleet: &bpfmap_client::Fleet,
    map: &MapName,
) -> Option<(String, Option<pb::BpftraceScript>)> {
    let mut run = fleet.get_map(map);
    while let Some(event) = run.next().await {
        if let FleetEvent::Answer { answer, .. } = event {
            return Some((answer.name().to_owned(), answer.as_proto().bpftrace.clone()));
        }
    }
    None
}

/// As bpftrace prints it (`table`), or one JSON object per key.
fn print(out: &mut dyn io::Write, format: Format, name: &str, m: &BpftraceMap) -> io::Result<()> {
    if format != Format::Json {
        let mut text = String::new();
        m.print(name, &mut text).expect("writing to a String");
        for line in text.lines() {
            writeln!(out, "{}", safe(line))?;
        }
        return Ok(());
    }
    for e in &m.entries {
        // 64-bit values as exact decimal strings, as everywhere.
        let line = match e.value {
            BpftraceValue::Avg { count, total } | BpftraceValue::Stats { count, total } => json!({
                "map": name,
                "key": e.key,
                "count": count.to_string(),
                "average": e.value.value().to_string(),
                "total": total.to_string(),
            }),
            _ => json!({"map": name, "key": e.key, "value": e.value.value().to_string()}),
        };
        writeln!(out, "{line}")?;
    }
    Ok(())
}
