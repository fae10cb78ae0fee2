//! Whether Redis may evict this service's keys: every counter, hold and place carries a TTL (its
//! window, its lifetime), so any policy but `noeviction` can drop them once Redis reaches
//! `maxmemory`, and an evicted concurrency counter frees every place it kept. Read once per
//! store at start with `CONFIG GET` (where the server allows it) and said in the log.

use std::sync::Arc;
use std::time::Duration;

use super::RedisBackend;

/// How often a store not reached yet is tried again.
const RETRY_EVERY: Duration = Duration::from_secs(1);

/// What a store's eviction settings mean for its keys.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Eviction {
    /// `noeviction`: a full Redis refuses writes (the failure mode decides) and drops nothing.
    Never,
    /// A policy that evicts, and the `maxmemory` it starts at (0: no bound, so not yet).
    Can { policy: String, maxmemory: u64 },
}

impl Eviction {
    /// Reads `CONFIG GET maxmemory-policy` and `maxmemory` replies: flat `[name, value]`
    /// arrays, or a map, or one of those per node (the cluster client sends `CONFIG GET` to
    /// one node, but a reply of several is read whole): the first evicting policy wins.
    pub(crate) fn of(policy: &redis::Value, maxmemory: &redis::Value) -> Option<Eviction> {
        let policies = values_after(policy, "maxmemory-policy");
        let maxmemory = values_after(maxmemory, "maxmemory")
            .iter()
            .filter_map(|v| v.parse::<u64>().ok())
            .max()
            .unwrap_or(0);
        if policies.is_empty() {
            return None;
        }
        Some(
            match policies
                .into_iter()
                .find(|p| !p.eq_ignore_ascii_case("noeviction"))
            {
                None => Eviction::Never,
                Some(policy) => Eviction::Can { policy, maxmemory },
            },
        )
    }
}

/// Every string that follows `name` in `value`, however nested.
fn values_after(value: &redis::Value, name: &str) -> Vec<String> {
    let mut strings = Vec::new();
    flatten(value, &mut strings);
    strings
        .windows(2)
        .filter(|w| w[0].eq_ignore_ascii_case(name))
        .map(|w| w[1].clone())
        .collect()
}

fn flatten(value: &redis::Value, out: &mut Vec<String>) {
    use redis::Value;
    match value {
        Value::BulkString(b) => out.push(String::from_utf8_lossy(b).into_owned()),
        Value::SimpleString(s) => out.push(s.clone()),
        Value::Int(i) => out.push(i.to_string()),
        Value::Array(items) | Value::Set(items) => items.iter().for_each(|v| flatten(v, out)),
        Value::Map(pairs) => pairs.iter().for_each(|(k, v)| {
            flatten(k, out);
            flatten(v, out);
        }),
        _ => {}
    }
}

impl RedisBackend {
    /// Checks each store's eviction policy once it answers, and logs it: a warning where
    /// Redis can evict this service's keys, a line naming `noeviction` otherwise, a note where
    /// the server refuses `CONFIG` (managed services often do).
    pub(crate) fn spawn_eviction_check(self: &Arc<Self>) -> tokio::task::JoinHandle<()> {
        let backend = Arc::downgrade(self);
        tokio::spawn(async move {
            let stores = backend.upgrade().map_or(0, |b| b.stores.len());
            for store in 0..stores {
                loop {
                    let Some(b) = backend.upgrade() else { return };
                    let s = &b.stores[store];
                    let name = s.health.name();
                    let get = |what: &str| {
                        let mut cmd = redis::cmd("CONFIG");
                        cmd.arg("GET").arg(what);
                        cmd
                    };
                    let policy = s
                        .conn
                        .query::<redis::Value>(&get("maxmemory-policy"), b.opts.timeout)
                        .await;
                    let policy = match policy {
                        Ok(v) => v,
                        // Not reached yet: tried again.
                        Err(e) if super::connection::is_dead(&e) => {
                            drop(b);
                            tokio::time::sleep(RETRY_EVERY).await;
                            continue;
                        }
                        Err(e) => {
                            tracing::info!(
                                "{name}: cannot read maxmemory-policy ({e}); set it to noeviction, or Redis may evict counters and free places in use (docs/redis.md)"
                            );
                            break;
                        }
                    };
                    let maxmemory = s
                        .conn
                        .query::<redis::Value>(&get("maxmemory"), b.opts.timeout)
                        .await
                        .unwrap_or(redis::Value::Nil);
                    match Eviction::of(&policy, &maxmemory) {
                        Some(Eviction::Never) => {
                            tracing::info!(
                                "{name}: maxmemory-policy noeviction: no key of this service is ever evicted"
                            );
                        }
                        Some(Eviction::Can { policy, maxmemory }) => {
                            tracing::warn!(policy = %policy, maxmemory, "{name}: maxmemory-policy {policy} can evict this service's keys once Redis is full: counters start again and places in use are freed; set maxmemory-policy noeviction (docs/redis.md)");
                        }
                        None => {
                            tracing::info!(
                                "{name}: maxmemory-policy not in CONFIG GET's answer; set it to noeviction (docs/redis.md)"
                            );
                        }
                    }
                    break;
                }
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use redis::Value;

    use super::*;

    fn pair(k: &str, v: &str) -> Value {
        Value::Array(vec![
            Value::BulkString(k.as_bytes().to_vec()),
            Value::BulkString(v.as_bytes().to_vec()),
        ])
    }

    #[test]
    fn every_node_and_reply_shape_is_read() {
        let max = pair("maxmemory", "1048576");
        assert_eq!(
            Eviction::of(&pair("maxmemory-policy", "noeviction"), &max),
            Some(Eviction::Never)
        );
        assert_eq!(
            Eviction::of(&pair("maxmemory-policy", "allkeys-lru"), &max),
            Some(Eviction::Can {
                policy: "allkeys-lru".into(),
                maxmemory: 1_048_576
            })
        );
        // A cluster's answer per node: one evicting node is enough.
        let nodes = Value::Map(vec![
            (
                Value::SimpleString("127.0.0.1:7000".into()),
                pair("maxmemory-policy", "noeviction"),
            ),
            (
                Value::SimpleString("127.0.0.1:7001".into()),
                pair("maxmemory-policy", "volatile-ttl"),
            ),
        ]);
        assert!(matches!(
            Eviction::of(&nodes, &Value::Nil),
            Some(Eviction::Can { policy, maxmemory: 0 }) if policy == "volatile-ttl"
        ));
        assert_eq!(Eviction::of(&Value::Array(vec![]), &Value::Nil), None);
    }
}
