//! Command-line flags, each also read from `RATELIMITD_<FLAG>` (upper case, `-` → `_`) when not
//! given on the command line. The environment is passed in, so tests never touch the process's.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use clap::{CommandFactory, Parser, ValueEnum};

pub mod envoyproxy;

use crate::engine::{EngineOptions, RequestLimits};
use crate::limiter::fallback::FailureMode;
use crate::limiter::key::{HashTag, KeyFormat, PrefixError};
use crate::limiter::redis::{Credentials, RedisOptions, RedisUrl, Target, TlsFiles};
use crate::server::conn::ConnLimits;
pub use crate::server::headers::HeaderMode;

/// Where counters are kept.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum BackendKind {
    /// In this process (the default): exact, fast, not shared between replicas.
    Memory,
    /// In Redis (standalone, cluster or sentinel), shared by every replica.
    Redis,
}

/// `--redis-failure-mode`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum FailureModeArg {
    /// gRPC UNAVAILABLE: Envoy's failure_mode_deny decides.
    Error,
    /// Answer OK.
    Allow,
    /// Answer OVER_LIMIT.
    Deny,
    /// Decide in this process until Redis is back.
    Local,
}

/// `--redis-hash-tag`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum HashTagArg {
    /// One slot per domain: exact all-or-nothing in one call.
    Domain,
    /// One slot per descriptor: spreads a domain over a cluster.
    Descriptor,
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
pub struct Secret(pub String);

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("***")
    }
}

fn parse_secret(s: &str) -> Result<Secret, String> {
    Ok(Secret(s.to_owned()))
}

/// Log line format.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum LogFormat {
    /// Human-readable lines.
    Text,
    /// One JSON object per line.
    Json,
}

/// Validated service settings.
#[derive(Clone, Debug, Parser)]
#[command(
    name = "ratelimitd",
    version,
    about = "Rate-limit service for Envoy and Istio (envoy.service.ratelimit.v3)",
    after_help = "Every flag can also be set as RATELIMITD_<FLAG>, e.g. RATELIMITD_GRPC_ADDR=0.0.0.0:8081; \
                  RATELIMITD_CONFIG takes a comma-separated list."
)]
pub struct Settings {
    /// Config file or directory (every *.yaml/*.yml inside, dot-files skipped); repeatable.
    /// Without it (and without RATELIMITD_CONFIG) the service reads envoyproxy/ratelimit's
    /// RUNTIME_ROOT/RUNTIME_SUBDIRECTORY/RUNTIME_APPDIRECTORY, as that service does.
    #[arg(long = "config", value_name = "PATH")]
    pub config: Vec<PathBuf>,

    /// envoyproxy/ratelimit variables that were set but change nothing here (logged at start).
    #[arg(skip)]
    pub ignored_env: Vec<String>,

    /// gRPC listen address (RateLimitService and grpc.health.v1).
    #[arg(long, default_value = "0.0.0.0:8081")]
    pub grpc_addr: SocketAddr,

    /// Serve gRPC over TLS with this certificate chain (PEM); with --grpc-tls-key. Reloaded
    /// when the file changes.
    #[arg(long, requires = "grpc_tls_key")]
    pub grpc_tls_cert: Option<PathBuf>,

    /// The gRPC listener's private key (PEM).
    #[arg(long, requires = "grpc_tls_cert")]
    pub grpc_tls_key: Option<PathBuf>,

    /// Require client certificates issued by this CA (PEM) on the gRPC listener (mutual TLS).
    #[arg(long, requires = "grpc_tls_cert")]
    pub grpc_tls_client_ca: Option<PathBuf>,

    /// HTTP listen address (/healthcheck, /metrics, /rlconfig).
    #[arg(long, default_value = "0.0.0.0:8080")]
    pub http_addr: SocketAddr,

    /// Also serve the HTTP endpoints here (envoyproxy/ratelimit's debug port, DEBUG_PORT).
    #[arg(long)]
    pub debug_addr: Option<SocketAddr>,

    /// Also serve the HTTP endpoints here (envoyproxy/ratelimit's PROMETHEUS_ADDR).
    #[arg(long)]
    pub metrics_addr: Option<SocketAddr>,

    /// Where counters are kept.
    #[arg(long, value_enum, default_value = "memory")]
    pub backend: BackendKind,

    /// Log format.
    #[arg(long, value_enum, default_value = "text")]
    pub log_format: LogFormat,

