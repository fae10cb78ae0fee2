//! What one connection can make the server hold, tried from outside as an attacker would,
//! against the `ratelimitd` process itself (its resident memory and open descriptors read from
//! /proc): a client that never reads, half-sent requests, slowloris on the HTTP ports. Each
//! time a well-behaved client on another connection is still served.

mod common;

use std::time::Duration;

use tokio::time::Instant;

use common::daemon::Daemon;
use common::frames::*;
use common::redis::free_port;
use common::*;
use prost::Message;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

const LIMITS: &str = "domain: d\ndescriptors:\n  - key: k\n    rate_limit: {unit: hour, requests_per_unit: 1000000}\n";

async fn daemon(flags: &[&str]) -> (Daemon, tempfile::TempDir) {
    common::daemon::quiet(LIMITS, flags).await
}

/// A victim's call on its own connection: admitted.
async fn victim_is_served(d: &Daemon) {
    let mut c = d.client().await;
    for _ in 0..5 {
        assert!(is_ok(
            &call(&mut c, request("d", &[&[("k", "victim")]])).await
        ));
    }
}

/// Polls until the daemon holds at most `fds` descriptors.
async fn until_fds_at_most(d: &Daemon, fds: usize, within: Duration) {
    poll(within, || {
        let now = d.fds();
        async move { (now <= fds).then_some(()) }
    })
    .await;
}

/// A client that advertises a zero flow-control window and never reads grew the server by
/// 964 MB in 17 s (every answer kept, `ratelimit_requests_in_flight` at 0). Now it has at most
/// 1024 streams, the server reads nothing more from it once its writes to it block, and it is
/// cut off when that has lasted the idle timeout.
#[tokio::test]
async fn a_client_that_never_reads_holds_bounded_memory_and_is_cut_off() {
    let (d, _dir) = daemon(&["--connection-idle-timeout", "3s"]).await;
    victim_is_served(&d).await;
    let (rss, fds) = (d.rss(), d.fds());
    let mut socket = TcpStream::connect(("127.0.0.1", d.grpc)).await.unwrap();
    let mut hello = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n".to_vec();
    hello.extend(frame(4, 0, 0, &[0, 4, 0, 0, 0, 0])); // SETTINGS_INITIAL_WINDOW_SIZE = 0
    assert!(send(&mut socket, &hello).await);
    let message = grpc_message(&request("d", &[&[("k", "attacker")]]).encode_to_vec());
    let block = headers(&CALL);
    let mut sent = 0;
    let started = Instant::now();
    'attack: while started.elapsed() < Duration::from_secs(5) {
        let mut batch = Vec::new();
        for _ in 0..100 {
            let stream = 2 * sent + 1;
            batch.extend(frame(1, 4, stream, &block)); // HEADERS, END_HEADERS
            batch.extend(frame(0, 1, stream, &message)); // DATA, END_STREAM
            sent += 1;
        }
        if !send(&mut socket, &batch).await {
            break 'attack;
        }
        if sent >= 60_000 {
            break;
        }
    }
    let grown = d.rss().saturating_sub(rss);
    victim_is_served(&d).await;
    assert!(
        grown < 48 << 20,
        "{sent} requests that are never read grew the server by {} MiB",
        grown >> 20
    );
    // Never reading, it cannot answer the server's PINGs: closed within the idle timeout.
    until_fds_at_most(&d, fds, Duration::from_secs(10)).await;
    drop(socket);
}

/// The answers and request sides of streams opened on one new connection to `d`: 200 calls
/// of `path`, each sending the first `sent` bytes of a message declared `declared` bytes long,
/// and no more. The connection's task is returned too.
async fn half_sent_streams(
    d: &Daemon,
    path: &str,
    declared: usize,
    sent: usize,
) -> (
    Vec<(h2::client::ResponseFuture, h2::SendStream<bytes::Bytes>)>,
    h2::client::SendRequest<bytes::Bytes>,
    tokio::task::JoinHandle<Result<(), h2::Error>>,
) {
    let tcp = TcpStream::connect(("127.0.0.1", d.grpc)).await.unwrap();
    let (mut h2, connection) = h2::client::handshake(tcp).await.unwrap();
    let connection = tokio::spawn(connection);
    let mut body = vec![0u8];
    body.extend_from_slice(&(declared as u32).to_be_bytes());
    body.resize(5 + sent, 0x0a);
    let body = bytes::Bytes::from(body);
    let mut streams = Vec::new();
    for _ in 0..200 {
        let mut req = http::Request::post(format!("http://ratelimitd{path}"));
        for (name, value) in &CALL[4..] {
            req = req.header(*name, *value);
        }
        h2 = h2.ready().await.unwrap();
        let (answer, mut stream) = h2.send_request(req.body(()).unwrap(), false).unwrap();
        stream.send_data(body.clone(), false).unwrap();
        streams.push((answer, stream));
    }
    (streams, h2, connection)
}

