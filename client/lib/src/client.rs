//! A connection to one daemon.

use tonic::transport::Channel;

use crate::{
    AggregateOptions, AggregateResult, ConnectOptions, Dump, DumpOptions, Error, Key,
    ListMapsOptions, LookupOptions, LookupResult, MapInfo, MapName, RetryPolicy,
    connect::MAX_DECODE, lookup::LookupCall, pb, pb::map_service_client::MapServiceClient, typed,
};

/// A connection to one bpfmapd. Cheap to clone; clones share the connection.
///
/// Every unary call is retried and every dump resumed as the
/// [`RetryPolicy`] of its [`ConnectOptions`] says.
#[derive(Debug, Clone)]
pub struct Client {
    inner: MapServiceClient<crate::transport::Transport>,
    channel: Channel,
    retry: RetryPolicy,
}

impl Client {
    /// Connects to `addr` ("http://host:port", or "https://host:port" with
    /// [`ConnectOptions::with_tls`]) and waits until the connection is up.
    pub async fn connect(addr: &str, options: ConnectOptions) -> Result<Self, Error> {
        let channel = options
            .endpoint(addr)?
            .connect()
            .await
            .map_err(|source| Error::Connect {
                addr: addr.into(),
                source,
            })?;
        Ok(Self::from_channel(channel, options))
    }

    /// A client of `addr` that connects on first use (and reconnects after
    /// failures); only an unusable address or unusable TLS material fails
    /// here.
    pub fn connect_lazy(addr: &str, options: ConnectOptions) -> Result<Self, Error> {
        let channel = options.endpoint(addr)?.connect_lazy();
        Ok(Self::from_channel(channel, options))
    }

    /// A client over a channel made elsewhere (another local address, a
    /// custom connector). The channel keeps its own TLS and timeouts; of the
    /// `options`, the retry policy applies.
    pub fn from_channel(channel: Channel, options: ConnectOptions) -> Self {
        Self {
            inner: MapServiceClient::with_interceptor(channel.clone(), options.headers())
                .max_decoding_message_size(MAX_DECODE),
            channel,
            retry: options.retry_or(RetryPolicy::default),
        }
    }

    /// The connection, for other services of the daemon (its health).
    pub fn channel(&self) -> &Channel {
        &self.channel
    }

    /// The retry policy of its calls.
    pub(crate) fn retry(&self) -> &RetryPolicy {
        &self.retry
    }

    /// Runs a unary call, retrying it as [`RetryPolicy::should_retry_call`]
    /// says.
    pub(crate) async fn call<T, F, Fut>(&self, mut f: F) -> Result<T, Error>
    where
        F: FnMut(MapServiceClient<crate::transport::Transport>) -> Fut,
        Fut: Future<Output = Result<tonic::Response<T>, tonic::Status>>,
    {
        let mut backoff = self.retry.backoff();
        let mut attempt = 0;
        loop {
            match f(self.inner.clone()).await {
                Ok(resp) => return Ok(resp.into_inner()),
                Err(status) => match RetryPolicy::should_retry_call(&status, attempt)
                    .then(|| backoff.next(&status))
                    .flatten()
                {
                    Some(delay) => {
                        attempt += 1;
                        tracing::debug!(code = ?status.code(), message = status.message(), ?delay, "call failed; retrying");
                        tokio::time::sleep(delay).await;
                    }
                    _ => return Err(status.into()),
                },
            }
        }
    }

    /// The maps the daemon exposes to this client.
    pub async fn list_maps(&self) -> Result<Vec<MapInfo>, Error> {
        self.list_maps_with(&ListMapsOptions::default()).await
    }

    /// The maps the daemon exposes to this client that `options` keep (by
    /// name glob, type, owner).
    pub async fn list_maps_with(&self, options: &ListMapsOptions) -> Result<Vec<MapInfo>, Error> {
        let req = options.to_proto();
        let resp = self
            .call(|mut c| {
                let req = req.clone();
                async move { c.list_maps(req).await }
            })
            .await?;
        Ok(resp.maps.into_iter().map(MapInfo::from).collect())
    }

    /// One map's description, with its key and value types when it has
    /// them ([`MapInfo::types`]).
    pub async fn get_map(&self, map: &MapName) -> Result<MapInfo, Error> {
        let req = pb::GetMapRequest {
            map: Some(map.to_proto()),
        };
        self.call(|mut c| {
            let req = req.clone();
            async move { c.get_map(req).await }
        })
        .await
        .map(MapInfo::from)
    }

    /// Looks keys up: bytes, or JSON through the map's key type ([`Key`]),
    /// in one call. One result per key, in the order given; absent keys
    /// come back not [`found`](LookupResult::found). Results of a typed map
    /// carry the decoded key and value too, unless
    /// [`LookupOptions::with_raw`].
    pub async fn lookup(
        &self,
        map: &MapName,
        keys: impl IntoIterator<Item = impl Into<Key>>,
        options: LookupOptions,
    ) -> Result<Vec<LookupResult>, Error> {
        self.lookup_call(&LookupCall::new(map, keys, &options))
            .await
    }

    pub(crate) async fn lookup_call(&self, call: &LookupCall) -> Result<Vec<LookupResult>, Error> {
        call.check()?;
        let resp = self
            .call(|mut c| {
                let req = call.request.clone();
                async move { c.lookup(req).await }
            })
            .await?;
        call.results(resp.results)
    }

    /// Groups the map's entries and computes aggregates per group in the
    /// daemon, in one walk ([`AggregateOptions`]): "the ten destinations
    /// with the most bytes" without sending the entries. Errors:
    /// INVALID_ARGUMENT for a filter, group-by path or field that does not
    /// fit the map's types (the message names it), RESOURCE_EXHAUSTED for
    /// more groups than the daemon's `limits.max_groups`.
    pub async fn aggregate(
        &self,
        map: &MapName,
        options: AggregateOptions,
    ) -> Result<AggregateResult, Error> {
        typed::parse_render(options.render()).map_err(Error::render)?;
        let req = options.request(map);
        let resp = self
            .call(|mut c| {
                let req = req.clone();
                async move { c.aggregate_map(req).await }
            })
            .await?;
        let ops: Vec<_> = options.aggregates().iter().map(|a| a.op()).collect();
        AggregateResult::from_proto(resp, &ops)
    }

    /// Watches a map; see [`Watch`](crate::Watch).
    pub fn watch(&self, map: &MapName, options: crate::WatchOptions) -> crate::Watch {
        crate::Watch::new(self.inner.clone(), map.clone(), options, self.retry.clone())
    }

    /// Drains a map: reads and deletes its entries, each chunk kept by the
    /// daemon until acknowledged; see [`Drain`](crate::Drain).
    pub fn drain(&self, map: &MapName, options: crate::DrainOptions) -> crate::Drain {
        crate::Drain::new(self.inner.clone(), map.clone(), options, self.retry.clone())
    }

    /// Dumps a map; see [`Dump`].
    pub fn dump(&self, map: &MapName, options: DumpOptions) -> Dump {
        Dump::new(self.inner.clone(), map.clone(), options, self.retry.clone())
    }
}
