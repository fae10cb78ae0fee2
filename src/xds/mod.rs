//! Rate-limit config over xDS, as Envoy Gateway serves it to envoyproxy/ratelimit: one ADS
//! State-of-the-World stream (`StreamAggregatedResources`) subscribed to every
//! `RateLimitConfig` (a wildcard subscription), with the node on the first request of each
//! stream.
//!
//! Each response is the whole state: one `RateLimitConfig` per domain. It is converted to the
//! same snapshot a directory of files gives ([`convert`]), by the same checks, and handed on in
//! one piece, or refused in one piece: an accepted response is ACKed (its version and nonce
//! echoed), a refused one NACKed (the last accepted version, the refused nonce and why, naming
//! the config), and the previous snapshot stays in force. A control plane that resends a
//! refused snapshot gets a NACK each time. When the stream ends or cannot be opened, it is
//! opened again after envoyproxy/ratelimit's backoff, the last snapshot staying in force.
//!
//! Every wait has an end ([`Deadlines`]): opening a stream (TCP, TLS, HTTP/2 and the server's
//! answer to the stream's request), its first response, and, once it is open, HTTP/2 PINGs and
//! TCP keepalive on the connection: a control plane that accepts TCP and says nothing, or
//! vanishes mid-stream, is left and tried again. A response over the size limit cannot be
//! read, so it cannot be NACKed (its nonce is inside it): the stream is cancelled, the refusal
//! counted as a failed load and logged once for as long as the same refusal repeats, and the
//! stream reopened after the backoff, asking for the last accepted version.

mod convert;

use std::collections::HashMap;
use std::path::PathBuf;
use std::time::Duration;

use envoy_types::pb::envoy::config::core::v3::Node;
use envoy_types::pb::envoy::service::discovery::v3::aggregated_discovery_service_client::AggregatedDiscoveryServiceClient;
use envoy_types::pb::envoy::service::discovery::v3::{DiscoveryRequest, DiscoveryResponse};
use envoy_types::pb::google::protobuf::{Struct, Value, value::Kind};
use envoy_types::pb::google::rpc::Status;
use prost::Message;
use tonic::transport::{Certificate, ClientTlsConfig, Endpoint, Identity};

use crate::config::{CompileOptions, Domains, Refused, Snapshot};

/// The generated `ratelimit.config.ratelimit.v3` messages (proto/ratelimit/).
pub mod pb {
    tonic::include_proto!("ratelimit.config.ratelimit.v3");
}

/// The resource type ratelimitd subscribes to.
pub const TYPE_URL: &str = "type.googleapis.com/ratelimit.config.ratelimit.v3.RateLimitConfig";

/// TCP keepalive on the connection to the control plane: idle time before the first probe,
/// the time between probes, and how many go unanswered before the connection is dropped. The
/// kernel's, so invisible to a gRPC server's ping policy: a dead peer host is noticed within
/// about 90 s even with HTTP/2 PINGs minutes apart.
const TCP_KEEPALIVE: (Duration, Duration, u32) =
    (Duration::from_secs(60), Duration::from_secs(10), 3);

/// How long each wait on the control plane may last.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Deadlines {
    /// Opening a stream: TCP, TLS, HTTP/2 and the server's answer to the stream's request.
    pub(crate) connect: Duration,
    /// The first response on an open stream.
    pub(crate) first_response: Duration,
    /// Between HTTP/2 PINGs on the connection.
    pub(crate) keepalive_interval: Duration,
    /// For a PING's answer, before the connection is given up.
    pub(crate) keepalive_timeout: Duration,
}

/// Where the config comes from and how to ask for it.
#[derive(Clone, Debug)]
pub(crate) struct XdsOptions {
    /// The control plane, as a URI (`http://host:port`).
    pub(crate) server: String,
    /// `node.id`: the control plane serves the snapshot it keeps for this id.
    pub(crate) node_id: String,
    /// `node.metadata`, as string values.
    pub(crate) node_metadata: Vec<(String, String)>,
    /// gRPC metadata sent with the stream.
    pub(crate) headers: Vec<(String, String)>,
    /// Pause between attempts to open the stream.
    pub(crate) backoff: Backoff,
    /// Largest response accepted.
    pub(crate) max_message_bytes: usize,
    /// How long each wait may last.
    pub(crate) deadlines: Deadlines,
    /// TLS to the control plane, if any.
    pub(crate) tls: Option<XdsTls>,
}

