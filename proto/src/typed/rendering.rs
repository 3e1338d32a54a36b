//! Renderings: members shown another way than their type says (addresses,
//! hex), asked for by a call, and their spellings accepted back in JSON
//! keys.

use std::{
    collections::BTreeMap,
    fmt,
    net::{Ipv4Addr, Ipv6Addr},
    str::FromStr,
};

use prost_types::{Value, value::Kind};

use super::{
    EncodeError, IntField, Layout, Member, Node, TypeError, encode, err, kind_name,
    member::{self, Root},
    render::slice,
};

/// How a member is shown.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Rendering {
    /// An IPv4 address ("10.0.0.1") of 4 bytes.
    Ipv4,
    /// An IPv6 address ("fe80::1") of 16 bytes.
    Ipv6,
    /// A MAC address ("02:42:ac:11:00:02") of 6 bytes.
    Mac,
    /// Hex: "0x1bb" for an integer, the bytes ("0x0a000001") otherwise.
    Hex,
}

impl Rendering {
    /// Every rendering, by its name.
    pub const ALL: [Rendering; 4] = [Self::Ipv4, Self::Ipv6, Self::Mac, Self::Hex];

    /// The name a request gives ("ipv4").
    pub fn name(self) -> &'static str {
        match self {
            Self::Ipv4 => "ipv4",
            Self::Ipv6 => "ipv6",
            Self::Mac => "mac",
            Self::Hex => "hex",
        }
    }

    /// The size a member must have, when the rendering needs one.
    fn size(self) -> Option<usize> {
        match self {
            Self::Ipv4 => Some(4),
            Self::Ipv6 => Some(16),
            Self::Mac => Some(6),
            Self::Hex => None,
        }
    }

    /// Why `node` (of `size` bytes) cannot be shown this way, if it cannot.
    fn misfit(self, node: &Node, size: usize) -> Option<String> {
        if let Some(want) = self.size()
            && want != size
        {
            return Some(format!(
                "{} needs a member of {want} bytes; this one ({}) has {size}",
                self.name(),
                kind_name(node)
            ));
        }
        let kind_ok = match node {
            Node::Int { .. } | Node::Array { .. } | Node::Record(_) | Node::Opaque { .. } => true,
            Node::Rendered { .. } => false,
            _ => self == Self::Hex,
        };
        (!kind_ok).then(|| format!("{} cannot show {}", self.name(), kind_name(node)))
    }

    /// `node` at `offset` of `bytes`, shown this way.
    pub(crate) fn show(self, node: &Node, size: usize, bytes: &[u8], offset: usize) -> String {
        if let Node::Int {
            size,
            signed,
            big_endian,
            ..
        } = node
        {
            let v = IntField::whole(offset, *size, *signed, *big_endian)
                .raw(bytes)
                .unwrap_or(0);
            return match self {
                Self::Ipv4 => Ipv4Addr::from(v as u32).to_string(),
                Self::Ipv6 => Ipv6Addr::from(v).to_string(),
                Self::Hex | Self::Mac => format!("{v:#x}"),
            };
        }
        let b = slice(bytes, offset, size);
        match self {
            Self::Ipv4 => <[u8; 4]>::try_from(b)
                .map_or_else(|_| String::new(), |a| Ipv4Addr::from(a).to_string()),
            Self::Ipv6 => <[u8; 16]>::try_from(b)
                .map_or_else(|_| String::new(), |a| Ipv6Addr::from(a).to_string()),
            Self::Mac => b
                .iter()
                .map(|x| format!("{x:02x}"))
                .collect::<Vec<_>>()
                .join(":"),
            Self::Hex => format!("0x{}", faster_hex::hex_string(b)),
        }
    }

    /// About how many bytes the shown form takes in a message.
    pub(crate) fn size_hint(self, size: usize) -> usize {
        match self {
            Self::Ipv4 => 18,
            Self::Ipv6 => 44,
            Self::Mac => 20,
            Self::Hex => 2 * size + 6,
        }
    }

    /// Encodes `v`, the shown form (or whatever `node` accepts), into the
    /// member's bytes.
    pub(crate) fn encode(
        self,
        node: &Node,
        size: usize,
        v: &Value,
        out: &mut [u8],
        offset: usize,
        path: &mut String,
    ) -> Result<(), EncodeError> {
        let Some(Kind::StringValue(text)) = &v.kind else {
            return encode::node(node, v, out, offset, path);
        };
        let bytes = self.parse(node, size, text, path)?;
        // An integer holds the address as its value (the first byte most
        // significant), in its own byte order; other members hold the bytes.
        match node {
            Node::Int {
                size,
                signed,
                big_endian,
                ..
            } => {
                let raw = bytes
                    .iter()
                    .fold(0u128, |acc, &x| (acc << 8) | u128::from(x));
                IntField::whole(offset, *size, *signed, *big_endian).write(out, raw);
            }
            _ => {
                if let Some(dst) = out.get_mut(offset..offset + size) {
                    dst.copy_from_slice(&bytes);
                }
            }
        }
        Ok(())
    }

    /// The bytes `text` spells in this rendering (for `node`, of `size`
    /// bytes), most significant first.
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
            Self::Mac => {
                let parts: Vec<&str> = text.split([':', '-']).collect();
                let parsed: Option<Vec<u8>> = parts
                    .iter()
                    .map(|p| {
                        (p.len() == 2)
                            .then(|| u8::from_str_radix(p, 16).ok())
                            .flatten()
                    })
                    .collect();
                match parsed.filter(|b| b.len() == 6) {
                    Some(b) => b,
                    None => return self.bad(text, path),
                }
            }
            Self::Hex => {
                if let Node::Int { .. } = node {
                    let digits = text.strip_prefix("0x").unwrap_or(text);
                    let Ok(raw) = u128::from_str_radix(digits, 16) else {
                        return self.bad(text, path);
                    };
                    if size < 16 && raw >> (size * 8) != 0 {
                        return encode::fail(path, format!("{text} does not fit {size} bytes"));
                    }
                    raw.to_be_bytes()[16 - size..].to_vec()
                } else {
                    match encode::hex_bytes(text).filter(|b| b.len() == size) {
                        Some(b) => b,
                        None => {
                            return encode::fail(
                                path,
                                format!("expected {size} bytes in hex (\"0x...\"), got {text:?}"),
                            );
                        }
                    }
                }
            }
        };
        Ok(bytes)
    }

    fn bad<T>(self, text: &str, path: &str) -> Result<T, EncodeError> {
        let example = match self {
            Self::Ipv4 => "\"10.0.0.1\"",
            Self::Ipv6 => "\"fe80::1\"",
            Self::Mac => "\"02:42:ac:11:00:02\"",
            Self::Hex => "\"0x1bb\"",
        };
        encode::fail(
            path,
            format!("expected {} like {example}, got {text:?}", self.name()),
        )
    }
}

impl fmt::Display for Rendering {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// A rendering name that is not one.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown rendering {0:?}; use ipv4, ipv6, mac or hex")]
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
