//! The listeners and the servers on them: gRPC (RLS, RLQS, health and the admin API), plain or
//! TLS, and the HTTP endpoints, each behind its connection bounds.

use std::sync::Arc;
use std::time::Duration;

use super::wire::rate_limit_quota_service_server::RateLimitQuotaServiceServer;
use super::wire::rate_limit_service_server::RateLimitServiceServer;
use tokio::net::{TcpListener, TcpSocket, UnixListener};
use tonic::transport::server::TcpIncoming;

use super::admin::{Admin, AdminServer};
use super::conn::{AGE_JITTER, AGE_LANES, BudgetLayer, ConnLimits, InLane, Tracked, Tracker};
use super::grpc::GrpcService;
use super::h2guard::{H2Guard, Resets};
use super::http::HttpState;
use super::rlqs::RlqsService;
use super::tls::{GrpcTls, Served};
use crate::engine::Engine;
use crate::metrics::{Metrics, ResetLabels};
use crate::shutdown::{Serving, Stop, Tasks};

/// HTTP/2 streams one gRPC connection may have open: far more than a busy Envoy keeps in
/// flight on one connection, few enough that a client withholding flow-control credit holds a
/// bounded number of answers.
pub const MAX_STREAMS_PER_CONNECTION: u32 = 1024;
/// Largest gRPC request message: a request at every per-request bound is well within it.
pub const MAX_MESSAGE_BYTES: usize = 1 << 20;
/// Connections the HTTP ports (health, metrics, debug, `/json`) hold together.
pub const MAX_HTTP_CONNECTIONS: usize = 512;
/// Connections the kernel queues on a listening socket before the service accepts them.
const BACKLOG: u32 = 1024;

/// How the servers serve.
pub(crate) struct ServerOptions {
    /// TLS on the gRPC listener.
    pub(crate) grpc_tls: Option<GrpcTls>,
    /// Rate-limit headers and the default answer for responses.
    pub(crate) telling: super::grpc::Telling,
    /// Serve the admin API on the gRPC port (`--admin`, until it is gone; not with
    /// `admin_listener`).
    pub(crate) admin: bool,
    /// The admin listener (`--admin-addr`): how it knows who calls.
    pub(crate) admin_listener: Option<AdminListenerOptions>,
    /// Bounds of each gRPC connection.
    pub(crate) grpc_connections: ConnLimits,
    /// Bounds of the HTTP ports' connections.
    pub(crate) http_connections: ConnLimits,
    /// Longest time to receive and answer one request.
    pub(crate) request_timeout: Duration,
    /// After SIGTERM, how long calls are still answered while health says not-serving.
    pub(crate) drain_delay: Duration,
    /// How long in-flight calls may finish after the drain.
    pub(crate) shutdown_grace: Duration,
}

