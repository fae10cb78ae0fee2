//! A large RLQS quota pool beside RLS traffic (`make pools`; not a test): what one report of
//! many new buckets costs when they join a pool of tens of thousands, and what an honest RLS
//! client's latency is while it happens, against the same client's latency on the same server
//! just before.
//!
//! One run against a fresh server (`scripts/pools.sh` starts one per round):
//! 1. quiet: an RLS client sends the bench domain's request at `--rls-rate` for `--window`
//!    seconds (open loop: calls are sent at the rate whatever the answers take, each timed
//!    from when it is sent; on a thread and runtime of its own, apart from the RLQS load this
//!    process makes);
//! 2. set-up: `--streams` streams, each on its own connection, report `--members - --report`
//!    buckets of one pool (`tenant: t-<n>`, one `share_threshold` counter) and wait for every
//!    answer;
//! 3. busy: the same RLS client for another `--window` seconds while a new stream reports
//!    `--report` new buckets of the same pool at once and, once that is answered, the set-up
//!    streams report all their buckets again, one after another (as Envoys do every 5 s).
//!
//! Prints one line of `name=value` pairs: the RLS percentiles of each phase (ms), how long the
//! large report took to be answered in full (ms) and the server's CPU during it (ms, from
//! `/proc/<--server-pid>/stat`; with `--redis-pid`, Redis's too). Loopback only.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use tokio::time::Instant;

use envoy_types::pb::envoy::extensions::common::ratelimit::v3::RateLimitDescriptor;
use envoy_types::pb::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::Entry;
use envoy_types::pb::envoy::service::rate_limit_quota::v3::rate_limit_quota_service_client::RateLimitQuotaServiceClient;
use envoy_types::pb::envoy::service::rate_limit_quota::v3::rate_limit_quota_usage_reports::BucketQuotaUsage;
use envoy_types::pb::envoy::service::rate_limit_quota::v3::{BucketId, RateLimitQuotaUsageReports};
use envoy_types::pb::envoy::service::ratelimit::v3::RateLimitRequest;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_client::RateLimitServiceClient;
use envoy_types::pb::google::protobuf::Duration as PbDuration;
use tokio::sync::{Notify, mpsc};
use tokio_stream::wrappers::ReceiverStream;
use tonic::transport::Channel;

#[derive(clap::Parser)]
#[command(about = "A large RLQS pool beside RLS traffic (run by scripts/pools.sh)")]
struct Flags {
    /// The server, e.g. http://127.0.0.1:8081 (loopback only).
    #[arg(long)]
    target: Option<String>,
    /// The server's pid, for its CPU time.
    #[arg(long)]
    server_pid: Option<u32>,
    /// Redis's pid, for its CPU time.
    #[arg(long)]
    redis_pid: Option<u32>,
    /// Participants of the pool once the large report is in.
    #[arg(long, default_value_t = 30_000)]
    members: usize,
    /// New buckets in the large report.
    #[arg(long, default_value_t = 10_000)]
    report: usize,
    /// Streams (one per connection) holding the other members.
    #[arg(long, default_value_t = 4)]
    streams: usize,
    /// RLS calls per second, open loop.
    #[arg(long, default_value_t = 1_000.0)]
    rls_rate: f64,
    /// Seconds of each phase.
    #[arg(long, default_value_t = 5.0)]
    window: f64,
}

/// CPU time of `pid` (user + system), from `/proc`.
fn cpu(pid: Option<u32>) -> Option<Duration> {
    let stat = std::fs::read_to_string(format!("/proc/{}/stat", pid?)).ok()?;
    let fields: Vec<&str> = stat.rsplit(')').next()?.split_whitespace().collect();
    let ticks: u64 = fields[11].parse::<u64>().ok()? + fields[12].parse::<u64>().ok()?;
    // USER_HZ: 100 on every Linux this runs on (what `getconf CLK_TCK` prints).
    Some(Duration::from_millis(ticks * 10))
}

