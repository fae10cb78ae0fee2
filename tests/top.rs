//! Who is being limited: `/top`, the admin API's GetTop and `ratelimitd top`, through the
//! binary, on memory and Redis (standalone and Cluster). A Zipf-like load with a long tail of
//! one-off values is listed heaviest first within the sketch's stated error; cost reports weigh
//! by their cost; values come back verbatim (or hashed, or hidden, as asked); domains stay
//! apart; two replicas on one Redis see each other's traffic, each counted once, and a dead
//! one's ages out; 100,000 distinct values stay within the memory bound and do not push a heavy
//! hitter out.

mod common;

use std::collections::HashMap;
use std::process::Stdio;
use std::time::Duration;

use common::daemon::{Daemon, quiet, ratelimitd};
use common::*;
use envoy_types::pb::envoy::service::ratelimit::v3::RateLimitRequest;
use futures_util::future::join_all;
use serde_json::Value;

/// Windows of 1,000 days: none ends within a test, so refusals are exact.
const LIMITS: &str = "domain: top
descriptors:
  - key: api_key
    rate_limit: {unit: day, unit_multiplier: 1000, requests_per_unit: 60}
  - key: tenant
    rate_limit: {unit: day, unit_multiplier: 1000, requests_per_unit: 1000000, name: tenants}
  - key: secret
    rate_limit: {unit: day, unit_multiplier: 1000, requests_per_unit: 1000000, top_values: hash}
  - key: hidden
    rate_limit: {unit: day, unit_multiplier: 1000, requests_per_unit: 1000000, top_values: hide}
  - key: shadow
    shadow_mode: true
    rate_limit: {unit: day, unit_multiplier: 1000, requests_per_unit: 1}
  - key: user
    rate_limit: {unit: day, unit_multiplier: 1000, requests_per_unit: 50}
";

async fn daemon(kind: Kind, extra: &[&str]) -> (Daemon, tempfile::TempDir) {
    let mut flags = kind.flags();
    flags.extend(extra.iter().map(|s| s.to_string()));
    let flags: Vec<&str> = flags.iter().map(String::as_str).collect();
    quiet(LIMITS, &flags).await
}

async fn top(d: &Daemon, query: &str) -> Value {
    let (status, body) = http_get(d.http, &format!("/top{query}")).await;
    assert_eq!(status, 200, "{body}");
    serde_json::from_str(&body).unwrap()
}

/// The limit of `rule` in a `/top` answer.
fn limit<'a>(report: &'a Value, domain: &str, rule: &str) -> Option<&'a Value> {
    report["limits"]
        .as_array()
        .unwrap()
        .iter()
        .find(|l| l["domain"] == domain && l["rule"] == rule)
}

/// The value of a listed descriptor's first entry.
fn first_value(d: &Value) -> Option<&str> {
    d["entries"][0]["value"].as_str()
}

/// Sends `reqs`, `width` at a time, each answered.
async fn send_all(c: &Client, reqs: Vec<RateLimitRequest>, width: usize) {
    let mut reqs = reqs.into_iter().peekable();
    while reqs.peek().is_some() {
        let calls = reqs.by_ref().take(width).map(|req| {
            let mut c = c.clone();
            async move {
                tokio::time::timeout(Duration::from_secs(20), c.should_rate_limit(req))
                    .await
                    .expect("answered in time")
                    .expect("answered")
            }
        });
        join_all(calls).await;
    }
}

/// A fixed shuffle (xorshift), so every run sends the same order.
fn shuffle<T>(v: &mut [T]) {
    let mut x: u64 = 0x9E37_79B9_7F4A_7C15;
    for i in (1..v.len()).rev() {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        v.swap(i, (x % (i as u64 + 1)) as usize);
    }
}

