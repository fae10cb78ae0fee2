//! The protocol between Rust and `script.lua`: what a request's share of a call carries
//! ([`Args`]), the call's command line ([`command`]) and a request's share of its reply
//! ([`Decided`]). The script's header documents the layout; this is the one place on the Rust
//! side that knows it, so a change to the script changes this module and nothing else.

use std::collections::HashMap;
use std::time::Duration;

use redis::Cmd;
use smallvec::SmallVec;

use crate::limiter::{Algorithm, Enforcement, HitKind, Hold, HoldId, Limit, Verdict};

/// The script. Loaded as a Redis function library once per Redis (FUNCTION LOAD, then FCALL),
/// or where Redis has no functions (before 7) or the user may not load them, called with
/// EVALSHA (EVAL after NOSCRIPT). The three ways a call names it are `Call`'s variants.
pub const SCRIPT: &str = include_str!("script.lua");

/// How a call names the script.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Call {
    /// FCALL of the function library [`load_library`] loads: its helpers and tables are built
    /// once, at load, not on every call as EVAL's body is (a quarter of a lone request's cost).
    Function,
    /// EVALSHA of the script.
    Hash,
    /// EVAL with the script's source (after NOSCRIPT; Redis caches it for later EVALSHAs).
    Source,
}

/// What a call does to its requests' counters.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Mode {
    /// Give back refunds, check every other limit, record cost reports, commit all admissions
    /// or none (per request).
    Decide,
    /// Take back what an admitted decide's admissions took (another slot group of the request
    /// rejected it).
    Undo,
}

impl Mode {
    fn arg(self) -> &'static str {
        match self {
            Mode::Decide => "decide",
            Mode::Undo => "undo",
        }
    }
}

/// One limit of a request, as the script takes it.
#[derive(Clone, Copy, Debug)]
struct LimitArgs {
    /// How it counts.
    algorithm: Algorithm,
    /// Hits per window (token bucket: refill per window).
    requests_per_unit: u64,
    /// Window in µs.
    window_us: u64,
    /// Token bucket capacity.
    burst: u64,
    /// Hits to add (a refund, or an undo: to give back).
    hits: u64,
    /// What an over verdict does.
    enforcement: Enforcement,
    /// Admission, cost report or refund.
    kind: HitKind,
    /// A calendar window's: where its boundaries are in [`Args::bounds`] (see script.lua).
    bounds: Option<u16>,
    /// The hold it names, if its node keeps holds.
    hold: HoldArg,
    /// A rate limit that keeps holds: where its two hold keys (the holds by end, and what
    /// each took) are in [`Args::hold_keys`]: `start..mid`, `mid..end`.
    hold_keys: Option<(u32, u32, u32)>,
}

/// Whether and how a limit names a hold, as the script takes it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum HoldArg {
    /// Its node keeps no holds.
    Unheld,
    /// Its node keeps holds, and the descriptor named none.
    Unnamed,
    /// The hold at this place in [`Args::hold_ids`].
    Named(u16),
}

/// A request's share of a script call: its counters' keys and limits, and what to do with
/// them. Its keys are all in one cluster slot (the caller's concern).
pub(super) struct Args {
    mode: Mode,
    /// Names the request's sliding_log members.
    nonce: [u8; 33],
    nonce_len: u8,
    /// Undo: the decide's time (µs).
    at: i64,
    /// Undo: the key marking this request's undo as done (empty for a decide).
    marker: Vec<u8>,
    /// Every key's bytes, back to back.
    keys: Vec<u8>,
    /// Where each key ends in `keys`.
    key_ends: SmallVec<[u32; 8]>,
    /// One per key.
    limits: SmallVec<[LimitArgs; 8]>,
    /// The boundaries of its calendar limits' windows (none for most requests: no allocation).
    bounds: Vec<[u64; 4]>,
    /// The holds its limits name (none for most requests: no allocation).
    hold_ids: Vec<HoldId>,
    /// The hold keys of its rate limits that keep holds, back to back.
    hold_keys: Vec<u8>,
}

impl Args {
    /// A decide for the request named by `nonce`, with room for `key_bytes` of keys.
    pub(super) fn decide(nonce: &[u8], key_bytes: usize) -> Args {
        Args::new(Mode::Decide, nonce, 0, Vec::new(), key_bytes)
    }

    /// The undo of the decide made at `at` (µs, as its reply said) for the request named by
    /// `nonce`: `marker` is the key (in the slot of its counters) that makes it run once.
    pub(super) fn undo(nonce: &[u8], at: i64, marker: Vec<u8>, key_bytes: usize) -> Args {
        Args::new(Mode::Undo, nonce, at, marker, key_bytes)
    }

