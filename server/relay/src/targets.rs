//! The relay's targets: resolved from their specs (addresses, `dns:`,
//! `srv:`) at start and again every refresh interval, each with the state
//! its last call or probe left it in. A call works on the targets known
//! when it starts.

use std::{
    collections::HashMap,
    sync::{Arc, Mutex},
    time::{Duration, SystemTime},
};

use bpfmap_client::{
    Client, ConnectOptions, Error as CallError, Resolver, Target, TargetReport, TargetSpec, pb,
};
use tokio::sync::watch;
use tonic::Code;

use crate::{
    config::ConfigError,
    error::{Error, InBand},
    status,
};

/// How long a probe of one target may take.
const PROBE_TIMEOUT: Duration = Duration::from_secs(3);

/// Where the target specs come from: read again at every refresh (the
/// targets file may have changed).
pub(crate) type SpecSource = Box<dyn Fn() -> Result<Vec<TargetSpec>, ConfigError> + Send + Sync>;

/// The targets and their states.
pub(crate) struct Targets {
    source: SpecSource,
    specs: Mutex<Vec<TargetSpec>>,
    resolver: Resolver,
    known: Mutex<Known>,
}

impl std::fmt::Debug for Targets {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Targets")
            .field("known", &self.lock().list.len())
            .finish()
    }
}

#[derive(Debug, Default)]
struct Known {
    /// In order, each with the spec it came from.
    list: Vec<(Target, String)>,
    states: HashMap<String, State>,
    /// Each target's daemon version, from its last probe answered.
    versions: HashMap<String, String>,
}

/// What the last call or probe of a target said.
#[derive(Debug, Clone)]
struct State {
    status: Option<pb::TargetStatus>,
    since: SystemTime,
}

impl Targets {
    /// Reads and resolves the specs; fails when none gives a target.
    pub(crate) async fn new(source: SpecSource) -> Result<Arc<Self>, ConfigError> {
        let resolver = Resolver::system().map_err(ConfigError::Resolver)?;
        let specs = source()?;
        let targets = Arc::new(Self {
            source,
            specs: Mutex::new(specs),
            resolver,
            known: Mutex::default(),
        });
        targets.refresh().await;
        if targets.current().is_empty() {
            return Err(ConfigError::NoTargetResolved);
        }
        Ok(targets)
    }

