//! Counting: what a hit is, how each algorithm decides, and the [`Backend`] trait that
//! stores the counters. Nothing here knows about gRPC or YAML.

pub(crate) mod algorithm;
pub(crate) mod calendar;
pub(crate) mod clock;
pub(crate) mod failure_mode;
pub(crate) mod hold;
pub(crate) mod key;
pub(crate) mod memory;
pub(crate) mod redis;
pub(crate) mod share;
pub(crate) mod start;

use std::future::Future;
use std::pin::Pin;
use std::time::Duration;

pub use algorithm::Algorithm;
pub(crate) use calendar::{Calendar, CalendarUnit, Zone};
pub use clock::{Clock, ManualClock, SystemClock};
pub(crate) use hold::{Hold, HoldId, HoldView};
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
    /// Windows that follow a time zone's calendar (fixed_window only): `window_us` is then
    /// the unit's nominal length, for the key and the headers, and windows come from here.
    pub calendar: Option<Calendar>,
}

impl Limit {
    /// The most hits one admission, report or refund of this limit can move: past it an
    /// amount decides exactly as this one does (an admission is over whatever the count, a
    /// report is held at its debt ceiling, a refund empties the counter). Redis' script counts
    /// in doubles, exact below 2^53, so amounts reach it no larger than this, which stays far
    /// below (`requests_per_unit` and `burst` are at most 2^32, the debt 1,000 limits' worth).
    pub fn most_hits(&self) -> u64 {
        self.requests_per_unit
            .max(self.burst)
            .saturating_mul(MAX_MAX_DEBT + 1)
            .saturating_add(1)
    }

    /// The most hits a hit of `kind` on this limit moves, as [`Limit::most_hits`] says; a
    /// refund's bound is that of the widest limit (`requests_per_unit` and `burst` at
    /// 2^32), not this one's: what it gives back was taken under the limit then in force,
    /// which may have been wider (a hold of 60 under a block of 0 in force now gives back 60).
    pub fn most_moved(&self, kind: HitKind) -> u64 {
        const WIDEST: u64 = (1 << 32) * (MAX_MAX_DEBT + 1) + 1;
        match kind {
            HitKind::Refund => self.most_hits().max(WIDEST),
            _ => self.most_hits(),
        }
    }

    /// The fixed window `[start, end)` (µs) holding `now`: aligned to the Unix epoch, or to
    /// the calendar.
    pub fn window_at(&self, now: u64) -> (u64, u64) {
        match &self.calendar {
            None => {
                let start = now - now % self.window_us;
                (start, start.saturating_add(self.window_us))
            }
            Some(calendar) => calendar.window_at(now),
        }
    }

    /// Whether the window is shorter than a minute (a unit of seconds): such counters live in
    /// the per-second store when there is one, as envoyproxy/ratelimit keeps its `SECOND`
    /// limits apart with `REDIS_PERSECOND`.
    /// A concurrency limit's places live in the main store whatever their lifetime, so that a
    /// reload changing it finds them.
    pub fn is_short(&self) -> bool {
        self.algorithm != Algorithm::Concurrency && self.window_us < 60_000_000
    }

    /// The window that, with the algorithm, names this limit's counter. A concurrency limit's is
    /// none: its window is its places' lifetime, which each place keeps as its own end, so a
    /// reload (or an override) that changes the lifetime keeps the places in flight, and the new
    /// lifetime applies to places taken after it.
    pub fn counter_window_us(&self) -> Option<u64> {
        (self.algorithm != Algorithm::Concurrency).then_some(self.window_us)
    }
}

/// How an over-limit verdict on a hit affects the whole request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Enforcement {
    /// Over limit rejects the request.
    Enforce,
    /// Counted and reported, never rejects (`shadow_mode`).
    Shadow,
    /// Soft limit (the config's `quota_mode`): rejects only when every soft hit of the request
    /// is over.
    Soft,
}

/// What a hit's units are: a request asking to pass, usage that already happened, or units
/// given back.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum HitKind {
    /// A request asking to pass (all-or-nothing): consumed only when the whole request is
    /// admitted; a refused request consumes nothing. 0 hits checks whether one more unit fits.
    #[default]
    Admission,
    /// A cost report (usage known after the response, e.g. LLM tokens): recorded whether or not
    /// it fits, past the limit as debt up to the backend's bound; over the limit it still
    /// answers over.
    Report,
    /// A refund (`is_negative_hits`): gives the hits back, never below an empty counter, before
    /// the request's other hits are checked. Never rejects.
    Refund,
}

