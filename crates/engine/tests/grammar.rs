//! Constrained decoding on the real model: a grammar forces SmolLM2-135M to answer with a
//! well-formed tool call, and a constrained request's tokens do not depend on what else
//! runs in its batch.

mod common;

use common::*;
use pdmesh_engine::{FinishReason, GenRequest, SamplingParams, StepEvent};
use pdmesh_tokenize::TextTokenizer;

/// What the gateway sends for `tool_choice: "required"` with one get_weather tool, in the
/// model's own (Hermes) call format.
const TOOL_GRAMMAR: &str = r#"start: "<tool_call>\n" %json{"type":"object","properties":{"name":{"const":"get_weather"},"arguments":{"type":"object","properties":{"location":{"type":"string"}},"required":["location"],"additionalProperties":false}},"required":["name","arguments"],"additionalProperties":false,"x-guidance":{"whitespace_flexible":false}} "\n</tool_call>""#;

fn tokenizer() -> TextTokenizer {
    TextTokenizer::from_path(pdmesh_gguf::models::require_default_model())
        .expect("the default model's tokenizer")
}

fn weather_prompt(tok: &TextTokenizer) -> Vec<u32> {
    let prompt = "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n\
                  <|im_start|>user\nWhat's the weather in Paris?<|im_end|>\n<|im_start|>assistant\n";
    tok.encode(prompt, false).unwrap()
}

fn constrained(id: &str, prompt: Vec<u32>, seed: Option<u64>) -> GenRequest {
    GenRequest {
        id: id.into(),
        prompt,
        params: SamplingParams {
            temperature: if seed.is_some() { 0.7 } else { 0.0 },
            seed,
            max_tokens: Some(60),
            grammar: Some(compiled(TOOL_GRAMMAR)),
            ..SamplingParams::default()
        },
    }
}

#[test]
fn the_grammar_forces_a_valid_tool_call_from_a_small_model() {
    let tok = tokenizer();
    let mut e = engine(|_| {});
    let prompt = weather_prompt(&tok);
    // Unconstrained, the model answers in prose.
    let free = run_all(&mut e, vec![greedy("free", &prompt, 20)]);
    let free_text = tok.decode(&free["free"].tokens, true).unwrap();
    assert!(!free_text.starts_with("<tool_call>"), "{free_text:?}");

    for (id, seed) in [("greedy", None), ("seeded", Some(7))] {
        let out = run_all(&mut e, vec![constrained(id, prompt.clone(), seed)]);
        let o = &out[id];
        let text = tok.decode(&o.tokens, true).unwrap();
        let body = text
            .strip_prefix("<tool_call>\n")
            .and_then(|r| r.strip_suffix("\n</tool_call>"))
            .unwrap_or_else(|| panic!("{id}: not one tool call: {text:?}"));
        let call: serde_json::Value = serde_json::from_str(body).unwrap();
        assert_eq!(call["name"], "get_weather", "{id}: {text}");
        assert!(call["arguments"]["location"].is_string(), "{id}: {text}");
        match &o.finished {
            Some(StepEvent::Finished { reason, .. }) => {
                assert_eq!(
                    *reason,
                    FinishReason::Stop,
                    "{id}: the grammar ends the output"
                )
            }
            other => panic!("{id}: {other:?}"),
        }
    }
    assert_eq!(available(&e), e.pool().total_pages(), "no page leaked");
}

#[test]
fn constrained_tokens_are_the_same_alone_and_in_a_batch() {
    let tok = tokenizer();
    let prompt = weather_prompt(&tok);
    let mut e = engine(|c| c.prefix_cache = false);
    let alone = run_all(&mut e, vec![constrained("c", prompt.clone(), Some(3))]);
    let mut batch = vec![constrained("c", prompt.clone(), Some(3))];
    for (i, p) in fixture_prompts().into_iter().take(4).enumerate() {
        batch.push(greedy(&format!("other{i}"), &p, 12));
    }
    batch.push(constrained("c2", prompt, None));
    let together = run_all(&mut e, batch);
    assert_eq!(alone["c"].tokens, together["c"].tokens);
    assert_eq!(alone["c"].finished, together["c"].finished);
}

#[test]
fn a_grammar_that_does_not_compile_is_the_callers_error_before_any_submit() {
    let e = engine(|_| {});
    let err = e
        .grammar_compiler()
        .compile("start: %json{ not json")
        .unwrap_err();
    assert!(
        matches!(
            err,
            pdmesh_engine::EngineError::InvalidParam {
                field: "grammar",
                ..
            }
        ),
        "{err}"
    );
    assert!(!e.has_work());
}
