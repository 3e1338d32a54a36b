//! StackMap: a map of counts keyed by stack ids (offcputime's, bpftrace's
//! @[kstack]) read as stacks. One aggregate walk groups its entries by
//! their roots, process and stack ids, weighing each group (a SUM or a
//! COUNT); the stack-trace map its ids refer to gives each id's frames;
//! the daemon's symbolizer names them; stacks that name the same frames
//! are one.

mod symbols;

use std::collections::{BTreeMap, BTreeSet, HashMap};

use bpfmap_kernel::{MapHandle, MapType};
use bpfmap_proto::{
    aggregate::{self as values, Op},
    typed::MapLayout,
    v1::{self as pb, LostStack},
};
use prost_types::value::Kind;

pub(crate) use symbols::Symbols;
use symbols::{BuildId, Space};

use crate::{
    aggregate::{Aggregator, Ask, prepare_as},
    calls::{Call, blocking},
    error::Error,
    model::{Caller, MapRequest, Operation, Rpc},
};

/// What a StackMap call reads with.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Stacker<'a> {
    pub(crate) aggregator: Aggregator<'a>,
    pub(crate) symbols: &'a Symbols,
}

/// Runs a StackMap call: the counts map's walk, the stack map's frames,
/// their names.
pub(crate) async fn run(
    with: Stacker<'_>,
    caller: &Caller,
    map: MapRequest,
    stack_map: Option<MapRequest>,
    req: pb::StackMapRequest,
) -> Result<pb::StackMapResponse, Error> {
    let ask = Ask {
        rpc: Rpc::StackMap,
        render: &req.render,
        scan: req.scan,
        max_aggregates: 1,
    };
    let holders = with.aggregator.calls.holders.clone();
    let (prepared, plan) = prepare_as(with.aggregator, caller, map, ask, |shown, meta| {
        let script = || holders.get().bpftrace(meta.id, &meta.name, meta.key_size);
        let plan = match meta.map_type == MapType::STACK_TRACE {
            true => None,
            false => Some(Plan::of(&req, shown, script)?),
        };
        let count = pb::AggregateMapRequest {
            aggregates: vec![pb::Aggregate {
                op: Op::Count as i32,
                field: String::new(),
            }],
            ..Default::default()
        };
        Ok((plan.as_ref().map_or(count, |p| p.request(&req)), plan))
    })
    .await?;
    let calls = with.aggregator.calls;
    if !req.addresses_only {
        let call = Call::new(Operation::Symbolize, Rpc::StackMap);
        calls.authorize(caller, call, prepared.map())?;
    }
    let Some(plan) = plan else {
        let budget = with.aggregator.dumps.env.limits.max_message_bytes;
        return itself(prepared, with.symbols, &req, budget).await;
    };
    let (stacks, stack_name) = match stack_map {
        Some(m) => {
            let call = Call::new(Operation::Aggregate, Rpc::StackMap);
            let (r, declared) = calls.resolve(caller, call, m).await?;
            let opened = calls.open(caller, call, r, &declared, false).await?;
            let name = opened.map.to_string();
            (stack_trace(opened.handle, &name)?, name)
        }
        None => {
            let id = prepared.meta().id;
            let handle = blocking(move || find_stack_map(id)).await?;
            let name = format!("id:{}", handle.meta().id);
            (handle, name)
        }
    };
    let answer = prepared.run(None).await?;
    let groups = plan.read(&answer.groups)?;
    let frames = blocking(move || Ok(raw_frames(&stacks, &groups))).await?;
    let budget = with.aggregator.dumps.env.limits.max_message_bytes;
    let (stacks, notes) = frames
        .name(with.symbols, req.addresses_only, req.limit, budget)
        .await;
    Ok(pb::StackMapResponse {
        stacks,
        stack_map: stack_name,
        ids: Some(plan.ids),
        summary: answer.summary.map(|s| pb::AggregateSummary {
            groups_total: s.groups_total,
            ..s
        }),
        notes,
    })
}

