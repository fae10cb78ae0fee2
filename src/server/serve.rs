//! The listeners and the servers on them: gRPC (RLS, RLQS, health and the admin API), plain or
//! TLS, and the HTTP endpoints, each behind its connection bounds.

use std::sync::Arc;
use std::time::Duration;

use envoy_types::pb::envoy::service::rate_limit_quota::v3::rate_limit_quota_service_server::RateLimitQuotaServiceServer;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_server::RateLimitServiceServer;
use tokio::net::{TcpListener, TcpSocket, UnixListener};
use tonic::transport::server::TcpIncoming;

use super::admin::{Admin, AdminServer};
use super::conn::{BudgetLayer, ConnLimits, Tracked, Tracker};
use super::grpc::GrpcService;
use super::headers::HeaderMode;
use super::http::HttpState;
use super::rlqs::RlqsService;
use super::tls::GrpcTls;
use crate::engine::Engine;
use crate::metrics::Metrics;
use crate::shutdown::{Serving, Stop, Tasks};

/// HTTP/2 streams one gRPC connection may have open: far more than a busy Envoy keeps in
/// flight on one connection, few enough that a client withholding flow-control credit holds a
/// bounded number of answers.
pub const MAX_STREAMS_PER_CONNECTION: u32 = 1024;
/// Largest gRPC request message: a request at every per-request bound is well within it.
pub const MAX_MESSAGE_BYTES: usize = 1 << 20;
/// Largest header block a gRPC client may send.
const MAX_HEADER_BYTES: u32 = 16 << 10;
/// Connections the HTTP ports (health, metrics, debug, `/json`) hold together.
pub const MAX_HTTP_CONNECTIONS: usize = 512;
/// Connections the kernel queues on a listening socket before the service accepts them.
const BACKLOG: u32 = 1024;

/// How the servers serve.
pub(crate) struct ServerOptions {
    /// TLS on the gRPC listener.
    pub(crate) grpc_tls: Option<GrpcTls>,
    /// Rate-limit headers added to responses.
    pub(crate) response_headers: HeaderMode,
    /// Serve the admin API.
    pub(crate) admin: bool,
    /// Bounds of each gRPC connection.
    pub(crate) grpc_connections: ConnLimits,
    /// Bounds of the HTTP ports' connections.
    pub(crate) http_connections: ConnLimits,
    /// Longest time to receive and answer one request.
    pub(crate) request_timeout: Duration,
    /// How long in-flight calls may finish after shutdown begins.
    pub(crate) shutdown_grace: Duration,
}

/// The sockets the service serves on, bound by the caller (so that a port taken fails at
/// once, and a test can bind port 0 and know its port) and listening only once the service can
/// serve: before the first xDS config a client is refused, not left waiting on a socket that
/// never answers. [`bind`] makes one.
pub struct Listeners {
    /// For gRPC.
    pub grpc: GrpcSocket,
    /// For HTTP.
    pub http: TcpSocket,
    /// More sockets serving the same HTTP endpoints (`--debug-addr`, `--metrics-addr`).
    pub extra_http: Vec<TcpSocket>,
}

/// Where gRPC is served: a TCP socket, or a Unix socket (`--grpc-uds`).
pub enum GrpcSocket {
    /// Bound by [`bind`], not yet listening.
    Tcp(TcpSocket),
    /// Made at `path` with permissions `mode` when the service can serve. A socket file left
    /// there by an earlier run is replaced; any other file is an error.
    Unix {
        /// The socket's path.
        path: std::path::PathBuf,
        /// Its permission bits (e.g. `0o660`: the service's user and group may connect).
        mode: u32,
    },
}

impl From<TcpSocket> for GrpcSocket {
    fn from(socket: TcpSocket) -> Self {
        GrpcSocket::Tcp(socket)
    }
}

/// A socket bound to `addr` (address reuse on, as a listener binds) and not yet listening.
pub fn bind(addr: std::net::SocketAddr) -> std::io::Result<TcpSocket> {
    let socket = if addr.is_ipv4() {
        TcpSocket::new_v4()?
    } else {
        TcpSocket::new_v6()?
    };
    #[cfg(unix)]
    socket.set_reuseaddr(true)?;
    socket.bind(addr)?;
    Ok(socket)
}

