//! Projections: only some members of each entry (`fields`), packed into
//! records of their own, described by derived types (records whose members
//! are named by their paths) through which both layouts decode them.

use bpfmap_proto::v1::{self as pb, type_info::Kind};

use super::path::{self, Resolved, Root, Shape};

/// Most members one projection selects.
pub const MAX_FIELDS: usize = 64;

/// A projection, resolved against a map's types.
#[derive(Debug, Clone)]
pub struct Projection {
    key: Vec<Part>,
    value: Vec<Part>,
    /// The derived types; `None` when no member of that side is selected.
    pub(crate) key_type: Option<pb::TypeInfo>,
    pub(crate) value_type: Option<pb::TypeInfo>,
    pub(crate) key_size: usize,
    pub(crate) value_size: usize,
}

/// One selected member: where it is read and where it goes.
#[derive(Debug, Clone)]
struct Part {
    root: Root,
    bit_offset: u64,
    bitfield: u32,
    size: usize,
    /// Summed over the CPUs (an integer of a per-CPU value), into 16 bytes.
    summed: bool,
    signed: bool,
    out: usize,
    out_size: usize,
}

impl Projection {
    /// Resolves `fields` ("key.daddr", "value.bytes") against `shape`.
    pub(crate) fn new(fields: &[String], shape: &Shape<'_>) -> Result<Self, String> {
        if fields.len() > MAX_FIELDS {
            return Err(format!("at most {MAX_FIELDS} fields"));
        }
        if !shape.typed() {
            return Err("fields select members: the map has no types (BTF)".into());
        }
        let mut key = Vec::new();
        let mut value = Vec::new();
        let mut key_members = Vec::new();
        let mut value_members = Vec::new();
        let (mut key_size, mut value_size) = (0usize, 0usize);
        let mut seen = std::collections::HashSet::new();
        for f in fields {
            if !seen.insert(f.as_str()) {
                return Err(format!("{f}: given twice"));
            }
            let (root, steps) = path::parse(f)?;
            let r = path::resolve(shape, root, &steps)?;
            let summed = root == Root::Value && shape.cpus.is_some();
            let (info, out_size, signed) = derived(&r, summed)?;
            let (parts, members, size) = match root {
                Root::Key => (&mut key, &mut key_members, &mut key_size),
                _ => (&mut value, &mut value_members, &mut value_size),
            };
            // Named by the path below its root: "key.daddr" is "daddr"
            // in the key's record; a whole key or value, or one CPU's
            // value, keeps its full path.
            let name = ["key.", "value."]
                .iter()
                .find_map(|p| r.path.strip_prefix(p))
                .unwrap_or(&r.path)
                .to_owned();
            members.push(pb::Member {
                name,
                bit_offset: u32::try_from(*size * 8).map_err(|_| "too large".to_owned())?,
                bitfield_size: 0,
                r#type: Some(info),
            });
            parts.push(Part {
                root: r.root,
                bit_offset: r.bit_offset,
                bitfield: r.bitfield,
                size: r.size,
                summed,
                signed,
                out: *size,
                out_size,
            });
            *size += out_size;
        }
        let record = |name: &str, members: Vec<pb::Member>, size: usize| {
            (!members.is_empty()).then(|| pb::TypeInfo {
                name: name.to_owned(),
                size: size as u32,
                kind: Some(Kind::Struct(pb::RecordType { members })),
            })
        };
        Ok(Self {
            key,
            value,
            key_type: record("key", key_members, key_size),
            value_type: record("value", value_members, value_size),
            key_size,
            value_size,
        })
    }

