//! Support for fleets of daemon processes on this machine (the fleet test
//! and benchmark): their configuration, starting hundreds of them at once,
//! a port free on all their addresses, a fleet with every kind of fault at
//! once ([`FaultyFleet`]), and what the client process holds while it
//! reads them (resident memory, open descriptors).

use std::{
    collections::BTreeMap,
    net::{IpAddr, TcpListener},
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, Ordering},
    },
    time::Duration,
};

use bpfmap_client::{Chunk, ClientTls, Target, ValueRef};
use tempfile::TempDir;

use crate::{
    BpfFs, OwnedMap,
    netns::NetNs,
    pki::{Name, Pki, Validity},
    process::DaemonProcess,
    u64_hash_of,
};

/// The identity of the fleet's reader (the clients' certificates).
pub const READER: &str = "spiffe://example.org/fleet/reader";

/// A daemon's configuration besides its address, root and state: mutual
/// TLS with `pki`'s server files, and a rule letting [`READER`] list, dump
/// and look up the maps under `fleet/`.
pub fn tls_config(pki: &Pki) -> String {
    let files = pki.server_files();
    format!(
        "[tls]\ncert = \"{}\"\nkey = \"{}\"\nclient_ca = \"{}\"\n[[rule]]\nidentities = [\"{READER}\"]\nmaps = [\"fleet/**\"]\noperations = [\"list\", \"dump\", \"lookup\"]\n",
        files.cert.display(),
        files.key.display(),
        files.client_ca.display()
    )
}

/// Runs `f` on every item, `threads` at a time, and returns the results in
/// the items' order: to start hundreds of daemon processes, each of which
/// is waited for until it listens, in the time of a few.
pub fn in_parallel<T: Sync, R: Send>(
    items: &[T],
    threads: usize,
    f: impl Fn(&T) -> R + Sync,
) -> Vec<R> {
    let next = Mutex::new(0usize);
    let results: Vec<Mutex<Option<R>>> = items.iter().map(|_| Mutex::new(None)).collect();
    std::thread::scope(|s| {
        for _ in 0..threads.clamp(1, items.len().max(1)) {
            s.spawn(|| {
                loop {
                    let i = {
                        let mut next = next.lock().unwrap();
                        let i = *next;
                        *next += 1;
                        i
                    };
                    let Some(item) = items.get(i) else { break };
                    *results[i].lock().unwrap() = Some(f(item));
                }
            });
        }
    });
    results
        .into_iter()
        .map(|r| r.into_inner().unwrap().expect("every item ran"))
        .collect()
}

/// A TCP port free on every one of `ips`.
pub fn port_free_on(ips: &[IpAddr]) -> u16 {
    for _ in 0..50 {
        let port = crate::process::free_addr("127.0.0.1").port();
        if ips.iter().all(|ip| TcpListener::bind((*ip, port)).is_ok()) {
            return port;
        }
    }
    panic!("no port free on all of {} addresses", ips.len());
}

/// `n` distinct loopback addresses from 127.0.0.2 on (127.0.0.2-254, then
/// 127.0.1.2-254, ...).
pub fn loopback_addrs(n: usize) -> Vec<IpAddr> {
    (0..n)
        .map(|i| {
            let (third, fourth) = (i / 253, i % 253 + 2);
            IpAddr::from([127, 0, third as u8, fourth as u8])
        })
        .collect()
}

/// A field of this process's /proc status, in KiB ("VmRSS:", "VmHWM:").
fn status_kib(field: &str) -> u64 {
    status_kib_of("self", field)
}

/// A field of process `pid`'s /proc status ("self" for this one), in KiB.
fn status_kib_of(pid: &str, field: &str) -> u64 {
    let path = format!("/proc/{pid}/status");
    std::fs::read_to_string(&path)
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix(field))
                .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        })
        .unwrap_or_else(|| panic!("no {field} in {path}"))
}

