//! What one client connection may hold, on every port. Each accepted socket is [`Tracked`]:
//!
//! - **Count.** A listener holds at most `max_connections`; one past that is closed at accept.
//! - **Silence.** A peer that sends no byte for `idle_timeout` is closed (a slowloris that sent
//!   half a request, a socket that never spoke). A live gRPC client is never silent that long:
//!   the server pings it every third of `idle_timeout` and its HTTP/2 stack answers.
//! - **Not reading.** While a peer leaves the server's writes blocked, nothing more is read
//!   from it, so it cannot make the server take in more requests than it reads answers for; if
//!   that lasts `idle_timeout` it is closed.
//! - **Age (gRPC).** With `age` set, each connection is given an age within ±[`AGE_JITTER`]
//!   of it; at that age the gRPC server sends it GOAWAY (see `serve.rs`), and once `grace` more
//!   has passed it is closed here, whatever its streams are doing.
//! - **Request bytes (gRPC).** The requests a connection has in flight, from their first body
//!   byte until their answer is ready, hold at most `request_bytes` between them; a request
//!   that would pass that is refused (`RESOURCE_EXHAUSTED`) on its own connection only. Half-
//!   sent requests therefore pin at most that much, and only until the request deadline. On a
//!   long-lived stream (RLQS) a message counts from its first byte until it is complete, and
//!   what was taken in is given back: a stream holds its unfinished message and the frame
//!   being read, never everything it ever sent; 200 streams each stopping one byte short of a
//!   1 MiB message hold the connection's budget between them, not 200 MiB. A stream's message
//!   must also arrive whole within the request deadline from its first byte, or the stream is
//!   ended (`DEADLINE_EXCEEDED`): what it held is given back.

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::task::{Context, Poll, Waker};
use std::time::Duration;

use axum::body::Bytes;
use http_body::{Body as HttpBody, Frame, SizeHint};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::time::{Instant, Sleep};

use crate::engine::{Engine, Taken};

/// Pause after a failed accept (out of descriptors, a connection reset before it was taken):
/// the error is likely to repeat at once, and retrying without a pause would spin a core.
const ACCEPT_RETRY: Duration = Duration::from_millis(50);

/// The next connection on `listener` (`what` names the port in the log). A failed accept is
/// logged and retried after [`ACCEPT_RETRY`]; the listener itself stays open. Cancel-safe.
pub(crate) async fn accept(
    listener: &tokio::net::TcpListener,
    what: &'static str,
) -> (tokio::net::TcpStream, std::net::SocketAddr) {
    loop {
        match listener.accept().await {
            Ok(accepted) => return accepted,
            Err(e) => {
                tracing::warn!(error = %e, "{what} accept failed");
                tokio::time::sleep(ACCEPT_RETRY).await;
            }
        }
    }
}

/// The bounds every accepted connection of one listener gets.
#[derive(Clone, Copy, Debug)]
pub(crate) struct ConnLimits {
    /// Connections held at once.
    pub max_connections: usize,
    /// Longest silence (no byte read), and longest time the server's writes may stay blocked.
    pub idle_timeout: Duration,
    /// Bytes of gRPC requests one connection may have in flight, their header blocks
    /// included.
    pub request_bytes: usize,
    /// Largest header block of one gRPC call (HTTP/2's SETTINGS_MAX_HEADER_LIST_SIZE).
    pub max_header_bytes: u32,
    /// How long a connection lives (`None`: as long as its client keeps it).
    pub(crate) age: Option<ConnectionAge>,
}

/// `--grpc-max-connection-age`: a gRPC connection is sent GOAWAY at about `age` (each
/// connection's own age is drawn within ±[`AGE_JITTER`] of it, so a fleet of Envoys that
/// connected together does not reconnect together), its streams in flight may go on for
/// `grace`, then it is closed. Envoy opens a new connection for its next request, which the
/// Service in front of the replicas may send to one that started since: without an age, the
/// long-lived HTTP/2 connections of Envoy stay on the replicas that were there first.
#[derive(Clone, Copy, Debug)]
pub(crate) struct ConnectionAge {
    /// The mean age at which a connection is sent GOAWAY.
    pub(crate) age: Duration,
    /// How long its streams may go on after the GOAWAY before the connection is closed.
    pub(crate) grace: Duration,
}

