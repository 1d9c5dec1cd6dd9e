//! What the engine needs to know about the vocabulary without tokenizing: the bytes each
//! token stands for (to match stop strings on output bytes) and the end-of-generation ids,
//! read from a GGUF's metadata or an HF checkpoint's `tokenizer.json`. The engine builds
//! no tokenizer: it depends on no tokenizer crate.

use std::collections::HashMap;
use std::path::Path;

use pdmesh_gguf::GgufFile;
use serde::Deserialize;

use crate::EngineError;

/// GPT-2's byte-level alphabet: each byte maps to a printable char; invert it.
fn byte_decoder() -> HashMap<char, u8> {
    let mut bs: Vec<u32> = (b'!' as u32..=b'~' as u32)
        .chain(0xA1..=0xAC)
        .chain(0xAE..=0xFF)
        .collect();
    let mut cs = bs.clone();
    let mut n = 0;
    for b in 0..256u32 {
        if !bs.contains(&b) {
            bs.push(b);
            cs.push(256 + n);
            n += 1;
        }
    }
    bs.into_iter()
        .zip(cs)
        .map(|(b, c)| (char::from_u32(c).expect("valid char"), b as u8))
        .collect()
}

/// Bytes of each token id. Control tokens map to nothing (they are not output text).
pub(crate) fn token_bytes_table(g: &GgufFile) -> Result<Vec<Vec<u8>>, EngineError> {
    let tokens = g.get_str_array("tokenizer.ggml.tokens")?;
    let types: Vec<u64> = g
        .get("tokenizer.ggml.token_type")
        .and_then(|v| v.as_array())
        .map(|a| a.iter().map(|v| v.as_u64().unwrap_or(1)).collect())
        .unwrap_or_default();
    let model = g.get_str("tokenizer.ggml.model").unwrap_or("gpt2");
    let dec = byte_decoder();
    Ok(tokens
        .iter()
        .enumerate()
        .map(|(i, t)| {
            if types.get(i) == Some(&3) {
                return Vec::new();
            }
            match model {
                "gpt2" => {
                    let mut out = Vec::with_capacity(t.len());
                    for ch in t.chars() {
                        match dec.get(&ch) {
                            Some(&b) => out.push(b),
                            None => out.extend(ch.to_string().as_bytes()),
                        }
                    }
                    out
                }
                // SentencePiece: '▁' is a space; <0xNN> byte tokens.
                _ => {
                    if let Some(hex) = t.strip_prefix("<0x").and_then(|r| r.strip_suffix('>'))
                        && let Ok(b) = u8::from_str_radix(hex, 16)
                    {
                        return vec![b];
                    }
                    t.replace('\u{2581}', " ").into_bytes()
                }
            }
        })
        .collect())
}

/// Token ids that end generation: eos, eot/eom if present, and the usual end-of-turn
/// control tokens.
pub(crate) fn eog_tokens(g: &GgufFile) -> Result<Vec<u32>, EngineError> {
    let mut out = Vec::new();
    for key in [
        "tokenizer.ggml.eos_token_id",
        "tokenizer.ggml.eot_token_id",
        "tokenizer.ggml.eom_token_id",
    ] {
        if let Ok(id) = g.get_u64(key) {
            out.push(id as u32);
        }
    }
    let tokens = g.get_str_array("tokenizer.ggml.tokens")?;
    for (i, t) in tokens.iter().enumerate() {
        if matches!(
            *t,
            "<|endoftext|>" | "<|im_end|>" | "<|eot_id|>" | "<end_of_turn>" | "<|end|>"
        ) {
            out.push(i as u32);
        }
    }
    out.sort_unstable();
    out.dedup();
    Ok(out)
}

/// The parts of `tokenizer.json` the table needs.
#[derive(Deserialize)]
struct TokenizerJson {
    #[serde(default)]
    added_tokens: Vec<AddedToken>,
    model: TokenizerModel,
}

#[derive(Deserialize)]
struct AddedToken {
    content: String,
    #[serde(default)]
    special: bool,
}

#[derive(Deserialize)]
struct TokenizerModel {
    vocab: ModelVocab,
}

/// A BPE or WordPiece vocabulary maps tokens to ids; a Unigram one lists pieces with
/// their scores, each piece's id its place.
#[derive(Deserialize)]
#[serde(untagged)]
enum ModelVocab {
    Map(HashMap<String, u32>),
    List(Vec<(String, f64)>),
}

