//! The streaming tool-call parser: content until a block starts, the block until it
//! closes (then its calls, or one error), then nothing but whitespace, an end-of-sequence
//! marker or another block. The end of a generation cut off by its length limit keeps
//! the calls that completed (a DSML or DeepSeek block holds several: those whose call
//! ended) and drops the rest unseen.

use crate::formats::{ToolFormat, ToolSyntax};
use crate::utf8::Utf8Assembler;
use crate::{Delta, ParseError};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum State {
    Content,
    Block,
    After,
    /// A block failed: everything after it is dropped.
    Failed,
}

/// See the module docs. One per generation.
pub struct ToolParser {
    /// The format's markup and block parser.
    syntax: &'static dyn ToolSyntax,
    /// The request's tool names: a call to another is an error. `None`: any name.
    allowed: Option<Vec<String>>,
    id_prefix: String,
    utf8: Utf8Assembler,
    buf: String,
    state: State,
    calls: usize,
    /// Block state: the closing tag was looked for up to here, and the opening tag checked.
    scanned: usize,
    opened: bool,
    ends: Vec<String>,
}

/// Held-back text this long (in chars) that matches the start of a marker counts as
/// markup when the generation ends there (shorter is taken as ordinary text).
const MARKUP_AT_END: usize = 2;

impl ToolParser {
    /// `allowed`: the request's tool names; `id_prefix` names the calls
    /// (`{id_prefix}{index}`).
    pub fn new(format: ToolFormat, allowed: Option<Vec<String>>, id_prefix: &str) -> Self {
        let syntax = format.syntax();
        Self {
            syntax,
            allowed,
            id_prefix: id_prefix.to_owned(),
            utf8: Utf8Assembler::default(),
            buf: String::new(),
            state: State::Content,
            calls: 0,
            scanned: 0,
            opened: false,
            ends: syntax.ends(),
        }
    }

    /// Tool calls emitted so far.
    pub fn calls(&self) -> usize {
        self.calls
    }

    pub fn push(&mut self, chunk: &[u8]) -> Vec<Delta> {
        let text = self.utf8.push(chunk);
        self.push_str(&text)
    }

    pub fn push_str(&mut self, text: &str) -> Vec<Delta> {
        let mut out = Vec::new();
        if self.state == State::Failed {
            return out;
        }
        self.buf.push_str(text);
        self.run(&mut out);
        out
    }

    /// The end of a generation the model ended itself (end of sequence, a stop): a block
    /// or marker left open is an error.
    pub fn finish(&mut self) -> Vec<Delta> {
        self.end(false)
    }

    /// The end of a generation cut off by its length limit: the calls completed so far
    /// stand (those of a block cut short too), and the unfinished markup after them, down
    /// to a lone `<` that might have begun a marker, is dropped, neither content nor an
    /// error. Markup that is complete but malformed is still an error.
    pub fn finish_truncated(&mut self) -> Vec<Delta> {
        self.end(true)
    }

    fn end(&mut self, cut: bool) -> Vec<Delta> {
        let mut out = Vec::new();
        let rest = self.utf8.finish();
        if !rest.is_empty() && self.state != State::Failed {
            self.buf.push_str(&rest);
            self.run(&mut out);
        }
        let buf = std::mem::take(&mut self.buf);
        match self.state {
            State::Content => match self.hold_from(&buf) {
                Some(p) if cut => emit_content(&mut out, buf[..p].trim_end()),
                // A held tail that began a marker is a block cut short.
                Some(p) if buf[p..].chars().count() >= MARKUP_AT_END => {
                    emit_content(&mut out, buf[..p].trim_end());
                    self.fail(
                        &mut out,
                        "unterminated",
                        format!("output ends inside {:?}", &buf[p..]),
                    );
                }
                _ => emit_content(&mut out, &buf),
            },
            State::Block if cut => {
                // The calls of the block that did end; the one cut short is dropped.
                let norm = self.syntax.normalize(&buf);
                if self.opened
                    && let Some(closed) = self.syntax.closed_prefix(&norm)
                {
                    match self.syntax.parse(&closed) {
                        Ok(calls) => self.emit_calls(&mut out, calls),
                        Err(e) => {
                            self.state = State::Failed;
                            out.push(Delta::Error(e));
                        }
                    }
                }
            }
            State::Block => {
                let head: String = buf.chars().take(40).collect();
                self.fail(
                    &mut out,
                    "unterminated",
                    format!("a block that never closed: {head:?}"),
                );
            }
            State::After if is_trailer(&buf) => {}
            // Cut inside the next block's opening marker or an end-of-sequence marker.
            State::After
                if cut
                    && (could_be_trailer(&buf)
                        || self.hold_from(&buf).is_some_and(|p| is_trailer(&buf[..p]))) => {}
            State::After => {
                self.fail(
                    &mut out,
                    "trailing_text",
                    format!("text after the calls: {buf:?}"),
                );
            }
            State::Failed => {}
        }
        out
    }

    /// Emits whole calls (name and id, then the arguments' JSON in one fragment); a call
    /// to a tool the request did not offer fails the block instead.
    fn emit_calls(&mut self, out: &mut Vec<Delta>, calls: Vec<crate::Call>) {
        if let Some(allowed) = &self.allowed
            && let Some(c) = calls.iter().find(|c| !allowed.contains(&c.name))
        {
            let detail = format!("{:?} is not one of the request's tools", c.name);
            self.fail(out, "unknown_tool", detail);
            return;
        }
        for c in calls {
            let index = self.calls;
            self.calls += 1;
            out.push(Delta::ToolCall {
                index,
                id: Some(format!("{}{index}", self.id_prefix)),
                name: Some(c.name),
                arguments: String::new(),
            });
            out.push(Delta::ToolCall {
                index,
                id: None,
                name: None,
                arguments: serde_json::Value::Object(c.arguments).to_string(),
            });
        }
    }

