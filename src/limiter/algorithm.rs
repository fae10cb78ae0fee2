//! The four counting algorithms as pure state transitions over microsecond timestamps.
//!
//! Each counter is checked first ([`State::check`]) and committed later ([`State::commit`]) only
//! if the whole request is admitted; a check never consumes. A cost report is recorded whatever
//! the check said ([`State::record`], past the limit as bounded debt) and a refund given back
//! before anything is checked ([`State::refund`]). The Redis script mirrors this math.

use std::collections::VecDeque;
use std::fmt;
use std::time::Duration;

use super::hold::{Held, HoldId, Holds};
use super::{Limit, Verdict};

/// How a limit counts hits.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub enum Algorithm {
    /// One counter per window aligned to the Unix epoch (envoyproxy/ratelimit's only algorithm).
    /// Lets up to twice the limit through across a window boundary.
    #[default]
    FixedWindow,
    /// Weighted sum of the previous and the current window: O(1) memory, smooth at the boundary,
    /// approximate (assumes the previous window's hits were spread evenly).
    SlidingWindow,
    /// Exact log of hit times: never more than the limit in any window-long interval; O(limit)
    /// memory per counter.
    SlidingLog,
    /// Refill `requests_per_unit` per window up to `burst` (GCRA: one timestamp per counter).
    TokenBucket,
    /// Requests in flight: `requests_per_unit` places, each taken by an admission that names a
    /// hold and kept until a refund naming it releases it or the window (its lifetime) ends.
    Concurrency,
}

impl Algorithm {
    /// Every rate algorithm (counting hits in time), in documentation order; [`Algorithm::Concurrency`]
    /// counts places and is apart.
    pub const ALL: [Algorithm; 4] = [
        Algorithm::FixedWindow,
        Algorithm::SlidingWindow,
        Algorithm::SlidingLog,
        Algorithm::TokenBucket,
    ];

    /// The name used in config files and output.
    pub fn as_str(self) -> &'static str {
        match self {
            Algorithm::FixedWindow => "fixed_window",
            Algorithm::SlidingWindow => "sliding_window",
            Algorithm::SlidingLog => "sliding_log",
            Algorithm::TokenBucket => "token_bucket",
            Algorithm::Concurrency => "concurrency",
        }
    }

    /// Parses a config name, case-insensitively.
    pub fn parse(name: &str) -> Option<Algorithm> {
        Algorithm::ALL
            .into_iter()
            .chain([Algorithm::Concurrency])
            .find(|a| a.as_str().eq_ignore_ascii_case(name))
    }

    /// A stable one-byte tag for counter keys.
    pub fn tag(self) -> u8 {
        match self {
            Algorithm::FixedWindow => b'f',
            Algorithm::SlidingWindow => b's',
            // 'w' (weighted log): the Redis layout changed from one member per hit to one per
            // request, so counters of the old layout are never read as the new one.
            Algorithm::SlidingLog => b'w',
            Algorithm::TokenBucket => b'b',
            Algorithm::Concurrency => b'c',
        }
    }
}

impl fmt::Display for Algorithm {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The stored state of one counter.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum State {
    /// Hits in the window `[start, end)`. The end is kept, not derived: a calendar window's
    /// takes time-zone lookups to work out, and its length varies.
    Fixed { start: u64, end: u64, count: u64 },
    /// Hits in the window starting at `start` and in the one before it.
    Sliding { start: u64, prev: u64, cur: u64 },
    /// (time, hits) of every admitted hit still inside the window, oldest first.
    Log {
        entries: VecDeque<(u64, u64)>,
        total: u64,
    },
    /// GCRA theoretical arrival time, in units of 1/`scale` microseconds (exact for any rate).
    Bucket { tat: u128, scale: u64 },
    /// A concurrency limit's places: one hold each, until released or ended.
    Places(Box<Holds>),
}

/// Log entries a rejected sliding_log check scans for its reset, here and in `script.lua`.
pub(crate) const LOG_SCAN_MAX: usize = 128;
/// Log entries one refund removes or shortens at most, here and in `script.lua`: a refund
/// larger than the oldest entries hold gives back only what they hold.
pub(crate) const LOG_REFUND_MAX: usize = 1000;

fn us(d: u128) -> Duration {
    Duration::from_micros(u64::try_from(d).unwrap_or(u64::MAX))
}

fn div_ceil(a: u128, b: u128) -> u128 {
    a.div_ceil(b.max(1))
}

impl State {
    /// A fresh counter for `algorithm`.
    pub(crate) fn new(algorithm: Algorithm) -> State {
        match algorithm {
            Algorithm::FixedWindow => State::Fixed {
                start: 0,
                end: 0,
                count: 0,
            },
            Algorithm::SlidingWindow => State::Sliding {
                start: 0,
                prev: 0,
                cur: 0,
            },
            Algorithm::SlidingLog => State::Log {
                entries: VecDeque::new(),
                total: 0,
            },
            Algorithm::TokenBucket => State::Bucket { tat: 0, scale: 1 },
            Algorithm::Concurrency => State::Places(Box::default()),
        }
    }

    /// Heap bytes beyond the state itself (a sliding log's entries), for the memory bound.
    pub(crate) fn heap_bytes(&self) -> u64 {
        match self {
            State::Log { entries, .. } => (entries.capacity() * 16) as u64,
            State::Places(holds) => std::mem::size_of::<Holds>() as u64 + holds.heap_bytes(),
            _ => 0,
        }
    }