    /// Log filter: a level (error, warn, info, debug, trace) or tracing directives.
    #[arg(long, default_value = "info")]
    pub log_level: String,

    /// Fraction of a limit past which a decision is counted as near_limit.
    #[arg(long, default_value_t = 0.8, value_parser = parse_ratio)]
    pub near_limit_ratio: f64,

    /// Answer OK overall whatever the limits say (statuses and metrics still report them).
    #[arg(long, default_value_t = false, action = clap::ArgAction::Set, num_args = 0..=1, default_missing_value = "true")]
    pub shadow_mode: bool,

    /// Serve the admin API (inspect and reset counters) on the gRPC port. Off by default:
    /// anyone who can reach the port could reset limits.
    #[arg(long, default_value_t = false, action = clap::ArgAction::Set, num_args = 0..=1, default_missing_value = "true")]
    pub admin: bool,

    /// Rate-limit headers for Envoy to add to the client's response.
    #[arg(long, value_enum, default_value = "off")]
    pub response_headers: HeaderMode,

    /// Return the config `metadata` of the descriptors that passed (and the request's
    /// descriptors) in each response's dynamic_metadata, as envoyproxy/ratelimit does.
    #[arg(long, default_value_t = false, action = clap::ArgAction::Set, num_args = 0..=1, default_missing_value = "true")]
    pub response_dynamic_metadata: bool,

    /// Most descriptors in one request.
    #[arg(long, default_value_t = 64)]
    pub max_descriptors: usize,

    /// Most entries in one descriptor.
    #[arg(long, default_value_t = 32)]
    pub max_entries: usize,

    /// Longest entry key, in bytes.
    #[arg(long, default_value_t = 4096)]
    pub max_key_bytes: usize,

    /// Longest entry value, in bytes.
    #[arg(long, default_value_t = 4096)]
    pub max_value_bytes: usize,

    /// Most counters one request may touch (its descriptors' limits, after merging the same
    /// counter), so that one request's CPU and Redis time stay bounded.
    #[arg(long, default_value_t = 256)]
    pub max_counters: usize,

    /// Redis server (standalone): `redis://[user:pass@]host:port[/db]`, or `rediss://` for TLS.
    #[arg(long, value_parser = RedisUrlParser)]
    pub redis_url: Option<RedisUrl>,

    /// Redis Cluster seed nodes, comma-separated URLs.
    #[arg(long, value_parser = RedisUrlParser, value_delimiter = ',')]
    pub redis_cluster_nodes: Vec<RedisUrl>,

    /// Redis Sentinel nodes, comma-separated URLs (with --redis-sentinel-master).
    #[arg(long, value_parser = RedisUrlParser, value_delimiter = ',')]
    pub redis_sentinel_nodes: Vec<RedisUrl>,

    /// The master name the sentinels monitor.
    #[arg(long)]
    pub redis_sentinel_master: Option<String>,

    /// ACL user for Redis data nodes (standalone, cluster, or the master Sentinel names) whose
    /// URL has no user information. Sentinels take theirs from their own URLs.
    #[arg(long)]
    pub redis_username: Option<String>,

    /// Password for Redis data nodes whose URL has none (best set as RATELIMITD_REDIS_PASSWORD
    /// from a Secret). Sentinels take theirs from their own URLs.
    #[arg(long, value_parser = parse_secret)]
    pub redis_password: Option<Secret>,

    /// Reach Redis data nodes over TLS (as if their URLs said rediss://); for Sentinel, the master.
    #[arg(long, default_value_t = false, action = clap::ArgAction::Set, num_args = 0..=1, default_missing_value = "true")]
    pub redis_tls: bool,

    /// CA certificate (PEM) to verify a rediss:// server.
    #[arg(long)]
    pub redis_tls_ca: Option<PathBuf>,

    /// Client certificate (PEM) for mutual TLS.
    #[arg(long)]
    pub redis_tls_cert: Option<PathBuf>,

    /// Client key (PEM) for mutual TLS.
    #[arg(long)]
    pub redis_tls_key: Option<PathBuf>,

    /// Budget for one Redis call, redirections and retries included.
    #[arg(long, default_value = "100ms", value_parser = parse_timeout)]
    pub redis_timeout: Duration,

    /// What to answer while Redis is unavailable.
    #[arg(long, value_enum, default_value = "error")]
    pub redis_failure_mode: FailureModeArg,

