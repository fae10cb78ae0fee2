//! envoyproxy/ratelimit's stats pushed to a statsd or DogStatsD collector (`--statsd-addr`),
//! named as that service's stats library names them, beside the Prometheus metrics (which stay
//! the native way).
//!
//! Nothing is sent from the decision path. A decision adds to atomic counters (the per-rule
//! counts of [`StatsdRules`](crate::metrics::StatsdRules), and the Prometheus families); one task reads them every flush
//! interval and sends what grew since the last flush that got through. So:
//!
//! - a collector that is away, slow or never reads never slows a decision: the task alone
//!   waits on it, each connect and each write within [`IO_TIMEOUT`];
//! - what the sink holds does not grow while the collector is away: the counters are
//!   cumulative and the sink keeps only the value it last sent of each stat (one per rule and
//!   count), so the first flush that gets through over TCP carries the whole difference; over
//!   UDP a datagram that cannot be sent is dropped, as statsd over UDP always may be;
//! - one flush sends at most [`MAX_FLUSH_BYTES`]; stats past it wait for the next flush;
//! - over TCP each line is sent at most once and never cut: a line is counted sent as soon as
//!   its first byte is written, and the rest of a line a timed-out flush cut goes first on the
//!   same connection at the next flush (a slow collector is kept while it reads; one that
//!   takes no byte for [`STALLED_FLUSHES`] flushes in a row is given up). A flush counts as
//!   `success` once the next flush finds its connection still up; one whose connection the
//!   collector then reset counts `error`, and its lines, with a line cut by a connection given
//!   up and UDP datagrams that could not be sent, are counted in
//!   `ratelimit_statsd_lines_lost_total` (lines the collector may not have had).
//!
//! Names (with `--statsd-tags` as the library serializes tags into a name, `.__key=value`, or
//! as DogStatsD tags, `|#key:value`):
//!
//! - `ratelimit.service.rate_limit.<domain>.<rule>.{total_hits,within_limit,near_limit,over_limit,shadow_mode}`,
//!   counted in hits as that service counts them;
//! - `ratelimit.service.config_load_success`, `ratelimit.service.config_load_error`;
//! - `ratelimit.service.call.should_rate_limit.redis_error` (requests the failure mode decided)
//!   and `.service_error` (answered `INTERNAL`);
//! - `ratelimit_server.ShouldRateLimit.total_requests`;
//! - the timer `ratelimit_server.ShouldRateLimit.response_time`, in milliseconds. That service
//!   sends one sample per request; here no sample is taken on the decision path: each flush
//!   reads what `ratelimit_request_duration_seconds` gained in each of its buckets and sends one
//!   line per bucket that grew, its value the middle of the bucket, with the sample rate
//!   (`|@`) that makes a collector count it as many times as requests fell in it (statsd,
//!   statsd_exporter and the Datadog agent scale a timer's count by it). Counts and rates are
//!   exact; each duration is known to its bucket (25 µs to 1 s, 14 buckets).

use std::collections::HashMap;
use std::fmt::Write as _;
use std::sync::Arc;
use std::time::Duration;

use tokio::io::AsyncWriteExt;
use tokio::net::{TcpStream, UdpSocket};

use crate::logs::{self, Throttle};
use crate::metrics::{LoadResult, Metrics};

/// Longest a connect or one flush's write may take: past it the flush is given up (TCP: the
/// connection too, and the next flush carries what this one had).
pub(crate) const IO_TIMEOUT: Duration = Duration::from_secs(1);
/// Most bytes one flush sends; what is left waits for the next.
pub(crate) const MAX_FLUSH_BYTES: usize = 1 << 20;
/// Largest UDP datagram: what fits in a common MTU, as the statsd libraries send.
const DATAGRAM_BYTES: usize = 1432;
/// A TCP connection to a collector that took no byte in this many flushes in a row is given
/// up (a line it cut is then lost): a collector that reads slowly is kept.
pub(crate) const STALLED_FLUSHES: u32 = 10;

/// How stats are sent.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Transport {
    /// One TCP connection, kept; what a failed flush had is sent by the next.
    Tcp,
    /// Datagrams of at most 1432 bytes; one that cannot be sent is dropped.
    Udp,
}

/// How tags are written.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Format {
    /// In the name, `name.__key=value` (lyft/gostats, which envoyproxy/ratelimit uses).
    Statsd,
    /// After the type, `|#key:value,…` (DogStatsD).
    DogStatsd,
}

