//! Baselines for `make bench`: the cheapest servers that answer the same protocol, so
//! ratelimitd's cost is read as a ratio against them, measured in the same run.
//!
//! - `--mode noop`: a bare tonic RateLimitService that does no work (OK for every descriptor):
//!   the floor set by gRPC itself.
//! - `--mode evalsha --redis redis://127.0.0.1:PORT`: the naive Redis design, one EVALSHA per
//!   request doing INCRBY + EXPIRE on each descriptor's key (fixed window, no all-or-nothing):
//!   what a straightforward service spends per request, in itself and in Redis.
//! - `--write-request FILE`: writes one gRPC-framed request of the bench domain (the body that
//!   h2load sends) and exits.
//!
//! `cargo bench --bench baseline -- --mode noop --addr 127.0.0.1:9000`. Loopback only.

use std::net::SocketAddr;

use envoy_types::pb::envoy::extensions::common::ratelimit::v3::RateLimitDescriptor;
use envoy_types::pb::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::Entry;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::{Code, DescriptorStatus};
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_server::{
    RateLimitService, RateLimitServiceServer,
};
use envoy_types::pb::envoy::service::ratelimit::v3::{RateLimitRequest, RateLimitResponse};
use prost::Message;
use tonic::{Request, Response, Status};

// The allocator ratelimitd uses, so the ratios measure the work and not the allocator.
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// INCRBY + EXPIRE per key, the textbook fixed window; returns each key's count.
const NAIVE_SCRIPT: &str = r"
local out = {}
for i, key in ipairs(KEYS) do
  local n = redis.call('INCRBY', key, ARGV[1])
  if n == tonumber(ARGV[1]) then redis.call('EXPIRE', key, ARGV[2]) end
  out[i] = n
end
return out
";

/// Requests allowed per key and window by the naive server (high: the bench measures cost).
const NAIVE_LIMIT: i64 = 1_000_000_000;

struct Noop;

fn statuses(n: usize, over: impl Fn(usize) -> bool) -> RateLimitResponse {
    let statuses: Vec<DescriptorStatus> = (0..n)
        .map(|i| DescriptorStatus {
            code: if over(i) { Code::OverLimit } else { Code::Ok } as i32,
            ..Default::default()
        })
        .collect();
    let overall = if statuses.iter().any(|s| s.code == Code::OverLimit as i32) {
        Code::OverLimit
    } else {
        Code::Ok
    };
    RateLimitResponse {
        overall_code: overall as i32,
        statuses,
        ..Default::default()
    }
}

#[tonic::async_trait]
impl RateLimitService for Noop {
    async fn should_rate_limit(
        &self,
        request: Request<RateLimitRequest>,
    ) -> Result<Response<RateLimitResponse>, Status> {
        let n = request.get_ref().descriptors.len();
        Ok(Response::new(statuses(n, |_| false)))
    }
}

struct Naive {
    conn: redis::aio::ConnectionManager,
    script: redis::Script,
}

#[tonic::async_trait]
impl RateLimitService for Naive {
    async fn should_rate_limit(
        &self,
        request: Request<RateLimitRequest>,
    ) -> Result<Response<RateLimitResponse>, Status> {
        let req = request.into_inner();
        let mut inv = self.script.prepare_invoke();
        for d in &req.descriptors {
            let mut key = format!("naive:{{{}}}", req.domain);
            for e in &d.entries {
                key.push(':');
                key.push_str(&e.key);
                key.push(':');
                key.push_str(&e.value);
            }
            inv.key(key);
        }
        inv.arg(req.hits_addend.max(1)).arg(1);
        let mut conn = self.conn.clone();
        let counts: Vec<i64> = inv
            .invoke_async(&mut conn)
            .await
            .map_err(|e| Status::unavailable(e.to_string()))?;
        Ok(Response::new(statuses(req.descriptors.len(), |i| {
            counts.get(i).copied().unwrap_or(0) > NAIVE_LIMIT
        })))
    }
}

/// The bench domain's request: one client and one route descriptor (as benches/limits.yaml).
fn bench_request() -> RateLimitRequest {
    let descriptor = |key: &str, value: &str| RateLimitDescriptor {
        entries: vec![Entry {
            key: key.into(),
            value: value.into(),
        }],
        ..Default::default()
    };
    RateLimitRequest {
        domain: "bench".into(),
        descriptors: vec![descriptor("client", "c1"), descriptor("route", "/api/1")],
        hits_addend: 1,
    }
}

/// The baselines `make bench` measures ratelimitd against.
#[derive(clap::Parser)]
#[command(name = "baseline")]
struct Flags {
    /// The server to run: noop (no work) or evalsha (one EVALSHA per request).
    #[arg(long, value_enum)]
    mode: Option<Mode>,
    /// Where to listen (loopback only).
    #[arg(long, default_value = "127.0.0.1:9000")]
    addr: SocketAddr,
    /// The Redis of `--mode evalsha`, e.g. redis://127.0.0.1:6379.
    #[arg(long, required_if_eq("mode", "evalsha"))]
    redis: Option<String>,
    /// Write one gRPC-framed request of the bench domain (what h2load sends) here, and exit.
    #[arg(long, conflicts_with = "mode")]
    write_request: Option<std::path::PathBuf>,
    /// Passed by `cargo bench`; ignored.
    #[arg(long, hide = true)]
    bench: bool,
}

#[derive(Clone, Copy, clap::ValueEnum)]
enum Mode {
    Noop,
    Evalsha,
}

#[tokio::main]
async fn main() {
    use clap::Parser;
    let flags = Flags::parse();
    if let Some(path) = flags.write_request {
        let body = bench_request().encode_to_vec();
        let mut framed = vec![0u8];
        framed.extend_from_slice(&(body.len() as u32).to_be_bytes());
        framed.extend_from_slice(&body);
        std::fs::write(path, framed).expect("write the request");
        return;
    }
    let Some(mode) = flags.mode else {
        eprintln!(
            "baseline: nothing to do without --mode or --write-request (see --help; `make bench` runs it)"
        );
        return;
    };
    // A subscriber that is never enabled: with none set at all, `tracing` hands every span of
    // h2, hyper and redis-rs to the `log` crate (its `log` feature is on in this build), a cost
    // of 0.6 µs per request the service, which sets a subscriber, does not pay.
    tracing::subscriber::set_global_default(tracing::subscriber::NoSubscriber::default())
        .expect("the only subscriber");
    let addr = flags.addr;
    assert!(addr.ip().is_loopback(), "baselines listen on loopback only");
    let mut server = tonic::transport::Server::builder();
    let result = match mode {
        Mode::Noop => {
            server
                .add_service(RateLimitServiceServer::new(Noop))
                .serve(addr)
                .await
        }
        Mode::Evalsha => {
            let url = flags.redis.expect("--mode evalsha needs --redis");
            let client = redis::Client::open(url).expect("--redis");
            let conn = redis::aio::ConnectionManager::new(client)
                .await
                .expect("connect to redis");
            let naive = Naive {
                conn,
                script: redis::Script::new(NAIVE_SCRIPT),
            };
            server
                .add_service(RateLimitServiceServer::new(naive))
                .serve(addr)
                .await
        }
    };
    result.expect("serve");
}
