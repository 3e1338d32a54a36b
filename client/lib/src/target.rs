//! The daemons of a fleet.

use std::{fmt, str::FromStr};

use crate::Error;

/// One daemon of a fleet: `host:port` (a name, an IPv4 address, or an IPv6
/// address in brackets), or a local daemon's Unix socket,
/// `unix:///run/bpfmapd.sock`. The scheme of a TCP target follows the
/// connection: https with TLS.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Target(String);

impl Target {
    /// The URL to connect to.
    pub fn url(&self, tls: bool) -> String {
        if self.0.starts_with("unix:") {
            return self.0.clone();
        }
        format!("{}://{}", if tls { "https" } else { "http" }, self.0)
    }

    /// `host:port`, or `unix:///PATH`.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// The target for an address.
    pub fn from_socket_addr(addr: std::net::SocketAddr) -> Self {
        Self(addr.to_string())
    }
}

impl fmt::Display for Target {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl FromStr for Target {
    type Err = Error;

    /// `host:port`, `[v6]:port`, or a URL `http(s)://host:port` (the scheme
    /// is dropped: TLS is a property of the fleet).
    fn from_str(s: &str) -> Result<Self, Error> {
        let bad = || Error::Target(s.to_owned());
        if let Some(path) = s
            .strip_prefix("unix://")
            .or_else(|| s.strip_prefix("unix:"))
        {
            if !path.starts_with('/') || path.len() < 2 {
                return Err(bad());
            }
            return Ok(Self(format!("unix://{path}")));
        }
        let rest = s
            .strip_prefix("http://")
            .or_else(|| s.strip_prefix("https://"))
            .unwrap_or(s)
            .trim_end_matches('/');
        let (host, port) = rest.rsplit_once(':').ok_or_else(bad)?;
        port.parse::<u16>().map_err(|_| bad())?;
        let host_ok = if let Some(v6) = host.strip_prefix('[') {
            v6.strip_suffix(']')
                .is_some_and(|a| a.parse::<std::net::Ipv6Addr>().is_ok())
        } else {
            !host.is_empty()
                && !host.contains(['/', '[', ']', ':', ' '])
                && host
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || "-._".contains(c))
        };
        if !host_ok {
            return Err(bad());
        }
        Ok(Self(rest.to_owned()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn targets_parse_and_refuse_what_is_not_host_port() {
        for (s, want) in [
            ("10.0.0.7:50051", "10.0.0.7:50051"),
            (
                "http://node-1.example.org:50051",
                "node-1.example.org:50051",
            ),
            ("https://[fd00::1]:50051/", "[fd00::1]:50051"),
            ("localhost:1", "localhost:1"),
            ("unix:///run/bpfmapd.sock", "unix:///run/bpfmapd.sock"),
            ("unix:/run/bpfmapd.sock", "unix:///run/bpfmapd.sock"),
        ] {
            assert_eq!(s.parse::<Target>().unwrap().as_str(), want, "{s}");
        }
        for bad in [
            "10.0.0.7",
            "10.0.0.7:",
            ":50051",
            "host:99999",
            "fd00::1:50051",
            "a b:1",
            "x:y",
            "",
            "unix:",
            "unix://relative/path",
        ] {
            assert!(bad.parse::<Target>().is_err(), "{bad:?}");
        }
        let t: Target = "10.0.0.7:50051".parse().unwrap();
        assert_eq!(t.url(true), "https://10.0.0.7:50051");
        assert_eq!(t.url(false), "http://10.0.0.7:50051");
        let u: Target = "unix:/run/bpfmapd.sock".parse().unwrap();
        assert_eq!(u.url(false), "unix:///run/bpfmapd.sock");
    }
}
