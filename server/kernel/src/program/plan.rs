//! What a walk inside the kernel computes, in terms of bytes and bits of a
//! map's keys and values: which entries it takes, how it groups them,
//! what it computes per group, and in which table it keeps the groups.
//! The code that computes it is [`code`](super::code)'s.

use super::asm::{Alu, Asm, Jmp, Reg};

/// Which part of an entry a member is in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Side {
    Key,
    /// The value; of a per-CPU map, every CPU's (a read sums them, or an
    /// aggregate takes each: [`IntRead::summed_over`], [`AggOp::MinOfEach`]).
    Value,
    /// One CPU's value of a per-CPU map: the CPU's index among the
    /// possible CPUs.
    Cpu(u16),
}

/// An integer member as a walk program reads it: one load of 1, 2, 4 or 8 bytes,
/// swapped from network order, shifted and cut to its bits, sign-extended
/// to 64 bits; of a per-CPU map's value, summed over the CPUs (in 128
/// bits when the sum can pass 63).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct IntRead {
    pub(super) side: Side,
    offset: u16,
    size: u8,
    shift: u8,
    pub(super) bits: u8,
    pub(super) signed: bool,
    big_endian: bool,
    /// The CPUs whose values it sums (a per-CPU map's `value`); 0 for a
    /// member read once.
    pub(super) summed: u16,
}

/// An integer member of an entry: where it lies and how it is encoded.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct IntSpec {
    /// The part of the entry it is in.
    pub side: Side,
    /// Its first bit in that part.
    pub bit_offset: usize,
    /// Its width in bits.
    pub bits: usize,
    /// Whether it is signed.
    pub signed: bool,
    /// Whether it is in network byte order.
    pub big_endian: bool,
}

impl IntRead {
    /// How a walk program reads `member`, in a side of `side_size` bytes,
    /// or `None` when one load cannot read it: wider than 64 bits, a
    /// network-order integer of an odd width, a bitfield that straddles
    /// what a load can reach.
    pub fn new(member: IntSpec, side_size: usize) -> Option<Self> {
        let IntSpec {
            side,
            bit_offset,
            bits,
            signed,
            big_endian,
        } = member;
        if bits == 0 || bits > 64 {
            return None;
        }
        let (offset, shift) = (bit_offset / 8, bit_offset % 8);
        let size = [1usize, 2, 4, 8]
            .into_iter()
            .find(|s| shift + bits <= s * 8 && offset + s <= side_size)?;
        if big_endian && (shift != 0 || bits != size * 8) {
            return None;
        }
        Some(Self {
            side,
            offset: u16::try_from(offset).ok().filter(|o| *o < 0x7ff0)?,
            size: size as u8,
            shift: shift as u8,
            bits: bits as u8,
            signed,
            big_endian,
            summed: 0,
        })
    }

    /// The same member of a per-CPU map's value, summed over its `cpus`
    /// CPUs (what `value.x` means there).
    pub fn summed_over(self, cpus: u16) -> Self {
        Self {
            summed: cpus,
            ..self
        }
    }

    /// The byte after the last one it loads.
    pub(super) fn end(&self) -> usize {
        usize::from(self.offset) + usize::from(self.size)
    }

    /// The smallest and largest value it reads (a sum: that many times
    /// the member's).
    pub(super) fn range(&self) -> (i128, i128) {
        let b = u32::from(self.bits);
        let (min, max) = if self.signed {
            (-(1i128 << (b - 1)), (1i128 << (b - 1)) - 1)
        } else {
            (0, (1i128 << b) - 1)
        };
        let n = i128::from(self.summed.max(1));
        (min * n, max * n)
    }

    /// Whether it is a sum that may not fit 63 bits: kept in 128.
    pub(super) fn wide(&self) -> bool {
        self.summed > 0
            && u32::from(self.bits) + u32::from(self.summed).next_power_of_two().ilog2() > 63
    }

    /// The member, one value of it, as a read of one CPU's value (the
    /// reads a per-CPU sum is made of).
    pub(super) fn one(&self) -> Self {
        Self { summed: 0, ..*self }
    }

