//! Filtered dumps walked inside the kernel: a walk program tests the
//! filter (what of it the kernel can test) on every entry and copies the
//! entries it takes; the dump then walks those, sorted by key, with the
//! filter tested again in user space, and with cursors of the same form
//! as a batched walk's (the last key delivered).
//!
//! Where that walk keeps the dump's promise of each entry exactly once it
//! runs by default: arrays, whose indexes the kernel visits once each, in
//! the order a batched walk reads them (the cursors of both walks are the
//! same). Hash maps only when the call accepts the unlocked walk
//! (SCAN_KERNEL): their entries then come in the order of their key
//! bytes, and a cursor issued so resumes only a dump walked the same way
//! (its binding says so).

use bpfmap_kernel::{
    MapHandle, MapMeta, MapOps, MapType, SyscallError,
    program::{self, Matches, WalkPlan},
    walk::Position,
};
use bpfmap_proto::v1 as pb;

use super::Dumps;
use crate::{
    calls::Calls,
    error::Error,
    limits::Reservation,
    model::MapRef,
    programs::Unavailable,
    query::{
        Filter, Query,
        scan::{Sizes, Untranslatable},
    },
};

/// What a dump reads: the map, or the entries a walk inside the kernel
/// took.
#[derive(Debug)]
pub(crate) enum Source {
    Map(MapHandle),
    Taken(Matches),
}

impl MapOps for Source {
    fn lookup_batch(
        &self,
        in_batch: Option<&[u8]>,
        out_batch: &mut [u8],
        keys: &mut [u8],
        values: &mut [u8],
        count: &mut u32,
    ) -> Result<(), SyscallError> {
        match self {
            Self::Map(m) => m.lookup_batch(in_batch, out_batch, keys, values, count),
            Self::Taken(m) => m.lookup_batch(in_batch, out_batch, keys, values, count),
        }
    }

    fn get_next_key(&self, key: Option<&[u8]>, next: &mut [u8]) -> Result<(), SyscallError> {
        match self {
            Self::Map(m) => m.get_next_key(key, next),
            Self::Taken(m) => m.get_next_key(key, next),
        }
    }

    fn lookup(&self, key: &[u8], value: &mut [u8]) -> Result<(), SyscallError> {
        match self {
            Self::Map(m) => m.lookup(key, value),
            Self::Taken(m) => m.lookup(key, value),
        }
    }
}

/// How a dump read its map, for its summary.
#[derive(Debug, Default)]
pub(crate) struct ScanReport {
    /// Entries a walk inside the kernel visited (`None`: read in batches).
    pub(crate) visited: Option<u64>,
    /// Why it was read in batches, or what of the filter user space tests.
    pub(crate) note: String,
    /// The memory of the entries taken, for the whole dump.
    #[expect(dead_code, reason = "kept for its drop")]
    pub(crate) memory: Option<Reservation>,
}

/// A dump's walk as the request and its cursor decide it.
pub(super) struct Decided {
    pub(super) source: Source,
    pub(super) report: ScanReport,
    /// Whether its cursors are those of a walk in key-byte order (a hash
    /// map's entries taken inside the kernel).
    pub(super) key_order: bool,
}

/// The scan method a request names, checked.
pub(crate) fn scan_method(value: i32) -> Result<pb::ScanMethod, Error> {
    pb::ScanMethod::try_from(value).map_err(|_| {
        Error::InvalidArgument(format!(
            "unknown scan method {value}; use SCAN_AUTO (0), SCAN_BATCHED (1) or SCAN_KERNEL (2)"
        ))
    })
}

/// The binding of cursors of a dump in key-byte order: the query's, marked
/// (a cursor of one walk does not resume the other).
pub(super) fn key_order_digest(query: [u8; 16]) -> [u8; 16] {
    let mut d = query;
    for (b, m) in d.iter_mut().zip(b"bpfmapd/kernel/1") {
        *b ^= m;
    }
    d
}

