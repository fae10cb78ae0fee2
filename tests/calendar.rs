//! Calendar windows (`calendar: <IANA zone>` on a limit, `--calendar-timezone`): windows that
//! start at the local hour, midnight, Monday, the 1st or January 1st of a zone, in zones with
//! half- and quarter-hour offsets and across daylight-saving changes, on both backends with the
//! clock stepped: the service's own clock on memory; on Redis the store's clock (a real
//! `redis-server` whose wall clock the test sets), while the service's clock is months wrong.
//! Bad zones and combinations are refused naming the file, line, field and zone.

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::daemon::ratelimitd;
use common::redis::*;
use common::*;
use ratelimitd::testing::{Clock, ManualClock, SystemClock, compile_file};

const SEC: u64 = 1_000_000;
const H: u64 = 3_600 * SEC;

/// µs of an RFC 3339 instant.
fn at(s: &str) -> u64 {
    s.parse::<jiff::Timestamp>().unwrap().as_microsecond() as u64
}

const CONFIG: &str = "domain: cal
descriptors:
  - key: berlin
    rate_limit: {unit: day, requests_per_unit: 2, calendar: Europe/Berlin}
  - key: kolkata
    rate_limit: {unit: hour, requests_per_unit: 2, calendar: Asia/Kolkata}
  - key: kathmandu
    rate_limit: {unit: hour, requests_per_unit: 2, calendar: Asia/Kathmandu}
  - key: newyork
    rate_limit: {unit: month, requests_per_unit: 2, calendar: America/New_York}
  - key: quarter
    rate_limit: {unit: month, unit_multiplier: 3, requests_per_unit: 2, calendar: America/New_York}
  - key: epoch
    rate_limit: {unit: month, requests_per_unit: 2}
  - key: metadata
    metadata: {ratelimitd: {calendar: Asia/Kolkata}}
    rate_limit: {unit: day, requests_per_unit: 2}
";

/// (descriptor, an instant one of its windows ends at, that window's length), in time order
/// (the memory backend's clock never runs backwards): a 23-hour day in Berlin (clocks forward
/// on 2026-03-29), an hour at +05:45 and at +05:30, a day in Kolkata set through
/// `metadata.ratelimitd`, the third quarter in New York, and November there (from midnight EDT
/// to midnight EST: 30 days and an hour).
const WINDOWS: [(&str, &str, u64); 6] = [
    ("berlin", "2026-03-29T22:00:00Z", 23 * H),
    ("kathmandu", "2026-06-01T05:15:00Z", H),
    ("kolkata", "2026-06-02T05:30:00Z", H),
    ("metadata", "2026-06-03T18:30:00Z", 24 * H),
    ("quarter", "2026-10-01T04:00:00Z", 92 * 24 * H),
    ("newyork", "2026-12-01T05:00:00Z", 30 * 24 * H + H),
];

/// How long before a window's end the test takes the rest of it.
const LEAD: u64 = 30 * SEC;

fn near(got: Duration, want_us: u64, slack: Duration, what: &str) {
    let want = Duration::from_micros(want_us);
    assert!(
        got <= want && got + slack >= want,
        "{what}: reset {got:?}, want {want:?} (less at most {slack:?})"
    );
}

/// For each window: at its start the reset is its whole length (a 23-hour day is 23 hours);
/// LEAD before its end the rest of it is taken and the next request refused until exactly the
/// end; past the end a new window starts. The epoch-aligned month beside them keeps the
/// reference's meaning (30 days from 1970-01-01).
async fn windows_start_and_end_at_the_local_calendar(server: &TestServer, clock: &Stepped) {
    let mut c = server.client().await;
    let slack = clock.slack();
    for (key, end, length) in WINDOWS {
        let end = at(end);
        let req = request("cal", &[&[(key, "tenant")]]);
        let what = |step: &str| format!("{key}: {step}");

        clock.set(end - length + 10 * SEC);
        let r = call(&mut c, req.clone()).await;
        assert!(is_ok(&r), "{}: {r:?}", what("start"));
        assert_eq!(r.statuses[0].limit_remaining, 1, "{}", what("start"));
        near(reset_of(&r, 0), length - 10 * SEC, slack, &what("start"));

        clock.set(end - LEAD);
        let r = call(&mut c, req.clone()).await;
        assert!(is_ok(&r), "{}: {r:?}", what("the second"));
        assert_eq!(r.statuses[0].limit_remaining, 0, "{}", what("the second"));
        let r = call(&mut c, req.clone()).await;
        assert!(is_over(&r), "{}: {r:?}", what("the third"));
        near(reset_of(&r, 0), LEAD, slack, &what("the third"));

        clock.set(end + SEC);
        let r = call(&mut c, req.clone()).await;
        assert!(is_ok(&r), "{}: {r:?}", what("the next window"));
        assert_eq!(
            r.statuses[0].limit_remaining,
            1,
            "{}",
            what("the next window")
        );
        near(
            reset_of(&r, 0),
            next_length(key, end) - SEC,
            slack,
            &what("next"),
        );
    }
    // The reference's month: 30 days from the epoch, whatever the zone.
    let now = at("2026-12-15T00:00:00Z");
    clock.set(now);
    let r = call(&mut c, request("cal", &[&[("epoch", "tenant")]])).await;
    let month = 30 * 24 * H;
    near(reset_of(&r, 0), month - now % month, slack, "epoch month");
}

