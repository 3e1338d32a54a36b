//! Fleet dumps: wall time to dump a 10,000-entry map from 1, 10 and 25
//! daemons (each a process of its own on its own loopback address) with
//! concurrency 1, 8 and 32, and the client's peak memory for the 25-host
//! run. A fleet should take close to its slowest host, not the sum.
//!
//! On one machine every daemon shares the same CPUs, so without latency the
//! run is bound by the total CPU work. A second table puts each daemon
//! behind a proxy that delays every transfer by 5 ms each way, as a network
//! would: there the overlap shows.
//!
//!     cargo bench -p bpfmap-tests --bench fleet      (as root)

use std::time::{Duration, Instant};

use bpfmap_client::{ConnectOptions, Fleet, FleetDumpOptions, FleetEvent, FleetOptions, Target};
use bpfmap_tests::{BpfFs, MapType, create_map, median, process::DaemonProcess, update_batch};
use futures::StreamExt as _;

const RUNS: usize = 5;
const ENTRIES: u64 = 10_000;
const HOSTS: usize = 25;

/// Peak resident memory of this process since the last reset, in KiB.
fn peak_kib() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("VmHWM:"))
                .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        })
        .unwrap_or(0)
}

fn reset_peak() {
    let _ = std::fs::write("/proc/self/clear_refs", "5");
}

/// A TCP proxy on `listen` to `target` that holds every transfer for
/// `delay` before passing it on, in both directions.
async fn delay_proxy(listen: std::net::SocketAddr, target: std::net::SocketAddr, delay: Duration) {
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    let listener = tokio::net::TcpListener::bind(listen).await.unwrap();
    tokio::spawn(async move {
        while let Ok((client, _)) = listener.accept().await {
            let Ok(server) = tokio::net::TcpStream::connect(target).await else {
                continue;
            };
            let _ = client.set_nodelay(true);
            let _ = server.set_nodelay(true);
            let (cr, cw) = client.into_split();
            let (sr, sw) = server.into_split();
            for (mut r, mut w) in [
                (
                    Box::new(cr) as Box<dyn tokio::io::AsyncRead + Unpin + Send>,
                    Box::new(sw) as Box<dyn tokio::io::AsyncWrite + Unpin + Send>,
                ),
                (Box::new(sr), Box::new(cw)),
            ] {
                tokio::spawn(async move {
                    let mut buf = vec![0u8; 64 << 10];
                    loop {
                        let n = match r.read(&mut buf).await {
                            Ok(0) | Err(_) => break,
                            Ok(n) => n,
                        };
                        tokio::time::sleep(delay).await;
                        if w.write_all(&buf[..n]).await.is_err() {
                            break;
                        }
                    }
                });
            }
        }
    });
}

async fn dump(targets: &[Target], concurrency: usize) -> (Duration, u64) {
    let fleet = Fleet::new(targets.iter().cloned(), ConnectOptions::default())
        .with_options(FleetOptions::default().with_concurrency(concurrency));
    let t = Instant::now();
    let mut run = fleet.dump(&"bench/m".parse().unwrap(), FleetDumpOptions::default());
    let mut entries = 0u64;
    while let Some(event) = run.next().await {
        match event {
            FleetEvent::Answer { answer, .. } => entries += answer.chunk.len() as u64,
            FleetEvent::Done(r) => assert!(r.is_ok(), "{}: {:?}", r.target, r.error),
            other => panic!("{other:?}"),
        }
    }
    (t.elapsed(), entries)
}

