//! The model's chat template (`tokenizer.chat_template`, Jinja) rendered with minijinja
//! under the settings Hugging Face transformers and llama.cpp use, so a conversation
//! becomes exactly the prompt the model was trained on.

use minijinja::value::{Kwargs, ValueKind};
use minijinja::{Environment, Error, ErrorKind, Value};
use serde::{Deserialize, Serialize};

use crate::TextError;

/// One chat turn, as OpenAI's API and the templates see it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChatMessage {
    pub role: String,
    pub content: String,
}

impl ChatMessage {
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Self {
        Self {
            role: role.into(),
            content: content.into(),
        }
    }
}

const NAME: &str = "chat_template";

/// A compiled chat template. Cheap to clone.
#[derive(Clone)]
pub struct ChatTemplate {
    env: Environment<'static>,
    source: String,
    bos_token: String,
    eos_token: String,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplate")
            .field("source_len", &self.source.len())
            .finish()
    }
}

impl ChatTemplate {
    /// Compiles `source`; `bos_token`/`eos_token` are the texts the template sees under
    /// those names. A syntax error is reported here, not at render time.
    pub fn new(source: &str, bos_token: &str, eos_token: &str) -> Result<Self, TextError> {
        let mut env = Environment::new();
        // transformers' ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True).
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", raise_exception);
        env.add_filter("tojson", tojson);
        env.add_template_owned(NAME, source.to_string())
            .map_err(TextError::template)?;
        Ok(Self {
            env,
            source: source.to_string(),
            bos_token: bos_token.into(),
            eos_token: eos_token.into(),
        })
    }

    /// The template's Jinja source.
    pub fn source(&self) -> &str {
        &self.source
    }

    /// Renders `messages` (and `tools`, a JSON list of tool definitions, when given) into
    /// a prompt; `add_generation_prompt` appends the header that opens the assistant's turn.
    pub fn render(
        &self,
        messages: &[ChatMessage],
        tools: Option<&serde_json::Value>,
        add_generation_prompt: bool,
    ) -> Result<String, TextError> {
        let tmpl = self.env.get_template(NAME).map_err(TextError::template)?;
        let ctx = minijinja::context! {
            messages => Value::from_serialize(messages),
            tools => tools.map(Value::from_serialize).unwrap_or(Value::from(())),
            add_generation_prompt => add_generation_prompt,
            bos_token => self.bos_token.as_str(),
            eos_token => self.eos_token.as_str(),
        };
        tmpl.render(ctx).map_err(TextError::template)
    }
}

/// `raise_exception(msg)`: how HF templates reject a conversation they cannot format.
fn raise_exception(msg: String) -> Result<Value, Error> {
    Err(Error::new(ErrorKind::InvalidOperation, msg))
}

/// transformers' `tojson`: `json.dumps(x, ensure_ascii=False, indent=indent,
/// sort_keys=sort_keys)`, i.e. Python's separators and no HTML escaping (minijinja's
/// built-in escapes `<`, `>`, `&` and `'`, which would change prompts).
fn tojson(value: &Value, kwargs: Kwargs) -> Result<Value, Error> {
    let indent: Option<usize> = kwargs.get("indent")?;
    let sort_keys: Option<bool> = kwargs.get("sort_keys")?;
    let ensure_ascii: Option<bool> = kwargs.get("ensure_ascii")?;
    kwargs.assert_all_used()?;
    if ensure_ascii == Some(true) {
        return Err(Error::new(
            ErrorKind::InvalidOperation,
            "tojson(ensure_ascii=true) is not supported",
        ));
    }
    let mut out = String::new();
    py_json(value, indent, sort_keys.unwrap_or(false), 0, &mut out)?;
    Ok(Value::from_safe_string(out))
}

