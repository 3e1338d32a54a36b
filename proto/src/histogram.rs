//! Histograms (HistogramMap): what bucket number k of each layout counts,
//! buckets merged exactly (the entries of a map, the hosts of a fleet, two
//! scans), and the total, mean and quantiles estimated from the buckets:
//! the same arithmetic in the daemon, the relay, the library and
//! bpfmapctl.

use std::collections::BTreeMap;

use crate::v1::{self as pb, histogram_layout::Buckets};

/// The quantiles every histogram answers: p50, p90, p99.
pub const QUANTILES: [f64; 3] = [0.5, 0.9, 0.99];

/// Most buckets one histogram may have: the length of a `slots` array, or
/// a bucket number read from a key.
pub const MAX_BUCKETS: u32 = 4096;

/// A layout whose buckets say nothing, or contradict themselves.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct LayoutError(pub String);

/// How bpfmapctl and messages name a layout's buckets: "log2", "linear",
/// "bpftrace-log2", "bpftrace-linear".
pub fn name(b: Buckets) -> &'static str {
    match b {
        Buckets::Unspecified => "unspecified",
        Buckets::Log2 => "log2",
        Buckets::BpftraceLog2 => "bpftrace-log2",
        Buckets::Linear => "linear",
        Buckets::BpftraceLinear => "bpftrace-linear",
    }
}

/// The buckets named as [`name`] spells them.
pub fn parse_name(s: &str) -> Option<Buckets> {
    Some(match s {
        "log2" => Buckets::Log2,
        "bpftrace-log2" => Buckets::BpftraceLog2,
        "linear" => Buckets::Linear,
        "bpftrace-linear" => Buckets::BpftraceLinear,
        _ => return None,
    })
}

/// Checks that a layout's buckets are complete: a kind, and for linear
/// ones a step of at least 1 (and a max above min for bpftrace's).
pub fn check(l: &pb::HistogramLayout) -> Result<(), LayoutError> {
    let bad = |m: String| Err(LayoutError(m));
    match l.buckets() {
        Buckets::Unspecified => {
            bad("layout.buckets: LOG2, BPFTRACE_LOG2, LINEAR or BPFTRACE_LINEAR".into())
        }
        Buckets::Log2 | Buckets::BpftraceLog2 => Ok(()),
        Buckets::Linear | Buckets::BpftraceLinear if l.step == 0 => bad(format!(
            "layout.step: {} buckets need the width of a bucket (step >= 1)",
            name(l.buckets())
        )),
        Buckets::BpftraceLinear if l.max <= l.min => bad(format!(
            "layout.max {} is not above layout.min {}: lhist(value, min, max, step) needs max > min",
            l.max, l.min
        )),
        Buckets::Linear | Buckets::BpftraceLinear => Ok(()),
    }
}

/// Whether two layouts count the same values in buckets of the same
/// number: histograms that merge by adding counts.
pub fn same_buckets(a: &pb::HistogramLayout, b: &pb::HistogramLayout) -> bool {
    a.buckets == b.buckets
        && match a.buckets() {
            Buckets::Linear => (a.min, a.step) == (b.min, b.step),
            Buckets::BpftraceLinear => (a.min, a.max, a.step) == (b.min, b.max, b.step),
            _ => true,
        }
}

/// The values bucket `index` counts: from `low` (included) to `high`
/// (excluded), `None` where there is no bound.
pub fn bounds(l: &pb::HistogramLayout, index: u32) -> (Option<i128>, Option<i128>) {
    let k = i128::from(index);
    let pow = |e: i128| (e < 127).then(|| 1i128 << e);
    let (min, max, step) = (i128::from(l.min), i128::from(l.max), i128::from(l.step));
    match l.buckets() {
        Buckets::Log2 if index == 0 => (Some(0), Some(2)),
        Buckets::Log2 => (pow(k), pow(k + 1)),
        Buckets::BpftraceLog2 => match index {
            0 => (None, Some(0)),
            1 => (Some(0), Some(1)),
            _ => (pow(k - 2), pow(k - 1)),
        },
        Buckets::Linear => (Some(min + k * step), Some(min + (k + 1) * step)),
        Buckets::BpftraceLinear => {
            let last = (max - min + step - 1) / step.max(1) + 1;
            match k {
                0 => (None, Some(min)),
                k if k >= last => (Some(max), None),
                k => (Some(min + (k - 1) * step), Some((min + k * step).min(max))),
            }
        }
        Buckets::Unspecified => (None, None),
    }
}