    /// Prefix of every Redis key.
    #[arg(long, default_value = "ratelimit:")]
    pub redis_key_prefix: String,

    /// What a key's cluster hash tag covers.
    #[arg(long, value_enum, default_value = "domain")]
    pub redis_hash_tag: HashTagArg,

    /// Redis script calls in flight at once; requests arriving meanwhile share the next call.
    #[arg(long, default_value_t = 2, value_parser = clap::builder::TypedValueParser::map(clap::value_parser!(u16).range(1..=64), usize::from))]
    pub redis_pipeline: usize,

    /// Most requests one Redis script call decides (1 turns coalescing off).
    #[arg(long, default_value_t = 64, value_parser = clap::builder::TypedValueParser::map(clap::value_parser!(u16).range(1..=1024), usize::from))]
    pub redis_max_batch: usize,

    /// Bytes of the local over-limit cache, keys included (0 = off), e.g. 1MiB.
    #[arg(long, default_value = "0", value_parser = parse_bytes)]
    pub local_cache_bytes: u64,

    /// Bytes of counter state the memory backend (or the `local` failure mode) may hold, keys
    /// included; past it the counters closest to expiry are given up, e.g. 64MiB.
    #[arg(long, default_value = "64MiB", value_parser = parse_bytes)]
    pub memory_max_bytes: u64,

    /// How long in-flight calls may take to finish after SIGTERM before the process exits anyway.
    #[arg(long, default_value = "10s", value_parser = parse_grace)]
    pub shutdown_grace: Duration,

    /// Most client connections the gRPC port holds at once; one more is closed at accept.
    #[arg(long, default_value_t = 4096)]
    pub max_connections: usize,

    /// A connection that sends nothing, or reads nothing the server writes, for this long is
    /// closed (gRPC clients are pinged every third of it, so a live one never is).
    #[arg(long, default_value = "30s", value_parser = parse_timeout)]
    pub connection_idle_timeout: Duration,

    /// Longest time to receive a request and answer it (gRPC and HTTP); a gRPC client's
    /// shorter `grpc-timeout` wins.
    #[arg(long, default_value = "5s", value_parser = parse_timeout)]
    pub request_timeout: Duration,

    /// Bytes of requests one gRPC connection may have in flight (from their first byte until
    /// answered), e.g. 4MiB; a request past it is refused on that connection only.
    #[arg(long, default_value = "4MiB", value_parser = parse_bytes)]
    pub max_connection_request_bytes: u64,
}

fn parse_ratio(s: &str) -> Result<f64, String> {
    let v: f64 = s.parse().map_err(|e| format!("{e}"))?;
    if (0.0..=1.0).contains(&v) {
        Ok(v)
    } else {
        Err(format!("{v} is not between 0 and 1"))
    }
}

/// Parses `250ms`, `10s`, `2m` or a bare number of seconds, never more than a day: a longer
/// timeout or grace is a typo, and an unbounded one would overflow the runtime's timers.
pub fn parse_duration(s: &str) -> Result<Duration, String> {
    parse_duration_within(s, Duration::from_secs(86_400))
}

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
        _ => return Err(format!("'{s}' has an unknown unit (use ms, s or m)")),
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

/// `--shutdown-grace`: at most an hour.
fn parse_grace(s: &str) -> Result<Duration, String> {
    parse_duration_within(s, Duration::from_secs(3_600))
}

