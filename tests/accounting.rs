//! Usage known after the response: cost reports (a descriptor's own `hits_addend` > 0, what
//! Envoy sends when a stream is done) recorded past the limit as bounded debt, refunds
//! (`is_negative_hits`), and the choice between admission and report, on every backend and
//! every algorithm. Windows are 1000 days unless a test needs them to pass, so no boundary falls
//! between the calls of a test.

mod common;

use std::time::Duration;

use tokio::time::Instant;

use common::*;
use envoy_types::pb::envoy::service::ratelimit::v3::RateLimitRequest;
use ratelimitd::testing::Algorithm;

const LONG: &str = "unit: day, unit_multiplier: 1000";

/// Domain `b`: one key per algorithm (`fixed_window`, …), each limited to `rpu` per window, with
/// `extra` in each limit.
fn budgets(rpu: u64, window: &str, extra: &str) -> String {
    let keys: String = Algorithm::ALL
        .map(|a| {
            format!(
                "  - key: {a}\n    rate_limit: {{{window}, requests_per_unit: {rpu}, algorithm: {a}{extra}}}\n"
            )
        })
        .concat();
    format!("domain: b\ndescriptors:\n{keys}")
}

/// A check-only request on `key` (its own `hits_addend: 0`).
fn check(key: &str, value: &str) -> RateLimitRequest {
    with_hits(request("b", &[&[(key, value)]]), 0, 0)
}

/// A cost report of `units` on `key`.
fn report(key: &str, value: &str, units: u64) -> RateLimitRequest {
    with_hits(request("b", &[&[(key, value)]]), 0, units)
}

/// A refund of `units` on `key`.
fn refund(key: &str, value: &str, units: u64) -> RateLimitRequest {
    let mut req = with_hits(request("b", &[&[(key, value)]]), 0, units);
    req.descriptors[0].is_negative_hits = true;
    req
}

/// What a check on `key` finds left (0 when over).
async fn left(c: &mut Client, key: &str, value: &str) -> u32 {
    call(c, check(key, value)).await.statuses[0].limit_remaining
}

/// Rounds of "check, then report `units`" (the AI Gateway's token budget): how many checks
/// passed out of `rounds`.
async fn budget_rounds(c: &mut Client, key: &str, units: u64, rounds: usize) -> usize {
    let mut admitted = 0;
    for _ in 0..rounds {
        if is_ok(&call(c, check(key, "t")).await) {
            admitted += 1;
            call(c, report(key, "t", units)).await;
        }
    }
    admitted
}

/// 10 000 tokens with responses of 4 000: three requests pass, the third's report takes the
/// budget over and is recorded, and every later check is refused. Before reports were
/// recorded, every request after the second passed.
async fn a_token_budget_admits_as_many_requests_as_it_allows(kind: Kind) {
    let yaml = budgets(10_000, LONG, "");
    let s = start(kind, &[("b.yaml", &yaml)], &["--reference-metrics"]).await;
    let mut c = s.client().await;
    for a in Algorithm::ALL.map(Algorithm::as_str) {
        assert_eq!(budget_rounds(&mut c, a, 4_000, 8).await, 3, "{kind:?} {a}");
        let r = call(&mut c, check(a, "t")).await;
        assert!(is_over(&r), "{kind:?} {a}: {r:?}");
        assert_eq!(r.statuses[0].limit_remaining, 0);
    }
    // Each over-limit report is counted, in hits.
    let (_, m) = s.http_get("/metrics").await;
    for a in Algorithm::ALL.map(Algorithm::as_str) {
        let series = format!(
            "ratelimit_accounted_hits_total{{domain=\"b\",rule=\"{a}\",kind=\"report_over_limit\"}}"
        );
        assert_eq!(metric(&m, &series), 4_000.0, "{kind:?} {a}\n{m}");
        // As envoyproxy/ratelimit counts them: of 8,000 + 4,000, the 2,000 past the limit are
        // over, the 2,000 below it past the near threshold (8,000) near.
        for (family, n) in [("over_limit", 2_000.0), ("near_limit", 2_000.0)] {
            let series =
                format!("ratelimit_service_rate_limit_{family}{{domain=\"b\",key1=\"{a}\"}}");
            assert_eq!(metric(&m, &series), n, "{kind:?} {a} {family}\n{m}");
        }
    }
}