    fn new(mode: Mode, nonce: &[u8], at: i64, marker: Vec<u8>, key_bytes: usize) -> Args {
        let mut n = [0u8; 33];
        let len = nonce.len().min(n.len());
        n[..len].copy_from_slice(&nonce[..len]);
        Args {
            mode,
            nonce: n,
            nonce_len: len as u8,
            at,
            marker,
            keys: Vec::with_capacity(key_bytes),
            key_ends: SmallVec::new(),
            limits: SmallVec::new(),
            bounds: Vec::new(),
            hold_ids: Vec::new(),
            hold_keys: Vec::new(),
        }
    }

    /// Adds a counter: its key, its limit, the hits to add (a refund, or an undo: to give back),
    /// what an over verdict does (a quota limit the caller cannot judge across calls goes as
    /// shadow), the hits' kind (an undo's are all admissions) and the hold it names. A calendar
    /// limit's windows are sent as the boundaries around `redis_now` (µs), where Redis' clock
    /// is expected. A rate limit that keeps holds keeps them in two keys beside its counter's
    /// (`<key>:e`, `<key>:h`: a counter's key ends in a digit, so no counter has either name,
    /// and both are in its slot); a concurrency limit's counter is its holds, and its `:h`
    /// keeps the releases owed to refused replays (script.lua, "Holds").
    #[allow(clippy::too_many_arguments)]
    pub(super) fn push(
        &mut self,
        key: &[u8],
        limit: &Limit,
        hits: u64,
        enforcement: Enforcement,
        kind: HitKind,
        hold: &Hold,
        redis_now: impl Fn() -> u64,
    ) {
        let hold_keys = hold.is_held().then(|| {
            let start = self.hold_keys.len() as u32;
            self.hold_keys.extend_from_slice(key);
            self.hold_keys.extend_from_slice(b":e");
            let mid = self.hold_keys.len() as u32;
            self.hold_keys.extend_from_slice(key);
            self.hold_keys.extend_from_slice(b":h");
            (start, mid, self.hold_keys.len() as u32)
        });
        let hold = match hold {
            Hold::Unheld => HoldArg::Unheld,
            Hold::Unnamed => HoldArg::Unnamed,
            Hold::Named(id) => {
                self.hold_ids.push(id.clone());
                HoldArg::Named((self.hold_ids.len() - 1) as u16)
            }
        };
        self.keys.extend_from_slice(key);
        self.key_ends.push(self.keys.len() as u32);
        let bounds = limit.calendar.map(|calendar| {
            self.bounds.push(calendar.boundaries_around(redis_now()));
            (self.bounds.len() - 1) as u16
        });
        self.limits.push(LimitArgs {
            algorithm: limit.algorithm,
            requests_per_unit: limit.requests_per_unit,
            window_us: limit.window_us,
            burst: limit.burst,
            // Exact in the script's doubles, and deciding as the amount sent (2^64 - 1 included).
            hits: hits.min(limit.most_moved(kind)),
            enforcement,
            kind,
            bounds,
            hold,
            hold_keys,
        });
    }

    /// Decide or undo.
    pub(super) fn mode(&self) -> Mode {
        self.mode
    }

    /// Bytes of its keys.
    pub(super) fn key_bytes(&self) -> usize {
        self.keys.len()
    }

    /// Number of its limits.
    pub(super) fn limit_count(&self) -> usize {
        self.limits.len()
    }

    /// Values the script returns for this request (after the call's [`REPLY_HEADER`]).
    pub(super) fn reply_len(&self) -> usize {
        match self.mode {
            Mode::Decide => {
                let places = self
                    .limits
                    .iter()
                    .filter(|l| l.algorithm == Algorithm::Concurrency)
                    .count();
                1 + 2 * self.limits.len() + 2 * places
            }
            Mode::Undo => 1,
        }
    }

    /// Whether one of its limits is a sliding_log (whose members its nonce names).
    fn logged(&self) -> bool {
        self.limits
            .iter()
            .any(|l| l.algorithm == Algorithm::SlidingLog)
    }

    /// Whether one of its limits keeps holds (it is then never one of a run).
    fn held(&self) -> bool {
        self.limits.iter().any(|l| l.hold != HoldArg::Unheld)
    }

    /// The two hold keys of limit `l`, if it keeps holds beside its counter.
    fn hold_keys_of(&self, l: &LimitArgs) -> Option<(&[u8], &[u8])> {
        l.hold_keys.map(|(start, mid, end)| {
            (
                &self.hold_keys[start as usize..mid as usize],
                &self.hold_keys[mid as usize..end as usize],
            )
        })
    }

