//! RLQS (`envoy.service.rate_limit_quota.v3.RateLimitQuotaService`): Envoy's quota protocol
//! over the same config as RLS. One task per stream holds the stream's buckets; the quota
//! pools (`rlqs::Pools`) decide what each gets. The protocol stops here: `rlqs` sees entries,
//! demands and grants.
//!
//! Bounds per stream: its buckets (`--rlqs-max-buckets`, then RESOURCE_EXHAUSTED), each at most
//! `--max-entries` pairs of `--max-key-bytes`/`--max-value-bytes` (else the entry is skipped and
//! counted, never the stream ended: Envoy would drop every bucket and resend the same entry),
//! answers queued (a few messages; a client that reads none for [`SEND_TIMEOUT`] is dropped).
//! In bytes: every bucket is charged what it holds ([`charge`]) against the process's
//! `--rlqs-max-bytes` and its connection's quarter of it (which bounds each of the connection's
//! streams too); a new bucket past either is skipped and counted (`over_budget`), and the
//! buckets held keep working. A bucket's id is kept once: its sorted pairs, shared with the
//! stream's index, and made into a `BucketId` again only to answer.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::Duration;

use arc_swap::ArcSwap;
use futures_util::future::join_all;
use envoy_types::pb::envoy::r#type::v3::rate_limit_strategy::{BlanketRule, Strategy};
use envoy_types::pb::envoy::r#type::v3::{RateLimitStrategy, TokenBucket};
use envoy_types::pb::envoy::service::rate_limit_quota::v3::rate_limit_quota_response::bucket_action::{
    self, AbandonAction, QuotaAssignmentAction,
};
use envoy_types::pb::envoy::service::rate_limit_quota::v3::rate_limit_quota_response::BucketAction;
use envoy_types::pb::envoy::service::rate_limit_quota::v3::{BucketId, RateLimitQuotaResponse};
use envoy_types::pb::google::protobuf::{Duration as PbDuration, UInt32Value};
use tokio::sync::mpsc;
use tokio::time::Instant;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Code, Request, Response, Status, Streaming};

use crate::config::Snapshot;
use crate::engine::RequestLimits;
use crate::limiter::BoxFuture;
use crate::limiter::key::KeyFormat;
use crate::metrics::{ModeLabels, NameLabels, RlqsMetrics, at_zero};
use crate::rlqs::{
    self, Ask, Assignment, BucketOptions, BucketRule, ParticipantId, Pools, Signal, Usage,
};
use crate::server::conn::ConnInfo;
use crate::server::wire::rate_limit_quota_service_server::RateLimitQuotaService;
use crate::server::wire::{BucketUsage, UsageReports};

/// Answers a stream may have waiting for the client.
const QUEUE: usize = 4;
/// A client that takes no answer for this long is dropped (its leases run out as usual).
const SEND_TIMEOUT: Duration = Duration::from_secs(30);
/// How often a stream looks for a new config (a reload reaches its buckets within this).
const CONFIG_CHECK: Duration = Duration::from_secs(1);
/// Reports claiming less time than this are measured on the server's clock instead.
const MIN_ELAPSED: Duration = Duration::from_millis(10);
/// Pushes of moved shares a stream sends at once; more wait [`PUSH_TICK`]. When one large
/// report moves every share of a pool of 30,000, pushing them all is linear work that cannot be
/// avoided: this spreads it (at most 2,560 pushes a second per stream) and lets a bucket that
/// moves again meanwhile be pushed once.
const PUSHES: usize = 256;
/// How long pushes past [`PUSHES`] wait.
const PUSH_TICK: Duration = Duration::from_millis(100);
/// Buckets a stream handles before it hands its worker thread back: a report (or a close, or
/// a reload) of 10,000 buckets never holds a thread that RLS requests are waiting for longer
/// than this many buckets take (figures: docs/performance.md, "Measurements behind the code").
const SLICE: usize = 32;
/// Assignments sent in one message at most: a message per slice raised the RLS tail beside a large
/// report and the CPU it cost; messages this large did not (docs/performance.md, "Measurements
/// behind the code").
const MESSAGE_ACTIONS: usize = 1024;
/// How long decided assignments may wait to fill a message: far less than the second a lease
/// outlasts its TTL (`rlqs::LEASE_GRACE`).
const HOLD_AT_MOST: Duration = Duration::from_millis(100);

