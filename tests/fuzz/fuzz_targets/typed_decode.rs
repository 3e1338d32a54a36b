//! A type description (as a server might send it) and bytes through the
//! decoder.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| bpfmap_tests::fuzz::typed_decode(data));
