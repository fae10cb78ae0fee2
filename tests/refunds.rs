//! Refunds that cross a window, per algorithm, on the memory backend (its clock stepped) and
//! on Redis (Redis' own clock stepped): what docs/configuration.md, "Refunds across a window",
//! says each algorithm can and cannot do. A refund does not say when its hits were taken;
//! where the state can tell hits apart by age (a sliding log's entries, a sliding window's two
//! counts) the oldest are given back first, so a refund never frees more than giving back its
//! own hits would. A fixed window and a token bucket cannot tell, and say so.
//!
//! Windows are 1000 s and steps ten seconds at least, so the moments Redis' running clock
//! moves between a step and an answer change nothing.

mod common;

use common::redis::*;
use common::*;
use envoy_types::pb::envoy::service::ratelimit::v3::RateLimitRequest;

const SEC: u64 = 1_000_000;
/// 2026-01-01T00:06:40Z: a multiple of every window here.
const T0: u64 = 1_767_226_000 * SEC;

const CONFIG: &str = "domain: r
descriptors:
  - key: log
    rate_limit: {unit: second, unit_multiplier: 1000, requests_per_unit: 10, algorithm: sliding_log}
  - key: sliding
    rate_limit: {unit: second, unit_multiplier: 1000, requests_per_unit: 10, algorithm: sliding_window}
  - key: fixed
    rate_limit: {unit: second, unit_multiplier: 1000, requests_per_unit: 10}
  - key: bucket
    rate_limit: {unit: second, unit_multiplier: 1000, requests_per_unit: 10, algorithm: token_bucket}
";

/// The tenant's admission of `hits`.
fn take(key: &str, hits: u32) -> RateLimitRequest {
    weighted(request("r", &[&[(key, "tenant")]]), hits)
}

/// The tenant's refund of `hits` (Envoy's `is_negative_hits`, with the descriptor's own
/// `hits_addend`).
fn refund(key: &str, hits: u64) -> RateLimitRequest {
    let mut req = with_hits(request("r", &[&[(key, "tenant")]]), 0, hits);
    req.descriptors[0].is_negative_hits = true;
    req
}

/// Single hits admitted at `at`, tried up to `most` times.
async fn admitted_at(c: &mut Client, clock: &Stepped, key: &str, at: u64, most: usize) -> usize {
    clock.set(at);
    let mut n = 0;
    for _ in 0..most {
        if is_ok(&call(c, take(key, 1)).await) {
            n += 1;
        }
    }
    n
}