/// A stack-trace map read itself: each stack once, its kernel frames named
/// (user frames carry no process to name them with).
async fn itself(
    prepared: crate::aggregate::Prepared,
    symbols: &Symbols,
    req: &pb::StackMapRequest,
    budget: usize,
) -> Result<pb::StackMapResponse, Error> {
    let name = prepared.map().to_string();
    let started = std::time::Instant::now();
    // The walk holds the call's dump slot (in `prepared`) while it reads.
    let read = blocking(move || every_stack(prepared.handle())).await?;
    let scanned = read.len() as u64;
    let groups: Vec<Counted> = read
        .iter()
        .map(|(id, ips)| Counted {
            roots: Vec::new(),
            pid: 0,
            kernel: ips.first().is_some_and(|f| f.is_kernel()).then_some(*id),
            user: ips.first().is_some_and(|f| !f.is_kernel()).then_some(*id),
            weight: 1,
        })
        .collect();
    let mut frames = RawFrames {
        groups,
        ..Default::default()
    };
    for (id, ips) in read {
        match ips.first().is_some_and(|f| f.is_kernel()) {
            true => frames.kernel.insert(id, ips),
            false => frames.user.insert((0, id), ips),
        };
    }
    let users = frames.user.len();
    let (mut stacks, mut notes) = frames.name_each(symbols, req.addresses_only).await;
    if users > 0 && !req.addresses_only {
        notes.push(format!(
            "{users} user stacks are addresses: a stack-trace map does not say whose they are (read the counts map that names the process)"
        ));
    }
    if req.limit > 0 {
        stacks.truncate(req.limit as usize);
    }
    notes.extend(bpfmap_proto::stacks::fit(&mut stacks, budget));
    Ok(pb::StackMapResponse {
        stacks,
        stack_map: name,
        ids: None,
        summary: Some(pb::AggregateSummary {
            entries_scanned: scanned,
            entries_matched: scanned,
            groups_total: scanned,
            elapsed: prost_types::Duration::try_from(started.elapsed()).ok(),
            order_non_negative: true,
            ..Default::default()
        }),
        notes,
    })
}

/// Whether an instruction address is the kernel's (the upper half of a
/// 64-bit address space, as x86-64 and arm64 split it).
fn kernel_address(ip: u64) -> bool {
    ip >= 0xffff_8000_0000_0000
}

/// One frame as a stack-trace map keeps it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kept {
    /// An instruction address.
    Ip(u64),
    /// An offset in the binary of a build ID (a map created with
    /// BPF_F_STACK_BUILD_ID).
    File(BuildId, u64),
}

impl Kept {
    /// Whose frame it is and where in it: kernel addresses are the
    /// kernel's, others `user`'s.
    fn place(self, user: Space) -> (Space, u64) {
        match self {
            Self::Ip(ip) if kernel_address(ip) => (Space::Kernel, ip),
            Self::Ip(ip) => (user, ip),
            Self::File(id, offset) => (Space::File(id), offset),
        }
    }

    fn is_kernel(self) -> bool {
        matches!(self, Self::Ip(ip) if kernel_address(ip))
    }
}

/// BPF_F_STACK_BUILD_ID: the map keeps `struct bpf_stack_build_id`
/// frames (status, build ID, offset or address) instead of addresses.
const STACK_BUILD_ID: u32 = 1 << 5;

/// A stack-trace map value's frames, outermost first.
fn kept(value: &[u8], build_ids: bool) -> Vec<Kept> {
    let mut frames: Vec<Kept> = if build_ids {
        value
            .chunks_exact(32)
            .map_while(|f| {
                let status = i32::from_le_bytes(f[..4].try_into().expect("4 bytes"));
                let at = u64::from_le_bytes(f[24..32].try_into().expect("8 bytes"));
                match status {
                    // VALID: a build ID and an offset in its file.
                    1 => Some(Kept::File(f[4..24].try_into().expect("20 bytes"), at)),
                    // IP: the build ID could not be read, the address is.
                    2 if at != 0 => Some(Kept::Ip(at)),
                    _ => None,
                }
            })
            .collect()
    } else {
        value
            .chunks_exact(8)
            .map(|c| u64::from_le_bytes(c.try_into().expect("8 bytes")))
            .take_while(|ip| *ip != 0)
            .map(Kept::Ip)
            .collect()
    };
    frames.reverse();
    frames
}

