//! Limits changed at runtime: the admin listener (`--admin-addr`), which asks every caller for
//! a token of `--admin-token-file`, and the operator's overrides it sets, applied by every
//! replica on Redis within two seconds and kept across restarts.

mod common;

use std::time::Duration;

use tokio::time::Instant;

use common::*;
use ratelimitd::admin::admin_client::AdminClient;
use ratelimitd::admin::{CounterRequest, Entry};

const LIMITS: &str = "domain: d
descriptors:
  - key: tenant
    rate_limit: {unit: hour, requests_per_unit: 100}
";

const ALICE: &str = "0123456789abcdef-alice";
const BOB: &str = "fedcba9876543210-bob";

/// A token file naming alice and bob, in a directory of its own.
fn tokens() -> (tempfile::TempDir, std::path::PathBuf) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("tokens");
    std::fs::write(&path, format!("alice:{ALICE}\nbob:{BOB}\n")).unwrap();
    (dir, path)
}

/// A server on `kind` with the admin listener, the tokens of `file`, and `extra` flags.
async fn admin_server(kind: Kind, file: &std::path::Path, extra: &[&str]) -> TestServer {
    let file = file.display().to_string();
    let mut flags = vec!["--admin-addr", "127.0.0.1:0", "--admin-token-file", &file];
    flags.extend_from_slice(extra);
    start(kind, &[("d.yaml", LIMITS)], &flags).await
}

/// A replica on the Redis at `url` (its keys under `prefix`, when given) with the admin
/// listener and the tokens of `file`, on the system clock.
async fn replica(url: &str, prefix: Option<&str>, file: &std::path::Path) -> TestServer {
    let file = file.display().to_string();
    let mut flags = vec![
        "--backend",
        "redis",
        "--redis-url",
        url,
        "--admin-addr",
        "127.0.0.1:0",
        "--admin-token-file",
        &file,
    ];
    if let Some(prefix) = prefix {
        flags.extend(["--redis-key-prefix", prefix]);
    }
    TestServer::start_with(
        &[("d.yaml", LIMITS)],
        &flags,
        std::sync::Arc::new(ratelimitd::testing::SystemClock),
    )
    .await
}

fn bearer(token: &str) -> String {
    format!("Bearer {token}")
}

/// `PUT /v1/overrides` of `body` as alice: status and body.
async fn put(s: &TestServer, body: &str) -> (u16, serde_json::Value) {
    put_at(s.admin.unwrap(), body).await
}

/// `PUT /v1/overrides` of `body` as alice to the admin listener at `admin`.
async fn put_at(admin: std::net::SocketAddr, body: &str) -> (u16, serde_json::Value) {
    let auth = bearer(ALICE);
    let (status, text) = http_call(
        admin,
        "PUT",
        "/v1/overrides",
        &[
            ("Authorization", &auth),
            ("Content-Type", "application/json"),
        ],
        body.as_bytes(),
    )
    .await;
    (status, serde_json::from_str(&text).unwrap_or_default())
}

/// An override of tenant=`tenant` to `per_hour` an hour (with `more` JSON fields); its id.
async fn set(s: &TestServer, tenant: &str, per_hour: u64, more: &str) -> String {
    let body = format!(
        r#"{{"domain": "d", "entries": [{{"key": "tenant", "value": "{tenant}"}}],
            "limits": [{{"requests_per_unit": {per_hour}, "unit": "hour"}}]{more}}}"#
    );
    let (status, answer) = put(s, &body).await;
    assert_eq!(status, 200, "{answer}");
    answer["id"].as_str().unwrap().to_owned()
}

async fn list(s: &TestServer) -> Vec<serde_json::Value> {
    let auth = bearer(ALICE);
    let (status, text) = http_call(
        s.admin.unwrap(),
        "GET",
        "/v1/overrides?domain=d",
        &[("Authorization", &auth)],
        b"",
    )
    .await;
    assert_eq!(status, 200, "{text}");
    let v: serde_json::Value = serde_json::from_str(&text).unwrap();
    v["overrides"].as_array().unwrap().clone()
}

async fn delete(s: &TestServer, id: &str) -> u16 {
    let auth = bearer(BOB);
    let path = format!("/v1/overrides/{id}");
    http_call(
        s.admin.unwrap(),
        "DELETE",
        &path,
        &[("Authorization", &auth)],
        b"",
    )
    .await
    .0
}

/// Whether one request of tenant=`tenant` passes.
async fn passes(c: &mut Client, tenant: &str) -> bool {
    is_ok(&call(c, request("d", &[&[("tenant", tenant)]])).await)
}

/// How many of `n` requests of tenant=`tenant` pass.
async fn passing(c: &mut Client, tenant: &str, n: usize) -> usize {
    let mut passed = 0;
    for _ in 0..n {
        passed += usize::from(passes(c, tenant).await);
    }
    passed
}

