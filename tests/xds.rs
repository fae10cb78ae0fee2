//! The config over xDS, against a small ADS server the tests run on loopback: it keeps one
//! snapshot (a version and its `RateLimitConfig`s), pushes it to every open stream when it
//! changes, can resend a refused snapshot at once as go-control-plane's cache does, and records
//! every request it receives.

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use common::ads::*;
use common::*;
use envoy_types::pb::google::protobuf::Any;
use ratelimitd::testing::rls_conf as pb;
use ratelimitd::testing::{SystemClock, XDS_TYPE_URL};
use tokio::net::TcpListener;

/// `d` with `metadata: {ratelimitd: {<fields>}}`, as a control plane sets our extensions.
fn with_extensions<const N: usize>(
    mut d: pb::RateLimitDescriptor,
    fields: [(&str, envoy_types::pb::google::protobuf::value::Kind); N],
) -> pb::RateLimitDescriptor {
    use envoy_types::pb::google::protobuf::{Struct, Value, value::Kind};
    let extensions = Struct {
        fields: fields
            .into_iter()
            .map(|(k, v)| (k.to_owned(), Value { kind: Some(v) }))
            .collect(),
    };
    d.metadata = Some(Struct {
        fields: [(
            "ratelimitd".to_owned(),
            Value {
                kind: Some(Kind::StructValue(extensions)),
            },
        )]
        .into(),
    });
    d
}

fn limit(key: &str, rpu: u32, unit: pb::RateLimitUnit) -> pb::RateLimitDescriptor {
    pb::RateLimitDescriptor {
        key: key.into(),
        rate_limit: Some(pb::RateLimitPolicy {
            unit: unit as i32,
            requests_per_unit: rpu,
            ..Default::default()
        }),
        ..Default::default()
    }
}

fn config(domain: &str, descriptors: Vec<pb::RateLimitDescriptor>) -> pb::RateLimitConfig {
    pb::RateLimitConfig {
        name: domain.into(),
        domain: domain.into(),
        descriptors,
    }
}

/// A server on `flags` and `extra`, with no config files.
async fn server_with(mut flags: Vec<String>, extra: &[&str]) -> TestServer {
    flags.extend(extra.iter().map(|s| s.to_string()));
    let flags: Vec<&str> = flags.iter().map(String::as_str).collect();
    TestServer::start_with(&[], &flags, Arc::new(SystemClock)).await
}

async fn server(ads: &AdsServer, extra: &[&str]) -> TestServer {
    server_with(ads.flags(), extra).await
}

/// Waits until a check-only call on `domain` (key `k`) is answered at all: the first config
/// has arrived.
async fn until_answered(c: &Client, domain: &str, within: Duration) {
    poll(within, || {
        let mut c = c.clone();
        async move {
            let r = c.should_rate_limit(with_hits(request(domain, &[&[("k", "v")]]), 0, 0));
            r.await.ok()
        }
    })
    .await;
}

/// The configured requests_per_unit for `key`, checked without consuming.
async fn rpu(c: &mut Client, domain: &str, key: &str) -> Option<u32> {
    rpu_of(
        &call(c, with_hits(request(domain, &[&[(key, "v")]]), 0, 0)).await,
        0,
    )
}

async fn until_rpu(c: &Client, domain: &str, key: &str, want: Option<u32>) {
    poll(Duration::from_secs(10), || {
        let mut c = c.clone();
        async move { (rpu(&mut c, domain, key).await == want).then_some(()) }
    })
    .await;
}

#[tokio::test]
async fn the_first_config_is_enforced_and_acked_with_its_version_and_nonce() {
    let ads = AdsServer::start().await;
    ads.set(
        "v1",
        &[config("d", vec![limit("k", 3, pb::RateLimitUnit::Hour)])],
    )
    .await;
    let s = server(
        &ads,
        &[
            "--xds-node-metadata",
            "zone=a,team=rl",
            "--xds-headers",
            "x-test=yes",
        ],
    )
    .await;
    let mut c = s.client().await;
    admits_exactly(&mut c, &request("d", &[&[("k", "v")]]), 3).await;

    let first = ads.requests()[0].clone();
    let node = first.node.expect("the first request names the node");
    assert_eq!(node.id, "test-node");
    let metadata = node.metadata.expect("node metadata");
    assert_eq!(metadata.fields.len(), 2, "{metadata:?}");
    assert_eq!(first.type_url, XDS_TYPE_URL);
    assert!(
        first.resource_names.contains(&"x-test=yes".to_owned()),
        "the stream's headers"
    );
    let ack = ads
        .until_request("ACK", |r| !r.response_nonce.is_empty())
        .await;
    assert_eq!(ack.version_info, "v1");
    assert_eq!(ack.response_nonce, ads.nonce());
    assert!(ack.error_detail.is_none());
    assert!(
        ack.node.is_none(),
        "only the first request carries the node"
    );
}

#[tokio::test]
async fn an_update_takes_effect_and_keeps_the_counts_of_unchanged_limits() {
    let ads = AdsServer::start().await;
    ads.set(
        "v1",
        &[config("d", vec![limit("k", 3, pb::RateLimitUnit::Hour)])],
    )
    .await;
    let s = server(&ads, &[]).await;
    let mut c = s.client().await;
    for _ in 0..2 {
        assert!(is_ok(&call(&mut c, request("d", &[&[("k", "v")]])).await));
    }
    // A new limit beside it; the used one unchanged: one hit of it left.
    ads.set(
        "v2",
        &[config(
            "d",
            vec![
                limit("k", 3, pb::RateLimitUnit::Hour),
                limit("other", 7, pb::RateLimitUnit::Minute),
            ],
        )],
    )
    .await;
    until_rpu(&c, "d", "other", Some(7)).await;
    admits_exactly(&mut c, &request("d", &[&[("k", "v")]]), 1).await;
    let ack = ads
        .until_request("ACK of v2", |r| r.version_info == "v2")
        .await;
    assert!(ack.error_detail.is_none());
}

