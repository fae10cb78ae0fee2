//! The admin API (`proto/ratelimitd/admin/v1/admin.proto`), served on the admin listener
//! (`--admin-addr`, behind tokens) or, deprecated, on the gRPC port with `--admin`: inspect the
//! counters of a descriptor without consuming, reset them, and the operator's overrides (on
//! the admin listener only: they need to know who calls).

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

use super::admin_listener::{Caller, rfc3339};
use crate::config::overrides::{OverrideRecord, parse_request};
use crate::overrides::{ChangeError, Overrides};
use crate::value::{OwnedEntries, borrowed};
pub(crate) use pb::admin_server::AdminServer;
use pb::{
    ClearHoldsResponse, Counter, CounterRequest, CounterResponse, DeleteOverrideRequest,
    DeleteOverrideResponse, HoldsResponse, LimitHolds, ListOverridesRequest, ListOverridesResponse,
    OverrideLimit, ResetResponse, SetOverrideRequest, SetOverrideResponse, TopDescriptor, TopEntry,
    TopLimit, TopRequest, TopResponse,
};

/// The admin service over an [`Engine`].
pub(crate) struct Admin {
    engine: Arc<Engine>,
    /// The overrides; `None` where the caller is not known (the gRPC port's `--admin`).
    overrides: Option<Arc<Overrides>>,
}

impl Admin {
    /// Serves `engine`'s counters.
    pub(crate) fn new(engine: Arc<Engine>) -> Self {
        Admin {
            engine,
            overrides: None,
        }
    }

    /// Serves the operator's `overrides` too (behind the admin listener's tokens).
    pub(crate) fn with_overrides(mut self, overrides: Arc<Overrides>) -> Self {
        self.overrides = Some(overrides);
        self
    }

    fn overrides(&self) -> Result<&Overrides, Status> {
        self.overrides.as_deref().ok_or_else(|| {
            Status::failed_precondition(
                "overrides are set on the admin listener (--admin-addr), which asks who calls",
            )
        })
    }
}

/// The name of the token the call bore (the admin listener notes it).
fn caller<T>(request: &Request<T>) -> String {
    request
        .extensions()
        .get::<Caller>()
        .map_or_else(|| "unknown".to_owned(), |c| c.0.to_string())
}

/// A limit of the API as the JSON an override keeps (unset fields left out).
fn limit_json(l: &OverrideLimit) -> serde_json::Value {
    let mut m = serde_json::Map::new();
    m.insert("requests_per_unit".into(), l.requests_per_unit.into());
    for (name, value) in [
        ("unit", &l.unit),
        ("name", &l.name),
        ("algorithm", &l.algorithm),
        ("accounting", &l.accounting),
        ("calendar", &l.calendar),
        ("top_values", &l.top_values),
    ] {
        if !value.is_empty() {
            m.insert(name.into(), value.clone().into());
        }
    }
    for (name, value) in [("burst", l.burst), ("unit_multiplier", l.unit_multiplier)] {
        if value > 0 {
            m.insert(name.into(), value.into());
        }
    }
    serde_json::Value::Object(m)
}

/// A kept limit as the API shows it.
fn limit_pb(v: &serde_json::Value) -> OverrideLimit {
    let text = |name: &str| v[name].as_str().unwrap_or_default().to_owned();
    let number = |name: &str| v[name].as_u64().unwrap_or_default();
    OverrideLimit {
        requests_per_unit: number("requests_per_unit"),
        unit: text("unit"),
        name: text("name"),
        algorithm: text("algorithm"),
        burst: number("burst"),
        unit_multiplier: number("unit_multiplier"),
        accounting: text("accounting"),
        calendar: text("calendar"),
        top_values: text("top_values"),
    }
}

fn override_pb(r: &OverrideRecord) -> pb::Override {
    pb::Override {
        id: r.id.clone(),
        domain: r.domain.clone(),
        entries: r
            .entries
            .iter()
            .map(|e| pb::Entry {
                key: e.key.clone(),
                value: e.value.clone(),
                escaped: false,
            })
            .collect(),
        limits: r.limits.iter().map(limit_pb).collect(),
        expires_at: r.expires_at_ms.map(rfc3339).unwrap_or_default(),
        reason: r.reason.clone(),
        created_by: r.created_by.clone(),
        created_at: rfc3339(r.created_at_ms),
    }
}

fn change_status(e: ChangeError) -> Status {
    match e {
        ChangeError::Full(_) => Status::resource_exhausted(e.to_string()),
        ChangeError::Store(_) => Status::unavailable(e.to_string()),
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

    async fn set_override(
        &self,
        request: Request<SetOverrideRequest>,
    ) -> Result<Response<SetOverrideResponse>, Status> {
        let overrides = self.overrides()?;
        let by = caller(&request);
        let req = request.into_inner();
        if req.entries.iter().any(|e| e.escaped) {
            return Err(Status::invalid_argument(
                "entries: an override names text; escaped entries are not taken",
            ));
        }
        let mut body = serde_json::json!({
            "domain": req.domain,
            "entries": req.entries.iter().map(|e| {
                serde_json::json!({ "key": e.key, "value": e.value })
            }).collect::<Vec<_>>(),
            "limits": req.limits.iter().map(limit_json).collect::<Vec<_>>(),
            "reason": req.reason,
        });
        if !req.ttl.is_empty() {
            body["ttl"] = serde_json::Value::String(req.ttl);
        }
        let parsed = parse_request(body.to_string().as_bytes(), overrides.compile())
            .map_err(|e| Status::invalid_argument(e.to_string()))?;
        let (record, _) = overrides.set(parsed, &by).await.map_err(change_status)?;
        Ok(Response::new(SetOverrideResponse {
            id: record.id,
            expires_at: record.expires_at_ms.map(rfc3339).unwrap_or_default(),
        }))
    }

    async fn list_overrides(
        &self,
        request: Request<ListOverridesRequest>,
    ) -> Result<Response<ListOverridesResponse>, Status> {
        let overrides = self.overrides()?;
        let domain = &request.get_ref().domain;
        let all = overrides
            .list((!domain.is_empty()).then_some(domain.as_str()))
            .await
            .map_err(change_status)?;
        Ok(Response::new(ListOverridesResponse {
            overrides: all.iter().map(override_pb).collect(),
        }))
    }

    async fn delete_override(
        &self,
        request: Request<DeleteOverrideRequest>,
    ) -> Result<Response<DeleteOverrideResponse>, Status> {
        let overrides = self.overrides()?;
        let by = caller(&request);
        let id = request.into_inner().id;
        match overrides.delete(&id, &by).await.map_err(change_status)? {
            Some(_) => Ok(Response::new(DeleteOverrideResponse { id })),
            None => Err(Status::not_found(format!("no override '{id}' is in force"))),
        }
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