/// No token, a wrong one, a malformed header and a token removed from the file are refused
/// (401; gRPC UNAUTHENTICATED) before anything changes; the Envoy-facing port no longer
/// serves the admin API.
#[tokio::test]
async fn the_admin_listener_asks_who_calls() {
    let (_dir, file) = tokens();
    let s = admin_server(Kind::Memory, &file, &[]).await;
    let admin = s.admin.unwrap();
    let body = r#"{"domain": "d", "entries": [{"key": "tenant", "value": "acme"}],
        "limits": [{"requests_per_unit": 0, "unit": "hour"}]}"#;
    let wrong = bearer("0123456789abcdef-alicf");
    for headers in [
        vec![],
        vec![("Authorization", wrong.as_str())],
        vec![("Authorization", "Basic YWxpY2U6c2VjcmV0")],
        vec![("Authorization", ALICE)],
    ] {
        let (status, text) =
            http_call(admin, "PUT", "/v1/overrides", &headers, body.as_bytes()).await;
        assert_eq!(status, 401, "{headers:?}: {text}");
        assert!(text.contains("token"), "{text}");
        let (status, _) = http_call(admin, "GET", "/v1/overrides", &headers, b"").await;
        assert_eq!(status, 401, "{headers:?}");
    }
    // A megabyte without a token: refused before the body is read, as any other call.
    let (status, _) = http_call(admin, "PUT", "/v1/overrides", &[], &vec![b'{'; 1 << 20]).await;
    assert_eq!(status, 401);
    let mut c = s.client().await;
    assert!(passes(&mut c, "acme").await, "nothing was set");
    assert!(list(&s).await.is_empty());

    // gRPC on the admin listener: the same tokens, as metadata.
    let mut grpc = AdminClient::connect(format!("http://{admin}"))
        .await
        .unwrap();
    let ask = || {
        tonic::Request::new(CounterRequest {
            domain: "d".into(),
            entries: vec![Entry {
                key: "tenant".into(),
                value: "acme".into(),
                escaped: false,
            }],
        })
    };
    let refused = grpc.get_counters(ask()).await.unwrap_err();
    assert_eq!(refused.code(), tonic::Code::Unauthenticated, "{refused:?}");
    let mut with_token = ask();
    with_token
        .metadata_mut()
        .insert("authorization", bearer(BOB).parse().unwrap());
    let counters = grpc.get_counters(with_token).await.unwrap().into_inner();
    assert_eq!(counters.counters[0].requests_per_unit, 100);

    // The Envoy-facing port: no admin API once the admin listener is set.
    let mut envoy_port = AdminClient::connect(format!("http://{}", s.grpc))
        .await
        .unwrap();
    let mut with_token = ask();
    with_token
        .metadata_mut()
        .insert("authorization", bearer(BOB).parse().unwrap());
    let gone = envoy_port.get_counters(with_token).await.unwrap_err();
    assert_eq!(gone.code(), tonic::Code::Unimplemented, "{gone:?}");

    // Every refusal counted, by result only.
    let (_, text) = s.http_get("/metrics").await;
    let refused = metric(
        &text,
        "ratelimit_admin_requests_total{result=\"unauthenticated\"}",
    );
    assert!(refused >= 8.0, "{refused} refusals counted");

    // Bob's token removed from the file: refused within a few seconds, alice's still taken.
    std::fs::write(&file, format!("alice:{ALICE}\n")).unwrap();
    let auth = bearer(BOB);
    poll(Duration::from_secs(10), || async {
        let (status, _) = http_call(
            admin,
            "GET",
            "/v1/overrides",
            &[("Authorization", &auth)],
            b"",
        )
        .await;
        (status == 401).then_some(())
    })
    .await;
    assert!(list(&s).await.is_empty());
}

/// The token file is taken as it is, within the reload interval: emptied, only comments, or
/// deleted, it accepts no token (before, the tokens of the last good version stayed in force);
/// a last line still being written (no newline yet) is no token, nor is a malformed line.
#[tokio::test]
async fn a_token_file_with_no_tokens_accepts_none() {
    let (_dir, file) = tokens();
    let s = admin_server(Kind::Memory, &file, &[]).await;
    let admin = s.admin.unwrap();
    let status = |token: &'static str| async move {
        let auth = bearer(token);
        http_call(
            admin,
            "GET",
            "/v1/overrides",
            &[("Authorization", &auth)],
            b"",
        )
        .await
        .0
    };
    let becomes = |token: &'static str, want: u16, why: &'static str| async move {
        poll(Duration::from_secs(10), || async {
            (status(token).await == want).then_some(())
        })
        .await;
        // Not a passing state: it stays so.
        tokio::time::sleep(Duration::from_millis(1500)).await;
        assert_eq!(status(token).await, want, "{why}");
    };
    let whole = format!("alice:{ALICE}\nbob:{BOB}\n");
    assert_eq!(status(ALICE).await, 200);
    for (text, why) in [
        ("", "emptied"),
        ("# rotated: none yet\n\n", "only comments"),
    ] {
        std::fs::write(&file, text).unwrap();
        becomes(ALICE, 401, why).await;
        assert_eq!(status(BOB).await, 401, "{why}");
        std::fs::write(&file, &whole).unwrap();
        becomes(ALICE, 200, "restored").await;
    }
    std::fs::remove_file(&file).unwrap();
    becomes(ALICE, 401, "deleted").await;
    std::fs::write(&file, &whole).unwrap();
    becomes(BOB, 200, "restored").await;
    // Bob's line cut short, as a write in progress leaves it; a malformed line beside alice's.
    std::fs::write(&file, format!("alice:{ALICE}\nnot a line\nbob:{BOB}")).unwrap();
    becomes(BOB, 401, "a partly written line").await;
    assert_eq!(status(ALICE).await, 200, "alice's whole line still counts");
}

