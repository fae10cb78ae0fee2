//! Resolution: the parsed flags, checked together, into the [`Options`] the service runs
//! with. What no single flag's parser can check is checked here: combinations, the Redis
//! options when `--backend redis` is chosen, the files the flags name.

use std::path::PathBuf;

use clap::CommandFactory;

use super::Startup;
use super::flags::{
    AccountingArg, AlgorithmArg, BackendArg, FailureModeArg, Flags, HashTagArg, HeaderModeArg,
    LogFormatArg, StatsdFormatArg, StatsdProtocolArg, TopValuesArg, TracingProtocolArg,
};
use crate::config::CompileOptions;
use crate::engine::{EngineOptions, RequestLimits};
use crate::limiter::failure_mode::FailureMode;
use crate::limiter::key::{HashTag, KeyFormat, PrefixError};
use crate::limiter::redis::{Credentials, RedisOptions, RedisTlsFiles, RedisUrl, Topology};
use crate::limiter::start::{BackendKind, BackendOptions};
use crate::limiter::{Accounting, Algorithm};
use crate::rlqs::BucketOptions;
use crate::server::conn::{ConnLimits, ConnectionAge};
use crate::server::headers::{HeaderMode, ReferenceNames};
use crate::server::rlqs::RlqsOptions;
use crate::server::serve::{AdminListenerOptions, MAX_HTTP_CONNECTIONS, ServerOptions};
use crate::server::tls::GrpcTls;
use crate::source::{ConfigSource, SourceOptions};
use crate::statsd::{Format, StatsdOptions, Transport};
use crate::telemetry::{LogFormat, Protocol, TelemetryOptions, TracingOptions};
use crate::xds::{Backoff, Deadlines, XdsOptions, XdsTls};

