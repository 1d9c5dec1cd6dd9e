//! OpenAI's answers: the JSON of a chat completion or a completion, of their stream chunks,
//! their logprobs and their usage.

use serde_json::{Value, json};

use crate::clients::output::ToolCallDelta;
use crate::generate::{Collected, LogprobEntry, TokenText, Usage};

/// The `usage` object.
pub(crate) fn usage_json(u: &Usage) -> Value {
    json!({
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "total_tokens": u.prompt_tokens + u.completion_tokens,
        "prompt_tokens_details": { "cached_tokens": u.cached_tokens },
    })
}

/// Identity shared by every chunk of one response.
#[derive(Clone, Debug)]
pub(crate) struct ResponseMeta {
    pub id: String,
    pub created: u64,
    pub model: String,
    /// The request asked for logprobs: choices carry them (else `null`).
    pub logprobs: bool,
    /// A completion with `echo`: each choice starts with the prompt.
    pub echo: Option<Echo>,
}

/// The prompt a completion echoes: its text, and its first token (which has no
/// log-probability: nothing comes before it).
#[derive(Clone, Debug)]
pub(crate) struct Echo {
    pub text: String,
    pub first: TokenText,
}

/// The legacy `logprobs` of an echoed prompt: its first token with `null`s, then the rest
/// (`prompt`); offsets from 0, and `offset` left after the prompt.
pub(crate) fn echo_logprobs(e: &Echo, prompt: &[LogprobEntry], offset: &mut usize) -> Value {
    *offset = e.first.text.chars().count();
    let mut v = completion_logprobs(prompt, offset);
    for (key, first) in [
        ("tokens", json!(e.first.text)),
        ("token_logprobs", Value::Null),
        ("top_logprobs", Value::Null),
        ("text_offset", json!(0)),
    ] {
        if let Some(a) = v[key].as_array_mut() {
            a.insert(0, first);
        }
    }
    v
}

/// Two legacy `logprobs` objects one after the other (an echoed prompt's and the
/// completion's).
pub(crate) fn join_logprobs(mut a: Value, b: Value) -> Value {
    for key in ["tokens", "token_logprobs", "top_logprobs", "text_offset"] {
        if let (Some(x), Some(y)) = (a[key].as_array_mut(), b[key].as_array()) {
            x.extend(y.iter().cloned());
        }
    }
    a
}

/// A chat choice's `logprobs`: per token its text, log-probability, bytes and
/// alternatives (OpenAI's `ChatCompletionTokenLogprob`).
pub(crate) fn chat_logprobs(entries: &[LogprobEntry]) -> Value {
    let one = |t: &TokenText, lp: f32| json!({"token": t.text, "logprob": lp, "bytes": t.bytes});
    let content: Vec<Value> = entries
        .iter()
        .map(|e| {
            let mut v = one(&e.token, e.logprob);
            v["top_logprobs"] = e.top.iter().map(|(t, lp)| one(t, *lp)).collect();
            v
        })
        .collect();
    json!({ "content": content, "refusal": null })
}

/// A completion choice's `logprobs` (the legacy shape): token texts, their
/// log-probabilities, the alternatives as `{text: logprob}` and each token's character
/// offset in the completion, counted on from `offset` (advanced past these tokens).
pub(crate) fn completion_logprobs(entries: &[LogprobEntry], offset: &mut usize) -> Value {
    let mut offsets = Vec::with_capacity(entries.len());
    for e in entries {
        offsets.push(*offset);
        *offset += e.token.text.chars().count();
    }
    let top: Vec<Value> = entries
        .iter()
        .map(|e| {
            let map: serde_json::Map<String, Value> = e
                .top
                .iter()
                .map(|(t, lp)| (t.text.clone(), json!(lp)))
                .collect();
            Value::Object(map)
        })
        .collect();
    json!({
        "tokens": entries.iter().map(|e| e.token.text.as_str()).collect::<Vec<_>>(),
        "token_logprobs": entries.iter().map(|e| e.logprob).collect::<Vec<_>>(),
        "top_logprobs": top,
        "text_offset": offsets,
    })
}

