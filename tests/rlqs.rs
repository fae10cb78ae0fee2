//! RLQS (`StreamRateLimitQuotas`) against simulated Envoys: tonic clients from envoy-types
//! that report as Envoy does (a new bucket at once, then every bucket on an interval, idle
//! ones included) and enforce what they are assigned.

mod common;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::*;
use envoy_types::pb::envoy::r#type::v3::rate_limit_strategy::{BlanketRule, Strategy};
use envoy_types::pb::envoy::service::rate_limit_quota::v3::rate_limit_quota_response::bucket_action::BucketAction as ActionKind;
use envoy_types::pb::envoy::service::rate_limit_quota::v3::rate_limit_quota_service_client::RateLimitQuotaServiceClient;
use envoy_types::pb::envoy::service::rate_limit_quota::v3::rate_limit_quota_usage_reports::BucketQuotaUsage;
use envoy_types::pb::envoy::service::rate_limit_quota::v3::{
    BucketId, RateLimitQuotaResponse, RateLimitQuotaUsageReports,
};
use envoy_types::pb::google::protobuf::Duration as PbDuration;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;

/// What a bucket was last told.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Told {
    Allow,
    Deny,
    Bucket {
        max_tokens: u32,
        tokens_per_fill: u32,
        fill_s: i64,
    },
    Abandon,
}

impl Told {
    fn tokens(self) -> Option<(u32, u32)> {
        match self {
            Told::Bucket {
                max_tokens,
                tokens_per_fill,
                ..
            } => Some((tokens_per_fill, max_tokens)),
            _ => None,
        }
    }
}

type Key = Vec<(String, String)>;

/// A bucket id as written in a test.
type Pairs<'a> = &'a [(&'a str, &'a str)];

fn key(pairs: &[(&str, &str)]) -> Key {
    let mut k: Key = pairs
        .iter()
        .map(|(a, b)| (a.to_string(), b.to_string()))
        .collect();
    k.sort();
    k
}

fn bucket_id(pairs: &[(&str, &str)]) -> BucketId {
    BucketId {
        bucket: pairs
            .iter()
            .map(|(a, b)| (a.to_string(), b.to_string()))
            .collect(),
    }
}

/// Everything every simulated Envoy of a test was told, shared with their reader tasks.
#[derive(Default)]
struct Board {
    /// (client, bucket) → the latest action.
    latest: HashMap<(usize, Key), Told>,
    /// How each stream ended, if it did.
    ended: HashMap<usize, tonic::Code>,
    /// The largest sum of `tokens_per_fill` over all clients of one bucket key the moment any
    /// answer arrived: answers to different streams race, so a client's increase may land
    /// before another's decrease that the server sent first.
    worst_transient: HashMap<Key, u64>,
    /// Σ `tokens_per_fill` of each bucket key over every client's latest token bucket, kept
    /// as answers arrive (summed over the board at every arrival, an answer of 10,000 buckets
    /// cost 10,000 x 10,000 steps on the thread the server under test shares).
    sums: HashMap<Key, u64>,
    /// Every client's token buckets in force, whatever their key.
    in_force: InForce,
    /// client → how many bucket actions it was sent in all.
    actions: HashMap<usize, u64>,
}

/// The tokens per fill of the token buckets clients hold at each moment: an assignment is in
/// force from its arrival until its TTL has passed (Envoy counts the TTL from when it got it),
/// or until the next one for the same bucket replaces it.
#[derive(Default)]
struct InForce {
    /// (client, bucket) → the tokens in force and the arrival that told them.
    held: HashMap<(usize, Key), (u64, u64)>,
    /// When each assignment runs out: (when, client, bucket, its arrival's number), soonest first.
    expiries:
        std::collections::BinaryHeap<std::cmp::Reverse<(tokio::time::Instant, usize, Key, u64)>>,
    arrivals: u64,
    now: u64,
    /// The most `now` has been.
    worst: u64,
}

impl InForce {
    /// `tokens` told to `client` for `bucket` just now, in force for `ttl` (0: not a token
    /// bucket, so nothing held).
    fn told(&mut self, client: usize, bucket: Key, tokens: u64, ttl: Duration) {
        let now = tokio::time::Instant::now();
        self.expire(now);
        self.arrivals += 1;
        if let Some((t, _)) = self.held.remove(&(client, bucket.clone())) {
            self.now -= t;
        }
        if tokens > 0 {
            self.now += tokens;
            self.worst = self.worst.max(self.now);
            self.held
                .insert((client, bucket.clone()), (tokens, self.arrivals));
            let expiry = (now + ttl, client, bucket, self.arrivals);
            self.expiries.push(std::cmp::Reverse(expiry));
        }
    }

    /// Takes out what has run out by `now`.
    fn expire(&mut self, now: tokio::time::Instant) {
        while let Some(std::cmp::Reverse((when, ..))) = self.expiries.peek()
            && *when <= now
        {
            let std::cmp::Reverse((_, c, k, arrival)) = self.expiries.pop().unwrap();
            if self
                .held
                .get(&(c, k.clone()))
                .is_some_and(|(_, a)| *a == arrival)
            {
                let (t, _) = self.held.remove(&(c, k)).unwrap();
                self.now -= t;
            }
        }
    }

    /// The most tokens per fill clients held at once, and what they hold now.
    fn most_and_now(&mut self) -> (u64, u64) {
        self.expire(tokio::time::Instant::now());
        (self.worst, self.now)
    }
}

impl Board {
    /// Σ `tokens_per_fill` of `bucket` over every client's latest token bucket.
    fn sum(&self, bucket: &Key) -> u64 {
        self.sums.get(bucket).copied().unwrap_or(0)
    }

    /// Σ `max_tokens` of `bucket` over every client's latest token bucket.
    fn max_sum(&self, bucket: &Key) -> u64 {
        self.total(bucket, |(_, max)| max)
    }

    fn total(&self, bucket: &Key, part: fn((u32, u32)) -> u32) -> u64 {
        self.latest
            .iter()
            .filter(|((_, k), _)| k == bucket)
            .filter_map(|(_, t)| t.tokens())
            .map(|t| u64::from(part(t)))
            .sum()
    }
}

/// A simulated Envoy: one stream, its reports sent by the test, its answers recorded.
struct Envoy {
    n: usize,
    tx: mpsc::Sender<RateLimitQuotaUsageReports>,
    domain: String,
    board: Arc<Mutex<Board>>,
}

impl Envoy {
    async fn connect(s: &TestServer, n: usize, domain: &str, board: &Arc<Mutex<Board>>) -> Envoy {
        let url = format!("http://{}", s.grpc);
        let mut client = poll(Duration::from_secs(10), || {
            let url = url.clone();
            async move { RateLimitQuotaServiceClient::connect(url).await.ok() }
        })
        .await;
        let (tx, rx) = mpsc::channel(16);
        let mut answers = client
            .stream_rate_limit_quotas(ReceiverStream::new(rx))
            .await
            .expect("stream opened")
            .into_inner();
        let b = board.clone();
        tokio::spawn(async move {
            loop {
                match answers.message().await {
                    Ok(Some(m)) => record(&b, n, m),
                    Ok(None) => break,
                    Err(status) => {
                        b.lock().unwrap().ended.insert(n, status.code());
                        break;
                    }
                }
            }
        });
        Envoy {
            n,
            tx,
            domain: domain.to_owned(),
            board: board.clone(),
        }
    }

