//! Renderings: members shown another way than their type says (addresses,
//! hex, network-order numbers, text), asked for by a call, and their
//! spellings accepted back in JSON keys and filters.

use std::{
    collections::BTreeMap,
    fmt,
    net::{Ipv4Addr, Ipv6Addr},
    str::FromStr,
};

use prost_types::{Value, value::Kind};

use super::{
    EncodeError, IntField, Layout, Member, Node, Sink, TypeError, encode, err, kind_name,
    member::{self, Root},
};

/// How a member is shown. Addresses and network-order numbers are read
/// from the member's bytes in memory order, as `inet_ntop` reads them:
/// whatever integer type a program declared a member with, the bytes it
/// copied off the wire show as what they are.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Rendering {
    /// An IPv4 address ("10.0.0.1") of 4 bytes.
    Ipv4,
    /// An IPv6 address ("fe80::1") of 16 bytes.
    Ipv6,
    /// A MAC address ("02:42:ac:11:00:02") of 6 bytes.
    Mac,
    /// Hex: "0x1bb" for an integer (its value), the bytes ("0x0a000001")
    /// otherwise.
    Hex,
    /// A number from the member's first 2 bytes in network order: a port
    /// a program keeps as it came off the wire (443 for the bytes 01 bb,
    /// whether declared `__be16`, `__u16` or as an index in a `__u32`).
    Be16,
    /// The same from the first 4 bytes.
    Be32,
    /// Text up to the first NUL: a char array, or bytes without a type (a
    /// command name).
    String,
}

impl Rendering {
    /// Every rendering, by its name.
    pub const ALL: [Rendering; 7] = [
        Self::Ipv4,
        Self::Ipv6,
        Self::Mac,
        Self::Hex,
        Self::Be16,
        Self::Be32,
        Self::String,
    ];

