//! Test harness: a real ratelimitd on loopback port 0, a real gRPC client, raw HTTP, polling.
#![allow(dead_code)]

use std::future::Future;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

use envoy_types::pb::envoy::extensions::common::ratelimit::v3::RateLimitDescriptor;
use envoy_types::pb::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::Entry;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::Code;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_client::RateLimitServiceClient;
use envoy_types::pb::envoy::service::ratelimit::v3::{RateLimitRequest, RateLimitResponse};
use envoy_types::pb::google::protobuf::UInt64Value;
use ratelimitd::testing::run_with_clock;
use ratelimitd::testing::{Clock, SystemClock};
use ratelimitd::{Listeners, RunError, Shutdown};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;
use tonic::transport::Channel;

pub(crate) mod ads;
pub(crate) mod balancer;
pub(crate) mod daemon;
pub(crate) mod envoy;
pub(crate) mod frames;
pub(crate) mod gateway;
pub(crate) mod istio;
pub(crate) mod raw;
pub(crate) mod redis;

pub(crate) type Client = RateLimitServiceClient<Channel>;

/// Which backend a behavioural test runs on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Kind {
    Memory,
    Redis,
    Cluster,
    /// The cluster with `--redis-hash-tag descriptor`: one script per slot group, refunds.
    ClusterPerDescriptor,
}

impl Kind {
    /// Flags selecting this backend; Redis kinds share one server (or cluster) per test binary,
    /// each test under its own key prefix.
    pub(crate) fn flags(self) -> Vec<String> {
        let common = |target: &[String]| {
            let mut f = vec!["--backend".to_string(), "redis".into()];
            f.extend(target.iter().cloned());
            f.extend([
                "--redis-key-prefix".to_string(),
                redis::unique_prefix(),
                // Generous: a debug build on a loaded CI machine; fault tests set their own.
                "--redis-timeout".into(),
                "2s".into(),
            ]);
            f
        };
        match self {
            Kind::Memory => vec![],
            Kind::Redis => common(&["--redis-url".into(), redis::shared_standalone().url()]),
            Kind::Cluster => common(&[
                "--redis-cluster-nodes".into(),
                redis::shared_cluster().urls(),
            ]),
            Kind::ClusterPerDescriptor => common(&[
                "--redis-cluster-nodes".into(),
                redis::shared_cluster().urls(),
                "--redis-hash-tag".into(),
                "descriptor".into(),
            ]),
        }
    }
}

/// A Redis-backed server: `target` picks the Redis (plus any other flags), under `prefix`,
/// with a per-call `timeout`.
pub(crate) async fn redis_server(
    files: &[(&str, &str)],
    target: &[&str],
    prefix: &str,
    timeout: &str,
) -> TestServer {
    let mut flags = vec!["--backend", "redis", "--redis-key-prefix", prefix];
    flags.extend_from_slice(&["--redis-timeout", timeout]);
    flags.extend_from_slice(target);
    TestServer::start_with(files, &flags, Arc::new(SystemClock)).await
}

/// How a fresh Redis-backed server with `target` (the Redis, TLS flags) answers one request of
/// `domain` for each value of key `k`: admitted or not, or the gRPC code it failed with.
pub(crate) async fn answers_on(
    files: &[(&str, &str)],
    target: &[&str],
    domain: &str,
    values: &[&str],
) -> Vec<Result<bool, tonic::Code>> {
    let s = redis_server(files, target, &redis::unique_prefix(), "2s").await;
    let mut c = s.client().await;
    let mut answers = Vec::with_capacity(values.len());
    for v in values {
        answers.push(
            c.should_rate_limit(request(domain, &[&[("k", v)]]))
                .await
                .map(|r| is_ok(r.get_ref()))
                .map_err(|e| e.code()),
        );
    }
    answers
}

/// A server on `kind` with `files` and extra flags.
pub(crate) async fn start(kind: Kind, files: &[(&str, &str)], extra: &[&str]) -> TestServer {
    let mut flags = kind.flags();
    flags.extend(extra.iter().map(|s| s.to_string()));
    let flags: Vec<&str> = flags.iter().map(String::as_str).collect();
    TestServer::start_with(files, &flags, Arc::new(SystemClock)).await
}