/// `--merge-domain-config` over xDS, as the reference merges configs of one domain: both
/// configs' descriptors apply; one descriptor in both is NACKed and the merged config stays.
#[tokio::test]
async fn configs_of_one_domain_merge_when_asked() {
    let ads = AdsServer::start().await;
    let first = config("d", vec![limit("a", 1, pb::RateLimitUnit::Hour)]);
    let second = pb::RateLimitConfig {
        name: "d-more".into(),
        ..config("d", vec![limit("b", 2, pb::RateLimitUnit::Hour)])
    };
    ads.set("v1", &[first.clone(), second.clone()]).await;
    let s = server(&ads, &["--merge-domain-config"]).await;
    let mut c = s.client().await;
    until_rpu(&c, "d", "b", Some(2)).await;
    assert_eq!(rpu(&mut c, "d", "a").await, Some(1));
    let again = pb::RateLimitConfig {
        name: "d-again".into(),
        ..first.clone()
    };
    ads.set("v2", &[first, again]).await;
    let nonce = ads.ads.0.lock().unwrap().nonce.to_string();
    let nack = ads
        .until_request("the NACK", |r| r.response_nonce == nonce)
        .await;
    let detail = nack.error_detail.expect("a NACK carries why").message;
    assert!(detail.contains("duplicate descriptor 'a'"), "{detail}");
    assert_eq!(
        rpu(&mut c, "d", "b").await,
        Some(2),
        "the merged config stays"
    );
}

/// Every refusal envoyproxy/ratelimit makes: NACKed, naming the config, with the last accepted
/// version and the refused nonce; the previous config stays in force.
#[tokio::test]
async fn a_refused_update_is_nacked_and_the_previous_config_stays() {
    let ads = AdsServer::start().await;
    let good = config("d", vec![limit("k", 2, pb::RateLimitUnit::Hour)]);
    ads.set("v1", std::slice::from_ref(&good)).await;
    let s = server(&ads, &[]).await;
    let mut c = s.client().await;
    assert!(is_ok(&call(&mut c, request("d", &[&[("k", "v")]])).await));

    let unlimited_with_unit = pb::RateLimitDescriptor {
        key: "u".into(),
        rate_limit: Some(pb::RateLimitPolicy {
            unlimited: true,
            unit: pb::RateLimitUnit::Second as i32,
            ..Default::default()
        }),
        ..Default::default()
    };
    let self_replacing = pb::RateLimitDescriptor {
        key: "r".into(),
        rate_limit: Some(pb::RateLimitPolicy {
            unit: pb::RateLimitUnit::Second as i32,
            requests_per_unit: 1,
            name: "a".into(),
            replaces: vec![pb::RateLimitReplace { name: "a".into() }],
            ..Default::default()
        }),
        ..Default::default()
    };
    let bad: Vec<(Vec<pb::RateLimitConfig>, &str)> = vec![
        (vec![good.clone(), config("d", vec![])], "duplicate domain"),
        (vec![config("", vec![])], "empty domain"),
        (
            vec![config("e", vec![limit("", 1, pb::RateLimitUnit::Second)])],
            "empty key",
        ),
        (
            vec![config(
                "e",
                vec![
                    limit("k", 1, pb::RateLimitUnit::Second),
                    limit("k", 2, pb::RateLimitUnit::Second),
                ],
            )],
            "duplicate descriptor",
        ),
        (
            vec![config("e", vec![limit("k", 1, pb::RateLimitUnit::Unknown)])],
            "unit",
        ),
        (vec![config("e", vec![unlimited_with_unit])], "unlimited"),
        (vec![config("e", vec![self_replacing])], "replaces itself"),
    ];
    for (i, (configs, why)) in bad.into_iter().enumerate() {
        let version = format!("bad{i}");
        ads.set(&version, &configs).await;
        let nonce = ads.ads.0.lock().unwrap().nonce.to_string();
        let nack = ads.until_request(why, |r| r.response_nonce == nonce).await;
        let detail = nack.error_detail.expect("a NACK carries why");
        assert!(
            detail.message.contains(why),
            "{} should say {why}",
            detail.message
        );
        assert_eq!(nack.version_info, "v1", "the last accepted version");
        // The previous config is still the one in force.
        assert_eq!(rpu(&mut c, "d", "k").await, Some(2));
    }
    // A resource that does not parse as a RateLimitConfig.
    {
        let mut st = ads.ads.0.lock().unwrap();
        st.version = "garbage".into();
        st.resources = vec![Any {
            type_url: XDS_TYPE_URL.into(),
            value: vec![0xff, 0xff, 0xff],
        }];
    }
    let (senders, response) = {
        let mut st = ads.ads.0.lock().unwrap();
        (st.open.clone(), st.response())
    };
    for tx in senders {
        let _ = tx.send(Ok(response.clone())).await;
    }
    let nack = ads
        .until_request("garbage", |r| r.response_nonce == response.nonce)
        .await;
    assert!(
        nack.error_detail
            .unwrap()
            .message
            .contains("not a RateLimitConfig")
    );
    admits_exactly(&mut c, &request("d", &[&[("k", "v")]]), 1).await;
    // Health stays SERVING throughout.
    let (status, _) = s.http_get("/healthcheck").await;
    assert_eq!(status, 200);
}