    /// Whether this state belongs to `algorithm`.
    pub(crate) fn is(&self, algorithm: Algorithm) -> bool {
        matches!(
            (self, algorithm),
            (State::Fixed { .. }, Algorithm::FixedWindow)
                | (State::Sliding { .. }, Algorithm::SlidingWindow)
                | (State::Log { .. }, Algorithm::SlidingLog)
                | (State::Bucket { .. }, Algorithm::TokenBucket)
                | (State::Places(_), Algorithm::Concurrency)
        )
    }

    /// Brings the state forward to `now` (rolls windows, drops expired log entries). Changes no
    /// observable count; [`check`](Self::check) and [`commit`](Self::commit) call it.
    fn advance(&mut self, limit: &Limit, now: u64) {
        let w = limit.window_us;
        match self {
            State::Fixed { start, end, count } => {
                // The stored window while it holds `now`; another is worked out only then.
                if now < *start || now >= *end {
                    let (window_start, window_end) = limit.window_at(now);
                    if *start != window_start {
                        *count = 0;
                    }
                    (*start, *end) = (window_start, window_end);
                }
            }
            State::Sliding { start, prev, cur } => {
                let window_start = now - now % w;
                if *start != window_start {
                    *prev = if start.checked_add(w) == Some(window_start) {
                        *cur
                    } else {
                        0
                    };
                    *cur = 0;
                    *start = window_start;
                }
            }
            State::Log { entries, total } => {
                while let Some(&(t, n)) = entries.front() {
                    if t.saturating_add(w) > now {
                        break;
                    }
                    *total -= n;
                    entries.pop_front();
                }
            }
            State::Bucket { tat, scale } => {
                let rpu = limit.requests_per_unit.max(1);
                if *scale != rpu {
                    *tat = *tat * rpu as u128 / (*scale).max(1) as u128;
                    *scale = rpu;
                }
            }
            State::Places(holds) => {
                holds.end_by(now);
            }
        }
    }

    /// Decides whether `hits` more fit at `now` without consuming anything. A check of 0 hits
    /// asks whether one more unit fits: it is over once nothing is left (a budget spent to
    /// exactly its size refuses the request it checks for).
    pub(crate) fn check(&mut self, limit: &Limit, now: u64, hits: u64) -> Verdict {
        self.advance(limit, now);
        let rpu = limit.requests_per_unit;
        let w = limit.window_us;
        // What must fit for the verdict to be "within": at least one unit.
        let need = hits.max(1);
        let never = |fits: u64| Verdict {
            over: true,
            remaining: 0,
            fits,
            reset: us(w as u128),
        };
        match self {
            State::Fixed { end, count, .. } => {
                let over = rpu == 0 || count.saturating_add(need) > rpu;
                Verdict {
                    over,
                    remaining: if over {
                        0
                    } else {
                        rpu - count.saturating_add(hits)
                    },
                    fits: rpu.saturating_sub(*count),
                    reset: us((*end - now) as u128),
                }
            }
            State::Sliding { start, prev, cur } => {
                let elapsed = (now - *start) as u128;
                let (w, prev_n, cur_n) = (w as u128, *prev as u128, *cur as u128);
                // Rounded up, so `over` is exactly "prev·(w−e)/w + cur + need > rpu".
                let weighted_prev = div_ceil(prev_n * (w - elapsed), w);
                let used = weighted_prev + cur_n;
                let rpu_n = rpu as u128;
                if rpu > 0 && used + need as u128 <= rpu_n {
                    let reset = if cur_n + (hits as u128) > 0 {
                        2 * w - elapsed
                    } else if prev_n > 0 {
                        w - elapsed
                    } else {
                        0
                    };
                    return Verdict {
                        over: false,
                        remaining: (rpu_n - used - hits as u128) as u64,
                        fits: 0,
                        reset: us(reset),
                    };
                }
                let fits = rpu_n.saturating_sub(used) as u64;
                if rpu == 0 || need > rpu {
                    return never(fits);
                }
                let room = rpu_n - need as u128; // what prev-weight + cur may add up to
                let wait = if cur_n <= room {
                    // The previous window's weight fades enough within this window:
                    // prev·(w−e)/w ≤ room − cur  ⇔  e ≥ w − (room − cur)·w/prev.
                    let target = w - (room - cur_n) * w / prev_n.max(1);
                    target.saturating_sub(elapsed).max(1)
                } else {
                    // Wait for the next window, where the current count becomes the faded one.
                    let target = w - room * w / cur_n;
                    (w - elapsed) + target
                };
                Verdict {
                    over: true,
                    remaining: 0,
                    fits,
                    reset: us(wait),
                }
            }
            State::Log { entries, total } => {
                if rpu > 0 && total.saturating_add(need) <= rpu {
                    let reset = if hits > 0 {
                        w as u128
                    } else {
                        entries.back().map_or(0, |&(t, _)| (t + w - now) as u128)
                    };
                    return Verdict {
                        over: false,
                        remaining: rpu - *total - hits,
                        fits: 0,
                        reset: us(reset),
                    };
                }
                let fits = rpu.saturating_sub(*total);
                if rpu == 0 || need > rpu {
                    return never(fits);
                }
                // The request fits once `total + need − rpu` logged hits have left the window.
                // Only the oldest LOG_SCAN_MAX entries are looked at (this runs under a shard
                // lock, for every rejected request); past them, a whole window is an upper
                // bound.
                let mut to_free = total.saturating_add(need) - rpu;
                let mut wait = w as u128;
                for &(t, n) in entries.iter().take(LOG_SCAN_MAX) {
                    if n >= to_free {
                        wait = (t + w - now) as u128;
                        break;
                    }
                    to_free -= n;
                }
                Verdict {
                    over: true,
                    remaining: 0,
                    fits,
                    reset: us(wait),
                }
            }
            State::Bucket { tat, scale } => {
                if rpu == 0 {
                    return never(0);
                }
                // Scaled time: 1 unit = 1/rpu µs, so one emission interval is exactly `w` units.
                let scale = *scale as u128;
                let now_s = now as u128 * scale;
                let w = w as u128;
                let capacity = limit.burst as u128 * w;
                let base = (*tat).max(now_s);
                if base + need as u128 * w <= now_s + capacity {
                    let new_tat = base + hits as u128 * w;
                    return Verdict {
                        over: false,
                        remaining: ((now_s + capacity - new_tat) / w) as u64,
                        fits: 0,
                        reset: us(div_ceil(new_tat - now_s, scale)),
                    };
                }
                let fits = ((now_s + capacity).saturating_sub(base) / w) as u64;
                if need > limit.burst {
                    return never(fits);
                }
                Verdict {
                    over: true,
                    remaining: 0,
                    fits,
                    reset: us(div_ceil(base + need as u128 * w - now_s - capacity, scale)),
                }
            }
            State::Places(holds) => {
                // One place, whatever the hits: a request in flight is one.
                let used = holds.len() as u64;
                if rpu > 0 && used < rpu {
                    let take = u64::from(hits > 0);
                    let reset = if take == 1 {
                        w as u128
                    } else {
                        holds.last_end().map_or(0, |end| (end - now) as u128)
                    };
                    return Verdict {
                        over: false,
                        remaining: rpu - used - take,
                        fits: 0,
                        reset: us(reset),
                    };
                }
                // The first place to free itself is the hold that ends first.
                Verdict {
                    over: true,
                    remaining: 0,
                    fits: 0,
                    reset: us(holds.first_end().map_or(w, |end| end - now) as u128),
                }
            }
        }
    }