/// Parses a byte size: a number with an optional `k`, `m` or `g` suffix (powers of 1024,
/// optionally followed by `i`/`ib`/`b`), e.g. `64MiB`, `512k`, `1048576`.
pub fn parse_bytes(s: &str) -> Result<u64, String> {
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

impl Settings {
    /// Parses `args` (program name first), filling flags missing from them from `env`, and
    /// checks that they resolve (see [`Settings::resolve`]).
    pub fn parse_with_env<I, S>(
        args: I,
        env: impl Fn(&str) -> Option<String>,
    ) -> Result<Settings, clap::Error>
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        Settings::parse_unresolved(args, env)?.validate()
    }

    /// Parses like [`Settings::parse_with_env`] and resolves once: the settings (for logging
    /// and listeners) and the options the service runs with.
    pub fn parse_options_with_env<I, S>(
        args: I,
        env: impl Fn(&str) -> Option<String>,
    ) -> Result<(Settings, Options), clap::Error>
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        let settings = Settings::parse_unresolved(args, env)?;
        let options = settings.resolve().map_err(|e| e.to_clap())?;
        Ok((settings, options))
    }

    fn parse_unresolved<I, S>(
        args: I,
        env: impl Fn(&str) -> Option<String>,
    ) -> Result<Settings, clap::Error>
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        let mut args: Vec<String> = args.into_iter().map(Into::into).collect();
        let on_command_line = |given: &[String], flag: &str| {
            given
                .iter()
                .any(|a| a == flag || a.starts_with(&format!("{flag}=")))
        };
        let cli: Vec<String> = args.clone();
        for arg in Settings::command().get_arguments() {
            let Some(long) = arg.get_long() else { continue };
            let flag = format!("--{long}");
            if on_command_line(&cli, &flag) {
                continue;
            }
            let var = format!("RATELIMITD_{}", long.to_uppercase().replace('-', "_"));
            let Some(value) = env(&var) else { continue };
            if long == "config" {
                for part in value.split(',').filter(|p| !p.is_empty()) {
                    args.push(format!("{flag}={part}"));
                }
            } else {
                args.push(format!("{flag}={value}"));
            }
        }
        // envoyproxy/ratelimit's variables fill whatever is still missing.
        let given: Vec<String> = args.clone();
        let dropin = !on_command_line(&given, "--config");
        let translated = envoyproxy::translate(&env, dropin).map_err(|message| {
            Settings::command().error(clap::error::ErrorKind::ValueValidation, message)
        })?;
        for (long, value) in translated.flags {
            let flag = format!("--{long}");
            if !on_command_line(&given, &flag) {
                args.push(format!("{flag}={value}"));
            }
        }
        let mut settings = Settings::try_parse_from(args)?;
        settings.ignored_env = translated.ignored;
        Ok(settings)
    }

    /// Resolves and validates the settings into what the service runs with: every
    /// combination checked, every file the flags name found, the gRPC TLS files loaded.
    pub fn resolve(&self) -> Result<Options, SettingsError> {
        let (backend, keys) = match self.backend {
            BackendKind::Memory => (BackendOptions::Memory, KeyFormat::default()),
            BackendKind::Redis => (
                BackendOptions::Redis {
                    redis: Box::new(self.redis_options()?),
                    failure_mode: self.failure_mode(),
                },
                KeyFormat::new(
                    &self.redis_key_prefix,
                    match self.redis_hash_tag {
                        HashTagArg::Domain => HashTag::Domain,
                        HashTagArg::Descriptor => HashTag::Descriptor,
                    },
                )?,
            ),
        };
        let grpc_tls = match self.grpc_tls() {
            None => None,
            Some(files) => {
                let config = files.load().map_err(SettingsError::GrpcTls)?;
                Some(GrpcTls { files, config })
            }
        };
        Ok(Options {
            config: self.config.clone(),
            backend,
            keys,
            engine: EngineOptions {
                request_limits: RequestLimits {
                    max_descriptors: self.max_descriptors,
                    max_entries: self.max_entries,
                    max_key_bytes: self.max_key_bytes,
                    max_value_bytes: self.max_value_bytes,
                    max_counters: self.max_counters,
                    ..RequestLimits::default()
                },
                near_limit_ratio: self.near_limit_ratio,
                global_shadow_mode: self.shadow_mode,
                dynamic_metadata: self.response_dynamic_metadata,
            },
            grpc_tls,
            response_headers: self.response_headers,
            admin: self.admin,
            memory_max_bytes: self.memory_max_bytes,
            shutdown_grace: self.shutdown_grace,
            grpc_connections: ConnLimits {
                max_connections: self.max_connections,
                idle_timeout: self.connection_idle_timeout,
                request_bytes: usize::try_from(self.max_connection_request_bytes)
                    .unwrap_or(usize::MAX),
            },
            request_timeout: self.request_timeout,
        })
    }

    /// The Redis backend's options, or why they are incomplete.
    fn redis_options(&self) -> Result<RedisOptions, SettingsError> {
        let credentials = Credentials {
            username: self.redis_username.clone(),
            password: self.redis_password.as_ref().map(|s| s.0.clone()),
        };
        if credentials.username.is_some() && credentials.password.is_none() {
            return Err(SettingsError::UsernameWithoutPassword);
        }
        let data_node = |url: &RedisUrl| {
            let url = url.with_default_credentials(&credentials);
            if self.redis_tls { url.with_tls() } else { url }
        };
        let target = match (
            &self.redis_url,
            self.redis_cluster_nodes.is_empty(),
            self.redis_sentinel_nodes.is_empty(),
        ) {
            (Some(url), true, true) => Target::Standalone(data_node(url)),
            (None, false, true) => {
                Target::Cluster(self.redis_cluster_nodes.iter().map(data_node).collect())
            }
            (None, true, false) => Target::Sentinel {
                nodes: self.redis_sentinel_nodes.clone(),
                master: self
                    .redis_sentinel_master
                    .clone()
                    .ok_or(SettingsError::SentinelWithoutMaster)?,
                master_credentials: credentials.clone(),
                master_tls: self.redis_tls,
            },
            (None, true, true) => return Err(SettingsError::NoRedis),
            _ => return Err(SettingsError::SeveralRedis),
        };
        if self.redis_tls_cert.is_some() != self.redis_tls_key.is_some() {
            return Err(SettingsError::RedisTlsPair);
        }
        for (flag, file) in [
            ("--redis-tls-ca", &self.redis_tls_ca),
            ("--redis-tls-cert", &self.redis_tls_cert),
            ("--redis-tls-key", &self.redis_tls_key),
        ] {
            if let Some(file) = file
                && let Err(source) = std::fs::metadata(file)
            {
                return Err(SettingsError::File {
                    flag,
                    path: file.clone(),
                    source,
                });
            }
        }
        Ok(RedisOptions {
            target,
            tls: TlsFiles {
                ca: self.redis_tls_ca.clone(),
                cert: self.redis_tls_cert.clone(),
                key: self.redis_tls_key.clone(),
            },
            timeout: self.redis_timeout,
            local_cache_bytes: self.local_cache_bytes,
            pipeline: self.redis_pipeline,
            max_batch: self.redis_max_batch,
        })
    }

    /// Checks what no single flag's parser can: combinations, the Redis options when
    /// `--backend redis` is chosen, the gRPC TLS files. A failure is a usage error (exit 2),
    /// like a bad flag.
    pub fn validate(self) -> Result<Settings, clap::Error> {
        if let Err(e) = self.resolve() {
            return Err(e.to_clap());
        }
        Ok(self)
    }

    /// The gRPC listener's TLS files, when TLS is asked for.
    fn grpc_tls(&self) -> Option<crate::server::tls::TlsFiles> {
        Some(crate::server::tls::TlsFiles {
            cert: self.grpc_tls_cert.clone()?,
            key: self.grpc_tls_key.clone()?,
            client_ca: self.grpc_tls_client_ca.clone(),
        })
    }

    /// `--redis-failure-mode` as the limiter's type.
    fn failure_mode(&self) -> FailureMode {
        match self.redis_failure_mode {
            FailureModeArg::Error => FailureMode::Error,
            FailureModeArg::Allow => FailureMode::Allow,
            FailureModeArg::Deny => FailureMode::Deny,
            FailureModeArg::Local => FailureMode::Local,
        }
    }
}

