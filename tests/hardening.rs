//! Regression tests for defects found by using the service as a hostile client and an unlucky
//! operator would (issue 6): each failed before its fix.

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::redis::*;
use common::*;
use envoy_types::pb::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::RateLimitOverride;
use envoy_types::pb::google::protobuf::UInt64Value;
use ratelimitd::testing::SystemClock;
use ratelimitd::testing::slot;

async fn redis_backed(redis: &RedisProc, files: &[(&str, &str)], extra: &[&str]) -> TestServer {
    let url = redis.url();
    let target = [&["--redis-url", url.as_str()], extra].concat();
    redis_server(files, &target, &unique_prefix(), "2s").await
}

fn with_hits(
    mut req: envoy_types::pb::envoy::service::ratelimit::v3::RateLimitRequest,
    i: usize,
    hits: u64,
) -> envoy_types::pb::envoy::service::ratelimit::v3::RateLimitRequest {
    req.descriptors[i].hits_addend = Some(UInt64Value { value: hits });
    req
}

const QUOTAS: &str = "domain: q\ndescriptors:\n  - key: a\n    quota_mode: true\n    rate_limit: {unit: hour, requests_per_unit: 2}\n  - key: b\n    quota_mode: true\n    rate_limit: {unit: hour, requests_per_unit: 2}\n";

/// Defect 1: with per-descriptor hash tags a rejected request refunded every limit of the
/// groups that passed, including quota limits that were over and had consumed nothing.
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

/// Defect 2: a sliding_log commit or refund did work per hit, so one request with a large
/// `hits_addend` blocked Redis for seconds. No call may now show in SLOWLOG above 10 ms.
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
        with_hits(request("big", &[&[("log", "a")]]), 0, 2_000_000),
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
    let req = with_hits(
        request("big", &[&[("log", "b")], &[("tight", "t")]]),
        0,
        1_999_999,
    );
    assert!(is_over(&call(&mut c, req).await));
    let r = call(&mut c, with_hits(request("big", &[&[("log", "b")]]), 0, 0)).await;
    assert_eq!(r.statuses[0].limit_remaining, 2_000_000, "refunded exactly");
    let (_, m) = s.http_get("/metrics").await;
    assert!(
        !m.contains("ratelimit_backend_errors_total{"),
        "no script call failed, refunds included: {m}"
    );
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

/// Defect 4: a `limit` override put the request's own entry keys into the `rule` label.
#[tokio::test]
async fn overrides_and_detailed_metrics_cannot_explode_metric_cardinality() {
    let yaml = "domain: m\ndescriptors:\n  - key: user\n    detailed_metric: true\n    rate_limit: {unit: hour, requests_per_unit: 5}\n";
    let s = TestServer::start(&[("m.yaml", yaml)]).await;
    let mut c = s.client().await;
    for i in 0..200 {
        // 64 descriptors, each a random key with an override.
        let keys: Vec<String> = (0..64).map(|j| format!("k{i}x{j}")).collect();
        let entries: Vec<[(&str, &str); 1]> = keys.iter().map(|k| [(k.as_str(), "v")]).collect();
        let descriptors: Vec<&[(&str, &str)]> = entries.iter().map(|e| &e[..]).collect();
        let mut req = request("m", &descriptors);
        for d in &mut req.descriptors {
            d.limit = Some(RateLimitOverride {
                requests_per_unit: 10,
                unit: 1,
            });
        }
        call(&mut c, req).await;
    }
    for i in 0..1500 {
        call(&mut c, request("m", &[&[("user", &format!("u{i}"))]])).await;
    }
    let (_, m) = s.http_get("/metrics").await;
    let series = m
        .lines()
        .filter(|l| l.starts_with("ratelimit_decisions_total{"))
        .count();
    assert!(series <= 1002, "{series} series");
    assert!(!m.contains("k0x0"), "no request key in any label");
    assert_eq!(
        metric(
            &m,
            r#"ratelimit_decisions_total{domain="m",rule="_override",decision="within_limit"}"#
        ),
        200.0 * 64.0
    );
    assert_eq!(
        metric(
            &m,
            r#"ratelimit_decisions_total{domain="m",rule="_other",decision="within_limit"}"#
        ),
        500.0
    );
    assert!(m.len() < 1 << 20, "/metrics is {} bytes", m.len());
}

