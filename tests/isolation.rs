//! One client's traffic never changes what another client is answered, and an operator's
//! change takes effect everywhere: each test runs an attack or a change from outside (a real
//! gRPC client, a real redis-server) and measures a victim's answers.

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;

use common::redis::*;
use common::*;
use envoy_types::pb::envoy::service::ratelimit::v3::RateLimitRequest;

/// 1000-day windows: a test's few seconds never straddle a window's end (an hour's end once
/// gave a victim ten more).
const VICTIM: &str = "domain: v\ndescriptors:\n  - key: victim\n    rate_limit: {unit: day, unit_multiplier: 1000, requests_per_unit: 10}\n  - key: big\n    rate_limit: {unit: day, unit_multiplier: 1000, requests_per_unit: 1000000}\n";

fn prefix_of(s: &TestServer) -> String {
    let i = s.flags.iter().position(|f| f == "--redis-key-prefix");
    s.flags[i.expect("a redis server") + 1].clone()
}

/// A server on `redis` answering in failure `mode` when Redis cannot decide, with one script
/// call in flight (so concurrent requests queue and share calls), a per-call `timeout` and
/// `extra` flags.
async fn one_call_at_a_time(
    redis: &RedisProc,
    mode: &str,
    timeout: &str,
    extra: &[&str],
) -> TestServer {
    let url = redis.url();
    let target = [
        "--redis-url",
        url.as_str(),
        "--redis-failure-mode",
        mode,
        "--redis-pipeline",
        "1",
    ];
    redis_server(
        &[("v.yaml", VICTIM)],
        &[&target[..], extra].concat(),
        &unique_prefix(),
        timeout,
    )
    .await
}

/// 64 descriptors with 4096-byte values: valid, each about 12 KiB once escaped in its key.
fn huge_request(n: usize) -> RateLimitRequest {
    let values: Vec<String> = (0..64)
        .map(|i| format!("{n}-{i}-{}", "\u{1}".repeat(4096 - 16)))
        .collect();
    let entries: Vec<[(&str, &str); 1]> = values.iter().map(|v| [("big", v.as_str())]).collect();
    let descriptors: Vec<&[(&str, &str)]> = entries.iter().map(|e| &e[..]).collect();
    request("v", &descriptors)
}

/// Runs `attack` on `tasks` tasks until the returned flag is set.
fn attack<F, Fut>(tasks: usize, attack: F) -> Arc<AtomicBool>
where
    F: Fn(usize) -> Fut + Send + Sync + 'static,
    Fut: std::future::Future<Output = ()> + Send,
{
    let stop = Arc::new(AtomicBool::new(false));
    let attack = Arc::new(attack);
    for t in 0..tasks {
        let (stop, attack) = (stop.clone(), attack.clone());
        tokio::spawn(async move {
            let mut n = 0;
            while !stop.load(Ordering::Relaxed) {
                attack(t * 1_000_000 + n).await;
                n += 1;
            }
        });
    }
    stop
}