/// A bucket as answers carry it (bounds outside int64 left out).
fn bucket(l: &pb::HistogramLayout, index: u32, count: u64) -> pb::Bucket {
    let (low, high) = bounds(l, index);
    pb::Bucket {
        index,
        low: low.and_then(|v| i64::try_from(v).ok()),
        high: high.and_then(|v| i64::try_from(v).ok()),
        count,
    }
}

/// The histogram of `counts` (bucket number to count) in layout `l`:
/// every bucket from the first that counts something to the last, the
/// total, the mean and the quantiles.
pub fn histogram(
    l: &pb::HistogramLayout,
    key: Option<prost_types::Struct>,
    key_bytes: Vec<u8>,
    counts: &BTreeMap<u32, u64>,
) -> pb::Histogram {
    let used = counts.iter().filter(|(_, c)| **c > 0).map(|(i, _)| *i);
    let (first, last) = (used.clone().min(), used.max());
    let buckets: Vec<pb::Bucket> = match (first, last) {
        (Some(first), Some(last)) => (first..=last)
            .map(|i| bucket(l, i, counts.get(&i).copied().unwrap_or(0)))
            .collect(),
        _ => Vec::new(),
    };
    let count = buckets.iter().fold(0u64, |a, b| a.saturating_add(b.count));
    pb::Histogram {
        key,
        key_bytes,
        mean: mean(l, &buckets, count),
        quantiles: QUANTILES
            .iter()
            .map(|&q| pb::Quantile {
                q,
                value: quantile(l, &buckets, count, q),
            })
            .collect(),
        buckets,
        count,
    }
}

/// Adds the buckets of `h` to `into` (saturating).
pub fn add(into: &mut BTreeMap<u32, u64>, h: &pb::Histogram) {
    for b in &h.buckets {
        let c = into.entry(b.index).or_insert(0);
        *c = c.saturating_add(b.count);
    }
}

/// A bucket's values taken at one point: its middle, or its one bound.
fn middle(l: &pb::HistogramLayout, index: u32) -> f64 {
    match bounds(l, index) {
        (Some(lo), Some(hi)) => (lo as f64 + hi as f64) / 2.0,
        (Some(v), None) | (None, Some(v)) => v as f64,
        (None, None) => 0.0,
    }
}

fn mean(l: &pb::HistogramLayout, buckets: &[pb::Bucket], count: u64) -> f64 {
    if count == 0 {
        return 0.0;
    }
    let total: f64 = buckets
        .iter()
        .map(|b| b.count as f64 * middle(l, b.index))
        .sum();
    total / count as f64
}

