//! What every call starts from, whatever its RPC: whether the daemon still
//! accepts calls, the policy's decision, the map opened with its types, the
//! layouts the call sees its entries through, a request's cursor, and the
//! blocking pool for kernel work.
//!
//! Each RPC's domain (`info`, `lookup`, `dump`, `aggregate`, `watch`,
//! `drain`) takes [`Calls`] and its request and returns its answer or its
//! stream; the gRPC handlers (`rpc`) only start the audit record, call the
//! domain and turn its error into a status. Nothing here holds a lock across
//! maps.

use std::{collections::HashMap, sync::Arc};

use bpfmap_kernel::MapHandle;
use bpfmap_proto::typed::{MapLayout, Renderings};
use tokio::sync::watch;

use crate::{
    access::SharedPolicy,
    cursor::{self, SharedKeys},
    error::Error,
    maps::{Catalog, HoldersCache, KnownTypes, RenderRules, Resolved, TypeCache, TypeRules},
    metrics::Metrics,
    model::{Caller, Declared, InnerKey, MapRef, MapRequest, Operation, Requested, Rpc},
};

/// What a call does to its map (what the policy decides on), and through
/// which RPC (what a denial is counted under).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Call {
    pub(crate) op: Operation,
    pub(crate) rpc: Rpc,
}

impl Call {
    pub(crate) const fn new(op: Operation, rpc: Rpc) -> Self {
        Self { op, rpc }
    }
}

/// What every call shares.
#[derive(Debug, Clone)]
pub(crate) struct Calls {
    /// The exposed maps.
    pub(crate) catalog: Catalog,
    /// The maps' types, read from BTF once per BTF object.
    pub(crate) types: Arc<TypeCache>,
    /// How members of the maps are shown unless a request says otherwise.
    pub(crate) renders: Arc<RenderRules>,
    /// Types declared for maps whose BTF does not give them.
    pub(crate) declarations: Arc<TypeRules>,
    /// Who holds the maps, read at most once a second.
    pub(crate) holders: Arc<HoldersCache>,
    /// The cursor keys in force.
    pub(crate) keys: SharedKeys,
    /// The policy in force.
    pub(crate) policy: SharedPolicy,
    /// Where denials and resumed dumps are counted.
    pub(crate) metrics: Metrics,
    /// True once the server is shutting down: new calls get UNAVAILABLE.
    pub(crate) draining: watch::Receiver<bool>,
    /// The programs that walk maps inside the kernel.
    pub(crate) programs: Arc<crate::programs::WalkPrograms>,
}

/// A map opened for a call, with its types when they were asked for.
#[derive(Debug)]
pub(crate) struct Opened {
    /// As the request names it.
    pub(crate) map: MapRef,
    pub(crate) handle: MapHandle,
    pub(crate) types: KnownTypes,
    /// Whether its types were read (`KnownTypes::None` is then a map
    /// without BTF).
    pub(crate) types_read: bool,
}

impl Calls {
    /// UNAVAILABLE once the server is shutting down.
    pub(crate) fn accepting(&self) -> Result<(), Error> {
        if *self.draining.borrow() {
            Err(Error::ShuttingDown)
        } else {
            Ok(())
        }
    }

    /// The map a request names: a name found among the maps the policy
    /// lets `caller` use for the call (its pin path, or its id), an inner
    /// map's JSON key encoded through its outer map's key type.
    pub(crate) async fn resolve(
        &self,
        caller: &Caller,
        call: Call,
        requested: MapRequest,
    ) -> Result<(MapRef, Declared), Error> {
        let MapRequest { map, declared } = requested;
        let named = !matches!(map, Requested::Ref(_));
        let text = named.then(|| map.to_string());
        let resolved = self.resolve_ref(caller, call, map).await?;
        if let Some(requested) = text {
            // The audit log records a call's map as requested; which map a
            // name or an inner reference meant goes beside it.
            tracing::info!(
                target: "bpfmapd::audit",
                identity = %caller.identity,
                requested = %requested,
                map = %resolved,
                "map resolved"
            );
        }
        Ok((resolved, declared))
    }

