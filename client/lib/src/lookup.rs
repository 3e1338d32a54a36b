//! Lookups: keys as bytes or JSON, and what each one found.

use std::{collections::BTreeMap, fmt};

use crate::{
    Error, MapName, PerCpuValues, ValueRef, pb,
    typed::{self, TypeError},
};

/// A key to look up: its bytes, or JSON through the map's key type.
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub enum Key {
    /// Exactly the map's key size.
    Bytes(Vec<u8>),
    /// Written as JSON (the form [`LookupResult::decoded_key`] gives):
    /// `{"sport": 1024, "proto": "IPPROTO_TCP", ...}`. The daemon
    /// encodes it through the map's key type: every named member must be
    /// given, integers as numbers or decimal strings, enums by name or
    /// number, char arrays as strings; a rendered member
    /// ([`LookupOptions::with_render`], or the daemon's configuration) in
    /// its rendered spelling too (`"daddr": "10.0.0.1"`). A key that does
    /// not fit is INVALID_ARGUMENT naming the member; a map without types
    /// refuses JSON keys (FAILED_PRECONDITION).
    Json(prost_types::Value),
}

impl From<Vec<u8>> for Key {
    fn from(b: Vec<u8>) -> Self {
        Self::Bytes(b)
    }
}

impl From<&[u8]> for Key {
    fn from(b: &[u8]) -> Self {
        Self::Bytes(b.to_vec())
    }
}

impl<const N: usize> From<[u8; N]> for Key {
    fn from(b: [u8; N]) -> Self {
        Self::Bytes(b.to_vec())
    }
}

impl<const N: usize> From<&[u8; N]> for Key {
    fn from(b: &[u8; N]) -> Self {
        Self::Bytes(b.to_vec())
    }
}

impl From<prost_types::Value> for Key {
    fn from(v: prost_types::Value) -> Self {
        Self::Json(v)
    }
}

/// How the daemon decodes per-CPU values for a typed map.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum PerCpu {
    /// One decoded value per possible CPU, in CPU order.
    #[default]
    Each,
    /// One value: every integer member summed over the CPUs (exactly:
    /// 64-bit sums are decimal strings). INVALID_ARGUMENT for a map that is
    /// not per-CPU or whose value is not made of integers.
    Sum,
}

/// Options of a lookup.
#[derive(Debug, Clone, Default)]
#[non_exhaustive]
pub struct LookupOptions {
    raw: bool,
    per_cpu: PerCpu,
    render: BTreeMap<String, String>,
}

impl LookupOptions {
    /// The options and keys of a `LookupRequest` as a caller wrote it (its
    /// map aside), for a program that forwards requests (a relay).
    pub fn from_proto(req: &pb::LookupRequest) -> (Self, Vec<Key>) {
        let options = Self {
            raw: req.raw,
            per_cpu: if req.per_cpu == pb::PerCpu::Sum as i32 {
                PerCpu::Sum
            } else {
                PerCpu::Each
            },
            render: req.render.clone().into_iter().collect(),
        };
        let keys = req
            .keys
            .iter()
            .map(|k| Key::Bytes(k.to_vec()))
            .chain(req.json_keys.iter().cloned().map(Key::Json))
            .collect();
        (options, keys)
    }

    /// Leave out the decoded key and value (the bytes always come): for a
    /// caller that decodes them itself ([`MapTypes`](crate::MapTypes)).
    /// Default: decoded when the map has types.
    pub fn with_raw(mut self, raw: bool) -> Self {
        self.raw = raw;
        self
    }

    /// How the decoded value shows a per-CPU value (default
    /// [`PerCpu::Each`]).
    pub fn with_per_cpu(mut self, per_cpu: PerCpu) -> Self {
        self.per_cpu = per_cpu;
        self
    }

