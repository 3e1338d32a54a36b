//! Typed maps: keys and values as the program declared them (BTF), read
//! through the daemon (GetMap, DumpMap's decoded entries, Lookup by JSON
//! key), the client library (packed dumps decoded locally), bpfmapctl and
//! grpcurl, from BTF built in code for every decoding rule, from the demo,
//! and from a BPF object compiled by clang.

use std::{
    collections::{BTreeMap, BTreeSet},
    time::Duration,
};

use bpfmap_client::{Client, ConnectOptions, DumpOptions, LookupOptions, MapInfo, Value, pb};
use bpfmap_kernel::{BtfBuilder, BtfMember as M, CreateMap, IntEncoding as E, OwnedBtf};
use bpfmap_tests::*;
use serde_json::{Value as Json, json};
use tonic::Code;

/// A map of `map_type` typed by the BTF `build` writes (returning the key
/// and value type ids), pinned at `rel`.
fn typed_map(
    fs: &BpfFs,
    rel: &str,
    map_type: MapType,
    key_size: u32,
    value_size: u32,
    max_entries: u32,
    build: impl FnOnce(&mut BtfBuilder) -> (u32, u32),
) -> OwnedMap {
    let mut b = BtfBuilder::new();
    let (key, value) = build(&mut b);
    let btf = OwnedBtf::load(&b.to_bytes()).unwrap_or_else(|e| panic!("BPF_BTF_LOAD: {e}"));
    let map = OwnedMap::create(&CreateMap {
        map_type: map_type.0,
        key_size,
        value_size,
        max_entries,
        name: "typed",
        btf: Some(btf.for_map(key, value)),
        ..Default::default()
    })
    .unwrap_or_else(|e| panic!("BPF_MAP_CREATE with BTF: {e}"));
    fs.pin(&map, rel);
    map
}

/// `struct everything`: one member for every decoding rule (144 bytes).
fn everything(b: &mut BtfBuilder) -> (u32, u32) {
    let u8_ = b.add_int("unsigned char", 1, E::Unsigned);
    let s8 = b.add_int("signed char", 1, E::Signed);
    let u16_ = b.add_int("unsigned short", 2, E::Unsigned);
    let s16 = b.add_int("short", 2, E::Signed);
    let u32_ = b.add_int("unsigned int", 4, E::Unsigned);
    let s32 = b.add_int("int", 4, E::Signed);
    let u64_ = b.add_int("unsigned long long", 8, E::Unsigned);
    let s64 = b.add_int("long long", 8, E::Signed);
    let u128_ = b.add_int("unsigned __int128", 16, E::Unsigned);
    let bool_ = b.add_int("_Bool", 1, E::Bool);
    let char_ = b.add_int("char", 1, E::Signed);
    let key = b.add_typedef("__u32", u32_);
    let c = b.add_const(key);
    let v = b.add_volatile(c);
    let counter = b.add_typedef("counter_t", v);
    let name = b.add_array(char_, 8);
    let raw = b.add_array(char_, 4);
    let pair = b.add_struct("pair", 4, &[M::new("a", u16_, 0), M::new("b", u16_, 16)]);
    let pairs = b.add_array(pair, 2);
    let row = b.add_array(u8_, 3);
    let grid = b.add_array(row, 2);
    let color = b.add_enum("color", 4, true, &[("RED", 0), ("NEG", -1)]);
    let big = b.add_enum64("big", 8, false, &[("HUGE", u64::MAX), ("ONE", 1)]);
    let mode = b.add_enum("mode", 4, false, &[("OFF", 0), ("ON", 1), ("AUTO", 2)]);
    let anon_s = b.add_struct("", 4, &[M::new("lo", s16, 0), M::new("hi", s16, 16)]);
    let bytes4 = b.add_array(u8_, 4);
    let anon_u = b.add_union(
        "",
        4,
        &[M::new("as_u32", u32_, 0), M::new("as_bytes", bytes4, 0)],
    );
    let node = b.add_fwd("node", false);
    let ptr = b.add_ptr(node);
    let float = b.add_float("float", 4);
    let double = b.add_float("double", 8);
    let value = b.add_struct(
        "everything",
        144,
        &[
            M::new("u8", u8_, 0),
            M::new("s8", s8, 8),
            M::new("u16", u16_, 16),
            M::new("s16", s16, 32),
            M::new("u32", u32_, 64),
            M::new("s32", s32, 96),
            M::new("u64", u64_, 128),
            M::new("s64", s64, 192),
            M::new("u128", u128_, 256),
            M::new("flag", bool_, 384),
            M::new("letter", char_, 392),
            M::new("name", name, 400),
            M::new("raw", raw, 464),
            M::new("counter", counter, 512),
            M::new("pair", pair, 544),
            M::new("pairs", pairs, 576),
            M::new("grid", grid, 640),
            M::new("color", color, 704),
            M::new("big", big, 768),
            M::new("", anon_s, 832),
            M::new("", anon_u, 864),
            M::new("ptr", ptr, 896),
            M::new("f", float, 960),
            M::new("d", double, 1024),
            M::bitfield("a", u32_, 1088, 3),
            M::bitfield("b", s32, 1091, 5),
            M::bitfield("m", mode, 1096, 2),
        ],
    );
    (key, value)
}

