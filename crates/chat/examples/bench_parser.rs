//! Parser throughput on a large generation with tool calls, fed in small chunks as a
//! detokenizer delivers them, beside a plain UTF-8 decode of the same chunks.
//!
//! `cargo run --release -p pdmesh-chat --example bench_parser -- [MIB] [CHUNK]`
//! (default 8 MiB in 12-byte chunks).

use std::time::Instant;

use pdmesh_chat::{Call, Delta, OutputParser, ReasoningParser, ToolFormat, ToolParser};

fn main() {
    let args: Vec<usize> = std::env::args()
        .skip(1)
        .map(|a| a.parse().expect("a number"))
        .collect();
    let mib = *args.first().unwrap_or(&8);
    let chunk = *args.get(1).unwrap_or(&12);
    // Reasoning, content, then a block of calls whose string arguments are long: about a
    // third of the bytes in each part.
    let third = (mib << 20) / 3;
    let mut text = String::new();
    while text.len() < third {
        text.push_str("Let me think about the shelves, ünïcödé and all 🦀. ");
    }
    text.push_str("</think>\n\n");
    while text.len() < 2 * third {
        text.push_str("The answer is on shelf seven, next to the maps. ");
    }
    // The calls as a DSML model writes them, their string arguments long.
    let body = "x".repeat(4000);
    let mut block: Vec<Call> = Vec::new();
    let mut len = text.len();
    while len < 3 * third {
        let args = serde_json::json!({"text": body, "n": block.len()});
        len += body.len() + 200;
        block.push(Call {
            name: "note".into(),
            arguments: args.as_object().expect("an object").clone(),
        });
    }
    let calls = block.len();
    text.push_str("\n\n");
    text.push_str(&ToolFormat::Dsml.syntax().write_calls(&block));
    let bytes = text.as_bytes();
    let mb = bytes.len() as f64 / 1e6;

    let t = Instant::now();
    let mut n = 0usize;
    for c in bytes.chunks(chunk) {
        n += String::from_utf8_lossy(c).len();
    }
    let plain = t.elapsed().as_secs_f64();
    std::hint::black_box(n);

    let t = Instant::now();
    let mut p = OutputParser::new(
        Some(ReasoningParser::new(true)),
        Some(ToolParser::new(ToolFormat::Dsml, None, "call_")),
    );
    let mut found = 0usize;
    let mut count = |ds: Vec<Delta>| {
        for d in ds {
            match d {
                Delta::ToolCall { name: Some(_), .. } => found += 1,
                Delta::Error(e) => panic!("{e:?}"),
                _ => {}
            }
        }
    };
    for c in bytes.chunks(chunk) {
        count(p.push(c));
    }
    count(p.finish());
    let parsed = t.elapsed().as_secs_f64();
    println!("{mb:.1} MB in {chunk}-byte chunks, {calls} calls (found {found})");
    println!("parser (reasoning + DSML): {:.0} MB/s", mb / parsed);
    println!("plain UTF-8 decode:        {:.0} MB/s", mb / plain);
    println!("parser / decode = {:.2}x", plain / parsed);
}
