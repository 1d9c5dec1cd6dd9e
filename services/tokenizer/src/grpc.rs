//! gRPC ingress for `pdmesh.tokenizer.v1.Tokenizer`: the only module that touches prost
//! types. It validates every user-supplied field (UTF-8, token ids) before the tokenizer
//! sees it, so bad input is an INVALID_ARGUMENT naming the field, never a panic.

use std::sync::Arc;

use pdmesh_chat::{Delta, Format, OutputParser, ReasoningParser, ToolParser};
use pdmesh_proto::tokenizer::v1 as pb;
use pdmesh_text::{ChatFormat, ChatMessage, TextTokenizer, dsv32};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status, Streaming};

use crate::Error;

/// Responses buffered per Detokenize stream before the server waits for the client.
const DETOKENIZE_BUFFER: usize = 16;

/// The tonic service: a shared, immutable tokenizer.
pub(crate) struct TokenizerService {
    tok: Arc<TextTokenizer>,
}

/// The parser a stream asked for, if any; an unknown tool format is INVALID_ARGUMENT.
fn output_parser(p: &pb::OutputParsing) -> Result<Option<OutputParser>, Status> {
    let format = pb::ToolFormat::try_from(p.tool_format).map_err(|_| {
        Status::invalid_argument(format!(
            "parsing.tool_format: {} is not a known tool format",
            p.tool_format
        ))
    })?;
    let format = match format {
        pb::ToolFormat::None => None,
        pb::ToolFormat::Dsml => Some(Format::Dsml),
        pb::ToolFormat::DeepseekV3 => Some(Format::DeepSeekV3),
        pb::ToolFormat::DeepseekV31 => Some(Format::DeepSeekV31),
        pb::ToolFormat::Hermes => Some(Format::Hermes),
    };
    if format.is_none() && !p.reasoning {
        return Ok(None);
    }
    let allowed = (!p.tool_names.is_empty()).then(|| p.tool_names.clone());
    Ok(Some(OutputParser::new(
        p.reasoning.then(|| ReasoningParser::new(p.thinking)),
        format.map(|f| ToolParser::new(f, allowed, &p.call_id_prefix)),
    )))
}

fn plain(text: String) -> pb::DetokenizeResponse {
    pb::DetokenizeResponse {
        text,
        ..Default::default()
    }
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

impl TokenizerService {
    pub(crate) fn new(tok: TextTokenizer) -> Self {
        Self { tok: Arc::new(tok) }
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
            Ok(ChatMessage {
                role: utf8(&m.role, || format!("messages[{i}].role"))?.to_owned(),
                content: utf8(&m.content, || format!("messages[{i}].content"))?.to_owned(),
            })
        })
        .collect()
}

/// `tools_json` → `None` when empty, else the parsed JSON.
fn tools(tools_json: &[u8]) -> Result<Option<serde_json::Value>, Error> {
    if tools_json.is_empty() {
        return Ok(None);
    }
    let text = utf8(tools_json, || "tools_json".to_owned())?;
    serde_json::from_str(text)
        .map(Some)
        .map_err(Error::ToolsJson)
}

impl TokenizerService {
    fn tokenize_impl(&self, req: &pb::TokenizeRequest) -> Result<Vec<u32>, Error> {
        let text = utf8(&req.text, || "text".to_owned())?;
        self.tok
            .encode(text, req.add_special_tokens)
            .map_err(Error::Text)
    }

    fn chat_impl(&self, req: &pb::ChatTemplateRequest) -> Result<pb::ChatTemplateResponse, Error> {
        let messages = chat_messages(&req.messages)?;
        let tools = tools(&req.tools_json)?;
        let prompt = match self.tok.chat_format() {
            ChatFormat::Template(t) => t
                .render(&messages, tools.as_ref(), req.add_generation_prompt)
                .map_err(Error::Template)?,
            // Its prompt always ends where the assistant's turn begins.
            ChatFormat::DeepSeekV32 => {
                let msgs: Vec<dsv32::Message> = messages
                    .iter()
                    .map(|m| dsv32::Message::new(&m.role, &m.content))
                    .collect();
                let tools = match &tools {
                    None => Vec::new(),
                    Some(serde_json::Value::Array(a)) => a.clone(),
                    Some(other) => vec![other.clone()],
                };
                dsv32::encode(&msgs, &tools, req.thinking).map_err(Error::Template)?
            }
            ChatFormat::None => return Err(Error::NoChatTemplate),
        };
        // The rendered prompt already carries its special tokens.
        let ids = self.tok.encode(&prompt, false).map_err(Error::Text)?;
        Ok(pb::ChatTemplateResponse { prompt, ids })
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
            let vocab = tok.vocab_size();
            let mut detok = None;
            let mut parser: Option<OutputParser> = None;
            loop {
                let msg = match inbound.message().await {
                    Ok(Some(msg)) => msg,
                    Ok(None) => break,
                    Err(status) => {
                        tracing::debug!(%status, "detokenize stream ended by the client");
                        return;
                    }
                };
                if detok.is_none() {
                    match msg.parsing.as_ref().map(output_parser).transpose() {
                        Ok(p) => parser = p.flatten(),
                        Err(status) => {
                            let _ = tx.send(Err(status)).await;
                            return;
                        }
                    }
                }
                let d = detok.get_or_insert_with(|| tok.detokenizer(msg.skip_special_tokens));
                let answer = check_ids(&msg.ids, vocab, "ids")
                    .and_then(|()| d.push(&msg.ids).map_err(Error::Text))
                    .map(|text| match &mut parser {
                        None => plain(text),
                        Some(p) => response(p.push(text.as_bytes())),
                    })
                    .map_err(Status::from);
                let failed = answer.is_err();
                if tx.send(answer).await.is_err() || failed {
                    return;
                }
            }
            if let Some(mut d) = detok {
                let text = d.finish();
                let last = match &mut parser {
                    None => plain(text),
                    Some(p) => {
                        let mut deltas = p.push(text.as_bytes());
                        deltas.extend(p.finish());
                        response(deltas)
                    }
                };
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
        Ok(Response::new(pb::InfoResponse {
            vocab_size: u32::try_from(self.tok.vocab_size()).unwrap_or(u32::MAX),
            eos_token_ids: self.tok.eos_token_ids(),
            bos_token_id: self.tok.bos_token_id(),
            has_chat_template: !matches!(self.tok.chat_format(), ChatFormat::None),
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn invalid_utf8_names_the_message_field() {
        let msgs = vec![
            pb::ChatMessage {
                role: b"system".to_vec(),
                content: b"ok".to_vec(),
            },
            pb::ChatMessage {
                role: b"user".to_vec(),
                content: vec![b'h', 0xff],
            },
        ];
        let err = chat_messages(&msgs).unwrap_err();
        assert_eq!(err.to_string(), "messages[1].content is not valid UTF-8");
        assert_eq!(Status::from(err).code(), tonic::Code::InvalidArgument);
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
        assert!(tools(br#"[{"type":"function"}]"#).unwrap().is_some());
        let err = tools(b"[{").unwrap_err();
        assert_eq!(Status::from(err).code(), tonic::Code::InvalidArgument);
    }
}
