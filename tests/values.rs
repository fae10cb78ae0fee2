//! What a client can put in a descriptor value, and how the service decides it. Envoy lets a
//! request through when its call fails, so every value a client can shape (any bytes but NUL,
//! CR and LF, not necessarily UTF-8; any length up to Envoy's 60 KiB header limit), every
//! `hits_addend` and every `is_negative_hits` must get a decision: an error would be a way
//! around every limit. Sent through a client whose messages carry bytes, as Envoy's do.

mod common;

use std::time::Duration;

use common::raw::{RawClient, RawEntry, RawRequest, raw};
use common::*;
use envoy_types::pb::envoy::service::ratelimit::v3::RateLimitResponse;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::Code;
use envoy_types::pb::google::protobuf::UInt64Value;

const LIMITS: &str = r#"
domain: values
descriptors:
  - key: user
    rate_limit: {unit: hour, requests_per_unit: 1}
  - key: pattern
    value: "caf*"
    rate_limit: {unit: hour, requests_per_unit: 1}
  - key: shared
    value: "t-*"
    share_threshold: true
    rate_limit: {unit: hour, requests_per_unit: 2}
  - key: detailed
    detailed_metric: true
    rate_limit: {unit: hour, requests_per_unit: 1}
  - key: fixed_window
    rate_limit: {unit: hour, requests_per_unit: 1}
  - key: sliding_window
    rate_limit: {unit: hour, requests_per_unit: 1, algorithm: sliding_window}
  - key: sliding_log
    rate_limit: {unit: hour, requests_per_unit: 1, algorithm: sliding_log}
  - key: token_bucket
    rate_limit: {unit: hour, requests_per_unit: 1, algorithm: token_bucket}
  - key: held
    hold_key: request_id
    rate_limits:
      - {algorithm: concurrency, requests_per_unit: 1, unit: hour}
      - {unit: hour, requests_per_unit: 1000}
"#;

/// The values a client sends when its header is not UTF-8 (Latin-1 `café`, a byte-order mark,
/// an overlong `/`, a surrogate, a lone continuation byte), and `café` in UTF-8.
const NOT_UTF8: [&[u8]; 6] = [
    b"caf\xe9",
    b"\xff\xfe",
    b"ok\xc0\xafx",
    b"\xed\xa0\x80",
    b"\x80",
    "caf\u{e9}".as_bytes(),
];

async fn server(kind: Kind) -> (TestServer, RawClient) {
    let s = start(kind, &[("limits.yaml", LIMITS)], &[]).await;
    s.client().await;
    let c = RawClient::connect(s.grpc).await;
    (s, c)
}

/// The answer to `req`, which must be a decision.
async fn decided(c: &mut RawClient, req: RawRequest) -> RateLimitResponse {
    match c.call(req).await {
        Ok(r) => {
            assert_ne!(r.overall_code, Code::Unknown as i32, "{r:?}");
            r
        }
        Err(status) => panic!("a call that fails lets Envoy's request through: {status:?}"),
    }
}

async fn code(c: &mut RawClient, req: RawRequest) -> Code {
    Code::try_from(decided(c, req).await.overall_code).unwrap()
}

/// A limit of 1 on `key`: `value` passes once, then is refused.
async fn counted_once(c: &mut RawClient, key: &str, value: &[u8]) {
    let show = String::from_utf8_lossy(&value[..value.len().min(16)]).into_owned();
    assert_eq!(
        code(c, raw("values", key, value)).await,
        Code::Ok,
        "{key} {show}"
    );
    assert_eq!(
        code(c, raw("values", key, value)).await,
        Code::OverLimit,
        "{key} {show}"
    );
}

