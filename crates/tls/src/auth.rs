//! The mesh credential: what every internal call carries and every service checks.
//!
//! A service is a member of its mesh by one of two credentials:
//! - mutual TLS ([`MeshTls`]): the connection itself is authenticated, both ways;
//! - the mesh token: a random secret every member holds, sent as gRPC metadata
//!   (`authorization: Bearer <token>`) on every call and in the page transport's hello,
//!   and compared in constant time. `pdmesh up` makes one per mesh and hands it to its
//!   children in the environment ([`TOKEN_ENV`]), never on a command line; services
//!   started by hand read it from `--mesh-token-file`.
//!
//! Without either a service refuses to start, unless `--insecure-plaintext` says the
//! operator wants an open service (for a client that can present neither, such as a
//! third-party router): then it accepts every call, with or without a credential, logs a
//! WARN at start and reports [`insecure`] as a gauge. A token crosses the wire in clear without TLS, so a service
//! listening on a non-loopback address needs TLS too, or the same flag.

use std::future::Future;
use std::net::SocketAddr;
use std::path::Path;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::task::{Context, Poll};

use subtle::ConstantTimeEq;
use tonic::codegen::{Service, http};
use tonic::metadata::{Ascii, MetadataValue};
use tonic::server::NamedService;
use tonic::service::Interceptor;
use tonic::service::interceptor::InterceptedService;
use tonic::transport::server::{TcpConnectInfo, TlsConnectInfo};
use tonic::transport::{Channel, Endpoint};
use tonic::{Request, Status};

use crate::refusal::Refusal;
use crate::role::{Caller, Policy, Role, Roles};
use crate::{MeshTls, TlsArgs, TlsError};

/// The environment variable `pdmesh up` passes the mesh token to its children in (and a
/// way to give it to a service by hand that keeps it off the command line).
pub const TOKEN_ENV: &str = "PDMESH_MESH_TOKEN";

/// The fewest characters a mesh token may have (`pdmesh up`'s are 64 hex digits: 256
/// random bits).
pub const MIN_TOKEN_CHARS: usize = 32;

/// The gRPC metadata key the token travels in.
const AUTHORIZATION: &str = "authorization";

/// A mesh token. Its `Debug` never shows it.
#[derive(Clone)]
pub struct MeshToken(Arc<str>);

impl std::fmt::Debug for MeshToken {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("MeshToken(..)")
    }
}

/// Equal tokens, compared in constant time.
impl PartialEq for MeshToken {
    fn eq(&self, other: &Self) -> bool {
        self.matches(other.0.as_bytes())
    }
}

impl Eq for MeshToken {}

impl MeshToken {
    /// A fresh token: 256 random bits as 64 hex digits.
    pub fn generate() -> Self {
        let bytes: [u8; 32] = rand::random();
        let hex: String = bytes.iter().map(|b| format!("{b:02x}")).collect();
        Self(hex.into())
    }

    /// A token as a user wrote it (surrounding white space dropped): at least
    /// [`MIN_TOKEN_CHARS`] visible ASCII characters, so that it can travel as metadata.
    pub fn parse(text: &str, from: &str) -> Result<Self, TlsError> {
        let t = text.trim();
        if t.len() < MIN_TOKEN_CHARS {
            return Err(TlsError::Config(format!(
                "the mesh token from {from} has {} characters; it needs at least {MIN_TOKEN_CHARS} (make one with `openssl rand -hex 32`)",
                t.len()
            )));
        }
        if !t.bytes().all(|b| b.is_ascii_graphic()) {
            return Err(TlsError::Config(format!(
                "the mesh token from {from} holds characters other than visible ASCII"
            )));
        }
        Ok(Self(t.into()))
    }