impl Flags {
    /// Checks the settings and turns them into what the service runs with: every
    /// combination checked, every file the flags name found, the gRPC TLS files loaded.
    pub(super) fn check(&self) -> Result<Options, SettingsError> {
        if self.rlqs_assignment_ttl <= self.rlqs_report_interval {
            return Err(SettingsError::RlqsTtl);
        }
        let admin_listener = match &self.admin_addr {
            None => None,
            Some(_) => {
                if let Some(file) = &self.admin_token_file {
                    crate::server::auth::check_file(file).map_err(SettingsError::AdminTokens)?;
                }
                let tls = self.admin_tls();
                let mutual = tls.as_ref().is_some_and(|t| t.client_ca.is_some());
                if self.admin_token_file.is_none() && !mutual {
                    return Err(SettingsError::AdminWithoutTokens);
                }
                let tls = match tls {
                    None => None,
                    Some(files) => {
                        let config = files.load().map_err(SettingsError::AdminTls)?;
                        Some(GrpcTls { files, config })
                    }
                };
                Some(AdminListenerOptions {
                    token_file: self.admin_token_file.clone(),
                    tls,
                })
            }
        };
        if self.overrides_file.is_some() && !matches!(self.backend, BackendArg::Memory) {
            return Err(SettingsError::OverridesFileWithRedis);
        }
        let (kind, keys): (_, KeyFormat) = match self.backend {
            BackendArg::Memory => (BackendKind::Memory, KeyFormat::default()),
            BackendArg::Redis => (
                BackendKind::Redis {
                    redis: Box::new(self.redis_options()?),
                    failure_mode: self.failure_mode(),
                    share_after: self.redis_share_after,
                },
                KeyFormat::new(&self.redis_key_prefix, self.hash_tag())?,
            ),
        };
        let keys = keys.with_longest_value(self.max_value_bytes);
        let grpc_tls = match self.grpc_tls() {
            None => None,
            Some(files) => {
                let config = files.load().map_err(SettingsError::GrpcTls)?;
                Some(GrpcTls { files, config })
            }
        };
        let engine = EngineOptions {
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
            global_quota_mode: self.quota_mode,
            dynamic_metadata: self.response_dynamic_metadata,
            accounting: match self.accounting {
                AccountingArg::Auto => Accounting::Auto,
                AccountingArg::Admission => Accounting::Admission,
                AccountingArg::Report => Accounting::Report,
            },
            top: crate::top::TopOptions {
                capacity: self.top_capacity,
                memory_bytes: usize::try_from(self.top_memory_bytes).unwrap_or(usize::MAX),
                window: self.top_window,
                publish_every: self.top_publish_interval,
                metrics: self.top_metrics,
                values: match self.top_values {
                    TopValuesArg::Show => crate::top::Values::Show,
                    TopValuesArg::Hash => crate::top::Values::Hash,
                    TopValuesArg::Hide => crate::top::Values::Hide,
                },
            },
        };
        let compile = CompileOptions {
            default_algorithm: self.default_algorithm(),
            merge_domains: self.merge_domain_config,
            calendar: self
                .calendar_timezone
                .as_deref()
                .and_then(crate::limiter::calendar::zone),
        };
        let grpc_connections = ConnLimits {
            max_connections: self.max_connections,
            idle_timeout: self.connection_idle_timeout,
            request_bytes: usize::try_from(self.max_connection_request_bytes).unwrap_or(usize::MAX),
            // At most 16 MiB (its parser's bound).
            max_header_bytes: u32::try_from(self.grpc_max_header_bytes).unwrap_or(u32::MAX),
            age: (!self.grpc_max_connection_age.is_zero()).then_some(ConnectionAge {
                age: self.grpc_max_connection_age,
                grace: self.grpc_max_connection_age_grace,
            }),
        };
        Ok(Options {
            source: SourceOptions {
                from: self.config_source()?,
                compile,
                start_without_config: self.start_without_config,
                unhealthy_until_config: self.unhealthy_until_config,
            },
            backend: BackendOptions {
                kind,
                memory_max_bytes: self.memory_max_bytes,
                max_debt: self.max_debt,
            },
            rlqs: RlqsOptions {
                buckets: BucketOptions {
                    assignment_ttl: self.rlqs_assignment_ttl,
                    abandon_after: self.rlqs_abandon_after,
                    report_interval: self.rlqs_report_interval,
                    max_buckets_per_stream: self.rlqs_max_buckets.max(1),
                    max_bytes: usize::try_from(self.rlqs_max_bytes).unwrap_or(usize::MAX),
                },
                keys: keys.clone(),
                limits: engine.request_limits,
                global_shadow: engine.global_shadow_mode,
            },
            keys,
            engine,
            server: ServerOptions {
                grpc_tls,
                telling: crate::server::grpc::Telling {
                    headers: self.header_mode(),
                    answer: match &self.default_answer {
                        None => None,
                        Some(path) => Some(std::sync::Arc::new(
                            crate::config::answer::read_file(path)
                                .map_err(SettingsError::DefaultAnswer)?,
                        )),
                    },
                },
                admin: self.admin,
                admin_listener,
                grpc_connections,
                // The HTTP ports share one cap of their own, with the gRPC port's silence bound;
                // HTTP/1 has no GOAWAY, and those connections are not Envoy's to rebalance.
                http_connections: ConnLimits {
                    max_connections: MAX_HTTP_CONNECTIONS,
                    age: None,
                    ..grpc_connections
                },
                request_timeout: self.request_timeout,
                drain_delay: self.drain_delay,
                shutdown_grace: self.shutdown_grace,
            },
            overrides: crate::overrides::OverrideOptions {
                file: self.overrides_file.clone(),
                max: self.max_overrides,
                compile,
            },
            reference_metrics: self.reference_metrics,
            removed_series_grace: self.removed_series_grace,
            statsd: self.statsd_addr.clone().map(|addr| StatsdOptions {
                addr,
                protocol: match self.statsd_protocol {
                    StatsdProtocolArg::Udp => Transport::Udp,
                    StatsdProtocolArg::Tcp => Transport::Tcp,
                },
                format: match self.statsd_format {
                    StatsdFormatArg::Statsd => Format::Statsd,
                    StatsdFormatArg::Dogstatsd => Format::DogStatsd,
                },
                tags: self.statsd_tags.0.clone(),
                flush_interval: self.statsd_flush_interval,
            }),
        })
    }

