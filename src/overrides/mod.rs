//! Where the operator's overrides live and how every replica comes to apply the same ones.
//!
//! - With Redis, in Redis, under one hash tag (one slot on a cluster):
//!   `<prefix>{ratelimitd-overrides}:all` (id → the override as JSON), `:slots` (domain and
//!   entries → the id in force: one per descriptor) and `:version`, a new random value at
//!   every change ([`new_version`]). Every replica reads `:version` each second and, when it
//!   differs from what it last read, the whole hash: a change is applied everywhere within
//!   about a second, and survives any replica's restart.
//! - On the memory backend, in this process, and in `--overrides-file` when given (written
//!   to a temporary file and renamed over it, so a crash leaves the old file or the new).
//!
//! The set in force is rebuilt on every change and when an override ends (at its expiry, to
//! the millisecond), then swapped in for the request path (`config::overrides::OverrideSet`).
//! An override ended is removed from the store by the first replica that sees it end.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use arc_swap::ArcSwap;
use parking_lot::Mutex;
use serde::{Deserialize, Serialize};

use crate::config::CompileOptions;
use crate::config::overrides::{OverrideRecord, OverrideRequest, OverrideSet};
use crate::limiter::redis::RedisBackend;
use crate::limiter::{BackendError, Clock, SystemClock};
use crate::metrics::AdminMetrics;

/// How often each replica asks Redis whether the overrides changed.
const POLL: Duration = Duration::from_secs(1);

/// How overrides are kept and bounded.
#[derive(Clone, Debug)]
pub(crate) struct OverrideOptions {
    /// Where the memory backend keeps them (`--overrides-file`); `None`: in this process only.
    pub(crate) file: Option<PathBuf>,
    /// Most overrides at once (`--max-overrides`).
    pub(crate) max: usize,
    /// How their limits compile (the config's options).
    pub(crate) compile: CompileOptions,
}

impl Default for OverrideOptions {
    fn default() -> Self {
        OverrideOptions {
            file: None,
            max: crate::config::overrides::DEFAULT_MAX_OVERRIDES,
            compile: CompileOptions::default(),
        }
    }
}

/// Why a change was not made.
#[derive(Debug, thiserror::Error)]
pub(crate) enum ChangeError {
    /// Past `--max-overrides`.
    #[error("{0} overrides are in force, the most --max-overrides allows: delete one first")]
    Full(usize),
    /// The store could not be written or read.
    #[error("the overrides store failed: {0}")]
    Store(String),
}

impl From<BackendError> for ChangeError {
    fn from(e: BackendError) -> Self {
        ChangeError::Store(e.to_string())
    }
}

/// The file `--overrides-file` holds.
#[derive(Default, Serialize, Deserialize)]
struct File {
    overrides: Vec<OverrideRecord>,
}

/// Where overrides are kept.
enum OverrideStore {
    Memory(Option<PathBuf>),
    Redis(Arc<RedisBackend>, Keys),
}

/// The Redis keys, under one hash tag.
struct Keys {
    all: Vec<u8>,
    slots: Vec<u8>,
    version: Vec<u8>,
}

impl Keys {
    fn new(prefix: &[u8]) -> Keys {
        let base = [prefix, b"{ratelimitd-overrides}:"].concat();
        Keys {
            all: [&base[..], b"all"].concat(),
            slots: [&base[..], b"slots"].concat(),
            version: [&base[..], b"version"].concat(),
        }
    }
}

/// Sets an override: replaces the one of its slot (returned), unless the cap is reached.
const SET: &str = r"
local old = redis.call('HGET', KEYS[2], ARGV[1])
local before = ''
if old then
  before = redis.call('HGET', KEYS[1], old) or ''
  redis.call('HDEL', KEYS[1], old)
elseif redis.call('HLEN', KEYS[1]) >= tonumber(ARGV[4]) then
  return {0, ''}
end
redis.call('HSET', KEYS[1], ARGV[2], ARGV[3])
redis.call('HSET', KEYS[2], ARGV[1], ARGV[2])
redis.call('SET', KEYS[3], ARGV[5])
return {1, before}
";

