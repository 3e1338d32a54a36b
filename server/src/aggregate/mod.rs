//! AggregateMap: one walk of a map in the caller's dump slot, on the
//! blocking pool, grouping the matching entries as it reads them (the
//! groups and their aggregates are `query::Spec`'s).

mod walk;

use std::sync::{Arc, atomic::AtomicBool};

use bpfmap_proto::v1 as pb;

use crate::{
    calls::{Calls, blocking},
    dump::Dumps,
    error::Error,
    model::{Caller, Identity, MapRequest, Operation, Rpc},
    query::{AggregateError, Filter, QueryError, Spec},
};

use walk::{AggregateWalk, CancelOnDrop};

/// Runs an AggregateMap call: its slot, its map, its groups (with the
/// renderings configured for the map and asked for), its filter, the walk.
pub(crate) async fn run(
    calls: &Calls,
    (dumps, max_groups): (&Dumps, usize),
    caller: &Caller,
    map: MapRequest,
    req: pb::AggregateMapRequest,
) -> Result<pb::AggregateMapResponse, Error> {
    calls.accepting()?;
    let started = std::time::Instant::now();
    let call = (Operation::Aggregate, Rpc::AggregateMap);
    let (map, declared) = calls.resolve(caller, call, map).await?;
    calls.authorize(caller, call, &map)?;
    // The daemon's own walks (exports, map pressure: one at a time per
    // export) take no dump slot from the callers.
    let slot = match caller.identity {
        Identity::Daemon => None,
        _ => Some(dumps.env.slots.try_acquire(caller)?),
    };
    let _trim = dumps.trimmer.enter();
    let opened = calls.open(caller, call, (map, &declared), true).await?;
    let shown = calls.layout(&opened, &req.render, true)?;
    let spec = Spec::new(&req, &shown, max_groups).map_err(Error::from)?;
    let filter = match req.filter.as_str() {
        "" => None,
        f => Some(Filter::compile(f, &calls.query_layout(&opened)?).map_err(QueryError::Filter)?),
    };
    let walk = AggregateWalk {
        map: opened.map,
        handle: opened.handle,
        spec,
        filter,
        stop: dumps.env.stop.clone(),
        cancelled: Arc::new(AtomicBool::new(false)),
        max_cost: dumps.env.max_filter_cost,
    };
    let cancelled = CancelOnDrop(walk.cancelled.clone());
    let (groups, summary) = blocking(move || walk.run()).await?;
    drop((cancelled, slot));
    Ok(pb::AggregateMapResponse {
        groups,
        summary: Some(pb::AggregateSummary {
            elapsed: prost_types::Duration::try_from(started.elapsed()).ok(),
            ..summary
        }),
    })
}

impl From<AggregateError> for Error {
    fn from(e: AggregateError) -> Self {
        match e {
            AggregateError::Invalid(m) => Error::InvalidArgument(m),
            e @ AggregateError::TooManyGroups { .. } => Error::ResourceExhausted(e.to_string()),
        }
    }
}
