//! The Redis backend against real servers the tests start: several ratelimitd instances
//! sharing counters, key hygiene, every failure mode, stalls, script flushes, start-before-Redis,
//! the over-limit cache, per-descriptor hash tags with refunds, what one call costs Redis, the
//! statuses backend errors become, Sentinel and TLS.

mod common;

use std::path::{Path, PathBuf};
use std::time::Duration;

use tokio::time::Instant;

use common::redis::*;
use common::*;
use envoy_types::pb::google::protobuf::UInt64Value;
use ratelimitd::admin::admin_client::AdminClient;
use ratelimitd::admin::{CounterRequest, Entry};
use ratelimitd::testing::{Algorithm, slot};

fn algorithms_yaml(domain: &str, rpu: u32) -> String {
    let mut y = format!("domain: {domain}\ndescriptors:\n");
    for a in Algorithm::ALL {
        y += &format!(
            "  - key: {a}\n    rate_limit: {{unit: hour, requests_per_unit: {rpu}, algorithm: {a}}}\n"
        );
    }
    y
}

/// Three ratelimitd instances on one Redis target and one key prefix.
async fn instances(target: &[&str], files: &[(&str, &str)], extra: &[&str]) -> Vec<TestServer> {
    let prefix = unique_prefix();
    let mut out = Vec::new();
    for _ in 0..3 {
        out.push(redis_server(files, &[target, extra].concat(), &prefix, "2s").await);
    }
    out
}

async fn clients(servers: &[TestServer]) -> Vec<Client> {
    let mut out = Vec::new();
    for s in servers {
        out.push(s.client().await);
    }
    out
}

/// Sends `n` requests concurrently, round-robin over `clients`; returns how many were admitted.
async fn admitted_of(
    clients: &[Client],
    n: usize,
    make: impl Fn(usize) -> envoy_types::pb::envoy::service::ratelimit::v3::RateLimitRequest,
) -> usize {
    let tasks: Vec<_> = (0..n)
        .map(|i| {
            let mut c = clients[i % clients.len()].clone();
            let req = make(i);
            tokio::spawn(async move { is_ok(&call(&mut c, req).await) })
        })
        .collect();
    let mut admitted = 0;
    for t in tasks {
        admitted += t.await.unwrap() as usize;
    }
    admitted
}

fn check_only(
    domain: &str,
    key: &str,
    value: &str,
) -> envoy_types::pb::envoy::service::ratelimit::v3::RateLimitRequest {
    let mut req = request(domain, &[&[(key, value)]]);
    req.descriptors[0].hits_addend = Some(UInt64Value { value: 0 });
    req
}

