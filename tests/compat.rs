//! envoyproxy/ratelimit's own config files, served unchanged, behave as their comments say.

mod common;

use std::sync::Arc;

use common::*;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::Code;
use ratelimitd::testing::SystemClock;

async fn serve_fixture(rel: &str) -> Option<TestServer> {
    let file = fixtures()?.join(rel);
    let dir = tempfile::tempdir().unwrap();
    Some(TestServer::start_at(dir, Some(file), &[], Arc::new(SystemClock)).await)
}

#[tokio::test]
async fn every_good_fixture_serves() {
    let Some(dir) = fixtures() else { return };
    for entry in std::fs::read_dir(dir.join("good")).unwrap() {
        let path = entry.unwrap().path();
        let rel = format!("good/{}", path.file_name().unwrap().to_str().unwrap());
        let mut s = serve_fixture(&rel).await.unwrap();
        let (status, dump) = s.http_get("/rlconfig").await;
        assert_eq!(status, 200, "{rel}");
        assert!(
            !dump.trim().is_empty() || rel.contains("example_config"),
            "{rel}: {dump}"
        );
        s.shutdown().await.unwrap();
    }
}

#[tokio::test]
async fn basic_config_limits_through_grpc() {
    let Some(s) = serve_fixture("good/basic_config.yaml").await else {
        return;
    };
    let mut c = s.client().await;
    // key1=value1, subkey1=subvalue1: 10 per second (the specific override of 5).
    let d: &[&[(&str, &str)]] = &[&[("key1", "value1"), ("subkey1", "subvalue1")]];
    let r = call(&mut c, request("test-domain", d)).await;
    assert_eq!(rpu_of(&r, 0), Some(10));
    // key3: 1 per hour.
    assert!(is_ok(
        &call(&mut c, request("test-domain", &[&[("key3", "a")]])).await
    ));
    assert!(is_over(
        &call(&mut c, request("test-domain", &[&[("key3", "a")]])).await
    ));
    // key4's named limit is reported by name.
    let r = call(&mut c, request("test-domain", &[&[("key4", "a")]])).await;
    assert_eq!(
        r.statuses[0].current_limit.as_ref().unwrap().name,
        "key4_rate_limit"
    );
    // key2=value3 is whitelisted; key6 unlimited.
    for d in [("key2", "value3"), ("key6", "x")] {
        for _ in 0..40 {
            assert!(is_ok(&call(&mut c, request("test-domain", &[&[d]])).await));
        }
    }
}

