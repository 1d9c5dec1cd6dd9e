//! The Responses API's answer: the response object built from the generation's events, and
//! the stream events that build it.

use serde_json::{Map, Value, json};

use super::request::{Item, ResponsesRequest};
use crate::error::ApiError;
use crate::generate::{Done, GenEvent, Usage};
use crate::state::unix_now;

pub(super) fn new_id(prefix: &str) -> String {
    format!("{prefix}_{}", uuid::Uuid::new_v4().simple())
}

/// Responses' `usage`. Reasoning is not counted apart from the answer (the gateway sees
/// text, not which tokens made it), so `reasoning_tokens` is 0.
fn usage_json(u: &Usage) -> Value {
    json!({
        "input_tokens": u.prompt_tokens,
        "input_tokens_details": {"cached_tokens": u.cached_tokens, "cache_write_tokens": 0},
        "output_tokens": u.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": u.prompt_tokens + u.completion_tokens,
    })
}

/// What the response object repeats from its request.
pub(super) struct Echo {
    pub(super) id: String,
    pub(super) created_at: u64,
    pub(super) model: String,
    pub(super) fields: Map<String, Value>,
    pub(super) store: bool,
}

impl Echo {
    pub(super) fn new(req: &ResponsesRequest, id: String, model: String) -> Self {
        let text = match &req.text {
            None => json!({"format": {"type": "text"}, "verbosity": "medium"}),
            Some(t) => json!({
                "format": t.format.clone().unwrap_or_else(|| json!({"type": "text"})),
                "verbosity": t.verbosity.as_deref().unwrap_or("medium"),
            }),
        };
        let effort = req.reasoning.as_ref().and_then(|r| r.effort.clone());
        let fields = json!({
            "instructions": req.instructions,
            "tools": req.tools.clone().unwrap_or_default(),
            "tool_choice": req.tool_choice.clone().unwrap_or_else(|| json!("auto")),
            "parallel_tool_calls": req.parallel_tool_calls.unwrap_or(true),
            // The chat endpoint's defaults, which OpenAI's are too.
            "temperature": req.temperature.unwrap_or(1.0),
            "top_p": req.top_p.unwrap_or(1.0),
            "max_output_tokens": req.max_output_tokens,
            "previous_response_id": req.previous_response_id,
            "metadata": req.metadata.clone().unwrap_or_default(),
            "store": req.store.unwrap_or(true),
            "text": text,
            "reasoning": {"effort": effort, "summary": null},
            "truncation": "disabled",
            "user": req.user,
        });
        Self {
            id,
            created_at: unix_now(),
            model,
            fields: fields.as_object().cloned().unwrap_or_default(),
            store: req.store.unwrap_or(true),
        }
    }

    /// The response object in `status`; `done` gives the usage and whether length cut it.
    pub(super) fn object(
        &self,
        status: &str,
        output: &[Value],
        done: Option<&Done>,
        error: Option<&ApiError>,
    ) -> Value {
        let mut o = json!({
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "error": error.map(|e| json!({"code": "server_error", "message": e.message})),
            "incomplete_details": (status == "incomplete").then(|| json!({"reason": "max_output_tokens"})),
            "model": self.model,
            "output": output,
            "usage": done.map(|d| usage_json(&d.usage)),
        });
        if done.is_some() {
            o["completed_at"] = json!(unix_now());
        }
        if let Value::Object(m) = &mut o {
            m.extend(self.fields.clone());
        }
        o
    }
}