async fn values_that_are_not_utf8_are_decided_as_their_bytes(kind: Kind) {
    let (_s, mut c) = server(kind).await;
    // Each value is its own counter: none of them was refused by another's count.
    for v in NOT_UTF8 {
        counted_once(&mut c, "user", v).await;
    }
    // A wildcard matches bytes: `caf*` takes `caf\xe9` and `caf\xe8`, each its own counter.
    counted_once(&mut c, "pattern", b"caf\xe9").await;
    counted_once(&mut c, "pattern", b"caf\xe8").await;
    // A shared wildcard counts every value it matches under its pattern: two in all.
    for (v, want) in [
        (&b"t-\xff"[..], Code::Ok),
        (b"t-\xfe", Code::Ok),
        (b"t-\x80", Code::OverLimit),
    ] {
        assert_eq!(code(&mut c, raw("values", "shared", v)).await, want);
    }
}

async fn long_values_are_decided_each_under_its_own_digest(kind: Kind) {
    let (_s, mut c) = server(kind).await;
    let long: Vec<u8> = (0..60 << 10).map(|i| b'a' + (i % 26) as u8).collect();
    let mut last_differs = long.clone();
    *last_differs.last_mut().unwrap() = b'!';
    let mut first_differs = long.clone();
    first_differs[0] = 0xff;
    for v in [&long, &last_differs, &first_differs] {
        counted_once(&mut c, "user", v).await;
    }
    // Either side of the longest value kept as it is (4,096 bytes): four counters.
    let edge: Vec<u8> = vec![0xe9; 4097];
    for v in [
        &edge[..4095],
        &edge[..4096],
        &edge[..],
        &[&edge[..], b"x"].concat(),
    ] {
        counted_once(&mut c, "user", v).await;
    }
    // A wildcard matches on every byte, however long the value.
    let mut cafe = b"caf".to_vec();
    cafe.extend_from_slice(&long);
    counted_once(&mut c, "pattern", &cafe).await;
}

/// What a client shapes, drawn from a seeded generator: the same on every run.
trait Shaped {
    fn value(&mut self) -> Vec<u8>;
    fn hits(&mut self) -> Option<u64>;
}

impl Shaped for Rng {
    /// A header value as a client may send it: any byte but NUL, CR and LF; mostly short,
    /// sometimes up to 64 KiB.
    fn value(&mut self) -> Vec<u8> {
        let len = match self.below(10) {
            0..=4 => 1 + self.below(64),
            5..=7 => 64 + self.below(4096),
            _ => 4096 + self.below((64 << 10) - 4096),
        };
        (0..len)
            .map(|_| {
                loop {
                    let b = self.next() as u8;
                    if ![0, b'\r', b'\n'].contains(&b) {
                        break b;
                    }
                }
            })
            .collect()
    }

    /// A descriptor's `hits_addend`: absent, the edges of exact arithmetic, or any.
    fn hits(&mut self) -> Option<u64> {
        match self.below(8) {
            0 => None,
            1 => Some(0),
            2 => Some(1),
            3 => Some((1 << 53) + 1),
            4 => Some(1 << 54),
            5 => Some(u64::MAX),
            _ => Some(self.next() >> self.below(64)),
        }
    }
}

async fn any_value_hits_and_refund_a_client_can_send_gets_a_decision(kind: Kind) {
    let (_s, mut c) = server(kind).await;
    let mut rng = Rng(0x5eed_0058);
    let keys = [
        "fixed_window",
        "sliding_window",
        "sliding_log",
        "token_bucket",
        "user",
        "pattern",
        "shared",
    ];
    for i in 0..300u64 {
        let key = keys[rng.below(keys.len() as u64) as usize];
        // The iteration's number makes every value new, so its limit of 1 is whole.
        let mut value = i.to_be_bytes().to_vec();
        value.extend(rng.value());
        if key == "pattern" {
            value.splice(0..0, *b"caf");
        }
        if key != "shared" {
            counted_once(&mut c, key, &value).await;
        }
        let mut req = raw("values", key, &value);
        req.hits_addend = rng.next() as u32;
        req.descriptors[0].hits_addend = rng.hits().map(|value| UInt64Value { value });
        req.descriptors[0].is_negative_hits = rng.below(2) == 0;
        decided(&mut c, req).await;
    }
    // After all of that, a limit of 1 still refuses the second call.
    for key in keys.iter().filter(|k| **k != "shared") {
        let value = if *key == "pattern" {
            b"caf-after".as_slice()
        } else {
            b"after"
        };
        counted_once(&mut c, key, value).await;
    }
}

