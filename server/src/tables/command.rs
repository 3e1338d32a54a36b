//! The command of a Flight descriptor or ticket (`bpfmap.v1.FlightCommand`)
//! and the criteria of ListFlights (`bpfmap.v1.ListMapsRequest`): protobuf
//! bytes, or the message's JSON form (proto3 JSON, as grpcurl writes it)
//! for people writing them by hand.

use std::sync::OnceLock;

use bpfmap_proto::v1 as pb;
use prost::Message as _;
use prost_reflect::{DescriptorPool, DynamicMessage};

use crate::error::Error;

/// What a Flight command asks for.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Command {
    /// A table of the map's entries.
    Dump(pb::DumpMapRequest),
    /// A table of the groups.
    Aggregate(pb::AggregateMapRequest),
}

impl Command {
    /// The command in `bytes`, for a daemon: a command that names the
    /// relay's targets or its fleet cursor is refused.
    pub(crate) fn parse(bytes: &[u8]) -> Result<Self, Error> {
        let command: pb::FlightCommand = decode(bytes, "bpfmap.v1.FlightCommand")?;
        if command.targets.is_some() || !command.fleet_cursor.is_empty() {
            return Err(Error::InvalidArgument(
                "targets and fleet_cursor are the relay's: a daemon serves its own maps (leave them out)".into(),
            ));
        }
        Self::of(command)
    }

    /// The command a `FlightCommand` carries.
    pub(crate) fn of(command: pb::FlightCommand) -> Result<Self, Error> {
        use pb::flight_command::Command as C;
        match command.command {
            Some(C::Dump(d)) => Ok(Self::Dump(d)),
            Some(C::Aggregate(a)) => Ok(Self::Aggregate(a)),
            None => Err(Error::InvalidArgument(format!(
                "the command says neither dump nor aggregate; for example {EXAMPLE}"
            ))),
        }
    }

    /// The command as protobuf bytes (what GetFlightInfo's ticket carries).
    pub(crate) fn to_bytes(&self) -> Vec<u8> {
        use pb::flight_command::Command as C;
        let command = match self {
            Self::Dump(d) => C::Dump(d.clone()),
            Self::Aggregate(a) => C::Aggregate(a.clone()),
        };
        pb::FlightCommand {
            command: Some(command),
            ..Default::default()
        }
        .encode_to_vec()
    }
}

/// A command written by hand, as the errors show it.
const EXAMPLE: &str = r#"{"dump": {"map": {"path": "demo/flows"}}}"#;

/// The criteria of ListFlights: which maps (empty: every map the caller
/// may read).
pub(crate) fn criteria(bytes: &[u8]) -> Result<pb::ListMapsRequest, Error> {
    match bytes.is_empty() {
        true => Ok(pb::ListMapsRequest::default()),
        false => decode(bytes, "bpfmap.v1.ListMapsRequest"),
    }
}

/// `bytes` as the message `name`: JSON when it starts with `{` (a
/// protobuf message never does: that byte is a group's start tag, which
/// proto3 has no use for), protobuf otherwise.
fn decode<M: prost::Message + Default>(bytes: &[u8], name: &str) -> Result<M, Error> {
    let text = bytes.trim_ascii_start();
    if !text.starts_with(b"{") {
        return M::decode(bytes).map_err(|e| {
            Error::InvalidArgument(format!(
                "the command is neither JSON nor a {name} ({e}); for example {EXAMPLE}"
            ))
        });
    }
    let descriptor = pool()
        .get_message_by_name(name)
        .ok_or_else(|| Error::InvalidArgument(format!("{name} is not described")))?;
    let mut json = serde_json::Deserializer::from_slice(text);
    let message = DynamicMessage::deserialize(descriptor, &mut json)
        .and_then(|m| json.end().map(|()| m))
        .map_err(|e| Error::InvalidArgument(format!("the command is not a {name} in JSON: {e}")))?;
    M::decode(message.encode_to_vec().as_slice())
        .map_err(|e| Error::InvalidArgument(format!("the command is not a {name}: {e}")))
}

/// The descriptions of bpfmap.v1, read once.
fn pool() -> &'static DescriptorPool {
    static POOL: OnceLock<DescriptorPool> = OnceLock::new();
    POOL.get_or_init(|| {
        DescriptorPool::decode(pb::FILE_DESCRIPTOR_SET).expect("the built-in descriptor set")
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn commands_read_as_json_or_protobuf() {
        let json = br#" {"dump": {"map": {"path": "demo/flows"}, "filter": "value.bytes > 1", "perCpu": "PER_CPU_SUM"}}"#;
        let Command::Dump(d) = Command::parse(json).unwrap() else {
            panic!("a dump");
        };
        assert_eq!(d.filter, "value.bytes > 1");
        assert_eq!(d.per_cpu, pb::PerCpu::Sum as i32);
        let again = Command::parse(&Command::Dump(d.clone()).to_bytes()).unwrap();
        assert_eq!(again, Command::Dump(d));
        let json = br#"{"aggregate": {"map": {"name": "hists"}, "group_by": ["key.pid"]}}"#;
        let Command::Aggregate(a) = Command::parse(json).unwrap() else {
            panic!("an aggregate");
        };
        assert_eq!(a.group_by, ["key.pid"]);
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
            (
                br#"{"dump": {}, "targets": {"targets": ["a"]}}"#,
                "targets and fleet_cursor are the relay's",
            ),
        ] {
            let e = Command::parse(bytes).unwrap_err();
            assert!(
                matches!(&e, Error::InvalidArgument(m) if m.contains(says)),
                "{e}"
            );
        }
        assert_eq!(criteria(br#"{"name": "AT_*"}"#).unwrap().name, "AT_*");
    }
}
