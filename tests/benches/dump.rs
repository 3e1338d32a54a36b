//! Dump throughput: bpfmapd over gRPC against the baselines, all measured in
//! the same run on the same maps.
//!
//!     cargo bench -p bpfmap-tests --bench dump            (as root)
//!     cargo bench -p bpfmap-tests --bench dump -- 100000  (sizes to run)
//!
//! Baselines: get_next_key + lookup entry by entry (what bpftool and most
//! libraries do), the raw BPF_MAP_LOOKUP_BATCH walk (the floor a remote dump
//! can approach), and `bpftool map dump -j` when bpftool is installed.

use std::{
    process::Command,
    time::{Duration, Instant},
};

use bpfmap_client::{DumpOptions, MapName};
use bpfmap_tests::{BpfFs, Daemon, u64_hash};
use bpfmapd::kernel::{
    MapHandle, MapOps as _,
    walk::{Position, Walker},
};

const RUNS: usize = 5;

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

fn time<T>(mut f: impl FnMut() -> T) -> Duration {
    let mut samples = Vec::new();
    for _ in 0..RUNS {
        let t = Instant::now();
        std::hint::black_box(f());
        samples.push(t.elapsed());
    }
    median(samples)
}

async fn time_async<F: std::future::Future<Output = u64>>(mut f: impl FnMut() -> F) -> Duration {
    let mut samples = Vec::new();
    for _ in 0..RUNS {
        let t = Instant::now();
        std::hint::black_box(f().await);
        samples.push(t.elapsed());
    }
    median(samples)
}

fn key_by_key(handle: &MapHandle) -> u64 {
    let (mut key, mut next, mut value) = (vec![0u8; 8], vec![0u8; 8], vec![0u8; 8]);
    let mut first = true;
    let mut n = 0;
    loop {
        let prev = if first { None } else { Some(key.as_slice()) };
        if handle.get_next_key(prev, &mut next).is_err() {
            return n;
        }
        if handle.lookup(&next, &mut value).is_ok() {
            n += 1;
        }
        std::mem::swap(&mut key, &mut next);
        first = false;
    }
}

fn batch_walk(path: &std::path::Path, chunk: u32) -> u64 {
    let handle = MapHandle::open_pinned(path).unwrap();
    let meta = handle.meta().clone();
    let mut w = Walker::new(handle, meta, Position::Start).unwrap();
    let mut n = 0;
    while let Some(c) = w.next_chunk(chunk).unwrap() {
        n += c.count as u64;
    }
    n
}

fn row(name: &str, d: Duration, n: u32, kbk: Duration, floor: Duration) {
    println!(
        "  {name:<40} {:>9.1} ms {:>7.3} us/entry {:>7.2}x faster than key-by-key {:>6.2}x the batch floor",
        d.as_secs_f64() * 1e3,
        d.as_secs_f64() * 1e6 / f64::from(n),
        kbk.as_secs_f64() / d.as_secs_f64(),
        d.as_secs_f64() / floor.as_secs_f64(),
    );
}

