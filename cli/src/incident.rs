//! `pdmesh incident list|show`: the incident reports a mesh wrote, read from their
//! directory or asked of a gateway (`GET /debug/incidents`).

use std::path::PathBuf;

use anyhow::Context as _;

use crate::args::{IncidentArgs, IncidentCommand};

/// Where `pdmesh up` has its services write reports unless told otherwise:
/// `$XDG_STATE_HOME/pdmesh/incidents`, else `~/.local/state/pdmesh/incidents`.
pub fn default_dir() -> PathBuf {
    let state = std::env::var_os("XDG_STATE_HOME")
        .map(PathBuf::from)
        .filter(|p| p.is_absolute())
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".local/state")))
        .unwrap_or_else(std::env::temp_dir);
    state.join("pdmesh").join("incidents")
}

pub async fn run(args: IncidentArgs) -> anyhow::Result<()> {
    match (&args.command, &args.gateway) {
        (IncidentCommand::List, None) => {
            let dir = args.dir.clone().unwrap_or_else(default_dir);
            let all = pdmesh_incident::list(&dir)?;
            if all.is_empty() {
                println!("no incident reports in {}", dir.display());
            }
            for i in all {
                println!(
                    "{}  {}  x{}  {}  {}",
                    i.id,
                    i.kind.name(),
                    i.repeats,
                    i.place.service,
                    dir.join(format!("{}.md", i.id)).display()
                );
            }
        }
        (IncidentCommand::Show { id, json }, None) => {
            let dir = args.dir.clone().unwrap_or_else(default_dir);
            let i = pdmesh_incident::read(&dir, id)?;
            if *json {
                println!("{}", serde_json::to_string_pretty(&i)?);
            } else {
                print!("{}", pdmesh_incident::render(&i));
            }
        }
        (cmd, Some(url)) => {
            let base = url.trim_end_matches('/');
            let path = match cmd {
                IncidentCommand::List => "/debug/incidents".to_owned(),
                IncidentCommand::Show { id, json: false } => {
                    format!("/debug/incidents/{id}?format=markdown")
                }
                IncidentCommand::Show { id, json: true } => format!("/debug/incidents/{id}"),
            };
            let mut req = reqwest::Client::new().get(format!("{base}{path}"));
            if let Some(key) = &args.admin_key {
                req = req.bearer_auth(key);
            }
            let resp = req.send().await.with_context(|| format!("asking {base}"))?;
            let status = resp.status();
            let body = resp.text().await?;
            anyhow::ensure!(status.is_success(), "{base}{path}: {status}: {body}");
            match cmd {
                IncidentCommand::List => {
                    let v: serde_json::Value = serde_json::from_str(&body)?;
                    for i in v["data"].as_array().into_iter().flatten() {
                        println!(
                            "{}  {}  x{}  {}",
                            i["id"].as_str().unwrap_or_default(),
                            i["kind"].as_str().unwrap_or_default(),
                            i["repeats"],
                            i["service"].as_str().unwrap_or_default()
                        );
                    }
                }
                IncidentCommand::Show { .. } => print!("{body}"),
            }
        }
    }
    Ok(())
}
