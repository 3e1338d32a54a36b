//! How maps are found and described: inner maps through their outer map,
//! names under the policy, every pin of a map reached by id or name, the
//! files bpffs makes itself, the types that cannot be walked.

use std::os::fd::AsFd as _;

use bpfmap_client::{DumpMethod, DumpOptions, MapName};
use bpfmap_kernel::{CreateMap, MapType, OwnedMap};
use bpfmap_tests::{daemon_bin, process::DaemonProcess, *};
use bpfmapd::{Operation, RuleConfig};
use futures::TryStreamExt as _;
use serde_json::json;
use tonic::Code;

/// An array_of_maps pinned at `rel` whose slot 1 holds an unpinned hash of
/// `n` u64 keys (key * 3); slot 0 is empty.
fn outer_with_inner(fs: &BpfFs, rel: &str, n: u64) -> (OwnedMap, OwnedMap, Entries) {
    let inner = create_map(MapType::HASH, 8, 8, 64);
    let mut expected = Entries::new();
    for k in 0..n {
        update(&inner, &k.to_le_bytes(), &(k * 3).to_le_bytes());
        expected.insert(
            k.to_le_bytes().to_vec(),
            bpfmap_client::Value::Single((k * 3).to_le_bytes().to_vec()),
        );
    }
    let outer = create_map_with(&CreateMap {
        map_type: MapType::ARRAY_OF_MAPS.0,
        key_size: 4,
        value_size: 4,
        max_entries: 4,
        name: "outer",
        inner_map: Some(inner.as_fd()),
        ..Default::default()
    });
    // A map of maps takes the inner map's descriptor as its value.
    let fd = std::os::fd::AsRawFd::as_raw_fd(&inner.as_fd()) as u32;
    update(&outer, &1u32.to_le_bytes(), &fd.to_le_bytes());
    fs.pin(&outer, rel);
    (outer, inner, expected)
}

