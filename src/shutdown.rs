//! Shutdown: the fan-out that turns health NOT_SERVING when the caller's shutdown future
//! resolves, keeps answering for the drain delay (so that every client learns of it before a
//! connection is refused) and then stops every server; the background tasks aborted with the
//! service, and the wait for the servers to finish within the grace period.

use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use tonic_health::ServingStatus;

/// gRPC health service names reported SERVING: the default, the name envoyproxy/ratelimit
/// registers (so existing probes keep working) and the service's full name.
pub const HEALTH_SERVICES: [&str; 3] = [
    "",
    "ratelimit",
    "envoy.service.ratelimit.v3.RateLimitService",
];

/// How a shutdown begins.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Shutdown {
    /// As SIGTERM asks: health turns not-serving at once, calls are still accepted and
    /// answered for `--drain-delay` (while the endpoint's removal reaches every Envoy), then
    /// every connection is sent GOAWAY and calls in flight have `--shutdown-grace` to finish.
    Drain,
    /// As SIGINT asks (a terminal's Ctrl-C): the same without the drain delay.
    Now,
}

/// A shutdown future that yields nothing drains.
impl From<()> for Shutdown {
    fn from((): ()) -> Shutdown {
        Shutdown::Drain
    }
}

/// Background tasks of a running service, aborted when it ends (returns or fails).
#[derive(Default)]
pub(crate) struct Tasks(Vec<tokio::task::JoinHandle<()>>);

impl Tasks {
    pub(crate) fn push(&mut self, task: tokio::task::JoinHandle<()>) {
        self.0.push(task);
    }
}

impl Drop for Tasks {
    fn drop(&mut self) {
        for task in &self.0 {
            task.abort();
        }
    }
}

/// The shutdown fan-out: when the caller's `shutdown` resolves, health turns NOT_SERVING
/// first; after the drain delay (for [`Shutdown::Drain`], once health had been SERVING) every
/// server stops accepting. Health starts SERVING, or, given `ready`, turns SERVING when it does.
pub(crate) struct Stop {
    /// False once shutdown has begun (`/healthcheck` answers 500).
    pub(crate) serving: Arc<AtomicBool>,
    stopped: tokio::sync::watch::Receiver<bool>,
}

impl Stop {
    pub(crate) async fn start<S: Into<Shutdown>>(
        shutdown: impl Future<Output = S> + Send + 'static,
        drain_delay: Duration,
        health: tonic_health::server::HealthReporter,
        ready: Option<tokio::sync::watch::Receiver<bool>>,
        tasks: &mut Tasks,
    ) -> Stop {
        let status = match ready {
            None => ServingStatus::Serving,
            Some(_) => ServingStatus::NotServing,
        };
        for name in HEALTH_SERVICES {
            health.set_service_status(name, status).await;
        }
        let serving = Arc::new(AtomicBool::new(ready.is_none()));
        let (stop_tx, stopped) = tokio::sync::watch::channel(false);
        tasks.push({
            let serving = serving.clone();
            tokio::spawn(async move {
                let shutdown = async move { shutdown.await.into() };
                tokio::pin!(shutdown);
                // One task for both, so that a late `ready` can never undo a shutdown.
                let mut how = None;
                if let Some(mut ready) = ready {
                    let became_ready = tokio::select! {
                        r = ready.wait_for(|r| *r) => r.is_ok(),
                        h = &mut shutdown => {
                            how = Some(h);
                            false
                        }
                    };
                    if became_ready {
                        serving.store(true, Ordering::SeqCst);
                        for name in HEALTH_SERVICES {
                            health
                                .set_service_status(name, ServingStatus::Serving)
                                .await;
                        }
                    }
                }
                let how = match how {
                    Some(h) => h,
                    None => shutdown.await,
                };
                // Nobody was told to send calls here (health never said SERVING): nothing to
                // drain.
                let drain = how == Shutdown::Drain && serving.load(Ordering::SeqCst);
                serving.store(false, Ordering::SeqCst);
                for name in HEALTH_SERVICES {
                    health
                        .set_service_status(name, ServingStatus::NotServing)
                        .await;
                }
                if drain && !drain_delay.is_zero() {
                    tracing::info!(
                        ?drain_delay,
                        "draining: health is not-serving, calls are still answered"
                    );
                    tokio::time::sleep(drain_delay).await;
                }
                tracing::info!("shutting down: GOAWAY sent, finishing in-flight calls");
                let _ = stop_tx.send(true);
            })
        });
        Stop { serving, stopped }
    }

    /// Resolves once shutdown has begun (a server's signal to stop accepting).
    pub(crate) fn stopped(&self) -> impl Future<Output = ()> + Send + 'static {
        let mut rx = self.stopped.clone();
        async move {
            let _ = rx.wait_for(|s| *s).await;
        }
    }
}

/// A server running until [`Stop::stopped`].
pub(crate) type Serving<E> = std::pin::Pin<Box<dyn Future<Output = Result<(), E>> + Send>>;

/// Why a server ended other than by shutdown.
#[derive(Debug)]
pub(crate) enum ServerFailed {
    Grpc(tonic::transport::Error),
    Http(std::io::Error),
}

/// Runs both servers until they have stopped after shutdown, or until the grace period after
/// shutdown has passed with calls still in flight.
pub(crate) async fn until_stopped(
    grpc: Serving<tonic::transport::Error>,
    http: Serving<std::io::Error>,
    stop: &Stop,
    grace: Duration,
) -> Result<(), ServerFailed> {
    let servers = async { tokio::join!(grpc, http) };
    let stopped = stop.stopped();
    tokio::select! {
        (g, h) = servers => match (g, h) {
            (Ok(()), Ok(())) => Ok(()),
            (Err(e), _) => Err(ServerFailed::Grpc(e)),
            (_, Err(e)) => Err(ServerFailed::Http(e)),
        },
        _ = async {
            stopped.await;
            tokio::time::sleep(grace).await;
        } => {
            tracing::warn!(?grace, "in-flight calls did not finish within the shutdown grace");
            Ok(())
        }
    }
}
