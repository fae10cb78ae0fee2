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
use redis::sentinel::{SentinelClient, SentinelClientBuilder, SentinelServerType};
use redis::{
    AsyncConnectionConfig, Client, IntoConnectionInfo, RedisError, RedisResult, TlsCertificates,
    TlsMode,
};
use tokio::sync::Mutex;

use crate::limiter::BoxFuture;

/// A Redis URL, parsed so that its user information can never be printed: `Debug` and
/// `Display` show `user:***`, and the password is only handed to the Redis client.
///
/// The user information is everything between `://` and the **last** `@` (a host, port or
/// database number never contains one), so a password with an unencoded `/`, `@`, `?` or `#`
/// is still recognised as a password, redacted, and percent-encoded before connecting.
#[derive(Clone, PartialEq, Eq)]
pub struct RedisUrl {
    scheme: String,
    /// (user, password) as the credentials themselves (the URL's `%XX` escapes decoded),
    /// `None` when the URL has no `@`.
    userinfo: Option<(String, Option<String>)>,
    /// host:port and anything after it (`/db`).
    rest: String,
}

/// Why a Redis URL was refused. Never carries the URL's password.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("expected redis://[user:pass@]host:port[/db] or rediss://…, got {shown}")]
pub struct UrlError {
    shown: String,
}

/// Percent-encodes `s` for the user information of a URL. `s` is the credential itself, so
/// every `%` is encoded too: a password `x%41y` reaches Redis as `x%41y`, never as `xAy`.
fn encode_userinfo(s: &str) -> String {
    encode(s, b"-._~!$&'()*+,;=")
}

/// Decodes the `%XX` escapes of a URL's user information into the credential they stand for.
/// A `%` not followed by two hex digits is kept as written; so is a result that is not UTF-8.
fn decode_userinfo(s: &str) -> String {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let hex = |b: u8| (b as char).to_digit(16).map(|d| d as u8);
        match (
            bytes[i],
            bytes.get(i + 1).copied().and_then(hex),
            bytes.get(i + 2).copied().and_then(hex),
        ) {
            (b'%', Some(hi), Some(lo)) => {
                out.push(hi << 4 | lo);
                i += 3;
            }
            (b, _, _) => {
                out.push(b);
                i += 1;
            }
        }
    }
    String::from_utf8(out).unwrap_or_else(|_| s.to_owned())
}

/// Percent-encodes `s` for a query parameter's value.
fn encode_query(s: &str) -> String {
    encode(s, b"-._~")
}

