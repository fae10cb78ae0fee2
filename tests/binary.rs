//! The `ratelimitd` binary itself: flags, environment, config errors at start, and SIGTERM.

mod common;

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use common::daemon::{Daemon, ratelimitd};
use common::redis::free_port;
use common::*;

#[test]
fn an_invalid_first_config_exits_non_zero_naming_file_line_and_field() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("bad.yaml");
    std::fs::write(
        &file,
        "domain: d\ndescriptors:\n  - key: k\n    rate_limit:\n      unit: fortnight\n",
    )
    .unwrap();
    let out = ratelimitd(
        &file,
        &["--grpc-addr", "127.0.0.1:0", "--http-addr", "127.0.0.1:0"],
    )
    .output()
    .unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    let expected = format!(
        "{}:5:13: descriptors[0].rate_limit.unit: invalid rate limit unit 'fortnight'",
        file.display()
    );
    assert!(stderr.contains(&expected), "{stderr}");
    assert_eq!(
        stderr.matches("fortnight").count(),
        1,
        "said once: {stderr}"
    );
}

/// `--check`: the rules as /rlconfig prints them and exit 0, or exit 1 naming file, line and
/// field; nothing is served either way (no address is even given), and a misplaced key is
/// warned about with its place.
/// `--merge-domain-config` (MERGE_DOMAIN_CONFIG): two files of one domain load as one, their
/// descriptors merged; without it the duplicate domain is an error naming both files, and with
/// it one descriptor defined in both is an error naming it and both files.
#[test]
fn files_of_one_domain_merge_only_when_asked() {
    let dir = tempfile::tempdir().unwrap();
    let (a, b) = (dir.path().join("a.yaml"), dir.path().join("b.yaml"));
    std::fs::write(
        &a,
        "domain: d\ndescriptors:\n  - key: k\n    value: one\n    rate_limit: {unit: hour, requests_per_unit: 7}\n",
    )
    .unwrap();
    std::fs::write(
        &b,
        "domain: d\ndescriptors:\n  - key: k\n    value: two\n    rate_limit: {unit: hour, requests_per_unit: 9}\n  - key: other\n    rate_limit: {unit: minute, requests_per_unit: 3}\n",
    )
    .unwrap();
    let out = ratelimitd(dir.path(), &["--check", "--merge-domain-config"])
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    for rule in ["d.k_one", "d.k_two", "d.other"] {
        assert!(stdout.contains(rule), "{rule} in {stdout}");
    }
    let out = ratelimitd(dir.path(), &["--check"]).output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains("duplicate domain 'd'") && stderr.contains(&a.display().to_string()),
        "{stderr}"
    );
    // The place named is the descriptor defined twice, in the file that repeats it (it was
    // 1:1 whatever the file held).
    std::fs::write(
        &b,
        "# b\ndomain: d\ndescriptors:\n  - key: x\n    rate_limit: {unit: hour, requests_per_unit: 1}\n  - key: k\n    value: one\n    rate_limit: {unit: hour, requests_per_unit: 9}\n",
    )
    .unwrap();
    let out = ratelimitd(dir.path(), &["--check", "--merge-domain-config"])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains("duplicate descriptor 'k_one'")
            && stderr.contains(&a.display().to_string())
            && stderr.contains(&format!("{}:6:", b.display())),
        "{stderr}"
    );
    // A duplicate domain is named at its `domain` line.
    let out = ratelimitd(dir.path(), &["--check"]).output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains(&format!("{}:2:", b.display())), "{stderr}");
}

#[test]
fn check_prints_the_rules_or_the_first_error_and_serves_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let good = dir.path().join("good.yaml");
    std::fs::write(
        &good,
        "name: eg\ndomain: d\ndescriptors:\n  - key: k\n    rate_limit:\n      unit: minute\n      requests_per_unit: 7\n      replaces:\n        - name: other\n          unit: hour\n",
    )
    .unwrap();
    let out = ratelimitd(&good, &["--check"]).output().unwrap();
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    assert!(out.status.success(), "{stderr}");
    assert!(
        stdout.contains("d.k") && stdout.contains("requests_per_unit=7"),
        "{stdout}"
    );
    assert!(
        stderr.contains(&format!("{}:1:", good.display())) && stderr.contains("name"),
        "the misplaced key is warned about with its place: {stderr}"
    );
    assert!(
        stderr.contains(&format!("{}:10:", good.display()))
            && stderr.contains("descriptors[0].rate_limit.replaces[0].unit"),
        "inside a replaces item too: {stderr}"
    );

    let bad = dir.path().join("bad.yaml");
    std::fs::write(
        &bad,
        "domain: d\ndescriptors:\n  - key: k\n    rate_limit: {unit: fortnight, requests_per_unit: 7}\n",
    )
    .unwrap();
    let out = ratelimitd(dir.path(), &["--check"]).output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains(&format!("{}:4:", bad.display()))
            && stderr.contains("descriptors[0].rate_limit.unit"),
        "{stderr}"
    );
}

#[test]
fn invalid_flags_and_missing_paths_exit_non_zero_with_a_message() {
    let out = ratelimitd("x.yaml", &["--log-format", "xml"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("--log-format"));

    let out = ratelimitd(
        "/nonexistent/limits.yaml",
        &["--grpc-addr", "127.0.0.1:0", "--http-addr", "127.0.0.1:0"],
    )
    .output()
    .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("/nonexistent/limits.yaml"));

    let out = ratelimitd("x.yaml", &[])
        .env("RATELIMITD_MAX_ENTRIES", "many")
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("--max-entries"));
}

const LIMITS: &str =
    "domain: d\ndescriptors:\n  - key: k\n    rate_limit: {unit: second, requests_per_unit: 5}\n";

#[tokio::test]
async fn sigterm_finishes_and_exits_zero() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("l.yaml"), LIMITS).unwrap();
    // Flags through the environment, as a container would set them.
    let mut cmd = ratelimitd("", &[]);
    cmd.env("RATELIMITD_CONFIG", dir.path())
        .env("RATELIMITD_LOG_FORMAT", "json");
    let d = Daemon::start(cmd).await;
    assert_eq!(http_get(d.http, "/healthcheck").await, (200, "OK".into()));
    let mut client = d.client().await;
    assert!(is_ok(
        &call(&mut client, request("d", &[&[("k", "v")]])).await
    ));
    let (exit, stderr) = d.terminate().await;
    assert!(exit.success(), "{exit:?}");
    assert!(stderr.contains("\"shutting down"), "json logs: {stderr}");
}