fn main() {
    let sizes: Vec<u32> = std::env::args()
        .skip(1)
        .filter(|a| !a.starts_with('-'))
        .filter_map(|a| a.parse().ok())
        .collect();
    let sizes = if sizes.is_empty() {
        vec![100_000, 1_000_000]
    } else {
        sizes
    };
    let rt = tokio::runtime::Runtime::new().unwrap();
    let bpftool = Command::new("bpftool")
        .arg("version")
        .output()
        .is_ok_and(|o| o.status.success());
    println!(
        "median of {RUNS} runs; u64 key, u64 value, hash map; {} CPUs",
        bpfmapd::kernel::possible_cpus()
    );
    for n in sizes {
        let fs = BpfFs::new();
        let (fd, _) = u64_hash(&fs, "m", n, n);
        let path = fs.path().join("m");
        let handle = MapHandle::open_pinned(&path).unwrap();
        println!("{n} entries:");

        let kbk = time(|| assert_eq!(key_by_key(&handle), u64::from(n)));
        let floor = time(|| assert_eq!(batch_walk(&path, 5000), u64::from(n)));
        row("get_next_key + lookup", kbk, n, kbk, floor);
        row("BPF_MAP_LOOKUP_BATCH, 5000/call", floor, n, kbk, floor);
        if bpftool {
            let d = time(|| {
                let out = Command::new("bpftool")
                    .args(["map", "dump", "-j", "pinned"])
                    .arg(&path)
                    .output()
                    .unwrap();
                assert!(out.status.success());
                out.stdout.len()
            });
            row("bpftool map dump -j", d, n, kbk, floor);
        } else {
            println!(
                "  bpftool map dump -j                (bpftool not installed: apt-get install bpftool)"
            );
        }

        rt.block_on(async {
            let state = tempfile::tempdir().unwrap();
            let daemon = Daemon::start(fs.path(), state.path()).await;
            let client = daemon.client().await;
            for (name, packed, chunk) in [
                ("bpfmapd gRPC, packed, chunk 1024", true, 0),
                ("bpfmapd gRPC, packed, chunk 5000", true, 5000),
                ("bpfmapd gRPC, entries, chunk 1024", false, 0),
            ] {
                let d = time_async(|| {
                    let client = client.clone();
                    async move {
                        let map: MapName = "m".parse().unwrap();
                        let mut dump = client.dump(
                            map,
                            DumpOptions {
                                packed,
                                chunk_size: chunk,
                                ..Default::default()
                            },
                        );
                        while dump.next_chunk().await.unwrap().is_some() {}
                        assert_eq!(dump.received(), u64::from(n));
                        dump.received()
                    }
                })
                .await;
                row(name, d, n, kbk, floor);
            }
            daemon.stop().await;

            // The same over mutual TLS (rustls, ring).
            let pki = bpfmap_tests::pki::Pki::new();
            let tls_daemon = Daemon::start_with(bpfmapd::Config {
                tls: Some(pki.server_files()),
                rules: vec![bpfmapd::RuleConfig {
                    identities: vec!["cn:bench".into()],
                    maps: vec!["**".into()],
                    operations: vec![bpfmapd::Operation::Dump],
                }],
                ..Daemon::config(fs.path(), state.path())
            })
            .await;
            let tls = pki.client(
                "bench",
                bpfmap_tests::pki::Name::Cn("bench"),
                bpfmap_tests::pki::Validity::Now,
            );
            let client = tls_daemon.tls_client(&tls).await.unwrap();
            let d = time_async(|| {
                let client = client.clone();
                async move {
                    let mut dump = client.dump("m".parse().unwrap(), DumpOptions::default());
                    while dump.next_chunk().await.unwrap().is_some() {}
                    assert_eq!(dump.received(), u64::from(n));
                    dump.received()
                }
            })
            .await;
            row("bpfmapd gRPC+mTLS, packed, chunk 1024", d, n, kbk, floor);
            tls_daemon.stop().await;
        });
        drop((handle, fd));
        typed(n, &rt);
    }
}

