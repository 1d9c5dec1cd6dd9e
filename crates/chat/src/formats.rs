//! The tool-call formats: how a block starts and ends, and how a whole block parses.

use serde_json::{Map, Value};

use crate::{Call, ParseError};

/// A model family's tool-call markup.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Format {
    /// DeepSeek DSML: V3.2 `function_calls`, V4 `tool_calls`, V4.1 with a space after the
    /// sentinel; the leaked ASCII (`|DSML|`), `‖DSML‖` and doubled (`｜｜DSML｜｜`)
    /// sentinels are read as the real one.
    Dsml,
    /// DeepSeek V3 / R1: `function<｜tool▁sep｜>NAME` and a fenced JSON body.
    DeepSeekV3,
    /// DeepSeek V3.1: `NAME<｜tool▁sep｜>ARGS`.
    DeepSeekV31,
    /// Hermes / Qwen: `<tool_call>{"name": …, "arguments": {…}}</tool_call>`.
    Hermes,
}

const D: &str = "｜DSML｜";
const DSML_VARIANTS: [&str; 4] = ["｜｜DSML｜｜", "‖DSML‖", "|DSML|", "｜DSML｜ "];
const EOS_TEXTS: [&str; 3] = ["<｜end▁of▁sentence｜>", "<|im_end|>", "<|endoftext|>"];

const V3_BEGIN: &str = "<｜tool▁calls▁begin｜>";
const V3_END: &str = "<｜tool▁calls▁end｜>";
const V3_CALL_BEGIN: &str = "<｜tool▁call▁begin｜>";
const V3_CALL_END: &str = "<｜tool▁call▁end｜>";
const V3_SEP: &str = "<｜tool▁sep｜>";

impl Format {
    pub fn name(self) -> &'static str {
        match self {
            Format::Dsml => "dsml",
            Format::DeepSeekV3 => "deepseek_v3",
            Format::DeepSeekV31 => "deepseek_v31",
            Format::Hermes => "hermes",
        }
    }

    /// Strings whose appearance starts markup (no content may contain one).
    pub(crate) fn starts(self) -> &'static [&'static str] {
        match self {
            Format::Dsml => &[
                "<｜DSML｜",
                "</｜DSML｜",
                "<|DSML|",
                "</|DSML|",
                "<‖DSML‖",
                "</‖DSML‖",
                "<｜｜DSML｜｜",
                "</｜｜DSML｜｜",
            ],
            Format::DeepSeekV3 | Format::DeepSeekV31 => {
                &[V3_BEGIN, V3_CALL_BEGIN, V3_SEP, V3_CALL_END, V3_END]
            }
            Format::Hermes => &["<tool_call>", "</tool_call>"],
        }
    }

    /// The text of a block in canonical spelling (DSML variants rewritten).
    pub(crate) fn normalize(self, block: &str) -> String {
        match self {
            Format::Dsml => {
                let mut s = block.to_owned();
                for v in DSML_VARIANTS {
                    s = s.replace(v, D);
                }
                s
            }
            _ => block.to_owned(),
        }
    }

    /// The closing tags of a block, in every spelling the format accepts.
    pub(crate) fn ends(self) -> Vec<String> {
        match self {
            Format::Dsml => {
                let mut v = Vec::new();
                for s in [D, "｜DSML｜ ", "|DSML|", "‖DSML‖", "｜｜DSML｜｜"] {
                    for w in ["function_calls>", "tool_calls>"] {
                        v.push(format!("</{s}{w}"));
                    }
                }
                v
            }
            Format::DeepSeekV3 | Format::DeepSeekV31 => vec![V3_END.to_owned()],
            Format::Hermes => vec!["</tool_call>".to_owned()],
        }
    }

    /// Text that may follow a block: whitespace and an end-of-sequence marker.
    pub(crate) fn is_trailer(self, text: &str) -> bool {
        let mut t = text.trim();
        for e in EOS_TEXTS {
            t = t.strip_suffix(e).unwrap_or(t).trim();
        }
        t.is_empty()
    }

    /// Once the block's first tag is complete: whether it opens a block (a closing tag, a
    /// bare call or another wrapper is an error at once). `None` until it is complete.
    pub(crate) fn opening(self, block: &str) -> Option<Result<(), ParseError>> {
        let end = block.find('>')?;
        let tag = &block[..=end];
        let ok = match self {
            Format::Dsml => {
                if tag == format!("<{D}function_calls>") || tag == format!("<{D}tool_calls>") {
                    return Some(Ok(()));
                }
                if tag.starts_with(&format!("<{D}invoke")) {
                    return Some(Err(err(
                        self,
                        "bare_invoke",
                        "an invoke outside a function_calls block",
                    )));
                }
                false
            }
            Format::DeepSeekV3 | Format::DeepSeekV31 => {
                if tag == V3_BEGIN {
                    return Some(Ok(()));
                }
                if tag == V3_CALL_BEGIN {
                    return Some(Err(err(
                        self,
                        "bare_invoke",
                        "a call outside a tool_calls block",
                    )));
                }
                false
            }
            Format::Hermes => tag == "<tool_call>",
        };
        Some(if ok {
            Ok(())
        } else {
            Err(err(
                self,
                "wrong_wrapper",
                format!("block opens with {tag:?}"),
            ))
        })
    }

    /// The complete calls of a block cut short (canonical text, from its opening tag), as
    /// a closed block: the text up to its last call's end with the block's closing tag
    /// added. `None` when no call in it ended, or the format has one call per block.
    pub(crate) fn closed_prefix(self, block: &str) -> Option<String> {
        let (call_end, close) = match self {
            Format::Dsml => {
                let wrapper = ["function_calls", "tool_calls"]
                    .into_iter()
                    .find(|w| block.starts_with(&format!("<{D}{w}>")))?;
                (format!("</{D}invoke>"), format!("\n</{D}{wrapper}>"))
            }
            Format::DeepSeekV3 | Format::DeepSeekV31 => {
                if !block.starts_with(V3_BEGIN) {
                    return None;
                }
                (V3_CALL_END.to_owned(), V3_END.to_owned())
            }
            Format::Hermes => return None,
        };
        let end = block.rfind(&call_end)? + call_end.len();
        Some(format!("{}{close}", &block[..end]))
    }

    /// Parses one whole block (canonical text, from its opening tag to its closing tag).
    pub(crate) fn parse(self, block: &str) -> Result<Vec<Call>, ParseError> {
        match self {
            Format::Dsml => parse_dsml(block),
            Format::DeepSeekV3 => parse_v3(block, true),
            Format::DeepSeekV31 => parse_v3(block, false),
            Format::Hermes => parse_hermes(block),
        }
    }
}