/// The length of `key`'s window that starts at `start`.
fn next_length(key: &str, start: u64) -> u64 {
    match key {
        "berlin" | "metadata" => 24 * H,
        "kolkata" | "kathmandu" => H,
        // December in New York: 31 days; its fourth quarter: 92 days and the hour the
        // clocks go back on 2026-11-01.
        "newyork" => 31 * 24 * H,
        "quarter" => {
            assert_eq!(start, at("2026-10-01T04:00:00Z"));
            92 * 24 * H + H
        }
        _ => unreachable!("{key}"),
    }
}

/// On memory the service's clock is stepped; on Redis the window comes from Redis' own clock,
/// set by the test, while the service's clock is months behind and never moves: its answers
/// are those of Redis' time.
#[tokio::test]
async fn windows_follow_the_calendar_of_the_clock_that_decides() {
    let (servers, _redis) = stepped_servers(
        &[("cal.yaml", CONFIG)],
        at("2026-01-01T00:00:00Z"),
        at("2025-10-01T00:00:00Z"),
    )
    .await;
    for (name, server, clock) in &servers {
        eprintln!("{name}");
        windows_start_and_end_at_the_local_calendar(server, clock).await;
    }
    let server = &servers[1].1;
    // Every answer on Redis was decided, none by the failure mode; Redis' clock jumping by
    // months made the first call after each jump ask again, as the script says.
    let (_, metrics) = server.http_get("/metrics").await;
    assert_eq!(
        metric(&metrics, "ratelimit_backend_errors_total{kind=\"clock\"}"),
        0.0,
        "{metrics}"
    );
    assert_eq!(
        metric(
            &metrics,
            "ratelimit_failure_mode_decisions_total{mode=\"error\"}"
        ),
        0.0
    );
}

/// Today's calendar windows on every backend (memory, Redis, Cluster with either hash tag), at
/// the real time: the reset is the time to the local boundary computed here independently.
async fn a_calendar_window_ends_at_the_local_boundary(kind: Kind) {
    let config = "domain: today
descriptors:
  - key: day
    rate_limit: {unit: day, requests_per_unit: 3, calendar: Asia/Kathmandu}
  - key: year
    rate_limit: {unit: year, requests_per_unit: 2, calendar: Pacific/Chatham}
";
    let s = start(kind, &[("today.yaml", config)], &[]).await;
    let mut c = s.client().await;
    for (key, zone, n) in [("day", "Asia/Kathmandu", 3), ("year", "Pacific/Chatham", 2)] {
        let req = request("today", &[&[(key, "v")]]);
        let before = SystemClock.now_us();
        let r = call(&mut c, req.clone()).await;
        let after = SystemClock.now_us();
        assert!(is_ok(&r), "{kind:?} {key}: {r:?}");
        let local = jiff::Timestamp::from_microsecond(before as i64)
            .unwrap()
            .in_tz(zone)
            .unwrap();
        let next = match key {
            "day" => local.tomorrow().unwrap().start_of_day().unwrap(),
            _ => local
                .date()
                .first_of_year()
                .checked_add(jiff::Span::new().years(1))
                .unwrap()
                .in_tz(zone)
                .unwrap(),
        };
        let end = next.timestamp().as_microsecond() as u64;
        let reset = reset_of(&r, 0);
        // Whole seconds, rounded up.
        assert!(
            reset < Duration::from_micros(end - before) + Duration::from_secs(1)
                && reset >= Duration::from_micros(end - after)
                && reset.subsec_nanos() == 0,
            "{kind:?} {key}: reset {reset:?}, the local boundary is {next}"
        );
        admits_exactly(&mut c, &req, n - 1).await;
    }
}

every_backend!(a_calendar_window_ends_at_the_local_boundary);

fn refused(yaml: &str) -> String {
    let err =
        compile_file(std::path::Path::new("/etc/limits/budgets.yaml"), yaml).expect_err("refused");
    err.to_string()
}

