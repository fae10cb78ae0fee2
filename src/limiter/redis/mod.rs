//! The Redis backend: every counter of a request decided by ONE atomic Lua script call
//! (`script.lua`), so replicas sharing a Redis never admit more than the limit between them.
//!
//! Keys are `<prefix>{<tag>}<rest>`. With `--redis-hash-tag domain` (default) the tag is the
//! domain: a request's keys share one cluster slot and one script call decides them exactly.
//! With `--redis-hash-tag descriptor` each descriptor's keys carry their own tag so a busy
//! domain spreads over the cluster; the request's keys are grouped by slot, one script runs per
//! group in parallel, and when any group rejects, the groups that consumed are refunded. That
//! mode may over-reject for one round trip (a concurrent request can see the consumed-then-
//! refunded hits); it never over-admits.

mod breaker;
mod cache;
pub mod connection;

use std::collections::HashMap;
use std::hash::{BuildHasher, RandomState};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use futures_util::future::join_all;
use redis::{RedisError, Script};

use self::breaker::Breaker;
use self::cache::OverLimitCache;
pub use self::connection::{Conn, Credentials, RedisUrl, Target, TlsFiles};
use super::{Backend, BackendError, BoxFuture, Enforcement, Hit, Outcome, Verdict, admits};
use crate::metrics::Metrics;

/// The script, loaded once per process and per Redis (EVALSHA; reloaded on NOSCRIPT).
pub const SCRIPT: &str = include_str!("script.lua");

/// What a key's hash tag covers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HashTag {
    /// The domain: one slot per domain, exact all-or-nothing in one call.
    Domain,
    /// The descriptor: spreads a domain over the cluster; refunds across slots.
    Descriptor,
}

/// Everything the Redis backend needs.
#[derive(Clone, Debug)]
pub struct RedisOptions {
    /// Where Redis is.
    pub target: Target,
    /// TLS files for `rediss://`.
    pub tls: TlsFiles,
    /// Budget for one call, including cluster redirections and retries.
    pub timeout: Duration,
    /// Prepended to every key; must not contain `{` or `}`.
    pub key_prefix: String,
    /// What the hash tag covers.
    pub hash_tag: HashTag,
    /// Bytes of the over-limit cache, keys included; 0 turns it off.
    pub local_cache_bytes: u64,
}

/// Counters in Redis.
pub struct RedisBackend {
    conn: Conn,
    script: Script,
    opts: RedisOptions,
    cache: Option<OverLimitCache>,
    breaker: Breaker,
    metrics: Arc<Metrics>,
    nonce_base: u64,
    nonce: AtomicU64,
    up: AtomicBool,
}

/// One script call's share of a request.
struct Group {
    hits: Vec<usize>,
}

/// CRC16 (XMODEM) of the hash tag, mod 16384: the Redis Cluster slot.
pub fn slot(tag: &[u8]) -> u16 {
    let mut crc: u16 = 0;
    for &b in tag {
        crc ^= (b as u16) << 8;
        for _ in 0..8 {
            crc = if crc & 0x8000 != 0 {
                (crc << 1) ^ 0x1021
            } else {
                crc << 1
            };
        }
    }
    crc % 16384
}

/// Classifies a Redis error: a bounded metric label, and whether a retry may succeed.
fn classify(err: &RedisError) -> (&'static str, bool) {
    use redis::{ErrorKind, ServerErrorKind};
    if err.is_timeout() {
        return ("timeout", true);
    }
    if err.is_io_error() || err.is_connection_dropped() || err.is_connection_refusal() {
        return ("connection", true);
    }
    match err.kind() {
        ErrorKind::Server(ServerErrorKind::NoScript) => ("noscript", true),
        ErrorKind::Server(ServerErrorKind::CrossSlot) => ("crossslot", false),
        ErrorKind::AuthenticationFailed | ErrorKind::Server(ServerErrorKind::NoPerm) => {
            ("auth", true)
        }
        _ if err.is_cluster_error() => ("cluster", true),
        _ => match err.code() {
            Some("BUSY") | Some("LOADING") | Some("MASTERDOWN") | Some("READONLY") => {
                ("busy", true)
            }
            Some("NOAUTH") | Some("WRONGPASS") => ("auth", true),
            _ if !matches!(err.retry_method(), redis::RetryMethod::NoRetry) => ("other", true),
            _ => ("script", false),
        },
    }
}

