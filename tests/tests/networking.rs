//! Real maps read right: the maps of widely run networking programs
//! (Cilium's connection tracking, load balancer and ipcache maps, the XDP
//! tutorial's per-CPU stats, a program's global data), compiled by clang
//! from `bpf/networking.bpf.c` and loaded as loaders load them, filled with
//! known entries in network byte order, and read through grpcurl, the
//! client library and bpfmapctl: ports and addresses as numbers (network
//! order), as renderings asked by a call (`render`, `--render`) or given
//! by the daemon's configuration (`[[render]]`), and looked up by JSON key
//! in either spelling.

use std::{collections::BTreeMap, net::Ipv6Addr};

use bpfmap_client::{
    ConnectOptions, DumpOptions, Error, Fleet, FleetDumpOptions, FleetEvent, Key, LookupOptions,
    MapName, PerCpu,
};
use bpfmap_tests::{networking::*, *};
use futures::StreamExt as _;
use serde_json::{Value as Json, json};

fn ct_entry_json() -> Json {
    json!({
        "reserved0": "0", "backend_id": "0", "packets": "10", "bytes": "15000",
        "lifetime": 12345,
        "rx_closing": 0, "tx_closing": 0, "reserved1": 0, "lb_loopback": 0,
        "seen_non_syn": 1, "node_port": 1, "proxy_redirect": 0, "dsr_internal": 0,
        "from_l7lb": 0, "reserved2": 0, "from_tunnel": 0, "reserved3": 0,
        "rev_nat_index": 7, "reserved4": 0, "tx_flags_seen": 18, "rx_flags_seen": 16,
        "src_sec_id": 42, "last_tx_report": 0, "last_rx_report": 0,
    })
}

/// One map's known entries, as every reader must show them.
struct Case {
    map: &'static str,
    /// The renderings that show its addresses: (member path, rendering).
    render: &'static [(&'static str, &'static str)],
    entries: Vec<Expected>,
}

/// One entry: its key's bytes, and its key and value decoded, as numbers
/// and with the case's renderings.
struct Expected {
    key: Vec<u8>,
    plain: (Json, Json),
    rendered: (Json, Json),
    /// The key as a JSON key in numbers: the decoded key, except that a
    /// union takes one of its members (the bytes, `addr`).
    numbers: Json,
}

impl Case {
    /// The entries' (key, value), sorted by key, rendered or not.
    fn want(&self, rendered: bool) -> Vec<(Json, Json)> {
        sorted(
            self.entries
                .iter()
                .map(|e| {
                    if rendered {
                        e.rendered.clone()
                    } else {
                        e.plain.clone()
                    }
                })
                .collect(),
        )
    }

    /// The renderings as a request's `render` field.
    fn render_json(&self) -> Json {
        self.render
            .iter()
            .map(|(p, r)| ((*p).to_owned(), json!(r)))
            .collect::<serde_json::Map<_, _>>()
            .into()
    }

    /// The renderings as bpfmapctl's `--render` value.
    fn render_arg(&self) -> String {
        self.render
            .iter()
            .map(|(p, r)| format!("{p}={r}"))
            .collect::<Vec<_>>()
            .join(",")
    }
}

fn sorted(mut entries: Vec<(Json, Json)>) -> Vec<(Json, Json)> {
    entries.sort_by_key(|(k, _)| canonical(k));
    entries
}

/// A JSON value's text with every object's members sorted by name,
/// whatever order it came in.
fn canonical(v: &Json) -> String {
    match v {
        Json::Object(o) => {
            let mut members: Vec<(&String, String)> =
                o.iter().map(|(k, v)| (k, canonical(v))).collect();
            members.sort();
            let inner: Vec<String> = members
                .into_iter()
                .map(|(k, v)| format!("{}:{v}", Json::from(k.as_str())))
                .collect();
            format!("{{{}}}", inner.join(","))
        }
        Json::Array(a) => format!(
            "[{}]",
            a.iter().map(canonical).collect::<Vec<_>>().join(",")
        ),
        v => v.to_string(),
    }
}

/// `union v6addr` as its type says: every member of the union, the words
/// in host (little-endian) order, the bytes as they are.
fn v6addr(words: [u32; 4], dwords: [&str; 2], addr: [u8; 16]) -> Json {
    json!({
        "p1": words[0], "p2": words[1], "p3": words[2], "p4": words[3],
        "d1": dwords[0], "d2": dwords[1], "addr": addr,
    })
}

