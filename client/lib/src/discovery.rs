//! Targets from DNS (the `discovery` feature): every A and AAAA record of a
//! name (a Kubernetes headless Service has one per node), or the SRV records
//! of a service name.
//!
//! ```no_run
//! # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
//! use bpfmap_client::{ConnectOptions, Fleet, Resolver, TargetSpec};
//!
//! let spec: TargetSpec = "dns:bpfmapd.kube-system.svc.cluster.local.:50051".parse()?;
//! let targets = Resolver::system()?.resolve(&[spec]).await?;
//! let fleet = Fleet::new(targets, ConnectOptions::default());
//! # let _ = fleet;
//! # Ok(()) }
//! ```

use std::{
    collections::HashSet,
    net::{IpAddr, SocketAddr},
    str::FromStr,
    time::Duration,
};

use hickory_resolver::{
    TokioResolver,
    config::{ConnectionConfig, NameServerConfig, ResolveHosts, ResolverConfig, ResolverOpts},
    net::{NetError, runtime::TokioRuntimeProvider},
    proto::rr::RData,
};

use crate::{Error, Target};

/// Where targets come from.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum TargetSpec {
    /// One daemon, `host:port`.
    Addr(Target),
    /// `dns:NAME:PORT`: every A and AAAA record of NAME, at PORT.
    Dns {
        /// The name (a trailing dot makes it absolute: no search list).
        name: String,
        /// The port of every target.
        port: u16,
    },
    /// `srv:NAME` (for example `srv:_bpfmap._tcp.bpfmapd.kube-system.svc`):
    /// every SRV record of NAME, each target host's addresses at its port.
    Srv {
        /// The service name.
        name: String,
    },
}

impl FromStr for TargetSpec {
    type Err = Error;

    fn from_str(s: &str) -> Result<Self, Error> {
        if let Some(rest) = s.strip_prefix("dns:") {
            let (name, port) = rest
                .rsplit_once(':')
                .ok_or_else(|| Error::Target(s.to_owned()))?;
            let port = port.parse().map_err(|_| Error::Target(s.to_owned()))?;
            if name.is_empty() {
                return Err(Error::Target(s.to_owned()));
            }
            return Ok(Self::Dns {
                name: name.to_owned(),
                port,
            });
        }
        if let Some(name) = s.strip_prefix("srv:") {
            if name.is_empty() {
                return Err(Error::Target(s.to_owned()));
            }
            return Ok(Self::Srv {
                name: name.to_owned(),
            });
        }
        s.parse().map(Self::Addr)
    }
}

/// Why a name gave no targets.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum DiscoveryError {
    /// The name does not exist (NXDOMAIN).
    #[error("{name}: no such name")]
    NoSuchName {
        /// The name.
        name: String,
    },
    /// The name exists but has no record of the kind asked for.
    #[error("{name}: no {kind} records")]
    NoRecords {
        /// The name.
        name: String,
        /// "A or AAAA", "SRV".
        kind: &'static str,
    },
    /// Anything else: no answer, a refusal, a malformed name.
    #[error("{name}: {error}")]
    Lookup {
        /// The name.
        name: String,
        /// What the resolver said.
        error: NetError,
    },
    /// The resolver could not be set up (no /etc/resolv.conf, ...).
    #[error("cannot set up DNS resolution: {0}")]
    Setup(NetError),
}

/// Resolves [`TargetSpec`]s.
#[derive(Debug, Clone)]
pub struct Resolver {
    inner: TokioResolver,
}

impl Resolver {
    /// The system's resolver configuration (/etc/resolv.conf).
    pub fn system() -> Result<Self, DiscoveryError> {
        let inner = TokioResolver::builder_tokio()
            .map_err(DiscoveryError::Setup)?
            .build()
            .map_err(DiscoveryError::Setup)?;
        Ok(Self { inner })
    }

    /// One name server at `addr` (UDP, and TCP for answers too large for
    /// UDP), no cache, no hosts file, no search list: for tests and for
    /// asking a cluster's DNS directly.
    pub fn with_name_server(addr: SocketAddr) -> Result<Self, DiscoveryError> {
        let mut udp = ConnectionConfig::udp();
        udp.port = addr.port();
        let mut tcp = ConnectionConfig::tcp();
        tcp.port = addr.port();
        let server = NameServerConfig::new(addr.ip(), true, vec![udp, tcp]);
        let mut opts = ResolverOpts::default();
        opts.cache_size = 0;
        opts.use_hosts_file = ResolveHosts::Never;
        opts.ndots = 0;
        opts.timeout = Duration::from_secs(2);
        opts.attempts = 1;
        let inner = TokioResolver::builder_with_config(
            ResolverConfig::from_name_servers(vec![server]),
            TokioRuntimeProvider::default(),
        )
        .with_options(opts)
        .build()
        .map_err(DiscoveryError::Setup)?;
        Ok(Self { inner })
    }

