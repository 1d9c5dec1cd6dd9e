//! `TextTokenizer`: a `tokenizers::Tokenizer` assembled from a GGUF file's
//! `tokenizer.ggml.*` metadata the way llama.cpp reads it, so pdmesh never needs a
//! separate tokenizer.json and produces the same token ids as llama.cpp.

use std::path::Path;
use std::sync::Arc;

use pdmesh_gguf::{GgufFile, MetaValue};
use tokenizers::decoders::DecoderWrapper;
use tokenizers::models::bpe::{BPE, Vocab};
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::processors::template::TemplateProcessing;
use tokenizers::{AddedToken, PreTokenizerWrapper, SplitDelimiterBehavior, Tokenizer};

use crate::{IncrementalDetokenizer, TokenizerError};

/// The regexes llama.cpp applies, in order, for `tokenizer.ggml.pre == "smollm"`: every
/// digit on its own, then the GPT-2 split. (llama.cpp spells the second without the final
/// `|\s+`; its GPT-2 splitter keeps unmatched whitespace as its own piece, which is
/// what the alternative does here.)
pub const PRE_TOKENIZER_SMOLLM: [&str; 2] = [
    r"\p{N}",
    r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+",
];

/// Plain GPT-2 (`tokenizer.ggml.pre == "gpt-2"`): the same split without the digit rule.
const PRE_TOKENIZER_GPT2: [&str; 1] =
    [r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"];

/// `tokenizer.ggml.pre` values this crate reproduces.
pub(crate) const SUPPORTED_PRE: &[&str] = &["smollm", "gpt-2"];

/// GGUF `tokenizer.ggml.token_type` values (llama.cpp's `llama_token_type`).
const TYPE_CONTROL: u64 = 3;
const TYPE_USER_DEFINED: u64 = 4;

/// A GGUF model's tokenizer. Cheap to clone; `Send + Sync`.
#[derive(Clone)]
pub struct TextTokenizer {
    inner: Arc<Tokenizer>,
    /// Raw bytes of each id, for byte-level stop matching.
    token_bytes: Arc<Vec<Vec<u8>>>,
    bos: Option<u32>,
    eos: Vec<u32>,
    /// The texts the tokenizer's files name as BOS and EOS (a chat template sees them
    /// under those names).
    bos_text: Option<String>,
    eos_text: Option<String>,
}

impl std::fmt::Debug for TextTokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TextTokenizer")
            .field("vocab_size", &self.vocab_size())
            .field("bos", &self.bos)
            .field("eos", &self.eos)
            .finish()
    }
}

impl TextTokenizer {
    /// Builds the tokenizer of the model at `path`: a GGUF file, or a directory holding
    /// an HF checkpoint's `tokenizer.json` and `tokenizer_config.json`.
    pub fn from_path(path: impl AsRef<Path>) -> Result<Self, TokenizerError> {
        let path = path.as_ref();
        if path.is_dir() {
            return Self::from_hf_dir(path);
        }
        Self::from_gguf(&GgufFile::open(path)?)
    }

    /// An HF tokenizer directory: `tokenizer.json` (a byte-level BPE) and
    /// `tokenizer_config.json` (`bos_token`, `eos_token`, both optional).
    pub fn from_hf_dir(dir: &Path) -> Result<Self, TokenizerError> {
        let meta =
            |e: &dyn std::fmt::Display| TokenizerError::Metadata(format!("{}: {e}", dir.display()));
        let tok = Tokenizer::from_file(dir.join("tokenizer.json")).map_err(|e| meta(&e))?;
        let config: serde_json::Value =
            match std::fs::read_to_string(dir.join("tokenizer_config.json")) {
                Ok(t) => serde_json::from_str(&t).map_err(|e| meta(&e))?,
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => serde_json::Value::Null,
                Err(e) => return Err(meta(&e)),
            };
        // A token named in the config, as a plain string or as an AddedToken object.
        let named = |key: &str| -> Option<String> {
            match &config[key] {
                serde_json::Value::String(s) => Some(s.clone()),
                v => v["content"].as_str().map(str::to_owned),
            }
        };
        let n = tok.get_vocab_size(true);
        let specials: std::collections::HashMap<u32, String> = tok
            .get_added_tokens_decoder()
            .into_iter()
            .filter(|(_, t)| t.special)
            .map(|(id, t)| (id, t.content))
            .collect();
        let token_bytes = (0..n as u32)
            .map(|id| match (specials.get(&id), tok.id_to_token(id)) {
                (Some(text), _) => text.as_bytes().to_vec(),
                (None, Some(t)) => byte_level_decode(&t),
                (None, None) => Vec::new(),
            })
            .collect();
        let bos_text = named("bos_token");
        let eos_text = named("eos_token");
        let bos = bos_text.as_deref().and_then(|t| tok.token_to_id(t));
        let mut eos = Vec::new();
        if let Some(id) = eos_text.as_deref().and_then(|t| tok.token_to_id(t)) {
            push_unique(&mut eos, id);
        }
        let mut ends: Vec<(&u32, &String)> = specials
            .iter()
            .filter(|(_, t)| pdmesh_gguf::END_OF_TURN_TEXTS.contains(&t.as_str()))
            .collect();
        ends.sort();
        for (&id, _) in ends {
            push_unique(&mut eos, id);
        }
        Ok(Self {
            inner: Arc::new(tok),
            token_bytes: Arc::new(token_bytes),
            bos,
            eos,
            bos_text,
            eos_text,
        })
    }

