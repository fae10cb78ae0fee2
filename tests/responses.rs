//! What a response carries besides its decision: rate-limit headers in every mode,
//! envoyproxy/ratelimit's dynamic metadata, and the same service as proto3 JSON on `POST /json`.
//! Windows are an hour long, so no boundary falls between the calls of a test.

mod common;

use std::sync::Arc;

use common::*;
use envoy_types::pb::envoy::service::ratelimit::v3::RateLimitResponse;
use envoy_types::pb::google::protobuf::value::Kind;
use ratelimitd::testing::SystemClock;

const LIMITS: &str = "domain: web
descriptors:
  - key: path
    rate_limit: {unit: hour, requests_per_unit: 2, name: per_path}
  - key: client
    rate_limit: {unit: hour, requests_per_unit: 100}
  - key: tenant
    quota_mode: true
    metadata: {team: payments, limits: {tier: gold}}
    rate_limit: {unit: hour, requests_per_unit: 1}
  - key: region
    metadata: {team: edge, limits: {zone: eu}}
    rate_limit: {unit: hour, requests_per_unit: 10}
";

async fn server(flags: &[&str]) -> TestServer {
    TestServer::start_with(&[("web.yaml", LIMITS)], flags, Arc::new(SystemClock)).await
}

fn header(r: &RateLimitResponse, name: &str) -> Option<String> {
    r.response_headers_to_add
        .iter()
        .find(|h| h.key.eq_ignore_ascii_case(name))
        .map(|h| h.value.clone())
}

#[tokio::test]
async fn draft03_headers_as_envoy_writes_them_and_retry_after_when_over() {
    let s = server(&["--response-headers", "draft03"]).await;
    let mut c = s.client().await;
    let req = || request("web", &[&[("client", "c1")], &[("path", "/a")]]);
    let r = call(&mut c, req()).await;
    assert_eq!(
        header(&r, "X-RateLimit-Limit").as_deref(),
        Some("2, 100;w=3600, 2;w=3600;name=\"per_path\"")
    );
    assert_eq!(header(&r, "X-RateLimit-Remaining").as_deref(), Some("1"));
    let reset: u64 = header(&r, "X-RateLimit-Reset").unwrap().parse().unwrap();
    assert!(reset <= 3600);
    assert_eq!(header(&r, "Retry-After"), None);
    call(&mut c, req()).await;
    let r = call(&mut c, req()).await;
    assert!(is_over(&r));
    let retry: u64 = header(&r, "Retry-After").unwrap().parse().unwrap();
    assert!((1..=3600).contains(&retry), "{retry}");
}

#[tokio::test]
async fn ietf_and_reference_headers() {
    let s = server(&["--response-headers", "ietf"]).await;
    let mut c = s.client().await;
    let r = call(
        &mut c,
        request("web", &[&[("path", "/a")], &[("client", "c")]]),
    )
    .await;
    assert_eq!(
        header(&r, "RateLimit-Policy").as_deref(),
        Some("\"per_path\";q=2;w=3600, \"descriptor1\";q=100;w=3600")
    );
    let rl = header(&r, "RateLimit").unwrap();
    assert!(rl.starts_with("\"per_path\";r=1;t="), "{rl}");

    // LIMIT_RESPONSE_HEADERS_ENABLED=true selects these (settings test); here the flag.
    let s = server(&["--response-headers", "reference"]).await;
    let mut c = s.client().await;
    let r = call(&mut c, request("web", &[&[("path", "/a")]])).await;
    assert_eq!(header(&r, "RateLimit-Limit").as_deref(), Some("2"));
    assert_eq!(header(&r, "RateLimit-Remaining").as_deref(), Some("1"));
    let reset: u64 = header(&r, "RateLimit-Reset").unwrap().parse().unwrap();
    assert!((1..=3600).contains(&reset));

    let s = server(&[]).await;
    let mut c = s.client().await;
    let r = call(&mut c, request("web", &[&[("path", "/a")]])).await;
    assert!(r.response_headers_to_add.is_empty(), "off by default");
}

