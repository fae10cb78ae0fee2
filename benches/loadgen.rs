//! Load generator for ratelimitd: closed-loop gRPC ShouldRateLimit calls from many concurrent
//! workers over a few HTTP/2 connections, reporting throughput and latency percentiles.
//!
//! `cargo bench --bench loadgen -- --target http://127.0.0.1:8081 --duration 10`
//! (see `make bench`, which also starts the server). Only loopback targets are accepted.
//! `--rate N` paces the load at N requests/s in all (open loop: each call's latency counts from
//! when it was due, so a slow answer that delays the calls behind it shows in theirs too);
//! `--report-every S` prints throughput, errors by gRPC code and latency percentiles every S
//! seconds (`make soak`); `--allow-errors` exits 0 even when some calls failed. `--worst`
//! sends the costliest request the server accepts instead: 64 descriptors on the bench
//! domain's `worst` key (four sliding_log limits each: 256 counters, the `--max-counters`
//! default) with values that bring its counter keys to just under 1 MiB (the bound).
//! `--plain` sends one descriptor on a fixed window (the bench domain's `plain` key);
//! `--holds` has each worker take a place (the `place` key: a concurrency limit) under a new
//! request id and release it, call after call (`scripts/holds.sh` compares the two).

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::time::Instant;

use envoy_types::pb::envoy::extensions::common::ratelimit::v3::RateLimitDescriptor;
use envoy_types::pb::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::Entry;
use envoy_types::pb::envoy::service::ratelimit::v3::RateLimitRequest;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::Code;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_client::RateLimitServiceClient;
use envoy_types::pb::google::protobuf::UInt64Value;
use tonic::transport::Channel;

/// Closed-loop (or paced) gRPC ShouldRateLimit calls against a ratelimitd on loopback,
/// reporting throughput, answers and latency percentiles.
#[derive(clap::Parser)]
#[command(name = "loadgen")]
struct Flags {
    /// The server (loopback only), e.g. http://127.0.0.1:8081.
    #[arg(long)]
    target: Option<String>,
    /// HTTP/2 connections the calls share.
    #[arg(long, default_value_t = 4)]
    connections: usize,
    /// Calls in flight at once.
    #[arg(long, default_value_t = 64)]
    concurrency: usize,
    /// Seconds measured.
    #[arg(long, default_value_t = 10.0)]
    duration: f64,
    /// Seconds of load before measuring.
    #[arg(long, default_value_t = 1.0)]
    warmup: f64,
    /// The domain the requests name.
    #[arg(long, default_value = "bench")]
    domain: String,
    /// Distinct client keys.
    #[arg(long, default_value_t = 10_000)]
    keys: u64,
    /// Requests per second in all (open loop) instead of as fast as answers come.
    #[arg(long)]
    rate: Option<f64>,
    /// Print throughput, errors and latency every this many seconds.
    #[arg(long)]
    report_every: Option<f64>,
    /// Exit 0 even when some calls failed.
    #[arg(long)]
    allow_errors: bool,
    /// Zipf exponent over the client keys (default: cycle through them uniformly).
    #[arg(long)]
    zipf: Option<f64>,
    /// Send the costliest request the server accepts (see the module documentation).
    #[arg(long)]
    worst: bool,
    /// Touch every client key once (each worker its own stretch of them), then stop: fills the
    /// server with --keys live counters.
    #[arg(long, conflicts_with_all = ["zipf", "rate", "worst"])]
    fill: bool,
    /// One descriptor per request, a fixed window (`plain`).
    #[arg(long, conflicts_with_all = ["worst", "holds"])]
    plain: bool,
    /// Each worker's calls alternate: take a place under a new request id, release it.
    #[arg(long, conflicts_with_all = ["worst", "plain"])]
    holds: bool,
    /// Instead of load: open this many connections, make one call on each, print `idle: N`,
    /// then hold them open and silent for --duration seconds (memory per idle connection).
    #[arg(long)]
    idle_connections: Option<usize>,
    /// Passed by `cargo bench`; ignored.
    #[arg(long, hide = true)]
    bench: bool,
}

