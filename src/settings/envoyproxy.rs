//! envoyproxy/ratelimit's environment, read as our flags, so a deployment of that service
//! switches by changing only its image.
//!
//! Each variable becomes the flag with its meaning; a flag given on the command line or as
//! `RATELIMITD_<FLAG>` wins. Without `--config` (nor `RATELIMITD_CONFIG`) the service runs as
//! that service would: the config directory is `RUNTIME_ROOT/RUNTIME_SUBDIRECTORY/
//! RUNTIME_APPDIRECTORY` and its defaults apply (log level `warn`, the debug port 6070).
//! `REDIS_URL` selects the Redis backend. A variable of that service with no equivalent here is
//! reported, once, as ignored; one whose meaning cannot be honoured is an error.

/// Flags (long name without `--`, value) the environment asks for, and what to log about it.
#[derive(Debug, Default, PartialEq, Eq)]
pub(super) struct Translated {
    /// In the order they were derived.
    pub flags: Vec<(&'static str, String)>,
    /// Variables that are set but have no equivalent (logged once at start).
    pub ignored: Vec<String>,
}

/// The reference's variables that are accepted but change nothing here, with why.
const IGNORED: &[(&str, &str)] = &[
    (
        "REDIS_POOL_SIZE",
        "one multiplexed connection needs no pool",
    ),
    (
        "REDIS_PIPELINE_WINDOW",
        "requests are pipelined on one connection",
    ),
    (
        "REDIS_PIPELINE_LIMIT",
        "requests are pipelined on one connection",
    ),
    ("REDIS_POOL_ON_EMPTY_BEHAVIOR", "there is no pool"),
    (
        "REDIS_HEALTH_CHECK_ACTIVE_CONNECTION",
        "Redis is probed every second anyway",
    ),
    (
        "REDIS_STARTUP_INITIAL_INTERVAL",
        "the service starts without Redis",
    ),
    (
        "REDIS_STARTUP_MAX_INTERVAL",
        "the service starts without Redis",
    ),
    (
        "REDIS_STARTUP_MAX_ELAPSED_TIME",
        "the service starts without Redis",
    ),
    (
        "REDIS_CLUSTER_PIPELINE_PARALLELISM",
        "script calls are pipelined on one connection per node",
    ),
    (
        "EXPIRATION_JITTER_MAX_SECONDS",
        "keys expire at their window's end",
    ),
    ("PROMETHEUS_PATH", "metrics are served at /metrics"),
    (
        "PROMETHEUS_MAPPER_YAML",
        "the families Envoy Gateway's mapping makes are exported as such",
    ),
    (
        "PROMETHEUS_RESPONSE_TIME_AS_MILLISECONDS",
        "durations are in seconds",
    ),
    (
        "GRPC_SERVER_TLS_CA_CERT",
        "Envoy Gateway's name, which envoyproxy/ratelimit ignores too; GRPC_CLIENT_TLS_CACERT asks for client certificates",
    ),
    (
        "RUNTIME_WATCH_ROOT",
        "the config directory is always watched, the root's swaps too",
    ),
    (
        "REDIS_PERSECOND_POOL_SIZE",
        "one multiplexed connection needs no pool",
    ),
    (
        "REDIS_PERSECOND_PIPELINE_WINDOW",
        "requests are pipelined on one connection",
    ),
    (
        "REDIS_PERSECOND_PIPELINE_LIMIT",
        "requests are pipelined on one connection",
    ),
    ("REDIS_PERSECOND_POOL_ON_EMPTY_BEHAVIOR", "there is no pool"),
    (
        "REDIS_PERSECOND_CLUSTER_PIPELINE_PARALLELISM",
        "script calls are pipelined on one connection per node",
    ),
    (
        "REDIS_PERSECOND_TIMEOUT",
        "REDIS_TIMEOUT bounds a request's calls to both stores, which are made in parallel",
    ),
];

/// The variables [`refuse`] judges.
const REFUSED: [&str; 4] = [
    "BACKEND_TYPE",
    "CONFIG_TYPE",
    "MEMCACHE_HOST_PORT",
    "MEMCACHE_SRV",
];

/// `CONFIG_TYPE` for the config over xDS.
const XDS: &str = "GRPC_XDS_SOTW";

/// Variables whose values cannot be honoured at all: refused rather than misread.
fn refuse(name: &str, value: &str) -> Option<String> {
    let v = value.trim();
    match name {
        "BACKEND_TYPE" if !v.eq_ignore_ascii_case("redis") => Some(format!(
            "BACKEND_TYPE={v} is not supported (redis, or no REDIS_URL for the in-process backend)"
        )),
        "CONFIG_TYPE" if !v.eq_ignore_ascii_case("FILE") && !v.eq_ignore_ascii_case(XDS) => {
            Some(format!("CONFIG_TYPE={v} is not supported (FILE or {XDS})"))
        }
        "MEMCACHE_HOST_PORT" | "MEMCACHE_SRV" if !v.is_empty() => {
            Some(format!("{name} is not supported (no memcache backend)"))
        }
        _ => None,
    }
}

fn truthy(v: &str) -> Result<bool, String> {
    match v.trim().to_ascii_lowercase().as_str() {
        "1" | "t" | "true" | "yes" | "on" => Ok(true),
        "0" | "f" | "false" | "no" | "off" | "" => Ok(false),
        other => Err(format!("'{other}' is not a boolean")),
    }
}

fn address_of(host: Option<String>, port: Option<String>, default_port: u16) -> String {
    let host = host
        .filter(|h| !h.is_empty())
        .unwrap_or_else(|| "0.0.0.0".into());
    let port = port.unwrap_or_else(|| default_port.to_string());
    if host.contains(':') && !host.starts_with('[') {
        format!("[{host}]:{port}")
    } else {
        format!("{host}:{port}")
    }
}

/// The environment as envoyproxy/ratelimit reads it: trimmed values, its booleans.
struct Env<'a>(&'a dyn Fn(&str) -> Option<String>);

impl Env<'_> {
    fn var(&self, name: &str) -> Option<String> {
        (self.0)(name).map(|v| v.trim().to_owned())
    }

    /// A set, non-empty variable.
    fn non_empty(&self, name: &str) -> Option<String> {
        self.var(name).filter(|v| !v.is_empty())
    }

    fn bool_var(&self, name: &str) -> Result<Option<bool>, String> {
        self.var(name)
            .map(|v| truthy(&v).map_err(|e| format!("{name}: {e}")))
            .transpose()
    }
}

impl Translated {
    fn flag(&mut self, name: &'static str, value: String) {
        self.flags.push((name, value));
    }
}