/// The sink's settings.
#[derive(Clone, Debug)]
pub(crate) struct StatsdOptions {
    /// The collector, `host:port` (resolved at each connect).
    pub(crate) addr: String,
    /// TCP or UDP.
    pub(crate) protocol: Transport,
    /// How tags are written.
    pub(crate) format: Format,
    /// Tags on every stat, sorted by key.
    pub(crate) tags: Vec<(String, String)>,
    /// How often stats are sent.
    pub(crate) flush_interval: Duration,
}

/// The stats sink: call [`Sink::flush`] every flush interval ([`run`] does).
pub(crate) struct Sink {
    options: StatsdOptions,
    metrics: Arc<Metrics>,
    /// The value last sent of each stat (by key: a counter's name, or a timer's name and bucket).
    sent: HashMap<String, u64>,
    conn: Option<Socket>,
    /// Whether the last flush failed (to log an outage once, not every flush).
    failing: bool,
}

enum Socket {
    Tcp(TcpConn),
    Udp(UdpSocket),
}

/// A TCP connection to the collector and what is owed on it.
struct TcpConn {
    stream: TcpStream,
    /// The unwritten end of a line a timed-out flush cut: written first by the next flush.
    rest: Vec<u8>,
    /// Flushes in a row that got no byte through.
    stalled: u32,
    /// Lines written whole since the connection was last seen up, not yet known to be taken
    /// (see `check`).
    unconfirmed: u64,
    /// The last flush was written whole: a success once the connection is seen up.
    awaiting: bool,
}

/// A line of a flush's payload: where it ends, the stat and the value it brings it to.
struct Line {
    end: usize,
    key: String,
    value: u64,
}

impl Sink {
    /// A sink sending `metrics` (and the per-rule counts, if they are on) as `options` say.
    pub(crate) fn new(options: StatsdOptions, metrics: Arc<Metrics>) -> Sink {
        Sink {
            options,
            metrics,
            sent: HashMap::new(),
            conn: None,
            failing: false,
        }
    }

    /// Sends what grew since the last flush that got through; returns the bytes sent.
    pub(crate) async fn flush(&mut self) -> usize {
        self.check();
        let (payload, lines) = self.payload();
        let owed = matches!(&self.conn, Some(Socket::Tcp(c)) if !c.rest.is_empty());
        if payload.is_empty() && !owed {
            return 0;
        }
        match self.options.protocol {
            Transport::Tcp => self.flush_tcp(&payload, lines).await,
            Transport::Udp => match tokio::time::timeout(IO_TIMEOUT, self.send_udp(&payload)).await
            {
                Ok(Ok(())) => {
                    self.succeeded();
                    self.sent
                        .extend(lines.into_iter().map(|l| (l.key, l.value)));
                    payload.len()
                }
                failed => {
                    let why = match failed {
                        Ok(Err(e)) => e.to_string(),
                        _ => "timed out".to_owned(),
                    };
                    // Dropped, as statsd over UDP may always be.
                    self.metrics.statsd_lines_lost(lines.len() as u64);
                    self.sent
                        .extend(lines.into_iter().map(|l| (l.key, l.value)));
                    self.conn = None;
                    self.failed(&why);
                    0
                }
            },
        }
    }

    /// Whether the TCP connection is still up: the last flush it took whole then counts as a
    /// success; one the collector closed or reset is dropped, and if reset, the lines of that
    /// flush may never have been read: counted lost, the flush an error.
    fn check(&mut self) {
        let Some(Socket::Tcp(conn)) = &mut self.conn else {
            return;
        };
        let mut scratch = [0u8; 256];
        let reset = match conn.stream.try_read(&mut scratch) {
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => None,
            // The collector sent something (statsd collectors do not): still up.
            Ok(n) if n > 0 => None,
            // Closed in order: it read what it was sent (a close with bytes unread resets).
            Ok(_) => Some(false),
            Err(_) => Some(true),
        };
        let unconfirmed = std::mem::take(&mut conn.unconfirmed);
        let awaiting = std::mem::take(&mut conn.awaiting);
        let cut = u64::from(!conn.rest.is_empty());
        match reset {
            None | Some(false) => {
                if awaiting {
                    self.succeeded();
                }
                if reset.is_some() {
                    // A line cut before the collector closed cannot be finished.
                    self.metrics.statsd_lines_lost(cut);
                }
            }
            Some(true) => {
                self.metrics.statsd_lines_lost(unconfirmed + cut);
                if awaiting {
                    self.failed("the collector reset the connection");
                }
            }
        }
        if reset.is_some() {
            self.conn = None;
        }
    }