    /// The name a request gives ("ipv4").
    pub fn name(self) -> &'static str {
        match self {
            Self::Ipv4 => "ipv4",
            Self::Ipv6 => "ipv6",
            Self::Mac => "mac",
            Self::Hex => "hex",
            Self::Be16 => "be16",
            Self::Be32 => "be32",
            Self::String => "string",
        }
    }

    /// Why `node` (of `size` bytes) cannot be shown this way, if it cannot.
    fn misfit(self, node: &Node, size: usize) -> Option<String> {
        let exact = match self {
            Self::Ipv4 => Some(4),
            Self::Ipv6 => Some(16),
            Self::Mac => Some(6),
            _ => None,
        };
        let least = match self {
            Self::Be16 => 2,
            Self::Be32 => 4,
            _ => 0,
        };
        let name = self.name();
        let kind = kind_name(node);
        if let Some(want) = exact.filter(|w| *w != size) {
            return Some(format!(
                "{name} needs a member of {want} bytes; this one ({kind}) has {size}"
            ));
        }
        if size < least {
            return Some(format!(
                "{name} needs a member of at least {least} bytes; this one ({kind}) has {size}"
            ));
        }
        let bytes = matches!(node, Node::Array { .. } | Node::Opaque { .. });
        let kind_ok = match self {
            // Text is made of bytes: a char or __u8 array, or untyped bytes.
            Self::String => matches!(
                node,
                Node::Array {
                    element_size: 1,
                    ..
                } | Node::Opaque { .. }
            ),
            Self::Hex => !matches!(node, Node::Rendered { .. }),
            _ => bytes || matches!(node, Node::Int { .. } | Node::Record(_)),
        };
        (!kind_ok).then(|| format!("{name} cannot show {kind}"))
    }

    /// `node`, whose bytes are `b`, shown this way into `sink`.
    pub(crate) fn render(self, node: &Node, b: &[u8], sink: &mut impl Sink) {
        match self {
            Self::Ipv4 => match <[u8; 4]>::try_from(b) {
                Ok(a) => sink.string(&Ipv4Addr::from(a).to_string()),
                Err(_) => sink.null(),
            },
            Self::Ipv6 => match <[u8; 16]>::try_from(b) {
                Ok(a) => sink.string(&Ipv6Addr::from(a).to_string()),
                Err(_) => sink.null(),
            },
            Self::Mac => sink.string(
                &b.iter()
                    .map(|x| format!("{x:02x}"))
                    .collect::<Vec<_>>()
                    .join(":"),
            ),
            Self::Hex => match node {
                Node::Int {
                    size,
                    signed,
                    big_endian,
                    ..
                } => {
                    let v = IntField::whole(0, *size, *signed, *big_endian)
                        .raw(b)
                        .unwrap_or(0);
                    sink.string(&format!("{v:#x}"));
                }
                _ => sink.string(&format!("0x{}", faster_hex::hex_string(b))),
            },
            Self::Be16 | Self::Be32 => match self.network_number(b) {
                Some(v) => sink.int(i64::from(v)),
                None => sink.null(),
            },
            Self::String => sink.string(&escaped_text(b)),
        }
    }

    /// The number of a be16 or be32 rendering: the first bytes of `b` in
    /// network order.
    fn network_number(self, b: &[u8]) -> Option<u32> {
        match self {
            Self::Be16 => Some(u32::from(u16::from_be_bytes(b.get(..2)?.try_into().ok()?))),
            _ => Some(u32::from_be_bytes(b.get(..4)?.try_into().ok()?)),
        }
    }

    /// About how many bytes the shown form takes in a message.
    pub(crate) fn size_hint(self, size: usize) -> usize {
        match self {
            Self::Ipv4 => 18,
            Self::Ipv6 => 44,
            Self::Mac => 20,
            Self::Hex => 2 * size + 6,
            Self::Be16 | Self::Be32 => 11,
            Self::String => size + 4,
        }
    }

    /// Encodes `v`, the shown form (or whatever `node` accepts), into
    /// `out`, the member's bytes (and what follows them).
    pub(crate) fn encode(
        self,
        node: &Node,
        size: usize,
        v: &Value,
        out: &mut [u8],
        path: &mut String,
    ) -> Result<(), EncodeError> {
        if let Self::Be16 | Self::Be32 = self {
            return self.encode_network_number(v, out, path);
        }
        let Some(Kind::StringValue(text)) = &v.kind else {
            return encode::node(node, v, out, 0, path);
        };
        let bytes = self.parse(node, size, text, path)?;
        match (self, node) {
            // An integer shown in hex holds the number as its value, in its
            // own byte order.
            (
                Self::Hex,
                Node::Int {
                    size,
                    signed,
                    big_endian,
                    ..
                },
            ) => {
                let raw = bytes
                    .iter()
                    .fold(0u128, |acc, &x| (acc << 8) | u128::from(x));
                IntField::whole(0, *size, *signed, *big_endian).write(out, raw);
            }
            // Everything else holds the bytes in memory order.
            _ => {
                if let Some(dst) = out.get_mut(..bytes.len()) {
                    dst.copy_from_slice(&bytes);
                }
            }
        }
        Ok(())
    }

    /// A be16 or be32 number (a JSON number, or a decimal or 0x string)
    /// written into the member's first bytes in network order.
    fn encode_network_number(
        self,
        v: &Value,
        out: &mut [u8],
        path: &str,
    ) -> Result<(), EncodeError> {
        let width = if self == Self::Be16 { 2 } else { 4 };
        let raw = encode::integer(v, width * 8, false, path)?;
        let field = IntField::whole(0, width, false, true);
        field.write(out, raw);
        Ok(())
    }

    /// The bytes `text` spells in this rendering (for `node`, of `size`
    /// bytes), in memory order (most significant first for hex).
    fn parse(
        self,
        node: &Node,
        size: usize,
        text: &str,
        path: &str,
    ) -> Result<Vec<u8>, EncodeError> {
        let bytes = match self {
            Self::Ipv4 => match text.parse::<Ipv4Addr>() {
                Ok(a) => a.octets().to_vec(),
                Err(_) => return self.bad(text, path),
            },
            Self::Ipv6 => match text.parse::<Ipv6Addr>() {
                Ok(a) => a.octets().to_vec(),
                Err(_) => return self.bad(text, path),
            },
            Self::Mac => parse_mac(text).map_or_else(|| self.bad(text, path), Ok)?,
            Self::Hex => parse_hex(node, size, text, path)?,
            Self::String => {
                let bytes = match unescaped(text) {
                    Ok(b) => b,
                    Err(why) => return encode::fail(path, format!("{text:?}: {why}")),
                };
                if bytes.len() > size {
                    return encode::fail(
                        path,
                        format!(
                            "a string of {} bytes does not fit {size} bytes",
                            bytes.len()
                        ),
                    );
                }
                bytes
            }
            Self::Be16 | Self::Be32 => return self.bad(text, path),
        };
        Ok(bytes)
    }

    fn bad<T>(self, text: &str, path: &str) -> Result<T, EncodeError> {
        let example = match self {
            Self::Ipv4 => "\"10.0.0.1\"",
            Self::Ipv6 => "\"fe80::1\"",
            Self::Mac => "\"02:42:ac:11:00:02\"",
            Self::Hex => "\"0x1bb\"",
            Self::Be16 | Self::Be32 => "443",
            Self::String => "\"bash\"",
        };
        encode::fail(
            path,
            format!("expected {} like {example}, got {text:?}", self.name()),
        )
    }
}