fn rls_request(n: u64) -> RateLimitRequest {
    let entry = |key: &str, value: String| Entry {
        key: key.into(),
        value,
    };
    RateLimitRequest {
        domain: "bench".into(),
        descriptors: vec![
            RateLimitDescriptor {
                entries: vec![entry("client", format!("c{}", n % 1000))],
                ..Default::default()
            },
            RateLimitDescriptor {
                entries: vec![entry("route", format!("r{}", n % 16))],
                ..Default::default()
            },
        ],
        hits_addend: 1,
    }
}

/// RLS latencies (µs) and errors over `window`, at `rate` calls per second.
async fn probe(client: RateLimitServiceClient<Channel>, rate: f64, window: Duration) -> Probe {
    let every = Duration::from_secs_f64(1.0 / rate.max(1.0));
    let mut tick = tokio::time::interval(every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Burst);
    let end = Instant::now() + window;
    let mut calls = tokio::task::JoinSet::new();
    let mut n = 0u64;
    loop {
        if tick.tick().await >= end {
            break;
        }
        n += 1;
        let mut c = client.clone();
        calls.spawn(async move {
            // Timed from when it is sent, not from when it was due: the timer fires up to a
            // millisecond late, which would add the same to every call of both phases.
            let sent = Instant::now();
            let ok = c.should_rate_limit(rls_request(n)).await.is_ok();
            (sent.elapsed().as_micros() as u64, ok)
        });
    }
    let mut p = Probe::default();
    while let Some(r) = calls.join_next().await {
        let (us, ok) = r.expect("a probe call");
        p.latencies_us.push(us);
        p.errors += u64::from(!ok);
    }
    p.latencies_us.sort_unstable();
    p
}

/// How long the probe warms its connection before it measures.
const WARM: Duration = Duration::from_millis(300);

/// The RLS client on a thread and a runtime of its own, so that the RLQS load this process
/// generates (large messages to encode and decode) never delays it: what it measures is the
/// server (the cores stay shared, as they are with any neighbour).
fn apart(target: String, rate: f64, window: Duration) -> tokio::task::JoinHandle<Probe> {
    tokio::task::spawn_blocking(move || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("a runtime");
        rt.block_on(async {
            let client = RateLimitServiceClient::new(
                Channel::from_shared(target)
                    .expect("target URL")
                    .connect()
                    .await
                    .expect("connect to the target"),
            );
            probe(client.clone(), rate, WARM).await;
            probe(client, rate, window).await
        })
    })
}

#[derive(Default)]
struct Probe {
    latencies_us: Vec<u64>,
    errors: u64,
}

impl Probe {
    fn ms(&self, q: f64) -> f64 {
        let v = &self.latencies_us;
        if v.is_empty() {
            return f64::NAN;
        }
        v[((v.len() - 1) as f64 * q).round() as usize] as f64 / 1000.0
    }
}

/// One RLQS stream on a connection of its own: reports sent, bucket actions counted.
struct Stream {
    tx: mpsc::Sender<RateLimitQuotaUsageReports>,
    answered: Arc<AtomicUsize>,
    changed: Arc<Notify>,
}

impl Stream {
    async fn open(target: &str) -> Stream {
        let channel = Channel::from_shared(target.to_owned())
            .expect("target URL")
            .connect()
            .await
            .expect("connect to the target");
        let mut client = RateLimitQuotaServiceClient::new(channel)
            .max_decoding_message_size(64 << 20)
            .max_encoding_message_size(64 << 20);
        let (tx, rx) = mpsc::channel(16);
        let answered = Arc::new(AtomicUsize::new(0));
        let changed = Arc::new(Notify::new());
        let (a, c) = (answered.clone(), changed.clone());
        tokio::spawn(async move {
            let mut inbound = client
                .stream_rate_limit_quotas(ReceiverStream::new(rx))
                .await
                .expect("an RLQS stream")
                .into_inner();
            while let Ok(Some(m)) = inbound.message().await {
                a.fetch_add(m.bucket_action.len(), Ordering::Relaxed);
                c.notify_waiters();
            }
        });
        Stream {
            tx,
            answered,
            changed,
        }
    }

