//! The `bpfmap-relay` binary.
#![forbid(unsafe_code)]

fn main() -> std::process::ExitCode {
    bpfmap_relay::main()
}
