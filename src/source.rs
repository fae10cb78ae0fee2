//! Where the config comes from: files, loaded at start and watched, or an xDS control plane,
//! followed. Either way a snapshot that compiled is installed in one step ([`Installer`]): it
//! is swapped in, logged, counted and its rules gauged; one that did not is logged and counted
//! and the previous one stays in force.

use std::path::PathBuf;
use std::sync::Arc;

use arc_swap::ArcSwap;
use tokio::sync::watch;

use crate::config::{self, CompileOptions, ConfigError, Snapshot, load_paths_with};
use crate::metrics::{LoadResult, Metrics};
use crate::shutdown::Tasks;
use crate::xds::{self, XdsOptions};

/// Where the config comes from, and how it is compiled.
pub(crate) struct SourceOptions {
    /// Files or an xDS server.
    pub(crate) from: ConfigSource,
    /// How the config is compiled.
    pub(crate) compile: CompileOptions,
    /// Serve before the first config (xDS).
    pub(crate) start_without_config: bool,
    /// Health waits for the first config (xDS).
    pub(crate) unhealthy_until_config: bool,
}

/// Files, or an xDS server.
pub(crate) enum ConfigSource {
    /// Files and directories, watched.
    Files(Vec<PathBuf>),
    /// An xDS control plane.
    Xds(Box<XdsOptions>),
}

/// Why the config source could not start.
#[derive(Debug, thiserror::Error)]
pub(crate) enum SourceError {
    /// The first load of the files failed.
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// The files could not be watched.
    #[error("cannot watch the config paths")]
    Watch(#[from] notify::Error),
}

/// Loads the config files `options` name without following them: the rules as `/rlconfig`
/// prints them, or the first error with its file, line and field.
pub(crate) fn check(options: &SourceOptions) -> Result<String, CheckError> {
    match &options.from {
        ConfigSource::Files(paths) => Ok(load_paths_with(paths, options.compile)?.snapshot.dump()),
        ConfigSource::Xds(_) => Err(CheckError::NotFiles),
    }
}

/// Why `--check` found no config to print.
#[derive(Debug, thiserror::Error)]
pub enum CheckError {
    /// A file is invalid (or missing).
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// The config comes over xDS: there are no files to check.
    #[error("--check reads config files; this config comes from an xDS server")]
    NotFiles,
}

/// The config in force, and for xDS a receiver that turns true with the first accepted
/// snapshot (until then the config is empty).
pub(crate) struct Source {
    /// The snapshot requests are decided against.
    pub(crate) config: Arc<ArcSwap<Snapshot>>,
    /// For xDS: whether a snapshot was accepted yet.
    pub(crate) loaded: Option<watch::Receiver<bool>>,
}

/// Starts following the config `options` name: the files are loaded now (the service does not
/// start without them) and watched; an xDS server is followed by a task.
pub(crate) fn start(
    options: &SourceOptions,
    metrics: &Arc<Metrics>,
    tasks: &mut Tasks,
) -> Result<Source, SourceError> {
    match &options.from {
        ConfigSource::Files(paths) => watch_files(paths, options.compile, metrics, tasks),
        ConfigSource::Xds(xds) => Ok(follow_xds(xds, options.compile, metrics, tasks)),
    }
}

/// Installs accepted snapshots and counts refused ones.
#[derive(Clone)]
struct Installer {
    config: Arc<ArcSwap<Snapshot>>,
    metrics: Arc<Metrics>,
}

/// Where an accepted snapshot came from, for its log line.
enum Origin<'a> {
    /// The files at start.
    Loaded { files: usize },
    /// The files, changed.
    Reloaded { files: usize },
    /// An xDS response.
    Xds { version: &'a str },
}

impl Installer {
    /// An installer whose config is `first` until the first install.
    fn new(first: Snapshot, metrics: &Arc<Metrics>) -> Installer {
        Installer {
            config: Arc::new(ArcSwap::from_pointee(first)),
            metrics: metrics.clone(),
        }
    }

    /// Swaps `snapshot` in, logs where it came from, counts the load and gauges its rules.
    fn install(&self, mut snapshot: Snapshot, origin: Origin<'_>) {
        let (domains, rules) = (snapshot.len(), snapshot.rule_count());
        match origin {
            Origin::Loaded { files } => tracing::info!(files, domains, rules, "config loaded"),
            Origin::Reloaded { files } => tracing::info!(files, domains, rules, "config reloaded"),
            Origin::Xds { version } => {
                tracing::info!(version, domains, rules, "config accepted from xDS");
            }
        }
        let in_force = snapshot.rule_paths();
        // Places the new config has not stay releasable for their lifetime.
        snapshot.retire(&self.config.load(), tokio::time::Instant::now());
        self.config.store(Arc::new(snapshot));
        // A request's own limit on a descriptor no rule matches is labelled apart.
        self.metrics
            .decisions
            .config_changed(|domain: &str, path: &str| {
                in_force.contains(domain, path)
                    || (path == crate::engine::OVERRIDE_RULE && in_force.has_domain(domain))
            });
        self.metrics.config_load(LoadResult::success);
        self.metrics.config_rules.set(rules as i64);
    }

    /// Counts a refused config; the previous one stays in force.
    fn refuse(&self) {
        self.metrics.config_load(LoadResult::error);
    }
}

/// Follows the config an xDS server sends.
fn follow_xds(
    options: &XdsOptions,
    compile: CompileOptions,
    metrics: &Arc<Metrics>,
    tasks: &mut Tasks,
) -> Source {
    let installer = Installer::new(Snapshot::not_loaded(), metrics);
    let config = installer.config.clone();
    let (loaded_tx, loaded) = watch::channel(false);
    let accepted = {
        let installer = installer.clone();
        move |snapshot: Snapshot, version: &str| {
            installer.install(snapshot, Origin::Xds { version });
            loaded_tx.send_replace(true);
        }
    };
    let refused = move |r: xds::Refusal<'_>| {
        if r.say {
            tracing::error!(
                error = r.why,
                "xDS config refused; the previous config stays in force"
            );
        }
        installer.refuse();
    };
    tasks.push(tokio::spawn(xds::run(
        options.clone(),
        compile,
        accepted,
        refused,
    )));
    Source {
        config,
        loaded: Some(loaded),
    }
}

/// Loads the config files and watches them.
fn watch_files(
    paths: &[PathBuf],
    compile: CompileOptions,
    metrics: &Arc<Metrics>,
    tasks: &mut Tasks,
) -> Result<Source, SourceError> {
    let loaded =
        load_paths_with(paths, compile).inspect_err(|_| metrics.config_load(LoadResult::error))?;
    let installer = Installer::new(Snapshot::not_loaded(), metrics);
    let files = loaded.files.len();
    installer.install(loaded.snapshot, Origin::Loaded { files });
    let config = installer.config.clone();
    let watcher = config::watch::spawn(
        paths.to_vec(),
        compile,
        loaded.fingerprint,
        move |result| match result {
            Ok(loaded) => {
                let files = loaded.files.len();
                installer.install(loaded.snapshot, Origin::Reloaded { files });
            }
            Err(err) => {
                tracing::error!(error = %err, "config reload refused; previous config stays in force");
                installer.refuse();
            }
        },
    )?;
    tasks.push(watcher);
    Ok(Source {
        config,
        loaded: None,
    })
}