/// Generates one `#[tokio::test]` per backend for each `async fn name(kind: Kind)`.
#[macro_export]
macro_rules! every_backend {
    ($($name:ident),* $(,)?) => {
        mod memory {
            $(#[tokio::test] async fn $name() { super::$name(super::Kind::Memory).await })*
        }
        mod redis {
            $(#[tokio::test] async fn $name() { super::$name(super::Kind::Redis).await })*
        }
        mod cluster {
            $(#[tokio::test] async fn $name() { super::$name(super::Kind::Cluster).await })*
        }
        mod cluster_per_descriptor {
            $(#[tokio::test] async fn $name() { super::$name(super::Kind::ClusterPerDescriptor).await })*
        }
    };
}

/// Generates, per backend (memory and Redis), one test per `async fn name(kind: Kind, version:
/// &str)` that runs in every installed Envoy version (the caller imports `common::envoy`).
#[macro_export]
macro_rules! in_envoy {
    ($($name:ident),* $(,)?) => {
        mod memory {
            $(#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $name() {
                for v in super::envoy::versions() { super::$name(super::Kind::Memory, v).await }
            })*
        }
        mod redis {
            $(#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $name() {
                for v in super::envoy::versions() { super::$name(super::Kind::Redis, v).await }
            })*
        }
    };
}

/// A running server with its config directory.
pub(crate) struct TestServer {
    pub grpc: SocketAddr,
    pub http: SocketAddr,
    /// The admin listener, when the flags name one (`--admin-addr`; the server listens on a
    /// free loopback port instead of the one named).
    pub admin: Option<SocketAddr>,
    pub dir: tempfile::TempDir,
    /// The flags it was started with.
    pub flags: Vec<String>,
    stop: Option<oneshot::Sender<Shutdown>>,
    pub task: Option<JoinHandle<Result<(), RunError>>>,
}

impl TestServer {
    /// Starts a server whose config directory holds `files` (name, YAML).
    pub(crate) async fn start(files: &[(&str, &str)]) -> TestServer {
        Self::start_with(files, &[], Arc::new(SystemClock)).await
    }

    /// Starts a server with extra flags and a clock for the memory backend.
    pub(crate) async fn start_with(
        files: &[(&str, &str)],
        flags: &[&str],
        clock: Arc<dyn Clock>,
    ) -> TestServer {
        let dir = tempfile::tempdir().unwrap();
        for (name, text) in files {
            std::fs::write(dir.path().join(name), text).unwrap();
        }
        Self::start_at(dir, None, flags, clock).await
    }

    /// Starts a server with extra flags and environment variables (read as the process's
    /// environment would be).
    pub(crate) async fn start_with_env(
        files: &[(&str, &str)],
        flags: &[&str],
        env: &[(&str, &str)],
    ) -> TestServer {
        let dir = tempfile::tempdir().unwrap();
        for (name, text) in files {
            std::fs::write(dir.path().join(name), text).unwrap();
        }
        Self::start_at_env(dir, None, flags, env, Arc::new(SystemClock)).await
    }

    /// Starts a server on a prepared directory; `config` defaults to the directory itself.
    pub(crate) async fn start_at(
        dir: tempfile::TempDir,
        config: Option<PathBuf>,
        flags: &[&str],
        clock: Arc<dyn Clock>,
    ) -> TestServer {
        Self::start_at_env(dir, config, flags, &[], clock).await
    }

    async fn start_at_env(
        dir: tempfile::TempDir,
        config: Option<PathBuf>,
        flags: &[&str],
        env: &[(&str, &str)],
        clock: Arc<dyn Clock>,
    ) -> TestServer {
        let config = config.unwrap_or_else(|| dir.path().to_owned());
        let mut args = vec!["ratelimitd".to_string()];
        // A server reading its config over xDS has no config path.
        if !flags.iter().any(|f| f.starts_with("--xds-server")) {
            args.extend(["--config".into(), config.display().to_string()]);
        }
        args.extend(flags.iter().map(|s| s.to_string()));
        let env: Vec<(String, String)> = env
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        let lookup = move |name: &str| {
            env.iter()
                .find(|(k, _)| k.as_str() == name)
                .map(|(_, v)| v.clone())
        };
        let (_, options) = ratelimitd::settings::parse(args.clone(), lookup).expect("settings");
        let loopback = "127.0.0.1:0".parse().unwrap();
        let grpc_listener = ratelimitd::bind(loopback).unwrap();
        let http_listener = ratelimitd::bind(loopback).unwrap();
        let grpc = grpc_listener.local_addr().unwrap();
        let http = http_listener.local_addr().unwrap();
        let admin_listener = args
            .iter()
            .any(|a| a.starts_with("--admin-addr"))
            .then(|| ratelimitd::bind(loopback).unwrap());
        let admin = admin_listener.as_ref().map(|l| l.local_addr().unwrap());
        let (stop, stopped) = oneshot::channel::<Shutdown>();
        let task = tokio::spawn(run_with_clock(
            options,
            Listeners {
                grpc: grpc_listener.into(),
                http: http_listener,
                extra_http: Vec::new(),
                debug_http: None,
                admin: admin_listener,
            },
            async { stopped.await.unwrap_or(Shutdown::Now) },
            clock,
        ));
        // The ports listen once the service serves: wait for that (a config that fails ends
        // the task instead), except where the first config comes over xDS, which a test may
        // send later.
        let waits_for_xds = args.iter().any(|a| a.starts_with("--xds-server"))
            && !args.iter().any(|a| a.starts_with("--start-without-config"));
        if !waits_for_xds {
            let until = Instant::now() + Duration::from_secs(20);
            while !task.is_finished() && TcpStream::connect(http).await.is_err() {
                assert!(Instant::now() < until, "not listening after 20 s");
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        }
        TestServer {
            grpc,
            http,
            admin,
            dir,
            flags: args,
            stop: Some(stop),
            task: Some(task),
        }
    }

    /// A client, once the server accepts; panics if the server has exited instead.
    pub(crate) async fn client(&self) -> Client {
        let url = format!("http://{}", self.grpc);
        poll(Duration::from_secs(10), || {
            let url = url.clone();
            let exited = self.task.as_ref().is_none_or(|t| t.is_finished());
            assert!(!exited, "the server exited before accepting (bad config?)");
            async move { RateLimitServiceClient::connect(url).await.ok() }
        })
        .await
    }

    pub(crate) async fn http_get(&self, path: &str) -> (u16, String) {
        http_get(self.http, path).await
    }

    /// One series' value on `/metrics` now (0 when absent).
    pub(crate) async fn metric(&self, series: &str) -> f64 {
        metric(&self.http_get("/metrics").await.1, series)
    }

    /// Signals shutdown as SIGINT does (no drain delay) and waits for `run` to return.
    pub(crate) async fn shutdown(&mut self) -> Result<(), RunError> {
        self.begin_shutdown(Shutdown::Now);
        self.finished().await
    }

    /// Begins a shutdown as `how` asks (SIGTERM's drain, or SIGINT's), without waiting.
    pub(crate) fn begin_shutdown(&mut self, how: Shutdown) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(how);
        }
    }

    /// Waits (15 s at most) for `run` to return.
    pub(crate) async fn finished(&mut self) -> Result<(), RunError> {
        let task = self.task.take().expect("running");
        tokio::time::timeout(Duration::from_secs(15), task)
            .await
            .expect("shut down within 15 s")
            .expect("run task")
    }

    /// Writes a file in the config directory.
    pub(crate) fn write(&self, name: &str, text: &str) {
        std::fs::write(self.dir.path().join(name), text).unwrap();
    }

    pub(crate) fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }
}

