//! Types declared from outside, for maps whose BTF does not say (bpftrace's
//! maps, maps created by sizes): a C type as a program would declare it
//! (`char[16]`, `__u64`, `struct { __be32 addr; __u16 port; }`), laid out
//! as a C compiler lays it out on the hosts bpfmapd runs on (x86-64,
//! arm64: natural alignment, `long` of 8 bytes), described as the
//! [`TypeInfo`] GetMap gives, which every reader then decodes.
//!
//! What is understood: the integer types of C (`int`, `unsigned long`,
//! ...), of the kernel (`__u8` to `__u64`, `__s8` to `__s64`, `__be16`,
//! `__be32`, `__be64` in network order, `u32`, `s64`, ...) and of
//! `<stdint.h>` (`uint32_t`, ...); `char`, `_Bool`/`bool`, `float`,
//! `double`; arrays of any of them (`__u32[26]`, `char comm[16]` inside a
//! struct, `__u8[4][4]`); anonymous `struct` and `union` with members,
//! nested, bitfields (`__u32 flags:4;`) and `__attribute__((packed))`.

use super::{TypeError, err};
use crate::v1::{
    ArrayType, BoolType, CharType, FloatType, IntType, Member, RecordType, TypeInfo, type_info,
};

/// Longest declaration read, in bytes.
const MAX_DECLARATION: usize = 4096;
/// Deepest nesting of structs, unions and arrays.
const MAX_NESTING: usize = 16;
/// Largest declared type, in bytes (a map's value is at most this).
const MAX_SIZE: u64 = 1 << 24;

/// Parses a C type (`what` names it in errors: "key", "value").
pub fn parse_c_type(text: &str, what: &str) -> Result<TypeInfo, TypeError> {
    if text.len() > MAX_DECLARATION {
        return Err(err(
            what,
            format!("a declaration is at most {MAX_DECLARATION} bytes"),
        ));
    }
    let mut p = Parser {
        tokens: tokenize(text).map_err(|e| err(what, e.to_string()))?,
        at: 0,
        depth: 0,
    };
    let parsed = p.type_name().and_then(|t| {
        let t = p.array_suffix(t)?;
        p.optional(";");
        match p.peek() {
            None => Ok(t),
            Some(tok) => Err(DeclError::Trailing(tok.to_owned())),
        }
    });
    parsed.map(|t| t.info).map_err(|e| {
        err(
            what,
            format!(
                "{e} (declare a C type: char[16], __u64, struct {{ __be32 addr; __u16 port; }})"
            ),
        )
    })
}

/// What is wrong with a declaration.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
enum DeclError {
    #[error("unexpected character {0:?}")]
    Character(char),
    #[error("unexpected {0:?} after the type")]
    Trailing(String),
    #[error("expected {wanted:?}{}", found_text(found))]
    Expected {
        wanted: String,
        found: Option<String>,
    },
    #[error("no type given")]
    NoType,
    #[error("unknown type {0:?}")]
    UnknownType(String),
    #[error("{0:?} is not a C type")]
    NotCType(String),
    #[error("{0:?} is not a type bpfmapd reads")]
    Unreadable(String),
    #[error("an array needs a length")]
    NoLength,
    #[error("array length {0:?} is not a number of at most 2^32 - 1")]
    Length(String),
    #[error("the type is larger than {MAX_SIZE} bytes")]
    TooLarge,
    #[error("structs nest at most {MAX_NESTING} deep")]
    Nesting,
    #[error("a struct or union is not closed with \"}}\"")]
    Unclosed,
    #[error("a struct or union needs members")]
    NoMembers,
    #[error("unknown attribute {0:?}")]
    Attribute(String),
    #[error("an attribute is not closed")]
    UnclosedAttribute,
    #[error("a member needs a name (only structs, unions and bitfields are unnamed)")]
    Unnamed,
    #[error("{0}: a bitfield of width 0 has no name")]
    NamedZeroWidth(String),
    #[error("a bitfield needs a width")]
    NoWidth,
    #[error("bitfield width {0:?} is not a number")]
    Width(String),
    #[error("{0}: only integers are bitfields")]
    NotInteger(String),
    #[error("{name}: {bits} bits do not fit its type")]
    TooWide { name: String, bits: u32 },
}

/// What an `Expected` found instead.
fn found_text(found: &Option<String>) -> String {
    match found {
        Some(t) => format!(", found {t:?}"),
        None => " at the end".into(),
    }
}

/// A parsed type: its description and its alignment.
#[derive(Clone)]
struct Ty {
    info: TypeInfo,
    align: u64,
}

