//! Every Envoy example, run in a real Envoy (each tested version) in front of ratelimitd on
//! memory and on Redis, with the example upstream behind and raw HTTP clients in front: each
//! test asserts what its example's comments promise, in counts of 200 and 429, the
//! `x-ratelimit-*` headers and Envoy's own ratelimit stats (never an error, never a request
//! let through because a call failed).

mod common;

use std::time::Duration;

use common::envoy::{self, Envoy, Upstream, get, send_and_reset};
use common::*;
use common::{ads::AdsServer, gateway, istio};
use ratelimitd::testing::rls_conf::RateLimitUnit;
use tokio::time::Instant;

/// The example limits `make run` loads (examples/envoy/limits/), as files for a server.
fn example_limits() -> Vec<(String, String)> {
    let dir = envoy::root().join("examples/envoy/limits");
    let mut files: Vec<(String, String)> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| {
            let p = e.unwrap().path();
            let name = p.file_name().unwrap().to_string_lossy().into_owned();
            (name, std::fs::read_to_string(&p).unwrap())
        })
        .collect();
    files.sort();
    files
}

/// ratelimitd on `kind` with the example limits and `extra` files.
async fn ratelimitd(kind: Kind, extra: &[(&str, &str)]) -> TestServer {
    let mut files = example_limits();
    files.extend(extra.iter().map(|(n, t)| (n.to_string(), t.to_string())));
    let files: Vec<(&str, &str)> = files
        .iter()
        .map(|(n, t)| (n.as_str(), t.as_str()))
        .collect();
    start(kind, &files, &[]).await
}

/// The ratelimit filter asked, answered, and never failed: the counts Envoy itself keeps.
async fn assert_decided(envoy: &Envoy, ok: u64, over: u64) {
    let s = envoy.ratelimit_stats(&envoy.upstream).await;
    assert_eq!(
        (s.ok, s.over_limit, s.error, s.failure_mode_allowed),
        (ok, over, 0, 0),
        "Envoy {}'s ratelimit stats\n{}",
        envoy.version,
        envoy.log()
    );
}

/// No call failed or came late: Envoy let nothing through undecided.
async fn assert_never_failed(envoy: &Envoy) {
    let s = envoy.ratelimit_stats(&envoy.upstream).await;
    assert_eq!(
        (s.error, s.failure_mode_allowed),
        (0, 0),
        "Envoy {}: {s:?}\n{}",
        envoy.version,
        envoy.log()
    );
}

/// examples/envoy/envoy.yaml with limits/config.yaml: a client without x-api-key, writing a
/// new X-Forwarded-For each time, is limited by its address (10 a second, sliding); the 429
/// carries x-ratelimit-* with a reset a client can wait for; /healthz is never limited.
async fn the_edge_example_limits_a_client_by_its_address(kind: Kind, version: &'static str) {
    let rls = ratelimitd(kind, &[]).await;
    let up = Upstream::start().await;
    let envoy = Envoy::start(
        version,
        "examples/envoy/envoy.yaml",
        up.port,
        rls.grpc.port(),
    )
    .await;
    let (mut admitted, mut refused) = (0u64, 0u64);
    let mut first_refusal = None;
    // Each request its own path (so the per-path bucket never binds) and its own made-up
    // X-Forwarded-For: only the connection's address can limit them.
    for i in 0..30 {
        let xff = format!("10.0.{}.{}", i / 250, i % 250 + 1);
        let a = get(
            envoy.http,
            &format!("/item/{i}"),
            &[("x-forwarded-for", &xff)],
        )
        .await;
        match a.status {
            200 => admitted += 1,
            429 => {
                refused += 1;
                first_refusal.get_or_insert(a);
            }
            s => panic!("status {s}: {a:?}"),
        }
    }
    let a = first_refusal.unwrap_or_else(|| {
        panic!("Envoy {version}: 30 quick requests from one address, none refused")
    });
    // A sliding window of 10 a second: at most 10 in any window, 20 across two.
    assert!((10..=20).contains(&admitted), "{admitted} admitted");
    assert!(
        a.header("x-ratelimit-limit")
            .is_some_and(|l| l.starts_with("10, 10;w=1")),
        "{a:?}"
    );
    assert_eq!(a.header("x-ratelimit-remaining"), Some("0"), "{a:?}");
    let reset: u64 = a.header("x-ratelimit-reset").unwrap().parse().unwrap();
    // The time until one more fits: the rest of this second, and on a sliding window up to a
    // tenth of the next while the last second's count still weighs; rounded up.
    assert!((1..=2).contains(&reset), "a reset of {reset} s: {a:?}");
    assert_decided(&envoy, admitted, refused).await;

    // Health checks are never limited (and never ask).
    for _ in 0..20 {
        assert_eq!(get(envoy.http, "/healthz", &[]).await.status, 200);
    }
    assert_decided(&envoy, admitted, refused).await;

    // A client that waits what it was told and retries is admitted.
    let refused_at = Instant::now();
    loop {
        let a = get(envoy.http, "/again", &[]).await;
        if a.status == 429 {
            let reset: u64 = a.header("x-ratelimit-reset").unwrap().parse().unwrap();
            assert!(reset >= 1, "{a:?}");
            tokio::time::sleep(Duration::from_secs(reset)).await;
            let b = get(envoy.http, "/again/after", &[]).await;
            assert_eq!(b.status, 200, "retried after {reset} s as told: {b:?}");
            break;
        }
        assert!(
            refused_at.elapsed() < Duration::from_secs(20),
            "never refused again"
        );
    }
}

/// examples/compose/envoy.yaml (docker-compose.yaml's) is envoy.yaml with the compose
/// services' names for the upstream and ratelimitd, and nothing else changed; with the names
/// on loopback it runs as the walkthrough says: twelve quick requests end in 429s.
async fn the_compose_example_is_the_edge_example(kind: Kind, version: &'static str) {
    let edge = std::fs::read_to_string(envoy::root().join("examples/envoy/envoy.yaml")).unwrap();
    let compose =
        std::fs::read_to_string(envoy::root().join("examples/compose/envoy.yaml")).unwrap();
    let body = |t: &str| t[t.find("static_resources:").unwrap()..].to_owned();
    let named = body(&edge)
        .replace(
            "socket_address: { address: 127.0.0.1, port_value: 9000 }",
            "socket_address: { address: upstream, port_value: 80 }",
        )
        .replace(
            "socket_address: { address: 127.0.0.1, port_value: 8081 }",
            "socket_address: { address: ratelimitd, port_value: 8081 }",
        )
        .replacen("type: STATIC", "type: STRICT_DNS", 1);
    assert_eq!(
        body(&compose),
        named,
        "compose's Envoy config drifted from envoy.yaml"
    );

    let rls = ratelimitd(kind, &[]).await;
    let up = Upstream::start().await;
    let local = compose
        .replace(
            "address: upstream, port_value: 80",
            &format!("address: 127.0.0.1, port_value: {}", envoy::UPSTREAM),
        )
        .replace("address: ratelimitd,", "address: 127.0.0.1,");
    let envoy = Envoy::start(version, &local, up.port, rls.grpc.port()).await;
    let mut codes = Vec::new();
    for _ in 0..12 {
        codes.push(get(envoy.http, "/", &[]).await.status);
    }
    assert!(codes.ends_with(&[429]), "{codes:?}");
    assert!(
        codes.iter().filter(|c| **c == 200).count() >= 10,
        "{codes:?}"
    );
    let ok = codes.iter().filter(|c| **c == 200).count() as u64;
    assert_decided(&envoy, ok, 12 - ok).await;
}

/// examples/envoy/concurrency.yaml with limits/concurrency.yaml: 5 places per tenant, taken at
/// the request, given back when the stream is done (answered or reset by the client).
async fn the_concurrency_example_releases_places(kind: Kind, version: &'static str) {
    let rls = ratelimitd(kind, &[]).await;
    let up = Upstream::start().await;
    let envoy = Envoy::start(
        version,
        "examples/envoy/concurrency.yaml",
        up.port,
        rls.grpc.port(),
    )
    .await;
    places_are_taken_and_released(&rls, &envoy, 3).await;
}