/// A refusal's `debug` line names the domain and the rule that refused, never the request's
/// values; a request that passes writes none.
#[tokio::test]
async fn a_refusal_is_logged_with_its_rule_at_debug() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("l.yaml"), LIMITS).unwrap();
    let d = Daemon::start(ratelimitd(dir.path(), &["--log-level", "debug"])).await;
    let mut client = d.client().await;
    // 5 a second: the sixth call within a second is refused. A second's boundary may fall
    // between the calls (a loaded machine), so up to 11 calls, until the first refusal.
    let mut passed = 0;
    loop {
        let r = call(&mut client, request("d", &[&[("k", "secret-value")]])).await;
        if !is_ok(&r) {
            break;
        }
        passed += 1;
        assert!(passed <= 10, "11 calls in at most two seconds: one refused");
    }
    assert!(passed >= 5, "the first 5 pass: {passed}");
    let (_, stderr) = d.terminate().await;
    let lines: Vec<&str> = stderr
        .lines()
        .filter(|l| l.contains("over the limit"))
        .collect();
    assert_eq!(lines.len(), 1, "{stderr}");
    for part in ["domain=d", "rule=k", "descriptor=0"] {
        assert!(lines[0].contains(part), "{part} in {}", lines[0]);
    }
    assert!(!stderr.contains("secret-value"), "{stderr}");
}

/// Starts ratelimitd on a Redis that requires `password`, given unencoded in the URL: it
/// authenticates, and none of `fragments` of the password shows in the logs (at trace level),
/// `/rlconfig` or `/metrics`, while the redacted target does.
async fn password_stays_secret(password: &str, fragments: &[&str]) {
    let redis = common::redis::RedisProc::start(&["--requirepass", password]);
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("l.yaml"), LIMITS).unwrap();
    let url = format!("redis://:{password}@127.0.0.1:{}", redis.port);
    let cmd = ratelimitd(
        dir.path(),
        &[
            "--backend",
            "redis",
            "--redis-url",
            &url,
            "--log-level",
            "trace",
        ],
    );
    let d = Daemon::start(cmd).await;
    let mut client = d.client().await;
    assert!(
        is_ok(&call(&mut client, request("d", &[&[("k", "v")]])).await),
        "authenticated"
    );
    let (_, dump) = http_get(d.http, "/rlconfig").await;
    let (_, metrics) = http_get(d.http, "/metrics").await;
    let (_, stderr) = d.terminate().await;
    assert!(
        stderr.contains("redis backend") && stderr.contains("redis://:***@127.0.0.1"),
        "the redacted target is logged: {stderr}"
    );
    for text in [&stderr, &dump, &metrics] {
        for secret in fragments {
            assert!(!text.contains(secret), "{text}");
        }
    }
}

#[tokio::test]
async fn redis_passwords_never_reach_the_logs() {
    password_stays_secret("hunter2-secret", &["hunter2"]).await;
}

/// A bad reload is logged with its file, line and field, and the process keeps serving.
#[tokio::test]
async fn a_bad_reload_is_logged_with_file_line_and_field() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("l.yaml");
    std::fs::write(&file, LIMITS).unwrap();
    let d = Daemon::start(ratelimitd(dir.path(), &[])).await;
    // Written aside and renamed over, so no half-written version is ever seen: the one bad
    // version is the one the log must name.
    let aside = dir.path().join(".l.yaml.tmp");
    std::fs::write(
        &aside,
        "domain: d\ndescriptors:\n  - key: k\n    rate_limit: {unit: fortnight}\n",
    )
    .unwrap();
    std::fs::rename(&aside, &file).unwrap();
    let http = d.http;
    poll(Duration::from_secs(10), || async move {
        let (_, m) = http_get(http, "/metrics").await;
        // At least one: a write may be seen half-done (truncated, then written), and each
        // version that fails to load counts.
        (metric(&m, r#"ratelimit_config_loads_total{result="error"}"#) >= 1.0).then_some(())
    })
    .await;
    let mut client = d.client().await;
    let r = call(&mut client, request("d", &[&[("k", "v")]])).await;
    assert_eq!(rpu_of(&r, 0), Some(5), "the previous config still serves");
    let (_, stderr) = d.terminate().await;
    let expected = format!("{}:4:24: descriptors[0].rate_limit.unit", file.display());
    assert!(stderr.contains("config reload refused"), "{stderr}");
    assert!(stderr.contains(&expected), "{stderr}");
}

fn rss_kib(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next())
        .unwrap()
        .parse()
        .unwrap()
}

/// Counter state is bounded in bytes, hour-long windows included: a flood of distinct 4 KB
/// values (escaping triples them) keeps the process near the bound, where counters kept until
/// their window ended would grow it by hundreds of megabytes.
#[tokio::test]
async fn a_flood_of_distinct_values_stays_within_the_memory_bound() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(
        dir.path().join("l.yaml"),
        "domain: d\ndescriptors:\n  - key: k\n    rate_limit: {unit: hour, requests_per_unit: 5}\n",
    )
    .unwrap();
    let cmd = ratelimitd(
        dir.path(),
        &["--memory-max-bytes", "8MiB", "--log-level", "warn"],
    );
    let d = Daemon::start(cmd).await;
    let mut client = d.client().await;
    let before = rss_kib(d.child.id());
    for i in 0..300 {
        // 4096 bytes that all need escaping, distinct per descriptor and request.
        let values: Vec<String> = (0..64)
            .map(|j| format!("{i:05}{j:03}{}", "%".repeat(4088)))
            .collect();
        let entries: Vec<[(&str, &str); 1]> = values.iter().map(|v| [("k", v.as_str())]).collect();
        let descriptors: Vec<&[(&str, &str)]> = entries.iter().map(|e| &e[..]).collect();
        assert!(is_ok(&call(&mut client, request("d", &descriptors)).await));
    }
    let (_, m) = http_get(d.http, "/metrics").await;
    let held = metric(&m, "ratelimit_memory_bytes");
    assert!(held > 0.0 && held <= (8 << 20) as f64, "{held} bytes held");
    assert!(
        metric(&m, "ratelimit_memory_evictions_total") > 10_000.0,
        "{m}"
    );
    let grown = rss_kib(d.child.id()).saturating_sub(before);
    eprintln!("resident memory grew by {grown} KiB; {held} bytes of counters held");
    assert!(grown < 64 * 1024, "resident memory grew by {grown} KiB");
}

