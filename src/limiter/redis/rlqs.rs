//! The protocol between Rust and `rlqs.lua`: one participant's grant from an RLQS pool
//! that every replica on this Redis shares ([`PoolCall`] → [`PoolReply`]), and the script's
//! pure fair-share arithmetic ([`RedisBackend::pool_shares`]), which a test holds against the
//! Rust function. The script's header documents the layout; this is the one place on the Rust
//! side that knows it.
//!
//! Pool calls travel in a [`Lane`] of their own: their own connection, their own circuit
//! breaker (fed only by their own calls and the PINGs confirming their timeouts) and at most
//! [`Lane::IN_FLIGHT`] calls at once, a call waiting for its turn no longer than its budget.
//! A large pool whose calls time out opens the RLQS lane's circuit, never the one RLS
//! requests go through; RLS calls wait at Redis behind at most that many pool calls.

use std::time::Duration;

use redis::{Cmd, Value};
use tokio::time::Instant;

use std::sync::Arc;

use super::circuit::StoreHealth;
use super::connection::Conn;
use super::error::{ErrorKind, Evidence};
use super::{RedisBackend, RedisOptions};
use crate::limiter::BackendError;
use crate::limiter::redis::SetupError;

/// The RLQS pools' way to Redis, apart from RLS's.
pub(super) struct Lane {
    conn: Conn,
    health: Arc<StoreHealth>,
    turns: tokio::sync::Semaphore,
}

impl Lane {
    /// Pool calls at Redis at once: one, so that an RLS call waits behind at most one
    /// (docs/performance.md, "Measurements behind the code").
    pub(super) const IN_FLIGHT: usize = 1;

    /// A lane to `opts`' Redis (nothing connects until the first call).
    pub(super) fn new(opts: &RedisOptions) -> Result<Lane, SetupError> {
        let conn = || Conn::new(&opts.target, &opts.tls, opts.timeout);
        Ok(Lane {
            conn: conn()?,
            health: Arc::new(StoreHealth::new("redis (RLQS)", conn()?, None)),
            turns: tokio::sync::Semaphore::new(Self::IN_FLIGHT),
        })
    }
}

/// The script, loaded once per process and per Redis (EVALSHA; EVAL after NOSCRIPT).
const POOL_SCRIPT: &str = include_str!("rlqs.lua");

/// The fair-share rule's constants, sent with every call so that they are written once, on
/// the Rust side.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct SharePolicy {
    /// A demand counts at least this fraction of an equal split.
    pub(crate) floor_of_equal_split: f64,
    /// Demand is met with this factor of room.
    pub(crate) headroom: f64,
}

/// What a call does to its member.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) enum PoolOp {
    /// Records the member's demand (tokens per window; `None`: not measured), keeps it
    /// connected and grants it its share.
    Grant(Option<f64>),
    /// The member is gone from this replica: its lease counts until it runs out.
    Leave,
}

/// One member's call on one pool.
#[derive(Clone, Copy, Debug)]
pub(crate) struct PoolCall<'a> {
    /// The pool: the key of the counter RLS would use for the same limit.
    pub(crate) pool: &'a [u8],
    /// The member, unique across replicas.
    pub(crate) member: &'a str,
    /// Tokens per window (> 0).
    pub(crate) limit: u64,
    /// Tokens at once, over all members.
    pub(crate) burst: u64,
    /// How long a grant is held (the assignment TTL).
    pub(crate) lease: Duration,
    /// How long a member counts as connected after a grant.
    pub(crate) alive: Duration,
    pub(crate) op: PoolOp,
    pub(crate) policy: SharePolicy,
}

/// The script's answer to a [`PoolCall`].
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct PoolReply {
    /// Tokens per window granted (0 for a leave).
    pub(crate) tokens: u64,
    /// The grant's part of the burst.
    pub(crate) max_tokens: u64,
    /// The pool's new shares, when a recomputation ended in this call.
    pub(crate) pass: Option<ShareTerms>,
}

/// A pool's fair shares in four numbers: a member's share is `min(ask, level) + extra`, its
/// ask being its demand with headroom, at most `capacity` and at least `least`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct ShareTerms {
    /// The water level (infinite: every ask is met).
    pub(crate) level: f64,
    /// What nobody asked for, per member.
    pub(crate) extra: f64,
    /// The least a member asks.
    pub(crate) least: f64,
    /// What the members share: the limit less the disconnected members' leases.
    pub(crate) capacity: f64,
    /// Tokens of the limit no grant held once the call that ended the pass had granted: what
    /// raising other members' grants can be paid from.
    pub(crate) free: u64,
}

