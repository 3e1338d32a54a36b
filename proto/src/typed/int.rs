//! Integers in a map's bytes: where one lies, how wide it is, its sign and
//! its byte order, read and written in one place for every reader
//! (decoding, per-CPU sums, filters, projections, aggregates, watch
//! deltas) and for encoding JSON keys.

/// Where an integer lies in its bytes and how it is stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct IntField {
    /// Offset from the start of its bytes, in bits.
    bit_offset: usize,
    /// Width in bits: a bitfield's width, or eight times the size.
    bits: usize,
    signed: bool,
    /// Stored in network byte order (whole bytes only: bitfields are
    /// little-endian, as compilers lay them out on the hosts bpfmapd runs
    /// on).
    big_endian: bool,
}

impl IntField {
    /// An integer of `size` bytes (1 to 16) at byte `offset`.
    pub fn whole(offset: usize, size: usize, signed: bool, big_endian: bool) -> Self {
        Self {
            bit_offset: offset * 8,
            bits: size * 8,
            signed,
            big_endian,
        }
    }

    /// A bitfield of `bits` bits at bit `bit_offset`.
    pub fn bitfield(bit_offset: usize, bits: usize, signed: bool) -> Self {
        Self {
            bit_offset,
            bits,
            signed,
            big_endian: false,
        }
    }

    /// An unsigned little-endian integer of `size` bytes at the start: how
    /// untyped values of 1, 2, 4 or 8 bytes are read.
    pub fn unsigned(size: usize) -> Self {
        Self::whole(0, size, false, false)
    }

    /// Width in bits.
    pub fn bits(&self) -> usize {
        self.bits
    }

    /// Whether the integer is signed.
    pub fn signed(&self) -> bool {
        self.signed
    }

    /// Whether it is stored in network byte order.
    pub fn big_endian(&self) -> bool {
        self.big_endian
    }

    /// Whether it is a bitfield (not whole bytes at a byte offset).
    pub fn is_bitfield(&self) -> bool {
        !(self.bit_offset.is_multiple_of(8) && self.bits.is_multiple_of(8))
    }

    /// Byte offset of a whole-byte integer (the first byte a bitfield
    /// touches otherwise).
    pub fn offset(&self) -> usize {
        self.bit_offset / 8
    }

    /// Offset in bits.
    pub fn bit_offset(&self) -> usize {
        self.bit_offset
    }

    /// Its bits, zero-extended; `None` when `bytes` is too short.
    #[inline]
    pub fn raw(&self, bytes: &[u8]) -> Option<u128> {
        let first = self.bit_offset / 8;
        if !self.is_bitfield() {
            let b = bytes.get(first..first + self.bits / 8)?;
            let mut buf = [0u8; 16];
            return Some(if self.big_endian {
                buf[16 - b.len()..].copy_from_slice(b);
                u128::from_be_bytes(buf)
            } else {
                buf[..b.len()].copy_from_slice(b);
                u128::from_le_bytes(buf)
            });
        }
        let last = (self.bit_offset + self.bits).div_ceil(8);
        let b = bytes.get(first..last)?;
        let shift = self.bit_offset % 8;
        // A bitfield of up to 64 bits spans at most 9 bytes; wider ones (up
        // to 128 bits, at a bit offset) are read in two parts.
        let mut buf = [0u8; 16];
        let n = b.len().min(16);
        buf[..n].copy_from_slice(&b[..n]);
        let mut v = u128::from_le_bytes(buf) >> shift;
        if b.len() > 16 && shift > 0 {
            v |= u128::from(b[16]) << (128 - shift);
        }
        Some(mask(v, self.bits))
    }

    /// `raw`, its bits, as a value: sign-extended when signed.
    #[inline]
    pub fn sign_extended(&self, raw: u128) -> i128 {
        match self.signed {
            true => sign_extend(raw, self.bits),
            false => raw as i128,
        }
    }

    /// Its value, sign-extended when signed; `None` when `bytes` is too
    /// short or an unsigned 128-bit value exceeds `i128::MAX` (it cannot be
    /// compared or summed exactly).
    #[inline]
    pub fn value(&self, bytes: &[u8]) -> Option<i128> {
        let raw = self.raw(bytes)?;
        if self.signed {
            Some(sign_extend(raw, self.bits))
        } else {
            i128::try_from(raw).ok()
        }
    }