/// A typed map (the demo's flows: a 5-tuple struct key, a struct of two
/// counters) of `n` entries: the transfer alone, then decoded on the client
/// (the library, packed chunks, to JSON text), by the daemon (grpcurl's
/// layout), and by bpfmapctl writing JSON Lines, whole process.
fn typed(n: u32, rt: &tokio::runtime::Runtime) {
    let fs = BpfFs::new();
    let map = bpfmapd::typed_flows(n).unwrap();
    fs.pin(&map, "flows");
    println!("{n} typed entries (demo/flows types: 16-byte struct key, 16-byte struct value):");
    rt.block_on(async {
        let state = tempfile::tempdir().unwrap();
        let daemon = Daemon::start(fs.path(), state.path()).await;
        let client = daemon.client().await;
        let name: MapName = "flows".parse().unwrap();
        let types = client.map_types(&name).await.unwrap().expect("typed");
        let transfer = time_async(|| {
            let client = client.clone();
            let name = name.clone();
            async move {
                let mut dump = client.dump(name, DumpOptions::default());
                while dump.next_chunk().await.unwrap().is_some() {}
                dump.received()
            }
        })
        .await;
        let decoded = time_async(|| {
            let (client, name, types) = (client.clone(), name.clone(), types.clone());
            async move {
                let mut dump = client.dump(name, DumpOptions::default());
                let mut out = Vec::with_capacity(1 << 20);
                let mut bytes = 0;
                while let Some(chunk) = dump.next_chunk().await.unwrap() {
                    for e in &chunk {
                        types.write_entry_json(e, &mut out);
                        out.push(b'\n');
                    }
                    bytes += out.len();
                    out.clear();
                }
                assert!(bytes > 0);
                dump.received()
            }
        })
        .await;
        let by_daemon = time_async(|| {
            let addr = daemon.addr();
            async move {
                let mut raw = bpfmap_client::pb::map_service_client::MapServiceClient::new(
                    tonic::transport::Endpoint::from_shared(addr)
                        .unwrap()
                        .connect()
                        .await
                        .unwrap(),
                )
                .max_decoding_message_size(64 << 20);
                let mut s = raw
                    .dump_map(bpfmap_client::pb::DumpMapRequest {
                        map: Some(bpfmap_client::pb::MapRef {
                            r#ref: Some(bpfmap_client::pb::map_ref::Ref::Path("flows".into())),
                        }),
                        ..Default::default()
                    })
                    .await
                    .unwrap()
                    .into_inner();
                let mut count = 0u64;
                while let Some(m) = s.message().await.unwrap() {
                    count += m
                        .entries
                        .iter()
                        .filter(|e| e.decoded_value.is_some())
                        .count() as u64;
                }
                assert_eq!(count, u64::from(n));
                count
            }
        })
        .await;
        let ms = |d: Duration| d.as_secs_f64() * 1e3;
        println!(
            "  {:<52} {:>9.1} ms",
            "library, packed, bytes only (the transfer)",
            ms(transfer)
        );
        println!(
            "  {:<52} {:>9.1} ms   decoding costs {:.2}x the transfer",
            "library, packed, decoded to JSON text on the client",
            ms(decoded),
            (decoded.as_secs_f64() - transfer.as_secs_f64()).max(0.0) / transfer.as_secs_f64()
        );
        println!(
            "  {:<52} {:>9.1} ms   {:.2}x the packed transfer",
            "entries layout, decoded by the daemon (grpcurl's)",
            ms(by_daemon),
            by_daemon.as_secs_f64() / transfer.as_secs_f64()
        );
        let ctl = std::path::Path::new(env!("CARGO_BIN_EXE_test-bpfmapctl"));
        let url = daemon.addr();
        let run = |raw: bool| {
            let url = url.clone();
            move || {
                let mut cmd = Command::new(ctl);
                cmd.args(["--addr", &url]);
                if raw {
                    cmd.arg("--raw");
                }
                let out = cmd.args(["dump", "flows"]).output().unwrap();
                assert!(out.status.success());
                out.stdout.len()
            }
        };
        let (raw_d, typed_d) = tokio::task::block_in_place(|| (time(run(true)), time(run(false))));
        println!(
            "  {:<52} {:>9.1} ms",
            "bpfmapctl dump --raw > file (hex JSON Lines)",
            ms(raw_d)
        );
        println!(
            "  {:<52} {:>9.1} ms   {:.2}x the hex output",
            "bpfmapctl dump > file (typed JSON Lines)",
            ms(typed_d),
            typed_d.as_secs_f64() / raw_d.as_secs_f64()
        );
        daemon.stop().await;
    });
    drop(map);
}
