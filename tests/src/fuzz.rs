//! The fuzz targets' bodies: the type-description builder (BTF bytes to
//! `TypeInfo`) and the decoder (a `TypeInfo` and bytes to JSON, back to
//! bytes, summed). Run by `tests/fuzz` (cargo-fuzz, libFuzzer) and, on
//! stable Rust in every test run, by `tests/tests/fuzz.rs` over mutated
//! seeds. Whatever the input, nothing may panic, hang or read outside the
//! bytes given; every decoded value must be valid JSON.

use bpfmap_proto::{
    typed::{JsonWriter, Layout},
    v1::TypeInfo,
};
use prost::Message as _;

/// Largest value the targets decode (a description may claim more).
const MAX_BYTES: usize = 1 << 16;

/// Types are looked up by id up to this many.
const MAX_IDS: u32 = 64;

/// BTF bytes, as the kernel would hand them out: parsed, every type
/// described, every description decoded.
pub fn btf_describe(data: &[u8]) {
    let Ok(btf) = bpfmapd::btf::parse(data, None) else {
        return;
    };
    for id in 1..=MAX_IDS {
        if let Ok(info) = bpfmapd::btf::describe(&btf, id) {
            decode_through(&info, data);
        }
    }
}

/// A `TypeInfo` (protobuf, as a server might send it) followed by value
/// bytes.
pub fn typed_decode(data: &[u8]) {
    let (len, rest) = match data.split_first() {
        Some((&n, rest)) => (usize::from(n) * 4, rest),
        None => return,
    };
    let (head, tail) = rest.split_at(len.min(rest.len()));
    if let Ok(info) = TypeInfo::decode(head) {
        decode_through(&info, tail);
    }
}

/// Decodes `bytes` (cut or padded to the type's size) every way the
/// daemon, the library and bpfmapctl do.
pub fn decode_through(info: &TypeInfo, bytes: &[u8]) {
    let Ok(layout) = Layout::new(info, "value") else {
        return;
    };
    if layout.size() > MAX_BYTES {
        return;
    }
    let mut value = bytes.to_vec();
    value.resize(layout.size(), 0);
    let mut text = Vec::new();
    layout.write_json(&value, &mut text);
    if let Err(e) = serde_json::from_slice::<serde_json::Value>(&text) {
        panic!(
            "invalid JSON ({e}) for {info:?}: {}",
            String::from_utf8_lossy(&text)
        );
    }
    let decoded = layout.to_value(&value);
    let _ = layout.encode(&decoded, "key");
    let _ = layout.encoded_size_hint();
    let _ = layout.member_names();
    if layout.check_summable().is_ok() {
        let mut sum = Vec::new();
        layout.render_sum(&[&value, &value], &mut JsonWriter::new(&mut sum));
        serde_json::from_slice::<serde_json::Value>(&sum).expect("a sum is valid JSON");
    }
    let mut list = Vec::new();
    layout.render_per_cpu(
        [value.as_slice(), &value[..value.len() / 2]],
        &mut JsonWriter::new(&mut list),
    );
    serde_json::from_slice::<serde_json::Value>(&list).expect("a per-CPU list is valid JSON");
}
