//! What a worker serves, as its cache service names disk-tier pages by it: the model's
//! name and a digest of its weights. Two models of one shape (a base and its fine-tune)
//! have the same KV layout, so the layout alone would let one load the other's pages
//! after a restart; the digest tells them apart.
//!
//! Hashing every byte of a large model at each start would take minutes, so the digest
//! covers each weights file's name and length and evenly spaced samples of its bytes
//! (the whole file when it is small). A fine-tune changes the weights throughout, and
//! with many samples some land on changed bytes.

use std::fs::File;
use std::io::{Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};

/// Samples taken from each weights file.
const SAMPLES: u64 = 256;
/// Bytes of each sample.
const SAMPLE_BYTES: u64 = 4096;

/// `<model_id>#<16 hex digits>`: the model's name and its weights' digest.
pub fn model_identity(model_id: &str, path: &Path) -> std::io::Result<String> {
    let mut h = xxhash_rust::xxh3::Xxh3::new();
    for f in weight_files(path)? {
        let name = f.file_name().map(|n| n.to_string_lossy().into_owned());
        h.update(name.unwrap_or_default().as_bytes());
        sample(&f, &mut h)?;
    }
    Ok(format!("{model_id}#{:016x}", h.digest()))
}

/// The model's files that decide its weights: the file itself, or a folder's
/// `.safetensors`, `.gguf` and `.json` files, by name.
fn weight_files(path: &Path) -> std::io::Result<Vec<PathBuf>> {
    if !path.is_dir() {
        return Ok(vec![path.to_owned()]);
    }
    let mut out: Vec<PathBuf> = std::fs::read_dir(path)?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| {
            p.is_file()
                && p.extension()
                    .is_some_and(|x| x == "safetensors" || x == "gguf" || x == "json")
        })
        .collect();
    out.sort();
    Ok(out)
}

fn sample(path: &Path, h: &mut xxhash_rust::xxh3::Xxh3) -> std::io::Result<()> {
    let mut f = File::open(path)?;
    let len = f.metadata()?.len();
    h.update(&len.to_le_bytes());
    let mut buf = vec![0u8; SAMPLE_BYTES as usize];
    if len <= SAMPLES * SAMPLE_BYTES {
        let mut all = Vec::with_capacity(len as usize);
        f.read_to_end(&mut all)?;
        h.update(&all);
        return Ok(());
    }
    for i in 0..SAMPLES {
        let at = i * (len - SAMPLE_BYTES) / (SAMPLES - 1);
        f.seek(SeekFrom::Start(at))?;
        f.read_exact(&mut buf)?;
        h.update(&buf);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_changed_weight_byte_changes_the_identity_and_a_copy_keeps_it() {
        let dir = tempfile::tempdir().unwrap();
        let weights: Vec<u8> = (0..3 << 20).map(|i: u32| (i * 7 + i / 251) as u8).collect();
        let a = dir.path().join("a.gguf");
        std::fs::write(&a, &weights).unwrap();
        let first = model_identity("m", &a).unwrap();
        assert!(first.starts_with("m#") && first.len() == 2 + 16, "{first}");
        // A copy under another folder: the same weights, the same identity.
        let other = tempfile::tempdir().unwrap();
        let b = other.path().join("a.gguf");
        std::fs::write(&b, &weights).unwrap();
        assert_eq!(model_identity("m", &b).unwrap(), first);
        // A fine-tune: bytes changed throughout (every 4 KiB here, as a sample's length).
        let mut tuned = weights.clone();
        for i in (0..tuned.len()).step_by(4096) {
            tuned[i] ^= 1;
        }
        std::fs::write(&b, &tuned).unwrap();
        assert_ne!(model_identity("m", &b).unwrap(), first);
        // Another name for the same weights is another model.
        assert_ne!(model_identity("n", &a).unwrap(), first);
    }

    #[test]
    fn a_folder_counts_its_weights_and_config_files_only() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("model.safetensors"), b"weights").unwrap();
        std::fs::write(dir.path().join("config.json"), b"{}").unwrap();
        let first = model_identity("m", dir.path()).unwrap();
        std::fs::write(dir.path().join("README.md"), b"notes").unwrap();
        assert_eq!(model_identity("m", dir.path()).unwrap(), first);
        std::fs::write(dir.path().join("config.json"), b"{\"layers\": 2}").unwrap();
        assert_ne!(model_identity("m", dir.path()).unwrap(), first);
    }
}
