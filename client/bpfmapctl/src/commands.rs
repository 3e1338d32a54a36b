//! `list`, `show` and `lookup`.

use std::{collections::HashMap, io};

use bpfmap_client::{
    Error, FleetEvent, FleetRun, Key, ListMapsOptions, LookupOptions, MapName, MapTypes, Target,
};
use futures::StreamExt as _;

use crate::{
    ListArgs, RenderArg,
    drive::{self, Io, drive},
    keys::parse_key,
    output::Printer,
    render_pairs,
    setup::Setup,
    usage,
};

/// `list`: every target's maps.
pub(crate) async fn list(setup: Setup, io: Io<'_>, args: &ListArgs) -> anyhow::Result<()> {
    let mut options = ListMapsOptions::default();
    if let Some(name) = &args.name {
        options = options.with_name(name);
    }
    if let Some(t) = &args.map_type {
        options = options.with_type(t);
    }
    if let Some(owner) = &args.owner {
        options = options.with_owner(owner);
    }
    let run = setup.fleet().list_maps_with(options);
    print_all(setup, io, run, |p, out, t, maps| p.maps(out, t, &maps)).await
}

/// `show MAP`: the map on every target.
pub(crate) async fn show(setup: Setup, io: Io<'_>, map: &str) -> anyhow::Result<()> {
    let run = setup.fleet().get_map(&setup.map_name(map)?);
    print_all(setup, io, run, |p, out, t, info| p.map(out, t, &info)).await
}

/// `lookup MAP KEY...`: the keys on every target, decoded through each
/// target's types (with the renderings of `--render` over the configured
/// ones).
pub(crate) async fn lookup(
    setup: Setup,
    io: Io<'_>,
    map: &str,
    keys: &[String],
    render: &[RenderArg],
) -> anyhow::Result<()> {
    let map = setup.map_name(map)?;
    let fleet = setup.fleet();
    let keys = keys
        .iter()
        .map(|k| parse_key(k))
        .collect::<anyhow::Result<Vec<Key>>>()?;
    // Renderings that do not fit a target's types are refused before the
    // lookup.
    let mut types = if setup.decode || !render.is_empty() {
        map_types(&fleet, &map, render).await?
    } else {
        HashMap::new()
    };
    if !setup.decode {
        types.clear();
    }
    // Raw: the bytes are decoded here, as a dump's are; the renderings go
    // along for JSON keys in their rendered spelling.
    let options = LookupOptions::default()
        .with_raw(true)
        .with_render(render_pairs(render));
    let run = fleet.lookup(&map, keys, options);
    print_all(setup, io, run, |p, out, t, results| {
        let types = types.get(t);
        results
            .iter()
            .try_for_each(|r| p.typed_lookup(out, t, r, types))
    })
    .await
}

/// Prints every answer of `run` with `print`, then what failed.
async fn print_all<T>(
    setup: Setup,
    io: Io<'_>,
    run: FleetRun<T>,
    mut print: impl FnMut(&mut Printer, &mut dyn io::Write, &Target, T) -> io::Result<()>,
) -> anyhow::Result<()> {
    let Setup {
        mut printer,
        progress,
        ..
    } = setup;
    let out = &mut *io.out;
    let (reports, end) = drive(run, &progress, std::future::pending(), |t, answer| {
        print(&mut printer, out, &t, answer)
    })
    .await;
    printer.finish(io.out, io.err)?;
    drive::finish(io, &progress, reports, end)
}

/// Every target's types for `map` (GetMap), with `render` over the
/// configured renderings, and the key size of the first target that
/// answers; targets that fail or have no types are left out, and print hex.
/// Renderings a target's types refuse are a usage error.
pub(crate) async fn map_types(
    fleet: &bpfmap_client::Fleet,
    map: &MapName,
    render: &[RenderArg],
) -> anyhow::Result<HashMap<Target, MapTypes>> {
    let mut run = fleet.get_map(map);
    let mut types = HashMap::new();
    let total = fleet.targets().len();
    while let Some(event) = run.next().await {
        if let FleetEvent::Answer { target, answer } = event {
            match answer.types_with(render_pairs(render)) {
                Ok(Some(t)) => {
                    types.insert(target, t);
                }
                // The command line's renderings; a daemon's own that do not
                // fit leave its results in hex.
                Err(e @ Error::Render { .. }) if !render.is_empty() => {
                    return Err(usage(if total == 1 {
                        e.to_string()
                    } else {
                        format!("{target}: {e}")
                    }));
                }
                _ => {}
            }
        }
    }
    Ok(types)
}
