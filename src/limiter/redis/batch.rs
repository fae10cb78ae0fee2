//! Coalescing: the requests in flight share script calls.
//!
//! Every request's share of a script call (a [`Part`]) goes to one worker task. The worker
//! sends a part at once while fewer than `pipeline` calls are in flight, so an idle service
//! adds no wait. Under load the calls in flight are full, parts queue, and the next call
//! carries every queued part of its slot (up to `max_requests`): one script call and one round
//! trip for many requests. The script decides a call's parts one after another, each
//! all-or-nothing on its own, exactly as separate calls at the same instant would: no decision
//! changes. A part whose caller has given up (its call budget spent) is dropped before it is
//! sent, so a request answered with an error is never counted later.
//!
//! Bounded, so that one client's work cannot slow or fail another's:
//! - the queue holds at most [`MAX_QUEUED_PARTS`] parts and [`MAX_QUEUED_BYTES`] of keys; a part
//!   beyond either is refused at once (`overloaded`), never left to time out in a long queue;
//! - a call carries at most [`MAX_CALL_BYTES`] of keys and [`MAX_CALL_LIMITS`] limits, and a
//!   large part (over [`LARGE_PART_BYTES`] or [`LARGE_PART_LIMITS`]) goes alone: a huge request
//!   is never coalesced with small ones, so its cost and any failure of its call stay its own;
//! - large parts have a lane of their own, one call in flight and [`MAX_QUEUED_LARGE_PARTS`]
//!   queued: however many huge requests clients send, at most one of them is ahead of a small
//!   request at Redis, and they wait (or are refused) behind each other, not in front of others;
//! - the script decides each part on its own: a part whose counter holds foreign data fails
//!   alone (see script.lua), and the call's health is reported once (see [`Health`]).

use std::collections::HashMap;
use std::ops::Range;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use futures_util::stream::{FuturesUnordered, StreamExt};
use redis::{Cmd, RedisError};
use smallvec::SmallVec;
use tokio::sync::{mpsc, oneshot};

use super::SCRIPT;
use super::breaker::Health;
use super::connection::Conn;
use crate::metrics::BackendMetrics;

/// Most parts waiting for a call.
pub const MAX_QUEUED_PARTS: usize = 16_384;
/// Most large parts waiting for their lane.
pub const MAX_QUEUED_LARGE_PARTS: usize = 64;
/// Most key bytes waiting for a call.
pub const MAX_QUEUED_BYTES: usize = 32 << 20;
/// Most key bytes one call carries.
pub const MAX_CALL_BYTES: usize = 64 << 10;
/// Most limits one call carries.
pub const MAX_CALL_LIMITS: usize = 512;
/// A part with more key bytes than this goes in a call of its own.
pub const LARGE_PART_BYTES: usize = 8 << 10;
/// A part with more limits than this goes in a call of its own.
pub const LARGE_PART_LIMITS: usize = 64;

/// What a call does to its parts' counters.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    /// Check every limit, commit all or none (per part).
    Decide,
    /// Give back what an admitted decide took.
    Refund,
}

impl Mode {
    fn arg(self) -> &'static str {
        match self {
            Mode::Decide => "decide",
            Mode::Refund => "refund",
        }
    }
}

/// One limit of a part, as the script takes it.
#[derive(Clone, Copy, Debug)]
pub struct LimitArgs {
    /// f, s, w or b.
    pub algorithm: u8,
    /// Hits per window (token bucket: refill per window).
    pub requests_per_unit: u64,
    /// Window in µs.
    pub window_us: u64,
    /// Token bucket capacity.
    pub burst: u64,
    /// Hits to add (refund: to give back).
    pub hits: u64,
    /// E, Q or S.
    pub enforcement: u8,
}

/// One request's share of a script call: keys of one slot, and what to do with them.
pub struct Part {
    /// Decide or refund.
    pub mode: Mode,
    /// The keys' cluster slot (ignored on a standalone Redis).
    pub slot: u16,
    /// Names the request's sliding_log members.
    pub nonce: [u8; 33],
    /// Length of `nonce`.
    pub nonce_len: u8,
    /// Refund: the decide's time (µs).
    pub at: i64,
    /// Refund: the key marking this request's refund as done (empty for a decide).
    pub marker: Vec<u8>,
    /// Every key's bytes, back to back.
    pub keys: Vec<u8>,
    /// Where each key ends in `keys`.
    pub key_ends: SmallVec<[u32; 8]>,
    /// One per key.
    pub limits: SmallVec<[LimitArgs; 8]>,
    /// Where the answer goes.
    pub reply: oneshot::Sender<Result<Reply, CallError>>,
}