/// 100 keys asking 300/(i+1) times each against a limit of 60, 2,000 one-off keys between
/// them, with 256 counters: listed by refusals then hits, every count within the error each
/// line states (true hits in [hits − error, hits], true refusals in [over, over + error]),
/// each error within N/256, no listed pair out of the order their true counts and errors
/// allow, the heaviest four exactly the four refused most, and each one's `remaining` what
/// its counter has left.
async fn a_zipf_load_lists_the_heaviest_within_the_stated_error(kind: Kind) {
    let (d, _dir) = daemon(kind, &["--top-capacity", "256"]).await;
    let c = d.client().await;
    let mut truth: HashMap<String, u64> = HashMap::new();
    let mut reqs = Vec::new();
    for i in 0..100u64 {
        let v = format!("key-{i}");
        let n = 300 / (i + 1);
        truth.insert(v.clone(), n);
        reqs.extend((0..n).map(|_| request("top", &[&[("api_key", &v)]])));
    }
    for i in 0..2000 {
        let v = format!("tail-{i}");
        truth.insert(v.clone(), 1);
        reqs.push(request("top", &[&[("api_key", &v)]]));
    }
    let total = reqs.len() as u64;
    shuffle(&mut reqs);
    send_all(&c, reqs, 16).await;

    let report = top(&d, "?domain=top&n=10").await;
    let l = limit(&report, "top", "api_key").expect("api_key listed");
    assert_eq!(l["hits"], total, "{l}");
    assert_eq!(l["requests_per_unit"], 60);
    assert_eq!(l["algorithm"], "fixed_window");
    let listed = l["descriptors"].as_array().unwrap();
    assert_eq!(listed.len(), 10, "{l}");
    let over = |n: u64| n.saturating_sub(60);
    let bound = total / 256;
    let mut seen = Vec::new();
    for d in listed {
        let v = first_value(d).unwrap();
        let (hits, refused, error) = (
            d["hits"].as_u64().unwrap(),
            d["over_limit"].as_u64().unwrap(),
            d["error"].as_u64().unwrap(),
        );
        let true_hits = truth[v];
        assert!(error <= bound, "{d} error past N/k = {bound}");
        assert!(
            hits >= true_hits && hits - error <= true_hits,
            "{d}: {true_hits} hits"
        );
        assert!(
            refused <= over(true_hits) && over(true_hits) - refused <= error,
            "{d}: {} refused",
            over(true_hits)
        );
        assert_eq!(
            d["remaining"].as_u64(),
            Some(60u64.saturating_sub(true_hits)),
            "{d}"
        );
        seen.push((v.to_owned(), true_hits, error));
    }
    for (i, a) in seen.iter().enumerate() {
        for b in &seen[i + 1..] {
            let (ta, tb) = ((over(a.1), a.1), (over(b.1), b.1));
            let margin = a.2 + b.2;
            assert!(
                !(tb.0 > ta.0 + margin || (tb.0 == ta.0 && tb.1 > ta.1 + margin)),
                "{b:?} is heavier than {a:?} but listed after it: {l}"
            );
        }
    }
    let first: Vec<&str> = seen.iter().take(4).map(|s| s.0.as_str()).collect();
    assert_eq!(first, ["key-0", "key-1", "key-2", "key-3"], "{l}");
}

every_backend!(a_zipf_load_lists_the_heaviest_within_the_stated_error);

