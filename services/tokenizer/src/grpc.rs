//! gRPC ingress for `pdmesh.tokenizer.v1.Tokenizer`: the only module that touches prost
//! types. It validates every user-supplied field (UTF-8, token ids) before the tokenizer
//! sees it, so bad input is an INVALID_ARGUMENT naming the field, never a panic.

use std::sync::Arc;

use pdmesh_chat::{
    ChatError, ChatFormat, ChatMessage, ChatTokenizer, Delta, OutputParser, TextStream, ToolCall,
    ToolFormat,
};
use pdmesh_proto::tokenizer::v1 as pb;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status, Streaming};

use crate::Error;

/// Responses buffered per Detokenize stream before the server waits for the client.
const DETOKENIZE_BUFFER: usize = 16;

/// The tonic service: a shared, immutable tokenizer.
pub(crate) struct TokenizerService {
    tok: Arc<ChatTokenizer>,
    /// The name the model is served under, for the errors that name it.
    model: String,
    /// [`pdmesh_tokenize::TextTokenizer::fingerprint`], computed once.
    fingerprint: String,
}

/// The parser a stream asked for, if any; an unknown tool format is INVALID_ARGUMENT.
fn output_parser(p: &pb::OutputParsing) -> Result<Option<OutputParser>, Status> {
    let unknown = || {
        Status::invalid_argument(format!(
            "parsing.tool_format: {} is not a known tool format",
            p.tool_format
        ))
    };
    let format = pb::ToolFormat::try_from(p.tool_format).map_err(|_| unknown())?;
    let format = match format.format_name() {
        None => None,
        Some(name) => Some(ToolFormat::from_name(&name).ok_or_else(unknown)?),
    };
    Ok(OutputParser::for_output(
        format,
        p.reasoning,
        p.thinking,
        &p.tool_names,
        &p.call_id_prefix,
    ))
}

/// Parsed deltas as one response (content and reasoning each concatenated, calls and
/// failures in order).
fn response(deltas: Vec<Delta>) -> pb::DetokenizeResponse {
    let mut r = pb::DetokenizeResponse::default();
    for d in deltas {
        match d {
            Delta::Content(t) => r.text.push_str(&t),
            Delta::Reasoning(t) => r.reasoning.push_str(&t),
            Delta::ToolCall {
                index,
                id,
                name,
                arguments,
            } => r.tool_calls.push(pb::ToolCallDelta {
                index: index as u32,
                id: id.unwrap_or_default(),
                name: name.unwrap_or_default(),
                arguments,
            }),
            Delta::Error(e) => {
                tracing::warn!(parser = e.parser, reason = e.reason, detail = %e.detail, "model output failed to parse");
                r.failures.push(pb::ParseFailure {
                    parser: e.parser.into(),
                    reason: e.reason.into(),
                    detail: e.detail,
                });
            }
        }
    }
    r
}

/// Who may call each RPC (over mutual TLS, by the roles in the caller's certificate): the
/// gateway renders, tokenizes and detokenizes; any member may ask Health and Info.
pub static POLICY: pdmesh_tls::Policy = {
    use pdmesh_tls::Roles;
    pdmesh_tls::Policy {
        service: "pdmesh.tokenizer.v1.Tokenizer",
        methods: &[
            ("Tokenize", Roles::GATEWAY),
            ("ApplyChatTemplate", Roles::GATEWAY),
            ("Detokenize", Roles::GATEWAY),
            ("Health", Roles::ANY),
            ("Info", Roles::ANY),
        ],
    }
};

impl TokenizerService {
    pub(crate) fn new(tok: ChatTokenizer, model: String) -> Self {
        Self {
            fingerprint: tok.tokenizer().fingerprint(),
            tok: Arc::new(tok),
            model,
        }
    }
}

/// `bytes` → `&str`, or an error naming `field`.
fn utf8(bytes: &[u8], field: impl FnOnce() -> String) -> Result<&str, Error> {
    std::str::from_utf8(bytes).map_err(|_| Error::InvalidUtf8 { field: field() })
}

