//! Connections to every deployment shape: standalone (optionally TLS), Redis Cluster, and a
//! master found through Sentinel. All are multiplexed and pipelined (one connection carries
//! every concurrent request), reconnect by themselves, and never block start-up: the first
//! connection is made on first use, so ratelimitd starts while Redis is down.

use std::fmt;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use redis::aio::{ConnectionManager, ConnectionManagerConfig, MultiplexedConnection};
use redis::cluster::ClusterClientBuilder;
use redis::cluster_async::ClusterConnection;
use redis::sentinel::{SentinelClient, SentinelServerType};
use redis::{AsyncConnectionConfig, Client, RedisResult, ScriptInvocation, TlsCertificates};
use tokio::sync::Mutex;

use crate::limiter::BoxFuture;

/// A Redis URL whose password never shows in `Debug` or `Display`.
#[derive(Clone, PartialEq, Eq)]
pub struct RedisUrl(pub String);

impl RedisUrl {
    /// The URL with any password replaced by `***`.
    pub fn redacted(&self) -> String {
        let s = &self.0;
        let Some(scheme_end) = s.find("://") else {
            return s.clone();
        };
        let rest = &s[scheme_end + 3..];
        let authority_end = rest.find('/').unwrap_or(rest.len());
        match rest[..authority_end].rfind('@') {
            Some(at) => {
                let userinfo = &rest[..at];
                let user = userinfo.split(':').next().unwrap_or("");
                let shown = if userinfo.contains(':') {
                    format!("{user}:***")
                } else {
                    "***".to_string()
                };
                format!("{}{shown}{}", &s[..scheme_end + 3], &rest[at..])
            }
            None => s.clone(),
        }
    }
}

impl fmt::Debug for RedisUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:?}", self.redacted())
    }
}

impl fmt::Display for RedisUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.redacted())
    }
}

/// Where Redis is.
#[derive(Clone, Debug)]
pub enum Target {
    /// One server (`redis://` or `rediss://`).
    Standalone(RedisUrl),
    /// Seed nodes of a Redis Cluster.
    Cluster(Vec<RedisUrl>),
    /// Sentinels and the name of the master they watch.
    Sentinel {
        /// Sentinel URLs.
        nodes: Vec<RedisUrl>,
        /// `sentinel monitor <name> …`.
        master: String,
    },
}

/// PEM files for TLS (`rediss://`).
#[derive(Clone, Debug, Default)]
pub struct TlsFiles {
    /// CA bundle to verify the server with (else the system's roots).
    pub ca: Option<PathBuf>,
    /// Client certificate, for mutual TLS.
    pub cert: Option<PathBuf>,
    /// Client key, for mutual TLS.
    pub key: Option<PathBuf>,
}

impl TlsFiles {
    fn certificates(&self) -> std::io::Result<Option<TlsCertificates>> {
        if self.ca.is_none() && self.cert.is_none() {
            return Ok(None);
        }
        let read = |p: &PathBuf| {
            std::fs::read(p)
                .map_err(|e| std::io::Error::new(e.kind(), format!("{}: {e}", p.display())))
        };
        let client_tls = match (&self.cert, &self.key) {
            (Some(cert), Some(key)) => Some(redis::ClientTlsConfig {
                client_cert: read(cert)?,
                client_key: read(key)?,
            }),
            _ => None,
        };
        Ok(Some(TlsCertificates {
            client_tls,
            root_cert: self.ca.as_ref().map(read).transpose()?,
        }))
    }
}

/// A connection to whichever shape was configured. Cheap to share.
#[derive(Clone)]
pub enum Conn {
    /// Auto-reconnecting multiplexed connection.
    Standalone(ConnectionManager),
    /// Cluster client: routes by slot, follows MOVED/ASK, retries TRYAGAIN within its budget.
    Cluster(Arc<Lazy<ClusterConnection>>),
    /// Master found through Sentinel, re-resolved after any connection error.
    Sentinel(Arc<SentinelConn>),
}

/// A connection made on first use and kept; failed attempts are retried on the next use.
pub struct Lazy<C> {
    slot: Mutex<Option<C>>,
    connect: Box<dyn Fn() -> BoxFuture<'static, RedisResult<C>> + Send + Sync>,
}

impl<C: Clone> Lazy<C> {
    async fn get(&self) -> RedisResult<C> {
        let mut slot = self.slot.lock().await;
        if let Some(c) = slot.as_ref() {
            return Ok(c.clone());
        }
        let c = (self.connect)().await?;
        *slot = Some(c.clone());
        Ok(c)
    }

    async fn reset(&self) {
        *self.slot.lock().await = None;
    }
}

/// Sentinel-discovered master.
pub struct SentinelConn {
    client: Mutex<SentinelClient>,
    conn: Mutex<Option<MultiplexedConnection>>,
}