/// The refused are a sliver of the traffic: 20,000 users ask 5 hits each (never refused) and
/// 10 users 100 each against a limit of 50 (50 refused each: 500 of 101,000 hits), in a fixed
/// shuffle. Counted by hits alone, a user refused 50 times is noise (N/64 = 1,578); the sketch
/// of refused hits lists all 10 first, each with 50 refusals within its stated error, ahead of
/// every user never refused, whose refusals are stated as none.
async fn the_refused_are_found_among_the_many(kind: Kind) {
    let (d, _dir) = daemon(kind, &[]).await;
    let c = d.client().await;
    let mut reqs = Vec::new();
    let many: Vec<String> = (0..20_000).map(|i| format!("user-{i}")).collect();
    for ten in many.chunks(10) {
        let descriptors: Vec<[(&str, &str); 1]> =
            ten.iter().map(|u| [("user", u.as_str())]).collect();
        let descriptors: Vec<&[(&str, &str)]> = descriptors.iter().map(|d| &d[..]).collect();
        reqs.push(weighted(request("top", &descriptors), 5));
    }
    let refused: Vec<String> = (0..10).map(|i| format!("refused-{i}")).collect();
    for u in &refused {
        reqs.extend((0..100).map(|_| request("top", &[&[("user", u)]])));
    }
    shuffle(&mut reqs);
    send_all(&c, reqs, 16).await;

    let report = top(&d, "?domain=top&limit=user&n=15").await;
    let l = limit(&report, "top", "user").expect("user listed");
    assert_eq!(l["hits"], 101_000, "{kind:?}: {l}");
    let listed = l["descriptors"].as_array().unwrap();
    assert_eq!(listed.len(), 15, "{kind:?}: {l}");
    let count = |d: &Value, field: &str| d[field].as_u64().unwrap();
    let mut found: Vec<&str> = Vec::new();
    for (i, d) in listed.iter().enumerate() {
        let v = first_value(d).unwrap();
        let (over, over_error) = (count(d, "over_limit"), count(d, "over_limit_error"));
        let (hits, error) = (count(d, "hits"), count(d, "error"));
        let (true_over, true_hits) = if v.starts_with("refused-") {
            (50, 100)
        } else {
            (0, 5)
        };
        assert!(
            over.abs_diff(true_over) <= over_error,
            "{kind:?}: {d}: {true_over} refused"
        );
        assert!(
            hits >= true_hits && hits - error <= true_hits,
            "{kind:?}: {d}: {true_hits} hits"
        );
        if i < 10 {
            assert!(v.starts_with("refused-"), "{kind:?}: {i}: {d}: {l}");
            // Ten refused descriptors in a sketch of 64: each counted exactly.
            assert_eq!((over, over_error), (50, 0), "{kind:?}: {d}");
            found.push(v);
        } else {
            assert!(v.starts_with("user-"), "{kind:?}: {d}: {l}");
            assert_eq!((over, over_error), (0, 0), "{kind:?}: {d}");
        }
    }
    found.sort_unstable();
    let mut want: Vec<&str> = refused.iter().map(String::as_str).collect();
    want.sort_unstable();
    assert_eq!(found, want, "{kind:?}: {l}");
}

#[tokio::test]
async fn the_refused_are_found_among_the_many_on_memory() {
    the_refused_are_found_among_the_many(Kind::Memory).await;
}

#[tokio::test]
async fn the_refused_are_found_among_the_many_on_redis() {
    the_refused_are_found_among_the_many(Kind::Redis).await;
}

