//! Bad requests and changed maps get the status code a client can act on.

use base64::Engine as _;
use bpfmap_client::{
    Client, ConnectOptions, DumpMethod, DumpOptions, Key, LookupOptions, MapName, RetryPolicy,
    Value, pb,
};
use bpfmap_tests::*;
use std::time::{Duration, Instant};

use tonic::Code;

/// A daemon on a private bpffs, and a client that does not resume (errors
/// surface at once).
async fn setup() -> (BpfFs, tempfile::TempDir, Daemon, Client) {
    let (fs, state, daemon, _) = bpfmap_tests::setup().await;
    let options = ConnectOptions::default().with_retry(RetryPolicy::never());
    let client = daemon.client_with(options).await;
    (fs, state, daemon, client)
}

/// Dumps `map` from `cursor`; the error of the first chunk, if any.
async fn dump_from(client: &Client, map: &str, cursor: &str) -> Result<(), bpfmap_client::Error> {
    let options = DumpOptions::default().with_cursor(cursor.to_owned());
    let mut dump = client.dump(&map.parse().unwrap(), options);
    while dump.next_chunk().await?.is_some() {}
    Ok(())
}

/// A cursor from the middle of a dump of `map`.
async fn mid_cursor(client: &Client, map: &str) -> String {
    let options = DumpOptions::default().with_chunk_size(10);
    let mut dump = client.dump(&map.parse().unwrap(), options);
    dump.next_chunk().await.unwrap().expect("a first chunk");
    dump.cursor().to_owned()
}

#[tokio::test]
async fn tampered_and_garbage_cursors_are_invalid_argument() {
    let (fs, _state, daemon, client) = setup().await;
    let _m = u64_hash(&fs, "m", 100, 128);
    let cursor = mid_cursor(&client, "m").await;
    let engine = base64::engine::general_purpose::URL_SAFE_NO_PAD;
    let mut raw = engine.decode(&cursor).unwrap();
    let last = raw.len() - 1;
    raw[last] ^= 1;
    let tampered = engine.encode(&raw);
    for bad in [
        tampered.as_str(),
        "garbage!",
        "AAAA",
        &cursor[..cursor.len() - 3],
    ] {
        let e = dump_from(&client, "m", bad).await.unwrap_err();
        assert_eq!(code_of(&e), Code::InvalidArgument, "{bad}: {e}");
        assert_eq!(reason_of(&e), "CURSOR_INVALID");
    }
    // A cursor from a server with another key.
    let other_state = tempfile::tempdir().unwrap();
    let other = Daemon::start(fs.path(), other_state.path()).await;
    let foreign = mid_cursor(&other.client().await, "m").await;
    let e = dump_from(&client, "m", &foreign).await.unwrap_err();
    assert_eq!(code_of(&e), Code::InvalidArgument, "{e}");
    other.stop().await;
    daemon.stop().await;
}

#[tokio::test]
async fn a_cursor_for_another_map_is_invalid_argument() {
    let (fs, _state, daemon, client) = setup().await;
    let _a = u64_hash(&fs, "a", 100, 128);
    let _b = u64_hash(&fs, "b", 100, 128);
    let cursor = mid_cursor(&client, "a").await;
    let e = dump_from(&client, "b", &cursor).await.unwrap_err();
    assert_eq!(code_of(&e), Code::InvalidArgument, "{e}");
    assert_eq!(reason_of(&e), "CURSOR_OTHER_MAP");
    assert!(e.to_string().contains("issued for map a, not for b"), "{e}");
    daemon.stop().await;
}

#[tokio::test]
async fn a_replaced_map_is_aborted_and_a_removed_map_not_found() {
    let (fs, _state, daemon, client) = setup().await;
    let (fd, _) = u64_hash(&fs, "m", 100, 128);
    let cursor = mid_cursor(&client, "m").await;
    // Same path, same shape, new map.
    std::fs::remove_file(fs.path().join("m")).unwrap();
    drop(fd);
    let _new = u64_hash(&fs, "m", 100, 128);
    let e = dump_from(&client, "m", &cursor).await.unwrap_err();
    assert_eq!(code_of(&e), Code::Aborted, "{e}");
    assert_eq!(reason_of(&e), "MAP_REPLACED");
    assert!(e.to_string().contains("restart the dump"), "{e}");

    std::fs::remove_file(fs.path().join("m")).unwrap();
    let e = dump_from(&client, "m", &cursor).await.unwrap_err();
    assert_eq!(code_of(&e), Code::NotFound, "{e}");
    assert!(e.to_string().contains("map m not found"), "{e}");
    daemon.stop().await;
}

