//! Where the operator's overrides live and how every replica comes to apply the same ones.
//!
//! - With Redis, in Redis, under one hash tag (one slot on a cluster):
//!   `<prefix>{ratelimitd-overrides}:all` (id → the override as JSON), `:slots` (domain and
//!   entries → the id in force: one per descriptor), `:version`, a new random value at every
//!   change ([`new_version`]), and `:log`, the latest [`LOG_LENGTH`] changes (a sorted set by
//!   `:seq`, each member `<seq>:<version>:<id>`). Every replica asks each second, in one
//!   script, whether `:version` differs from what it last read and, when it does, reads only
//!   the overrides changed since the last change it read, if that change is still in the log
//!   as it read it; else (a FLUSHALL, a failover to a replica that lags, a replica too far
//!   behind, a change by an older build that keeps no log) the whole hash, once. So a change
//!   costs each replica what changed, not the set in force; it is applied everywhere within
//!   about a second, and survives any replica's restart.
//! - On the memory backend, in this process, and in `--overrides-file` when given (written
//!   to a temporary file and renamed over it, so a crash leaves the old file or the new).
//!
//! The set in force is changed by one thread of its own (`applier`), never a request
//! worker: a change takes out and puts in only the overrides it touches (compiling those
//! alone), and the set is swapped in for the request path (`config::overrides::OverrideSet`)
//! once per batch of changes; on the memory backend the batch's file write (and its fsync) is
//! one, however many changes it carries. A change is acknowledged once it is in force here
//! (and written, with a file). An override ended leaves the set at its expiry (to the
//! millisecond), and the store by the first replica that sees it end.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use arc_swap::ArcSwap;
use parking_lot::Mutex;

mod applier;

use crate::config::CompileOptions;
use crate::config::overrides::{OverrideRecord, OverrideRequest, OverrideSet};
use crate::limiter::redis::RedisBackend;
use crate::limiter::{BackendError, Clock, SystemClock};
use crate::metrics::AdminMetrics;
use applier::{Edit, EditDone, Job, read_file};

/// How often each replica asks Redis whether the overrides changed.
const POLL: Duration = Duration::from_secs(1);
/// Changes Redis' `:log` keeps. A replica further behind reads the whole set once; at one
/// change each millisecond, a replica polling each second is never that far behind.
const LOG_LENGTH: usize = 4096;

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

/// Where overrides are kept.
enum OverrideStore {
    Memory,
    Redis(Arc<RedisBackend>, Keys),
}

/// The Redis keys, under one hash tag.
struct Keys {
    all: Vec<u8>,
    slots: Vec<u8>,
    version: Vec<u8>,
    seq: Vec<u8>,
    log: Vec<u8>,
}

impl Keys {
    fn new(prefix: &[u8]) -> Keys {
        let base = [prefix, b"{ratelimitd-overrides}:"].concat();
        let key = |name: &[u8]| [&base[..], name].concat();
        Keys {
            all: key(b"all"),
            slots: key(b"slots"),
            version: key(b"version"),
            seq: key(b"seq"),
            log: key(b"log"),
        }
    }
}

/// Appends a change of override `id` to the log (KEYS[4] `:seq`, KEYS[5] `:log`), under the
/// change's version `v`, and trims the log to its length (ARGV[6]).
const LOG: &str = r"
local function log(id, v)
  local seq = redis.call('INCR', KEYS[4])
  redis.call('ZADD', KEYS[5], seq, seq .. ':' .. v .. ':' .. id)
  local n = redis.call('ZCARD', KEYS[5])
  if n > tonumber(ARGV[6]) then redis.call('ZREMRANGEBYRANK', KEYS[5], 0, n - tonumber(ARGV[6]) - 1) end
end
";

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
if old then log(old, ARGV[5]) end
log(ARGV[2], ARGV[5])
return {1, before}
";

/// Deletes an override if it is still the one read (`ARGV[2]`), and its slot if that still
/// names it.
const DELETE: &str = r"
if redis.call('HGET', KEYS[1], ARGV[1]) ~= ARGV[2] then return 0 end
redis.call('HDEL', KEYS[1], ARGV[1])
if redis.call('HGET', KEYS[2], ARGV[3]) == ARGV[1] then redis.call('HDEL', KEYS[2], ARGV[3]) end
redis.call('SET', KEYS[3], ARGV[4])
log(ARGV[1], ARGV[4])
return 1
";

