//! A map's key and value layouts as one call sees them: typed or bytes,
//! per-CPU or not, with the call's renderings. Every reader of a map's
//! types in a call (decoding, filters, projections, aggregates, watch
//! deltas) starts from one of these.

use std::sync::Arc;

use super::{
    Counter, IntMember, Layout, Node, Renderings, TypeError, err, member, rendering::apply,
};
use crate::v1::TypeInfo;

/// What a map is beyond its types: its key and value sizes, and the
/// possible CPUs of a per-CPU map (`None` otherwise), whose values are one
/// CPU's value each.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MapShape {
    pub key_size: usize,
    pub value_size: usize,
    pub cpus: Option<usize>,
}

impl MapShape {
    /// A map of keys and values of these sizes, not per-CPU.
    pub fn new(key_size: usize, value_size: usize) -> Self {
        Self {
            key_size,
            value_size,
            cpus: None,
        }
    }

    /// The same, per-CPU over `cpus` possible CPUs when `Some`.
    pub fn with_cpus(self, cpus: Option<usize>) -> Self {
        Self { cpus, ..self }
    }
}

/// A map's types, resolved once for a call.
#[derive(Debug, Clone, PartialEq)]
pub struct MapLayout {
    key: Arc<Layout>,
    value: Arc<Layout>,
    /// The key has a type of its own (not the bytes of an untyped map, nor
    /// the stand-in of a typed map whose BTF gives no key type).
    key_typed: bool,
    /// The map carries types (its value's, at least).
    typed: bool,
    /// Possible CPUs, for per-CPU maps.
    cpus: Option<usize>,
    renderings: Renderings,
}

impl MapLayout {
    /// The layouts of a map's key and value types as the map describes
    /// them (`value` one CPU's value for per-CPU maps), checked against its
    /// `shape`. A map without a value type is untyped (its key too,
    /// whatever `key` says); a typed map without a key type (the keyless
    /// BTF of a global data section) has its key shown as an unsigned
    /// integer of its size (the index, 0), or as hex.
    pub fn new(
        key: Option<&TypeInfo>,
        value: Option<&TypeInfo>,
        shape: MapShape,
    ) -> Result<Self, TypeError> {
        let Some(value) = value else {
            return Ok(Self::untyped(shape));
        };
        let key = key
            .map(|k| Layout::new(k, "key").map(Arc::new))
            .transpose()?;
        let value = Arc::new(Layout::new(value, "value")?);
        Self::of_layouts(key, value, shape)
    }

    /// The same from layouts already made (and kept) from the
    /// descriptions.
    pub fn of_layouts(
        key: Option<Arc<Layout>>,
        value: Arc<Layout>,
        shape: MapShape,
    ) -> Result<Self, TypeError> {
        let MapShape {
            key_size,
            value_size,
            cpus,
        } = shape;
        check_size(&value, value_size, "value")?;
        let key_typed = key.is_some();
        let key = match key {
            Some(k) => {
                check_size(&k, key_size, "key")?;
                k
            }
            None => {
                Arc::new(Layout::unsigned(key_size).unwrap_or_else(|| Layout::opaque(key_size)))
            }
        };
        Ok(Self {
            key,
            value,
            key_typed,
            typed: true,
            cpus,
            renderings: Renderings::default(),
        })
    }

    /// The layout of a map without types: its keys and values are bytes.
    pub fn untyped(shape: MapShape) -> Self {
        Self {
            key: Arc::new(Layout::opaque(shape.key_size)),
            value: Arc::new(Layout::opaque(shape.value_size)),
            key_typed: false,
            typed: false,
            cpus: shape.cpus,
            renderings: Renderings::default(),
        }
    }

    /// The layout of records whose key and value are `key` and `value`
    /// (a projection's), not per-CPU.
    pub(crate) fn of_records(key: Layout, value: Layout) -> Self {
        Self {
            key: Arc::new(key),
            value: Arc::new(value),
            key_typed: true,
            typed: true,
            cpus: None,
            renderings: Renderings::default(),
        }
    }

