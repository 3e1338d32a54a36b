//! Types declared for a map in C, by a request (`MapRef.declare`) or the
//! configuration (`[[types]]`), for maps whose BTF does not give them.

use bpfmap_proto::{
    typed::{TypeError, parse_c_type},
    v1::TypeInfo,
};

/// The declared key and value types; a side not declared is `None`.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Declared {
    /// The key's type.
    pub key: Option<Decl>,
    /// The value's type (one CPU's value for per-CPU maps).
    pub value: Option<Decl>,
}

/// One declared type: as written, and as parsed.
#[derive(Debug, Clone, PartialEq)]
pub struct Decl {
    /// The C declaration (`char[16]`).
    pub text: String,
    /// Its description.
    pub info: TypeInfo,
}

impl Declared {
    /// Parses the key's and the value's declarations (empty: not
    /// declared); the error names the side.
    pub fn parse(key: &str, value: &str) -> Result<Self, TypeError> {
        let side = |text: &str, what: &str| -> Result<Option<Decl>, TypeError> {
            let text = text.trim();
            if text.is_empty() {
                return Ok(None);
            }
            Ok(Some(Decl {
                text: text.to_owned(),
                info: parse_c_type(text, what)?,
            }))
        };
        Ok(Self {
            key: side(key, "key")?,
            value: side(value, "value")?,
        })
    }

    /// What a map's type implies where its BTF says nothing: the values of
    /// an array_of_maps or hash_of_maps are inner map ids (`__u32`), the
    /// keys of an array_of_maps indexes.
    pub fn implied(meta: &bpfmap_kernel::MapMeta) -> Self {
        use bpfmap_kernel::MapType;
        let u32_decl = || {
            Some(Decl {
                text: "__u32".into(),
                info: parse_c_type("__u32", "value").expect("__u32 is a C type"),
            })
        };
        match meta.map_type {
            MapType::ARRAY_OF_MAPS if meta.key_size == 4 => Self {
                key: u32_decl(),
                value: u32_decl(),
            },
            MapType::HASH_OF_MAPS | MapType::ARRAY_OF_MAPS => Self {
                key: None,
                value: u32_decl(),
            },
            _ => Self::default(),
        }
    }

    /// Whether nothing is declared.
    pub fn is_empty(&self) -> bool {
        self.key.is_none() && self.value.is_none()
    }

    /// These declarations, each side falling back to `other`'s.
    pub fn or(self, other: Declared) -> Declared {
        Declared {
            key: self.key.or(other.key),
            value: self.value.or(other.value),
        }
    }
}
