//! The statsd sink (`--statsd-addr`, envoyproxy/ratelimit's `USE_STATSD`) against real collector
//! sockets: the names and tags that service sends, over UDP and TCP, and a collector that is
//! away or never reads, which must not slow a decision, lose what it missed (TCP) or make the
//! process grow.

mod common;

use std::collections::HashMap;
use std::time::Duration;

use common::daemon::Daemon;
use common::*;
use tokio::io::AsyncReadExt;
use tokio::net::{TcpListener, UdpSocket};

const LIMITS: &str = "domain: d\ndescriptors:\n  - key: k\n    value: v\n    rate_limit: {unit: hour, requests_per_unit: 2}\n  - key: ip\n    detailed_metric: true\n    rate_limit: {unit: hour, requests_per_unit: 1000000}\n";

async fn daemon(flags: &[&str]) -> (Daemon, tempfile::TempDir) {
    common::daemon::quiet(LIMITS, flags).await
}

/// Adds every line of `text` to `totals`: a counter's delta (`name:delta|c…`), or how many
/// samples a timer line stands for (`name:ms|ms|@rate…`), as statsd_exporter counts them
/// (`1/rate`, truncated).
fn add_lines(totals: &mut HashMap<String, u64>, text: &str) {
    for line in text.lines() {
        // A DogStatsD line has its tags last: name:delta|c|#k:v, name:ms|ms|@rate|#k:v.
        let head = line.split_once("|#").map_or(line, |(head, _)| head);
        let (name, rest) = head
            .rsplit_once(':')
            .unwrap_or_else(|| panic!("not a stat: {line}"));
        let n = if let Some(delta) = rest.strip_suffix("|c") {
            delta.parse::<u64>().unwrap()
        } else {
            let mut parts = rest.split('|');
            let ms: f64 = parts.next().unwrap().parse().unwrap();
            assert_eq!(parts.next(), Some("ms"), "{line}");
            assert!((0.0..=1000.0).contains(&ms), "{line}");
            match parts.next() {
                None => 1,
                Some(rate) => {
                    let rate: f64 = rate.strip_prefix('@').unwrap().parse().unwrap();
                    (1.0 / rate) as u64
                }
            }
        };
        *totals.entry(name.to_owned()).or_default() += n;
    }
}

/// Three requests on the limit of 2 and one on a detailed IP rule; what that service would
/// count for them.
async fn traffic(d: &Daemon) {
    let mut c = d.client().await;
    for _ in 0..3 {
        call(&mut c, request("d", &[&[("k", "v")]])).await;
    }
    assert!(is_ok(
        &call(&mut c, request("d", &[&[("ip", "10.1.2.3")]])).await
    ));
}

fn expected(tags: &str) -> Vec<(String, u64)> {
    [
        ("ratelimit.service.rate_limit.d.k_v.total_hits", 3),
        ("ratelimit.service.rate_limit.d.k_v.within_limit", 2),
        ("ratelimit.service.rate_limit.d.k_v.near_limit", 1),
        ("ratelimit.service.rate_limit.d.k_v.over_limit", 1),
        // The IP's dots are cleaned, as that service cleans them.
        ("ratelimit.service.rate_limit.d.ip_10_1_2_3.total_hits", 1),
        ("ratelimit.service.config_load_success", 1),
        ("ratelimit_server.ShouldRateLimit.total_requests", 4),
        ("ratelimit_server.ShouldRateLimit.response_time", 4),
    ]
    .into_iter()
    .map(|(name, n)| (format!("{name}{tags}"), n))
    .collect()
}

fn all_there(totals: &HashMap<String, u64>, want: &[(String, u64)]) -> bool {
    want.iter()
        .all(|(name, n)| totals.get(name).copied().unwrap_or(0) >= *n)
}

