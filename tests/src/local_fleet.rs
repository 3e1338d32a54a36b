//! A fleet on this machine for the benchmarks: daemon processes on
//! loopback addresses of their own (one port), each serving a hash map of
//! its own, and a relay process over them.

use std::{
    net::{IpAddr, SocketAddr},
    path::Path,
    process::{Child, Command, Stdio},
    time::Duration,
};

use bpfmap_client::{Target, pb::fleet_service_client::FleetServiceClient};

use crate::{
    BpfFs, MapType, create_map,
    fleet::{in_parallel, loopback_addrs, memory_mib_of, port_free_on},
    process::{DaemonProcess, free_addr},
    update_batch,
};

/// Daemons on loopback addresses sharing one port, each with a hash map at
/// `map` of `entries` u64 keys 0.. (daemon h's values key * (h + 1)): one
/// bpffs, a directory each. Stopped when dropped.
#[derive(Debug)]
pub struct LocalFleet {
    _fs: BpfFs,
    _state: tempfile::TempDir,
    _maps: Vec<bpfmap_kernel::OwnedMap>,
    _processes: Vec<DaemonProcess>,
    /// The daemons, in order.
    pub targets: Vec<Target>,
}

impl LocalFleet {
    /// `n` daemons running `bin` (name it with [`daemon_bin!`](crate::daemon_bin)).
    pub fn start(bin: &Path, n: usize, map: &str, entries: u64) -> Self {
        let (fs, state) = (BpfFs::new(), tempfile::tempdir().unwrap());
        let ips: Vec<IpAddr> = loopback_addrs(n);
        let port = port_free_on(&ips);
        let mut maps = Vec::new();
        for h in 0..n {
            let map_fd = create_map(MapType::HASH, 8, 8, (entries as u32).next_power_of_two());
            let keys: Vec<u8> = (0..entries).flat_map(|i| i.to_le_bytes()).collect();
            let values: Vec<u8> = (0..entries)
                .flat_map(|i| (i * (h as u64 + 1)).to_le_bytes())
                .collect();
            update_batch(&map_fd, &keys, &values);
            fs.pin(&map_fd, &format!("h{h}/{map}"));
            maps.push(map_fd);
        }
        let specs: Vec<(usize, SocketAddr)> = ips
            .iter()
            .enumerate()
            .map(|(h, ip)| (h, SocketAddr::new(*ip, port)))
            .collect();
        let processes = in_parallel(&specs, 32, |(h, addr)| {
            let state = state.path().join(format!("h{h}"));
            std::fs::create_dir_all(&state).unwrap();
            DaemonProcess::start(bin, &fs.path().join(format!("h{h}")), &state, *addr, "")
        });
        let targets = specs
            .iter()
            .map(|(_, a)| Target::from_socket_addr(*a))
            .collect();
        Self {
            _fs: fs,
            _state: state,
            _maps: maps,
            _processes: processes,
            targets,
        }
    }
}

/// A relay process over some targets; killed when dropped.
#[derive(Debug)]
pub struct RelayProcess {
    child: Child,
    /// Where it listens (plaintext, loopback).
    pub addr: SocketAddr,
    _dir: tempfile::TempDir,
}

impl RelayProcess {
    /// Runs `bin` (the relay) over `targets`, `concurrency` at once.
    pub fn start(bin: &Path, targets: &[Target], concurrency: usize) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let addr = free_addr("127.0.0.1");
        let list: Vec<String> = targets
            .iter()
            .map(|t| format!("{:?}", t.as_str()))
            .collect();
        let config = dir.path().join("relay.toml");
        std::fs::write(
            &config,
            format!(
                "listen = \"{addr}\"\nstate_dir = \"{}\"\nconcurrency = {concurrency}\ntargets = [{}]\n",
                dir.path().display(),
                list.join(", ")
            ),
        )
        .unwrap();
        let child = Command::new(bin)
            .arg("--config")
            .arg(&config)
            .stderr(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| panic!("cannot run {}: {e}", bin.display()));
        let relay = Self {
            child,
            addr,
            _dir: dir,
        };
        let started = std::time::Instant::now();
        while std::net::TcpStream::connect(addr).is_err() {
            assert!(
                started.elapsed() < Duration::from_secs(20),
                "the relay did not listen on {addr} within 20 s"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        relay
    }

    /// A raw client of its FleetService.
    pub async fn client(&self) -> FleetServiceClient<tonic::transport::Channel> {
        FleetServiceClient::connect(format!("http://{}", self.addr))
            .await
            .expect("the relay answers")
            .max_decoding_message_size(64 << 20)
    }

    /// Its peak resident memory, in MiB.
    pub fn peak_mib(&self) -> f64 {
        memory_mib_of(self.child.id()).1
    }
}

impl Drop for RelayProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