impl RedisBackend {
    /// Prepares the backend without connecting (Redis may be down at start).
    pub fn new(opts: RedisOptions, metrics: Arc<Metrics>) -> Result<RedisBackend, String> {
        if opts.key_prefix.contains(['{', '}']) {
            return Err(format!(
                "--redis-key-prefix '{}' must not contain '{{' or '}}' (it would move the hash tag)",
                opts.key_prefix
            ));
        }
        let conn = Conn::new(&opts.target, &opts.tls, opts.timeout)?;
        Ok(RedisBackend {
            conn,
            script: Script::new(SCRIPT),
            cache: (opts.local_cache_bytes > 0)
                .then(|| OverLimitCache::new(opts.local_cache_bytes)),
            breaker: Breaker::new(),
            metrics,
            nonce_base: RandomState::new().hash_one(std::process::id()),
            nonce: AtomicU64::new(0),
            up: AtomicBool::new(true),
            opts,
        })
    }

    /// Whether the last call or probe reached Redis.
    pub fn is_up(&self) -> bool {
        self.up.load(Ordering::Relaxed)
    }

    fn set_up(&self, up: bool) {
        self.up.store(up, Ordering::Relaxed);
        self.metrics.backend_up.set(up as i64);
    }

    /// Pings Redis every `every` so health and metrics tell the truth without traffic, and a
    /// recovered Redis closes the circuit without waiting for a request to probe it.
    ///
    /// While Redis is down it probes ten times as often, so a Redis that is back is used again
    /// within a tenth of `every` (and the circuit closes) rather than within `every`.
    pub fn spawn_probe(self: &Arc<Self>, every: Duration) -> tokio::task::JoinHandle<()> {
        let backend = Arc::downgrade(self);
        tokio::spawn(async move {
            loop {
                let up = backend.upgrade().is_some_and(|b| b.is_up());
                tokio::time::sleep(if up { every } else { every / 10 }).await;
                let Some(b) = backend.upgrade() else { return };
                let ok = matches!(
                    tokio::time::timeout(b.opts.timeout, b.conn.ping(b.opts.timeout)).await,
                    Ok(Ok(()))
                );
                if ok {
                    b.breaker.on_success();
                } else if b.is_up() {
                    tracing::warn!("redis unreachable");
                }
                if ok && !b.is_up() {
                    tracing::info!("redis reachable again");
                }
                b.set_up(ok);
            }
        })
    }

    /// The Redis key of a hit: `<prefix>{<tag>}<rest>`.
    pub fn redis_key(&self, hit: &Hit) -> Vec<u8> {
        let at = match self.opts.hash_tag {
            HashTag::Domain => hit.key.domain_len(),
            HashTag::Descriptor => hit.key.descriptor_len(),
        };
        let (tag, rest) = hit.key.split_at(at);
        let mut key = Vec::with_capacity(self.opts.key_prefix.len() + hit.key.as_bytes().len() + 2);
        key.extend_from_slice(self.opts.key_prefix.as_bytes());
        key.push(b'{');
        key.extend_from_slice(tag);
        key.push(b'}');
        key.extend_from_slice(rest);
        key
    }

    fn groups(&self, hits: &[Hit]) -> Vec<Group> {
        if self.opts.hash_tag == HashTag::Domain {
            return vec![Group {
                hits: (0..hits.len()).collect(),
            }];
        }
        let mut by_slot: HashMap<u16, Vec<usize>> = HashMap::new();
        let mut order = Vec::new();
        for (i, hit) in hits.iter().enumerate() {
            let s = slot(hit.key.descriptor_part());
            by_slot
                .entry(s)
                .or_insert_with(|| {
                    order.push(s);
                    Vec::new()
                })
                .push(i);
        }
        order
            .into_iter()
            .map(|s| Group {
                hits: by_slot.remove(&s).unwrap_or_default(),
            })
            .collect()
    }