/// How the admin listener knows who calls: tokens, a client certificate, or both.
pub(crate) struct AdminListenerOptions {
    /// `--admin-token-file`: every call needs one of its tokens.
    pub(crate) token_file: Option<std::path::PathBuf>,
    /// `--admin-tls-*`: TLS, and with a client CA, a certificate from it for every connection.
    pub(crate) tls: Option<GrpcTls>,
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
    /// More sockets serving the same HTTP endpoints (`--metrics-addr`).
    pub extra_http: Vec<TcpSocket>,
    /// The debug port (`--debug-addr`): the HTTP endpoints, `/stats` and the CPU profile.
    pub debug_http: Option<TcpSocket>,
    /// The admin listener (`--admin-addr`).
    pub admin: Option<TcpSocket>,
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
/// Its text names the address; the reason is its source (`{:#}` prints both, once each).
#[derive(Debug, thiserror::Error)]
#[error("cannot listen on {addr}")]
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

/// A Unix socket at `path` with permissions `mode`, listening.
///
/// A socket file already there is replaced only when nothing answers on it (an earlier run
/// left it); one a live process listens on is that process's, and the service refuses to
/// start rather than take it. The socket is made and given its mode in a directory of the
/// service's own beside `path` (mode 0700), then linked at `path`, which fails if anything
/// appeared there meanwhile: no moment where it is reachable with other permissions, and no
/// `chmod` through a path someone else could have turned into a symlink.
fn listen_unix(path: &std::path::Path, mode: u32) -> Result<UnixListener, ListenError> {
    use std::os::unix::fs::{DirBuilderExt, FileTypeExt, PermissionsExt};
    let failed = |source| ListenError {
        addr: path.display().to_string(),
        source,
    };
    let refuse = |kind, message: &str| failed(std::io::Error::new(kind, message.to_owned()));
    match std::fs::symlink_metadata(path) {
        Ok(m) if m.file_type().is_socket() => {
            match std::os::unix::net::UnixStream::connect(path) {
                Ok(_) => {
                    return Err(refuse(
                        std::io::ErrorKind::AddrInUse,
                        "another process is listening on this socket",
                    ));
                }
                // Nothing listens: a socket an earlier run left.
                Err(e) if e.kind() == std::io::ErrorKind::ConnectionRefused => {
                    std::fs::remove_file(path).map_err(failed)?;
                }
                Err(e) => return Err(failed(e)),
            }
        }
        Ok(_) => {
            return Err(refuse(
                std::io::ErrorKind::AlreadyExists,
                "a file that is not a socket is there",
            ));
        }
        Err(_) => {}
    }
    let parent = match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => std::path::Path::new("."),
    };
    let private = parent.join(format!(
        ".ratelimitd-{}-{:x}",
        std::process::id(),
        std::hash::BuildHasher::hash_one(&std::collections::hash_map::RandomState::new(), 0u8)
    ));
    std::fs::DirBuilder::new()
        .mode(0o700)
        .create(&private)
        .map_err(failed)?;
    let made = private.join("grpc.sock");
    let listening = (|| {
        let listener = UnixListener::bind(&made)?;
        std::fs::set_permissions(&made, std::fs::Permissions::from_mode(mode))?;
        std::fs::hard_link(&made, path)?;
        Ok(listener)
    })();
    let _ = std::fs::remove_file(&made);
    let _ = std::fs::remove_dir(&private);
    listening.map_err(failed)
}

/// The gRPC listener, listening.
enum GrpcListener {
    Tcp(TcpListener),
    Unix {
        listener: UnixListener,
        /// Where it is linked (the listener was bound elsewhere: see [`listen_unix`]).
        path: std::path::PathBuf,
    },
}

/// The listeners, listening.
pub(crate) struct Listening {
    grpc: GrpcListener,
    http: TcpListener,
    extra_http: Vec<TcpListener>,
    debug_http: Option<TcpListener>,
    admin: Option<TcpListener>,
}

impl Listeners {
    /// Starts every socket listening.
    pub(crate) fn listen(self) -> Result<Listening, ListenError> {
        Ok(Listening {
            grpc: match self.grpc {
                GrpcSocket::Tcp(socket) => GrpcListener::Tcp(listen(socket)?),
                GrpcSocket::Unix { path, mode } => GrpcListener::Unix {
                    listener: listen_unix(&path, mode)?,
                    path,
                },
            },
            http: listen(self.http)?,
            extra_http: self
                .extra_http
                .into_iter()
                .map(listen)
                .collect::<Result<_, _>>()?,
            debug_http: self.debug_http.map(listen).transpose()?,
            admin: self.admin.map(listen).transpose()?,
        })
    }
}