/// What every stream shares.
pub(crate) struct ServiceState {
    pub(crate) config: Arc<ArcSwap<Snapshot>>,
    pub(crate) pools: Pools,
    pub(crate) keys: KeyFormat,
    pub(crate) options: BucketOptions,
    pub(crate) limits: RequestLimits,
    pub(crate) global_shadow: bool,
    pub(crate) metrics: RlqsMetrics,
    next_id: AtomicU64,
    /// Bytes every stream's buckets are charged, together.
    bytes: AtomicUsize,
}

/// The RLQS gRPC service.
#[derive(Clone)]
pub(crate) struct RlqsService {
    shared: Arc<ServiceState>,
    apart: Arc<Apart>,
}

/// The thread every RLQS stream's work (and the sweep of the pools) runs on, apart from the
/// workers that answer RLS; only reading and decoding a stream's reports stays on the workers
/// (see [`read`]). Handling a report of 10,000 buckets, a pool's rebalance or the pushes that
/// follow are CPU work that RLS requests must never queue behind: on a thread of its own, at
/// a lower scheduling priority (nice +10), the kernel hands the cores to an RLS worker the
/// moment it has a request, and gives RLQS what is left. One thread: RLQS is a few Envoys
/// reporting every few seconds, not a request path.
struct Apart {
    handle: tokio::runtime::Handle,
    /// Dropped with the last clone of the service: the thread's runtime then stops, dropping
    /// the streams still on it.
    _stop: tokio::sync::oneshot::Sender<()>,
}

/// The nice value of the RLQS thread (0 is the default; 19 the lowest priority).
const NICENESS: i32 = 10;

impl Apart {
    fn start() -> std::io::Result<Apart> {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?;
        let handle = runtime.handle().clone();
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        std::thread::Builder::new()
            .name("rlqs".into())
            .spawn(move || {
                if let Err(e) =
                    rustix::process::setpriority_process(Some(rustix::thread::gettid()), NICENESS)
                {
                    tracing::warn!(error = %e, "the RLQS thread keeps the default priority");
                }
                runtime.block_on(async {
                    let _ = stopped.await;
                });
            })?;
        Ok(Apart {
            handle,
            _stop: stop,
        })
    }
}

/// How the RLQS service works: its pools' options, and what it shares with the engine.
pub(crate) struct RlqsOptions {
    /// Leases, reports, buckets and bytes.
    pub(crate) buckets: BucketOptions,
    /// How counter keys are built (a bucket's pool is named after its limit's counter).
    pub(crate) keys: KeyFormat,
    /// Size bounds on a bucket id, as on a request's descriptor.
    pub(crate) limits: RequestLimits,
    /// Every limit in shadow mode (`--shadow-mode`).
    pub(crate) global_shadow: bool,
}

impl RlqsService {
    /// The service, its own thread started, deciding buckets against `config` with `quota`'s
    /// pools.
    pub(crate) fn new(
        config: Arc<ArcSwap<Snapshot>>,
        pools: Pools,
        RlqsOptions {
            buckets: options,
            keys,
            limits,
            global_shadow,
        }: RlqsOptions,
        metrics: RlqsMetrics,
    ) -> std::io::Result<RlqsService> {
        let kind = |kind| NameLabels { kind };
        at_zero(
            &metrics.assignments,
            ["allow_all", "deny_all", "token_bucket"].map(kind),
        );
        at_zero(
            &metrics.skipped,
            [
                "empty_key_or_value",
                "no_bucket_id",
                "not_utf8",
                "too_long",
                "too_many_pairs",
                "over_budget",
            ]
            .map(kind),
        );
        // The failure mode's only with Redis pools.
        if let Pools::InRedis { failure, .. } = &pools {
            at_zero(
                &metrics.failure_mode_decisions,
                [failure.as_str(), "error"].map(|mode| ModeLabels { mode }),
            );
        }
        let service = RlqsService {
            apart: Arc::new(Apart::start()?),
            shared: Arc::new(ServiceState {
                config,
                pools,
                keys,
                options,
                limits,
                global_shadow,
                metrics,
                next_id: AtomicU64::new(1),
                bytes: AtomicUsize::new(0),
            }),
        };
        service
            .apart
            .handle
            .spawn(sweep_forever(service.shared.clone()));
        Ok(service)
    }
}