/// Deletes an override if it is still the one read (`ARGV[2]`), and its slot if that still
/// names it.
const DELETE: &str = r"
if redis.call('HGET', KEYS[1], ARGV[1]) ~= ARGV[2] then return 0 end
redis.call('HDEL', KEYS[1], ARGV[1])
if redis.call('HGET', KEYS[2], ARGV[3]) == ARGV[1] then redis.call('HDEL', KEYS[2], ARGV[3]) end
redis.call('SET', KEYS[3], ARGV[4])
return 1
";

/// The operator's overrides: the store, what this replica read of it, and the set in force.
pub(crate) struct Overrides {
    store: OverrideStore,
    options: OverrideOptions,
    /// Every override this replica knows of, by id (ended ones until removed).
    records: Mutex<HashMap<String, OverrideRecord>>,
    /// The set the request path applies.
    applied: Arc<ArcSwap<OverrideSet>>,
    /// Wakes the task that keeps `applied` current.
    changed: tokio::sync::Notify,
    /// The Redis `:version` last read (`i64::MIN`: none yet).
    version: std::sync::atomic::AtomicI64,
    metrics: AdminMetrics,
}

fn now_ms() -> u64 {
    SystemClock.now_us() / 1_000
}

/// An id no other override has: 16 hex digits of a per-process random hash of the time and a
/// count.
fn new_id() -> String {
    use std::sync::atomic::{AtomicU64, Ordering};
    static COUNT: AtomicU64 = AtomicU64::new(0);
    static STATE: std::sync::OnceLock<std::hash::RandomState> = std::sync::OnceLock::new();
    let state = STATE.get_or_init(std::hash::RandomState::new);
    let n = COUNT.fetch_add(1, Ordering::Relaxed);
    format!(
        "{:016x}",
        std::hash::BuildHasher::hash_one(state, (SystemClock.now_us(), n))
    )
}

/// A `:version` for a change: random, never a counter's next value. A counter restarts at 1
/// after a FLUSHALL or a restart without persistence, and after a failover to a replica that
/// lags it repeats values the old primary had given to other sets; replicas that last read one
/// of those would never read the new set. A replica reads the set again whenever `:version`
/// differs from what it last read (gone included), so only a value never used before will do.
/// An integer below 2^53, so that a counter's INCR (an older replica's) still works on it.
fn new_version() -> i64 {
    let hash = u64::from_str_radix(&new_id(), 16).unwrap_or_default();
    (hash >> 11).max(1) as i64
}

impl Overrides {
    /// The overrides of this service: in `redis` when the backend is Redis, else in this
    /// process and `options.file`. Either is read now, before the service serves: a replica
    /// started applies every override in force from its first request (an unreadable or
    /// malformed file is an error naming it; Redis unreachable is logged, and the overrides are
    /// read once it answers).
    pub(crate) async fn start(
        options: OverrideOptions,
        redis: Option<(Arc<RedisBackend>, &[u8])>,
        metrics: AdminMetrics,
        tasks: &mut crate::shutdown::Tasks,
    ) -> Result<Arc<Overrides>, String> {
        let mut records = HashMap::new();
        let store = match redis {
            Some((redis, prefix)) => OverrideStore::Redis(redis, Keys::new(prefix)),
            None => {
                if let Some(path) = &options.file {
                    for r in read_file(path)? {
                        records.insert(r.id.clone(), r);
                    }
                }
                OverrideStore::Memory(options.file.clone())
            }
        };
        let o = Arc::new(Overrides {
            store,
            options,
            records: Mutex::new(records),
            applied: Arc::default(),
            changed: tokio::sync::Notify::new(),
            version: std::sync::atomic::AtomicI64::new(i64::MIN),
            metrics,
        });
        if let OverrideStore::Redis(redis, keys) = &o.store
            && let Err(e) = o.read_redis(redis, keys).await
        {
            tracing::warn!(error = %e, "overrides: cannot read Redis at start; applied once it answers");
        }
        o.apply();
        tasks.push(tokio::spawn(o.clone().run()));
        Ok(o)
    }

