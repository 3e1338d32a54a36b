//! Generated types and gRPC stubs for the `bpfmap.v1` protocol.
#![forbid(unsafe_code)]

pub mod aggregate;
pub mod codec;
mod entry;
#[cfg(feature = "arrow")]
pub mod flight;
pub mod histogram;
pub mod stacks;
pub mod status;

/// Package `bpfmap.v1`.
pub mod v1 {
    #![allow(missing_debug_implementations, clippy::all, reason = "generated code")]
    tonic::include_proto!("bpfmap.v1");

    pub use crate::entry::Entry;

    /// Encoded `FileDescriptorSet` of `bpfmap.v1` (and its imports), for
    /// server reflection.
    pub const FILE_DESCRIPTOR_SET: &[u8] =
        include_bytes!(concat!(env!("OUT_DIR"), "/bpfmap_descriptor.bin"));

    /// Encoded `FileDescriptorSet` of Arrow Flight's
    /// `arrow.flight.protocol.FlightService`, for server reflection.
    pub const FLIGHT_FILE_DESCRIPTOR_SET: &[u8] =
        include_bytes!(concat!(env!("OUT_DIR"), "/flight_descriptor.bin"));
}

pub mod typed;