fn cases() -> Vec<Case> {
    let ct4 = |daddr: Json, saddr: Json| json!({"daddr": daddr, "saddr": saddr, "dport": 443, "sport": 51234, "nexthdr": 6, "flags": 0});
    let ct6 = |daddr: Json, saddr: Json| json!({"daddr": daddr, "saddr": saddr, "dport": 443, "sport": 51234, "nexthdr": 6, "flags": 0});
    let fe80_1_bytes = [254u8, 128, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1];
    let fe80_2_bytes = [254u8, 128, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 2];
    let fe80_1 = v6addr(
        [33022, 0, 0, 16777216],
        ["33022", "72057594037927936"],
        fe80_1_bytes,
    );
    let fe80_2 = v6addr(
        [33022, 0, 0, 33554432],
        ["33022", "144115188075855872"],
        fe80_2_bytes,
    );
    let lb4 = |address: Json| json!({"address": address, "dport": 53, "backend_slot": 0, "proto": 17, "scope": 0, "pad": [0, 0]});
    let service = json!({
        "backend_id": 0, "affinity_timeout": 0, "l7_lb_proxy_port": 0,
        "count": 1, "rev_nat_index": 5, "flags": 0, "flags2": 0, "qcount": 0,
    });
    let backend = |address: Json| json!({"address": address, "port": 8053, "proto": 17, "flags": 0, "cluster_id": 0, "zone": 0, "pad": 0});
    let ipcache_key = |prefixlen: u32, family: u8, ip4: Json, ip6: Json| {
        json!({
            "lpm_key": {"prefixlen": prefixlen, "data": []},
            "cluster_id": 0, "pad1": 0, "family": family,
            "ip4": ip4, "pad4": 0, "pad5": 0, "pad6": 0, "ip6": ip6,
        })
    };
    let endpoint = |identity: u32, tunnel: Json, has_tunnel: u8| {
        json!({
            "sec_identity": identity, "tunnel_endpoint": tunnel, "pad": 0, "key": 0,
            "flag_skip_tunnel": 0, "flag_has_tunnel_ep": has_tunnel, "pad2": 0,
        })
    };
    let mut ipcache_v4 = 56u32.to_le_bytes().to_vec();
    ipcache_v4.extend(ipcache_data(AF_INET, &[10, 0, 0, 0]));
    let mut ipcache_v6 = 96u32.to_le_bytes().to_vec();
    ipcache_v6.extend(ipcache_data(
        AF_INET6,
        &"fe80::".parse::<Ipv6Addr>().unwrap().octets(),
    ));
    let ten_bytes = [10u8, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0];
    let fe80_bytes = [254u8, 128, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0];
    let ten = v6addr([10, 0, 0, 0], ["10", "0"], ten_bytes);
    let fe80 = v6addr([33022, 0, 0, 0], ["33022", "0"], fe80_bytes);
    // The per-CPU stats: a list of one value per CPU; XDP_PASS (2) counted.
    let stats: Vec<Expected> = (0u32..5)
        .map(|k| {
            let value = |render: bool| -> Json {
                (0..cpus())
                    .map(|cpu| {
                        let (packets, bytes) = if k == 2 {
                            (cpu as u64 + 1, (cpu as u64 + 1) * 100)
                        } else {
                            (0, 0)
                        };
                        let bytes = if render {
                            json!(format!("{bytes:#x}"))
                        } else {
                            json!(bytes.to_string())
                        };
                        json!({"rx_packets": packets.to_string(), "rx_bytes": bytes})
                    })
                    .collect()
            };
            Expected {
                key: k.to_le_bytes().to_vec(),
                plain: (json!(k), value(false)),
                rendered: (json!(k), value(true)),
                numbers: json!(k),
            }
        })
        .collect();
    vec![
        Case {
            map: CT4,
            render: &[("key.daddr", "ipv4"), ("key.saddr", "ipv4")],
            entries: vec![Expected {
                key: ct4_key().to_vec(),
                plain: (ct4(json!(167772161), json!(3232235522u32)), ct_entry_json()),
                rendered: (
                    ct4(json!("10.0.0.1"), json!("192.168.0.2")),
                    ct_entry_json(),
                ),
                numbers: ct4(json!(167772161), json!(3232235522u32)),
            }],
        },
        Case {
            map: CT6,
            render: &[("key.daddr", "ipv6"), ("key.saddr", "ipv6")],
            entries: vec![Expected {
                key: ct6_key().to_vec(),
                plain: (ct6(fe80_1, fe80_2), ct_entry_json()),
                rendered: (ct6(json!("fe80::1"), json!("fe80::2")), ct_entry_json()),
                numbers: ct6(json!({"addr": fe80_1_bytes}), json!({"addr": fe80_2_bytes})),
            }],
        },
        Case {
            map: LB4_SERVICES,
            render: &[("key.address", "ipv4")],
            entries: vec![Expected {
                key: lb4_key().to_vec(),
                plain: (lb4(json!(174063626)), service.clone()),
                rendered: (lb4(json!("10.96.0.10")), service),
                numbers: lb4(json!(174063626)),
            }],
        },
        Case {
            map: LB4_BACKENDS,
            render: &[("value.address", "ipv4")],
            entries: vec![Expected {
                key: 1u32.to_le_bytes().to_vec(),
                plain: (json!(1), backend(json!(167772421))),
                rendered: (json!(1), backend(json!("10.0.1.5"))),
                numbers: json!(1),
            }],
        },
        Case {
            map: IPCACHE,
            render: &[
                ("key.ip4", "ipv4"),
                ("key.ip6", "ipv6"),
                ("value.tunnel_endpoint", "ipv4"),
            ],
            entries: vec![
                Expected {
                    key: ipcache_v4,
                    plain: (
                        ipcache_key(56, AF_INET, json!(167772160), ten),
                        endpoint(1234, json!(3232235786u32), 1),
                    ),
                    rendered: (
                        ipcache_key(56, AF_INET, json!("10.0.0.0"), json!("a00::")),
                        endpoint(1234, json!("192.168.1.10"), 1),
                    ),
                    // The anonymous union's members are all given, in
                    // order: ip6, last, writes the 16 bytes over ip4 and
                    // the pads, so it must hold the same address.
                    numbers: ipcache_key(56, AF_INET, json!(167772160), json!({"addr": ten_bytes})),
                },
                Expected {
                    key: ipcache_v6,
                    plain: (
                        ipcache_key(96, AF_INET6, json!(4269801472u32), fe80),
                        endpoint(5678, json!(0), 0),
                    ),
                    rendered: (
                        ipcache_key(96, AF_INET6, json!("254.128.0.0"), json!("fe80::")),
                        endpoint(5678, json!("0.0.0.0"), 0),
                    ),
                    numbers: ipcache_key(
                        96,
                        AF_INET6,
                        json!(4269801472u32),
                        json!({"addr": fe80_bytes}),
                    ),
                },
            ],
        },
        Case {
            map: XDP_STATS,
            render: &[("value.rx_bytes", "hex")],
            entries: stats,
        },
    ]
}

