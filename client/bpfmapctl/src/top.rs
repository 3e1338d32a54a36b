//! `top`: the top groups of a map, aggregated by each daemon and merged
//! exactly across the targets.

use std::io;

use bpfmap_client::{
    AggregateOptions, Code, FleetAggregate, FleetAggregateOptions, FleetGroup, TargetReport,
    typed::write_json_string,
};
use serde_json::json;

use crate::{
    TopArgs, code_and_text,
    drive::Io,
    output::{Format, PerCpu, cell, write_value},
    render_pairs,
    setup::Setup,
    table::Table,
    usage,
};

/// `top MAP --by AGG ...`; with `--per-cpu sum`, each entry of a per-CPU
/// map counts with its sum over the CPUs (for MIN and MAX; by default each
/// CPU's value is a value of its own).
pub(crate) async fn run(
    setup: Setup,
    io: Io<'_>,
    args: TopArgs,
    per_cpu: PerCpu,
) -> anyhow::Result<()> {
    let map = setup.map_name(&args.map)?;
    let mut aggregate = AggregateOptions::default()
        .with_per_cpu(per_cpu.into())
        .with_aggregates(args.by.iter().cloned())
        .with_group_by(args.group_by.iter().cloned())
        .with_limit(args.limit)
        .with_render(render_pairs(&args.render));
    if let Some(filter) = &args.filter {
        aggregate = aggregate.with_filter(filter);
    }
    let options = FleetAggregateOptions::default().with_aggregate(aggregate);
    let result = setup.fleet().aggregate(&map, options).await;
    setup.progress.finish();
    let total = result.reports.len();
    if let Some(refused) = refused(&result.reports) {
        return Err(refused);
    }
    let names: Vec<String> = args.by.iter().map(ToString::to_string).collect();
    match setup.printer.format() {
        Format::Table => table(io.out, &args, &names, &result.groups)?,
        _ => {
            for g in &result.groups {
                io.out.write_all(&json_line(g, &args.group_by, &names))?;
            }
        }
    }
    io.out.flush()?;
    summary(io.err, &result, total)?;
    if result.is_partial() {
        let [one] = result.reports.as_slice() else {
            return Err(anyhow::anyhow!(
                "{} of {total} targets failed; the groups are those of the others",
                result.missing.len()
            ));
        };
        let (code, text) = one.error.as_ref().map(code_and_text).unwrap_or_default();
        return Err(anyhow::anyhow!("{code}: {text}"));
    }
    Ok(())
}

/// A usage error when every target refused the request as malformed (an
/// aggregate field, a group-by path or a filter that does not fit the map):
/// the command line needs fixing, not the targets.
fn refused(reports: &[TargetReport]) -> Option<anyhow::Error> {
    let invalid = |r: &TargetReport| {
        r.error
            .as_ref()
            .is_some_and(|e| e.code() == Code::InvalidArgument)
    };
    if reports.is_empty() || !reports.iter().all(invalid) {
        return None;
    }
    let first = &reports[0];
    let (_, text) = first.error.as_ref().map(code_and_text)?;
    Some(match reports {
        [_] => usage(text),
        _ => usage(format!("{}: {text}", first.target)),
    })
}

/// `{"targets":[...],"key":{"key.daddr":...},"values":{"sum(value.bytes)":"123"}}`:
/// the targets that hold the group, its key's members in `group_by`'s
/// order, its values as exact decimal strings (null for the MIN or MAX of
/// nothing).
pub(crate) fn json_line(g: &FleetGroup, group_by: &[String], names: &[String]) -> Vec<u8> {
    let mut line = b"{\"targets\":[".to_vec();
    for (i, t) in g.hosts.iter().enumerate() {
        if i > 0 {
            line.push(b',');
        }
        write_json_string(&mut line, t.as_str());
    }
    line.extend_from_slice(b"],\"key\":");
    key_object(&mut line, group_by, g.group.key());
    line.extend_from_slice(b",\"values\":{");
    let decimal = |line: &mut Vec<u8>, v: &Option<i128>| match v {
        Some(v) => write_json_string(line, &v.to_string()),
        None => line.extend_from_slice(b"null"),
    };
    for (i, (name, v)) in names.iter().zip(g.group.values()).enumerate() {
        if i > 0 {
            line.push(b',');
        }
        write_json_string(&mut line, name);
        line.push(b':');
        match g.group.elements(i) {
            [] => decimal(&mut line, v),
            each => {
                line.push(b'[');
                for (j, e) in each.iter().enumerate() {
                    if j > 0 {
                        line.push(b',');
                    }
                    decimal(&mut line, e);
                }
                line.push(b']');
            }
        }
    }
    line.extend_from_slice(b"}}\n");
    line
}

