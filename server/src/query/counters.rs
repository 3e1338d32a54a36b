//! The integer members of a value, by path: what a watch computes deltas
//! and rates of.

use bpfmap_proto::v1::{self as pb, type_info::Kind};

use super::{
    EntryRef,
    filter::IntLoad,
    path::{Resolved, Root, Shape},
};

/// Most members a value's deltas cover; elements of arrays count one each.
pub const MAX_COUNTERS: usize = 256;
/// Elements of one array that count (the first ones).
const MAX_ELEMENTS: u32 = 64;

/// One integer member of a value.
#[derive(Debug, Clone)]
pub struct Counter {
    /// Its path (`value.bytes`, `value.counters[2]`).
    pub path: String,
    load: IntLoad,
}

impl Counter {
    /// Its value in `e` (for per-CPU maps read in their kernel layout: the
    /// sum over the CPUs).
    /// Whether the member is signed (a gauge: its deltas may be negative,
    /// never a reset).
    pub fn signed(&self) -> bool {
        self.load.signed()
    }

    #[inline]
    pub fn read(&self, e: &EntryRef<'_>) -> Option<i128> {
        self.load.read(e)
    }
}

/// The integer members of the values `shape` describes (`projected`: the
/// record of a projection, whose members are named by their paths below
/// the value). A map without types whose value is 1, 2, 4 or 8 bytes has
/// one: the value.
pub fn counters(shape: &Shape<'_>, projected: bool) -> Vec<Counter> {
    let mut out = Vec::new();
    match shape.value {
        None if matches!(shape.value_size, 1 | 2 | 4 | 8) => push(
            &mut out,
            Resolved {
                path: "value".into(),
                root: Root::Value,
                bit_offset: 0,
                bitfield: 0,
                info: None,
                size: shape.value_size,
            },
        ),
        None => {}
        Some(t) if projected => {
            if let Some(Kind::Struct(r)) = &t.kind {
                for m in &r.members {
                    let Some(mt) = &m.r#type else { continue };
                    let path = if m.name == "value" || m.name.starts_with("values[") {
                        m.name.clone()
                    } else {
                        format!("value.{}", m.name)
                    };
                    leaves(mt, path, u64::from(m.bit_offset), &mut out);
                }
            }
        }
        Some(t) => leaves(t, "value".into(), 0, &mut out),
    }
    out
}

fn push(out: &mut Vec<Counter>, r: Resolved) {
    if out.len() < MAX_COUNTERS
        && let Ok(load) = IntLoad::of(&r)
    {
        out.push(Counter { path: r.path, load });
    }
}

fn leaves(t: &pb::TypeInfo, path: String, bit: u64, out: &mut Vec<Counter>) {
    if out.len() >= MAX_COUNTERS {
        return;
    }
    match &t.kind {
        Some(Kind::Int(_)) => push(
            out,
            Resolved {
                path,
                root: Root::Value,
                bit_offset: bit,
                bitfield: 0,
                info: Some(t.clone()),
                size: t.size as usize,
            },
        ),
        Some(Kind::Struct(r)) => {
            for m in &r.members {
                let Some(mt) = &m.r#type else { continue };
                let p = if m.name.is_empty() {
                    path.clone()
                } else {
                    format!("{path}.{}", m.name)
                };
                let at = bit + u64::from(m.bit_offset);
                if m.bitfield_size > 0 {
                    if matches!(mt.kind, Some(Kind::Int(_))) {
                        push(
                            out,
                            Resolved {
                                path: p,
                                root: Root::Value,
                                bit_offset: at,
                                bitfield: m.bitfield_size,
                                info: Some(mt.clone()),
                                size: mt.size as usize,
                            },
                        );
                    }
                } else {
                    leaves(mt, p, at, out);
                }
            }
        }
        Some(Kind::Array(a)) => {
            let Some(el) = &a.element else { return };
            if matches!(el.kind, Some(Kind::Char(_))) {
                return;
            }
            for i in 0..a.length.min(MAX_ELEMENTS) {
                leaves(
                    el,
                    format!("{path}[{i}]"),
                    bit + u64::from(i) * u64::from(el.size) * 8,
                    out,
                );
            }
        }
        // Enums, bools, chars, floats, pointers and unions are not counters.
        _ => {}
    }
}
