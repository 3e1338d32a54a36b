//! bpfmapctl, built into this package so that the tests can run it as a
//! process of its own (`CARGO_BIN_EXE_test-bpfmapctl`): the same entry point
//! as the `bpfmapctl` binary.
#![forbid(unsafe_code)]

fn main() -> std::process::ExitCode {
    bpfmapctl::main()
}