    /// Reads `--mesh-token-file`: refused when other users may read or write it.
    pub fn from_file(path: &Path) -> Result<Self, TlsError> {
        use std::os::unix::fs::MetadataExt;
        let read = |source| TlsError::Read {
            flag: "--mesh-token-file",
            path: path.to_owned(),
            source,
        };
        let meta = std::fs::metadata(path).map_err(read)?;
        if meta.mode() & 0o007 != 0 {
            return Err(TlsError::Config(format!(
                "--mesh-token-file {}: other users may read it (mode {:o}); make it 0600 or 0640",
                path.display(),
                meta.mode() & 0o777
            )));
        }
        let text = std::fs::read_to_string(path).map_err(read)?;
        Self::parse(&text, &format!("--mesh-token-file {}", path.display()))
    }

    /// The token itself, to hand to a child process's environment.
    pub fn expose(&self) -> &str {
        &self.0
    }

    /// Whether `presented` is this token, in time that does not depend on where they
    /// differ.
    pub fn matches(&self, presented: &[u8]) -> bool {
        bool::from(self.0.as_bytes().ct_eq(presented))
    }

    fn bearer(&self) -> MetadataValue<Ascii> {
        MetadataValue::try_from(format!("Bearer {}", self.0)).expect("a token is visible ASCII")
    }
}

/// Whether this process runs with `--insecure-plaintext`.
static INSECURE: AtomicBool = AtomicBool::new(false);

/// Calls and page-transport connections refused so far for their credential (the
/// `pdmesh_auth_refused_total` counter of each service's metrics).
pub fn refused_total() -> u64 {
    crate::refusal::total()
}

/// Whether this process runs open (`--insecure-plaintext`): the
/// `pdmesh_insecure_plaintext` gauge.
pub fn insecure() -> bool {
    INSECURE.load(Ordering::Relaxed)
}

/// A service's membership of its mesh: its TLS and token (either or both), or neither
/// with `--insecure-plaintext`. Cloned into every client and server the service makes.
#[derive(Clone, Debug, Default)]
pub struct MeshAuth {
    tls: Option<MeshTls>,
    token: Option<MeshToken>,
    insecure: bool,
}

impl MeshAuth {
    /// From its parts (tests and embedders; services use [`TlsArgs::auth`]).
    pub fn new(tls: Option<MeshTls>, token: Option<MeshToken>, insecure: bool) -> Self {
        Self {
            tls,
            token,
            insecure,
        }
    }

    /// A token-only credential (tests).
    pub fn token(token: MeshToken) -> Self {
        Self::new(None, Some(token), false)
    }

    /// No credential at all: what `--insecure-plaintext` alone gives.
    pub fn open() -> Self {
        Self::new(None, None, true)
    }

    pub fn tls(&self) -> Option<&MeshTls> {
        self.tls.as_ref()
    }

    pub fn mesh_token(&self) -> Option<&MeshToken> {
        self.token.as_ref()
    }

    pub fn is_insecure(&self) -> bool {
        self.insecure
    }

    /// Checked once at start, for each address the service listens on: a service with no
    /// credential, or one listening beyond loopback without TLS, refuses to start unless
    /// `--insecure-plaintext` was given; with it, it logs a WARN once.
    pub fn check_listen(&self, what: &str, addr: SocketAddr) -> Result<(), TlsError> {
        let problem = if self.tls.is_none() && self.token.is_none() {
            Some(format!(
                "{what} on {addr} has no mesh credential: give --mesh-token-file (or {TOKEN_ENV}), or --tls-ca/--tls-cert/--tls-key"
            ))
        } else if self.tls.is_none() && !addr.ip().is_loopback() {
            Some(format!(
                "{what} on {addr}, beyond loopback, without TLS: its calls and the mesh token would cross the network in clear; give --tls-ca/--tls-cert/--tls-key"
            ))
        } else {
            None
        };
        match problem {
            Some(p) if self.insecure => {
                INSECURE.store(true, Ordering::Relaxed);
                tracing::warn!("--insecure-plaintext: {p}; serving anyway");
                Ok(())
            }
            // A credential it has, but it lets every caller in (the guard's open door).
            None if self.insecure => {
                INSECURE.store(true, Ordering::Relaxed);
                tracing::warn!(
                    "--insecure-plaintext: {what} on {addr} serves every caller, with or without the mesh credential"
                );
                Ok(())
            }
            None => Ok(()),
            Some(p) => Err(TlsError::Config(format!(
                "{p} (or --insecure-plaintext to serve without)"
            ))),
        }
    }