fn err(parser: Format, reason: &'static str, detail: impl Into<String>) -> ParseError {
    ParseError {
        parser: parser.name(),
        reason,
        detail: detail.into(),
    }
}

/// A cursor over a block's text.
struct Cursor<'a> {
    s: &'a str,
    at: usize,
    f: Format,
}

impl<'a> Cursor<'a> {
    fn rest(&self) -> &'a str {
        &self.s[self.at..]
    }
    fn skip_ws(&mut self) {
        let r = self.rest();
        self.at += r.len() - r.trim_start().len();
    }
    fn eat(&mut self, lit: &str) -> bool {
        if self.rest().starts_with(lit) {
            self.at += lit.len();
            true
        } else {
            false
        }
    }
    fn expect(&mut self, lit: &str, reason: &'static str) -> Result<(), ParseError> {
        if self.eat(lit) {
            Ok(())
        } else {
            Err(err(
                self.f,
                reason,
                format!("expected {lit:?} at {:?}", head(self.rest())),
            ))
        }
    }
    /// Text up to `lit` (consumed, not returned).
    fn until(&mut self, lit: &str, reason: &'static str) -> Result<&'a str, ParseError> {
        let r = self.rest();
        let i = r
            .find(lit)
            .ok_or_else(|| err(self.f, reason, format!("no {lit:?} after {:?}", head(r))))?;
        self.at += i + lit.len();
        Ok(&r[..i])
    }
    /// `name="VALUE"`: the attribute's value.
    fn attr(&mut self, name: &str) -> Result<&'a str, ParseError> {
        self.skip_ws();
        self.expect(&format!("{name}=\""), "malformed_tag")?;
        self.until("\"", "malformed_tag")
    }
}

fn head(s: &str) -> String {
    s.chars().take(40).collect()
}