struct Args {
    target: String,
    connections: usize,
    concurrency: usize,
    duration: Duration,
    warmup: Duration,
    domain: String,
    keys: u64,
    rate: Option<f64>,
    report_every: Option<Duration>,
    allow_errors: bool,
    /// Zipf exponent over the client keys; `None` cycles through them uniformly.
    zipf: Option<f64>,
    /// The Zipf distribution's cumulative weights, built once from `keys` and `zipf`.
    cdf: Vec<f64>,
    /// Send the costliest accepted request instead of the two-descriptor one.
    worst: bool,
    /// Hold this many idle connections instead of sending load.
    idle_connections: Option<usize>,
    /// Touch every key once, then stop.
    fill: bool,
    /// One fixed-window descriptor per request.
    plain: bool,
    /// Acquire and release places, alternately.
    holds: bool,
}

/// The arguments, or `None` when there is nothing to do (`cargo bench` with no arguments).
fn parse_args() -> Option<Args> {
    use clap::Parser;
    let flags = Flags::parse();
    let Some(target) = flags.target else {
        eprintln!("loadgen: nothing to do without --target (see --help; `make bench` runs it)");
        return None;
    };
    let seconds = |name: &str, s: f64| {
        Duration::try_from_secs_f64(s).unwrap_or_else(|_| {
            eprintln!("loadgen: --{name} must be a number of seconds, not {s}");
            std::process::exit(2)
        })
    };
    let mut args = Args {
        target,
        connections: flags.connections,
        concurrency: flags.concurrency,
        duration: seconds("duration", flags.duration),
        warmup: seconds("warmup", flags.warmup),
        domain: flags.domain,
        keys: flags.keys,
        rate: flags.rate,
        report_every: flags.report_every.map(|s| seconds("report-every", s)),
        allow_errors: flags.allow_errors,
        zipf: flags.zipf,
        cdf: Vec::new(),
        worst: flags.worst,
        idle_connections: flags.idle_connections,
        fill: flags.fill,
        plain: flags.plain,
        holds: flags.holds,
    };
    if let Some(s) = args.zipf {
        let weights: Vec<f64> = (1..=args.keys.max(1))
            .map(|k| 1.0 / (k as f64).powf(s))
            .collect();
        let total: f64 = weights.iter().sum();
        let mut acc = 0.0;
        args.cdf = weights
            .iter()
            .map(|w| {
                acc += w / total;
                acc
            })
            .collect();
    }
    let host = args.target.trim_start_matches("http://");
    if !(host.starts_with("127.") || host.starts_with("localhost") || host.starts_with("[::1]")) {
        eprintln!("loadgen: load is only ever sent to loopback, not {host}");
        std::process::exit(2);
    }
    Some(args)
}

fn entry(key: &str, value: String) -> Entry {
    Entry {
        key: key.into(),
        value,
    }
}

/// The client key of the `n`th request: Zipf-distributed when asked (a SplitMix64 hash of `n`
/// picks a point of the cumulative weights), else cycling through all keys.
fn client_key(args: &Args, n: u64) -> u64 {
    if args.cdf.is_empty() {
        return n % args.keys.max(1);
    }
    let mut z = n.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    let u = (z ^ (z >> 31)) as f64 / u64::MAX as f64;
    args.cdf.partition_point(|&c| c < u).min(args.cdf.len() - 1) as u64
}

