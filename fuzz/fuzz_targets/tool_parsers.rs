//! Each tool-call parser on arbitrary model output, cut into arbitrary chunks: never a
//! panic, every call's arguments a JSON object, and the same content, calls and failure
//! whether the output arrives at once or in pieces.
#![no_main]

use libfuzzer_sys::fuzz_target;
use pdmesh_chat::{Delta, ToolFormat, ToolParser};

/// What a client ends up with: the content, each call's name and arguments, and whether
/// the markup failed.
#[derive(Debug, PartialEq)]
struct Outcome {
    content: String,
    calls: Vec<(String, String)>,
    failed: bool,
}

fn run(format: ToolFormat, chunks: &[&[u8]], truncated: bool) -> Outcome {
    let allowed = Some(vec!["get_weather".to_owned(), "search".to_owned()]);
    let mut p = ToolParser::new(format, allowed, "call_");
    let mut deltas = Vec::new();
    for c in chunks {
        deltas.extend(p.push(c));
    }
    deltas.extend(if truncated {
        p.finish_truncated()
    } else {
        p.finish()
    });
    let mut o = Outcome {
        content: String::new(),
        calls: Vec::new(),
        failed: false,
    };
    for d in deltas {
        match d {
            Delta::Content(t) | Delta::Reasoning(t) => o.content.push_str(&t),
            Delta::ToolCall {
                index,
                name,
                arguments,
                ..
            } => {
                if let Some(name) = name {
                    assert_eq!(index, o.calls.len(), "calls are numbered in order");
                    o.calls.push((name, String::new()));
                }
                o.calls
                    .get_mut(index)
                    .expect("arguments follow their call's name")
                    .1
                    .push_str(&arguments);
            }
            Delta::Error(_) => o.failed = true,
        }
    }
    for (name, args) in &o.calls {
        let v: serde_json::Value = serde_json::from_str(args)
            .unwrap_or_else(|e| panic!("{name}'s arguments {args:?} are not JSON: {e}"));
        assert!(
            v.is_object(),
            "{name}'s arguments {args:?} are not an object"
        );
    }
    o
}

fuzz_target!(|data: &[u8]| {
    let [sel, cut, text @ ..] = data else {
        return;
    };
    let format = ToolFormat::ALL[usize::from(sel & 3)];
    let truncated = sel & 4 != 0;
    let whole = run(format, &[text], truncated);
    // Cut every `cut % 7 + 1` bytes (inside UTF-8 sequences and markers too).
    let step = usize::from(cut % 7) + 1;
    let chunks: Vec<&[u8]> = text.chunks(step).collect();
    let pieces = run(format, &chunks, truncated);
    assert_eq!(whole, pieces, "chunks of {step} bytes");
});