/// Choice `index` of a chat completion.
pub(crate) fn chat_choice(
    m: &ResponseMeta,
    index: usize,
    out: &Collected,
    finish_reason: &str,
) -> Value {
    let mut message = json!({ "role": "assistant", "content": out.text });
    if !out.reasoning.is_empty() {
        message["reasoning_content"] = json!(out.reasoning);
    }
    if !out.tool_calls.is_empty() {
        if out.text.is_empty() {
            message["content"] = Value::Null;
        }
        message["tool_calls"] = out
            .tool_calls
            .iter()
            .map(|(id, name, arguments)| {
                json!({"id": id, "type": "function", "function": {"name": name, "arguments": arguments}})
            })
            .collect();
    }
    json!({
        "index": index,
        "message": message,
        "logprobs": if m.logprobs { chat_logprobs(&out.logprobs) } else { Value::Null },
        "finish_reason": finish_reason,
    })
}

pub(crate) fn chat_completion(m: &ResponseMeta, choices: Vec<Value>, usage: &Usage) -> Value {
    json!({
        "id": m.id,
        "object": "chat.completion",
        "created": m.created,
        "model": m.model,
        "choices": choices,
        "usage": usage_json(usage),
    })
}

/// The delta of one tool-call piece: the first carries id, type and name.
pub(crate) fn tool_call_delta(d: &ToolCallDelta) -> Value {
    let mut call = json!({"index": d.index, "function": {"arguments": d.arguments}});
    if !d.id.is_empty() {
        call["id"] = json!(d.id);
        call["type"] = json!("function");
    }
    if !d.name.is_empty() {
        call["function"]["name"] = json!(d.name);
    }
    json!({ "tool_calls": [call] })
}

/// A stream chunk; `logprobs` is the choice's (`null` unless asked for).
pub(crate) fn chat_chunk(
    m: &ResponseMeta,
    index: usize,
    delta: Value,
    finish_reason: Option<&str>,
    logprobs: Value,
) -> Value {
    json!({
        "id": m.id,
        "object": "chat.completion.chunk",
        "created": m.created,
        "model": m.model,
        "choices": [{ "index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason }],
    })
}

/// Choice `index` of a text completion.
pub(crate) fn completion_choice(
    m: &ResponseMeta,
    index: usize,
    out: &Collected,
    finish_reason: &str,
) -> Value {
    let mut offset = 0;
    let (text, logprobs) = match (&m.echo, m.logprobs) {
        (None, false) => (out.text.clone(), Value::Null),
        (None, true) => (
            out.text.clone(),
            completion_logprobs(&out.logprobs, &mut offset),
        ),
        (Some(e), false) => (format!("{}{}", e.text, out.text), Value::Null),
        (Some(e), true) => {
            let prompt = echo_logprobs(e, &out.prompt_logprobs, &mut offset);
            let rest = completion_logprobs(&out.logprobs, &mut offset);
            (
                format!("{}{}", e.text, out.text),
                join_logprobs(prompt, rest),
            )
        }
    };
    json!({ "index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason })
}

pub(crate) fn completion(m: &ResponseMeta, choices: Vec<Value>, usage: &Usage) -> Value {
    json!({
        "id": m.id,
        "object": "text_completion",
        "created": m.created,
        "model": m.model,
        "choices": choices,
        "usage": usage_json(usage),
    })
}

pub(crate) fn completion_chunk(
    m: &ResponseMeta,
    index: usize,
    text: &str,
    finish_reason: Option<&str>,
    logprobs: Value,
) -> Value {
    json!({
        "id": m.id,
        "object": "text_completion",
        "created": m.created,
        "model": m.model,
        "choices": [{ "index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason }],
    })
}

/// The final usage-only chunk of a stream (`stream_options.include_usage`).
pub(crate) fn usage_chunk(m: &ResponseMeta, object: &str, usage: &Usage) -> Value {
    json!({
        "id": m.id,
        "object": object,
        "created": m.created,
        "model": m.model,
        "choices": [],
        "usage": usage_json(usage),
    })
}