/// Every stack of a stack-trace map: its id and frames, outermost first.
fn every_stack(handle: &MapHandle) -> Result<Vec<(i32, Vec<Kept>)>, Error> {
    let meta = handle.meta().clone();
    let map = crate::model::MapRef::Id(meta.id);
    let mut walker = bpfmap_kernel::walk::Walker::new(
        handle,
        meta.clone(),
        bpfmap_kernel::walk::Position::Start,
    )
    .map_err(|e| Error::from_walk(&map, e))?;
    let (ks, vs) = (meta.key_size as usize, meta.kernel_value_size());
    let mut out = Vec::new();
    while let Some(c) = walker
        .next_chunk(1024)
        .map_err(|e| Error::from_walk(&map, e))?
    {
        for i in 0..c.count {
            let key = &c.keys[i * ks..(i + 1) * ks];
            let id = i32::from_le_bytes(key[..4].try_into().expect("a u32 key"));
            let build_ids = meta.flags & STACK_BUILD_ID != 0;
            out.push((id, kept(&c.values[i * vs..(i + 1) * vs], build_ids)));
        }
    }
    Ok(out)
}

/// Where the ids are, what weighs, the roots: the aggregate walk's group
/// members, in order (roots, process, kernel id, user id).
#[derive(Debug)]
struct Plan {
    ids: pb::StackIds,
    by: pb::Aggregate,
    roots: Vec<String>,
    /// The id and process members a map without types holds as bytes
    /// (group keys show them in hex).
    untyped: BTreeSet<String>,
}

/// The ids of a request that does not say where they are: libbpf-tools'
/// members from the key's BTF, else bpftrace's `@[kstack]` or `@[ustack]`
/// as its script says.
fn recognized_ids(
    mut ids: pb::StackIds,
    shown: &MapLayout,
    script: impl FnOnce() -> Option<pb::BpftraceScript>,
) -> Result<pb::StackIds, Error> {
    let find = |names: &[&str]| {
        names
            .iter()
            .map(|n| format!("key.{n}"))
            .find(|p| shown.member(p).and_then(|m| m.int()).is_ok())
            .unwrap_or_default()
    };
    ids.kernel = find(&KERNEL_IDS);
    ids.user = find(&USER_IDS);
    if ids.pid.is_empty() && !ids.user.is_empty() {
        ids.pid = find(&PIDS);
    }
    if ids.kernel.is_empty()
        && ids.user.is_empty()
        && let Some(s) = script()
    {
        match s.key.split('(').next().map(str::trim) {
            Some("kstack") => ids.kernel = "key".into(),
            Some("ustack") => ids.user = "key".into(),
            _ => {}
        }
        ids.bpftrace = !(ids.kernel.is_empty() && ids.user.is_empty());
    }
    if ids.kernel.is_empty() && ids.user.is_empty() {
        return Err(Error::InvalidArgument(
            "the map's key holds no stack id this daemon recognizes (kern_stack_id, user_stack_id): say where they are, e.g. {\"ids\": {\"kernel\": \"key\", \"bpftrace\": true}} for bpftrace's @[kstack] (bpfmapctl stacks --kernel-id key --bpftrace)".into(),
        ));
    }
    Ok(ids)
}

/// What a stack weighs when the request does not say: the sum of the
/// value when it is one integer, or of its integer member named as
/// [`WEIGHTS`], else the count of entries.
fn default_weight(shown: &MapLayout) -> pb::Aggregate {
    let field = std::iter::once("value".to_owned())
        .chain(WEIGHTS.iter().map(|w| format!("value.{w}")))
        .find(|p| shown.member(p).and_then(|m| m.int()).is_ok());
    match field {
        Some(field) => pb::Aggregate {
            op: Op::Sum as i32,
            field,
        },
        None => pb::Aggregate {
            op: Op::Count as i32,
            field: String::new(),
        },
    }
}

/// Key members libbpf-tools names its stack ids and processes with.
const KERNEL_IDS: [&str; 3] = ["kern_stack_id", "kernel_stack_id", "kstack_id"];
const USER_IDS: [&str; 2] = ["user_stack_id", "ustack_id"];
const PIDS: [&str; 2] = ["tgid", "pid"];
/// Value members that hold what an entry weighs.
const WEIGHTS: [&str; 3] = ["delta", "count", "value"];