    /// Writes `raw` (its two's-complement bits) into `out`.
    pub(crate) fn write(&self, out: &mut [u8], raw: u128) {
        if !self.is_bitfield() {
            let first = self.bit_offset / 8;
            let size = self.bits / 8;
            let Some(dst) = out.get_mut(first..first + size) else {
                return;
            };
            if self.big_endian {
                dst.copy_from_slice(&raw.to_be_bytes()[16 - size..]);
            } else {
                dst.copy_from_slice(&raw.to_le_bytes()[..size]);
            }
            return;
        }
        for i in 0..self.bits {
            let pos = self.bit_offset + i;
            if let Some(byte) = out.get_mut(pos / 8) {
                let bit = 1u8 << (pos % 8);
                if raw >> i & 1 == 1 {
                    *byte |= bit;
                } else {
                    *byte &= !bit;
                }
            }
        }
    }

    /// The sum of this integer over per-CPU values (`None` when one is
    /// unreadable or the sum overflows 128 bits).
    #[inline]
    pub fn sum<'a>(&self, cpus: impl IntoIterator<Item = &'a [u8]>) -> Option<i128> {
        let mut sum = 0i128;
        for cpu in cpus {
            sum = sum.checked_add(self.value(cpu)?)?;
        }
        Some(sum)
    }
}

/// The low `bits` bits of `v`.
fn mask(v: u128, bits: usize) -> u128 {
    if bits >= 128 {
        v
    } else {
        v & ((1u128 << bits) - 1)
    }
}

/// `raw`, a `bits`-bit two's-complement integer, sign-extended.
pub(crate) fn sign_extend(raw: u128, bits: usize) -> i128 {
    if bits == 0 || bits >= 128 {
        return raw as i128;
    }
    let shift = 128 - bits;
    ((raw << shift) as i128) >> shift
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn integers_read_in_their_width_sign_and_byte_order() {
        let b = [0x01, 0x02, 0x03, 0x04, 0xff, 0xff];
        assert_eq!(IntField::whole(0, 2, false, false).raw(&b), Some(0x0201));
        assert_eq!(IntField::whole(0, 2, false, true).raw(&b), Some(0x0102));
        assert_eq!(IntField::whole(4, 2, true, false).value(&b), Some(-1));
        assert_eq!(IntField::whole(4, 2, false, false).value(&b), Some(0xffff));
        assert_eq!(IntField::whole(5, 2, false, false).raw(&b), None);
        // Bits 4..12 of 0x0201: 0x20.
        assert_eq!(IntField::bitfield(4, 8, false).raw(&b), Some(0x20));
        // The top bit of a 3-bit field set: -4 when signed.
        assert_eq!(IntField::bitfield(0, 3, true).value(&[0b100]), Some(-4));
        assert_eq!(IntField::bitfield(0, 3, false).value(&[0b100]), Some(4));
        let wide = [0xffu8; 16];
        assert_eq!(IntField::whole(0, 16, false, false).value(&wide), None);
        assert_eq!(IntField::whole(0, 16, true, false).value(&wide), Some(-1));
    }

    #[test]
    fn a_wide_bitfield_off_a_byte_boundary_reads_every_bit() {
        let mut b = [0u8; 17];
        let f = IntField::bitfield(4, 128, false);
        f.write(&mut b, u128::MAX - 1);
        assert_eq!(f.raw(&b), Some(u128::MAX - 1));
        assert_eq!(b[0] & 0x0f, 0, "the four bits before it untouched");
    }

    #[test]
    fn what_is_written_reads_back() {
        for f in [
            IntField::whole(1, 4, false, true),
            IntField::whole(2, 2, true, false),
            IntField::bitfield(3, 5, true),
            IntField::bitfield(9, 17, false),
        ] {
            let mut out = [0xa5u8; 8];
            let v: i128 = if f.signed() { -3 } else { 77 };
            f.write(&mut out, v as u128);
            assert_eq!(f.value(&out), Some(v), "{f:?}");
        }
    }

    #[test]
    fn sums_over_cpus_are_exact_or_nothing() {
        let f = IntField::unsigned(8);
        let cpus = [10u64.to_le_bytes(), 32u64.to_le_bytes()];
        assert_eq!(f.sum(cpus.iter().map(|c| c.as_slice())), Some(42));
        let big = IntField::whole(0, 16, true, false);
        let max = i128::MAX.to_le_bytes();
        assert_eq!(big.sum([max.as_slice(), max.as_slice()]), None);
    }
}