/// go-control-plane answers a NACK by resending the same snapshot at once: each is NACKed,
/// the service stays healthy, and the next good version is ACKed and enforced.
#[tokio::test]
async fn a_snapshot_resent_after_each_nack_is_nacked_each_time_then_the_next_good_one_acked() {
    let ads = AdsServer::start().await;
    ads.set(
        "v1",
        &[config("d", vec![limit("k", 5, pb::RateLimitUnit::Hour)])],
    )
    .await;
    let s = server(&ads, &[]).await;
    let mut c = s.client().await;
    until_rpu(&c, "d", "k", Some(5)).await;
    ads.ads.0.lock().unwrap().resend_on_nack = 20;
    ads.set("bad", &[config("", vec![])]).await;
    poll(Duration::from_secs(10), || {
        let nacks = ads
            .requests()
            .iter()
            .filter(|r| r.error_detail.is_some())
            .count();
        async move { (nacks >= 21).then_some(()) }
    })
    .await;
    assert_eq!(rpu(&mut c, "d", "k").await, Some(5));
    ads.set(
        "v2",
        &[config("d", vec![limit("k", 9, pb::RateLimitUnit::Hour)])],
    )
    .await;
    until_rpu(&c, "d", "k", Some(9)).await;
    let ack = ads
        .until_request("ACK of v2", |r| r.version_info == "v2")
        .await;
    assert!(ack.error_detail.is_none());
    let (status, _) = s.http_get("/healthcheck").await;
    assert_eq!(status, 200);
}

