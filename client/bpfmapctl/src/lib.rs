//! The `bpfmapctl` command line: read eBPF maps from a bpfmapd, as JSON Lines.
//! A library so that the tests can run it in-process; `main.rs` is the
//! binary.
#![forbid(unsafe_code)]

use std::io;

use bpfmap_client::{Client, ClientTls, DumpOptions, Entry, MapName, RetryPolicy, Value, pb};
use clap::{Parser, Subcommand};
use serde_json::{Value as Json, json};

/// Read eBPF maps from a bpfmapd. Output is JSON Lines; keys and values are
/// hex strings.
#[derive(Debug, Parser)]
#[command(name = "bpfmapctl", version)]
pub struct Cli {
    /// Address of the daemon.
    #[arg(
        long,
        short = 'a',
        env = "BPFMAP_ADDR",
        default_value = "http://127.0.0.1:50051"
    )]
    pub addr: String,
    /// CA bundle (PEM) for the server's certificate; enables mutual TLS
    /// (use an https:// address) together with --cert and --key.
    #[arg(long, env = "BPFMAP_CA", requires_all = ["cert", "key"])]
    pub ca: Option<std::path::PathBuf>,
    /// This client's certificate (PEM).
    #[arg(long, env = "BPFMAP_CERT", requires = "ca")]
    pub cert: Option<std::path::PathBuf>,
    /// This client's private key (PEM).
    #[arg(long, env = "BPFMAP_KEY", requires = "ca")]
    pub key: Option<std::path::PathBuf>,
    /// Name the server certificate must carry (default: the address's host).
    #[arg(long)]
    pub server_name: Option<String>,
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// List the maps the daemon exposes, one JSON object per line.
    List,
    /// Describe one map.
    Show {
        /// Map path relative to the daemon's root ("demo/flows"), or "id:N".
        map: String,
    },
    /// Dump a map's entries, one per line. A summary (with the cursor to
    /// resume from) goes to stderr.
    Dump {
        /// Map path relative to the daemon's root ("demo/flows"), or "id:N".
        map: String,
        /// Entries per chunk (server default when 0).
        #[arg(long, default_value_t = 0)]
        chunk_size: u32,
        /// Stop after this many entries (0 = all).
        #[arg(long, default_value_t = 0)]
        limit: u64,
        /// Resume after this cursor (from an earlier dump's summary).
        #[arg(long, allow_hyphen_values = true)]
        cursor: Option<String>,
        /// Do not resume automatically when the stream breaks.
        #[arg(long)]
        no_resume: bool,
    },
    /// Look up keys (hex) in a map; absent keys print "found": false.
    Lookup {
        /// Map path relative to the daemon's root ("demo/flows"), or "id:N".
        map: String,
        /// Keys as hex strings, each exactly the map's key size.
        #[arg(required = true)]
        keys: Vec<String>,
    },
}

fn hex(b: &[u8]) -> String {
    hex::encode(b)
}

fn unhex(s: &str) -> anyhow::Result<Vec<u8>> {
    let digits = s.strip_prefix("0x").unwrap_or(s);
    hex::decode(digits).map_err(|e| {
        anyhow::anyhow!("key {s:?} is not a hex string (two hex digits per byte): {e}")
    })
}

fn map_json(m: &pb::MapInfo) -> Json {
    json!({
        "path": m.path,
        "id": m.id,
        "name": m.name,
        "type": m.type_name,
        "key_size": m.key_size,
        "value_size": m.value_size,
        "max_entries": m.max_entries,
        "flags": m.flags,
        "per_cpu": m.per_cpu,
        "possible_cpus": m.possible_cpus,
        "btf_id": m.btf_id,
        "btf_key_type_id": m.btf_key_type_id,
        "btf_value_type_id": m.btf_value_type_id,
        "dump_method": match pb::DumpMethod::try_from(m.dump_method) {
            Ok(pb::DumpMethod::Batch) => "batch",
            Ok(pb::DumpMethod::KeyByKey) => "key_by_key",
            Ok(pb::DumpMethod::None) => "none",
            _ => "unknown",
        },
    })
}

fn entry_json(e: &Entry) -> Json {
    match &e.value {
        Value::Single(v) => json!({"key": hex(&e.key), "value": hex(v)}),
        Value::PerCpu(vs) => json!({
            "key": hex(&e.key),
            "per_cpu_values": vs.iter().map(|v| hex(v)).collect::<Vec<_>>(),
        }),
    }
}

/// Runs bpfmapctl as the `bpfmapctl` binary does: exit code 0 on success,
/// 1 on an error, 2 on a usage error, 130 when a dump was interrupted.
pub fn main() -> std::process::ExitCode {
    use std::io::Write as _;
    let cli = Cli::parse();
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(r) => r,
        Err(e) => {
            eprintln!("bpfmapctl: cannot start the runtime: {e}");
            return std::process::ExitCode::FAILURE;
        }
    };
    let stdout = io::stdout();
    let mut out = io::BufWriter::with_capacity(1 << 16, stdout.lock());
    let result = runtime.block_on(run(cli, &mut out, &mut io::stderr()));
    // Whatever happened, what was printed reaches stdout before exiting.
    let flushed = out.flush();
    let result = result.and_then(|()| flushed.map_err(Into::into));
    match result {
        Ok(()) => std::process::ExitCode::SUCCESS,
        // A closed pipe (`| head`) is not an error.
        Err(e)
            if e.downcast_ref::<io::Error>()
                .is_some_and(|io| io.kind() == io::ErrorKind::BrokenPipe) =>
        {
            std::process::ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("bpfmapctl: {e:#}");
            if e.is::<Interrupted>() {
                std::process::ExitCode::from(130)
            } else {
                std::process::ExitCode::FAILURE
            }
        }
    }
}