    /// Sends one report: per bucket, (allowed, denied) over `elapsed`.
    async fn report(&self, entries: &[(Pairs<'_>, u64, u64)], elapsed: Duration) {
        self.send(RateLimitQuotaUsageReports {
            domain: self.domain.clone(),
            bucket_quota_usages: entries
                .iter()
                .map(|(pairs, allowed, denied)| BucketQuotaUsage {
                    bucket_id: Some(bucket_id(pairs)),
                    time_elapsed: Some(PbDuration {
                        seconds: elapsed.as_secs() as i64,
                        nanos: elapsed.subsec_nanos() as i32,
                    }),
                    num_requests_allowed: *allowed,
                    num_requests_denied: *denied,
                })
                .collect(),
        })
        .await;
    }

    async fn send(&self, m: RateLimitQuotaUsageReports) {
        let _ = self.tx.send(m).await;
    }

    /// How the server ended this client's stream, once it has.
    async fn ended(&self) -> tonic::Code {
        poll(Duration::from_secs(10), || {
            let code = self.board.lock().unwrap().ended.get(&self.n).copied();
            async move { code }
        })
        .await
    }

    fn told(&self, pairs: &[(&str, &str)]) -> Option<Told> {
        self.board
            .lock()
            .unwrap()
            .latest
            .get(&(self.n, key(pairs)))
            .copied()
    }

    /// How many bucket actions this client was sent in all.
    fn actions(&self) -> u64 {
        let board = self.board.lock().unwrap();
        board.actions.get(&self.n).copied().unwrap_or(0)
    }

    /// Waits until this client has been told something about `pairs` that `ok` accepts.
    async fn until(&self, pairs: &[(&str, &str)], ok: impl Fn(Told) -> bool) -> Told {
        poll(Duration::from_secs(10), || {
            let t = self.told(pairs).filter(|t| ok(*t));
            async move { t }
        })
        .await
    }
}

fn record(board: &Mutex<Board>, n: usize, m: RateLimitQuotaResponse) {
    let mut b = board.lock().unwrap();
    *b.actions.entry(n).or_default() += m.bucket_action.len() as u64;
    for a in m.bucket_action {
        let id = a.bucket_id.expect("every action names its bucket");
        let mut k: Key = id.bucket.into_iter().collect();
        k.sort();
        let mut in_force = Duration::ZERO;
        let told = match a.bucket_action.expect("an action") {
            ActionKind::AbandonAction(_) => Told::Abandon,
            ActionKind::QuotaAssignmentAction(q) => {
                let ttl = q.assignment_time_to_live.expect("a TTL");
                assert!(ttl.seconds >= 1 && ttl.nanos == 0, "{ttl:?}");
                in_force = Duration::from_secs(ttl.seconds as u64);
                match q
                    .rate_limit_strategy
                    .and_then(|s| s.strategy)
                    .expect("a strategy")
                {
                    Strategy::BlanketRule(r) if r == BlanketRule::AllowAll as i32 => Told::Allow,
                    Strategy::BlanketRule(_) => Told::Deny,
                    Strategy::TokenBucket(t) => {
                        let fill = t.fill_interval.expect("a fill interval");
                        assert_eq!(fill.nanos, 0);
                        Told::Bucket {
                            max_tokens: t.max_tokens,
                            tokens_per_fill: t.tokens_per_fill.expect("tokens per fill").value,
                            fill_s: fill.seconds,
                        }
                    }
                    Strategy::RequestsPerTimeUnit(_) => {
                        panic!("Envoy ignores requests_per_time_unit")
                    }
                }
            }
        };
        let tokens = |t: Told| t.tokens().map_or(0, |(per_fill, _)| u64::from(per_fill));
        b.in_force.told(n, k.clone(), tokens(told), in_force);
        let was = b.latest.insert((n, k.clone()), told).map_or(0, tokens);
        let sum = b.sums.entry(k.clone()).or_default();
        *sum = *sum + tokens(told) - was;
        let sum = *sum;
        let worst = b.worst_transient.entry(k).or_default();
        *worst = (*worst).max(sum);
    }
}

const POOL: &str = "domain: q
descriptors:
  - key: name
    value: api
    rate_limit: {unit: minute, requests_per_unit: 600}
";

const API: &[(&str, &str)] = &[("name", "api")];

/// Flags with short intervals, so a test's ten report intervals take seconds.
const FAST: &[&str] = &[
    "--rlqs-report-interval",
    "1s",
    "--rlqs-assignment-ttl",
    "3s",
];

/// The simulated Envoys' report interval (Envoy's is 5 s): whole requests per report at the
/// demands below, so what the server measures is exactly what is asked.
/// A server with `files` and `flags` (at least [`FAST`]).
async fn quota_server(files: &[(&str, &str)], flags: &[&str]) -> TestServer {
    TestServer::start_with(files, flags, Arc::new(ratelimitd::testing::SystemClock)).await
}

const TICK: Duration = Duration::from_secs(1);
/// The assignment TTL of [`FAST`].
const TTL: Duration = Duration::from_secs(3);

/// One client's demand, enforced as Envoy would with its assignment.
struct Demand {
    per_second: f64,
    carry: f64,
}

impl Demand {
    fn new(per_second: f64) -> Demand {
        Demand {
            per_second,
            carry: 0.0,
        }
    }

    /// (allowed, denied) over one tick under `told`.
    fn tick(&mut self, told: Option<Told>) -> (u64, u64) {
        self.carry += self.per_second * TICK.as_secs_f64();
        let requests = self.carry.floor();
        self.carry -= requests;
        let allowed = match told.and_then(Told::tokens) {
            Some((per_fill, _)) => {
                requests.min(f64::from(per_fill) / 60.0 * TICK.as_secs_f64() + 1.0)
            }
            None => requests,
        };
        (allowed as u64, (requests - allowed) as u64)
    }
}

/// Three clients asking 1, 6 and 20 per second of one 600-per-minute pool: the small one keeps
/// what it needs, the others split the rest, and the assigned rates never add up past the limit.
/// Then an idle newcomer gets a floor, and a client that leaves gives its share to the others
/// once its lease has run out, not before.
#[tokio::test]
async fn clients_converge_to_fair_shares_within_the_limit() {
    let s = quota_server(&[("q.yaml", POOL)], FAST).await;
    converge(&[&s]).await;
}

/// The same on two replicas sharing one Redis: clients 0 and 2 (the big one) on one, 1 and the
/// newcomer on the other. Every grant comes from one atomic script call on the pool, so what
/// both replicas hand out together stays within the limit.
#[tokio::test]
async fn replicas_on_one_redis_share_one_pool() {
    let target = ["--redis-url".to_string(), redis::shared_standalone().url()];
    let (a, b) = replicas(&target).await;
    converge(&[&a, &b]).await;
}

/// The same on a Redis Cluster (each pool is one key, in its rule's slot).
#[tokio::test]
async fn replicas_on_a_cluster_share_one_pool() {
    let target = [
        "--redis-cluster-nodes".to_string(),
        redis::shared_cluster().urls(),
    ];
    let (a, b) = replicas(&target).await;
    converge(&[&a, &b]).await;
}

/// Two replicas on the Redis `target` names, under one key prefix of their own.
async fn replicas(target: &[String]) -> (TestServer, TestServer) {
    let prefix = redis::unique_prefix();
    let mut flags: Vec<&str> = FAST.to_vec();
    flags.extend(target.iter().map(String::as_str));
    flags.extend(["--backend", "redis", "--redis-key-prefix", &prefix]);
    flags.extend(["--redis-timeout", "2s"]);
    let a = quota_server(&[("q.yaml", POOL)], &flags).await;
    let b = quota_server(&[("q.yaml", POOL)], &flags).await;
    (a, b)
}

/// The convergence scenario, client `n` on `servers[n % servers.len()]`.
async fn converge(servers: &[&TestServer]) {
    let on = |n: usize| servers[n % servers.len()];
    let board = Arc::new(Mutex::new(Board::default()));
    let mut envoys = Vec::new();
    for n in 0..3 {
        envoys.push(Envoy::connect(on(n), n, "q", &board).await);
    }
    let mut demands = [Demand::new(1.0), Demand::new(6.0), Demand::new(20.0)];
    // A new bucket is reported at once, with no time elapsed.
    for e in &envoys {
        e.report(&[(API, 0, 0)], Duration::ZERO).await;
    }
    let started = tokio::time::Instant::now();
    let mut converged = None;
    let mut worst_settled = 0;
    let mut on_arrival = 0;
    for tick in 0..12 {
        tokio::time::sleep(TICK).await;
        // A tick after the last reports, every answer to them has landed. Settled means every
        // client has reported since the last one arrived: a client on another replica that
        // holds what a newcomer needs hears of it at its next report (on one replica, at once).
        let sum = board.lock().unwrap().sum(&key(API));
        if tick == 0 {
            on_arrival = sum;
        } else {
            worst_settled = worst_settled.max(sum);
        }
        for (e, d) in envoys.iter().zip(&mut demands) {
            let (a, r) = d.tick(e.told(API));
            e.report(&[(API, a, r)], TICK).await;
        }
        let t: Vec<Option<(u32, u32)>> = envoys
            .iter()
            .map(|e| e.told(API).and_then(Told::tokens))
            .collect();
        if let [Some(small), Some(mid), Some(big)] = t[..]
            && small.0 >= 60
            && mid.0.abs_diff(big.0) <= 2
            && mid.0 + big.0 + small.0 >= 590
            && converged.is_none()
        {
            converged = Some((tick + 1, started.elapsed()));
        }
    }
    let (intervals, took) = converged.expect("converged");
    assert!(intervals <= 10, "converged after {intervals} intervals");
    let final_tokens: Vec<(u32, u32)> = envoys
        .iter()
        .map(|e| e.told(API).unwrap().tokens().unwrap())
        .collect();
    {
        let b = board.lock().unwrap();
        let k = key(API);
        assert!(
            worst_settled <= 600,
            "rates assigned at once: {worst_settled}"
        );
        assert!(b.max_sum(&k) <= 600, "bursts: {}", b.max_sum(&k));
        println!(
            "{} replica(s): converged after {intervals} intervals ({took:?}); final (tokens per minute, max tokens): {final_tokens:?}; worst sum of rates, settled: {worst_settled} of 600; as clients arrived: {on_arrival}; while answers raced: {}",
            servers.len(),
            b.worst_transient[&k]
        );
    }
    for e in &envoys {
        assert!(matches!(e.told(API), Some(Told::Bucket { fill_s: 60, .. })));
    }

    // An idle newcomer gets a floor at once; the others make room.
    let newcomer = Envoy::connect(on(3), 3, "q", &board).await;
    newcomer.report(&[(API, 0, 0)], Duration::ZERO).await;
    let told = newcomer.until(API, |t| t.tokens().is_some()).await;
    assert!(told.tokens().unwrap().0 >= 1, "{told:?}");
    for _ in 0..4 {
        tokio::time::sleep(TICK).await;
        for (e, d) in envoys.iter().zip(&mut demands) {
            let (a, r) = d.tick(e.told(API));
            e.report(&[(API, a, r)], TICK).await;
        }
        newcomer.report(&[(API, 0, 0)], TICK).await;
    }
    let floor = newcomer.told(API).unwrap().tokens().unwrap().0;
    // A quarter of an equal split: 600 / 4 / 4.
    assert!(floor >= 37, "the idle client's floor: {floor}");
    assert!(board.lock().unwrap().sum(&key(API)) <= 600);

    // The big client leaves: its lease (2 s) still counts, then the middle one gets its need.
    tokio::time::sleep(TICK).await; // every answer to the last reports has landed
    let gone = envoys.pop().unwrap();
    let lease = gone.told(API).unwrap().tokens().unwrap().0;
    drop(gone);
    let left_at = tokio::time::Instant::now();
    let mut grew = None;
    for _ in 0..8 {
        for (e, d) in envoys.iter().zip(&mut demands) {
            let (a, r) = d.tick(e.told(API));
            e.report(&[(API, a, r)], TICK).await;
        }
        newcomer.report(&[(API, 0, 0)], TICK).await;
        tokio::time::sleep(TICK).await;
        let staying: u32 = envoys
            .iter()
            .chain([&newcomer])
            .map(|e| e.told(API).unwrap().tokens().unwrap().0)
            .sum();
        let lease_counts = left_at.elapsed() < TTL - TICK;
        let total = staying + if lease_counts { lease } else { 0 };
        assert!(total <= 600, "{staying} + the lease {lease}");
        let now = envoys[1].told(API).unwrap().tokens().unwrap().0;
        if now >= 360 && grew.is_none() {
            grew = Some(left_at.elapsed());
        }
    }
    let grew = grew.expect("the middle client got its need");
    assert!(grew >= TTL - TICK, "a lease counts until its TTL: {grew:?}");
    println!(
        "{} replica(s): a leaving client's share reached the others after {grew:?} (TTL {TTL:?})",
        servers.len()
    );
}

/// `rlqs.lua` computes the shares as `rlqs::fair_share::fair_shares` does, bit for bit, on
/// random demands (none, zero, tiny, huge, absurd) and capacities (zero included).
#[tokio::test]
async fn the_script_shares_as_the_rust_function_does() {
    let url = redis::shared_standalone().url();
    let mut seed: u64 = 0x9e37_79b9_7f4a_7c15;
    let mut next = move || {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        seed
    };
    for case in 0..300 {
        let n = (next() % 12) as usize;
        let capacity = match case % 10 {
            0 => 0.0,
            1 => 1.0,
            _ => (next() % 100_000) as f64 / (1 + next() % 7) as f64,
        };
        let demands: Vec<Option<f64>> = (0..n)
            .map(|_| match next() % 8 {
                0 => None,
                1 => Some(0.0),
                2 => Some(u64::MAX as f64),
                3 => Some(1e300),
                _ => Some((next() % 1_000_000) as f64 / (1 + next() % 1000) as f64),
            })
            .collect();
        let rust = ratelimitd::testing::fair_shares(capacity, &demands);
        let lua = ratelimitd::testing::script_fair_shares(&url, capacity, &demands)
            .await
            .expect("the script answers");
        assert_eq!(rust, lua, "capacity {capacity}, demands {demands:?}");
    }
}

/// A pass over a pool spans calls (a scan, then a walk over the demands in order); until it
/// ends, grants follow the last pass's terms. The walk keeps its own floor and capacity: a
/// grant made mid-walk never mixes the new pass's capacity and floor with the old pass's
/// level and extra (it did, when the walk overwrote them as it began).
#[tokio::test]
async fn grants_during_a_walk_follow_the_last_pass_terms() {
    use ::redis::Value;
    let node = redis::shared_standalone();
    let client = ::redis::Client::open(node.url()).unwrap();
    let mut con = client.get_multiplexed_async_connection().await.unwrap();
    let script = ::redis::Script::new(include_str!("../src/limiter/redis/rlqs.lua"));
    let tag = redis::unique_prefix();
    let (pool, order) = (format!("{{{tag}}}pool"), format!("{{{tag}}}order"));
    let text = |v: &Value| match v {
        Value::BulkString(b) => String::from_utf8_lossy(b).into_owned(),
        Value::Int(i) => i.to_string(),
        other => panic!("unexpected {other:?}"),
    };
    // {tokens, max, pass[, level, extra, least, cap, free]}, as text.
    let mut call = async |op: &str, member: usize| -> Vec<String> {
        let reply: Vec<Value> = script
            .key(&pool)
            .key(&order)
            .arg(op)
            .arg(format!("m{member}"))
            .arg(100_000)
            .arg(100_000)
            .arg(60_000)
            .arg(60_000)
            .arg("5")
            .arg(0.25)
            .arg(1.1)
            .invoke_async(&mut con)
            .await
            .unwrap();
        reply.iter().map(text).collect()
    };
    // 48 members, three times the members a call advances a pass by.
    let mut last = None;
    for m in (0..48).chain(0..48) {
        let r = call("grant", m).await;
        if r[2] == "1" {
            last = Some((r[5].clone(), r[6].clone()));
        }
    }
    let mut last = last.expect("a pass ended");
    // Half leave: their leases still count, so the next pass has less capacity to share.
    for m in 0..24 {
        let r = call("leave", m).await;
        if r[2] == "1" {
            last = (r[5].clone(), r[6].clone());
        }
    }
    let mut walked_apart = 0;
    for _ in 0..200 {
        let r = call("grant", 40).await;
        if r[2] == "1" {
            last = (r[5].clone(), r[6].clone());
            continue;
        }
        let state = node.cli(&["HGET", &pool, "#"]);
        let f: Vec<&str> = state.split_whitespace().collect();
        assert_eq!(f.len(), 14, "{state}");
        if f[1] == "w" {
            assert_eq!((f[10], f[11]), (&*last.0, &*last.1), "mid-walk: {state}");
            walked_apart += usize::from(f[13] != f[11]);
        }
    }
    assert!(walked_apart > 0, "no walk ran with a capacity of its own");
}

const TENANTS: &str = "domain: q
descriptors:
  - key: tenant
    value: t-*
    share_threshold: true
    rate_limit: {unit: minute, requests_per_unit: 600}
";

/// Shares that fall are pushed without a script call, and shares that rise only as far as the
/// free capacity pays: when 40 new buckets join a pool of 40 on Redis, the 40 already there are
/// pushed their smaller share from the pass terms the new buckets' calls returned. Before, every
/// pass end called Redis once per member pushed (a report of 10,000 buckets joining 20,000 made
/// 90,000 calls), and members below their share were pushed again at every pass end to be told
/// the capacity was still held.
#[tokio::test]
async fn pushes_that_lower_a_share_on_redis_make_no_call() {
    let redis = redis::RedisProc::start(&[]);
    let url = redis.url();
    // Leases and demands that outlast a slow run: a push down calls Redis when the grant it
    // lowers has less than a second left (`RedisPools::lowered`), which a 3 s TTL came to on
    // a CI machine under load (76-86 calls with 3 busy loops beside it on two cores).
    let mut flags = vec![
        "--rlqs-report-interval",
        "10s",
        "--rlqs-assignment-ttl",
        "30s",
    ];
    flags.extend(["--backend", "redis", "--redis-url", &url]);
    // Generous, as for every test not about Redis failing: the second Envoy reports once, and
    // a call past the default 100 ms (a debug build beside a CI build on two cores; seen once)
    // ends in the failure mode `error`, which tells it nothing until its next report.
    flags.extend(["--redis-timeout", "2s"]);
    let server = quota_server(&[("q.yaml", TENANTS)], &flags).await;
    let board = Arc::new(Mutex::new(Board::default()));
    let names: Vec<String> = (0..80).map(|n| format!("t-{n}")).collect();
    let ids: Vec<[(&str, &str); 1]> = names.iter().map(|n| [("tenant", n.as_str())]).collect();
    let first = Envoy::connect(&server, 0, "q", &board).await;
    let second = Envoy::connect(&server, 1, "q", &board).await;
    // 1 request a second each: they ask 66 a minute; 40 of them share 600 (15 each).
    let entries = |range: std::ops::Range<usize>| -> Vec<(Pairs<'_>, u64, u64)> {
        ids[range].iter().map(|id| (&id[..], 1, 0)).collect()
    };
    // Reported until every one holds the fair share, each report's answers all landed before
    // the next: what a bucket was told before an answer still on its way (a CI machine under
    // load) may be the one token a grant into a full pool is, which no push down goes below,
    // and an answer still on its way is script calls counted below.
    let fair = 600 / 40;
    let tokens = |id: &[(&str, &str)]| first.told(id).and_then(Told::tokens).map(|t| t.0);
    for round in 0.. {
        let sent = first.actions();
        first.report(&entries(0..40), TICK).await;
        poll(Duration::from_secs(10), || {
            let landed = first.actions() >= sent + 40;
            async move { landed.then_some(()) }
        })
        .await;
        if ids[..40].iter().all(|id| tokens(id) == Some(fair)) {
            break;
        }
        let told: Vec<Option<u32>> = ids[..40].iter().map(|id| tokens(id)).collect();
        assert!(round < 25, "the first 40 never all held {fair}: {told:?}");
    }
    let held: Vec<u32> = ids[..40].iter().map(|id| tokens(id).unwrap()).collect();
    let calls = || -> u64 {
        let stats = redis.cli(&["INFO", "commandstats"]);
        stats
            .lines()
            .filter(|l| l.starts_with("cmdstat_evalsha:") || l.starts_with("cmdstat_eval:"))
            .filter_map(|l| {
                l.split("calls=")
                    .nth(1)?
                    .split(',')
                    .next()?
                    .parse::<u64>()
                    .ok()
            })
            .sum()
    };
    let before = calls();
    second.report(&entries(40..80), TICK).await;
    for id in &ids[40..] {
        second.until(id, |t| t.tokens().is_some()).await;
    }
    // Every one of the first 40 is pushed a smaller share.
    for (id, was) in ids[..40].iter().zip(&held) {
        first
            .until(id, |t| {
                t.tokens().is_some_and(|(per_fill, _)| per_fill < *was)
            })
            .await;
    }
    let made = calls() - before;
    println!("40 new buckets joining 40: {made} script calls; first shares {held:?}");
    assert!(
        (40..60).contains(&made),
        "{made} script calls for 40 grants and 40 pushes down"
    );
    // Until the pushes down land, each newcomer holds the one token a grant is at least while
    // the first 40 hold the whole limit; once they have landed, the limit.
    let (most, now) = board.lock().unwrap().in_force.most_and_now();
    println!("clients held at most {most} tokens a minute at once, {now} once pushed");
    assert!(
        most <= 600 + 40,
        "clients held {most} tokens a minute at once"
    );
    assert!(
        now <= 600,
        "clients hold {now} tokens a minute after the pushes"
    );
}

/// One report of 10,000 buckets of one pool while an RLS client keeps asking: every RLS request
/// is answered OK, and the whole report is answered. The issue's figures: on memory an RLS call
/// waited 1.9-2.0 s (DEADLINE_EXCEEDED at 2 s in two runs of three) beside 3 x 3,000 buckets of
/// one pool; on Redis 13-20 of ~50 RLS calls got UNAVAILABLE beside 2,000, only 487-964 of them
/// answered. Latency beside it is a benchmark's (`make pools`), not a test's, figure.
async fn a_large_pool_beside_rls(backend: &[&str]) {
    const BUCKETS: usize = 10_000;
    let rls = "domain: r\ndescriptors:\n  - key: k\n    rate_limit: {unit: day, requests_per_unit: 1000000}\n";
    // An assignment TTL shorter than the report takes to decide (seconds in this build): the
    // first grants' leases would run out before the last were decided, and must not run out
    // before their answers reach the client.
    let mut flags = vec![
        "--rlqs-report-interval",
        "500ms",
        "--rlqs-assignment-ttl",
        "1s",
    ];
    flags.extend(["--rlqs-max-bytes", "256MiB"]);
    flags.extend(backend);
    // Room for every bucket's share to be more than the one token each gets at least.
    let pool = TENANTS.replace("600}", "600000}");
    let s = quota_server(&[("q.yaml", &pool), ("r.yaml", rls)], &flags).await;
    let board = Arc::new(Mutex::new(Board::default()));
    let e = Envoy::connect(&s, 0, "q", &board).await;
    let mut c = s.client().await;
    assert!(is_ok(
        c.should_rate_limit(request("r", &[&[("k", "v")]]))
            .await
            .expect("RLS answers")
            .get_ref()
    ));
    e.send(RateLimitQuotaUsageReports {
        domain: "q".into(),
        bucket_quota_usages: (0..BUCKETS)
            .map(|n| BucketQuotaUsage {
                bucket_id: Some(bucket_id(&[("tenant", &format!("t-{n}"))])),
                time_elapsed: Some(PbDuration {
                    seconds: 1,
                    nanos: 0,
                }),
                num_requests_allowed: 1,
                num_requests_denied: 0,
            })
            .collect(),
    })
    .await;
    let answered = || board.lock().unwrap().latest.len();
    // A loaded machine decides the report slowly, not partly: the test fails when answers
    // stop coming (none for 60 s) or take past 300 s in all, not at a fixed time.
    let start = tokio::time::Instant::now();
    let (mut seen, mut progress) = (0, start);
    let (mut ok, mut failed) = (0, Vec::new());
    while answered() < BUCKETS || ok + failed.len() < 50 {
        let now = tokio::time::Instant::now();
        if answered() > seen {
            (seen, progress) = (answered(), now);
        }
        assert!(
            now - progress < Duration::from_secs(60) && now - start < Duration::from_secs(300),
            "{seen} of {BUCKETS} answered in {:?}, none in the last {:?}",
            now - start,
            now - progress
        );
        match c.should_rate_limit(request("r", &[&[("k", "v")]])).await {
            Ok(r) if is_ok(r.get_ref()) => ok += 1,
            Ok(r) => failed.push(format!("{:?}", r.get_ref().overall_code)),
            Err(status) => failed.push(format!("{:?}: {}", status.code(), status.message())),
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    println!("{ok} RLS requests answered OK beside a report of {BUCKETS} buckets of one pool");
    assert!(failed.is_empty(), "{ok} OK, failed: {failed:?}");
    // Each bucket that joined while the pool's capacity was held got the one token a grant is
    // at least (on Redis: the first member was granted the whole limit, and held it until the
    // pass that lowered it ended); once every answer has landed, the limit holds.
    let (most, now) = board.lock().unwrap().in_force.most_and_now();
    println!("clients held at most {most} tokens a minute at once, {now} at the end");
    assert!(
        most <= 600_000 + BUCKETS as u64,
        "clients held {most} tokens a minute at once"
    );
    assert!(
        now <= 600_000,
        "clients hold {now} tokens a minute at the end"
    );
}

#[tokio::test]
async fn a_large_pool_beside_rls_on_memory() {
    a_large_pool_beside_rls(&[]).await;
}

#[tokio::test]
async fn a_large_pool_beside_rls_on_redis() {
    let redis = redis::RedisProc::start(&[]);
    let url = redis.url();
    // A budget of 2 s, not the default 100 ms, as for every test not about Redis failing: the
    // server under test shares this test's one thread with the client and the simulated Envoy,
    // in a debug build, beside the suite's other tests on two cores. (One call in ~290 once
    // failed here at 100 ms, one run in four; at 500 ms, 3 of the 10,000 grants beside a second
    // fresh-clone run, each then left unanswered by the failure mode `error` until a report
    // the simulated Envoy never sends.)
    a_large_pool_beside_rls(&[
        "--backend",
        "redis",
        "--redis-url",
        &url,
        "--redis-timeout",
        "2s",
    ])
    .await;
}

/// While Redis cannot answer, the failure mode decides what a bucket is told: `deny` denies,
/// `local` shares the limit among this replica's own clients, `share` shares this replica's
/// part of it (1/n, n the replicas in `share` counted on Redis: two here), `error` sends
/// nothing (the client keeps its assignment until its TTL, then its own fallback) and keeps
/// the stream. Once Redis is back, the shared pool answers again.
#[tokio::test]
async fn while_redis_is_down_the_failure_mode_decides() {
    let mut redis = redis::RedisProc::start(&[]);
    let url = redis.url();
    let board = Arc::new(Mutex::new(Board::default()));
    let mut servers = Vec::new();
    for mode in ["deny", "local", "error", "share", "share"] {
        let mut flags = FAST.to_vec();
        flags.extend(["--backend", "redis", "--redis-url", &url]);
        flags.extend(["--redis-timeout", "300ms", "--redis-failure-mode", mode]);
        servers.push(quota_server(&[("q.yaml", POOL)], &flags).await);
    }
    let mut envoys = Vec::new();
    for (n, s) in servers.iter().enumerate() {
        let e = Envoy::connect(s, n, "q", &board).await;
        e.report(&[(API, 0, 0)], Duration::ZERO).await;
        e.until(API, |t| t.tokens().is_some()).await;
        envoys.push(e);
    }
    // Each on its own replica: a round of reports settles what the arrivals left.
    for e in &envoys {
        reported(e).await;
    }
    tokio::time::sleep(TICK).await;
    let shared: u64 = board.lock().unwrap().sum(&key(API));
    assert!(shared <= 600, "five clients of one pool: {shared}");
    for s in &servers[3..] {
        poll(Duration::from_secs(10), || async {
            let (_, m) = s.http_get("/metrics").await;
            (metric(&m, "ratelimit_redis_replicas") == 2.0).then_some(())
        })
        .await;
    }

    redis.kill();
    async fn reported(e: &Envoy) {
        e.report(&[(API, 10, 0)], TICK).await;
    }
    /// Reports until `e` is told a rate (tokens per fill) that `ok` accepts.
    async fn told_a_rate(e: &Envoy, ok: impl Fn(u32) -> bool) {
        poll(Duration::from_secs(10), || async {
            reported(e).await;
            tokio::time::sleep(Duration::from_millis(200)).await;
            e.told(API).and_then(Told::tokens).filter(|(t, _)| ok(*t))
        })
        .await;
    }
    for e in &envoys {
        reported(e).await;
    }
    envoys[0].until(API, |t| t == Told::Deny).await;
    // Alone on its replica, the local client gets the whole limit.
    told_a_rate(&envoys[1], |t| t >= 550).await;
    poll(Duration::from_secs(10), || async {
        let (_, m) = servers[2].http_get("/metrics").await;
        (metric(&m, "ratelimit_rlqs_failure_mode_total{mode=\"error\"}") >= 1.0).then_some(())
    })
    .await;
    // Alone on its replica too, the client of a `share` replica gets half the limit.
    told_a_rate(&envoys[3], |t| (250..=300).contains(&t)).await;
    let kept = envoys[2].told(API);
    assert!(kept.and_then(Told::tokens).is_some(), "{kept:?}");
    assert!(!board.lock().unwrap().ended.contains_key(&2));

    // Back: the three share the pool again.
    redis.restart();
    poll(Duration::from_secs(15), || async {
        for e in &envoys {
            reported(e).await;
        }
        tokio::time::sleep(Duration::from_millis(300)).await;
        let shares: Option<Vec<u32>> = envoys
            .iter()
            .map(|e| e.told(API).and_then(Told::tokens).map(|(t, _)| t))
            .collect();
        shares.filter(|s| s.iter().all(|t| *t < 300) && s.iter().sum::<u32>() <= 600)
    })
    .await;
}

/// A bucket id has no order: a nested rule matches whatever order its pairs come in, and one
/// that lands nowhere, on `unlimited`, on a shadow rule or in an unknown domain is allowed
/// explicitly; a zero limit denies. `bucket: {}` (what Envoy sends for an empty header value)
/// is allowed too.
#[tokio::test]
async fn bucket_ids_map_to_rules_in_any_order() {
    let yaml = "domain: n
descriptors:
  - key: tenant
    value: acme
    descriptors:
      - key: user
        rate_limit: {unit: hour, requests_per_unit: 100}
      - key: path
        value: /admin
        rate_limit: {unit: hour, requests_per_unit: 0}
  - key: free
    rate_limit: {unlimited: true}
  - key: trial
    shadow_mode: true
    rate_limit: {unit: hour, requests_per_unit: 1}
";
    let s = quota_server(&[("n.yaml", yaml)], FAST).await;
    let board = Arc::new(Mutex::new(Board::default()));
    let e = Envoy::connect(&s, 0, "n", &board).await;
    type Expect = fn(Told) -> bool;
    let cases: [(Pairs<'_>, Expect); 7] = [
        // Half the hour's 100 at first: a lone bucket with no demand seen asks the floor and
        // is granted at most twice that (docs/rlqs.md, "Fair shares").
        (&[("user", "u1"), ("tenant", "acme")], |t| {
            matches!(
                t,
                Told::Bucket {
                    tokens_per_fill: 50,
                    fill_s: 3600,
                    ..
                }
            )
        }),
        (&[("tenant", "acme"), ("user", "u2")], |t| {
            t.tokens().is_some()
        }),
        (&[("path", "/admin"), ("tenant", "acme")], |t| {
            t == Told::Deny
        }),
        (&[("tenant", "acme")], |t| t == Told::Allow),
        (&[("tenant", "acme"), ("user", "u1"), ("extra", "x")], |t| {
            t == Told::Allow
        }),
        (&[("free", "x")], |t| t == Told::Allow),
        (&[("trial", "x")], |t| t == Told::Allow),
    ];
    for (pairs, _) in &cases {
        e.report(&[(pairs, 0, 0)], Duration::ZERO).await;
    }
    // A bucket id with no pairs names no bucket: skipped, as an absent one (hostile_reports_…).
    e.report(&[(&[], 0, 0)], Duration::ZERO).await;
    for (pairs, ok) in cases {
        let told = e.until(pairs, |_| true).await;
        assert!(ok(told), "{pairs:?}: {told:?}");
    }
    // Seven buckets, two of them limited: one pool per user value.
    let (_, m) = s.http_get("/metrics").await;
    assert_eq!(metric(&m, "ratelimit_rlqs_buckets"), 7.0, "{m}");
    assert_eq!(e.told(&[]), None, "no action for an empty bucket id");
    poll(Duration::from_secs(10), || async {
        let (_, m) = s.http_get("/metrics").await;
        (metric(&m, "ratelimit_rlqs_pools") == 2.0).then_some(())
    })
    .await;

    let other = Envoy::connect(&s, 1, "elsewhere", &board).await;
    other
        .report(&[(&[("user", "u1")], 0, 0)], Duration::ZERO)
        .await;
    assert_eq!(other.until(&[("user", "u1")], |_| true).await, Told::Allow);
}

/// A concurrency limit is not assigned over RLQS (a quota report never releases a place): a
/// bucket on a node with only places is allowed, even with none; beside a rate limit, only the
/// rate limit is assigned; a hold's id entry is an unused key (docs/rlqs.md).
#[tokio::test]
async fn concurrency_limits_are_not_assigned() {
    let yaml = "domain: c
descriptors:
  - key: places
    hold_key: request_id
    rate_limit: {algorithm: concurrency, unit: minute, requests_per_unit: 0}
  - key: mixed
    hold_key: request_id
    rate_limits:
      - {algorithm: concurrency, unit: minute, requests_per_unit: 2}
      - {unit: hour, requests_per_unit: 50}
";
    let s = quota_server(&[("c.yaml", yaml)], FAST).await;
    let board = Arc::new(Mutex::new(Board::default()));
    let e = Envoy::connect(&s, 0, "c", &board).await;
    let places: Pairs<'_> = &[("places", "x")];
    let mixed: Pairs<'_> = &[("mixed", "x")];
    let held: Pairs<'_> = &[("mixed", "x"), ("request_id", "r1")];
    for pairs in [places, mixed, held] {
        e.report(&[(pairs, 0, 0)], Duration::ZERO).await;
    }
    assert_eq!(e.until(places, |_| true).await, Told::Allow);
    let told = e.until(mixed, |_| true).await;
    // The hour's 50, halved while no demand is seen (docs/rlqs.md, "Fair shares").
    assert!(
        matches!(
            told,
            Told::Bucket {
                tokens_per_fill: 25,
                fill_s: 3600,
                ..
            }
        ),
        "{told:?}"
    );
    assert_eq!(e.until(held, |_| true).await, Told::Allow);
}

/// A reload that lowers a limit reaches every client within seconds, still adding up to the
/// new limit; one that removes it allows everything.
#[tokio::test]
async fn reloads_push_new_assignments() {
    let s = quota_server(&[("q.yaml", POOL)], FAST).await;
    let board = Arc::new(Mutex::new(Board::default()));
    let a = Envoy::connect(&s, 0, "q", &board).await;
    let b = Envoy::connect(&s, 1, "q", &board).await;
    for e in [&a, &b] {
        e.report(&[(API, 0, 0)], Duration::ZERO).await;
    }
    for e in [&a, &b] {
        e.report(&[(API, 50, 0)], TICK).await;
    }
    for e in [&a, &b] {
        e.until(API, |t| t.tokens().is_some_and(|(t, _)| t >= 250))
            .await;
    }
    // No reports from here on: what arrives is pushed.
    let lowered = POOL.replace("600", "60");
    s.write("q.yaml", &lowered);
    let at = tokio::time::Instant::now();
    for e in [&a, &b] {
        e.until(API, |t| t.tokens().is_some_and(|(t, _)| t <= 30))
            .await;
    }
    println!("a lowered limit reached both clients in {:?}", at.elapsed());
    assert!(board.lock().unwrap().sum(&key(API)) <= 60);

    s.write("q.yaml", "domain: q\ndescriptors: []\n");
    for e in [&a, &b] {
        e.until(API, |t| t == Told::Allow).await;
    }
}

/// A bucket reported idle for `--rlqs-abandon-after` is abandoned; reported again (Envoy's next
/// request re-creates it), it is assigned again.
#[tokio::test]
async fn idle_buckets_are_abandoned_and_come_back() {
    let mut flags = FAST.to_vec();
    flags.extend(["--rlqs-abandon-after", "2s"]);
    let s = quota_server(&[("q.yaml", POOL)], &flags).await;
    let board = Arc::new(Mutex::new(Board::default()));
    let e = Envoy::connect(&s, 0, "q", &board).await;
    e.report(&[(API, 1, 0)], Duration::ZERO).await;
    e.until(API, |t| t.tokens().is_some()).await;
    let started = tokio::time::Instant::now();
    poll(Duration::from_secs(10), || {
        let e = &e;
        async move {
            e.report(&[(API, 0, 0)], Duration::from_millis(500)).await;
            tokio::time::sleep(Duration::from_millis(500)).await;
            (e.told(API) == Some(Told::Abandon)).then_some(())
        }
    })
    .await;
    assert!(started.elapsed() >= Duration::from_secs(2));
    let (_, m) = s.http_get("/metrics").await;
    assert_eq!(metric(&m, "ratelimit_rlqs_abandons_total"), 1.0);
    assert_eq!(metric(&m, "ratelimit_rlqs_buckets"), 0.0);
    e.report(&[(API, 1, 0)], Duration::ZERO).await;
    e.until(API, |t| t.tokens().is_some()).await;
}

/// Faulty entries are skipped and counted, the rest of the report answered and the stream kept;
/// stream faults end the stream with INVALID_ARGUMENT, a stream past its bucket cap with
/// RESOURCE_EXHAUSTED; absurd counters weigh no more than an honest "everything".
#[tokio::test]
async fn hostile_reports_are_skipped_or_refused() {
    let mut flags = FAST.to_vec();
    flags.extend(["--rlqs-max-buckets", "5", "--max-entries", "4"]);
    let s = quota_server(&[("q.yaml", POOL)], &flags).await;
    let board = Arc::new(Mutex::new(Board::default()));
    let e = Envoy::connect(&s, 0, "q", &board).await;
    let long = "x".repeat(5000);
    let usage = |pairs: Option<Vec<(&str, &str)>>| BucketQuotaUsage {
        bucket_id: pairs.map(|p| BucketId {
            bucket: p.into_iter().map(|(k, v)| (k.into(), v.into())).collect(),
        }),
        time_elapsed: None,
        num_requests_allowed: u64::MAX,
        num_requests_denied: u64::MAX,
    };
    e.send(RateLimitQuotaUsageReports {
        domain: "q".into(),
        bucket_quota_usages: vec![
            usage(None),
            // Present but empty: as absent (it was given an action, allow for 4 s).
            usage(Some(vec![])),
            usage(Some(vec![("name", "")])),
            usage(Some(vec![("", "api")])),
            usage(Some(vec![
                ("a", "1"),
                ("b", "2"),
                ("c", "3"),
                ("d", "4"),
                ("e", "5"),
            ])),
            // A key is Envoy's configuration's, bounded; a value, a client's, is kept whole.
            usage(Some(vec![(long.as_str(), "api")])),
            usage(Some(vec![("name", long.as_str())])),
            usage(Some(vec![("name", "api")])),
        ],
    })
    .await;
    e.until(API, |t| t.tokens().is_some()).await;
    e.until(&[("name", long.as_str())], |_| true).await;
    let (_, m) = s.http_get("/metrics").await;
    for (kind, n) in [
        ("no_bucket_id", 2.0),
        ("empty_key_or_value", 2.0),
        ("too_many_pairs", 1.0),
        ("too_long", 1.0),
    ] {
        let series = format!("ratelimit_rlqs_skipped_entries_total{{kind=\"{kind}\"}}");
        assert_eq!(metric(&m, &series), n, "{kind}\n{m}");
    }
    assert_eq!(e.told(&[]), None, "no action for an empty bucket id");
    // The absurd counters: a second client gets what it would beside an honest greedy one.
    let honest = Envoy::connect(&s, 1, "q", &board).await;
    honest.report(&[(API, 0, 0)], Duration::ZERO).await;
    for _ in 0..3 {
        e.send(RateLimitQuotaUsageReports {
            domain: String::new(),
            bucket_quota_usages: vec![BucketQuotaUsage {
                time_elapsed: Some(PbDuration {
                    seconds: 0,
                    nanos: 1,
                }),
                ..usage(Some(vec![("name", "api")]))
            }],
        })
        .await;
        honest.report(&[(API, 300, 0)], TICK).await;
        tokio::time::sleep(TICK).await;
    }
    let theirs = honest.told(API).unwrap().tokens().unwrap().0;
    assert!(
        theirs >= 290,
        "an absurd neighbour took from the honest client: {theirs}"
    );
    assert!(board.lock().unwrap().sum(&key(API)) <= 600);

    // The bucket cap: five buckets, then the stream ends.
    for i in 0..5 {
        let v = format!("b{i}");
        e.report(&[(&[("name", v.as_str())], 0, 0)], Duration::ZERO)
            .await;
    }
    assert_eq!(e.ended().await, tonic::Code::ResourceExhausted);

    // No domain first, or another domain later: INVALID_ARGUMENT.
    let nameless = Envoy::connect(&s, 2, "", &board).await;
    nameless.report(&[(API, 0, 0)], Duration::ZERO).await;
    let switching = Envoy::connect(&s, 3, "q", &board).await;
    switching.report(&[(API, 0, 0)], Duration::ZERO).await;
    switching
        .send(RateLimitQuotaUsageReports {
            domain: "other".into(),
            bucket_quota_usages: vec![],
        })
        .await;
    for client in [&nameless, &switching] {
        assert_eq!(
            client.ended().await,
            tonic::Code::InvalidArgument,
            "client {}",
            client.n
        );
    }
    let (_, m) = s.http_get("/metrics").await;
    poll(Duration::from_secs(10), || {
        let s = &s;
        async move {
            let (_, m) = s.http_get("/metrics").await;
            (metric(&m, "ratelimit_rlqs_streams") == 1.0).then_some(())
        }
    })
    .await;
    assert!(m.contains("ratelimit_rlqs_assignments_total"));
}

/// The Envoy example for the quota filter: every `@type` in it names a message of Envoy's own
/// protos, and the bucket it builds, reported against the example limits, is assigned the
/// `api_key` rule's quota (the least of its two limits, over the longer window).
#[tokio::test]
async fn the_envoy_example_buckets_meet_the_example_limits() {
    use envoy_types::pb::envoy::extensions::filters::http::rate_limit_quota::v3::{
        RateLimitQuotaBucketSettings, RateLimitQuotaFilterConfig,
    };
    use envoy_types::pb::envoy::extensions::filters::http::router::v3::Router;
    use envoy_types::pb::envoy::extensions::filters::network::http_connection_manager::v3::HttpConnectionManager;
    use envoy_types::pb::envoy::extensions::upstreams::http::v3::HttpProtocolOptions;
    use envoy_types::pb::envoy::r#type::matcher::v3::HttpRequestHeaderMatchInput;
    use prost::Name;

    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let text = std::fs::read_to_string(root.join("examples/envoy/rlqs.yaml")).unwrap();
    let known = [
        RateLimitQuotaFilterConfig::type_url(),
        RateLimitQuotaBucketSettings::type_url(),
        HttpRequestHeaderMatchInput::type_url(),
        HttpConnectionManager::type_url(),
        Router::type_url(),
        HttpProtocolOptions::type_url(),
    ];
    assert_eq!(envoy_types_in(&text, &known), 7);
    let doc: serde_json::Value = serde_saphyr::from_str(&text).unwrap();
    let filter = &doc["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
        ["http_filters"][0]["typed_config"];
    let domain = filter["domain"].as_str().unwrap();
    let settings = &filter["bucket_matchers"]["matcher_list"]["matchers"][0]["on_match"]["action"]
        ["typed_config"];
    let keys: Vec<&String> = settings["bucket_id_builder"]["bucket_id_builder"]
        .as_object()
        .unwrap()
        .keys()
        .collect();
    assert_eq!(keys, ["api_key"]);

    let limits = std::fs::read_to_string(root.join("examples/envoy/limits/config.yaml")).unwrap();
    let s = quota_server(&[("config.yaml", &limits)], FAST).await;
    let board = Arc::new(Mutex::new(Board::default()));
    let e = Envoy::connect(&s, 0, domain, &board).await;
    let bucket: Pairs<'_> = &[("api_key", "k1")];
    e.report(&[(bucket, 0, 0)], Duration::ZERO).await;
    let told = e.until(bucket, |_| true).await;
    // 10 per second over a day is 864,000; the daily limit, 10,000, is the lesser. A burst of
    // at most the per-second limit's 10. Before any demand is seen, half of each (a lone
    // bucket asks the floor, a quarter, and is granted at most twice its ask).
    assert_eq!(
        told,
        Told::Bucket {
            max_tokens: 5,
            tokens_per_fill: 5_000,
            fill_s: 86_400
        }
    );
    // Once a report shows it asking (10 a second is far more than 10,000 a day), all of it.
    let full = Told::Bucket {
        max_tokens: 10,
        tokens_per_fill: 10_000,
        fill_s: 86_400,
    };
    poll(Duration::from_secs(10), || async {
        e.report(&[(bucket, 10, 0)], Duration::from_secs(1)).await;
        tokio::time::sleep(Duration::from_millis(100)).await;
        (e.told(bucket) == Some(full)).then_some(())
    })
    .await;
}

/// What the quota server holds per bucket and per stream, as a fresh daemon's resident memory
/// grows: 20,000 buckets on one stream, each its own pool (a per-user rule, the costliest case:
/// bucket, pool, member and lease); then, in another daemon, 900 streams of one bucket each (on
/// one connection, which carries at most 1,024: a connection's own cost is bounded apart).
#[tokio::test]
async fn memory_per_bucket_and_per_stream_is_bounded() {
    const WARM: usize = 2_000;
    const BUCKETS: usize = 20_000;
    const STREAMS: usize = 900;
    let quota = QuotaDaemon::start().await;
    let tx = quota.open().await;
    for from in (0..WARM).step_by(1000) {
        tx.send(users(from..from + 1000)).await.unwrap();
    }
    quota.answered(WARM).await;
    let before = quota.daemon.rss();
    for from in (WARM..WARM + BUCKETS).step_by(1000) {
        tx.send(users(from..from + 1000)).await.unwrap();
    }
    quota.answered(WARM + BUCKETS).await;
    let per_bucket = quota.daemon.rss().saturating_sub(before) / BUCKETS as u64;
    drop(quota);

    let quota = QuotaDaemon::start().await;
    let mut streams = Vec::new();
    let mut before = 0;
    for n in 0..STREAMS + 100 {
        if n == 100 {
            quota.answered(100).await;
            before = quota.daemon.rss();
        }
        let tx = quota.open().await;
        tx.send(users(n..n + 1)).await.unwrap();
        streams.push(tx);
    }
    quota.answered(STREAMS + 100).await;
    let per_stream = quota.daemon.rss().saturating_sub(before) / STREAMS as u64;
    println!(
        "resident memory: {per_bucket} B per bucket (its own pool), {per_stream} B per stream of one bucket"
    );
    assert!(per_bucket > 0 && per_stream > 0, "the measure moved");
    assert!(per_bucket <= 4096, "{per_bucket} B per bucket");
    assert!(per_stream <= 64 * 1024, "{per_stream} B per stream");
}

/// The bytes a daemon's RLQS buckets are charged now (`ratelimit_rlqs_bytes`).
async fn charged(d: &daemon::Daemon) -> f64 {
    let (_, m) = http_get(d.http, "/metrics").await;
    metric(&m, "ratelimit_rlqs_bytes")
}

/// What a connection's streams may be charged with the default `--rlqs-max-bytes` (64 MiB):
/// a quarter of it.
const CONNECTION_SHARE: f64 = (16 << 20) as f64;

/// How far a server's resident memory may grow past what one connection is charged: decoding
/// the skipped entries, the answers on their way out and what the allocator keeps of them for
/// reuse (measured: 14-39 MiB in the two tests below; a build that held every bucket grew by
/// 162-311 MiB).
const TRANSIENT: u64 = 64 << 20;

/// The RLQS entries a daemon skipped as over its byte budget.
async fn over_budget(d: &daemon::Daemon) -> f64 {
    let (_, m) = http_get(d.http, "/metrics").await;
    metric(
        &m,
        r#"ratelimit_rlqs_skipped_entries_total{kind="over_budget"}"#,
    )
}

/// One connection with 16 streams of 10,000 buckets each (every one its own pool) took
/// 160,000 buckets and grew the server by 292-311 MiB: only the count per stream was bounded.
/// Now the connection's streams hold at most a quarter of `--rlqs-max-bytes` (64 MiB): the rest
/// are skipped and counted, the buckets held keep being answered, and another connection still
/// gets its buckets.
#[tokio::test]
async fn buckets_past_the_byte_budget_are_skipped_and_the_rest_keep_working() {
    const STREAMS: usize = 16;
    const PER_STREAM: usize = 10_000;
    let quota = QuotaDaemon::start_with(&[]).await;
    let before = quota.daemon.rss();
    let mut streams = Vec::new();
    for s in 0..STREAMS {
        let tx = quota.open().await;
        let first = s * PER_STREAM;
        for from in (first..first + PER_STREAM).step_by(1000) {
            tx.send(users(from..from + 1000)).await.unwrap();
        }
        streams.push(tx);
    }
    let total = (STREAMS * PER_STREAM) as f64;
    let (held, skipped) = poll(Duration::from_secs(60), || async {
        let answered = quota.answered.load(std::sync::atomic::Ordering::Relaxed);
        let skipped = over_budget(&quota.daemon).await;
        (answered as f64 + skipped >= total).then_some((answered, skipped))
    })
    .await;
    let grown = quota.daemon.rss().saturating_sub(before);
    println!(
        "{held} buckets held, {skipped} skipped; the server grew by {} KiB, charged {} KiB",
        grown >> 10,
        charged(&quota.daemon).await as u64 >> 10
    );
    assert!(
        held > 4_000 && skipped > 140_000.0,
        "{held} held, {skipped} skipped"
    );
    let charge = charged(&quota.daemon).await;
    assert!(charge <= CONNECTION_SHARE, "charged {charge} B");
    assert!(
        grown < charge as u64 + TRANSIENT,
        "grew by {} MiB, charged {} MiB",
        grown >> 20,
        charge as u64 >> 20
    );
    // A bucket held is answered again.
    let answered = quota.answered.load(std::sync::atomic::Ordering::Relaxed);
    streams[0].send(users(0..1)).await.unwrap();
    quota.answered(answered + 1).await;
    // Another connection has a share of its own.
    let other =
        tonic::transport::Channel::from_shared(format!("http://127.0.0.1:{}", quota.daemon.grpc))
            .unwrap()
            .connect()
            .await
            .unwrap();
    let mut client = RateLimitQuotaServiceClient::new(other);
    let (tx, rx) = mpsc::channel(1);
    tx.send(users(900_000..900_001)).await.unwrap();
    let mut answers = client
        .stream_rate_limit_quotas(ReceiverStream::new(rx))
        .await
        .unwrap()
        .into_inner();
    let answer = tokio::time::timeout(Duration::from_secs(10), answers.message())
        .await
        .expect("answered")
        .unwrap()
        .expect("a message");
    assert_eq!(answer.bucket_action.len(), 1);
}

/// One stream of 201 buckets whose ids are 32 pairs of 4 KiB keys and values (50 MiB sent)
/// grew the server by 162-170 MiB, 3.3 times what was sent: the id was kept three times. Now
/// it is kept once and charged: the connection's share holds about 60 such ids, the rest are
/// skipped.
#[tokio::test]
async fn maximum_size_bucket_ids_are_kept_once_and_within_the_budget() {
    let quota = QuotaDaemon::start_with(&[]).await;
    let before = quota.daemon.rss();
    let tx = quota.open().await;
    let big =
        |i: usize, j: usize, what: char| format!("{i:04}{j:02}{}", what.to_string().repeat(4090));
    const IDS: usize = 201;
    for first in (0..IDS).step_by(3) {
        let report = RateLimitQuotaUsageReports {
            domain: "u".into(),
            bucket_quota_usages: (first..(first + 3).min(IDS))
                .map(|i| BucketQuotaUsage {
                    bucket_id: Some(BucketId {
                        bucket: (0..32).map(|j| (big(i, j, 'k'), big(i, j, 'v'))).collect(),
                    }),
                    time_elapsed: None,
                    num_requests_allowed: 1,
                    num_requests_denied: 0,
                })
                .collect(),
        };
        tx.send(report).await.unwrap();
    }
    let (held, skipped) = poll(Duration::from_secs(60), || async {
        let answered = quota.answered.load(std::sync::atomic::Ordering::Relaxed);
        let skipped = over_budget(&quota.daemon).await;
        (answered as f64 + skipped >= IDS as f64).then_some((answered, skipped))
    })
    .await;
    let grown = quota.daemon.rss().saturating_sub(before);
    println!(
        "{held} maximum-size ids held, {skipped} skipped; the server grew by {} KiB, charged {} KiB",
        grown >> 10,
        charged(&quota.daemon).await as u64 >> 10
    );
    assert!((40..=70).contains(&held), "{held} held, {skipped} skipped");
    let charge = charged(&quota.daemon).await;
    assert!(charge <= CONNECTION_SHARE, "charged {charge} B");
    assert!(
        grown < charge as u64 + TRANSIENT,
        "grew by {} MiB, charged {} MiB",
        grown >> 20,
        charge as u64 >> 20
    );
}

/// A `ratelimitd` process with a per-user rule, and streams to it whose answers are counted.
struct QuotaDaemon {
    daemon: daemon::Daemon,
    channel: tonic::transport::Channel,
    answered: Arc<std::sync::atomic::AtomicUsize>,
    _dir: tempfile::TempDir,
}

impl QuotaDaemon {
    /// Bounds raised far above what a test holds.
    async fn start() -> QuotaDaemon {
        Self::start_with(&["--rlqs-max-buckets", "30000", "--rlqs-max-bytes", "1GiB"]).await
    }

    async fn start_with(flags: &[&str]) -> QuotaDaemon {
        let rule = "domain: u\ndescriptors:\n  - key: user\n    rate_limit: {unit: minute, requests_per_unit: 100}\n";
        let (daemon, dir) = daemon::quiet(rule, flags).await;
        let channel =
            tonic::transport::Channel::from_shared(format!("http://127.0.0.1:{}", daemon.grpc))
                .unwrap()
                .connect()
                .await
                .unwrap();
        QuotaDaemon {
            daemon,
            channel,
            answered: Arc::default(),
            _dir: dir,
        }
    }

    /// A new stream on the one connection; its answers are counted, action by action.
    async fn open(&self) -> mpsc::Sender<RateLimitQuotaUsageReports> {
        let mut client = RateLimitQuotaServiceClient::new(self.channel.clone());
        let (tx, rx) = mpsc::channel(4);
        let mut answers = client
            .stream_rate_limit_quotas(ReceiverStream::new(rx))
            .await
            .expect("stream opened")
            .into_inner();
        let answered = self.answered.clone();
        tokio::spawn(async move {
            while let Ok(Some(m)) = answers.message().await {
                answered.fetch_add(m.bucket_action.len(), std::sync::atomic::Ordering::Relaxed);
            }
        });
        tx
    }

    /// Waits until `n` bucket actions have arrived over all streams.
    async fn answered(&self, n: usize) {
        poll(Duration::from_secs(60), || {
            let done = self.answered.load(std::sync::atomic::Ordering::Relaxed) >= n;
            async move { done.then_some(()) }
        })
        .await;
    }
}

/// A report of one request for each of `range`'s users.
fn users(range: std::ops::Range<usize>) -> RateLimitQuotaUsageReports {
    RateLimitQuotaUsageReports {
        domain: "u".into(),
        bucket_quota_usages: range
            .map(|i| BucketQuotaUsage {
                bucket_id: Some(bucket_id(&[("user", &format!("user-{i:06}"))])),
                time_elapsed: None,
                num_requests_allowed: 1,
                num_requests_denied: 0,
            })
            .collect(),
    }
}

/// A report that does not decode ends its stream with INVALID_ARGUMENT saying why; it used to
/// end with OK, as if the client had closed it.
#[tokio::test]
async fn a_report_that_does_not_decode_ends_the_stream_saying_why() {
    let s = quota_server(&[("q.yaml", POOL)], FAST).await;
    let tcp = tokio::net::TcpStream::connect(s.grpc).await.unwrap();
    let (h2, connection) = h2::client::handshake(tcp).await.unwrap();
    let connection = tokio::spawn(connection);
    let mut h2 = h2.ready().await.unwrap();
    let path = "/envoy.service.rate_limit_quota.v3.RateLimitQuotaService/StreamRateLimitQuotas";
    let req = http::Request::post(format!("http://{}{path}", s.grpc))
        .header("content-type", "application/grpc")
        .header("te", "trailers")
        .body(())
        .unwrap();
    let (response, mut stream) = h2.send_request(req, false).unwrap();
    // One gRPC message of two bytes: field 1 (domain) declared 100 bytes long, none of them there.
    const MESSAGE: [u8; 7] = [0, 0, 0, 0, 2, 0x0a, 100];
    stream
        .send_data(bytes::Bytes::from_static(&MESSAGE), false)
        .unwrap();
    let response = tokio::time::timeout(Duration::from_secs(10), response)
        .await
        .expect("answered")
        .unwrap();
    let (head, mut body) = response.into_parts();
    let status = match head.headers.get("grpc-status") {
        // Trailers only.
        Some(_) => head.headers,
        None => {
            while let Some(chunk) = body.data().await {
                chunk.unwrap();
            }
            tokio::time::timeout(Duration::from_secs(10), body.trailers())
                .await
                .expect("trailers")
                .unwrap()
                .expect("grpc-status in the trailers")
        }
    };
    let code = status.get("grpc-status").unwrap().to_str().unwrap();
    let message = status
        .get("grpc-message")
        .map(|m| m.to_str().unwrap().to_owned())
        .unwrap_or_default();
    assert_eq!(code, "3", "INVALID_ARGUMENT, not OK: {message}");
    assert!(message.contains("decode"), "{message}");
    connection.abort();
}

/// The RLQS pools' calls to Redis go their own way: their connection failing over and over
/// (every connection whose last command was the pool script is killed, as a proxy or a
/// flaky network path would) opens only their circuit. They shared the RLS connection and
/// breaker, so the same kills failed RLS requests beside them.
#[tokio::test]
async fn failing_quota_calls_never_fail_rls_requests() {
    let redis = redis::RedisProc::start(&[]);
    let url = redis.url();
    let rls = "domain: r\ndescriptors:\n  - key: k\n    rate_limit: {unit: day, requests_per_unit: 1000000}\n";
    let mut flags = FAST.to_vec();
    flags.extend(["--backend", "redis", "--redis-url", &url]);
    flags.extend(["--redis-timeout", "300ms", "--redis-failure-mode", "error"]);
    let s = quota_server(&[("q.yaml", POOL), ("r.yaml", rls)], &flags).await;
    let board = Arc::new(Mutex::new(Board::default()));
    let e = Envoy::connect(&s, 0, "q", &board).await;
    e.report(&[(API, 0, 0)], Duration::ZERO).await;
    e.until(API, |t| t.tokens().is_some()).await;
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let killed = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let killer = {
        let (stop, killed, port) = (stop.clone(), killed.clone(), redis.port);
        std::thread::spawn(move || {
            let cli = |args: &[&str]| {
                let out = std::process::Command::new("redis-cli")
                    .args(["-p", &port.to_string()])
                    .args(args)
                    .output()
                    .unwrap();
                String::from_utf8_lossy(&out.stdout).into_owned()
            };
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                for line in cli(&["CLIENT", "LIST"]).lines() {
                    if line.contains("cmd=evalsha") || line.contains("cmd=eval ") {
                        let id = line.split(' ').next().unwrap().trim_start_matches("id=");
                        if cli(&["CLIENT", "KILL", "ID", id]).trim() == "1" {
                            killed.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                        }
                    }
                }
                std::thread::sleep(Duration::from_millis(5));
            }
        })
    };
    let mut c = s.client().await;
    let (mut ok, mut failed) = (0, 0);
    for _ in 0..60 {
        e.report(&[(API, 1, 0)], Duration::from_millis(50)).await;
        match c.should_rate_limit(request("r", &[&[("k", "v")]])).await {
            Ok(r) if is_ok(r.get_ref()) => ok += 1,
            _ => failed += 1,
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    killer.join().unwrap();
    let (_, m) = s.http_get("/metrics").await;
    let kills = killed.load(std::sync::atomic::Ordering::Relaxed);
    assert!(kills >= 3, "the quota connection was killed {kills} times");
    assert_eq!(
        (ok, failed),
        (60, 0),
        "RLS requests beside it ({kills} kills): {m}"
    );
    assert_eq!(metric(&m, "ratelimit_backend_up"), 1.0);
}
