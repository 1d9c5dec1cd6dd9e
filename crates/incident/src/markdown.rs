//! A report as people read it: the sections in the order an engineer writes them by hand
//! (what happened, where, the timeline, the evidence, how to replay it).

use std::fmt::Write as _;

use crate::{Incident, LayoutPair};

/// `i` as Markdown.
pub fn render(i: &Incident) -> String {
    let mut s = String::new();
    let p = &i.place;
    let _ = writeln!(s, "# {}: {}\n", i.kind.title(), i.id);
    let _ = writeln!(s, "{}\n", i.summary);
    if i.repeats > 1 {
        let _ = writeln!(
            s,
            "Seen {} times in this component from {} to {} (one report per cause and \
             component per interval).\n",
            i.repeats, i.first_seen, i.last_seen
        );
    }
    let _ = writeln!(s, "## When and where\n");
    let mut rows = vec![
        ("first seen", i.first_seen.clone()),
        ("service", p.service.clone()),
        ("host", p.host.clone()),
    ];
    if !p.worker.is_empty() {
        rows.push(("worker", p.worker.clone()));
    }
    if !p.stage.is_empty() {
        rows.push(("stage", p.stage.clone()));
    }
    if let Some(r) = p.room {
        rows.push(("room", r.to_string()));
    }
    if !p.request_id.is_empty() {
        rows.push(("request", format!("`{}`", p.request_id)));
    }
    if !p.trace_id.is_empty() {
        let t = if p.trace_link.is_empty() {
            format!("`{}`", p.trace_id)
        } else {
            format!("[`{}`]({})", p.trace_id, p.trace_link)
        };
        rows.push(("trace", t));
    }
    table(
        &mut s,
        &["", ""],
        rows.into_iter().map(|(k, v)| vec![k.to_owned(), v]),
    );
    if !i.timeline.is_empty() {
        let _ = writeln!(s, "## Timeline\n");
        table(
            &mut s,
            &["at", "what"],
            i.timeline
                .iter()
                .map(|t| vec![t.at.clone(), t.what.clone()]),
        );
    }
    if let Some(l) = &i.layouts {
        layouts(&mut s, l);
    }
    if !i.pages.is_empty() {
        let _ = writeln!(s, "## Pages\n");
        table(
            &mut s,
            &["page", "expected", "found"],
            i.pages.iter().map(|c| {
                vec![
                    c.page.clone(),
                    format!("`{}`", c.expected),
                    format!("`{}`", c.found),
                ]
            }),
        );
    }
    if !i.stuck_rooms.is_empty() {
        let _ = writeln!(s, "## Stuck rooms at that moment\n");
        table(
            &mut s,
            &["room", "state", "age (s)", "request", "trace"],
            i.stuck_rooms.iter().map(|r| {
                vec![
                    r.room.to_string(),
                    r.state.clone(),
                    format!("{:.1}", r.age_seconds),
                    r.request_id.clone(),
                    r.trace_id.clone(),
                ]
            }),
        );
    }
    if !i.metrics.is_empty() {
        let _ = writeln!(s, "## Metrics\n");
        let v = |x: Option<f64>| x.map_or_else(|| "-".to_owned(), |x| format!("{x}"));
        table(
            &mut s,
            &["metric", "before", "after"],
            i.metrics
                .iter()
                .map(|m| vec![format!("`{}`", m.name), v(m.before), v(m.after)]),
        );
    }
    if !i.details.is_empty() {
        let _ = writeln!(s, "## Evidence\n");
        table(
            &mut s,
            &["", ""],
            i.details.iter().map(|(k, v)| vec![k.clone(), v.clone()]),
        );
    }
    if !i.config.is_empty() {
        let _ = writeln!(s, "## Configuration\n");
        table(
            &mut s,
            &["setting", "value"],
            i.config
                .iter()
                .map(|(k, v)| vec![format!("`{k}`"), v.clone()]),
        );
    }
    if let Some(r) = &i.replay {
        let _ = writeln!(s, "## Replay\n");
        let _ = writeln!(s, "The request:\n\n```json");
        let _ = writeln!(s, "{}", json(&r.body, 0));
        let _ = writeln!(s, "```\n");
        if !r.prompt_token_ids.is_empty() {
            let ids: Vec<String> = r.prompt_token_ids.iter().map(u32::to_string).collect();
            let _ = writeln!(
                s,
                "The prompt's token ids:\n\n```\n[{}]\n```\n",
                ids.join(", ")
            );
        }
        if !r.command.is_empty() {
            let _ = writeln!(
                s,
                "Replay it (the prompt's token ids with its sampling, to `/completions`) on \
                 the mesh, with `PDMESH_API_KEY` set; add `--reference URL` to compare with \
                 a reference mesh (a unified worker with no cache):\n"
            );
            let _ = writeln!(s, "```sh\n{}\n```\n", r.command);
        }
    }
    s
}

