//! What every call of a client goes through.

/// What every call of a client goes through: its channel, and the header
/// naming who it calls for.
pub(crate) type Transport =
    tonic::service::interceptor::InterceptedService<tonic::transport::Channel, OnBehalfOf>;

/// Adds `bpfmap-on-behalf-of` to every call, when set.
#[derive(Debug, Clone, Default)]
pub(crate) struct OnBehalfOf(pub(crate) Option<tonic::metadata::AsciiMetadataValue>);

impl tonic::service::Interceptor for OnBehalfOf {
    fn call(&mut self, mut req: tonic::Request<()>) -> Result<tonic::Request<()>, tonic::Status> {
        if let Some(v) = &self.0 {
            req.metadata_mut().insert("bpfmap-on-behalf-of", v.clone());
        }
        Ok(req)
    }
}
