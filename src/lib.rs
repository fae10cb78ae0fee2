//! ratelimitd: an external rate-limit service for Envoy and Istio.
//!
//! [`run`] starts the whole service on listeners the caller has bound, so tests can run a real
//! server on port 0; `main.rs` only parses flags, binds and waits for a signal.
#![forbid(unsafe_code)]

mod config;
mod engine;
mod limiter;
mod metrics;
mod quota;
mod server;
pub mod settings;
mod shutdown;
pub mod telemetry;
mod xds;

pub use crate::config::ConfigError;
pub use crate::limiter::redis::SetupError;
/// The admin API's messages and its gRPC client (`--admin`), for tools that read or reset
/// counters.
pub use crate::server::admin::pb as admin;
pub use crate::shutdown::HEALTH_SERVICES;

/// What the integration tests (`tests/`) and the fuzz targets (`fuzz/`) drive directly, below
/// [`run`]: not an API, no stability promised, hidden from the documentation.
#[doc(hidden)]
pub mod testing;

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use arc_swap::ArcSwap;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_server::RateLimitServiceServer;
use tokio::net::{TcpListener, TcpSocket};
use tonic::transport::server::TcpIncoming;

use crate::config::{CompileOptions, Snapshot, load_paths_with};
use crate::engine::Engine;
use crate::limiter::fallback::Fallback;
use crate::limiter::redis::{RedisBackend, RedisOptions};
use crate::limiter::{Backend, Clock, MemoryBackend, SystemClock};
use crate::metrics::{LoadResult, Metrics};
use crate::quota::Quota;
use crate::server::grpc::GrpcService;
use crate::server::http::{HttpState, router};
use crate::server::rlqs::RlqsService;
use crate::settings::{BackendOptions, ConfigSource, Options};
use crate::shutdown::{ServerFailed, Serving, Stop, Tasks, until_stopped};
use envoy_types::pb::envoy::service::rate_limit_quota::v3::rate_limit_quota_service_server::RateLimitQuotaServiceServer;

/// How often the memory backend drops expired counters in the background.
const SWEEP_EVERY: Duration = Duration::from_secs(10);
/// How often the Redis backend checks that Redis answers, traffic or not.
const PROBE_EVERY: Duration = Duration::from_secs(1);
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

/// The sockets the service serves on, bound by the caller (so that a port taken fails at
/// once, and a test can bind port 0 and know its port) and listening only once the service can
/// serve: before the first xDS config a client is refused, not left waiting on a socket that
/// never answers. [`bind`] makes one.
pub struct Listeners {
    /// For gRPC.
    pub grpc: TcpSocket,
    /// For HTTP.
    pub http: TcpSocket,
    /// More sockets serving the same HTTP endpoints (`--debug-addr`, `--metrics-addr`).
    pub extra_http: Vec<TcpSocket>,
}

/// Connections the kernel queues on a listening socket before the service accepts them.
const BACKLOG: u32 = 1024;

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

