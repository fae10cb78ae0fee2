//! Holds (docs/configuration.md, "Holds"): an admission that names a hold takes it (a place on
//! a concurrency limit; on a rate limit, its hits with the window they were charged to), and a
//! refund naming it gives back at most that, once. On memory, Redis, a three-master cluster
//! and the cluster tagged per descriptor; the timelines on a stepped clock (memory and Redis).

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::Duration;

use tokio::time::Instant;

use common::redis::*;
use common::*;
use envoy_types::pb::envoy::service::ratelimit::v3::RateLimitRequest;

const CONFIG: &str = "domain: llm
descriptors:
  # Three requests in flight per tenant; a place is kept 10 minutes at most.
  - key: tenant
    hold_key: request_id
    rate_limits:
      - {algorithm: concurrency, requests_per_unit: 3, unit: minute, unit_multiplier: 10}
  # A route's own limit, to refuse a request that also asks for a place.
  - key: route
    rate_limit: {unit: hour, requests_per_unit: 1}
";

/// The shipped budget's shape: a calendar month of tokens, reserved per request.
const BUDGETS: &str = "domain: budgets
descriptors:
  - key: tenant
    hold_key: request_id
    rate_limit: {unit: month, requests_per_unit: 1000000, calendar: Europe/Berlin}
";

/// The request `id` of `tenant` asking for a place.
fn acquire(tenant: &str, id: &str) -> RateLimitRequest {
    request("llm", &[&[("tenant", tenant), ("request_id", id)]])
}

/// The stream of request `id` done: its place given back (Envoy's `is_negative_hits`, 1).
fn release(tenant: &str, id: &str) -> RateLimitRequest {
    let mut req = with_hits(acquire(tenant, id), 0, 1);
    req.descriptors[0].is_negative_hits = true;
    req
}

/// How many of `ids`' acquisitions are admitted, in order.
async fn admitted(c: &mut Client, tenant: &str, ids: &[&str]) -> Vec<bool> {
    let mut out = Vec::new();
    for id in ids {
        out.push(is_ok(&call(c, acquire(tenant, id)).await));
    }
    out
}

async fn three_places_four_holds_and_a_release_frees_one(kind: Kind) {
    let s = start(kind, &[("llm.yaml", CONFIG)], &[]).await;
    let mut c = s.client().await;
    assert_eq!(
        admitted(&mut c, "acme", &["a", "b", "c", "d"]).await,
        [true, true, true, false],
        "{kind:?}"
    );
    let full = call(&mut c, acquire("acme", "e")).await;
    assert_eq!(full.statuses[0].limit_remaining, 0, "{kind:?}");
    // Another tenant's places are its own.
    assert_eq!(admitted(&mut c, "other", &["a"]).await, [true], "{kind:?}");
    call(&mut c, release("acme", "b")).await;
    assert_eq!(
        admitted(&mut c, "acme", &["d", "e"]).await,
        [true, false],
        "{kind:?}: one release, one place"
    );
}

async fn releases_free_only_the_place_a_hold_took(kind: Kind) {
    let s = start(kind, &[("llm.yaml", CONFIG)], &[]).await;
    let mut c = s.client().await;
    assert_eq!(
        admitted(&mut c, "acme", &["a", "b", "c", "refused"]).await,
        [true, true, true, false]
    );
    // The refused request's hold, a hold never taken, and a release that names no hold.
    call(&mut c, release("acme", "refused")).await;
    call(&mut c, release("acme", "never-taken")).await;
    let mut unnamed = request("llm", &[&[("tenant", "acme")]]);
    unnamed.descriptors[0].is_negative_hits = true;
    unnamed.hits_addend = 1;
    call(&mut c, unnamed).await;
    assert_eq!(
        admitted(&mut c, "acme", &["x"]).await,
        [false],
        "{kind:?}: nothing freed"
    );
    // A replayed id while its place is held is refused: it never holds two.
    assert_eq!(admitted(&mut c, "acme", &["a"]).await, [false], "{kind:?}");
    // The same hold released three times frees its one place.
    for _ in 0..3 {
        call(&mut c, release("acme", "a")).await;
    }
    assert_eq!(
        admitted(&mut c, "acme", &["y", "z"]).await,
        [true, false],
        "{kind:?}: one place, once"
    );
}

async fn a_request_refused_by_another_limit_takes_no_place(kind: Kind) {
    let s = start(kind, &[("llm.yaml", CONFIG)], &[]).await;
    let mut c = s.client().await;
    let both = |id: &str| {
        request(
            "llm",
            &[&[("tenant", "acme"), ("request_id", id)], &[("route", "r")]],
        )
    };
    assert!(is_ok(&call(&mut c, both("first")).await), "{kind:?}");
    for i in 0..5 {
        let r = call(&mut c, both(&format!("refused-{i}"))).await;
        assert!(is_over(&r), "{kind:?}: the route's limit refuses");
    }
    // The first holds one place; the refused took none: two are free.
    assert_eq!(
        admitted(&mut c, "acme", &["p", "q", "full"]).await,
        [true, true, false],
        "{kind:?}"
    );
}

/// A tenant's budget: `hits` reserved by request `id` (the request's estimate, an admission).
fn reserve(id: &str, hits: u32) -> RateLimitRequest {
    weighted(
        request("budgets", &[&[("tenant", "acme"), ("request_id", id)]]),
        hits,
    )
}

/// The stream of request `id` done: `back` given back (a client header says how much) and,
/// in the same call, `used` charged.
fn settle(id: &str, back: u64, used: Option<u64>) -> RateLimitRequest {
    let d = [("tenant", "acme"), ("request_id", id)];
    let mut req = with_hits(request("budgets", &[&d, &d]), 0, back);
    req.descriptors[0].is_negative_hits = true;
    match used {
        Some(used) => with_hits(req, 1, used),
        None => {
            req.descriptors.pop();
            req
        }
    }
}

/// What is left of the tenant's budget (a check of 0 hits).
async fn left(c: &mut Client) -> u32 {
    let check = with_hits(request("budgets", &[&[("tenant", "acme")]]), 0, 0);
    call(c, check).await.statuses[0].limit_remaining
}

async fn a_forged_refund_gives_nothing_back(kind: Kind) {
    let s = start(kind, &[("budgets.yaml", BUDGETS)], &[]).await;
    let mut c = s.client().await;
    // Spent to nothing (a report of what was used).
    call(
        &mut c,
        with_hits(request("budgets", &[&[("tenant", "acme")]]), 0, 1_000_000),
    )
    .await;
    assert_eq!(left(&mut c).await, 0, "{kind:?}");
    // A reservation far past the budget is refused; its stream-done refund names a hold
    // that holds nothing.
    assert!(is_over(&call(&mut c, reserve("forged", 999_999_999)).await));
    call(&mut c, settle("forged", 999_999_999, None)).await;
    assert_eq!(left(&mut c).await, 0, "{kind:?}: nothing given back");
    for i in 0..10 {
        let r = call(&mut c, reserve(&format!("next-{i}"), 100_000)).await;
        assert!(is_over(&r), "{kind:?}: reservation {i} admitted");
    }
}