/// When the control plane goes away the last config stays in force; when it comes back the
/// client reconnects (presenting its node again) and follows the new snapshot.
#[tokio::test]
async fn a_restarted_control_plane_is_reconnected_and_the_config_kept_meanwhile() {
    let ads = AdsServer::start().await;
    let addr = ads.addr;
    ads.set(
        "v1",
        &[config("d", vec![limit("k", 4, pb::RateLimitUnit::Hour)])],
    )
    .await;
    let s = server(&ads, &[]).await;
    let mut c = s.client().await;
    until_rpu(&c, "d", "k", Some(4)).await;
    drop(ads);
    // Down: the config in force does not change.
    for _ in 0..5 {
        assert_eq!(rpu(&mut c, "d", "k").await, Some(4));
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let listener = poll(Duration::from_secs(10), || async move {
        TcpListener::bind(addr).await.ok()
    })
    .await;
    let back = AdsServer::start_on(listener, Ads::default());
    back.set(
        "v2",
        &[config("d", vec![limit("k", 6, pb::RateLimitUnit::Hour)])],
    )
    .await;
    until_rpu(&c, "d", "k", Some(6)).await;
    let first = back.requests()[0].clone();
    assert_eq!(
        first.node.expect("a new stream names the node").id,
        "test-node"
    );
    assert_eq!(first.version_info, "v1", "the version in force");
}

/// An unknown domain, and descriptors no limit matches, are OK as with files.
#[tokio::test]
async fn the_snapshot_serves_rlconfig_like_files() {
    let ads = AdsServer::start().await;
    ads.set(
        "v1",
        &[config("d", vec![limit("k", 3, pb::RateLimitUnit::Minute)])],
    )
    .await;
    let s = server(&ads, &[]).await;
    let mut c = s.client().await;
    assert!(is_ok(
        &call(&mut c, request("nope", &[&[("k", "v")]])).await
    ));
    let (status, body) = s.http_get("/rlconfig").await;
    assert_eq!(status, 200);
    assert!(body.contains("d.k"), "{body}");
}

/// gRPC health of the service's default name.
async fn grpc_health(s: &TestServer) -> i32 {
    use tonic_health::pb::{HealthCheckRequest, health_client::HealthClient};
    let channel = tonic::transport::Endpoint::from_shared(format!("http://{}", s.grpc))
        .unwrap()
        .connect()
        .await
        .unwrap();
    HealthClient::new(channel)
        .check(HealthCheckRequest {
            service: String::new(),
        })
        .await
        .unwrap()
        .into_inner()
        .status
}

/// FORCE_START_WITHOUT_INITIAL_CONFIG and HEALTHY_WITH_AT_LEAST_ONE_CONFIG_LOADED, as Envoy
/// Gateway sets them: ports open at once, requests fail as the reference fails them, health
/// waits for the first config.
#[tokio::test]
async fn started_without_a_config_requests_fail_until_the_first_arrives() {
    let ads = AdsServer::start().await;
    let s = server(
        &ads,
        &["--start-without-config", "--unhealthy-until-config"],
    )
    .await;
    let mut c = s.client().await;
    let err = c
        .should_rate_limit(request("d", &[&[("k", "v")]]))
        .await
        .unwrap_err();
    assert_eq!(err.code(), tonic::Code::Unknown);
    assert_eq!(err.message(), "no rate limit configuration loaded");
    assert_eq!(s.http_get("/healthcheck").await.0, 500);
    assert_eq!(grpc_health(&s).await, 2, "NOT_SERVING");

    ads.set(
        "v1",
        &[config("d", vec![limit("k", 2, pb::RateLimitUnit::Hour)])],
    )
    .await;
    until_answered(&c, "d", Duration::from_secs(10)).await;
    assert_eq!(rpu(&mut c, "d", "k").await, Some(2));
    // Health follows the config, not necessarily in the same instant.
    poll(Duration::from_secs(10), || async {
        (s.http_get("/healthcheck").await.0 == 200 && grpc_health(&s).await == 1).then_some(())
    })
    .await;
}

/// Without it, nothing is served until the first config; then everything is.
#[tokio::test]
async fn otherwise_nothing_is_served_before_the_first_config() {
    let ads = AdsServer::start().await;
    let s = server(&ads, &[]).await;
    // Not even a TCP connection: a client is refused at once, not left waiting (the stream is
    // open and asked, so the service is past its start).
    ads.until_request("the first request", |r| r.node.is_some())
        .await;
    for port in [s.grpc, s.http] {
        let refused = tokio::net::TcpStream::connect(port).await;
        assert_eq!(
            refused.map(|_| ()).map_err(|e| e.kind()),
            Err(std::io::ErrorKind::ConnectionRefused),
            "{port} before the first config"
        );
    }
    let url = format!("http://{}", s.grpc);
    let early =
        tokio::time::timeout(Duration::from_millis(500), ratelimitd_client(url.clone())).await;
    assert!(
        !matches!(early, Ok(Some(_))),
        "a call was answered before the first config"
    );
    ads.set(
        "v1",
        &[config("d", vec![limit("k", 2, pb::RateLimitUnit::Hour)])],
    )
    .await;
    let mut c = s.client().await;
    admits_exactly(&mut c, &request("d", &[&[("k", "v")]]), 2).await;
}

/// A client that made one call, if the server answered it.
async fn ratelimitd_client(url: String) -> Option<Client> {
    let mut c = Client::connect(url).await.ok()?;
    c.should_rate_limit(request("d", &[&[("k", "v")]]))
        .await
        .ok()?;
    Some(c)
}

/// TLS as Envoy Gateway sets it up: its server requires a client certificate from its CA. A
/// handshake it refuses is logged and retried (the files are read again at each attempt), the
/// service serving meanwhile; once the certificate is right, the config arrives.
#[tokio::test]
async fn mutual_tls_to_the_control_plane_and_a_refused_handshake_retried() {
    let dir = tempfile::tempdir().unwrap();
    let certs = common::redis::make_certs(dir.path());
    let other = tempfile::tempdir().unwrap();
    let stranger = common::redis::make_certs(other.path());
    let ads = AdsServer::start_tls(&certs).await;
    ads.set(
        "v1",
        &[config("d", vec![limit("k", 2, pb::RateLimitUnit::Hour)])],
    )
    .await;
    // The client's certificate comes from another CA at first.
    let client = tempfile::tempdir().unwrap();
    for f in ["client.crt", "client.key"] {
        std::fs::copy(stranger.join(f), client.path().join(f)).unwrap();
    }
    let path = |d: &std::path::Path, f: &str| d.join(f).to_str().unwrap().to_owned();
    let (ca, cert, key) = (
        path(&certs, "ca.crt"),
        path(client.path(), "client.crt"),
        path(client.path(), "client.key"),
    );
    let s = server(
        &ads,
        &[
            "--xds-tls-ca",
            &ca,
            "--xds-tls-cert",
            &cert,
            "--xds-tls-key",
            &key,
            "--xds-tls-server-name",
            "localhost",
            "--start-without-config",
        ],
    )
    .await;
    let mut c = s.client().await;
    // Refused handshakes: no config, the service still answering (with the reference's error).
    tokio::time::sleep(Duration::from_millis(300)).await;
    let err = c
        .should_rate_limit(request("d", &[&[("k", "v")]]))
        .await
        .unwrap_err();
    assert_eq!(err.code(), tonic::Code::Unknown);
    assert!(
        ads.requests().is_empty(),
        "a stream opened without a valid client certificate"
    );
    assert_eq!(s.http_get("/healthcheck").await.0, 200);
    // The right certificate: the next attempt gets through.
    for f in ["client.crt", "client.key"] {
        std::fs::copy(certs.join(f), client.path().join(f)).unwrap();
    }
    until_answered(&c, "d", Duration::from_secs(10)).await;
    admits_exactly(&mut c, &request("d", &[&[("k", "v")]]), 2).await;
    assert_eq!(ads.requests()[0].node.as_ref().unwrap().id, "test-node");
}

/// The descriptor a route's rate-limit actions produce for a request that matches them all
/// (a request header's value is `alice`).
fn entries_of(actions: &serde_json::Value) -> Vec<(String, String)> {
    let mut entries = Vec::new();
    for a in actions.as_array().unwrap() {
        let spec = &a["ActionSpecifier"];
        let (kind, body) = spec.as_object().unwrap().iter().next().unwrap();
        let key = |default: &str| {
            body["descriptor_key"]
                .as_str()
                .unwrap_or(default)
                .to_owned()
        };
        let value = || {
            body["descriptor_value"]
                .as_str()
                .unwrap_or_default()
                .to_owned()
        };
        entries.push(match kind.as_str() {
            "GenericKey" => (key("generic_key"), value()),
            "HeaderValueMatch" => (key("header_match"), value()),
            "QueryParameterValueMatch" => (key("query_match"), value()),
            "RemoteAddressMatch" => (key("remote_address_match"), value()),
            "RequestHeaders" => (key("request_headers"), "alice".to_owned()),
            other => panic!("an action the test does not know: {other}"),
        });
    }
    entries
}

/// Envoy Gateway's translator corpus, pushed over ADS as its control plane would: for every
/// route's rate-limit actions, the descriptor they produce meets exactly the limit the
/// translator meant (shadow rules never reject). Memory backend: time is a manual clock,
/// moved two years on between rules so that no window carries over, and the limit is checked
/// call by call. Redis keeps its own time, so there each check is one call that no window
/// boundary can split: `limit` hits at once are admitted after `limit + 1` were refused.
async fn envoy_gateway_corpus_over_ads(redis: Option<&common::redis::RedisProc>) {
    let Some(corpus) = envoy_gateway_corpus() else {
        return;
    };
    let mut checked = 0;
    let mut names: Vec<_> = std::fs::read_dir(&corpus)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| !p.to_str().unwrap().ends_with(".routes.yaml"))
        .collect();
    names.sort();
    for path in names {
        let text = std::fs::read_to_string(&path).unwrap();
        let configs: Vec<serde_json::Value> = serde_saphyr::from_multiple(&text).unwrap();
        let routes_text = std::fs::read_to_string(path.with_extension("routes.yaml")).unwrap();
        let routes: Vec<serde_json::Value> = serde_saphyr::from_multiple(&routes_text).unwrap();
        let shadow = text.contains("shadow_mode: true");

        let ads = AdsServer::start().await;
        let configs: Vec<pb::RateLimitConfig> = configs.iter().map(pb_config).collect();
        ads.set("v1", &configs).await;
        let clock = Arc::new(ratelimitd::testing::ManualClock::new(1_000_000));
        let mut flags = ads.flags();
        flags.push("--start-without-config".into());
        if let Some(redis) = redis {
            flags.extend([
                "--backend".into(),
                "redis".into(),
                "--redis-url".into(),
                redis.url(),
                "--redis-key-prefix".into(),
                common::redis::unique_prefix(),
                "--redis-timeout".into(),
                "2s".into(),
            ]);
        }
        let flags: Vec<&str> = flags.iter().map(String::as_str).collect();
        let s = TestServer::start_with(&[], &flags, clock.clone()).await;
        let mut c = s.client().await;
        let file = path.file_name().unwrap().to_str().unwrap();
        // Shared policies give several routes the same descriptor, so the same counter: on
        // Redis (no clock to move on) each is checked once.
        let mut seen = std::collections::HashSet::new();
        for route in &routes {
            for (domain, limits) in route["rateLimitsByDomain"].as_object().unwrap() {
                for rule in limits.as_array().unwrap() {
                    let entries = entries_of(&rule["actions"]);
                    let refs: Vec<(&str, &str)> = entries
                        .iter()
                        .map(|(k, v)| (k.as_str(), v.as_str()))
                        .collect();
                    let req = request(domain, &[&refs]);
                    if redis.is_some() && !seen.insert((domain.clone(), entries.clone())) {
                        continue;
                    }
                    clock.advance(Duration::from_secs(2 * 365 * 86_400));
                    let probe = poll(Duration::from_secs(10), || {
                        let mut c = c.clone();
                        let req = with_hits(req.clone(), 0, 0);
                        async move { c.should_rate_limit(req).await.ok() }
                    })
                    .await
                    .into_inner();
                    let rpu = rpu_of(&probe, 0)
                        .unwrap_or_else(|| panic!("{file}: no limit for {domain} {entries:?}"));
                    let limit = u64::from(rpu);
                    if shadow {
                        let r = call(&mut c, weighted(req.clone(), limit as u32 + 1)).await;
                        assert!(is_ok(&r), "{file}: shadow");
                    } else if rpu > 1000 {
                        assert!(is_ok(&call(&mut c, req.clone()).await), "{file}");
                    } else if redis.is_some() {
                        let over = call(&mut c, weighted(req.clone(), limit as u32 + 1)).await;
                        assert!(is_over(&over), "{file}: {} hits admitted", limit + 1);
                        let fits = call(&mut c, weighted(req.clone(), limit as u32)).await;
                        assert!(is_ok(&fits), "{file}: {limit} hits refused");
                    } else {
                        admits_exactly(&mut c, &req, rpu as usize).await;
                    }
                    checked += 1;
                }
            }
        }
    }
    eprintln!("{checked} rules checked");
    assert!(checked >= 26, "{checked} rules checked");
}

