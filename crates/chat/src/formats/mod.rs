//! The tool-call formats: one module per model family's markup, each behind
//! [`ToolSyntax`]: the strings its markup is made of, how a block of it parses (the hooks
//! the streaming [`ToolParser`](crate::ToolParser) calls), the grammar that makes a model
//! write it, and how pdmesh writes calls in it. [`ToolFormat`] names the set.
//!
//! **Architecture Invariant:** no code outside a format's module spells its markup; other
//! code asks the format (`crates/chat/tests/markers.rs`). `crates/chat/tests/round_trip.rs`
//! checks that each format's writing, grammar and parser agree.

pub mod deepseek_v3;
pub mod deepseek_v31;
pub mod dsml;
pub mod hermes;

use serde_json::{Map, Value};

use crate::schema::SchemaError;
use crate::{Call, ParseError};

/// A model family's tool-call markup.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ToolFormat {
    /// DeepSeek DSML: V3.2 `function_calls`, V4 `tool_calls`, V4.1 with a space after the
    /// sentinel; leaked and doubled sentinels are read as the real one ([`dsml`]).
    Dsml,
    /// DeepSeek V3 / R1: `function`, the separator, the name and a fenced JSON body
    /// ([`deepseek_v3`]).
    DeepSeekV3,
    /// DeepSeek V3.1: the name, the separator and the arguments ([`deepseek_v31`]).
    DeepSeekV31,
    /// Hermes / Qwen: one JSON object with `name` and `arguments` per block ([`hermes`]).
    Hermes,
}

impl ToolFormat {
    /// Every format.
    pub const ALL: [ToolFormat; 4] = [
        ToolFormat::Dsml,
        ToolFormat::DeepSeekV3,
        ToolFormat::DeepSeekV31,
        ToolFormat::Hermes,
    ];

    /// The module that implements this format.
    pub fn syntax(self) -> &'static dyn ToolSyntax {
        match self {
            ToolFormat::Dsml => &dsml::Dsml,
            ToolFormat::DeepSeekV3 => &deepseek_v3::DeepSeekV3,
            ToolFormat::DeepSeekV31 => &deepseek_v31::DeepSeekV31,
            ToolFormat::Hermes => &hermes::Hermes,
        }
    }

    /// The format's name ([`ToolSyntax::name`]): the `parser` of its parse errors, a
    /// metric label, and its name on the wire.
    pub fn name(self) -> &'static str {
        self.syntax().name()
    }

    /// The format named `name` ([`Self::name`]).
    pub fn from_name(name: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|f| f.name() == name)
    }

    /// The markup a chat template asks the model to write: the first of DeepSeek V3,
    /// V3.1 and DSML whose markup its source writes, else Hermes (Qwen-style templates,
    /// and pdmesh's own tools block for templates without tools).
    pub fn from_template(source: &str) -> Self {
        [
            ToolFormat::DeepSeekV3,
            ToolFormat::DeepSeekV31,
            ToolFormat::Dsml,
        ]
        .into_iter()
        .find(|f| f.syntax().written_by(source))
        .unwrap_or(ToolFormat::Hermes)
    }
}

/// How one model family writes tool calls. One implementation per format, each in its own
/// module; [`ToolFormat::syntax`] gives the one for a format.
pub trait ToolSyntax: Sync {
    /// The format's name (a closed set: [`crate::PARSERS`]).
    fn name(&self) -> &'static str;

    /// Every string this format's markup is made of (tags, sentinels and the spellings
    /// it also accepts), for the check that no other code spells them.
    fn markers(&self) -> &'static [&'static str];

    /// Whether a chat template's source asks the model for this format.
    fn written_by(&self, template: &str) -> bool;

    /// Strings whose appearance starts markup: no content may hold one.
    fn starts(&self) -> &'static [&'static str];

    /// The closing tags of a block, in every spelling the format accepts.
    fn ends(&self) -> Vec<String>;

    /// The text of a block in its canonical spelling (variants rewritten).
    fn normalize(&self, block: &str) -> String {
        block.to_owned()
    }

    /// Once the block's first tag is complete (canonical text): whether it opens a block
    /// (a closing tag, a bare call or another wrapper is an error at once). `None` until
    /// it is complete.
    fn opening(&self, block: &str) -> Option<Result<(), ParseError>>;

    /// The complete calls of a block cut short (canonical text, from its opening tag), as
    /// a closed block: the text up to its last call's end with the block's closing tag
    /// added. `None` when no call in it ended, or the format has one call per block.
    fn closed_prefix(&self, _block: &str) -> Option<String> {
        None
    }

    /// Parses one whole block (canonical text, from its opening tag to its closing tag).
    fn parse(&self, block: &str) -> Result<Vec<Call>, ParseError>;

    /// The Lark grammar (its first rule `start`) of one call, or of one or more (`many`),
    /// of one of `tools`, in this format's markup: what a constrained answer writes.
    fn grammar(&self, tools: &[&Tool], many: bool) -> Result<String, SchemaError>;

    /// The text a model constrained by [`Self::grammar`] (with `many` for several calls)
    /// writes for `calls`, which the streaming parser reads back into the same calls.
    fn write_calls(&self, calls: &[Call]) -> String;
}