/// examples/envoy/concurrency.yaml with limits/concurrency.yaml's places given a lifetime of
/// 3 s: an Envoy killed while its five requests hold the tenant's places never gives them back,
/// so the Envoy that replaces it is refused until the lifetime ends, and admitted then.
async fn a_killed_envoys_places_end_at_their_lifetime(kind: Kind, version: &'static str) {
    let text =
        std::fs::read_to_string(envoy::root().join("examples/envoy/limits/concurrency.yaml"))
            .unwrap();
    let short = text.replace(
        "unit: minute, unit_multiplier: 10",
        "unit: second, unit_multiplier: 3",
    );
    assert_ne!(short, text);
    let rls = ratelimitd(kind, &[("concurrency.yaml", &short)]).await;
    let up = Upstream::start().await;
    let mut first = Envoy::start(
        version,
        "examples/envoy/concurrency.yaml",
        up.port,
        rls.grpc.port(),
    )
    .await;
    let slow: Vec<_> = (0..5)
        .map(|_| {
            send_and_reset(
                first.http,
                "/slow",
                &[("x-tenant-id", "acme"), ("x-delay-ms", "30000")],
            )
        })
        .collect();
    let slow = futures_util::future::join_all(slow).await;
    first.wait_in_flight(5).await;
    let taken = Instant::now();
    first.kill();
    drop(slow);
    let second = Envoy::start(
        version,
        "examples/envoy/concurrency.yaml",
        up.port,
        rls.grpc.port(),
    )
    .await;
    let tenant = [("x-tenant-id", "acme")];
    let refused = get(second.http, "/after", &tenant).await;
    assert!(
        refused.status == 429 || taken.elapsed() >= Duration::from_secs(3),
        "Envoy {version}: a place the killed Envoy held was free at once: {refused:?}"
    );
    poll(Duration::from_secs(10), || async {
        (get(second.http, "/after", &tenant).await.status == 200).then_some(())
    })
    .await;
    let freed = taken.elapsed();
    assert!(
        freed >= Duration::from_millis(2_500),
        "Envoy {version}: the places ended after {freed:?}, before their 3 s"
    );
    assert_never_failed(&second).await;
}

/// istio-concurrency.yaml's patches applied to an ingress gateway as istiod applies them, with
/// limits/concurrency.yaml: the places of the_concurrency_example_releases_places.
async fn the_istio_concurrency_patches_release_places(kind: Kind, version: &'static str) {
    let rls = ratelimitd(kind, &[]).await;
    let up = Upstream::start().await;
    let gateway = istio::gateway_with(&["examples/envoy/istio-concurrency.yaml"]);
    let mut envoy = Envoy::start(version, &gateway, up.port, rls.grpc.port()).await;
    envoy.upstream = istio::UPSTREAM.to_owned();
    places_are_taken_and_released(&rls, &envoy, 2).await;
}

/// Waits (10 s at most) until every place of `llm`'s tenants is given back: the stream-done
/// calls, which Envoy sends after the answer, have arrived (ratelimitd's gauge says so).
async fn places_free(rls: &TestServer) {
    poll(Duration::from_secs(10), || async {
        let (_, m) = rls.http_get("/metrics").await;
        let in_use = metric(&m, r#"ratelimit_places_in_use{domain="llm",rule="tenant"}"#);
        (in_use == 0.0).then_some(())
    })
    .await;
}

/// Through `envoy` (whose filter has domain `llm` and the tenant's places in front of
/// `upstream.py`): for `rounds` rounds, five slow requests take a tenant's 5 places, a sixth is
/// refused, another tenant is admitted, and once they are answered five more are; then five
/// client resets give their places back.
async fn places_are_taken_and_released(rls: &TestServer, envoy: &Envoy, rounds: usize) {
    let version = envoy.version;
    let tenant = [("x-tenant-id", "acme")];
    for round in 0..rounds {
        // The last round's releases arrived: every place is free.
        places_free(rls).await;
        // Five long requests take the five places; a sixth is refused while they are open.
        let slow: Vec<_> = (0..5)
            .map(|_| {
                let http = envoy.http;
                tokio::spawn(async move {
                    get(
                        http,
                        "/slow",
                        &[("x-tenant-id", "acme"), ("x-delay-ms", "5000")],
                    )
                    .await
                })
            })
            .collect();
        envoy.wait_in_flight(5).await;
        let sixth = get(envoy.http, "/sixth", &tenant).await;
        assert_eq!(sixth.status, 429, "round {round}: {sixth:?}");
        // Another tenant has places of its own.
        assert_eq!(
            get(envoy.http, "/other", &[("x-tenant-id", "other")])
                .await
                .status,
            200
        );
        for s in slow {
            assert_eq!(s.await.unwrap().status, 200);
        }
        // Every place given back, five more at once are admitted.
        places_free(rls).await;
        let again: Vec<_> = (0..5)
            .map(|_| {
                let http = envoy.http;
                tokio::spawn(async move {
                    get(
                        http,
                        "/quick",
                        &[("x-tenant-id", "acme"), ("x-delay-ms", "300")],
                    )
                    .await
                    .status
                })
            })
            .collect();
        for a in again {
            assert_eq!(a.await.unwrap(), 200, "round {round}: a place still taken");
        }
    }

    // A client that resets its streams mid-request gives its places back too (once the last
    // round's releases have arrived: before, a held request sent ahead of them was refused, and
    // five were never in flight on a loaded machine).
    places_free(rls).await;
    let held: Vec<_> = {
        let mut v = Vec::new();
        for _ in 0..5 {
            v.push(
                send_and_reset(
                    envoy.http,
                    "/held",
                    &[("x-tenant-id", "acme"), ("x-delay-ms", "30000")],
                )
                .await,
            );
        }
        v
    };
    envoy.wait_in_flight(5).await;
    assert_eq!(get(envoy.http, "/sixth", &tenant).await.status, 429);
    drop(held);
    let reset_at = Instant::now();
    poll(Duration::from_secs(10), || async {
        (get(envoy.http, "/after-reset", &tenant).await.status == 200).then_some(())
    })
    .await;
    eprintln!(
        "Envoy {version}: places free {:?} after the resets",
        reset_at.elapsed()
    );
    assert_never_failed(envoy).await;
}

/// concurrency.yaml as shipped is the edge: Envoy replaces a client's x-request-id, so five
/// requests naming one id take five places. Behind a load balancer (the same Envoy without
/// use_remote_address, which keeps the client's id), a client reusing an id in flight is
/// refused and its release frees nothing: never more than five in flight, whatever ids it
/// sends.
async fn a_client_chosen_request_id_never_lifts_the_places(kind: Kind, version: &'static str) {
    let rls = ratelimitd(kind, &[]).await;
    let up = Upstream::start().await;
    let shipped =
        std::fs::read_to_string(envoy::root().join("examples/envoy/concurrency.yaml")).unwrap();
    let behind = shipped.replace("use_remote_address: true", "use_remote_address: false");
    assert_ne!(behind, shipped);
    for (edge, text) in [(true, shipped), (false, behind)] {
        let envoy = Envoy::start(version, &text, up.port, rls.grpc.port()).await;
        let tenant = if edge { "edge" } else { "behind" };
        let slow = |id: &'static str| {
            let http = envoy.http;
            tokio::spawn(async move {
                get(
                    http,
                    "/slow",
                    &[
                        ("x-tenant-id", tenant),
                        ("x-request-id", id),
                        ("x-delay-ms", "4000"),
                    ],
                )
                .await
                .status
            })
        };
        if edge {
            let all: Vec<_> = (0..5).map(|_| slow("same")).collect();
            envoy.wait_in_flight(5).await;
            assert_eq!(
                get(envoy.http, "/sixth", &[("x-tenant-id", tenant)])
                    .await
                    .status,
                429
            );
            for a in all {
                assert_eq!(a.await.unwrap(), 200, "Envoy made each request's id");
            }
            continue;
        }
        let first = slow("mine");
        envoy.wait_in_flight(1).await;
        // Replays of the id in flight: refused, and each one's stream-done release is spent.
        for _ in 0..5 {
            let a = get(
                envoy.http,
                "/replay",
                &[("x-tenant-id", tenant), ("x-request-id", "mine")],
            )
            .await;
            assert_eq!(a.status, 429, "{a:?}");
        }
        // Fill the places: four more (the replays freed nothing), the fifth refused. (The
        // pause lets the refused requests' stream-done calls land first, so that a release that
        // freed the place would show; it cannot make a correct server fail.)
        tokio::time::sleep(Duration::from_millis(300)).await;
        let more: Vec<_> = ["m1", "m2", "m3", "m4"].into_iter().map(slow).collect();
        envoy.wait_in_flight(5).await;
        let a = get(
            envoy.http,
            "/sixth",
            &[("x-tenant-id", tenant), ("x-request-id", "m5")],
        )
        .await;
        assert_eq!(a.status, 429, "Envoy {version}: a sixth in flight: {a:?}");
        assert_eq!(first.await.unwrap(), 200);
        for m in more {
            assert_eq!(m.await.unwrap(), 200);
        }
        assert_never_failed(&envoy).await;
    }
}

