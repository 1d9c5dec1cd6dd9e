//! pdmesh-tokenize against Gemma 3 270M (a SentencePiece vocabulary: `tokenizer.ggml.model
//! == "llama"`) and llama.cpp's own ids for it (tests/fixtures/gemma3_tokenizer_ids.json
//! and the prompts of gemma3_reference.json, made by scripts/reference/gen_gemma3.py):
//! same token ids, the same decoded text, the right bytes per id and clean streaming text.

use std::sync::OnceLock;

use pdmesh_gguf::models::{GEMMA3_270M, require_gemma3_model};
use pdmesh_testkit::reference::assert_no_failures;
use pdmesh_tokenize::{TextTokenizer, TokenizerError};
use serde::Deserialize;

fn tok() -> &'static TextTokenizer {
    static TOK: OnceLock<TextTokenizer> = OnceLock::new();
    TOK.get_or_init(|| {
        let path = require_gemma3_model();
        TextTokenizer::from_path(&path)
            .unwrap_or_else(|e| panic!("loading {}: {e}", path.display()))
    })
}

/// `gemma3_tokenizer_ids.json`: llama.cpp's ids (`tokenize(text, add_bos=False,
/// special=True)`) for strings that test the tokenizer, and the text llama.cpp decodes
/// them to (`detokenize(ids, special=True)`).
#[derive(Deserialize)]
struct TokenizerFixture {
    model_sha256: String,
    cases: Vec<Case>,
}

#[derive(Deserialize)]
struct Case {
    name: String,
    text: String,
    ids: Vec<u32>,
    decoded: String,
}

fn cases() -> Vec<Case> {
    let f: TokenizerFixture = pdmesh_testkit::fixture("gemma3_tokenizer_ids.json");
    assert_eq!(
        f.model_sha256, GEMMA3_270M.sha256,
        "gemma3_tokenizer_ids.json was made from another model"
    );
    assert!(
        f.cases.len() >= 29,
        "only {} fixture strings",
        f.cases.len()
    );
    f.cases
}

/// The id of the token spelled `text`.
fn id(text: &str) -> u32 {
    tok()
        .inner()
        .token_to_id(text)
        .unwrap_or_else(|| panic!("{text:?} is not a token"))
}