    /// How their limits compile (the config's options), for the API that checks new ones.
    pub(crate) fn compile(&self) -> CompileOptions {
        self.options.compile
    }

    /// The set in force, for the engine to read.
    pub(crate) fn applied(&self) -> Arc<ArcSwap<OverrideSet>> {
        self.applied.clone()
    }

    /// Rebuilds the set in force from the records (each override's limits compiled again:
    /// only when they changed, or one ended).
    fn apply(&self) {
        let records = self.records.lock();
        let set = OverrideSet::build(records.values(), now_ms(), self.options.compile);
        self.metrics.overrides.set(set.len() as i64);
        self.applied.store(Arc::new(set));
    }

    /// A change this replica made (`action`): in force here at once, its expiry taken up by
    /// the task that keeps the set current, and counted.
    fn changed_here(&self, action: &'static str) {
        self.apply();
        self.changed.notify_one();
        self.metrics.changed(action);
    }

    /// Keeps the set in force current until the process ends (`start` spawns it): at every change, at every
    /// expiry, and (with Redis) after every change another replica made, read each second.
    /// Nothing is rebuilt while nothing changes.
    async fn run(self: Arc<Self>) {
        let mut failing = false;
        let mut rebuild_at = next_expiry(self.records.lock().values(), now_ms());
        loop {
            let mut changed = false;
            if let OverrideStore::Redis(redis, keys) = &self.store {
                match self.read_redis(redis, keys).await {
                    Ok(read) => {
                        changed |= read;
                        if failing {
                            tracing::info!("overrides: reading Redis again");
                        }
                        failing = false;
                    }
                    Err(e) => {
                        if !failing {
                            tracing::warn!(error = %e, "overrides: cannot read Redis; the ones read last stay in force");
                        }
                        failing = true;
                    }
                }
            }
            changed |= self.remove_ended().await;
            if changed || rebuild_at.is_some_and(|at| at <= now_ms()) {
                self.apply();
            }
            // What set and delete changed meanwhile they applied themselves; only their
            // expiries are new here.
            rebuild_at = next_expiry(self.records.lock().values(), now_ms());
            let mut wait = match self.store {
                OverrideStore::Redis(..) => POLL,
                OverrideStore::Memory(_) => Duration::from_secs(3_600),
            };
            if let Some(at) = rebuild_at {
                wait = wait.min(Duration::from_millis(at.saturating_sub(now_ms())));
            }
            tokio::select! {
                () = tokio::time::sleep(wait) => {}
                () = self.changed.notified() => {}
            }
        }
    }

    /// Reads every override from Redis when `:version` moved since it was last read; whether
    /// it had.
    async fn read_redis(&self, redis: &RedisBackend, keys: &Keys) -> Result<bool, BackendError> {
        use std::sync::atomic::Ordering;
        let now: Option<i64> = redis.command(redis::cmd("GET").arg(&keys.version)).await?;
        let now = now.unwrap_or(0);
        if self.version.load(Ordering::Acquire) == now {
            return Ok(false);
        }
        let all: HashMap<String, String> =
            redis.command(redis::cmd("HGETALL").arg(&keys.all)).await?;
        let mut records = HashMap::with_capacity(all.len());
        for (id, json) in all {
            match serde_json::from_str::<OverrideRecord>(&json) {
                Ok(r) => {
                    records.insert(id, r);
                }
                Err(e) => {
                    tracing::warn!(id = %id, error = %e, "overrides: an entry in Redis is not an override; left out")
                }
            }
        }
        *self.records.lock() = records;
        self.version.store(now, Ordering::Release);
        Ok(true)
    }

    /// Removes from the store the overrides that have ended (counted, logged); whether any
    /// left this replica's records.
    async fn remove_ended(&self) -> bool {
        let now = now_ms();
        let ended: Vec<OverrideRecord> = self
            .records
            .lock()
            .values()
            .filter(|r| r.expired(now))
            .cloned()
            .collect();
        let mut left = false;
        for r in ended {
            match self.remove(&r).await {
                Ok(true) => {
                    left = true;
                    self.metrics.changed("expire");
                    tracing::info!(id = %r.id, domain = %r.domain, entries = %entries_text(&r), limits = %limits_text(&r), "override ended; the config's limits apply again");
                }
                // Another replica removed it first.
                Ok(false) => left = true,
                Err(e) => {
                    tracing::debug!(error = %e, "overrides: an ended override not removed yet")
                }
            }
        }
        left
    }

