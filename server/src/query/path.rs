//! Member paths ("key.daddr", "value.stats.bytes", "value.counters[2]",
//! "values[1].bytes") resolved against a map's types, once per call: where
//! the member's bytes are and what type it has.

use bpfmap_proto::v1::{self as pb, type_info::Kind};

/// Where a member lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Root {
    /// The key.
    Key,
    /// The value (for per-CPU maps: its sum over the CPUs).
    Value,
    /// One CPU's value of a per-CPU map.
    Cpu(usize),
}

impl Root {
    fn name(self) -> String {
        match self {
            Self::Key => "key".into(),
            Self::Value => "value".into(),
            Self::Cpu(i) => format!("values[{i}]"),
        }
    }
}

/// One step down a path.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Step {
    /// A member of a struct or union.
    Member(String),
    /// An element of an array.
    Index(u64),
}

/// A member found in the map's types.
#[derive(Debug, Clone)]
pub(crate) struct Resolved {
    /// The whole path as written ("key.daddr").
    pub(crate) path: String,
    pub(crate) root: Root,
    /// From the start of its root, in bits.
    pub(crate) bit_offset: u64,
    /// The width of a bitfield; 0 when it is not one.
    pub(crate) bitfield: u32,
    /// Its type; `None` for the bytes of a map without types (the whole
    /// key or value).
    pub(crate) info: Option<pb::TypeInfo>,
    /// Its size in bytes.
    pub(crate) size: usize,
}

/// The map's types as paths see them.
#[derive(Debug, Clone, Copy)]
pub struct Shape<'a> {
    /// The key's type (none for a map without types).
    pub key: Option<&'a pb::TypeInfo>,
    /// The value's type (one CPU's, for per-CPU maps).
    pub value: Option<&'a pb::TypeInfo>,
    /// The key's size in bytes.
    pub key_size: usize,
    /// One value's size in bytes (one CPU's).
    pub value_size: usize,
    /// Possible CPUs, for per-CPU maps.
    pub cpus: Option<usize>,
}

impl Shape<'_> {
    /// Whether the map carries types.
    pub fn typed(&self) -> bool {
        self.value.is_some()
    }
}

/// The name of a type in messages ("u64", "struct flow_key", "char[16]").
pub(crate) fn type_name(info: &pb::TypeInfo) -> String {
    let named = |what: &str| {
        if info.name.is_empty() {
            format!("anonymous {what}")
        } else {
            format!("{what} {}", info.name)
        }
    };
    match &info.kind {
        Some(Kind::Int(i)) if info.name.is_empty() => {
            format!("{}{}", if i.signed { "s" } else { "u" }, info.size * 8)
        }
        Some(Kind::Struct(_)) => named("struct"),
        Some(Kind::Union(_)) => named("union"),
        Some(Kind::Enum(_)) => named("enum"),
        Some(Kind::Array(a)) => {
            let elem = a
                .element
                .as_ref()
                .map_or_else(|| "?".into(), |t| type_name(t));
            format!("{elem}[{}]", a.length)
        }
        _ if !info.name.is_empty() => info.name.clone(),
        Some(Kind::Bool(_)) => "bool".into(),
        Some(Kind::Char(_)) => "char".into(),
        Some(Kind::Float(_)) => format!("float{}", info.size * 8),
        Some(Kind::Pointer(_)) => "pointer".into(),
        _ => format!("{} bytes", info.size),
    }
}

