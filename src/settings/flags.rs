//! The flags as clap parses them, and their value parsers.
//!
//! One rule for enums: every flag that takes one of a few words has its own clap `ValueEnum`
//! here, named `<Thing>Arg`; [`check`](super::check) maps it to the type of the module that
//! uses it. So clap stays in `settings`, and a module's type can change without changing a flag.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use clap::{Parser, ValueEnum};

use crate::limiter::redis::RedisUrl;

/// `--backend`: where counters are kept.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub(crate) enum BackendArg {
    /// In this process (the default): exact, fast, not shared between replicas.
    Memory,
    /// In Redis (standalone, cluster or sentinel), shared by every replica.
    Redis,
}

/// `--redis-failure-mode`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub(crate) enum FailureModeArg {
    /// gRPC UNAVAILABLE: Envoy's failure_mode_deny decides.
    Error,
    /// Answer OK.
    Allow,
    /// Answer OVER_LIMIT.
    Deny,
    /// Decide in this process until Redis is back.
    Local,
    /// Decide in this process on this replica's share of what was left, and write the hits
    /// admitted back when Redis is back.
    Share,
}

/// `--statsd-protocol`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub(crate) enum StatsdProtocolArg {
    /// Datagrams; one that cannot be sent is dropped.
    Udp,
    /// One connection; what a failed flush had is sent by the next.
    Tcp,
}

/// `--statsd-format`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub(crate) enum StatsdFormatArg {
    /// Tags in the name, `.__key=value` (envoyproxy/ratelimit's statsd sink).
    Statsd,
    /// DogStatsD tags, `|#key:value`.
    Dogstatsd,
}

/// `--redis-hash-tag`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub(crate) enum HashTagArg {
    /// One slot per domain: exact all-or-nothing in one call.
    Domain,
    /// One slot per descriptor: spreads a domain over a cluster.
    Descriptor,
}

/// `--response-headers`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub(crate) enum HeaderModeArg {
    /// None.
    Off,
    /// `X-RateLimit-Limit`, `-Remaining`, `-Reset`, as Envoy's DRAFT_VERSION_03 writes them.
    Draft03,
    /// `RateLimit-Policy` and `RateLimit` (draft-ietf-httpapi-ratelimit-headers).
    Ietf,
    /// envoyproxy/ratelimit's own `RateLimit-Limit`, `-Remaining`, `-Reset`
    /// (`LIMIT_RESPONSE_HEADERS_ENABLED=true`).
    Reference,
}

/// `--tracing-protocol`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub(crate) enum TracingProtocolArg {
    /// OTLP over HTTP (protobuf).
    Http,
    /// OTLP over gRPC.
    Grpc,
}

/// `--default-algorithm`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub(crate) enum AlgorithmArg {
    /// Counter per aligned window (envoyproxy/ratelimit's).
    FixedWindow,
    /// Two windows, the previous one weighted: no burst at the boundary.
    SlidingWindow,
    /// Every hit's time: exact, memory per hit.
    SlidingLog,
    /// Refills continuously up to a burst.
    TokenBucket,
}

/// `--top-values`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub(crate) enum TopValuesArg {
    /// As sent.
    Show,
    /// sha256: and the first 16 hex digits of the value's SHA-256.
    Hash,
    /// Not shown.
    Hide,
}

/// `--accounting`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub(crate) enum AccountingArg {
    /// A descriptor with its own hits_addend greater than 0 is a cost report (recorded even
    /// past the limit); any other is an admission (a refused request consumes nothing).
    Auto,
    /// Every descriptor is an admission (STOP_CACHE_KEY_INCREMENT_WHEN_OVERLIMIT=true).
    Admission,
    /// Every descriptor is a cost report: hits are recorded even when refused, as
    /// envoyproxy/ratelimit counts them.
    Report,
}

/// Parses a Redis URL flag. A custom parser (not a function) so that a refused value is never
/// echoed: clap would print the whole value, password included.
#[derive(Clone)]
struct RedisUrlParser;

impl clap::builder::TypedValueParser for RedisUrlParser {
    type Value = RedisUrl;

    fn parse_ref(
        &self,
        _cmd: &clap::Command,
        arg: Option<&clap::Arg>,
        value: &std::ffi::OsStr,
    ) -> Result<RedisUrl, clap::Error> {
        let flag = arg.map_or("a Redis URL".to_owned(), |a| a.to_string());
        let text = value.to_str().ok_or_else(|| {
            clap::Error::raw(
                clap::error::ErrorKind::InvalidUtf8,
                format!("{flag}: not UTF-8\n"),
            )
        })?;
        RedisUrl::parse(text).map_err(|e| {
            clap::Error::raw(
                clap::error::ErrorKind::ValueValidation,
                format!("invalid value for {flag}: {e}\n"),
            )
        })
    }
}

/// A flag value that is never shown (`Debug` prints `***`).
#[derive(Clone, PartialEq, Eq)]
pub(crate) struct Secret(pub(crate) String);

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("***")
    }
}

/// What `--version` prints after the name: the release and the time-zone data built in, which
/// calendar windows follow (`ratelimitd 0.1.0 (tzdb 2026f)`).
fn version() -> &'static str {
    static VERSION: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    VERSION.get_or_init(|| {
        format!(
            "{} (tzdb {})",
            env!("CARGO_PKG_VERSION"),
            crate::limiter::calendar::tzdb_version()
        )
    })
}

fn parse_zone(s: &str) -> Result<String, String> {
    match crate::limiter::calendar::zone(s) {
        Some(zone) => Ok(zone.name().to_owned()),
        None => Err(crate::limiter::calendar::unknown_zone(s)),
    }
}

fn parse_secret(s: &str) -> Result<Secret, String> {
    Ok(Secret(s.to_owned()))
}

/// `--log-format`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub(crate) enum LogFormatArg {
    /// Human-readable lines.
    Text,
    /// One JSON object per line.
    Json,
}

