//! Coalescing: the requests in flight share script calls.
//!
//! Every request's share of a script call (a [`Part`]) goes to one worker task. The worker
//! sends what is queued at once while fewer than `pipeline` calls are in flight, so an idle
//! service adds no wait. While `pipeline` calls are in flight, parts queue and the next call
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
//!   alone (see script.lua), and the call's health is reported once (see [`StoreHealth`]).

use std::ops::Range;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;

use tokio::time::Instant;

use futures_util::stream::{FuturesUnordered, StreamExt};
use redis::RedisError;
use tokio::sync::{mpsc, oneshot};

use super::circuit::StoreHealth;
use super::connection::{Conn, response_timeout};
use super::error::{self, ErrorKind, Evidence};
use super::wire::{self, Args, Call};
use crate::limiter::BoxFuture;
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
    /// `{admitted, then per limit: room, reset}` (undo: `{1}`); see [`wire::Decided`].
    pub(super) fn values(&self) -> &[i64] {
        &self.values[self.range.clone()]
    }

    /// The call's Redis `TIME` (µs): when it was decided.
    pub(super) fn at(&self) -> i64 {
        wire::call_time(&self.values)
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
    /// How far past its limit a cost report may take a counter.
    pub max_debt: u64,
}

/// What the worker and its calls share.
#[derive(Clone)]
struct WorkerState {
    conn: Conn,
    by_slot: bool,
    options: BatchOptions,
    metrics: BackendMetrics,
    health: Arc<StoreHealth>,
    /// Key bytes of the parts queued.
    queued_bytes: Arc<AtomicUsize>,
    /// Whether the script is called as a function (until Redis refuses functions).
    functions: Arc<AtomicBool>,
}

/// The handle requests submit their parts to; each lane's worker starts on first use.
pub(super) struct Batcher {
    small: std::sync::OnceLock<mpsc::Sender<Part>>,
    large: std::sync::OnceLock<mpsc::Sender<Part>>,
    shared: WorkerState,
}

impl Batcher {
    /// Coalesces calls on `conn`; `by_slot`: only parts of one cluster slot share a call. Each
    /// call's outcome is reported to `health`.
    pub(super) fn new(
        conn: Conn,
        by_slot: bool,
        options: BatchOptions,
        metrics: BackendMetrics,
        health: Arc<StoreHealth>,
    ) -> Self {
        Batcher {
            small: std::sync::OnceLock::new(),
            large: std::sync::OnceLock::new(),
            shared: WorkerState {
                conn,
                by_slot,
                options,
                metrics,
                health,
                queued_bytes: Arc::new(AtomicUsize::new(0)),
                functions: Arc::new(AtomicBool::new(true)),
            },
        }
    }

    /// The lane of requests of up to 64 counters, its worker started on first use.
    fn small_lane(&self) -> &mpsc::Sender<Part> {
        self.small.get_or_init(|| {
            let (tx, rx) = mpsc::channel(MAX_QUEUED_PARTS);
            let options = self.shared.options;
            let lane = (options.pipeline.max(1), options.max_requests.max(1));
            tokio::spawn(run(rx, self.shared.clone(), lane.0, lane.1));
            tx
        })
    }

    /// Readies the store for a first burst before anyone calls: the small lane's worker
    /// started, the calls' connection made and the script loaded where calls will find it (the
    /// function library, or where Redis refuses functions, the script cached for EVALSHA).
    /// Without it the first calls each waited for all three, and a fresh replica's first wave
    /// missed Envoy's 20 ms.
    pub(super) async fn warm(&self) -> Result<(), RedisError> {
        let _ = self.small_lane();
        let WorkerState {
            conn,
            options,
            functions,
            ..
        } = &self.shared;
        if functions.load(Ordering::Relaxed) {
            match conn
                .query::<redis::Value>(&wire::load_library(), options.timeout)
                .await
            {
                Ok(_) => return Ok(()),
                Err(e) if error::functions_refused(&e) => {
                    without_functions(functions, &e);
                }
                Err(e) => return Err(e),
            }
        }
        let mut load = redis::cmd("SCRIPT");
        load.arg("LOAD").arg(wire::SCRIPT);
        conn.query::<redis::Value>(&load, options.timeout)
            .await
            .map(|_| ())
    }