    /// Writes this tokenizer as an HF directory ([`Self::from_hf_dir`] reads it back).
    pub fn write_hf_dir(&self, dir: &Path) -> Result<(), TokenizerError> {
        self.write_hf_dir_with(dir, serde_json::Map::new())
    }

    /// [`Self::write_hf_dir`] with `extra` entries in `tokenizer_config.json`, after the
    /// tokenizer's own (a chat template, say).
    pub fn write_hf_dir_with(
        &self,
        dir: &Path,
        extra: serde_json::Map<String, serde_json::Value>,
    ) -> Result<(), TokenizerError> {
        let meta =
            |e: &dyn std::fmt::Display| TokenizerError::Metadata(format!("{}: {e}", dir.display()));
        std::fs::create_dir_all(dir).map_err(|e| meta(&e))?;
        self.inner
            .save(dir.join("tokenizer.json"), false)
            .map_err(TokenizerError::tokenizer)?;
        let text = |id: Option<u32>| id.and_then(|i| self.inner.id_to_token(i));
        let mut config = serde_json::json!({
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": text(self.bos),
            "eos_token": text(self.eos.first().copied()),
        });
        for (k, v) in extra {
            config[k] = v;
        }
        let json = serde_json::to_string_pretty(&config).map_err(|e| meta(&e))?;
        std::fs::write(dir.join("tokenizer_config.json"), json).map_err(|e| meta(&e))
    }