/// The command line as clap parses it: every flag, each also read from `RATELIMITD_<FLAG>`
/// when not given. [`parse`](super::parse) checks it into [`Options`](super::Options).
#[derive(Clone, Debug, Parser)]
#[command(
    name = "ratelimitd",
    version = version(),
    about = "Rate-limit service for Envoy and Istio (envoy.service.ratelimit.v3)",
    after_help = "Every flag can also be set as RATELIMITD_<FLAG>, e.g. RATELIMITD_GRPC_ADDR=0.0.0.0:8081; \
                  RATELIMITD_CONFIG takes a comma-separated list.\n\n\
                  `ratelimitd top --addr HOST:PORT` prints who is being limited (GET /top) as a \
                  table, refreshed (`ratelimitd top --help`)."
)]
pub(crate) struct Flags {
    /// Config file or directory (every *.yaml/*.yml inside, dot-files skipped); repeatable.
    /// Without it (and without RATELIMITD_CONFIG) the service reads envoyproxy/ratelimit's
    /// RUNTIME_ROOT/RUNTIME_SUBDIRECTORY/RUNTIME_APPDIRECTORY, as that service does.
    #[arg(long = "config", value_name = "PATH")]
    pub(crate) config: Vec<PathBuf>,

    /// Read the config from this xDS control plane (`host:port` or `http://host:port`) instead of
    /// files: one ADS stream of envoyproxy/ratelimit's RateLimitConfig, as Envoy Gateway serves
    /// it. The service starts once the first config is accepted.
    #[arg(long, value_name = "URL", conflicts_with = "config")]
    pub(crate) xds_server: Option<String>,

    /// node.id presented to the xDS server (it serves the snapshot kept for this id).
    #[arg(long, default_value = "default")]
    pub(crate) xds_node_id: String,

    /// node.metadata presented to the xDS server: comma-separated `key=value` pairs.
    #[arg(long, default_value = "")]
    pub(crate) xds_node_metadata: String,

    /// gRPC metadata sent on the xDS stream: comma-separated `key=value` pairs.
    #[arg(long, default_value = "")]
    pub(crate) xds_headers: String,

    /// Shortest wait before reopening a failed xDS stream.
    #[arg(long, default_value = "10s", value_parser = parse_xds_duration)]
    pub(crate) xds_backoff_initial: Duration,

    /// Longest wait before reopening a failed xDS stream.
    #[arg(long, default_value = "60s", value_parser = parse_xds_duration)]
    pub(crate) xds_backoff_max: Duration,

    /// Growth of the wait per failed attempt (envoyproxy/ratelimit's default, 0.5, never grows).
    #[arg(long, default_value_t = 0.5)]
    pub(crate) xds_backoff_factor: f64,