    /// Loads one value of it into `dst` from the part of the entry `base`
    /// points to.
    pub(super) fn emit_from(&self, a: &mut Asm, base: Reg, dst: Reg) {
        let size = u32::from(self.size);
        a.load(dst, base, self.offset as i16, size);
        if self.big_endian && size > 1 {
            a.swap_be(dst, (size * 8) as i32);
        }
        if self.shift > 0 {
            a.alu_imm(Alu::Rsh, dst, i32::from(self.shift));
        }
        let bits = i32::from(self.bits);
        if bits < 64 && (self.signed || bits < (size * 8) as i32) {
            a.alu_imm(Alu::Lsh, dst, 64 - bits);
            let op = if self.signed { Alu::Arsh } else { Alu::Rsh };
            a.alu_imm(op, dst, 64 - bits);
        }
    }
}

/// A comparison of a member with a constant.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum CmpOp {
    Eq,
    Ne,
    Lt,
    Le,
    Gt,
    Ge,
}

impl CmpOp {
    pub(super) fn test(self, a: i128, b: i128) -> bool {
        match self {
            Self::Eq => a == b,
            Self::Ne => a != b,
            Self::Lt => a < b,
            Self::Le => a <= b,
            Self::Gt => a > b,
            Self::Ge => a >= b,
        }
    }

    pub(super) fn jump(self, signed: bool) -> Jmp {
        match (self, signed) {
            (Self::Eq, _) => Jmp::Eq,
            (Self::Ne, _) => Jmp::Ne,
            (Self::Lt, false) => Jmp::Lt,
            (Self::Le, false) => Jmp::Le,
            (Self::Gt, false) => Jmp::Gt,
            (Self::Ge, false) => Jmp::Ge,
            (Self::Lt, true) => Jmp::Slt,
            (Self::Le, true) => Jmp::Sle,
            (Self::Gt, true) => Jmp::Sgt,
            (Self::Ge, true) => Jmp::Sge,
        }
    }
}

/// Which entries a walk takes.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Cond {
    Const(bool),
    /// `member op constant`.
    Cmp(IntRead, CmpOp, i128),
    Not(Box<Cond>),
    All(Vec<Cond>),
    Any(Vec<Cond>),
}

impl Cond {
    /// The same condition with what is known before the walk folded away
    /// (constants, comparisons that no value of the member can change):
    /// the verifier refuses code no path reaches.
    pub fn simplified(self) -> Self {
        match self {
            Self::Cmp(r, op, k) => {
                let (min, max) = r.range();
                if k < min || k > max {
                    let probe = if k < min { min } else { max };
                    Self::Const(op.test(probe, k))
                } else {
                    Self::Cmp(r, op, k)
                }
            }
            Self::Not(c) => match c.simplified() {
                Self::Const(b) => Self::Const(!b),
                c => Self::Not(Box::new(c)),
            },
            Self::All(cs) => fold(cs, true),
            Self::Any(cs) => fold(cs, false),
            c @ Self::Const(_) => c,
        }
    }

    /// The members it reads.
    pub(super) fn reads(&self, out: &mut Vec<IntRead>) {
        match self {
            Self::Const(_) => {}
            Self::Cmp(r, _, _) => out.push(*r),
            Self::Not(c) => c.reads(out),
            Self::All(cs) | Self::Any(cs) => cs.iter().for_each(|c| c.reads(out)),
        }
    }
}

/// An `All` (`all`) or `Any` of `cs`, simplified.
fn fold(cs: Vec<Cond>, all: bool) -> Cond {
    let mut kept = Vec::new();
    for c in cs.into_iter().map(Cond::simplified) {
        match c {
            // true in All, false in Any: no effect.
            Cond::Const(b) if b == all => {}
            // false in All, true in Any: decides.
            Cond::Const(b) => return Cond::Const(b),
            c => kept.push(c),
        }
    }
    match kept.len() {
        0 => Cond::Const(all),
        1 => kept.pop().expect("one"),
        _ if all => Cond::All(kept),
        _ => Cond::Any(kept),
    }
}