impl Part {
    /// Whether the part goes in a call of its own.
    fn is_large(&self) -> bool {
        self.keys.len() > LARGE_PART_BYTES || self.limits.len() > LARGE_PART_LIMITS
    }

    /// Values the script returns for this part.
    fn reply_len(&self) -> usize {
        match self.mode {
            Mode::Decide => 2 + 3 * self.limits.len(),
            Mode::Refund => 2,
        }
    }
}

/// A part's slice of its call's reply.
#[derive(Debug)]
pub struct Reply {
    values: Arc<Vec<i64>>,
    range: Range<usize>,
}

impl Reply {
    /// `{admitted, now, then per limit: over, remaining, reset}` (refund: `{1, now}`).
    pub fn values(&self) -> &[i64] {
        &self.values[self.range.clone()]
    }
}

/// Why a call gave a part no reply.
#[derive(Clone, Debug)]
pub enum CallError {
    /// Redis refused or failed the call.
    Redis(RedisError),
    /// No answer within the call budget.
    Timeout,
    /// The script's reply did not have the expected shape.
    Reply(String),
    /// The worker is gone (the backend is shutting down).
    Closed,
    /// The queue was full: refused at once.
    Overloaded,
}

/// How calls are coalesced.
#[derive(Clone, Copy, Debug)]
pub struct BatchOptions {
    /// Script calls in flight at once (pipelined on the connection).
    pub pipeline: usize,
    /// Most requests one call carries.
    pub max_requests: usize,
    /// Budget of one call.
    pub timeout: Duration,
}

/// What the worker and its calls share.
#[derive(Clone)]
struct Shared {
    conn: Conn,
    by_slot: bool,
    options: BatchOptions,
    metrics: BackendMetrics,
    health: Arc<Health>,
    /// Key bytes of the parts queued.
    queued_bytes: Arc<AtomicUsize>,
}

/// The handle requests submit their parts to; each lane's worker starts on first use.
pub struct Batcher {
    small: std::sync::OnceLock<mpsc::Sender<Part>>,
    large: std::sync::OnceLock<mpsc::Sender<Part>>,
    shared: Shared,
}

impl Batcher {
    /// Coalesces calls on `conn`; `by_slot`: only parts of one cluster slot share a call. Each
    /// call's outcome is reported to `health`.
    pub fn new(
        conn: Conn,
        by_slot: bool,
        options: BatchOptions,
        metrics: BackendMetrics,
        health: Arc<Health>,
    ) -> Self {
        Batcher {
            small: std::sync::OnceLock::new(),
            large: std::sync::OnceLock::new(),
            shared: Shared {
                conn,
                by_slot,
                options,
                metrics,
                health,
                queued_bytes: Arc::new(AtomicUsize::new(0)),
            },
        }
    }

    /// Queues `part`; its reply arrives on the receiver its `reply` sender belongs to. A part
    /// the queue has no room for is answered [`CallError::Overloaded`] at once.
    pub fn submit(&self, part: Part) {
        let options = self.shared.options;
        let tx = if part.is_large() {
            self.large.get_or_init(|| {
                let (tx, rx) = mpsc::channel(MAX_QUEUED_LARGE_PARTS);
                tokio::spawn(run(rx, self.shared.clone(), 1, 1));
                tx
            })
        } else {
            self.small.get_or_init(|| {
                let (tx, rx) = mpsc::channel(MAX_QUEUED_PARTS);
                let lane = (options.pipeline.max(1), options.max_requests.max(1));
                tokio::spawn(run(rx, self.shared.clone(), lane.0, lane.1));
                tx
            })
        };
        let bytes = part.keys.len();
        let queued = self.shared.queued_bytes.fetch_add(bytes, Ordering::AcqRel);
        if queued > 0 && queued + bytes > MAX_QUEUED_BYTES {
            self.shared.queued_bytes.fetch_sub(bytes, Ordering::AcqRel);
            let _ = part.reply.send(Err(CallError::Overloaded));
            return;
        }
        if let Err(e) = tx.try_send(part) {
            self.shared.queued_bytes.fetch_sub(bytes, Ordering::AcqRel);
            let (part, error) = match e {
                mpsc::error::TrySendError::Full(p) => (p, CallError::Overloaded),
                mpsc::error::TrySendError::Closed(p) => (p, CallError::Closed),
            };
            let _ = part.reply.send(Err(error));
        }
    }
}