    /// Builds the tokenizer described by `gguf`'s `tokenizer.*` metadata.
    pub fn from_gguf(gguf: &GgufFile) -> Result<Self, TokenizerError> {
        let model = gguf.get_str("tokenizer.ggml.model")?;
        if model != "gpt2" {
            return Err(TokenizerError::UnsupportedModel(model.to_string()));
        }
        let pre = match gguf.get("tokenizer.ggml.pre") {
            Some(v) => v.as_str().ok_or_else(|| {
                TokenizerError::Metadata("tokenizer.ggml.pre is not a string".into())
            })?,
            None => return Err(TokenizerError::UnsupportedPreTokenizer("(missing)".into())),
        };
        let regexes: &[&str] = match pre {
            "smollm" => &PRE_TOKENIZER_SMOLLM,
            "gpt-2" => &PRE_TOKENIZER_GPT2,
            other => return Err(TokenizerError::UnsupportedPreTokenizer(other.to_string())),
        };

        let tokens = gguf.get_str_array("tokenizer.ggml.tokens")?;
        let n = tokens.len();
        if n == 0 || n > u32::MAX as usize {
            return Err(TokenizerError::Metadata(format!(
                "tokenizer.ggml.tokens has {n} entries"
            )));
        }
        let types = token_types(gguf, n)?;
        let merges = gguf
            .get_str_array("tokenizer.ggml.merges")?
            .into_iter()
            .map(|m| {
                m.split_once(' ')
                    .map(|(a, b)| (a.to_string(), b.to_string()))
                    .ok_or_else(|| {
                        TokenizerError::Metadata(format!(
                            "merge {m:?} is not two space-separated tokens"
                        ))
                    })
            })
            .collect::<Result<Vec<_>, _>>()?;

        let mut vocab = Vocab::with_capacity(n);
        for (id, t) in tokens.iter().enumerate() {
            if vocab.insert((*t).to_string(), id as u32).is_some() {
                return Err(TokenizerError::Metadata(format!(
                    "token {t:?} appears twice in tokenizer.ggml.tokens"
                )));
            }
        }
        let bpe = BPE::builder()
            .vocab_and_merges(vocab, merges)
            .build()
            .map_err(TokenizerError::tokenizer)?;

        let mut pre_tokenizers = Vec::with_capacity(regexes.len() + 1);
        for r in regexes {
            let split = Split::new(
                SplitPattern::Regex((*r).to_string()),
                SplitDelimiterBehavior::Isolated,
                false,
            )
            .map_err(TokenizerError::tokenizer)?;
            pre_tokenizers.push(PreTokenizerWrapper::Split(split));
        }
        // Regex splitting is done above; ByteLevel only maps bytes to its printable alphabet.
        // No prefix space: llama.cpp never adds one for BPE vocabularies.
        pre_tokenizers.push(PreTokenizerWrapper::ByteLevel(ByteLevel::new(
            false, true, false,
        )));

        let mut tok = Tokenizer::new(bpe);
        tok.with_pre_tokenizer(Some(Sequence::new(pre_tokenizers)));
        tok.with_decoder(Some(DecoderWrapper::ByteLevel(ByteLevel::new(
            false, true, false,
        ))));

        // Control tokens are special (split out of the text, skippable on decode);
        // user-defined ones are split out of the text too but always decoded.
        let added: Vec<AddedToken> = (0..n)
            .filter(|&i| types[i] == TYPE_CONTROL || types[i] == TYPE_USER_DEFINED)
            .map(|i| AddedToken::from(tokens[i], types[i] == TYPE_CONTROL).normalized(false))
            .collect();
        tok.add_tokens(added).map_err(TokenizerError::tokenizer)?;

        let token_id = |key: &str| -> Result<Option<u32>, TokenizerError> {
            match gguf.get(key) {
                None => Ok(None),
                Some(v) => match v.as_u64() {
                    Some(id) if (id as usize) < n => Ok(Some(id as u32)),
                    _ => Err(TokenizerError::Metadata(format!(
                        "{key} = {v:?} is not a token id below {n}"
                    ))),
                },
            }
        };
        let bos = token_id("tokenizer.ggml.bos_token_id")?;
        let eos_id = token_id("tokenizer.ggml.eos_token_id")?;
        let flag = |key: &str| gguf.get(key).and_then(MetaValue::as_bool).unwrap_or(false);
        let add_bos = flag("tokenizer.ggml.add_bos_token");
        let add_eos = flag("tokenizer.ggml.add_eos_token");
        if add_bos || add_eos {
            let mut single: Vec<String> = Vec::new();
            let mut specials: Vec<(String, u32)> = Vec::new();
            let mut add = |key: &str, id: Option<u32>| -> Result<String, TokenizerError> {
                let id = id.ok_or_else(|| {
                    TokenizerError::Metadata(format!(
                        "add_{key}_token is set but {key}_token_id is missing"
                    ))
                })?;
                specials.push((tokens[id as usize].to_string(), id));
                Ok(tokens[id as usize].to_string())
            };
            if add_bos {
                single.push(add("bos", bos)?);
            }
            single.push("$A".into());
            if add_eos {
                single.push(add("eos", eos_id)?);
            }
            let post = TemplateProcessing::builder()
                .try_single(single)
                .map_err(|e| TokenizerError::Tokenizer(e.to_string()))?
                .special_tokens(specials)
                .build()
                .map_err(|e| TokenizerError::Tokenizer(e.to_string()))?;
            tok.with_post_processor(Some(post));
        }

        let mut eos = Vec::new();
        for key in [
            "tokenizer.ggml.eos_token_id",
            "tokenizer.ggml.eot_token_id",
            "tokenizer.ggml.eom_token_id",
        ] {
            if let Some(id) = token_id(key)? {
                push_unique(&mut eos, id);
            }
        }
        for (i, t) in tokens.iter().enumerate() {
            if types[i] == TYPE_CONTROL && pdmesh_gguf::END_OF_TURN_TEXTS.contains(t) {
                push_unique(&mut eos, i as u32);
            }
        }

        let token_bytes = tokens
            .iter()
            .zip(&types)
            .map(|(t, &ty)| match ty {
                TYPE_CONTROL | TYPE_USER_DEFINED => t.as_bytes().to_vec(),
                _ => byte_level_decode(t),
            })
            .collect();

        let text = |id: Option<u32>| id.map(|i| tokens[i as usize].to_owned());
        Ok(Self {
            inner: Arc::new(tok),
            token_bytes: Arc::new(token_bytes),
            bos,
            eos,
            bos_text: text(bos),
            eos_text: text(eos_id),
        })
    }