/// The value below which a fraction `q` of the counted values lie,
/// interpolated linearly inside its bucket (a bucket without a bound
/// answers its one bound).
fn quantile(l: &pb::HistogramLayout, buckets: &[pb::Bucket], count: u64, q: f64) -> f64 {
    if count == 0 {
        return 0.0;
    }
    let target = q * count as f64;
    let mut before = 0.0;
    for b in buckets {
        let after = before + b.count as f64;
        if b.count > 0 && after >= target {
            return match bounds(l, b.index) {
                (Some(lo), Some(hi)) => {
                    let within = (target - before) / b.count as f64;
                    lo as f64 + within * (hi - lo) as f64
                }
                (Some(v), None) | (None, Some(v)) => v as f64,
                (None, None) => 0.0,
            };
        }
        before = after;
    }
    buckets.last().map_or(0.0, |b| middle(l, b.index))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn layout(b: Buckets) -> pb::HistogramLayout {
        pb::HistogramLayout {
            buckets: b as i32,
            ..Default::default()
        }
    }

    #[test]
    fn buckets_count_what_the_programs_count() {
        // libbpf-tools: slot 0 counts 0 and 1, slot k counts [2^k, 2^(k+1)).
        let l = layout(Buckets::Log2);
        assert_eq!(bounds(&l, 0), (Some(0), Some(2)));
        assert_eq!(bounds(&l, 1), (Some(2), Some(4)));
        assert_eq!(bounds(&l, 10), (Some(1024), Some(2048)));
        // bpftrace hist(): 0 is "< 0", 1 is 0, k is [2^(k-2), 2^(k-1)).
        let b = layout(Buckets::BpftraceLog2);
        assert_eq!(bounds(&b, 0), (None, Some(0)));
        assert_eq!(bounds(&b, 1), (Some(0), Some(1)));
        assert_eq!(bounds(&b, 2), (Some(1), Some(2)));
        assert_eq!(bounds(&b, 4), (Some(4), Some(8)));
        // bpftrace lhist(v, 0, 100, 10): "< 0", [0, 10) ... [90, 100), ">= 100".
        let lh = pb::HistogramLayout {
            min: 0,
            max: 100,
            step: 10,
            ..layout(Buckets::BpftraceLinear)
        };
        assert_eq!(bounds(&lh, 0), (None, Some(0)));
        assert_eq!(bounds(&lh, 1), (Some(0), Some(10)));
        assert_eq!(bounds(&lh, 10), (Some(90), Some(100)));
        assert_eq!(bounds(&lh, 11), (Some(100), None));
        let lin = pb::HistogramLayout {
            min: -50,
            step: 25,
            ..layout(Buckets::Linear)
        };
        assert_eq!(bounds(&lin, 0), (Some(-50), Some(-25)));
        assert_eq!(bounds(&lin, 3), (Some(25), Some(50)));
        // Bounds beyond int64 are left out of answers.
        let top = bucket(&l, 63, 1);
        assert_eq!((top.low, top.high), (None, None));
        assert_eq!(bucket(&l, 62, 1).low, Some(1 << 62));
    }

    #[test]
    fn a_histogram_has_its_used_buckets_total_mean_and_quantiles() {
        let l = layout(Buckets::Log2);
        // 10 values in [4, 8), 90 in [16, 32).
        let counts = BTreeMap::from([(1, 0), (2, 10), (4, 90), (7, 0)]);
        let h = histogram(&l, None, Vec::new(), &counts);
        let shown: Vec<_> = h.buckets.iter().map(|b| (b.index, b.count)).collect();
        assert_eq!(shown, [(2, 10), (3, 0), (4, 90)]);
        assert_eq!(h.count, 100);
        assert_eq!(h.mean, (10.0 * 6.0 + 90.0 * 24.0) / 100.0);
        // p50: 40 of the 90 in [16, 32) -> 16 + 40/90 * 16.
        let p50 = h.quantiles[0].value;
        assert!((p50 - (16.0 + 40.0 / 90.0 * 16.0)).abs() < 1e-9, "{p50}");
        assert_eq!(h.quantiles[0].q, 0.5);
        // p90 and p99 are in the last bucket; below its top.
        assert!(h.quantiles[2].value < 32.0 && h.quantiles[2].value > h.quantiles[1].value);
        let empty = histogram(&l, None, Vec::new(), &BTreeMap::new());
        assert!(empty.buckets.is_empty());
        assert_eq!((empty.count, empty.mean), (0, 0.0));
    }

    #[test]
    fn histograms_merge_by_adding_equal_buckets() {
        let l = layout(Buckets::BpftraceLog2);
        let a = histogram(&l, None, Vec::new(), &BTreeMap::from([(2, 3), (5, 1)]));
        let b = histogram(
            &l,
            None,
            Vec::new(),
            &BTreeMap::from([(0, 2), (5, u64::MAX)]),
        );
        let mut sum = BTreeMap::new();
        add(&mut sum, &a);
        add(&mut sum, &b);
        assert_eq!(
            sum,
            BTreeMap::from([(0, 2), (1, 0), (2, 3), (3, 0), (4, 0), (5, u64::MAX)])
        );
        let lin = |min, step| pb::HistogramLayout {
            min,
            step,
            ..layout(Buckets::Linear)
        };
        assert!(same_buckets(&lin(0, 10), &lin(0, 10)));
        assert!(!same_buckets(&lin(0, 10), &lin(0, 5)));
        assert!(!same_buckets(&l, &layout(Buckets::Log2)));
    }

    #[test]
    fn incomplete_layouts_are_refused_with_what_to_give() {
        let e = check(&layout(Buckets::Unspecified)).unwrap_err();
        assert!(e.0.contains("LOG2"), "{e}");
        let e = check(&layout(Buckets::Linear)).unwrap_err();
        assert!(e.0.contains("step >= 1"), "{e}");
        let e = check(&pb::HistogramLayout {
            min: 10,
            max: 10,
            step: 1,
            ..layout(Buckets::BpftraceLinear)
        })
        .unwrap_err();
        assert!(e.0.contains("max > min"), "{e}");
        for name_ in ["log2", "linear", "bpftrace-log2", "bpftrace-linear"] {
            assert_eq!(name(parse_name(name_).unwrap()), name_);
        }
    }
}