/// Raise, lower, block and delete one tenant's limit; the others keep the config's; the
/// count already used carries over when the algorithm and window stay.
async fn an_override_changes_one_descriptors_limit(kind: Kind) {
    let (_dir, file) = tokens();
    let s = admin_server(kind, &file, &[]).await;
    let mut c = s.client().await;
    set(&s, "acme", 3, "").await;
    assert_eq!(
        passing(&mut c, "acme", 4).await,
        3,
        "3 an hour: the fourth refused"
    );
    assert_eq!(
        passing(&mut c, "other", 10).await,
        10,
        "another tenant keeps 100"
    );
    // POST /json and /top show the limit in force.
    let (status, answer) = post_json(
        s.http,
        r#"{"domain": "d", "descriptors": [{"entries": [{"key": "tenant", "value": "acme"}]}]}"#,
    )
    .await;
    assert_eq!(status, 429, "refused, consuming nothing: {answer}");
    let answer: serde_json::Value = serde_json::from_str(&answer).unwrap();
    assert_eq!(
        answer["statuses"][0]["currentLimit"]["requestsPerUnit"], 3,
        "{answer}"
    );
    let (status, top) = s.http_get("/top?domain=d").await;
    assert_eq!(status, 200, "{top}");
    let top: serde_json::Value = serde_json::from_str(&top).unwrap();
    let limits = top["limits"].as_array().unwrap();
    let under = |rpu: u64, value: &str| {
        limits.iter().any(|l| {
            l["requests_per_unit"] == rpu
                && l["descriptors"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .any(|d| d["entries"][0]["value"] == value)
        })
    };
    assert!(under(3, "acme") && under(100, "other"), "{top}");
    assert!(!under(100, "acme"), "{top}");
    let listed = list(&s).await;
    assert_eq!(listed.len(), 1);
    assert_eq!(listed[0]["created_by"], "alice");
    assert_eq!(listed[0]["entries"][0]["value"], "acme");
    // Raised to 5 after 3 (and a refusal) were used: 2 more pass.
    let raised = set(&s, "acme", 5, r#", "reason": "plan upgrade""#).await;
    assert_eq!(
        passing(&mut c, "acme", 3).await,
        2,
        "5 an hour after 3 used"
    );
    let listed = list(&s).await;
    assert_eq!(listed.len(), 1, "one override per descriptor: {listed:?}");
    assert_eq!(listed[0]["id"], raised.as_str());
    assert_eq!(listed[0]["reason"], "plan upgrade");
    // What is in force is what the admin API shows for the descriptor.
    let auth = bearer(ALICE);
    let mut grpc = AdminClient::connect(format!("http://{}", s.admin.unwrap()))
        .await
        .unwrap();
    let mut ask = tonic::Request::new(CounterRequest {
        domain: "d".into(),
        entries: vec![Entry {
            key: "tenant".into(),
            value: "acme".into(),
            escaped: false,
        }],
    });
    ask.metadata_mut()
        .insert("authorization", auth.parse().unwrap());
    let counters = grpc.get_counters(ask).await.unwrap().into_inner().counters;
    assert_eq!((counters[0].requests_per_unit, counters[0].used), (5, 5));
    // Blocked: refused at once, with 0 as the limit Envoy is told.
    set(&s, "fresh", 0, "").await;
    let r = call(&mut c, request("d", &[&[("tenant", "fresh")]])).await;
    assert!(is_over(&r));
    assert_eq!(rpu_of(&r, 0), Some(0));
    let (_, text) = s.http_get("/metrics").await;
    assert_eq!(
        metric(&text, "ratelimit_overrides"),
        2.0,
        "acme's and fresh's in force"
    );
    assert_eq!(
        metric(&text, "ratelimit_override_changes_total{action=\"set\"}"),
        3.0
    );
    // Deleted: the config's 100 again, at once.
    assert_eq!(delete(&s, &raised).await, 200);
    assert_eq!(delete(&s, &raised).await, 404, "deleted once");
    assert!(passes(&mut c, "acme").await);
    let r = call(&mut c, request("d", &[&[("tenant", "acme")]])).await;
    assert_eq!(rpu_of(&r, 0), Some(100));
}

every_backend!(an_override_changes_one_descriptors_limit);

/// An override of entries no rule matches is kept, and applies once a reload adds a rule
/// they match.
#[tokio::test]
async fn an_override_applies_once_a_rule_matches_it() {
    let (_dir, file) = tokens();
    let s = admin_server(Kind::Memory, &file, &[]).await;
    let mut c = s.client().await;
    let body = r#"{"domain": "d", "entries": [{"key": "plan", "value": "free"}],
        "limits": [{"requests_per_unit": 1, "unit": "hour"}]}"#;
    let (status, answer) = put(&s, body).await;
    assert_eq!(status, 200, "{answer}");
    let free = request("d", &[&[("plan", "free")]]);
    for _ in 0..3 {
        assert!(
            is_ok(&call(&mut c, free.clone()).await),
            "no rule: not limited"
        );
    }
    s.write(
        "d.yaml",
        &format!("{LIMITS}  - key: plan\n    rate_limit: {{unit: hour, requests_per_unit: 50}}\n"),
    );
    // Once the reload is in force, the override's 1 an hour, not the rule's 50.
    poll(Duration::from_secs(10), || {
        let mut c = c.clone();
        let free = free.clone();
        async move {
            let r = call(&mut c, free).await;
            (rpu_of(&r, 0) == Some(1)).then_some(())
        }
    })
    .await;
    assert!(is_over(&call(&mut c, free).await));
}

/// An override's TTL: in force until it ends, the config's limit again within a second after.
#[tokio::test]
async fn an_override_ends_at_its_ttl() {
    let (_dir, file) = tokens();
    let s = admin_server(Kind::Memory, &file, &[]).await;
    let mut c = s.client().await;
    let body = r#"{"domain": "d", "entries": [{"key": "tenant", "value": "acme"}],
        "limits": [{"requests_per_unit": 0, "unit": "hour"}], "ttl": "3s"}"#;
    let set_at = Instant::now();
    let (status, answer) = put(&s, body).await;
    assert_eq!(status, 200, "{answer}");
    assert!(
        answer["expires_at"]
            .as_str()
            .is_some_and(|t| t.ends_with('Z')),
        "{answer}"
    );
    assert!(!passes(&mut c, "acme").await, "blocked while in force");
    poll(Duration::from_secs(10), || {
        let mut c = c.clone();
        async move { passes(&mut c, "acme").await.then_some(()) }
    })
    .await;
    let took = set_at.elapsed();
    println!("a 3 s override: the config's limit again after {took:?}");
    assert!(
        took >= Duration::from_millis(2_900) && took <= Duration::from_secs(4),
        "the config's limit again after {took:?} (TTL 3 s)"
    );
    assert!(
        list(&s).await.is_empty(),
        "an ended override is listed nowhere"
    );
}

/// Malformed overrides are refused with the field named, and change nothing.
#[tokio::test]
async fn malformed_overrides_are_refused_and_change_nothing() {
    let (_dir, file) = tokens();
    let s = admin_server(Kind::Memory, &file, &[]).await;
    let entries = r#""entries": [{"key": "tenant", "value": "acme"}]"#;
    let huge = format!(
        r#"{{"domain": "d", {entries}, "limits": [{{"requests_per_unit": 1, "unit": "hour"}}], "reason": "{}"}}"#,
        "x".repeat(1 << 20)
    );
    let cases = [
        (
            format!(
                r#"{{"domain": "d", {entries}, "limits": [{{"requests_per_unit": 1, "unit": "fortnight"}}]}}"#
            ),
            "limits[0].unit",
        ),
        (
            format!(r#"{{{entries}, "limits": [{{"requests_per_unit": 1, "unit": "hour"}}]}}"#),
            "domain",
        ),
        (
            format!(
                r#"{{"domain": "d", {entries}, "limits": [{{"requests_per_unit": -1, "unit": "hour"}}]}}"#
            ),
            "limits[0].requests_per_unit",
        ),
        (huge, "body"),
        ("{".to_owned(), "body"),
    ];
    for (body, field) in cases {
        let (status, answer) = put(&s, &body).await;
        assert_eq!(status, 400, "{field}: {answer}");
        assert_eq!(answer["field"], field, "{answer}");
    }
    assert!(list(&s).await.is_empty());
    let mut c = s.client().await;
    assert_eq!(passing(&mut c, "acme", 5).await, 5);
}

/// Past `--max-overrides` a new override is refused with a message; replacing one is not.
#[tokio::test]
async fn overrides_are_bounded() {
    let (_dir, file) = tokens();
    let s = admin_server(Kind::Memory, &file, &["--max-overrides", "2"]).await;
    set(&s, "a", 1, "").await;
    set(&s, "b", 1, "").await;
    let body = r#"{"domain": "d", "entries": [{"key": "tenant", "value": "c"}],
        "limits": [{"requests_per_unit": 1, "unit": "hour"}]}"#;
    let (status, answer) = put(&s, body).await;
    assert_eq!(status, 409, "{answer}");
    assert!(
        answer["error"]
            .as_str()
            .unwrap()
            .contains("--max-overrides")
    );
    set(&s, "a", 2, "").await;
    assert_eq!(list(&s).await.len(), 2);
}