    /// Token ids for `text`. Special-token strings in `text` (such as `<|im_start|>`) become
    /// their single special token, as llama.cpp does with `parse_special`. With
    /// `add_special_tokens`, BOS/EOS are added where the GGUF asks for them
    /// (`tokenizer.ggml.add_bos_token` / `add_eos_token`).
    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>, TokenizerError> {
        let enc = self
            .inner
            .encode_fast(text, add_special_tokens)
            .map_err(TokenizerError::tokenizer)?;
        Ok(enc.get_ids().to_vec())
    }

    /// The text of `ids`; with `skip_special`, control tokens (`<|im_end|>`, …) are left
    /// out. Byte sequences that are not valid UTF-8 become U+FFFD. Ids outside the
    /// vocabulary are an error.
    pub fn decode(&self, ids: &[u32], skip_special: bool) -> Result<String, TokenizerError> {
        self.check_ids(ids)?;
        self.inner
            .decode(ids, skip_special)
            .map_err(TokenizerError::tokenizer)
    }

    /// A streaming detokenizer over this tokenizer.
    pub fn detokenizer(&self, skip_special: bool) -> IncrementalDetokenizer {
        IncrementalDetokenizer::new(self.clone(), skip_special)
    }

    /// Number of token ids (the GGUF vocabulary, special tokens included).
    pub fn vocab_size(&self) -> usize {
        self.token_bytes.len()
    }

    pub fn bos_token_id(&self) -> Option<u32> {
        self.bos
    }

    /// Ids that end generation: the GGUF's EOS first, then its EOT/EOM ids and control
    /// tokens that are well-known end-of-turn markers (`<|im_end|>`, `<|endoftext|>`, …).
    pub fn eos_token_ids(&self) -> Vec<u32> {
        self.eos.clone()
    }

    /// For every id, the bytes it stands for in generated text: byte-level tokens decoded
    /// to raw bytes (possibly part of a UTF-8 character), special tokens as their text.
    pub fn token_bytes_table(&self) -> Vec<Vec<u8>> {
        self.token_bytes.as_ref().clone()
    }

    /// The bytes one id stands for (see [`Self::token_bytes_table`]); `None` outside the
    /// vocabulary.
    pub fn token_bytes(&self, id: u32) -> Option<&[u8]> {
        self.token_bytes.get(id as usize).map(Vec::as_slice)
    }

    /// A digest (hex SHA-256) of everything detokenization depends on: each id's bytes,
    /// which ids are special, and the decoder's configuration. Two tokenizers with the same
    /// fingerprint turn every id sequence into the same text.
    pub fn fingerprint(&self) -> String {
        use sha2::{Digest, Sha256};
        let mut h = Sha256::new();
        // The crate's former name: a new tag would tell two pdmesh versions' identical
        // tokenizers apart.
        h.update(b"pdmesh-text detokenize v1\0");
        h.update((self.token_bytes.len() as u64).to_le_bytes());
        for t in self.token_bytes.iter() {
            h.update((t.len() as u64).to_le_bytes());
            h.update(t);
        }
        let mut special: Vec<u32> = self
            .inner
            .get_added_tokens_decoder()
            .into_iter()
            .filter(|(_, t)| t.special)
            .map(|(id, _)| id)
            .collect();
        special.sort_unstable();
        h.update((special.len() as u64).to_le_bytes());
        for id in special {
            h.update(id.to_le_bytes());
        }
        // Serializing a decoder cannot fail (plain data); an error would hash as empty.
        h.update(serde_json::to_vec(&self.inner.get_decoder()).unwrap_or_default());
        h.finalize().iter().map(|b| format!("{b:02x}")).collect()
    }

