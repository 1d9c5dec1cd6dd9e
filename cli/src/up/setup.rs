//! What `up` settles before it starts anything: the model to serve, the flags a role
//! allows, and the addresses its services are reached at.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::path::{Path, PathBuf};

use pdmesh_gguf::models::{
    DEFAULT_MODEL, KNOWN_MODELS, KnownModel, cached_model_path, known_model,
};

use super::error::UpError;
use crate::args::{UpArgs, UpRole};
use crate::fetch::{self, Outcome};

/// The model to serve: `--model` (a path, or a known model's id or alias), else the
/// default; a known model is fetched into the cache when missing.
pub(super) fn resolve_model(arg: Option<&Path>) -> Result<PathBuf, UpError> {
    resolve_model_with(arg, cached_model_path, |m| {
        eprintln!(
            "the model {} is not installed yet; fetching it (same as `pdmesh model fetch {}`)",
            m.id, m.id
        );
        match fetch::fetch_known(m, None)? {
            Outcome::Installed(p) | Outcome::AlreadyInstalled(p) => Ok(p),
        }
    })
}

/// [`resolve_model`] with where a known model is cached (`cached`) and how one missing
/// there is fetched (`fetch`), so tests need neither the user's cache nor the network.
/// A path that exists wins over a known model's name.
pub(super) fn resolve_model_with(
    arg: Option<&Path>,
    cached: impl Fn(&KnownModel) -> PathBuf,
    fetch: impl FnOnce(&'static KnownModel) -> Result<PathBuf, UpError>,
) -> Result<PathBuf, UpError> {
    let known = match arg {
        None => &DEFAULT_MODEL,
        // A GGUF file, or a checkpoint directory (DeepSeek V3.2: config.json, safetensors).
        Some(p) if p.is_file() || p.join("config.json").is_file() => return Ok(p.to_owned()),
        Some(p) => {
            let named = p.to_str().and_then(known_model);
            // A known model's cache path, given before it was fetched.
            let cached_at = || {
                KNOWN_MODELS
                    .into_iter()
                    .map(|(m, _)| m)
                    .find(|m| cached(m) == p)
            };
            named
                .or_else(cached_at)
                .ok_or_else(|| UpError::ModelMissing(p.to_owned()))?
        }
    };
    let path = cached(known);
    if path.is_file() {
        return Ok(path);
    }
    fetch(known)
}

/// Flags that belong to another role, or that a role cannot do without.
pub(super) fn check_role(args: &UpArgs) -> Result<(), UpError> {
    let role = args.role;
    let bad = |m: String| Err(UpError::Role(m));
    let remote = [
        ("--prefill-url", !args.prefill_url.is_empty()),
        ("--decode-url", !args.decode_url.is_empty()),
        ("--cache-url", !args.cache_url.is_empty()),
    ];
    match role {
        UpRole::Gateway => {
            if args.prefill_url.is_empty() || args.decode_url.is_empty() {
                return bad("--role gateway needs --prefill-url and --decode-url (the other hosts' workers)".into());
            }
            if args.unified {
                return bad(
                    "--role gateway fronts prefill and decode hosts: drop --unified".into(),
                );
            }
            for u in args
                .prefill_url
                .iter()
                .chain(&args.decode_url)
                .chain(&args.cache_url)
            {
                if !u.starts_with("http://") && !u.starts_with("https://") {
                    return bad(format!("{u:?} is not an http:// URL"));
                }
            }
        }
        UpRole::All => {
            if let Some((flag, _)) = remote.iter().find(|r| r.1) {
                return bad(format!(
                    "{flag} names other hosts' services: it needs --role gateway"
                ));
            }
        }
        UpRole::Prefill | UpRole::Decode => {
            if args.chat_template.is_some() {
                return bad(format!(
                    "--chat-template is for the tokenizer, which --role gateway runs, not --role {}",
                    role.name()
                ));
            }
            if let Some((flag, _)) = remote.iter().find(|r| r.1) {
                return bad(format!(
                    "{flag} is for --role gateway, not --role {}",
                    role.name()
                ));
            }
            if args.unified {
                return bad(format!(
                    "--role {} runs one side of disaggregation: drop --unified",
                    role.name()
                ));
            }
            let n = if role == UpRole::Decode {
                args.decode
            } else {
                args.prefill
            };
            if args.worker_port == 0 || usize::from(args.worker_port) + n > 65536 {
                return bad(format!(
                    "--worker-port {} leaves no room for {n} workers",
                    args.worker_port
                ));
            }
            if args.cache_port == 0 {
                return bad("--cache-port must be a port, not 0".into());
            }
            if args.host.is_unspecified() || args.host.is_loopback() {
                return bad(format!(
                    "--role {} needs --host set to this host's address that the other hosts reach (not {})",
                    role.name(),
                    args.host
                ));
            }
        }
    }
    Ok(())
}

/// The `--chat-template` file, read and compiled before any service starts: one that
/// cannot serve refuses the start, naming the flag and the file, rather than the
/// tokenizer service exiting once the mesh is half up.
pub(super) fn check_chat_template(args: &UpArgs) -> Result<(), UpError> {
    match &args.chat_template {
        Some(path) => pdmesh_tokenizer::read_chat_template(path)
            .map(drop)
            .map_err(UpError::ChatTemplate),
        None => Ok(()),
    }
}

/// The address of `url`'s host and port.
pub(super) async fn url_addr(url: &str) -> Result<SocketAddr, UpError> {
    let bad = || UpError::Role(format!("{url:?} is not a reachable http://HOST:PORT URL"));
    let uri: http::Uri = url.parse().map_err(|_| bad())?;
    let host = uri
        .host()
        .ok_or_else(bad)?
        .trim_matches(['[', ']'])
        .to_owned();
    let port = uri.port_u16().ok_or_else(bad)?;
    tokio::net::lookup_host((host.as_str(), port))
        .await
        .ok()
        .and_then(|mut a| a.next())
        .ok_or_else(bad)
}

/// The name of the i-th worker of a kind: `prefill`, then `prefill-2`, ...
pub(super) fn worker_name(kind: &'static str, i: usize) -> &'static str {
    if i == 0 {
        kind
    } else {
        // A handful per run, for the life of the process.
        Box::leak(format!("{kind}-{}", i + 1).into_boxed_str())
    }
}

/// Where to reach a server bound to `host`: wildcard addresses are probed on loopback.
pub(super) fn reachable(host: IpAddr, port: u16) -> SocketAddr {
    let ip = match host {
        IpAddr::V4(v) if v.is_unspecified() => IpAddr::V4(Ipv4Addr::LOCALHOST),
        IpAddr::V6(v) if v.is_unspecified() => IpAddr::V6(Ipv6Addr::LOCALHOST),
        ip => ip,
    };
    SocketAddr::new(ip, port)
}