async fn a_settlement_gives_back_what_its_hold_took_once(kind: Kind) {
    let s = start(kind, &[("budgets.yaml", BUDGETS)], &[]).await;
    let mut c = s.client().await;
    assert!(
        is_ok(&call(&mut c, reserve("r1", 100_000)).await),
        "{kind:?}"
    );
    assert_eq!(left(&mut c).await, 900_000, "{kind:?}");
    // A refund of more than the hold took gives back the hold; the usage is charged.
    call(&mut c, settle("r1", 150_000, Some(60_000))).await;
    assert_eq!(left(&mut c).await, 940_000, "{kind:?}");
    call(&mut c, settle("r1", 150_000, None)).await;
    assert_eq!(left(&mut c).await, 940_000, "{kind:?}: settled once");
    // With others' usage counted, a refund larger than its hold gives back the hold alone.
    assert!(
        is_ok(&call(&mut c, reserve("r3", 100_000)).await),
        "{kind:?}"
    );
    call(&mut c, settle("r3", 150_000, None)).await;
    assert_eq!(left(&mut c).await, 940_000, "{kind:?}: the hold's 100,000");
    // A replayed id while held is refused, and its own settlement (Envoy sends one for a
    // refused request too) is owed to the hold: it gives nothing back and leaves the hold.
    // Once settled, the id may be taken again.
    assert!(is_ok(&call(&mut c, reserve("r2", 1_000)).await));
    assert!(
        is_over(&call(&mut c, reserve("r2", 1_000)).await),
        "{kind:?}"
    );
    call(&mut c, settle("r2", 1_000, None)).await;
    assert_eq!(
        left(&mut c).await,
        939_000,
        "{kind:?}: the replay's give-back is owed"
    );
    call(&mut c, settle("r2", 400, None)).await;
    assert_eq!(left(&mut c).await, 939_400, "{kind:?}: a partial refund");
    call(&mut c, settle("r2", 600, None)).await;
    assert_eq!(left(&mut c).await, 939_400, "{kind:?}: the hold ended");
    assert!(is_ok(&call(&mut c, reserve("r2", 1_000)).await), "{kind:?}");
    assert_eq!(left(&mut c).await, 938_400, "{kind:?}");
    // On a node that keeps holds, a refund naming none gives nothing back.
    let mut unnamed = with_hits(request("budgets", &[&[("tenant", "acme")]]), 0, 5_000);
    unnamed.descriptors[0].is_negative_hits = true;
    call(&mut c, unnamed).await;
    assert_eq!(left(&mut c).await, 938_400, "{kind:?}");
}

/// A hold gives back what it took, whatever the window and the limit in force at the refund:
/// a sliding_log of 300 and of 10,000 years (its end past 2^53 µs; before, Redis gave back 4
/// of 10 and 1 of 10), and a hold of 60 refunded while a reload has the limit at 0 (before,
/// Redis gave back 1: a refund was capped at the limit in force's widest amount).
async fn a_hold_gives_back_what_it_took(kind: Kind) {
    let logs = "domain: budgets
descriptors:
  - key: tenant
    hold_key: request_id
    rate_limit: {algorithm: sliding_log, unit: year, unit_multiplier: 300, requests_per_unit: 100}
  - key: team
    hold_key: request_id
    rate_limit: {algorithm: sliding_log, unit: year, unit_multiplier: 10000, requests_per_unit: 100}
";
    let s = start(kind, &[("budgets.yaml", logs)], &[]).await;
    let mut c = s.client().await;
    for key in ["tenant", "team"] {
        let d = [(key, "acme"), ("request_id", "r1")];
        let r = call(&mut c, weighted(request("budgets", &[&d]), 10)).await;
        assert_eq!(r.statuses[0].limit_remaining, 90, "{kind:?} {key}");
        let mut back = with_hits(request("budgets", &[&d]), 0, 10);
        back.descriptors[0].is_negative_hits = true;
        call(&mut c, back).await;
        let check = with_hits(request("budgets", &[&[(key, "acme")]]), 0, 0);
        let left = call(&mut c, check).await.statuses[0].limit_remaining;
        assert_eq!(left, 100, "{kind:?} {key}: the hold's 10 given back");
    }

    let budget = |n: u64| BUDGETS.replace("1000000", &n.to_string());
    reload(&s, "budgets.yaml", &budget(100)).await;
    assert!(is_ok(&call(&mut c, reserve("r60", 60)).await), "{kind:?}");
    assert_eq!(left(&mut c).await, 40, "{kind:?}");
    reload(&s, "budgets.yaml", &budget(0)).await;
    call(&mut c, settle("r60", 60, None)).await;
    reload(&s, "budgets.yaml", &budget(100)).await;
    assert_eq!(
        left(&mut c).await,
        100,
        "{kind:?}: the hold's 60 given back"
    );
}

/// `ratelimit_places_in_use{domain,rule}` of `s`.
async fn in_use(s: &TestServer) -> f64 {
    s.metric("ratelimit_places_in_use{domain=\"llm\",rule=\"tenant\"}")
        .await
}

async fn places_in_use_are_a_gauge_per_rule(kind: Kind) {
    let s = start(kind, &[("llm.yaml", CONFIG)], &[]).await;
    let mut c = s.client().await;
    admitted(&mut c, "acme", &["a", "b"]).await;
    admitted(&mut c, "other", &["a"]).await;
    assert_eq!(in_use(&s).await, 3.0, "{kind:?}");
    call(&mut c, release("acme", "a")).await;
    call(&mut c, release("acme", "a")).await;
    call(&mut c, release("acme", "never")).await;
    assert_eq!(in_use(&s).await, 2.0, "{kind:?}: one released");
}

