//! Stacks computed where the map lives (StackMap): a map of counts keyed
//! by stack ids (offcputime's, bpftrace's @[kstack]) read with its
//! stack-trace map as stacks of named frames and their weights, merged
//! exactly across hosts (stacks that name the same frames are one), and
//! folded as flame graphs read them.

use std::collections::BTreeMap;

use bpfmap_proto::stacks as fold;

use crate::{
    Aggregate, AggregateSummary, Client, Error, Fleet, FleetEvent, MapName, Target, TargetReport,
    pb, typed,
};

/// Options of a stacks call ([`Client::stacks`]).
#[derive(Debug, Clone, Default)]
#[non_exhaustive]
pub struct StackOptions {
    stack_map: Option<MapName>,
    ids: Option<pb::StackIds>,
    by: Option<Aggregate>,
    roots: Vec<String>,
    filter: String,
    addresses_only: bool,
    limit: u32,
    render: BTreeMap<String, String>,
    batched: bool,
}

impl StackOptions {
    /// The stack-trace map the ids refer to (else the daemon finds the one
    /// the map's programs use).
    pub fn with_stack_map(mut self, map: MapName) -> Self {
        self.stack_map = Some(map);
        self
    }

    /// Where the ids are, when the map's key does not say it
    /// (`kern_stack_id`, `user_stack_id`): `kernel` and `user` the members
    /// holding them, `pid` the process, `bpftrace` for bpftrace's ids.
    pub fn with_ids(mut self, kernel: &str, user: &str, pid: &str, bpftrace: bool) -> Self {
        self.ids = Some(pb::StackIds {
            kernel: kernel.into(),
            user: user.into(),
            pid: pid.into(),
            bpftrace,
        });
        self
    }

    /// What a stack weighs (a SUM or COUNT); else the value's integer, or
    /// the count of entries.
    pub fn with_by(mut self, by: Aggregate) -> Self {
        self.by = Some(by);
        self
    }

    /// Members shown as root frames ("value.comm").
    pub fn with_roots(mut self, roots: impl IntoIterator<Item = impl Into<String>>) -> Self {
        self.roots = roots.into_iter().map(Into::into).collect();
        self
    }

    /// Only entries for which the CEL `filter` is true count.
    pub fn with_filter(mut self, filter: impl Into<String>) -> Self {
        self.filter = filter.into();
        self
    }

    /// Frames as addresses, not named (no `symbolize` permission needed).
    pub fn with_addresses_only(mut self) -> Self {
        self.addresses_only = true;
        self
    }

    /// The heaviest this many stacks (0: all).
    pub fn with_limit(mut self, stacks: u32) -> Self {
        self.limit = stacks;
        self
    }

    /// How root members are shown (`"value.comm" => "string"`).
    pub fn with_render<K: AsRef<str>, V: std::fmt::Display>(
        mut self,
        render: impl IntoIterator<Item = (K, V)>,
    ) -> Self {
        self.render = render
            .into_iter()
            .map(|(k, v)| (k.as_ref().to_owned(), v.to_string()))
            .collect();
        self
    }

    /// Read the map in batches, never inside the kernel.
    pub fn with_batched_scan(mut self) -> Self {
        self.batched = true;
        self
    }

    /// The options of a `StackMapRequest` as a caller wrote it (its map
    /// aside), for a program that forwards requests (a relay).
    /// [`Error::Aggregate`] for a `by` that is not an aggregate, or a
    /// `stack_map` that names no map.
    pub fn from_proto(req: &pb::StackMapRequest) -> Result<Self, Error> {
        Ok(Self {
            stack_map: req
                .stack_map
                .as_ref()
                .map(MapName::from_proto)
                .transpose()?,
            ids: req.ids.clone(),
            by: req.by.as_ref().map(Aggregate::from_proto).transpose()?,
            roots: req.roots.clone(),
            filter: req.filter.clone(),
            addresses_only: req.addresses_only,
            limit: req.limit,
            render: req.render.clone().into_iter().collect(),
            batched: req.scan == pb::ScanMethod::ScanBatched as i32,
        })
    }

    fn request(&self, map: &MapName) -> pb::StackMapRequest {
        pb::StackMapRequest {
            map: Some(map.to_proto()),
            stack_map: self.stack_map.as_ref().map(MapName::to_proto),
            ids: self.ids.clone(),
            by: self.by.as_ref().map(Aggregate::to_proto),
            roots: self.roots.clone(),
            filter: self.filter.clone(),
            addresses_only: self.addresses_only,
            limit: self.limit,
            render: self.render.clone().into_iter().collect(),
            scan: if self.batched {
                pb::ScanMethod::ScanBatched
            } else {
                pb::ScanMethod::ScanAuto
            } as i32,
        }
    }
}

/// A StackMap answer.
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub struct Stacks {
    /// The heaviest first.
    pub stacks: Vec<pb::Stack>,
    /// The stack-trace map read ("id:N").
    pub stack_map: String,
    /// Where the ids were read.
    pub ids: Option<pb::StackIds>,
    /// The walk's figures.
    pub summary: Option<AggregateSummary>,
    /// Why some frames have no names.
    pub notes: Vec<String>,
}

impl Stacks {
    fn from_proto(r: pb::StackMapResponse) -> Self {
        Self {
            stacks: r.stacks,
            stack_map: r.stack_map,
            ids: r.ids,
            summary: r.summary.map(AggregateSummary::from_proto),
            notes: r.notes,
        }
    }