/// A request of `held` `tenant` naming the hold `id`: with `release`, its stream done (a
/// refund of one, Envoy's `is_negative_hits`).
fn hold(tenant: &[u8], id: &[u8], release: bool) -> RawRequest {
    let mut req = raw("values", "held", tenant);
    req.descriptors[0].entries.push(RawEntry {
        key: b"request_id".to_vec(),
        value: id.to_vec(),
    });
    if release {
        req.descriptors[0].hits_addend = Some(UInt64Value { value: 1 });
        req.descriptors[0].is_negative_hits = true;
    }
    req
}

/// `id`, its last byte changed (to another a header may carry).
fn last_changed(id: &[u8]) -> Vec<u8> {
    let mut other = id.to_vec();
    let last = other.last_mut().unwrap();
    *last = if *last == b'a' { b'b' } else { b'a' };
    other
}

/// A hold's id is a header value too (Envoy sends `x-request-id`, which a client chooses where
/// it is kept): any bytes, any length. Each id holds its tenant's one place and only a release
/// naming that id, byte for byte, frees it: ids that differ in their last byte of 60 KiB, or
/// are not UTF-8, are never one hold, and no release, hits or refund on them fails a call.
async fn any_hold_id_a_client_can_send_holds_and_releases_exactly(kind: Kind) {
    let (_s, mut c) = server(kind).await;
    let long: Vec<u8> = (0..60 << 10).map(|i| b'a' + (i % 26) as u8).collect();
    let mut first_changed = long.clone();
    first_changed[0] = 0xff;
    let mut ids: Vec<Vec<u8>> = NOT_UTF8.iter().map(|v| v.to_vec()).collect();
    ids.extend([long.clone(), first_changed, vec![0xe9; 64], vec![0xe9; 65]]);
    let mut rng = Rng(0x5eed_0059);
    ids.extend((0..40).map(|_| rng.value()));
    for (i, id) in ids.iter().enumerate() {
        let tenant = format!("t{i}").into_bytes();
        let other = last_changed(id);
        let show = String::from_utf8_lossy(&id[..id.len().min(16)]).into_owned();
        let step = |what: &str| format!("{kind:?}: id {i} ({} bytes, {show:?}): {what}", id.len());
        assert_eq!(
            code(&mut c, hold(&tenant, id, false)).await,
            Code::Ok,
            "{}",
            step("takes the place")
        );
        assert_eq!(
            code(&mut c, hold(&tenant, id, false)).await,
            Code::OverLimit,
            "{}",
            step("replayed while held")
        );
        // The refused replay's own release is owed to the hold: it frees nothing.
        decided(&mut c, hold(&tenant, id, true)).await;
        assert_eq!(
            code(&mut c, hold(&tenant, &other, false)).await,
            Code::OverLimit,
            "{}",
            step("a second id")
        );
        // A release naming another id, however close, frees nothing.
        decided(&mut c, hold(&tenant, &other, true)).await;
        assert_eq!(
            code(&mut c, hold(&tenant, &other, false)).await,
            Code::OverLimit,
            "{}",
            step("after another's release")
        );
        decided(&mut c, hold(&tenant, id, true)).await;
        assert_eq!(
            code(&mut c, hold(&tenant, &other, false)).await,
            Code::Ok,
            "{}",
            step("after its own release")
        );
        // Whatever hits or refund a client puts beside the id, the call is decided.
        let mut req = hold(&tenant, id, rng.below(2) == 0);
        req.descriptors[0].hits_addend = rng.hits().map(|value| UInt64Value { value });
        req.hits_addend = rng.next() as u32;
        decided(&mut c, req).await;
    }
    // The long id's hold is the long id's alone: its tenant's place, held by the id that differs
    // in its last byte, is not freed by a release naming the long id.
    let at = NOT_UTF8.len();
    let tenant = format!("t{at}").into_bytes();
    decided(&mut c, hold(&tenant, &long, true)).await;
    assert_eq!(
        code(&mut c, hold(&tenant, &long, false)).await,
        Code::OverLimit,
        "{kind:?}: the place is still held by the other id"
    );
}