/// A DumpMap through grpcurl: every entry's (decodedKey, decodedValue),
/// sorted by key.
async fn grpcurl_dump(host: &str, request: Json) -> Vec<(Json, Json)> {
    let (ok, out, err) = grpcurl(
        &["-plaintext", "-d", &request.to_string()],
        host,
        &["bpfmap.v1.MapService/DumpMap"],
    )
    .await;
    assert!(ok, "{request}: {err}");
    sorted(
        json_stream(&out)
            .iter()
            .filter_map(|d| d["entries"].as_array())
            .flatten()
            .map(|e| (e["decodedKey"].clone(), e["decodedValue"].clone()))
            .collect(),
    )
}

/// A Lookup of one key through grpcurl: its result.
async fn grpcurl_lookup(host: &str, request: Json) -> Json {
    let (ok, out, err) = grpcurl(
        &["-plaintext", "-d", &request.to_string()],
        host,
        &["bpfmap.v1.MapService/Lookup"],
    )
    .await;
    assert!(ok, "{request}: {err}");
    json_stream(&out)[0]["results"][0].clone()
}

/// A decoded value of a bpfmapctl line: "value", or "per_cpu_values".
fn value_of(line: &Json) -> Json {
    line.get("value")
        .or_else(|| line.get("per_cpu_values"))
        .cloned()
        .unwrap_or(Json::Null)
}

/// `bpfmapctl --addr ADDR dump MAP EXTRA...` (JSON Lines): every line's
/// (key, value), sorted by key; each line names the target.
async fn ctl_dump(addr: &str, map: &str, extra: &[&str]) -> Vec<(Json, Json)> {
    let mut args = vec!["--addr", addr, "dump", map];
    args.extend_from_slice(extra);
    let (r, out, err) = ctl(&args).await;
    assert!(r.is_ok(), "{args:?}: {r:?} {err}");
    let target = addr.trim_start_matches("http://");
    sorted(
        json_lines(&out)
            .iter()
            .map(|l| {
                assert_eq!(l["target"], json!(target), "{l}");
                (l["key"].clone(), value_of(l))
            })
            .collect(),
    )
}

/// `bpfmapctl --addr ADDR lookup MAP json:KEY EXTRA...`: the one line.
async fn ctl_lookup(addr: &str, map: &str, key: &Json, extra: &[&str]) -> Json {
    let key = format!("json:{key}");
    let mut args = vec!["--addr", addr, "lookup", map, &key];
    args.extend_from_slice(extra);
    let (r, out, err) = ctl(&args).await;
    assert!(r.is_ok(), "{args:?}: {r:?} {err}");
    let lines = json_lines(&out);
    assert_eq!(lines.len(), 1, "{out}");
    lines[0].clone()
}

/// The client library: a packed dump decoded with the map's types (as
/// they come, and with the case's renderings), the same with the fleet's
/// types beside the dump, and the entries layout decoded by the daemon
/// with the renderings sent along.
async fn library_reads(addr: &str, client: &bpfmap_client::Client, case: &Case) {
    let map = case.map;
    let name: MapName = map.parse().unwrap();
    let info = client.get_map(&name).await.unwrap();
    let plain = info.types().unwrap().expect("types");
    let rendered = info
        .types_with(case.render.iter().copied())
        .unwrap()
        .expect("types");
    assert_eq!(
        rendered.renderings(),
        &bpfmap_client::typed::Renderings::parse(
            &case
                .render
                .iter()
                .map(|(p, r)| ((*p).to_owned(), (*r).to_owned()))
                .collect::<BTreeMap<_, _>>()
        )
        .unwrap()
    );
    let entries = dump_entries(client, map, DumpOptions::default()).await;
    let decode = |t: &bpfmap_client::MapTypes| {
        sorted(
            entries
                .iter()
                .map(|e| {
                    (
                        json_of(&t.decode_key(&e.key)),
                        json_of(&t.decode_value(e.value.view())),
                    )
                })
                .collect(),
        )
    };
    assert_eq!(decode(&plain), case.want(false), "{map}");
    assert_eq!(decode(&rendered), case.want(true), "{map}");
    // JSON keys encode to the entry's bytes in either spelling.
    for e in &case.entries {
        assert_eq!(
            plain.encode_key(&proto_of(&e.numbers)).unwrap(),
            e.key,
            "{map}"
        );
        assert_eq!(
            rendered.encode_key(&proto_of(&e.rendered.0)).unwrap(),
            e.key,
            "{map}"
        );
    }

    // A fleet dump with types: the renderings apply to the types that come
    // with the chunks (bpfmapctl's way).
    let fleet = Fleet::new([addr.parse().unwrap()], ConnectOptions::default());
    let options = FleetDumpOptions::default()
        .with_types(true)
        .with_dump(DumpOptions::default().with_render(case.render.iter().copied()));
    let mut run = fleet.dump(&name, options);
    let mut got = Vec::new();
    while let Some(event) = run.next().await {
        match event {
            FleetEvent::Answer { answer, .. } => {
                let types = answer.types.expect("types with the chunk");
                for e in &answer.chunk {
                    got.push((
                        json_of(&types.decode_key(e.key)),
                        json_of(&types.decode_value(e.value)),
                    ));
                }
            }
            FleetEvent::Done(report) => assert!(report.is_ok(), "{:?}", report.error),
            _ => {}
        }
    }
    assert_eq!(sorted(got), case.want(true), "{map}");

    // The entries layout: the daemon decodes, with the renderings sent.
    let mut dump = client.dump(
        &name,
        DumpOptions::default()
            .with_packed(false)
            .with_render(case.render.iter().copied()),
    );
    let mut got = Vec::new();
    while let Some(chunk) = dump.next_chunk().await.unwrap() {
        for i in 0..chunk.len() {
            got.push((
                json_of(chunk.decoded_key(i).expect("decoded by the daemon")),
                json_of(chunk.decoded_value(i).expect("decoded by the daemon")),
            ));
        }
    }
    assert_eq!(sorted(got), case.want(true), "{map}");
}