/// A report that names two budgets charges both, though it takes one of them over.
async fn a_report_naming_two_budgets_charges_both(kind: Kind) {
    let yaml = format!(
        "domain: b\ndescriptors:\n  - key: small\n    rate_limit: {{{LONG}, requests_per_unit: 100, algorithm: token_bucket}}\n  - key: large\n    rate_limit: {{{LONG}, requests_per_unit: 1000, algorithm: sliding_window}}\n"
    );
    let s = start(kind, &[("b.yaml", &yaml)], &[]).await;
    let mut c = s.client().await;
    let mut both = request("b", &[&[("small", "t")], &[("large", "t")]]);
    both = with_hits(with_hits(both, 0, 150), 1, 150);
    let r = call(&mut c, both).await;
    assert!(is_over(&r), "{kind:?}: small is over: {r:?}");
    assert_eq!(r.statuses[1].limit_remaining, 850, "{kind:?}");
    assert_eq!(left(&mut c, "large", "t").await, 850, "{kind:?}: charged");
    assert!(
        is_over(&call(&mut c, check("small", "t")).await),
        "{kind:?}"
    );
}

/// Envoy Gateway with only `cost.response`: each request is a plain admission (1 hit), and its
/// response reports 30. On a limit of 100, four rounds pass: 31, 62, 93, then 94 + 30 = 124.
async fn a_response_cost_alone_is_charged_after_each_request(kind: Kind) {
    let s = start(kind, &[("b.yaml", &budgets(100, LONG, ""))], &[]).await;
    let mut c = s.client().await;
    for a in Algorithm::ALL.map(Algorithm::as_str) {
        let mut rounds = 0;
        for _ in 0..8 {
            if is_ok(&call(&mut c, request("b", &[&[(a, "r")]])).await) {
                rounds += 1;
                call(&mut c, report(a, "r", 30)).await;
            }
        }
        assert_eq!(rounds, 4, "{kind:?} {a}");
    }
}

/// A refused request still consumes nothing of its admissions, on any descriptor; a report in
/// the same refused request is recorded (the usage happened).
async fn a_refused_admission_consumes_nothing_but_its_reports_count(kind: Kind) {
    let s = start(kind, &[("b.yaml", &budgets(10, LONG, ""))], &[]).await;
    let mut c = s.client().await;
    let tight = "fixed_window";
    for roomy in ["sliding_window", "sliding_log", "token_bucket"] {
        let pair = || request("b", &[&[(tight, roomy)], &[(roomy, "x")]]);
        let filled = weighted(request("b", &[&[(tight, roomy)]]), 10);
        assert!(is_ok(&call(&mut c, filled).await), "{kind:?}");
        for _ in 0..3 {
            assert!(is_over(&call(&mut c, pair()).await), "{kind:?}");
        }
        assert_eq!(left(&mut c, roomy, "x").await, 10, "{kind:?} {roomy}");
        let r = call(&mut c, with_hits(pair(), 1, 4)).await;
        assert!(is_over(&r), "{kind:?}");
        assert_eq!(
            left(&mut c, roomy, "x").await,
            6,
            "{kind:?} {roomy}: reported"
        );
    }
}

/// Refunds give back exactly what was taken, never more than the limit (no credit on an
/// unused counter), debt included; a request mixing a refund and hits is decided in one piece,
/// the refund first.
async fn refunds_restore_what_was_taken_and_never_more(kind: Kind) {
    let s = start(kind, &[("b.yaml", &budgets(10, LONG, ""))], &[]).await;
    let mut c = s.client().await;
    for a in Algorithm::ALL.map(Algorithm::as_str) {
        assert!(is_ok(
            &call(&mut c, weighted(request("b", &[&[(a, "f")]]), 6)).await
        ));
        assert_eq!(left(&mut c, a, "f").await, 4, "{kind:?} {a}");
        let r = call(&mut c, refund(a, "f", 2)).await;
        assert!(is_ok(&r), "{kind:?} {a}: {r:?}");
        assert_eq!(r.statuses[0].limit_remaining, 6, "{kind:?} {a}");
        assert_eq!(left(&mut c, a, "f").await, 6, "{kind:?} {a}: 2 given back");
        call(&mut c, refund(a, "f", 1_000)).await;
        assert_eq!(left(&mut c, a, "f").await, 10, "{kind:?} {a}: no credit");
        call(&mut c, refund(a, "unused", 5)).await;
        admits_exactly(&mut c, &weighted(request("b", &[&[(a, "unused")]]), 5), 2).await;
        // Full: a refund and an admission in one request, the refund first.
        assert!(is_ok(
            &call(&mut c, weighted(request("b", &[&[(a, "f")]]), 10)).await
        ));
        let mut mixed = request("b", &[&[(a, "f")], &[(a, "f")]]);
        mixed.descriptors[0].is_negative_hits = true;
        let r = call(&mut c, weighted(mixed, 3)).await;
        assert!(is_ok(&r), "{kind:?} {a}: {r:?}");
        assert!(is_over(&call(&mut c, check(a, "f")).await), "{kind:?} {a}");
        // Debt is given back too.
        call(&mut c, report(a, "d", 15)).await;
        assert!(is_over(&call(&mut c, check(a, "d")).await), "{kind:?} {a}");
        call(&mut c, refund(a, "d", 6)).await;
        assert_eq!(left(&mut c, a, "d").await, 1, "{kind:?} {a}");
    }
    let (_, m) = s.http_get("/metrics").await;
    let series =
        "ratelimit_accounted_hits_total{domain=\"b\",rule=\"token_bucket\",kind=\"refund\"}";
    assert_eq!(metric(&m, series), 1_016.0, "{kind:?}\n{m}");
    // A refund is no decision, not even one of 0 hits.
    let decided = |m: &str| -> f64 {
        ["within_limit", "near_limit", "over_limit"]
            .iter()
            .map(|d| {
                metric(
                    m,
                    &format!("ratelimit_decisions_total{{domain=\"b\",rule=\"token_bucket\",decision=\"{d}\"}}"),
                )
            })
            .sum()
    };
    call(&mut c, refund("token_bucket", "f", 0)).await;
    let (_, after) = s.http_get("/metrics").await;
    assert_eq!(decided(&after), decided(&m), "{kind:?}\n{after}");
}