    /// The script call for `group`. For a refund, `consumed[i]` says whether the decide took
    /// hit `i` (it did not when that limit was over): only what was taken is given back.
    #[allow(clippy::too_many_arguments)]
    fn invocation<'s>(
        &'s self,
        hits: &[Hit],
        group: &Group,
        mode: &str,
        nonce: &str,
        at: i64,
        soft_quota: bool,
        consumed: Option<&[bool]>,
    ) -> redis::ScriptInvocation<'s> {
        let mut inv = self.script.prepare_invoke();
        inv.arg(mode).arg(nonce).arg(at);
        for &i in &group.hits {
            let hit = &hits[i];
            let taken = match consumed {
                Some(c) if !c[i] => 0,
                _ => hit.hits,
            };
            let l = &hit.limit;
            let enforcement = match hit.enforcement {
                Enforcement::Enforce => "E",
                Enforcement::Quota if !soft_quota => "Q",
                Enforcement::Quota | Enforcement::Shadow => "S",
            };
            inv.key(self.redis_key(hit))
                .arg(std::str::from_utf8(&[l.algorithm.tag()]).unwrap_or("f"))
                .arg(l.requests_per_unit)
                .arg(l.window_us)
                .arg(l.burst)
                .arg(taken)
                .arg(enforcement);
        }
        inv
    }

    /// Runs `op` within the call budget. A failure becomes a [`BackendError`], counted by kind;
    /// a connection the error says is dead is dropped.
    async fn bounded<T>(
        &self,
        op: impl std::future::Future<Output = redis::RedisResult<T>>,
    ) -> Result<T, BackendError> {
        match tokio::time::timeout(self.opts.timeout, op).await {
            Ok(Ok(v)) => Ok(v),
            Ok(Err(e)) => {
                self.conn.on_error(&e).await;
                let (kind, transient) = classify(&e);
                self.metrics.backend_error(kind);
                let detail = format!("redis: {e}");
                Err(if transient {
                    BackendError::Unavailable { kind, detail }
                } else {
                    BackendError::Internal { kind, detail }
                })
            }
            Err(_) => {
                self.metrics.backend_error("timeout");
                Err(BackendError::Unavailable {
                    kind: "timeout",
                    detail: format!("redis did not answer within {:?}", self.opts.timeout),
                })
            }
        }
    }

    async fn call(&self, inv: &redis::ScriptInvocation<'_>) -> Result<Vec<i64>, BackendError> {
        let started = Instant::now();
        let result = self.bounded(self.conn.invoke(inv, self.opts.timeout)).await;
        self.metrics
            .backend_duration
            .observe(started.elapsed().as_secs_f64());
        match result {
            Ok(v) => {
                self.breaker.on_success();
                self.set_up(true);
                Ok(v)
            }
            Err(e) => {
                // Only a Redis that cannot be reached or is stuck opens the circuit. One that
                // answered (TRYAGAIN mid-migration, a failover in progress, AUTH, a script
                // error) costs no timeout when called again, and a bug must not open it.
                if e.is_transient() && matches!(e.kind(), "timeout" | "connection" | "busy") {
                    self.breaker.on_failure();
                    self.set_up(false);
                }
                Err(e)
            }
        }
    }

    async fn decide_remote(&self, hits: &[Hit]) -> Result<Outcome, BackendError> {
        if !self.breaker.allow() {
            self.metrics.backend_error("circuit_open");
            return Err(BackendError::Unavailable {
                kind: "circuit_open",
                detail: "redis circuit open after repeated failures".into(),
            });
        }
        let nonce = format!(
            "{:x}.{:x}",
            self.nonce_base,
            self.nonce.fetch_add(1, Ordering::Relaxed)
        );
        let groups = self.groups(hits);
        let soft_quota = groups.len() > 1;
        let invocations: Vec<_> = groups
            .iter()
            .map(|g| self.invocation(hits, g, "decide", &nonce, 0, soft_quota, None))
            .collect();
        let results = join_all(invocations.iter().map(|inv| self.call(inv))).await;

        let mut verdicts = vec![
            Verdict {
                over: false,
                remaining: 0,
                reset: Duration::ZERO
            };
            hits.len()
        ];
        let mut committed: Vec<(usize, i64)> = Vec::new(); // (group, time of decide)
        let mut first_error = None;
        for (g, result) in results.into_iter().enumerate() {
            match result {
                Ok(reply) if reply.len() == 2 + 3 * groups[g].hits.len() => {
                    if reply[0] == 1 {
                        committed.push((g, reply[1]));
                    }
                    for (j, &i) in groups[g].hits.iter().enumerate() {
                        let v = &reply[2 + 3 * j..5 + 3 * j];
                        verdicts[i] = Verdict {
                            over: v[0] == 1,
                            remaining: v[1].max(0) as u64,
                            reset: Duration::from_micros(v[2].max(0) as u64),
                        };
                    }
                }
                Ok(reply) => {
                    self.metrics.backend_error("reply");
                    first_error.get_or_insert(BackendError::Internal {
                        kind: "reply",
                        detail: format!(
                            "unexpected script reply of {} values for {} limits",
                            reply.len(),
                            groups[g].hits.len()
                        ),
                    });
                }
                Err(e) => {
                    first_error.get_or_insert(e);
                }
            }
        }
        let admitted = first_error.is_none() && admits(hits, |i| verdicts[i].over);
        if !admitted && groups.len() > 1 {
            // Undo the groups that consumed, and in them only the limits that were taken (an
            // over limit, shadow or quota, took nothing); never over-admit, may over-reject
            // briefly.
            let consumed: Vec<bool> = verdicts.iter().map(|v| !v.over).collect();
            let refunds: Vec<_> = committed
                .iter()
                .map(|&(g, at)| {
                    self.invocation(
                        hits,
                        &groups[g],
                        "refund",
                        &nonce,
                        at,
                        soft_quota,
                        Some(&consumed),
                    )
                })
                .collect();
            for result in join_all(refunds.iter().map(|inv| self.call(inv))).await {
                if let Err(e) = result {
                    tracing::warn!(error = %e, "refund failed; the hits stay counted until their window ends");
                }
            }
        }
        if let Some(e) = first_error {
            return Err(e);
        }
        if let Some(cache) = &self.cache {
            let now = Instant::now();
            for (hit, v) in hits.iter().zip(&verdicts) {
                if v.over && hit.enforcement == Enforcement::Enforce {
                    cache.insert(hit.key.as_bytes(), now + v.reset, hit.hits);
                }
            }
        }
        Ok(Outcome { admitted, verdicts })
    }

    /// Answers from the over-limit cache when an enforced hit is known to be over.
    fn decide_cached(&self, hits: &[Hit]) -> Option<Outcome> {
        let cache = self.cache.as_ref()?;
        let now = Instant::now();
        let mut any = false;
        let verdicts: Vec<Verdict> = hits
            .iter()
            .map(|hit| {
                let until = (hit.enforcement == Enforcement::Enforce)
                    .then(|| cache.over_until(hit.key.as_bytes(), hit.hits, now))
                    .flatten();
                match until {
                    Some(until) => {
                        any = true;
                        Verdict {
                            over: true,
                            remaining: 0,
                            reset: until - now,
                        }
                    }
                    // Unknown without a round trip; the request is rejected anyway.
                    None => Verdict {
                        over: false,
                        remaining: 0,
                        reset: Duration::ZERO,
                    },
                }
            })
            .collect();
        if !any {
            return None;
        }
        self.metrics.local_cache_hits.inc();
        Some(Outcome {
            admitted: false,
            verdicts,
        })
    }
}