struct Parser {
    tokens: Vec<String>,
    at: usize,
    depth: usize,
}

fn tokenize(text: &str) -> Result<Vec<String>, DeclError> {
    let mut out = Vec::new();
    let mut chars = text.char_indices().peekable();
    while let Some(&(i, c)) = chars.peek() {
        if c.is_whitespace() {
            chars.next();
        } else if c.is_ascii_alphanumeric() || c == '_' {
            let mut end = i;
            while let Some(&(j, d)) = chars.peek() {
                if d.is_ascii_alphanumeric() || d == '_' {
                    end = j + d.len_utf8();
                    chars.next();
                } else {
                    break;
                }
            }
            out.push(text[i..end].to_owned());
        } else if "{}[];:(),*".contains(c) {
            out.push(c.to_string());
            chars.next();
        } else {
            return Err(DeclError::Character(c));
        }
    }
    Ok(out)
}

impl Parser {
    fn peek(&self) -> Option<&str> {
        self.tokens.get(self.at).map(String::as_str)
    }

    fn next(&mut self) -> Option<String> {
        let t = self.tokens.get(self.at).cloned();
        self.at += 1;
        t
    }

    fn optional(&mut self, tok: &str) -> bool {
        if self.peek() == Some(tok) {
            self.at += 1;
            true
        } else {
            false
        }
    }

    fn expect(&mut self, tok: &str) -> Result<(), DeclError> {
        match self.next() {
            Some(t) if t == tok => Ok(()),
            found => Err(DeclError::Expected {
                wanted: tok.to_owned(),
                found,
            }),
        }
    }

    /// A type without its array suffix: a record or a scalar.
    fn type_name(&mut self) -> Result<Ty, DeclError> {
        while matches!(self.peek(), Some("const" | "volatile")) {
            self.at += 1;
        }
        match self.peek() {
            Some(kw @ ("struct" | "union")) => {
                let union = kw == "union";
                self.at += 1;
                self.record(union)
            }
            Some(_) => self.scalar(),
            None => Err(DeclError::NoType),
        }
    }

    /// `[N]...` after a type or a member's name.
    fn array_suffix(&mut self, element: Ty) -> Result<Ty, DeclError> {
        let mut lengths = Vec::new();
        while self.optional("[") {
            let n = self.next().ok_or(DeclError::NoLength)?;
            let n: u32 = n.parse().map_err(|_| DeclError::Length(n.clone()))?;
            self.expect("]")?;
            lengths.push(n);
        }
        // int a[2][3] is an array of 2 arrays of 3.
        let mut t = element;
        for n in lengths.into_iter().rev() {
            let size = u64::from(t.info.size) * u64::from(n);
            if size > MAX_SIZE {
                return Err(DeclError::TooLarge);
            }
            t = Ty {
                info: TypeInfo {
                    name: String::new(),
                    size: size as u32,
                    kind: Some(type_info::Kind::Array(Box::new(ArrayType {
                        element: Some(Box::new(t.info)),
                        length: n,
                    }))),
                },
                align: t.align,
            };
        }
        Ok(t)
    }

    /// `{ members } [__attribute__((packed))]` (after `struct`/`union`,
    /// a tag name allowed and ignored).
    fn record(&mut self, union: bool) -> Result<Ty, DeclError> {
        self.depth += 1;
        if self.depth > MAX_NESTING {
            return Err(DeclError::Nesting);
        }
        let mut packed = self.attributes()?;
        if self.peek().is_some_and(|t| t != "{") {
            self.at += 1; // a tag: struct flow { ... }
        }
        self.expect("{")?;
        let mut members = Vec::new();
        while !self.optional("}") {
            if self.peek().is_none() {
                return Err(DeclError::Unclosed);
            }
            members.extend(self.members()?);
        }
        packed |= self.attributes()?;
        self.depth -= 1;
        if members.is_empty() {
            return Err(DeclError::NoMembers);
        }
        lay_out(members, union, packed)
    }

    /// `__attribute__((packed))`, if there; whether it says packed.
    fn attributes(&mut self) -> Result<bool, DeclError> {
        let mut packed = false;
        while matches!(self.peek(), Some("__attribute__" | "__attribute")) {
            self.at += 1;
            self.expect("(")?;
            self.expect("(")?;
            while !self.optional(")") {
                match self.next().as_deref() {
                    Some("packed" | "__packed__") => packed = true,
                    Some(",") => {}
                    Some(other) => return Err(DeclError::Attribute(other.to_owned())),
                    None => return Err(DeclError::UnclosedAttribute),
                }
            }
            self.expect(")")?;
        }
        Ok(packed)
    }