/// What the engine reads from an HF tokenizer directory (`tokenizer.json`, and
/// `tokenizer_config.json` for `eos_token`): each id's bytes and the ids that end
/// generation, exactly as `pdmesh_tokenize::TextTokenizer::from_hf_dir` gives them
/// (`token_bytes_table`, `eos_token_ids`), without building a tokenizer. Ids follow the
/// `tokenizers` crate's rules: an added token already in the model's vocabulary keeps
/// that id, another takes the next one after it. Special tokens stand for their text;
/// every other token for the bytes of GPT-2's byte-level alphabet (a token with a
/// character outside it for its UTF-8 text).
pub(crate) fn hf_vocab(dir: &Path) -> Result<(Vec<Vec<u8>>, Vec<u32>), EngineError> {
    let fail = |what: &str, e: &dyn std::fmt::Display| {
        EngineError::Unsupported(format!("tokenizer: {}/{what}: {e}", dir.display()))
    };
    let file = dir.join("tokenizer.json");
    let text = std::fs::read_to_string(&file).map_err(|e| fail("tokenizer.json", &e))?;
    let tj: TokenizerJson = serde_json::from_str(&text).map_err(|e| fail("tokenizer.json", &e))?;
    let config: serde_json::Value = match std::fs::read_to_string(dir.join("tokenizer_config.json"))
    {
        Ok(t) => serde_json::from_str(&t).map_err(|e| fail("tokenizer_config.json", &e))?,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => serde_json::Value::Null,
        Err(e) => return Err(fail("tokenizer_config.json", &e)),
    };

    let vocab: HashMap<String, u32> = match tj.model.vocab {
        ModelVocab::Map(m) => m,
        ModelVocab::List(l) => l
            .into_iter()
            .enumerate()
            .map(|(i, (piece, _))| (piece, i as u32))
            .collect(),
    };
    let mut by_id: HashMap<u32, &str> = vocab.iter().map(|(t, &id)| (id, t.as_str())).collect();
    // Added tokens, as `tokenizers` assigns their ids; the last definition of an id wins.
    let mut added: HashMap<&str, u32> = HashMap::new();
    let mut added_by_id: HashMap<u32, &AddedToken> = HashMap::new();
    let mut next = vocab.len() as u32;
    for t in tj.added_tokens.iter().filter(|t| !t.content.is_empty()) {
        let id = match added.get(t.content.as_str()).or(vocab.get(&t.content)) {
            Some(&id) => id,
            None => {
                next += 1;
                next - 1
            }
        };
        added.insert(&t.content, id);
        added_by_id.insert(id, t);
    }
    for (&id, t) in &added_by_id {
        by_id.insert(id, &t.content);
    }
    let n = vocab.len() + added.keys().filter(|t| !vocab.contains_key(**t)).count();
    let dec = byte_decoder();
    let token_bytes = (0..n as u32)
        .map(|id| match (added_by_id.get(&id), by_id.get(&id)) {
            (Some(t), _) if t.special => t.content.as_bytes().to_vec(),
            (_, Some(t)) => t
                .chars()
                .map(|c| dec.get(&c).copied())
                .collect::<Option<Vec<u8>>>()
                .unwrap_or_else(|| t.as_bytes().to_vec()),
            (_, None) => Vec::new(),
        })
        .collect();

    let token_id = |t: &str| added.get(t).or(vocab.get(t)).copied();
    let named = match &config["eos_token"] {
        serde_json::Value::String(s) => Some(s.as_str()),
        v => v["content"].as_str(),
    };
    let mut eos: Vec<u32> = named.and_then(token_id).into_iter().collect();
    let mut ends: Vec<u32> = added_by_id
        .iter()
        .filter(|(_, t)| t.special && pdmesh_gguf::END_OF_TURN_TEXTS.contains(&t.content.as_str()))
        .map(|(&id, _)| id)
        .collect();
    ends.sort_unstable();
    for id in ends {
        if !eos.contains(&id) {
            eos.push(id);
        }
    }
    Ok((token_bytes, eos))
}

#[cfg(test)]
mod tests {
    use pdmesh_gguf::MetaValue;
    use pdmesh_tokenize::TextTokenizer;
    use pdmesh_tokenize::test_support::tiny_gguf;

    use super::*;