    /// For a process that only calls services (the gateway): it needs a credential, or
    /// `--insecure-plaintext`.
    pub fn require(&self, what: &str) -> Result<(), TlsError> {
        if self.tls.is_some() || self.token.is_some() {
            return Ok(());
        }
        if self.insecure {
            INSECURE.store(true, Ordering::Relaxed);
            tracing::warn!(
                "--insecure-plaintext: {what} calls the mesh's services without a credential"
            );
            return Ok(());
        }
        Err(TlsError::Config(format!(
            "{what} has no mesh credential: give --mesh-token-file (or {TOKEN_ENV}), or --tls-ca/--tls-cert/--tls-key (or --insecure-plaintext for a mesh that runs open)"
        )))
    }

    /// A gRPC endpoint for `url`, mutual TLS when configured.
    pub fn endpoint(&self, url: &str) -> Result<Endpoint, tonic::transport::Error> {
        crate::endpoint(url, self.tls.as_ref())
    }

    /// `channel` with this service's token on every call.
    pub fn channel(&self, channel: Channel) -> AuthChannel {
        InterceptedService::new(channel, Bearer(self.token.as_ref().map(MeshToken::bearer)))
    }

    /// A lazily connecting channel to `url`, the token on every call.
    pub fn connect_lazy(&self, url: &str) -> Result<AuthChannel, tonic::transport::Error> {
        Ok(self.channel(self.endpoint(url)?.connect_lazy()))
    }

    /// A connected channel to `url`, the token on every call.
    pub async fn connect(&self, url: &str) -> Result<AuthChannel, tonic::transport::Error> {
        Ok(self.channel(self.endpoint(url)?.connect().await?))
    }

    /// A gRPC server builder, mutual TLS when configured. Wrap each service in
    /// [`MeshAuth::guard`].
    pub fn server(&self) -> Result<tonic::transport::Server, tonic::transport::Error> {
        crate::server(self.tls.as_ref())
    }

    /// `service`, refusing every call that does not carry this mesh's credential with
    /// UNAUTHENTICATED, and every call whose certificate names none of the roles `policy`
    /// gives its method with PERMISSION_DENIED. Admitted calls carry their [`Caller`].
    pub fn guard<S>(&self, policy: &'static Policy, service: S) -> Guarded<S> {
        Guarded {
            inner: service,
            check: Arc::new(Check {
                token: self.token.clone(),
                tls: self.tls.is_some(),
                open: self.insecure,
                policy,
            }),
        }
    }

    /// What the page transport's hello carries: the token's bytes, or nothing.
    pub fn hello_token(&self) -> &[u8] {
        self.token.as_ref().map_or(&[][..], |t| t.0.as_bytes())
    }

    /// Whether a page transport peer that presented `token` in its hello may go on. Over
    /// TLS the handshake already admitted it to the mesh; only a cache service sends
    /// pages, so its certificate (`peer_certs`, the chain it presented) must name that
    /// role.
    pub fn admits_hello<C: AsRef<[u8]>>(&self, token: &[u8], peer_certs: Option<&[C]>) -> bool {
        let ok = match (&self.tls, &self.token) {
            _ if self.insecure => true,
            (Some(_), _) => peer_certs.is_some_and(|c| Roles::of_chain(c).contains(Role::Cache)),
            (None, Some(t)) => t.matches(token),
            (None, None) => false,
        };
        if !ok {
            crate::refusal::count();
        }
        ok
    }
}

/// A gRPC channel that sends the mesh token with every call.
pub type AuthChannel = InterceptedService<Channel, Bearer>;

/// Adds `authorization: Bearer <token>` to each call (nothing without a token).
#[derive(Clone)]
pub struct Bearer(Option<MetadataValue<Ascii>>);