/// Rejects the first id that is not in the vocabulary; `field` names the repeated field.
fn check_ids(ids: &[u32], vocab: usize, field: &str) -> Result<(), Error> {
    match ids.iter().enumerate().find(|&(_, &t)| t as usize >= vocab) {
        Some((i, &token)) => Err(Error::TokenOutOfRange {
            field: format!("{field}[{i}]"),
            token,
            vocab,
        }),
        None => Ok(()),
    }
}

/// Validates a chat request and converts it to domain types.
fn chat_messages(messages: &[pb::ChatMessage]) -> Result<Vec<ChatMessage>, Error> {
    messages
        .iter()
        .enumerate()
        .map(|(i, m)| {
            let role = utf8(&m.role, || format!("messages[{i}].role"))?;
            let tool_calls = tool_calls(&m.tool_calls_json, i)?;
            if !tool_calls.is_empty() && role != "assistant" {
                return Err(Error::InvalidField {
                    field: format!("messages[{i}].tool_calls_json"),
                    problem: format!("is only allowed on assistant messages, not on {role:?}"),
                });
            }
            let optional = |bytes: &[u8], name: &str| -> Result<Option<String>, Error> {
                let text = utf8(bytes, || format!("messages[{i}].{name}"))?;
                Ok((!text.is_empty()).then(|| text.to_owned()))
            };
            Ok(ChatMessage {
                role: role.to_owned(),
                content: utf8(&m.content, || format!("messages[{i}].content"))?.to_owned(),
                tool_calls,
                tool_call_id: optional(&m.tool_call_id, "tool_call_id")?,
                reasoning: optional(&m.reasoning, "reasoning")?,
            })
        })
        .collect()
}

/// `messages[i].tool_calls_json` → the calls (none when empty), or an error naming the
/// offending part (`messages[1].tool_calls[0].function.arguments is not a JSON object`).
fn tool_calls(json: &[u8], i: usize) -> Result<Vec<ToolCall>, Error> {
    if json.is_empty() {
        return Ok(Vec::new());
    }
    let field = || format!("messages[{i}].tool_calls_json");
    let text = utf8(json, field)?;
    let invalid = |problem: String| Error::InvalidField {
        field: field(),
        problem,
    };
    let value: serde_json::Value =
        serde_json::from_str(text).map_err(|e| invalid(format!("is not valid JSON: {e}")))?;
    let serde_json::Value::Array(calls) = value else {
        return Err(invalid("is not a JSON array".to_owned()));
    };
    calls
        .into_iter()
        .enumerate()
        .map(|(j, c)| {
            ToolCall::from_openai(c).map_err(|e| Error::InvalidField {
                field: match e.part {
                    "" => format!("messages[{i}].tool_calls[{j}]"),
                    part => format!("messages[{i}].tool_calls[{j}].{part}"),
                },
                problem: e.problem.to_owned(),
            })
        })
        .collect()
}

/// `tools_json` → `None` when empty, else the parsed JSON as a list of tool definitions
/// (a single definition not in an array is taken as a list of one).
fn tools(tools_json: &[u8]) -> Result<Option<serde_json::Value>, Error> {
    if tools_json.is_empty() {
        return Ok(None);
    }
    let text = utf8(tools_json, || "tools_json".to_owned())?;
    match serde_json::from_str(text).map_err(Error::ToolsJson)? {
        serde_json::Value::Null => Ok(None),
        a @ serde_json::Value::Array(_) => Ok(Some(a)),
        one => Ok(Some(serde_json::Value::Array(vec![one]))),
    }
}

/// The domain's tool-call markup as the proto names it (each format's proto value is
/// named after it: [`pb::ToolFormat::from_format_name`]).
fn tool_format(f: Option<ToolFormat>) -> pb::ToolFormat {
    f.and_then(|f| pb::ToolFormat::from_format_name(f.name()))
        .unwrap_or(pb::ToolFormat::None)
}

impl TokenizerService {
    fn tokenize_impl(&self, req: &pb::TokenizeRequest) -> Result<Vec<u32>, Error> {
        let text = utf8(&req.text, || "text".to_owned())?;
        self.tok
            .tokenizer()
            .encode(text, req.add_special_tokens)
            .map_err(Error::Text)
    }

