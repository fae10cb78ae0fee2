//! TLS on the gRPC listener: server certificates, mutual TLS, and certificates reloaded when
//! their files change, through a real TLS gRPC client.

mod common;

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use common::redis::make_certs;
use common::*;
use ratelimitd::testing::SystemClock;
use tonic::transport::{Certificate, Channel, ClientTlsConfig, Identity};

const LIMITS: &str =
    "domain: d\ndescriptors:\n  - key: k\n    rate_limit: {unit: hour, requests_per_unit: 5}\n";

/// A TLS client trusting `ca`, optionally presenting `identity`; `None` if it cannot connect
/// or its first call fails.
async fn tls_call(addr: std::net::SocketAddr, ca: &Path, identity: Option<&Path>) -> Option<bool> {
    let mut tls = ClientTlsConfig::new()
        .ca_certificate(Certificate::from_pem(std::fs::read(ca).unwrap()))
        .domain_name("localhost");
    if let Some(dir) = identity {
        tls = tls.identity(Identity::from_pem(
            std::fs::read(dir.join("client.crt")).unwrap(),
            std::fs::read(dir.join("client.key")).unwrap(),
        ));
    }
    let channel = Channel::from_shared(format!("https://127.0.0.1:{}", addr.port()))
        .unwrap()
        .tls_config(tls)
        .ok()?
        .connect_timeout(Duration::from_secs(5))
        .connect()
        .await
        .ok()?;
    let mut client = Client::new(channel);
    let r = client
        .should_rate_limit(request("d", &[&[("k", "v")]]))
        .await
        .ok()?;
    Some(is_ok(r.get_ref()))
}

/// A fresh CA with server and client certificates (the directory lives as long as the guard).
fn new_certs() -> (tempfile::TempDir, std::path::PathBuf) {
    let dir = tempfile::tempdir().unwrap();
    let certs = make_certs(dir.path());
    (dir, certs)
}

/// Polls until a TLS client trusting `ca` (with `identity`) gets an answer; returns it.
async fn first_answer(addr: std::net::SocketAddr, ca: &Path, identity: Option<&Path>) -> bool {
    poll(Duration::from_secs(10), || tls_call(addr, ca, identity)).await
}

async fn tls_server(certs: &Path, dir: &Path, mutual: bool) -> TestServer {
    tls_server_with(certs, dir, mutual, &[]).await
}

/// [`tls_server`] with more flags.
async fn tls_server_with(certs: &Path, dir: &Path, mutual: bool, more: &[&str]) -> TestServer {
    for f in ["server.crt", "server.key"] {
        std::fs::copy(certs.join(f), dir.join(f)).unwrap();
    }
    let (cert, key) = (dir.join("server.crt"), dir.join("server.key"));
    let ca = certs.join("ca.crt");
    let mut flags = vec![
        "--grpc-tls-cert",
        cert.to_str().unwrap(),
        "--grpc-tls-key",
        key.to_str().unwrap(),
    ];
    if mutual {
        flags.extend(["--grpc-tls-client-ca", ca.to_str().unwrap()]);
    }
    flags.extend(more);
    let flags: Vec<String> = flags.into_iter().map(String::from).collect();
    let flags: Vec<&str> = flags.iter().map(String::as_str).collect();
    TestServer::start_with(&[("l.yaml", LIMITS)], &flags, Arc::new(SystemClock)).await
}

#[tokio::test]
async fn grpc_over_tls_and_plain_text_is_refused() {
    let (_tmp, certs) = new_certs();
    let files = tempfile::tempdir().unwrap();
    let s = tls_server(&certs, files.path(), false).await;
    assert!(first_answer(s.grpc, &certs.join("ca.crt"), None).await);
    let plain = async {
        let mut c = Client::connect(format!("http://{}", s.grpc)).await.ok()?;
        c.should_rate_limit(request("d", &[&[("k", "v")]]))
            .await
            .ok()
    };
    assert!(
        tokio::time::timeout(Duration::from_secs(5), plain)
            .await
            .ok()
            .flatten()
            .is_none(),
        "plain text is not served"
    );
}

