//! HistogramMap: a map that keeps a histogram, read as one AggregateMap
//! walk (the same slot, filter, bounds and walks inside the kernel) whose
//! groups become buckets. Two shapes of map: an array of counts per entry
//! (libbpf-tools' `struct hist { __u32 slots[N]; }`), summed element by
//! element, one SUM per bucket; or one entry per bucket (bpftrace's hist()
//! and lhist(), arrays indexed by bucket), grouped by the bucket member.

use std::collections::{BTreeMap, HashMap};

use bpfmap_proto::{
    aggregate::{self as values, Op},
    histogram::{self as hist, MAX_BUCKETS},
    typed::{IntField, MapLayout, Projection, Root, Source as Place},
    v1::{self as pb, histogram_layout::Buckets, type_info::Kind},
};

use super::{Aggregator, Ask, prepare_as};
use crate::{
    error::Error,
    model::{Caller, MapRequest, Rpc},
};

/// Runs a HistogramMap call.
pub(crate) async fn run(
    with: Aggregator<'_>,
    caller: &Caller,
    map: MapRequest,
    req: pb::HistogramMapRequest,
) -> Result<pb::HistogramMapResponse, Error> {
    let ask = Ask {
        rpc: Rpc::HistogramMap,
        render: &req.render,
        scan: req.scan,
        max_aggregates: MAX_BUCKETS as usize,
    };
    let holders = with.calls.holders.clone();
    let (prepared, shape) = prepare_as(with, caller, map, ask, |shown, meta| {
        let script = || holders.get().bpftrace(meta.id, &meta.name, meta.key_size);
        let shape = Shape::of(&req, shown, script)?;
        Ok((shape.request(&req), shape))
    })
    .await?;
    let answer = prepared.run(None).await?;
    shape.answer(answer, req.limit)
}

/// Where a map keeps its buckets.
#[derive(Debug, Clone, PartialEq)]
enum Source {
    /// Element k of an array of `len` integers counts bucket k.
    Slots { len: u32 },
    /// Each entry counts one bucket: its number is the key member at the
    /// start of the group keys, read by `number`.
    Keyed { number: IntField },
}

/// A histogram's layout, complete, and where its map keeps the buckets.
#[derive(Debug, Clone, PartialEq)]
struct Shape {
    layout: pb::HistogramLayout,
    source: Source,
}

impl Shape {
    /// The layout of `req` (or the one `shown`'s types say, or the script
    /// of the bpftrace process holding the map), checked against the
    /// map's types.
    fn of(
        req: &pb::HistogramMapRequest,
        shown: &MapLayout,
        script: impl FnOnce() -> Option<pb::BpftraceScript>,
    ) -> Result<Self, Error> {
        let bad = Error::InvalidArgument;
        let mut layout = req.layout.clone().unwrap_or_default();
        if layout.buckets() == Buckets::Unspecified {
            if !(layout.bucket.is_empty() && layout.count.is_empty()) {
                return Err(bad(
                    "layout.bucket and layout.count name where buckets are, not what they count: give layout.buckets too (LOG2, BPFTRACE_LOG2, LINEAR or BPFTRACE_LINEAR)".into(),
                ));
            }
            match (layout.slots.is_empty(), recognize(shown)) {
                (false, _) => layout.buckets = Buckets::Log2 as i32,
                (true, Ok(slots)) => {
                    layout.slots = slots;
                    layout.buckets = Buckets::Log2 as i32;
                }
                (true, Err(e)) => match script() {
                    Some(s) => bpftrace_layout(&mut layout, &s, e)?,
                    None => return Err(e),
                },
            }
        } else if layout.slots.is_empty() && layout.bucket.is_empty() && layout.count.is_empty() {
            // Buckets declared, not where: the value's histogram array if
            // its types have one, else an entry per bucket.
            match histograms_in(shown).as_slice() {
                [] => {}
                [one] => layout.slots = one.clone(),
                many => return Err(several(many)),
            }
        }
        hist::check(&layout).map_err(|e| bad(e.0))?;
        if layout.unit.is_empty() {
            layout.unit = "value".into();
        }
        let source = if layout.slots.is_empty() {
            keyed(&mut layout, shown)?
        } else {
            if !(layout.bucket.is_empty() && layout.count.is_empty()) {
                return Err(bad(
                    "layout: either slots (an array of counts per entry) or bucket and count (an entry per bucket), not both".into(),
                ));
            }
            Source::Slots {
                len: slots_len(&layout.slots, shown)?,
            }
        };
        let own = [&layout.slots, &layout.bucket];
        if let Some(g) = req.group_by.iter().find(|g| own.contains(g)) {
            return Err(bad(format!(
                "group_by {g:?}: the histogram's buckets are not a group (leave it out)"
            )));
        }
        Ok(Self { layout, source })
    }