/// Two descriptors per request: a per-client limit and a per-route limit (or as `--worst`,
/// `--plain` and `--holds` say; a hold's id is the worker's and the call's, `worker`).
fn request(args: &Args, n: u64, client: u64, worker: u64) -> RateLimitRequest {
    if args.worst {
        return worst_request(&args.domain, client);
    }
    if args.plain {
        return RateLimitRequest {
            domain: args.domain.clone(),
            descriptors: vec![RateLimitDescriptor {
                entries: vec![entry("plain", format!("p{client}"))],
                ..Default::default()
            }],
            hits_addend: 1,
        };
    }
    if args.holds {
        // Odd calls take the place of request `n`, even ones release the place of `n - 1`,
        // on the same tenant.
        let taking = n % 2 == 1;
        let id = if taking { n } else { n - 1 };
        let tenant = client_key(args, id);
        return RateLimitRequest {
            domain: args.domain.clone(),
            descriptors: vec![RateLimitDescriptor {
                entries: vec![
                    entry("place", format!("p{tenant}")),
                    // This process's own ids: another run's held places are not replays.
                    entry(
                        "request_id",
                        format!("{}-{worker}-{id}", std::process::id()),
                    ),
                ],
                hits_addend: (!taking).then_some(UInt64Value { value: 1 }),
                is_negative_hits: !taking,
                ..Default::default()
            }],
            hits_addend: 1,
        };
    }
    RateLimitRequest {
        domain: args.domain.clone(),
        descriptors: vec![
            RateLimitDescriptor {
                entries: vec![entry("client", format!("c{client}"))],
                ..Default::default()
            },
            RateLimitDescriptor {
                entries: vec![entry("route", format!("/api/{}", n % 16))],
                ..Default::default()
            },
        ],
        hits_addend: 1,
    }
}

/// 64 descriptors of 4000-byte values on the `worst` key: 256 counters whose keys (each about
/// 4050 bytes with the domain, key and limit identity) total just under 1 MiB.
fn worst_request(domain: &str, client: u64) -> RateLimitRequest {
    RateLimitRequest {
        domain: domain.into(),
        descriptors: (0..64)
            .map(|i| RateLimitDescriptor {
                entries: vec![entry("worst", format!("{client}-{i}-{}", "w".repeat(3990)))],
                ..Default::default()
            })
            .collect(),
        hits_addend: 1,
    }
}

#[derive(Default)]
struct Tally {
    ok: u64,
    over: u64,
    errors: u64,
    latencies_us: Vec<u32>,
}

/// What happened since the last report: answers, failures by gRPC code, latencies.
#[derive(Default)]
struct Interval {
    ok: u64,
    over: u64,
    errors: BTreeMap<String, u64>,
    latencies_us: Vec<u32>,
}

async fn worker(
    mut client: RateLimitServiceClient<Channel>,
    args: &Args,
    id: u64,
    start: Instant,
    interval: Arc<Mutex<Interval>>,
) -> Tally {
    let mut tally = Tally::default();
    let measure_from = start + args.warmup;
    let end = measure_from + args.duration;
    // Workers start evenly spread over the keys, so together they cycle through all of them.
    let stretch = args.keys.div_ceil(args.concurrency.max(1) as u64).max(1);
    let mut n = id.wrapping_mul(stretch);
    let mut left = if args.fill { stretch } else { u64::MAX };
    // Open loop when paced: each worker's calls are due at rate/concurrency, whatever the
    // answers take; a call sent late (its worker still waiting for an answer) counts from when
    // it was due, so queueing behind a slow answer is measured, not hidden.
    let mut pace = args.rate.map(|r| {
        let every = Duration::from_secs_f64(args.concurrency as f64 / r.max(0.001));
        let mut t = tokio::time::interval(every);
        t.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Burst);
        t
    });
    loop {
        if left == 0 {
            return tally;
        }
        left -= 1;
        let sent = match pace.as_mut() {
            Some(p) => p.tick().await,
            None => Instant::now(),
        };
        if sent >= end {
            return tally;
        }
        n = n.wrapping_add(1);
        let result = client
            .should_rate_limit(request(args, n, client_key(args, n), id))
            .await;
        if sent < measure_from {
            continue;
        }
        let took = sent.elapsed().as_micros().min(u32::MAX as u128) as u32;
        tally.latencies_us.push(took);
        let mut i = interval.lock().unwrap();
        i.latencies_us.push(took);
        match result {
            Ok(r) if r.get_ref().overall_code == Code::OverLimit as i32 => {
                tally.over += 1;
                i.over += 1;
            }
            Ok(_) => {
                tally.ok += 1;
                i.ok += 1;
            }
            Err(status) => {
                tally.errors += 1;
                *i.errors.entry(format!("{:?}", status.code())).or_default() += 1;
            }
        }
    }
}

