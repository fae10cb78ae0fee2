//! Finding and reading config files: a config path is a file or a directory. In a directory,
//! every `*.yaml`/`*.yml` counts (subdirectories too), and dot-files and dot-directories are
//! skipped, so Kubernetes ConfigMap mounts (`..data`, `..2026_…`) are read once, through the
//! visible symlinks.

use std::hash::{DefaultHasher, Hash, Hasher};
use std::path::{Path, PathBuf};

use super::{CompileOptions, ConfigError, Domains, Refused, Snapshot, compile_file_with};

/// Directory nesting followed below a config path.
const MAX_DEPTH: usize = 8;
/// Largest config file read: ten times a 100,000-descriptor file, so no honest config meets it,
/// and a file that grows without end (a log written into the config directory) is refused
/// before it is read rather than after it has filled memory.
pub(super) const MAX_FILE_BYTES: u64 = 256 << 20;

/// Reads a config file of at most [`MAX_FILE_BYTES`].
fn read_bounded(file: &Path) -> Result<String, ConfigError> {
    use std::io::Read;
    let f = std::fs::File::open(file).map_err(|e| ConfigError::io(file, &e))?;
    let mut text = String::new();
    f.take(MAX_FILE_BYTES + 1)
        .read_to_string(&mut text)
        .map_err(|e| ConfigError::io(file, &e))?;
    if text.len() as u64 > MAX_FILE_BYTES {
        return Err(ConfigError::at(
            file,
            None,
            "file",
            format!("larger than the maximum of {} MiB", MAX_FILE_BYTES >> 20),
        ));
    }
    Ok(text)
}

/// A file or directory's identity, whatever path (or symlink) reached it.
pub(super) type Identity = (u64, u64);

/// (device, inode) of what `meta` describes.
pub(super) fn identity(meta: &std::fs::Metadata) -> Identity {
    use std::os::unix::fs::MetadataExt;
    (meta.dev(), meta.ino())
}

/// What a walk has seen: each directory is entered once and each file read once, however many
/// symlinks lead to them (a `loop -> .` would otherwise read every file twice, and a few
/// self-links multiply the walk exponentially).
#[derive(Default)]
struct Seen {
    dirs: std::collections::HashSet<Identity>,
    files: std::collections::HashSet<Identity>,
}

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

/// Reads every config file under `paths` and builds one snapshot, or fails as a whole, with
/// the default compile options.
pub fn load_paths(paths: &[PathBuf]) -> Result<LoadedConfig, ConfigError> {
    load_paths_with(paths, CompileOptions::default())
}

/// Reads every config file under `paths` and builds one snapshot, or fails as a whole.
pub(crate) fn load_paths_with(
    paths: &[PathBuf],
    options: CompileOptions,
) -> Result<LoadedConfig, ConfigError> {
    let mut files = Vec::new();
    let mut seen = Seen::default();
    for path in paths {
        collect(path, 0, &mut seen, &mut files)?;
    }
    let mut hasher = DefaultHasher::new();
    let mut domains = Domains::new(options.merge_domains);
    for file in &files {
        let text = read_bounded(file)?;
        (file, &text).hash(&mut hasher);
        let domain = compile_file_with(file, &text, options)?;
        let (name, line) = (domain.name.clone(), domain.line);
        domains.add(domain, file).map_err(|refused| match refused {
            Refused::Domain(first) => ConfigError::at(
                file,
                Some((line, 1)),
                "domain",
                format!(
                    "duplicate domain '{name}' (also defined in {}; --merge-domain-config merges them)",
                    first.display()
                ),
            ),
            // At the descriptor defined twice, in the file that repeats it.
            Refused::Descriptor(first, path, at) => ConfigError::at(
                file,
                Some((if at > 0 { at } else { line }, 1)),
                "descriptors",
                format!(
                    "duplicate descriptor '{path}' in domain '{name}' (also in {}): merged files may not define one descriptor twice",
                    first.display()
                ),
            ),
        })?;
    }
    Ok(LoadedConfig {
        snapshot: domains.into_snapshot(),
        files,
        fingerprint: hasher.finish(),
    })
}

fn collect(
    path: &Path,
    depth: usize,
    seen: &mut Seen,
    out: &mut Vec<PathBuf>,
) -> Result<(), ConfigError> {
    let meta = std::fs::metadata(path).map_err(|e| ConfigError::io(path, &e))?;
    if !meta.is_dir() {
        if seen.files.insert(identity(&meta)) {
            out.push(path.to_owned());
        } else {
            tracing::warn!(path = %path.display(), "config file reached twice (through a symlink); read once");
        }
        return Ok(());
    }
    if !seen.dirs.insert(identity(&meta)) {
        tracing::warn!(path = %path.display(), "config directory reached again (a symlink loop or a second link); skipped");
        return Ok(());
    }
    if depth > MAX_DEPTH {
        tracing::warn!(path = %path.display(), max = MAX_DEPTH, "config directory nested too deep; skipped");
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
        let is_yaml = entry
            .extension()
            .and_then(|e| e.to_str())
            .is_some_and(|e| e == "yaml" || e == "yml");
        if meta.is_dir() || is_yaml {
            collect(&entry, depth + 1, seen, out)?;
        }
    }
    Ok(())
}
