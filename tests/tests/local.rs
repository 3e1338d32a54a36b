//! The Unix socket listener: the local transport of a per-host daemon.
//! Local callers are `uid:N` (from `SO_PEERCRED`), matched by the policy as
//! such, and each process is one caller for the dump slots; bpfmapctl, the
//! library and grpcurl reach the daemon at `unix:///PATH`.

use std::{collections::BTreeSet, os::unix::fs::PermissionsExt as _, time::Duration};

use bpfmap_client::{Client, ConnectOptions, DumpOptions, RetryPolicy};
use bpfmap_tests::*;
use bpfmapd::{Config, Limits, Operation, RuleConfig};
use tonic::Code;

fn unix_config(fs: &BpfFs, state: &std::path::Path, sock: &std::path::Path) -> Config {
    Config {
        listen_unix: Some(sock.to_owned()),
        ..Daemon::config(fs.path(), state)
    }
}

fn hex_keys(out: &str) -> BTreeSet<Vec<u8>> {
    json_lines(out)
        .iter()
        .map(|l| {
            let hex = l["key"]
                .as_str()
                .unwrap_or_else(|| panic!("a hex key: {l}"));
            faster_hex::hex_decode_vec(hex.as_bytes()).unwrap()
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bpfmapctl_the_library_and_grpcurl_work_over_the_unix_socket() {
    let fs = BpfFs::new();
    let state = tempfile::tempdir().unwrap();
    let (_m, expected) = u64_hash(&fs, "small", 100, 128);
    let sock = state.path().join("run/bpfmapd.sock");
    let daemon = Daemon::start_with(unix_config(&fs, state.path(), &sock)).await;
    let mode = std::fs::metadata(&sock).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode, 0o660, "who may connect is the socket's permissions");
    let url = format!("unix://{}", sock.display());

    // bpfmapctl, as a process of its own.
    let out = std::process::Command::new(ctl_bin!())
        .args(["--addr", &url, "dump", "small"])
        .output()
        .unwrap();
    process::assert_success(&out);
    let got = hex_keys(&String::from_utf8(out.stdout).unwrap());
    assert_eq!(got, expected.keys().cloned().collect::<BTreeSet<_>>());

    // The library.
    let client = Client::connect(&url, ConnectOptions::default())
        .await
        .expect("the library connects to unix://");
    assert_eq!(
        dump_all(&client, "small", DumpOptions::default()).await,
        expected
    );

    // grpcurl, with no proto file (reflection over the socket). Its
    // default :authority is the socket's path, which HTTP/2 refuses (a path
    // is no authority): -authority names one.
    let flags = ["-plaintext", "-unix", "-authority", "localhost"];
    let (ok, out, err) = grpcurl(&flags, &sock.display().to_string(), &["list"]).await;
    assert!(ok, "grpcurl list over the socket: {err}");
    assert!(out.contains("bpfmap.v1.MapService"), "{out}");
    let (ok, out, err) = grpcurl(
        &[
            "-plaintext",
            "-unix",
            "-authority",
            "localhost",
            "-d",
            r#"{"map":{"path":"small"}}"#,
        ],
        &sock.display().to_string(),
        &["bpfmap.v1.MapService/GetMap"],
    )
    .await;
    assert!(ok, "grpcurl GetMap over the socket: {err}");
    let info: serde_json::Value = serde_json::from_str(&out).expect("GetMap prints JSON");
    assert_eq!(info["maxEntries"], 128, "{out}");
    daemon.stop().await;
    assert!(
        !sock.exists(),
        "the socket file is removed when the daemon stops"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn local_callers_are_their_user_for_the_policy_and_their_process_for_the_slots() {
    let fs = BpfFs::new();
    let state = tempfile::tempdir().unwrap();
    let (_big, _) = u64_hash(&fs, "big", 300_000, 524_288);
    let (_small, expected) = u64_hash(&fs, "small", 100, 128);
    let (_secret, _) = u64_hash(&fs, "secret", 10, 16);
    let sock = state.path().join("bpfmapd.sock");
    let uid = std::fs::metadata("/proc/self").map(|m| {
        use std::os::unix::fs::MetadataExt as _;
        m.uid()
    });
    let me = format!("uid:{}", uid.unwrap());
    let daemon = Daemon::start_with(Config {
        rules: vec![RuleConfig {
            identities: vec![me.clone()],
            maps: vec!["big".into(), "small".into()],
            operations: vec![Operation::List, Operation::Dump],
        }],
        limits: Limits {
            max_dumps_per_identity: 2,
            ..Limits::default()
        },
        ..unix_config(&fs, state.path(), &sock)
    })
    .await;
    let url = format!("unix://{}", sock.display());
    let never = ConnectOptions::default().with_retry(RetryPolicy::never());
    let client = Client::connect(&url, never.clone()).await.unwrap();

    // The policy sees uid:N.
    let e = client
        .dump(&"secret".parse().unwrap(), DumpOptions::default())
        .next_chunk()
        .await
        .unwrap_err();
    assert_eq!(code_of(&e), Code::PermissionDenied);
    assert!(
        reason_of(&e).contains(&me) || e.to_string().contains(&me),
        "the denial names the local identity {me}: {e}"
    );

    // This process holds its two slots with dumps it stops reading...
    let mut held = Vec::new();
    for _ in 0..2 {
        let c = Client::connect(&url, never.clone()).await.unwrap();
        let mut d = c.dump(&"big".parse().unwrap(), DumpOptions::default());
        d.next_chunk().await.unwrap().expect("a first chunk");
        held.push((c, d));
    }
    // ... so its third is refused, naming the process...
    let e = client
        .dump(&"small".parse().unwrap(), DumpOptions::default())
        .next_chunk()
        .await
        .unwrap_err();
    assert_eq!(code_of(&e), Code::ResourceExhausted, "{e}");
    let text = format!("{e} {}", reason_of(&e));
    assert!(
        text.contains(&format!("local process {}", std::process::id())),
        "the refusal names the process: {text}"
    );
    // ... while another process of the same user has slots of its own.
    let out = tokio::task::spawn_blocking({
        let url = url.clone();
        move || {
            std::process::Command::new(ctl_bin!())
                .args(["--addr", &url, "--busy-wait", "0", "dump", "small"])
                .output()
                .unwrap()
        }
    })
    .await
    .unwrap();
    process::assert_success(&out);
    let got = hex_keys(&String::from_utf8(out.stdout).unwrap());
    assert_eq!(got, expected.keys().cloned().collect::<BTreeSet<_>>());
    drop(held);
    tokio::time::sleep(Duration::from_millis(100)).await;
    daemon.stop().await;
}