/// Drops expired leases now and then, so pools nobody reports on go away.
async fn sweep_forever(shared: Arc<ServiceState>) {
    let mut every = tokio::time::interval(CONFIG_CHECK);
    loop {
        every.tick().await;
        shared.pools.sweep(Instant::now());
        shared.metrics.pools.set(shared.pools.len() as i64);
    }
}

#[tonic::async_trait]
impl RateLimitQuotaService for RlqsService {
    type StreamRateLimitQuotasStream = ReceiverStream<Result<RateLimitQuotaResponse, Status>>;

    async fn stream_rate_limit_quotas(
        &self,
        request: Request<Streaming<UsageReports>>,
    ) -> Result<Response<Self::StreamRateLimitQuotasStream>, Status> {
        let (tx, rx) = mpsc::channel(QUEUE);
        // Shared by the connection's streams; a request without one (never, over a listener)
        // gets its own.
        let conn_bytes = ConnInfo::of(request.extensions())
            .map(ConnInfo::rlqs_bytes)
            .unwrap_or_default();
        let stream = RlqsStream::new(self.shared.clone(), conn_bytes, tx);
        let (reports_tx, reports) = mpsc::channel(1);
        tokio::spawn(read(request.into_inner(), reports_tx));
        self.apart.handle.spawn(stream.run(reports));
        Ok(Response::new(ReceiverStream::new(rx)))
    }
}

/// What the reader hands a stream's task: a decoded report, the end of the stream (`None`),
/// or why it could not be read.
type Inbound = Result<Option<UsageReports>, Status>;

/// Reads and decodes a stream's reports on the server's workers, as every request body is
/// read (the connection's byte budget and the message deadline act there, at the pace the
/// connection delivers), and hands them one at a time to the stream's task on the RLQS thread.
/// Ends when the stream does, or when its task has (the client may hold its side open).
async fn read(mut inbound: Streaming<UsageReports>, reports: mpsc::Sender<Inbound>) {
    loop {
        let message = tokio::select! {
            m = inbound.message() => m,
            () = reports.closed() => return,
        };
        let more = matches!(message, Ok(Some(_)));
        if reports.send(message).await.is_err() || !more {
            return;
        }
    }
}

/// One pair of a bucket id.
type Pair = (Box<str>, Box<str>);

/// A bucket id's pairs, sorted: the bucket's identity within a stream, kept once (the bucket
/// and the stream's index share it).
type BucketKey = Arc<[Pair]>;

/// Bytes a bucket holds beyond its pairs and its pools: the bucket, its index entry and its
/// task's share of the stream's maps. With [`POOL_BYTES`], what a daemon's resident memory
/// grows by per bucket of its own pool (tests/rlqs.rs measures 1.9 KB; a bucket sharing a pool
/// costs less and is charged the same).
const BUCKET_BYTES: usize = 640;
/// Per pair: its two boxed strings.
const PAIR_BYTES: usize = 32;
/// Per pool the bucket takes part in, beyond the pool's key: the pool, its member entry and
/// lease.
const POOL_BYTES: usize = 1152;

/// What a bucket of `key` mapped to `target` is charged.
fn charge(key: &[Pair], target: &BucketRule) -> usize {
    let pairs: usize = key
        .iter()
        .map(|(k, v)| k.len() + v.len() + PAIR_BYTES)
        .sum();
    let pools = match target {
        BucketRule::LocalPools { pools, .. } => {
            pools.iter().map(|p| p.key.len() + POOL_BYTES).sum()
        }
        BucketRule::Allow | BucketRule::Deny => 0,
    };
    BUCKET_BYTES + pairs + pools
}

/// The protocol's form of a bucket's id.
fn id_of(key: &[Pair]) -> BucketId {
    BucketId {
        bucket: key
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect(),
    }
}

