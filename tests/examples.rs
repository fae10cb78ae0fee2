//! Every Envoy example read against Envoy's own API. The Envoy configs under examples/envoy/
//! are decoded as Envoy's `Bootstrap` message, and the patches of the Istio `EnvoyFilter`s as
//! the messages their `applyTo` names, through the descriptor set of Envoy's protos that
//! envoy-types ships (the version the service is built against) and the proto JSON mapping:
//! a field, an enum value or a `typed_config` type Envoy does not have fails the test, naming
//! the file and the path.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

use prost_reflect::{DescriptorPool, DynamicMessage};

fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

/// The descriptor set of Envoy's protos in the envoy-types crate this build uses, read once
/// for every test.
fn envoy_pool() -> &'static DescriptorPool {
    static POOL: OnceLock<DescriptorPool> = OnceLock::new();
    POOL.get_or_init(read_envoy_pool)
}

/// [`envoy_pool`]'s set, found through `cargo metadata` (offline: the crate is already there).
fn read_envoy_pool() -> DescriptorPool {
    let cargo = option_env!("CARGO").unwrap_or("cargo");
    // This machine's platform only: other platforms' dependencies may not be downloaded.
    let rustc = Command::new("rustc").arg("-vV").output().unwrap();
    let host = String::from_utf8(rustc.stdout)
        .unwrap()
        .lines()
        .find_map(|l| l.strip_prefix("host: ").map(str::to_owned))
        .expect("rustc -vV names the host");
    let out = Command::new(cargo)
        .args(["metadata", "--format-version", "1", "--offline"])
        .args(["--filter-platform", &host, "--manifest-path"])
        .arg(root().join("Cargo.toml"))
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let meta: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let manifest = meta["packages"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["name"] == "envoy-types")
        .expect("envoy-types among the packages")["manifest_path"]
        .as_str()
        .unwrap()
        .to_owned();
    let set = PathBuf::from(manifest)
        .parent()
        .unwrap()
        .join("src/generated/types.bin");
    let bytes = std::fs::read(&set).unwrap_or_else(|e| panic!("{}: {e}", set.display()));
    DescriptorPool::decode(bytes.as_slice()).unwrap()
}

/// `value` decoded as the message `name`, or the error naming where it does not fit.
fn decode(
    pool: &DescriptorPool,
    name: &str,
    value: &serde_json::Value,
) -> Result<DynamicMessage, String> {
    let desc = pool
        .get_message_by_name(name)
        .unwrap_or_else(|| panic!("Envoy's API has no message {name}"));
    DynamicMessage::deserialize(desc, value.clone()).map_err(|e| e.to_string())
}

fn yaml(rel: &str) -> Vec<serde_json::Value> {
    let text = std::fs::read_to_string(root().join(rel)).unwrap();
    text.split("\n---\n")
        .filter(|d| {
            d.lines()
                .any(|l| !l.trim().is_empty() && !l.trim_start().starts_with('#'))
        })
        .map(|d| serde_saphyr::from_str(d).unwrap_or_else(|e| panic!("{rel}: {e}")))
        .collect()
}

const BOOTSTRAP: &str = "envoy.config.bootstrap.v3.Bootstrap";

#[test]
fn every_envoy_example_is_a_bootstrap_envoy_reads() {
    let pool = envoy_pool();
    let mut checked = Vec::new();
    for entry in std::fs::read_dir(root().join("examples/envoy")).unwrap() {
        let path = entry.unwrap().path();
        let name = path.file_name().unwrap().to_string_lossy().into_owned();
        if path.extension().is_none_or(|e| e != "yaml") || name.starts_with("istio-") {
            continue;
        }
        let rel = format!("examples/envoy/{name}");
        for doc in yaml(&rel) {
            decode(pool, BOOTSTRAP, &doc).unwrap_or_else(|e| panic!("{rel}: {e}"));
        }
        checked.push(name);
    }
    checked.sort();
    assert_eq!(
        checked,
        [
            "concurrency.yaml",
            "envoy.yaml",
            "llm-api.yaml",
            "network-filter.yaml",
            "reservations.yaml",
            "rest-api.yaml",
            "rlqs.yaml",
            "token-budget.yaml"
        ]
    );
    // The compose walkthrough's Envoy config too.
    for doc in yaml("examples/compose/envoy.yaml") {
        decode(pool, BOOTSTRAP, &doc).unwrap_or_else(|e| panic!("compose: {e}"));
    }
}

/// The check can fail: a field Envoy's RateLimit filter does not have, and a typed_config of a
/// type Envoy does not have, are refused.
#[test]
fn a_field_or_a_type_envoy_does_not_have_is_refused() {
    let pool = envoy_pool();
    let doc = &yaml("examples/envoy/envoy.yaml")[0];
    let text = serde_json::to_string(doc).unwrap();
    let misspelt = text.replacen("\"domain\"", "\"domian\"", 1);
    assert_ne!(misspelt, text);
    let err = decode(pool, BOOTSTRAP, &serde_json::from_str(&misspelt).unwrap()).unwrap_err();
    assert!(err.contains("domian"), "{err}");
    let unknown = text.replacen(
        "envoy.extensions.filters.http.ratelimit.v3.RateLimit\"",
        "envoy.extensions.filters.http.ratelimit.v3.RateLimiter\"",
        1,
    );
    assert_ne!(unknown, text);
    assert!(decode(pool, BOOTSTRAP, &serde_json::from_str(&unknown).unwrap()).is_err());
}

/// Istio's EnvoyFilter patches, each decoded as the message its `applyTo` patches.
#[test]
fn the_istio_envoyfilter_patches_are_envoy_messages() {
    let pool = envoy_pool();
    let mut patches = 0;
    let docs = ["istio-envoyfilter.yaml", "istio-concurrency.yaml"]
        .into_iter()
        .flat_map(|f| yaml(&format!("examples/envoy/{f}")));
    for doc in docs {
        assert_eq!(doc["kind"], "EnvoyFilter");
        for patch in doc["spec"]["configPatches"].as_array().unwrap() {
            let message = match patch["applyTo"].as_str().unwrap() {
                "HTTP_FILTER" => {
                    "envoy.extensions.filters.network.http_connection_manager.v3.HttpFilter"
                }
                "VIRTUAL_HOST" => "envoy.config.route.v3.VirtualHost",
                "HTTP_ROUTE" => "envoy.config.route.v3.Route",
                "CLUSTER" => "envoy.config.cluster.v3.Cluster",
                other => panic!("applyTo {other} is not checked here"),
            };
            decode(pool, message, &patch["patch"]["value"])
                .unwrap_or_else(|e| panic!("{}, {message}: {e}", doc["metadata"]["name"]));
            patches += 1;
        }
    }
    assert!(patches >= 4, "{patches} patches");
}