#[tokio::test]
async fn mutual_tls_requires_a_client_certificate_from_the_ca() {
    let (_tmp, certs) = new_certs();
    let (_other, stranger) = new_certs();
    let files = tempfile::tempdir().unwrap();
    let s = tls_server(&certs, files.path(), true).await;
    let ca = certs.join("ca.crt");
    assert!(first_answer(s.grpc, &ca, Some(&certs)).await);
    assert_eq!(
        tls_call(s.grpc, &ca, None).await,
        None,
        "no client certificate"
    );
    assert_eq!(
        tls_call(s.grpc, &ca, Some(&stranger)).await,
        None,
        "a certificate from another CA"
    );
}

/// `--grpc-tls-client-san` (envoyproxy/ratelimit's `GRPC_CLIENT_TLS_SAN`): of two client
/// certificates from the same CA, only the one valid for the name is admitted.
#[tokio::test]
async fn a_client_san_admits_only_certificates_valid_for_it() {
    let (_tmp, certs) = new_certs();
    // Another client of the same CA, for another name, presented as `client.*` from its own
    // directory.
    common::redis::sign(
        &certs,
        "stranger",
        "/CN=stranger",
        "extendedKeyUsage=clientAuth\nsubjectAltName=DNS:stranger.ratelimitd.test\n",
    );
    let stranger = tempfile::tempdir().unwrap();
    for (from, to) in [
        ("stranger.crt", "client.crt"),
        ("stranger.key", "client.key"),
    ] {
        std::fs::copy(certs.join(from), stranger.path().join(to)).unwrap();
    }
    let ca = certs.join("ca.crt");
    let files = tempfile::tempdir().unwrap();
    let named = tls_server_with(
        &certs,
        files.path(),
        true,
        &["--grpc-tls-client-san", "envoy.ratelimitd.test"],
    )
    .await;
    assert!(first_answer(named.grpc, &ca, Some(&certs)).await);
    assert_eq!(
        tls_call(named.grpc, &ca, Some(stranger.path())).await,
        None,
        "a certificate from the CA for another name"
    );
    assert_eq!(
        tls_call(named.grpc, &ca, None).await,
        None,
        "no certificate"
    );
    // Without the flag the CA alone decides: the same certificate is admitted.
    let files = tempfile::tempdir().unwrap();
    let any = tls_server(&certs, files.path(), true).await;
    assert!(
        first_answer(any.grpc, &ca, Some(stranger.path())).await,
        "without the flag, the CA decides"
    );
}

#[tokio::test]
async fn a_renewed_certificate_is_served_without_a_restart() {
    let (_tmp, old) = new_certs();
    let (_tmp2, new) = new_certs();
    let files = tempfile::tempdir().unwrap();
    let s = tls_server(&old, files.path(), false).await;
    assert!(first_answer(s.grpc, &old.join("ca.crt"), None).await);
    // A broken renewal is refused and the old certificate keeps serving.
    std::fs::write(files.path().join("server.crt"), "not a certificate").unwrap();
    poll(Duration::from_secs(10), || async {
        let (_, m) = s.http_get("/metrics").await;
        (metric(&m, r#"ratelimit_tls_reloads_total{result="error"}"#) >= 1.0).then_some(())
    })
    .await;
    assert_eq!(
        tls_call(s.grpc, &old.join("ca.crt"), None).await,
        Some(true)
    );
    // Written aside and renamed over, as a Secret update would.
    for f in ["server.key", "server.crt"] {
        let aside = files.path().join(format!(".{f}"));
        std::fs::copy(new.join(f), &aside).unwrap();
        std::fs::rename(&aside, files.path().join(f)).unwrap();
    }
    first_answer(s.grpc, &new.join("ca.crt"), None).await;
    assert_eq!(tls_call(s.grpc, &old.join("ca.crt"), None).await, None);
}