    /// One flush over TCP: the rest of a line the last one cut, then `payload`, each line
    /// counted sent from its first byte written.
    async fn flush_tcp(&mut self, payload: &[u8], lines: Vec<Line>) -> usize {
        let deadline = tokio::time::Instant::now() + IO_TIMEOUT;
        if self.conn.is_none() {
            let connected = tokio::time::timeout_at(deadline, async {
                let s = TcpStream::connect(&self.options.addr).await?;
                s.set_nodelay(true)?;
                Ok::<_, std::io::Error>(s)
            })
            .await;
            match connected {
                Ok(Ok(stream)) => {
                    self.conn = Some(Socket::Tcp(TcpConn {
                        stream,
                        rest: Vec::new(),
                        stalled: 0,
                        unconfirmed: 0,
                        awaiting: false,
                    }));
                }
                Ok(Err(e)) => {
                    self.failed(&e.to_string());
                    return 0;
                }
                Err(_) => {
                    self.failed("connect timed out");
                    return 0;
                }
            }
        }
        let Some(Socket::Tcp(conn)) = &mut self.conn else {
            return 0;
        };
        let mut progressed = false;
        // The end of a cut line first: nothing else may come between its two parts.
        let mut outcome = write_within(&mut conn.stream, &conn.rest, deadline).await;
        let (Ok(n) | Err((n, _))) = &outcome;
        progressed |= *n > 0;
        conn.rest.drain(..*n);
        let mut written = 0;
        if outcome.is_ok() {
            outcome = write_within(&mut conn.stream, payload, deadline).await;
            written = match &outcome {
                Ok(n) | Err((n, _)) => *n,
            };
            progressed |= written > 0;
        }
        // Every line begun is sent: a cut one is finished on this connection.
        let (mut begun, mut cut, mut start) = (0, false, 0);
        for line in &lines {
            if start >= written {
                break;
            }
            if line.end > written {
                conn.rest.extend_from_slice(&payload[written..line.end]);
                cut = true;
            }
            begun += 1;
            start = line.end;
        }
        let whole = (begun - usize::from(cut)) as u64;
        self.sent
            .extend(lines.into_iter().take(begun).map(|l| (l.key, l.value)));
        conn.unconfirmed += whole;
        match outcome {
            Ok(_) => {
                conn.stalled = 0;
                conn.awaiting = true;
                written
            }
            Err((_, why)) => {
                let give_up = match &why {
                    // A timeout: the connection is kept while the collector takes bytes.
                    None => {
                        conn.stalled = if progressed { 0 } else { conn.stalled + 1 };
                        conn.stalled >= STALLED_FLUSHES
                    }
                    Some(_) => true,
                };
                if give_up {
                    let lost = conn.unconfirmed + u64::from(!conn.rest.is_empty());
                    self.metrics.statsd_lines_lost(lost);
                    self.conn = None;
                }
                let why = why.map_or_else(|| "timed out".to_owned(), |e| e.to_string());
                self.failed(&why);
                written
            }
        }
    }

    fn succeeded(&mut self) {
        self.metrics.statsd_flush(LoadResult::success);
        // A collector that comes and goes every flush (UDP to a port nothing listens on
        // refuses every other datagram) is in the log once per interval, not every flush.
        static LOG: Throttle = Throttle::new(logs::EVERY);
        if std::mem::take(&mut self.failing)
            && let Some(held_back) = LOG.pass()
        {
            tracing::info!(addr = %self.options.addr, held_back, "statsd collector reachable again");
        }
    }

    fn failed(&mut self, why: &str) {
        self.metrics.statsd_flush(LoadResult::error);
        static LOG: Throttle = Throttle::new(logs::EVERY);
        if !std::mem::replace(&mut self.failing, true)
            && let Some(held_back) = LOG.pass()
        {
            tracing::warn!(addr = %self.options.addr, error = why, held_back, "statsd flush failed; stats wait for the next flush (TCP) or are dropped (UDP)");
        }
    }

    async fn send_udp(&mut self, payload: &[u8]) -> std::io::Result<()> {
        if self.conn.is_none() {
            let target = tokio::net::lookup_host(&self.options.addr)
                .await?
                .next()
                .ok_or_else(|| std::io::Error::other("no address"))?;
            let local = if target.is_ipv4() {
                "0.0.0.0:0"
            } else {
                "[::]:0"
            };
            let s = UdpSocket::bind(local).await?;
            s.connect(target).await?;
            self.conn = Some(Socket::Udp(s));
        }
        if let Some(Socket::Udp(s)) = &self.conn {
            for datagram in datagrams(payload) {
                s.send(datagram).await?;
            }
        }
        Ok(())
    }

