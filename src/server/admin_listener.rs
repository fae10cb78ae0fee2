//! The admin listener (`--admin-addr`): its own port, HTTP/1.1 and HTTP/2 (cleartext with
//! prior knowledge, or by ALPN over TLS) on one socket, serving the `ratelimitd.admin.v1.Admin` gRPC service and the
//! JSON API of the operator's overrides:
//!
//! - `PUT /v1/overrides`: sets one (`200 {"id", "expires_at"}`); a malformed one is `400`
//!   naming the field, and changes nothing; past `--max-overrides`, `409`.
//! - `GET /v1/overrides[?domain=d]`: those in force.
//! - `DELETE /v1/overrides/<id>`: `200`, or `404` for an id not in force.
//!
//! Every call needs `Authorization: Bearer <token>` with a token of `--admin-token-file`
//! ([`super::auth`]); without one: `401` (gRPC: `UNAUTHENTICATED`), before anything is read
//! of the body. The caller's token name is who `created_by` and the change's log line name.
//! Without a token file, the listener is TLS with a client CA (`--admin-tls-*`): the verified
//! certificate each connection presented is who calls.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::body::Bytes;
use axum::extract::{DefaultBodyLimit, Path, Query, State};
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{delete, get};
use futures_util::Stream;
use serde_json::{Value, json};

use super::auth::Tokens;
use super::conn::{Tracked, Tracker, accept};
use super::tls::Accepted;
use crate::config::overrides::{OverrideRecord, parse_request};
use crate::metrics::AdminMetrics;
use crate::overrides::{ChangeError, Overrides};

/// Largest body the admin listener reads (an override is refused past 16 KiB, with a message).
const MAX_ADMIN_BODY_BYTES: usize = 2 << 20;
/// Streams one HTTP/2 connection to the admin listener may have open.
const MAX_ADMIN_STREAMS: u32 = 64;

/// Who called: the name of the token presented (or, on a listener with client certificates
/// and no tokens, the certificate's).
#[derive(Clone, Debug)]
pub(crate) struct Caller(pub(crate) Arc<str>);

/// The name of the verified client certificate a connection presented.
#[derive(Clone, Debug)]
struct Certified(Arc<str>);

/// What the admin listener's handlers read.
pub(crate) struct AdminState {
    /// `None`: no token file; a verified client certificate is who calls.
    pub(crate) tokens: Option<Arc<Tokens>>,
    pub(crate) overrides: Arc<Overrides>,
    pub(crate) metrics: AdminMetrics,
}

/// The admin listener's routes: `grpc` (the Admin service's routes) and the JSON API, behind
/// the token check, each call answered within `request_timeout`.
pub(crate) fn router(state: Arc<AdminState>, grpc: Router, request_timeout: Duration) -> Router {
    let api = Router::new()
        .route("/v1/overrides", get(list).put(set))
        .route("/v1/overrides/{id}", delete(remove))
        .with_state(state.clone());
    grpc.merge(api)
        .layer(axum::middleware::from_fn(not_found_for_http))
        .layer(DefaultBodyLimit::max(MAX_ADMIN_BODY_BYTES))
        .layer(axum::middleware::from_fn_with_state(state, authenticate))
        .layer(axum::middleware::from_fn(
            move |req: axum::extract::Request, next: axum::middleware::Next| async move {
                match tokio::time::timeout(request_timeout, next.run(req)).await {
                    Ok(response) => response,
                    Err(_) => (StatusCode::REQUEST_TIMEOUT, "request timed out\n").into_response(),
                }
            },
        ))
}

/// A call that is not gRPC to a path the JSON API does not have: `404` (the gRPC routes would
/// answer `200` with `grpc-status: 12`, and a mistyped `curl -X DELETE` would look like a
/// success).
async fn not_found_for_http(req: axum::extract::Request, next: axum::middleware::Next) -> Response {
    let grpc = req
        .headers()
        .get(header::CONTENT_TYPE)
        .is_some_and(|v| v.as_bytes().starts_with(b"application/grpc"));
    let path = req.uri().path();
    let api = path == "/v1/overrides"
        || path
            .strip_prefix("/v1/overrides/")
            .is_some_and(|id| !id.is_empty() && !id.contains('/'));
    if grpc || api {
        return next.run(req).await;
    }
    let message = format!("no such path: {path} (the API is /v1/overrides)");
    error(StatusCode::NOT_FOUND, message, None)
}