    /// Consumes `hits` at `now`. Call only after a [`check`](Self::check) at the same `now`
    /// found them within the limit.
    pub(crate) fn commit(&mut self, limit: &Limit, now: u64, hits: u64) {
        self.advance(limit, now);
        match self {
            State::Fixed { count, .. } => *count = count.saturating_add(hits),
            State::Sliding { cur, .. } => *cur = cur.saturating_add(hits),
            State::Log { entries, total } => {
                if hits == 0 {
                    return;
                }
                *total = total.saturating_add(hits);
                match entries.back_mut() {
                    Some((t, n)) if *t == now => *n += hits,
                    _ => entries.push_back((now, hits)),
                }
            }
            State::Bucket { tat, scale } => {
                let now_s = now as u128 * *scale as u128;
                *tat = (*tat).max(now_s) + hits as u128 * limit.window_us as u128;
            }
            // A place is taken with its hold ([`State::take_place`]).
            State::Places(_) => {}
        }
    }

    /// Takes a place under `id` until the limit's lifetime ends. Call only after a
    /// [`check`](Self::check) at the same `now` found a place free and `id` not held.
    pub(crate) fn take_place(&mut self, limit: &Limit, now: u64, id: &HoldId) {
        self.advance(limit, now);
        if let State::Places(holds) = self {
            let held = Held {
                at: now,
                hits: 1,
                end: now.saturating_add(limit.window_us),
            };
            holds.take(id.clone(), held);
        }
    }

    /// A concurrency limit's places that ended unreleased and were dropped since the last call.
    pub(crate) fn take_ended(&mut self) -> u64 {
        match self {
            State::Places(holds) => holds.take_ended(),
            _ => 0,
        }
    }

    /// The holds of a concurrency limit's places.
    pub(crate) fn places(&self) -> Option<&Holds> {
        match self {
            State::Places(holds) => Some(holds),
            _ => None,
        }
    }

    /// The holds of a concurrency limit's places, to change.
    pub(crate) fn places_mut(&mut self) -> Option<&mut Holds> {
        match self {
            State::Places(holds) => Some(holds),
            _ => None,
        }
    }

    /// Releases the place `id` holds, if it holds one not ended at `now` and owes no release to
    /// a refused replay (then that release is consumed instead); returns when it would have
    /// ended.
    pub(crate) fn release_place(&mut self, limit: &Limit, now: u64, id: &HoldId) -> Option<u64> {
        self.advance(limit, now);
        match self {
            State::Places(holds) => holds.settle(id).map(|h| h.end),
            _ => None,
        }
    }

    /// Gives back at most `hits` of what `held` took, to the window (or the part of the bucket)
    /// it was charged to, at `now`: nothing when that window has passed, so a late refund never
    /// credits a later window, on every algorithm.
    ///
    /// - fixed_window: from the count, while the window it was taken in is the current one;
    /// - sliding_window: from the current window's count, or the previous one's, whichever it
    ///   was taken in;
    /// - sliding_log: from its own entry, while that entry is in the log;
    /// - token_bucket: the tokens it took that have not refilled yet.
    pub(crate) fn refund_held(&mut self, limit: &Limit, now: u64, held: Held, hits: u64) {
        self.advance(limit, now);
        let back = hits.min(held.hits);
        let w = limit.window_us;
        match self {
            State::Fixed { start, count, .. } => {
                if held.at >= *start {
                    *count = count.saturating_sub(back);
                }
            }
            State::Sliding { start, prev, cur } => {
                if held.at >= *start {
                    *cur = cur.saturating_sub(back);
                } else if held.at >= start.saturating_sub(w) {
                    *prev = prev.saturating_sub(back);
                }
            }
            State::Log { entries, total } => {
                let i = entries.partition_point(|&(t, _)| t < held.at);
                if let Some((t, n)) = entries.get_mut(i)
                    && *t == held.at
                {
                    let back = back.min(*n);
                    *n -= back;
                    *total -= back;
                    if *n == 0 {
                        entries.remove(i);
                    }
                }
            }
            State::Bucket { tat, scale } => {
                let now_s = now as u128 * *scale as u128;
                let end_s = held.end as u128 * *scale as u128;
                // Its tokens refill by its end, one emission interval (`w` scaled) each: what
                // is still to refill of them is what it can give back.
                let back = (back as u128 * w as u128).min(end_s.saturating_sub(now_s));
                if *tat > now_s {
                    *tat = tat.saturating_sub(back).max(now_s);
                }
            }
            State::Places(_) => {}
        }
    }