    /// One declaration of members: `TYPE DECLARATOR[, DECLARATOR...];`,
    /// each declarator `[NAME][[N]...] [: BITS]` (`__u8 ihl:4, version:4;`,
    /// an unnamed bitfield `__u32 :3;` pads).
    fn members(&mut self) -> Result<Vec<Declared>, DeclError> {
        let base = self.type_name()?;
        let mut out = Vec::new();
        loop {
            out.push(self.declarator(&base)?);
            if !self.optional(",") {
                break;
            }
        }
        self.expect(";")?;
        Ok(out)
    }

    /// One declarator of a member of type `base`.
    fn declarator(&mut self, base: &Ty) -> Result<Declared, DeclError> {
        let name = match self.peek() {
            Some(t) if is_identifier(t) => self.next().unwrap_or_default(),
            _ => String::new(),
        };
        let ty = self.array_suffix(base.clone())?;
        let bits = match self.optional(":") {
            true => Some(self.bitfield_width(&name, &ty)?),
            false => None,
        };
        let record = matches!(
            ty.info.kind,
            Some(type_info::Kind::Struct(_) | type_info::Kind::Union(_))
        );
        if name.is_empty() && bits.is_none() && !record {
            return Err(DeclError::Unnamed);
        }
        if bits == Some(0) && !name.is_empty() {
            return Err(DeclError::NamedZeroWidth(name));
        }
        Ok(Declared { name, ty, bits })
    }

    /// The width after `NAME :`.
    fn bitfield_width(&mut self, name: &str, ty: &Ty) -> Result<u32, DeclError> {
        let n = self.next().ok_or(DeclError::NoWidth)?;
        let bits: u32 = n.parse().map_err(|_| DeclError::Width(n.clone()))?;
        let integer = matches!(
            ty.info.kind,
            Some(type_info::Kind::Int(_) | type_info::Kind::Char(_) | type_info::Kind::Bool(_))
        );
        if !integer {
            return Err(DeclError::NotInteger(name.to_owned()));
        }
        if bits > ty.info.size * 8 {
            return Err(DeclError::TooWide {
                name: name.to_owned(),
                bits,
            });
        }
        Ok(bits)
    }

    /// A scalar type: a run of C keywords, or one typedef name.
    fn scalar(&mut self) -> Result<Ty, DeclError> {
        let mut words = Vec::new();
        while let Some(t) = self.peek() {
            if C_WORDS.contains(&t) {
                words.push(t.to_owned());
                self.at += 1;
            } else {
                break;
            }
        }
        if words.is_empty() {
            let name = self.next().ok_or(DeclError::NoType)?;
            return named(&name).ok_or(DeclError::UnknownType(name));
        }
        c_type(&words)
    }
}

/// A member before layout: a bitfield has a width (an unnamed one only
/// pads; of width 0, it moves the next bitfield to a new unit).
struct Declared {
    name: String,
    ty: Ty,
    bits: Option<u32>,
}

/// Lays members out as C does: each at its alignment (bitfields packed
/// into their type's units), the record's size rounded up to its
/// alignment; with `packed`, no padding.
fn lay_out(members: Vec<Declared>, union: bool, packed: bool) -> Result<Ty, DeclError> {
    let mut bit = 0u64; // next free bit
    let mut size = 0u64;
    let mut align = 1u64;
    let mut out = Vec::new();
    for m in members {
        let a = if packed { 1 } else { m.ty.align };
        let unit = a * 8;
        let member_bits = u64::from(m.ty.info.size) * 8;
        let (at, width) = match m.bits {
            _ if union => (0, m.bits.map_or(member_bits, u64::from)),
            // Width 0: the next bitfield starts a new unit.
            Some(0) => {
                bit = bit.div_ceil(unit) * unit;
                continue;
            }
            // A bitfield starts where it fits in one aligned unit of its
            // type.
            Some(bits) => {
                let bits = u64::from(bits);
                let fits = (bit % unit) + bits <= unit.max(member_bits);
                (
                    if fits || packed {
                        bit
                    } else {
                        bit.div_ceil(unit) * unit
                    },
                    bits,
                )
            }
            None => (bit.div_ceil(unit) * unit, member_bits),
        };
        bit = if union { 0 } else { at + width };
        size = size.max((at + width).div_ceil(8));
        if m.name.is_empty() && m.bits.is_some() {
            continue; // an unnamed bitfield pads, and does not align the record
        }
        align = align.max(a);
        out.push(Member {
            name: m.name,
            bit_offset: at as u32,
            bitfield_size: m.bits.unwrap_or(0),
            r#type: Some(m.ty.info),
        });
    }
    let size = size.div_ceil(align) * align;
    if size > MAX_SIZE {
        return Err(DeclError::TooLarge);
    }
    let record = RecordType { members: out };
    Ok(Ty {
        info: TypeInfo {
            name: String::new(),
            size: size as u32,
            kind: Some(if union {
                type_info::Kind::Union(record)
            } else {
                type_info::Kind::Struct(record)
            }),
        },
        align,
    })
}