    /// Each key with its limit.
    fn counters(&self) -> impl Iterator<Item = (&[u8], &LimitArgs)> {
        let mut from = 0;
        self.key_ends.iter().zip(&self.limits).map(move |(end, l)| {
            let key = &self.keys[from..*end as usize];
            from = *end as usize;
            (key, l)
        })
    }

    /// The boundaries of limit `l`'s calendar windows, if it has a calendar.
    fn bounds_of(&self, l: &LimitArgs) -> Option<&[u64; 4]> {
        l.bounds.map(|b| &self.bounds[b as usize])
    }
}

/// Up to this many limits in a call, keys and counters are matched by a scan.
const SCAN_LIMITS: usize = 16;

/// The script call carrying `parts` (all of one mode), naming the script as `how` says, with
/// cost reports taking a counter at most `max_debt` times its limit past it. Each distinct key
/// is sent once and each distinct (key, limit) counter once; requests name their counters by
/// number (see script.lua).
pub(super) fn command<'p>(parts: &[&'p Args], how: Call, max_debt: u64) -> Cmd {
    // Keys → KEYS index, (key, algorithm, requests_per_unit, window, burst) → counter number,
    // both 1-based as Lua counts.
    let limits_in: usize = parts.iter().map(|p| p.limits.len()).sum();
    let undoing = parts.first().is_some_and(|p| p.mode == Mode::Undo);
    let mut keys: Vec<&[u8]> =
        Vec::with_capacity(limits_in + if undoing { parts.len() } else { 0 });
    // A few limits (an idle service's lone request) are matched by a scan; a call of many by
    // hashing, which costs more to set up than a short scan does.
    let hashed = limits_in > SCAN_LIMITS;
    let mut key_index: HashMap<&[u8], usize> = HashMap::new();
    // (key, limit, calendar boundaries, KEYS index of its first hold key).
    let mut counters: Vec<CallCounter<'_>> = Vec::with_capacity(limits_in);
    let mut counter_index: HashMap<CounterIdentity, usize> = HashMap::new();
    if hashed {
        key_index.reserve(limits_in);
        counter_index.reserve(limits_in);
    }
    let mut limits: Vec<usize> = Vec::with_capacity(limits_in); // every part's limits' counter numbers, in order
    for p in parts {
        for (key, l) in p.counters() {
            let k = if hashed {
                *key_index.entry(key).or_insert_with(|| {
                    keys.push(key);
                    keys.len()
                })
            } else {
                match keys.iter().position(|k| *k == key) {
                    Some(k) => k + 1,
                    None => {
                        keys.push(key);
                        keys.len()
                    }
                }
            };
            // A calendar counter's boundaries are the first request's: every request's are
            // boundaries of the same calendar, and the script asks again if they miss TIME.
            let identity = (
                k,
                l.algorithm,
                l.bounds.is_some(),
                l.requests_per_unit,
                l.window_us,
                l.burst,
                l.hold_keys.is_some(),
            );
            let same = |(ck, cl, _, hk): &CallCounter<'_>| {
                (
                    *ck,
                    cl.algorithm,
                    cl.bounds.is_some(),
                    cl.requests_per_unit,
                    cl.window_us,
                    cl.burst,
                    hk.is_some(),
                ) == identity
            };
            // A counter's hold keys go to KEYS with it, once.
            let add = |keys: &mut Vec<&'p [u8]>, counters: &mut Vec<CallCounter<'p>>| {
                let hk = p.hold_keys_of(l).map(|(by_end, taken)| {
                    keys.push(by_end);
                    keys.push(taken);
                    keys.len() - 1
                });
                counters.push((k, l, p.bounds_of(l), hk));
                counters.len()
            };
            let found = if hashed {
                counter_index.get(&identity).copied()
            } else {
                counters.iter().position(same).map(|c| c + 1)
            };
            let c = match found {
                Some(c) => c,
                None => {
                    let c = add(&mut keys, &mut counters);
                    if hashed {
                        counter_index.insert(identity, c);
                    }
                    c
                }
            };
            limits.push(c);
        }
    }
    // An undo's markers follow the counters' keys (each its own: one per request).
    let markers = keys.len();
    if undoing {
        keys.extend(parts.iter().map(|p| &p.marker[..]));
    }
    // Runs of identical decides (same counters, hits, enforcement and kind, no sliding_log
    // member to name) go as one entry with their count: a hot key's coalesced requests are
    // parsed once.
    let mut entries: Vec<(usize, usize, usize)> = Vec::with_capacity(parts.len()); // (part, first limit, run)
    let mut first = 0;
    for (i, p) in parts.iter().enumerate() {
        let these = first..first + p.limits.len();
        let same_as_last = !undoing
            && !p.logged()
            && !p.held()
            && entries.last().is_some_and(|&(j, from, _)| {
                let q = parts[j];
                !q.logged()
                    && !q.held()
                    && limits[from..from + q.limits.len()] == limits[these.clone()]
                    && q.limits.iter().zip(&p.limits).all(|(a, b)| {
                        (a.hits, a.enforcement, a.kind) == (b.hits, b.enforcement, b.kind)
                    })
            });
        match entries.last_mut() {
            Some((_, _, run)) if same_as_last => *run += 1,
            _ => entries.push((i, first, 1)),
        }
        first = these.end;
    }
    // Every number goes in one argument, packed (see [`Numbers`]); the nonces follow it.
    let numbers = 3
        + 5 * counters.len()
        + 4 * counters.iter().filter(|(_, _, b, _)| b.is_some()).count()
        + counters.iter().filter(|(_, _, _, hk)| hk.is_some()).count()
        + entries
            .iter()
            .map(|&(i, _, _)| 3 + 3 * parts[i].limits.len())
            .sum::<usize>();
    let mut packed = Numbers(Vec::with_capacity(8 * numbers));
    packed
        .push(entries.len() as f64)
        .push(counters.len() as f64)
        .push(max_debt as f64);
    for (k, l, bounds, hk) in &counters {
        let code = match bounds {
            Some(_) => CALENDAR_CODE,
            None => algorithm_code(l.algorithm),
        };
        packed
            .push(*k as f64)
            .push(code + if hk.is_some() { HOLDS_CODE } else { 0.0 })
            .push(l.requests_per_unit as f64)
            .push(l.window_us as f64)
            .push(l.burst as f64);
        if let Some(hk) = hk {
            packed.push(*hk as f64);
        }
        for b in bounds.iter().flat_map(|b| b.iter()) {
            packed.push(*b as f64);
        }
    }
    let mut nonces: SmallVec<[&[u8]; 4]> = SmallVec::new();
    for &(i, from, run) in &entries {
        let p = parts[i];
        let nonce = &p.nonce[..p.nonce_len as usize];
        if undoing {
            packed.push(p.at as f64).push((markers + i + 1) as f64);
            nonces.push(nonce);
        } else {
            packed.push(run as f64);
        }
        packed.push(p.limits.len() as f64);
        for (l, c) in p.limits.iter().zip(&limits[from..]) {
            let hold = match l.hold {
                HoldArg::Unheld => 0.0,
                HoldArg::Named(_) => NAMED_CODE,
                HoldArg::Unnamed => UNNAMED_CODE,
            };
            packed
                .push(*c as f64)
                .push(l.hits as f64)
                .push(how_code(l.enforcement, l.kind) + hold);
        }
        if !undoing && p.logged() {
            nonces.push(nonce);
        }
        // The holds its limits name, in the limits' order, after its nonce.
        for l in &p.limits {
            if let HoldArg::Named(i) = l.hold {
                nonces.push(p.hold_ids[i as usize].as_bytes());
            }
        }
    }
    let key_bytes: usize = keys.iter().map(|k| k.len()).sum();
    let nonce_bytes: usize = nonces.iter().map(|n| n.len()).sum();
    let mut cmd = Cmd::with_capacity(
        5 + keys.len() + nonces.len(),
        key_bytes + nonce_bytes + packed.0.len() + 128,
    );
    match how {
        Call::Function => cmd.arg("FCALL").arg(function_name()),
        Call::Hash => cmd.arg("EVALSHA").arg(script_hash()),
        Call::Source => cmd.arg("EVAL").arg(SCRIPT),
    };
    cmd.arg(keys.len());
    for key in &keys {
        cmd.arg(*key);
    }
    let mode = if undoing { Mode::Undo } else { Mode::Decide };
    cmd.arg(mode.arg()).arg(&packed.0[..]);
    for nonce in nonces {
        cmd.arg(nonce);
    }
    cmd
}