/// Another process's resident memory now and at its peak, in MiB.
pub fn memory_mib_of(pid: u32) -> (f64, f64) {
    let mib = |field| status_kib_of(&pid.to_string(), field) as f64 / 1024.0;
    (mib("VmRSS:"), mib("VmHWM:"))
}

/// This process's resident memory now, in KiB.
pub fn rss_kib() -> u64 {
    status_kib("VmRSS:")
}

/// This process's peak resident memory since the last [`reset_peak`], in
/// KiB.
pub fn peak_kib() -> u64 {
    status_kib("VmHWM:")
}

/// Resets the peak resident memory to the memory resident now.
pub fn reset_peak() {
    std::fs::write("/proc/self/clear_refs", "5")
        .expect("reset VmHWM through /proc/self/clear_refs");
}

/// This process's open file descriptors.
pub fn open_fds() -> usize {
    std::fs::read_dir("/proc/self/fd")
        .expect("/proc/self/fd")
        .count()
}

/// This process's open file descriptors by kind ("socket", "pipe",
/// `anon_inode:[eventfd]`, "file", ...).
pub fn fd_kinds() -> BTreeMap<String, usize> {
    let mut kinds = BTreeMap::new();
    for entry in std::fs::read_dir("/proc/self/fd")
        .expect("/proc/self/fd")
        .flatten()
    {
        let Ok(link) = std::fs::read_link(entry.path()) else {
            continue;
        };
        let link = link.to_string_lossy();
        let kind = if link.starts_with('/') {
            "file".to_owned()
        } else {
            link.split(['[', ':']).next().unwrap_or_default().to_owned()
        };
        *kinds.entry(kind).or_default() += 1;
    }
    kinds
}

/// Samples this process's open descriptors every millisecond, on a thread
/// of its own, until stopped: the most seen, and their kinds then.
#[derive(Debug)]
pub struct FdSampler {
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<(usize, BTreeMap<String, usize>)>>,
}

impl FdSampler {
    pub fn start() -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let flag = stop.clone();
        let thread = std::thread::spawn(move || {
            let (mut most, mut kinds) = (0, BTreeMap::new());
            loop {
                let stopping = flag.load(Ordering::Relaxed);
                let n = open_fds();
                if n > most {
                    most = n;
                    kinds = fd_kinds();
                }
                if stopping {
                    return (most, kinds);
                }
                std::thread::sleep(Duration::from_millis(1));
            }
        });
        Self {
            stop,
            thread: Some(thread),
        }
    }

    /// The most descriptors open at once while it ran, and their kinds.
    pub fn stop(mut self) -> (usize, BTreeMap<String, usize>) {
        self.stop.store(true, Ordering::Relaxed);
        self.thread
            .take()
            .expect("running")
            .join()
            .expect("the sampler")
    }
}

/// Raises this process's soft limit of open descriptors to its hard limit
/// (a client of a thousand daemons, each with a map and a log pipe here);
/// the limit now.
#[allow(
    unsafe_code,
    reason = "getrlimit(2)/setrlimit(2) have no safe wrapper in std"
)]
pub fn raise_fd_limit() -> u64 {
    let mut limit = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes one rlimit into the struct we own.
    let ret = unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) };
    assert_eq!(ret, 0, "getrlimit(RLIMIT_NOFILE) failed");
    limit.rlim_cur = limit.rlim_max;
    // SAFETY: setrlimit reads one rlimit from the struct we own.
    let ret = unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &limit) };
    assert_eq!(ret, 0, "setrlimit(RLIMIT_NOFILE) failed");
    limit.rlim_cur
}

/// What a host of a [`FaultyFleet`] is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Kind {
    Healthy,
    /// Nothing listens on its address.
    Dead,
    /// Its daemon is stopped (SIGSTOP): the kernel accepts connections, the
    /// daemon never answers.
    Frozen,
    /// Its certificate comes from another CA.
    OtherCa,
    /// Its daemon is in a network namespace whose link drops every packet.
    BlackHole,
    /// Its daemon is in a network namespace behind a 1 Mbit/s link.
    Slow,
    /// Its daemon is killed in the middle of the dump and started again.
    Restarted,
}