fn is_identifier(t: &str) -> bool {
    t.starts_with(|c: char| c.is_ascii_alphabetic() || c == '_') && !C_WORDS.contains(&t)
}

/// The words C builds its integer and floating types of.
const C_WORDS: [&str; 10] = [
    "signed", "unsigned", "char", "short", "int", "long", "float", "double", "_Bool", "bool",
];

/// A C type spelled in keywords ("unsigned long long").
fn c_type(words: &[String]) -> Result<Ty, DeclError> {
    let count = |w: &str| words.iter().filter(|x| *x == w).count();
    let spelled = words.join(" ");
    let unsigned = count("unsigned") > 0;
    if count("unsigned") + count("signed") > 1 {
        return Err(DeclError::NotCType(spelled));
    }
    let scalars = count("_Bool") + count("bool") + count("float") + count("double");
    if scalars > 0 && words.len() > 1 {
        return Err(DeclError::Unreadable(spelled));
    }
    let bytes = match (count("char"), count("short"), count("long"), count("int")) {
        _ if count("_Bool") + count("bool") == 1 && words.len() == 1 => {
            return Ok(scalar("_Bool", 1, type_info::Kind::Bool(BoolType {})));
        }
        _ if count("float") == 1 && words.len() == 1 => {
            return Ok(scalar("float", 4, type_info::Kind::Float(FloatType {})));
        }
        _ if count("double") == 1 && words.len() == 1 => {
            return Ok(scalar("double", 8, type_info::Kind::Float(FloatType {})));
        }
        (1, 0, 0, 0) => {
            // A plain char is signed, as on x86-64.
            let kind = type_info::Kind::Char(CharType { signed: !unsigned });
            return Ok(scalar(&spelled, 1, kind));
        }
        (0, 1, 0, 0 | 1) => 2,
        (0, 0, 1 | 2, 0 | 1) => 8,
        (0, 0, 0, 1) | (0, 0, 0, 0) if count("unsigned") + count("signed") + count("int") > 0 => 4,
        _ => return Err(DeclError::NotCType(spelled)),
    };
    Ok(int(&spelled, bytes, !unsigned, false))
}

/// A typedef name of the kernel's, `<stdint.h>`'s or libbpf's.
fn named(name: &str) -> Option<Ty> {
    let (bytes, signed, big_endian) = match name {
        "__u8" | "u8" | "uint8_t" => (1, false, false),
        "__s8" | "s8" | "int8_t" => (1, true, false),
        "__u16" | "u16" | "uint16_t" | "__le16" => (2, false, false),
        "__s16" | "s16" | "int16_t" => (2, true, false),
        "__u32" | "u32" | "uint32_t" | "__le32" => (4, false, false),
        "__s32" | "s32" | "int32_t" => (4, true, false),
        "__u64" | "u64" | "uint64_t" | "__le64" | "size_t" => (8, false, false),
        "__s64" | "s64" | "int64_t" | "ssize_t" => (8, true, false),
        "__be16" | "__sum16" => (2, false, true),
        "__be32" | "__wsum" => (4, false, true),
        "__be64" => (8, false, true),
        _ => return None,
    };
    Some(int(name, bytes, signed, big_endian))
}

fn int(name: &str, bytes: u32, signed: bool, big_endian: bool) -> Ty {
    scalar(
        name,
        bytes,
        type_info::Kind::Int(IntType { signed, big_endian }),
    )
}