/// What the servers serve: RLS over the engine, RLQS over the RLQS pools, and health.
pub(crate) struct Services<H> {
    /// The decision engine (RLS, `/json`, the admin API).
    pub(crate) engine: Arc<Engine>,
    /// The RLQS service.
    pub(crate) rlqs: RlqsService,
    /// The health service, which shutdown turns to NOT_SERVING.
    pub(crate) health: tonic_health::pb::health_server::HealthServer<H>,
    /// The backend, for `/healthcheck`.
    pub(crate) backend: Arc<dyn crate::limiter::Backend>,
    /// The operator's overrides (the admin listener changes them).
    pub(crate) overrides: Arc<crate::overrides::Overrides>,
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
    let unknown = || "?".to_owned();
    let grpc_addr = match &listening.grpc {
        GrpcListener::Tcp(l) => l.local_addr().map_or_else(|_| unknown(), |a| a.to_string()),
        GrpcListener::Unix { path, .. } => format!("unix:{}", path.display()),
    };
    let http_addr = listening
        .http
        .local_addr()
        .map_or_else(|_| unknown(), |a| a.to_string());
    let state = Arc::new(HttpState {
        engine: services.engine.clone(),
        metrics: metrics.clone(),
        serving: stop.serving.clone(),
        backend: services.backend.clone(),
        telling: options.telling.clone(),
    });
    if let Some(listener) = listening.admin {
        serve_admin(options, listener, &services, &metrics, stop, tasks);
    }
    let grpc = serve_grpc(options, listening.grpc, services, &metrics, stop, tasks);
    let http = serve_http(
        listening.http,
        listening.extra_http,
        listening.debug_http,
        state,
        options,
        stop,
        tasks,
    );
    // The line that says the service is ready: both ports accept (README.md, "First five
    // minutes").
    tracing::info!(grpc = %grpc_addr, http = %http_addr, "serving");
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
        ..
    }: Services<H>,
    metrics: &Arc<Metrics>,
    stop: &Stop,
    tasks: &mut Tasks,
) -> Serving<tonic::transport::Error> {
    let admin = (options.admin && options.admin_listener.is_none()).then(|| {
        tracing::warn!("admin API on the gRPC port (--admin), which every Envoy reaches, without asking who calls: use --admin-addr with --admin-token-file; --admin goes in a later release");
        AdminServer::new(Admin::new(engine.clone()))
    });
    let conns = options.grpc_connections;
    let mut routes = tonic::service::RoutesBuilder::default();
    routes
        .add_service(health)
        .add_service(
            RateLimitServiceServer::new(GrpcService::new(
                engine,
                metrics.clone(),
                options.telling.clone(),
            ))
            .max_decoding_message_size(MAX_MESSAGE_BYTES),
        )
        .add_service(
            RateLimitQuotaServiceServer::new(rlqs).max_decoding_message_size(MAX_MESSAGE_BYTES),
        );
    if let Some(admin) = admin {
        routes.add_service(admin.max_decoding_message_size(MAX_MESSAGE_BYTES));
    }
    let routes = routes.routes();
    let router = |age: Option<Duration>| {
        let mut server = tonic::transport::Server::builder()
            .max_concurrent_streams(MAX_STREAMS_PER_CONNECTION)
            // Envoy resets a call it gave up on (its 20 ms timeout): under load many are reset
            // before they are accepted, and past h2's default of 20 such streams it closes the
            // whole connection (ENHANCE_YOUR_CALM), failing every call on it. As many as the
            // streams a connection may have: still a bound against a rapid-reset peer.
            .http2_max_pending_accept_reset_streams(Some(MAX_STREAMS_PER_CONNECTION as usize))
            .http2_max_header_list_size(conns.max_header_bytes)
            .timeout(options.request_timeout)
            .http2_keepalive_interval(Some(conns.idle_timeout / 3))
            .http2_keepalive_timeout(Some(conns.idle_timeout / 3));
        if let Some(age) = age {
            server = server.max_connection_age(age);
        }
        server
            .layer(BudgetLayer {
                message_timeout: options.request_timeout,
            })
            .add_routes(routes.clone())
    };
    let lanes: Vec<GrpcRouter> = match conns.age {
        None => vec![router(None)],
        Some(age) => {
            tracing::info!(age = ?age.age, jitter = AGE_JITTER, grace = ?age.grace, "gRPC connections age");
            // The grace is kept by the connection itself (`Tracked`): tonic, given one, closes
            // the connection at age plus grace without ever sending GOAWAY.
            (0..AGE_LANES)
                .map(|lane| router(Some(age.of_lane(lane))))
                .collect()
        }
    };
    let tracker = Tracker::new(conns);
    let resets = Resets(metrics.grpc_resets.clone());
    crate::metrics::at_zero(
        &metrics.grpc_resets,
        ["protocol_error", "refused_stream"].map(|code| ResetLabels {
            frame: "rst_stream",
            code,
        }),
    );
    match (listener, &options.grpc_tls) {
        // Plain text only (settings refuse TLS with a Unix socket).
        (GrpcListener::Unix { listener, .. }, _) => {
            let accepted = futures_util::stream::unfold(listener, |l| async move {
                let accepted = l.accept().await.map(|(stream, _)| stream);
                Some((accepted, l))
            });
            serve_lanes(
                lanes,
                guarded(admitted(accepted, tracker), true, resets),
                stop,
            )
        }
        (GrpcListener::Tcp(listener), None) => {
            let accepted = TcpIncoming::from(listener).with_nodelay(Some(true));
            serve_lanes(
                lanes,
                guarded(admitted(accepted, tracker), false, resets),
                stop,
            )
        }
        (GrpcListener::Tcp(listener), Some(GrpcTls { files, config })) => {
            tracing::info!(mutual = files.client_ca.is_some(), "gRPC over TLS");
            let (incoming, tls_tasks) = super::tls::incoming(
                listener,
                files.clone(),
                config.clone(),
                tracker,
                metrics.clone(),
                Served::Grpc,
            );
            for task in tls_tasks {
                tasks.push(task);
            }
            serve_lanes(lanes, guarded(incoming, false, resets), stop)
        }
    }
}

