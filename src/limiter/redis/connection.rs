//! Connections to every deployment shape: standalone (optionally TLS), Redis Cluster, and a
//! master found through Sentinel. All are multiplexed and pipelined (one connection carries
//! every concurrent request), reconnect by themselves, and never block start-up: the first
//! connection is made on first use, so ratelimitd starts while Redis is down.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use redis::aio::{ConnectionManager, ConnectionManagerConfig, MultiplexedConnection};
use redis::cluster::ClusterClientBuilder;
use redis::cluster_async::ClusterConnection;
use redis::sentinel::{SentinelClient, SentinelClientBuilder, SentinelServerType};
use redis::{
    AsyncConnectionConfig, Client, ConnectionAddr, IntoConnectionInfo, RedisError, RedisResult,
    TlsCertificates, TlsMode,
};
use tokio::sync::Mutex;

pub(crate) use super::url::Credentials;
pub use super::url::RedisUrl;
use crate::limiter::BoxFuture;

/// Where Redis is.
#[derive(Clone, Debug)]
pub(crate) enum Topology {
    /// One server (`redis://` or `rediss://`).
    Standalone(RedisUrl),
    /// Seed nodes of a Redis Cluster.
    Cluster(Vec<RedisUrl>),
    /// Sentinels and the name of the master they watch.
    Sentinel {
        /// Sentinel URLs; their user information and `rediss://` apply to the sentinels only.
        nodes: Vec<RedisUrl>,
        /// `sentinel monitor <name> …`.
        master: String,
        /// Credentials for the master the sentinels name.
        master_credentials: Credentials,
        /// Whether the master is reached over TLS.
        master_tls: bool,
    },
}

/// PEM files for TLS (`rediss://`).
#[derive(Clone, Debug, Default)]
pub(crate) struct RedisTlsFiles {
    /// CA bundle to verify the server with (else the system's roots).
    pub ca: Option<PathBuf>,
    /// Client certificate, for mutual TLS.
    pub cert: Option<PathBuf>,
    /// Client key, for mutual TLS.
    pub key: Option<PathBuf>,
    /// Accept a server certificate whatever names it carries (envoyproxy/ratelimit's
    /// `REDIS_TLS_SKIP_HOSTNAME_VERIFICATION`): its chain is still verified against `ca` (or the
    /// system's roots), its dates and its key usage too; only the name check is skipped. Every
    /// shape: the standalone server, every cluster node, the sentinels and their master.
    pub skip_hostname_verification: bool,
    /// Verify the standalone server's (or the Sentinel master's) certificate against this
    /// name; the URL's host (the address announced) is still the one dialled
    /// (`--redis-tls-server-name`).
    pub server_name: Option<String>,
}