/// TLS to the control plane: the CA that signs its certificate, this client's certificate
/// (Envoy Gateway requires one), and the name to verify the server's certificate against.
/// The files are read at every connection attempt, so renewed certificates are picked up.
#[derive(Clone, Debug)]
pub(crate) struct XdsTls {
    /// PEM CA bundle.
    pub(crate) ca: PathBuf,
    /// PEM client certificate chain and key, both or neither.
    pub(crate) identity: Option<(PathBuf, PathBuf)>,
    /// The name the server's certificate must carry; by default the server URL's host.
    pub(crate) server_name: Option<String>,
}

impl XdsTls {
    fn config(&self) -> Result<ClientTlsConfig, StreamError> {
        let read = |p: &PathBuf| {
            std::fs::read(p).map_err(|e| StreamError::TlsFile(format!("{}: {e}", p.display())))
        };
        let mut config =
            ClientTlsConfig::new().ca_certificate(Certificate::from_pem(read(&self.ca)?));
        if let Some((cert, key)) = &self.identity {
            config = config.identity(Identity::from_pem(read(cert)?, read(key)?));
        }
        if let Some(name) = &self.server_name {
            config = config.domain_name(name.clone());
        }
        Ok(config)
    }
}

/// envoyproxy/ratelimit's reconnection backoff (`XDS_CLIENT_BACKOFF_*`), with its arithmetic:
/// attempt `n` waits `initial × factor^n`, drawn between `initial` and that when `jitter` is
/// on, and always within `[initial, max]`. A factor of at most 0 means 2. With that service's
/// defaults (10 s, 60 s, 0.5, jitter) every attempt waits 10 s: a factor below 1 never grows.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct Backoff {
    /// The shortest wait.
    pub(crate) initial: Duration,
    /// The longest wait.
    pub(crate) max: Duration,
    /// The growth factor per attempt.
    pub(crate) factor: f64,
    /// Draw each wait at random between `initial` and the computed one.
    pub(crate) jitter: bool,
}

impl Backoff {
    /// The wait before attempt `attempt` (0 for the first retry).
    fn delay(&self, attempt: u32) -> Duration {
        let factor = if self.factor <= 0.0 { 2.0 } else { self.factor };
        let min = self.initial.as_secs_f64();
        let mut d = min * factor.powi(attempt.min(64) as i32);
        if self.jitter {
            // A fresh RandomState is randomly keyed: enough randomness for a jitter, without a
            // random-number crate.
            let r = std::hash::BuildHasher::hash_one(&std::hash::RandomState::new(), attempt);
            d = (r as f64 / u64::MAX as f64) * (d - min) + min;
        }
        let d = Duration::try_from_secs_f64(d).unwrap_or(self.max);
        d.clamp(self.initial, self.max.max(self.initial))
    }
}

/// A response the client refused: why, and whether to say so (a refusal that repeats one
/// already said, such as the same oversized snapshot on every reconnect, is only counted).
pub(crate) struct Refusal<'a> {
    /// Why, naming the config or the limit.
    pub(crate) why: &'a str,
    /// Whether to log it.
    pub(crate) say: bool,
}

