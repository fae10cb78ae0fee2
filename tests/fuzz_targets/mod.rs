//! Fuzz targets, shared by the AFL++ harnesses in `fuzz/` (`make fuzz`) and by
//! `tests/fuzz.rs`, which replays every kept input (seeds and past crashes) in `make test`.
//! Each target must never panic, and checks the property its module promises.

use std::path::Path;
use std::sync::{Arc, OnceLock};

use arc_swap::ArcSwap;
use envoy_types::pb::envoy::service::ratelimit::v3::RateLimitRequest;
use prost::Message;
use ratelimitd::config::{Snapshot, compile_file};
use ratelimitd::limiter::redis::{HashTag, RedisBackend, RedisOptions, RedisUrl, Target, TlsFiles};
use ratelimitd::limiter::{Algorithm, CounterKey, Enforcement, Hit, Limit, MemoryBackend};
use ratelimitd::metrics::Metrics;
use ratelimitd::server::grpc::to_request;
use ratelimitd::service::{Policies, RateLimiter};

/// A fuzz target: takes any bytes, panics only on a bug.
pub type FuzzTarget = fn(&[u8]);

/// The fuzz targets by name, as `make fuzz` and the replay test know them.
pub const TARGETS: [(&str, FuzzTarget); 4] = [
    ("config", config),
    ("request", request),
    ("key", key),
    ("redis_args", redis_args),
];

/// Config parsing and validation: any text is loaded or refused with a located error.
pub fn config(data: &[u8]) {
    let text = String::from_utf8_lossy(data);
    match compile_file(Path::new("fuzz.yaml"), &text) {
        Ok(domain) => {
            let snapshot = Snapshot::new(vec![domain]);
            let _ = snapshot.dump();
            let _ = snapshot.rule_count();
        }
        Err(e) => assert!(!e.field.is_empty(), "an error names a field: {e}"),
    }
}

const LIMITS: &str = "domain: fuzz
descriptors:
  - key: a
    rate_limits:
      - {unit: second, requests_per_unit: 3}
      - {unit: minute, requests_per_unit: 5, algorithm: sliding_window, name: w}
  - key: a
    value: x*y
    share_threshold: true
    rate_limit: {unit: hour, requests_per_unit: 2, algorithm: sliding_log}
  - key: b
    shadow_mode: true
    rate_limit: {unit: second, requests_per_unit: 1, algorithm: token_bucket, burst: 2}
  - key: q
    quota_mode: true
    detailed_metric: true
    rate_limit: {unit: day, requests_per_unit: 1, replaces: [{name: w}]}
  - key: n
    value: v
    descriptors:
      - key: m
        rate_limit: {unit: second, requests_per_unit: 0}
      - key: u
        rate_limit: {unlimited: true}
";

fn runtime() -> &'static tokio::runtime::Runtime {
    static RT: OnceLock<tokio::runtime::Runtime> = OnceLock::new();
    RT.get_or_init(|| {
        tokio::runtime::Builder::new_current_thread()
            .build()
            .expect("runtime")
    })
}

fn limiter() -> &'static RateLimiter {
    static L: OnceLock<RateLimiter> = OnceLock::new();
    L.get_or_init(|| {
        let domain = compile_file(Path::new("fuzz.yaml"), LIMITS).expect("fuzz limits");
        RateLimiter::new(
            Arc::new(ArcSwap::from_pointee(Snapshot::new(vec![domain]))),
            Arc::new(MemoryBackend::default()),
            Arc::new(Metrics::new()),
            Policies::default(),
        )
    })
}

/// Request validation, resolution and decision: any protobuf bytes are refused as invalid or
/// decided, with one status per descriptor.
pub fn request(data: &[u8]) {
    let Ok(req) = RateLimitRequest::decode(data) else {
        return;
    };
    let Ok(req) = to_request(&req) else {
        return;
    };
    if let Ok(resp) = runtime().block_on(limiter().should_rate_limit(&req)) {
        assert_eq!(resp.statuses.len(), req.descriptors.len());
    }
}