    /// The projected record of one entry's key, or of its value (`value`
    /// in the kernel's layout, per-CPU values `stride` bytes apart).
    pub(crate) fn write(
        &self,
        key: &[u8],
        value: &[u8],
        stride: usize,
        keys: &mut Vec<u8>,
        values: &mut Vec<u8>,
    ) {
        for (parts, out, size) in [
            (&self.key, keys, self.key_size),
            (&self.value, values, self.value_size),
        ] {
            let start = out.len();
            out.resize(start + size, 0);
            for p in parts {
                let dst = &mut out[start + p.out..start + p.out + p.out_size];
                match p.root {
                    Root::Key => p.copy(key, dst),
                    Root::Value if !p.summed => p.copy(value, dst),
                    Root::Value => {
                        let mut sum = 0i128;
                        for cpu in value.chunks_exact(stride.max(1)) {
                            sum = sum.wrapping_add(p.int(cpu));
                        }
                        dst.copy_from_slice(&sum.to_le_bytes());
                    }
                    Root::Cpu(i) => {
                        if let Some(cpu) = value.get(i * stride..(i + 1) * stride) {
                            p.copy(cpu, dst);
                        }
                    }
                }
            }
        }
    }
}

impl Part {
    fn copy(&self, from: &[u8], dst: &mut [u8]) {
        if self.bitfield != 0 {
            let v = self.int(from);
            dst.copy_from_slice(&v.to_le_bytes()[..dst.len()]);
            return;
        }
        let start = (self.bit_offset / 8) as usize;
        if let Some(src) = from.get(start..start + self.size) {
            dst[..self.size].copy_from_slice(src);
        }
    }

    /// The member as an integer (little-endian, or a bitfield).
    fn int(&self, from: &[u8]) -> i128 {
        let (start, bits) = if self.bitfield != 0 {
            (self.bit_offset, self.bitfield)
        } else {
            (self.bit_offset, (self.size * 8) as u32)
        };
        let first = (start / 8) as usize;
        let last = (start + u64::from(bits)).div_ceil(8) as usize;
        let Some(b) = from.get(first..last) else {
            return 0;
        };
        let mut buf = [0u8; 16];
        let n = b.len().min(16);
        buf[..n].copy_from_slice(&b[..n]);
        let v = u128::from_le_bytes(buf) >> (start % 8);
        let v = if bits >= 128 {
            v
        } else {
            v & ((1u128 << bits) - 1)
        };
        if self.signed && bits < 128 {
            let shift = 128 - bits;
            ((v << shift) as i128) >> shift
        } else {
            v as i128
        }
    }
}

/// The type a selected member has in the projection, its size there, and
/// whether it is signed: its own type; a bitfield becomes an integer of the
/// next size up; a summed per-CPU integer a 128-bit one.
fn derived(r: &Resolved, summed: bool) -> Result<(pb::TypeInfo, usize, bool), String> {
    let info = r
        .info
        .clone()
        .ok_or_else(|| format!("{}: the map has no types", r.path))?;
    let int_of = |size: usize, signed: bool, big_endian: bool| pb::TypeInfo {
        name: String::new(),
        size: size as u32,
        kind: Some(Kind::Int(pb::IntType { signed, big_endian })),
    };
    let (signed, big_endian, is_int) = match &info.kind {
        Some(Kind::Int(i)) => (i.signed, i.big_endian, true),
        Some(Kind::Enum(e)) => (e.signed, false, false),
        _ => (false, false, false),
    };
    if summed {
        if !is_int || big_endian {
            return Err(format!(
                "{}: per-CPU values are summed over the CPUs for `value`, and only (little-endian) integers can be ({} is not); select one CPU's with values[i]",
                r.path,
                path::type_name(&info)
            ));
        }
        return Ok((int_of(16, signed, false), 16, signed));
    }
    if r.bitfield != 0 {
        let size = match r.bitfield {
            0..=8 => 1,
            9..=16 => 2,
            17..=32 => 4,
            33..=64 => 8,
            _ => 16,
        };
        let mut t = int_of(size, signed, false);
        if let Some(Kind::Enum(_)) = &info.kind {
            t = pb::TypeInfo {
                size: size as u32,
                ..info
            };
        }
        return Ok((t, size, signed));
    }
    let size = r.size;
    Ok((info, size, signed))
}

#[cfg(test)]
#[path = "projection_tests.rs"]
mod tests;
