//! pdmesh-tokenize against the real default model and llama.cpp's own answers
//! (tests/fixtures/*.json, made by scripts/reference/gen_reference.py): same token ids,
//! lossless decoding and clean streaming text.

use std::sync::OnceLock;

use pdmesh_testkit::reference::{
    Reference, assert_no_failures, default_model, model_fixture, reference,
};
use pdmesh_tokenize::{TextTokenizer, TokenizerError};
use serde::Deserialize;

fn tok() -> &'static TextTokenizer {
    static TOK: OnceLock<TextTokenizer> = OnceLock::new();
    TOK.get_or_init(|| default_model(TextTokenizer::from_path))
}

/// `tokenizer_ids.json`: llama.cpp's ids for strings that test the tokenizer.
#[derive(Deserialize)]
struct TokenizerFixture {
    cases: Vec<Case>,
}

#[derive(Deserialize)]
struct Case {
    name: String,
    text: String,
    ids: Vec<u32>,
}

fn tokenizer_cases() -> Vec<Case> {
    let f: TokenizerFixture = model_fixture("tokenizer_ids.json");
    assert!(
        f.cases.len() >= 24,
        "only {} fixture strings",
        f.cases.len()
    );
    f.cases
}

/// Everything the tokenizer must do for one string whose llama.cpp ids are `want`.
/// Returns a description of each way it failed.
fn check(tok: &TextTokenizer, name: &str, text: &str, want: &[u32]) -> Vec<String> {
    let mut bad = Vec::new();
    let got = tok.encode(text, false).unwrap();
    if got != want {
        bad.push(format!(
            "{name}: encode({text:?}) = {got:?}, llama.cpp gives {want:?}"
        ));
    }
    let back = tok.decode(want, false).unwrap();
    if back != text {
        bad.push(format!("{name}: decode gives {back:?}, want {text:?}"));
    }
    let table = tok.token_bytes_table();
    let bytes: Vec<u8> = want
        .iter()
        .flat_map(|&id| table[id as usize].iter().copied())
        .collect();
    if bytes != text.as_bytes() {
        bad.push(format!(
            "{name}: token_bytes_table concatenation is {:?}",
            String::from_utf8_lossy(&bytes)
        ));
    }
    let mut d = tok.detokenizer(false);
    let mut streamed = String::new();
    for &id in want {
        let chunk = d.push(&[id]).unwrap();
        if chunk.contains(char::REPLACEMENT_CHARACTER) {
            bad.push(format!(
                "{name}: streamed chunk {chunk:?} (after id {id}) has U+FFFD"
            ));
        }
        streamed.push_str(&chunk);
    }
    let rest = d.finish();
    if !rest.is_empty() {
        bad.push(format!(
            "{name}: finish() still had {rest:?}: text was held back"
        ));
    }
    streamed.push_str(&rest);
    if streamed != back {
        bad.push(format!(
            "{name}: streamed {streamed:?}, decode gives {back:?}"
        ));
    }
    bad
}

#[test]
fn fixture_strings_match_llama_cpp() {
    let tok = tok();
    let bad: Vec<String> = tokenizer_cases()
        .iter()
        .flat_map(|c| check(tok, &c.name, &c.text, &c.ids))
        .collect();
    assert_no_failures(&bad);
}

#[test]
fn reference_prompts_tokenize_like_llama_cpp() {
    let tok = tok();
    let f: Reference = reference();
    let bad: Vec<String> = f
        .prompts
        .iter()
        .flat_map(|p| check(tok, &p.name, &p.text, &p.prompt_ids))
        .collect();
    assert!(f.prompts.iter().filter(|p| p.kind == "chat").count() >= 3);
    assert_no_failures(&bad);
}

#[test]
fn fixtures_include_characters_split_across_tokens() {
    // Guards the streaming check above: some fixture ids must be partial UTF-8.
    let tok = tok();
    let table = tok.token_bytes_table();
    let split: Vec<String> = tokenizer_cases()
        .into_iter()
        .filter(|c| {
            c.ids
                .iter()
                .any(|&id| std::str::from_utf8(&table[id as usize]).is_err())
        })
        .map(|c| c.name)
        .collect();
    for name in ["emoji", "emoji_zwj", "cjk"] {
        assert!(
            split.iter().any(|s| s == name),
            "{name} has no split character; cases with one: {split:?}"
        );
    }
}

#[test]
fn special_tokens_and_vocabulary() {
    let tok = tok();
    assert_eq!(tok.vocab_size(), 49152);
    assert_eq!(tok.bos_token_id(), Some(1));
    assert_eq!(
        tok.eos_token_ids(),
        [2, 0],
        "<|im_end|> (GGUF eos) then <|endoftext|>"
    );
    // SmolLM2's GGUF does not ask for BOS, so add_special_tokens adds nothing.
    assert_eq!(
        tok.encode("Hello", true).unwrap(),
        tok.encode("Hello", false).unwrap()
    );
    // "The" is one token with no space prefix (not "ĠThe").
    let the = tok.encode("The", false).unwrap();
    assert_eq!(the.len(), 1);
    assert_eq!(tok.token_bytes_table()[the[0] as usize], b"The");
    let ids = tok.encode("<|im_start|>user\nhi<|im_end|>", false).unwrap();
    assert_eq!(tok.decode(&ids, true).unwrap(), "user\nhi");
    assert!(matches!(
        tok.decode(&[49152], false),
        Err(TokenizerError::UnknownTokenId { id: 49152, .. })
    ));
}

#[test]
fn incremental_detokenizer_skips_specials_when_asked() {
    let tok = tok();
    let ids = tok
        .encode("<|im_start|>assistant\nCafé 😀<|im_end|>", false)
        .unwrap();
    let mut d = tok.detokenizer(true);
    let mut out = String::new();
    for &id in &ids {
        out.push_str(&d.push(&[id]).unwrap());
    }
    out.push_str(&d.finish());
    assert_eq!(out, "assistant\nCafé 😀");
}

#[test]
fn an_hf_directory_written_from_the_gguf_tokenizes_identically() {
    let dir = tempfile::tempdir().unwrap();
    tok().write_hf_dir(dir.path()).unwrap();
    let hf = TextTokenizer::from_path(dir.path()).unwrap();
    let cases: TokenizerFixture = model_fixture("tokenizer_ids.json");
    for c in &cases.cases {
        assert_eq!(hf.encode(&c.text, false).unwrap(), c.ids, "{}", c.name);
        assert_eq!(
            hf.decode(&c.ids, false).unwrap(),
            tok().decode(&c.ids, false).unwrap()
        );
    }
    assert_eq!(hf.vocab_size(), tok().vocab_size());
    assert_eq!(hf.eos_token_ids(), tok().eos_token_ids());
    assert_eq!(hf.bos_token_id(), tok().bos_token_id());
    assert_eq!(hf.token_bytes_table(), tok().token_bytes_table());
    assert_eq!(hf.fingerprint(), tok().fingerprint());
}