/// The operator's override comes before a limit the request sends, and the config's.
#[tokio::test]
async fn an_override_comes_before_the_requests_own_limit() {
    use envoy_types::pb::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::RateLimitOverride;
    let (_dir, file) = tokens();
    let s = admin_server(Kind::Memory, &file, &[]).await;
    let mut c = s.client().await;
    set(&s, "acme", 2, "").await;
    let mut req = request("d", &[&[("tenant", "acme")]]);
    req.descriptors[0].limit = Some(RateLimitOverride {
        requests_per_unit: 50,
        unit: 3, // HOUR
    });
    let mut passed = 0;
    for _ in 0..4 {
        passed += usize::from(is_ok(&call(&mut c, req.clone()).await));
    }
    assert_eq!(passed, 2, "the operator's 2, not the request's 50");
}

/// Two replicas on one Redis: an override set on one is applied by the other within 2 s, and
/// by a replica started after it.
#[tokio::test]
async fn replicas_on_redis_apply_an_override_within_two_seconds() {
    let (_dir, file) = tokens();
    let url = common::redis::shared_standalone().url();
    let prefix = common::redis::unique_prefix();
    let a = replica(&url, Some(&prefix), &file).await;
    let b = replica(&url, Some(&prefix), &file).await;
    let mut on_b = b.client().await;
    assert!(passes(&mut on_b, "acme").await);
    let set_at = Instant::now();
    set(&a, "acme", 0, "").await;
    poll(Duration::from_secs(5), || {
        let mut c = on_b.clone();
        async move { (!passes(&mut c, "acme").await).then_some(()) }
    })
    .await;
    let took = set_at.elapsed();
    println!("set on one replica, applied by the other after {took:?}");
    assert!(
        took <= Duration::from_secs(2),
        "applied by the other replica after {took:?}"
    );
    // Listed by either; a replica started now applies it at once.
    assert_eq!(list(&b).await.len(), 1);
    drop(b);
    let c = replica(&url, Some(&prefix), &file).await;
    let mut on_c = c.client().await;
    assert!(!passes(&mut on_c, "acme").await, "a new replica applies it");
    assert!(passes(&mut on_c, "other").await);
}

/// Replicas converge on what Redis holds after it lost overrides or went back to an older set:
/// a FLUSHALL, then a change before the next poll; and a restart from an older snapshot (a
/// failover to a replica that lags), then a change. Before, `:version` was a counter that
/// started again at the value the replicas had last read for another set: they kept a deleted
/// block and never applied the new one.
#[tokio::test]
async fn replicas_converge_after_redis_loses_or_rolls_back_overrides() {
    let (_dir, file) = tokens();
    let mut redis = common::redis::RedisProc::start(&[]);
    let url = redis.url();
    let a = replica(&url, None, &file).await;
    let b = replica(&url, None, &file).await;
    let on_b = b.client().await;
    // Which of `tenants` b lets through, once it does as `want` says (5 s at most).
    let b_sees = |want: &'static [(&'static str, bool)]| {
        let on_b = on_b.clone();
        async move {
            let since = Instant::now();
            poll(Duration::from_secs(5), || {
                let mut c = on_b.clone();
                async move {
                    for (tenant, passes_now) in want {
                        if passes(&mut c, tenant).await != *passes_now {
                            return None;
                        }
                    }
                    Some(())
                }
            })
            .await;
            since.elapsed()
        }
    };
    // A block set on a; Redis may be answering again only after a reconnect.
    let on_a = &a;
    let block = move |tenant: &'static str| async move {
        let body = format!(
            r#"{{"domain": "d", "entries": [{{"key": "tenant", "value": "{tenant}"}}],
                "limits": [{{"requests_per_unit": 0, "unit": "hour"}}]}}"#
        );
        poll(Duration::from_secs(10), || async {
            (put(on_a, &body).await.0 == 200).then_some(())
        })
        .await;
    };

    block("acme").await;
    b_sees(&[("acme", false)]).await;
    redis.cli(&["FLUSHALL"]);
    block("other").await;
    let took = b_sees(&[("acme", true), ("other", false)]).await;
    println!("after a FLUSHALL and a change, b converged in {took:?}");
    assert!(took <= Duration::from_secs(2), "{took:?}");

    // {other} saved; then {other, third}; then back to {other}, and a change at once.
    redis.cli(&["SAVE"]);
    block("third").await;
    b_sees(&[("third", false)]).await;
    redis.restart();
    block("fourth").await;
    let took = b_sees(&[("third", true), ("fourth", false), ("other", false)]).await;
    println!("after a roll back and a change, b converged in {took:?}");
    assert!(took <= Duration::from_secs(2), "{took:?}");
}