impl RedisTlsFiles {
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

/// Why a Redis connection could not be set up (before any connection is attempted).
#[derive(Debug, thiserror::Error)]
pub enum SetupError {
    /// A TLS file could not be read or parsed.
    #[error("redis TLS files: {0}")]
    Tls(#[from] std::io::Error),
    /// The client refused a node's address or options.
    #[error("{node}: {source}")]
    Client {
        /// The node (redacted) or node list.
        node: String,
        /// The client's reason.
        source: RedisError,
    },
    /// Sentinel without sentinel nodes.
    #[error("no sentinel nodes")]
    NoSentinels,
}

/// How long a connection waits for a response, for calls of `call_budget`. A call whose caller
/// has given up keeps its place until Redis answers it (see `batch.rs`); this bounds that wait,
/// and notices a connection that hangs.
pub(crate) fn response_timeout(call_budget: Duration) -> Duration {
    (call_budget * 10).max(Duration::from_secs(1))
}

/// A connection to whichever shape was configured. Cheap to share.
#[derive(Clone)]
pub(crate) enum Conn {
    /// Auto-reconnecting multiplexed connection.
    Standalone(ConnectionManager),
    /// A connection made on use and remade after errors: a standalone server verified against
    /// another name than the one dialled (the client connects to that name, which its resolver
    /// maps to the URL's host; the connection manager takes no resolver), or the master behind
    /// Sentinel whose certificate's names are not checked ([`FindMaster`]).
    Named(Arc<Lazy<MultiplexedConnection>>),
    /// Cluster client: routes by slot, follows MOVED/ASK, retries TRYAGAIN within its budget.
    Cluster(Arc<Lazy<ClusterConnection>>),
    /// Master found through Sentinel, re-resolved after any connection error.
    Sentinel(Arc<SentinelConn>),
}

/// A connection made on first use and kept; failed attempts are retried on the next use.
pub(crate) struct Lazy<C> {
    slot: Mutex<Option<C>>,
    connect: Box<dyn Fn() -> BoxFuture<'static, RedisResult<C>> + Send + Sync>,
}

impl<C: Clone> Lazy<C> {
    /// A connection `connect` makes on first use, shared.
    fn new(
        connect: impl Fn() -> BoxFuture<'static, RedisResult<C>> + Send + Sync + 'static,
    ) -> Arc<Lazy<C>> {
        Arc::new(Lazy {
            slot: Mutex::new(None),
            connect: Box::new(connect),
        })
    }

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

/// Resolves the name a certificate is verified against to the host the URL names, so that
/// the client dials one and verifies the other (`--redis-tls-server-name`).
struct DialAs {
    name: String,
    host: String,
}

impl redis::io::AsyncDNSResolver for DialAs {
    fn resolve<'a, 'b: 'a>(
        &'a self,
        host: &'b str,
        port: u16,
    ) -> redis::RedisFuture<'a, Box<dyn Iterator<Item = std::net::SocketAddr> + Send + 'a>> {
        let dial = if host == self.name { &self.host } else { host };
        Box::pin(async move {
            let addrs: Vec<std::net::SocketAddr> =
                tokio::net::lookup_host((dial, port)).await?.collect();
            Ok(Box::new(addrs.into_iter()) as Box<dyn Iterator<Item = _> + Send>)
        })
    }
}

/// A client for `url`, with the TLS `certs`; `skip_names`: its certificate's names are not
/// checked (the chain, dates and key usage still are).
fn open(url: &RedisUrl, certs: &Option<TlsCertificates>, skip_names: bool) -> RedisResult<Client> {
    let client = match certs {
        Some(c) => Client::build_with_tls(url.for_client(), c.clone()),
        None => Client::open(url.for_client()),
    }?;
    if !skip_names {
        return Ok(client);
    }
    let info = client.get_connection_info().clone();
    let mut addr = info.addr().clone();
    addr.set_danger_accept_invalid_hostnames(true);
    Client::open(info.set_addr(addr))
}

/// The master a set of sentinels names, found without the redis crate's Sentinel client, whose
/// connection to the master always checks the certificate against the address announced: for
/// `--redis-tls-skip-hostname-verification` and `--redis-tls-server-name` behind Sentinel.
struct FindMaster {
    /// One client per sentinel (its URL's credentials and TLS).
    sentinels: Vec<Client>,
    master: String,
    credentials: Credentials,
    /// The master is reached over TLS.
    tls: bool,
    certs: Option<TlsCertificates>,
    /// Certificates' names are not checked.
    skip_names: bool,
    /// The name the master's certificate is verified against, whatever address it has.
    server_name: Option<String>,
    config: AsyncConnectionConfig,
}

impl FindMaster {
    /// Asks each sentinel in turn where the master is, and connects to the first address that
    /// answers as a master (`ROLE`): a sentinel that has not yet seen a failover may name the
    /// old master, now a replica.
    async fn connect(&self) -> RedisResult<MultiplexedConnection> {
        let mut last = RedisError::from((
            redis::ErrorKind::MasterNameNotFoundBySentinel,
            "no sentinel names the master",
        ));
        for sentinel in &self.sentinels {
            match self.through(sentinel).await {
                Ok(conn) => return Ok(conn),
                Err(e) => last = e,
            }
        }
        Err(last)
    }