/// One function a request offers.
#[derive(Clone, Debug, PartialEq)]
pub struct Tool {
    pub name: String,
    /// The arguments' JSON schema (`{"type": "object"}` when the tool gives none).
    pub parameters: Value,
}

/// A parse error of the format named `parser`.
pub(crate) fn err(
    parser: &'static str,
    reason: &'static str,
    detail: impl Into<String>,
) -> ParseError {
    ParseError {
        parser,
        reason,
        detail: detail.into(),
    }
}

/// A cursor over a block's text; its errors name the format `parser`.
pub(crate) struct Cursor<'a> {
    s: &'a str,
    at: usize,
    parser: &'static str,
}

impl<'a> Cursor<'a> {
    pub(crate) fn new(s: &'a str, parser: &'static str) -> Self {
        Self { s, at: 0, parser }
    }
    pub(crate) fn rest(&self) -> &'a str {
        &self.s[self.at..]
    }
    pub(crate) fn skip_ws(&mut self) {
        let r = self.rest();
        self.at += r.len() - r.trim_start().len();
    }
    pub(crate) fn eat(&mut self, lit: &str) -> bool {
        if self.rest().starts_with(lit) {
            self.at += lit.len();
            true
        } else {
            false
        }
    }
    pub(crate) fn expect(&mut self, lit: &str, reason: &'static str) -> Result<(), ParseError> {
        if self.eat(lit) {
            Ok(())
        } else {
            Err(err(
                self.parser,
                reason,
                format!("expected {lit:?} at {:?}", head(self.rest())),
            ))
        }
    }
    /// Text up to `lit` (consumed, not returned).
    pub(crate) fn until(&mut self, lit: &str, reason: &'static str) -> Result<&'a str, ParseError> {
        let r = self.rest();
        let i = r.find(lit).ok_or_else(|| {
            err(
                self.parser,
                reason,
                format!("no {lit:?} after {:?}", head(r)),
            )
        })?;
        self.at += i + lit.len();
        Ok(&r[..i])
    }
    /// `name="VALUE"`: the attribute's value.
    pub(crate) fn attr(&mut self, name: &str) -> Result<&'a str, ParseError> {
        self.skip_ws();
        self.expect(&format!("{name}=\""), "malformed_tag")?;
        self.until("\"", "malformed_tag")
    }
}

/// The first 40 characters of `s`, for error details.
pub(crate) fn head(s: &str) -> String {
    s.chars().take(40).collect()
}

/// A call's arguments: `text` must be a JSON object, and `name` a tool name.
pub(crate) fn object(
    parser: &'static str,
    name: &str,
    text: &str,
) -> Result<Map<String, Value>, ParseError> {
    if name.is_empty() || name.contains('<') {
        return Err(err(parser, "malformed_tag", format!("tool name {name:?}")));
    }
    match serde_json::from_str(text.trim()) {
        Ok(Value::Object(m)) => Ok(m),
        Ok(other) => Err(err(
            parser,
            "bad_json",
            format!("arguments of {name:?} are not an object: {other}"),
        )),
        Err(e) => Err(err(
            parser,
            "bad_json",
            format!("arguments of {name:?}: {e}"),
        )),
    }
}

/// A Lark string literal.
pub(crate) fn lit(s: &str) -> String {
    Value::String(s.to_owned()).to_string()
}

/// `schema` (a part of the tool's `parameters`) made a document of its own: `$ref`s resolve
/// against the root, so the parameters' `$defs` and `definitions` move to it.
pub(crate) fn with_definitions(mut schema: Value, parameters: &Value) -> Value {
    if let Value::Object(m) = &mut schema {
        for key in ["$defs", "definitions"] {
            if let Some(d) = parameters.get(key)
                && !m.contains_key(key)
            {
                m.insert(key.into(), d.clone());
            }
        }
    }
    schema
}

/// The `callN` alternatives of a grammar over `tools`, one per tool.
pub(crate) fn call_alternatives(tools: &[&Tool]) -> String {
    (0..tools.len())
        .map(|i| format!("call{i}"))
        .collect::<Vec<_>>()
        .join(" | ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_distinct_and_read_back() {
        for f in ToolFormat::ALL {
            assert_eq!(ToolFormat::from_name(f.name()), Some(f));
        }
        assert_eq!(
            ToolFormat::ALL.map(ToolFormat::name),
            crate::PARSERS,
            "PARSERS lists every format's name, in order"
        );
        assert_eq!(ToolFormat::from_name("json"), None);
    }
}