    /// Show members another way than their types say, in the decoded key
    /// and value, and accept their rendered spelling in JSON keys
    /// ([`Key::Json`]): (member path, rendering) pairs such as
    /// `("key.daddr", "ipv4")` (see
    /// [`Rendering`](crate::typed::Rendering)), over the renderings the
    /// daemon's configuration gives the map. Added to those given before.
    /// With [`with_raw`](Self::with_raw) the daemon decodes nothing, so the
    /// renderings are sent only with JSON keys. An unknown rendering or a
    /// path that does not start with "key" or "value" is [`Error::Render`]
    /// before anything is sent; a member that does not exist or fit is
    /// INVALID_ARGUMENT from the daemon, naming it.
    pub fn with_render<K: AsRef<str>, V: fmt::Display>(
        mut self,
        render: impl IntoIterator<Item = (K, V)>,
    ) -> Self {
        self.render.extend(typed::render_map(render));
        self
    }
}

/// A Lookup request, and where each result goes back to.
#[derive(Debug, Clone)]
pub(crate) struct LookupCall {
    pub(crate) request: pb::LookupRequest,
    /// The caller's position of each result the daemon sends (byte keys
    /// first, then JSON keys).
    order: Vec<usize>,
    /// Renderings that cannot be parsed: the call fails with them.
    bad_render: Option<TypeError>,
}

impl LookupCall {
    pub(crate) fn new(
        map: &MapName,
        keys: impl IntoIterator<Item = impl Into<Key>>,
        options: &LookupOptions,
    ) -> Self {
        let mut request = pb::LookupRequest {
            map: Some(map.to_proto()),
            raw: options.raw,
            per_cpu: match options.per_cpu {
                PerCpu::Each => pb::PerCpu::Each,
                PerCpu::Sum => pb::PerCpu::Sum,
            } as i32,
            ..Default::default()
        };
        let (mut bytes_at, mut json_at) = (Vec::new(), Vec::new());
        for (i, key) in keys.into_iter().enumerate() {
            match key.into() {
                Key::Bytes(b) => {
                    request.keys.push(b);
                    bytes_at.push(i);
                }
                Key::Json(j) => {
                    request.json_keys.push(j);
                    json_at.push(i);
                }
            }
        }
        bytes_at.extend(json_at);
        let bad_render = typed::parse_render(&options.render).err();
        // Raw byte-key lookups decode nothing: the daemon would refuse
        // renderings it has no use for.
        if !options.raw || !request.json_keys.is_empty() {
            request.render = options.render.clone().into_iter().collect();
        }
        Self {
            request,
            order: bytes_at,
            bad_render,
        }
    }

    /// The call's renderings cannot be parsed.
    pub(crate) fn check(&self) -> Result<(), Error> {
        match &self.bad_render {
            Some(e) => Err(Error::render(e.clone())),
            None => Ok(()),
        }
    }

    /// The results in the order the caller gave the keys.
    pub(crate) fn results(
        &self,
        results: Vec<pb::LookupResult>,
    ) -> Result<Vec<LookupResult>, Error> {
        if results.len() != self.order.len() {
            return Err(Error::Protocol(format!(
                "{} results for {} keys",
                results.len(),
                self.order.len()
            )));
        }
        if self.order.is_sorted() {
            return Ok(results.into_iter().map(LookupResult).collect());
        }
        let mut out: Vec<Option<LookupResult>> = vec![None; results.len()];
        for (r, at) in results.into_iter().zip(&self.order) {
            out[*at] = Some(LookupResult(r));
        }
        Ok(out.into_iter().flatten().collect())
    }
}

/// What a lookup found for one key.
#[derive(Debug, Clone, PartialEq)]
pub struct LookupResult(pb::LookupResult);

impl LookupResult {
    /// The key's bytes (for a JSON key, as the daemon encoded it).
    pub fn key(&self) -> &[u8] {
        &self.0.key
    }

    /// Whether the map holds the key.
    pub fn found(&self) -> bool {
        self.0.found
    }

