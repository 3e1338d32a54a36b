//! Questions as walks inside the kernel: a filter, groups and aggregates
//! translated into a [`WalkPlan`], or the reason they cannot be (a member
//! the generated program does not read: text, wider than 64 bits, one
//! CPU's value; a filter with arithmetic, strings or regular expressions).

use bpfmap_kernel::program::{IntRead, IntSpec, Side, WalkPlan};
use bpfmap_proto::typed::{IntMember, Root};

use super::{Filter, Spec};

/// The sizes of a map's key and of one value.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Sizes {
    pub(crate) key: usize,
    pub(crate) value: usize,
}

/// How a program reads `m`, or why it cannot.
pub(crate) fn int_read(m: &IntMember, sizes: Sizes) -> Result<IntRead, String> {
    let (side, size) = match m.root() {
        Root::Key => (Side::Key, sizes.key),
        Root::Value => (Side::Value, sizes.value),
        Root::Cpu(_) => return Err("one CPU's value is read in user space".into()),
    };
    let f = m.field();
    let member = IntSpec {
        side,
        bit_offset: f.bit_offset(),
        bits: f.bits(),
        signed: f.signed(),
        big_endian: f.big_endian(),
    };
    IntRead::new(member, size)
        .ok_or_else(|| format!("a {}-bit member is read in user space", f.bits()))
}

/// The plan of an aggregate with `filter`, or why it stays in user space.
pub(crate) fn plan(
    spec: &Spec,
    filter: Option<&Filter>,
    sizes: Sizes,
    max_groups: usize,
) -> Result<WalkPlan, String> {
    let filter = match filter {
        None => bpfmap_kernel::program::Cond::Const(true),
        Some(f) => f.kernel_cond(sizes)?,
    };
    let (group, key_len, aggs) = spec.kernel_parts(sizes)?;
    // Only COUNT, no filter, no groups: the program counts what it visits.
    if filter == bpfmap_kernel::program::Cond::Const(true)
        && group.is_empty()
        && aggs
            .iter()
            .all(|a| *a == bpfmap_kernel::program::AggOp::Count)
    {
        return Ok(WalkPlan::count());
    }
    Ok(WalkPlan {
        output: bpfmap_kernel::program::Output::Groups,
        filter,
        group,
        key_len,
        aggs,
        max_groups: u32::try_from(max_groups).unwrap_or(u32::MAX),
    })
}
