//! The tokenizer files a gateway needs to speak to this worker in token ids: an HF
//! directory (`tokenizer.json`, `tokenizer_config.json` with the chat template,
//! `config.json`) made from the model (a GGUF's metadata, or a checkpoint directory's own
//! files), written once under the cache directory and also served as a zip with its
//! SHA-256 (SGLang's `GetTokenizer`). The worker writes these files; it never tokenizes.

use std::io::Write;
use std::path::{Path, PathBuf};

use pdmesh_engine::ModelInfo;
use sha2::{Digest, Sha256};

use crate::error::Error;

/// What `GetTokenizer` streams and `GetModelInfo.tokenizer_path` names.
#[derive(Clone, Debug)]
pub(crate) struct TokenizerBundle {
    /// The HF tokenizer directory.
    pub dir: PathBuf,
    /// Its files zipped (stored uncompressed: tokenizers compress well, but a gateway
    /// reads this once).
    pub zip: Vec<u8>,
    /// Lowercase hex SHA-256 of `zip`.
    pub sha256: String,
}

/// The files, in the order they are zipped.
const FILES: [&str; 3] = ["tokenizer.json", "tokenizer_config.json", "config.json"];

fn err(what: impl std::fmt::Display) -> Error {
    Error::Config(format!("tokenizer bundle: {what}"))
}

/// Writes (or rewrites) the bundle for `model` into `dir` and zips it. `info` gives the
/// facts `config.json` records for a GGUF (a checkpoint directory has its own).
pub(crate) fn build(model: &Path, dir: &Path, info: &ModelInfo) -> Result<TokenizerBundle, Error> {
    let tok = pdmesh_chat::ChatTokenizer::from_path(model).map_err(err)?;
    // Written aside, then each file renamed into place: workers of one model (a prefill
    // and a decode) may build the bundle at once, and a reader never sees half a file.
    std::fs::create_dir_all(dir).map_err(err)?;
    let staging = tempfile::Builder::new()
        .prefix(".staging-")
        .tempdir_in(dir)
        .map_err(err)?;
    tok.write_hf_dir(staging.path(), true).map_err(err)?;
    let config = if model.is_dir() {
        std::fs::read(model.join("config.json"))
            .map_err(|e| err(format!("{}/config.json: {e}", model.display())))?
    } else {
        let c = serde_json::json!({
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "vocab_size": info.vocab_size,
            "max_position_embeddings": info.context_length,
            "bos_token_id": tok.tokenizer().bos_token_id(),
            "eos_token_id": info.eos_token_ids.first(),
        });
        serde_json::to_vec_pretty(&c).map_err(err)?
    };
    std::fs::write(staging.path().join("config.json"), config).map_err(err)?;
    for name in FILES {
        std::fs::rename(staging.path().join(name), dir.join(name)).map_err(err)?;
    }
    let mut zip = zip::ZipWriter::new(std::io::Cursor::new(Vec::new()));
    let opts =
        zip::write::SimpleFileOptions::default().compression_method(zip::CompressionMethod::Stored);
    for name in FILES {
        let bytes = std::fs::read(dir.join(name)).map_err(err)?;
        zip.start_file(name, opts).map_err(err)?;
        zip.write_all(&bytes).map_err(err)?;
    }
    let zip = zip.finish().map_err(err)?.into_inner();
    let sha256 = Sha256::digest(&zip)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    Ok(TokenizerBundle {
        dir: dir.to_path_buf(),
        zip,
        sha256,
    })
}

/// Where a model's bundle lives: under the cache directory, named by the model file's
/// stem and a hash of its full path (two models with one name do not collide).
pub(crate) fn default_dir(model: &Path) -> PathBuf {
    let stem = model
        .file_name()
        .and_then(|n| n.to_str())
        .and_then(|n| n.split('.').next())
        .unwrap_or("model");
    let hash = Sha256::digest(model.to_string_lossy().as_bytes());
    let tag: String = hash[..4].iter().map(|b| format!("{b:02x}")).collect();
    pdmesh_gguf::models::cache_dir()
        .join("tokenizers")
        .join(format!("{stem}-{tag}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_bundle_is_an_hf_directory_and_its_zip_checks_out() {
        let model = pdmesh_gguf::models::require_default_model();
        let tmp = tempfile::tempdir().unwrap();
        let info = ModelInfo {
            model_id: "m".into(),
            context_length: 8192,
            vocab_size: 49152,
            eos_token_ids: vec![2],
            kv_layout: String::new(),
            kv_layout_fingerprint: String::new(),
            page_size: 16,
            total_pages: 1,
            max_batch: 1,
        };
        let b = build(&model, tmp.path(), &info).unwrap();
        // The directory reads back as the same tokenizer, chat template included.
        let back = pdmesh_chat::ChatTokenizer::from_hf_dir(&b.dir).unwrap();
        let orig = pdmesh_chat::ChatTokenizer::from_path(&model).unwrap();
        let text = "Hello, <|im_start|>world ünïcödé";
        assert_eq!(
            back.tokenizer().encode(text, false).unwrap(),
            orig.tokenizer().encode(text, false).unwrap()
        );
        assert!(back.chat_template().is_some());
        let config: serde_json::Value =
            serde_json::from_slice(&std::fs::read(b.dir.join("config.json")).unwrap()).unwrap();
        assert_eq!(config["max_position_embeddings"], 8192);
        // The zip holds the three files byte for byte, and the hash is the zip's.
        let mut z = zip::ZipArchive::new(std::io::Cursor::new(&b.zip)).unwrap();
        assert_eq!(z.len(), 3);
        for name in FILES {
            let mut f = z.by_name(name).unwrap();
            let mut got = Vec::new();
            std::io::Read::read_to_end(&mut f, &mut got).unwrap();
            assert_eq!(got, std::fs::read(b.dir.join(name)).unwrap(), "{name}");
        }
        assert_eq!(b.sha256.len(), 64);
        let again = build(&model, tmp.path(), &info).unwrap();
        assert_eq!(again.sha256, b.sha256, "deterministic");
    }
}
