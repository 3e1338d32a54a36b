//! Queries evaluated where the map lives: filters (CEL, compiled to read
//! members from the entries' bytes), projections (only some members), and
//! aggregates (groups with COUNT, SUM, MIN, MAX). The `cel` crate parses;
//! everything after the parse is ours, checked against the map's types once
//! per call.

mod aggregate;
mod filter;
#[cfg(test)]
mod projection_tests;
pub(crate) mod scan;
#[cfg(test)]
mod testing;

use std::time::Duration;

use bpfmap_kernel::{MapMeta, walk::Chunk};
pub use bpfmap_proto::typed::{
    Counter, EntryRef, MAX_COUNTERS, MAX_FIELDS, MapLayout, MapShape, Projection, ProjectionError,
};
use bpfmap_proto::v1 as pb;

pub use aggregate::{Acc, AggregateError, MAX_AGGREGATES, Spec, Table};
pub use filter::{
    Filter, FilterError, MAX_FILTER_DEPTH, MAX_FILTER_LEN, MAX_FILTER_NODES, MAX_LIST_ELEMENTS,
    MAX_REGEXES,
};

/// Why a dump's or a watch's query cannot be used (INVALID_ARGUMENT).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum QueryError {
    /// The filter does not compile.
    #[error(transparent)]
    Filter(#[from] FilterError),
    /// A field cannot be selected.
    #[error("fields: {0}")]
    Fields(ProjectionError),
}

/// A filter that costs too much against the walk it filters
/// (RESOURCE_EXHAUSTED).
#[derive(Debug, Clone, Copy, PartialEq, thiserror::Error)]
#[error(
    "the filter costs {times:.0} times the walk it filters (limits.max_filter_cost is {limit}): simplify it"
)]
pub struct FilterTooCostly {
    /// Evaluation time over read time.
    pub times: f64,
    /// limits.max_filter_cost.
    pub limit: u32,
}

/// What a dump's or a watch's request asks of its entries, and how the
/// call reads them.
#[derive(Debug, Clone, Copy)]
pub(crate) struct QueryRequest<'a> {
    /// The filter (CEL), empty for none.
    pub(crate) filter: &'a str,
    /// The fields kept, none for all.
    pub(crate) fields: &'a [String],
    /// The map's layout as the call shows it: with its renderings, whose
    /// spellings the filter's literals may use, and which the projected
    /// members keep.
    pub(crate) shown: &'a MapLayout,
    /// How the call reads entries beyond the map's own BTF (renderings,
    /// declared types: `KnownTypes::reading`), which a cursor binds.
    pub(crate) reading: Option<&'a str>,
}

/// What a dump asks beyond the walk: a filter, a projection.
#[derive(Debug)]
pub(crate) struct Query {
    pub(crate) filter: Option<Filter>,
    pub(crate) projection: Option<Projection>,
    /// Per-CPU maps: the bytes of one CPU's value in the kernel's layout.
    stride: usize,
    key_size: usize,
    value_size: usize,
    /// What the cursor binds: the filter and the fields.
    digest: [u8; 16],
}

impl Query {
    /// The query of a request, checked against the map's layout as the
    /// call shows it; `None` when it asks for neither a filter nor fields.
    pub(crate) fn of_request(
        req: QueryRequest<'_>,
        meta: &MapMeta,
    ) -> Result<Option<Self>, QueryError> {
        let QueryRequest {
            filter,
            fields,
            shown,
            reading,
        } = req;
        if filter.is_empty() && fields.is_empty() {
            return Ok(None);
        }
        let digest = digest(filter, fields, reading);
        let filter = match filter {
            "" => None,
            f => Some(Filter::compile(f, shown)?),
        };
        let projection = match fields {
            [] => None,
            f => Some(Projection::new(f, shown).map_err(QueryError::Fields)?),
        };
        Ok(Some(Self {
            filter,
            projection,
            stride: if meta.per_cpu() { meta.cpu_stride() } else { 0 },
            key_size: meta.key_size as usize,
            value_size: meta.kernel_value_size(),
            digest,
        }))
    }

    /// What a cursor of this query binds.
    pub(crate) fn digest(&self) -> [u8; 16] {
        self.digest
    }