impl Drop for TestServer {
    fn drop(&mut self) {
        if let Some(task) = self.task.take() {
            task.abort();
        }
    }
}

/// A minimal HTTP/1.1 GET: status and body.
pub(crate) async fn http_get(addr: SocketAddr, path: &str) -> (u16, String) {
    try_http_get(addr, path)
        .await
        .unwrap_or_else(|e| panic!("GET {path} from {addr}: {e}"))
}

/// [`http_get`], or the I/O error that ended it (a server shutting down may reset a
/// connection it had not yet served).
pub(crate) async fn try_http_get(addr: SocketAddr, path: &str) -> std::io::Result<(u16, String)> {
    let mut stream = TcpStream::connect(addr).await?;
    let req = format!("GET {path} HTTP/1.1\r\nHost: test\r\nConnection: close\r\n\r\n");
    stream.write_all(req.as_bytes()).await?;
    let mut raw = Vec::new();
    stream.read_to_end(&mut raw).await?;
    let text = String::from_utf8_lossy(&raw).to_string();
    let status: u16 = text.split_whitespace().nth(1).unwrap().parse().unwrap();
    let (_, body) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
    let body = if text
        .to_ascii_lowercase()
        .contains("transfer-encoding: chunked")
    {
        dechunk(body)
    } else {
        body.to_string()
    };
    Ok((status, body))
}