    fn chat_impl(&self, req: &pb::ChatTemplateRequest) -> Result<pb::ChatTemplateResponse, Error> {
        let messages = chat_messages(&req.messages)?;
        let tools = tools(&req.tools_json)?;
        // Control tokens come only from the chat format's markup: text in the request
        // that spells one (`<|im_end|>`) is tokenized as text.
        let prompt = self
            .tok
            .chat_prompt(
                &messages,
                tools.as_ref(),
                req.add_generation_prompt,
                req.thinking,
            )
            .map_err(|e| match e {
                ChatError::NoChatFormat => Error::NoChatTemplate {
                    model: self.model.clone(),
                },
                e @ ChatError::Template(_) => Error::Template(e),
                ChatError::Tokenizer(e) => Error::Text(e),
            })?;
        Ok(pb::ChatTemplateResponse {
            prompt: prompt.text,
            ids: prompt.ids,
        })
    }
}

#[tonic::async_trait]
impl pb::tokenizer_server::Tokenizer for TokenizerService {
    #[tracing::instrument(skip_all, fields(bytes = request.get_ref().text.len()))]
    async fn tokenize(
        &self,
        request: Request<pb::TokenizeRequest>,
    ) -> Result<Response<pb::TokenizeResponse>, Status> {
        let ids = self.tokenize_impl(request.get_ref())?;
        Ok(Response::new(pb::TokenizeResponse { ids }))
    }

    #[tracing::instrument(skip_all, fields(messages = request.get_ref().messages.len()))]
    async fn apply_chat_template(
        &self,
        request: Request<pb::ChatTemplateRequest>,
    ) -> Result<Response<pb::ChatTemplateResponse>, Status> {
        Ok(Response::new(self.chat_impl(request.get_ref())?))
    }

    type DetokenizeStream = ReceiverStream<Result<pb::DetokenizeResponse, Status>>;

    /// One incremental detokenizer per stream; every request is answered with the text it
    /// completed (possibly empty), and the client's end of stream with the flushed rest.
    #[tracing::instrument(skip_all)]
    async fn detokenize(
        &self,
        request: Request<Streaming<pb::DetokenizeRequest>>,
    ) -> Result<Response<Self::DetokenizeStream>, Status> {
        let mut inbound = request.into_inner();
        let tok = Arc::clone(&self.tok);
        let (tx, rx) = mpsc::channel(DETOKENIZE_BUFFER);
        tokio::spawn(async move {
            let vocab = tok.tokenizer().vocab_size();
            let mut stream: Option<TextStream> = None;
            let mut truncated = false;
            loop {
                let msg = match inbound.message().await {
                    Ok(Some(msg)) => msg,
                    Ok(None) => break,
                    Err(status) => {
                        tracing::debug!(%status, "detokenize stream ended by the client");
                        return;
                    }
                };
                if stream.is_none() {
                    match msg.parsing.as_ref().map(output_parser).transpose() {
                        Ok(p) => {
                            stream = Some(TextStream::new(
                                tok.tokenizer(),
                                msg.skip_special_tokens,
                                p.flatten(),
                            ))
                        }
                        Err(status) => {
                            let _ = tx.send(Err(status)).await;
                            return;
                        }
                    }
                }
                truncated |= msg.truncated;
                let s = stream.as_mut().expect("created above");
                let answer = check_ids(&msg.ids, vocab, "ids")
                    .and_then(|()| s.push(&msg.ids).map_err(Error::Text))
                    .map(response)
                    .map_err(Status::from);
                let failed = answer.is_err();
                if tx.send(answer).await.is_err() || failed {
                    return;
                }
            }
            if let Some(s) = stream {
                // Cut off by the length limit, unfinished markup is not the model's error:
                // it is dropped, and the calls before it stand.
                let last = response(s.finish(truncated));
                if last != pb::DetokenizeResponse::default() {
                    let _ = tx.send(Ok(last)).await;
                }
            }
        });
        Ok(Response::new(ReceiverStream::new(rx)))
    }

    async fn health(
        &self,
        _request: Request<pb::HealthRequest>,
    ) -> Result<Response<pb::HealthResponse>, Status> {
        Ok(Response::new(pb::HealthResponse { ok: true }))
    }