/// examples/envoy/token-budget.yaml with limits/tokens.yaml: each response's 4,000 tokens
/// are charged when its stream is done; with 10,000 a day, three requests pass and the fourth
/// is refused.
async fn the_token_budget_example_charges_what_responses_used(kind: Kind, version: &'static str) {
    let rls = ratelimitd(kind, &[]).await;
    let up = Upstream::start().await;
    let envoy = Envoy::start(
        version,
        "examples/envoy/token-budget.yaml",
        up.port,
        rls.grpc.port(),
    )
    .await;
    let tenant = [("x-tenant-id", "acme")];
    let charged = || async {
        let (_, m) = rls.http_get("/metrics").await;
        metric(
            &m,
            r#"ratelimit_rule_hits_total{domain="tokens",rule="tenant",limit="0"}"#,
        ) as u64
    };
    for n in 1..=3u64 {
        let a = get(envoy.http, "/v1/chat", &tenant).await;
        assert_eq!(a.status, 200, "request {n}: {a:?}");
        // The check at the request costs nothing; the report at stream end costs 4,000.
        poll(Duration::from_secs(10), || async {
            (charged().await == 4000 * n).then_some(())
        })
        .await;
    }
    let a = get(envoy.http, "/v1/chat", &tenant).await;
    assert_eq!(a.status, 429, "{a:?}");
    let reset: u64 = a.header("x-ratelimit-reset").unwrap().parse().unwrap();
    assert!(reset >= 1, "{a:?}");
    // A refused request's stream-done call reports nothing (Envoy leaves the metadata's
    // descriptor out): still 12,000.
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(charged().await, 12_000);
    assert_decided(&envoy, 3, 1).await;
}

/// examples/envoy/reservations.yaml with limits/budgets.yaml: each request reserves its
/// x-max-tokens; with three reservations of 300,000 in flight against 1,000,000 a fourth is
/// refused; each settles at 1,000 used, so 997,000 are left, exactly.
async fn the_reservations_example_reserves_and_settles(kind: Kind, version: &'static str) {
    let rls = ratelimitd(kind, &[]).await;
    let up = Upstream::start().await;
    let envoy = Envoy::start(
        version,
        "examples/envoy/reservations.yaml",
        up.port,
        rls.grpc.port(),
    )
    .await;
    let ask = |max: &'static str, delay: &'static str| {
        let http = envoy.http;
        async move {
            get(
                http,
                "/v1/chat",
                &[
                    ("x-tenant-id", "acme"),
                    ("x-max-tokens", max),
                    ("x-fake-tokens", if delay == "0" { "0" } else { "1000" }),
                    ("x-delay-ms", delay),
                ],
            )
            .await
            .status
        }
    };
    let slow: Vec<_> = (0..3)
        .map(|_| tokio::spawn(ask("300000", "4000")))
        .collect();
    envoy.wait_in_flight(3).await;
    assert_eq!(
        ask("300000", "0").await,
        429,
        "a fourth reservation while three are held"
    );
    assert_eq!(ask("100000", "0").await, 200, "what is left is still there");
    for s in slow {
        assert_eq!(s.await.unwrap(), 200);
    }
    // Settled: each reservation given back, 1,000 charged for each.
    poll(Duration::from_secs(10), || async {
        (ask("997000", "0").await == 200).then_some(())
    })
    .await;
    poll(Duration::from_secs(10), || async {
        (ask("997000", "0").await == 200).then_some(())
    })
    .await;
    assert_eq!(
        ask("997001", "0").await,
        429,
        "3,000 used, not a token more or less"
    );
    assert_never_failed(&envoy).await;
}

/// Clients that reset while their rate-limit call is in flight (here: Redis paused, so that
/// every call is): Envoy cancels the call and never sends the stream-done call that would give
/// back what it took. Through concurrency.yaml, five such resets took all five of a tenant's
/// places for the 10-minute lifetime; through reservations.yaml, three burned 900,000 of a
/// 1,000,000 monthly budget with no token used. Now ratelimitd gives back what a call whose
/// answer never went out took.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_reset_mid_call_take_nothing() {
    for version in envoy::versions() {
        let redis = common::redis::RedisProc::start(&[]);
        let files = example_limits();
        let files: Vec<(&str, &str)> = files
            .iter()
            .map(|(n, t)| (n.as_str(), t.as_str()))
            .collect();
        let rls = redis_server(
            &files,
            &["--redis-url", &redis.url()],
            &common::redis::unique_prefix(),
            "5s",
        )
        .await;
        let up = Upstream::start().await;
        let mut undone = 0.0;
        for (example, headers, resets) in [
            (
                "examples/envoy/concurrency.yaml",
                vec![("x-tenant-id", "acme"), ("x-delay-ms", "0")],
                5,
            ),
            (
                "examples/envoy/reservations.yaml",
                vec![
                    ("x-tenant-id", "acme"),
                    ("x-max-tokens", "300000"),
                    ("x-fake-tokens", "0"),
                ],
                3,
            ),
        ] {
            let envoy = Envoy::start(version, example, up.port, rls.grpc.port()).await;
            // Warm: the connection to ratelimitd up, the scripts loaded, and both of the
            // warm-up's calls (the request's and its stream-done call) answered.
            let calls = rls.metric("ratelimit_request_duration_seconds_count").await;
            assert_eq!(get(envoy.http, "/warm", &headers).await.status, 200);
            poll(Duration::from_secs(10), || async {
                (rls.metric("ratelimit_request_duration_seconds_count").await >= calls + 2.0)
                    .then_some(())
            })
            .await;
            // Long enough for the clients to reset on a loaded machine; the calls they cancel
            // are Envoy's no longer, whatever its timeout.
            redis.cli(&["CLIENT", "PAUSE", "3000", "WRITE"]);
            let mut clients = Vec::new();
            for _ in 0..resets {
                clients.push(send_and_reset(envoy.http, "/reset", &headers).await);
            }
            poll(Duration::from_secs(10), || async {
                (rls.metric("ratelimit_requests_in_flight").await >= resets as f64).then_some(())
            })
            .await;
            drop(clients); // the clients give up: Envoy cancels their calls
            undone += resets as f64;
            // A write waits out the pause: the cancelled calls' scripts have run by its answer.
            redis.cli(&["SET", "probe", "1"]);
            let all: Vec<(&str, &str)> = if example.contains("concurrency") {
                headers.clone()
            } else {
                // All that is left of the month but the warm-up's 1,000: nothing was burned.
                vec![
                    ("x-tenant-id", "acme"),
                    ("x-max-tokens", "999000"),
                    ("x-fake-tokens", "0"),
                ]
            };
            // (The warm-up's own stream-done call may come a moment after its answer.)
            let deadline = Instant::now() + Duration::from_secs(10);
            loop {
                let after = get(envoy.http, "/after", &all).await;
                if after.status == 200 {
                    break;
                }
                assert!(
                    Instant::now() < deadline,
                    "Envoy {version}, {example}: what the reset requests took is not back: {after:?}"
                );
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            poll(Duration::from_secs(10), || async {
                (rls.metric("ratelimit_calls_undone_total").await == undone).then_some(())
            })
            .await;
            assert_never_failed(&envoy).await;
        }
    }
}

/// examples/envoy/reservations.yaml with a budget of 10,000 tokens: requests that each use
/// 1,000 tokens and leave their estimate out, or write it as Envoy cannot read it as a whole
/// number, reserved 1 each (Envoy put nothing in the filter state): 20 of 20 were admitted,
/// the budget 10,000 in debt. Now such a request reserves the example's MAX_TOKENS (100,000),
/// more than this budget: none is admitted, and a request with a valid estimate still is.
async fn the_reservations_example_cannot_be_overdrawn_by_leaving_the_estimate_out(
    kind: Kind,
    version: &'static str,
) {
    let budgets =
        std::fs::read_to_string(envoy::root().join("examples/envoy/limits/budgets.yaml")).unwrap();
    let small = budgets.replace("requests_per_unit: 1000000", "requests_per_unit: 10000");
    assert_ne!(small, budgets);
    let rls = ratelimitd(kind, &[("budgets.yaml", &small)]).await;
    let up = Upstream::start().await;
    let envoy = Envoy::start(
        version,
        "examples/envoy/reservations.yaml",
        up.port,
        rls.grpc.port(),
    )
    .await;
    let estimates: [Option<&'static str>; 6] = [
        None,
        Some("1e3"),
        Some("1000.0"),
        Some("-1"),
        Some("0"),
        Some(""),
    ];
    // 20 at once, each answered after a second: every reservation is held at the same time.
    let asked: Vec<_> = (0..20)
        .map(|i| {
            let http = envoy.http;
            let estimate = estimates[i % estimates.len()];
            tokio::spawn(async move {
                let mut headers = vec![
                    ("x-tenant-id", "acme"),
                    ("x-fake-tokens", "1000"),
                    ("x-delay-ms", "1000"),
                ];
                if let Some(e) = estimate {
                    headers.push(("x-max-tokens", e));
                }
                get(http, "/v1/chat", &headers).await.status
            })
        })
        .collect();
    let mut admitted = 0;
    for a in asked {
        match a.await.unwrap() {
            200 => admitted += 1,
            429 => {}
            s => panic!("Envoy {version}: status {s}"),
        }
    }
    assert!(
        admitted * 1000 <= 10_000,
        "Envoy {version}: {admitted} requests of 1,000 tokens admitted against 10,000"
    );
    let valid = [
        ("x-tenant-id", "acme"),
        ("x-fake-tokens", "1000"),
        ("x-max-tokens", "1000"),
    ];
    assert_eq!(get(envoy.http, "/v1/chat", &valid).await.status, 200);
    assert_never_failed(&envoy).await;
}

