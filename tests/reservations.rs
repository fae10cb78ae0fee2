//! Reservations: a request reserves an estimate as an all-or-nothing admission, and when its
//! stream is done one call gives the estimate back and charges what was used. Driven with
//! concurrent requests on every algorithm and every backend (memory, Redis, Cluster with either
//! hash tag), and the example (examples/envoy/reservations.yaml) read against Envoy's protos
//! and run against its limits. docs/configuration.md, "Reservations", explains the pattern.

mod common;

use std::time::Duration;

use common::*;
use envoy_types::pb::envoy::service::ratelimit::v3::RateLimitRequest;
use envoy_types::pb::google::protobuf::UInt64Value;
use futures_util::future::join_all;

/// A request of `domain` reserving `estimate` for [`key`=tenant]: the request's own
/// `hits_addend` (what Envoy sends from the filter state `envoy.ratelimit.hits_addend`), the
/// descriptor carrying none: an admission.
fn reserve(domain: &str, key: &str, estimate: u32) -> RateLimitRequest {
    weighted(request(domain, &[&[(key, "tenant")]]), estimate)
}

/// The stream-done call settling a reservation of `estimate` that used `used`: the estimate
/// given back (`is_negative_hits`) and the usage charged (a cost report), one call, as Envoy
/// sends the route's `apply_on_stream_done` rate limits.
fn settle(domain: &str, key: &str, estimate: u64, used: u64) -> RateLimitRequest {
    let mut req = request(domain, &[&[(key, "tenant")], &[(key, "tenant")]]);
    req.hits_addend = estimate as u32;
    req.descriptors[0].hits_addend = Some(UInt64Value { value: estimate });
    req.descriptors[0].is_negative_hits = true;
    req.descriptors[1].hits_addend = Some(UInt64Value { value: used });
    req
}

/// How many of `reqs`, sent all at once on their own calls, are admitted.
async fn admitted_together(c: &Client, reqs: Vec<RateLimitRequest>) -> usize {
    let calls = reqs.into_iter().map(|req| {
        let mut c = c.clone();
        async move {
            tokio::time::timeout(Duration::from_secs(10), call(&mut c, req))
                .await
                .expect("answered")
        }
    });
    join_all(calls).await.iter().filter(|r| is_ok(r)).count()
}

const CONFIG: &str = "domain: reserve
descriptors:
  - key: fixed_window
    rate_limit: {unit: day, unit_multiplier: 1000, requests_per_unit: 10000}
  - key: sliding_window
    rate_limit: {unit: day, unit_multiplier: 1000, requests_per_unit: 10000, algorithm: sliding_window}
  - key: sliding_log
    rate_limit: {unit: day, unit_multiplier: 1000, requests_per_unit: 10000, algorithm: sliding_log}
  - key: token_bucket
    rate_limit: {unit: day, unit_multiplier: 1000, requests_per_unit: 10000, algorithm: token_bucket}
";

/// 20 concurrent reservations of 1,000 against 10,000 admit exactly 10; settled at 600 each
/// (6,000 used), the budget reads 4,000 left in one `/json` call, and of 20 more concurrent
/// reservations exactly 4 fit. (Windows of 1,000 days: none ends within the test; the token
/// bucket refills 10 a day.)
async fn reservations_hold_under_concurrency(kind: Kind) {
    let s = start(kind, &[("reserve.yaml", CONFIG)], &[]).await;
    let c = s.client().await;
    for key in [
        "fixed_window",
        "sliding_window",
        "sliding_log",
        "token_bucket",
    ] {
        let first = (0..20).map(|_| reserve("reserve", key, 1_000)).collect();
        assert_eq!(admitted_together(&c, first).await, 10, "{kind:?} {key}");
        let settled = (0..10)
            .map(|_| settle("reserve", key, 1_000, 600))
            .collect();
        admitted_together(&c, settled).await;

        // The budget in one call: a check (hits_addend 0) says what is left, of how much, and
        // when it resets.
        let body = format!(
            r#"{{"domain":"reserve","descriptors":[{{"entries":[{{"key":"{key}","value":"tenant"}}],"hitsAddend":"0"}}]}}"#
        );
        let (status, json) = post_json(s.http, &body).await;
        assert_eq!(status, 200, "{kind:?} {key}: {json}");
        let v: serde_json::Value = serde_json::from_str(&json).unwrap();
        let st = &v["statuses"][0];
        assert_eq!(st["limitRemaining"], 4_000, "{kind:?} {key}: {json}");
        assert_eq!(st["currentLimit"]["requestsPerUnit"], 10_000, "{json}");
        assert!(st["durationUntilReset"].is_string(), "{json}");

        let second = (0..20).map(|_| reserve("reserve", key, 1_000)).collect();
        assert_eq!(admitted_together(&c, second).await, 4, "{kind:?} {key}");
    }
}