    async fn info(
        &self,
        _request: Request<pb::InfoRequest>,
    ) -> Result<Response<pb::InfoResponse>, Status> {
        let format = self.tok.chat_format();
        Ok(Response::new(pb::InfoResponse {
            vocab_size: u32::try_from(self.tok.tokenizer().vocab_size()).unwrap_or(u32::MAX),
            eos_token_ids: self.tok.tokenizer().eos_token_ids(),
            bos_token_id: self.tok.tokenizer().bos_token_id(),
            has_chat_template: !matches!(format, ChatFormat::None),
            tool_format: tool_format(format.tool_format()).into(),
            reasoning: format.reasoning(),
            fingerprint: self.fingerprint.clone(),
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn invalid_utf8_names_the_message_field() {
        let msgs = vec![msg("system", b"ok"), msg("user", &[b'h', 0xff])];
        let err = chat_messages(&msgs).unwrap_err();
        assert_eq!(err.to_string(), "messages[1].content is not valid UTF-8");
        assert_eq!(Status::from(err).code(), tonic::Code::InvalidArgument);
    }

    fn msg(role: &str, content: &[u8]) -> pb::ChatMessage {
        pb::ChatMessage {
            role: role.as_bytes().to_vec(),
            content: content.to_vec(),
            ..Default::default()
        }
    }

    fn with_calls(role: &str, tool_calls_json: &[u8]) -> pb::ChatMessage {
        pb::ChatMessage {
            tool_calls_json: tool_calls_json.to_vec(),
            ..msg(role, b"")
        }
    }

    /// The INVALID_ARGUMENT message for a conversation of `m` after one user turn.
    fn rejection(m: pb::ChatMessage) -> String {
        let err = chat_messages(&[msg("user", b"hi"), m]).unwrap_err();
        let status = Status::from(err);
        assert_eq!(status.code(), tonic::Code::InvalidArgument, "{status:?}");
        status.message().to_owned()
    }

    #[test]
    fn tool_calls_tool_call_ids_and_reasoning_become_domain_types() {
        let calls = br#"[{"id": "call_0", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}},
                         {"function": {"name": "get_time", "arguments": {"tz": "UTC"}}}]"#;
        let msgs = [
            msg("user", b"Weather?"),
            pb::ChatMessage {
                reasoning: b"Look it up.".to_vec(),
                ..with_calls("assistant", calls)
            },
            pb::ChatMessage {
                tool_call_id: b"call_0".to_vec(),
                ..msg("tool", b"sunny")
            },
        ];
        let got = chat_messages(&msgs).unwrap();
        let args = |v: serde_json::Value| v.as_object().unwrap().clone();
        assert_eq!(
            got,
            [
                ChatMessage::new("user", "Weather?"),
                ChatMessage::new("assistant", "")
                    .with_tool_calls(vec![
                        ToolCall::new("get_weather", args(serde_json::json!({"city": "Paris"})))
                            .with_id("call_0"),
                        ToolCall::new("get_time", args(serde_json::json!({"tz": "UTC"}))),
                    ])
                    .with_reasoning("Look it up."),
                ChatMessage::new("tool", "sunny").with_tool_call_id("call_0"),
            ]
        );
    }

    #[test]
    fn malformed_tool_calls_are_invalid_argument_naming_the_part() {
        assert_eq!(
            rejection(with_calls("assistant", &[b'[', 0xff, b']'])),
            "messages[1].tool_calls_json is not valid UTF-8"
        );
        assert!(
            rejection(with_calls("assistant", b"[{"))
                .starts_with("messages[1].tool_calls_json is not valid JSON: ")
        );
        assert_eq!(
            rejection(with_calls("assistant", br#"{"function": {}}"#)),
            "messages[1].tool_calls_json is not a JSON array"
        );
        assert_eq!(
            rejection(with_calls("assistant", b"[1]")),
            "messages[1].tool_calls[0] is not a JSON object"
        );
        let ok = r#"{"function": {"name": "f", "arguments": "{}"}}"#;
        for (call, want) in [
            (
                r#"{"function": {"name": "", "arguments": "{}"}}"#,
                "messages[1].tool_calls[1].function.name is not a non-empty string",
            ),
            (
                r#"{"function": {"name": "f", "arguments": "[1, 2]"}}"#,
                "messages[1].tool_calls[1].function.arguments is not a JSON object",
            ),
            (
                r#"{"function": {"name": "f", "arguments": "{\"a\": "}}"#,
                "messages[1].tool_calls[1].function.arguments is not a JSON object",
            ),
            (
                r#"{"function": {"name": "f"}}"#,
                "messages[1].tool_calls[1].function.arguments is not a JSON object",
            ),
            (
                r#"{"id": 3, "function": {"name": "f", "arguments": {}}}"#,
                "messages[1].tool_calls[1].id is not a string",
            ),
        ] {
            let json = format!("[{ok}, {call}]");
            assert_eq!(rejection(with_calls("assistant", json.as_bytes())), want);
        }
        assert_eq!(
            rejection(with_calls("user", format!("[{ok}]").as_bytes())),
            "messages[1].tool_calls_json is only allowed on assistant messages, not on \"user\""
        );
        assert_eq!(
            rejection(pb::ChatMessage {
                tool_call_id: vec![0xc3],
                ..msg("tool", b"r")
            }),
            "messages[1].tool_call_id is not valid UTF-8"
        );
        assert_eq!(
            rejection(pb::ChatMessage {
                reasoning: vec![0xc3],
                ..msg("assistant", b"r")
            }),
            "messages[1].reasoning is not valid UTF-8"
        );
    }

    #[test]
    fn tool_formats_map_one_to_one() {
        assert_eq!(tool_format(None), pb::ToolFormat::None);
        assert_eq!(tool_format(Some(ToolFormat::Dsml)), pb::ToolFormat::Dsml);
        assert_eq!(
            tool_format(Some(ToolFormat::DeepSeekV3)),
            pb::ToolFormat::DeepseekV3
        );
        assert_eq!(
            tool_format(Some(ToolFormat::DeepSeekV31)),
            pb::ToolFormat::DeepseekV31
        );
        assert_eq!(
            tool_format(Some(ToolFormat::Hermes)),
            pb::ToolFormat::Hermes
        );
    }

    /// Every proto value but NONE names a format that parses, and each format has its
    /// own value: what the gateway asks for is what it gets.
    #[test]
    fn every_proto_tool_format_reads_back_as_its_format() {
        let parsing = |tool_format| pb::OutputParsing {
            tool_format,
            ..Default::default()
        };
        let mut named = Vec::new();
        for v in 0..16 {
            let Ok(wire) = pb::ToolFormat::try_from(v) else {
                assert!(output_parser(&parsing(v)).is_err(), "{v} is no format");
                continue;
            };
            let parser = output_parser(&parsing(v)).unwrap();
            assert_eq!(parser.is_some(), wire != pb::ToolFormat::None, "{wire:?}");
            if let Some(name) = wire.format_name() {
                let f = ToolFormat::from_name(&name).unwrap();
                assert_eq!(tool_format(Some(f)), wire);
                named.push(f);
            }
        }
        assert_eq!(named, ToolFormat::ALL);
    }

    #[test]
    fn out_of_vocab_id_names_its_index() {
        let err = check_ids(&[1, 2, 50_000], 49_152, "ids").unwrap_err();
        assert!(
            err.to_string().starts_with("ids[2]: token id 50000"),
            "{err}"
        );
        assert!(check_ids(&[0, 49_151], 49_152, "ids").is_ok());
    }

    #[test]
    fn tools_json_empty_is_none_and_garbage_is_invalid_argument() {
        assert!(tools(b"").unwrap().is_none());
        assert!(tools(b"null").unwrap().is_none());
        assert_eq!(
            tools(br#"[{"type":"function"}]"#).unwrap(),
            Some(serde_json::json!([{"type": "function"}]))
        );
        // A single definition is a list of one, for every chat format.
        assert_eq!(
            tools(br#"{"type":"function"}"#).unwrap(),
            Some(serde_json::json!([{"type": "function"}]))
        );
        let err = tools(b"[{").unwrap_err();
        assert_eq!(Status::from(err).code(), tonic::Code::InvalidArgument);
    }
}

#[cfg(test)]
#[test]
fn every_rpc_has_the_roles_that_may_call_it() {
    let proto = include_str!("../../../proto/pdmesh/tokenizer/v1/tokenizer.proto");
    assert_eq!(POLICY.unlisted(proto), Vec::<&str>::new());
}