struct Bucket {
    key: BucketKey,
    target: BucketRule,
    /// What it is charged (see [`charge`]).
    charge: usize,
    /// When its requests were last reported non-zero (or it was created).
    last_used: Instant,
    /// When it was last reported.
    last_report: Instant,
}

/// One stream's state, owned by its task.
struct RlqsStream {
    shared: Arc<ServiceState>,
    domain: Option<String>,
    buckets: HashMap<ParticipantId, Bucket>,
    by_key: HashMap<BucketKey, ParticipantId>,
    signal: Arc<Signal>,
    /// The snapshot the buckets were mapped against.
    snapshot: Arc<Snapshot>,
    /// Bytes its connection's streams are charged, together.
    conn_bytes: Arc<AtomicUsize>,
    /// Bytes its buckets are charged.
    held: usize,
    /// Its answers, to the client.
    out: mpsc::Sender<Result<RateLimitQuotaResponse, Status>>,
    /// The client stopped reading its answers (or left): the stream ends.
    gone: bool,
}

/// An entry's bucket id as sorted pairs, or why the entry is skipped. The id's strings are
/// taken, not copied: decoded at their length, they become the pairs as they are, so a
/// bucket held keeps the very bytes decoded and leaves no freed copy behind.
fn fault(usage: &mut BucketUsage, limits: &RequestLimits) -> Result<Vec<Pair>, &'static str> {
    // A bucket id with no pairs names no bucket, as an absent one.
    let Some(id) = usage.bucket_id.take().filter(|id| !id.bucket.is_empty()) else {
        return Err("no_bucket_id");
    };
    if id.bucket.len() > limits.max_entries {
        return Err("too_many_pairs");
    }
    // A map on the wire: a key sent twice keeps its last value, as protobuf's decoders keep it
    // (and as envoy-types' map did). Sorted by key, stably, the last sent first, then deduped.
    let mut sent = id.bucket;
    sent.reverse();
    sent.sort_by(|a, b| a.key.cmp(&b.key));
    sent.dedup_by(|later, kept| later.key == kept.key);
    let mut pairs = Vec::with_capacity(sent.len());
    for pair in sent {
        let (k, v) = (pair.key, pair.value);
        if k.is_empty() || v.is_empty() {
            return Err("empty_key_or_value");
        }
        // A key is Envoy's configuration's; a value, a client's, is kept whole however long
        // (the bucket is charged for it), as it must be sent back the same.
        if k.len() > limits.max_key_bytes {
            return Err("too_long");
        }
        // Envoy's protobuf refuses a string that is not UTF-8 when it parses an answer: such
        // a bucket cannot be answered, and follows the filter's `no_assignment_behavior`.
        let (Ok(k), Ok(v)) = (String::from_utf8(k), String::from_utf8(v)) else {
            return Err("not_utf8");
        };
        pairs.push((k.into_boxed_str(), v.into_boxed_str()));
    }
    // Sorted already: by key, each key once (bytes order is UTF-8 text's order).
    Ok(pairs)
}

impl RlqsStream {
    fn new(
        shared: Arc<ServiceState>,
        conn_bytes: Arc<AtomicUsize>,
        out: mpsc::Sender<Result<RateLimitQuotaResponse, Status>>,
    ) -> RlqsStream {
        shared.metrics.streams.inc();
        let snapshot = shared.config.load_full();
        RlqsStream {
            shared,
            domain: None,
            buckets: HashMap::new(),
            by_key: HashMap::new(),
            signal: Arc::new(Signal::default()),
            snapshot,
            conn_bytes,
            held: 0,
            out,
            gone: false,
        }
    }

