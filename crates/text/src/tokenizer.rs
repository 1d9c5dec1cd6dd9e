//! `TextTokenizer`: a `tokenizers::Tokenizer` assembled from a GGUF file's
//! `tokenizer.ggml.*` metadata the way llama.cpp reads it, so pdmesh never needs a
//! separate tokenizer.json and produces the same token ids as llama.cpp.

use std::path::Path;
use std::sync::{Arc, OnceLock};

use pdmesh_gguf::{GgufFile, MetaValue};
use tokenizers::decoders::DecoderWrapper;
use tokenizers::models::bpe::{BPE, Vocab};
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::processors::template::TemplateProcessing;
use tokenizers::{AddedToken, PreTokenizerWrapper, SplitDelimiterBehavior, Tokenizer};

use crate::prompt::{self, ChatPrompt, Literal};
use crate::{ChatMessage, ChatTemplate, IncrementalDetokenizer, TextError, ToolFormat};

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

/// Control-token texts that end a turn; llama.cpp treats them as end-of-generation too.
const END_OF_TURN_TEXTS: &[&str] = &[
    "<|im_end|>",
    "<|endoftext|>",
    "<|eot_id|>",
    "<|eom_id|>",
    "<|end|>",
    "<end_of_turn>",
    "<|end_of_text|>",
    "<EOT>",
];

/// A GGUF model's tokenizer. Cheap to clone; `Send + Sync`.
#[derive(Clone)]
pub struct TextTokenizer {
    inner: Arc<Tokenizer>,
    /// Raw bytes of each id, for byte-level stop matching.
    token_bytes: Arc<Vec<Vec<u8>>>,
    bos: Option<u32>,
    eos: Vec<u32>,
    chat_template: Option<Arc<ChatTemplate>>,
    /// DeepSeek V3.2's encoding rules instead of a template ([`crate::dsv32`]).
    deepseek_v32: bool,
    /// The plain-text tokenizer chat prompts use for request text, made on first need.
    literal: Arc<OnceLock<Literal>>,
}

/// How a conversation becomes a prompt for this model.
#[derive(Clone, Copy, Debug)]
pub enum ChatFormat<'a> {
    /// The tokenizer's Jinja chat template.
    Template(&'a ChatTemplate),
    /// DeepSeek V3.2's rules ([`crate::dsv32::encode`]).
    DeepSeekV32,
    /// Neither: chat requests cannot be served.
    None,
}

impl ChatFormat<'_> {
    /// The tool-call markup this format asks the model to write: DSML for DeepSeek V3.2,
    /// [`ChatTemplate::tool_format`] for a template, `None` without a chat format.
    pub fn tool_format(&self) -> Option<ToolFormat> {
        match self {
            Self::Template(t) => Some(t.tool_format()),
            Self::DeepSeekV32 => Some(ToolFormat::Dsml),
            Self::None => None,
        }
    }

    /// Whether the model reasons in `<think>…</think>` tags: always for DeepSeek V3.2,
    /// [`ChatTemplate::reasoning`] for a template, never without a chat format.
    pub fn reasoning(&self) -> bool {
        match self {
            Self::Template(t) => t.reasoning(),
            Self::DeepSeekV32 => true,
            Self::None => false,
        }
    }
}

impl std::fmt::Debug for TextTokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TextTokenizer")
            .field("vocab_size", &self.vocab_size())
            .field("bos", &self.bos)
            .field("eos", &self.eos)
            .field("chat_template", &self.chat_template.is_some())
            .finish()
    }
}

impl TextTokenizer {
    /// Builds the tokenizer of the model at `path`: a GGUF file, or a directory holding
    /// an HF checkpoint's `tokenizer.json` and `tokenizer_config.json`.
    pub fn from_path(path: impl AsRef<Path>) -> Result<Self, TextError> {
        let path = path.as_ref();
        if path.is_dir() {
            return Self::from_hf_dir(path);
        }
        Self::from_gguf(&GgufFile::open(path)?)
    }

