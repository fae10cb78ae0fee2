//! Istio's `EnvoyFilter` patches applied to an ingress gateway's configuration as istiod
//! applies them (Istio 86c9f01, pilot/pkg/networking/core/envoyfilter: `HTTP_FILTER` inserted beside the
//! sub-filter it names in the listener's HTTP connection manager, `VIRTUAL_HOST` and
//! `HTTP_ROUTE` merged into every virtual host or route they match, a proto merge: messages
//! field by field, lists appended, map entries and `Any`s replaced), so that the result runs in
//! a real Envoy. Only what the shipped patches use is applied; anything else fails the test.

use serde_json::Value;

/// The cluster the gateway routes to (a VirtualService's destination, named as istiod names
/// its outbound clusters).
pub(crate) const UPSTREAM: &str = "outbound|9080||productpage.default.svc.cluster.local";

/// An ingress gateway as istiod configures one for a `Gateway` on port 80 (listener
/// 0.0.0.0_8080, route configuration http.8080, a virtual host `*:80`) with a VirtualService
/// sending everything to productpage: `use_remote_address: true` as istiod sets on gateways,
/// and the HTTP filters of upstream Envoy that istiod puts before the router (its own
/// `istio.*` filters are not in Envoy's release binary, and no patch here names them). The
/// ratelimit service's cluster is what istiod makes of the `ratelimit` Service's port 8081
/// (`grpc-port`: HTTP/2), with istiod's default circuit breakers. Ports are the examples'
/// (10000, 9000, 8081), rewritten by [`super::envoy::Envoy::start`].
const GATEWAY: &str = r#"
static_resources:
  listeners:
    - name: 0.0.0.0_8080
      address:
        socket_address: { address: 0.0.0.0, port_value: 10000 }
      filter_chains:
        - filters:
            - name: envoy.filters.network.http_connection_manager
              typed_config:
                "@type": type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager
                stat_prefix: outbound_0.0.0.0_8080
                use_remote_address: true
                route_config:
                  name: http.8080
                  virtual_hosts:
                    - name: "*:80"
                      domains: ["*"]
                      routes:
                        - name: productpage
                          match: { prefix: "/" }
                          route: { cluster: "outbound|9080||productpage.default.svc.cluster.local" }
                http_filters:
                  - name: envoy.filters.http.fault
                    typed_config:
                      "@type": type.googleapis.com/envoy.extensions.filters.http.fault.v3.HTTPFault
                  - name: envoy.filters.http.cors
                    typed_config:
                      "@type": type.googleapis.com/envoy.extensions.filters.http.cors.v3.Cors
                  - name: envoy.filters.http.router
                    typed_config:
                      "@type": type.googleapis.com/envoy.extensions.filters.http.router.v3.Router
  clusters:
    - name: "outbound|9080||productpage.default.svc.cluster.local"
      type: STATIC
      load_assignment:
        cluster_name: "outbound|9080||productpage.default.svc.cluster.local"
        endpoints:
          - lb_endpoints:
              - endpoint:
                  address:
                    socket_address: { address: 127.0.0.1, port_value: 9000 }
    - name: "outbound|8081||ratelimit.default.svc.cluster.local"
      type: STATIC
      # istiod's default thresholds on every outbound cluster (no DestinationRule).
      circuit_breakers:
        thresholds:
          - max_connections: 4294967295
            max_pending_requests: 4294967295
            max_requests: 4294967295
            max_retries: 4294967295
            track_remaining: true
      typed_extension_protocol_options:
        envoy.extensions.upstreams.http.v3.HttpProtocolOptions:
          "@type": type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions
          explicit_http_config:
            http2_protocol_options: {}
      load_assignment:
        cluster_name: "outbound|8081||ratelimit.default.svc.cluster.local"
        endpoints:
          - lb_endpoints:
              - endpoint:
                  address:
                    socket_address: { address: 127.0.0.1, port_value: 8081 }
"#;

/// The gateway with every `EnvoyFilter` in `manifests` (paths under the repository, each a
/// multi-document YAML file) applied in order, as YAML for [`super::envoy::Envoy::start`].
pub(crate) fn gateway_with(manifests: &[&str]) -> String {
    let mut config: Value = serde_saphyr::from_str(GATEWAY).unwrap();
    let mut applied = 0;
    for path in manifests {
        let text = std::fs::read_to_string(super::envoy::root().join(path)).unwrap();
        for doc in text.split("\n---\n") {
            let doc: Value = serde_saphyr::from_str(doc).unwrap();
            if doc["kind"] != "EnvoyFilter" {
                continue;
            }
            assert_eq!(
                doc["spec"]["workloadSelector"]["labels"]["istio"], "ingressgateway",
                "{path}: a gateway's filter"
            );
            for patch in doc["spec"]["configPatches"].as_array().unwrap() {
                apply(&mut config, patch, path);
                applied += 1;
            }
        }
    }
    assert!(applied > 0, "no EnvoyFilter in {manifests:?}");
    serde_saphyr::to_string(&config).unwrap()
}