/// The settings as the service runs with them: resolved, validated and typed.
pub struct Options {
    /// Config files and directories.
    pub config: Vec<PathBuf>,
    /// Where counters live.
    pub backend: BackendOptions,
    /// How counter keys are built.
    pub keys: KeyFormat,
    /// How the engine decides.
    pub engine: EngineOptions,
    /// TLS on the gRPC listener.
    pub grpc_tls: Option<GrpcTls>,
    /// Rate-limit headers added to responses.
    pub response_headers: HeaderMode,
    /// Serve the admin API.
    pub admin: bool,
    /// Bound of the memory backend (and the `local` failure mode).
    pub memory_max_bytes: u64,
    /// How long in-flight calls may finish after shutdown begins.
    pub shutdown_grace: Duration,
    /// Bounds of each gRPC connection.
    pub grpc_connections: ConnLimits,
    /// Longest time to receive and answer one request.
    pub request_timeout: Duration,
}

/// The chosen backend.
pub enum BackendOptions {
    /// The embedded memory backend.
    Memory,
    /// Redis, and what to answer while it is unavailable.
    Redis {
        /// Where and how to reach it.
        redis: Box<RedisOptions>,
        /// What to answer while it is unavailable.
        failure_mode: FailureMode,
    },
}

/// The gRPC listener's TLS: its files (watched for renewals) and their first load.
pub struct GrpcTls {
    /// The files.
    pub files: crate::server::tls::TlsFiles,
    /// The server config they gave at start.
    pub config: std::sync::Arc<rustls::ServerConfig>,
}

