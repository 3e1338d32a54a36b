//! The exported maps' series as OpenMetrics text. Their values are exact
//! integers (sums may pass 2^64), which prometheus-client's encoders, of
//! 64-bit integers and floats, cannot write: the families are written
//! here, and the metrics listener puts them beside the registry's.

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
    pub(crate) bounds: Bounds,
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
            let le = self.bounds.upper(i);
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

/// A histogram's bucket bounds: how its slots are spaced, and a linear
/// histogram's width.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Bounds {
    pub(crate) buckets: Buckets,
    pub(crate) width: u64,
}

impl Bounds {
    /// The upper bound of bucket `i`, as `le` writes it: exp2's slot i
    /// counts values below 2^(i+1), linear's below (i+1) x width.
    pub(crate) fn upper(&self, i: usize) -> String {
        let bound: u128 = match self.buckets {
            Buckets::Exp2 => 1u128.checked_shl(i as u32 + 1).unwrap_or(u128::MAX),
            Buckets::Linear => (i as u128 + 1) * u128::from(self.width),
        };
        format!("{bound}.0")
    }
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
            bounds: Bounds {
                buckets: Buckets::Exp2,
                width: 1,
            },
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
            bounds: Bounds {
                buckets: Buckets::Exp2,
                width: 1,
            },
            label_names: vec![],
            series: &series,
        }
        .write(&mut out);
        assert_eq!(
            out,
            "# TYPE lat histogram\nlat_bucket{le=\"2.0\"} 1\nlat_bucket{le=\"4.0\"} 1\nlat_bucket{le=\"8.0\"} 4\nlat_bucket{le=\"+Inf\"} 4\nlat_count 4\n"
        );
        let linear = Bounds {
            buckets: Buckets::Linear,
            width: 10,
        };
        assert_eq!(linear.upper(2), "30.0");
        let exp2 = Bounds {
            buckets: Buckets::Exp2,
            width: 1,
        };
        assert_eq!(exp2.upper(200), format!("{}.0", u128::MAX));
    }
}
