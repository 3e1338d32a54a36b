//! Aggregates over arrays of integers (`sum(value.slots)`: a histogram kept
//! per key, summed over the keys): each element aggregated as a member of
//! its own, one aggregate per element in the walk, and answered as one
//! list per aggregate. Groups ordered by such an aggregate are ordered by
//! its elements folded as the aggregate folds them (a SUM's total, a MIN's
//! smallest, a MAX's largest).

use bpfmap_proto::{
    aggregate::{self as values, Op},
    typed::MapLayout,
    v1::{self as pb, type_info::Kind},
};
use prost_types::value::Kind as ValueKind;

use crate::{error::Error, query::MAX_AGGREGATES};

/// Most elements one aggregate over an array covers.
pub(crate) const MAX_ELEMENTS: usize = 4096;

/// How a request's aggregates over arrays became one per element.
#[derive(Debug)]
pub(crate) struct Elements {
    /// Per asked aggregate: its elements (`None`: not an array).
    shape: Vec<Option<usize>>,
    /// When an aggregate over an array orders the groups.
    order: Option<Order>,
}

/// Ordering by an aggregate over an array, done after the walk.
#[derive(Debug)]
struct Order {
    index: usize,
    op: Op,
    ascending: bool,
    limit: usize,
    threshold: Option<i128>,
    only_given: bool,
    non_negative: bool,
}

/// The length of an array of integers at `field`; `None` for any other
/// member (or none).
fn array_len(field: &str, shown: &MapLayout) -> Option<(usize, bool)> {
    let m = shown.member(field).ok()?;
    let Some(Kind::Array(a)) = m.describe()?.kind else {
        return None;
    };
    let element = shown.member(&format!("{field}[0]")).ok()?.int().ok()?;
    a.element
        .as_ref()
        .is_some_and(|e| matches!(e.kind, Some(Kind::Int(_))))
        .then_some((a.length as usize, element.signed()))
}

impl Elements {
    /// `req` with each aggregate over an array made one per element, and
    /// how to make the answer whole again; `None` when it has none.
    pub(crate) fn expand(
        req: &pb::AggregateMapRequest,
        shown: &MapLayout,
    ) -> Result<Option<(pb::AggregateMapRequest, Self)>, Error> {
        let bad = Error::InvalidArgument;
        let arrays: Vec<Option<(usize, bool)>> = req
            .aggregates
            .iter()
            .map(|a| match Op::try_from(a.op) {
                Ok(Op::Sum | Op::Min | Op::Max) if !a.field.is_empty() => {
                    array_len(&a.field, shown)
                }
                _ => None,
            })
            .collect();
        if arrays.iter().all(Option::is_none) {
            return Ok(None);
        }
        if req.aggregates.len() > MAX_AGGREGATES {
            return Err(bad(format!(
                "{} aggregates: at most {MAX_AGGREGATES}",
                req.aggregates.len()
            )));
        }
        let mut aggregates = Vec::new();
        let mut first = Vec::new();
        for (a, array) in req.aggregates.iter().zip(&arrays) {
            first.push(aggregates.len());
            match array {
                Some((len, _)) if *len == 0 || *len > MAX_ELEMENTS => {
                    return Err(bad(format!(
                        "{} has {len} elements: an aggregate over an array covers 1 to {MAX_ELEMENTS}",
                        a.field
                    )));
                }
                Some((len, _)) => aggregates.extend((0..*len).map(|i| pb::Aggregate {
                    op: a.op,
                    field: format!("{}[{i}]", a.field),
                })),
                None => aggregates.push(a.clone()),
            }
        }
        let mut inner = pb::AggregateMapRequest {
            aggregates,
            ..req.clone()
        };
        let order = Order::of(req, &arrays, &first, &mut inner)?;
        let shape = arrays.iter().map(|a| a.map(|(len, _)| len)).collect();
        Ok(Some((inner, Self { shape, order })))
    }