/// Each refusal names the file, the line, the field and the zone as written.
#[test]
fn bad_zones_and_combinations_are_refused_naming_where() {
    let cases = [
        (
            "rate_limit: {unit: day, requests_per_unit: 1, calendar: Europe/Berln}",
            "descriptors[0].rate_limit.calendar",
            "unknown time zone 'Europe/Berln'",
        ),
        (
            "rate_limit: {unit: minute, requests_per_unit: 1, calendar: UTC}",
            "descriptors[0].rate_limit.calendar",
            "calendar 'UTC' means nothing for unit minute",
        ),
        (
            "rate_limit: {unit: second, requests_per_unit: 1, calendar: Asia/Kolkata}",
            "descriptors[0].rate_limit.calendar",
            "calendar 'Asia/Kolkata' means nothing for unit second",
        ),
        (
            "rate_limit: {unit: day, requests_per_unit: 1, calendar: Asia/Tokyo, algorithm: sliding_window}",
            "descriptors[0].rate_limit.calendar",
            "calendar 'Asia/Tokyo' applies only to algorithm: fixed_window",
        ),
        (
            "rate_limit: {unit: month, requests_per_unit: 1, calendar: Asia/Tokyo, algorithm: token_bucket}",
            "descriptors[0].rate_limit.calendar",
            "applies only to algorithm: fixed_window (token_bucket",
        ),
        (
            "rate_limit: {unit: hour, unit_multiplier: 5, requests_per_unit: 1, calendar: UTC}",
            "descriptors[0].rate_limit.unit_multiplier",
            "must be one of 1, 2, 3, 4, 6, 8, 12, 24",
        ),
        (
            "rate_limit: {unit: day, unit_multiplier: 7, requests_per_unit: 1, calendar: UTC}",
            "descriptors[0].rate_limit.unit_multiplier",
            "a day takes no unit_multiplier",
        ),
        (
            "metadata: {ratelimitd: {calendar: Mars/Olympus_Mons}}\n    rate_limit: {unit: day, requests_per_unit: 1}",
            "descriptors[0].metadata.ratelimitd.calendar",
            "unknown time zone 'Mars/Olympus_Mons'",
        ),
    ];
    for (limit, field, words) in cases {
        let yaml = format!("domain: d\ndescriptors:\n  - key: k\n    {limit}\n");
        let err = refused(&yaml);
        // metadata is kept as data, without lines of its own: its errors name the descriptor's.
        let line = if limit.starts_with("metadata") { 3 } else { 4 };
        assert!(
            err.contains(&format!("/etc/limits/budgets.yaml:{line}:"))
                && err.contains(field)
                && err.contains(words),
            "{limit}\n=> {err}"
        );
    }
}

/// `--check` refuses the same, and `--calendar-timezone` refuses an unknown zone at start;
/// `--version` names the time-zone data built in.
#[test]
fn check_and_the_flag_refuse_unknown_zones_and_version_names_the_data() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(
        dir.path().join("b.yaml"),
        "domain: d\ndescriptors:\n  - key: k\n    rate_limit: {unit: month, requests_per_unit: 1, calendar: europe/paris}\n  - key: j\n    rate_limit: {unit: month, requests_per_unit: 1, calendar: Europe/Pariss}\n",
    )
    .unwrap();
    let out = ratelimitd(dir.path(), &["--check"]).output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        stderr.contains("b.yaml:6")
            && stderr.contains("descriptors[1].rate_limit.calendar")
            && stderr.contains("unknown time zone 'Europe/Pariss'"),
        "{stderr}"
    );
    let out = ratelimitd(
        dir.path(),
        &["--check", "--calendar-timezone", "Nowhere/Atall"],
    )
    .output()
    .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        stderr.contains("unknown time zone 'Nowhere/Atall'"),
        "{stderr}"
    );
    let out = ratelimitd("", &["--version"]).output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success());
    let data = stdout.split("(tzdb ").nth(1).expect("names the data");
    assert!(data.starts_with("20"), "{stdout}");
}