/// A value that is not UTF-8 is shown escaped (`\xHH` for such a byte, `\\` for a
/// backslash), marked so where the output has room, and the admin API names it back; a UTF-8
/// value is shown as it is, backslashes and all.
async fn values_that_are_not_utf8_are_shown_escaped(kind: Kind) {
    use ratelimitd::admin::admin_client::AdminClient;
    use ratelimitd::admin::{CounterRequest, Entry};
    let s = start(
        kind,
        &[("limits.yaml", LIMITS)],
        &["--top-capacity", "8", "--top-metrics", "4", "--admin"],
    )
    .await;
    s.client().await;
    let mut c = RawClient::connect(s.grpc).await;
    counted_once(&mut c, "detailed", b"caf\xe9\\").await;
    counted_once(&mut c, "detailed", b"a\\b").await;
    let (status, metrics) = s.http_get("/metrics").await;
    assert_eq!(status, 200);
    // OpenMetrics escapes a backslash in a label value as `\\`.
    for label in [r#"rule="detailed_caf\\xe9\\\\""#, r#"rule="detailed_a\\b""#] {
        assert!(metrics.contains(label), "{label}: {metrics}");
    }
    let top = poll(Duration::from_secs(10), || async {
        let (_, body) = s.http_get("/top?domain=values").await;
        let top: serde_json::Value = serde_json::from_str(&body).expect("/top is JSON");
        (top["limits"][0]["descriptors"].as_array()?.len() == 2).then_some(top)
    })
    .await;
    let mut shown: Vec<(String, bool)> = top["limits"][0]["descriptors"]
        .as_array()
        .unwrap()
        .iter()
        .map(|d| {
            let e = &d["entries"][0];
            (
                e["value"].as_str().unwrap().to_owned(),
                e["escaped"] == true,
            )
        })
        .collect();
    shown.sort();
    assert_eq!(
        shown,
        [(r"a\b".to_owned(), false), (r"caf\xe9\\".to_owned(), true)]
    );
    let mut admin = AdminClient::connect(format!("http://{}", s.grpc))
        .await
        .unwrap();
    let used = |value: &str, escaped: bool| CounterRequest {
        domain: "values".into(),
        entries: vec![Entry {
            key: "detailed".into(),
            value: value.into(),
            escaped,
        }],
    };
    for (value, escaped, want) in [(r"caf\xe9\\", true, 1), (r"caf\xe9\\", false, 0)] {
        let counters = admin.get_counters(used(value, escaped)).await.unwrap();
        assert_eq!(
            counters.into_inner().counters[0].used,
            want,
            "{value} {escaped}"
        );
    }
}

const FIVE: &str = r#"
domain: five
descriptors:
  - key: fixed_window
    rate_limit: {unit: hour, requests_per_unit: 5}
  - key: sliding_window
    rate_limit: {unit: hour, requests_per_unit: 5, algorithm: sliding_window}
  - key: sliding_log
    rate_limit: {unit: hour, requests_per_unit: 5, algorithm: sliding_log}
  - key: token_bucket
    rate_limit: {unit: hour, requests_per_unit: 5, algorithm: token_bucket}
"#;

