//! The code of a walk program: `main` takes the walked map from its slot
//! and walks it with `bpf_for_each_map_elem`; the callback reads the
//! members the question needs ([`Reads`]), tests the condition, and adds
//! the entry to its group (in a dense array indexed by the group key, or
//! in a hash map: [`GroupTable`]) or copies it out. Figures go to the
//! scratch value user space reads after the run.

use aya_obj::generated::{BPF_NOEXIST, bpf_func_id};

use super::{
    asm::{Alu, Asm, AsmError, Jmp, Label, Pseudo, R0, R1, R2, R3, R4, R6, R7, R8, R9, Reg},
    cpus::{Reads, Reductions, add_to_wide},
    plan::{
        AggOp, CmpOp, Cond, ERROR, GROUPS, GroupPart, GroupTable, IntRead, Output, Side, VISITED,
        WalkPlan, ZERO,
    },
};

const MAP_LOOKUP_ELEM: i32 = bpf_func_id::BPF_FUNC_map_lookup_elem as i32;
const MAP_UPDATE_ELEM: i32 = bpf_func_id::BPF_FUNC_map_update_elem as i32;
const FOR_EACH_MAP_ELEM: i32 = bpf_func_id::BPF_FUNC_for_each_map_elem as i32;

/// The descriptors a program's instructions name its maps by.
#[derive(Debug, Clone, Copy)]
pub(super) struct MapFds {
    /// Its slot: an array of one map, which holds the map it walks while
    /// it runs (the program holds no reference to that map).
    pub(super) slot: i32,
    /// Its groups (a hash map, or the one-element array of a dense table)
    /// or the entries it takes; none when it only counts.
    pub(super) groups: Option<i32>,
    /// Its one-element array of figures.
    pub(super) scratch: i32,
}

/// A program being assembled: its plan, its maps, what it gathers from a
/// per-CPU map's values.
struct Program<'a> {
    plan: &'a WalkPlan,
    fds: MapFds,
    reads: Reads<'a>,
}

impl WalkPlan {
    /// The program: `main` walks the target map with its callback, which
    /// groups the entries it takes, keeping figures in the scratch value.
    /// `cpus`: the map's possible CPUs when its values are per-CPU.
    /// Returns the instructions and where the callback starts.
    pub(super) fn assemble(
        &self,
        fds: MapFds,
        cpus: Option<u16>,
    ) -> Result<(Vec<u64>, usize), AsmError> {
        let gathered = match cpus {
            Some(n) => Reductions::of(self, n).unwrap_or_default(),
            None => Reductions::default(),
        };
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
        let program = Program {
            plan: self,
            fds,
            reads: Reads {
                gathered: &gathered,
            },
        };
        match fds.groups {
            Some(_) if !self.counts_only() => program.callback(&mut a),
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
    ) -> Result<Vec<u64>, AsmError> {
        let mut a = Asm::default();
        slotted_map(&mut a, slot, scratch);
        a.alu_reg(Alu::Mov, R1, R0);
        a.call_kfunc(kfunc as i32);
        a.load_pseudo(R1, Pseudo::MapValue, scratch, 0);
        a.store(R1, VISITED, R0, 8);
        a.ret(0);
        a.finish()
    }
}

impl Program<'_> {
    /// The callback: (map, key, value, ctx) in r1-r4. The entry's group
    /// ends in r8, its count before this entry in r9.
    fn callback(&self, a: &mut Asm) {
        let filter = self.plan.filter.clone().simplified();
        if filter == Cond::Const(false) {
            a.ret(0);
            return;
        }
        let reject = a.label();
        a.alu_reg(Alu::Mov, R6, R2);
        a.alu_reg(Alu::Mov, R7, R3);
        // A condition on what is where the entry is goes first: the CPUs'
        // values are gathered only for the entries it takes.
        let mut tested = Vec::new();
        filter.reads(&mut tested);
        let first = Reads::here(&tested);
        if first {
            branch(a, self.reads, &filter, reject, false);
        }
        if !self.reads.gathered.is_empty() {
            self.reads.gathered.emit(a, reject);
        }
        if !first {
            branch(a, self.reads, &filter, reject, false);
        }
        let groups = self
            .fds
            .groups
            .expect("a program that groups has a groups map");
        match (self.plan.output, self.plan.table()) {
            (Output::Entries, _) => copy_entry(a, groups, self.fds.scratch),
            (_, GroupTable::Dense { slots }) => {
                self.dense_group(a, groups, slots);
                self.aggregates(a);
            }
            _ => {
                self.hash_group(a, groups);
                self.aggregates(a);
            }
        }
        a.bind(reject);
        a.ret(0);
    }