    /// The aggregate walk that counts the buckets.
    fn request(&self, req: &pb::HistogramMapRequest) -> pb::AggregateMapRequest {
        let sum = |field: String| pb::Aggregate {
            op: Op::Sum as i32,
            field,
        };
        let (group_by, aggregates) = match self.source {
            Source::Slots { len } => (
                req.group_by.clone(),
                (0..len)
                    .map(|i| sum(format!("{}[{i}]", self.layout.slots)))
                    .collect(),
            ),
            Source::Keyed { .. } => (
                std::iter::once(self.layout.bucket.clone())
                    .chain(req.group_by.iter().cloned())
                    .collect(),
                vec![sum(self.layout.count.clone())],
            ),
        };
        pb::AggregateMapRequest {
            map: req.map.clone(),
            filter: req.filter.clone(),
            group_by,
            aggregates,
            per_cpu: pb::PerCpu::Sum as i32,
            render: req.render.clone(),
            scan: req.scan,
            ..Default::default()
        }
    }

    /// The histograms of an aggregate walk's groups: the largest totals
    /// first, at most `limit` (0: all).
    fn answer(
        self,
        answer: pb::AggregateMapResponse,
        limit: u32,
    ) -> Result<pb::HistogramMapResponse, Error> {
        let mut groups: HashMap<Vec<u8>, Group> = HashMap::new();
        for g in answer.groups {
            let mut key = g.key.unwrap_or_default();
            let (key_bytes, buckets) = match self.source {
                Source::Slots { .. } => {
                    let counts = g
                        .values
                        .iter()
                        .enumerate()
                        .map(|(i, v)| Ok((i as u32, count(v)?)))
                        .collect::<Result<Vec<_>, Error>>()?;
                    (g.key_bytes, counts)
                }
                Source::Keyed { number } => {
                    key.fields.remove(&self.layout.bucket);
                    let index = bucket_number(&self.layout.bucket, number, &g.key_bytes)?;
                    let c = g.values.first().map(count).transpose()?.unwrap_or(0);
                    let rest = g.key_bytes.get(number.bits() / 8..).unwrap_or_default();
                    (rest.to_vec(), vec![(index, c)])
                }
            };
            let group = groups.entry(key_bytes).or_insert_with(|| Group {
                key,
                counts: BTreeMap::new(),
            });
            for (i, c) in buckets {
                let at = group.counts.entry(i).or_insert(0);
                *at = at.saturating_add(c);
            }
        }
        let mut histograms: Vec<pb::Histogram> = groups
            .into_iter()
            .map(|(key_bytes, g)| hist::histogram(&self.layout, Some(g.key), key_bytes, &g.counts))
            .collect();
        histograms.sort_by(|a, b| {
            b.count
                .cmp(&a.count)
                .then_with(|| a.key_bytes.cmp(&b.key_bytes))
        });
        // Histograms before the limit.
        let total = histograms.len() as u64;
        if limit > 0 {
            histograms.truncate(limit as usize);
        }
        let summary = answer.summary.map(|s| pb::AggregateSummary {
            groups_total: total,
            order_non_negative: true,
            ..s
        });
        Ok(pb::HistogramMapResponse {
            histograms,
            layout: Some(self.layout),
            summary,
        })
    }
}

/// One histogram being merged from its groups.
struct Group {
    key: prost_types::Struct,
    counts: BTreeMap<u32, u64>,
}