    /// The text the tokenizer's files name as BOS: the BOS id's token in a GGUF,
    /// `bos_token` in `tokenizer_config.json`.
    pub fn bos_text(&self) -> Option<&str> {
        self.bos_text.as_deref()
    }

    /// The text the tokenizer's files name as EOS: `tokenizer.ggml.eos_token_id`'s token
    /// in a GGUF, `eos_token` in `tokenizer_config.json`.
    pub fn eos_text(&self) -> Option<&str> {
        self.eos_text.as_deref()
    }

    pub fn inner(&self) -> &Tokenizer {
        &self.inner
    }

    pub(crate) fn check_ids(&self, ids: &[u32]) -> Result<(), TokenizerError> {
        let vocab_size = self.vocab_size();
        match ids.iter().find(|&&id| id as usize >= vocab_size) {
            Some(&id) => Err(TokenizerError::UnknownTokenId { id, vocab_size }),
            None => Ok(()),
        }
    }
}

fn push_unique(v: &mut Vec<u32>, id: u32) {
    if !v.contains(&id) {
        v.push(id);
    }
}

/// `tokenizer.ggml.token_type`, or all-normal when absent.
fn token_types(gguf: &GgufFile, n: usize) -> Result<Vec<u64>, TokenizerError> {
    let Some(v) = gguf.get("tokenizer.ggml.token_type") else {
        return Ok(vec![1; n]);
    };
    let arr = v.as_array().ok_or_else(|| {
        TokenizerError::Metadata("tokenizer.ggml.token_type is not an array".into())
    })?;
    if arr.len() != n {
        return Err(TokenizerError::Metadata(format!(
            "tokenizer.ggml.token_type has {} entries for {n} tokens",
            arr.len()
        )));
    }
    arr.iter()
        .map(|t| {
            t.as_u64().ok_or_else(|| {
                TokenizerError::Metadata(format!("token type {t:?} is not a small integer"))
            })
        })
        .collect()
}

/// GPT-2's byte-to-printable-char table, inverted: the raw bytes a byte-level token
/// stands for. A char outside the table makes the whole token its UTF-8 text, as the
/// `tokenizers` ByteLevel decoder does.
fn byte_level_decode(token: &str) -> Vec<u8> {
    token
        .chars()
        .map(char_to_byte)
        .collect::<Option<Vec<u8>>>()
        .unwrap_or_else(|| token.as_bytes().to_vec())
}

fn is_printable_byte(b: u32) -> bool {
    (0x21..=0x7e).contains(&b) || (0xa1..=0xac).contains(&b) || (0xae..=0xff).contains(&b)
}