/// A password with an unencoded `/` is still a password: redacted at start-up, and it
/// authenticates.
#[tokio::test]
async fn a_password_with_a_slash_authenticates_and_is_never_logged() {
    password_stays_secret("s3cr/et@pass", &["s3cr", "et@pass"]).await;
    // Refused URLs do not echo the password either.
    let out = ratelimitd("x", &["--redis-url", "http://:s3cr/et@h:1"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(!String::from_utf8_lossy(&out.stderr).contains("s3cr"));
}

/// Every bad flag, huge durations included, is a usage error (exit 2), never a panic (101).
#[test]
fn bad_flags_exit_2_with_a_message_never_a_panic() {
    for args in [
        &["--shutdown-grace", "99999999999999999999999"][..],
        &["--redis-timeout", "99999999999999999999999"],
        &["--redis-timeout", "0"],
        &["--memory-max-bytes", "lots"],
        &["--reference-limit-header", "Rate Limit"],
        // Hop-by-hop and framing headers: Envoy would add them to the client's response.
        &["--reference-limit-header", "Content-Length"],
        &["--reference-remaining-header", "transfer-encoding"],
        &["--reference-reset-header", "Connection"],
        &["--reference-reset-header", "host"],
        // Checked at start, not at each flush.
        &["--statsd-addr", "nohostport"],
        &["--statsd-addr", "statsd:port"],
        &["--statsd-addr", ":8125"],
        &["--statsd-addr", "::1:8125"],
        &["--grpc-uds-mode", "999"],
        // A view exchange more often than a second loads Redis for no one's benefit.
        &["--top-publish-interval", "10ms"],
        &["--top-publish-interval", "999ms"],
        &["--backend", "redis"],
        &[
            "--backend",
            "redis",
            "--redis-url",
            "redis://h:1",
            "--redis-key-prefix",
            "{x}",
        ],
    ] {
        let out = ratelimitd("x.yaml", args).output().unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {stderr}");
        let flag = args[args.len() - 2].trim_end_matches(|c: char| c.is_alphabetic());
        assert!(stderr.contains(flag), "{args:?}: {stderr}");
        assert!(!stderr.contains("panicked"), "{stderr}");
    }
}

/// A daemon a test starts dies with the test, pass or fail.
#[tokio::test]
async fn a_daemon_dies_with_its_test() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("l.yaml"), LIMITS).unwrap();
    let d = Daemon::start(ratelimitd(dir.path(), &[])).await;
    let pid = d.child.id();
    let failed = std::panic::AssertUnwindSafe(async move {
        let _d = d;
        panic!("a failing test");
    });
    let caught = futures_util::FutureExt::catch_unwind(failed).await;
    assert!(caught.is_err());
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    assert!(
        status.is_empty() || status.contains("State:\tZ"),
        "still running: {status}"
    );
}

/// Started with exactly the environment of Istio's sample deployment of
/// envoyproxy/ratelimit (only the ports are moved to free ones, through RATELIMITD_*, which
/// win) and a config laid out as its ConfigMap mount, the limits hold and are counted in that
/// Redis; /rlconfig is on the debug port; a ConfigMap update reloads.
#[tokio::test]
async fn istio_sample_environment_runs_unchanged() {
    let redis = common::redis::RedisProc::start(&[]);
    let data = tempfile::tempdir().unwrap();
    let config = data.path().join("ratelimit/config");
    let limits = |rpu: u32| {
        format!(
            "domain: ratelimit\ndescriptors:\n  - key: PATH\n    value: \"/productpage\"\n    rate_limit: {{unit: hour, requests_per_unit: {rpu}}}\n  - key: PATH\n    rate_limit: {{unit: hour, requests_per_unit: 100}}\n"
        )
    };
    // kubelet's layout: ..<generation>/config.yaml, ..data -> it, config.yaml -> ..data/config.yaml
    let swap = |generation: u32, text: &str| {
        let gen_dir = config.join(format!("..gen{generation}"));
        std::fs::create_dir_all(&gen_dir).unwrap();
        std::fs::write(gen_dir.join("config.yaml"), text).unwrap();
        let tmp = config.join("..data_tmp");
        std::os::unix::fs::symlink(format!("..gen{generation}"), &tmp).unwrap();
        std::fs::rename(&tmp, config.join("..data")).unwrap();
    };
    std::fs::create_dir_all(&config).unwrap();
    swap(1, &limits(1));
    std::os::unix::fs::symlink("..data/config.yaml", config.join("config.yaml")).unwrap();

    let debug = free_port();
    let mut cmd = ratelimitd("", &[]);
    cmd.env("REDIS_SOCKET_TYPE", "tcp")
        .env("REDIS_URL", format!("127.0.0.1:{}", redis.port))
        .env("USE_STATSD", "false")
        .env("LOG_LEVEL", "debug")
        .env("RUNTIME_ROOT", data.path())
        .env("RUNTIME_SUBDIRECTORY", "ratelimit")
        .env("RUNTIME_WATCH_ROOT", "false")
        .env("RUNTIME_IGNOREDOTFILES", "true")
        .env("RATELIMITD_DEBUG_ADDR", format!("127.0.0.1:{debug}"));
    let d = Daemon::start(cmd).await;
    let mut client = d.client().await;
    let productpage = || request("ratelimit", &[&[("PATH", "/productpage")]]);
    assert!(is_ok(&call(&mut client, productpage()).await));
    assert!(is_over(&call(&mut client, productpage()).await));
    assert!(is_ok(
        &call(
            &mut client,
            request("ratelimit", &[&[("PATH", "/reviews")]])
        )
        .await
    ));
    let keys = redis.cli(&["--scan", "--pattern", "*ratelimit*PATH*"]);
    assert_eq!(keys.lines().count(), 2, "counted in that Redis: {keys}");

    let debug_addr: SocketAddr = format!("127.0.0.1:{debug}").parse().unwrap();
    let (status, dump) = http_get(debug_addr, "/rlconfig").await;
    assert_eq!(status, 200);
    assert!(
        dump.contains("ratelimit.PATH_/productpage: unit=HOUR requests_per_unit=1"),
        "{dump}"
    );

    swap(2, &limits(5));
    poll(Duration::from_secs(10), || {
        let mut c = client.clone();
        async move { is_ok(&call(&mut c, productpage()).await).then_some(()) }
    })
    .await;
    let (exit, stderr) = d.terminate().await;
    assert!(exit.success());
    assert!(
        !stderr.contains("ignored"),
        "nothing of it is ignored: {stderr}"
    );
}