/// The admin listener on `listener`: the Admin gRPC service and the overrides' JSON API,
/// behind the tokens of `--admin-token-file`, under the HTTP ports' connection bounds.
fn serve_admin<H>(
    options: &ServerOptions,
    listener: TcpListener,
    services: &Services<H>,
    metrics: &Arc<Metrics>,
    stop: &Stop,
    tasks: &mut Tasks,
) {
    let Some(admin) = &options.admin_listener else {
        return;
    };
    let tokens = match admin.token_file.as_deref().map(super::auth::Tokens::load) {
        None => None,
        Some(Ok(t)) => {
            tasks.push(tokio::spawn(t.clone().keep()));
            Some(t)
        }
        Some(Err(e)) => {
            tracing::error!(error = %e, "admin listener not started: no tokens");
            return;
        }
    };
    let grpc = tonic::service::Routes::new(
        AdminServer::new(
            Admin::new(services.engine.clone()).with_overrides(services.overrides.clone()),
        )
        .max_decoding_message_size(MAX_MESSAGE_BYTES),
    )
    .into_axum_router();
    let state = Arc::new(super::admin_listener::AdminState {
        tokens,
        overrides: services.overrides.clone(),
        metrics: metrics.admin.clone(),
    });
    let routes = super::admin_listener::router(state, grpc, options.request_timeout);
    let mutual = admin
        .tls
        .as_ref()
        .is_some_and(|t| t.files.client_ca.is_some());
    tracing::info!(
        admin = ?listener.local_addr().ok(),
        tokens = admin.token_file.is_some(),
        tls = admin.tls.is_some(),
        client_certificates = mutual,
        "admin listener: the admin API and the overrides"
    );
    let tracker = Tracker::new(options.http_connections);
    let stopped = stop.stopped();
    let serve: futures_util::future::BoxFuture<'static, ()> = match &admin.tls {
        None => Box::pin(super::admin_listener::serve(
            super::admin_listener::plain(listener, tracker),
            routes,
            stopped,
        )),
        Some(GrpcTls { files, config }) => {
            let (incoming, tls_tasks) = super::tls::incoming(
                listener,
                files.clone(),
                Served::Admin.offered(config.clone()),
                tracker,
                metrics.clone(),
                Served::Admin,
            );
            for task in tls_tasks {
                tasks.push(task);
            }
            Box::pin(super::admin_listener::serve(
                super::admin_listener::certified(incoming, mutual),
                routes,
                stopped,
            ))
        }
    };
    tasks.push(tokio::spawn(serve));
}