impl Kind {
    /// Whether the host answers (slowly, or after a restart, for some).
    pub fn healthy(self) -> bool {
        matches!(self, Kind::Healthy | Kind::Slow | Kind::Restarted)
    }

    /// Entries of host `n`'s map: 200 to 1,000 for most, more behind a slow
    /// link (so that the link shows) and on the daemons killed mid-dump (so
    /// that the kill lands in the middle of the dump).
    pub fn entries(self, n: u64) -> u64 {
        match self {
            Kind::Slow => 8_000,
            Kind::Restarted => 200_000,
            _ => 200 + n * 37 % 801,
        }
    }
}

/// The faults of a [`FaultyFleet`], besides its daemons: 4 addresses where
/// nothing listens; among the daemons 4 frozen, 4 with a certificate from
/// another CA, 3 behind a black hole, 3 behind a 1 Mbit/s link and 3
/// killed and restarted mid-dump.
pub const FAULTS: &[(Kind, usize)] = &[
    (Kind::Dead, 4),
    (Kind::Frozen, 4),
    (Kind::OtherCa, 4),
    (Kind::BlackHole, 3),
    (Kind::Slow, 3),
    (Kind::Restarted, 3),
];

/// `faults` spread evenly among `n` targets; the rest are healthy.
pub fn layout(n: usize, faults: &[(Kind, usize)]) -> Vec<Kind> {
    let faults: Vec<Kind> = faults
        .iter()
        .flat_map(|&(k, count)| std::iter::repeat_n(k, count))
        .collect();
    assert!(faults.len() <= n, "more faults than targets");
    let mut kinds = vec![Kind::Healthy; n];
    for (i, k) in faults.iter().enumerate() {
        kinds[(2 * i + 1) * n / (2 * faults.len())] = *k;
    }
    kinds
}

/// One host of a [`FaultyFleet`]. Its daemon stops before its namespace
/// goes.
#[derive(Debug)]
pub struct Host {
    pub kind: Kind,
    pub target: Target,
    /// The keys its map holds ([`Tally`]).
    pub keys: KeyRange,
    pub process: Option<DaemonProcess>,
    ns: Option<NetNs>,
}

/// The keys of a host's map: `count` keys from `first` on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KeyRange {
    pub first: u64,
    pub count: u64,
}

/// A fleet of daemon processes with every fault of [`FAULTS`] at once,
/// spread among them: each daemon on its own address (127.0.x.y; those
/// behind a black hole or a slow link in a network namespace of their
/// own), one port for all, mutual TLS with certificates that carry
/// "localhost", each with a map `MAP` of its own under its own directory
/// of one bpffs (keys n * 1,000,000 + i -> key * 7, u64 LE).
#[derive(Debug)]
pub struct FaultyFleet {
    pub hosts: Vec<Host>,
    pki: Pki,
    _other_ca: Pki,
    _maps: Vec<OwnedMap>,
    _state: TempDir,
    _fs: BpfFs,
}