/// Variables of envoyproxy/ratelimit's with no equivalent are logged once as ignored; those
/// that cannot be honoured stop the service with a usage error.
#[tokio::test]
async fn reference_variables_without_an_equivalent_are_reported() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("l.yaml"), LIMITS).unwrap();
    let mut cmd = ratelimitd(dir.path(), &[]);
    cmd.env("PROMETHEUS_PATH", "/m")
        .env("EXPIRATION_JITTER_MAX_SECONDS", "300")
        .env("USE_STATSD", "true");
    let d = Daemon::start(cmd).await;
    let (_, stderr) = d.terminate().await;
    assert_eq!(
        stderr
            .matches("PROMETHEUS_PATH=/m has no equivalent")
            .count(),
        1,
        "{stderr}"
    );
    // And one that now has: the reference's statsd defaults.
    assert!(
        stderr.contains("sending stats to statsd addr=localhost:8125 protocol=Tcp"),
        "{stderr}"
    );
    assert!(
        stderr.contains("EXPIRATION_JITTER_MAX_SECONDS=300"),
        "{stderr}"
    );

    let out = ratelimitd("x", &[])
        .env("BACKEND_TYPE", "memcache")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("BACKEND_TYPE=memcache"));
}

/// `--grpc-uds` (GRPC_UDS, here through the variable): gRPC on a Unix socket with the stated
/// permissions and not on TCP; a socket an earlier run left there is replaced, a file that is
/// not a socket is an error naming the path.
#[tokio::test]
async fn grpc_on_a_unix_socket() {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("l.yaml"), LIMITS).unwrap();
    let sockets = tempfile::tempdir().unwrap();
    let sock = sockets.path().join("rl.sock");
    drop(std::os::unix::net::UnixListener::bind(&sock).unwrap());
    let mut cmd = ratelimitd(dir.path(), &[]);
    cmd.env("GRPC_UDS", &sock);
    let d = Daemon::start(cmd).await;
    let mode = std::fs::metadata(&sock).unwrap().permissions().mode();
    assert_eq!(mode & 0o777, 0o660, "{mode:o}");
    let path = sock.clone();
    let channel = tonic::transport::Endpoint::try_from("http://localhost")
        .unwrap()
        .connect_with_connector(tower::service_fn(move |_: http::Uri| {
            let path = path.clone();
            async move {
                let stream = tokio::net::UnixStream::connect(path).await?;
                Ok::<_, std::io::Error>(hyper_util::rt::TokioIo::new(stream))
            }
        }))
        .await
        .unwrap();
    let mut c = Client::new(channel);
    assert!(is_ok(&call(&mut c, request("d", &[&[("k", "v")]])).await));
    assert!(
        tokio::net::TcpStream::connect(("127.0.0.1", d.grpc))
            .await
            .is_err(),
        "no gRPC on TCP"
    );
    drop(d);

    let file = sockets.path().join("not-a-socket");
    std::fs::write(&file, "").unwrap();
    let out = ratelimitd(dir.path(), &["--grpc-uds", file.to_str().unwrap()])
        .env("RATELIMITD_HTTP_ADDR", "127.0.0.1:0")
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    assert!(
        stderr.contains(&file.display().to_string()) && stderr.contains("not a socket"),
        "{stderr}"
    );
    assert_eq!(
        stderr.matches("not a socket").count(),
        1,
        "said once: {stderr}"
    );
}

/// `--grpc-uds` never takes a socket a live process listens on: a second service on the
/// same path, or ratelimitd started twice, is refused with the path named, and the first keeps
/// its socket and its clients. (Before, the file was unlinked and replaced, silently, and the
/// first process stayed up unreachable.)
#[tokio::test]
async fn grpc_uds_refuses_a_socket_a_live_process_listens_on() {
    use std::io::{Read, Write};
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("l.yaml"), LIMITS).unwrap();
    let sockets = tempfile::tempdir().unwrap();
    let refused = |sock: &std::path::Path| {
        let mut child = ratelimitd(dir.path(), &["--grpc-uds", sock.to_str().unwrap()])
            .env("RATELIMITD_HTTP_ADDR", "127.0.0.1:0")
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        common::redis::watchdog(child.id());
        let started = tokio::time::Instant::now();
        let status = loop {
            if let Some(status) = child.try_wait().unwrap() {
                break status;
            }
            if started.elapsed() > Duration::from_secs(20) {
                let _ = child.kill();
                panic!("started on {} and took it", sock.display());
            }
            std::thread::sleep(Duration::from_millis(20));
        };
        let mut stderr = String::new();
        child
            .stderr
            .take()
            .unwrap()
            .read_to_string(&mut stderr)
            .unwrap();
        assert!(!status.success(), "{stderr}");
        assert!(
            stderr.contains(&sock.display().to_string()) && stderr.contains("another process"),
            "{stderr}"
        );
    };

    // Another service's socket.
    let theirs = sockets.path().join("theirs.sock");
    let listener = std::os::unix::net::UnixListener::bind(&theirs).unwrap();
    refused(&theirs);
    let mut client = std::os::unix::net::UnixStream::connect(&theirs).unwrap();
    client.write_all(b"still theirs").unwrap();
    drop(client);
    // ratelimitd's own look (connected, closed at once) came first.
    let mut got = Vec::new();
    while got.is_empty() {
        let (mut served, _) = listener.accept().unwrap();
        served.read_to_end(&mut got).unwrap();
    }
    assert_eq!(got, b"still theirs");

    // ratelimitd started twice on one path.
    let ours = sockets.path().join("rl.sock");
    let first = Daemon::start(ratelimitd(
        dir.path(),
        &["--grpc-uds", ours.to_str().unwrap()],
    ))
    .await;
    refused(&ours);
    let path = ours.clone();
    let channel = tonic::transport::Endpoint::try_from("http://localhost")
        .unwrap()
        .connect_with_connector(tower::service_fn(move |_: http::Uri| {
            let path = path.clone();
            async move {
                let stream = tokio::net::UnixStream::connect(path).await?;
                Ok::<_, std::io::Error>(hyper_util::rt::TokioIo::new(stream))
            }
        }))
        .await
        .unwrap();
    let mut c = Client::new(channel);
    assert!(is_ok(&call(&mut c, request("d", &[&[("k", "v")]])).await));
    drop(first);
    // Nothing listens now: the socket it left is replaced at the next start.
    let again = Daemon::start(ratelimitd(
        dir.path(),
        &["--grpc-uds", ours.to_str().unwrap()],
    ))
    .await;
    assert!(std::os::unix::net::UnixStream::connect(&ours).is_ok());
    drop(again);
    // Nothing else was left beside the socket (the directory it is made in is removed).
    let left: Vec<_> = std::fs::read_dir(sockets.path())
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(left.len(), 2, "{left:?}");
}