/// Whether a map of `meta`'s type keeps the exactly-once promise when
/// walked inside the kernel: arrays.
fn exact_in_kernel(meta: &MapMeta) -> bool {
    meta.map_type == MapType::ARRAY
}

/// Why a filtered dump is read in batches rather than walked inside the
/// kernel: its summary's note.
#[derive(Debug, thiserror::Error)]
pub(crate) enum Batched {
    /// No walk program runs for the map.
    #[error(transparent)]
    Program(#[from] Unavailable),
    /// The kernel can test nothing of the filter that takes fewer entries
    /// than all.
    #[error("the filter takes every entry")]
    EveryEntry,
    /// What of the filter the kernel cannot test, when that leaves it
    /// nothing to test.
    #[error("{}", joined(.0))]
    Untested(Vec<Untranslatable>),
    /// A per-CPU map: a program sees one CPU's value.
    #[error("a scan in the kernel sees one CPU's value of a per-CPU map")]
    PerCpu,
    /// A map whose walk inside the kernel can miss an entry (all but
    /// arrays), without SCAN_KERNEL.
    #[error(
        "a walk inside the kernel can miss an entry of a {0} map replaced while it runs, which a dump's cursors rule out; SCAN_KERNEL accepts that"
    )]
    Unlocked(MapType),
    /// The cursor resumes a dump read in batches.
    #[error("the cursor comes from a dump read in batches")]
    CursorOfBatches,
    /// More entries match than a dump holds (this many).
    #[error(
        "more than {0} entries match, more than a dump walked inside the kernel holds (a quarter of limits.max_queued_bytes)"
    )]
    TooManyMatches(usize),
    /// The pool's memory is taken.
    #[error("the server's memory for dumps is in use")]
    NoMemory,
}

/// Reasons, as a note lists them.
fn joined(reasons: &[Untranslatable]) -> String {
    let texts: Vec<String> = reasons.iter().map(ToString::to_string).collect();
    texts.join("; ")
}

/// What a dump's walk is decided from: its map, its query, the scan method
/// it asks for and where its cursor stands.
pub(super) struct WalkRequest<'a> {
    pub(super) map: &'a MapRef,
    pub(super) query: Option<&'a Query>,
    pub(super) scan: pb::ScanMethod,
    pub(super) position: &'a Position,
    /// Whether the cursor comes from a dump in key-byte order.
    pub(super) key_order_cursor: bool,
}

/// Decides how the dump `req` asks for reads `handle`'s map, and runs the
/// walk inside the kernel when it does.
pub(super) async fn decide(
    calls: &Calls,
    dumps: &Dumps,
    handle: MapHandle,
    req: &WalkRequest<'_>,
) -> Result<Decided, Error> {
    let meta = handle.meta().clone();
    let filter = req
        .query
        .and_then(|q| q.filter.as_ref())
        .filter(|_| req.scan != pb::ScanMethod::ScanBatched);
    // Without a filter there is nothing to walk inside the kernel, and
    // nothing to say.
    let Some(filter) = filter else {
        return Ok(batched(handle, None));
    };
    let cond = match why_not(calls, &meta, req) {
        Some(why) => Err(why),
        None => prefilter(filter, &meta),
    };
    let (cond, left_out) = match cond {
        Ok(c) => c,
        Err(why) => return Ok(batched(handle, Some(why))),
    };
    let (handle, taken) = take(calls, dumps, handle, cond).await?;
    let (matches, report) = match taken {
        Ok(taken) => taken,
        Err(why) if req.key_order_cursor => {
            return Err(Error::KernelWalkUnavailable(format!(
                "this cursor resumes a dump of {} walked inside the kernel, and that walk cannot run now ({why}); restart the dump",
                req.map
            )));
        }
        Err(why) => return Ok(batched(handle, Some(why))),
    };
    Ok(Decided {
        source: Source::Taken(matches),
        report: ScanReport {
            note: left_out
                .first()
                .map(|why| format!("part of the filter is tested in user space: {why}"))
                .unwrap_or_default(),
            ..report
        },
        key_order: !exact_in_kernel(&meta),
    })
}

