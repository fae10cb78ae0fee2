//! Hot reload through a real file watcher: in-place edits, atomic renames, Kubernetes
//! ConfigMap `..data` swaps, replaced directories, bad reloads that must leave the previous
//! config in force, and counts that survive limits being reordered or added.

mod common;

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

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
    assert_eq!(metric(&m, "ratelimit_config_last_load_success"), 1.0);
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
    let (_, m) = s.http_get("/metrics").await;
    assert_eq!(metric(&m, "ratelimit_config_last_load_success"), 0.0);
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
    let (_, m) = s.http_get("/metrics").await;
    assert_eq!(metric(&m, "ratelimit_config_last_load_success"), 1.0);
}

/// A bad file, then the file as it was before: the config in force is the files' again, so
/// the last load counts as good (the failure does not stand until some other change).
#[tokio::test]
async fn putting_back_the_config_in_force_after_a_bad_reload_clears_the_failure() {
    let s = TestServer::start(&[("limits.yaml", &limits(5))]).await;
    let mut c = s.client().await;
    let last_ok = || async {
        let (_, m) = s.http_get("/metrics").await;
        metric(&m, "ratelimit_config_last_load_success")
    };
    assert_eq!(last_ok().await, 1.0);
    s.write(
        "limits.yaml",
        "domain: d\ndescriptors: [{key: k, rate_limit: {unit: fortnight}}]\n",
    );
    poll(RELOAD_DEADLINE, || async {
        (last_ok().await == 0.0).then_some(())
    })
    .await;
    s.write("limits.yaml", &limits(5));
    poll(RELOAD_DEADLINE, || async {
        (last_ok().await == 1.0).then_some(())
    })
    .await;
    assert_eq!(rpu(&mut c).await, Some(5));
    let (_, m) = s.http_get("/metrics").await;
    assert_eq!(
        metric(&m, r#"ratelimit_config_loads_total{result="error"}"#),
        1.0
    );
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

const DAILY: &str = "domain: r\ndescriptors:\n  - key: k\n    rate_limits:\n      - {unit: day, requests_per_unit: 3}\n";
const SECOND_IN_FRONT: &str = "domain: r\ndescriptors:\n  - key: k\n    rate_limits:\n      - {unit: second, requests_per_unit: 100}\n      - {unit: day, requests_per_unit: 3, name: daily}\n";
const DAILY_OF_FOUR: &str = "domain: r\ndescriptors:\n  - key: k\n    rate_limits:\n      - {unit: day, requests_per_unit: 4}\n      - {unit: second, requests_per_unit: 100}\n";

/// A counter is named by its limit, not by its position in `rate_limits`: inserting a limit
/// in front of a used-up one neither resets it nor hands its count to the newcomer.
async fn counts_survive_reordering_and_new_limits(kind: Kind) {
    let s = start(kind, &[("r.yaml", DAILY)], &[]).await;
    let mut c = s.client().await;
    admits_exactly(&mut c, &request("r", &[&[("k", "v")]]), 3).await;

    // A per-second limit in front, and a name on the daily one: still used up.
    s.write("r.yaml", SECOND_IN_FRONT);
    poll(Duration::from_secs(5), || {
        let mut c = c.clone();
        async move {
            let r = call(&mut c, with_hits(request("r", &[&[("k", "v")]]), 0, 0)).await;
            (r.statuses[0].current_limit.as_ref()?.name == "daily").then_some(())
        }
    })
    .await;
    assert!(is_over(&call(&mut c, request("r", &[&[("k", "v")]])).await));

    // Reordered again, the daily limit raised to 4: exactly one more fits.
    s.write("r.yaml", DAILY_OF_FOUR);
    poll(Duration::from_secs(5), || {
        let mut c = c.clone();
        async move {
            let r = call(&mut c, with_hits(request("r", &[&[("k", "v")]]), 0, 0)).await;
            (rpu_of(&r, 0) == Some(4)).then_some(())
        }
    })
    .await;
    assert!(is_ok(&call(&mut c, request("r", &[&[("k", "v")]])).await));
    assert!(is_over(&call(&mut c, request("r", &[&[("k", "v")]])).await));
}

every_backend!(counts_survive_reordering_and_new_limits);

/// Replaces the config directory (`mv limits old; mkdir limits`) under a server configured
/// with the directory, or with the file in it, and checks that hot reload keeps working: the
/// watch follows the path, not the directory it first found there.
async fn hot_reload_follows_a_replaced_directory(config_is_the_file: bool) {
    let root = tempfile::tempdir().unwrap();
    let dir = root.path().join("limits");
    std::fs::create_dir(&dir).unwrap();
    std::fs::write(dir.join("l.yaml"), limits(1)).unwrap();
    let configured = if config_is_the_file {
        dir.join("l.yaml")
    } else {
        dir.clone()
    };
    let s = TestServer::start_at(
        tempfile::tempdir().unwrap(),
        Some(configured),
        &[],
        Arc::new(SystemClock),
    )
    .await;
    let c = s.client().await;
    until_rpu(&c, 1).await;

    std::fs::rename(&dir, root.path().join("old")).unwrap();
    std::fs::create_dir(&dir).unwrap();
    std::fs::write(dir.join("l.yaml"), limits(2)).unwrap();
    until_rpu(&c, 2).await;
    // The new directory is watched, and the old one no longer matters.
    std::fs::write(dir.join("l.yaml"), limits(3)).unwrap();
    until_rpu(&c, 3).await;
    std::fs::write(root.path().join("old/l.yaml"), limits(9)).unwrap();
    std::fs::write(dir.join("l.yaml"), limits(4)).unwrap();
    until_rpu(&c, 4).await;
}

#[tokio::test]
async fn hot_reload_follows_a_replaced_config_directory() {
    hot_reload_follows_a_replaced_directory(false).await;
}

#[tokio::test]
async fn hot_reload_follows_a_configured_file_whose_directory_is_replaced() {
    hot_reload_follows_a_replaced_directory(true).await;
}

/// `--default-algorithm` applies to the files' limits that name none, at start and on reload.
#[tokio::test]
async fn the_default_algorithm_holds_across_reloads() {
    let s = TestServer::start_with(
        &[("limits.yaml", &limits(1))],
        &["--default-algorithm", "sliding-log"],
        Arc::new(SystemClock),
    )
    .await;
    let c = s.client().await;
    until_rpu(&c, 1).await;
    let (_, rules) = s.http_get("/rlconfig").await;
    assert!(rules.contains("algorithm=sliding_log"), "{rules}");
    s.write("limits.yaml", &limits(2));
    until_rpu(&c, 2).await;
    let (_, rules) = s.http_get("/rlconfig").await;
    assert!(
        rules.contains("requests_per_unit=2, algorithm=sliding_log"),
        "{rules}"
    );
}

/// A removed rule's series stay for `--removed-series-grace`, however many scrapes come in
/// between: a second scraper (an HA pair of Prometheus, a dashboard, curl) takes nothing
/// from the first. Before, they went at the second scrape after the reload, whoever sent it,
/// and Prometheus missed the rule's last hits.
#[tokio::test]
async fn a_removed_rules_series_stay_for_their_grace_whoever_scrapes() {
    let with = "domain: d\ndescriptors:\n  - key: kept\n    rate_limit: {unit: minute, requests_per_unit: 100}\n  - key: removed\n    rate_limit: {unit: minute, requests_per_unit: 100}\n";
    let without = "domain: d\ndescriptors:\n  - key: kept\n    rate_limit: {unit: minute, requests_per_unit: 101}\n";
    let grace = Duration::from_secs(4);
    let s = TestServer::start_with(
        &[("d.yaml", with)],
        &["--removed-series-grace", "4s"],
        Arc::new(SystemClock),
    )
    .await;
    let c = s.client().await;
    for _ in 0..5 {
        assert!(is_ok(
            &call(&mut c.clone(), request("d", &[&[("removed", "x")]])).await
        ));
    }
    let series = "ratelimit_rule_hits_total{domain=\"d\",rule=\"removed\",limit=\"0\"}";
    let (_, text) = s.http_get("/metrics").await;
    assert_eq!(metric(&text, series), 5.0, "{text}");
    s.write("d.yaml", without);
    let written = Instant::now();
    poll(RELOAD_DEADLINE, || {
        let mut c = c.clone();
        async move {
            let mut req = request("d", &[&[("kept", "x")]]);
            req.descriptors[0].hits_addend = Some(UInt64Value { value: 0 });
            (rpu_of(&call(&mut c, req).await, 0) == Some(101)).then_some(())
        }
    })
    .await;
    let removed = Instant::now();
    // Scrapers other than Prometheus, many times within the grace (the half of it that has
    // surely not passed since the reload, however late the poll saw it).
    let mut scrapes = 0;
    while removed.elapsed() < grace / 2 && written.elapsed() < grace / 2 {
        let (_, text) = s.http_get("/metrics").await;
        scrapes += 1;
        assert_eq!(
            metric(&text, series),
            5.0,
            "scrape {scrapes}, {:?} after the reload",
            removed.elapsed()
        );
    }
    assert!(scrapes >= 3, "{scrapes} scrapes");
    // Past the grace, the next scrape drops them.
    tokio::time::sleep_until(removed + grace).await;
    poll(Duration::from_secs(10), || async {
        let (_, text) = s.http_get("/metrics").await;
        (!text.contains(series)).then_some(())
    })
    .await;
}

/// Per-rule series of rules no longer in force go, after a grace in which a scrape sees their
/// last increase: 20 reloads of 50 renamed rules (and 2 kept) leave at most the series of the
/// config in force and of the two before it. Before, every rule ever in force kept its series
/// (1,000 and more `ratelimit_rule_hits_total` with 52 rules in force).
#[tokio::test]
async fn series_of_removed_rules_go_after_their_grace() {
    const RENAMED: usize = 50;
    let config = |generation: usize| {
        let mut text = String::from(
            "domain: d\ndescriptors:\n  - key: kept_a\n    rate_limit: {unit: minute, requests_per_unit: 100}\n  - key: kept_b\n    rate_limit: {unit: minute, requests_per_unit: 100}\n",
        );
        for i in 0..RENAMED {
            text.push_str(&format!(
                "  - key: r{generation}_{i}\n    rate_limit: {{unit: minute, requests_per_unit: {}}}\n",
                1000 + generation
            ));
        }
        text
    };
    let s = TestServer::start(&[("d.yaml", &config(0))]).await;
    let c = s.client().await;
    let series = |text: &str, family: &str| text.lines().filter(|l| l.starts_with(family)).count();
    let mut first_total = 0;
    for generation in 0..20 {
        if generation > 0 {
            s.write("d.yaml", &config(generation));
        }
        // In force once a renamed rule answers with this generation's limit.
        poll(RELOAD_DEADLINE, || {
            let mut c = c.clone();
            let key = format!("r{generation}_0");
            async move {
                let mut req = request("d", &[&[(key.as_str(), "x")]]);
                req.descriptors[0].hits_addend = Some(UInt64Value { value: 0 });
                (rpu_of(&call(&mut c, req).await, 0) == Some(1000 + generation as u32))
                    .then_some(())
            }
        })
        .await;
        let keys: Vec<String> = (0..RENAMED).map(|i| format!("r{generation}_{i}")).collect();
        let mut descriptors: Vec<[(&str, &str); 1]> =
            keys.iter().map(|k| [(k.as_str(), "x")]).collect();
        descriptors.push([("kept_a", "x")]);
        descriptors.push([("kept_b", "x")]);
        let refs: Vec<&[(&str, &str)]> = descriptors.iter().map(|d| d.as_slice()).collect();
        assert!(is_ok(&call(&mut c.clone(), request("d", &refs)).await));
        // One scrape per config, as a Prometheus scraping slower than the reloads would.
        let (_, text) = s.http_get("/metrics").await;
        if generation == 0 {
            first_total = text.lines().filter(|l| !l.starts_with('#')).count();
        } else {
            // The rules the last reload removed: still seen, with their last increase.
            let last = format!(
                "ratelimit_rule_hits_total{{domain=\"d\",rule=\"r{}_0\",limit=\"0\"}}",
                generation - 1
            );
            assert_eq!(metric(&text, &last), 1.0, "generation {generation}");
        }
    }
    let (_, text) = s.http_get("/metrics").await;
    let rule_hits = series(&text, "ratelimit_rule_hits_total{");
    let decisions = series(&text, "ratelimit_decisions_total{");
    let total = text.lines().filter(|l| !l.starts_with('#')).count();
    println!(
        "after 20 configs: {rule_hits} rule_hits series, {decisions} decision series, \
         {total} series in all (first config: {first_total})"
    );
    let in_force = RENAMED + 2;
    assert!(rule_hits <= 3 * in_force, "{rule_hits} rule_hits series");
    assert!(decisions <= 3 * in_force * 4, "{decisions} decision series");
    assert!(
        total <= 3 * first_total,
        "{total} series, {first_total} at first"
    );
    // The kept rules kept their counts across every reload.
    let kept = "ratelimit_rule_hits_total{domain=\"d\",rule=\"kept_a\",limit=\"0\"}";
    assert_eq!(metric(&text, kept), 20.0);
}