/// The text the string rendering shows for `b`: its bytes without the
/// NULs that end them, printable characters as they are, a backslash as
/// `\\`, and every other byte (of a control character, of what is not
/// UTF-8, a NUL before other bytes) as `\xNN`. Safe on a terminal, and
/// different bytes never show the same text.
pub(crate) fn escaped_text(b: &[u8]) -> String {
    use std::fmt::Write as _;
    let end = b.iter().rposition(|&c| c != 0).map_or(0, |i| i + 1);
    let mut out = String::with_capacity(end);
    let escape = |out: &mut String, bytes: &[u8]| {
        for byte in bytes {
            let _ = write!(out, "\\x{byte:02x}");
        }
    };
    for chunk in b[..end].utf8_chunks() {
        for c in chunk.valid().chars() {
            match c {
                '\\' => out.push_str("\\\\"),
                c if c.is_control() => escape(&mut out, c.encode_utf8(&mut [0; 4]).as_bytes()),
                c => out.push(c),
            }
        }
        escape(&mut out, chunk.invalid());
    }
    out
}

/// The bytes a string rendering's text stands for: [`escaped_text`]
/// undone (`\\` and `\xNN` are its only escapes).
pub(crate) fn unescaped(text: &str) -> Result<Vec<u8>, &'static str> {
    let mut out = Vec::with_capacity(text.len());
    let mut bytes = text.bytes();
    while let Some(b) = bytes.next() {
        if b != b'\\' {
            out.push(b);
            continue;
        }
        match bytes.next() {
            Some(b'\\') => out.push(b'\\'),
            Some(b'x') => {
                let digits = [bytes.next(), bytes.next()];
                let hex = |d: Option<u8>| (d? as char).to_digit(16);
                match digits.map(hex) {
                    [Some(hi), Some(lo)] => out.push((hi * 16 + lo) as u8),
                    _ => return Err("\\x takes two hex digits (\\x1b)"),
                }
            }
            _ => return Err("a backslash starts \\\\ (a backslash) or \\xNN (a byte)"),
        }
    }
    Ok(out)
}

/// A MAC address's 6 bytes ("02:42:ac:11:00:02", or with dashes).
fn parse_mac(text: &str) -> Option<Vec<u8>> {
    let parsed: Option<Vec<u8>> = text
        .split([':', '-'])
        .map(|p| {
            (p.len() == 2)
                .then(|| u8::from_str_radix(p, 16).ok())
                .flatten()
        })
        .collect();
    parsed.filter(|b| b.len() == 6)
}

/// A hex rendering's bytes: an integer's value ("0x1bb", most significant
/// byte first), or the member's bytes.
fn parse_hex(node: &Node, size: usize, text: &str, path: &str) -> Result<Vec<u8>, EncodeError> {
    if let Node::Int { .. } = node {
        let digits = text.strip_prefix("0x").unwrap_or(text);
        let Ok(raw) = u128::from_str_radix(digits, 16) else {
            return Rendering::Hex.bad(text, path);
        };
        if size < 16 && raw >> (size * 8) != 0 {
            return encode::fail(path, format!("{text} does not fit {size} bytes"));
        }
        return Ok(raw.to_be_bytes()[16 - size..].to_vec());
    }
    encode::hex_bytes(text)
        .filter(|b| b.len() == size)
        .map_or_else(
            || {
                encode::fail(
                    path,
                    format!("expected {size} bytes in hex (\"0x...\"), got {text:?}"),
                )
            },
            Ok,
        )
}

impl fmt::Display for Rendering {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// A rendering name that is not one.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown rendering {0:?}; use ipv4, ipv6, mac, hex, be16, be32 or string")]
pub struct UnknownRendering(pub String);

impl FromStr for Rendering {
    type Err = UnknownRendering;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::ALL
            .into_iter()
            .find(|r| r.name() == s)
            .ok_or_else(|| UnknownRendering(s.to_owned()))
    }
}

/// The renderings a call asks for, by member path ("key.daddr",
/// "value.stats.bytes", "key" for the whole key).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Renderings(BTreeMap<String, Rendering>);