/// A refund of any amount gives back what was taken and no more; an admission or report of
/// any amount is decided as the memory backend's exact integers decide it. Redis' script
/// counts in doubles, where `2^54 - 1 == 2^54`: a log refund of 2^54 once emptied the log and
/// kept its total, refusing everything for a window.
async fn amounts_past_2_pow_53_are_decided_exactly(kind: Kind) {
    let s = start(kind, &[("limits.yaml", FIVE)], &[]).await;
    s.client().await;
    let mut c = RawClient::connect(s.grpc).await;
    let with = |key: &str, value: &[u8], hits: u64, refund: bool| {
        let mut req = raw("five", key, value);
        req.descriptors[0].hits_addend = Some(UInt64Value { value: hits });
        req.descriptors[0].is_negative_hits = refund;
        req
    };
    let amounts = [(1u64 << 53) + 1, 1 << 54, u64::MAX];
    for key in [
        "fixed_window",
        "sliding_window",
        "sliding_log",
        "token_bucket",
    ] {
        for (n, amount) in amounts.into_iter().enumerate() {
            let value = format!("refund-{n}");
            let one = || with(key, value.as_bytes(), 1, false);
            for _ in 0..5 {
                assert_eq!(code(&mut c, one()).await, Code::Ok, "{key}");
            }
            assert_eq!(code(&mut c, one()).await, Code::OverLimit, "{key}");
            decided(&mut c, with(key, value.as_bytes(), amount, true)).await;
            for i in 0..5 {
                assert_eq!(
                    code(&mut c, one()).await,
                    Code::Ok,
                    "{key}: admission {i} after a refund of {amount}"
                );
            }
            assert_eq!(code(&mut c, one()).await, Code::OverLimit, "{key}");

            // An admission of the amount is refused and takes nothing.
            let value = format!("admit-{n}");
            let mut big = with(key, value.as_bytes(), amount, false);
            big.descriptors[0].hits_addend = None;
            big.hits_addend = u32::MAX;
            assert_eq!(code(&mut c, big).await, Code::OverLimit, "{key}");
            let mut req = raw("five", key, value.as_bytes());
            req.descriptors[0].hits_addend = Some(UInt64Value { value: amount });
            // A descriptor's own hits past 0 are a cost report: recorded, at most the debt.
            decided(&mut c, req).await;
            assert_eq!(
                code(&mut c, with(key, value.as_bytes(), 1, false)).await,
                Code::OverLimit,
                "{key}: a report of {amount} leaves the limit over"
            );
            decided(&mut c, with(key, value.as_bytes(), amount, true)).await;
            assert_eq!(
                code(&mut c, with(key, value.as_bytes(), 5, false)).await,
                Code::Ok,
                "{key}: a refund of {amount} after a report of as much empties it"
            );
        }
    }
}

every_backend!(
    values_that_are_not_utf8_are_decided_as_their_bytes,
    long_values_are_decided_each_under_its_own_digest,
    any_value_hits_and_refund_a_client_can_send_gets_a_decision,
    values_that_are_not_utf8_are_shown_escaped,
    amounts_past_2_pow_53_are_decided_exactly,
    any_hold_id_a_client_can_send_holds_and_releases_exactly,
);

/// A long value is kept as its digest: 2,000 distinct values of 60 KiB, each decided and
/// counted, leave the memory backend's process at most 32 MiB larger.
#[tokio::test]
async fn long_values_keep_the_memory_backend_small() {
    let (d, _dir) = common::daemon::quiet(LIMITS, &[]).await;
    let addr = format!("127.0.0.1:{}", d.grpc).parse().unwrap();
    let mut c = RawClient::connect(addr).await;
    let value = |i: u32| {
        let mut v = vec![b'k'; 60 << 10];
        v[..4].copy_from_slice(&i.to_be_bytes());
        v
    };
    // The allocator and the connection's buffers come to their working size first.
    for i in 0..200 {
        assert_eq!(
            code(&mut c, raw("values", "token_bucket", &value(i))).await,
            Code::Ok
        );
    }
    let before = d.rss();
    for i in 200..2_200 {
        assert_eq!(
            code(&mut c, raw("values", "token_bucket", &value(i))).await,
            Code::Ok
        );
    }
    let grown = d.rss().saturating_sub(before);
    eprintln!(
        "2,000 values of 60 KiB: resident memory grew by {} KiB",
        grown >> 10
    );
    assert!(grown <= 32 << 20, "grew by {grown} bytes");
    // Each is counted: the first is refused now. (A token bucket, whose refusal lasts, not
    // a calendar window, which the loop may cross.)
    assert_eq!(
        code(&mut c, raw("values", "token_bucket", &value(0))).await,
        Code::OverLimit
    );
}

