//! Differential test: random request sequences (several limits per descriptor, every
//! algorithm, shadow and quota rules, checks, admissions, cost reports within and past the
//! limit, refunds, request overrides, calendar windows) sent to the memory backend and to Redis
//! and a Redis Cluster (one script per request, and one per slot group with undos) must get
//! the same decisions and the same remaining counts. Windows are 1000 days (overrides: a year;
//! calendar limits: the year in two zones), so no window boundary falls inside the test but
//! once a year. A failure prints its seed: `DIFF_SEED=<seed>` replays it (add `DIFF_TRACE=1`
//! to print every step); `DIFF_ROUNDS=<n>` runs more sequences.

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::redis::*;
use common::*;
use envoy_types::pb::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::RateLimitOverride;
use envoy_types::pb::envoy::service::ratelimit::v3::{RateLimitRequest, RateLimitResponse};
use envoy_types::pb::google::protobuf::UInt64Value;
use ratelimitd::testing::SystemClock;

const W: &str = "unit: day, unit_multiplier: 1000";

fn config() -> String {
    format!(
        "domain: diff
descriptors:
  - key: f
    rate_limits:
      - {{{W}, requests_per_unit: 5}}
      - {{{W}, requests_per_unit: 8, name: wide}}
  - key: s
    rate_limit: {{{W}, requests_per_unit: 6, algorithm: sliding_window}}
  - key: l
    rate_limits:
      - {{{W}, requests_per_unit: 6, algorithm: sliding_log}}
      - {{{W}, requests_per_unit: 9, algorithm: fixed_window}}
  - key: b
    rate_limit: {{{W}, requests_per_unit: 4, algorithm: token_bucket, burst: 6}}
  - key: sh
    shadow_mode: true
    rate_limit: {{{W}, requests_per_unit: 3, algorithm: sliding_log}}
  - key: q1
    quota_mode: true
    rate_limit: {{{W}, requests_per_unit: 3}}
  - key: q2
    quota_mode: true
    rate_limit: {{{W}, requests_per_unit: 2, algorithm: token_bucket}}
  - key: t
    value: x
    descriptors:
      - key: u
        rate_limits:
          - {{{W}, requests_per_unit: 4, algorithm: sliding_window}}
          - {{{W}, requests_per_unit: 3, algorithm: token_bucket, burst: 5}}
  - key: z
    rate_limit: {{{W}, requests_per_unit: 0}}
  - key: cal
    rate_limits:
      - {{unit: year, requests_per_unit: 7, calendar: Pacific/Chatham}}
      - {{unit: month, unit_multiplier: 12, requests_per_unit: 5, calendar: Asia/Kathmandu}}
"
    )
}

fn random_request(rng: &mut Rng) -> RateLimitRequest {
    let keys = [
        "f", "s", "l", "b", "sh", "q1", "q2", "z", "cal", "nested", "unknown",
    ];
    let values = ["a", "b"];
    let n = 1 + rng.below(3) as usize;
    let mut descriptors: Vec<Vec<(String, String)>> = Vec::new();
    for _ in 0..n {
        let key = keys[rng.below(keys.len() as u64) as usize];
        let value = values[rng.below(2) as usize].to_string();
        descriptors.push(match key {
            "nested" => vec![("t".into(), "x".into()), ("u".into(), value)],
            k => vec![(k.into(), value)],
        });
    }
    let refs: Vec<Vec<(&str, &str)>> = descriptors
        .iter()
        .map(|d| d.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect())
        .collect();
    let refs: Vec<&[(&str, &str)]> = refs.iter().map(|d| &d[..]).collect();
    let mut req = request("diff", &refs);
    req.hits_addend = rng.below(3) as u32;
    for d in &mut req.descriptors {
        match rng.below(10) {
            0 => d.hits_addend = Some(UInt64Value { value: 0 }),
            // A cost report (the default accounting), within the limit or past it.
            1 => {
                d.hits_addend = Some(UInt64Value {
                    value: 1 + rng.below(3),
                })
            }
            2 => {
                d.hits_addend = Some(UInt64Value {
                    value: 4 + rng.below(20),
                })
            }
            3 => {
                d.limit = Some(RateLimitOverride {
                    requests_per_unit: rng.below(6) as u32,
                    unit: 6, // YEAR
                })
            }
            // A refund, of the request's hits or of its own.
            4 => {
                d.is_negative_hits = true;
                if rng.below(2) == 0 {
                    d.hits_addend = Some(UInt64Value {
                        value: 1 + rng.below(8),
                    });
                }
            }
            _ => {}
        }
    }
    req
}

