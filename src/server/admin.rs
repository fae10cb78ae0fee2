//! The admin API (`proto/ratelimitd/admin/v1/admin.proto`), served on the gRPC port with
//! `--admin`: inspect the counters of a descriptor without consuming, and reset them.

use std::sync::Arc;

use tonic::{Request, Response, Status};

use super::grpc::to_status;
use crate::engine::Engine;
use crate::engine::top::{DEFAULT_TOP_N, TopQuery};

/// Code generated from the proto at build time.
#[allow(missing_docs, clippy::all)]
pub mod pb {
    tonic::include_proto!("ratelimitd.admin.v1");
}

use crate::value::{OwnedEntries, borrowed};
pub(crate) use pb::admin_server::AdminServer;
use pb::{
    ClearHoldsResponse, Counter, CounterRequest, CounterResponse, HoldsResponse, LimitHolds,
    ResetResponse, TopDescriptor, TopEntry, TopLimit, TopRequest, TopResponse,
};

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

/// An entry's key and value as bytes: as written, or, where it is marked `escaped`, read as
/// `/top` escapes what is not UTF-8 (`\xHH` for such a byte, `\\` for `\`).
fn entry_bytes(e: &pb::Entry) -> Result<(Vec<u8>, Vec<u8>), Status> {
    if !e.escaped {
        return Ok((e.key.as_bytes().to_vec(), e.value.as_bytes().to_vec()));
    }
    let read = |s: &str| {
        crate::value::unshown(s).ok_or_else(|| {
            Status::invalid_argument(format!(
                "'{s}' is no escaped value (\\xHH for a byte, \\\\ for a backslash)"
            ))
        })
    };
    Ok((read(&e.key)?, read(&e.value)?))
}

/// Entries as bytes (see [`entry_bytes`]).
fn entries(entries: &[pb::Entry]) -> Result<OwnedEntries, Status> {
    entries.iter().map(entry_bytes).collect()
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
            .inspect(&req.domain, &borrowed(&entries(&req.entries)?))
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
            .reset(&req.domain, &borrowed(&entries(&req.entries)?))
            .await
            .map_err(to_status)?;
        tracing::info!(domain = %req.domain, counters = reset, "admin: counters reset");
        Ok(Response::new(ResetResponse {
            reset: u32::try_from(reset).unwrap_or(u32::MAX),
        }))
    }

    async fn get_holds(
        &self,
        request: Request<CounterRequest>,
    ) -> Result<Response<HoldsResponse>, Status> {
        let req = request.get_ref();
        let limits = self
            .engine
            .holds(&req.domain, &borrowed(&entries(&req.entries)?))
            .await
            .map_err(to_status)?;
        let limits = limits
            .into_iter()
            .map(|(limit, algorithm, holds)| LimitHolds {
                name: limit.name.as_deref().unwrap_or_default().to_owned(),
                algorithm: algorithm.as_str().to_owned(),
                requests_per_unit: limit.requests_per_unit,
                window_seconds: limit.window.as_secs(),
                holds: holds
                    .into_iter()
                    .map(|h| {
                        let (id, escaped) = h.id.shown();
                        pb::Hold {
                            id,
                            escaped,
                            hits: h.hits,
                            ends_in_ms: u64::try_from(h.ends_in.as_millis()).unwrap_or(u64::MAX),
                        }
                    })
                    .collect(),
            })
            .collect();
        Ok(Response::new(HoldsResponse { limits }))
    }

    async fn clear_holds(
        &self,
        request: Request<CounterRequest>,
    ) -> Result<Response<ClearHoldsResponse>, Status> {
        let req = request.get_ref();
        let cleared = self
            .engine
            .clear_holds(&req.domain, &borrowed(&entries(&req.entries)?))
            .await
            .map_err(to_status)?;
        tracing::info!(domain = %req.domain, holds = cleared, "admin: holds cleared");
        Ok(Response::new(ClearHoldsResponse {
            cleared: u32::try_from(cleared).unwrap_or(u32::MAX),
        }))
    }

    async fn get_top(&self, request: Request<TopRequest>) -> Result<Response<TopResponse>, Status> {
        let req = request.into_inner();
        let nonempty = |s: String| (!s.is_empty()).then_some(s);
        let query = TopQuery {
            domain: nonempty(req.domain),
            limit: nonempty(req.limit),
            prefix: entries(&req.entries)?,
            n: match req.n {
                0 => DEFAULT_TOP_N,
                n => n as usize,
            },
        };
        let report = self.engine.top_report(&query).await.map_err(to_status)?;
        Ok(Response::new(TopResponse {
            window_seconds: report.window.as_secs(),
            untracked_hits: report.untracked_hits,
            limits: report
                .limits
                .into_iter()
                .map(|l| TopLimit {
                    r#override: l.info.index == crate::top::OVERRIDE,
                    domain: l.info.domain,
                    rule: l.info.rule,
                    name: l.info.name.unwrap_or_default(),
                    algorithm: l.info.algorithm,
                    unit: l.info.unit,
                    window_seconds: l.info.window_seconds,
                    requests_per_unit: l.info.requests_per_unit,
                    values: l.values.as_str().to_owned(),
                    hits: l.hits,
                    absent_at_most: l.floor,
                    descriptors: l
                        .descriptors
                        .into_iter()
                        .map(|d| TopDescriptor {
                            entries: d
                                .entries
                                .into_iter()
                                .map(|e| TopEntry {
                                    key: e.key,
                                    value: e.value,
                                    escaped: e.escaped,
                                })
                                .collect(),
                            hits: d.hits,
                            over_limit: d.over_limit,
                            error: d.error,
                            over_limit_error: d.over_limit_error,
                            remaining: d.remaining,
                            elided: d.elided,
                        })
                        .collect(),
                })
                .collect(),
        }))
    }
}
