//! What every command needs: the targets, how to reach them, how to print.

use std::time::Duration;

use bpfmap_client::{
    ClientTls, ConnectOptions, Fleet, FleetOptions, InnerKey, Key, MapName, Resolver, RetryPolicy,
    Target, TargetSpec,
};

use crate::{
    Cli, Terminals,
    cursors::CursorFile,
    output::{Format, Printer, Progress},
    usage,
};

/// The targets and how to reach them, and how to print what they say.
#[derive(Debug)]
pub(crate) struct Setup {
    pub(crate) targets: Vec<Target>,
    pub(crate) connect: ConnectOptions,
    pub(crate) options: FleetOptions,
    pub(crate) printer: Printer,
    pub(crate) progress: Progress,
    /// Whether keys and values are decoded through the maps' types (not
    /// with --raw, nor in hex).
    pub(crate) decode: bool,
    /// `--inner KEY`: the inner map of the named map at KEY.
    pub(crate) inner: Option<String>,
    /// `--key-type` and `--value-type`: the map's types declared in C.
    pub(crate) declared: Option<(String, String)>,
    /// `--relay URL`: the fleet through the relay.
    pub(crate) relay: Option<Fleet>,
}

impl Setup {
    /// From the command line; the targets of `saved` when no target is
    /// given.
    pub(crate) async fn new(
        cli: &Cli,
        saved: Option<&CursorFile>,
        terminals: Terminals,
    ) -> anyhow::Result<Self> {
        let busy_wait = Duration::try_from_secs_f64(cli.busy_wait).map_err(|_| {
            usage(format!(
                "--busy-wait must be a number of seconds (0 or more), not {}",
                cli.busy_wait
            ))
        })?;
        let mut connect = ConnectOptions::default()
            .with_connect_timeout(seconds("--connect-timeout", cli.connect_timeout)?)
            .with_retry(RetryPolicy::fleet().with_busy_wait(busy_wait));
        if let Some(tls) = tls(cli)? {
            connect = connect.with_tls(tls);
        }
        let (targets, relay) = match &cli.relay {
            Some(url) => {
                let fleet = via_relay(cli, url, saved, connect.clone()).await?;
                (fleet.targets().to_vec(), Some(fleet))
            }
            None => (targets(cli, saved).await?, None),
        };
        let mut options = FleetOptions::default()
            .with_concurrency(cli.concurrency as usize)
            .with_answer_timeout(seconds("--connect-timeout", cli.connect_timeout)?);
        if let Some(d) = cli.deadline {
            options = options.with_deadline(seconds("--deadline", d)?);
        }
        let format = cli.format.unwrap_or(if terminals.stdout {
            Format::Table
        } else {
            Format::Json
        });
        Ok(Self {
            progress: Progress::new(terminals.stderr, targets.len()),
            targets,
            connect,
            options,
            printer: Printer::new(format, cli.per_cpu),
            decode: !(cli.raw || format == Format::Hex),
            inner: cli.inner.clone(),
            declared: (cli.key_type.is_some() || cli.value_type.is_some()).then(|| {
                (
                    cli.key_type.clone().unwrap_or_default(),
                    cli.value_type.clone().unwrap_or_default(),
                )
            }),
            relay,
        })
    }

    /// The map a command names: `s`, or its inner map at `--inner KEY`
    /// (a key as `lookup` takes them).
    pub(crate) fn map_name(&self, s: &str) -> anyhow::Result<MapName> {
        let mut map = map_name(s)?;
        if let Some(key) = &self.inner {
            let key = match crate::keys::parse_key(key)? {
                Key::Bytes(b) => InnerKey::Bytes(b),
                Key::Json(v) => InnerKey::Json(v),
                _ => return Err(usage(format!("--inner {key:?} is not a key"))),
            };
            map = map.inner(key);
        }
        if let Some((key, value)) = &self.declared {
            map = map.with_types(key, value);
        }
        Ok(map)
    }

    /// A fleet of every target.
    pub(crate) fn fleet(&self) -> Fleet {
        self.fleet_of(self.targets.clone(), self.connect.clone())
    }

    /// A fleet of `targets`, reached with `connect` (or through the relay).
    pub(crate) fn fleet_of(&self, targets: Vec<Target>, connect: ConnectOptions) -> Fleet {
        match &self.relay {
            Some(relay) => relay.clone().with_targets(targets),
            None => Fleet::new(targets, connect),
        }
        .with_options(self.options.clone())
    }
}