/// examples/envoy/rlqs.yaml with limits/config.yaml: Envoy's quota filter takes ratelimitd's
/// assignment for the bucket {api_key} (a burst of 10 refilled at 10,000 a day, the tighter of
/// the rule's two limits, and half of that before any use is seen) and enforces it.
async fn the_rlqs_example_enforces_its_assignments(kind: Kind, version: &'static str) {
    let rls = ratelimitd(kind, &[]).await;
    let up = Upstream::start().await;
    let envoy = Envoy::start(
        version,
        "examples/envoy/rlqs.yaml",
        up.port,
        rls.grpc.port(),
    )
    .await;
    let key = [("x-api-key", "k1")];
    // Until the first assignment Envoy allows all; then the bucket (5 or 10) is spent.
    poll(Duration::from_secs(20), || async {
        (get(envoy.http, "/q", &key).await.status == 429).then_some(())
    })
    .await;
    let started = Instant::now();
    let mut admitted = 0;
    for _ in 0..40 {
        if get(envoy.http, "/q", &key).await.status == 200 {
            admitted += 1;
        }
    }
    let bound = 1 + (started.elapsed().as_secs_f64() * 10_000.0 / 86_400.0).ceil() as u32;
    assert!(admitted <= bound, "{admitted} admitted, at most {bound}");
    // Another key has a bucket of its own, and requests without the header none.
    assert_eq!(
        get(envoy.http, "/q", &[("x-api-key", "k2")]).await.status,
        200
    );
    for _ in 0..30 {
        assert_eq!(get(envoy.http, "/q", &[]).await.status, 200);
    }
}

/// istio-envoyfilter.yaml's patches applied to an ingress gateway as istiod applies them, with
/// istio-ratelimit.yaml's ConfigMap as the service's config: /productpage once a minute, every
/// other path 100 a minute.
async fn the_istio_sample_limits_productpage(kind: Kind, version: &'static str) {
    let text =
        std::fs::read_to_string(envoy::root().join("examples/envoy/istio-ratelimit.yaml")).unwrap();
    let config = text
        .split("\n---\n")
        .map(|d| serde_saphyr::from_str::<serde_json::Value>(d).unwrap())
        .find(|d| d["kind"] == "ConfigMap")
        .and_then(|d| d["data"]["config.yaml"].as_str().map(str::to_owned))
        .unwrap();
    let rls = start(kind, &[("config.yaml", &config)], &[]).await;
    let up = Upstream::start().await;
    let gateway = istio::gateway_with(&["examples/envoy/istio-envoyfilter.yaml"]);
    let mut envoy = Envoy::start(version, &gateway, up.port, rls.grpc.port()).await;
    envoy.upstream = istio::UPSTREAM.to_owned();
    let mut codes = Vec::new();
    for _ in 0..4 {
        codes.push(get(envoy.http, "/productpage", &[]).await.status);
    }
    assert_eq!(codes, [200, 429, 429, 429], "Envoy {version}");
    for i in 0..10 {
        assert_eq!(
            get(envoy.http, &format!("/reviews/{i}"), &[]).await.status,
            200
        );
    }
    assert_decided(&envoy, 11, 3).await;
}

/// Envoy Gateway's corpus entries run here: header, method, query, request-header and
/// address matches (inverted too, and one no local client meets), and shared policies in a
/// domain and filter of their own beside the listener's.
const GATEWAY_CORPUS: &[&str] = &[
    "distinct-match",
    "method-match",
    "query-parameters-match",
    "ratelimit-sourceip-invert",
    "masked-remote-address-match",
    "multiple-domains",
    "multiple-shared-and-unshared",
];

/// Envoy Gateway's rendering of its translator's output (tests/common/gateway.rs) run in
/// Envoy, the service fed the matching `RateLimitConfig`s over xDS: each request that meets a
/// rule is admitted exactly as often in one second as the least limit envoyproxy/ratelimit
/// would give the descriptors Envoy makes of it, then refused; a request that meets no limited
/// rule is never refused.
async fn envoy_gateway_renderings_decide_as_the_reference(kind: Kind, version: &'static str) {
    let Some(corpus) = envoy_gateway_corpus() else {
        return;
    };
    let up = Upstream::start().await;
    let mut bursts = 0;
    for name in GATEWAY_CORPUS {
        let r = gateway::render(&corpus, name);
        let ads = AdsServer::start().await;
        ads.set("v1", &r.configs).await;
        let flags = ads.flags();
        let flags: Vec<&str> = flags.iter().map(String::as_str).collect();
        let rls = start(kind, &[], &flags).await;
        poll(Duration::from_secs(10), || async {
            // Nothing listens before the first config has arrived.
            let (_, text) = try_http_get(rls.http, "/rlconfig").await.ok()?;
            r.configs
                .iter()
                .all(|c| text.contains(&c.domain))
                .then_some(())
        })
        .await;
        let envoy = Envoy::start(version, &r.bootstrap, up.port, rls.grpc.port()).await;
        let mut requests: Vec<gateway::Request> =
            r.rules.iter().filter_map(gateway::request_for).collect();
        requests.dedup();
        assert!(!requests.is_empty(), "{name}: no request meets a rule");
        for req in &requests {
            let limits: Vec<_> = r
                .rules
                .iter()
                .filter_map(|rule| {
                    let entries = gateway::descriptor(rule, req)?;
                    let config = r.configs.iter().find(|c| c.domain == rule.domain)?;
                    gateway::limit_of(config, &entries)
                })
                .filter(|(_, _, shadow)| !shadow)
                .collect();
            let headers: Vec<(&str, &str)> = req
                .headers
                .iter()
                .map(|(k, v)| (k.as_str(), v.as_str()))
                .collect();
            let send = || envoy::send(envoy.http, &req.method, &req.path, &headers);
            let Some(&(limit, unit, _)) = limits.iter().min_by_key(|l| l.0) else {
                for _ in 0..8 {
                    assert_eq!(
                        send().await.status,
                        200,
                        "{name}: {req:?} is limited by nothing"
                    );
                }
                continue;
            };
            assert_eq!(unit, RateLimitUnit::Second, "{name}: {req:?}");
            // limit + 1 requests inside one second (a new one each try): `limit` admitted,
            // then refused.
            let mut tries = 0;
            loop {
                tries += 1;
                assert!(tries <= 10, "{name}: {req:?} never fit in one second");
                use ratelimitd::testing::{Clock, SystemClock};
                let now = SystemClock.now_us();
                tokio::time::sleep(Duration::from_micros(1_000_000 - now % 1_000_000 + 2_000))
                    .await;
                let second = SystemClock.now_us() / 1_000_000;
                let mut codes = Vec::new();
                for _ in 0..=limit {
                    codes.push(send().await.status);
                }
                let after = SystemClock.now_us() / 1_000_000;
                if after != second {
                    continue;
                }
                let mut want = vec![200; limit as usize];
                want.push(429);
                assert_eq!(codes, want, "Envoy {version}, {name}: {req:?}");
                bursts += 1;
                break;
            }
        }
        assert_never_failed(&envoy).await;
    }
    eprintln!("Envoy {version}: {bursts} limits checked");
    assert!(bursts >= GATEWAY_CORPUS.len(), "{bursts} limits checked");
}

/// One limit of 3 a second per algorithm, for [`what_a_429_tells_a_client_is_true`].
const ALGORITHMS: &str = "domain: algos
descriptors:
  - key: algo
    value: fixed_window
    rate_limit: {unit: second, requests_per_unit: 3}
  - key: algo
    value: sliding_window
    rate_limit: {unit: second, requests_per_unit: 3, algorithm: sliding_window}
  - key: algo
    value: sliding_log
    rate_limit: {unit: second, requests_per_unit: 3, algorithm: sliding_log}
  - key: algo
    value: token_bucket
    rate_limit: {unit: second, requests_per_unit: 3, algorithm: token_bucket}
";

