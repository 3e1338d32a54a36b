//! Questions as walks inside the kernel: a filter, groups and aggregates
//! translated into a [`WalkPlan`], or the reason they cannot be (a member
//! the generated program does not read: text, wider than 64 bits; a filter
//! with arithmetic, strings or regular expressions). A per-CPU map's
//! `value.x` is read summed over its CPUs, `values[i].x` CPU i's, as in
//! user space.

use bpfmap_kernel::program::{IntRead, IntSpec, Side, WalkPlan};
use bpfmap_proto::typed::{IntMember, Root};

use super::{Filter, Spec};

/// The sizes of a map's key and of one value, and its possible CPUs when
/// its values are per-CPU.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Sizes {
    pub(crate) key: usize,
    pub(crate) value: usize,
    pub(crate) cpus: Option<u16>,
}

impl Sizes {
    /// Those of the map `meta` describes.
    pub(crate) fn of(meta: &bpfmap_kernel::MapMeta) -> Self {
        Self {
            key: meta.key_size as usize,
            value: meta.value_size as usize,
            cpus: meta
                .per_cpu()
                .then(|| u16::try_from(meta.possible_cpus).unwrap_or(u16::MAX)),
        }
    }
}

/// Why a question is answered in user space rather than by a walk inside
/// the kernel: what of it a walk program does not compute.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub(crate) enum Untranslatable {
    /// A member of one CPU's value (`values[N]`) beyond the CPUs a
    /// program reads.
    #[error("values[{0}] is read in user space")]
    CpuValue(usize),
    /// An integer one load cannot read (`bits` wide).
    #[error("a {0}-bit member is read in user space")]
    WideMember(usize),
    /// The filter compares text or bytes.
    #[error("the filter reads text or bytes")]
    FilterReadsBytes,
    /// The filter computes (`+`, `-`, ...).
    #[error("the filter computes arithmetic")]
    FilterComputes,
    /// The filter compares two computed values.
    #[error("the filter compares computed values")]
    FilterComparesComputed,
    /// The filter tests a computed value with `in`.
    #[error("the filter tests a computed value against a list")]
    FilterListOfComputed,
    /// The filter's `in` list has more elements than this.
    #[error("the filter has a list longer than {0}")]
    FilterLongList(usize),
    /// The filter has `a ? b : c`.
    #[error("the filter has a conditional expression")]
    FilterConditional,
    /// The filter's root is not a condition.
    #[error("the filter is not a condition")]
    FilterNotCondition,
    /// The group key is longer than a program's key.
    #[error("the group key is too long")]
    GroupKeyTooLong,
    /// A group member of bytes of a per-CPU map's value.
    #[error("a group by bytes of a per-CPU map's value is computed in user space")]
    GroupCpuValue,
    /// A group member at an offset past 64 KiB.
    #[error("a member too far")]
    MemberTooFar,
    /// A group member longer than 64 KiB.
    #[error("a member too long")]
    MemberTooLong,
    /// A group member integer wider than 64 bits.
    #[error("a group member of more than 64 bits")]
    WideGroupMember,
    /// An aggregate of the CPUs' values other than each one's of every
    /// CPU in order.
    #[error("an aggregate of some CPUs' values is computed in user space")]
    SomeCpus,
}

/// How a program reads `m`, or why it cannot.
pub(crate) fn int_read(m: &IntMember, sizes: Sizes) -> Result<IntRead, Untranslatable> {
    let (side, size) = match m.root() {
        Root::Key => (Side::Key, sizes.key),
        Root::Value => (Side::Value, sizes.value),
        Root::Cpu(i) => match u16::try_from(i) {
            Ok(cpu) if sizes.cpus.is_some_and(|n| cpu < n) => (Side::Cpu(cpu), sizes.value),
            _ => return Err(Untranslatable::CpuValue(i)),
        },
    };
    let f = m.field();
    let member = IntSpec {
        side,
        bit_offset: f.bit_offset(),
        bits: f.bits(),
        signed: f.signed(),
        big_endian: f.big_endian(),
    };
    let read = IntRead::new(member, size).ok_or(Untranslatable::WideMember(f.bits()))?;
    Ok(match (side, sizes.cpus) {
        (Side::Value, Some(cpus)) => read.summed_over(cpus),
        _ => read,
    })
}

/// The plan of an aggregate with `filter`, or why it stays in user space.
pub(crate) fn plan(
    spec: &Spec,
    filter: Option<&Filter>,
    sizes: Sizes,
    max_groups: usize,
) -> Result<WalkPlan, Untranslatable> {
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