/// A minimal HTTP/1.1 call with `headers` and `body`: status and body.
pub(crate) async fn http_call(
    addr: SocketAddr,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &[u8],
) -> (u16, String) {
    let mut stream = TcpStream::connect(addr).await.unwrap();
    let mut req = format!(
        "{method} {path} HTTP/1.1\r\nHost: test\r\nConnection: close\r\nContent-Length: {}\r\n",
        body.len()
    );
    for (k, v) in headers {
        req.push_str(&format!("{k}: {v}\r\n"));
    }
    req.push_str("\r\n");
    stream.write_all(req.as_bytes()).await.unwrap();
    // A server may answer (and close) before it has read a body it refuses.
    let _ = stream.write_all(body).await;
    let mut raw = Vec::new();
    let _ = stream.read_to_end(&mut raw).await;
    let text = String::from_utf8_lossy(&raw).to_string();
    let status: u16 = text
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("{method} {path}: no status in {text:?}"));
    let (head, body) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
    let body = if head
        .to_ascii_lowercase()
        .contains("transfer-encoding: chunked")
    {
        dechunk(body)
    } else {
        body.to_string()
    };
    (status, body)
}

fn dechunk(mut body: &str) -> String {
    let mut out = String::new();
    while let Some((size, rest)) = body.split_once("\r\n") {
        let n = usize::from_str_radix(size.trim(), 16).unwrap_or(0);
        if n == 0 {
            break;
        }
        out.push_str(&rest[..n]);
        body = &rest[n + 2..];
    }
    out
}