/// The call's numbers in one argument, little-endian doubles back to back: the script reads
/// them with `struct.unpack`, where text would cost Redis a `strtod` each (a fifth of a lone
/// request's cost). Doubles are what Lua numbers are: every value is exact below 2^53, as it
/// was as text.
struct Numbers(Vec<u8>);

impl Numbers {
    fn push(&mut self, n: f64) -> &mut Numbers {
        self.0.extend_from_slice(&n.to_le_bytes());
        self
    }
}

/// The script's code for a fixed_window on a calendar, whose four boundaries follow its limit.
const CALENDAR_CODE: f64 = 5.0;
/// Added to a counter's algorithm code when the KEYS index of its two hold keys follows.
const HOLDS_CODE: f64 = 10.0;
/// Added to a limit's "how" code when it names a hold (its id follows in ARGV).
const NAMED_CODE: f64 = 9.0;
/// Added to a limit's "how" code when its node keeps holds and it names none.
const UNNAMED_CODE: f64 = 18.0;

/// What makes limits one counter of a call: the KEYS index, algorithm, whether on a calendar,
/// requests_per_unit, window, burst, and whether it keeps holds.
type CounterIdentity = (usize, Algorithm, bool, u64, u64, u64, bool);

/// A counter of a call: its KEYS index, its limit, its calendar boundaries, and the KEYS
/// index of the first of its two hold keys.
type CallCounter<'a> = (usize, &'a LimitArgs, Option<&'a [u64; 4]>, Option<usize>);

