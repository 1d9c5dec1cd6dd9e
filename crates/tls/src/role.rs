//! Roles: which part of the mesh a certificate speaks for, and which parts may make each
//! call.
//!
//! Over mutual TLS a member's certificate names its roles as Organizational Unit entries
//! of its subject (`/OU=worker/CN=host-a`; one OU per role, several allowed): `gateway`,
//! `tokenizer`, `worker` or `cache`. Each gRPC method has a set of roles that may call it
//! ([`Policy`]), so a gateway's certificate cannot register with a cache service as a
//! worker, and a worker's cannot register as a peer cache service or feed pages to the
//! page transport. The mesh token names no role: a caller holding it is a member of every
//! role, which is why meshes that want roles use certificates.

use std::fmt;

use crate::refusal::Refusal;

/// One part of the mesh.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Role {
    /// The HTTP front door: calls tokenizers, workers, and cache services for routing.
    Gateway,
    /// The tokenizer service.
    Tokenizer,
    /// A prefill, decode or unified worker: calls its host's cache service.
    Worker,
    /// A host's cache service: calls other hosts' cache services and sends them pages.
    Cache,
}

impl Role {
    pub const ALL: [Role; 4] = [Role::Gateway, Role::Tokenizer, Role::Worker, Role::Cache];

    /// The role's name, as a certificate's OU entry spells it.
    pub const fn name(self) -> &'static str {
        match self {
            Role::Gateway => "gateway",
            Role::Tokenizer => "tokenizer",
            Role::Worker => "worker",
            Role::Cache => "cache",
        }
    }

    const fn bit(self) -> u8 {
        1 << self as u8
    }

    fn parse(name: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|r| r.name() == name)
    }
}

/// A set of roles.
#[derive(Clone, Copy, Default, PartialEq, Eq, Hash)]
pub struct Roles(u8);

impl Roles {
    pub const NONE: Roles = Roles(0);
    /// Every role: a call any member may make.
    pub const ANY: Roles = Roles::of(&Role::ALL);
    pub const GATEWAY: Roles = Roles::of(&[Role::Gateway]);
    pub const CACHE: Roles = Roles::of(&[Role::Cache]);
    /// A worker or a cache service: the callers of a cache service's page and room calls
    /// (a cache service relays rooms and registers at peers as a worker does).
    pub const WORKER_OR_CACHE: Roles = Roles::of(&[Role::Worker, Role::Cache]);

    pub const fn of(roles: &[Role]) -> Self {
        let mut bits = 0;
        let mut i = 0;
        while i < roles.len() {
            bits |= roles[i].bit();
            i += 1;
        }
        Roles(bits)
    }

    pub const fn contains(self, role: Role) -> bool {
        self.0 & role.bit() != 0
    }

    pub const fn intersects(self, other: Roles) -> bool {
        self.0 & other.0 != 0
    }

    pub fn iter(self) -> impl Iterator<Item = Role> {
        Role::ALL.into_iter().filter(move |r| self.contains(*r))
    }

    /// The roles a DER certificate names in its subject's OU entries (others ignored; a
    /// certificate that cannot be parsed names none).
    pub fn of_certificate(der: &[u8]) -> Roles {
        let Ok((_, cert)) = x509_parser::parse_x509_certificate(der) else {
            return Roles::NONE;
        };
        let mut roles = Roles::NONE;
        for ou in cert.subject().iter_organizational_unit() {
            if let Some(r) = ou.as_str().ok().and_then(Role::parse) {
                roles.0 |= r.bit();
            }
        }
        roles
    }

    /// The roles of a TLS peer: its leaf certificate's (the first of the chain).
    pub fn of_chain<C: AsRef<[u8]>>(chain: &[C]) -> Roles {
        chain
            .first()
            .map_or(Roles::NONE, |c| Roles::of_certificate(c.as_ref()))
    }
}

impl fmt::Debug for Roles {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Roles({self})")
    }
}

/// "worker or cache"; "no role".
impl fmt::Display for Roles {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let names: Vec<&str> = self.iter().map(Role::name).collect();
        match names.as_slice() {
            [] => f.write_str("no role"),
            [one] => f.write_str(one),
            [init @ .., last] => write!(f, "{} or {last}", init.join(", ")),
        }
    }
}

/// Who made a call, as the service's guard admitted it. The guard puts it in every
/// admitted request's extensions ([`Caller::of`]), for checks that depend on the request
/// itself (a cache service's Register as a peer needs the cache role).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Caller {
    /// A certificate the mesh CA signed, naming these roles.
    Cert(Roles),
    /// The mesh token: a member, of whichever role (the token does not say).
    Token,
    /// Let in without a credential by `--insecure-plaintext`.
    Open,
}