/// A map name from the command line.
pub(crate) fn map_name(s: &str) -> anyhow::Result<MapName> {
    s.parse()
        .map_err(|e: bpfmap_client::Error| usage(e.to_string()))
}

fn tls(cli: &Cli) -> anyhow::Result<Option<ClientTls>> {
    let (Some(ca), Some(cert), Some(key)) = (&cli.ca, &cli.cert, &cli.key) else {
        return Ok(None);
    };
    let tls = ClientTls::from_files(ca, cert, key).map_err(|e| usage(e.to_string()))?;
    Ok(Some(match &cli.server_name {
        Some(name) => tls.with_server_name(name),
        None => tls,
    }))
}

/// The fleet behind the relay at `url`: the targets --target,
/// --targets-file or the cursor file name (as the relay names them), else
/// every target of the relay.
async fn via_relay(
    cli: &Cli,
    url: &str,
    saved: Option<&CursorFile>,
    connect: ConnectOptions,
) -> anyhow::Result<Fleet> {
    let parse = |t: &str| {
        t.parse::<Target>()
            .map_err(|e: bpfmap_client::Error| usage(e.to_string()))
    };
    let mut names: Vec<Target> = read_lines(cli)?
        .iter()
        .map(|l| parse(l))
        .collect::<anyhow::Result<_>>()?;
    if names.is_empty()
        && let Some(file) = saved
    {
        names = file.targets().map(parse).collect::<anyhow::Result<_>>()?;
    }
    Fleet::via_relay(url, connect, names)
        .await
        .map_err(|e| match e.code() {
            bpfmap_client::Code::InvalidArgument => usage(e.to_string()),
            _ => anyhow::anyhow!("through the relay: {e}"),
        })
}

/// The targets: --target and --targets-file, else those of the cursor
/// file, else --addr.
async fn targets(cli: &Cli, saved: Option<&CursorFile>) -> anyhow::Result<Vec<Target>> {
    let parse = |t: &str| {
        t.parse()
            .map_err(|e: bpfmap_client::Error| usage(e.to_string()))
    };
    let specs = read_specs(cli)?;
    let targets = if !specs.is_empty() {
        resolve(cli, &specs).await?
    } else if let Some(file) = saved {
        file.targets().map(parse).collect::<anyhow::Result<_>>()?
    } else {
        vec![parse(&cli.addr)?]
    };
    if targets.is_empty() {
        return Err(usage("no targets"));
    }
    Ok(targets)
}

fn read_specs(cli: &Cli) -> anyhow::Result<Vec<TargetSpec>> {
    read_lines(cli)?
        .iter()
        .map(|s| s.parse::<TargetSpec>().map_err(|e| usage(e.to_string())))
        .collect()
}

/// The lines of --target and --targets-file.
fn read_lines(cli: &Cli) -> anyhow::Result<Vec<String>> {
    let mut lines: Vec<String> = cli.targets.clone();
    if let Some(file) = &cli.targets_file {
        let text = std::fs::read_to_string(file)
            .map_err(|e| usage(format!("cannot read {}: {e}", file.display())))?;
        for line in text.lines() {
            let line = line.split('#').next().unwrap_or("").trim();
            if !line.is_empty() {
                lines.push(line.to_owned());
            }
        }
    }
    Ok(lines)
}

async fn resolve(cli: &Cli, specs: &[TargetSpec]) -> anyhow::Result<Vec<Target>> {
    let addrs: Option<Vec<Target>> = specs
        .iter()
        .map(|s| match s {
            TargetSpec::Addr(t) => Some(t.clone()),
            _ => None,
        })
        .collect();
    if let Some(addrs) = addrs {
        return Ok(addrs);
    }
    let resolver = match cli.dns_server {
        Some(addr) => Resolver::with_name_server(addr),
        None => Resolver::system(),
    }
    .map_err(|e| usage(e.to_string()))?;
    resolver
        .resolve(specs)
        .await
        .map_err(|e| usage(format!("cannot find the targets: {e}")))
}

fn seconds(what: &str, s: f64) -> anyhow::Result<Duration> {
    Duration::try_from_secs_f64(s)
        .ok()
        .filter(|d| !d.is_zero())
        .ok_or_else(|| {
            usage(format!(
                "{what} must be a positive number of seconds, not {s}"
            ))
        })
}