/// The script's code for an algorithm (`ALGORITHMS` in script.lua).
fn algorithm_code(algorithm: Algorithm) -> f64 {
    match algorithm {
        Algorithm::FixedWindow => 1.0,
        Algorithm::SlidingWindow => 2.0,
        Algorithm::SlidingLog => 3.0,
        Algorithm::TokenBucket => 4.0,
        Algorithm::Concurrency => 6.0,
    }
}

/// The script's code for a limit's enforcement and kind, one number (`ENFORCEMENTS` and
/// `KINDS` in script.lua): 1-3 an admission (E, Q, S), 4-6 a cost report, 7-9 a refund.
fn how_code(enforcement: Enforcement, kind: HitKind) -> f64 {
    let enforcement = match enforcement {
        Enforcement::Enforce => 1.0,
        Enforcement::Soft => 2.0,
        Enforcement::Shadow => 3.0,
    };
    let kind = match kind {
        HitKind::Admission => 0.0,
        HitKind::Report => 3.0,
        HitKind::Refund => 6.0,
    };
    enforcement + kind
}

/// The script's SHA1, as EVALSHA names it (computed once).
pub(super) fn script_hash() -> &'static str {
    static HASH: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    HASH.get_or_init(|| redis::Script::new(SCRIPT).get_hash().to_owned())
}

/// The function library's name, which is also its one function's: the script's hash in it, so
/// replicas of different versions sharing a Redis (a rolling deploy) each call their own.
pub(super) fn function_name() -> &'static str {
    static NAME: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    NAME.get_or_init(|| format!("ratelimitd_{}", script_hash()))
}

/// FUNCTION LOAD REPLACE of the library: the script with the header a library needs (its
/// name, and the name its last lines register `main` under). REPLACE makes loading
/// idempotent: the library of that name can only hold this very script.
pub(super) fn load_library() -> Cmd {
    static LIBRARY: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    let library = LIBRARY.get_or_init(|| {
        let name = function_name();
        format!("#!lua name={name}\nlocal FUNCTION = '{name}'\n{SCRIPT}")
    });
    let mut cmd = redis::cmd("FUNCTION");
    cmd.arg("LOAD").arg("REPLACE").arg(library.as_str());
    cmd
}

/// Values a call's reply starts with, before its requests' shares: the call's Redis `TIME` (µs).
pub(super) const REPLY_HEADER: usize = 1;

/// A call's reply as its values: the script sends them packed, little-endian doubles back to
/// back (script.lua, "The reply"), each an integer that a double holds exactly; read as Redis
/// reads a Lua number it replies with (truncated).
pub(super) fn reply_values(packed: &[u8]) -> Result<Vec<i64>, String> {
    if !packed.len().is_multiple_of(8) {
        return Err(format!(
            "unexpected script reply of {} bytes, not whole values",
            packed.len()
        ));
    }
    Ok(packed
        .chunks_exact(8)
        .map(|b| {
            let mut v = [0; 8];
            v.copy_from_slice(b);
            f64::from_le_bytes(v) as i64
        })
        .collect())
}

/// The call's Redis `TIME` (µs), from a whole reply's values (its length checked by the caller).
pub(super) fn call_time(values: &[i64]) -> i64 {
    values[0]
}