/// A pool's Redis key: `<prefix>{<tag>}<what><rest of the counter key>` (`quota`: the pool,
/// `quota-order`: its recomputation's sorted demands; names kept from before "quota" was left to
/// the protocol, as they are data that replicas of every version share). A counter key holds no brace but its
/// tag's, and continues the tag with `:`, so this is no counter's key, distinct pools have
/// distinct keys, and a pool's two keys share its counter's slot.
fn pool_key(counter: &[u8], what: &[u8]) -> Vec<u8> {
    let tag_end = counter.iter().position(|b| *b == b'}').map_or(0, |i| i + 1);
    let mut key = Vec::with_capacity(counter.len() + what.len());
    key.extend_from_slice(&counter[..tag_end]);
    key.extend_from_slice(what);
    key.extend_from_slice(&counter[tag_end..]);
    key
}

/// A demand as the script reads it: `-` for none.
fn demand_arg(demand: Option<f64>) -> String {
    match demand {
        Some(d) if d.is_finite() => format!("{d:e}"),
        _ => "-".into(),
    }
}

fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX).max(1)
}

fn int(v: &Value) -> Option<i64> {
    match v {
        Value::Int(i) => Some(*i),
        _ => None,
    }
}

fn number(v: &Value) -> Option<f64> {
    match text(v)?.as_str() {
        "inf" => Some(f64::INFINITY),
        t => t.parse().ok(),
    }
}

fn text(v: &Value) -> Option<String> {
    match v {
        Value::BulkString(b) => String::from_utf8(b.clone()).ok(),
        Value::SimpleString(s) => Some(s.clone()),
        _ => None,
    }
}

impl PoolReply {
    fn parse(reply: &Value) -> Result<PoolReply, &'static str> {
        let Value::Array(values) = reply else {
            return Err("not an array");
        };
        match values.as_slice() {
            [first] if int(first) == Some(-1) => Err("foreign"),
            [tokens, max_tokens, pass, terms @ ..] => Ok(PoolReply {
                tokens: int(tokens)
                    .and_then(|t| u64::try_from(t).ok())
                    .ok_or("tokens")?,
                max_tokens: int(max_tokens)
                    .and_then(|t| u64::try_from(t).ok())
                    .ok_or("max_tokens")?,
                pass: match (int(pass), terms) {
                    (Some(0), []) => None,
                    (Some(1), [level, extra, least, capacity, free]) => Some(ShareTerms {
                        level: number(level).ok_or("level")?,
                        extra: number(extra).ok_or("extra")?,
                        least: number(least).ok_or("least")?,
                        capacity: number(capacity).ok_or("capacity")?,
                        free: int(free)
                            .and_then(|f| u64::try_from(f).ok())
                            .ok_or("free")?,
                    }),
                    _ => return Err("pass"),
                },
            }),
            _ => Err("too short"),
        }
    }
}

impl RedisBackend {
    /// Runs the pool script on `keys` with `args`, within the call budget, through the
    /// circuit breaker; NOSCRIPT is answered by sending the source once.
    async fn eval_pool(&self, keys: &[&[u8]], args: &[Vec<u8>]) -> Result<Value, BackendError> {
        let lane = &self.rlqs;
        if !lane.health.allow() {
            return Err(self.error(
                ErrorKind::CircuitOpen,
                "redis circuit of the RLQS pools open after repeated failures",
            ));
        }
        let timeout = self.opts.timeout;
        let deadline = Instant::now() + timeout;
        // Its turn, within its budget; a lane that stays full answers like a full queue.
        let Ok(Ok(_turn)) = tokio::time::timeout_at(deadline, lane.turns.acquire()).await else {
            return Err(self.error(
                ErrorKind::Overloaded,
                format!(
                    "the RLQS pools' calls to redis are {} deep",
                    Lane::IN_FLIGHT
                ),
            ));
        };
        let command = |by_source: bool| {
            let mut cmd = Cmd::new();
            if by_source {
                cmd.arg("EVAL").arg(POOL_SCRIPT);
            } else {
                cmd.arg("EVALSHA").arg(pool_script_hash());
            }
            cmd.arg(keys.len());
            for k in keys {
                cmd.arg(*k);
            }
            for a in args {
                cmd.arg(&a[..]);
            }
            cmd
        };
        let attempt = |cmd: Cmd| async move {
            tokio::time::timeout_at(deadline, lane.conn.query::<Value>(&cmd, timeout)).await
        };
        let mut result = attempt(command(false)).await;
        if let Ok(Err(e)) = &result
            && e.kind() == redis::ErrorKind::Server(redis::ServerErrorKind::NoScript)
        {
            result = attempt(command(true)).await;
        }
        match result {
            Ok(Ok(v)) => {
                lane.health.on_answer();
                Ok(v)
            }
            Ok(Err(e)) => {
                match ErrorKind::of(&e).evidence() {
                    Evidence::Unreachable => lane.health.on_unreachable(&e),
                    Evidence::Stalled => lane.health.on_timeout(timeout),
                    Evidence::None => {}
                }
                lane.conn.on_error(&e).await;
                Err(self.redis_error(&e))
            }
            Err(_) => {
                lane.health.on_timeout(timeout);
                Err(self.timeout_error())
            }
        }
    }