    /// Keeps the entries of `c` that match, at most `max` of them; returns
    /// how many entries of `c` were looked at to find them (all of them
    /// unless `max` cut the chunk short).
    pub(crate) fn keep_matching(&self, c: &mut Chunk, max: Option<u64>) -> usize {
        let Some(filter) = &self.filter else {
            return cut(c, max, self.key_size, self.value_size);
        };
        let (ks, vs) = (self.key_size, self.value_size);
        let mut kept = 0usize;
        let mut looked = 0usize;
        for i in 0..c.count {
            if max.is_some_and(|m| kept as u64 >= m) {
                break;
            }
            looked += 1;
            let e = EntryRef {
                key: &c.keys[i * ks..(i + 1) * ks],
                value: &c.values[i * vs..(i + 1) * vs],
                stride: self.stride,
            };
            if filter.matches(&e) {
                if kept != i {
                    c.keys.copy_within(i * ks..(i + 1) * ks, kept * ks);
                    c.values.copy_within(i * vs..(i + 1) * vs, kept * vs);
                }
                kept += 1;
            }
        }
        c.count = kept;
        c.keys.truncate(kept * ks);
        c.values.truncate(kept * vs);
        looked
    }

    /// The projected chunk and the description its messages are built
    /// with (the projected records as a map that is not per-CPU).
    pub(crate) fn project(&self, c: Chunk, meta: &MapMeta) -> (Chunk, Option<MapMeta>) {
        let Some(p) = &self.projection else {
            return (c, None);
        };
        let (ks, vs) = (self.key_size, self.value_size);
        let mut keys = Vec::with_capacity(c.count * p.key_size());
        let mut values = Vec::with_capacity(c.count * p.value_size());
        for i in 0..c.count {
            let e = EntryRef {
                key: &c.keys[i * ks..(i + 1) * ks],
                value: &c.values[i * vs..(i + 1) * vs],
                stride: self.stride,
            };
            p.write(&e, &mut keys, &mut values);
        }
        let chunk = Chunk {
            count: c.count,
            keys,
            values,
        };
        (chunk, Some(projected_meta(meta, p)))
    }
}

/// A map description of projected records.
pub(crate) fn projected_meta(meta: &MapMeta, p: &Projection) -> MapMeta {
    let mut m = meta.clone();
    if m.per_cpu() {
        m.map_type = bpfmap_kernel::MapType::HASH;
    }
    m.key_size = p.key_size() as u32;
    m.value_size = p.value_size() as u32;
    m
}

/// Cuts `c` to at most `max` entries; how many are left.
fn cut(c: &mut Chunk, max: Option<u64>, ks: usize, vs: usize) -> usize {
    if let Some(m) = max
        && (c.count as u64) > m
    {
        c.count = m as usize;
        c.keys.truncate(c.count * ks);
        c.values.truncate(c.count * vs);
    }
    c.count
}

/// The digest a cursor binds: the filter and the fields, in order, and how
/// the entries are read when that is not the map's own BTF alone (so that
/// cursors of plain queries stay what they were).
fn digest(filter: &str, fields: &[String], reading: Option<&str>) -> [u8; 16] {
    let mut ctx = ring::digest::Context::new(&ring::digest::SHA256);
    ctx.update(&(filter.len() as u64).to_le_bytes());
    ctx.update(filter.as_bytes());
    for f in fields {
        ctx.update(&(f.len() as u64).to_le_bytes());
        ctx.update(f.as_bytes());
    }
    if let Some(r) = reading {
        ctx.update(&(r.len() as u64).to_le_bytes());
        ctx.update(r.as_bytes());
    }
    let mut out = [0u8; 16];
    out.copy_from_slice(&ctx.finish().as_ref()[..16]);
    out
}

/// The projection's types, for the first message of a projected dump.
pub(crate) fn projection_message(p: &Projection) -> pb::Projection {
    pb::Projection {
        key_type: p.key_type(),
        value_type: p.value_type(),
        render: p.renderings().into_iter().collect(),
    }
}

/// Bounds what a filter may cost against the walk it filters: past a
/// minimum, evaluating may take at most `multiple` times the kernel reads.
#[derive(Debug, Clone, Copy)]
pub(crate) struct CostMeter {
    multiple: u32,
    reads: Duration,
    evals: Duration,
}

/// Evaluation time below which no filter is stopped (a short dump's
/// timings say little).
const FREE_EVAL: Duration = Duration::from_millis(200);

