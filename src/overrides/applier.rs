//! The one writer of the overrides this replica knows and of the set in force: a thread of its
//! own, never a request worker. It takes the changes waiting (from the admin API, the Redis
//! reads and the sweep of ended ones) in one batch, applies them to the records (on the memory
//! backend with one write and fsync of `--overrides-file` for the batch), changes the set one
//! override at a time (compiling only what is new), swaps it in for the request path once, and
//! answers each change. It wakes at the next end of an override in force to take it out.

use std::collections::{BTreeSet, HashMap};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use arc_swap::ArcSwap;
use parking_lot::Mutex;
use serde::{Deserialize, Serialize};

use super::{ChangeError, now_ms};
use crate::config::CompileOptions;
use crate::config::overrides::{InForce, OverrideRecord, OverrideSet};
use crate::metrics::AdminMetrics;

/// Most changes the applier takes in one batch (then it swaps the set in and takes the next).
const MAX_BATCH: usize = 1024;

/// The file `--overrides-file` holds.
#[derive(Default, Serialize, Deserialize)]
struct File {
    overrides: Vec<OverrideRecord>,
}
/// A change for the applier.
pub(super) enum Edit {
    /// The memory store: sets the override, in place of its slot's, unless past the cap.
    Set(OverrideRecord),
    /// The memory store: removes the override if it is still there as read.
    Remove(OverrideRecord),
    /// Redis: these overrides were set (`Some`) or are gone (`None`) in the store.
    Stored(Vec<(String, Option<OverrideRecord>)>),
    /// Redis: every override the store holds.
    All(HashMap<String, OverrideRecord>),
}

/// What a change did.
#[derive(Debug)]
pub(super) enum EditDone {
    /// Set, in place of this one.
    Set(Option<OverrideRecord>),
    /// Removed (false: it was not there as read).
    Removed(bool),
    /// Applied.
    Applied,
}

/// A change and who waits for it to be in force.
pub(super) struct Job {
    pub(super) change: Edit,
    pub(super) reply: tokio::sync::oneshot::Sender<Result<EditDone, ChangeError>>,
}

/// The one writer of the records and of the set in force, on a thread of its own.
struct Applier {
    records: Arc<Mutex<HashMap<String, OverrideRecord>>>,
    /// The memory store's file (`--overrides-file`).
    file: Option<PathBuf>,
    /// The memory store's slots: domain and entries → the id set there.
    slots: HashMap<String, String>,
    max: usize,
    compile: CompileOptions,
    /// The overrides in the set, by id, with their ends.
    in_force: HashMap<String, (Arc<InForce>, Option<u64>)>,
    /// Their ends (ms), the first first.
    ends: BTreeSet<(u64, String)>,
    set: OverrideSet,
    applied: Arc<ArcSwap<OverrideSet>>,
    next_end: Arc<AtomicU64>,
    woken: Arc<tokio::sync::Notify>,
    metrics: AdminMetrics,
}

impl Applier {
    /// Takes jobs until every sender is gone, each batch of those waiting at once; takes out
    /// what ends at its end.
    fn run(mut self, jobs: std::sync::mpsc::Receiver<Job>) {
        use std::sync::mpsc::RecvTimeoutError;
        loop {
            let wait = self
                .ends
                .first()
                .map(|(end, _)| Duration::from_millis(end.saturating_sub(now_ms())));
            let first = match wait {
                Some(wait) => jobs.recv_timeout(wait),
                None => jobs.recv().map_err(|_| RecvTimeoutError::Disconnected),
            };
            let mut batch = match first {
                Ok(job) => vec![job],
                Err(RecvTimeoutError::Timeout) => Vec::new(),
                Err(RecvTimeoutError::Disconnected) => return,
            };
            while batch.len() < MAX_BATCH
                && let Ok(job) = jobs.try_recv()
            {
                batch.push(job);
            }
            self.batch(batch);
        }
    }