/// What of `filter` the kernel tests, and what it leaves to user space;
/// why nothing when it can test nothing that takes fewer entries than all.
fn prefilter(
    filter: &Filter,
    meta: &MapMeta,
) -> Result<(program::Cond, Vec<Untranslatable>), Batched> {
    let (cond, left_out) = filter.kernel_prefilter(Sizes::of(meta));
    match (cond, left_out.is_empty()) {
        (program::Cond::Const(true), true) => Err(Batched::EveryEntry),
        (program::Cond::Const(true), false) => Err(Batched::Untested(left_out)),
        (cond, _) => Ok((cond, left_out)),
    }
}

/// A dump read in batches, and why (nothing to say without a filter).
fn batched(handle: MapHandle, why: Option<Batched>) -> Decided {
    Decided {
        source: Source::Map(handle),
        report: ScanReport {
            note: why.map(|w| w.to_string()).unwrap_or_default(),
            ..ScanReport::default()
        },
        key_order: false,
    }
}

/// Why a filtered dump of a map like `meta`'s is read in batches whatever
/// its filter: the kernel, the map, the scan asked for, the cursor's walk.
fn why_not(calls: &Calls, meta: &MapMeta, req: &WalkRequest<'_>) -> Option<Batched> {
    let exact = exact_in_kernel(meta);
    if let Some(why) = calls.programs.unavailable(meta) {
        Some(why.into())
    } else if meta.per_cpu() {
        Some(Batched::PerCpu)
    } else if !exact && req.scan == pb::ScanMethod::ScanAuto {
        Some(Batched::Unlocked(meta.map_type))
    } else if !exact && !req.key_order_cursor && *req.position != Position::Start {
        Some(Batched::CursorOfBatches)
    } else {
        None
    }
}

/// The entries that `cond` takes, walked inside the kernel (on the
/// blocking pool), sorted, with their memory; why not when the program
/// cannot run, more match than a dump holds, or the memory is in use.
async fn take(
    calls: &Calls,
    dumps: &Dumps,
    handle: MapHandle,
    cond: program::Cond,
) -> Result<(MapHandle, Result<(Matches, ScanReport), Batched>), Error> {
    let meta = handle.meta().clone();
    let entry = (meta.key_size + meta.value_size).max(1) as usize;
    let max = (dumps.env.limits.pool / entry).clamp(1, meta.max_entries.max(1) as usize);
    let plan = WalkPlan::entries(cond, max as u32);
    let programs = calls.programs.clone();
    let (handle, ran) = tokio::task::spawn_blocking(move || {
        let ran = programs.run(&handle, &plan);
        (handle, ran)
    })
    .await
    .map_err(|e| Error::Internal {
        map: None,
        message: format!("a scan in the kernel panicked: {e}"),
    })?;
    let out = match ran {
        Ok(out) if out.overflowed => return Ok((handle, Err(Batched::TooManyMatches(max)))),
        Ok(out) => out,
        Err(why) => return Ok((handle, Err(why.into()))),
    };
    let bytes = out.entries.keys.len() + out.entries.values.len();
    let Some(memory) = dumps.pool.try_reserve(bytes) else {
        return Ok((handle, Err(Batched::NoMemory)));
    };
    let order = if exact_in_kernel(&meta) {
        program::index_order
    } else {
        program::byte_order
    };

    let report = ScanReport {
        visited: Some(out.visited),
        note: String::new(),
        memory: Some(memory),
    };
    Ok((
        handle,
        Ok((
            Matches::new(
                out.entries,
                meta.key_size as usize,
                meta.value_size as usize,
                order,
            ),
            report,
        )),
    ))
}