    /// Draw each wait at random between the shortest and the computed one.
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set, num_args = 0..=1, default_missing_value = "true")]
    pub(crate) xds_backoff_jitter: bool,

    /// Longest wait for an xDS stream to open: the TCP connection, TLS, HTTP/2 and the
    /// server's answer to the stream's request (envoyproxy/ratelimit's gRPC dial gives up after
    /// 20 s). Past it the attempt is abandoned and retried after the backoff.
    #[arg(long, default_value = "20s", value_parser = parse_xds_duration)]
    pub(crate) xds_connect_timeout: Duration,

    /// Longest wait for the first response on an open xDS stream; past it the stream is
    /// abandoned and reopened after the backoff. Later silence is normal (the config did not
    /// change): HTTP/2 and TCP keepalive watch the connection then.
    #[arg(long, default_value = "60s", value_parser = parse_xds_duration)]
    pub(crate) xds_response_timeout: Duration,

    /// HTTP/2 PING interval on the xDS connection. gRPC servers refuse pings more frequent than
    /// every 5 minutes by default (Envoy Gateway's keeps that default) with a GOAWAY, so
    /// shorter needs a server that permits it; TCP keepalive (60 s idle, 3 probes 10 s apart)
    /// notices a dead peer host sooner regardless.
    #[arg(long, default_value = "5m", value_parser = parse_xds_duration)]
    pub(crate) xds_keepalive_interval: Duration,

    /// How long an HTTP/2 PING on the xDS connection may go unanswered before the connection
    /// is given up (and the stream reopened after the backoff).
    #[arg(long, default_value = "20s", value_parser = parse_xds_duration)]
    pub(crate) xds_keepalive_timeout: Duration,

    /// Connect to the xDS server over TLS, trusting this CA bundle (PEM).
    #[arg(long, value_name = "PATH")]
    pub(crate) xds_tls_ca: Option<PathBuf>,

    /// Client certificate chain (PEM) for TLS to the xDS server; with --xds-tls-key.
    #[arg(long, value_name = "PATH", requires = "xds_tls_key")]
    pub(crate) xds_tls_cert: Option<PathBuf>,

    /// Client key (PEM) for TLS to the xDS server; with --xds-tls-cert.
    #[arg(long, value_name = "PATH", requires = "xds_tls_cert")]
    pub(crate) xds_tls_key: Option<PathBuf>,

    /// The name the xDS server's certificate must carry (default: the server URL's host).
    #[arg(long, value_name = "NAME")]
    pub(crate) xds_tls_server_name: Option<String>,

    /// Largest xDS response accepted, e.g. 4MiB.
    #[arg(long, default_value = "4MiB", value_parser = parse_bytes)]
    pub(crate) xds_max_message_bytes: u64,

    /// With --xds-server: serve at once, before the first config arrives; until then requests
    /// fail (UNKNOWN, "no rate limit configuration loaded"). Without it nothing is served until
    /// the first config.
    #[arg(long, default_value_t = false, action = clap::ArgAction::Set, num_args = 0..=1, default_missing_value = "true")]
    pub(crate) start_without_config: bool,

    /// With --xds-server: health (gRPC and /healthcheck) reports not serving until the first
    /// config is accepted.
    #[arg(long, default_value_t = false, action = clap::ArgAction::Set, num_args = 0..=1, default_missing_value = "true")]
    pub(crate) unhealthy_until_config: bool,

    /// The algorithm of every limit that names none, in files and over xDS alike (Envoy
    /// Gateway's API has no field for one: set RATELIMITD_DEFAULT_ALGORITHM in its deployment).
    #[arg(long, value_enum, default_value = "fixed-window")]
    pub(crate) default_algorithm: AlgorithmArg,

    /// Make every limit of an hour or longer that names no `calendar` follow the calendar of
    /// this IANA time zone (e.g. Europe/Berlin, UTC): a day from local midnight, a month from
    /// the 1st, in files and over xDS alike (Envoy Gateway's API has no field for it: set
    /// RATELIMITD_CALENDAR_TIMEZONE in its deployment). Limits of seconds or minutes, and
    /// those whose algorithm or unit_multiplier cannot take a calendar, are left as they are
    /// (logged once). Unset: windows are fixed lengths from the Unix epoch, as in
    /// envoyproxy/ratelimit (a month is 30 days).
    #[arg(long, value_name = "ZONE", value_parser = parse_zone)]
    pub(crate) calendar_timezone: Option<String>,

    /// How limits that set no `accounting` of their own count a descriptor's hits: auto (a
    /// descriptor carrying its own hits_addend > 0 is a cost report, as Envoy sends when a
    /// stream is done), admission (all-or-nothing) or report (recorded even when over).
    #[arg(long, value_enum, default_value = "auto")]
    pub(crate) accounting: AccountingArg,

    /// How far past its limit one cost report may take a counter, in limits: the count at most
    /// (1 + N) × requests_per_unit (a token bucket: at most N × requests_per_unit tokens below
    /// empty). 0: a report fills the limit and no more.
    #[arg(long, value_name = "N", default_value_t = crate::limiter::DEFAULT_MAX_DEBT,
        value_parser = clap::value_parser!(u64).range(0..=crate::limiter::MAX_MAX_DEBT))]
    pub(crate) max_debt: u64,

    /// Also export envoyproxy/ratelimit's per-rule families on /metrics
    /// (`ratelimit_service_rate_limit_{total_hits,within_limit,near_limit,over_limit,shadow_mode}`
    /// with labels domain, key1, key2, as Envoy Gateway's dashboard reads them) and the process's
    /// memory. Set by USE_PROMETHEUS=true.
    #[arg(long, default_value_t = false, action = clap::ArgAction::Set, num_args = 0..=1, default_missing_value = "true")]
    pub(crate) reference_metrics: bool,

    /// How long the per-rule series of a rule removed from the config stay on /metrics, so
    /// that every scraper (an HA pair of Prometheus, a dashboard) sees its last increase: at
    /// least two scrape intervals of the slowest. They go sooner when the second config after
    /// the one that removed it comes in force. At most 1h.
    #[arg(long, default_value = "10m", value_parser = parse_grace)]
    pub(crate) removed_series_grace: Duration,

    /// Also send envoyproxy/ratelimit's stats, as it names them, to this statsd collector
    /// (host:port) every --statsd-flush-interval; off when unset. Set by USE_STATSD and
    /// USE_DOG_STATSD with STATSD_HOST and STATSD_PORT.
    #[arg(long, value_parser = parse_host_port)]
    pub(crate) statsd_addr: Option<String>,

    /// udp or tcp (envoyproxy/ratelimit's STATSD_PROTOCOL, whose default is tcp).
    #[arg(long, value_enum, default_value = "udp")]
    pub(crate) statsd_protocol: StatsdProtocolArg,

    /// statsd (tags in the name, as envoyproxy/ratelimit sends them) or dogstatsd.
    #[arg(long, value_enum, default_value = "statsd")]
    pub(crate) statsd_format: StatsdFormatArg,

    /// Tags on every stat, `key:value,key2:value2` (envoyproxy/ratelimit's EXTRA_TAGS).
    #[arg(long, value_parser = parse_tags, default_value = "")]
    pub(crate) statsd_tags: Tags,

    /// How often stats are sent (STATS_FLUSH_INTERVAL).
    #[arg(long, default_value = "10s", value_parser = parse_xds_duration)]
    pub(crate) statsd_flush_interval: Duration,

    /// Export a span per ShouldRateLimit call (and its Redis wait) over OTLP, continuing the
    /// caller's W3C traceparent.
    #[arg(long, default_value_t = false, action = clap::ArgAction::Set, num_args = 0..=1, default_missing_value = "true")]
    pub(crate) tracing: bool,

    /// OTLP transport for --tracing: http (to ENDPOINT/v1/traces) or grpc.
    #[arg(long, value_enum, default_value = "http")]
    pub(crate) tracing_protocol: TracingProtocolArg,

    /// The OTLP collector's base URL (default: localhost on 4318 for http, 4317 for grpc).
    #[arg(long, value_name = "URL")]
    pub(crate) tracing_endpoint: Option<String>,

    /// The traces' service.name.
    #[arg(long, default_value = "ratelimitd")]
    pub(crate) tracing_service_name: String,

    /// The traces' service.namespace.
    #[arg(long)]
    pub(crate) tracing_service_namespace: Option<String>,

    /// The traces' service.instance.id.
    #[arg(long)]
    pub(crate) tracing_service_instance_id: Option<String>,

    /// Fraction of new traces sampled, 0 to 1; a caller's sampling decision is followed.
    #[arg(long, default_value_t = 1.0, value_parser = parse_ratio)]
    pub(crate) tracing_sampling_rate: f64,

    /// Load the config files, print their rules as /rlconfig does and exit: 0 when they are
    /// valid, 1 with the file, line and field of the first error. For CI and pre-commit hooks.
    #[arg(long)]
    pub(crate) check: bool,

    /// Keep a light load on one tokio worker thread and bring in more only while those taking
    /// tasks are saturated (the worker gate; docs/operations.md, "Worker threads"). Off: every
    /// worker takes tasks at any load, as tokio does by default.
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set, num_args = 0..=1, default_missing_value = "true")]
    pub(crate) worker_gate: bool,

    /// envoyproxy/ratelimit variables that were set but change nothing here (logged at start).
    #[arg(skip)]
    pub(crate) ignored_env: Vec<String>,

    /// gRPC listen address (RateLimitService and grpc.health.v1).
    #[arg(long, default_value = "0.0.0.0:8081")]
    pub(crate) grpc_addr: SocketAddr,

    /// Serve gRPC over TLS with this certificate chain (PEM); with --grpc-tls-key. Reloaded
    /// when the file changes.
    #[arg(long, requires = "grpc_tls_key")]
    pub(crate) grpc_tls_cert: Option<PathBuf>,

    /// The gRPC listener's private key (PEM).
    #[arg(long, requires = "grpc_tls_cert")]
    pub(crate) grpc_tls_key: Option<PathBuf>,

    /// Require client certificates issued by this CA (PEM) on the gRPC listener (mutual TLS).
    #[arg(long, requires = "grpc_tls_cert")]
    pub(crate) grpc_tls_client_ca: Option<PathBuf>,

    /// Admit only client certificates valid for this name (a DNS name, wildcards as WebPKI
    /// reads them, or an IP address) among their subject alternative names, after the CA's
    /// checks (envoyproxy/ratelimit's GRPC_CLIENT_TLS_SAN).
    #[arg(long, requires = "grpc_tls_client_ca")]
    pub(crate) grpc_tls_client_san: Option<String>,

    /// Serve gRPC on this Unix socket instead of --grpc-addr (sidecar deployments;
    /// envoyproxy/ratelimit's GRPC_UDS). Plain text only. A socket file an earlier run left
    /// there is replaced.
    #[arg(long, conflicts_with = "grpc_tls_cert")]
    pub(crate) grpc_uds: Option<PathBuf>,

    /// Permission bits of the --grpc-uds socket, in octal: 660 lets the service's user and
    /// group connect; 666 lets anyone who can reach the directory.
    #[arg(long, default_value = "660", value_parser = parse_mode)]
    pub(crate) grpc_uds_mode: u32,

    /// HTTP listen address (/healthcheck, /metrics, /rlconfig).
    #[arg(long, default_value = "0.0.0.0:8080")]
    pub(crate) http_addr: SocketAddr,

    /// Also serve the HTTP endpoints here, with the debug pages: /stats and a CPU profile at
    /// /debug/pprof/profile (envoyproxy/ratelimit's debug port, DEBUG_PORT).
    #[arg(long)]
    pub(crate) debug_addr: Option<SocketAddr>,

    /// Also serve the HTTP endpoints here (envoyproxy/ratelimit's PROMETHEUS_ADDR).
    #[arg(long)]
    pub(crate) metrics_addr: Option<SocketAddr>,

    /// Where counters are kept.
    #[arg(long, value_enum, default_value = "memory")]
    pub(crate) backend: BackendArg,

    /// Log format.
    #[arg(long, value_enum, default_value = "text")]
    pub(crate) log_format: LogFormatArg,

    /// Log filter: a level (error, warn, info, debug, trace) or tracing directives.
    #[arg(long, default_value = "info")]
    pub(crate) log_level: String,

    /// Fraction of a limit past which a decision is counted as near_limit.
    #[arg(long, default_value_t = 0.8, value_parser = parse_ratio)]
    pub(crate) near_limit_ratio: f64,

    /// Answer OK overall whatever the limits say (statuses and metrics still report them).
    #[arg(long, default_value_t = false, action = clap::ArgAction::Set, num_args = 0..=1, default_missing_value = "true")]
    pub(crate) shadow_mode: bool,

    /// Every limit soft, as if each descriptor had quota_mode (envoyproxy/ratelimit's
    /// QUOTA_MODE): a request is refused only when all its descriptors are over; one that
    /// matches no limit, or is in shadow mode, passes, so such a request is never refused.
    #[arg(long, default_value_t = false, action = clap::ArgAction::Set, num_args = 0..=1, default_missing_value = "true")]
    pub(crate) quota_mode: bool,

    /// Let several config files (or xDS configs) carry the same domain: their descriptors are
    /// merged, and one descriptor defined twice is an error naming both files
    /// (envoyproxy/ratelimit's MERGE_DOMAIN_CONFIG). Without it a duplicate domain is an error.
    #[arg(long, default_value_t = false, action = clap::ArgAction::Set, num_args = 0..=1, default_missing_value = "true")]
    pub(crate) merge_domain_config: bool,

    /// Serve the admin API (inspect and reset counters) on the gRPC port, without asking who
    /// calls. Deprecated: use --admin-addr, which asks for a token. Ignored with --admin-addr.
    #[arg(long, default_value_t = false, action = clap::ArgAction::Set, num_args = 0..=1, default_missing_value = "true")]
    pub(crate) admin: bool,

    /// The admin listener: the admin API and the operator's overrides (/v1/overrides), on a
    /// port of its own, every call with a token of --admin-token-file. Off unless set; once
    /// set, the gRPC port no longer serves the admin API.
    #[arg(long)]
    pub(crate) admin_addr: Option<SocketAddr>,

    /// The admin listener's bearer tokens: one name:token per line (a token 16 bytes or
    /// more), read again within a second of a change.
    #[arg(long)]
    pub(crate) admin_token_file: Option<std::path::PathBuf>,

    /// Serve the admin listener over TLS with this certificate chain (PEM), reloaded when it
    /// changes.
    #[arg(long, requires = "admin_tls_key")]
    pub(crate) admin_tls_cert: Option<std::path::PathBuf>,

    /// The admin listener's private key (PEM).
    #[arg(long, requires = "admin_tls_cert")]
    pub(crate) admin_tls_key: Option<std::path::PathBuf>,

    /// Require admin callers' certificates from this CA (mutual TLS); without
    /// --admin-token-file, a verified certificate is who calls (named by its SHA-256).
    #[arg(long, requires = "admin_tls_cert")]
    pub(crate) admin_tls_client_ca: Option<std::path::PathBuf>,

    /// On the memory backend, where the operator's overrides are kept across restarts
    /// (written atomically). With Redis they live in Redis.
    #[arg(long)]
    pub(crate) overrides_file: Option<std::path::PathBuf>,

    /// Most operator overrides in force at once; a PUT past it is refused.
    #[arg(long, default_value_t = crate::config::overrides::DEFAULT_MAX_OVERRIDES)]
    pub(crate) max_overrides: usize,

    /// Rate-limit headers for Envoy to add to the client's response.
    #[arg(long, value_enum, default_value = "off")]
    pub(crate) response_headers: HeaderModeArg,

    /// What a client is told about a limit that sets no `answer` of its own: a YAML file
    /// holding what an `answer` holds (headers, over_limit: headers, body, content_type).
    /// Read at start (docs/configuration.md, "What a limited client is told").
    #[arg(long)]
    pub(crate) default_answer: Option<std::path::PathBuf>,

    /// With `--response-headers reference`: the header carrying the limit
    /// (envoyproxy/ratelimit's LIMIT_LIMIT_HEADER).
    #[arg(long, default_value = "RateLimit-Limit", value_parser = parse_header_name)]
    pub(crate) reference_limit_header: String,

    /// With `--response-headers reference`: the header carrying what is left
    /// (LIMIT_REMAINING_HEADER).
    #[arg(long, default_value = "RateLimit-Remaining", value_parser = parse_header_name)]
    pub(crate) reference_remaining_header: String,

    /// With `--response-headers reference`: the header carrying the seconds to the end of the
    /// limit's unit (LIMIT_RESET_HEADER).
    #[arg(long, default_value = "RateLimit-Reset", value_parser = parse_header_name)]
    pub(crate) reference_reset_header: String,

    /// Return the config `metadata` of the descriptors that passed (and the request's
    /// descriptors) in each response's dynamic_metadata, as envoyproxy/ratelimit does.
    #[arg(long, default_value_t = false, action = clap::ArgAction::Set, num_args = 0..=1, default_missing_value = "true")]
    pub(crate) response_dynamic_metadata: bool,

    /// Most descriptors in one request.
    #[arg(long, default_value_t = 64)]
    pub(crate) max_descriptors: usize,

    /// Most entries in one descriptor.
    #[arg(long, default_value_t = 32)]
    pub(crate) max_entries: usize,

    /// Longest entry key, in bytes.
    #[arg(long, default_value_t = 4096)]
    pub(crate) max_key_bytes: usize,

    /// Longest entry value, in bytes.
    #[arg(long, default_value_t = 4096)]
    pub(crate) max_value_bytes: usize,

    /// Most counters one request may touch (its descriptors' limits, after merging the same
    /// counter), so that one request's CPU and Redis time stay bounded.
    #[arg(long, default_value_t = 256)]
    pub(crate) max_counters: usize,

    /// Redis server (standalone): `redis://[user:pass@]host:port[/db]`, or `rediss://` for TLS.
    #[arg(long, value_parser = RedisUrlParser)]
    pub(crate) redis_url: Option<RedisUrl>,

    /// Redis Cluster seed nodes, comma-separated URLs.
    #[arg(long, value_parser = RedisUrlParser, value_delimiter = ',')]
    pub(crate) redis_cluster_nodes: Vec<RedisUrl>,

    /// Redis Sentinel nodes, comma-separated URLs (with --redis-sentinel-master).
    #[arg(long, value_parser = RedisUrlParser, value_delimiter = ',')]
    pub(crate) redis_sentinel_nodes: Vec<RedisUrl>,

    /// The master name the sentinels monitor.
    #[arg(long)]
    pub(crate) redis_sentinel_master: Option<String>,

    /// ACL user for Redis data nodes (standalone, cluster, or the master Sentinel names) whose
    /// URL has no user information. Sentinels take theirs from their own URLs.
    #[arg(long)]
    pub(crate) redis_username: Option<String>,

    /// Password for Redis data nodes whose URL has none (best set as RATELIMITD_REDIS_PASSWORD
    /// from a Secret). Sentinels take theirs from their own URLs.
    #[arg(long, value_parser = parse_secret)]
    pub(crate) redis_password: Option<Secret>,

    /// Reach Redis data nodes over TLS (as if their URLs said rediss://); for Sentinel, the master.
    #[arg(long, default_value_t = false, action = clap::ArgAction::Set, num_args = 0..=1, default_missing_value = "true")]
    pub(crate) redis_tls: bool,

    /// Accept the Redis server's certificate whatever names it carries (managed Redis whose
    /// certificate names an address you do not connect to). Its chain is still verified against
    /// --redis-tls-ca or the system's roots, and its dates; only the name check is skipped.
    /// Every node: standalone, cluster, sentinels and their master (envoyproxy/ratelimit's
    /// REDIS_TLS_SKIP_HOSTNAME_VERIFICATION).
    #[arg(long, default_value_t = false, action = clap::ArgAction::Set, num_args = 0..=1, default_missing_value = "true")]
    pub(crate) redis_tls_skip_hostname_verification: bool,

    /// Verify the standalone Redis server's certificate against this name instead of the URL's
    /// host, which is still the address dialled (a certificate that names something other than
    /// the address you reach it by); with Sentinel, the master's, at the address announced. The
    /// chain, dates and key usage are verified as ever.
    #[arg(long)]
    pub(crate) redis_tls_server_name: Option<String>,

    /// A second Redis (standalone) for the counters of windows shorter than a minute, kept
    /// apart from the longer ones (envoyproxy/ratelimit's REDIS_PERSECOND_URL). Same forms as
    /// --redis-url; the TLS files, timeout and call bounds are shared.
    #[arg(long, value_parser = RedisUrlParser)]
    pub(crate) redis_per_second_url: Option<RedisUrl>,

    /// The per-second store as a Redis Cluster: seed nodes, comma-separated URLs.
    #[arg(long, value_parser = RedisUrlParser, value_delimiter = ',')]
    pub(crate) redis_per_second_cluster_nodes: Vec<RedisUrl>,

    /// The per-second store behind Sentinel: sentinel nodes, comma-separated URLs (with
    /// --redis-per-second-sentinel-master).
    #[arg(long, value_parser = RedisUrlParser, value_delimiter = ',')]
    pub(crate) redis_per_second_sentinel_nodes: Vec<RedisUrl>,

    /// The master name the per-second store's sentinels monitor.
    #[arg(long)]
    pub(crate) redis_per_second_sentinel_master: Option<String>,

    /// ACL user for the per-second store's data nodes whose URL has none.
    #[arg(long)]
    pub(crate) redis_per_second_username: Option<String>,

    /// Password for the per-second store's data nodes whose URL has none.
    #[arg(long, value_parser = parse_secret)]
    pub(crate) redis_per_second_password: Option<Secret>,

    /// Reach the per-second store's data nodes over TLS; for Sentinel, its master.
    #[arg(long, default_value_t = false, action = clap::ArgAction::Set, num_args = 0..=1, default_missing_value = "true")]
    pub(crate) redis_per_second_tls: bool,

    /// CA certificate (PEM) to verify a rediss:// server.
    #[arg(long)]
    pub(crate) redis_tls_ca: Option<PathBuf>,

    /// Client certificate (PEM) for mutual TLS.
    #[arg(long)]
    pub(crate) redis_tls_cert: Option<PathBuf>,

    /// Client key (PEM) for mutual TLS.
    #[arg(long)]
    pub(crate) redis_tls_key: Option<PathBuf>,

    /// Budget for one Redis call, redirections and retries included.
    #[arg(long, default_value = "100ms", value_parser = parse_timeout)]
    pub(crate) redis_timeout: Duration,

    /// What to answer while Redis is unavailable.
    #[arg(long, value_enum, default_value = "error")]
    pub(crate) redis_failure_mode: FailureModeArg,

    /// With `--redis-failure-mode share`: a request Redis has not answered after this is
    /// decided alone, so that it is answered before Envoy's timeout (20 ms by default) lets it
    /// through.
    #[arg(long, default_value = "10ms", value_parser = parse_timeout)]
    pub(crate) redis_share_after: Duration,

    /// Prefix of every Redis key.
    #[arg(long, default_value = "ratelimit:")]
    pub(crate) redis_key_prefix: String,

    /// What a key's cluster hash tag covers.
    #[arg(long, value_enum, default_value = "domain")]
    pub(crate) redis_hash_tag: HashTagArg,

    /// Most Redis script calls in flight at once: while fewer are in flight, a call goes at once
    /// with every request queued; while this many are, requests arriving meanwhile share the
    /// next call.
    #[arg(long, default_value_t = 2, value_parser = clap::builder::TypedValueParser::map(clap::value_parser!(u16).range(1..=64), usize::from))]
    pub(crate) redis_pipeline: usize,

    /// Most requests one Redis script call decides (1 turns coalescing off).
    // 128: docs/performance.md, "Measurements behind the code".
    #[arg(long, default_value_t = 128, value_parser = clap::builder::TypedValueParser::map(clap::value_parser!(u16).range(1..=1024), usize::from))]
    pub(crate) redis_max_batch: usize,

    /// Bytes of the local over-limit cache, keys included (0 = off), e.g. 1MiB.
    #[arg(long, default_value = "0", value_parser = parse_bytes)]
    pub(crate) local_cache_bytes: u64,

    /// Bytes of counter state the memory backend (or the `local` failure mode) may hold, keys
    /// included; past it the counters closest to expiry are given up, e.g. 64MiB.
    #[arg(long, default_value = "64MiB", value_parser = parse_bytes)]
    pub(crate) memory_max_bytes: u64,

    /// Descriptors counted per limit for `/top` (who is being limited): Space-Saving
    /// counters, so any descriptor asking for more than 1/N of a limit's hits is listed, each
    /// count within N-th of the limit's hits. 0 turns the sketches off.
    #[arg(long, default_value_t = crate::top::TopOptions::default().capacity,
        value_parser = clap::builder::TypedValueParser::map(clap::value_parser!(u16).range(0..=4096), usize::from))]
    pub(crate) top_capacity: usize,

    /// Memory all of `/top`'s sketches may hold, descriptors' bytes included; a limit that
    /// finds no room takes the place of the lightest (a request's override never displaces a
    /// configured limit), e.g. 4MiB.
    #[arg(long, default_value = "4MiB", value_parser = parse_bytes)]
    pub(crate) top_memory_bytes: u64,

    /// How long each window of `/top`'s counts lasts: they cover the current window and the
    /// previous one (so between one and two of these).
    #[arg(long, default_value = "60s", value_parser = parse_xds_duration)]
    pub(crate) top_window: Duration,

    /// With Redis: how often each replica publishes its `/top` view there and reads the
    /// others' (a view expires after three of these, so a dead replica's ages out). From 1s
    /// to 1h: each replica reads every other's view each interval, so a shorter one would
    /// load Redis and the network for no one's benefit.
    #[arg(long, default_value = "5s", value_parser = parse_publish_interval)]
    pub(crate) top_publish_interval: Duration,

    /// How `/top` shows descriptor values, at least (a limit's own `top_values` may show
    /// less): show, hash (sha256: and 16 hex digits) or hide.
    #[arg(long, value_enum, default_value = "show")]
    pub(crate) top_values: TopValuesArg,

    /// Export each limit's first N descriptors (most refused, then heaviest) on /metrics as `ratelimit_top_hits` and
    /// `ratelimit_top_over_limit` (values as `--top-values` and the limit's `top_values` show
    /// them, cut to 128 characters; at most 1,000 series per family), for a dashboard panel.
    /// 0 (the default): not exported; `/top` answers either way.
    #[arg(long, value_name = "N", default_value_t = 0,
        value_parser = clap::builder::TypedValueParser::map(clap::value_parser!(u16).range(0..=100), usize::from))]
    pub(crate) top_metrics: usize,

    /// After SIGTERM, how long health says not-serving while calls are still accepted and
    /// answered, before connections are sent GOAWAY: long enough for the endpoint's removal to
    /// reach every Envoy (kube-proxy, EDS), so that none is refused a connection meanwhile.
    /// SIGINT skips it. At most 10m.
    #[arg(long, default_value = "5s", value_parser = parse_drain)]
    pub(crate) drain_delay: Duration,

    /// How long in-flight calls may take to finish after the drain (GOAWAY sent) before the
    /// process exits anyway.
    #[arg(long, default_value = "10s", value_parser = parse_grace)]
    pub(crate) shutdown_grace: Duration,

    /// Most client connections the gRPC port holds at once; one more is closed at accept.
    #[arg(long, default_value_t = 4096)]
    pub(crate) max_connections: usize,

    /// A connection that sends nothing, or reads nothing the server writes, for this long is
    /// closed (gRPC clients are pinged every third of it, so a live one never is).
    #[arg(long, default_value = "30s", value_parser = parse_timeout)]
    pub(crate) connection_idle_timeout: Duration,

    /// A gRPC connection is sent GOAWAY after about this long (each connection within ±10% of
    /// it), so that Envoy reconnects and new replicas take their share; 0 keeps connections
    /// for as long as their clients do. E.g. 30m, 2h.
    #[arg(long, default_value = "30m", value_parser = parse_age)]
    pub(crate) grpc_max_connection_age: Duration,

    /// How long the streams of a connection sent GOAWAY for its age may go on before it is
    /// closed.
    #[arg(long, default_value = "1m", value_parser = parse_age)]
    pub(crate) grpc_max_connection_age_grace: Duration,

    /// Longest time to receive a request and answer it (gRPC and HTTP); a gRPC client's
    /// shorter `grpc-timeout` wins.
    #[arg(long, default_value = "5s", value_parser = parse_timeout)]
    pub(crate) request_timeout: Duration,

    /// Bytes of requests one gRPC connection may have in flight (from their first byte until
    /// answered), e.g. 4MiB; a request past it is refused on that connection only.
    #[arg(long, default_value = "4MiB", value_parser = parse_bytes)]
    pub(crate) max_connection_request_bytes: u64,

    /// Largest header block one gRPC call may carry, in HTTP/2's measure (each field's name
    /// and value plus 32 bytes), e.g. 1MiB; from 16KiB to 16MiB. Envoy copies a client's trace
    /// headers (W3C `tracestate`, `baggage`) into its calls, up to its own
    /// `max_request_headers_kb` (60 KiB by default, 8 MiB at most), and lets a call refused
    /// for them through. A call's headers count against --max-connection-request-bytes while
    /// it is in flight.
    #[arg(long, default_value = "1MiB", value_parser = parse_header_bytes)]
    pub(crate) grpc_max_header_bytes: u64,

    /// How long an RLQS quota assignment lasts, in whole seconds (Envoy reads no fraction and
    /// expires a shorter one at once); refreshed in the answer to every report.
    #[arg(long, default_value = "20s", value_parser = parse_ttl)]
    pub(crate) rlqs_assignment_ttl: Duration,

    /// An RLQS bucket reported with no requests for this long is abandoned (Envoy then forgets
    /// it until its next request).
    #[arg(long, default_value = "60s", value_parser = parse_grace)]
    pub(crate) rlqs_abandon_after: Duration,

    /// How often RLQS clients are expected to report (Envoy: every 5 s); a client silent for
    /// twice this long is measured on the server's clock.
    #[arg(long, default_value = "5s", value_parser = parse_timeout)]
    pub(crate) rlqs_report_interval: Duration,

    /// Buckets one RLQS stream may hold; a report opening one more ends the stream with
    /// RESOURCE_EXHAUSTED.
    #[arg(long, default_value_t = 10_000)]
    pub(crate) rlqs_max_buckets: usize,

    /// Bytes the buckets of all RLQS streams may hold together (their ids, their index and
    /// their part of the pools: about 1.9 KB for a bucket with a short id), e.g. 64MiB; the
    /// streams of one connection get at most a quarter of it. A bucket past either is skipped
    /// and counted (`ratelimit_rlqs_skipped_entries_total{kind="over_budget"}`); the others keep
    /// working.
    #[arg(long, default_value = "64MiB", value_parser = parse_bytes)]
    pub(crate) rlqs_max_bytes: u64,
}

