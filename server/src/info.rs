//! ListMaps and GetMap: the maps a caller may see, and one map described
//! (the kernel's description, its types, the renderings configured for it).

use bpfmap_proto::v1 as pb;

use crate::{
    calls::{Calls, blocking},
    error::Error,
    model::{Caller, MapRef, Operation, Rpc},
    wire::IntoProto as _,
};

/// Every exposed map the policy lets `caller` list.
pub(crate) async fn list(calls: &Calls, caller: &Caller) -> Result<Vec<pb::MapInfo>, Error> {
    calls.accepting()?;
    let catalog = calls.catalog.clone();
    let maps = blocking(move || Ok(catalog.list())).await?;
    let policy = calls.policy.load();
    Ok(maps
        .iter()
        .filter(|(map, _)| policy.allows(&caller.identity, Operation::List, map))
        .map(|(map, meta)| (map, meta).into_proto())
        .collect())
}

/// One map described.
pub(crate) async fn get(calls: &Calls, caller: &Caller, map: MapRef) -> Result<pb::MapInfo, Error> {
    calls.accepting()?;
    let opened = calls
        .open(caller, (Operation::List, Rpc::GetMap), map, true)
        .await?;
    let mut info = (&opened.map, opened.handle.meta()).into_proto();
    opened.types.fill(&mut info);
    info.render = calls
        .renders
        .for_map(&opened.map)
        .iter()
        .map(|(path, how)| (path.to_owned(), how.to_string()))
        .collect();
    Ok(info)
}