/// The admin API lists a descriptor's holds (ids as sent, a long one as its digest; what each
/// took; when each ends) and ends them: places free again, a budget's hits still counted.
async fn the_admin_api_lists_and_clears_holds(kind: Kind) {
    use ratelimitd::admin::admin_client::AdminClient;
    use ratelimitd::admin::{CounterRequest, Entry};
    let s = start(
        kind,
        &[("llm.yaml", CONFIG), ("budgets.yaml", BUDGETS)],
        &["--admin"],
    )
    .await;
    let mut c = s.client().await;
    let mut admin = AdminClient::connect(format!("http://{}", s.grpc))
        .await
        .unwrap();
    let of = |domain: &str, key: &str| CounterRequest {
        domain: domain.into(),
        entries: vec![Entry {
            key: key.into(),
            value: "acme".into(),
            escaped: false,
        }],
    };
    let long = "x".repeat(100);
    admitted(&mut c, "acme", &["a", &long, "c"]).await;
    let holds = admin
        .get_holds(of("llm", "tenant"))
        .await
        .unwrap()
        .into_inner()
        .limits;
    assert_eq!(holds.len(), 1, "{kind:?}: {holds:?}");
    assert_eq!(holds[0].algorithm, "concurrency");
    let ids: Vec<(&str, bool, u64)> = holds[0]
        .holds
        .iter()
        .map(|h| (h.id.as_str(), h.escaped, h.hits))
        .collect();
    assert_eq!(ids.len(), 3, "{kind:?}: {ids:?}");
    assert_eq!(
        (ids[0].0, ids[0].2),
        ("a", 1),
        "{kind:?}: the first to end first"
    );
    assert!(ids[1].0.starts_with("\\#sha256:") && ids[1].1, "{ids:?}");
    assert!(
        holds[0]
            .holds
            .iter()
            .all(|h| h.ends_in_ms <= 600_000 && h.ends_in_ms > 590_000)
    );
    let cleared = admin.clear_holds(of("llm", "tenant")).await.unwrap();
    assert_eq!(cleared.into_inner().cleared, 3, "{kind:?}");
    assert_eq!(
        admitted(&mut c, "acme", &["d", "e", "f", "g"]).await,
        [true, true, true, false],
        "{kind:?}: the places are free"
    );

    assert!(is_ok(&call(&mut c, reserve("r1", 100_000)).await));
    let holds = admin
        .get_holds(of("budgets", "tenant"))
        .await
        .unwrap()
        .into_inner()
        .limits;
    assert_eq!(
        holds[0]
            .holds
            .iter()
            .map(|h| (h.id.as_str(), h.hits))
            .collect::<Vec<_>>(),
        [("r1", 100_000)]
    );
    admin.clear_holds(of("budgets", "tenant")).await.unwrap();
    call(&mut c, settle("r1", 100_000, None)).await;
    assert_eq!(
        left(&mut c).await,
        900_000,
        "{kind:?}: the hits stay counted"
    );
}

/// A client that reuses an id in flight (an Envoy that is not the edge keeps the client's
/// x-request-id) is refused, and the refused request's release (Envoy sends it for a 429'd
/// request too) is owed to the hold it collided with: it frees nothing, so the tenant never
/// has more than its places in flight. However many replays, each owes one release; the place
/// is freed by the release after them, in whatever order they come.
async fn a_refused_replays_release_never_frees_the_place_it_collided_with(kind: Kind) {
    let s = start(kind, &[("llm.yaml", CONFIG)], &[]).await;
    let mut c = s.client().await;
    assert_eq!(admitted(&mut c, "acme", &["a"]).await, [true]);
    // Three replays of "a", each refused, each released at once.
    for _ in 0..3 {
        assert!(
            is_over(&call(&mut c, acquire("acme", "a")).await),
            "{kind:?}"
        );
        call(&mut c, release("acme", "a")).await;
    }
    assert_eq!(
        admitted(&mut c, "acme", &["b", "c", "d"]).await,
        [true, true, false],
        "{kind:?}: a's place is still taken"
    );
    assert_eq!(in_use(&s).await, 3.0, "{kind:?}");
    // a's own release, after the replays', frees it.
    call(&mut c, release("acme", "a")).await;
    assert_eq!(
        admitted(&mut c, "acme", &["e", "f"]).await,
        [true, false],
        "{kind:?}"
    );
    // The other order: a replay of b refused; b's own release comes first and is taken as
    // the one owed, the replay's later one frees the place. Never more than 3 in flight.
    assert!(is_over(&call(&mut c, acquire("acme", "b")).await));
    call(&mut c, release("acme", "b")).await;
    assert_eq!(admitted(&mut c, "acme", &["g"]).await, [false], "{kind:?}");
    call(&mut c, release("acme", "b")).await;
    assert_eq!(
        admitted(&mut c, "acme", &["g", "h"]).await,
        [true, false],
        "{kind:?}"
    );
    // A released id owes nothing: taken again, released once, it frees its place.
    for id in ["c", "e", "g"] {
        call(&mut c, release("acme", id)).await;
    }
    assert_eq!(in_use(&s).await, 0.0, "{kind:?}");
    assert_eq!(admitted(&mut c, "acme", &["a"]).await, [true]);
    call(&mut c, release("acme", "a")).await;
    assert_eq!(in_use(&s).await, 0.0, "{kind:?}");
}

/// A release owed to a refused replay whose own release never came (its Envoy died) ends with
/// the hold it was owed to: once that hold's lifetime is over, a request under the same id
/// takes a place, and its one release frees it.
async fn an_owed_release_ends_with_its_hold(kind: Kind) {
    const ONE_SECOND: &str = "domain: llm
descriptors:
  - key: tenant
    hold_key: request_id
    rate_limits:
      - {algorithm: concurrency, requests_per_unit: 1, unit: second}
";
    let s = start(kind, &[("llm.yaml", ONE_SECOND)], &[]).await;
    let mut c = s.client().await;
    assert_eq!(admitted(&mut c, "acme", &["a"]).await, [true]);
    // A replay, refused; its release never comes. Neither does a's: the place ends at 1 s.
    assert!(is_over(&call(&mut c, acquire("acme", "a")).await));
    poll(Duration::from_secs(10), || {
        let mut c = c.clone();
        async move { is_ok(&call(&mut c, acquire("acme", "a")).await).then_some(()) }
    })
    .await;
    call(&mut c, release("acme", "a")).await;
    assert_eq!(
        admitted(&mut c, "acme", &["b"]).await,
        [true],
        "{kind:?}: the new hold's release was taken as the one owed to the old"
    );
}

/// The docs' own `hold_key` node: five places per tenant and a monthly budget, reserved and
/// settled as "Reservations" shows.
const PLACES_AND_BUDGET: &str = "domain: budgets
descriptors:
  - key: tenant
    hold_key: request_id
    rate_limits:
      - {algorithm: concurrency, requests_per_unit: 5, unit: minute, unit_multiplier: 10}
      - {unit: month, requests_per_unit: 1000000, calendar: Europe/Berlin}
";