/// A cost report of 500 outweighs 100 admissions of 1; values come back exactly as sent,
/// quotes, braces, separators, control characters, non-ASCII and 4 KiB ones included, never as
/// structure; a limit's `top_values: hash` and `hide` are honoured; domains stay apart.
#[tokio::test]
async fn costs_weigh_values_come_back_verbatim_and_domains_stay_apart() {
    let two = LIMITS.replace("domain: top", "domain: other");
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("top.yaml"), LIMITS).unwrap();
    std::fs::write(dir.path().join("other.yaml"), two).unwrap();
    let mut cmd = ratelimitd(dir.path(), &[]);
    cmd.env("RATELIMITD_LOG_LEVEL", "warn");
    let d = Daemon::start_with(cmd, Stdio::null).await;
    let c = d.client().await;

    let mut reqs = vec![with_hits(request("top", &[&[("tenant", "big")]]), 0, 500)];
    reqs.extend((0..100).map(|_| request("top", &[&[("tenant", "small")]])));
    reqs.extend((0..7).map(|_| request("other", &[&[("tenant", "small")]])));
    let long = format!("é{}\u{1F600}", "x".repeat(4090)); // 4 KiB, the most a value may be
    let odd = [
        "\"quoted\"",
        "{\"json\": [1, 2]}",
        "a=b, c=d; e:f|g",
        "line\nbreak\ttab\\back\u{1b}[31m",
        "日本語 ✓",
        long.as_str(),
        "",
    ];
    for v in odd {
        reqs.push(request("top", &[&[("tenant", v)]]));
        reqs.push(request("top", &[&[("secret", v)]]));
        reqs.push(request("top", &[&[("hidden", v)]]));
    }
    send_all(&c, reqs, 8).await;

    let report = top(&d, "?domain=top&n=20").await;
    let tenants = limit(&report, "top", "tenant").unwrap();
    assert_eq!(tenants["name"], "tenants");
    let listed = tenants["descriptors"].as_array().unwrap();
    assert_eq!(first_value(&listed[0]), Some("big"), "{tenants}");
    assert_eq!(listed[0]["hits"], 500);
    assert_eq!(first_value(&listed[1]), Some("small"));
    assert_eq!(listed[1]["hits"], 100, "the other domain's 7 are not here");
    for v in odd {
        let found = listed.iter().find(|d| first_value(d) == Some(v));
        assert!(found.is_some(), "{v:?} not listed verbatim: {tenants}");
        assert_eq!(found.unwrap()["entries"][0]["key"], "tenant");
    }
    let secret = limit(&report, "top", "secret").unwrap();
    assert_eq!(secret["values"], "hash");
    for d in secret["descriptors"].as_array().unwrap() {
        let v = first_value(d).unwrap();
        assert!(v.starts_with("sha256:") && v.len() == 23, "{v}");
    }
    let hashed = |v: &str| {
        secret["descriptors"]
            .as_array()
            .unwrap()
            .iter()
            .any(|d| first_value(d) == Some(v))
    };
    // What an operator checking a suspect gets: `printf %s VALUE | sha256sum`, cut to 16.
    for v in odd {
        assert!(hashed(&sha256sum(v)), "{v:?} hashed otherwise: {secret}");
    }
    let hidden = limit(&report, "top", "hidden").unwrap();
    assert_eq!(hidden["values"], "hide");
    for d in hidden["descriptors"].as_array().unwrap() {
        assert!(d["entries"][0]["value"].is_null(), "{d}");
        assert_eq!(d["entries"][0]["key"], "hidden");
    }

    let other = top(&d, "?domain=other").await;
    assert_eq!(other["limits"].as_array().unwrap().len(), 1, "{other}");
    let l = limit(&other, "other", "tenant").unwrap();
    assert_eq!(l["descriptors"][0]["hits"], 7);
    // ?limit= by name, ?n=, and a bad parameter.
    let named = top(&d, "?limit=tenants&n=1").await;
    assert_eq!(
        named["limits"].as_array().unwrap().len(),
        2,
        "both domains' tenants"
    );
    assert!(
        named["limits"]
            .as_array()
            .unwrap()
            .iter()
            .all(|l| l["descriptors"].as_array().unwrap().len() == 1)
    );
    assert_eq!(http_get(d.http, "/top?n=0").await.0, 400);
    assert_eq!(http_get(d.http, "/top?top=1").await.0, 400);
}

/// `sha256:` and the first 16 hex digits of `sha256sum` of `v`.
fn sha256sum(v: &str) -> String {
    use std::io::Write;
    let mut child = std::process::Command::new("sha256sum")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    child.stdin.take().unwrap().write_all(v.as_bytes()).unwrap();
    let out = child.wait_with_output().unwrap();
    format!("sha256:{}", &String::from_utf8(out.stdout).unwrap()[..16])
}

/// A shadow-mode limit answers OK and counts what it would have refused.
#[tokio::test]
async fn a_shadow_limit_counts_what_it_would_have_refused() {
    let (d, _dir) = daemon(Kind::Memory, &[]).await;
    let mut c = d.client().await;
    for _ in 0..3 {
        assert!(is_ok(
            &call(&mut c, request("top", &[&[("shadow", "s")]])).await
        ));
    }
    let report = top(&d, "?limit=shadow").await;
    let l = limit(&report, "top", "shadow").unwrap();
    assert_eq!(l["descriptors"][0]["hits"], 3, "{l}");
    assert_eq!(l["descriptors"][0]["over_limit"], 2, "{l}");
}

/// `--top-values hash` hashes every limit's values, whatever the limit says (`show` included).
#[tokio::test]
async fn the_server_wide_setting_hashes_every_value() {
    let (d, _dir) = daemon(Kind::Memory, &["--top-values", "hash"]).await;
    let mut c = d.client().await;
    call(&mut c, request("top", &[&[("tenant", "abc")]])).await;
    call(&mut c, request("top", &[&[("hidden", "abc")]])).await;
    let report = top(&d, "").await;
    let tenants = limit(&report, "top", "tenant").unwrap();
    assert_eq!(tenants["values"], "hash");
    // printf abc | sha256sum: ba7816bf8f01cfea...
    assert_eq!(
        first_value(&tenants["descriptors"][0]),
        Some("sha256:ba7816bf8f01cfea")
    );
    let hidden = limit(&report, "top", "hidden").unwrap();
    assert!(
        hidden["descriptors"][0]["entries"][0]["value"].is_null(),
        "hide stays hide"
    );
}