const DAILY: &str = "domain: r\ndescriptors:\n  - key: k\n    rate_limits:\n      - {unit: day, requests_per_unit: 3}\n";
const SECOND_IN_FRONT: &str = "domain: r\ndescriptors:\n  - key: k\n    rate_limits:\n      - {unit: second, requests_per_unit: 100}\n      - {unit: day, requests_per_unit: 3, name: daily}\n";
const DAILY_OF_FOUR: &str = "domain: r\ndescriptors:\n  - key: k\n    rate_limits:\n      - {unit: day, requests_per_unit: 4}\n      - {unit: second, requests_per_unit: 100}\n";

/// Defect 5: a counter was named by its position in `rate_limits`, so inserting a limit in
/// front of a used-up one gave it a fresh count (and handed its count to the new limit).
async fn counts_survive_reordering_and_new_limits(kind: Kind) {
    let s = start(kind, &[("r.yaml", DAILY)], &[]).await;
    let mut c = s.client().await;
    for _ in 0..3 {
        assert!(is_ok(&call(&mut c, request("r", &[&[("k", "v")]])).await));
    }
    assert!(is_over(&call(&mut c, request("r", &[&[("k", "v")]])).await));

    // A per-second limit in front, and a name on the daily one: still used up.
    s.write("r.yaml", SECOND_IN_FRONT);
    poll(Duration::from_secs(5), || {
        let mut c = c.clone();
        async move {
            let r = call(&mut c, with_hits(request("r", &[&[("k", "v")]]), 0, 0)).await;
            (r.statuses[0].current_limit.as_ref()?.name == "daily").then_some(())
        }
    })
    .await;
    assert!(is_over(&call(&mut c, request("r", &[&[("k", "v")]])).await));

    // Reordered again, the daily limit raised to 4: exactly one more fits.
    s.write("r.yaml", DAILY_OF_FOUR);
    poll(Duration::from_secs(5), || {
        let mut c = c.clone();
        async move {
            let r = call(&mut c, with_hits(request("r", &[&[("k", "v")]]), 0, 0)).await;
            (rpu_of(&r, 0) == Some(4)).then_some(())
        }
    })
    .await;
    assert!(is_ok(&call(&mut c, request("r", &[&[("k", "v")]])).await));
    assert!(is_over(&call(&mut c, request("r", &[&[("k", "v")]])).await));
}

every_backend!(counts_survive_reordering_and_new_limits);

fn limits(rpu: u32) -> String {
    format!(
        "domain: d\ndescriptors:\n  - key: k\n    rate_limit: {{unit: minute, requests_per_unit: {rpu}}}\n"
    )
}

async fn until_rpu(c: &Client, want: u32) {
    poll(Duration::from_secs(5), || {
        let mut c = c.clone();
        async move {
            let r = call(&mut c, with_hits(request("d", &[&[("k", "v")]]), 0, 0)).await;
            (rpu_of(&r, 0) == Some(want)).then_some(())
        }
    })
    .await;
}

/// Defect 6: replacing the config directory (`mv limits old; mkdir limits`) ended hot reload
/// for good; now the watch follows the path.
#[tokio::test]
async fn hot_reload_follows_a_replaced_config_directory() {
    let root = tempfile::tempdir().unwrap();
    let dir = root.path().join("limits");
    std::fs::create_dir(&dir).unwrap();
    std::fs::write(dir.join("l.yaml"), limits(1)).unwrap();
    let s = TestServer::start_at(
        tempfile::tempdir().unwrap(),
        Some(dir.clone()),
        &[],
        Arc::new(SystemClock),
    )
    .await;
    let c = s.client().await;
    until_rpu(&c, 1).await;

    std::fs::rename(&dir, root.path().join("old")).unwrap();
    std::fs::create_dir(&dir).unwrap();
    std::fs::write(dir.join("l.yaml"), limits(2)).unwrap();
    until_rpu(&c, 2).await;
    // The new directory is watched, and the old one no longer matters.
    std::fs::write(dir.join("l.yaml"), limits(3)).unwrap();
    until_rpu(&c, 3).await;
    std::fs::write(root.path().join("old/l.yaml"), limits(9)).unwrap();
    std::fs::write(dir.join("l.yaml"), limits(4)).unwrap();
    until_rpu(&c, 4).await;
}

