//! Envoy Gateway's translator output rendered for a real Envoy as Envoy Gateway renders it
//! (envoyproxy/gateway d32f282, internal/xds/translator/ratelimit.go): one ratelimit filter
//! per domain ahead of the router (`envoy.filters.http.ratelimit` for the listener's domain,
//! `envoy.filters.http.ratelimit/<domain>` for a shared policy's), each with the domain,
//! `ratelimit_cluster`, DRAFT_VERSION_03 headers and no `x-envoy-ratelimited`; each route's
//! rate limits in a `RateLimitPerRoute` (with its domain) under that filter's name in the
//! route's `typed_per_filter_config`. The corpus gives the rate limits per route and domain
//! (`<name>.routes.yaml`) and the `RateLimitConfig`s the service is fed (`<name>.yaml`); a
//! route's own match is not in it, so each route here matches the path prefix `/<route>`.

use std::path::Path;

use serde_json::{Value, json};

use super::ads::pb_config;
use ratelimitd::testing::rls_conf as pb;

/// One rate limit of a route (a rule), as Envoy Gateway's corpus gives it.
#[derive(Clone, Debug)]
pub(crate) struct Rule {
    pub route: String,
    pub domain: String,
    /// The rule's actions in Envoy Gateway's rendering (`ActionSpecifier: {GenericKey: …}`).
    pub actions: Vec<Value>,
}

/// A request a client makes.
#[derive(Clone, Debug, Default, PartialEq)]
pub(crate) struct Request {
    pub method: String,
    pub path: String,
    pub headers: Vec<(String, String)>,
}

/// One corpus entry, rendered.
pub(crate) struct Rendering {
    pub configs: Vec<pb::RateLimitConfig>,
    pub rules: Vec<Rule>,
    /// The bootstrap, ports as the examples' (10000, 9000, 8081) for `Envoy::start`.
    pub bootstrap: String,
}

/// The address every test client connects from.
const CLIENT: [u8; 4] = [127, 0, 0, 1];

pub(crate) fn render(corpus: &Path, name: &str) -> Rendering {
    let read = |f: String| std::fs::read_to_string(corpus.join(&f)).unwrap();
    let configs: Vec<Value> = serde_saphyr::from_multiple(&read(format!("{name}.yaml"))).unwrap();
    let routes: Vec<Value> =
        serde_saphyr::from_multiple(&read(format!("{name}.routes.yaml"))).unwrap();
    let mut rules = Vec::new();
    for r in &routes {
        let route = r["routeName"].as_str().unwrap().to_owned();
        for (domain, limits) in r["rateLimitsByDomain"].as_object().unwrap() {
            for l in limits.as_array().unwrap() {
                rules.push(Rule {
                    route: route.clone(),
                    domain: domain.clone(),
                    actions: l["actions"].as_array().unwrap().clone(),
                });
            }
        }
    }
    let mut domains: Vec<&str> = rules.iter().map(|r| r.domain.as_str()).collect();
    domains.sort();
    domains.dedup();
    let filter_name = |domain: &str| {
        if domain.contains('/') {
            format!("envoy.filters.http.ratelimit/{domain}")
        } else {
            "envoy.filters.http.ratelimit".to_owned()
        }
    };
    assert!(
        domains.iter().filter(|d| !d.contains('/')).count() <= 1,
        "{name}: one listener's domain at most"
    );
    let mut http_filters: Vec<Value> = domains
        .iter()
        .map(|d| {
            json!({
                "name": filter_name(d),
                "typed_config": {
                    "@type": "type.googleapis.com/envoy.extensions.filters.http.ratelimit.v3.RateLimit",
                    "domain": d,
                    "timeout": "0.02s",
                    "disable_x_envoy_ratelimited_header": true,
                    "enable_x_ratelimit_headers": "DRAFT_VERSION_03",
                    "rate_limit_service": {
                        "grpc_service": { "envoy_grpc": { "cluster_name": "ratelimit_cluster" } },
                        "transport_api_version": "V3"
                    }
                }
            })
        })
        .collect();
    http_filters.push(json!({
        "name": "envoy.filters.http.router",
        "typed_config": { "@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router" }
    }));
    let mut names: Vec<&str> = rules.iter().map(|r| r.route.as_str()).collect();
    names.dedup();
    let routes: Vec<Value> = names
        .iter()
        .map(|route| {
            let mut per_filter = serde_json::Map::new();
            for d in &domains {
                let limits: Vec<Value> = rules
                    .iter()
                    .filter(|r| r.route == *route && r.domain == *d)
                    .map(|r| json!({ "actions": r.actions.iter().map(envoy_action).collect::<Vec<_>>() }))
                    .collect();
                if !limits.is_empty() {
                    per_filter.insert(filter_name(d), json!({
                        "@type": "type.googleapis.com/envoy.extensions.filters.http.ratelimit.v3.RateLimitPerRoute",
                        "domain": d,
                        "rate_limits": limits
                    }));
                }
            }
            json!({
                "name": route,
                "match": { "prefix": format!("/{route}") },
                "route": { "cluster": "upstream" },
                "typed_per_filter_config": per_filter
            })
        })
        .collect();
    let cluster = |name: &str, port: u16, h2: bool| {
        let mut c = json!({
            "name": name,
            "type": "STATIC",
            "load_assignment": {
                "cluster_name": name,
                "endpoints": [{ "lb_endpoints": [{ "endpoint": { "address": {
                    "socket_address": { "address": "127.0.0.1", "port_value": port }
                } } }] }]
            }
        });
        if h2 {
            c["typed_extension_protocol_options"] = json!({
                "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                    "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
                    "explicit_http_config": { "http2_protocol_options": {} }
                }
            });
        }
        c
    };
    let bootstrap = json!({
        "static_resources": {
            "listeners": [{
                "name": name,
                "address": { "socket_address": { "address": "0.0.0.0", "port_value": 10000 } },
                "filter_chains": [{ "filters": [{
                    "name": "envoy.filters.network.http_connection_manager",
                    "typed_config": {
                        "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
                        "stat_prefix": "http",
                        "use_remote_address": true,
                        "route_config": { "name": name, "virtual_hosts": [{
                            "name": name, "domains": ["*"], "routes": routes
                        }] },
                        "http_filters": http_filters
                    }
                }] }]
            }],
            "clusters": [cluster("upstream", 9000, false), cluster("ratelimit_cluster", 8081, true)]
        }
    });
    Rendering {
        configs: configs.iter().map(pb_config).collect(),
        rules,
        bootstrap: serde_saphyr::to_string(&bootstrap).unwrap(),
    }
}