/// How far a connection's age strays from `--grpc-max-connection-age`, either way (gRPC's own
/// servers use the same ±10%).
pub(crate) const AGE_JITTER: f64 = 0.1;

/// Connection ages are drawn from this many values evenly spread over the jitter's range: the
/// gRPC server runs one loop per value, each keeping its connections' age (tonic has one age
/// per server). 16 puts ±10% of 30 minutes in steps of about 22 seconds.
pub(crate) const AGE_LANES: usize = 16;

impl ConnectionAge {
    /// The age of the connections in lane `lane` of [`AGE_LANES`].
    pub(crate) fn of_lane(self, lane: usize) -> Duration {
        let spread = (lane as f64 + 0.5) / AGE_LANES as f64;
        self.age
            .mul_f64(1.0 - AGE_JITTER + 2.0 * AGE_JITTER * spread)
    }
}

/// The lane of each next connection: a golden-ratio sequence, which spreads connections that
/// arrive together over every lane, from a start drawn at random per process so that replicas
/// do not share it.
struct Lanes(AtomicU64);

impl Lanes {
    fn new() -> Self {
        use std::hash::BuildHasher;
        Lanes(AtomicU64::new(
            std::collections::hash_map::RandomState::new().hash_one(0u8),
        ))
    }

    fn next(&self) -> usize {
        const STEP: u64 = 0x9E37_79B9_7F4A_7C15;
        let at = self.0.fetch_add(STEP, Ordering::Relaxed).wrapping_add(STEP);
        // The top 32 bits scaled to the lane count: always below it.
        (((at >> 32) * AGE_LANES as u64) >> 32) as usize
    }
}

/// The age lane a connection was given when admitted (0 without an age).
pub(crate) trait InLane {
    /// Its lane, below [`AGE_LANES`].
    fn lane(&self) -> usize;
}

impl<IO> InLane for Tracked<IO> {
    fn lane(&self) -> usize {
        self.lane
    }
}

/// Admits connections to one listener within its [`ConnLimits`].
#[derive(Clone)]
pub(crate) struct Tracker {
    limits: ConnLimits,
    open: Arc<AtomicUsize>,
    lanes: Arc<Lanes>,
}

impl Tracker {
    /// A listener's tracker.
    pub(crate) fn new(limits: ConnLimits) -> Tracker {
        Tracker {
            limits,
            open: Arc::new(AtomicUsize::new(0)),
            lanes: Arc::new(Lanes::new()),
        }
    }

    /// `io` tracked, or `None` (and `io` dropped, so closed) when the listener is full.
    pub(crate) fn admit<IO>(&self, io: IO) -> Option<Tracked<IO>> {
        let held = self.open.fetch_add(1, Ordering::AcqRel);
        let slot = Slot(self.open.clone());
        if held >= self.limits.max_connections {
            tracing::debug!(held, "connection refused: the listener is full");
            return None;
        }
        let idle = self.limits.idle_timeout;
        let now = Instant::now();
        let (lane, closes_at) = match self.limits.age {
            Some(age) => {
                let lane = self.lanes.next();
                (lane, Some(now + age.of_lane(lane) + age.grace))
            }
            None => (0, None),
        };
        Some(Tracked {
            io,
            idle,
            lane,
            closes_at,
            last_read: now,
            read_deadline: Box::pin(tokio::time::sleep_until(
                closes_at.map_or(now + idle, |at| at.min(now + idle)),
            )),
            read_armed: None,
            write_blocked: None,
            read_parked: false,
            write_deadline: Box::pin(tokio::time::sleep(idle)),
            info: ConnInfo {
                budget: Arc::new(RequestBudget {
                    max: self.limits.request_bytes,
                    used: AtomicUsize::new(0),
                }),
                rlqs_bytes: Arc::default(),
            },
            _slot: slot,
        })
    }
}

