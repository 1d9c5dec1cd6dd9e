//! Mutual TLS between pdmesh services.
//!
//! Every service of a mesh is given the same three PEM files' kinds: the mesh's
//! certificate authority, its own certificate (signed by that CA, naming the addresses
//! other services dial it at) and its key. With them, each gRPC server (tokenizer,
//! workers, cache services) and each cache service's page transport accepts only
//! connections that present a certificate signed by the mesh CA, and every connection a
//! service makes to another is TLS, checking the peer's certificate against the same CA.
//! So the CA is the mesh's membership: a process without a certificate it signed can
//! neither call a service nor feed pages to a cache service, and nothing between
//! services crosses the network in clear text.
//!
//! URLs stay as the user wrote them (`http://host:port`); with TLS on, connections to
//! them are made with `https`. Without the flags nothing changes: plaintext, as before.

#![forbid(unsafe_code)]

use std::path::{Path, PathBuf};
use std::sync::Arc;

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use tonic::transport::{Certificate, ClientTlsConfig, Endpoint, Identity, ServerTlsConfig};

/// The mesh credential flags every service takes: `--tls-*` (all three or none),
/// `--mesh-token-file` and `--insecure-plaintext` (see [`auth`]).
#[derive(Clone, Debug, Default, PartialEq, Eq, clap::Args)]
pub struct TlsArgs {
    /// PEM file of the mesh's certificate authority. With --tls-cert and --tls-key, every
    /// gRPC and page-transport connection to or from this service is mutual TLS, and
    /// only peers holding a certificate this CA signed are accepted.
    #[arg(long, env = "PDMESH_TLS_CA", requires_all = ["tls_cert", "tls_key"])]
    pub tls_ca: Option<PathBuf>,
    /// PEM file of this service's certificate (signed by --tls-ca; its subject names must
    /// include the addresses other services dial this one at).
    #[arg(long, env = "PDMESH_TLS_CERT", requires_all = ["tls_ca", "tls_key"])]
    pub tls_cert: Option<PathBuf>,
    /// PEM file of this service's private key.
    #[arg(long, env = "PDMESH_TLS_KEY", requires_all = ["tls_ca", "tls_cert"])]
    pub tls_key: Option<PathBuf>,
    /// Check every peer's certificate for this one DNS name instead of the address it is
    /// dialled at: one certificate for the whole mesh, for peers whose addresses are not
    /// known when it is made (pods, nodes' addresses on Kubernetes). The CA still decides
    /// who belongs to the mesh.
    #[arg(long, env = "PDMESH_TLS_SERVER_NAME", requires = "tls_ca")]
    pub tls_server_name: Option<String>,
    /// File holding the mesh token (one line, at least 32 characters, readable by this
    /// user only): every call to another service carries it, and every call to this one
    /// must. `pdmesh up` makes one per mesh itself. The token can also come from the
    /// PDMESH_MESH_TOKEN environment variable.
    #[arg(long, env = "PDMESH_MESH_TOKEN_FILE")]
    pub mesh_token_file: Option<PathBuf>,
    /// Serve open: every peer that can connect may call this service, with or without a
    /// credential, and it may listen beyond loopback without TLS. Logged as a WARN at start and reported by the
    /// pdmesh_insecure_plaintext gauge.
    #[arg(long, env = "PDMESH_INSECURE_PLAINTEXT")]
    pub insecure_plaintext: bool,
    /// The mesh token handed over in code (embedders and tests), never from a command
    /// line; it goes before --mesh-token-file and the environment.
    #[arg(skip)]
    pub mesh_token: Option<MeshToken>,
}

