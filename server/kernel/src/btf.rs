//! A BTF reader: raw BTF (the kernel's type format) parsed into [`Type`]s.
//!
//! The layout is that of `include/uapi/linux/btf.h`: a 24-byte header, the
//! type section (one record per type, ids implicit: the n-th record is id n,
//! 0 is void), then the string section (NUL-terminated names, referred to by
//! offset). The data is in this host's byte order, the only one the kernel
//! hands out; BTF in the other order is refused (bad magic).
//!
//! BTF read from the kernel was checked by it, but the bytes handed to
//! [`Btf::parse`] may come from anywhere, so nothing is trusted: every
//! section and record is checked to lie within the data before it is read,
//! an unknown kind is an error, and memory is only allocated for records
//! whose bytes are there (the parsed form takes a small constant times the
//! input). Parsing checks the layout; what records refer to is checked when
//! it is looked up: [`Btf::get`] for a type id, [`Btf::name`] for a string
//! offset (within the string section, NUL-terminated there, UTF-8), so that
//! one bad reference spoils only the types that use it.
//!
//! Split BTF (a kernel module's, on vmlinux) continues its base: its type
//! ids start after the base's last id and its string offsets after the
//! base's string section, as in the kernel (`btf->start_id`,
//! `btf->start_str_off`); [`Btf::get`] and [`Btf::name`] look ids and
//! offsets below those up in the base.
#![forbid(unsafe_code)]

use std::{fmt, sync::Arc};

/// `BTF_MAGIC`, as read in this host's byte order.
pub const MAGIC: u16 = 0xeb9f;
/// Length of the header (`struct btf_header`) this reader knows.
pub const HEADER_LEN: usize = 24;

pub(crate) const KIND_INT: u32 = 1;
pub(crate) const KIND_PTR: u32 = 2;
pub(crate) const KIND_ARRAY: u32 = 3;
pub(crate) const KIND_STRUCT: u32 = 4;
pub(crate) const KIND_UNION: u32 = 5;
pub(crate) const KIND_ENUM: u32 = 6;
pub(crate) const KIND_FWD: u32 = 7;
pub(crate) const KIND_TYPEDEF: u32 = 8;
pub(crate) const KIND_VOLATILE: u32 = 9;
pub(crate) const KIND_CONST: u32 = 10;
pub(crate) const KIND_RESTRICT: u32 = 11;
pub(crate) const KIND_FUNC: u32 = 12;
pub(crate) const KIND_FUNC_PROTO: u32 = 13;
pub(crate) const KIND_VAR: u32 = 14;
pub(crate) const KIND_DATASEC: u32 = 15;
pub(crate) const KIND_FLOAT: u32 = 16;
pub(crate) const KIND_DECL_TAG: u32 = 17;
pub(crate) const KIND_TYPE_TAG: u32 = 18;
pub(crate) const KIND_ENUM64: u32 = 19;

/// Length of `struct btf_type`, the start of every record.
const TYPE_LEN: usize = 12;

/// Why BTF cannot be parsed, or a type or name looked up.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum BtfError {
    /// Fewer bytes than a header.
    #[error("BTF of {len} bytes is shorter than its header ({HEADER_LEN} bytes)")]
    ShortHeader {
        /// Length of the data.
        len: usize,
    },
    /// Not BTF, or BTF in the other byte order.
    #[error("not BTF in this host's byte order (bad magic {magic:#06x}, expected {MAGIC:#06x})")]
    BadMagic {
        /// The first two bytes, in this host's byte order.
        magic: u16,
    },
    /// A version or flags this reader does not know.
    #[error(
        "unsupported BTF version {version} (flags {flags:#x}): only version 1 without flags is known"
    )]
    Version {
        /// The header's version.
        version: u8,
        /// The header's flags.
        flags: u8,
    },
    /// The header's own length is shorter than a header or past the data.
    #[error(
        "invalid BTF header length {hdr_len} (at least {HEADER_LEN}, at most the {len} bytes of data)"
    )]
    HeaderLen {
        /// The header's `hdr_len`.
        hdr_len: u32,
        /// Length of the data.
        len: usize,
    },
    /// A section runs past the end of the data.
    #[error(
        "the BTF {section} section ({size} bytes at {offset} after the header) runs past the end of the data ({len} bytes)"
    )]
    SectionPastEnd {
        /// "type" or "string".
        section: &'static str,
        /// The section's offset, from the end of the header.
        offset: u32,
        /// The section's length.
        size: u32,
        /// Length of the data.
        len: usize,
    },
    /// The string section breaks the kernel's rules.
    #[error("invalid BTF string section: {0}")]
    StringSection(&'static str),
    /// A record runs past the end of the type section.
    #[error(
        "BTF type [{id}] ({kind}, at byte {offset} of the type section) is truncated: it needs {needed} bytes, {left} are left"
    )]
    Truncated {
        /// The type's id.
        id: u32,
        /// The type's kind ("struct", ...).
        kind: &'static str,
        /// Where its record starts in the type section.
        offset: usize,
        /// Bytes its record takes (with its members, enumerators, ...).
        needed: usize,
        /// Bytes left in the type section.
        left: usize,
    },
    /// A record of a kind this reader does not know (newer than it, or
    /// garbage).
    #[error(
        "BTF type [{id}] (at byte {offset} of the type section) has unknown kind {kind} (known kinds are 1 to {KIND_ENUM64})"
    )]
    UnknownKind {
        /// The type's id.
        id: u32,
        /// Where its record starts in the type section.
        offset: usize,
        /// The kind number.
        kind: u32,
    },
    /// Type ids or string offsets (with the base's) do not fit in 32 bits.
    #[error("BTF too large: its {0} do not fit in 32 bits")]
    TooLarge(&'static str),
    /// A type id that is neither void, in this object, nor in its base.
    #[error("type [{id}] does not exist (the BTF has types 0 to {last})")]
    NoType {
        /// The id looked up.
        id: u32,
        /// The highest id there is.
        last: u32,
    },
    /// A string offset past the string section.
    #[error("string offset {offset} is past the end of the BTF string section ({len} bytes)")]
    StringOffset {
        /// The offset looked up.
        offset: u32,
        /// Length of the string sections (with the base's).
        len: u32,
    },
    /// A string that runs to the end of the string section (never for an
    /// object from [`Btf::parse`], which checks that the section ends with
    /// a NUL byte; kept so that lookups check what they read).
    #[error("the BTF string at offset {offset} is not NUL-terminated within the string section")]
    Unterminated {
        /// The offset looked up.
        offset: u32,
    },
    /// A string that is not UTF-8.
    #[error("the BTF string at offset {offset} is not valid UTF-8")]
    NotUtf8 {
        /// The offset looked up.
        offset: u32,
    },
}

/// An integer type (`BTF_KIND_INT`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Int {
    /// Name offset.
    pub name_off: u32,
    /// Size in bytes.
    pub size: u32,
    /// `BTF_INT_ENCODING`: `BTF_INT_SIGNED` (1), `BTF_INT_CHAR` (2),
    /// `BTF_INT_BOOL` (4).
    pub encoding: u8,
    /// `BTF_INT_OFFSET`: where the value starts, in bits from the start of
    /// its `size` bytes.
    pub bit_offset: u8,
    /// `BTF_INT_BITS`: how many bits the value has.
    pub bits: u8,
}

impl Int {
    /// Whether the value is signed (`BTF_INT_SIGNED`).
    pub fn is_signed(&self) -> bool {
        self.encoding & 1 != 0
    }

    /// Whether it is a character (`BTF_INT_CHAR`).
    pub fn is_char(&self) -> bool {
        self.encoding & 2 != 0
    }

    /// Whether it is a boolean (`BTF_INT_BOOL`).
    pub fn is_bool(&self) -> bool {
        self.encoding & 4 != 0
    }

