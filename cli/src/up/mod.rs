//! `pdmesh up`: the whole mesh on one machine. Tokenizer, cache service (unless
//! `--no-host-cache`), worker and gateway run as separate child processes of this one (the same binary, re-executed with a service
//! subcommand) on loopback ports. `up` waits until each is healthy, prints the URL, then
//! supervises: a signal stops all children; a child that exits stops the others and
//! makes `up` fail naming it — or, with `--restart`, is started again the same way after
//! a backoff. Children die with `up` even if it is killed outright.
//!
//! With `--role`, `up` runs one host's part of a mesh over several: `prefill` or `decode`
//! (that host's cache service and workers, on `--host` at fixed ports) or `gateway` (the
//! tokenizer and the gateway, in front of the other hosts' workers).

mod error;
mod ports;
mod service;
mod setup;
#[cfg(test)]
mod tests;

use std::net::{Ipv4Addr, SocketAddr};
use std::process::ExitStatus;
use std::time::Duration;

use futures::future::select_all;
use pdmesh_gguf::models::DEFAULT_MODEL;

use self::ports::MeshLayout;
use self::service::{Backoff, Secrets, listen_on, signal_group, spawn, stop_all, wait_healthy};
use self::setup::{
    check_chat_template, check_role, reachable, resolve_model, url_addr, worker_name,
};
use crate::args::{UpArgs, UpRole};
use crate::probe;
use crate::serve::Signals;

pub use self::error::UpError;