    /// Applies `jobs` to the records (the memory store's file written once for all), then the
    /// set: what they touched and what has ended; swaps it in and answers each.
    fn batch(&mut self, jobs: Vec<Job>) {
        let now = now_ms();
        let mut touched = Vec::new();
        let mut answers = Vec::with_capacity(jobs.len());
        let mut undo: Vec<(String, Option<OverrideRecord>)> = Vec::new();
        let mut records = self.records.lock();
        for job in &jobs {
            let answer = match &job.change {
                Edit::Set(record) => {
                    let slot = record.slot();
                    let old = self.slots.get(&slot).cloned();
                    // Ended ones not removed yet do not count (counted only near the cap).
                    let live = || records.values().filter(|r| !r.expired(now)).count();
                    if old.is_none() && records.len() >= self.max && live() >= self.max {
                        Err(ChangeError::Full(live()))
                    } else {
                        let before = old.and_then(|id| records.remove(&id));
                        if let Some(b) = &before {
                            undo.push((b.id.clone(), Some(b.clone())));
                            touched.push(b.id.clone());
                        }
                        undo.push((record.id.clone(), None));
                        records.insert(record.id.clone(), record.clone());
                        self.slots.insert(slot, record.id.clone());
                        touched.push(record.id.clone());
                        Ok(EditDone::Set(before))
                    }
                }
                Edit::Remove(r) => match records.remove(&r.id) {
                    Some(was) => {
                        let slot = was.slot();
                        if self.slots.get(&slot) == Some(&was.id) {
                            self.slots.remove(&slot);
                        }
                        undo.push((was.id.clone(), Some(was)));
                        touched.push(r.id.clone());
                        Ok(EditDone::Removed(true))
                    }
                    None => Ok(EditDone::Removed(false)),
                },
                Edit::Stored(changed) => {
                    for (id, record) in changed {
                        match record {
                            Some(r) => records.insert(id.clone(), r.clone()),
                            None => records.remove(id),
                        };
                        touched.push(id.clone());
                    }
                    Ok(EditDone::Applied)
                }
                Edit::All(all) => {
                    touched.extend(records.keys().cloned());
                    touched.extend(all.keys().cloned());
                    *records = all.clone();
                    Ok(EditDone::Applied)
                }
            };
            answers.push(answer);
        }
        if let Some(path) = &self.file
            && !undo.is_empty()
        {
            let snapshot: Vec<OverrideRecord> = records.values().cloned().collect();
            drop(records);
            let written = write_file(path, snapshot.iter());
            records = self.records.lock();
            if let Err(e) = written {
                // Nothing of the batch was made: every record as it was, and each change
                // that touched the store told so.
                for (id, was) in undo.into_iter().rev() {
                    if let Some(now) = records.remove(&id) {
                        let slot = now.slot();
                        if self.slots.get(&slot) == Some(&id) {
                            self.slots.remove(&slot);
                        }
                    }
                    if let Some(was) = was {
                        self.slots.insert(was.slot(), id.clone());
                        records.insert(id, was);
                    }
                }
                for (job, answer) in jobs.iter().zip(&mut answers) {
                    if matches!(job.change, Edit::Set(_) | Edit::Remove(_))
                        && !matches!(answer, Ok(EditDone::Removed(false)) | Err(_))
                    {
                        *answer = Err(ChangeError::Store(e.clone()));
                    }
                }
            }
        }
        while let Some((end, _)) = self.ends.first()
            && *end <= now
        {
            let (_, id) = self.ends.pop_first().expect("just seen");
            touched.push(id);
        }
        let wanted: Vec<(String, Option<OverrideRecord>)> = touched
            .into_iter()
            .map(|id| {
                let r = records.get(&id).filter(|r| !r.expired(now)).cloned();
                (id, r)
            })
            .collect();
        drop(records);
        let before = self.set.len();
        let changed = wanted
            .into_iter()
            .fold(false, |changed, (id, r)| self.reconcile(id, r) | changed);
        if changed || before != self.set.len() {
            self.applied.store(Arc::new(self.set.clone()));
            self.metrics.overrides.set(self.set.len() as i64);
        }
        let next = self.ends.first().map_or(u64::MAX, |(end, _)| *end);
        if self.next_end.swap(next, Ordering::AcqRel) > next {
            self.woken.notify_one();
        }
        for (job, answer) in jobs.into_iter().zip(answers) {
            let _ = job.reply.send(answer);
        }
    }