/// Bytes of `struct everything` with the values of [`everything_json`].
fn everything_bytes() -> Vec<u8> {
    let mut v = vec![0u8; 144];
    v[0] = 200;
    v[1] = (-3i8) as u8;
    v[2..4].copy_from_slice(&60000u16.to_le_bytes());
    v[4..6].copy_from_slice(&(-300i16).to_le_bytes());
    v[8..12].copy_from_slice(&4_000_000_000u32.to_le_bytes());
    v[12..16].copy_from_slice(&(-70000i32).to_le_bytes());
    v[16..24].copy_from_slice(&u64::MAX.to_le_bytes());
    v[24..32].copy_from_slice(&(-5i64).to_le_bytes());
    v[32..48].copy_from_slice(&(1u128 << 100).to_le_bytes());
    v[48] = 1;
    v[49] = b'A';
    v[50..58].copy_from_slice(b"bpfmapd\0");
    v[58..62].copy_from_slice(&[1, 2, 3, 4]);
    v[64..68].copy_from_slice(&42u32.to_le_bytes());
    for (i, x) in [1u16, 2, 3, 4, 5, 6].iter().enumerate() {
        v[68 + 2 * i..70 + 2 * i].copy_from_slice(&x.to_le_bytes());
    }
    v[80..86].copy_from_slice(&[1, 2, 3, 4, 5, 6]);
    v[88..92].copy_from_slice(&(-1i32).to_le_bytes());
    v[96..104].copy_from_slice(&u64::MAX.to_le_bytes());
    v[104..106].copy_from_slice(&(-1i16).to_le_bytes());
    v[106..108].copy_from_slice(&2i16.to_le_bytes());
    v[108..112].copy_from_slice(&[1, 2, 3, 4]);
    v[112..120].copy_from_slice(&0xffff_8888_1234_5678u64.to_le_bytes());
    v[120..124].copy_from_slice(&1.5f32.to_le_bytes());
    v[128..136].copy_from_slice(&(-2.25f64).to_le_bytes());
    let bits: u32 = 5 | ((-10i32 as u32 & 0x1f) << 3) | (2 << 8);
    v[136..140].copy_from_slice(&bits.to_le_bytes());
    v
}