impl Interceptor for Bearer {
    fn call(&mut self, mut req: Request<()>) -> Result<Request<()>, Status> {
        if let Some(v) = &self.0 {
            req.metadata_mut().insert(AUTHORIZATION, v.clone());
        }
        Ok(req)
    }
}

/// A gRPC service behind the mesh credential ([`MeshAuth::guard`]).
#[derive(Clone)]
pub struct Guarded<S> {
    inner: S,
    check: Arc<Check>,
}

/// What [`Guarded`] checks each call against.
struct Check {
    token: Option<MeshToken>,
    tls: bool,
    /// `--insecure-plaintext`: every call is let in (for clients that cannot present the
    /// credential, such as a third-party router).
    open: bool,
    policy: &'static Policy,
}

impl Check {
    /// Who is calling `method`, or why the call is refused. A call over mutual TLS passed
    /// the handshake and is judged by its certificate's roles; otherwise the token must
    /// match (or, with no token and no TLS, the service runs open).
    fn admit<B>(&self, req: &http::Request<B>) -> Result<Caller, Refusal> {
        if self.open {
            return Ok(Caller::Open);
        }
        let method = req.uri().path().rsplit('/').next().unwrap_or_default();
        if self.tls {
            let certs = req
                .extensions()
                .get::<TlsConnectInfo<TcpConnectInfo>>()
                .and_then(|i| i.peer_certs());
            let Some(certs) = certs.filter(|c| !c.is_empty()) else {
                return Err(Refusal::NoCertificate.counted());
            };
            let caller = Caller::Cert(Roles::of_chain(&certs));
            let allowed = self.policy.roles(method);
            if !caller.may(allowed) {
                // The message is made only for a refusal, not on every call.
                caller.require(allowed, &format!("{}.{method}", self.policy.service))?;
            }
            return Ok(caller);
        }
        let Some(token) = &self.token else {
            return Ok(Caller::Open);
        };
        let presented = req
            .headers()
            .get(AUTHORIZATION)
            .and_then(|v| v.as_bytes().strip_prefix(b"Bearer "));
        match presented {
            Some(p) if token.matches(p) => Ok(Caller::Token),
            Some(_) => Err(Refusal::WrongToken.counted()),
            None => Err(Refusal::NoToken.counted()),
        }
    }
}

impl<S: NamedService> NamedService for Guarded<S> {
    const NAME: &'static str = S::NAME;
}

impl<S, B> Service<http::Request<B>> for Guarded<S>
where
    S: Service<http::Request<B>, Response = http::Response<tonic::body::Body>>,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = Pin<Box<dyn Future<Output = Result<S::Response, S::Error>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, mut req: http::Request<B>) -> Self::Future {
        match self.check.admit(&req) {
            Ok(caller) => {
                req.extensions_mut().insert(caller);
                Box::pin(self.inner.call(req))
            }
            Err(refused) => Box::pin(std::future::ready(Ok(Status::from(refused).into_http()))),
        }
    }
}

impl TlsArgs {
    /// The credential these flags (and [`TOKEN_ENV`]) describe. Not checked for being
    /// enough: each listener does that ([`MeshAuth::check_listen`]).
    pub fn auth(&self) -> Result<MeshAuth, TlsError> {
        let tls = self.load()?;
        let token = match (&self.mesh_token, &self.mesh_token_file) {
            (Some(t), _) => Some(t.clone()),
            (None, Some(path)) => Some(MeshToken::from_file(path)?),
            (None, None) => match std::env::var(TOKEN_ENV) {
                Ok(t) if !t.is_empty() => Some(MeshToken::parse(&t, TOKEN_ENV)?),
                _ => None,
            },
        };
        Ok(MeshAuth::new(tls, token, self.insecure_plaintext))
    }

    /// `--mesh-token-file` and `--insecure-plaintext` for a child's command line (the
    /// token itself goes through the environment).
    pub(crate) fn auth_args(&self, out: &mut Vec<String>) {
        if let Some(p) = &self.mesh_token_file {
            out.push("--mesh-token-file".to_owned());
            out.push(p.display().to_string());
        }
        if self.insecure_plaintext {
            out.push("--insecure-plaintext".to_owned());
        }
    }
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::PermissionsExt;

