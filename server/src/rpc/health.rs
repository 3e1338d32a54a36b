//! grpc.health.v1.Health whose Watch streams end when the daemon stops, so
//! that a probe watching the daemon cannot hold its shutdown open.

use std::pin::Pin;

use futures::{Stream, StreamExt as _};
use tokio::sync::watch;
use tonic::{Request, Response, Status};
use tonic_health::{
    pb::{
        HealthCheckRequest, HealthCheckResponse,
        health_server::{Health, HealthServer},
    },
    server::{HealthReporter, HealthService},
};

/// The health service of `reporter`; Watch streams end once `stop` turns
/// true (after they have reported NOT_SERVING).
pub(crate) fn service(
    reporter: HealthReporter,
    stop: watch::Receiver<bool>,
) -> HealthServer<StoppingHealth> {
    HealthServer::new(StoppingHealth {
        inner: HealthService::from_health_reporter(reporter),
        stop,
    })
}

/// See [`service`].
#[derive(Debug)]
pub(crate) struct StoppingHealth {
    inner: HealthService,
    stop: watch::Receiver<bool>,
}

type WatchStream = Pin<Box<dyn Stream<Item = Result<HealthCheckResponse, Status>> + Send>>;

#[tonic::async_trait]
impl Health for StoppingHealth {
    async fn check(
        &self,
        request: Request<HealthCheckRequest>,
    ) -> Result<Response<HealthCheckResponse>, Status> {
        self.inner.check(request).await
    }

    type WatchStream = WatchStream;

    async fn watch(
        &self,
        request: Request<HealthCheckRequest>,
    ) -> Result<Response<WatchStream>, Status> {
        let statuses = self.inner.watch(request).await?.into_inner();
        let mut stop = self.stop.clone();
        let stopped = async move {
            let _ = stop.wait_for(|s| *s).await;
        };
        Ok(Response::new(Box::pin(statuses.take_until(stopped))))
    }
}