#[tokio::test]
async fn envoy_gateway_corpus_over_ads_admits_each_rule_exactly_its_limit() {
    envoy_gateway_corpus_over_ads(None).await;
}

#[tokio::test]
async fn envoy_gateway_corpus_over_ads_on_redis_admits_each_rule_exactly_its_limit() {
    let redis = common::redis::RedisProc::start(&[]);
    envoy_gateway_corpus_over_ads(Some(&redis)).await;
}

/// Envoy Gateway's API has no field for an algorithm: `--default-algorithm` applies to every
/// limit that names none, and a descriptor's `metadata.ratelimitd` (numbers arrive as floats in
/// a protobuf Struct) sets algorithm, burst, unit_multiplier and accounting for its limits.
#[tokio::test]
async fn the_default_algorithm_and_metadata_extensions_reach_xds_limits() {
    use envoy_types::pb::google::protobuf::value::Kind;
    let ads = AdsServer::start().await;
    let bucket = with_extensions(
        limit("bucket", 5, pb::RateLimitUnit::Second),
        [
            ("algorithm", Kind::StringValue("token_bucket".into())),
            ("burst", Kind::NumberValue(20.0)),
            ("accounting", Kind::StringValue("admission".into())),
        ],
    );
    ads.set(
        "v1",
        &[config(
            "d",
            vec![limit("plain", 3, pb::RateLimitUnit::Minute), bucket],
        )],
    )
    .await;
    let s = server(&ads, &["--default-algorithm", "sliding-window"]).await;
    let c = s.client().await;
    until_rpu(&c, "d", "plain", Some(3)).await;
    let (_, rules) = s.http_get("/rlconfig").await;
    let line = |key: &str| rule_line(&rules, "d", key);
    assert!(
        line("plain").contains("algorithm=sliding_window"),
        "{rules}"
    );
    assert!(
        line("bucket").contains("algorithm=token_bucket burst=20 accounting=admission"),
        "{rules}"
    );
    // An admission: the descriptor's own hits_addend past the limit is refused and consumes
    // nothing (under the default accounting it would be a report, recorded as debt).
    let mut c = c;
    let over = call(
        &mut c,
        with_hits(request("d", &[&[("bucket", "v")]]), 0, 21),
    )
    .await;
    assert!(is_over(&over));
    let fits = call(
        &mut c,
        with_hits(request("d", &[&[("bucket", "v")]]), 0, 20),
    )
    .await;
    assert!(is_ok(&fits), "{fits:?}");
}