/// What a change costs Redis' egress does not grow with the overrides in force: each replica
/// reads what changed since its last read, not the whole set. Ten changes, one each 200 ms,
/// with two replicas, at 20 overrides in force and at 2,000. Before, each change had every
/// replica read the whole hash (1.3-1.5 MB/s at 3,000 overrides and a change a second).
#[tokio::test]
async fn a_change_costs_each_replica_what_changed_not_the_set() {
    let (_dir, file) = tokens();
    let redis = common::redis::RedisProc::start(&[]);
    let url = redis.url();
    let a = replica(&url, None, &file).await;
    let b = replica(&url, None, &file).await;
    let sent = || {
        let info = redis.cli(&["INFO", "stats"]);
        info.lines()
            .find_map(|l| l.strip_prefix("total_net_output_bytes:"))
            .expect("INFO stats has total_net_output_bytes")
            .trim()
            .parse::<u64>()
            .unwrap()
    };
    // Both replicas apply `n` overrides (10 s at most).
    let in_force = |n: usize| {
        let (a, b) = (&a, &b);
        async move {
            poll(Duration::from_secs(10), || async {
                for s in [a, b] {
                    let (_, text) = s.http_get("/metrics").await;
                    if metric(&text, "ratelimit_overrides") != n as f64 {
                        return None;
                    }
                }
                Some(())
            })
            .await;
        }
    };
    // Sets overrides `from..to` from eight callers at once.
    let admin = a.admin.unwrap();
    let add = |from: usize, to: usize| async move {
        let callers: Vec<_> = (0..8)
            .map(|k| {
                tokio::spawn(async move {
                    for i in (from + k..to).step_by(8) {
                        let body = format!(
                            r#"{{"domain": "d", "entries": [{{"key": "tenant", "value": "t-{i}"}}],
                                "limits": [{{"requests_per_unit": 100, "unit": "hour"}}],
                                "reason": "a reason of some length, as operators write them"}}"#
                        );
                        let (status, answer) = put_at(admin, &body).await;
                        assert_eq!(status, 200, "{answer}");
                    }
                })
            })
            .collect();
        for c in callers {
            c.await.unwrap();
        }
    };
    // Bytes Redis sends per change: ten changes paced 200 ms apart, until both replicas
    // have applied them.
    let per_change = |from: usize| {
        let (sent, in_force, add) = (&sent, &in_force, &add);
        async move {
            let before = sent();
            for i in from..from + 10 {
                add(i, i + 1).await;
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            in_force(from + 10).await;
            (sent() - before) / 10
        }
    };
    add(0, 20).await;
    in_force(20).await;
    let small = per_change(20).await;
    add(30, 2_000).await;
    in_force(2_000).await;
    let large = per_change(2_000).await;
    println!("Redis sent per change: {small} B at 20 overrides in force, {large} B at 2,000");
    assert!(
        large < 2 * small + 2_000,
        "{large} B per change at 2,000 overrides, {small} B at 20"
    );
    // A change an older build made (the hash and `:version`, no log) is read whole, also by
    // the replica that has just made a change of its own (logged, not yet read back).
    add(2_010, 2_011).await;
    let legacy = serde_json::json!({
        "id": "00000000000001d0", "domain": "d",
        "entries": [{"key": "tenant", "value": "legacy"}],
        "limits": [{"requests_per_unit": 0, "unit": "hour"}],
        "expires_at_ms": null, "reason": "", "created_by": "old", "created_at_ms": 0,
    });
    let all = "ratelimit:{ratelimitd-overrides}:all";
    redis.cli(&["HSET", all, "00000000000001d0", &legacy.to_string()]);
    redis.cli(&["SET", "ratelimit:{ratelimitd-overrides}:version", "12345"]);
    in_force(2_012).await;
    let mut on_b = b.client().await;
    assert!(!passes(&mut on_b, "legacy").await);
}

/// On the memory backend, `--overrides-file` keeps overrides across a restart.
#[tokio::test]
async fn the_overrides_file_keeps_them_across_a_restart() {
    let (dir, file) = tokens();
    let kept = dir.path().join("overrides.json");
    let kept_flag = kept.display().to_string();
    let mut s = admin_server(Kind::Memory, &file, &["--overrides-file", &kept_flag]).await;
    let id = set(&s, "acme", 0, r#", "reason": "attack""#).await;
    s.shutdown().await.unwrap();
    assert!(std::fs::read_to_string(&kept).unwrap().contains(&id));
    let s = admin_server(Kind::Memory, &file, &["--overrides-file", &kept_flag]).await;
    let mut c = s.client().await;
    assert!(!passes(&mut c, "acme").await, "applied after the restart");
    let listed = list(&s).await;
    assert_eq!(listed[0]["id"], id.as_str());
    assert_eq!(listed[0]["reason"], "attack");
}

/// On the memory backend, a change acknowledged is in `--overrides-file`, however many are
/// written at once (one write and fsync per batch of changes): eight callers PUT as fast as
/// they can until the process is killed (SIGKILL) under them, three times; each restart
/// lists every override acknowledged before.
#[tokio::test]
async fn acknowledged_changes_survive_a_kill_mid_storm() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let (dir, file) = tokens();
    std::fs::write(dir.path().join("d.yaml"), LIMITS).unwrap();
    let kept = dir.path().join("overrides.json").display().to_string();
    let token_file = file.display().to_string();
    // A PUT that may meet a dead process: the id when acknowledged.
    async fn try_put(admin: std::net::SocketAddr, body: String) -> Option<String> {
        let mut stream = tokio::net::TcpStream::connect(admin).await.ok()?;
        let auth = bearer(ALICE);
        let req = format!(
            "PUT /v1/overrides HTTP/1.1\r\nHost: test\r\nConnection: close\r\nAuthorization: {auth}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
            body.len()
        );
        stream.write_all(req.as_bytes()).await.ok()?;
        let mut raw = Vec::new();
        stream.read_to_end(&mut raw).await.ok()?;
        let text = String::from_utf8_lossy(&raw);
        let (head, answer) = text.split_once("\r\n\r\n")?;
        if !head.starts_with("HTTP/1.1 200") {
            return None;
        }
        let v: serde_json::Value = serde_json::from_str(answer).ok()?;
        Some(v["id"].as_str()?.to_owned())
    }
    let mut acknowledged: Vec<String> = Vec::new();
    for round in 0..3 {
        let port = common::redis::free_port();
        let admin: std::net::SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
        let admin_flag = admin.to_string();
        let cmd = common::daemon::ratelimitd(
            dir.path().join("d.yaml"),
            &[
                "--admin-addr",
                &admin_flag,
                "--admin-token-file",
                &token_file,
                "--overrides-file",
                &kept,
                "--log-level",
                "warn",
            ],
        );
        let mut d = common::daemon::Daemon::start(cmd).await;
        // Every override acknowledged before is listed.
        let auth = bearer(ALICE);
        let (status, text) = poll(Duration::from_secs(10), || async {
            tokio::net::TcpStream::connect(admin).await.ok()?;
            Some(
                http_call(
                    admin,
                    "GET",
                    "/v1/overrides",
                    &[("Authorization", &auth)],
                    b"",
                )
                .await,
            )
        })
        .await;
        assert_eq!(status, 200, "{text}");
        let listed: serde_json::Value = serde_json::from_str(&text).unwrap();
        let listed: std::collections::HashSet<&str> = listed["overrides"]
            .as_array()
            .unwrap()
            .iter()
            .map(|o| o["id"].as_str().unwrap())
            .collect();
        let lost: Vec<_> = acknowledged
            .iter()
            .filter(|id| !listed.contains(id.as_str()))
            .collect();
        assert!(
            lost.is_empty(),
            "round {round}: {} of {} acknowledged lost",
            lost.len(),
            acknowledged.len()
        );
        // Eight callers until the kill; each one's own tenants, replacing earlier rounds'.
        let before = acknowledged.len();
        let callers: Vec<_> = (0..8)
            .map(|k| {
                tokio::spawn(async move {
                    let mut ids = Vec::new();
                    for i in 0.. {
                        let body = format!(
                            r#"{{"domain": "d", "entries": [{{"key": "tenant", "value": "r{round}-{k}-{i}"}}],
                                "limits": [{{"requests_per_unit": 100, "unit": "hour"}}]}}"#
                        );
                        match try_put(admin, body).await {
                            Some(id) => ids.push(id),
                            None => break,
                        }
                    }
                    ids
                })
            })
            .collect();
        // Killed once some have landed, while the callers keep calling.
        let since = acknowledged.len();
        poll(Duration::from_secs(10), || async {
            let (_, text) = http_call(d.http, "GET", "/metrics", &[], b"").await;
            (metric(&text, "ratelimit_overrides") >= (since + 100) as f64).then_some(())
        })
        .await;
        d.child.kill().unwrap();
        d.child.wait().unwrap();
        for c in callers {
            acknowledged.extend(c.await.unwrap());
        }
        assert!(acknowledged.len() >= before + 50, "round {round}");
    }
    println!("{} PUTs acknowledged over three kills", acknowledged.len());
}