    /// Adds the entry to its group (r8, its count before in r9).
    fn aggregates(&self, a: &mut Asm) {
        for (i, op) in self.plan.aggs.iter().enumerate() {
            aggregate(a, self.reads, op, 8 + 16 * i as i16);
        }
        a.alu_imm(Alu::Add, R9, 1);
        a.store(R8, 0, R9, 8);
    }

    /// The entry's group in a hash map: found, or inserted; a full map
    /// (E2BIG) or a failed insert stops the walk.
    fn hash_group(&self, a: &mut Asm, groups: i32) {
        let scratch = self.fds.scratch;
        a.load_pseudo(R9, Pseudo::MapValue, scratch, 0);
        let key = self.plan.key_at() as i16;
        for part in &self.plan.group {
            copy_part(a, self.reads, part, key);
        }
        let (found, again) = (a.label(), a.label());
        let lookup = |a: &mut Asm| {
            a.load_pseudo(R1, Pseudo::MapFd, groups, 0);
            a.load_pseudo(R2, Pseudo::MapValue, scratch, i32::from(key));
            a.call(MAP_LOOKUP_ELEM);
        };
        lookup(a);
        a.jump_imm(Jmp::Ne, R0, 0, found);
        a.load_pseudo(R1, Pseudo::MapFd, groups, 0);
        a.load_pseudo(R2, Pseudo::MapValue, scratch, i32::from(key));
        a.load_pseudo(R3, Pseudo::MapValue, scratch, i32::from(ZERO));
        a.alu_imm(Alu::Mov, R4, BPF_NOEXIST as i32);
        a.call(MAP_UPDATE_ELEM);
        a.jump_imm(Jmp::Eq, R0, 0, again);
        // The groups are full (E2BIG) or the insert failed: stop.
        stop(a, scratch, R0);
        a.bind(again);
        lookup(a);
        a.jump_imm(Jmp::Ne, R0, 0, found);
        a.alu_imm(Alu::Mov, R1, -libc::ENOENT);
        stop(a, scratch, R1);
        a.bind(found);
        a.alu_reg(Alu::Mov, R8, R0);
        a.load(R9, R8, 0, 8);
    }

    /// The entry's group in a dense table of `slots` groups (the value of
    /// the one-element array `table`): its index made of the group key's
    /// bits, no lookup. A group seen for the first time is counted; one
    /// more than `max_groups` stops the walk (E2BIG).
    fn dense_group(&self, a: &mut Asm, table: i32, slots: u32) {
        let plan = self.plan;
        for (i, part) in plan.group.iter().enumerate() {
            let dst = if i == 0 { R1 } else { R2 };
            let bits = index_part(a, self.reads, part, dst);
            if i > 0 {
                a.alu_imm(Alu::Lsh, R1, bits as i32);
                a.alu_reg(Alu::Or, R1, R2);
            }
        }
        if plan.group.is_empty() {
            a.alu_imm(Alu::Mov, R1, 0);
        }
        // The verifier sees the index within the table.
        a.alu_imm(Alu::And, R1, (slots - 1) as i32);
        a.alu_imm(Alu::Mul, R1, plan.group_value_size() as i32);
        a.load_pseudo(R8, Pseudo::MapValue, table, 0);
        a.alu_reg(Alu::Add, R8, R1);
        a.load(R9, R8, 0, 8);
        let (counted, room) = (a.label(), a.label());
        a.jump_imm(Jmp::Ne, R9, 0, counted);
        a.load_pseudo(R1, Pseudo::MapValue, self.fds.scratch, 0);
        a.load(R2, R1, GROUPS, 8);
        match i32::try_from(plan.max_groups) {
            Ok(max) => a.jump_imm(Jmp::Lt, R2, max, room),
            Err(_) => {
                a.load_imm64(R3, u64::from(plan.max_groups));
                a.jump_reg(Jmp::Lt, R2, R3, room);
            }
        }
        a.alu_imm(Alu::Mov, R3, -libc::E2BIG);
        stop(a, self.fds.scratch, R3);
        a.bind(room);
        a.alu_imm(Alu::Add, R2, 1);
        a.store(R1, GROUPS, R2, 8);
        a.bind(counted);
    }
}