    /// Whether the value uses all of its bytes: no bit offset, and as many
    /// bits as its size holds. Other integers are the types of bitfields in
    /// structs without `kind_flag`.
    pub fn is_whole(&self) -> bool {
        self.bit_offset == 0 && u64::from(self.bits) == u64::from(self.size) * 8
    }
}

/// A type that names another: pointer, typedef, modifier, type tag.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Ref {
    /// Name offset (0 except for typedefs and type tags).
    pub name_off: u32,
    /// The type referred to (0 for void).
    pub type_id: u32,
}

/// An array type (`BTF_KIND_ARRAY`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Array {
    /// The elements' type.
    pub elem_type: u32,
    /// The index type.
    pub index_type: u32,
    /// Number of elements.
    pub len: u32,
}

/// A struct or union (`BTF_KIND_STRUCT`, `BTF_KIND_UNION`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Record {
    /// Name offset (0 when anonymous).
    pub name_off: u32,
    /// Size in bytes.
    pub size: u32,
    /// Whether members carry their bitfield width (`kind_flag`). When it
    /// is clear, a bitfield's width is in its integer type ([`Int::bits`]).
    pub kind_flag: bool,
    /// The members, in order.
    pub members: Vec<Member>,
}

/// A member of a [`Record`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Member {
    /// Name offset (0 for an anonymous struct or union member).
    pub name_off: u32,
    /// The member's type.
    pub type_id: u32,
    /// Offset from the start of the record, in bits.
    pub bit_offset: u32,
    /// Bitfield width in bits; 0 for a plain member, and always 0 in a
    /// record without `kind_flag`.
    pub bitfield_size: u32,
}

/// An enum with 32-bit values (`BTF_KIND_ENUM`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Enum {
    /// Name offset (0 when anonymous).
    pub name_off: u32,
    /// Size in bytes.
    pub size: u32,
    /// Whether values are signed (`kind_flag`).
    pub signed: bool,
    /// The enumerators.
    pub values: Vec<EnumValue>,
}

/// An enumerator of an [`Enum`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EnumValue {
    /// Name offset.
    pub name_off: u32,
    /// The value's bits, as stored.
    pub val: u32,
}

impl Enum {
    /// The value of `v`, read as signed or not as the enum says.
    pub fn value(&self, v: &EnumValue) -> i64 {
        if self.signed {
            i64::from(v.val as i32)
        } else {
            i64::from(v.val)
        }
    }
}

/// An enum with 64-bit values (`BTF_KIND_ENUM64`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Enum64 {
    /// Name offset (0 when anonymous).
    pub name_off: u32,
    /// Size in bytes.
    pub size: u32,
    /// Whether values are signed (`kind_flag`).
    pub signed: bool,
    /// The enumerators.
    pub values: Vec<Enum64Value>,
}

/// An enumerator of an [`Enum64`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Enum64Value {
    /// Name offset.
    pub name_off: u32,
    /// The value's bits (`val_hi32 << 32 | val_lo32`).
    pub val: u64,
}

/// A forward declaration (`BTF_KIND_FWD`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Fwd {
    /// Name offset.
    pub name_off: u32,
    /// Whether it declares a union (`kind_flag`) rather than a struct.
    pub is_union: bool,
}

/// The linkage of a function or variable.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Linkage {
    /// `BTF_FUNC_STATIC`, `BTF_VAR_STATIC` (0).
    Static,
    /// `BTF_FUNC_GLOBAL`, `BTF_VAR_GLOBAL_ALLOCATED` (1).
    Global,
    /// `BTF_FUNC_EXTERN`, `BTF_VAR_GLOBAL_EXTERN` (2).
    Extern,
    /// Any other value (the kernel refuses them).
    Other(u32),
}

impl Linkage {
    fn from_raw(v: u32) -> Self {
        match v {
            0 => Self::Static,
            1 => Self::Global,
            2 => Self::Extern,
            other => Self::Other(other),
        }
    }
}

/// A function (`BTF_KIND_FUNC`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Func {
    /// Name offset.
    pub name_off: u32,
    /// Its prototype (a [`FuncProto`]).
    pub proto_type: u32,
    /// Its linkage (the record's vlen).
    pub linkage: Linkage,
}

/// A function prototype (`BTF_KIND_FUNC_PROTO`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FuncProto {
    /// The return type (0 for void).
    pub return_type: u32,
    /// The parameters; a variadic function's last one has neither name nor
    /// type.
    pub params: Vec<Param>,
}

/// A parameter of a [`FuncProto`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Param {
    /// Name offset (0 when unnamed).
    pub name_off: u32,
    /// Its type.
    pub type_id: u32,
}

/// A variable (`BTF_KIND_VAR`), as found in a [`DataSec`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Var {
    /// Name offset.
    pub name_off: u32,
    /// Its type.
    pub type_id: u32,
    /// Its linkage.
    pub linkage: Linkage,
}

/// A data section (`BTF_KIND_DATASEC`): `.bss`, `.data`, `.rodata`, ...
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DataSec {
    /// Name offset.
    pub name_off: u32,
    /// Size in bytes.
    pub size: u32,
    /// The variables it holds.
    pub vars: Vec<VarSecInfo>,
}

/// Where a variable lies in a [`DataSec`] (`struct btf_var_secinfo`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct VarSecInfo {
    /// The variable (a [`Var`]).
    pub type_id: u32,
    /// Its offset in the section, in bytes.
    pub offset: u32,
    /// Its size in bytes.
    pub size: u32,
}

/// A floating-point type (`BTF_KIND_FLOAT`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Float {
    /// Name offset.
    pub name_off: u32,
    /// Size in bytes.
    pub size: u32,
}

/// A declaration tag (`BTF_KIND_DECL_TAG`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeclTag {
    /// The tag, as a name offset.
    pub name_off: u32,
    /// The tagged type.
    pub type_id: u32,
    /// The tagged member or parameter, -1 for the whole declaration.
    pub component_idx: i32,
}

/// One BTF type.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Type {
    /// Id 0.
    Void,
    /// `BTF_KIND_INT`.
    Int(Int),
    /// `BTF_KIND_PTR`.
    Ptr(Ref),
    /// `BTF_KIND_ARRAY`.
    Array(Array),
    /// `BTF_KIND_STRUCT`.
    Struct(Record),
    /// `BTF_KIND_UNION`.
    Union(Record),
    /// `BTF_KIND_ENUM`.
    Enum(Enum),
    /// `BTF_KIND_FWD`.
    Fwd(Fwd),
    /// `BTF_KIND_TYPEDEF`.
    Typedef(Ref),
    /// `BTF_KIND_VOLATILE`.
    Volatile(Ref),
    /// `BTF_KIND_CONST`.
    Const(Ref),
    /// `BTF_KIND_RESTRICT`.
    Restrict(Ref),
    /// `BTF_KIND_FUNC`.
    Func(Func),
    /// `BTF_KIND_FUNC_PROTO`.
    FuncProto(FuncProto),
    /// `BTF_KIND_VAR`.
    Var(Var),
    /// `BTF_KIND_DATASEC`.
    DataSec(DataSec),
    /// `BTF_KIND_FLOAT`.
    Float(Float),
    /// `BTF_KIND_DECL_TAG`.
    DeclTag(DeclTag),
    /// `BTF_KIND_TYPE_TAG`.
    TypeTag(Ref),
    /// `BTF_KIND_ENUM64`.
    Enum64(Enum64),
}

static VOID: Type = Type::Void;