/// A bucket's count as a SUM carries it (counts are never negative; a
/// count past 2^64 saturates).
fn count(v: &prost_types::Value) -> Result<u64, Error> {
    let v = values::parse(v)
        .map_err(|e| internal(format!("a histogram's sum: {e}")))?
        .unwrap_or(0);
    Ok(u64::try_from(v.max(0)).unwrap_or(u64::MAX))
}

fn internal(message: String) -> Error {
    Error::Internal { map: None, message }
}

/// The bucket number at the start of a group key (`number` reads it).
fn bucket_number(path: &str, number: IntField, key_bytes: &[u8]) -> Result<u32, Error> {
    let n = number
        .value(key_bytes)
        .ok_or_else(|| internal(format!("{path}: a group key too short for its bucket")))?;
    u32::try_from(n)
        .ok()
        .filter(|n| *n < MAX_BUCKETS)
        .ok_or_else(|| {
            Error::InvalidArgument(format!(
                "{path} holds {n} in an entry: not a bucket number (0 to {}); is this map a histogram kept one entry per bucket?",
                MAX_BUCKETS - 1
            ))
        })
}

/// The member of a map's value that is its histogram: the one array of
/// integers named `slots` or `hist` (libbpf-tools' `struct hist`,
/// funclatency's `hist[]`).
/// The layout of a bpftrace hist() or lhist() map its script gives (one
/// entry per bucket, keyed by the bucket alone); `unrecognized` otherwise,
/// said with what the script shows.
fn bpftrace_layout(
    layout: &mut pb::HistogramLayout,
    script: &pb::BpftraceScript,
    unrecognized: Error,
) -> Result<(), Error> {
    let bad = Error::InvalidArgument;
    match (script.function.as_str(), script.key.is_empty()) {
        ("hist", true) => layout.buckets = Buckets::BpftraceLog2 as i32,
        ("lhist", true) if script.step > 0 => {
            layout.buckets = Buckets::BpftraceLinear as i32;
            (layout.min, layout.max, layout.step) = (script.min, script.max, script.step);
        }
        ("lhist", true) => {
            return Err(bad(
                "the map is a bpftrace lhist() whose bounds its script does not give as numbers: declare them, {\"buckets\": \"BPFTRACE_LINEAR\", \"min\": ..., \"max\": ..., \"step\": ...}".into(),
            ));
        }
        ("hist" | "lhist", false) => {
            return Err(bad(format!(
                "the map is a bpftrace {}() keyed by [{}] and a bucket: declare its key with the bucket last, e.g. {{\"key\": \"struct {{ ...; __u64 bucket; }}\"}}, the layout {{\"buckets\": \"{}\", \"bucket\": \"key.bucket\"}} and group_by the other members",
                script.function,
                script.key,
                if script.function == "hist" {
                    "BPFTRACE_LOG2"
                } else {
                    "BPFTRACE_LINEAR"
                }
            )));
        }
        ("", _) => return Err(unrecognized),
        (f, _) => {
            return Err(bad(format!(
                "the map is kept by bpftrace's {f}(), not a histogram (bpfmapctl bpftrace prints it as bpftrace does)"
            )));
        }
    }
    Ok(())
}

fn recognize(shown: &MapLayout) -> Result<String, Error> {
    match histograms_in(shown).as_slice() {
        [one] => Ok(one.clone()),
        [] => Err(Error::InvalidArgument(
            "the map's types hold no histogram this daemon recognizes (an array of integers named slots or hist in the value): declare its layout, e.g. {\"buckets\": \"BPFTRACE_LOG2\"} for a bpftrace hist() map (bpfmapctl hist --hist bpftrace-log2), or {\"buckets\": \"LOG2\", \"slots\": \"value.counts\"}".into(),
        )),
        many => Err(several(many)),
    }
}

/// The arrays of integers named `slots` or `hist` in a map's value.
fn histograms_in(shown: &MapLayout) -> Vec<String> {
    let mut found = Vec::new();
    if let Some(t) = shown.member("value").ok().and_then(|m| m.describe()) {
        histogram_arrays(&t, "value", &mut found);
    }
    found
}