/// The admin listener does not start without tokens: a usage error naming the flags.
#[test]
fn the_admin_listener_needs_a_token_file() {
    let err = ratelimitd::settings::parse(
        [
            "ratelimitd",
            "--config",
            "/tmp",
            "--admin-addr",
            "127.0.0.1:0",
        ],
        |_| None,
    )
    .err()
    .expect("refused");
    let text = err.to_string();
    assert!(
        text.contains("--admin-addr") && text.contains("--admin-token-file"),
        "{text}"
    );
    assert_eq!(err.exit_code(), 2);
    let dir = tempfile::tempdir().unwrap();
    let weak = dir.path().join("tokens");
    std::fs::write(&weak, "alice:short\n").unwrap();
    let err = ratelimitd::settings::parse(
        [
            "ratelimitd",
            "--config",
            "/tmp",
            "--admin-addr",
            "127.0.0.1:0",
            "--admin-token-file",
            weak.to_str().unwrap(),
        ],
        |_| None,
    )
    .err()
    .expect("refused");
    assert!(err.to_string().contains(":1:"), "names the line: {err}");
}

/// The same three as gRPC methods of `Admin` on the admin listener (the caller's token name
/// kept as `created_by`); the deprecated `--admin` port, which does not know who calls, refuses
/// them.
#[tokio::test]
async fn overrides_over_grpc() {
    use ratelimitd::admin::{
        DeleteOverrideRequest, ListOverridesRequest, OverrideLimit, SetOverrideRequest,
    };
    let (_dir, file) = tokens();
    let s = admin_server(Kind::Memory, &file, &[]).await;
    let mut grpc = AdminClient::connect(format!("http://{}", s.admin.unwrap()))
        .await
        .unwrap();
    fn as_bob<M>(m: M) -> tonic::Request<M> {
        let mut r = tonic::Request::new(m);
        r.metadata_mut()
            .insert("authorization", bearer(BOB).parse().unwrap());
        r
    }
    let set = SetOverrideRequest {
        domain: "d".into(),
        entries: vec![Entry {
            key: "tenant".into(),
            value: "acme".into(),
            escaped: false,
        }],
        limits: vec![OverrideLimit {
            requests_per_unit: 2,
            unit: "minute".into(),
            algorithm: "sliding_window".into(),
            ..OverrideLimit::default()
        }],
        ttl: "1h".into(),
        reason: "trial".into(),
    };
    let made = grpc
        .set_override(as_bob(set.clone()))
        .await
        .unwrap()
        .into_inner();
    assert!(made.expires_at.ends_with('Z'), "{made:?}");
    let mut c = s.client().await;
    assert_eq!(passing(&mut c, "acme", 3).await, 2);
    let listed = grpc
        .list_overrides(as_bob(ListOverridesRequest { domain: "d".into() }))
        .await
        .unwrap()
        .into_inner()
        .overrides;
    assert_eq!(listed.len(), 1);
    assert_eq!(listed[0].id, made.id);
    assert_eq!(listed[0].created_by, "bob");
    assert_eq!(listed[0].limits[0].algorithm, "sliding_window");
    assert_eq!(listed[0].limits[0].requests_per_unit, 2);
    // Malformed: INVALID_ARGUMENT naming the field; nothing changes.
    let mut bad = set.clone();
    bad.limits[0].unit = "fortnight".into();
    let e = grpc.set_override(as_bob(bad)).await.unwrap_err();
    assert_eq!(e.code(), tonic::Code::InvalidArgument);
    assert!(e.message().contains("limits[0].unit"), "{e:?}");
    let gone = grpc
        .delete_override(as_bob(DeleteOverrideRequest {
            id: made.id.clone(),
        }))
        .await
        .unwrap();
    assert_eq!(gone.into_inner().id, made.id);
    let again = grpc
        .delete_override(as_bob(DeleteOverrideRequest { id: made.id }))
        .await
        .unwrap_err();
    assert_eq!(again.code(), tonic::Code::NotFound);
    assert!(passes(&mut c, "acme").await);

    // The deprecated port: counters yes, overrides no.
    let legacy = start(Kind::Memory, &[("d.yaml", LIMITS)], &["--admin"]).await;
    let mut on_grpc_port = AdminClient::connect(format!("http://{}", legacy.grpc))
        .await
        .unwrap();
    let e = on_grpc_port.set_override(set).await.unwrap_err();
    assert_eq!(e.code(), tonic::Code::FailedPrecondition, "{e:?}");
}

