//! Map key and value types, from the map's BTF, as [`TypeInfo`] for clients.
//!
//! [`TypeCache::map_types`] reads the BTF object a map names
//! ([`MapMeta::btf_id`]) from the kernel, parses it with
//! `bpfmap_kernel::btf`, [`describe`]s the key and value types and keeps
//! the result. An integer reached through one of the kernel's network-order
//! typedefs ([`NETWORK_ORDER`]) is described as big-endian. A description
//! is self-contained: typedefs and modifiers are
//! resolved (the outermost name is kept), pointers are not followed (only
//! the name of what they point to is given).
//!
//! The BTF comes from whatever program created the map, so it is treated as
//! hostile. The parser checks every section and record against the data,
//! and every type id and name offset when it is looked up (malformed input
//! is an error, never a panic: nothing here runs under `catch_unwind`), and
//! a description is bounded: at most [`MAX_DEPTH`] levels and
//! [`MAX_NODES`] types and enumerators, a loop in the type graph that is
//! not through a pointer is refused, and every member, bitfield and array
//! is checked to lie within its parent's size, so a decoder can trust the
//! offsets and sizes it is given.
//!
//! Bitfields are read as the kernel reads them. In a struct or union with
//! `kind_flag` set (what current compilers and pahole write when there are
//! bitfields), each member carries its width. In one without (the encoding
//! that predates `kind_flag`), the width is in the member's integer type
//! (`btf_int_check_member`): a member whose integer, through typedefs and
//! modifiers, has fewer bits than its size holds or a bit offset of its own,
//! or that starts off a byte boundary, is a bitfield of the integer's bits,
//! at the member's offset plus the integer's; any other member (an enum
//! among them) is a plain one.
#![forbid(unsafe_code)]

use std::{
    collections::HashMap,
    fmt,
    sync::{Arc, Mutex, OnceLock},
};

use bpfmap_kernel::btf::{Btf, BtfError, Int, Record, Type};
use bpfmap_proto::v1::{
    ArrayType, BoolType, CharType, EnumType, Enumerator, FloatType, IntType, Member, OpaqueType,
    PointerType, RecordType, TypeInfo, type_info::Kind,
};

use bpfmap_kernel::{self as kernel, BtfInfo, MAX_BTF_SIZE, MapMeta, SysResult};

use super::{KnownTypes, MapTypes};

/// The bounds of every description, whoever reads it: its depth and its
/// types and enumerators (the decoder checks the same).
pub use bpfmap_proto::typed::{MAX_DEPTH, MAX_NODES};
/// Most members of one struct or union.
pub const MAX_MEMBERS: usize = 4096;
/// Most enumerators of one enum.
pub const MAX_ENUMERATORS: usize = 4096;
/// Largest type described (map values are at most KMALLOC_MAX_SIZE, a few
/// MiB; the caller checks the exact size against the map).
pub const MAX_SIZE: u32 = 16 << 20;
/// Longest name (the kernel's KSYM_NAME_LEN).
pub const MAX_NAME: usize = 512;
/// Most bytes of names in one description.
const MAX_NAME_BYTES: usize = 1 << 20;
/// Longest run of typedefs and modifiers (the kernel's MAX_RESOLVE_DEPTH).
const MAX_CHAIN: usize = 32;
/// Decoded values allowed per byte of the described type: a byte holds at
/// most 8 one-bit bitfields, plus the values of the records around them.
/// What goes beyond (zero-sized elements repeated) would let a small value
/// decode into an unbounded amount of output.
const VALUES_PER_BYTE: u64 = 16;

/// The kernel's typedefs of integers stored in network byte order
/// (include/uapi/linux/types.h): an integer reached through one of them is
/// described as big-endian.
pub const NETWORK_ORDER: [&str; 5] = ["__be16", "__be32", "__be64", "__sum16", "__wsum"];

/// Why a map's types are unavailable when the daemon lacks CAP_SYS_ADMIN.
pub const NEEDS_CAP_SYS_ADMIN: &str = "reading BTF needs CAP_SYS_ADMIN";

/// Why a BTF type cannot be described.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DescribeError {
    /// A type contains itself other than through a pointer.
    #[error("type graph loops at [{0}]")]
    Loop(u32),
    /// More than [`MAX_DEPTH`] levels.
    #[error("types nest more than {MAX_DEPTH} levels deep (at [{0}])")]
    TooDeep(u32),
    /// More than [`MAX_NODES`] types and enumerators.
    #[error("more than {MAX_NODES} types and enumerators to describe (at [{0}])")]
    TooLarge(u32),
    /// Anything else about type `id`.
    #[error("type [{id}] {reason}")]
    Invalid {
        /// The type's id in its BTF object.
        id: u32,
        /// What is wrong, completing `type [id] ...`.
        reason: String,
    },
}

fn invalid(id: u32, reason: impl Into<String>) -> DescribeError {
    DescribeError::Invalid {
        id,
        reason: reason.into(),
    }
}

/// Describes type `type_id` of `btf` (see the module documentation).
pub fn describe(btf: &Btf, type_id: u32) -> Result<TypeInfo, DescribeError> {
    let mut d = Describer {
        btf,
        nodes: 0,
        name_bytes: 0,
        path: Vec::new(),
    };
    let out = d.describe(type_id, 1)?;
    let budget = VALUES_PER_BYTE * u64::from(out.info.size) + MAX_NODES as u64;
    if out.values > budget {
        return Err(invalid(
            type_id,
            format!(
                "decodes into {} values for its {} bytes (zero-sized elements repeated)",
                out.values, out.info.size
            ),
        ));
    }
    Ok(out.info)
}

