//! What every fleet call starts from: its caller and deadline, its map,
//! its targets (those the caller asked, split by the policy into those it
//! may ask and those it may not, which end in-band), and the library's
//! fleet that runs it.

use std::{collections::HashMap, pin::Pin, sync::Arc, time::Duration};

use bpfmap_client::{ConnectOptions, Fleet, FleetOptions, MapName, Target, pb};
use bpfmapd::{
    Operation,
    frontend::{Caller, caller_of},
};
use tonic::{Request, Status};

use crate::{
    cursor::CursorKeys,
    error::{Error, InBand},
    policy::RelayPolicy,
    status,
    targets::Targets,
};

/// Messages queued for a slow caller, per call (the fleet's own buffers
/// and the daemons' streams hold the rest: back-pressure, not buffering).
pub(crate) const QUEUED: usize = 8;

/// A streamed answer.
pub(crate) type Answers<T> = Pin<Box<dyn futures::Stream<Item = Result<T, Status>> + Send>>;

/// What every call shares.
#[derive(Debug, Clone)]
pub(crate) struct Calls {
    pub(crate) targets: Arc<Targets>,
    /// How the relay reaches the daemons.
    pub(crate) connect: ConnectOptions,
    /// Concurrency, buffers, the answer timeout.
    pub(crate) options: FleetOptions,
    pub(crate) policy: Arc<RelayPolicy>,
    /// What fleet cursors are sealed with.
    pub(crate) keys: Arc<CursorKeys>,
    /// The largest message the relay sends (limits.max_message_bytes).
    pub(crate) max_message_bytes: usize,
}

/// Who asks, and by when: what a request's metadata says.
#[derive(Debug, Clone)]
pub(crate) struct Asker {
    pub(crate) caller: Caller,
    /// The caller's deadline (`grpc-timeout`), if it set one.
    pub(crate) deadline: Option<Duration>,
}

impl Asker {
    /// The caller of `request` (named by the front door) and its deadline.
    pub(crate) fn of<T>(request: &Request<T>) -> Result<Self, Status> {
        Ok(Self {
            caller: caller_of(request)?,
            deadline: deadline_of(request),
        })
    }
}

/// What a call asks for: an operation on a map, on targets (all the
/// relay's when none is named).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Ask<'a> {
    pub(crate) op: Operation,
    pub(crate) map: Option<&'a pb::MapRef>,
    pub(crate) targets: Option<&'a pb::TargetSelector>,
}

/// A call's caller, map and targets, checked.
#[derive(Debug, Clone)]
pub(crate) struct Call {
    pub(crate) asker: Asker,
    pub(crate) op: Operation,
    pub(crate) map: MapName,
    /// The targets asked that the policy lets the caller ask, in order.
    pub(crate) targets: Vec<Target>,
    /// The targets the policy keeps from the caller.
    pub(crate) denied: Vec<Target>,
}

/// A target that ends in-band before its daemon is called: kept from the
/// caller by the policy, or gone from the relay's targets.
#[derive(Debug, Clone)]
pub(crate) struct Ended {
    pub(crate) target: String,
    pub(crate) status: pb::TargetStatus,
}

impl Calls {
    /// The call `ask` makes for `asker`: its map, its targets checked
    /// against the policy; INVALID_ARGUMENT for no map or a target the
    /// relay does not know, PERMISSION_DENIED when no target is left.
    pub(crate) fn start(&self, asker: Asker, ask: Ask<'_>) -> Result<Call, Error> {
        let map = MapName::from_proto(ask.map.ok_or(Error::NoMap)?).map_err(Error::Map)?;
        let names = ask
            .targets
            .map(|t| t.targets.as_slice())
            .unwrap_or_default();
        let targets = self.targets.select(names)?;
        self.checked(Call {
            asker,
            op: ask.op,
            map,
            targets,
            denied: Vec::new(),
        })
    }

    /// `call` with the targets the policy keeps from its caller moved to
    /// its denied ones; PERMISSION_DENIED when none is left.
    pub(crate) fn checked(&self, mut call: Call) -> Result<Call, Error> {
        let text = call.map.to_string();
        let asked = std::mem::take(&mut call.targets);
        let (allowed, denied) = asked.into_iter().partition::<Vec<_>, _>(|t| {
            self.policy
                .allows(&call.asker.caller.identity, call.op, &text, t.as_str())
        });
        if allowed.is_empty() {
            return Err(Error::Denied {
                identity: call.asker.caller.identity.clone(),
                op: call.op,
                map: text,
            });
        }
        call.targets = allowed;
        call.denied.extend(denied);
        Ok(call)
    }

    /// Whether the caller of `call` may make it on `target`.
    pub(crate) fn allows(&self, call: &Call, target: &Target) -> bool {
        let map = call.map.to_string();
        self.policy
            .allows(&call.asker.caller.identity, call.op, &map, target.as_str())
    }