impl Caller {
    /// Who made `request`: [`Caller::Open`] when no guard saw it (a service started
    /// without one, in tests).
    pub fn of<T>(request: &tonic::Request<T>) -> Caller {
        request
            .extensions()
            .get::<Caller>()
            .copied()
            .unwrap_or(Caller::Open)
    }

    /// Whether this caller may make a call open to `roles`.
    pub fn may(self, roles: Roles) -> bool {
        match self {
            Caller::Cert(have) => have.intersects(roles),
            Caller::Token | Caller::Open => true,
        }
    }

    /// A refusal (counted with the others) unless this caller may make `what`, a call
    /// open to `roles`.
    pub fn require(self, roles: Roles, what: &str) -> Result<(), Refusal> {
        match self {
            _ if self.may(roles) => Ok(()),
            Caller::Cert(have) => Err(Refusal::WrongRole {
                what: what.to_owned(),
                allowed: roles.to_string(),
                have: have.to_string(),
            }
            .counted()),
            Caller::Token | Caller::Open => Ok(()),
        }
    }
}

/// Which roles may call each method of one gRPC service. A method the table does not
/// name is refused to every certificate (a new RPC is closed until it is given roles).
#[derive(Debug)]
pub struct Policy {
    /// The service, for error messages.
    pub service: &'static str,
    /// Method names (the last part of the gRPC path) and the roles that may call them.
    pub methods: &'static [(&'static str, Roles)],
}

impl Policy {
    /// The roles that may call `method` (a gRPC path's last part).
    pub fn roles(&self, method: &str) -> Roles {
        self.methods
            .iter()
            .find(|(m, _)| *m == method)
            .map_or(Roles::NONE, |(_, r)| *r)
    }

    /// The methods of `proto` (a .proto file's text: its `rpc Name(` lines) this table
    /// does not name: for each service's test that its policy covers every RPC.
    pub fn unlisted<'a>(&self, proto: &'a str) -> Vec<&'a str> {
        proto
            .lines()
            .filter_map(|l| l.trim_start().strip_prefix("rpc "))
            .filter_map(|l| l.split('(').next())
            .map(str::trim)
            .filter(|m| self.roles(m) == Roles::NONE)
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_certificate_names_its_roles_in_its_subjects_organizational_units() {
        let ca = crate::test_ca::Ca::new("mesh");
        let der = |roles: &[&str]| {
            let (pem, _) = ca.leaf_with_roles(&["127.0.0.1"], roles);
            use rustls::pki_types::pem::PemObject;
            rustls::pki_types::CertificateDer::from_pem_slice(pem.as_bytes())
                .unwrap()
                .to_vec()
        };
        assert_eq!(
            Roles::of_certificate(&der(&["worker"])),
            Roles::of(&[Role::Worker])
        );
        assert_eq!(
            Roles::of_certificate(&der(&["worker", "cache"])),
            Roles::WORKER_OR_CACHE
        );
        assert_eq!(
            Roles::of_certificate(&der(&["ops", "cache"])),
            Roles::CACHE,
            "unknown OU entries are ignored"
        );
        assert_eq!(Roles::of_certificate(&der(&[])), Roles::NONE);
        assert_eq!(Roles::of_certificate(b"not a certificate"), Roles::NONE);
        assert_eq!(Roles::of_chain::<Vec<u8>>(&[]), Roles::NONE);
    }

    #[test]
    fn a_certificate_caller_needs_a_role_the_call_allows_and_the_token_is_every_role() {
        let gw = Caller::Cert(Roles::GATEWAY);
        assert!(gw.may(Roles::ANY));
        assert!(!gw.may(Roles::WORKER_OR_CACHE));
        let err = tonic::Status::from(gw.require(Roles::WORKER_OR_CACHE, "Register").unwrap_err());
        assert_eq!(err.code(), tonic::Code::PermissionDenied);
        assert!(
            err.message().contains("worker or cache") && err.message().contains("gateway"),
            "{}",
            err.message()
        );
        assert!(!Caller::Cert(Roles::NONE).may(Roles::ANY));
        assert!(Caller::Token.may(Roles::CACHE));
        assert!(Caller::Open.may(Roles::CACHE));
        assert_eq!(
            Roles::ANY.to_string(),
            "gateway, tokenizer, worker or cache"
        );
        let p = Policy {
            service: "s",
            methods: &[("Register", Roles::WORKER_OR_CACHE)],
        };
        assert_eq!(p.roles("Register"), Roles::WORKER_OR_CACHE);
        assert_eq!(p.roles("Unlisted"), Roles::NONE, "closed by default");
        let proto = "service S {\n  rpc Register(A) returns (B);\n  rpc Gone (A) returns (B);\n}";
        assert_eq!(p.unlisted(proto), vec!["Gone"]);
    }
}
