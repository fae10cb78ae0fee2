//! Fuzz targets, shared by the AFL++ harnesses in `fuzz/` (`make fuzz`) and by
//! `tests/fuzz.rs`, which replays every kept input (seeds and past crashes) in `make test`.
//! Each target must never panic, and checks the property its module promises.

use std::path::Path;
use std::sync::{Arc, OnceLock};

use arc_swap::ArcSwap;
use prost::Message;
use ratelimitd::testing::Metrics;
use ratelimitd::testing::RedisUrl;
use ratelimitd::testing::WireRequest;
use ratelimitd::testing::to_request;
use ratelimitd::testing::{Algorithm, CounterKey, HashTag, KeyFormat, Limit, MemoryBackend};
use ratelimitd::testing::{Engine, EngineOptions};
use ratelimitd::testing::{Snapshot, compile_file};

/// A fuzz target: takes any bytes, panics only on a bug.
pub(crate) type FuzzTarget = fn(&[u8]);

/// The fuzz targets by name, as `make fuzz` and the replay test know them.
pub(crate) const TARGETS: [(&str, FuzzTarget); 4] = [
    ("config", config),
    ("request", request),
    ("key", key),
    ("redis_args", redis_args),
];

/// Config parsing and validation: any text is loaded or refused with a located error.
pub(crate) fn config(data: &[u8]) {
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

fn engine() -> &'static Engine {
    static L: OnceLock<Engine> = OnceLock::new();
    L.get_or_init(|| {
        let domain = compile_file(Path::new("fuzz.yaml"), LIMITS).expect("fuzz limits");
        Engine::new(
            Arc::new(ArcSwap::from_pointee(Snapshot::new(vec![domain]))),
            Arc::new(MemoryBackend::default()),
            KeyFormat::default(),
            Metrics::new().decisions.clone(),
            EngineOptions::default(),
        )
    })
}

/// Request validation, resolution and decision: any protobuf bytes are refused as invalid or
/// decided, with one status per descriptor.
pub(crate) fn request(data: &[u8]) {
    let Ok(req) = WireRequest::decode(data) else {
        return;
    };
    let Ok(req) = to_request(&req) else {
        return;
    };
    if let Ok(resp) = runtime().block_on(engine().should_rate_limit(&req)) {
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
/// a key's only braces are its hash tag's.
pub(crate) fn key(data: &[u8]) {
    let mut halves = data.splitn(2, |&b| b == 0xFD);
    let a = parts(halves.next().unwrap_or_default());
    let b = parts(halves.next().unwrap_or_default());
    let (ka, kb) = (key_of(&a.0, &a.1), key_of(&b.0, &b.1));
    assert_eq!(ka.as_bytes() == kb.as_bytes(), a == b, "{a:?} / {b:?}");
    let braces = ka.as_bytes().iter().filter(|c| b"{}".contains(c)).count();
    assert_eq!(braces, 2, "{:?}", String::from_utf8_lossy(ka.as_bytes()));
}

/// Script arguments: the Redis key of any descriptor has exactly one hash tag, ours: around
/// the escaped domain alone (so the entries never move a request to another slot), or around
/// the escaped descriptor; and any URL parses or is refused without showing its password.
pub(crate) fn redis_args(data: &[u8]) {
    let (domain, entries) = parts(data);
    let limit = Limit {
        algorithm: Algorithm::SlidingLog,
        requests_per_unit: 1,
        window_us: 1_000_000,
        burst: 1,
        calendar: None,
    };
    let entries = || entries.iter().map(|(k, v)| (k.as_str(), v.as_str()));
    for tag in [HashTag::Domain, HashTag::Descriptor] {
        let format = KeyFormat::new("rl:", tag).expect("a prefix without braces");
        let descriptor = format.descriptor_key(&domain, entries());
        let key = descriptor.clone().with_limit(&limit, 0);
        let redis_key = key.as_bytes();
        let open = redis_key.iter().filter(|&&c| c == b'{').count();
        let close = redis_key.iter().filter(|&&c| c == b'}').count();
        assert_eq!(
            (open, close),
            (1, 1),
            "{:?}",
            String::from_utf8_lossy(redis_key)
        );
        let expected = [b"rl:{".as_slice(), key.tag(), b"}"].concat();
        assert!(redis_key.starts_with(&expected));
        let alone = format.descriptor_key(&domain, [] as [(&str, &str); 0]);
        match tag {
            HashTag::Domain => assert_eq!(key.tag(), alone.tag()),
            HashTag::Descriptor => assert_eq!(
                key.tag(),
                &descriptor.as_bytes()[4..descriptor.as_bytes().len() - 1]
            ),
        }
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
