//! [`BtfBuilder`]: writes raw BTF (the kernel's type format) for the maps
//! this process creates: the demo maps and the tests' maps. Reading BTF is
//! [`crate::btf`]'s; this is only the encoder.
//!
//! The layout follows `include/uapi/linux/btf.h`: a 24-byte header, the type
//! section, then the string section, in native byte order. Type ids are
//! implicit (the n-th record is id n, 0 is void), so every `add_*` returns
//! the id of the type it wrote; a reference may point forward, which is how
//! self-referential types are written (see [`BtfBuilder::next_id`]).
#![forbid(unsafe_code)]

use crate::btf::{
    KIND_ARRAY, KIND_CONST, KIND_DATASEC, KIND_DECL_TAG, KIND_ENUM, KIND_ENUM64, KIND_FLOAT,
    KIND_FUNC, KIND_FUNC_PROTO, KIND_FWD, KIND_INT, KIND_PTR, KIND_RESTRICT, KIND_STRUCT,
    KIND_TYPE_TAG, KIND_TYPEDEF, KIND_UNION, KIND_VAR, KIND_VOLATILE,
};

use std::collections::HashMap;

const MAGIC: u16 = 0xeb9f;
const HEADER_LEN: u32 = crate::btf::HEADER_LEN as u32;

/// Largest vlen (members, enumerators, parameters) a record can hold.
const MAX_VLEN: usize = 0xffff;

/// How an integer's bits are read (`BTF_INT_ENCODING`); the kernel accepts
/// one of these, not a combination.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IntEncoding {
    /// Unsigned integer.
    Unsigned,
    /// Signed integer (also what compilers emit for plain `char` on most
    /// targets, named "char").
    Signed,
    /// A character (`BTF_INT_CHAR`), read as unsigned.
    Char,
    /// A boolean (`BTF_INT_BOOL`).
    Bool,
}

impl IntEncoding {
    fn bits(self) -> u32 {
        match self {
            Self::Unsigned => 0,
            Self::Signed => 1,
            Self::Char => 2,
            Self::Bool => 4,
        }
    }
}

/// A member of a struct or union.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BtfMember<'a> {
    /// Member name; empty for an anonymous struct or union member.
    pub name: &'a str,
    /// The member's type id.
    pub type_id: u32,
    /// Offset from the start of the record, in bits.
    pub bit_offset: u32,
    /// Bitfield width in bits, 0 for a plain member.
    pub bitfield_size: u32,
}

impl<'a> BtfMember<'a> {
    /// A plain member at `bit_offset`.
    pub fn new(name: &'a str, type_id: u32, bit_offset: u32) -> Self {
        Self {
            name,
            type_id,
            bit_offset,
            bitfield_size: 0,
        }
    }

    /// A bitfield of `bits` bits at `bit_offset`.
    pub fn bitfield(name: &'a str, type_id: u32, bit_offset: u32, bits: u32) -> Self {
        Self {
            name,
            type_id,
            bit_offset,
            bitfield_size: bits,
        }
    }
}

/// Writes raw BTF, one type at a time.
///
/// The builder checks only what it must to produce well-formed records
/// (lengths that fit their fields); whether the types make sense is the
/// kernel's call, so tests can also write BTF the kernel refuses.
///
/// # Panics
/// The `add_*` methods panic when a record cannot be encoded: more than
/// 65,535 members or enumerators, a bitfield wider than 255 bits or a bit
/// offset of 2^24 or more in a record with bitfields, or a type section
/// past 4 GiB.
#[derive(Debug, Clone)]
pub struct BtfBuilder {
    types: Vec<u8>,
    strings: Vec<u8>,
    string_offsets: HashMap<String, u32>,
    next_id: u32,
    str_base: u32,
    array_index: Option<u32>,
}

impl Default for BtfBuilder {
    fn default() -> Self {
        Self::new()
    }
}

fn info(kind: u32, vlen: usize, kind_flag: bool) -> u32 {
    assert!(
        vlen <= MAX_VLEN,
        "a BTF record holds at most {MAX_VLEN} entries, not {vlen}"
    );
    (u32::from(kind_flag) << 31) | (kind << 24) | vlen as u32
}