impl Plan {
    fn of(
        req: &pb::StackMapRequest,
        shown: &MapLayout,
        script: impl FnOnce() -> Option<pb::BpftraceScript>,
    ) -> Result<Self, Error> {
        let ids = match req.ids.clone().unwrap_or_default() {
            ids if ids.kernel.is_empty() && ids.user.is_empty() => {
                recognized_ids(ids, shown, script)?
            }
            ids => ids,
        };
        for (what, path) in [
            ("ids.kernel", &ids.kernel),
            ("ids.user", &ids.user),
            ("ids.pid", &ids.pid),
        ] {
            if !path.is_empty() {
                shown
                    .member(path)
                    .and_then(|m| m.int())
                    .map_err(|e| Error::InvalidArgument(format!("{what}: {e}")))?;
            }
        }
        let by = req.by.clone().unwrap_or_else(|| default_weight(shown));
        let untyped = [&ids.kernel, &ids.user, &ids.pid]
            .into_iter()
            .filter(|p| shown.member(p).is_ok_and(|m| !m.typed()))
            .cloned()
            .collect();
        Ok(Self {
            ids,
            by,
            roots: req.roots.clone(),
            untyped,
        })
    }

    /// The group members, in order: the roots, the process, the ids.
    fn group_by(&self) -> Vec<String> {
        let mut g = self.roots.clone();
        for p in [&self.ids.pid, &self.ids.kernel, &self.ids.user] {
            if !p.is_empty() && !g.contains(p) {
                g.push(p.clone());
            }
        }
        g
    }

    fn request(&self, req: &pb::StackMapRequest) -> pb::AggregateMapRequest {
        pb::AggregateMapRequest {
            map: req.map.clone(),
            filter: req.filter.clone(),
            group_by: self.group_by(),
            aggregates: vec![self.by.clone()],
            per_cpu: pb::PerCpu::Sum as i32,
            render: req.render.clone(),
            scan: req.scan,
            ..Default::default()
        }
    }

    /// Each group's roots, process, ids and weight.
    fn read(&self, groups: &[pb::Group]) -> Result<Vec<Counted>, Error> {
        groups
            .iter()
            .map(|g| {
                let key = g.key.clone().unwrap_or_default().fields;
                let int = |path: &str| -> Option<i64> {
                    (!path.is_empty())
                        .then(|| {
                            let hex = self.untyped.contains(path);
                            key.get(path).and_then(|v| integer(v, hex))
                        })
                        .flatten()
                };
                let (mut kernel, mut user, mut pid) = (
                    int(&self.ids.kernel),
                    int(&self.ids.user),
                    int(&self.ids.pid),
                );
                if self.ids.bpftrace {
                    // The low 32 bits the id, a ustack's high 32 the process.
                    if let Some(u) = user {
                        pid = pid.or(Some(u >> 32 & 0xffff_ffff));
                        user = Some(i64::from(u as i32));
                    }
                    kernel = kernel.map(|k| i64::from(k as i32));
                }
                let weight = g
                    .values
                    .first()
                    .map(values::parse)
                    .transpose()
                    .map_err(|e| Error::Internal {
                        map: None,
                        message: format!("a stack's weight: {e}"),
                    })?
                    .flatten()
                    .unwrap_or(0);
                Ok(Counted {
                    roots: self
                        .roots
                        .iter()
                        .map(|r| key.get(r).map(text).unwrap_or_default())
                        .collect(),
                    pid: pid.and_then(|p| u32::try_from(p).ok()).unwrap_or(0),
                    kernel: kernel.and_then(|k| i32::try_from(k).ok()),
                    user: user.and_then(|u| i32::try_from(u).ok()),
                    weight,
                })
            })
            .collect()
    }
}

/// A group of the walk: what its stack is made of, and its weight.
#[derive(Debug, Clone)]
struct Counted {
    roots: Vec<String>,
    pid: u32,
    kernel: Option<i32>,
    user: Option<i32>,
    weight: i128,
}

/// An integer as a group key shows it: a number, a decimal string, or
/// (`hex`) the hex of an untyped member's bytes, little-endian.
fn integer(v: &prost_types::Value, hex: bool) -> Option<i64> {
    match &v.kind {
        Some(Kind::NumberValue(n)) if n.fract() == 0.0 => Some(*n as i64),
        // A u64 past 2^63 keeps its bits (bpftrace's ids of lost stacks).
        Some(Kind::StringValue(s)) if !hex => s.parse::<i128>().ok().map(|v| v as i64),
        Some(Kind::StringValue(s)) => {
            let hex = s.trim_start_matches("0x").as_bytes();
            if hex.is_empty() || hex.len() > 16 || hex.len() % 2 != 0 {
                return None;
            }
            let mut le = [0u8; 8];
            faster_hex::hex_decode(hex, &mut le[..hex.len() / 2]).ok()?;
            Some(i64::from_le_bytes(le))
        }
        _ => None,
    }
}

