//! The behavioural suite: a real server, a real gRPC client, every rule of the protocol and
//! config, and the metrics it reports. Time-exact checks use a manual clock; wall-clock checks poll with deadlines.

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::*;
use envoy_types::pb::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::RateLimitOverride;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::Code;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::rate_limit::Unit;
use envoy_types::pb::google::protobuf::UInt64Value;
use ratelimitd::testing::{Algorithm, ManualClock};

const LIMITS: &str = r#"
domain: test
descriptors:
  - key: three_per_minute
    rate_limit: {unit: hour, requests_per_unit: 3, name: three}
  - key: roomy
    rate_limit: {unit: hour, requests_per_unit: 100}
  - key: blocked
    rate_limit: {unit: second, requests_per_unit: 0}
  - key: free
    rate_limit: {unlimited: true}
  - key: shadow
    shadow_mode: true
    rate_limit: {unit: hour, requests_per_unit: 1}
  - key: layered
    rate_limits:
      - {name: burst, unit: hour, requests_per_unit: 2}
      - {name: daily, unit: day, requests_per_unit: 5}
  - key: quota
    value: a
    quota_mode: true
    rate_limit: {unit: hour, requests_per_unit: 1}
  - key: quota
    value: b
    quota_mode: true
    rate_limit: {unit: hour, requests_per_unit: 2}
  - key: tenant
    value: t-*
    share_threshold: true
    rate_limit: {unit: hour, requests_per_unit: 2}
  - key: detailed
    detailed_metric: true
    rate_limit: {unit: hour, requests_per_unit: 10}
  - key: near
    rate_limit: {unit: hour, requests_per_unit: 10}
"#;

async fn server(kind: Kind) -> TestServer {
    start(kind, &[("limits.yaml", LIMITS)], &[]).await
}

async fn fixed_window_admits_up_to_the_limit_and_reports_it(kind: Kind) {
    let s = server(kind).await;
    let mut c = s.client().await;
    for left in [2, 1, 0] {
        let r = call(&mut c, request("test", &[&[("three_per_minute", "x")]])).await;
        assert!(is_ok(&r));
        let st = &r.statuses[0];
        assert_eq!(st.code, Code::Ok as i32);
        assert_eq!(st.limit_remaining, left);
        let limit = st.current_limit.as_ref().unwrap();
        assert_eq!((limit.name.as_str(), limit.requests_per_unit), ("three", 3));
        assert_eq!(limit.unit, Unit::Hour as i32);
        assert!(reset_of(&r, 0) <= Duration::from_secs(3600));
        assert!(reset_of(&r, 0) > Duration::ZERO);
    }
    let r = call(&mut c, request("test", &[&[("three_per_minute", "x")]])).await;
    assert!(is_over(&r));
    assert_eq!(r.statuses[0].code, Code::OverLimit as i32);
    assert_eq!(r.statuses[0].limit_remaining, 0);
    // Another value of a value-less key has its own counter.
    let r = call(&mut c, request("test", &[&[("three_per_minute", "y")]])).await;
    assert!(is_ok(&r));
}

async fn unknown_domains_and_unmatched_descriptors_are_not_limited(kind: Kind) {
    let s = server(kind).await;
    let mut c = s.client().await;
    let r = call(
        &mut c,
        request("nope", &[&[("three_per_minute", "x")], &[("a", "b")]]),
    )
    .await;
    assert!(is_ok(&r));
    assert_eq!(r.statuses.len(), 2);
    assert!(
        r.statuses
            .iter()
            .all(|s| s.current_limit.is_none() && s.code == Code::Ok as i32)
    );
    let r = call(
        &mut c,
        request(
            "test",
            &[
                &[("unknown", "x")],
                &[("three_per_minute", "x"), ("deeper", "y")],
            ],
        ),
    )
    .await;
    assert!(is_ok(&r));
    assert!(r.statuses.iter().all(|s| s.current_limit.is_none()));
}

async fn malformed_requests_are_invalid_argument_with_a_message(kind: Kind) {
    let s = server(kind).await;
    let mut c = s.client().await;
    let mut cases = vec![
        (request("", &[&[("a", "b")]]), "domain"),
        (request("test", &[]), "descriptors"),
        (request("test", &[&[("", "b")]]), "key must not be empty"),
    ];
    let many: Vec<&[(&str, &str)]> = vec![&[("a", "b")]; 65];
    cases.push((request("test", &many), "maximum of 64"));
    let deep: Vec<(&str, &str)> = vec![("a", "b"); 33];
    cases.push((request("test", &[&deep]), "maximum of 32"));
    // A value of any length is a client's, and decided (tests/values.rs); a key is Envoy's
    // configuration's.
    let long_key = "k".repeat(4097);
    cases.push((
        request("test", &[&[(long_key.as_str(), "v")]]),
        "key is 4097 bytes",
    ));
    for (req, needle) in cases {
        let err = c.should_rate_limit(req).await.expect_err(needle);
        assert_eq!(err.code(), tonic::Code::InvalidArgument, "{needle}");
        assert!(
            err.message().contains(needle),
            "{} lacks {needle}",
            err.message()
        );
    }
    // The server is still fine.
    assert!(is_ok(
        &call(&mut c, request("test", &[&[("roomy", "x")]])).await
    ));
    let (_, metrics) = s.http_get("/metrics").await;
    assert_eq!(
        metric(
            &metrics,
            r#"ratelimit_grpc_errors_total{code="invalid_argument"}"#
        ),
        6.0
    );
}