/// How a variable's value becomes its flag's.
#[derive(Clone, Copy, Debug)]
enum As {
    /// As set (trimmed), even empty.
    Set,
    /// As set, when not empty.
    NonEmpty,
    /// Lower-cased, as set.
    Lower,
    /// Lower-cased, when not empty.
    LowerNonEmpty,
    /// A boolean (that service's spellings), as `true` or `false`.
    Bool,
    /// This value when the boolean is true; nothing otherwise.
    IfTrue(&'static str),
    /// A Go duration (`1m30s`), in milliseconds.
    GoDuration,
    /// As set when not empty, else that service's default.
    OrDefault(&'static str),
}

/// One variable, the flag it sets and how: each group of variables is a table of these,
/// applied in order by [`apply`].
type Row = (&'static str, &'static str, As);

/// Sets the flag of every row whose variable asks for one.
fn apply(env: &Env<'_>, rows: &[Row], t: &mut Translated) -> Result<(), String> {
    for &(name, flag, how) in rows {
        let value = match how {
            As::Set => env.var(name),
            As::NonEmpty => env.non_empty(name),
            As::Lower => env.var(name).map(|v| v.to_ascii_lowercase()),
            As::LowerNonEmpty => env.non_empty(name).map(|v| v.to_ascii_lowercase()),
            As::Bool => env.bool_var(name)?.map(|b| b.to_string()),
            As::IfTrue(value) => (env.bool_var(name)? == Some(true)).then(|| value.to_owned()),
            As::GoDuration => match env.non_empty(name) {
                Some(v) => {
                    let d = go_duration(&v).map_err(|e| format!("{name}: {e}"))?;
                    Some(format!("{}ms", d.as_secs_f64() * 1000.0))
                }
                None => None,
            },
            As::OrDefault(default) => {
                Some(env.non_empty(name).unwrap_or_else(|| default.to_owned()))
            }
        };
        if let Some(value) = value {
            t.flag(flag, value);
        }
    }
    Ok(())
}

/// Reads envoyproxy/ratelimit's variables from `env`. `dropin` is true when no config path
/// was given, so that service's defaults apply too.
pub(super) fn translate(
    env: &dyn Fn(&str) -> Option<String>,
    dropin: bool,
) -> Result<Translated, String> {
    let env = Env(env);
    let mut t = Translated::default();
    for name in REFUSED {
        if let Some(v) = env.var(name)
            && let Some(why) = refuse(name, &v)
        {
            return Err(why);
        }
    }
    let xds = env
        .var("CONFIG_TYPE")
        .is_some_and(|v| v.eq_ignore_ascii_case(XDS));
    if xds {
        xds_source(&env, &mut t)?;
    } else {
        if dropin {
            config_directory(&env, &mut t)?;
        }
        for name in [
            "FORCE_START_WITHOUT_INITIAL_CONFIG",
            "HEALTHY_WITH_AT_LEAST_ONE_CONFIG_LOADED",
        ] {
            if env.bool_var(name)? == Some(true) {
                t.ignored.push(format!(
                    "{name}=true applies to CONFIG_TYPE={XDS} only: config files load before the service starts, and an invalid one stops it"
                ));
            }
        }
    }
    listeners(&env, dropin, &mut t)?;
    behaviour(&env, dropin, &mut t)?;
    grpc_tls(&env, &mut t)?;
    tracing(&env, &mut t)?;
    stats(&env, dropin, &mut t)?;
    if let Some(url) = env.non_empty("REDIS_URL") {
        t.flag("backend", "redis".into());
        redis(&env, &url, &MAIN_STORE, &mut t)?;
        apply(&env, REDIS_TLS, &mut t)?;
    }
    if env.bool_var("REDIS_PERSECOND")? == Some(true) {
        if env.non_empty("REDIS_URL").is_none() {
            return Err(
                "REDIS_PERSECOND=true needs REDIS_URL: the per-second Redis keeps only the counters of windows shorter than a minute".into(),
            );
        }
        let url = env
            .non_empty("REDIS_PERSECOND_URL")
            .unwrap_or_else(|| "/var/run/nutcracker/ratelimitpersecond.sock".into());
        redis(&env, &url, &PER_SECOND_STORE, &mut t)?;
    }
    ignored(&env, &mut t);
    Ok(t)
}

/// `RUNTIME_ROOT/RUNTIME_SUBDIRECTORY/RUNTIME_APPDIRECTORY`, with that service's defaults.
fn config_directory(env: &Env<'_>, t: &mut Translated) -> Result<(), String> {
    let root = env
        .var("RUNTIME_ROOT")
        .unwrap_or_else(|| "/srv/runtime_data/current".into());
    let sub = env.var("RUNTIME_SUBDIRECTORY").unwrap_or_default();
    let app = env
        .var("RUNTIME_APPDIRECTORY")
        .unwrap_or_else(|| "config".into());
    let dir: std::path::PathBuf = [root, sub, app].iter().filter(|p| !p.is_empty()).collect();
    t.flag("config", dir.display().to_string());
    if env.bool_var("RUNTIME_IGNOREDOTFILES")? != Some(true) {
        t.ignored.push(
            "RUNTIME_IGNOREDOTFILES is false: dot-files and dot-directories are skipped anyway"
                .into(),
        );
    }
    Ok(())
}

/// `CONFIG_TYPE=GRPC_XDS_SOTW`: the xDS server, the node, the stream's headers and backoff.
fn xds_source(env: &Env<'_>, t: &mut Translated) -> Result<(), String> {
    if env.bool_var("CONFIG_GRPC_XDS_SERVER_USE_TLS")? == Some(true) {
        let ca = env.non_empty("CONFIG_GRPC_XDS_SERVER_TLS_CACERT").ok_or(
            "CONFIG_GRPC_XDS_SERVER_USE_TLS needs CONFIG_GRPC_XDS_SERVER_TLS_CACERT (system roots are not read)",
        )?;
        t.flag("xds-tls-ca", ca);
        let cert = env.non_empty("CONFIG_GRPC_XDS_CLIENT_TLS_CERT");
        let key = env.non_empty("CONFIG_GRPC_XDS_CLIENT_TLS_KEY");
        if let (Some(cert), Some(key)) = (cert, key) {
            t.flag("xds-tls-cert", cert);
            t.flag("xds-tls-key", key);
        }
        if let Some(san) = env.non_empty("CONFIG_GRPC_XDS_SERVER_TLS_SAN") {
            t.flag("xds-tls-server-name", san);
        }
    }
    let server = env
        .non_empty("CONFIG_GRPC_XDS_SERVER_URL")
        .unwrap_or_else(|| "localhost:18000".into());
    t.flag("xds-server", server);
    apply(
        env,
        &[("CONFIG_GRPC_XDS_NODE_ID", "xds-node-id", As::NonEmpty)],
        t,
    )?;
    if let Some(metadata) = env.non_empty("CONFIG_GRPC_XDS_NODE_METADATA") {
        // `key=value` pairs; a pair without `=` is skipped, as that service skips it.
        let pairs: Vec<&str> = metadata.split(',').filter(|p| p.contains('=')).collect();
        t.flag("xds-node-metadata", pairs.join(","));
    }
    if let Some(headers) = env.non_empty("CONFIG_GRPC_XDS_CLIENT_ADDITIONAL_HEADERS") {
        // envconfig's map syntax: `key:value` pairs.
        let mut pairs = Vec::new();
        for pair in headers.split(',').filter(|p| !p.trim().is_empty()) {
            let (k, v) = pair.split_once(':').ok_or_else(|| {
                format!("CONFIG_GRPC_XDS_CLIENT_ADDITIONAL_HEADERS: '{pair}' is not key:value")
            })?;
            pairs.push(format!("{}={}", k.trim(), v.trim()));
        }
        t.flag("xds-headers", pairs.join(","));
    }
    apply(env, XDS_CLIENT, t)
}

/// The xDS client's retries, message bound and start-up.
#[rustfmt::skip]
const XDS_CLIENT: &[Row] = &[
    ("XDS_CLIENT_BACKOFF_INITIAL_INTERVAL",     "xds-backoff-initial",    As::GoDuration),
    ("XDS_CLIENT_BACKOFF_MAX_INTERVAL",         "xds-backoff-max",        As::GoDuration),
    ("XDS_CLIENT_BACKOFF_RANDOM_FACTOR",        "xds-backoff-factor",     As::NonEmpty),
    ("XDS_CLIENT_BACKOFF_JITTER",               "xds-backoff-jitter",     As::Bool),
    ("XDS_CLIENT_MAX_MSG_SIZE_IN_BYTES",        "xds-max-message-bytes",  As::NonEmpty),
    ("FORCE_START_WITHOUT_INITIAL_CONFIG",      "start-without-config",   As::Bool),
    ("HEALTHY_WITH_AT_LEAST_ONE_CONFIG_LOADED", "unhealthy-until-config", As::Bool),
];

/// Parses Go's duration syntax (`300ms`, `1m30s`, `2h`, `1.5s`; units ns, us, µs, ms, s, m, h).
fn go_duration(text: &str) -> Result<std::time::Duration, String> {
    let bad = || format!("'{text}' is not a duration (e.g. 10s, 1m30s, 500ms)");
    let mut rest = text.trim();
    if rest == "0" {
        return Ok(std::time::Duration::ZERO);
    }
    if rest.is_empty() {
        return Err(bad());
    }
    let mut secs = 0.0f64;
    while !rest.is_empty() {
        let number_end = rest
            .find(|c: char| !c.is_ascii_digit() && c != '.')
            .ok_or_else(bad)?;
        let (number, tail) = rest.split_at(number_end);
        let n: f64 = number.parse().map_err(|_| bad())?;
        let unit_end = tail
            .find(|c: char| c.is_ascii_digit() || c == '.')
            .unwrap_or(tail.len());
        let (unit, tail) = tail.split_at(unit_end);
        let scale = match unit {
            "ns" => 1e-9,
            "us" | "µs" | "μs" => 1e-6,
            "ms" => 1e-3,
            "s" => 1.0,
            "m" => 60.0,
            "h" => 3600.0,
            _ => return Err(bad()),
        };
        secs += n * scale;
        rest = tail;
    }
    std::time::Duration::try_from_secs_f64(secs).map_err(|_| bad())
}

/// The HTTP, gRPC, debug and Prometheus addresses.
fn listeners(env: &Env<'_>, dropin: bool, t: &mut Translated) -> Result<(), String> {
    let address = |host: &str, port: &str, default_port| {
        (env.var(host).is_some() || env.var(port).is_some())
            .then(|| address_of(env.var(host), env.var(port), default_port))
    };
    if let Some(addr) = address("HOST", "PORT", 8080) {
        t.flag("http-addr", addr);
    }
    if let Some(addr) = address("GRPC_HOST", "GRPC_PORT", 8081) {
        t.flag("grpc-addr", addr);
    }
    // A Unix socket instead of the TCP address, as that service listens on one or the other.
    apply(env, &[("GRPC_UDS", "grpc-uds", As::NonEmpty)], t)?;
    match address("DEBUG_HOST", "DEBUG_PORT", 6070) {
        Some(addr) => t.flag("debug-addr", addr),
        None if dropin => t.flag("debug-addr", address_of(None, None, 6070)),
        None => {}
    }
    if env.bool_var("USE_PROMETHEUS")? == Some(true) {
        let addr = env.var("PROMETHEUS_ADDR").unwrap_or_else(|| ":9090".into());
        let addr = match addr.strip_prefix(':') {
            Some(port) => format!("0.0.0.0:{port}"),
            None => addr,
        };
        t.flag("metrics-addr", addr);
        // What a Prometheus scraping envoyproxy/ratelimit reads (Envoy Gateway's dashboard).
        t.flag("reference-metrics", "true".into());
    }
    Ok(())
}

/// Logging, decisions and responses.
fn behaviour(env: &Env<'_>, dropin: bool, t: &mut Translated) -> Result<(), String> {
    match env.var("LOG_LEVEL") {
        Some(level) => {
            let level = match level.to_ascii_lowercase().as_str() {
                "warning" => "warn".to_owned(),
                "fatal" | "panic" => "error".to_owned(),
                other => other.to_owned(),
            };
            t.flag("log-level", level);
        }
        None if dropin => t.flag("log-level", "warn".into()),
        None => {}
    }
    apply(env, BEHAVIOUR, t)
}

/// Decisions, responses and the Redis client's bounds.
#[rustfmt::skip]
const BEHAVIOUR: &[Row] = &[
    ("LOG_FORMAT",                              "log-format",                 As::Lower),
    ("NEAR_LIMIT_RATIO",                        "near-limit-ratio",           As::Set),
    ("SHADOW_MODE",                             "shadow-mode",                As::Bool),
    ("QUOTA_MODE",                              "quota-mode",                 As::Bool),
    ("MERGE_DOMAIN_CONFIG",                     "merge-domain-config",        As::Bool),
    ("LIMIT_RESPONSE_HEADERS_ENABLED",          "response-headers",           As::IfTrue("reference")),
    ("LIMIT_LIMIT_HEADER",                      "reference-limit-header",     As::NonEmpty),
    ("LIMIT_REMAINING_HEADER",                  "reference-remaining-header", As::NonEmpty),
    ("LIMIT_RESET_HEADER",                      "reference-reset-header",     As::NonEmpty),
    ("RESPONSE_DYNAMIC_METADATA",               "response-dynamic-metadata",  As::Bool),
    ("LOCAL_CACHE_SIZE_IN_BYTES",               "local-cache-bytes",          As::Set),
    ("CACHE_KEY_PREFIX",                        "redis-key-prefix",           As::Set),
    ("REDIS_TIMEOUT",                           "redis-timeout",              As::Set),
    // Unset: ratelimitd's own 30m and 1m, not that service's 24h and 1h (docs/migrating.md).
    ("GRPC_MAX_CONNECTION_AGE",                 "grpc-max-connection-age",    As::GoDuration),
    ("GRPC_MAX_CONNECTION_AGE_GRACE",           "grpc-max-connection-age-grace", As::GoDuration),
    // true: nothing past a limit is recorded, reports included. Unset or false (that service's
    // default, which counts every hit): the default accounting, where reports are recorded as
    // that service records them and a refused admission still consumes nothing.
    ("STOP_CACHE_KEY_INCREMENT_WHEN_OVERLIMIT", "accounting",                 As::IfTrue("admission")),
];

/// The stats sinks: statsd (`USE_STATSD`, on by default in that service) or DogStatsD
/// (`USE_DOG_STATSD`, which that service accepts only with `USE_STATSD=false`). Prometheus is
/// always on here, so `USE_PROMETHEUS=true` with `USE_STATSD` unset (which that service refuses)
/// sends no statsd.
fn stats(env: &Env<'_>, dropin: bool, t: &mut Translated) -> Result<(), String> {
    if let Some(m) = env.non_empty("USE_DOG_STATSD_MOGRIFIERS") {
        return Err(format!(
            "USE_DOG_STATSD_MOGRIFIERS={m} is not supported: stats are sent under that service's names, EXTRA_TAGS as DogStatsD tags"
        ));
    }
    let statsd = env.bool_var("USE_STATSD")?;
    let dog = env.bool_var("USE_DOG_STATSD")? == Some(true);
    if dog && statsd != Some(false) {
        return Err(
            "USE_DOG_STATSD=true needs USE_STATSD=false: one stats sink, as envoyproxy/ratelimit requires".into(),
        );
    }
    let on = dog
        || statsd == Some(true)
        || (statsd.is_none() && dropin && env.bool_var("USE_PROMETHEUS")? != Some(true));
    if !on || env.bool_var("DISABLE_STATS")? == Some(true) {
        return Ok(());
    }
    let host = env
        .non_empty("STATSD_HOST")
        .unwrap_or_else(|| "localhost".into());
    t.flag(
        "statsd-addr",
        address_of(Some(host), env.non_empty("STATSD_PORT"), 8125),
    );
    // That service's statsd library reads STATSD_PROTOCOL: TCP unless it says udp. DogStatsD's
    // client sends datagrams.
    let udp = dog
        || env
            .var("STATSD_PROTOCOL")
            .is_some_and(|p| p.eq_ignore_ascii_case("udp"));
    t.flag("statsd-protocol", if udp { "udp" } else { "tcp" }.into());
    if dog {
        t.flag("statsd-format", "dogstatsd".into());
    }
    apply(env, STATS, t)
}

/// The stats sink's tags and interval.
#[rustfmt::skip]
const STATS: &[Row] = &[
    ("EXTRA_TAGS",           "statsd-tags",           As::NonEmpty),
    ("STATS_FLUSH_INTERVAL", "statsd-flush-interval", As::GoDuration),
];

/// OpenTelemetry tracing (`TRACING_*`, `OTEL_EXPORTER_OTLP_ENDPOINT`).
fn tracing(env: &Env<'_>, t: &mut Translated) -> Result<(), String> {
    if env.bool_var("TRACING_ENABLED")? != Some(true) {
        return Ok(());
    }
    t.flag("tracing", "true".into());
    apply(env, TRACING, t)
}

/// Span export, with `TRACING_ENABLED=true`.
#[rustfmt::skip]
const TRACING: &[Row] = &[
    ("TRACING_EXPORTER_PROTOCOL",   "tracing-protocol",            As::LowerNonEmpty),
    ("OTEL_EXPORTER_OTLP_ENDPOINT", "tracing-endpoint",            As::NonEmpty),
    ("TRACING_SERVICE_NAME",        "tracing-service-name",        As::OrDefault("RateLimit")),
    ("TRACING_SERVICE_NAMESPACE",   "tracing-service-namespace",   As::NonEmpty),
    ("TRACING_SERVICE_INSTANCE_ID", "tracing-service-instance-id", As::NonEmpty),
    ("TRACING_SAMPLING_RATE",       "tracing-sampling-rate",       As::NonEmpty),
];

/// TLS on the gRPC listener.
fn grpc_tls(env: &Env<'_>, t: &mut Translated) -> Result<(), String> {
    if env.bool_var("GRPC_SERVER_USE_TLS")? != Some(true) {
        return Ok(());
    }
    let cert = env
        .var("GRPC_SERVER_TLS_CERT")
        .ok_or("GRPC_SERVER_USE_TLS needs GRPC_SERVER_TLS_CERT")?;
    let key = env
        .var("GRPC_SERVER_TLS_KEY")
        .ok_or("GRPC_SERVER_USE_TLS needs GRPC_SERVER_TLS_KEY")?;
    t.flag("grpc-tls-cert", cert);
    t.flag("grpc-tls-key", key);
    if env.non_empty("GRPC_CLIENT_TLS_CACERT").is_some() {
        apply(env, GRPC_CLIENT_TLS, t)?;
    } else if let Some(san) = env.non_empty("GRPC_CLIENT_TLS_SAN") {
        // That service then asks for no client certificate, so the name checks nothing.
        t.ignored.push(format!(
            "GRPC_CLIENT_TLS_SAN={san} without GRPC_CLIENT_TLS_CACERT checks nothing: no client certificate is asked for"
        ));
    }
    Ok(())
}

/// Client certificates on the gRPC listener, with `GRPC_CLIENT_TLS_CACERT`.
#[rustfmt::skip]
const GRPC_CLIENT_TLS: &[Row] = &[
    ("GRPC_CLIENT_TLS_CACERT", "grpc-tls-client-ca",  As::NonEmpty),
    ("GRPC_CLIENT_TLS_SAN",    "grpc-tls-client-san", As::NonEmpty),
];

/// The variables that name one Redis store, and the flags they become.
struct StoreVars {
    url: &'static str,
    kind: &'static str,
    socket_type: &'static str,
    tls: &'static str,
    auth: &'static str,
    sentinel_auth: &'static str,
    flag_url: &'static str,
    flag_cluster_nodes: &'static str,
    flag_sentinel_master: &'static str,
    flag_sentinel_nodes: &'static str,
    flag_tls: &'static str,
    flag_username: &'static str,
    flag_password: &'static str,
}

/// `REDIS_*`: the main store.
const MAIN_STORE: StoreVars = StoreVars {
    url: "REDIS_URL",
    kind: "REDIS_TYPE",
    socket_type: "REDIS_SOCKET_TYPE",
    tls: "REDIS_TLS",
    auth: "REDIS_AUTH",
    sentinel_auth: "REDIS_SENTINEL_AUTH",
    flag_url: "redis-url",
    flag_cluster_nodes: "redis-cluster-nodes",
    flag_sentinel_master: "redis-sentinel-master",
    flag_sentinel_nodes: "redis-sentinel-nodes",
    flag_tls: "redis-tls",
    flag_username: "redis-username",
    flag_password: "redis-password",
};

/// `REDIS_PERSECOND_*`: the store of the limits whose unit is a second.
const PER_SECOND_STORE: StoreVars = StoreVars {
    url: "REDIS_PERSECOND_URL",
    kind: "REDIS_PERSECOND_TYPE",
    socket_type: "REDIS_PERSECOND_SOCKET_TYPE",
    tls: "REDIS_PERSECOND_TLS",
    auth: "REDIS_PERSECOND_AUTH",
    sentinel_auth: "REDIS_PERSECOND_SENTINEL_AUTH",
    flag_url: "redis-per-second-url",
    flag_cluster_nodes: "redis-per-second-cluster-nodes",
    flag_sentinel_master: "redis-per-second-sentinel-master",
    flag_sentinel_nodes: "redis-per-second-sentinel-nodes",
    flag_tls: "redis-per-second-tls",
    flag_username: "redis-per-second-username",
    flag_password: "redis-per-second-password",
};

/// The Redis store at `url` that `vars` name: its shape (`REDIS_TYPE`), credentials and TLS.
fn redis(env: &Env<'_>, url: &str, vars: &StoreVars, t: &mut Translated) -> Result<(), String> {
    let tls = env.bool_var(vars.tls)?.unwrap_or(false);
    let unix = env
        .var(vars.socket_type)
        .unwrap_or_else(|| "unix".into())
        .eq_ignore_ascii_case("unix");
    let scheme = if tls { "rediss" } else { "redis" };
    let node = |hostport: &str| {
        if unix {
            format!("unix://{hostport}")
        } else {
            format!("{scheme}://{hostport}")
        }
    };
    match env
        .var(vars.kind)
        .unwrap_or_else(|| "SINGLE".into())
        .to_ascii_uppercase()
        .as_str()
    {
        "SINGLE" => t.flag(vars.flag_url, node(url)),
        "CLUSTER" => {
            let nodes: Vec<String> = url.split(',').map(|n| node(n.trim())).collect();
            t.flag(vars.flag_cluster_nodes, nodes.join(","));
        }
        "SENTINEL" => {
            let mut parts = url.split(',').map(str::trim);
            let master = parts.next().unwrap_or_default().to_owned();
            let auth = env.non_empty(vars.sentinel_auth);
            let sentinels: Vec<String> = parts
                .map(|hostport| match &auth {
                    Some(a) if a.contains(':') => format!("{scheme}://{a}@{hostport}"),
                    Some(a) => format!("{scheme}://:{a}@{hostport}"),
                    None => format!("{scheme}://{hostport}"),
                })
                .collect();
            if master.is_empty() || sentinels.is_empty() {
                return Err(format!(
                    "{}=SENTINEL needs {}=<master name>,<host:port>[,…]",
                    vars.kind, vars.url
                ));
            }
            t.flag(vars.flag_sentinel_master, master);
            t.flag(vars.flag_sentinel_nodes, sentinels.join(","));
            if tls {
                t.flag(vars.flag_tls, "true".into());
            }
        }
        other => {
            return Err(format!(
                "{}={other} is not one of SINGLE, CLUSTER, SENTINEL",
                vars.kind
            ));
        }
    }
    if let Some(auth) = env.non_empty(vars.auth) {
        match auth.split_once(':') {
            Some((user, pass)) => {
                t.flag(vars.flag_username, user.to_owned());
                t.flag(vars.flag_password, pass.to_owned());
            }
            None => t.flag(vars.flag_password, auth),
        }
    }
    Ok(())
}

/// The Redis client's certificates.
#[rustfmt::skip]
const REDIS_TLS: &[Row] = &[
    ("REDIS_TLS_CACERT",                     "redis-tls-ca",                         As::NonEmpty),
    ("REDIS_TLS_CLIENT_CERT",                "redis-tls-cert",                       As::NonEmpty),
    ("REDIS_TLS_CLIENT_KEY",                 "redis-tls-key",                        As::NonEmpty),
    ("REDIS_TLS_SKIP_HOSTNAME_VERIFICATION", "redis-tls-skip-hostname-verification", As::Bool),
];

/// One note per variable of that service that is set and changes nothing here.
fn ignored(env: &Env<'_>, t: &mut Translated) {
    for (name, why) in IGNORED {
        let Some(v) = env.var(name) else { continue };
        // A variable set to what this service does anyway is not worth a line.
        let harmless = matches!(
            (*name, truthy(&v)),
            ("USE_STATSD" | "USE_DOG_STATSD", Ok(false))
        ) || matches!(*name, "RUNTIME_WATCH_ROOT" | "REDIS_POOL_SIZE");
        if !harmless {
            t.ignored.push(format!(
                "{name}={v} has no equivalent here and is ignored ({why})"
            ));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn run(vars: &[(&str, &str)], dropin: bool) -> Result<Translated, String> {
        let env: HashMap<String, String> = vars
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        translate(&|k| env.get(k).cloned(), dropin)
    }

    fn flags(t: &Translated) -> Vec<(&str, &str)> {
        t.flags.iter().map(|(k, v)| (*k, v.as_str())).collect()
    }

    #[test]
    fn redis_tls_hostname_verification_can_be_skipped() {
        let t = run(
            &[
                ("REDIS_SOCKET_TYPE", "tcp"),
                ("REDIS_URL", "10.0.0.3:6378"),
                ("REDIS_TLS", "true"),
                ("REDIS_TLS_CACERT", "/ca.pem"),
                ("REDIS_TLS_SKIP_HOSTNAME_VERIFICATION", "true"),
            ],
            false,
        )
        .unwrap();
        let f = flags(&t);
        assert!(
            f.contains(&("redis-tls-skip-hostname-verification", "true")),
            "{f:?}"
        );
        assert!(
            f.contains(&("redis-url", "rediss://10.0.0.3:6378")),
            "{f:?}"
        );
        assert!(t.ignored.is_empty(), "{:?}", t.ignored);
    }

    #[test]
    fn connection_age_takes_go_durations() {
        let t = run(
            &[
                ("GRPC_MAX_CONNECTION_AGE", "24h"),
                ("GRPC_MAX_CONNECTION_AGE_GRACE", "1h30m"),
            ],
            false,
        )
        .unwrap();
        let f = flags(&t);
        assert!(
            f.contains(&("grpc-max-connection-age", "86400000ms")),
            "{f:?}"
        );
        assert!(
            f.contains(&("grpc-max-connection-age-grace", "5400000ms")),
            "{f:?}"
        );
        assert!(t.ignored.is_empty(), "{:?}", t.ignored);
        let bad = run(&[("GRPC_MAX_CONNECTION_AGE", "a day")], false).unwrap_err();
        assert!(bad.contains("GRPC_MAX_CONNECTION_AGE"), "{bad}");
    }

    #[test]
    fn statsd_as_that_service_sends_it() {
        // Its default: on, over TCP, to localhost:8125, every 10 s.
        let t = run(&[], true).unwrap();
        let f = flags(&t);
        assert!(f.contains(&("statsd-addr", "localhost:8125")), "{f:?}");
        assert!(f.contains(&("statsd-protocol", "tcp")), "{f:?}");
        // Not without the drop-in, nor with Prometheus chosen instead.
        for (vars, dropin) in [
            (&[][..], false),
            (&[("USE_PROMETHEUS", "true")][..], true),
            (&[("USE_STATSD", "false")][..], true),
            (
                &[("USE_STATSD", "true"), ("DISABLE_STATS", "true")][..],
                true,
            ),
        ] {
            let t = run(vars, dropin).unwrap();
            assert!(
                !flags(&t).iter().any(|(k, _)| k.starts_with("statsd")),
                "{vars:?}: {:?}",
                flags(&t)
            );
        }
        let t = run(
            &[
                ("USE_STATSD", "true"),
                ("STATSD_HOST", "statsd.monitoring"),
                ("STATSD_PORT", "9125"),
                ("STATSD_PROTOCOL", "UDP"),
                ("EXTRA_TAGS", "env:prod,team:edge"),
                ("STATS_FLUSH_INTERVAL", "2s"),
            ],
            false,
        )
        .unwrap();
        let f = flags(&t);
        for want in [
            ("statsd-addr", "statsd.monitoring:9125"),
            ("statsd-protocol", "udp"),
            ("statsd-tags", "env:prod,team:edge"),
            ("statsd-flush-interval", "2000ms"),
        ] {
            assert!(f.contains(&want), "{want:?} in {f:?}");
        }
        let t = run(
            &[("USE_STATSD", "false"), ("USE_DOG_STATSD", "true")],
            false,
        )
        .unwrap();
        let f = flags(&t);
        assert!(f.contains(&("statsd-format", "dogstatsd")), "{f:?}");
        assert!(f.contains(&("statsd-protocol", "udp")), "{f:?}");
        // What that service refuses, or what cannot be honoured.
        for vars in [
            &[("USE_DOG_STATSD", "true")][..],
            &[("USE_STATSD", "false"), ("USE_DOG_STATSD_MOGRIFIERS", "A")][..],
        ] {
            let e = run(vars, true).unwrap_err();
            assert!(e.contains("STATSD"), "{e}");
        }
    }

    #[test]
    fn istio_sample_environment() {
        let t = run(
            &[
                ("REDIS_SOCKET_TYPE", "tcp"),
                ("REDIS_URL", "redis:6379"),
                ("USE_STATSD", "false"),
                ("LOG_LEVEL", "debug"),
                ("RUNTIME_ROOT", "/data"),
                ("RUNTIME_SUBDIRECTORY", "ratelimit"),
                ("RUNTIME_WATCH_ROOT", "false"),
                ("RUNTIME_IGNOREDOTFILES", "true"),
            ],
            true,
        )
        .unwrap();
        assert_eq!(
            flags(&t),
            vec![
                ("config", "/data/ratelimit/config"),
                ("debug-addr", "0.0.0.0:6070"),
                ("log-level", "debug"),
                ("backend", "redis"),
                ("redis-url", "redis://redis:6379"),
            ]
        );
        assert!(t.ignored.is_empty(), "{:?}", t.ignored);
    }

    #[test]
    fn listeners_and_logging() {
        let t = run(
            &[
                ("USE_PROMETHEUS", "true"),
                ("HOST", "::"),
                ("PORT", "9080"),
                ("GRPC_PORT", "9081"),
                ("LOG_LEVEL", "WARNING"),
                ("LOG_FORMAT", "JSON"),
                ("GRPC_SERVER_USE_TLS", "true"),
                ("GRPC_SERVER_TLS_CERT", "/c.pem"),
                ("GRPC_SERVER_TLS_KEY", "/k.pem"),
            ],
            false,
        )
        .unwrap();
        let f = flags(&t);
        for want in [
            ("metrics-addr", "0.0.0.0:9090"),
            ("http-addr", "[::]:9080"),
            ("grpc-addr", "0.0.0.0:9081"),
            ("log-level", "warn"),
            ("log-format", "json"),
            ("grpc-tls-cert", "/c.pem"),
            ("grpc-tls-key", "/k.pem"),
        ] {
            assert!(f.contains(&want), "{want:?} in {f:?}");
        }
        assert!(!f.iter().any(|(k, _)| *k == "debug-addr"), "not a drop-in");
    }

    #[test]
    fn headers_and_metadata() {
        let t = run(
            &[
                ("LIMIT_RESPONSE_HEADERS_ENABLED", "true"),
                ("RESPONSE_DYNAMIC_METADATA", "true"),
            ],
            false,
        )
        .unwrap();
        assert_eq!(
            flags(&t),
            vec![
                ("response-headers", "reference"),
                ("response-dynamic-metadata", "true")
            ]
        );
    }

    #[test]
    fn grpc_on_a_unix_socket() {
        let t = run(&[("GRPC_UDS", "/run/ratelimit/rl.sock")], false).unwrap();
        assert_eq!(flags(&t), vec![("grpc-uds", "/run/ratelimit/rl.sock")]);
        assert!(t.ignored.is_empty(), "{:?}", t.ignored);
    }

    #[test]
    fn quota_mode_is_the_global_soft_mode() {
        let t = run(&[("QUOTA_MODE", "true")], false).unwrap();
        assert_eq!(flags(&t), vec![("quota-mode", "true")]);
        assert!(t.ignored.is_empty(), "{:?}", t.ignored);
        assert!(run(&[("QUOTA_MODE", "sometimes")], false).is_err());
        let t = run(&[("MERGE_DOMAIN_CONFIG", "true")], false).unwrap();
        assert_eq!(flags(&t), vec![("merge-domain-config", "true")]);
        assert!(t.ignored.is_empty(), "{:?}", t.ignored);
    }

    #[test]
    fn reference_header_names() {
        let t = run(
            &[
                ("LIMIT_RESPONSE_HEADERS_ENABLED", "true"),
                ("LIMIT_LIMIT_HEADER", "X-Quota-Limit"),
                ("LIMIT_REMAINING_HEADER", "X-Quota-Left"),
                ("LIMIT_RESET_HEADER", "X-Quota-Reset"),
            ],
            false,
        )
        .unwrap();
        assert_eq!(
            flags(&t),
            vec![
                ("response-headers", "reference"),
                ("reference-limit-header", "X-Quota-Limit"),
                ("reference-remaining-header", "X-Quota-Left"),
                ("reference-reset-header", "X-Quota-Reset"),
            ]
        );
        assert!(t.ignored.is_empty(), "{:?}", t.ignored);
    }

    #[test]
    fn a_per_second_redis_gets_its_own_shape_credentials_and_tls() {
        let t = run(
            &[
                ("REDIS_SOCKET_TYPE", "tcp"),
                ("REDIS_URL", "main:6379"),
                ("REDIS_PERSECOND", "true"),
                ("REDIS_PERSECOND_SOCKET_TYPE", "tcp"),
                ("REDIS_PERSECOND_TYPE", "sentinel"),
                ("REDIS_PERSECOND_URL", "fast, s1:26379"),
                ("REDIS_PERSECOND_SENTINEL_AUTH", "spw"),
                ("REDIS_PERSECOND_AUTH", "u:mpw"),
                ("REDIS_PERSECOND_TLS", "true"),
                ("REDIS_PERSECOND_POOL_SIZE", "20"),
            ],
            false,
        )
        .unwrap();
        assert_eq!(
            flags(&t),
            vec![
                ("backend", "redis"),
                ("redis-url", "redis://main:6379"),
                ("redis-per-second-sentinel-master", "fast"),
                ("redis-per-second-sentinel-nodes", "rediss://:spw@s1:26379"),
                ("redis-per-second-tls", "true"),
                ("redis-per-second-username", "u"),
                ("redis-per-second-password", "mpw"),
            ]
        );
        assert_eq!(t.ignored.len(), 1, "{:?}", t.ignored);
        assert!(t.ignored[0].starts_with("REDIS_PERSECOND_POOL_SIZE=20"));
        // That service's defaults: a Unix socket of its own.
        let t = run(&[("REDIS_URL", "/m.sock"), ("REDIS_PERSECOND", "1")], false).unwrap();
        assert!(flags(&t).contains(&(
            "redis-per-second-url",
            "unix:///var/run/nutcracker/ratelimitpersecond.sock"
        )));
        // Off, it names nothing, whatever else is set.
        let t = run(
            &[
                ("REDIS_URL", "/m.sock"),
                ("REDIS_PERSECOND", "false"),
                ("REDIS_PERSECOND_URL", "/s.sock"),
            ],
            false,
        )
        .unwrap();
        assert!(!flags(&t).iter().any(|(f, _)| f.contains("per-second")));
        let err = run(&[("REDIS_PERSECOND", "true")], false).unwrap_err();
        assert!(err.contains("needs REDIS_URL"), "{err}");
        let err = run(
            &[
                ("REDIS_URL", "/m.sock"),
                ("REDIS_PERSECOND", "true"),
                ("REDIS_PERSECOND_TYPE", "ring"),
            ],
            false,
        )
        .unwrap_err();
        assert!(err.starts_with("REDIS_PERSECOND_TYPE=RING"), "{err}");
    }

    #[test]
    fn the_client_san_is_checked_only_when_client_certificates_are_asked_for() {
        let tls = [
            ("GRPC_SERVER_USE_TLS", "true"),
            ("GRPC_SERVER_TLS_CERT", "/c.pem"),
            ("GRPC_SERVER_TLS_KEY", "/k.pem"),
            ("GRPC_CLIENT_TLS_SAN", "envoy.example"),
        ];
        let t = run(
            &[&tls[..], &[("GRPC_CLIENT_TLS_CACERT", "/ca.pem")]].concat(),
            false,
        )
        .unwrap();
        assert_eq!(
            flags(&t),
            vec![
                ("grpc-tls-cert", "/c.pem"),
                ("grpc-tls-key", "/k.pem"),
                ("grpc-tls-client-ca", "/ca.pem"),
                ("grpc-tls-client-san", "envoy.example"),
            ]
        );
        assert!(t.ignored.is_empty(), "{:?}", t.ignored);
        // Without a client CA that service asks for no certificate: the name is said to
        // check nothing, and no flag that would need a CA is set.
        let t = run(&tls, false).unwrap();
        assert!(!flags(&t).iter().any(|(k, _)| *k == "grpc-tls-client-san"));
        assert!(
            t.ignored[0].contains("GRPC_CLIENT_TLS_SAN=envoy.example"),
            "{:?}",
            t.ignored
        );
    }

    #[test]
    fn stop_cache_key_increment_when_overlimit_true_makes_every_descriptor_an_admission() {
        let t = run(
            &[("STOP_CACHE_KEY_INCREMENT_WHEN_OVERLIMIT", "true")],
            false,
        )
        .unwrap();
        assert_eq!(flags(&t), vec![("accounting", "admission")]);
        // false is that service's default: the default accounting, nothing logged as ignored.
        let t = run(
            &[("STOP_CACHE_KEY_INCREMENT_WHEN_OVERLIMIT", "false")],
            false,
        )
        .unwrap();
        assert!(t.flags.is_empty() && t.ignored.is_empty(), "{t:?}");
        assert!(
            run(
                &[("STOP_CACHE_KEY_INCREMENT_WHEN_OVERLIMIT", "maybe")],
                false
            )
            .is_err()
        );
    }

    #[test]
    fn defaults_apply_only_as_a_drop_in() {
        let t = run(&[], true).unwrap();
        assert_eq!(flags(&t)[0], ("config", "/srv/runtime_data/current/config"));
        assert!(flags(&t).contains(&("log-level", "warn")));
        assert!(run(&[], false).unwrap().flags.is_empty());
    }

    #[test]
    fn every_redis_shape() {
        let t = run(
            &[
                ("REDIS_SOCKET_TYPE", "tcp"),
                ("REDIS_TYPE", "cluster"),
                ("REDIS_URL", "a:1, b:2"),
                ("REDIS_TLS", "true"),
                ("REDIS_AUTH", "user:p/w"),
                ("REDIS_TLS_CACERT", "/ca.pem"),
            ],
            false,
        )
        .unwrap();
        assert!(flags(&t).contains(&("redis-cluster-nodes", "rediss://a:1,rediss://b:2")));
        assert!(flags(&t).contains(&("redis-username", "user")));
        assert!(flags(&t).contains(&("redis-password", "p/w")));
        assert!(flags(&t).contains(&("redis-tls-ca", "/ca.pem")));
        let t = run(
            &[
                ("REDIS_SOCKET_TYPE", "tcp"),
                ("REDIS_TYPE", "SENTINEL"),
                ("REDIS_URL", "main,s1:26379,s2:26379"),
                ("REDIS_SENTINEL_AUTH", "spw"),
                ("REDIS_AUTH", "mpw"),
            ],
            false,
        )
        .unwrap();
        assert!(flags(&t).contains(&("redis-sentinel-master", "main")));
        assert!(flags(&t).contains(&(
            "redis-sentinel-nodes",
            "redis://:spw@s1:26379,redis://:spw@s2:26379"
        )));
        assert!(flags(&t).contains(&("redis-password", "mpw")));
        let t = run(&[("REDIS_URL", "/var/run/r.sock")], false).unwrap();
        assert!(flags(&t).contains(&("redis-url", "unix:///var/run/r.sock")));
    }

    #[test]
    fn unsupported_values_are_refused_and_the_rest_reported() {
        assert!(
            run(&[("BACKEND_TYPE", "memcache")], false)
                .unwrap_err()
                .contains("BACKEND_TYPE")
        );
        assert!(
            run(&[("CONFIG_TYPE", "GRPC_XDS_TLS")], false)
                .unwrap_err()
                .contains("CONFIG_TYPE")
        );
        assert!(run(&[("REDIS_URL", "x"), ("REDIS_TYPE", "ring")], false).is_err());
        let t = run(
            &[
                ("DISABLE_STATS", "true"),
                ("EXPIRATION_JITTER_MAX_SECONDS", "60"),
                ("RUNTIME_IGNOREDOTFILES", "true"),
            ],
            true,
        )
        .unwrap();
        // DISABLE_STATS is honoured (statsd off), so it is not reported as ignored.
        assert_eq!(t.ignored.len(), 1, "{:?}", t.ignored);
        assert!(t.ignored[0].starts_with("EXPIRATION_JITTER_MAX_SECONDS="));
        assert!(!flags(&t).iter().any(|(k, _)| k.starts_with("statsd")));
        assert!(
            run(&[("SHADOW_MODE", "maybe")], false)
                .unwrap_err()
                .contains("SHADOW_MODE")
        );
    }

    #[test]
    fn xds_variables_become_xds_flags_and_no_config_directory() {
        let t = run(
            &[
                ("CONFIG_TYPE", "GRPC_XDS_SOTW"),
                ("CONFIG_GRPC_XDS_SERVER_URL", "envoy-gateway:18001"),
                ("CONFIG_GRPC_XDS_NODE_ID", "envoy-ratelimit"),
                ("CONFIG_GRPC_XDS_NODE_METADATA", "a=1,skipped,b=x=y"),
                ("CONFIG_GRPC_XDS_CLIENT_ADDITIONAL_HEADERS", "k1:v1, k2:v2"),
                ("XDS_CLIENT_BACKOFF_INITIAL_INTERVAL", "1m30s"),
                ("XDS_CLIENT_BACKOFF_MAX_INTERVAL", "250ms"),
                ("XDS_CLIENT_BACKOFF_JITTER", "false"),
                ("CONFIG_GRPC_XDS_SERVER_USE_TLS", "true"),
                ("CONFIG_GRPC_XDS_SERVER_TLS_CACERT", "/certs/ca.crt"),
                ("CONFIG_GRPC_XDS_CLIENT_TLS_CERT", "/certs/tls.crt"),
                ("CONFIG_GRPC_XDS_CLIENT_TLS_KEY", "/certs/tls.key"),
                ("CONFIG_GRPC_XDS_SERVER_TLS_SAN", "envoy-gateway"),
            ],
            true,
        )
        .unwrap();
        let f = flags(&t);
        for want in [
            ("xds-server", "envoy-gateway:18001"),
            ("xds-node-id", "envoy-ratelimit"),
            ("xds-node-metadata", "a=1,b=x=y"),
            ("xds-headers", "k1=v1,k2=v2"),
            ("xds-backoff-initial", "90000ms"),
            ("xds-backoff-max", "250ms"),
            ("xds-backoff-jitter", "false"),
            ("xds-tls-ca", "/certs/ca.crt"),
            ("xds-tls-cert", "/certs/tls.crt"),
            ("xds-tls-key", "/certs/tls.key"),
            ("xds-tls-server-name", "envoy-gateway"),
        ] {
            assert!(f.contains(&want), "{want:?} in {f:?}");
        }
        assert!(!f.iter().any(|(k, _)| *k == "config"), "{f:?}");
        assert!(
            run(
                &[
                    ("CONFIG_TYPE", "GRPC_XDS_SOTW"),
                    ("XDS_CLIENT_BACKOFF_MAX_INTERVAL", "ten seconds"),
                ],
                true
            )
            .unwrap_err()
            .contains("XDS_CLIENT_BACKOFF_MAX_INTERVAL")
        );
    }

    #[test]
    fn go_durations() {
        for (text, ms) in [
            ("10s", 10_000.0),
            ("1m30s", 90_000.0),
            ("1.5h", 5_400_000.0),
            ("500ms", 500.0),
            ("0", 0.0),
            ("1h2m3s4ms", 3_723_004.0),
        ] {
            assert_eq!(
                go_duration(text).unwrap().as_secs_f64() * 1000.0,
                ms,
                "{text}"
            );
        }
        for bad in ["", "10", "s", "1d", "-1s", "1.2.3s"] {
            assert!(go_duration(bad).is_err(), "{bad}");
        }
    }
}