/// `--calendar-timezone` (also RATELIMITD_CALENDAR_TIMEZONE) makes fixed windows of an hour or
/// longer that name no zone calendar windows in it; a limit naming its own zone keeps it;
/// minutes, other algorithms and multipliers that do not tile are left as they are.
#[tokio::test]
async fn the_server_wide_zone_applies_where_it_can_and_leaves_the_rest() {
    let config = "domain: d
descriptors:
  - key: day
    rate_limit: {unit: day, requests_per_unit: 5}
  - key: own
    rate_limit: {unit: day, requests_per_unit: 5, calendar: UTC}
  - key: minute
    rate_limit: {unit: minute, requests_per_unit: 5}
  - key: sliding
    rate_limit: {unit: day, requests_per_unit: 5, algorithm: sliding_window}
  - key: two_days
    rate_limit: {unit: day, unit_multiplier: 2, requests_per_unit: 5}
";
    // 2026-06-01 12:00 UTC is 17:30 in Kolkata: 6 h 30 min to its midnight, 12 h to UTC's.
    let now = at("2026-06-01T12:00:00Z");
    let clock = ManualClock::new(now);
    let s = TestServer::start_with_env(
        &[("d.yaml", config)],
        &[],
        &[("RATELIMITD_CALENDAR_TIMEZONE", "Asia/Kolkata")],
    )
    .await;
    // The environment reached the rules: /rlconfig shows which limits took the zone.
    let (_, rules) = s.http_get("/rlconfig").await;
    let rule = |key: &str| rule_line(&rules, "d", key);
    assert!(rule("day").contains("calendar=Asia/Kolkata"), "{rules}");
    assert!(rule("own").contains("calendar=UTC"), "{rules}");
    for key in ["minute", "sliding", "two_days"] {
        assert!(!rule(key).contains("calendar"), "{rules}");
    }
    drop(s);

    let s = TestServer::start_with(
        &[("d.yaml", config)],
        &["--calendar-timezone", "Asia/Kolkata"],
        Arc::new(clock.clone()),
    )
    .await;
    let mut c = s.client().await;
    let reset = |r: &_| reset_of(r, 0);
    let r = call(&mut c, request("d", &[&[("day", "v")]])).await;
    assert_eq!(reset(&r), Duration::from_secs(6 * 3_600 + 1_800));
    let r = call(&mut c, request("d", &[&[("own", "v")]])).await;
    assert_eq!(reset(&r), Duration::from_secs(12 * 3_600));
    let r = call(&mut c, request("d", &[&[("two_days", "v")]])).await;
    let two_days = 2 * 24 * H;
    assert_eq!(reset(&r), Duration::from_micros(two_days - now % two_days));
    let r = call(&mut c, request("d", &[&[("minute", "v")]])).await;
    assert_eq!(reset(&r), Duration::from_secs(60));
}

/// Calendar windows are computed up to 9999-12-30T22:00Z, where the time-zone database's civil
/// times end: the window holding that end is cut there, and after it one window runs on. A
/// limit refuses past its count on both sides of it, and announces a reset no later than the
/// cut within the range. (A week there once lasted one microsecond, admitting without bound.)
#[tokio::test]
async fn the_last_calendar_windows_of_year_9999_still_refuse() {
    let config = "domain: far
descriptors:
  - key: week
    rate_limit: {unit: week, requests_per_unit: 3, calendar: UTC}
  - key: kiritimati_week
    rate_limit: {unit: week, requests_per_unit: 3, calendar: Pacific/Kiritimati}
  - key: month
    rate_limit: {unit: month, requests_per_unit: 3, calendar: Europe/Berlin}
  - key: year
    rate_limit: {unit: year, requests_per_unit: 3, calendar: America/New_York}
  - key: day
    rate_limit: {unit: day, requests_per_unit: 3, calendar: Asia/Tokyo}
";
    let clock = ManualClock::new(at("9999-12-29T12:00:00Z"));
    let s = TestServer::start_with(&[("far.yaml", config)], &[], Arc::new(clock.clone())).await;
    let mut c = s.client().await;
    let cut = at("9999-12-30T22:00:00Z") + 999_999;
    for (now, what) in [
        (at("9999-12-29T12:00:00Z"), "within the range"),
        (cut + 14 * H, "past its end"),
    ] {
        clock.set(now);
        for key in ["week", "kiritimati_week", "month", "year", "day"] {
            let req = request("far", &[&[(key, what)]]);
            // A second between calls: time moves on within the window, as it does.
            for i in 0..3 {
                clock.advance(Duration::from_secs(1));
                let r = call(&mut c, req.clone()).await;
                assert!(is_ok(&r), "{key} {what}: call {i} refused: {r:?}");
            }
            clock.advance(Duration::from_secs(1));
            let r = call(&mut c, req.clone()).await;
            assert!(is_over(&r), "{key} {what}: a fourth admitted: {r:?}");
            if now < cut {
                let reset = reset_of(&r, 0);
                assert!(
                    reset <= Duration::from_micros(cut - now) && reset > Duration::from_secs(60),
                    "{key}: reset {reset:?}"
                );
            }
            clock.set(now);
        }
    }
}