/// Two replicas on one Redis: within 15 s each lists what both saw, each replica's share
/// counted once; once one is gone, its share ages out of the other's view.
#[tokio::test]
async fn two_replicas_on_one_redis_merge_within_15_seconds() {
    let prefix = common::redis::unique_prefix();
    let flags = [
        "--backend",
        "redis",
        "--redis-url",
        &common::redis::shared_standalone().url(),
        "--redis-key-prefix",
        &prefix,
        "--redis-timeout",
        "2s",
    ];
    let (a, _da) = quiet(LIMITS, &flags).await;
    let (b, _db) = quiet(LIMITS, &flags).await;
    let (ca, cb) = (a.client().await, b.client().await);
    let one = |v: &str, n| {
        (0..n)
            .map(|_| request("top", &[&[("tenant", v)]]))
            .collect::<Vec<_>>()
    };
    send_all(&ca, one("a", 30), 8).await;
    send_all(&cb, [one("a", 10), one("b", 20)].concat(), 8).await;
    // Hashed and hidden values are published as digests, never in clear, and still merge.
    for c in [&ca, &cb] {
        let reqs = vec![
            request("top", &[&[("secret", "s3cr3t-value")]]),
            request("top", &[&[("hidden", "h1dden-value")]]),
        ];
        send_all(c, reqs, 2).await;
    }
    let counts = |report: Value| -> Vec<(String, u64)> {
        limit(&report, "top", "tenant")
            .map(|l| {
                l["descriptors"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|d| {
                        (
                            first_value(d).unwrap().to_owned(),
                            d["hits"].as_u64().unwrap(),
                        )
                    })
                    .collect()
            })
            .unwrap_or_default()
    };
    let both = vec![("a".to_owned(), 40), ("b".to_owned(), 20)];
    let secret = sha256sum("s3cr3t-value");
    for d in [&a, &b] {
        let both = both.clone();
        poll(Duration::from_secs(15), || async {
            let report = top(d, "?domain=top").await;
            let merged = |rule: &str| {
                limit(&report, "top", rule)
                    .and_then(|l| l["descriptors"].as_array().cloned())
                    .map(|ds| {
                        ds.iter()
                            .map(|d| (d["entries"][0]["value"].clone(), d["hits"].as_u64()))
                            .collect::<Vec<_>>()
                    })
            };
            let hashed = merged("secret") == Some(vec![(secret.clone().into(), Some(2))]);
            let hidden = merged("hidden") == Some(vec![(Value::Null, Some(2))]);
            (counts(report.clone()) == both && hashed && hidden).then_some(())
        })
        .await;
    }
    // The views, the merges written for each replica, the set of replicas and the turns to
    // merge are keys of their own, under the prefix, all expiring; none holds a hidden value in
    // clear.
    let redis = common::redis::shared_standalone();
    let exchange = redis.cli(&[
        "--scan",
        "--pattern",
        &format!("{prefix}{{ratelimitd-top}}*"),
    ]);
    let exchange: Vec<&str> = exchange.lines().filter(|k| !k.is_empty()).collect();
    let kind = |k: &str| {
        k.rsplit_once("}:")
            .map(|(_, rest)| rest.split(':').next().unwrap().to_owned())
    };
    let count = |what: &str| {
        exchange
            .iter()
            .filter(|k| kind(k).as_deref() == Some(what))
            .count()
    };
    assert_eq!(count("view"), 2, "two views: {exchange:?}");
    assert_eq!(count("replicas"), 1, "the set: {exchange:?}");
    assert!((1..=2).contains(&count("others")), "merges: {exchange:?}");
    assert_eq!(
        count("view") + count("replicas") + count("others") + count("turn"),
        exchange.len(),
        "nothing else: {exchange:?}"
    );
    for k in exchange {
        let ttl: i64 = redis.cli(&["PTTL", k]).parse().unwrap();
        assert!(ttl > 0, "{k} expires: {ttl}");
        if k.contains(":view:") || k.contains(":others:") {
            let view = redis.cli(&["GET", k]);
            assert!(view.contains("tenant"), "{k} is a view: {view}");
            for clear in ["s3cr3t", "h1dden"] {
                assert!(!view.contains(clear), "{k} holds {clear} in clear: {view}");
            }
        }
    }
    drop(b);
    poll(Duration::from_secs(25), || async {
        (counts(top(&a, "?domain=top").await) == [("a".to_owned(), 30)]).then_some(())
    })
    .await;
}

