//! `TextTokenizer`: a `tokenizers::Tokenizer` assembled from a GGUF file's
//! `tokenizer.ggml.*` metadata the way llama.cpp reads it, so pdmesh never needs a
//! separate tokenizer.json and produces the same token ids as llama.cpp: byte-level BPE
//! (`tokenizer.ggml.model == "gpt2"`, SmolLM2) and SentencePiece BPE (`"llama"`, Gemma 3).

use std::path::Path;
use std::sync::Arc;

use pdmesh_gguf::{GgufFile, MetaValue};
use tokenizers::decoders::DecoderWrapper;
use tokenizers::decoders::byte_fallback::ByteFallback;
use tokenizers::decoders::fuse::Fuse;
use tokenizers::decoders::sequence::Sequence as DecoderSequence;
use tokenizers::models::ModelWrapper;
use tokenizers::models::bpe::{BPE, Vocab};
use tokenizers::normalizers::replace::Replace;
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

/// `tokenizer.ggml.model` values this crate reproduces.
pub(crate) const SUPPORTED_MODELS: &[&str] = &["gpt2", "llama"];

/// GGUF `tokenizer.ggml.token_type` values (llama.cpp's `llama_token_type`).
const TYPE_UNKNOWN: u64 = 2;
const TYPE_CONTROL: u64 = 3;
const TYPE_USER_DEFINED: u64 = 4;

/// SentencePiece's visible space: llama.cpp writes every ' ' of the text as U+2581 before
/// looking up pieces, and turns it back into ' ' when printing a normal token.
const SPM_SPACE: &str = "\u{2581}";

/// Whether llama.cpp treats tokens of type `ty` as control tokens: split out of the text
/// only when parsing special tokens, and printed only when asked to. llama.cpp puts
/// `<unk>`-typed tokens (SentencePiece vocabularies have them) in the same class.
fn is_control(ty: u64) -> bool {
    ty == TYPE_CONTROL || ty == TYPE_UNKNOWN
}

