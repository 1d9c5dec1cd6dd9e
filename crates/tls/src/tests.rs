//! The mesh's mutual TLS over a real loopback socket, with certificates made for the test.

use super::test_ca::Ca;
use super::*;
use clap::Parser;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// Serves one connection with `server`; returns what the client sent, or the handshake's
/// or read's error.
async fn accept_one(
    server: MeshTls,
) -> (
    std::net::SocketAddr,
    tokio::task::JoinHandle<Result<Vec<u8>, String>>,
) {
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    let task = tokio::spawn(async move {
        let (s, _) = l.accept().await.unwrap();
        let mut tls = server
            .acceptor()
            .accept(s)
            .await
            .map_err(|e| e.to_string())?;
        let mut buf = [0u8; 5];
        tls.read_exact(&mut buf).await.map_err(|e| e.to_string())?;
        tls.write_all(b"pong!").await.map_err(|e| e.to_string())?;
        tls.flush().await.map_err(|e| e.to_string())?;
        Ok(buf.to_vec())
    });
    (addr, task)
}

async fn exchange(
    connector: tokio_rustls::TlsConnector,
    addr: std::net::SocketAddr,
) -> Result<Vec<u8>, String> {
    exchange_as(connector, addr, &addr.ip().to_string()).await
}

/// As `exchange`, checking the server's certificate against `host` (an IP or a DNS name).
async fn exchange_as(
    connector: tokio_rustls::TlsConnector,
    addr: std::net::SocketAddr,
    host: &str,
) -> Result<Vec<u8>, String> {
    let s = TcpStream::connect(addr).await.unwrap();
    let mut tls = connector
        .connect(server_name(host).unwrap(), s)
        .await
        .map_err(|e| e.to_string())?;
    tls.write_all(b"ping!").await.map_err(|e| e.to_string())?;
    tls.flush().await.map_err(|e| e.to_string())?;
    let mut buf = [0u8; 5];
    tls.read_exact(&mut buf).await.map_err(|e| e.to_string())?;
    Ok(buf.to_vec())
}

#[tokio::test]
async fn two_services_of_one_mesh_talk_both_ways() {
    let ca = Ca::new("mesh");
    let (addr, server) = accept_one(ca.mesh(&["127.0.0.1"])).await;
    let got = exchange(ca.mesh(&["10.0.0.2"]).connector(), addr).await;
    assert_eq!(got.unwrap(), b"pong!");
    assert_eq!(server.await.unwrap().unwrap(), b"ping!");
}

#[tokio::test]
async fn a_client_with_another_cas_certificate_is_refused() {
    let ca = Ca::new("mesh");
    let other = Ca::new("intruder");
    // It trusts the mesh CA (so the server's certificate passes) but presents its own.
    let (cert, key) = other.leaf(&["127.0.0.1"]);
    let intruder = MeshTls::from_pem(ca.pem.as_bytes(), cert.as_bytes(), key.as_bytes()).unwrap();
    let (addr, server) = accept_one(ca.mesh(&["127.0.0.1"])).await;
    assert!(exchange(intruder.connector(), addr).await.is_err());
    let err = server.await.unwrap().unwrap_err();
    assert!(err.contains("certificate"), "{err}");
}

#[tokio::test]
async fn a_client_without_a_certificate_is_refused() {
    let ca = Ca::new("mesh");
    let mut roots = rustls::RootCertStore::empty();
    for c in CertificateDer::pem_slice_iter(ca.pem.as_bytes()) {
        roots.add(c.unwrap()).unwrap();
    }
    let anonymous = rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .unwrap()
    .with_root_certificates(roots)
    .with_no_client_auth();
    let (addr, server) = accept_one(ca.mesh(&["127.0.0.1"])).await;
    assert!(
        exchange(tokio_rustls::TlsConnector::from(Arc::new(anonymous)), addr)
            .await
            .is_err()
    );
    let err = server.await.unwrap().unwrap_err();
    assert!(err.to_lowercase().contains("certificate"), "{err}");
}

