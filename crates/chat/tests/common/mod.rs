//! What the chat crate's tests share: a parse's deltas summed up as a client sees them.

#![allow(dead_code)]

use pdmesh_chat::{Delta, coalesce};
use serde_json::Value;

/// The DSML markers' full-width bars, as DeepSeek writes them.
pub const D: &str = "｜DSML｜";

/// What a parse produced, summed up.
#[derive(Debug, Default, PartialEq)]
pub struct Outcome {
    pub content: String,
    pub reasoning: String,
    /// (name, arguments JSON) per call.
    pub calls: Vec<(String, Value)>,
    pub errors: Vec<&'static str>,
}

/// `deltas` summed up: calls arrive in order, each named before its arguments; every
/// error names a known parser and reason; every call's arguments parse (none is cut
/// short).
pub fn outcome(deltas: Vec<Delta>) -> Outcome {
    let mut o = Outcome::default();
    let mut args: Vec<String> = Vec::new();
    for d in coalesce(deltas) {
        match d {
            Delta::Content(t) => o.content.push_str(&t),
            Delta::Reasoning(t) => o.reasoning.push_str(&t),
            Delta::ToolCall {
                index,
                name,
                arguments,
                ..
            } => {
                if let Some(n) = name {
                    assert_eq!(index, o.calls.len(), "calls arrive in order, name first");
                    o.calls.push((n, Value::Null));
                    args.push(String::new());
                }
                args[index].push_str(&arguments);
            }
            Delta::Error(e) => {
                assert!(pdmesh_chat::PARSERS.contains(&e.parser), "{e:?}");
                assert!(pdmesh_chat::FAILURE_REASONS.contains(&e.reason), "{e:?}");
                o.errors.push(e.reason)
            }
        }
    }
    for (c, a) in o.calls.iter_mut().zip(args) {
        c.1 = serde_json::from_str(&a).unwrap_or_else(|e| panic!("arguments {a:?}: {e}"));
    }
    o
}