/// Splits `data` into a domain and entries at 0xFF bytes (entries' key and value at 0xFE).
fn parts(data: &[u8]) -> (String, Vec<(String, String)>) {
    let mut fields = data.split(|&b| b == 0xFF);
    let domain = String::from_utf8_lossy(fields.next().unwrap_or_default()).into_owned();
    let entries = fields
        .map(|f| {
            let mut kv = f.splitn(2, |&b| b == 0xFE);
            let k = String::from_utf8_lossy(kv.next().unwrap_or_default()).into_owned();
            let v = String::from_utf8_lossy(kv.next().unwrap_or_default()).into_owned();
            (k, v)
        })
        .collect();
    (domain, entries)
}

fn key_of(domain: &str, entries: &[(String, String)]) -> CounterKey {
    CounterKey::new(
        domain,
        entries.iter().map(|(k, v)| (k.as_str(), v.as_str())),
    )
}

/// Key building: two inputs (split at 0xFD) give the same key only if they are the same, and
/// no key contains a brace.
pub fn key(data: &[u8]) {
    let mut halves = data.splitn(2, |&b| b == 0xFD);
    let a = parts(halves.next().unwrap_or_default());
    let b = parts(halves.next().unwrap_or_default());
    let (ka, kb) = (key_of(&a.0, &a.1), key_of(&b.0, &b.1));
    assert_eq!(ka.as_bytes() == kb.as_bytes(), a == b, "{a:?} / {b:?}");
    assert!(!ka.as_bytes().iter().any(|c| b"{}".contains(c)));
}

fn backend(hash_tag: HashTag) -> RedisBackend {
    let opts = RedisOptions {
        target: Target::Standalone(RedisUrl::parse("redis://127.0.0.1:1").expect("url")),
        tls: TlsFiles::default(),
        timeout: std::time::Duration::from_millis(100),
        key_prefix: "rl:".into(),
        hash_tag,
        local_cache_bytes: 0,
    };
    // Building the (lazy, never used) connection needs a runtime context.
    let _runtime = runtime().enter();
    RedisBackend::new(opts, Arc::new(Metrics::new())).expect("backend")
}

/// Script arguments: the Redis key of any descriptor has exactly one hash tag, ours, around
/// the escaped domain (or descriptor); and any URL parses or is refused without showing its
/// password.
pub fn redis_args(data: &[u8]) {
    static DOMAIN: OnceLock<RedisBackend> = OnceLock::new();
    static DESCRIPTOR: OnceLock<RedisBackend> = OnceLock::new();
    let (domain, entries) = parts(data);
    let key = key_of(&domain, &entries);
    let hit = Hit {
        key: key.clone().with_limit(
            &Limit {
                algorithm: Algorithm::SlidingLog,
                requests_per_unit: 1,
                window_us: 1_000_000,
                burst: 1,
            },
            0,
        ),
        limit: Limit {
            algorithm: Algorithm::SlidingLog,
            requests_per_unit: 1,
            window_us: 1_000_000,
            burst: 1,
        },
        hits: 1,
        enforcement: Enforcement::Enforce,
    };
    for (b, tag) in [
        (
            DOMAIN.get_or_init(|| backend(HashTag::Domain)),
            key.domain_part(),
        ),
        (
            DESCRIPTOR.get_or_init(|| backend(HashTag::Descriptor)),
            key.descriptor_part(),
        ),
    ] {
        let redis_key = b.redis_key(&hit);
        let open = redis_key.iter().filter(|&&c| c == b'{').count();
        let close = redis_key.iter().filter(|&&c| c == b'}').count();
        assert_eq!(
            (open, close),
            (1, 1),
            "{:?}",
            String::from_utf8_lossy(&redis_key)
        );
        let expected = [b"rl:{".as_slice(), tag, b"}"].concat();
        assert!(redis_key.starts_with(&expected));
    }

    // What is shown of a URL never depends on its password: the same URL with another
    // password renders the same (accepted or refused).
    let render = |text: &str| match RedisUrl::parse(text) {
        Ok(url) => format!("{url} {url:?}"),
        Err(e) => e.to_string(),
    };
    let text = String::from_utf8_lossy(data);
    if let Some((scheme, after)) = text.split_once("://")
        && let Some(at) = after.rfind('@')
        && let Some((user, _password)) = after[..at].split_once(':')
    {
        let other = format!("{scheme}://{user}:Z@{}", &after[at + 1..]);
        assert_eq!(render(&text), render(&other), "the password shows");
    } else {
        let _ = render(&text);
    }
}