/// Gives a connection's place back when it closes.
struct Slot(Arc<AtomicUsize>);

impl Drop for Slot {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

/// An accepted socket under its listener's bounds.
pub(crate) struct Tracked<IO> {
    io: IO,
    idle: Duration,
    /// Its age lane.
    lane: usize,
    /// When its age and grace are over.
    closes_at: Option<Instant>,
    last_read: Instant,
    read_deadline: Pin<Box<Sleep>>,
    /// The waker `read_deadline` was last polled with. While the task's waker is this one the
    /// timer will wake it when it fires, so a pending read need not poll the timer again (a
    /// poll of tokio's timer registers the waker anew, on every read: docs/performance.md,
    /// "Measurements behind the code").
    read_armed: Option<Waker>,
    /// Since when the server's writes have been blocked.
    write_blocked: Option<Instant>,
    /// A read was refused while writes were blocked: the task must be woken to read again
    /// once they go through, as nothing else would wake it for the bytes waiting.
    read_parked: bool,
    write_deadline: Pin<Box<Sleep>>,
    info: ConnInfo,
    _slot: Slot,
}

/// What the request layer learns of a connection (tonic puts it in each request's extensions).
#[derive(Clone)]
pub(crate) struct ConnInfo {
    budget: Arc<RequestBudget>,
    /// Bytes of RLQS state this connection's streams hold (see `server::rlqs`).
    rlqs_bytes: Arc<AtomicUsize>,
}

impl ConnInfo {
    /// The connection's, from a request's extensions (plain or TLS).
    pub(crate) fn of(ext: &http::Extensions) -> Option<&ConnInfo> {
        ext.get::<ConnInfo>().or_else(|| {
            ext.get::<tonic::transport::server::TlsConnectInfo<ConnInfo>>()
                .map(|i| i.get_ref())
        })
    }

    /// Bytes of RLQS state this connection's streams hold, shared by them.
    pub(crate) fn rlqs_bytes(&self) -> Arc<AtomicUsize> {
        self.rlqs_bytes.clone()
    }
}

fn timed_out(what: &str) -> io::Error {
    io::Error::new(io::ErrorKind::TimedOut, what.to_owned())
}

impl<IO: AsyncRead + Unpin> AsyncRead for Tracked<IO> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = &mut *self;
        // While the peer leaves our writes blocked, read nothing more from it: a client that
        // never reads cannot make the server take in (and queue answers or resets for) ever
        // more of its requests. The connection's one task is woken when writing can go on.
        if this.write_blocked.is_some() {
            if this.write_stalled(cx) {
                return Poll::Ready(Err(timed_out("the peer reads nothing")));
            }
            this.read_parked = true;
            return Poll::Pending;
        }
        let before = buf.filled().len();
        match Pin::new(&mut this.io).poll_read(cx, buf) {
            Poll::Ready(r) => {
                // The timer also keeps the age (below): one that has fired since it was last
                // moved is the only time a busy connection's clock need be read for it.
                if this.read_deadline.is_elapsed() && this.aged() {
                    return Poll::Ready(Err(timed_out("the connection's age and grace are over")));
                }
                if buf.filled().len() > before {
                    this.last_read = Instant::now();
                }
                Poll::Ready(r)
            }
            Poll::Pending => {
                let armed = this
                    .read_armed
                    .as_ref()
                    .is_some_and(|w| w.will_wake(cx.waker()));
                if armed && !this.read_deadline.is_elapsed() {
                    return Poll::Pending;
                }
                // The timer is moved only when it fires: no timer work per read.
                while this.read_deadline.as_mut().poll(cx).is_ready() {
                    if this.aged() {
                        return Poll::Ready(Err(timed_out(
                            "the connection's age and grace are over",
                        )));
                    }
                    let until = this.last_read + this.idle;
                    if Instant::now() >= until {
                        return Poll::Ready(Err(timed_out("the peer sent nothing")));
                    }
                    this.read_deadline
                        .as_mut()
                        .reset(this.closes_at.map_or(until, |at| at.min(until)));
                }
                this.read_armed = Some(cx.waker().clone());
                Poll::Pending
            }
        }
    }
}