    /// One member's call on one pool.
    pub(crate) async fn pool(&self, call: &PoolCall<'_>) -> Result<PoolReply, BackendError> {
        let key = pool_key(call.pool, b"quota");
        let order = pool_key(call.pool, b"quota-order");
        let (op, demand) = match call.op {
            PoolOp::Grant(demand) => ("grant", demand),
            PoolOp::Leave => ("leave", None),
        };
        let p = call.policy;
        let args: Vec<Vec<u8>> = [
            op.to_string(),
            call.member.to_string(),
            call.limit.max(1).to_string(),
            call.burst.max(1).to_string(),
            millis(call.lease).to_string(),
            millis(call.alive).to_string(),
            demand_arg(demand),
            format!("{:e}", p.floor_of_equal_split),
            format!("{:e}", p.headroom),
        ]
        .into_iter()
        .map(String::into_bytes)
        .collect();
        let reply = self.eval_pool(&[&key, &order], &args).await?;
        PoolReply::parse(&reply).map_err(|why| match why {
            "foreign" => self.error(
                ErrorKind::ForeignData,
                "an RLQS pool's key holds data this service did not write",
            ),
            why => self.error(
                ErrorKind::Reply,
                format!("unexpected pool script reply ({why}): {reply:?}"),
            ),
        })
    }

    /// The script's fair shares of `capacity` among `demands` (writes nothing).
    pub(crate) async fn pool_shares(
        &self,
        policy: SharePolicy,
        capacity: f64,
        demands: &[Option<f64>],
    ) -> Result<Vec<f64>, BackendError> {
        let mut args = vec![
            "shares".to_string(),
            format!("{:e}", policy.floor_of_equal_split),
            format!("{:e}", policy.headroom),
            format!("{capacity:e}"),
        ];
        args.extend(demands.iter().map(|d| demand_arg(*d)));
        let args: Vec<Vec<u8>> = args.into_iter().map(String::into_bytes).collect();
        let reply = self.eval_pool(&[], &args).await?;
        let Value::Array(values) = &reply else {
            return Err(self.error(ErrorKind::Reply, format!("{reply:?}")));
        };
        values
            .iter()
            .map(|v| text(v).and_then(|s| s.parse().ok()))
            .collect::<Option<Vec<f64>>>()
            .ok_or_else(|| self.error(ErrorKind::Reply, format!("{reply:?}")))
    }
}

/// The pool script's SHA1, as EVALSHA names it (computed once).
fn pool_script_hash() -> &'static str {
    static HASH: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    HASH.get_or_init(|| redis::Script::new(POOL_SCRIPT).get_hash().to_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pool_keys_sit_beside_the_counter_in_its_slot() {
        assert_eq!(
            pool_key(b"p:{edge}:name:api:f60000000:0", b"quota"),
            b"p:{edge}quota:name:api:f60000000:0"
        );
        assert_eq!(
            pool_key(b"{d:k:v}:f1000000:0", b"quota-order"),
            b"{d:k:v}quota-order:f1000000:0"
        );
    }

    #[test]
    fn replies_are_read_or_refused() {
        let bulk = |s: &str| Value::BulkString(s.as_bytes().to_vec());
        let reply = Value::Array(vec![
            Value::Int(5),
            Value::Int(2),
            Value::Int(1),
            bulk("inf"),
            bulk("2.5"),
            bulk("1"),
            bulk("100"),
            Value::Int(7),
        ]);
        assert_eq!(
            PoolReply::parse(&reply),
            Ok(PoolReply {
                tokens: 5,
                max_tokens: 2,
                pass: Some(ShareTerms {
                    level: f64::INFINITY,
                    extra: 2.5,
                    least: 1.0,
                    capacity: 100.0,
                    free: 7,
                })
            })
        );
        let quiet = Value::Array(vec![Value::Int(5), Value::Int(2), Value::Int(0)]);
        assert_eq!(PoolReply::parse(&quiet).map(|r| r.pass), Ok(None));
        let short = Value::Array(vec![Value::Int(5), Value::Int(2), Value::Int(1)]);
        assert!(PoolReply::parse(&short).is_err());
        assert_eq!(
            PoolReply::parse(&Value::Array(vec![Value::Int(-1)])),
            Err("foreign")
        );
        assert!(PoolReply::parse(&Value::Array(vec![Value::Int(-5), Value::Int(1)])).is_err());
        assert!(PoolReply::parse(&Value::Int(1)).is_err());
        assert_eq!(demand_arg(Some(f64::NAN)), "-");
        assert_eq!(demand_arg(Some(1.5)), "1.5e0");
    }
}
