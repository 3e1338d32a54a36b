//! BPF instructions, encoded as the kernel reads them (one little-endian
//! 64-bit word each: opcode, registers, offset, immediate), with labels
//! for forward jumps and for the address of a function, placed when the
//! code is finished. Opcodes are the kernel's (`aya_obj::generated`).

use aya_obj::generated::{
    BPF_ADD, BPF_ALU, BPF_ALU64, BPF_AND, BPF_ARSH, BPF_B, BPF_CALL, BPF_DW, BPF_END, BPF_EXIT,
    BPF_H, BPF_IMM, BPF_JA, BPF_JEQ, BPF_JGE, BPF_JGT, BPF_JLE, BPF_JLT, BPF_JMP, BPF_JNE,
    BPF_JSGE, BPF_JSGT, BPF_JSLE, BPF_JSLT, BPF_K, BPF_LD, BPF_LDX, BPF_LSH, BPF_MEM, BPF_MOV,
    BPF_MUL, BPF_OR, BPF_PSEUDO_FUNC, BPF_PSEUDO_KFUNC_CALL, BPF_PSEUDO_MAP_FD,
    BPF_PSEUDO_MAP_VALUE, BPF_RSH, BPF_STX, BPF_SUB, BPF_TO_BE, BPF_W, BPF_X,
};

/// A register (r0 to r10).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Reg(pub(super) u8);

pub(super) const R0: Reg = Reg(0);
pub(super) const R1: Reg = Reg(1);
pub(super) const R2: Reg = Reg(2);
pub(super) const R3: Reg = Reg(3);
pub(super) const R4: Reg = Reg(4);
pub(super) const R6: Reg = Reg(6);
pub(super) const R7: Reg = Reg(7);
pub(super) const R8: Reg = Reg(8);
pub(super) const R9: Reg = Reg(9);
/// The frame pointer (read only).
pub(super) const R10: Reg = Reg(10);

/// An opcode's bits, from the kernel's header (`u32` there).
const fn op(bits: u32) -> u8 {
    bits as u8
}

/// Arithmetic operations.
#[derive(Debug, Clone, Copy)]
pub(super) enum Alu {
    Add = op(BPF_ADD) as isize,
    Sub = op(BPF_SUB) as isize,
    Mul = op(BPF_MUL) as isize,
    Or = op(BPF_OR) as isize,
    And = op(BPF_AND) as isize,
    Lsh = op(BPF_LSH) as isize,
    Rsh = op(BPF_RSH) as isize,
    Mov = op(BPF_MOV) as isize,
    Arsh = op(BPF_ARSH) as isize,
}

/// Conditional jumps (the 64-bit comparisons).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Jmp {
    Eq = op(BPF_JEQ) as isize,
    Gt = op(BPF_JGT) as isize,
    Ge = op(BPF_JGE) as isize,
    Ne = op(BPF_JNE) as isize,
    Sgt = op(BPF_JSGT) as isize,
    Sge = op(BPF_JSGE) as isize,
    Lt = op(BPF_JLT) as isize,
    Le = op(BPF_JLE) as isize,
    Slt = op(BPF_JSLT) as isize,
    Sle = op(BPF_JSLE) as isize,
}

impl Jmp {
    /// The jump taken exactly when this one is not.
    pub(super) fn negated(self) -> Self {
        match self {
            Self::Eq => Self::Ne,
            Self::Ne => Self::Eq,
            Self::Gt => Self::Le,
            Self::Le => Self::Gt,
            Self::Ge => Self::Lt,
            Self::Lt => Self::Ge,
            Self::Sgt => Self::Sle,
            Self::Sle => Self::Sgt,
            Self::Sge => Self::Slt,
            Self::Slt => Self::Sge,
        }
    }
}

/// A memory access width: 1, 2, 4 or 8 bytes.
pub(super) fn size_code(bytes: u32) -> u8 {
    op(match bytes {
        1 => BPF_B,
        2 => BPF_H,
        4 => BPF_W,
        _ => BPF_DW,
    })
}

/// What an `ld_imm64` loads (its source register field).
#[derive(Debug, Clone, Copy)]
pub(super) enum Pseudo {
    /// A map, by descriptor.
    MapFd = op(BPF_PSEUDO_MAP_FD) as isize,
    /// A pointer into the value of a single-element array map.
    MapValue = op(BPF_PSEUDO_MAP_VALUE) as isize,
}

/// A place in the code, bound once.
#[derive(Debug, Clone, Copy)]
pub(super) struct Label(usize);

/// Instructions being assembled.
#[derive(Debug, Default)]
pub(super) struct Asm {
    insns: Vec<u64>,
    labels: Vec<Option<usize>>,
    /// Instructions to patch with a label's place.
    fixups: Vec<Fixup>,
}

/// An instruction that names a label, patched by [`Asm::finish`].
#[derive(Debug)]
struct Fixup {
    /// The instruction.
    at: usize,
    label: Label,
    /// Where the distance to the label goes.
    field: Field,
}

