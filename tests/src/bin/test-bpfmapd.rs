//! The bpfmapd daemon, built into this package so that the tests can run it
//! as a process of its own (`CARGO_BIN_EXE_test-bpfmapd`): the same entry
//! point as the `bpfmapd` binary.
#![forbid(unsafe_code)]

fn main() -> std::process::ExitCode {
    bpfmapd::daemon::main()
}