/// A lane's worker: at most `pipeline` calls in flight, each of at most `max_requests` parts.
async fn run(mut rx: mpsc::Receiver<Part>, shared: Shared, pipeline: usize, max_requests: usize) {
    let mut in_flight = FuturesUnordered::new();
    let mut queued: Vec<Part> = Vec::new();
    loop {
        tokio::select! {
            biased;
            Some(()) = in_flight.next(), if !in_flight.is_empty() => {}
            part = rx.recv(), if in_flight.len() < pipeline => {
                let Some(part) = part else { break };
                queued.push(part);
                while queued.len() < max_requests {
                    match rx.try_recv() {
                        Ok(p) => queued.push(p),
                        Err(_) => break,
                    }
                }
                let bytes: usize = queued.iter().map(|p| p.keys.len()).sum();
                shared.queued_bytes.fetch_sub(bytes, Ordering::AcqRel);
                for call in calls(&mut queued, shared.by_slot) {
                    in_flight.push(send(shared.clone(), call));
                }
            }
        }
    }
    // The backend is gone: let the calls in flight answer their callers.
    while in_flight.next().await.is_some() {}
}

/// Splits the queued parts into calls: one per mode (and per slot when `by_slot`), in order,
/// each within [`MAX_CALL_BYTES`] and [`MAX_CALL_LIMITS`], a large part alone.
fn calls(queued: &mut Vec<Part>, by_slot: bool) -> Vec<Vec<Part>> {
    // (parts, key bytes, limits) of each call being filled.
    let mut calls: Vec<(Vec<Part>, usize, usize)> = Vec::new();
    for part in queued.drain(..) {
        // A caller that gave up was answered with an error: never count its request later.
        if part.reply.is_closed() {
            continue;
        }
        let (bytes, limits) = (part.keys.len(), part.limits.len());
        if part.is_large() {
            calls.push((vec![part], bytes, limits));
            continue;
        }
        let fits = |(c, b, l): &(Vec<Part>, usize, usize)| {
            c[0].mode == part.mode
                && (!by_slot || c[0].slot == part.slot)
                && !c[0].is_large()
                && b + bytes <= MAX_CALL_BYTES
                && l + limits <= MAX_CALL_LIMITS
        };
        match calls.iter_mut().find(|c| fits(c)) {
            Some((c, b, l)) => {
                c.push(part);
                *b += bytes;
                *l += limits;
            }
            None => calls.push((vec![part], bytes, limits)),
        }
    }
    calls.into_iter().map(|(c, _, _)| c).collect()
}

/// Up to this many limits in a call, keys and counters are matched by a scan.
const SCAN_LIMITS: usize = 16;