    use tonic_health::pb::health_client::HealthClient;
    use tonic_health::pb::{HealthCheckRequest, health_check_response::ServingStatus};

    use super::*;

    fn token(c: char) -> MeshToken {
        MeshToken::parse(&c.to_string().repeat(40), "a test").unwrap()
    }

    /// The test service's policy: only a worker may call Check.
    static HEALTH: Policy = Policy {
        service: "grpc.health.v1.Health",
        methods: &[("Check", Roles::of(&[Role::Worker]))],
    };

    /// A guarded health service on loopback, and its URL.
    async fn serve(auth: MeshAuth) -> (String, tokio_util::sync::CancellationToken) {
        let (reporter, service) = tonic_health::server::health_reporter();
        reporter
            .set_service_status("", tonic_health::ServingStatus::Serving)
            .await;
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", l.local_addr().unwrap());
        let stop = tokio_util::sync::CancellationToken::new();
        let server = auth
            .server()
            .unwrap()
            .add_service(auth.guard(&HEALTH, service));
        let s = stop.clone();
        tokio::spawn(async move {
            server
                .serve_with_incoming_shutdown(
                    tonic::transport::server::TcpIncoming::from(l),
                    s.cancelled_owned(),
                )
                .await
        });
        (url, stop)
    }

    async fn check(client: &MeshAuth, url: &str) -> Result<ServingStatus, tonic::Code> {
        let mut c = HealthClient::new(client.connect(url).await.unwrap());
        c.check(HealthCheckRequest::default())
            .await
            .map(|r| r.into_inner().status())
            .map_err(|s| s.code())
    }

    #[tokio::test]
    async fn a_call_without_the_token_or_with_another_is_refused_unauthenticated_and_counted() {
        let (url, stop) = serve(MeshAuth::token(token('a'))).await;
        let before = refused_total();
        let open = MeshAuth::open();
        assert_eq!(check(&open, &url).await, Err(tonic::Code::Unauthenticated));
        let other = MeshAuth::token(token('b'));
        assert_eq!(check(&other, &url).await, Err(tonic::Code::Unauthenticated));
        assert!(refused_total() >= before + 2);
        let member = MeshAuth::token(token('a'));
        assert_eq!(check(&member, &url).await, Ok(ServingStatus::Serving));
        stop.cancel();
    }

    #[tokio::test]
    async fn over_mutual_tls_the_certificate_is_the_credential() {
        let ca = crate::test_ca::Ca::new("mesh");
        let server = MeshAuth::new(Some(ca.mesh(&["127.0.0.1"])), None, false);
        let (url, stop) = serve(server).await;
        let client = MeshAuth::new(Some(ca.mesh(&["127.0.0.1"])), None, false);
        assert_eq!(check(&client, &url).await, Ok(ServingStatus::Serving));
        stop.cancel();
    }

    #[tokio::test]
    async fn over_mutual_tls_a_certificate_without_the_methods_role_is_refused_permission_denied() {
        let ca = crate::test_ca::Ca::new("mesh");
        let server = MeshAuth::new(Some(ca.member(&["127.0.0.1"], &["cache"])), None, false);
        let (url, stop) = serve(server).await;
        let as_role =
            |roles: &[&str]| MeshAuth::new(Some(ca.member(&["127.0.0.1"], roles)), None, false);
        let before = refused_total();
        for wrong in [&["gateway"][..], &["cache", "tokenizer"], &[]] {
            assert_eq!(
                check(&as_role(wrong), &url).await,
                Err(tonic::Code::PermissionDenied),
                "{wrong:?}"
            );
        }
        assert!(refused_total() >= before + 3, "counted");
        assert_eq!(
            check(&as_role(&["worker"]), &url).await,
            Ok(ServingStatus::Serving)
        );
        assert_eq!(
            check(&as_role(&["gateway", "worker"]), &url).await,
            Ok(ServingStatus::Serving)
        );
        // Another CA's certificate, whatever its roles, does not get past the handshake.
        let stranger = crate::test_ca::Ca::new("elsewhere");
        let c = MeshAuth::new(
            Some(stranger.member(&["127.0.0.1"], &["worker"])),
            None,
            false,
        );
        assert!(c.connect(&url).await.is_err() || check(&c, &url).await.is_err());
        stop.cancel();
    }