async fn shared_counting_is_exact(target: &[&str], nodes: &[&RedisProc]) {
    let servers = instances(target, &[("a.yaml", &algorithms_yaml("shared", 50))], &[]).await;
    let clients = clients(&servers).await;
    for a in Algorithm::ALL {
        let key = a.as_str();
        let admitted = admitted_of(&clients, 150, |_| request("shared", &[&[(key, "x")]])).await;
        assert_eq!(admitted, 50, "{a}");
    }
    let prefix = s_prefix(&servers[0]);
    let keys: Vec<(String, i64)> = nodes
        .iter()
        .flat_map(|n| keys_with_ttl(n, &prefix))
        .collect();
    assert_eq!(keys.len(), Algorithm::ALL.len(), "{keys:?}");
    assert!(
        keys.iter().all(|(_, ttl)| *ttl > 0),
        "every key expires: {keys:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_instances_on_standalone_admit_exactly_the_limit() {
    let redis = shared_standalone();
    shared_counting_is_exact(&["--redis-url", &redis.url()], &[redis]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_instances_on_a_cluster_admit_exactly_the_limit() {
    let cluster = shared_cluster();
    let nodes: Vec<&RedisProc> = cluster.nodes.iter().collect();
    shared_counting_is_exact(&["--redis-cluster-nodes", &cluster.urls()], &nodes).await;
    // The script went to every node as a function library (FCALL, not EVALSHA).
    for node in &nodes {
        assert!(
            node.cli(&["FUNCTION", "LIST"]).contains("ratelimitd_"),
            "node {}",
            node.url()
        );
    }
}

const PAIR: &str = "domain: pair\ndescriptors:\n  - key: tight\n    rate_limit: {unit: hour, requests_per_unit: 20}\n  - key: roomy\n    rate_limit: {unit: hour, requests_per_unit: 1000}\n";

async fn all_or_nothing_under_concurrency(target: &[&str]) {
    let servers = instances(target, &[("p.yaml", PAIR)], &[]).await;
    let clients = clients(&servers).await;
    let admitted = admitted_of(&clients, 100, |_| {
        request("pair", &[&[("roomy", "r")], &[("tight", "t")]])
    })
    .await;
    assert_eq!(admitted, 20);
    let mut c = clients[0].clone();
    let r = call(&mut c, check_only("pair", "roomy", "r")).await;
    assert_eq!(
        r.statuses[0].limit_remaining, 980,
        "rejected requests consumed nothing"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn all_or_nothing_holds_under_concurrency_on_standalone() {
    let url = shared_standalone().url();
    all_or_nothing_under_concurrency(&["--redis-url", &url]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn all_or_nothing_holds_under_concurrency_on_a_cluster() {
    let urls = shared_cluster().urls();
    all_or_nothing_under_concurrency(&["--redis-cluster-nodes", &urls]).await;
}

/// Requests in flight share script calls (with one call in flight at a time, concurrent
/// requests must queue behind it), yet every decision is the one separate calls would give:
/// exactly the limit admitted, each request all-or-nothing on its own, on every algorithm.
/// `--redis-max-batch 1` (one call per request) gives the same decisions.
async fn coalesced_calls_decide_as_separate_calls_would(target: &[&str]) {
    let mut yaml = algorithms_yaml("co", 30);
    yaml += "  - key: roomy\n    rate_limit: {unit: hour, requests_per_unit: 100000}\n";
    for (batch, coalesced) in [("64", true), ("1", false)] {
        let flags = [
            target,
            &["--redis-pipeline", "1", "--redis-max-batch", batch],
        ]
        .concat();
        let servers = instances(&flags, &[("co.yaml", &yaml)], &[]).await;
        let clients = clients(&servers).await;
        for (n, a) in Algorithm::ALL.into_iter().enumerate() {
            let key = a.as_str();
            let admitted = admitted_of(&clients, 120, |i| {
                // The same hot key for all; four roomy values, each for eight requests in a
                // row, so a call holds runs of identical requests and requests unlike them.
                let roomy = format!("r{}", (i / 8) % 4);
                request("co", &[&[(key, "hot")], &[("roomy", &roomy)]])
            })
            .await;
            assert_eq!(admitted, 30, "{a}, max batch {batch}");
            let mut c = clients[0].clone();
            let mut roomy_used = 0;
            for r in 0..4 {
                let resp = call(&mut c, check_only("co", "roomy", &format!("r{r}"))).await;
                roomy_used += 100_000 - resp.statuses[0].limit_remaining;
            }
            let expected = 30 * (1 + n as u32);
            assert_eq!(roomy_used, expected, "{a}: rejected requests took nothing");
        }
        let mut calls = 0.0;
        let mut requests = 0.0;
        for s in &servers {
            let (_, text) = s.http_get("/metrics").await;
            calls += metric(&text, "ratelimit_redis_batch_requests_count");
            requests += metric(&text, "ratelimit_redis_batch_requests_sum");
        }
        assert!(requests >= 4.0 * 120.0, "{requests} requests");
        if coalesced {
            assert!(
                calls < requests,
                "{calls} calls for {requests} requests: none coalesced"
            );
        } else {
            assert_eq!(calls, requests, "max batch 1 makes one call per request");
        }
    }
}

/// A call goes at once while fewer than `--redis-pipeline` are in flight; with the pipeline
/// full, requests wait and then share one call. (Redis holds the calls with CLIENT PAUSE; the
/// calls are counted from the metrics.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_behind_a_full_pipeline_share_the_next_call() {
    let redis = RedisProc::start(&[]);
    let url = redis.url();
    let flags = ["--redis-url", url.as_str(), "--redis-pipeline", "2"];
    let s = redis_server(&[("f.yaml", ONE)], &flags, &unique_prefix(), "10s").await;
    let c = s.client().await;
    let calls = || async {
        let (_, text) = s.http_get("/metrics").await;
        (
            metric(&text, "ratelimit_redis_batch_requests_count"),
            metric(&text, "ratelimit_redis_batch_requests_sum"),
        )
    };
    // Loads the script; then the counts start from here.
    assert!(is_ok(
        &call(&mut c.clone(), request("f", &[&[("s", "warm")]])).await
    ));
    let (calls0, requests0) = calls().await;
    redis.cli(&["CLIENT", "PAUSE", "3000", "WRITE"]);
    let send = |name: String| {
        let mut c = c.clone();
        tokio::spawn(async move { call(&mut c, request("f", &[&[("s", &name)]])).await })
    };
    // One call in flight, then a second: it goes at once, not after the first.
    let mut first = Vec::new();
    for (i, name) in ["first", "second"].into_iter().enumerate() {
        first.push(send(name.to_owned()));
        poll(Duration::from_secs(5), || async {
            (calls().await.0 == calls0 + 1.0 + i as f64).then_some(())
        })
        .await;
    }
    let behind: Vec<_> = (0..10).map(|i| send(format!("behind{i}"))).collect();
    for r in first {
        assert!(is_ok(&r.await.expect("a request in the pipeline")));
    }
    for b in behind {
        assert!(is_ok(&b.await.expect("a request behind it")));
    }
    let (calls1, requests1) = calls().await;
    assert_eq!(requests1 - requests0, 12.0);
    assert_eq!(
        calls1 - calls0,
        3.0,
        "two calls in flight, then one call for the ten behind them"
    );
}

/// A call answered `Timeout` that Redis has not answered yet keeps its place among the calls
/// in flight, but nobody waits for it: a request behind it is sent at once, not after it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_call_nobody_waits_for_holds_up_no_request() {
    let redis = RedisProc::start(&[]);
    let url = redis.url();
    let flags = ["--redis-url", url.as_str(), "--redis-pipeline", "2"];
    let s = redis_server(&[("f.yaml", ONE)], &flags, &unique_prefix(), "300ms").await;
    let mut c = s.client().await;
    let calls = || async {
        let (_, text) = s.http_get("/metrics").await;
        metric(&text, "ratelimit_redis_batch_requests_count")
    };
    assert!(is_ok(
        &call(&mut c, request("f", &[&[("s", "warm")]])).await
    ));
    let calls0 = calls().await;
    redis.cli(&["CLIENT", "PAUSE", "5000", "WRITE"]);
    let first = c
        .should_rate_limit(request("f", &[&[("s", "first")]]))
        .await;
    assert_eq!(
        first.map_err(|e| e.code()).err(),
        Some(tonic::Code::Unavailable),
        "answered when its budget ran out"
    );
    let second = tokio::spawn({
        let mut c = c.clone();
        async move {
            c.should_rate_limit(request("f", &[&[("s", "second")]]))
                .await
        }
    });
    // Sent while Redis still holds the first call (the pause lasts 5 s).
    poll(Duration::from_millis(2500), || async {
        (calls().await == calls0 + 2.0).then_some(())
    })
    .await;
    redis.cli(&["CLIENT", "UNPAUSE"]);
    let _ = second.await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn coalesced_calls_decide_as_separate_calls_would_on_standalone() {
    let url = shared_standalone().url();
    coalesced_calls_decide_as_separate_calls_would(&["--redis-url", &url]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn coalesced_calls_decide_as_separate_calls_would_on_a_cluster() {
    let urls = shared_cluster().urls();
    coalesced_calls_decide_as_separate_calls_would(&["--redis-cluster-nodes", &urls]).await;
}

/// Moves the slot of `{tag}` to another master while traffic flows: MOVED and ASK are
/// followed, nothing is lost or double counted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slot_migration_under_traffic_loses_nothing() {
    let cluster = RedisCluster::start();
    let domain = "migrating";
    let yaml = format!(
        "domain: {domain}\ndescriptors:\n  - key: k\n    rate_limit: {{unit: hour, requests_per_unit: 100000}}\n"
    );
    let s = start_cluster_server(&cluster, &yaml).await;
    let mut c = s.client().await;
    let slot = cluster.nodes[0].cli(&["CLUSTER", "KEYSLOT", domain]);
    let src = cluster.node_for_key(domain);
    let dst = cluster.nodes.iter().find(|n| n.port != src.port).unwrap();
    let id = |n: &RedisProc| n.cli(&["CLUSTER", "MYID"]);
    let (src_id, dst_id) = (id(src), id(dst));

    let traffic = {
        let c = c.clone();
        tokio::spawn(async move {
            let mut sent = 0u64;
            let started = Instant::now();
            while started.elapsed() < Duration::from_secs(2) {
                let mut c = c.clone();
                let r = call(&mut c, request(domain, &[&[("k", "v")]])).await;
                assert!(is_ok(&r), "every request decided during the migration");
                sent += 1;
            }
            sent
        })
    };
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(
        dst.cli(&["CLUSTER", "SETSLOT", &slot, "IMPORTING", &src_id]),
        "OK"
    );
    assert_eq!(
        src.cli(&["CLUSTER", "SETSLOT", &slot, "MIGRATING", &dst_id]),
        "OK"
    );
    tokio::time::sleep(Duration::from_millis(300)).await; // traffic meets ASK redirections
    let keys = src.cli(&["CLUSTER", "GETKEYSINSLOT", &slot, "100"]);
    for key in keys.lines().filter(|k| !k.is_empty()) {
        let port = dst.port.to_string();
        src.cli(&["MIGRATE", "127.0.0.1", &port, key, "0", "5000"]);
    }
    for n in &cluster.nodes {
        n.cli(&["CLUSTER", "SETSLOT", &slot, "NODE", &dst_id]);
    }
    let sent = traffic.await.unwrap();
    let r = call(&mut c, check_only(domain, "k", "v")).await;
    assert_eq!(
        100_000 - r.statuses[0].limit_remaining as u64,
        sent,
        "each admitted request counted once"
    );
    assert_eq!(cluster.node_for_key(domain).port, dst.port);
}

async fn start_cluster_server(cluster: &RedisCluster, yaml: &str) -> TestServer {
    let target = ["--redis-cluster-nodes", &cluster.urls()];
    redis_server(&[("m.yaml", yaml)], &target, &unique_prefix(), "2s").await
}

#[tokio::test]
async fn restarting_an_instance_mid_window_keeps_the_count() {
    let url = shared_standalone().url();
    let (prefix, target, files) = (unique_prefix(), ["--redis-url", &url], [("p.yaml", PAIR)]);
    let mut a = redis_server(&files, &target, &prefix, "2s").await;
    let mut c = a.client().await;
    for _ in 0..15 {
        assert!(is_ok(
            &call(&mut c, request("pair", &[&[("tight", "t")]])).await
        ));
    }
    a.shutdown().await.unwrap();
    let b = redis_server(&files, &target, &prefix, "2s").await;
    let mut c = b.client().await;
    let mut admitted = 0;
    for _ in 0..10 {
        admitted += is_ok(&call(&mut c, request("pair", &[&[("tight", "t")]])).await) as usize;
    }
    assert_eq!(admitted, 5);
}

const HOSTILE: [&str; 11] = [
    "a}b",
    "a%7Db",
    "{x}",
    "x",
    "a:b",
    "a_b",
    "a%3Ab",
    "line\nbreak",
    "line%0Abreak",
    "",
    "ü{}",
];

/// Hostile values never collide, every key stays in the domain's slot, every key has a TTL.
#[tokio::test]
async fn keys_are_injective_slotted_by_domain_and_always_expire() {
    let cluster = shared_cluster();
    let yaml = format!(
        "{}  - key: v\n    rate_limit: {{unit: hour, requests_per_unit: 1}}\n",
        algorithms_yaml("hostile", 5)
    );
    let s = start(Kind::Cluster, &[("h.yaml", &yaml)], &[]).await;
    let prefix = s_prefix(&s);
    let mut c = s.client().await;
    for v in HOSTILE {
        assert!(
            is_ok(&call(&mut c, request("hostile", &[&[("v", v)]])).await),
            "{v:?}"
        );
    }
    for v in HOSTILE {
        assert!(
            is_over(&call(&mut c, request("hostile", &[&[("v", v)]])).await),
            "{v:?}"
        );
    }
    for a in Algorithm::ALL {
        call(&mut c, request("hostile", &[&[(a.as_str(), "{evil}:\n")]])).await;
    }
    let domain_slot = cluster.nodes[0].cli(&["CLUSTER", "KEYSLOT", "hostile"]);
    let mut keys = Vec::new();
    for node in &cluster.nodes {
        keys.extend(keys_with_ttl(node, &prefix));
    }
    assert_eq!(keys.len(), HOSTILE.len() + Algorithm::ALL.len(), "{keys:?}");
    for (key, ttl) in &keys {
        assert!(*ttl > 0, "{key:?} has PTTL {ttl}");
        assert!(key.starts_with(&format!("{prefix}{{hostile}}")), "{key:?}");
        assert_eq!(
            cluster.nodes[0].cli(&["CLUSTER", "KEYSLOT", key]),
            domain_slot,
            "{key:?}"
        );
    }
}

/// The key prefix a server was given (for inspecting its keys).
fn s_prefix(s: &TestServer) -> String {
    s.flags
        .iter()
        .position(|f| f == "--redis-key-prefix")
        .map(|i| s.flags[i + 1].clone())
        .expect("a redis server")
}

const ONE: &str = "domain: f\ndescriptors:\n  - key: k\n    rate_limit: {unit: hour, requests_per_unit: 2}\n  - key: s\n    shadow_mode: true\n    rate_limit: {unit: hour, requests_per_unit: 1}\n";

async fn fault_server(redis: &RedisProc, extra: &[&str]) -> TestServer {
    let url = redis.url();
    let target = [&["--redis-url", url.as_str()], extra].concat();
    redis_server(&[("f.yaml", ONE)], &target, &unique_prefix(), "100ms").await
}

/// Answers every call within the timeout plus a margin for a debug build on a busy machine.
const ANSWER_BOUND: Duration = Duration::from_millis(100 + 150);

async fn timed(
    c: &mut Client,
    req: envoy_types::pb::envoy::service::ratelimit::v3::RateLimitRequest,
) -> (Result<bool, tonic::Code>, Duration) {
    let started = Instant::now();
    let r = c.should_rate_limit(req).await;
    (
        r.map(|r| is_ok(r.get_ref())).map_err(|s| s.code()),
        started.elapsed(),
    )
}

#[tokio::test]
async fn a_killed_redis_is_answered_fast_in_every_failure_mode_and_recovers() {
    for mode in ["error", "allow", "deny", "local"] {
        let mut redis = RedisProc::start(&[]);
        let s = fault_server(&redis, &["--redis-failure-mode", mode]).await;
        let mut c = s.client().await;
        assert!(
            is_ok(&call(&mut c, request("f", &[&[("k", "v")]])).await),
            "{mode}"
        );
        redis.kill();
        let mut answers = Vec::new();
        for _ in 0..6 {
            let (answer, took) = timed(&mut c, request("f", &[&[("k", "v")]])).await;
            assert!(took < ANSWER_BOUND, "{mode}: answered after {took:?}");
            answers.push(answer);
        }
        match mode {
            "error" => assert!(
                answers.iter().all(|a| *a == Err(tonic::Code::Unavailable)),
                "{answers:?}"
            ),
            "allow" => assert!(answers.iter().all(|a| *a == Ok(true)), "{answers:?}"),
            "deny" => assert!(answers.iter().all(|a| *a == Ok(false)), "{answers:?}"),
            _ => assert_eq!(
                answers,
                [
                    Ok(true),
                    Ok(true),
                    Ok(false),
                    Ok(false),
                    Ok(false),
                    Ok(false)
                ],
                "local: 2 per hour, counted here"
            ),
        }
        if mode == "deny" {
            // Shadow-only requests are still admitted in deny mode.
            assert_eq!(
                timed(&mut c, request("f", &[&[("s", "v")]])).await.0,
                Ok(true)
            );
        }
        let (_, m) = s.http_get("/metrics").await;
        assert!(
            metric(
                &m,
                &format!("ratelimit_failure_mode_decisions_total{{mode=\"{mode}\"}}")
            ) >= 6.0,
            "{m}"
        );
        assert_eq!(metric(&m, "ratelimit_backend_up"), 0.0);

        redis.restart();
        // The probe notices, and then Redis decides again: the failure mode stops counting.
        poll(Duration::from_secs(10), || async {
            let (_, m) = s.http_get("/metrics").await;
            (metric(&m, "ratelimit_backend_up") == 1.0).then_some(())
        })
        .await;
        // The probe says up only once the calls' connection answers too: the next call is
        // decided by Redis, nothing counted by the failure mode, and it is the first counted
        // there.
        let series = format!("ratelimit_failure_mode_decisions_total{{mode=\"{mode}\"}}");
        let before = s.metric(&series).await;
        let r = c
            .should_rate_limit(request("f", &[&[("k", "v")]]))
            .await
            .expect("decided by Redis")
            .into_inner();
        assert_eq!(s.metric(&series).await, before);
        assert!(is_ok(&r), "{mode}: Redis is empty again");
        assert_eq!(r.statuses[0].limit_remaining, 1, "{mode}: counted in Redis");
    }
}

#[tokio::test]
async fn a_stalled_redis_is_answered_within_the_timeout_and_recovers() {
    let redis = RedisProc::start(&["--enable-debug-command", "yes"]);
    let s = fault_server(&redis, &[]).await;
    let mut c = s.client().await;
    assert!(is_ok(&call(&mut c, request("f", &[&[("k", "v")]])).await));
    // Long enough for the circuit to open (a confirming PING gets 0.5 s) with time to spare.
    let mut stall = redis.stall(3.0);
    // Wait for the stall to begin: the first request that times out.
    poll(Duration::from_secs(2), || {
        let mut c = c.clone();
        async move {
            let (answer, _) = timed(&mut c, request("f", &[&[("k", "v")]])).await;
            (answer == Err(tonic::Code::Unavailable)).then_some(())
        }
    })
    .await;
    // Every request is answered within its budget while the breaker makes up its mind, and
    // once it has opened; it opens while the stall lasts.
    let circuit_open = r#"ratelimit_backend_errors_total{kind="circuit_open"}"#;
    let (mut slowest, mut asked) = (Duration::ZERO, 0);
    let until = Instant::now() + Duration::from_secs(3);
    while s.metric(circuit_open).await < 1.0 {
        assert!(
            Instant::now() < until,
            "still closed after {asked} timed-out requests"
        );
        let (answer, took) = timed(&mut c, request("f", &[&[("k", "v")]])).await;
        assert_eq!(answer, Err(tonic::Code::Unavailable));
        slowest = slowest.max(took);
        asked += 1;
    }
    assert!(
        slowest < ANSWER_BOUND,
        "slowest of {asked} answers {slowest:?}"
    );
    let _ = stall.wait();
    // Calls that timed out were still queued in Redis and may have counted (never admitted):
    // recovery is checked on a fresh counter.
    poll(Duration::from_secs(10), || {
        let mut c = c.clone();
        async move { is_ok(&call(&mut c, request("f", &[&[("k", "after")]])).await).then_some(()) }
    })
    .await;
    let (_, m) = s.http_get("/metrics").await;
    assert!(
        metric(&m, r#"ratelimit_backend_errors_total{kind="timeout"}"#) >= 1.0,
        "{m}"
    );
}

/// The script runs as a function library; a Redis that lost it (restarted without
/// persistence, flushed) gets it again on the next call, which is answered as usual.
#[tokio::test]
async fn a_function_and_script_flush_is_recovered_transparently() {
    let redis = RedisProc::start(&[]);
    let s = fault_server(&redis, &[]).await;
    let mut c = s.client().await;
    assert!(is_ok(&call(&mut c, request("f", &[&[("k", "v")]])).await));
    assert!(
        redis.cli(&["FUNCTION", "LIST"]).contains("ratelimitd_"),
        "the script is loaded as a function"
    );
    assert_eq!(redis.cli(&["FUNCTION", "FLUSH"]), "OK");
    assert_eq!(redis.cli(&["SCRIPT", "FLUSH"]), "OK");
    let r = call(&mut c, request("f", &[&[("k", "v")]])).await;
    assert!(is_ok(&r));
    assert_eq!(
        r.statuses[0].limit_remaining, 0,
        "the count survived the flush"
    );
    assert!(redis.cli(&["FUNCTION", "LIST"]).contains("ratelimitd_"));
    let stats = redis.cli(&["INFO", "commandstats"]);
    assert!(!stats.contains("cmdstat_evalsha"), "{stats}");
}

/// A user whose ACL forbids functions (as a Redis before 7 has none) is served by EVALSHA,
/// with the same answers.
#[tokio::test]
async fn a_user_who_may_not_load_functions_is_served_by_evalsha() {
    let redis = RedisProc::start(&[]);
    redis.cli(&[
        "ACL",
        "SETUSER",
        "limiter",
        "on",
        ">secret",
        "~*",
        "&*",
        "+@all",
        "-function",
        "-fcall",
        "-fcall_ro",
    ]);
    let url = redis.url().replace("redis://", "redis://limiter:secret@");
    let target = ["--redis-url", url.as_str()];
    let s = redis_server(&[("f.yaml", ONE)], &target, &unique_prefix(), "1s").await;
    let mut c = s.client().await;
    let remaining: Vec<u32> = {
        let mut r = Vec::new();
        for _ in 0..3 {
            let answer = call(&mut c, request("f", &[&[("k", "v")]])).await;
            r.push(answer.statuses[0].limit_remaining);
        }
        r
    };
    assert_eq!(remaining, [1, 0, 0], "2 an hour, counted as with functions");
    assert_eq!(redis.cli(&["FUNCTION", "LIST"]), "", "nothing was loaded");
    let stats = redis.cli(&["INFO", "commandstats"]);
    assert!(stats.contains("cmdstat_evalsha"), "{stats}");
}

#[tokio::test]
async fn starting_before_redis_is_not_a_crash() {
    let port = free_port();
    let url = format!("redis://127.0.0.1:{port}");
    let target = ["--redis-url", &url];
    let s = redis_server(&[("f.yaml", ONE)], &target, &unique_prefix(), "100ms").await;
    let mut c = s.client().await;
    let (answer, took) = timed(&mut c, request("f", &[&[("k", "v")]])).await;
    assert_eq!(answer, Err(tonic::Code::Unavailable));
    assert!(took < ANSWER_BOUND, "{took:?}");
    poll(Duration::from_secs(5), || async {
        let (status, body) = s.http_get("/healthcheck").await;
        (status == 200 && body.contains("backend: unavailable")).then_some(())
    })
    .await;
    let _redis = RedisProc::start_on(port, &[]);
    // Down at start, the circuit is open: calls get the failure mode until a probe (every
    // 100 ms while Redis is down) finds it back.
    poll(Duration::from_secs(10), || {
        let mut c = c.clone();
        async move {
            let r = c.should_rate_limit(request("f", &[&[("k", "v")]])).await;
            r.is_ok_and(|r| is_ok(r.get_ref())).then_some(())
        }
    })
    .await;
    poll(Duration::from_secs(5), || async {
        (s.http_get("/healthcheck").await.1 == "OK").then_some(())
    })
    .await;
}

#[tokio::test]
async fn the_over_limit_cache_answers_without_redis_but_never_for_shadow_rules() {
    let mut redis = RedisProc::start(&[]);
    let s = fault_server(&redis, &["--local-cache-bytes", "64KiB"]).await;
    let mut c = s.client().await;
    for _ in 0..2 {
        assert!(is_ok(&call(&mut c, request("f", &[&[("k", "v")]])).await));
    }
    assert!(
        is_over(&call(&mut c, request("f", &[&[("k", "v")]])).await),
        "over: now cached"
    );
    call(&mut c, request("f", &[&[("s", "v")]])).await;
    call(&mut c, request("f", &[&[("s", "v")]])).await; // shadow over: not cached
    redis.kill();
    let r = call(&mut c, request("f", &[&[("k", "v")], &[("k", "other")]])).await;
    assert!(is_over(&r), "answered from the cache with Redis gone");
    assert!(r.statuses[0].duration_until_reset.is_some());
    let (_, m) = s.http_get("/metrics").await;
    assert_eq!(metric(&m, "ratelimit_local_cache_hits_total"), 1.0);
    let shadow = c.should_rate_limit(request("f", &[&[("s", "v")]])).await;
    assert_eq!(
        shadow.unwrap_err().code(),
        tonic::Code::Unavailable,
        "shadow rules are never cached"
    );
}

/// Two descriptor values whose per-descriptor hash tags live on different cluster nodes.
fn values_on_different_nodes(cluster: &RedisCluster) -> (String, String) {
    let node = |v: &str| cluster.node_for_key(&format!("{{pair:roomy:{v}}}")).port;
    let a = "r0".to_string();
    let b = (1..)
        .map(|i| format!("t{i}"))
        .find(|v| cluster.node_for_key(&format!("{{pair:tight:{v}}}")).port != node(&a))
        .unwrap();
    (a, b)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn descriptor_hash_tags_spread_and_refund_but_never_over_admit() {
    let cluster = shared_cluster();
    let (roomy, tight) = values_on_different_nodes(cluster);
    let urls = cluster.urls();
    let servers = instances(
        &["--redis-cluster-nodes", &urls],
        &[("p.yaml", PAIR)],
        &["--redis-hash-tag", "descriptor"],
    )
    .await;
    let clients = clients(&servers).await;
    let (r, t) = (roomy.clone(), tight.clone());
    let admitted = admitted_of(&clients, 100, move |_| {
        request("pair", &[&[("roomy", &r)], &[("tight", &t)]])
    })
    .await;
    assert!(
        (1..=20).contains(&admitted),
        "never over-admits: {admitted}"
    );
    let mut c = clients[0].clone();
    let roomy_left = call(&mut c, check_only("pair", "roomy", &roomy))
        .await
        .statuses[0]
        .limit_remaining;
    let tight_left = call(&mut c, check_only("pair", "tight", &tight))
        .await
        .statuses[0]
        .limit_remaining;
    assert_eq!(
        1000 - roomy_left as usize,
        admitted,
        "rejected requests were refunded"
    );
    assert_eq!(20 - tight_left as usize, admitted);
    // The two counters really are on different nodes.
    let prefix = s_prefix(&servers[0]);
    let holders: Vec<usize> = cluster
        .nodes
        .iter()
        .map(|n| keys_with_ttl(n, &prefix).len())
        .collect();
    assert_eq!(holders.iter().filter(|&&k| k > 0).count(), 2, "{holders:?}");
}

/// A master, a replica and one Sentinel: requests go to the master Sentinel names, and after
/// the master dies they follow the failover to the promoted replica, counts included.
#[tokio::test]
async fn sentinel_finds_the_master_and_follows_a_failover() {
    follows_a_failover(&[]).await;
}

/// With `--redis-tls-skip-hostname-verification` the master is found without the redis
/// crate's Sentinel client (whose connection to the master always checks names): that path
/// follows a failover too.
#[tokio::test]
async fn sentinel_found_by_hand_follows_a_failover() {
    follows_a_failover(&["--redis-tls-skip-hostname-verification"]).await;
}

async fn follows_a_failover(extra: &[&str]) {
    // The replica's first sync at once, not after the default 5 s wait for more replicas.
    let mut master = RedisProc::start(&["--repl-diskless-sync-delay", "0"]);
    let master_addr = master.port.to_string();
    let replica = RedisProc::start(&["--replicaof", "127.0.0.1", &master_addr]);
    let sentinel = RedisProc::start_sentinel(
        master.port,
        "sentinel down-after-milliseconds main 400\nsentinel failover-timeout main 2000\n",
        &[],
    );
    let sentinel_url = sentinel.url();
    let prefix = unique_prefix();
    let target = [
        &[
            "--redis-sentinel-nodes",
            &sentinel_url,
            "--redis-sentinel-master",
            "main",
        ],
        extra,
    ]
    .concat();
    let s = redis_server(&[("f.yaml", ONE)], &target, &prefix, "500ms").await;
    let mut c = s.client().await;
    admits_exactly(&mut c, &request("f", &[&[("k", "v")]]), 2).await;
    assert_eq!(
        keys_with_ttl(&master, &prefix).len(),
        1,
        "counted on the master"
    );
    // Generous: two of these tests may sync their replicas at once on a loaded machine.
    poll(Duration::from_secs(30), || async {
        (keys_with_ttl(&replica, &prefix).len() == 1).then_some(())
    })
    .await;

    master.kill();
    // Sentinel promotes the replica; ratelimitd asks the sentinel again and carries on.
    poll(Duration::from_secs(30), || {
        let mut c = c.clone();
        async move {
            let r = c
                .should_rate_limit(request("f", &[&[("k", "after")]]))
                .await
                .ok()?;
            is_ok(r.get_ref()).then_some(())
        }
    })
    .await;
    assert!(replica.cli(&["ROLE"]).starts_with("master"));
    assert!(
        is_over(&call(&mut c, request("f", &[&[("k", "v")]])).await),
        "the count survived the failover"
    );
}

/// The suites run on the server they were asked to (`make test` runs them again on Valkey):
/// `INFO server` names it.
#[test]
fn the_server_is_the_one_asked_for() {
    let redis = RedisProc::start(&[]);
    let info = redis.cli(&["INFO", "server"]);
    let valkey = info.contains("server_name:valkey");
    assert_eq!(
        valkey,
        common::redis::server_binary().contains("valkey"),
        "{info}"
    );
    let version = |name: &str| info.lines().find(|l| l.starts_with(name));
    eprintln!(
        "running on {}",
        version("valkey_version:")
            .or(version("redis_version:"))
            .unwrap_or("?")
    );
}

#[tokio::test]
async fn tls_with_a_private_ca() {
    let certs_dir = tempfile::tempdir().unwrap();
    let certs = make_certs(certs_dir.path());
    let redis = RedisProc::start_tls(&certs);
    let url = redis.url();
    assert!(url.starts_with("rediss://"));
    let ca = certs.join("ca.crt");
    let prefix = unique_prefix();
    let target = ["--redis-url", &url, "--redis-tls-ca", ca.to_str().unwrap()];
    let s = redis_server(&[("f.yaml", ONE)], &target, &prefix, "2s").await;
    let mut c = s.client().await;
    assert!(is_ok(&call(&mut c, request("f", &[&[("k", "v")]])).await));
    assert_eq!(keys_with_ttl(&redis, &prefix).len(), 1);
}

/// `--redis-tls-skip-hostname-verification` (REDIS_TLS_SKIP_HOSTNAME_VERIFICATION): a server
/// certificate for another name is refused without it and accepted with it, while one from
/// another CA is refused either way (the chain is still verified).
#[tokio::test]
async fn tls_hostname_verification_can_be_skipped_and_only_it() {
    let certs_dir = tempfile::tempdir().unwrap();
    let certs = certs_naming_elsewhere(certs_dir.path());
    let redis = RedisProc::start_tls_as(&certs, "elsewhere");
    let url = redis.url();
    let ca = certs.join("ca.crt");
    let answers = |ca: &Path, skip: bool| {
        let mut flags = vec![
            "--redis-url".to_string(),
            url.clone(),
            "--redis-tls-ca".into(),
            ca.display().to_string(),
        ];
        if skip {
            flags.push("--redis-tls-skip-hostname-verification".into());
        }
        async move {
            let flags: Vec<&str> = flags.iter().map(String::as_str).collect();
            answers_on(&[("f.yaml", ONE)], &flags, "f", &["v"]).await
        }
    };
    assert_eq!(
        answers(&ca, false).await,
        [Err(tonic::Code::Unavailable)],
        "the certificate names another host"
    );
    assert_eq!(answers(&ca, true).await, [Ok(true)]);
    let other_dir = tempfile::tempdir().unwrap();
    let other = make_certs(other_dir.path());
    assert_eq!(
        answers(&other.join("ca.crt"), true).await,
        [Err(tonic::Code::Unavailable)],
        "a certificate from another CA"
    );
}

/// `--redis-tls-server-name`: the certificate is verified against that name while the URL's
/// address is dialled. The certificate's own name is served; another name, or a certificate
/// from another CA, is refused.
#[tokio::test]
async fn tls_server_name_verifies_another_name_than_the_one_dialled() {
    let certs_dir = tempfile::tempdir().unwrap();
    let certs = certs_naming_elsewhere(certs_dir.path());
    let redis = RedisProc::start_tls_as(&certs, "elsewhere");
    let url = redis.url();
    let answers = |ca: PathBuf, name: &'static str| {
        let url = url.clone();
        async move {
            let flags = [
                "--redis-url",
                url.as_str(),
                "--redis-tls-ca",
                ca.to_str().unwrap(),
                "--redis-tls-server-name",
                name,
            ];
            answers_on(&[("f.yaml", ONE)], &flags, "f", &["v"]).await
        }
    };
    let ca = certs.join("ca.crt");
    assert_eq!(answers(ca.clone(), ELSEWHERE).await, [Ok(true)]);
    assert_eq!(
        answers(ca, "other.ratelimitd.test").await,
        [Err(tonic::Code::Unavailable)],
        "the certificate does not name that"
    );
    let other_dir = tempfile::tempdir().unwrap();
    let other = make_certs(other_dir.path());
    assert_eq!(
        answers(other.join("ca.crt"), ELSEWHERE).await,
        [Err(tonic::Code::Unavailable)],
        "a certificate from another CA"
    );
}

/// SIGTERM's in-process twin: shutdown begins while a call waits on a stalled Redis; health
/// turns not-serving, the call still completes, and only then does the server return.
#[tokio::test]
async fn shutdown_lets_in_flight_calls_finish() {
    let redis = RedisProc::start(&["--enable-debug-command", "yes"]);
    let target = ["--redis-url", &redis.url()];
    let mut s = redis_server(&[("f.yaml", ONE)], &target, &unique_prefix(), "5s").await;
    let mut c = s.client().await;
    assert!(is_ok(&call(&mut c, request("f", &[&[("k", "v")]])).await));
    let mut stall = redis.stall(1.5);
    poll(Duration::from_secs(5), || async {
        redis_is_stalled(redis.port).await.then_some(())
    })
    .await;
    let in_flight = {
        let mut c = c.clone();
        tokio::spawn(async move { c.should_rate_limit(request("f", &[&[("k", "v")]])).await })
    };
    poll(Duration::from_secs(5), || async {
        let (_, m) = s.http_get("/metrics").await;
        (metric(&m, "ratelimit_requests_in_flight") == 1.0).then_some(())
    })
    .await;
    let http = s.http;
    let shutdown = tokio::spawn(async move { s.shutdown().await });
    poll(Duration::from_secs(5), || async {
        // Not-serving first, while the call is still waiting (or the port already closing:
        // refused, or reset before it was served).
        match try_http_get(http, "/healthcheck").await {
            Ok((status, _)) => (status == 500).then_some(()),
            Err(_) => Some(()),
        }
    })
    .await;
    let answer = in_flight
        .await
        .unwrap()
        .expect("the in-flight call was answered");
    assert!(
        is_ok(answer.get_ref()),
        "and decided by Redis once the stall ended"
    );
    shutdown.await.unwrap().unwrap();
    let _ = stall.wait();
}

/// True when `port` does not answer PING within 50 ms.
async fn redis_is_stalled(port: u16) -> bool {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let Ok(mut conn) = tokio::net::TcpStream::connect(("127.0.0.1", port)).await else {
        return false;
    };
    if conn.write_all(b"PING\r\n").await.is_err() {
        return false;
    }
    let mut buf = [0u8; 16];
    tokio::time::timeout(Duration::from_millis(50), conn.read(&mut buf))
        .await
        .is_err()
}

async fn redis_backed(redis: &RedisProc, files: &[(&str, &str)], extra: &[&str]) -> TestServer {
    let url = redis.url();
    let target = [&["--redis-url", url.as_str()], extra].concat();
    redis_server(files, &target, &unique_prefix(), "2s").await
}

const QUOTAS: &str = "domain: q\ndescriptors:\n  - key: a\n    quota_mode: true\n    rate_limit: {unit: hour, requests_per_unit: 2}\n  - key: b\n    quota_mode: true\n    rate_limit: {unit: hour, requests_per_unit: 2}\n";

/// With per-descriptor hash tags, a rejected request refunds only what its groups consumed:
/// never a quota limit that was over and consumed nothing.
#[tokio::test]
async fn descriptor_tags_refund_only_what_was_consumed() {
    assert_ne!(
        slot(b"q:a:x"),
        slot(b"q:b:y"),
        "two groups, two script calls"
    );
    for tag in ["domain", "descriptor"] {
        let redis = shared_standalone();
        let s = redis_backed(redis, &[("q.yaml", QUOTAS)], &["--redis-hash-tag", tag]).await;
        let mut c = s.client().await;
        let mut admitted = 0;
        for _ in 0..20 {
            admitted +=
                is_ok(&call(&mut c, request("q", &[&[("a", "x")], &[("b", "y")]])).await) as usize;
        }
        assert_eq!(admitted, 2, "--redis-hash-tag {tag}");
    }
}

/// A sliding_log commit or refund costs the same whatever `hits_addend` is: no call shows in
/// SLOWLOG above 10 ms, where work per hit would block Redis for seconds.
#[tokio::test]
async fn a_huge_hits_addend_costs_redis_what_one_hit_costs() {
    let redis = RedisProc::start(&["--slowlog-log-slower-than", "10000"]);
    let yaml = "domain: big\ndescriptors:\n  - key: log\n    rate_limit: {unit: hour, requests_per_unit: 2000000, algorithm: sliding_log}\n  - key: tight\n    rate_limit: {unit: hour, requests_per_unit: 1}\n";
    let s = redis_backed(
        &redis,
        &[("b.yaml", yaml)],
        &["--redis-hash-tag", "descriptor"],
    )
    .await;
    let mut c = s.client().await;
    let r = call(
        &mut c,
        weighted(request("big", &[&[("log", "a")]]), 2_000_000),
    )
    .await;
    assert!(is_ok(&r));
    assert_eq!(r.statuses[0].limit_remaining, 0);
    assert!(is_over(
        &call(&mut c, request("big", &[&[("log", "a")]])).await
    ));
    // A refund of a huge request: the log's group consumes, the tight group rejects.
    assert!(is_ok(
        &call(&mut c, request("big", &[&[("tight", "t")]])).await
    ));
    let req = weighted(
        request("big", &[&[("log", "b")], &[("tight", "t")]]),
        1_999_999,
    );
    assert!(is_over(&call(&mut c, req).await));
    let r = call(&mut c, with_hits(request("big", &[&[("log", "b")]]), 0, 0)).await;
    assert_eq!(r.statuses[0].limit_remaining, 2_000_000, "refunded exactly");
    let (_, m) = s.http_get("/metrics").await;
    // Every kind is exported from the start, at 0.
    let failed: f64 = m
        .lines()
        .filter(|l| l.starts_with("ratelimit_backend_errors_total{"))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum();
    assert_eq!(failed, 0.0, "no script call failed, refunds included: {m}");
    assert_eq!(
        redis.cli(&["SLOWLOG", "LEN"]),
        "0",
        "{}",
        redis.cli(&["SLOWLOG", "GET"])
    );
    let used: u64 = redis
        .cli(&["INFO", "memory"])
        .lines()
        .find_map(|l| l.strip_prefix("used_memory:"))
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    assert!(used < 20 << 20, "Redis holds {used} bytes");
}

/// Backend errors reach clients as short, stable statuses: no Redis client text ("Connection
/// refused (os error 111)"), and a permanent error is not UNAVAILABLE like a transient one.
#[tokio::test]
async fn backend_errors_reach_clients_as_short_stable_statuses() {
    let mut redis = RedisProc::start(&[]);
    let yaml =
        "domain: e\ndescriptors:\n  - key: k\n    rate_limit: {unit: hour, requests_per_unit: 5}\n";
    let s = redis_backed(
        &redis,
        &[("e.yaml", yaml)],
        &["--redis-failure-mode", "allow"],
    )
    .await;
    let mut c = s.client().await;
    assert!(is_ok(&call(&mut c, request("e", &[&[("k", "v")]])).await));

    // A key of the wrong type where the counter lives: a permanent error, never hidden by the
    // failure mode.
    let prefix = s
        .flags
        .iter()
        .position(|f| f == "--redis-key-prefix")
        .map(|i| s.flags[i + 1].clone())
        .unwrap();
    let key = format!("{prefix}{{e}}:k:w:f3600000000:0");
    redis.cli(&["RPUSH", &key, "x"]);
    let err = c
        .should_rate_limit(request("e", &[&[("k", "w")]]))
        .await
        .unwrap_err();
    assert_eq!(err.code(), tonic::Code::Internal, "{err:?}");
    assert_eq!(err.message(), "rate limit backend error");

    // Redis gone: the failure mode answers; in `error` mode the status is short and stable.
    redis.kill();
    assert!(is_ok(&call(&mut c, request("e", &[&[("k", "v")]])).await));
    drop(s);
    let s = redis_backed(&redis, &[("e.yaml", yaml)], &[]).await;
    let mut c = s.client().await;
    let err = c
        .should_rate_limit(request("e", &[&[("k", "v")]]))
        .await
        .unwrap_err();
    assert_eq!(err.code(), tonic::Code::Unavailable);
    assert_eq!(err.message(), "rate limit backend unavailable");
    let (_, m) = s.http_get("/metrics").await;
    assert!(
        metric(&m, r#"ratelimit_backend_errors_total{kind="connection"}"#) >= 1.0,
        "{m}"
    );
}

/// Starts ratelimitd on the Sentinel at `sentinel_url` (master `main`) with `flags`, and checks
/// that a limit of 2 holds and is counted on `master`.
async fn counts_on_the_master(master: &RedisProc, sentinel_url: &str, flags: &[&str]) {
    let prefix = unique_prefix();
    let target = [
        &[
            "--redis-sentinel-nodes",
            sentinel_url,
            "--redis-sentinel-master",
            "main",
        ],
        flags,
    ]
    .concat();
    let limits = "domain: d\ndescriptors:\n  - key: k\n    rate_limit: {unit: minute, requests_per_unit: 2}\n";
    let s = redis_server(&[("f.yaml", limits)], &target, &prefix, "2s").await;
    let mut c = s.client().await;
    admits_exactly(&mut c, &request("d", &[&[("k", "v")]]), 2).await;
    assert_eq!(
        keys_with_ttl(master, &prefix).len(),
        1,
        "counted on the master"
    );
}

/// Through Sentinel, a password-protected master is reached with its own password (the
/// master and the sentinel here have different ones).
#[tokio::test]
async fn sentinel_reaches_a_password_protected_master() {
    let master = RedisProc::start(&["--requirepass", "master/pass"]);
    let sentinel = RedisProc::start_sentinel(
        master.port,
        "sentinel auth-pass main master/pass\n",
        &["--requirepass", "sentinel-pass"],
    );
    let sentinel_url = format!("redis://:sentinel-pass@127.0.0.1:{}", sentinel.port);
    counts_on_the_master(&master, &sentinel_url, &["--redis-password", "master/pass"]).await;
}

/// Through Sentinel, the master is reached over TLS when the settings say so. Here the master
/// speaks only TLS; the sentinel itself is plain.
#[tokio::test]
async fn sentinel_reaches_a_tls_only_master() {
    let certs_dir = tempfile::tempdir().unwrap();
    let certs = make_certs(certs_dir.path());
    let master = RedisProc::start_tls(&certs);
    let sentinel = sentinel_over_tls(&master, &certs, "server");
    let ca = certs.join("ca.crt").display().to_string();
    counts_on_the_master(
        &master,
        &sentinel.url(),
        &["--redis-tls", "--redis-tls-ca", &ca],
    )
    .await;
}

/// A per-second limit (a window under a minute) and an hourly one, for the per-second store.
const TWO_STORES: &str = "domain: p\ndescriptors:\n  - key: fast\n    rate_limit: {unit: second, unit_multiplier: 50, requests_per_unit: 3}\n  - key: slow\n    rate_limit: {unit: hour, requests_per_unit: 2}\n";

/// `--redis-per-second-url` (envoyproxy/ratelimit's `REDIS_PERSECOND`): windows under a minute
/// are counted in the second Redis, the rest in the main one; a request touching both is still
/// all-or-nothing (the per-second hit of a request the hourly limit refuses is undone); and
/// each store's outage touches only the requests that need it.
#[tokio::test]
async fn a_per_second_store_keeps_short_windows_apart_and_all_or_nothing() {
    let mut main = RedisProc::start(&[]);
    let fast = RedisProc::start(&[]);
    let prefix = unique_prefix();
    let (main_url, fast_url) = (main.url(), fast.url());
    let s = redis_server(
        &[("p.yaml", TWO_STORES)],
        &[
            "--redis-url",
            &main_url,
            "--redis-per-second-url",
            &fast_url,
            "--redis-failure-mode",
            "error",
            "--admin",
        ],
        &prefix,
        "2s",
    )
    .await;
    let mut c = s.client().await;
    let mut attempt = 0;
    let v = loop {
        // A 50 s window may end mid-test: start again, on fresh counters, when less than 10 s
        // of it are left.
        attempt += 1;
        let v = format!("v{attempt}");
        let both = request("p", &[&[("fast", &v)], &[("slow", &v)]]);
        let r = call(&mut c, both.clone()).await;
        assert!(is_ok(&r), "{r:?}");
        let left = r.statuses[0].duration_until_reset.as_ref().unwrap().seconds;
        if left < 10 {
            assert!(attempt < 3, "windows keep ending");
            tokio::time::sleep(Duration::from_secs(left as u64 + 1)).await;
            continue;
        }
        assert_eq!(
            (r.statuses[0].limit_remaining, r.statuses[1].limit_remaining),
            (2, 1)
        );
        assert!(is_ok(&call(&mut c, both.clone()).await));
        // The hourly limit refuses the third: its per-second hit, taken in the other store,
        // is given back.
        let r = call(&mut c, both).await;
        assert!(is_over(&r), "{r:?}");
        let r = call(&mut c, request("p", &[&[("fast", &v)]])).await;
        assert!(is_ok(&r), "the refused request took nothing: {r:?}");
        assert_eq!(r.statuses[0].limit_remaining, 0);
        assert!(is_over(
            &call(&mut c, request("p", &[&[("fast", &v)]])).await
        ));
        break v;
    };
    // The admin API finds each counter in its store, and a reset clears it there.
    let mut admin = AdminClient::connect(format!("http://{}", s.grpc))
        .await
        .unwrap();
    let fast_counter = CounterRequest {
        domain: "p".into(),
        entries: vec![Entry {
            key: "fast".into(),
            value: v.clone(),
            escaped: false,
        }],
    };
    let seen = admin.get_counters(fast_counter.clone()).await.unwrap();
    assert_eq!(seen.get_ref().counters[0].used, 3, "{seen:?}");
    let reset = admin.reset_counters(fast_counter).await.unwrap();
    assert_eq!(reset.get_ref().reset, 1);
    assert!(is_ok(&call(&mut c, request("p", &[&[("fast", &v)]])).await));
    let names = |node: &RedisProc| -> Vec<String> {
        keys_with_ttl(node, &prefix)
            .into_iter()
            .map(|(k, _)| k)
            .filter(|k| !k.contains("undo:"))
            .collect()
    };
    let (in_main, in_fast) = (names(&main), names(&fast));
    assert!(
        !in_main.is_empty() && in_main.iter().all(|k| k.contains("slow")),
        "{in_main:?}"
    );
    assert!(
        !in_fast.is_empty() && in_fast.iter().all(|k| k.contains("fast")),
        "{in_fast:?}"
    );

    // The main store down: a per-second request is still decided, an hourly one is not.
    main.kill();
    let fresh = format!("{v}-after");
    let r = call(&mut c, request("p", &[&[("fast", &fresh)]])).await;
    assert!(is_ok(&r), "{r:?}");
    assert_eq!(
        r.statuses[0].limit_remaining, 2,
        "counted in the second Redis"
    );
    let e = c
        .should_rate_limit(request("p", &[&[("slow", &fresh)]]))
        .await
        .unwrap_err();
    assert_eq!(e.code(), tonic::Code::Unavailable);
    poll(Duration::from_secs(10), || async {
        let (_, m) = s.http_get("/metrics").await;
        (metric(&m, "ratelimit_backend_up") == 0.0).then_some(())
    })
    .await;
    main.restart();
    poll(Duration::from_secs(10), || async {
        let (_, m) = s.http_get("/metrics").await;
        (metric(&m, "ratelimit_backend_up") == 1.0).then_some(())
    })
    .await;
    let r = call(&mut c, request("p", &[&[("slow", &fresh)]])).await;
    assert!(is_ok(&r), "{r:?}");
}

/// A sentinel (plain) watching `master` over TLS, trusting the CA of `certs` and presenting
/// `cert`.
fn sentinel_over_tls(master: &RedisProc, certs: &Path, cert: &str) -> RedisProc {
    let path = |f: &str| certs.join(f).display().to_string();
    RedisProc::start_sentinel(
        master.port,
        &format!(
            "tls-replication yes\ntls-cert-file {}\ntls-key-file {}\ntls-ca-cert-file {}\n\
             tls-auth-clients no\n",
            path(&format!("{cert}.crt")),
            path(&format!("{cert}.key")),
            path("ca.crt"),
        ),
        &[],
    )
}

/// Behind Sentinel too, a master whose certificate names another host is served with
/// `--redis-tls-skip-hostname-verification` (which skips that check and only it: a
/// certificate from another CA is still refused) or with `--redis-tls-server-name` naming what
/// the certificate names (another name is refused), while the address the sentinel announces
/// is dialled.
#[tokio::test]
async fn sentinel_master_certificate_names_skipped_or_given() {
    let certs_dir = tempfile::tempdir().unwrap();
    let certs = certs_naming_elsewhere(certs_dir.path());
    let master = RedisProc::start_tls_as(&certs, "elsewhere");
    let sentinel = sentinel_over_tls(&master, &certs, "elsewhere");
    let sentinel_url = sentinel.url();
    let ca = certs.join("ca.crt").display().to_string();
    let other_dir = tempfile::tempdir().unwrap();
    let other_ca = make_certs(other_dir.path()).join("ca.crt");
    let other_ca = other_ca.display().to_string();
    let skip = "--redis-tls-skip-hostname-verification";
    let name = "--redis-tls-server-name";
    for (ca, extra, want, why) in [
        (
            &ca,
            &[][..],
            Err(tonic::Code::Unavailable),
            "the certificate names another host",
        ),
        (&ca, &[skip][..], Ok(true), "the name check skipped"),
        (
            &other_ca,
            &[skip][..],
            Err(tonic::Code::Unavailable),
            "another CA",
        ),
        (
            &ca,
            &[name, "other.ratelimitd.test"][..],
            Err(tonic::Code::Unavailable),
            "another name",
        ),
        (
            &ca,
            &[name, ELSEWHERE][..],
            Ok(true),
            "the certificate's name",
        ),
    ] {
        let sentinel_flags = [
            "--redis-sentinel-nodes",
            &sentinel_url,
            "--redis-sentinel-master",
            "main",
        ];
        let flags = [
            &sentinel_flags[..],
            &["--redis-tls", "--redis-tls-ca", ca],
            extra,
        ]
        .concat();
        assert_eq!(
            answers_on(&[("f.yaml", ONE)], &flags, "f", &["v"]).await,
            [want],
            "{why}"
        );
    }
    for extra in [&[skip][..], &[name, ELSEWHERE][..]] {
        let flags = [&["--redis-tls", "--redis-tls-ca", &ca][..], extra].concat();
        counts_on_the_master(&master, &sentinel_url, &flags).await;
    }
}