impl<IO> Tracked<IO> {
    /// Whether the connection's age and grace are over.
    fn aged(&self) -> bool {
        self.closes_at.is_some_and(|at| Instant::now() >= at)
    }

    /// Whether the server's writes have been blocked for the idle timeout (and, until then, a
    /// wake-up when they will have been).
    fn write_stalled(&mut self, cx: &mut Context<'_>) -> bool {
        self.write_blocked.is_some_and(|since| {
            self.write_deadline.as_mut().poll(cx).is_ready() && since.elapsed() >= self.idle
        })
    }
}

impl<IO: AsyncWrite + Unpin> Tracked<IO> {
    /// Notes whether a write went through; a peer that blocks them past the idle timeout is
    /// cut off.
    fn written<T>(&mut self, cx: &mut Context<'_>, r: Poll<io::Result<T>>) -> Poll<io::Result<T>> {
        match r {
            Poll::Ready(r) => {
                self.write_blocked = None;
                if std::mem::take(&mut self.read_parked) {
                    // The read refused above registered no interest in the socket: an HTTP/2
                    // connection that flushes after a pending read would otherwise sleep, its
                    // peer's requests unread, until something else woke it.
                    cx.waker().wake_by_ref();
                }
                Poll::Ready(r)
            }
            Poll::Pending => {
                if self.write_blocked.is_none() {
                    let now = Instant::now();
                    self.write_deadline.as_mut().reset(now + self.idle);
                    self.write_blocked = Some(now);
                }
                if self.write_stalled(cx) {
                    return Poll::Ready(Err(timed_out("the peer reads nothing")));
                }
                Poll::Pending
            }
        }
    }
}

impl<IO: AsyncWrite + Unpin> AsyncWrite for Tracked<IO> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let r = Pin::new(&mut self.io).poll_write(cx, buf);
        self.written(cx, r)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let r = Pin::new(&mut self.io).poll_write_vectored(cx, bufs);
        self.written(cx, r)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let r = Pin::new(&mut self.io).poll_flush(cx);
        self.written(cx, r)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_shutdown(cx)
    }
}

impl<IO> tonic::transport::server::Connected for Tracked<IO> {
    type ConnectInfo = ConnInfo;

    fn connect_info(&self) -> ConnInfo {
        self.info.clone()
    }
}

/// The bytes a connection's requests in flight hold, against its bound.
struct RequestBudget {
    max: usize,
    used: AtomicUsize,
}

impl RequestBudget {
    /// Takes `n` bytes if they fit.
    fn reserve(&self, n: usize) -> bool {
        let used = self.used.fetch_add(n, Ordering::AcqRel) + n;
        if used > self.max {
            self.used.fetch_sub(n, Ordering::AcqRel);
            return false;
        }
        true
    }
}

/// One request's share of its connection's budget, given back when its handler has answered
/// (and what its body takes after that, when the body is done); and what the call took, to
/// give back if its answer never goes out.
struct BudgetShare {
    budget: Arc<RequestBudget>,
    /// What its body holds.
    bytes: AtomicUsize,
    /// What its header block holds, until the handler answers.
    headers: AtomicUsize,
    /// What an admitted call took, until its answer has gone out.
    taken: parking_lot::Mutex<Option<(Arc<Engine>, Taken)>>,
}

impl BudgetShare {
    /// A share holding `headers` bytes of header block, or `None` when they do not fit.
    fn new(budget: Arc<RequestBudget>, headers: usize) -> Option<BudgetShare> {
        if !budget.reserve(headers) {
            return None;
        }
        Some(BudgetShare {
            budget,
            bytes: AtomicUsize::new(0),
            headers: AtomicUsize::new(headers),
            taken: parking_lot::Mutex::new(None),
        })
    }

    /// Gives back what the request holds now: its handler has answered.
    fn release(&self) {
        let held = self.bytes.swap(0, Ordering::AcqRel) + self.headers.swap(0, Ordering::AcqRel);
        self.budget.used.fetch_sub(held, Ordering::AcqRel);
    }

