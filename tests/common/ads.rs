//! A small ADS server on loopback (state of the world): it keeps one snapshot (a version and
//! its `RateLimitConfig`s), pushes it to every open stream when it changes, can resend a
//! refused snapshot at once as go-control-plane's cache does, and records every request it
//! receives. Also Envoy Gateway's `RateLimitConfig`s read from their YAML rendering.

use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use envoy_types::pb::envoy::service::discovery::v3::aggregated_discovery_service_server::{
    AggregatedDiscoveryService, AggregatedDiscoveryServiceServer,
};
use envoy_types::pb::envoy::service::discovery::v3::{
    DeltaDiscoveryRequest, DeltaDiscoveryResponse, DiscoveryRequest, DiscoveryResponse,
};
use envoy_types::pb::google::protobuf::Any;
use futures_util::{Stream, StreamExt};
use prost::Message;
use ratelimitd::testing::XDS_TYPE_URL;
use ratelimitd::testing::rls_conf as pb;
use tokio::net::TcpListener;
use tokio::sync::mpsc;

/// What the ADS server holds and has seen.
#[derive(Default)]
pub(crate) struct State {
    pub(crate) version: String,
    pub(crate) resources: Vec<Any>,
    /// Every request received, in order.
    pub(crate) requests: Vec<DiscoveryRequest>,
    /// Streams opened so far.
    pub(crate) streams: usize,
    /// How many NACKs to answer by resending the refused snapshot at once.
    pub(crate) resend_on_nack: usize,
    pub(crate) nonce: u64,
    /// The open streams' senders.
    pub(crate) open: Vec<mpsc::Sender<Result<DiscoveryResponse, tonic::Status>>>,
}

impl State {
    pub(crate) fn response(&mut self) -> DiscoveryResponse {
        self.nonce += 1;
        DiscoveryResponse {
            version_info: self.version.clone(),
            resources: self.resources.clone(),
            type_url: XDS_TYPE_URL.to_owned(),
            nonce: self.nonce.to_string(),
            ..Default::default()
        }
    }
}

#[derive(Clone)]
pub(crate) struct Ads(
    pub(crate) Arc<Mutex<State>>,
    pub(crate) tokio::sync::watch::Sender<bool>,
);

impl Default for Ads {
    fn default() -> Ads {
        Ads(Arc::default(), tokio::sync::watch::channel(false).0)
    }
}

type Responses = Pin<Box<dyn Stream<Item = Result<DiscoveryResponse, tonic::Status>> + Send>>;

#[tonic::async_trait]
impl AggregatedDiscoveryService for Ads {
    type StreamAggregatedResourcesStream = Responses;

    async fn stream_aggregated_resources(
        &self,
        request: tonic::Request<tonic::Streaming<DiscoveryRequest>>,
    ) -> Result<tonic::Response<Responses>, tonic::Status> {
        let headers = request.metadata().clone();
        let mut requests = request.into_inner();
        let (tx, rx) = mpsc::channel(16);
        {
            let mut s = self.0.lock().unwrap();
            s.streams += 1;
            s.open.push(tx.clone());
        }
        let state = self.0.clone();
        let mut killed = self.1.subscribe();
        tokio::spawn(async move {
            loop {
                let next = tokio::select! {
                    next = requests.next() => next,
                    _ = killed.wait_for(|k| *k) => break,
                };
                let Some(Ok(mut req)) = next else { break };
                // The stream's headers travel with its first request, for the tests to see.
                if let Some(v) = headers.get("x-test")
                    && req.node.is_some()
                {
                    req.resource_names
                        .push(format!("x-test={}", v.to_str().unwrap()));
                }
                let reply = {
                    let mut s = state.lock().unwrap();
                    let first = req.response_nonce.is_empty();
                    let nack = req.error_detail.is_some();
                    s.requests.push(req);
                    if (first && !s.version.is_empty()) || (nack && s.resend_on_nack > 0) {
                        if nack {
                            s.resend_on_nack -= 1;
                        }
                        Some(s.response())
                    } else {
                        None
                    }
                };
                if let Some(r) = reply
                    && tx.send(Ok(r)).await.is_err()
                {
                    break;
                }
            }
        });
        let stream =
            futures_util::stream::unfold(
                rx,
                |mut rx| async move { rx.recv().await.map(|r| (r, rx)) },
            );
        Ok(tonic::Response::new(Box::pin(stream)))
    }

    type DeltaAggregatedResourcesStream =
        Pin<Box<dyn Stream<Item = Result<DeltaDiscoveryResponse, tonic::Status>> + Send>>;

    async fn delta_aggregated_resources(
        &self,
        _: tonic::Request<tonic::Streaming<DeltaDiscoveryRequest>>,
    ) -> Result<tonic::Response<Self::DeltaAggregatedResourcesStream>, tonic::Status> {
        Err(tonic::Status::unimplemented("state of the world only"))
    }
}

/// A running ADS server.
pub(crate) struct AdsServer {
    pub(crate) ads: Ads,
    pub(crate) addr: std::net::SocketAddr,
    task: tokio::task::JoinHandle<()>,
}

impl AdsServer {
    pub(crate) async fn start() -> AdsServer {
        Self::start_on(
            TcpListener::bind("127.0.0.1:0").await.unwrap(),
            Ads::default(),
        )
    }

    pub(crate) fn start_on(listener: TcpListener, ads: Ads) -> AdsServer {
        Self::serve(listener, ads, None)
    }

