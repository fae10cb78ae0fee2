//! The service's start and its failures: [`run`] brings the parts up in order, each
//! background task it starts ending with it.

use std::future::Future;
use std::sync::Arc;

use crate::config::ConfigError;
use crate::engine::Engine;
use crate::limiter::redis::SetupError;
use crate::limiter::{Clock, SystemClock};
use crate::metrics::Metrics;
use crate::rlqs::Pools;
use crate::server::rlqs::RlqsService;
use crate::server::serve::Services;
use crate::server::serve::{ListenError, Listeners};
use crate::settings::Options;
use crate::shutdown::{ServerFailed, Shutdown, Stop, Tasks, until_stopped};
use crate::source::{self, CheckError, SourceError};
use crate::{limiter, overrides, server, statsd};

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
    /// The operator's overrides could not be read (`--overrides-file`).
    #[error("{0}")]
    Overrides(String),
    /// A bound socket could not listen.
    #[error(transparent)]
    Listen(#[from] ListenError),
}

impl From<ServerFailed> for RunError {
    fn from(e: ServerFailed) -> RunError {
        match e {
            ServerFailed::Grpc(e) => RunError::Grpc(e),
            ServerFailed::Http(e) => RunError::Http(e),
        }
    }
}

impl From<SourceError> for RunError {
    fn from(e: SourceError) -> RunError {
        match e {
            SourceError::Config(e) => RunError::Config(e),
            SourceError::Watch(e) => RunError::Watch(e),
        }
    }
}

/// Loads the config files `options` name, as the service would at start, without running it:
/// the rules as `/rlconfig` prints them, or the first error with its file, line and field.
pub fn check_config(options: &Options) -> Result<String, CheckError> {
    source::check(&options.source)
}

/// Runs the service until `shutdown` resolves, then turns health not-serving, drains (for
/// [`Shutdown::Drain`], `--drain-delay`), stops accepting, lets in-flight calls finish (up to
/// `--shutdown-grace`) and returns. A future that yields `()` drains.
pub async fn run<S: Into<Shutdown>>(
    options: Options,
    listeners: Listeners,
    shutdown: impl Future<Output = S> + Send + 'static,
) -> Result<(), RunError> {
    run_with_clock(options, listeners, shutdown, Arc::new(SystemClock)).await
}

/// [`run`] with the memory backend reading time from `clock` (for tests, through `testing`).
/// The service comes up in named steps: the config source, the shutdown fan-out, the backend,
/// the protocols, then the servers; every background task it starts ends with it.
#[doc(hidden)]
pub async fn run_with_clock<S: Into<Shutdown>>(
    options: Options,
    listeners: Listeners,
    shutdown: impl Future<Output = S> + Send + 'static,
    clock: Arc<dyn Clock>,
) -> Result<(), RunError> {
    // rediss:// uses rustls, which needs one crypto provider chosen per process; ring builds
    // with the C compiler alone (aws-lc also wants cmake). A second install is a harmless no-op.
    let _ = rustls::crypto::ring::default_provider().install_default();
    let metrics = Arc::new(Metrics::with_families(
        options.reference_metrics,
        options.statsd.is_some(),
    ));
    metrics
        .decisions
        .set_removed_series_grace(options.removed_series_grace);
    let mut tasks = Tasks::default();
    let (health, health_service) = tonic_health::server::health_reporter();
    let source = source::start(&options.source, &metrics, &mut tasks)?;
    // Health waits for the first config only when asked to.
    let ready = source
        .loaded
        .clone()
        .filter(|_| options.source.unhealthy_until_config);
    let stop = Stop::start(
        shutdown,
        options.server.drain_delay,
        health,
        ready,
        &mut tasks,
    )
    .await;
    if let Some(statsd) = options.statsd.clone() {
        let sink = statsd::Sink::new(statsd, metrics.clone());
        tasks.push(tokio::spawn(statsd::run(sink, stop.stopped())));
    }
    if let Some(mut loaded) = source.loaded
        && !options.source.start_without_config
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
    let started =
        limiter::start::start(&options.backend, &options.keys, clock, &metrics, &mut tasks).await?;
    let redis = started.redis.as_ref().map(|(r, _)| r.clone());
    let pools = Pools::beside(started.redis, &options.rlqs.buckets, metrics.rlqs.clone());
    let rlqs = RlqsService::new(
        source.config.clone(),
        pools,
        options.rlqs,
        metrics.rlqs.clone(),
    )
    .map_err(RunError::Thread)?;
    let overrides = overrides::Overrides::start(
        options.overrides.clone(),
        redis.as_ref().map(|r| (r.clone(), options.keys.prefix())),
        metrics.admin.clone(),
        &mut tasks,
    )
    .await
    .map_err(RunError::Overrides)?;
    let engine = Arc::new(
        Engine::new(
            source.config,
            started.backend.clone(),
            options.keys,
            metrics.decisions.clone(),
            options.engine,
        )
        .with_overrides(overrides.applied()),
    );
    engine.spawn_top(redis, &mut tasks);
    engine.spawn_places(&mut tasks);
    // Listening only now: the config is in force and the backend ready.
    let services = Services {
        engine,
        rlqs,
        health: health_service,
        backend: started.backend,
        overrides,
    };
    let (grpc, http) = server::serve::serve(
        &options.server,
        listeners.listen()?,
        services,
        metrics,
        &stop,
        &mut tasks,
    );
    until_stopped(grpc, http, &stop, options.server.shutdown_grace)
        .await
        .map_err(RunError::from)
}
