//! Hot reload: watch the config directories (never the files: a Kubernetes ConfigMap update
//! swaps a `..data` symlink, and a watch on the file dies with the first swap), wait for the
//! burst of events to settle, reload everything, and hand the result to the caller.

use std::path::{Path, PathBuf};
use std::time::Duration;

use notify::{EventKind, RecommendedWatcher, RecursiveMode, Watcher};
use tokio::sync::mpsc;
use tokio::task::JoinHandle;

use super::{ConfigError, LoadedConfig, load_paths};

/// Quiet time after the last event before reloading; a burst longer than `MAX_DELAY` reloads
/// anyway. Together they keep a change in force well within a second.
const QUIET: Duration = Duration::from_millis(100);
const MAX_DELAY: Duration = Duration::from_millis(400);

/// Starts watching `paths`. Each time they change, every file is reloaded and `apply` gets the
/// result, unless the content is unchanged from `fingerprint` (the last good load). The watch
/// ends when the returned task is aborted or the runtime stops.
pub fn spawn<F>(
    paths: Vec<PathBuf>,
    mut fingerprint: u64,
    apply: F,
) -> Result<JoinHandle<()>, notify::Error>
where
    F: Fn(Result<LoadedConfig, ConfigError>) + Send + 'static,
{
    let (tx, mut rx) = mpsc::unbounded_channel::<()>();
    let mut watcher: RecommendedWatcher =
        notify::recommended_watcher(move |event: notify::Result<notify::Event>| match event {
            Ok(e) if matches!(e.kind, EventKind::Access(_)) => {}
            Ok(_) => {
                let _ = tx.send(());
            }
            Err(err) => tracing::warn!(%err, "config watch error"),
        })?;
    for path in &paths {
        let (target, mode) = watch_target(path);
        watcher.watch(&target, mode)?;
        tracing::debug!(path = %target.display(), "watching config");
    }

    Ok(tokio::spawn(async move {
        let _watcher = watcher; // dropping it ends the watch
        while rx.recv().await.is_some() {
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
            let paths = paths.clone();
            let Ok(result) = tokio::task::spawn_blocking(move || load_paths(&paths)).await else {
                continue;
            };
            match result {
                Ok(loaded) if loaded.fingerprint == fingerprint => {
                    tracing::debug!("config files touched but unchanged");
                }
                Ok(loaded) => {
                    fingerprint = loaded.fingerprint;
                    apply(Ok(loaded));
                }
                Err(err) => apply(Err(err)),
            }
        }
    }))
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