/// A listener whose requests are limited by their `x-algo` header (domain `algos`), with
/// DRAFT_VERSION_03 headers and, on Envoy 1.40, `enable_retry_after_header`.
fn algorithms_bootstrap(version: &str) -> String {
    let retry_after = if version.starts_with("1.38") {
        ""
    } else {
        "\n                      enable_retry_after_header: true"
    };
    format!(
        r#"static_resources:
  listeners:
    - name: ingress
      address:
        socket_address: {{ address: 0.0.0.0, port_value: 10000 }}
      filter_chains:
        - filters:
            - name: envoy.filters.network.http_connection_manager
              typed_config:
                "@type": type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager
                stat_prefix: ingress
                use_remote_address: true
                route_config:
                  virtual_hosts:
                    - name: all
                      domains: ["*"]
                      rate_limits:
                        - actions:
                            - request_headers: {{ header_name: x-algo, descriptor_key: algo }}
                      routes:
                        - match: {{ prefix: "/" }}
                          route: {{ cluster: upstream }}
                http_filters:
                  - name: envoy.filters.http.ratelimit
                    typed_config:
                      "@type": type.googleapis.com/envoy.extensions.filters.http.ratelimit.v3.RateLimit
                      domain: algos
                      timeout: 0.02s
                      enable_x_ratelimit_headers: DRAFT_VERSION_03{retry_after}
                      rate_limit_service:
                        grpc_service: {{ envoy_grpc: {{ cluster_name: ratelimitd }} }}
                        transport_api_version: V3
                  - name: envoy.filters.http.router
                    typed_config:
                      "@type": type.googleapis.com/envoy.extensions.filters.http.router.v3.Router
  clusters:
    - name: upstream
      type: STATIC
      load_assignment:
        cluster_name: upstream
        endpoints:
          - lb_endpoints:
              - endpoint: {{ address: {{ socket_address: {{ address: 127.0.0.1, port_value: 9000 }} }} }}
    - name: ratelimitd
      type: STATIC
      typed_extension_protocol_options:
        envoy.extensions.upstreams.http.v3.HttpProtocolOptions:
          "@type": type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions
          explicit_http_config: {{ http2_protocol_options: {{}} }}
      load_assignment:
        cluster_name: ratelimitd
        endpoints:
          - lb_endpoints:
              - endpoint: {{ address: {{ socket_address: {{ address: 127.0.0.1, port_value: 8081 }} }} }}
"#
    )
}

/// On every algorithm, a 429's `x-ratelimit-reset` (and on Envoy 1.40 with
/// `enable_retry_after_header`, `Retry-After`, the same figure) is a whole second or more, and a
/// client that waits exactly that long and retries is admitted.
async fn what_a_429_tells_a_client_is_true(kind: Kind, version: &'static str) {
    let rls = start(kind, &[("algos.yaml", ALGORITHMS)], &[]).await;
    let up = Upstream::start().await;
    let envoy = Envoy::start(
        version,
        &algorithms_bootstrap(version),
        up.port,
        rls.grpc.port(),
    )
    .await;
    for algo in [
        "fixed_window",
        "sliding_window",
        "sliding_log",
        "token_bucket",
    ] {
        let header = [("x-algo", algo)];
        let mut admitted = 0;
        let refused = loop {
            let a = get(envoy.http, "/a", &header).await;
            match a.status {
                200 => admitted += 1,
                429 => break a,
                s => panic!("{algo}: {s}"),
            }
            assert!(admitted <= 30, "{algo}: {admitted} admitted, none refused");
        };
        let told = Instant::now();
        let reset: u64 = refused
            .header("x-ratelimit-reset")
            .unwrap_or_else(|| panic!("{algo}: {refused:?}"))
            .parse()
            .unwrap();
        assert!(
            (1..=2).contains(&reset),
            "{algo}: reset {reset}: {refused:?}"
        );
        waits_what_it_is_told(&envoy, &refused, reset, told, "/a", &header, algo).await;
    }
    assert_never_failed(&envoy).await;
}

/// A descriptor over two limits at once is told the reset of the one that ends last: with
/// `[2/second, 2 per 5 s]` spent, a 429 said `x-ratelimit-reset: 1` (the first in config
/// order), and a client that waited that second was refused again. Through
/// examples/envoy/envoy.yaml with Envoy 1.40's `enable_retry_after_header` (1.38 has no
/// `Retry-After`), from the start of a 5-second window: told 5 s, and admitted after 5 s.
async fn a_client_told_when_to_retry_is_admitted_then(kind: Kind, version: &'static str) {
    let limits = "domain: waits\ndescriptors:\n  - key: api_key\n    rate_limits:\n      - {name: per_second, unit: second, requests_per_unit: 2}\n      - {name: per_5s, unit: second, unit_multiplier: 5, requests_per_unit: 2}\n";
    let rls = start(kind, &[("waits.yaml", limits)], &[]).await;
    let up = Upstream::start().await;
    let edge = std::fs::read_to_string(envoy::root().join("examples/envoy/envoy.yaml")).unwrap();
    let mut bootstrap = edge.replace("domain: edge", "domain: waits");
    if !version.starts_with("1.38") {
        bootstrap = bootstrap.replace(
            "enable_x_ratelimit_headers: DRAFT_VERSION_03\n",
            "enable_x_ratelimit_headers: DRAFT_VERSION_03\n                      enable_retry_after_header: true\n",
        );
        assert!(bootstrap.contains("enable_retry_after_header"));
    }
    let envoy = Envoy::start(version, &bootstrap, up.port, rls.grpc.port()).await;
    let key = [("x-api-key", "k")];
    // Just after a 5-second window began (windows are aligned to the Unix epoch), so that
    // its reset is far from the second's.
    use ratelimitd::testing::{Clock, SystemClock};
    let into = Duration::from_micros(SystemClock.now_us() % 5_000_000);
    tokio::time::sleep(Duration::from_secs(5) - into + Duration::from_millis(50)).await;
    let (mut admitted, mut refused) = (0, None);
    while refused.is_none() {
        let a = get(envoy.http, "/w", &key).await;
        match a.status {
            200 => admitted += 1,
            429 => refused = Some((a, Instant::now())),
            s => panic!("status {s}: {a:?}"),
        }
        assert!(admitted <= 2, "Envoy {version}: {admitted} admitted");
    }
    let (a, told) = refused.unwrap();
    let reset: u64 = a.header("x-ratelimit-reset").unwrap().parse().unwrap();
    assert!(
        (4..=5).contains(&reset),
        "Envoy {version}: told {reset} s, the 5-second window's reset is 4-5 s: {a:?}"
    );
    waits_what_it_is_told(&envoy, &a, reset, told, "/w", &key, "two limits").await;
    assert_never_failed(&envoy).await;
}

/// `refused`, a 429 whose `x-ratelimit-reset` said `reset` s, carries the same figure in
/// `Retry-After` on Envoy 1.40 (none on 1.38); a client that waits that long from `told` and
/// asks `path` again is admitted.
async fn waits_what_it_is_told(
    envoy: &Envoy,
    refused: &envoy::Answer,
    reset: u64,
    told: Instant,
    path: &str,
    headers: &[(&str, &str)],
    what: &str,
) {
    let version = envoy.version;
    let retry_after = refused.header("retry-after");
    if version.starts_with("1.38") {
        assert_eq!(retry_after, None, "{refused:?}");
    } else {
        assert_eq!(
            retry_after,
            Some(reset.to_string().as_str()),
            "Envoy {version}, {what}: {refused:?}"
        );
    }
    tokio::time::sleep_until(told + Duration::from_secs(reset)).await;
    let again = get(envoy.http, path, headers).await;
    assert_eq!(
        again.status, 200,
        "Envoy {version}, {what}: refused after waiting the {reset} s it was told: {again:?}"
    );
}

/// examples/envoy/rlqs.yaml on a pool far above use (10^9 a second), restarted as a rolling
/// restart does: the first Envoy is killed while its grant is held (its lease runs 21 s), and
/// the Envoy that replaces it is admitted from its first assignment, since no grant holds more
/// than twice what its client asks (docs/rlqs.md, "Fair shares"). Before, the first Envoy held
/// the whole pool and its successor got one token a second until the lease ran out.
async fn a_restarted_envoy_is_admitted_from_its_first_assignment(
    kind: Kind,
    version: &'static str,
) {
    let limits = "domain: rolling\ndescriptors:\n  - key: api_key\n    rate_limit: { unit: second, requests_per_unit: 1000000000 }\n";
    let rls = ratelimitd(kind, &[("rolling.yaml", limits)]).await;
    let up = Upstream::start().await;
    let text = std::fs::read_to_string(envoy::root().join("examples/envoy/rlqs.yaml")).unwrap();
    let yaml = text.replace("domain: edge", "domain: rolling");
    assert_ne!(yaml, text);
    let key = [("x-api-key", "tenant")];
    let assigned = || async {
        let (_, m) = rls.http_get("/metrics").await;
        metric(
            &m,
            r#"ratelimit_rlqs_assignments_total{kind="token_bucket"}"#,
        )
    };
    // Traffic through the first Envoy until its bucket has been assigned a token bucket.
    let mut first = Envoy::start(version, &yaml, up.port, rls.grpc.port()).await;
    poll(Duration::from_secs(20), || async {
        assert_eq!(get(first.http, "/a", &key).await.status, 200);
        (assigned().await >= 1.0).then_some(())
    })
    .await;
    for _ in 0..50 {
        assert_eq!(get(first.http, "/a", &key).await.status, 200);
    }
    first.kill();
    // Its successor: allowed all until its first assignment, and then still admitted.
    let before = assigned().await;
    let second = Envoy::start(version, &yaml, up.port, rls.grpc.port()).await;
    poll(Duration::from_secs(20), || async {
        assert_eq!(get(second.http, "/b", &key).await.status, 200);
        (assigned().await > before).then_some(())
    })
    .await;
    let mut admitted = 0;
    for _ in 0..200 {
        if get(second.http, "/b", &key).await.status == 200 {
            admitted += 1;
        }
    }
    assert!(
        admitted >= 180,
        "Envoy {version}, restarted beside its predecessor's grant: {admitted} of 200 admitted"
    );
}