/// The exact value a header or query-parameter matcher of Envoy Gateway's rendering names (the
/// only pattern the chosen corpus entries use).
fn exact(matcher: &Value) -> &str {
    let spec = ["HeaderMatchSpecifier", "QueryParameterMatchSpecifier"]
        .iter()
        .map(|k| &matcher[k]["StringMatch"]["MatchPattern"])
        .find(|p| !p.is_null())
        .unwrap_or_else(|| panic!("no string match: {matcher}"));
    spec["Exact"]
        .as_str()
        .unwrap_or_else(|| panic!("a pattern the test does not render: {spec}"))
}

/// An action of Envoy Gateway's rendering as Envoy's JSON.
fn envoy_action(a: &Value) -> Value {
    let (kind, b) = a["ActionSpecifier"]
        .as_object()
        .unwrap()
        .iter()
        .next()
        .unwrap();
    let common = |extra: Value| {
        let mut v = json!({});
        for f in ["descriptor_key", "descriptor_value"] {
            if let Some(s) = b[f].as_str() {
                v[f] = s.into();
            }
        }
        for (k, x) in extra.as_object().unwrap() {
            v[k] = x.clone();
        }
        v
    };
    let string_match = |m: &Value| json!({ "exact": exact(m) });
    match kind.as_str() {
        "GenericKey" => json!({ "generic_key": common(json!({})) }),
        "RequestHeaders" => {
            json!({ "request_headers": common(json!({ "header_name": b["header_name"] })) })
        }
        "HeaderValueMatch" => {
            let headers: Vec<Value> = b["headers"]
                .as_array()
                .unwrap()
                .iter()
                .map(|h| {
                    json!({
                        "name": h["name"],
                        "string_match": string_match(h),
                        "invert_match": h["invert_match"].as_bool().unwrap_or(false)
                    })
                })
                .collect();
            json!({ "header_value_match": common(json!({
                "expect_match": b["expect_match"]["value"].as_bool().unwrap_or(true),
                "headers": headers
            })) })
        }
        "QueryParameterValueMatch" => {
            let params: Vec<Value> = b["query_parameters"]
                .as_array()
                .unwrap()
                .iter()
                .map(|q| {
                    json!({
                        "name": q["name"],
                        "string_match": string_match(q)
                    })
                })
                .collect();
            json!({ "query_parameter_value_match": common(json!({
                "expect_match": b["expect_match"]["value"].as_bool().unwrap_or(true),
                "query_parameters": params
            })) })
        }
        "RemoteAddressMatch" => {
            let m = &b["address_matcher"];
            let ranges: Vec<Value> = m["ranges"]
                .as_array()
                .unwrap()
                .iter()
                .map(|r| {
                    json!({
                        "address_prefix": r["address_prefix"],
                        "prefix_len": r["prefix_len"]["value"].as_u64().unwrap_or(0)
                    })
                })
                .collect();
            json!({ "remote_address_match": common(json!({ "address_matcher": {
                "ranges": ranges,
                "invert_match": m["invert_match"].as_bool().unwrap_or(false)
            } })) })
        }
        other => panic!("an action the test does not render: {other}"),
    }
}

