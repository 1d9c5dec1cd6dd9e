use std::time::Duration;

use pdmesh_kv::{IndexKDtype, KvLayout, MlaCacheDtype, MlaDims};

use super::*;

fn place(service: &str) -> Place {
    Place {
        service: service.into(),
        host: "hostA".into(),
        request_id: "chatcmpl-1".into(),
        trace_id: "4bf92f3577b34da6a3ce929d0e0e4736".into(),
        ..Default::default()
    }
}

fn reporter(dir: &Path, f: impl FnOnce(&mut Config)) -> Reporter {
    let mut cfg = Config::new(dir.join("incidents"));
    f(&mut cfg);
    Reporter::new(cfg).unwrap()
}

#[test]
fn a_hundred_identical_failures_are_one_report_counting_a_hundred() {
    let tmp = tempfile::tempdir().unwrap();
    let r = reporter(tmp.path(), |_| {});
    let mut filed = Vec::new();
    for _ in 0..100 {
        filed.push(
            r.report(Incident::new(
                Kind::Checksum,
                "a host page failed",
                place("cache"),
            ))
            .unwrap(),
        );
    }
    assert!(filed[0].new && filed[1..].iter().all(|f| !f.new && f.id == filed[0].id));
    r.flush().unwrap();
    let all = list(r.dir()).unwrap();
    assert_eq!(all.len(), 1);
    assert_eq!(all[0].repeats, 100);
    let md = std::fs::read_to_string(&filed[0].path).unwrap();
    assert!(md.contains("Seen 100 times"), "{md}");
    // Another cause, or the same cause elsewhere, is its own report.
    r.report(Incident::new(Kind::Wedge, "stuck", place("cache")))
        .unwrap();
    r.report(Incident::new(
        Kind::Checksum,
        "a host page failed",
        place("worker"),
    ))
    .unwrap();
    assert_eq!(ids(r.dir()).unwrap().len(), 3);
}

#[test]
fn a_closed_window_opens_a_new_report_with_the_last_count_written() {
    let tmp = tempfile::tempdir().unwrap();
    let r = reporter(tmp.path(), |c| c.window = Duration::from_millis(50));
    let first = r
        .report(Incident::new(Kind::ToolParse, "bad call", place("gateway")))
        .unwrap();
    r.report(Incident::new(Kind::ToolParse, "bad call", place("gateway")))
        .unwrap();
    std::thread::sleep(Duration::from_millis(60));
    let second = r
        .report(Incident::new(Kind::ToolParse, "bad call", place("gateway")))
        .unwrap();
    assert!(second.new && second.id != first.id);
    assert_eq!(read(r.dir(), &first.id).unwrap().repeats, 2);
}

#[test]
fn secrets_are_replaced_and_files_are_owner_only() {
    let tmp = tempfile::tempdir().unwrap();
    let r = reporter(tmp.path(), |_| {});
    let mut i = Incident::new(Kind::EngineStall, "the loop stopped", place("worker"));
    i.config.insert("api_key".into(), "sk-very-secret".into());
    i.config
        .insert("PDMESH_MESH_TOKEN".into(), "tok-secret".into());
    i.config.insert("kv_pages".into(), "4096".into());
    let f = r.report(i).unwrap();
    for ext in ["md", "json"] {
        let text = std::fs::read_to_string(r.dir().join(format!("{}.{ext}", f.id))).unwrap();
        assert!(
            !text.contains("sk-very-secret") && !text.contains("tok-secret"),
            "{text}"
        );
        assert!(text.contains("4096") && text.contains("[redacted]"));
    }
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        let mode = |p: &Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode(r.dir()), 0o700);
        assert_eq!(mode(&f.path), 0o600);
    }
}