#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("reading {flag} {path}: {source}")]
    Read {
        flag: &'static str,
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{flag} {path}: {what}")]
    Pem {
        flag: &'static str,
        path: PathBuf,
        what: String,
    },
    #[error("--tls-ca, --tls-cert and --tls-key go together; {0} is missing")]
    Incomplete(&'static str),
    #[error("the TLS configuration is refused: {0}")]
    Config(String),
}

impl TlsArgs {
    /// The mesh TLS these flags describe, or `None` when none is given.
    pub fn load(&self) -> Result<Option<MeshTls>, TlsError> {
        match (&self.tls_ca, &self.tls_cert, &self.tls_key) {
            (None, None, None) => Ok(None),
            (Some(ca), Some(cert), Some(key)) => {
                let tls = MeshTls::from_files(ca, cert, key)?;
                match &self.tls_server_name {
                    Some(name) => tls.with_server_name(name).map(Some),
                    None => Ok(Some(tls)),
                }
            }
            (None, _, _) => Err(TlsError::Incomplete("--tls-ca")),
            (_, None, _) => Err(TlsError::Incomplete("--tls-cert")),
            (_, _, None) => Err(TlsError::Incomplete("--tls-key")),
        }
    }

    /// The same flags for a child process's command line.
    pub fn to_args(&self) -> Vec<String> {
        let mut out = Vec::new();
        for (flag, v) in [
            ("--tls-ca", &self.tls_ca),
            ("--tls-cert", &self.tls_cert),
            ("--tls-key", &self.tls_key),
        ] {
            if let Some(p) = v {
                out.push(flag.to_owned());
                out.push(p.display().to_string());
            }
        }
        if let Some(name) = &self.tls_server_name {
            out.push("--tls-server-name".to_owned());
            out.push(name.clone());
        }
        self.auth_args(&mut out);
        out
    }
}

/// One service's side of the mesh's mutual TLS: the CA it trusts, and the certificate and
/// key it presents, ready as tonic and rustls configurations.
#[derive(Clone)]
pub struct MeshTls {
    ca_pem: Arc<[u8]>,
    cert_pem: Arc<[u8]>,
    key_pem: Arc<[u8]>,
    server: Arc<rustls::ServerConfig>,
    client: Arc<rustls::ClientConfig>,
    /// `--tls-server-name`: the name peers' certificates are checked for, whatever
    /// address they are dialled at.
    server_name: Option<ServerName<'static>>,
}

impl std::fmt::Debug for MeshTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never the key.
        f.debug_struct("MeshTls").finish_non_exhaustive()
    }
}

fn read(flag: &'static str, path: &Path) -> Result<Vec<u8>, TlsError> {
    std::fs::read(path).map_err(|source| TlsError::Read {
        flag,
        path: path.to_owned(),
        source,
    })
}

fn certs(
    flag: &'static str,
    path: &Path,
    pem: &[u8],
) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let bad = |what: String| TlsError::Pem {
        flag,
        path: path.to_owned(),
        what,
    };
    let certs = CertificateDer::pem_slice_iter(pem)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| bad(format!("not a PEM certificate file: {e}")))?;
    if certs.is_empty() {
        return Err(bad("holds no certificate".into()));
    }
    Ok(certs)
}

impl MeshTls {
    /// Reads the three PEM files (the flags' values).
    pub fn from_files(ca: &Path, cert: &Path, key: &Path) -> Result<Self, TlsError> {
        let (ca_pem, cert_pem, key_pem) = (
            read("--tls-ca", ca)?,
            read("--tls-cert", cert)?,
            read("--tls-key", key)?,
        );
        Self::build((ca, &ca_pem), (cert, &cert_pem), (key, &key_pem))
    }

    /// From PEM text already in memory (tests).
    pub fn from_pem(ca: &[u8], cert: &[u8], key: &[u8]) -> Result<Self, TlsError> {
        Self::build(
            (Path::new("<ca>"), ca),
            (Path::new("<cert>"), cert),
            (Path::new("<key>"), key),
        )
    }

    fn build(
        (ca_path, ca): (&Path, &[u8]),
        (cert_path, cert): (&Path, &[u8]),
        (key_path, key): (&Path, &[u8]),
    ) -> Result<Self, TlsError> {
        let config = |e: String| TlsError::Config(e);
        let cas = certs("--tls-ca", ca_path, ca)?;
        let chain = certs("--tls-cert", cert_path, cert)?;
        let private = PrivateKeyDer::from_pem_slice(key).map_err(|e| TlsError::Pem {
            flag: "--tls-key",
            path: key_path.to_owned(),
            what: format!("not a PEM private key: {e}"),
        })?;
        let mut roots = rustls::RootCertStore::empty();
        for c in cas {
            roots.add(c).map_err(|e| TlsError::Pem {
                flag: "--tls-ca",
                path: ca_path.to_owned(),
                what: format!("not a usable CA certificate: {e}"),
            })?;
        }
        let roots = Arc::new(roots);
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let verifier = rustls::server::WebPkiClientVerifier::builder_with_provider(
            roots.clone(),
            provider.clone(),
        )
        .build()
        .map_err(|e| config(e.to_string()))?;
        let server = rustls::ServerConfig::builder_with_provider(provider.clone())
            .with_safe_default_protocol_versions()
            .map_err(|e| config(e.to_string()))?
            .with_client_cert_verifier(verifier)
            .with_single_cert(chain.clone(), private.clone_key())
            .map_err(|e| config(format!("--tls-cert and --tls-key: {e}")))?;
        let client = rustls::ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .map_err(|e| config(e.to_string()))?
            .with_root_certificates(roots)
            .with_client_auth_cert(chain, private)
            .map_err(|e| config(format!("--tls-cert and --tls-key: {e}")))?;
        Ok(Self {
            ca_pem: ca.into(),
            cert_pem: cert.into(),
            key_pem: key.into(),
            server: Arc::new(server),
            client: Arc::new(client),
            server_name: None,
        })
    }