/// envoyproxy/ratelimit's `REDIS_PERSECOND`: its limits whose unit is a second are counted in
/// the Redis `REDIS_PERSECOND_URL` names, the others in `REDIS_URL`'s, as that service splits
/// them.
#[tokio::test]
async fn redis_persecond_counts_second_limits_in_their_own_redis() {
    let main = common::redis::RedisProc::start(&[]);
    let fast = common::redis::RedisProc::start(&[]);
    let data = tempfile::tempdir().unwrap();
    let config = data.path().join("config");
    std::fs::create_dir_all(&config).unwrap();
    std::fs::write(
        config.join("limits.yaml"),
        "domain: ps\ndescriptors:\n  - key: rps\n    rate_limit: {unit: second, requests_per_unit: 1000}\n  - key: rph\n    rate_limit: {unit: hour, requests_per_unit: 1000}\n",
    )
    .unwrap();
    let mut cmd = ratelimitd("", &[]);
    cmd.env("REDIS_SOCKET_TYPE", "tcp")
        .env("REDIS_URL", format!("127.0.0.1:{}", main.port))
        .env("REDIS_PERSECOND", "true")
        .env("REDIS_PERSECOND_SOCKET_TYPE", "tcp")
        .env("REDIS_PERSECOND_URL", format!("127.0.0.1:{}", fast.port))
        .env("USE_STATSD", "false")
        .env("RUNTIME_ROOT", data.path())
        .env("RUNTIME_SUBDIRECTORY", "")
        .env("RUNTIME_IGNOREDOTFILES", "true");
    let d = Daemon::start(cmd).await;
    let mut client = d.client().await;
    let r = call(
        &mut client,
        request("ps", &[&[("rps", "a")], &[("rph", "a")]]),
    )
    .await;
    assert!(is_ok(&r), "{r:?}");
    // A one-second counter may have expired by the time it is looked for: a key written is
    // either there or counted in `expired_keys` (the servers hold nothing else).
    let written = |node: &common::redis::RedisProc, name: &str| -> u64 {
        let keys = node.cli(&["--scan", "--pattern", &format!("*{name}*")]);
        let expired: u64 = node
            .cli(&["INFO", "stats"])
            .lines()
            .find_map(|l| l.strip_prefix("expired_keys:"))
            .and_then(|n| n.trim().parse().ok())
            .expect("INFO stats has expired_keys");
        keys.lines().count() as u64 + expired
    };
    assert_eq!(
        (written(&main, "rph"), written(&main, "rps")),
        (1, 0),
        "the hourly counter in the main Redis, nothing expired there"
    );
    let listed = fast.cli(&["--scan", "--pattern", "*rph*"]);
    assert!(
        listed.is_empty(),
        "no hourly counter in the per-second Redis: {listed}"
    );
    assert_eq!(
        written(&fast, "rps"),
        1,
        "the per-second counter in the per-second Redis"
    );
    let (status, log) = d.terminate().await;
    assert!(status.success(), "{log}");
}

/// With the per-second Redis down and `--redis-failure-mode local`, only its limits fall
/// back: an hourly budget spent in the healthy main Redis still refuses requests that carry
/// both descriptors (before: 10 of 30 admitted, both decided in memory), and a refused request
/// takes nothing from the per-second limit decided in memory.
#[tokio::test]
async fn a_per_second_redis_down_leaves_the_main_stores_budgets_in_force() {
    let main = common::redis::RedisProc::start(&[]);
    let mut fast = common::redis::RedisProc::start(&[]);
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(
        dir.path().join("limits.yaml"),
        "domain: ps\ndescriptors:\n  - key: rps\n    rate_limit: {unit: second, requests_per_unit: 10}\n  - key: rph\n    rate_limit: {unit: hour, requests_per_unit: 5}\n",
    )
    .unwrap();
    let (main_url, fast_url) = (main.url(), fast.url());
    let d = Daemon::start(ratelimitd(
        dir.path(),
        &[
            "--backend",
            "redis",
            "--redis-url",
            &main_url,
            "--redis-per-second-url",
            &fast_url,
            "--redis-failure-mode",
            "local",
            "--redis-timeout",
            "2s",
        ],
    ))
    .await;
    let mut c = d.client().await;
    let both = || request("ps", &[&[("rps", "a")], &[("rph", "a")]]);
    for _ in 0..5 {
        assert!(is_ok(&call(&mut c, both()).await));
    }
    assert!(
        is_over(&call(&mut c, both()).await),
        "the hourly budget is spent"
    );
    fast.kill();
    let mut admitted = 0;
    for _ in 0..30 {
        let r = call(&mut c, both()).await;
        assert!(r.statuses.len() == 2, "{r:?}");
        admitted += usize::from(is_ok(&r));
    }
    assert_eq!(
        admitted, 0,
        "requests admitted past the main store's spent budget"
    );
    assert!(is_over(
        &call(&mut c, request("ps", &[&[("rph", "a")]])).await
    ));
    // The per-second limit alone is decided in memory, and the 30 refused took none of it.
    let mut alone = 0;
    for _ in 0..12 {
        alone += usize::from(is_ok(
            &call(&mut c, request("ps", &[&[("rps", "b")]])).await,
        ));
    }
    assert!(
        (10..=12).contains(&alone),
        "{alone} of 12 within a limit of 10/s"
    );
    let r = call(&mut c, request("ps", &[&[("rps", "a")]])).await;
    assert!(
        is_ok(&r),
        "the refused requests took nothing from rps=a: {r:?}"
    );
    let (_, m) = http_get(d.http, "/metrics").await;
    assert!(
        metric(
            &m,
            r#"ratelimit_failure_mode_decisions_total{mode="local"}"#
        ) >= 30.0,
        "{m}"
    );
}