#[tokio::test]
async fn refunds_across_a_window_do_what_each_algorithm_can_know() {
    let (servers, _redis) = stepped_servers(&[("r.yaml", CONFIG)], T0, T0).await;
    for (name, server, clock) in &servers {
        let mut c = server.client().await;
        // Each algorithm's steps start 10,000 s after the last's: the memory backend's clock
        // never runs backwards.
        let from = |base: u64| move |s: u64| T0 + (base + s) * SEC;
        let ok = |r: &_| is_ok(r);

        let at = from(0);
        // sliding_log, 10 per 1000 s. A reserves 5 at 0; others take 5 at 900; A settles
        // (gives its 5 back) at 950. The oldest weight goes (A's): 5 more fit at 960, and none
        // from 1000 to 1890, while the others' entries are in the window. Giving back the
        // newest (the others') let 5 in at 960 and 5 more at 1000, when A's entry left: 15
        // within 100 s.
        clock.set(at(0));
        assert!(ok(&call(&mut c, take("log", 5)).await), "{name}");
        clock.set(at(900));
        assert!(ok(&call(&mut c, take("log", 5)).await), "{name}");
        clock.set(at(950));
        call(&mut c, refund("log", 5)).await;
        assert_eq!(
            admitted_at(&mut c, clock, "log", at(960), 8).await,
            5,
            "{name}: log at 960"
        );
        for s in [1000, 1500, 1890] {
            assert_eq!(
                admitted_at(&mut c, clock, "log", at(s), 3).await,
                0,
                "{name}: log at {s}"
            );
        }

        let at = from(10000);
        // sliding_window, 10 per 1000 s. A takes 10 late in the window [0, 1000); at 1500 the
        // previous window weighs half: 5 fit and others take them. A gives its 10 back: from
        // the previous window first, as had A never taken them, so 5 more fit. (Given back
        // from the current window first, the others' 5 went and 7 more fit at 1510.)
        clock.set(at(990));
        assert!(ok(&call(&mut c, take("sliding", 10)).await), "{name}");
        assert_eq!(
            admitted_at(&mut c, clock, "sliding", at(1500), 8).await,
            5,
            "{name}"
        );
        call(&mut c, refund("sliding", 10)).await;
        assert_eq!(
            admitted_at(&mut c, clock, "sliding", at(1510), 8).await,
            5,
            "{name}: sliding after the refund: the others' 5 stand"
        );

        let at = from(20000);
        // fixed_window, 10 per 1000 s: it cannot tell which window a refund's hits were taken
        // in. A takes 10 at 990; the window turns; others take 10 at 1010; A's refund at 1020
        // is given back from the current window, which then admits 10 more: 20 within 10 s.
        clock.set(at(990));
        assert!(ok(&call(&mut c, take("fixed", 10)).await), "{name}");
        assert_eq!(
            admitted_at(&mut c, clock, "fixed", at(1010), 11).await,
            10,
            "{name}"
        );
        clock.set(at(1020));
        call(&mut c, refund("fixed", 10)).await;
        assert_eq!(
            admitted_at(&mut c, clock, "fixed", at(1020), 11).await,
            10,
            "{name}"
        );

        let at = from(30000);
        // token_bucket, 10 per 1000 s: it cannot tell refilled tokens from those still out. A
        // takes 10 at 0; by 1000 the bucket is full again and others take 10 at 1010; A's
        // refund at 1020 moves the bucket back to full: 10 more at once.
        clock.set(at(0));
        assert!(ok(&call(&mut c, take("bucket", 10)).await), "{name}");
        assert_eq!(
            admitted_at(&mut c, clock, "bucket", at(1010), 11).await,
            10,
            "{name}"
        );
        clock.set(at(1020));
        call(&mut c, refund("bucket", 10)).await;
        assert_eq!(
            admitted_at(&mut c, clock, "bucket", at(1020), 11).await,
            10,
            "{name}"
        );
    }
}

/// A sliding log's refund gives back at most 1,000 entries (docs/configuration.md, "Budgets
/// known after the response"), on both backends alike, so one call's work stays bounded
/// however long the log: after 3,000 one-hit requests, a refund of 2,500 gives back 1,000.
#[tokio::test]
async fn a_log_refund_gives_back_at_most_1000_entries() {
    let config = "domain: r
descriptors:
  - key: many
    rate_limit: {unit: second, unit_multiplier: 1000, requests_per_unit: 3000, algorithm: sliding_log}
";
    let (servers, _redis) = stepped_servers(&[("r.yaml", config)], T0, T0).await;
    for (name, server, clock) in &servers {
        let mut c = server.client().await;
        for i in 0..3_000 {
            // Each request its own entry: the memory backend merges those of one instant.
            if let common::redis::Stepped::Memory(m) = clock {
                m.set(T0 + i * 1_000);
            }
            assert!(is_ok(&call(&mut c, take("many", 1)).await), "{name}: {i}");
        }
        assert!(is_over(&call(&mut c, take("many", 1)).await), "{name}");
        call(&mut c, refund("many", 2_500)).await;
        let mut admitted = 0;
        while is_ok(&call(&mut c, take("many", 1)).await) {
            admitted += 1;
            assert!(admitted <= 2_500, "{name}");
        }
        assert_eq!(
            admitted, 1_000,
            "{name}: a refund of 2,500 gave back {admitted}"
        );
    }
}
