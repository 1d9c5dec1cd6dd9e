//! Tests of the OpenAI bodies: the sampling fields' checks, the chat and completion requests'
//! forms, and the logprobs' shapes.

use serde::de::DeserializeOwned;

use super::encode::{chat_logprobs, completion_logprobs};
use super::request::DetokenizeRequest;
use super::*;
use crate::generate::TokenText;
use crate::generate::sampling::{MAX_CACHE_SALT_BYTES, MAX_STOP_BYTES};
use crate::json::parse;

fn err<T: DeserializeOwned + std::fmt::Debug>(body: &str) -> ApiError {
    parse::<T>(body.as_bytes()).unwrap_err()
}

fn params(body: &str) -> Result<GenParams, ApiError> {
    parse::<SamplingFields>(body.as_bytes())
        .unwrap()
        .to_params()
}

#[test]
fn malformed_json_is_a_400_with_the_parser_message() {
    let e = err::<ChatRequest>(r#"{"model": "m", "messages": [}"#);
    assert_eq!(e.status, 400);
    assert!(
        e.message.starts_with("could not parse the JSON body"),
        "{}",
        e.message
    );
    let e = err::<ChatRequest>(r#"{"model": "m", "messages": []} trailing"#);
    assert_eq!(e.status, 400);
}

#[test]
fn invalid_utf8_is_a_400_not_a_crash() {
    let e = parse::<ChatRequest>(b"{\"model\": \"m\xff\", \"messages\": []}").unwrap_err();
    assert_eq!(e.status, 400);
    assert!(e.message.contains("UTF-8"), "{}", e.message);
}

#[test]
fn missing_field_and_wrong_type_name_the_problem() {
    let e = err::<ChatRequest>(r#"{"model": "m"}"#);
    assert!(
        e.message.contains("missing field `messages`"),
        "{}",
        e.message
    );
    assert_eq!(e.param.as_deref(), Some("messages"));
    let e = err::<SamplingFields>(r#"{"temperature": "hot"}"#);
    assert_eq!(e.param.as_deref(), Some("temperature"));
    let e = err::<ChatRequest>(r#"{"model": "m", "messages": [{"role": 7, "content": "x"}]}"#);
    assert_eq!(e.param.as_deref(), Some("messages[0].role"));
}

#[test]
fn out_of_range_sampling_params_are_rejected_by_name() {
    let long_stop = format!(r#"{{"stop": ["{}"]}}"#, "x".repeat(MAX_STOP_BYTES + 1));
    let long_salt = format!(
        r#"{{"cache_salt": "{}"}}"#,
        "s".repeat(MAX_CACHE_SALT_BYTES + 1)
    );
    for (body, param) in [
        (r#"{"cache_salt": ""}"#, "cache_salt"),
        (long_salt.as_str(), "cache_salt"),
        (r#"{"max_tokens": 0}"#, "max_tokens"),
        (r#"{"max_tokens": -5}"#, "max_tokens"),
        (r#"{"max_completion_tokens": 0}"#, "max_completion_tokens"),
        (r#"{"temperature": -0.1}"#, "temperature"),
        (r#"{"top_p": 0}"#, "top_p"),
        (r#"{"top_p": 1.5}"#, "top_p"),
        (r#"{"min_p": 2}"#, "min_p"),
        (r#"{"frequency_penalty": 3}"#, "frequency_penalty"),
        (r#"{"top_k": -2}"#, "top_k"),
        (r#"{"stop": ["a","b","c","d","e"]}"#, "stop"),
        (r#"{"stop": ""}"#, "stop"),
        (long_stop.as_str(), "stop"),
        (r#"{"n": 0}"#, "n"),
        (r#"{"n": 17}"#, "n"),
    ] {
        let e = params(body).unwrap_err();
        assert_eq!(e.status, 400, "{body}");
        assert_eq!(e.param.as_deref(), Some(param), "{body}");
    }
}

/// Schemathesis sends `5.0` where the document says integer (JSON Schema's integer
/// admits it): such requests were refused as "expected i64".
#[test]
fn integers_written_as_whole_floats_are_integers() {
    let f: SamplingFields = parse(
        br#"{"max_tokens": 5.0, "max_completion_tokens": 6.0, "n": 2.0, "seed": -3.0,
                "top_k": 40.0, "min_tokens": 1.0, "stop_token_ids": [2.0, 3]}"#,
    )
    .unwrap();
    assert_eq!(
        (
            f.max_tokens,
            f.max_completion_tokens,
            f.n,
            f.seed,
            f.top_k,
            f.min_tokens
        ),
        (Some(5), Some(6), Some(2), Some(-3), Some(40), Some(1))
    );
    assert_eq!(f.stop_token_ids, Some(vec![2, 3]));
    let f: SamplingFields = parse(br#"{"max_tokens": null, "seed": 9007199254740992.0}"#).unwrap();
    assert_eq!((f.max_tokens, f.seed), (None, Some(1 << 53)));
    for (body, param) in [
        (r#"{"max_tokens": 5.5}"#, "max_tokens"),
        (r#"{"max_tokens": "5"}"#, "max_tokens"),
        (r#"{"seed": 1e300}"#, "seed"),
        (r#"{"seed": 9223372036854775808.0}"#, "seed"),
        (r#"{"stop_token_ids": [-1.0]}"#, "stop_token_ids[0]"),
        (r#"{"stop_token_ids": [4294967296.0]}"#, "stop_token_ids[0]"),
        (r#"{"n": 1e-9}"#, "n"),
    ] {
        let e = err::<SamplingFields>(body);
        assert_eq!(e.param.as_deref(), Some(param), "{body}: {}", e.message);
    }
    assert!(
        err::<SamplingFields>(r#"{"max_tokens": 5.5}"#)
            .message
            .contains("floating point `5.5`, expected i64")
    );
    let prompt = |body: &str| {
        parse::<CompletionRequest>(body.as_bytes())
            .unwrap()
            .prompt()
    };
    assert_eq!(
        prompt(r#"{"model":"m","prompt":[1.0,2]}"#).unwrap(),
        PromptInput::Ids(vec![1, 2])
    );
    assert_eq!(
        prompt(r#"{"model":"m","prompt":[[4.0]]}"#).unwrap(),
        PromptInput::Ids(vec![4])
    );
    assert_eq!(
        err::<CompletionRequest>(r#"{"model":"m","prompt":[1.5]}"#)
            .param
            .as_deref(),
        Some("prompt")
    );
    let c: CompletionRequest =
        parse(br#"{"model":"m","prompt":"x","logprobs":2.0,"best_of":1.0}"#).unwrap();
    assert_eq!((c.logprobs, c.best_of), (Some(2), Some(1)));
    let d: DetokenizeRequest = parse(br#"{"tokens":[1.0,2]}"#).unwrap();
    assert_eq!(d.tokens, [1, 2]);
    let r: ChatRequest = parse(br#"{"model":"m","messages":[],"top_logprobs":3.0}"#).unwrap();
    assert_eq!(r.top_logprobs, Some(3));
}

/// `top_p: 1e-50` passed the gateway's (0, 1] check, became 0 as an f32 and was
/// refused by the worker ("got 0", no `param`).
#[test]
fn open_ranges_stay_open_once_narrowed() {
    let p = params(r#"{"top_p": 1e-50, "repetition_penalty": 1e-300}"#).unwrap();
    assert!(p.top_p.unwrap() > 0.0);
    assert!(p.repetition_penalty.unwrap() > 0.0);
    assert_eq!(params(r#"{"top_p": 0.5}"#).unwrap().top_p, Some(0.5));
    assert_eq!(params(r#"{"temperature": 0}"#).unwrap().temperature, 0.0);
}

#[test]
fn defaults_and_mapping() {
    let p = params("{}").unwrap();
    assert_eq!(p.cache_salt, None);
    let salt = "s".repeat(MAX_CACHE_SALT_BYTES);
    let p = params(&format!(r#"{{"cache_salt": "{salt}"}}"#)).unwrap();
    assert_eq!(p.cache_salt, Some(salt));
    let p = params("{}").unwrap();
    assert_eq!(p.temperature, 1.0);
    assert_eq!(p.max_tokens, None);
    let p = params(r#"{"temperature": 0, "max_tokens": 7, "max_completion_tokens": 9, "stop": "\n", "seed": 3, "top_k": 40}"#)
            .unwrap();
    assert_eq!(p.temperature, 0.0);
    assert_eq!(
        p.max_tokens,
        Some(9),
        "max_completion_tokens wins over max_tokens"
    );
    assert_eq!(p.stop, ["\n"]);
    assert_eq!(p.seed, Some(3));
    assert_eq!(p.top_k, Some(40));
}

#[test]
fn completion_prompt_forms() {
    let prompt = |body: &str| {
        parse::<CompletionRequest>(body.as_bytes())
            .unwrap()
            .prompt()
    };
    assert_eq!(
        prompt(r#"{"model":"m","prompt":"hi"}"#).unwrap(),
        PromptInput::Text("hi".into())
    );
    assert_eq!(
        prompt(r#"{"model":"m","prompt":["hi"]}"#).unwrap(),
        PromptInput::Text("hi".into())
    );
    assert_eq!(
        prompt(r#"{"model":"m","prompt":[1,2,3]}"#).unwrap(),
        PromptInput::Ids(vec![1, 2, 3])
    );
    assert_eq!(
        prompt(r#"{"model":"m","prompt":[[4,5]]}"#).unwrap(),
        PromptInput::Ids(vec![4, 5])
    );
    assert_eq!(
        prompt(r#"{"model":"m","prompt":["a","b"]}"#)
            .unwrap_err()
            .status,
        400
    );
    assert_eq!(
        prompt(r#"{"model":"m","prompt":""}"#).unwrap_err().status,
        400
    );
    assert_eq!(
        prompt(r#"{"model":"m","prompt":[]}"#).unwrap_err().status,
        400
    );
    assert_eq!(
        err::<CompletionRequest>(r#"{"model":"m","prompt":[-1]}"#).status,
        400
    );
}

#[test]
fn chat_content_parts_are_joined_and_images_rejected() {
    let req: ChatRequest = parse(
            br#"{"model":"m","messages":[{"role":"user","content":[{"type":"text","text":"a"},{"type":"text","text":"b"}]}]}"#,
        )
        .unwrap();
    assert_eq!(req.messages().unwrap()[0].content, "ab");
    let req: ChatRequest =
            parse(br#"{"model":"m","messages":[{"role":"user","content":[{"type":"image_url","image_url":{}}]}]}"#).unwrap();
    assert_eq!(req.messages().unwrap_err().status, 400);
    let req: ChatRequest =
        parse(br#"{"model":"m","messages":[{"role":"wizard","content":"x"}]}"#).unwrap();
    assert_eq!(
        req.messages().unwrap_err().param.as_deref(),
        Some("messages[0].role")
    );
    let req: ChatRequest = parse(br#"{"model":"m","messages":[]}"#).unwrap();
    assert_eq!(req.messages().unwrap_err().status, 400);
}

/// An assistant's tool call the tokenizer cannot read was refused by the tokenizer,
/// with no `param` (and, through `/v1/responses`, naming a chat field).
#[test]
fn assistant_tool_calls_are_checked_by_name() {
    let bad = |calls: Value| {
        let body = json!({"model": "m", "messages": [
                {"role": "user", "content": "x"},
                {"role": "assistant", "content": "", "tool_calls": calls}]});
        parse::<ChatRequest>(body.to_string().as_bytes())
            .unwrap()
            .messages()
            .map(|_| ())
    };
    for (calls, param) in [
        (
            json!([{"function": {"name": "f", "arguments": "x"}}]),
            "messages[1].tool_calls[0].function.arguments",
        ),
        (
            json!([{"function": {"name": "", "arguments": "{}"}}]),
            "messages[1].tool_calls[0].function.name",
        ),
        (
            json!([{"id": "c", "function": {"name": "f", "arguments": "{}"}}, 7]),
            "messages[1].tool_calls[1]",
        ),
    ] {
        let e = bad(calls).unwrap_err();
        assert_eq!(e.param.as_deref(), Some(param));
        assert!(e.message.starts_with(param), "{}", e.message);
    }
    bad(json!([{"id": "c", "type": "function", "function": {"name": "f", "arguments": "{\"a\": 1}"}}]))
            .unwrap();
}

#[test]
fn logprobs_ranges_and_their_pairing() {
    let chat = |extra: &str| {
        parse::<ChatRequest>(format!(r#"{{"model":"m","messages":[]{extra}}}"#).as_bytes())
            .unwrap()
            .logprobs()
    };
    assert_eq!(chat("").unwrap(), None);
    assert_eq!(chat(r#","logprobs":false"#).unwrap(), None);
    assert_eq!(chat(r#","logprobs":true"#).unwrap(), Some(0));
    assert_eq!(
        chat(r#","logprobs":true,"top_logprobs":20"#).unwrap(),
        Some(20)
    );
    for bad in [
        r#","logprobs":true,"top_logprobs":21"#,
        r#","logprobs":true,"top_logprobs":-1"#,
        r#","top_logprobs":3"#,
    ] {
        assert_eq!(
            chat(bad).unwrap_err().param.as_deref(),
            Some("top_logprobs"),
            "{bad}"
        );
    }
    let completion = |lp: i64| {
        parse::<CompletionRequest>(
            format!(r#"{{"model":"m","prompt":"x","logprobs":{lp}}}"#).as_bytes(),
        )
        .unwrap()
        .logprobs()
    };
    assert_eq!(completion(0).unwrap(), Some(0));
    assert_eq!(completion(5).unwrap(), Some(5));
    assert_eq!(
        completion(6).unwrap_err().param.as_deref(),
        Some("logprobs")
    );
    assert_eq!(
        completion(-1).unwrap_err().param.as_deref(),
        Some("logprobs")
    );
}

#[test]
fn logit_bias_and_min_tokens_are_checked_and_passed_on() {
    let p = params(r#"{"logit_bias": {"28": 5, "13": -100}, "min_tokens": 3, "max_tokens": 8}"#)
        .unwrap();
    assert_eq!(
        (p.logit_bias, p.min_tokens),
        (vec![(13, -100.0), (28, 5.0)], 3)
    );
    for (body, param) in [
        (r#"{"logit_bias": {"the": 1}}"#, "logit_bias"),
        (r#"{"logit_bias": {"5": 100.5}}"#, "logit_bias"),
        (r#"{"min_tokens": -1}"#, "min_tokens"),
        (r#"{"min_tokens": 9, "max_tokens": 8}"#, "min_tokens"),
        (
            r#"{"min_tokens": 9, "max_completion_tokens": 8}"#,
            "min_tokens",
        ),
    ] {
        assert_eq!(
            params(body).unwrap_err().param.as_deref(),
            Some(param),
            "{body}"
        );
    }
    assert_eq!(
        err::<SamplingFields>(r#"{"logit_bias": [1]}"#)
            .param
            .as_deref(),
        Some("logit_bias")
    );
}

#[test]
fn logprobs_render_in_the_chat_and_the_legacy_shapes() {
    let t = |s: &str| TokenText {
        text: s.into(),
        bytes: s.as_bytes().to_vec(),
    };
    let entries = vec![
        LogprobEntry {
            token: t("Hé"),
            logprob: -0.25,
            top: vec![(t("Hé"), -0.25), (t("Ho"), -2.0)],
        },
        LogprobEntry {
            token: t("!"),
            logprob: -1.5,
            top: vec![(t("."), -0.5), (t("!"), -1.5)],
        },
    ];
    let c = chat_logprobs(&entries);
    assert_eq!(c["content"][0]["token"], "Hé");
    assert_eq!(c["content"][0]["bytes"], json!([72, 195, 169]));
    assert_eq!(
        c["content"][1]["top_logprobs"][0],
        json!({"token": ".", "logprob": -0.5, "bytes": [46]})
    );
    let mut offset = 10;
    let l = completion_logprobs(&entries, &mut offset);
    assert_eq!(l["tokens"], json!(["Hé", "!"]));
    assert_eq!(l["token_logprobs"], json!([-0.25, -1.5]));
    assert_eq!(l["top_logprobs"][1], json!({".": -0.5, "!": -1.5}));
    assert_eq!(
        l["text_offset"],
        json!([10, 12]),
        "offsets count characters"
    );
    assert_eq!(offset, 13);
}