    fn take(&self, n: usize) -> bool {
        if !self.budget.reserve(n) {
            return false;
        }
        self.bytes.fetch_add(n, Ordering::AcqRel);
        true
    }
}

impl Drop for BudgetShare {
    fn drop(&mut self) {
        let held = *self.bytes.get_mut() + *self.headers.get_mut();
        self.budget.used.fetch_sub(held, Ordering::AcqRel);
    }
}

/// A gRPC call's way to have what it took given back should its answer never go out: in the
/// request's extensions, for the handler ([`Delivery::on_undelivered`]).
#[derive(Clone)]
pub(crate) struct Delivery(Arc<BudgetShare>);

impl Delivery {
    /// Should the answer being made not go out (the peer resets the stream, or the deadline
    /// passes, before the answer's last frame is handed to HTTP/2), `taken` is given back by
    /// `engine` ([`Engine::undo`]).
    pub(crate) fn on_undelivered(&self, engine: &Arc<Engine>, taken: Taken) {
        *self.0.taken.lock() = Some((engine.clone(), taken));
    }
}

pin_project_lite::pin_project! {
    /// An answer's body: once its last frame (the trailers) has been handed to HTTP/2, the
    /// call's answer has gone out; dropped before that, what the call took is given back. Not
    /// boxed: every answer is one, most with nothing to give back.
    pub(crate) struct Delivered {
        #[pin]
        inner: tonic::body::Body,
        share: Option<Arc<BudgetShare>>,
    }

    impl PinnedDrop for Delivered {
        fn drop(this: Pin<&mut Self>) {
            if let Some(share) = this.project().share.take()
                && let Some((engine, taken)) = share.taken.lock().take()
            {
                engine.undo(taken);
            }
        }
    }
}

