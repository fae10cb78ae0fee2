//! Tracing as envoyproxy/ratelimit offers it, against a test OTLP collector on loopback: the
//! binary started with `TRACING_*` and `OTEL_EXPORTER_OTLP_ENDPOINT` exports a span per
//! ShouldRateLimit call that continues the caller's `traceparent`, with the Redis wait as its
//! child, under the service's resource attributes, over OTLP/HTTP (its default) and gRPC.

mod common;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::daemon::{Daemon, ratelimitd};
use common::redis::RedisProc;
use common::*;
use envoy_types::pb::envoy::service::ratelimit::v3::RateLimitRequest;
use opentelemetry_proto::tonic::collector::trace::v1::trace_service_server::{
    TraceService, TraceServiceServer,
};
use opentelemetry_proto::tonic::collector::trace::v1::{
    ExportTraceServiceRequest, ExportTraceServiceResponse,
};
use opentelemetry_proto::tonic::common::v1::any_value::Value;
use prost::Message;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;

type Received = Arc<Mutex<Vec<ExportTraceServiceRequest>>>;

/// An OTLP/HTTP collector: answers every POST with 200 and keeps the decoded bodies.
async fn http_collector() -> (std::net::SocketAddr, Received) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let received: Received = Arc::default();
    let kept = received.clone();
    tokio::spawn(async move {
        while let Ok((mut stream, _)) = listener.accept().await {
            let kept = kept.clone();
            tokio::spawn(async move {
                let mut buf = Vec::new();
                let mut chunk = [0u8; 8192];
                loop {
                    // Headers, then as many body bytes as Content-Length says.
                    let Ok(n) = stream.read(&mut chunk).await else {
                        return;
                    };
                    if n == 0 {
                        return;
                    }
                    buf.extend_from_slice(&chunk[..n]);
                    let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") else {
                        continue;
                    };
                    let head = String::from_utf8_lossy(&buf[..end]).to_ascii_lowercase();
                    let len: usize = head
                        .lines()
                        .find_map(|l| l.strip_prefix("content-length:"))
                        .map_or(0, |v| v.trim().parse().unwrap());
                    if buf.len() < end + 4 + len {
                        continue;
                    }
                    let body = buf[end + 4..end + 4 + len].to_vec();
                    buf.drain(..end + 4 + len);
                    if head.starts_with("post /v1/traces") {
                        kept.lock()
                            .unwrap()
                            .push(ExportTraceServiceRequest::decode(&body[..]).unwrap());
                    }
                    let ok = "HTTP/1.1 200 OK\r\ncontent-type: application/x-protobuf\r\ncontent-length: 0\r\n\r\n";
                    if stream.write_all(ok.as_bytes()).await.is_err() {
                        return;
                    }
                }
            });
        }
    });
    (addr, received)
}

#[derive(Clone, Default)]
struct Collector(Received);

#[tonic::async_trait]
impl TraceService for Collector {
    async fn export(
        &self,
        request: tonic::Request<ExportTraceServiceRequest>,
    ) -> Result<tonic::Response<ExportTraceServiceResponse>, tonic::Status> {
        self.0.lock().unwrap().push(request.into_inner());
        Ok(tonic::Response::new(ExportTraceServiceResponse::default()))
    }
}

/// An OTLP/gRPC collector.
async fn grpc_collector() -> (std::net::SocketAddr, Received) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let collector = Collector::default();
    let received = collector.0.clone();
    tokio::spawn(async move {
        let _ = tonic::transport::Server::builder()
            .add_service(TraceServiceServer::new(collector))
            .serve_with_incoming(tonic::transport::server::TcpIncoming::from(listener))
            .await;
    });
    (addr, received)
}

/// A span as the collector received it: name, trace id, span id, parent span id, resource.
#[derive(Debug, Clone)]
struct Span {
    name: String,
    trace: Vec<u8>,
    id: Vec<u8>,
    parent: Vec<u8>,
    resource: Vec<(String, String)>,
}

