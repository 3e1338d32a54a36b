//! BPF instructions, encoded as the kernel reads them (one little-endian
//! 64-bit word each: opcode, registers, offset, immediate), with labels
//! for forward jumps.

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

const LD: u8 = 0x00;
const LDX: u8 = 0x01;
const STX: u8 = 0x03;
const ALU: u8 = 0x04;
const JMP: u8 = 0x05;
const ALU64: u8 = 0x07;
const MEM: u8 = 0x60;
const DW: u8 = 0x18;
const K: u8 = 0x00;
const X: u8 = 0x08;

/// Arithmetic operations.
#[derive(Debug, Clone, Copy)]
pub(super) enum Alu {
    Add = 0x00,
    Sub = 0x10,
    Lsh = 0x60,
    Rsh = 0x70,
    Mov = 0xb0,
    Arsh = 0xc0,
}

/// Conditional jumps (the 64-bit comparisons).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Jmp {
    Eq = 0x10,
    Gt = 0x20,
    Ge = 0x30,
    Ne = 0x50,
    Sgt = 0x60,
    Sge = 0x70,
    Lt = 0xa0,
    Le = 0xb0,
    Slt = 0xc0,
    Sle = 0xd0,
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
    match bytes {
        1 => 0x10,
        2 => 0x08,
        4 => 0x00,
        _ => DW,
    }
}

/// What an `ld_imm64` loads (its source register field).
#[derive(Debug, Clone, Copy)]
pub(super) enum Pseudo {
    /// A map, by descriptor.
    MapFd = 1,
    /// A pointer into the value of a single-element array map.
    MapValue = 2,
    /// A function of the program, by instruction offset.
    Func = 4,
}

/// A place in the code, bound once.
#[derive(Debug, Clone, Copy)]
pub(super) struct Label(usize);

/// Instructions being assembled.
#[derive(Debug, Default)]
pub(super) struct Asm {
    pub(super) insns: Vec<u64>,
    labels: Vec<Option<usize>>,
    /// Jumps to patch: (instruction, label).
    fixups: Vec<(usize, Label)>,
}

/// Why assembled code cannot be loaded.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub(super) enum AsmError {
    #[error("a jump spans more than 32,767 instructions")]
    TooFar,
    #[error("a jump to a label never placed")]
    Unbound,
}

fn encode(code: u8, dst: Reg, src: u8, off: i16, imm: i32) -> u64 {
    u64::from(code)
        | (u64::from(dst.0 | (src << 4)) << 8)
        | (u64::from(off as u16) << 16)
        | (u64::from(imm as u32) << 32)
}

impl Asm {
    fn push(&mut self, code: u8, dst: Reg, src: u8, off: i16, imm: i32) {
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
        self.push(ALU64 | op as u8 | K, dst, 0, 0, imm);
    }

    /// `dst op= src` (64-bit).
    pub(super) fn alu_reg(&mut self, op: Alu, dst: Reg, src: Reg) {
        self.push(ALU64 | op as u8 | X, dst, src.0, 0, 0);
    }

    /// Swaps the low `bits` (16, 32, 64) of `dst` from big-endian.
    pub(super) fn swap_be(&mut self, dst: Reg, bits: i32) {
        const END: u8 = 0xd0;
        self.push(ALU | END | X, dst, 0, 0, bits);
    }

    /// `dst = *(size *)(src + off)`, zero-extended.
    pub(super) fn load(&mut self, dst: Reg, src: Reg, off: i16, bytes: u32) {
        self.push(LDX | MEM | size_code(bytes), dst, src.0, off, 0);
    }

    /// `*(size *)(dst + off) = src`.
    pub(super) fn store(&mut self, dst: Reg, off: i16, src: Reg, bytes: u32) {
        self.push(STX | MEM | size_code(bytes), dst, src.0, off, 0);
    }

    /// `dst = imm` (64 bits).
    pub(super) fn load_imm64(&mut self, dst: Reg, imm: u64) {
        self.push(LD | DW, dst, 0, 0, imm as u32 as i32);
        self.push(0, Reg(0), 0, 0, (imm >> 32) as u32 as i32);
    }

    /// `dst = ` a map, a pointer into a map's value, or a function.
    pub(super) fn load_pseudo(&mut self, dst: Reg, kind: Pseudo, imm: i32, next: i32) {
        self.push(LD | DW, dst, kind as u8, 0, imm);
        self.push(0, Reg(0), 0, 0, next);
    }

    /// `if dst op src goto l`.
    pub(super) fn jump_reg(&mut self, op: Jmp, dst: Reg, src: Reg, l: Label) {
        self.fixups.push((self.insns.len(), l));
        self.push(JMP | op as u8 | X, dst, src.0, 0, 0);
    }

    /// `if dst op imm goto l` (imm sign-extended to 64 bits).
    pub(super) fn jump_imm(&mut self, op: Jmp, dst: Reg, imm: i32, l: Label) {
        self.fixups.push((self.insns.len(), l));
        self.push(JMP | op as u8 | K, dst, 0, 0, imm);
    }

    /// `goto l`.
    pub(super) fn ja(&mut self, l: Label) {
        self.fixups.push((self.insns.len(), l));
        self.push(JMP, Reg(0), 0, 0, 0);
    }

    pub(super) fn call(&mut self, helper: i32) {
        self.push(JMP | 0x80, Reg(0), 0, 0, helper);
    }

    /// A call of the kernel function of BTF id `btf_id` (in vmlinux).
    pub(super) fn call_kfunc(&mut self, btf_id: i32) {
        self.push(JMP | 0x80, Reg(0), 2, 0, btf_id);
    }

    pub(super) fn exit(&mut self) {
        self.push(JMP | 0x90, Reg(0), 0, 0, 0);
    }

    /// `return imm`.
    pub(super) fn ret(&mut self, imm: i32) {
        self.alu_imm(Alu::Mov, R0, imm);
        self.exit();
    }

    /// Patches every jump with its label's place.
    pub(super) fn finish(mut self) -> Result<Vec<u64>, AsmError> {
        for (at, l) in std::mem::take(&mut self.fixups) {
            let target = self.labels[l.0].ok_or(AsmError::Unbound)?;
            let off = target as i64 - at as i64 - 1;
            let off = i16::try_from(off).map_err(|_| AsmError::TooFar)?;
            let insn = &mut self.insns[at];
            *insn = (*insn & !(0xffff << 16)) | (u64::from(off as u16) << 16);
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
}