/// Envoy Gateway's rate-limit container, as its resource.go builds it: the binary with no
/// arguments and exactly that environment (xDS over mutual TLS with one certificate mounted
/// for serving and for the xDS client, gRPC over TLS, Redis over TCP, Prometheus, force
/// start); only the ports move to free loopback ones, through RATELIMITD_*, which win. The
/// config arrives over xDS and is enforced, counted in that Redis.
#[tokio::test]
async fn the_envoy_gateway_environment_runs_unchanged() {
    use common::daemon::{Daemon, ratelimitd};
    use common::redis::{RedisProc, free_port, make_certs};
    let redis = RedisProc::start(&[]);
    let dir = tempfile::tempdir().unwrap();
    let certs = make_certs(dir.path());
    // EG mounts tls.crt, tls.key and ca.crt at /certs.
    let mount = dir.path().join("mount");
    std::fs::create_dir(&mount).unwrap();
    for (from, to) in [
        ("server.crt", "tls.crt"),
        ("server.key", "tls.key"),
        ("ca.crt", "ca.crt"),
    ] {
        std::fs::copy(certs.join(from), mount.join(to)).unwrap();
    }
    let file = |f: &str| mount.join(f).to_str().unwrap().to_owned();
    let ads = AdsServer::start_tls(&certs).await;
    ads.set(
        "v1",
        &[config("eg", vec![limit("k", 2, pb::RateLimitUnit::Hour)])],
    )
    .await;
    let (debug, metrics) = (free_port(), free_port());
    let mut cmd = ratelimitd("", &[]);
    cmd.env("RUNTIME_ROOT", "/data")
        .env("RUNTIME_SUBDIRECTORY", "ratelimit")
        .env("RUNTIME_IGNOREDOTFILES", "true")
        .env("RUNTIME_WATCH_ROOT", "false")
        .env("LOG_LEVEL", "info")
        .env("USE_STATSD", "false")
        .env("CONFIG_TYPE", "GRPC_XDS_SOTW")
        .env("CONFIG_GRPC_XDS_SERVER_URL", ads.addr.to_string())
        .env("CONFIG_GRPC_XDS_NODE_ID", "envoy-ratelimit")
        .env("GRPC_SERVER_USE_TLS", "true")
        .env("GRPC_SERVER_TLS_CERT", file("tls.crt"))
        .env("GRPC_SERVER_TLS_KEY", file("tls.key"))
        .env("GRPC_SERVER_TLS_CA_CERT", file("ca.crt"))
        .env("CONFIG_GRPC_XDS_SERVER_USE_TLS", "true")
        .env("CONFIG_GRPC_XDS_CLIENT_TLS_CERT", file("tls.crt"))
        .env("CONFIG_GRPC_XDS_CLIENT_TLS_KEY", file("tls.key"))
        .env("CONFIG_GRPC_XDS_SERVER_TLS_CACERT", file("ca.crt"))
        .env("FORCE_START_WITHOUT_INITIAL_CONFIG", "true")
        .env("REDIS_SOCKET_TYPE", "tcp")
        .env("REDIS_URL", format!("127.0.0.1:{}", redis.port))
        .env("USE_PROMETHEUS", "true")
        .env("PROMETHEUS_ADDR", ":19001")
        .env("PROMETHEUS_MAPPER_YAML", "/etc/statsd-exporter/conf.yaml")
        .env("RATELIMITD_METRICS_ADDR", format!("127.0.0.1:{metrics}"))
        .env("RATELIMITD_DEBUG_ADDR", format!("127.0.0.1:{debug}"));
    let d = Daemon::start(cmd).await;
    let channel = tonic::transport::Endpoint::from_shared(format!("https://localhost:{}", d.grpc))
        .unwrap()
        .tls_config(tonic::transport::ClientTlsConfig::new().ca_certificate(
            tonic::transport::Certificate::from_pem(std::fs::read(certs.join("ca.crt")).unwrap()),
        ))
        .unwrap()
        .connect()
        .await
        .unwrap();
    let mut c = Client::new(channel);
    until_answered(&c, "eg", Duration::from_secs(20)).await;
    admits_exactly(&mut c, &request("eg", &[&[("k", "v")]]), 2).await;
    let keys = redis.cli(&["--scan", "--pattern", "*eg*"]);
    assert_eq!(keys.lines().count(), 1, "counted in that Redis: {keys}");
    let metrics_addr: std::net::SocketAddr = format!("127.0.0.1:{metrics}").parse().unwrap();
    let (status, m) = http_get(metrics_addr, "/metrics").await;
    assert_eq!(status, 200);
    // envoyproxy/ratelimit's families as the dashboard reads them, counted as it counts:
    // 3 hits (the probe adds none), 2 within, 1 past floor(2 × 0.8), 1 over.
    for (family, n) in [
        ("total_hits", 3.0),
        ("within_limit", 2.0),
        ("near_limit", 1.0),
        ("over_limit", 1.0),
    ] {
        let series = format!("ratelimit_service_rate_limit_{family}{{domain=\"eg\",key1=\"k\"}}");
        assert_eq!(metric(&m, &series), n, "{series}\n{m}");
    }
    assert!(
        !m.contains("ratelimit_service_rate_limit_total_hits_total"),
        "no _total suffix"
    );
    assert!(metric(&m, "process_resident_memory_bytes") > 1e6, "{m}");
    assert!(metric(&m, "process_virtual_memory_bytes") > 1e6, "{m}");
    let node = ads.requests()[0].node.clone().unwrap();
    assert_eq!(node.id, "envoy-ratelimit");
    let (exit, stderr) = d.terminate().await;
    assert!(exit.success(), "{stderr}");
    assert!(!stderr.contains("ERROR"), "{stderr}");
}