/// Permission bits in octal (`660`), at most `777`.
fn parse_mode(s: &str) -> Result<u32, String> {
    u32::from_str_radix(s.trim_start_matches("0o"), 8)
        .ok()
        .filter(|m| *m <= 0o777)
        .ok_or_else(|| format!("'{s}' is not an octal file mode such as 660"))
}

/// Names a response header may not take: HTTP/1.1's hop-by-hop and framing headers, which
/// Envoy would add to the client's response and which there say how the message is carried
/// (HTTP/2 refuses most of them outright).
const NOT_RESPONSE_HEADERS: [&str; 10] = [
    "connection",
    "content-length",
    "host",
    "keep-alive",
    "proxy-connection",
    "te",
    "trailer",
    "transfer-encoding",
    "upgrade",
    "proxy-authenticate",
];

/// The name of a header added to the client's response (RFC 9110 token characters, at most
/// 256 bytes), not one of [`NOT_RESPONSE_HEADERS`].
fn parse_header_name(s: &str) -> Result<String, String> {
    let token = |c: char| c.is_ascii_alphanumeric() || "!#$%&'*+-.^_`|~".contains(c);
    if s.is_empty() || s.len() > 256 || !s.chars().all(token) {
        return Err(format!("'{s}' is not an HTTP header name"));
    }
    if NOT_RESPONSE_HEADERS
        .iter()
        .any(|n| n.eq_ignore_ascii_case(s))
    {
        return Err(format!(
            "'{s}' says how a message is carried, not what it means: Envoy would add it to the client's response"
        ));
    }
    Ok(s.to_owned())
}

