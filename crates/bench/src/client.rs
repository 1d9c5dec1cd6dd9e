//! A streaming OpenAI chat client that times what it receives: the first token, the gaps
//! between chunks, the whole answer. Works against any server speaking the chat
//! completions API with Server-Sent Events.

use std::time::{Duration, Instant};

use futures::StreamExt;
use serde_json::{Value, json};

use crate::summary::Record;

/// Why a plain (not streamed) request to the endpoint failed; the message names the
/// method and URL.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// The request could not be sent, or its answer not read.
    #[error("{method} {url}: {source}")]
    Http {
        method: &'static str,
        url: String,
        #[source]
        source: reqwest::Error,
    },
    /// `/models` answered without any model.
    #[error("GET {url} answered {status} with no model")]
    NoModel {
        url: String,
        status: reqwest::StatusCode,
    },
    /// The endpoint answered with an error status (and this body).
    #[error("{method} {url} answered {status}: {body}")]
    Status {
        method: &'static str,
        url: String,
        status: reqwest::StatusCode,
        body: String,
    },
    /// The answer was not JSON.
    #[error("{method} {url}: {source}: {body}")]
    Json {
        method: &'static str,
        url: String,
        #[source]
        source: serde_json::Error,
        body: String,
    },
}

/// Why a streamed request got no whole answer, as a short class. Its text is what
/// [`Record::error`] holds and reports count by: an HTTP status ("429"), an error the
/// server reported mid-stream ("in_stream:overloaded"), "timeout", "connect", "send",
/// "stream" (the stream broke off), or "finished" (a client meant to leave got the whole
/// answer first).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum RequestError {
    #[error("connect")]
    Connect,
    #[error("send")]
    Send,
    /// The endpoint answered with this HTTP status before any stream.
    #[error("{0}")]
    Status(u16),
    #[error("stream")]
    Stream,
    /// The class (the OpenAI error's `code`, else its `type`) of an error the server
    /// reported inside a stream it had begun.
    #[error("in_stream:{0}")]
    InStream(String),
    #[error("timeout")]
    Timeout,
    #[error("finished")]
    Finished,
}

impl RequestError {
    fn sending(e: &reqwest::Error) -> Self {
        if e.is_connect() {
            Self::Connect
        } else {
            Self::Send
        }
    }
}

/// A tool call as the answer carried it.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ToolCall {
    pub name: String,
    /// The arguments' JSON text, as streamed.
    pub arguments: String,
}

/// What came back for one request (for differential comparison and the next turn).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Answer {
    pub content: String,
    pub tool_calls: Vec<ToolCall>,
    pub finish_reason: Option<String>,
    pub completion_tokens: u32,
}

/// An OpenAI-compatible endpoint: `base` ends in `/v1`.
#[derive(Clone, Debug)]
pub struct Client {
    http: reqwest::Client,
    base: String,
    api_key: Option<String>,
    timeout: Duration,
}

impl Client {
    pub fn new(base: &str, api_key: Option<String>, timeout: Duration) -> Self {
        let http = reqwest::Client::builder()
            .connect_timeout(Duration::from_secs(10))
            // Many requests in flight to one host: keep their connections.
            .pool_max_idle_per_host(1024)
            .build()
            .expect("a client without TLS builds");
        Self {
            http,
            base: base.trim_end_matches('/').to_owned(),
            api_key,
            timeout,
        }
    }

    fn post(&self, path: &str) -> reqwest::RequestBuilder {
        let req = self.http.post(format!("{}{path}", self.base));
        match &self.api_key {
            Some(k) => req.bearer_auth(k),
            None => req,
        }
    }

    /// The first model `/models` lists.
    pub async fn first_model(&self) -> Result<String, ClientError> {
        let url = format!("{}/models", self.base);
        let http = |source| ClientError::Http {
            method: "GET",
            url: url.clone(),
            source,
        };
        let mut req = self.http.get(&url);
        if let Some(k) = &self.api_key {
            req = req.bearer_auth(k);
        }
        let resp = req
            .timeout(Duration::from_secs(30))
            .send()
            .await
            .map_err(http)?;
        let status = resp.status();
        let body: Value = resp.json().await.map_err(http)?;
        body["data"][0]["id"]
            .as_str()
            .map(str::to_owned)
            .ok_or_else(|| ClientError::NoModel {
                url: url.clone(),
                status,
            })
    }