/// A root member's value as text.
fn text(v: &prost_types::Value) -> String {
    match &v.kind {
        Some(Kind::StringValue(s)) => s.clone(),
        Some(Kind::NumberValue(n)) if n.fract() == 0.0 => format!("{}", *n as i64),
        Some(Kind::NumberValue(n)) => n.to_string(),
        Some(Kind::BoolValue(b)) => b.to_string(),
        _ => String::new(),
    }
}

/// A stack-trace map, or FAILED_PRECONDITION saying what it is.
fn stack_trace(handle: MapHandle, name: &str) -> Result<MapHandle, Error> {
    if handle.meta().map_type != MapType::STACK_TRACE {
        return Err(Error::NoStackMap(format!(
            "stack_map {name} is not a stack-trace map (BPF_MAP_TYPE_STACK_TRACE)"
        )));
    }
    Ok(handle)
}

/// The one stack-trace map that the programs using map `id` use too.
fn find_stack_map(id: u32) -> Result<MapHandle, Error> {
    let programs = bpfmap_kernel::holders::programs().map_err(|e| {
        Error::NoStackMap(format!(
            "the stack-trace map of map id:{id} is found through its programs, which cannot be listed ({e}): name it in stack_map"
        ))
    })?;
    let near: BTreeSet<u32> = programs
        .iter()
        .filter(|p| p.map_ids.contains(&id))
        .flat_map(|p| p.map_ids.iter().copied())
        .filter(|m| *m != id)
        .collect();
    let stacks: Vec<MapHandle> = near
        .into_iter()
        .filter_map(|m| MapHandle::open_id(m).ok())
        .filter(|h| h.meta().map_type == MapType::STACK_TRACE)
        .collect();
    match <[MapHandle; 1]>::try_from(stacks) {
        Ok([one]) => Ok(one),
        Err(v) if v.is_empty() => Err(Error::NoStackMap(format!(
            "no program that uses map id:{id} uses a stack-trace map: name the stack map in stack_map"
        ))),
        Err(v) => Err(Error::NoStackMap(format!(
            "the programs of map id:{id} use {} stack-trace maps ({}): name one in stack_map",
            v.len(),
            v.iter()
                .map(|h| format!("id:{}", h.meta().id))
                .collect::<Vec<_>>()
                .join(", ")
        ))),
    }
}

/// The frames of every group's stacks, as addresses, outermost first.
#[derive(Debug, Default)]
struct RawFrames {
    groups: Vec<Counted>,
    kernel: HashMap<i32, Vec<Kept>>,
    user: HashMap<(u32, i32), Vec<Kept>>,
}

fn raw_frames(stacks: &MapHandle, groups: &[Counted]) -> RawFrames {
    let mut out = RawFrames {
        groups: groups.to_vec(),
        ..Default::default()
    };
    let build_ids = stacks.meta().flags & STACK_BUILD_ID != 0;
    let read = |id: i32| -> Option<Vec<Kept>> {
        let value = stacks.lookup_value(&id.to_le_bytes()).ok()??;
        Some(kept(&value, build_ids))
    };
    for g in groups {
        if let Some(k) = g.kernel.filter(|k| *k >= 0)
            && !out.kernel.contains_key(&k)
            && let Some(ips) = read(k)
        {
            out.kernel.insert(k, ips);
        }
        if let Some(u) = g.user.filter(|u| *u >= 0)
            && !out.user.contains_key(&(g.pid, u))
            && let Some(ips) = read(u)
        {
            out.user.insert((g.pid, u), ips);
        }
    }
    out
}

/// Why a stack id names no frames.
fn lost(id: Option<i32>, found: bool) -> LostStack {
    match id {
        None => LostStack::None,
        Some(-14 | -1) => LostStack::NoStack,
        Some(-17) => LostStack::Eexist,
        Some(i) if i < 0 || !found => LostStack::Other,
        Some(_) => LostStack::None,
    }
}