    /// Reads the specs again (a targets file that cannot be read keeps the
    /// last ones) and resolves them: targets that appeared are added, those
    /// gone are dropped (a spec that fails to resolve keeps its targets).
    pub(crate) async fn refresh(&self) {
        let specs = match (self.source)() {
            Ok(specs) => {
                *self.specs.lock().unwrap_or_else(|e| e.into_inner()) = specs.clone();
                specs
            }
            Err(e) => {
                tracing::warn!(error = %e, "cannot read the targets; keeping the last ones");
                self.specs.lock().unwrap_or_else(|e| e.into_inner()).clone()
            }
        };
        let mut list = Vec::new();
        let before = self.lock().list.clone();
        for spec in &specs {
            let source = spec_text(spec);
            match self.resolver.targets(spec).await {
                Ok(found) => list.extend(found.into_iter().map(|t| (t, source.clone()))),
                Err(e) => {
                    tracing::warn!(spec = %source, error = %e, "cannot resolve targets; keeping the last ones");
                    list.extend(before.iter().filter(|(_, s)| *s == source).cloned());
                }
            }
        }
        let mut seen = std::collections::HashSet::new();
        list.retain(|(t, _)| seen.insert(t.clone()));
        let mut known = self.lock();
        let listed = |name: &String| list.iter().any(|(t, _)| t.as_str() == name);
        known.states.retain(|name, _| listed(name));
        known.versions.retain(|name, _| listed(name));
        known.list = list;
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Known> {
        self.known.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Every target known now.
    pub(crate) fn current(&self) -> Vec<Target> {
        self.lock().list.iter().map(|(t, _)| t.clone()).collect()
    }

    /// The targets a call names (all when none; each once, in order),
    /// INVALID_ARGUMENT for a name the relay does not know.
    pub(crate) fn select(&self, names: &[String]) -> Result<Vec<Target>, Error> {
        let all = self.current();
        if names.is_empty() {
            return Ok(all);
        }
        let mut seen = std::collections::HashSet::new();
        names
            .iter()
            .filter(|n| seen.insert(n.as_str()))
            .map(|n| {
                all.iter()
                    .find(|t| t.as_str() == n)
                    .cloned()
                    .ok_or_else(|| Error::UnknownTarget {
                        name: n.clone(),
                        known: all.len(),
                    })
            })
            .collect()
    }

    /// Records how a call to `target` went (a failure of the call's own
    /// request, INVALID_ARGUMENT or NOT_FOUND, says nothing of the target).
    pub(crate) fn record(&self, target: &Target, error: Option<&CallError>) {
        let status = match error {
            None => None,
            Some(e) if !says_target_is_down(e.code()) => return,
            Some(e) => Some(status::of_target(e)),
        };
        self.set(target, status);
    }

    /// Records how `report`'s target ended: its status when it failed.
    pub(crate) fn record_end(&self, report: &TargetReport) -> Option<pb::TargetStatus> {
        self.record(&report.target, report.error.as_ref());
        report.error.as_ref().map(status::of_target)
    }

    /// Sets the state of `target`: answering (`None`) or failing.
    fn set(&self, target: &Target, status: Option<pb::TargetStatus>) {
        let mut known = self.lock();
        let now = SystemTime::now();
        let state = known
            .states
            .entry(target.as_str().to_owned())
            .or_insert_with(|| State {
                status: status.clone(),
                since: now,
            });
        if state.status.is_some() != status.is_some() {
            state.since = now;
        }
        state.status = status;
    }

    /// Every target with its state.
    pub(crate) fn states(&self) -> Vec<pb::TargetState> {
        let known = self.lock();
        known
            .list
            .iter()
            .map(|(t, source)| {
                let state = known.states.get(t.as_str());
                pb::TargetState {
                    target: t.as_str().to_owned(),
                    answering: state.is_some_and(|s| s.status.is_none()),
                    status: match state {
                        Some(s) => s.status.clone(),
                        None => Some(status::in_band(&InBand::NotProbed)),
                    },
                    since: state.map(|s| prost_types::Timestamp::from(s.since)),
                    source: source.clone(),
                    version: known.versions.get(t.as_str()).cloned().unwrap_or_default(),
                }
            })
            .collect()
    }

    /// Resolves and probes every target every `every` (health checks),
    /// until `stop`.
    pub(crate) fn spawn_upkeep(
        self: &Arc<Self>,
        every: Duration,
        connect: ConnectOptions,
        mut stop: watch::Receiver<bool>,
    ) {
        let targets = self.clone();
        tokio::spawn(async move {
            loop {
                targets.probe_all(&connect).await;
                tokio::select! {
                    _ = tokio::time::sleep(every) => {}
                    _ = stop.wait_for(|s| *s) => return,
                }
                targets.refresh().await;
            }
        });
    }

    /// A health check of every target, 32 at once.
    async fn probe_all(&self, connect: &ConnectOptions) {
        use futures::StreamExt as _;
        let targets = self.current();
        futures::stream::iter(targets)
            .for_each_concurrent(32, |t| async move {
                match tokio::time::timeout(PROBE_TIMEOUT, probe(&t, connect)).await {
                    Ok(Ok(health)) => {
                        if let Some(v) = health.version {
                            self.lock().versions.insert(t.as_str().to_owned(), v);
                        }
                        if health.serving {
                            self.record(&t, None);
                        } else {
                            self.set(&t, Some(status::in_band(&InBand::NotServing)));
                        }
                    }
                    Ok(Err(e)) => self.record(&t, Some(&e)),
                    Err(_) => {
                        let late = InBand::ProbeTimeout(PROBE_TIMEOUT);
                        self.set(&t, Some(status::in_band(&late)));
                    }
                }
            })
            .await;
    }
}

/// What a target's health check says.
struct Health {
    /// Whether the map service is serving (not stopping).
    serving: bool,
    /// Its daemon's version, when it says it.
    version: Option<String>,
}

/// The health of one target (grpc.health.v1, the map service's status),
/// and its daemon's version when it says it.
async fn probe(target: &Target, connect: &ConnectOptions) -> Result<Health, CallError> {
    let client = Client::connect(&target.url(connect.uses_tls()), connect.clone()).await?;
    let mut health = tonic_health::pb::health_client::HealthClient::new(client.channel().clone());
    let answer = health
        .check(tonic_health::pb::HealthCheckRequest {
            service: bpfmapd::SERVICE_NAME.into(),
        })
        .await?;
    let version = answer
        .metadata()
        .get(bpfmapd::VERSION_HEADER)
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned);
    let serving = tonic_health::pb::health_check_response::ServingStatus::Serving as i32;
    Ok(Health {
        serving: answer.into_inner().status == serving,
        version,
    })
}

/// Whether a failure says the target itself is not answering (rather than
/// that the call was wrong for it).
fn says_target_is_down(code: Code) -> bool {
    matches!(
        code,
        Code::Unavailable
            | Code::DeadlineExceeded
            | Code::Unknown
            | Code::Internal
            | Code::Unauthenticated
    )
}

/// A spec as written.
fn spec_text(spec: &TargetSpec) -> String {
    match spec {
        TargetSpec::Addr(t) => t.as_str().to_owned(),
        TargetSpec::Dns { name, port } => format!("dns:{name}:{port}"),
        TargetSpec::Srv { name } => format!("srv:{name}"),
        _ => format!("{spec:?}"),
    }
}