impl FaultyFleet {
    /// Starts `daemons` daemon processes of `bin` (all at once, each
    /// waited for until it listens) with `map` each, and sets up the
    /// faults: the frozen daemons stopped, the black holes closed, the slow
    /// links limited.
    pub fn start(bin: &std::path::Path, daemons: usize, map: &str) -> Self {
        crate::netns::require_iproute2();
        let dead = FAULTS
            .iter()
            .filter(|(k, _)| *k == Kind::Dead)
            .map(|(_, n)| n)
            .sum::<usize>();
        let kinds = layout(daemons + dead, FAULTS);
        let pki = Pki::new();
        let other_ca = Pki::new();
        let fs = BpfFs::new();
        let state = tempfile::tempdir().expect("a state directory");
        let loopback = loopback_addrs(kinds.len());
        let port = port_free_on(&loopback);
        let configs = (tls_config(&pki), tls_config(&other_ca));
        let mut maps = Vec::new();
        let mut specs = Vec::new();
        for (i, kind) in kinds.iter().enumerate() {
            let n = i as u64 + 1;
            let ns = matches!(kind, Kind::BlackHole | Kind::Slow).then(NetNs::new);
            let ip: IpAddr = match &ns {
                Some(ns) => ns.addr.into(),
                None => loopback[i],
            };
            let keys = if *kind == Kind::Dead {
                KeyRange { first: 0, count: 0 }
            } else {
                let (first, entries) = (n * 1_000_000, kind.entries(n));
                let max_entries = (entries as u32).next_power_of_two().max(64);
                let (m, _) = u64_hash_of(
                    &fs,
                    &format!("h{n}/{map}"),
                    first..first + entries,
                    |k| k * 7,
                    max_entries,
                );
                maps.push(m);
                KeyRange {
                    first,
                    count: entries,
                }
            };
            specs.push((n, *kind, std::net::SocketAddr::new(ip, port), keys, ns));
        }
        let processes = in_parallel(&specs, 32, |(n, kind, addr, _, ns)| {
            if *kind == Kind::Dead {
                return None;
            }
            let root = fs.path().join(format!("h{n}"));
            let state = state.path().join(format!("h{n}"));
            std::fs::create_dir_all(&state).expect("a state directory");
            let config = if *kind == Kind::OtherCa {
                &configs.1
            } else {
                &configs.0
            };
            let launch = ns.as_ref().map(NetNs::launch).unwrap_or_default();
            Some(DaemonProcess::launch(
                bin, &root, &state, *addr, config, launch,
            ))
        });
        let hosts: Vec<Host> = specs
            .into_iter()
            .zip(processes)
            .map(|((_, kind, addr, keys, ns), process)| Host {
                kind,
                target: Target::from_socket_addr(addr),
                keys,
                process,
                ns,
            })
            .collect();
        for host in &hosts {
            match host.kind {
                Kind::Frozen => host
                    .process
                    .as_ref()
                    .expect("a daemon")
                    .signal(libc::SIGSTOP),
                Kind::BlackHole => host.ns.as_ref().expect("a namespace").black_hole(),
                Kind::Slow => host.ns.as_ref().expect("a namespace").limit_rate("1mbit"),
                _ => {}
            }
        }
        Self {
            hosts,
            pki,
            _other_ca: other_ca,
            _maps: maps,
            _state: state,
            _fs: fs,
        }
    }

    /// The targets, in the fleet's order.
    pub fn targets(&self) -> Vec<Target> {
        self.hosts.iter().map(|h| h.target.clone()).collect()
    }

    /// The client's TLS: the fleet's CA, a certificate of [`READER`], the
    /// shared name "localhost".
    pub fn client_tls(&self) -> ClientTls {
        self.pki
            .client("reader", Name::Spiffe(READER), Validity::Now)
            .with_server_name("localhost")
    }

    /// The files of a [`READER`] certificate from the fleet's CA, for a
    /// relay in front of it: its client TLS to the daemons (the shared
    /// name "localhost").
    pub fn relay_client_tls(&self) -> bpfmap_relay::ClientTlsFiles {
        self.pki
            .client("relay", Name::Spiffe(READER), Validity::Now);
        bpfmap_relay::ClientTlsFiles {
            ca: self.pki.path("ca.pem"),
            cert: self.pki.path("relay.pem"),
            key: self.pki.path("relay.key"),
            server_name: Some("localhost".into()),
        }
    }

    /// A fresh [`Tally`] for every target.
    pub fn tallies(&self) -> std::collections::HashMap<Target, Tally> {
        self.hosts
            .iter()
            .map(|h| (h.target.clone(), Tally::new(h.keys)))
            .collect()
    }

