//! Members as a walk program reads them: of the key and of the value where
//! it visits an entry; of a per-CPU map's value, from every CPU's. The
//! callback of `bpf_for_each_map_elem` sees only the current CPU's value of
//! a per-CPU map, so before it tests or groups an entry the program
//! gathers what the question reads of the others
//! (`bpf_map_lookup_percpu_elem`, Linux 5.19, once per possible CPU, a
//! number known when the program is built) into its stack: sums over the
//! CPUs in 128 bits, the smallest and largest of the CPUs' values, one
//! CPU's value. The rest of the program reads them there.

use std::sync::OnceLock;

use aya_obj::generated::bpf_func_id;

use super::{
    asm::{Alu, Asm, Jmp, Label, R0, R1, R2, R3, R6, R7, R8, R9, R10, Reg},
    plan::{AggOp, GroupPart, IntRead, PlanError, Side, WalkPlan},
};

const MAP_LOOKUP_PERCPU_ELEM: i32 = bpf_func_id::BPF_FUNC_map_lookup_percpu_elem as i32;
const GET_SMP_PROCESSOR_ID: i32 = bpf_func_id::BPF_FUNC_get_smp_processor_id as i32;

/// Most members a program gathers from the CPUs' values (each takes 8 or 16
/// bytes of its 512 bytes of stack).
pub(super) const MAX_GATHERED: usize = 24;

/// Where the callback keeps the map it walks (its first argument), in the
/// stack.
const MAP_AT: i16 = -8;

/// Whether this host's possible CPUs are numbered from 0 without gaps
/// (`/sys/devices/system/cpu/possible` is one range from 0, as on every
/// host seen): a program reads CPU i's value by its number, and a batched
/// read gives the possible CPUs' values in order.
pub(super) fn numbered_from_zero() -> bool {
    static ONE_RANGE: OnceLock<bool> = OnceLock::new();
    *ONE_RANGE.get_or_init(|| {
        std::fs::read_to_string("/sys/devices/system/cpu/possible").is_ok_and(|s| {
            let s = s.trim();
            s == "0"
                || s.strip_prefix("0-")
                    .is_some_and(|n| n.parse::<u32>().is_ok())
        })
    })
}

/// How the values of a member on the CPUs are gathered.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Gather {
    /// Their sum (two words: low, high).
    Sum,
    /// The smallest.
    Min,
    /// The largest.
    Max,
    /// That of one CPU.
    One(u16),
}

/// One member gathered: how, the member as one CPU's value holds it, and
/// where in the stack.
#[derive(Debug, Clone, Copy)]
struct Gathered {
    how: Gather,
    read: IntRead,
    at: i16,
}

/// What a program gathers from every CPU's value of an entry of a per-CPU
/// map.
#[derive(Debug, Clone, Default)]
pub(super) struct Reductions {
    cpus: u16,
    slots: Vec<Gathered>,
}

impl Reductions {
    /// What `plan` gathers from `cpus` CPUs' values; too many members to
    /// keep in the stack is an error.
    pub(super) fn of(plan: &WalkPlan, cpus: u16) -> Result<Self, PlanError> {
        let mut wanted = Vec::new();
        let mut reads = Vec::new();
        plan.filter.reads(&mut reads);
        for g in &plan.group {
            if let GroupPart::Int { read, .. } = g {
                reads.push(*read);
            }
        }
        for a in &plan.aggs {
            match a {
                AggOp::Count => {}
                AggOp::Sum(r) | AggOp::Min(r) | AggOp::Max(r) => reads.push(*r),
                AggOp::MinOfEach(r) => wanted.push((Gather::Min, r.one())),
                AggOp::MaxOfEach(r) => wanted.push((Gather::Max, r.one())),
            }
        }
        for r in reads {
            match r.side {
                Side::Key => {}
                Side::Value => wanted.push((Gather::Sum, r.one())),
                Side::Cpu(i) => wanted.push((Gather::One(i), r)),
            }
        }
        if cpus == 0 && !wanted.is_empty() {
            return Err(PlanError::OtherCpus);
        }
        let mut out = Self {
            cpus,
            slots: Vec::new(),
        };
        let mut at = MAP_AT;
        for (how, read) in wanted {
            if out.find(how, &read).is_some() {
                continue;
            }
            at -= if how == Gather::Sum { 16 } else { 8 };
            out.slots.push(Gathered { how, read, at });
        }
        if out.slots.len() > MAX_GATHERED {
            return Err(PlanError::TooManyMembers(MAX_GATHERED));
        }
        Ok(out)
    }

    fn find(&self, how: Gather, read: &IntRead) -> Option<i16> {
        self.slots
            .iter()
            .find(|g| g.how == how && g.read == *read)
            .map(|g| g.at)
    }

    /// Whether it gathers nothing.
    pub(super) fn is_empty(&self) -> bool {
        self.slots.is_empty()
    }

    /// The code that gathers them, at the start of the callback (the map
    /// in r1, the key in r6, the value of the CPU it runs on in r7: the
    /// walk of a per-CPU map keeps to one CPU): the other CPUs' values are
    /// looked up; an entry deleted meanwhile (a CPU's value not found) is
    /// skipped, going to `skip`. Uses r8 and r9.
    pub(super) fn emit(&self, a: &mut Asm, skip: Label) {
        a.store(R10, MAP_AT, R1, 8);
        a.call(GET_SMP_PROCESSOR_ID);
        a.alu_reg(Alu::Mov, R9, R0);
        for cpu in 0..self.cpus {
            let (other, done) = (a.label(), a.label());
            a.jump_imm(Jmp::Ne, R9, i32::from(cpu), other);
            for g in &self.slots {
                gather(a, g, cpu, R7);
            }
            a.ja(done);
            a.bind(other);
            a.load(R1, R10, MAP_AT, 8);
            a.alu_reg(Alu::Mov, R2, R6);
            a.alu_imm(Alu::Mov, R3, i32::from(cpu));
            a.call(MAP_LOOKUP_PERCPU_ELEM);
            a.jump_imm(Jmp::Eq, R0, 0, skip);
            a.alu_reg(Alu::Mov, R8, R0);
            for g in &self.slots {
                gather(a, g, cpu, R8);
            }
            a.bind(done);
        }
    }
}