/// What Envoy forwards because of what a client sent or left out is decided, never refused
/// (a refused call is a request let through): a descriptor with no entries (a rate limit whose
/// `skip_if_absent` header is absent; on the wire `\x12\x00`) matches nothing, the others of
/// the request decided as usual; a `limit` override with the unit `UNKNOWN` (Envoy's parse of
/// a metadata value "UNKNOWN") is left out and the configured limit decides.
async fn what_a_client_makes_envoy_send_is_decided(kind: Kind) {
    let s = server(kind).await;
    let mut c = s.client().await;
    for left in [2, 1, 0] {
        let r = call(
            &mut c,
            request(
                "test",
                &[&[("roomy", "e")], &[], &[("three_per_minute", "e")]],
            ),
        )
        .await;
        assert!(is_ok(&r), "{r:?}");
        assert_eq!(r.statuses.len(), 3);
        assert!(r.statuses[1].current_limit.is_none(), "{r:?}");
        assert_eq!(r.statuses[1].code, Code::Ok as i32);
        assert_eq!(r.statuses[2].limit_remaining, left);
    }
    let r = call(
        &mut c,
        request("test", &[&[], &[("three_per_minute", "e")]]),
    )
    .await;
    assert!(is_over(&r), "the other descriptors still decide: {r:?}");
    assert_eq!(r.statuses[0].code, Code::Ok as i32);
    // Only empty descriptors: nothing to limit.
    assert!(is_ok(&call(&mut c, request("test", &[&[], &[]])).await));
    // An empty descriptor with a hits_addend, a refund or a limit of its own: still nothing.
    let mut req = request("test", &[&[]]);
    req.descriptors[0].hits_addend = Some(UInt64Value { value: 7 });
    req.descriptors[0].is_negative_hits = true;
    req.descriptors[0].limit = Some(RateLimitOverride {
        requests_per_unit: 0,
        unit: Unit::Second as i32,
    });
    let r = call(&mut c, req).await;
    assert!(is_ok(&r) && r.statuses[0].current_limit.is_none(), "{r:?}");

    let mut unknown = request("test", &[&[("three_per_minute", "u")]]);
    unknown.descriptors[0].limit = Some(RateLimitOverride {
        requests_per_unit: 0,
        unit: 0,
    });
    for left in [2, 1, 0] {
        let r = call(&mut c, unknown.clone()).await;
        assert!(is_ok(&r), "{r:?}");
        assert_eq!(r.statuses[0].limit_remaining, left);
        assert_eq!(
            r.statuses[0]
                .current_limit
                .as_ref()
                .unwrap()
                .requests_per_unit,
            3
        );
    }
    assert!(is_over(&call(&mut c, unknown).await));
    let (_, metrics) = s.http_get("/metrics").await;
    assert_eq!(
        metric(
            &metrics,
            r#"ratelimit_grpc_errors_total{code="invalid_argument"}"#
        ),
        0.0
    );
}

async fn hits_addend_per_request_and_per_descriptor(kind: Kind) {
    let s = server(kind).await;
    let mut c = s.client().await;
    // Request hits_addend 0 means 1.
    let r = call(&mut c, request("test", &[&[("roomy", "h")]])).await;
    assert_eq!(r.statuses[0].limit_remaining, 99);
    let mut req = request("test", &[&[("roomy", "h")]]);
    req.hits_addend = 10;
    assert_eq!(call(&mut c, req).await.statuses[0].limit_remaining, 89);
    // A descriptor's own hits_addend wins, and 0 only checks.
    let mut req = request("test", &[&[("roomy", "h")], &[("roomy", "h2")]]);
    req.hits_addend = 10;
    req.descriptors[0].hits_addend = Some(UInt64Value { value: 0 });
    req.descriptors[1].hits_addend = Some(UInt64Value { value: 5 });
    let r = call(&mut c, req).await;
    assert_eq!(r.statuses[0].limit_remaining, 89);
    assert_eq!(r.statuses[1].limit_remaining, 95);
    let mut req = request("test", &[&[("roomy", "h")]]);
    req.descriptors[0].hits_addend = Some(UInt64Value { value: 0 });
    assert_eq!(call(&mut c, req).await.statuses[0].limit_remaining, 89);
    // More than fits at once is over, and consumes nothing.
    let mut req = request("test", &[&[("roomy", "h")]]);
    req.hits_addend = 90;
    assert!(is_over(&call(&mut c, req).await));
    let mut req = request("test", &[&[("roomy", "h")]]);
    req.hits_addend = 89;
    let r = call(&mut c, req).await;
    assert!(is_ok(&r));
    assert_eq!(r.statuses[0].limit_remaining, 0);
}

async fn a_descriptor_limit_override_replaces_the_configured_limit(kind: Kind) {
    let s = server(kind).await;
    let mut c = s.client().await;
    let with_override = |key: &str| {
        let mut req = request("test", &[&[(key, "o")]]);
        req.descriptors[0].limit = Some(RateLimitOverride {
            requests_per_unit: 2,
            unit: 3, /* HOUR */
        });
        req
    };
    for key in ["roomy", "not_configured"] {
        let r = call(&mut c, with_override(key)).await;
        let limit = r.statuses[0].current_limit.as_ref().unwrap();
        assert_eq!(
            (limit.requests_per_unit, limit.unit),
            (2, Unit::Hour as i32),
            "{key}"
        );
        assert!(is_ok(&call(&mut c, with_override(key)).await), "{key}");
        assert!(is_over(&call(&mut c, with_override(key)).await), "{key}");
    }
    // The configured limit's own counter was not touched.
    let r = call(&mut c, request("test", &[&[("roomy", "o")]])).await;
    assert_eq!(r.statuses[0].limit_remaining, 99);
}

