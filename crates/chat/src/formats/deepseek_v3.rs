//! DeepSeek V3 / R1 tool calls: a `tool▁calls` block of `tool▁call`s made of the
//! tokenizer's own special tokens, each call `function`, the separator, the tool's name, a
//! newline and its arguments as fenced JSON. The chat template writes them into prompts.
//!
//! The block's tokens are DeepSeek V3.1's too ([`super::deepseek_v31`]), which writes a
//! call differently; both read a block through [`parse_block`].

use serde_json::Value;

use super::{Cursor, Tool, ToolSyntax, call_alternatives, err, lit, object};
use crate::schema::{SchemaError, json_rule};
use crate::{Call, ParseError};

/// The format's name.
pub const NAME: &str = "deepseek_v3";

pub(super) const BEGIN: &str = "<｜tool▁calls▁begin｜>";
pub(super) const END: &str = "<｜tool▁calls▁end｜>";
pub(super) const CALL_BEGIN: &str = "<｜tool▁call▁begin｜>";
pub(super) const CALL_END: &str = "<｜tool▁call▁end｜>";
pub(super) const SEP: &str = "<｜tool▁sep｜>";
/// Written before the separator, where V3.1 writes the tool's name.
const CALL_TYPE: &str = "function";

/// The markup of both V3 and V3.1.
pub(super) const MARKERS: &[&str] = &[BEGIN, CALL_BEGIN, SEP, CALL_END, END];

/// DeepSeek V3 / R1 (see the module docs).
#[derive(Clone, Copy, Debug)]
pub struct DeepSeekV3;

/// Whether a template writes V3's calls (the call type before the separator).
pub(super) fn writes_call_type(template: &str) -> bool {
    template.contains(&format!("{CALL_TYPE}{SEP}"))
}

impl ToolSyntax for DeepSeekV3 {
    fn name(&self) -> &'static str {
        NAME
    }

    fn markers(&self) -> &'static [&'static str] {
        MARKERS
    }

    fn written_by(&self, template: &str) -> bool {
        template.contains(BEGIN) && writes_call_type(template)
    }

    fn starts(&self) -> &'static [&'static str] {
        MARKERS
    }

    fn ends(&self) -> Vec<String> {
        vec![END.to_owned()]
    }

    fn opening(&self, block: &str) -> Option<Result<(), ParseError>> {
        opening(NAME, block)
    }

    fn closed_prefix(&self, block: &str) -> Option<String> {
        closed_prefix(block)
    }

    fn parse(&self, block: &str) -> Result<Vec<Call>, ParseError> {
        parse_block(NAME, block, |c| {
            c.expect(CALL_TYPE, "malformed_tag")?;
            c.expect(SEP, "malformed_tag")?;
            let name = c.until("\n", "malformed_tag")?.trim().to_owned();
            c.expect("```json", "malformed_tag")?;
            let body = c.until("```", "unterminated_call")?;
            c.skip_ws();
            c.expect(CALL_END, "malformed_tag")?;
            Ok((name, body))
        })
    }

    fn grammar(&self, tools: &[&Tool], many: bool) -> Result<String, SchemaError> {
        grammar(
            tools,
            many,
            &format!("{CALL_TYPE}{SEP}"),
            "\\n```json\\n",
            "\\n```",
        )
    }

    /// The calls back to back in one block, each `function`, the separator, the name and
    /// its arguments as compact JSON fenced on their own lines.
    fn write_calls(&self, calls: &[Call]) -> String {
        let body: String = calls
            .iter()
            .map(|c| {
                format!(
                    "{CALL_BEGIN}{CALL_TYPE}{SEP}{}\n```json\n{}\n```{CALL_END}",
                    c.name,
                    Value::Object(c.arguments.clone())
                )
            })
            .collect();
        format!("{BEGIN}{body}{END}")
    }
}

/// V3 and V3.1: a block opens with [`BEGIN`]; a call outside one is an error.
pub(super) fn opening(parser: &'static str, block: &str) -> Option<Result<(), ParseError>> {
    let end = block.find('>')?;
    let tag = &block[..=end];
    Some(if tag == BEGIN {
        Ok(())
    } else if tag == CALL_BEGIN {
        Err(err(
            parser,
            "bare_invoke",
            "a call outside a tool_calls block",
        ))
    } else {
        Err(err(
            parser,
            "wrong_wrapper",
            format!("block opens with {tag:?}"),
        ))
    })
}

/// V3 and V3.1: the calls that ended, closed with [`END`].
pub(super) fn closed_prefix(block: &str) -> Option<String> {
    if !block.starts_with(BEGIN) {
        return None;
    }
    let end = block.rfind(CALL_END)? + CALL_END.len();
    Some(format!("{}{END}", &block[..end]))
}

/// V3 and V3.1: a block of calls, `call` reading one after its [`CALL_BEGIN`] up to and
/// including its [`CALL_END`] (the name and the arguments' text).
pub(super) fn parse_block<'a>(
    parser: &'static str,
    block: &'a str,
    call: impl Fn(&mut Cursor<'a>) -> Result<(String, &'a str), ParseError>,
) -> Result<Vec<Call>, ParseError> {
    let mut c = Cursor::new(block, parser);
    if !c.eat(BEGIN) {
        return Err(err(
            parser,
            "bare_invoke",
            "a call outside a tool_calls block",
        ));
    }
    let mut calls = Vec::new();
    loop {
        c.skip_ws();
        if c.eat(END) {
            break;
        }
        c.expect(CALL_BEGIN, "malformed_tag")?;
        let (name, args) = call(&mut c)?;
        calls.push(Call {
            arguments: object(parser, &name, args)?,
            name,
        });
    }
    if calls.is_empty() {
        return Err(err(
            parser,
            "empty_block",
            "a tool_calls block without a call",
        ));
    }
    Ok(calls)
}

/// V3 and V3.1: the grammar of a block whose calls are `before`, the name, `between`,
/// the arguments' JSON and `after` (Lark string contents, escapes and all).
pub(super) fn grammar(
    tools: &[&Tool],
    many: bool,
    before: &str,
    between: &str,
    after: &str,
) -> Result<String, SchemaError> {
    let rep = if many { "+" } else { "" };
    let mut g = format!(
        "start: \"{BEGIN}\" call{rep} \"{END}\"\ncall: {}\n",
        call_alternatives(tools)
    );
    for (i, t) in tools.iter().enumerate() {
        g.push_str(&format!(
            "call{i}: \"{CALL_BEGIN}{before}\" {} \"{between}\" {} \"{after}{CALL_END}\"\n",
            lit(&t.name),
            json_rule(&t.parameters)?
        ));
    }
    Ok(g)
}