/// The field of an instruction that holds a distance in instructions.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Field {
    /// A jump's 16-bit offset.
    Offset,
    /// The 32-bit immediate of an `ld_imm64` of a function.
    Imm,
}

/// Why assembled code cannot be loaded.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AsmError {
    /// A jump farther than its 16-bit offset reaches.
    #[error("a jump spans more than 32,767 instructions")]
    TooFar,
    /// A label used and never bound.
    #[error("a jump to a label never placed")]
    Unbound,
}

fn encode(code: u32, dst: Reg, src: u8, off: i16, imm: i32) -> u64 {
    u64::from(op(code))
        | (u64::from(dst.0 | (src << 4)) << 8)
        | (u64::from(off as u16) << 16)
        | (u64::from(imm as u32) << 32)
}

impl Asm {
    fn push(&mut self, code: u32, dst: Reg, src: u8, off: i16, imm: i32) {
        self.insns.push(encode(code, dst, src, off, imm));
    }

    /// The index of the next instruction.
    pub(super) fn here(&self) -> usize {
        self.insns.len()
    }

    pub(super) fn label(&mut self) -> Label {
        self.labels.push(None);
        Label(self.labels.len() - 1)
    }

    pub(super) fn bind(&mut self, l: Label) {
        self.labels[l.0] = Some(self.insns.len());
    }

    /// `dst op= imm` (64-bit).
    pub(super) fn alu_imm(&mut self, op: Alu, dst: Reg, imm: i32) {
        self.push(BPF_ALU64 | op as u32 | BPF_K, dst, 0, 0, imm);
    }

    /// `dst op= src` (64-bit).
    pub(super) fn alu_reg(&mut self, op: Alu, dst: Reg, src: Reg) {
        self.push(BPF_ALU64 | op as u32 | BPF_X, dst, src.0, 0, 0);
    }

    /// Swaps the low `bits` (16, 32, 64) of `dst` from big-endian.
    pub(super) fn swap_be(&mut self, dst: Reg, bits: i32) {
        self.push(BPF_ALU | BPF_END | BPF_TO_BE, dst, 0, 0, bits);
    }

    /// `dst = *(size *)(src + off)`, zero-extended.
    pub(super) fn load(&mut self, dst: Reg, src: Reg, off: i16, bytes: u32) {
        self.push(
            BPF_LDX | BPF_MEM | u32::from(size_code(bytes)),
            dst,
            src.0,
            off,
            0,
        );
    }

    /// `*(size *)(dst + off) = src`.
    pub(super) fn store(&mut self, dst: Reg, off: i16, src: Reg, bytes: u32) {
        self.push(
            BPF_STX | BPF_MEM | u32::from(size_code(bytes)),
            dst,
            src.0,
            off,
            0,
        );
    }

    /// `dst = imm` (64 bits).
    pub(super) fn load_imm64(&mut self, dst: Reg, imm: u64) {
        self.push(BPF_LD | BPF_IMM | BPF_DW, dst, 0, 0, imm as u32 as i32);
        self.push(0, Reg(0), 0, 0, (imm >> 32) as u32 as i32);
    }

    /// `dst = ` a map, or a pointer into a map's value.
    pub(super) fn load_pseudo(&mut self, dst: Reg, kind: Pseudo, imm: i32, next: i32) {
        self.push(BPF_LD | BPF_IMM | BPF_DW, dst, kind as u8, 0, imm);
        self.push(0, Reg(0), 0, 0, next);
    }

    /// `dst = ` the address of the function that starts at `l` (a
    /// callback), placed by [`Asm::finish`].
    pub(super) fn load_func(&mut self, dst: Reg, l: Label) {
        self.fixups.push(Fixup {
            at: self.insns.len(),
            label: l,
            field: Field::Imm,
        });
        self.push(BPF_LD | BPF_IMM | BPF_DW, dst, op(BPF_PSEUDO_FUNC), 0, 0);
        self.push(0, Reg(0), 0, 0, 0);
    }

    /// Records that the instruction about to be pushed jumps to `l`.
    fn jump_to(&mut self, l: Label) {
        self.fixups.push(Fixup {
            at: self.insns.len(),
            label: l,
            field: Field::Offset,
        });
    }

    /// `if dst op src goto l`.
    pub(super) fn jump_reg(&mut self, op: Jmp, dst: Reg, src: Reg, l: Label) {
        self.jump_to(l);
        self.push(BPF_JMP | op as u32 | BPF_X, dst, src.0, 0, 0);
    }

    /// `if dst op imm goto l` (imm sign-extended to 64 bits).
    pub(super) fn jump_imm(&mut self, op: Jmp, dst: Reg, imm: i32, l: Label) {
        self.jump_to(l);
        self.push(BPF_JMP | op as u32 | BPF_K, dst, 0, 0, imm);
    }

    /// `goto l`.
    pub(super) fn ja(&mut self, l: Label) {
        self.jump_to(l);
        self.push(BPF_JMP | BPF_JA, Reg(0), 0, 0, 0);
    }