    async fn resolve_ref(
        &self,
        caller: &Caller,
        call: Call,
        requested: Requested,
    ) -> Result<MapRef, Error> {
        match requested {
            Requested::Inner { outer, key } => {
                let outer = self.resolve_outer(caller, call.op, *outer).await?;
                let key = match key {
                    InnerKey::Bytes(b) => b,
                    InnerKey::Json(v) => self.outer_key(caller, call, &outer, &v).await?,
                };
                Ok(MapRef::Inner {
                    outer: Box::new(outer),
                    key,
                })
            }
            r => self.resolve_outer(caller, call.op, r).await,
        }
    }

    /// A path, an id, or a name resolved (not an inner map).
    async fn resolve_outer(
        &self,
        caller: &Caller,
        op: Operation,
        requested: Requested,
    ) -> Result<MapRef, Error> {
        match requested {
            Requested::Ref(r) => Ok(r),
            Requested::Name(name) => {
                let (catalog, policy) = (self.catalog.clone(), self.policy.load_full());
                let (identity, holders) = (caller.identity.clone(), self.holders.clone());
                blocking(move || {
                    catalog.find_name(&name, |r| policy.allows(&identity, op, r), &holders)
                })
                .await
            }
            Requested::Inner { .. } => Err(Error::InvalidArgument(
                "maps of maps do not nest: an outer map is named by path, id or name".into(),
            )),
        }
    }

    /// An inner map's key given as JSON, encoded through `outer`'s key type
    /// (with its configured renderings).
    async fn outer_key(
        &self,
        caller: &Caller,
        call: Call,
        outer: &MapRef,
        key: &prost_types::Value,
    ) -> Result<Vec<u8>, Error> {
        let declared = Declared::default();
        let opened = self
            .open(caller, call, outer.clone(), &declared, true)
            .await?;
        let layout = self.layout(&opened, &HashMap::new(), true)?;
        let key_layout = opened.types.key_layout(outer, &layout)?;
        key_layout.encode(key, "key").map_err(|e| {
            Error::InvalidArgument(format!("inner.json_key does not fit map {outer}: {e}"))
        })
    }

    /// PERMISSION_DENIED unless the policy allows `op` on `map` (checked
    /// before the map is opened, so a denial says nothing about existence).
    pub(crate) fn authorize(&self, caller: &Caller, call: Call, map: &MapRef) -> Result<(), Error> {
        if self.policy.load().allows(&caller.identity, call.op, map) {
            return Ok(());
        }
        self.metrics.denied(call.rpc);
        Err(Error::PermissionDenied {
            identity: caller.identity.clone(),
            operation: call.op,
            map: map.clone(),
        })
    }

    /// Authorizes, then opens the map (with its types when `types`, read in
    /// the same trip to the blocking pool: a trip costs more than the
    /// syscalls; the request's declared types over the configured ones
    /// over a map without BTF types). A path that resolves (through a
    /// symlink) to another map is authorized under that map's name too.
    pub(crate) async fn open(
        &self,
        caller: &Caller,
        call: Call,
        map: MapRef,
        declared: &Declared,
        types: bool,
    ) -> Result<Opened, Error> {
        self.authorize(caller, call, &map)?;
        // Declared types are checked against the map whatever the call
        // decodes: one that cannot apply is refused, never ignored.
        let types = types || !declared.is_empty();
        let (catalog, typer, r) = (self.catalog.clone(), self.typer(declared), map.clone());
        let (resolved, read_types): (Resolved, KnownTypes) = blocking(move || {
            let resolved = catalog.open(&r)?;
            let types = if types {
                typer.types(&r, resolved.handle.meta())?
            } else {
                KnownTypes::None
            };
            Ok((resolved, types))
        })
        .await?;
        if let Some(target) = &resolved.target {
            self.authorize_target(caller, call, &map, target)?;
        }
        Ok(Opened {
            map,
            handle: resolved.handle,
            types: read_types,
            types_read: types,
        })
    }