    async fn through(&self, sentinel: &Client) -> RedisResult<MultiplexedConnection> {
        let mut ask = sentinel
            .get_multiplexed_async_connection_with_config(&self.config)
            .await?;
        let (host, port): (String, u16) = redis::cmd("SENTINEL")
            .arg("get-master-addr-by-name")
            .arg(&self.master)
            .query_async::<Option<(String, u16)>>(&mut ask)
            .await?
            .ok_or_else(|| {
                RedisError::from((
                    redis::ErrorKind::MasterNameNotFoundBySentinel,
                    "the sentinel does not know the master",
                    self.master.clone(),
                ))
            })?;
        // With a server name the client connects to that name, which the resolver maps to the
        // address announced (as for a standalone server).
        let (dial, config) = match &self.server_name {
            Some(name) => (
                name.clone(),
                self.config.clone().set_dns_resolver(DialAs {
                    name: name.clone(),
                    host,
                }),
            ),
            None if host.contains(':') => (format!("[{host}]"), self.config.clone()),
            None => (host, self.config.clone()),
        };
        let scheme = if self.tls { "rediss" } else { "redis" };
        let url = RedisUrl::parse(&format!("{scheme}://{dial}:{port}"))
            .map_err(|e| {
                RedisError::from((
                    redis::ErrorKind::InvalidClientConfig,
                    "the sentinel named an unusable address",
                    e.to_string(),
                ))
            })?
            .with_default_credentials(&self.credentials);
        let mut conn = open(&url, &self.certs, self.skip_names)?
            .get_multiplexed_async_connection_with_config(&config)
            .await?;
        let role: Vec<redis::Value> = redis::cmd("ROLE").query_async(&mut conn).await?;
        match role.first() {
            Some(redis::Value::BulkString(r)) if r == b"master" => Ok(conn),
            Some(redis::Value::SimpleString(r)) if r == "master" => Ok(conn),
            _ => Err(RedisError::from((
                redis::ErrorKind::Server(redis::ServerErrorKind::ReadOnly),
                "the address the sentinel named is not a master (yet)",
            ))),
        }
    }
}

/// Sentinel-discovered master.
pub(crate) struct SentinelConn {
    client: Mutex<SentinelClient>,
    conn: Mutex<Option<MultiplexedConnection>>,
}

/// The master the sentinels watch, as the flags name it.
struct SentinelMaster<'a> {
    name: &'a str,
    credentials: &'a Credentials,
    tls: bool,
}

/// What every shape of connection is built with: the TLS files (read once) and the call
/// budget. Each method builds one shape.
struct Dial<'a> {
    tls: &'a RedisTlsFiles,
    certs: Option<TlsCertificates>,
    timeout: Duration,
}