impl CostMeter {
    pub(crate) fn new(multiple: u32) -> Self {
        Self {
            multiple,
            reads: Duration::ZERO,
            evals: Duration::ZERO,
        }
    }

    /// Adds one chunk's timings; an error once the filter costs too much.
    pub(crate) fn add(&mut self, read: Duration, eval: Duration) -> Result<(), FilterTooCostly> {
        self.reads += read;
        self.evals += eval;
        if self.multiple != 0 && self.evals > FREE_EVAL && self.evals > self.reads * self.multiple {
            return Err(FilterTooCostly {
                times: self.evals.as_secs_f64() / self.reads.as_secs_f64().max(1e-9),
                limit: self.multiple,
            });
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A query of `filter` over flow keys and stats.
    fn query(filter: &str) -> Query {
        let (key, value) = (testing::flow_key(), testing::flow_stats());
        let layout = testing::layout(&key, &value, None);
        Query {
            filter: Some(Filter::compile(filter, &layout).unwrap()),
            projection: None,
            stride: 0,
            key_size: 16,
            value_size: 16,
            digest: digest(filter, &[], None),
        }
    }

    /// Entries i = 0..n: dport i, bytes 10 * i.
    fn chunk(n: u16) -> Chunk {
        let mut c = Chunk {
            count: usize::from(n),
            ..Chunk::default()
        };
        for i in 0..n {
            c.keys.extend(testing::flow(1, 2, 3, i, 6));
            c.values.extend(testing::stats(1, 10 * u64::from(i)));
        }
        c
    }

    fn dports(c: &Chunk) -> Vec<u16> {
        c.keys
            .chunks(16)
            .map(|k| u16::from_le_bytes([k[10], k[11]]))
            .collect()
    }

    #[test]
    fn matching_entries_are_kept_in_order_up_to_a_maximum() {
        let q = query("key.dport % 3 == 0");
        let mut c = chunk(20);
        assert_eq!(q.keep_matching(&mut c, None), 20);
        assert_eq!(dports(&c), [0, 3, 6, 9, 12, 15, 18]);
        assert_eq!(c.values.len(), 7 * 16);
        assert_eq!(&c.values[16 + 8..32], &30u64.to_le_bytes());
        let mut c = chunk(20);
        // Three matches are at 0, 3 and 6: 7 entries looked at.
        assert_eq!(q.keep_matching(&mut c, Some(3)), 7);
        assert_eq!(dports(&c), [0, 3, 6]);
        let mut c = chunk(20);
        assert_eq!(q.keep_matching(&mut c, Some(0)), 0);
        assert_eq!(c.count, 0);
    }

    #[test]
    fn the_cursor_digest_binds_the_filter_and_the_fields_in_order() {
        let a = ["key.dport".to_owned(), "value.bytes".to_owned()];
        let b = ["value.bytes".to_owned(), "key.dport".to_owned()];
        let d = |f: &str, fields: &[String]| digest(f, fields, None);
        assert_eq!(d("x", &a), d("x", &a));
        assert_ne!(d("x", &a), d("x", &b));
        assert_ne!(d("x", &a), d("y", &a));
        // Lengths are framed: no two splits of the same text collide.
        assert_ne!(d("", &["ab".to_owned()]), d("a", &["b".to_owned()]));
        // How entries are read binds too (`key == 443` with be16 or not).
        assert_ne!(d("x", &a), digest("x", &a, Some("render key=be16;")));
    }

    #[test]
    fn the_cost_meter_stops_a_filter_only_past_the_free_time_and_the_multiple() {
        let ms = Duration::from_millis;
        let mut m = CostMeter::new(8);
        assert!(m.add(ms(1), ms(150)).is_ok(), "under the free time");
        assert!(m.add(ms(1), ms(40)).is_ok(), "190 ms: still free");
        let e = m.add(ms(1), ms(20)).unwrap_err();
        assert_eq!(
            e.to_string(),
            "the filter costs 70 times the walk it filters (limits.max_filter_cost is 8): simplify it"
        );
        let mut m = CostMeter::new(8);
        assert!(m.add(ms(100), ms(700)).is_ok(), "7x the walk");
        let mut off = CostMeter::new(0);
        assert!(off.add(ms(1), ms(10_000)).is_ok(), "0 turns it off");
    }
}