/// `host:port` (`[v6]:port`), the port 1 to 65535; the host is resolved at each connect.
fn parse_host_port(s: &str) -> Result<String, String> {
    let bad = || format!("'{s}' is not host:port (e.g. statsd.monitoring:8125 or 127.0.0.1:8125)");
    let (host, port) = s.rsplit_once(':').ok_or_else(bad)?;
    let bracketed = host.starts_with('[') == host.ends_with(']');
    let port_ok = port.parse::<u16>().is_ok_and(|p| p > 0);
    if host.is_empty() || host.contains(char::is_whitespace) || !bracketed || !port_ok {
        return Err(bad());
    }
    if !host.starts_with('[') && host.contains(':') {
        return Err(bad());
    }
    Ok(s.to_owned())
}

/// `--rlqs-assignment-ttl`: whole seconds, at least one, at most an hour.
fn parse_ttl(s: &str) -> Result<Duration, String> {
    let d = parse_duration_within(s, Duration::from_secs(3_600))?;
    if d.subsec_nanos() != 0 || d.is_zero() {
        return Err("must be a whole number of seconds, at least 1s".into());
    }
    Ok(d)
}

fn parse_ratio(s: &str) -> Result<f64, String> {
    let v: f64 = s.parse().map_err(|e| format!("{e}"))?;
    if (0.0..=1.0).contains(&v) {
        Ok(v)
    } else {
        Err(format!("{v} is not between 0 and 1"))
    }
}