    /// Over mutual TLS, as Envoy Gateway's xDS server: `certs` from `make_certs`.
    pub(crate) async fn start_tls(certs: &std::path::Path) -> AdsServer {
        let read = |f: &str| std::fs::read(certs.join(f)).unwrap();
        let tls = tonic::transport::ServerTlsConfig::new()
            .identity(tonic::transport::Identity::from_pem(
                read("server.crt"),
                read("server.key"),
            ))
            .client_ca_root(tonic::transport::Certificate::from_pem(read("ca.crt")));
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        Self::serve(listener, Ads::default(), Some(tls))
    }

    pub(crate) fn serve(
        listener: TcpListener,
        ads: Ads,
        tls: Option<tonic::transport::ServerTlsConfig>,
    ) -> AdsServer {
        let addr = listener.local_addr().unwrap();
        let incoming = tonic::transport::server::TcpIncoming::from(listener);
        let service = AggregatedDiscoveryServiceServer::new(ads.clone());
        let task = tokio::spawn(async move {
            let mut builder = tonic::transport::Server::builder();
            if let Some(tls) = tls {
                builder = builder.tls_config(tls).unwrap();
            }
            let _ = builder
                .add_service(service)
                .serve_with_incoming(incoming)
                .await;
        });
        AdsServer { ads, addr, task }
    }

    /// Serves `configs` as `version`, pushing it to every open stream.
    pub(crate) async fn set(&self, version: &str, configs: &[pb::RateLimitConfig]) {
        let (senders, response) = {
            let mut s = self.ads.0.lock().unwrap();
            s.version = version.to_owned();
            s.resources = configs
                .iter()
                .map(|c| Any {
                    type_url: XDS_TYPE_URL.to_owned(),
                    value: c.encode_to_vec(),
                })
                .collect();
            s.open.retain(|tx| !tx.is_closed());
            (s.open.clone(), s.response())
        };
        for tx in senders {
            let _ = tx.send(Ok(response.clone())).await;
        }
    }

    pub(crate) fn requests(&self) -> Vec<DiscoveryRequest> {
        self.ads.0.lock().unwrap().requests.clone()
    }

    pub(crate) fn flags(&self) -> Vec<String> {
        xds_flags(self.addr)
    }

    /// Waits until a request matching `pred` (`what`) has been received; returns it.
    pub(crate) async fn until_request(
        &self,
        what: &str,
        pred: impl Fn(&DiscoveryRequest) -> bool,
    ) -> DiscoveryRequest {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        loop {
            if let Some(r) = self.requests().into_iter().find(|r| pred(r)) {
                return r;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "no {what} within 10 s: {:#?}",
                self.requests()
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
}

impl AdsServer {
    /// The nonce of the last response made.
    pub(crate) fn nonce(&self) -> String {
        self.ads.0.lock().unwrap().nonce.to_string()
    }
}

/// Stopping the server ends its streams, as a control plane going away does.
impl Drop for AdsServer {
    fn drop(&mut self) {
        self.ads.1.send_replace(true);
        self.ads.0.lock().unwrap().open.clear();
        self.task.abort();
    }
}

/// Flags for a server following the control plane at `addr`, retrying within a fraction of a
/// second.
pub(crate) fn xds_flags(addr: std::net::SocketAddr) -> Vec<String> {
    vec![
        "--xds-server".into(),
        format!("http://{addr}"),
        "--xds-node-id".into(),
        "test-node".into(),
        "--xds-backoff-initial".into(),
        "50ms".into(),
        "--xds-backoff-max".into(),
        "200ms".into(),
    ]
}

/// One `RateLimitConfig` from its YAML rendering in Envoy Gateway's corpus.
pub(crate) fn pb_config(v: &serde_json::Value) -> pb::RateLimitConfig {
    pb::RateLimitConfig {
        name: v["name"].as_str().unwrap_or_default().into(),
        domain: v["domain"].as_str().unwrap_or_default().into(),
        descriptors: pb_descriptors(&v["descriptors"]),
    }
}

pub(crate) fn pb_descriptors(v: &serde_json::Value) -> Vec<pb::RateLimitDescriptor> {
    let Some(list) = v.as_array() else {
        return Vec::new();
    };
    list.iter()
        .map(|d| pb::RateLimitDescriptor {
            key: d["key"].as_str().unwrap_or_default().into(),
            value: d["value"].as_str().unwrap_or_default().into(),
            rate_limit: d["rate_limit"].is_object().then(|| {
                let l = &d["rate_limit"];
                pb::RateLimitPolicy {
                    unit: pb::RateLimitUnit::from_str_name(l["unit"].as_str().unwrap_or("UNKNOWN"))
                        .expect("a unit name") as i32,
                    requests_per_unit: l["requests_per_unit"].as_u64().unwrap_or(0) as u32,
                    unlimited: l["unlimited"].as_bool().unwrap_or(false),
                    name: l["name"].as_str().unwrap_or_default().into(),
                    replaces: l["replaces"]
                        .as_array()
                        .map(|r| {
                            r.iter()
                                .map(|r| pb::RateLimitReplace {
                                    name: r["name"].as_str().unwrap_or_default().into(),
                                })
                                .collect()
                        })
                        .unwrap_or_default(),
                }
            }),
            descriptors: pb_descriptors(&d["descriptors"]),
            shadow_mode: d["shadow_mode"].as_bool().unwrap_or(false),
            detailed_metric: d["detailed_metric"].as_bool().unwrap_or(false),
            quota_mode: d["quota_mode"].as_bool().unwrap_or(false),
            metadata: None,
        })
        .collect()
}