/// One aggregate of a group.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum AggOp {
    Count,
    Sum(IntRead),
    Min(IntRead),
    Max(IntRead),
    /// The smallest of every CPU's value of a per-CPU map's member (each
    /// CPU's value a value of its own).
    MinOfEach(IntRead),
    /// The largest of every CPU's value.
    MaxOfEach(IntRead),
}

impl AggOp {
    /// Its value in a group, from the two words the program keeps: a SUM's
    /// 128 bits (low, high), a MIN's or MAX's 64 (128 for a sum that can
    /// pass 63 bits).
    pub fn value(&self, count: u64, words: (u64, u64)) -> i128 {
        let (low, high) = words;
        let wide = ((u128::from(high) << 64) | u128::from(low)) as i128;
        match self {
            Self::Count => i128::from(count),
            Self::Sum(_) => wide,
            Self::Min(r) | Self::Max(r) if r.wide() => wide,
            Self::Min(r) | Self::Max(r) | Self::MinOfEach(r) | Self::MaxOfEach(r) if r.signed => {
                i128::from(low as i64)
            }
            Self::Min(_) | Self::Max(_) | Self::MinOfEach(_) | Self::MaxOfEach(_) => {
                i128::from(low)
            }
        }
    }
}

/// Where a member of a group key comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum GroupPart {
    /// `len` bytes at `offset` of a side, copied to `out`.
    Bytes {
        side: Side,
        offset: u16,
        len: u16,
        out: u16,
    },
    /// An integer, written little-endian in `size` bytes (1, 2, 4, 8; 16
    /// for a sum over CPUs) at `out`.
    Int { read: IntRead, out: u16, size: u8 },
}

impl GroupPart {
    /// Its bits in a dense table's index, when it can be part of one: an
    /// integer read once, or one or two bytes.
    fn index_bits(&self) -> Option<u32> {
        match self {
            Self::Int { read, .. } if read.summed == 0 => Some(u32::from(read.bits)),
            Self::Bytes { len, .. } if *len <= 2 => Some(u32::from(*len) * 8),
            _ => None,
        }
    }
}

/// What a walk keeps of the entries its condition takes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Output {
    /// Their groups, with aggregates per group (or only how many entries
    /// there are).
    Groups,
    /// The entries themselves, key and value, at most `max_groups` of them.
    Entries,
}

/// What a walk inside the kernel computes: the entries a condition takes, grouped by a key
/// made of members, with aggregates per group; without aggregates, only
/// how many entries there are; or the entries themselves.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct WalkPlan {
    pub output: Output,
    pub filter: Cond,
    pub group: Vec<GroupPart>,
    /// The group key's length (the parts end within it).
    pub key_len: u16,
    pub aggs: Vec<AggOp>,
    /// Groups (entries) beyond which the walk stops, reporting the
    /// overflow.
    pub max_groups: u32,
}

/// Where a walk program keeps its groups.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GroupTable {
    /// Nowhere: it counts the entries.
    None,
    /// An array of `slots` groups indexed by the group key's bits (a key
    /// of at most 16 bits: small integers, enums, bitfields, bytes): no
    /// lookup per entry.
    Dense { slots: u32 },
    /// A hash map of at most `max_groups` groups (or of the entries taken).
    Hash,
}

/// The largest dense table, in bytes: beyond it, groups go to a hash map.
pub const MAX_DENSE_BYTES: usize = 8 << 20;