fn apply(config: &mut Value, patch: &Value, path: &str) {
    let m = &patch["match"];
    assert!(
        matches!(m["context"].as_str(), Some("GATEWAY") | Some("ANY") | None),
        "{path}: {m}"
    );
    let op = patch["patch"]["operation"].as_str().unwrap();
    let value = patch["patch"]["value"].clone();
    let mut hits = 0;
    match patch["applyTo"].as_str().unwrap() {
        "HTTP_FILTER" => {
            let l = &m["listener"]["filterChain"]["filter"];
            for hcm in network_filters(config, l["name"].as_str().unwrap()) {
                let filters = hcm["typed_config"]["http_filters"].as_array_mut().unwrap();
                let sub = l["subFilter"]["name"].as_str();
                let at = sub.and_then(|n| filters.iter().position(|f| f["name"] == n));
                let index = match (op, at) {
                    ("INSERT_BEFORE", Some(i)) => i,
                    ("INSERT_AFTER", Some(i)) => i + 1,
                    ("INSERT_FIRST", _) => 0,
                    ("ADD", _) => filters.len(),
                    (_, None) if sub.is_some() => continue,
                    (op, _) => panic!("{path}: HTTP_FILTER {op} is not applied here"),
                };
                filters.insert(index, value.clone());
                hits += 1;
            }
        }
        "VIRTUAL_HOST" | "HTTP_ROUTE" => {
            assert_eq!(op, "MERGE", "{path}: only MERGE is applied here");
            let vm = &m["routeConfiguration"]["vhost"];
            for vh in virtual_hosts(config) {
                let name = vm["name"].as_str().unwrap_or("");
                if !name.is_empty() && vh["name"] != name {
                    continue;
                }
                if patch["applyTo"] == "VIRTUAL_HOST" {
                    merge(vh, &value);
                    hits += 1;
                    continue;
                }
                for route in vh["routes"].as_array_mut().unwrap() {
                    let rm = &vm["route"];
                    let name = rm["name"].as_str().unwrap_or("");
                    if name.is_empty() || route["name"] == name {
                        merge(route, &value);
                        hits += 1;
                    }
                }
            }
        }
        other => panic!("{path}: applyTo {other} is not applied here"),
    }
    assert!(hits > 0, "{path}: a patch that matched nothing: {patch}");
}

/// The listeners' network filters named `name`.
fn network_filters<'a>(config: &'a mut Value, name: &str) -> Vec<&'a mut Value> {
    let mut out = Vec::new();
    for l in config["static_resources"]["listeners"]
        .as_array_mut()
        .unwrap()
    {
        for chain in l["filter_chains"].as_array_mut().unwrap() {
            for f in chain["filters"].as_array_mut().unwrap() {
                if f["name"] == name {
                    out.push(f);
                }
            }
        }
    }
    out
}

/// Every virtual host of every HTTP connection manager's route configuration.
fn virtual_hosts(config: &mut Value) -> Vec<&mut Value> {
    network_filters(config, "envoy.filters.network.http_connection_manager")
        .into_iter()
        .flat_map(|hcm| {
            hcm["typed_config"]["route_config"]["virtual_hosts"]
                .as_array_mut()
                .unwrap()
                .iter_mut()
        })
        .collect()
}

/// A proto merge of `src` into `dst`, on their JSON forms: an `Any` (an object with `@type`)
/// or a map's entry (`typed_per_filter_config`) replaced, other messages merged field by
/// field, lists appended, scalars replaced.
fn merge(dst: &mut Value, src: &Value) {
    match (dst, src) {
        (Value::Object(d), Value::Object(s)) if !s.contains_key("@type") => {
            for (k, v) in s {
                match d.get_mut(k) {
                    Some(Value::Object(entries)) if k == "typed_per_filter_config" => {
                        for (name, any) in v.as_object().unwrap() {
                            entries.insert(name.clone(), any.clone());
                        }
                    }
                    Some(existing) => merge(existing, v),
                    None => {
                        d.insert(k.clone(), v.clone());
                    }
                }
            }
        }
        (Value::Array(d), Value::Array(s)) => d.extend(s.iter().cloned()),
        (d, s) => *d = s.clone(),
    }
}