/// examples/envoy/network-filter.yaml with the limits its comment gives: a token bucket of
/// 100 a second holding 200 refuses connections past it (Envoy closes them).
async fn the_network_filter_example_limits_connections(kind: Kind, version: &'static str) {
    let text =
        std::fs::read_to_string(envoy::root().join("examples/envoy/network-filter.yaml")).unwrap();
    let limits: String = text
        .lines()
        .skip_while(|l| !l.contains("Matching limits"))
        .skip(1)
        .take_while(|l| l.starts_with("#   "))
        .map(|l| format!("{}\n", &l[4..]))
        .collect();
    assert!(limits.contains("domain: edge_tcp"), "{limits}");
    let rls = ratelimitd(kind, &[("edge_tcp.yaml", &limits)]).await;
    let up = Upstream::start().await;
    let envoy = Envoy::start(
        version,
        "examples/envoy/network-filter.yaml",
        up.port,
        rls.grpc.port(),
    )
    .await;
    let started = Instant::now();
    let (mut admitted, mut refused) = (0u64, 0u64);
    while refused == 0 {
        assert!(
            started.elapsed() < Duration::from_secs(30),
            "{admitted} admitted, none refused"
        );
        let batch: Vec<_> = (0..300)
            .map(|_| {
                let tcp = envoy.tcp;
                tokio::spawn(async move {
                    use tokio::io::{AsyncReadExt, AsyncWriteExt};
                    let mut s = tokio::net::TcpStream::connect(tcp).await.unwrap();
                    let _ = s
                        .write_all(b"GET /tcp HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n")
                        .await;
                    let mut out = Vec::new();
                    let _ = s.read_to_end(&mut out).await;
                    out.starts_with(b"HTTP/1.1 200")
                })
            })
            .collect();
        for b in batch {
            match b.await.unwrap() {
                true => admitted += 1,
                false => refused += 1,
            }
        }
    }
    let bound = 200 + (100.0 * started.elapsed().as_secs_f64()).ceil() as u64 + 1;
    assert!(admitted <= bound, "{admitted} admitted, at most {bound}");
    assert!(
        admitted >= 200,
        "the bucket's 200 first: {admitted} admitted"
    );
    let s = envoy.stats("ratelimit.tcp.").await;
    let get = |n: &str| s.get(&format!("ratelimit.tcp.{n}")).copied().unwrap_or(0);
    assert_eq!(get("over_limit"), refused, "{s:?}");
    assert_eq!(get("ok"), admitted, "{s:?}");
    assert_eq!((get("error"), get("failure_mode_allowed")), (0, 0), "{s:?}");
}

/// Seconds from `now_s` (Unix time) to the start of the next calendar month in UTC.
fn to_next_utc_month(now_s: u64) -> u64 {
    // Days to civil and back (proleptic Gregorian), for the month's end.
    let days = (now_s / 86_400) as i64;
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1_460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    let (year, month) = if month == 12 {
        (year + 1, 1)
    } else {
        (year, month + 1)
    };
    let y = if month <= 2 { year - 1 } else { year };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let mp = if month > 2 { month - 3 } else { month + 9 };
    let doy = (153 * mp + 2) / 5;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    let first = era * 146_097 + doe - 719_468;
    (first * 86_400) as u64 - now_s
}

/// examples/envoy/llm-api.yaml with limits/openai.yaml: what OpenAI's SDKs read. A 200 shows
/// the requests and the tokens budget; past 3 requests a second the 429 is a JSON
/// `rate_limit_exceeded` error of type `requests` with a retry of at most a second; past the
/// soft 4,000 tokens a minute requests go on, the upstream told `x-llm-tier: economy`; once
/// the month's tokens are spent the 429 is `insufficient_quota`, with `x-should-retry: false`
/// and a `retry-after` that reaches the month's end (its reset, not the minute's).
async fn the_llm_example_tells_what_openai_sdks_read(kind: Kind, version: &'static str) {
    let rls = ratelimitd(kind, &[]).await;
    let up = Upstream::start().await;
    let envoy = Envoy::start(
        version,
        "examples/envoy/llm-api.yaml",
        up.port,
        rls.grpc.port(),
    )
    .await;
    let path = "/v1/chat/completions";
    let error = |a: &envoy::Answer| -> serde_json::Value {
        assert_eq!(a.status, 429, "Envoy {version}: {a:?}");
        assert_eq!(a.header("content-type"), Some("application/json"), "{a:?}");
        let body: serde_json::Value = serde_json::from_str(&a.body)
            .unwrap_or_else(|e| panic!("Envoy {version}: not JSON ({e}): {a:?}"));
        body["error"].clone()
    };
    let number = |a: &envoy::Answer, name: &str| -> u64 {
        a.header(name)
            .unwrap_or_else(|| panic!("Envoy {version}: no {name}: {a:?}"))
            .trim_end_matches("ms")
            .trim_end_matches('s')
            .parse()
            .unwrap_or_else(|e| panic!("Envoy {version}: {name}: {e}: {a:?}"))
    };

    // A 200 shows both budgets.
    let a = get(
        envoy.http,
        path,
        &[
            ("authorization", "Bearer sk-fresh"),
            ("x-fake-tokens", "1000"),
        ],
    )
    .await;
    assert_eq!(a.status, 200, "Envoy {version}: {a:?}");
    assert_eq!(number(&a, "x-ratelimit-limit-requests"), 3, "{a:?}");
    assert_eq!(number(&a, "x-ratelimit-remaining-requests"), 2, "{a:?}");
    assert!(
        a.header("x-ratelimit-reset-requests")
            .unwrap()
            .ends_with("ms")
    );
    assert_eq!(number(&a, "x-ratelimit-limit-tokens"), 8000, "{a:?}");
    assert_eq!(number(&a, "x-ratelimit-remaining-tokens"), 8000, "{a:?}");
    assert!(number(&a, "x-ratelimit-reset-tokens") <= 60, "{a:?}");

    // Past 3 a second: wait a second at most, and retry.
    let burst = [("authorization", "Bearer sk-burst"), ("x-fake-tokens", "1")];
    let mut admitted = 0;
    let refused = loop {
        let a = get(envoy.http, path, &burst).await;
        if a.status == 429 {
            break a;
        }
        assert_eq!(a.status, 200, "{a:?}");
        admitted += 1;
        assert!(
            admitted <= 20,
            "Envoy {version}: {admitted} admitted, none refused"
        );
    };
    let e = error(&refused);
    assert_eq!(e["code"], "rate_limit_exceeded", "{refused:?}");
    assert_eq!(e["type"], "requests", "{refused:?}");
    assert!(
        (1..=2).contains(&number(&refused, "retry-after")),
        "{refused:?}"
    );
    assert!(
        (1..=1000).contains(&number(&refused, "retry-after-ms")),
        "{refused:?}"
    );
    assert_eq!(refused.header("x-should-retry"), None, "{refused:?}");
    assert_eq!(
        number(&refused, "x-ratelimit-remaining-requests"),
        0,
        "{refused:?}"
    );

    // Past 4,000 tokens a minute (one response of 5,000), the soft limit lets requests on and
    // tells the upstream: x-llm-tier: economy.
    let heavy = [
        ("authorization", "Bearer sk-heavy"),
        ("x-fake-tokens", "5000"),
    ];
    let charged = || async {
        let (_, m) = rls.http_get("/metrics").await;
        metric(
            &m,
            r#"ratelimit_rule_hits_total{domain="openai",rule="api_key.budget_tokens",limit="tokens-per-minute"}"#,
        ) as u64
    };
    let before = charged().await;
    let a = get(envoy.http, path, &heavy).await;
    assert_eq!(a.status, 200, "{a:?}");
    assert_eq!(a.header("x-upstream-saw-x-llm-tier"), None, "{a:?}");
    // Once the response's 5,000 are reported (when its stream is done).
    poll(Duration::from_secs(10), || async {
        (charged().await >= before + 5000).then_some(())
    })
    .await;
    let tagged = get(envoy.http, path, &heavy).await;
    assert_eq!(
        tagged.status, 200,
        "Envoy {version}: a soft limit never refuses: {tagged:?}"
    );
    assert_eq!(
        tagged.header("x-upstream-saw-x-llm-tier"),
        Some("economy"),
        "Envoy {version}: {tagged:?}"
    );
    // The hard budgets report, not the soft one: 5,000 of 8,000 a minute used.
    assert_eq!(
        number(&tagged, "x-ratelimit-limit-tokens"),
        8000,
        "{tagged:?}"
    );

    // The month's tokens spent (one response of 60,000 against 50,000): do not retry until
    // the month ends.
    let spent = [
        ("authorization", "Bearer sk-spent"),
        ("x-fake-tokens", "60000"),
    ];
    let a = get(envoy.http, path, &spent).await;
    assert_eq!(a.status, 200, "{a:?}");
    let refused = poll(Duration::from_secs(10), || async {
        let a = get(envoy.http, path, &spent).await;
        (a.status == 429).then_some(a)
    })
    .await;
    use ratelimitd::testing::{Clock, SystemClock};
    let month_left = to_next_utc_month(SystemClock.now_us() / 1_000_000);
    let e = error(&refused);
    assert_eq!(e["code"], "insufficient_quota", "{refused:?}");
    assert_eq!(e["type"], "insufficient_quota", "{refused:?}");
    assert_eq!(
        refused.header("x-should-retry"),
        Some("false"),
        "{refused:?}"
    );
    let retry = number(&refused, "retry-after");
    assert!(
        retry + 2 >= month_left && retry <= month_left + 2,
        "Envoy {version}: retry-after {retry}, the month ends in {month_left} s: {refused:?}"
    );
    assert_eq!(
        number(&refused, "x-ratelimit-limit-tokens"),
        50_000,
        "{refused:?}"
    );
    assert_never_failed(&envoy).await;
}