/// An address that accepts TCP and never speaks: the first connection is held open and
/// silent; the client gives it up after `--xds-connect-timeout` and tries again, and the
/// control plane it then finds on the same address is followed.
#[tokio::test]
async fn a_control_plane_that_accepts_tcp_and_says_nothing_is_left_and_retried() {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let extra = ["--xds-connect-timeout", "300ms", "--start-without-config"];
    let s = server_with(xds_flags(addr), &extra).await;
    // The first connection, held silent for far longer than the deadline.
    let (silent, _) = tokio::time::timeout(Duration::from_secs(10), listener.accept())
        .await
        .expect("the client connects")
        .unwrap();
    let ads = AdsServer::start_on(listener, Ads::default());
    ads.set(
        "v1",
        &[config("d", vec![limit("k", 2, pb::RateLimitUnit::Hour)])],
    )
    .await;
    let c = s.client().await;
    until_answered(&c, "d", Duration::from_secs(10)).await;
    assert_eq!(ads.ads.0.lock().unwrap().streams, 1);
    drop(silent);
}

/// A stream whose first response never comes (a control plane holding the request, e.g. with
/// no snapshot for this node) is abandoned after `--xds-response-timeout` and reopened.
#[tokio::test]
async fn a_stream_without_a_first_response_is_reopened() {
    let ads = AdsServer::start().await;
    let _s = server(
        &ads,
        &["--xds-response-timeout", "300ms", "--start-without-config"],
    )
    .await;
    poll(Duration::from_secs(10), || async {
        (ads.ads.0.lock().unwrap().streams >= 3).then_some(())
    })
    .await;
    // Each new stream asks again, naming the node.
    let requests = ads.requests();
    assert!(
        requests.len() >= 3 && requests.iter().all(|r| r.node.is_some()),
        "{requests:#?}"
    );
}

/// Forwards TCP to `upstream`. Bumping the returned epoch freezes every connection open at
/// that moment: held open, not a byte moved either way (a partition, or a control plane hung
/// mid-stream); connections made later are forwarded again.
async fn freezing_proxy(upstream: std::net::SocketAddr) -> (std::net::SocketAddr, Arc<AtomicU64>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let epoch = Arc::new(AtomicU64::new(0));
    let current = epoch.clone();
    tokio::spawn(async move {
        while let Ok((client, _)) = listener.accept().await {
            let Ok(server) = tokio::net::TcpStream::connect(upstream).await else {
                return;
            };
            let born = current.load(Ordering::SeqCst);
            let (cr, cw) = client.into_split();
            let (sr, sw) = server.into_split();
            tokio::spawn(pump(cr, sw, born, current.clone()));
            tokio::spawn(pump(sr, cw, born, current.clone()));
        }
    });
    (addr, epoch)
}

/// Copies `from` to `to` until either ends, or forever nothing once `epoch` passes `born`.
async fn pump(
    mut from: impl tokio::io::AsyncRead + Unpin,
    mut to: impl tokio::io::AsyncWrite + Unpin,
    born: u64,
    epoch: Arc<AtomicU64>,
) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut buf = vec![0u8; 16 << 10];
    while let Ok(n @ 1..) = from.read(&mut buf).await {
        if epoch.load(Ordering::SeqCst) > born {
            // Swallowed; both sockets stay open.
            std::future::pending::<()>().await;
        }
        if to.write_all(&buf[..n]).await.is_err() {
            return;
        }
    }
}

/// A control plane that goes silent mid-stream, its connection still open: HTTP/2 PINGs go
/// unanswered, the connection is given up after `--xds-keepalive-timeout`, and a new stream
/// brings the update the frozen one never delivered.
#[tokio::test]
async fn a_control_plane_silent_mid_stream_is_left_by_keepalive() {
    let ads = AdsServer::start().await;
    ads.set(
        "v1",
        &[config("d", vec![limit("k", 2, pb::RateLimitUnit::Hour)])],
    )
    .await;
    let (proxy, epoch) = freezing_proxy(ads.addr).await;
    let extra = [
        "--xds-keepalive-interval",
        "200ms",
        "--xds-keepalive-timeout",
        "300ms",
    ];
    let s = server_with(xds_flags(proxy), &extra).await;
    let c = s.client().await;
    until_rpu(&c, "d", "k", Some(2)).await;
    ads.until_request("ACK", |r| !r.response_nonce.is_empty())
        .await;
    epoch.fetch_add(1, Ordering::SeqCst);
    ads.set(
        "v2",
        &[config("d", vec![limit("k", 5, pb::RateLimitUnit::Hour)])],
    )
    .await;
    until_rpu(&c, "d", "k", Some(5)).await;
    assert_eq!(ads.ads.0.lock().unwrap().streams, 2, "one new stream");
}

