//! A DNS server of the tests' own, on loopback (hickory-server, in
//! process): one zone whose names the tests choose, served over UDP and TCP
//! on the same port.

use std::{
    collections::BTreeMap,
    net::{IpAddr, SocketAddr},
    str::FromStr,
    sync::Arc,
    time::Duration,
};

use hickory_server::{
    Server,
    proto::rr::{
        LowerName, Name, RData, Record, RecordSet, RrKey,
        rdata::{A, AAAA, SOA, SRV},
    },
    store::in_memory::InMemoryZoneHandler,
    zone_handler::{AxfrPolicy, Catalog, ZoneHandler, ZoneType},
};

/// What a test's zone holds.
#[derive(Debug, Default, Clone)]
pub struct Zone {
    records: Vec<Record>,
}

fn name(s: &str) -> Name {
    Name::from_str(s).unwrap_or_else(|e| panic!("bad DNS name {s:?}: {e}"))
}

impl Zone {
    /// An address record (A or AAAA) for `host` (absolute, "nodes.fleet.test.").
    pub fn address(mut self, host: &str, ip: IpAddr) -> Self {
        let rdata = match ip {
            IpAddr::V4(v4) => RData::A(A(v4)),
            IpAddr::V6(v6) => RData::AAAA(AAAA(v6)),
        };
        self.records.push(Record::from_rdata(name(host), 30, rdata));
        self
    }

    /// An SRV record: `service` (e.g. "_bpfmap._tcp.fleet.test.") at
    /// `target`:`port`.
    pub fn srv(mut self, service: &str, target: &str, port: u16) -> Self {
        self.records.push(Record::from_rdata(
            name(service),
            30,
            RData::SRV(SRV::new(10, 10, port, name(target))),
        ));
        self
    }
}

/// A running DNS server; stops when dropped.
pub struct DnsServer {
    /// Where it answers (UDP and TCP).
    pub addr: SocketAddr,
    _server: Server<Catalog>,
}

impl std::fmt::Debug for DnsServer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DnsServer")
            .field("addr", &self.addr)
            .finish()
    }
}

impl DnsServer {
    /// Serves `zone` as the zone `origin` ("fleet.test.") on 127.0.0.1.
    pub async fn start(origin: &str, zone: Zone) -> Self {
        let origin = name(origin);
        let serial = 1;
        let mut records: BTreeMap<RrKey, RecordSet> = BTreeMap::new();
        let soa = Record::from_rdata(
            origin.clone(),
            30,
            RData::SOA(SOA::new(
                name(&format!("ns.{origin}")),
                name(&format!("admin.{origin}")),
                serial,
                60,
                60,
                60,
                0,
            )),
        );
        for r in std::iter::once(soa).chain(zone.records) {
            let key = RrKey::new(LowerName::new(&r.name), r.record_type());
            records
                .entry(key)
                .or_insert_with(|| RecordSet::new(r.name.clone(), r.record_type(), serial))
                .insert(r, serial);
        }
        let handler =
            InMemoryZoneHandler::<hickory_server::net::runtime::TokioRuntimeProvider>::new(
                origin.clone(),
                records,
                ZoneType::Primary,
                AxfrPolicy::Deny,
            )
            .expect("a valid zone");
        let mut catalog = Catalog::new();
        catalog.upsert(
            LowerName::new(&origin),
            vec![Arc::new(handler) as Arc<dyn ZoneHandler>],
        );
        let mut server = Server::new(catalog);
        // UDP first, then TCP on the same port (retried if that port is
        // taken for TCP).
        for _ in 0..20 {
            let udp = tokio::net::UdpSocket::bind("127.0.0.1:0")
                .await
                .expect("bind UDP");
            let addr = udp.local_addr().unwrap();
            let Ok(tcp) = tokio::net::TcpListener::bind(addr).await else {
                continue;
            };
            server.register_socket(udp);
            server.register_listener(tcp, Duration::from_secs(5), 65_536);
            return Self {
                addr,
                _server: server,
            };
        }
        panic!("no loopback port free for both UDP and TCP");
    }
}