    /// A fleet of `targets` for `asker`, each call naming the caller to the
    /// daemons (for their audit logs); with the caller's deadline, the
    /// targets not done shortly before it end with DEADLINE_EXCEEDED, so
    /// that the caller still receives the others' answers and their names.
    pub(crate) fn fleet(&self, asker: &Asker, targets: &[Target]) -> Fleet {
        let mut options = self.options.clone();
        if let Some(d) = asker.deadline {
            options = options.with_deadline(d.mul_f64(0.9));
        }
        Fleet::new(targets.to_vec(), self.connect_for(asker)).with_options(options)
    }

    /// How the relay reaches the daemons for `asker`.
    pub(crate) fn connect_for(&self, asker: &Asker) -> ConnectOptions {
        self.connect
            .clone()
            .with_on_behalf_of(asker.caller.identity.to_string())
    }
}

/// How the targets of a call answered at once ended.
pub(crate) struct Ends {
    pub(crate) answered: Vec<String>,
    pub(crate) failed: Vec<pb::TargetFailure>,
    pub(crate) work: Vec<pb::TargetWork>,
}

impl Call {
    /// How a target the policy keeps from the caller ends.
    pub(crate) fn denial(&self) -> InBand {
        InBand::Denied {
            identity: self.asker.caller.identity.clone(),
            op: self.op,
            map: self.map.to_string(),
        }
    }

    /// How every target of a call answered at once (AggregateMap,
    /// HistogramMap, StackMap) ended, its end recorded: the denied, those
    /// whose report says they failed (both in `failed`), the others in
    /// `answered`; what each daemon did.
    pub(crate) fn ends(&self, calls: &Calls, reports: &[bpfmap_client::TargetReport]) -> Ends {
        let mut failed: Vec<pb::TargetFailure> = self
            .denials()
            .into_iter()
            .map(|e| pb::TargetFailure {
                target: e.target,
                status: Some(e.status),
            })
            .collect();
        let mut answered = Vec::new();
        for report in reports {
            let target = report.target.as_str().to_owned();
            match calls.targets.record_end(report) {
                Some(status) => failed.push(pb::TargetFailure {
                    target,
                    status: Some(status),
                }),
                None => answered.push(target),
            }
        }
        let work = reports
            .iter()
            .map(|r| pb::TargetWork {
                target: r.target.as_str().to_owned(),
                entries_scanned: r.scanned,
                groups: r.entries,
                calls: r.calls,
            })
            .collect();
        Ends {
            answered,
            failed,
            work,
        }
    }

    /// The targets the policy keeps from the caller, each with its status.
    pub(crate) fn denials(&self) -> Vec<Ended> {
        let status = status::in_band(&self.denial());
        self.denied
            .iter()
            .map(|t| Ended {
                target: t.as_str().to_owned(),
                status: status.clone(),
            })
            .collect()
    }
}

/// Longest target's own cursor accepted, in characters (a daemon's).
const MAX_TARGET_CURSOR_LEN: usize = 4096;

impl Call {
    /// Each target's own cursor, as the caller gave them (a dump's
    /// `targetCursors`, a watch's): names of the call's targets, cursors of
    /// at most a daemon's length. (A daemon binds its cursors to the
    /// relay's identity: the relay decides who may use them, by the policy
    /// of the map on each target.)
    pub(crate) fn target_cursors(
        &self,
        given: HashMap<String, String>,
    ) -> Result<HashMap<String, String>, Error> {
        for (name, cursor) in &given {
            if !self.targets.iter().any(|t| t.as_str() == name) {
                return Err(Error::NotACallTarget(name.clone()));
            }
            if cursor.len() > MAX_TARGET_CURSOR_LEN {
                return Err(Error::TargetCursorTooLong {
                    name: name.clone(),
                    max: MAX_TARGET_CURSOR_LEN,
                });
            }
        }
        Ok(given)
    }
}

/// The deadline a caller set (`grpc-timeout`: digits and a unit, H, M, S,
/// m, u or n).
fn deadline_of<T>(request: &Request<T>) -> Option<Duration> {
    let text = request.metadata().get("grpc-timeout")?.to_str().ok()?;
    let (digits, unit) = text.split_at(text.len().checked_sub(1)?);
    let n: u64 = digits.parse().ok()?;
    Some(match unit {
        "H" => Duration::from_secs(n.saturating_mul(3600)),
        "M" => Duration::from_secs(n.saturating_mul(60)),
        "S" => Duration::from_secs(n),
        "m" => Duration::from_millis(n),
        "u" => Duration::from_micros(n),
        "n" => Duration::from_nanos(n),
        _ => return None,
    })
}
