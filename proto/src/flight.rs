//! The commands of Arrow Flight (feature `arrow`): a descriptor's command
//! and a ticket are a `bpfmap.v1.FlightCommand`, the criteria of
//! ListFlights a `bpfmap.v1.ListMapsRequest`; each as protobuf bytes, or
//! in the message's JSON form (proto3 JSON, as grpcurl writes it) for
//! people writing them by hand. The daemon and the relay read them here.

use std::sync::OnceLock;

use prost::Message as _;
use prost_reflect::{DescriptorPool, DynamicMessage};

use crate::v1::{FILE_DESCRIPTOR_SET, FlightCommand, ListMapsRequest, flight_command::Command};

/// A command written by hand, as errors show it.
pub const EXAMPLE: &str = r#"{"dump": {"map": {"path": "demo/flows"}}}"#;

/// Why bytes are not a command.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct CommandError(String);

/// The command in `bytes`, which asks for a dump or an aggregate.
pub fn command(bytes: &[u8]) -> Result<FlightCommand, CommandError> {
    let command: FlightCommand = decode(bytes, "bpfmap.v1.FlightCommand")?;
    match command.command {
        Some(Command::Dump(_) | Command::Aggregate(_)) => Ok(command),
        None => Err(CommandError(format!(
            "the command says neither dump nor aggregate; for example {EXAMPLE}"
        ))),
    }
}

/// Why a dump's request cannot be read as a table.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TableRequestError {
    /// A `per_cpu` that is none of the values.
    #[error("unknown per_cpu {0}: PER_CPU_EACH (a list per entry) or PER_CPU_SUM")]
    PerCpu(i32),
    /// `layout` or `raw` set: a table is typed columns.
    #[error("a table's columns are typed: leave layout and raw out of a Flight command")]
    NotATable,
}

/// The dump a table command runs (packed records, each CPU's value), and
/// how its per-CPU values become columns: what the daemon and the relay
/// both read a `dump` command as.
pub fn table_request(
    mut req: crate::v1::DumpMapRequest,
) -> Result<
    (
        crate::v1::DumpMapRequest,
        crate::typed::arrow::PerCpuColumns,
    ),
    TableRequestError,
> {
    use crate::{typed::arrow::PerCpuColumns, v1 as pb};
    let per_cpu = match pb::PerCpu::try_from(req.per_cpu) {
        Ok(pb::PerCpu::Each) => PerCpuColumns::List,
        Ok(pb::PerCpu::Sum) => PerCpuColumns::Sum,
        Err(_) => return Err(TableRequestError::PerCpu(req.per_cpu)),
    };
    if req.raw || req.layout != pb::Layout::Entries as i32 {
        return Err(TableRequestError::NotATable);
    }
    req.layout = pb::Layout::Packed as i32;
    req.per_cpu = pb::PerCpu::Each as i32;
    Ok((req, per_cpu))
}

/// The criteria of ListFlights: which maps (empty: every map).
pub fn criteria(bytes: &[u8]) -> Result<ListMapsRequest, CommandError> {
    match bytes.is_empty() {
        true => Ok(ListMapsRequest::default()),
        false => decode(bytes, "bpfmap.v1.ListMapsRequest"),
    }
}

/// `bytes` as the message `name`: JSON when it starts with `{` (a
/// protobuf message never does: that byte is a group's start tag, which
/// proto3 has no use for), protobuf otherwise.
fn decode<M: prost::Message + Default>(bytes: &[u8], name: &str) -> Result<M, CommandError> {
    let text = bytes.trim_ascii_start();
    if !text.starts_with(b"{") {
        return M::decode(bytes).map_err(|e| {
            CommandError(format!(
                "the command is neither JSON nor a {name} ({e}); for example {EXAMPLE}"
            ))
        });
    }
    let descriptor = pool()
        .get_message_by_name(name)
        .ok_or_else(|| CommandError(format!("{name} is not described")))?;
    let mut json = serde_json::Deserializer::from_slice(text);
    let message = DynamicMessage::deserialize(descriptor, &mut json)
        .and_then(|m| json.end().map(|()| m))
        .map_err(|e| CommandError(format!("the command is not a {name} in JSON: {e}")))?;
    M::decode(message.encode_to_vec().as_slice())
        .map_err(|e| CommandError(format!("the command is not a {name}: {e}")))
}

/// The descriptions of bpfmap.v1, read once.
fn pool() -> &'static DescriptorPool {
    static POOL: OnceLock<DescriptorPool> = OnceLock::new();
    POOL.get_or_init(|| {
        DescriptorPool::decode(FILE_DESCRIPTOR_SET).expect("the built-in descriptor set")
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::v1::PerCpu;

    #[test]
    fn commands_read_as_json_or_protobuf() {
        let json = br#" {"dump": {"map": {"path": "demo/flows"}, "filter": "value.bytes > 1", "perCpu": "PER_CPU_SUM"}, "targets": {"targets": ["a"]}}"#;
        let c = command(json).unwrap();
        let Some(Command::Dump(d)) = &c.command else {
            panic!("a dump");
        };
        assert_eq!(d.filter, "value.bytes > 1");
        assert_eq!(d.per_cpu, PerCpu::Sum as i32);
        assert_eq!(c.targets.as_ref().unwrap().targets, ["a"]);
        assert_eq!(command(&c.encode_to_vec()).unwrap(), c);
        let json = br#"{"aggregate": {"map": {"name": "hists"}, "group_by": ["key.pid"]}}"#;
        let Some(Command::Aggregate(a)) = command(json).unwrap().command else {
            panic!("an aggregate");
        };
        assert_eq!(a.group_by, ["key.pid"]);
        assert_eq!(criteria(br#"{"name": "AT_*"}"#).unwrap().name, "AT_*");
        assert_eq!(criteria(b"").unwrap(), ListMapsRequest::default());
    }

    #[test]
    fn bad_commands_say_what_a_command_is() {
        for (bytes, says) in [
            (
                &br#"{"dump": {"mapp": {}}}"#[..],
                "not a bpfmap.v1.FlightCommand in JSON",
            ),
            (b"{}", "neither dump nor aggregate"),
            (b"{\"dump\": {}} x", "not a bpfmap.v1.FlightCommand in JSON"),
            (b"\xff\xff", "neither JSON nor a bpfmap.v1.FlightCommand"),
        ] {
            let e = command(bytes).unwrap_err();
            assert!(e.to_string().contains(says), "{e}");
        }
    }
}