/// The reference headers under the names LIMIT_*_HEADER give (here their flags), and only
/// under those.
#[tokio::test]
async fn reference_headers_under_configured_names() {
    let s = server(&[
        "--response-headers",
        "reference",
        "--reference-limit-header",
        "X-Quota-Limit",
        "--reference-remaining-header",
        "X-Quota-Left",
        "--reference-reset-header",
        "X-Quota-Reset",
    ])
    .await;
    let mut c = s.client().await;
    let r = call(&mut c, request("web", &[&[("path", "/a")]])).await;
    assert_eq!(header(&r, "X-Quota-Limit").as_deref(), Some("2"));
    assert_eq!(header(&r, "X-Quota-Left").as_deref(), Some("1"));
    let reset: u64 = header(&r, "X-Quota-Reset").unwrap().parse().unwrap();
    assert!((1..=3600).contains(&reset));
    assert_eq!(
        r.response_headers_to_add.len(),
        3,
        "{:?}",
        r.response_headers_to_add
    );
}

fn field<'a>(s: &'a envoy_types::pb::google::protobuf::Struct, name: &str) -> Option<&'a Kind> {
    s.fields.get(name).and_then(|v| v.kind.as_ref())
}

#[tokio::test]
async fn dynamic_metadata_as_envoyproxy_ratelimit_returns_it() {
    let s = server(&["--response-dynamic-metadata"]).await;
    let mut c = s.client().await;
    let req = || request("web", &[&[("tenant", "t1")], &[("region", "r1")]]);
    let r = call(&mut c, req()).await;
    let m = r.dynamic_metadata.as_ref().expect("dynamic metadata");
    assert!(matches!(field(m, "domain"), Some(Kind::StringValue(d)) if d == "web"));
    let Some(Kind::ListValue(ds)) = field(m, "descriptors") else {
        panic!("{m:?}")
    };
    let Some(Kind::StructValue(d0)) = ds.values[0].kind.as_ref() else {
        panic!()
    };
    let Some(Kind::ListValue(entries)) = field(d0, "entries") else {
        panic!()
    };
    assert!(matches!(&entries.values[0].kind, Some(Kind::StringValue(e)) if e == "tenant=t1"));
    // Both passed: their metadata merged, the first one's value kept, mappings merged.
    let Some(Kind::StructValue(meta)) = field(m, "metadata") else {
        panic!("{m:?}")
    };
    assert!(matches!(field(meta, "team"), Some(Kind::StringValue(t)) if t == "payments"));
    let Some(Kind::StructValue(limits)) = field(meta, "limits") else {
        panic!()
    };
    assert!(matches!(field(limits, "tier"), Some(Kind::StringValue(t)) if t == "gold"));
    assert!(matches!(field(limits, "zone"), Some(Kind::StringValue(z)) if z == "eu"));

    // The quota descriptor is now over (a violation): only the region's metadata is returned.
    let r = call(&mut c, req()).await;
    let m = r.dynamic_metadata.as_ref().unwrap();
    let Some(Kind::StructValue(meta)) = field(m, "metadata") else {
        panic!("{m:?}")
    };
    assert!(matches!(field(meta, "team"), Some(Kind::StringValue(t)) if t == "edge"));

    let s = server(&[]).await;
    let mut c = s.client().await;
    assert!(
        call(&mut c, req()).await.dynamic_metadata.is_none(),
        "off by default"
    );
}

