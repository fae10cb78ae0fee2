//! TLS on the gRPC listener: a certificate and key (PEM), and optionally a client CA that
//! every client must present a certificate from (mutual TLS). The files are checked every
//! second and reloaded when they change (a Kubernetes Secret update swaps them under their
//! names); a reload that fails keeps the previous certificate in force and says why in the
//! log. Connections already open keep the certificate they were made with.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use arc_swap::ArcSwap;
use futures_util::Stream;
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinHandle;
use tokio_rustls::TlsAcceptor;
use tokio_rustls::rustls::client::danger::HandshakeSignatureValid;
use tokio_rustls::rustls::client::verify_server_name;
use tokio_rustls::rustls::pki_types::pem::PemObject;
use tokio_rustls::rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName, UnixTime};
use tokio_rustls::rustls::server::danger::{ClientCertVerified, ClientCertVerifier};
use tokio_rustls::rustls::server::{ParsedCertificate, WebPkiClientVerifier};
use tokio_rustls::rustls::{
    self, DigitallySignedStruct, DistinguishedName, RootCertStore, ServerConfig, SignatureScheme,
};
use tokio_rustls::server::TlsStream;

use super::conn::{InLane, Tracked, Tracker, accept};
use crate::metrics::{LoadResult, Metrics};

/// How often the files are checked for changes.
const CHECK_EVERY: Duration = Duration::from_secs(1);
/// A client that has not finished its handshake by then is dropped.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// The files of the listener's TLS.
#[derive(Clone, Debug)]
pub(crate) struct ListenerTlsFiles {
    /// Certificate chain (PEM).
    pub cert: PathBuf,
    /// Private key (PEM).
    pub key: PathBuf,
    /// CA bundle (PEM) client certificates must chain to; `None`: no client certificates.
    pub client_ca: Option<PathBuf>,
    /// The name (DNS name or IP address) a client certificate must be valid for, as
    /// envoyproxy/ratelimit's `GRPC_CLIENT_TLS_SAN` checks it; `None`: any name.
    pub client_san: Option<String>,
}

/// The gRPC listener's TLS: its files (watched for renewals) and their first load.
pub(crate) struct GrpcTls {
    /// The files.
    pub(crate) files: ListenerTlsFiles,
    /// The server config they gave at start.
    pub(crate) config: Arc<ServerConfig>,
}

/// Why the TLS files could not be used.
#[derive(Debug, thiserror::Error)]
#[error("{path}: {message}")]
pub struct TlsError {
    path: String,
    message: String,
}

fn err(path: &Path, message: impl ToString) -> TlsError {
    TlsError {
        path: path.display().to_string(),
        message: message.to_string(),
    }
}

impl ListenerTlsFiles {
    /// Reads and checks the files: a rustls server config speaking HTTP/2 (gRPC).
    pub(crate) fn load(&self) -> Result<Arc<ServerConfig>, TlsError> {
        let certs: Vec<CertificateDer<'static>> = CertificateDer::pem_file_iter(&self.cert)
            .map_err(|e| err(&self.cert, e))?
            .collect::<Result<_, _>>()
            .map_err(|e| err(&self.cert, e))?;
        if certs.is_empty() {
            return Err(err(&self.cert, "no certificate in the file"));
        }
        let key = PrivateKeyDer::from_pem_file(&self.key).map_err(|e| err(&self.key, e))?;
        let provider = Arc::new(tokio_rustls::rustls::crypto::ring::default_provider());
        let builder = ServerConfig::builder_with_provider(provider.clone())
            .with_safe_default_protocol_versions()
            .map_err(|e| err(&self.cert, e))?;
        let builder = match &self.client_ca {
            None => builder.with_no_client_auth(),
            Some(ca) => {
                let mut roots = RootCertStore::empty();
                for cert in CertificateDer::pem_file_iter(ca).map_err(|e| err(ca, e))? {
                    roots
                        .add(cert.map_err(|e| err(ca, e))?)
                        .map_err(|e| err(ca, e))?;
                }
                let verifier =
                    WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider)
                        .build()
                        .map_err(|e| err(ca, e))?;
                match &self.client_san {
                    None => builder.with_client_cert_verifier(verifier),
                    Some(san) => {
                        let name = ServerName::try_from(san.clone())
                            .map_err(|e| err(ca, format!("--grpc-tls-client-san '{san}': {e}")))?;
                        builder.with_client_cert_verifier(Arc::new(NamedClient {
                            inner: verifier,
                            name,
                        }))
                    }
                }
            }
        };
        let mut config = builder
            .with_single_cert(certs, key)
            .map_err(|e| err(&self.key, e))?;
        config.alpn_protocols = vec![b"h2".to_vec()];
        Ok(Arc::new(config))
    }

    /// What identifies the files' current contents (size, time and inode of each).
    fn stamp(&self) -> Vec<Option<(u64, SystemTime, u64)>> {
        use std::os::unix::fs::MetadataExt;
        [Some(&self.cert), Some(&self.key), self.client_ca.as_ref()]
            .into_iter()
            .flatten()
            .map(|p| {
                let m = std::fs::metadata(p).ok()?;
                Some((m.len(), m.modified().ok()?, m.ino()))
            })
            .collect()
    }
}

