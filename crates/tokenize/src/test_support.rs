//! Tiny real vocabularies for tests (feature `test-support`): a GGUF whose every id is
//! known, so tests of tokenizers, prompts and vocabularies can assert exact ids without
//! the default model.

use pdmesh_gguf::{GgufWriter, MetaValue};

use crate::TextTokenizer;
use crate::tokenizer::char_to_byte;

/// The char GPT-2's byte-level alphabet writes for byte `b`.
pub fn byte_to_char(b: u8) -> char {
    (0x21..0x200u32)
        .filter_map(char::from_u32)
        .find(|&c| char_to_byte(c) == Some(b))
        .expect("every byte has a char")
}

/// A real GGUF with a tiny byte-level vocabulary: ids 0..256 are the 256 bytes, then
/// `<|im_start|>` (256), `<|im_end|>` (257) as control tokens, `<tool>` (258)
/// user-defined, and the merges `h i` → `hi` (259), `Ġ hi` → `Ġhi` (260). `edit` may
/// change or add metadata before it is written.
pub fn tiny_gguf(edit: impl FnOnce(&mut GgufWriter)) -> (tempfile::TempDir, std::path::PathBuf) {
    let mut tokens: Vec<MetaValue> = (0..=255u8)
        .map(|b| MetaValue::String(byte_to_char(b).to_string()))
        .collect();
    let mut types: Vec<MetaValue> = vec![MetaValue::I32(1); 256];
    for (t, ty) in [
        ("<|im_start|>", 3),
        ("<|im_end|>", 3),
        ("<tool>", 4),
        ("hi", 1),
        ("Ġhi", 1),
    ] {
        tokens.push(MetaValue::String(t.into()));
        types.push(MetaValue::I32(ty));
    }
    let merges = ["h i", "Ġ hi"]
        .map(|m| MetaValue::String(m.into()))
        .to_vec();
    let mut w = GgufWriter::new();
    w.meta("tokenizer.ggml.model", MetaValue::String("gpt2".into()))
        .meta("tokenizer.ggml.pre", MetaValue::String("smollm".into()))
        .meta("tokenizer.ggml.tokens", MetaValue::Array(tokens))
        .meta("tokenizer.ggml.token_type", MetaValue::Array(types))
        .meta("tokenizer.ggml.merges", MetaValue::Array(merges))
        .meta("tokenizer.ggml.bos_token_id", MetaValue::U32(256))
        .meta("tokenizer.ggml.eos_token_id", MetaValue::U32(257));
    edit(&mut w);
    let dir = tempfile::tempdir().expect("a temporary directory");
    let path = dir.path().join("tiny.gguf");
    w.write_to(&path).expect("the tiny GGUF is written");
    (dir, path)
}

/// The tokenizer of [`tiny_gguf`] unchanged.
pub fn tiny() -> TextTokenizer {
    let (_dir, path) = tiny_gguf(|_| {});
    TextTokenizer::from_path(&path).expect("the tiny GGUF is a tokenizer")
}

/// [`tiny_spm_gguf`]'s normal pieces and their scores: ids 265.. in this order, after its
/// 9 special and 256 byte tokens.
pub const TINY_SPM_PIECES: [(&str, f32); 12] = [
    ("\u{2581}", -100.0),
    ("a", -101.0),
    ("b", -102.0),
    ("c", -103.0),
    ("h", -104.0),
    ("i", -105.0),
    // "ab" has the lower id but "bc" the better score: "abc" is a + bc.
    ("ab", -10.0),
    ("bc", -5.0),
    ("aa", -20.0),
    ("hi", -3.0),
    ("\u{2581}hi", -4.0),
    // The best score of all, yet two raw spaces are the user-defined "  " (7).
    ("\u{2581}\u{2581}", -1.0),
];

/// A real GGUF with a tiny SentencePiece vocabulary (`tokenizer.ggml.model == "llama"`,
/// laid out like Gemma 3's): `<pad>` (0), `<eos>` (1), `<bos>` (2) and `<end_of_turn>`
/// (4) control, `<unk>` (3) of the unknown type, user-defined `\n` (5), `\n\n` (6), `  `
/// (7) and `<b>` (8), the byte tokens `<0x00>`..`<0xFF>` (9..265), then
/// [`TINY_SPM_PIECES`] (265..277) with their scores. BOS is added, there is no space
/// prefix. `edit` may change or add metadata before it is written.
pub fn tiny_spm_gguf(
    edit: impl FnOnce(&mut GgufWriter),
) -> (tempfile::TempDir, std::path::PathBuf) {
    let mut tokens: Vec<MetaValue> = Vec::new();
    let mut scores: Vec<MetaValue> = Vec::new();
    let mut types: Vec<MetaValue> = Vec::new();
    let mut push = |t: String, score: f32, ty: i32| {
        tokens.push(MetaValue::String(t));
        scores.push(MetaValue::F32(score));
        types.push(MetaValue::I32(ty));
    };
    for (t, ty) in [
        ("<pad>", 3),
        ("<eos>", 3),
        ("<bos>", 3),
        ("<unk>", 2),
        ("<end_of_turn>", 3),
        ("\n", 4),
        ("\n\n", 4),
        ("  ", 4),
        ("<b>", 4),
    ] {
        push(t.into(), -1000.0, ty);
    }
    for b in 0..=255u8 {
        push(format!("<0x{b:02X}>"), 0.0, 6);
    }
    for (t, score) in TINY_SPM_PIECES {
        push(t.into(), score, 1);
    }
    let mut w = GgufWriter::new();
    w.meta("tokenizer.ggml.model", MetaValue::String("llama".into()))
        .meta("tokenizer.ggml.pre", MetaValue::String("default".into()))
        .meta("tokenizer.ggml.tokens", MetaValue::Array(tokens))
        .meta("tokenizer.ggml.scores", MetaValue::Array(scores))
        .meta("tokenizer.ggml.token_type", MetaValue::Array(types))
        .meta("tokenizer.ggml.bos_token_id", MetaValue::U32(2))
        .meta("tokenizer.ggml.eos_token_id", MetaValue::U32(1))
        .meta("tokenizer.ggml.unknown_token_id", MetaValue::U32(3))
        .meta("tokenizer.ggml.add_bos_token", MetaValue::Bool(true))
        .meta("tokenizer.ggml.add_space_prefix", MetaValue::Bool(false));
    edit(&mut w);
    let dir = tempfile::tempdir().expect("a temporary directory");
    let path = dir.path().join("tiny_spm.gguf");
    w.write_to(&path).expect("the tiny GGUF is written");
    (dir, path)
}

/// The tokenizer of [`tiny_spm_gguf`] unchanged.
pub fn tiny_spm() -> TextTokenizer {
    let (_dir, path) = tiny_spm_gguf(|_| {});
    TextTokenizer::from_path(&path).expect("the tiny SentencePiece GGUF is a tokenizer")
}