async fn a_rejected_request_consumes_nothing_anywhere(kind: Kind) {
    let s = server(kind).await;
    let mut c = s.client().await;
    let both: &[&[(&str, &str)]] = &[&[("roomy", "aon")], &[("three_per_minute", "aon")]];
    for _ in 0..3 {
        assert!(is_ok(&call(&mut c, request("test", both)).await));
    }
    for _ in 0..5 {
        let r = call(&mut c, request("test", both)).await;
        assert!(is_over(&r));
        assert_eq!(
            r.statuses[0].code,
            Code::Ok as i32,
            "the roomy limit had room"
        );
        assert_eq!(r.statuses[0].limit_remaining, 97, "and still has it");
        assert_eq!(r.statuses[1].code, Code::OverLimit as i32);
    }
    let r = call(&mut c, request("test", &[&[("roomy", "aon")]])).await;
    assert_eq!(
        r.statuses[0].limit_remaining, 96,
        "five rejected requests took nothing"
    );
}

/// The same counter twice in one request is checked once with both hits: separately, each
/// would fit and both would be committed.
async fn one_counter_twice_in_a_request_counts_both_hits(kind: Kind) {
    let s = server(kind).await;
    let mut c = s.client().await;
    let twice: &[&[(&str, &str)]] = &[
        &[("three_per_minute", "dup")],
        &[("three_per_minute", "dup")],
    ];
    let r = call(&mut c, request("test", twice)).await;
    assert!(is_ok(&r));
    assert_eq!(
        (r.statuses[0].limit_remaining, r.statuses[1].limit_remaining),
        (1, 1)
    );
    let r = call(&mut c, request("test", twice)).await;
    assert!(is_over(&r), "2 more hits do not fit in the 1 left");
    assert!(r.statuses.iter().all(|s| s.code == Code::OverLimit as i32));
    let r = call(&mut c, request("test", &[&[("three_per_minute", "dup")]])).await;
    assert!(is_ok(&r));
    assert_eq!(r.statuses[0].limit_remaining, 0);
}

async fn zero_blocks_unlimited_never_limits(kind: Kind) {
    let s = server(kind).await;
    let mut c = s.client().await;
    let r = call(&mut c, request("test", &[&[("blocked", "x")]])).await;
    assert!(is_over(&r));
    for _ in 0..50 {
        let r = call(&mut c, request("test", &[&[("free", "x")]])).await;
        assert!(is_ok(&r));
        assert!(r.statuses[0].current_limit.is_none());
    }
}

async fn shadow_mode_counts_and_reports_but_never_rejects(kind: Kind) {
    let s = server(kind).await;
    let mut c = s.client().await;
    for _ in 0..3 {
        let r = call(&mut c, request("test", &[&[("shadow", "x")]])).await;
        assert!(is_ok(&r));
        assert_eq!(r.statuses[0].code, Code::Ok as i32);
    }
    let (_, m) = s.http_get("/metrics").await;
    assert_eq!(
        metric(
            &m,
            r#"ratelimit_decisions_total{domain="test",rule="shadow",decision="shadow_mode"}"#
        ),
        2.0
    );
    // A shadow limit being over does not stop other limits from counting.
    let r = call(
        &mut c,
        request("test", &[&[("shadow", "x")], &[("roomy", "s")]]),
    )
    .await;
    assert!(is_ok(&r));
    assert_eq!(r.statuses[1].limit_remaining, 99);
}

async fn global_shadow_mode_answers_ok_overall(kind: Kind) {
    let s = start(kind, &[("limits.yaml", LIMITS)], &["--shadow-mode"]).await;
    let mut c = s.client().await;
    let r = call(&mut c, request("test", &[&[("blocked", "x")]])).await;
    assert!(is_ok(&r));
    assert_eq!(
        r.statuses[0].code,
        Code::OverLimit as i32,
        "statuses still tell the truth"
    );
}

async fn several_limits_report_the_most_restrictive(kind: Kind) {
    let s = server(kind).await;
    let mut c = s.client().await;
    let r = call(&mut c, request("test", &[&[("layered", "k")]])).await;
    let limit = r.statuses[0].current_limit.as_ref().unwrap();
    assert_eq!(
        (limit.name.as_str(), r.statuses[0].limit_remaining),
        ("burst", 1)
    );
    let r = call(&mut c, request("test", &[&[("layered", "k")]])).await;
    assert_eq!(r.statuses[0].limit_remaining, 0);
    let r = call(&mut c, request("test", &[&[("layered", "k")]])).await;
    assert!(is_over(&r));
    assert_eq!(r.statuses[0].current_limit.as_ref().unwrap().name, "burst");
    // Two hits at once: the burst limit (0 left) is tighter than the daily one (3 left).
    let mut req = request("test", &[&[("layered", "j")]]);
    req.hits_addend = 2;
    let r = call(&mut c, req).await;
    assert_eq!(r.statuses[0].current_limit.as_ref().unwrap().name, "burst");
    assert_eq!(r.statuses[0].limit_remaining, 0);
}

async fn quota_mode_rejects_only_when_every_quota_descriptor_is_over(kind: Kind) {
    let s = server(kind).await;
    let mut c = s.client().await;
    let both: &[&[(&str, &str)]] = &[&[("quota", "a")], &[("quota", "b")]];
    assert!(is_ok(&call(&mut c, request("test", both)).await)); // a 0 left, b 1 left
    let r = call(&mut c, request("test", both)).await; // a over, b fits
    assert!(is_ok(&r));
    assert_eq!(r.statuses[0].code, Code::Ok as i32);
    assert_eq!(r.statuses[1].limit_remaining, 0);
    let r = call(&mut c, request("test", both)).await; // both over
    assert!(is_over(&r));
    assert!(r.statuses.iter().all(|s| s.code == Code::OverLimit as i32));
}