/// A group's key as a JSON object: each group-by path to its member's
/// value, in `group_by`'s order.
pub(crate) fn key_object(
    line: &mut Vec<u8>,
    group_by: &[String],
    key: &std::collections::BTreeMap<String, prost_types::Value>,
) {
    line.push(b'{');
    for (i, path) in group_by.iter().enumerate() {
        if i > 0 {
            line.push(b',');
        }
        write_json_string(line, path);
        line.push(b':');
        match key.get(path) {
            Some(v) => write_value(v, line),
            None => line.extend_from_slice(b"null"),
        }
    }
    line.push(b'}');
}

/// Aligned columns: the group-by members, the aggregates, the targets
/// (with `--hosts`).
fn table(
    out: &mut dyn io::Write,
    args: &TopArgs,
    names: &[String],
    groups: &[FleetGroup],
) -> io::Result<()> {
    let mut header: Vec<String> = args.group_by.clone();
    header.extend(names.iter().cloned());
    if args.hosts {
        header.push("TARGETS".into());
    }
    let mut table = Table::new(header);
    for g in groups {
        let mut row: Vec<String> = args
            .group_by
            .iter()
            .map(|p| g.group.key().get(p).map(cell).unwrap_or_default())
            .collect();
        let cell = |v: &Option<i128>| v.map_or_else(|| "-".to_owned(), |v| v.to_string());
        row.extend(
            g.group
                .values()
                .iter()
                .enumerate()
                .map(|(i, v)| match g.group.elements(i) {
                    [] => cell(v),
                    each => format!("[{}]", each.iter().map(cell).collect::<Vec<_>>().join(",")),
                }),
        );
        if args.hosts {
            let hosts: Vec<&str> = g.hosts.iter().map(|t| t.as_str()).collect();
            row.push(hosts.join(","));
        }
        table.row(out, &row)?;
    }
    table.finish(out)
}

/// One line per target that failed, then for a fleet the totals and how
/// the groups were merged.
fn summary(err: &mut dyn io::Write, result: &FleetAggregate, total: usize) -> io::Result<()> {
    for r in result.reports.iter().filter(|r| !r.is_ok()) {
        let (code, text) = r.error.as_ref().map(code_and_text).unwrap_or_default();
        let line = json!({"target": r.target.as_str(), "code": code, "error": text});
        err.write_all(format!("{line}\n").as_bytes())?;
    }
    if total > 1 {
        let line = json!({
            "targets": total,
            "ok": total - result.missing.len(),
            "failed": result.missing.len(),
            "method": result.method.as_str(),
            "groups": result.groups.len(),
            "groups_sent": result.reports.iter().map(|r| r.entries).sum::<u64>(),
            "entries_scanned": result.reports.iter().map(|r| r.scanned).sum::<u64>(),
        });
        err.write_all(format!("{line}\n").as_bytes())?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use bpfmap_client::Aggregate;
    use clap::Parser as _;

    use crate::{Cli, Command};

    #[test]
    fn top_takes_aggregates_and_refuses_bad_spellings() {
        let cli = Cli::try_parse_from([
            "bpfmapctl",
            "top",
            "m",
            "--by",
            "sum(value.bytes)",
            "--by",
            "count()",
            "--group-by",
            "key.daddr,key.dport",
            "-n",
            "3",
        ])
        .unwrap();
        let Command::Top(args) = cli.command else {
            panic!("top")
        };
        assert_eq!(args.by, [Aggregate::sum("value.bytes"), Aggregate::count()]);
        assert_eq!(args.group_by, ["key.daddr", "key.dport"]);
        assert_eq!(args.limit, 3);
        let e =
            Cli::try_parse_from(["bpfmapctl", "top", "m", "--by", "avg(value.bytes)"]).unwrap_err();
        assert_eq!(e.exit_code(), 2);
        assert!(
            e.to_string().contains(
                "invalid aggregate \"avg(value.bytes)\": use count(), sum(FIELD), min(FIELD) or max(FIELD)"
            ),
            "{e}"
        );
        assert!(Cli::try_parse_from(["bpfmapctl", "top", "m"]).is_err());
    }
}
