//! The RPCs the daemon serves: one list for the audit log, the metrics and
//! the policy's denials.

use std::fmt;

/// Name of the map service (in the health protocol, and in RPC paths).
pub const SERVICE_NAME: &str = "bpfmap.v1.MapService";

/// The response header carrying the server's version ("0.1.0"), on every
/// call's response (health checks included).
pub const VERSION_HEADER: &str = "bpfmap-version";

/// An RPC the daemon serves.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Rpc {
    /// MapService/ListMaps.
    ListMaps,
    /// MapService/GetMap.
    GetMap,
    /// MapService/DumpMap.
    DumpMap,
    /// MapService/Lookup.
    Lookup,
    /// MapService/AggregateMap.
    AggregateMap,
    /// MapService/HistogramMap.
    HistogramMap,
    /// MapService/StackMap.
    StackMap,
    /// MapService/WatchMap.
    WatchMap,
    /// MapService/DrainMap.
    DrainMap,
    /// grpc.health.v1.Health/Check.
    HealthCheck,
    /// grpc.health.v1.Health/Watch.
    HealthWatch,
    /// grpc.reflection.v1.ServerReflection/ServerReflectionInfo.
    ReflectionV1,
    /// grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo.
    ReflectionV1Alpha,
    /// arrow.flight.protocol.FlightService/ListFlights.
    FlightListFlights,
    /// arrow.flight.protocol.FlightService/GetFlightInfo.
    FlightGetFlightInfo,
    /// arrow.flight.protocol.FlightService/GetSchema.
    FlightGetSchema,
    /// arrow.flight.protocol.FlightService/DoGet.
    FlightDoGet,
}

/// Name of Arrow Flight's service.
pub const FLIGHT_SERVICE_NAME: &str = "arrow.flight.protocol.FlightService";

/// How an RPC streams (the `grpc_type` of the usual gRPC metrics).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum RpcKind {
    /// One request, one response.
    Unary,
    /// One request, a stream of responses.
    ServerStream,
    /// Streams both ways.
    BidiStream,
}

impl RpcKind {
    /// The name in metrics ("server_stream").
    pub fn name(self) -> &'static str {
        match self {
            Self::Unary => "unary",
            Self::ServerStream => "server_stream",
            Self::BidiStream => "bidi_stream",
        }
    }
}

impl Rpc {
    /// Every RPC.
    pub const ALL: [Rpc; 17] = [
        Self::ListMaps,
        Self::GetMap,
        Self::DumpMap,
        Self::Lookup,
        Self::AggregateMap,
        Self::HistogramMap,
        Self::StackMap,
        Self::WatchMap,
        Self::DrainMap,
        Self::HealthCheck,
        Self::HealthWatch,
        Self::ReflectionV1,
        Self::ReflectionV1Alpha,
        Self::FlightListFlights,
        Self::FlightGetFlightInfo,
        Self::FlightGetSchema,
        Self::FlightDoGet,
    ];

    /// The service ("bpfmap.v1.MapService").
    pub fn service(self) -> &'static str {
        match self {
            Self::ListMaps
            | Self::GetMap
            | Self::DumpMap
            | Self::Lookup
            | Self::AggregateMap
            | Self::HistogramMap
            | Self::StackMap
            | Self::WatchMap
            | Self::DrainMap => SERVICE_NAME,
            Self::HealthCheck | Self::HealthWatch => "grpc.health.v1.Health",
            Self::ReflectionV1 => "grpc.reflection.v1.ServerReflection",
            Self::ReflectionV1Alpha => "grpc.reflection.v1alpha.ServerReflection",
            Self::FlightListFlights
            | Self::FlightGetFlightInfo
            | Self::FlightGetSchema
            | Self::FlightDoGet => FLIGHT_SERVICE_NAME,
        }
    }

    /// The method ("DumpMap").
    pub fn method(self) -> &'static str {
        match self {
            Self::ListMaps => "ListMaps",
            Self::GetMap => "GetMap",
            Self::DumpMap => "DumpMap",
            Self::Lookup => "Lookup",
            Self::AggregateMap => "AggregateMap",
            Self::HistogramMap => "HistogramMap",
            Self::StackMap => "StackMap",
            Self::WatchMap => "WatchMap",
            Self::DrainMap => "DrainMap",
            Self::HealthCheck => "Check",
            Self::HealthWatch => "Watch",
            Self::ReflectionV1 | Self::ReflectionV1Alpha => "ServerReflectionInfo",
            Self::FlightListFlights => "ListFlights",
            Self::FlightGetFlightInfo => "GetFlightInfo",
            Self::FlightGetSchema => "GetSchema",
            Self::FlightDoGet => "DoGet",
        }
    }

    /// How it streams.
    pub fn kind(self) -> RpcKind {
        match self {
            Self::DumpMap
            | Self::WatchMap
            | Self::DrainMap
            | Self::HealthWatch
            | Self::FlightListFlights
            | Self::FlightDoGet => RpcKind::ServerStream,
            Self::ReflectionV1 | Self::ReflectionV1Alpha => RpcKind::BidiStream,
            _ => RpcKind::Unary,
        }
    }

    /// The RPC an HTTP/2 request path names ("/bpfmap.v1.MapService/DumpMap").
    pub fn of_path(path: &str) -> Option<Self> {
        let (service, method) = path.trim_start_matches('/').split_once('/')?;
        Self::ALL
            .into_iter()
            .find(|r| r.service() == service && r.method() == method)
    }
}

impl fmt::Display for Rpc {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.method())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths_name_rpcs() {
        for rpc in Rpc::ALL {
            let path = format!("/{}/{}", rpc.service(), rpc.method());
            assert_eq!(Rpc::of_path(&path), Some(rpc), "{path}");
        }
        assert_eq!(Rpc::of_path("/bpfmap.v1.MapService/Nope"), None);
        assert_eq!(Rpc::of_path("nonsense"), None);
    }
}