impl Type {
    /// The kind, as a word: "int", "struct", "func-proto", ...
    pub fn kind_name(&self) -> &'static str {
        match self {
            Self::Void => "void",
            Self::Int(_) => "int",
            Self::Ptr(_) => "ptr",
            Self::Array(_) => "array",
            Self::Struct(_) => "struct",
            Self::Union(_) => "union",
            Self::Enum(_) => "enum",
            Self::Fwd(_) => "fwd",
            Self::Typedef(_) => "typedef",
            Self::Volatile(_) => "volatile",
            Self::Const(_) => "const",
            Self::Restrict(_) => "restrict",
            Self::Func(_) => "func",
            Self::FuncProto(_) => "func-proto",
            Self::Var(_) => "var",
            Self::DataSec(_) => "datasec",
            Self::Float(_) => "float",
            Self::DeclTag(_) => "decl-tag",
            Self::TypeTag(_) => "type-tag",
            Self::Enum64(_) => "enum64",
        }
    }

    /// The type's name offset; 0 (the empty name) for void, arrays and
    /// function prototypes, which have none.
    pub fn name_off(&self) -> u32 {
        match self {
            Self::Void | Self::Array(_) | Self::FuncProto(_) => 0,
            Self::Int(t) => t.name_off,
            Self::Ptr(t)
            | Self::Typedef(t)
            | Self::Volatile(t)
            | Self::Const(t)
            | Self::Restrict(t)
            | Self::TypeTag(t) => t.name_off,
            Self::Struct(t) | Self::Union(t) => t.name_off,
            Self::Enum(t) => t.name_off,
            Self::Fwd(t) => t.name_off,
            Self::Func(t) => t.name_off,
            Self::Var(t) => t.name_off,
            Self::DataSec(t) => t.name_off,
            Self::Float(t) => t.name_off,
            Self::DeclTag(t) => t.name_off,
            Self::Enum64(t) => t.name_off,
        }
    }
}

/// Parsed BTF: its types and strings, and its base when it is split BTF.
///
/// Cheap to clone (the parsed data is shared); a split object keeps its
/// base alive.
#[derive(Clone)]
pub struct Btf {
    inner: Arc<Inner>,
}

struct Inner {
    base: Option<Btf>,
    /// Id of `types[0]`: 1, or the base's next id.
    first_id: u32,
    types: Vec<Type>,
    /// Offset of `strings[0]`: 0, or the base's string length.
    str_start: u32,
    strings: Box<[u8]>,
}

impl fmt::Debug for Btf {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Btf")
            .field("first_id", &self.inner.first_id)
            .field("types", &self.inner.types.len())
            .field("str_start", &self.inner.str_start)
            .field("str_len", &self.inner.strings.len())
            .field("split", &self.inner.base.is_some())
            .finish()
    }
}

/// Reads native-endian words off the front of a slice.
struct Words<'a>(&'a [u8]);

impl Words<'_> {
    fn next(&mut self) -> Option<u32> {
        let (word, rest) = self.0.split_first_chunk::<4>()?;
        self.0 = rest;
        Some(u32::from_ne_bytes(*word))
    }
}

/// Where the header places a section: `offset` bytes after the header,
/// `size` bytes long.
#[derive(Clone, Copy)]
struct SectionAt {
    offset: u32,
    size: u32,
}

impl SectionAt {
    /// The two words at `at` of the header `h`.
    fn read(h: &[u8; HEADER_LEN], at: usize) -> Self {
        let word = |i: usize| u32::from_ne_bytes([h[i], h[i + 1], h[i + 2], h[i + 3]]);
        Self {
            offset: word(at),
            size: word(at + 4),
        }
    }

    /// The section as a range of `raw`, whose header is `hdr_len` bytes.
    fn range(
        self,
        raw: &[u8],
        hdr_len: u32,
        what: &'static str,
    ) -> Result<std::ops::Range<usize>, BtfError> {
        let Self { offset, size } = self;
        let start = u64::from(hdr_len) + u64::from(offset);
        let end = start + u64::from(size);
        if end > raw.len() as u64 {
            return Err(BtfError::SectionPastEnd {
                section: what,
                offset,
                size,
                len: raw.len(),
            });
        }
        // Both within `raw.len()`, so within usize.
        Ok(start as usize..end as usize)
    }
}

/// Bytes a record of `kind` with `vlen` entries takes after its
/// `struct btf_type`, and the kind's name; `None` for an unknown kind.
fn record_layout(kind: u32, vlen: usize) -> Option<(usize, &'static str)> {
    Some(match kind {
        KIND_INT => (4, "int"),
        KIND_PTR => (0, "ptr"),
        KIND_ARRAY => (12, "array"),
        KIND_STRUCT => (vlen * 12, "struct"),
        KIND_UNION => (vlen * 12, "union"),
        KIND_ENUM => (vlen * 8, "enum"),
        KIND_FWD => (0, "fwd"),
        KIND_TYPEDEF => (0, "typedef"),
        KIND_VOLATILE => (0, "volatile"),
        KIND_CONST => (0, "const"),
        KIND_RESTRICT => (0, "restrict"),
        KIND_FUNC => (0, "func"),
        KIND_FUNC_PROTO => (vlen * 8, "func-proto"),
        KIND_VAR => (4, "var"),
        KIND_DATASEC => (vlen * 12, "datasec"),
        KIND_FLOAT => (0, "float"),
        KIND_DECL_TAG => (4, "decl-tag"),
        KIND_TYPE_TAG => (0, "type-tag"),
        KIND_ENUM64 => (vlen * 12, "enum64"),
        _ => return None,
    })
}

/// Decodes one record whose bytes (`struct btf_type` and what follows) are
/// `w`, checked to be as long as [`record_layout`] says.
fn decode(kind: u32, w: &mut Words<'_>) -> Option<Type> {
    let name_off = w.next()?;
    let info = w.next()?;
    let size_or_type = w.next()?;
    let vlen = info & 0xffff;
    let kind_flag = info >> 31 != 0;
    let r = Ref {
        name_off,
        type_id: size_or_type,
    };
    let h = Head {
        kind,
        name_off,
        size_or_type,
        vlen,
        kind_flag,
    };
    Some(match kind {
        KIND_STRUCT | KIND_UNION | KIND_ENUM | KIND_FUNC_PROTO | KIND_DATASEC | KIND_ENUM64 => {
            return decode_listed(&h, w);
        }
        KIND_INT => {
            let data = w.next()?;
            Type::Int(Int {
                name_off,
                size: size_or_type,
                encoding: ((data >> 24) & 0x0f) as u8,
                bit_offset: ((data >> 16) & 0xff) as u8,
                bits: (data & 0xff) as u8,
            })
        }
        KIND_PTR => Type::Ptr(r),
        KIND_ARRAY => Type::Array(Array {
            elem_type: w.next()?,
            index_type: w.next()?,
            len: w.next()?,
        }),
        KIND_FWD => Type::Fwd(Fwd {
            name_off,
            is_union: kind_flag,
        }),
        KIND_TYPEDEF => Type::Typedef(r),
        KIND_VOLATILE => Type::Volatile(r),
        KIND_CONST => Type::Const(r),
        KIND_RESTRICT => Type::Restrict(r),
        KIND_FUNC => Type::Func(Func {
            name_off,
            proto_type: size_or_type,
            linkage: Linkage::from_raw(vlen),
        }),
        KIND_VAR => Type::Var(Var {
            name_off,
            type_id: size_or_type,
            linkage: Linkage::from_raw(w.next()?),
        }),
        KIND_FLOAT => Type::Float(Float {
            name_off,
            size: size_or_type,
        }),
        KIND_DECL_TAG => Type::DeclTag(DeclTag {
            name_off,
            type_id: size_or_type,
            component_idx: w.next()? as i32,
        }),
        KIND_TYPE_TAG => Type::TypeTag(r),
        _ => return None,
    })
}

/// The first three words of a type record, read.
#[derive(Clone, Copy)]
struct Head {
    kind: u32,
    name_off: u32,
    size_or_type: u32,
    vlen: u32,
    kind_flag: bool,
}

