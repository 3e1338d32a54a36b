//! `stacks`: a map of counts keyed by stack ids read as stacks of named
//! frames, folded for flame graphs or as JSON, merged across the targets.

use std::io;

use bpfmap_client::{FleetStacks, StackOptions, pb, stack_folding::folded_line};
use serde_json::json;

use crate::{
    StacksArgs, code_and_text,
    drive::Io,
    output::Format,
    render_pairs,
    setup::{Setup, map_name},
    usage,
};

/// `stacks MAP ...`.
pub(crate) async fn run(
    setup: Setup,
    io: Io<'_>,
    args: StacksArgs,
    format: Option<Format>,
    terminal: bool,
) -> anyhow::Result<()> {
    let format = match format.unwrap_or(Format::Folded) {
        f @ (Format::Folded | Format::Json | Format::Pprof | Format::Svg) => f,
        other => {
            return Err(usage(format!(
                "stacks are written folded (the default), as json, pprof or svg, not {}",
                format!("{other:?}").to_lowercase()
            )));
        }
    };
    if format == Format::Pprof && args.output.is_none() && terminal {
        return Err(usage(
            "a pprof profile is gzipped protobuf: write it to a file (-o profile.pb.gz) or a pipe",
        ));
    }
    let map = setup.map_name(&args.map)?;
    let options = options(&args)?;
    let result = setup.fleet().stacks(&map, options).await;
    setup.progress.finish();
    refused(&result)?;
    let bytes = render(&result.stacks, format, &args)?;
    match &args.output {
        Some(path) => std::fs::write(path, &bytes)
            .map_err(|e| anyhow::anyhow!("cannot write {}: {e}", path.display()))?,
        None => {
            io.out.write_all(&bytes)?;
            io.out.flush()?;
        }
    }
    finish(io.err, &result)
}

/// The stacks in `format`.
fn render(stacks: &[pb::Stack], format: Format, args: &StacksArgs) -> anyhow::Result<Vec<u8>> {
    let lines = |f: fn(&pb::Stack) -> String| -> Vec<u8> {
        stacks
            .iter()
            .flat_map(|s| (f(s) + "\n").into_bytes())
            .collect()
    };
    Ok(match format {
        Format::Json => lines(json_line),
        Format::Pprof => {
            let name = args
                .by
                .as_ref()
                .map_or_else(|| "weight".to_owned(), ToString::to_string);
            let sample = bpfmap_client::pprof::SampleType {
                name: &name,
                unit: &args.unit,
            };
            bpfmap_client::pprof::profile(stacks, sample)?
        }
        Format::Svg => svg(stacks, args)?,
        _ => lines(folded_line),
    })
}

/// An SVG flame graph of the stacks (inferno, as flamegraph.pl draws them).
fn svg(stacks: &[pb::Stack], args: &StacksArgs) -> anyhow::Result<Vec<u8>> {
    let folded: Vec<String> = stacks
        .iter()
        .filter(|s| s.value != "0")
        .map(folded_line)
        .collect();
    if folded.is_empty() {
        return Err(anyhow::anyhow!(
            "no stack weighs anything: no flame graph to draw"
        ));
    }
    let mut options = inferno::flamegraph::Options::default();
    options.title = args.title.clone();
    options.count_name = args.unit.clone();
    options.hash = true;
    let mut out = Vec::new();
    inferno::flamegraph::from_lines(&mut options, folded.iter().map(String::as_str), &mut out)?;
    Ok(out)
}

fn options(args: &StacksArgs) -> anyhow::Result<StackOptions> {
    let mut o = StackOptions::default()
        .with_roots(args.roots.iter().cloned())
        .with_limit(args.limit)
        .with_render(render_pairs(&args.render));
    if let Some(m) = &args.stack_map {
        o = o.with_stack_map(map_name(m)?);
    }
    if let Some(by) = &args.by {
        o = o.with_by(by.clone());
    }
    if let Some(f) = &args.filter {
        o = o.with_filter(f);
    }
    if args.addresses {
        o = o.with_addresses_only();
    }
    let declared = args.kernel_id.is_some() || args.user_id.is_some() || args.pid.is_some();
    if declared || args.bpftrace {
        if !(args.kernel_id.is_some() || args.user_id.is_some()) {
            return Err(usage(
                "--pid and --bpftrace say how to read the ids: name them too (--kernel-id, --user-id)",
            ));
        }
        o = o.with_ids(
            args.kernel_id.as_deref().unwrap_or_default(),
            args.user_id.as_deref().unwrap_or_default(),
            args.pid.as_deref().unwrap_or_default(),
            args.bpftrace,
        );
    }
    Ok(o)
}

/// A usage error when every target refused the request as malformed.
fn refused(result: &FleetStacks) -> anyhow::Result<()> {
    let invalid = |r: &bpfmap_client::TargetReport| {
        r.error
            .as_ref()
            .is_some_and(|e| e.code() == bpfmap_client::Code::InvalidArgument)
    };
    if result.reports.is_empty() || !result.reports.iter().all(invalid) {
        return Ok(());
    }
    let first = &result.reports[0];
    let (_, text) = first.error.as_ref().map(code_and_text).unwrap_or_default();
    Err(match result.reports.as_slice() {
        [_] => usage(text),
        _ => usage(format!("{}: {text}", first.target)),
    })
}

/// A stack as data: its value, roots, process, frames (outermost first).
pub(crate) fn json_line(s: &pb::Stack) -> String {
    let frames = |fs: &[pb::Frame]| -> Vec<serde_json::Value> {
        fs.iter()
            .map(|f| {
                json!({
                    "address": format!("{:#x}", f.address),
                    "function": (!f.function.is_empty()).then_some(&f.function),
                    "offset": f.offset,
                    "module": (!f.module.is_empty()).then_some(&f.module),
                })
            })
            .collect()
    };
    let lost = |l: i32| match pb::LostStack::try_from(l) {
        Ok(pb::LostStack::None) | Err(_) => None,
        Ok(pb::LostStack::NoStack) => Some("NO_STACK"),
        Ok(pb::LostStack::Eexist) => Some("EEXIST"),
        Ok(pb::LostStack::Other) => Some("OTHER"),
    };
    json!({
        "value": s.value,
        "roots": s.roots,
        "pid": s.pid,
        "stack_id": (s.stack_id >= 0).then_some(s.stack_id),
        "user_lost": lost(s.user_lost),
        "kernel_lost": lost(s.kernel_lost),
        "user": frames(&s.user),
        "kernel": frames(&s.kernel),
    })
    .to_string()
}

/// Failed targets and notes on stderr; an error when a target failed.
fn finish(err: &mut dyn io::Write, result: &FleetStacks) -> anyhow::Result<()> {
    for r in result.reports.iter().filter(|r| !r.is_ok()) {
        let (code, text) = r.error.as_ref().map(code_and_text).unwrap_or_default();
        let line = json!({"target": r.target.as_str(), "code": code, "error": text});
        writeln!(err, "{line}")?;
    }
    for (t, note) in &result.notes {
        writeln!(err, "{}", json!({"target": t.as_str(), "note": note}))?;
    }
    let failed = result.missing.len();
    if failed > 0 {
        let total = result.reports.len();
        if let [one] = result.reports.as_slice() {
            let (code, text) = one.error.as_ref().map(code_and_text).unwrap_or_default();
            return Err(anyhow::anyhow!("{code}: {text}"));
        }
        return Err(anyhow::anyhow!(
            "{failed} of {total} targets failed; the stacks are those of the others"
        ));
    }
    Ok(())
}