impl Dial<'_> {
    fn client(&self, url: &RedisUrl) -> Result<Client, SetupError> {
        open(url, &self.certs, self.tls.skip_hostname_verification).map_err(failed(url))
    }

    fn config(&self) -> AsyncConnectionConfig {
        AsyncConnectionConfig::new()
            .set_connection_timeout(Some(self.timeout))
            .set_response_timeout(Some(response_timeout(self.timeout)))
    }

    /// One server, through a connection manager that reconnects by itself.
    fn standalone(&self, url: &RedisUrl) -> Result<Conn, SetupError> {
        let config = ConnectionManagerConfig::new()
            .set_connection_timeout(Some(self.timeout))
            .set_response_timeout(Some(response_timeout(self.timeout)))
            .set_number_of_retries(1)
            .set_min_delay(Duration::from_millis(10))
            .set_max_delay(Duration::from_millis(200));
        let manager = ConnectionManager::new_lazy_with_config(self.client(url)?, config)
            .map_err(failed(url))?;
        Ok(Conn::Standalone(manager))
    }

    /// One server whose certificate is verified against `name` while the URL's host is
    /// dialled (`--redis-tls-server-name`): the client connects to `name`, which [`DialAs`]
    /// resolves to the host.
    fn standalone_as(&self, url: &RedisUrl, name: &str) -> Result<Conn, SetupError> {
        let info = self.client(url)?.get_connection_info().clone();
        let ConnectionAddr::TcpTls {
            host,
            port,
            insecure,
            tls_params,
        } = info.addr().clone()
        else {
            return Err(SetupError::Client {
                node: url.to_string(),
                source: RedisError::from((
                    redis::ErrorKind::InvalidClientConfig,
                    "--redis-tls-server-name needs a rediss:// URL",
                )),
            });
        };
        let named = info.set_addr(ConnectionAddr::TcpTls {
            host: name.to_owned(),
            port,
            insecure,
            tls_params,
        });
        let client = Client::open(named).map_err(failed(url))?;
        let config = self.config().set_dns_resolver(DialAs {
            name: name.to_owned(),
            host,
        });
        Ok(Conn::Named(Lazy::new(move || {
            let (client, config) = (client.clone(), config.clone());
            Box::pin(async move {
                client
                    .get_multiplexed_async_connection_with_config(&config)
                    .await
            })
        })))
    }

    /// A Redis Cluster from its seed nodes.
    fn cluster(&self, nodes: &[RedisUrl]) -> Result<Conn, SetupError> {
        let mut builder = ClusterClientBuilder::new(nodes.iter().map(|u| u.for_client()))
            .connection_timeout(self.timeout)
            .response_timeout(response_timeout(self.timeout))
            // MOVED, ASK and TRYAGAIN (a slot mid-migration) are retried with backoff
            // 2, 4, 8, 16, 20, 20 ms: about 70 ms, within the call's budget, which
            // bounds the whole call anyway.
            .retries(6)
            .min_retry_wait(2)
            .max_retry_wait(20);
        if let Some(c) = &self.certs {
            builder = builder.certs(c.clone());
        }
        if self.tls.skip_hostname_verification {
            builder = builder.danger_accept_invalid_hostnames(true);
        }
        let client = builder.build().map_err(failed("cluster nodes"))?;
        Ok(Conn::Cluster(Lazy::new(move || {
            let client = client.clone();
            Box::pin(async move { client.get_async_connection().await })
        })))
    }

    /// The master behind Sentinel, found by [`FindMaster`]: for certificates whose names are
    /// not checked, or checked against `--redis-tls-server-name`.
    fn find_master(
        &self,
        nodes: &[RedisUrl],
        master: &SentinelMaster<'_>,
    ) -> Result<Conn, SetupError> {
        // The sentinels' own credentials and TLS come from their URLs.
        let sentinels = nodes
            .iter()
            .map(|url| {
                let certs = if url.is_tls() { &self.certs } else { &None };
                open(url, certs, self.tls.skip_hostname_verification).map_err(failed(url))
            })
            .collect::<Result<Vec<_>, _>>()?;
        if sentinels.is_empty() {
            return Err(SetupError::NoSentinels);
        }
        let find = Arc::new(FindMaster {
            sentinels,
            master: master.name.to_owned(),
            credentials: master.credentials.clone(),
            tls: master.tls,
            certs: self.certs.clone(),
            skip_names: self.tls.skip_hostname_verification,
            server_name: self.tls.server_name.clone(),
            config: self.config(),
        });
        Ok(Conn::Named(Lazy::new(move || {
            let find = find.clone();
            Box::pin(async move { find.connect().await })
        })))
    }

    /// The master behind Sentinel, through the redis crate's Sentinel client.
    fn sentinel(
        &self,
        nodes: &[RedisUrl],
        master: &SentinelMaster<'_>,
    ) -> Result<Conn, SetupError> {
        let mut addrs = Vec::with_capacity(nodes.len());
        for url in nodes {
            let info = url
                .for_client()
                .into_connection_info()
                .map_err(failed(url))?;
            addrs.push(info.addr().clone());
        }
        let first = nodes.first().ok_or(SetupError::NoSentinels)?;
        let mut builder =
            SentinelClientBuilder::new(addrs, master.name, SentinelServerType::Master)
                .map_err(failed("sentinel nodes"))?;
        // The sentinels' own credentials and TLS come from their URLs.
        if let Some((user, pass)) = &first.userinfo {
            if !user.is_empty() {
                builder = builder.set_client_to_sentinel_username(user);
            }
            if let Some(pass) = pass {
                builder = builder.set_client_to_sentinel_password(pass);
            }
        }
        if first.is_tls() {
            builder = builder.set_client_to_sentinel_tls_mode(TlsMode::Secure);
            if let Some(c) = &self.certs {
                builder = builder.set_client_to_sentinel_certificates(c.clone());
            }
        }
        // The master's, from their own flags.
        if let Some(user) = &master.credentials.username {
            builder = builder.set_client_to_redis_username(user);
        }
        if let Some(pass) = &master.credentials.password {
            builder = builder.set_client_to_redis_password(pass);
        }
        if master.tls {
            builder = builder.set_client_to_redis_tls_mode(TlsMode::Secure);
            if let Some(c) = &self.certs {
                builder = builder.set_client_to_redis_certificates(c.clone());
            }
        }
        let client = builder.build().map_err(failed("sentinel nodes"))?;
        Ok(Conn::Sentinel(Arc::new(SentinelConn {
            client: Mutex::new(client),
            conn: Mutex::new(None),
        })))
    }
}

/// A setup error naming `node` (a URL, or which nodes).
fn failed(node: impl std::fmt::Display) -> impl FnOnce(RedisError) -> SetupError {
    let node = node.to_string();
    move |source| SetupError::Client { node, source }
}

