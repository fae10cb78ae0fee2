//! The HTTP side port: `/healthcheck`, `/metrics` (Prometheus text), `/rlconfig` and
//! `POST /json` (the RateLimitService in proto3 JSON, as envoyproxy/ratelimit serves it).

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use axum::Router;
use axum::body::Bytes;
use axum::extract::{DefaultBodyLimit, Query, State};
use axum::http::{StatusCode, header};
use axum::response::IntoResponse;
use axum::routing::{get, post};

use super::conn::{Tracker, accept};
use super::grpc::{to_request, to_response, to_status};
use super::json::{parse_request, response_json};
use super::wire::RateLimitRequest;
use crate::engine::Code;

use crate::engine::Engine;
use crate::limiter::Backend;
use crate::metrics::Metrics;

/// What the HTTP handlers read.
pub(crate) struct HttpState {
    /// The decision engine (for its config snapshot).
    pub engine: Arc<Engine>,
    /// Metrics to export.
    pub metrics: Arc<Metrics>,
    /// False once shutdown has begun, so load balancers stop sending traffic.
    pub serving: Arc<AtomicBool>,
    /// The backend, for its reachability.
    pub backend: Arc<dyn Backend>,
    /// Headers and bodies added to `/json` answers, as to gRPC ones.
    pub telling: super::grpc::Telling,
}

/// Largest request body (`POST /json`): the gRPC port's message bound.
pub(crate) const MAX_BODY_BYTES: usize = 1 << 20;
/// Longest time a client may take to send a request's headers.
pub(crate) const HEADER_TIMEOUT: Duration = Duration::from_secs(5);

/// The HTTP routes. A request must arrive and be answered within `request_timeout` (else
/// 408), with a body of at most [`MAX_BODY_BYTES`].
pub(crate) fn router(state: Arc<HttpState>, request_timeout: Duration) -> Router {
    Router::new()
        .route("/healthcheck", get(healthcheck))
        .route("/metrics", get(metrics))
        .route("/rlconfig", get(rlconfig))
        .route("/json", post(json_decide))
        .route("/top", get(top))
        .with_state(state)
        .layer(DefaultBodyLimit::max(MAX_BODY_BYTES))
        .layer(axum::middleware::from_fn(
            move |req: axum::extract::Request, next: axum::middleware::Next| async move {
                match tokio::time::timeout(request_timeout, next.run(req)).await {
                    Ok(response) => response,
                    Err(_) => (StatusCode::REQUEST_TIMEOUT, "request timed out\n").into_response(),
                }
            },
        ))
}

/// Serves `router` on `listener` over HTTP/1.1 until `stopped` resolves, then lets requests in
/// flight finish. Every connection is [`Tracked`](super::conn::Tracked): capped in number, cut
/// off when silent or not reading; headers must arrive within [`HEADER_TIMEOUT`].
pub(crate) async fn serve(
    listener: tokio::net::TcpListener,
    router: Router,
    tracker: Tracker,
    stopped: impl std::future::Future<Output = ()>,
) -> std::io::Result<()> {
    let graceful = hyper_util::server::graceful::GracefulShutdown::new();
    let mut builder = hyper::server::conn::http1::Builder::new();
    builder
        .timer(hyper_util::rt::TokioTimer::new())
        .header_read_timeout(HEADER_TIMEOUT)
        .max_buf_size(64 << 10);
    tokio::pin!(stopped);
    loop {
        let (tcp, _) = tokio::select! {
            accepted = accept(&listener, "HTTP") => accepted,
            () = &mut stopped => break,
        };
        let Some(io) = tracker.admit(tcp) else {
            continue;
        };
        let service = hyper_util::service::TowerToHyperService::new(router.clone());
        let conn = builder.serve_connection(hyper_util::rt::TokioIo::new(io), service);
        let conn = graceful.watch(conn);
        tokio::spawn(async move {
            if let Err(e) = conn.await {
                tracing::debug!(error = %e, "HTTP connection ended");
            }
        });
    }
    graceful.shutdown().await;
    Ok(())
}

/// 200 while serving, even with the backend down: the failure mode decides what requests get,
/// and failing every replica's probe when a shared Redis blips would only add an outage.
/// The body says when the backend is unreachable.
async fn healthcheck(State(state): State<Arc<HttpState>>) -> impl IntoResponse {
    if !state.serving.load(Ordering::SeqCst) {
        return (StatusCode::INTERNAL_SERVER_ERROR, "shutting down");
    }
    if state.backend.is_reachable() {
        (StatusCode::OK, "OK")
    } else {
        (StatusCode::OK, "OK\nbackend: unavailable")
    }
}

async fn metrics(State(state): State<Arc<HttpState>>) -> impl IntoResponse {
    let mut text = state.metrics.encode();
    // Seen once more: a removed rule's series go after their grace.
    state.metrics.decisions.scraped();
    let top = state.engine.top();
    if top.options().metrics > 0 {
        // OpenMetrics ends with `# EOF`: the heavy-hitter families go before it.
        let end = text.rfind("# EOF").unwrap_or(text.len());
        text.insert_str(
            end,
            &super::top::metrics_text(top, state.engine.longest_value()),
        );
    }
    (
        [(
            header::CONTENT_TYPE,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )],
        text,
    )
}

async fn top(
    State(state): State<Arc<HttpState>>,
    Query(params): Query<HashMap<String, String>>,
) -> axum::response::Response {
    super::top::top(&state.engine, params).await
}

async fn rlconfig(State(state): State<Arc<HttpState>>) -> impl IntoResponse {
    (
        [(header::CONTENT_TYPE, "text/plain; charset=utf-8")],
        state.engine.snapshot().dump(),
    )
}

/// `POST /json`: 200 when OK, 429 when over the limit, 400 with a message for a malformed
/// request, 503 or 500 when the backend could not decide.
async fn json_decide(State(state): State<Arc<HttpState>>, body: Bytes) -> axum::response::Response {
    let text = |status: StatusCode, message: String| {
        (
            status,
            [(header::CONTENT_TYPE, "text/plain; charset=utf-8")],
            message + "\n",
        )
            .into_response()
    };
    let req: RateLimitRequest = match parse_request(&body) {
        Ok(r) => r.into(),
        Err(e) => return text(StatusCode::BAD_REQUEST, e.to_string()),
    };
    let decided = match to_request(&req) {
        Err(e) => return text(StatusCode::BAD_REQUEST, e.to_string()),
        Ok(r) => state.engine.should_rate_limit_naming_rules(&r).await,
    };
    match decided {
        Ok(resp) => {
            let status = match resp.overall {
                Code::Ok => StatusCode::OK,
                Code::OverLimit => StatusCode::TOO_MANY_REQUESTS,
            };
            let refused_by: Vec<_> = resp.statuses.iter().map(|s| s.refused_by.clone()).collect();
            let out = to_response(
                &req,
                resp,
                &state.telling,
                super::headers::now_s(state.telling.headers),
                state.engine.longest_value(),
            );
            (
                status,
                [(header::CONTENT_TYPE, "application/json")],
                response_json(&out, &refused_by).to_string(),
            )
                .into_response()
        }
        // The same short messages (and logging) as the gRPC answer, with HTTP's codes.
        Err(e) => {
            let status = to_status(e);
            let code = match status.code() {
                tonic::Code::InvalidArgument => StatusCode::BAD_REQUEST,
                tonic::Code::Unavailable => StatusCode::SERVICE_UNAVAILABLE,
                _ => StatusCode::INTERNAL_SERVER_ERROR,
            };
            text(code, status.message().to_owned())
        }
    }
}