    /// The folded lines of the stacks, one per stack (`root;frame;... value`).
    pub fn folded(&self) -> impl Iterator<Item = String> + '_ {
        self.stacks.iter().map(fold::folded_line)
    }
}

impl Client {
    /// The stacks of a map of counts keyed by stack ids, named by the
    /// daemon ([`StackOptions`]). Errors: INVALID_ARGUMENT for ids or
    /// members that do not fit, FAILED_PRECONDITION (reason NO_STACK_MAP)
    /// when the stack-trace map is not found, PERMISSION_DENIED when the
    /// caller may not have frames named (ask for addresses only).
    pub async fn stacks(&self, map: &MapName, options: StackOptions) -> Result<Stacks, Error> {
        typed::parse_render(&options.render).map_err(Error::render)?;
        let req = options.request(map);
        let resp = self
            .call(|mut c| {
                let req = req.clone();
                async move { c.stack_map(req).await }
            })
            .await?;
        Ok(Stacks::from_proto(resp))
    }
}

/// Stacks merged over a fleet: stacks that name the same frames are one,
/// their values added exactly.
#[derive(Debug)]
#[non_exhaustive]
pub struct FleetStacks {
    /// The heaviest first, at most the limit asked.
    pub stacks: Vec<pb::Stack>,
    /// Every target's report, in the order they ended.
    pub reports: Vec<TargetReport>,
    /// Targets that failed.
    pub missing: Vec<Target>,
    /// Why some frames have no names, per target.
    pub notes: Vec<(Target, String)>,
}

impl Fleet {
    /// The stacks of `map` on every target, merged (each call waits at most
    /// the fleet's answer timeout).
    pub async fn stacks(&self, map: &MapName, options: StackOptions) -> FleetStacks {
        use futures::StreamExt;
        if let Some(relay) = self.relay.as_ref().filter(|_| !self.targets().is_empty()) {
            return via_relay(relay, self, map, &options).await;
        }
        let limit = options.limit;
        let timeout = self.options().answer_timeout();
        let map = map.clone();
        let mut run = self.plan().run(move |client, answers| {
            let (map, options) = (map.clone(), options.clone());
            async move {
                let s = crate::fleet::timed(timeout, client.stacks(&map, options)).await?;
                answers.update(|p| {
                    p.entries = s.stacks.len() as u64;
                    p.scanned = s.summary.as_ref().map_or(0, |s| s.entries_scanned());
                    p.calls = 1;
                });
                answers.send(s).await;
                Ok(())
            }
        });
        let (mut answers, mut reports) = (Vec::new(), Vec::new());
        while let Some(event) = run.next().await {
            match event {
                FleetEvent::Answer { target, answer } => answers.push((target, answer)),
                FleetEvent::Done(r) => reports.push(r),
                FleetEvent::Merged(_) | FleetEvent::Retrying { .. } => {}
            }
        }
        let mut stacks = fold::merge(answers.iter().flat_map(|(_, a)| &a.stacks));
        if limit > 0 {
            stacks.truncate(limit as usize);
        }
        FleetStacks {
            stacks,
            missing: reports
                .iter()
                .filter(|r| r.error.is_some())
                .map(|r| r.target.clone())
                .collect(),
            notes: answers
                .iter()
                .flat_map(|(t, a)| a.notes.iter().map(|n| (t.clone(), n.clone())))
                .collect(),
            reports,
        }
    }
}

/// One StackMap call to the relay: its merged stacks, a report per target
/// of the fleet (in its order).
async fn via_relay(
    link: &crate::relay::RelayLink,
    fleet: &Fleet,
    map: &MapName,
    options: &StackOptions,
) -> FleetStacks {
    let req = pb::FleetServiceStackMapRequest {
        request: Some(options.request(map)),
        targets: crate::relay::RelayLink::selector(fleet.targets()),
    };
    let started = std::time::Instant::now();
    let deadline = crate::relay::Deadline::start(fleet.options().deadline());
    let mut client = link.client.clone();
    let answer = deadline
        .within(async move { client.stack_map(deadline.request(req)).await })
        .await
        .map(tonic::Response::into_inner);
    let answer = answer.unwrap_or_else(|e| pb::FleetServiceStackMapResponse {
        failed: fleet
            .targets()
            .iter()
            .map(|t| pb::TargetFailure {
                target: t.as_str().to_owned(),
                status: Some(pb::TargetStatus {
                    code: crate::code_name(e.code()).to_owned(),
                    reason: String::new(),
                    message: e.to_string(),
                }),
            })
            .collect(),
        ..Default::default()
    });
    let ends = crate::relay::OneAnswer {
        answered: &answer.answered,
        failed: &answer.failed,
        work: &answer.work,
    };
    let reports: Vec<TargetReport> = ends
        .reports(fleet.targets(), started)
        .into_iter()
        .map(|(r, _)| r)
        .collect();
    let notes = answer
        .notes
        .iter()
        .filter_map(|n| {
            let (name, note) = n.split_once(": ")?;
            let t = fleet.targets().iter().find(|t| t.as_str() == name)?;
            Some((t.clone(), note.to_owned()))
        })
        .collect();
    FleetStacks {
        missing: reports
            .iter()
            .filter(|r| r.error.is_some())
            .map(|r| r.target.clone())
            .collect(),
        stacks: answer.stacks,
        reports,
        notes,
    }
}