/// The dump was stopped by SIGINT or SIGTERM (the summary says where to
/// resume).
#[derive(Debug, thiserror::Error)]
#[error("stopped by {0}")]
pub struct Interrupted(pub &'static str);

/// Resolves when the process gets SIGINT or SIGTERM, with the signal's name.
async fn interrupted() -> &'static str {
    use tokio::signal::unix::{SignalKind, signal};
    match (
        signal(SignalKind::interrupt()),
        signal(SignalKind::terminate()),
    ) {
        (Ok(mut int), Ok(mut term)) => tokio::select! {
            _ = int.recv() => "SIGINT",
            _ = term.recv() => "SIGTERM",
        },
        _ => std::future::pending().await,
    }
}

fn print(out: &mut dyn io::Write, v: &Json) -> io::Result<()> {
    serde_json::to_writer(&mut *out, v)?;
    out.write_all(b"\n")
}

/// Runs one command, writing results to `out` and the dump summary to `err`.
pub async fn run(cli: Cli, out: &mut dyn io::Write, err: &mut dyn io::Write) -> anyhow::Result<()> {
    let tls = match (&cli.ca, &cli.cert, &cli.key) {
        (Some(ca), Some(cert), Some(key)) => Some(ClientTls {
            server_name: cli.server_name.clone(),
            ..ClientTls::from_files(ca, cert, key)?
        }),
        _ => None,
    };
    let client = Client::connect_with(&cli.addr, tls.as_ref()).await?;
    match cli.command {
        Command::List => {
            for m in client.list_maps().await? {
                print(out, &map_json(&m))?;
            }
        }
        Command::Show { map } => {
            let map: MapName = map.parse()?;
            print(out, &map_json(&client.get_map(&map).await?))?;
        }
        Command::Dump {
            map,
            chunk_size,
            limit,
            cursor,
            no_resume,
        } => {
            let map: MapName = map.parse()?;
            let client = if no_resume {
                client.with_retry(RetryPolicy::never())
            } else {
                client
            };
            let options = DumpOptions {
                chunk_size,
                limit,
                cursor,
                packed: true,
            };
            let mut dump = client.dump(map, options);
            // What is on stdout, chunk by chunk: the summary's cursor resumes
            // right after the last line written, whatever ends the dump.
            let mut written = 0u64;
            let mut cursor = dump.cursor().to_owned();
            let result = async {
                let mut stop = std::pin::pin!(interrupted());
                loop {
                    let chunk = tokio::select! {
                        chunk = dump.next_chunk() => chunk?,
                        signal = &mut stop => return Err(anyhow::Error::new(Interrupted(signal))),
                    };
                    let Some(chunk) = chunk else { break };
                    for e in &chunk {
                        print(out, &entry_json(e))?;
                    }
                    written += chunk.len() as u64;
                    cursor = dump.cursor().to_owned();
                }
                anyhow::Ok(())
            }
            .await;
            let flushed = out.flush();
            if result.is_ok() {
                cursor = dump.cursor().to_owned();
            }
            let summary = json!({
                "entries": written,
                "complete": result.is_ok() && dump.complete(),
                "resumes": dump.resumes(),
                "cursor": cursor,
            });
            if result.is_ok() || written > 0 || !cursor.is_empty() {
                writeln!(err, "{summary}")?;
            }
            result?;
            flushed?;
        }
        Command::Lookup { map, keys } => {
            let map: MapName = map.parse()?;
            let keys = keys
                .iter()
                .map(|k| unhex(k))
                .collect::<anyhow::Result<Vec<_>>>()?;
            for r in client.lookup(&map, keys).await? {
                let mut v = json!({"key": hex(&r.key), "found": r.found});
                if r.found {
                    if r.per_cpu_values.is_empty() {
                        v["value"] = json!(hex(&r.value));
                    } else {
                        v["per_cpu_values"] =
                            json!(r.per_cpu_values.iter().map(|x| hex(x)).collect::<Vec<_>>());
                    }
                }
                print(out, &v)?;
            }
        }
    }
    out.flush()?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hex_round_trip_and_errors() {
        assert_eq!(unhex("0a0B").unwrap(), [10, 11]);
        assert_eq!(unhex("0x0a").unwrap(), [10]);
        assert_eq!(hex(&[0, 255]), "00ff");
        assert!(unhex("abc").is_err());
        assert!(unhex("zz").is_err());
    }

    #[test]
    fn help_lists_the_commands() {
        use clap::CommandFactory as _;
        let help = Cli::command().render_help().to_string();
        for cmd in ["list", "show", "dump", "lookup"] {
            assert!(help.contains(cmd), "{help}");
        }
    }
}
