//! The Helm chart: `helm lint --strict` and `helm template` over the default values and with
//! every optional feature switched on (`charts/ratelimitd/ci/all-on-values.yaml`), and the
//! rendered objects checked. helm comes from PATH, $HELM or target/tools/helm (`make deps`).

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::Command;

use common::*;
use promql_parser::parser::{Expr, LabelModifier};
use serde_json::Value;

fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

fn helm() -> Option<PathBuf> {
    let candidates = [
        std::env::var_os("HELM").map(PathBuf::from),
        Some(PathBuf::from("helm")),
        Some(root().join("target/tools/helm")),
    ];
    for c in candidates.into_iter().flatten() {
        if Command::new(&c)
            .arg("version")
            .output()
            .is_ok_and(|o| o.status.success())
        {
            return Some(c);
        }
    }
    assert!(
        std::env::var_os("RATELIMITD_REQUIRE_HELM").is_none(),
        "helm required but not found (make deps installs it into target/tools)"
    );
    eprintln!("skipping: no helm");
    None
}

fn run(helm: &Path, args: &[&str]) -> Result<String, String> {
    let out = Command::new(helm)
        .args(args)
        .current_dir(root())
        .output()
        .unwrap();
    let text =
        String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr);
    if out.status.success() {
        Ok(text)
    } else {
        Err(text)
    }
}

/// Rendered objects, by kind.
fn template(helm: &Path, extra: &[&str]) -> Vec<Value> {
    let mut args = vec!["template", "rl", "charts/ratelimitd"];
    args.extend_from_slice(extra);
    let text = run(helm, &args).unwrap_or_else(|e| panic!("{e}"));
    text.split("\n---\n")
        .map(|d| serde_saphyr::from_str::<Value>(d).unwrap_or_else(|e| panic!("{e}\n{d}")))
        .filter(|v| !v.is_null())
        .collect()
}

fn of<'a>(objects: &'a [Value], kind: &str) -> Option<&'a Value> {
    objects.iter().find(|o| o["kind"] == kind)
}

fn args(deployment: &Value) -> Vec<String> {
    deployment["spec"]["template"]["spec"]["containers"][0]["args"]
        .as_array()
        .unwrap()
        .iter()
        .map(|a| a.as_str().unwrap().to_owned())
        .collect()
}

#[test]
fn lint_is_strict_clean_with_defaults_and_every_feature() {
    let Some(helm) = helm() else { return };
    run(&helm, &["lint", "--strict", "charts/ratelimitd"]).unwrap();
    run(
        &helm,
        &[
            "lint",
            "--strict",
            "charts/ratelimitd",
            "-f",
            "charts/ratelimitd/ci/all-on-values.yaml",
        ],
    )
    .unwrap();
}

#[test]
fn defaults_render_a_safe_deployment_reading_a_valid_config() {
    let Some(helm) = helm() else { return };
    let objects = template(&helm, &[]);
    let d = of(&objects, "Deployment").unwrap();
    let pod = &d["spec"]["template"]["spec"];
    let c = &pod["containers"][0];
    assert_eq!(
        d["spec"]["replicas"], 1,
        "one replica: the memory backend counts per replica"
    );
    assert_eq!(pod["securityContext"]["runAsNonRoot"], true);
    assert_eq!(c["securityContext"]["readOnlyRootFilesystem"], true);
    assert_eq!(c["securityContext"]["allowPrivilegeEscalation"], false);
    assert_eq!(c["readinessProbe"]["grpc"]["port"], 8081);
    assert_eq!(c["readinessProbe"]["grpc"]["service"], "ratelimit");
    assert_eq!(c["livenessProbe"]["grpc"]["port"], 8081);
    assert!(
        d["spec"]["template"]["metadata"]["annotations"]["checksum/config"]
            .as_str()
            .is_some_and(|s| s.len() == 64)
    );
    let mount = &c["volumeMounts"][0];
    assert_eq!(mount["mountPath"], "/etc/ratelimitd/limits");
    assert!(
        mount.get("subPath").is_none(),
        "a subPath mount never updates"
    );
    assert!(args(d).contains(&"--config=/etc/ratelimitd/limits".to_owned()));
    assert!(
        !args(d).iter().any(|a| a.starts_with("--backend")),
        "memory"
    );
    // The rendered config is one ratelimitd loads.
    let cm = of(&objects, "ConfigMap").unwrap();
    let config = cm["data"]["config.yaml"].as_str().unwrap();
    ratelimitd::testing::compile_file(Path::new("config.yaml"), config).unwrap();
    // Every flag the chart passes is one the binary accepts.
    let mut cli = vec!["ratelimitd".to_owned()];
    cli.extend(args(d));
    ratelimitd::settings::parse(cli, |_| None).unwrap();
    let svc = of(&objects, "Service").unwrap();
    assert_eq!(svc["spec"]["ports"][0]["port"], 8081);
    for absent in [
        "HorizontalPodAutoscaler",
        "PodDisruptionBudget",
        "ServiceMonitor",
    ] {
        assert!(of(&objects, absent).is_none(), "{absent} is off by default");
    }
}