/// Parses `250ms`, `10s`, `2m` or a bare number of seconds, never more than `max`: a longer
/// timeout or grace is a typo, and an unbounded one would overflow the runtime's timers.
fn parse_duration_within(s: &str, max: Duration) -> Result<Duration, String> {
    let s = s.trim();
    let split = s
        .find(|c: char| !c.is_ascii_digit() && c != '.')
        .unwrap_or(s.len());
    let (number, unit) = s.split_at(split);
    let n: f64 = number
        .parse()
        .map_err(|_| format!("'{s}' is not a duration (e.g. 250ms, 10s, 2m)"))?;
    let secs = match unit {
        "ms" => n / 1000.0,
        "" | "s" => n,
        "m" => n * 60.0,
        "h" => n * 3_600.0,
        _ => return Err(format!("'{s}' has an unknown unit (use ms, s, m or h)")),
    };
    match Duration::try_from_secs_f64(secs) {
        Ok(d) if d <= max => Ok(d),
        _ => Err(format!("'{s}' is longer than the maximum of {max:?}")),
    }
}

/// `--redis-timeout`: more than 0 and at most a minute (Envoy itself waits 20 ms by default).
fn parse_timeout(s: &str) -> Result<Duration, String> {
    let d = parse_duration_within(s, Duration::from_secs(60))?;
    if d.is_zero() {
        return Err("must be more than 0".into());
    }
    Ok(d)
}

