//! The HTTP side port: `/healthcheck`, `/metrics` (Prometheus text) and `/rlconfig`.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use axum::Router;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::IntoResponse;
use axum::routing::get;

use crate::metrics::Metrics;
use crate::service::RateLimiter;

/// What the HTTP handlers read.
pub struct HttpState {
    /// The decision engine (for its config snapshot).
    pub limiter: Arc<RateLimiter>,
    /// Metrics to export.
    pub metrics: Arc<Metrics>,
    /// False once shutdown has begun, so load balancers stop sending traffic.
    pub serving: Arc<AtomicBool>,
}

/// The HTTP routes.
pub fn router(state: Arc<HttpState>) -> Router {
    Router::new()
        .route("/healthcheck", get(healthcheck))
        .route("/metrics", get(metrics))
        .route("/rlconfig", get(rlconfig))
        .with_state(state)
}

async fn healthcheck(State(state): State<Arc<HttpState>>) -> impl IntoResponse {
    if state.serving.load(Ordering::SeqCst) {
        (StatusCode::OK, "OK")
    } else {
        (StatusCode::INTERNAL_SERVER_ERROR, "shutting down")
    }
}

async fn metrics(State(state): State<Arc<HttpState>>) -> impl IntoResponse {
    (
        [(
            header::CONTENT_TYPE,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )],
        state.metrics.encode(),
    )
}

async fn rlconfig(State(state): State<Arc<HttpState>>) -> impl IntoResponse {
    (
        [(header::CONTENT_TYPE, "text/plain; charset=utf-8")],
        state.limiter.snapshot().dump(),
    )
}