/// The script call of `parts`: EVALSHA, or EVAL with the source after NOSCRIPT. Each distinct
/// key is sent once and each distinct (key, limit) counter once; requests name their counters
/// by number (see script.lua).
fn command(parts: &[Part], by_source: bool) -> Cmd {
    // Keys → KEYS index, (key, algorithm, requests_per_unit, window, burst) → counter number,
    // both 1-based as Lua counts.
    let limits_in: usize = parts.iter().map(|p| p.limits.len()).sum();
    let refunding = parts[0].mode == Mode::Refund;
    let mut keys: Vec<&[u8]> =
        Vec::with_capacity(limits_in + if refunding { parts.len() } else { 0 });
    // A few limits (an idle service's lone request) are matched by a scan; a call of many by
    // hashing, which costs more to set up than a short scan does.
    let hashed = limits_in > SCAN_LIMITS;
    let mut key_index: HashMap<&[u8], usize> = HashMap::new();
    let mut counters: Vec<(usize, &LimitArgs)> = Vec::with_capacity(limits_in);
    let mut counter_index: HashMap<(usize, u8, u64, u64, u64), usize> = HashMap::new();
    if hashed {
        key_index.reserve(limits_in);
        counter_index.reserve(limits_in);
    }
    let mut limits: Vec<usize> = Vec::with_capacity(limits_in); // every part's limits' counter numbers, in order
    for p in parts {
        let mut from = 0;
        for (end, l) in p.key_ends.iter().zip(&p.limits) {
            let key = &p.keys[from..*end as usize];
            from = *end as usize;
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
            let identity = (k, l.algorithm, l.requests_per_unit, l.window_us, l.burst);
            let same = |(ck, cl): &(usize, &LimitArgs)| {
                (
                    *ck,
                    cl.algorithm,
                    cl.requests_per_unit,
                    cl.window_us,
                    cl.burst,
                ) == identity
            };
            let c = if hashed {
                *counter_index.entry(identity).or_insert_with(|| {
                    counters.push((k, l));
                    counters.len()
                })
            } else {
                match counters.iter().position(same) {
                    Some(c) => c + 1,
                    None => {
                        counters.push((k, l));
                        counters.len()
                    }
                }
            };
            limits.push(c);
        }
    }
    // A refund's markers follow the counters' keys (each its own: one per request).
    let markers = keys.len();
    if refunding {
        keys.extend(parts.iter().map(|p| &p.marker[..]));
    }
    let key_bytes: usize = keys.iter().map(|k| k.len()).sum();
    let args = 6
        + keys.len()
        + 5 * counters.len()
        + parts.iter().map(|p| 3 + 3 * p.limits.len()).sum::<usize>();
    let mut cmd = Cmd::with_capacity(args, key_bytes + 16 * args + 128);
    if by_source {
        cmd.arg("EVAL").arg(SCRIPT);
    } else {
        cmd.arg("EVALSHA").arg(script_hash());
    }
    cmd.arg(keys.len());
    for key in &keys {
        cmd.arg(*key);
    }
    cmd.arg(parts[0].mode.arg())
        .arg(parts.len())
        .arg(counters.len());
    for (k, l) in &counters {
        cmd.arg(*k)
            .arg(&[l.algorithm][..])
            .arg(l.requests_per_unit)
            .arg(l.window_us)
            .arg(l.burst);
    }
    let mut counter = limits.iter();
    for (i, p) in parts.iter().enumerate() {
        cmd.arg(&p.nonce[..p.nonce_len as usize]).arg(p.at);
        if refunding {
            cmd.arg(markers + i + 1);
        }
        cmd.arg(p.limits.len());
        for l in &p.limits {
            cmd.arg(*counter.next().expect("one counter per limit"))
                .arg(l.hits)
                .arg(&[l.enforcement][..]);
        }
    }
    cmd
}

/// The script's SHA1, as EVALSHA names it (computed once).
fn script_hash() -> &'static str {
    static HASH: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    HASH.get_or_init(|| redis::Script::new(SCRIPT).get_hash().to_owned())
}