    /// The lines of every stat that grew, at most [`MAX_FLUSH_BYTES`] of them, and the values
    /// they bring the stats to.
    fn payload(&mut self) -> (Vec<u8>, Vec<Line>) {
        let mut out = String::new();
        let mut lines = Vec::new();
        let stats = reference_stats(&self.metrics);
        // A stat no longer kept (its rule left the config) is forgotten here too: so the sink
        // holds no more than the stats do, and a rule back in force counts from its new 0.
        let kept: std::collections::HashSet<&str> = stats.iter().map(|s| s.key.as_str()).collect();
        self.sent.retain(|k, _| kept.contains(k.as_str()));
        for Stat { key, value, timer } in stats {
            let before = self.sent.get(&key).copied().unwrap_or(0);
            if value <= before {
                continue;
            }
            let name = key.split_once('@').map_or(key.as_str(), |(name, _)| name);
            let line = self.line(name, value - before, timer);
            if out.len() + line.len() > MAX_FLUSH_BYTES {
                break;
            }
            out.push_str(&line);
            lines.push(Line {
                end: out.len(),
                key,
                value,
            });
        }
        (out.into_bytes(), lines)
    }

    /// One line: a counter's `delta`, or `delta` samples of a timer's value (ms) as one line
    /// with a sample rate.
    fn line(&self, name: &str, delta: u64, timer: Option<f64>) -> String {
        let mut line = String::with_capacity(name.len() + 48);
        line.push_str(name);
        if self.options.format == Format::Statsd {
            for (k, v) in &self.options.tags {
                let _ = write!(line, ".__{k}={v}");
            }
        }
        match timer {
            None => {
                let _ = write!(line, ":{delta}|c");
            }
            Some(ms) => {
                let _ = write!(line, ":{ms}|ms");
                if delta > 1 {
                    let _ = write!(line, "|@{}", sample_rate(delta));
                }
            }
        }
        if self.options.format == Format::DogStatsd && !self.options.tags.is_empty() {
            line.push_str("|#");
            for (i, (k, v)) in self.options.tags.iter().enumerate() {
                if i > 0 {
                    line.push(',');
                }
                let _ = write!(line, "{k}:{v}");
            }
        }
        line.push('\n');
        line
    }
}

/// Every stat of envoyproxy/ratelimit's this service keeps, with its cumulative value now, by
/// key (without tags): what the sink sends the growth of, and the debug port's `/stats` lists.
/// The per-rule stats are there while they are counted (statsd on).
pub(crate) fn reference_stats(metrics: &Metrics) -> Vec<Stat> {
    let mut stats = Vec::new();
    if let Some(rules) = &metrics.decisions.statsd {
        for (domain, rule, counts) in rules.snapshot() {
            let key = sanitize(&format!("{domain}.{rule}"));
            for (stat, n) in RULE_STATS.iter().zip(counts) {
                stats.push(Stat::counter(
                    format!("ratelimit.service.rate_limit.{key}.{stat}"),
                    n,
                ));
            }
        }
    }
    let text = metrics.encode();
    let sum = |prefix: &str| -> u64 {
        text.lines()
            .filter(|l| l.starts_with(prefix))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum::<f64>() as u64
    };
    for (name, series) in [
        (
            "ratelimit.service.config_load_success",
            "ratelimit_config_loads_total{result=\"success\"} ",
        ),
        (
            "ratelimit.service.config_load_error",
            "ratelimit_config_loads_total{result=\"error\"} ",
        ),
        (
            "ratelimit.service.call.should_rate_limit.redis_error",
            "ratelimit_failure_mode_decisions_total{",
        ),
        (
            "ratelimit.service.call.should_rate_limit.service_error",
            "ratelimit_grpc_errors_total{code=\"internal\"} ",
        ),
        (
            "ratelimit_server.ShouldRateLimit.total_requests",
            "ratelimit_request_duration_seconds_count ",
        ),
    ] {
        stats.push(Stat::counter(name.to_owned(), sum(series)));
    }
    stats.extend(response_times(&text));
    stats
}

