//! ListMaps and GetMap: the maps a caller may see, and one map described
//! (the kernel's description, its types, the renderings configured for it,
//! its pins, the programs and processes holding it, its memory).

use bpfmap_kernel::MapType;
use bpfmap_proto::v1 as pb;

use crate::{
    calls::{Call, Calls, blocking},
    error::Error,
    maps::{Catalog, Holders, Listed},
    model::{Caller, MapRef, MapRequest, Operation, Rpc, quote},
    wire::IntoProto as _,
};

/// Every exposed map the policy lets `caller` list, narrowed as `req`
/// asks (name glob, type, owner).
pub(crate) async fn list(
    calls: &Calls,
    caller: &Caller,
    req: pb::ListMapsRequest,
) -> Result<Vec<pb::MapInfo>, Error> {
    calls.accepting()?;
    let narrow = Narrowing::of(&req)?;
    let (catalog, holders) = (calls.catalog.clone(), calls.holders.clone());
    let (listed, holders) = blocking(move || Ok((catalog.list(true), holders.get()))).await?;
    let policy = calls.policy.load();
    let may_list = |r: &MapRef| policy.allows(&caller.identity, Operation::List, r);
    let listed: Vec<&Listed> = listed.iter().filter(|l| may_list(&l.map)).collect();
    // Only the pins the caller may list: a pin under a path the policy
    // denies is not revealed.
    let pins = Catalog::pins(listed.iter().copied());
    Ok(listed
        .into_iter()
        .filter(|l| narrow.keeps(l, &holders))
        .map(|l| {
            let mut info = (&l.map, &l.meta).into_proto();
            info.pins = pins.get(&l.meta.id).cloned().unwrap_or_default();
            info.memlock = l.memlock.unwrap_or(0);
            holders.fill(&mut info);
            info
        })
        .collect())
}

/// What a ListMaps call keeps.
struct Narrowing {
    name: Option<globset::GlobMatcher>,
    map_type: Option<MapType>,
    owner: Option<String>,
}

impl Narrowing {
    fn of(req: &pb::ListMapsRequest) -> Result<Self, Error> {
        let name = match req.name.as_str() {
            "" => None,
            n => Some(
                globset::Glob::new(n)
                    .map_err(|e| {
                        Error::InvalidArgument(format!("name {} is not a glob: {e}", quote(n)))
                    })?
                    .compile_matcher(),
            ),
        };
        let map_type = match req.r#type.as_str() {
            "" => None,
            t => Some(MapType::by_name(t).ok_or_else(|| {
                Error::InvalidArgument(format!(
                    "type {} is not a map type; use one of {}",
                    quote(t),
                    MapType::names().collect::<Vec<_>>().join(", ")
                ))
            })?),
        };
        let owner = Some(req.owner.clone()).filter(|o| !o.is_empty());
        Ok(Self {
            name,
            map_type,
            owner,
        })
    }

    fn keeps(&self, l: &Listed, holders: &Holders) -> bool {
        self.name.as_ref().is_none_or(|g| g.is_match(&l.meta.name))
            && self.map_type.is_none_or(|t| t == l.meta.map_type)
            && self
                .owner
                .as_ref()
                .is_none_or(|o| holders.holds(l.meta.id, o))
    }
}

/// One map described.
pub(crate) async fn get(
    calls: &Calls,
    caller: &Caller,
    map: MapRequest,
) -> Result<pb::MapInfo, Error> {
    calls.accepting()?;
    let call = Call::new(Operation::List, Rpc::GetMap);
    let (map, declared) = calls.resolve(caller, call, map).await?;
    let opened = calls.open(caller, call, map, &declared, true).await?;
    let mut info = (&opened.map, opened.handle.meta()).into_proto();
    opened.types.fill(&mut info);
    info.render = calls
        .renders
        .for_map(&opened.map, &opened.handle.meta().name)
        .iter()
        .map(|(path, how)| (path.to_owned(), how.to_string()))
        .collect();
    info.memlock = opened.handle.memlock().unwrap_or(0);
    let (catalog, holders, id) = (calls.catalog.clone(), calls.holders.clone(), info.id);
    let (programs, meta) = (calls.programs.clone(), opened.handle.meta().clone());
    let (pins, holders, unavailable) = blocking(move || {
        Ok((
            catalog.pins_of(id),
            holders.get(),
            programs.unavailable(&meta),
        ))
    })
    .await?;
    info.kernel_scans_unavailable = unavailable.map(|u| u.to_string()).unwrap_or_default();
    // Only the pins the caller may see.
    let policy = calls.policy.load();
    let pins: Vec<String> = pins
        .into_iter()
        .filter(|p| policy.allows(&caller.identity, Operation::List, &MapRef::Path(p.clone())))
        .collect();
    if !matches!(opened.map, MapRef::Path(_))
        && let Some(first) = pins.first()
    {
        // Reached by id, name or through its outer map: its pin says
        // where it lives.
        info.path.clone_from(first);
    }
    info.pins = pins;
    holders.fill(&mut info);
    Ok(info)
}
