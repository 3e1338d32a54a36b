//! The network side: accepting connections (TLS handshakes included),
//! bounding and closing them, counting the calls on each, and
//! authenticating each call's caller from its connection.

mod authenticate;
mod calls;
mod conn;
mod goaway;
mod serve;
mod tls;
mod unix;

pub(crate) use authenticate::authenticate;
pub use authenticate::caller_of;
pub(crate) use calls::CountCalls;
pub(crate) use conn::{AcceptConfig, ConnInfo, ConnRegistry, accept_loop, accept_unix_loop};
pub(crate) use serve::{Http2Settings, serve};
pub use tls::TlsFiles;
pub(crate) use tls::{SharedTls, Transport, server_config};
pub(crate) use unix::{SocketFile, bind as bind_unix};