/// A report of 2^64 - 1 hits overflows nothing and takes a limit at most one limit's worth past
/// it (`--max-debt 1`): one unit given back less than that still finds it over. With
/// `--max-debt 0` it fills the limit and no more.
async fn a_huge_report_is_bounded(kind: Kind) {
    for (debt, over_after_refund) in [("1", true), ("0", false)] {
        let files = [("b.yaml", budgets(10, LONG, ""))];
        let files: Vec<(&str, &str)> = files.iter().map(|(n, t)| (*n, t.as_str())).collect();
        let s = start(kind, &files, &["--max-debt", debt]).await;
        let mut c = s.client().await;
        for a in Algorithm::ALL.map(Algorithm::as_str) {
            let r = call(&mut c, report(a, "h", u64::MAX)).await;
            assert!(is_over(&r), "{kind:?} {a}");
            assert!(is_over(&call(&mut c, check(a, "h")).await), "{kind:?} {a}");
            call(&mut c, refund(a, "h", 9)).await;
            let after = call(&mut c, check(a, "h")).await;
            assert_eq!(
                is_over(&after),
                over_after_refund,
                "{kind:?} {a} debt {debt}"
            );
            call(&mut c, refund(a, "h", 2)).await;
            let r = call(&mut c, check(a, "h")).await;
            assert!(is_ok(&r), "{kind:?} {a} debt {debt}: {r:?}");
        }
    }
}

/// With windows of 2 s, a report of 2^64 - 1 hits closes each limit for a bounded time: over
/// at once, admitting again within the bound stated for its algorithm (at most about two
/// windows) plus slack for a loaded machine. (A fixed window's check may fall in the next
/// window, where the debt is gone by design: only the report's own answer is asserted there.)
async fn a_huge_report_closes_a_limit_for_a_bounded_time(kind: Kind) {
    let s = start(
        kind,
        &[(
            "b.yaml",
            &budgets(10, "unit: second, unit_multiplier: 2", ""),
        )],
        &[],
    )
    .await;
    let mut c = s.client().await;
    for a in Algorithm::ALL.map(Algorithm::as_str) {
        let started = Instant::now();
        assert!(is_over(&call(&mut c, report(a, "h", u64::MAX)).await));
        if a != "fixed_window" {
            assert!(is_over(&call(&mut c, check(a, "h")).await), "{kind:?} {a}");
        }
        poll(Duration::from_secs(15), || {
            let mut c = c.clone();
            async move { is_ok(&call(&mut c, check(a, "h")).await).then_some(()) }
        })
        .await;
        eprintln!(
            "{kind:?} {a}: admitting again after {:?}",
            started.elapsed()
        );
    }
}

every_backend!(
    a_token_budget_admits_as_many_requests_as_it_allows,
    a_report_naming_two_budgets_charges_both,
    a_response_cost_alone_is_charged_after_each_request,
    a_refused_admission_consumes_nothing_but_its_reports_count,
    refunds_restore_what_was_taken_and_never_more,
    a_huge_report_is_bounded,
    a_huge_report_closes_a_limit_for_a_bounded_time,
);

