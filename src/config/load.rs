//! Finding and reading config files: a config path is a file or a directory. In a directory,
//! every `*.yaml`/`*.yml` counts (subdirectories too), and dot-files and dot-directories are
//! skipped, so Kubernetes ConfigMap mounts (`..data`, `..2026_…`) are read once, through the
//! visible symlinks.

use std::collections::HashMap;
use std::hash::{DefaultHasher, Hash, Hasher};
use std::path::{Path, PathBuf};

use super::{ConfigError, Snapshot, compile_file};

/// Directory nesting followed below a config path (symlink loops end here).
const MAX_DEPTH: usize = 8;

/// A validated snapshot and what it was built from.
#[derive(Debug)]
pub struct LoadedConfig {
    /// The rules.
    pub snapshot: Snapshot,
    /// Every file read, in load order.
    pub files: Vec<PathBuf>,
    /// Hash of every file's path and content: equal fingerprints mean nothing changed.
    pub fingerprint: u64,
}

/// Reads every config file under `paths` and builds one snapshot, or fails as a whole.
pub fn load_paths(paths: &[PathBuf]) -> Result<LoadedConfig, ConfigError> {
    let mut files = Vec::new();
    for path in paths {
        collect(path, 0, &mut files)?;
    }
    let mut hasher = DefaultHasher::new();
    let mut domains = Vec::with_capacity(files.len());
    let mut seen: HashMap<String, PathBuf> = HashMap::new();
    for file in &files {
        let text = std::fs::read_to_string(file).map_err(|e| ConfigError::io(file, &e))?;
        (file, &text).hash(&mut hasher);
        let domain = compile_file(file, &text)?;
        if let Some(first) = seen.get(domain.name.as_str()) {
            return Err(ConfigError::at(
                file,
                Some((domain.line, 1)),
                "domain",
                format!(
                    "duplicate domain '{}' (also defined in {})",
                    domain.name,
                    first.display()
                ),
            ));
        }
        seen.insert(domain.name.as_str().to_owned(), file.clone());
        domains.push(domain);
    }
    Ok(LoadedConfig {
        snapshot: Snapshot::new(domains),
        files,
        fingerprint: hasher.finish(),
    })
}

fn collect(path: &Path, depth: usize, out: &mut Vec<PathBuf>) -> Result<(), ConfigError> {
    let meta = std::fs::metadata(path).map_err(|e| ConfigError::io(path, &e))?;
    if !meta.is_dir() {
        out.push(path.to_owned());
        return Ok(());
    }
    if depth > MAX_DEPTH {
        return Ok(());
    }
    let mut entries: Vec<PathBuf> = std::fs::read_dir(path)
        .map_err(|e| ConfigError::io(path, &e))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| !n.starts_with('.'))
        })
        .collect();
    entries.sort();
    for entry in entries {
        // A dangling symlink (a ConfigMap mid-swap) is skipped, not fatal.
        let Ok(meta) = std::fs::metadata(&entry) else {
            continue;
        };
        if meta.is_dir() {
            collect(&entry, depth + 1, out)?;
        } else if entry
            .extension()
            .and_then(|e| e.to_str())
            .is_some_and(|e| e == "yaml" || e == "yml")
        {
            out.push(entry);
        }
    }
    Ok(())
}