/// How `up` ended without an error.
#[derive(Debug, PartialEq, Eq)]
pub enum Stopped {
    /// A signal asked for it.
    BySignal(&'static str),
}

/// Asks the served model one question through the gateway and prints the answer, so a
/// first `pdmesh up` shows the whole path works: a chat question, or, for a model without
/// a chat template (`chat` false), the start of a sentence to complete. A failure is
/// reported, not fatal.
async fn smoke_test(gateway: SocketAddr, model: &str, api_key: Option<&str>, chat: bool) {
    const QUESTION: &str = "What is the capital of France? Answer in one sentence.";
    const PROMPT: &str = "The capital of France is";
    let (path, asked, body, answer_at) = if chat {
        let body = serde_json::json!({
            "model": model,
            "messages": [{ "role": "user", "content": QUESTION }],
            "max_tokens": 48,
            "temperature": 0,
        });
        (
            "/v1/chat/completions",
            QUESTION,
            body,
            "/choices/0/message/content",
        )
    } else {
        let body = serde_json::json!({
            "model": model,
            "prompt": PROMPT,
            "max_tokens": 16,
            "temperature": 0,
        });
        ("/v1/completions", PROMPT, body, "/choices/0/text")
    };
    let answer = probe::http_post_json(gateway, path, &body, api_key, SMOKE_TIMEOUT).await;
    match answer {
        Some((200, bytes)) => {
            let v: serde_json::Value = serde_json::from_slice(&bytes).unwrap_or_default();
            match v.pointer(answer_at).and_then(|t| t.as_str()) {
                Some(text) => {
                    println!("asked: {asked}");
                    println!("model: {}", text.trim());
                }
                None => eprintln!(
                    "pdmesh up: the first test question's answer has no message content: {}",
                    String::from_utf8_lossy(&bytes)
                ),
            }
        }
        Some((status, bytes)) => {
            eprintln!(
                "pdmesh up: the first test question failed with HTTP {status}: {}",
                String::from_utf8_lossy(&bytes)
            );
        }
        None => {
            eprintln!("pdmesh up: the first test question got no answer within {SMOKE_TIMEOUT:?}")
        }
    }
}

/// Longest the first test question may take.
const SMOKE_TIMEOUT: Duration = Duration::from_secs(120);

/// Runs the mesh until a signal (`Ok`) or until a child exits (`Err` naming it; with
/// `--restart`, the child is started again and only a failed start ends the mesh). Must
/// run on a current-thread runtime: the parent-death signal is tied to the spawning thread
/// (restarted children are spawned from it too).
pub async fn run(args: UpArgs) -> Result<Stopped, UpError> {
    let mut signals = Signals::new().map_err(UpError::Signals)?;
    // Flags are checked before a model is fetched, and a template file that cannot serve
    // refuses the start before any service runs.
    check_role(&args)?;
    check_chat_template(&args)?;
    let model = resolve_model(args.model.as_deref())?;
    let exe = std::env::current_exe().map_err(UpError::CurrentExe)?;
    let pd = !args.unified;
    if pd && args.no_host_cache {
        return Err(UpError::PdNeedsCache);
    }
    if args.disk_dir.is_some() && args.no_host_cache {
        return Err(UpError::DiskNeedsCache);
    }
    if pd && (args.prefill == 0 || args.decode == 0) {
        return Err(UpError::NoWorkers);
    }
    let role = args.role;
    // The mesh credential: the one given (TLS, a token file or PDMESH_MESH_TOKEN), else a
    // token made for this mesh; every child gets the token in its environment.
    let mut tls = args.tls.auth()?;
    if tls.mesh_token().is_none() {
        tls = pdmesh_tls::MeshAuth::new(
            tls.tls().cloned(),
            Some(pdmesh_tls::MeshToken::generate()),
            tls.is_insecure(),
        );
    }
    let mesh_env: Secrets = tls
        .mesh_token()
        .map(|t| (pdmesh_tls::auth::TOKEN_ENV, t.expose().to_owned()))
        .into_iter()
        .collect();
    let tls_args = args.tls.to_args();
    let (has_gateway, has_cache) = (
        matches!(role, UpRole::All | UpRole::Gateway),
        !args.no_host_cache && role != UpRole::Gateway,
    );
    // Every service's socket, bound here before any starts (see `listen_on`); the gateway's first,
    // so that a port the user named is taken before the kernel picks any other.
    let gateway_sock = has_gateway
        .then(|| listen_on(SocketAddr::new(args.host, args.port)))
        .transpose()?;
    let local = || listen_on(SocketAddr::new(Ipv4Addr::LOCALHOST.into(), 0));
    let tok_sock = has_gateway.then(local).transpose()?;
    // (name, role subcommand, socket, extra flags): the decode worker (or the unified
    // one) first.
    let mut workers: Vec<(&'static str, &'static str, std::net::TcpListener, &[String])> =
        Vec::new();
    // This host's part of a mesh over several: its services on --host at fixed ports.
    let on_host = |port: u16| listen_on(SocketAddr::new(args.host, port));
    let part = match role {
        UpRole::Decode => Some(("decode", args.decode, &args.decode_args)),
        UpRole::Prefill => Some(("prefill", args.prefill, &args.prefill_args)),
        UpRole::All | UpRole::Gateway => None,
    };
    if let Some((kind, n, extra)) = part {
        for i in 0..n {
            let port = u16::try_from(i)
                .ok()
                .and_then(|i| args.worker_port.checked_add(i))
                .filter(|&p| p != 0)
                .ok_or_else(|| {
                    UpError::Role(format!(
                        "--worker-port {} leaves no room for {n} workers",
                        args.worker_port
                    ))
                })?;
            workers.push((worker_name(kind, i), kind, on_host(port)?, extra));
        }
    } else if role == UpRole::Gateway {
        // No workers here: they are on the other hosts.
    } else if pd {
        for i in 0..args.decode {
            workers.push((
                worker_name("decode", i),
                "decode",
                local()?,
                &args.decode_args,
            ));
        }
        for i in 0..args.prefill {
            workers.push((
                worker_name("prefill", i),
                "prefill",
                local()?,
                &args.prefill_args,
            ));
        }
    } else {
        workers.push(("worker", "worker", local()?, &[]));
    }
    let bound = |l: &std::net::TcpListener| {
        l.local_addr()
            .map(|a| reachable(a.ip(), a.port()))
            .map_err(|source| UpError::Listen {
                addr: SocketAddr::new(args.host, 0),
                source,
            })
    };
    let workers = workers
        .into_iter()
        .map(|(name, sub, l, extra)| Ok((name, sub, bound(&l)?, extra, l)))
        .collect::<Result<Vec<_>, UpError>>()?;
    let worker_addr = match role {
        // The model id comes from the first decode worker on another host.
        UpRole::Gateway => url_addr(&args.decode_url[0]).await?,
        _ => workers[0].2,
    };
    let cache_sock = match role {
        _ if !has_cache => None,
        UpRole::Prefill | UpRole::Decode => Some(on_host(args.cache_port)?),
        _ => Some(local()?),
    };
    let cache_addr = cache_sock.as_ref().map(bound).transpose()?;
    let tok_addr = tok_sock.as_ref().map(bound).transpose()?;
    let port = match &gateway_sock {
        Some(l) => bound(l)?.port(),
        None => args.port,
    };
    let model_arg = model.to_string_lossy().into_owned();
    // Every service writes its incident reports into one directory.
    let incident_dir = args
        .incident_dir
        .clone()
        .unwrap_or_else(crate::incident::default_dir)
        .display()
        .to_string();
    // Reports' replay commands name the gateway as this machine reaches it.
    let replay_url = format!("http://{}/v1", reachable(args.host, port));

    let mut services = Vec::new();
    let started = (|| -> Result<(), UpError> {
        if let (Some(sock), Some(addr)) = (&tok_sock, tok_addr) {
            let mut tok_args = vec!["tokenizer".into(), "--model".into(), model_arg.clone()];
            if let Some(t) = &args.chat_template {
                tok_args.extend(["--chat-template".into(), t.display().to_string()]);
            }
            tok_args.extend(tls_args.iter().cloned());
            services.push(spawn(
                "tokenizer",
                &exe,
                &tok_args,
                (sock, addr),
                &mesh_env,
            )?);
        }
        if let (Some(sock), Some(addr)) = (&cache_sock, cache_addr) {
            let mut cache_args = vec![
                "cache".into(),
                "--incident-dir".into(),
                incident_dir.clone(),
            ];
            cache_args.extend(tls_args.iter().cloned());
            if let Some(dir) = &args.disk_dir {
                cache_args.extend(["--disk-dir".into(), dir.display().to_string()]);
            }
            cache_args.extend(args.cache_args.iter().cloned());
            services.push(spawn("cache", &exe, &cache_args, (sock, addr), &mesh_env)?);
        }
        for (name, sub, addr, extra, sock) in &workers {
            let mut worker_args = vec![
                (*sub).into(),
                "--model".into(),
                model_arg.clone(),
                "--incident-dir".into(),
                incident_dir.clone(),
            ];
            if has_gateway {
                worker_args.extend(["--incident-replay-url".into(), replay_url.clone()]);
            }
            if let Some(cache) = cache_addr {
                worker_args.extend(["--cache-url".into(), format!("http://{cache}")]);
            }
            worker_args.extend(tls_args.iter().cloned());
            worker_args.extend(args.worker_args.iter().cloned());
            worker_args.extend(extra.iter().cloned());
            services.push(spawn(name, &exe, &worker_args, (sock, *addr), &mesh_env)?);
        }
        let (Some(gateway_sock), Some(tok_addr)) = (&gateway_sock, tok_addr) else {
            return Ok(());
        };
        let urls = |kind: &str| {
            workers
                .iter()
                .filter(|w| w.1 == kind)
                .map(|w| format!("http://{}", w.2))
                .collect::<Vec<_>>()
                .join(",")
        };
        let mut gw_args = vec![
            "gateway".into(),
            "--tokenizer-url".into(),
            format!("http://{tok_addr}"),
            // The tokenizer's own model file: the gateway detokenizes in process.
            "--model".into(),
            model_arg.clone(),
            "--incident-dir".into(),
            incident_dir.clone(),
            "--incident-replay-url".into(),
            replay_url.clone(),
        ];
        if role == UpRole::Gateway {
            gw_args.extend(["--prefill-url".into(), args.prefill_url.join(",")]);
            gw_args.extend(["--decode-url".into(), args.decode_url.join(",")]);
            if !args.cache_url.is_empty() {
                gw_args.extend(["--cache-url".into(), args.cache_url.join(",")]);
            }
        } else if pd {
            gw_args.extend(["--prefill-url".into(), urls("prefill")]);
            gw_args.extend(["--decode-url".into(), urls("decode")]);
        } else {
            gw_args.extend(["--worker-url".into(), format!("http://{worker_addr}")]);
        }
        if let Some(cache) = cache_addr {
            gw_args.extend(["--cache-url".into(), format!("http://{cache}")]);
        }
        gw_args.extend(tls_args.iter().cloned());
        gw_args.extend(args.gateway_args.iter().cloned());
        services.push(spawn(
            "gateway",
            &exe,
            &gw_args,
            (gateway_sock, reachable(args.host, port)),
            &[
                mesh_env.clone(),
                args.api_key
                    .iter()
                    .map(|k| ("PDMESH_API_KEY", k.clone()))
                    .collect(),
                args.admin_key
                    .iter()
                    .map(|k| ("PDMESH_ADMIN_KEY", k.clone()))
                    .collect(),
            ]
            .concat(),
        )?);
        Ok(())
    })();
    // Each started service has its own copy of its socket: `up` lets go of its copies,
    // so a service that exits closes its port.
    drop((gateway_sock, tok_sock, cache_sock));
    let workers: Vec<_> = workers
        .into_iter()
        .map(|(name, sub, addr, extra, _)| (name, sub, addr, extra))
        .collect();
    let grace = Duration::from_secs(args.grace);
    if let Err(e) = started {
        stop_all(&mut services, grace).await;
        return Err(e);
    }
    for s in &services {
        eprintln!(
            "pdmesh up: started the {} (pid {}) on {}",
            s.name, s.pid, s.addr
        );
    }

    let ready = tokio::select! {
        r = wait_healthy(&mut services, Duration::from_secs(args.startup_timeout), &tls) => r.map(|()| None),
        sig = signals.recv() => Ok(Some(sig)),
    };
    match ready {
        Err(e) => {
            stop_all(&mut services, grace).await;
            return Err(e);
        }
        Ok(Some(sig)) => {
            eprintln!("pdmesh up: {sig} received during startup; stopping");
            stop_all(&mut services, grace).await;
            return Ok(Stopped::BySignal(sig));
        }
        Ok(None) => {}
    }

    let model_id = probe::worker_model_id(worker_addr, &tls)
        .await
        .unwrap_or_else(|| DEFAULT_MODEL.id.to_owned());
    // A base model (no chat template, none given) serves completions only.
    let chat = match tok_addr {
        Some(a) => probe::tokenizer_has_chat_template(a, &tls)
            .await
            .unwrap_or(true),
        None => true,
    };
    let shown = reachable(args.host, port);
    let url = format!("http://{shown}/v1");
    // Before the ports file: whoever waits for that file finds an idle mesh.
    if has_gateway && !args.no_smoke_test {
        tokio::select! {
            () = smoke_test(shown, &model_id, args.api_key.as_deref(), chat) => {}
            sig = signals.recv() => {
                eprintln!("pdmesh up: {sig} received; stopping the services");
                stop_all(&mut services, grace).await;
                return Ok(Stopped::BySignal(sig));
            }
        }
    }
    let layout = MeshLayout {
        url: url.clone(),
        host: shown.ip(),
        pd,
        gateway: if has_gateway { port } else { 0 },
        tokenizer: tok_addr.map_or(0, |a| a.port()),
        workers: workers.iter().map(|w| (w.0, w.1, w.2.port())).collect(),
        cache: cache_addr.map_or(0, |a| a.port()),
        model: model_id.clone(),
        restart: args.restart,
    };
    if let Some(path) = &args.ports_json
        && let Err(e) = layout.write(path, &services)
    {
        stop_all(&mut services, grace).await;
        return Err(e);
    }
    let auth = match (&args.api_key, std::env::var_os("PDMESH_API_KEY")) {
        (None, _) => "",
        (Some(_), Some(_)) => " -H \"Authorization: Bearer $PDMESH_API_KEY\"",
        (Some(_), None) => " -H 'Authorization: Bearer <your --api-key>'",
    };
    if has_gateway {
        println!("pdmesh is up: {url} (model {model_id})");
        if !chat {
            println!(
                "this model has no chat template: it serves /v1/completions only (give --chat-template FILE for chat)"
            );
        }
        println!("try:");
        if chat {
            println!(
                "  curl {url}/chat/completions -H 'Content-Type: application/json'{auth} \\\n    -d '{{\"model\": \"{model_id}\", \"messages\": [{{\"role\": \"user\", \"content\": \"Hello!\"}}]}}'"
            );
        } else {
            println!(
                "  curl {url}/completions -H 'Content-Type: application/json'{auth} \\\n    -d '{{\"model\": \"{model_id}\", \"prompt\": \"Monday, Tuesday,\", \"max_tokens\": 16}}'"
            );
        }
    } else {
        let kind = role.name();
        let list: Vec<String> = workers.iter().map(|w| format!("http://{}", w.2)).collect();
        let cache = cache_addr.map_or_else(String::new, |a| format!("http://{a}"));
        println!("pdmesh {kind} host is up (model {model_id}): cache service {cache}");
        println!(
            "  give the gateway host --{kind}-url {} --cache-url {cache}",
            list.join(",")
        );
        let peers_named = args.cache_args.iter().any(|a| a.starts_with("--peer"));
        if tls.tls().is_none() && !peers_named {
            // Without TLS a cache service relays rooms only to the homes --peer names.
            println!(
                "  and, without TLS, name the other hosts' cache services here: --cache-arg=--peer=http://HOST:PORT"
            );
        }
    }
    println!("press Ctrl-C to stop");

    let mut backoff: Vec<Backoff> = services.iter().map(|_| Backoff::default()).collect();
    loop {
        let exited = tokio::select! {
            (status, i, _) = select_all(services.iter_mut().map(|s| Box::pin(s.child.wait()))) => Ok((i, status)),
            sig = signals.recv() => Err(sig),
        };
        let (i, status) = match exited {
            Ok(x) => x,
            Err(sig) => {
                eprintln!("pdmesh up: {sig} received; stopping the services");
                stop_all(&mut services, grace).await;
                return Ok(Stopped::BySignal(sig));
            }
        };
        let (name, pid) = (services[i].name, services[i].pid);
        let status = match status {
            Ok(s) => s,
            Err(e) => {
                eprintln!("pdmesh up: waiting for the {name} failed: {e}");
                ExitStatus::default()
            }
        };
        if !args.restart {
            eprintln!(
                "pdmesh up: the {name} (pid {pid}) exited with {status}; stopping the other services"
            );
            stop_all(&mut services, grace).await;
            return Err(UpError::ChildExited { name, pid, status });
        }
        // Whatever the service left in its process group goes with it.
        signal_group(pid, libc::SIGKILL);
        let wait = backoff[i].after_exit(services[i].started.elapsed());
        eprintln!(
            "pdmesh up: the {name} (pid {pid}) exited with {status}; restarting it in {} s",
            wait.as_secs_f64()
        );
        tokio::select! {
            () = tokio::time::sleep(wait) => {}
            sig = signals.recv() => {
                eprintln!("pdmesh up: {sig} received; stopping the services");
                stop_all(&mut services, grace).await;
                return Ok(Stopped::BySignal(sig));
            }
        }
        match services[i].respawn(&exe) {
            Ok(s) => services[i] = s,
            Err(e) => {
                eprintln!("pdmesh up: restarting the {name} failed; stopping the other services");
                stop_all(&mut services, grace).await;
                return Err(e);
            }
        }
        eprintln!(
            "pdmesh up: restarted the {name} (pid {}) on {}",
            services[i].pid, services[i].addr
        );
        if let Some(path) = &args.ports_json
            && let Err(e) = layout.write(path, &services)
        {
            stop_all(&mut services, grace).await;
            return Err(e);
        }
    }
}