/// One connection opening 200 streams, each carrying 1 MiB of a request one byte short of
/// complete; returns once every stream is answered and the connection is gone, with the
/// server's peak growth over `rss` while it lasted.
async fn half_sent_attack(d: &Daemon, rss: u64) -> u64 {
    // A message declared 1 MiB long, of which all but its last byte is sent.
    let declared = (1 << 20) - 5;
    let (mut answers, h2, connection) =
        half_sent_streams(d, CALL[2].1, declared, declared - 1).await;
    let mut peak = 0;
    let started = Instant::now();
    for (i, (answer, _stream)) in answers.iter_mut().enumerate() {
        let Ok(got) = tokio::time::timeout(Duration::from_secs(15), answer).await else {
            // What a failure needs to be read: how far the attack got, and whether the server
            // still answers others and how many workers it runs (the worker gate).
            let victim = tokio::time::timeout(Duration::from_secs(5), victim_is_served(d)).await;
            let (_, metrics) = http_get(d.http, "/metrics").await;
            let workers: Vec<&str> = metrics
                .lines()
                .filter(|l| l.starts_with("ratelimit_worker_threads_active"))
                .collect();
            panic!(
                "every half-sent request is answered by its deadline: stream {i} of {} was not, \
                 {:?} after the last was sent; a victim is served: {}; {workers:?}",
                answers.len(),
                started.elapsed(),
                victim.is_ok(),
            );
        };
        peak = peak.max(d.rss().saturating_sub(rss));
        let response = got.unwrap();
        let status = response.headers().get("grpc-status").cloned();
        assert!(status.is_some_and(|s| s != "0"), "refused, not decided");
    }
    assert!(started.elapsed() < Duration::from_secs(15));
    drop(answers);
    drop(h2);
    connection.abort();
    peak
}

/// What one connection's unfinished requests may hold: 4 MiB.
const CONNECTION_BUDGET: u64 = 4 << 20;

/// How far the peak may pass the budget: 200 streams' state, h2's receive window, decode
/// buffers that grow by doubling, and the freed pages the allocator keeps before it gives them
/// back (the same run with `MIMALLOC_PURGE_DELAY=0` peaks 8-10 MiB lower). Measured: +27-33 MiB
/// here, +52 MiB once on CI's machine; the defect grew the server by 240 MiB.
const TRANSIENT: u64 = 64 << 20;