/// After a Redis restart, the first call is decided by Redis (its connection, found closed,
/// is made afresh: before, it failed with a broken pipe), and health says up only once calls
/// will work: with nobody calling, the probe finds the calls' connection closed and makes it afresh (before,
/// only its own PING connection came back, and the first call after, minutes later for an
/// idle replica, failed with a broken pipe); a burst of 16 right after health says up gets
/// no error (before: one UNAVAILABLE).
#[tokio::test]
async fn after_a_redis_restart_health_says_up_only_when_calls_work() {
    let mut redis = common::redis::RedisProc::start(&[]);
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("l.yaml"), LIMITS).unwrap();
    let url = redis.url();
    let d = Daemon::start(ratelimitd(
        dir.path(),
        &[
            "--backend",
            "redis",
            "--redis-url",
            &url,
            // No other use of the main connection than the calls and the probe.
            "--top-publish-interval",
            "1h",
            // The claim is resend, not speed: a reconnect, a FUNCTION LOAD into the empty new
            // Redis and the call again fit one budget even on a loaded machine.
            "--redis-timeout",
            "2s",
        ],
    ))
    .await;
    let mut c = d.client().await;
    assert!(is_ok(&call(&mut c, request("d", &[&[("k", "v")]])).await));
    let clients = |redis: &common::redis::RedisProc| -> u64 {
        redis
            .cli(&["INFO", "clients"])
            .lines()
            .find_map(|l| l.strip_prefix("connected_clients:"))
            .and_then(|n| n.trim().parse().ok())
            .expect("INFO clients")
    };
    // The probe's, the calls' and redis-cli's.
    let before = poll(Duration::from_secs(15), || {
        let n = clients(&redis);
        async move { (n >= 3).then_some(n) }
    })
    .await;
    // A call right after a restart (the probe runs every second and has likely not run yet)
    // finds its connection closed, never written: it is sent again on a fresh one.
    redis.restart();
    let r = c
        .should_rate_limit(request("d", &[&[("k", "first")]]))
        .await;
    if !r.as_ref().is_ok_and(|r| is_ok(r.get_ref())) {
        let (_, log) = d.terminate().await;
        panic!("decided by Redis: {r:?}\n{log}");
    }

    redis.restart();
    // Nobody calls: the probe alone brings the calls' connection back.
    poll(Duration::from_secs(15), || {
        let n = clients(&redis);
        async move { (n >= before).then_some(()) }
    })
    .await;
    poll(Duration::from_secs(15), || async {
        let (_, m) = http_get(d.http, "/metrics").await;
        (metric(&m, "ratelimit_backend_up") == 1.0).then_some(())
    })
    .await;
    let burst = (0..16).map(|i| {
        let mut c = c.clone();
        async move {
            let value = format!("burst-{i}");
            c.should_rate_limit(request("d", &[&[("k", &value)]])).await
        }
    });
    for r in futures_util::future::join_all(burst).await {
        let r = r.expect("every call of the burst decided by Redis");
        assert!(is_ok(&r.into_inner()));
    }
    let (_, m) = http_get(d.http, "/metrics").await;
    assert_eq!(
        metric(&m, r#"ratelimit_grpc_errors_total{code="unavailable"}"#),
        0.0,
        "{m}"
    );
}

/// An outage is in the log once per interval, not once per request, probe or flush: with
/// Redis down and the failure mode `error`, three seconds of calls log "backend unavailable"
/// and "circuit open" a line or two (before: a line per request, and "circuit open" every
/// ~100 ms), and statsd over UDP to a port nothing listens on says so once (before: "failed"
/// and "reachable again" by turns, every flush).
#[tokio::test]
async fn an_outage_is_in_the_log_once_per_interval() {
    let mut redis = common::redis::RedisProc::start(&[]);
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("l.yaml"), LIMITS).unwrap();
    let log = dir.path().join("stderr.log");
    let url = redis.url();
    let statsd = format!("127.0.0.1:{}", free_port());
    let cmd = ratelimitd(
        dir.path(),
        &[
            "--backend",
            "redis",
            "--redis-url",
            &url,
            "--statsd-addr",
            &statsd,
            "--statsd-protocol",
            "udp",
            "--statsd-flush-interval",
            "100ms",
        ],
    );
    let d = Daemon::start_with(cmd, || {
        std::process::Stdio::from(std::fs::File::create(&log).unwrap())
    })
    .await;
    let mut c = d.client().await;
    assert!(is_ok(&call(&mut c, request("d", &[&[("k", "v")]])).await));
    redis.kill();
    let (mut calls, until) = (0, tokio::time::Instant::now() + Duration::from_secs(3));
    while tokio::time::Instant::now() < until {
        let r = c.should_rate_limit(request("d", &[&[("k", "v")]])).await;
        calls += usize::from(r.is_err());
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(calls >= 20, "{calls} calls failed");
    drop(d);
    let text = std::fs::read_to_string(&log).unwrap();
    for (line, most) in [
        ("grpc: backend unavailable", 1),
        ("circuit open", 1),
        ("statsd: statsd flush failed", 1),
        ("statsd: statsd collector reachable again", 1),
    ] {
        let n = text.lines().filter(|l| l.contains(line)).count();
        assert!(n <= most, "{n} lines of '{line}' in 3 s:\n{text}");
    }
}