    async fn run(mut self, mut inbound: mpsc::Receiver<Inbound>) {
        // Set while moved buckets wait for their turn to be pushed (see `PUSHES`).
        let mut push_after: Option<Instant> = None;
        let mut config_check = tokio::time::interval(CONFIG_CHECK);
        config_check.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            // Each handler sends its answers as it decides them; an error ends the stream.
            let answer = tokio::select! {
                message = inbound.recv() => match message {
                    Some(Ok(Some(reports))) => self.on_reports(reports).await,
                    Some(Ok(None)) | None => break,
                    // A report that does not decode (or another fault of the client's stream)
                    // ends the stream with what went wrong, not with OK; a client that reset
                    // the stream hears nothing either way.
                    Some(Err(status)) => {
                        tracing::debug!(%status, "RLQS stream failed");
                        // Over its connection's budget stays RESOURCE_EXHAUSTED, a message too
                        // slow to arrive DEADLINE_EXCEEDED; anything else was malformed.
                        let code = match status.code() {
                            c @ (Code::ResourceExhausted | Code::DeadlineExceeded) => c,
                            _ => Code::InvalidArgument,
                        };
                        let why = Status::new(code, format!(
                            "the RLQS stream could not be read: {}",
                            status.message()
                        ));
                        let _ = self.out.send_timeout(Err(why), SEND_TIMEOUT).await;
                        break;
                    }
                },
                () = self.signal.notify.notified(), if push_after.is_none() => {
                    self.on_moved(&mut push_after).await;
                    Ok(())
                }
                () = tokio::time::sleep_until(push_after.unwrap_or_else(Instant::now)),
                    if push_after.is_some() =>
                {
                    push_after = None;
                    self.on_moved(&mut push_after).await;
                    Ok(())
                }
                _ = config_check.tick() => {
                    self.on_config_check().await;
                    Ok(())
                }
            };
            if let Err(status) = answer {
                let _ = self.out.send_timeout(Err(status), SEND_TIMEOUT).await;
                break;
            }
            if self.gone {
                break;
            }
        }
        self.close().await;
    }

    /// Sends what `told` says of each bucket (`None`: abandoned) as one message. Each
    /// assignment's TTL is what is left of its lease as the message leaves (whole seconds, at
    /// most `--rlqs-assignment-ttl`), taken once the queue has room: the client counts it from
    /// when the message arrives.
    async fn deliver(&mut self, told: Vec<(BucketId, Option<Assignment>)>) {
        if told.is_empty() || self.gone {
            return;
        }
        let Ok(Ok(permit)) = tokio::time::timeout(SEND_TIMEOUT, self.out.reserve()).await else {
            self.gone = true;
            return;
        };
        let (ttl, now) = (self.shared.options.assignment_ttl, Instant::now());
        let actions: Vec<BucketAction> = told
            .into_iter()
            .map(|(id, assignment)| match assignment {
                Some(a) => action(id, a, ttl, now),
                None => BucketAction {
                    bucket_id: Some(id),
                    bucket_action: Some(bucket_action::BucketAction::AbandonAction(
                        AbandonAction {},
                    )),
                },
            })
            .collect();
        self.count(&actions);
        permit.send(Ok(RateLimitQuotaResponse {
            bucket_action: actions,
        }));
    }

    fn count(&self, actions: &[BucketAction]) {
        for a in actions {
            let kind = match &a.bucket_action {
                Some(bucket_action::BucketAction::AbandonAction(_)) => continue,
                Some(bucket_action::BucketAction::QuotaAssignmentAction(q)) => {
                    match q.rate_limit_strategy.and_then(|s| s.strategy) {
                        Some(Strategy::TokenBucket(_)) => "token_bucket",
                        Some(Strategy::BlanketRule(r)) if r == BlanketRule::DenyAll as i32 => {
                            "deny_all"
                        }
                        _ => "allow_all",
                    }
                }
                None => continue,
            };
            self.shared
                .metrics
                .assignments
                .get_or_create(&NameLabels { kind })
                .inc();
        }
    }

    /// One report message: each entry's bucket is created, measured and answered (abandoned
    /// when idle), or skipped.
    async fn on_reports(&mut self, reports: UsageReports) -> Result<(), Status> {
        let Ok(domain) = std::str::from_utf8(&reports.domain) else {
            return Err(Status::invalid_argument("the RLQS domain is not UTF-8"));
        };
        match (&self.domain, domain) {
            (None, "") => {
                return Err(Status::invalid_argument(
                    "the first RLQS report must name its domain",
                ));
            }
            (None, d) => self.domain = Some(d.to_owned()),
            (Some(_), "") => {}
            (Some(ours), d) if ours == d => {}
            (Some(ours), d) => {
                return Err(Status::invalid_argument(format!(
                    "this stream's domain is '{ours}'; a report named '{d}'"
                )));
            }
        }
        let now = Instant::now();
        let mut abandoned = Vec::new();
        let mut asks = Vec::with_capacity(reports.bucket_quota_usages.len());
        for (i, mut usage) in reports.bucket_quota_usages.into_iter().enumerate() {
            if i % SLICE == SLICE - 1 {
                tokio::task::yield_now().await;
            }
            let key = match fault(&mut usage, &self.shared.limits) {
                Ok(key) => key,
                Err(kind) => {
                    self.skipped(kind);
                    continue;
                }
            };
            let pid = match self.by_key.get(&key[..]) {
                Some(pid) => *pid,
                None => {
                    if self.buckets.len() >= self.shared.options.max_buckets_per_stream {
                        return Err(Status::resource_exhausted(format!(
                            "this stream holds {} buckets, the most it may",
                            self.buckets.len()
                        )));
                    }
                    let target = self.bucket_rule(&key);
                    let charge = charge(&key, &target);
                    if !self.take(charge) {
                        self.skipped("over_budget");
                        continue;
                    }
                    self.open(key.into(), target, charge, now)
                }
            };
            match self.measure(pid, &usage, now) {
                Some(usage) => asks.push((pid, Ask::Report(usage))),
                None => {
                    let id = id_of(&self.buckets[&pid].key);
                    self.remove(pid, now).await;
                    self.shared.metrics.abandons.inc();
                    abandoned.push((id, None));
                }
            }
        }
        self.deliver(abandoned).await;
        self.answer(asks).await;
        Ok(())
    }

    /// Counts an entry skipped for `kind`.
    fn skipped(&self, kind: &'static str) {
        self.shared
            .metrics
            .skipped
            .get_or_create(&NameLabels { kind })
            .inc();
    }

    /// Charges `n` bytes to the stream, its connection and the process, if both have room.
    fn take(&mut self, n: usize) -> bool {
        let max = self.shared.options.max_bytes;
        if self.conn_bytes.fetch_add(n, Ordering::AcqRel) + n > max / 4 {
            self.conn_bytes.fetch_sub(n, Ordering::AcqRel);
            return false;
        }
        if self.shared.bytes.fetch_add(n, Ordering::AcqRel) + n > max {
            self.shared.bytes.fetch_sub(n, Ordering::AcqRel);
            self.conn_bytes.fetch_sub(n, Ordering::AcqRel);
            return false;
        }
        self.held += n;
        self.shared.metrics.bytes.inc_by(n as i64);
        true
    }

    /// Charges `n` bytes to the stream, its connection and the process, room or not.
    fn add(&mut self, n: usize) {
        self.held += n;
        self.conn_bytes.fetch_add(n, Ordering::AcqRel);
        self.shared.bytes.fetch_add(n, Ordering::AcqRel);
        self.shared.metrics.bytes.inc_by(n as i64);
    }

    /// Gives back `n` bytes [`RlqsStream::take`] charged.
    fn give_back(&mut self, n: usize) {
        self.held -= n;
        self.conn_bytes.fetch_sub(n, Ordering::AcqRel);
        self.shared.bytes.fetch_sub(n, Ordering::AcqRel);
        self.shared.metrics.bytes.dec_by(n as i64);
    }

    /// A new bucket, charged `charge`: a participant of its pools.
    fn open(
        &mut self,
        key: BucketKey,
        target: BucketRule,
        charge: usize,
        now: Instant,
    ) -> ParticipantId {
        let pid = self.shared.next_id.fetch_add(1, Ordering::Relaxed);
        self.shared.pools.join(pid, &target, &self.signal, now);
        self.by_key.insert(key.clone(), pid);
        self.buckets.insert(
            pid,
            Bucket {
                key,
                target,
                charge,
                last_used: now,
                last_report: now,
            },
        );
        self.shared.metrics.buckets.inc();
        pid
    }

    fn bucket_rule(&self, key: &[Pair]) -> BucketRule {
        let entries: Vec<(&[u8], &[u8])> = key
            .iter()
            .map(|(k, v)| (k.as_bytes(), v.as_bytes()))
            .collect();
        rlqs::bucket_rule(
            &self.snapshot,
            self.domain.as_deref().unwrap_or_default(),
            &entries,
            &self.shared.keys,
            self.shared.global_shadow,
        )
    }

    /// Measures one entry: the usage it reports (`None` inside when it measures nothing), or
    /// `None` when the bucket has been idle for `--rlqs-abandon-after` and is to be abandoned.
    fn measure(
        &mut self,
        pid: ParticipantId,
        usage: &BucketUsage,
        now: Instant,
    ) -> Option<Option<Usage>> {
        let bucket = self.buckets.get_mut(&pid).expect("opened above");
        let requests = usage
            .num_requests_allowed
            .saturating_add(usage.num_requests_denied);
        // The client's measure of the time, unless absent, zero or absurd; else ours.
        let claimed = usage
            .time_elapsed
            .and_then(|d| {
                let secs = u64::try_from(d.seconds).ok()?;
                let nanos = u32::try_from(d.nanos).ok().filter(|n| *n < 1_000_000_000)?;
                Some(Duration::new(secs, nanos))
            })
            .filter(|d| *d >= MIN_ELAPSED);
        let elapsed = claimed
            .or_else(|| Some(now.duration_since(bucket.last_report)).filter(|d| *d >= MIN_ELAPSED));
        bucket.last_report = now;
        if requests > 0 {
            bucket.last_used = now;
        } else if now.duration_since(bucket.last_used) >= self.shared.options.abandon_after {
            return None;
        }
        Some(elapsed.map(|e| Usage {
            requests,
            seconds: e.as_secs_f64(),
        }))
    }

    /// The assignments of `asks`' buckets, asked of the pools a slice at a time (with Redis,
    /// a slice's script calls overlap) and sent as they are decided, in messages of at most
    /// [`MESSAGE_ACTIONS`] held back no longer than [`HOLD_AT_MOST`]: an answer leaves soon
    /// after its grant, not after the whole report's (a report of 10,000 buckets on Redis
    /// takes seconds, and its first grants' leases would run out on their way; see
    /// `rlqs::LEASE_GRACE`). A bucket the failure mode leaves unanswered is not in the answer.
    async fn answer(&mut self, asks: impl IntoIterator<Item = (ParticipantId, Ask)>) {
        let mut asks = asks.into_iter();
        // Decided and not yet sent, and when the first of them was.
        let mut pending = Vec::new();
        let mut decided: Option<Instant> = None;
        loop {
            let now = Instant::now();
            let this = &*self;
            let answers: Vec<_> = asks
                .by_ref()
                .take(SLICE)
                .filter_map(|(pid, ask)| {
                    let bucket = this.buckets.get(&pid)?;
                    // Boxed: a future of futures of script calls is a type too deep to prove
                    // Send.
                    let answer: BoxFuture<'_, Option<(BucketId, Option<Assignment>)>> =
                        Box::pin(async move {
                            let assignment = this
                                .shared
                                .pools
                                .assign(pid, &bucket.target, ask, &this.signal, now)
                                .await?;
                            Some((id_of(&bucket.key), Some(assignment)))
                        });
                    Some(answer)
                })
                .collect();
            if answers.is_empty() {
                drop(answers);
                self.deliver(pending).await;
                return;
            }
            pending.extend(join_all(answers).await.into_iter().flatten());
            let first = *decided.get_or_insert(now);
            if pending.len() >= MESSAGE_ACTIONS || first.elapsed() >= HOLD_AT_MOST {
                self.deliver(std::mem::take(&mut pending)).await;
                decided = None;
                if self.gone {
                    return;
                }
            }
            tokio::task::yield_now().await;
        }
    }

    async fn remove(&mut self, pid: ParticipantId, now: Instant) {
        if let Some(b) = self.buckets.remove(&pid) {
            self.shared.pools.leave(pid, &b.target, now).await;
            self.by_key.remove(&b.key);
            self.give_back(b.charge);
            self.shared.metrics.buckets.dec();
        }
    }

    /// Buckets whose share moved: pushed their assignment now, at most [`PUSHES`] of them;
    /// the rest wait for `push_after`.
    async fn on_moved(&mut self, push_after: &mut Option<Instant>) {
        let (moved, more) = self.signal.take(PUSHES);
        if more {
            *push_after = Some(Instant::now() + PUSH_TICK);
        }
        self.answer(moved.into_iter().map(|pid| (pid, Ask::Push)))
            .await;
    }

    /// A new config: every bucket mapped again; those whose target changed are told now.
    async fn on_config_check(&mut self) {
        let latest = self.shared.config.load_full();
        if Arc::ptr_eq(&latest, &self.snapshot) {
            return;
        }
        self.snapshot = latest;
        let now = Instant::now();
        let keys: Vec<(BucketKey, ParticipantId)> =
            self.by_key.iter().map(|(k, p)| (k.clone(), *p)).collect();
        let mut changed = Vec::new();
        for (i, (key, pid)) in keys.into_iter().enumerate() {
            if i % SLICE == SLICE - 1 {
                tokio::task::yield_now().await;
            }
            let target = self.bucket_rule(&key);
            let bucket = self.buckets.get_mut(&pid).expect("indexed");
            if bucket.target != target {
                let now_charged = charge(&key, &target);
                let was = std::mem::replace(&mut bucket.charge, now_charged);
                let old = std::mem::replace(&mut bucket.target, target.clone());
                // Charged again for its new pools, room or not: a bucket held keeps working.
                self.give_back(was);
                self.add(now_charged);
                self.shared.pools.leave(pid, &old, now).await;
                self.shared.pools.join(pid, &target, &self.signal, now);
                changed.push((pid, Ask::Push));
            }
        }
        self.answer(changed).await;
    }

    /// The stream is gone: its buckets leave their pools (their leases run out as usual).
    async fn close(mut self) {
        let now = Instant::now();
        self.give_back(self.held);
        let pools = &self.shared.pools;
        let buckets: Vec<_> = self.buckets.iter().collect();
        for slice in buckets.chunks(SLICE) {
            join_all(
                slice
                    .iter()
                    .map(|(pid, b)| pools.leave(**pid, &b.target, now)),
            )
            .await;
            tokio::task::yield_now().await;
        }
        let metrics = &self.shared.metrics;
        metrics.buckets.dec_by(self.buckets.len() as i64);
        metrics.streams.dec();
    }
}