/// One connection opening 200 RLQS streams, each sending 1007 KiB of a 1015 KiB report and
/// stopping there, kept open: the server grew by 240 MiB, because a stream gave its frames back
/// to the connection's budget as soon as the next arrived while the decoder kept them all. Now
/// a stream's unfinished message counts until it is complete: the streams past the connection's
/// 4 MiB are refused with RESOURCE_EXHAUSTED, the rest hold at most that, and only until the
/// request deadline (DEADLINE_EXCEEDED); the server's peak stays within its bound.
#[tokio::test]
async fn half_sent_rlqs_reports_pin_no_more_than_the_connections_budget() {
    let (d, _dir) = daemon(&["--request-timeout", "2s"]).await;
    victim_is_served(&d).await;
    d.reset_hwm();
    let rss = d.rss();
    let path = "/envoy.service.rate_limit_quota.v3.RateLimitQuotaService/StreamRateLimitQuotas";
    let (mut streams, h2, connection) = half_sent_streams(&d, path, 1015 << 10, 1007 << 10).await;
    // Each stream is refused or held; the refusals come at once (all within a few seconds).
    let by = tokio::time::Instant::now() + Duration::from_secs(10);
    let ends = streams.iter_mut().map(|(answer, _)| async move {
        let response = tokio::time::timeout_at(by, answer).await.ok()?.unwrap();
        let mut body = response.into_body();
        let trailers = tokio::time::timeout_at(by, body.trailers()).await.ok()?;
        trailers
            .unwrap()
            .and_then(|t| t.get("grpc-status").cloned())
    });
    let ends = futures_util::future::join_all(ends).await;
    let peak = d.hwm().saturating_sub(rss);
    let count = |code: &str| {
        ends.iter()
            .filter(|s| s.as_ref().is_some_and(|s| s == code))
            .count()
    };
    let (refused, timed_out) = (count("8"), count("4"));
    assert_eq!(
        refused + timed_out,
        200,
        "refused (8) or ended at the deadline (4): {ends:?}"
    );
    eprintln!(
        "{refused} refused, {timed_out} held until the deadline, peak +{} KiB",
        peak >> 10
    );
    assert!(
        timed_out <= 5,
        "{timed_out} streams held, {refused} refused"
    );
    assert!(
        peak < CONNECTION_BUDGET + TRANSIENT,
        "200 half-sent reports grew the server by {} MiB",
        peak >> 20
    );
    victim_is_served(&d).await;
    drop(streams);
    drop(h2);
    connection.abort();
}

/// 200 streams each carrying 1 MiB of a request one byte short of complete pinned 239 MB with
/// the connection kept open, and kept it after the client left. Now a connection's requests in
/// flight hold at most 4 MiB (the rest are refused on that connection), each is ended at the
/// request deadline, and what an attack held does not stay behind to add up with the next one:
/// every connection's descriptor is released, and five attacks end within 32 MiB of where the
/// first left the process (the allocator keeps some of what was freed for reuse: 0 to 18 MiB
/// from run to run on the 2-core machine; the defect kept 239 MB per attack).
#[tokio::test]
async fn half_sent_requests_pin_bounded_memory_until_their_deadline() {
    let (d, _dir) = daemon(&["--request-timeout", "2s"]).await;
    victim_is_served(&d).await;
    let rss = d.rss();
    let fds = d.fds();
    let first = half_sent_attack(&d, rss).await;
    victim_is_served(&d).await;
    assert!(
        first < 48 << 20,
        "200 half-sent 1 MiB requests grew the server by {} MiB",
        first >> 20
    );
    let after_first = d.rss();
    // Four more attacks, one after another: the allocator may keep what it freed for reuse,
    // but none of it is still held by a connection that has gone.
    for i in 0..4 {
        let peak = half_sent_attack(&d, rss).await;
        assert!(peak < 48 << 20, "peak +{} MiB", peak >> 20);
        eprintln!(
            "attack {}: peak +{} KiB, then +{} KiB over the first's end",
            i + 2,
            peak >> 10,
            d.rss().saturating_sub(after_first) >> 10
        );
    }
    // Every attacker's connection is gone from the server.
    poll(Duration::from_secs(20), || {
        let open = d.fds();
        async move { (open <= fds).then_some(()) }
    })
    .await;
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let grown = d.rss().saturating_sub(after_first);
        if grown < 32 << 20 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "five attacks left +{} MiB over the first",
            grown >> 20
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    victim_is_served(&d).await;
}

/// Sends `text` on a new connection to `port` and keeps the connection.
async fn half_request(port: u16, text: &str) -> TcpStream {
    let mut s = TcpStream::connect(("127.0.0.1", port)).await.unwrap();
    let _ = s.write_all(text.as_bytes()).await;
    s
}

/// Every attacker's connection is closed by the server within 10 s, all of them within 12 s
/// of `started`.
async fn all_cut_off(attackers: &mut [TcpStream], started: Instant) {
    for (i, a) in attackers.iter_mut().enumerate() {
        assert!(
            closed_within(a, Duration::from_secs(10)).await,
            "attacker {i} still connected after {:?}",
            started.elapsed()
        );
    }
    assert!(started.elapsed() < Duration::from_secs(12));
}