#[tokio::test]
async fn json_endpoint_answers_200_then_429_and_400_for_bad_input() {
    let s = server(&["--response-headers", "draft03"]).await;
    let body = r#"{"domain":"web","descriptors":[{"entries":[{"key":"path","value":"/j"}]}]}"#;
    for _ in 0..2 {
        let (status, json) = post_json(s.http, body).await;
        assert_eq!(status, 200, "{json}");
        let v: serde_json::Value = serde_json::from_str(&json).unwrap();
        assert_eq!(v["overallCode"], "OK");
        assert_eq!(v["statuses"][0]["currentLimit"]["name"], "per_path");
        assert_eq!(v["statuses"][0]["currentLimit"]["unit"], "HOUR");
    }
    let (status, json) = post_json(s.http, body).await;
    assert_eq!(status, 429);
    let v: serde_json::Value = serde_json::from_str(&json).unwrap();
    assert_eq!(v["overallCode"], "OVER_LIMIT");
    assert_eq!(v["statuses"][0]["code"], "OVER_LIMIT");
    assert!(
        v["statuses"][0].get("limitRemaining").is_none(),
        "defaults are left out"
    );
    assert!(
        v["statuses"][0]["durationUntilReset"]
            .as_str()
            .unwrap()
            .ends_with('s'),
        "{v}"
    );
    assert!(
        v["responseHeadersToAdd"]
            .as_array()
            .unwrap()
            .iter()
            .any(|h| h["key"] == "Retry-After"),
        "{v}"
    );
    for (bad, says) in [
        ("{", "not JSON"),
        (
            r#"{"domain":"web","descriptors":[{"entries":[{"kee":"x"}]}]}"#,
            "kee",
        ),
        (r#"{"domain":"","descriptors":[]}"#, "domain"),
    ] {
        let (status, message) = post_json(s.http, bad).await;
        assert_eq!(status, 400, "{bad}: {message}");
        assert!(message.contains(says), "{bad}: {message}");
    }
}

/// `POST /json` takes `isNegativeHits` as gRPC takes `is_negative_hits`: the hits go back.
#[tokio::test]
async fn json_refunds_with_is_negative_hits() {
    let s = server(&[]).await;
    let body = r#"{"domain":"web","descriptors":[{"entries":[{"key":"path","value":"/n"}]}]}"#;
    for _ in 0..2 {
        assert_eq!(post_json(s.http, body).await.0, 200);
    }
    assert_eq!(post_json(s.http, body).await.0, 429);
    let refund = r#"{"domain":"web","descriptors":[{"entries":[{"key":"path","value":"/n"}],"hitsAddend":"1","isNegativeHits":true}]}"#;
    let (status, json) = post_json(s.http, refund).await;
    assert_eq!(status, 200, "{json}");
    let v: serde_json::Value = serde_json::from_str(&json).unwrap();
    assert_eq!(v["statuses"][0]["limitRemaining"], 1, "{v}");
    assert_eq!(post_json(s.http, body).await.0, 200, "one given back");
    assert_eq!(post_json(s.http, body).await.0, 429);
}

/// Limits with answers: `tenant`'s is inherited by `tenant.user`, whose second limit has its
/// own; `plain` has none (the default answer applies when the server has one).
const ANSWERED: &str = r#"domain: told
descriptors:
  - key: tenant
    answer:
      headers:
        x-left-requests: "{{remaining}}"
        x-ratelimit-limit: "answer's"
      over_limit:
        headers:
          retry-after-ms: "{{reset_ms}}"
        body: '{"error": {"limit": "{{name}}", "per": "{{unit}}", "tenant": "{{value}}", "in": {{reset_seconds}}}}'
    rate_limit: {unit: hour, requests_per_unit: 2, name: hourly}
    descriptors:
      - key: user
        rate_limits:
          - {unit: minute, requests_per_unit: 5, name: per-minute}
          - unit: day
            requests_per_unit: 1
            name: daily
            answer:
              headers:
                x-left-daily: "{{remaining}}"
              over_limit:
                headers:
                  x-should-retry: "false"
                content_type: text/plain
                body: "daily budget of {{key}} {{value}} spent; {{reset_seconds}} s left"
  - key: plain
    rate_limit: {unit: hour, requests_per_unit: 1}
  - key: model
    value: premium
    rate_limits:
      - name: premium-soft
        unit: hour
        requests_per_unit: 2
        soft: true
        answer:
          over_limit:
            upstream_headers:
              x-model-tier: economy
              x-soft-left: "{{remaining}}"
            headers:
              x-served-by: economy
      - {unit: hour, requests_per_unit: 4, name: premium-hard}
  - key: tag
    soft: true
    rate_limit: {unit: hour, requests_per_unit: 1}
"#;

async fn answered(flags: &[&str]) -> TestServer {
    TestServer::start_with(&[("told.yaml", ANSWERED)], flags, Arc::new(SystemClock)).await
}

/// A limit's answer reaches the client: its headers on every answer, and on a refusal its
/// own headers and body (raw_body), with the content type; a descriptor's answer is its
/// nested descriptors' unless a limit has its own; an answer's header replaces the
/// `--response-headers` one of that name.
#[tokio::test]
async fn a_limits_answer_is_its_headers_and_on_a_refusal_its_body() {
    let s = answered(&["--response-headers", "draft03"]).await;
    let mut c = s.client().await;
    let req = || request("told", &[&[("tenant", "acme \"inc\"")]]);
    let r = call(&mut c, req()).await;
    assert!(!is_over(&r));
    assert_eq!(header(&r, "x-left-requests").as_deref(), Some("1"));
    assert_eq!(header(&r, "x-ratelimit-limit").as_deref(), Some("answer's"));
    let named = |r: &RateLimitResponse, name: &str| {
        r.response_headers_to_add
            .iter()
            .filter(|h| h.key.eq_ignore_ascii_case(name))
            .count()
    };
    assert_eq!(named(&r, "x-ratelimit-limit"), 1, "{r:?}");
    assert_eq!(header(&r, "X-RateLimit-Remaining").as_deref(), Some("1"));
    assert!(r.raw_body.is_empty());
    call(&mut c, req()).await;
    let r = call(&mut c, req()).await;
    assert!(is_over(&r));
    assert_eq!(
        header(&r, "content-type").as_deref(),
        Some("application/json")
    );
    let ms: u64 = header(&r, "retry-after-ms").unwrap().parse().unwrap();
    assert!((1..=3_600_000).contains(&ms), "{ms}");
    let body: serde_json::Value = serde_json::from_slice(&r.raw_body).unwrap();
    assert_eq!(body["error"]["limit"], "hourly");
    assert_eq!(body["error"]["per"], "hour");
    assert_eq!(body["error"]["tenant"], "acme \"inc\"");
    assert_eq!(body["error"]["in"], ms.div_ceil(1000));

    // Nested: the day's own answer (text), the minute's inherited one.
    let req = || request("told", &[&[("tenant", "t"), ("user", "u1")]]);
    let r = call(&mut c, req()).await;
    assert_eq!(header(&r, "x-left-daily").as_deref(), Some("0"), "{r:?}");
    let r = call(&mut c, req()).await;
    assert!(is_over(&r));
    assert_eq!(header(&r, "content-type").as_deref(), Some("text/plain"));
    assert_eq!(header(&r, "x-should-retry").as_deref(), Some("false"));
    let text = String::from_utf8(r.raw_body.clone()).unwrap();
    assert!(
        text.starts_with("daily budget of user u1 spent; "),
        "{text}"
    );

    // No answer: nothing of it.
    let r = call(&mut c, request("told", &[&[("plain", "p")]])).await;
    assert_eq!(header(&r, "x-left-requests"), None);
    assert_eq!(r.response_headers_to_add.len(), 3, "draft03's: {r:?}");
}

/// On a refusal by two descriptors the one the client must wait longest for speaks; the
/// other's headers still show.
#[tokio::test]
async fn the_limit_that_resets_last_speaks() {
    let s = answered(&[]).await;
    let mut c = s.client().await;
    // One request spends user u2's day and half of tenant t2's hour; one more the hour.
    let both = || {
        request(
            "told",
            &[&[("tenant", "t2")], &[("tenant", "t2"), ("user", "u2")]],
        )
    };
    let r = call(&mut c, both()).await;
    assert!(!is_over(&r));
    let r = call(&mut c, request("told", &[&[("tenant", "t2")]])).await;
    assert!(!is_over(&r));
    let r = call(&mut c, both()).await;
    assert!(is_over(&r));
    assert_eq!(r.statuses[0].code, r.statuses[1].code, "both over: {r:?}");
    assert_eq!(
        header(&r, "x-should-retry").as_deref(),
        Some("false"),
        "the day speaks"
    );
    assert_eq!(
        header(&r, "x-left-requests").as_deref(),
        Some("0"),
        "the hour's header"
    );
    assert!(String::from_utf8_lossy(&r.raw_body).starts_with("daily budget"));
}

/// `--default-answer` answers for limits without one; `POST /json` shows the same headers and
/// the body (`rawBody`, base64 as proto3 JSON writes bytes).
#[tokio::test]
async fn the_default_answer_and_the_json_endpoint() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("answer.yaml");
    std::fs::write(
        &file,
        "over_limit:\n  headers:\n    x-default: \"{{domain}}\"\n  body: 'over {{requests_per_unit}}/{{unit}}'\n",
    )
    .unwrap();
    let s = answered(&["--default-answer", file.to_str().unwrap()]).await;
    let body = r#"{"domain":"told","descriptors":[{"entries":[{"key":"plain","value":"j"}]}]}"#;
    let (status, _) = post_json(s.http, body).await;
    assert_eq!(status, 200);
    let (status, json) = post_json(s.http, body).await;
    assert_eq!(status, 429);
    let v: serde_json::Value = serde_json::from_str(&json).unwrap();
    let headers = v["responseHeadersToAdd"].as_array().unwrap();
    assert!(
        headers
            .iter()
            .any(|h| h["key"] == "x-default" && h["value"] == "told"),
        "{v}"
    );
    assert!(
        headers
            .iter()
            .any(|h| h["key"] == "content-type" && h["value"] == "text/plain; charset=utf-8"),
        "{v}"
    );
    // "over 1/hour"
    assert_eq!(v["rawBody"], "b3ZlciAxL2hvdXI=", "{v}");

    // A default that does not compile stops the start, naming file, line and field.
    std::fs::write(&file, "headers:\n  x-a: \"{{nope}}\"\n").unwrap();
    let out =
        common::daemon::ratelimitd(s.dir.path(), &["--default-answer", file.to_str().unwrap()])
            .output()
            .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains(&format!(
            "{}:2:8: headers.x-a: unknown variable '{{{{nope}}}}'",
            file.display()
        )),
        "{err}"
    );
}