fn spans(received: &Received) -> Vec<Span> {
    let mut out = Vec::new();
    for req in received.lock().unwrap().iter() {
        for rs in &req.resource_spans {
            let resource: Vec<(String, String)> = rs
                .resource
                .iter()
                .flat_map(|r| &r.attributes)
                .filter_map(|kv| match kv.value.as_ref()?.value.as_ref()? {
                    Value::StringValue(s) => Some((kv.key.clone(), s.clone())),
                    _ => None,
                })
                .collect();
            for ss in &rs.scope_spans {
                for s in &ss.spans {
                    out.push(Span {
                        name: s.name.clone(),
                        trace: s.trace_id.clone(),
                        id: s.span_id.clone(),
                        parent: s.parent_span_id.clone(),
                        resource: resource.clone(),
                    });
                }
            }
        }
    }
    out
}

fn hex(s: &str) -> Vec<u8> {
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
        .collect()
}

const LIMITS: &str =
    "domain: t\ndescriptors:\n  - key: k\n    rate_limit: {unit: hour, requests_per_unit: 5}\n";

async fn traced_calls(protocol: &str, collector: std::net::SocketAddr, received: &Received) {
    let redis = RedisProc::start(&[]);
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("t.yaml"), LIMITS).unwrap();
    let mut cmd = ratelimitd(dir.path(), &[]);
    cmd.env("REDIS_SOCKET_TYPE", "tcp")
        .env("REDIS_URL", format!("127.0.0.1:{}", redis.port))
        .env("TRACING_ENABLED", "true")
        .env("TRACING_EXPORTER_PROTOCOL", protocol)
        .env("OTEL_EXPORTER_OTLP_ENDPOINT", format!("http://{collector}"))
        .env("TRACING_SERVICE_NAME", "envoy-ratelimit")
        .env("TRACING_SERVICE_NAMESPACE", "envoy-gateway-system")
        .env("TRACING_SERVICE_INSTANCE_ID", "pod-1")
        .env("TRACING_SAMPLING_RATE", "1.0");
    let d = Daemon::start(cmd).await;
    let mut c = d.client().await;
    let trace_id = "4bf92f3577b34da6a3ce929d0e0e4736";
    let parent_id = "00f067aa0ba902b7";
    let traceparent = format!("00-{trace_id}-{parent_id}-01");
    let r = c
        .should_rate_limit(with_metadata(&[("traceparent", &traceparent)]))
        .await
        .unwrap()
        .into_inner();
    assert!(is_ok(&r));
    // SIGTERM flushes what was not yet exported.
    let (exit, stderr) = d.terminate().await;
    assert!(exit.success(), "{stderr}");
    let all = poll(Duration::from_secs(10), || {
        let all = spans(received);
        let done = all.iter().any(|s| s.name == "ShouldRateLimit");
        async move { done.then_some(all) }
    })
    .await;
    let call = all.iter().find(|s| s.name == "ShouldRateLimit").unwrap();
    assert_eq!(call.trace, hex(trace_id), "continues the caller's trace");
    assert_eq!(call.parent, hex(parent_id), "a child of the caller's span");
    for want in [
        ("service.name", "envoy-ratelimit"),
        ("service.namespace", "envoy-gateway-system"),
        ("service.instance.id", "pod-1"),
    ] {
        assert!(
            call.resource
                .contains(&(want.0.to_owned(), want.1.to_owned())),
            "{want:?} in {:?}",
            call.resource
        );
    }
    let redis_span = all
        .iter()
        .find(|s| s.name == "redis")
        .unwrap_or_else(|| panic!("no redis span in {all:?}"));
    assert_eq!(redis_span.trace, call.trace);
    assert_eq!(
        redis_span.parent, call.id,
        "the Redis wait is the call's child"
    );
}

#[tokio::test]
async fn spans_continue_the_callers_trace_over_otlp_http() {
    let (addr, received) = http_collector().await;
    traced_calls("http", addr, &received).await;
}

#[tokio::test]
async fn spans_continue_the_callers_trace_over_otlp_grpc() {
    let (addr, received) = grpc_collector().await;
    traced_calls("grpc", addr, &received).await;
}

/// A daemon exporting spans over OTLP/HTTP at sampling rate 0 (so only its callers' sampled
/// traces), with what its collector receives and its config directory.
async fn daemon_at_rate_zero() -> (Daemon, Received, tempfile::TempDir) {
    let (addr, received) = http_collector().await;
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("t.yaml"), LIMITS).unwrap();
    let mut cmd = ratelimitd(dir.path(), &[]);
    cmd.env("TRACING_ENABLED", "true")
        .env("OTEL_EXPORTER_OTLP_ENDPOINT", format!("http://{addr}"))
        .env("TRACING_SAMPLING_RATE", "0");
    (Daemon::start(cmd).await, received, dir)
}

