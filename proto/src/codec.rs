//! The codec of the generated services: prost, except that
//! - a message that does not decode is INVALID_ARGUMENT (tonic's own prost
//!   codec answers INTERNAL, which tells a client the server is at fault and
//!   not to fix its request: a garbage body or a non-UTF-8 string field is
//!   the sender's mistake);
//! - a message is encoded into room reserved for all of it at once. tonic's
//!   prost encoder lets the buffer grow field by field: a dump's chunk of
//!   115 KiB was copied again as the buffer grew, past 128 KiB, into fresh
//!   pages that faulted in (the daemon maps buffers of 128 KiB and up
//!   afresh): about 3,500 page faults per dump of 32 MB.

use std::marker::PhantomData;

use prost::Message;
use tonic::{
    Status,
    codec::{BufferSettings, Codec, DecodeBuf, Decoder, EncodeBuf, Encoder},
};

/// See the module documentation.
#[derive(Debug, Clone)]
pub struct StrictCodec<T, U>(PhantomData<(T, U)>);

impl<T, U> Default for StrictCodec<T, U> {
    fn default() -> Self {
        Self(PhantomData)
    }
}

impl<T, U> Codec for StrictCodec<T, U>
where
    T: Message + Send + 'static,
    U: Message + Default + Send + 'static,
{
    type Encode = T;
    type Decode = U;
    type Encoder = ReservingEncoder<T>;
    type Decoder = StrictDecoder<U>;

    fn encoder(&mut self) -> Self::Encoder {
        ReservingEncoder(PhantomData)
    }

    fn decoder(&mut self) -> Self::Decoder {
        StrictDecoder(PhantomData)
    }
}

/// Encodes with prost into room reserved for the whole message.
#[derive(Debug, Clone)]
pub struct ReservingEncoder<T>(PhantomData<T>);

impl<T: Message> Encoder for ReservingEncoder<T> {
    type Item = T;
    type Error = Status;

    fn encode(&mut self, item: T, buf: &mut EncodeBuf<'_>) -> Result<(), Status> {
        buf.reserve(item.encoded_len());
        item.encode(buf)
            .map_err(|e| Status::internal(format!("cannot encode the message: {e}")))
    }

    fn buffer_settings(&self) -> BufferSettings {
        BufferSettings::default()
    }
}

/// Decodes with prost; a failure is INVALID_ARGUMENT.
#[derive(Debug, Clone)]
pub struct StrictDecoder<U>(PhantomData<U>);

impl<U: Message + Default> Decoder for StrictDecoder<U> {
    type Item = U;
    type Error = Status;

    fn decode(&mut self, buf: &mut DecodeBuf<'_>) -> Result<Option<U>, Status> {
        U::decode(buf)
            .map(Some)
            .map_err(|e| Status::invalid_argument(format!("malformed message: {e}")))
    }

    fn buffer_settings(&self) -> BufferSettings {
        BufferSettings::default()
    }
}