/// The request that meets every action of `rule` (a header a RequestHeaders action reads
/// carries `alice`), or `None` when no request can (two values for one header).
pub(crate) fn request_for(rule: &Rule) -> Option<Request> {
    let mut r = Request {
        method: "GET".into(),
        path: format!("/{}", rule.route),
        headers: Vec::new(),
    };
    let mut query = Vec::new();
    for a in &rule.actions {
        let (kind, b) = a["ActionSpecifier"]
            .as_object()
            .unwrap()
            .iter()
            .next()
            .unwrap();
        let mut want = |name: &str, value: &str| -> Option<()> {
            if name == ":method" {
                (r.method == "GET" || r.method == value).then(|| r.method = value.into())
            } else if let Some((_, v)) = r.headers.iter().find(|(n, _)| n == name) {
                (v == value).then_some(())
            } else {
                r.headers.push((name.into(), value.into()));
                Some(())
            }
        };
        match kind.as_str() {
            "RequestHeaders" => want(b["header_name"].as_str().unwrap(), "alice")?,
            "HeaderValueMatch" if b["expect_match"]["value"] != false => {
                for h in b["headers"].as_array().unwrap() {
                    want(h["name"].as_str().unwrap(), exact(h))?;
                }
            }
            "QueryParameterValueMatch" => {
                for q in b["query_parameters"].as_array().unwrap() {
                    query.push(format!("{}={}", q["name"].as_str().unwrap(), exact(q)));
                }
            }
            _ => {}
        }
    }
    if !query.is_empty() {
        r.path = format!("{}?{}", r.path, query.join("&"));
    }
    Some(r)
}

/// The descriptor Envoy sends for `rule` on `req`, as the rule's actions make it (what
/// Envoy's documentation says each action appends), or `None` when an action does not match
/// (Envoy leaves the whole rate limit out).
pub(crate) fn descriptor(rule: &Rule, req: &Request) -> Option<Vec<(String, String)>> {
    if format!("/{}", rule.route) != req.path.split('?').next().unwrap() {
        return None;
    }
    let header = |name: &str| -> Option<String> {
        if name == ":method" {
            return Some(req.method.clone());
        }
        req.headers
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.clone())
    };
    let mut entries = Vec::new();
    for a in &rule.actions {
        let (kind, b) = a["ActionSpecifier"]
            .as_object()
            .unwrap()
            .iter()
            .next()
            .unwrap();
        let key = |default: &str| b["descriptor_key"].as_str().unwrap_or(default).to_owned();
        let value = || b["descriptor_value"].as_str().unwrap_or("").to_owned();
        let expect = b["expect_match"]["value"] != false;
        entries.push(match kind.as_str() {
            "GenericKey" => (key("generic_key"), value()),
            "RequestHeaders" => (
                key("request_headers"),
                header(b["header_name"].as_str().unwrap())?,
            ),
            "HeaderValueMatch" => {
                let all = b["headers"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .all(|h| header(h["name"].as_str().unwrap()).as_deref() == Some(exact(h)));
                if all != expect {
                    return None;
                }
                (key("header_match"), value())
            }
            "QueryParameterValueMatch" => {
                let all = b["query_parameters"].as_array().unwrap().iter().all(|q| {
                    req.path
                        .contains(&format!("{}={}", q["name"].as_str().unwrap(), exact(q)))
                });
                if all != expect {
                    return None;
                }
                (key("query_match"), value())
            }
            "RemoteAddressMatch" => {
                let m = &b["address_matcher"];
                let inside = m["ranges"].as_array().unwrap().iter().any(|r| {
                    let prefix: std::net::Ipv4Addr =
                        r["address_prefix"].as_str().unwrap().parse().unwrap();
                    let len = r["prefix_len"]["value"].as_u64().unwrap_or(0) as u32;
                    let mask = if len == 0 { 0 } else { u32::MAX << (32 - len) };
                    u32::from(prefix) & mask == u32::from_be_bytes(CLIENT) & mask
                });
                if inside == m["invert_match"].as_bool().unwrap_or(false) {
                    return None;
                }
                (key("remote_address_match"), value())
            }
            other => panic!("an action the test does not know: {other}"),
        });
    }
    Some(entries)
}

/// The limit `entries` meet in `config` as envoyproxy/ratelimit matches them (each entry the
/// child with its key and value, else its key alone): (requests per unit, unit, shadow).
pub(crate) fn limit_of(
    config: &pb::RateLimitConfig,
    entries: &[(String, String)],
) -> Option<(u32, pb::RateLimitUnit, bool)> {
    let mut level = &config.descriptors;
    let mut found = None;
    for (k, v) in entries {
        let d = level
            .iter()
            .find(|d| d.key == *k && d.value == *v)
            .or_else(|| level.iter().find(|d| d.key == *k && d.value.is_empty()))?;
        found = Some(d);
        level = &d.descriptors;
    }
    let d = found?;
    let l = d.rate_limit.as_ref()?;
    if l.unlimited {
        return None;
    }
    Some((l.requests_per_unit, l.unit(), d.shadow_mode))
}