/// How a limit counts a descriptor's hits: the per-limit `accounting` setting and the
/// server-wide `--accounting` flag.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum Accounting {
    /// A descriptor carrying its own `hits_addend` greater than 0 is a cost report (Envoy sends
    /// those when a stream is done, with the units used); any other is an admission.
    #[default]
    Auto,
    /// Every descriptor is an admission (nothing is recorded for a refused request).
    Admission,
    /// Every descriptor is a cost report (recorded even when over, as envoyproxy/ratelimit
    /// counts every hit).
    Report,
}

impl Accounting {
    /// Every value, in documentation order.
    pub const ALL: [Accounting; 3] = [Accounting::Auto, Accounting::Admission, Accounting::Report];

    /// The name used in config files and flags.
    pub fn as_str(self) -> &'static str {
        match self {
            Accounting::Auto => "auto",
            Accounting::Admission => "admission",
            Accounting::Report => "report",
        }
    }

    /// Parses a config name, case-insensitively.
    pub fn parse(name: &str) -> Option<Accounting> {
        Accounting::ALL
            .into_iter()
            .find(|a| a.as_str().eq_ignore_ascii_case(name))
    }

    /// The kind of a (non-refund) hit of a descriptor whose own `hits_addend` is
    /// `own_hits_addend`.
    pub fn kind(self, own_hits_addend: Option<u64>) -> HitKind {
        match self {
            Accounting::Admission => HitKind::Admission,
            Accounting::Report => HitKind::Report,
            Accounting::Auto if own_hits_addend.is_some_and(|h| h > 0) => HitKind::Report,
            Accounting::Auto => HitKind::Admission,
        }
    }
}

/// How far past its limit a cost report may take a counter, by default: one limit's worth
/// (`--max-debt`). See [`State::record`](algorithm::State::record) for what that means per
/// algorithm.
pub(crate) const DEFAULT_MAX_DEBT: u64 = 1;
/// The largest `--max-debt`.
pub(crate) const MAX_MAX_DEBT: u64 = 1_000;

/// One counter touched by a request: the key that names it, its limit and how many hits to add.
#[derive(Clone, Debug)]
pub struct Hit {
    /// Which counter: domain, entries and limit identity.
    pub key: CounterKey,
    /// The limit to apply.
    pub limit: Limit,
    /// Hits to add (a refund: to give back); 0 checks without consuming.
    pub hits: u64,
    /// What an over-limit verdict on this hit does to the request.
    pub enforcement: Enforcement,
    /// Admission, cost report or refund.
    pub kind: HitKind,
    /// The hold it names, if its node keeps holds (`hold_key`).
    pub hold: Hold,
}

impl Hit {
    /// Whether it takes or releases a place (a concurrency limit's).
    pub fn is_place(&self) -> bool {
        self.limit.algorithm == Algorithm::Concurrency
    }
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
    /// Whether the request was admitted; when false, no admission was consumed (cost reports
    /// are recorded and refunds given back either way).
    pub admitted: bool,
    /// One verdict per hit, in the order of the hits.
    pub verdicts: Vec<Verdict>,
    /// What the request did to its concurrency limits' places (none for most requests: no
    /// allocation).
    pub places: Vec<PlaceChange>,
}

/// What one request did to a concurrency limit's places, as the backend saw it: each place is
/// added once and removed once (released, or ended and dropped), so these changes summed over
/// every replica sharing a store are the places in use in it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PlaceChange {
    /// The hit (its index in the request's hits).
    pub hit: usize,
    /// 1: a place taken; -1: one released; 0: neither.
    pub change: i64,
    /// When the place taken or released ends (µs, the store's time): it is in use until then.
    pub end: u64,
    /// The store's time of the decision (µs).
    pub at: u64,
    /// Places that had ended unreleased (a crashed Envoy, or a lifetime shorter than a stream)
    /// and were dropped.
    pub ended: u64,
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

/// Decides hits whose store failed (the failure mode), given the failure.
pub(crate) type Degrade<'d> =
    dyn Fn(&[Hit], BackendError) -> Result<Outcome, BackendError> + Send + Sync + 'd;