/// Whether the server has closed `s` (reads until end of stream, within `within`).
async fn closed_within(s: &mut TcpStream, within: Duration) -> bool {
    let mut sink = Vec::new();
    matches!(
        tokio::time::timeout(within, s.read_to_end(&mut sink)).await,
        Ok(Ok(_)) | Ok(Err(_))
    )
}

/// 2000 connections each sending half of a request's headers were all held for good (+64 MB,
/// 2000 descriptors): no header-read timeout, no connection cap. Half-sent bodies and silent
/// connections too. Now each is cut off within its deadline and the count is capped.
/// The debug and metrics ports share the HTTP ports' cap and deadlines.
#[tokio::test]
async fn slowloris_connections_on_the_http_ports_are_cut_off_and_capped() {
    let (debug, metrics) = (free_port(), free_port());
    let (debug_addr, metrics_addr) = (format!("127.0.0.1:{debug}"), format!("127.0.0.1:{metrics}"));
    let (d, _dir) = daemon(&[
        "--connection-idle-timeout",
        "2s",
        "--request-timeout",
        "2s",
        "--debug-addr",
        &debug_addr,
        "--metrics-addr",
        &metrics_addr,
    ])
    .await;
    let ports = [d.http.port(), debug, metrics];
    let fds = d.fds();
    let started = Instant::now();
    let mut attackers = Vec::new();
    for i in 0..600 {
        let port = ports[(i / 3) % 3];
        attackers.push(match i % 3 {
            0 => half_request(port, "GET /metrics HTTP/1.1\r\nHost: x\r\n").await,
            1 => {
                half_request(
                    port,
                    "POST /json HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n{",
                )
                .await
            }
            _ => half_request(port, "").await,
        });
    }
    let held = d.fds() - fds;
    assert!(
        held <= ratelimitd::MAX_HTTP_CONNECTIONS + 8,
        "600 attackers hold {held} descriptors"
    );
    all_cut_off(&mut attackers, started).await;
    until_fds_at_most(&d, fds, Duration::from_secs(5)).await;
    for port in ports {
        let addr = format!("127.0.0.1:{port}").parse().unwrap();
        let (status, _) = http_get(addr, "/healthcheck").await;
        assert_eq!(status, 200, "port {port}");
    }
    victim_is_served(&d).await;
}

/// Connections that never finish the HTTP/2 greeting (silent, or half the preface) hold no
/// stream and send no request, so no request deadline ends them: the idle timeout does.
#[tokio::test]
async fn silent_connections_on_the_grpc_port_are_cut_off() {
    let (d, _dir) = daemon(&["--connection-idle-timeout", "3s"]).await;
    let fds = d.fds();
    let started = Instant::now();
    let mut attackers = Vec::new();
    for i in 0..200 {
        let greeting = if i % 2 == 0 { "" } else { "PRI * HTTP/2.0\r\n" };
        attackers.push(half_request(d.grpc, greeting).await);
    }
    // The server has accepted them (the kernel completes a connection before accept()).
    poll(Duration::from_millis(2500), || {
        let now = d.fds();
        async move { (now >= fds + 100).then_some(()) }
    })
    .await;
    victim_is_served(&d).await;
    all_cut_off(&mut attackers, started).await;
    until_fds_at_most(&d, fds + 1, Duration::from_secs(5)).await;
    victim_is_served(&d).await;
}

/// Reads until a GOAWAY: how long after `since` it came.
async fn until_goaway(socket: &mut TcpStream, since: Instant) -> Duration {
    loop {
        match next_frame(socket).await {
            Some((7, ..)) => return since.elapsed(),
            Some(_) => {}
            None => panic!("closed without GOAWAY after {:?}", since.elapsed()),
        }
    }
}

