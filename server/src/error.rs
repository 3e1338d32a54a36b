//! What a call can fail with, in the daemon's terms: the message a person
//! reads, and the facts behind it. How each error reaches a gRPC client
//! (its status code and stable reason) is `rpc::status`'s.

use bpfmap_kernel::{LookupError, MapType, OpenError, SyscallError, walk::WalkError};

use crate::{
    cursor::CursorError,
    model::{Identity, InvalidPath, MapName, MapRef, Operation},
    query::{FilterTooCostly, QueryError},
};

/// Everything a call can fail with.
#[derive(Debug, thiserror::Error)]
pub(crate) enum Error {
    /// A malformed request; the message says what to fix.
    #[error("{0}")]
    InvalidArgument(String),
    /// A map path that names no map.
    #[error(transparent)]
    InvalidPath(#[from] InvalidPath),
    /// A filter or fields that cannot be used on the map.
    #[error(transparent)]
    Query(#[from] QueryError),
    /// A filter that costs too much against the walk it filters.
    #[error(transparent)]
    FilterTooCostly(#[from] FilterTooCostly),
    /// Nothing at that path or id.
    #[error("map {0} not found{hint}", hint = name_hint(.0))]
    MapNotFound(MapRef),
    /// No map the caller may reach has that name (and owner).
    #[error("no map {what}{close}")]
    NameNotFound {
        /// What was looked for ("named \"hist\"", "named \"start\" held by \"x\"").
        what: String,
        /// The close names, with where they are ("; close: ..."), or empty.
        close: String,
    },
    /// Several maps have the name; the message names each.
    #[error(
        "{name} matches {count} maps: {candidates}; choose one with NAME@OWNER (a program name, process name or pid), or by path or id"
    )]
    NameAmbiguous {
        /// As requested.
        name: MapName,
        /// How many.
        count: usize,
        /// Each by path or id, with its owners.
        candidates: String,
    },
    /// An inner map was asked of a map that holds none.
    #[error(
        "map {map} is a {map_type} map, not a map of maps (array_of_maps, hash_of_maps): it has no inner maps"
    )]
    NotMapOfMaps {
        /// The outer map.
        map: MapRef,
        /// Its type.
        map_type: MapType,
    },
    /// The outer map has no inner map at the key.
    #[error("map {outer} holds no inner map at key {key}")]
    NoInnerMap {
        /// The outer map.
        outer: MapRef,
        /// The key, in hex.
        key: String,
    },
    /// A directory, or a pinned program, link or BTF object.
    #[error("{map} is not a BPF map ({what})")]
    NotAMap {
        /// The reference.
        map: MapRef,
        /// What it is instead.
        what: &'static str,
    },
    /// The request names a map by id and the server does not allow it.
    #[error("access by map id is disabled on this server (enable `allow_by_id`)")]
    ByIdDisabled,
    /// The map's type cannot be iterated from user space.
    #[error(
        "map {map} cannot be dumped: maps of type {map_type} cannot be iterated from user space"
    )]
    NotIterable {
        /// The reference.
        map: MapRef,
        /// Its type.
        map_type: MapType,
    },
    /// The daemon cannot size the map's values.
    #[error("map {map} cannot be read: {reason}")]
    Unsized {
        /// The reference.
        map: MapRef,
        /// Why.
        reason: String,
    },
    /// The map's type has no lookup from user space.
    #[error("map {map} does not support lookups from user space (type {map_type})")]
    LookupUnsupported {
        /// The reference.
        map: MapRef,
        /// Its type.
        map_type: MapType,
    },
    /// A type declared for a side of a map whose BTF gives that side's
    /// type: declarations are for maps without types.
    #[error(
        "map {map} has types: its BTF gives its {side} type ({name}), which a declaration cannot replace; leave the {side} type undeclared"
    )]
    TypedByBtf {
        /// The reference.
        map: MapRef,
        /// "key" or "value".
        side: &'static str,
        /// The BTF type's name.
        name: String,
    },
    /// The map's types are needed and it has none that can be used.
    #[error("map {map} has no types: {why}")]
    Untyped {
        /// The reference.
        map: MapRef,
        /// Why, and what to do instead.
        why: String,
    },
    /// A cursor that cannot be used (its variant says why).
    #[error(transparent)]
    Cursor(#[from] CursorError),
    /// The key a key-walked dump resumes after was deleted.
    #[error(
        "map {0}: the last key delivered before this cursor was deleted; restart the dump without a cursor"
    )]
    ResumeKeyDeleted(MapRef),
    /// The map cannot be drained (configuration or type); the message says
    /// why.
    #[error("{0}")]
    NotDrainable(String),
    /// Another call is draining the map.
    #[error("{0}")]
    DrainBusy(String),
    /// A spool file that cannot be read back as written: the message names
    /// it and says what is wrong.
    #[error("{0}")]
    SpoolCorrupt(String),
    /// A watched map was replaced or changed shape; the message says how.
    #[error("{0}")]
    MapChanged(String),
    /// A dump's cursor asks for a walk inside the kernel that cannot run
    /// now; the message says why.
    #[error("{0}")]
    KernelWalkUnavailable(String),
    /// The stack-trace map of a StackMap call: none, several, or not one;
    /// the message says which and how to name it.
    #[error("{0}")]
    NoStackMap(String),
    /// The server is stopping.
    #[error("server is shutting down; resume from the last cursor received")]
    ShuttingDown,
    /// The client went away before the call ended.
    #[error("the client cancelled the call")]
    Cancelled,
    /// The client took no chunk for the stall timeout.
    #[error(
        "the client took no chunk for {secs} s, so the stream was ended; resume from the last cursor received"
    )]
    Stalled {
        /// The stall timeout.
        secs: u64,
    },
    /// A map too large to watch within limits.max_watch_bytes (retrying
    /// cannot help until the limit or the map changes).
    #[error("{0}")]
    WatchTooLarge(String),
    /// A limit was reached; the message names it.
    #[error("{0}")]
    ResourceExhausted(String),
    /// The dump held its slot for the hold time while other dumps waited.
    #[error(
        "this dump held its slot for {secs} s while other dumps were waiting for one, so the stream was ended; resume from the last cursor received"
    )]
    SlotExpired {
        /// limits.max_slot_hold.
        secs: u64,
    },
    /// An entry (or a hash bucket) too large for this server's limits.
    #[error("an entry of map {map} takes {bytes} bytes: {why}")]
    EntryTooLarge {
        /// The reference.
        map: MapRef,
        /// Bytes of one entry (or bucket) in a message.
        bytes: usize,
        /// Which limit, and what to raise.
        why: String,
    },
    /// The response to a Lookup would be too large.
    #[error(
        "the values of {keys} keys of map {map} would make a response of about {bytes} bytes; {}, split the request",
        if *fit == 1 { "only one key of this map fits in one Lookup".to_owned() } else { format!("at most {fit} keys of this map fit in one Lookup") }
    )]
    ResponseTooLarge {
        /// The reference.
        map: MapRef,
        /// Keys asked for.
        keys: usize,
        /// Estimated response size.
        bytes: usize,
        /// Keys that fit.
        fit: usize,
    },
    /// The policy does not allow this.
    #[error("{identity} may not {verb} {map}", verb = .operation.verb())]
    PermissionDenied {
        /// The caller.
        identity: Identity,
        /// What it asked to do.
        operation: Operation,
        /// To which map (as requested).
        map: MapRef,
    },
    /// An unexpected kernel error.
    #[error("map {map}: {source}")]
    Kernel {
        /// The reference.
        map: MapRef,
        /// The failed call.
        #[source]
        source: SyscallError,
    },
    /// Anything else that should not happen.
    #[error("{}{message}", map.as_ref().map(|m| format!("map {m}: ")).unwrap_or_default())]
    Internal {
        /// The map concerned, if any.
        map: Option<MapRef>,
        /// What happened.
        message: String,
    },
}