/// `accounting` on a limit, in a file, wins over the server's; the server's (`--accounting`)
/// applies to every limit that sets none.
#[tokio::test]
async fn accounting_chosen_per_limit_or_for_the_whole_server() {
    let yaml = format!(
        "domain: b\ndescriptors:\n  - key: admit\n    rate_limit: {{{LONG}, requests_per_unit: 10, accounting: admission}}\n  - key: record\n    rate_limit: {{{LONG}, requests_per_unit: 10, accounting: report}}\n  - key: plain\n    rate_limit: {{{LONG}, requests_per_unit: 10}}\n"
    );
    let s = start(Kind::Memory, &[("b.yaml", &yaml)], &[]).await;
    let mut c = s.client().await;
    // `admission`: a descriptor's own hits_addend over the limit is refused and consumes nothing.
    assert!(is_over(&call(&mut c, report("admit", "x", 11)).await));
    assert_eq!(left(&mut c, "admit", "x").await, 10);
    // `report`: a plain request over the limit is recorded anyway.
    assert!(is_over(
        &call(&mut c, weighted(request("b", &[&[("record", "x")]]), 11)).await
    ));
    assert!(is_over(&call(&mut c, check("record", "x")).await));

    let s = start(
        Kind::Memory,
        &[("b.yaml", &yaml)],
        &["--accounting", "report"],
    )
    .await;
    let mut c = s.client().await;
    assert!(is_over(
        &call(&mut c, weighted(request("b", &[&[("plain", "x")]]), 11)).await
    ));
    assert!(
        is_over(&call(&mut c, check("plain", "x")).await),
        "recorded"
    );
    assert!(is_over(&call(&mut c, report("admit", "x", 11)).await));
    assert_eq!(left(&mut c, "admit", "x").await, 10, "the limit's own wins");

    let s = start(
        Kind::Memory,
        &[("b.yaml", &yaml)],
        &["--accounting", "admission"],
    )
    .await;
    let mut c = s.client().await;
    assert!(is_over(&call(&mut c, report("plain", "x", 11)).await));
    assert_eq!(left(&mut c, "plain", "x").await, 10, "not recorded");
}

/// envoyproxy/ratelimit's `STOP_CACHE_KEY_INCREMENT_WHEN_OVERLIMIT=true`: nothing past a limit
/// is recorded, reports included (as that service documents), so a token budget of 10 000 with
/// reports of 4 000 admits every check; `false` (its default) leaves the default accounting.
#[tokio::test]
async fn the_reference_stop_increment_variable_behaves_as_documented() {
    let yaml = budgets(10_000, LONG, "");
    for (value, admitted) in [("true", 8), ("false", 3)] {
        let s = TestServer::start_with_env(
            &[("b.yaml", &yaml)],
            &[],
            &[("STOP_CACHE_KEY_INCREMENT_WHEN_OVERLIMIT", value)],
        )
        .await;
        let mut c = s.client().await;
        for a in Algorithm::ALL.map(Algorithm::as_str) {
            assert_eq!(
                budget_rounds(&mut c, a, 4_000, 8).await,
                admitted,
                "{value} {a}"
            );
        }
    }
}

/// Headers on a check after a report show nothing left and the real reset: the end of the
/// fixed window, or when a token bucket's debt is paid off.
#[tokio::test]
async fn headers_after_a_report_show_nothing_left_and_the_real_reset() {
    let yaml = "domain: b\ndescriptors:\n  - key: fixed\n    rate_limit: {unit: hour, requests_per_unit: 100}\n  - key: bucket\n    rate_limit: {unit: hour, requests_per_unit: 3600, algorithm: token_bucket}\n";
    let s = start(
        Kind::Memory,
        &[("b.yaml", yaml)],
        &["--response-headers", "draft03"],
    )
    .await;
    let mut c = s.client().await;
    let header = |r: &envoy_types::pb::envoy::service::ratelimit::v3::RateLimitResponse,
                  name: &str| {
        r.response_headers_to_add
            .iter()
            .find(|h| h.key.eq_ignore_ascii_case(name))
            .map(|h| h.value.clone())
            .unwrap_or_else(|| panic!("{name} in {r:?}"))
    };
    call(&mut c, report("fixed", "h", 150)).await;
    let r = call(&mut c, check("fixed", "h")).await;
    assert!(is_over(&r));
    assert_eq!(header(&r, "X-RateLimit-Remaining"), "0");
    let reset: u64 = header(&r, "X-RateLimit-Reset").parse().unwrap();
    let window_left = 3600 - std::time::UNIX_EPOCH.elapsed().unwrap().as_secs() % 3600;
    assert!(reset.abs_diff(window_left) <= 2, "{reset} vs {window_left}");
    // One token a second: 3600 + 600 taken from a full bucket is 600 tokens of debt, 601 s to
    // the next token.
    call(&mut c, report("bucket", "h", 4_200)).await;
    let r = call(&mut c, check("bucket", "h")).await;
    assert_eq!(header(&r, "X-RateLimit-Remaining"), "0");
    let reset: u64 = header(&r, "X-RateLimit-Reset").parse().unwrap();
    assert!((599..=601).contains(&reset), "{reset}");
}