/// Runs the ADS client until the task is aborted. `accepted` receives every snapshot the
/// client accepts, in order; `refused` every response it refuses (NACKed, or too large to
/// read).
pub(crate) async fn run(
    options: XdsOptions,
    compile: CompileOptions,
    mut accepted: impl FnMut(Snapshot, &str) + Send,
    mut refused: impl FnMut(Refusal<'_>) + Send,
) {
    let mut attempt = 0;
    // The version of the last accepted response: sent with every NACK, across streams.
    let mut version = String::new();
    // The last oversized response's refusal, said once until a response is accepted.
    let mut oversized: Option<String> = None;
    loop {
        let mut accept = |snapshot: Snapshot, version: &str| {
            oversized = None;
            accepted(snapshot, version);
        };
        let mut nack = |why: &str| refused(Refusal { why, say: true });
        let ended = stream(
            &options,
            compile,
            &mut version,
            &mut attempt,
            &mut accept,
            &mut nack,
        )
        .await;
        match ended {
            Ok(()) => tracing::warn!(server = %options.server, "xDS stream closed by the server"),
            Err(StreamError::Oversized(why)) => {
                let say = oversized.as_deref() != Some(why.as_str());
                refused(Refusal { why: &why, say });
                oversized = Some(why);
            }
            Err(e) => tracing::warn!(server = %options.server, error = %e, "xDS stream failed"),
        }
        let wait = options.backoff.delay(attempt);
        attempt = attempt.saturating_add(1);
        tracing::info!(?wait, "reconnecting to the xDS server");
        tokio::time::sleep(wait).await;
    }
}

/// Why a stream ended.
#[derive(Debug, thiserror::Error)]
enum StreamError {
    #[error("cannot connect: {0}")]
    Connect(#[from] tonic::transport::Error),
    #[error("{0}")]
    Status(#[from] tonic::Status),
    #[error("invalid header {0}")]
    Header(String),
    #[error("cannot read a TLS file: {0}")]
    TlsFile(String),
    #[error("no stream within {0:?} (--xds-connect-timeout)")]
    OpenTimeout(Duration),
    #[error("no response within {0:?} of opening the stream (--xds-response-timeout)")]
    ResponseTimeout(Duration),
    #[error("{0}")]
    Oversized(String),
}

/// One stream: opens it, then answers each response until it ends.
async fn stream(
    options: &XdsOptions,
    compile: CompileOptions,
    version: &mut String,
    attempt: &mut u32,
    accepted: &mut (impl FnMut(Snapshot, &str) + Send),
    refused: &mut (impl FnMut(&str) + Send),
) -> Result<(), StreamError> {
    let d = options.deadlines;
    let mut endpoint = Endpoint::from_shared(options.server.clone())?
        .connect_timeout(d.connect)
        .http2_keep_alive_interval(d.keepalive_interval)
        .keep_alive_timeout(d.keepalive_timeout)
        .tcp_keepalive(Some(TCP_KEEPALIVE.0))
        .tcp_keepalive_interval(Some(TCP_KEEPALIVE.1))
        .tcp_keepalive_retries(Some(TCP_KEEPALIVE.2));
    if let Some(tls) = &options.tls {
        endpoint = endpoint.tls_config(tls.config()?)?;
    }
    // Opening, all of it within the connect deadline.
    let opened_by = tokio::time::Instant::now() + d.connect;
    let open_timeout = |_| StreamError::OpenTimeout(d.connect);
    let channel = tokio::time::timeout_at(opened_by, endpoint.connect())
        .await
        .map_err(open_timeout)??;
    let mut client = AggregatedDiscoveryServiceClient::new(channel)
        .max_decoding_message_size(options.max_message_bytes);
    let (tx, rx) = tokio::sync::mpsc::channel::<DiscoveryRequest>(4);
    // The first request of every stream carries the node; ACKs and NACKs do not need it.
    let first = DiscoveryRequest {
        version_info: version.clone(),
        node: Some(node(options)),
        type_url: TYPE_URL.to_owned(),
        ..Default::default()
    };
    // The channel holds four: a send cannot wait here, before the stream reads any.
    let _ = tx.send(first).await;
    let requests =
        futures_util::stream::unfold(rx, |mut rx| async move { rx.recv().await.map(|r| (r, rx)) });
    let mut request = tonic::Request::new(requests);
    for (k, v) in &options.headers {
        let key = tonic::metadata::MetadataKey::from_bytes(k.as_bytes())
            .map_err(|_| StreamError::Header(k.clone()))?;
        let value = v.parse().map_err(|_| StreamError::Header(k.clone()))?;
        request.metadata_mut().insert(key, value);
    }
    let mut responses =
        tokio::time::timeout_at(opened_by, client.stream_aggregated_resources(request))
            .await
            .map_err(open_timeout)??
            .into_inner();
    tracing::info!(server = %options.server, node = %options.node_id, "xDS stream open");
    let mut first = Some(tokio::time::Instant::now() + d.first_response);
    loop {
        let next = match first.take() {
            Some(by) => tokio::time::timeout_at(by, responses.message())
                .await
                .map_err(|_| StreamError::ResponseTimeout(d.first_response))?,
            None => responses.message().await,
        };
        let response = match next {
            Ok(Some(response)) => response,
            Ok(None) => break,
            Err(status) if is_oversized(&status) => {
                return Err(StreamError::Oversized(format!(
                    "xDS response refused unread: {} (--xds-max-message-bytes)",
                    status.message()
                )));
            }
            Err(status) => return Err(status.into()),
        };
        *attempt = 0;
        let reply = match snapshot_of(&response, compile) {
            Ok(snapshot) => {
                accepted(snapshot, &response.version_info);
                version.clone_from(&response.version_info);
                DiscoveryRequest {
                    version_info: response.version_info,
                    type_url: TYPE_URL.to_owned(),
                    response_nonce: response.nonce,
                    ..Default::default()
                }
            }
            Err(why) => {
                refused(&why);
                DiscoveryRequest {
                    version_info: version.clone(),
                    type_url: TYPE_URL.to_owned(),
                    response_nonce: response.nonce,
                    error_detail: Some(Status {
                        // google.rpc.Code INVALID_ARGUMENT: the config, not the stream, is bad.
                        code: 3,
                        message: why,
                        details: Vec::new(),
                    }),
                    ..Default::default()
                }
            }
        };
        if tx.send(reply).await.is_err() {
            break; // the request side ended with the stream
        }
    }
    Ok(())
}

/// Whether `status` is the client's own refusal of a message over its decoding limit (tonic
/// says so with OUT_OF_RANGE; a server's OUT_OF_RANGE would carry its own words).
fn is_oversized(status: &tonic::Status) -> bool {
    status.code() == tonic::Code::OutOfRange
        && status.message().contains("message length too large")
}

/// The node this client presents.
fn node(options: &XdsOptions) -> Node {
    let fields: HashMap<String, Value> = options
        .node_metadata
        .iter()
        .map(|(k, v)| {
            let value = Value {
                kind: Some(Kind::StringValue(v.clone())),
            };
            (k.clone(), value)
        })
        .collect();
    Node {
        id: options.node_id.clone(),
        metadata: Some(Struct { fields }),
        user_agent_name: "ratelimitd".to_owned(),
        ..Default::default()
    }
}

/// The snapshot a response describes, or why it is refused.
fn snapshot_of(response: &DiscoveryResponse, compile: CompileOptions) -> Result<Snapshot, String> {
    if response.type_url != TYPE_URL {
        return Err(format!(
            "unexpected resource type '{}' (expected {TYPE_URL})",
            response.type_url
        ));
    }
    // Each domain with the name of the config that gave it.
    let mut domains = Domains::new(compile.merge_domains);
    for (i, resource) in response.resources.iter().enumerate() {
        if resource.type_url != TYPE_URL {
            return Err(format!(
                "resources[{i}]: unexpected type '{}' (expected {TYPE_URL})",
                resource.type_url
            ));
        }
        let config = pb::RateLimitConfig::decode(resource.value.as_slice())
            .map_err(|e| format!("resources[{i}]: not a RateLimitConfig: {e}"))?;
        let name = config.name.clone();
        let domain = convert::domain(config, compile).map_err(|e| e.to_string())?;
        let domain_name = domain.name.clone();
        domains
            .add(domain, name.clone())
            .map_err(|refused| match refused {
                Refused::Domain(other) => format!(
                    "config '{name}': duplicate domain '{domain_name}' (also in config '{other}')"
                ),
                Refused::Descriptor(other, path, _) => format!(
                    "config '{name}': duplicate descriptor '{path}' in domain '{domain_name}' (also in config '{other}')"
                ),
            })?;
    }
    Ok(domains.into_snapshot())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_follows_the_reference_arithmetic() {
        let reference = Backoff {
            initial: Duration::from_secs(10),
            max: Duration::from_secs(60),
            factor: 0.5,
            jitter: true,
        };
        for attempt in 0..10 {
            assert_eq!(reference.delay(attempt), Duration::from_secs(10));
        }
        let doubling = Backoff {
            initial: Duration::from_millis(100),
            max: Duration::from_secs(1),
            factor: 2.0,
            jitter: false,
        };
        let waits: Vec<u128> = (0..6).map(|a| doubling.delay(a).as_millis()).collect();
        assert_eq!(waits, [100, 200, 400, 800, 1000, 1000]);
        let jittered = Backoff {
            jitter: true,
            ..doubling
        };
        for attempt in 0..40 {
            let d = jittered.delay(attempt);
            assert!(d >= doubling.initial && d <= doubling.max, "{d:?}");
        }
    }
}