/// Every entry looked up by JSON key, in numbers and in the rendered
/// spelling, through grpcurl, the library and bpfmapctl.
async fn lookups(host: &str, addr: &str, client: &bpfmap_client::Client, case: &Case) {
    let map = case.map;
    let name: MapName = map.parse().unwrap();
    let target = addr.trim_start_matches("http://");
    let value_field = |v: &Json| {
        if v.is_array() {
            "per_cpu_values"
        } else {
            "value"
        }
    };
    for e in &case.entries {
        let by_numbers = json!({"map": {"path": map}, "jsonKeys": [e.numbers]});
        let r = grpcurl_lookup(host, by_numbers).await;
        assert_eq!(r["found"], json!(true), "{map}: {r}");
        assert_eq!(
            (r["decodedKey"].clone(), r["decodedValue"].clone()),
            e.plain,
            "{map}"
        );
        let rendered =
            json!({"map": {"path": map}, "jsonKeys": [e.rendered.0], "render": case.render_json()});
        let r = grpcurl_lookup(host, rendered).await;
        assert_eq!(r["found"], json!(true), "{map}: {r}");
        assert_eq!(
            (r["decodedKey"].clone(), r["decodedValue"].clone()),
            e.rendered,
            "{map}"
        );

        let found = client
            .lookup(
                &name,
                [Key::Json(proto_of(&e.numbers))],
                LookupOptions::default(),
            )
            .await
            .unwrap();
        assert!(found[0].found(), "{map}");
        assert_eq!(found[0].key(), e.key, "{map}");
        assert_eq!(
            json_of(found[0].decoded_value().unwrap()),
            e.plain.1,
            "{map}"
        );
        let options = LookupOptions::default().with_render(case.render.iter().copied());
        let found = client
            .lookup(&name, [Key::Json(proto_of(&e.rendered.0))], options)
            .await
            .unwrap();
        assert!(found[0].found(), "{map}");
        assert_eq!(found[0].key(), e.key, "{map}");
        assert_eq!(
            json_of(found[0].decoded_key().unwrap()),
            e.rendered.0,
            "{map}"
        );
        assert_eq!(
            json_of(found[0].decoded_value().unwrap()),
            e.rendered.1,
            "{map}"
        );

        let line = ctl_lookup(addr, map, &e.numbers, &[]).await;
        let mut want = json!({"target": target, "key": e.plain.0, "found": true});
        want[value_field(&e.plain.1)] = e.plain.1.clone();
        assert_eq!(line, want, "{map}");
        let render = case.render_arg();
        let line = ctl_lookup(addr, map, &e.rendered.0, &["--render", &render]).await;
        let mut want = json!({"target": target, "key": e.rendered.0, "found": true});
        want[value_field(&e.rendered.1)] = e.rendered.1.clone();
        assert_eq!(line, want, "{map}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ports_and_addresses_read_right_as_numbers_and_as_renderings_in_every_reader() {
    let fs = BpfFs::new();
    let _maps = load(fs.path());
    let state = tempfile::tempdir().unwrap();
    let daemon = Daemon::start(fs.path(), state.path()).await;
    let host = daemon.running.local_addr().to_string();
    let addr = daemon.addr();
    let client = daemon.client().await;
    for case in cases() {
        let map = case.map;
        // grpcurl: numbers in network order (443, not 47873), and the
        // renderings a request asks for.
        let plain = grpcurl_dump(&host, json!({"map": {"path": map}})).await;
        assert_eq!(plain, case.want(false), "{map}");
        let request = json!({"map": {"path": map}, "render": case.render_json()});
        assert_eq!(grpcurl_dump(&host, request).await, case.want(true), "{map}");
        // The library.
        library_reads(&addr, &client, &case).await;
        // bpfmapctl: the same, with and without --render (one flag with
        // commas, or the flag repeated).
        assert_eq!(ctl_dump(&addr, map, &[]).await, case.want(false), "{map}");
        let render = case.render_arg();
        let got = ctl_dump(&addr, map, &["--render", &render]).await;
        assert_eq!(got, case.want(true), "{map}");
        let repeated: Vec<String> = case
            .render
            .iter()
            .map(|(p, r)| format!("{p}={r}"))
            .collect();
        let mut args = Vec::new();
        for r in &repeated {
            args.extend(["--render", r.as_str()]);
        }
        assert_eq!(ctl_dump(&addr, map, &args).await, case.want(true), "{map}");
        // Lookups by JSON key, in numbers and rendered.
        lookups(&host, &addr, &client, &case).await;
    }

    // A table shows the rendered strings as cells.
    let (r, out, err) = ctl(&[
        "--addr",
        &addr,
        "--format",
        "table",
        "dump",
        CT4,
        "--render",
        "key.daddr=ipv4,key.saddr=ipv4",
    ])
    .await;
    assert!(r.is_ok(), "{err}");
    let lines: Vec<Vec<&str>> = out
        .lines()
        .map(|l| l.split_whitespace().collect())
        .collect();
    assert_eq!(lines.len(), 2, "{out}");
    assert_eq!(
        lines[0][..7],
        [
            "TARGET", "daddr", "saddr", "dport", "sport", "nexthdr", "flags"
        ],
        "{out}"
    );
    assert_eq!(
        lines[1][..9],
        [
            &host,
            "10.0.0.1",
            "192.168.0.2",
            "443",
            "51234",
            "6",
            "0",
            "0",
            "0"
        ],
        "{out}"
    );
    daemon.stop().await;
}

/// A daemon whose configuration renders every case's members
/// (`[[render]]`): grpcurl shows them rendered without asking, GetMap
/// says so, and the library and bpfmapctl, which decode packed entries
/// themselves, show them the same way; a call's own renderings override
/// the configured ones.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn renderings_configured_on_the_daemon_show_without_asking() {
    let fs = BpfFs::new();
    let _maps = load(fs.path());
    let state = tempfile::tempdir().unwrap();
    let cases = cases();
    let config = bpfmapd::Config {
        render: cases
            .iter()
            .map(|c| bpfmapd::RenderConfig {
                names: Vec::new(),
                // A glob, as a deployment writes them (cilium_ct4_global
                // and any other cilium_ct4 map).
                maps: vec![if c.map == CT4 {
                    "tc/globals/cilium_ct4*".to_owned()
                } else {
                    c.map.to_owned()
                }],
                members: c
                    .render
                    .iter()
                    .map(|(p, r)| ((*p).to_owned(), (*r).to_owned()))
                    .collect(),
            })
            .collect(),
        ..Daemon::config(fs.path(), state.path())
    };
    let daemon = Daemon::start_with(config).await;
    let host = daemon.running.local_addr().to_string();
    let addr = daemon.addr();
    let client = daemon.client().await;
    for case in &cases {
        let map = case.map;
        let (ok, out, err) = grpcurl(
            &[
                "-plaintext",
                "-d",
                &json!({"map": {"path": map}}).to_string(),
            ],
            &host,
            &["bpfmap.v1.MapService/GetMap"],
        )
        .await;
        assert!(ok, "{err}");
        assert_eq!(json_stream(&out)[0]["render"], case.render_json(), "{map}");
        let got = grpcurl_dump(&host, json!({"map": {"path": map}})).await;
        assert_eq!(got, case.want(true), "{map}");
        // The library's types apply the configured renderings.
        let name: MapName = map.parse().unwrap();
        let types = client
            .get_map(&name)
            .await
            .unwrap()
            .types()
            .unwrap()
            .expect("types");
        let entries = dump_entries(&client, map, DumpOptions::default()).await;
        let decoded: Vec<(Json, Json)> = entries
            .iter()
            .map(|e| {
                (
                    json_of(&types.decode_key(&e.key)),
                    json_of(&types.decode_value(e.value.view())),
                )
            })
            .collect();
        assert_eq!(sorted(decoded), case.want(true), "{map}");
        assert_eq!(ctl_dump(&addr, map, &[]).await, case.want(true), "{map}");
        // JSON keys in the rendered spelling, without asking.
        for e in &case.entries {
            let request = json!({"map": {"path": map}, "jsonKeys": [e.rendered.0]});
            let r = grpcurl_lookup(&host, request).await;
            assert_eq!(r["found"], json!(true), "{map}: {r}");
            assert_eq!(r["decodedValue"], e.rendered.1, "{map}");
            let line = ctl_lookup(&addr, map, &e.rendered.0, &[]).await;
            assert_eq!(line["found"], json!(true), "{map}: {line}");
            assert_eq!(line["key"], e.rendered.0, "{map}");
        }
    }
    // A call's renderings override the configuration's, member by member.
    let mut want = cases[0].want(true);
    want[0].0["dport"] = json!("0x1bb");
    let request = json!({"map": {"path": CT4}, "render": {"key.dport": "hex"}});
    assert_eq!(grpcurl_dump(&host, request).await, want);
    assert_eq!(
        ctl_dump(&addr, CT4, &["--render", "key.dport=hex"]).await,
        want
    );
    let name: MapName = CT4.parse().unwrap();
    let types = client
        .get_map(&name)
        .await
        .unwrap()
        .types_with([("key.dport", bpfmap_client::typed::Rendering::Hex)])
        .unwrap()
        .expect("types");
    assert_eq!(json_of(&types.decode_key(&ct4_key())), want[0].0);
    daemon.stop().await;
}

/// The XDP tutorial's per-CPU stats, summed over the CPUs: grpcurl's
/// PER_CPU_SUM, bpfmapctl's --per-cpu sum and the library's sum_value give
/// the same exact totals, numbers whatever the renderings.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn per_cpu_stats_sum_over_the_cpus_in_every_reader() {
    let fs = BpfFs::new();
    let _maps = load(fs.path());
    let state = tempfile::tempdir().unwrap();
    let daemon = Daemon::start(fs.path(), state.path()).await;
    let host = daemon.running.local_addr().to_string();
    let addr = daemon.addr();
    let n = cpus() as u64;
    let packets = n * (n + 1) / 2;
    let sums: Vec<(Json, Json)> = (0u32..5)
        .map(|k| {
            let (p, b) = if k == 2 {
                (packets, packets * 100)
            } else {
                (0, 0)
            };
            (
                json!(k),
                json!({"rx_packets": p.to_string(), "rx_bytes": b.to_string()}),
            )
        })
        .collect();
    for request in [
        json!({"map": {"path": XDP_STATS}, "perCpu": "PER_CPU_SUM"}),
        json!({"map": {"path": XDP_STATS}, "perCpu": "PER_CPU_SUM", "render": {"value.rx_bytes": "hex"}}),
    ] {
        assert_eq!(grpcurl_dump(&host, request).await, sums);
    }
    for extra in [&[][..], &["--render", "value.rx_bytes=hex"]] {
        let mut args = vec!["--addr", &addr, "--per-cpu", "sum", "dump", XDP_STATS];
        args.extend_from_slice(extra);
        let (r, out, err) = ctl(&args).await;
        assert!(r.is_ok(), "{err}");
        let got: Vec<(Json, Json)> = json_lines(&out)
            .iter()
            .map(|l| (l["key"].clone(), l["value"].clone()))
            .collect();
        assert_eq!(sorted(got), sums, "{extra:?}");
    }
    let r = grpcurl_lookup(
        &host,
        json!({"map": {"path": XDP_STATS}, "jsonKeys": [2], "perCpu": "PER_CPU_SUM"}),
    )
    .await;
    assert_eq!(r["decodedValue"], sums[2].1);
    let client = daemon.client().await;
    let name: MapName = XDP_STATS.parse().unwrap();
    let found = client
        .lookup(
            &name,
            [Key::Json(json_key(2))],
            LookupOptions::default().with_per_cpu(PerCpu::Sum),
        )
        .await
        .unwrap();
    assert_eq!(json_of(found[0].decoded_value().unwrap()), sums[2].1);
    let types = client
        .get_map(&name)
        .await
        .unwrap()
        .types_with([("value.rx_bytes", "hex")])
        .unwrap()
        .expect("types");
    let entries = dump_entries(&client, XDP_STATS, DumpOptions::default()).await;
    let got: Vec<(Json, Json)> = entries
        .iter()
        .map(|e| {
            (
                json_of(&types.decode_key(&e.key)),
                json_of(&types.sum_value(e.value.view()).unwrap()),
            )
        })
        .collect();
    assert_eq!(sorted(got), sums);
    // Or summed by the daemon, in the entries layout.
    let options = DumpOptions::default()
        .with_packed(false)
        .with_per_cpu(PerCpu::Sum);
    let mut dump = client.dump(&name, options);
    let mut got = Vec::new();
    while let Some(chunk) = dump.next_chunk().await.unwrap() {
        for i in 0..chunk.len() {
            got.push((
                json_of(chunk.decoded_key(i).unwrap()),
                json_of(chunk.decoded_value(i).unwrap()),
            ));
        }
    }
    assert_eq!(sorted(got), sums);
    daemon.stop().await;
}