impl HttpBody for Delivered {
    type Data = Bytes;
    type Error = tonic::Status;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, tonic::Status>>> {
        let this = self.project();
        let frame = std::task::ready!(this.inner.poll_frame(cx));
        let last = match &frame {
            None => true,
            Some(Ok(f)) => f.is_trailers(),
            Some(Err(_)) => false,
        };
        if last {
            // Handed to HTTP/2: the answer goes out (the race left: a reset that crosses it).
            this.share.take();
        }
        Poll::Ready(frame)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

/// A request's header block in HTTP/2's measure (RFC 9113 §6.5.2: each field's name and value
/// plus 32 bytes), its pseudo-header fields included.
fn header_block_bytes<B>(req: &http::Request<B>) -> usize {
    const FIELD: usize = 32;
    let uri = req.uri();
    let pseudo = req.method().as_str().len()
        + uri.scheme_str().map_or(0, str::len)
        + uri.authority().map_or(0, |a| a.as_str().len())
        + uri.path_and_query().map_or(0, |p| p.as_str().len())
        + 4 * (FIELD + ":method".len());
    req.headers()
        .iter()
        .map(|(name, value)| name.as_str().len() + value.len() + FIELD)
        .sum::<usize>()
        + pseudo
}

/// A request body counted against its connection's budget.
struct CountedBody {
    inner: tonic::body::Body,
    held: Arc<BudgetShare>,
    /// On a long-lived stream of messages (RLQS), where its messages begin and end.
    streaming: Option<Framing>,
    /// How long a stream's message may take to arrive whole.
    message_timeout: Duration,
    /// When the stream's unfinished message must be whole.
    unfinished: Option<Pin<Box<Sleep>>>,
    /// The header block alone did not fit the budget: the body's first poll refuses it.
    headers_over: bool,
}

/// Where a stream of gRPC messages (each a flag byte, a 4-byte big-endian length, then the
/// message) is: how much of an unfinished message has arrived. The decoder reads the body only
/// once it has taken in every complete message before, so what it holds when a frame arrives
/// is the unfinished message's bytes so far, plus the frame.
#[derive(Default)]
struct Framing {
    /// Bytes of the unfinished message received so far (its prefix included); 0 between
    /// messages.
    partial: usize,
    /// Of the 5-byte prefix, the bytes received.
    prefix: [u8; 5],
    /// The message's length, once its prefix is complete.
    length: Option<usize>,
}

impl Framing {
    /// Takes in `data`; what the decoder then holds: the unfinished message's bytes from
    /// before, plus `data`.
    fn read(&mut self, mut data: &[u8]) -> usize {
        let held = self.partial + data.len();
        while !data.is_empty() {
            let n = match self.length {
                None => {
                    let filled = self.partial;
                    let n = (5 - filled).min(data.len());
                    self.prefix[filled..filled + n].copy_from_slice(&data[..n]);
                    if filled + n == 5 {
                        let len = u32::from_be_bytes([
                            self.prefix[1],
                            self.prefix[2],
                            self.prefix[3],
                            self.prefix[4],
                        ]);
                        self.length = Some(len as usize);
                    }
                    n
                }
                Some(len) => (5 + len - self.partial).min(data.len()),
            };
            self.partial += n;
            data = &data[n..];
            if self.length.is_some_and(|len| self.partial == 5 + len) {
                *self = Framing::default();
            }
        }
        held
    }
}

impl HttpBody for CountedBody {
    type Data = Bytes;
    type Error = tonic::Status;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, tonic::Status>>> {
        if std::mem::take(&mut self.headers_over) {
            return Poll::Ready(Some(Err(tonic::Status::resource_exhausted(format!(
                "this connection's requests in flight would hold more than {} bytes",
                self.held.budget.max
            )))));
        }
        if let Some(deadline) = &mut self.unfinished
            && deadline.as_mut().poll(cx).is_ready()
        {
            self.unfinished = None;
            return Poll::Ready(Some(Err(tonic::Status::deadline_exceeded(format!(
                "a message of this stream did not arrive whole within {:?}",
                self.message_timeout
            )))));
        }
        let frame = std::task::ready!(Pin::new(&mut self.inner).poll_frame(cx));
        let this = &mut *self;
        let data = match &frame {
            Some(Ok(f)) => f.data_ref(),
            _ => None,
        };
        // A stream gives back what it held for the frame before (taken in by now) and holds
        // its unfinished message with this frame; a unary request holds all it sent.
        let take = match (&mut this.streaming, data) {
            (Some(framing), data) => {
                let before = this.held.bytes.swap(0, Ordering::AcqRel);
                this.held.budget.used.fetch_sub(before, Ordering::AcqRel);
                let held = data.map(|d| framing.read(d));
                // The deadline runs from an unfinished message's first byte until it is whole.
                if framing.partial == 0 {
                    this.unfinished = None;
                } else if this.unfinished.is_none() {
                    this.unfinished = Some(Box::pin(tokio::time::sleep(this.message_timeout)));
                }
                held
            }
            (None, data) => data.map(|d| d.len()),
        };
        if let Some(n) = take
            && !this.held.take(n)
        {
            return Poll::Ready(Some(Err(tonic::Status::resource_exhausted(format!(
                "this connection's requests in flight would hold more than {} bytes",
                self.held.budget.max
            )))));
        }
        Poll::Ready(frame)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

/// The one method whose request is a long-lived stream of messages (RLQS).
const STREAMING_METHOD: &str = "/StreamRateLimitQuotas";

/// Counts each gRPC request against its connection's request-byte budget; a stream's message
/// must arrive whole within `message_timeout` (the request deadline).
#[derive(Clone, Copy, Debug)]
pub(crate) struct BudgetLayer {
    pub(crate) message_timeout: Duration,
}

impl<S> tower::Layer<S> for BudgetLayer {
    type Service = Budgeted<S>;

    fn layer(&self, inner: S) -> Budgeted<S> {
        Budgeted {
            inner,
            message_timeout: self.message_timeout,
        }
    }
}

/// See [`BudgetLayer`].
#[derive(Clone, Debug)]
pub(crate) struct Budgeted<S> {
    inner: S,
    message_timeout: Duration,
}

type HttpRequest = http::Request<tonic::body::Body>;

type HttpResponse = http::Response<tonic::body::Body>;

impl<S> tower::Service<HttpRequest> for Budgeted<S>
where
    S: tower::Service<HttpRequest, Response = HttpResponse> + Send,
    S::Future: Send + 'static,
{
    type Response = http::Response<Delivered>;
    type Error = S::Error;
    type Future = Answer<S::Future>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, mut req: HttpRequest) -> Self::Future {
        let budget = ConnInfo::of(req.extensions()).map(|i| i.budget.clone());
        let Some(budget) = budget else {
            return Answer {
                inner: self.inner.call(req),
                held: None,
            };
        };
        // The header block h2 decoded is held while the call is: counted with its body, so
        // that calls in flight hold at most the budget, headers and all.
        let (held, over) = match BudgetShare::new(budget.clone(), header_block_bytes(&req)) {
            Some(share) => (share, false),
            None => (BudgetShare::new(budget, 0).expect("nothing to take"), true),
        };
        let held = Arc::new(held);
        let body_held = held.clone();
        req.extensions_mut().insert(Delivery(held.clone()));
        let message_timeout = self.message_timeout;
        let streaming = req
            .uri()
            .path()
            .ends_with(STREAMING_METHOD)
            .then(Framing::default);
        let req = req.map(|inner| {
            tonic::body::Body::new(CountedBody {
                inner,
                held: body_held,
                streaming,
                message_timeout,
                unfinished: None,
                headers_over: over,
            })
        });
        Answer {
            inner: self.inner.call(req),
            held: Some(held),
        }
    }
}

pin_project_lite::pin_project! {
    /// A budgeted request's answer: the request's bytes stay held until it is answered (or
    /// dropped). A named future, not a boxed one: no allocation per request.
    pub(crate) struct Answer<F> {
        #[pin]
        inner: F,
        held: Option<Arc<BudgetShare>>,
    }
}

impl<F, E> Future for Answer<F>
where
    F: Future<Output = Result<HttpResponse, E>>,
{
    type Output = Result<http::Response<Delivered>, E>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.project();
        let answer = std::task::ready!(this.inner.poll(cx));
        // Only a call that took something waits for its answer to go out.
        let share = this.held.take().and_then(|held| {
            held.release();
            let armed = held.taken.lock().is_some();
            armed.then_some(held)
        });
        Poll::Ready(answer.map(|response| response.map(|inner| Delivered { inner, share })))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::task::{Wake, Waker};
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    /// Connections arriving together are spread over every lane, each lane's age within the
    /// jitter, the lowest and highest at its two ends.
    #[test]
    fn connections_are_spread_evenly_over_ages_within_the_jitter() {
        let lanes = Lanes::new();
        let mut count = [0usize; AGE_LANES];
        // Any 16 in a row visit at least 12 lanes; 1600 fill each within 10% of its share.
        let first: std::collections::HashSet<usize> = (0..16).map(|_| lanes.next()).collect();
        assert!(first.len() >= 12, "{first:?}");
        for _ in 0..1600 {
            count[lanes.next()] += 1;
        }
        assert!(count.iter().all(|c| (90..=110).contains(c)), "{count:?}");
        let age = ConnectionAge {
            age: Duration::from_secs(1000),
            grace: Duration::ZERO,
        };
        let ages: Vec<Duration> = (0..AGE_LANES).map(|l| age.of_lane(l)).collect();
        assert!(ages.windows(2).all(|w| w[0] < w[1]), "{ages:?}");
        assert!(ages[0] >= Duration::from_secs(900) && ages[0] < Duration::from_secs(910));
        let last = ages[AGE_LANES - 1];
        assert!(last <= Duration::from_secs(1100) && last > Duration::from_secs(1090));
    }

    /// What a stream's decoder holds as frames arrive, cut anywhere: the unfinished message
    /// so far plus the frame; nothing of a message once it is complete.
    #[test]
    fn a_stream_holds_its_unfinished_message_and_the_frame() {
        let message = |len: usize| {
            let mut m = vec![0u8];
            m.extend_from_slice(&(len as u32).to_be_bytes());
            m.resize(5 + len, 7);
            m
        };
        let mut f = Framing::default();
        // Two whole messages in one frame: nothing left over.
        let two = [message(3), message(0)].concat();
        assert_eq!(f.read(&two), two.len());
        assert_eq!(f.partial, 0);
        // A 100-byte message in pieces, its prefix split too.
        let m = message(100);
        assert_eq!(f.read(&m[..2]), 2);
        assert_eq!(f.read(&m[2..50]), 50);
        assert_eq!(f.read(&m[50..104]), 104);
        // Its last byte, and the start of the next.
        let next = message(10);
        let frame = [&m[104..], &next[..6]].concat();
        assert_eq!(f.read(&frame), 104 + 7);
        assert_eq!(f.partial, 6, "only the next message's start is unfinished");
        assert_eq!(f.read(&next[6..]), 6 + 9);
        assert_eq!(f.partial, 0);
    }

    /// Counts its wake-ups: how an executor learns a task must be polled again.
    #[derive(Default)]
    struct Wakes(AtomicUsize);

    impl Wake for Wakes {
        fn wake(self: Arc<Self>) {
            self.0.fetch_add(1, Ordering::SeqCst);
        }
    }

    /// One poll of a connection the way h2 drives it: read until a read is pending, then flush
    /// what is waiting to be written. What was read, if anything.
    fn drive<IO: AsyncRead + AsyncWrite + Unpin>(
        io: &mut Tracked<IO>,
        out: &mut Vec<u8>,
        cx: &mut Context<'_>,
    ) -> Option<Vec<u8>> {
        let mut buf = [0u8; 64];
        let mut read = ReadBuf::new(&mut buf);
        if let Poll::Ready(r) = Pin::new(&mut *io).poll_read(cx, &mut read) {
            r.expect("a read");
            return Some(read.filled().to_vec());
        }
        while !out.is_empty() {
            match Pin::new(&mut *io).poll_write(cx, out) {
                Poll::Ready(n) => drop(out.drain(..n.expect("a write"))),
                Poll::Pending => break,
            }
        }
        None
    }

    /// A read refused while the peer left our writes blocked registers no interest in the
    /// socket; once the writes go through, the connection's task must be woken to read what
    /// the peer sent meanwhile, or it sleeps with requests unread until something else wakes it.
    #[tokio::test]
    async fn a_read_refused_while_writes_were_blocked_is_retried_once_they_go_through() {
        let limits = ConnLimits {
            max_connections: 1,
            idle_timeout: Duration::from_secs(60),
            request_bytes: 1 << 20,
            max_header_bytes: 16 << 10,
            age: None,
        };
        let (ours, mut peer) = tokio::io::duplex(64);
        let mut io = Tracker::new(limits).admit(ours).expect("admitted");
        let wakes = Arc::new(Wakes::default());
        let waker = Waker::from(wakes.clone());
        let mut cx = Context::from_waker(&waker);
        let mut out = vec![7u8; 128];
        // Nothing to read; half the answer fits, the rest waits for the peer to read.
        assert_eq!(drive(&mut io, &mut out, &mut cx), None);
        assert_eq!(out.len(), 64);
        // The peer sends a request (a wake-up) that is not read while our writes are blocked.
        peer.write_all(b"hello").await.unwrap();
        assert_eq!(drive(&mut io, &mut out, &mut cx), None);
        // The peer reads: the rest of the answer goes through in the next poll.
        let mut answer = [0u8; 64];
        peer.read_exact(&mut answer).await.unwrap();
        let before = wakes.0.load(Ordering::SeqCst);
        assert_eq!(drive(&mut io, &mut out, &mut cx), None);
        assert!(out.is_empty());
        assert!(
            wakes.0.load(Ordering::SeqCst) > before,
            "the task was left asleep with the peer's request unread"
        );
        assert_eq!(
            drive(&mut io, &mut out, &mut cx).as_deref(),
            Some(&b"hello"[..])
        );
    }
}