/// examples/envoy/rest-api.yaml with limits/rest.yaml: RFC 9457 problem details. Five requests
/// a minute per API key, each 200 with `RateLimit-Policy` and `RateLimit`; the sixth a 429 whose
/// `application/problem+json` body names the limit and the key and says when to retry, as
/// `Retry-After` does.
async fn the_rest_example_answers_problem_details(kind: Kind, version: &'static str) {
    let rls = ratelimitd(kind, &[]).await;
    let up = Upstream::start().await;
    let envoy = Envoy::start(
        version,
        "examples/envoy/rest-api.yaml",
        up.port,
        rls.grpc.port(),
    )
    .await;
    let refused = refused_after(&envoy, "/api/items", &[("x-api-key", "k1")], 5).await;
    assert_eq!(
        refused.header("content-type"),
        Some("application/problem+json"),
        "Envoy {version}: {refused:?}"
    );
    let problem: serde_json::Value = serde_json::from_str(&refused.body)
        .unwrap_or_else(|e| panic!("Envoy {version}: {e}: {refused:?}"));
    assert_eq!(problem["status"], 429, "{problem}");
    assert_eq!(problem["limit"], "per-minute", "{problem}");
    let detail = problem["detail"].as_str().unwrap();
    assert!(
        detail.starts_with("API key k1 made more than 5 requests per minute"),
        "{detail}"
    );
    let retry = problem["retry_after"].as_u64().unwrap();
    assert!((1..=60).contains(&retry), "{problem}");
    assert_eq!(refused.header("retry-after"), Some(&*retry.to_string()));
    assert!(
        refused
            .header("ratelimit")
            .unwrap()
            .starts_with("\"per-minute\";r=0;t="),
        "{refused:?}"
    );
    assert_never_failed(&envoy).await;
}

/// Requests to `path` with `headers` until one is refused: `allowed` are admitted first (one
/// more if a window ends meanwhile), each carrying the REST example's `RateLimit-Policy`.
async fn refused_after(
    envoy: &Envoy,
    path: &str,
    headers: &[(&str, &str)],
    allowed: usize,
) -> envoy::Answer {
    let mut admitted = 0;
    loop {
        let a = get(envoy.http, path, headers).await;
        if a.status == 429 {
            assert!(
                admitted >= allowed,
                "Envoy {}: {admitted} admitted",
                envoy.version
            );
            return a;
        }
        assert_eq!(a.status, 200, "Envoy {}: {a:?}", envoy.version);
        assert!(
            a.header("ratelimit-policy").is_some(),
            "Envoy {}: {a:?}",
            envoy.version
        );
        admitted += 1;
        assert!(
            admitted <= 2 * allowed,
            "Envoy {}: {admitted} admitted",
            envoy.version
        );
    }
}

/// What a client sends is what the answer says, escaped, whatever it sends: with
/// limits/rest.yaml, a header carrying the key too (`x-limited-key`), keys with quotes,
/// backslashes, CR/LF, NUL and bytes that are not UTF-8 (percent-encoded in the query string,
/// which Envoy decodes), and one of 59,000 bytes (Envoy's header limit is 60 KiB): every 429's
/// body is JSON whose `detail` holds the key as sent (cut at 256 bytes), no header is split or
/// added, and no call fails.
async fn hostile_keys_are_told_safely(kind: Kind, version: &'static str) {
    let rest = std::fs::read_to_string(envoy::root().join("examples/envoy/limits/rest.yaml"))
        .unwrap()
        .replace(
            "          retry-after: \"{{reset_seconds}}\"\n",
            "          retry-after: \"{{reset_seconds}}\"\n          x-limited-key: \"{{value}}\"\n",
        )
        .replace("domain: rest", "domain: hostile");
    assert!(rest.contains("x-limited-key"));
    let rls = ratelimitd(kind, &[("hostile.yaml", &rest)]).await;
    let up = Upstream::start().await;
    let bootstrap = std::fs::read_to_string(envoy::root().join("examples/envoy/rest-api.yaml"))
        .unwrap()
        .replace("domain: rest", "domain: hostile");
    let envoy = Envoy::start(version, &bootstrap, up.port, rls.grpc.port()).await;
    let long = "y".repeat(59_000);
    let cases: [(&str, Vec<u8>); 5] = [
        ("?api_key=a%22b%5Cc", b"a\"b\\c".to_vec()),
        (
            "?api_key=crlf%0D%0Ax-injected:%201",
            b"crlf\r\nx-injected: 1".to_vec(),
        ),
        ("?api_key=nul%00end", b"nul\0end".to_vec()),
        ("?api_key=bytes%FF%FE", b"bytes\xff\xfe".to_vec()),
        ("", long.as_bytes().to_vec()),
    ];
    for (query, sent) in cases {
        let path = format!("/api/items{query}");
        let headers: Vec<(&str, &str)> = if query.is_empty() {
            vec![("x-api-key", &long)]
        } else {
            vec![]
        };
        let a = refused_after(&envoy, &path, &headers, 5).await;
        let shown = String::from_utf8_lossy(&sent[..sent.len().min(256)]).into_owned();
        let problem: serde_json::Value = serde_json::from_str(&a.body)
            .unwrap_or_else(|e| panic!("Envoy {version}, {query}: not JSON ({e}): {a:?}"));
        let detail = problem["detail"].as_str().unwrap();
        assert_eq!(
            detail
                .strip_prefix("API key ")
                .and_then(|d| d.split(" made more").next()),
            Some(&*shown),
            "Envoy {version}, {query}: {detail:?}"
        );
        assert_eq!(a.header("x-injected"), None, "Envoy {version}: {a:?}");
        let in_header: String = shown.chars().filter(|c| (' '..='~').contains(c)).collect();
        assert_eq!(
            a.header("x-limited-key"),
            Some(in_header.trim()),
            "Envoy {version}, {query}: {a:?}"
        );
    }
    assert_never_failed(&envoy).await;
}

in_envoy!(
    the_edge_example_limits_a_client_by_its_address,
    the_compose_example_is_the_edge_example,
    the_concurrency_example_releases_places,
    the_istio_concurrency_patches_release_places,
    a_killed_envoys_places_end_at_their_lifetime,
    the_istio_sample_limits_productpage,
    a_client_chosen_request_id_never_lifts_the_places,
    the_token_budget_example_charges_what_responses_used,
    the_reservations_example_reserves_and_settles,
    the_reservations_example_cannot_be_overdrawn_by_leaving_the_estimate_out,
    the_rlqs_example_enforces_its_assignments,
    a_restarted_envoy_is_admitted_from_its_first_assignment,
    envoy_gateway_renderings_decide_as_the_reference,
    what_a_429_tells_a_client_is_true,
    a_client_told_when_to_retry_is_admitted_then,
    the_network_filter_example_limits_connections,
    the_llm_example_tells_what_openai_sdks_read,
    the_rest_example_answers_problem_details,
    hostile_keys_are_told_safely,
);