    /// Removes `r` from the store if it is still there as read. Whether it was.
    async fn remove(&self, r: &OverrideRecord) -> Result<bool, ChangeError> {
        match &self.store {
            OverrideStore::Memory(file) => {
                let mut records = self.records.lock();
                if records.remove(&r.id).is_none() {
                    return Ok(false);
                }
                if let Some(path) = file
                    && let Err(e) = write_file(path, records.values())
                {
                    records.insert(r.id.clone(), r.clone());
                    return Err(ChangeError::Store(e));
                }
                Ok(true)
            }
            OverrideStore::Redis(redis, keys) => {
                let json = serde_json::to_string(r).unwrap_or_default();
                let done: i64 = redis
                    .command(
                        redis::cmd("EVAL")
                            .arg(DELETE)
                            .arg(3)
                            .arg(&keys.all)
                            .arg(&keys.slots)
                            .arg(&keys.version)
                            .arg(&r.id)
                            .arg(json)
                            .arg(r.slot())
                            .arg(new_version()),
                    )
                    .await?;
                self.records.lock().remove(&r.id);
                Ok(done == 1)
            }
        }
    }

    /// Sets `req` as `by`'s override: in force on this replica when this returns, on every
    /// other within about a second. Returns it, and the one it replaced.
    pub(crate) async fn set(
        &self,
        req: OverrideRequest,
        by: &str,
    ) -> Result<(OverrideRecord, Option<OverrideRecord>), ChangeError> {
        let now = now_ms();
        let record = OverrideRecord {
            id: new_id(),
            domain: req.domain,
            entries: req.entries,
            limits: req.limits,
            expires_at_ms: req
                .ttl
                .map(|t| now.saturating_add(u64::try_from(t.as_millis()).unwrap_or(u64::MAX))),
            reason: req.reason,
            created_by: by.to_owned(),
            created_at_ms: now,
        };
        let slot = record.slot();
        let before = match &self.store {
            OverrideStore::Memory(file) => {
                let mut records = self.records.lock();
                let old = records
                    .values()
                    .find(|r| r.slot() == slot)
                    .map(|r| r.id.clone());
                let live = records.values().filter(|r| !r.expired(now)).count();
                if old.is_none() && live >= self.options.max {
                    return Err(ChangeError::Full(live));
                }
                let before = old.and_then(|id| records.remove(&id));
                records.insert(record.id.clone(), record.clone());
                if let Some(path) = file
                    && let Err(e) = write_file(path, records.values())
                {
                    records.remove(&record.id);
                    if let Some(b) = &before {
                        records.insert(b.id.clone(), b.clone());
                    }
                    return Err(ChangeError::Store(e));
                }
                before
            }
            OverrideStore::Redis(redis, keys) => {
                let json = serde_json::to_string(&record)
                    .map_err(|e| ChangeError::Store(e.to_string()))?;
                let (done, before): (i64, String) = redis
                    .command(
                        redis::cmd("EVAL")
                            .arg(SET)
                            .arg(3)
                            .arg(&keys.all)
                            .arg(&keys.slots)
                            .arg(&keys.version)
                            .arg(&slot)
                            .arg(&record.id)
                            .arg(json)
                            .arg(self.options.max)
                            .arg(new_version()),
                    )
                    .await?;
                if done == 0 {
                    return Err(ChangeError::Full(self.options.max));
                }
                let before: Option<OverrideRecord> = serde_json::from_str(&before).ok();
                let mut records = self.records.lock();
                if let Some(b) = &before {
                    records.remove(&b.id);
                }
                records.insert(record.id.clone(), record.clone());
                before
            }
        };
        self.changed_here("set");
        tracing::info!(
            by = %by,
            id = %record.id,
            domain = %record.domain,
            entries = %entries_text(&record),
            before = %before.as_ref().map_or_else(|| "the config's".to_owned(), limits_text),
            after = %limits_text(&record),
            ttl_ms = ?record.expires_at_ms.map(|at| at - now),
            reason = %record.reason,
            "override set"
        );
        Ok((record, before))
    }

