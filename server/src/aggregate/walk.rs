//! The walk of an AggregateMap call: the whole map read in chunks on the
//! blocking pool, the matching entries grouped as they are read, stopped
//! by the client going away, a shutdown, or a filter that costs too much.

use std::sync::Arc;

use std::sync::atomic::Ordering::Relaxed;

use bpfmap_kernel::{
    MapHandle,
    program::{AggOp, GroupTable, WalkOutput, WalkPlan},
    walk::Position,
};
use bpfmap_proto::v1 as pb;
use tokio::sync::watch;

use crate::{
    error::Error,
    model::MapRef,
    programs::{Unavailable, WalkPrograms},
    query::{CostMeter, EntryRef, Filter, Spec, Table, scan::Untranslatable},
    watch::Scanner,
};

/// Sets its flag when dropped: the call's future was dropped (the client
/// went away), and the walk on the blocking pool stops at its next chunk.
pub(super) struct CancelOnDrop(pub(super) Arc<std::sync::atomic::AtomicBool>);

impl Drop for CancelOnDrop {
    fn drop(&mut self) {
        self.0.store(true, std::sync::atomic::Ordering::Relaxed);
    }
}

/// The walk of an AggregateMap call.
pub(super) struct AggregateWalk {
    pub(super) map: MapRef,
    pub(super) handle: MapHandle,
    pub(super) spec: Spec,
    pub(super) filter: Option<Filter>,
    pub(super) stop: watch::Receiver<bool>,
    pub(super) cancelled: Arc<std::sync::atomic::AtomicBool>,
    pub(super) max_cost: u32,
    /// Whether and how the map may be walked inside the kernel.
    pub(super) kernel: KernelPlan,
}

/// Whether an aggregate's walk may run inside the kernel.
pub(super) enum KernelPlan {
    /// The call asked for batched reads (SCAN_BATCHED).
    Off,
    /// The program's plan, and the daemon's programs.
    Plan(InKernel),
    /// Why it cannot.
    Cannot(NotInKernel),
}

/// A walk inside the kernel: the daemon's programs, the plan, and the
/// call's bound on groups (`limits.max_groups`; the plan's table may hold
/// fewer).
pub(super) struct InKernel {
    pub(super) programs: Arc<WalkPrograms>,
    pub(super) plan: WalkPlan,
    pub(super) limit: usize,
}

/// Why an aggregate's walk does not run inside the kernel.
#[derive(Debug, thiserror::Error)]
pub(super) enum NotInKernel {
    /// No walk program runs for the map.
    #[error(transparent)]
    Program(#[from] Unavailable),
    /// The question is not one a walk program computes.
    #[error(transparent)]
    Question(#[from] Untranslatable),
    /// The walk found more groups than its hash map of groups holds with
    /// SCAN_AUTO, where the batched read costs less.
    #[error(
        "more than {0} groups: beyond that a walk inside the kernel costs more than the batched read (SCAN_KERNEL walks inside the kernel still)"
    )]
    ManyGroups(u32),
    /// The walk found more groups than the map holds entries (entries
    /// replaced while it ran).
    #[error("the walk inside the kernel found more groups than the map holds entries")]
    MoreGroupsThanEntries,
}

/// Entries read per kernel call of an aggregate.
const AGGREGATE_READ: u32 = 1024;

impl AggregateWalk {
    /// Groups the matching entries (blocking): by a program inside the
    /// kernel when the plan allows it, else reading the whole map.
    pub(super) fn run(self) -> Result<(Vec<pb::Group>, pb::AggregateSummary), Error> {
        let note = match &self.kernel {
            KernelPlan::Off => String::new(),
            KernelPlan::Cannot(why) => why.to_string(),
            KernelPlan::Plan(k) => {
                self.check()?;
                match k.programs.run(&self.handle, &k.plan) {
                    // Its table filled before the call's bound: the walk
                    // stopped short.
                    Ok(out) if out.overflowed && (k.plan.max_groups as usize) < k.limit => {
                        k.programs.stats.fallbacks.fetch_add(1, Relaxed);
                        let why = match k.plan.table() {
                            GroupTable::Hash if k.plan.max_groups <= super::KERNEL_HASH_GROUPS => {
                                NotInKernel::ManyGroups(k.plan.max_groups)
                            }
                            _ => NotInKernel::MoreGroupsThanEntries,
                        };
                        why.to_string()
                    }
                    Ok(out) => return self.kernel_groups(out, &k.plan),
                    Err(why) => why.to_string(),
                }
            }
        };
        let (groups, summary) = self.read()?;
        Ok((
            groups,
            pb::AggregateSummary {
                scan_note: note,
                ..summary
            },
        ))
    }