/// `ratelimitd override set|list|delete` against the binary's admin listener, the token from a
/// file; a wrong token fails (exit 1) with the listener's answer.
#[tokio::test]
async fn the_override_command_sets_lists_and_deletes() {
    use common::daemon::{BIN, Daemon, ratelimitd};
    let (dir, file) = tokens();
    std::fs::write(dir.path().join("d.yaml"), LIMITS).unwrap();
    let admin_port = common::redis::free_port();
    let admin = format!("127.0.0.1:{admin_port}");
    let token_file = file.display().to_string();
    let config = dir.path().join("d.yaml");
    let d = Daemon::start(ratelimitd(
        &config,
        &["--admin-addr", &admin, "--admin-token-file", &token_file],
    ))
    .await;
    let mine = dir.path().join("my-token");
    std::fs::write(&mine, format!("{ALICE}\n")).unwrap();
    let mine = mine.display().to_string();
    let run = |args: &[&str]| {
        let out = std::process::Command::new(BIN)
            .arg("override")
            .args(["--addr", &admin, "--token-file", &mine])
            .args(args)
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&out.stdout).to_string();
        (
            out.status.code(),
            text,
            String::from_utf8_lossy(&out.stderr).to_string(),
        )
    };
    let (code, out, err) = run(&[
        "set",
        "--domain",
        "d",
        "--entry",
        "tenant=acme",
        "--limit",
        "1/hour",
        "--ttl",
        "1h",
        "--reason",
        "from the command line",
    ]);
    assert_eq!(code, Some(0), "{out} {err}");
    let id = serde_json::from_str::<serde_json::Value>(&out).unwrap()["id"]
        .as_str()
        .unwrap()
        .to_owned();
    let mut c = d.client().await;
    assert_eq!(passing(&mut c, "acme", 2).await, 1);
    let (code, out, _) = run(&["list", "--domain", "d"]);
    assert_eq!(code, Some(0));
    assert!(
        out.contains(&id) && out.contains("\"created_by\":\"alice\""),
        "{out}"
    );
    let (code, _, _) = run(&["delete", &id]);
    assert_eq!(code, Some(0));
    let (code, _, err) = run(&["delete", &id]);
    assert_eq!(code, Some(1), "{err}");
    assert!(err.contains("HTTP 404"), "{err}");
    // The token from the environment; a wrong one is refused.
    let out = std::process::Command::new(BIN)
        .args(["override", "--addr", &admin, "list"])
        .env("RATELIMITD_ADMIN_TOKEN", "not-a-token-of-the-file")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("HTTP 401"));
    // Every change logged with the token's name, the entries and the limits; never a token.
    let (_, log) = d.terminate().await;
    let set_line = log
        .lines()
        .find(|l| l.contains("override set"))
        .unwrap_or_else(|| panic!("{log}"));
    assert!(
        set_line.contains("alice") && set_line.contains("tenant=acme"),
        "{set_line}"
    );
    assert!(
        log.lines()
            .any(|l| l.contains("override deleted") && l.contains("alice")),
        "{log}"
    );
    assert!(
        !log.contains(ALICE) && !log.contains(BOB),
        "a token in the log: {log}"
    );
}

/// The admin listener over mutual TLS, without a token file: a client certificate from the
/// CA is who calls (`created_by` names it by its SHA-256); a client without one is refused at
/// the handshake, and one with a token but no certificate gets nowhere.
#[tokio::test]
async fn the_admin_listener_over_mutual_tls_knows_callers_by_their_certificate() {
    use ratelimitd::admin::{ListOverridesRequest, OverrideLimit, SetOverrideRequest};
    use tonic::transport::{Certificate, Channel, ClientTlsConfig, Identity};
    let tmp = tempfile::tempdir().unwrap();
    let certs = common::redis::make_certs(tmp.path());
    let path = |f: &str| certs.join(f).display().to_string();
    let (cert, key, ca) = (path("server.crt"), path("server.key"), path("ca.crt"));
    let s = start(
        Kind::Memory,
        &[("d.yaml", LIMITS)],
        &[
            "--admin-addr",
            "127.0.0.1:0",
            "--admin-tls-cert",
            &cert,
            "--admin-tls-key",
            &key,
            "--admin-tls-client-ca",
            &ca,
        ],
    )
    .await;
    let admin = s.admin.unwrap();
    let channel = |identity: bool| {
        let mut tls = ClientTlsConfig::new()
            .ca_certificate(Certificate::from_pem(std::fs::read(&ca).unwrap()))
            .domain_name("localhost");
        if identity {
            tls = tls.identity(Identity::from_pem(
                std::fs::read(certs.join("client.crt")).unwrap(),
                std::fs::read(certs.join("client.key")).unwrap(),
            ));
        }
        Channel::from_shared(format!("https://127.0.0.1:{}", admin.port()))
            .unwrap()
            .tls_config(tls)
            .unwrap()
            .connect_timeout(Duration::from_secs(5))
    };
    let set = SetOverrideRequest {
        domain: "d".into(),
        entries: vec![Entry {
            key: "tenant".into(),
            value: "acme".into(),
            escaped: false,
        }],
        limits: vec![OverrideLimit {
            requests_per_unit: 0,
            unit: "hour".into(),
            ..OverrideLimit::default()
        }],
        ttl: String::new(),
        reason: "mtls".into(),
    };
    // No certificate: no connection, so nothing set.
    let refused = match channel(false).connect().await {
        Err(_) => true,
        Ok(ch) => AdminClient::new(ch)
            .set_override(set.clone())
            .await
            .is_err(),
    };
    assert!(refused, "a client without a certificate was served");
    let mut grpc = AdminClient::new(
        poll(Duration::from_secs(10), || async {
            channel(true).connect().await.ok()
        })
        .await,
    );
    grpc.set_override(set).await.unwrap();
    let listed = grpc
        .list_overrides(ListOverridesRequest::default())
        .await
        .unwrap()
        .into_inner()
        .overrides;
    assert_eq!(listed.len(), 1);
    assert!(
        listed[0].created_by.starts_with("cert:sha256:") && listed[0].created_by.len() == 28,
        "{}",
        listed[0].created_by
    );
    let mut c = s.client().await;
    assert!(!passes(&mut c, "acme").await);
}

/// The deprecated `--admin` still serves the admin API on the gRPC port, and says at start
/// that it is going.
#[tokio::test]
async fn the_old_admin_flag_warns() {
    use common::daemon::{Daemon, ratelimitd};
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("d.yaml");
    std::fs::write(&config, LIMITS).unwrap();
    let d = Daemon::start(ratelimitd(&config, &["--admin"])).await;
    let mut admin = AdminClient::connect(format!("http://127.0.0.1:{}", d.grpc))
        .await
        .unwrap();
    let counters = admin
        .get_counters(CounterRequest {
            domain: "d".into(),
            entries: vec![Entry {
                key: "tenant".into(),
                value: "acme".into(),
                escaped: false,
            }],
        })
        .await
        .unwrap();
    assert_eq!(counters.into_inner().counters[0].requests_per_unit, 100);
    let (_, log) = d.terminate().await;
    let warning = log
        .lines()
        .find(|l| l.contains("--admin-addr"))
        .unwrap_or_else(|| panic!("no warning: {log}"));
    assert!(warning.contains("WARN"), "{warning}");
}