/// Why BTF cannot be read or parsed.
#[derive(Debug, thiserror::Error)]
pub enum BtfReadError {
    /// More than [`MAX_BTF_SIZE`] bytes.
    #[error("{what} is {bytes} bytes, more than {MAX_BTF_SIZE}")]
    TooLarge {
        /// What ("BTF", "/sys/kernel/btf/vmlinux").
        what: &'static str,
        /// Its size.
        bytes: u64,
    },
    /// A file that cannot be read.
    #[error("cannot read {what}: {source}")]
    Io {
        /// The file.
        what: &'static str,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// Not BTF, or BTF that does not hold together.
    #[error(transparent)]
    Malformed(#[from] BtfError),
    /// No base BTF to parse split BTF on.
    #[error("{0}")]
    NoBase(&'static str),
}

/// Parses raw BTF, split on `base` when given (a kernel module's BTF on
/// vmlinux): at most [`MAX_BTF_SIZE`] bytes, in this host's byte order
/// (the only one the kernel hands out), every section and record within
/// the data.
pub fn parse(raw: &[u8], base: Option<&Btf>) -> Result<Btf, BtfReadError> {
    if raw.len() > MAX_BTF_SIZE {
        return Err(BtfReadError::TooLarge {
            what: "BTF",
            bytes: raw.len() as u64,
        });
    }
    Ok(Btf::parse(raw, base)?)
}

/// A described type and how many values a decoder produces for it.
struct Described {
    info: TypeInfo,
    values: u64,
}

struct Describer<'a> {
    btf: &'a Btf,
    nodes: usize,
    name_bytes: usize,
    /// Type ids from the outermost type down to the current one: meeting
    /// one again is a loop.
    path: Vec<u32>,
}

fn is_integral(kind: Option<&Kind>) -> bool {
    matches!(
        kind,
        Some(Kind::Int(_) | Kind::Char(_) | Kind::Bool(_) | Kind::Enum(_))
    )
}

impl<'a> Describer<'a> {
    fn type_by_id(&self, id: u32) -> Result<&'a Type, DescribeError> {
        self.btf
            .get(id)
            .map_err(|_| invalid(id, "does not exist in its BTF object"))
    }

    /// The name at `name_off` (of type `id`, or of one of its members or
    /// enumerators), "" for offset 0 (no name).
    fn name(&mut self, id: u32, name_off: u32) -> Result<String, DescribeError> {
        let btf = self.btf;
        let name = btf
            .name(name_off)
            .map_err(|e| invalid(id, format!("has an invalid name: {e}")))?;
        if name.len() > MAX_NAME {
            return Err(invalid(
                id,
                format!("has a name of {} bytes (at most {MAX_NAME})", name.len()),
            ));
        }
        self.name_bytes += name.len();
        if self.name_bytes > MAX_NAME_BYTES {
            return Err(DescribeError::TooLarge(id));
        }
        Ok(name.to_owned())
    }

    fn count_node(&mut self, id: u32) -> Result<(), DescribeError> {
        self.nodes += 1;
        if self.nodes > MAX_NODES {
            return Err(DescribeError::TooLarge(id));
        }
        Ok(())
    }

    fn enter(&mut self, id: u32) -> Result<(), DescribeError> {
        if self.path.contains(&id) {
            return Err(DescribeError::Loop(id));
        }
        self.path.push(id);
        Ok(())
    }

    fn describe(&mut self, id: u32, depth: usize) -> Result<Described, DescribeError> {
        if depth > MAX_DEPTH {
            return Err(DescribeError::TooDeep(id));
        }
        self.count_node(id)?;
        let on_path = self.path.len();
        let out = self.describe_on_path(id, depth);
        self.path.truncate(on_path);
        let out = out?;
        if out.info.size > MAX_SIZE {
            return Err(invalid(
                id,
                format!(
                    "is {} bytes, more than the {MAX_SIZE} described",
                    out.info.size
                ),
            ));
        }
        Ok(out)
    }

    fn describe_on_path(&mut self, id: u32, depth: usize) -> Result<Described, DescribeError> {
        let (id, ty, typedefs) = self.resolve_modifiers(id)?;
        let (own_name, size, mut kind, values) = self.describe_kind(id, ty, depth)?;
        if let Kind::Int(int) = &mut kind {
            int.big_endian = typedefs.iter().any(|t| NETWORK_ORDER.contains(&t.as_str()));
        }
        let outer_name = typedefs.into_iter().next();
        Ok(Described {
            info: TypeInfo {
                name: outer_name.unwrap_or(own_name),
                size,
                kind: Some(kind),
            },
            values,
        })
    }

    /// Follows typedefs and modifiers from `id` to the type they name: its
    /// id, the type, and the names of the typedefs met, outermost first
    /// (the first names the type).
    fn resolve_modifiers(
        &mut self,
        mut id: u32,
    ) -> Result<(u32, &'a Type, Vec<String>), DescribeError> {
        let mut typedefs = Vec::new();
        let mut chain = 0;
        loop {
            self.enter(id)?;
            let ty = self.type_by_id(id)?;
            let next = match ty {
                Type::Typedef(t) => {
                    typedefs.push(self.name(id, t.name_off)?);
                    t.type_id
                }
                Type::Const(t) | Type::Volatile(t) | Type::Restrict(t) | Type::TypeTag(t) => {
                    t.type_id
                }
                _ => return Ok((id, ty, typedefs)),
            };
            chain += 1;
            if chain > MAX_CHAIN {
                return Err(invalid(
                    id,
                    format!("ends a run of more than {MAX_CHAIN} typedefs and modifiers"),
                ));
            }
            id = next;
        }
    }

    /// A data type's own name, size, kind and decoded values.
    fn describe_kind(
        &mut self,
        id: u32,
        ty: &'a Type,
        depth: usize,
    ) -> Result<(String, u32, Kind, u64), DescribeError> {
        Ok(match ty {
            Type::Int(t) => self.int(id, t)?,
            Type::Float(t) => {
                let name = self.name(id, t.name_off)?;
                let size = t.size;
                let kind = if size == 4 || size == 8 {
                    Kind::Float(FloatType {})
                } else {
                    Kind::Opaque(OpaqueType {
                        reason: format!("{size}-byte floating-point type"),
                    })
                };
                (name, size, kind, 1)
            }
            Type::Enum(t) => {
                let name = self.name(id, t.name_off)?;
                let values = t.values.iter().map(|v| (v.name_off, t.value(v)));
                let kind = self.enumeration(id, t.signed, t.values.len(), values)?;
                (name, self.enum_size(id, t.size)?, kind, 1)
            }
            Type::Enum64(t) => {
                let name = self.name(id, t.name_off)?;
                let values = t.values.iter().map(|v| (v.name_off, v.val as i64));
                let kind = self.enumeration(id, t.signed, t.values.len(), values)?;
                (name, self.enum_size(id, t.size)?, kind, 1)
            }
            Type::Struct(t) | Type::Union(t) => {
                let union = matches!(ty, Type::Union(_));
                let name = self.name(id, t.name_off)?;
                let (record, values) = self.record(id, &name, t, union, depth)?;
                let kind = if union {
                    Kind::Union(record)
                } else {
                    Kind::Struct(record)
                };
                (name, t.size, kind, values)
            }
            Type::Array(t) => self.array(id, t, depth)?,
            Type::Ptr(t) => {
                let target = self.pointee_name(t.type_id)?;
                let size = std::mem::size_of::<*const u8>() as u32;
                let kind = Kind::Pointer(PointerType { target });
                (String::new(), size, kind, 1)
            }
            Type::Fwd(t) => {
                let name = self.name(id, t.name_off)?;
                let what = if t.is_union { "union" } else { "struct" };
                return Err(invalid(
                    id,
                    format!("is a forward declaration of {what} {name}: its size is unknown"),
                ));
            }
            Type::DataSec(d) => {
                let name = self.name(id, d.name_off)?;
                let (record, values) = self.datasec(id, &name, d, depth)?;
                (name, d.size, Kind::Struct(record), values)
            }
            Type::Void => return Err(invalid(id, "is void, which has no size")),
            other => {
                let name = self.name(id, other.name_off())?;
                return Err(invalid(
                    id,
                    format!("is a {} ({name:?}), not a data type", other.kind_name()),
                ));
            }
        })
    }

    /// A global data section (`.bss`, `.data`, `.rodata`): an object of its
    /// variables, each at its offset.
    fn datasec(
        &mut self,
        id: u32,
        name: &str,
        d: &bpfmap_kernel::btf::DataSec,
        depth: usize,
    ) -> Result<(RecordType, u64), DescribeError> {
        if d.vars.len() > MAX_MEMBERS {
            return Err(invalid(
                id,
                format!(
                    "(section {name}) has {} variables (at most {MAX_MEMBERS})",
                    d.vars.len()
                ),
            ));
        }
        let mut members = Vec::with_capacity(d.vars.len());
        let mut values: u64 = 1;
        for v in &d.vars {
            let Type::Var(var) = self.type_by_id(v.type_id)? else {
                return Err(invalid(
                    id,
                    format!(
                        "(section {name}) lists type [{}], which is not a variable",
                        v.type_id
                    ),
                ));
            };
            let var_name = self.name(v.type_id, var.name_off)?;
            let ty = self.describe(var.type_id, depth + 1)?;
            let end = u64::from(v.offset) + u64::from(ty.info.size);
            if ty.info.size != v.size || end > u64::from(d.size) {
                return Err(invalid(
                    id,
                    format!(
                        "(section {name}): variable {var_name:?} ({} bytes, {} in the section) at {} does not fit the section's {} bytes",
                        ty.info.size, v.size, v.offset, d.size
                    ),
                ));
            }
            values = values.saturating_add(ty.values);
            members.push(Member {
                name: var_name,
                bit_offset: v.offset * 8,
                bitfield_size: 0,
                r#type: Some(ty.info),
            });
        }
        Ok((RecordType { members }, values))
    }

    fn int(&mut self, id: u32, t: &Int) -> Result<(String, u32, Kind, u64), DescribeError> {
        let name = self.name(id, t.name_off)?;
        let size = t.size;
        if ![1, 2, 4, 8, 16].contains(&size) {
            return Err(invalid(
                id,
                format!("({name}) is an integer of {size} bytes"),
            ));
        }
        let kind = if t.is_bool() {
            Kind::Bool(BoolType {})
        } else if size == 1 && (t.is_char() || name == "char") {
            Kind::Char(CharType {
                signed: t.is_signed(),
            })
        } else {
            Kind::Int(IntType {
                signed: t.is_signed(),
                big_endian: false,
            })
        };
        Ok((name, size, kind, 1))
    }

    fn array(
        &mut self,
        id: u32,
        t: &bpfmap_kernel::btf::Array,
        depth: usize,
    ) -> Result<(String, u32, Kind, u64), DescribeError> {
        let element = self.describe(t.elem_type, depth + 1)?;
        let length = t.len;
        let size = element.info.size.checked_mul(length).ok_or_else(|| {
            invalid(
                id,
                format!(
                    "is an array of {length} elements of {} bytes: its size overflows",
                    element.info.size
                ),
            )
        })?;
        let values = element
            .values
            .saturating_mul(u64::from(length))
            .saturating_add(1);
        let kind = Kind::Array(Box::new(ArrayType {
            element: Some(Box::new(element.info)),
            length,
        }));
        Ok((String::new(), size, kind, values))
    }

    fn enum_size(&self, id: u32, size: u32) -> Result<u32, DescribeError> {
        match size {
            1 | 2 | 4 | 8 => Ok(size),
            _ => Err(invalid(id, format!("is an enum of {size} bytes"))),
        }
    }

    /// An enum of `count` enumerators, as (name offset, value).
    fn enumeration(
        &mut self,
        id: u32,
        signed: bool,
        count: usize,
        values: impl Iterator<Item = (u32, i64)>,
    ) -> Result<Kind, DescribeError> {
        if count > MAX_ENUMERATORS {
            return Err(invalid(
                id,
                format!("is an enum of {count} enumerators (at most {MAX_ENUMERATORS})"),
            ));
        }
        let mut enumerators = Vec::with_capacity(count);
        for (name_off, value) in values {
            self.count_node(id)?;
            enumerators.push(Enumerator {
                name: self.name(id, name_off)?,
                value,
            });
        }
        Ok(Kind::Enum(EnumType {
            signed,
            enumerators,
        }))
    }

    fn record(
        &mut self,
        id: u32,
        name: &str,
        t: &Record,
        union: bool,
        depth: usize,
    ) -> Result<(RecordType, u64), DescribeError> {
        let what = if union { "union" } else { "struct" };
        if t.members.len() > MAX_MEMBERS {
            return Err(invalid(
                id,
                format!(
                    "({what} {name}) has {} members (at most {MAX_MEMBERS})",
                    t.members.len()
                ),
            ));
        }
        let mut members = Vec::with_capacity(t.members.len());
        let mut values: u64 = 1;
        let record = RecordAt { id, what, name, t };
        for m in &t.members {
            let (member, member_values) = self.member(&record, m, depth)?;
            values = values.saturating_add(member_values);
            members.push(member);
        }
        Ok((RecordType { members }, values))
    }

    /// One member of a record, placed and checked to lie within it.
    fn member(
        &mut self,
        r: &RecordAt<'_>,
        m: &bpfmap_kernel::btf::Member,
        depth: usize,
    ) -> Result<(Member, u64), DescribeError> {
        let (id, what, name) = (r.id, r.what, r.name);
        let member_name = self.name(id, m.name_off)?;
        let ty = self.describe(m.type_id, depth + 1)?;
        let type_bits = u64::from(ty.info.size) * 8;
        let (bit_offset, bitfield_size) = self.member_bits(r, m, &member_name)?;
        let end = if bitfield_size == 0 {
            if bit_offset % 8 != 0 {
                return Err(invalid(
                    id,
                    format!(
                        "({what} {name}): member {member_name:?} at bit {bit_offset} is not byte-aligned"
                    ),
                ));
            }
            u64::from(bit_offset) + type_bits
        } else {
            if !is_integral(ty.info.kind.as_ref()) {
                return Err(invalid(
                    id,
                    format!(
                        "({what} {name}): bitfield {member_name:?} is not of an integer or enum type"
                    ),
                ));
            }
            if bitfield_size > 64 || u64::from(bitfield_size) > type_bits {
                return Err(invalid(
                    id,
                    format!(
                        "({what} {name}): bitfield {member_name:?} of {bitfield_size} bits does not fit its {}-byte type",
                        ty.info.size
                    ),
                ));
            }
            u64::from(bit_offset) + u64::from(bitfield_size)
        };
        if end > u64::from(r.t.size) * 8 {
            return Err(invalid(
                id,
                format!(
                    "({what} {name}): member {member_name:?} (bits {bit_offset}..{end}) lies outside the {what}'s {} bytes",
                    r.t.size
                ),
            ));
        }
        let member = Member {
            name: member_name,
            bit_offset,
            bitfield_size,
            r#type: Some(ty.info),
        };
        Ok((member, ty.values))
    }

    /// A member's bit offset and bitfield width (0: not a bitfield). With
    /// kind_flag 0, a bitfield shows through its integer type: the width is
    /// the integer's, which may start a few bits in (the kernel's
    /// btf_int_check_member).
    fn member_bits(
        &self,
        r: &RecordAt<'_>,
        m: &bpfmap_kernel::btf::Member,
        member_name: &str,
    ) -> Result<(u32, u32), DescribeError> {
        let legacy = if r.t.kind_flag {
            None
        } else {
            self.int_of(m.type_id)
                .filter(|int| !int.is_whole() || !m.bit_offset.is_multiple_of(8))
        };
        let Some(int) = legacy else {
            return Ok((m.bit_offset, m.bitfield_size));
        };
        let (id, what, name) = (r.id, r.what, r.name);
        if int.bits == 0 {
            return Err(invalid(
                id,
                format!("({what} {name}): member {member_name:?} is of an integer type of 0 bits"),
            ));
        }
        let offset = m
            .bit_offset
            .checked_add(u32::from(int.bit_offset))
            .ok_or_else(|| {
                invalid(
                    id,
                    format!(
                        "({what} {name}): member {member_name:?} lies past bit {}",
                        u32::MAX
                    ),
                )
            })?;
        Ok((offset, u32::from(int.bits)))
    }

    fn int_of(&self, mut id: u32) -> Option<&'a Int> {
        for _ in 0..=MAX_CHAIN {
            match self.btf.get(id).ok()? {
                Type::Int(int) => return Some(int),
                Type::Typedef(t)
                | Type::Const(t)
                | Type::Volatile(t)
                | Type::Restrict(t)
                | Type::TypeTag(t) => id = t.type_id,
                _ => return None,
            }
        }
        None
    }