every_backend!(reservations_hold_under_concurrency);

/// The example: every `@type` names a message of Envoy's own protos, the fields it sets are
/// those of Envoy's messages (read into them), the filter state it sets is the one Envoy's
/// rate limit filter reads, and its timeline against the example's limits holds: reservations
/// admitted together never exceed the budget, and a settled reservation frees what it did not
/// use.
#[tokio::test]
async fn the_reservations_example_meets_envoys_protos_and_holds() {
    use envoy_types::pb::envoy::config::core::v3::data_source::Specifier;
    use envoy_types::pb::envoy::config::core::v3::substitution_format_string::Format;
    use envoy_types::pb::envoy::config::core::v3::{DataSource, SubstitutionFormatString};
    use envoy_types::pb::envoy::extensions::filters::common::set_filter_state::v3::FilterStateValue;
    use envoy_types::pb::envoy::extensions::filters::common::set_filter_state::v3::filter_state_value::{
        Key, Value,
    };
    use envoy_types::pb::envoy::extensions::filters::http::lua::v3::Lua;
    use envoy_types::pb::envoy::extensions::filters::http::ratelimit::v3::{
        RateLimit as Filter, RateLimitPerRoute,
    };
    use envoy_types::pb::envoy::extensions::filters::http::router::v3::Router;
    use envoy_types::pb::envoy::extensions::filters::http::set_filter_state::v3::Config as SetFilterState;
    use envoy_types::pb::envoy::extensions::filters::network::http_connection_manager::v3::HttpConnectionManager;
    use envoy_types::pb::envoy::extensions::upstreams::http::v3::HttpProtocolOptions;
    use prost::Name;

    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let text = std::fs::read_to_string(root.join("examples/envoy/reservations.yaml")).unwrap();
    let known = [
        HttpConnectionManager::type_url(),
        SetFilterState::type_url(),
        Lua::type_url(),
        Filter::type_url(),
        RateLimitPerRoute::type_url(),
        Router::type_url(),
        HttpProtocolOptions::type_url(),
    ];
    assert_eq!(envoy_types_in(&text, &known), 7);
    let doc: serde_json::Value = serde_saphyr::from_str(&text).unwrap();
    let hcm =
        &doc["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"];
    let filters = hcm["http_filters"].as_array().unwrap();
    let names: Vec<&str> = filters
        .iter()
        .map(|f| f["name"].as_str().unwrap())
        .collect();
    assert_eq!(
        names,
        [
            "envoy.filters.http.lua",
            "envoy.filters.http.set_filter_state",
            "envoy.filters.http.ratelimit",
            "envoy.filters.http.router"
        ],
        "the estimate is made whole before the filter state takes it, and the filter state is \
         set before the rate limit filter reads it"
    );
    let domain = filters[2]["typed_config"]["domain"].as_str().unwrap();

    // The estimate into the filter state Envoy's rate limit filter reads as the request's
    // hits_addend, read into Envoy's message field by field.
    let states: Vec<FilterStateValue> = filters[1]["typed_config"]["on_request_headers"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| {
            let mut state = FilterStateValue::default();
            for (field, value) in v.as_object().unwrap() {
                match field.as_str() {
                    "object_key" => {
                        state.key = Some(Key::ObjectKey(value.as_str().unwrap().into()))
                    }
                    "format_string" => {
                        // A SubstitutionFormatString whose one field is text_format_source, a
                        // DataSource whose one field is inline_string.
                        assert_eq!(value.as_object().unwrap().len(), 1, "{value}");
                        let source = value["text_format_source"].as_object().unwrap();
                        assert_eq!(source.len(), 1, "{value}");
                        let inline = source["inline_string"].as_str().unwrap().to_owned();
                        state.value = Some(Value::FormatString(SubstitutionFormatString {
                            format: Some(Format::TextFormatSource(DataSource {
                                specifier: Some(Specifier::InlineString(inline)),
                                ..Default::default()
                            })),
                            ..Default::default()
                        }));
                    }
                    other => panic!("FilterStateValue field {other} is not used here"),
                }
            }
            state
        })
        .collect();
    assert_eq!(
        states[0].key,
        Some(Key::ObjectKey("envoy.ratelimit.hits_addend".into()))
    );
    let Some(Value::FormatString(format)) = &states[0].value else {
        panic!("a format string")
    };
    let Some(Format::TextFormatSource(DataSource {
        specifier: Some(Specifier::InlineString(estimate)),
        ..
    })) = &format.format
    else {
        panic!("an inline text format")
    };
    assert_eq!(estimate, "%REQ(x-max-tokens)%");

    // The route's rate limits, read into Envoy's messages.
    let route = &hcm["route_config"]["virtual_hosts"][0]["routes"][0];
    let per_route = &route["typed_per_filter_config"]["envoy.filters.http.ratelimit"];
    let limits: Vec<_> = per_route["rate_limits"]
        .as_array()
        .unwrap()
        .iter()
        .map(route_rate_limit)
        .collect();
    let per_route_message = RateLimitPerRoute {
        rate_limits: limits.clone(),
        ..Default::default()
    };
    let [reservation, give_back, charge] = &per_route_message.rate_limits[..] else {
        panic!("three rate limits")
    };
    // Each names its request's hold last: the request id, budgets.yaml's hold_key.
    for limit in [reservation, give_back, charge] {
        use envoy_types::pb::envoy::config::route::v3::rate_limit::action::ActionSpecifier;
        let Some(ActionSpecifier::RequestHeaders(last)) = limit
            .actions
            .last()
            .and_then(|a| a.action_specifier.as_ref())
        else {
            panic!("a request_headers action last: {limit:?}")
        };
        assert_eq!(
            (last.header_name.as_str(), last.descriptor_key.as_str()),
            ("x-request-id", "request_id")
        );
    }
    assert!(!reservation.apply_on_stream_done && reservation.hits_addend.is_none());
    assert!(give_back.apply_on_stream_done && charge.apply_on_stream_done);
    let give_back = give_back.hits_addend.as_ref().unwrap();
    assert!(give_back.is_negative_hits);
    assert_eq!(
        give_back.format, "%REQ(x-max-tokens)%",
        "the estimate reserved"
    );
    let charge = charge.hits_addend.as_ref().unwrap();
    assert!(!charge.is_negative_hits);
    let lua = filters[0]["typed_config"]["default_source_code"]["inline_string"]
        .as_str()
        .unwrap();
    assert_eq!(charge.format, "%DYNAMIC_METADATA(example.tokens:used)%");
    assert!(
        lua.contains(r#"dynamicMetadata():set("example.tokens", "used""#),
        "{lua}"
    );
    // An estimate Envoy cannot read as a whole number is the most a request may cost, in the
    // header both of Envoy's reads take it from.
    assert!(
        lua.contains(r#"handle:headers():replace("x-max-tokens", estimate)"#),
        "{lua}"
    );

    // The timeline against the example limits: 1,000,000 tokens a month per tenant.
    let dir = tempfile::tempdir().unwrap();
    let s = TestServer::start_at(
        dir,
        Some(root.join("examples/envoy/limits")),
        &[],
        std::sync::Arc::new(ratelimitd::testing::SystemClock),
    )
    .await;
    let c = s.client().await;
    // Envoy's descriptors: [tenant=acme, request_id=<x-request-id>].
    let held = |mut req: RateLimitRequest, id: &str| {
        for d in &mut req.descriptors {
            d.entries
                .push(desc(&[("request_id", id)]).entries.remove(0));
        }
        req
    };
    let reserve = |id: &str| held(reserve(domain, "tenant", 400_000), id);
    let ids = ["r1", "r2", "r3"];
    let first: Vec<_> = ids.iter().map(|id| reserve(id)).collect();
    let resp = futures_util::future::join_all(first.into_iter().map(|req| {
        let mut c = c.clone();
        async move { call(&mut c, req).await }
    }))
    .await;
    let admitted: Vec<&str> = ids
        .iter()
        .zip(&resp)
        .filter(|(_, r)| is_ok(r))
        .map(|(id, _)| *id)
        .collect();
    assert_eq!(
        admitted.len(),
        2,
        "two reservations of 400,000 fit in 1,000,000, three do not"
    );
    // Every stream is done, the refused one's too: its give-back names a hold that holds
    // nothing.
    let settled = ids
        .iter()
        .map(|id| held(settle(domain, "tenant", 400_000, 100_000), id))
        .filter(|req| {
            admitted
                .iter()
                .any(|id| req.descriptors[0].entries[1].value == *id)
        })
        .chain(
            ids.iter()
                .filter(|id| !admitted.contains(id))
                .map(|id| held(settle(domain, "tenant", 400_000, 0), id)),
        )
        .collect();
    admitted_together(&c, settled).await;
    let next: Vec<_> = ["n1", "n2", "n3"].iter().map(|id| reserve(id)).collect();
    assert_eq!(
        admitted_together(&c, next).await,
        2,
        "800,000 left after two responses of 100,000"
    );
}