/// Held by the tests that load both cores (an attack) or time their answers (a bound that must
/// answer at once), so that neither runs beside the other: a request the attack's CPU load held
/// back for seconds once reached the server after the stall it was meant to meet.
static CORES: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// A victim limited to 10 per 1000 days, asking 40 times while `stop` is unset: how many were
/// admitted, and how many got an error.
async fn victim(c: &Client) -> (usize, usize) {
    let (mut admitted, mut errors) = (0, 0);
    for _ in 0..40 {
        let mut c = c.clone();
        match c
            .should_rate_limit(request("v", &[&[("victim", "me")]]))
            .await
        {
            Ok(r) => admitted += is_ok(&r.into_inner()) as usize,
            Err(_) => errors += 1,
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    (admitted, errors)
}

/// Sixteen clients sending huge valid requests made the coalesced calls carrying them time
/// out; each timed-out request counted against the circuit breaker, which opened, and every
/// client got the failure mode while Redis answered PING (with `error`, 75 of a victim's 79
/// calls were UNAVAILABLE; with `allow`, it was admitted without limit). The failure mode here
/// is `error`, so what a victim is answered shows exactly: a timeout on a loaded machine is an
/// error, never an admission.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn huge_requests_from_one_client_never_switch_limits_off_for_another() {
    let _cores = CORES.lock().await;
    let redis = RedisProc::start(&[]);
    let s = one_call_at_a_time(&redis, "error", "100ms", &["--max-counters", "64"]).await;
    let c = s.client().await;
    let sent = Arc::new(AtomicUsize::new(0));
    let stop = {
        let (c, sent) = (c.clone(), sent.clone());
        attack(16, move |n| {
            let (mut c, sent) = (c.clone(), sent.clone());
            async move {
                let _ = c.should_rate_limit(huge_request(n)).await;
                sent.fetch_add(1, Ordering::Relaxed);
            }
        })
    };
    // The attack is under way before the victim asks.
    poll(Duration::from_secs(10), || {
        let sent = sent.load(Ordering::Relaxed);
        async move { (sent >= 4).then_some(()) }
    })
    .await;
    let (admitted, errors) = victim(&c).await;
    stop.store(true, Ordering::Relaxed);
    let (_, m) = s.http_get("/metrics").await;
    let sent = sent.load(Ordering::Relaxed);
    assert_eq!(
        metric(&m, r#"ratelimit_backend_errors_total{kind="circuit_open"}"#),
        0.0,
        "the circuit stayed closed ({sent} huge requests sent): {m}"
    );
    // Never past its limit, and short of it only by calls that failed: a call that timed out
    // may still have been counted. On an idle machine the victim sees no error at all; a
    // starved test process can make some of its calls miss the 100 ms budget (21 of 40 with
    // two builds and an Envoy suite beside the run), never all of them as the open circuit did.
    assert!(admitted <= 10, "{admitted} admitted: {m}");
    assert!(
        admitted + errors >= 10,
        "{admitted} admitted, {errors} errors: {m}"
    );
    assert!(
        errors <= 30,
        "{errors} of the victim's 40 calls failed: {m}"
    );
}

/// A counter key of the wrong type (anyone with access to Redis can write one) failed every
/// request coalesced with it, and the writes earlier requests in the call had made were lost.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_corrupt_counter_fails_only_the_requests_that_use_it() {
    let redis = RedisProc::start(&[]);
    let s = one_call_at_a_time(&redis, "allow", "2s", &[]).await;
    let c = s.client().await;
    let key = format!("{}{{v}}:victim:bad:f86400000000000:0", prefix_of(&s));
    redis.cli(&["RPUSH", &key, "x"]);
    let tasks: Vec<_> = (0..200)
        .map(|i| {
            let mut c = c.clone();
            let value = if i % 2 == 0 { "bad" } else { "good" };
            tokio::spawn(async move {
                c.should_rate_limit(request("v", &[&[("victim", value)]]))
                    .await
                    .map(|r| is_ok(&r.into_inner()))
                    .map_err(|e| (value, e.code()))
            })
        })
        .collect();
    let (mut admitted, mut internal) = (0, 0);
    for t in tasks {
        match t.await.unwrap() {
            Ok(ok) => admitted += ok as usize,
            Err(("bad", tonic::Code::Internal)) => internal += 1,
            Err(other) => panic!("unexpected error {other:?}"),
        }
    }
    assert_eq!(
        internal, 100,
        "every request on the corrupt counter, and only those"
    );
    assert_eq!(admitted, 10, "the good counter admitted exactly its limit");
    let mut c = c.clone();
    let r = call(&mut c, request("v", &[&[("victim", "good")]])).await;
    assert!(is_over(&r), "every admitted request was written");
    let (_, m) = s.http_get("/metrics").await;
    assert!(
        metric(&m, r#"ratelimit_backend_errors_total{kind="foreign_data"}"#) >= 1.0,
        "{m}"
    );
}

/// Redis refusing writes (too few replicas, out of memory) is "cannot serve now": the failure
/// mode answers, and the metrics say which, rather than INTERNAL under `allow`.
#[tokio::test]
async fn redis_refusing_writes_is_answered_by_the_failure_mode() {
    let redis = RedisProc::start(&[]);
    let url = redis.url();
    for mode in ["allow", "error"] {
        let s = redis_server(
            &[("v.yaml", VICTIM)],
            &["--redis-url", &url, "--redis-failure-mode", mode],
            &unique_prefix(),
            "2s",
        )
        .await;
        let mut c = s.client().await;
        for (set, reset, kind) in [
            (
                ["min-replicas-to-write", "1"],
                ["min-replicas-to-write", "0"],
                "noreplicas",
            ),
            (["maxmemory", "1"], ["maxmemory", "0"], "oom"),
        ] {
            redis.cli(&["CONFIG", "SET", set[0], set[1]]);
            let answer = c
                .should_rate_limit(request("v", &[&[("victim", kind)]]))
                .await;
            redis.cli(&["CONFIG", "SET", reset[0], reset[1]]);
            match mode {
                "allow" => assert!(is_ok(&answer.expect("allowed").into_inner()), "{kind}"),
                _ => assert_eq!(
                    answer.unwrap_err().code(),
                    tonic::Code::Unavailable,
                    "{kind}"
                ),
            }
            let (_, m) = s.http_get("/metrics").await;
            let series = format!(r#"ratelimit_backend_errors_total{{kind="{kind}"}}"#);
            assert!(metric(&m, &series) >= 1.0, "{mode}: {m}");
        }
    }
}

/// A password given apart from a URL was percent-decoded: `x%41y` reached Redis as `xAy`.
#[tokio::test]
async fn a_password_given_as_a_flag_reaches_redis_byte_for_byte() {
    let redis = RedisProc::start(&["--requirepass", "x%41y"]);
    let url = format!("redis://127.0.0.1:{}", redis.port);
    let s = redis_server(
        &[("v.yaml", VICTIM)],
        &["--redis-url", &url, "--redis-password", "x%41y"],
        &unique_prefix(),
        "2s",
    )
    .await;
    let mut c = s.client().await;
    admits_exactly(&mut c, &request("v", &[&[("victim", "p")]]), 10).await;
}

fn limit_of(rpu: u32) -> String {
    format!(
        "domain: v\ndescriptors:\n  - key: victim\n    rate_limit: {{unit: hour, requests_per_unit: {rpu}}}\n"
    )
}

/// With the over-limit cache, a client over 3 an hour stayed OVER_LIMIT for the rest of the
/// hour after a reload raised its limit to 100.
#[tokio::test]
async fn a_reload_that_raises_a_limit_is_not_hidden_by_the_over_limit_cache() {
    let redis = shared_standalone();
    let url = redis.url();
    let s = redis_server(
        &[("v.yaml", &limit_of(3))],
        &["--redis-url", &url, "--local-cache-bytes", "1MiB"],
        &unique_prefix(),
        "2s",
    )
    .await;
    let mut c = s.client().await;
    admits_exactly(&mut c, &request("v", &[&[("victim", "r")]]), 3).await;
    s.write("v.yaml", &limit_of(100));
    poll(Duration::from_secs(5), || {
        let mut c = c.clone();
        async move {
            let r = call(&mut c, request("v", &[&[("victim", "r")]])).await;
            is_ok(&r).then_some(())
        }
    })
    .await;
    let r = call(&mut c, request("v", &[&[("victim", "r")]])).await;
    assert_eq!(
        r.statuses[0].limit_remaining, 95,
        "counted in Redis, not the cache"
    );
}

/// `ResetCounters` through replica A emptied Redis, yet replica B answered OVER_LIMIT from its
/// over-limit cache until the window ended. Now every replica sees it within a second.
#[tokio::test]
async fn an_admin_reset_through_one_replica_unblocks_a_client_on_every_replica() {
    use ratelimitd::admin::admin_client::AdminClient;
    use ratelimitd::admin::{CounterRequest, Entry};
    let redis = shared_standalone();
    let url = redis.url();
    let prefix = unique_prefix();
    let flags = [
        "--redis-url",
        url.as_str(),
        "--local-cache-bytes",
        "1MiB",
        "--admin",
    ];
    let a = redis_server(&[("v.yaml", &limit_of(3))], &flags, &prefix, "2s").await;
    let b = redis_server(&[("v.yaml", &limit_of(3))], &flags, &prefix, "2s").await;
    let mut cb = b.client().await;
    for _ in 0..3 {
        assert!(is_ok(
            &call(&mut cb, request("v", &[&[("victim", "x")]])).await
        ));
    }
    for _ in 0..3 {
        assert!(is_over(
            &call(&mut cb, request("v", &[&[("victim", "x")]])).await
        ));
    }
    let mut admin = AdminClient::connect(format!("http://{}", a.grpc))
        .await
        .unwrap();
    admin
        .reset_counters(CounterRequest {
            domain: "v".into(),
            entries: vec![Entry {
                key: "victim".into(),
                value: "x".into(),
                escaped: false,
            }],
        })
        .await
        .unwrap();
    let reset_at = tokio::time::Instant::now();
    poll(Duration::from_secs(5), || {
        let mut cb = cb.clone();
        async move {
            let r = call(&mut cb, request("v", &[&[("victim", "x")]])).await;
            is_ok(&r).then_some(())
        }
    })
    .await;
    // The cache answers for at most a second (pinned exactly by its unit test); the rest is
    // slack for a loaded machine, far short of the hour B used to wait.
    assert!(
        reset_at.elapsed() < Duration::from_millis(2500),
        "B answered from its cache for {:?}",
        reset_at.elapsed()
    );
}

/// Inside a script Redis judges expiry at the script's start while TIME moves on: a fixed
/// window's key read at a boundary must never pass for the current window. A value left from
/// another window (here, one that will not expire for a minute) counts for nothing.
#[tokio::test]
async fn a_fixed_window_never_takes_another_windows_count_for_its_own() {
    let redis = shared_standalone();
    let url = redis.url();
    let s = redis_server(
        &[("v.yaml", &limit_of(3))],
        &["--redis-url", &url],
        &unique_prefix(),
        "2s",
    )
    .await;
    let mut c = s.client().await;
    let key = format!("{}{{v}}:victim:w:f3600000000:0", prefix_of(&s));
    redis.cli(&["SET", &key, "3@0", "PX", "60000"]);
    let r = call(&mut c, request("v", &[&[("victim", "w")]])).await;
    assert!(is_ok(&r), "the stale window's 3 do not count");
    assert_eq!(r.statuses[0].limit_remaining, 2);
    // A bare count (as an earlier version wrote) is still this window's.
    let key = format!("{}{{v}}:victim:old:f3600000000:0", prefix_of(&s));
    redis.cli(&["SET", &key, "2", "PX", "60000"]);
    let r = call(&mut c, request("v", &[&[("victim", "old")]])).await;
    assert_eq!(r.statuses[0].limit_remaining, 0);
    assert!(is_over(
        &call(&mut c, request("v", &[&[("victim", "old")]])).await
    ));
}

/// 63 descriptors matching 100 limits each cost 130-180 ms of CPU and a 105 ms script call.
/// One request's counters are bounded: past `--max-counters` it is refused, with the numbers.
#[tokio::test]
async fn a_request_touching_too_many_counters_is_refused_with_the_numbers() {
    let limits: String = (0..100)
        .map(|i| {
            format!(
                "      - {{unit: second, unit_multiplier: {}, requests_per_unit: 5}}\n",
                i + 1
            )
        })
        .collect();
    let yaml = format!("domain: m\ndescriptors:\n  - key: k\n    rate_limits:\n{limits}");
    let s = start(Kind::Memory, &[("m.yaml", &yaml)], &[]).await;
    let mut c = s.client().await;
    let values: Vec<String> = (0..63).map(|i| i.to_string()).collect();
    let entries: Vec<[(&str, &str); 1]> = values.iter().map(|v| [("k", v.as_str())]).collect();
    let descriptors: Vec<&[(&str, &str)]> = entries.iter().map(|e| &e[..]).collect();
    let err = c
        .should_rate_limit(request("m", &descriptors))
        .await
        .unwrap_err();
    assert_eq!(err.code(), tonic::Code::InvalidArgument);
    assert_eq!(
        err.message(),
        "the request touches 6300 counters, more than the maximum of 256"
    );
    // Two descriptors (200 counters) are within the bound.
    assert!(is_ok(&call(&mut c, request("m", &descriptors[..2])).await));
}

/// A plain connection to `redis`, to drive the script by hand.
fn script_connection(redis: &RedisProc) -> ::redis::Connection {
    ::redis::Client::open(redis.url())
        .and_then(|c| c.get_connection())
        .expect("a connection")
}

/// EVAL of the script in its documented layout: KEYS, the mode, the numbers packed as
/// little-endian doubles, the nonces. Its reply's values come packed the same way.
fn eval_script(
    conn: &mut ::redis::Connection,
    keys: &[&str],
    mode: &str,
    numbers: &[f64],
    nonces: &[&str],
) -> Vec<i64> {
    let packed: Vec<u8> = numbers.iter().flat_map(|n| n.to_le_bytes()).collect();
    let reply: Vec<u8> = ::redis::cmd("EVAL")
        .arg(ratelimitd::testing::SCRIPT)
        .arg(keys.len())
        .arg(keys)
        .arg(mode)
        .arg(packed)
        .arg(nonces)
        .query(conn)
        .expect("the script runs");
    assert_eq!(reply.len() % 8, 0, "whole doubles: {} bytes", reply.len());
    reply
        .chunks_exact(8)
        .map(|b| f64::from_le_bytes(b.try_into().unwrap()) as i64)
        .collect()
}

/// The script packs its reply in slices of 2,048 values (`unpack` puts them on Lua's C stack,
/// which holds 8,000). The service's calls stay under one slice (at most 512 limits a call),
/// so the slices are driven by hand: a run of 3,000 identical requests (9,001 values, more than
/// one `unpack` can take) gets each request's own values on both sides of each slice's end, in
/// order, the second run too, where the limit runs out part of the way.
#[tokio::test]
async fn a_reply_of_more_than_one_slice_keeps_every_requests_values_in_order() {
    let redis = shared_standalone();
    let key = format!("{}{{r}}:k:v:f3600000000:0", unique_prefix());
    let mut conn = script_connection(redis);
    const RUN: i64 = 3000;
    const LIMIT: i64 = 4000;
    // One entry, one counter, a debt bound of 1; the counter: KEYS[1], fixed window (1), LIMIT
    // an hour, burst LIMIT; the entry: a run of RUN, one limit: counter 1, 1 hit, enforced (1).
    let header = [1.0, 1.0, 1.0];
    let counter = [1.0, 1.0, LIMIT as f64, 3600000000.0, LIMIT as f64];
    let entry = [RUN as f64, 1.0, 1.0, 1.0, 1.0];
    let numbers = [&header[..], &counter, &entry].concat();
    for run in 0..2 {
        let reply = eval_script(&mut conn, &[&key], "decide", &numbers, &[]);
        let len = reply.len() as i64;
        assert_eq!(len, 1 + RUN * 3, "the time, then 3 values a request");
        for (i, v) in (0..).zip(reply[1..].chunks_exact(3)) {
            let taken = run * RUN + i + 1;
            let (admitted, room, reset) = (v[0], v[1], v[2]);
            if taken <= LIMIT {
                let want = (1, LIMIT - taken);
                assert_eq!((admitted, room), want, "run {run}, request {i}");
            } else {
                // Over, with nothing that would have fit: the room is -1 - 0.
                assert_eq!((admitted, room), (0, -1), "run {run}, request {i}");
            }
            assert!(
                (1..=3_600_000_000).contains(&reset),
                "run {run}, request {i}: reset {reset} µs"
            );
        }
    }
}

/// The cluster client retries a script call after an I/O error, so an undo (of a request another
/// slot group rejected) may run twice; run twice, it gave back twice and over-admitted. Its
/// marker key makes the second run a no-op. (The script is driven by hand here, in its
/// documented argument layout.)
#[tokio::test]
async fn an_undo_run_twice_gives_back_once() {
    let redis = shared_standalone();
    let prefix = unique_prefix();
    let key = format!("{prefix}{{r}}:k:v:f3600000000:0");
    let marker = format!("{prefix}{{r}}undo:n1");
    let mut conn = script_connection(redis);
    // One entry, one counter, a debt bound of 1; the counter: KEYS[1], fixed window (1), 5 an
    // hour, burst 5.
    let header = [1.0, 1.0, 1.0];
    let counter = [1.0, 1.0, 5.0, 3600000000.0, 5.0];
    // A decide entry: one request (a run of 1), one limit: counter 1, 1 hit, an enforced
    // admission (1). A fixed window names no log members: no nonce.
    let decide = [&header[..], &counter, &[1.0, 1.0, 1.0, 1.0, 1.0]].concat();
    // The reply: the call's time, then admitted, then the limit's room and reset.
    let first = eval_script(&mut conn, &[&key], "decide", &decide, &[]);
    assert_eq!(first[1], 1, "admitted: {first:?}");
    let at = first[0] as f64;
    assert_eq!(
        eval_script(&mut conn, &[&key], "decide", &decide, &[])[1],
        1
    );
    for _ in 0..2 {
        // An undo entry: at, its marker (KEYS[2]), one limit as above; its nonce.
        let numbers = [&header[..], &counter, &[at, 2.0, 1.0, 1.0, 1.0, 1.0]].concat();
        eval_script(&mut conn, &[&key, &marker], "undo", &numbers, &["n1"]);
    }
    // Two taken, one given back (once), one more taken: 3 remain.
    let third = eval_script(&mut conn, &[&key], "decide", &decide, &[]);
    assert_eq!(
        third[2], 3,
        "5 - 2 taken + 1 given back - 1 taken: {third:?}"
    );
}

/// Waits until `redis` no longer answers a PING within 200 ms (a stall has begun).
async fn until_stalled(redis: &RedisProc) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let addr = redis.url().trim_start_matches("redis://").to_owned();
    poll(Duration::from_secs(10), || {
        let addr = addr.clone();
        async move {
            let mut s = tokio::net::TcpStream::connect(addr).await.ok()?;
            s.write_all(b"PING\r\n").await.ok()?;
            let mut buf = [0u8; 16];
            let answered = tokio::time::timeout(Duration::from_millis(200), s.read(&mut buf));
            answered.await.is_err().then_some(())
        }
    })
    .await;
}

/// The queue of script calls is bounded: with Redis stalled, requests beyond what their lane
/// holds (one large call in flight and 64 queued) are refused at once with the failure mode
/// (`overloaded`), not left to wait; those it holds are decided once Redis is back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_beyond_the_queue_bound_are_refused_at_once() {
    let _cores = CORES.lock().await;
    let redis = RedisProc::start(&["--enable-debug-command", "yes"]);
    let s = one_call_at_a_time(&redis, "error", "20s", &["--request-timeout", "30s"]).await;
    let c = s.client().await;
    // Over 8 KiB of keys: a large part, which goes in the large lane.
    let values: Vec<String> = (0..3).map(|i| format!("{i}{}", "x".repeat(4000))).collect();
    let entries: Vec<[(&str, &str); 1]> = values.iter().map(|v| [("big", v.as_str())]).collect();
    let descriptors: Vec<&[(&str, &str)]> = entries.iter().map(|e| &e[..]).collect();
    let large = request("v", &descriptors);
    let mut stall = redis.stall(6.0);
    until_stalled(&redis).await;
    let started = tokio::time::Instant::now();
    let tasks: Vec<_> = (0..200)
        .map(|_| {
            let (mut c, large) = (c.clone(), large.clone());
            tokio::spawn(async move {
                let r = c.should_rate_limit(large).await;
                (r.map(|r| is_ok(&r.into_inner())), started.elapsed())
            })
        })
        .collect();
    let (mut admitted, mut refused) = (0, 0);
    let (mut first_decided, mut last_refused) = (Duration::MAX, Duration::ZERO);
    for t in tasks {
        match t.await.unwrap() {
            (Ok(ok), at) => {
                admitted += ok as usize;
                first_decided = first_decided.min(at);
            }
            (Err(e), at) => {
                assert_eq!(e.code(), tonic::Code::Unavailable, "{e:?}");
                last_refused = last_refused.max(at);
                refused += 1;
            }
        }
    }
    // Held requests are decided only once Redis wakes; every refusal came before that, so none
    // waited for Redis (how long a request took to reach the server is the machine's business).
    assert!(
        last_refused < first_decided && first_decided > Duration::from_secs(4),
        "last refusal after {last_refused:?}, first held request decided after {first_decided:?}"
    );
    let _ = stall.wait();
    let (_, m) = s.http_get("/metrics").await;
    let overloaded = metric(&m, r#"ratelimit_backend_errors_total{kind="overloaded"}"#);
    assert_eq!(overloaded, refused as f64, "{m}");
    assert!(
        (130..=135).contains(&refused),
        "{refused} refused, {admitted} admitted: the lane holds 65 or 66"
    );
    assert_eq!(
        admitted + refused,
        200,
        "every held request was decided: {m}"
    );
    let mut c = c.clone();
    assert!(is_ok(
        &call(&mut c, request("v", &[&[("victim", "after")]])).await
    ));
}