fn json_key(n: u32) -> prost_types::Value {
    proto_of(&json!(n))
}

/// Global data. aya 0.14 makes the `.bss` and `.data` maps without BTF
/// (its data maps carry no type ids), so through aya they are served as
/// bytes; made as libbpf makes them (the section's DATASEC as the value
/// type, no key type) their variables decode by name, in network order
/// where declared so.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn global_data_sections_decode_as_objects_of_their_variables() {
    let fs = BpfFs::new();
    let _maps = load(fs.path());
    let state = tempfile::tempdir().unwrap();
    let daemon = Daemon::start(fs.path(), state.path()).await;
    let host = daemon.running.local_addr().to_string();
    let addr = daemon.addr();
    let target = host.as_str();
    let client = daemon.client().await;

    // aya's maps: no BTF, so no types; the bytes are the sections'.
    for (map, bytes) in [(BSS, vec![0u8; 12]), (DATA, vec![0x00, 0x50, 0x01])] {
        let info = client.get_map(&map.parse().unwrap()).await.unwrap();
        assert_eq!(info.btf_id(), None, "{map}: aya gives data maps no BTF");
        assert!(info.types().unwrap().is_none());
        let (r, out, err) = ctl(&["--addr", &addr, "dump", map]).await;
        assert!(r.is_ok(), "{err}");
        assert_eq!(
            json_lines(&out),
            [json!({"target": target, "key": "00000000", "value": faster_hex::hex_string(&bytes)})]
        );
    }

    // As libbpf makes them: objects of the variables, the key untyped.
    let bss = json!({"packets_seen": "1000", "drops": 3});
    let data = json!({"listen_port": 80, "enabled": 1});
    let (ok, out, err) = grpcurl(
        &[
            "-plaintext",
            "-d",
            r#"{"map":{"path":"globals/data_typed"}}"#,
        ],
        &host,
        &["bpfmap.v1.MapService/GetMap"],
    )
    .await;
    assert!(ok, "{err}");
    let info = &json_stream(&out)[0];
    assert_eq!(info["keyType"], Json::Null, "{out}");
    assert_eq!(info["valueType"]["name"], json!(".data"), "{out}");
    for (map, want) in [(BSS_TYPED, &bss), (DATA_TYPED, &data)] {
        let (ok, out, err) = grpcurl(
            &[
                "-plaintext",
                "-d",
                &json!({"map": {"path": map}}).to_string(),
            ],
            &host,
            &["bpfmap.v1.MapService/DumpMap"],
        )
        .await;
        assert!(ok, "{err}");
        let entry = &json_stream(&out)[0]["entries"][0];
        assert_eq!(entry["key"], json!("AAAAAA=="), "{out}");
        // The daemon, the library and bpfmapctl alike: the key is the
        // index, 0.
        assert_eq!(entry["decodedKey"], json!(0), "{out}");
        assert_eq!(&entry["decodedValue"], want, "{out}");
        let types = client
            .get_map(&map.parse().unwrap())
            .await
            .unwrap()
            .types()
            .unwrap()
            .expect("types");
        let entries = dump_entries(&client, map, DumpOptions::default()).await;
        assert_eq!(entries.len(), 1);
        assert_eq!(json_of(&types.decode_key(&entries[0].key)), json!(0));
        assert_eq!(&json_of(&types.decode_value(entries[0].value.view())), want);
        let (r, out, err) = ctl(&["--addr", &addr, "dump", map]).await;
        assert!(r.is_ok(), "{err}");
        assert_eq!(
            json_lines(&out),
            [json!({"target": target, "key": 0, "value": want})]
        );
        // Looked up by its index as dumps show it, and by the key's bytes.
        for key in ["0", "hex:00000000"] {
            let line = ctl_lookup_raw(&addr, map, key, &[]).await;
            assert_eq!(
                line,
                json!({"target": target, "key": 0, "found": true, "value": want}),
                "{key}"
            );
        }
    }
    // Renderings of the variables; the section's BTF has no key to render.
    let rendered = json!({"listen_port": "0x50", "enabled": 1});
    let request = json!({"map": {"path": DATA_TYPED}, "render": {"value.listen_port": "hex"}});
    assert_eq!(
        grpcurl_dump(&host, request).await,
        [(json!(0), rendered.clone())]
    );
    assert_eq!(
        ctl_dump(&addr, DATA_TYPED, &["--render", "value.listen_port=hex"]).await,
        [(json!(0), rendered.clone())]
    );
    let r = grpcurl_lookup(
        &host,
        json!({"map": {"path": DATA_TYPED}, "keys": ["AAAAAA=="], "render": {"value.listen_port": "hex"}}),
    )
    .await;
    assert_eq!(r["decodedValue"], rendered);
    let (r, _, _) = ctl(&["--addr", &addr, "dump", DATA_TYPED, "--render", "key=hex"]).await;
    let e = r.unwrap_err();
    assert!(e.is::<bpfmapctl::Usage>(), "{e:#}");
    assert_eq!(
        e.to_string(),
        "render: key: the map's keys have no type (only its value is typed)"
    );
    // A JSON key is the section's index, as dumps show it.
    let r = grpcurl_lookup(
        &host,
        json!({"map": {"path": DATA_TYPED}, "jsonKeys": [0], "render": {"value.listen_port": "hex"}}),
    )
    .await;
    assert_eq!((&r["found"], &r["decodedValue"]), (&json!(true), &rendered));
    daemon.stop().await;
}