/// Lets through only a call bearing a token in force (or, without tokens, made on a
/// connection with a verified client certificate), its caller noted for the handler.
async fn authenticate(
    State(state): State<Arc<AdminState>>,
    mut req: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    let grpc = req
        .headers()
        .get(header::CONTENT_TYPE)
        .is_some_and(|v| v.as_bytes().starts_with(b"application/grpc"));
    let bearer = req
        .headers()
        .get(header::AUTHORIZATION)
        .map(|v| v.as_bytes());
    let who = match &state.tokens {
        Some(tokens) => tokens.caller(bearer),
        None => req.extensions().get::<Certified>().map(|c| c.0.clone()),
    };
    match who {
        Some(name) => {
            req.extensions_mut().insert(Caller(name));
            next.run(req).await
        }
        None => {
            state.metrics.request("unauthenticated");
            let message = "a valid admin token is needed: Authorization: Bearer <token>";
            if grpc {
                tonic::Status::unauthenticated(message)
                    .into_http::<axum::body::Body>()
                    .into_response()
            } else {
                (
                    StatusCode::UNAUTHORIZED,
                    [(header::WWW_AUTHENTICATE, "Bearer")],
                    axum::Json(json!({ "error": message })),
                )
                    .into_response()
            }
        }
    }
}

/// An error answer: `{"error": message}` (and the field at fault, if one is).
fn error(status: StatusCode, message: String, field: Option<String>) -> Response {
    let mut body = json!({ "error": message });
    if let Some(f) = field {
        body["field"] = Value::String(f);
    }
    (status, axum::Json(body)).into_response()
}

fn change_error(state: &AdminState, e: ChangeError) -> Response {
    match e {
        ChangeError::Full(_) => {
            state.metrics.request("refused");
            error(StatusCode::CONFLICT, e.to_string(), None)
        }
        ChangeError::Store(_) => {
            state.metrics.request("unavailable");
            error(StatusCode::SERVICE_UNAVAILABLE, e.to_string(), None)
        }
    }
}

/// An instant in milliseconds since the epoch as RFC 3339, UTC.
pub(crate) fn rfc3339(ms: u64) -> String {
    i64::try_from(ms)
        .ok()
        .and_then(|ms| jiff::Timestamp::from_millisecond(ms).ok())
        .map_or_else(String::new, |t| t.to_string())
}

/// An override as the API shows it.
fn shown(r: &OverrideRecord) -> Value {
    json!({
        "id": r.id,
        "domain": r.domain,
        "entries": r.entries,
        "limits": r.limits,
        "expires_at": r.expires_at_ms.map(rfc3339),
        "reason": r.reason,
        "created_by": r.created_by,
        "created_at": rfc3339(r.created_at_ms),
    })
}

async fn set(
    State(state): State<Arc<AdminState>>,
    caller: axum::Extension<Caller>,
    body: Bytes,
) -> Response {
    let req = match parse_request(&body, state.overrides.compile()) {
        Ok(r) => r,
        Err(e) => {
            state.metrics.request("invalid");
            return error(StatusCode::BAD_REQUEST, e.to_string(), Some(e.field));
        }
    };
    match state.overrides.set(req, &caller.0.0).await {
        Ok((record, _)) => {
            state.metrics.request("ok");
            (
                StatusCode::OK,
                axum::Json(json!({
                    "id": record.id,
                    "expires_at": record.expires_at_ms.map(rfc3339),
                })),
            )
                .into_response()
        }
        Err(e) => change_error(&state, e),
    }
}

async fn list(
    State(state): State<Arc<AdminState>>,
    Query(params): Query<HashMap<String, String>>,
) -> Response {
    if let Some(unknown) = params.keys().find(|k| *k != "domain") {
        state.metrics.request("invalid");
        return error(
            StatusCode::BAD_REQUEST,
            format!("unknown parameter '{unknown}'; the one known is domain"),
            Some(unknown.clone()),
        );
    }
    match state
        .overrides
        .list(params.get("domain").map(String::as_str))
        .await
    {
        Ok(all) => {
            state.metrics.request("ok");
            let shown: Vec<Value> = all.iter().map(shown).collect();
            axum::Json(json!({ "overrides": shown })).into_response()
        }
        Err(e) => change_error(&state, e),
    }
}