/// What changed since the replica last read (ARGV: the `:version`, the log's last member and
/// its score, as it last read them): `{'0'}` nothing; `{'1', version, member, score, id, json,
/// ...}` the overrides changed since (json `''`: gone), when the member last read is still in
/// the log as read and the log's last change is the one that set `:version` now; else `{'2',
/// version, member, score, id, json, ...}`, every override. (An older build changes the hash
/// and `:version` without logging: its change is in no log, so only a whole read finds it,
/// even by a replica whose own changes since its last read are in the log.)
const READ: &str = r"
local v = redis.call('GET', KEYS[3]) or ''
if v == ARGV[1] then return {'0'} end
local top = redis.call('ZRANGE', KEYS[2], -1, -1, 'WITHSCORES')
local m, s = top[1] or '', top[2] or '0'
local logged = string.match(m, '^[^:]*:([^:]*):') == v
if logged and ARGV[2] ~= '' and m ~= ARGV[2] then
  local since = redis.call('ZRANGEBYSCORE', KEYS[2], ARGV[3], '+inf')
  if since[1] == ARGV[2] then
    local out, seen = {'1', v, m, s}, {}
    for i = 2, #since do
      local id = string.match(since[i], '^[^:]*:[^:]*:(.*)$')
      if id and not seen[id] then
        seen[id] = true
        out[#out + 1] = id
        out[#out + 1] = redis.call('HGET', KEYS[1], id) or ''
      end
    end
    return out
  end
end
local out = {'2', v, m, s}
local all = redis.call('HGETALL', KEYS[1])
for i = 1, #all do out[#out + 1] = all[i] end
return out
";

/// What this replica last read of Redis: `:version`, and the log's last member and its score
/// (empty: nothing read yet).
#[derive(Default)]
struct LastRead {
    version: String,
    member: String,
    score: String,
}

/// The operator's overrides: the store, what this replica read of it, and the set in force.
pub(crate) struct Overrides {
    store: OverrideStore,
    options: OverrideOptions,
    /// Every override this replica knows of, by id (ended ones until removed). Written by the
    /// applier alone.
    records: Arc<Mutex<HashMap<String, OverrideRecord>>>,
    /// The set the request path applies.
    applied: Arc<ArcSwap<OverrideSet>>,
    /// Changes for the applier's thread.
    jobs: std::sync::mpsc::Sender<Job>,
    /// The earliest end of an override in force (ms; `u64::MAX`: none), from the applier.
    next_end: Arc<AtomicU64>,
    /// Wakes the task that removes ended overrides (a new earliest end).
    woken: Arc<tokio::sync::Notify>,
    /// What this replica last read of Redis.
    seen: Mutex<LastRead>,
    metrics: AdminMetrics,
}

fn now_ms() -> u64 {
    SystemClock.now_us() / 1_000
}

/// An id no other override has: 16 hex digits of a per-process random hash of the time and a
/// count.
fn new_id() -> String {
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
                    applier::remove_stale_temporaries(path);
                    for r in read_file(path)? {
                        records.insert(r.id.clone(), r);
                    }
                }
                OverrideStore::Memory
            }
        };
        let file = match store {
            OverrideStore::Memory => options.file.clone(),
            OverrideStore::Redis(..) => None,
        };
        let applier::Running {
            records,
            applied,
            jobs,
            next_end,
            woken,
        } = applier::start(records, file, options.max, options.compile, metrics.clone())?;
        let o = Arc::new(Overrides {
            store,
            options,
            records,
            applied,
            jobs,
            next_end,
            woken,
            seen: Mutex::new(LastRead::default()),
            metrics,
        });
        if let OverrideStore::Redis(redis, keys) = &o.store
            && let Err(e) = o.read_redis(redis, keys).await
        {
            tracing::warn!(error = %e, "overrides: cannot read Redis at start; applied once it answers");
        }
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

    /// Hands `change` to the applier; what it did, once in force here.
    async fn change(&self, change: Edit) -> Result<EditDone, ChangeError> {
        let (reply, done) = tokio::sync::oneshot::channel();
        self.jobs
            .send(Job { change, reply })
            .map_err(|_| ChangeError::Store("the overrides' thread has ended".into()))?;
        done.await
            .map_err(|_| ChangeError::Store("the overrides' thread has ended".into()))?
    }

    /// Removes ended overrides from the store (at their ends, and with Redis at each read)
    /// and, with Redis, reads each second what other replicas changed, until the process ends
    /// (`start` spawns it).
    async fn run(self: Arc<Self>) {
        let mut failing = false;
        // When an override ends (ms): the store is swept then.
        let mut due = self.next_end.load(Ordering::Acquire);
        loop {
            let mut sweep = due <= now_ms();
            if let OverrideStore::Redis(redis, keys) = &self.store {
                sweep = true;
                match self.read_redis(redis, keys).await {
                    Ok(()) => {
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
            let mut retry = false;
            if sweep {
                retry = !self.remove_ended().await;
            }
            due = self.next_end.load(Ordering::Acquire);
            let mut wait = match self.store {
                OverrideStore::Redis(..) => POLL,
                OverrideStore::Memory if retry => POLL,
                OverrideStore::Memory => Duration::from_secs(3_600),
            };
            if retry {
                due = due.min(now_ms() + POLL.as_millis() as u64);
            }
            if due != u64::MAX {
                wait = wait.min(Duration::from_millis(due.saturating_sub(now_ms())));
            }
            tokio::select! {
                () = tokio::time::sleep(wait) => {}
                () = self.woken.notified() => {}
            }
        }
    }

    /// Reads from Redis what changed since it was last read, and has it applied.
    async fn read_redis(&self, redis: &RedisBackend, keys: &Keys) -> Result<(), BackendError> {
        let (version, member, score) = {
            let seen = self.seen.lock();
            (
                seen.version.clone(),
                seen.member.clone(),
                seen.score.clone(),
            )
        };
        let reply: Vec<String> = redis
            .command(
                redis::cmd("EVAL")
                    .arg(READ)
                    .arg(3)
                    .arg(&keys.all)
                    .arg(&keys.log)
                    .arg(&keys.version)
                    .arg(version)
                    .arg(member)
                    .arg(score),
            )
            .await?;
        let [kind, version, member, score, pairs @ ..] = &reply[..] else {
            return Ok(());
        };
        let record = |id: &String, json: &String| {
            serde_json::from_str::<OverrideRecord>(json)
                .inspect_err(|e| {
                    tracing::warn!(id = %id, error = %e, "overrides: an entry in Redis is not an override; left out")
                })
                .ok()
        };
        let change = if kind == "1" {
            Edit::Stored(
                pairs
                    .chunks_exact(2)
                    .map(|p| {
                        let r = (!p[1].is_empty()).then(|| record(&p[0], &p[1])).flatten();
                        (p[0].clone(), r)
                    })
                    .collect(),
            )
        } else {
            Edit::All(
                pairs
                    .chunks_exact(2)
                    .filter_map(|p| Some((p[0].clone(), record(&p[0], &p[1])?)))
                    .collect(),
            )
        };
        if self.change(change).await.is_ok() {
            *self.seen.lock() = LastRead {
                version: version.clone(),
                member: member.clone(),
                score: score.clone(),
            };
        }
        Ok(())
    }

    /// Removes from the store the overrides that have ended (counted, logged); whether every
    /// one was.
    async fn remove_ended(&self) -> bool {
        let now = now_ms();
        let ended: Vec<OverrideRecord> = self
            .records
            .lock()
            .values()
            .filter(|r| r.expired(now))
            .cloned()
            .collect();
        let mut all = true;
        for r in ended {
            match self.remove(&r).await {
                Ok(true) => {
                    self.metrics.changed("expire");
                    tracing::info!(id = %r.id, domain = %r.domain, entries = %entries_text(&r), limits = %limits_text(&r), "override ended; the config's limits apply again");
                }
                // Another replica removed it first.
                Ok(false) => {}
                Err(e) => {
                    all = false;
                    tracing::debug!(error = %e, "overrides: an ended override not removed yet")
                }
            }
        }
        all
    }

    /// Removes `r` from the store if it is still there as read, and from the set here.
    /// Whether it was there.
    async fn remove(&self, r: &OverrideRecord) -> Result<bool, ChangeError> {
        match &self.store {
            OverrideStore::Memory => match self.change(Edit::Remove(r.clone())).await? {
                EditDone::Removed(done) => Ok(done),
                other => unreachable!("a removal answered {other:?}"),
            },
            OverrideStore::Redis(redis, keys) => {
                let json = serde_json::to_string(r).unwrap_or_default();
                let done: i64 = redis
                    .command(
                        redis::cmd("EVAL")
                            .arg([LOG, DELETE].concat())
                            .arg(5)
                            .arg(&keys.all)
                            .arg(&keys.slots)
                            .arg(&keys.version)
                            .arg(&keys.seq)
                            .arg(&keys.log)
                            .arg(&r.id)
                            .arg(json)
                            .arg(r.slot())
                            .arg(new_version())
                            .arg("")
                            .arg(LOG_LENGTH),
                    )
                    .await?;
                self.change(Edit::Stored(vec![(r.id.clone(), None)]))
                    .await?;
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
        let before = match &self.store {
            OverrideStore::Memory => match self.change(Edit::Set(record.clone())).await? {
                EditDone::Set(before) => before,
                other => unreachable!("a set answered {other:?}"),
            },
            OverrideStore::Redis(redis, keys) => {
                let json = serde_json::to_string(&record)
                    .map_err(|e| ChangeError::Store(e.to_string()))?;
                let (done, before): (i64, String) = redis
                    .command(
                        redis::cmd("EVAL")
                            .arg([LOG, SET].concat())
                            .arg(5)
                            .arg(&keys.all)
                            .arg(&keys.slots)
                            .arg(&keys.version)
                            .arg(&keys.seq)
                            .arg(&keys.log)
                            .arg(record.slot())
                            .arg(&record.id)
                            .arg(json)
                            .arg(self.options.max)
                            .arg(new_version())
                            .arg(LOG_LENGTH),
                    )
                    .await?;
                if done == 0 {
                    return Err(ChangeError::Full(self.options.max));
                }
                let before: Option<OverrideRecord> = serde_json::from_str(&before).ok();
                let mut changed = Vec::with_capacity(2);
                if let Some(b) = &before {
                    changed.push((b.id.clone(), None));
                }
                changed.push((record.id.clone(), Some(record.clone())));
                self.change(Edit::Stored(changed)).await?;
                before
            }
        };
        self.metrics.changed("set");
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
            OverrideStore::Memory => self.records.lock().values().cloned().collect(),
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
            OverrideStore::Memory => self.records.lock().get(id).cloned(),
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
        self.metrics.changed("delete");
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