impl Renderings {
    /// Parses a request's `render` map; the error names the member.
    pub fn parse<'a>(
        entries: impl IntoIterator<Item = (&'a String, &'a String)>,
    ) -> Result<Self, TypeError> {
        let mut out = BTreeMap::new();
        for (path, how) in entries {
            let how = how
                .parse::<Rendering>()
                .map_err(|e| err(path, e.to_string()))?;
            let bad_root = || {
                err(
                    path,
                    "a member path starts with \"key\" or \"value\" (\"key.daddr\")",
                )
            };
            let (root, steps) = match member::parse(path) {
                Ok((Root::Cpu(_), _)) => return Err(bad_root()),
                Ok(parsed) => parsed,
                Err(e) if e.message.starts_with("a member path starts") => {
                    return Err(bad_root());
                }
                Err(e) => return Err(err(path, e.message)),
            };
            let _ = root;
            if steps.iter().any(|s| matches!(s, member::Step::Index(_))) {
                return Err(err(
                    path,
                    "renderings name members, not array elements (render the whole array)",
                ));
            }
            out.insert(path.clone(), how);
        }
        Ok(Self(out))
    }

    /// These, then `other` over them (for the same path, `other` wins).
    pub fn overridden_by(&self, other: &Renderings) -> Renderings {
        let mut out = self.0.clone();
        out.extend(other.0.iter().map(|(k, v)| (k.clone(), *v)));
        Self(out)
    }

    /// Those of a whole key or value ("key", "value"): what a map without
    /// types can be shown with.
    pub fn whole_only(&self) -> Renderings {
        Self(
            self.0
                .iter()
                .filter(|(path, _)| *path == "key" || *path == "value")
                .map(|(p, r)| (p.clone(), *r))
                .collect(),
        )
    }

    /// No renderings.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// The renderings below `root` ("key", "value"): (path inside it, how).
    pub fn under<'a>(&'a self, root: &'a str) -> impl Iterator<Item = (&'a str, Rendering)> + 'a {
        self.0.iter().filter_map(move |(path, how)| {
            let rest = path.strip_prefix(root)?;
            match rest {
                "" => Some(("", *how)),
                _ => rest.strip_prefix('.').map(|r| (r, *how)),
            }
        })
    }

    /// The pairs, in path order.
    pub fn iter(&self) -> impl Iterator<Item = (&str, Rendering)> {
        self.0.iter().map(|(p, r)| (p.as_str(), *r))
    }
}

/// Shows the member `m` (resolved in a layout like `target`) of `target`
/// as `how` says: the error says why it cannot be.
pub(crate) fn apply(target: &mut Layout, m: &Member<'_>, how: Rendering) -> Result<(), TypeError> {
    if m.bitfield().is_some() {
        return Err(err(m.path(), "a bitfield cannot be rendered"));
    }
    let size = m.size();
    let node = target
        .node_at_mut(&m.trail)
        .ok_or_else(|| err(m.path(), "not found"))?;
    let inner = match std::mem::replace(node, Node::Opaque { size: 0 }) {
        Node::Rendered { node, .. } => *node,
        n => n,
    };
    if let Some(why) = how.misfit(&inner, size) {
        *node = inner;
        return Err(err(m.path(), why));
    }
    *node = Node::Rendered {
        how,
        node: Box::new(inner),
        size,
    };
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn string_renderings_are_safe_on_a_terminal_and_tell_bytes_apart() {
        let cases: [(&[u8], &str); 8] = [
            (b"bash\0\0\0\0", "bash"),
            (b"\x1b[31mEVIL\x1b[0m\0", "\\x1b[31mEVIL\\x1b[0m"),
            (b"a\\b", "a\\\\b"),
            (b"caf\xc3\xa9", "café"),
            (b"\xff\xfe\x14\0", "\\xff\\xfe\\x14"),
            (b"\xff\xfd\x14\0", "\\xff\\xfd\\x14"),
            (b"ab\0cd\0", "ab\\x00cd"),
            // A C1 control character (CSI) is escaped byte by byte.
            (b"\xc2\x9b2J", "\\xc2\\x9b2J"),
        ];
        for (bytes, shown) in cases {
            assert_eq!(escaped_text(bytes), shown, "{bytes:?}");
            let back = unescaped(shown).unwrap();
            let end = bytes.iter().rposition(|&c| c != 0).map_or(0, |i| i + 1);
            assert_eq!(back, &bytes[..end], "{shown:?}");
        }
        assert_eq!(
            unescaped("a\\q").unwrap_err(),
            "a backslash starts \\\\ (a backslash) or \\xNN (a byte)"
        );
        assert!(unescaped("\\x1").is_err());
    }
}