    /// Puts the override `id` in the set as `wanted` (`None`: out of it); whether the set
    /// changed. An id names one override for good, so one in the set already is kept.
    fn reconcile(&mut self, id: String, wanted: Option<OverrideRecord>) -> bool {
        match (wanted, self.in_force.contains_key(&id)) {
            (Some(r), false) => match InForce::compile(&r, self.compile) {
                Ok(o) => {
                    if let Some(end) = r.expires_at_ms {
                        self.ends.insert((end, id.clone()));
                    }
                    if let Some(old) = self.set.insert(o.clone())
                        && let Some((_, end)) = self.in_force.remove(&*old.id)
                        && let Some(end) = end
                    {
                        self.ends.remove(&(end, old.id.to_string()));
                    }
                    self.in_force.insert(id, (o, r.expires_at_ms));
                    true
                }
                Err(e) => {
                    tracing::warn!(id = %r.id, domain = %r.domain, error = %e, "override not applied: its limits do not compile");
                    false
                }
            },
            (None, true) => {
                let (o, end) = self.in_force.remove(&id).expect("just seen");
                if let Some(end) = end {
                    self.ends.remove(&(end, id));
                }
                self.set.remove(&o)
            }
            _ => false,
        }
    }
}

/// What [`start`] hands the overrides: what the applier writes and how to reach it.
pub(super) struct Running {
    /// Every override known, by id (written by the applier alone).
    pub(super) records: Arc<Mutex<HashMap<String, OverrideRecord>>>,
    /// The set the request path applies.
    pub(super) applied: Arc<ArcSwap<OverrideSet>>,
    /// Where changes go.
    pub(super) jobs: std::sync::mpsc::Sender<Job>,
    /// The earliest end of an override in force (ms; `u64::MAX`: none).
    pub(super) next_end: Arc<AtomicU64>,
    /// Notified when that end comes earlier.
    pub(super) woken: Arc<tokio::sync::Notify>,
}

/// Puts `records` in force (before the first request) and starts the applier's thread;
/// `file` is the memory store's (`None` with Redis).
pub(super) fn start(
    records: HashMap<String, OverrideRecord>,
    file: Option<PathBuf>,
    max: usize,
    compile: CompileOptions,
    metrics: AdminMetrics,
) -> Result<Running, String> {
    let slots = records.values().map(|r| (r.slot(), r.id.clone())).collect();
    let now = now_ms();
    let wanted: Vec<_> = records
        .iter()
        .map(|(id, r)| (id.clone(), Some(r.clone()).filter(|r| !r.expired(now))))
        .collect();
    let records = Arc::new(Mutex::new(records));
    let applied: Arc<ArcSwap<OverrideSet>> = Arc::default();
    let next_end = Arc::new(AtomicU64::new(u64::MAX));
    let woken = Arc::new(tokio::sync::Notify::new());
    let mut applier = Applier {
        records: records.clone(),
        file,
        slots,
        max,
        compile,
        in_force: HashMap::new(),
        ends: BTreeSet::new(),
        set: OverrideSet::default(),
        applied: applied.clone(),
        next_end: next_end.clone(),
        woken: woken.clone(),
        metrics: metrics.clone(),
    };
    for (id, r) in wanted {
        applier.reconcile(id, r);
    }
    applied.store(Arc::new(applier.set.clone()));
    metrics.overrides.set(applier.set.len() as i64);
    next_end.store(
        applier.ends.first().map_or(u64::MAX, |(end, _)| *end),
        Ordering::Release,
    );
    let (jobs, queue) = std::sync::mpsc::channel();
    std::thread::Builder::new()
        .name("overrides".into())
        .spawn(move || applier.run(queue))
        .map_err(|e| format!("overrides: cannot start their thread: {e}"))?;
    Ok(Running {
        records,
        applied,
        jobs,
        next_end,
        woken,
    })
}