pub(crate) fn char_to_byte(c: char) -> Option<u8> {
    let c = c as u32;
    if is_printable_byte(c) {
        return Some(c as u8);
    }
    // The other bytes map, in order, to U+0100, U+0101, …
    let k = c.checked_sub(0x100)?;
    (0u32..256)
        .filter(|&b| !is_printable_byte(b))
        .nth(k as usize)
        .map(|b| b as u8)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_support::{tiny, tiny_gguf};

    /// Equal tokenizers share a fingerprint; one more special id, or one id's bytes
    /// changed, gives another.
    #[test]
    fn fingerprint_tells_detokenizers_apart() {
        let fp = tiny().fingerprint();
        assert_eq!(fp.len(), 64);
        assert_eq!(tiny().fingerprint(), fp);
        let with = |edit: fn(&mut Vec<MetaValue>), key: &'static str| {
            let (_dir, path) = tiny_gguf(|w| match w.meta_mut(key) {
                Some(MetaValue::Array(v)) => edit(v),
                other => panic!("{key} is {other:?}"),
            });
            TextTokenizer::from_path(&path).unwrap().fingerprint()
        };
        // `<tool>` (258) user-defined -> control.
        let special = with(|t| t[258] = MetaValue::I32(3), "tokenizer.ggml.token_type");
        let swapped = with(|t| t.swap(0x41, 0x42), "tokenizer.ggml.tokens");
        assert_ne!(special, fp);
        assert_ne!(swapped, fp);
        assert_ne!(special, swapped);
    }

    #[test]
    fn tiny_vocab_encodes_bytes_merges_and_specials() {
        let tok = tiny();
        assert_eq!(tok.vocab_size(), 261);
        assert_eq!(tok.encode("hi", false).unwrap(), [259]);
        assert_eq!(tok.encode(" hi", false).unwrap(), [260]);
        assert_eq!(tok.encode("é", false).unwrap(), [0xc3, 0xa9]);
        assert_eq!(
            tok.encode("<|im_start|>hi<tool><|im_end|>", false).unwrap(),
            [256, 259, 258, 257]
        );
        // Digits are split one by one before BPE.
        assert_eq!(tok.encode("12", false).unwrap(), [b'1' as u32, b'2' as u32]);
        // No BOS without add_bos_token, even when special tokens are requested.
        assert_eq!(tok.encode("hi", true).unwrap(), [259]);
        assert_eq!(
            tok.decode(&[256, 259, 258, 257], false).unwrap(),
            "<|im_start|>hi<tool><|im_end|>"
        );
        assert_eq!(tok.decode(&[256, 259, 258, 257], true).unwrap(), "hi<tool>");
        assert_eq!(tok.bos_token_id(), Some(256));
        assert_eq!(tok.eos_token_ids(), [257]);
        let table = tok.token_bytes_table();
        assert_eq!(table[0xc3], [0xc3]);
        assert_eq!(table[256], b"<|im_start|>");
        assert_eq!(table[260], b" hi");
    }

    #[test]
    fn add_bos_and_eos_flags_are_honoured() {
        let (_dir, path) = tiny_gguf(|w| {
            w.meta("tokenizer.ggml.add_bos_token", MetaValue::Bool(true))
                .meta("tokenizer.ggml.add_eos_token", MetaValue::Bool(true));
        });
        let tok = TextTokenizer::from_path(&path).unwrap();
        assert_eq!(tok.encode("hi", true).unwrap(), [256, 259, 257]);
        assert_eq!(tok.encode("hi", false).unwrap(), [259]);
    }

    #[test]
    fn out_of_range_ids_are_rejected() {
        let err = tiny().decode(&[1, 261], false).unwrap_err();
        assert!(
            matches!(
                err,
                TokenizerError::UnknownTokenId {
                    id: 261,
                    vocab_size: 261
                }
            ),
            "{err:?}"
        );
    }

    #[test]
    fn unsupported_tokenizers_give_clear_errors() {
        let (_dir, path) = tiny_gguf(|w| {
            w.meta("tokenizer.ggml.model", MetaValue::String("llama".into()));
        });
        let err = TextTokenizer::from_path(&path).unwrap_err();
        // The GGUF reader keeps the last value of a repeated key.
        assert_eq!(
            err.to_string(),
            "tokenizer model \"llama\" is not supported (pdmesh-tokenize supports \"gpt2\" byte-level BPE)"
        );

        let (_dir, path) = tiny_gguf(|w| {
            w.meta("tokenizer.ggml.pre", MetaValue::String("qwen2".into()));
        });
        let err = TextTokenizer::from_path(&path).unwrap_err();
        assert!(
            matches!(err, TokenizerError::UnsupportedPreTokenizer(ref p) if p == "qwen2"),
            "{err:?}"
        );
        assert!(err.to_string().contains("smollm"), "{err}");
    }

    #[test]
    fn byte_level_table_inverts_gpt2_alphabet() {
        assert_eq!(byte_level_decode("Ġthe"), b" the");
        assert_eq!(byte_level_decode("Ċ"), b"\n");
        assert_eq!(byte_level_decode("ĉ"), b"\t");
        assert_eq!(byte_level_decode("Ā"), [0u8]);
        assert_eq!(byte_level_decode("ł"), [0xa0u8]);
        assert_eq!(byte_level_decode("Ń"), [0xadu8]);
        // 'é' is U+00E9, itself a printable byte: a lone 0xE9 byte, not UTF-8 "é".
        assert_eq!(byte_level_decode("é"), [0xe9u8]);
        // Every one of the 256 bytes has exactly one char.
        let mut seen: Vec<u8> = (0x21..0x200)
            .filter_map(|c| char_to_byte(char::from_u32(c).unwrap()))
            .collect();
        seen.sort();
        assert_eq!(seen, (0..=255u8).collect::<Vec<_>>());
        // Out of the alphabet: taken as its own UTF-8 text.
        assert_eq!(byte_level_decode("a\u{3000}"), "a\u{3000}".as_bytes());
    }
}