/// Loads into `dst` the part of a dense table's index that `part` makes:
/// its value less its smallest, in [0, 2^bits). Returns its bits.
pub(super) fn index_part(a: &mut Asm, reads: Reads<'_>, part: &GroupPart, dst: Reg) -> u32 {
    match *part {
        GroupPart::Int { read, .. } => {
            reads.int(a, &read, dst);
            if read.signed {
                a.alu_imm(Alu::Add, dst, 1 << (read.bits - 1));
            }
            u32::from(read.bits)
        }
        GroupPart::Bytes {
            side, offset, len, ..
        } => {
            let base = if side == Side::Key { R6 } else { R7 };
            a.load(dst, base, offset as i16, u32::from(len));
            u32::from(len) * 8
        }
    }
}

/// Stores `errno` (a register holding a negative errno) in the scratch
/// value's error word and ends the walk.
fn stop(a: &mut Asm, scratch: i32, errno: Reg) {
    let at = if errno == R1 { R2 } else { R1 };
    a.load_pseudo(at, Pseudo::MapValue, scratch, 0);
    a.store(at, ERROR, errno, 8);
    a.ret(1);
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
    a.alu_imm(Alu::Mov, R2, -libc::ENOENT);
    stop(a, scratch, R2);
    a.bind(found);
}

/// Copies the entry (key in r6, value in r7) into `out`, a map of the
/// target's key and value sizes; a full map (E2BIG) or a failed insert
/// stops the walk.
fn copy_entry(a: &mut Asm, out: i32, scratch: i32) {
    let copied = a.label();
    a.load_pseudo(R1, Pseudo::MapFd, out, 0);
    a.alu_reg(Alu::Mov, R2, R6);
    a.alu_reg(Alu::Mov, R3, R7);
    // BPF_ANY: an entry the walk meets twice is kept once.
    a.alu_imm(Alu::Mov, R4, 0);
    a.call(MAP_UPDATE_ELEM);
    a.jump_imm(Jmp::Eq, R0, 0, copied);
    stop(a, scratch, R0);
    a.bind(copied);
}

