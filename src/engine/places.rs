//! Places in use per concurrency rule, kept from what each request did to them (the backend's
//! [`PlaceChange`]s): a place taken counts until it ends, a place released counts against until
//! it would have ended. Each replica keeps its own share; summed over the replicas of one
//! store (a place taken on one and released on another included) they are the places in use.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use parking_lot::Mutex;
use tokio::time::Instant;

use crate::limiter::PlaceChange;
use crate::metrics::{DecisionMetrics, PlaceLabels};

/// Most distinct end times one rule's ledger keeps: ends are rounded up to a step of the
/// lifetime / this (a second at least), so a rule costs at most this many entries however many
/// places it has; a place counts up to one step longer than it lasts.
const STEPS: u64 = 4096;

/// One rule's places by when they end (rounded up to its step): +1 taken, -1 released.
struct Ledger {
    by_end: BTreeMap<u64, i64>,
    in_use: i64,
    gauge: prometheus_client::metrics::gauge::Gauge,
}

impl Ledger {
    /// Drops what ends by `now`.
    fn end_by(&mut self, now: u64) {
        while let Some(entry) = self.by_end.first_entry() {
            if *entry.key() > now {
                break;
            }
            self.in_use -= entry.remove();
        }
        self.gauge.set(self.in_use);
    }
}

/// Every concurrency rule's ledger, and the store's time as last seen.
#[derive(Default)]
pub(crate) struct Places {
    ledgers: Mutex<HashMap<PlaceLabels, Ledger>>,
    /// (the store's time of the latest decision, when it was seen): the store's time now is
    /// that plus what has passed since.
    seen: Mutex<Option<(u64, Instant)>>,
    /// Wakes [`Places::keep`] when the first place is recorded.
    first: tokio::sync::Notify,
}

impl Places {
    /// The store's time now, as far as the latest decision tells.
    fn now(&self, at: Option<u64>) -> u64 {
        let mut seen = self.seen.lock();
        if let Some(at) = at
            && seen.is_none_or(|(t, i)| at >= t + i.elapsed().as_micros() as u64)
        {
            *seen = Some((at, Instant::now()));
        }
        seen.map_or(0, |(t, i)| t + i.elapsed().as_micros() as u64)
    }

    /// Records `change`, made on the concurrency rule `rule` of `domain` whose places last
    /// `lifetime_us`, into `metrics`.
    pub(crate) fn record(
        &self,
        metrics: &DecisionMetrics,
        domain: &Arc<String>,
        rule: &str,
        lifetime_us: u64,
        change: &PlaceChange,
    ) {
        let labels = PlaceLabels {
            domain: domain.clone(),
            rule: Arc::new(rule.to_owned()),
        };
        metrics.note_places(&labels);
        // At 0 from the rule's first change, so that a rate of it exists before one ends.
        let ended = metrics.places_ended.get_or_create(&labels);
        if change.ended > 0 {
            ended.inc_by(change.ended);
        }
        drop(ended);
        let now = self.now(Some(change.at));
        let mut ledgers = self.ledgers.lock();
        if ledgers.is_empty() {
            self.first.notify_one();
        }
        let ledger = ledgers.entry(labels).or_insert_with_key(|labels| Ledger {
            by_end: BTreeMap::new(),
            in_use: 0,
            gauge: metrics.places_in_use.get_or_create(labels).clone(),
        });
        if change.change != 0 && change.end > now {
            let step = (lifetime_us / STEPS).max(1_000_000);
            let end = change.end.div_ceil(step) * step;
            *ledger.by_end.entry(end).or_default() += change.change;
            ledger.in_use += change.change;
        }
        ledger.end_by(now);
    }

    /// Keeps every ledger current: once a place has been recorded, drops what has ended every
    /// second (places end whether or not requests come). A config without concurrency limits
    /// never wakes it.
    pub(crate) async fn keep(self: Arc<Self>) {
        self.first.notified().await;
        let mut every = tokio::time::interval(std::time::Duration::from_secs(1));
        every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            every.tick().await;
            self.tick();
        }
    }

    /// Drops from every ledger what has ended.
    fn tick(&self) {
        let now = self.now(None);
        if now == 0 {
            return;
        }
        for ledger in self.ledgers.lock().values_mut() {
            ledger.end_by(now);
        }
    }
}
