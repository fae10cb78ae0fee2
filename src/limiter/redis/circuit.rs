//! A Redis store's health ([`StoreHealth`]): whether it was last seen reachable, and its
//! circuit ([`Circuit`]: closed, open or half-open). One word each: "reachable" is what
//! `ratelimit_backend_up` and `/healthcheck` report, "circuit" what stops the calls; the
//! metric names (`ratelimit_backend_up`, error kind `circuit_open`) keep their published words.
//!
//! The circuit is a small breaker: after a few consecutive failures, stop calling Redis for a short
//! cool-down so a dead Redis costs one timeout per cool-down, not one per request. After the
//! cool-down one probe goes through; its success closes the circuit, its failure re-opens it.
//!
//! [`StoreHealth`] decides what counts as a failure: evidence that Redis itself is unwell, counted
//! once per script call (never once per request in it). A connection error is such evidence; a
//! call that timed out is only a suspicion until a PING, sent at once, times out too. One
//! client's oversized work can make its own call slow, but Redis still answers the PING, so the
//! circuit stays closed for everyone else. PINGs travel on a connection of their own: on a
//! call's connection a PING waited behind that connection's calls (a huge one's bytes
//! included), and timed out while Redis was answering.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::time::Duration;

use parking_lot::Mutex;
// tokio's clock (the system's, unless a test pauses it).
use tokio::time::Instant;

use super::connection::Conn;
use crate::metrics::BackendMetrics;

/// Consecutive failures that open the circuit.
const THRESHOLD: u32 = 3;
/// How long the circuit stays open before a probe.
pub(super) const COOL_DOWN: Duration = Duration::from_millis(500);
/// The least time a PING confirming a timed-out call (or the health probe's) gets. A Redis that
/// answers within it is alive, only slow (one client's huge calls on a loaded machine): opening
/// the circuit then would turn that client's slowness into errors for every other client. A
/// stalled Redis still opens it this long after its first timeout, every request meanwhile
/// answered within its own budget. (A PING on its own connection, on a starved machine, stays
/// well within it: docs/performance.md, "Measurements behind the code".)
const CONFIRM_AT_LEAST: Duration = Duration::from_millis(500);

/// What a PING that judges Redis's health gets, for calls of `call_budget`.
fn ping_budget(call_budget: Duration) -> Duration {
    call_budget.max(CONFIRM_AT_LEAST)
}

/// Closed (calls go through), open (calls fail at once) or half-open (one probe in flight).
pub(super) struct Circuit {
    failures: AtomicU32,
    open_until: Mutex<Option<Instant>>,
    probing: AtomicBool,
}

impl Circuit {
    /// A closed circuit.
    pub(super) fn new() -> Circuit {
        Circuit {
            failures: AtomicU32::new(0),
            open_until: Mutex::new(None),
            probing: AtomicBool::new(false),
        }
    }

    /// Whether a call may go to Redis now.
    pub(super) fn allow(&self) -> bool {
        let Some(until) = *self.open_until.lock() else {
            return true;
        };
        if Instant::now() < until {
            return false;
        }
        // Half-open: exactly one probe.
        self.probing
            .compare_exchange(false, true, Ordering::AcqRel, Ordering::Acquire)
            .is_ok()
    }

    /// Records a successful call.
    pub(super) fn on_success(&self) {
        self.failures.store(0, Ordering::Release);
        *self.open_until.lock() = None;
        self.probing.store(false, Ordering::Release);
    }

    /// Opens the circuit now, whatever the count; whether it was closed (a new outage, worth
    /// a line in the log: one that stays open re-opens every cool-down, silently).
    pub(super) fn trip(&self) -> bool {
        let was_closed = self
            .open_until
            .lock()
            .replace(Instant::now() + COOL_DOWN)
            .is_none();
        self.probing.store(false, Ordering::Release);
        was_closed
    }