/// The token-budget example: every `@type` names a message of Envoy's own protos, each route
/// rate limit's fields are those of Envoy's `RateLimit` (read into it), and its timeline
/// (a check at the request, the response's tokens reported when the stream is done) against
/// the example limits admits exactly as many requests as the budget allows.
#[tokio::test]
async fn the_token_budget_example_meets_envoys_protos_and_holds() {
    use envoy_types::pb::envoy::extensions::filters::http::lua::v3::Lua;
    use envoy_types::pb::envoy::extensions::filters::http::ratelimit::v3::RateLimit as Filter;
    use envoy_types::pb::envoy::extensions::filters::http::ratelimit::v3::RateLimitPerRoute;
    use envoy_types::pb::envoy::extensions::filters::http::router::v3::Router;
    use envoy_types::pb::envoy::extensions::filters::network::http_connection_manager::v3::HttpConnectionManager;
    use envoy_types::pb::envoy::extensions::upstreams::http::v3::HttpProtocolOptions;
    use envoy_types::pb::google::protobuf::UInt64Value;
    use prost::Name;

    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let text = std::fs::read_to_string(root.join("examples/envoy/token-budget.yaml")).unwrap();
    let known = [
        HttpConnectionManager::type_url(),
        Lua::type_url(),
        Filter::type_url(),
        RateLimitPerRoute::type_url(),
        Router::type_url(),
        HttpProtocolOptions::type_url(),
    ];
    assert_eq!(envoy_types_in(&text, &known), 6);
    let doc: serde_json::Value = serde_saphyr::from_str(&text).unwrap();
    let hcm =
        &doc["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"];
    let filters = hcm["http_filters"].as_array().unwrap();
    let domain = filters[1]["typed_config"]["domain"].as_str().unwrap();
    // The filter's per-route config (RateLimitPerRoute): the only place Envoy honours
    // hits_addend. Each rate limit, read into Envoy's message field by field: a field Envoy
    // does not have is refused here.
    let route = &hcm["route_config"]["virtual_hosts"][0]["routes"][0];
    let per_route = &route["typed_per_filter_config"]["envoy.filters.http.ratelimit"];
    let limits: Vec<_> = per_route["rate_limits"]
        .as_array()
        .unwrap()
        .iter()
        .map(route_rate_limit)
        .collect();
    let [check, report] = &limits[..] else {
        panic!("two rate limits")
    };
    assert!(!check.apply_on_stream_done);
    assert_eq!(
        check.hits_addend.as_ref().unwrap().number,
        Some(UInt64Value { value: 0 })
    );
    assert!(report.apply_on_stream_done);
    let format = &report.hits_addend.as_ref().unwrap().format;
    let lua = filters[0]["typed_config"]["default_source_code"]["inline_string"]
        .as_str()
        .unwrap();
    // The metadata the Lua filter sets is the metadata the report reads.
    assert_eq!(format, "%DYNAMIC_METADATA(example.tokens:used)%");
    assert!(
        lua.contains(r#"dynamicMetadata():set("example.tokens", "used""#),
        "{lua}"
    );

    // The timeline against the example limits: Envoy's two calls per request.
    let dir = tempfile::tempdir().unwrap();
    let examples = root.join("examples/envoy/limits");
    let s = TestServer::start_at(
        dir,
        Some(examples),
        &[],
        std::sync::Arc::new(ratelimitd::testing::SystemClock),
    )
    .await;
    let mut c = s.client().await;
    let tenant: &[&[(&str, &str)]] = &[&[("tenant", "acme")]];
    let mut admitted = 0;
    for _ in 0..6 {
        if is_ok(&call(&mut c, with_hits(request(domain, tenant), 0, 0)).await) {
            admitted += 1;
            call(&mut c, with_hits(request(domain, tenant), 0, 4_000)).await;
        }
    }
    assert_eq!(admitted, 3, "10,000 tokens a day, 4,000 per response");
}