/// Connections that an Envoy fleet opened together are each sent GOAWAY at their age, within
/// ±10% of `--grpc-max-connection-age`, not all at once.
#[tokio::test]
async fn connections_are_sent_goaway_at_their_age_each_with_its_own_jitter() {
    // Long enough that the spread (1.9 s expected) outlasts any stall of a loaded machine.
    let age = Duration::from_secs(10);
    let (d, _dir) = daemon(&["--grpc-max-connection-age", "10s"]).await;
    let clients = (0..24).map(|_| async {
        let mut socket = h2_connection(d.grpc).await;
        let since = Instant::now();
        tokio::time::timeout(Duration::from_secs(30), until_goaway(&mut socket, since))
            .await
            .expect("GOAWAY within 30 s")
    });
    let ages = futures_util::future::join_all(clients).await;
    let (first, last) = (ages.iter().min().unwrap(), ages.iter().max().unwrap());
    // No connection is sent GOAWAY before 90% of the age (the lowest lane is 90.6%); a busy
    // machine may only make one late.
    assert!(*first >= age.mul_f64(0.9), "{ages:?}");
    assert!(
        *last <= age.mul_f64(1.1) + Duration::from_secs(10),
        "{ages:?}"
    );
    // 24 connections over 16 lanes spread over 1.9 s; together they would be within ms.
    assert!(*last - *first >= Duration::from_millis(500), "{ages:?}");
    victim_is_served(&d).await;
}

/// A stream in flight when its connection's age comes finishes on that connection; a stream
/// that never finishes is cut off with the connection when the grace is over.
#[tokio::test]
async fn streams_in_flight_at_the_age_finish_within_the_grace_then_the_connection_closes() {
    let (age, grace) = (Duration::from_secs(2), Duration::from_secs(3));
    let (d, _dir) = daemon(&[
        "--grpc-max-connection-age",
        "2s",
        "--grpc-max-connection-age-grace",
        "3s",
        "--request-timeout",
        "60s",
    ])
    .await;
    let message = grpc_message(&request("d", &[&[("k", "in-flight")]]).encode_to_vec());
    let (head, tail) = message.split_at(message.len() / 2);
    let mut socket = h2_connection(d.grpc).await;
    let since = Instant::now();
    let mut opening = Vec::new();
    for stream in [1, 3] {
        opening.extend(frame(1, 4, stream, &headers(&CALL))); // HEADERS, END_HEADERS
        opening.extend(frame(0, 0, stream, head)); // half the message
    }
    assert!(send(&mut socket, &opening).await);
    let goaway = until_goaway(&mut socket, since).await;
    assert!(goaway >= age.mul_f64(0.9), "GOAWAY after {goaway:?}");

    // Stream 1 finishes after the GOAWAY and is answered.
    assert!(send(&mut socket, &frame(0, 1, 1, tail)).await); // DATA, END_STREAM
    let mut body = Vec::new();
    loop {
        match next_frame(&mut socket).await {
            Some((0, _, 1, data)) => body.extend(data),
            Some((1, flags, 1, _)) if flags & 1 == 1 => break, // trailers
            Some(_) => {}
            None => panic!("closed before stream 1 was answered"),
        }
    }
    assert!(body.len() > 5, "an answer message, not only trailers");
    let answer =
        envoy_types::pb::envoy::service::ratelimit::v3::RateLimitResponse::decode(&body[5..])
            .unwrap();
    assert!(is_ok(&answer), "{answer:?}");

    // Stream 3 never finishes: the connection is closed once the grace is over.
    while next_frame(&mut socket).await.is_some() {}
    let closed = since.elapsed();
    // Not before the earliest age plus the grace, whenever this client read the GOAWAY.
    assert!(
        closed >= age.mul_f64(0.9) + grace,
        "closed after {closed:?}, GOAWAY after {goaway:?}"
    );
    assert!(
        closed <= age.mul_f64(1.1) + grace + Duration::from_secs(10),
        "closed after {closed:?}"
    );
}

/// The next frame as it comes, PINGs included (SETTINGS are acknowledged and skipped).
async fn next_frame_raw(socket: &mut TcpStream) -> Option<(u8, u8, u32, Vec<u8>)> {
    loop {
        let got = read_frame(socket).await?;
        if got.0 == 4 {
            if got.1 & 1 == 0 {
                let _ = send(socket, &frame(4, 1, 0, &[])).await;
            }
            continue;
        }
        return Some(got);
    }
}

