//! bpfmap-relay, built into this package so that the tests can run it as a
//! process of its own (`CARGO_BIN_EXE_test-bpfmap-relay`): the same entry
//! point as the `bpfmap-relay` binary.
#![forbid(unsafe_code)]

fn main() -> std::process::ExitCode {
    bpfmap_relay::main()
}