fn encode(s: &str, keep: &[u8]) -> String {
    let mut out = String::with_capacity(s.len());
    for &b in s.as_bytes() {
        if b.is_ascii_alphanumeric() || keep.contains(&b) {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

impl RedisUrl {
    /// Parses `redis://…` or `rediss://…`.
    pub fn parse(s: &str) -> Result<RedisUrl, UrlError> {
        let (scheme, after) = match s.split_once("://") {
            Some((scheme @ ("unix" | "redis+unix"), path)) if path.starts_with('/') => {
                // A Unix socket: a path, no user information.
                return Ok(RedisUrl {
                    scheme: scheme.to_owned(),
                    userinfo: None,
                    rest: path.to_owned(),
                });
            }
            Some((scheme @ ("redis" | "rediss"), after)) => (scheme, after),
            _ => {
                return Err(UrlError {
                    shown: if s.contains('@') {
                        "a value with user information (not shown)".into()
                    } else {
                        format!("'{s}'")
                    },
                });
            }
        };
        let (userinfo, rest) = match after.rfind('@') {
            Some(at) => {
                let (user, pass) = match after[..at].split_once(':') {
                    Some((u, p)) => (decode_userinfo(u), Some(decode_userinfo(p))),
                    None => (decode_userinfo(&after[..at]), None),
                };
                (Some((user, pass)), &after[at + 1..])
            }
            None => (None, after),
        };
        let url = RedisUrl {
            scheme: scheme.to_owned(),
            userinfo,
            rest: rest.to_owned(),
        };
        if rest.is_empty() || rest.starts_with(['/', ':']) {
            return Err(UrlError {
                shown: url.redacted(),
            });
        }
        Ok(url)
    }

    /// Whether the URL asks for TLS (`rediss://`).
    pub fn is_tls(&self) -> bool {
        self.scheme == "rediss"
    }

    /// The same URL over TLS (`rediss://`); a Unix socket stays as it is.
    pub fn with_tls(mut self) -> RedisUrl {
        if self.scheme == "redis" {
            self.scheme = "rediss".into();
        }
        self
    }

    /// Whether the URL carries a user or password.
    pub fn has_credentials(&self) -> bool {
        self.userinfo.is_some()
    }

    /// The same URL with `credentials` as its user information when it has none of its own.
    pub fn with_default_credentials(&self, credentials: &Credentials) -> RedisUrl {
        let mut url = self.clone();
        if url.userinfo.is_none() && credentials.password.is_some() {
            url.userinfo = Some((
                credentials.username.clone().unwrap_or_default(),
                credentials.password.clone(),
            ));
        }
        url
    }

    /// The URL with any password replaced by `***`: the only way it is ever shown.
    pub fn redacted(&self) -> String {
        match &self.userinfo {
            None => format!("{}://{}", self.scheme, self.rest),
            Some((user, None)) if user.is_empty() => format!("{}://{}", self.scheme, self.rest),
            Some((_, None)) => format!("{}://***@{}", self.scheme, self.rest),
            Some((user, Some(_))) => format!("{}://{user}:***@{}", self.scheme, self.rest),
        }
    }

    /// The URL as the Redis client reads it, user information percent-encoded (for a Unix
    /// socket, as the `user` and `pass` query parameters the client reads there).
    fn for_client(&self) -> String {
        if self.scheme.ends_with("unix") {
            let mut s = format!("{}://{}", self.scheme, self.rest);
            if let Some((user, pass)) = &self.userinfo {
                let mut sep = if self.rest.contains('?') { '&' } else { '?' };
                if !user.is_empty() {
                    s.push_str(&format!("{sep}user={}", encode_query(user)));
                    sep = '&';
                }
                if let Some(p) = pass {
                    s.push_str(&format!("{sep}pass={}", encode_query(p)));
                }
            }
            return s;
        }
        match &self.userinfo {
            None => format!("{}://{}", self.scheme, self.rest),
            Some((user, pass)) => {
                let mut s = format!("{}://{}", self.scheme, encode_userinfo(user));
                if let Some(p) = pass {
                    s.push(':');
                    s.push_str(&encode_userinfo(p));
                }
                s.push('@');
                s.push_str(&self.rest);
                s
            }
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

/// A user name and password given apart from a URL (`--redis-password`, or a Secret through
/// the environment). Never shown.
#[derive(Clone, Default, PartialEq, Eq)]
pub struct Credentials {
    /// ACL user; `None` for the default user.
    pub username: Option<String>,
    /// Password; `None` for no AUTH.
    pub password: Option<String>,
}

impl fmt::Debug for Credentials {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Credentials")
            .field("username", &self.username)
            .field("password", &self.password.as_ref().map(|_| "***"))
            .finish()
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
    pub fn new(target: &Target, tls: &TlsFiles, timeout: Duration) -> Result<Conn, SetupError> {
        let certs = tls.certificates()?;
        let failed = |node: String| move |source| SetupError::Client { node, source };
        let client_for = |url: &RedisUrl| -> Result<Client, SetupError> {
            match &certs {
                Some(c) => Client::build_with_tls(url.for_client(), c.clone()),
                None => Client::open(url.for_client()),
            }
            .map_err(failed(url.to_string()))
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
                    .map_err(failed(url.to_string()))?;
                Ok(Conn::Standalone(manager))
            }
            Target::Cluster(nodes) => {
                let mut builder = ClusterClientBuilder::new(nodes.iter().map(|u| u.for_client()))
                    .connection_timeout(timeout)
                    .response_timeout(timeout)
                    // MOVED, ASK and TRYAGAIN (a slot mid-migration) are retried with backoff
                    // 2, 4, 8, 16, 20, 20 ms: about 70 ms, within the call's budget, which
                    // bounds the whole call anyway.
                    .retries(6)
                    .min_retry_wait(2)
                    .max_retry_wait(20);
                if let Some(c) = &certs {
                    builder = builder.certs(c.clone());
                }
                let client = builder.build().map_err(failed("cluster nodes".into()))?;
                Ok(Conn::Cluster(Arc::new(Lazy {
                    slot: Mutex::new(None),
                    connect: Box::new(move || {
                        let client = client.clone();
                        Box::pin(async move { client.get_async_connection().await })
                    }),
                })))
            }
            Target::Sentinel {
                nodes,
                master,
                master_credentials,
                master_tls,
            } => {
                let mut addrs = Vec::with_capacity(nodes.len());
                for url in nodes {
                    let info = url
                        .for_client()
                        .into_connection_info()
                        .map_err(failed(url.to_string()))?;
                    addrs.push(info.addr().clone());
                }
                let first = nodes.first().ok_or(SetupError::NoSentinels)?;
                let mut builder =
                    SentinelClientBuilder::new(addrs, master.as_str(), SentinelServerType::Master)
                        .map_err(failed("sentinel nodes".into()))?;
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
                    if let Some(c) = &certs {
                        builder = builder.set_client_to_sentinel_certificates(c.clone());
                    }
                }
                // The master's, from their own flags.
                if let Some(user) = &master_credentials.username {
                    builder = builder.set_client_to_redis_username(user);
                }
                if let Some(pass) = &master_credentials.password {
                    builder = builder.set_client_to_redis_password(pass);
                }
                if *master_tls {
                    builder = builder.set_client_to_redis_tls_mode(TlsMode::Secure);
                    if let Some(c) = &certs {
                        builder = builder.set_client_to_redis_certificates(c.clone());
                    }
                }
                let client = builder.build().map_err(failed("sentinel nodes".into()))?;
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

    /// Sends one command and reads its reply.
    pub async fn query<T: redis::FromRedisValue>(
        &self,
        cmd: &redis::Cmd,
        timeout: Duration,
    ) -> RedisResult<T> {
        let mut live = self.live(timeout).await?;
        cmd.query_async(&mut live).await
    }

    /// DEL of one key; how many keys it removed.
    pub async fn del(&self, key: &[u8], timeout: Duration) -> RedisResult<usize> {
        let mut live = self.live(timeout).await?;
        redis::cmd("DEL")
            .arg(key)
            .query_async::<usize>(&mut live)
            .await
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
            ("redis://:se/cret@host:6379", "redis://:***@host:6379"),
            (
                "redis://:se/cr@t?#x@host:6379/2",
                "redis://:***@host:6379/2",
            ),
            ("redis://u:a/b/secret@h", "redis://u:***@h"),
        ];
        for (url, shown) in cases {
            let u = RedisUrl::parse(url).unwrap();
            assert_eq!(u.to_string(), shown);
            assert!(!format!("{u:?}").contains("secret"), "{u:?}");
            assert!(!format!("{u:?}").contains("se/"), "{u:?}");
        }
        for bad in [
            "http://:secret@h",
            "host:6379",
            "redis://:secret@",
            "redis://",
        ] {
            let err = RedisUrl::parse(bad).unwrap_err().to_string();
            assert!(!err.contains("secret"), "{err}");
        }
    }

    #[test]
    fn unix_sockets_take_credentials_as_query_parameters() {
        let u = RedisUrl::parse("unix:///run/redis.sock")
            .unwrap()
            .with_default_credentials(&Credentials {
                username: None,
                password: Some("a&b=c".into()),
            })
            .with_tls();
        assert_eq!(u.to_string(), "unix://:***@/run/redis.sock");
        let info = u.for_client().into_connection_info().unwrap();
        assert_eq!(info.redis_settings().password(), Some("a&b=c"));
    }

    #[test]
    fn a_password_given_apart_from_a_url_reaches_redis_byte_for_byte() {
        let given = Credentials {
            username: Some("u%20".into()),
            password: Some("x%41y%".into()),
        };
        let u = RedisUrl::parse("redis://127.0.0.1:6379")
            .unwrap()
            .with_default_credentials(&given);
        let info = u.for_client().into_connection_info().unwrap();
        assert_eq!(info.redis_settings().password(), Some("x%41y%"));
        assert_eq!(info.redis_settings().username(), Some("u%20"));
        // Inside a URL, `%41` is an escape and stands for `A`.
        let u = RedisUrl::parse("redis://:x%41y@127.0.0.1:6379").unwrap();
        let info = u.for_client().into_connection_info().unwrap();
        assert_eq!(info.redis_settings().password(), Some("xAy"));
    }

    #[test]
    fn unencoded_passwords_reach_the_client_encoded() {
        let u = RedisUrl::parse("redis://us er:p/a@ss%2Fw?#@127.0.0.1:6379/3").unwrap();
        assert_eq!(
            u.for_client(),
            "redis://us%20er:p%2Fa%40ss%2Fw%3F%23@127.0.0.1:6379/3"
        );
        let info = u.for_client().into_connection_info().unwrap();
        assert_eq!(info.redis_settings().password(), Some("p/a@ss/w?#"));
        assert_eq!(info.redis_settings().username(), Some("us er"));
        assert_eq!(info.redis_settings().db(), 3);
    }
}