/// A bound socket that could not listen.
#[derive(Debug, thiserror::Error)]
#[error("cannot listen on {addr}: {source}")]
pub struct ListenError {
    /// The socket's address, if it has one.
    pub addr: String,
    /// Why.
    pub source: std::io::Error,
}

/// Starts `socket` listening.
fn listen(socket: TcpSocket) -> Result<TcpListener, ListenError> {
    let addr = socket
        .local_addr()
        .map_or_else(|_| "an unbound socket".to_owned(), |a| a.to_string());
    socket
        .listen(BACKLOG)
        .map_err(|source| ListenError { addr, source })
}

/// A Unix socket at `path` with permissions `mode`, listening, replacing a socket file an
/// earlier run left there.
fn listen_unix(path: &std::path::Path, mode: u32) -> Result<UnixListener, ListenError> {
    use std::os::unix::fs::{FileTypeExt, PermissionsExt};
    let failed = |source| ListenError {
        addr: path.display().to_string(),
        source,
    };
    match std::fs::symlink_metadata(path) {
        Ok(m) if m.file_type().is_socket() => std::fs::remove_file(path).map_err(failed)?,
        Ok(_) => {
            return Err(failed(std::io::Error::new(
                std::io::ErrorKind::AlreadyExists,
                "a file that is not a socket is there",
            )));
        }
        Err(_) => {}
    }
    let listener = UnixListener::bind(path).map_err(failed)?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode)).map_err(failed)?;
    Ok(listener)
}

/// The gRPC listener, listening.
enum GrpcListener {
    Tcp(TcpListener),
    Unix(UnixListener),
}

/// The listeners, listening.
pub(crate) struct Listening {
    grpc: GrpcListener,
    http: TcpListener,
    extra_http: Vec<TcpListener>,
}

impl Listeners {
    /// Starts every socket listening.
    pub(crate) fn listen(self) -> Result<Listening, ListenError> {
        Ok(Listening {
            grpc: match self.grpc {
                GrpcSocket::Tcp(socket) => GrpcListener::Tcp(listen(socket)?),
                GrpcSocket::Unix { path, mode } => GrpcListener::Unix(listen_unix(&path, mode)?),
            },
            http: listen(self.http)?,
            extra_http: self
                .extra_http
                .into_iter()
                .map(listen)
                .collect::<Result<_, _>>()?,
        })
    }
}

/// What the servers serve: RLS over the engine, RLQS over the quota pools, and health.
pub(crate) struct Services<H> {
    /// The decision engine (RLS, `/json`, the admin API).
    pub(crate) engine: Arc<Engine>,
    /// The RLQS service.
    pub(crate) rlqs: RlqsService,
    /// The health service, which shutdown turns to NOT_SERVING.
    pub(crate) health: tonic_health::pb::health_server::HealthServer<H>,
    /// The backend, for `/healthcheck`.
    pub(crate) backend: Arc<dyn crate::limiter::Backend>,
}

/// Serves `services` on `listening` until `stop`; returns the two servers' futures.
pub(crate) fn serve<H: tonic_health::pb::health_server::Health>(
    options: &ServerOptions,
    listening: Listening,
    services: Services<H>,
    metrics: Arc<Metrics>,
    stop: &Stop,
    tasks: &mut Tasks,
) -> (Serving<tonic::transport::Error>, Serving<std::io::Error>) {
    let grpc_addr = match &listening.grpc {
        GrpcListener::Tcp(l) => l.local_addr().ok().map(|a| a.to_string()),
        GrpcListener::Unix(l) => l
            .local_addr()
            .ok()
            .and_then(|a| a.as_pathname().map(|p| format!("unix:{}", p.display()))),
    };
    let http_addr = listening.http.local_addr().ok();
    let state = Arc::new(HttpState {
        engine: services.engine.clone(),
        metrics: metrics.clone(),
        serving: stop.serving.clone(),
        backend: services.backend.clone(),
        headers: options.response_headers,
    });
    let grpc = serve_grpc(options, listening.grpc, services, &metrics, stop, tasks);
    let http = serve_http(
        listening.http,
        listening.extra_http,
        state,
        options,
        stop,
        tasks,
    );
    tracing::info!(grpc = ?grpc_addr, http = ?http_addr, "serving");
    (grpc, http)
}