impl Error {
    /// A key of the wrong size (the `index`th of a request, when known).
    pub(crate) fn key_size(
        map: &MapRef,
        index: Option<usize>,
        got: usize,
        expected: usize,
    ) -> Self {
        let which = index.map_or_else(|| "a key".to_owned(), |i| format!("key {i}"));
        Self::InvalidArgument(format!(
            "{which} is {got} bytes; map {map} has {expected}-byte keys"
        ))
    }

    /// INVALID_ARGUMENT unless `key` has the size of `meta`'s keys.
    pub(crate) fn check_key_size(
        map: &MapRef,
        meta: &bpfmap_kernel::MapMeta,
        index: Option<usize>,
        key: &[u8],
    ) -> Result<(), Self> {
        let expected = meta.key_size as usize;
        if expected != 0 && key.len() != expected {
            return Err(Self::key_size(map, index, key.len(), expected));
        }
        Ok(())
    }

    /// A map that could not be opened.
    pub(crate) fn from_open(map: &MapRef, e: OpenError) -> Self {
        match e {
            OpenError::NotFound => Self::MapNotFound(map.clone()),
            OpenError::NotAMap => Self::NotAMap {
                map: map.clone(),
                what: "a pinned program, link or BTF object",
            },
            OpenError::Syscall(source) => Self::Kernel {
                map: map.clone(),
                source,
            },
        }
    }

    /// A walk that failed.
    pub(crate) fn from_walk(map: &MapRef, e: WalkError) -> Self {
        match e {
            WalkError::NotIterable(map_type) => Self::NotIterable {
                map: map.clone(),
                map_type,
            },
            WalkError::ResumeKeyDeleted => Self::ResumeKeyDeleted(map.clone()),
            WalkError::Unsized(reason) => Self::Unsized {
                map: map.clone(),
                reason,
            },
            WalkError::BadToken => Self::Cursor(CursorError::MapReplaced {
                map: map.clone(),
                detail: "the cursor's position no longer fits it".into(),
            }),
            WalkError::BucketTooLarge { .. } => Self::Internal {
                map: Some(map.clone()),
                message: e.to_string(),
            },
            WalkError::Syscall(source) => Self::Kernel {
                map: map.clone(),
                source,
            },
        }
    }

    /// A lookup that failed.
    pub(crate) fn from_lookup(map: &MapRef, e: LookupError) -> Self {
        match e {
            LookupError::Unsupported(map_type) => Self::LookupUnsupported {
                map: map.clone(),
                map_type,
            },
            LookupError::Unsized(reason) => Self::Unsized {
                map: map.clone(),
                reason,
            },
            LookupError::KeySize { expected, got } => Self::key_size(map, None, got, expected),
            LookupError::Syscall(source) => Self::Kernel {
                map: map.clone(),
                source,
            },
        }
    }
}

/// For a path of one word (`hists`), how a map is named by its kernel
/// name instead: most programs pin nothing.
fn name_hint(map: &MapRef) -> String {
    match map {
        MapRef::Path(p) if !p.contains('/') && MapName::parse(p).is_ok() => {
            format!(" (no map is pinned at {p}; a map by its kernel name is name:{p})")
        }
        _ => String::new(),
    }
}