    /// The value, borrowed; `None` when the key was not found.
    pub fn value(&self) -> Option<ValueRef<'_>> {
        self.0.found.then(|| {
            if self.0.per_cpu_values.is_empty() {
                ValueRef::Single(&self.0.value)
            } else {
                ValueRef::PerCpu(PerCpuValues::from_slices(&self.0.per_cpu_values))
            }
        })
    }

    /// The key decoded through the map's types (absent for maps without
    /// types and for raw lookups).
    pub fn decoded_key(&self) -> Option<&prost_types::Value> {
        self.0.decoded_key.as_ref()
    }

    /// The value decoded through the map's types (per-CPU values as
    /// [`LookupOptions::with_per_cpu`] says).
    pub fn decoded_value(&self) -> Option<&prost_types::Value> {
        self.0.decoded_value.as_ref()
    }

    /// The message it came in.
    pub fn as_proto(&self) -> &pb::LookupResult {
        &self.0
    }

    /// The message it came in, owned.
    pub fn into_proto(self) -> pb::LookupResult {
        self.0
    }
}

impl From<pb::LookupResult> for LookupResult {
    fn from(r: pb::LookupResult) -> Self {
        Self(r)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn json(n: f64) -> prost_types::Value {
        prost_types::Value {
            kind: Some(prost_types::value::Kind::NumberValue(n)),
        }
    }

    #[test]
    fn mixed_keys_come_back_in_the_callers_order() {
        let map: MapName = "m".parse().unwrap();
        let keys = [
            Key::from(json(1.0)),
            Key::from([2u8]),
            Key::from(json(3.0)),
            Key::from(vec![4u8]),
        ];
        let call = LookupCall::new(&map, keys, &LookupOptions::default().with_raw(true));
        assert_eq!(call.request.keys, [vec![2u8], vec![4]]);
        assert_eq!(call.request.json_keys, [json(1.0), json(3.0)]);
        assert!(call.request.raw);
        // The daemon answers byte keys first, then JSON keys.
        let answer = [2u8, 4, 1, 3].map(|k| pb::LookupResult {
            key: vec![k],
            ..Default::default()
        });
        let results = call.results(answer.to_vec()).unwrap();
        let keys: Vec<&[u8]> = results.iter().map(LookupResult::key).collect();
        assert_eq!(keys, [[1u8], [2], [3], [4]]);
        assert!(matches!(
            call.results(Vec::new()),
            Err(Error::Protocol(m)) if m == "0 results for 4 keys"
        ));
    }

    #[test]
    fn renderings_go_where_the_daemon_uses_them() {
        let map: MapName = "m".parse().unwrap();
        let render = LookupOptions::default().with_render([("key.daddr", "ipv4")]);
        let sent = |options: &LookupOptions, keys: Vec<Key>| {
            LookupCall::new(&map, keys, options).request.render
        };
        let want = std::collections::HashMap::from([("key.daddr".into(), "ipv4".into())]);
        // Decoded results, or JSON keys to encode: sent.
        assert_eq!(sent(&render, vec![Key::from([1u8])]), want);
        let raw = render.clone().with_raw(true);
        assert_eq!(sent(&raw, vec![Key::from(json(1.0))]), want);
        // Raw results of byte keys: nothing to render.
        assert!(sent(&raw, vec![Key::from([1u8])]).is_empty());
        // Renderings that are not ones fail before anything is sent.
        let bad = LookupCall::new(
            &map,
            [Key::from([1u8])],
            &LookupOptions::default().with_render([("key.daddr", "ipv9")]),
        );
        match bad.check() {
            Err(Error::Render { path, message }) => {
                assert_eq!(path, "key.daddr");
                assert_eq!(
                    message,
                    "unknown rendering \"ipv9\"; use ipv4, ipv6, mac, hex, be16, be32 or string"
                );
            }
            other => panic!("{other:?}"),
        }
        assert!(
            LookupCall::new(&map, [Key::from([1u8])], &render)
                .check()
                .is_ok()
        );
    }

    #[test]
    fn values_of_found_keys_only() {
        let r = LookupResult::from(pb::LookupResult {
            key: vec![1],
            found: true,
            per_cpu_values: vec![vec![1], vec![2]],
            ..Default::default()
        });
        let Some(ValueRef::PerCpu(v)) = r.value() else {
            panic!("per-CPU")
        };
        assert_eq!(v.len(), 2);
        let absent = LookupResult::from(pb::LookupResult::default());
        assert!(!absent.found() && absent.value().is_none());
    }
}
