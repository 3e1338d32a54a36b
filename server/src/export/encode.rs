//! The exposition of exports: OpenMetrics text (what Prometheus asks for
//! first), and the Prometheus text format 0.0.4 for scrapers that do not
//! ask for OpenMetrics, made from it.

use std::fmt::Write as _;

use super::config::{Buckets, ExportKind};

/// One exported series: its label values (in the family's label order)
/// and its value.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Series {
    pub(crate) labels: Vec<String>,
    pub(crate) value: SeriesValue,
}

/// A series' value: a counter's or gauge's number, or a histogram's
/// counts per bucket (not cumulative: as the map keeps them).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum SeriesValue {
    Number(i128),
    Buckets(Vec<i128>),
}

/// A family to write: its name, help, kind, label names and series.
pub(crate) struct Family<'a> {
    pub(crate) name: &'a str,
    pub(crate) help: &'a str,
    pub(crate) kind: ExportKind,
    pub(crate) buckets: (Buckets, u64),
    pub(crate) label_names: Vec<&'a str>,
    pub(crate) series: &'a [Series],
}

impl Family<'_> {
    /// The family in OpenMetrics text (no `# EOF`).
    pub(crate) fn write(&self, out: &mut String) {
        let kind = match self.kind {
            ExportKind::Counter => "counter",
            ExportKind::Gauge => "gauge",
            ExportKind::Histogram => "histogram",
        };
        let _ = writeln!(out, "# TYPE {} {kind}", self.name);
        if !self.help.is_empty() {
            let _ = writeln!(out, "# HELP {} {}", self.name, escape_help(self.help));
        }
        for s in self.series {
            match (&s.value, self.kind) {
                (SeriesValue::Number(n), ExportKind::Counter) => {
                    self.sample(out, "_total", &s.labels, None, &n.to_string());
                }
                (SeriesValue::Number(n), _) => {
                    self.sample(out, "", &s.labels, None, &n.to_string())
                }
                (SeriesValue::Buckets(counts), _) => self.histogram(out, &s.labels, counts),
            }
        }
    }

    fn histogram(&self, out: &mut String, labels: &[String], counts: &[i128]) {
        let mut total = 0i128;
        for (i, c) in counts.iter().enumerate() {
            total += c;
            let le = upper_bound(self.buckets, i);
            self.sample(out, "_bucket", labels, Some(&le), &total.to_string());
        }
        self.sample(out, "_bucket", labels, Some("+Inf"), &total.to_string());
        self.sample(out, "_count", labels, None, &total.to_string());
    }

    fn sample(&self, out: &mut String, suffix: &str, labels: &[String], le: Option<&str>, v: &str) {
        let _ = write!(out, "{}{suffix}", self.name);
        let mut pairs: Vec<(&str, &str)> = self
            .label_names
            .iter()
            .copied()
            .zip(labels.iter().map(String::as_str))
            .collect();
        if let Some(le) = le {
            pairs.push(("le", le));
        }
        if !pairs.is_empty() {
            out.push('{');
            for (i, (name, value)) in pairs.iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                let _ = write!(out, "{name}=\"{}\"", escape_label(value));
            }
            out.push('}');
        }
        let _ = writeln!(out, " {v}");
    }
}

/// The upper bound of bucket `i`, as `le` writes it: exp2's slot i counts
/// values below 2^(i+1), linear's below (i+1) x width.
pub(crate) fn upper_bound((buckets, width): (Buckets, u64), i: usize) -> String {
    let bound: u128 = match buckets {
        Buckets::Exp2 => 1u128.checked_shl(i as u32 + 1).unwrap_or(u128::MAX),
        Buckets::Linear => (i as u128 + 1) * u128::from(width),
    };
    format!("{bound}.0")
}

/// A label value as the text formats quote it.
pub(crate) fn escape_label(v: &str) -> String {
    v.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

/// A help text as the text formats write it.
fn escape_help(v: &str) -> String {
    v.replace('\\', "\\\\").replace('\n', "\\n")
}

/// The OpenMetrics exposition `om` in the Prometheus text format 0.0.4: a
/// counter's family is named after its `_total` samples, `_created`
/// samples, `# UNIT` and `# EOF` are left out.
pub(crate) fn to_text_format(om: &str) -> String {
    let mut counters = std::collections::HashSet::new();
    for line in om.lines() {
        if let Some(rest) = line.strip_prefix("# TYPE ")
            && let Some(name) = rest.strip_suffix(" counter")
        {
            counters.insert(name.to_owned());
        }
    }
    let created = |sample: &str| {
        let name = sample.split(['{', ' ']).next().unwrap_or(sample);
        name.strip_suffix("_created")
            .is_some_and(|f| counters.contains(f) || om.contains(&format!("# TYPE {f} histogram")))
    };
    let mut out = String::with_capacity(om.len());
    for line in om.lines() {
        if line == "# EOF"
            || line.starts_with("# UNIT ")
            || (!line.starts_with('#') && created(line))
        {
            continue;
        }
        let renamed = ["# TYPE ", "# HELP "].iter().find_map(|p| {
            let rest = line.strip_prefix(p)?;
            let (name, tail) = rest.split_once(' ').unwrap_or((rest, ""));
            counters
                .contains(name)
                .then(|| format!("{p}{name}_total {tail}").trim_end().to_owned())
        });
        out.push_str(renamed.as_deref().unwrap_or(line));
        out.push('\n');
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn families_are_written_with_escaped_labels_and_cumulative_buckets() {
        let series = [Series {
            labels: vec!["a\"b\\c\nd".into()],
            value: SeriesValue::Number(i128::MAX),
        }];
        let mut out = String::new();
        Family {
            name: "ct_bytes",
            help: "Bytes\nper destination",
            kind: ExportKind::Counter,
            buckets: (Buckets::Exp2, 1),
            label_names: vec!["daddr"],
            series: &series,
        }
        .write(&mut out);
        assert_eq!(
            out,
            "# TYPE ct_bytes counter\n# HELP ct_bytes Bytes\\nper destination\nct_bytes_total{daddr=\"a\\\"b\\\\c\\nd\"} 170141183460469231731687303715884105727\n"
        );
        let series = [Series {
            labels: vec![],
            value: SeriesValue::Buckets(vec![1, 0, 3]),
        }];
        let mut out = String::new();
        Family {
            name: "lat",
            help: "",
            kind: ExportKind::Histogram,
            buckets: (Buckets::Exp2, 1),
            label_names: vec![],
            series: &series,
        }
        .write(&mut out);
        assert_eq!(
            out,
            "# TYPE lat histogram\nlat_bucket{le=\"2.0\"} 1\nlat_bucket{le=\"4.0\"} 1\nlat_bucket{le=\"8.0\"} 4\nlat_bucket{le=\"+Inf\"} 4\nlat_count 4\n"
        );
        assert_eq!(upper_bound((Buckets::Linear, 10), 2), "30.0");
        assert_eq!(
            upper_bound((Buckets::Exp2, 1), 200),
            format!("{}.0", u128::MAX)
        );
    }

    #[test]
    fn openmetrics_becomes_the_text_format() {
        let om = "# HELP reqs Requests.\n# TYPE reqs counter\nreqs_total{a=\"1\"} 3\nreqs_created{a=\"1\"} 1.7e9\n# TYPE up gauge\n# UNIT up seconds\nup 1\n# EOF\n";
        assert_eq!(
            to_text_format(om),
            "# HELP reqs_total Requests.\n# TYPE reqs_total counter\nreqs_total{a=\"1\"} 3\n# TYPE up gauge\nup 1\n"
        );
    }
}