/// A call in flight when its connection's age comes is answered even when the client sends
/// what grpc-core (C++, Python, Ruby, PHP) sends across the two GOAWAYs: its answer to the
/// server's PING first, then a call it had queued (HEADERS, DATA) with a WINDOW_UPDATE for
/// it. h2 0.4 takes that WINDOW_UPDATE, on a stream above the last GOAWAY's, for a frame on
/// a stream never opened and ends the connection (GOAWAY PROTOCOL_ERROR), failing every call
/// in flight: see `src/server/h2guard.rs`.
#[tokio::test]
async fn a_call_in_flight_survives_grpc_cores_frames_across_the_goaways() {
    let (d, _dir) = daemon(&[
        "--grpc-max-connection-age",
        "1s",
        "--grpc-max-connection-age-grace",
        "30s",
        "--request-timeout",
        "60s",
    ])
    .await;
    let message = grpc_message(&request("d", &[&[("k", "in-flight")]]).encode_to_vec());
    let (head, tail) = message.split_at(message.len() / 2);
    let mut socket = h2_connection(d.grpc).await;
    let mut opening = frame(1, 4, 1, &headers(&CALL)); // HEADERS, END_HEADERS
    opening.extend(frame(0, 0, 1, head)); // half the message: in flight
    assert!(send(&mut socket, &opening).await);

    // GOAWAY(2^31-1) and the shutdown PING, within the age (and a loaded machine's delay).
    let mut goaways = Vec::new();
    let ping = tokio::time::timeout(Duration::from_secs(30), async {
        loop {
            match next_frame_raw(&mut socket).await {
                Some((7, _, _, payload)) => goaways.push(payload),
                Some((6, 0, _, payload)) if !goaways.is_empty() => return payload,
                Some(_) => {}
                None => panic!("closed before the shutdown PING"),
            }
        }
    })
    .await
    .expect("GOAWAY and PING within 30 s");
    assert_eq!(
        goaways[0][..4],
        0x7fff_ffffu32.to_be_bytes(),
        "the first GOAWAY"
    );

    // grpc-core's order: the PING's answer, then a queued call with its WINDOW_UPDATE.
    let mut late = frame(6, 1, 0, &ping); // PING, ACK
    late.extend(frame(1, 4, 3, &headers(&CALL)));
    late.extend(frame(8, 0, 3, &65_535u32.to_be_bytes())); // WINDOW_UPDATE on stream 3
    late.extend(frame(0, 1, 3, &message)); // DATA, END_STREAM
    assert!(send(&mut socket, &late).await);
    assert!(send(&mut socket, &frame(0, 1, 1, tail)).await); // stream 1's end

    let mut body = Vec::new();
    let answered = tokio::time::timeout(Duration::from_secs(30), async {
        loop {
            match next_frame_raw(&mut socket).await {
                Some((0, _, 1, data)) => body.extend(data),
                Some((1, flags, 1, _)) if flags & 1 == 1 => return, // trailers
                Some((7, _, _, payload)) => {
                    let error = u32::from_be_bytes(payload[4..8].try_into().unwrap());
                    assert_eq!(error, 0, "GOAWAY with error code {error}: stream 1 is lost");
                    let last = u32::from_be_bytes(payload[..4].try_into().unwrap());
                    assert_eq!(last, 1, "the last GOAWAY names the last stream taken");
                }
                Some((3, _, 1, payload)) => panic!("stream 1 reset: {payload:?}"),
                Some(_) => {}
                None => panic!("closed before stream 1 was answered"),
            }
        }
    })
    .await;
    assert!(answered.is_ok(), "stream 1 answered within 30 s");
    let answer =
        envoy_types::pb::envoy::service::ratelimit::v3::RateLimitResponse::decode(&body[5..])
            .unwrap();
    assert!(is_ok(&answer), "{answer:?}");
}

/// `n` streams opened and reset (CANCEL) in one write, then a PING: whether the connection
/// answered the PING (alive) or sent GOAWAY, with its error code, or closed.
async fn reset_burst(port: u16, n: u32) -> Result<(), String> {
    let mut s = h2_connection(port).await;
    let mut burst = Vec::new();
    for i in 0..n {
        let id = 2 * i + 1;
        burst.extend(frame(1, 4, id, &headers(&CALL)));
        burst.extend(frame(3, 0, id, &8u32.to_be_bytes()));
    }
    burst.extend(frame(6, 0, 0, b"rapidrst"));
    if !send(&mut s, &burst).await {
        return Err("the server stopped reading".into());
    }
    loop {
        let frame_read = tokio::time::timeout(Duration::from_secs(10), read_frame(&mut s)).await;
        match frame_read {
            Err(_) => return Err("no answer within 10 s".into()),
            Ok(None) => return Err("closed".into()),
            Ok(Some((4, 0, ..))) => {
                let _ = send(&mut s, &frame(4, 1, 0, &[])).await;
            }
            Ok(Some((6, 1, _, payload))) if payload == b"rapidrst" => return Ok(()),
            Ok(Some((7, _, _, payload))) => {
                let code = u32::from_be_bytes([payload[4], payload[5], payload[6], payload[7]]);
                return Err(format!("GOAWAY {code:#x}"));
            }
            Ok(Some(_)) => {}
        }
    }
}

