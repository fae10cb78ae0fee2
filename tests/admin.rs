//! The admin API on every backend: counters inspected without consuming, reset to unblock a
//! client, and off unless asked for.

mod common;

use common::*;
use ratelimitd::admin::admin_client::AdminClient;
use ratelimitd::admin::{Counter, CounterRequest, Entry};

const LIMITS: &str = "domain: a
descriptors:
  - key: k
    rate_limits:
      - {unit: hour, requests_per_unit: 5}
      - {unit: hour, requests_per_unit: 10, algorithm: sliding_log, name: logged}
  - key: b
    rate_limit: {unit: hour, requests_per_unit: 2, algorithm: token_bucket, burst: 4}
";

fn counter_request(key: &str, value: &str) -> CounterRequest {
    CounterRequest {
        domain: "a".into(),
        entries: vec![Entry {
            key: key.into(),
            value: value.into(),
            escaped: false,
        }],
    }
}

type Admin = AdminClient<tonic::transport::Channel>;

async fn counters(admin: &mut Admin, key: &str, value: &str) -> Vec<Counter> {
    admin
        .get_counters(counter_request(key, value))
        .await
        .unwrap()
        .into_inner()
        .counters
}

async fn inspect_and_reset_counters(kind: Kind) {
    let s = start(kind, &[("a.yaml", LIMITS)], &["--admin"]).await;
    let mut c = s.client().await;
    let mut admin = AdminClient::connect(format!("http://{}", s.grpc))
        .await
        .unwrap();
    for _ in 0..3 {
        assert!(is_ok(
            &call(&mut c, request("a", &[&[("k", "v")], &[("b", "v")]])).await
        ));
    }
    for _ in 0..2 {
        let counters = counters(&mut admin, "k", "v").await;
        let seen: Vec<(&str, &str, u64, u64)> = counters
            .iter()
            .map(|c| (c.name.as_str(), c.algorithm.as_str(), c.used, c.remaining))
            .collect();
        assert_eq!(
            seen,
            vec![("", "fixed_window", 3, 2), ("logged", "sliding_log", 3, 7)],
            "looking consumes nothing"
        );
        assert!(
            counters
                .iter()
                .all(|c| c.reset_ms > 0 && c.window_seconds == 3600)
        );
    }
    let bucket = counters(&mut admin, "b", "v").await;
    assert_eq!((bucket[0].used, bucket[0].remaining), (3, 1));

    let reset = admin
        .reset_counters(counter_request("k", "v"))
        .await
        .unwrap()
        .into_inner()
        .reset;
    assert_eq!(reset, 2);
    let counters = counters(&mut admin, "k", "v").await;
    assert!(counters.iter().all(|c| c.used == 0), "{counters:?}");
    for _ in 0..5 {
        assert!(is_ok(&call(&mut c, request("a", &[&[("k", "v")]])).await));
    }
    assert!(is_over(&call(&mut c, request("a", &[&[("k", "v")]])).await));
    // A descriptor no limit applies to has no counters; a malformed one is refused.
    let none = admin
        .get_counters(counter_request("nothing", "x"))
        .await
        .unwrap()
        .into_inner();
    assert!(none.counters.is_empty());
    let err = admin
        .get_counters(counter_request("", "x"))
        .await
        .unwrap_err();
    assert_eq!(err.code(), tonic::Code::InvalidArgument);
}

/// A request's own `limit` override counts in a counter of its own; a reset reaches it too.
async fn a_reset_unblocks_a_client_over_its_own_limit_override(kind: Kind) {
    use envoy_types::pb::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::RateLimitOverride;
    let s = start(kind, &[("a.yaml", LIMITS)], &["--admin"]).await;
    let mut c = s.client().await;
    let mut admin = AdminClient::connect(format!("http://{}", s.grpc))
        .await
        .unwrap();
    let overridden = || {
        let mut req = request("a", &[&[("k", "o")]]);
        req.descriptors[0].limit = Some(RateLimitOverride {
            requests_per_unit: 2,
            unit: 3, // hour
        });
        req
    };
    for _ in 0..2 {
        assert!(is_ok(&call(&mut c, overridden()).await));
    }
    assert!(is_over(&call(&mut c, overridden()).await));
    let reset = admin
        .reset_counters(counter_request("k", "o"))
        .await
        .unwrap()
        .into_inner()
        .reset;
    assert!(reset >= 1, "the override's counter was held: {reset}");
    assert!(is_ok(&call(&mut c, overridden()).await), "unblocked");
}

every_backend!(
    inspect_and_reset_counters,
    a_reset_unblocks_a_client_over_its_own_limit_override
);

#[tokio::test]
async fn the_admin_api_is_off_unless_asked_for() {
    let s = start(Kind::Memory, &[("a.yaml", LIMITS)], &[]).await;
    let _ = s.client().await;
    let mut admin = AdminClient::connect(format!("http://{}", s.grpc))
        .await
        .unwrap();
    let err = admin
        .reset_counters(counter_request("k", "v"))
        .await
        .unwrap_err();
    assert_eq!(err.code(), tonic::Code::Unimplemented);
}