    /// The answer of the expanded walk made whole: each aggregate over an
    /// array one list of its elements' values; ordered, cut at the
    /// threshold and the limit when such an aggregate orders the groups.
    pub(crate) fn collapse(&self, mut resp: pb::AggregateMapResponse) -> pb::AggregateMapResponse {
        for g in &mut resp.groups {
            let mut flat = std::mem::take(&mut g.values).into_iter();
            g.values = self
                .shape
                .iter()
                .map(|s| match s {
                    None => flat.next().unwrap_or_default(),
                    Some(n) => prost_types::Value {
                        kind: Some(ValueKind::ListValue(prost_types::ListValue {
                            values: flat.by_ref().take(*n).collect(),
                        })),
                    },
                })
                .collect();
        }
        let Some(order) = &self.order else {
            return resp;
        };
        let folded = |g: &pb::Group| order.fold(g);
        let mut keyed: Vec<(Option<i128>, pb::Group)> =
            resp.groups.into_iter().map(|g| (folded(&g), g)).collect();
        keyed.sort_by(|(x, a), (y, b)| {
            let by = match (x, y) {
                (Some(x), Some(y)) if order.ascending => x.cmp(y),
                (Some(x), Some(y)) => y.cmp(x),
                (Some(_), None) => std::cmp::Ordering::Less,
                (None, Some(_)) => std::cmp::Ordering::Greater,
                (None, None) => std::cmp::Ordering::Equal,
            };
            by.then_with(|| a.key_bytes.cmp(&b.key_bytes))
        });
        if !order.only_given {
            if let Some(t) = order.threshold {
                keyed.retain(|(v, _)| {
                    v.is_some_and(|v| if order.ascending { v <= t } else { v >= t })
                });
            }
            keyed.truncate(order.limit);
        }
        resp.groups = keyed.into_iter().map(|(_, g)| g).collect();
        if let Some(s) = resp.summary.as_mut() {
            s.order_non_negative = order.non_negative;
        }
        resp
    }
}

impl Order {
    /// How `req`'s groups are ordered: by an aggregate of one integer, in
    /// the walk (`inner` orders by its one aggregate); by one over an
    /// array, after it (`inner` keeps every group).
    fn of(
        req: &pb::AggregateMapRequest,
        arrays: &[Option<(usize, bool)>],
        first: &[usize],
        inner: &mut pb::AggregateMapRequest,
    ) -> Result<Option<Self>, Error> {
        let bad = Error::InvalidArgument;
        let index = req.order_by as usize;
        let Some(array) = arrays.get(index) else {
            return Err(bad(format!(
                "order_by {index} names no aggregate (there are {}; indexes start at 0)",
                req.aggregates.len()
            )));
        };
        inner.order_by = first[index] as u32;
        let Some((_, signed)) = array else {
            return Ok(None);
        };
        let op = Op::try_from(req.aggregates[index].op).unwrap_or(Op::Sum);
        let threshold = match req.threshold.as_str() {
            "" => None,
            t => Some(
                t.parse::<i128>()
                    .map_err(|_| bad(format!("threshold {t:?} is not a decimal integer")))?,
            ),
        };
        inner.limit = 0;
        inner.threshold = String::new();
        Ok(Some(Self {
            index,
            op,
            ascending: req.ascending,
            limit: if req.limit == 0 {
                usize::MAX
            } else {
                req.limit as usize
            },
            threshold,
            only_given: !req.groups.is_empty(),
            non_negative: op == Op::Sum && !signed,
        }))
    }

    /// A group's ordering value: its list's elements folded by the
    /// aggregate's operation.
    fn fold(&self, g: &pb::Group) -> Option<i128> {
        let Some(ValueKind::ListValue(l)) = g.values.get(self.index).and_then(|v| v.kind.as_ref())
        else {
            return None;
        };
        l.values
            .iter()
            .filter_map(|v| values::parse(v).ok().flatten())
            .fold(None, |acc, v| values::combine(self.op, acc, Some(v)))
    }
}