impl BtfBuilder {
    /// An empty, stand-alone BTF object.
    pub fn new() -> Self {
        Self {
            types: Vec::new(),
            strings: vec![0],
            string_offsets: HashMap::from([(String::new(), 0)]),
            next_id: 1,
            str_base: 0,
            array_index: None,
        }
    }

    /// Split BTF on top of a base with `base_nr_types` types (void not
    /// counted) and a `base_str_len`-byte string section: ids and string
    /// offsets continue the base's, as in a kernel module's BTF. Types of
    /// the base are referred to by their ids; their names are not shared.
    pub fn new_split(base_nr_types: u32, base_str_len: u32) -> Self {
        Self {
            types: Vec::new(),
            strings: Vec::new(),
            string_offsets: HashMap::from([(String::new(), 0)]),
            next_id: base_nr_types + 1,
            str_base: base_str_len,
            array_index: None,
        }
    }

    /// The id the next `add_*` call returns, for types that refer to a type
    /// written after them (`struct node { struct node *next; }`).
    pub fn next_id(&self) -> u32 {
        self.next_id
    }

    /// Length of the string section so far, including the base's for split
    /// BTF (what [`BtfBuilder::new_split`] takes for a base).
    pub fn str_len(&self) -> u32 {
        self.str_base + self.strings.len() as u32
    }

    /// Offset of `s` in the string section, adding it once.
    fn string(&mut self, s: &str) -> u32 {
        if let Some(&off) = self.string_offsets.get(s) {
            return off;
        }
        let off = self.str_len();
        self.strings.extend_from_slice(s.as_bytes());
        self.strings.push(0);
        self.string_offsets.insert(s.to_owned(), off);
        off
    }

    fn word(&mut self, v: u32) {
        self.types.extend_from_slice(&v.to_ne_bytes());
    }

    /// Writes the common `struct btf_type` and returns the new type's id.
    fn record(&mut self, name: &str, info: u32, size_or_type: u32) -> u32 {
        let name_off = self.string(name);
        self.word(name_off);
        self.word(info);
        self.word(size_or_type);
        let id = self.next_id;
        self.next_id += 1;
        id
    }

    /// An integer of `size` bytes (1, 2, 4, 8 or 16) using all its bits.
    pub fn add_int(&mut self, name: &str, size: u32, encoding: IntEncoding) -> u32 {
        self.add_int_bits(name, size, encoding, 0, size * 8)
    }

    /// An integer whose value is `bits` bits starting `offset` bits in: the
    /// types of bitfields in the encoding that predates `kind_flag`.
    pub fn add_int_bits(
        &mut self,
        name: &str,
        size: u32,
        encoding: IntEncoding,
        offset: u32,
        bits: u32,
    ) -> u32 {
        let id = self.record(name, info(KIND_INT, 0, false), size);
        self.word((encoding.bits() << 24) | ((offset & 0xff) << 16) | (bits & 0xff));
        id
    }

    /// A floating-point type of `size` bytes.
    pub fn add_float(&mut self, name: &str, size: u32) -> u32 {
        self.record(name, info(KIND_FLOAT, 0, false), size)
    }

    /// A pointer to `target` (0 for `void *`).
    pub fn add_ptr(&mut self, target: u32) -> u32 {
        self.record("", info(KIND_PTR, 0, false), target)
    }

    /// An array of `len` elements of type `element`. Its index type (which
    /// the kernel requires) is an unsigned int added on first use.
    pub fn add_array(&mut self, element: u32, len: u32) -> u32 {
        let index = match self.array_index {
            Some(id) => id,
            None => {
                let id = self.add_int("__ARRAY_SIZE_TYPE__", 4, IntEncoding::Unsigned);
                self.array_index = Some(id);
                id
            }
        };
        let id = self.record("", info(KIND_ARRAY, 0, false), 0);
        self.word(element);
        self.word(index);
        self.word(len);
        id
    }