/// Polls `f` until it yields `Some`, or panics at the deadline.
pub(crate) async fn poll<T, F, Fut>(deadline: Duration, mut f: F) -> T
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Option<T>>,
{
    let until = Instant::now() + deadline;
    loop {
        if let Some(v) = f().await {
            return v;
        }
        assert!(
            Instant::now() < until,
            "condition not met within {deadline:?}"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// A descriptor from (key, value) pairs.
pub(crate) fn desc(entries: &[(&str, &str)]) -> RateLimitDescriptor {
    RateLimitDescriptor {
        entries: entries
            .iter()
            .map(|(k, v)| Entry {
                key: k.to_string(),
                value: v.to_string(),
            })
            .collect(),
        ..Default::default()
    }
}

/// A request for `domain` with one descriptor per entry list.
pub(crate) fn request(domain: &str, descriptors: &[&[(&str, &str)]]) -> RateLimitRequest {
    RateLimitRequest {
        domain: domain.into(),
        descriptors: descriptors.iter().map(|d| desc(d)).collect(),
        hits_addend: 0,
    }
}

/// Sends a request that must succeed.
pub(crate) async fn call(client: &mut Client, req: RateLimitRequest) -> RateLimitResponse {
    client
        .should_rate_limit(req)
        .await
        .expect("ShouldRateLimit")
        .into_inner()
}

/// `req` with descriptor `i` carrying its own `hits_addend`: greater than 0, a cost report under
/// the default accounting (recorded even past the limit); 0, a check.
pub(crate) fn with_hits(mut req: RateLimitRequest, i: usize, hits: u64) -> RateLimitRequest {
    req.descriptors[i].hits_addend = Some(UInt64Value { value: hits });
    req
}

/// `req` asking to pass with `hits` (the request-level `hits_addend`): a weighted admission,
/// all-or-nothing.
pub(crate) fn weighted(mut req: RateLimitRequest, hits: u32) -> RateLimitRequest {
    req.hits_addend = hits;
    req
}

/// Sends `req` `n` times, each admitted, then once more, refused: exactly `n` hits were left.
pub(crate) async fn admits_exactly(client: &mut Client, req: &RateLimitRequest, n: usize) {
    for i in 1..=n {
        let r = call(client, req.clone()).await;
        assert!(is_ok(&r), "call {i} of {n} refused: {r:?}");
    }
    let r = call(client, req.clone()).await;
    assert!(is_over(&r), "call {} admitted past {n}: {r:?}", n + 1);
}

pub(crate) fn is_ok(resp: &RateLimitResponse) -> bool {
    resp.overall_code == Code::Ok as i32
}

pub(crate) fn is_over(resp: &RateLimitResponse) -> bool {
    resp.overall_code == Code::OverLimit as i32
}

/// The `requests_per_unit` a status reports, if it reports a limit.
pub(crate) fn rpu_of(resp: &RateLimitResponse, i: usize) -> Option<u32> {
    resp.statuses[i]
        .current_limit
        .as_ref()
        .map(|l| l.requests_per_unit)
}

/// A clock-independent seconds value of a status's duration_until_reset.
pub(crate) fn reset_of(resp: &RateLimitResponse, i: usize) -> Duration {
    let d = resp.statuses[i]
        .duration_until_reset
        .as_ref()
        .expect("duration_until_reset");
    Duration::new(d.seconds as u64, d.nanos as u32)
}

/// The `"@type"` URLs in an Envoy example's text, each checked to be one of `known` (messages
/// of Envoy's own protos); returns how many there are.
pub(crate) fn envoy_types_in(text: &str, known: &[String]) -> usize {
    let mut types = 0;
    for line in text.lines() {
        if let Some(t) = line.trim().strip_prefix("\"@type\": ") {
            assert!(
                known.iter().any(|k| k == t),
                "{t} is not a message Envoy knows"
            );
            types += 1;
        }
    }
    types
}

/// Path to envoyproxy/ratelimit's fixtures, if present (required when CI asks).
pub(crate) fn fixtures() -> Option<PathBuf> {
    let dir = std::env::var_os("RATELIMITD_FIXTURES")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            Path::new(env!("CARGO_MANIFEST_DIR")).join("../shared/fixtures/envoyproxy-ratelimit")
        });
    required(dir)
}

/// `dir` if it exists; else `None` (the test skips), unless CI requires the fixtures.
fn required(dir: PathBuf) -> Option<PathBuf> {
    if dir.is_dir() {
        return Some(dir);
    }
    assert!(
        std::env::var_os("RATELIMITD_REQUIRE_FIXTURES").is_none(),
        "fixtures required but missing at {}",
        dir.display()
    );
    eprintln!("skipping: no fixtures at {}", dir.display());
    None
}

/// Envoy Gateway's translator corpus (`../shared/fixtures/envoy-gateway/ratelimit-config`),
/// beside the reference service's fixtures; `None` (the test skips) where they are missing.
pub(crate) fn envoy_gateway_corpus() -> Option<PathBuf> {
    required(fixtures()?.parent()?.join("envoy-gateway/ratelimit-config"))
}

/// The value of a metric line (exact label set) in Prometheus text, or 0.
pub(crate) fn metric(text: &str, series: &str) -> f64 {
    text.lines()
        .find_map(|l| {
            l.strip_prefix(series)
                .and_then(|rest| rest.strip_prefix(' '))
        })
        .map_or(0.0, |v| v.trim().parse().unwrap())
}

/// `POST /json` with `body` on the HTTP port at `addr`: the status and the body.
pub(crate) async fn post_json(addr: SocketAddr, body: &str) -> (u16, String) {
    let mut stream = tokio::net::TcpStream::connect(addr).await.unwrap();
    let req = format!(
        "POST /json HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    stream.write_all(req.as_bytes()).await.unwrap();
    let mut raw = Vec::new();
    stream.read_to_end(&mut raw).await.unwrap();
    let text = String::from_utf8_lossy(&raw).to_string();
    let status = text.split_whitespace().nth(1).unwrap().parse().unwrap();
    let body = text
        .split_once("\r\n\r\n")
        .map_or("", |(_, b)| b)
        .to_string();
    (status, body)
}

/// A route rate limit of an Envoy example, read into Envoy's `RateLimit` field by field: a
/// field Envoy's message does not have (or that the examples do not use) is refused here.
pub(crate) fn route_rate_limit(
    l: &serde_json::Value,
) -> envoy_types::pb::envoy::config::route::v3::RateLimit {
    use envoy_types::pb::envoy::config::route::v3::RateLimit;
    use envoy_types::pb::envoy::config::route::v3::rate_limit::HitsAddend;
    let mut limit = RateLimit::default();
    for (field, value) in l.as_object().unwrap() {
        match field.as_str() {
            "actions" => {
                limit.actions = value.as_array().unwrap().iter().map(action).collect();
            }
            "apply_on_stream_done" => limit.apply_on_stream_done = value == true,
            "hits_addend" => {
                let mut addend = HitsAddend::default();
                for (field, value) in value.as_object().unwrap() {
                    match field.as_str() {
                        "number" => {
                            addend.number = Some(UInt64Value {
                                value: value.as_u64().unwrap(),
                            })
                        }
                        "format" => addend.format = value.as_str().unwrap().to_owned(),
                        "is_negative_hits" => addend.is_negative_hits = value == true,
                        other => panic!("HitsAddend has no field {other}"),
                    }
                }
                limit.hits_addend = Some(addend);
            }
            other => panic!("RateLimit field {other} is not used here"),
        }
    }
    limit
}

/// An action of a route rate limit, read into Envoy's message field by field (the examples use
/// `request_headers` only).
fn action(a: &serde_json::Value) -> envoy_types::pb::envoy::config::route::v3::rate_limit::Action {
    use envoy_types::pb::envoy::config::route::v3::rate_limit::Action;
    use envoy_types::pb::envoy::config::route::v3::rate_limit::action::{
        ActionSpecifier, RequestHeaders,
    };
    let (kind, fields) = a.as_object().unwrap().iter().next().unwrap();
    assert_eq!(kind, "request_headers", "an action the examples do not use");
    let mut headers = RequestHeaders::default();
    for (field, value) in fields.as_object().unwrap() {
        let value = value.as_str().unwrap().to_owned();
        match field.as_str() {
            "header_name" => headers.header_name = value,
            "descriptor_key" => headers.descriptor_key = value,
            other => panic!("RequestHeaders field {other} is not used here"),
        }
    }
    Action {
        action_specifier: Some(ActionSpecifier::RequestHeaders(headers)),
    }
}

/// The line of `/rlconfig` (`rules`) for `key` in `domain`.
pub(crate) fn rule_line(rules: &str, domain: &str, key: &str) -> String {
    rules
        .lines()
        .find(|l| l.starts_with(&format!("{domain}.{key}:")))
        .unwrap_or_else(|| panic!("no rule for {key}: {rules}"))
        .to_owned()
}

/// xorshift64*: reproducible sequences from a printed seed, no dependency.
pub(crate) struct Rng(pub u64);

impl Rng {
    pub(crate) fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    pub(crate) fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}
