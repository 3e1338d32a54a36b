//! Lookups: keys as bytes or JSON, and what each one found.

use crate::{Error, MapName, PerCpuValues, ValueRef, pb};

/// A key to look up: its bytes, or JSON through the map's key type.
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub enum Key {
    /// Exactly the map's key size.
    Bytes(Vec<u8>),
    /// Written as JSON (the form [`LookupResult::decoded_key`] gives):
    /// `{"saddr": 167772160, "proto": "IPPROTO_TCP", ...}`. The daemon
    /// encodes it through the map's key type: every named member must be
    /// given, integers as numbers or decimal strings, enums by name or
    /// number, char arrays as strings. A key that does not fit is
    /// INVALID_ARGUMENT naming the member; a map without types refuses
    /// JSON keys (FAILED_PRECONDITION).
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
}

impl LookupOptions {
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
}

/// A Lookup request, and where each result goes back to.
#[derive(Debug, Clone)]
pub(crate) struct LookupCall {
    pub(crate) request: pb::LookupRequest,
    /// The caller's position of each result the daemon sends (byte keys
    /// first, then JSON keys).
    order: Vec<usize>,
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
        Self {
            request,
            order: bytes_at,
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