/// A request's share of a decide call's reply: `{admitted, then per limit: room, reset (µs)}`,
/// admitted being -1 when one of its counters holds foreign data; the room is what is left
/// when within (>= 0) and `-1 - fits` when over (see script.lua).
pub(super) enum Decided<'a> {
    /// A counter holds data this service did not write: nothing was decided or written.
    ForeignData,
    /// A calendar counter's boundaries held no window with Redis' time: nothing was decided or
    /// written; ask again with boundaries around the call's time.
    Stale,
    /// Decided.
    Answered {
        /// Every limit fit and was consumed.
        admitted: bool,
        /// Redis `TIME` of the decision (µs), what its refund names.
        at: i64,
        /// The limits' values, two each.
        limits: &'a [i64],
    },
}

impl Decided<'_> {
    /// Reads `values`, a decide's reply for one request (its length checked by the caller
    /// against [`Args::reply_len`]), made at `at` (the call's time).
    pub(super) fn parse(values: &[i64], at: i64) -> Decided<'_> {
        match values {
            [admitted, limits @ ..] if *admitted >= 0 => Decided::Answered {
                admitted: *admitted == 1,
                at,
                limits,
            },
            [-2, ..] => Decided::Stale,
            _ => Decided::ForeignData,
        }
    }
}