/// A daemon whose policy lets the anonymous caller read `outer` only.
async fn daemon_allowing_outer(fs: &BpfFs, state: &std::path::Path) -> Daemon {
    Daemon::start_with(bpfmapd::Config {
        rules: vec![RuleConfig {
            identities: vec!["anonymous".into()],
            maps: vec!["outer".into(), "pub/*".into()],
            operations: vec![Operation::List, Operation::Dump, Operation::Lookup],
        }],
        ..Daemon::config(fs.path(), state)
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_inner_map_reads_through_its_outer_map_with_its_access() {
    let (fs, state) = (BpfFs::new(), tempfile::tempdir().unwrap());
    let (outer, inner, expected) = outer_with_inner(&fs, "outer", 20);
    let (other, _inner2, _) = outer_with_inner(&fs, "other", 1);
    // "pub/o" leads to "other", which the policy denies; "outer" is also
    // pinned where the policy denies.
    std::fs::create_dir(fs.path().join("pub")).unwrap();
    std::os::unix::fs::symlink("../other", fs.path().join("pub/o")).unwrap();
    fs.pin(&other, "secret/other");
    fs.pin(&outer, "secret/outer");
    let daemon = daemon_allowing_outer(&fs, state.path()).await;
    let client = daemon.client().await;
    // The outer map's values are inner map ids, as numbers.
    let (r, out, err) = ctl(&["--addr", &daemon.addr(), "lookup", "outer", "1"]).await;
    assert!(r.is_ok(), "{err}");
    assert_eq!(json_lines(&out)[0]["value"], json!(inner.id()), "{out}");
    // Its inner map, by the outer map's key: every entry, without access
    // by id (which this daemon does not allow).
    let map: MapName = "outer".parse::<MapName>().unwrap().inner(1);
    let got = collect_unique(
        client
            .dump(&map, DumpOptions::default())
            .into_entries()
            .try_collect::<Vec<_>>()
            .await
            .unwrap(),
    );
    assert_eq!(got, expected);
    // By its id, the inner map is neither allowed nor reachable here.
    let e = client.get_map(&MapName::Id(inner.id())).await.unwrap_err();
    assert_eq!(code_of(&e), Code::PermissionDenied, "{e}");
    let info = client.get_map(&map).await.unwrap();
    assert_eq!((info.id(), info.path()), (inner.id(), None));
    // Pins where the policy denies are not revealed.
    let info = client.get_map(&"outer".parse().unwrap()).await.unwrap();
    assert_eq!(info.pins(), ["outer"]);
    let listed = client.list_maps().await.unwrap();
    let outer_pins: Vec<&[String]> = listed
        .iter()
        .filter(|m| m.name() == "outer")
        .map(|m| m.pins())
        .collect();
    assert_eq!(
        outer_pins,
        [["outer".to_owned()]],
        "only the allowed pin, listed once"
    );
    // Through a symlink, the inner map is allowed what the target is,
    // whatever form its key takes.
    for key in [
        bpfmap_client::InnerKey::Bytes(1u32.to_le_bytes().to_vec()),
        1u32.into(),
    ] {
        let via = "pub/o".parse::<MapName>().unwrap().inner(key);
        let e = client.get_map(&via).await.unwrap_err();
        assert_eq!(code_of(&e), Code::PermissionDenied, "{via}: {e}");
    }
    inner_map_through_grpcurl_and_bpfmapctl(&daemon).await;
    inner_maps_refused(&daemon).await;
    daemon.stop().await;
}

async fn inner_map_through_grpcurl_and_bpfmapctl(daemon: &Daemon) {
    let host = daemon.running.local_addr().to_string();
    let body =
        r#"{"map":{"inner":{"outer":{"path":"outer"},"jsonKey":1}},"keys":["BQAAAAAAAAA="]}"#;
    let (ok, out, err) = grpcurl(
        &["-plaintext", "-d", body],
        &host,
        &["bpfmap.v1.MapService/Lookup"],
    )
    .await;
    assert!(ok, "{err}");
    let result = &json_stream(&out)[0]["results"][0];
    assert_eq!(
        (&result["found"], &result["value"]),
        (&json!(true), &json!("DwAAAAAAAAA=")),
        "{out}"
    );
    let (r, out, err) = ctl(&["--addr", &daemon.addr(), "dump", "outer", "--inner", "1"]).await;
    assert!(r.is_ok(), "{err}");
    assert_eq!(json_lines(&out).len(), 20, "{out}");
    let (r, out, err) = ctl(&[
        "--addr",
        &daemon.addr(),
        "lookup",
        "outer",
        "--inner",
        "1",
        "hex:0500000000000000",
    ])
    .await;
    assert!(r.is_ok(), "{err}");
    assert_eq!(
        json_lines(&out)[0]["value"],
        json!("0f00000000000000"),
        "{out}"
    );
}

/// An empty slot, a map that holds no maps, an outer map the policy does
/// not allow.
async fn inner_maps_refused(daemon: &Daemon) {
    let client = daemon.client().await;
    let empty = "outer".parse::<MapName>().unwrap().inner(0);
    let e = client.get_map(&empty).await.unwrap_err();
    assert_eq!(code_of(&e), Code::NotFound);
    assert!(
        e.to_string()
            .contains("map outer holds no inner map at key 00000000"),
        "{e}"
    );
    let denied = "other".parse::<MapName>().unwrap().inner(1);
    let e = client.get_map(&denied).await.unwrap_err();
    assert_eq!(code_of(&e), Code::PermissionDenied, "{e}");
    assert!(
        e.to_string().contains("anonymous may not list other"),
        "{e}"
    );
    // Both maps are named "outer"; a name finds only the maps the policy
    // allows, so it names one.
    let info = client
        .get_map(&"name:outer".parse().unwrap())
        .await
        .unwrap();
    assert_eq!(info.path(), Some("outer"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_map_reached_by_id_or_name_shows_its_pins_and_holders() {
    let (fs, state) = (BpfFs::new(), tempfile::tempdir().unwrap());
    // Names two edits from "count", older than "counts" (lower ids): more
    // of them than a message lists.
    let _farther: Vec<_> = (0..6)
        .map(|_| {
            create_map_with(&CreateMap {
                map_type: MapType::HASH.0,
                key_size: 8,
                value_size: 8,
                max_entries: 4,
                name: "coxyt",
                ..Default::default()
            })
        })
        .collect();
    let map = create_map_with(&CreateMap {
        map_type: MapType::HASH.0,
        key_size: 8,
        value_size: 8,
        max_entries: 16,
        name: "counts",
        ..Default::default()
    });
    fs.pin(&map, "b/counts");
    fs.pin(&map, "a/counts");
    let plain = create_map(MapType::PERCPU_HASH, 4, 8, 16);
    fs.pin(&plain, "plain");
    let daemon = Daemon::start_with(bpfmapd::Config {
        allow_by_id: true,
        ..Daemon::config(fs.path(), state.path())
    })
    .await;
    let client = daemon.client().await;
    for name in [format!("id:{}", map.id()), "name:counts".to_owned()] {
        let info = client.get_map(&name.parse().unwrap()).await.unwrap();
        assert_eq!(info.path(), Some("a/counts"), "{name}");
        assert_eq!(info.pins(), ["a/counts", "b/counts"], "{name}");
        assert!(info.memlock().is_some_and(|m| m > 0), "{name}");
        assert_eq!(
            info.owners(),
            [],
            "the daemon's own descriptors are not an owner's"
        );
    }
    let e = client
        .get_map(&"name:count".parse().unwrap())
        .await
        .unwrap_err();
    assert_eq!(code_of(&e), Code::NotFound);
    assert!(
        e.to_string().contains(r#"close: "counts" (a/counts)"#),
        "the closest name first: {e}"
    );
    daemon.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bpffs_own_files_are_not_maps_and_unwalkable_types_say_so() {
    let (fs, state) = (BpfFs::new(), tempfile::tempdir().unwrap());
    assert!(
        fs.path().join("maps.debug").exists(),
        "this kernel preloads bpffs's iterators (maps.debug)"
    );
    let perf = create_map(MapType::PERF_EVENT_ARRAY, 4, 4, 2);
    fs.pin(&perf, "perf");
    let cgroups = create_map(MapType::CGROUP_ARRAY, 4, 4, 2);
    fs.pin(&cgroups, "cgroups");
    let daemon = DaemonProcess::local(daemon_bin!(), fs.path(), state.path());
    let client = bpfmap_client::Client::connect(&daemon.url(), Default::default())
        .await
        .unwrap();
    let maps = client.list_maps().await.unwrap();
    let listed: Vec<(&str, DumpMethod)> = maps
        .iter()
        .map(|m| (m.path().unwrap(), m.dump_method()))
        .collect();
    assert_eq!(
        listed,
        [
            ("cgroups", DumpMethod::Unsupported),
            ("perf", DumpMethod::Unsupported)
        ]
    );
    for path in ["maps.debug", "progs.debug"] {
        let e = client.get_map(&path.parse().unwrap()).await.unwrap_err();
        assert_eq!(
            (code_of(&e), reason_of(&e).as_str()),
            (Code::FailedPrecondition, "NOT_A_MAP"),
            "{e}"
        );
    }
    let e = client
        .dump(&"perf".parse().unwrap(), DumpOptions::default())
        .into_entries()
        .try_collect::<Vec<_>>()
        .await
        .unwrap_err();
    assert_eq!(reason_of(&e), "MAP_NOT_ITERABLE", "{e}");
    // No warning about bpffs's own files, which are not pins of maps.
    let warnings: Vec<String> = daemon
        .log()
        .into_iter()
        .filter(|l| l.contains(r#""level":"WARN""#) && !l.contains("plaintext on loopback"))
        .collect();
    assert!(warnings.is_empty(), "{warnings:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn configured_and_requested_declarations_type_maps_without_btf() {
    let (fs, state) = (BpfFs::new(), tempfile::tempdir().unwrap());
    let _demo = bpfmapd::Demo::start(fs.path()).expect("the demo starts");
    let (_plain, _) = u64_hash(&fs, "plain", 5, 8);
    let daemon = Daemon::start_with(bpfmapd::Config {
        types: vec![bpfmapd::TypesConfig {
            maps: vec!["pla*".into()],
            names: Vec::new(),
            key: "__u64".into(),
            value: "struct { __u32 lo; __u32 hi; }".into(),
        }],
        ..Daemon::config(fs.path(), state.path())
    })
    .await;
    let client = daemon.client().await;
    let plain: MapName = "plain".parse().unwrap();
    let info = client.get_map(&plain).await.unwrap();
    assert!(info.as_proto().types_declared);
    // Typed for every call: a filter on a declared member.
    let (r, out, err) = ctl(&[
        "--addr",
        &daemon.addr(),
        "dump",
        "plain",
        "--filter",
        "value.lo == 6",
    ])
    .await;
    assert!(r.is_ok(), "{err}");
    assert_eq!(json_lines(&out)[0]["key"], json!("2"), "{out}");
    assert_eq!(
        json_lines(&out)[0]["value"],
        json!({"lo": 6, "hi": 0}),
        "{out}"
    );
    // A request's declaration overrides the configuration's, side by side.
    let info = client
        .get_map(&plain.clone().with_types("", "__s64"))
        .await
        .unwrap();
    assert_eq!(info.as_proto().value_type.as_ref().unwrap().name, "__s64");
    assert_eq!(info.as_proto().key_type.as_ref().unwrap().name, "__u64");
    // The size must be the map's; the BTF's types are not redeclared.
    let e = client
        .get_map(&plain.with_types("__u32", ""))
        .await
        .unwrap_err();
    assert_eq!(code_of(&e), Code::InvalidArgument);
    assert!(
        e.to_string()
            .contains(r#"the declared key type "__u32" is 4 bytes; the map's keys are 8 bytes"#),
        "{e}"
    );
    let flows: MapName = "demo/flows"
        .parse::<MapName>()
        .unwrap()
        .with_types("", "__u64[2]");
    let typed = "FAILED_PRECONDITION: map demo/flows has types: its BTF gives its value type (flow_stats), which a declaration cannot replace; leave the value type undeclared";
    let e = client.get_map(&flows).await.unwrap_err();
    assert_eq!(
        (code_of(&e), reason_of(&e).as_str()),
        (Code::FailedPrecondition, "MAP_TYPED"),
        "{e}"
    );
    assert_eq!(e.to_string(), typed);
    // A raw dump reads no types, and is refused all the same: a
    // declaration is never ignored.
    let mut dump = std::pin::pin!(client.dump(&flows, Default::default()).into_entries());
    let e = dump.try_next().await.unwrap_err();
    assert_eq!(e.to_string(), typed);
    // bpfmapctl says so too, on every command, and prints nothing.
    let addr = daemon.addr();
    for command in [&["dump", "demo/flows"][..], &["lookup", "demo/flows", "0"]] {
        let mut args = vec!["--addr", &addr];
        args.extend_from_slice(command);
        args.extend_from_slice(&["--value-type", "__u64[2]"]);
        let (r, out, err) = ctl(&args).await;
        assert!(r.is_err(), "{args:?}: {out}");
        assert!(out.is_empty(), "{args:?}: {out}");
        let message = typed.strip_prefix("FAILED_PRECONDITION: ").unwrap();
        assert!(err.contains(message), "{args:?}: {err}");
    }
    let e = client
        .get_map(&"plain".parse::<MapName>().unwrap().with_types("char[", ""))
        .await
        .unwrap_err();
    assert_eq!(code_of(&e), Code::InvalidArgument);
    assert!(
        e.to_string()
            .contains("map.declare: key: an array needs a length"),
        "{e}"
    );
    daemon.stop().await;
}