/// Adds CPU `cpu`'s value (`value` points to it) to `g`.
fn gather(a: &mut Asm, g: &Gathered, cpu: u16, value: Reg) {
    if matches!(g.how, Gather::One(i) if i != cpu) {
        return;
    }
    g.read.emit_from(a, value, R1);
    match g.how {
        Gather::One(_) => a.store(R10, g.at, R1, 8),
        Gather::Sum if cpu == 0 => {
            a.store(R10, g.at, R1, 8);
            high_word(a, R2, R1, g.read.signed);
            a.store(R10, g.at + 8, R2, 8);
        }
        Gather::Sum => add_to_wide(a, R10, g.at, R1, g.read.signed),
        Gather::Min | Gather::Max if cpu == 0 => a.store(R10, g.at, R1, 8),
        Gather::Min | Gather::Max => {
            let keep = a.label();
            a.load(R2, R10, g.at, 8);
            let better = match (g.how, g.read.signed) {
                (Gather::Min, false) => Jmp::Ge,
                (Gather::Min, true) => Jmp::Sge,
                (_, false) => Jmp::Le,
                (_, true) => Jmp::Sle,
            };
            // Not better: keep the one stored.
            a.jump_reg(better, R1, R2, keep);
            a.store(R10, g.at, R1, 8);
            a.bind(keep);
        }
    }
}

/// `high` = the high word of `low` extended to 128 bits.
pub(super) fn high_word(a: &mut Asm, high: Reg, low: Reg, signed: bool) {
    if signed {
        a.alu_reg(Alu::Mov, high, low);
        a.alu_imm(Alu::Arsh, high, 63);
    } else {
        a.alu_imm(Alu::Mov, high, 0);
    }
}

/// Adds `v` (64 bits, `signed` or not) to the 128 bits at `base + at`
/// (low word first). Uses r2 and r3.
pub(super) fn add_to_wide(a: &mut Asm, base: Reg, at: i16, v: Reg, signed: bool) {
    let (done, negative) = (a.label(), a.label());
    a.load(R2, base, at, 8);
    a.alu_reg(Alu::Add, R2, v);
    a.store(base, at, R2, 8);
    if signed {
        a.jump_imm(Jmp::Slt, v, 0, negative);
    }
    // No carry: the high word stays.
    a.jump_reg(Jmp::Ge, R2, v, done);
    a.load(R3, base, at + 8, 8);
    a.alu_imm(Alu::Add, R3, 1);
    a.store(base, at + 8, R3, 8);
    if signed {
        a.ja(done);
        a.bind(negative);
        // A carry and the sign's -1 cancel.
        a.jump_reg(Jmp::Lt, R2, v, done);
        a.load(R3, base, at + 8, 8);
        a.alu_imm(Alu::Sub, R3, 1);
        a.store(base, at + 8, R3, 8);
    }
    a.bind(done);
}

/// How the callback reads members: the key and the value where the entry
/// is (r6, r7), what it gathered from the CPUs' values in its stack.
#[derive(Debug, Clone, Copy)]
pub(super) struct Reads<'a> {
    pub(super) gathered: &'a Reductions,
}

impl Reads<'_> {
    /// Loads `r` into `dst`: a sum's low word (all of it when it is not
    /// [`wide`](IntRead::wide)).
    pub(super) fn int(&self, a: &mut Asm, r: &IntRead, dst: Reg) {
        match self.slot(r) {
            Some(at) => a.load(dst, R10, at, 8),
            None if r.side == Side::Key => r.emit_from(a, R6, dst),
            None => r.emit_from(a, R7, dst),
        }
    }

    /// Loads `r` as 128 bits into `low` and `high`.
    pub(super) fn wide(&self, a: &mut Asm, r: &IntRead, low: Reg, high: Reg) {
        match self.slot(r) {
            Some(at) if r.summed > 0 => {
                a.load(low, R10, at, 8);
                a.load(high, R10, at + 8, 8);
            }
            _ => {
                self.int(a, r, low);
                high_word(a, high, low, r.signed);
            }
        }
    }

    /// Loads the smallest (`max`: largest) of the CPUs' values of `r`.
    pub(super) fn each(&self, a: &mut Asm, r: &IntRead, max: bool, dst: Reg) {
        let how = if max { Gather::Max } else { Gather::Min };
        let at = self.gathered.find(how, &r.one()).expect("gathered");
        a.load(dst, R10, at, 8);
    }

    /// Where `r` was gathered; `None` for a member read where the entry is.
    fn slot(&self, r: &IntRead) -> Option<i16> {
        match r.side {
            Side::Key => None,
            Side::Value if r.summed == 0 => None,
            Side::Value => Some(self.gathered.find(Gather::Sum, &r.one()).expect("gathered")),
            Side::Cpu(i) => Some(self.gathered.find(Gather::One(i), r).expect("gathered")),
        }
    }

    /// Whether `reads` need nothing gathered (key members, or members of a
    /// map that is not per-CPU).
    pub(super) fn here(reads: &[IntRead]) -> bool {
        reads
            .iter()
            .all(|r| r.side == Side::Key || (r.side == Side::Value && r.summed == 0))
    }
}