fn everything_json() -> Json {
    json!({
        "u8": 200, "s8": -3, "u16": 60000, "s16": -300,
        "u32": 4000000000u32, "s32": -70000,
        "u64": "18446744073709551615", "s64": "-5",
        "u128": "1267650600228229401496703205376",
        "flag": true, "letter": 65, "name": "bpfmapd", "raw": [1, 2, 3, 4],
        "counter": 42,
        "pair": {"a": 1, "b": 2},
        "pairs": [{"a": 3, "b": 4}, {"a": 5, "b": 6}],
        "grid": [[1, 2, 3], [4, 5, 6]],
        "color": "NEG", "big": "HUGE",
        "lo": -1, "hi": 2,
        "as_u32": 67305985, "as_bytes": [1, 2, 3, 4],
        "ptr": "0xffff888812345678",
        "f": 1.5, "d": -2.25,
        "a": 5, "b": -10, "m": "AUTO",
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_rule_reads_the_same_through_the_daemon_the_library_the_cli_and_grpcurl() {
    let (fs, _state, daemon, client) = setup().await;
    let map = typed_map(&fs, "typed/all", MapType::HASH, 4, 144, 8, everything);
    update(&map, &7u32.to_le_bytes(), &everything_bytes());
    let want = everything_json();

    // GetMap describes both types.
    let info = client.get_map(&"typed/all".parse().unwrap()).await.unwrap();
    assert_eq!(info.types_unavailable(), None);
    let key = info.as_proto().key_type.clone().expect("a key type");
    assert_eq!(
        (key.name.as_str(), key.size),
        ("__u32", 4),
        "the typedef's name is kept"
    );
    assert!(matches!(
        key.kind,
        Some(pb::type_info::Kind::Int(pb::IntType {
            signed: false,
            big_endian: false
        }))
    ));
    let value = info.as_proto().value_type.clone().expect("a value type");
    assert_eq!((value.name.as_str(), value.size), ("everything", 144));
    let Some(pb::type_info::Kind::Struct(record)) = &value.kind else {
        panic!("{value:?}")
    };
    let member = |n: &str| record.members.iter().find(|m| m.name == n).unwrap();
    assert_eq!(
        (member("m").bit_offset, member("m").bitfield_size),
        (1096, 2)
    );
    assert_eq!(
        member("counter").r#type.as_ref().unwrap().name,
        "counter_t",
        "const volatile typedef chain: the outer name"
    );
    let ptr = member("ptr").r#type.clone().unwrap();
    assert_eq!(
        ptr.kind,
        Some(pb::type_info::Kind::Pointer(pb::PointerType {
            target: "node".into()
        }))
    );
    let Some(pb::type_info::Kind::Enum(color)) = &member("color").r#type.as_ref().unwrap().kind
    else {
        panic!()
    };
    assert_eq!(
        color.enumerators,
        [
            pb::Enumerator {
                name: "RED".into(),
                value: 0
            },
            pb::Enumerator {
                name: "NEG".into(),
                value: -1
            }
        ]
    );
    assert!(color.signed);

    // DumpMap in grpcurl's layout: decoded next to the bytes.
    let mut raw = pb::map_service_client::MapServiceClient::new(
        channel_from(&daemon.addr(), "127.0.0.1").await,
    );
    let mut stream = raw
        .dump_map(pb::DumpMapRequest {
            map: map_ref("typed/all"),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    let msg = stream.message().await.unwrap().unwrap();
    let entry = &msg.entries[0];
    assert_eq!(entry.value, everything_bytes());
    assert_eq!(json_of(entry.decoded_key.as_ref().unwrap()), json!(7));
    assert_eq!(json_of(entry.decoded_value.as_ref().unwrap()), want);
    // raw = true leaves them out.
    let mut stream = raw
        .dump_map(pb::DumpMapRequest {
            map: map_ref("typed/all"),
            raw: true,
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    let msg = stream.message().await.unwrap().unwrap();
    assert!(msg.entries[0].decoded_key.is_none() && msg.entries[0].decoded_value.is_none());

    // The library: a packed dump, decoded on the client.
    let name = "typed/all".parse().unwrap();
    let types = client
        .get_map(&name)
        .await
        .unwrap()
        .types()
        .unwrap()
        .expect("types");
    let entries = dump_all(&client, "typed/all", DumpOptions::default()).await;
    let (k, v) = entries.iter().next().unwrap();
    assert_eq!(json_of(&types.decode_key(k)), json!(7));
    assert_eq!(json_of(&types.decode_value(v.view())), want);
    let mut text = Vec::new();
    types.write_entry_json(
        bpfmap_client::EntryRef {
            key: k,
            value: v.view(),
        },
        &mut text,
    );
    assert_eq!(
        serde_json::from_slice::<Json>(&text).unwrap(),
        json!({"key": 7, "value": want})
    );

    // bpfmapctl: decoded by default, hex with --raw.
    let addr = daemon.addr();
    let (r, out, err) = ctl(&["--addr", &addr, "dump", "typed/all"]).await;
    assert!(r.is_ok(), "{err}");
    let target = addr.trim_start_matches("http://");
    assert_eq!(
        json_lines(&out),
        [json!({"target": target, "key": 7, "value": want})]
    );
    let (r, out, _) = ctl(&["--addr", &addr, "--raw", "dump", "typed/all"]).await;
    assert!(r.is_ok());
    assert_eq!(
        json_lines(&out)[0]["value"],
        json!(faster_hex::hex_string(&everything_bytes()))
    );
    // Lookup by JSON key, and a key that is absent.
    let (r, out, err) = ctl(&["--addr", &addr, "lookup", "typed/all", "json:7", "json:8"]).await;
    assert!(r.is_ok(), "{err}");
    assert_eq!(
        json_lines(&out),
        [
            json!({"target": target, "key": 7, "found": true, "value": want}),
            json!({"target": target, "key": 8, "found": false}),
        ]
    );

    // grpcurl: nested JSON, and a lookup by JSON key.
    let host = daemon.running.local_addr().to_string();
    let (ok, out, err) = grpcurl(
        &["-plaintext", "-d", r#"{"map":{"path":"typed/all"}}"#],
        &host,
        &["bpfmap.v1.MapService/DumpMap"],
    )
    .await;
    assert!(ok, "{err}");
    let docs = json_stream(&out);
    assert_eq!(docs[0]["entries"][0]["decodedKey"], json!(7));
    assert_eq!(docs[0]["entries"][0]["decodedValue"], want);
    let (ok, out, err) = grpcurl(
        &[
            "-plaintext",
            "-d",
            r#"{"map":{"path":"typed/all"},"jsonKeys":[7]}"#,
        ],
        &host,
        &["bpfmap.v1.MapService/Lookup"],
    )
    .await;
    assert!(ok, "{err}");
    let result = &json_stream(&out)[0]["results"][0];
    assert_eq!(result["found"], json!(true));
    assert_eq!(result["decodedValue"], want);
    drop(map);
    daemon.stop().await;
}

/// `struct flow_key` of the demo and the issue's example.
fn flow_types(b: &mut BtfBuilder) -> (u32, u32) {
    let u8_ = b.add_int("unsigned char", 1, E::Unsigned);
    let u16_ = b.add_int("unsigned short", 2, E::Unsigned);
    let u32_ = b.add_int("unsigned int", 4, E::Unsigned);
    let u64_ = b.add_int("unsigned long long", 8, E::Unsigned);
    let proto = b.add_enum(
        "ip_proto",
        1,
        false,
        &[("IPPROTO_ICMP", 1), ("IPPROTO_TCP", 6), ("IPPROTO_UDP", 17)],
    );
    let pad = b.add_array(u8_, 3);
    let key = b.add_struct(
        "flow_key",
        16,
        &[
            M::new("saddr", u32_, 0),
            M::new("daddr", u32_, 32),
            M::new("sport", u16_, 64),
            M::new("dport", u16_, 80),
            M::new("proto", proto, 96),
            M::new("pad", pad, 104),
        ],
    );
    let value = b.add_struct(
        "flow_stats",
        16,
        &[M::new("packets", u64_, 0), M::new("bytes", u64_, 64)],
    );
    (key, value)
}

fn flow(saddr: u32, daddr: u32, sport: u16, dport: u16, proto: u8) -> Vec<u8> {
    let mut k = Vec::new();
    k.extend_from_slice(&saddr.to_le_bytes());
    k.extend_from_slice(&daddr.to_le_bytes());
    k.extend_from_slice(&sport.to_le_bytes());
    k.extend_from_slice(&dport.to_le_bytes());
    k.extend_from_slice(&[proto, 0, 0, 0]);
    k
}

/// A fleet dump with types: each target's chunks come with that target's
/// types (a typed map on one host, the same name untyped on another), read
/// by a GetMap on the dump's own connection.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_typed_fleet_dump_gives_each_target_its_types_over_one_connection() {
    use bpfmap_client::{ConnectOptions, Fleet, FleetDumpOptions, FleetEvent};
    use futures::StreamExt as _;
    let (typed_fs, untyped_fs) = (BpfFs::new(), BpfFs::new());
    let (typed_state, untyped_state) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let start = |fs: &BpfFs, state: &tempfile::TempDir, ip: &str| {
        let config = bpfmapd::Config {
            listen: format!("{ip}:0").parse().unwrap(),
            ..Daemon::config(fs.path(), state.path())
        };
        Daemon::start_with(config)
    };
    let typed_daemon = start(&typed_fs, &typed_state, "127.0.0.41").await;
    let untyped_daemon = start(&untyped_fs, &untyped_state, "127.0.0.42").await;
    let map = typed_map(&typed_fs, "flows", MapType::HASH, 16, 16, 4096, flow_types);
    let mut want_typed = BTreeMap::new();
    for i in 0..3000u32 {
        let key = flow(0x0a00_0000 + i, 0xc0a8_0001, 1024, 443, 6);
        let mut value = u64::from(i).to_le_bytes().to_vec();
        value.extend_from_slice(&(u64::from(i) * 1500).to_le_bytes());
        update(&map, &key, &value);
        want_typed.insert(
            key,
            json!({
                "saddr": 0x0a00_0000 + i, "daddr": 0xc0a8_0001u32, "sport": 1024,
                "dport": 443, "proto": "IPPROTO_TCP", "pad": [0, 0, 0],
            }),
        );
    }
    let untyped = create_map(MapType::HASH, 16, 16, 64);
    untyped_fs.pin(&untyped, "flows");
    let mut want_untyped = BTreeSet::new();
    for i in 0..10u8 {
        update(&untyped, &[i; 16], &[i; 16]);
        want_untyped.insert(vec![i; 16]);
    }
    // The typed host behind a proxy that counts connections.
    let proxy = CutProxy::start_on(
        "127.0.0.43:0".parse().unwrap(),
        typed_daemon.running.local_addr(),
        usize::MAX,
        false,
    )
    .await;
    let (typed_target, untyped_target): (bpfmap_client::Target, bpfmap_client::Target) = (
        proxy.addr.to_string().parse().unwrap(),
        untyped_daemon
            .running
            .local_addr()
            .to_string()
            .parse()
            .unwrap(),
    );
    let fleet = Fleet::new(
        [typed_target.clone(), untyped_target.clone()],
        ConnectOptions::default(),
    );
    let options = FleetDumpOptions::default().with_types(true);
    let mut run = fleet.dump(&"flows".parse().unwrap(), options);
    let (mut got_typed, mut got_untyped, mut reports) = (BTreeMap::new(), BTreeSet::new(), vec![]);
    while let Some(event) = run.next().await {
        match event {
            FleetEvent::Answer { target, answer } if target == typed_target => {
                let types = answer
                    .types
                    .expect("the typed host's chunks carry its types");
                for e in &answer.chunk {
                    let mut text = Vec::new();
                    types.key().write_json(e.key, &mut text);
                    let decoded: Json = serde_json::from_slice(&text).unwrap();
                    assert!(got_typed.insert(e.key.to_vec(), decoded).is_none());
                }
            }
            FleetEvent::Answer { answer, .. } => {
                assert!(answer.types.is_none(), "an untyped map has no types");
                for e in &answer.chunk {
                    assert!(got_untyped.insert(e.key.to_vec()));
                }
            }
            FleetEvent::Done(r) => reports.push(r),
            other => panic!("{other:?}"),
        }
    }
    assert_eq!(reports.len(), 2);
    assert!(
        reports.iter().all(|r| r.is_ok() && r.complete),
        "{reports:?}"
    );
    assert_eq!(got_typed.len(), want_typed.len());
    for (key, want) in &want_typed {
        assert_eq!(got_typed.get(key), Some(want), "key {key:?}");
    }
    assert_eq!(got_untyped, want_untyped);
    assert_eq!(
        proxy.connections(),
        1,
        "GetMap and DumpMap share a connection"
    );
    typed_daemon.stop().await;
    untyped_daemon.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn json_keys_that_do_not_fit_are_refused_naming_the_member() {
    let (fs, _state, daemon, client) = setup().await;
    let map = typed_map(&fs, "flows", MapType::HASH, 16, 16, 64, flow_types);
    let mut value = 10u64.to_le_bytes().to_vec();
    value.extend_from_slice(&1500u64.to_le_bytes());
    update(&map, &flow(167772160, 3232235521, 1024, 443, 6), &value);
    let (_untyped, _) = u64_hash(&fs, "plain", 3, 4);
    let name = "flows".parse().unwrap();

    let key = json!({"saddr": 167772160, "daddr": 3232235521u32, "sport": 1024, "dport": 443, "proto": "IPPROTO_TCP", "pad": [0, 0, 0]});
    let found = client
        .lookup(&name, vec![proto_of(&key)], LookupOptions::default())
        .await
        .unwrap();
    assert!(found[0].found());
    assert_eq!(
        json_of(found[0].decoded_value().unwrap()),
        json!({"packets": "10", "bytes": "1500"})
    );
    assert_eq!(json_of(found[0].decoded_key().unwrap()), key);

    let refused = |key: Json| {
        let client = client.clone();
        let name = name.clone();
        async move {
            let e = client
                .lookup(&name, vec![proto_of(&key)], LookupOptions::default())
                .await
                .unwrap_err();
            (code_of(&e), e.to_string())
        }
    };
    let (code, msg) =
        refused(json!({"saddr": 1, "daddr": 2, "sport": 3, "dport": 4, "pad": [0, 0, 0]})).await;
    assert_eq!(code, Code::InvalidArgument);
    assert!(
        msg.contains("json_keys[0] does not fit map flows: key.proto: missing"),
        "{msg}"
    );
    let (code, msg) = refused(
        json!({"saddr": 1, "daddr": 2, "sport": 70000, "dport": 4, "proto": 6, "pad": [0, 0, 0]}),
    )
    .await;
    assert_eq!(code, Code::InvalidArgument);
    assert!(
        msg.contains("key.sport: 70000 is out of range for a 16-bit unsigned integer"),
        "{msg}"
    );
    let (code, msg) = refused(json!({"saddr": 1, "daddr": 2, "sport": 3, "dport": 4, "proto": "IPPROTO_SCTP", "pad": [0, 0, 0]})).await;
    assert_eq!(code, Code::InvalidArgument);
    assert!(
        msg.contains("key.proto: \"IPPROTO_SCTP\" is not an enumerator of enum ip_proto"),
        "{msg}"
    );
    // A map without BTF whose keys are 1, 2, 4 or 8 bytes takes a number
    // (an unsigned integer: xdp-filter's port index, an array's index).
    let plain: bpfmap_client::MapName = "plain".parse().unwrap();
    let found = client
        .lookup(&plain, vec![proto_of(&json!(1))], LookupOptions::default())
        .await
        .unwrap();
    assert_eq!(
        (found[0].key(), found[0].found()),
        (&1u64.to_le_bytes()[..], true)
    );
    assert!(
        matches!(found[0].value(), Some(bpfmap_client::ValueRef::Single(v)) if v == 3u64.to_le_bytes())
    );
    let e = client
        .lookup(
            &plain,
            vec![proto_of(&json!({"a": 1}))],
            LookupOptions::default(),
        )
        .await
        .unwrap_err();
    assert_eq!(code_of(&e), Code::InvalidArgument, "{e}");
    // Other keys without a type are bytes only.
    let wide = create_map(MapType::HASH, 16, 8, 4);
    fs.pin(&wide, "wide");
    let e = client
        .lookup(
            &"wide".parse().unwrap(),
            vec![proto_of(&json!(1))],
            LookupOptions::default(),
        )
        .await
        .unwrap_err();
    assert_eq!(code_of(&e), Code::FailedPrecondition);
    assert!(
        e.to_string().contains("carries no BTF; give keys as bytes"),
        "{e}"
    );

    // The same through bpfmapctl.
    let addr = daemon.addr();
    let (r, out, err) = ctl(&[
        "--addr",
        &addr,
        "lookup",
        "flows",
        r#"{"saddr":167772160,"daddr":3232235521,"sport":1024,"dport":443,"proto":"IPPROTO_TCP","pad":[0,0,0]}"#,
    ])
    .await;
    assert!(r.is_ok(), "{err}");
    assert_eq!(
        json_lines(&out)[0]["value"],
        json!({"packets": "10", "bytes": "1500"})
    );
    let (r, _, err) = ctl(&["--addr", &addr, "lookup", "flows", r#"{"saddr":1}"#]).await;
    assert!(r.is_err());
    assert!(err.contains("key.daddr: missing"), "{err}");
    // The table shows members as columns.
    let (r, out, err) = ctl(&["--addr", &addr, "--format", "table", "dump", "flows"]).await;
    assert!(r.is_ok(), "{err}");
    let mut rows = out.lines();
    let header: Vec<&str> = rows.next().unwrap().split_whitespace().collect();
    assert_eq!(
        header,
        [
            "TARGET", "saddr", "daddr", "sport", "dport", "proto", "pad", "packets", "bytes"
        ]
    );
    let row: Vec<&str> = rows.next().unwrap().split_whitespace().collect();
    assert_eq!(
        row[1..],
        [
            "167772160",
            "3232235521",
            "1024",
            "443",
            "IPPROTO_TCP",
            "[0,0,0]",
            "10",
            "1500"
        ]
    );
    drop(map);
    daemon.stop().await;
}

/// `struct counters { __u64 rx; __u64 tx; __u32 drops; __u32 errors:31; __u32 flag:1; }`
fn counter_types(b: &mut BtfBuilder) -> (u32, u32) {
    let u32_ = b.add_int("unsigned int", 4, E::Unsigned);
    let u64_ = b.add_int("unsigned long long", 8, E::Unsigned);
    let key = b.add_typedef("__u32", u32_);
    let value = b.add_struct(
        "counters",
        24,
        &[
            M::new("rx", u64_, 0),
            M::new("tx", u64_, 64),
            M::new("drops", u32_, 128),
            M::bitfield("errors", u32_, 160, 31),
            M::bitfield("flag", u32_, 191, 1),
        ],
    );
    (key, value)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn per_cpu_values_decode_one_per_cpu_or_summed_exactly() {
    let (fs, _state, daemon, client) = setup().await;
    let map = typed_map(&fs, "pcpu", MapType::PERCPU_ARRAY, 4, 24, 2, counter_types);
    let cpus = bpfmap_kernel::possible_cpus() as usize;
    let mut values = Vec::new();
    for cpu in 0..cpus {
        let mut v = vec![0u8; 24];
        v[0..8].copy_from_slice(&u64::MAX.to_le_bytes());
        v[8..16].copy_from_slice(&(cpu as u64).to_le_bytes());
        v[16..20].copy_from_slice(&1u32.to_le_bytes());
        v[20..24].copy_from_slice(&(3u32 | 1 << 31).to_le_bytes());
        values.extend_from_slice(&v);
    }
    update(&map, &1u32.to_le_bytes(), &values);
    let (_plain, _) = u64_hash(&fs, "hash", 1, 2);
    let untyped = create_map(MapType::PERCPU_ARRAY, 4, 8, 1);
    fs.pin(&untyped, "untyped_pcpu");
    update(
        &untyped,
        &0u32.to_le_bytes(),
        &(0..cpus)
            .flat_map(|_| u64::MAX.to_le_bytes())
            .collect::<Vec<_>>(),
    );

    let raw = pb::map_service_client::MapServiceClient::new(
        channel_from(&daemon.addr(), "127.0.0.1").await,
    );
    let dump = |path: &'static str, per_cpu: pb::PerCpu, layout: pb::Layout| {
        let mut raw = raw.clone();
        async move {
            let mut s = raw
                .dump_map(pb::DumpMapRequest {
                    map: map_ref(path),
                    per_cpu: per_cpu as i32,
                    layout: layout as i32,
                    ..Default::default()
                })
                .await?
                .into_inner();
            let mut out = Vec::new();
            while let Some(m) = s.message().await? {
                out.extend(m.entries);
            }
            Ok::<_, tonic::Status>(out)
        }
    };
    let each = dump("pcpu", pb::PerCpu::Each, pb::Layout::Entries)
        .await
        .unwrap();
    let listed = json_of(each[1].decoded_value.as_ref().unwrap());
    assert_eq!(listed.as_array().unwrap().len(), cpus);
    assert_eq!(
        listed[0],
        json!({"rx": "18446744073709551615", "tx": "0", "drops": 1, "errors": 3, "flag": 1})
    );
    let summed = dump("pcpu", pb::PerCpu::Sum, pb::Layout::Entries)
        .await
        .unwrap();
    let total_tx: u64 = (0..cpus as u64).sum();
    let want = json!({
        "rx": (u128::from(u64::MAX) * cpus as u128).to_string(),
        "tx": total_tx.to_string(),
        "drops": cpus, "errors": 3 * cpus, "flag": cpus,
    });
    assert_eq!(json_of(summed[1].decoded_value.as_ref().unwrap()), want);
    // Index 0 was never written: zeros.
    assert_eq!(
        json_of(summed[0].decoded_value.as_ref().unwrap())["rx"],
        json!("0")
    );
    // Untyped values of 8 bytes sum as unsigned integers.
    let summed = dump("untyped_pcpu", pb::PerCpu::Sum, pb::Layout::Entries)
        .await
        .unwrap();
    assert_eq!(
        json_of(summed[0].decoded_value.as_ref().unwrap()),
        json!((u128::from(u64::MAX) * cpus as u128).to_string())
    );
    assert!(summed[0].decoded_key.is_none());
    // What cannot be summed.
    let e = dump("hash", pb::PerCpu::Sum, pb::Layout::Entries)
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument);
    assert!(e.message().contains("is not per-CPU"), "{}", e.message());
    let e = dump("pcpu", pb::PerCpu::Sum, pb::Layout::Packed)
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument);
    assert!(
        e.message().contains("needs LAYOUT_ENTRIES"),
        "{}",
        e.message()
    );

    // The library and bpfmapctl sum the same.
    let types = client
        .get_map(&"pcpu".parse().unwrap())
        .await
        .unwrap()
        .types()
        .unwrap()
        .expect("types");
    let entries = dump_all(&client, "pcpu", DumpOptions::default()).await;
    let v = &entries[&1u32.to_le_bytes().to_vec()];
    assert!(matches!(v, Value::PerCpu(_)));
    assert_eq!(json_of(&types.sum_value(v.view()).unwrap()), want);
    let (r, out, err) = ctl(&["--addr", &daemon.addr(), "--per-cpu", "sum", "dump", "pcpu"]).await;
    assert!(r.is_ok(), "{err}");
    assert_eq!(json_lines(&out)[1]["value"], want);
    drop((map, untyped));
    daemon.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_demo_flows_read_as_typed_json_in_grpcurl_and_bpfmapctl() {
    let fs = BpfFs::new();
    let state = tempfile::tempdir().unwrap();
    let demo = bpfmapd::Demo::start(fs.path()).expect("the demo starts");
    let daemon = Daemon::start(fs.path(), state.path()).await;
    let host = daemon.running.local_addr().to_string();
    let (ok, out, err) = grpcurl(
        &[
            "-plaintext",
            "-d",
            r#"{"map":{"path":"demo/flows"},"limit":2,"render":{"key.saddr":"ipv4","key.daddr":"ipv4"}}"#,
        ],
        &host,
        &["bpfmap.v1.MapService/DumpMap"],
    )
    .await;
    assert!(ok, "{err}");
    let docs = json_stream(&out);
    let entries: Vec<&Json> = docs
        .iter()
        .filter_map(|d| d["entries"].as_array())
        .flatten()
        .collect();
    // A dump stops before a hash bucket that would overshoot its limit, and
    // exceeds it only when its first bucket holds more: the demo's flows
    // collide, so a limit of 2 may give 1, or the whole first bucket.
    assert!(!entries.is_empty(), "{out}");
    let summary = docs.iter().find_map(|d| d.get("summary")).unwrap();
    assert_eq!(
        summary["entries"],
        json!(entries.len().to_string()),
        "{out}"
    );
    for e in entries {
        let key = &e["decodedKey"];
        let saddr: std::net::Ipv4Addr = key["saddr"].as_str().unwrap().parse().unwrap();
        let i = u64::from(u32::from(saddr) - 0x0a00_0000);
        assert_eq!(
            key,
            &json!({
                "saddr": saddr.to_string(),
                "daddr": format!("192.168.0.{}", i % 250 + 1),
                "sport": 1024 + i % 60000,
                "dport": 443,
                "proto": if i % 4 == 3 { "IPPROTO_UDP" } else { "IPPROTO_TCP" },
            }),
            "{out}"
        );
        assert_eq!(
            e["decodedValue"],
            json!({"packets": (i + 1).to_string(), "bytes": ((i + 1) * 1500).to_string()})
        );
    }
    // The issue's lookup, from grpcurl and bpfmapctl, the addresses in
    // their rendered spelling.
    let key = r#"{"saddr":"10.0.0.0","daddr":"192.168.0.1","sport":1024,"dport":443,"proto":"IPPROTO_TCP"}"#;
    let render = r#"{"key.saddr":"ipv4","key.daddr":"ipv4"}"#;
    let (ok, out, err) = grpcurl(
        &[
            "-plaintext",
            "-d",
            &format!(r#"{{"map":{{"path":"demo/flows"}},"jsonKeys":[{key}],"render":{render}}}"#),
        ],
        &host,
        &["bpfmap.v1.MapService/Lookup"],
    )
    .await;
    assert!(ok, "{err}");
    let result = &json_stream(&out)[0]["results"][0];
    assert_eq!(result["found"], json!(true), "{out}");
    assert_eq!(
        result["decodedValue"],
        json!({"packets": "1", "bytes": "1500"})
    );
    let (r, out, err) = ctl(&[
        "--addr",
        &daemon.addr(),
        "lookup",
        "demo/flows",
        key,
        "--render",
        "key.saddr=ipv4",
        "--render",
        "key.daddr=ipv4",
    ])
    .await;
    assert!(r.is_ok(), "{err}");
    assert_eq!(
        json_lines(&out)[0]["value"],
        json!({"packets": "1", "bytes": "1500"})
    );
    daemon.stop().await;
    drop(demo);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_cap_sys_admin_typed_maps_are_served_untyped_and_the_log_says_why() {
    use bpfmap_tests::process::{DaemonProcess, Launch, free_addr};
    let fs = BpfFs::new();
    let state = tempfile::tempdir().unwrap();
    let map = typed_map(&fs, "flows", MapType::HASH, 16, 16, 64, flow_types);
    let caps = "-all,+bpf,+dac_read_search";
    let daemon = DaemonProcess::launch(
        daemon_bin!(),
        fs.path(),
        state.path(),
        free_addr("127.0.0.1"),
        "",
        Launch {
            wrapper: vec![
                "setpriv".into(),
                format!("--inh-caps={caps}"),
                format!("--ambient-caps={caps}"),
                format!("--bounding-set={caps}"),
            ],
            ..Launch::default()
        },
    );
    let client = Client::connect(&daemon.url(), ConnectOptions::default())
        .await
        .unwrap();
    let info = client.get_map(&"flows".parse().unwrap()).await.unwrap();
    assert!(info.types().unwrap().is_none());
    assert!(info.btf_id().is_some());
    let why = info.types_unavailable().unwrap_or_default();
    assert!(why.contains("CAP_SYS_ADMIN"), "{why}");
    // Entries still come, as bytes.
    let entries = dump_all(&client, "flows", DumpOptions::default()).await;
    assert!(entries.is_empty());
    tokio::time::sleep(Duration::from_millis(100)).await;
    let warnings: Vec<String> = daemon
        .log()
        .into_iter()
        .filter(|l| l.contains("CAP_SYS_ADMIN") && l.contains("WARN"))
        .collect();
    assert_eq!(warnings.len(), 1, "{:?}", daemon.log());
    drop(map);
}

#[test]
fn map_types_from_an_info_without_types_are_none() {
    let info = MapInfo::from(pb::MapInfo::default());
    assert!(info.types().unwrap().is_none());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn maps_of_a_clang_compiled_object_dump_decoded() {
    let fs = BpfFs::new();
    let state = tempfile::tempdir().unwrap();
    let build = tempfile::tempdir().unwrap();
    let object = compile_bpf_object("typed.bpf.c", build.path());
    // Loaded as libbpf loaders do: the object's BTF goes to the kernel with
    // the maps, pinned by name.
    let mut ebpf = aya::EbpfLoader::new()
        .default_map_pin_directory(fs.path())
        .load(&object)
        .unwrap_or_else(|e| panic!("loading the object: {e}"));
    let mut key = [0u8; 16];
    key[0..4].copy_from_slice(&167772161u32.to_le_bytes());
    key[4..8].copy_from_slice(&3232235522u32.to_le_bytes());
    key[8..10].copy_from_slice(&40000u16.to_le_bytes());
    key[10..12].copy_from_slice(&53u16.to_le_bytes());
    key[12] = 17;
    let mut value = [0u8; 48];
    value[0..8].copy_from_slice(&3u64.to_le_bytes());
    value[8..16].copy_from_slice(&180u64.to_le_bytes());
    value[16..24].copy_from_slice(b"resolvd\0");
    value[24..32].copy_from_slice(&[0xff, 1, 2, 3, 4, 5, 6, 7]);
    value[32..36].copy_from_slice(&10u32.to_le_bytes());
    value[36..40].copy_from_slice(&20u32.to_le_bytes());
    value[40..44].copy_from_slice(&0x0403_0201u32.to_le_bytes());
    value[44] = 1;
    value[45] = (-2i8) as u8;
    let mut flows: aya::maps::HashMap<_, [u8; 16], [u8; 48]> =
        aya::maps::HashMap::try_from(ebpf.map_mut("flows").expect("map flows")).unwrap();
    flows.insert(key, value, 0).unwrap();
    let mut counter = [0u8; 24];
    counter[0..8].copy_from_slice(&100u64.to_le_bytes());
    counter[8..16].copy_from_slice(&200u64.to_le_bytes());
    counter[16..20].copy_from_slice(&7u32.to_le_bytes());
    counter[20..24].copy_from_slice(&(5u32 | 1 << 31).to_le_bytes());
    let cpus = bpfmap_kernel::possible_cpus() as usize;
    let mut counters: aya::maps::PerCpuArray<_, [u8; 24]> =
        aya::maps::PerCpuArray::try_from(ebpf.map_mut("counters").expect("map counters")).unwrap();
    counters
        .set(
            2,
            aya::maps::PerCpuValues::try_from(vec![counter; cpus]).unwrap(),
            0,
        )
        .unwrap();

    let daemon = Daemon::start(fs.path(), state.path()).await;
    let addr = daemon.addr();
    let target = addr.trim_start_matches("http://").to_owned();
    let (r, out, err) = ctl(&["--addr", &addr, "dump", "flows"]).await;
    assert!(r.is_ok(), "{err}");
    assert_eq!(
        json_lines(&out),
        [json!({
            "target": target,
            "key": {"saddr": 167772161, "daddr": 3232235522u32, "sport": 40000, "dport": 53, "proto": "L4_UDP", "pad": [0, 0, 0]},
            "value": {
                "packets": "3", "bytes": "180", "comm": "resolvd",
                "range": {"lo": 10, "hi": 20},
                "as_u32": 67305985, "as_bytes": [1, 2, 3, 4],
                "active": true, "delta": -2,
            },
        })]
    );
    let (r, out, err) = ctl(&["--addr", &addr, "--per-cpu", "sum", "dump", "counters"]).await;
    assert!(r.is_ok(), "{err}");
    let sums = json_lines(&out);
    assert_eq!(sums.len(), 4, "{out}");
    assert_eq!(
        sums[2],
        json!({
            "target": target, "key": 2,
            "value": {"rx": (100 * cpus).to_string(), "tx": (200 * cpus).to_string(), "drops": 7 * cpus, "errors": 5 * cpus, "flag": cpus},
        })
    );
    // GetMap names the compiler's types.
    let info = Client::connect(&addr, ConnectOptions::default())
        .await
        .unwrap()
        .get_map(&"flows".parse().unwrap())
        .await
        .unwrap();
    let types = info.into_proto();
    assert_eq!(types.key_type.unwrap().name, "flow_key");
    assert_eq!(types.value_type.unwrap().name, "flow_stats");
    daemon.stop().await;
    drop(ebpf);
}
