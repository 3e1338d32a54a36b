//! bpfmapctl: read eBPF maps from a bpfmapd, as JSON Lines.
#![forbid(unsafe_code)]

fn main() -> std::process::ExitCode {
    bpfmapctl::main()
}