impl Conn {
    /// Builds the connection for `target` without connecting. `timeout` bounds each attempt
    /// and each response.
    pub fn new(target: &Target, tls: &TlsFiles, timeout: Duration) -> Result<Conn, String> {
        let certs = tls.certificates().map_err(|e| e.to_string())?;
        let client_for = |url: &RedisUrl| -> Result<Client, String> {
            match &certs {
                Some(c) => Client::build_with_tls(url.0.as_str(), c.clone()),
                None => Client::open(url.0.as_str()),
            }
            .map_err(|e| format!("{url}: {e}"))
        };
        match target {
            Target::Standalone(url) => {
                let config = ConnectionManagerConfig::new()
                    .set_connection_timeout(Some(timeout))
                    .set_response_timeout(Some(timeout))
                    .set_number_of_retries(1)
                    .set_min_delay(Duration::from_millis(10))
                    .set_max_delay(Duration::from_millis(200));
                let manager = ConnectionManager::new_lazy_with_config(client_for(url)?, config)
                    .map_err(|e| format!("{url}: {e}"))?;
                Ok(Conn::Standalone(manager))
            }
            Target::Cluster(nodes) => {
                let mut builder = ClusterClientBuilder::new(nodes.iter().map(|u| u.0.clone()))
                    .connection_timeout(timeout)
                    .response_timeout(timeout)
                    .retries(3)
                    .min_retry_wait(2)
                    .max_retry_wait(20);
                if let Some(c) = &certs {
                    builder = builder.certs(c.clone());
                }
                let client = builder.build().map_err(|e| format!("cluster nodes: {e}"))?;
                Ok(Conn::Cluster(Arc::new(Lazy {
                    slot: Mutex::new(None),
                    connect: Box::new(move || {
                        let client = client.clone();
                        Box::pin(async move { client.get_async_connection().await })
                    }),
                })))
            }
            Target::Sentinel { nodes, master } => {
                let urls: Vec<String> = nodes.iter().map(|u| u.0.clone()).collect();
                let client =
                    SentinelClient::build(urls, master.as_str(), None, SentinelServerType::Master)
                        .map_err(|e| format!("sentinel nodes: {e}"))?;
                Ok(Conn::Sentinel(Arc::new(SentinelConn {
                    client: Mutex::new(client),
                    conn: Mutex::new(None),
                })))
            }
        }
    }

    /// A live connection, connecting first if needed.
    async fn live(&self, timeout: Duration) -> RedisResult<Live> {
        match self {
            Conn::Standalone(m) => Ok(Live::Manager(m.clone())),
            Conn::Cluster(lazy) => Ok(Live::Cluster(lazy.get().await?)),
            Conn::Sentinel(s) => {
                let mut slot = s.conn.lock().await;
                if let Some(c) = slot.as_ref() {
                    return Ok(Live::Mux(c.clone()));
                }
                let config = AsyncConnectionConfig::new()
                    .set_connection_timeout(Some(timeout))
                    .set_response_timeout(Some(timeout));
                let c = s
                    .client
                    .lock()
                    .await
                    .get_async_connection_with_config(&config)
                    .await?;
                *slot = Some(c.clone());
                Ok(Live::Mux(c))
            }
        }
    }

    /// Runs a script invocation (EVALSHA, loading the script on NOSCRIPT).
    pub async fn invoke(
        &self,
        invocation: &ScriptInvocation<'_>,
        timeout: Duration,
    ) -> RedisResult<Vec<i64>> {
        let mut live = self.live(timeout).await?;
        invocation.invoke_async(&mut live).await
    }

    /// PING, to learn whether Redis is reachable without touching any counter.
    pub async fn ping(&self, timeout: Duration) -> RedisResult<()> {
        let mut live = self.live(timeout).await?;
        redis::cmd("PING")
            .query_async::<String>(&mut live)
            .await
            .map(|_| ())
    }

    /// Forgets a cached connection after errors that suggest it is dead (or, for Sentinel,
    /// that the master moved), so the next call connects afresh.
    pub async fn on_error(&self, err: &redis::RedisError) {
        let dead = err.is_io_error()
            || err.is_connection_dropped()
            || err.is_connection_refusal()
            || err.is_timeout()
            || err.kind() == redis::ErrorKind::Server(redis::ServerErrorKind::ReadOnly);
        match self {
            Conn::Cluster(lazy) if dead => lazy.reset().await,
            Conn::Sentinel(s) if dead => *s.conn.lock().await = None,
            _ => {}
        }
    }
}

/// Whichever connection is live, as one `ConnectionLike`.
enum Live {
    Manager(ConnectionManager),
    Cluster(ClusterConnection),
    Mux(MultiplexedConnection),
}

impl redis::aio::ConnectionLike for Live {
    fn req_packed_command<'a>(
        &'a mut self,
        cmd: &'a redis::Cmd,
    ) -> redis::RedisFuture<'a, redis::Value> {
        match self {
            Live::Manager(c) => c.req_packed_command(cmd),
            Live::Cluster(c) => c.req_packed_command(cmd),
            Live::Mux(c) => c.req_packed_command(cmd),
        }
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        pipeline: &'a redis::Pipeline,
        offset: usize,
        count: usize,
    ) -> redis::RedisFuture<'a, Vec<redis::Value>> {
        match self {
            Live::Manager(c) => c.req_packed_commands(pipeline, offset, count),
            Live::Cluster(c) => c.req_packed_commands(pipeline, offset, count),
            Live::Mux(c) => c.req_packed_commands(pipeline, offset, count),
        }
    }

    fn get_db(&self) -> i64 {
        match self {
            Live::Manager(c) => c.get_db(),
            Live::Cluster(c) => c.get_db(),
            Live::Mux(c) => c.get_db(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn passwords_never_show() {
        let cases = [
            ("redis://:secret@host:6379/0", "redis://:***@host:6379/0"),
            (
                "redis://user:secret@host:6379",
                "redis://user:***@host:6379",
            ),
            ("rediss://token@host", "rediss://***@host"),
            ("redis://host:6379", "redis://host:6379"),
            ("redis://u:p@ss@host/1", "redis://u:***@host/1"),
        ];
        for (url, shown) in cases {
            let u = RedisUrl(url.into());
            assert_eq!(u.to_string(), shown);
            assert!(!format!("{u:?}").contains("secret"));
        }
    }
}