fn several(paths: &[String]) -> Error {
    Error::InvalidArgument(format!(
        "the map's value holds several histograms ({}): name one in layout.slots",
        paths.join(", ")
    ))
}

/// Adds the paths below `t` (named `path`) of arrays of integers named
/// `slots` or `hist`, through records (anonymous members as C reaches
/// them), not into arrays.
fn histogram_arrays(t: &pb::TypeInfo, path: &str, out: &mut Vec<String>) {
    let (Some(Kind::Struct(r)) | Some(Kind::Union(r))) = &t.kind else {
        return;
    };
    for m in &r.members {
        let Some(mt) = &m.r#type else { continue };
        let p = if m.name.is_empty() {
            path.to_owned()
        } else {
            format!("{path}.{}", m.name)
        };
        match &mt.kind {
            Some(Kind::Array(_))
                if matches!(m.name.as_str(), "slots" | "hist") && int_array_len(mt).is_some() =>
            {
                out.push(p);
            }
            Some(Kind::Struct(_) | Kind::Union(_)) => histogram_arrays(mt, &p, out),
            _ => {}
        }
    }
}

/// The length of an array of integers; `None` for any other type.
fn int_array_len(t: &pb::TypeInfo) -> Option<u32> {
    match &t.kind {
        Some(Kind::Array(a)) => a
            .element
            .as_ref()
            .is_some_and(|e| matches!(e.kind, Some(Kind::Int(_))))
            .then_some(a.length),
        _ => None,
    }
}

/// The length of the array of counts at `path`: integers, at most
/// MAX_BUCKETS of them.
fn slots_len(path: &str, shown: &MapLayout) -> Result<u32, Error> {
    let bad = Error::InvalidArgument;
    let m = shown
        .member(path)
        .map_err(|e| bad(format!("layout.slots: {e}")))?;
    let Some(len) = m.describe().as_ref().and_then(int_array_len) else {
        return Err(bad(format!(
            "layout.slots: {path} is {}, not an array of integers",
            m.type_name()
        )));
    };
    if len == 0 || len > MAX_BUCKETS {
        return Err(bad(format!(
            "layout.slots: {path} has {len} elements: a histogram has 1 to {MAX_BUCKETS} buckets"
        )));
    }
    Ok(len)
}

/// An entry per bucket: the bucket member (default `key`) is an integer of
/// the key, the count (default `value`) an integer.
fn keyed(layout: &mut pb::HistogramLayout, shown: &MapLayout) -> Result<Source, Error> {
    let bad = Error::InvalidArgument;
    if layout.bucket.is_empty() {
        layout.bucket = "key".into();
    }
    if layout.count.is_empty() {
        layout.count = "value".into();
    }
    let bucket = shown
        .member(&layout.bucket)
        .map_err(|e| bad(format!("layout.bucket: {e}")))?;
    if bucket.root() != Root::Key {
        return Err(bad(format!(
            "layout.bucket: {} is not in the key: a histogram kept one entry per bucket has the bucket number in its key",
            layout.bucket
        )));
    }
    let int = bucket
        .int()
        .map_err(|e| bad(format!("layout.bucket: {e}")))?;
    if int.field().is_bitfield() {
        return Err(bad(format!(
            "layout.bucket: {} is a bitfield: a bucket number is a whole integer",
            layout.bucket
        )));
    }
    shown
        .member(&layout.count)
        .and_then(|m| m.int())
        .map_err(|e| bad(format!("layout.count: {e}")))?;
    let projection = Projection::new(std::slice::from_ref(&layout.bucket), shown)
        .map_err(|e| bad(format!("layout.bucket: {e}")))?;
    // How a group key holds it: an integer of its width, or its bytes.
    let number = match projection.places().as_slice() {
        [(Place::Int(_), 0, size)] => IntField::whole(0, *size, true, false),
        [(Place::Bytes { len, .. }, 0, _)] => {
            let f = int.field();
            IntField::whole(0, *len, f.signed(), f.big_endian())
        }
        _ => {
            return Err(bad(format!(
                "layout.bucket: {} is not a whole integer of the key",
                layout.bucket
            )));
        }
    };
    Ok(Source::Keyed { number })
}
