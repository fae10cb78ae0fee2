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

use std::ops::Range;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use futures_util::stream::{FuturesUnordered, StreamExt};
use redis::RedisError;
use tokio::sync::{mpsc, oneshot};

use super::breaker::Health;
use super::connection::{Conn, response_timeout};
use super::error::{ErrorKind, Evidence};
use super::wire::{self, Args};
use crate::metrics::BackendMetrics;

/// Most parts waiting for a call.
pub(super) const MAX_QUEUED_PARTS: usize = 16_384;
/// Most large parts waiting for their lane.
pub(super) const MAX_QUEUED_LARGE_PARTS: usize = 64;
/// Most key bytes waiting for a call.
pub(super) const MAX_QUEUED_BYTES: usize = 32 << 20;
/// Most key bytes one call carries.
pub(super) const MAX_CALL_BYTES: usize = 64 << 10;
/// Most limits one call carries.
pub(super) const MAX_CALL_LIMITS: usize = 512;
/// A part with more key bytes than this goes in a call of its own.
pub(super) const LARGE_PART_BYTES: usize = 8 << 10;
/// A part with more limits than this goes in a call of its own.
pub(super) const LARGE_PART_LIMITS: usize = 64;

/// One request's share of a script call, queued: its arguments, its slot, where its answer goes.
pub(super) struct Part {
    /// Keys, limits and what to do with them.
    pub args: Args,
    /// The keys' cluster slot (ignored on a standalone Redis).
    pub slot: u16,
    /// Where the answer goes.
    pub reply: oneshot::Sender<Result<Reply, CallError>>,
}

impl Part {
    /// Whether the part goes in a call of its own.
    fn is_large(&self) -> bool {
        self.args.key_bytes() > LARGE_PART_BYTES || self.args.limit_count() > LARGE_PART_LIMITS
    }
}

/// A part's slice of its call's reply.
#[derive(Debug)]
pub(super) struct Reply {
    values: Arc<Vec<i64>>,
    range: Range<usize>,
}

impl Reply {
    /// `{admitted, now, then per limit: over, remaining, reset}` (refund: `{1, now}`).
    pub(super) fn values(&self) -> &[i64] {
        &self.values[self.range.clone()]
    }
}

/// Why a call gave a part no reply.
#[derive(Clone, Debug)]
pub(super) enum CallError {
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
pub(crate) struct BatchOptions {
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
pub(super) struct Batcher {
    small: std::sync::OnceLock<mpsc::Sender<Part>>,
    large: std::sync::OnceLock<mpsc::Sender<Part>>,
    shared: Shared,
}

impl Batcher {
    /// Coalesces calls on `conn`; `by_slot`: only parts of one cluster slot share a call. Each
    /// call's outcome is reported to `health`.
    pub(super) fn new(
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
    pub(super) fn submit(&self, part: Part) {
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
        let bytes = part.args.key_bytes();
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
                let bytes: usize = queued.iter().map(|p| p.args.key_bytes()).sum();
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
        let (bytes, limits) = (part.args.key_bytes(), part.args.limit_count());
        if part.is_large() {
            calls.push((vec![part], bytes, limits));
            continue;
        }
        let fits = |(c, b, l): &(Vec<Part>, usize, usize)| {
            c[0].args.mode() == part.args.mode()
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
    let deadline = tokio::time::Instant::now() + timeout;
    let args: Vec<&Args> = parts.iter().map(|p| &p.args).collect();
    let by_hash = wire::command(&args, false);
    let by_source;
    // A call whose budget runs out is answered `Timeout` but stays in flight, holding its
    // lane's slot, until Redis answers it (or the connection's own response timeout): calls
    // nobody waits for any more never pile up in Redis ahead of everyone else's.
    let mut unanswered = None;
    let mut query = Box::pin(conn.query::<Vec<i64>>(&by_hash, timeout));
    let mut result = match tokio::time::timeout_at(deadline, &mut query).await {
        Ok(r) => r.map_err(CallError::Redis),
        Err(_) => {
            unanswered = Some(query);
            Err(CallError::Timeout)
        }
    };
    if let Err(CallError::Redis(e)) = &result
        && e.kind() == redis::ErrorKind::Server(redis::ServerErrorKind::NoScript)
    {
        // EVAL routes like EVALSHA and leaves the script cached on that node.
        by_source = wire::command(&args, true);
        let mut query = Box::pin(conn.query::<Vec<i64>>(&by_source, timeout));
        result = match tokio::time::timeout_at(deadline, &mut query).await {
            Ok(r) => r.map_err(CallError::Redis),
            Err(_) => {
                unanswered = Some(query);
                Err(CallError::Timeout)
            }
        };
    }
    metrics.duration.observe(started.elapsed().as_secs_f64());
    // The call's outcome, once, as evidence of Redis's health (never once per request in it).
    // A timeout is the call's budget (the connection's own response timeout is longer).
    let evidence = match &result {
        Err(CallError::Redis(e)) => ErrorKind::of(e).evidence(),
        Err(CallError::Timeout) => ErrorKind::Timeout.evidence(),
        _ => Evidence::None,
    };
    match &result {
        Ok(_) => health.on_answer(),
        Err(_) if evidence == Evidence::Unreachable => health.on_unreachable(),
        Err(_) if evidence == Evidence::Stalled => health.on_timeout(&conn, timeout),
        Err(_) => {}
    }
    drop(args);
    let expected: usize = parts.iter().map(|p| p.args.reply_len()).sum();
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
        let len = part.args.reply_len();
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
    if let Some(query) = unanswered {
        let _ = tokio::time::timeout(response_timeout(timeout), query).await;
    }
}