/// `bpfmapctl --addr ADDR lookup MAP KEY EXTRA...` with KEY as given.
async fn ctl_lookup_raw(addr: &str, map: &str, key: &str, extra: &[&str]) -> Json {
    let mut args = vec!["--addr", addr, "lookup", map, key];
    args.extend_from_slice(extra);
    let (r, out, err) = ctl(&args).await;
    assert!(r.is_ok(), "{args:?}: {r:?} {err}");
    json_lines(&out)[0].clone()
}

/// Renderings that cannot be applied are refused, naming the member and
/// why: by bpfmapctl as a usage error (exit code 2), by the library as
/// [`Error::Render`], by the daemon as INVALID_ARGUMENT.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn renderings_that_do_not_fit_are_refused_naming_the_member() {
    use clap::Parser as _;
    let fs = BpfFs::new();
    let _maps = load(fs.path());
    let state = tempfile::tempdir().unwrap();
    let daemon = Daemon::start(fs.path(), state.path()).await;
    let host = daemon.running.local_addr().to_string();
    let addr = daemon.addr();
    let misfit = "render: key.dport: ipv4 needs a member of 4 bytes; this one (an integer) has 2";

    // bpfmapctl: dump and lookup, nothing on stdout, a usage error.
    let (r, out, err) = ctl(&["--addr", &addr, "dump", CT4, "--render", "key.dport=ipv4"]).await;
    let e = r.unwrap_err();
    assert!(e.is::<bpfmapctl::Usage>(), "{e:#}");
    assert_eq!(e.to_string(), misfit);
    assert_eq!(out, "");
    let summary = &json_lines(&err)[0];
    assert_eq!(summary["code"], json!("INVALID_ARGUMENT"), "{err}");
    assert_eq!(summary["error"], json!(misfit), "{err}");
    let key = format!("json:{}", cases()[0].entries[0].numbers);
    let (r, out, _) = ctl(&[
        "--addr",
        &addr,
        "lookup",
        CT4,
        &key,
        "--render",
        "key.dport=ipv4",
    ])
    .await;
    let e = r.unwrap_err();
    assert!(e.is::<bpfmapctl::Usage>(), "{e:#}");
    assert_eq!(e.to_string(), misfit);
    assert_eq!(out, "");
    let (r, _, _) = ctl(&["--addr", &addr, "dump", CT4, "--render", "key.nope=ipv4"]).await;
    let e = r.unwrap_err();
    assert!(e.is::<bpfmapctl::Usage>(), "{e:#}");
    assert_eq!(
        e.to_string(),
        "render: key.nope: no such member of struct ipv4_ct_tuple (members: daddr, saddr, dport, sport, nexthdr, flags)"
    );
    let (r, _, _) = ctl(&[
        "--addr",
        &addr,
        "--raw",
        "dump",
        CT4,
        "--render",
        "key.daddr=ipv4",
    ])
    .await;
    assert!(r.unwrap_err().is::<bpfmapctl::Usage>());
    // Renderings and paths that are not ones: refused as the command line
    // is read (exit code 2).
    for (arg, says) in [
        (
            "key.daddr=ipv9",
            "key.daddr: unknown rendering \"ipv9\"; use ipv4, ipv6, mac, hex, be16, be32 or string",
        ),
        (
            "daddr=ipv4",
            "daddr: a member path starts with \"key\" or \"value\" (\"key.daddr\")",
        ),
        ("key.daddr", "expected PATH=RENDERING, like key.daddr=ipv4"),
    ] {
        let e = bpfmapctl::Cli::try_parse_from(["bpfmapctl", "dump", CT4, "--render", arg])
            .unwrap_err();
        assert_eq!(e.exit_code(), 2);
        assert!(e.to_string().contains(says), "{arg}: {e}");
    }

    // grpcurl: INVALID_ARGUMENT, naming the member and the map.
    for (call, request) in [
        (
            "DumpMap",
            json!({"map": {"path": CT4}, "render": {"key.dport": "ipv4"}}),
        ),
        (
            "Lookup",
            json!({"map": {"path": CT4}, "jsonKeys": [cases()[0].entries[0].numbers], "render": {"key.dport": "ipv4"}}),
        ),
    ] {
        let (ok, _, err) = grpcurl(
            &["-plaintext", "-d", &request.to_string()],
            &host,
            &[&format!("bpfmap.v1.MapService/{call}")],
        )
        .await;
        assert!(!ok, "{call}");
        assert!(err.contains("Code: InvalidArgument"), "{call}: {err}");
        assert!(
            err.contains(&format!("{misfit} (map {CT4})")),
            "{call}: {err}"
        );
    }

    // The library.
    let client = daemon.client().await;
    let name: MapName = CT4.parse().unwrap();
    let info = client.get_map(&name).await.unwrap();
    let e = info.types_with([("key.dport", "ipv4")]).unwrap_err();
    assert!(
        matches!(&e, Error::Render { path, .. } if path == "key.dport"),
        "{e:?}"
    );
    assert_eq!(e.to_string(), misfit);
    assert_eq!(e.code(), tonic::Code::InvalidArgument);
    let mut dump = client.dump(
        &name,
        DumpOptions::default().with_render([("key.daddr", "ipv9")]),
    );
    let e = dump.next_chunk().await.unwrap_err();
    assert_eq!(
        e.to_string(),
        "render: key.daddr: unknown rendering \"ipv9\"; use ipv4, ipv6, mac, hex, be16, be32 or string"
    );
    assert!(dump.next_chunk().await.unwrap().is_none(), "the dump ended");
    let e = client
        .lookup(
            &name,
            [Key::Json(proto_of(&cases()[0].entries[0].numbers))],
            LookupOptions::default().with_render([("daddr", "ipv4")]),
        )
        .await
        .unwrap_err();
    assert!(
        matches!(&e, Error::Render { path, .. } if path == "daddr"),
        "{e:?}"
    );
    // In the entries layout the daemon checks them.
    let mut dump = client.dump(
        &name,
        DumpOptions::default()
            .with_packed(false)
            .with_render([("key.dport", "ipv4")]),
    );
    let e = dump.next_chunk().await.unwrap_err();
    assert_eq!(e.code(), tonic::Code::InvalidArgument);
    assert_eq!(
        e.to_string(),
        format!("INVALID_ARGUMENT: {misfit} (map {CT4})")
    );
    // A fleet dump with types: the target fails with the renderings.
    let fleet = Fleet::new([addr.parse().unwrap()], ConnectOptions::default());
    let options = FleetDumpOptions::default()
        .with_types(true)
        .with_dump(DumpOptions::default().with_render([("key.dport", "ipv4")]));
    let reports = fleet.dump(&name, options).collect().await;
    let error = reports[0].0.error.as_ref().expect("the target failed");
    assert_eq!(error.to_string(), misfit);
    daemon.stop().await;

    // A daemon configured with a rendering that does not fit the map:
    // the map's decoded dumps fail there, and bpfmapctl, which was asked
    // nothing wrong, reports the target as failed (exit code 1).
    let config = bpfmapd::Config {
        render: vec![bpfmapd::RenderConfig {
            names: Vec::new(),
            maps: vec![CT4.into()],
            members: BTreeMap::from([("key.dport".into(), "ipv4".into())]),
        }],
        ..Daemon::config(fs.path(), state.path())
    };
    let daemon = Daemon::start_with(config).await;
    let host = daemon.running.local_addr().to_string();
    let (ok, _, err) = grpcurl(
        &[
            "-plaintext",
            "-d",
            &json!({"map": {"path": CT4}}).to_string(),
        ],
        &host,
        &["bpfmap.v1.MapService/DumpMap"],
    )
    .await;
    assert!(!ok);
    assert!(err.contains(&format!("{misfit} (map {CT4})")), "{err}");
    let (r, out, _) = ctl(&["--addr", &daemon.addr(), "dump", CT4]).await;
    let e = r.unwrap_err();
    assert!(e.is::<bpfmapctl::TargetsFailed>(), "{e:#}");
    assert_eq!(e.to_string(), format!("INVALID_ARGUMENT: {misfit}"));
    assert_eq!(out, "");
    daemon.stop().await;
}