    /// Queues `part`; its reply arrives on the receiver its `reply` sender belongs to. A part
    /// the queue has no room for is answered [`CallError::Overloaded`] at once.
    pub(super) fn submit(&self, part: Part) {
        let tx = if part.is_large() {
            self.large.get_or_init(|| {
                let (tx, rx) = mpsc::channel(MAX_QUEUED_LARGE_PARTS);
                tokio::spawn(run(rx, self.shared.clone(), 1, 1));
                tx
            })
        } else {
            self.small_lane()
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

/// A lane's worker: calls of at most `max_requests` parts each, at most `pipeline` in flight.
/// While fewer are in flight, what is queued goes at once (an idle service adds no wait);
/// while `pipeline` are, parts wait for one to return and then share the next call. So a few
/// requests in flight share calls too, and a busy lane keeps `pipeline` full calls going.
/// Sending a second call before the first returns, rather than only a full one, is measured
/// in docs/performance.md ("The second call goes at once"). A call answered
/// `Timeout` but not by Redis yet still holds its place among the `pipeline`.
async fn run(
    mut rx: mpsc::Receiver<Part>,
    shared: WorkerState,
    pipeline: usize,
    max_requests: usize,
) {
    // Calls, and the tails of calls answered `Timeout` that Redis has not answered yet.
    let mut in_flight: FuturesUnordered<BoxFuture<'static, Done>> = FuturesUnordered::new();
    // Parts taken off the channel, not sent yet: at most `pipeline` calls' worth (the channel
    // holds the rest, within its bound).
    let mut queued: Vec<Part> = Vec::new();
    let held = pipeline * max_requests;
    let mut open = true;
    loop {
        while !queued.is_empty() && in_flight.len() < pipeline {
            let mut next: Vec<Part> = queued.drain(..queued.len().min(max_requests)).collect();
            let bytes: usize = next.iter().map(|p| p.args.key_bytes()).sum();
            shared.queued_bytes.fetch_sub(bytes, Ordering::AcqRel);
            for call in calls(&mut next, shared.by_slot) {
                in_flight.push(Box::pin(send(shared.clone(), call)));
            }
        }
        if !open && in_flight.is_empty() {
            break;
        }
        tokio::select! {
            biased;
            Some(done) = in_flight.next(), if !in_flight.is_empty() => match done {
                Done::Answered | Done::TailAnswered => {}
                Done::Unanswered(tail) => {
                    // Its callers are answered; it keeps its place until Redis answers.
                    in_flight.push(Box::pin(async move {
                        tail.await;
                        Done::TailAnswered
                    }));
                }
            },
            part = rx.recv(), if open && queued.len() < held => {
                let Some(part) = part else {
                    // The backend is gone: send what is queued, let the calls answer.
                    open = false;
                    continue;
                };
                queued.push(part);
                if in_flight.len() < pipeline {
                    // This part goes at once: first let the tasks already woken (requests read
                    // in the same pass) queue theirs, to share its call. One pass of the
                    // scheduler, no timer (docs/performance.md, "Measurements behind the code").
                    tokio::task::yield_now().await;
                }
                while queued.len() < held {
                    match rx.try_recv() {
                        Ok(p) => queued.push(p),
                        Err(_) => break,
                    }
                }
            }
        }
    }
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

/// How a call in flight ended.
enum Done {
    /// Every part answered, and Redis answered the call.
    Answered,
    /// Every part answered (`Timeout`), but Redis has not answered the call yet: this waits
    /// for it, within the connection's response timeout.
    Unanswered(Unanswered),
    /// An [`Done::Unanswered`] call's answer came (or the response timeout passed).
    TailAnswered,
}

/// Makes the call carrying `parts` and answers each part.
async fn send(shared: WorkerState, parts: Vec<Part>) -> Done {
    let WorkerState {
        conn,
        options,
        metrics,
        health,
        functions,
        ..
    } = shared;
    let timeout = options.timeout;
    metrics.batch_requests.observe(parts.len() as f64);
    let started = Instant::now();
    let deadline = tokio::time::Instant::now() + timeout;
    let args: Vec<&Args> = parts.iter().map(|p| &p.args).collect();
    // A call whose budget runs out is answered `Timeout` but stays in flight, holding its
    // lane's slot, until Redis answers it (or the connection's own response timeout): calls
    // nobody waits for any more never pile up in Redis ahead of everyone else's.
    let mut unanswered = None;
    // FCALL; after "Function not found" (a Redis restarted or flushed) the library is loaded
    // and the call made once more. Where Redis refuses functions (before 7, or an ACL), the
    // service calls the script by EVALSHA from then on, and by EVAL after NOSCRIPT. At most
    // three round trips, all within the call's budget.
    let mut how = if functions.load(Ordering::Relaxed) {
        Call::Function
    } else {
        Call::Hash
    };
    let mut loaded = false;
    let mut reconnected = false;
    let result = loop {
        let cmd = wire::command(&args, how, options.max_debt);
        let r = attempt::<Vec<u8>>(&conn, cmd, timeout, deadline, &mut unanswered).await;
        let Err(CallError::Redis(e)) = &r else {
            break r;
        };
        match how {
            Call::Function if !loaded && error::function_missing(e) => {
                let load = wire::load_library();
                match attempt::<redis::Value>(&conn, load, timeout, deadline, &mut unanswered).await
                {
                    Ok(_) => loaded = true,
                    Err(CallError::Redis(e)) if error::functions_refused(&e) => {
                        how = without_functions(&functions, &e);
                    }
                    Err(e) => break Err(e),
                }
            }
            Call::Function if error::functions_refused(e) => how = without_functions(&functions, e),
            // EVAL routes like EVALSHA and leaves the script cached on that node.
            Call::Hash
                if e.kind() == redis::ErrorKind::Server(redis::ServerErrorKind::NoScript) =>
            {
                how = Call::Source;
            }
            // The connection was found closed (Redis restarted since the last call): the
            // call was never written. Once more, on a fresh connection.
            _ if !reconnected && never_written(e) => {
                reconnected = true;
                conn.on_error(e).await;
            }
            _ => break r,
        }
    };
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
        Err(CallError::Redis(e)) if evidence == Evidence::Unreachable => health.on_unreachable(e),
        Err(_) if evidence == Evidence::Stalled => health.on_timeout(timeout),
        Err(_) => {}
    }
    drop(args);
    let expected: usize =
        wire::REPLY_HEADER + parts.iter().map(|p| p.args.reply_len()).sum::<usize>();
    let result =
        match result.and_then(|packed| wire::reply_values(&packed).map_err(CallError::Reply)) {
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
    let mut from = wire::REPLY_HEADER;
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
    match unanswered {
        Some(query) => Done::Unanswered(Box::pin(async move {
            let _ = tokio::time::timeout(response_timeout(timeout), query).await;
        })),
        None => Done::Answered,
    }
}

/// Whether a call failed because its connection was closed before it could be written: the
/// client's "broken pipe", which it gives for a connection whose reader had already seen Redis
/// go (a write that fails gives it too, and writes nothing whole). The reply to a call written
/// before Redis closed its connection is lost the same way, but Redis only closes one between
/// calls or when it dies, when what it did dies with it (without persistence).
fn never_written(e: &redis::RedisError) -> bool {
    // The client keeps the I/O error's kind to itself; its text names it.
    e.is_io_error() && e.to_string().to_ascii_lowercase().contains("broken pipe")
}

/// A call not answered yet, kept until Redis answers it (see [`send`]).
type Unanswered = BoxFuture<'static, ()>;

/// Sends `cmd` and waits for its reply until `deadline`; past it, the query goes to
/// `unanswered` and the answer is [`CallError::Timeout`].
async fn attempt<T: redis::FromRedisValue + Send + 'static>(
    conn: &Conn,
    cmd: redis::Cmd,
    timeout: Duration,
    deadline: tokio::time::Instant,
    unanswered: &mut Option<Unanswered>,
) -> Result<T, CallError> {
    let conn = conn.clone();
    let mut query = Box::pin(async move { conn.query::<T>(&cmd, timeout).await });
    match tokio::time::timeout_at(deadline, &mut query).await {
        Ok(r) => r.map_err(CallError::Redis),
        Err(_) => {
            *unanswered = Some(Box::pin(async move {
                let _ = query.await;
            }));
            Err(CallError::Timeout)
        }
    }
}

/// Turns functions off for this process after Redis refused them (`why`): from now on the
/// script is called by EVALSHA.
fn without_functions(functions: &AtomicBool, why: &RedisError) -> Call {
    if functions.swap(false, Ordering::Relaxed) {
        tracing::info!("redis refuses functions ({why}): the script is called by EVALSHA");
    }
    Call::Hash
}