/// Resolves `steps` under `root`. The error says which step fails and why
/// ("key.dprt: no such member of struct flow_key").
pub(crate) fn resolve(shape: &Shape<'_>, root: Root, steps: &[Step]) -> Result<Resolved, String> {
    let path = root.name();
    let (info, size) = match root {
        Root::Key => (shape.key, shape.key_size),
        Root::Value => (shape.value, shape.value_size),
        Root::Cpu(i) => {
            let Some(cpus) = shape.cpus else {
                return Err(format!(
                    "{path}: the map is not per-CPU (use value, not values[i])"
                ));
            };
            if i >= cpus {
                return Err(format!("{path}: the host has {cpus} possible CPUs"));
            }
            (shape.value, shape.value_size)
        }
    };
    let Some(info) = info else {
        if let Some(step) = steps.first() {
            let what = match step {
                Step::Member(m) => format!(".{m}"),
                Step::Index(i) => format!("[{i}]"),
            };
            return Err(format!(
                "{path}{what}: the map has no types (BTF): its {} is bytes",
                if root == Root::Key { "key" } else { "value" }
            ));
        }
        return Ok(Resolved {
            path,
            root,
            bit_offset: 0,
            bitfield: 0,
            info: None,
            size,
        });
    };
    let mut at = At {
        path,
        info,
        bit_offset: 0,
        bitfield: 0,
    };
    for step in steps {
        at.step(step)?;
    }
    let At {
        path,
        info,
        bit_offset,
        bitfield,
    } = at;
    let size = info.size as usize;
    // The descriptions were checked against the map's sizes (Layout), but
    // a path must never reach outside the bytes whatever they say.
    let end = if bitfield != 0 {
        bit_offset + u64::from(bitfield)
    } else {
        bit_offset + size as u64 * 8
    };
    let root_size = match root {
        Root::Key => shape.key_size,
        _ => shape.value_size,
    };
    if end > root_size as u64 * 8 || (bitfield == 0 && !bit_offset.is_multiple_of(8)) {
        return Err(format!(
            "{path}: outside the {} bytes of its root",
            root_size
        ));
    }
    Ok(Resolved {
        path,
        root,
        bit_offset,
        bitfield,
        info: Some(info.clone()),
        size,
    })
}

/// Where a resolution stands: the path so far, its type, its offset.
struct At<'a> {
    path: String,
    info: &'a pb::TypeInfo,
    bit_offset: u64,
    bitfield: u32,
}

impl At<'_> {
    /// One step down: a member, or an array element.
    fn step(&mut self, step: &Step) -> Result<(), String> {
        let path = &self.path;
        if self.bitfield != 0 {
            return Err(format!("{path}: a bitfield has no members"));
        }
        match step {
            Step::Member(name) => {
                let members = match &self.info.kind {
                    Some(Kind::Struct(r)) | Some(Kind::Union(r)) => &r.members,
                    _ => {
                        return Err(format!(
                            "{path}.{name}: {path} is {}, which has no members",
                            type_name(self.info)
                        ));
                    }
                };
                let Some((m, off)) = find_member(members, name, 0) else {
                    return Err(format!(
                        "{path}.{name}: no such member of {}",
                        type_name(self.info)
                    ));
                };
                self.bit_offset += off;
                self.bitfield = m.bitfield_size;
                self.path = format!("{path}.{name}");
                self.info = m
                    .r#type
                    .as_ref()
                    .ok_or_else(|| format!("{}: no type", self.path))?;
            }
            Step::Index(i) => {
                let Some(Kind::Array(a)) = &self.info.kind else {
                    return Err(format!(
                        "{path}[{i}]: {path} is {}, not an array",
                        type_name(self.info)
                    ));
                };
                if *i >= u64::from(a.length) {
                    return Err(format!(
                        "{path}[{i}]: out of bounds ({} has {} elements)",
                        type_name(self.info),
                        a.length
                    ));
                }
                let elem = a
                    .element
                    .as_ref()
                    .ok_or_else(|| format!("{path}: no type"))?;
                self.bit_offset += i * u64::from(elem.size) * 8;
                self.path = format!("{path}[{i}]");
                self.info = elem;
            }
        }
        Ok(())
    }
}

/// A member by name, looking into anonymous members as C does; its offset
/// from the record's start in bits.
fn find_member<'a>(
    members: &'a [pb::Member],
    name: &str,
    depth: usize,
) -> Option<(&'a pb::Member, u64)> {
    if depth > bpfmap_proto::typed::MAX_DEPTH {
        return None;
    }
    for m in members {
        if m.name == name {
            return Some((m, u64::from(m.bit_offset)));
        }
        if m.name.is_empty()
            && let Some(Kind::Struct(r) | Kind::Union(r)) =
                m.r#type.as_ref().and_then(|t| t.kind.as_ref())
            && let Some((inner, off)) = find_member(&r.members, name, depth + 1)
        {
            return Some((inner, u64::from(m.bit_offset) + off));
        }
    }
    None
}