    /// Every override in force (of `domain` when given), the oldest first. With Redis, as
    /// Redis holds them now.
    pub(crate) async fn list(
        &self,
        domain: Option<&str>,
    ) -> Result<Vec<OverrideRecord>, ChangeError> {
        let now = now_ms();
        let mut all: Vec<OverrideRecord> = match &self.store {
            OverrideStore::Memory(_) => self.records.lock().values().cloned().collect(),
            OverrideStore::Redis(redis, keys) => {
                let all: HashMap<String, String> =
                    redis.command(redis::cmd("HGETALL").arg(&keys.all)).await?;
                all.values()
                    .filter_map(|j| serde_json::from_str(j).ok())
                    .collect()
            }
        };
        all.retain(|r| !r.expired(now) && domain.is_none_or(|d| d == r.domain));
        all.sort_by(|a, b| (a.created_at_ms, &a.id).cmp(&(b.created_at_ms, &b.id)));
        Ok(all)
    }

    /// Deletes the override `id` as `by`; `None` when no such override is in force.
    pub(crate) async fn delete(
        &self,
        id: &str,
        by: &str,
    ) -> Result<Option<OverrideRecord>, ChangeError> {
        let record = match &self.store {
            OverrideStore::Memory(_) => self.records.lock().get(id).cloned(),
            OverrideStore::Redis(redis, keys) => {
                let json: Option<String> = redis
                    .command(redis::cmd("HGET").arg(&keys.all).arg(id))
                    .await?;
                json.and_then(|j| serde_json::from_str(&j).ok())
            }
        };
        let Some(record) = record.filter(|r| !r.expired(now_ms())) else {
            return Ok(None);
        };
        if !self.remove(&record).await? {
            return Ok(None);
        }
        self.changed_here("delete");
        tracing::info!(
            by = %by,
            id = %record.id,
            domain = %record.domain,
            entries = %entries_text(&record),
            before = %limits_text(&record),
            after = "the config's",
            "override deleted"
        );
        Ok(Some(record))
    }
}

/// The earliest expiry of `records` after `now`.
fn next_expiry<'a>(records: impl Iterator<Item = &'a OverrideRecord>, now: u64) -> Option<u64> {
    records
        .filter_map(|r| r.expires_at_ms)
        .filter(|at| *at > now)
        .min()
}

/// `key=value,...` of an override, for its log lines.
fn entries_text(r: &OverrideRecord) -> String {
    r.entries
        .iter()
        .map(|e| format!("{}={}", e.key, e.value))
        .collect::<Vec<_>>()
        .join(",")
}

/// Its limits as JSON, for its log lines.
fn limits_text(r: &OverrideRecord) -> String {
    serde_json::to_string(&r.limits).unwrap_or_default()
}

/// The overrides `path` holds; none when it does not exist yet.
fn read_file(path: &Path) -> Result<Vec<OverrideRecord>, String> {
    match std::fs::read(path) {
        Ok(bytes) => serde_json::from_slice::<File>(&bytes)
            .map(|f| f.overrides)
            .map_err(|e| format!("--overrides-file {}: {e}", path.display())),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(Vec::new()),
        Err(e) => Err(format!("--overrides-file {}: {e}", path.display())),
    }
}

/// Writes `records` to `path`: to a temporary file beside it, synced, then renamed over it.
fn write_file<'a>(
    path: &Path,
    records: impl Iterator<Item = &'a OverrideRecord>,
) -> Result<(), String> {
    use std::io::Write as _;
    let mut overrides: Vec<OverrideRecord> = records.cloned().collect();
    overrides.sort_by(|a, b| (a.created_at_ms, &a.id).cmp(&(b.created_at_ms, &b.id)));
    let text = serde_json::to_vec_pretty(&File { overrides }).map_err(|e| e.to_string())?;
    let tmp = path.with_extension(format!("tmp.{}", std::process::id()));
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
    Ok(())
}