/// A settlement (the estimate given back, the usage reported, in one stream-done call) leaves
/// its request's place free, whichever of the two comes first: a cost report takes no place.
/// Before, the report took a new place under the same id that nothing released: after five
/// requests the tenant was locked out for the places' lifetime.
async fn a_settlement_leaves_its_place_free(kind: Kind) {
    let s = start(kind, &[("budgets.yaml", PLACES_AND_BUDGET)], &[]).await;
    let mut c = s.client().await;
    let places = || async {
        let (_, text) = s.http_get("/metrics").await;
        metric(
            &text,
            "ratelimit_places_in_use{domain=\"budgets\",rule=\"tenant\"}",
        )
    };
    for i in 0..8 {
        let id = format!("r{i}");
        let r = call(&mut c, reserve(&id, 1_000)).await;
        assert!(is_ok(&r), "{kind:?}: request {i} refused: {r:?}");
        assert_eq!(places().await, 1.0, "{kind:?}: request {i} in flight");
        let mut done = settle(&id, 1_000, Some(600));
        if i % 2 == 1 {
            // The usage first, the refund after it: the same call.
            done.descriptors.reverse();
        }
        call(&mut c, done).await;
        assert_eq!(places().await, 0.0, "{kind:?}: request {i} settled");
    }
    // A check reports the most restrictive of the two: five places left.
    assert_eq!(left(&mut c).await, 5, "{kind:?}");
    // Five in flight still fill the places; the sixth is refused.
    for i in 0..5 {
        assert!(is_ok(&call(&mut c, reserve(&format!("f{i}"), 1)).await));
    }
    assert!(is_over(&call(&mut c, reserve("f5", 1)).await), "{kind:?}");
}

/// A request's own `limit` replaces a node's rate limits, never its places: a client cannot
/// lift a concurrency limit by sending one. Before, 4 of 3 were admitted (all 3, 4 of 2...).
async fn a_requests_own_limit_leaves_the_places_in_force(kind: Kind) {
    use envoy_types::pb::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::RateLimitOverride;
    use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::rate_limit::Unit;
    let s = start(kind, &[("llm.yaml", CONFIG)], &[]).await;
    let mut c = s.client().await;
    let limited = |mut req: RateLimitRequest, requests_per_unit: u32| {
        req.descriptors[0].limit = Some(RateLimitOverride {
            requests_per_unit,
            unit: Unit::Minute as i32,
        });
        req
    };
    let mut got = Vec::new();
    for id in ["a", "b", "c", "d", "e"] {
        got.push(is_ok(
            &call(&mut c, limited(acquire("acme", id), 100)).await,
        ));
    }
    assert_eq!(got, [true, true, true, false, false], "{kind:?}");
    // Its own limit still applies beside the places.
    let r = call(&mut c, limited(acquire("other", "x"), 0)).await;
    assert!(is_over(&r), "{kind:?}: {r:?}");
    // A release that carries a `limit` releases the place.
    call(&mut c, limited(release("acme", "a"), 100)).await;
    assert_eq!(admitted(&mut c, "acme", &["f", "g"]).await, [true, false]);
}