/// Everything the tokenizer must do for one fixture string: encode to llama.cpp's ids,
/// and decode them (at once, as token bytes and streamed) to llama.cpp's text. Returns a
/// description of each way it failed.
fn check(tok: &TextTokenizer, case: &Case) -> Vec<String> {
    let Case {
        name,
        text,
        ids: want,
        decoded,
    } = case;
    let mut bad = Vec::new();
    let got = tok.encode(text, false).unwrap();
    if got != *want {
        bad.push(format!(
            "{name}: encode({text:?}) = {got:?}, llama.cpp gives {want:?}"
        ));
    }
    let back = tok.decode(want, false).unwrap();
    if back != *decoded {
        bad.push(format!(
            "{name}: decode gives {back:?}, llama.cpp {decoded:?}"
        ));
    }
    let bytes: Vec<u8> = want
        .iter()
        .flat_map(|&id| tok.token_bytes(id).unwrap().iter().copied())
        .collect();
    if bytes != decoded.as_bytes() {
        bad.push(format!(
            "{name}: token bytes concatenate to {:?}",
            String::from_utf8_lossy(&bytes)
        ));
    }
    let mut d = tok.detokenizer(false);
    let mut streamed = String::new();
    for &id in want.iter() {
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
    if streamed != *decoded {
        bad.push(format!("{name}: streamed {streamed:?}, want {decoded:?}"));
    }
    bad
}

#[test]
fn fixture_strings_match_llama_cpp() {
    let tok = tok();
    let bad: Vec<String> = cases().iter().flat_map(|c| check(tok, c)).collect();
    assert_no_failures(&bad);
}

/// `gemma3_reference.json` (the engine's reference), for its prompts: raw text, the ids
/// llama.cpp gives it with BOS, and llama.cpp's greedy continuation as ids and text.
#[derive(Deserialize)]
struct Reference {
    model_sha256: String,
    prompts: Vec<Prompt>,
}

#[derive(Deserialize)]
struct Prompt {
    name: String,
    text: String,
    prompt_ids: Vec<u32>,
    greedy_ids: Vec<u32>,
    greedy_text: String,
}

#[test]
fn reference_prompts_tokenize_like_llama_cpp() {
    let tok = tok();
    let f: Reference = pdmesh_testkit::fixture("gemma3_reference.json");
    assert_eq!(f.model_sha256, GEMMA3_270M.sha256);
    assert!(f.prompts.len() >= 8);
    let mut bad = Vec::new();
    for p in &f.prompts {
        let got = tok.encode(&p.text, true).unwrap();
        if got != p.prompt_ids {
            bad.push(format!(
                "{}: {} ids, llama.cpp {} (first difference at {:?})",
                p.name,
                got.len(),
                p.prompt_ids.len(),
                got.iter().zip(&p.prompt_ids).position(|(a, b)| a != b)
            ));
        }
        let text = tok.decode(&p.greedy_ids, false).unwrap();
        if text != p.greedy_text {
            bad.push(format!(
                "{}: greedy ids decode to {text:?}, llama.cpp {:?}",
                p.name, p.greedy_text
            ));
        }
    }
    // The long prompts are there to pass the 512-token sliding window.
    assert!(f.prompts.iter().any(|p| p.prompt_ids.len() > 1500));
    assert_no_failures(&bad);
}

#[test]
fn fixtures_cover_byte_fallback_and_whitespace_runs() {
    // Guards the checks above: the fixture must exercise what makes SentencePiece differ.
    let tok = tok();
    let cases = cases();
    let ids_of = |name: &str| -> &[u32] {
        &cases
            .iter()
            .find(|c| c.name == name)
            .unwrap_or_else(|| panic!("no fixture case {name}"))
            .ids
    };
    let is_byte = |id: u32| {
        tok.inner()
            .id_to_token(id)
            .is_some_and(|t| t.starts_with("<0x"))
    };
    // Private-use and ancient characters are not in the vocabulary: bytes, some of them
    // partial UTF-8 that the streaming check above must hold back.
    let fallback = ids_of("byte_fallback");
    assert!(fallback.iter().filter(|&&id| is_byte(id)).count() >= 8);
    assert!(
        fallback
            .iter()
            .any(|&id| std::str::from_utf8(tok.token_bytes(id).unwrap()).is_err())
    );
    // 36 newlines are two user-defined tokens, 31 and 5; 40 spaces are 31 and 9.
    let newlines = ids_of("newline_runs");
    assert!(newlines.contains(&id(&"\n".repeat(31))));
    assert!(newlines.contains(&id(&"\n".repeat(5))));
    let spaces = ids_of("space_runs");
    assert!(spaces.contains(&id(&" ".repeat(31))));
    assert!(spaces.contains(&id(&" ".repeat(9))));
    assert!(ids_of("tab_runs").contains(&id("\t\t\t\t")));
    // Control tokens are split out of the text (special parsing is on).
    assert!(ids_of("control_tokens").contains(&id("<end_of_turn>")));
    // Decoding gives the text back, but for a literal "▁" (a space once decoded).
    for c in &cases {
        assert_eq!(
            c.decoded == c.text,
            !c.text.contains('\u{2581}'),
            "{}: llama.cpp decodes {:?}",
            c.name,
            c.decoded
        );
    }
}

#[test]
fn spaces_are_pieces_with_no_dummy_prefix() {
    let tok = tok();
    // add_space_prefix is false: "Hello" is not "▁Hello".
    let hello = tok.encode("Hello", false).unwrap();
    assert_eq!(hello, [id("Hello")]);
    assert_eq!(tok.encode(" Hello", false).unwrap(), [id("\u{2581}Hello")]);
    // One space is the piece ▁; two are the user-defined token "  ", taken from the raw
    // text before spaces become ▁.
    assert_eq!(tok.encode(" ", false).unwrap(), [id("\u{2581}")]);
    assert_eq!(
        tok.encode("a  b", false).unwrap(),
        [id("a"), id("  "), id("b")]
    );
    // A literal ▁ is the same piece as a space.
    assert_eq!(
        tok.encode("\u{2581}Hello", false).unwrap(),
        tok.encode(" Hello", false).unwrap()
    );
    assert_eq!(tok.encode("", false).unwrap(), Vec::<u32>::new());
}

#[test]
fn bos_is_added_with_special_tokens() {
    let tok = tok();
    assert_eq!(tok.bos_token_id(), Some(2));
    let plain = tok.encode("The quick brown fox", false).unwrap();
    let with = tok.encode("The quick brown fox", true).unwrap();
    assert_eq!(with[0], 2);
    assert_eq!(with[1..], plain[..]);
    // Only BOS: the GGUF does not ask for EOS.
    assert_eq!(tok.encode("", true).unwrap(), [2]);
    assert_eq!(tok.decode(&with, true).unwrap(), "The quick brown fox");
    assert_eq!(
        tok.decode(&with, false).unwrap(),
        "<bos>The quick brown fox"
    );
}

#[test]
fn special_tokens_and_vocabulary() {
    let tok = tok();
    assert_eq!(tok.vocab_size(), 262_144);
    assert_eq!(tok.bos_text(), Some("<bos>"));
    assert_eq!(tok.eos_text(), Some("<eos>"));
    assert_eq!(
        tok.eos_token_ids(),
        [1, 106],
        "<eos> (GGUF eos) then <end_of_turn>"
    );
    assert_eq!(id("<end_of_turn>"), 106);
    let ids = tok
        .encode("<start_of_turn>user\nhi<end_of_turn>\n", false)
        .unwrap();
    assert_eq!(ids[0], 105);
    assert_eq!(tok.decode(&ids, true).unwrap(), "user\nhi\n");
    assert!(matches!(
        tok.decode(&[262_144], false),
        Err(TokenizerError::UnknownTokenId {
            id: 262_144,
            vocab_size: 262_144
        })
    ));
}

#[test]
fn token_bytes_follow_sentencepiece_rules() {
    let tok = tok();
    // Every byte token is its byte.
    for b in 0..=255u8 {
        let id = id(&format!("<0x{b:02X}>"));
        assert_eq!(tok.token_bytes(id), Some(&[b][..]), "<0x{b:02X}>");
    }
    // ▁ is a space wherever it is in a normal piece.
    assert_eq!(tok.token_bytes(id("\u{2581}")), Some(&b" "[..]));
    assert_eq!(tok.token_bytes(id("\u{2581}the")), Some(&b" the"[..]));
    assert_eq!(tok.token_bytes(id("\u{2581}😀")), Some(" 😀".as_bytes()));
    // Control and user-defined tokens are their text.
    assert_eq!(tok.token_bytes(106), Some(&b"<end_of_turn>"[..]));
    assert_eq!(tok.token_bytes(2), Some(&b"<bos>"[..]));
    assert_eq!(tok.token_bytes(id("\n\n")), Some(&b"\n\n"[..]));
    assert_eq!(tok.token_bytes(id("\t")), Some(&b"\t"[..]));
    assert_eq!(tok.token_bytes(id("<table>")), Some(&b"<table>"[..]));
    assert_eq!(tok.token_bytes(262_144), None);
    let table = tok.token_bytes_table();
    assert_eq!(table.len(), 262_144);
    assert_eq!(table[id("\u{2581}the") as usize], b" the");
}

#[test]
fn incremental_detokenizer_holds_split_characters_and_skips_specials() {
    let tok = tok();
    // U+F0001 is outside the vocabulary: four byte tokens, one character.
    let text = "<start_of_turn>model\nCafé \u{f0001} 😀<end_of_turn>";
    let ids = tok.encode(text, false).unwrap();
    let mut d = tok.detokenizer(true);
    let mut chunks = Vec::new();
    for &id in &ids {
        chunks.push(d.push(&[id]).unwrap());
    }
    let rest = d.finish();
    assert_eq!(rest, "");
    assert!(
        chunks
            .iter()
            .all(|c| !c.contains(char::REPLACEMENT_CHARACTER)),
        "{chunks:?}"
    );
    assert!(
        chunks.iter().any(|c| c == "\u{f0001}"),
        "the private-use character comes out whole once its last byte arrives: {chunks:?}"
    );
    assert_eq!(chunks.concat(), "model\nCafé \u{f0001} 😀");
}

#[test]
fn an_hf_directory_written_from_the_gguf_tokenizes_identically() {
    let dir = tempfile::tempdir().unwrap();
    tok().write_hf_dir(dir.path()).unwrap();
    let hf = TextTokenizer::from_path(dir.path()).unwrap();
    for c in cases() {
        assert_eq!(hf.encode(&c.text, false).unwrap(), c.ids, "{}", c.name);
        assert_eq!(hf.decode(&c.ids, false).unwrap(), c.decoded, "{}", c.name);
    }
    assert_eq!(
        hf.encode("Hi", true).unwrap(),
        tok().encode("Hi", true).unwrap()
    );
    assert_eq!(hf.vocab_size(), tok().vocab_size());
    assert_eq!(hf.eos_token_ids(), tok().eos_token_ids());
    assert_eq!(hf.bos_token_id(), tok().bos_token_id());
    assert_eq!(hf.token_bytes_table(), tok().token_bytes_table());
    assert_eq!(hf.fingerprint(), tok().fingerprint());
}