/// RLQS: a bucket id present but with no pairs is skipped and counted as an absent one, and
/// gets no action (before: allow, TTL 4 s, for a bucket Envoy cannot have).
#[tokio::test]
async fn rlqs_skips_an_empty_bucket_id_as_an_absent_one() {
    use envoy_types::pb::envoy::service::rate_limit_quota::v3::rate_limit_quota_service_client::RateLimitQuotaServiceClient;
    use envoy_types::pb::envoy::service::rate_limit_quota::v3::rate_limit_quota_usage_reports::BucketQuotaUsage;
    use envoy_types::pb::envoy::service::rate_limit_quota::v3::{
        BucketId, RateLimitQuotaUsageReports,
    };
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(
        dir.path().join("q.yaml"),
        "domain: q\ndescriptors:\n  - key: name\n    value: api\n    rate_limit: {unit: minute, requests_per_unit: 600}\n",
    )
    .unwrap();
    let d = Daemon::start(ratelimitd(dir.path(), &[])).await;
    let mut client = RateLimitQuotaServiceClient::connect(format!("http://127.0.0.1:{}", d.grpc))
        .await
        .unwrap();
    let usage = |pairs: &[(&str, &str)]| BucketQuotaUsage {
        bucket_id: Some(BucketId {
            bucket: pairs
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
        }),
        time_elapsed: None,
        num_requests_allowed: 1,
        num_requests_denied: 0,
    };
    let (tx, rx) = tokio::sync::mpsc::channel(4);
    tx.send(RateLimitQuotaUsageReports {
        domain: "q".into(),
        bucket_quota_usages: vec![usage(&[]), usage(&[("name", "api")])],
    })
    .await
    .unwrap();
    let mut answers = client
        .stream_rate_limit_quotas(tokio_stream::wrappers::ReceiverStream::new(rx))
        .await
        .unwrap()
        .into_inner();
    let answer = tokio::time::timeout(Duration::from_secs(10), answers.message())
        .await
        .expect("an answer within 10 s")
        .unwrap()
        .expect("an answer");
    let ids: Vec<usize> = answer
        .bucket_action
        .iter()
        .map(|a| a.bucket_id.as_ref().map_or(0, |id| id.bucket.len()))
        .collect();
    assert_eq!(ids, [1], "one action, for name=api: {answer:?}");
    let (_, m) = http_get(d.http, "/metrics").await;
    assert_eq!(
        metric(
            &m,
            r#"ratelimit_rlqs_skipped_entries_total{kind="no_bucket_id"}"#
        ),
        1.0,
        "{m}"
    );
    drop(tx);
}

/// While a costly request (more than 64 counters) is handled, the worker gate holds no worker:
/// one waiting on a stalled Redis brings every worker in at once (before: the gate, seeing no
/// worker saturated, kept one worker for it and everything queued behind its steps), and once
/// it is answered one is held again.
#[tokio::test]
async fn the_worker_gate_holds_no_worker_while_a_costly_request_is_handled() {
    if std::thread::available_parallelism().map_or(1, |n| n.get()) < 2 {
        eprintln!("skipped: one core, no worker to hold");
        return;
    }
    let redis = common::redis::RedisProc::start(&[]);
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(
        dir.path().join("l.yaml"),
        "domain: d\ndescriptors:\n  - key: k\n    rate_limit: {unit: hour, requests_per_unit: 1000}\n",
    )
    .unwrap();
    let url = redis.url();
    let d = Daemon::start(ratelimitd(
        dir.path(),
        &[
            "--backend",
            "redis",
            "--redis-url",
            &url,
            "--redis-timeout",
            "20s",
            "--request-timeout",
            "30s",
            "--max-descriptors",
            "100",
        ],
    ))
    .await;
    // Read every 100 ms: a scrape is work too, and scraping without a pause would keep a
    // worker busy enough to bring the other in.
    let active = || async {
        tokio::time::sleep(Duration::from_millis(100)).await;
        let (_, m) = http_get(d.http, "/metrics").await;
        metric(&m, "ratelimit_worker_threads_active")
    };
    poll(Duration::from_secs(30), || async {
        (active().await == 1.0).then_some(())
    })
    .await;
    // In force once the command returns: every other client's commands wait 3 s.
    assert_eq!(redis.cli(&["CLIENT", "PAUSE", "3000", "ALL"]).trim(), "OK");
    let values: Vec<String> = (0..70).map(|i| format!("v{i}")).collect();
    let descriptors: Vec<[(&str, &str); 1]> = values.iter().map(|v| [("k", v.as_str())]).collect();
    let descriptors: Vec<&[(&str, &str)]> = descriptors.iter().map(|d| &d[..]).collect();
    let costly = request("d", &descriptors);
    let mut c = d.client().await;
    let call = tokio::spawn(async move { c.should_rate_limit(costly).await });
    poll(Duration::from_secs(3), || async {
        (active().await == 2.0).then_some(())
    })
    .await;
    let answer = call.await.unwrap().expect("answered once Redis is back");
    assert!(is_ok(&answer.into_inner()));
    poll(Duration::from_secs(30), || async {
        (active().await == 1.0).then_some(())
    })
    .await;
}

/// A GET answered with a body of known length (binary allowed): status and body bytes.
async fn get_bytes(addr: SocketAddr, path: &str) -> (u16, Vec<u8>) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut stream = tokio::net::TcpStream::connect(addr).await.unwrap();
    let req = format!("GET {path} HTTP/1.1\r\nHost: test\r\nConnection: close\r\n\r\n");
    stream.write_all(req.as_bytes()).await.unwrap();
    let mut raw = Vec::new();
    stream.read_to_end(&mut raw).await.unwrap();
    let end = raw
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .expect("a whole answer");
    let head = String::from_utf8_lossy(&raw[..end]).to_string();
    assert!(!head.to_ascii_lowercase().contains("chunked"), "{head}");
    let status = head.split_whitespace().nth(1).unwrap().parse().unwrap();
    (status, raw[end + 4..].to_vec())
}