#[tokio::test]
async fn example_replaces_bans_and_shadows() {
    let Some(s) = serve_fixture("good/example.yaml").await else {
        return;
    };
    let mut c = s.client().await;
    // A 2/min limit that replaces "bkthomps" (1/min): the named one stops applying.
    let pair: &[&[(&str, &str)]] = &[
        &[
            ("source_cluster", "proxy"),
            ("destination_cluster", "bkthomps"),
        ],
        &[("foo", "f"), ("bar", "bkthomps")],
    ];
    for _ in 0..2 {
        let r = call(&mut c, request("rl", pair)).await;
        assert!(is_ok(&r));
        assert!(r.statuses[1].current_limit.is_none(), "replaced");
    }
    assert!(is_over(&call(&mut c, request("rl", pair)).await));
    // Alone, the bkthomps limit is 1/min.
    let alone: &[&[(&str, &str)]] = &[&[("foo", "g"), ("bar", "bkthomps")]];
    assert!(is_ok(&call(&mut c, request("rl", alone)).await));
    assert!(is_over(&call(&mut c, request("rl", alone)).await));
    // requests_per_unit 0 bans, unless a limit that replaces "banned_limit" applies too.
    let banned: &[&[(&str, &str)]] = &[&[("foo", "h"), ("bar", "banned")]];
    assert!(is_over(&call(&mut c, request("rl", banned)).await));
    let unbanned: &[&[(&str, &str)]] = &[
        &[("foo", "h"), ("bar", "banned")],
        &[
            ("source_cluster", "proxy"),
            ("destination_cluster", "override"),
        ],
    ];
    assert!(is_ok(&call(&mut c, request("rl", unbanned)).await));
    // Shadow mode: over its 3/min, still OK.
    let shady: &[&[(&str, &str)]] = &[&[("foo", "i"), ("baz", "shady")]];
    for _ in 0..5 {
        let r = call(&mut c, request("rl", shady)).await;
        assert!(is_ok(&r));
        assert_eq!(r.statuses[0].code, Code::Ok as i32);
    }
    // detailed_metric puts the value in the rule label; others never do.
    call(&mut c, request("rl", &[&[("unspec", "client-7")]])).await;
    let (_, m) = s.http_get("/metrics").await;
    assert!(m.contains(r#"rule="unspec_client-7""#), "{m}");
    assert!(
        m.contains(r#"rule="foo.baz_shady",decision="shadow_mode""#),
        "{m}"
    );
    assert!(!m.contains("f.bar_bkthomps"));
}

#[tokio::test]
async fn a_duplicate_domain_in_the_config_directory_is_refused_at_start() {
    let Some(dir) = fixtures() else { return };
    let config = tempfile::tempdir().unwrap();
    for rel in ["good/basic_config.yaml", "pairs/duplicate_domain.yaml"] {
        let name = rel.replace('/', "_");
        std::fs::copy(dir.join(rel), config.path().join(name)).unwrap();
    }
    let mut s = TestServer::start_at(config, None, &[], Arc::new(SystemClock)).await;
    let err = s.shutdown().await.unwrap_err().to_string();
    assert!(
        err.contains("pairs_duplicate_domain.yaml")
            && err.contains("duplicate domain 'test-domain'"),
        "{err}"
    );
}

#[tokio::test]
async fn the_example_limits_load_and_limit() {
    let dir = tempfile::tempdir().unwrap();
    let limits = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("examples/envoy/limits");
    let s = TestServer::start_at(dir, Some(limits), &[], Arc::new(SystemClock)).await;
    let mut c = s.client().await;
    let r = call(
        &mut c,
        request("edge", &[&[("path", "/login")], &[("path", "/healthz")]]),
    )
    .await;
    assert!(is_ok(&r));
    assert_eq!(rpu_of(&r, 0), Some(5));
    assert!(r.statuses[1].current_limit.is_none(), "unlimited");
    for _ in 0..4 {
        call(&mut c, request("edge", &[&[("path", "/login")]])).await;
    }
    assert!(is_over(
        &call(&mut c, request("edge", &[&[("path", "/login")]])).await
    ));
    // The descriptors of the example's generic_key and header_value_match actions.
    let r = call(
        &mut c,
        request(
            "edge",
            &[&[("generic_key", "edge")], &[("header_match", "post")]],
        ),
    )
    .await;
    assert_eq!((rpu_of(&r, 0), rpu_of(&r, 1)), (Some(1000), Some(60)));
}

/// The Istio manifests' ConfigMap holds a valid config, and the Deployment runs this image with
/// the environment of Istio's sample (read by the drop-in), mounting the ConfigMap as a
/// directory.
#[test]
fn the_istio_manifests_carry_a_valid_config_and_the_drop_in_environment() {
    let text = std::fs::read_to_string(
        std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("examples/envoy/istio-ratelimit.yaml"),
    )
    .unwrap();
    let docs: Vec<serde_json::Value> = text
        .split("\n---\n")
        .map(|d| serde_saphyr::from_str(d).unwrap())
        .collect();
    let kind = |k: &str| {
        docs.iter()
            .find(|d| d["kind"] == k)
            .unwrap_or_else(|| panic!("{k}"))
    };
    let config = kind("ConfigMap")["data"]["config.yaml"].as_str().unwrap();
    let domain =
        ratelimitd::testing::compile_file(std::path::Path::new("config.yaml"), config).unwrap();
    assert_eq!(domain.name.as_str(), "ratelimit");
    let pod = &kind("Deployment")["spec"]["template"]["spec"];
    let env = pod["containers"][0]["env"].as_array().unwrap();
    let var = |n: &str| {
        env.iter()
            .find(|e| e["name"] == n)
            .map(|e| e["value"].clone())
    };
    assert_eq!(var("RUNTIME_ROOT"), Some("/data".into()));
    assert_eq!(var("RUNTIME_SUBDIRECTORY"), Some("ratelimit".into()));
    let mount = &pod["containers"][0]["volumeMounts"][0];
    assert_eq!(mount["mountPath"], "/data/ratelimit/config");
    assert!(
        mount.get("subPath").is_none(),
        "a subPath mount never updates"
    );
    let ports: Vec<i64> = kind("Service")["spec"]["ports"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p["port"].as_i64().unwrap())
        .collect();
    assert_eq!(ports, vec![8080, 8081, 6070]);
}

/// Every YAML example in the README and docs/ is a valid config (fragments inside a domain).
#[test]
fn the_documented_examples_are_valid_configs() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut checked = 0;
    for page in documentation(root) {
        let text = std::fs::read_to_string(&page).unwrap();
        for block in text.split("```yaml\n").skip(1) {
            let yaml = block.split("```").next().unwrap();
            let text = if yaml.starts_with("domain:") {
                yaml.to_string()
            } else {
                format!("domain: readme\ndescriptors:\n{yaml}")
            };
            ratelimitd::testing::compile_file(&page, &text)
                .unwrap_or_else(|e| panic!("{e}\n{text}"));
            checked += 1;
        }
    }
    assert!(checked >= 6, "{checked} examples");
}

/// The README, docs/*.md and the chart's README.
fn documentation(root: &std::path::Path) -> Vec<std::path::PathBuf> {
    let mut pages = vec![
        root.join("README.md"),
        root.join("charts/ratelimitd/README.md"),
    ];
    let mut docs: Vec<_> = std::fs::read_dir(root.join("docs"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "md"))
        .collect();
    docs.sort();
    pages.extend(docs);
    pages
}

/// Every relative link in the documentation reaches a file (and a heading or anchor there).
#[test]
fn the_documentation_links_resolve() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut checked = 0;
    for page in documentation(root) {
        let text = std::fs::read_to_string(&page).unwrap();
        for link in text.split("](").skip(1) {
            let target = link.split(')').next().unwrap();
            if target.starts_with("http") || target.is_empty() {
                continue;
            }
            let (path, anchor) = target.split_once('#').unwrap_or((target, ""));
            let file = if path.is_empty() {
                page.clone()
            } else {
                page.parent().unwrap().join(path)
            };
            assert!(file.exists(), "{}: {target} does not exist", page.display());
            if !anchor.is_empty() {
                let linked = std::fs::read_to_string(&file).unwrap();
                let headings = linked.lines().filter_map(|l| {
                    let title = l.trim_start_matches('#');
                    (title.len() < l.len()).then(|| {
                        title
                            .trim()
                            .to_lowercase()
                            .chars()
                            .filter(|c| c.is_alphanumeric() || *c == ' ' || *c == '-')
                            .map(|c| if c == ' ' { '-' } else { c })
                            .collect::<String>()
                    })
                });
                let found = linked.contains(&format!("<a id=\"{anchor}\">"))
                    || headings.into_iter().any(|h| h == anchor);
                assert!(
                    found,
                    "{}: no anchor {anchor} in {}",
                    page.display(),
                    file.display()
                );
            }
            checked += 1;
        }
    }
    assert!(checked >= 20, "{checked} links");
}

/// docker-compose's Envoy config is the example's, with only the addresses changed; the image
/// builds what `make build` builds, and where a container runtime exists it builds and runs.
#[test]
fn the_compose_walkthrough_matches_the_examples() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let yaml = |p: &str| -> serde_json::Value {
        serde_saphyr::from_str(&std::fs::read_to_string(root.join(p)).unwrap()).unwrap()
    };
    let example = yaml("examples/envoy/envoy.yaml");
    let compose = yaml("examples/compose/envoy.yaml");
    assert_eq!(
        example["static_resources"]["listeners"],
        compose["static_resources"]["listeners"]
    );
    let services = yaml("docker-compose.yaml");
    let volumes = services["services"]["ratelimitd"]["volumes"][0]
        .as_str()
        .unwrap();
    let host = volumes.split(':').next().unwrap();
    assert!(root.join(host).is_dir(), "{host}");
    let dockerfile = std::fs::read_to_string(root.join("Dockerfile")).unwrap();
    let makefile = std::fs::read_to_string(root.join("Makefile")).unwrap();
    assert!(dockerfile.contains("cargo build --release"));
    assert!(makefile.contains("$(CARGO) build --release"));
    assert!(dockerfile.contains("USER 65532"), "non-root");
    assert!(
        dockerfile.contains("ln -s /usr/local/bin/ratelimitd /bin/ratelimit"),
        "Envoy Gateway's command, /bin/ratelimit, is the binary"
    );
    // Everything the build reads is copied in.
    for input in ["build.rs", "proto", "src", "benches", "Cargo.lock"] {
        assert!(dockerfile.contains(input), "{input}");
    }
    // Where a container runtime answers, the image is built and its binary run.
    let docker = |args: &[&str]| {
        std::process::Command::new("docker")
            .args(args)
            .current_dir(root)
            .status()
            .is_ok_and(|s| s.success())
    };
    if !docker(&["info", "--format", "{{.ServerVersion}}"]) {
        eprintln!("no container runtime answers `docker info`: the image was not built");
        return;
    }
    assert!(docker(&["build", "-t", "ratelimitd:test", "."]));
    assert!(docker(&["run", "--rm", "ratelimitd:test", "--version"]));
    assert!(docker(&[
        "run",
        "--rm",
        "--entrypoint",
        "/bin/ratelimit",
        "ratelimitd:test",
        "--version"
    ]));
}