/// Over UDP (`USE_DOG_STATSD`'s way), with DogStatsD tags: the counts that service sends,
/// exactly, however the flushes cut them.
#[tokio::test]
async fn dogstatsd_over_udp_gets_the_counts_that_service_sends() {
    let collector = UdpSocket::bind("127.0.0.1:0").await.unwrap();
    let addr = collector.local_addr().unwrap().to_string();
    let (d, _dir) = daemon(&[
        "--statsd-addr",
        &addr,
        "--statsd-protocol",
        "udp",
        "--statsd-format",
        "dogstatsd",
        "--statsd-tags",
        "team:edge,env:prod",
        "--statsd-flush-interval",
        "100ms",
    ])
    .await;
    traffic(&d).await;
    let want = expected("");
    let mut totals = HashMap::new();
    let mut buf = vec![0u8; 65536];
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while !all_there(&totals, &want) {
        let n = tokio::time::timeout_at(deadline, collector.recv(&mut buf))
            .await
            .unwrap_or_else(|_| panic!("not all counted: {totals:?}"))
            .unwrap();
        assert!(n <= 1432, "a datagram fits a common MTU: {n}");
        let text = std::str::from_utf8(&buf[..n]).unwrap();
        for line in text.lines() {
            assert!(
                line.ends_with("|c|#env:prod,team:edge")
                    || line.contains("|ms") && line.ends_with("|#env:prod,team:edge"),
                "{line}"
            );
        }
        add_lines(&mut totals, text);
    }
    // One flush more: nothing counted twice.
    tokio::time::sleep(Duration::from_millis(300)).await;
    while let Ok(Ok(n)) =
        tokio::time::timeout(Duration::from_millis(50), collector.recv(&mut buf)).await
    {
        add_lines(&mut totals, std::str::from_utf8(&buf[..n]).unwrap());
    }
    for (name, n) in &want {
        assert_eq!(totals.get(name), Some(n), "{name} in {totals:?}");
    }
}

/// Reads a TCP collector's connections into `totals` until `want` is all there.
async fn collect_tcp(listener: &TcpListener, want: &[(String, u64)]) -> HashMap<String, u64> {
    let mut totals = HashMap::new();
    let mut pending = String::new();
    let (mut conn, _) = tokio::time::timeout(Duration::from_secs(10), listener.accept())
        .await
        .expect("the sink connects")
        .unwrap();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    let mut buf = vec![0u8; 65536];
    while !all_there(&totals, want) {
        let n = tokio::time::timeout_at(deadline, conn.read(&mut buf))
            .await
            .unwrap_or_else(|_| panic!("not all counted: {totals:?}"))
            .unwrap();
        assert!(n > 0, "closed: {totals:?}");
        pending.push_str(std::str::from_utf8(&buf[..n]).unwrap());
        if let Some(end) = pending.rfind('\n') {
            add_lines(&mut totals, &pending[..=end]);
            pending.drain(..=end);
        }
    }
    totals
}

/// envoyproxy/ratelimit's default: TCP, tags in the name. A collector that is away at first
/// misses nothing: the first flush that gets through carries everything since.
#[tokio::test]
async fn statsd_over_tcp_carries_what_a_collector_away_missed() {
    // A port with nothing listening on it yet.
    let port = common::redis::free_port();
    let addr = format!("127.0.0.1:{port}");
    let (d, _dir) = daemon(&[
        "--statsd-addr",
        &addr,
        "--statsd-protocol",
        "tcp",
        "--statsd-tags",
        "env:prod",
        "--statsd-flush-interval",
        "100ms",
    ])
    .await;
    traffic(&d).await;
    // Several flushes fail (connection refused) while the collector is away.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let listener = TcpListener::bind(&addr).await.unwrap();
    let want = expected(".__env=prod");
    let totals = collect_tcp(&listener, &want).await;
    for (name, n) in &want {
        assert_eq!(totals.get(name), Some(n), "{name} in {totals:?}");
    }
}