#[tokio::test]
async fn a_trie_resumed_after_its_last_key_was_deleted_gives_exactly_the_rest() {
    let (fs, _state, daemon, client) = setup().await;
    let fd = create_map_with(&bpfmap_kernel::CreateMap {
        map_type: MapType::LPM_TRIE.0,
        key_size: 8,
        value_size: 8,
        max_entries: 64,
        flags: 1,
        name: "trie",
        ..Default::default()
    });
    let mut all = Entries::new();
    for i in 0u8..30 {
        let mut k = 32u32.to_ne_bytes().to_vec();
        k.extend_from_slice(&[10, 0, 0, i]);
        update(&fd, &k, &[i; 8]);
        all.insert(k, Value::Single(vec![i; 8]));
    }
    fs.pin(&fd, "trie");
    let mut dump = client.dump(
        &"trie".parse().unwrap(),
        DumpOptions::default()
            .with_chunk_size(10)
            .with_packed(false),
    );
    let first = collect_unique(dump.next_chunk().await.unwrap().unwrap());
    assert_eq!(first.len(), 10);
    let cursor = dump.cursor().to_owned();
    drop(dump);
    // Delete the last key delivered: the kernel restarts the walk from the
    // first key, and the daemon skips what the cursor already covered.
    let last = first
        .keys()
        .max_by(|a, b| bpfmap_kernel::walk::trie_order(a, b))
        .unwrap()
        .clone();
    delete(&fd, &last);
    let rest = dump_all(
        &client,
        "trie",
        DumpOptions::default()
            .with_cursor(cursor)
            .with_chunk_size(4),
    )
    .await;
    let mut expected = all.clone();
    expected.retain(|k, _| !first.contains_key(k));
    assert_eq!(rest, expected, "exactly the entries after the cursor");
    daemon.stop().await;
}

#[tokio::test]
async fn a_devmap_hash_resumed_after_its_last_key_was_deleted_is_aborted() {
    let (fs, _state, daemon, client) = setup().await;
    let map = create_map(MapType::DEVMAP_HASH, 4, 4, 64);
    for k in 0u32..20 {
        // Every entry redirects to the loopback device (ifindex 1).
        update(&map, &k.to_le_bytes(), &1u32.to_le_bytes());
    }
    fs.pin(&map, "devs");
    let mut dump = client.dump(
        &"devs".parse().unwrap(),
        DumpOptions::default().with_chunk_size(5),
    );
    let first = dump.next_chunk().await.unwrap().unwrap();
    assert_eq!(first.len(), 5);
    let cursor = dump.cursor().to_owned();
    drop(dump);
    // The walk continues after the last key it delivered; that key is gone,
    // and devmap_hash would silently start again from its first key.
    delete(&map, first.last().unwrap().key);
    let e = dump_from(&client, "devs", &cursor).await.unwrap_err();
    assert_eq!(code_of(&e), Code::Aborted, "{e}");
    assert_eq!(reason_of(&e), "RESUME_KEY_DELETED");
    daemon.stop().await;
}

#[tokio::test]
async fn paths_that_escape_the_root_are_invalid_argument() {
    let (fs, _state, daemon, client) = setup().await;
    // A map outside the root, reachable through a symlink inside it.
    let outside = BpfFs::new();
    let _o = u64_hash(&outside, "secret", 10, 16);
    std::os::unix::fs::symlink(outside.path(), fs.path().join("link")).unwrap();
    let abs = outside.path().join("secret");
    for bad in [
        "../etc/passwd",
        abs.to_str().unwrap(),
        "a/../../x",
        "link/secret",
        "",
    ] {
        let e = client
            .get_map(&MapName::Path(bad.into()))
            .await
            .unwrap_err();
        assert_eq!(code_of(&e), Code::InvalidArgument, "{bad:?}: {e}");
        if !bad.is_empty() {
            // (The client refuses an empty name before sending it.)
            let e = dump_from(&client, bad, "").await.unwrap_err();
            assert_eq!(code_of(&e), Code::InvalidArgument, "{bad:?}: {e}");
        }
    }
    daemon.stop().await;
}