    /// The groups a walk inside the kernel found.
    fn kernel_groups(
        &self,
        out: WalkOutput,
        plan: &WalkPlan,
    ) -> Result<(Vec<pb::Group>, pb::AggregateSummary), Error> {
        let mut table = self.spec.table();
        let (visited, matched) = if plan.counts_only() {
            if out.visited > 0 {
                let values = vec![None; self.spec.aggregates()];
                table.add_group(Vec::new(), out.visited, values);
            }
            (out.visited, out.visited)
        } else {
            for g in out.groups {
                let values = plan
                    .aggs
                    .iter()
                    .zip(&g.words)
                    .map(|(a, w)| (*a != AggOp::Count).then(|| a.value(g.count, *w)))
                    .collect();
                if !table.add_group(g.key, g.count, values) {
                    break;
                }
            }
            (out.visited, out.matched)
        };
        if out.overflowed {
            table.overflow(plan.max_groups as usize + 1);
        }
        let (groups, summary) = self.finish(table, visited, matched)?;
        Ok((
            groups,
            pb::AggregateSummary {
                scanned_in_kernel: true,
                ..summary
            },
        ))
    }

    /// Reads the whole map in batches, grouping the matching entries.
    fn read(&self) -> Result<(Vec<pb::Group>, pb::AggregateSummary), Error> {
        let meta = self.handle.meta().clone();
        let stride = if meta.per_cpu() { meta.cpu_stride() } else { 0 };
        let (ks, vs) = (meta.key_size as usize, meta.kernel_value_size());
        let mut walker = bpfmap_kernel::walk::Walker::new(&self.handle, meta, Position::Start)
            .map_err(|e| Error::from_walk(&self.map, e))?;
        let mut table = self.spec.table();
        let mut meter = CostMeter::new(self.max_cost);
        let (mut scanned, mut matched) = (0u64, 0u64);
        'walk: loop {
            self.check()?;
            let read_at = std::time::Instant::now();
            let Some(c) = walker
                .next_chunk(AGGREGATE_READ)
                .map_err(|e| Error::from_walk(&self.map, e))?
            else {
                break;
            };
            let eval_at = std::time::Instant::now();
            let reading = eval_at - read_at;
            for i in 0..c.count {
                let e = EntryRef {
                    key: &c.keys[i * ks..(i + 1) * ks],
                    value: &c.values[i * vs..(i + 1) * vs],
                    stride,
                };
                scanned += 1;
                if self.filter.as_ref().is_some_and(|f| !f.matches(&e)) {
                    continue;
                }
                matched += 1;
                if !table.add(&e) {
                    break 'walk;
                }
            }
            // What the filter costs (with the grouping of what it let
            // through); grouping alone is bounded by limits.max_groups.
            if self.filter.is_some() {
                meter.add(reading, eval_at.elapsed())?;
            }
            if *walker.position() == Position::End {
                break;
            }
        }
        self.finish(table, scanned, matched)
    }

    /// Groups the entries of a watch's last scan of the map instead of
    /// walking it (blocking).
    pub(super) fn run_over(
        self,
        scanner: &Scanner,
    ) -> Result<(Vec<pb::Group>, pb::AggregateSummary), Error> {
        self.check()?;
        let meta = self.handle.meta();
        let stride = if meta.per_cpu() { meta.cpu_stride() } else { 0 };
        let mut table = self.spec.table();
        let mut matched = 0u64;
        let scanned = scanner.each_entry(|key, value| {
            let e = EntryRef { key, value, stride };
            if self.filter.as_ref().is_some_and(|f| !f.matches(&e)) {
                return true;
            }
            matched += 1;
            table.add(&e)
        });
        self.finish(table, scanned, matched)
    }

    /// Stops a walk the daemon is shutting down or the client left.
    fn check(&self) -> Result<(), Error> {
        if *self.stop.borrow() {
            return Err(Error::ShuttingDown);
        }
        if self.cancelled.load(std::sync::atomic::Ordering::Relaxed) {
            return Err(Error::Cancelled);
        }
        Ok(())
    }

    /// The groups of `table`, and the summary of a walk that read
    /// `scanned` entries and took `matched`.
    fn finish(
        &self,
        table: Table<'_>,
        scanned: u64,
        matched: u64,
    ) -> Result<(Vec<pb::Group>, pb::AggregateSummary), Error> {
        let order_non_negative = self.spec.non_negative_order();
        let (groups, total) = table
            .finish()
            .map_err(|e| Error::ResourceExhausted(e.to_string()))?;
        Ok((
            groups,
            pb::AggregateSummary {
                entries_scanned: scanned,
                entries_matched: matched,
                groups_total: total,
                elapsed: None,
                order_non_negative,
                scanned_in_kernel: false,
                scan_note: String::new(),
            },
        ))
    }
}