/// The export examples of deploy/exports/, as an operator would copy them,
/// over these maps: Cilium's connection tracking by destination and
/// protocol, and xdp-filter's statistics by action (its map pinned here
/// under tc/globals).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_export_examples_read_cilium_and_xdp_stats_maps() {
    let fs = BpfFs::new();
    let _maps = load(fs.path());
    let state = tempfile::tempdir().unwrap();
    let example = |file: &str| {
        let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../deploy/exports/").to_owned() + file;
        let text = std::fs::read_to_string(&path).unwrap();
        let text = text.replace("xdp-filter/xdp_stats_map", XDP_STATS);
        let toml = format!("roots = [\"/sys/fs/bpf\"]\n{text}");
        bpfmapd::Config::from_toml(&toml).unwrap().exports
    };
    let mut exports = example("cilium.toml");
    exports.extend(example("xdp-filter.toml"));
    let daemon = Daemon::start_with(bpfmapd::Config {
        metrics_listen: Some("127.0.0.1:0".parse().unwrap()),
        exports,
        ..Daemon::config(fs.path(), state.path())
    })
    .await;
    let m = metrics::scrape(daemon.running.metrics_addr().unwrap()).await;
    let lines = |family: &str| -> Vec<String> {
        m.0.lines()
            .filter(|l| l.starts_with(family))
            .map(str::to_owned)
            .collect()
    };
    assert_eq!(
        lines("cilium_ct_bytes_total{"),
        ["cilium_ct_bytes_total{daddr=\"10.0.0.1\",proto=\"tcp\"} 15000"]
    );
    assert_eq!(
        lines("cilium_ct_connections{"),
        ["cilium_ct_connections{proto=\"tcp\"} 1"]
    );
    // Packets of every CPU summed: CPU i counted i + 1.
    let n = cpus() as u64;
    let pass = n * (n + 1) / 2;
    let packets = lines("xdp_filter_packets_total{");
    assert!(
        packets.contains(&format!(
            "xdp_filter_packets_total{{action=\"pass\"}} {pass}"
        )),
        "{packets:?}"
    );
    assert!(
        packets.contains(&"xdp_filter_packets_total{action=\"drop\"} 0".to_owned()),
        "{packets:?}"
    );
    assert!(
        lines("xdp_filter_bytes_total{").contains(&format!(
            "xdp_filter_bytes_total{{action=\"pass\"}} {}",
            pass * 100
        )),
        "{}",
        m.0
    );
    daemon.stop().await;
}
