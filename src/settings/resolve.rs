//! Resolution: the parsed flags, checked together, into the [`Options`] the service runs
//! with. What no single flag's parser can check is checked here: combinations, the Redis
//! options when `--backend redis` is chosen, the files the flags name.

use std::path::PathBuf;
use std::time::Duration;

use clap::CommandFactory;

use super::flags::{
    AccountingArg, AlgorithmArg, BackendArg, FailureModeArg, Flags, HashTagArg, HeaderModeArg,
    TracingProtocolArg,
};
use crate::config::CompileOptions;
use crate::engine::{EngineOptions, RequestLimits};
use crate::limiter::fallback::FailureMode;
use crate::limiter::key::{HashTag, KeyFormat, PrefixError};
use crate::limiter::redis::{Credentials, RedisOptions, RedisUrl, Target, TlsFiles};
use crate::limiter::{Accounting, Algorithm};
use crate::quota::QuotaOptions;
use crate::server::conn::ConnLimits;
use crate::server::headers::HeaderMode;
use crate::telemetry::{Protocol, TracingOptions};
use crate::xds::{Backoff, Deadlines, XdsOptions, XdsTls};

impl Flags {
    /// Resolves and validates the settings into what the service runs with: every
    /// combination checked, every file the flags name found, the gRPC TLS files loaded.
    pub(super) fn resolve(&self) -> Result<Options, SettingsError> {
        if self.rlqs_assignment_ttl <= self.rlqs_report_interval {
            return Err(SettingsError::RlqsTtl);
        }
        let (backend, keys) = match self.backend {
            BackendArg::Memory => (BackendOptions::Memory, KeyFormat::default()),
            BackendArg::Redis => (
                BackendOptions::Redis {
                    redis: Box::new(self.redis_options()?),
                    failure_mode: self.failure_mode(),
                },
                KeyFormat::new(&self.redis_key_prefix, self.hash_tag())?,
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
            config: self.config_source()?,
            compile: CompileOptions {
                default_algorithm: self.default_algorithm(),
            },
            start_without_config: self.start_without_config,
            reference_metrics: self.reference_metrics,
            tracing: self.tracing.then(|| self.tracing_options()),
            unhealthy_until_config: self.unhealthy_until_config,
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
                accounting: match self.accounting {
                    AccountingArg::Auto => Accounting::Auto,
                    AccountingArg::Admission => Accounting::Admission,
                    AccountingArg::Report => Accounting::Report,
                },
            },
            max_debt: self.max_debt,
            grpc_tls,
            response_headers: self.header_mode(),
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
            quota: QuotaOptions {
                assignment_ttl: self.rlqs_assignment_ttl,
                abandon_after: self.rlqs_abandon_after,
                report_interval: self.rlqs_report_interval,
                max_buckets_per_stream: self.rlqs_max_buckets.max(1),
                max_bytes: usize::try_from(self.rlqs_max_bytes).unwrap_or(usize::MAX),
            },
        })
    }

    /// The Redis backend's options, or why they are incomplete.
    pub(super) fn redis_options(&self) -> Result<RedisOptions, SettingsError> {
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
        files_exist([
            ("--redis-tls-ca", self.redis_tls_ca.as_ref()),
            ("--redis-tls-cert", self.redis_tls_cert.as_ref()),
            ("--redis-tls-key", self.redis_tls_key.as_ref()),
        ])?;
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
            max_debt: self.max_debt,
        })
    }

    /// The gRPC listener's TLS files, when TLS is asked for.
    fn grpc_tls(&self) -> Option<crate::server::tls::TlsFiles> {
        Some(crate::server::tls::TlsFiles {
            cert: self.grpc_tls_cert.clone()?,
            key: self.grpc_tls_key.clone()?,
            client_ca: self.grpc_tls_client_ca.clone(),
        })
    }

    /// Files, or the xDS server.
    fn config_source(&self) -> Result<ConfigSource, SettingsError> {
        let Some(server) = &self.xds_server else {
            return Ok(ConfigSource::Files(self.config.clone()));
        };
        let tls = self.xds_tls()?;
        let scheme = if tls.is_some() { "https" } else { "http" };
        let server = match server.split_once("://") {
            Some(("https", _)) if tls.is_none() => return Err(SettingsError::XdsTlsCa),
            Some((_, rest)) => format!("{scheme}://{rest}"),
            None => format!("{scheme}://{server}"),
        };
        let pairs =
            |flag: &'static str, text: &str| -> Result<Vec<(String, String)>, SettingsError> {
                text.split(',')
                    .filter(|p| !p.trim().is_empty())
                    .map(|p| match p.split_once('=') {
                        Some((k, v)) if !k.trim().is_empty() => {
                            Ok((k.trim().to_owned(), v.trim().to_owned()))
                        }
                        _ => Err(SettingsError::Pairs {
                            flag,
                            pair: p.to_owned(),
                        }),
                    })
                    .collect()
            };
        Ok(ConfigSource::Xds(Box::new(XdsOptions {
            server,
            node_id: self.xds_node_id.clone(),
            node_metadata: pairs("--xds-node-metadata", &self.xds_node_metadata)?,
            headers: pairs("--xds-headers", &self.xds_headers)?,
            backoff: Backoff {
                initial: self.xds_backoff_initial,
                max: self.xds_backoff_max,
                factor: self.xds_backoff_factor,
                jitter: self.xds_backoff_jitter,
            },
            max_message_bytes: usize::try_from(self.xds_max_message_bytes).unwrap_or(usize::MAX),
            deadlines: Deadlines {
                connect: self.xds_connect_timeout,
                first_response: self.xds_response_timeout,
                keepalive_interval: self.xds_keepalive_interval,
                keepalive_timeout: self.xds_keepalive_timeout,
            },
            tls,
        })))
    }

    /// TLS to the xDS server, when any `--xds-tls-*` flag asks for it.
    fn xds_tls(&self) -> Result<Option<XdsTls>, SettingsError> {
        let asked = self.xds_tls_cert.is_some() || self.xds_tls_server_name.is_some();
        let Some(ca) = &self.xds_tls_ca else {
            return if asked {
                Err(SettingsError::XdsTlsCa)
            } else {
                Ok(None)
            };
        };
        files_exist([
            ("--xds-tls-ca", Some(ca)),
            ("--xds-tls-cert", self.xds_tls_cert.as_ref()),
            ("--xds-tls-key", self.xds_tls_key.as_ref()),
        ])?;
        Ok(Some(XdsTls {
            ca: ca.clone(),
            identity: self.xds_tls_cert.clone().zip(self.xds_tls_key.clone()),
            server_name: self.xds_tls_server_name.clone(),
        }))
    }

    /// `--tracing-*` as telemetry's options.
    fn tracing_options(&self) -> TracingOptions {
        let (protocol, port) = match self.tracing_protocol {
            TracingProtocolArg::Http => (Protocol::Http, 4318),
            TracingProtocolArg::Grpc => (Protocol::Grpc, 4317),
        };
        TracingOptions {
            protocol,
            endpoint: self
                .tracing_endpoint
                .clone()
                .unwrap_or_else(|| format!("http://localhost:{port}")),
            service_name: self.tracing_service_name.clone(),
            service_namespace: self.tracing_service_namespace.clone(),
            service_instance_id: self.tracing_service_instance_id.clone(),
            sampling_rate: self.tracing_sampling_rate,
        }
    }

    /// `--default-algorithm` as the limiter's type.
    fn default_algorithm(&self) -> Algorithm {
        match self.default_algorithm {
            AlgorithmArg::FixedWindow => Algorithm::FixedWindow,
            AlgorithmArg::SlidingWindow => Algorithm::SlidingWindow,
            AlgorithmArg::SlidingLog => Algorithm::SlidingLog,
            AlgorithmArg::TokenBucket => Algorithm::TokenBucket,
        }
    }

    /// `--redis-hash-tag` as the key format's type.
    fn hash_tag(&self) -> HashTag {
        match self.redis_hash_tag {
            HashTagArg::Domain => HashTag::Domain,
            HashTagArg::Descriptor => HashTag::Descriptor,
        }
    }

    /// `--response-headers` as the header writer's type.
    fn header_mode(&self) -> HeaderMode {
        match self.response_headers {
            HeaderModeArg::Off => HeaderMode::Off,
            HeaderModeArg::Draft03 => HeaderMode::Draft03,
            HeaderModeArg::Ietf => HeaderMode::Ietf,
            HeaderModeArg::Reference => HeaderMode::Reference,
        }
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

/// Each file the flags name that is given exists, or the error names the first missing one.
fn files_exist<const N: usize>(
    files: [(&'static str, Option<&PathBuf>); N],
) -> Result<(), SettingsError> {
    for (flag, file) in files {
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
    Ok(())
}

/// What the service runs with: every flag resolved, validated and typed, every file the flags
/// name found, the gRPC TLS files loaded. Made by [`parse`](super::parse), taken by
/// [`run`](crate::run).
pub struct Options {
    /// Where the config comes from.
    pub(crate) config: ConfigSource,
    /// How the config is compiled.
    pub(crate) compile: CompileOptions,
    /// Span export, when on.
    pub(crate) tracing: Option<TracingOptions>,
    /// Export envoyproxy/ratelimit's metric families too.
    pub(crate) reference_metrics: bool,
    /// Serve before the first config (xDS).
    pub(crate) start_without_config: bool,
    /// Health waits for the first config (xDS).
    pub(crate) unhealthy_until_config: bool,
    /// Where counters live.
    pub(crate) backend: BackendOptions,
    /// How counter keys are built.
    pub(crate) keys: KeyFormat,
    /// How the engine decides.
    pub(crate) engine: EngineOptions,
    /// TLS on the gRPC listener.
    pub(crate) grpc_tls: Option<GrpcTls>,
    /// Rate-limit headers added to responses.
    pub(crate) response_headers: HeaderMode,
    /// Serve the admin API.
    pub(crate) admin: bool,
    /// Bound of the memory backend (and the `local` failure mode).
    pub(crate) memory_max_bytes: u64,
    /// How far past its limit a cost report may take a counter, in limits (every backend).
    pub(crate) max_debt: u64,
    /// How long in-flight calls may finish after shutdown begins.
    pub(crate) shutdown_grace: Duration,
    /// Bounds of each gRPC connection.
    pub(crate) grpc_connections: ConnLimits,
    /// Longest time to receive and answer one request.
    pub(crate) request_timeout: Duration,
    /// The quota server's (RLQS) behaviour.
    pub(crate) quota: QuotaOptions,
}

/// Where the config comes from.
pub(crate) enum ConfigSource {
    /// Files and directories, watched.
    Files(Vec<PathBuf>),
    /// An xDS control plane.
    Xds(Box<XdsOptions>),
}

/// The chosen backend.
pub(crate) enum BackendOptions {
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
pub(crate) struct GrpcTls {
    /// The files.
    pub(crate) files: crate::server::tls::TlsFiles,
    /// The server config they gave at start.
    pub(crate) config: std::sync::Arc<rustls::ServerConfig>,
}

/// Flags that are individually valid but do not fit together, or name missing files.
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
    /// Assignments that would expire between two reports.
    #[error("--rlqs-assignment-ttl must be longer than --rlqs-report-interval")]
    RlqsTtl,
    /// TLS to the xDS server without a CA to verify it.
    #[error("TLS to the xDS server needs --xds-tls-ca")]
    XdsTlsCa,
    /// A list of pairs with one that is not `key=value`.
    #[error("{flag}: '{pair}' is not key=value")]
    Pairs {
        /// The flag.
        flag: &'static str,
        /// The pair.
        pair: String,
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
    pub(super) fn to_clap(&self) -> clap::Error {
        let kind = match self {
            SettingsError::GrpcTls(_) | SettingsError::File { .. } => {
                clap::error::ErrorKind::ValueValidation
            }
            _ => clap::error::ErrorKind::ArgumentConflict,
        };
        Flags::command().error(kind, self.to_string())
    }
}