impl RawFrames {
    /// The stacks, named (unless `addresses_only`), merged by the frames
    /// they name (as `bpfmap_proto::stacks::merge` merges them, without
    /// making every group's stack first), the heaviest first, at most
    /// `limit` (0: all) and those that fit in a message of
    /// `max_message_bytes`; and why some frames have no name, or some
    /// stacks were left out.
    async fn name(
        self,
        symbols: &Symbols,
        addresses_only: bool,
        limit: u32,
        max_message_bytes: usize,
    ) -> (Vec<pb::Stack>, Vec<String>) {
        let (named, mut notes) = self.named_frames(symbols, addresses_only).await;
        // Every string of an identity, interned: roots, lost kinds, frames.
        let mut interned = Interned::default();
        let frame_ids: HashMap<(Space, u64), u32> = named
            .iter()
            .map(|(k, f)| (*k, interned.id(&bpfmap_proto::stacks::frame_identity(f))))
            .collect();
        let mut merged: HashMap<Vec<u32>, (usize, i128)> = HashMap::new();
        for (i, g) in self.groups.iter().enumerate() {
            let kernel_ips = g.kernel.and_then(|k| self.kernel.get(&k));
            let user_ips = g.user.and_then(|u| self.user.get(&(g.pid, u)));
            let mut key: Vec<u32> = g.roots.iter().map(|r| interned.id(r)).collect();
            let frames = |interned: &mut Interned,
                          key: &mut Vec<u32>,
                          user: Space,
                          ips: Option<&Vec<Kept>>| {
                for f in ips.into_iter().flatten() {
                    let (space, at) = f.place(user);
                    key.push(match frame_ids.get(&(space, at)) {
                        Some(id) => *id,
                        None => interned.id(&format!("{at:#x}")),
                    });
                }
            };
            key.push(interned.id(&format!("u{}", lost(g.user, user_ips.is_some()) as i32)));
            frames(&mut interned, &mut key, Space::Process(g.pid), user_ips);
            key.push(interned.id(&format!("k{}", lost(g.kernel, kernel_ips.is_some()) as i32)));
            frames(&mut interned, &mut key, Space::Kernel, kernel_ips);
            let e = merged.entry(key).or_insert((i, 0));
            e.1 = e.1.saturating_add(g.weight);
        }
        // Ids ranked by their strings: keys compare as identities do.
        let rank = interned.ranks();
        let mut order: Vec<(Vec<u32>, usize, i128)> = merged
            .into_iter()
            .map(|(k, (i, w))| (k.iter().map(|id| rank[*id as usize]).collect(), i, w))
            .collect();
        order.sort_by(|a, b| b.2.cmp(&a.2).then_with(|| a.0.cmp(&b.0)));
        if limit > 0 {
            order.truncate(limit as usize);
        }
        // Made heaviest first, until one would not fit.
        let mut fitting = bpfmap_proto::stacks::Fitting::new(max_message_bytes);
        let mut stacks = Vec::new();
        for (_, i, weight) in &order {
            let s = pb::Stack {
                value: weight.to_string(),
                stack_id: -1,
                ..self.stack(&self.groups[*i], &named)
            };
            if !fitting.take(&s) {
                notes.push(fitting.note(stacks.len(), order.len()));
                break;
            }
            stacks.push(s);
        }
        (stacks, notes)
    }

    /// Each group's stack, named (unless `addresses_only`), with its id
    /// (the kernel's, else the user's); and why some frames have no name.
    async fn name_each(
        self,
        symbols: &Symbols,
        addresses_only: bool,
    ) -> (Vec<pb::Stack>, Vec<String>) {
        let (named, notes) = self.named_frames(symbols, addresses_only).await;
        let stacks = self.groups.iter().map(|g| self.stack(g, &named)).collect();
        (stacks, notes)
    }

    /// Group `g`'s stack, its frames as `named` names them.
    fn stack(&self, g: &Counted, named: &HashMap<(Space, u64), pb::Frame>) -> pb::Stack {
        let frames = |user: Space, ips: Option<&Vec<Kept>>| -> Vec<pb::Frame> {
            ips.map(|ips| {
                ips.iter()
                    .map(|f| {
                        let (space, at) = f.place(user);
                        named.get(&(space, at)).cloned().unwrap_or(pb::Frame {
                            address: at,
                            ..Default::default()
                        })
                    })
                    .collect()
            })
            .unwrap_or_default()
        };
        let kernel_ips = g.kernel.and_then(|k| self.kernel.get(&k));
        let user_ips = g.user.and_then(|u| self.user.get(&(g.pid, u)));
        pb::Stack {
            roots: g.roots.clone(),
            user: frames(Space::Process(g.pid), user_ips),
            kernel: frames(Space::Kernel, kernel_ips),
            value: g.weight.to_string(),
            user_lost: lost(g.user, user_ips.is_some()) as i32,
            kernel_lost: lost(g.kernel, kernel_ips.is_some()) as i32,
            pid: g.pid,
            stack_id: g.kernel.or(g.user).map_or(-1, i64::from),
        }
    }

