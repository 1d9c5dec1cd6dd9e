//! DeepSeek V3.1 tool calls: V3's block of special tokens ([`super::deepseek_v3`]), each
//! call the tool's name, the separator and the arguments' JSON, unfenced. The chat
//! template writes them into prompts.

use serde_json::Value;

use super::deepseek_v3::{self, BEGIN, CALL_BEGIN, CALL_END, END, MARKERS, SEP, writes_call_type};
use super::{Tool, ToolSyntax};
use crate::schema::SchemaError;
use crate::{Call, ParseError};

/// The format's name.
pub const NAME: &str = "deepseek_v31";

/// DeepSeek V3.1 (see the module docs).
#[derive(Clone, Copy, Debug)]
pub struct DeepSeekV31;

impl ToolSyntax for DeepSeekV31 {
    fn name(&self) -> &'static str {
        NAME
    }

    fn markers(&self) -> &'static [&'static str] {
        MARKERS
    }

    fn written_by(&self, template: &str) -> bool {
        template.contains(BEGIN) && !writes_call_type(template)
    }

    fn starts(&self) -> &'static [&'static str] {
        MARKERS
    }

    fn ends(&self) -> Vec<String> {
        vec![END.to_owned()]
    }

    fn opening(&self, block: &str) -> Option<Result<(), ParseError>> {
        deepseek_v3::opening(NAME, block)
    }

    fn closed_prefix(&self, block: &str) -> Option<String> {
        deepseek_v3::closed_prefix(block)
    }

    fn parse(&self, block: &str) -> Result<Vec<Call>, ParseError> {
        deepseek_v3::parse_block(NAME, block, |c| {
            let name = c.until(SEP, "malformed_tag")?.trim().to_owned();
            let body = c.until(CALL_END, "unterminated_call")?;
            Ok((name, body))
        })
    }

    fn grammar(&self, tools: &[&Tool], many: bool) -> Result<String, SchemaError> {
        deepseek_v3::grammar(tools, many, "", SEP, "")
    }

    /// The calls back to back in one block, each the name, the separator and its
    /// arguments as compact JSON.
    fn write_calls(&self, calls: &[Call]) -> String {
        let body: String = calls
            .iter()
            .map(|c| {
                format!(
                    "{CALL_BEGIN}{}{SEP}{}{CALL_END}",
                    c.name,
                    Value::Object(c.arguments.clone())
                )
            })
            .collect();
        format!("{BEGIN}{body}{END}")
    }
}