/// The protocol form of an assignment, sent `now`: a token bucket's TTL is what is left of its
/// lease, at most `ttl`.
fn action(id: BucketId, assignment: Assignment, ttl: Duration, now: Instant) -> BucketAction {
    let ttl = match assignment {
        // What is left of the lease, in whole seconds (Envoy reads no fraction), at least
        // one: only an answer held up for longer than the grace is sent with a TTL that
        // outlasts its lease, by less than a second.
        Assignment::Bucket { until, .. } => {
            Duration::from_secs(until.saturating_duration_since(now).as_secs().max(1)).min(ttl)
        }
        _ => ttl,
    };
    let strategy = match assignment {
        Assignment::Allow => Strategy::BlanketRule(BlanketRule::AllowAll as i32),
        Assignment::Deny => Strategy::BlanketRule(BlanketRule::DenyAll as i32),
        Assignment::Bucket {
            max_tokens,
            tokens_per_fill,
            fill_s,
            ..
        } => Strategy::TokenBucket(TokenBucket {
            max_tokens: u32::try_from(max_tokens).unwrap_or(u32::MAX),
            tokens_per_fill: Some(UInt32Value {
                value: u32::try_from(tokens_per_fill).unwrap_or(u32::MAX),
            }),
            fill_interval: Some(PbDuration {
                seconds: i64::try_from(fill_s).unwrap_or(i64::MAX),
                nanos: 0,
            }),
        }),
    };
    BucketAction {
        bucket_id: Some(id),
        bucket_action: Some(bucket_action::BucketAction::QuotaAssignmentAction(
            QuotaAssignmentAction {
                assignment_time_to_live: Some(PbDuration {
                    seconds: i64::try_from(ttl.as_secs()).unwrap_or(i64::MAX),
                    nanos: 0,
                }),
                rate_limit_strategy: Some(RateLimitStrategy {
                    strategy: Some(strategy),
                }),
            },
        )),
    }
}