#[tokio::test]
async fn hostile_paths_and_bodies_are_invalid_argument_with_a_bounded_message() {
    let (fs, _state, daemon, client) = setup().await;
    std::os::unix::fs::symlink("loop", fs.path().join("loop")).unwrap();
    let root = fs.path().to_str().unwrap().to_owned();
    let long_component = "a".repeat(300);
    let huge = "x/".repeat(5000);
    for (what, path) in [
        ("a 300-character component", long_component.as_str()),
        ("a symlink loop", "loop/m"),
        ("a 10 KB path", huge.as_str()),
    ] {
        let t = Instant::now();
        let e = client
            .get_map(&MapName::Path(path.into()))
            .await
            .unwrap_err();
        assert_eq!(code_of(&e), Code::InvalidArgument, "{what}: {e}");
        let message = e.status().unwrap().message().to_owned();
        assert!(
            message.len() < 250,
            "{what}: a {}-byte message",
            message.len()
        );
        assert!(
            !message.contains(&root),
            "{what}: the message shows the host path: {message}"
        );
        assert!(
            t.elapsed() < Duration::from_secs(2),
            "{what}: answered at once"
        );
        let e = dump_from(&client, path, "").await.unwrap_err();
        assert_eq!(code_of(&e), Code::InvalidArgument, "{what}: {e}");
    }
    // Not-found and permission messages name the map, not the host path.
    let e = client
        .get_map(&"no/such".parse().unwrap())
        .await
        .unwrap_err();
    assert!(!e.to_string().contains(&root), "{e}");

    // Bodies no well-behaved client sends: a map path that is not UTF-8,
    // and bytes that are not a protobuf message at all.
    let not_utf8 = vec![0x0a, 0x04, 0x0a, 0x02, 0xff, 0xfe];
    let garbage = vec![0xff; 16];
    for (what, body) in [("a non-UTF-8 path", not_utf8), ("garbage", garbage)] {
        for method in ["GetMap", "DumpMap", "Lookup"] {
            let path = format!("/bpfmap.v1.MapService/{method}");
            let e = raw_call(&daemon.addr(), &path, body.clone())
                .await
                .unwrap_err();
            assert_eq!(e.code(), Code::InvalidArgument, "{what} to {method}: {e:?}");
        }
    }
    daemon.stop().await;
}

#[tokio::test]
async fn missing_maps_and_disabled_ids_and_non_maps() {
    let (fs, _state, daemon, client) = setup().await;
    let (fd, _) = u64_hash(&fs, "m", 10, 16);
    let e = client
        .get_map(&"no/such/map".parse().unwrap())
        .await
        .unwrap_err();
    assert_eq!(code_of(&e), Code::NotFound);
    assert!(e.to_string().contains("no/such/map"), "{e}");
    let e = dump_from(&client, "nope", "").await.unwrap_err();
    assert_eq!(code_of(&e), Code::NotFound);
    // A directory is not a map.
    std::fs::create_dir(fs.path().join("dir")).unwrap();
    let e = client.get_map(&"dir".parse().unwrap()).await.unwrap_err();
    assert_eq!(code_of(&e), Code::FailedPrecondition, "{e}");
    assert_eq!(reason_of(&e), "NOT_A_MAP");
    assert!(e.to_string().contains("directory"), "{e}");
    // By id: disabled by default.
    let id = fd.id();
    let e = client.get_map(&MapName::Id(id)).await.unwrap_err();
    assert_eq!(code_of(&e), Code::FailedPrecondition, "{e}");
    assert_eq!(reason_of(&e), "BY_ID_DISABLED");
    daemon.stop().await;
}