/// Ten limits of 64 values of 200 bytes each, seen alike by every replica.
fn full_view_limits() -> String {
    let mut limits = String::from("domain: wide\ndescriptors:\n");
    for k in 0..10 {
        limits += &format!(
            "  - key: k{k}\n    rate_limit: {{unit: day, unit_multiplier: 1000, requests_per_unit: 1000000}}\n"
        );
    }
    limits
}

/// Bytes Redis sent and CPU seconds it used, from INFO.
fn redis_sent_and_cpu(redis: &common::redis::RedisProc) -> (u64, f64) {
    let info = redis.cli(&["INFO", "all"]);
    let field = |name: &str| {
        info.lines()
            .find_map(|l| l.strip_prefix(name)?.strip_prefix(':'))
            .unwrap_or_else(|| panic!("INFO has {name}"))
            .trim()
            .to_owned()
    };
    let cpu: f64 = ["used_cpu_user", "used_cpu_sys"]
        .iter()
        .map(|f| field(f).parse::<f64>().unwrap())
        .sum();
    (field("total_net_output_bytes").parse().unwrap(), cpu)
}

/// What Redis sends each replica per second for the views' exchange, `replicas` replicas
/// each with a full view (10 limits × 64 values of 200 bytes) publishing every second,
/// measured over whole intervals once every replica lists every other's share; and Redis's CPU
/// per replica per second.
async fn exchange_cost(
    redis: &common::redis::RedisProc,
    daemons: &mut Vec<(Daemon, tempfile::TempDir)>,
    replicas: usize,
) -> (f64, f64) {
    let flags = [
        "--backend",
        "redis",
        "--redis-url",
        &redis.url(),
        "--redis-timeout",
        "2s",
        "--top-publish-interval",
        "1s",
    ];
    let limits = full_view_limits();
    let started = join_all((daemons.len()..replicas).map(|_| quiet(&limits, &flags))).await;
    let value = |i: usize| format!("{i:0>200}");
    // Each new replica sees every value once.
    for (d, _) in &started {
        let c = d.client().await;
        let reqs = (0..64)
            .map(|i| {
                let v = value(i);
                let ds: Vec<[(String, String); 1]> =
                    (0..10).map(|k| [(format!("k{k}"), v.clone())]).collect();
                let ds: Vec<[(&str, &str); 1]> = ds
                    .iter()
                    .map(|[(k, v)]| [(k.as_str(), v.as_str())])
                    .collect();
                let ds: Vec<&[(&str, &str)]> = ds.iter().map(|d| &d[..]).collect();
                request("wide", &ds)
            })
            .collect();
        send_all(&c, reqs, 16).await;
    }
    daemons.extend(started);
    // Every replica lists each value once per replica: every view is in every merge.
    for (d, _) in daemons.iter() {
        poll(Duration::from_secs(30), || async {
            let report = top(d, "?domain=wide&n=64").await;
            let full = (0..10).all(|k| {
                limit(&report, "wide", &format!("k{k}")).is_some_and(|l| {
                    let ds = l["descriptors"].as_array().unwrap();
                    ds.len() == 64 && ds.iter().all(|d| d["hits"] == replicas as u64)
                })
            });
            full.then_some(())
        })
        .await;
    }
    // Over five whole intervals of the wall clock, read at 0.9 of an interval (each interval's
    // publishing, merging and reading are done by half of it).
    let at_point_nine = || async {
        use ratelimitd::testing::{Clock, SystemClock};
        let now = SystemClock.now_us() / 1000;
        let next = (now / 1000) * 1000 + 900;
        let next = if next <= now { next + 1000 } else { next };
        tokio::time::sleep(Duration::from_millis(next - now)).await;
    };
    at_point_nine().await;
    let (sent0, cpu0) = redis_sent_and_cpu(redis);
    for _ in 0..5 {
        at_point_nine().await;
    }
    let (sent1, cpu1) = redis_sent_and_cpu(redis);
    let per_replica = |d: f64| d / 5.0 / replicas as f64;
    (
        per_replica((sent1 - sent0) as f64),
        per_replica(cpu1 - cpu0),
    )
}