#[test]
fn the_oldest_reports_go_past_the_bound() {
    let tmp = tempfile::tempdir().unwrap();
    let r = reporter(tmp.path(), |c| c.keep = 3);
    let mut made = Vec::new();
    for w in 0..5 {
        let mut p = place("worker");
        p.worker = format!("w{w}");
        made.push(
            r.report(Incident::new(Kind::EngineStall, "stall", p))
                .unwrap()
                .id,
        );
    }
    let kept = ids(r.dir()).unwrap();
    assert_eq!(kept.len(), 3);
    assert!(
        kept.iter().all(|k| made[2..].contains(k)),
        "{kept:?} {made:?}"
    );
    // Ids sort by time: the listing is newest first.
    assert_eq!(list(r.dir()).unwrap()[0].id, made[4]);
}

#[test]
fn a_layout_report_shows_index_k_132_against_256_bytes_per_token() {
    let lay = |k| KvLayout::deepseek_v32(2, MlaDims::V32, MlaCacheDtype::Fp8, k, 64).unwrap();
    let pair = LayoutPair {
        ours_label: "cache service".into(),
        ours: LayoutView::of(&lay(IndexKDtype::Bf16)),
        theirs_label: "host mirror pool".into(),
        theirs: LayoutView::of(&lay(IndexKDtype::Fp8)),
    };
    assert_eq!(
        pair.differences(),
        ["index_k: 256 B/token (bf16) vs 132 B/token (fp8_e4m3)"]
    );
    let tmp = tempfile::tempdir().unwrap();
    let r = reporter(tmp.path(), |c| {
        c.trace_link = Some("http://tempo:3200/trace/{trace_id}".into())
    });
    let mut i = Incident::new(Kind::LayoutRefused, "another layout", place("cache"));
    i.layouts = Some(pair);
    let f = r.report(i).unwrap();
    let md = std::fs::read_to_string(&f.path).unwrap();
    let row = md
        .lines()
        .find(|l| l.starts_with("| `index_k`"))
        .expect(&md);
    assert!(
        row.contains("256 B/token") && row.contains("132 B/token") && row.contains("**differs**"),
        "{row}"
    );
    let mla = md.lines().find(|l| l.starts_with("| `mla_nope`")).unwrap();
    assert!(!mla.contains("differs"), "{mla}");
    assert!(md.contains("(http://tempo:3200/trace/4bf92f3577b34da6a3ce929d0e0e4736)"));
    // The JSON reads back whole.
    let back = read(r.dir(), &f.id).unwrap();
    let theirs = back.layouts.unwrap().theirs;
    let index_k = theirs
        .components
        .iter()
        .find(|c| c.name == "index_k")
        .unwrap();
    assert_eq!((index_k.bytes_per_token, index_k.scale_bytes), (132, 4));
}

#[test]
fn only_report_ids_are_read() {
    let tmp = tempfile::tempdir().unwrap();
    for bad in ["../etc/passwd", "a/b", "", "x.json"] {
        assert!(
            matches!(read(tmp.path(), bad), Err(Error::BadId(_))),
            "{bad}"
        );
    }
    assert!(matches!(read(tmp.path(), "nope"), Err(Error::NotFound(_))));
    assert!(list(&tmp.path().join("none")).unwrap().is_empty());
}

