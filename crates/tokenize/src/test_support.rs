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