/// `--quota-mode` (envoyproxy/ratelimit's `QUOTA_MODE`): every limit is soft. A request is
/// refused only when all its descriptors are over; `unlimited` ones do not count, and one that
/// matches no limit or is in shadow mode passes, as that service counts them. Without the flag,
/// a `quota_mode` descriptor in shadow mode passes the same way.
async fn global_quota_mode_refuses_only_when_every_descriptor_is_over(kind: Kind) {
    let yaml = "domain: q
descriptors:
  - key: a
    rate_limit: {unit: hour, requests_per_unit: 1}
  - key: b
    rate_limit: {unit: hour, requests_per_unit: 1}
  - key: free
    rate_limit: {unlimited: true}
  - key: watched
    shadow_mode: true
    rate_limit: {unit: hour, requests_per_unit: 1}
  - key: soft
    quota_mode: true
    rate_limit: {unit: hour, requests_per_unit: 1}
  - key: soft_watched
    quota_mode: true
    shadow_mode: true
    rate_limit: {unit: hour, requests_per_unit: 1}
";
    let s = start(kind, &[("q.yaml", yaml)], &["--quota-mode"]).await;
    let mut c = s.client().await;
    let ask = |d: &[&[(&str, &str)]]| request("q", d);
    assert!(is_ok(&call(&mut c, ask(&[&[("a", "1")]])).await));
    assert!(
        is_over(&call(&mut c, ask(&[&[("a", "1")]])).await),
        "its one descriptor is over"
    );
    let r = call(&mut c, ask(&[&[("a", "1")], &[("b", "1")]])).await;
    assert!(is_ok(&r), "b is within");
    // As with quota_mode on a descriptor: an over soft limit of an admitted request reports
    // OK, with nothing left.
    assert_eq!(
        (r.statuses[0].code, r.statuses[0].limit_remaining),
        (Code::Ok as i32, 0)
    );
    let r = call(&mut c, ask(&[&[("a", "1")], &[("b", "1")]])).await;
    assert!(is_over(&r), "both over");
    let r = call(&mut c, ask(&[&[("a", "1")], &[("free", "1")]])).await;
    assert!(is_over(&r), "an unlimited descriptor does not count");
    let r = call(
        &mut c,
        ask(&[&[("a", "1")], &[("b", "1")], &[("none", "1")]]),
    )
    .await;
    assert!(is_ok(&r), "a descriptor no limit matches passes");
    assert_eq!(r.statuses[0].limit_remaining, 0);
    let r = call(&mut c, ask(&[&[("a", "1")], &[("watched", "1")]])).await;
    assert!(is_ok(&r), "a shadow-mode descriptor passes");
    // Without the flag the same config enforces: a is refused on its own.
    let s = start(kind, &[("q.yaml", yaml)], &[]).await;
    let mut c = s.client().await;
    assert!(is_ok(
        &call(&mut c, ask(&[&[("a", "2")], &[("none", "1")]])).await
    ));
    assert!(is_over(
        &call(&mut c, ask(&[&[("a", "2")], &[("none", "1")]])).await
    ));
    // Without the flag, a quota_mode descriptor in shadow mode is, as the reference counts
    // it, a soft descriptor that passes: the other soft one alone being over refuses nothing.
    let both: &[&[(&str, &str)]] = &[&[("soft", "1")], &[("soft_watched", "1")]];
    assert!(is_ok(&call(&mut c, ask(both)).await));
    assert!(is_ok(&call(&mut c, ask(both)).await), "soft_watched passes");
    assert!(is_over(&call(&mut c, ask(&[&[("soft", "1")]])).await));
}

async fn share_threshold_wildcards_share_one_counter(kind: Kind) {
    let s = server(kind).await;
    let mut c = s.client().await;
    assert!(is_ok(
        &call(&mut c, request("test", &[&[("tenant", "t-1")]])).await
    ));
    assert!(is_ok(
        &call(&mut c, request("test", &[&[("tenant", "t-2")]])).await
    ));
    assert!(is_over(
        &call(&mut c, request("test", &[&[("tenant", "t-3")]])).await
    ));
    let (_, m) = s.http_get("/metrics").await;
    assert_eq!(
        metric(
            &m,
            r#"ratelimit_decisions_total{domain="test",rule="tenant_t-*",decision="over_limit"}"#
        ),
        1.0
    );
}