/// One stat's cumulative value: a counter, or the samples of a timer in one bucket (its key is
/// then `name@bucket`).
pub(crate) struct Stat {
    /// The stat's name (a timer's: `name@bucket`).
    pub(crate) key: String,
    /// Its cumulative value (a timer's: samples in the bucket).
    pub(crate) value: u64,
    /// A timer's value for this bucket, in milliseconds.
    pub(crate) timer: Option<f64>,
}

impl Stat {
    fn counter(key: String, value: u64) -> Stat {
        Stat {
            key,
            value,
            timer: None,
        }
    }
}

/// The timer `ratelimit_server.ShouldRateLimit.response_time` from the request histogram in
/// `text` (the registry, encoded): per bucket, the requests that fell in it so far, valued at
/// the bucket's middle in milliseconds (the last, unbounded one at its lower bound).
fn response_times(text: &str) -> Vec<Stat> {
    const BUCKET: &str = "ratelimit_request_duration_seconds_bucket{le=\"";
    let mut stats = Vec::new();
    let (mut below, mut lower) = (0u64, 0.0f64);
    for line in text.lines() {
        let Some(rest) = line.strip_prefix(BUCKET) else {
            continue;
        };
        let Some((le, count)) = rest.split_once("\"} ") else {
            continue;
        };
        let (Ok(upper), Ok(cumulative)) = (le.parse::<f64>(), count.trim().parse::<u64>()) else {
            continue;
        };
        let seconds = if upper.is_finite() {
            (lower + upper) / 2.0
        } else {
            lower
        };
        // To the nanosecond, so that 0.0375 is not written 0.037500000000000006.
        let ms = (seconds * 1e9).round() / 1e6;
        stats.push(Stat {
            key: format!("ratelimit_server.ShouldRateLimit.response_time@{le}"),
            value: cumulative.saturating_sub(below),
            timer: Some(ms),
        });
        (below, lower) = (cumulative, upper);
    }
    stats
}

/// The sample rate that makes a collector count one line `n` times: the largest `f64` not
/// above `1/n` whose inverse is at least `n`, so a collector that truncates `1/rate` (as
/// statsd_exporter does) still counts `n`. Written in full, never in exponent form.
fn sample_rate(n: u64) -> f64 {
    let n = n as f64;
    let mut rate = 1.0 / n;
    while 1.0 / rate < n {
        rate = f64::from_bits(rate.to_bits() - 1);
    }
    rate
}

/// The per-rule stats, in the order of `engine::report::reference_counts`.
const RULE_STATS: [&str; 5] = [
    "total_hits",
    "within_limit",
    "near_limit",
    "over_limit",
    "shadow_mode",
];

/// A stat key as envoyproxy/ratelimit cleans it: `:` and `|` (statsd's separators) become `_`,
/// and so do the dots of an IPv4 address (which would otherwise split the name's levels). So
/// do `\n` and `\r` (a value from metadata may hold them): a name never starts a line of its own.
pub(crate) fn sanitize(key: &str) -> String {
    let key = key.replace([':', '|', '\n', '\r'], "_");
    let bytes = key.as_bytes();
    let mut out = bytes.to_vec();
    let mut i = 0;
    while i < bytes.len() {
        if let Some(len) = ipv4_at(&bytes[i..]) {
            for b in &mut out[i..i + len] {
                if *b == b'.' {
                    *b = b'_';
                }
            }
            i += len;
        } else {
            i += 1;
        }
    }
    String::from_utf8(out).unwrap_or(key)
}

/// The length of `\d{1,3}\.\d{1,3}\.\d{1,3}\.\d{1,3}` at the start of `s`, if it is there
/// (the regular expression that service uses, matched leftmost and greedy as Go's does).
fn ipv4_at(s: &[u8]) -> Option<usize> {
    let mut at = 0;
    for group in 0..4 {
        let digits = s[at..]
            .iter()
            .take(3)
            .take_while(|b| b.is_ascii_digit())
            .count();
        if digits == 0 {
            return None;
        }
        at += digits;
        if group < 3 {
            if s.get(at) != Some(&b'.') {
                return None;
            }
            at += 1;
        }
    }
    Some(at)
}

/// `payload` cut at line ends into datagrams of at most [`DATAGRAM_BYTES`] (a longer line goes
/// alone).
fn datagrams(payload: &[u8]) -> Vec<&[u8]> {
    let mut out = Vec::new();
    let mut start = 0;
    let mut end = 0;
    for (i, b) in payload.iter().enumerate() {
        if *b != b'\n' {
            continue;
        }
        if i + 1 - start > DATAGRAM_BYTES && end > start {
            out.push(&payload[start..end]);
            start = end;
        }
        end = i + 1;
    }
    if end > start {
        out.push(&payload[start..end]);
    }
    out
}