/// A response over `--xds-max-message-bytes` cannot be read, so not NACKed: each time it comes
/// (on every reconnect) it is counted as a failed load, but logged once; the config in force
/// stays.
#[tokio::test]
async fn an_oversized_response_is_counted_each_time_and_logged_once() {
    use common::daemon::{Daemon, ratelimitd};
    let ads = AdsServer::start().await;
    ads.set(
        "v1",
        &[config("d", vec![limit("k", 2, pb::RateLimitUnit::Hour)])],
    )
    .await;
    let mut cmd = ratelimitd("", &["--xds-max-message-bytes", "64KiB"]);
    cmd.args(ads.flags());
    let d = Daemon::start(cmd).await;
    let mut c = d.client().await;
    assert_eq!(rpu(&mut c, "d", "k").await, Some(2));
    let mut big = config("d", vec![limit("k", 9, pb::RateLimitUnit::Hour)]);
    big.name = "n".repeat(100 << 10);
    ads.set("v2", &[big]).await;
    let errors = r#"ratelimit_config_loads_total{result="error"}"#;
    poll(Duration::from_secs(10), || async {
        let (_, m) = http_get(d.http, "/metrics").await;
        (metric(&m, errors) >= 3.0).then_some(())
    })
    .await;
    assert_eq!(rpu(&mut c, "d", "k").await, Some(2), "v1 stays in force");
    assert!(
        ads.ads.0.lock().unwrap().streams >= 3,
        "fetched again on each reconnect"
    );
    let (_, stderr) = d.terminate().await;
    let said = stderr.matches("refused unread").count();
    assert_eq!(said, 1, "logged once: {stderr}");
    assert!(stderr.contains("found 10"), "the size: {stderr}");
}

/// Envoy Gateway's `Month`, `Day` and `Year` reach us over xDS with no field for a zone:
/// `--calendar-timezone` makes them calendar windows, a descriptor's `metadata.ratelimitd`
/// names a zone of its own, and an unknown zone there is NACKed with the words a file gets,
/// the previous config staying in force.
#[tokio::test]
async fn calendar_windows_reach_xds_limits_and_a_bad_zone_is_nacked() {
    use envoy_types::pb::google::protobuf::value::Kind;
    let with_zone =
        |d, zone: &str| with_extensions(d, [("calendar", Kind::StringValue(zone.into()))]);
    let ads = AdsServer::start().await;
    let good = config(
        "d",
        vec![
            limit("month", 2, pb::RateLimitUnit::Month),
            with_zone(limit("own", 2, pb::RateLimitUnit::Day), "Asia/Kolkata"),
            limit("minute", 2, pb::RateLimitUnit::Minute),
        ],
    );
    ads.set("v1", std::slice::from_ref(&good)).await;
    let s = server(&ads, &["--calendar-timezone", "America/New_York"]).await;
    let mut c = s.client().await;
    until_rpu(&c, "d", "month", Some(2)).await;
    let (_, rules) = s.http_get("/rlconfig").await;
    let rule = |key: &str| rule_line(&rules, "d", key);
    assert!(
        rule("month").contains("calendar=America/New_York"),
        "{rules}"
    );
    assert!(rule("own").contains("calendar=Asia/Kolkata"), "{rules}");
    assert!(!rule("minute").contains("calendar"), "{rules}");

    let bad = config(
        "d",
        vec![with_zone(
            limit("own", 2, pb::RateLimitUnit::Day),
            "Mars/Base",
        )],
    );
    ads.set("v2", &[bad]).await;
    let nonce = ads.nonce();
    let nack = ads
        .until_request("the NACK", |r| r.response_nonce == nonce)
        .await;
    let detail = nack.error_detail.expect("a NACK carries why").message;
    assert!(
        detail.contains("xds:d")
            && detail.contains("descriptors[0].metadata.ratelimitd.calendar")
            && detail.contains("unknown time zone 'Mars/Base'"),
        "{detail}"
    );
    assert_eq!(nack.version_info, "v1");
    assert_eq!(rpu(&mut c, "d", "month").await, Some(2), "v1 stays");
}

/// Holds over xDS: Envoy Gateway has no field for them, so a descriptor's
/// `metadata.ratelimitd` names the `hold_key` and the `algorithm: concurrency`; places are
/// then taken and released as from a file (docs/configuration.md, "Holds").
#[tokio::test]
async fn holds_and_concurrency_reach_xds_limits_through_metadata() {
    use envoy_types::pb::google::protobuf::value::Kind;
    let ads = AdsServer::start().await;
    let places = with_extensions(
        limit("tenant", 2, pb::RateLimitUnit::Minute),
        [
            ("algorithm", Kind::StringValue("concurrency".into())),
            ("hold_key", Kind::StringValue("request_id".into())),
        ],
    );
    ads.set("v1", &[config("llm", vec![places])]).await;
    let s = server(&ads, &[]).await;
    let mut c = s.client().await;
    until_rpu(&c, "llm", "tenant", Some(2)).await;
    let (_, rules) = s.http_get("/rlconfig").await;
    assert!(
        rule_line(&rules, "llm", "tenant").contains("algorithm=concurrency, hold_key=request_id"),
        "{rules}"
    );
    let acquire = |id: &str| request("llm", &[&[("tenant", "acme"), ("request_id", id)]]);
    // until_rpu's own calls named no hold: they took no place.
    for (id, ok) in [("a", true), ("b", true), ("c", false)] {
        assert_eq!(is_ok(&call(&mut c, acquire(id)).await), ok, "{id}");
    }
    let mut release = with_hits(acquire("a"), 0, 1);
    release.descriptors[0].is_negative_hits = true;
    call(&mut c, release).await;
    assert!(is_ok(&call(&mut c, acquire("c")).await));
}