    /// One `/completions` request, not streamed: the answer's JSON, or why there is none
    /// (the status and the error body).
    pub async fn complete(&self, body: &Value) -> Result<Value, ClientError> {
        let url = format!("{}/completions", self.base);
        let http = |source| ClientError::Http {
            method: "POST",
            url: url.clone(),
            source,
        };
        let resp = self
            .post("/completions")
            .json(body)
            .timeout(self.timeout)
            .send()
            .await
            .map_err(http)?;
        let status = resp.status();
        let text = resp.text().await.map_err(http)?;
        if !status.is_success() {
            return Err(ClientError::Status {
                method: "POST",
                url,
                status,
                body: text,
            });
        }
        serde_json::from_str(&text).map_err(|source| ClientError::Json {
            method: "POST",
            url,
            source,
            body: text,
        })
    }

    /// Streams one chat completion (`body` without `stream`), timing it from now.
    pub async fn chat(&self, body: Value, t0_run: Instant) -> (Record, Answer) {
        let (rec, ans, _) = self.chat_checked(body, t0_run).await;
        (rec, ans)
    }

    /// [`Client::chat`], and why the answer is not whole when it is not (the error whose
    /// class the record holds as text).
    pub(crate) async fn chat_checked(
        &self,
        mut body: Value,
        t0_run: Instant,
    ) -> (Record, Answer, Result<(), RequestError>) {
        body["stream"] = json!(true);
        body["stream_options"] = json!({ "include_usage": true });
        let start = Instant::now();
        let mut rec = Record {
            start_s: start.duration_since(t0_run).as_secs_f64(),
            ..Record::default()
        };
        let mut ans = Answer::default();
        let out = tokio::time::timeout(self.timeout, self.stream(body, start, &mut rec, &mut ans))
            .await
            .unwrap_or(Err(RequestError::Timeout));
        rec.error = out.as_ref().err().map(ToString::to_string);
        rec.e2e_s = start.elapsed().as_secs_f64();
        if rec.completion_tokens == 0 {
            rec.completion_tokens = ans.completion_tokens;
        }
        (rec, ans, out)
    }

    async fn stream(
        &self,
        body: Value,
        start: Instant,
        rec: &mut Record,
        ans: &mut Answer,
    ) -> Result<(), RequestError> {
        let send = || self.post("/chat/completions").json(&body).send();
        let resp = match send().await {
            // A kept-alive connection the server closed just as it was reused (servers
            // cap requests per connection): the request never got an answer, so it is
            // sent once more, on a fresh connection.
            Err(e) if !e.is_connect() && !e.is_timeout() => send().await,
            r => r,
        }
        .map_err(|e| RequestError::sending(&e))?;
        if !resp.status().is_success() {
            return Err(RequestError::Status(resp.status().as_u16()));
        }
        let mut events = SseLines::default();
        let mut bytes = resp.bytes_stream();
        let mut last: Option<Instant> = None;
        let mut done = false;
        while let Some(chunk) = bytes.next().await {
            let chunk = chunk.map_err(|_| RequestError::Stream)?;
            for data in events.push(&chunk) {
                if data == "[DONE]" {
                    done = true;
                    continue;
                }
                let v: Value = serde_json::from_str(&data).map_err(|_| RequestError::Stream)?;
                if let Some(e) = v.get("error") {
                    return Err(in_stream_error(e));
                }
                if let Some(u) = v.get("usage").filter(|u| !u.is_null()) {
                    let n = |k: &str| u[k].as_u64().unwrap_or(0) as u32;
                    rec.prompt_tokens = n("prompt_tokens");
                    rec.completion_tokens = n("completion_tokens");
                    rec.cached_tokens = u["prompt_tokens_details"]["cached_tokens"]
                        .as_u64()
                        .unwrap_or(0) as u32;
                }
                let Some(choice) = v["choices"].get(0) else {
                    continue;
                };
                let delta = &choice["delta"];
                let mut produced = false;
                for key in ["content", "reasoning_content"] {
                    if let Some(t) = delta[key].as_str().filter(|t| !t.is_empty()) {
                        if key == "content" {
                            ans.content.push_str(t);
                        }
                        produced = true;
                    }
                }
                if let Some(calls) = delta["tool_calls"].as_array() {
                    for c in calls {
                        let i = c["index"].as_u64().unwrap_or(0) as usize;
                        if ans.tool_calls.len() <= i {
                            ans.tool_calls.resize(i + 1, ToolCall::default());
                        }
                        let call = &mut ans.tool_calls[i];
                        if let Some(n) = c["function"]["name"].as_str() {
                            call.name.push_str(n);
                        }
                        if let Some(a) = c["function"]["arguments"].as_str() {
                            call.arguments.push_str(a);
                        }
                        produced = true;
                    }
                }
                if let Some(f) = choice["finish_reason"].as_str() {
                    ans.finish_reason = Some(f.to_owned());
                }
                if produced {
                    let now = Instant::now();
                    match last {
                        None => rec.ttft_s = Some(now.duration_since(start).as_secs_f64()),
                        Some(t) => rec.itl_s.push(now.duration_since(t).as_secs_f64()),
                    }
                    last = Some(now);
                    ans.completion_tokens += 1;
                }
            }
        }
        if !done && ans.finish_reason.is_none() {
            return Err(RequestError::Stream);
        }
        Ok(())
    }
}