    /// Every distinct frame, named (unless `addresses_only`) once per
    /// space; and why some have no name.
    async fn named_frames(
        &self,
        symbols: &Symbols,
        addresses_only: bool,
    ) -> (HashMap<(Space, u64), pb::Frame>, Vec<String>) {
        let mut notes = BTreeSet::new();
        let mut named: HashMap<(Space, u64), pb::Frame> = HashMap::new();
        let mut spaces: BTreeMap<Space, BTreeSet<u64>> = BTreeMap::new();
        for ips in self.kernel.values() {
            for (space, at) in ips.iter().map(|f| f.place(Space::Kernel)) {
                spaces.entry(space).or_default().insert(at);
            }
        }
        for ((pid, _), ips) in &self.user {
            for (space, at) in ips.iter().map(|f| f.place(Space::Process(*pid))) {
                spaces.entry(space).or_default().insert(at);
            }
        }
        let (mut exited, mut remembered) = (Vec::new(), Vec::new());
        for (space, addrs) in spaces {
            let addrs: Vec<u64> = addrs.into_iter().collect();
            // Process 0: user stacks of a stack-trace map read itself.
            let frames = if addresses_only || space == Space::Process(0) {
                symbols::unnamed(&addrs, None)
            } else {
                symbols.name(space, addrs.clone()).await
            };
            match (frames.note, space) {
                (Some(symbols::Note::Exited), Space::Process(pid)) => exited.push(pid),
                (Some(symbols::Note::Remembered), Space::Process(pid)) => remembered.push(pid),
                (Some(note), _) => {
                    notes.insert(note.to_string());
                }
                (None, _) => {}
            }
            for (a, f) in addrs.into_iter().zip(frames.frames) {
                named.insert((space, a), f);
            }
        }
        if !exited.is_empty() {
            notes.insert(exited_note(&exited));
        }
        if !remembered.is_empty() {
            notes.insert(format!(
                "user frames of {} were named from the binaries they mapped when the daemon last named their frames: they exited since ({})",
                processes(remembered.len()),
                pid_list(&remembered)
            ));
        }
        (named, notes.into_iter().collect())
    }
}

/// Strings interned to ids.
#[derive(Debug, Default)]
struct Interned {
    ids: HashMap<String, u32>,
    strings: Vec<String>,
}

impl Interned {
    fn id(&mut self, s: &str) -> u32 {
        if let Some(id) = self.ids.get(s) {
            return *id;
        }
        let id = self.strings.len() as u32;
        self.ids.insert(s.to_owned(), id);
        self.strings.push(s.to_owned());
        id
    }

    /// Each id's rank among the strings in order.
    fn ranks(&self) -> Vec<u32> {
        let mut order: Vec<u32> = (0..self.strings.len() as u32).collect();
        order.sort_by(|a, b| self.strings[*a as usize].cmp(&self.strings[*b as usize]));
        let mut rank = vec![0; order.len()];
        for (r, id) in order.into_iter().enumerate() {
            rank[id as usize] = r as u32;
        }
        rank
    }
}

/// The processes whose user frames are addresses because they exited
/// before they were named (the first ten named).
fn exited_note(pids: &[u32]) -> String {
    format!(
        "user frames of {} are addresses: they exited before their stacks were read ({})",
        processes(pids.len()),
        pid_list(pids)
    )
}

/// "1 process", "3 processes".
fn processes(n: usize) -> String {
    format!("{n} process{}", if n == 1 { "" } else { "es" })
}

/// The first ten pids, and how many more.
fn pid_list(pids: &[u32]) -> String {
    let shown: Vec<String> = pids.iter().take(10).map(u32::to_string).collect();
    match pids.len() {
        n if n > 10 => format!("{} and {} more", shown.join(", "), n - 10),
        _ => shown.join(", "),
    }
}
