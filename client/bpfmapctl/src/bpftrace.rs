//! `bpftrace MAP --as FUNCTION`: a map bpftrace keeps with count(),
//! sum(), min(), max(), avg() or stats(), printed as bpftrace prints it
//! (`@mn[7]: -3`, `@st: count 51, average 4, total 204`), combined by each
//! daemon and merged across the targets.

use std::io;

use bpfmap_client::{
    FleetEvent, MapName,
    bpftrace::{BpftraceMap, BpftraceOptions, BpftraceValue, Function, script_name},
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

/// `bpftrace MAP --as FUNCTION`.
pub(crate) async fn run(setup: Setup, io: Io<'_>, args: BpftraceArgs) -> anyhow::Result<()> {
    let function: Function = args
        .function
        .parse()
        .map_err(|e| usage(format!("--as: {e}")))?;
    let map = setup.map_name(&args.map)?;
    let mut options = BpftraceOptions::new(function);
    if let Some(k) = map.declared_key() {
        options = options.with_key_type(k);
    }
    let fleet = setup.fleet();
    let merged = fleet.bpftrace(&map, options).await;
    setup.progress.finish();
    refused(&merged.reports)?;
    if let Some(e) = merged.error {
        return Err(usage(e.to_string()));
    }
    if let Some(m) = &merged.map {
        let name = match &args.name {
            Some(n) => n.clone(),
            None => kernel_name(&fleet, &map).await,
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

/// The map's kernel name ("AT_mn"): from its reference, else from the
/// first target that describes it.
async fn kernel_name(fleet: &bpfmap_client::Fleet, map: &MapName) -> String {
    if let MapName::Name(n) = map.clone().without_types() {
        return n;
    }
    let mut run = fleet.get_map(map);
    while let Some(event) = run.next().await {
        if let FleetEvent::Answer { answer, .. } = event {
            return answer.name().to_owned();
        }
    }
    map.to_string()
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