/// A client verifier that also requires the certificate to be valid for one name (its DNS or
/// IP subject alternative names, wildcards as WebPKI reads them), after the CA's checks.
#[derive(Debug)]
struct NamedClient {
    inner: Arc<dyn ClientCertVerifier>,
    name: ServerName<'static>,
}

impl ClientCertVerifier for NamedClient {
    fn offer_client_auth(&self) -> bool {
        self.inner.offer_client_auth()
    }

    fn client_auth_mandatory(&self) -> bool {
        self.inner.client_auth_mandatory()
    }

    fn root_hint_subjects(&self) -> &[DistinguishedName] {
        self.inner.root_hint_subjects()
    }

    fn verify_client_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        now: UnixTime,
    ) -> Result<ClientCertVerified, rustls::Error> {
        let verified = self
            .inner
            .verify_client_cert(end_entity, intermediates, now)?;
        let cert = ParsedCertificate::try_from(end_entity)?;
        verify_server_name(&cert, &self.name).inspect_err(|e| {
            tracing::warn!(error = %e, name = ?self.name, "client certificate refused: not valid for --grpc-tls-client-san");
        })?;
        Ok(verified)
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.inner.verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.inner.verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.inner.supported_verify_schemes()
    }
}

/// A client connection after its TLS handshake, under its listener's bounds.
pub(crate) type Accepted = TlsStream<Tracked<TcpStream>>;

impl InLane for Accepted {
    fn lane(&self) -> usize {
        self.get_ref().0.lane()
    }
}

/// Which listener a TLS config serves: the protocols it offers (ALPN), and its name in logs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Served {
    /// The gRPC listener: HTTP/2 only.
    Grpc,
    /// The admin listener: HTTP/2 and HTTP/1.1.
    Admin,
}

impl Served {
    /// `config` offering this listener's protocols.
    pub(crate) fn offered(self, config: Arc<ServerConfig>) -> Arc<ServerConfig> {
        if self == Served::Grpc {
            return config;
        }
        let mut config = (*config).clone();
        config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
        Arc::new(config)
    }

    fn name(self) -> &'static str {
        match self {
            Served::Grpc => "gRPC",
            Served::Admin => "admin",
        }
    }
}

/// TLS connections accepted on `listener` (the `served` one), for tonic's
/// `serve_with_incoming` or the admin listener, with the tasks that accept them and reload the
/// files (abort them to stop).
pub(crate) fn incoming(
    listener: TcpListener,
    files: ListenerTlsFiles,
    config: Arc<ServerConfig>,
    tracker: Tracker,
    metrics: Arc<Metrics>,
    served: Served,
) -> (
    impl Stream<Item = Result<Accepted, std::io::Error>>,
    Vec<JoinHandle<()>>,
) {
    let current = Arc::new(ArcSwap::new(config));
    let reload = {
        let current = current.clone();
        tokio::spawn(async move {
            let mut stamp = files.stamp();
            let mut tick = tokio::time::interval(CHECK_EVERY);
            loop {
                tick.tick().await;
                let now = files.stamp();
                if now == stamp {
                    continue;
                }
                stamp = now;
                let f = files.clone();
                match tokio::task::spawn_blocking(move || f.load()).await {
                    Ok(Ok(config)) => {
                        current.store(served.offered(config));
                        metrics.tls_reload(LoadResult::success);
                        tracing::info!("{} TLS files reloaded", served.name());
                    }
                    Ok(Err(e)) => {
                        metrics.tls_reload(LoadResult::error);
                        tracing::error!(error = %e, "{} TLS reload refused; the previous certificate stays in force", served.name());
                    }
                    Err(_) => {}
                }
            }
        })
    };
    let (tx, rx) = tokio::sync::mpsc::channel::<Accepted>(128);
    let accept = tokio::spawn(async move {
        loop {
            let (tcp, peer) = accept(&listener, served.name()).await;
            let _ = tcp.set_nodelay(true);
            // Counted and bounded from accept: handshakes in progress hold a place too.
            let Some(tcp) = tracker.admit(tcp) else {
                continue;
            };
            let acceptor = TlsAcceptor::from(current.load_full());
            let tx = tx.clone();
            tokio::spawn(async move {
                match tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(tcp)).await {
                    Ok(Ok(tls)) => {
                        let _ = tx.send(tls).await;
                    }
                    Ok(Err(e)) => tracing::debug!(%peer, error = %e, "TLS handshake failed"),
                    Err(_) => tracing::debug!(%peer, "TLS handshake timed out"),
                }
            });
        }
    });
    let stream = futures_util::stream::unfold(rx, |mut rx| async move {
        rx.recv().await.map(|tls| (Ok(tls), rx))
    });
    (stream, vec![reload, accept])
}