#[tokio::test]
async fn by_id_access_when_enabled() {
    let fs = BpfFs::new();
    let state = tempfile::tempdir().unwrap();
    let daemon = Daemon::start_with(bpfmapd::Config {
        allow_by_id: true,
        ..Daemon::config(fs.path(), state.path())
    })
    .await;
    let client = daemon.client().await;
    let (fd, expected) = u64_hash(&fs, "m", 50, 64);
    let unpinned = create_map(MapType::HASH, 8, 8, 4);
    let id = fd.id();
    let unpinned_id = unpinned.id();
    let info = client.get_map(&MapName::Id(id)).await.unwrap();
    assert_eq!((info.id(), info.key_size()), (id, 8));
    assert_eq!(
        dump_all(&client, &format!("id:{id}"), DumpOptions::default()).await,
        expected
    );
    let listed = client.list_maps().await.unwrap();
    assert!(listed.iter().any(|m| m.id() == id && m.path() == Some("m")));
    assert!(
        listed
            .iter()
            .any(|m| m.id() == unpinned_id && m.path().is_none())
    );
    // A cursor issued for the path is not valid for the id.
    let cursor = mid_cursor(&client, "m").await;
    let e = dump_from(&client, &format!("id:{id}"), &cursor)
        .await
        .unwrap_err();
    assert_eq!(code_of(&e), Code::InvalidArgument);
    let e = client.get_map(&MapName::Id(u32::MAX)).await.unwrap_err();
    assert_eq!(code_of(&e), Code::NotFound);
    daemon.stop().await;
}

#[tokio::test]
async fn non_iterable_types_are_failed_precondition_naming_the_type() {
    let (fs, _state, daemon, client) = setup().await;
    let maps = [
        ("queue", create_map(MapType::QUEUE, 0, 8, 8)),
        ("stack", create_map(MapType::STACK, 0, 8, 8)),
        ("bloom_filter", create_map(MapType::BLOOM_FILTER, 0, 8, 8)),
        ("ringbuf", create_map(MapType::RINGBUF, 0, 0, 4096)),
    ];
    for (name, fd) in &maps {
        fs.pin(fd, name);
    }
    for (name, _) in &maps {
        let info = client.get_map(&name.parse().unwrap()).await.unwrap();
        assert_eq!(info.dump_method(), DumpMethod::Unsupported, "{name}");
        let e = dump_from(&client, name, "").await.unwrap_err();
        assert_eq!(code_of(&e), Code::FailedPrecondition, "{name}: {e}");
        assert_eq!(reason_of(&e), "MAP_NOT_ITERABLE");
        assert!(e.to_string().contains(&format!("type {name}")), "{e}");
        let e = client
            .lookup(
                &name.parse().unwrap(),
                vec![vec![]],
                LookupOptions::default(),
            )
            .await
            .unwrap_err();
        assert_eq!(code_of(&e), Code::FailedPrecondition, "{name}: {e}");
    }
    daemon.stop().await;
}

#[tokio::test]
async fn bad_lookup_and_dump_requests_are_invalid_argument() {
    let (fs, _state, daemon, client) = setup().await;
    let _m = u64_hash(&fs, "m", 10, 16);
    let map: MapName = "m".parse().unwrap();
    let e = client
        .lookup(&map, vec![vec![1, 2, 3]], LookupOptions::default())
        .await
        .unwrap_err();
    assert_eq!(code_of(&e), Code::InvalidArgument);
    assert!(
        e.to_string().contains("3 bytes") && e.to_string().contains("8-byte"),
        "{e}"
    );
    let e = client
        .lookup(&map, Vec::<Key>::new(), LookupOptions::default())
        .await
        .unwrap_err();
    assert_eq!(code_of(&e), Code::InvalidArgument);
    let e = client
        .lookup(&map, vec![vec![0; 8]; 4097], LookupOptions::default())
        .await
        .unwrap_err();
    assert_eq!(code_of(&e), Code::InvalidArgument);
    assert!(e.to_string().contains("4096"), "{e}");

    // No map reference, unknown layout: through the raw API.
    let channel = tonic::transport::Channel::from_shared(daemon.addr())
        .unwrap()
        .connect()
        .await
        .unwrap();
    let mut raw = pb::map_service_client::MapServiceClient::new(channel);
    let e = raw
        .dump_map(pb::DumpMapRequest::default())
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument);
    assert!(e.message().contains("map.path"), "{}", e.message());
    let e = raw
        .dump_map(pb::DumpMapRequest {
            map: Some(pb::MapRef {
                r#ref: Some(pb::map_ref::Ref::Path("m".into())),
                declare: None,
            }),
            layout: 7,
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument);
    daemon.stop().await;
}