    #[test]
    fn a_service_needs_a_credential_and_tls_beyond_loopback_unless_told_to_run_open() {
        let lo: SocketAddr = "127.0.0.1:7000".parse().unwrap();
        let wide: SocketAddr = "10.0.0.1:7000".parse().unwrap();
        let none = MeshAuth::default();
        let err = none.check_listen("the worker", lo).unwrap_err().to_string();
        assert!(
            err.contains("no mesh credential") && err.contains("--mesh-token-file"),
            "{err}"
        );
        assert!(none.require("the gateway").is_err());
        let tok = MeshAuth::token(token('a'));
        tok.check_listen("the worker", lo).unwrap();
        tok.require("the gateway").unwrap();
        let err = tok
            .check_listen("the worker", wide)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("beyond loopback") && err.contains("--insecure-plaintext"),
            "{err}"
        );
        let ca = crate::test_ca::Ca::new("mesh");
        MeshAuth::new(Some(ca.mesh(&["10.0.0.1"])), None, false)
            .check_listen("the worker", wide)
            .unwrap();
        let open = MeshAuth::new(None, Some(token('a')), true);
        open.check_listen("the worker", wide).unwrap();
        assert!(insecure(), "the gauge says so");
    }

    #[test]
    fn a_service_told_to_run_open_says_so_even_with_a_credential_on_loopback() {
        // The gauge is per process; nextest runs each test in a process of its own.
        assert!(!insecure());
        let lo: SocketAddr = "127.0.0.1:7000".parse().unwrap();
        MeshAuth::token(token('a'))
            .check_listen("the worker", lo)
            .unwrap();
        assert!(!insecure(), "a credential on loopback is not open");
        MeshAuth::new(None, Some(token('a')), true)
            .check_listen("the worker", lo)
            .unwrap();
        assert!(insecure(), "it lets every caller in, and the gauge says so");
    }

    #[test]
    fn a_token_is_long_visible_ascii_and_its_file_private() {
        let short = MeshToken::parse("abc", "x").unwrap_err().to_string();
        assert!(short.contains("at least 32"), "{short}");
        assert!(MeshToken::parse(&"é".repeat(40), "x").is_err());
        assert!(MeshToken::parse(&format!("{} ", "a b".repeat(20)), "x").is_err());
        let t = MeshToken::generate();
        assert_eq!(t.expose().len(), 64);
        assert_ne!(t, MeshToken::generate());
        assert_eq!(format!("{t:?}"), "MeshToken(..)");

        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("token");
        std::fs::write(&path, format!("{}\n", t.expose())).unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644)).unwrap();
        let err = MeshToken::from_file(&path).unwrap_err().to_string();
        assert!(err.contains("other users may read it"), "{err}");
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).unwrap();
        assert_eq!(MeshToken::from_file(&path).unwrap(), t);
        let args = TlsArgs {
            mesh_token_file: Some(path),
            ..Default::default()
        };
        assert_eq!(args.auth().unwrap().mesh_token(), Some(&t));
        // The file goes to a child as a flag; the token itself never does.
        let argv = args.to_args().join(" ");
        assert!(
            argv.contains("--mesh-token-file") && !argv.contains(t.expose()),
            "{argv}"
        );
    }

    #[test]
    fn the_page_transport_hello_admits_the_token_only() {
        let member = MeshAuth::token(token('a'));
        let no_tls: Option<&[Vec<u8>]> = None;
        assert!(member.admits_hello(member.hello_token(), no_tls));
        assert!(!member.admits_hello(MeshAuth::token(token('b')).hello_token(), no_tls));
        assert!(!member.admits_hello(b"", no_tls));
        assert!(MeshAuth::open().admits_hello(b"", no_tls));
    }
}