/// A rule whose requests name a hold (`hold_key`): the override is of the descriptor's entries
/// less the hold's id, which every request has its own of.
#[tokio::test]
async fn an_override_of_a_rule_with_holds_is_of_the_entries_before_the_hold() {
    let (_dir, file) = tokens();
    let token_file = file.display().to_string();
    let limits = format!(
        "{LIMITS}  - key: user\n    hold_key: request_id\n    rate_limit: {{unit: hour, requests_per_unit: 100}}\n"
    );
    let s = start(
        Kind::Memory,
        &[("d.yaml", &limits)],
        &[
            "--admin-addr",
            "127.0.0.1:0",
            "--admin-token-file",
            &token_file,
        ],
    )
    .await;
    let body = r#"{"domain": "d", "entries": [{"key": "user", "value": "alice"}],
        "limits": [{"requests_per_unit": 1, "unit": "hour"}]}"#;
    let (status, answer) = put(&s, body).await;
    assert_eq!(status, 200, "{answer}");
    let mut c = s.client().await;
    let held = |user: &'static str, id: &'static str| {
        request("d", &[&[("user", user), ("request_id", id)]])
    };
    assert!(is_ok(&call(&mut c, held("alice", "r1")).await));
    let r = call(&mut c, held("alice", "r2")).await;
    assert!(is_over(&r), "the override's 1 an hour");
    assert_eq!(rpu_of(&r, 0), Some(1));
    for id in ["r3", "r4"] {
        assert!(is_ok(&call(&mut c, held("bob", id)).await), "bob keeps 100");
    }
}

/// The audit log as the binary writes it, in both formats, when a caller chooses a reason and
/// an entry value holding a newline and a forged line (`override deleted by=mallory`) and
/// field-like text: every line the process writes is one of its own (text: it starts with a
/// timestamp; JSON: it parses), the forged text is never a line of its own, and JSON keeps the
/// reason exactly.
#[tokio::test]
async fn the_audit_log_cannot_be_forged() {
    use common::daemon::{Daemon, ratelimitd};
    const FORGED: &str =
        "2026-12-02T00:00:00.000000Z  INFO ratelimitd: override deleted by=mallory";
    for format in ["text", "json"] {
        let (dir, file) = tokens();
        std::fs::write(dir.path().join("d.yaml"), LIMITS).unwrap();
        let admin_port = common::redis::free_port();
        let admin = format!("127.0.0.1:{admin_port}");
        let token_file = file.display().to_string();
        let d = Daemon::start(ratelimitd(
            dir.path().join("d.yaml"),
            &[
                "--admin-addr",
                &admin,
                "--admin-token-file",
                &token_file,
                "--log-format",
                format,
                "--log-level",
                "info",
            ],
        ))
        .await;
        let admin: std::net::SocketAddr = admin.parse().unwrap();
        let reason = format!("ticket 1\n{FORGED} id=x\r\n{FORGED}");
        let body = serde_json::json!({
            "domain": "d",
            "entries": [{"key": "tenant", "value": format!("acme\n{FORGED}")}],
            "limits": [{"requests_per_unit": 5, "unit": "hour"}],
            "reason": reason,
        })
        .to_string();
        let auth = bearer(ALICE);
        let (status, answer) = put_at(admin, &body).await;
        assert_eq!(status, 200, "{answer}");
        let id = answer["id"].as_str().unwrap().to_owned();
        let (status, _) = http_call(
            admin,
            "DELETE",
            &format!("/v1/overrides/{id}"),
            &[("Authorization", &auth)],
            b"",
        )
        .await;
        assert_eq!(status, 200);
        let (_, log) = d.terminate().await;
        assert!(
            log.contains("override set") && log.contains("override deleted"),
            "{log}"
        );
        for line in log.lines().filter(|l| !l.is_empty()) {
            assert!(
                !line.starts_with("2026-12-02T00:00:00"),
                "{format}: a forged line: {line}\n{log}"
            );
            if format == "json" {
                let v: serde_json::Value =
                    serde_json::from_str(line).unwrap_or_else(|e| panic!("not JSON ({e}): {line}"));
                if v["fields"]["message"] == "override set" {
                    assert_eq!(v["fields"]["reason"], reason.as_str());
                }
            } else {
                let stamp = line.split(' ').next().unwrap();
                assert!(
                    stamp.len() >= 20 && stamp.as_bytes()[4] == b'-' && stamp.ends_with('Z'),
                    "text: a line not of the process: {line}\n{log}"
                );
                if line.contains("override set") {
                    assert!(line.contains(r#"reason="ticket 1\n2026"#), "{line}");
                }
            }
        }
    }
}

/// The admin listener's small promises: a path the JSON API does not have is `404` for an HTTP
/// client (a mistyped `curl -X DELETE` is not a success), after the token check as every path;
/// a body giving a key twice is `400` naming it and changes nothing; the `Bearer` scheme is
/// matched whatever its case (RFC 9110).
#[tokio::test]
async fn the_admin_listener_says_what_it_did_not_do() {
    let (_dir, file) = tokens();
    let s = admin_server(Kind::Memory, &file, &[]).await;
    let admin = s.admin.unwrap();
    let auth = bearer(ALICE);
    for (method, path) in [
        ("DELETE", "/v1/override/abc"),
        ("GET", "/v1/overridess"),
        ("GET", "/"),
        ("DELETE", "/v1/overrides/abc/def"),
    ] {
        let (status, text) = http_call(admin, method, path, &[("Authorization", &auth)], b"").await;
        assert_eq!(status, 404, "{method} {path}: {text}");
        let (status, _) = http_call(admin, method, path, &[], b"").await;
        assert_eq!(status, 401, "{method} {path} without a token");
    }
    let twice = r#"{"domain": "d", "entries": [{"key": "tenant", "value": "acme"}],
        "limits": [{"requests_per_unit": 5, "unit": "hour"}], "limits": []}"#;
    let (status, answer) = put(&s, twice).await;
    assert_eq!(
        (status, answer["field"].as_str()),
        (400, Some("limits")),
        "{answer}"
    );
    let nested = r#"{"domain": "d", "entries": [{"key": "tenant", "key": "user", "value": "acme"}],
        "limits": [{"requests_per_unit": 5, "unit": "hour"}]}"#;
    let (status, answer) = put(&s, nested).await;
    assert_eq!(
        (status, answer["field"].as_str()),
        (400, Some("key")),
        "{answer}"
    );
    assert!(list(&s).await.is_empty(), "nothing set");
    for scheme in ["bearer", "BEARER", "Bearer"] {
        let header = format!("{scheme} {ALICE}");
        let (status, text) = http_call(
            admin,
            "GET",
            "/v1/overrides",
            &[("Authorization", &header)],
            b"",
        )
        .await;
        assert_eq!(status, 200, "{header}: {text}");
    }
}
