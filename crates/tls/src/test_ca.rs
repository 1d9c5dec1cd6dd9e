//! Certificates for tests: a throwaway CA and the services' certificates it signs
//! (feature `test-ca`; never used by the services themselves), and the mesh token of a
//! test process.

use crate::MeshTls;

/// A throwaway CA and leaves it signs.
pub struct Ca {
    issuer: rcgen::Issuer<'static, rcgen::KeyPair>,
    pub pem: String,
}

impl Ca {
    pub fn new(name: &str) -> Self {
        let mut params = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
        params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        params
            .distinguished_name
            .push(rcgen::DnType::CommonName, name);
        params.key_usages = vec![
            rcgen::KeyUsagePurpose::KeyCertSign,
            rcgen::KeyUsagePurpose::DigitalSignature,
        ];
        let key = rcgen::KeyPair::generate().unwrap();
        let cert = params.self_signed(&key).unwrap();
        Self {
            pem: cert.pem(),
            issuer: rcgen::Issuer::new(params, key),
        }
    }

    /// A service's certificate for `names` (IP addresses or DNS names), good as server
    /// and as client; its PEM and its key's.
    /// Its subject names the roles of a worker host: worker and cache.
    pub fn leaf(&self, names: &[&str]) -> (String, String) {
        self.leaf_with_roles(names, &["worker", "cache"])
    }

    /// A service's certificate for `names` whose subject names `roles`, one OU entry each
    /// (at most two: rcgen keeps one attribute per type, so the second goes in as the
    /// same OID spelled as a custom type).
    pub fn leaf_with_roles(&self, names: &[&str], roles: &[&str]) -> (String, String) {
        assert!(
            roles.len() <= 2,
            "a test certificate names at most two roles"
        );
        let mut params =
            rcgen::CertificateParams::new(names.iter().map(|s| s.to_string()).collect::<Vec<_>>())
                .unwrap();
        let ou = [
            rcgen::DnType::OrganizationalUnitName,
            rcgen::DnType::CustomDnType(vec![2, 5, 4, 11]),
        ];
        for (ty, r) in ou.into_iter().zip(roles) {
            params.distinguished_name.push(ty, *r);
        }
        params.extended_key_usages = vec![
            rcgen::ExtendedKeyUsagePurpose::ServerAuth,
            rcgen::ExtendedKeyUsagePurpose::ClientAuth,
        ];
        let key = rcgen::KeyPair::generate().unwrap();
        let cert = params.signed_by(&key, &self.issuer).unwrap();
        (cert.pem(), key.serialize_pem())
    }

    /// A worker host's member (worker and cache).
    pub fn mesh(&self, names: &[&str]) -> MeshTls {
        let (cert, key) = self.leaf(names);
        MeshTls::from_pem(self.pem.as_bytes(), cert.as_bytes(), key.as_bytes()).unwrap()
    }

    /// A member with only `roles` (`"worker"`, ...).
    pub fn member(&self, names: &[&str], roles: &[&str]) -> MeshTls {
        let (cert, key) = self.leaf_with_roles(names, roles);
        MeshTls::from_pem(self.pem.as_bytes(), cert.as_bytes(), key.as_bytes()).unwrap()
    }
}

/// This test process's mesh token: random, one per process, so that services and clients
/// a test starts in process agree on it.
pub fn token() -> crate::MeshToken {
    static TOKEN: std::sync::OnceLock<crate::MeshToken> = std::sync::OnceLock::new();
    TOKEN.get_or_init(crate::MeshToken::generate).clone()
}

/// A token-only credential with [`token`].
pub fn auth() -> crate::MeshAuth {
    crate::MeshAuth::token(token())
}

/// The credential flags of a service a test starts in process: [`token`], in code.
pub fn args() -> crate::TlsArgs {
    crate::TlsArgs {
        mesh_token: Some(token()),
        ..Default::default()
    }
}

/// A client made by `new` (a generated client's `new`) on a channel to `url` that carries
/// [`token`].
pub async fn client<C>(
    url: impl AsRef<str>,
    new: impl FnOnce(crate::AuthChannel) -> C,
) -> Result<C, tonic::transport::Error> {
    Ok(new(auth().connect(url.as_ref()).await?))
}