/// `--xds-backoff-*` and the xDS deadlines: more than 0 and at most an hour.
fn parse_xds_duration(s: &str) -> Result<Duration, String> {
    let d = parse_duration_within(s, Duration::from_secs(3_600))?;
    if d.is_zero() {
        return Err("must be more than 0".into());
    }
    Ok(d)
}

/// `--top-publish-interval`: at least a second (8 replicas publishing every 10 ms sent 20 GB
/// through one Redis in 50 s and took request p99 from 4.4 ms to 120 ms), at most an hour.
fn parse_publish_interval(s: &str) -> Result<Duration, String> {
    let d = parse_duration_within(s, Duration::from_secs(3_600))?;
    if d < Duration::from_secs(1) {
        return Err("must be at least 1s".into());
    }
    Ok(d)
}

/// `--grpc-max-connection-age` and its grace: at most 30 days (0 is off for the age).
fn parse_age(s: &str) -> Result<Duration, String> {
    parse_duration_within(s, Duration::from_secs(30 * 86_400))
}

/// `--statsd-tags`: sorted by key, a key given twice keeping its last value.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct Tags(pub(crate) Vec<(String, String)>);

fn parse_tags(s: &str) -> Result<Tags, String> {
    let mut tags = std::collections::BTreeMap::new();
    for pair in s.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        let (k, v) = pair
            .split_once(':')
            .ok_or_else(|| format!("'{pair}' is not key:value"))?;
        let clean = |t: &str| {
            !t.is_empty()
                && t.bytes().all(|b| {
                    b.is_ascii_graphic() && !matches!(b, b':' | b'|' | b',' | b'=' | b'#' | b'@')
                })
        };
        if !clean(k) || !clean(v) {
            return Err(format!(
                "'{pair}': a tag's key and value are non-empty, without spaces or :|,=#@"
            ));
        }
        tags.insert(k.to_owned(), v.to_owned());
    }
    Ok(Tags(tags.into_iter().collect()))
}

