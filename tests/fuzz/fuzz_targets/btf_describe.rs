//! BTF bytes through the type-description builder and the decoder.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| bpfmap_tests::fuzz::btf_describe(data));