fn scalar(name: &str, bytes: u32, kind: type_info::Kind) -> Ty {
    Ty {
        info: TypeInfo {
            name: name.to_owned(),
            size: bytes,
            kind: Some(kind),
        },
        align: u64::from(bytes),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::typed::Layout;

    fn json(t: &TypeInfo, bytes: &[u8]) -> String {
        let layout = Layout::new(t, "value").expect("a usable type");
        let mut out = Vec::new();
        layout.write_json(bytes, &mut out);
        String::from_utf8(out).unwrap()
    }

    #[test]
    fn scalars_arrays_and_typedefs() {
        for (text, size) in [
            ("__u64", 8),
            ("unsigned long long", 8),
            ("long", 8),
            ("unsigned int", 4),
            ("unsigned", 4),
            ("short int", 2),
            ("char[16]", 16),
            ("__u32[26]", 104),
            ("uint8_t[4][4]", 16),
            ("_Bool", 1),
            ("double", 8),
        ] {
            let t = parse_c_type(text, "value").unwrap_or_else(|e| panic!("{text}: {e}"));
            assert_eq!(t.size, size, "{text}");
        }
        let comm = parse_c_type("char[16]", "key").unwrap();
        assert_eq!(json(&comm, b"bash\0\0\0\0\0\0\0\0\0\0\0\0"), r#""bash""#);
        let be = parse_c_type("__be16", "key").unwrap();
        assert_eq!(json(&be, &[1, 187]), "443");
    }

    #[test]
    fn structs_are_laid_out_as_c_lays_them_out() {
        let t = parse_c_type(
            "struct { __be32 addr; __u16 port; __u64 bytes; char comm[3]; }",
            "value",
        )
        .unwrap();
        // addr 0, port 4, (pad 2) bytes 8, comm 16, size rounded to 24.
        assert_eq!(t.size, 24);
        let Some(type_info::Kind::Struct(r)) = &t.kind else {
            panic!("a struct")
        };
        let offsets: Vec<u32> = r.members.iter().map(|m| m.bit_offset / 8).collect();
        assert_eq!(offsets, [0, 4, 8, 16]);
        let mut bytes = vec![0u8; 24];
        bytes[..4].copy_from_slice(&[10, 0, 0, 1]);
        bytes[4..6].copy_from_slice(&443u16.to_le_bytes());
        bytes[8..16].copy_from_slice(&7u64.to_le_bytes());
        bytes[16..19].copy_from_slice(b"ab\0");
        assert_eq!(
            json(&t, &bytes),
            r#"{"addr":167772161,"port":443,"bytes":"7","comm":"ab"}"#
        );
        let packed = parse_c_type(
            "struct __attribute__((packed)) { __u8 a; __u32 b; }",
            "value",
        )
        .unwrap();
        assert_eq!(packed.size, 5);
        let u = parse_c_type("union { __u64 packets; __u64 rx_packets; }", "value").unwrap();
        assert_eq!(u.size, 8);
        let bits = parse_c_type("struct { __u32 a:4; __u32 b:4; __u16 c; }", "value").unwrap();
        assert_eq!(bits.size, 4);
        // iphdr's first byte, two declarators; unnamed and zero-width
        // bitfields pad.
        let iphdr = parse_c_type("struct { __u8 ihl:4, version:4; __u8 tos; }", "value").unwrap();
        assert_eq!(iphdr.size, 2);
        assert_eq!(json(&iphdr, &[0x45, 7]), r#"{"ihl":5,"version":4,"tos":7}"#);
        let padded = parse_c_type(
            "struct { __u32 a:3; __u32 :5; __u32 b:8; __u32 :0; __u32 c:1; }",
            "value",
        )
        .unwrap();
        let Some(type_info::Kind::Struct(r)) = &padded.kind else {
            panic!("a struct")
        };
        let offsets: Vec<u32> = r.members.iter().map(|m| m.bit_offset).collect();
        assert_eq!((offsets, padded.size), (vec![0, 8, 32], 8));
        let flags = parse_c_type("struct { char c:2; _Bool b:1; }", "value").unwrap();
        assert_eq!(flags.size, 1);
        let nested = parse_c_type(
            "struct { struct { __u32 x; } inner; union { __u32 y; __u16 z; }; }",
            "value",
        )
        .unwrap();
        assert_eq!(nested.size, 8);
    }

    #[test]
    fn bad_declarations_say_what_is_wrong() {
        for (text, says) in [
            ("", "no type given"),
            ("__u33", "unknown type \"__u33\""),
            ("char[x]", "array length \"x\" is not a number"),
            ("struct { __u32 a; ", "not closed"),
            ("struct { __u32; }", "a member needs a name"),
            ("struct { }", "needs members"),
            ("__u32 extra", "unexpected \"extra\""),
            ("unsigned signed", "is not a C type"),
            ("struct { float a:3; }", "only integers are bitfields"),
            ("struct { __u8 a:9; }", "9 bits do not fit"),
            ("struct { __u32 a:0; }", "a bitfield of width 0 has no name"),
            ("char[4294967296]", "is not a number of at most 2^32 - 1"),
            ("__u64[4294967295]", "larger than"),
            ("__u8 $", "unexpected character '$'"),
        ] {
            let e = parse_c_type(text, "key").unwrap_err().to_string();
            assert!(e.starts_with("key: "), "{text}: {e}");
            assert!(e.contains(says), "{text}: {e}");
        }
    }
}
