//! What a walk inside the kernel computes, in terms of bytes and bits of a
//! map's keys and values, and the code that computes it.

use aya_obj::generated::{BPF_NOEXIST, bpf_func_id};

use super::asm::{Alu, Asm, Jmp, Label, Pseudo, R0, R1, R2, R3, R4, R6, R7, R8, R9, Reg};

/// Which half of an entry a member is in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Side {
    Key,
    Value,
}

/// An integer member as a walk program reads it: one load of 1, 2, 4 or 8 bytes,
/// swapped from network order, shifted and cut to its bits, sign-extended
/// to 64 bits.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct IntRead {
    side: Side,
    offset: u16,
    size: u8,
    shift: u8,
    bits: u8,
    signed: bool,
    big_endian: bool,
}

/// An integer member of an entry: where it lies and how it is encoded.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct IntSpec {
    /// The half of the entry it is in.
    pub side: Side,
    /// Its first bit in that half.
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
        })
    }

    /// The smallest and largest value the member holds.
    fn range(&self) -> (i128, i128) {
        let b = u32::from(self.bits);
        if self.signed {
            (-(1i128 << (b - 1)), (1i128 << (b - 1)) - 1)
        } else {
            (0, (1i128 << b) - 1)
        }
    }

    /// Loads it into `dst` (the key is in r6, the value in r7).
    fn emit(&self, a: &mut Asm, dst: Reg) {
        let base = if self.side == Side::Key { R6 } else { R7 };
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
    fn test(self, a: i128, b: i128) -> bool {
        match self {
            Self::Eq => a == b,
            Self::Ne => a != b,
            Self::Lt => a < b,
            Self::Le => a <= b,
            Self::Gt => a > b,
            Self::Ge => a >= b,
        }
    }

    fn jump(self, signed: bool) -> Jmp {
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
}

impl AggOp {
    /// Its value in a group, from the two words the program keeps: a SUM's
    /// 128 bits (low, high), a MIN's or MAX's 64.
    pub fn value(&self, count: u64, words: (u64, u64)) -> i128 {
        let (low, high) = words;
        match self {
            Self::Count => i128::from(count),
            Self::Sum(_) => ((u128::from(high) << 64) | u128::from(low)) as i128,
            Self::Min(r) | Self::Max(r) if r.signed => i128::from(low as i64),
            Self::Min(_) | Self::Max(_) => i128::from(low),
        }
    }

    fn read(&self) -> Option<&IntRead> {
        match self {
            Self::Count => None,
            Self::Sum(r) | Self::Min(r) | Self::Max(r) => Some(r),
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
    /// An integer, written little-endian in `size` bytes (1, 2, 4, 8) at
    /// `out`.
    Int { read: IntRead, out: u16, size: u8 },
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

/// Why a plan cannot run on a map.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum PlanError {
    /// It reads a per-CPU map's value, or takes its entries.
    #[error("a scan in the kernel sees one CPU's value of a per-CPU map")]
    PerCpuValue,
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
pub(crate) const MATCHED: i16 = 8;
pub(crate) const ERROR: i16 = 16;
pub(super) const ZERO: i16 = 24;

const MAP_LOOKUP_ELEM: i32 = bpf_func_id::BPF_FUNC_map_lookup_elem as i32;
const MAP_UPDATE_ELEM: i32 = bpf_func_id::BPF_FUNC_map_update_elem as i32;
const FOR_EACH_MAP_ELEM: i32 = bpf_func_id::BPF_FUNC_for_each_map_elem as i32;

/// The descriptors a program's instructions name its maps by.
#[derive(Debug, Clone, Copy)]
pub(super) struct MapFds {
    /// Its slot: an array of one map, which holds the map it walks while
    /// it runs (the program holds no reference to that map).
    pub(super) slot: i32,
    /// Its groups (or the entries it takes); none when it only counts.
    pub(super) groups: Option<i32>,
    /// Its one-element array of figures.
    pub(super) scratch: i32,
}

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

    /// Whether every member it reads is within a map of these sizes whose
    /// values are per-CPU (`per_cpu`: then no value member can be read: a
    /// walk program sees one CPU's value); the reason when it is not.
    pub fn check(
        &self,
        key_size: usize,
        value_size: usize,
        per_cpu: bool,
    ) -> Result<(), PlanError> {
        let mut reads: Vec<(Side, usize)> = Vec::new();
        cond_reads(&self.filter, &mut reads);
        for a in &self.aggs {
            if let Some(r) = a.read() {
                reads.push((r.side, usize::from(r.offset) + usize::from(r.size)));
            }
        }
        for g in &self.group {
            match g {
                GroupPart::Bytes {
                    side, offset, len, ..
                } => reads.push((*side, usize::from(*offset) + usize::from(*len))),
                GroupPart::Int { read, .. } => {
                    reads.push((read.side, usize::from(read.offset) + usize::from(read.size)))
                }
            }
        }
        if self.output == Output::Entries && per_cpu {
            return Err(PlanError::PerCpuValue);
        }
        for (side, end) in reads {
            match side {
                Side::Value if per_cpu => return Err(PlanError::PerCpuValue),
                Side::Key if end > key_size => return Err(PlanError::BeyondKey),
                Side::Value if end > value_size => return Err(PlanError::BeyondValue),
                _ => {}
            }
        }
        if self.scratch_size() > 0x7000 {
            return Err(PlanError::KeyTooLong);
        }
        Ok(())
    }

    /// The program: `main` walks the target map with its callback, which
    /// groups the entries it takes in the groups map, keeping figures in
    /// the scratch value. Returns the instructions and where the callback
    /// starts.
    pub(super) fn assemble(&self, fds: MapFds) -> Result<(Vec<u64>, usize), super::asm::AsmError> {
        let mut a = Asm::default();
        let callback = a.label();
        slotted_map(&mut a, fds.slot, fds.scratch);
        a.alu_reg(Alu::Mov, R1, R0);
        a.load_func(R2, callback);
        a.alu_imm(Alu::Mov, R3, 0);
        a.alu_imm(Alu::Mov, R4, 0);
        a.call(FOR_EACH_MAP_ELEM);
        a.load_pseudo(R1, Pseudo::MapValue, fds.scratch, 0);
        a.store(R1, VISITED, R0, 8);
        a.ret(0);
        let callback_at = a.here();
        a.bind(callback);
        match fds.groups {
            Some(groups) if !self.counts_only() => self.callback(&mut a, groups, fds.scratch),
            _ => a.ret(0),
        }
        Ok((a.finish()?, callback_at))
    }

    /// The program that counts a hash map's entries without walking it: it
    /// sums the kernel's per-CPU counters of the map's elements (the kernel
    /// function `bpf_map_sum_elem_count`, of BTF id `kfunc`, Linux 6.6)
    /// into the scratch value's VISITED.
    pub(super) fn assemble_count(
        slot: i32,
        scratch: i32,
        kfunc: u32,
    ) -> Result<Vec<u64>, super::asm::AsmError> {
        let mut a = Asm::default();
        slotted_map(&mut a, slot, scratch);
        a.alu_reg(Alu::Mov, R1, R0);
        a.call_kfunc(kfunc as i32);
        a.load_pseudo(R1, Pseudo::MapValue, scratch, 0);
        a.store(R1, VISITED, R0, 8);
        a.ret(0);
        a.finish()
    }

    /// The callback: (map, key, value, ctx) in r1-r4.
    fn callback(&self, a: &mut Asm, groups: i32, scratch: i32) {
        let filter = self.filter.clone().simplified();
        if filter == Cond::Const(false) {
            a.ret(0);
            return;
        }
        let reject = a.label();
        a.alu_reg(Alu::Mov, R6, R2);
        a.alu_reg(Alu::Mov, R7, R3);
        branch(a, &filter, reject, false);
        a.load_pseudo(R9, Pseudo::MapValue, scratch, 0);
        // Without a condition every entry visited is taken.
        if filter != Cond::Const(true) {
            a.load(R1, R9, MATCHED, 8);
            a.alu_imm(Alu::Add, R1, 1);
            a.store(R9, MATCHED, R1, 8);
        }
        if self.output == Output::Entries {
            copy_entry(a, groups);
            a.bind(reject);
            a.ret(0);
            return;
        }
        let key = self.key_at() as i16;
        for part in &self.group {
            copy_part(a, part, key);
        }
        let (found, again) = (a.label(), a.label());
        let lookup = |a: &mut Asm| {
            a.load_pseudo(R1, Pseudo::MapFd, groups, 0);
            a.alu_reg(Alu::Mov, R2, R9);
            a.alu_imm(Alu::Add, R2, i32::from(key));
            a.call(MAP_LOOKUP_ELEM);
        };
        lookup(a);
        a.jump_imm(Jmp::Ne, R0, 0, found);
        a.load_pseudo(R1, Pseudo::MapFd, groups, 0);
        a.alu_reg(Alu::Mov, R2, R9);
        a.alu_imm(Alu::Add, R2, i32::from(key));
        a.alu_reg(Alu::Mov, R3, R9);
        a.alu_imm(Alu::Add, R3, i32::from(ZERO));
        a.alu_imm(Alu::Mov, R4, BPF_NOEXIST as i32);
        a.call(MAP_UPDATE_ELEM);
        a.jump_imm(Jmp::Eq, R0, 0, again);
        // The groups are full (E2BIG) or the insert failed: stop.
        a.store(R9, ERROR, R0, 8);
        a.ret(1);
        a.bind(again);
        lookup(a);
        a.jump_imm(Jmp::Ne, R0, 0, found);
        a.alu_imm(Alu::Mov, R1, -libc::ENOENT);
        a.store(R9, ERROR, R1, 8);
        a.ret(1);
        a.bind(found);
        a.alu_reg(Alu::Mov, R8, R0);
        // r9: the group's count before this entry.
        a.load(R9, R8, 0, 8);
        for (i, op) in self.aggs.iter().enumerate() {
            aggregate(a, op, 8 + 16 * i as i16);
        }
        a.alu_imm(Alu::Add, R9, 1);
        a.store(R8, 0, R9, 8);
        a.bind(reject);
        a.ret(0);
    }
}

/// The map in `slot` (an array of one map), in r0; an empty slot stops the
/// program with ENOENT in `scratch`'s error word. The key 0 is the
/// scratch value's zeroed words.
fn slotted_map(a: &mut Asm, slot: i32, scratch: i32) {
    let found = a.label();
    a.load_pseudo(R1, Pseudo::MapFd, slot, 0);
    a.load_pseudo(R2, Pseudo::MapValue, scratch, i32::from(ZERO));
    a.call(MAP_LOOKUP_ELEM);
    a.jump_imm(Jmp::Ne, R0, 0, found);
    a.load_pseudo(R1, Pseudo::MapValue, scratch, 0);
    a.alu_imm(Alu::Mov, R2, -libc::ENOENT);
    a.store(R1, ERROR, R2, 8);
    a.ret(1);
    a.bind(found);
}

/// Copies the entry (key in r6, value in r7) into `out`, a map of the
/// target's key and value sizes; a full map (E2BIG) or a failed insert
/// stops the walk, the error kept in r9's scratch.
fn copy_entry(a: &mut Asm, out: i32) {
    let copied = a.label();
    a.load_pseudo(R1, Pseudo::MapFd, out, 0);
    a.alu_reg(Alu::Mov, R2, R6);
    a.alu_reg(Alu::Mov, R3, R7);
    // BPF_ANY: an entry the walk meets twice is kept once.
    a.alu_imm(Alu::Mov, R4, 0);
    a.call(MAP_UPDATE_ELEM);
    a.jump_imm(Jmp::Eq, R0, 0, copied);
    a.store(R9, ERROR, R0, 8);
    a.ret(1);
    a.bind(copied);
}

/// The members a condition reads: (side, end offset).
fn cond_reads(c: &Cond, out: &mut Vec<(Side, usize)>) {
    match c {
        Cond::Const(_) => {}
        Cond::Cmp(r, _, _) => out.push((r.side, usize::from(r.offset) + usize::from(r.size))),
        Cond::Not(c) => cond_reads(c, out),
        Cond::All(cs) | Cond::Any(cs) => cs.iter().for_each(|c| cond_reads(c, out)),
    }
}

/// Code that jumps to `target` when `c` (simplified) is `when`, and goes
/// on otherwise.
fn branch(a: &mut Asm, c: &Cond, target: Label, when: bool) {
    match c {
        Cond::Const(b) => {
            if *b == when {
                a.ja(target);
            }
        }
        Cond::Not(c) => branch(a, c, target, !when),
        Cond::All(cs) | Cond::Any(cs) if cs.is_empty() => {
            branch(a, &Cond::Const(matches!(c, Cond::All(_))), target, when)
        }
        // All jumps when one is false; Any when one is true.
        Cond::All(cs) | Cond::Any(cs) if matches!(c, Cond::Any(_)) == when => {
            for c in cs {
                branch(a, c, target, when);
            }
        }
        Cond::All(cs) | Cond::Any(cs) => {
            let skip = a.label();
            let (last, rest) = cs.split_last().expect("not empty");
            for c in rest {
                branch(a, c, skip, !when);
            }
            branch(a, last, target, when);
            a.bind(skip);
        }
        // In the member's range (`Cond::simplified` folded the others).
        Cond::Cmp(r, op, k) => {
            r.emit(a, R1);
            let jump = if when {
                op.jump(r.signed)
            } else {
                op.jump(r.signed).negated()
            };
            match i32::try_from(*k) {
                Ok(k) if r.signed || k >= 0 => a.jump_imm(jump, R1, k, target),
                _ => {
                    a.load_imm64(R2, *k as u64);
                    a.jump_reg(jump, R1, R2, target);
                }
            }
        }
    }
}

/// Copies one group member into the key at `key` in r9's scratch.
fn copy_part(a: &mut Asm, part: &GroupPart, key: i16) {
    match *part {
        GroupPart::Bytes {
            side,
            offset,
            len,
            out,
        } => {
            let base = if side == Side::Key { R6 } else { R7 };
            let mut done = 0u16;
            while done < len {
                let left = u32::from(len - done);
                let size = [8u32, 4, 2, 1]
                    .into_iter()
                    .find(|s| *s <= left)
                    .unwrap_or(1);
                a.load(R1, base, (offset + done) as i16, size);
                a.store(R9, key + (out + done) as i16, R1, size);
                done += size as u16;
            }
        }
        GroupPart::Int { read, out, size } => {
            read.emit(a, R1);
            a.store(R9, key + out as i16, R1, u32::from(size));
        }
    }
}

/// Adds the member of r6/r7's entry to aggregate slot `at` of the group
/// value in r8 (r9: the group's count before the entry).
fn aggregate(a: &mut Asm, op: &AggOp, at: i16) {
    match op {
        AggOp::Count => {}
        AggOp::Sum(r) => {
            r.emit(a, R1);
            let (carry, sign) = (a.label(), a.label());
            a.load(R2, R8, at, 8);
            a.alu_reg(Alu::Add, R2, R1);
            a.store(R8, at, R2, 8);
            a.load(R3, R8, at + 8, 8);
            a.jump_reg(Jmp::Ge, R2, R1, carry);
            a.alu_imm(Alu::Add, R3, 1);
            a.bind(carry);
            if r.signed {
                a.jump_imm(Jmp::Sge, R1, 0, sign);
                a.alu_imm(Alu::Sub, R3, 1);
            }
            a.bind(sign);
            a.store(R8, at + 8, R3, 8);
        }
        AggOp::Min(r) | AggOp::Max(r) => {
            r.emit(a, R1);
            let (set, skip) = (a.label(), a.label());
            a.jump_imm(Jmp::Eq, R9, 0, set);
            a.load(R2, R8, at, 8);
            let better = match (op, r.signed) {
                (AggOp::Min(_), false) => Jmp::Lt,
                (AggOp::Min(_), true) => Jmp::Slt,
                (_, false) => Jmp::Gt,
                (_, true) => Jmp::Sgt,
            };
            a.jump_reg(better, R1, R2, set);
            a.ja(skip);
            a.bind(set);
            a.store(R8, at, R1, 8);
            a.bind(skip);
        }
    }
}