#[test]
fn a_directory_that_cannot_be_made_or_others_may_write_is_refused() {
    use std::os::unix::fs::PermissionsExt;
    let tmp = tempfile::tempdir().unwrap();
    let file = tmp.path().join("a-file");
    std::fs::write(&file, b"x").unwrap();
    let e = Reporter::from_flags(Some(&file.join("incidents")), None, None, false).unwrap_err();
    assert!(matches!(e, Error::Io { .. }), "{e}");
    assert!(
        Reporter::from_flags(None, None, None, false)
            .unwrap()
            .is_none()
    );
    let r = Reporter::from_flags(
        Some(&tmp.path().join("ok")),
        Some("t/{trace_id}".into()),
        None,
        false,
    )
    .unwrap();
    assert!(r.is_some_and(|r| r.dir().is_dir()));
    // World-writable, or group-writable: refused with what and why.
    for mode in [0o777, 0o1777, 0o770] {
        let loose = tmp.path().join(format!("loose-{mode:o}"));
        std::fs::create_dir(&loose).unwrap();
        std::fs::set_permissions(&loose, std::fs::Permissions::from_mode(mode)).unwrap();
        let e = Reporter::from_flags(Some(&loose), None, None, false).unwrap_err();
        let msg = e.to_string();
        assert!(matches!(e, Error::Unsafe { .. }), "{msg}");
        assert!(
            msg.contains(&format!("mode is {mode:04o}"))
                && msg.contains(&loose.display().to_string()),
            "{msg}"
        );
    }
    // Readable by others but writable by the owner alone is fine.
    let shared = tmp.path().join("shared");
    std::fs::create_dir(&shared).unwrap();
    std::fs::set_permissions(&shared, std::fs::Permissions::from_mode(0o755)).unwrap();
    assert!(Reporter::from_flags(Some(&shared), None, None, false).is_ok());
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } == 0 {
        let foreign = tmp.path().join("foreign");
        std::fs::create_dir(&foreign).unwrap();
        std::os::unix::fs::chown(&foreign, Some(65534), Some(65534)).unwrap();
        let e = Reporter::from_flags(Some(&foreign), None, None, false).unwrap_err();
        assert!(e.to_string().contains("owned by uid 65534"), "{e}");
    }
}

/// A failure's evidence as a gateway files it: a chat request carrying a secret in its
/// system text, user text and tool arguments, its prompt's ids, and the output that failed.
fn with_prompt(secret: &str) -> Incident {
    let mut i = Incident::new(Kind::ToolParse, "a call did not parse", place("gateway"));
    i.replay = Some(Replay {
        body: serde_json::json!({
            "model": "m",
            "max_tokens": 4,
            "temperature": 0.5,
            "stop": [secret],
            "messages": [
                {"role": "system", "content": format!("system {secret}")},
                {"role": "user", "content": format!("user {secret}")},
                {"role": "assistant", "content": null, "tool_calls": [{"id": "c1", "type": "function",
                    "function": {"name": "f", "arguments": format!("{{\"q\": \"{secret}\"}}")}}]},
            ],
            "tools": [{"type": "function", "function": {"name": "f", "description": secret}}],
            "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"const": secret}}},
        }),
        prompt_token_ids: vec![91_919, 92_929, 93_939],
        command: String::new(),
    });
    i.details.insert("parser".into(), "hermes".into());
    i.details
        .insert("detail".into(), format!("<tool_call>{secret}"));
    i
}

#[test]
fn without_the_flag_a_report_keeps_only_the_allowlist_and_with_it_the_prompt() {
    const SECRET: &str = "s3cr3t-canary-7f1";
    let tmp = tempfile::tempdir().unwrap();
    let r = reporter(tmp.path(), |_| {});
    let f = r.report(with_prompt(SECRET)).unwrap();
    for ext in ["json", "md"] {
        let text = std::fs::read_to_string(r.dir().join(format!("{}.{ext}", f.id))).unwrap();
        assert!(!text.contains(SECRET), "{ext}: {text}");
        assert!(
            !text.contains("91919") && !text.contains("92929"),
            "{ext}: {text}"
        );
    }
    let got = read(r.dir(), &f.id).unwrap();
    let replay = got.replay.unwrap();
    assert_eq!(
        replay.body,
        serde_json::json!({"model": "m", "max_tokens": 4, "temperature": 0.5})
    );
    assert!(replay.prompt_token_ids.is_empty());
    assert_eq!(got.details["prompt tokens"], "3");
    assert_eq!(got.details["parser"], "hermes");
    assert!(!got.details.contains_key("detail"));
    let left_out = &got.details["left out (--incident-include-prompts keeps them)"];
    for name in [
        "detail",
        "request messages",
        "request tools",
        "prompt token ids",
    ] {
        assert!(left_out.contains(name), "{left_out}");
    }

    let tmp = tempfile::tempdir().unwrap();
    let r = reporter(tmp.path(), |c| c.include_prompts = true);
    let f = r.report(with_prompt(SECRET)).unwrap();
    let text = std::fs::read_to_string(r.dir().join(format!("{}.json", f.id))).unwrap();
    assert!(text.contains(&format!("user {SECRET}")), "{text}");
    let got = read(r.dir(), &f.id).unwrap();
    assert_eq!(
        got.replay.unwrap().prompt_token_ids,
        vec![91_919, 92_929, 93_939]
    );
    assert_eq!(got.details["detail"], format!("<tool_call>{SECRET}"));
}