    /// Records a cost report of `hits` at `now`, whether it fits or not: usage that already
    /// happened. What takes the counter past its limit is debt, kept up to `max_debt` times
    /// the limit's size (what is beyond is dropped), so one report can close a limit for a
    /// bounded time and no count overflows:
    ///
    /// - fixed_window: the count, at most `(1 + max_debt) × requests_per_unit`; over until the
    ///   window ends, whatever the debt;
    /// - sliding_window: the current window's count, the estimate at most that bound; the
    ///   overage carries into the next window's estimate, fading over it;
    /// - sliding_log: one weighted entry, the log's total at most that bound; over until enough
    ///   weight leaves the window (the report's own entry leaves one window after it);
    /// - token_bucket: the bucket goes negative, at most `max_debt × requests_per_unit` tokens
    ///   below empty, and refills from there at its rate.
    pub(crate) fn record(&mut self, limit: &Limit, now: u64, hits: u64, max_debt: u64) {
        self.advance(limit, now);
        let rpu = limit.requests_per_unit;
        let ceiling = rpu.saturating_mul(max_debt.saturating_add(1));
        match self {
            State::Fixed { count, .. } => {
                *count += hits.min(ceiling.saturating_sub(*count));
            }
            State::Sliding { start, prev, cur } => {
                let w = limit.window_us as u128;
                let elapsed = (now - *start) as u128;
                let weighted_prev = div_ceil(*prev as u128 * (w - elapsed), w) as u64;
                let used = weighted_prev.saturating_add(*cur);
                *cur = cur.saturating_add(hits.min(ceiling.saturating_sub(used)));
            }
            State::Log { entries, total } => {
                let add = hits.min(ceiling.saturating_sub(*total));
                if add > 0 {
                    *total += add;
                    match entries.back_mut() {
                        Some((t, n)) if *t == now => *n += add,
                        _ => entries.push_back((now, add)),
                    }
                }
            }
            State::Places(_) => {}
            State::Bucket { tat, scale } => {
                if rpu == 0 {
                    return;
                }
                let now_s = now as u128 * *scale as u128;
                let w = limit.window_us as u128;
                let base = (*tat).max(now_s);
                let most = now_s + (limit.burst as u128 + max_debt as u128 * rpu as u128) * w;
                let wanted = base.saturating_add((hits as u128).saturating_mul(w));
                *tat = base.max(wanted.min(most));
            }
        }
    }

    /// Gives `hits` back at `now` (a refund): never below an empty counter, so a refund on an
    /// unused counter creates no credit and `remaining` never exceeds the limit. A refund does
    /// not say when its hits were taken; where the state can tell hits apart by age, it gives
    /// back the oldest first, which never frees more than giving back the refund's own hits
    /// would (docs/configuration.md, "Refunds across a window"):
    ///
    /// - fixed_window: from the current window's count (it cannot tell which window the hits
    ///   were taken in);
    /// - sliding_window: from the previous window's count first (which lowers the estimate by
    ///   its weighted share only), the rest from the current one's;
    /// - sliding_log: the oldest weight first, at most [`LOG_REFUND_MAX`] entries, so the log
    ///   keeps "never more than the limit in any window-long interval" for a refund of hits it
    ///   still holds;
    /// - token_bucket: the theoretical arrival time moves back, never before now (a full
    ///   bucket).
    pub(crate) fn refund(&mut self, limit: &Limit, now: u64, hits: u64) {
        self.advance(limit, now);
        match self {
            State::Fixed { count, .. } => *count = count.saturating_sub(hits),
            State::Sliding { prev, cur, .. } => {
                let from_prev = hits.min(*prev);
                *prev -= from_prev;
                *cur = cur.saturating_sub(hits - from_prev);
            }
            State::Log { entries, total } => {
                let mut rest = hits;
                for _ in 0..LOG_REFUND_MAX {
                    let Some((_, n)) = entries.front_mut() else {
                        break;
                    };
                    if *n <= rest {
                        rest -= *n;
                        *total -= *n;
                        entries.pop_front();
                    } else {
                        *n -= rest;
                        *total -= rest;
                        rest = 0;
                    }
                    if rest == 0 {
                        break;
                    }
                }
            }
            State::Bucket { tat, scale } => {
                let now_s = now as u128 * *scale as u128;
                if *tat > now_s {
                    let back = (hits as u128).saturating_mul(limit.window_us as u128);
                    *tat = tat.saturating_sub(back).max(now_s);
                }
            }
            // A place goes back only with its hold ([`State::release_place`]).
            State::Places(_) => {}
        }
    }

