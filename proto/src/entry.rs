//! `bpfmap.v1.Entry`, written by hand so that its decoded forms can also be
//! carried already encoded: the daemon writes each entry's
//! `google.protobuf.Value`s straight from the map's layout into the
//! message's bytes ([`ValueWriter`](crate::typed::ValueWriter)) instead of
//! building a `Value` tree per entry. On the wire it is the message the
//! proto file declares; decoding fills the fields as generated code would.

use bytes::{Buf, BufMut, Bytes};
use prost::{
    DecodeError, Message,
    encoding::{self, DecodeContext, WireType},
};

/// One entry of a dump (see the proto file for each field).
#[derive(Clone, PartialEq, Default)]
pub struct Entry {
    /// The key's bytes.
    pub key: Vec<u8>,
    /// The value, for maps that are not per-CPU.
    pub value: Vec<u8>,
    /// For per-CPU maps: one value per possible CPU, in CPU order.
    pub per_cpu_values: Vec<Vec<u8>>,
    /// The key decoded through the map's types.
    pub decoded_key: Option<prost_types::Value>,
    /// The value decoded through the map's types.
    pub decoded_value: Option<prost_types::Value>,
    /// `decoded_key` and `decoded_value` already encoded (fields 4 and 5,
    /// tags included), written after the other fields. Set by a sender that
    /// encodes them itself, in place of the two fields above; never set by
    /// decoding.
    pub encoded_decoded: Bytes,
}

impl std::fmt::Debug for Entry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Entry")
            .field("key", &self.key)
            .field("value", &self.value)
            .field("per_cpu_values", &self.per_cpu_values)
            .field("decoded_key", &self.decoded_key)
            .field("decoded_value", &self.decoded_value)
            .field("encoded_decoded", &self.encoded_decoded.len())
            .finish()
    }
}

impl Message for Entry {
    fn encode_raw(&self, buf: &mut impl BufMut) {
        if !self.key.is_empty() {
            encoding::bytes::encode(1, &self.key, buf);
        }
        if !self.value.is_empty() {
            encoding::bytes::encode(2, &self.value, buf);
        }
        encoding::bytes::encode_repeated(3, &self.per_cpu_values, buf);
        if let Some(v) = &self.decoded_key {
            encoding::message::encode(4, v, buf);
        }
        if let Some(v) = &self.decoded_value {
            encoding::message::encode(5, v, buf);
        }
        buf.put_slice(&self.encoded_decoded);
    }

    fn merge_field(
        &mut self,
        tag: u32,
        wire_type: WireType,
        buf: &mut impl Buf,
        ctx: DecodeContext,
    ) -> Result<(), DecodeError> {
        match tag {
            1 => encoding::bytes::merge(wire_type, &mut self.key, buf, ctx),
            2 => encoding::bytes::merge(wire_type, &mut self.value, buf, ctx),
            3 => encoding::bytes::merge_repeated(wire_type, &mut self.per_cpu_values, buf, ctx),
            4 => encoding::message::merge(
                wire_type,
                self.decoded_key.get_or_insert_with(Default::default),
                buf,
                ctx,
            ),
            5 => encoding::message::merge(
                wire_type,
                self.decoded_value.get_or_insert_with(Default::default),
                buf,
                ctx,
            ),
            _ => encoding::skip_field(wire_type, tag, buf, ctx),
        }
    }

    fn encoded_len(&self) -> usize {
        let key = if self.key.is_empty() {
            0
        } else {
            encoding::bytes::encoded_len(1, &self.key)
        };
        let value = if self.value.is_empty() {
            0
        } else {
            encoding::bytes::encoded_len(2, &self.value)
        };
        key + value
            + encoding::bytes::encoded_len_repeated(3, &self.per_cpu_values)
            + self
                .decoded_key
                .as_ref()
                .map_or(0, |v| encoding::message::encoded_len(4, v))
            + self
                .decoded_value
                .as_ref()
                .map_or(0, |v| encoding::message::encoded_len(5, v))
            + self.encoded_decoded.len()
    }

    fn clear(&mut self) {
        *self = Self::default();
    }
}

#[cfg(test)]
mod tests {
    use prost_types::{Value, value::Kind};

    use super::*;
    use crate::typed::{Sink as _, ValueWriter};

    fn number(n: f64) -> Value {
        Value {
            kind: Some(Kind::NumberValue(n)),
        }
    }

    #[test]
    fn an_entry_reads_back_as_written_whichever_way_its_values_were_encoded() {
        let plain = Entry {
            key: vec![1, 2],
            value: vec![3],
            per_cpu_values: vec![vec![4], vec![]],
            decoded_key: Some(number(513.0)),
            decoded_value: Some(number(3.0)),
            encoded_decoded: Bytes::new(),
        };
        let bytes = plain.encode_to_vec();
        assert_eq!(bytes.len(), plain.encoded_len());
        assert_eq!(Entry::decode(bytes.as_slice()).unwrap(), plain);

        let mut pre = Vec::new();
        ValueWriter::new(&mut pre, 4).int(513);
        ValueWriter::new(&mut pre, 5).int(3);
        let encoded = Entry {
            decoded_key: None,
            decoded_value: None,
            encoded_decoded: pre.into(),
            ..plain.clone()
        };
        let bytes = encoded.encode_to_vec();
        assert_eq!(bytes.len(), encoded.encoded_len());
        assert_eq!(Entry::decode(bytes.as_slice()).unwrap(), plain);
    }
}