#[test]
fn a_link_planted_at_a_temporary_files_name_is_not_followed() {
    let tmp = tempfile::tempdir().unwrap();
    let r = reporter(tmp.path(), |c| c.window = Duration::from_secs(600));
    let f = r
        .report(Incident::new(Kind::Wedge, "stuck", place("cache")))
        .unwrap();
    // Links where the next write of this report puts its temporary files.
    let victim = tmp.path().join("victim");
    std::fs::write(&victim, b"untouched").unwrap();
    let mut links = Vec::new();
    for ext in ["json", "md"] {
        let link = r.dir().join(format!("{}.{ext}.tmp", f.id));
        std::os::unix::fs::symlink(&victim, &link).unwrap();
        links.push(link);
    }
    r.report(Incident::new(Kind::Wedge, "stuck", place("cache")))
        .unwrap();
    r.flush().unwrap();
    assert_eq!(std::fs::read(&victim).unwrap(), b"untouched");
    assert_eq!(read(r.dir(), &f.id).unwrap().repeats, 2);
    for ext in ["json", "md"] {
        let p = r.dir().join(format!("{}.{ext}", f.id));
        assert!(
            std::fs::symlink_metadata(&p).unwrap().is_file(),
            "{}",
            p.display()
        );
    }
    for link in links {
        assert!(
            std::fs::symlink_metadata(&link).is_err(),
            "{} left",
            link.display()
        );
    }
    // A link in a report's own place is not read through either.
    let planted = r.dir().join("20000101T000000000Z-wedge-x-1.json");
    std::os::unix::fs::symlink(&victim, &planted).unwrap();
    let e = read(r.dir(), "20000101T000000000Z-wedge-x-1").unwrap_err();
    assert!(matches!(e, Error::Io { .. }), "{e}");
}

#[test]
fn a_replay_gets_the_command_that_runs_it_with_the_reports_path_quoted() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("my reports");
    let r = Reporter::new(Config {
        replay_url: Some("http://127.0.0.1:8080/v1".into()),
        include_prompts: true,
        ..Config::new(&dir)
    })
    .unwrap();
    let mut i = Incident::new(Kind::ToolParse, "a call did not parse", place("gateway"));
    let body = serde_json::json!({"model": "m", "messages": [{"role": "user", "content": "[redacted]"}], "max_tokens": 4});
    i.replay = Some(Replay {
        body: body.clone(),
        prompt_token_ids: vec![1, 2, 3],
        command: String::new(),
    });
    let filed = r.report(i).unwrap();
    let got = read(&dir, &filed.id).unwrap();
    let cmd = &got.replay.as_ref().unwrap().command;
    let path = dir.join(format!("{}.json", filed.id));
    assert_eq!(
        shlex::split(cmd).unwrap(),
        [
            "pdmesh",
            "bench",
            "replay",
            &path.display().to_string(),
            "--url",
            "http://127.0.0.1:8080/v1"
        ]
    );
    // The Markdown shows the body as JSON that reads back the same, and the command.
    let md = std::fs::read_to_string(&filed.path).unwrap();
    let block = md
        .split("```json\n")
        .nth(1)
        .unwrap()
        .split("\n```")
        .next()
        .unwrap();
    assert_eq!(
        serde_json::from_str::<serde_json::Value>(block).unwrap(),
        body
    );
    assert!(md.contains(cmd.as_str()), "{md}");
}