/// What Redis sends each replica for the views' exchange does not grow with the replicas:
/// with 6 replicas at most 1.6 times what it sends each of 2 (each replica reading every
/// other's view, it was 5 times). `RATELIMITD_TOP_REPLICAS=4,12` measures other counts
/// (`cargo test --test top exchange -- --nocapture` prints the figures).
#[tokio::test]
async fn redis_sends_each_replica_as_much_however_many_there_are() {
    let counts: Vec<usize> = std::env::var("RATELIMITD_TOP_REPLICAS")
        .unwrap_or_else(|_| "2,6".into())
        .split(',')
        .map(|n| n.trim().parse().unwrap())
        .collect();
    let redis = common::redis::RedisProc::start(&[]);
    let mut daemons = Vec::new();
    let mut costs = Vec::new();
    for &n in &counts {
        let (bytes, cpu) = exchange_cost(&redis, &mut daemons, n).await;
        eprintln!(
            "{n} replicas: Redis sent {:.1} KiB and used {:.0} µs of CPU per replica per second",
            bytes / 1024.0,
            cpu * 1e6
        );
        costs.push(bytes);
    }
    let (few, many) = (costs[0], costs[costs.len() - 1]);
    assert!(
        many <= 1.6 * few,
        "{} replicas: {many:.0} B/s each; {}: {few:.0} B/s each",
        counts[counts.len() - 1],
        counts[0]
    );
}

/// 100,000 distinct 1 KiB values, each under a `limit` override of its own (100,000 distinct
/// limits as the sketches tell them apart), one heavy value among them under the configured
/// limit: the sketches hold no more than `--top-memory-bytes` (their own account, and the
/// process's resident memory grows by no more than that and a fixed allowance), and the heavy
/// value is listed first, counted exactly.
#[tokio::test]
async fn a_hundred_thousand_distinct_values_stay_within_the_bound() {
    use envoy_types::pb::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::RateLimitOverride;
    let bound: u64 = 1 << 20;
    let (d, _dir) = daemon(
        Kind::Redis,
        &[
            "--top-memory-bytes",
            &bound.to_string(),
            "--top-window",
            "10m",
        ],
    )
    .await;
    let c = d.client().await;
    let pad = "v".repeat(1000);
    let batch = |from: usize, key: &str| {
        let values: Vec<String> = (from..from + 63).map(|i| format!("{pad}{i}")).collect();
        let mut entries: Vec<Vec<(&str, &str)>> =
            values.iter().map(|v| vec![(key, v.as_str())]).collect();
        entries.push(vec![(key, "heavy")]);
        let refs: Vec<&[(&str, &str)]> = entries.iter().map(|e| e.as_slice()).collect();
        let mut req = request("top", &refs);
        for (i, d) in req.descriptors.iter_mut().take(63).enumerate() {
            d.limit = Some(RateLimitOverride {
                requests_per_unit: 1_000_000 + (from + i) as u32,
                unit: 4, // day
            });
        }
        req
    };
    // Warm-up with a key no limit has (nothing counted, in Redis or the sketches):
    // connections, buffers and the allocator's pools at their working size.
    send_all(
        &c,
        (0..160).map(|i| batch(i * 63, "unlimited")).collect(),
        8,
    )
    .await;
    let before = d.rss();
    let n = 100_000 / 63 + 1;
    send_all(
        &c,
        (0..n)
            .map(|i| batch(1_000_000 + i * 63, "tenant"))
            .collect(),
        8,
    )
    .await;
    let after = d.rss();
    let report = top(&d, "?domain=top&n=3").await;
    assert!(
        report["memory_bytes"].as_u64().unwrap() <= bound,
        "{report}"
    );
    let l = report["limits"]
        .as_array()
        .unwrap()
        .iter()
        .find(|l| l["rule"] == "tenant" && l["override"] == false)
        .expect("the configured limit kept");
    let heavy = &l["descriptors"][0];
    assert_eq!(first_value(heavy), Some("heavy"), "{l}");
    assert_eq!(heavy["hits"].as_u64(), Some(n as u64), "{heavy}");
    let allowance = 16 << 20;
    eprintln!(
        "resident memory grew {} bytes over {} distinct values; the sketches hold {} bytes",
        after.saturating_sub(before),
        n * 63,
        report["memory_bytes"]
    );
    assert!(
        after.saturating_sub(before) <= bound + allowance,
        "resident memory grew {} bytes over {} distinct values",
        after - before,
        n * 63
    );
}

