//! `pdmesh bench matrix`: the corruption matrix in the seed's terms. For each
//! configuration (model, index-K cache form, host mirror on or off, disaggregated or
//! unified) it starts a mesh with `pdmesh up`, drives the same agentic sessions at once,
//! stops it, and replays every answer alone on a unified worker without any cache (one
//! reference mesh per model and cache form, kept up while its configurations run). The
//! table gives each configuration's corruption rate, tool-call validity, TTFT and
//! throughput; `index.html` shows it above one bar chart per metric with a labelled bar per
//! configuration.

mod cells;
mod table;
#[cfg(test)]
mod tests;
mod up;

use std::path::Path;
use std::time::Duration;

use self::cells::reference_args;
use self::table::row_line;
use self::up::Up;
use crate::client::Client;
use crate::drive;
use crate::error::BenchError;
use crate::mesh;
use crate::report;
use crate::run::{Level, Reference, RequestCfg};
use crate::summary::{LevelSummary, Report};
use crate::workload::{Kind, Spec};

pub use self::cells::{Cell, Family, Fault, IndexK, MatrixArgs, Mirror, Mode, cells};
pub use self::table::{Matrix, Row, page, table};
pub use crate::error::MatrixError;

/// Runs the matrix; any corrupted answer fails it (after the table is written).
pub async fn run(a: MatrixArgs) -> Result<(), BenchError> {
    let cells = cells(&a);
    if cells.is_empty() {
        return Err(MatrixError::Empty.into());
    }
    check_templates(&a, &cells)?;
    let exe = match &a.pdmesh {
        Some(p) => p.clone(),
        None => std::env::current_exe().map_err(MatrixError::io("finding the pdmesh binary"))?,
    };
    std::fs::create_dir_all(&a.out)
        .map_err(MatrixError::io(format!("creating {}", a.out.display())))?;
    let spec = Spec {
        kind: Kind::Sessions,
        sessions: a.sessions.max(1),
        turns: a.turns.max(1),
        input_len: a.input_len,
        output_len: a.output_len,
        seed: a.seed,
    };
    let startup = Duration::from_secs(a.startup_timeout_s.max(1));
    let timeout = Duration::from_secs(a.timeout_s.max(1));
    let mut matrix = Matrix {
        started: drive::now_rfc3339(),
        workload: spec.describe(),
        rows: Vec::new(),
    };
    let mut diffs = Vec::new();
    let http = reqwest::Client::new();
    let mut i = 0;
    while i < cells.len() {
        // Cells sharing a model and index-K form share one reference mesh.
        let group: Vec<Cell> = cells[i..]
            .iter()
            .take_while(|c| (c.model, c.index_k) == (cells[i].model, cells[i].index_k))
            .copied()
            .collect();
        i += group.len();
        let model_args = model_args(&a, &exe, group[0].model).await?;
        let mut ref_args = model_args.clone();
        ref_args.extend(reference_args(group[0].index_k));
        ref_args.extend(worker_args(&a.worker_args));
        let ref_name = format!("{}-reference", group[0].name());
        eprintln!("starting the reference for {}", group[0].name());
        let key = a.api_key.as_deref();
        let mut ref_up = Up::start(&exe, &ref_args, key, &a.out.join(&ref_name), startup).await?;
        let reference = Reference::new(Client::new(&ref_up.file().url, a.api_key.clone(), timeout));
        for cell in group {
            let name = cell.name();
            let mut args = model_args.clone();
            args.extend(cell.up_args());
            args.extend(worker_args(&a.worker_args));
            if let Some(fault) = a.fault {
                args.extend(worker_args(&[fault.worker_flag().to_owned()]));
            }
            if !(cell.mirror == Mirror::Off && cell.mode == Mode::Unified) {
                args.extend(a.cache_args.iter().map(|c| format!("--cache-arg={c}")));
            }
            let dir = a.out.join(&name);
            eprintln!("{name}: starting `pdmesh up {}`", args.join(" "));
            let mut up = Up::start(&exe, &args, key, &dir, startup).await?;
            let mesh = up.file().clone();
            let client = Client::new(&mesh.url, a.api_key.clone(), timeout);
            let cfg = RequestCfg {
                model: mesh.model.clone(),
                max_tokens: a.output_len,
            };
            let level = Level::Concurrency(spec.sessions as u32);
            // The same salt for every cell: every configuration is asked the same first
            // turns, and while answers agree, the same whole sessions.
            let (ex, mut summary) = drive::load(&client, &cfg, &spec, 1, level, &name).await;
            // Every page and room back where it was: nothing leaked under the load.
            let (baseline, _) =
                mesh::wait_baseline(&http, &mesh.gateway_url(), Duration::from_secs(a.settle_s))
                    .await;
            // Where the prompt tokens came from (computed, device, host, transferred): what
            // the configuration really exercised.
            let prompt_sources = mesh::scrape(&http, &format!("{}/metrics", mesh.gateway_url()))
                .await
                .map(|m| {
                    m.into_iter()
                        .filter_map(|(k, v)| {
                            let source = k
                                .strip_prefix("mesh_prompt_token_sources_total{source=\"")?
                                .strip_suffix("\"}")?;
                            Some((source.to_owned(), v))
                        })
                        .collect()
                })
                .unwrap_or_default();
            up.stop().await;
            // Replayed once the measured mesh is down, so the reference has the CPU; a
            // request an earlier configuration sent is not replayed again.
            diffs.extend(drive::check(&reference, &ex, &mut summary).await);
            let report = Report {
                label: name.clone(),
                url: mesh.url.clone(),
                model: mesh.model.clone(),
                workload: spec.describe(),
                started: drive::now_rfc3339(),
                levels: vec![summary.clone()],
            };
            report::write(&dir, std::slice::from_ref(&report))?;
            let row = Row {
                cell,
                name,
                fault: a.fault,
                leaked: (!baseline.ok()).then(|| baseline.describe()),
                prompt_sources,
                summary,
            };
            println!("{}", row_line(&row));
            matrix.rows.push(row);
        }
        eprintln!(
            "the reference answered {} distinct requests",
            reference.known()
        );
        ref_up.stop().await;
    }
    // The table and a bar per configuration in each chart, side by side.
    drive::print_written(&report::write_bars(&a.out, &page(&matrix))?);
    let md = table(&matrix);
    println!("\n{md}");
    write(&a.out.join("matrix.md"), md.as_bytes())?;
    let json = serde_json::to_vec_pretty(&matrix).expect("the matrix serializes");
    write(&a.out.join("matrix.json"), &json)?;
    println!("wrote {}", a.out.join("matrix.json").display());
    println!("wrote {}", a.out.join("matrix.md").display());
    for d in diffs.iter().take(20) {
        eprintln!("{d}");
    }
    let leaks: Vec<String> = matrix
        .rows
        .iter()
        .filter_map(|r| Some(format!("{}: {}", r.name, r.leaked.as_ref()?)))
        .collect();
    let levels: Vec<LevelSummary> = matrix.rows.into_iter().map(|r| r.summary).collect();
    drive::judge(&levels, &a.out)?;
    if !leaks.is_empty() {
        return Err(MatrixError::Leaked(leaks.join("; ")).into());
    }
    Ok(())
}