async fn remove(
    State(state): State<Arc<AdminState>>,
    caller: axum::Extension<Caller>,
    Path(id): Path<String>,
) -> Response {
    match state.overrides.delete(&id, &caller.0.0).await {
        Ok(Some(_)) => {
            state.metrics.request("ok");
            axum::Json(json!({ "id": id })).into_response()
        }
        Ok(None) => {
            state.metrics.request("invalid");
            error(
                StatusCode::NOT_FOUND,
                format!("no override '{id}' is in force"),
                None,
            )
        }
        Err(e) => change_error(&state, e),
    }
}

/// The connections accepted on `listener` under `tracker`'s bounds, none with a certificate.
pub(crate) fn plain(
    listener: tokio::net::TcpListener,
    tracker: Tracker,
) -> impl Stream<Item = (Tracked<tokio::net::TcpStream>, Option<Arc<str>>)> + Send {
    futures_util::stream::unfold((listener, tracker), |(listener, tracker)| async move {
        loop {
            let (tcp, _) = accept(&listener, "admin").await;
            if let Some(io) = tracker.admit(tcp) {
                return Some(((io, None), (listener, tracker)));
            }
        }
    })
}

/// TLS connections, each with the name of the client certificate it presented when `mutual`
/// (the TLS config then required one from the client CA): `cert:sha256:` and the first 16
/// hex digits of the certificate's SHA-256, which `created_by` and the log lines carry.
pub(crate) fn certified(
    incoming: impl Stream<Item = std::io::Result<Accepted>> + Send,
    mutual: bool,
) -> impl Stream<Item = (Accepted, Option<Arc<str>>)> + Send {
    use futures_util::StreamExt;
    incoming.filter_map(move |tls| {
        std::future::ready(tls.ok().map(|tls| {
            let name = mutual
                .then(|| tls.get_ref().1.peer_certificates()?.first().map(cert_name))
                .flatten();
            (tls, name)
        }))
    })
}

fn cert_name(cert: &tokio_rustls::rustls::pki_types::CertificateDer<'_>) -> Arc<str> {
    let digest = ring::digest::digest(&ring::digest::SHA256, cert.as_ref());
    let hex: String = digest.as_ref()[..8]
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    format!("cert:sha256:{hex}").into()
}

/// Serves `router` on the connections `incoming` yields, HTTP/1.1 and HTTP/2 alike, until
/// `stopped`, then lets calls in flight finish. Connections are bounded as the HTTP ports' are
/// (see [`plain`]); headers must arrive within the HTTP ports' bound. A connection that
/// presented a client certificate carries its name to every call on it.
pub(crate) async fn serve<IO>(
    incoming: impl Stream<Item = (IO, Option<Arc<str>>)> + Send,
    router: Router,
    stopped: impl std::future::Future<Output = ()>,
) where
    IO: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    use futures_util::StreamExt;
    let graceful = hyper_util::server::graceful::GracefulShutdown::new();
    let mut builder =
        hyper_util::server::conn::auto::Builder::new(hyper_util::rt::TokioExecutor::new());
    builder
        .http1()
        .timer(hyper_util::rt::TokioTimer::new())
        .header_read_timeout(super::http::HEADER_TIMEOUT)
        .max_buf_size(64 << 10);
    builder
        .http2()
        .timer(hyper_util::rt::TokioTimer::new())
        .max_concurrent_streams(MAX_ADMIN_STREAMS)
        .max_header_list_size(16 << 10);
    tokio::pin!(stopped);
    let mut incoming = std::pin::pin!(incoming);
    loop {
        let (io, certificate) = tokio::select! {
            next = incoming.next() => match next {
                Some(next) => next,
                None => break,
            },
            () = &mut stopped => break,
        };
        let routes = match certificate {
            Some(name) => router.clone().layer(axum::Extension(Certified(name))),
            None => router.clone(),
        };
        let service = hyper_util::service::TowerToHyperService::new(routes);
        let conn = builder
            .serve_connection(hyper_util::rt::TokioIo::new(io), service)
            .into_owned();
        let conn = graceful.watch(conn);
        tokio::spawn(async move {
            if let Err(e) = conn.await {
                tracing::debug!(error = %e, "admin connection ended");
            }
        });
    }
    graceful.shutdown().await;
}
