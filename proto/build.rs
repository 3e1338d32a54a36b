//! Compiles `bpfmap/v1/*.proto` with protox (pure Rust: no protoc needed) and
//! writes the encoded descriptor set that server reflection serves.

use std::{env, fs, path::PathBuf};

use prost::Message;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let protos = [
        "bpfmap/v1/map_service.proto",
        "bpfmap/v1/fleet_service.proto",
        "bpfmap/v1/flight.proto",
    ];
    for proto in protos {
        println!("cargo:rerun-if-changed={proto}");
    }
    let fds = protox::compile(protos, ["."])?;
    let out = PathBuf::from(env::var("OUT_DIR")?);
    fs::write(out.join("bpfmap_descriptor.bin"), fds.encode_to_vec())?;
    // Arrow Flight's service, described for reflection only (its code is
    // the arrow-flight crate's).
    let flight = "arrow/flight/protocol/flight.proto";
    println!("cargo:rerun-if-changed={flight}");
    let flight_fds = protox::compile([flight], ["."])?;
    fs::write(
        out.join("flight_descriptor.bin"),
        flight_fds.encode_to_vec(),
    )?;
    tonic_prost_build::configure()
        .codec_path("crate::codec::StrictCodec")
        // Packed chunks are read in place: their buffers are slices of the
        // received message, not copies of it.
        .bytes(".bpfmap.v1.PackedEntries")
        // Entry is written by hand (src/entry.rs): its decoded forms can be
        // carried already encoded.
        .extern_path(".bpfmap.v1.Entry", "crate::entry::Entry")
        .build_client(true)
        .build_server(true)
        .compile_fds(fds)?;
    Ok(())
}
