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
    /// The C declaration ("char[16]").
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