/// `v` indented for people, with arrays of plain values (token ids) on one line.
fn json(v: &serde_json::Value, depth: usize) -> String {
    use serde_json::Value;
    let pad = "  ".repeat(depth + 1);
    let close = "  ".repeat(depth);
    match v {
        Value::Array(a) if a.iter().any(|x| x.is_array() || x.is_object()) => {
            let items: Vec<String> = a
                .iter()
                .map(|x| format!("{pad}{}", json(x, depth + 1)))
                .collect();
            format!("[\n{}\n{close}]", items.join(",\n"))
        }
        Value::Object(o) if !o.is_empty() => {
            let items: Vec<String> = o
                .iter()
                .map(|(k, x)| format!("{pad}{}: {}", Value::from(k.as_str()), json(x, depth + 1)))
                .collect();
            format!("{{\n{}\n{close}}}", items.join(",\n"))
        }
        _ => v.to_string(),
    }
}

/// Both layouts side by side, the components that differ marked.
fn layouts(s: &mut String, l: &LayoutPair) {
    let _ = writeln!(s, "## KV layouts\n");
    let (a, b) = (&l.ours, &l.theirs);
    let mut names: Vec<&str> = a.components.iter().map(|c| c.name.as_str()).collect();
    for c in &b.components {
        if !names.contains(&c.name.as_str()) {
            names.push(&c.name);
        }
    }
    let cell = |v: &crate::LayoutView, name: &str| {
        v.components.iter().find(|c| c.name == name).map_or_else(
            || "—".to_owned(),
            |c| {
                format!(
                    "{} B/token ({}: {} B values + {} B scales)",
                    c.bytes_per_token, c.dtype, c.value_bytes, c.scale_bytes
                )
            },
        )
    };
    let mut rows = vec![
        vec![
            "fingerprint".to_owned(),
            format!("`{}`", a.fingerprint),
            format!("`{}`", b.fingerprint),
            mark(a.fingerprint != b.fingerprint),
        ],
        vec![
            "page size".to_owned(),
            a.page_size.to_string(),
            b.page_size.to_string(),
            mark(a.page_size != b.page_size),
        ],
        vec![
            "layers".to_owned(),
            a.layers.to_string(),
            b.layers.to_string(),
            mark(a.layers != b.layers),
        ],
    ];
    for n in names {
        let (x, y) = (cell(a, n), cell(b, n));
        let differs = x != y;
        rows.push(vec![format!("`{n}`"), x, y, mark(differs)]);
    }
    rows.push(vec![
        "per token per layer".to_owned(),
        format!("{} B", a.bytes_per_token_per_layer),
        format!("{} B", b.bytes_per_token_per_layer),
        mark(a.bytes_per_token_per_layer != b.bytes_per_token_per_layer),
    ]);
    table(
        s,
        &[
            "",
            &format!("{} ({})", l.ours_label, a.name),
            &format!("{} ({})", l.theirs_label, b.name),
            "",
        ],
        rows.into_iter(),
    );
    let diffs = l.differences();
    if !diffs.is_empty() {
        let _ = writeln!(s, "Differences:\n");
        for d in diffs {
            let _ = writeln!(s, "- {d}");
        }
        let _ = writeln!(s);
    }
}

fn mark(differs: bool) -> String {
    if differs {
        "**differs**".into()
    } else {
        String::new()
    }
}

fn table(s: &mut String, head: &[&str], rows: impl Iterator<Item = Vec<String>>) {
    let esc = |c: &str| c.replace('|', "\\|").replace('\n', " ");
    let _ = writeln!(
        s,
        "| {} |",
        head.iter().map(|h| esc(h)).collect::<Vec<_>>().join(" | ")
    );
    let _ = writeln!(s, "|{}", "---|".repeat(head.len()));
    for r in rows {
        let _ = writeln!(
            s,
            "| {} |",
            r.iter().map(|c| esc(c)).collect::<Vec<_>>().join(" | ")
        );
    }
    let _ = writeln!(s);
}
