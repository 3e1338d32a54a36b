//! The command of a Flight descriptor or ticket and the criteria of
//! ListFlights, as a daemon reads them (`bpfmap_proto::flight`): a command
//! that names the relay's targets or its fleet cursor is refused.

use bpfmap_proto::{flight, v1 as pb};
use prost::Message as _;

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
    /// The command in `bytes`.
    pub(crate) fn parse(bytes: &[u8]) -> Result<Self, Error> {
        use pb::flight_command::Command as C;
        let command = flight::command(bytes).map_err(|e| Error::InvalidArgument(e.to_string()))?;
        if command.targets.is_some() || !command.fleet_cursor.is_empty() {
            return Err(Error::InvalidArgument(
                "targets and fleet_cursor are the relay's: a daemon serves its own maps (leave them out)".into(),
            ));
        }
        match command.command {
            Some(C::Dump(d)) => Ok(Self::Dump(d)),
            Some(C::Aggregate(a)) => Ok(Self::Aggregate(a)),
            None => Err(Error::InvalidArgument(format!(
                "the command says neither dump nor aggregate; for example {}",
                flight::EXAMPLE
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

/// The criteria of ListFlights: which maps (empty: every map the caller
/// may read).
pub(crate) fn criteria(bytes: &[u8]) -> Result<pb::ListMapsRequest, Error> {
    flight::criteria(bytes).map_err(|e| Error::InvalidArgument(e.to_string()))
}
