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
    query::{Filter, Query, scan::Sizes},
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

/// Decides how a dump of `handle`'s map reads it, and runs the walk inside
/// the kernel when it does: `key_order_cursor` when the request's cursor
/// comes from a dump in key-byte order.
pub(super) async fn decide(
    (calls, dumps): (&Calls, &Dumps),
    (map, handle): (&MapRef, MapHandle),
    (query, scan): (Option<&Query>, pb::ScanMethod),
    (position, key_order_cursor): (&Position, bool),
) -> Result<Decided, Error> {
    let meta = handle.meta().clone();
    let filter = query
        .and_then(|q| q.filter.as_ref())
        .filter(|_| scan != pb::ScanMethod::ScanBatched);
    let cond = match filter {
        None => Err(String::new()),
        Some(f) => match why_not(calls, &meta, scan, (position, key_order_cursor)) {
            Some(why) => Err(why),
            None => prefilter(f, &meta),
        },
    };
    let (cond, left_out) = match cond {
        Ok(c) => c,
        Err(why) => return Ok(batched(handle, why)),
    };
    let (handle, taken) = take(calls, dumps, handle, cond).await?;
    let (matches, report) = match taken {
        Ok(taken) => taken,
        Err(why) if key_order_cursor => {
            return Err(Error::KernelWalkUnavailable(format!(
                "this cursor resumes a dump of {map} walked inside the kernel, and that walk cannot run now ({why}); restart the dump"
            )));
        }
        Err(why) => return Ok(batched(handle, why)),
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
fn prefilter(filter: &Filter, meta: &MapMeta) -> Result<(program::Cond, Vec<String>), String> {
    let sizes = Sizes {
        key: meta.key_size as usize,
        value: meta.value_size as usize,
    };
    let (cond, left_out) = filter.kernel_prefilter(sizes);
    match (cond, left_out.is_empty()) {
        (program::Cond::Const(true), true) => Err("the filter takes every entry".into()),
        (program::Cond::Const(true), false) => Err(left_out.join("; ")),
        (cond, _) => Ok((cond, left_out)),
    }
}

/// A dump read in batches, and why.
fn batched(handle: MapHandle, note: String) -> Decided {
    Decided {
        source: Source::Map(handle),
        report: ScanReport {
            note,
            ..ScanReport::default()
        },
        key_order: false,
    }
}

/// Why a filtered dump of a map like `meta`'s is read in batches whatever
/// its filter: the kernel, the map, the scan asked for, the cursor's walk.
fn why_not(
    calls: &Calls,
    meta: &MapMeta,
    scan: pb::ScanMethod,
    (position, key_order_cursor): (&Position, bool),
) -> Option<String> {
    let exact = exact_in_kernel(meta);
    if let Some(why) = calls.programs.unavailable(meta) {
        Some(why)
    } else if meta.per_cpu() {
        Some("a scan in the kernel sees one CPU's value of a per-CPU map".into())
    } else if !exact && scan == pb::ScanMethod::ScanAuto {
        Some(format!(
            "a walk inside the kernel can miss an entry of a {} map replaced while it runs, which a dump's cursors rule out; SCAN_KERNEL accepts that",
            meta.map_type
        ))
    } else if !exact && !key_order_cursor && *position != Position::Start {
        Some("the cursor comes from a dump read in batches".into())
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
) -> Result<(MapHandle, Result<(Matches, ScanReport), String>), Error> {
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
        Ok(out) if out.overflowed => {
            let why = format!(
                "more than {max} entries match, more than a dump walked inside the kernel holds (a quarter of limits.max_queued_bytes)"
            );
            return Ok((handle, Err(why)));
        }
        Ok(out) => out,
        Err(why) => return Ok((handle, Err(why))),
    };
    let bytes = out.entries.keys.len() + out.entries.values.len();
    let Some(memory) = dumps.pool.try_reserve(bytes) else {
        return Ok((
            handle,
            Err("the server's memory for dumps is in use".into()),
        ));
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