    /// Records a failed call; whether it opened a closed circuit (a failed probe re-opens an
    /// open one, and says no).
    pub(super) fn on_failure(&self) -> bool {
        let failures = self.failures.fetch_add(1, Ordering::AcqRel) + 1;
        let opens = failures >= THRESHOLD || self.probing.load(Ordering::Acquire);
        if !opens {
            return false;
        }
        self.trip()
    }
}

/// What the backend knows of Redis: the circuit, and whether Redis was last seen reachable
/// (for health and `ratelimit_backend_up`). Shared by the script calls and the probe.
pub(super) struct StoreHealth {
    circuit: Circuit,
    /// The connection PINGs use, and nothing else.
    ping: Conn,
    reachable: AtomicBool,
    /// A PING confirming a timed-out call's suspicion is in flight.
    confirming: AtomicBool,
    /// Where `ratelimit_backend_up` is set: the RLS path's health only.
    up_gauge: Option<UpGauge>,
    /// Which store, for the log: "redis" or "per-second redis".
    name: &'static str,
}

/// `ratelimit_backend_up` over the backend's stores (the main one, and the per-second one when
/// there is one): 1 only while every store is up. One per store, sharing which are down.
#[derive(Clone)]
pub(super) struct UpGauge {
    metrics: BackendMetrics,
    /// One bit per store that was last seen down.
    down: Arc<AtomicU32>,
    bit: u32,
}

impl UpGauge {
    /// The gauges of stores `0..n` of `metrics`.
    pub(super) fn per_store(metrics: &BackendMetrics, n: usize) -> Vec<UpGauge> {
        let down = Arc::new(AtomicU32::new(0));
        (0..n)
            .map(|i| UpGauge {
                metrics: metrics.clone(),
                down: down.clone(),
                bit: 1 << i,
            })
            .collect()
    }

    fn set(&self, up: bool) {
        let was = if up {
            self.down.fetch_and(!self.bit, Ordering::AcqRel)
        } else {
            self.down.fetch_or(self.bit, Ordering::AcqRel)
        };
        let now = if up { was & !self.bit } else { was | self.bit };
        // Racing stores may set it out of order; the next probe of each sets it again.
        self.metrics.up.set((now == 0) as i64);
    }
}

impl StoreHealth {
    /// Closed, and the store called `name` presumed reachable; PINGs go on `ping`. `up_gauge`: the
    /// `ratelimit_backend_up` this health has a say in (one health per store of a backend).
    pub(super) fn new(name: &'static str, ping: Conn, up_gauge: Option<UpGauge>) -> StoreHealth {
        StoreHealth {
            circuit: Circuit::new(),
            ping,
            reachable: AtomicBool::new(true),
            confirming: AtomicBool::new(false),
            up_gauge,
            name,
        }
    }