/// Code that jumps to `target` when `c` (simplified) is `when`, and goes
/// on otherwise.
fn branch(a: &mut Asm, reads: Reads<'_>, c: &Cond, target: Label, when: bool) {
    match c {
        Cond::Const(b) => {
            if *b == when {
                a.ja(target);
            }
        }
        Cond::Not(c) => branch(a, reads, c, target, !when),
        Cond::All(cs) | Cond::Any(cs) if cs.is_empty() => branch(
            a,
            reads,
            &Cond::Const(matches!(c, Cond::All(_))),
            target,
            when,
        ),
        // All jumps when one is false; Any when one is true.
        Cond::All(cs) | Cond::Any(cs) if matches!(c, Cond::Any(_)) == when => {
            for c in cs {
                branch(a, reads, c, target, when);
            }
        }
        Cond::All(cs) | Cond::Any(cs) => {
            let skip = a.label();
            let (last, rest) = cs.split_last().expect("not empty");
            for c in rest {
                branch(a, reads, c, skip, !when);
            }
            branch(a, reads, last, target, when);
            a.bind(skip);
        }
        // In the member's range (`Cond::simplified` folded the others).
        Cond::Cmp(r, op, k) if r.wide() => {
            reads.wide(a, r, R1, R2);
            compare_wide(a, *op, *k, target, when);
        }
        Cond::Cmp(r, op, k) => {
            reads.int(a, r, R1);
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

/// Jumps to `target` when the 128-bit value in r1 (low) and r2 (high)
/// compared with `k` is `when` (signed: sums of the CPUs' values).
fn compare_wide(a: &mut Asm, op: CmpOp, k: i128, target: Label, when: bool) {
    let next = a.label();
    let (yes, no) = if when { (target, next) } else { (next, target) };
    a.load_imm64(R3, (k >> 64) as u64);
    a.load_imm64(R4, k as u64);
    match op {
        CmpOp::Eq | CmpOp::Ne => {
            let (equal, differ) = if op == CmpOp::Eq {
                (yes, no)
            } else {
                (no, yes)
            };
            a.jump_reg(Jmp::Ne, R2, R3, differ);
            a.jump_reg(Jmp::Ne, R1, R4, differ);
            a.ja(equal);
        }
        _ => {
            // Decided by the high words when they differ, else by the low.
            let (high, low) = match op {
                CmpOp::Lt => (Jmp::Slt, Jmp::Lt),
                CmpOp::Le => (Jmp::Slt, Jmp::Le),
                CmpOp::Gt => (Jmp::Sgt, Jmp::Gt),
                _ => (Jmp::Sgt, Jmp::Ge),
            };
            a.jump_reg(high, R2, R3, yes);
            a.jump_reg(Jmp::Ne, R2, R3, no);
            a.jump_reg(low, R1, R4, yes);
            a.ja(no);
        }
    }
    a.bind(next);
}

/// Copies one group member into the key at `key` in r9's scratch.
fn copy_part(a: &mut Asm, reads: Reads<'_>, part: &GroupPart, key: i16) {
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
        GroupPart::Int { read, out, size } if size > 8 => {
            reads.wide(a, &read, R1, R2);
            a.store(R9, key + out as i16, R1, 8);
            a.store(R9, key + out as i16 + 8, R2, 8);
        }
        GroupPart::Int { read, out, size } => {
            reads.int(a, &read, R1);
            a.store(R9, key + out as i16, R1, u32::from(size));
        }
    }
}

/// Adds the entry's member to aggregate slot `at` of the group value in r8
/// (r9: the group's count before the entry).
fn aggregate(a: &mut Asm, reads: Reads<'_>, op: &AggOp, at: i16) {
    match op {
        AggOp::Count => {}
        AggOp::Sum(r) if r.summed > 0 => {
            reads.wide(a, r, R1, R2);
            add_wide(a, at);
        }
        AggOp::Sum(r) => {
            reads.int(a, r, R1);
            add_to_wide(a, R8, at, R1, r.signed);
        }
        AggOp::Min(r) | AggOp::Max(r) if r.wide() => {
            reads.wide(a, r, R1, R2);
            keep_wide(a, matches!(op, AggOp::Max(_)), at);
        }
        AggOp::Min(r) | AggOp::Max(r) => {
            reads.int(a, r, R1);
            keep(a, matches!(op, AggOp::Max(_)), r, at);
        }
        AggOp::MinOfEach(r) | AggOp::MaxOfEach(r) => {
            let max = matches!(op, AggOp::MaxOfEach(_));
            reads.each(a, r, max, R1);
            keep(a, max, r, at);
        }
    }
}

/// Adds the 128 bits in r1 (low) and r2 (high) to those at `at` in r8.
fn add_wide(a: &mut Asm, at: i16) {
    let no_carry = a.label();
    a.load(R3, R8, at, 8);
    a.alu_reg(Alu::Add, R3, R1);
    a.store(R8, at, R3, 8);
    a.load(R4, R8, at + 8, 8);
    a.alu_reg(Alu::Add, R4, R2);
    a.jump_reg(Jmp::Ge, R3, R1, no_carry);
    a.alu_imm(Alu::Add, R4, 1);
    a.bind(no_carry);
    a.store(R8, at + 8, R4, 8);
}

/// Keeps at `at` in r8 the smaller (`max`: larger) of what it holds and r1
/// (the first entry of a group, r9 = 0, sets it).
fn keep(a: &mut Asm, max: bool, r: &IntRead, at: i16) {
    let (set, skip) = (a.label(), a.label());
    a.jump_imm(Jmp::Eq, R9, 0, set);
    a.load(R2, R8, at, 8);
    let better = match (max, r.signed) {
        (false, false) => Jmp::Lt,
        (false, true) => Jmp::Slt,
        (true, false) => Jmp::Gt,
        (true, true) => Jmp::Sgt,
    };
    a.jump_reg(better, R1, R2, set);
    a.ja(skip);
    a.bind(set);
    a.store(R8, at, R1, 8);
    a.bind(skip);
}

/// [`keep`] of 128 bits (signed), r1 low and r2 high.
fn keep_wide(a: &mut Asm, max: bool, at: i16) {
    let (set, skip) = (a.label(), a.label());
    a.jump_imm(Jmp::Eq, R9, 0, set);
    a.load(R3, R8, at + 8, 8);
    a.load(R4, R8, at, 8);
    let (high, low) = if max {
        (Jmp::Sgt, Jmp::Gt)
    } else {
        (Jmp::Slt, Jmp::Lt)
    };
    a.jump_reg(high, R2, R3, set);
    a.jump_reg(Jmp::Ne, R2, R3, skip);
    a.jump_reg(low, R1, R4, set);
    a.ja(skip);
    a.bind(set);
    a.store(R8, at, R1, 8);
    a.store(R8, at + 8, R2, 8);
    a.bind(skip);
}
