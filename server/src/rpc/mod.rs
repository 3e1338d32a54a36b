//! The gRPC side: `bpfmap.v1.MapService` (thin handlers over the domain),
//! the response stream of a dump, the one mapping of errors to statuses,
//! and the health service.

mod dump_stream;
mod flight;
mod health;
mod service;
mod status;

pub use flight::FlightEncoder;
pub(crate) use flight::FlightServiceImpl;
pub(crate) use health::service as health_service;
pub(crate) use service::{MapServiceImpl, ServiceParts, streamed};
pub(crate) use status::code;