fn main() {
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let port = bpfmap_tests::process::free_addr("127.0.0.1").port();
    let mut hosts = Vec::new();
    for n in 0..HOSTS {
        let fs = BpfFs::new();
        let state = tempfile::tempdir().unwrap();
        let map = create_map(MapType::HASH, 8, 8, 16_384);
        let keys: Vec<u8> = (0..ENTRIES).flat_map(|i| i.to_le_bytes()).collect();
        let values: Vec<u8> = (0..ENTRIES)
            .flat_map(|i| (i * n as u64).to_le_bytes())
            .collect();
        update_batch(&map, &keys, &values);
        fs.pin(&map, "bench/m");
        let ip = format!("127.0.0.{}", n + 2);
        let daemon = DaemonProcess::start(
            bpfmap_tests::daemon_bin!(),
            fs.path(),
            state.path(),
            format!("{ip}:{port}").parse().unwrap(),
            "",
        );
        let target: Target = format!("{ip}:{port}").parse().unwrap();
        hosts.push((fs, state, map, daemon, target));
    }
    let targets: Vec<Target> = hosts.iter().map(|h| h.4.clone()).collect();
    println!(
        "fleet dump of a {ENTRIES}-entry hash map per daemon (median of {RUNS} runs; daemons are release builds, one process each, 2 CPUs)"
    );
    runtime.block_on(async {
        // Warm up every daemon and connection path once.
        dump(&targets, 32).await;
        let mut single = Vec::new();
        for t in &targets {
            single.push(dump(std::slice::from_ref(t), 1).await.0);
        }
        let slowest_single = *single.iter().max().unwrap();
        let sum_single: Duration = single.iter().sum();
        println!(
            "  one daemon at a time: median {:.1} ms, slowest {:.1} ms, sum of all 25 {:.1} ms",
            median(single.clone()).as_secs_f64() * 1e3,
            slowest_single.as_secs_f64() * 1e3,
            sum_single.as_secs_f64() * 1e3
        );
        println!("  {:>7} {:>11} {:>10} {:>12} {:>16}", "daemons", "concurrency", "time", "entries/s", "vs slowest host");
        let mut peak = 0;
        for &n in &[1usize, 10, 25] {
            for &c in &[1usize, 8, 32] {
                if n == 25 && c == 32 {
                    reset_peak();
                }
                let mut times = Vec::new();
                let mut entries = 0;
                for _ in 0..RUNS {
                    let (d, e) = dump(&targets[..n], c).await;
                    times.push(d);
                    entries = e;
                }
                if n == 25 && c == 32 {
                    peak = peak_kib();
                }
                assert_eq!(entries, ENTRIES * n as u64);
                let d = median(times);
                println!(
                    "  {n:>7} {c:>11} {:>8.1} ms {:>12.0} {:>15.2}x",
                    d.as_secs_f64() * 1e3,
                    entries as f64 / d.as_secs_f64(),
                    d.as_secs_f64() / slowest_single.as_secs_f64()
                );
            }
        }
        println!("  client peak resident memory during the 25-daemon runs (concurrency 32): {} MiB", peak / 1024);

        // The same daemons behind proxies that delay every transfer by 5 ms
        // each way.
        let mut delayed = Vec::new();
        for (n, t) in targets.iter().enumerate() {
            let listen: std::net::SocketAddr = format!("127.0.0.{}:{}", n + 2, port + 1).parse().unwrap();
            delay_proxy(listen, t.as_str().parse().unwrap(), Duration::from_millis(5)).await;
            delayed.push(Target::from_socket_addr(listen));
        }
        dump(&delayed, 32).await;
        let mut single = Vec::new();
        for t in &delayed {
            single.push(dump(std::slice::from_ref(t), 1).await.0);
        }
        let slowest = *single.iter().max().unwrap();
        println!(
            "  behind a 5 ms delay each way: one daemon at a time: median {:.1} ms, slowest {:.1} ms, sum of all 25 {:.1} ms",
            median(single.clone()).as_secs_f64() * 1e3,
            slowest.as_secs_f64() * 1e3,
            single.iter().sum::<Duration>().as_secs_f64() * 1e3
        );
        println!("  {:>7} {:>11} {:>10} {:>16}", "daemons", "concurrency", "time", "vs slowest host");
        for &n in &[1usize, 10, 25] {
            for &c in &[1usize, 8, 32] {
                let mut times = Vec::new();
                for _ in 0..RUNS {
                    times.push(dump(&delayed[..n], c).await.0);
                }
                let d = median(times);
                println!(
                    "  {n:>7} {c:>11} {:>8.1} ms {:>15.2}x",
                    d.as_secs_f64() * 1e3,
                    d.as_secs_f64() / slowest.as_secs_f64()
                );
            }
        }
    });
}