    fn add_record(&mut self, kind: u32, name: &str, size: u32, members: &[BtfMember<'_>]) -> u32 {
        let kind_flag = members.iter().any(|m| m.bitfield_size != 0);
        let id = self.record(name, info(kind, members.len(), kind_flag), size);
        for m in members {
            let name_off = self.string(m.name);
            self.word(name_off);
            self.word(m.type_id);
            if kind_flag {
                assert!(
                    m.bitfield_size <= 0xff && m.bit_offset <= 0xff_ffff,
                    "bitfield {} of {} bits at bit {} cannot be encoded",
                    m.name,
                    m.bitfield_size,
                    m.bit_offset
                );
                self.word((m.bitfield_size << 24) | m.bit_offset);
            } else {
                self.word(m.bit_offset);
            }
        }
        id
    }

    /// A struct of `size` bytes. When a member is a bitfield, the record is
    /// written with `kind_flag` set (every offset carries its width).
    pub fn add_struct(&mut self, name: &str, size: u32, members: &[BtfMember<'_>]) -> u32 {
        self.add_record(KIND_STRUCT, name, size, members)
    }

    /// A union of `size` bytes (see [`BtfBuilder::add_struct`]).
    pub fn add_union(&mut self, name: &str, size: u32, members: &[BtfMember<'_>]) -> u32 {
        self.add_record(KIND_UNION, name, size, members)
    }

    /// An enum of `size` bytes (1, 2, 4 or 8) with 32-bit values: each value
    /// is stored as its low 32 bits.
    pub fn add_enum(&mut self, name: &str, size: u32, signed: bool, values: &[(&str, i64)]) -> u32 {
        let id = self.record(name, info(KIND_ENUM, values.len(), signed), size);
        for &(name, value) in values {
            let name_off = self.string(name);
            self.word(name_off);
            self.word(value as u32);
        }
        id
    }

    /// An enum with 64-bit values (`BTF_KIND_ENUM64`).
    pub fn add_enum64(
        &mut self,
        name: &str,
        size: u32,
        signed: bool,
        values: &[(&str, u64)],
    ) -> u32 {
        let id = self.record(name, info(KIND_ENUM64, values.len(), signed), size);
        for &(name, value) in values {
            let name_off = self.string(name);
            self.word(name_off);
            self.word(value as u32);
            self.word((value >> 32) as u32);
        }
        id
    }

    /// A forward declaration of a struct (or union).
    pub fn add_fwd(&mut self, name: &str, is_union: bool) -> u32 {
        self.record(name, info(KIND_FWD, 0, is_union), 0)
    }

    /// `typedef target name`.
    pub fn add_typedef(&mut self, name: &str, target: u32) -> u32 {
        self.record(name, info(KIND_TYPEDEF, 0, false), target)
    }

    /// `const target`.
    pub fn add_const(&mut self, target: u32) -> u32 {
        self.record("", info(KIND_CONST, 0, false), target)
    }

    /// `volatile target`.
    pub fn add_volatile(&mut self, target: u32) -> u32 {
        self.record("", info(KIND_VOLATILE, 0, false), target)
    }

    /// `restrict target`.
    pub fn add_restrict(&mut self, target: u32) -> u32 {
        self.record("", info(KIND_RESTRICT, 0, false), target)
    }

    /// `target __attribute__((btf_type_tag(tag)))`. The kernel accepts type
    /// tags only right after a pointer (before any modifier).
    pub fn add_type_tag(&mut self, tag: &str, target: u32) -> u32 {
        self.record(tag, info(KIND_TYPE_TAG, 0, false), target)
    }

    /// `btf_decl_tag(tag)` on `target` (a struct, union, var, func or
    /// typedef), or on its member or parameter `component` (-1 for the
    /// whole declaration).
    pub fn add_decl_tag(&mut self, tag: &str, target: u32, component: i32) -> u32 {
        let id = self.record(tag, info(KIND_DECL_TAG, 0, false), target);
        self.word(component as u32);
        id
    }

    /// A function prototype: return type and named parameters.
    pub fn add_func_proto(&mut self, ret: u32, params: &[(&str, u32)]) -> u32 {
        let id = self.record("", info(KIND_FUNC_PROTO, params.len(), false), ret);
        for &(name, type_id) in params {
            let name_off = self.string(name);
            self.word(name_off);
            self.word(type_id);
        }
        id
    }

    /// A function of prototype `proto` (linkage 0 static, 1 global).
    pub fn add_func(&mut self, name: &str, proto: u32, linkage: u32) -> u32 {
        self.record(name, info(KIND_FUNC, linkage as usize, false), proto)
    }

    /// A variable (linkage 0 static, 1 global).
    pub fn add_var(&mut self, name: &str, type_id: u32, linkage: u32) -> u32 {
        let id = self.record(name, info(KIND_VAR, 0, false), type_id);
        self.word(linkage);
        id
    }

    /// A data section of `size` bytes holding `vars` as (var id, offset,
    /// size), in ascending offset order.
    pub fn add_datasec(&mut self, name: &str, size: u32, vars: &[(u32, u32, u32)]) -> u32 {
        let id = self.record(name, info(KIND_DATASEC, vars.len(), false), size);
        for &(var, offset, size) in vars {
            self.word(var);
            self.word(offset);
            self.word(size);
        }
        id
    }

    /// The raw BTF: header, types, strings.
    pub fn to_bytes(&self) -> Vec<u8> {
        let type_len = u32::try_from(self.types.len()).expect("type section past 4 GiB");
        let str_len = u32::try_from(self.strings.len()).expect("string section past 4 GiB");
        let mut out =
            Vec::with_capacity(HEADER_LEN as usize + self.types.len() + self.strings.len());
        out.extend_from_slice(&MAGIC.to_ne_bytes());
        out.push(1); // version
        out.push(0); // flags
        // hdr_len, type_off, type_len, str_off, str_len: offsets are from
        // the end of the header, types first.
        for v in [HEADER_LEN, 0, type_len, type_len, str_len] {
            out.extend_from_slice(&v.to_ne_bytes());
        }
        out.extend_from_slice(&self.types);
        out.extend_from_slice(&self.strings);
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{CreateMap, MapType, OwnedBtf, OwnedMap};

    /// Every kind the builder writes, in a shape the kernel accepts, with a
    /// 16-byte key and a value type for a hash map.
    fn every_kind() -> (Vec<u8>, u32, u32) {
        let mut b = BtfBuilder::new();
        let u32_ = b.add_int("unsigned int", 4, IntEncoding::Unsigned);
        let int = b.add_int("int", 4, IntEncoding::Signed);
        let ch = b.add_int("char", 1, IntEncoding::Char);
        let boolean = b.add_int("_Bool", 1, IntEncoding::Bool);
        let legacy = b.add_int_bits("unsigned int", 4, IntEncoding::Unsigned, 0, 3);
        let u128_ = b.add_int("unsigned __int128", 16, IntEncoding::Unsigned);
        let double = b.add_float("double", 8);
        let u32_t = b.add_typedef("__u32", u32_);
        let cv = b.add_const(int);
        let vcv = b.add_volatile(cv);
        let opaque = b.add_fwd("opaque", false);
        let p_opaque = b.add_ptr(opaque);
        let p_int = b.add_ptr(int);
        let rp = b.add_restrict(p_int);
        let tagged = b.add_type_tag("user", int);
        let p_tagged = b.add_ptr(tagged);
        let name = b.add_array(ch, 8);
        let color = b.add_enum("color", 4, true, &[("RED", 0), ("NEG", -1)]);
        let big = b.add_enum64("big", 8, false, &[("HUGE", u64::MAX)]);
        let inner = b.add_union(
            "",
            4,
            &[BtfMember::new("i", int, 0), BtfMember::new("u", u32_t, 0)],
        );
        let old = b.add_struct(
            "old",
            4,
            &[
                BtfMember::new("a", legacy, 0),
                BtfMember::new("b", legacy, 3),
            ],
        );
        let key = b.add_struct(
            "key",
            16,
            &[
                BtfMember::new("a", u32_t, 0),
                BtfMember::new("b", vcv, 32),
                BtfMember::new("c", inner, 64),
                BtfMember::new("d", old, 96),
            ],
        );
        let value = b.add_struct(
            "value",
            64,
            &[
                BtfMember::bitfield("flag", boolean, 0, 1),
                BtfMember::bitfield("kind", color, 1, 3),
                BtfMember::new("x", double, 64),
                BtfMember::new("name", name, 128),
                BtfMember::new("big", big, 192),
                BtfMember::new("wide", u128_, 256),
                BtfMember::new("rp", rp, 384),
                BtfMember::new("op", p_opaque, 448),
            ],
        );
        // Kinds that only describe code: accepted in BTF, never map types.
        let proto = b.add_func_proto(int, &[("arg", p_tagged)]);
        b.add_func("f", proto, 1);
        let var = b.add_var("counter", int, 1);
        b.add_datasec(".data", 4, &[(var, 0, 4)]);
        b.add_decl_tag("annotated", value, 0);
        (b.to_bytes(), key, value)
    }

    #[test]
    fn the_kernel_accepts_every_kind_and_types_a_map_with_it() {
        let (raw, key, value) = every_kind();
        let btf = OwnedBtf::load(&raw).unwrap_or_else(|e| {
            panic!("BPF_BTF_LOAD refused the builder's output ({e}); these tests need root and BPF")
        });
        let info = btf.info().expect("BTF info");
        assert_eq!(info.data, raw, "the kernel hands back the bytes it loaded");
        assert!(!info.kernel_btf);
        assert_eq!(info.name, "");
        let map = OwnedMap::create(&CreateMap {
            map_type: MapType::HASH.0,
            key_size: 16,
            value_size: 64,
            max_entries: 4,
            name: "btf_kinds",
            btf: Some(btf.for_map(key, value)),
            ..Default::default()
        })
        .expect("typed hash map");
        let meta = map.meta();
        assert_eq!(meta.btf_id, info.id);
        assert_eq!((meta.btf_key_type_id, meta.btf_value_type_id), (key, value));
        assert_eq!(crate::read_btf(meta.btf_id).expect("read back").data, raw);
    }

    #[test]
    fn the_kernel_checks_the_types_against_the_map() {
        let (raw, key, value) = every_kind();
        let btf = OwnedBtf::load(&raw).expect("BTF load");
        let create = |key_size| {
            OwnedMap::create(&CreateMap {
                map_type: MapType::HASH.0,
                key_size,
                value_size: 64,
                max_entries: 4,
                name: "btf_mismatch",
                btf: Some(btf.for_map(key, value)),
                ..Default::default()
            })
        };
        assert!(create(16).is_ok());
        assert_eq!(create(12).unwrap_err().errno(), Some(libc::EINVAL));
    }

    #[test]
    fn a_refused_load_carries_the_kernel_log() {
        let mut b = BtfBuilder::new();
        let int = b.add_int("int", 4, IntEncoding::Signed);
        b.add_typedef("", int);
        let e = OwnedBtf::load(&b.to_bytes()).unwrap_err();
        assert_eq!(e.errno(), Some(libc::EINVAL), "{e}");
        let msg = e.to_string();
        assert!(
            msg.contains("TYPEDEF") && msg.contains("Invalid name"),
            "{msg}"
        );
    }

    #[test]
    fn strings_are_shared_and_ids_follow_the_order_of_writing() {
        let mut b = BtfBuilder::new();
        let a = b.add_int("int", 4, IntEncoding::Signed);
        let next = b.next_id();
        let p = b.add_ptr(next + 1);
        let s = b.add_struct("int", 8, &[BtfMember::new("p", p, 0)]);
        assert_eq!((a, p, s), (1, 2, 3));
        assert_eq!(b.str_len(), 7, "\"\\0int\\0p\\0\": \"int\" written once");
        let split = BtfBuilder::new_split(3, b.str_len());
        assert_eq!((split.next_id(), split.str_len()), (4, 7));
    }
}