/// Why the service could not start or stopped abnormally.
#[derive(Debug, thiserror::Error)]
pub enum RunError {
    /// The Redis client refused its options.
    #[error(transparent)]
    Redis(#[from] SetupError),
    /// The first config load failed.
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// The config could not be watched.
    #[error("cannot watch the config paths")]
    Watch(#[from] notify::Error),
    /// The gRPC server failed.
    #[error("gRPC server: {0}")]
    Grpc(#[from] tonic::transport::Error),
    /// The HTTP server failed.
    #[error("HTTP server: {0}")]
    Http(#[from] std::io::Error),
    /// The RLQS thread could not be started.
    #[error("cannot start the RLQS thread: {0}")]
    Thread(std::io::Error),
    /// A bound socket could not listen.
    #[error("cannot listen on {addr}: {source}")]
    Listen {
        /// The socket's address, if it has one.
        addr: String,
        /// Why.
        source: std::io::Error,
    },
}

impl From<ServerFailed> for RunError {
    fn from(e: ServerFailed) -> RunError {
        match e {
            ServerFailed::Grpc(e) => RunError::Grpc(e),
            ServerFailed::Http(e) => RunError::Http(e),
        }
    }
}

/// Starts `socket` listening.
fn listen(socket: TcpSocket) -> Result<TcpListener, RunError> {
    let addr = socket
        .local_addr()
        .map_or_else(|_| "an unbound socket".to_owned(), |a| a.to_string());
    socket
        .listen(BACKLOG)
        .map_err(|source| RunError::Listen { addr, source })
}

/// Loads the config files `options` name, as the service would at start, without running it:
/// the rules as `/rlconfig` prints them, or the first error with its file, line and field.
pub fn check_config(options: &Options) -> Result<String, CheckError> {
    match &options.config {
        ConfigSource::Files(paths) => Ok(load_paths_with(paths, options.compile)?.snapshot.dump()),
        ConfigSource::Xds(_) => Err(CheckError::NotFiles),
    }
}

/// Why [`check_config`] found no config to print.
#[derive(Debug, thiserror::Error)]
pub enum CheckError {
    /// A file is invalid (or missing).
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// The config comes over xDS: there are no files to check.
    #[error("--check reads config files; this config comes from an xDS server")]
    NotFiles,
}

/// Runs the service until `shutdown` resolves, then stops accepting, lets in-flight calls
/// finish (up to `options.shutdown_grace`) and returns.
pub async fn run(
    options: Options,
    listeners: Listeners,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), RunError> {
    run_with_clock(options, listeners, shutdown, Arc::new(SystemClock)).await
}

/// [`run`] with the memory backend reading time from `clock` (for tests, through `testing`).
/// The service comes up in named steps: the config (and its watcher), the backend, the engine,
/// the shutdown fan-out, then the servers; every background task it starts ends with it.
#[doc(hidden)]
pub async fn run_with_clock(
    options: Options,
    listeners: Listeners,
    shutdown: impl Future<Output = ()> + Send + 'static,
    clock: Arc<dyn Clock>,
) -> Result<(), RunError> {
    // rediss:// uses rustls, which needs one crypto provider chosen per process; ring builds
    // with the C compiler alone (aws-lc also wants cmake). A second install is a harmless no-op.
    let _ = rustls::crypto::ring::default_provider().install_default();
    let metrics = Arc::new(Metrics::with_reference(options.reference_metrics));
    let mut tasks = Tasks::default();
    let (health, health_service) = tonic_health::server::health_reporter();
    let (config, loaded) = match &options.config {
        ConfigSource::Files(paths) => (
            watch_files(paths, options.compile, &metrics, &mut tasks)?,
            None,
        ),
        ConfigSource::Xds(xds) => {
            let (config, loaded) = follow_xds(xds, options.compile, &metrics, &mut tasks);
            (config, Some(loaded))
        }
    };
    // Health waits for the first config only when asked to.
    let ready = loaded.clone().filter(|_| options.unhealthy_until_config);
    let stop = Stop::start(shutdown, health, ready, &mut tasks).await;
    if let Some(mut loaded) = loaded
        && !options.start_without_config
    {
        // As envoyproxy/ratelimit does: nothing is served before the first config.
        let first = tokio::select! {
            l = loaded.wait_for(|l| *l) => l.is_ok(),
            () = stop.stopped() => false,
        };
        if !first {
            return Ok(());
        }
    }
    let (backend, quota) = start_backend(&options, clock, &metrics, &mut tasks)?;
    let quota = RlqsService::new(
        config.clone(),
        quota,
        options.keys.clone(),
        options.quota,
        options.engine.request_limits,
        options.engine.global_shadow_mode,
        metrics.quota.clone(),
    )
    .map_err(RunError::Thread)?;
    let engine = Arc::new(Engine::new(
        config,
        backend.clone(),
        options.keys.clone(),
        metrics.decisions.clone(),
        options.engine,
    ));

    // Listening only now: the config is in force and the backend ready.
    let grpc_listener = listen(listeners.grpc)?;
    let http_listener = listen(listeners.http)?;
    let extra_http = listeners
        .extra_http
        .into_iter()
        .map(listen)
        .collect::<Result<Vec<_>, _>>()?;
    let grpc_addr = grpc_listener.local_addr().ok();
    let http_addr = http_listener.local_addr().ok();
    let grpc = serve_grpc(
        &options,
        grpc_listener,
        Protocols {
            engine: engine.clone(),
            quota,
        },
        health_service,
        &metrics,
        &stop,
        &mut tasks,
    );
    let http_state = Arc::new(HttpState {
        engine,
        metrics,
        serving: stop.serving.clone(),
        backend,
        headers: options.response_headers,
    });
    let http = serve_http(
        http_listener,
        extra_http,
        http_state,
        &options,
        &stop,
        &mut tasks,
    );
    tracing::info!(grpc = ?grpc_addr, http = ?http_addr, "serving");
    until_stopped(grpc, http, &stop, options.shutdown_grace)
        .await
        .map_err(RunError::from)
}

/// Follows the config an xDS server sends: each accepted snapshot is swapped in, a refused one
/// is logged and counted and the previous one stays in force. The receiver turns true with
/// the first accepted snapshot; until then the config is empty.
fn follow_xds(
    options: &xds::XdsOptions,
    compile: CompileOptions,
    metrics: &Arc<Metrics>,
    tasks: &mut Tasks,
) -> (Arc<ArcSwap<Snapshot>>, tokio::sync::watch::Receiver<bool>) {
    let config = Arc::new(ArcSwap::from_pointee(Snapshot::not_loaded()));
    let (loaded_tx, loaded) = tokio::sync::watch::channel(false);
    let accepted = {
        let (config, metrics) = (config.clone(), metrics.clone());
        move |snapshot: Snapshot, version: &str| {
            let rules = snapshot.rule_count();
            tracing::info!(
                version,
                domains = snapshot.len(),
                rules,
                "config accepted from xDS"
            );
            config.store(Arc::new(snapshot));
            metrics.config_load(LoadResult::success);
            metrics.config_rules.set(rules as i64);
            loaded_tx.send_replace(true);
        }
    };
    let refused = {
        let metrics = metrics.clone();
        move |r: xds::Refusal<'_>| {
            if r.say {
                tracing::error!(
                    error = r.why,
                    "xDS config refused; the previous config stays in force"
                );
            }
            metrics.config_load(LoadResult::error);
        }
    };
    tasks.push(tokio::spawn(xds::run(
        options.clone(),
        compile,
        accepted,
        refused,
    )));
    (config, loaded)
}

/// Loads the config files (the service does not start without them) and watches them: a
/// reload swaps in the new snapshot, a bad one is logged and counted and the previous one stays
/// in force.
fn watch_files(
    paths: &[std::path::PathBuf],
    compile: CompileOptions,
    metrics: &Arc<Metrics>,
    tasks: &mut Tasks,
) -> Result<Arc<ArcSwap<Snapshot>>, RunError> {
    let loaded =
        load_paths_with(paths, compile).inspect_err(|_| metrics.config_load(LoadResult::error))?;
    metrics.config_load(LoadResult::success);
    metrics
        .config_rules
        .set(loaded.snapshot.rule_count() as i64);
    tracing::info!(
        files = loaded.files.len(),
        domains = loaded.snapshot.len(),
        rules = loaded.snapshot.rule_count(),
        "config loaded"
    );
    let config = Arc::new(ArcSwap::from_pointee(loaded.snapshot));
    let watcher = {
        let config = config.clone();
        let metrics = metrics.clone();
        config::watch::spawn(
            paths.to_vec(),
            compile,
            loaded.fingerprint,
            move |result| match result {
                Ok(loaded) => {
                    let rules = loaded.snapshot.rule_count();
                    tracing::info!(
                        files = loaded.files.len(),
                        domains = loaded.snapshot.len(),
                        rules,
                        "config reloaded"
                    );
                    config.store(Arc::new(loaded.snapshot));
                    metrics.config_load(LoadResult::success);
                    metrics.config_rules.set(rules as i64);
                }
                Err(err) => {
                    tracing::error!(error = %err, "config reload refused; previous config stays in force");
                    metrics.config_load(LoadResult::error);
                }
            },
        )?
    };
    tasks.push(watcher);
    Ok(config)
}

/// The backend `options` name: the memory backend, or Redis with the memory backend as its
/// `local` failure mode. The memory backend is swept in the background; Redis is probed. The
/// RLQS quota pools live where the counters do.
fn start_backend(
    options: &Options,
    clock: Arc<dyn Clock>,
    metrics: &Arc<Metrics>,
    tasks: &mut Tasks,
) -> Result<(Arc<dyn Backend>, Quota), RunError> {
    let memory = Arc::new(
        MemoryBackend::bounded(clock, options.memory_max_bytes, metrics.memory.clone())
            .with_max_debt(options.max_debt),
    );
    tasks.push({
        let memory = memory.clone();
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(SWEEP_EVERY);
            loop {
                tick.tick().await;
                memory.sweep();
            }
        })
    });
    Ok(match &options.backend {
        BackendOptions::Memory => (memory, Quota::local(&options.quota)),
        BackendOptions::Redis {
            redis,
            failure_mode,
        } => {
            tracing::info!(target = ?redis.target, hash_tag = ?options.keys.hash_tag(), failure_mode = failure_mode.as_str(), pipeline = redis.pipeline, max_batch = redis.max_batch, "redis backend");
            let redis = Arc::new(RedisBackend::new(
                RedisOptions::clone(redis),
                metrics.backend.clone(),
            )?);
            tasks.push(redis.spawn_probe(PROBE_EVERY));
            let quota = Quota::shared(
                redis.clone(),
                *failure_mode,
                &options.quota,
                metrics.quota.clone(),
            );
            let backend = Arc::new(Fallback::new(
                redis,
                *failure_mode,
                memory,
                metrics.backend.clone(),
            ));
            (backend, quota)
        }
    })
}

/// The two protocols' front ends: RLS over the engine, RLQS over the quota pools.
struct Protocols {
    engine: Arc<Engine>,
    quota: RlqsService,
}

/// The gRPC server on `listener`: rate limit service, quota service, health and (if enabled)
/// admin, plain or TLS, behind the per-connection bounds.
fn serve_grpc(
    options: &Options,
    listener: TcpListener,
    Protocols { engine, quota }: Protocols,
    health_service: tonic_health::pb::health_server::HealthServer<
        impl tonic_health::pb::health_server::Health,
    >,
    metrics: &Arc<Metrics>,
    stop: &Stop,
    tasks: &mut Tasks,
) -> Serving<tonic::transport::Error> {
    let admin = options.admin.then(|| {
        tracing::info!("admin API on the gRPC port");
        server::admin::AdminServer::new(server::admin::Admin::new(engine.clone()))
    });
    let conns = options.grpc_connections;
    let router = tonic::transport::Server::builder()
        .max_concurrent_streams(MAX_STREAMS_PER_CONNECTION)
        .http2_max_header_list_size(MAX_HEADER_BYTES)
        .timeout(options.request_timeout)
        .http2_keepalive_interval(Some(conns.idle_timeout / 3))
        .http2_keepalive_timeout(Some(conns.idle_timeout / 3))
        .layer(server::conn::BudgetLayer {
            message_timeout: options.request_timeout,
        })
        .add_service(health_service)
        .add_service(
            RateLimitServiceServer::new(GrpcService::new(
                engine,
                metrics.clone(),
                options.response_headers,
            ))
            .max_decoding_message_size(MAX_MESSAGE_BYTES),
        )
        .add_service(
            RateLimitQuotaServiceServer::new(quota).max_decoding_message_size(MAX_MESSAGE_BYTES),
        )
        .add_optional_service(admin.map(|a| a.max_decoding_message_size(MAX_MESSAGE_BYTES)));
    let tracker = server::conn::Tracker::new(conns);
    match &options.grpc_tls {
        None => {
            use futures_util::StreamExt;
            let incoming = TcpIncoming::from(listener)
                .with_nodelay(Some(true))
                .filter_map(move |accepted| {
                    std::future::ready(match accepted {
                        Ok(tcp) => tracker.admit(tcp).map(Ok),
                        Err(e) => Some(Err(e)),
                    })
                });
            Box::pin(router.serve_with_incoming_shutdown(incoming, stop.stopped()))
        }
        Some(settings::GrpcTls { files, config }) => {
            tracing::info!(mutual = files.client_ca.is_some(), "gRPC over TLS");
            let (incoming, tls_tasks) = server::tls::incoming(
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

/// The HTTP endpoints on `listener` and on every `extra` listener. The HTTP ports share one
/// connection cap; their connections get the gRPC port's silence bound, and no request-byte
/// budget beyond the body limit.
fn serve_http(
    listener: TcpListener,
    extra: Vec<TcpListener>,
    state: Arc<HttpState>,
    options: &Options,
    stop: &Stop,
    tasks: &mut Tasks,
) -> Serving<std::io::Error> {
    let tracker = server::conn::Tracker::new(server::conn::ConnLimits {
        max_connections: MAX_HTTP_CONNECTIONS,
        ..options.grpc_connections
    });
    let routes = router(state, options.request_timeout);
    for l in extra {
        tracing::info!(http = ?l.local_addr().ok(), "serving HTTP endpoints here too");
        let serve = server::http::serve(l, routes.clone(), tracker.clone(), stop.stopped());
        tasks.push(tokio::spawn(async move {
            if let Err(e) = serve.await {
                tracing::error!(error = %e, "HTTP server failed");
            }
        }));
    }
    Box::pin(server::http::serve(
        listener,
        routes,
        tracker,
        stop.stopped(),
    ))
}