/// Whether `err` says the connection is dead (or, for Sentinel, that the master moved): the
/// next call should connect afresh, and a call may be tried again on it.
pub(crate) fn is_dead(err: &redis::RedisError) -> bool {
    err.is_io_error()
        || err.is_connection_dropped()
        || err.is_connection_refusal()
        || err.is_timeout()
        || err.kind() == redis::ErrorKind::Server(redis::ServerErrorKind::ReadOnly)
}

impl Conn {
    /// Builds the connection for `target` without connecting. `timeout` (the call budget)
    /// bounds each connection attempt; responses get [`response_timeout`].
    pub(crate) fn new(
        target: &Topology,
        tls: &RedisTlsFiles,
        timeout: Duration,
    ) -> Result<Conn, SetupError> {
        let dial = Dial {
            certs: tls.certificates()?,
            tls,
            timeout,
        };
        match target {
            Topology::Standalone(url) => match &tls.server_name {
                Some(name) => dial.standalone_as(url, name),
                None => dial.standalone(url),
            },
            Topology::Cluster(nodes) => dial.cluster(nodes),
            Topology::Sentinel {
                nodes,
                master,
                master_credentials,
                master_tls,
            } => {
                let master = SentinelMaster {
                    name: master,
                    credentials: master_credentials,
                    tls: *master_tls,
                };
                if tls.skip_hostname_verification || tls.server_name.is_some() {
                    dial.find_master(nodes, &master)
                } else {
                    dial.sentinel(nodes, &master)
                }
            }
        }
    }

    /// A live connection, connecting first if needed.
    async fn live(&self, timeout: Duration) -> RedisResult<Live> {
        match self {
            Conn::Standalone(m) => Ok(Live::Manager(m.clone())),
            Conn::Cluster(lazy) => Ok(Live::Cluster(lazy.get().await?)),
            Conn::Named(lazy) => Ok(Live::Mux(lazy.get().await?)),
            Conn::Sentinel(s) => {
                let mut slot = s.conn.lock().await;
                if let Some(c) = slot.as_ref() {
                    return Ok(Live::Mux(c.clone()));
                }
                let config = AsyncConnectionConfig::new()
                    .set_connection_timeout(Some(timeout))
                    .set_response_timeout(Some(response_timeout(timeout)));
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

    /// Sends one command and reads its reply.
    pub(crate) async fn query<T: redis::FromRedisValue>(
        &self,
        cmd: &redis::Cmd,
        timeout: Duration,
    ) -> RedisResult<T> {
        let mut live = self.live(timeout).await?;
        cmd.query_async(&mut live).await
    }

    /// DEL of one key; how many keys it removed.
    pub(crate) async fn del(&self, key: &[u8], timeout: Duration) -> RedisResult<usize> {
        let mut live = self.live(timeout).await?;
        redis::cmd("DEL")
            .arg(key)
            .query_async::<usize>(&mut live)
            .await
    }

    /// PING, to learn whether Redis is reachable without touching any counter.
    pub(crate) async fn ping(&self, timeout: Duration) -> RedisResult<()> {
        let mut live = self.live(timeout).await?;
        redis::cmd("PING")
            .query_async::<String>(&mut live)
            .await
            .map(|_| ())
    }

    /// Forgets a cached connection after errors that suggest it is dead (or, for Sentinel,
    /// that the master moved), so the next call connects afresh.
    pub(crate) async fn on_error(&self, err: &redis::RedisError) {
        let dead = is_dead(err);
        match self {
            Conn::Cluster(lazy) if dead => lazy.reset().await,
            Conn::Named(lazy) if dead => lazy.reset().await,
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

/// A client per sentinel of `target` (none for another shape), each with its URL's credentials
/// and TLS: for listening to what the sentinels announce.
pub(crate) fn sentinel_clients(
    target: &Topology,
    tls: &RedisTlsFiles,
) -> Result<Vec<Client>, SetupError> {
    let Topology::Sentinel { nodes, .. } = target else {
        return Ok(Vec::new());
    };
    let certs = tls.certificates()?;
    nodes
        .iter()
        .map(|url| {
            let certs = if url.is_tls() { &certs } else { &None };
            open(url, certs, tls.skip_hostname_verification).map_err(failed(url))
        })
        .collect()
}