    fn enter_block(&mut self) {
        self.state = State::Block;
        self.scanned = 0;
        self.opened = false;
    }

    fn fail(&mut self, out: &mut Vec<Delta>, reason: &'static str, detail: String) {
        self.state = State::Failed;
        self.buf.clear();
        out.push(Delta::Error(ParseError {
            parser: self.syntax.name(),
            reason,
            detail,
        }));
    }

    /// The earliest position from which `text` could be (or is) markup.
    fn hold_from(&self, text: &str) -> Option<usize> {
        text.char_indices().find_map(|(i, ch)| {
            let rest = &text[i..];
            (ch == '<'
                && self
                    .syntax
                    .starts()
                    .iter()
                    .any(|m| m.starts_with(rest) || rest.starts_with(m)))
            .then_some(i)
        })
    }

    /// The position of a complete start marker, if one arrived.
    fn start_at(&self, text: &str) -> Option<usize> {
        text.char_indices().find_map(|(i, ch)| {
            let rest = &text[i..];
            (ch == '<' && self.syntax.starts().iter().any(|m| rest.starts_with(m))).then_some(i)
        })
    }

    fn run(&mut self, out: &mut Vec<Delta>) {
        loop {
            match self.state {
                State::Failed => return,
                State::Content => {
                    if let Some(p) = self.start_at(&self.buf) {
                        // What precedes the block is content; the blank line before it
                        // belongs to the block's format.
                        let head = self.buf[..p].trim_end().to_owned();
                        emit_content(out, &head);
                        self.buf.drain(..p);
                        self.enter_block();
                        continue;
                    }
                    // Keep back what could still start a marker, and trailing whitespace
                    // (it may be the blank line before a block).
                    let keep = self.hold_from(&self.buf).unwrap_or(self.buf.len());
                    let keep = self.buf[..keep].trim_end().len();
                    let text: String = self.buf.drain(..keep).collect();
                    emit_content(out, &text);
                    return;
                }
                State::Block => {
                    if !self.opened {
                        let head: String = self.buf.chars().take(256).collect();
                        match self.syntax.opening(&self.syntax.normalize(&head)) {
                            None if head.chars().count() < 256 => return,
                            None => {
                                self.fail(
                                    out,
                                    "malformed_tag",
                                    format!("no opening tag in {head:?}"),
                                );
                                return;
                            }
                            Some(Ok(())) => self.opened = true,
                            Some(Err(e)) => {
                                self.state = State::Failed;
                                self.buf.clear();
                                out.push(Delta::Error(e));
                                return;
                            }
                        }
                    }
                    // Only the new text (and a tag's length before it) can hold the
                    // closing tag: a long block is scanned once, not at every chunk.
                    let longest = self.ends.iter().map(String::len).max().unwrap_or(0);
                    let mut from = self.scanned.saturating_sub(longest);
                    while !self.buf.is_char_boundary(from) {
                        from -= 1;
                    }
                    self.scanned = self.buf.len();
                    let Some(end) = self
                        .ends
                        .iter()
                        .filter_map(|e| {
                            self.buf[from..]
                                .find(e.as_str())
                                .map(|i| from + i + e.len())
                        })
                        .min()
                    else {
                        return;
                    };
                    let norm = self.syntax.normalize(&self.buf[..end]);
                    let rest = self.buf[end..].to_owned();
                    match self.syntax.parse(&norm) {
                        Ok(calls) => {
                            self.emit_calls(out, calls);
                            if self.state == State::Failed {
                                return;
                            }
                            self.buf = rest;
                            self.state = State::After;
                        }
                        Err(e) => {
                            self.state = State::Failed;
                            self.buf.clear();
                            out.push(Delta::Error(e));
                            return;
                        }
                    }
                }
                State::After => {
                    if let Some(p) = self.start_at(&self.buf) {
                        if !is_trailer(&self.buf[..p]) {
                            let detail = format!("text between blocks: {:?}", &self.buf[..p]);
                            self.fail(out, "trailing_text", detail);
                            return;
                        }
                        self.buf.drain(..p);
                        self.enter_block();
                        continue;
                    }
                    // Whitespace and end-of-sequence markers may follow; anything else is
                    // an error once it cannot be the start of one of those.
                    let keep = self.hold_from(&self.buf).unwrap_or(self.buf.len());
                    let settled = &self.buf[..keep];
                    if !is_trailer(settled) && !could_be_trailer(settled) {
                        let detail = format!("text after the calls: {settled:?}");
                        self.fail(out, "trailing_text", detail);
                    }
                    return;
                }
            }
        }
    }
}

/// End-of-sequence texts a generation may end with after its calls.
const EOS_TEXTS: [&str; 3] = ["<｜end▁of▁sentence｜>", "<|im_end|>", "<|endoftext|>"];

/// Text that may follow a block: whitespace and an end-of-sequence marker.
fn is_trailer(text: &str) -> bool {
    let mut t = text.trim();
    for e in EOS_TEXTS {
        t = t.strip_suffix(e).unwrap_or(t).trim();
    }
    t.is_empty()
}

/// Whether `text` (whitespace so far, then the start of an end-of-sequence marker) may
/// still turn out to be a trailer.
fn could_be_trailer(text: &str) -> bool {
    let t = text.trim_start();
    EOS_TEXTS.iter().any(|e| e.starts_with(t))
}

fn emit_content(out: &mut Vec<Delta>, text: &str) {
    if !text.is_empty() {
        out.push(Delta::Content(text.to_owned()));
    }
}