fn write(path: &Path, bytes: &[u8]) -> Result<(), MatrixError> {
    std::fs::write(path, bytes).map_err(MatrixError::io(format!("writing {}", path.display())))
}

/// Extra worker flags, as `pdmesh up` takes them.
fn worker_args(args: &[String]) -> Vec<String> {
    args.iter().map(|a| format!("--worker-arg={a}")).collect()
}

/// Refuses, before any mesh starts, a model that cannot serve the sessions' chat
/// requests: Gemma 3 270M without --chat-template.
fn check_templates(a: &MatrixArgs, cells: &[Cell]) -> Result<(), MatrixError> {
    if a.chat_template.is_none() && cells.iter().any(|c| c.model == Family::Gemma) {
        return Err(MatrixError::NeedsChatTemplate("gemma"));
    }
    Ok(())
}

/// `--model` for a family (and its `--chat-template`), writing the DeepSeek tiny
/// checkpoint first if it is missing.
async fn model_args(
    a: &MatrixArgs,
    exe: &Path,
    family: Family,
) -> Result<Vec<String>, MatrixError> {
    let path = match family {
        Family::Smol => match &a.smol_model {
            Some(p) => p.clone(),
            None => return Ok(Vec::new()),
        },
        Family::Gemma => {
            let model = a.gemma_model.clone().unwrap_or_else(|| "gemma3".into());
            let template = a
                .chat_template
                .as_ref()
                .ok_or(MatrixError::NeedsChatTemplate("gemma"))?;
            return Ok(vec![
                "--model".into(),
                model.display().to_string(),
                "--chat-template".into(),
                template.display().to_string(),
            ]);
        }
        Family::Dsa => {
            let dir = a
                .dsa_model
                .clone()
                .unwrap_or_else(|| a.out.join("deepseek-v32-tiny"));
            if !dir.join("config.json").exists() {
                let argv = ["model", "synth", "deepseek-v32-tiny", "--out"];
                let out = tokio::process::Command::new(exe)
                    .args(argv)
                    .arg(&dir)
                    .output()
                    .await
                    .map_err(MatrixError::io(format!(
                        "running {} model synth",
                        exe.display()
                    )))?;
                if !out.status.success() {
                    return Err(MatrixError::Mesh {
                        args: format!("{} {}", argv.join(" "), dir.display()),
                        why: format!("it exited with {}", out.status),
                        log: String::from_utf8_lossy(&out.stderr).into_owned(),
                    });
                }
            }
            dir
        }
    };
    Ok(vec!["--model".into(), path.display().to_string()])
}