async fn send(shared: Shared, parts: Vec<Part>) {
    let Shared {
        conn,
        options,
        metrics,
        health,
        ..
    } = shared;
    let timeout = options.timeout;
    metrics.batch_requests.observe(parts.len() as f64);
    let started = Instant::now();
    let attempt = |by_source: bool| {
        let cmd = command(&parts, by_source);
        let conn = &conn;
        async move {
            match tokio::time::timeout(timeout, conn.query::<Vec<i64>>(&cmd, timeout)).await {
                Ok(Ok(v)) => Ok(v),
                Ok(Err(e)) => Err(CallError::Redis(e)),
                Err(_) => Err(CallError::Timeout),
            }
        }
    };
    let mut result = attempt(false).await;
    if let Err(CallError::Redis(e)) = &result
        && e.kind() == redis::ErrorKind::Server(redis::ServerErrorKind::NoScript)
    {
        // EVAL routes like EVALSHA and leaves the script cached on that node.
        let left = timeout.saturating_sub(started.elapsed());
        result = if left.is_zero() {
            Err(CallError::Timeout)
        } else {
            attempt(true).await
        };
    }
    metrics.duration.observe(started.elapsed().as_secs_f64());
    // The call's outcome, once, as evidence of Redis's health (never once per request in it).
    // A timeout is ours (the call's budget) or the client's (its response timeout, the same
    // budget): whichever fires first, it is the same suspicion.
    let kind = match &result {
        Err(CallError::Redis(e)) => super::classify(e).0,
        Err(CallError::Timeout) => "timeout",
        _ => "",
    };
    match &result {
        Ok(_) => health.on_answer(),
        Err(_) if kind == "connection" => health.on_unreachable(),
        Err(_) if kind == "timeout" => {
            let conn = conn.clone();
            health.on_timeout(async move {
                matches!(
                    tokio::time::timeout(timeout, conn.ping(timeout)).await,
                    Ok(Ok(()))
                )
            });
        }
        Err(_) => {}
    }
    let expected: usize = parts.iter().map(Part::reply_len).sum();
    let result = match result {
        Ok(values) if values.len() == expected => Ok(Arc::new(values)),
        Ok(values) => Err(CallError::Reply(format!(
            "unexpected script reply of {} values for {} requests ({} expected)",
            values.len(),
            parts.len(),
            expected
        ))),
        Err(e) => {
            if let CallError::Redis(e) = &e {
                conn.on_error(e).await;
            }
            Err(e)
        }
    };
    let mut from = 0;
    for part in parts {
        let len = part.reply_len();
        let reply = match &result {
            Ok(values) => Ok(Reply {
                values: values.clone(),
                range: from..from + len,
            }),
            Err(e) => Err(e.clone()),
        };
        from += len;
        let _ = part.reply.send(reply);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn part(keys: &[&[u8]], rpu: u64) -> Part {
        let mut p = Part {
            mode: Mode::Decide,
            slot: 0,
            nonce: [b'n'; 33],
            nonce_len: 2,
            at: 0,
            marker: Vec::new(),
            keys: Vec::new(),
            key_ends: SmallVec::new(),
            limits: SmallVec::new(),
            reply: oneshot::channel().0,
        };
        for key in keys {
            p.keys.extend_from_slice(key);
            p.key_ends.push(p.keys.len() as u32);
            p.limits.push(LimitArgs {
                algorithm: b'f',
                requests_per_unit: rpu,
                window_us: 1_000_000,
                burst: rpu,
                hits: 1,
                enforcement: b'E',
            });
        }
        p
    }

    fn args(cmd: &Cmd) -> Vec<String> {
        cmd.args_iter()
            .map(|a| match a {
                redis::Arg::Simple(b) => String::from_utf8_lossy(b).into_owned(),
                _ => "<cursor>".into(),
            })
            .collect()
    }

    #[test]
    fn keys_and_counters_go_once_per_call_and_requests_name_them() {
        // Two requests on the same keys, a third on one of them under another limit (as across
        // a reload): two keys, three counters.
        let parts = [
            part(&[b"{d}:a", b"{d}:b"], 5),
            part(&[b"{d}:a", b"{d}:b"], 5),
            part(&[b"{d}:a"], 7),
        ];
        let got = args(&command(&parts, false));
        #[rustfmt::skip]
        let expected = [
            "EVALSHA", script_hash(), "2", "{d}:a", "{d}:b", "decide", "3", "3",
            // counters: key, algorithm, requests_per_unit, window, burst
            "1", "f", "5", "1000000", "5",
            "2", "f", "5", "1000000", "5",
            "1", "f", "7", "1000000", "7",
            // requests: nonce, at, n, then counter, hits, enforcement per limit
            "nn", "0", "2", "1", "1", "E", "2", "1", "E",
            "nn", "0", "2", "1", "1", "E", "2", "1", "E",
            "nn", "0", "1", "3", "1", "E",
        ];
        assert_eq!(got, expected);
        assert_eq!(args(&command(&parts, true))[..2], ["EVAL", SCRIPT]);

        // Past SCAN_LIMITS limits, keys and counters are matched by hashing: the same call.
        let many: Vec<Part> = (0..10).map(|_| part(&[b"{d}:a", b"{d}:b"], 5)).collect();
        let got = args(&command(&many, false));
        assert_eq!(got[2..8], ["2", "{d}:a", "{d}:b", "decide", "10", "2"]);
        let requests = &got[18..];
        assert_eq!(requests.len(), 10 * 9);
        for r in requests.chunks(9) {
            assert_eq!(r, ["nn", "0", "2", "1", "1", "E", "2", "1", "E"]);
        }
    }
}
