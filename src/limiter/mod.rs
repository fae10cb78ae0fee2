//! Counting: what a hit is, how each algorithm decides, and the [`Backend`] trait that
//! stores the counters. Nothing here knows about gRPC or YAML.

pub(crate) mod algorithm;
pub(crate) mod clock;
pub(crate) mod fallback;
pub(crate) mod key;
pub(crate) mod memory;
pub(crate) mod redis;

use std::future::Future;
use std::pin::Pin;
use std::time::Duration;

pub use algorithm::Algorithm;
pub use clock::{Clock, ManualClock, SystemClock};
pub use key::{CounterKey, HashTag, KeyFormat};
pub use memory::MemoryBackend;

/// One limit as the backend applies it: how many units of hits per window, by which algorithm.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Limit {
    /// How counting works for this limit.
    pub algorithm: Algorithm,
    /// Hits allowed per window (for the token bucket: refill per window).
    pub requests_per_unit: u64,
    /// Window length in microseconds (unit × unit_multiplier); always > 0.
    pub window_us: u64,
    /// Token bucket capacity; equals `requests_per_unit` unless configured.
    pub burst: u64,
}

/// How an over-limit verdict on a hit affects the whole request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Enforcement {
    /// Over limit rejects the request.
    Enforce,
    /// Counted and reported, never rejects (`shadow_mode`).
    Shadow,
    /// Soft limit (`quota_mode`): rejects only when every quota hit of the request is over.
    Quota,
}

/// One counter touched by a request: the key that names it, its limit and how many hits to add.
#[derive(Clone, Debug)]
pub struct Hit {
    /// Which counter: domain, entries and limit identity.
    pub key: CounterKey,
    /// The limit to apply.
    pub limit: Limit,
    /// Hits to add; 0 checks without consuming.
    pub hits: u64,
    /// What an over-limit verdict on this hit does to the request.
    pub enforcement: Enforcement,
}

/// The verdict on one hit.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Verdict {
    /// The hit does not fit in its limit.
    pub over: bool,
    /// Hits still available after this request (0 when over).
    pub remaining: u64,
    /// Over: how many of the request's hits would have fit (fewer than it asked for; 0 when
    /// unknown). Unused when within the limit. Only statistics read it.
    pub fits: u64,
    /// Admitted: time until the limit is fully available again (fixed window: the window end).
    /// Over: time until this request would fit.
    pub reset: Duration,
}

/// The backend's answer for a whole request.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Outcome {
    /// Whether the request was admitted; when false, no counter was consumed.
    pub admitted: bool,
    /// One verdict per hit, in the order of the hits.
    pub verdicts: Vec<Verdict>,
}

/// Why a backend could not decide. The detail is for the log only: clients get a short,
/// stable message chosen by the front end.
#[derive(Debug, thiserror::Error)]
pub enum BackendError {
    /// The store could not be reached or did not answer in time (network, timeout, failover,
    /// a busy or loading server, rejected credentials); retrying may succeed. The failure mode
    /// decides what such a request gets.
    #[error("backend unavailable ({kind}): {detail}")]
    Unavailable {
        /// A short, bounded category for metrics (timeout, connection, cluster, …).
        kind: &'static str,
        /// What happened, for the log.
        detail: String,
    },
    /// The store answered something this service cannot use (a malformed script reply, a
    /// script error, a key of the wrong type): a bug or foreign data; retrying will not help.
    #[error("backend failed ({kind}): {detail}")]
    Internal {
        /// A short, bounded category for metrics.
        kind: &'static str,
        /// What happened, for the log.
        detail: String,
    },
}

impl BackendError {
    /// True when a retry may succeed (network, timeout, failover), false for a bug or bad data.
    pub fn is_transient(&self) -> bool {
        matches!(self, BackendError::Unavailable { .. })
    }
}

/// A boxed future, so backends can be chosen at run time.
pub(crate) type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// Where counters live. Every backend gives the same guarantee: all-or-nothing per request.
/// If any enforcing hit would exceed its limit (see [`admits`]), nothing is consumed;
/// otherwise every hit that fits is consumed, atomically with the check.
pub trait Backend: Send + Sync + 'static {
    /// Checks every hit and commits them all or none.
    fn decide<'a>(&'a self, hits: &'a [Hit]) -> BoxFuture<'a, Result<Outcome, BackendError>>;

    /// [`Backend::decide`] for a backend that never waits and never fails (the memory
    /// backend): the decision at once, without a boxed future per request. `None` (the
    /// default): call `decide`.
    fn decide_at_once(&self, _hits: &[Hit]) -> Option<Outcome> {
        None
    }

    /// Forgets the counters of `hits` (each limit is fully available again); returns how
    /// many were held. For the admin API.
    fn reset<'a>(&'a self, hits: &'a [Hit]) -> BoxFuture<'a, Result<usize, BackendError>>;

    /// Whether the store is reachable, as far as the backend knows (for health and metrics).
    fn is_up(&self) -> bool {
        true
    }
}

/// The request-level rule shared by every backend: is a request admitted given each hit's
/// `over` flag? Enforcing hits that are over reject; quota hits reject only when every quota
/// hit of the request is over; shadow hits never reject.
pub(crate) fn admits(hits: &[Hit], over: impl Fn(usize) -> bool) -> bool {
    let enforced_over = hits
        .iter()
        .enumerate()
        .any(|(i, h)| h.enforcement == Enforcement::Enforce && over(i));
    !enforced_over && !quota_rejects(hits, over)
}

/// Whether the request's quota hits reject it: there is at least one, and all are over.
pub(crate) fn quota_rejects(hits: &[Hit], over: impl Fn(usize) -> bool) -> bool {
    let mut quota = hits
        .iter()
        .enumerate()
        .filter(|(_, h)| h.enforcement == Enforcement::Quota)
        .peekable();
    quota.peek().is_some() && quota.all(|(i, _)| over(i))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hit(enforcement: Enforcement) -> Hit {
        Hit {
            key: CounterKey::new("d", []),
            limit: Limit {
                algorithm: Algorithm::FixedWindow,
                requests_per_unit: 1,
                window_us: 1_000_000,
                burst: 1,
            },
            hits: 1,
            enforcement,
        }
    }

    #[test]
    fn enforced_over_rejects_shadow_never_does() {
        let hits = [hit(Enforcement::Enforce), hit(Enforcement::Shadow)];
        assert!(admits(&hits, |_| false));
        assert!(!admits(&hits, |i| i == 0));
        assert!(admits(&hits, |i| i == 1));
    }

    #[test]
    fn quota_rejects_only_when_all_quota_hits_are_over() {
        let hits = [
            hit(Enforcement::Quota),
            hit(Enforcement::Quota),
            hit(Enforcement::Enforce),
        ];
        assert!(admits(&hits, |i| i == 0));
        assert!(!admits(&hits, |i| i < 2));
        assert!(!admits(&hits, |i| i == 2));
    }
}