    /// The engine reads `dir` as pdmesh-tokenize does: the same bytes for every id, the
    /// same end ids in the same order.
    fn check_same(dir: &Path) {
        let tok = TextTokenizer::from_hf_dir(dir).unwrap();
        let (bytes, eos) = hf_vocab(dir).unwrap();
        assert_eq!(bytes.len(), tok.vocab_size());
        assert_eq!(bytes, tok.token_bytes_table());
        assert_eq!(eos, tok.eos_token_ids());
    }

    fn edit_json(path: &Path, edit: impl FnOnce(&mut serde_json::Value)) {
        let mut v: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
        edit(&mut v);
        std::fs::write(path, serde_json::to_string(&v).unwrap()).unwrap();
    }

    /// The tiny vocabulary with more added tokens (end-of-turn controls, user-defined
    /// tokens inside and outside GPT-2's byte alphabet), written as an HF directory,
    /// then edited the ways real checkpoints differ.
    #[test]
    fn an_hf_directory_reads_as_pdmesh_tokenize_reads_it() {
        let (_gguf, path) = tiny_gguf(|w| {
            let more = [
                ("<|endoftext|>", 3),
                ("<|eot_id|>", 3),
                ("<｜User｜>", 4),
                ("<ünï>", 4),
                ("<|not_an_end|>", 3),
            ];
            for key in ["tokenizer.ggml.tokens", "tokenizer.ggml.token_type"] {
                let Some(MetaValue::Array(v)) = w.meta_mut(key) else {
                    panic!("{key} is not an array");
                };
                v.extend(more.iter().map(|&(t, ty)| match key {
                    "tokenizer.ggml.tokens" => MetaValue::String(t.into()),
                    _ => MetaValue::I32(ty),
                }));
            }
        });
        let dir = tempfile::tempdir().unwrap();
        TextTokenizer::from_path(&path)
            .unwrap()
            .write_hf_dir(dir.path())
            .unwrap();
        check_same(dir.path());
        let (bytes, eos) = hf_vocab(dir.path()).unwrap();
        assert_eq!(
            eos,
            [257, 261, 262],
            "<|im_end|> (EOS), then the end controls"
        );
        assert_eq!(bytes[260], b" hi");
        assert_eq!(bytes[263], "<｜User｜>".as_bytes());

        // EOS named as an AddedToken object; an added token the model's vocabulary lacks
        // (it takes the next id); a duplicate definition (the last one wins).
        let config = dir.path().join("tokenizer_config.json");
        edit_json(&config, |c| {
            c["eos_token"] = serde_json::json!({"content": "<|endoftext|>", "special": true});
        });
        edit_json(&dir.path().join("tokenizer.json"), |t| {
            let added = t["added_tokens"].as_array_mut().unwrap();
            let mut extra = added[0].clone();
            extra["content"] = "<|im_end|><extra>".into();
            extra["id"] = 9999.into();
            let mut again = added[1].clone();
            again["special"] = false.into();
            added.push(extra);
            added.push(again);
        });
        check_same(dir.path());
        let (bytes, eos) = hf_vocab(dir.path()).unwrap();
        assert_eq!(bytes.len(), 267);
        assert_eq!(bytes[266], b"<|im_end|><extra>");
        assert_eq!(eos[0], 261, "the configured EOS first");

        // No tokenizer_config.json: the end controls alone.
        std::fs::remove_file(&config).unwrap();
        check_same(dir.path());
    }

    /// The synthesized `deepseek-v32-tiny` checkpoint the engine's tests serve: its
    /// vocabulary (the default model's) reads the same through the engine.
    #[test]
    fn the_tiny_deepseek_checkpoints_vocabulary_reads_as_pdmesh_tokenize_reads_it() {
        let tokenizer = tempfile::tempdir().unwrap();
        TextTokenizer::from_path(pdmesh_gguf::models::require_default_model())
            .unwrap()
            .write_hf_dir(tokenizer.path())
            .unwrap();
        let dir = tempfile::tempdir().unwrap();
        let cfg = crate::deepseek_synth::tiny_config();
        crate::deepseek_synth::write(dir.path(), &cfg, 7, Some(tokenizer.path())).unwrap();
        check_same(dir.path());
        let (bytes, eos) = hf_vocab(dir.path()).unwrap();
        assert_eq!(bytes.len(), cfg.vocab_size);
        assert_eq!(eos, [2, 0], "<|im_end|> (EOS), then <|endoftext|>");
    }
}
