//! The Helm chart: `helm lint --strict` and `helm template` over the default values and with
//! every optional feature switched on (`charts/ratelimitd/ci/all-on-values.yaml`), and the
//! rendered objects checked. helm comes from PATH, $HELM or target/tools/helm (`make deps`).

use std::path::{Path, PathBuf};
use std::process::Command;

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
        "--redis-key-prefix=ratelimit:",
        "--max-descriptors=32",
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
    assert!(env.iter().any(|e| e["name"] == "RATELIMITD_SHADOW_MODE"));
    assert!(
        of(&objects, "ConfigMap").is_none(),
        "an existing ConfigMap is used"
    );
    let volumes = d["spec"]["template"]["spec"]["volumes"].as_array().unwrap();
    assert_eq!(volumes[0]["configMap"]["name"], "my-limits");
    assert_eq!(volumes[1]["secret"]["secretName"], "redis-ca");
    // And the binary accepts them all (a value YAML would read as a mapping would not be a
    // string at all); the CA file exists only in the pod.
    let mut cli = vec!["ratelimitd".to_owned()];
    cli.extend(a.into_iter().filter(|a| !a.starts_with("--redis-tls-")));
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
        ("backend.redis.keyPrefix=a{b}", "keyPrefix"),
        ("backend.redis.url=http://x", "url"),
        ("nonsense=1", "nonsense"),
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
