//! bpfmapd: serves eBPF maps over gRPC, read-only, with resumable dumps.
#![forbid(unsafe_code)]

fn main() -> std::process::ExitCode {
    bpfmapd::daemon::main()
}