/// A reload whose answer does not compile is refused; the answers in force stay.
#[tokio::test]
async fn a_bad_answer_on_reload_keeps_the_last_good_config() {
    let s = answered(&[]).await;
    s.write(
        "told.yaml",
        &ANSWERED.replace("{{remaining}}", "{{remainder}}"),
    );
    poll(std::time::Duration::from_secs(10), || async {
        let (_, m) = s.http_get("/metrics").await;
        (metric(&m, r#"ratelimit_config_loads_total{result="error"}"#) >= 1.0).then_some(())
    })
    .await;
    let mut c = s.client().await;
    let r = call(&mut c, request("told", &[&[("tenant", "r")]])).await;
    assert_eq!(header(&r, "x-left-requests").as_deref(), Some("1"));
}

/// A soft limit over lets the request through and tells the upstream (its
/// `upstream_headers`, else `x-ratelimit-soft: <name>`), and the client if asked; it counts as
/// `soft_limit`; a hard limit beside it still refuses, and the refused request tells nobody.
#[tokio::test]
async fn a_soft_limit_over_tells_the_upstream_and_refuses_nothing() {
    let s = answered(&[]).await;
    let mut c = s.client().await;
    let premium = || request("told", &[&[("model", "premium")]]);
    for _ in 0..2 {
        let r = call(&mut c, premium()).await;
        assert!(!is_over(&r) && r.request_headers_to_add.is_empty(), "{r:?}");
    }
    for _ in 0..2 {
        let r = call(&mut c, premium()).await;
        assert!(!is_over(&r), "a soft limit never refuses: {r:?}");
        let upstream: Vec<(&str, &str)> = r
            .request_headers_to_add
            .iter()
            .map(|h| (h.key.as_str(), h.value.as_str()))
            .collect();
        assert_eq!(
            upstream,
            [("x-model-tier", "economy"), ("x-soft-left", "0")]
        );
        assert_eq!(header(&r, "x-served-by").as_deref(), Some("economy"));
        // The hard limit reports, not the soft one.
        assert_eq!(
            r.statuses[0].current_limit.as_ref().unwrap().name,
            "premium-hard"
        );
    }
    let r = call(&mut c, premium()).await;
    assert!(is_over(&r), "the hard limit's 4 are spent: {r:?}");
    assert!(r.request_headers_to_add.is_empty(), "{r:?}");
    let (_, m) = s.http_get("/metrics").await;
    assert_eq!(
        metric(
            &m,
            r#"ratelimit_decisions_total{domain="told",rule="model_premium",decision="soft_limit"}"#
        ),
        3.0,
        "each limit's decision is its own: the refused request was over the soft limit too"
    );

    // Without upstream_headers: x-ratelimit-soft, the limit's name or `over`. On /json too.
    let body = r#"{"domain":"told","descriptors":[{"entries":[{"key":"tag","value":"t"}]}]}"#;
    let (status, json) = post_json(s.http, body).await;
    assert_eq!(status, 200);
    assert!(!json.contains("requestHeadersToAdd"), "{json}");
    let (status, json) = post_json(s.http, body).await;
    assert_eq!(status, 200, "{json}");
    let v: serde_json::Value = serde_json::from_str(&json).unwrap();
    assert_eq!(
        v["requestHeadersToAdd"],
        serde_json::json!([{"key": "x-ratelimit-soft", "value": "over"}]),
        "{v}"
    );
}