    /// What `main` needs around the service.
    pub(super) fn startup(self) -> Startup {
        let telemetry = TelemetryOptions {
            log_level: self.log_level.clone(),
            log_format: match self.log_format {
                LogFormatArg::Text => LogFormat::Text,
                LogFormatArg::Json => LogFormat::Json,
            },
            tracing: self.tracing.then(|| self.tracing_options()),
        };
        Startup {
            grpc_addr: self.grpc_addr,
            grpc_uds: self.grpc_uds.clone().map(|p| (p, self.grpc_uds_mode)),
            http_addr: self.http_addr,
            extra_http: [("--metrics-addr", self.metrics_addr)]
                .into_iter()
                .filter_map(|(flag, addr)| Some((flag, addr?)))
                .collect(),
            debug_addr: self.debug_addr,
            admin_addr: self.admin_addr,
            ignored_env: self.ignored_env,
            check: self.check,
            worker_gate: self.worker_gate,
            telemetry,
        }
    }

    /// The Redis backend's options, or why they are incomplete.
    pub(super) fn redis_options(&self) -> Result<RedisOptions, SettingsError> {
        let target = self
            .main_store()
            .topology()?
            .ok_or(SettingsError::NoRedis)?;
        let per_second = self.per_second_store().topology()?;
        if let Some(name) = &self.redis_tls_server_name {
            let standalone_tls = match &target {
                Topology::Standalone(url) => url.is_tls(),
                Topology::Sentinel { master_tls, .. } => *master_tls,
                Topology::Cluster(_) => false,
            };
            let per_second_tls = per_second.as_ref().is_some_and(|t| match t {
                Topology::Standalone(url) => url.is_tls(),
                Topology::Cluster(nodes) => nodes.iter().any(RedisUrl::is_tls),
                Topology::Sentinel { master_tls, .. } => *master_tls,
            });
            if !standalone_tls || per_second_tls || self.redis_tls_skip_hostname_verification {
                return Err(SettingsError::ServerName(name.clone()));
            }
        }
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
            tls: RedisTlsFiles {
                ca: self.redis_tls_ca.clone(),
                cert: self.redis_tls_cert.clone(),
                key: self.redis_tls_key.clone(),
                skip_hostname_verification: self.redis_tls_skip_hostname_verification,
                server_name: self.redis_tls_server_name.clone(),
            },
            timeout: self.redis_timeout,
            local_cache_bytes: self.local_cache_bytes,
            pipeline: self.redis_pipeline,
            max_batch: self.redis_max_batch,
            max_debt: self.max_debt,
            per_second,
        })
    }

    /// The flags that name the main store.
    fn main_store(&self) -> StoreFlags<'_> {
        StoreFlags {
            flag: "--redis",
            url: self.redis_url.as_ref(),
            cluster_nodes: &self.redis_cluster_nodes,
            sentinel_nodes: &self.redis_sentinel_nodes,
            sentinel_master: self.redis_sentinel_master.as_deref(),
            username: self.redis_username.as_deref(),
            password: self.redis_password.as_ref().map(|s| s.0.as_str()),
            tls: self.redis_tls,
        }
    }

    /// The flags that name the per-second store.
    fn per_second_store(&self) -> StoreFlags<'_> {
        StoreFlags {
            flag: "--redis-per-second",
            url: self.redis_per_second_url.as_ref(),
            cluster_nodes: &self.redis_per_second_cluster_nodes,
            sentinel_nodes: &self.redis_per_second_sentinel_nodes,
            sentinel_master: self.redis_per_second_sentinel_master.as_deref(),
            username: self.redis_per_second_username.as_deref(),
            password: self
                .redis_per_second_password
                .as_ref()
                .map(|s| s.0.as_str()),
            tls: self.redis_per_second_tls,
        }
    }

    /// The gRPC listener's TLS files, when TLS is asked for.
    fn admin_tls(&self) -> Option<crate::server::tls::ListenerTlsFiles> {
        Some(crate::server::tls::ListenerTlsFiles {
            cert: self.admin_tls_cert.clone()?,
            key: self.admin_tls_key.clone()?,
            client_ca: self.admin_tls_client_ca.clone(),
            client_san: None,
        })
    }

    fn grpc_tls(&self) -> Option<crate::server::tls::ListenerTlsFiles> {
        Some(crate::server::tls::ListenerTlsFiles {
            cert: self.grpc_tls_cert.clone()?,
            key: self.grpc_tls_key.clone()?,
            client_ca: self.grpc_tls_client_ca.clone(),
            client_san: self.grpc_tls_client_san.clone(),
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
            HeaderModeArg::Reference => HeaderMode::Reference(self.reference_names()),
        }
    }

    /// The reference headers' names. A name other than the default is kept for the life of the
    /// process (three short strings, once at start), so every response borrows it.
    fn reference_names(&self) -> ReferenceNames {
        let defaults = ReferenceNames::default();
        let keep = |name: &str, default: &'static str| -> &'static str {
            if name == default {
                default
            } else {
                Box::leak(name.to_owned().into_boxed_str())
            }
        };
        ReferenceNames {
            limit: keep(&self.reference_limit_header, defaults.limit),
            remaining: keep(&self.reference_remaining_header, defaults.remaining),
            reset: keep(&self.reference_reset_header, defaults.reset),
        }
    }

    /// `--redis-failure-mode` as the limiter's type.
    fn failure_mode(&self) -> FailureMode {
        match self.redis_failure_mode {
            FailureModeArg::Error => FailureMode::Error,
            FailureModeArg::Allow => FailureMode::Allow,
            FailureModeArg::Deny => FailureMode::Deny,
            FailureModeArg::Local => FailureMode::Local,
            FailureModeArg::Share => FailureMode::Share,
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

/// What the service runs with: every flag checked and typed, every file the flags
/// name found, the gRPC TLS files loaded, grouped by who uses them. Made by
/// [`parse`](super::parse), taken by [`run`](crate::run).
pub struct Options {
    /// Where the config comes from.
    pub(crate) source: SourceOptions,
    /// Where counters live.
    pub(crate) backend: BackendOptions,
    /// How counter keys are built (the engine's, the RLQS pools' and Redis's).
    pub(crate) keys: KeyFormat,
    /// How the engine decides.
    pub(crate) engine: EngineOptions,
    /// The RLQS service's behaviour.
    pub(crate) rlqs: RlqsOptions,
    /// How the servers serve.
    pub(crate) server: ServerOptions,
    /// Where the operator's overrides are kept, and their bound.
    pub(crate) overrides: crate::overrides::OverrideOptions,
    /// Export envoyproxy/ratelimit's metric families too.
    pub(crate) reference_metrics: bool,
    /// How long a removed rule's per-rule series stay.
    pub(crate) removed_series_grace: std::time::Duration,
    /// The statsd sink, if on.
    pub(crate) statsd: Option<StatsdOptions>,
}

/// The flags that name one Redis store: `--redis-*` or `--redis-per-second-*`.
struct StoreFlags<'a> {
    /// The flags' common start, for errors.
    flag: &'static str,
    url: Option<&'a RedisUrl>,
    cluster_nodes: &'a [RedisUrl],
    sentinel_nodes: &'a [RedisUrl],
    sentinel_master: Option<&'a str>,
    username: Option<&'a str>,
    password: Option<&'a str>,
    tls: bool,
}

impl StoreFlags<'_> {
    /// Where the store is, `None` when no flag names it.
    fn topology(&self) -> Result<Option<Topology>, SettingsError> {
        let credentials = Credentials {
            username: self.username.map(str::to_owned),
            password: self.password.map(str::to_owned),
        };
        if credentials.username.is_some() && credentials.password.is_none() {
            return Err(SettingsError::UsernameWithoutPassword(self.flag));
        }
        let data_node = |url: &RedisUrl| {
            let url = url.with_default_credentials(&credentials);
            if self.tls { url.with_tls() } else { url }
        };
        Ok(Some(
            match (
                self.url,
                self.cluster_nodes.is_empty(),
                self.sentinel_nodes.is_empty(),
            ) {
                (Some(url), true, true) => Topology::Standalone(data_node(url)),
                (None, false, true) => {
                    Topology::Cluster(self.cluster_nodes.iter().map(data_node).collect())
                }
                (None, true, false) => Topology::Sentinel {
                    nodes: self.sentinel_nodes.to_vec(),
                    master: self
                        .sentinel_master
                        .ok_or(SettingsError::SentinelWithoutMaster(self.flag))?
                        .to_owned(),
                    master_credentials: credentials.clone(),
                    master_tls: self.tls,
                },
                (None, true, true) => return Ok(None),
                _ => return Err(SettingsError::SeveralRedis(self.flag)),
            },
        ))
    }
}

/// Flags that are individually valid but do not fit together, or name missing files.
#[derive(Debug, thiserror::Error)]
pub enum SettingsError {
    /// The admin listener with no way to know who calls.
    #[error(
        "--admin-addr needs --admin-token-file, or --admin-tls-cert, --admin-tls-key and --admin-tls-client-ca: the admin listener changes limits, and does not start without knowing who calls"
    )]
    AdminWithoutTokens,
    /// The admin listener's TLS files do not load.
    #[error("--admin-tls-*: {0}")]
    AdminTls(crate::server::tls::TlsError),
    /// A token file that cannot be used.
    #[error("--admin-token-file {0}")]
    AdminTokens(String),
    /// `--overrides-file` with Redis, where overrides live in Redis.
    #[error("--overrides-file is for the memory backend; with Redis, overrides live in Redis")]
    OverridesFileWithRedis,
    /// A user without a password (of the store whose flags start so).
    #[error("{0}-username needs {0}-password")]
    UsernameWithoutPassword(&'static str),
    /// `--backend redis` with no Redis.
    #[error("--backend redis needs --redis-url, --redis-cluster-nodes or --redis-sentinel-nodes")]
    NoRedis,
    /// Two Redis shapes at once (for the store whose flags start so).
    #[error("give only one of {0}-url, {0}-cluster-nodes and {0}-sentinel-nodes")]
    SeveralRedis(&'static str),
    /// Sentinels without the master's name.
    #[error("{0}-sentinel-nodes needs {0}-sentinel-master")]
    SentinelWithoutMaster(&'static str),
    /// A server name where it cannot apply.
    #[error(
        "--redis-tls-server-name {0} applies to one rediss:// --redis-url or a Sentinel master reached over TLS, without --redis-tls-skip-hostname-verification or a per-second store over TLS: a cluster's nodes are dialled at the addresses they announce, each verified against its own, and a second server has a name of its own"
    )]
    ServerName(String),
    /// Half a client certificate.
    #[error("--redis-tls-cert and --redis-tls-key go together")]
    RedisTlsPair,
    /// The default answer's file cannot be used.
    #[error("--default-answer: {0}")]
    DefaultAnswer(crate::config::ConfigError),
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
            SettingsError::GrpcTls(_) | SettingsError::AdminTls(_) | SettingsError::File { .. } => {
                clap::error::ErrorKind::ValueValidation
            }
            _ => clap::error::ErrorKind::ArgumentConflict,
        };
        Flags::command().error(kind, self.to_string())
    }
}