/// Opens `n` connections, makes one call on each, then holds them open and silent.
async fn hold_idle(args: &Args, n: usize) {
    let mut held = Vec::with_capacity(n);
    for i in 0..n {
        let channel = Channel::from_shared(args.target.clone())
            .expect("target URL")
            .connect()
            .await
            .expect("connect to the target");
        let mut client = RateLimitServiceClient::new(channel);
        client
            .should_rate_limit(request(args, i as u64, i as u64, 0))
            .await
            .expect("a call on each connection");
        held.push(client);
    }
    println!("idle: {n}");
    tokio::time::sleep(args.duration).await;
    drop(held);
}

fn percentile(sorted: &[u32], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i] as f64 / 1000.0
}

#[tokio::main]
async fn main() {
    let Some(args) = parse_args() else {
        return;
    };
    if let Some(n) = args.idle_connections {
        return hold_idle(&args, n).await;
    }
    let mut channels = Vec::new();
    for _ in 0..args.connections.max(1) {
        let channel = Channel::from_shared(args.target.clone())
            .expect("target URL")
            .tcp_nodelay(true)
            .connect()
            .await
            .expect("connect to the target");
        channels.push(channel);
    }
    let args = Box::leak(Box::new(args));
    let start = Instant::now();
    let interval = Arc::new(Mutex::new(Interval::default()));
    let reporter = args.report_every.map(|every| {
        let interval = interval.clone();
        tokio::spawn(async move {
            let mut tick = tokio::time::interval_at(tokio::time::Instant::now() + every, every);
            loop {
                tick.tick().await;
                let mut i = std::mem::take(&mut *interval.lock().unwrap());
                i.latencies_us.sort_unstable();
                let errors: Vec<String> =
                    i.errors.iter().map(|(k, v)| format!("{k}={v}")).collect();
                println!(
                    "t={:>4.0}s  {:>7.0} req/s  ok {}  over_limit {}  errors {}  p50 {:.3} ms  p99 {:.3} ms  max {:.3} ms",
                    start.elapsed().as_secs_f64(),
                    i.latencies_us.len() as f64 / every.as_secs_f64(),
                    i.ok,
                    i.over,
                    if errors.is_empty() { "0".into() } else { errors.join(",") },
                    percentile(&i.latencies_us, 0.50),
                    percentile(&i.latencies_us, 0.99),
                    percentile(&i.latencies_us, 1.0),
                );
            }
        })
    });
    let workers: Vec<_> = (0..args.concurrency)
        .map(|i| {
            let client = RateLimitServiceClient::new(channels[i % channels.len()].clone());
            let args: &'static Args = args;
            let interval = interval.clone();
            tokio::spawn(async move { worker(client, args, i as u64, start, interval).await })
        })
        .collect();
    let mut total = Tally::default();
    for w in workers {
        let t = w.await.expect("worker");
        total.ok += t.ok;
        total.over += t.over;
        total.errors += t.errors;
        total.latencies_us.extend(t.latencies_us);
    }
    if let Some(r) = reporter {
        r.abort();
    }
    total.latencies_us.sort_unstable();
    let count = total.latencies_us.len() as f64;
    let secs = args.duration.as_secs_f64();
    println!(
        "loadgen: {} connections, {} concurrent, {:.0} s, {} descriptors/request, {} client keys{}",
        args.connections,
        args.concurrency,
        secs,
        if args.worst {
            64
        } else if args.plain || args.holds {
            1
        } else {
            2
        },
        args.keys,
        args.zipf
            .map(|s| format!(" (Zipf {s})"))
            .unwrap_or_default()
    );
    println!(
        "requests: {:.0} ({:.0}/s)  ok {}  over_limit {}  errors {}",
        count,
        count / secs,
        total.ok,
        total.over,
        total.errors
    );
    println!(
        "latency ms: p50 {:.3}  p90 {:.3}  p99 {:.3}  max {:.3}",
        percentile(&total.latencies_us, 0.50),
        percentile(&total.latencies_us, 0.90),
        percentile(&total.latencies_us, 0.99),
        percentile(&total.latencies_us, 1.0)
    );
    if total.errors > 0 && !args.allow_errors {
        std::process::exit(1);
    }
}