/// Each limit's verdict in a decided reply, in the order they were pushed (`algorithms`, theirs
/// in that order), with what a concurrency limit's request did to its places: (change, when
/// that place ends, places found ended), see script.lua's reply.
pub(super) fn verdicts<'a>(
    limits: &'a [i64],
    algorithms: impl IntoIterator<Item = Algorithm> + 'a,
) -> impl Iterator<Item = (Verdict, Option<(i64, u64, u64)>)> + 'a {
    let mut at = 0;
    algorithms.into_iter().map(move |algorithm| {
        let v = &limits[at..at + 2];
        at += 2;
        // The room: what is left when within, -1 - what would have fit when over.
        let over = v[0] < 0;
        let verdict = Verdict {
            over,
            remaining: if over { 0 } else { v[0] as u64 },
            fits: if over { (-1 - v[0]) as u64 } else { 0 },
            reset: Duration::from_micros(v[1].max(0) as u64),
        };
        let places = (algorithm == Algorithm::Concurrency).then(|| {
            let (code, end) = (limits[at], limits[at + 1].max(0) as u64);
            at += 2;
            // 0: an undecided request's (nothing done).
            match code {
                1.. => ((code & 3) - 2, end, (code >> 2) as u64),
                _ => (0, 0, 0),
            }
        });
        (verdict, places)
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::limiter::Algorithm;

    fn part(keys: &[&[u8]], rpu: u64) -> Args {
        part_of(Algorithm::FixedWindow, keys, rpu, 1)
    }

    fn part_of(algorithm: Algorithm, keys: &[&[u8]], rpu: u64, hits: u64) -> Args {
        let mut p = Args::decide(b"nn", 0);
        let limit = Limit {
            algorithm,
            requests_per_unit: rpu,
            window_us: 1_000_000,
            burst: rpu,
            calendar: None,
        };
        for key in keys {
            p.push(
                key,
                &limit,
                hits,
                Enforcement::Enforce,
                HitKind::Admission,
                &Hold::Unheld,
                || 0,
            );
        }
        p
    }

    /// The command's arguments as text, the packed numbers (after the mode) one by one.
    fn args(cmd: &Cmd) -> Vec<String> {
        let mut out = Vec::new();
        let mut packed_next = false;
        for a in cmd.args_iter() {
            let redis::Arg::Simple(b) = a else {
                panic!("a cursor")
            };
            if packed_next {
                assert_eq!(b.len() % 8, 0, "whole doubles");
                out.extend(b.chunks_exact(8).map(|c| {
                    let n = f64::from_le_bytes(c.try_into().expect("8 bytes"));
                    n.to_string()
                }));
                packed_next = false;
                continue;
            }
            packed_next = b == b"decide" || b == b"undo";
            out.push(String::from_utf8_lossy(b).into_owned());
        }
        out
    }

    #[test]
    fn keys_and_counters_go_once_per_call_and_identical_requests_once_per_run() {
        // Two requests on the same keys, a third on one of them under another limit (as across
        // a reload): two keys, three counters, two entries.
        let parts = [
            part(&[b"{d}:a", b"{d}:b"], 5),
            part(&[b"{d}:a", b"{d}:b"], 5),
            part(&[b"{d}:a"], 7),
        ];
        let parts: Vec<&Args> = parts.iter().collect();
        let got = args(&command(&parts, Call::Hash, 1));
        #[rustfmt::skip]
        let expected = [
            "EVALSHA", script_hash(), "2", "{d}:a", "{d}:b", "decide",
            // packed numbers: entries, counters, the reports' debt bound
            "2", "3", "1",
            // counters: key, algorithm (1: fixed_window), requests_per_unit, window, burst
            "1", "1", "5", "1000000", "5",
            "2", "1", "5", "1000000", "5",
            "1", "1", "7", "1000000", "7",
            // entries: requests in the run, n, then counter, hits, how (1: an admission, E)
            // per limit
            "2", "2", "1", "1", "1", "2", "1", "1",
            "1", "1", "3", "1", "1",
        ];
        assert_eq!(got, expected);
        assert_eq!(
            args(&command(&parts, Call::Source, 1))[..2],
            ["EVAL", SCRIPT]
        );
        // The same arguments after the function's name.
        let function = args(&command(&parts, Call::Function, 1));
        assert_eq!(function[..2], ["FCALL", function_name()]);
        assert_eq!(function[2..], expected[2..]);

        // Past SCAN_LIMITS limits, keys and counters are matched by hashing: the same call.
        let many: Vec<Args> = (0..10).map(|_| part(&[b"{d}:a", b"{d}:b"], 5)).collect();
        let many: Vec<&Args> = many.iter().collect();
        let got = args(&command(&many, Call::Hash, 1));
        assert_eq!(got[2..9], ["2", "{d}:a", "{d}:b", "decide", "1", "2", "1"]);
        assert_eq!(got[19..], ["10", "2", "1", "1", "1", "2", "1", "1"]);
    }

    #[test]
    fn only_requests_alike_in_counters_hits_enforcement_and_kind_share_an_entry() {
        let mut quota = part(&[b"{d}:a"], 5);
        quota.limits[0].enforcement = Enforcement::Soft;
        let mut report = part(&[b"{d}:b"], 5);
        report.limits[0].kind = HitKind::Report;
        let mut refund = part(&[b"{d}:b"], 5);
        refund.limits[0].kind = HitKind::Refund;
        let parts = [
            part(&[b"{d}:a"], 5),
            part_of(Algorithm::FixedWindow, &[b"{d}:a"], 5, 2), // other hits
            quota,                                              // other enforcement
            part(&[b"{d}:b"], 5),                               // other counter
            part(&[b"{d}:b"], 5),
            part(&[b"{d}:b"], 5), // a run of three
            part(&[b"{d}:a"], 5), // alike, but not next to its kind
            report,               // other kind
            refund,
        ];
        let parts: Vec<&Args> = parts.iter().collect();
        let got = args(&command(&parts, Call::Hash, 7));
        assert_eq!(got[5..9], ["decide", "7", "2", "7"]);
        #[rustfmt::skip]
        let entries = [
            "1", "1", "1", "1", "1",
            "1", "1", "1", "2", "1",
            "1", "1", "1", "1", "2", // Q
            "3", "1", "2", "1", "1",
            "1", "1", "1", "1", "1",
            "1", "1", "2", "1", "4", // a report, E
            "1", "1", "2", "1", "7", // a refund, E
        ];
        assert_eq!(got[19..], entries);

        // sliding_log members are named by each request's nonce: never a run, nonce sent.
        let logs = [
            part_of(Algorithm::SlidingLog, &[b"{d}:a"], 5, 1),
            part_of(Algorithm::SlidingLog, &[b"{d}:a"], 5, 1),
        ];
        let logs: Vec<&Args> = logs.iter().collect();
        let got = args(&command(&logs, Call::Hash, 1));
        assert_eq!(got[4..8], ["decide", "2", "1", "1"]);
        assert_eq!(
            got[13..],
            ["1", "1", "1", "1", "1", "1", "1", "1", "1", "1", "nn", "nn"]
        );
    }

    #[test]
    fn an_undo_names_its_marker_after_the_counters_keys() {
        let mut p = Args::undo(b"nn", 42, b"{d}undo:nn".to_vec(), 0);
        let limit = Limit {
            algorithm: Algorithm::SlidingLog,
            requests_per_unit: 3,
            window_us: 2_000_000,
            burst: 3,
            calendar: None,
        };
        p.push(
            b"{d}:a",
            &limit,
            1,
            Enforcement::Soft,
            HitKind::Admission,
            &Hold::Unheld,
            || 0,
        );
        assert_eq!(p.reply_len(), 1);
        let got = args(&command(&[&p], Call::Hash, 1));
        #[rustfmt::skip]
        let expected = [
            "EVALSHA", script_hash(), "2", "{d}:a", "{d}undo:nn", "undo", "1", "1", "1",
            "1", "3", "3", "2000000", "3", // 3: sliding_log
            "42", "2", "1", "1", "1", "2", // at, marker (KEYS[2]), n; 2: Q
            "nn",
        ];
        assert_eq!(got, expected);
    }

    /// The packed reply: doubles back to back, each read as the integer Redis would have
    /// replied with (truncated toward zero); a length that is not whole values is an error.
    #[test]
    fn a_packed_reply_reads_as_its_integers() {
        let sent = [
            1_795_000_000_123_456.0,
            1.0,
            -1.0,
            -4.0,
            3_600_000_000.0,
            2.9,
            -2.9,
        ];
        let packed: Vec<u8> = sent.iter().flat_map(|v: &f64| v.to_le_bytes()).collect();
        assert_eq!(
            reply_values(&packed).unwrap(),
            [1_795_000_000_123_456, 1, -1, -4, 3_600_000_000, 2, -2]
        );
        assert_eq!(reply_values(&[]).unwrap(), Vec::<i64>::new());
        let e = reply_values(&packed[..13]).unwrap_err();
        assert!(e.contains("13 bytes"), "{e}");
    }

    /// What redis-rs spends reading a call's reply of 265 values (53 requests of two limits),
    /// as RESP integers and packed: docs/performance.md, "Measurements behind the code".
    /// `cargo test --release --lib reply_read_cost -- --ignored --nocapture`
    #[test]
    #[ignore = "a measurement, not a test"]
    fn reply_read_cost() {
        let n = 265;
        let now = 1_795_000_000_000_000_i64;
        let mut integers = format!("*{n}\r\n").into_bytes();
        for i in 0..n {
            integers.extend_from_slice(format!(":{}\r\n", now + i * 7919).as_bytes());
        }
        let mut packed = format!("${}\r\n", n * 8).into_bytes();
        for i in 0..n {
            packed.extend_from_slice(&((now + i * 7919) as f64).to_le_bytes());
        }
        packed.extend_from_slice(b"\r\n");
        let reads = 20_000;
        for (name, reply) in [("RESP integers", &integers), ("packed", &packed)] {
            let started = tokio::time::Instant::now();
            let mut values = 0;
            for _ in 0..reads {
                values += match redis::parse_redis_value(reply).unwrap() {
                    redis::Value::Array(a) => a.len(),
                    redis::Value::BulkString(b) => reply_values(&b).unwrap().len(),
                    other => panic!("{other:?}"),
                };
            }
            assert_eq!(values, reads * n as usize);
            let each = started.elapsed() / reads as u32;
            eprintln!("{name}: {} bytes, read in {each:?}", reply.len());
        }
    }

    #[test]
    fn a_reply_reads_as_foreign_data_or_as_verdicts() {
        assert!(matches!(
            Decided::parse(&[-1, 0, 0, 0, 0], 7),
            Decided::ForeignData
        ));
        let Decided::Answered {
            admitted,
            at,
            limits,
        } = Decided::parse(&[0, -4, 5, 2, 0, -1, 9, 0, 3], 7)
        else {
            panic!("decided")
        };
        assert!(!admitted);
        assert_eq!(at, 7);
        let v: Vec<Verdict> = verdicts(limits, [Algorithm::FixedWindow; 4])
            .map(|(v, places)| {
                assert_eq!(places, None);
                v
            })
            .collect();
        assert!(v[0].over && v[0].remaining == 0 && v[0].fits == 3);
        assert_eq!(v[0].reset, Duration::from_micros(5));
        assert!(!v[1].over && v[1].remaining == 2 && v[1].fits == 0);
        // Over with no room at all, and within with none left.
        assert!(v[2].over && v[2].fits == 0 && v[2].reset == Duration::from_micros(9));
        assert!(!v[3].over && v[3].remaining == 0 && v[3].fits == 0);
        // A concurrency limit's two more values: a place taken (2 + 1), one found ended (4 × 1),
        // ending at 70; then one released, ending at 60.
        let limits = [2, 9, 7, 70, 1, 3, 1, 60];
        let v: Vec<_> = verdicts(&limits, [Algorithm::Concurrency; 2]).collect();
        assert_eq!(v[0].1, Some((1, 70, 1)));
        assert_eq!(v[1].1, Some((-1, 60, 0)));
        assert_eq!(v[1].0.remaining, 1);
        let undecided = [0, 0, 0, 0];
        let v: Vec<_> = verdicts(&undecided, [Algorithm::Concurrency]).collect();
        assert_eq!(v[0].1, Some((0, 0, 0)));
    }
}