fn parse_dsml(block: &str) -> Result<Vec<Call>, ParseError> {
    let f = Format::Dsml;
    let mut c = Cursor { s: block, at: 0, f };
    let wrapper = if c.eat(&format!("<{D}function_calls>")) {
        "function_calls"
    } else if c.eat(&format!("<{D}tool_calls>")) {
        "tool_calls"
    } else if c.rest().starts_with(&format!("<{D}invoke")) {
        return Err(err(
            f,
            "bare_invoke",
            "an invoke outside a function_calls block",
        ));
    } else {
        return Err(err(
            f,
            "wrong_wrapper",
            format!("block opens with {:?}", head(block)),
        ));
    };
    let close = format!("</{D}{wrapper}>");
    let mut calls = Vec::new();
    loop {
        c.skip_ws();
        if c.eat(&close) {
            break;
        }
        c.expect(&format!("<{D}invoke"), "malformed_tag")?;
        let name = c.attr("name")?.to_owned();
        c.expect(">", "malformed_tag")?;
        let mut args = Map::new();
        loop {
            c.skip_ws();
            if c.eat(&format!("</{D}invoke>")) {
                break;
            }
            c.expect(&format!("<{D}parameter"), "malformed_tag")?;
            let key = c.attr("name")?.to_owned();
            let is_string = match c.attr("string")? {
                "true" => true,
                "false" => false,
                other => {
                    return Err(err(
                        f,
                        "bad_string_attr",
                        format!("string=\"{other}\" on parameter {key:?}"),
                    ));
                }
            };
            c.expect(">", "malformed_tag")?;
            let raw = c.until(&format!("</{D}parameter>"), "unterminated_parameter")?;
            if raw.contains(D) {
                return Err(err(
                    f,
                    "malformed_tag",
                    format!("markup inside parameter {key:?}"),
                ));
            }
            let value = if is_string {
                Value::String(raw.to_owned())
            } else {
                serde_json::from_str(raw.trim()).map_err(|e| {
                    err(
                        f,
                        "bad_json",
                        format!("parameter {key:?} = {:?}: {e}", head(raw)),
                    )
                })?
            };
            if args.insert(key.clone(), value).is_some() {
                return Err(err(
                    f,
                    "duplicate_parameter",
                    format!("{key:?} twice in a call to {name:?}"),
                ));
            }
        }
        calls.push(Call {
            name,
            arguments: args,
        });
    }
    if calls.is_empty() {
        return Err(err(
            f,
            "empty_block",
            "a function_calls block without an invoke",
        ));
    }
    Ok(calls)
}

fn parse_v3(block: &str, fenced: bool) -> Result<Vec<Call>, ParseError> {
    let f = if fenced {
        Format::DeepSeekV3
    } else {
        Format::DeepSeekV31
    };
    let mut c = Cursor { s: block, at: 0, f };
    if !c.eat(V3_BEGIN) {
        return Err(err(f, "bare_invoke", "a call outside a tool_calls block"));
    }
    let mut calls = Vec::new();
    loop {
        c.skip_ws();
        if c.eat(V3_END) {
            break;
        }
        c.expect(V3_CALL_BEGIN, "malformed_tag")?;
        let (name, args) = if fenced {
            c.expect("function", "malformed_tag")?;
            c.expect(V3_SEP, "malformed_tag")?;
            let name = c.until("\n", "malformed_tag")?.trim().to_owned();
            c.expect("```json", "malformed_tag")?;
            let body = c.until("```", "unterminated_call")?;
            c.skip_ws();
            c.expect(V3_CALL_END, "malformed_tag")?;
            (name, body)
        } else {
            let name = c.until(V3_SEP, "malformed_tag")?.trim().to_owned();
            let body = c.until(V3_CALL_END, "unterminated_call")?;
            (name, body)
        };
        calls.push(Call {
            arguments: object(f, &name, args)?,
            name,
        });
    }
    if calls.is_empty() {
        return Err(err(f, "empty_block", "a tool_calls block without a call"));
    }
    Ok(calls)
}

fn object(f: Format, name: &str, text: &str) -> Result<Map<String, Value>, ParseError> {
    if name.is_empty() || name.contains('<') {
        return Err(err(f, "malformed_tag", format!("tool name {name:?}")));
    }
    match serde_json::from_str(text.trim()) {
        Ok(Value::Object(m)) => Ok(m),
        Ok(other) => Err(err(
            f,
            "bad_json",
            format!("arguments of {name:?} are not an object: {other}"),
        )),
        Err(e) => Err(err(f, "bad_json", format!("arguments of {name:?}: {e}"))),
    }
}

fn parse_hermes(block: &str) -> Result<Vec<Call>, ParseError> {
    let f = Format::Hermes;
    let mut c = Cursor { s: block, at: 0, f };
    if !c.eat("<tool_call>") {
        return Err(err(
            f,
            "wrong_wrapper",
            format!("block opens with {:?}", head(block)),
        ));
    }
    let body = c.until("</tool_call>", "unterminated_call")?;
    let v: Value =
        serde_json::from_str(body.trim()).map_err(|e| err(f, "bad_json", e.to_string()))?;
    let name = v["name"]
        .as_str()
        .ok_or_else(|| err(f, "bad_json", "a tool call without a string \"name\""))?
        .to_owned();
    let arguments = match &v["arguments"] {
        Value::Object(m) => m.clone(),
        Value::Null => Map::new(),
        // Some models send the arguments as a JSON string.
        Value::String(s) => object(f, &name, s)?,
        other => {
            return Err(err(
                f,
                "bad_json",
                format!("arguments of {name:?}: {other}"),
            ));
        }
    };
    Ok(vec![Call { name, arguments }])
}
