//! `<think>…</think>`: reasoning until the closing tag, content after. Whether the
//! generation starts inside reasoning depends on the prompt (a thinking-mode prompt already
//! opened `<think>`), so the caller says. A model that opens `<think>` itself at the start
//! of its content is followed too. The tags are never emitted.

use crate::Delta;
use crate::utf8::Utf8Assembler;

const OPEN: &str = "<think>";
const CLOSE: &str = "</think>";

/// See the module docs.
pub struct ReasoningParser {
    utf8: Utf8Assembler,
    buf: String,
    in_reasoning: bool,
    /// Nothing but whitespace has been emitted as content yet (a `<think>` may still open).
    at_start: bool,
    /// Reasoning just closed: the blank line before the content is formatting.
    trim: bool,
}

impl ReasoningParser {
    /// `thinking`: the prompt opened `<think>`, so the output starts as reasoning.
    pub fn new(thinking: bool) -> Self {
        Self {
            utf8: Utf8Assembler::default(),
            buf: String::new(),
            in_reasoning: thinking,
            at_start: true,
            trim: false,
        }
    }

    pub fn push(&mut self, chunk: &[u8]) -> Vec<Delta> {
        let text = self.utf8.push(chunk);
        self.buf.push_str(&text);
        let mut out = Vec::new();
        self.run(&mut out, false);
        out
    }

    pub fn finish(&mut self) -> Vec<Delta> {
        let rest = self.utf8.finish();
        self.buf.push_str(&rest);
        let mut out = Vec::new();
        self.run(&mut out, true);
        out
    }

    fn run(&mut self, out: &mut Vec<Delta>, end: bool) {
        loop {
            let tag = if self.in_reasoning { CLOSE } else { OPEN };
            if (self.in_reasoning || self.at_start)
                && let Some(i) = self.buf.find(tag)
            {
                let before: String = self.buf.drain(..i + tag.len()).take(i).collect();
                if self.in_reasoning {
                    push(out, Delta::Reasoning(before));
                    self.in_reasoning = false;
                    self.at_start = false;
                    self.trim = true;
                } else if before.trim().is_empty() {
                    self.in_reasoning = true;
                } else {
                    // Text came first: this `<think>` is content.
                    self.at_start = false;
                    let mut all = before;
                    all.push_str(tag);
                    push(out, Delta::Content(all));
                }
                continue;
            }
            // Hold back a tail that could start the tag we wait for.
            let keep = if end || !(self.in_reasoning || self.at_start) {
                self.buf.len()
            } else {
                partial_from(&self.buf, tag)
            };
            let mut text: String = self.buf.drain(..keep).collect();
            if self.trim && !self.in_reasoning {
                // The blank line after `</think>` is formatting.
                text = text.trim_start().to_owned();
                self.trim = text.is_empty();
            }
            if self.in_reasoning {
                push(out, Delta::Reasoning(text));
            } else {
                if !text.trim().is_empty() {
                    self.at_start = false;
                } else if self.at_start && !end {
                    // Leading whitespace waits: a `<think>` may follow.
                    self.buf.insert_str(0, &text);
                    return;
                }
                push(out, Delta::Content(text));
            }
            return;
        }
    }
}

/// The position from which `text`'s tail is a proper prefix of `tag` (or its length).
fn partial_from(text: &str, tag: &str) -> usize {
    text.char_indices()
        .map(|(i, _)| i)
        .find(|&i| tag.starts_with(&text[i..]))
        .unwrap_or(text.len())
}

fn push(out: &mut Vec<Delta>, d: Delta) {
    match &d {
        Delta::Content(t) | Delta::Reasoning(t) if t.is_empty() => {}
        _ => out.push(d),
    }
}