    /// Which store this is, for the log.
    pub(super) fn name(&self) -> &'static str {
        self.name
    }

    /// Whether a call may go to Redis now.
    pub(super) fn allow(&self) -> bool {
        self.circuit.allow()
    }

    /// Whether Redis was last seen reachable.
    pub(super) fn is_reachable(&self) -> bool {
        self.reachable.load(Ordering::Relaxed)
    }

    fn set_reachable(&self, up: bool) {
        self.reachable.store(up, Ordering::Relaxed);
        if let Some(gauge) = &self.up_gauge {
            gauge.set(up);
        }
    }

    /// Redis answered (a call, or a PING).
    pub(super) fn on_answer(&self) {
        self.circuit.on_success();
        self.set_reachable(true);
    }

    /// Redis could not be reached (`why`: a connection error, a failed PING): counts toward
    /// opening.
    pub(super) fn on_unreachable(&self, why: &dyn std::fmt::Display) {
        if self.circuit.on_failure() {
            tracing::warn!("{} circuit open: unreachable ({why})", self.name);
        }
        self.set_reachable(false);
    }

    /// Redis could not be readied at start (`why`): the circuit opens at once, so the first
    /// calls get the failure mode without each waiting out its budget; the probes close it.
    pub(super) fn down_at_start(&self, why: &dyn std::fmt::Display) {
        self.circuit.trip();
        tracing::warn!("{} circuit open: not ready at start ({why})", self.name);
        self.set_reachable(false);
    }

    /// PINGs Redis, giving it the call budget or [`CONFIRM_AT_LEAST`], whichever is longer;
    /// why it failed, if it did.
    pub(super) async fn ping(&self, call_budget: Duration) -> Result<(), String> {
        let budget = ping_budget(call_budget);
        match tokio::time::timeout(budget, self.ping.ping(budget)).await {
            Ok(Ok(())) => Ok(()),
            Ok(Err(e)) => {
                self.ping.on_error(&e).await;
                Err(format!("PING: {e}"))
            }
            Err(_) => Err(format!("PING: no answer in {budget:?}")),
        }
    }

    /// The health probe: a [`StoreHealth::ping`], then a PING on `calls`, the connection the script
    /// calls go on, which is what requests will see: one found closed (Redis restarted while
    /// nobody called) is made afresh and PINGed once more, so that the next call finds it
    /// open, and health says up only once it is.
    pub(super) async fn probe(&self, calls: &Conn, call_budget: Duration) -> Result<(), String> {
        self.ping(call_budget).await?;
        let budget = ping_budget(call_budget);
        let mut fresh = false;
        loop {
            match tokio::time::timeout(budget, calls.ping(budget)).await {
                Ok(Ok(())) => return Ok(()),
                Ok(Err(e)) => {
                    calls.on_error(&e).await;
                    if fresh || !e.is_connection_dropped() {
                        return Err(format!("PING on the calls' connection: {e}"));
                    }
                    fresh = true;
                }
                Err(_) => {
                    return Err(format!(
                        "PING on the calls' connection: no answer in {budget:?}"
                    ));
                }
            }
        }
    }

    /// A call timed out: opens the circuit only if a [`StoreHealth::ping`] fails too. One
    /// confirmation at a time; the calls timing out meanwhile add nothing.
    pub(super) fn on_timeout(self: &std::sync::Arc<Self>, call_budget: Duration) {
        if self.confirming.swap(true, Ordering::AcqRel) {
            return;
        }
        let health = self.clone();
        tokio::spawn(async move {
            match health.ping(call_budget).await {
                Ok(()) => health.on_answer(),
                Err(why) => {
                    if health.circuit.trip() {
                        tracing::warn!(
                            "{} circuit open: a script call timed out, and {why}",
                            health.name
                        );
                    }
                    health.set_reachable(false);
                }
            }
            health.confirming.store(false, Ordering::Release);
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn opens_after_repeated_failures_and_probes_once() {
        let b = Circuit::new();
        for n in 1..=THRESHOLD {
            assert!(b.allow());
            assert_eq!(b.on_failure(), n == THRESHOLD, "opens at the {THRESHOLD}th");
        }
        assert!(!b.allow());
        tokio::time::advance(COOL_DOWN - Duration::from_millis(1)).await;
        assert!(!b.allow(), "open for the whole cool-down");
        tokio::time::advance(Duration::from_millis(1)).await;
        assert!(b.allow(), "one probe");
        assert!(!b.allow(), "only one");
        assert!(!b.on_failure(), "a failed probe re-opens, as no new outage");
        assert!(!b.allow());
        tokio::time::advance(COOL_DOWN).await;
        assert!(b.allow());
        b.on_success();
        assert!(b.allow() && b.allow(), "closed");
    }

    #[tokio::test(start_paused = true)]
    async fn a_trip_opens_at_once_for_a_cool_down() {
        let b = Circuit::new();
        assert!(b.trip(), "a closed circuit opened");
        assert!(!b.trip(), "open already");
        assert!(!b.allow());
        tokio::time::advance(COOL_DOWN).await;
        assert!(b.allow(), "one probe after the cool-down");
        b.on_success();
        assert!(b.allow() && b.allow());
    }
}