/// RLQS bucket ids are built from request headers too. A report with a bucket whose id is
/// not UTF-8 (which Envoy could not read back in an answer) skips that bucket alone: the
/// report's other buckets, a long value's among them, are answered and the stream goes on.
#[tokio::test]
async fn a_quota_report_with_a_bucket_id_that_is_not_utf8_goes_on() {
    use common::raw::{RawReports, raw_rlqs, raw_usage};
    let s = start(
        Kind::Memory,
        &[("q.yaml", "domain: q\ndescriptors:\n  - key: user\n    rate_limit: {unit: minute, requests_per_unit: 100}\n")],
        &[],
    )
    .await;
    s.client().await;
    let (tx, mut answers) = raw_rlqs(s.grpc).await;
    let long = vec![b'x'; 60 << 10];
    let report = |domain: &str, values: &[&[u8]]| RawReports {
        domain: domain.into(),
        bucket_quota_usages: values.iter().map(|v| raw_usage("user", v)).collect(),
    };
    // Each answered bucket's value, and whether it was assigned a token bucket (its limit).
    type Answered = std::collections::HashMap<Vec<u8>, bool>;
    let mut answered = Answered::new();
    let mut wait_for = async |want: &[u8], answered: &mut Answered| {
        use envoy_types::pb::envoy::r#type::v3::rate_limit_strategy::Strategy;
        use envoy_types::pb::envoy::service::rate_limit_quota::v3::rate_limit_quota_response::bucket_action::BucketAction;
        tokio::time::timeout(Duration::from_secs(30), async {
            while !answered.contains_key(want) {
                let r = answers
                    .message()
                    .await
                    .expect("the stream goes on")
                    .expect("open");
                for a in r.bucket_action {
                    let id = a.bucket_id.expect("an id");
                    let bucket = matches!(
                        a.bucket_action,
                        Some(BucketAction::QuotaAssignmentAction(q))
                            if matches!(q.rate_limit_strategy.and_then(|s| s.strategy),
                                Some(Strategy::TokenBucket(_)))
                    );
                    answered.insert(id.bucket["user"].as_bytes().to_vec(), bucket);
                }
            }
        })
        .await
        .expect("answered in time");
    };
    tx.send(report("q", &[b"ok", b"caf\xe9", &long]))
        .await
        .unwrap();
    wait_for(b"ok", &mut answered).await;
    wait_for(&long, &mut answered).await;
    tx.send(report("", &[b"\xff", b"ok2"])).await.unwrap();
    wait_for(b"ok2", &mut answered).await;
    // A bucket id is a map: a key sent twice keeps its last value, as Envoy's decoders read it.
    let mut twice = raw_usage("user", b"first");
    twice
        .bucket_id
        .as_mut()
        .unwrap()
        .bucket
        .push(common::raw::RawEntry {
            key: b"user".to_vec(),
            value: b"last".to_vec(),
        });
    tx.send(RawReports {
        domain: Vec::new(),
        bucket_quota_usages: vec![twice],
    })
    .await
    .unwrap();
    wait_for(b"last", &mut answered).await;
    assert_eq!(
        answered.len(),
        4,
        "only UTF-8 ids are answered, a map's last value"
    );
    for v in [&b"ok"[..], b"ok2", &long, b"last"] {
        assert!(answered[v], "assigned its limit's token bucket");
    }
    let (_, metrics) = s.http_get("/metrics").await;
    assert_eq!(
        metric(
            &metrics,
            r#"ratelimit_rlqs_skipped_entries_total{kind="not_utf8"}"#
        ),
        2.0
    );
}
