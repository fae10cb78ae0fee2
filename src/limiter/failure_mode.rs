//! What to answer while the shared backend is unavailable (`--redis-failure-mode`).

use std::sync::Arc;

use super::{Backend, BackendError, BoxFuture, Hit, MemoryBackend, Outcome, Verdict, admits};
use crate::metrics::BackendMetrics;

/// The answer while Redis cannot be reached.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum FailureMode {
    /// gRPC UNAVAILABLE, so Envoy's `failure_mode_deny` decides.
    Error,
    /// Admit everything.
    Allow,
    /// Reject everything that has an enforced limit.
    Deny,
    /// Decide with the in-process memory backend until Redis is back (per-replica counts).
    Local,
}

impl FailureMode {
    /// The flag value.
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            FailureMode::Error => "error",
            FailureMode::Allow => "allow",
            FailureMode::Deny => "deny",
            FailureMode::Local => "local",
        }
    }
}

/// A backend that answers by `mode` when `primary` fails.
pub(crate) struct WithFailureMode {
    primary: Arc<dyn Backend>,
    mode: FailureMode,
    local: Arc<MemoryBackend>,
    metrics: BackendMetrics,
}

impl WithFailureMode {
    /// Wraps `primary`; `local` is used only in `FailureMode::Local`.
    pub(crate) fn new(
        primary: Arc<dyn Backend>,
        mode: FailureMode,
        local: Arc<MemoryBackend>,
        metrics: BackendMetrics,
    ) -> Self {
        WithFailureMode {
            primary,
            mode,
            local,
            metrics,
        }
    }

    fn degrade(&self, hits: &[Hit], err: BackendError) -> Result<Outcome, BackendError> {
        self.metrics.failure_mode(self.mode.as_str());
        tracing::debug!(error = %err, mode = self.mode.as_str(), "backend unavailable; failure mode decides");
        let all = |over: bool| -> Vec<Verdict> {
            hits.iter()
                .map(|h| Verdict {
                    over,
                    remaining: if over { 0 } else { h.limit.requests_per_unit },
                    fits: 0,
                    reset: std::time::Duration::ZERO,
                })
                .collect()
        };
        match self.mode {
            FailureMode::Error => Err(err),
            FailureMode::Allow => Ok(Outcome {
                admitted: true,
                verdicts: all(false),
                places: Vec::new(),
            }),
            FailureMode::Deny => Ok(Outcome {
                admitted: admits(hits, |_| true),
                verdicts: all(true),
                places: Vec::new(),
            }),
            FailureMode::Local => Ok(self.local.decide_now(hits)),
        }
    }
}

impl Backend for WithFailureMode {
    fn decide<'a>(&'a self, hits: &'a [Hit]) -> BoxFuture<'a, Result<Outcome, BackendError>> {
        Box::pin(async move {
            // A store that failed beside others that answered falls back alone: its limits
            // are decided by the mode, the others where they live.
            let decided = match self.mode {
                FailureMode::Error => self.primary.decide(hits).await,
                _ => {
                    let degrade = |hits: &[Hit], err| self.degrade(hits, err);
                    self.primary.decide_degrading(hits, &degrade).await
                }
            };
            match decided {
                Ok(outcome) => Ok(outcome),
                // Only an unreachable store is a failure mode's business; a permanent error
                // (a bug) is reported as such rather than hidden behind `allow` or `local`.
                Err(err) if err.is_transient() => self.degrade(hits, err),
                Err(err) => Err(err),
            }
        })
    }

    /// Resets the shared counters, and the local ones the `local` mode may have kept.
    fn reset<'a>(&'a self, hits: &'a [Hit]) -> BoxFuture<'a, Result<usize, BackendError>> {
        Box::pin(async move {
            let local = self.local.reset_now(hits);
            let shared = self.primary.reset(hits).await?;
            Ok(shared.max(local))
        })
    }

    /// The shared holds (the `local` mode's are its own until the store is back).
    fn holds<'a>(
        &'a self,
        hits: &'a [Hit],
    ) -> BoxFuture<'a, Result<Vec<Vec<super::HoldView>>, BackendError>> {
        self.primary.holds(hits)
    }

    /// Ends the shared holds, and the local ones the `local` mode may have kept.
    fn clear_holds<'a>(&'a self, hits: &'a [Hit]) -> BoxFuture<'a, Result<usize, BackendError>> {
        Box::pin(async move {
            let local = self.local.clear_holds_now(hits);
            let shared = self.primary.clear_holds(hits).await?;
            Ok(shared.max(local))
        })
    }

    fn is_reachable(&self) -> bool {
        self.primary.is_reachable()
    }
}