    /// An HF tokenizer directory: `tokenizer.json` (a byte-level BPE) and
    /// `tokenizer_config.json` (`bos_token`, `eos_token`, `chat_template`, all optional).
    pub fn from_hf_dir(dir: &Path) -> Result<Self, TextError> {
        let meta =
            |e: &dyn std::fmt::Display| TextError::Metadata(format!("{}: {e}", dir.display()));
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
            .filter(|(_, t)| END_OF_TURN_TEXTS.contains(&t.as_str()))
            .collect();
        ends.sort();
        for (&id, _) in ends {
            push_unique(&mut eos, id);
        }
        let chat_template = match config["chat_template"].as_str() {
            None => None,
            Some(src) => Some(Arc::new(ChatTemplate::new(
                src,
                bos_text.as_deref().unwrap_or(""),
                eos_text.as_deref().unwrap_or(""),
            )?)),
        };
        Ok(Self {
            inner: Arc::new(tok),
            token_bytes: Arc::new(token_bytes),
            bos,
            eos,
            // A DeepSeek V3.2 checkpoint ships no template: its prompts follow rules.
            deepseek_v32: config["chat_template"].is_null() && is_deepseek_v32(dir),
            chat_template,
            literal: Arc::default(),
        })
    }

    /// How chat requests become prompts: the template, else DeepSeek V3.2's rules for a
    /// `deepseek_v32` checkpoint without one.
    pub fn chat_format(&self) -> ChatFormat<'_> {
        match (&self.chat_template, self.deepseek_v32) {
            (Some(t), _) => ChatFormat::Template(t),
            (None, true) => ChatFormat::DeepSeekV32,
            (None, false) => ChatFormat::None,
        }
    }

    /// Writes this tokenizer as an HF directory ([`Self::from_hf_dir`] reads it back), with
    /// its chat template or without (a model whose prompts follow other rules).
    pub fn write_hf_dir(&self, dir: &Path, with_template: bool) -> Result<(), TextError> {
        let meta =
            |e: &dyn std::fmt::Display| TextError::Metadata(format!("{}: {e}", dir.display()));
        std::fs::create_dir_all(dir).map_err(|e| meta(&e))?;
        self.inner
            .save(dir.join("tokenizer.json"), false)
            .map_err(TextError::tokenizer)?;
        let text = |id: Option<u32>| id.and_then(|i| self.inner.id_to_token(i));
        let mut config = serde_json::json!({
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": text(self.bos),
            "eos_token": text(self.eos.first().copied()),
        });
        if let Some(t) = self.chat_template.as_ref().filter(|_| with_template) {
            config["chat_template"] = t.source().into();
        }
        let json = serde_json::to_string_pretty(&config).map_err(|e| meta(&e))?;
        std::fs::write(dir.join("tokenizer_config.json"), json).map_err(|e| meta(&e))
    }

    /// Builds the tokenizer described by `gguf`'s `tokenizer.*` metadata.
    pub fn from_gguf(gguf: &GgufFile) -> Result<Self, TextError> {
        let model = gguf.get_str("tokenizer.ggml.model")?;
        if model != "gpt2" {
            return Err(TextError::UnsupportedModel(model.to_string()));
        }
        let pre = match gguf.get("tokenizer.ggml.pre") {
            Some(v) => v
                .as_str()
                .ok_or_else(|| TextError::Metadata("tokenizer.ggml.pre is not a string".into()))?,
            None => return Err(TextError::UnsupportedPreTokenizer("(missing)".into())),
        };
        let regexes: &[&str] = match pre {
            "smollm" => &PRE_TOKENIZER_SMOLLM,
            "gpt-2" => &PRE_TOKENIZER_GPT2,
            other => return Err(TextError::UnsupportedPreTokenizer(other.to_string())),
        };

        let tokens = gguf.get_str_array("tokenizer.ggml.tokens")?;
        let n = tokens.len();
        if n == 0 || n > u32::MAX as usize {
            return Err(TextError::Metadata(format!(
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
                        TextError::Metadata(format!(
                            "merge {m:?} is not two space-separated tokens"
                        ))
                    })
            })
            .collect::<Result<Vec<_>, _>>()?;

        let mut vocab = Vocab::with_capacity(n);
        for (id, t) in tokens.iter().enumerate() {
            if vocab.insert((*t).to_string(), id as u32).is_some() {
                return Err(TextError::Metadata(format!(
                    "token {t:?} appears twice in tokenizer.ggml.tokens"
                )));
            }
        }
        let bpe = BPE::builder()
            .vocab_and_merges(vocab, merges)
            .build()
            .map_err(TextError::tokenizer)?;

        let mut pre_tokenizers = Vec::with_capacity(regexes.len() + 1);
        for r in regexes {
            let split = Split::new(
                SplitPattern::Regex((*r).to_string()),
                SplitDelimiterBehavior::Isolated,
                false,
            )
            .map_err(TextError::tokenizer)?;
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
        tok.add_tokens(added).map_err(TextError::tokenizer)?;

        let token_id = |key: &str| -> Result<Option<u32>, TextError> {
            match gguf.get(key) {
                None => Ok(None),
                Some(v) => match v.as_u64() {
                    Some(id) if (id as usize) < n => Ok(Some(id as u32)),
                    _ => Err(TextError::Metadata(format!(
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
            let mut add = |key: &str, id: Option<u32>| -> Result<String, TextError> {
                let id = id.ok_or_else(|| {
                    TextError::Metadata(format!(
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
                .map_err(|e| TextError::Tokenizer(e.to_string()))?
                .special_tokens(specials)
                .build()
                .map_err(|e| TextError::Tokenizer(e.to_string()))?;
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
            if types[i] == TYPE_CONTROL && END_OF_TURN_TEXTS.contains(t) {
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

        let chat_template = match gguf.get("tokenizer.chat_template") {
            None => None,
            Some(v) => {
                let src = v.as_str().ok_or_else(|| {
                    TextError::Metadata("tokenizer.chat_template is not a string".into())
                })?;
                let text = |id: Option<u32>| id.map(|i| tokens[i as usize]).unwrap_or("");
                Some(Arc::new(ChatTemplate::new(src, text(bos), text(eos_id))?))
            }
        };

        Ok(Self {
            inner: Arc::new(tok),
            token_bytes: Arc::new(token_bytes),
            bos,
            eos,
            chat_template,
            deepseek_v32: false,
            literal: Arc::default(),
        })
    }

    /// Token ids for `text`. Special-token strings in `text` (such as `<|im_start|>`) become
    /// their single special token, as llama.cpp does with `parse_special`. With
    /// `add_special_tokens`, BOS/EOS are added where the GGUF asks for them
    /// (`tokenizer.ggml.add_bos_token` / `add_eos_token`).
    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>, TextError> {
        let enc = self
            .inner
            .encode_fast(text, add_special_tokens)
            .map_err(TextError::tokenizer)?;
        Ok(enc.get_ids().to_vec())
    }

    /// The prompt for a conversation in this model's [chat format](Self::chat_format),
    /// with `tools` (a JSON list of tool definitions) when given. Only the format's own
    /// markup becomes control tokens: every string from the request is tokenized as
    /// text, so a message holding `<|im_end|>` cannot end its turn. `add_generation_prompt` appends the header that opens the assistant's
    /// turn (DeepSeek V3.2's prompt always ends there); `thinking` opens DeepSeek V3.2's
    /// reasoning.
    pub fn chat_prompt(
        &self,
        messages: &[ChatMessage],
        tools: Option<&serde_json::Value>,
        add_generation_prompt: bool,
        thinking: bool,
    ) -> Result<ChatPrompt, TextError> {
        prompt::chat_prompt(self, messages, tools, add_generation_prompt, thinking)
    }

    /// What [`Self::chat_prompt`] needs beyond the tokenizer, made on its first call.
    pub(crate) fn literal(&self) -> Result<&Literal, TextError> {
        if let Some(l) = self.literal.get() {
            return Ok(l);
        }
        let made = Literal::new(&self.inner)?;
        Ok(self.literal.get_or_init(|| made))
    }

    /// The text of `ids`; with `skip_special`, control tokens (`<|im_end|>`, …) are left
    /// out. Byte sequences that are not valid UTF-8 become U+FFFD. Ids outside the
    /// vocabulary are an error.
    pub fn decode(&self, ids: &[u32], skip_special: bool) -> Result<String, TextError> {
        self.check_ids(ids)?;
        self.inner
            .decode(ids, skip_special)
            .map_err(TextError::tokenizer)
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

    /// The model's chat template (`tokenizer.chat_template`), if the GGUF has one.
    pub fn chat_template(&self) -> Option<&ChatTemplate> {
        self.chat_template.as_deref()
    }

    pub fn inner(&self) -> &Tokenizer {
        &self.inner
    }

    pub(crate) fn check_ids(&self, ids: &[u32]) -> Result<(), TextError> {
        let vocab_size = self.vocab_size();
        match ids.iter().find(|&&id| id as usize >= vocab_size) {
            Some(&id) => Err(TextError::UnknownTokenId { id, vocab_size }),
            None => Ok(()),
        }
    }
}

/// Whether `dir` holds a `deepseek_v32` checkpoint (its `config.json` says so).
fn is_deepseek_v32(dir: &Path) -> bool {
    std::fs::read_to_string(dir.join("config.json"))
        .ok()
        .and_then(|t| serde_json::from_str::<serde_json::Value>(&t).ok())
        .is_some_and(|c| c["model_type"] == "deepseek_v32")
}

fn push_unique(v: &mut Vec<u32>, id: u32) {
    if !v.contains(&id) {
        v.push(id);
    }
}

/// `tokenizer.ggml.token_type`, or all-normal when absent.
fn token_types(gguf: &GgufFile, n: usize) -> Result<Vec<u64>, TextError> {
    let Some(v) = gguf.get("tokenizer.ggml.token_type") else {
        return Ok(vec![1; n]);
    };
    let arr = v
        .as_array()
        .ok_or_else(|| TextError::Metadata("tokenizer.ggml.token_type is not an array".into()))?;
    if arr.len() != n {
        return Err(TextError::Metadata(format!(
            "tokenizer.ggml.token_type has {} entries for {n} tokens",
            arr.len()
        )));
    }
    arr.iter()
        .map(|t| {
            t.as_u64().ok_or_else(|| {
                TextError::Metadata(format!("token type {t:?} is not a small integer"))
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

fn char_to_byte(c: char) -> Option<u8> {
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
pub(crate) mod tests {
    use super::*;
    use pdmesh_gguf::GgufWriter;

    fn byte_to_char(b: u8) -> char {
        (0x21..0x200u32)
            .filter_map(char::from_u32)
            .find(|&c| char_to_byte(c) == Some(b))
            .unwrap()
    }

    /// A real GGUF with a tiny byte-level vocabulary: ids 0..256 are the 256 bytes, then
    /// `<|im_start|>` (256), `<|im_end|>` (257) as control tokens, `<tool>` (258)
    /// user-defined, and the merges `h i` → `hi` (259), `Ġ hi` → `Ġhi` (260).
    pub(crate) fn tiny_gguf(
        edit: impl FnOnce(&mut GgufWriter),
    ) -> (tempfile::TempDir, std::path::PathBuf) {
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
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("tiny.gguf");
        w.write_to(&path).unwrap();
        (dir, path)
    }

    pub(crate) fn tiny() -> TextTokenizer {
        let (_dir, path) = tiny_gguf(|_| {});
        TextTokenizer::from_path(&path).unwrap()
    }

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
    fn chat_formats_name_their_tool_markup_and_reasoning() {
        assert_eq!(
            ChatFormat::DeepSeekV32.tool_format(),
            Some(ToolFormat::Dsml)
        );
        assert!(ChatFormat::DeepSeekV32.reasoning());
        assert_eq!(ChatFormat::None.tool_format(), None);
        assert!(!ChatFormat::None.reasoning());
        let chatml = ChatTemplate::new(
            "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}",
            "",
            "",
        )
        .unwrap();
        assert_eq!(
            ChatFormat::Template(&chatml).tool_format(),
            Some(ToolFormat::Hermes)
        );
        assert!(!ChatFormat::Template(&chatml).reasoning());
        let v3 = ChatTemplate::new(
            "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>{{ x }}<think>",
            "",
            "",
        )
        .unwrap();
        assert_eq!(
            ChatFormat::Template(&v3).tool_format(),
            Some(ToolFormat::DeepSeekV3)
        );
        assert!(ChatFormat::Template(&v3).reasoning());
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
                TextError::UnknownTokenId {
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
            "tokenizer model \"llama\" is not supported (pdmesh-text supports \"gpt2\" byte-level BPE)"
        );

        let (_dir, path) = tiny_gguf(|w| {
            w.meta("tokenizer.ggml.pre", MetaValue::String("qwen2".into()));
        });
        let err = TextTokenizer::from_path(&path).unwrap_err();
        assert!(
            matches!(err, TextError::UnsupportedPreTokenizer(ref p) if p == "qwen2"),
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