/// Dialled as `host`, the server at `addr` (serving through `server`) is refused for the
/// name its certificate carries, and its own side of the handshake fails.
async fn refused_for_its_name(
    client: &MeshTls,
    addr: std::net::SocketAddr,
    host: &str,
    server: tokio::task::JoinHandle<Result<Vec<u8>, String>>,
) {
    let err = exchange_as(client.connector(), addr, host)
        .await
        .unwrap_err();
    assert!(
        err.contains("NotValidForName") || err.contains("not valid"),
        "{host}: {err}"
    );
    assert!(server.await.unwrap().is_err());
}

#[tokio::test]
async fn a_server_whose_certificate_names_another_address_is_refused() {
    let ca = Ca::new("mesh");
    let (addr, server) = accept_one(ca.mesh(&["10.9.9.9"])).await;
    refused_for_its_name(&ca.mesh(&["10.0.0.2"]), addr, "127.0.0.1", server).await;
}

#[tokio::test]
async fn a_server_known_by_a_dns_name_is_checked_against_that_name() {
    let ca = Ca::new("mesh");
    let client = ca.mesh(&["10.0.0.2"]);
    let (addr, server) = accept_one(ca.mesh(&["cache-b.mesh.internal"])).await;
    let got = exchange_as(client.connector(), addr, "cache-b.mesh.internal").await;
    assert_eq!(got.unwrap(), b"pong!");
    assert_eq!(server.await.unwrap().unwrap(), b"ping!");
    // The same server dialled by another name (or by its address) is refused.
    for host in ["cache-c.mesh.internal", "127.0.0.1"] {
        let (addr, server) = accept_one(ca.mesh(&["cache-b.mesh.internal"])).await;
        refused_for_its_name(&client, addr, host, server).await;
    }
}

#[tokio::test]
async fn with_a_mesh_server_name_every_peer_is_checked_for_that_name_whatever_its_address() {
    let ca = Ca::new("mesh");
    // One certificate for the mesh, naming no address (Kubernetes pods and nodes).
    let named = |tls: MeshTls| tls.with_server_name("pdmesh.mesh").unwrap();
    let client = named(ca.mesh(&["pdmesh.mesh"]));
    let (addr, server) = accept_one(named(ca.mesh(&["pdmesh.mesh"]))).await;
    let name = client.peer_name(&addr.ip().to_string()).unwrap();
    assert_eq!(name, server_name("pdmesh.mesh").unwrap());
    let got = exchange_as(client.connector(), addr, "pdmesh.mesh").await;
    assert_eq!(got.unwrap(), b"pong!");
    assert_eq!(server.await.unwrap().unwrap(), b"ping!");
    // A server whose certificate carries another name is still refused, and so is one
    // from another CA carrying the mesh's name.
    let (addr, server) = accept_one(ca.mesh(&["other.mesh"])).await;
    refused_for_its_name(&client, addr, "pdmesh.mesh", server).await;
    let (addr, server) = accept_one(Ca::new("intruder").mesh(&["pdmesh.mesh"])).await;
    assert!(
        exchange_as(client.connector(), addr, "pdmesh.mesh")
            .await
            .is_err()
    );
    assert!(server.await.unwrap().is_err());
    // Without the flag the address dialled is what is checked.
    assert_eq!(
        ca.mesh(&["127.0.0.1"]).peer_name("10.0.0.2").unwrap(),
        server_name("10.0.0.2").unwrap()
    );
}

#[test]
fn the_mesh_server_name_is_a_dns_name_and_needs_the_other_flags() {
    let ca = Ca::new("mesh");
    let err = ca
        .mesh(&["127.0.0.1"])
        .with_server_name("10.0.0.2")
        .unwrap_err();
    assert!(err.to_string().contains("not a DNS name"), "{err}");
    assert!(
        ca.mesh(&["127.0.0.1"])
            .with_server_name("bad name!")
            .is_err()
    );
    let err = Cli::try_parse_from(["svc", "--tls-server-name", "pdmesh.mesh"])
        .err()
        .expect("refused");
    assert!(err.to_string().contains("--tls-ca"), "{err}");
    let flags = [
        "--tls-ca",
        "a",
        "--tls-cert",
        "b",
        "--tls-key",
        "c",
        "--tls-server-name",
        "m.x",
    ];
    let all = Cli::try_parse_from(std::iter::once("svc").chain(flags)).unwrap();
    assert_eq!(all.tls.to_args(), flags);
}

