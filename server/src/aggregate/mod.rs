//! AggregateMap: one walk of a map in the caller's dump slot, on the
//! blocking pool, grouping the matching entries as it reads them (the
//! groups and their aggregates are `query::Spec`'s).

mod elements;
pub(crate) mod histogram;
mod walk;

use std::{
    sync::{Arc, atomic::AtomicBool},
    time::Instant,
};

use bpfmap_kernel::{MapMeta, program::GroupTable};
use bpfmap_proto::{typed::MapLayout, v1 as pb};

use crate::{
    calls::{Call, Calls, blocking},
    dump::Dumps,
    error::Error,
    limits::{Slot, TrimGuard},
    model::{Caller, Identity, MapRequest, Operation, Rpc},
    query::{AggregateError, Filter, MAX_AGGREGATES, QueryError, Spec, scan::Sizes},
    watch::Scanner,
};

use walk::{AggregateWalk, CancelOnDrop, InKernel, KernelPlan};

/// What an AggregateMap call reads with: the daemon's calls, its dump
/// slots, and its bound on groups (`limits.max_groups`).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Aggregator<'a> {
    pub(crate) calls: &'a Calls,
    pub(crate) dumps: &'a Dumps,
    pub(crate) max_groups: usize,
}

/// Runs an AggregateMap call: its slot, its map, its groups (with the
/// renderings configured for the map and asked for), its filter, the walk.
pub(crate) async fn run(
    with: Aggregator<'_>,
    caller: &Caller,
    map: MapRequest,
    req: pb::AggregateMapRequest,
) -> Result<pb::AggregateMapResponse, Error> {
    prepare(with, caller, map, req).await?.run(None).await
}

/// Runs an AggregateMap call as the RPC answers it: aggregates over arrays
/// of integers (`sum(value.slots)`) as lists, one value per element (see
/// `elements`).
pub(crate) async fn answer(
    with: Aggregator<'_>,
    caller: &Caller,
    map: MapRequest,
    req: pb::AggregateMapRequest,
) -> Result<pb::AggregateMapResponse, Error> {
    let ask = Ask {
        rpc: Rpc::AggregateMap,
        render: &req.render.clone(),
        scan: req.scan,
        max_aggregates: elements::MAX_ELEMENTS,
    };
    let (prepared, elements) =
        prepare_as(
            with,
            caller,
            map,
            ask,
            |shown, _| match elements::Elements::expand(&req, shown)? {
                Some((inner, elements)) => Ok((inner, Some(elements))),
                None if req.aggregates.len() > MAX_AGGREGATES => {
                    Err(Error::InvalidArgument(format!(
                        "{} aggregates: at most {MAX_AGGREGATES}",
                        req.aggregates.len()
                    )))
                }
                None => Ok((req, None)),
            },
        )
        .await?;
    let answer = prepared.run(None).await?;
    Ok(match elements {
        Some(e) => e.collapse(answer),
        None => answer,
    })
}

/// An AggregateMap call ready to read its map: its slot taken, its map
/// opened, its groups and its filter compiled.
pub(crate) struct Prepared {
    walk: AggregateWalk,
    started: Instant,
    _slot: Option<Slot>,
    _trim: TrimGuard,
}

/// Prepares an AggregateMap call (see `run`).
pub(crate) async fn prepare(
    with: Aggregator<'_>,
    caller: &Caller,
    map: MapRequest,
    req: pb::AggregateMapRequest,
) -> Result<Prepared, Error> {
    let ask = Ask {
        rpc: Rpc::AggregateMap,
        render: &req.render.clone(),
        scan: req.scan,
        max_aggregates: MAX_AGGREGATES,
    };
    let (prepared, ()) = prepare_as(with, caller, map, ask, |_, _| Ok((req, ()))).await?;
    Ok(prepared)
}

/// What a call that groups a map's entries asks before its map's types
/// are known: the RPC (for the audit and the policy), the renderings of
/// its group keys, how the map is read, and how many aggregates it may
/// compute (AggregateMap's bound, or a histogram's buckets).
pub(crate) struct Ask<'r> {
    pub(crate) rpc: Rpc,
    pub(crate) render: &'r std::collections::HashMap<String, String>,
    pub(crate) scan: i32,
    pub(crate) max_aggregates: usize,
}