fn py_json(
    v: &Value,
    indent: Option<usize>,
    sort: bool,
    level: usize,
    out: &mut String,
) -> Result<(), Error> {
    let newline = |out: &mut String, level: usize| {
        if let Some(n) = indent {
            out.push('\n');
            out.push_str(&" ".repeat(n * level));
        }
    };
    let item_sep = if indent.is_some() { "," } else { ", " };
    match v.kind() {
        ValueKind::Undefined | ValueKind::None => out.push_str("null"),
        ValueKind::Bool => out.push_str(if v.is_true() { "true" } else { "false" }),
        ValueKind::String => {
            out.push_str(&serde_json::to_string(v.as_str().unwrap_or_default()).map_err(json_err)?)
        }
        ValueKind::Number => {
            if v.is_integer() {
                out.push_str(&v.to_string());
            } else {
                let f = f64::try_from(v.clone())?;
                if !f.is_finite() {
                    return Err(Error::new(
                        ErrorKind::InvalidOperation,
                        "tojson: non-finite number",
                    ));
                }
                out.push_str(&format!("{f:?}"));
            }
        }
        ValueKind::Seq | ValueKind::Iterable => {
            let items: Vec<Value> = v.try_iter()?.collect();
            if items.is_empty() {
                out.push_str("[]");
                return Ok(());
            }
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(item_sep);
                }
                newline(out, level + 1);
                py_json(item, indent, sort, level + 1, out)?;
            }
            newline(out, level);
            out.push(']');
        }
        ValueKind::Map => {
            let mut keys: Vec<Value> = v.try_iter()?.collect();
            if sort {
                keys.sort();
            }
            if keys.is_empty() {
                out.push_str("{}");
                return Ok(());
            }
            out.push('{');
            for (i, k) in keys.iter().enumerate() {
                if i > 0 {
                    out.push_str(item_sep);
                }
                newline(out, level + 1);
                let key = k
                    .as_str()
                    .map(str::to_string)
                    .unwrap_or_else(|| k.to_string());
                out.push_str(&serde_json::to_string(&key).map_err(json_err)?);
                out.push_str(": ");
                py_json(&v.get_item(k)?, indent, sort, level + 1, out)?;
            }
            newline(out, level);
            out.push('}');
        }
        other => {
            return Err(Error::new(
                ErrorKind::InvalidOperation,
                format!("tojson: cannot serialize a {other}"),
            ));
        }
    }
    Ok(())
}

fn json_err(e: serde_json::Error) -> Error {
    Error::new(ErrorKind::InvalidOperation, "tojson failed").with_source(e)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn render_expr(expr: &str, value: serde_json::Value) -> String {
        let t = ChatTemplate::new(&format!("{{{{ {expr} }}}}"), "", "").unwrap();
        let tmpl = t.env.get_template(NAME).unwrap();
        tmpl.render(minijinja::context! { x => Value::from_serialize(&value) })
            .unwrap()
    }

    #[test]
    fn tojson_matches_python_json_dumps() {
        let v = serde_json::json!({"name": "get_weather", "args": [1, 2.5, true, null, "<a&b>'é"]});
        // json.dumps(v, ensure_ascii=False) with keys in the order serde_json yields them.
        let keys_in_order: Vec<&String> = v.as_object().unwrap().keys().collect();
        let expected = if keys_in_order[0] == "name" {
            r#"{"name": "get_weather", "args": [1, 2.5, true, null, "<a&b>'é"]}"#
        } else {
            r#"{"args": [1, 2.5, true, null, "<a&b>'é"], "name": "get_weather"}"#
        };
        assert_eq!(render_expr("x | tojson", v.clone()), expected);
        assert_eq!(
            render_expr("x | tojson(indent=2, sort_keys=true)", v),
            "{\n  \"args\": [\n    1,\n    2.5,\n    true,\n    null,\n    \"<a&b>'é\"\n  ],\n  \"name\": \"get_weather\"\n}"
        );
        assert_eq!(render_expr("x | tojson", serde_json::json!([])), "[]");
        assert_eq!(render_expr("x | tojson", serde_json::json!(1.0)), "1.0");
    }

    #[test]
    fn python_string_methods_work() {
        let t = ChatTemplate::new("{{ messages[0]['content'].strip().upper() }}", "", "").unwrap();
        assert_eq!(
            t.render(&[ChatMessage::new("user", "  hi  ")], None, false)
                .unwrap(),
            "HI"
        );
    }

    #[test]
    fn syntax_error_is_reported_at_compile_time() {
        let err = ChatTemplate::new("{% for m in messages %}", "", "").unwrap_err();
        assert!(matches!(err, TextError::Template(_)), "{err:?}");
        assert!(err.to_string().contains("chat template"), "{err}");
    }
}
