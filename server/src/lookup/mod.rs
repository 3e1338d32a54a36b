//! Lookup: keys looked up in a map (given as bytes, or as JSON through the
//! key's type), the response bounded before anything is read, the values
//! decoded as the request asks.

use std::sync::Arc;

use bpfmap_kernel::{MapHandle, MapMeta};
use bpfmap_proto::{typed::MapLayout, v1 as pb};

use crate::{
    calls::{Call, Calls, blocking},
    dump::{DumpLimits, MAX_CHUNK_BYTES, POOL_WAIT},
    error::Error,
    limits::{Budget, Held, LookupSlots, Trimmer},
    maps::{Decoder, Decoding, KnownTypes},
    model::{Caller, MapRef, MapRequest, Operation, Rpc},
    wire::{self, IntoProto as _, LookupOutcome},
};

/// Most keys accepted in one Lookup call.
pub(crate) const MAX_LOOKUP_KEYS: usize = 4096;
/// Upper bound on a Lookup response, as for a dump chunk (below grpcurl's
/// 4 MiB default), unless one entry alone is larger.
pub(crate) const MAX_LOOKUP_RESPONSE: usize = MAX_CHUNK_BYTES;

/// What lookups share beyond what every call does.
#[derive(Debug, Clone)]
pub(crate) struct Lookups {
    /// Lookups at once.
    pub(crate) slots: Arc<LookupSlots>,
    /// The memory pool responses are reserved from.
    pub(crate) pool: Budget,
    /// Calls in flight (free memory is handed back when none are).
    pub(crate) trimmer: Trimmer,
    /// The bounds of messages and of the pool.
    pub(crate) limits: DumpLimits,
}

/// The results, and what the response keeps until it is sent: its memory
/// and its lookup slot.
pub(crate) async fn run(
    calls: &Calls,
    lookups: &Lookups,
    caller: &Caller,
    map: MapRequest,
    mut req: pb::LookupRequest,
) -> Result<(Vec<pb::LookupResult>, Held), Error> {
    calls.accepting()?;
    let call = Call::new(Operation::Lookup, Rpc::Lookup);
    let (map, declared) = calls.resolve(caller, call, map).await?;
    check_key_count(&req)?;
    let slot = lookups.slots.try_acquire()?;
    let trim = lookups.trimmer.enter();
    let decodes = !req.raw || req.per_cpu != pb::PerCpu::Each as i32;
    let with_types = decodes || !req.json_keys.is_empty();
    let opened = calls.open(caller, call, map, &declared, with_types).await?;
    let layout = calls.layout(&opened, &req.render, !req.raw || !req.json_keys.is_empty())?;
    let (map, handle, types) = (opened.map, opened.handle, opened.types);
    let meta = handle.meta();
    let decoder = Decoder::for_request(
        &map,
        meta,
        &types,
        &layout,
        Decoding {
            raw: req.raw,
            per_cpu: req.per_cpu,
            packed: false,
        },
    )?;
    encode_json_keys(&map, &types, &layout, &mut req)?;
    for (i, k) in req.keys.iter().enumerate() {
        Error::check_key_size(&map, meta, Some(i), k)?;
    }
    let bytes = response_bytes(
        &lookups.limits,
        &map,
        meta,
        decoder.as_ref(),
        req.keys.len(),
    )?;
    let memory = tokio::time::timeout(POOL_WAIT, lookups.pool.reserve(bytes, bytes))
        .await
        .map_err(|_| {
            Error::ResourceExhausted(
                "the server's memory for responses is in use (limits.max_queued_bytes); retry later"
                    .into(),
            )
        })?;
    let results = blocking(move || look_up(&map, &handle, decoder.as_ref(), req.keys)).await?;
    Ok((results, Held::new(slot, memory, trim)))
}

/// The size of a Lookup response of `keys` keys, bounded before anything
/// is read: every value has the map's fixed size.
fn response_bytes(
    limits: &DumpLimits,
    map: &MapRef,
    meta: &MapMeta,
    decoder: Option<&Decoder>,
    keys: usize,
) -> Result<usize, Error> {
    let per_key = wire::entry_bytes(meta, pb::Layout::Entries, decoder).max(wire::entry_memory(
        meta,
        pb::Layout::Entries,
        decoder,
    ));
    let max = limits.max_message_bytes.min(limits.pool);
    if per_key > max {
        return Err(Error::EntryTooLarge {
            map: map.clone(),
            bytes: per_key,
            why: format!(
                "more than the largest Lookup response this server builds ({max} bytes: limits.max_message_bytes, and a quarter of limits.max_queued_bytes)"
            ),
        });
    }
    let fit = (MAX_LOOKUP_RESPONSE / per_key).max(1);
    let bytes = keys * per_key;
    if keys > fit {
        return Err(Error::ResponseTooLarge {
            map: map.clone(),
            keys,
            bytes,
            fit,
        });
    }
    Ok(bytes)
}

fn check_key_count(req: &pb::LookupRequest) -> Result<(), Error> {
    let count = req.keys.len() + req.json_keys.len();
    if count == 0 {
        return Err(Error::InvalidArgument(
            "no keys to look up; set keys (bytes) or json_keys".into(),
        ));
    }
    if count > MAX_LOOKUP_KEYS {
        return Err(Error::InvalidArgument(format!(
            "{count} keys in one Lookup; at most {MAX_LOOKUP_KEYS} are allowed, split the request"
        )));
    }
    Ok(())
}

/// Adds the request's JSON keys, encoded through the key's type, to its
/// byte keys.
fn encode_json_keys(
    map: &MapRef,
    types: &KnownTypes,
    layout: &MapLayout,
    req: &mut pb::LookupRequest,
) -> Result<(), Error> {
    if req.json_keys.is_empty() {
        return Ok(());
    }
    let layout = types.key_layout(map, layout)?;
    for (i, k) in req.json_keys.iter().enumerate() {
        let key = layout.encode(k, "key").map_err(|e| {
            Error::InvalidArgument(format!("json_keys[{i}] does not fit map {map}: {e}"))
        })?;
        req.keys.push(key);
    }
    Ok(())
}

/// Looks every key up (blocking).
fn look_up(
    map: &MapRef,
    handle: &MapHandle,
    decoder: Option<&Decoder>,
    keys: Vec<Vec<u8>>,
) -> Result<Vec<pb::LookupResult>, Error> {
    let meta = handle.meta();
    keys.into_iter()
        .map(|key| {
            let value = handle
                .lookup_value(&key)
                .map_err(|e| Error::from_lookup(map, e))?;
            Ok(LookupOutcome {
                meta,
                key,
                value,
                decoder,
            }
            .into_proto())
        })
        .collect()
}