/// Prepares a call that groups a map's entries: its slot, its map, then
/// `question`, given the map's layout with the call's renderings and its
/// description, says what to compute (as an AggregateMapRequest) and what
/// else the call needs to make its answer (`T`).
pub(crate) async fn prepare_as<T>(
    with: Aggregator<'_>,
    caller: &Caller,
    map: MapRequest,
    ask: Ask<'_>,
    question: impl FnOnce(&MapLayout, &MapMeta) -> Result<(pb::AggregateMapRequest, T), Error>,
) -> Result<(Prepared, T), Error> {
    let Aggregator {
        calls,
        dumps,
        max_groups,
    } = with;
    calls.accepting()?;
    crate::dump::scan_method(ask.scan)?;
    let started = Instant::now();
    let call = Call::new(Operation::Aggregate, ask.rpc);
    let (map, declared) = calls.resolve(caller, call, map).await?;
    calls.authorize(caller, call, &map)?;
    // The daemon's own walks (exports, map pressure: one at a time per
    // export) take no dump slot from the callers.
    let slot = match caller.identity {
        Identity::Daemon => None,
        _ => Some(dumps.env.slots.try_acquire(caller)?),
    };
    let trim = dumps.trimmer.enter();
    let opened = calls.open(caller, call, map, &declared, true).await?;
    let shown = calls.layout(&opened, ask.render, true)?;
    let (req, extra) = question(&shown, opened.handle.meta())?;
    let spec = Spec::within(&req, &shown, max_groups, ask.max_aggregates).map_err(Error::from)?;
    let filter = match req.filter.as_str() {
        "" => None,
        f => Some(Filter::compile(f, &calls.query_layout(&opened)?).map_err(QueryError::Filter)?),
    };
    let kernel = kernel_plan(
        calls,
        &opened.handle,
        req.scan,
        &spec,
        filter.as_ref(),
        max_groups,
    );
    let prepared = Prepared {
        walk: AggregateWalk {
            map: opened.map,
            handle: opened.handle,
            spec,
            filter,
            stop: dumps.env.stop.clone(),
            cancelled: Arc::new(AtomicBool::new(false)),
            max_cost: dumps.env.max_filter_cost,
            kernel,
        },
        started,
        _slot: slot,
        _trim: trim,
    };
    Ok((prepared, extra))
}

/// Groups beyond which a walk inside the kernel that keeps its groups in a
/// hash map costs more than the batched read with SCAN_AUTO (measured:
/// tests/docs/performance.md, the query benchmark): such a walk stops
/// there and the map is read in batches. A dense table has no such bound.
pub(crate) const KERNEL_HASH_GROUPS: u32 = 1 << 17;

/// Whether the call's walk may run inside the kernel: asked for (`scan`,
/// the request's; by default), possible here for this map, and
/// expressible as a program, with a group table sized for the map: no more
/// groups than it holds entries, and with SCAN_AUTO no more groups in a
/// hash map than [`KERNEL_HASH_GROUPS`].
fn kernel_plan(
    calls: &Calls,
    handle: &bpfmap_kernel::MapHandle,
    scan: i32,
    spec: &Spec,
    filter: Option<&Filter>,
    max_groups: usize,
) -> KernelPlan {
    if scan == pb::ScanMethod::ScanBatched as i32 {
        return KernelPlan::Off;
    }
    let meta = handle.meta();
    if let Some(why) = calls.programs.unavailable(meta) {
        return KernelPlan::Cannot(why.into());
    }
    let mut plan = match crate::query::scan::plan(spec, filter, Sizes::of(meta), max_groups) {
        Ok(plan) => plan,
        Err(why) => return KernelPlan::Cannot(why.into()),
    };
    // A map of N entries makes at most N groups (rounded up: maps of
    // similar sizes share a program).
    let held = meta.max_entries.max(1).checked_next_power_of_two();
    plan.max_groups = plan.max_groups.min(held.unwrap_or(u32::MAX));
    if scan == pb::ScanMethod::ScanAuto as i32 && plan.table() == GroupTable::Hash {
        plan.max_groups = plan.max_groups.min(KERNEL_HASH_GROUPS);
    }
    KernelPlan::Plan(InKernel {
        programs: calls.programs.clone(),
        plan,
        limit: max_groups,
    })
}

impl Prepared {
    /// The map, as the request named it.
    pub(crate) fn map(&self) -> &crate::model::MapRef {
        &self.walk.map
    }

    /// The map it reads, opened.
    pub(crate) fn handle(&self) -> &bpfmap_kernel::MapHandle {
        &self.walk.handle
    }

    /// The map it reads.
    pub(crate) fn meta(&self) -> &MapMeta {
        self.walk.handle.meta()
    }

    /// Walks the map, or groups the entries of `over`'s last scan of it.
    pub(crate) async fn run(
        self,
        over: Option<Arc<Scanner>>,
    ) -> Result<pb::AggregateMapResponse, Error> {
        let Self { walk, started, .. } = self;
        let cancelled = CancelOnDrop(walk.cancelled.clone());
        let (groups, summary) = blocking(move || match over {
            Some(scanner) => walk.run_over(&scanner),
            None => walk.run(),
        })
        .await?;
        drop(cancelled);
        Ok(pb::AggregateMapResponse {
            groups,
            summary: Some(pb::AggregateSummary {
                elapsed: prost_types::Duration::try_from(started.elapsed()).ok(),
                ..summary
            }),
        })
    }
}

impl From<AggregateError> for Error {
    fn from(e: AggregateError) -> Self {
        match e {
            AggregateError::Invalid(m) => Error::InvalidArgument(m),
            e @ AggregateError::TooManyGroups { .. } => Error::ResourceExhausted(e.to_string()),
        }
    }
}