    /// Every address of `host`: its A and AAAA records (both asked; a name
    /// with records of one family only is fine, a failure of either is an
    /// error rather than half a fleet). An IP address is itself.
    pub async fn addresses(&self, host: &str) -> Result<Vec<IpAddr>, DiscoveryError> {
        if let Ok(ip) = host.trim_matches(['[', ']']).parse::<IpAddr>() {
            return Ok(vec![ip]);
        }
        let (v4, v6) = tokio::join!(self.inner.ipv4_lookup(host), self.inner.ipv6_lookup(host));
        let mut out = Vec::new();
        let mut nx = 0;
        for result in [v4, v6] {
            match result {
                Ok(lookup) => out.extend(lookup.answers().iter().filter_map(|r| match &r.data {
                    RData::A(a) => Some(IpAddr::V4(a.0)),
                    RData::AAAA(a) => Some(IpAddr::V6(a.0)),
                    _ => None,
                })),
                Err(e) if e.is_nx_domain() => nx += 1,
                Err(e) if e.is_no_records_found() => {}
                Err(error) => {
                    return Err(DiscoveryError::Lookup {
                        name: host.to_owned(),
                        error,
                    });
                }
            }
        }
        if nx == 2 {
            return Err(DiscoveryError::NoSuchName {
                name: host.to_owned(),
            });
        }
        if out.is_empty() {
            return Err(DiscoveryError::NoRecords {
                name: host.to_owned(),
                kind: "A or AAAA",
            });
        }
        let mut seen = HashSet::new();
        out.retain(|ip| seen.insert(*ip));
        Ok(out)
    }

    /// The targets of `spec`, in the order the records came.
    pub async fn targets(&self, spec: &TargetSpec) -> Result<Vec<Target>, DiscoveryError> {
        match spec {
            TargetSpec::Addr(t) => Ok(vec![t.clone()]),
            TargetSpec::Dns { name, port } => Ok(self
                .addresses(name)
                .await?
                .into_iter()
                .map(|ip| Target::from_socket_addr(SocketAddr::new(ip, *port)))
                .collect()),
            TargetSpec::Srv { name } => {
                let lookup = self
                    .inner
                    .srv_lookup(name.as_str())
                    .await
                    .map_err(|error| {
                        if error.is_nx_domain() {
                            DiscoveryError::NoSuchName { name: name.clone() }
                        } else if error.is_no_records_found() {
                            DiscoveryError::NoRecords {
                                name: name.clone(),
                                kind: "SRV",
                            }
                        } else {
                            DiscoveryError::Lookup {
                                name: name.clone(),
                                error,
                            }
                        }
                    })?;
                let mut records: Vec<(u16, u16, String)> = lookup
                    .answers()
                    .iter()
                    .filter_map(|r| match &r.data {
                        RData::SRV(srv) => Some((srv.priority, srv.port, srv.target.to_string())),
                        _ => None,
                    })
                    .collect();
                records.sort_by_key(|(priority, _, _)| *priority);
                let mut out = Vec::new();
                for (_, port, host) in records {
                    for ip in self.addresses(&host).await? {
                        out.push(Target::from_socket_addr(SocketAddr::new(ip, port)));
                    }
                }
                Ok(out)
            }
        }
    }

    /// The targets of every spec, duplicates dropped, order kept.
    pub async fn resolve(&self, specs: &[TargetSpec]) -> Result<Vec<Target>, DiscoveryError> {
        let mut seen = HashSet::new();
        let mut out = Vec::new();
        for spec in specs {
            for t in self.targets(spec).await? {
                if seen.insert(t.clone()) {
                    out.push(t);
                }
            }
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn specs_parse() {
        assert_eq!(
            "dns:nodes.fleet.test.:50051".parse::<TargetSpec>().unwrap(),
            TargetSpec::Dns {
                name: "nodes.fleet.test.".into(),
                port: 50051
            }
        );
        assert_eq!(
            "srv:_bpfmap._tcp.fleet.test".parse::<TargetSpec>().unwrap(),
            TargetSpec::Srv {
                name: "_bpfmap._tcp.fleet.test".into()
            }
        );
        assert!(matches!(
            "10.0.0.1:1".parse::<TargetSpec>().unwrap(),
            TargetSpec::Addr(_)
        ));
        for bad in ["dns:name", "dns::1", "dns:name:x", "srv:", "nope"] {
            assert!(bad.parse::<TargetSpec>().is_err(), "{bad}");
        }
    }
}