/// Why a plan cannot run on a map.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum PlanError {
    /// It copies a per-CPU map's entries.
    #[error("a scan in the kernel does not copy out the entries of a per-CPU map")]
    PerCpuEntries,
    /// It reads bytes of a per-CPU map's value.
    #[error("a scan in the kernel reads the integers of a per-CPU map's values, not their bytes")]
    PerCpuBytes,
    /// It reads the CPUs' values of a map that has one value per entry, or
    /// sums another number of CPUs than the map has.
    #[error("the plan reads CPUs' values the map does not have")]
    OtherCpus,
    /// This host's possible CPUs are not numbered from 0 without gaps.
    #[error("this host's possible CPUs are not numbered from 0 without gaps")]
    CpuNumbers,
    /// It reads more members of a per-CPU map's values than a program
    /// keeps while it visits an entry.
    #[error("a scan in the kernel reads at most {0} members of a per-CPU map's values")]
    TooManyMembers(usize),
    /// A member past the end of the key.
    #[error("a member beyond the key")]
    BeyondKey,
    /// A member past the end of the value.
    #[error("a member beyond the value")]
    BeyondValue,
    /// The group key makes the scratch value too large.
    #[error("the group key is too long")]
    KeyTooLong,
}

/// Offsets in the scratch value the program and user space share.
pub(crate) const VISITED: i16 = 0;
/// Groups a dense table holds.
pub(crate) const GROUPS: i16 = 8;
pub(crate) const ERROR: i16 = 16;
pub(super) const ZERO: i16 = 24;

impl WalkPlan {
    /// Counts the entries, nothing else.
    pub fn count() -> Self {
        Self {
            output: Output::Groups,
            filter: Cond::Const(true),
            group: Vec::new(),
            key_len: 0,
            aggs: Vec::new(),
            max_groups: 1,
        }
    }

    /// The entries `filter` takes, at most `max` of them.
    pub fn entries(filter: Cond, max: u32) -> Self {
        Self {
            output: Output::Entries,
            filter,
            group: Vec::new(),
            key_len: 0,
            aggs: Vec::new(),
            max_groups: max,
        }
    }

    /// Whether it only counts entries.
    pub fn counts_only(&self) -> bool {
        self.output == Output::Groups && self.aggs.is_empty() && self.filter == Cond::Const(true)
    }

    /// Where its program keeps its groups: a dense array when the group
    /// key has at most 16 bits and the array is at most
    /// [`MAX_DENSE_BYTES`] and not much larger than `max_groups` groups
    /// (32 times, or 4,096 slots: the array is read back after each walk);
    /// a hash map otherwise.
    pub fn table(&self) -> GroupTable {
        if self.counts_only() {
            return GroupTable::None;
        }
        if self.output == Output::Entries {
            return GroupTable::Hash;
        }
        let bits: Option<u32> = self.group.iter().map(GroupPart::index_bits).sum();
        let Some(bits) = bits.filter(|b| *b <= 16) else {
            return GroupTable::Hash;
        };
        let slots = 1u32 << bits;
        let bytes = slots as usize * self.group_value_size();
        let most = (u64::from(self.max_groups) * 32).max(4096);
        if bytes <= MAX_DENSE_BYTES && u64::from(slots) <= most {
            GroupTable::Dense { slots }
        } else {
            GroupTable::Hash
        }
    }

    /// The group key of slot `index` of its dense table: each part's bits
    /// (the first part's highest) back to the member's value, written as
    /// the hash map's keys hold it.
    pub(super) fn dense_key(&self, index: u32) -> Vec<u8> {
        let mut key = vec![0u8; usize::from(self.key_len)];
        let mut shift = 0;
        for part in self.group.iter().rev() {
            let bits = part.index_bits().expect("a dense table's part");
            let v = (u64::from(index) >> shift) & ((1u64 << bits) - 1);
            shift += bits;
            match *part {
                GroupPart::Int { read, out, size } => {
                    let min = if read.signed { 1i64 << (bits - 1) } else { 0 };
                    let bytes = (v as i64 - min).to_le_bytes();
                    let out = usize::from(out);
                    key[out..out + usize::from(size)].copy_from_slice(&bytes[..usize::from(size)]);
                }
                // As the program loaded them: one byte, or two in the
                // host's order.
                GroupPart::Bytes { len: 1, out, .. } => key[usize::from(out)] = v as u8,
                GroupPart::Bytes { out, .. } => {
                    let out = usize::from(out);
                    key[out..out + 2].copy_from_slice(&(v as u16).to_ne_bytes());
                }
            }
        }
        key
    }