    /// This layout with members shown as `renderings` say (member path to
    /// rendering; the renderings already in force stay unless overridden).
    /// A map without types has renderings of its whole key or value only
    /// ("key" = "string"). The error names the member that does not exist,
    /// is a bitfield, or does not fit its rendering.
    pub fn with_renderings(&self, renderings: &Renderings) -> Result<Self, TypeError> {
        if renderings.is_empty() {
            return Ok(self.clone());
        }
        if self.typed
            && !self.key_typed
            && let Some((path, _)) = renderings.under("key").next()
        {
            let path = if path.is_empty() {
                "key".to_owned()
            } else {
                format!("key.{path}")
            };
            return Err(err(
                &path,
                "the map's keys have no type (only its value is typed)",
            ));
        }
        let mut key = (*self.key).clone();
        let mut value = (*self.value).clone();
        for (path, how) in renderings.iter() {
            // Paths are checked against this layout, then applied to the
            // copy being built.
            let m = self.member(path)?;
            let target = match m.root() {
                member::Root::Key => &mut key,
                _ => &mut value,
            };
            apply(target, &m, how)?;
        }
        Ok(Self {
            key: Arc::new(key),
            value: Arc::new(value),
            renderings: self.renderings.overridden_by(renderings),
            ..self.clone()
        })
    }

    /// The key's layout (for a map without types: its bytes; for a typed
    /// map without a key type: an unsigned integer of its size, or hex).
    pub fn key(&self) -> &Layout {
        &self.key
    }

    /// The value's layout (one CPU's value for per-CPU maps).
    pub fn value(&self) -> &Layout {
        &self.value
    }

    /// The key's layout, shared.
    pub fn key_arc(&self) -> &Arc<Layout> {
        &self.key
    }

    /// The value's layout, shared.
    pub fn value_arc(&self) -> &Arc<Layout> {
        &self.value
    }

    /// Whether the map carries types (BTF).
    pub fn typed(&self) -> bool {
        self.typed
    }

    /// Whether its key has a type of its own.
    pub fn key_typed(&self) -> bool {
        self.key_typed
    }

    /// The layout per-CPU values are summed through: the value's, or for a
    /// map without types whose values are 1, 2, 4 or 8 bytes, an unsigned
    /// integer (a counter, as the daemon sums it).
    pub fn value_for_sums(&self) -> std::borrow::Cow<'_, Layout> {
        match Layout::unsigned(self.value.size()).filter(|_| !self.typed) {
            Some(int) => std::borrow::Cow::Owned(int),
            None => std::borrow::Cow::Borrowed(&self.value),
        }
    }

    /// Whether the whole key is shown through a rendering ("key" =
    /// "string"), which JSON keys are then written in.
    pub fn key_rendered(&self) -> bool {
        matches!(self.key.root(), super::Node::Rendered { .. })
    }

    /// The possible CPUs of a per-CPU map.
    pub fn cpus(&self) -> Option<usize> {
        self.cpus
    }

    /// The renderings members are shown with.
    pub fn renderings(&self) -> &Renderings {
        &self.renderings
    }

    /// The integer members of the value (what a watch computes deltas and
    /// rates of): every integer and integer bitfield, in records and in the
    /// first elements of arrays, by path. A map without types whose values
    /// are 1, 2, 4 or 8 bytes has one: the value, an unsigned integer.
    pub fn counters(&self) -> Vec<Counter> {
        let mut out = Vec::new();
        if self.typed {
            member::counters(self.value.root(), "value", 0, &mut out);
        } else if matches!(self.value.size(), 1 | 2 | 4 | 8) {
            out.push(Counter {
                path: "value".into(),
                int: IntMember::untyped_value(self.value.size()),
            });
        }
        out
    }
}

fn check_size(layout: &Layout, expected: usize, what: &str) -> Result<(), TypeError> {
    if layout.size() == expected {
        return Ok(());
    }
    let name = match layout.name() {
        "" => String::new(),
        n => format!(" {n}"),
    };
    Err(err(
        what,
        format!(
            "the {what} type{name} is {} bytes but the map's {what}s are {expected} bytes",
            layout.size()
        ),
    ))
}

impl Layout {
    /// The node a trail of record fields and array elements leads to.
    pub(crate) fn node_at_mut(&mut self, trail: &[usize]) -> Option<&mut Node> {
        // The tree changes: its plan is made again.
        self.plan = Default::default();
        let mut node = &mut self.root;
        for &i in trail {
            if let Node::Rendered { node: inner, .. } = node {
                node = inner;
            }
            node = match node {
                Node::Record(r) => &mut r.fields.get_mut(i)?.node,
                Node::Array { element, .. } if i == usize::MAX => element,
                _ => return None,
            };
        }
        Some(node)
    }
}
