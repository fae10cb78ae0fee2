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