/// Writes `bytes` within `deadline`: how many were written, and on failure why (`None`: the
/// deadline passed).
async fn write_within(
    stream: &mut TcpStream,
    bytes: &[u8],
    deadline: tokio::time::Instant,
) -> Result<usize, (usize, Option<std::io::Error>)> {
    let mut written = 0;
    while written < bytes.len() {
        match tokio::time::timeout_at(deadline, stream.write(&bytes[written..])).await {
            Ok(Ok(0)) => return Err((written, Some(std::io::ErrorKind::WriteZero.into()))),
            Ok(Ok(n)) => written += n,
            Ok(Err(e)) => return Err((written, Some(e))),
            Err(_) => return Err((written, None)),
        }
    }
    Ok(written)
}

/// Flushes `sink` every flush interval until `stopped`, then once more.
pub(crate) async fn run(mut sink: Sink, stopped: impl std::future::Future<Output = ()>) {
    tracing::info!(addr = %sink.options.addr, protocol = ?sink.options.protocol, format = ?sink.options.format, interval = ?sink.options.flush_interval, "sending stats to statsd");
    let mut tick = tokio::time::interval(sink.options.flush_interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    tick.tick().await;
    let mut stopped = std::pin::pin!(stopped);
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            () = &mut stopped => break,
        }
        sink.flush().await;
    }
    sink.flush().await;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_timer_bucket_is_counted_as_often_as_requests_fell_in_it() {
        for n in [2u64, 3, 6, 7, 49, 1_000, 123_457, 10_000_019] {
            let rate = sample_rate(n);
            let written: f64 = rate.to_string().parse().unwrap();
            assert!(!rate.to_string().contains('e'), "{rate}");
            assert_eq!(
                (1.0 / written) as u64,
                n,
                "truncated, as statsd_exporter does"
            );
            assert_eq!((1.0 / written).round() as u64, n, "rounded");
        }
        let text = "ratelimit_request_duration_seconds_count 7\n\
            ratelimit_request_duration_seconds_bucket{le=\"0.000025\"} 1\n\
            ratelimit_request_duration_seconds_bucket{le=\"0.00005\"} 1\n\
            ratelimit_request_duration_seconds_bucket{le=\"0.001\"} 5\n\
            ratelimit_request_duration_seconds_bucket{le=\"1.0\"} 6\n\
            ratelimit_request_duration_seconds_bucket{le=\"+Inf\"} 7\n";
        let got: Vec<(u64, f64)> = response_times(text)
            .into_iter()
            .map(|s| (s.value, s.timer.unwrap()))
            .collect();
        assert_eq!(
            got,
            [
                (1, 0.0125),
                (0, 0.0375),
                (4, 0.525),
                (1, 500.5),
                (1, 1000.0)
            ]
        );
    }

    #[test]
    fn keys_are_cleaned_as_that_service_cleans_them() {
        assert_eq!(
            sanitize("d.remote_address_10.0.0.1"),
            "d.remote_address_10_0_0_1"
        );
        assert_eq!(sanitize("d.k:v|w.1.2"), "d.k_v_w.1.2");
        assert_eq!(sanitize("d.k_a\nx:1|c\r"), "d.k_a_x_1_c_");
        // Unanchored, as Go's regexp finds it: from the 2.
        assert_eq!(sanitize("d.ip_1234.5.6.7"), "d.ip_1234_5_6_7");
        assert_eq!(sanitize("d.v_1.2.3"), "d.v_1.2.3");
        assert_eq!(sanitize("d.a_192.168.1.10.b"), "d.a_192_168_1_10.b");
    }

    #[test]
    fn datagrams_end_at_lines_and_fit() {
        let line = "x".repeat(99) + "\n";
        let payload = line.repeat(30);
        let cut = datagrams(payload.as_bytes());
        assert_eq!(cut.concat(), payload.as_bytes());
        assert!(
            cut.iter()
                .all(|d| d.len() <= DATAGRAM_BYTES && d.ends_with(b"\n"))
        );
        assert_eq!(cut.len(), 3);
        let long = "y".repeat(2000) + "\n";
        assert_eq!(datagrams(long.as_bytes()), vec![long.as_bytes()]);
    }
}
