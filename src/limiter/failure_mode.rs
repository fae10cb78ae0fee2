//! What to answer while the shared backend is unavailable (`--redis-failure-mode`).

use std::sync::Arc;

use std::sync::atomic::{AtomicBool, Ordering};

use super::share::{Shares, WRITE_BACK_BATCH};
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
    /// Decide in this process on this replica's share of what Redis last said was left, and
    /// write what was admitted back when Redis is back (`share.rs`).
    Share,
}

impl FailureMode {
    /// The flag value.
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            FailureMode::Error => "error",
            FailureMode::Allow => "allow",
            FailureMode::Deny => "deny",
            FailureMode::Local => "local",
            FailureMode::Share => "share",
        }
    }
}

/// A backend that answers by `mode` when `primary` fails.
pub(crate) struct WithFailureMode {
    primary: Arc<dyn Backend>,
    mode: FailureMode,
    local: Arc<MemoryBackend>,
    /// The `share` mode's state (that mode only).
    shares: Option<Arc<Shares>>,
    metrics: BackendMetrics,
}

impl WithFailureMode {
    /// Wraps `primary`; `local` is used only in `FailureMode::Local`, `shares` only in
    /// `FailureMode::Share` (and must then be given).
    pub(crate) fn new(
        primary: Arc<dyn Backend>,
        mode: FailureMode,
        local: Arc<MemoryBackend>,
        shares: Option<Arc<Shares>>,
        metrics: BackendMetrics,
    ) -> Self {
        debug_assert_eq!(shares.is_some(), mode == FailureMode::Share);
        WithFailureMode {
            primary,
            mode,
            local,
            shares,
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
            FailureMode::Share => match &self.shares {
                Some(shares) => {
                    let (outcome, start) = shares.degrade(hits);
                    if start {
                        tokio::spawn(rejoin(
                            self.primary.clone(),
                            shares.clone(),
                            self.metrics.clone(),
                        ));
                    }
                    Ok(outcome)
                }
                None => Err(err),
            },
        }
    }
}

/// How often the `share` mode's write-back looks whether Redis is back.
const REJOIN_EVERY: std::time::Duration = std::time::Duration::from_millis(10);
/// How long after its first write-back a replica still decides alone: long enough for the
/// other replicas (probing every 0.1 s while Redis is down) to find Redis back and write theirs,
/// so that none asks Redis while another's hits are still missing there.
const REJOIN_GRACE: std::time::Duration = std::time::Duration::from_millis(250);

/// How many times the last write-back is tried, [`REJOIN_EVERY`] apart, before its hits are
/// given up (Redis failed again right after it came back).
const FINAL_TRIES: usize = 20;

/// The `share` mode's way back: once Redis is reachable, writes what was admitted alone into
/// its counters (cost reports, a batch per call) and goes on writing back what is admitted
/// alone for [`REJOIN_GRACE`]; then sends requests to Redis again and writes what was admitted
/// alone since the last batch. A batch Redis refuses for good (not a transient failure) is
/// given up and counted lost; a transient failure waits for Redis again.
async fn rejoin(primary: Arc<dyn Backend>, shares: Arc<Shares>, metrics: BackendMetrics) {
    let mut tally = WriteBack::default();
    // When Redis first took this replica's hits back.
    let mut back: Option<tokio::time::Instant> = None;
    loop {
        tokio::time::sleep(REJOIN_EVERY).await;
        if !primary.is_reachable() {
            continue;
        }
        if tally
            .write(&*primary, Some(&shares), shares.owed(), &metrics)
            .await
            .is_err()
        {
            continue;
        }
        if back.get_or_insert_with(tokio::time::Instant::now).elapsed() >= REJOIN_GRACE {
            break;
        }
    }
    // Handed over, no longer in the ledger: a new outage's hits there are not these.
    let mut rest = shares.rejoin();
    for _ in 0..FINAL_TRIES {
        match tally.write(&*primary, None, rest, &metrics).await {
            Ok(()) => {
                rest = Vec::new();
                break;
            }
            Err(left) => rest = left,
        }
        tokio::time::sleep(REJOIN_EVERY).await;
    }
    let given_up: u64 = rest.iter().map(|h| h.hits).sum();
    if given_up > 0 {
        tracing::warn!(
            hits = given_up,
            "share failure mode: hits admitted alone could not be written back"
        );
        tally.lost += given_up;
        metrics.written_back_lost.inc_by(given_up);
    }
    tracing::info!(
        written = tally.written,
        lost = tally.lost,
        "share failure mode: redis is back and has the hits admitted alone"
    );
}

/// Hits written back, and given up, by one [`rejoin`].
#[derive(Default)]
struct WriteBack {
    written: u64,
    lost: u64,
}

impl WriteBack {
    /// Writes `owed` back a batch per call, each batch then marked written in `ledger` (if
    /// they are still there); on a transient failure, what is left unwritten.
    async fn write(
        &mut self,
        primary: &dyn Backend,
        ledger: Option<&Shares>,
        owed: Vec<Hit>,
        metrics: &BackendMetrics,
    ) -> Result<(), Vec<Hit>> {
        for (i, batch) in owed.chunks(WRITE_BACK_BATCH).enumerate() {
            let hits: u64 = batch.iter().map(|h| h.hits).sum();
            match primary.decide(batch).await {
                Ok(_) => {
                    self.written += hits;
                    metrics.written_back.inc_by(hits);
                }
                Err(e) if e.is_transient() => {
                    return Err(owed[i * WRITE_BACK_BATCH..].to_vec());
                }
                Err(e) => {
                    tracing::warn!(error = %e, hits, "share failure mode: hits admitted alone could not be written back");
                    self.lost += hits;
                    metrics.written_back_lost.inc_by(hits);
                }
            }
            if let Some(shares) = ledger {
                shares.written(batch);
            }
        }
        Ok(())
    }
}

impl Backend for WithFailureMode {
    fn decide<'a>(&'a self, hits: &'a [Hit]) -> BoxFuture<'a, Result<Outcome, BackendError>> {
        Box::pin(async move {
            // `share`: once a call has failed, decided alone until what was admitted alone is
            // written back.
            if let Some(shares) = &self.shares
                && shares.is_alone()
                && let Some(outcome) = shares.decide_alone(hits)
            {
                self.metrics.failure_mode(self.mode.as_str());
                return Ok(outcome);
            }
            // A store that failed beside others that answered falls back alone: its limits
            // are decided by the mode, the others where they live.
            let degraded = AtomicBool::new(false);
            let degrade = |hits: &[Hit], err| {
                degraded.store(true, Ordering::Relaxed);
                self.degrade(hits, err)
            };
            let decided = match (self.mode, &self.shares) {
                (FailureMode::Error, _) => self.primary.decide(hits).await,
                // A call still unanswered when Envoy would give up is as good as failed: decided
                // alone before then. (Redis may still count it: that errs toward refusing.)
                (FailureMode::Share, Some(shares)) => {
                    let call = self.primary.decide_degrading(hits, &degrade);
                    match tokio::time::timeout(shares.after(), call).await {
                        Ok(decided) => decided,
                        Err(_) => Err(BackendError::Unavailable {
                            kind: "timeout",
                            detail: format!(
                                "no answer within --redis-share-after ({:?})",
                                shares.after()
                            ),
                        }),
                    }
                }
                _ => self.primary.decide_degrading(hits, &degrade).await,
            };
            match decided {
                Ok(outcome) => {
                    if let Some(shares) = &self.shares
                        && !degraded.load(Ordering::Relaxed)
                    {
                        shares.saw(hits, &outcome);
                    }
                    Ok(outcome)
                }
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