/// One SSE event of a response stream: its `type` and its body.
pub(super) type StreamEvent = (&'static str, Value);

#[derive(Clone, Copy, Debug, PartialEq)]
pub(super) enum Kind {
    Reasoning,
    Message,
    /// A tool call, by its index in the generation.
    Call(u32),
}

/// The output item being written.
struct Open {
    kind: Kind,
    id: String,
    index: usize,
    /// The reasoning, the message's text or the call's arguments so far.
    text: String,
    call_id: String,
    name: String,
}

impl Open {
    fn item(&self, status: &str) -> Value {
        match self.kind {
            Kind::Reasoning => json!({
                "type": "reasoning", "id": self.id, "summary": [], "status": status,
                "content": [{"type": "reasoning_text", "text": self.text}],
            }),
            Kind::Message => json!({
                "type": "message", "id": self.id, "role": "assistant", "status": status,
                "content": [self.part()],
            }),
            Kind::Call(_) => json!({
                "type": "function_call", "id": self.id, "call_id": self.call_id, "name": self.name,
                "arguments": self.text, "status": status,
            }),
        }
    }

    fn part(&self) -> Value {
        match self.kind {
            Kind::Reasoning => json!({"type": "reasoning_text", "text": self.text}),
            _ => {
                json!({"type": "output_text", "text": self.text, "annotations": [], "logprobs": []})
            }
        }
    }
}

/// The output items as they form from the generation's events. The same builder makes the
/// streamed events and the final object, so a stream ends in exactly the response a plain
/// request gets (items in the order the model wrote them).
#[derive(Default)]
pub(super) struct Builder {
    pub(super) items: Vec<Value>,
    /// The output as conversation items, for the store.
    pub(super) history: Vec<Item>,
    open: Option<Open>,
    pub(super) seq: u64,
}

impl Builder {
    pub(super) fn event(&mut self, kind: &'static str, mut body: Value) -> StreamEvent {
        body["type"] = json!(kind);
        body["sequence_number"] = json!(self.seq);
        self.seq += 1;
        (kind, body)
    }

    /// The events one generation event makes (none for logprobs, not asked for).
    pub(super) fn push(&mut self, ev: GenEvent) -> Vec<StreamEvent> {
        let (kind, delta, call) = match ev {
            GenEvent::Text(t) => (Kind::Message, t, None),
            GenEvent::Reasoning(t) => (Kind::Reasoning, t, None),
            GenEvent::ToolCall(d) => (Kind::Call(d.index), d.arguments, Some((d.id, d.name))),
            GenEvent::Logprob(_) | GenEvent::Prompt(_) | GenEvent::Done(_) => return Vec::new(),
        };
        let mut out = Vec::new();
        if self.open.as_ref().is_none_or(|o| o.kind != kind) {
            out.extend(self.close("completed"));
            let (call_id, name) = call.clone().unwrap_or_default();
            let prefix = match kind {
                Kind::Reasoning => "rs",
                Kind::Message => "msg",
                Kind::Call(_) => "fc",
            };
            let open = Open {
                kind,
                id: new_id(prefix),
                index: self.items.len(),
                text: String::new(),
                call_id,
                name,
            };
            let (mut item, part) = (open.item("in_progress"), open.part());
            let (id, index) = (open.id.clone(), open.index);
            self.open = Some(open);
            let has_parts = item.get("content").is_some();
            if has_parts {
                // The content arrives as a part, announced after its item.
                item["content"] = json!([]);
            }
            out.push(self.event(
                "response.output_item.added",
                json!({"output_index": index, "item": item}),
            ));
            if has_parts {
                out.push(self.event(
                    "response.content_part.added",
                    json!({"item_id": id, "output_index": index, "content_index": 0, "part": part}),
                ));
            }
        }
        let Some(open) = self.open.as_mut() else {
            return out;
        };
        if let Some((call_id, name)) = call {
            // A later piece of the same call may repeat what the first gave.
            if !call_id.is_empty() {
                open.call_id = call_id;
            }
            if !name.is_empty() {
                open.name = name;
            }
        }
        if delta.is_empty() {
            return out;
        }
        open.text.push_str(&delta);
        let (id, index) = (open.id.clone(), open.index);
        let ev = match kind {
            Kind::Message => self.event(
                "response.output_text.delta",
                json!({"item_id": id, "output_index": index, "content_index": 0, "delta": delta, "logprobs": []}),
            ),
            Kind::Reasoning => self.event(
                "response.reasoning_text.delta",
                json!({"item_id": id, "output_index": index, "content_index": 0, "delta": delta}),
            ),
            Kind::Call(_) => self.event(
                "response.function_call_arguments.delta",
                json!({"item_id": id, "output_index": index, "delta": delta}),
            ),
        };
        out.push(ev);
        out
    }

    /// Ends the open item (`incomplete` when the generation was cut by length, except a
    /// call: one is only sent whole, and a call cut short is dropped).
    pub(super) fn close(&mut self, status: &str) -> Vec<StreamEvent> {
        let Some(open) = self.open.take() else {
            return Vec::new();
        };
        let status = if matches!(open.kind, Kind::Call(_)) {
            "completed"
        } else {
            status
        };
        let (id, index, item) = (open.id.clone(), open.index, open.item(status));
        let mut out = Vec::new();
        let at = json!({"item_id": id, "output_index": index, "content_index": 0});
        let with = |mut v: Value, extra: Value| {
            if let (Value::Object(a), Value::Object(b)) = (&mut v, extra) {
                a.extend(b);
            }
            v
        };
        match open.kind {
            Kind::Message => {
                out.push(self.event(
                    "response.output_text.done",
                    with(at.clone(), json!({"text": open.text, "logprobs": []})),
                ));
                out.push(self.event(
                    "response.content_part.done",
                    with(at, json!({"part": open.part()})),
                ));
                self.history.push(Item::Message {
                    role: "assistant".into(),
                    text: open.text.clone(),
                });
            }
            Kind::Reasoning => {
                out.push(self.event(
                    "response.reasoning_text.done",
                    with(at.clone(), json!({"text": open.text})),
                ));
                out.push(self.event(
                    "response.content_part.done",
                    with(at, json!({"part": open.part()})),
                ));
                self.history.push(Item::Reasoning(open.text.clone()));
            }
            Kind::Call(_) => {
                out.push(self.event(
                    "response.function_call_arguments.done",
                    json!({"item_id": id, "output_index": index, "arguments": open.text}),
                ));
                self.history.push(Item::Call {
                    call_id: open.call_id.clone(),
                    name: open.name.clone(),
                    arguments: open.text.clone(),
                });
            }
        }
        out.push(self.event(
            "response.output_item.done",
            json!({"output_index": index, "item": item}),
        ));
        self.items.push(item);
        out
    }

    /// Closes the output for the generation's end; the response's status.
    pub(super) fn finish(&mut self, done: &Done) -> (&'static str, Vec<StreamEvent>) {
        let status = if done.finish_reason == "length" {
            "incomplete"
        } else {
            "completed"
        };
        (status, self.close(status))
    }
}