/// The temporary file a write of `path` by process `pid` goes through.
fn temporary(path: &Path, pid: u32) -> std::path::PathBuf {
    path.with_extension(format!("tmp.{pid}"))
}

/// Removes the temporaries earlier processes left beside `path` (one killed mid-write leaves
/// its full copy of the set): those of a process that no longer runs. Returns how many.
pub(super) fn remove_stale_temporaries(path: &Path) -> usize {
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    };
    let Ok(entries) = std::fs::read_dir(dir) else {
        return 0;
    };
    let prefix = temporary(path, 0);
    let Some(prefix) = prefix.file_name().and_then(|n| n.to_str()) else {
        return 0;
    };
    let prefix = prefix.trim_end_matches('0');
    let mut removed = 0;
    for entry in entries.flatten() {
        let name = entry.file_name();
        let Some(pid) = name
            .to_str()
            .and_then(|n| n.strip_prefix(prefix))
            .and_then(|pid| pid.parse::<u32>().ok())
        else {
            continue;
        };
        let running = pid == std::process::id() || Path::new(&format!("/proc/{pid}")).exists();
        if !running && std::fs::remove_file(entry.path()).is_ok() {
            tracing::info!(file = %entry.path().display(), "--overrides-file: removed a temporary an earlier process left");
            removed += 1;
        }
    }
    removed
}

/// The overrides `path` holds; none when it does not exist yet.
pub(super) fn read_file(path: &Path) -> Result<Vec<OverrideRecord>, String> {
    match std::fs::read(path) {
        Ok(bytes) => serde_json::from_slice::<File>(&bytes)
            .map(|f| f.overrides)
            .map_err(|e| format!("--overrides-file {}: {e}", path.display())),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(Vec::new()),
        Err(e) => Err(format!("--overrides-file {}: {e}", path.display())),
    }
}

/// Writes `records` to `path`: to a temporary file beside it, synced, then renamed over it,
/// and the directory synced so that the rename outlives a power cut too.
fn write_file<'a>(
    path: &Path,
    records: impl Iterator<Item = &'a OverrideRecord>,
) -> Result<(), String> {
    use std::io::Write as _;
    let mut overrides: Vec<OverrideRecord> = records.cloned().collect();
    overrides.sort_by(|a, b| (a.created_at_ms, &a.id).cmp(&(b.created_at_ms, &b.id)));
    let text = serde_json::to_vec_pretty(&File { overrides }).map_err(|e| e.to_string())?;
    let tmp = temporary(path, std::process::id());
    let written = (|| {
        let mut f = std::fs::File::create(&tmp)?;
        f.write_all(&text)?;
        f.sync_all()?;
        std::fs::rename(&tmp, path)
    })();
    if let Err(e) = written {
        let _ = std::fs::remove_file(&tmp);
        return Err(format!("{}: {e}", path.display()));
    }
    // The file already holds the new set: a directory that cannot be synced is said, not
    // undone (the set in force must stay what the file holds).
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    };
    if let Err(e) = std::fs::File::open(dir).and_then(|d| d.sync_all()) {
        tracing::warn!(dir = %dir.display(), error = %e, "--overrides-file: its directory could not be synced; the last change may not outlive a power cut");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A process killed mid-write leaves its temporary beside the file: the next start removes
    /// it, and leaves the file and a running process's temporary alone.
    #[test]
    fn temporaries_of_processes_gone_are_removed_at_start() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("overrides.json");
        std::fs::write(&path, "{\"overrides\":[]}").unwrap();
        // Above Linux's largest pid (2^22): no such process runs.
        let gone = temporary(&path, 999_999_999);
        let ours = temporary(&path, std::process::id());
        let other = dir.path().join("overrides.tmp.x1");
        for f in [&gone, &ours, &other] {
            std::fs::write(f, "partial").unwrap();
        }
        assert_eq!(remove_stale_temporaries(&path), 1);
        assert!(!gone.exists());
        assert!(ours.exists() && other.exists() && path.exists());
        assert_eq!(remove_stale_temporaries(&path), 0);
    }
}