/// `--memory-max-bytes` bounds what holds a client makes the service keep: a counter with its
/// holds fits its shard's share (the bound / 64). A rate limit drops its holds that end first
/// (their hits stay counted); a concurrency limit refuses the place that would not fit and
/// never drops one in use. Before, the counter being written was never given up and its holds
/// never dropped: 6,000 holds of 64-byte ids held 1.35 MB at a 1 MiB bound.
#[tokio::test]
async fn the_memory_bound_holds_whatever_holds_a_client_makes_it_keep() {
    const BOUND: f64 = 1_048_576.0;
    let config = "domain: bound
descriptors:
  - key: tenant
    hold_key: request_id
    rate_limit: {unit: day, requests_per_unit: 1000000}
  - key: team
    hold_key: request_id
    rate_limit: {algorithm: concurrency, requests_per_unit: 10000, unit: minute, unit_multiplier: 10}
";
    let s = start(
        Kind::Memory,
        &[("bound.yaml", config)],
        &["--memory-max-bytes", "1MiB"],
    )
    .await;
    let id = |i: usize| format!("{i:064}");
    let hold =
        move |key: &str, i: usize| request("bound", &[&[(key, "acme"), ("request_id", &id(i))]]);
    let give_back = move |key: &str, i: usize| {
        let mut req = with_hits(hold(key, i), 0, 1);
        req.descriptors[0].is_negative_hits = true;
        req
    };
    let held = || s.metric("ratelimit_memory_bytes");

    // 6,000 holds on one rate limit's counter, from four clients at once, the bound watched
    // while they are taken.
    const HOLDS: usize = 6_000;
    let mut tasks = Vec::new();
    for t in 0..4 {
        let mut c = s.client().await;
        tasks.push(tokio::spawn(async move {
            for i in (t..HOLDS).step_by(4) {
                let r = call(&mut c, hold("tenant", i)).await;
                assert!(is_ok(&r), "hold {i}: {r:?}");
            }
        }));
    }
    while !tasks.iter().all(|t| t.is_finished()) {
        let bytes = held().await;
        assert!(bytes <= BOUND, "{bytes} bytes held at a bound of {BOUND}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    for t in tasks {
        t.await.unwrap();
    }
    let bytes = held().await;
    assert!(bytes <= BOUND, "{bytes} bytes held at a bound of {BOUND}");
    assert!(s.metric("ratelimit_memory_holds_dropped_total").await > 0.0);
    let mut c = s.client().await;
    let counted = 1_000_000 - HOLDS as u32;
    assert_eq!(remaining(&mut c).await, counted, "every hit stays counted");
    call(&mut c, give_back("tenant", 0)).await;
    let left = remaining(&mut c).await;
    assert_eq!(left, counted, "a dropped hold gives nothing back");
    call(&mut c, give_back("tenant", HOLDS - 1)).await;
    let left = remaining(&mut c).await;
    assert_eq!(left, counted + 1, "a kept hold gives back");

    // Places: refused once the counter's share is full; none in use is dropped for room.
    let mut taken = 0;
    while taken < 10_000 && is_ok(&call(&mut c, hold("team", taken)).await) {
        taken += 1;
    }
    assert!(
        (10..1_000).contains(&taken),
        "{taken} places in a share of 16 KiB"
    );
    assert!(held().await <= BOUND);
    assert_eq!(s.metric("ratelimit_memory_places_refused_total").await, 1.0);
    let in_use = || s.metric("ratelimit_places_in_use{domain=\"bound\",rule=\"team\"}");
    assert_eq!(in_use().await, taken as f64);
    for i in 0..taken {
        call(&mut c, give_back("team", i)).await;
    }
    assert_eq!(in_use().await, 0.0, "every place taken was still held");
    for i in 0..taken {
        let r = call(&mut c, hold("team", 20_000 + i)).await;
        assert!(is_ok(&r), "place {i} of {taken} again: {r:?}");
    }
    assert!(is_over(&call(&mut c, hold("team", 30_000)).await));
    assert!(held().await <= BOUND);
}

/// One tenant's holds never cost another tenant its counters while the process is under its
/// bound: 16 tenants each keeping far more open reservations than one counter may hold (its
/// share, 1/64 of the bound) lose their own oldest holds, and 32 victims whose monthly budget
/// is spent stay refused. Before, a counter past its shard's share made the shard give up its
/// other counters first: with the state at a fraction of the bound, victims were evicted and
/// admitted again.
#[tokio::test]
async fn holds_never_cost_another_tenant_its_counters_under_the_bound() {
    let config = "domain: crowd
descriptors:
  - key: tenant
    hold_key: request_id
    rate_limit: {unit: month, requests_per_unit: 1000000}
  - key: victim
    rate_limit: {unit: month, requests_per_unit: 1}
";
    let s = start(
        Kind::Memory,
        &[("crowd.yaml", config)],
        &["--memory-max-bytes", "4MiB"],
    )
    .await;
    let victim = |v: usize| request("crowd", &[&[("victim", &format!("victim-{v}"))]]);
    let mut c = s.client().await;
    for v in 0..32 {
        assert!(is_ok(&call(&mut c, victim(v)).await), "victim {v}");
        assert!(is_over(&call(&mut c, victim(v)).await), "victim {v}");
    }
    // 16 tenants × 600 open reservations of 1 (each hold about 220 bytes: some 300 fit in a
    // counter's 64 KiB share).
    let mut tasks = Vec::new();
    for t in 0..16 {
        let mut c = s.client().await;
        tasks.push(tokio::spawn(async move {
            for i in 0..600 {
                let id = format!("req-{i}");
                let r = call(
                    &mut c,
                    request(
                        "crowd",
                        &[&[("tenant", &format!("tenant-{t}")), ("request_id", &id)]],
                    ),
                )
                .await;
                assert!(is_ok(&r), "tenant {t}, hold {i}: {r:?}");
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    let (bytes, dropped) = (
        s.metric("ratelimit_memory_bytes").await,
        s.metric("ratelimit_memory_holds_dropped_total").await,
    );
    println!("16 tenants × 600 holds: {bytes} bytes held, {dropped} holds dropped");
    assert!(dropped > 0.0, "each tenant outgrew its share");
    assert!(
        bytes <= 4_194_304.0 / 2.0,
        "{bytes} bytes: well under the bound"
    );
    assert_eq!(s.metric("ratelimit_memory_evictions_total").await, 0.0);
    for v in 0..32 {
        assert!(
            is_over(&call(&mut c, victim(v)).await),
            "victim {v}'s spent budget was given up and admitted again"
        );
    }
}

/// What is left of `bound`'s tenant limit (a check of 0 hits).
async fn remaining(c: &mut Client) -> u32 {
    let check = with_hits(request("bound", &[&[("tenant", "acme")]]), 0, 0);
    call(c, check).await.statuses[0].limit_remaining
}

/// Writes `text` to `name` in the server's config directory and waits until it is in force.
async fn reload(s: &TestServer, name: &str, text: &str) {
    let loads = || async {
        let (_, m) = s.http_get("/metrics").await;
        metric(&m, r#"ratelimit_config_loads_total{result="success"}"#)
    };
    let before = loads().await;
    s.write(name, text);
    poll(Duration::from_secs(15), || async {
        (loads().await > before).then_some(())
    })
    .await;
}

/// Places in flight carry across a reload that keeps the rule: a changed lifetime applies to
/// places taken after it, a lower `requests_per_unit` refuses until the places in flight drop
/// under it, and the releases made meanwhile count. Before, a changed lifetime was a counter
/// of its own: 3 of 3 held, 3 more admitted after the reload, and releases of the places
/// taken before it lost.
async fn places_carry_across_a_reload_that_keeps_the_rule(kind: Kind) {
    let s = start(kind, &[("llm.yaml", CONFIG)], &[]).await;
    let mut c = s.client().await;
    assert_eq!(admitted(&mut c, "acme", &["a", "b", "c"]).await, [true; 3]);
    // Five minutes, not ten: the three places stay taken.
    reload(
        &s,
        "llm.yaml",
        &CONFIG.replace("unit_multiplier: 10", "unit_multiplier: 5"),
    )
    .await;
    assert_eq!(admitted(&mut c, "acme", &["d"]).await, [false], "{kind:?}");
    call(&mut c, release("acme", "b")).await;
    assert_eq!(
        admitted(&mut c, "acme", &["d", "e"]).await,
        [true, false],
        "{kind:?}: a place taken before the reload, released after it"
    );
    // Two places, not three: a, c and d stay in flight, and one release frees none.
    reload(
        &s,
        "llm.yaml",
        &CONFIG.replace("requests_per_unit: 3", "requests_per_unit: 2"),
    )
    .await;
    assert_eq!(admitted(&mut c, "acme", &["f"]).await, [false], "{kind:?}");
    call(&mut c, release("acme", "a")).await;
    assert_eq!(admitted(&mut c, "acme", &["f"]).await, [false], "{kind:?}");
    call(&mut c, release("acme", "c")).await;
    assert_eq!(
        admitted(&mut c, "acme", &["f", "g"]).await,
        [true, false],
        "{kind:?}: d and f in flight of 2"
    );
}

/// A concurrency rule removed by a reload and restored by another finds its places as they
/// were left: those still in flight stay taken (3 of 3 held, none admitted after), and a
/// release made while it was out of force frees its place.
async fn places_of_a_rule_removed_for_a_while_are_kept(kind: Kind) {
    let s = start(kind, &[("llm.yaml", CONFIG)], &[]).await;
    let mut c = s.client().await;
    assert_eq!(admitted(&mut c, "acme", &["a", "b", "c"]).await, [true; 3]);
    let without = "domain: llm\ndescriptors:\n  - key: route\n    rate_limit: {unit: hour, requests_per_unit: 1}\n";
    reload(&s, "llm.yaml", without).await;
    call(&mut c, release("acme", "b")).await;
    reload(&s, "llm.yaml", CONFIG).await;
    assert_eq!(
        admitted(&mut c, "acme", &["d", "e"]).await,
        [true, false],
        "{kind:?}: a and c in flight, b released while its rule was out of force"
    );
}

/// The admin token of `an_override_of_places_keeps_the_places_in_flight`'s token file.
const AUTH: (&str, &str) = ("Authorization", "Bearer 0123456789abcdef-alice");

/// `PUT /v1/overrides` of `body` on `s`'s admin listener: status and body.
async fn put_override(s: &TestServer, body: &str) -> (u16, String) {
    let headers = [AUTH, ("Content-Type", "application/json")];
    http_call(
        s.admin.unwrap(),
        "PUT",
        "/v1/overrides",
        &headers,
        body.as_bytes(),
    )
    .await
}

/// An operator's override of a concurrency rule keeps the places in flight, whatever lifetime
/// it gives them: 3 held, an override to 4 places of 5 minutes admits one more, not four, and
/// a release of a place taken before it counts. Deleting it brings the 3 back over the same
/// places. Before, an override could not give places (400), and one of rate limits replaced
/// the places.
async fn an_override_of_places_keeps_the_places_in_flight(kind: Kind) {
    let tokens = tempfile::tempdir().unwrap();
    let file = tokens.path().join("tokens");
    std::fs::write(&file, "alice:0123456789abcdef-alice\n").unwrap();
    let file = file.display().to_string();
    let flags = ["--admin-addr", "127.0.0.1:0", "--admin-token-file", &file];
    let s = start(kind, &[("llm.yaml", CONFIG)], &flags).await;
    let mut c = s.client().await;
    assert_eq!(admitted(&mut c, "acme", &["a", "b", "c"]).await, [true; 3]);
    let auth = [AUTH];
    let body = r#"{"domain": "llm", "entries": [{"key": "tenant", "value": "acme"}],
        "limits": [{"algorithm": "concurrency", "requests_per_unit": 4, "unit": "minute",
                    "unit_multiplier": 5}]}"#;
    let (status, answer) = put_override(&s, body).await;
    assert_eq!(status, 200, "{answer}");
    let id = serde_json::from_str::<serde_json::Value>(&answer).unwrap()["id"]
        .as_str()
        .unwrap()
        .to_owned();
    assert_eq!(
        admitted(&mut c, "acme", &["d", "e"]).await,
        [true, false],
        "{kind:?}: 4 places, 3 of them taken before the override"
    );
    call(&mut c, release("acme", "a")).await;
    assert_eq!(admitted(&mut c, "acme", &["e", "f"]).await, [true, false]);
    let path = format!("/v1/overrides/{id}");
    let (status, answer) = http_call(s.admin.unwrap(), "DELETE", &path, &auth, b"").await;
    assert_eq!(status, 200, "{answer}");
    // b, c, d and e in flight of the config's 3.
    assert_eq!(admitted(&mut c, "acme", &["g"]).await, [false], "{kind:?}");
    for id in ["b", "c"] {
        call(&mut c, release("acme", id)).await;
    }
    assert_eq!(
        admitted(&mut c, "acme", &["g", "h"]).await,
        [true, false],
        "{kind:?}"
    );
    // An override of rate limits alone leaves the node's places in force (before, it replaced
    // them: every request admitted).
    let body = r#"{"domain": "llm", "entries": [{"key": "tenant", "value": "other"}],
        "limits": [{"requests_per_unit": 100, "unit": "hour"}]}"#;
    let (status, answer) = put_override(&s, body).await;
    assert_eq!(status, 200, "{answer}");
    assert_eq!(
        admitted(&mut c, "other", &["a", "b", "c", "d"]).await,
        [true, true, true, false],
        "{kind:?}"
    );
}

/// `ratelimit_calls_undone_total`.
async fn undone(s: &TestServer) -> f64 {
    s.metric("ratelimit_calls_undone_total").await
}

/// A call whose answer never goes out takes nothing. Three acquisitions sent on a raw HTTP/2
/// connection whose flow-control window is 0 are decided (their places taken: a fourth is
/// refused), but their answers cannot be sent; the client then resets the three streams, as
/// Envoy does when its downstream resets mid-call: the places are free again at once, where
/// before they were kept for the place lifetime (10 minutes) and the tenant locked out.
async fn a_call_reset_before_its_answer_went_out_takes_nothing(kind: Kind) {
    use common::frames::*;
    use prost::Message;
    let s = start(kind, &[("llm.yaml", CONFIG)], &[]).await;
    let mut socket = tokio::net::TcpStream::connect(s.grpc).await.unwrap();
    let mut hello = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n".to_vec();
    hello.extend(frame(4, 0, 0, &[0, 4, 0, 0, 0, 0])); // SETTINGS_INITIAL_WINDOW_SIZE = 0
    assert!(send(&mut socket, &hello).await);
    // The window applies to streams opened once the server has acknowledged it.
    loop {
        match read_frame(&mut socket)
            .await
            .expect("the server's greeting")
        {
            (4, 0, ..) => assert!(send(&mut socket, &frame(4, 1, 0, &[])).await),
            (4, ..) => break,
            _ => {}
        }
    }
    let mut calls = Vec::new();
    let block = headers(&CALL);
    for (stream, id) in [(1u32, "a"), (3, "b"), (5, "c")] {
        calls.extend(frame(1, 4, stream, &block)); // HEADERS, END_HEADERS
        let message = grpc_message(&acquire("acme", id).encode_to_vec());
        calls.extend(frame(0, 1, stream, &message)); // DATA, END_STREAM
    }
    assert!(send(&mut socket, &calls).await);
    let mut c = s.client().await;
    // Decided: their places are taken while their answers wait for a window.
    poll(Duration::from_secs(10), || async {
        (in_use(&s).await == 3.0).then_some(())
    })
    .await;
    assert!(
        !is_ok(&call(&mut c, acquire("acme", "d")).await),
        "{kind:?}"
    );
    assert_eq!(undone(&s).await, 0.0, "{kind:?}");
    let mut resets = Vec::new();
    for stream in [1u32, 3, 5] {
        resets.extend(frame(3, 0, stream, &[0, 0, 0, 8])); // RST_STREAM CANCEL
    }
    assert!(send(&mut socket, &resets).await);
    poll(Duration::from_secs(10), || async {
        (undone(&s).await == 3.0).then_some(())
    })
    .await;
    assert_eq!(
        in_use(&s).await,
        0.0,
        "{kind:?}: the gauge counts what is taken"
    );
    assert_eq!(
        admitted(&mut c, "acme", &["e", "f", "g", "h"]).await,
        [true, true, true, false],
        "{kind:?}: the three places are free again"
    );
    drop(socket);
}

/// A call cancelled while Redis decides it: the script runs once Redis answers, and the
/// admission it made is given back at once, its caller being gone. Before, the three places
/// stayed taken for their lifetime, and the places gauge showed none of them.
#[tokio::test]
async fn a_call_cancelled_while_redis_decides_takes_nothing() {
    let redis = RedisProc::start(&[]);
    let s = redis_server(
        &[("llm.yaml", CONFIG)],
        &["--redis-url", &redis.url()],
        &unique_prefix(),
        "5s",
    )
    .await;
    let mut c = s.client().await;
    // The scripts loaded, the connection up.
    assert_eq!(admitted(&mut c, "warm", &["w"]).await, [true]);
    // Scripts wait while Redis is paused for writes: the calls are in flight at Redis.
    redis.cli(&["CLIENT", "PAUSE", "3000", "WRITE"]);
    for id in ["a", "b", "c"] {
        let cancelled = tokio::time::timeout(
            Duration::from_millis(200),
            call(&mut c, acquire("acme", id)),
        )
        .await;
        assert!(cancelled.is_err(), "answered while Redis was paused");
    }
    poll(Duration::from_secs(10), || async {
        (undone(&s).await == 3.0).then_some(())
    })
    .await;
    assert_eq!(in_use(&s).await, 1.0, "the warm-up's place alone");
    assert_eq!(
        admitted(&mut c, "acme", &["e", "f", "g", "h"]).await,
        [true, true, true, false],
        "the three places are free again"
    );
}

every_backend!(
    a_call_reset_before_its_answer_went_out_takes_nothing,
    a_hold_gives_back_what_it_took,
    places_of_a_rule_removed_for_a_while_are_kept,
    places_carry_across_a_reload_that_keeps_the_rule,
    an_override_of_places_keeps_the_places_in_flight,
    a_settlement_leaves_its_place_free,
    a_requests_own_limit_leaves_the_places_in_force,
    an_owed_release_ends_with_its_hold,
    a_refused_replays_release_never_frees_the_place_it_collided_with,
    the_admin_api_lists_and_clears_holds,
    places_in_use_are_a_gauge_per_rule,
    three_places_four_holds_and_a_release_frees_one,
    releases_free_only_the_place_a_hold_took,
    a_request_refused_by_another_limit_takes_no_place,
    a_forged_refund_gives_nothing_back,
    a_settlement_gives_back_what_its_hold_took_once,
);

const SEC: u64 = 1_000_000;
/// 2026-01-01T00:06:40Z: a multiple of every window here.
const T0: u64 = 1_767_226_000 * SEC;

#[tokio::test]
async fn places_never_released_end_at_their_lifetime_not_before() {
    let config = "domain: llm
descriptors:
  - key: tenant
    hold_key: request_id
    rate_limit: {algorithm: concurrency, requests_per_unit: 2, unit: second, unit_multiplier: 1000}
";
    let (servers, _redis) = stepped_servers(&[("llm.yaml", config)], T0, T0).await;
    for (name, server, clock) in &servers {
        let mut c = server.client().await;
        assert_eq!(
            admitted(&mut c, "acme", &["a", "b", "c"]).await,
            [true, true, false]
        );
        // Ten seconds before the lifetime ends (a running clock's slack): still held.
        clock.set(T0 + 990 * SEC);
        assert_eq!(admitted(&mut c, "acme", &["c"]).await, [false], "{name}");
        // Ten seconds after (the running clock started ms after the places were taken).
        clock.set(T0 + 1_010 * SEC);
        assert_eq!(
            admitted(&mut c, "acme", &["c", "d", "e"]).await,
            [true, true, false],
            "{name}: both places ended"
        );
        // Their releases, late, free nothing: the places are c's and d's now.
        call(&mut c, release("acme", "a")).await;
        call(&mut c, release("acme", "b")).await;
        assert_eq!(admitted(&mut c, "acme", &["e"]).await, [false], "{name}");
        // The two that ended unreleased are counted; in use are the two taken since.
        let (_, text) = server.http_get("/metrics").await;
        let ended = "ratelimit_places_ended_total{domain=\"llm\",rule=\"tenant\"}";
        assert_eq!(metric(&text, ended), 2.0, "{name}: {text}");
        assert_eq!(in_use(server).await, 2.0, "{name}");
    }
}

#[tokio::test]
async fn holds_refunded_after_their_window_free_nothing_in_the_next() {
    let mut config = String::from("domain: w\ndescriptors:\n");
    for a in [
        "fixed_window",
        "sliding_window",
        "sliding_log",
        "token_bucket",
    ] {
        config.push_str(&format!(
            "  - key: {a}\n    hold_key: request_id\n    rate_limit: {{algorithm: {a}, unit: second, unit_multiplier: 1000, requests_per_unit: 10}}\n"
        ));
    }
    let take = |a: &str, id: &str, hits: u32| {
        weighted(request("w", &[&[(a, "t"), ("request_id", id)]]), hits)
    };
    let give = |a: &str, id: &str, hits: u64| {
        let mut r = with_hits(request("w", &[&[(a, "t"), ("request_id", id)]]), 0, hits);
        r.descriptors[0].is_negative_hits = true;
        r
    };
    let (servers, _redis) = stepped_servers(&[("w.yaml", &config)], T0, T0).await;
    for (name, server, clock) in &servers {
        let mut c = server.client().await;
        // Each algorithm 4,000 s after the last: the memory clock never runs back.
        for (n, a) in [
            "fixed_window",
            "sliding_window",
            "sliding_log",
            "token_bucket",
        ]
        .into_iter()
        .enumerate()
        {
            let at = |s: u64| T0 + (n as u64 * 4_000 + s) * SEC;
            clock.set(at(0));
            assert!(is_ok(&call(&mut c, take(a, "old", 10)).await), "{name} {a}");
            // Within its window a hold's refund gives back what it took.
            assert!(is_over(&call(&mut c, take(a, "x", 1)).await), "{name} {a}");
            clock.set(at(10));
            call(&mut c, give(a, "old", 4)).await;
            assert!(is_ok(&call(&mut c, take(a, "new", 4)).await), "{name} {a}");
            assert!(is_over(&call(&mut c, take(a, "y", 1)).await), "{name} {a}");
            // Two windows later (a sliding window weighs the previous one; a bucket refills
            // in one), what is taken then is not given back by the old holds' refunds.
            clock.set(at(2_000));
            assert!(
                is_ok(&call(&mut c, take(a, "now", 10)).await),
                "{name} {a}: a fresh window"
            );
            call(&mut c, give(a, "new", 4)).await;
            call(&mut c, give(a, "old", 10)).await;
            let r = call(&mut c, take(a, "z", 1)).await;
            assert!(
                is_over(&r),
                "{name} {a}: a late refund credited a later window: {r:?}"
            );
        }
    }
}

/// Two replicas on one Redis, 16 clients acquiring and releasing for 8 s: the clients never
/// count more requests in flight than there are places.
#[tokio::test]
async fn replicas_on_one_redis_never_admit_more_than_the_places() {
    let config = "domain: llm
descriptors:
  - key: tenant
    hold_key: request_id
    rate_limit: {algorithm: concurrency, requests_per_unit: 4, unit: minute}
";
    let redis = shared_standalone();
    let prefix = unique_prefix();
    let mut servers = Vec::new();
    for _ in 0..2 {
        servers.push(
            redis_server(
                &[("llm.yaml", config)],
                &["--redis-url", &redis.url()],
                &prefix,
                "2s",
            )
            .await,
        );
    }
    let in_flight = Arc::new(AtomicUsize::new(0));
    let most = Arc::new(AtomicUsize::new(0));
    let (admitted, refused) = (Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)));
    let until = Instant::now() + Duration::from_secs(8);
    let mut tasks = Vec::new();
    for client in 0..16 {
        let mut c = servers[client % 2].client().await;
        let (in_flight, most) = (in_flight.clone(), most.clone());
        let (admitted, refused) = (admitted.clone(), refused.clone());
        tasks.push(tokio::spawn(async move {
            let mut rng = Rng(client as u64 + 1);
            let mut n = 0;
            while Instant::now() < until {
                n += 1;
                let id = format!("{client}-{n}");
                if !is_ok(&call(&mut c, acquire("acme", &id)).await) {
                    refused.fetch_add(1, Ordering::Relaxed);
                    continue;
                }
                admitted.fetch_add(1, Ordering::Relaxed);
                let now = in_flight.fetch_add(1, Ordering::SeqCst) + 1;
                most.fetch_max(now, Ordering::SeqCst);
                tokio::time::sleep(Duration::from_millis(rng.below(5))).await;
                in_flight.fetch_sub(1, Ordering::SeqCst);
                call(&mut c, release("acme", &id)).await;
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    let (admitted, refused) = (
        admitted.load(Ordering::Relaxed),
        refused.load(Ordering::Relaxed),
    );
    let most = most.load(Ordering::SeqCst);
    assert!(most <= 4, "{most} requests in flight at once, 4 places");
    // Each replica's gauge is its share: a place taken on one and released on the other
    // counts +1 there and -1 here. Summed, nothing is in use.
    let mut sum = 0.0;
    for s in &servers {
        sum += in_use(s).await;
    }
    assert_eq!(sum, 0.0, "places in use over both replicas");
    assert!(
        admitted > 100 && refused > 0,
        "too little contention to tell: {admitted} admitted, {refused} refused"
    );
    assert_eq!(most, 4, "the places were all used at some point");
}

/// The example: its route rate limits read into Envoy's messages (a place taken at the request,
/// given back when the stream is done, both naming the request id last), and its timeline
/// against the example limits: 5 places per tenant, a release frees one, a refused request's
/// release frees none.
#[tokio::test]
async fn the_concurrency_example_meets_envoys_protos_and_holds() {
    use envoy_types::pb::envoy::config::route::v3::rate_limit::action::ActionSpecifier;
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let text = std::fs::read_to_string(root.join("examples/envoy/concurrency.yaml")).unwrap();
    let doc: serde_json::Value = serde_saphyr::from_str(&text).unwrap();
    let hcm =
        &doc["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"];
    // The filter's per-route config: the only place Envoy honours hits_addend.
    let route = &hcm["route_config"]["virtual_hosts"][0]["routes"][0];
    let per_route = &route["typed_per_filter_config"]["envoy.filters.http.ratelimit"];
    assert_eq!(
        per_route["@type"],
        "type.googleapis.com/envoy.extensions.filters.http.ratelimit.v3.RateLimitPerRoute"
    );
    let limits: Vec<_> = per_route["rate_limits"]
        .as_array()
        .unwrap()
        .iter()
        .map(route_rate_limit)
        .collect();
    let [take, give_back] = &limits[..] else {
        panic!("two rate limits")
    };
    assert!(!take.apply_on_stream_done && take.hits_addend.is_none());
    assert!(give_back.apply_on_stream_done);
    let addend = give_back.hits_addend.as_ref().unwrap();
    assert!(addend.is_negative_hits && addend.number.as_ref().unwrap().value == 1);
    for limit in [take, give_back] {
        let keys: Vec<_> = limit
            .actions
            .iter()
            .map(|a| match &a.action_specifier {
                Some(ActionSpecifier::RequestHeaders(h)) => {
                    (h.header_name.as_str(), h.descriptor_key.as_str())
                }
                other => panic!("{other:?}"),
            })
            .collect();
        assert_eq!(
            keys,
            [("x-tenant-id", "tenant"), ("x-request-id", "request_id")]
        );
    }
    let domain = hcm["http_filters"][0]["typed_config"]["domain"]
        .as_str()
        .unwrap();
    assert_eq!(domain, "llm");

    let s = TestServer::start_at(
        tempfile::tempdir().unwrap(),
        Some(root.join("examples/envoy/limits")),
        &[],
        Arc::new(ratelimitd::testing::SystemClock),
    )
    .await;
    let mut c = s.client().await;
    let ids = ["1", "2", "3", "4", "5", "6"];
    assert_eq!(
        admitted(&mut c, "acme", &ids).await,
        [true, true, true, true, true, false]
    );
    call(&mut c, release("acme", "6")).await;
    assert_eq!(
        admitted(&mut c, "acme", &["7"]).await,
        [false],
        "refused held none"
    );
    call(&mut c, release("acme", "3")).await;
    assert_eq!(admitted(&mut c, "acme", &["7", "8"]).await, [true, false]);
}

/// `/top` counts a concurrency limit's refusals like any other limit's, under the tenant (the
/// hold's id is no entry of it).
#[tokio::test]
async fn top_lists_who_is_refused_a_place() {
    let s = start(Kind::Memory, &[("llm.yaml", CONFIG)], &[]).await;
    let mut c = s.client().await;
    let ids: Vec<String> = (0..8).map(|i| i.to_string()).collect();
    let ids: Vec<&str> = ids.iter().map(String::as_str).collect();
    admitted(&mut c, "acme", &ids).await;
    admitted(&mut c, "quiet", &ids[..1]).await;
    let (status, body) = s.http_get("/top").await;
    assert_eq!(status, 200, "{body}");
    let report: serde_json::Value = serde_json::from_str(&body).unwrap();
    let tenant = report["limits"]
        .as_array()
        .unwrap()
        .iter()
        .find(|l| l["domain"] == "llm" && l["rule"] == "tenant")
        .unwrap_or_else(|| panic!("{body}"));
    assert_eq!(tenant["algorithm"], "concurrency");
    let first = &tenant["descriptors"][0];
    assert_eq!(first["entries"].as_array().unwrap().len(), 1, "{body}");
    assert_eq!(first["entries"][0]["value"], "acme", "{body}");
    assert_eq!(
        (first["hits"].as_u64(), first["over_limit"].as_u64()),
        (Some(8), Some(5))
    );
}
