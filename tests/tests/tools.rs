//! What a person at a terminal sees: grpcurl through server reflection, and
//! bpfmapctl's JSON Lines.

use std::{
    collections::BTreeSet,
    net::SocketAddr,
    path::Path,
    time::{Duration, Instant},
};

use base64::Engine as _;
use bpfmap_client::Value;
use bpfmap_tests::{
    process::{DaemonProcess, assert_success, free_addr},
    *,
};
use serde_json::{Value as Json, json};

fn b64(s: &Json) -> Vec<u8> {
    base64::engine::general_purpose::STANDARD
        .decode(s.as_str().unwrap_or_default())
        .unwrap()
}

#[tokio::test(flavor = "multi_thread")]
async fn grpcurl_lists_describes_and_dumps_through_reflection() {
    let fs = BpfFs::new();
    let state = tempfile::tempdir().unwrap();
    let (_fd, expected) = u64_hash(&fs, "demo/flows", 300, 512);
    let pc = create_map(MapType::PERCPU_ARRAY, 4, 8, 2);
    fs.pin(&pc, "demo/counters");
    let daemon = Daemon::start(fs.path(), state.path()).await;
    let addr = daemon.running.local_addr().to_string();

    let (ok, out, err) = grpcurl_plain(&addr, &[], &["list"]).await;
    assert!(ok, "{err}");
    for svc in ["bpfmap.v1.MapService", "grpc.health.v1.Health"] {
        assert!(out.lines().any(|l| l == svc), "{svc} missing from:\n{out}");
    }

    let (ok, out, err) = grpcurl_plain(&addr, &[], &["describe", "bpfmap.v1.MapService"]).await;
    assert!(ok, "{err}");
    assert!(out.contains("rpc DumpMap ( .bpfmap.v1.DumpMapRequest ) returns ( stream .bpfmap.v1.DumpMapResponse )"), "{out}");

    let (ok, out, err) = grpcurl_plain(&addr, &[], &["bpfmap.v1.MapService/ListMaps"]).await;
    assert!(ok, "{err}");
    let list = &json_stream(&out)[0]["maps"];
    let paths: Vec<&str> = list
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["path"].as_str().unwrap())
        .collect();
    assert_eq!(paths, ["demo/counters", "demo/flows"]);
    assert_eq!(list[1]["typeName"], "hash");
    assert_eq!(list[1]["dumpMethod"], "DUMP_METHOD_BATCH");

    let (ok, out, err) = grpcurl_plain(
        &addr,
        &["-d", r#"{"map":{"path":"demo/flows"},"chunk_size":100}"#],
        &["bpfmap.v1.MapService/DumpMap"],
    )
    .await;
    assert!(ok, "{err}");
    let msgs = json_stream(&out);
    let mut got = Entries::new();
    for m in &msgs[..msgs.len() - 1] {
        assert!(!m["cursor"].as_str().unwrap().is_empty());
        for e in m["entries"].as_array().unwrap() {
            let prev = got.insert(b64(&e["key"]), Value::Single(b64(&e["value"])));
            assert!(prev.is_none());
        }
    }
    assert_eq!(got, expected);
    let last = msgs.last().unwrap();
    assert_eq!(last["done"], true);
    assert_eq!(
        last["summary"]["entries"], "300",
        "uint64 prints as a string"
    );
    assert_eq!(last["summary"]["complete"], true);

    // Per-CPU values and errors as grpcurl shows them.
    let (ok, out, err) = grpcurl_plain(
        &addr,
        &["-d", r#"{"map":{"path":"demo/counters"}}"#],
        &["bpfmap.v1.MapService/DumpMap"],
    )
    .await;
    assert!(ok, "{err}");
    let first = &json_stream(&out)[0]["entries"][0];
    assert_eq!(
        first["perCpuValues"].as_array().unwrap().len(),
        bpfmap_kernel::possible_cpus() as usize
    );
    let (ok, _, err) = grpcurl_plain(
        &addr,
        &["-d", r#"{"map":{"path":"demo/nope"}}"#],
        &["bpfmap.v1.MapService/DumpMap"],
    )
    .await;
    assert!(!ok);
    assert!(
        err.contains("NotFound") && err.contains("demo/nope"),
        "{err}"
    );

    let (ok, out, err) = grpcurl_plain(&addr, &[], &["grpc.health.v1.Health/Check"]).await;
    assert!(ok, "{err}");
    assert_eq!(json_stream(&out)[0]["status"], "SERVING");
    daemon.stop().await;
}

/// Runs bpfmapctl against `addr`: (its result, stdout as JSON lines,
/// stderr).
async fn ctl_at(addr: &str, args: &[&str]) -> (anyhow::Result<()>, Vec<Json>, String) {
    let mut argv = vec!["--addr", addr];
    argv.extend_from_slice(args);
    let (result, out, err) = ctl(&argv).await;
    (result, json_lines(&out), err)
}

/// `grpcurl -plaintext FLAGS ADDR ARGS`.
async fn grpcurl_plain(addr: &str, flags: &[&str], args: &[&str]) -> (bool, String, String) {
    let mut all = vec!["-plaintext"];
    all.extend_from_slice(flags);
    grpcurl(&all, addr, args).await
}

#[tokio::test]
async fn bpfmapctl_prints_json_lines() {
    let fs = BpfFs::new();
    let state = tempfile::tempdir().unwrap();
    let (_fd, expected) = u64_hash(&fs, "m", 50, 64);
    let daemon = Daemon::start(fs.path(), state.path()).await;
    let addr = daemon.addr();

    let (r, lines, _) = ctl_at(&addr, &["list"]).await;
    r.unwrap();
    assert_eq!(lines.len(), 1);
    assert_eq!(lines[0]["path"], "m");
    assert_eq!(lines[0]["type"], "hash");
    assert_eq!(lines[0]["dump_method"], "batch");

    let (r, lines, summary) = ctl_at(&addr, &["dump", "m", "--chunk-size", "7"]).await;
    r.unwrap();
    let got: Entries = lines
        .iter()
        .map(|l| {
            let k = faster_hex::hex_decode_vec(l["key"].as_str().unwrap().as_bytes()).unwrap();
            let v = faster_hex::hex_decode_vec(l["value"].as_str().unwrap().as_bytes()).unwrap();
            (k, Value::Single(v))
        })
        .collect();
    assert_eq!(got, expected);
    let summary: Json = serde_json::from_str(summary.trim()).unwrap();
    assert_eq!(summary["entries"], 50);
    assert_eq!(summary["complete"], true);

    // --limit, then --cursor resumes after it.
    let (r, first, summary) = ctl_at(&addr, &["dump", "m", "--limit", "20"]).await;
    r.unwrap();
    assert!(first.len() <= 20 && !first.is_empty());
    let summary: Json = serde_json::from_str(summary.trim()).unwrap();
    assert_eq!(summary["complete"], false);
    let cursor = summary["cursor"].as_str().unwrap();
    let (r, rest, _) = ctl_at(&addr, &["dump", "m", "--cursor", cursor]).await;
    r.unwrap();
    assert_eq!(first.len() + rest.len(), 50);

    let (r, lines, _) = ctl_at(
        &addr,
        &[
            "lookup",
            "m",
            "hex:0500000000000000",
            "hex:ff00000000000000",
        ],
    )
    .await;
    r.unwrap();
    assert_eq!(lines[0]["found"], true);
    assert_eq!(lines[0]["value"], "0f00000000000000");
    assert_eq!(lines[1]["found"], false);
    // One grammar: digits are a number whatever their length (16 digits on
    // an 8-byte key too), 0x a number in hex, hex: the bytes.
    let (r, lines, err) = ctl_at(&addr, &["lookup", "m", "5", "0x5", "1000000000000005"]).await;
    r.unwrap_or_else(|e| panic!("{e}: {err}"));
    let found: Vec<&Json> = lines.iter().map(|l| &l["found"]).collect();
    assert_eq!(
        found,
        [&json!(true), &json!(true), &json!(false)],
        "{lines:?}"
    );
    assert_eq!(lines[0]["key"], "0500000000000000");
    let (r, _, _) = ctl_at(&addr, &["lookup", "m", "0102"]).await;
    assert_eq!(
        r.unwrap_err().to_string(),
        "key \"0102\" could be the number 102 or the bytes 0102: write 102 for the number, or hex:0102 for the bytes"
    );

    let (r, _, _) = ctl_at(&addr, &["show", "missing"]).await;
    let e = r.unwrap_err().to_string();
    assert_eq!(
        e,
        "NOT_FOUND: map missing not found (no map is pinned at missing; a map by its kernel name is name:missing)"
    );
    // A cursor that starts with "-" is a value, not an option: the server
    // judges it (this one is not a cursor it issued).
    let (r, _, _) = ctl_at(&addr, &["dump", "m", "--cursor", "-AAAA"]).await;
    let e = r.unwrap_err().to_string();
    assert!(e.starts_with("INVALID_ARGUMENT: cursor"), "{e}");
    let (r, _, _) = ctl_at(&addr, &["lookup", "m", "zz"]).await;
    assert!(r.unwrap_err().to_string().contains("is not a key"));
    daemon.stop().await;
}

/// Runs the bpfmapctl binary against `addr` with `args`. A command that
/// runs until stopped (a watch, a live top) is stopped once it printed a
/// line of each of `wanted`'s shapes, or after 20 s: the lines it printed.
fn ctl_process(addr: SocketAddr, args: &[String], wanted: Option<&[Json]>) -> Vec<Json> {
    use std::io::BufRead as _;
    let mut child = std::process::Command::new(ctl_bin!())
        .arg("--addr")
        .arg(addr.to_string())
        .args(args)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("run bpfmapctl");
    let Some(wanted) = wanted else {
        let out = child.wait_with_output().expect("bpfmapctl's output");
        assert_success(&out);
        return json_lines(&String::from_utf8(out.stdout).unwrap());
    };
    let (lines, got) = (
        std::io::BufReader::new(child.stdout.take().unwrap()).lines(),
        std::sync::mpsc::channel(),
    );
    std::thread::spawn(move || lines.map_while(Result::ok).try_for_each(|l| got.0.send(l)));
    let deadline = Instant::now() + Duration::from_secs(20);
    let mut printed = Vec::new();
    while wanted
        .iter()
        .any(|w| !printed.iter().any(|p| shape(p) == shape(w)))
    {
        let Some(left) = deadline.checked_duration_since(Instant::now()) else {
            break;
        };
        match got.1.recv_timeout(left) {
            Ok(line) => printed.push(serde_json::from_str(&line).expect("a JSON line")),
            Err(_) => break,
        }
    }
    let _ = child.kill();
    let _ = child.wait();
    printed
}

/// Every example of bpfmapctl's README ("The output"), run on the demo as a
/// person would (the binary, a daemon with `demo = true`), prints lines of
/// the shape shown: the same fields in the same order, each value of the
/// same kind (a 64-bit counter a string, a rate a number), nested members
/// included.
#[test]
fn bpfmapctl_prints_what_its_readme_shows() {
    let fs = BpfFs::new();
    let state = tempfile::tempdir().unwrap();
    let addr = free_addr("127.0.0.1");
    let _daemon = DaemonProcess::start(daemon_bin!(), fs.path(), state.path(), addr, "demo = true");
    // The demo's writer has inserted demo/recent's key 1 by then.
    std::thread::sleep(Duration::from_millis(500));
    let readme = Path::new(env!("CARGO_MANIFEST_DIR")).join("../client/bpfmapctl/README.md");
    let examples = readme_examples(&readme, "## The output");
    let commands: BTreeSet<&str> = examples.iter().map(|e| e.args[0].as_str()).collect();
    assert_eq!(
        commands,
        BTreeSet::from(["dump", "hist", "lookup", "show", "top", "watch"]),
        "one example per command"
    );
    for example in &examples {
        let runs = example
            .args
            .iter()
            .any(|a| a == "watch" || a == "--interval");
        let printed = ctl_process(addr, &example.args, runs.then_some(&example.lines[..]));
        let shown: Vec<Json> = example.lines.iter().map(shape).collect();
        let got: Vec<Json> = printed.iter().map(shape).collect();
        if runs {
            for line in &shown {
                assert!(
                    got.contains(line),
                    "`bpfmapctl {}` printed no line shaped as {line}:\n{got:#?}",
                    example.args.join(" ")
                );
            }
        } else {
            assert_eq!(
                got,
                shown,
                "`bpfmapctl {}` printed:\n{printed:#?}",
                example.args.join(" ")
            );
        }
    }
}