#[tokio::test]
async fn a_plaintext_client_gets_no_answer() {
    let ca = Ca::new("mesh");
    let (addr, server) = accept_one(ca.mesh(&["127.0.0.1"])).await;
    let mut s = TcpStream::connect(addr).await.unwrap();
    s.write_all(b"ping!").await.unwrap();
    let mut buf = Vec::new();
    // The server fails the handshake and closes; nothing of the payload is ever read.
    let _ = s.read_to_end(&mut buf).await;
    assert!(!buf.starts_with(b"pong"), "{buf:?}");
    assert!(server.await.unwrap().is_err());
}

#[derive(Parser)]
struct Cli {
    #[command(flatten)]
    tls: TlsArgs,
}

#[test]
fn the_three_flags_go_together() {
    let err = Cli::try_parse_from(["svc", "--tls-ca", "ca.pem"])
        .err()
        .expect("refused");
    assert!(err.to_string().contains("--tls-cert"), "{err}");
    let none = Cli::try_parse_from(["svc"]).unwrap();
    assert!(none.tls.load().unwrap().is_none());
    let all =
        Cli::try_parse_from(["svc", "--tls-ca", "a", "--tls-cert", "b", "--tls-key", "c"]).unwrap();
    assert_eq!(
        all.tls.to_args(),
        ["--tls-ca", "a", "--tls-cert", "b", "--tls-key", "c"]
    );
}

#[test]
fn an_unreadable_or_malformed_file_names_its_flag() {
    let ca = Ca::new("mesh");
    let (cert, key) = ca.leaf(&["127.0.0.1"]);
    let dir = tempfile::tempdir().unwrap();
    let write = |name: &str, text: &str| {
        let p = dir.path().join(name);
        std::fs::write(&p, text).unwrap();
        p
    };
    let (ca_p, cert_p, key_p) = (
        write("ca.pem", &ca.pem),
        write("c.pem", &cert),
        write("k.pem", &key),
    );
    let junk = write("junk.pem", "not a certificate\n");
    assert!(MeshTls::from_files(&ca_p, &cert_p, &key_p).is_ok());
    let err = MeshTls::from_files(&ca_p, &junk, &key_p)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("--tls-cert") && err.contains("junk.pem"),
        "{err}"
    );
    let err = MeshTls::from_files(&ca_p, &cert_p, &junk)
        .unwrap_err()
        .to_string();
    assert!(err.contains("--tls-key"), "{err}");
    let err = MeshTls::from_files(&dir.path().join("missing.pem"), &cert_p, &key_p)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("--tls-ca") && err.contains("missing.pem"),
        "{err}"
    );
    // A key that is not the certificate's.
    let (_, other_key) = ca.leaf(&["127.0.0.1"]);
    let wrong = write("wrong.pem", &other_key);
    let err = MeshTls::from_files(&ca_p, &cert_p, &wrong)
        .unwrap_err()
        .to_string();
    assert!(err.contains("--tls-key"), "{err}");
}

#[test]
fn urls_are_dialled_with_https_only_when_tls_is_on() {
    let ca = Ca::new("mesh");
    let tls = ca.mesh(&["127.0.0.1"]);
    assert_eq!(
        dial_url("http://10.0.0.2:7100", None),
        "http://10.0.0.2:7100"
    );
    assert_eq!(
        dial_url("http://10.0.0.2:7100", Some(&tls)),
        "https://10.0.0.2:7100"
    );
    assert_eq!(dial_url("https://a:1", Some(&tls)), "https://a:1");
}
