//! Parser throughput on a large generation with tool calls, fed in small chunks as a
//! detokenizer delivers them, beside a plain UTF-8 decode of the same chunks.
//!
//! `cargo run --release -p pdmesh-chat --example bench_parser -- [MIB] [CHUNK]`
//! (default 8 MiB in 12-byte chunks).

use std::time::Instant;

use pdmesh_chat::{Delta, Format, OutputParser, ReasoningParser, ToolParser};

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
    text.push_str("\n\n<｜DSML｜function_calls>\n");
    let mut calls = 0;
    while text.len() < 3 * third {
        let body = "x".repeat(4000);
        text.push_str(&format!(
            "<｜DSML｜invoke name=\"note\">\n<｜DSML｜parameter name=\"text\" string=\"true\">{body}</｜DSML｜parameter>\n<｜DSML｜parameter name=\"n\" string=\"false\">{calls}</｜DSML｜parameter>\n</｜DSML｜invoke>\n"
        ));
        calls += 1;
    }
    text.push_str("</｜DSML｜function_calls>");
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
        Some(ToolParser::new(Format::Dsml, None, "call_")),
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