/// A type whose record ends with a list of `vlen` entries.
fn decode_listed(h: &Head, w: &mut Words<'_>) -> Option<Type> {
    let Head {
        kind,
        name_off,
        size_or_type,
        vlen,
        kind_flag,
    } = *h;
    Some(match kind {
        KIND_STRUCT | KIND_UNION => {
            let record = Record {
                name_off,
                size: size_or_type,
                kind_flag,
                members: list(vlen, w, |w| member(w, kind_flag))?,
            };
            if kind == KIND_STRUCT {
                Type::Struct(record)
            } else {
                Type::Union(record)
            }
        }
        KIND_ENUM => Type::Enum(Enum {
            name_off,
            size: size_or_type,
            signed: kind_flag,
            values: list(vlen, w, |w| {
                Some(EnumValue {
                    name_off: w.next()?,
                    val: w.next()?,
                })
            })?,
        }),
        KIND_FUNC_PROTO => Type::FuncProto(FuncProto {
            return_type: size_or_type,
            params: list(vlen, w, |w| {
                Some(Param {
                    name_off: w.next()?,
                    type_id: w.next()?,
                })
            })?,
        }),
        KIND_DATASEC => Type::DataSec(DataSec {
            name_off,
            size: size_or_type,
            vars: list(vlen, w, |w| {
                Some(VarSecInfo {
                    type_id: w.next()?,
                    offset: w.next()?,
                    size: w.next()?,
                })
            })?,
        }),
        KIND_ENUM64 => Type::Enum64(Enum64 {
            name_off,
            size: size_or_type,
            signed: kind_flag,
            values: list(vlen, w, |w| {
                let (name_off, lo, hi) = (w.next()?, w.next()?, w.next()?);
                Some(Enum64Value {
                    name_off,
                    val: (u64::from(hi) << 32) | u64::from(lo),
                })
            })?,
        }),
        _ => return None,
    })
}