/// examples/envoy/envoy.yaml with tracing on its HTTP connection manager (OpenTelemetry, as
/// Istio and Envoy Gateway configure it): Envoy copies each client's W3C `tracestate` into
/// its call to ratelimitd. A 40 KB one (Envoy's own header limit is 60 KiB) made the call's
/// header block pass the gRPC port's 16 KiB, HTTP/2 refused it, and Envoy let all 15 requests
/// through against 10 a second; now every call is decided.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_traced_request_with_a_40_kb_tracestate_is_decided() {
    let edge = std::fs::read_to_string(envoy::root().join("examples/envoy/envoy.yaml")).unwrap();
    let collector = common::redis::free_port(); // nothing listens: spans are lost, not calls
    let traced = edge
        .replacen(
            "                stat_prefix: ingress\n",
            "                stat_prefix: ingress\n                tracing:\n                  provider:\n                    name: envoy.tracers.opentelemetry\n                    typed_config:\n                      \"@type\": type.googleapis.com/envoy.config.trace.v3.OpenTelemetryConfig\n                      grpc_service: { envoy_grpc: { cluster_name: otel } }\n                      service_name: edge\n",
            1,
        )
        .replacen(
            "  clusters:\n",
            &format!("  clusters:\n    - name: otel\n      type: STATIC\n      typed_extension_protocol_options:\n        envoy.extensions.upstreams.http.v3.HttpProtocolOptions:\n          \"@type\": type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions\n          explicit_http_config: {{ http2_protocol_options: {{}} }}\n      load_assignment:\n        cluster_name: otel\n        endpoints: [{{ lb_endpoints: [{{ endpoint: {{ address: {{ socket_address: {{ address: 127.0.0.1, port_value: {collector} }} }} }} }}] }}]\n"),
            1,
        );
    assert!(traced.contains("opentelemetry") && traced.contains("name: otel"));
    let tracestate = format!("vendor={}", "t".repeat(40_000));
    let traceparent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
    for version in envoy::versions() {
        let rls = ratelimitd(Kind::Memory, &[]).await;
        let up = Upstream::start().await;
        let envoy = Envoy::start(version, &traced, up.port, rls.grpc.port()).await;
        let (mut admitted, mut refused) = (0u64, 0u64);
        for i in 0..15 {
            let a = get(
                envoy.http,
                &format!("/traced/{i}"),
                &[("traceparent", traceparent), ("tracestate", &tracestate)],
            )
            .await;
            match a.status {
                200 => admitted += 1,
                429 => refused += 1,
                s => panic!("Envoy {version}: status {s}: {a:?}"),
            }
        }
        assert!(
            refused >= 1,
            "Envoy {version}: 15 traced requests, none refused"
        );
        assert_decided(&envoy, admitted, refused).await;
        let (_, metrics) = rls.http_get("/metrics").await;
        assert_eq!(
            metric(
                &metrics,
                "ratelimit_grpc_resets_total{frame=\"rst_stream\",code=\"protocol_error\"}"
            ),
            0.0
        );
    }
}

/// What each example makes Envoy send, recorded by a stand-in rate-limit service (which
/// answers OVER_LIMIT to a descriptor entry `deny`) and checked against what
/// docs/configuration.md ("Behind Envoy") and the examples' comments say.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn what_envoy_sends_for_each_example() {
    use common::envoy::{Call, Recorder, send};
    fn shown(calls: &[Call]) -> Vec<Vec<String>> {
        calls.iter().map(Call::shown).collect()
    }
    fn ids(call: &Call) -> Vec<String> {
        call.request
            .descriptors
            .iter()
            .flat_map(|d| d.entries.iter())
            .filter(|e| e.key == "request_id")
            .map(|e| e.value.clone())
            .collect()
    }
    for version in envoy::versions() {
        let rec = Recorder::start().await;
        let up = Upstream::start().await;

        // envoy.yaml: one descriptor per rate limit in order; [api_key] with no entries when
        // the header is absent (skip_if_absent); [header_match] left out for a method other
        // than POST (a header_value_match that does not match); /healthz asks nothing.
        let edge = Envoy::start(version, "examples/envoy/envoy.yaml", up.port, rec.port).await;
        get(edge.http, "/a", &[("x-forwarded-for", "10.9.9.9")]).await;
        assert_eq!(
            shown(&rec.take_after(1).await),
            [[
                "remote_address=127.0.0.1",
                "path=/a",
                "",
                "generic_key=edge"
            ]],
            "Envoy {version}"
        );
        send(
            edge.http,
            "POST",
            "/b",
            &[("x-api-key", "k"), ("content-length", "0")],
        )
        .await;
        assert_eq!(
            shown(&rec.take_after(1).await),
            [[
                "remote_address=127.0.0.1",
                "path=/b",
                "api_key=k",
                "generic_key=edge",
                "header_match=post"
            ]],
            "Envoy {version}"
        );
        get(edge.http, "/healthz", &[]).await;
        assert!(
            rec.take_after(0).await.is_empty(),
            "Envoy {version}: /healthz asked"
        );

        // concurrency.yaml: the place at the request, the release when the stream is done
        // (after the answer), under the same request id, for a refused request too.
        let conc = Envoy::start(
            version,
            "examples/envoy/concurrency.yaml",
            up.port,
            rec.port,
        )
        .await;
        let sent = Instant::now();
        get(
            conc.http,
            "/c",
            &[
                ("x-tenant-id", "t"),
                ("x-delay-ms", "500"),
                ("x-request-id", "client"),
            ],
        )
        .await;
        let calls = rec.take_after(2).await;
        assert_eq!(
            shown(&calls),
            [
                vec!["tenant=t,request_id=*"],
                vec!["tenant=t,request_id=* hits_addend=1 negative"]
            ],
            "Envoy {version}"
        );
        assert_eq!(ids(&calls[0]), ids(&calls[1]));
        assert_ne!(
            ids(&calls[0]),
            ["client"],
            "the edge makes its own request id"
        );
        assert!(
            calls[1].at.duration_since(sent) >= Duration::from_millis(500),
            "released after the answer"
        );
        assert_eq!(
            get(conc.http, "/c", &[("x-tenant-id", "deny")])
                .await
                .status,
            429
        );
        assert_eq!(
            shown(&rec.take_after(2).await),
            [
                vec!["tenant=deny,request_id=*"],
                vec!["tenant=deny,request_id=* hits_addend=1 negative"]
            ],
            "Envoy {version}: a refused request's release comes too"
        );

        // token-budget.yaml: a check of 0 at the request, the response's tokens when done; a
        // refused request's stream-done descriptor reads response metadata, so it is left out
        // and no call is made.
        let tok = Envoy::start(
            version,
            "examples/envoy/token-budget.yaml",
            up.port,
            rec.port,
        )
        .await;
        get(tok.http, "/t", &[("x-tenant-id", "t")]).await;
        assert_eq!(
            shown(&rec.take_after(2).await),
            [["tenant=t hits_addend=0"], ["tenant=t hits_addend=4000"]],
            "Envoy {version}"
        );
        assert_eq!(
            get(tok.http, "/t", &[("x-tenant-id", "deny")]).await.status,
            429
        );
        assert_eq!(
            shown(&rec.take_after(2).await),
            [["tenant=deny hits_addend=0"]],
            "Envoy {version}"
        );

        // reservations.yaml: the estimate as the request's hits_addend (both calls carry it;
        // the stream-done descriptors' own win), the give-back and the usage in one call.
        let res = Envoy::start(
            version,
            "examples/envoy/reservations.yaml",
            up.port,
            rec.port,
        )
        .await;
        let tenant = |t: &'static str| {
            [
                ("x-tenant-id", t),
                ("x-max-tokens", "900"),
                ("x-fake-tokens", "600"),
            ]
        };
        get(res.http, "/r", &tenant("t")).await;
        let calls = rec.take_after(2).await;
        assert_eq!(
            shown(&calls),
            [
                vec!["tenant=t,request_id=*"],
                vec![
                    "tenant=t,request_id=* hits_addend=900 negative",
                    "tenant=t,request_id=* hits_addend=600"
                ]
            ],
            "Envoy {version}"
        );
        assert_eq!(
            (calls[0].request.hits_addend, calls[1].request.hits_addend),
            (900, 900)
        );
        assert_eq!(get(res.http, "/r", &tenant("deny")).await.status, 429);
        assert_eq!(
            shown(&rec.take_after(2).await),
            [
                vec!["tenant=deny,request_id=*"],
                vec!["tenant=deny,request_id=* hits_addend=900 negative"]
            ],
            "Envoy {version}: a refused request gives back (its hold took nothing), reports nothing"
        );

        // network-filter.yaml: one call per connection.
        let tcp = Envoy::start(
            version,
            "examples/envoy/network-filter.yaml",
            up.port,
            rec.port,
        )
        .await;
        for _ in 0..3 {
            use tokio::io::{AsyncReadExt, AsyncWriteExt};
            let mut s = tokio::net::TcpStream::connect(tcp.tcp).await.unwrap();
            s.write_all(b"GET / HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n")
                .await
                .unwrap();
            let _ = s.read_to_end(&mut Vec::new()).await;
        }
        let calls = rec.take_after(3).await;
        assert_eq!(
            shown(&calls),
            [["connection=tcp_proxy"]; 3],
            "Envoy {version}"
        );
        assert!(calls.iter().all(|c| c.request.domain == "edge_tcp"));
    }
}