/// A pod being deleted drains before it stops, and the kubelet waits for both: the drain delay
/// and the shutdown grace reach the binary, and the termination grace period covers their sum.
#[test]
fn the_termination_grace_covers_the_drain_and_the_calls_in_flight() {
    let Some(helm) = helm() else { return };
    for (extra, drain, grace) in [
        (&[][..], 5, 10),
        (
            &[
                "--set",
                "shutdown.drainDelaySeconds=30",
                "--set",
                "shutdown.shutdownGraceSeconds=2",
            ][..],
            30,
            2,
        ),
    ] {
        let objects = template(&helm, extra);
        let d = of(&objects, "Deployment").unwrap();
        let a = args(d);
        assert!(a.contains(&format!("--drain-delay={drain}s")), "{a:?}");
        assert!(a.contains(&format!("--shutdown-grace={grace}s")), "{a:?}");
        let period = d["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
            .as_u64()
            .unwrap();
        assert!(period > drain + grace, "{period} for {drain} + {grace}");
    }
}

/// The dashboard's table of who is being limited reads `ratelimit_top_*`, which the service
/// exports only with `--top-metrics`: on a default install with the dashboard on, it is filled.
#[test]
fn the_dashboards_table_is_filled_on_a_default_install() {
    let Some(helm) = helm() else { return };
    let objects = template(&helm, &["--set", "dashboard.enabled=true"]);
    let dashboard = objects
        .iter()
        .find(|o| o["kind"] == "ConfigMap" && o["metadata"]["name"] == "rl-ratelimitd-dashboard")
        .expect("the dashboard's ConfigMap");
    let json = serde_json::to_string(&dashboard["data"]).unwrap();
    assert!(json.contains("ratelimit_top_hits"), "the table reads it");
    let d = of(&objects, "Deployment").unwrap();
    let n: usize = args(d)
        .iter()
        .find_map(|a| a.strip_prefix("--top-metrics="))
        .expect("--top-metrics is passed")
        .parse()
        .unwrap();
    assert!(n > 0, "--top-metrics={n} leaves the table empty");
}

#[test]
fn every_feature_switched_on() {
    let Some(helm) = helm() else { return };
    let objects = template(&helm, &["-f", "charts/ratelimitd/ci/all-on-values.yaml"]);
    let d = of(&objects, "Deployment").unwrap();
    assert!(
        d["spec"].get("replicas").is_none(),
        "the HPA owns the replicas"
    );
    let a = args(d);
    for expected in [
        "--backend=redis",
        "--redis-sentinel-nodes=redis://sentinel-0:26379,redis://sentinel-1:26379",
        "--redis-sentinel-master=mymaster",
        "--redis-failure-mode=local",
        "--redis-hash-tag=descriptor",
        "--redis-tls",
        "--redis-tls-ca=/etc/ratelimitd/redis-tls/ca.crt",
        "--redis-tls-cert=/etc/ratelimitd/redis-tls/tls.crt",
        "--redis-tls-key=/etc/ratelimitd/redis-tls/tls.key",
        "--response-headers=draft03",
        "--calendar-timezone=America/New_York",
        "--top-values=hash",
        "--top-metrics=5",
        "--redis-key-prefix=ratelimit:",
        "--max-descriptors=32",
        "--grpc-max-connection-age=2h",
        "--grpc-max-connection-age-grace=5m",
        "--redis-per-second-cluster-nodes=redis://fast-0:6379,redis://fast-1:6379",
        "--redis-per-second-tls",
        "--admin-addr=0.0.0.0:9191",
        "--admin-token-file=/etc/ratelimitd/admin/tokens",
    ] {
        assert!(a.contains(&expected.to_owned()), "{expected} in {a:?}");
    }
    let c = &d["spec"]["template"]["spec"]["containers"][0];
    let env = c["env"].as_array().unwrap();
    let password = env
        .iter()
        .find(|e| e["name"] == "RATELIMITD_REDIS_PASSWORD")
        .unwrap();
    assert_eq!(password["valueFrom"]["secretKeyRef"]["name"], "redis-auth");
    assert_eq!(
        password["valueFrom"]["secretKeyRef"]["key"],
        "redis-password"
    );
    let fast = env
        .iter()
        .find(|e| e["name"] == "RATELIMITD_REDIS_PER_SECOND_PASSWORD")
        .unwrap();
    assert_eq!(fast["valueFrom"]["secretKeyRef"]["name"], "redis-fast-auth");
    assert_eq!(fast["valueFrom"]["secretKeyRef"]["key"], "password");
    assert!(env.iter().any(|e| e["name"] == "RATELIMITD_SHADOW_MODE"));
    assert!(
        !objects
            .iter()
            .any(|o| o["kind"] == "ConfigMap" && o["metadata"]["name"] == "rl-ratelimitd"),
        "an existing ConfigMap is used"
    );
    let volumes = d["spec"]["template"]["spec"]["volumes"].as_array().unwrap();
    assert_eq!(volumes[0]["configMap"]["name"], "my-limits");
    assert_eq!(volumes[1]["secret"]["secretName"], "redis-ca");
    assert_eq!(
        volumes[2]["secret"]["secretName"],
        "ratelimitd-admin-tokens"
    );
    // The admin port: its own Service, and a NetworkPolicy that opens it to the operators'
    // namespaces only while Envoy's ports stay open.
    let admin_service = objects
        .iter()
        .find(|o| o["kind"] == "Service" && o["metadata"]["name"] == "rl-ratelimitd-admin")
        .expect("the admin Service");
    assert_eq!(admin_service["spec"]["ports"][0]["port"], 9191);
    let envoy_service = objects
        .iter()
        .find(|o| o["kind"] == "Service" && o["metadata"]["name"] == "rl-ratelimitd")
        .unwrap();
    assert!(
        envoy_service["spec"]["ports"]
            .as_array()
            .unwrap()
            .iter()
            .all(|p| p["name"] != "admin"),
        "Envoy's Service never exposes the admin port"
    );
    let policy = of(&objects, "NetworkPolicy").expect("the NetworkPolicy");
    let rules = policy["spec"]["ingress"].as_array().unwrap();
    assert_eq!(rules[0]["ports"].as_array().unwrap().len(), 2);
    assert!(rules[0].get("from").is_none());
    assert_eq!(
        rules[1]["from"][0]["namespaceSelector"]["matchLabels"]["kubernetes.io/metadata.name"],
        "operators"
    );
    assert_eq!(rules[1]["ports"][0]["port"], "admin");
    // And the binary accepts them all (a value YAML would read as a mapping would not be a
    // string at all); the CA and token files exist only in the pod.
    let mut cli = vec!["ratelimitd".to_owned()];
    cli.extend(
        a.into_iter()
            .filter(|a| !a.starts_with("--redis-tls-") && !a.starts_with("--admin-")),
    );
    ratelimitd::settings::parse(cli, |_| None).unwrap();
    let hpa = of(&objects, "HorizontalPodAutoscaler").unwrap();
    assert_eq!(hpa["spec"]["maxReplicas"], 12);
    assert_eq!(
        of(&objects, "PodDisruptionBudget").unwrap()["spec"]["minAvailable"],
        1
    );
    let sm = of(&objects, "ServiceMonitor").unwrap();
    assert_eq!(sm["spec"]["endpoints"][0]["path"], "/metrics");
    assert_eq!(sm["metadata"]["labels"]["release"], "prometheus");
}

#[test]
fn the_schema_refuses_bad_values() {
    let Some(helm) = helm() else { return };
    for (set, says) in [
        ("backend.type=etcd", "backend/type"),
        ("responseHeaders=on", "responseHeaders"),
        ("calendarTimezone=Europe/Berlin;rm", "calendarTimezone"),
        ("top.values=plain", "values"),
        ("backend.redis.keyPrefix=a{b}", "keyPrefix"),
        ("backend.redis.url=http://x", "url"),
        ("nonsense=1", "nonsense"),
        ("shutdown.drainDelaySeconds=-1", "drainDelaySeconds"),
    ] {
        let err = run(
            &helm,
            &["template", "rl", "charts/ratelimitd", "--set", set],
        )
        .unwrap_err();
        assert!(err.contains(says), "{set}: {err}");
    }
    let err = run(
        &helm,
        &[
            "template",
            "rl",
            "charts/ratelimitd",
            "--set",
            "backend.type=redis",
        ],
    )
    .unwrap_err();
    assert!(err.contains("needs backend.redis.url"), "{err}");
}

/// The memory backend counts in each replica alone: a default install must not multiply every
/// limit, so more than one replica (or autoscaling) on it is refused unless asked for.
#[test]
fn more_than_one_memory_replica_is_an_explicit_choice() {
    let Some(helm) = helm() else { return };
    for set in ["replicaCount=2", "autoscaling.enabled=true"] {
        let err = run(
            &helm,
            &["template", "rl", "charts/ratelimitd", "--set", set],
        )
        .unwrap_err();
        assert!(
            err.contains("backend.memory.countPerReplica"),
            "{set}: {err}"
        );
        let objects = template(
            &helm,
            &["--set", set, "--set", "backend.memory.countPerReplica=true"],
        );
        assert!(of(&objects, "Deployment").is_some(), "{set}");
    }
    let objects = template(
        &helm,
        &[
            "--set",
            "replicaCount=3",
            "--set",
            "backend.type=redis",
            "--set",
            "backend.redis.url=redis://redis:6379",
        ],
    );
    assert_eq!(of(&objects, "Deployment").unwrap()["spec"]["replicas"], 3);
}

/// `backend.redis.tls.mutual` presents the Secret's client certificate and key, not only its CA.
#[test]
fn mutual_tls_to_redis_passes_the_client_certificate() {
    let Some(helm) = helm() else { return };
    let base = [
        "--set",
        "backend.type=redis",
        "--set",
        "backend.redis.url=rediss://redis:6379",
        "--set",
        "backend.redis.tls.enabled=true",
        "--set",
        "backend.redis.tls.mutual=true",
    ];
    let err = run(
        &helm,
        &[&["template", "rl", "charts/ratelimitd"][..], &base[..]].concat(),
    )
    .unwrap_err();
    assert!(
        err.contains("needs backend.redis.tls.existingSecret"),
        "{err}"
    );
    let objects = template(
        &helm,
        &[
            &base[..],
            &["--set", "backend.redis.tls.existingSecret=redis-mtls"],
        ]
        .concat(),
    );
    let a = args(of(&objects, "Deployment").unwrap());
    for flag in [
        "--redis-tls-ca=/etc/ratelimitd/redis-tls/ca.crt",
        "--redis-tls-cert=/etc/ratelimitd/redis-tls/tls.crt",
        "--redis-tls-key=/etc/ratelimitd/redis-tls/tls.key",
    ] {
        assert!(a.contains(&flag.to_owned()), "{flag} in {a:?}");
    }
}

/// The metric families a scrape of `/metrics` shows, each with the label names its samples carry
/// (`le` on a histogram's buckets), under every name a query may use: a counter's `_total`, a
/// histogram's `_bucket`, `_sum` and `_count`, a gauge's own.
fn exported(scrapes: &[String]) -> BTreeMap<String, BTreeSet<String>> {
    let mut names = BTreeMap::<String, BTreeSet<String>>::new();
    for text in scrapes {
        for line in text.lines() {
            if let Some(rest) = line.strip_prefix("# TYPE ") {
                let mut parts = rest.split_whitespace();
                let (family, kind) = (parts.next().unwrap(), parts.next().unwrap());
                let suffixes: &[&str] = match kind {
                    "counter" => &["_total"],
                    "histogram" => &["_bucket", "_sum", "_count"],
                    _ => &[""],
                };
                for suffix in suffixes {
                    names.entry(format!("{family}{suffix}")).or_default();
                }
            } else if !line.starts_with('#') && !line.is_empty() {
                let name_end = line.find(['{', ' ']).unwrap();
                let labels = names.entry(line[..name_end].to_owned()).or_default();
                if let Some(set) = line[name_end..].strip_prefix('{') {
                    let set = &set[..set.rfind('}').unwrap()];
                    for pair in set.split("\",") {
                        if let Some((name, _)) = pair.split_once('=') {
                            labels.insert(name.trim_start_matches(',').to_owned());
                        }
                    }
                }
            }
        }
    }
    names
}

/// Labels Prometheus gives every series of a target (a ServiceMonitor's).
const TARGET_LABELS: [&str; 6] = [
    "job",
    "namespace",
    "pod",
    "instance",
    "service",
    "container",
];

/// What one query names: metrics, and for each the label names of its matchers; and the labels
/// it groups or matches by.
#[derive(Default)]
struct Named {
    metrics: BTreeMap<String, BTreeSet<String>>,
    grouping: BTreeSet<String>,
}

impl promql_parser::util::ExprVisitor for Named {
    type Error = String;

    fn pre_visit(&mut self, expr: &Expr) -> Result<bool, String> {
        let modifier = |m: &Option<LabelModifier>| {
            m.as_ref()
                .map(|m| m.labels().labels.clone())
                .unwrap_or_default()
        };
        // The walk does not enter a range's selector (`x[5m]`): taken here.
        let selector = match expr {
            Expr::VectorSelector(vs) => Some(vs),
            Expr::MatrixSelector(ms) => Some(&ms.vs),
            _ => None,
        };
        if let Some(vs) = selector {
            let name = vs.name.clone().ok_or("a selector without a metric name")?;
            let labels = self.metrics.entry(name).or_default();
            labels.extend(vs.matchers.matchers.iter().map(|m| m.name.clone()));
        }
        match expr {
            Expr::Aggregate(a) => self.grouping.extend(modifier(&a.modifier)),
            Expr::Binary(b) => {
                if let Some(m) = &b.modifier {
                    self.grouping.extend(modifier(&m.matching));
                }
            }
            _ => {}
        }
        Ok(true)
    }
}

/// Parses `query` as Prometheus would once Grafana has put in its interval.
fn named(query: &str) -> Named {
    let query = query.replace("$__rate_interval", "5m");
    let expr = promql_parser::parser::parse(&query).unwrap_or_else(|e| panic!("{query}: {e}"));
    let mut named = Named::default();
    promql_parser::util::walk_expr(&mut named, &expr).unwrap();
    named
}

/// Every query of the chart's dashboard and alerts parses as PromQL, and names only metrics the
/// service exports, with labels their samples carry (or a target's); the alert rules pass
/// `promtool check rules` and fire in `promtool test rules` where promtool is installed.
#[tokio::test]
async fn the_dashboard_and_the_alerts_ask_only_for_what_the_service_exports() {
    let Some(helm) = helm() else { return };
    let objects = template(&helm, &["-f", "charts/ratelimitd/ci/all-on-values.yaml"]);
    let dashboard = objects
        .iter()
        .find(|o| o["kind"] == "ConfigMap" && o["metadata"]["name"] == "rl-ratelimitd-dashboard")
        .expect("the dashboard's ConfigMap");
    assert_eq!(dashboard["metadata"]["labels"]["grafana_dashboard"], "1");
    let dashboard: Value =
        serde_json::from_str(dashboard["data"]["ratelimitd.json"].as_str().unwrap()).unwrap();
    let mut queries = Vec::new();
    for panel in dashboard["panels"].as_array().unwrap() {
        for target in panel["targets"].as_array().into_iter().flatten() {
            queries.push(target["expr"].as_str().unwrap().to_owned());
        }
    }
    // Variables: label_values(<selector>, <label>), Grafana's own function around a selector.
    for var in dashboard["templating"]["list"].as_array().unwrap() {
        if let Some(q) = var["query"]["query"].as_str() {
            let inner = q
                .strip_prefix("label_values(")
                .unwrap()
                .strip_suffix(')')
                .unwrap();
            let (selector, label) = inner.rsplit_once(',').unwrap();
            queries.push(format!("count by ({}) ({selector})", label.trim()));
        }
    }
    let rules = of(&objects, "PrometheusRule").expect("the PrometheusRule");
    let alerts: Vec<&Value> = rules["spec"]["groups"][0]["rules"]
        .as_array()
        .unwrap()
        .iter()
        .collect();
    assert_eq!(alerts.len(), 6, "every alert is on in all-on-values");
    queries.extend(
        alerts
            .iter()
            .map(|r| r["expr"].as_str().unwrap().to_owned()),
    );
    assert!(queries.len() >= 30, "{}", queries.len());

    // Scrapes of a memory and a Redis server that have decided a request and taken a place, so
    // that the families of both backends carry samples, and so labels.
    const CONFIG: &str = "domain: d
descriptors:
  - key: k
    rate_limit: {unit: second, requests_per_unit: 1}
  - key: tenant
    hold_key: request_id
    rate_limit: {algorithm: concurrency, unit: minute, requests_per_unit: 1}
";
    let mut scrapes = Vec::new();
    for kind in [Kind::Memory, Kind::Redis] {
        let s = start(kind, &[("d.yaml", CONFIG)], &["--top-metrics", "3"]).await;
        let mut c = s.client().await;
        call(&mut c, request("d", &[&[("k", "v")]])).await;
        call(&mut c, request("d", &[&[("k", "v")]])).await;
        let place = request("d", &[&[("tenant", "t"), ("request_id", "r")]]);
        assert!(is_ok(&call(&mut c, place).await), "{kind:?}: a place");
        scrapes.push(s.http_get("/metrics").await.1);
    }
    let exported = exported(&scrapes);
    let mut missing = Vec::new();
    for query in &queries {
        let named = named(query);
        for (metric, labels) in &named.metrics {
            let Some(has) = exported.get(metric) else {
                missing.push(format!("{metric} (in {query})"));
                continue;
            };
            // A family without samples shows no labels to check against.
            if has.is_empty() {
                continue;
            }
            for label in labels.iter().chain(&named.grouping) {
                if !has.contains(label)
                    && !TARGET_LABELS.contains(&label.as_str())
                    && label != "__name__"
                {
                    missing.push(format!("label {label} of {metric} (in {query})"));
                }
            }
        }
    }
    assert!(missing.is_empty(), "not exported: {missing:#?}");

    promtool_checks(&rules["spec"]);
}

fn promtool() -> Option<PathBuf> {
    let found = Command::new("promtool")
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success());
    if !found {
        assert!(
            std::env::var_os("RATELIMITD_REQUIRE_PROMTOOL").is_none(),
            "RATELIMITD_REQUIRE_PROMTOOL is set but promtool is not installed (scripts/promtool.sh)"
        );
        eprintln!(
            "promtool not installed: the alert rules are not checked by it (scripts/promtool.sh installs it)"
        );
    }
    found.then(|| PathBuf::from("promtool"))
}