impl Backend for RedisBackend {
    fn decide<'a>(&'a self, hits: &'a [Hit]) -> BoxFuture<'a, Result<Outcome, BackendError>> {
        Box::pin(async move {
            if let Some(outcome) = self.decide_cached(hits) {
                return Ok(outcome);
            }
            self.decide_remote(hits).await
        })
    }

    fn reset<'a>(&'a self, hits: &'a [Hit]) -> BoxFuture<'a, Result<usize, BackendError>> {
        Box::pin(async move {
            let mut removed = 0;
            // One DEL per key: with per-descriptor hash tags they may live in different slots.
            for hit in hits {
                if let Some(cache) = &self.cache {
                    cache.remove(hit.key.as_bytes());
                }
                removed += self
                    .bounded(self.conn.del(&self.redis_key(hit), self.opts.timeout))
                    .await?;
            }
            Ok(removed)
        })
    }

    fn is_up(&self) -> bool {
        RedisBackend::is_up(self)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn options(prefix: &str) -> RedisOptions {
        RedisOptions {
            target: Target::Standalone(RedisUrl::parse("redis://127.0.0.1:1").unwrap()),
            tls: TlsFiles::default(),
            timeout: Duration::from_millis(100),
            key_prefix: prefix.into(),
            hash_tag: HashTag::Domain,
            local_cache_bytes: 0,
        }
    }

    #[tokio::test]
    async fn a_prefix_with_braces_is_refused_and_keys_carry_our_tag() {
        let metrics = Arc::new(Metrics::new());
        let err = RedisBackend::new(options("rl{x}:"), metrics.clone())
            .err()
            .unwrap();
        assert!(err.contains("--redis-key-prefix"), "{err}");
        let backend = RedisBackend::new(options("rl:"), metrics).unwrap();
        let hit = Hit {
            key: super::super::CounterKey::new("edge", [("k", "{v}")]),
            limit: super::super::Limit {
                algorithm: super::super::Algorithm::FixedWindow,
                requests_per_unit: 1,
                window_us: 1_000_000,
                burst: 1,
            },
            hits: 1,
            enforcement: Enforcement::Enforce,
        };
        assert_eq!(backend.redis_key(&hit), b"rl:{edge}:k:%7Bv%7D".to_vec());
    }

    #[test]
    fn slots_match_redis() {
        // Values from CLUSTER KEYSLOT.
        assert_eq!(slot(b"foo"), 12182);
        assert_eq!(slot(b"edge"), slot(b"edge"));
        assert_eq!(slot(b"123456789"), 0x31C3, "the CRC16-XMODEM check value");
    }
}