    /// How a pointer's target is named: the first name met through
    /// typedefs and modifiers ("node", "__u32", "void"), with a `*` per
    /// pointer in between ("char *"). Never looks inside the target.
    fn pointee_name(&mut self, mut id: u32) -> Result<String, DescribeError> {
        let mut stars = String::new();
        let mut suffix = String::new();
        let mut seen = Vec::new();
        for _ in 0..MAX_CHAIN {
            if seen.contains(&id) {
                return Err(DescribeError::Loop(id));
            }
            seen.push(id);
            let ty = self.type_by_id(id)?;
            let next = match &ty {
                Type::Void => return Ok(spell("void", &stars, &suffix)),
                Type::Ptr(t) => {
                    stars.push('*');
                    t.type_id
                }
                Type::Array(t) => {
                    suffix = format!("[{}]{suffix}", t.len);
                    t.elem_type
                }
                Type::Const(t) | Type::Volatile(t) | Type::Restrict(t) | Type::TypeTag(t) => {
                    t.type_id
                }
                Type::FuncProto(_) => return Ok(spell("function", &stars, &suffix)),
                other => {
                    let name = self.name(id, other.name_off())?;
                    return Ok(spell(&name, &stars, &suffix));
                }
            };
            id = next;
        }
        Err(invalid(
            id,
            format!("ends a pointer target chain of more than {MAX_CHAIN} types"),
        ))
    }
}

/// A record being described: its type id, kind ("struct" or "union"),
/// name and BTF.
struct RecordAt<'r> {
    id: u32,
    what: &'static str,
    name: &'r str,
    t: &'r Record,
}

fn spell(name: &str, stars: &str, suffix: &str) -> String {
    match (stars.is_empty(), suffix.is_empty()) {
        (true, true) => name.to_owned(),
        (false, true) => format!("{name} {stars}"),
        (true, false) => format!("{name}{suffix}"),
        (false, false) => format!("{name} ({stars}){suffix}"),
    }
}

/// Reads a BTF object by kernel id.
type BtfSource = dyn Fn(u32) -> SysResult<BtfInfo> + Send + Sync;
/// Reads the raw vmlinux BTF, the base of module BTF.
type BaseSource = dyn Fn() -> Result<Vec<u8>, BtfReadError> + Send + Sync;

/// Parsed BTF objects kept (a program's maps share its BTF object).
const CACHED_OBJECTS: usize = 8;
/// Most raw bytes of the BTF objects kept (parsed, they take several
/// times more).
const CACHED_OBJECT_BYTES: usize = 8 << 20;
/// Descriptions kept, by (BTF object, key type, value type).
const CACHED_DESCRIPTIONS: usize = 1024;

type Shared<T> = Result<Arc<T>, Arc<str>>;

struct LruEntry<T> {
    value: T,
    last_used: u64,
}

/// A small map that forgets its least recently used entries.
struct Lru<K, V> {
    entries: HashMap<K, LruEntry<V>>,
    tick: u64,
}

impl<K: std::hash::Hash + Eq + Copy, V: Clone> Lru<K, V> {
    fn new() -> Self {
        Self {
            entries: HashMap::new(),
            tick: 0,
        }
    }

    fn get(&mut self, key: &K) -> Option<V> {
        self.tick += 1;
        let slot = self.entries.get_mut(key)?;
        slot.last_used = self.tick;
        Some(slot.value.clone())
    }

    fn insert(&mut self, key: K, value: V) {
        self.tick += 1;
        self.entries.insert(
            key,
            LruEntry {
                value,
                last_used: self.tick,
            },
        );
    }

    /// Forgets the least recently used entries while `over` says so.
    fn evict_while(&mut self, mut over: impl FnMut(&HashMap<K, LruEntry<V>>) -> bool) {
        while over(&self.entries) {
            let Some(oldest) = self
                .entries
                .iter()
                .min_by_key(|(_, s)| s.last_used)
                .map(|(k, _)| *k)
            else {
                return;
            };
            self.entries.remove(&oldest);
        }
    }
}

struct Cached {
    /// Parsed BTF objects by kernel id, with their raw size.
    objects: Lru<u32, (Shared<Btf>, usize)>,
    /// Descriptions by (BTF object id, key type id, value type id).
    descriptions: Lru<(u32, u32, u32), Shared<MapTypes>>,
}

/// The types of maps, from their BTF, cached by BTF object.
///
/// Reading and parsing a BTF object blocks (syscalls, then up to a few
/// hundred milliseconds for large objects): call [`TypeCache::map_types`]
/// where blocking is allowed (`spawn_blocking`) unless the map's types were
/// described before.
pub struct TypeCache {
    read: Box<BtfSource>,
    read_base: Box<BaseSource>,
    vmlinux: OnceLock<Shared<Btf>>,
    cached: Mutex<Cached>,
}

impl fmt::Debug for TypeCache {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let (objects, descriptions) = match self.cached.lock() {
            Ok(c) => (c.objects.entries.len(), c.descriptions.entries.len()),
            Err(_) => (0, 0),
        };
        f.debug_struct("TypeCache")
            .field("objects", &objects)
            .field("descriptions", &descriptions)
            .finish_non_exhaustive()
    }
}

