//! The admin API (`proto/ratelimitd/admin/v1/admin.proto`), served on the gRPC port with
//! `--admin`: inspect the counters of a descriptor without consuming, and reset them.

use std::sync::Arc;

use tonic::{Request, Response, Status};

use super::grpc::to_status;
use crate::engine::Engine;

/// Code generated from the proto at build time.
#[allow(missing_docs, clippy::all)]
pub mod pb {
    tonic::include_proto!("ratelimitd.admin.v1");
}

pub(crate) use pb::admin_server::AdminServer;
use pb::{Counter, CounterRequest, CounterResponse, ResetResponse};

/// The admin service over an [`Engine`].
pub(crate) struct Admin {
    engine: Arc<Engine>,
}

impl Admin {
    /// Serves `engine`'s counters.
    pub(crate) fn new(engine: Arc<Engine>) -> Self {
        Admin { engine }
    }
}

fn entries(req: &CounterRequest) -> Vec<(&str, &str)> {
    req.entries
        .iter()
        .map(|e| (e.key.as_str(), e.value.as_str()))
        .collect()
}

#[tonic::async_trait]
impl pb::admin_server::Admin for Admin {
    async fn get_counters(
        &self,
        request: Request<CounterRequest>,
    ) -> Result<Response<CounterResponse>, Status> {
        let req = request.get_ref();
        let views = self
            .engine
            .inspect(&req.domain, &entries(req))
            .await
            .map_err(to_status)?;
        let counters = views
            .into_iter()
            .map(|v| Counter {
                name: v.limit.name.as_deref().unwrap_or_default().to_owned(),
                algorithm: v.algorithm.as_str().to_owned(),
                requests_per_unit: v.limit.requests_per_unit,
                unit: v.limit.unit.as_str().to_owned(),
                window_seconds: v.limit.window.as_secs(),
                used: v.used,
                remaining: v.remaining,
                reset_ms: u64::try_from(v.reset.as_millis()).unwrap_or(u64::MAX),
            })
            .collect();
        Ok(Response::new(CounterResponse { counters }))
    }

    async fn reset_counters(
        &self,
        request: Request<CounterRequest>,
    ) -> Result<Response<ResetResponse>, Status> {
        let req = request.get_ref();
        let reset = self
            .engine
            .reset(&req.domain, &entries(req))
            .await
            .map_err(to_status)?;
        tracing::info!(domain = %req.domain, counters = reset, "admin: counters reset");
        Ok(Response::new(ResetResponse {
            reset: u32::try_from(reset).unwrap_or(u32::MAX),
        }))
    }
}