/// The gRPC server on `listener`: rate limit service, quota service, health and (if enabled)
/// admin, plain or TLS, behind the per-connection bounds.
fn serve_grpc<H: tonic_health::pb::health_server::Health>(
    options: &ServerOptions,
    listener: GrpcListener,
    Services {
        engine,
        rlqs,
        health,
        backend: _,
    }: Services<H>,
    metrics: &Arc<Metrics>,
    stop: &Stop,
    tasks: &mut Tasks,
) -> Serving<tonic::transport::Error> {
    let admin = options.admin.then(|| {
        tracing::info!("admin API on the gRPC port");
        AdminServer::new(Admin::new(engine.clone()))
    });
    let conns = options.grpc_connections;
    let router = tonic::transport::Server::builder()
        .max_concurrent_streams(MAX_STREAMS_PER_CONNECTION)
        .http2_max_header_list_size(MAX_HEADER_BYTES)
        .timeout(options.request_timeout)
        .http2_keepalive_interval(Some(conns.idle_timeout / 3))
        .http2_keepalive_timeout(Some(conns.idle_timeout / 3))
        .layer(BudgetLayer {
            message_timeout: options.request_timeout,
        })
        .add_service(health)
        .add_service(
            RateLimitServiceServer::new(GrpcService::new(
                engine,
                metrics.clone(),
                options.response_headers,
            ))
            .max_decoding_message_size(MAX_MESSAGE_BYTES),
        )
        .add_service(
            RateLimitQuotaServiceServer::new(rlqs).max_decoding_message_size(MAX_MESSAGE_BYTES),
        )
        .add_optional_service(admin.map(|a| a.max_decoding_message_size(MAX_MESSAGE_BYTES)));
    let tracker = Tracker::new(conns);
    match (listener, &options.grpc_tls) {
        // Plain text only (settings refuse TLS with a Unix socket).
        (GrpcListener::Unix(listener), _) => {
            let accepted = futures_util::stream::unfold(listener, |l| async move {
                let accepted = l.accept().await.map(|(stream, _)| stream);
                Some((accepted, l))
            });
            let incoming = admitted(accepted, tracker);
            Box::pin(router.serve_with_incoming_shutdown(incoming, stop.stopped()))
        }
        (GrpcListener::Tcp(listener), None) => {
            let accepted = TcpIncoming::from(listener).with_nodelay(Some(true));
            let incoming = admitted(accepted, tracker);
            Box::pin(router.serve_with_incoming_shutdown(incoming, stop.stopped()))
        }
        (GrpcListener::Tcp(listener), Some(GrpcTls { files, config })) => {
            tracing::info!(mutual = files.client_ca.is_some(), "gRPC over TLS");
            let (incoming, tls_tasks) = super::tls::incoming(
                listener,
                files.clone(),
                config.clone(),
                tracker,
                metrics.clone(),
            );
            for task in tls_tasks {
                tasks.push(task);
            }
            Box::pin(router.serve_with_incoming_shutdown(incoming, stop.stopped()))
        }
    }
}

/// The connections `accepted` yields, each under `tracker`'s bounds (one past them is closed
/// at once).
fn admitted<IO>(
    accepted: impl futures_util::Stream<Item = std::io::Result<IO>>,
    tracker: Tracker,
) -> impl futures_util::Stream<Item = std::io::Result<Tracked<IO>>> {
    use futures_util::StreamExt;
    accepted.filter_map(move |accepted| {
        std::future::ready(match accepted {
            Ok(io) => tracker.admit(io).map(Ok),
            Err(e) => Some(Err(e)),
        })
    })
}

/// The HTTP endpoints on `listener` and on every `extra` listener. The HTTP ports share one
/// connection cap; no request-byte budget beyond the body limit.
fn serve_http(
    listener: TcpListener,
    extra: Vec<TcpListener>,
    state: Arc<HttpState>,
    options: &ServerOptions,
    stop: &Stop,
    tasks: &mut Tasks,
) -> Serving<std::io::Error> {
    let tracker = Tracker::new(options.http_connections);
    let routes = super::http::router(state, options.request_timeout);
    for l in extra {
        tracing::info!(http = ?l.local_addr().ok(), "serving HTTP endpoints here too");
        let serve = super::http::serve(l, routes.clone(), tracker.clone(), stop.stopped());
        tasks.push(tokio::spawn(async move {
            if let Err(e) = serve.await {
                tracing::error!(error = %e, "HTTP server failed");
            }
        }));
    }
    Box::pin(super::http::serve(
        listener,
        routes,
        tracker,
        stop.stopped(),
    ))
}