    /// Threads that kill each daemon of kind [`Kind::Restarted`] whose
    /// target [`Restarts::chunk_from`] names (the first time), and start it
    /// again 300 ms later.
    pub fn restarts(&mut self) -> Restarts {
        let mut senders = std::collections::HashMap::new();
        let mut threads = Vec::new();
        for host in self.hosts.iter_mut().filter(|h| h.kind == Kind::Restarted) {
            let (tx, rx) = std::sync::mpsc::channel::<()>();
            let mut process = host.process.take().expect("a daemon");
            threads.push((
                host.target.clone(),
                std::thread::spawn(move || {
                    let killed = rx.recv().is_ok();
                    if killed {
                        process.kill9();
                        std::thread::sleep(Duration::from_millis(300));
                        process.restart();
                    }
                    (process, killed)
                }),
            ));
            senders.insert(host.target.clone(), tx);
        }
        Restarts { senders, threads }
    }

    /// Waits for the restarts and takes their daemons back: the targets
    /// whose daemon was not killed (no chunk came from it).
    pub fn finish(&mut self, restarts: Restarts) -> Vec<Target> {
        drop(restarts.senders);
        let mut not_killed = Vec::new();
        for (target, thread) in restarts.threads {
            let (process, killed) = thread.join().expect("a restart thread");
            if !killed {
                not_killed.push(target.clone());
            }
            let host = self
                .hosts
                .iter_mut()
                .find(|h| h.target == target)
                .expect("a host");
            host.process = Some(process);
        }
        not_killed
    }
}

/// The daemons to kill and restart mid-dump ([`FaultyFleet::restarts`]).
#[derive(Debug)]
pub struct Restarts {
    senders: std::collections::HashMap<Target, std::sync::mpsc::Sender<()>>,
    threads: Vec<(Target, std::thread::JoinHandle<(DaemonProcess, bool)>)>,
}

impl Restarts {
    /// A chunk came from `target`: if it is one to restart and was not
    /// killed yet, kill it now (and start it again soon).
    pub fn chunk_from(&mut self, target: &Target) {
        if let Some(tx) = self.senders.remove(target) {
            let _ = tx.send(());
        }
    }
}

/// What a target delivered, checked as it arrives against what its map
/// holds (keys `first..first + entries`, each -> key * 7), without keeping
/// the entries (the client's memory is measured): each key of the map
/// once, with its value.
#[derive(Debug)]
pub struct Tally {
    first: u64,
    seen: Vec<bool>,
    /// Entries delivered.
    pub delivered: u64,
    /// The first entries that were not the map's, or came twice.
    pub wrong: Vec<String>,
}

impl Tally {
    pub fn new(keys: KeyRange) -> Self {
        Self {
            first: keys.first,
            seen: vec![false; keys.count as usize],
            delivered: 0,
            wrong: Vec::new(),
        }
    }

    /// Checks and counts a chunk's entries.
    pub fn add(&mut self, chunk: &Chunk) {
        for entry in chunk {
            self.delivered += 1;
            let key = u64::from_le_bytes(entry.key.try_into().unwrap_or_default());
            let value = match entry.value {
                ValueRef::Single(v) => v.try_into().ok().map(u64::from_le_bytes),
                ValueRef::PerCpu(_) => None,
            };
            let slot = key
                .checked_sub(self.first)
                .and_then(|i| self.seen.get_mut(i as usize));
            let problem = match slot {
                None => Some("not in its map"),
                Some(seen) if *seen => Some("delivered twice"),
                Some(seen) => {
                    *seen = true;
                    (value != Some(key.wrapping_mul(7))).then_some("with the wrong value")
                }
            };
            if let Some(problem) = problem
                && self.wrong.len() < 5
            {
                self.wrong
                    .push(format!("key {key} {problem} (value {:?})", entry.value));
            }
        }
    }

    /// Entries the map holds.
    pub fn expected(&self) -> u64 {
        self.seen.len() as u64
    }

    /// Whether every key of the map came once, and nothing else.
    pub fn exact(&self) -> bool {
        self.wrong.is_empty() && self.delivered == self.expected()
    }
}