/// `--drain-delay`: at most ten minutes.
fn parse_drain(s: &str) -> Result<Duration, String> {
    parse_duration_within(s, Duration::from_secs(600))
}

/// `--shutdown-grace`: at most an hour.
fn parse_grace(s: &str) -> Result<Duration, String> {
    parse_duration_within(s, Duration::from_secs(3_600))
}

/// `--grpc-max-header-bytes`: a size from 16 KiB (HTTP/2's usual floor, what the port took
/// before) to 16 MiB (twice the most Envoy sends).
fn parse_header_bytes(s: &str) -> Result<u64, String> {
    let n = parse_bytes(s)?;
    if (16 << 10..=16 << 20).contains(&n) {
        Ok(n)
    } else {
        Err(format!("'{s}' is not between 16KiB and 16MiB"))
    }
}

/// Parses a byte size: a number with an optional `k`, `m` or `g` suffix (powers of 1024,
/// optionally followed by `i`/`ib`/`b`), e.g. `64MiB`, `512k`, `1048576`.
fn parse_bytes(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let split = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (number, unit) = t.split_at(split);
    let n: u64 = number
        .parse()
        .map_err(|_| format!("'{s}' is not a size (e.g. 65536, 512KiB, 64MiB, 1GiB)"))?;
    let shift = match unit.to_ascii_lowercase().as_str() {
        "" | "b" => 0,
        "k" | "kb" | "ki" | "kib" => 10,
        "m" | "mb" | "mi" | "mib" => 20,
        "g" | "gb" | "gi" | "gib" => 30,
        _ => return Err(format!("'{s}' has an unknown unit (use KiB, MiB or GiB)")),
    };
    n.checked_mul(1 << shift)
        .filter(|b| *b <= 1 << 40)
        .ok_or_else(|| format!("'{s}' is larger than 1 TiB"))
}