    /// Reports buckets `range` (5 requests in 5 s each).
    async fn report(&self, range: std::ops::Range<usize>) {
        let usages = range
            .map(|n| BucketQuotaUsage {
                bucket_id: Some(BucketId {
                    bucket: [("tenant".to_owned(), format!("t-{n}"))].into(),
                }),
                time_elapsed: Some(PbDuration {
                    seconds: 5,
                    nanos: 0,
                }),
                num_requests_allowed: 5,
                num_requests_denied: 0,
            })
            .collect();
        self.tx
            .send(RateLimitQuotaUsageReports {
                domain: "bench".into(),
                bucket_quota_usages: usages,
            })
            .await
            .expect("the stream is open");
    }

    /// Waits until `n` bucket actions have arrived in all, or `limit` has passed.
    async fn answered(&self, n: usize, limit: Duration) -> bool {
        let deadline = tokio::time::Instant::now() + limit;
        loop {
            let changed = self.changed.notified();
            if self.answered.load(Ordering::Relaxed) >= n {
                return true;
            }
            if tokio::time::timeout_at(deadline, changed).await.is_err() {
                return self.answered.load(Ordering::Relaxed) >= n;
            }
        }
    }
}

#[tokio::main]
async fn main() {
    use clap::Parser;
    let flags = Flags::parse();
    let Some(target) = flags.target.clone() else {
        eprintln!("pools: nothing to do without --target (scripts/pools.sh runs it)");
        return;
    };
    let host = target.trim_start_matches("http://");
    if !host.starts_with("127.") {
        eprintln!("pools: load is only ever sent to loopback, not {host}");
        std::process::exit(2);
    }
    let window = Duration::from_secs_f64(flags.window);
    let quiet = apart(target.clone(), flags.rls_rate, window)
        .await
        .expect("the probe");

    // Set-up: the pool's other members, split over the streams.
    let others = flags.members.saturating_sub(flags.report);
    let per = others.div_ceil(flags.streams.max(1)).max(1);
    let mut streams = Vec::new();
    for s in 0..flags.streams.max(1) {
        streams.push((
            Stream::open(&target).await,
            s * per..((s + 1) * per).min(others),
        ));
    }
    for (stream, range) in &streams {
        stream.report(range.clone()).await;
    }
    for (stream, range) in &streams {
        if !stream.answered(range.len(), Duration::from_secs(120)).await {
            eprintln!("pools: set-up not answered in 120 s");
            std::process::exit(1);
        }
    }
    let newcomer = Stream::open(&target).await;

    // Busy: the large report at once, the others' reports spread over the window.
    let busy = apart(target.clone(), flags.rls_rate, window);
    tokio::time::sleep(WARM + window / 10).await;
    let (cpu0, redis0, t0) = (cpu(flags.server_pid), cpu(flags.redis_pid), Instant::now());
    newcomer.report(others..others + flags.report).await;
    let done = newcomer
        .answered(flags.report, Duration::from_secs(120))
        .await;
    let took = t0.elapsed();
    let (cpu1, redis1) = (cpu(flags.server_pid), cpu(flags.redis_pid));
    // Then every other member reports again, a stream at a time, over what is left.
    for (stream, range) in &streams {
        stream.report(range.clone()).await;
        tokio::time::sleep(window / (2 * streams.len() as u32)).await;
    }
    let busy = busy.await.expect("the probe");
    let ms = |d: Option<Duration>| d.map_or(f64::NAN, |d| d.as_secs_f64() * 1000.0);
    println!(
        "quiet_p50={:.3} quiet_p99={:.3} quiet_max={:.3} busy_p50={:.3} busy_p99={:.3} \
         busy_max={:.3} rls_errors={} report_ms={:.1} report_answered={} server_cpu_ms={:.0} \
         redis_cpu_ms={:.0}",
        quiet.ms(0.5),
        quiet.ms(0.99),
        quiet.ms(1.0),
        busy.ms(0.5),
        busy.ms(0.99),
        busy.ms(1.0),
        quiet.errors + busy.errors,
        took.as_secs_f64() * 1000.0,
        if done {
            flags.report
        } else {
            newcomer.answered.load(Ordering::Relaxed)
        },
        ms(cpu1.zip(cpu0).map(|(a, b)| a - b)),
        ms(redis1.zip(redis0).map(|(a, b)| a - b)),
    );
}