    /// Bytes of one group's value: the count, then two words per aggregate.
    pub(super) fn group_value_size(&self) -> usize {
        8 + 16 * self.aggs.len()
    }

    /// The key of the groups map: at least 4 bytes (a plan without groups
    /// keeps its one group under zeros).
    pub(super) fn group_key_size(&self) -> usize {
        usize::from(self.key_len).max(4)
    }

    /// The offset of the group key in the scratch value.
    pub(super) fn key_at(&self) -> usize {
        ZERO as usize + self.group_value_size()
    }

    /// The scratch value's size.
    pub(super) fn scratch_size(&self) -> usize {
        (self.key_at() + self.group_key_size()).next_multiple_of(8)
    }

    /// Every member it reads as an integer (but those of MIN and MAX of
    /// each CPU's value), and the bytes it copies: (side, end offset).
    fn reads(&self) -> (Vec<IntRead>, Vec<(Side, usize)>) {
        let mut ints = Vec::new();
        self.filter.reads(&mut ints);
        for a in &self.aggs {
            match a {
                AggOp::Count | AggOp::MinOfEach(_) | AggOp::MaxOfEach(_) => {}
                AggOp::Sum(r) | AggOp::Min(r) | AggOp::Max(r) => ints.push(*r),
            }
        }
        let mut bytes = Vec::new();
        for g in &self.group {
            match g {
                GroupPart::Bytes {
                    side, offset, len, ..
                } => bytes.push((*side, usize::from(*offset) + usize::from(*len))),
                GroupPart::Int { read, .. } => ints.push(*read),
            }
        }
        (ints, bytes)
    }

    /// Whether every member it reads is within a map of these sizes, whose
    /// values are per-CPU over `cpus` CPUs when `cpus` is given (then a
    /// value member is read summed over them, or one CPU's, and no bytes
    /// of the value are read); the reason when it is not.
    pub fn check(
        &self,
        key_size: usize,
        value_size: usize,
        cpus: Option<u16>,
    ) -> Result<(), PlanError> {
        if self.output == Output::Entries && cpus.is_some() {
            return Err(PlanError::PerCpuEntries);
        }
        let (ints, bytes) = self.reads();
        for (side, end) in bytes {
            match side {
                Side::Key if end > key_size => return Err(PlanError::BeyondKey),
                Side::Key => {}
                _ if cpus.is_some() => return Err(PlanError::PerCpuBytes),
                Side::Cpu(_) => return Err(PlanError::OtherCpus),
                Side::Value if end > value_size => return Err(PlanError::BeyondValue),
                Side::Value => {}
            }
        }
        for r in &ints {
            check_int(r, key_size, value_size, cpus)?;
        }
        for a in &self.aggs {
            if let AggOp::MinOfEach(r) | AggOp::MaxOfEach(r) = a {
                if cpus.is_none() || r.side != Side::Value || r.summed != 0 {
                    return Err(PlanError::OtherCpus);
                }
                if r.end() > value_size {
                    return Err(PlanError::BeyondValue);
                }
            }
        }
        if let Some(cpus) = cpus {
            super::cpus::Reductions::of(self, cpus)?;
        }
        if self.scratch_size() > 0x7000 {
            return Err(PlanError::KeyTooLong);
        }
        Ok(())
    }
}

/// Whether `r` is within a map of these sizes and CPUs.
fn check_int(
    r: &IntRead,
    key_size: usize,
    value_size: usize,
    cpus: Option<u16>,
) -> Result<(), PlanError> {
    let fits = match r.side {
        Side::Key => {
            return (r.end() <= key_size)
                .then_some(())
                .ok_or(PlanError::BeyondKey);
        }
        // Of a per-CPU map, a value member is a sum over every CPU.
        Side::Value => r.summed == cpus.unwrap_or(0),
        Side::Cpu(i) => cpus.is_some_and(|n| i < n) && r.summed == 0,
    };
    if !fits {
        return Err(PlanError::OtherCpus);
    }
    (r.end() <= value_size)
        .then_some(())
        .ok_or(PlanError::BeyondValue)
}