    /// Peers' certificates are checked for `name` (a DNS name), not for the address they
    /// are dialled at.
    pub fn with_server_name(mut self, name: &str) -> Result<Self, TlsError> {
        let checked = server_name(name)?;
        if !matches!(checked, ServerName::DnsName(_)) {
            return Err(TlsError::Config(format!(
                "--tls-server-name {name:?} is an address, not a DNS name"
            )));
        }
        self.server_name = Some(checked);
        Ok(self)
    }

    /// The name a peer dialled as `host` must show in its certificate: `host` itself, or
    /// `--tls-server-name` when given.
    pub fn peer_name(&self, host: &str) -> Result<ServerName<'static>, TlsError> {
        match &self.server_name {
            Some(n) => Ok(n.clone()),
            None => server_name(host),
        }
    }

    /// A gRPC server's TLS: present this service's certificate, require the client's,
    /// signed by the mesh CA.
    pub fn grpc_server(&self) -> ServerTlsConfig {
        ServerTlsConfig::new()
            .identity(Identity::from_pem(&self.cert_pem, &self.key_pem))
            .client_ca_root(Certificate::from_pem(&self.ca_pem))
            // A client that opens a connection and stalls holds nothing for long.
            .timeout(HANDSHAKE_TIMEOUT)
    }

    /// A gRPC client's TLS: trust only the mesh CA, present this service's certificate.
    pub fn grpc_client(&self) -> ClientTlsConfig {
        let c = ClientTlsConfig::new()
            .ca_certificate(Certificate::from_pem(&self.ca_pem))
            .identity(Identity::from_pem(&self.cert_pem, &self.key_pem));
        match &self.server_name {
            Some(name) => c.domain_name(name.to_str()),
            None => c,
        }
    }

    /// The page transport's accepting side.
    pub fn acceptor(&self) -> tokio_rustls::TlsAcceptor {
        tokio_rustls::TlsAcceptor::from(self.server.clone())
    }

    /// The page transport's connecting side.
    pub fn connector(&self) -> tokio_rustls::TlsConnector {
        tokio_rustls::TlsConnector::from(self.client.clone())
    }
}

/// The name a certificate must carry for a peer dialled as `host` (a DNS name or an IP
/// address, as its URL names it).
pub fn server_name(host: &str) -> Result<ServerName<'static>, TlsError> {
    ServerName::try_from(host.to_owned())
        .map_err(|e| TlsError::Config(format!("{host:?} is not a host name TLS can check: {e}")))
}

/// How long a peer may take over its TLS handshake before the connection is dropped.
pub const HANDSHAKE_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);

/// `url` as connections are made to it: `https` when TLS is on.
pub fn dial_url(url: &str, tls: Option<&MeshTls>) -> String {
    match (tls, url.strip_prefix("http://")) {
        (Some(_), Some(rest)) => format!("https://{rest}"),
        _ => url.to_owned(),
    }
}

/// A gRPC endpoint for `url`, mutual TLS when `tls` is given.
pub fn endpoint(url: &str, tls: Option<&MeshTls>) -> Result<Endpoint, tonic::transport::Error> {
    let ep = Endpoint::from_shared(dial_url(url, tls))?;
    match tls {
        Some(t) => ep.tls_config(t.grpc_client()),
        None => Ok(ep),
    }
}

/// A gRPC server builder, mutual TLS when `tls` is given.
pub fn server(tls: Option<&MeshTls>) -> Result<tonic::transport::Server, tonic::transport::Error> {
    let s = tonic::transport::Server::builder();
    match tls {
        Some(t) => s.tls_config(t.grpc_server()),
        None => Ok(s),
    }
}

pub mod auth;
pub mod refusal;
pub mod role;
mod serve;
pub use auth::{AuthChannel, Guarded, MeshAuth, MeshToken};
pub use refusal::Refusal;
pub use role::{Caller, Policy, Role, Roles};
pub use serve::{DRAIN_POLL, DrainEnd, serve, wait_drained};

#[cfg(any(test, feature = "test-ca"))]
pub mod test_ca;
#[cfg(test)]
mod tests;