/// A collector that accepts and never reads, while 1,000 distinct rules change every flush and
/// long tags make each line about 500 bytes: the kernel's buffers towards it fill (about 3 MB
/// on loopback), the sink's writes time out, and still decisions are answered as before and the
/// process does not grow with what it cannot send.
#[tokio::test]
async fn a_collector_that_never_reads_slows_no_decision_and_grows_nothing() {
    // A small receive window, so that the kernel's buffers towards it fill within the test.
    let socket = tokio::net::TcpSocket::new_v4().unwrap();
    socket.set_recv_buffer_size(4096).unwrap();
    socket.bind("127.0.0.1:0".parse().unwrap()).unwrap();
    let listener = socket.listen(1).unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let tags: Vec<String> = (0..8)
        .map(|i| format!("tag{i}:{}", "x".repeat(50)))
        .collect();
    let (d, _dir) = daemon(&[
        "--statsd-addr",
        &addr,
        "--statsd-protocol",
        "tcp",
        "--statsd-flush-interval",
        "50ms",
        "--statsd-tags",
        &tags.join(","),
    ])
    .await;
    let mut c = d.client().await;
    let round = |from: u32| {
        let mut c = c.clone();
        async move {
            for i in from..from + 1000 {
                let ip = format!("10.0.{}.{}", i / 250, i % 250);
                let r = call(&mut c, request("d", &[&[("ip", &ip)]])).await;
                assert!(is_ok(&r), "{r:?}");
            }
        }
    };
    // Warm: every label exists (the detailed labels are capped at 1000, so the same 1000
    // each round), and the kernel's buffers towards the collector fill.
    round(0).await;
    round(0).await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    let before = d.rss();
    for _ in 0..5 {
        round(0).await;
    }
    let grew = d.rss().saturating_sub(before);
    assert!(
        grew < 16 << 20,
        "grew by {grew} bytes while the collector read nothing"
    );
    let (_, m) = http_get(d.http, "/metrics").await;
    let failed = metric(&m, r#"ratelimit_statsd_flushes_total{result="error"}"#);
    eprintln!("statsd stalled: grew {grew} bytes, {failed} failed flushes");
    assert!(
        failed >= 1.0,
        "the collector's buffers filled and writes timed out: {m}"
    );
    // The limit of 2 still counts exactly.
    let answers = [
        call(&mut c, request("d", &[&[("k", "v")]])).await,
        call(&mut c, request("d", &[&[("k", "v")]])).await,
        call(&mut c, request("d", &[&[("k", "v")]])).await,
    ];
    assert!(is_ok(&answers[0]) && is_ok(&answers[1]) && is_over(&answers[2]));
    drop(listener);
}

/// What a TCP collector got: totals of whole lines, and any line a connection ended inside.
#[derive(Default)]
struct Collected {
    totals: HashMap<String, u64>,
    cut: Vec<String>,
    connections: usize,
}

/// A collector on `listener` reading each connection at `bytes_per_100ms` (0: as fast as it
/// can) until it is told otherwise.
fn slow_collector(
    listener: TcpListener,
    bytes_per_100ms: std::sync::Arc<std::sync::atomic::AtomicUsize>,
) -> std::sync::Arc<std::sync::Mutex<Collected>> {
    use std::sync::atomic::Ordering;
    let got = std::sync::Arc::new(std::sync::Mutex::new(Collected::default()));
    let shared = got.clone();
    tokio::spawn(async move {
        loop {
            let Ok((mut conn, _)) = listener.accept().await else {
                return;
            };
            shared.lock().unwrap().connections += 1;
            let (got, rate) = (shared.clone(), bytes_per_100ms.clone());
            tokio::spawn(async move {
                let mut pending = Vec::new();
                let mut buf = vec![0u8; 1 << 16];
                loop {
                    let cap = match rate.load(Ordering::Relaxed) {
                        0 => buf.len(),
                        n => {
                            tokio::time::sleep(Duration::from_millis(100)).await;
                            n
                        }
                    };
                    let n = match conn.read(&mut buf[..cap]).await {
                        Ok(0) | Err(_) => break,
                        Ok(n) => n,
                    };
                    pending.extend_from_slice(&buf[..n]);
                    if let Some(end) = pending.iter().rposition(|b| *b == b'\n') {
                        let text = String::from_utf8(pending.drain(..=end).collect()).unwrap();
                        add_lines(&mut got.lock().unwrap().totals, &text);
                    }
                }
                if !pending.is_empty() {
                    got.lock()
                        .unwrap()
                        .cut
                        .push(String::from_utf8_lossy(&pending).into());
                }
            });
        }
    });
    got
}

/// A collector that reads slowly (20 KB/s, with a small receive window) while 64 rules with
/// 1 KB descriptor values grow every flush: flushes time out part-way, and still each hit is
/// counted once (before: a timed-out flush was sent again whole on the next connection, 11 to
/// 49 of the 64 rules arriving 40-80 over their true total), no line arrives cut, and nothing
/// is counted lost, the slow connection being kept while it reads.
#[tokio::test]
async fn a_slow_tcp_collector_gets_each_hit_once_and_no_line_cut() {
    use std::sync::atomic::{AtomicUsize, Ordering};
    let socket = tokio::net::TcpSocket::new_v4().unwrap();
    socket.set_recv_buffer_size(4096).unwrap();
    socket.bind("127.0.0.1:0".parse().unwrap()).unwrap();
    let listener = socket.listen(4).unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let rate = std::sync::Arc::new(AtomicUsize::new(2048));
    let got = slow_collector(listener, rate.clone());
    let (d, _dir) = daemon(&[
        "--statsd-addr",
        &addr,
        "--statsd-protocol",
        "tcp",
        "--statsd-flush-interval",
        "100ms",
    ])
    .await;
    let values: Vec<String> = (0..64)
        .map(|i| format!("{i:02}{}", "v".repeat(1022)))
        .collect();
    let mut c = d.client().await;
    let mut sent = 0u64;
    let started = tokio::time::Instant::now();
    let (_, m) = http_get(d.http, "/metrics").await;
    let errors_before = metric(&m, r#"ratelimit_statsd_flushes_total{result="error"}"#);
    // Until flushes have timed out a few times (the buffers towards the collector full).
    loop {
        for v in &values {
            assert!(is_ok(&call(&mut c, request("d", &[&[("ip", v)]])).await));
        }
        sent += 1;
        let (_, m) = http_get(d.http, "/metrics").await;
        let errors = metric(&m, r#"ratelimit_statsd_flushes_total{result="error"}"#);
        if errors >= errors_before + 3.0 {
            break;
        }
        assert!(
            started.elapsed() < Duration::from_secs(90),
            "no flush timed out: {m}"
        );
    }
    // The collector reads at full speed from here: everything owed arrives.
    rate.store(0, Ordering::Relaxed);
    let name = |v: &str, stat: &str| format!("ratelimit.service.rate_limit.d.ip_{v}.{stat}");
    let complete = |totals: &HashMap<String, u64>| {
        values.iter().all(|v| {
            ["total_hits", "within_limit"]
                .iter()
                .all(|stat| totals.get(&name(v, stat)).copied().unwrap_or(0) >= sent)
        })
    };
    poll(Duration::from_secs(60), || {
        let done = complete(&got.lock().unwrap().totals);
        async move { done.then_some(()) }
    })
    .await;
    // A few more flushes: nothing more arrives for these rules.
    tokio::time::sleep(Duration::from_secs(1)).await;
    let (_, m) = http_get(d.http, "/metrics").await;
    assert_eq!(metric(&m, "ratelimit_statsd_lines_lost_total"), 0.0, "{m}");
    let got = got.lock().unwrap();
    for v in &values {
        for stat in ["total_hits", "within_limit"] {
            assert_eq!(
                got.totals.get(&name(v, stat)),
                Some(&sent),
                "{stat} of {v:.4}…"
            );
        }
    }
    assert!(got.cut.is_empty(), "lines cut: {:?}", got.cut);
    eprintln!(
        "slow collector: {sent} rounds, {} connection(s)",
        got.connections
    );
}

/// A collector that resets every connection it takes: no flush is counted a success, and the
/// lines written to it are counted lost (before: every other flush counted `success`).
#[tokio::test]
async fn a_resetting_collectors_flushes_are_failures_and_their_lines_lost() {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    tokio::spawn(async move {
        while let Ok((conn, _)) = listener.accept().await {
            // Let the first flush arrive, then reset (close with bytes unread).
            tokio::time::sleep(Duration::from_millis(30)).await;
            conn.set_zero_linger().unwrap();
            drop(conn);
        }
    });
    let (d, _dir) = daemon(&[
        "--statsd-addr",
        &addr,
        "--statsd-protocol",
        "tcp",
        "--statsd-flush-interval",
        "100ms",
    ])
    .await;
    let mut c = d.client().await;
    poll(Duration::from_secs(30), || {
        let mut c = c.clone();
        async move {
            call(&mut c, request("d", &[&[("ip", "10.0.0.1")]])).await;
            let (_, m) = http_get(d.http, "/metrics").await;
            let errors = metric(&m, r#"ratelimit_statsd_flushes_total{result="error"}"#);
            let lost = metric(&m, "ratelimit_statsd_lines_lost_total");
            (errors >= 5.0 && lost >= 5.0).then_some(m)
        }
    })
    .await;
    let _ = call(&mut c, request("d", &[&[("ip", "10.0.0.1")]])).await;
    let (_, m) = http_get(d.http, "/metrics").await;
    assert_eq!(
        metric(&m, r#"ratelimit_statsd_flushes_total{result="success"}"#),
        0.0,
        "{m}"
    );
}