/// The connections `accepted` yields, their frames read through [`H2Guard`] (`unix`: they
/// came over the Unix socket).
fn guarded<IO>(
    accepted: impl futures_util::Stream<Item = std::io::Result<IO>>,
    unix: bool,
    resets: Resets,
) -> impl futures_util::Stream<Item = std::io::Result<H2Guard<IO>>> {
    use futures_util::StreamExt;
    accepted.map(move |io| io.map(|io| H2Guard::new(io, unix, resets.clone())))
}

/// The gRPC server, as one lane of connection ages sees it.
type GrpcRouter = tonic::transport::server::Router<
    tower::layer::util::Stack<BudgetLayer, tower::layer::util::Identity>,
>;

/// Serves the connections `incoming` yields on `lanes` until `stop`, each on the lane it was
/// given when admitted. Connections handed to a lane and not yet served are already counted
/// against the connection cap, so nothing queued here is unbounded.
fn serve_lanes<IO>(
    lanes: Vec<GrpcRouter>,
    incoming: impl futures_util::Stream<Item = std::io::Result<IO>> + Send + 'static,
    stop: &Stop,
) -> Serving<tonic::transport::Error>
where
    IO: tokio::io::AsyncRead
        + tokio::io::AsyncWrite
        + tonic::transport::server::Connected
        + InLane
        + Unpin
        + Send
        + 'static,
{
    use futures_util::StreamExt;
    let mut lanes = lanes;
    if lanes.len() == 1
        && let Some(router) = lanes.pop()
    {
        return Box::pin(router.serve_with_incoming_shutdown(incoming, stop.stopped()));
    }
    let mut senders = Vec::with_capacity(lanes.len());
    let mut servers = Vec::with_capacity(lanes.len());
    for router in lanes {
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        senders.push(tx);
        let incoming = tokio_stream::wrappers::UnboundedReceiverStream::new(rx);
        servers.push(router.serve_with_incoming_shutdown(incoming, stop.stopped()));
    }
    let stopped = stop.stopped();
    let dispatch = async move {
        let mut incoming = std::pin::pin!(incoming);
        let mut stopped = std::pin::pin!(stopped);
        loop {
            let io = tokio::select! {
                () = &mut stopped => break,
                io = incoming.next() => match io {
                    Some(io) => io,
                    None => break,
                },
            };
            // An error goes to any lane, whose server logs it. A lane's server ends only at
            // `stop`, so a send fails only then.
            let lane = io.as_ref().map_or(0, InLane::lane);
            let _ = senders[lane.min(senders.len() - 1)].send(io);
        }
        // Dropping the senders ends every lane's incoming: each then finishes its connections.
    };
    Box::pin(async move {
        let ((), served) = tokio::join!(dispatch, futures_util::future::try_join_all(servers));
        served.map(|_| ())
    })
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

/// The HTTP endpoints on `listener` and on every `extra` listener, and with the debug pages on
/// `debug`. The HTTP ports share one connection cap; no request-byte budget beyond the body
/// limit.
fn serve_http(
    listener: TcpListener,
    extra: Vec<TcpListener>,
    debug: Option<TcpListener>,
    state: Arc<HttpState>,
    options: &ServerOptions,
    stop: &Stop,
    tasks: &mut Tasks,
) -> Serving<std::io::Error> {
    let tracker = Tracker::new(options.http_connections);
    let metrics = state.metrics.clone();
    let routes = super::http::router(state, options.request_timeout);
    let debug = debug.map(|l| {
        let pages = super::debug::router(metrics, options.http_connections.idle_timeout);
        let routes = routes.clone().merge(pages);
        (l, routes, "serving HTTP endpoints and debug pages here too")
    });
    let extra = extra
        .into_iter()
        .map(|l| (l, routes.clone(), "serving HTTP endpoints here too"));
    for (l, routes, what) in extra.chain(debug) {
        tracing::info!(http = ?l.local_addr().ok(), "{what}");
        let serve = super::http::serve(l, routes, tracker.clone(), stop.stopped());
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