/// The same when the configured path is a file whose directory is replaced.
#[tokio::test]
async fn hot_reload_follows_a_configured_file_whose_directory_is_replaced() {
    let root = tempfile::tempdir().unwrap();
    let dir = root.path().join("limits");
    std::fs::create_dir(&dir).unwrap();
    std::fs::write(dir.join("l.yaml"), limits(1)).unwrap();
    let s = TestServer::start_at(
        tempfile::tempdir().unwrap(),
        Some(dir.join("l.yaml")),
        &[],
        Arc::new(SystemClock),
    )
    .await;
    let c = s.client().await;
    until_rpu(&c, 1).await;
    std::fs::rename(&dir, root.path().join("old")).unwrap();
    std::fs::create_dir(&dir).unwrap();
    std::fs::write(dir.join("l.yaml"), limits(2)).unwrap();
    until_rpu(&c, 2).await;
    std::fs::write(dir.join("l.yaml"), limits(3)).unwrap();
    until_rpu(&c, 3).await;
}

/// Defect 7: symlinks were followed without remembering directories: a `loop -> .` read every
/// file twice (and failed with "duplicate domain"), a few self-links made start-up take
/// minutes.
#[test]
fn symlink_loops_are_read_once() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("l.yaml"), limits(1)).unwrap();
    std::os::unix::fs::symlink(".", dir.path().join("loop")).unwrap();
    let sub = dir.path().join("sub");
    std::fs::create_dir(&sub).unwrap();
    std::fs::write(sub.join("other.yaml"), "domain: other\ndescriptors: []\n").unwrap();
    for i in 0..7 {
        std::os::unix::fs::symlink(".", sub.join(format!("self{i}"))).unwrap();
    }
    std::os::unix::fs::symlink("l.yaml", dir.path().join("alias.yaml")).unwrap();
    let loaded = ratelimitd::testing::load_paths(&[dir.path().to_owned()]).unwrap();
    assert_eq!(loaded.snapshot.len(), 2);
    assert_eq!(loaded.files.len(), 2, "{:?}", loaded.files);
    // The same directory named twice is read once too.
    let twice = [dir.path().to_owned(), dir.path().join("loop")];
    assert_eq!(
        ratelimitd::testing::load_paths(&twice).unwrap().files.len(),
        2
    );
}

/// Defect 11: gRPC statuses carried the Redis client's error text ("Connection refused (os
/// error 111)"); a permanent error was UNAVAILABLE like a transient one.
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
    let s = redis_server(&[("f.yaml", &limits(2))], &target, &prefix, "2s").await;
    let mut c = s.client().await;
    for _ in 0..2 {
        assert!(is_ok(&call(&mut c, request("d", &[&[("k", "v")]])).await));
    }
    assert!(is_over(&call(&mut c, request("d", &[&[("k", "v")]])).await));
    assert_eq!(
        keys_with_ttl(master, &prefix).len(),
        1,
        "counted on the master"
    );
}

/// Defect 10: Sentinel could not reach a password-protected master (NOAUTH on every call).
/// Master and sentinel here have different passwords.
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

/// Defect 10, the other half: the master Sentinel names was reached without TLS whatever the
/// settings said. Here the master speaks only TLS; the sentinel itself is plain.
#[tokio::test]
async fn sentinel_reaches_a_tls_only_master() {
    let certs_dir = tempfile::tempdir().unwrap();
    let certs = make_certs(certs_dir.path());
    let master = RedisProc::start_tls(&certs);
    let path = |f: &str| certs.join(f).display().to_string();
    let sentinel = RedisProc::start_sentinel(
        master.port,
        &format!(
            "tls-replication yes\ntls-cert-file {}\ntls-key-file {}\ntls-ca-cert-file {}\n\
             tls-auth-clients no\n",
            path("server.crt"),
            path("server.key"),
            path("ca.crt"),
        ),
        &[],
    );
    let ca = path("ca.crt");
    counts_on_the_master(
        &master,
        &sentinel.url(),
        &["--redis-tls", "--redis-tls-ca", &ca],
    )
    .await;
}