    pub(super) fn call(&mut self, helper: i32) {
        self.push(BPF_JMP | BPF_CALL, Reg(0), 0, 0, helper);
    }

    /// A call of the kernel function of BTF id `btf_id` (in vmlinux).
    pub(super) fn call_kfunc(&mut self, btf_id: i32) {
        self.push(
            BPF_JMP | BPF_CALL,
            Reg(0),
            op(BPF_PSEUDO_KFUNC_CALL),
            0,
            btf_id,
        );
    }

    pub(super) fn exit(&mut self) {
        self.push(BPF_JMP | BPF_EXIT, Reg(0), 0, 0, 0);
    }

    /// `return imm`.
    pub(super) fn ret(&mut self, imm: i32) {
        self.alu_imm(Alu::Mov, R0, imm);
        self.exit();
    }

    /// Patches every jump and function address with its label's place
    /// (the distance from the instruction after).
    pub(super) fn finish(mut self) -> Result<Vec<u64>, AsmError> {
        for Fixup { at, label, field } in std::mem::take(&mut self.fixups) {
            let target = self.labels[label.0].ok_or(AsmError::Unbound)?;
            let distance = target as i64 - at as i64 - 1;
            let insn = &mut self.insns[at];
            match field {
                Field::Offset => {
                    let off = i16::try_from(distance).map_err(|_| AsmError::TooFar)?;
                    *insn = (*insn & !(0xffff << 16)) | (u64::from(off as u16) << 16);
                }
                Field::Imm => {
                    let imm = i32::try_from(distance).map_err(|_| AsmError::TooFar)?;
                    *insn = (*insn & 0xffff_ffff) | (u64::from(imm as u32) << 32);
                }
            }
        }
        Ok(self.insns)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn instructions_are_encoded_as_the_kernel_reads_them() {
        let mut a = Asm::default();
        let end = a.label();
        a.alu_imm(Alu::Mov, R0, 7); // b7 00 0000 07000000
        a.jump_imm(Jmp::Eq, R1, -1, end); // 15 01 0100 ffffffff
        a.load(R2, R6, -8, 4); // 61 62 f8ff 00000000
        a.bind(end);
        a.exit(); // 95
        let insns = a.finish().unwrap();
        assert_eq!(
            insns,
            [
                0x0000_0007_0000_00b7,
                0xffff_ffff_0001_0115,
                0x0000_0000_fff8_6261,
                0x0000_0000_0000_0095
            ]
        );
    }

    #[test]
    fn a_function_is_loaded_by_its_label_once_placed() {
        let mut a = Asm::default();
        let callback = a.label();
        a.load_func(R2, callback); // 18 42 0000 02000000, then 0
        a.exit(); // 95
        a.bind(callback);
        a.ret(0); // b7 00 0000 00000000, 95
        let insns = a.finish().unwrap();
        assert_eq!(
            insns,
            [
                0x0000_0002_0000_4218,
                0x0000_0000_0000_0000,
                0x0000_0000_0000_0095,
                0x0000_0000_0000_00b7,
                0x0000_0000_0000_0095
            ]
        );
        // A label never placed is an error, as for jumps.
        let mut a = Asm::default();
        let nowhere = a.label();
        a.load_func(R2, nowhere);
        assert_eq!(a.finish(), Err(AsmError::Unbound));
    }

    #[test]
    fn the_other_forms_are_encoded_as_the_kernel_reads_them() {
        let mut a = Asm::default();
        a.load_pseudo(R1, Pseudo::MapFd, 5, 0); // 18 11 0000 05000000, 0
        a.load_pseudo(R1, Pseudo::MapValue, 6, 0); // 18 21 0000 06000000, 0
        a.load_imm64(R2, 0x1_0000_0002); // 18 02 0000 02000000, 00 00 0000 01000000
        a.swap_be(R1, 16); // dc 01 0000 10000000
        a.store(R9, 16, R0, 8); // 7b 09 1000 00000000
        a.alu_reg(Alu::Add, R2, R1); // 0f 12 0000 00000000
        a.call(164); // 85 00 0000 a4000000
        a.call_kfunc(77); // 85 20 0000 4d000000
        a.alu_imm(Alu::Mul, R1, 24); // 27 01 0000 18000000
        a.alu_reg(Alu::Or, R1, R2); // 4f 21 0000 00000000
        a.alu_imm(Alu::And, R1, 0xffff); // 57 01 0000 ffff0000
        let insns = a.finish().unwrap();
        assert_eq!(
            insns,
            [
                0x0000_0005_0000_1118,
                0,
                0x0000_0006_0000_2118,
                0,
                0x0000_0002_0000_0218,
                0x0000_0001_0000_0000,
                0x0000_0010_0000_01dc,
                0x0000_0000_0010_097b,
                0x0000_0000_0000_120f,
                0x0000_00a4_0000_0085,
                0x0000_004d_0000_2085,
                0x0000_0018_0000_0127,
                0x0000_0000_0000_214f,
                0x0000_ffff_0000_0157,
            ]
        );
    }
}