/// A boxed future, so backends can be chosen at run time.
pub(crate) type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// Where counters live. Every backend gives the same guarantees, per request and atomically:
/// refunds are given back first; then every other hit is checked; cost reports are recorded
/// whatever the checks say (up to the backend's debt bound); admissions are all-or-nothing: if
/// any enforcing hit would exceed its limit (see [`admits`]), no admission is consumed,
/// otherwise every admission that fits is.
pub trait Backend: Send + Sync + 'static {
    /// Checks every hit and commits them all or none.
    fn decide<'a>(&'a self, hits: &'a [Hit]) -> BoxFuture<'a, Result<Outcome, BackendError>>;

    /// [`Backend::decide`] for a backend that never waits and never fails (the memory
    /// backend): the decision at once, without a boxed future per request. `None` (the
    /// default): call `decide`.
    fn decide_at_once(&self, _hits: &[Hit]) -> Option<Outcome> {
        None
    }

    /// [`Backend::decide`], where `degrade` decides the hits of a store that failed when the
    /// request's other stores answered (a backend with several stores: each store's limits
    /// are decided where they live, and only the failed store's fall back). The default, for
    /// a backend of one store: `decide`.
    fn decide_degrading<'a>(
        &'a self,
        hits: &'a [Hit],
        degrade: &'a Degrade<'a>,
    ) -> BoxFuture<'a, Result<Outcome, BackendError>> {
        let _ = degrade;
        self.decide(hits)
    }

    /// Forgets the counters of `hits` (each limit is fully available again) and their holds;
    /// returns how many counters were held. For the admin API.
    fn reset<'a>(&'a self, hits: &'a [Hit]) -> BoxFuture<'a, Result<usize, BackendError>>;

    /// The live holds of each hit's counter (those of a node that keeps holds), the first to
    /// end first. For the admin API.
    fn holds<'a>(
        &'a self,
        hits: &'a [Hit],
    ) -> BoxFuture<'a, Result<Vec<Vec<HoldView>>, BackendError>>;

    /// Ends every hold of `hits`' counters: a concurrency limit's places are free again, a
    /// rate limit's hits stay counted (refunds naming those holds give nothing back). Returns
    /// how many holds there were. For the admin API.
    fn clear_holds<'a>(&'a self, hits: &'a [Hit]) -> BoxFuture<'a, Result<usize, BackendError>>;

    /// Whether the store is reachable, as far as the backend knows (for health and metrics).
    fn is_reachable(&self) -> bool {
        true
    }
}

/// The request-level rule shared by every backend: is a request admitted given each hit's
/// `over` flag? Enforcing hits that are over reject; soft hits reject only when every soft
/// hit of the request is over; shadow hits and refunds never reject.
pub(crate) fn admits(hits: &[Hit], over: impl Fn(usize) -> bool) -> bool {
    let enforced_over = hits.iter().enumerate().any(|(i, h)| {
        h.enforcement == Enforcement::Enforce && h.kind != HitKind::Refund && over(i)
    });
    !enforced_over && !soft_rejects(hits, over)
}

/// Whether the request's soft hits (`quota_mode`) reject it: there is at least one, and all are over.
pub(crate) fn soft_rejects(hits: &[Hit], over: impl Fn(usize) -> bool) -> bool {
    let mut soft = hits
        .iter()
        .enumerate()
        .filter(|(_, h)| h.enforcement == Enforcement::Soft && h.kind != HitKind::Refund)
        .peekable();
    soft.peek().is_some() && soft.all(|(i, _)| over(i))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hit(enforcement: Enforcement) -> Hit {
        Hit {
            key: CounterKey::new("d", [] as [(&str, &str); 0]),
            limit: Limit {
                algorithm: Algorithm::FixedWindow,
                requests_per_unit: 1,
                window_us: 1_000_000,
                burst: 1,
                calendar: None,
            },
            hits: 1,
            enforcement,
            kind: HitKind::Admission,
            hold: Hold::Unheld,
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
            hit(Enforcement::Soft),
            hit(Enforcement::Soft),
            hit(Enforcement::Enforce),
        ];
        assert!(admits(&hits, |i| i == 0));
        assert!(!admits(&hits, |i| i < 2));
        assert!(!admits(&hits, |i| i == 2));
    }

    #[test]
    fn refunds_never_reject() {
        let mut refund = hit(Enforcement::Enforce);
        refund.kind = HitKind::Refund;
        let mut soft_refund = hit(Enforcement::Soft);
        soft_refund.kind = HitKind::Refund;
        assert!(admits(&[refund.clone(), soft_refund.clone()], |_| true));
        // A soft refund is not one of the soft hits that must all be over.
        let hits = [soft_refund, hit(Enforcement::Soft)];
        assert!(!admits(&hits, |i| i == 1));
    }

    #[test]
    fn auto_accounting_reads_the_descriptors_own_hits_addend() {
        assert_eq!(Accounting::Auto.kind(Some(40)), HitKind::Report);
        assert_eq!(Accounting::Auto.kind(Some(0)), HitKind::Admission);
        assert_eq!(Accounting::Auto.kind(None), HitKind::Admission);
        assert_eq!(Accounting::Admission.kind(Some(40)), HitKind::Admission);
        assert_eq!(Accounting::Report.kind(None), HitKind::Report);
        for a in Accounting::ALL {
            assert_eq!(Accounting::parse(&a.as_str().to_uppercase()), Some(a));
        }
    }
}
