//! Aggregates (COUNT, SUM, MIN, MAX): how their values combine, exactly,
//! wherever values are combined: the daemon adding entries to groups, the
//! library merging many hosts' groups (a fleet's top K), bpfmapctl merging
//! a live view across hosts. Values are 128-bit integers, never floating
//! point; sums saturate far beyond any map's counters.

use prost_types::{Value, value::Kind};

pub use crate::v1::aggregate::Op;

/// An aggregate as bpfmapctl, tables and the relay name it:
/// "count()", "sum(value.bytes)".
pub fn spelling(a: &crate::v1::Aggregate) -> String {
    let op = match Op::try_from(a.op) {
        Ok(Op::Count) => "count",
        Ok(Op::Sum) => "sum",
        Ok(Op::Min) => "min",
        Ok(Op::Max) => "max",
        Ok(Op::Unspecified) | Err(_) => "unspecified",
    };
    format!("{op}({})", a.field)
}

/// Combines two values of an aggregate: COUNT and SUM add, MIN keeps the
/// smaller, MAX the larger; `None` (no value yet) changes nothing.
#[inline]
pub fn combine(op: Op, a: Option<i128>, b: Option<i128>) -> Option<i128> {
    match (a, b) {
        (None, x) | (x, None) => x,
        (Some(a), Some(b)) => Some(match op {
            Op::Min => a.min(b),
            Op::Max => a.max(b),
            Op::Count | Op::Sum | Op::Unspecified => a.saturating_add(b),
        }),
    }
}

/// Merges the values of one group from another source (another host, or
/// another scan) into `into`: one value per aggregate of `ops`.
pub fn merge(ops: &[Op], into: &mut [Option<i128>], from: &[Option<i128>]) {
    for ((op, a), b) in ops.iter().zip(into.iter_mut()).zip(from) {
        *a = combine(*op, *a, *b);
    }
}

/// A value that is not an aggregate's.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("aggregate value {0} is not an integer")]
pub struct NotAnInteger(pub String);

/// An aggregate's value as answers carry it: a decimal string, an
/// integral number (exact below 2^53), or null (a MIN or MAX of nothing).
pub fn parse(v: &Value) -> Result<Option<i128>, NotAnInteger> {
    match &v.kind {
        None | Some(Kind::NullValue(_)) => Ok(None),
        Some(Kind::StringValue(s)) => s
            .parse()
            .map(Some)
            .map_err(|_| NotAnInteger(format!("{s:?}"))),
        Some(Kind::NumberValue(n)) if n.fract() == 0.0 && n.abs() < 9.0e15 => Ok(Some(*n as i128)),
        Some(other) => Err(NotAnInteger(format!("{other:?}"))),
    }
}

/// An aggregate's value as answers carry it: COUNT and SUM as decimal
/// strings ("0" for nothing), MIN and MAX as numbers when their member has
/// at most 32 bits (`small`), else as decimal strings; null for a MIN or
/// MAX of nothing.
pub fn to_wire(op: Op, v: Option<i128>, small: bool) -> Value {
    let kind = match (op, v) {
        (Op::Min | Op::Max, None) => Kind::NullValue(0),
        (Op::Min | Op::Max, Some(v)) if small => Kind::NumberValue(v as f64),
        (_, v) => Kind::StringValue(v.unwrap_or(0).to_string()),
    };
    Value { kind: Some(kind) }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn values_combine_exactly_by_their_operation() {
        assert_eq!(combine(Op::Sum, Some(3), Some(4)), Some(7));
        assert_eq!(combine(Op::Count, None, Some(4)), Some(4));
        assert_eq!(combine(Op::Min, Some(12), Some(24)), Some(12));
        assert_eq!(combine(Op::Max, Some(198), Some(296)), Some(296));
        assert_eq!(combine(Op::Max, None, None), None);
        assert_eq!(combine(Op::Sum, Some(i128::MAX), Some(1)), Some(i128::MAX));
        let ops = [Op::Sum, Op::Min, Op::Max, Op::Count];
        let mut a = [Some(10), Some(12), Some(198), Some(2)];
        merge(&ops, &mut a, &[Some(20), Some(24), Some(296), Some(3)]);
        assert_eq!(a, [Some(30), Some(12), Some(296), Some(5)]);
    }

    #[test]
    fn values_cross_the_wire_exactly() {
        let big = i128::from(u64::MAX) * 3;
        for (op, v, small) in [
            (Op::Sum, Some(big), false),
            (Op::Count, Some(7), false),
            (Op::Min, Some(-5), true),
            (Op::Max, Some(big), false),
            (Op::Max, None, true),
        ] {
            assert_eq!(parse(&to_wire(op, v, small)), Ok(v), "{op:?} {v:?}");
        }
        assert_eq!(parse(&to_wire(Op::Sum, None, false)), Ok(Some(0)));
        assert!(parse(&Value::from(1.5)).is_err());
    }
}
