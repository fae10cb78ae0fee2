//! Hot reload through a real file watcher: in-place edits, atomic renames, Kubernetes
//! ConfigMap `..data` swaps, and bad reloads that must leave the previous config in force.

mod common;

use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::*;
use envoy_types::pb::google::protobuf::UInt64Value;
use ratelimitd::testing::SystemClock;

/// Generous for a loaded CI machine; the design target (and typical result) is well under 1 s.
const RELOAD_DEADLINE: Duration = Duration::from_secs(3);

fn limits(rpu: u32) -> String {
    format!(
        "domain: r\ndescriptors:\n  - key: k\n    rate_limit: {{unit: minute, requests_per_unit: {rpu}}}\n"
    )
}

/// The configured requests_per_unit for key `k`, checked without consuming.
async fn rpu(c: &mut Client) -> Option<u32> {
    let mut req = request("r", &[&[("k", "v")]]);
    req.descriptors[0].hits_addend = Some(UInt64Value { value: 0 });
    rpu_of(&call(c, req).await, 0)
}

/// Waits until the service answers with `want`, returning how long that took.
async fn until_rpu(c: &Client, want: u32) -> Duration {
    let started = Instant::now();
    poll(RELOAD_DEADLINE, || {
        let mut c = c.clone();
        async move { (rpu(&mut c).await == Some(want)).then_some(()) }
    })
    .await;
    let took = started.elapsed();
    eprintln!("reload to {want} seen after {took:?}");
    took
}

#[tokio::test]
async fn in_place_edits_and_atomic_renames_take_effect() {
    let s = TestServer::start(&[("limits.yaml", &limits(1))]).await;
    let c = s.client().await;
    assert_eq!(rpu(&mut c.clone()).await, Some(1));

    s.write("limits.yaml", &limits(2));
    until_rpu(&c, 2).await;

    // Editors and deploy tools write a temporary file and rename it over the old one.
    s.write(".limits.yaml.tmp", &limits(3));
    std::fs::rename(s.path(".limits.yaml.tmp"), s.path("limits.yaml")).unwrap();
    until_rpu(&c, 3).await;

    let (_, m) = s.http_get("/metrics").await;
    assert!(metric(&m, r#"ratelimit_config_loads_total{result="success"}"#) >= 3.0);
    assert_eq!(
        metric(&m, r#"ratelimit_config_loads_total{result="error"}"#),
        0.0
    );
}

#[tokio::test]
async fn a_bad_reload_keeps_the_whole_previous_config() {
    let s = TestServer::start(&[
        ("limits.yaml", &limits(5)),
        ("other.yaml", "domain: other\ndescriptors:\n  - key: x\n    rate_limit: {unit: second, requests_per_unit: 1}\n"),
    ])
    .await;
    let mut c = s.client().await;
    let (_, before) = s.http_get("/rlconfig").await;

    // One good change and one bad file in the same reload: nothing of it applies.
    s.write("limits.yaml", &limits(6));
    s.write(
        "other.yaml",
        "domain: other\ndescriptors:\n  - key: x\n    rate_limit: {unit: fortnight}\n",
    );
    poll(RELOAD_DEADLINE, || async {
        let (_, m) = s.http_get("/metrics").await;
        (metric(&m, r#"ratelimit_config_loads_total{result="error"}"#) >= 1.0).then_some(())
    })
    .await;
    assert_eq!(rpu(&mut c).await, Some(5), "previous config still in force");
    assert_eq!(s.http_get("/rlconfig").await.1, before);
    assert_eq!(s.http_get("/healthcheck").await.0, 200);

    // A duplicate domain is refused the same way.
    s.write("other.yaml", &limits(7));
    poll(RELOAD_DEADLINE, || async {
        let (_, m) = s.http_get("/metrics").await;
        (metric(&m, r#"ratelimit_config_loads_total{result="error"}"#) >= 2.0).then_some(())
    })
    .await;
    assert_eq!(rpu(&mut c).await, Some(5));

    // Fixing it applies everything.
    s.write("other.yaml", "domain: other\n");
    until_rpu(&c, 6).await;
}

/// What kubelet does on a ConfigMap update: a new `..<timestamp>` directory, a `..data_tmp`
/// symlink to it renamed over `..data`, then the old directory removed.
fn configmap_swap(dir: &Path, generation: u32, text: &str) {
    let data = format!("..2026_11_21_00_00_{generation:02}.000000000");
    std::fs::create_dir(dir.join(&data)).unwrap();
    std::fs::write(dir.join(&data).join("config.yaml"), text).unwrap();
    let old = std::fs::read_link(dir.join("..data")).ok();
    std::os::unix::fs::symlink(&data, dir.join("..data_tmp")).unwrap();
    std::fs::rename(dir.join("..data_tmp"), dir.join("..data")).unwrap();
    if !dir.join("config.yaml").exists() {
        std::os::unix::fs::symlink("..data/config.yaml", dir.join("config.yaml")).unwrap();
    }
    if let Some(old) = old {
        std::fs::remove_dir_all(dir.join(old)).unwrap();
    }
}

async fn configmap_swaps(config_is_the_file: bool) {
    let dir = tempfile::tempdir().unwrap();
    configmap_swap(dir.path(), 0, &limits(10));
    let config = config_is_the_file.then(|| dir.path().join("config.yaml"));
    let s = TestServer::start_at(dir, config, &[], Arc::new(SystemClock)).await;
    let c = s.client().await;
    assert_eq!(rpu(&mut c.clone()).await, Some(10));
    for generation in 1..=3 {
        configmap_swap(s.dir.path(), generation, &limits(10 + generation));
        let took = until_rpu(&c, 10 + generation).await;
        assert!(took < RELOAD_DEADLINE);
    }
    let (_, m) = s.http_get("/metrics").await;
    assert_eq!(
        metric(&m, r#"ratelimit_config_loads_total{result="success"}"#),
        4.0,
        "one load per swap"
    );
}

#[tokio::test]
async fn configmap_data_swaps_reload_when_the_directory_is_configured() {
    configmap_swaps(false).await;
}

#[tokio::test]
async fn configmap_data_swaps_reload_when_the_symlinked_file_is_configured() {
    configmap_swaps(true).await;
}

#[tokio::test]
async fn requests_in_flight_during_reloads_always_see_a_whole_config() {
    let s = TestServer::start(&[("limits.yaml", &limits(100))]).await;
    let c = s.client().await;
    let writer = {
        let path = s.path("limits.yaml");
        tokio::task::spawn_blocking(move || {
            for i in 0..20 {
                let tmp = path.with_file_name(".tmp");
                std::fs::write(&tmp, limits(if i % 2 == 0 { 200 } else { 100 })).unwrap();
                std::fs::rename(tmp, &path).unwrap();
                std::thread::sleep(Duration::from_millis(30));
            }
        })
    };
    let mut c2 = c.clone();
    while !writer.is_finished() {
        let got = rpu(&mut c2).await;
        assert!(matches!(got, Some(100) | Some(200)), "{got:?}");
    }
    writer.await.unwrap();
}