/// Parses a member path as written in `fields` and `group_by` ("key",
/// "value.stats.bytes", "value.counters[2]", "values[0].bytes").
pub(crate) fn parse(text: &str) -> Result<(Root, Vec<Step>), String> {
    let bad = |why: &str| format!("{text:?}: {why}");
    if text.len() > 256 {
        return Err(bad("a member path is at most 256 characters"));
    }
    let mut rest = text;
    let head_end = rest.find(['.', '[']).unwrap_or(rest.len());
    let head = &rest[..head_end];
    rest = &rest[head_end..];
    let mut root = match head {
        "key" => Root::Key,
        "value" => Root::Value,
        "values" => Root::Cpu(usize::MAX),
        _ => return Err(bad("a member path starts with key, value or values[i]")),
    };
    let mut steps = Vec::new();
    while !rest.is_empty() {
        if let Some(r) = rest.strip_prefix('.') {
            let end = r.find(['.', '[']).unwrap_or(r.len());
            let name = &r[..end];
            if name.is_empty() || !name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_') {
                return Err(bad("member names are C identifiers"));
            }
            steps.push(Step::Member(name.to_owned()));
            rest = &r[end..];
        } else if let Some(r) = rest.strip_prefix('[') {
            let end = r.find(']').ok_or_else(|| bad("unclosed ["))?;
            let i: u64 = r[..end].parse().map_err(|_| bad("an index is a number"))?;
            rest = &r[end + 1..];
            if root == Root::Cpu(usize::MAX) {
                root = Root::Cpu(usize::try_from(i).unwrap_or(usize::MAX - 1));
            } else {
                steps.push(Step::Index(i));
            }
        } else {
            return Err(bad("expected . or ["));
        }
    }
    if root == Root::Cpu(usize::MAX) {
        return Err(bad("values needs a CPU index: values[0]"));
    }
    Ok((root, steps))
}

#[cfg(test)]
mod tests {
    use super::*;
    use bpfmap_proto::v1::{ArrayType, IntType, Member, RecordType, TypeInfo};

    fn int(name: &str, size: u32) -> TypeInfo {
        TypeInfo {
            name: name.into(),
            size,
            kind: Some(Kind::Int(IntType::default())),
        }
    }

    fn record(name: &str, size: u32, members: Vec<(&str, u32, TypeInfo)>) -> TypeInfo {
        TypeInfo {
            name: name.into(),
            size,
            kind: Some(Kind::Struct(RecordType {
                members: members
                    .into_iter()
                    .map(|(n, off, t)| Member {
                        name: n.into(),
                        bit_offset: off,
                        bitfield_size: 0,
                        r#type: Some(t),
                    })
                    .collect(),
            })),
        }
    }

    #[test]
    fn paths_resolve_members_anonymous_members_and_indexes() {
        let counters = TypeInfo {
            name: String::new(),
            size: 16,
            kind: Some(Kind::Array(Box::new(ArrayType {
                element: Some(Box::new(int("__u32", 4))),
                length: 4,
            }))),
        };
        let inner = record("", 8, vec![("bytes", 0, int("__u64", 8))]);
        let value = record(
            "stats",
            24,
            vec![("", 0, inner), ("counters", 64, counters)],
        );
        let key = int("__u32", 4);
        let shape = Shape {
            key: Some(&key),
            value: Some(&value),
            key_size: 4,
            value_size: 24,
            cpus: None,
        };
        let (root, steps) = parse("value.counters[2]").unwrap();
        let r = resolve(&shape, root, &steps).unwrap();
        assert_eq!((r.bit_offset, r.size), (64 + 64, 4));
        let (root, steps) = parse("value.bytes").unwrap();
        assert_eq!(resolve(&shape, root, &steps).unwrap().bit_offset, 0);
        let e = resolve(&shape, Root::Value, &[Step::Member("byts".into())]).unwrap_err();
        assert_eq!(e, "value.byts: no such member of struct stats");
        let (root, steps) = parse("value.counters[4]").unwrap();
        let e = resolve(&shape, root, &steps).unwrap_err();
        assert!(e.contains("out of bounds"), "{e}");
        let e = resolve(&shape, Root::Key, &[Step::Member("x".into())]).unwrap_err();
        assert!(e.contains("which has no members"), "{e}");
        assert!(parse("values.x").is_err());
        assert!(parse("flow.x").is_err());
        assert!(parse("key..x").is_err());
        assert_eq!(parse("values[3].bytes").unwrap().0, Root::Cpu(3));
        let e = resolve(&shape, Root::Cpu(0), &[]).unwrap_err();
        assert!(e.contains("not per-CPU"), "{e}");
    }
}
