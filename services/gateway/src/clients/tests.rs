//! Tests of the clients' conversions of the worker's and tokenizer's answers.

use super::*;

#[tokio::test]
async fn a_cache_service_is_learned_once_and_clones_share_what_was_learned() {
    let b = Backends::connect_lazy("http://127.0.0.1:1", "http://127.0.0.1:2")
        .unwrap()
        .with_cache("http://10.0.0.1:50063")
        .unwrap();
    let other = b.clone();
    assert!(
        other
            .learn_cache("http://10.0.0.1:50063")
            .unwrap()
            .is_none()
    );
    let (url, _) = other.learn_cache("http://10.0.0.2:50063").unwrap().unwrap();
    assert_eq!(url, "http://10.0.0.2:50063");
    let urls: Vec<String> = b.caches().into_iter().map(|(u, _)| u).collect();
    assert_eq!(urls, ["http://10.0.0.1:50063", "http://10.0.0.2:50063"]);
    assert!(b.learn_cache("not a url").is_err());
    assert_eq!(b.caches().len(), 2);
}

#[tokio::test]
async fn dns_names_become_workers_and_a_failed_look_up_changes_nothing() {
    let b = Backends::connect_pd(
        "http://127.0.0.1:1",
        "http://127.0.0.1:2",
        (true, &["http://127.0.0.1:3".to_owned()], &[]),
        pdmesh_tls::test_ca::auth(),
    )
    .unwrap();
    let stop = tokio_util::sync::CancellationToken::new();
    let every = Duration::from_millis(20);
    // `localhost` is in every /etc/hosts; the name below is in none (.invalid is
    // reserved never to resolve).
    b.discover(false, vec!["localhost:4".into()], every, stop.clone());
    b.discover(
        true,
        vec!["no-such-host.invalid:4".into()],
        every,
        stop.clone(),
    );
    let decode = || -> Vec<String> {
        b.workers
            .named()
            .into_iter()
            .filter(|(r, _)| *r == crate::route::Role::Decode)
            .map(|(_, t)| t.url().to_owned())
            .collect()
    };
    let mut found = Vec::new();
    for _ in 0..250 {
        found = decode();
        if !found.is_empty() {
            break;
        }
        tokio::time::sleep(every).await;
    }
    assert!(
        found.contains(&"http://127.0.0.1:4".to_owned()),
        "{found:?}"
    );
    let prefill: Vec<String> = b
        .workers
        .named()
        .into_iter()
        .filter(|(r, _)| *r == crate::route::Role::Prefill)
        .map(|(_, t)| t.url().to_owned())
        .collect();
    assert_eq!(prefill, ["http://127.0.0.1:3"]);
    stop.cancel();
}

/// Every tool-call format crosses the tokenizer's proto and comes back as itself; no
/// format is sent as "no tool calls".
#[test]
fn tool_formats_cross_the_wire_by_name() {
    assert_eq!(tool_format_to_wire(None), tk::ToolFormat::None);
    assert_eq!(tool_format_from_wire(tk::ToolFormat::None), None);
    for f in ToolFormat::ALL {
        let wire = tool_format_to_wire(Some(f));
        assert_ne!(wire, tk::ToolFormat::None, "{f:?}");
        assert_eq!(tool_format_from_wire(wire), Some(f));
    }
}
