//! What the engine needs to know about the vocabulary without tokenizing: the bytes each
//! token stands for (to match stop strings on output bytes) and the end-of-generation ids.

use std::collections::HashMap;

use pdmesh_gguf::GgufFile;

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