impl Default for TypeCache {
    fn default() -> Self {
        Self::new()
    }
}

/// vmlinux BTF, as the kernel exposes it.
fn read_vmlinux() -> Result<Vec<u8>, BtfReadError> {
    const PATH: &str = "/sys/kernel/btf/vmlinux";
    let too_large = |bytes: u64| BtfReadError::TooLarge { what: PATH, bytes };
    let io = |source| BtfReadError::Io { what: PATH, source };
    let len = std::fs::metadata(PATH).map_err(io)?.len();
    if len > MAX_BTF_SIZE as u64 {
        return Err(too_large(len));
    }
    let raw = std::fs::read(PATH).map_err(io)?;
    if raw.len() > MAX_BTF_SIZE {
        return Err(too_large(raw.len() as u64));
    }
    Ok(raw)
}

impl TypeCache {
    /// Reads BTF from the kernel.
    pub fn new() -> Self {
        Self::with_sources(Box::new(kernel::read_btf), Box::new(read_vmlinux))
    }

    fn with_sources(read: Box<BtfSource>, read_base: Box<BaseSource>) -> Self {
        Self {
            read,
            read_base,
            vmlinux: OnceLock::new(),
            cached: Mutex::new(Cached {
                objects: Lru::new(),
                descriptions: Lru::new(),
            }),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Cached> {
        // The cache holds no invariant a panic could break halfway.
        self.cached
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// The key and value types of the map `meta` describes, checked against
    /// its key and value sizes.
    pub fn map_types(&self, meta: &MapMeta) -> KnownTypes {
        if meta.btf_id == 0 {
            return KnownTypes::None;
        }
        let (key_id, value_id) = (meta.btf_key_type_id, meta.btf_value_type_id);
        if value_id == 0 {
            return KnownTypes::Unavailable(
                "the map's BTF gives no value type (the map was declared by sizes)".into(),
            );
        }
        let types = match self.describe_map(meta.btf_id, key_id, value_id) {
            Ok(types) => types,
            Err(why) => return KnownTypes::Unavailable(why),
        };
        let mismatch = |what: &str, t: &TypeInfo, expected: u32| {
            let name = if t.name.is_empty() {
                String::new()
            } else {
                format!(" {}", t.name)
            };
            KnownTypes::Unavailable(
                format!(
                    "the {what} type{name} is {} bytes but the map's {what}s are {expected} bytes",
                    t.size
                )
                .into(),
            )
        };
        if let Some(key) = &types.key
            && key.size != meta.key_size
        {
            return mismatch("key", key, meta.key_size);
        }
        if types.value.size != meta.value_size {
            return mismatch("value", &types.value, meta.value_size);
        }
        KnownTypes::Typed(types)
    }

    fn describe_map(&self, btf_id: u32, key_id: u32, value_id: u32) -> Shared<MapTypes> {
        let slot = (btf_id, key_id, value_id);
        if let Some(known) = self.lock().descriptions.get(&slot) {
            return known;
        }
        // A BTF object that cannot be read now is not remembered: it may be
        // readable later (ENOENT races a map being replaced).
        let btf = self.object(btf_id)?;
        let described = btf.and_then(|btf| {
            let one = |what: &str, id: u32| {
                describe(&btf, id)
                    .map_err(|e| Arc::from(format!("the {what} type cannot be described: {e}")))
            };
            let key = match key_id {
                0 => None,
                id => Some(one("key", id)?),
            };
            let value = one("value", value_id)?;
            MapTypes::new(key, value)
                .map(Arc::new)
                .map_err(|e| Arc::from(e.to_string()))
        });
        let mut cached = self.lock();
        cached.descriptions.insert(slot, described.clone());
        cached
            .descriptions
            .evict_while(|e| e.len() > CACHED_DESCRIPTIONS);
        described
    }

    /// The parsed BTF object `btf_id`: `Err` when it cannot be read now,
    /// `Ok(Err)` when it was read but cannot be parsed.
    fn object(&self, btf_id: u32) -> Result<Shared<Btf>, Arc<str>> {
        if let Some((known, _)) = self.lock().objects.get(&btf_id) {
            return Ok(known);
        }
        let info = (self.read)(btf_id).map_err(|e| -> Arc<str> {
            match e.errno() {
                Some(libc::EPERM) => NEEDS_CAP_SYS_ADMIN.into(),
                Some(libc::ENOENT) => format!("BTF object {btf_id} no longer exists").into(),
                _ => format!("cannot read BTF object {btf_id}: {e}").into(),
            }
        })?;
        let parsed = if info.kernel_btf && info.name != "vmlinux" {
            self.vmlinux().and_then(|base| {
                parse(&info.data, Some(&base)).map_err(|e| Arc::from(e.to_string()))
            })
        } else {
            parse(&info.data, None).map_err(|e| Arc::from(e.to_string()))
        }
        .map(Arc::new)
        .map_err(|e| Arc::from(format!("BTF object {btf_id}: {e}")));
        let raw_len = info.data.len();
        let mut cached = self.lock();
        cached.objects.insert(btf_id, (parsed.clone(), raw_len));
        cached.objects.evict_while(|e| {
            e.len() > CACHED_OBJECTS
                || (e.len() > 1
                    && e.values().map(|s| s.value.1).sum::<usize>() > CACHED_OBJECT_BYTES)
        });
        Ok(parsed)
    }

    /// vmlinux BTF, the base of kernel modules' split BTF: read once.
    fn vmlinux(&self) -> Shared<Btf> {
        self.vmlinux
            .get_or_init(|| {
                (self.read_base)()
                    .and_then(|raw| parse(&raw, None))
                    .map(Arc::new)
                    .map_err(|e| Arc::from(format!("vmlinux BTF: {e}")))
            })
            .clone()
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};

    use super::*;
    use bpfmap_kernel::{
        BtfBuilder, BtfMember, CreateMap, IntEncoding, MapType, OwnedBtf, OwnedMap, SyscallError,
    };

    use IntEncoding::{Bool, Char, Signed, Unsigned};

    // Expected descriptions, spelled out.

    fn ty(name: &str, size: u32, kind: Kind) -> TypeInfo {
        TypeInfo {
            name: name.into(),
            size,
            kind: Some(kind),
        }
    }

    fn int(name: &str, size: u32, signed: bool) -> TypeInfo {
        ty(
            name,
            size,
            Kind::Int(IntType {
                signed,
                big_endian: false,
            }),
        )
    }

    fn chr(name: &str, signed: bool) -> TypeInfo {
        ty(name, 1, Kind::Char(CharType { signed }))
    }

    fn float(name: &str, size: u32) -> TypeInfo {
        ty(name, size, Kind::Float(FloatType {}))
    }

    fn record(name: &str, size: u32, members: Vec<Member>) -> TypeInfo {
        ty(name, size, Kind::Struct(RecordType { members }))
    }

    fn union(name: &str, size: u32, members: Vec<Member>) -> TypeInfo {
        ty(name, size, Kind::Union(RecordType { members }))
    }

    fn m(name: &str, bit_offset: u32, t: TypeInfo) -> Member {
        bf(name, bit_offset, 0, t)
    }

    fn bf(name: &str, bit_offset: u32, bitfield_size: u32, t: TypeInfo) -> Member {
        Member {
            name: name.into(),
            bit_offset,
            bitfield_size,
            r#type: Some(t),
        }
    }

    fn array(name: &str, element: TypeInfo, length: u32) -> TypeInfo {
        let size = element.size * length;
        ty(
            name,
            size,
            Kind::Array(Box::new(ArrayType {
                element: Some(Box::new(element)),
                length,
            })),
        )
    }

    fn ptr(target: &str) -> TypeInfo {
        ty(
            "",
            8,
            Kind::Pointer(PointerType {
                target: target.into(),
            }),
        )
    }

    fn enumeration(name: &str, size: u32, signed: bool, values: &[(&str, i64)]) -> TypeInfo {
        let enumerators = values
            .iter()
            .map(|&(name, value)| Enumerator {
                name: name.into(),
                value,
            })
            .collect();
        ty(
            name,
            size,
            Kind::Enum(EnumType {
                signed,
                enumerators,
            }),
        )
    }

    /// Compares member by member first, so that a failure names the member.
    fn assert_same(got: &TypeInfo, expected: &TypeInfo) {
        if let (Some(Kind::Struct(g)), Some(Kind::Struct(e))) = (&got.kind, &expected.kind) {
            for (g, e) in g.members.iter().zip(&e.members) {
                assert_eq!(g, e, "member {}", e.name);
            }
        }
        assert_eq!(got, expected);
    }

    struct Rich {
        raw: Vec<u8>,
        key: u32,
        value: u32,
        ints: u32,
        u32_t: u32,
    }

    /// BTF with every case the description handles, and a value struct
    /// holding them all (272 bytes).
    fn rich_btf() -> Rich {
        let mut b = BtfBuilder::new();
        let s8 = b.add_int("signed char", 1, Signed);
        let u8_ = b.add_int("unsigned char", 1, Unsigned);
        let s16 = b.add_int("short", 2, Signed);
        let u16_ = b.add_int("unsigned short", 2, Unsigned);
        let s32 = b.add_int("int", 4, Signed);
        let u32_ = b.add_int("unsigned int", 4, Unsigned);
        let s64 = b.add_int("long long", 8, Signed);
        let u64_ = b.add_int("unsigned long long", 8, Unsigned);
        let s128 = b.add_int("__int128", 16, Signed);
        let u128_ = b.add_int("unsigned __int128", 16, Unsigned);
        let boolean = b.add_int("_Bool", 1, Bool);
        let ch = b.add_int("char", 1, Signed);
        let char8 = b.add_int("char8", 1, Char);
        let f32_ = b.add_float("float", 4);
        let f64_ = b.add_float("double", 8);
        let f128 = b.add_float("long double", 16);
        let u16_t = b.add_typedef("__u16", u16_);
        let u32_t = b.add_typedef("__u32", u32_);
        let s32_t = b.add_typedef("__s32", s32);
        let u64_t = b.add_typedef("__u64", u64_);

        let ints = b.add_struct(
            "ints",
            64,
            &[
                BtfMember::new("s8", s8, 0),
                BtfMember::new("u8", u8_, 8),
                BtfMember::new("s16", s16, 16),
                BtfMember::new("u16", u16_, 32),
                BtfMember::new("s32", s32, 64),
                BtfMember::new("u32", u32_, 96),
                BtfMember::new("s64", s64, 128),
                BtfMember::new("u64", u64_, 192),
                BtfMember::new("s128", s128, 256),
                BtfMember::new("u128", u128_, 384),
            ],
        );
        let name = b.add_array(ch, 16);
        let row = b.add_array(ch, 3);
        let grid = b.add_array(row, 2);
        let text = b.add_struct(
            "text",
            32,
            &[
                BtfMember::new("flag", boolean, 0),
                BtfMember::new("c", ch, 8),
                BtfMember::new("c8", char8, 16),
                BtfMember::new("name", name, 24),
                BtfMember::new("grid", grid, 152),
            ],
        );
        let num = b.add_union(
            "num",
            8,
            &[
                BtfMember::new("u", u64_t, 0),
                BtfMember::new("s", s32_t, 0),
                BtfMember::new("d", f64_, 0),
            ],
        );
        let halves = b.add_struct(
            "",
            4,
            &[
                BtfMember::new("lo", u16_t, 0),
                BtfMember::new("hi", u16_t, 16),
            ],
        );
        let either = b.add_union(
            "",
            4,
            &[BtfMember::new("x", u32_t, 0), BtfMember::new("", halves, 0)],
        );
        let anon = b.add_struct(
            "anon",
            8,
            &[BtfMember::new("", either, 0), BtfMember::new("f", f32_, 32)],
        );
        let point = b.add_struct(
            "point",
            8,
            &[
                BtfMember::new("x", s32_t, 0),
                BtfMember::new("y", s32_t, 32),
            ],
        );
        let points = b.add_array(point, 3);
        let level = b.add_enum("level", 4, true, &[("LOW", -1), ("MID", 0), ("HIGH", 1)]);
        let small = b.add_enum("small", 1, false, &[("A", 1), ("B", 200)]);
        let big = b.add_enum64("big", 8, false, &[("ONE", 1), ("HUGE", u64::MAX)]);
        let neg = b.add_enum64("neg", 8, true, &[("MINUS", -5i64 as u64)]);
        let bits = b.add_struct(
            "bits",
            8,
            &[
                BtfMember::bitfield("a", u32_t, 0, 3),
                BtfMember::bitfield("b", s32, 3, 5),
                BtfMember::bitfield("c", level, 8, 2),
                BtfMember::new("d", u32_t, 32),
            ],
        );
        let c_u32 = b.add_const(u32_t);
        let cv_u32 = b.add_volatile(c_u32);
        let reg = b.add_typedef("reg_t", cv_u32);
        let reg2 = b.add_typedef("reg2_t", reg);
        let node = b.next_id() + 1;
        let node_ptr = b.add_ptr(node);
        assert_eq!(
            b.add_struct(
                "node",
                16,
                &[
                    BtfMember::new("next", node_ptr, 0),
                    BtfMember::new("v", u32_t, 64),
                ],
            ),
            node
        );
        let void_ptr = b.add_ptr(0);
        let opaque = b.add_fwd("opaque", false);
        let opaque_ptr = b.add_ptr(opaque);
        let char_ptr = b.add_ptr(ch);
        let argv = b.add_ptr(char_ptr);
        let c_char = b.add_const(ch);
        let str_ptr = b.add_ptr(c_char);
        let value = b.add_struct(
            "all",
            272,
            &[
                BtfMember::new("ints", ints, 0),
                BtfMember::new("text", text, 512),
                BtfMember::new("num", num, 768),
                BtfMember::new("anon", anon, 832),
                BtfMember::new("pts", points, 896),
                BtfMember::new("level", level, 1088),
                BtfMember::new("small", small, 1120),
                BtfMember::new("big", big, 1152),
                BtfMember::new("neg", neg, 1216),
                BtfMember::new("bits", bits, 1280),
                BtfMember::new("reg", reg, 1344),
                BtfMember::new("creg", c_u32, 1376),
                BtfMember::new("reg2", reg2, 1408),
                BtfMember::new("node", node, 1472),
                BtfMember::new("p", void_ptr, 1600),
                BtfMember::new("op", opaque_ptr, 1664),
                BtfMember::new("argv", argv, 1728),
                BtfMember::new("s", str_ptr, 1792),
                BtfMember::new("f", f32_, 1856),
                BtfMember::new("d", f64_, 1920),
                BtfMember::new("ld", f128, 2048),
            ],
        );
        Rich {
            raw: b.to_bytes(),
            key: u64_t,
            value,
            ints,
            u32_t,
        }
    }

    fn expected_ints() -> TypeInfo {
        record(
            "ints",
            64,
            vec![
                m("s8", 0, int("signed char", 1, true)),
                m("u8", 8, int("unsigned char", 1, false)),
                m("s16", 16, int("short", 2, true)),
                m("u16", 32, int("unsigned short", 2, false)),
                m("s32", 64, int("int", 4, true)),
                m("u32", 96, int("unsigned int", 4, false)),
                m("s64", 128, int("long long", 8, true)),
                m("u64", 192, int("unsigned long long", 8, false)),
                m("s128", 256, int("__int128", 16, true)),
                m("u128", 384, int("unsigned __int128", 16, false)),
            ],
        )
    }

    fn expected_rich_value() -> TypeInfo {
        let u32_t = || int("__u32", 4, false);
        let s32_t = || int("__s32", 4, true);
        let level = || enumeration("level", 4, true, &[("LOW", -1), ("MID", 0), ("HIGH", 1)]);
        record(
            "all",
            272,
            vec![
                m("ints", 0, expected_ints()),
                m(
                    "text",
                    512,
                    record(
                        "text",
                        32,
                        vec![
                            m("flag", 0, ty("_Bool", 1, Kind::Bool(BoolType {}))),
                            m("c", 8, chr("char", true)),
                            m("c8", 16, chr("char8", false)),
                            m("name", 24, array("", chr("char", true), 16)),
                            m("grid", 152, array("", array("", chr("char", true), 3), 2)),
                        ],
                    ),
                ),
                m(
                    "num",
                    768,
                    union(
                        "num",
                        8,
                        vec![
                            m("u", 0, int("__u64", 8, false)),
                            m("s", 0, s32_t()),
                            m("d", 0, float("double", 8)),
                        ],
                    ),
                ),
                m(
                    "anon",
                    832,
                    record(
                        "anon",
                        8,
                        vec![
                            m(
                                "",
                                0,
                                union(
                                    "",
                                    4,
                                    vec![
                                        m("x", 0, u32_t()),
                                        m(
                                            "",
                                            0,
                                            record(
                                                "",
                                                4,
                                                vec![
                                                    m("lo", 0, int("__u16", 2, false)),
                                                    m("hi", 16, int("__u16", 2, false)),
                                                ],
                                            ),
                                        ),
                                    ],
                                ),
                            ),
                            m("f", 32, float("float", 4)),
                        ],
                    ),
                ),
                m(
                    "pts",
                    896,
                    array(
                        "",
                        record("point", 8, vec![m("x", 0, s32_t()), m("y", 32, s32_t())]),
                        3,
                    ),
                ),
                m("level", 1088, level()),
                m(
                    "small",
                    1120,
                    enumeration("small", 1, false, &[("A", 1), ("B", 200)]),
                ),
                m(
                    "big",
                    1152,
                    enumeration("big", 8, false, &[("ONE", 1), ("HUGE", -1)]),
                ),
                m("neg", 1216, enumeration("neg", 8, true, &[("MINUS", -5)])),
                m(
                    "bits",
                    1280,
                    record(
                        "bits",
                        8,
                        vec![
                            bf("a", 0, 3, u32_t()),
                            bf("b", 3, 5, int("int", 4, true)),
                            bf("c", 8, 2, level()),
                            m("d", 32, u32_t()),
                        ],
                    ),
                ),
                m("reg", 1344, int("reg_t", 4, false)),
                m("creg", 1376, u32_t()),
                m("reg2", 1408, int("reg2_t", 4, false)),
                m(
                    "node",
                    1472,
                    record(
                        "node",
                        16,
                        vec![m("next", 0, ptr("node")), m("v", 64, u32_t())],
                    ),
                ),
                m("p", 1600, ptr("void")),
                m("op", 1664, ptr("opaque")),
                m("argv", 1728, ptr("char *")),
                m("s", 1792, ptr("char")),
                m("f", 1856, float("float", 4)),
                m("d", 1920, float("double", 8)),
                m(
                    "ld",
                    2048,
                    ty(
                        "long double",
                        16,
                        Kind::Opaque(OpaqueType {
                            reason: "16-byte floating-point type".into(),
                        }),
                    ),
                ),
            ],
        )
    }

    fn load(raw: &[u8]) -> OwnedBtf {
        OwnedBtf::load(raw).unwrap_or_else(|e| {
            panic!("BPF_BTF_LOAD refused the test BTF ({e}); these tests need root and BPF")
        })
    }

    fn typed_map(
        btf: &OwnedBtf,
        map_type: MapType,
        key_size: u32,
        value_size: u32,
        key: u32,
        value: u32,
    ) -> OwnedMap {
        OwnedMap::create(&CreateMap {
            map_type: map_type.0,
            key_size,
            value_size,
            max_entries: 4,
            name: "btf_test",
            btf: Some(btf.for_map(key, value)),
            ..Default::default()
        })
        .unwrap_or_else(|e| panic!("cannot create a typed {map_type} map: {e}"))
    }

    fn typed(types: KnownTypes) -> Arc<MapTypes> {
        match types {
            KnownTypes::Typed(t) => t,
            other => panic!("expected types, got {other:?}"),
        }
    }

    #[test]
    fn map_types_read_back_from_the_kernel_describe_every_case() {
        let rich = rich_btf();
        let btf = load(&rich.raw);
        let hash = typed_map(&btf, MapType::HASH, 8, 272, rich.key, rich.value);
        let per_cpu = typed_map(&btf, MapType::PERCPU_ARRAY, 4, 64, rich.u32_t, rich.ints);
        drop(btf);

        let cache = TypeCache::new();
        let t = typed(cache.map_types(hash.meta()));
        assert_eq!(t.key, Some(int("__u64", 8, false)));
        assert_same(&t.value, &expected_rich_value());

        let t = typed(cache.map_types(per_cpu.meta()));
        assert_eq!(t.key, Some(int("__u32", 4, false)));
        assert_same(&t.value, &expected_ints());
    }

    #[test]
    fn legacy_bitfields_take_their_width_from_their_integer_type() {
        let mut b = BtfBuilder::new();
        let u32_ = b.add_int("unsigned int", 4, Unsigned);
        let three = b.add_int_bits("unsigned int", 4, Unsigned, 0, 3);
        let five = b.add_int_bits("unsigned int", 4, Unsigned, 0, 5);
        let legacy = b.add_struct(
            "legacy",
            8,
            &[
                BtfMember::new("a", three, 0),
                BtfMember::new("b", five, 3),
                BtfMember::new("c", u32_, 32),
            ],
        );
        let btf = load(&b.to_bytes());
        let map = typed_map(&btf, MapType::ARRAY, 4, 8, u32_, legacy);
        let t = typed(TypeCache::new().map_types(map.meta()));
        let uint = || int("unsigned int", 4, false);
        assert_same(
            &t.value,
            &record(
                "legacy",
                8,
                vec![
                    bf("a", 0, 3, uint()),
                    bf("b", 3, 5, uint()),
                    m("c", 32, uint()),
                ],
            ),
        );
    }

    /// A hash map's description: its BTF, its sizes and its type ids.
    fn meta(btf_id: u32, key_size: u32, value_size: u32, key: u32, value: u32) -> MapMeta {
        MapMeta {
            id: 1,
            name: "fake".into(),
            map_type: MapType::HASH,
            key_size,
            value_size,
            max_entries: 1,
            flags: 0,
            btf_id,
            btf_key_type_id: key,
            btf_value_type_id: value,
            possible_cpus: 1,
        }
    }

    /// A cache reading `raw` for every BTF object and `base` for vmlinux,
    /// counting the reads.
    fn fake_cache(
        raw: Vec<u8>,
        kernel_btf: bool,
        base: Option<Vec<u8>>,
    ) -> (TypeCache, Arc<AtomicUsize>) {
        let reads = Arc::new(AtomicUsize::new(0));
        let (counter, base_counter) = (reads.clone(), reads.clone());
        let cache = TypeCache::with_sources(
            Box::new(move |id| {
                counter.fetch_add(1, Ordering::Relaxed);
                Ok(BtfInfo {
                    id,
                    name: if kernel_btf {
                        "a_module".into()
                    } else {
                        String::new()
                    },
                    kernel_btf,
                    data: raw.clone(),
                })
            }),
            Box::new(move || {
                base_counter.fetch_add(1, Ordering::Relaxed);
                base.clone().ok_or(BtfReadError::NoBase("no vmlinux here"))
            }),
        );
        (cache, reads)
    }

    fn failing_cache(errno: i32) -> TypeCache {
        TypeCache::with_sources(
            Box::new(move |_| {
                Err(SyscallError {
                    call: "BPF_BTF_GET_FD_BY_ID",
                    io_error: std::io::Error::from_raw_os_error(errno),
                })
            }),
            Box::new(|| Err(BtfReadError::NoBase("unused"))),
        )
    }

    fn unavailable(types: KnownTypes) -> String {
        match types {
            KnownTypes::Unavailable(why) => why.to_string(),
            other => panic!("expected a reason, got {other:?}"),
        }
    }

    #[test]
    fn map_types_say_why_they_are_missing() {
        let rich = rich_btf();
        let (cache, reads) = fake_cache(rich.raw.clone(), false, None);
        assert!(matches!(
            cache.map_types(&meta(0, 8, 272, 0, 0)),
            KnownTypes::None
        ));
        let why = unavailable(cache.map_types(&meta(7, 8, 272, 0, 0)));
        assert!(why.contains("no value type"), "{why}");
        assert_eq!(
            reads.load(Ordering::Relaxed),
            0,
            "nothing to read for these"
        );

        let why = unavailable(cache.map_types(&meta(7, 4, 272, rich.key, rich.value)));
        assert_eq!(
            why,
            "the key type __u64 is 8 bytes but the map's keys are 4 bytes"
        );
        let why = unavailable(cache.map_types(&meta(7, 8, 270, rich.key, rich.value)));
        assert_eq!(
            why,
            "the value type all is 272 bytes but the map's values are 270 bytes"
        );
        typed(cache.map_types(&meta(7, 8, 272, rich.key, rich.value)));
        typed(cache.map_types(&meta(7, 8, 64, rich.key, rich.ints)));
        assert_eq!(reads.load(Ordering::Relaxed), 1, "one read per BTF object");

        let why = unavailable(failing_cache(libc::EPERM).map_types(&meta(7, 8, 272, 1, 2)));
        assert_eq!(why, NEEDS_CAP_SYS_ADMIN);
        let why = unavailable(failing_cache(libc::ENOENT).map_types(&meta(7, 8, 272, 1, 2)));
        assert_eq!(why, "BTF object 7 no longer exists");

        let why = unavailable(cache.map_types(&meta(8, 8, 272, rich.key, 9999)));
        assert!(
            why.starts_with("the value type cannot be described: type [9999] does not exist"),
            "{why}"
        );
    }

    #[test]
    fn keyless_maps_have_a_value_type_only() {
        let rich = rich_btf();
        let (cache, _) = fake_cache(rich.raw, false, None);
        let t = typed(cache.map_types(&meta(3, 0, 64, 0, rich.ints)));
        assert_eq!(t.key, None);
        assert_eq!(t.value, expected_ints());
    }

    /// A base (vmlinux-like) and a split object on top of it whose types
    /// refer to the base's.
    fn split_pair() -> (Vec<u8>, Vec<u8>, u32) {
        let mut base = BtfBuilder::new();
        let u32_ = base.add_int("unsigned int", 4, Unsigned);
        let u32_t = base.add_typedef("__u32", u32_);
        let u16_ = base.add_int("unsigned short", 2, Unsigned);
        let mut split = BtfBuilder::new_split(base.next_id() - 1, base.str_len());
        let u16_t = split.add_typedef("__u16", u16_);
        let s = split.add_struct(
            "split_s",
            8,
            &[
                BtfMember::new("x", u32_t, 0),
                BtfMember::new("y", u16_t, 32),
                BtfMember::new("z", u16_, 48),
            ],
        );
        (base.to_bytes(), split.to_bytes(), s)
    }

    fn expected_split() -> TypeInfo {
        record(
            "split_s",
            8,
            vec![
                m("x", 0, int("__u32", 4, false)),
                m("y", 32, int("__u16", 2, false)),
                m("z", 48, int("unsigned short", 2, false)),
            ],
        )
    }

    #[test]
    fn split_btf_refers_to_its_base() {
        let (base, split, s) = split_pair();
        let base_btf = parse(&base, None).unwrap();
        let btf = parse(&split, Some(&base_btf)).unwrap();
        assert_eq!(describe(&btf, s).unwrap(), expected_split());
        assert!(
            parse(&split, None).is_err(),
            "its names are in the base's string section"
        );

        // Module BTF from the kernel is parsed on vmlinux, read once.
        let (cache, reads) = fake_cache(split.clone(), true, Some(base));
        for id in [1, 2] {
            let t = typed(cache.map_types(&meta(id, 4, 8, 1, s)));
            assert_eq!(t.value, expected_split());
        }
        assert_eq!(
            reads.load(Ordering::Relaxed),
            2 + 1,
            "two objects, one base"
        );
        let (cache, _) = fake_cache(split, true, None);
        let why = unavailable(cache.map_types(&meta(1, 4, 8, 1, s)));
        assert!(why.contains("vmlinux BTF: no vmlinux here"), "{why}");
    }

    fn describe_raw(b: &BtfBuilder, id: u32) -> Result<TypeInfo, DescribeError> {
        describe(&parse(&b.to_bytes(), None).expect("parse"), id)
    }

    #[test]
    fn integers_through_network_order_typedefs_are_big_endian() {
        let mut b = BtfBuilder::new();
        let u16_ = b.add_int("unsigned short", 2, IntEncoding::Unsigned);
        let u32_ = b.add_int("unsigned int", 4, IntEncoding::Unsigned);
        let host16 = b.add_typedef("__u16", u16_);
        let host32 = b.add_typedef("__u32", u32_);
        let be16 = b.add_typedef("__be16", host16);
        let be32 = b.add_typedef("__be32", host32);
        let sum16 = b.add_typedef("__sum16", host16);
        // A typedef of a network-order typedef is still in network order.
        let port = b.add_typedef("port_t", be16);
        let tuple = b.add_struct(
            "ipv4_ct_tuple",
            12,
            &[
                BtfMember::new("daddr", be32, 0),
                BtfMember::new("dport", port, 32),
                BtfMember::new("check", sum16, 48),
                BtfMember::new("len", host16, 64),
                BtfMember::new("seq", host32, 64),
            ],
        );
        let info = describe_raw(&b, tuple).expect("described");
        let Some(Kind::Struct(r)) = info.kind else {
            panic!("a struct: {info:?}")
        };
        let order: Vec<(String, String, bool)> = r
            .members
            .iter()
            .map(|m| {
                let t = m.r#type.as_ref().unwrap();
                let Some(Kind::Int(int)) = &t.kind else {
                    panic!("an int: {t:?}")
                };
                (m.name.clone(), t.name.clone(), int.big_endian)
            })
            .collect();
        let expect = |n: &str, t: &str, be: bool| (n.to_owned(), t.to_owned(), be);
        assert_eq!(
            order,
            [
                expect("daddr", "__be32", true),
                expect("dport", "port_t", true),
                expect("check", "__sum16", true),
                expect("len", "__u16", false),
                expect("seq", "__u32", false),
            ]
        );
    }

    #[test]
    fn loops_not_through_a_pointer_are_refused() {
        let mut b = BtfBuilder::new();
        let a = b.next_id();
        b.add_typedef("a_t", a + 1);
        b.add_typedef("b_t", a);
        assert_eq!(describe_raw(&b, a), Err(DescribeError::Loop(a)));
        assert_eq!(
            DescribeError::Loop(a).to_string(),
            format!("type graph loops at [{a}]")
        );

        let mut b = BtfBuilder::new();
        let s = b.next_id();
        b.add_struct("s", 4, &[BtfMember::new("me", s, 0)]);
        assert_eq!(describe_raw(&b, s), Err(DescribeError::Loop(s)));

        let mut b = BtfBuilder::new();
        let s = b.next_id() + 1;
        let arr = b.add_array(s, 1);
        b.add_struct("s", 4, &[BtfMember::new("me", arr, 0)]);
        assert_eq!(describe_raw(&b, s), Err(DescribeError::Loop(s)));

        // A pointer loop in a pointer's target name.
        let mut b = BtfBuilder::new();
        let p = b.next_id();
        b.add_ptr(p + 1);
        b.add_ptr(p);
        let s = b.add_struct("s", 8, &[BtfMember::new("p", p, 0)]);
        assert!(matches!(describe_raw(&b, s), Err(DescribeError::Loop(_))));
    }

    /// `levels` structs, each holding the next, around an int.
    fn nested(levels: u32) -> (BtfBuilder, u32) {
        let mut b = BtfBuilder::new();
        let mut inner = b.add_int("int", 4, Signed);
        for _ in 0..levels {
            inner = b.add_struct("n", 4, &[BtfMember::new("x", inner, 0)]);
        }
        (b, inner)
    }

    #[test]
    fn nesting_is_bounded() {
        let (b, top) = nested(MAX_DEPTH as u32 - 1);
        let mut t = describe_raw(&b, top).expect("24 levels");
        let mut depth = 1;
        while let Some(Kind::Struct(r)) = t.kind {
            t = r.members[0].r#type.clone().unwrap();
            depth += 1;
        }
        assert_eq!(depth, MAX_DEPTH);
        let (b, top) = nested(MAX_DEPTH as u32);
        assert!(matches!(
            describe_raw(&b, top),
            Err(DescribeError::TooDeep(_))
        ));

        // Twenty levels of two members each: a million nodes.
        let mut b = BtfBuilder::new();
        let mut inner = b.add_int("int", 4, Signed);
        for level in 0..20 {
            let size = 4 << (level + 1);
            inner = b.add_struct(
                "fan",
                size,
                &[
                    BtfMember::new("l", inner, 0),
                    BtfMember::new("r", inner, size * 4),
                ],
            );
        }
        assert!(matches!(
            describe_raw(&b, inner),
            Err(DescribeError::TooLarge(_))
        ));
    }

    #[test]
    fn layouts_that_do_not_fit_are_refused() {
        fn refused(b: &BtfBuilder, id: u32, needle: &str) {
            match describe_raw(b, id) {
                Err(e) => assert!(e.to_string().contains(needle), "{e} (wanted {needle:?})"),
                Ok(t) => panic!("{t:?} was accepted (wanted {needle:?})"),
            }
        }
        let base = || {
            let mut b = BtfBuilder::new();
            let int = b.add_int("int", 4, Signed);
            (b, int)
        };

        let (mut b, int) = base();
        let s = b.add_struct("s", 4, &[BtfMember::new("x", int, 32)]);
        refused(
            &b,
            s,
            "member \"x\" (bits 32..64) lies outside the struct's 4 bytes",
        );

        let (mut b, int) = base();
        let s = b.add_struct("s", 4, &[BtfMember::bitfield("x", int, 30, 3)]);
        refused(&b, s, "lies outside");

        let (mut b, int) = base();
        let s = b.add_struct("s", 8, &[BtfMember::bitfield("x", int, 0, 33)]);
        refused(&b, s, "does not fit its 4-byte type");

        let (mut b, int) = base();
        let inner = b.add_struct("inner", 4, &[BtfMember::new("x", int, 0)]);
        let s = b.add_struct("s", 4, &[BtfMember::bitfield("x", inner, 0, 3)]);
        refused(&b, s, "not of an integer or enum type");

        let (mut b, int) = base();
        let s = b.add_struct(
            "s",
            8,
            &[
                BtfMember::bitfield("f", int, 0, 1),
                BtfMember::new("x", int, 4),
            ],
        );
        refused(&b, s, "at bit 4 is not byte-aligned");

        let (mut b, _) = base();
        let long = b.add_int("long", 8, Signed);
        let arr = b.add_array(long, 1 << 29);
        refused(&b, arr, "its size overflows");
        let arr = b.add_array(long, 1 << 22);
        refused(&b, arr, "more than the 16777216 described");

        let (mut b, _) = base();
        let empty = b.add_struct("empty", 0, &[]);
        let many = b.add_array(empty, 1 << 20);
        refused(&b, many, "zero-sized elements");

        let (mut b, _) = base();
        let e = b.add_enum("e", 3, false, &[("A", 1)]);
        refused(&b, e, "is an enum of 3 bytes");
        let i = b.add_int("odd", 3, Unsigned);
        refused(&b, i, "(odd) is an integer of 3 bytes");

        let (mut b, int) = base();
        let fwd = b.add_fwd("later", false);
        let s = b.add_struct(
            "s",
            4,
            &[BtfMember::new("x", fwd, 0), BtfMember::new("y", int, 0)],
        );
        refused(&b, s, "forward declaration of struct later");
        refused(&b, 0, "is void");

        let (mut b, int) = base();
        let proto = b.add_func_proto(int, &[("a", int)]);
        let func = b.add_func("main", proto, 1);
        let var = b.add_var("counter", int, 1);
        let past = b.add_datasec(".data", 4, &[(var, 2, 4)]);
        let not_var = b.add_datasec(".bss", 4, &[(int, 0, 4)]);
        refused(&b, func, "is a func (\"main\"), not a data type");
        refused(&b, var, "is a var (\"counter\"), not a data type");
        refused(
            &b,
            past,
            "variable \"counter\" (4 bytes, 4 in the section) at 2 does not fit the section's 4 bytes",
        );
        refused(&b, not_var, "which is not a variable");
        refused(&b, 999, "type [999] does not exist");
    }

    #[test]
    fn a_global_data_section_is_an_object_of_its_variables() {
        let mut b = BtfBuilder::new();
        let u32_ = b.add_int("unsigned int", 4, Unsigned);
        let u64_ = b.add_int("unsigned long long", 8, Unsigned);
        let hits = b.add_var("hits", u64_, 1);
        let limit = b.add_var("limit", u32_, 1);
        let sec = b.add_datasec(".bss", 16, &[(hits, 0, 8), (limit, 8, 4)]);
        let info = describe_raw(&b, sec).expect("described");
        assert_eq!(info.name, ".bss");
        assert_eq!(info.size, 16);
        let layout = bpfmap_proto::typed::Layout::new(&info, "value").expect("a layout");
        let mut bytes = 7u64.to_le_bytes().to_vec();
        bytes.extend_from_slice(&100u32.to_le_bytes());
        bytes.extend_from_slice(&[0; 4]);
        let mut json = Vec::new();
        layout.write_json(&bytes, &mut json);
        assert_eq!(
            String::from_utf8(json).unwrap(),
            r#"{"hits":"7","limit":100}"#
        );
    }

    #[test]
    fn type_tags_and_enumerators_are_bounded_too() {
        let mut b = BtfBuilder::new();
        let i32_ = b.add_int("int", 4, Signed);
        let tagged = b.add_type_tag("user", i32_);
        let p = b.add_ptr(tagged);
        let s = b.add_struct(
            "s",
            12,
            &[BtfMember::new("t", tagged, 0), BtfMember::new("p", p, 32)],
        );
        assert_eq!(
            describe_raw(&b, s).unwrap(),
            record(
                "s",
                12,
                vec![m("t", 0, int("int", 4, true)), m("p", 32, ptr("int"))]
            )
        );

        let names: Vec<String> = (0..=MAX_ENUMERATORS).map(|i| format!("E{i}")).collect();
        let values: Vec<(&str, i64)> = names.iter().map(|n| (n.as_str(), 0)).collect();
        let mut b = BtfBuilder::new();
        let e = b.add_enum("e", 4, false, &values);
        let err = describe_raw(&b, e).unwrap_err().to_string();
        assert!(err.contains("4097 enumerators"), "{err}");

        let mut b = BtfBuilder::new();
        let mut id = b.add_int("int", 4, Signed);
        for _ in 0..=MAX_CHAIN {
            id = b.add_const(id);
        }
        let err = describe_raw(&b, id).unwrap_err().to_string();
        assert!(err.contains("typedefs and modifiers"), "{err}");
    }

    #[test]
    fn headers_that_lie_about_their_sections_are_refused() {
        let raw = rich_btf().raw;
        let mut lying = raw.clone();
        // str_len past the end.
        lying[20..24].copy_from_slice(&(u32::MAX / 2).to_ne_bytes());
        let e = parse(&lying, None).expect_err("refused").to_string();
        assert!(e.contains("string section"), "{e}");
        let mut lying = raw.clone();
        lying[4..8].copy_from_slice(&4u32.to_ne_bytes());
        assert!(parse(&lying, None).is_err());
        let mut swapped = raw;
        swapped[0..2].copy_from_slice(&0xeb9fu16.to_be_bytes());
        if cfg!(target_endian = "little") {
            let e = parse(&swapped, None).err().unwrap().to_string();
            assert!(e.contains("bad magic"), "{e}");
        }
        assert!(
            parse(&[], None)
                .err()
                .unwrap()
                .to_string()
                .contains("shorter than its header")
        );
    }

    /// Parses and describes every type id of `raw`: a panic in the parser
    /// or here fails the test.
    fn describe_everything(raw: &[u8]) {
        let Ok(btf) = parse(raw, None) else {
            return;
        };
        for id in 0..200 {
            let _ = describe(&btf, id);
        }
    }

    #[test]
    fn truncated_and_corrupted_btf_never_panics() {
        let raw = rich_btf().raw;
        for len in 0..raw.len() {
            describe_everything(&raw[..len]);
        }
        // Truncated inside, with the header's lengths shrunk to match.
        for len in (24..raw.len()).step_by(7) {
            let mut cut = raw[..len].to_vec();
            let type_len = u32::from_ne_bytes(cut[12..16].try_into().unwrap());
            let body = len as u32 - 24;
            let (t, s) = if body < type_len {
                (body, 0)
            } else {
                (type_len, body - type_len)
            };
            cut[12..16].copy_from_slice(&t.to_ne_bytes());
            cut[16..20].copy_from_slice(&t.to_ne_bytes());
            cut[20..24].copy_from_slice(&s.to_ne_bytes());
            describe_everything(&cut);
        }
        // Random corruption, reproducible (xorshift).
        let mut state: u64 = 0x2545_f491_4f6c_dd1d;
        let mut next = move || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state
        };
        for _ in 0..3000 {
            let mut bad = raw.clone();
            for _ in 0..1 + next() % 4 {
                let at = 24 + (next() as usize) % (raw.len() - 24);
                bad[at] = next() as u8;
            }
            describe_everything(&bad);
        }
    }

    #[test]
    fn a_map_keeps_its_btf_readable_after_the_loader_closed_it() {
        let rich = rich_btf();
        let btf = load(&rich.raw);
        let info = btf.info().expect("info");
        let map = typed_map(&btf, MapType::HASH, 8, 272, rich.key, rich.value);
        drop(btf);
        assert_eq!(map.meta().btf_id, info.id);
        let read = kernel::read_btf(info.id).expect("read by id");
        assert_eq!(read.data, rich.raw);
        assert_eq!(
            (read.id, read.kernel_btf, read.name.as_str()),
            (info.id, false, "")
        );
    }

    #[test]
    fn legacy_bitfields_are_read_as_the_kernel_reads_them() {
        let mut b = BtfBuilder::new();
        let u8_ = b.add_int("unsigned char", 1, Unsigned);
        let u32_ = b.add_int("unsigned int", 4, Unsigned);
        // Six bits, four bits into the integer's bytes.
        let shifted = b.add_int_bits("unsigned int", 4, Unsigned, 4, 6);
        let two = b.add_int_bits("unsigned char", 1, Unsigned, 0, 2);
        let two_t = b.add_typedef("two_t", two);
        let c_two = b.add_const(two_t);
        let s = b.add_struct(
            "legacy",
            8,
            &[
                BtfMember::new("a", shifted, 0),
                BtfMember::new("b", c_two, 16),
                // A whole integer off a byte boundary: a bitfield of its bits.
                BtfMember::new("c", u8_, 19),
                BtfMember::new("d", u32_, 32),
            ],
        );
        assert_same(
            &describe_raw(&b, s).unwrap(),
            &record(
                "legacy",
                8,
                vec![
                    bf("a", 4, 6, int("unsigned int", 4, false)),
                    bf("b", 16, 2, int("two_t", 1, false)),
                    bf("c", 19, 8, int("unsigned char", 1, false)),
                    m("d", 32, int("unsigned int", 4, false)),
                ],
            ),
        );
        // In a union too.
        let u = b.add_union("u", 4, &[BtfMember::new("x", shifted, 0)]);
        assert_eq!(
            describe_raw(&b, u).unwrap(),
            union("u", 4, vec![bf("x", 4, 6, int("unsigned int", 4, false))])
        );

        let refused = |b: &BtfBuilder, id: u32, needle: &str| {
            let e = describe_raw(b, id).unwrap_err().to_string();
            assert!(e.contains(needle), "{e} (wanted {needle:?})");
        };
        // Enums are never bitfields without kind_flag (as in the kernel).
        let e = b.add_enum("e", 4, false, &[("A", 1)]);
        let s = b.add_struct("s", 8, &[BtfMember::new("e", e, 3)]);
        refused(&b, s, "member \"e\" at bit 3 is not byte-aligned");
        // Bits past the struct, wider than the type, or none.
        let s = b.add_struct("s", 4, &[BtfMember::new("a", shifted, 24)]);
        refused(&b, s, "(bits 28..34) lies outside the struct's 4 bytes");
        let wide = b.add_int_bits("unsigned int", 4, Unsigned, 0, 40);
        let s = b.add_struct("s", 8, &[BtfMember::new("w", wide, 0)]);
        refused(
            &b,
            s,
            "bitfield \"w\" of 40 bits does not fit its 4-byte type",
        );
        let none = b.add_int_bits("unsigned int", 4, Unsigned, 0, 0);
        let s = b.add_struct("s", 8, &[BtfMember::new("z", none, 0)]);
        refused(&b, s, "of an integer type of 0 bits");
        let s = b.add_struct("s", 8, &[BtfMember::new("far", shifted, u32::MAX - 1)]);
        refused(&b, s, "lies past bit 4294967295");
    }

    #[test]
    fn the_cache_can_be_shared_between_threads() {
        fn shared<T: Send + Sync>() {}
        shared::<TypeCache>();
        shared::<KnownTypes>();
    }
}