async fn metrics_keep_request_values_out_unless_asked(kind: Kind) {
    let s = server(kind).await;
    let mut c = s.client().await;
    for _ in 0..9 {
        call(&mut c, request("test", &[&[("near", "v0")]])).await;
    }
    for v in ["a", "b"] {
        call(&mut c, request("test", &[&[("detailed", v)]])).await;
    }
    let (status, m) = s.http_get("/metrics").await;
    assert_eq!(status, 200);
    // 10 per hour, ratio 0.8: the 9th hit is past 8.
    assert_eq!(
        metric(
            &m,
            r#"ratelimit_decisions_total{domain="test",rule="near",decision="within_limit"}"#
        ),
        8.0
    );
    assert_eq!(
        metric(
            &m,
            r#"ratelimit_decisions_total{domain="test",rule="near",decision="near_limit"}"#
        ),
        1.0
    );
    assert!(
        !m.contains("v0"),
        "a value-less key never puts request values in labels"
    );
    assert_eq!(
        metric(
            &m,
            r#"ratelimit_decisions_total{domain="test",rule="detailed_a",decision="within_limit"}"#
        ),
        1.0
    );
    assert!(metric(&m, "ratelimit_request_duration_seconds_count") >= 11.0);
    assert_eq!(
        metric(&m, r#"ratelimit_config_loads_total{result="success"}"#),
        1.0
    );
}

/// Each configured limit has its denominator and its hits on `/metrics`, labelled by the
/// config (never a request value), and a refusal names the rule that refused: in the
/// over-limit counters and in `/json`'s answer.
async fn per_rule_metrics_give_each_limit_its_limit_and_name_the_refusing_rule(kind: Kind) {
    let s = server(kind).await;
    let mut c = s.client().await;
    let mut refused = 0;
    for _ in 0..5 {
        let r = call(&mut c, request("test", &[&[("layered", "x")]])).await;
        refused += usize::from(!is_ok(&r));
    }
    assert_eq!(refused, 3, "burst: 2 an hour");
    for v in ["a", "b"] {
        call(&mut c, request("test", &[&[("detailed", v)]])).await;
    }
    let (_, m) = s.http_get("/metrics").await;
    let series = |family: &str, rule: &str, limit: &str| {
        metric(
            &m,
            &format!(
                "ratelimit_rule_{family}{{domain=\"test\",rule=\"{rule}\",limit=\"{limit}\"}}"
            ),
        )
    };
    for (limit, hits, over, rpu, window) in [
        ("burst", 5.0, 3.0, 2.0, 3600.0),
        ("daily", 5.0, 0.0, 5.0, 86400.0),
    ] {
        assert_eq!(series("hits_total", "layered", limit), hits, "{limit}\n{m}");
        assert_eq!(
            series("over_limit_hits_total", "layered", limit),
            over,
            "{limit}"
        );
        assert_eq!(series("limit", "layered", limit), rpu, "{limit}");
        assert_eq!(
            series("window_seconds", "layered", limit),
            window,
            "{limit}"
        );
    }
    assert!(
        m.contains(
            r#"ratelimit_rule_over_limit_hits_total{domain="test",rule="layered",limit="daily"} 0"#
        ),
        "a limit never exceeded shows 0: {m}"
    );
    assert_eq!(
        metric(
            &m,
            r#"ratelimit_decisions_total{domain="test",rule="layered",decision="over_limit"}"#
        ),
        3.0
    );
    // detailed_metric puts values in ratelimit_decisions_total's label, never in these.
    assert_eq!(series("hits_total", "detailed", "0"), 2.0, "{m}");
    assert_eq!(series("limit", "detailed", "0"), 10.0);
    assert!(
        !m.lines()
            .any(|l| l.starts_with("ratelimit_rule_") && l.contains("detailed_")),
        "{m}"
    );
    // /json names the refusing rule on each refused status, and on no other.
    let body = r#"{"domain":"test","descriptors":[{"entries":[{"key":"three_per_minute","value":"j"}]},{"entries":[{"key":"roomy","value":"j"}]}]}"#;
    for _ in 0..3 {
        let (status, json) = post_json(s.http, body).await;
        assert_eq!(status, 200, "{json}");
        assert!(!json.contains("\"rule\""), "{json}");
    }
    let (status, json) = post_json(s.http, body).await;
    assert_eq!(status, 429, "{json}");
    let v: serde_json::Value = serde_json::from_str(&json).unwrap();
    assert_eq!(v["statuses"][0]["rule"], "three_per_minute", "{json}");
    assert_eq!(v["statuses"][0]["currentLimit"]["name"], "three", "{json}");
    assert!(v["statuses"][1].get("rule").is_none(), "{json}");
}

async fn health_over_grpc_and_http(kind: Kind) {
    use tonic_health::pb::health_check_response::ServingStatus;
    use tonic_health::pb::{HealthCheckRequest, health_client::HealthClient};
    let mut s = server(kind).await;
    s.client().await; // wait until up
    let channel = tonic::transport::Channel::from_shared(format!("http://{}", s.grpc))
        .unwrap()
        .connect()
        .await
        .unwrap();
    let mut health = HealthClient::new(channel);
    for service in ratelimitd::HEALTH_SERVICES {
        let r = health
            .check(HealthCheckRequest {
                service: service.into(),
            })
            .await
            .unwrap()
            .into_inner();
        assert_eq!(r.status, ServingStatus::Serving as i32, "{service:?}");
    }
    assert_eq!(s.http_get("/healthcheck").await, (200, "OK".to_string()));
    let (status, dump) = s.http_get("/rlconfig").await;
    assert_eq!(status, 200);
    assert!(dump.contains("test.three_per_minute: unit=HOUR requests_per_unit=3, algorithm=fixed_window, name=three, shadow_mode: false"), "{dump}");
    assert!(
        dump.contains(
            "test.shadow: unit=HOUR requests_per_unit=1, algorithm=fixed_window, shadow_mode: true"
        ),
        "{dump}"
    );
    s.shutdown().await.unwrap();
    assert!(
        tokio::net::TcpStream::connect(s.grpc).await.is_err(),
        "stopped accepting"
    );
}

async fn concurrent_requests_admit_exactly_the_limit_for_every_algorithm(kind: Kind) {
    let yaml = Algorithm::ALL
        .iter()
        .map(|a| format!("  - key: {a}\n    rate_limit: {{unit: hour, requests_per_unit: 50, algorithm: {a}}}\n"))
        .collect::<String>();
    let s = start(
        kind,
        &[("c.yaml", &format!("domain: c\ndescriptors:\n{yaml}"))],
        &[],
    )
    .await;
    let client = s.client().await;
    for algorithm in Algorithm::ALL {
        let key = algorithm.as_str();
        let calls = (0..150).map(|_| {
            let mut c = client.clone();
            tokio::spawn(async move { is_ok(&call(&mut c, request("c", &[&[(key, "x")]])).await) })
        });
        let mut admitted = 0;
        for call in calls.collect::<Vec<_>>() {
            admitted += call.await.unwrap() as usize;
        }
        assert_eq!(admitted, 50, "{algorithm}");
    }
}

/// Each algorithm's exact timing, through gRPC, with the memory backend on a manual clock.
#[tokio::test]
async fn algorithms_keep_time_exactly_on_a_manual_clock() {
    const T0: u64 = 1_800_000_000_000_000; // aligned to every window below
    let clock = ManualClock::new(T0);
    let yaml = [
        "domain: t",
        "descriptors:",
        "  - key: fixed",
        "    rate_limit: {unit: second, unit_multiplier: 10, requests_per_unit: 2}",
        "  - key: sliding",
        "    rate_limit: {unit: second, unit_multiplier: 10, requests_per_unit: 10, algorithm: sliding_window}",
        "  - key: log",
        "    rate_limit: {unit: second, unit_multiplier: 10, requests_per_unit: 2, algorithm: sliding_log}",
        "  - key: bucket",
        "    rate_limit: {unit: second, requests_per_unit: 4, algorithm: token_bucket, burst: 2}",
    ]
    .join("\n");
    let yaml = yaml.as_str();
    let s = TestServer::start_with(&[("t.yaml", yaml)], &[], Arc::new(clock.clone())).await;
    let mut c = s.client().await;
    let mut hit = async |key: &str, hits: u32| {
        let mut req = request("t", &[&[(key, "k")]]);
        req.hits_addend = hits;
        call(&mut c, req).await
    };

    // fixed_window: 2 per 10 s window, reset at the window end.
    clock.set(T0 + 3_000_000);
    assert!(is_ok(&hit("fixed", 2).await));
    let r = hit("fixed", 1).await;
    assert!(is_over(&r));
    assert_eq!(reset_of(&r, 0), Duration::from_secs(7));
    clock.set(T0 + 10_000_000);
    assert!(is_ok(&hit("fixed", 2).await), "new window");

    // sliding_window: 10 at 15 s; 10 s later (25 s) half of them still count. (Time only
    // moves forward here: the memory backend never lets it run backwards.)
    clock.set(T0 + 15_000_000);
    assert!(is_ok(&hit("sliding", 10).await));
    clock.set(T0 + 25_000_000);
    assert!(is_ok(&hit("sliding", 5).await));
    let r = hit("sliding", 1).await;
    assert!(is_over(&r));
    // prev·(10−e)/10 ≤ 4 ⇒ e ≥ 6 s: 1 s from now.
    assert_eq!(reset_of(&r, 0), Duration::from_secs(1));
    clock.advance(Duration::from_secs(1));
    assert!(is_ok(&hit("sliding", 1).await));

    // sliding_log: 2 in any 10 s; the oldest leaves exactly 10 s after it came.
    clock.set(T0 + 30_000_000);
    assert!(is_ok(&hit("log", 1).await));
    clock.set(T0 + 34_000_000);
    assert!(is_ok(&hit("log", 1).await));
    clock.set(T0 + 39_000_000);
    let r = hit("log", 1).await;
    assert!(is_over(&r));
    assert_eq!(reset_of(&r, 0), Duration::from_secs(1));
    clock.set(T0 + 40_000_000);
    assert!(is_ok(&hit("log", 1).await));
    assert!(is_over(&hit("log", 1).await));

    // token_bucket: 4 per second (one per 250 ms), holds 2.
    clock.set(T0 + 50_000_000);
    assert!(is_ok(&hit("bucket", 2).await));
    let r = hit("bucket", 1).await;
    assert!(is_over(&r));
    // 250 ms to the next token, answered in whole seconds rounded up (Envoy reads whole
    // seconds): 1 s.
    assert_eq!(reset_of(&r, 0), Duration::from_secs(1));
    clock.advance(Duration::from_millis(250));
    assert!(is_ok(&hit("bucket", 1).await));
    assert!(is_over(&hit("bucket", 1).await));
    clock.advance(Duration::from_secs(60));
    let r = hit("bucket", 1).await;
    assert_eq!(r.statuses[0].limit_remaining, 1, "never more than burst");
}

/// An NTP step back (and forward again) must not start windows afresh: with 5 per minute, at
/// most 5 are admitted across the whole episode, on every algorithm.
#[tokio::test]
async fn a_wall_clock_stepped_back_never_resets_a_window() {
    const T0: u64 = 1_800_000_000_000_000 + 30_000_000; // mid-minute
    let clock = ManualClock::new(T0);
    let yaml = Algorithm::ALL
        .iter()
        .map(|a| format!("  - key: {a}\n    rate_limit: {{unit: minute, requests_per_unit: 5, algorithm: {a}}}\n"))
        .collect::<String>();
    let s = TestServer::start_with(
        &[("c.yaml", &format!("domain: c\ndescriptors:\n{yaml}"))],
        &[],
        Arc::new(clock.clone()),
    )
    .await;
    let mut c = s.client().await;
    for a in Algorithm::ALL {
        let key = a.to_string();
        let mut admitted = 0;
        for at in [T0, T0 - 70_000_000, T0 + 1_000_000] {
            clock.set(at);
            for _ in 0..5 {
                admitted +=
                    is_ok(&call(&mut c, request("c", &[&[(key.as_str(), "v")]])).await) as usize;
            }
        }
        assert_eq!(admitted, 5, "{a}");
        clock.set(T0);
    }
}

/// Each algorithm on the wall clock: rejected now, admitted again no later than it said.
async fn algorithms_recover_on_the_wall_clock_when_they_said(kind: Kind) {
    let yaml = Algorithm::ALL
        .iter()
        .map(|a| format!("  - key: {a}\n    rate_limit: {{unit: second, requests_per_unit: 3, algorithm: {a}}}\n"))
        .collect::<String>();
    let s = start(
        kind,
        &[("w.yaml", &format!("domain: w\ndescriptors:\n{yaml}"))],
        &[],
    )
    .await;
    let mut c = s.client().await;
    for algorithm in Algorithm::ALL {
        let key = algorithm.as_str();
        // Fill the limit and see the next request refused. A window boundary between the two
        // calls (1 s windows) would admit it; then try again with a fresh counter.
        let mut attempt = 0;
        let (value, said, asked) = loop {
            attempt += 1;
            let value = format!("x{attempt}");
            let mut req = request("w", &[&[(key, &value)]]);
            req.hits_addend = 3;
            assert!(is_ok(&call(&mut c, req).await), "{algorithm}");
            // Timed from before the question: the server counts `said` from when it decides,
            // which a loaded machine may answer long after.
            let asked = tokio::time::Instant::now();
            let r = call(&mut c, request("w", &[&[(key, &value)]])).await;
            if is_over(&r) {
                break (value, reset_of(&r, 0), asked);
            }
            assert!(attempt < 3, "{algorithm}: never refused");
        };
        assert!(
            said > Duration::ZERO && said <= Duration::from_secs(2),
            "{algorithm}: {said:?}"
        );
        poll(said + Duration::from_secs(3), || {
            let mut c = c.clone();
            let req = request("w", &[&[(key, value.as_str())]]);
            async move { is_ok(&call(&mut c, req).await).then_some(()) }
        })
        .await;
        // Admitted, and not long before the time it announced: `said` is whole seconds
        // rounded up, so up to a second early (and 10 ms of clock slack).
        assert!(
            asked.elapsed() + Duration::from_millis(1010) >= said,
            "{algorithm}: admitted early"
        );
        assert_eq!(said.subsec_nanos(), 0, "{algorithm}: whole seconds");
    }
}

/// envoyproxy/ratelimit's counts for a request of several hits that crosses a limit: the hits
/// past the limit are over, those between the near threshold and the limit near. Windows of
/// 1000 days, so no window boundary falls between the calls.
async fn reference_counts_split_a_request_that_crosses_the_limit(kind: Kind) {
    let yaml = Algorithm::ALL
        .map(|a| format!("  - key: {a}\n    rate_limit: {{unit: day, unit_multiplier: 1000, requests_per_unit: 10, algorithm: {a}}}\n"))
        .concat();
    let yaml = format!("domain: x\ndescriptors:\n{yaml}");
    let s = start(kind, &[("x.yaml", &yaml)], &["--reference-metrics"]).await;
    let mut c = s.client().await;
    for key in Algorithm::ALL.map(|a| a.as_str()) {
        let req = |hits| weighted(request("x", &[&[(key, "v")]]), hits);
        // 7 within; then 5 from 7 cross 10: 8..10 are 2 near (threshold floor(10 × 0.8) = 8),
        // 11 and 12 over, nothing consumed; then 2 from 7 fit: 7..9, 1 near.
        assert!(is_ok(&call(&mut c, req(7)).await), "{key}");
        assert!(is_over(&call(&mut c, req(5)).await), "{key}");
        assert!(is_ok(&call(&mut c, req(2)).await), "{key}");
        let (_, m) = s.http_get("/metrics").await;
        for (family, n) in [
            ("total_hits", 14.0),
            ("within_limit", 9.0),
            ("near_limit", 3.0),
            ("over_limit", 2.0),
        ] {
            let series =
                format!("ratelimit_service_rate_limit_{family}{{domain=\"x\",key1=\"{key}\"}}");
            assert_eq!(metric(&m, &series), n, "{kind:?} {key} {family}\n{m}");
        }
    }
}

every_backend!(
    reference_counts_split_a_request_that_crosses_the_limit,
    one_counter_twice_in_a_request_counts_both_hits,
    fixed_window_admits_up_to_the_limit_and_reports_it,
    unknown_domains_and_unmatched_descriptors_are_not_limited,
    malformed_requests_are_invalid_argument_with_a_message,
    what_a_client_makes_envoy_send_is_decided,
    hits_addend_per_request_and_per_descriptor,
    a_descriptor_limit_override_replaces_the_configured_limit,
    a_rejected_request_consumes_nothing_anywhere,
    zero_blocks_unlimited_never_limits,
    shadow_mode_counts_and_reports_but_never_rejects,
    global_shadow_mode_answers_ok_overall,
    several_limits_report_the_most_restrictive,
    quota_mode_rejects_only_when_every_quota_descriptor_is_over,
    global_quota_mode_refuses_only_when_every_descriptor_is_over,
    share_threshold_wildcards_share_one_counter,
    metrics_keep_request_values_out_unless_asked,
    per_rule_metrics_give_each_limit_its_limit_and_name_the_refusing_rule,
    health_over_grpc_and_http,
    concurrent_requests_admit_exactly_the_limit_for_every_algorithm,
    algorithms_recover_on_the_wall_clock_when_they_said,
);

/// The `rule` label comes from the config, never from a request: an override's entry keys
/// and detailed_metric values cannot grow the number of series without bound.
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

/// 1,000 rules and 100,000 distinct values: the per-rule series are four per limit (hits,
/// hits over, limit, window), whatever the values; a request's own limit adds its own series
/// to the rule it lands on, once.
#[tokio::test]
async fn per_rule_series_are_as_many_as_the_rules_whatever_the_values() {
    let mut yaml = String::from("domain: many\ndescriptors:\n");
    for r in 0..1000 {
        yaml += &format!(
            "  - key: r{r}\n    rate_limit: {{unit: hour, requests_per_unit: {}}}\n",
            r + 1
        );
    }
    let s = TestServer::start(&[("many.yaml", &yaml)]).await;
    let c = s.client().await;
    let requests: Vec<_> = (0..2000)
        .map(|i| {
            let entries: Vec<(String, String)> = (0..50)
                .map(|j| {
                    let v = i * 50 + j;
                    (format!("r{}", v % 1000), format!("value-{v}"))
                })
                .collect();
            let entries: Vec<[(&str, &str); 1]> = entries
                .iter()
                .map(|(k, v)| [(k.as_str(), v.as_str())])
                .collect();
            let descriptors: Vec<&[(&str, &str)]> = entries.iter().map(|e| &e[..]).collect();
            request("many", &descriptors)
        })
        .collect();
    for chunk in requests.chunks(16) {
        let calls = chunk.iter().cloned().map(|req| {
            let mut c = c.clone();
            async move { call(&mut c, req).await }
        });
        futures_util::future::join_all(calls).await;
    }
    let mut one = request("many", &[&[("r7", "own-limit")]]);
    one.descriptors[0].limit = Some(RateLimitOverride {
        requests_per_unit: 1,
        unit: 1,
    });
    call(&mut c.clone(), one.clone()).await;
    call(&mut c.clone(), one).await;
    let (_, m) = s.http_get("/metrics").await;
    let lines: Vec<&str> = m
        .lines()
        .filter(|l| l.starts_with("ratelimit_rule_"))
        .collect();
    assert_eq!(
        lines.len(),
        4 * 1000 + 2,
        "{:?}",
        &lines[..lines.len().min(20)]
    );
    assert!(!m.contains("value-"), "no value in any label");
    let hits: f64 = lines
        .iter()
        .filter(|l| l.starts_with("ratelimit_rule_hits_total{") && !l.contains("limit=\"request\""))
        .map(|l| l.rsplit(' ').next().unwrap().parse::<f64>().unwrap())
        .sum();
    assert_eq!(hits, 100_000.0);
    let series = |family: &str, rule: &str, limit: &str| {
        metric(
            &m,
            &format!(
                "ratelimit_rule_{family}{{domain=\"many\",rule=\"{rule}\",limit=\"{limit}\"}}"
            ),
        )
    };
    assert_eq!(series("limit", "r999", "0"), 1000.0);
    assert_eq!(series("hits_total", "r7", "0"), 100.0);
    assert_eq!(series("hits_total", "r7", "request"), 2.0);
    assert_eq!(series("over_limit_hits_total", "r7", "request"), 1.0);
}

/// A reload gauges the limits of the config now in force: a limit changed shows its new
/// value, a rule gone is gauged no more, and counters carry on.
#[tokio::test]
async fn per_rule_limits_follow_the_config_in_force() {
    let s = TestServer::start(&[(
        "l.yaml",
        "domain: r\ndescriptors:\n  - key: a\n    rate_limit: {unit: hour, requests_per_unit: 5}\n  - key: b\n    rate_limit: {unit: minute, requests_per_unit: 7}\n",
    )])
    .await;
    let mut c = s.client().await;
    call(&mut c, request("r", &[&[("a", "1")], &[("b", "1")]])).await;
    let scrape = || async { s.http_get("/metrics").await.1 };
    let m = scrape().await;
    let series = |m: &str, family: &str, rule: &str| {
        metric(
            m,
            &format!("ratelimit_rule_{family}{{domain=\"r\",rule=\"{rule}\",limit=\"0\"}}"),
        )
    };
    assert_eq!(series(&m, "limit", "a"), 5.0);
    assert_eq!(series(&m, "limit", "b"), 7.0);
    assert_eq!(series(&m, "window_seconds", "b"), 60.0);
    s.write(
        "l.yaml",
        "domain: r\ndescriptors:\n  - key: a\n    rate_limit: {unit: hour, requests_per_unit: 9}\n",
    );
    poll(Duration::from_secs(10), || async {
        (metric(
            &scrape().await,
            r#"ratelimit_config_loads_total{result="success"}"#,
        ) == 2.0)
            .then_some(())
    })
    .await;
    call(&mut c, request("r", &[&[("a", "1")], &[("b", "1")]])).await;
    let m = scrape().await;
    assert_eq!(series(&m, "limit", "a"), 9.0, "{m}");
    assert!(
        !m.contains(r#"ratelimit_rule_limit{domain="r",rule="b""#),
        "{m}"
    );
    assert_eq!(series(&m, "hits_total", "a"), 2.0, "counted on");
    assert_eq!(series(&m, "hits_total", "b"), 1.0, "kept");
}

/// `--reference-metrics`: envoyproxy/ratelimit's per-rule families as Envoy Gateway's statsd
/// mapping names them (`key2` for the second level, none deeper), shadow hits counted as over
/// and as shadow; without the flag they are absent.
#[tokio::test]
async fn reference_metric_families_name_rules_as_envoy_gateway_reads_them() {
    let yaml = "domain: eg
descriptors:
  - key: route
    value: r1
    descriptors:
      - key: user
        shadow_mode: true
        rate_limit: {unit: hour, requests_per_unit: 1}
";
    let s = TestServer::start_with(
        &[("eg.yaml", yaml)],
        &["--reference-metrics"],
        Arc::new(ManualClock::new(1_000_000)),
    )
    .await;
    let mut c = s.client().await;
    for _ in 0..3 {
        let r = call(&mut c, request("eg", &[&[("route", "r1"), ("user", "u")]])).await;
        assert!(is_ok(&r), "shadow mode never rejects");
    }
    let (_, m) = s.http_get("/metrics").await;
    let series = |family: &str| {
        format!(
            "ratelimit_service_rate_limit_{family}{{domain=\"eg\",key1=\"route_r1\",key2=\"user\"}}"
        )
    };
    for (family, n) in [
        ("total_hits", 3.0),
        ("within_limit", 1.0),
        ("near_limit", 1.0),
        ("over_limit", 2.0),
        ("shadow_mode", 2.0),
    ] {
        assert_eq!(metric(&m, &series(family)), n, "{family}\n{m}");
    }

    let plain = TestServer::start(&[("eg.yaml", yaml)]).await;
    let mut c = plain.client().await;
    call(&mut c, request("eg", &[&[("route", "r1"), ("user", "u")]])).await;
    let (_, m) = plain.http_get("/metrics").await;
    assert!(!m.contains("ratelimit_service_"), "{m}");
    // Memory is always exported: the chart's dashboard shows it.
    assert!(metric(&m, "process_resident_memory_bytes") > 1e6, "{m}");
}