/// Streams a peer resets before the service takes them (HTTP/2's rapid reset) are bounded per
/// connection at 1024, not h2's default of 20: Envoy resets every call it gives up on at its
/// timeout, and past 20 h2 closed its whole connection with every other call on it. 500 reset
/// in one burst leave the connection answering; 20,000 get it closed (ENHANCE_YOUR_CALM), and a
/// victim on another connection is served throughout.
#[tokio::test]
async fn streams_reset_before_they_are_taken_are_bounded_per_connection() {
    let (d, _dir) = daemon(&[]).await;
    for _ in 0..3 {
        assert_eq!(reset_burst(d.grpc, 500).await, Ok(()), "500 resets");
    }
    victim_is_served(&d).await;
    assert_eq!(
        reset_burst(d.grpc, 20_000).await,
        Err("GOAWAY 0xb".into()),
        "20,000 resets in one burst"
    );
    victim_is_served(&d).await;
}

/// With tracing on, Envoy copies a client's W3C `tracestate` into its call, up to its own
/// 60 KiB header limit: such a call is decided (it was refused by HTTP/2 past 16 KiB before,
/// and Envoy let the request through unseen). A header block over `--grpc-max-header-bytes`
/// is still refused by HTTP/2, and now counted (`ratelimit_grpc_resets_total`), so an
/// operator sees calls Envoy fails open.
#[tokio::test]
async fn a_traced_call_is_decided_and_a_header_block_past_the_bound_is_counted() {
    let (d, _dir) = daemon(&["--grpc-max-header-bytes", "64KiB"]).await;
    let tracestate = format!("vendor={}", "a".repeat(40_000));
    let mut c = d.client().await;
    let mut req = tonic::Request::new(request("d", &[&[("k", "traced")]]));
    req.metadata_mut()
        .insert("tracestate", tracestate.parse().unwrap());
    let answer = c
        .should_rate_limit(req)
        .await
        .expect("decided")
        .into_inner();
    assert!(is_ok(&answer), "{answer:?}");

    let resets = "ratelimit_grpc_resets_total{frame=\"rst_stream\",code=\"protocol_error\"}";
    let (_, text) = http_get(d.http, "/metrics").await;
    assert_eq!(metric(&text, resets), 0.0, "{text}");
    // 80 KB of tracestate, as an Envoy whose max_request_headers_kb was raised could send.
    let mut socket = h2_connection(d.grpc).await;
    let mut block = headers(&CALL);
    block.push(0);
    block.extend(hpack_string(b"tracestate"));
    block.extend(hpack_string(
        format!("vendor={}", "b".repeat(80_000)).as_bytes(),
    ));
    let mut call = header_frames(1, &block);
    call.extend(frame(
        0,
        1,
        1,
        &grpc_message(&request("d", &[&[("k", "big")]]).encode_to_vec()),
    ));
    assert!(send(&mut socket, &call).await);
    let refused = tokio::time::timeout(Duration::from_secs(10), async {
        loop {
            match next_frame(&mut socket).await {
                Some((3, _, 1, code)) => return code,
                Some(_) => {}
                None => panic!("closed without resetting the stream"),
            }
        }
    })
    .await
    .expect("the stream is reset");
    assert_eq!(refused, vec![0, 0, 0, 1], "PROTOCOL_ERROR");
    poll(Duration::from_secs(10), || async {
        let (_, text) = http_get(d.http, "/metrics").await;
        (metric(&text, resets) == 1.0).then_some(())
    })
    .await;
    victim_is_served(&d).await;
}