/// What must agree: overall code, and per status its code, limit and remaining hits; the
/// reset may differ by the servers' clocks (a few ms), so within a second.
fn same(a: &RateLimitResponse, b: &RateLimitResponse) -> Result<(), String> {
    if a.overall_code != b.overall_code || a.statuses.len() != b.statuses.len() {
        return Err("overall code".into());
    }
    for (i, (x, y)) in a.statuses.iter().zip(&b.statuses).enumerate() {
        if x.code != y.code || x.current_limit != y.current_limit {
            return Err(format!("status {i}: code or limit"));
        }
        if x.limit_remaining != y.limit_remaining {
            return Err(format!("status {i}: remaining"));
        }
        let secs = |s: &envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::DescriptorStatus| {
            s.duration_until_reset.as_ref().map(|d| d.seconds)
        };
        match (secs(x), secs(y)) {
            (Some(p), Some(q)) if (p - q).abs() <= 1 => {}
            (None, None) => {}
            _ => return Err(format!("status {i}: reset")),
        }
    }
    Ok(())
}

async fn servers(seed: u64) -> Vec<(String, TestServer)> {
    let yaml = config();
    let files = [("diff.yaml", yaml.as_str())];
    let redis = shared_standalone().url();
    let mut out = vec![(
        "memory".to_string(),
        TestServer::start_with(&files, &[], Arc::new(SystemClock)).await,
    )];
    let cluster = shared_cluster().urls();
    for tag in ["domain", "descriptor"] {
        let prefix = format!("{}{seed}:", unique_prefix());
        let target = ["--redis-url", redis.as_str(), "--redis-hash-tag", tag];
        out.push((
            format!("redis, {tag} tags"),
            redis_server(&files, &target, &prefix, "2s").await,
        ));
        let prefix = format!("{}{seed}:", unique_prefix());
        let target = [
            "--redis-cluster-nodes",
            cluster.as_str(),
            "--redis-hash-tag",
            tag,
        ];
        out.push((
            format!("cluster, {tag} tags"),
            redis_server(&files, &target, &prefix, "2s").await,
        ));
    }
    out
}

#[tokio::test]
async fn memory_and_redis_decide_every_random_sequence_alike() {
    // DIFF_SEED=<seed> replays one failing sequence.
    let fixed: Option<u64> = std::env::var("DIFF_SEED").ok().map(|s| s.parse().unwrap());
    let base = {
        use ratelimitd::testing::{Clock, SystemClock};
        SystemClock.now_us() | 1
    };
    let rounds: u64 = match (fixed, std::env::var("DIFF_ROUNDS")) {
        (Some(_), _) => 1,
        (None, Ok(n)) => n.parse().unwrap(),
        (None, Err(_)) => 4,
    };
    for round in 0..rounds {
        let seed =
            fixed.unwrap_or(base.wrapping_add(round.wrapping_mul(0x9E37_79B9_7F4A_7C15)) | 1);
        let servers = servers(seed).await;
        let mut clients = Vec::new();
        for (_, s) in &servers {
            clients.push(s.client().await);
        }
        let mut rng = Rng(seed);
        for step in 0..150 {
            let req = random_request(&mut rng);
            let mut answers = Vec::new();
            for c in &mut clients {
                answers.push(
                    tokio::time::timeout(Duration::from_secs(10), call(c, req.clone()))
                        .await
                        .expect("answered"),
                );
            }
            if std::env::var_os("DIFF_TRACE").is_some() {
                eprintln!("step {step}: {req:?}");
                for ((name, _), a) in servers.iter().zip(&answers) {
                    eprintln!("  {name}: {a:?}");
                }
            }
            for (k, answer) in answers.iter().enumerate().skip(1) {
                if let Err(what) = same(&answers[0], answer) {
                    panic!(
                        "seed {seed} step {step}: {} and {} differ in {what}\nrequest: {req:?}\n{}: {:?}\n{}: {:?}",
                        servers[0].0, servers[k].0, servers[0].0, answers[0], servers[k].0, answer
                    );
                }
            }
        }
    }
}