/// Settings that are individually valid but do not fit together, or name missing files.
#[derive(Debug, thiserror::Error)]
pub enum SettingsError {
    /// A user without a password.
    #[error("--redis-username needs --redis-password")]
    UsernameWithoutPassword,
    /// `--backend redis` with no Redis.
    #[error("--backend redis needs --redis-url, --redis-cluster-nodes or --redis-sentinel-nodes")]
    NoRedis,
    /// Two Redis shapes at once.
    #[error("give only one of --redis-url, --redis-cluster-nodes and --redis-sentinel-nodes")]
    SeveralRedis,
    /// Sentinels without the master's name.
    #[error("--redis-sentinel-nodes needs --redis-sentinel-master")]
    SentinelWithoutMaster,
    /// Half a client certificate.
    #[error("--redis-tls-cert and --redis-tls-key go together")]
    RedisTlsPair,
    /// A file a flag names cannot be read.
    #[error("{flag}: {}: {source}", path.display())]
    File {
        /// The flag.
        flag: &'static str,
        /// The file.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// A key prefix with braces.
    #[error("--redis-key-prefix: {0}")]
    KeyPrefix(#[from] PrefixError),
    /// The gRPC TLS files do not load.
    #[error("--grpc-tls-*: {0}")]
    GrpcTls(crate::server::tls::TlsError),
}

impl SettingsError {
    /// As a usage error (exit 2), like a bad flag.
    pub fn to_clap(&self) -> clap::Error {
        let kind = match self {
            SettingsError::GrpcTls(_) | SettingsError::File { .. } => {
                clap::error::ErrorKind::ValueValidation
            }
            _ => clap::error::ErrorKind::ArgumentConflict,
        };
        Settings::command().error(kind, self.to_string())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn parse(args: &[&str], env: &[(&str, &str)]) -> Result<Settings, clap::Error> {
        let env: HashMap<String, String> = env
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        Settings::parse_with_env(
            std::iter::once("ratelimitd").chain(args.iter().copied()),
            |k| env.get(k).cloned(),
        )
    }

    #[test]
    fn defaults_match_the_reference_ports() {
        let s = parse(&["--config", "x.yaml"], &[]).unwrap();
        assert_eq!(s.grpc_addr.port(), 8081);
        assert_eq!(s.http_addr.port(), 8080);
        assert_eq!(s.backend, BackendKind::Memory);
        assert_eq!(
            s.resolve().unwrap().engine.request_limits,
            RequestLimits::default()
        );
    }

    #[test]
    fn environment_fills_missing_flags_and_flags_win() {
        let s = parse(
            &["--grpc-addr", "127.0.0.1:1"],
            &[
                ("RATELIMITD_CONFIG", "a.yaml,dir"),
                ("RATELIMITD_GRPC_ADDR", "127.0.0.1:2"),
                ("RATELIMITD_MAX_DESCRIPTORS", "3"),
                ("RATELIMITD_SHADOW_MODE", "true"),
                ("RATELIMITD_SHUTDOWN_GRACE", "250ms"),
            ],
        )
        .unwrap();
        assert_eq!(
            s.config,
            vec![PathBuf::from("a.yaml"), PathBuf::from("dir")]
        );
        assert_eq!(s.grpc_addr.port(), 1);
        assert_eq!(s.max_descriptors, 3);
        assert!(s.shadow_mode);
        assert_eq!(s.shutdown_grace, Duration::from_millis(250));
        let s = parse(
            &["--config", "x"],
            &[
                ("RATELIMITD_REDIS_CLUSTER_NODES", "redis://a:1,redis://b:2"),
                ("RATELIMITD_REDIS_TIMEOUT", "50ms"),
            ],
        )
        .unwrap();
        let opts = s.redis_options().unwrap();
        assert!(matches!(opts.target, Target::Cluster(ref n) if n.len() == 2));
        assert_eq!(opts.timeout, Duration::from_millis(50));
        let s = parse(
            &["--config", "x", "--redis-url", "redis://:hunter2@h:1"],
            &[],
        )
        .unwrap();
        assert!(
            !format!("{s:?}").contains("hunter2"),
            "passwords never in Debug"
        );
    }

    #[test]
    fn bad_values_are_refused_with_the_flag_named() {
        let err = parse(&["--config", "x", "--near-limit-ratio", "2"], &[]).unwrap_err();
        assert!(err.to_string().contains("--near-limit-ratio"), "{err}");
        let err = parse(&["--config", "x", "--backend", "etcd"], &[]).unwrap_err();
        assert!(err.to_string().contains("--backend"), "{err}");
        // Without --config, envoyproxy/ratelimit's runtime directory and defaults.
        let s = parse(&[], &[]).unwrap();
        assert_eq!(
            s.config,
            vec![PathBuf::from("/srv/runtime_data/current/config")]
        );
        assert_eq!(s.debug_addr.map(|a| a.port()), Some(6070));
        let err = parse(&["--config", "x", "--backend", "redis"], &[]).unwrap_err();
        assert!(err.to_string().contains("--redis-url"), "{err}");
        assert_eq!(err.exit_code(), 2);
        let err = parse(
            &[
                "--config",
                "x",
                "--backend",
                "redis",
                "--redis-sentinel-nodes",
                "redis://a:1",
            ],
            &[],
        )
        .unwrap_err();
        assert!(err.to_string().contains("--redis-sentinel-master"), "{err}");
        let err = parse(
            &[
                "--config",
                "x",
                "--backend",
                "redis",
                "--redis-url",
                "redis://h:1",
                "--redis-key-prefix",
                "a{b}",
            ],
            &[],
        )
        .unwrap_err();
        assert!(err.to_string().contains("--redis-key-prefix"), "{err}");
        let err = parse(&["--config", "x", "--redis-url", "host:6379"], &[]).unwrap_err();
        assert!(err.to_string().contains("--redis-url"), "{err}");
        let err = parse(&["--config", "x"], &[("RATELIMITD_GRPC_ADDR", "nope")]).unwrap_err();
        assert!(err.to_string().contains("--grpc-addr"), "{err}");
    }

    #[test]
    fn huge_or_odd_durations_and_sizes_are_usage_errors_not_panics() {
        for (flag, value) in [
            ("--shutdown-grace", "99999999999999999999999"),
            ("--redis-timeout", "99999999999999999999999"),
            ("--redis-timeout", "1e400"),
            ("--shutdown-grace", "2h"),
            ("--redis-timeout", "0"),
            ("--redis-timeout", "61s"),
            ("--shutdown-grace", "."),
            ("--memory-max-bytes", "99999999999999999999GiB"),
            ("--memory-max-bytes", "2TiB"),
            ("--local-cache-bytes", "1.5MiB"),
            ("--near-limit-ratio", "NaN"),
            ("--max-descriptors", "99999999999999999999999"),
        ] {
            let err = parse(&["--config", "x", flag, value], &[]).unwrap_err();
            assert!(err.to_string().contains(flag), "{flag} {value}: {err}");
            assert_eq!(err.exit_code(), 2, "{flag} {value}");
        }
        let s = parse(
            &[
                "--config",
                "x",
                "--memory-max-bytes",
                "512KiB",
                "--redis-timeout",
                "60s",
            ],
            &[],
        )
        .unwrap();
        assert_eq!(s.memory_max_bytes, 512 * 1024);
        assert_eq!(s.redis_timeout, Duration::from_secs(60));
    }

    #[test]
    fn sentinel_master_credentials_and_tls_are_apart_from_the_sentinels() {
        let s = parse(
            &[
                "--config",
                "x",
                "--backend",
                "redis",
                "--redis-sentinel-nodes",
                "redis://:sentinel-pw@a:1",
                "--redis-sentinel-master",
                "m",
                "--redis-tls",
            ],
            &[("RATELIMITD_REDIS_PASSWORD", "master/pw")],
        )
        .unwrap();
        assert!(!format!("{s:?}").contains("pw"), "{s:?}");
        match s.redis_options().unwrap().target {
            Target::Sentinel {
                master_credentials,
                master_tls,
                nodes,
                ..
            } => {
                assert_eq!(master_credentials.password.as_deref(), Some("master/pw"));
                assert!(master_tls);
                assert!(!nodes[0].is_tls());
            }
            other => panic!("{other:?}"),
        }
    }
}