/// The admin API lists the same for a descriptor prefix; `ratelimitd top --once` prints it as
/// a table, values escaped (a value cannot drive the terminal).
#[tokio::test]
async fn the_admin_api_and_the_terminal_table_list_it_too() {
    use ratelimitd::admin::admin_client::AdminClient;
    use ratelimitd::admin::{Entry, TopRequest};

    let (d, _dir) = daemon(Kind::Memory, &["--admin"]).await;
    let mut c = d.client().await;
    for (v, n) in [("acme", 5), ("zeta\u{1b}[2J", 3)] {
        for _ in 0..n {
            call(&mut c, request("top", &[&[("tenant", v)]])).await;
        }
    }
    let mut admin = AdminClient::connect(format!("http://127.0.0.1:{}", d.grpc))
        .await
        .unwrap();
    let all = admin
        .get_top(TopRequest {
            domain: "top".into(),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(all.limits.len(), 1);
    assert_eq!(all.limits[0].descriptors.len(), 2);
    assert_eq!(all.limits[0].descriptors[0].hits, 5);
    let zeta = admin
        .get_top(TopRequest {
            domain: "top".into(),
            entries: vec![Entry {
                key: "tenant".into(),
                value: "zeta\u{1b}[2J".into(),
                escaped: false,
            }],
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    let listed = &zeta.limits[0].descriptors;
    assert_eq!(listed.len(), 1);
    assert_eq!(listed[0].hits, 3);
    assert_eq!(listed[0].entries[0].value.as_deref(), Some("zeta\u{1b}[2J"));

    let out = std::process::Command::new(common::daemon::BIN)
        .args([
            "top",
            "--once",
            "--addr",
            &d.http.to_string(),
            "--domain",
            "top",
        ])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let table = String::from_utf8(out.stdout).unwrap();
    assert!(table.contains("tenant=acme"), "{table}");
    assert!(table.contains("tenant=zeta\\u{1b}[2J"), "{table}");
    assert!(!table.contains('\u{1b}'), "{table}");
    let rows: Vec<&str> = table.lines().filter(|l| l.contains("tenant=")).collect();
    assert!(
        rows[0].contains("acme") && rows[0].split_whitespace().nth(1) == Some("5"),
        "{table}"
    );
}

/// `ratelimit_top_*` on /metrics: absent unless `--top-metrics N`; then N series per limit,
/// the heaviest, values escaped as OpenMetrics label values and shown as the limit says.
#[tokio::test]
async fn the_metrics_family_is_off_by_default_and_bounded_per_limit() {
    for (flags, per_limit) in [(vec![], 0), (vec!["--top-metrics", "1"], 1)] {
        let (d, _dir) = daemon(Kind::Memory, &flags).await;
        let mut c = d.client().await;
        for (key, v, n) in [
            ("tenant", "a\"b\\c", 3),
            ("tenant", "light", 1),
            ("secret", "abc", 2),
        ] {
            for _ in 0..n {
                call(&mut c, request("top", &[&[(key, v)]])).await;
            }
        }
        let (_, text) = http_get(d.http, "/metrics").await;
        let series: Vec<&str> = text
            .lines()
            .filter(|l| l.starts_with("ratelimit_top_hits{"))
            .collect();
        assert_eq!(series.len(), 2 * per_limit, "{series:?}");
        if per_limit == 1 {
            assert!(
                series.contains(
                    &"ratelimit_top_hits{domain=\"top\",rule=\"tenant\",limit=\"tenants\",descriptor=\"tenant=a\\\"b\\\\c\"} 3"
                ),
                "{series:?}"
            );
            assert!(
                series
                    .iter()
                    .any(|s| s.contains("descriptor=\"secret=sha256:ba7816bf8f01cfea\"")),
                "{series:?}"
            );
            assert!(
                text.trim_end().ends_with("# EOF"),
                "still ends as OpenMetrics does"
            );
        }
    }
}