/// Whether tokens of type `ty` are taken out of the text before the model sees it, and
/// printed as they are written: control and user-defined tokens.
fn is_added(ty: u64) -> bool {
    is_control(ty) || ty == TYPE_USER_DEFINED
}

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
        // Byte fallback is what a SentencePiece vocabulary (▁ for spaces, `<0xNN>` byte
        // tokens) needs and a byte-level one never has: it tells the two alphabets apart.
        let sentencepiece = matches!(tok.get_model(), ModelWrapper::BPE(b) if b.byte_fallback);
        let token_bytes = (0..n as u32)
            .map(|id| match (specials.get(&id), tok.id_to_token(id)) {
                (Some(text), _) => text.as_bytes().to_vec(),
                (None, Some(t)) if sentencepiece => sentencepiece_bytes(&t),
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
        if !SUPPORTED_MODELS.contains(&model) {
            return Err(TokenizerError::UnsupportedModel(model.to_string()));
        }
        let tokens = gguf.get_str_array("tokenizer.ggml.tokens")?;
        let n = tokens.len();
        if n == 0 || n > u32::MAX as usize {
            return Err(TokenizerError::Metadata(format!(
                "tokenizer.ggml.tokens has {n} entries"
            )));
        }
        let types = token_types(gguf, n)?;
        let (mut tok, token_bytes) = if model == "llama" {
            sentencepiece_bpe(gguf, &tokens, &types)?
        } else {
            byte_level_bpe(gguf, &tokens, &types)?
        };

        // Control tokens are special (split out of the text, skippable on decode);
        // user-defined ones are split out of the text too but always decoded. Both are
        // matched in the raw text, before any normalization (for SentencePiece: before
        // spaces become ▁), as llama.cpp does. llama.cpp takes the longest such token
        // first throughout the text, `tokenizers` the leftmost-longest match: the two
        // differ only where one token's end overlaps another's start ("ab" and "bcd" in
        // "abcd"), which no supported vocabulary has (Gemma 3's runs of one whitespace
        // character and HTML tags do not).
        let added: Vec<AddedToken> = (0..n)
            .filter(|&i| is_added(types[i]))
            .map(|i| AddedToken::from(tokens[i], is_control(types[i])).normalized(false))
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
            if is_control(types[i]) && pdmesh_gguf::END_OF_TURN_TEXTS.contains(t) {
                push_unique(&mut eos, i as u32);
            }
        }

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

/// What each model kind contributes to a [`TextTokenizer`]: the `tokenizers` pipeline
/// (model, normalizer, pre-tokenizer, decoder) and the bytes of every id. Added tokens,
/// BOS/EOS and the end ids are the same for every kind and are set by the caller.
type ModelParts = (Tokenizer, Vec<Vec<u8>>);

/// `tokenizer.ggml.model == "gpt2"`: byte-level BPE with the GGUF's merge list, after
/// the regex split `tokenizer.ggml.pre` names.
fn byte_level_bpe(
    gguf: &GgufFile,
    tokens: &[&str],
    types: &[u64],
) -> Result<ModelParts, TokenizerError> {
    let pre = match gguf.get("tokenizer.ggml.pre") {
        Some(v) => v
            .as_str()
            .ok_or_else(|| TokenizerError::Metadata("tokenizer.ggml.pre is not a string".into()))?,
        None => return Err(TokenizerError::UnsupportedPreTokenizer("(missing)".into())),
    };
    let regexes: &[&str] = match pre {
        "smollm" => &PRE_TOKENIZER_SMOLLM,
        "gpt-2" => &PRE_TOKENIZER_GPT2,
        other => return Err(TokenizerError::UnsupportedPreTokenizer(other.to_string())),
    };
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
    let bpe = BPE::builder()
        .vocab_and_merges(vocab(tokens)?, merges)
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

    Ok((tok, bytes_table(tokens, types, byte_level_decode)))
}

/// Each token's bytes: control and user-defined tokens as they are written (llama.cpp
/// prints them so, with no unescaping), the others through `normal`.
fn bytes_table(tokens: &[&str], types: &[u64], normal: fn(&str) -> Vec<u8>) -> Vec<Vec<u8>> {
    tokens
        .iter()
        .zip(types)
        .map(|(t, &ty)| {
            if is_added(ty) {
                t.as_bytes().to_vec()
            } else {
                normal(t)
            }
        })
        .collect()
}

/// `tokenizer.ggml.model == "llama"`: a SentencePiece vocabulary (pieces with scores,
/// `▁` for spaces, `<0xNN>` byte tokens), tokenized as llama.cpp's `llm_tokenizer_spm`
/// does. llama.cpp's algorithm is BPE whose merges are implicit: starting from the
/// characters of the text (spaces written as `▁`, no pre-tokenizer split), it joins the
/// adjacent pair whose concatenation is a token with the best score, leftmost first, until
/// no pair is a token; characters no token covers become their UTF-8 bytes' `<0xNN>`
/// tokens. The `tokenizers` BPE model does exactly that given those merges ranked by
/// score ([`merges_from_scores`]) and `byte_fallback`.
///
/// `tokenizer.ggml.pre` plays no part for SentencePiece vocabularies (llama.cpp ignores
/// it). `tokenizer.ggml.add_space_prefix` (llama.cpp's default: true) would prefix every
/// run of text with a space and strip one on decoding; no supported model asks for it
/// (Gemma 3 does not), so it is refused rather than half supported.
fn sentencepiece_bpe(
    gguf: &GgufFile,
    tokens: &[&str],
    types: &[u64],
) -> Result<ModelParts, TokenizerError> {
    let space_prefix = match gguf.get("tokenizer.ggml.add_space_prefix") {
        None => true,
        Some(v) => v.as_bool().ok_or_else(|| {
            TokenizerError::Metadata("tokenizer.ggml.add_space_prefix is not a bool".into())
        })?,
    };
    if space_prefix {
        return Err(TokenizerError::UnsupportedModel(
            "llama with tokenizer.ggml.add_space_prefix".into(),
        ));
    }
    let scores = token_scores(gguf, tokens.len())?;
    let vocab = vocab(tokens)?;
    // Without every byte token, byte fallback would silently drop the characters it
    // cannot spell (llama.cpp throws on them).
    if let Some(b) = (0..=255u8).find(|b| !vocab.contains_key(&format!("<0x{b:02X}>"))) {
        return Err(TokenizerError::Metadata(format!(
            "the SentencePiece vocabulary has no byte token <0x{b:02X}>"
        )));
    }
    let merges = merges_from_scores(tokens, &scores, &vocab);
    let bpe = BPE::builder()
        .vocab_and_merges(vocab, merges)
        .byte_fallback(true)
        .build()
        .map_err(TokenizerError::tokenizer)?;

    let mut tok = Tokenizer::new(bpe);
    // Only ' ' is escaped (not tabs or newlines), as llama_escape_whitespace does.
    let escape = Replace::new(" ", SPM_SPACE).map_err(TokenizerError::tokenizer)?;
    tok.with_normalizer(Some(escape))
        .map_err(TokenizerError::tokenizer)?;
    // ▁ back to ' ', runs of byte tokens back to UTF-8 text, then one string. Nothing is
    // stripped: without add_space_prefix no space was added.
    let unescape = Replace::new(SPM_SPACE, " ").map_err(TokenizerError::tokenizer)?;
    tok.with_decoder(Some(DecoderSequence::new(vec![
        DecoderWrapper::Replace(unescape),
        DecoderWrapper::ByteFallback(ByteFallback::new()),
        DecoderWrapper::Fuse(Fuse::new()),
    ])));

    Ok((tok, bytes_table(tokens, types, sentencepiece_bytes)))
}

/// The merges that make the `tokenizers` BPE model behave as llama.cpp's SPM tokenizer:
/// every split of every token into two tokens (llama.cpp joins any adjacent pair whose
/// concatenation is in the vocabulary, whatever its type), ranked by the joined token's
/// score, best first.
///
/// llama.cpp breaks ties between equal scores by position (leftmost first); a BPE rank
/// cannot tie, so equal scores are ordered by token id, then by split point. Two
/// different tokens with equal scores never compete in Gemma 3: its normal tokens all
/// have distinct scores, and the tokens that share one (control and user-defined at
/// -1000, bytes at 0) are split out of the text before merging or have no split.
fn merges_from_scores(tokens: &[&str], scores: &[f32], vocab: &Vocab) -> Vec<(String, String)> {
    let mut found: Vec<(f32, usize, usize)> = Vec::new();
    for (id, t) in tokens.iter().enumerate() {
        for (at, _) in t.char_indices().skip(1) {
            if vocab.contains_key(&t[..at]) && vocab.contains_key(&t[at..]) {
                // -0.0 and 0.0 are equal scores for llama.cpp, not for total_cmp.
                let score = if scores[id] == 0.0 { 0.0 } else { scores[id] };
                found.push((score, id, at));
            }
        }
    }
    found.sort_unstable_by(|a, b| b.0.total_cmp(&a.0).then((a.1, a.2).cmp(&(b.1, b.2))));
    found
        .into_iter()
        .map(|(_, id, at)| (tokens[id][..at].to_string(), tokens[id][at..].to_string()))
        .collect()
}

/// Token text to id, refusing a token that appears twice (llama.cpp would keep only one
/// of them reachable).
fn vocab(tokens: &[&str]) -> Result<Vocab, TokenizerError> {
    let mut vocab = Vocab::with_capacity(tokens.len());
    for (id, t) in tokens.iter().enumerate() {
        if vocab.insert((*t).to_string(), id as u32).is_some() {
            return Err(TokenizerError::Metadata(format!(
                "token {t:?} appears twice in tokenizer.ggml.tokens"
            )));
        }
    }
    Ok(vocab)
}

/// `tokenizer.ggml.scores`, required: the merge order of a SentencePiece vocabulary.
fn token_scores(gguf: &GgufFile, n: usize) -> Result<Vec<f32>, TokenizerError> {
    let arr = gguf
        .get("tokenizer.ggml.scores")
        .and_then(MetaValue::as_array)
        .ok_or_else(|| {
            TokenizerError::Metadata("tokenizer.ggml.scores is missing or not an array".into())
        })?;
    if arr.len() != n {
        return Err(TokenizerError::Metadata(format!(
            "tokenizer.ggml.scores has {} entries for {n} tokens",
            arr.len()
        )));
    }
    arr.iter()
        .map(|s| match *s {
            MetaValue::F32(v) => Ok(v),
            _ => Err(TokenizerError::Metadata(format!(
                "token score {s:?} is not an f32"
            ))),
        })
        .collect()
}

/// The bytes a SentencePiece piece stands for: `<0xNN>` is the byte NN, any other piece
/// its text with `▁` as a space. The same rule as the `ByteFallback` and `Replace`
/// decoders, so these bytes are what `decode` gives.
fn sentencepiece_bytes(piece: &str) -> Vec<u8> {
    if piece.len() == 6
        && let Some(hex) = piece.strip_prefix("<0x").and_then(|r| r.strip_suffix('>'))
        && let Ok(b) = u8::from_str_radix(hex, 16)
    {
        return vec![b];
    }
    piece.replace(SPM_SPACE, " ").into_bytes()
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
    use crate::test_support::{tiny, tiny_gguf, tiny_spm, tiny_spm_gguf};

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
            w.meta("tokenizer.ggml.model", MetaValue::String("t5".into()));
        });
        let err = TextTokenizer::from_path(&path).unwrap_err();
        assert_eq!(
            err.to_string(),
            "tokenizer model \"t5\" is not supported (pdmesh-tokenize supports \"gpt2\" byte-level BPE and \"llama\" SentencePiece BPE without add_space_prefix)"
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

    // The ids the sentencepiece tests below expect are llama.cpp's (llama-cpp-python
    // 0.3.36, `tokenize(text, add_bos=False, special=True)`) for the same vocabulary.

    /// [`tiny_spm_gguf`]'s ids: `<0xNN>` is 9 + NN, then its pieces from 265.
    fn spm_byte(b: u8) -> u32 {
        9 + u32::from(b)
    }
    const SPACE: u32 = 265;
    const A: u32 = 266;
    const B: u32 = 267;
    const H: u32 = 269;
    const AB: u32 = 271;
    const BC: u32 = 272;
    const AA: u32 = 273;
    const HI: u32 = 274;
    const SPACE_HI: u32 = 275;

    /// llama.cpp's SPM rule: join the adjacent pair whose concatenation is the
    /// best-scored token, leftmost first; spaces are ▁ and there is no dummy prefix.
    #[test]
    fn sentencepiece_merges_by_score_leftmost_first() {
        let tok = tiny_spm();
        assert_eq!(tok.vocab_size(), 277);
        // "ab" has the lower id, "bc" the better score.
        assert_eq!(tok.encode("abc", false).unwrap(), [A, BC]);
        assert_eq!(tok.encode("ab", false).unwrap(), [AB]);
        // Equal scores (one merge, "a a"): leftmost first.
        assert_eq!(tok.encode("aaaaa", false).unwrap(), [AA, AA, A]);
        // "▁hi" comes from ▁ + hi once "hi" exists; "hi" alone gets no ▁ prefix.
        assert_eq!(tok.encode(" hi", false).unwrap(), [SPACE_HI]);
        assert_eq!(tok.encode("hi", false).unwrap(), [HI]);
        assert_eq!(tok.encode("a b", false).unwrap(), [A, SPACE, B]);
        assert_eq!(tok.encode("", false).unwrap(), Vec::<u32>::new());
    }

    #[test]
    fn sentencepiece_falls_back_to_bytes() {
        let tok = tiny_spm();
        // 'é' and '中' are no piece: their UTF-8 bytes, and no merge across them.
        assert_eq!(
            tok.encode("hé", false).unwrap(),
            [H, spm_byte(0xc3), spm_byte(0xa9)]
        );
        assert_eq!(
            tok.encode("a中b", false).unwrap(),
            [A, spm_byte(0xe4), spm_byte(0xb8), spm_byte(0xad), B]
        );
        // A tab is neither a piece nor escaped.
        assert_eq!(tok.encode("\t", false).unwrap(), [spm_byte(b'\t')]);
        // Text that spells a byte token is text.
        assert_eq!(
            tok.encode("<0x41>", false).unwrap(),
            "<0x41>".bytes().map(spm_byte).collect::<Vec<_>>()
        );
        assert_eq!(
            tok.decode(&[SPACE_HI, spm_byte(0xc3), spm_byte(0xa9)], false)
                .unwrap(),
            " hié"
        );
        // A character cut short decodes as U+FFFD per byte.
        assert_eq!(
            tok.decode(&[HI, spm_byte(0xe4)], false).unwrap(),
            "hi\u{fffd}"
        );
    }

    /// User-defined tokens are taken out of the raw text before spaces become ▁ (so two
    /// spaces are "  ", never the better-scored "▁▁"), longest first; control tokens too,
    /// and `<unk>`-typed ones count as control.
    #[test]
    fn sentencepiece_splits_user_defined_and_control_tokens_first() {
        let tok = tiny_spm();
        assert_eq!(tok.encode("a  b", false).unwrap(), [A, 7, B]);
        assert_eq!(tok.encode("a   b", false).unwrap(), [A, 7, SPACE, B]);
        assert_eq!(tok.encode("  hi", false).unwrap(), [7, HI]);
        assert_eq!(tok.encode("\n\n\nhi\n", false).unwrap(), [6, 5, HI, 5]);
        assert_eq!(tok.encode("<b>ab", false).unwrap(), [8, AB]);
        // A literal ▁▁ is not raw spaces: it merges like any text.
        assert_eq!(tok.encode("\u{2581}\u{2581}", false).unwrap(), [276]);
        assert_eq!(
            tok.encode("<bos>hi<end_of_turn><unk>", false).unwrap(),
            [2, HI, 4, 3]
        );
        assert_eq!(
            tok.decode(&[2, HI, 7, 6, 8, 4, 3], false).unwrap(),
            "<bos>hi  \n\n<b><end_of_turn><unk>"
        );
        assert_eq!(
            tok.decode(&[2, HI, 7, 6, 8, 4, 3], true).unwrap(),
            "hi  \n\n<b>"
        );
    }

    #[test]
    fn sentencepiece_special_ids_and_token_bytes() {
        let tok = tiny_spm();
        assert_eq!(tok.encode("hi", true).unwrap(), [2, HI]);
        assert_eq!(tok.bos_token_id(), Some(2));
        assert_eq!(tok.bos_text(), Some("<bos>"));
        assert_eq!(tok.eos_text(), Some("<eos>"));
        assert_eq!(tok.eos_token_ids(), [1, 4]);
        let table = tok.token_bytes_table();
        assert_eq!(table[spm_byte(0xc3) as usize], [0xc3]);
        assert_eq!(table[spm_byte(b' ') as usize], b" ");
        assert_eq!(table[SPACE as usize], b" ");
        assert_eq!(table[SPACE_HI as usize], b" hi");
        assert_eq!(table[276], b"  ");
        assert_eq!(table[2], b"<bos>");
        assert_eq!(table[3], b"<unk>");
        assert_eq!(table[7], b"  ");
        assert_eq!(table[6], b"\n\n");
        // The table spells what decode gives, id by id.
        for id in 0..tok.vocab_size() as u32 {
            let bytes = &table[id as usize];
            if let Ok(text) = std::str::from_utf8(bytes) {
                assert_eq!(tok.decode(&[id], false).unwrap(), text, "id {id}");
            }
        }
        assert!(matches!(
            tok.decode(&[277], false),
            Err(TokenizerError::UnknownTokenId {
                id: 277,
                vocab_size: 277
            })
        ));
    }

    #[test]
    fn sentencepiece_streams_split_characters_whole() {
        let tok = tiny_spm();
        let ids = tok.encode("<bos>hi 中", false).unwrap();
        let mut d = tok.detokenizer(true);
        let chunks: Vec<String> = ids.iter().map(|&id| d.push(&[id]).unwrap()).collect();
        assert_eq!(chunks, ["", "hi", " ", "", "", "中"]);
        assert_eq!(d.finish(), "");
    }

    #[test]
    fn sentencepiece_hf_directory_round_trips() {
        let dir = tempfile::tempdir().unwrap();
        let tok = tiny_spm();
        tok.write_hf_dir(dir.path()).unwrap();
        let hf = TextTokenizer::from_path(dir.path()).unwrap();
        for text in ["abc aaaaa", " hié\n\n  x", "<bos>hi<end_of_turn>"] {
            assert_eq!(
                hf.encode(text, true).unwrap(),
                tok.encode(text, true).unwrap()
            );
        }
        assert_eq!(hf.token_bytes_table(), tok.token_bytes_table());
        assert_eq!(hf.eos_token_ids(), tok.eos_token_ids());
        assert_eq!(hf.fingerprint(), tok.fingerprint());
    }

    #[test]
    fn sentencepiece_fingerprint_differs_from_byte_level() {
        let fp = tiny_spm().fingerprint();
        assert_eq!(tiny_spm().fingerprint(), fp);
        assert_ne!(tiny().fingerprint(), fp);
        // One piece spelled differently: other bytes, another fingerprint.
        let (_dir, path) = tiny_spm_gguf(|w| match w.meta_mut("tokenizer.ggml.tokens") {
            Some(MetaValue::Array(t)) => t[276] = MetaValue::String("\u{2581}x".into()),
            other => panic!("tokens are {other:?}"),
        });
        assert_ne!(TextTokenizer::from_path(&path).unwrap().fingerprint(), fp);
    }

    #[test]
    fn sentencepiece_metadata_llama_cpp_reads_otherwise_is_refused() {
        let refused = |edit: fn(&mut pdmesh_gguf::GgufWriter)| {
            let (_dir, path) = tiny_spm_gguf(edit);
            TextTokenizer::from_path(&path).unwrap_err()
        };
        // llama.cpp's default is a space prefix, which this crate does not do.
        for err in [
            refused(|w| {
                w.meta("tokenizer.ggml.add_space_prefix", MetaValue::Bool(true));
            }),
            // The key left out altogether.
            refused(|w| {
                let mut fresh = pdmesh_gguf::GgufWriter::new();
                for key in [
                    "tokenizer.ggml.model",
                    "tokenizer.ggml.tokens",
                    "tokenizer.ggml.scores",
                    "tokenizer.ggml.token_type",
                ] {
                    fresh.meta(key, w.meta_mut(key).unwrap().clone());
                }
                *w = fresh;
            }),
        ] {
            assert!(
                matches!(err, TokenizerError::UnsupportedModel(ref m) if m.contains("add_space_prefix")),
                "{err:?}"
            );
        }
        let err = refused(|w| {
            w.meta("tokenizer.ggml.scores", MetaValue::Array(Vec::new()));
        });
        assert!(err.to_string().contains("tokenizer.ggml.scores"), "{err}");
        let err = refused(|w| match w.meta_mut("tokenizer.ggml.tokens") {
            Some(MetaValue::Array(t)) => t[9 + 0x80] = MetaValue::String("x".into()),
            other => panic!("tokens are {other:?}"),
        });
        assert!(err.to_string().contains("<0x80>"), "{err}");
    }
}
