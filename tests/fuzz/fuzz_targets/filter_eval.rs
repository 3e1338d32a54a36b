//! A filter (its source, against one of three map shapes) through the
//! compiler and, when it compiles, the evaluator.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| bpfmap_tests::fuzz::filter_eval(data));