    /// The time (µs since the epoch) after which this state is indistinguishable from a fresh
    /// counter and may be dropped.
    pub(crate) fn expires_at(&self, limit: &Limit) -> u64 {
        let w = limit.window_us;
        match self {
            State::Fixed { end, .. } => *end,
            State::Sliding { start, .. } => start.saturating_add(w.saturating_mul(2)),
            State::Log { entries, .. } => entries.back().map_or(0, |&(t, _)| t.saturating_add(w)),
            State::Bucket { tat, scale } => {
                u64::try_from(div_ceil(*tat, *scale as u128)).unwrap_or(u64::MAX)
            }
            // Kept a lifetime past its last place's end, so that a request then still finds
            // (and counts) places that ended unreleased.
            State::Places(holds) => holds.last_end().map_or(0, |end| end.saturating_add(w)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SEC: u64 = 1_000_000;
    // A time aligned to a 60 s window boundary, far from the epoch.
    const T0: u64 = 1_800_000_000 * SEC;

    fn limit(algorithm: Algorithm, rpu: u64, window_s: u64) -> Limit {
        Limit {
            algorithm,
            requests_per_unit: rpu,
            window_us: window_s * SEC,
            burst: rpu,
            calendar: None,
        }
    }

    /// Checks and, when within the limit, commits: what a one-hit request does.
    fn take(state: &mut State, limit: &Limit, now: u64, hits: u64) -> Verdict {
        let v = state.check(limit, now, hits);
        if !v.over {
            state.commit(limit, now, hits);
        }
        v
    }

    #[test]
    fn fixed_window_counts_until_the_window_ends() {
        let l = limit(Algorithm::FixedWindow, 3, 60);
        let mut s = State::new(l.algorithm);
        for left in [2, 1, 0] {
            let v = take(&mut s, &l, T0 + 10 * SEC, 1);
            assert_eq!((v.over, v.remaining), (false, left));
            assert_eq!(v.reset, Duration::from_secs(50));
        }
        let v = take(&mut s, &l, T0 + 59 * SEC, 1);
        assert!(v.over);
        assert_eq!(v.reset, Duration::from_secs(1));
        assert!(
            !take(&mut s, &l, T0 + 60 * SEC, 1).over,
            "a new window starts empty"
        );
    }

    #[test]
    fn zero_requests_per_unit_blocks_everything_even_checks() {
        for algorithm in Algorithm::ALL {
            let l = limit(algorithm, 0, 1);
            let mut s = State::new(algorithm);
            assert!(s.check(&l, T0, 1).over, "{algorithm}");
            assert!(s.check(&l, T0, 0).over, "{algorithm}");
        }
    }

    #[test]
    fn check_only_hits_never_consume() {
        for algorithm in Algorithm::ALL {
            let l = limit(algorithm, 2, 60);
            let mut s = State::new(algorithm);
            for _ in 0..5 {
                let v = take(&mut s, &l, T0, 0);
                assert!(!v.over, "{algorithm}");
                assert_eq!(v.remaining, 2, "{algorithm}");
            }
        }
    }

    #[test]
    fn a_check_is_over_once_nothing_is_left() {
        for algorithm in Algorithm::ALL {
            let l = limit(algorithm, 2, 60);
            let mut s = State::new(algorithm);
            assert!(!take(&mut s, &l, T0, 2).over, "{algorithm}");
            let v = s.check(&l, T0, 0);
            assert!(
                v.over,
                "{algorithm}: a spent limit refuses the request it checks for"
            );
            assert_eq!((v.remaining, v.fits), (0, 0), "{algorithm}");
        }
    }

    /// A budget of 10 000 with check-only requests and reports of 4 000: three requests pass,
    /// the third's report goes over and is recorded, and the next check is over.
    #[test]
    fn reports_past_the_limit_are_recorded_on_every_algorithm() {
        for algorithm in Algorithm::ALL {
            let l = limit(algorithm, 10_000, 3_600);
            let mut s = State::new(algorithm);
            let mut admitted = 0;
            for i in 0..8 {
                let now = T0 + i * SEC;
                if s.check(&l, now, 0).over {
                    continue;
                }
                admitted += 1;
                let v = s.check(&l, now, 4_000);
                s.record(&l, now, 4_000, DEBT);
                assert_eq!(v.over, admitted == 3, "{algorithm}: report {admitted}");
            }
            assert_eq!(admitted, 3, "{algorithm}");
            let v = s.check(&l, T0 + 8 * SEC, 0);
            assert!(v.over && v.remaining == 0, "{algorithm}");
        }
    }

    const DEBT: u64 = 1;

    #[test]
    fn a_reports_debt_is_bounded_and_paid_off_as_each_algorithm_says() {
        let huge = u64::MAX;
        // fixed_window: over until the window ends, then empty.
        let l = limit(Algorithm::FixedWindow, 10, 60);
        let mut s = State::new(l.algorithm);
        s.record(&l, T0 + SEC, huge, DEBT);
        assert_eq!(
            s,
            State::Fixed {
                start: T0,
                end: T0 + 60 * SEC,
                count: 20
            }
        );
        assert!(s.check(&l, T0 + 59 * SEC, 0).over);
        assert_eq!(s.check(&l, T0 + 60 * SEC, 0).remaining, 10);

        // sliding_window: the debt carries into the next window's estimate and fades.
        let l = limit(Algorithm::SlidingWindow, 10, 60);
        let mut s = State::new(l.algorithm);
        s.record(&l, T0 + 30 * SEC, huge, DEBT);
        assert!(s.check(&l, T0 + 60 * SEC, 0).over, "20 carried in");
        // 20·(60−e)/60 + 1 ≤ 10 ⇔ e ≥ 33 s into the next window.
        let v = s.check(&l, T0 + 60 * SEC, 0);
        assert_eq!(v.reset, Duration::from_secs(33));
        assert!(s.check(&l, T0 + 92 * SEC, 0).over);
        assert!(!s.check(&l, T0 + 93 * SEC, 0).over);

        // sliding_log: one weighted entry, which leaves one window later.
        let l = limit(Algorithm::SlidingLog, 10, 60);
        let mut s = State::new(l.algorithm);
        s.record(&l, T0, 3, DEBT);
        s.record(&l, T0 + SEC, huge, DEBT);
        let State::Log { entries, total } = &s else {
            panic!("a log")
        };
        assert_eq!((entries.len(), *total), (2, 20));
        assert_eq!(s.check(&l, T0 + 2 * SEC, 0).reset, Duration::from_secs(59));
        assert!(!s.check(&l, T0 + 61 * SEC, 0).over);

        // token_bucket: at most one window's refill below empty, refilled at the rate.
        let l = limit(Algorithm::TokenBucket, 10, 10); // one token a second
        let mut s = State::new(l.algorithm);
        s.record(&l, T0, huge, DEBT);
        let v = s.check(&l, T0, 0);
        assert!(v.over);
        // 10 tokens of debt and one to check for: 11 s.
        assert_eq!(v.reset, Duration::from_secs(11));
        assert!(s.check(&l, T0 + 10 * SEC, 0).over);
        assert!(!s.check(&l, T0 + 11 * SEC, 0).over);

        // No debt at all: a report fills the limit and no more.
        for algorithm in Algorithm::ALL {
            let l = limit(algorithm, 10, 10);
            let mut s = State::new(algorithm);
            s.record(&l, T0, huge, 0);
            assert!(s.check(&l, T0, 0).over, "{algorithm}");
            s.refund(&l, T0, 1);
            assert!(!s.check(&l, T0, 1).over, "{algorithm}: one given back fits");
        }
    }

    #[test]
    fn refunds_give_back_what_was_taken_and_never_more() {
        for algorithm in Algorithm::ALL {
            let l = limit(algorithm, 10, 3_600);
            let mut s = State::new(algorithm);
            for n in [2, 3] {
                assert!(!take(&mut s, &l, T0, n).over);
            }
            s.refund(&l, T0 + SEC, 4);
            assert_eq!(s.check(&l, T0 + SEC, 0).remaining, 9, "{algorithm}");
            s.refund(&l, T0 + SEC, 1_000);
            assert_eq!(
                s.check(&l, T0 + SEC, 0).remaining,
                10,
                "{algorithm}: no credit"
            );
            // A refund on a fresh counter is nothing, and what was given back can be taken.
            let mut fresh = State::new(algorithm);
            fresh.refund(&l, T0, 5);
            assert_eq!(fresh.check(&l, T0, 10).remaining, 0, "{algorithm}");
            assert!(fresh.check(&l, T0, 11).over, "{algorithm}");
            // Debt is given back too.
            s.record(&l, T0 + SEC, 15, DEBT);
            assert!(s.check(&l, T0 + SEC, 0).over, "{algorithm}");
            s.refund(&l, T0 + SEC, 6);
            let v = s.check(&l, T0 + SEC, 0);
            assert_eq!((v.over, v.remaining), (false, 1), "{algorithm}");
        }
    }

    #[test]
    fn a_sliding_log_refund_takes_the_oldest_weight_first() {
        let l = limit(Algorithm::SlidingLog, 10, 60);
        let mut s = State::new(l.algorithm);
        for (t, n) in [(0, 4), (10, 3), (20, 2)] {
            assert!(!take(&mut s, &l, T0 + t * SEC, n).over);
        }
        s.refund(&l, T0 + 30 * SEC, 5);
        let State::Log { entries, total } = &s else {
            panic!("a log")
        };
        assert_eq!(*total, 4);
        assert_eq!(
            entries.iter().copied().collect::<Vec<_>>(),
            [(T0 + 10 * SEC, 2), (T0 + 20 * SEC, 2)]
        );
    }

    /// Limit 10 a second. A reserves 5 at 0; others take 5 at 0.9; A settles (refunds its 5)
    /// at 0.95. Giving back the newest weight (the others') let 5 more in at once and 5 more
    /// when A's entry left at 1.0: 15 within 0.25 s. The oldest first keeps 10 in any second.
    #[test]
    fn a_sliding_log_refund_keeps_the_limit_in_every_window_long_interval() {
        let l = limit(Algorithm::SlidingLog, 10, 1);
        let ms = 1_000;
        let mut s = State::new(l.algorithm);
        assert!(!take(&mut s, &l, T0, 5).over);
        assert!(!take(&mut s, &l, T0 + 900 * ms, 5).over);
        s.refund(&l, T0 + 950 * ms, 5);
        let mut admitted = vec![(T0 + 900 * ms, 5)];
        for t in (960..=2_000).step_by(10) {
            if !take(&mut s, &l, T0 + t * ms, 1).over {
                admitted.push((T0 + t * ms, 1));
            }
        }
        for &(from, _) in &admitted {
            let within: u64 = admitted
                .iter()
                .filter(|&&(t, _)| t >= from && t < from + SEC)
                .map(|&(_, n)| n)
                .sum();
            assert!(within <= 10, "{within} admitted in the second from {from}");
        }
    }

    /// Limit 10 a minute. A takes 10 late in one window; the window turns; A refunds 10. The
    /// previous window's count gives them back first: the estimate falls by their weighted
    /// share only, as it would had A never taken them.
    #[test]
    fn a_sliding_window_refund_takes_the_previous_window_first() {
        let l = limit(Algorithm::SlidingWindow, 10, 60);
        let mut s = State::new(l.algorithm);
        assert!(!take(&mut s, &l, T0 + 59 * SEC, 10).over);
        // 15 s into the next window: 10 × 45/60 = 7.5 still weigh; 2 fit.
        let now = T0 + 75 * SEC;
        assert!(!take(&mut s, &l, now, 2).over);
        s.refund(&l, now, 10);
        assert_eq!(
            s,
            State::Sliding {
                start: T0 + 60 * SEC,
                prev: 0,
                cur: 2
            }
        );
        // Had the refund come from the current window, the 2 taken now would be gone too.
        assert_eq!(s.check(&l, now, 0).remaining, 8);
    }

    #[test]
    fn sliding_window_weights_the_previous_window() {
        let l = limit(Algorithm::SlidingWindow, 10, 60);
        let mut s = State::new(l.algorithm);
        assert!(!take(&mut s, &l, T0 + 30 * SEC, 10).over);
        // 15 s into the next window: 10 × 45/60 = 7.5 still count, so 2 fit and 3 do not.
        let now = T0 + 75 * SEC;
        let v = s.check(&l, now, 2);
        assert_eq!((v.over, v.remaining), (false, 0));
        assert!(s.check(&l, now, 3).over);
        let v = s.check(&l, now, 4);
        assert!(v.over);
        // Room for 4 needs prev·(60−e)/60 ≤ 6 ⇒ e ≥ 24 s, i.e. 9 s from now.
        assert_eq!(v.reset, Duration::from_secs(9));
        assert!(!take(&mut s, &l, now + 9 * SEC, 4).over);
        // Two windows later nothing is left.
        assert_eq!(s.check(&l, T0 + 180 * SEC, 10).remaining, 0);
        assert!(!s.check(&l, T0 + 180 * SEC, 10).over);
    }

    #[test]
    fn sliding_window_over_in_current_window_waits_for_the_next() {
        let l = limit(Algorithm::SlidingWindow, 10, 60);
        let mut s = State::new(l.algorithm);
        assert!(!take(&mut s, &l, T0 + 30 * SEC, 10).over);
        let v = s.check(&l, T0 + 30 * SEC, 5);
        assert!(v.over);
        // Next window: 10·(60−e)/60 ≤ 5 ⇒ e ≥ 30 s; 30 s to the boundary + 30 s.
        assert_eq!(v.reset, Duration::from_secs(60));
        assert!(!take(&mut s, &l, T0 + 90 * SEC, 5).over);
    }

    #[test]
    fn sliding_log_is_exact_and_waits_for_the_oldest_hits() {
        let l = limit(Algorithm::SlidingLog, 3, 10);
        let mut s = State::new(l.algorithm);
        for t in [0, 2, 4] {
            assert!(!take(&mut s, &l, T0 + t * SEC, 1).over);
        }
        let v = take(&mut s, &l, T0 + 9 * SEC, 1);
        assert!(v.over);
        assert_eq!(v.reset, Duration::from_secs(1), "the hit at 0 leaves at 10");
        let v = s.check(&l, T0 + 9 * SEC, 2);
        assert_eq!(v.reset, Duration::from_secs(3), "two must leave: 0 and 2");
        assert!(!take(&mut s, &l, T0 + 10 * SEC, 1).over);
        assert!(take(&mut s, &l, T0 + 10 * SEC, 1).over);
        assert!(s.check(&l, T0, 4).over, "more than the limit never fits");
    }

    #[test]
    fn a_rejected_sliding_log_check_scans_a_bounded_number_of_entries() {
        // 10 000 single hits at distinct times; freeing 5 000 of them would need a scan of
        // half the log under the shard lock. Past LOG_SCAN_MAX entries the answer is a whole
        // window: an upper bound, computed in constant time.
        let l = limit(Algorithm::SlidingLog, 10_000, 3_600);
        let mut s = State::new(l.algorithm);
        for i in 0..10_000 {
            assert!(!take(&mut s, &l, T0 + i * 1_000, 1).over);
        }
        let now = T0 + 20 * SEC;
        let v = s.check(&l, now, 5_000);
        assert!(v.over);
        assert_eq!(v.reset, Duration::from_secs(3_600));
        // Within the scanned entries the reset is exact: the oldest hit leaves at T0 + 1 h.
        let v = s.check(&l, now, 1);
        assert_eq!(v.reset, Duration::from_micros(T0 + 3_600 * SEC - now));
    }

    #[test]
    fn token_bucket_refills_at_the_rate_up_to_burst() {
        let mut l = limit(Algorithm::TokenBucket, 2, 1); // 2 per second: one every 500 ms
        l.burst = 4;
        let mut s = State::new(l.algorithm);
        for left in [3, 2, 1, 0] {
            let v = take(&mut s, &l, T0, 1);
            assert_eq!((v.over, v.remaining), (false, left));
        }
        let v = take(&mut s, &l, T0, 1);
        assert!(v.over);
        assert_eq!(v.reset, Duration::from_millis(500));
        assert!(!take(&mut s, &l, T0 + 500_000, 1).over);
        assert!(take(&mut s, &l, T0 + 500_000, 1).over);
        // After a long pause the bucket holds `burst`, not more.
        let v = take(&mut s, &l, T0 + 100 * SEC, 1);
        assert_eq!(v.remaining, 3);
    }

    #[test]
    fn token_bucket_is_exact_for_rates_that_do_not_divide_the_window() {
        let l = limit(Algorithm::TokenBucket, 3, 1);
        let mut s = State::new(l.algorithm);
        for _ in 0..3 {
            assert!(!take(&mut s, &l, T0, 1).over);
        }
        // 3 per second: after exactly one second all three are back.
        assert_eq!(s.check(&l, T0 + SEC, 3).remaining, 0);
        assert!(!s.check(&l, T0 + SEC, 3).over);
        assert!(s.check(&l, T0 + SEC - 1, 3).over);
    }

    #[test]
    fn expiry_marks_when_state_is_fresh_again() {
        for algorithm in Algorithm::ALL {
            let l = limit(algorithm, 5, 10);
            let mut s = State::new(algorithm);
            take(&mut s, &l, T0 + SEC, 5);
            let at = s.expires_at(&l);
            assert!(at > T0 + SEC, "{algorithm}");
            let v = s.check(&l, at, 5);
            assert!(!v.over, "{algorithm}: full quota at expiry");
            assert_eq!(v.remaining, 0, "{algorithm}");
        }
    }

    /// A hold's hits go back to the window (or the part of the bucket) they were charged to,
    /// at most what it took; nothing once that has passed.
    #[test]
    fn a_holds_refund_credits_only_the_window_it_was_charged_to() {
        for algorithm in Algorithm::ALL {
            let l = limit(algorithm, 10, 100);
            let mut s = State::new(algorithm);
            let charge = |s: &mut State, now: u64, hits: u64| {
                assert!(!take(s, &l, now, hits).over, "{algorithm}");
                Held {
                    at: now,
                    hits,
                    end: s.expires_at(&l),
                }
            };
            let a = charge(&mut s, T0, 6);
            let b = charge(&mut s, T0 + SEC, 4);
            // More than it took gives back what it took.
            s.refund_held(&l, T0 + 2 * SEC, a, 100);
            assert_eq!(s.check(&l, T0 + 2 * SEC, 0).remaining, 6, "{algorithm}");
            // Three windows later, a fresh window's hits are not the old hold's to give.
            let later = T0 + 300 * SEC;
            assert!(!take(&mut s, &l, later, 10).over, "{algorithm}");
            s.refund_held(&l, later, b, 4);
            assert!(
                s.check(&l, later, 1).over,
                "{algorithm}: a later window credited"
            );
        }
    }

    /// A sliding window gives a hold's hits back to the previous window's count when it was
    /// taken there; a fixed window not at all.
    #[test]
    fn a_late_holds_refund_on_the_window_boundary() {
        let l = limit(Algorithm::SlidingWindow, 10, 60);
        let mut s = State::new(l.algorithm);
        assert!(!take(&mut s, &l, T0 + 50 * SEC, 10).over);
        let held = Held {
            at: T0 + 50 * SEC,
            hits: 10,
            end: s.expires_at(&l),
        };
        let now = T0 + 70 * SEC;
        assert!(!take(&mut s, &l, now, 1).over);
        s.refund_held(&l, now, held, 10);
        assert_eq!(
            s,
            State::Sliding {
                start: T0 + 60 * SEC,
                prev: 0,
                cur: 1
            }
        );
        let l = limit(Algorithm::FixedWindow, 10, 60);
        let mut s = State::new(l.algorithm);
        assert!(!take(&mut s, &l, T0 + 50 * SEC, 10).over);
        let held = Held {
            at: T0 + 50 * SEC,
            hits: 10,
            end: s.expires_at(&l),
        };
        assert!(!take(&mut s, &l, now, 10).over);
        s.refund_held(&l, now, held, 10);
        assert!(s.check(&l, now, 1).over, "the next window keeps its count");
    }

    #[test]
    fn places_are_taken_by_holds_and_end_with_their_lifetime() {
        let l = limit(Algorithm::Concurrency, 2, 60);
        let mut s = State::new(l.algorithm);
        let (a, b, c) = (HoldId::new(b"a"), HoldId::new(b"b"), HoldId::new(b"c"));
        for (id, left) in [(&a, 1), (&b, 0)] {
            let v = s.check(&l, T0, 1);
            assert_eq!((v.over, v.remaining), (false, left));
            s.take_place(&l, T0 + SEC, id);
        }
        let v = s.check(&l, T0 + 2 * SEC, 1);
        assert!(v.over);
        assert_eq!(v.reset, Duration::from_secs(59), "a's place ends first");
        assert_eq!(s.release_place(&l, T0 + 2 * SEC, &a), Some(T0 + 61 * SEC));
        assert_eq!(s.release_place(&l, T0 + 2 * SEC, &a), None, "once");
        assert!(!s.check(&l, T0 + 2 * SEC, 1).over);
        s.take_place(&l, T0 + 2 * SEC, &c);
        assert!(s.check(&l, T0 + 61 * SEC - 1, 1).over, "not before");
        assert_eq!(s.check(&l, T0 + 61 * SEC, 0).remaining, 1, "b ended");
        assert_eq!(s.take_ended(), 1, "b ended unreleased");
        assert_eq!(
            s.release_place(&l, T0 + 61 * SEC, &b),
            None,
            "nothing to release"
        );
        assert_eq!(s.expires_at(&l), T0 + 122 * SEC, "c's end and a lifetime");
    }
}
