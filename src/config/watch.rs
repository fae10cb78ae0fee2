//! Hot reload: watch the config directories (never the files: a Kubernetes ConfigMap update
//! swaps a `..data` symlink, and a watch on the file dies with the first swap), wait for the
//! burst of events to settle, reload everything, and hand the result to the caller.

use std::path::{Path, PathBuf};
use std::time::Duration;

use notify::{EventKind, RecommendedWatcher, RecursiveMode, Watcher};
use tokio::sync::mpsc;
use tokio::task::JoinHandle;

use super::load::{self, Identity};
use super::{CompileOptions, ConfigError, LoadedConfig, load_paths_with};

/// Quiet time after the last event before reloading; a burst longer than `MAX_DELAY` reloads
/// anyway. Together they keep a change in force well within a second.
const QUIET: Duration = Duration::from_millis(100);
const MAX_DELAY: Duration = Duration::from_millis(400);
/// How often the watched directories are checked for having been swapped without an event.
const CHECK_EVERY: Duration = Duration::from_secs(1);

/// Starts watching `paths`. Each time they change, every file is reloaded and `apply` gets the
/// result, unless the content is unchanged from `fingerprint` (the last good load). The watch
/// ends when the returned task is aborted or the runtime stops.
///
/// A watched directory (a configured one, or a configured file's) is followed by path, not by
/// inode: every second its identity is checked, and when the path names another directory than
/// before (`mv limits old; mkdir limits`), the watch moves to the new one and says so in the log.
pub(crate) fn spawn<F>(
    paths: Vec<PathBuf>,
    compile: CompileOptions,
    mut fingerprint: u64,
    apply: F,
) -> Result<JoinHandle<()>, notify::Error>
where
    F: Fn(Result<LoadedConfig, ConfigError>) + Send + 'static,
{
    let (tx, mut rx) = mpsc::unbounded_channel::<()>();
    // Whether the last load was refused.
    let mut failing = false;
    let settle = tx.clone();
    let mut watcher: RecommendedWatcher =
        notify::recommended_watcher(move |event: notify::Result<notify::Event>| match event {
            Ok(e) if matches!(e.kind, EventKind::Access(_)) => {}
            Ok(_) => {
                let _ = tx.send(());
            }
            Err(err) => tracing::warn!(%err, "config watch error"),
        })?;
    let mut watched: Vec<Watched> = Vec::with_capacity(paths.len());
    for path in &paths {
        let (target, mode) = watch_target(path);
        watcher.watch(&target, mode)?;
        tracing::debug!(path = %target.display(), "watching config");
        watched.push(Watched {
            identity: identity(&target),
            target,
            mode,
        });
    }

    // A change between the caller's load and these watches made no event: reload once now
    // (nothing is applied if the files are as loaded).
    let _ = settle.send(());
    drop(settle);

    Ok(tokio::spawn(async move {
        let mut watcher = watcher; // dropping it ends the watch
        // Events say most changes. A watched directory replaced (`mv limits old; mkdir
        // limits`) or a symlink swapped higher up (envoyproxy/ratelimit's RUNTIME_ROOT) makes
        // none in what is watched, so the watched directories' identity is checked every
        // second. (Watching their parents as well was tried: a busy parent such as /tmp reloaded
        // the config at its own pace, re-logging a bad config's error each time, and the
        // directory's own events were then sometimes not delivered at all.)
        let mut check = tokio::time::interval(CHECK_EVERY);
        check.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                event = rx.recv() => {
                    if event.is_none() {
                        return;
                    }
                }
                _ = check.tick() => {
                    if watched.iter().all(|w| identity(&w.target) == w.identity) {
                        continue;
                    }
                }
            }
            let deadline = tokio::time::Instant::now() + MAX_DELAY;
            loop {
                let wait =
                    QUIET.min(deadline.saturating_duration_since(tokio::time::Instant::now()));
                match tokio::time::timeout(wait, rx.recv()).await {
                    Ok(Some(())) if wait > Duration::ZERO => continue,
                    Ok(None) => return,
                    _ => break,
                }
            }
            for w in &mut watched {
                w.follow(&mut watcher);
            }
            let paths = paths.clone();
            let Ok(result) =
                tokio::task::spawn_blocking(move || load_paths_with(&paths, compile)).await
            else {
                continue;
            };
            match result {
                // Unchanged, and the last load was good: nothing to do. After a refused load,
                // files put back as they were are a good load again (the config in force
                // is theirs), not a failure still standing.
                Ok(loaded) if loaded.fingerprint == fingerprint && !failing => {
                    tracing::debug!("config files touched but unchanged");
                }
                Ok(loaded) => {
                    fingerprint = loaded.fingerprint;
                    failing = false;
                    apply(Ok(loaded));
                }
                Err(err) => {
                    failing = true;
                    apply(Err(err));
                }
            }
        }
    }))
}

/// The identity of what `path` names now, following symlinks; `None` if nothing.
fn identity(path: &Path) -> Option<Identity> {
    std::fs::metadata(path).ok().map(|m| load::identity(&m))
}

/// The directory watched for one configured path: the path itself, or a file's directory.
struct Watched {
    target: PathBuf,
    mode: RecursiveMode,
    identity: Option<Identity>,
}

impl Watched {
    /// Moves the watch when the watched directory was replaced (or has come back): the watch
    /// follows the path, not the directory it named when it was set.
    fn follow(&mut self, watcher: &mut RecommendedWatcher) {
        let now = identity(&self.target);
        if now == self.identity {
            return;
        }
        let _ = watcher.unwatch(&self.target);
        match now {
            None => {
                tracing::warn!(path = %self.target.display(), "config directory is gone; the previous config stays in force until it is back");
            }
            Some(_) => match watcher.watch(&self.target, self.mode) {
                Ok(()) => {
                    tracing::info!(path = %self.target.display(), "config directory was replaced; watching the new one");
                }
                Err(err) => {
                    tracing::error!(path = %self.target.display(), %err, "cannot watch the replaced config directory");
                    return; // try again on the next event
                }
            },
        }
        self.identity = now;
    }
}

/// A directory is watched with everything below it; a file through its directory.
fn watch_target(path: &Path) -> (PathBuf, RecursiveMode) {
    if path.is_dir() {
        (path.to_owned(), RecursiveMode::Recursive)
    } else {
        let parent = path
            .parent()
            .filter(|p| !p.as_os_str().is_empty())
            .unwrap_or(Path::new("."));
        (parent.to_owned(), RecursiveMode::NonRecursive)
    }
}
