//! Settings: the command line and the environment, checked into the [`Options`] the service
//! runs with. One path, [`parse`], in three steps, one file each: the environment fills flags
//! missing from the command line (`environment.rs`, with envoyproxy/ratelimit's variables in
//! `envoyproxy.rs`), clap parses them (`flags.rs`), and resolution checks them together
//! (`check.rs`). The environment is passed in, so tests never touch the process's.

mod check;
mod environment;
mod envoyproxy;
mod flags;

use clap::Parser;

pub use self::check::{Options, SettingsError};
pub(crate) use self::flags::Flags;

use std::net::SocketAddr;

use crate::telemetry::TelemetryOptions;

/// What `main` needs around the service: where to bind, what to log and trace, what the
/// environment set that changes nothing here, and whether only to check the config files.
pub struct Startup {
    /// The gRPC listener's address.
    pub grpc_addr: SocketAddr,
    /// A Unix socket (its path and permission bits) to serve gRPC on instead of `grpc_addr`.
    pub grpc_uds: Option<(std::path::PathBuf, u32)>,
    /// The HTTP listener's address.
    pub http_addr: SocketAddr,
    /// More addresses serving the HTTP endpoints, each with the flag that named it.
    pub extra_http: Vec<(&'static str, SocketAddr)>,
    /// The debug port (`--debug-addr`): the HTTP endpoints and the debug pages.
    pub debug_addr: Option<SocketAddr>,
    /// The admin listener (`--admin-addr`).
    pub admin_addr: Option<SocketAddr>,
    /// envoyproxy/ratelimit variables that were set but change nothing here (logged at start).
    pub ignored_env: Vec<String>,
    /// `--check`: load the config files, print their rules and exit.
    pub check: bool,
    /// `--worker-gate`: start a [`crate::runtime::WorkerGate`] on the runtime.
    pub worker_gate: bool,
    /// Logging and tracing.
    pub telemetry: TelemetryOptions,
}

/// Parses `args` (program name first), filling flags they lack from `env`, and checks them:
/// what `main` needs around the service, and the options the service runs with. Every error
/// is a usage error (exit 2) that names the flag, as clap's own are.
pub fn parse<I, S>(
    args: I,
    env: impl Fn(&str) -> Option<String>,
) -> Result<(Startup, Options), clap::Error>
where
    I: IntoIterator<Item = S>,
    S: Into<String>,
{
    let (flags, options) = parse_flags(args, env)?;
    Ok((flags.startup(), options))
}

/// [`parse`], keeping the flags as clap parsed them.
fn parse_flags<I, S>(
    args: I,
    env: impl Fn(&str) -> Option<String>,
) -> Result<(Flags, Options), clap::Error>
where
    I: IntoIterator<Item = S>,
    S: Into<String>,
{
    let overlaid = environment::overlay(args.into_iter().map(Into::into).collect(), env)?;
    let mut flags = Flags::try_parse_from(overlaid.args)?;
    flags.ignored_env = overlaid.ignored;
    let options = flags.check().map_err(|e| e.to_clap())?;
    Ok((flags, options))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;
    use std::path::PathBuf;
    use std::time::Duration;

    use super::flags::BackendArg;
    use crate::engine::RequestLimits;
    use crate::limiter::redis::Topology;
    use crate::source::ConfigSource;

    fn parse(args: &[&str], env: &[(&str, &str)]) -> Result<Flags, clap::Error> {
        let env: HashMap<String, String> = env
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        super::parse_flags(
            std::iter::once("ratelimitd").chain(args.iter().copied()),
            |k| env.get(k).cloned(),
        )
        .map(|(flags, _)| flags)
    }

    #[test]
    fn defaults_match_the_reference_ports() {
        let s = parse(&["--config", "x.yaml"], &[]).unwrap();
        assert_eq!(s.grpc_addr.port(), 8081);
        assert_eq!(s.http_addr.port(), 8080);
        assert_eq!(s.backend, BackendArg::Memory);
        assert_eq!(
            s.check().unwrap().engine.request_limits,
            RequestLimits::default()
        );
    }

    #[test]
    fn the_reference_xds_environment_reads_the_config_from_xds_alone() {
        let env: HashMap<&str, &str> = [
            ("CONFIG_TYPE", "GRPC_XDS_SOTW"),
            ("CONFIG_GRPC_XDS_SERVER_URL", "envoy-gateway:18001"),
            ("CONFIG_GRPC_XDS_NODE_ID", "envoy-ratelimit"),
            ("RUNTIME_ROOT", "/data"),
        ]
        .into();
        let (flags, options) =
            super::parse_flags(["ratelimitd"], |k| env.get(k).map(|v| v.to_string())).unwrap();
        assert!(
            flags.config.is_empty(),
            "no config directory: {:?}",
            flags.config
        );
        match options.source.from {
            ConfigSource::Xds(x) => {
                assert_eq!(x.server, "http://envoy-gateway:18001");
                assert_eq!(x.node_id, "envoy-ratelimit");
            }
            ConfigSource::Files(f) => panic!("files {f:?}"),
        }
        // A config path and an xDS server at once is a usage error.
        let err = parse(&["--config", "x", "--xds-server", "h:1"], &[]).unwrap_err();
        assert_eq!(err.kind(), clap::error::ErrorKind::ArgumentConflict);
        let err = parse(&["--xds-server", "h:1", "--xds-headers", "novalue"], &[]).unwrap_err();
        assert!(err.to_string().contains("--xds-headers"), "{err}");
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
        assert!(matches!(opts.target, Topology::Cluster(ref n) if n.len() == 2));
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
        // A server name applies to one rediss:// URL or a Sentinel master over TLS, and not
        // beside the skip.
        let sentinel = [
            "--redis-sentinel-nodes",
            "redis://s:1",
            "--redis-sentinel-master",
            "m",
        ];
        let named = [
            "--config",
            "x",
            "--backend",
            "redis",
            "--redis-tls-server-name",
            "n",
        ];
        assert!(parse(&[&named[..], &sentinel, &["--redis-tls"]].concat(), &[]).is_ok());
        for target in [
            &sentinel[..],
            &["--redis-url", "redis://h:1"][..],
            &["--redis-cluster-nodes", "rediss://a:1,rediss://b:1"][..],
            &[
                "--redis-url",
                "rediss://h:1",
                "--redis-tls-skip-hostname-verification",
            ][..],
        ] {
            let err = parse(&[&named[..], target].concat(), &[]).unwrap_err();
            assert!(
                err.to_string().contains("--redis-tls-server-name n"),
                "{err}"
            );
        }
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
    fn a_per_second_store_is_checked_as_the_main_one() {
        let main = [
            "--config",
            "x",
            "--backend",
            "redis",
            "--redis-url",
            "redis://m:1",
        ];
        let s = parse(
            &[
                &main[..],
                &[
                    "--redis-per-second-cluster-nodes",
                    "redis://a:1,redis://b:2",
                    "--redis-per-second-password",
                    "fast/pw",
                    "--redis-per-second-tls",
                ],
            ]
            .concat(),
            &[],
        )
        .unwrap();
        assert!(!format!("{s:?}").contains("fast/pw"), "{s:?}");
        let opts = s.redis_options().unwrap();
        assert!(matches!(opts.target, Topology::Standalone(ref u) if !u.is_tls()));
        match opts.per_second {
            Some(Topology::Cluster(nodes)) => {
                assert_eq!(nodes.len(), 2);
                assert!(nodes.iter().all(|n| n.is_tls()));
            }
            other => panic!("{other:?}"),
        }
        assert!(
            parse(&main, &[])
                .unwrap()
                .redis_options()
                .unwrap()
                .per_second
                .is_none()
        );
        for (extra, says) in [
            (
                &[
                    "--redis-per-second-url",
                    "redis://p:1",
                    "--redis-per-second-cluster-nodes",
                    "redis://a:1",
                ][..],
                "give only one of --redis-per-second-url",
            ),
            (
                &["--redis-per-second-sentinel-nodes", "redis://s:1"][..],
                "--redis-per-second-sentinel-nodes needs --redis-per-second-sentinel-master",
            ),
            (
                &[
                    "--redis-per-second-url",
                    "redis://p:1",
                    "--redis-per-second-username",
                    "u",
                ][..],
                "--redis-per-second-username needs --redis-per-second-password",
            ),
        ] {
            let err = parse(&[&main[..], extra].concat(), &[]).unwrap_err();
            assert!(err.to_string().contains(says), "{extra:?}: {err}");
        }
        // A server name names one server: not a per-second one over TLS as well.
        let tls_main = [
            "--config",
            "x",
            "--backend",
            "redis",
            "--redis-url",
            "rediss://m:1",
        ];
        let named = [&tls_main[..], &["--redis-tls-server-name", "10.0.0.3"]].concat();
        assert!(parse(&named, &[]).is_ok());
        assert!(
            parse(
                &[&named[..], &["--redis-per-second-url", "redis://p:1"]].concat(),
                &[]
            )
            .is_ok()
        );
        let err = parse(
            &[&named[..], &["--redis-per-second-url", "rediss://p:1"]].concat(),
            &[],
        )
        .unwrap_err();
        assert!(
            err.to_string()
                .contains("a second server has a name of its own"),
            "{err}"
        );
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
            Topology::Sentinel {
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