    /// What reads the types of the maps a call opens, with the call's
    /// declared types (to move to the blocking pool).
    pub(crate) fn typer(&self, declared: &Declared) -> Typer {
        Typer {
            cache: self.types.clone(),
            rules: self.declarations.clone(),
            declared: declared.clone(),
        }
    }

    /// The map a symlink named `map` resolved to must be allowed too; the
    /// denial names the map as requested (the target is not revealed).
    pub(crate) fn authorize_target(
        &self,
        caller: &Caller,
        call: Call,
        map: &MapRef,
        target: &MapRef,
    ) -> Result<(), Error> {
        self.authorize(caller, call, target)
            .map_err(|_| Error::PermissionDenied {
                identity: caller.identity.clone(),
                operation: call.op,
                map: map.clone(),
            })
    }

    /// The layout a call shows `opened`'s entries through: its types with
    /// the configured renderings for the map, overridden by the request's
    /// (`render`). `decodes` says whether the call decodes anything
    /// (renderings of a call that does not are refused).
    pub(crate) fn layout(
        &self,
        opened: &Opened,
        render: &HashMap<String, String>,
        decodes: bool,
    ) -> Result<MapLayout, Error> {
        let asked = Renderings::parse(render)
            .map_err(|e| Error::InvalidArgument(format!("render: {e}")))?;
        if !asked.is_empty() && !decodes {
            return Err(Error::InvalidArgument(
                "render shows decoded entries: it cannot be combined with LAYOUT_PACKED or raw = true (clients that decode packed entries apply renderings themselves)".into(),
            ));
        }
        // The configured renderings of a map whose types were read; of a
        // map without types, those of its whole key or value only.
        let configured = match &opened.types {
            KnownTypes::Typed(_) => self
                .renders
                .for_map(&opened.map, &opened.handle.meta().name),
            _ if opened.types_read => self
                .renders
                .for_map(&opened.map, &opened.handle.meta().name)
                .whole_only(),
            _ => Renderings::default(),
        };
        opened.types.layout(
            &opened.map,
            opened.handle.meta(),
            &configured.overridden_by(&asked),
        )
    }

    /// The layout a call's queries (filters, fields) read `opened`'s
    /// entries through: its types as they are, without renderings.
    pub(crate) fn query_layout(&self, opened: &Opened) -> Result<MapLayout, Error> {
        opened
            .types
            .layout(&opened.map, opened.handle.meta(), &Renderings::default())
    }

    /// A request's cursor, opened for `caller` and `map` (none when
    /// empty): checked before the map is touched, so that a bad cursor is a
    /// bad request whatever state the map is in.
    pub(crate) fn cursor(
        &self,
        token: &str,
        caller: &Caller,
        map: &MapRef,
    ) -> Result<Option<cursor::Opened>, Error> {
        match token {
            "" => Ok(None),
            token => Ok(Some(self.keys.load().open(token, &caller.identity, map)?)),
        }
    }
}

/// Reads a map's types: its BTF's, with the call's declared types over
/// the configured ones where the BTF does not give them.
#[derive(Debug)]
pub(crate) struct Typer {
    cache: Arc<TypeCache>,
    rules: Arc<TypeRules>,
    declared: Declared,
}

impl Typer {
    /// The types of `map` (`meta`); blocking (reads BTF). The values of a
    /// map of maps are inner map ids (`__u32`) unless declared otherwise.
    pub(crate) fn types(
        &self,
        map: &MapRef,
        meta: &bpfmap_kernel::MapMeta,
    ) -> Result<KnownTypes, Error> {
        let configured = self
            .rules
            .for_map(map, &meta.name)
            .or(Declared::implied(meta));
        self.cache
            .map_types(meta)
            .declared(&self.declared, &configured, map, meta)
    }
}

/// Runs kernel work on the blocking pool.
pub(crate) async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> Result<T, Error> + Send + 'static,
) -> Result<T, Error> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| Error::Internal {
            map: None,
            message: format!("worker failed: {e}"),
        })?
}