/// The debug port (`--debug-addr`, envoyproxy/ratelimit's `DEBUG_PORT`) serves `/stats` and a
/// CPU profile `go tool pprof` reads, one at a time, of a bounded length; the HTTP port serves
/// neither.
#[tokio::test]
async fn the_debug_port_serves_stats_and_a_cpu_profile() {
    let debug: SocketAddr = format!("127.0.0.1:{}", free_port()).parse().unwrap();
    let (d, _dir) = common::daemon::quiet(
        "domain: d\ndescriptors:\n  - key: k\n    rate_limit: {unit: hour, requests_per_unit: 1000000}\n",
        &["--debug-addr", &debug.to_string()],
    )
    .await;
    let mut client = d.client().await;
    for _ in 0..3 {
        assert!(is_ok(
            &call(&mut client, request("d", &[&[("k", "v")]])).await
        ));
    }
    let (status, stats) = http_get(debug, "/stats").await;
    assert_eq!(status, 200);
    assert!(
        stats.contains("ratelimit_server.ShouldRateLimit.total_requests: 3\n"),
        "{stats}"
    );
    assert!(stats.contains("ratelimit.service.config_load_success: 1\n"));
    let resident: u64 = stats
        .lines()
        .find_map(|l| l.strip_prefix("process.resident_bytes: "))
        .unwrap()
        .parse()
        .unwrap();
    assert!(resident > 1 << 20, "{stats}");
    let (status, index) = http_get(debug, "/debug/pprof/").await;
    assert!(status == 200 && index.contains("at most 20"), "{index}");
    for path in ["/stats", "/debug/pprof/profile?seconds=1"] {
        assert_eq!(
            http_get(d.http, path).await.0,
            404,
            "{path} on the HTTP port"
        );
    }
    for bad in ["0", "21", "x"] {
        let path = format!("/debug/pprof/profile?seconds={bad}");
        assert_eq!(http_get(debug, &path).await.0, 400, "{path}");
    }

    // Busy while profiles are taken, so that they have samples; until told to stop, within a
    // bound of its own.
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let load = tokio::spawn({
        let stop = stop.clone();
        async move {
            let until = tokio::time::Instant::now() + Duration::from_secs(60);
            while !stop.load(Ordering::Relaxed) && tokio::time::Instant::now() < until {
                let calls = (0..64).map(|_| {
                    let mut c = client.clone();
                    async move { c.should_rate_limit(request("d", &[&[("k", "v")]])).await }
                });
                for r in futures_util::future::join_all(calls).await {
                    r.unwrap();
                }
            }
        }
    });
    // Two at once: one is taken, the other refused (2 s each, so they overlap whichever
    // arrives first).
    let first = tokio::spawn(get_bytes(debug, "/debug/pprof/profile?seconds=2"));
    let second = tokio::spawn(get_bytes(debug, "/debug/pprof/profile?seconds=2"));
    let (first, second) = (first.await.unwrap(), second.await.unwrap());
    let mut statuses = [first.0, second.0];
    statuses.sort();
    assert_eq!(statuses, [200, 429]);
    let body = if first.0 == 200 { first.1 } else { second.1 };
    use pprof::protos::Message as _;
    let mut profile = pprof::protos::Profile::decode(body.as_slice()).expect("a pprof protobuf");
    // Done: the next one may start. A profile samples the process when a kernel tick finds it
    // on a CPU: on a machine busy with other work, a service that runs in short bursts can be
    // missed for seconds, so profiles are taken until one has the service's own functions.
    let named = |p: &pprof::protos::Profile| {
        !p.sample.is_empty() && p.string_table.iter().any(|s| s.contains("ratelimitd"))
    };
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    while !named(&profile) {
        assert!(
            tokio::time::Instant::now() < deadline,
            "no profile named the service's functions in 30 s: {} samples in the last",
            profile.sample.len()
        );
        let (status, body) = get_bytes(debug, "/debug/pprof/profile?seconds=1").await;
        assert_eq!(status, 200);
        profile = pprof::protos::Profile::decode(body.as_slice()).expect("a pprof protobuf");
    }
    stop.store(true, Ordering::Relaxed);
    load.await.unwrap();
    assert_eq!(
        get_bytes(debug, "/debug/pprof/profile?seconds=1").await.0,
        200
    );
}

/// The worker gate (`--worker-gate`, on by default): of two tokio workers one is held while
/// the service idles (`ratelimit_worker_threads_active` reads 1), calls are answered all the
/// while, and SIGTERM exits cleanly with a worker held; `--worker-gate=false` keeps both.
#[tokio::test]
async fn the_worker_gate_holds_a_worker_at_rest_and_exits_cleanly() {
    for (flags, active) in [(&[][..], "1"), (&["--worker-gate=false"][..], "2")] {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("l.yaml"), LIMITS).unwrap();
        let mut cmd = ratelimitd(dir.path(), flags);
        cmd.env("TOKIO_WORKER_THREADS", "2");
        let d = Daemon::start(cmd).await;
        let want = format!("\nratelimit_worker_threads_active {active}\n");
        poll(Duration::from_secs(20), || async {
            http_get(d.http, "/metrics")
                .await
                .1
                .contains(&want)
                .then_some(())
        })
        .await;
        let mut client = d.client().await;
        // Within the limit of 5 a second.
        for _ in 0..3 {
            assert!(is_ok(
                &call(&mut client, request("d", &[&[("k", "v")]])).await
            ));
        }
        let (exit, stderr) = d.terminate().await;
        assert!(exit.success(), "{flags:?}: {exit:?} {stderr}");
    }
}

/// A Redis that can evict (any `maxmemory-policy` but `noeviction`: every key of the service
/// has a TTL) is warned of at start, naming the policy; `noeviction` is said to be safe.
#[tokio::test]
async fn a_redis_that_can_evict_is_warned_of_at_start() {
    for (policy, want) in [
        ("allkeys-lru", "maxmemory-policy allkeys-lru can evict"),
        ("volatile-ttl", "maxmemory-policy volatile-ttl can evict"),
        ("noeviction", "maxmemory-policy noeviction: no key"),
    ] {
        let redis =
            common::redis::RedisProc::start(&["--maxmemory", "64mb", "--maxmemory-policy", policy]);
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("l.yaml"), LIMITS).unwrap();
        let log = dir.path().join("stderr.log");
        let url = redis.url();
        let cmd = ratelimitd(dir.path(), &["--backend", "redis", "--redis-url", &url]);
        let d = Daemon::start_with(cmd, || {
            std::process::Stdio::from(std::fs::File::create(&log).unwrap())
        })
        .await;
        let line = poll(Duration::from_secs(10), || async {
            let text = std::fs::read_to_string(&log).unwrap_or_default();
            text.lines()
                .find(|l| l.contains("maxmemory-policy"))
                .map(str::to_owned)
        })
        .await;
        assert!(line.contains(want), "{policy}: {line}");
        assert_eq!(
            line.contains("WARN"),
            policy != "noeviction",
            "{policy}: {line}"
        );
        drop(d);
    }
}