/// `promtool check rules` over the rendered groups, and `promtool test rules`: each alert fires
/// on the series it is about, after its `for`, and stays quiet on a healthy replica.
fn promtool_checks(spec: &Value) {
    let Some(promtool) = promtool() else { return };
    let dir = tempfile::tempdir().unwrap();
    let rules = dir.path().join("rules.yaml");
    std::fs::write(&rules, serde_json::to_string(spec).unwrap()).unwrap();
    let test = dir.path().join("test.yaml");
    std::fs::write(&test, ALERT_TESTS).unwrap();
    // The test names its rule file relative to itself.
    for (what, file) in [("check", &rules), ("test", &test)] {
        run(&promtool, &[what, "rules", file.to_str().unwrap()])
            .unwrap_or_else(|e| panic!("promtool {what} rules: {e}"));
    }
}

/// Series of two replicas over 30 minutes, one healthy (`a`) and one in trouble (`b`), and which
/// alerts must be firing for `b` (and none for `a`) when. all-on-values' latency bound is 20 ms.
const ALERT_TESTS: &str = r#"
rule_files: [rules.yaml]
evaluation_interval: 1m
tests:
  - interval: 1m
    input_series:
      - series: 'ratelimit_failure_mode_decisions_total{job="rl-ratelimitd", namespace="default", pod="b", mode="allow"}'
        values: '0 0 0 0 0 60+60x25'
      - series: 'ratelimit_backend_up{job="rl-ratelimitd", namespace="default", pod="a"}'
        values: '1x30'
      - series: 'ratelimit_backend_up{job="rl-ratelimitd", namespace="default", pod="b"}'
        values: '1 1 1 1 1 0x25'
      - series: 'ratelimit_config_last_load_success{job="rl-ratelimitd", namespace="default", pod="a"}'
        values: '1x30'
      - series: 'ratelimit_config_last_load_success{job="rl-ratelimitd", namespace="default", pod="b"}'
        values: '1 1 1 1 1 0x25'
      - series: 'ratelimit_memory_evictions_total{job="rl-ratelimitd", namespace="default", pod="a"}'
        values: '0x30'
      - series: 'ratelimit_memory_evictions_total{job="rl-ratelimitd", namespace="default", pod="b"}'
        values: '0 0 0 0 0 100+100x25'
      - series: 'ratelimit_request_duration_seconds_bucket{job="rl-ratelimitd", namespace="default", pod="b", le="0.01"}'
        values: '0+1000x30'
      - series: 'ratelimit_request_duration_seconds_bucket{job="rl-ratelimitd", namespace="default", pod="b", le="0.05"}'
        values: '0+1100x30'
      - series: 'ratelimit_request_duration_seconds_bucket{job="rl-ratelimitd", namespace="default", pod="b", le="+Inf"}'
        values: '0+1100x30'
      - series: 'ratelimit_rule_hits_total{job="rl-ratelimitd", namespace="default", pod="a", domain="d", rule="user", limit="0"}'
        values: '0+600x30'
      - series: 'ratelimit_rule_over_limit_hits_total{job="rl-ratelimitd", namespace="default", pod="a", domain="d", rule="user", limit="0"}'
        values: '0+60x5 300+300x25'
      - series: 'ratelimit_rule_hits_total{job="rl-ratelimitd", namespace="default", pod="a", domain="d", rule="global", limit="burst"}'
        values: '0+600x30'
      - series: 'ratelimit_rule_over_limit_hits_total{job="rl-ratelimitd", namespace="default", pod="a", domain="d", rule="global", limit="burst"}'
        values: '0x30'
    alert_rule_test:
      - {eval_time: 4m, alertname: RatelimitdCircuitOpen, exp_alerts: []}
      - eval_time: 10m
        alertname: RatelimitdCircuitOpen
        exp_alerts:
          - exp_labels: {severity: critical, namespace: default, job: rl-ratelimitd, pod: b}
            exp_annotations:
              summary: A ratelimitd replica's circuit to its backend is open.
              description: b in default cannot reach its backend; its requests are decided by the failure mode.
      - {eval_time: 8m, alertname: RatelimitdFailureModeAnswering, exp_alerts: []}
      - eval_time: 15m
        alertname: RatelimitdFailureModeAnswering
        exp_alerts:
          - exp_labels: {severity: warning, namespace: default, job: rl-ratelimitd, mode: allow}
            exp_annotations:
              summary: The rate-limit backend cannot decide; the failure mode answers.
              description: 'rl-ratelimitd in default answers 1 requests/s by its failure mode (allow): Redis is unreachable, slow or overloaded.'
      - {eval_time: 8m, alertname: RatelimitdConfigReloadFailing, exp_alerts: []}
      - eval_time: 15m
        alertname: RatelimitdConfigReloadFailing
        exp_alerts:
          - exp_labels: {severity: warning, namespace: default, job: rl-ratelimitd, pod: b}
            exp_annotations:
              summary: The last rate-limit config load failed; the previous config is in force.
              description: b in default refused its last config (see its log for the file, line and field); limits changed since are not in force.
      - {eval_time: 15m, alertname: RatelimitdMemoryBoundReached, exp_alerts: []}
      - eval_time: 25m
        alertname: RatelimitdMemoryBoundReached
        exp_alerts:
          - exp_labels: {severity: warning, namespace: default, job: rl-ratelimitd, pod: b}
            exp_annotations:
              summary: Counters are given up at the memory bound.
              description: b in default gives up 1.667 live counters/s at backend.memoryMaxBytes; each may admit up to its limit again. Raise the bound (and the memory limit) or use Redis.
      - {eval_time: 5m, alertname: RatelimitdSlowDecisions, exp_alerts: []}
      - eval_time: 15m
        alertname: RatelimitdSlowDecisions
        exp_alerts:
          - exp_labels: {severity: critical, namespace: default, job: rl-ratelimitd}
            exp_annotations:
              summary: ShouldRateLimit's p99 latency is above 0.02 s.
              description: rl-ratelimitd in default answers 1% of its calls in more than 45.6ms; Envoy gives up after its own timeout (20 ms by default).
      - {eval_time: 12m, alertname: RatelimitdRuleRefusing, exp_alerts: []}
      - eval_time: 28m
        alertname: RatelimitdRuleRefusing
        exp_alerts:
          - exp_labels: {severity: warning, namespace: default, job: rl-ratelimitd, domain: d, rule: user, limit: "0"}
            exp_annotations:
              summary: A rate-limit rule refuses more than 25% of its hits.
              description: Rule user (limit 0) of domain d in default is over its limit for 50% of its hits; /top?limit=user lists whom it refuses.
"#;