/// A call on `t` carrying `metadata` (trace headers).
fn with_metadata(metadata: &[(&str, &str)]) -> tonic::Request<RateLimitRequest> {
    let mut req = tonic::Request::new(request("t", &[&[("k", "v")]]));
    for (k, v) in metadata {
        let key = tonic::metadata::MetadataKey::from_bytes(k.as_bytes()).unwrap();
        req.metadata_mut().insert(key, v.parse().unwrap());
    }
    req
}

/// Parent-based sampling: at a rate of 0 no new trace is sampled, but a caller's sampled trace
/// is followed.
#[tokio::test]
async fn sampling_follows_the_caller_and_the_rate() {
    let (d, received, _dir) = daemon_at_rate_zero().await;
    let mut c = d.client().await;
    for _ in 0..5 {
        call(&mut c, request("t", &[&[("k", "v")]])).await;
    }
    let trace_id = "0af7651916cd43dd8448eb211c80319c";
    let traceparent = format!("00-{trace_id}-b7ad6b7169203331-01");
    c.should_rate_limit(with_metadata(&[("traceparent", &traceparent)]))
        .await
        .unwrap();
    let (exit, stderr) = d.terminate().await;
    assert!(exit.success(), "{stderr}");
    let all = poll(Duration::from_secs(10), || {
        let all = spans(&received);
        let done = !all.is_empty();
        async move { done.then_some(all) }
    })
    .await;
    let calls: Vec<_> = all.iter().filter(|s| s.name == "ShouldRateLimit").collect();
    assert_eq!(calls.len(), 1, "{all:?}");
    assert_eq!(calls[0].trace, hex(trace_id));
}

/// B3 beside W3C, as envoyproxy/ratelimit accepts both: the single `b3` header (a 64-bit trace
/// id widened with zeros) and the `x-b3-*` headers continue the caller's trace, and their
/// sampled flag decides (the rate is 0, so only the caller's sampled traces are exported).
#[tokio::test]
async fn b3_headers_continue_the_callers_trace() {
    let (d, received, _dir) = daemon_at_rate_zero().await;
    let mut c = d.client().await;
    let calls: [&[(&str, &str)]; 4] = [
        &[("b3", "80f198ee56343ba864fe8b2a57d3eff7-e457b5a2e4d86bd1-1")],
        &[
            ("x-b3-traceid", "463ac35c9f6413ad48485a3953bb6124"),
            ("x-b3-spanid", "0020000000000001"),
            ("x-b3-sampled", "1"),
        ],
        &[("b3", "a3ce929d0e0e4736-00f067aa0ba902b7-1")],
        &[("b3", "6b221d5bc9e6496c6b221d5bc9e6496c-b7ad6b7169203331-0")],
    ];
    for headers in calls {
        c.should_rate_limit(with_metadata(headers)).await.unwrap();
    }
    let (exit, stderr) = d.terminate().await;
    assert!(exit.success(), "{stderr}");
    let want = [
        ("80f198ee56343ba864fe8b2a57d3eff7", "e457b5a2e4d86bd1"),
        ("463ac35c9f6413ad48485a3953bb6124", "0020000000000001"),
        ("0000000000000000a3ce929d0e0e4736", "00f067aa0ba902b7"),
    ];
    let all = poll(Duration::from_secs(10), || {
        let all = spans(&received);
        let done = all.iter().filter(|s| s.name == "ShouldRateLimit").count() >= want.len();
        async move { done.then_some(all) }
    })
    .await;
    let mut got: Vec<(Vec<u8>, Vec<u8>)> = all
        .iter()
        .filter(|s| s.name == "ShouldRateLimit")
        .map(|s| (s.trace.clone(), s.parent.clone()))
        .collect();
    got.sort();
    let mut want: Vec<(Vec<u8>, Vec<u8>)> = want.iter().map(|(t, p)| (hex(t), hex(p))).collect();
    want.sort();
    assert_eq!(got, want, "the unsampled fourth is not exported");
}