/// `vlen` entries of a record's trailing list, each read by `one`.
fn list<T>(
    vlen: u32,
    w: &mut Words<'_>,
    mut one: impl FnMut(&mut Words<'_>) -> Option<T>,
) -> Option<Vec<T>> {
    let mut out = Vec::with_capacity(vlen as usize);
    for _ in 0..vlen {
        out.push(one(w)?);
    }
    Some(out)
}

/// A struct or union member; with `kind_flag` its offset word holds the
/// bitfield width in its top byte.
fn member(w: &mut Words<'_>, kind_flag: bool) -> Option<Member> {
    let (name_off, type_id, offset) = (w.next()?, w.next()?, w.next()?);
    let (bit_offset, bitfield_size) = if kind_flag {
        (offset & 0xff_ffff, offset >> 24)
    } else {
        (offset, 0)
    };
    Some(Member {
        name_off,
        type_id,
        bit_offset,
        bitfield_size,
    })
}

/// Parses the type section `sec`, whose first record is id `first_id`.
fn parse_types(sec: &[u8], first_id: u32) -> Result<Vec<Type>, BtfError> {
    // vmlinux averages about 40 bytes a record; growing costs little.
    let mut types = Vec::with_capacity(sec.len() / 32);
    let mut rest = sec;
    let mut id = first_id;
    while !rest.is_empty() {
        let offset = sec.len() - rest.len();
        let mut head = Words(rest);
        let info = match (head.next(), head.next()) {
            (Some(_), Some(info)) => info,
            _ => {
                return Err(BtfError::Truncated {
                    id,
                    kind: "record",
                    offset,
                    needed: TYPE_LEN,
                    left: rest.len(),
                });
            }
        };
        let kind = (info >> 24) & 0x1f;
        let vlen = (info & 0xffff) as usize;
        let Some((extra, kind_name)) = record_layout(kind, vlen) else {
            return Err(BtfError::UnknownKind { id, offset, kind });
        };
        let truncated = || BtfError::Truncated {
            id,
            kind: kind_name,
            offset,
            needed: TYPE_LEN + extra,
            left: rest.len(),
        };
        // The record's bytes are checked to be there before anything is
        // allocated for its entries.
        let (record, after) = rest
            .split_at_checked(TYPE_LEN + extra)
            .ok_or_else(truncated)?;
        let t = decode(kind, &mut Words(record)).ok_or_else(truncated)?;
        types.push(t);
        rest = after;
        if !rest.is_empty() {
            id = id.checked_add(1).ok_or(BtfError::TooLarge("type ids"))?;
        }
    }
    Ok(types)
}

impl Btf {
    /// Parses raw BTF; split BTF (a kernel module's) on the `base` it was
    /// built on (vmlinux).
    ///
    /// Checks the header (magic in this host's byte order, version 1, no
    /// flags, sections within the data), the string section (the kernel's
    /// rules: it ends with a NUL byte, and stand-alone BTF's starts with
    /// one, the empty name), and that every record is of a known kind and
    /// lies within the type section.
    pub fn parse(raw: &[u8], base: Option<&Btf>) -> Result<Btf, BtfError> {
        let Some(header) = raw.first_chunk::<HEADER_LEN>() else {
            return Err(BtfError::ShortHeader { len: raw.len() });
        };
        let magic = u16::from_ne_bytes([header[0], header[1]]);
        if magic != MAGIC {
            return Err(BtfError::BadMagic { magic });
        }
        let (version, flags) = (header[2], header[3]);
        if version != 1 || flags != 0 {
            return Err(BtfError::Version { version, flags });
        }
        let h = header;
        let hdr_len = u32::from_ne_bytes([h[4], h[5], h[6], h[7]]);
        let types_at = SectionAt::read(h, 8);
        let strings_at = SectionAt::read(h, 16);
        if (hdr_len as usize) < HEADER_LEN || u64::from(hdr_len) > raw.len() as u64 {
            return Err(BtfError::HeaderLen {
                hdr_len,
                len: raw.len(),
            });
        }
        let type_sec = types_at.range(raw, hdr_len, "type")?;
        let str_sec = strings_at.range(raw, hdr_len, "string")?;
        let strings = raw.get(str_sec).unwrap_or_default();
        let types = raw.get(type_sec).unwrap_or_default();

        match (strings.first(), strings.last()) {
            (None, _) if base.is_none() => {
                return Err(BtfError::StringSection(
                    "it is empty (it must hold at least the empty name)",
                ));
            }
            (Some(&first), _) if first != 0 && base.is_none() => {
                return Err(BtfError::StringSection(
                    "it does not start with the empty name (is this split BTF parsed without its base?)",
                ));
            }
            (_, Some(&last)) if last != 0 => {
                return Err(BtfError::StringSection("it does not end with a NUL byte"));
            }
            _ => {}
        }

        let (first_id, str_start) = match base {
            None => (1, 0),
            Some(b) => (
                b.last_id()
                    .checked_add(1)
                    .ok_or(BtfError::TooLarge("type ids"))?,
                b.str_len(),
            ),
        };
        u32::try_from(strings.len())
            .ok()
            .and_then(|len| str_start.checked_add(len))
            .ok_or(BtfError::TooLarge("string offsets"))?;
        // Every id it gives fits in 32 bits, so last_id() does too.
        let types = parse_types(types, first_id)?;
        Ok(Btf {
            inner: Arc::new(Inner {
                base: base.cloned(),
                first_id,
                types,
                str_start,
                strings: strings.into(),
            }),
        })
    }

    /// The base this split BTF was parsed on.
    pub fn base(&self) -> Option<&Btf> {
        self.inner.base.as_ref()
    }

    /// The first id of this object's own types: 1, or the one after its
    /// base's last.
    pub fn first_id(&self) -> u32 {
        self.inner.first_id
    }

    /// The highest type id, with the base's (0 when there is only void).
    pub fn last_id(&self) -> u32 {
        // Fits: parse_types checked every id it gave.
        self.inner.first_id - 1 + self.inner.types.len() as u32
    }

    /// Length of the string sections, with the base's: where the strings
    /// of split BTF on this one start.
    pub fn str_len(&self) -> u32 {
        // Fits: checked by parse.
        self.inner.str_start + self.inner.strings.len() as u32
    }

    /// This object's own types (not its base's), with their ids.
    pub fn types(&self) -> impl ExactSizeIterator<Item = (u32, &Type)> + '_ {
        let first = self.inner.first_id;
        self.inner
            .types
            .iter()
            .enumerate()
            .map(move |(i, t)| (first + i as u32, t))
    }

    /// Type `id`: void for 0, then the base's types, then this object's.
    pub fn get(&self, id: u32) -> Result<&Type, BtfError> {
        if id == 0 {
            return Ok(&VOID);
        }
        let inner = &*self.inner;
        if id < inner.first_id
            && let Some(base) = &inner.base
        {
            return base.get(id);
        }
        id.checked_sub(inner.first_id)
            .and_then(|i| inner.types.get(i as usize))
            .ok_or(BtfError::NoType {
                id,
                last: self.last_id(),
            })
    }

    /// The id of the first type named `name` of the kind `kind` tells
    /// (`|t| matches!(t, Type::Func(_))`), the base's types first; `None`
    /// when there is none. Names are compared as bytes, without decoding
    /// the others: a look-up in vmlinux's BTF reads each name once.
    pub fn find(&self, name: &str, kind: impl Fn(&Type) -> bool) -> Option<u32> {
        self.find_dyn(name, &kind)
    }

    fn find_dyn(&self, name: &str, kind: &dyn Fn(&Type) -> bool) -> Option<u32> {
        if let Some(id) = self.base().and_then(|b| b.find_dyn(name, kind)) {
            return Some(id);
        }
        self.types()
            .find(|(_, t)| self.name_is(t.name_off(), name) && kind(t))
            .map(|(id, _)| id)
    }

    /// Whether this object's own string at `offset` is `name` (false for
    /// an offset outside its string section).
    fn name_is(&self, offset: u32, name: &str) -> bool {
        let inner = &*self.inner;
        offset
            .checked_sub(inner.str_start)
            .and_then(|at| inner.strings.get(at as usize..))
            .and_then(|tail| tail.strip_prefix(name.as_bytes()))
            .is_some_and(|rest| rest.first() == Some(&0))
    }

    /// The string at `offset`: the empty name for 0, then the base's
    /// strings, then this object's.
    pub fn name(&self, offset: u32) -> Result<&str, BtfError> {
        if offset == 0 {
            return Ok("");
        }
        let inner = &*self.inner;
        if offset < inner.str_start
            && let Some(base) = &inner.base
        {
            return base.name(offset);
        }
        let tail = offset
            .checked_sub(inner.str_start)
            .and_then(|at| inner.strings.get(at as usize..))
            .filter(|tail| !tail.is_empty())
            .ok_or(BtfError::StringOffset {
                offset,
                len: self.str_len(),
            })?;
        let bytes = tail
            .iter()
            .position(|&b| b == 0)
            .and_then(|end| tail.get(..end))
            .ok_or(BtfError::Unterminated { offset })?;
        std::str::from_utf8(bytes).map_err(|_| BtfError::NotUtf8 { offset })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{BtfBuilder, BtfMember, IntEncoding};

    fn parse(raw: &[u8]) -> Btf {
        Btf::parse(raw, None).unwrap_or_else(|e| panic!("parse: {e}"))
    }

    fn named<'a>(btf: &'a Btf, t: &Type) -> &'a str {
        btf.name(t.name_off()).expect("name")
    }

    #[test]
    fn every_kind_the_builder_writes_is_read_back() {
        let mut b = BtfBuilder::new();
        let int = b.add_int("int", 4, IntEncoding::Signed);
        let uint = b.add_int("unsigned int", 4, IntEncoding::Unsigned);
        let ch = b.add_int("char", 1, IntEncoding::Char);
        let boolean = b.add_int("_Bool", 1, IntEncoding::Bool);
        let three = b.add_int_bits("unsigned int", 4, IntEncoding::Unsigned, 2, 3);
        let wide = b.add_int("unsigned __int128", 16, IntEncoding::Unsigned);
        let double = b.add_float("double", 8);
        let p = b.add_ptr(int);
        let vp = b.add_ptr(0);
        let arr = b.add_array(ch, 16);
        let index = arr - 1; // the builder's index type, written on first use
        let s = b.add_struct(
            "s",
            8,
            &[BtfMember::new("a", int, 0), BtfMember::new("b", uint, 32)],
        );
        let bits = b.add_union(
            "u",
            4,
            &[
                BtfMember::bitfield("x", uint, 3, 5),
                BtfMember::new("y", int, 0),
            ],
        );
        let color = b.add_enum("color", 4, true, &[("RED", 0), ("NEG", -1)]);
        let flags = b.add_enum("flags", 1, false, &[("HI", 200)]);
        let big = b.add_enum64("big", 8, false, &[("HUGE", u64::MAX), ("ONE", 1)]);
        let fwd_s = b.add_fwd("later", false);
        let fwd_u = b.add_fwd("either", true);
        let td = b.add_typedef("__u32", uint);
        let c = b.add_const(int);
        let v = b.add_volatile(c);
        let r = b.add_restrict(p);
        let tag = b.add_type_tag("user", int);
        let proto = b.add_func_proto(int, &[("argc", int), ("argv", p)]);
        let func = b.add_func("main", proto, 1);
        let static_func = b.add_func("helper", proto, 0);
        let var = b.add_var("counter", int, 1);
        let static_var = b.add_var("hidden", uint, 0);
        let sec = b.add_datasec(".data", 8, &[(var, 0, 4), (static_var, 4, 4)]);
        let decl = b.add_decl_tag("annotated", s, 1);
        let whole = b.add_decl_tag("whole", func, -1);
        let btf = parse(&b.to_bytes());

        assert_eq!(btf.first_id(), 1);
        assert_eq!(btf.last_id(), whole);
        assert_eq!(btf.types().len(), whole as usize);
        assert_eq!(btf.get(0), Ok(&Type::Void));

        let Type::Int(i) = btf.get(int).unwrap() else {
            panic!("int")
        };
        assert_eq!(btf.name(i.name_off), Ok("int"));
        assert_eq!((i.size, i.bits, i.bit_offset), (4, 32, 0));
        assert!(i.is_signed() && !i.is_char() && !i.is_bool() && i.is_whole());
        let Type::Int(i) = btf.get(uint).unwrap() else {
            panic!("uint")
        };
        assert!(!i.is_signed() && i.is_whole());
        let Type::Int(i) = btf.get(ch).unwrap() else {
            panic!("char")
        };
        assert!(i.is_char() && !i.is_signed() && i.size == 1 && i.bits == 8);
        let Type::Int(i) = btf.get(boolean).unwrap() else {
            panic!("bool")
        };
        assert!(i.is_bool() && !i.is_char());
        let Type::Int(i) = btf.get(three).unwrap() else {
            panic!("three")
        };
        assert_eq!((i.size, i.bit_offset, i.bits), (4, 2, 3));
        assert!(!i.is_whole());
        let Type::Int(i) = btf.get(wide).unwrap() else {
            panic!("wide")
        };
        assert_eq!((i.size, i.bits), (16, 128));
        assert!(i.is_whole());

        let t = btf.get(double).unwrap();
        assert_eq!(
            t,
            &Type::Float(Float {
                name_off: t.name_off(),
                size: 8
            })
        );
        assert_eq!(named(&btf, t), "double");
        assert_eq!(
            btf.get(p),
            Ok(&Type::Ptr(Ref {
                name_off: 0,
                type_id: int
            }))
        );
        assert_eq!(
            btf.get(vp),
            Ok(&Type::Ptr(Ref {
                name_off: 0,
                type_id: 0
            }))
        );
        assert_eq!(
            btf.get(arr),
            Ok(&Type::Array(Array {
                elem_type: ch,
                index_type: index,
                len: 16
            }))
        );
        assert_eq!(named(&btf, btf.get(index).unwrap()), "__ARRAY_SIZE_TYPE__");

        let Type::Struct(rec) = btf.get(s).unwrap() else {
            panic!("struct")
        };
        assert_eq!((named(&btf, btf.get(s).unwrap()), rec.size), ("s", 8));
        assert!(!rec.kind_flag);
        let got: Vec<_> = rec
            .members
            .iter()
            .map(|m| {
                (
                    btf.name(m.name_off).unwrap(),
                    m.type_id,
                    m.bit_offset,
                    m.bitfield_size,
                )
            })
            .collect();
        assert_eq!(got, [("a", int, 0, 0), ("b", uint, 32, 0)]);
        let Type::Union(rec) = btf.get(bits).unwrap() else {
            panic!("union")
        };
        assert!(rec.kind_flag);
        let got: Vec<_> = rec
            .members
            .iter()
            .map(|m| (btf.name(m.name_off).unwrap(), m.bit_offset, m.bitfield_size))
            .collect();
        assert_eq!(got, [("x", 3, 5), ("y", 0, 0)]);

        let Type::Enum(e) = btf.get(color).unwrap() else {
            panic!("enum")
        };
        assert!(e.signed);
        assert_eq!(e.size, 4);
        let got: Vec<_> = e
            .values
            .iter()
            .map(|v| (btf.name(v.name_off).unwrap(), e.value(v)))
            .collect();
        assert_eq!(got, [("RED", 0), ("NEG", -1)]);
        let Type::Enum(e) = btf.get(flags).unwrap() else {
            panic!("enum")
        };
        assert!(!e.signed);
        assert_eq!((e.size, e.value(&e.values[0])), (1, 200));
        let Type::Enum64(e) = btf.get(big).unwrap() else {
            panic!("enum64")
        };
        assert!(!e.signed);
        let got: Vec<_> = e
            .values
            .iter()
            .map(|v| (btf.name(v.name_off).unwrap(), v.val))
            .collect();
        assert_eq!(got, [("HUGE", u64::MAX), ("ONE", 1)]);

        let Type::Fwd(f) = btf.get(fwd_s).unwrap() else {
            panic!("fwd")
        };
        assert!(!f.is_union);
        assert_eq!(btf.name(f.name_off), Ok("later"));
        let Type::Fwd(f) = btf.get(fwd_u).unwrap() else {
            panic!("fwd")
        };
        assert!(f.is_union);

        let t = btf.get(td).unwrap();
        assert!(matches!(t, Type::Typedef(Ref { type_id, .. }) if *type_id == uint));
        assert_eq!(named(&btf, t), "__u32");
        assert!(matches!(btf.get(c), Ok(Type::Const(Ref { type_id, .. })) if *type_id == int));
        assert!(matches!(btf.get(v), Ok(Type::Volatile(Ref { type_id, .. })) if *type_id == c));
        assert!(matches!(btf.get(r), Ok(Type::Restrict(Ref { type_id, .. })) if *type_id == p));
        let t = btf.get(tag).unwrap();
        assert!(matches!(t, Type::TypeTag(Ref { type_id, .. }) if *type_id == int));
        assert_eq!(named(&btf, t), "user");

        let Type::FuncProto(fp) = btf.get(proto).unwrap() else {
            panic!("proto")
        };
        assert_eq!(fp.return_type, int);
        let got: Vec<_> = fp
            .params
            .iter()
            .map(|p| (btf.name(p.name_off).unwrap(), p.type_id))
            .collect();
        assert_eq!(got, [("argc", int), ("argv", p)]);
        let Type::Func(f) = btf.get(func).unwrap() else {
            panic!("func")
        };
        assert_eq!((f.proto_type, f.linkage), (proto, Linkage::Global));
        assert_eq!(btf.name(f.name_off), Ok("main"));
        let Type::Func(f) = btf.get(static_func).unwrap() else {
            panic!("func")
        };
        assert_eq!(f.linkage, Linkage::Static);

        let Type::Var(x) = btf.get(var).unwrap() else {
            panic!("var")
        };
        assert_eq!((x.type_id, x.linkage), (int, Linkage::Global));
        assert_eq!(btf.name(x.name_off), Ok("counter"));
        let Type::Var(x) = btf.get(static_var).unwrap() else {
            panic!("var")
        };
        assert_eq!((x.type_id, x.linkage), (uint, Linkage::Static));
        let t = btf.get(sec).unwrap();
        let Type::DataSec(d) = t else {
            panic!("datasec")
        };
        assert_eq!((named(&btf, t), d.size), (".data", 8));
        assert_eq!(
            d.vars,
            [
                VarSecInfo {
                    type_id: var,
                    offset: 0,
                    size: 4
                },
                VarSecInfo {
                    type_id: static_var,
                    offset: 4,
                    size: 4
                },
            ]
        );
        let t = btf.get(decl).unwrap();
        assert!(
            matches!(t, Type::DeclTag(DeclTag { type_id, component_idx: 1, .. }) if *type_id == s)
        );
        assert_eq!(named(&btf, t), "annotated");
        assert!(matches!(
            btf.get(whole),
            Ok(Type::DeclTag(DeclTag {
                component_idx: -1,
                ..
            }))
        ));

        let kinds: Vec<_> = btf.types().map(|(_, t)| t.kind_name()).collect();
        for kind in [
            "int",
            "ptr",
            "array",
            "struct",
            "union",
            "enum",
            "fwd",
            "typedef",
            "volatile",
            "const",
            "restrict",
            "func",
            "func-proto",
            "var",
            "datasec",
            "float",
            "decl-tag",
            "type-tag",
            "enum64",
        ] {
            assert!(kinds.contains(&kind), "{kind} missing from {kinds:?}");
        }
        assert_eq!(
            btf.get(whole + 1),
            Err(BtfError::NoType {
                id: whole + 1,
                last: whole
            })
        );
    }

    #[test]
    fn signed_enum64_and_linkages() {
        let mut b = BtfBuilder::new();
        let int = b.add_int("int", 4, IntEncoding::Signed);
        let e = b.add_enum64("neg", 8, true, &[("MINUS", -5i64 as u64)]);
        let ext = b.add_var("ext", int, 2);
        let odd = b.add_var("odd", int, 7);
        let btf = parse(&b.to_bytes());
        let Type::Enum64(e) = btf.get(e).unwrap() else {
            panic!("enum64")
        };
        assert!(e.signed);
        assert_eq!(e.values[0].val as i64, -5);
        assert!(matches!(
            btf.get(ext),
            Ok(Type::Var(Var {
                linkage: Linkage::Extern,
                ..
            }))
        ));
        assert!(matches!(
            btf.get(odd),
            Ok(Type::Var(Var {
                linkage: Linkage::Other(7),
                ..
            }))
        ));
    }

    /// Raw BTF from a header's fields and the two sections (types, then
    /// strings).
    fn raw(types: &[u32], strings: &[u8]) -> Vec<u8> {
        let type_len = (types.len() * 4) as u32;
        let mut out = Vec::new();
        out.extend_from_slice(&MAGIC.to_ne_bytes());
        out.extend_from_slice(&[1, 0]);
        for v in [24, 0, type_len, type_len, strings.len() as u32] {
            out.extend_from_slice(&v.to_ne_bytes());
        }
        for w in types {
            out.extend_from_slice(&w.to_ne_bytes());
        }
        out.extend_from_slice(strings);
        out
    }

    fn info(kind: u32, vlen: u32, kind_flag: bool) -> u32 {
        (u32::from(kind_flag) << 31) | (kind << 24) | vlen
    }

    fn err(raw: &[u8]) -> BtfError {
        Btf::parse(raw, None).expect_err("refused")
    }

    #[test]
    fn headers_are_checked() {
        let good = raw(&[1, info(KIND_INT, 0, false), 4, 32], b"\0int\0");
        assert!(Btf::parse(&good, None).is_ok());
        for len in 0..HEADER_LEN {
            assert_eq!(err(&good[..len]), BtfError::ShortHeader { len });
        }
        let e = err(&good[..HEADER_LEN]);
        assert!(
            matches!(
                e,
                BtfError::SectionPastEnd {
                    section: "type",
                    ..
                }
            ),
            "{e}"
        );

        let mut swapped = good.clone();
        swapped[0..2].copy_from_slice(&MAGIC.swap_bytes().to_ne_bytes());
        let e = err(&swapped);
        assert_eq!(
            e,
            BtfError::BadMagic {
                magic: MAGIC.swap_bytes()
            }
        );
        assert!(e.to_string().contains("bad magic"), "{e}");
        let mut v2 = good.clone();
        v2[2] = 2;
        assert_eq!(
            err(&v2),
            BtfError::Version {
                version: 2,
                flags: 0
            }
        );
        let mut flagged = good.clone();
        flagged[3] = 1;
        assert!(matches!(err(&flagged), BtfError::Version { flags: 1, .. }));

        let with_word = |at: usize, v: u32| {
            let mut bad = good.clone();
            bad[at..at + 4].copy_from_slice(&v.to_ne_bytes());
            bad
        };
        for hdr_len in [0, 4, 23, good.len() as u32 + 1, u32::MAX] {
            assert_eq!(
                err(&with_word(4, hdr_len)),
                BtfError::HeaderLen {
                    hdr_len,
                    len: good.len()
                }
            );
        }
        // A longer header moves the sections (here past the end).
        assert!(matches!(
            err(&with_word(4, 28)),
            BtfError::SectionPastEnd {
                section: "string",
                ..
            }
        ));
        // Sections past the end, their sums overflowing 32 bits too.
        for (at, what) in [(8, "type"), (12, "type"), (16, "string"), (20, "string")] {
            for v in [u32::MAX, u32::MAX / 2, good.len() as u32] {
                let e = err(&with_word(at, v));
                assert!(
                    matches!(e, BtfError::SectionPastEnd { section, .. } if section == what),
                    "{e}"
                );
            }
        }
        let e = err(&with_word(20, 1000));
        assert_eq!(
            e.to_string(),
            format!(
                "the BTF string section (1000 bytes at 16 after the header) runs past the end of the data ({} bytes)",
                good.len()
            )
        );
    }

    #[test]
    fn string_sections_follow_the_kernel_rules() {
        let t = [1, info(KIND_INT, 0, false), 4, 32];
        assert!(
            matches!(err(&raw(&t, b"")), BtfError::StringSection(why) if why.contains("empty"))
        );
        assert!(matches!(
            err(&raw(&t, b"int\0")),
            BtfError::StringSection(why) if why.contains("split BTF")
        ));
        let e = err(&raw(&t, b"\0int"));
        assert_eq!(
            e,
            BtfError::StringSection("it does not end with a NUL byte")
        );
        assert_eq!(
            e.to_string(),
            "invalid BTF string section: it does not end with a NUL byte"
        );
    }

    #[test]
    fn names_are_checked_when_looked_up() {
        let btf = parse(&raw(
            &[1, info(KIND_INT, 0, false), 4, 32],
            b"\0int\0\xff\xfe\0",
        ));
        assert_eq!(btf.name(0), Ok(""));
        assert_eq!(btf.name(1), Ok("int"));
        assert_eq!(btf.name(2), Ok("nt"));
        assert_eq!(btf.name(4), Ok(""));
        assert_eq!(btf.name(5), Err(BtfError::NotUtf8 { offset: 5 }));
        for offset in [8, 9, u32::MAX] {
            let e = btf.name(offset).unwrap_err();
            assert_eq!(e, BtfError::StringOffset { offset, len: 8 });
        }
        assert_eq!(
            btf.name(8).unwrap_err().to_string(),
            "string offset 8 is past the end of the BTF string section (8 bytes)"
        );
        // The type's name offset is not checked until it is looked up.
        let btf = parse(&raw(&[100, info(KIND_INT, 0, false), 4, 32], b"\0"));
        let t = btf.get(1).unwrap();
        assert!(matches!(
            btf.name(t.name_off()),
            Err(BtfError::StringOffset { offset: 100, .. })
        ));
    }

    #[test]
    fn records_are_checked_against_the_type_section() {
        // A record cut short, at every length.
        let whole = [1, info(KIND_STRUCT, 2, false), 8, 1, 1, 0, 1, 1, 32];
        for words in 1..whole.len() {
            let e = err(&raw(&whole[..words], b"\0a\0"));
            let needed = if words < 2 { 12 } else { 36 };
            assert!(
                matches!(e, BtfError::Truncated { id: 1, offset: 0, needed: n, left, .. }
                    if n == needed && left == words * 4),
                "{words} words: {e}"
            );
        }
        // A vlen for more members than there are bytes: refused before
        // anything is allocated for them.
        let e = err(&raw(
            &[1, info(KIND_STRUCT, 0xffff, false), 8, 1, 1, 0],
            b"\0a\0",
        ));
        assert_eq!(
            e,
            BtfError::Truncated {
                id: 1,
                kind: "struct",
                offset: 0,
                needed: 12 + 0xffff * 12,
                left: 24
            }
        );
        assert_eq!(
            e.to_string(),
            format!(
                "BTF type [1] (struct, at byte 0 of the type section) is truncated: it needs {} bytes, 24 are left",
                12 + 0xffff * 12
            )
        );
        for (kind, per) in [
            (KIND_UNION, 12),
            (KIND_ENUM, 8),
            (KIND_FUNC_PROTO, 8),
            (KIND_DATASEC, 12),
            (KIND_ENUM64, 12),
        ] {
            let e = err(&raw(&[1, info(kind, 3, false), 4, 0, 0], b"\0a\0"));
            assert!(
                matches!(e, BtfError::Truncated { needed, left: 20, .. } if needed == 12 + 3 * per),
                "{e}"
            );
        }
        // The second record's offset and id are given.
        let e = err(&raw(
            &[
                1,
                info(KIND_INT, 0, false),
                4,
                32,
                0,
                info(KIND_ARRAY, 0, false),
                0,
                1,
            ],
            b"\0a\0",
        ));
        assert_eq!(
            e,
            BtfError::Truncated {
                id: 2,
                kind: "array",
                offset: 16,
                needed: 24,
                left: 16
            }
        );
        // Trailing bytes that are not a whole word.
        let mut bytes = raw(&[1, info(KIND_INT, 0, false), 4, 32], b"\0a\0");
        bytes.splice(40..40, [0, 0]);
        bytes[12..16].copy_from_slice(&18u32.to_ne_bytes());
        bytes[16..20].copy_from_slice(&18u32.to_ne_bytes());
        assert!(matches!(
            err(&bytes),
            BtfError::Truncated { id: 2, left: 2, .. }
        ));
    }

    #[test]
    fn unknown_kinds_are_refused_with_their_number() {
        for kind in [0, 20, 31] {
            let e = err(&raw(
                &[
                    1,
                    info(KIND_INT, 0, false),
                    4,
                    32,
                    1,
                    info(kind, 0, false),
                    4,
                ],
                b"\0a\0",
            ));
            assert_eq!(
                e,
                BtfError::UnknownKind {
                    id: 2,
                    offset: 16,
                    kind
                }
            );
            assert!(
                e.to_string().contains(&format!("unknown kind {kind}")),
                "{e}"
            );
        }
    }

    #[test]
    fn bad_type_ids_are_refused() {
        let btf = parse(&raw(&[1, info(KIND_PTR, 0, false), 7], b"\0a\0"));
        assert!(matches!(btf.get(1), Ok(Type::Ptr(Ref { type_id: 7, .. }))));
        for id in [2, 7, u32::MAX] {
            assert_eq!(btf.get(id), Err(BtfError::NoType { id, last: 1 }));
        }
        assert_eq!(
            btf.get(7).unwrap_err().to_string(),
            "type [7] does not exist (the BTF has types 0 to 1)"
        );
        let empty = parse(&raw(&[], b"\0"));
        assert_eq!((empty.first_id(), empty.last_id()), (1, 0));
        assert_eq!(empty.get(0), Ok(&Type::Void));
        assert_eq!(empty.get(1), Err(BtfError::NoType { id: 1, last: 0 }));
    }

    #[test]
    fn split_btf_continues_its_base() {
        let mut base = BtfBuilder::new();
        let int = base.add_int("int", 4, IntEncoding::Signed);
        let uint = base.add_int("unsigned int", 4, IntEncoding::Unsigned);
        let base_raw = base.to_bytes();
        let base_btf = parse(&base_raw);
        assert_eq!(
            (base_btf.last_id(), base_btf.str_len()),
            (2, base.str_len())
        );

        let mut split = BtfBuilder::new_split(base_btf.last_id(), base_btf.str_len());
        let td = split.add_typedef("__u32", uint);
        let s = split.add_struct(
            "pair",
            8,
            &[BtfMember::new("a", int, 0), BtfMember::new("b", td, 32)],
        );
        let split_raw = split.to_bytes();
        let btf = Btf::parse(&split_raw, Some(&base_btf)).expect("split");
        assert_eq!((btf.first_id(), btf.last_id()), (3, 4));
        assert_eq!((td, s), (3, 4));
        assert_eq!(btf.str_len(), split.str_len());
        assert_eq!(btf.base().map(Btf::last_id), Some(2));
        assert_eq!(btf.types().map(|(id, _)| id).collect::<Vec<_>>(), [3, 4]);

        // Base ids and names through the split object.
        let t = btf.get(int).unwrap();
        assert_eq!((t.kind_name(), named(&btf, t)), ("int", "int"));
        assert_eq!(btf.get(0), Ok(&Type::Void));
        let t = btf.get(td).unwrap();
        assert!(matches!(t, Type::Typedef(Ref { type_id, .. }) if *type_id == uint));
        assert_eq!(named(&btf, t), "__u32");
        assert!(
            t.name_off() >= base_btf.str_len(),
            "after the base's strings"
        );
        let Type::Struct(r) = btf.get(s).unwrap() else {
            panic!("struct")
        };
        let names: Vec<_> = r
            .members
            .iter()
            .map(|m| btf.name(m.name_off).unwrap())
            .collect();
        assert_eq!(names, ["a", "b"]);
        assert_eq!(btf.get(5), Err(BtfError::NoType { id: 5, last: 4 }));
        assert!(matches!(
            btf.name(btf.str_len()),
            Err(BtfError::StringOffset { .. })
        ));
        // The base knows nothing of the split object.
        assert_eq!(base_btf.get(td), Err(BtfError::NoType { id: td, last: 2 }));

        // Without its base, split BTF does not parse (its strings do not
        // start with the empty name).
        let e = Btf::parse(&split_raw, None).unwrap_err();
        assert!(e.to_string().contains("without its base"), "{e}");

        // Split BTF may have no strings of its own; it may be split on split
        // BTF too.
        let mut more = BtfBuilder::new_split(btf.last_id(), btf.str_len());
        let p = more.add_ptr(s);
        let more_raw = more.to_bytes();
        let more_btf = Btf::parse(&more_raw, Some(&btf)).expect("split on split");
        assert_eq!(more_btf.first_id(), 5);
        assert!(matches!(more_btf.get(p), Ok(Type::Ptr(Ref { type_id, .. })) if *type_id == s));
        assert!(matches!(more_btf.get(s), Ok(Type::Struct(_))));
        assert_eq!(more_btf.name(1), Ok("int"));
    }

    #[test]
    fn truncated_and_corrupted_btf_never_panics() {
        let mut b = BtfBuilder::new();
        let int = b.add_int("int", 4, IntEncoding::Signed);
        let bits = b.add_int_bits("unsigned int", 4, IntEncoding::Unsigned, 1, 3);
        let arr = b.add_array(int, 4);
        let s = b.add_struct(
            "s",
            24,
            &[
                BtfMember::bitfield("a", bits, 0, 3),
                BtfMember::new("b", arr, 32),
            ],
        );
        b.add_enum("e", 4, false, &[("A", 1), ("B", 2)]);
        b.add_enum64("e64", 8, true, &[("C", 3)]);
        let proto = b.add_func_proto(int, &[("x", s)]);
        b.add_func("f", proto, 1);
        let var = b.add_var("v", int, 1);
        b.add_datasec(".bss", 4, &[(var, 0, 4)]);
        b.add_decl_tag("t", s, 0);
        b.add_type_tag("tt", int);
        let good = b.to_bytes();
        let poke = |btf: &Btf| {
            for id in 0..=btf.last_id() + 1 {
                if let Ok(t) = btf.get(id) {
                    let _ = btf.name(t.name_off());
                }
            }
            for off in 0..=btf.str_len() + 1 {
                let _ = btf.name(off);
            }
        };
        poke(&parse(&good));
        for len in 0..good.len() {
            if let Ok(btf) = Btf::parse(&good[..len], None) {
                poke(&btf);
            }
        }
        let mut state: u64 = 0x9e37_79b9_7f4a_7c15;
        let mut next = move || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state
        };
        for _ in 0..5000 {
            let mut bad = good.clone();
            for _ in 0..1 + next() % 4 {
                let at = (next() as usize) % bad.len();
                bad[at] = next() as u8;
            }
            if let Ok(btf) = Btf::parse(&bad, None) {
                poke(&btf);
            }
        }
    }

    #[test]
    fn types_are_found_by_name_and_kind() {
        let mut base = BtfBuilder::new();
        let long = base.add_int("long", 8, IntEncoding::Signed);
        let proto = base.add_func_proto(long, &[]);
        let s = base.add_struct("count", 8, &[BtfMember::new("n", long, 0)]);
        let f = base.add_func("count", proto, 1);
        let base_btf = parse(&base.to_bytes());
        let func = |t: &Type| matches!(t, Type::Func(_));
        assert_eq!(base_btf.find("count", func), Some(f));
        assert_eq!(
            base_btf.find("count", |t| matches!(t, Type::Struct(_))),
            Some(s)
        );
        assert_eq!(
            base_btf.find("coun", func),
            None,
            "a prefix is not the name"
        );
        assert_eq!(base_btf.find("counts", func), None);
        assert_eq!(base_btf.find("long", func), None, "not a function");
        // Split BTF finds the base's types, and its own.
        let mut split = BtfBuilder::new_split(base_btf.last_id(), base_btf.str_len());
        let own = split.add_func("sum", proto, 1);
        let btf = Btf::parse(&split.to_bytes(), Some(&base_btf)).expect("split");
        assert_eq!(btf.find("count", func), Some(f));
        assert_eq!(btf.find("sum", func), Some(own));
        assert_eq!(base_btf.find("sum", func), None);
    }

    #[test]
    fn the_kernels_vmlinux_btf_parses() {
        const PATH: &str = "/sys/kernel/btf/vmlinux";
        let Ok(raw) = std::fs::read(PATH) else {
            eprintln!("{PATH} cannot be read: skipped");
            return;
        };
        let btf = parse(&raw);
        assert!(btf.last_id() > 1000, "{btf:?}");
        let iphdr = btf
            .types()
            .find(|(_, t)| matches!(t, Type::Struct(_)) && named(&btf, t) == "iphdr")
            .map(|(_, t)| t)
            .expect("struct iphdr");
        let Type::Struct(r) = iphdr else {
            unreachable!()
        };
        assert_eq!(r.size, 20);
        let names: Vec<_> = r
            .members
            .iter()
            .map(|m| btf.name(m.name_off).unwrap())
            .collect();
        for name in [
            "ihl", "version", "tos", "tot_len", "ttl", "protocol", "check",
        ] {
            assert!(names.contains(&name), "{name} missing from {names:?}");
        }
        // Every name and reference resolves.
        for (_, t) in btf.types() {
            btf.name(t.name_off()).expect("name");
        }
        // A look-up by name and kind finds what a walk of every type does.
        let func = |t: &Type| matches!(t, Type::Func(_));
        let walked = btf
            .types()
            .find(|(_, t)| func(t) && named(&btf, t) == "bpf_map_sum_elem_count")
            .map(|(id, _)| id);
        assert_eq!(btf.find("bpf_map_sum_elem_count", func), walked);
        assert!(
            btf.find("iphdr", |t| matches!(t, Type::Struct(_)))
                .is_some()
        );
    }
}