/// The class of an error the server reported inside a stream it had begun (after the
/// 200): `in_stream:` and the OpenAI error's `code`, else its `type` (the statuses the
/// server would have answered with before the stream began: `overloaded` is a 429,
/// `service_unavailable` a 503).
fn in_stream_error(e: &Value) -> RequestError {
    let class = e["code"]
        .as_str()
        .or_else(|| e["type"].as_str())
        .unwrap_or("unknown");
    RequestError::InStream(class.to_owned())
}

impl Client {
    /// Streams one chat completion (`body` without `stream`) and goes away after `events`
    /// SSE chunks (0: as soon as the response headers arrive), as a client that closes
    /// its connection mid-answer. Returns the chunks seen; if the request ended first, the
    /// error class as [`Client::chat`] names it, or `finished` for a whole answer.
    pub async fn chat_and_leave(
        &self,
        mut body: Value,
        events: usize,
    ) -> Result<usize, RequestError> {
        body["stream"] = json!(true);
        let go = async {
            let resp = self
                .post("/chat/completions")
                .json(&body)
                .send()
                .await
                .map_err(|e| RequestError::sending(&e))?;
            if !resp.status().is_success() {
                return Err(RequestError::Status(resp.status().as_u16()));
            }
            let mut seen = 0;
            let mut sse = SseLines::default();
            let mut bytes = resp.bytes_stream();
            while seen < events {
                let Some(chunk) = bytes.next().await else {
                    return Err(RequestError::Stream);
                };
                let chunk = chunk.map_err(|_| RequestError::Stream)?;
                for data in sse.push(&chunk) {
                    if data == "[DONE]" {
                        return Err(RequestError::Finished);
                    }
                    let v: Value = serde_json::from_str(&data).map_err(|_| RequestError::Stream)?;
                    if let Some(e) = v.get("error") {
                        return Err(in_stream_error(e));
                    }
                    seen += 1;
                }
            }
            // Dropping the unfinished body closes the connection.
            Ok(seen)
        };
        tokio::time::timeout(self.timeout, go)
            .await
            .unwrap_or(Err(RequestError::Timeout))
    }
}

/// Splits a Server-Sent Events byte stream into its `data:` payloads, whatever the chunk
/// boundaries.
#[derive(Default)]
pub(crate) struct SseLines {
    buf: Vec<u8>,
    data: String,
}

impl SseLines {
    pub(crate) fn push(&mut self, bytes: &[u8]) -> Vec<String> {
        self.buf.extend_from_slice(bytes);
        let mut out = Vec::new();
        while let Some(nl) = self.buf.iter().position(|&b| b == b'\n') {
            let line: Vec<u8> = self.buf.drain(..=nl).collect();
            let line = String::from_utf8_lossy(&line);
            let line = line.trim_end_matches(['\n', '\r']);
            if line.is_empty() {
                // An event ends at a blank line.
                if !self.data.is_empty() {
                    out.push(std::mem::take(&mut self.data));
                }
            } else if let Some(d) = line.strip_prefix("data:") {
                if !self.data.is_empty() {
                    self.data.push('\n');
                }
                self.data.push_str(d.strip_prefix(' ').unwrap_or(d));
            }
            // Comments (":"), "event:", "id:" and "retry:" lines carry nothing we use.
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_error_inside_a_stream_is_classed_by_its_code() {
        let e = |v: Value| in_stream_error(&v).to_string();
        assert_eq!(
            e(json!({"type": "rate_limit_error", "code": "overloaded"})),
            "in_stream:overloaded"
        );
        assert_eq!(
            e(json!({"type": "server_error", "code": null})),
            "in_stream:server_error"
        );
        assert_eq!(e(json!({})), "in_stream:unknown");
    }

    #[test]
    fn sse_payloads_survive_any_split_and_skip_comments() {
        let stream = b": keep-alive\n\ndata: {\"a\":1}\n\ndata: [DONE]\r\n\r\n";
        for cut in 0..stream.len() {
            let mut s = SseLines::default();
            let mut got = s.push(&stream[..cut]);
            got.extend(s.push(&stream[cut..]));
            assert_eq!(got, ["{\"a\":1}", "[DONE]"], "split at {cut}");
        }
        let mut s = SseLines::default();
        assert_eq!(s.push(b"data: a\ndata: b\n\n"), ["a\nb"]);
    }
}
