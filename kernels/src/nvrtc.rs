//! Compiling the CUDA kernel sources ([`crate::cuda_src`]) to PTX with NVRTC, at run time,
//! with a disk cache.
//!
//! libnvrtc is loaded dynamically (cudarc's `dynamic-loading`): building needs no CUDA
//! toolkit, and a machine without the library gets [`NvrtcError::LibraryMissing`] naming it
//! (cudarc itself would panic). The library can come from a CUDA installation or from the
//! PyPI package `nvidia-cuda-nvrtc` (its `nvidia/cu13/lib`; `scripts/ci/nvrtc-env`
//! installs it and prints that directory for `LD_LIBRARY_PATH`).
//!
//! Options: `--gpu-architecture=compute_XX` (PTX for the virtual architecture of `sm_XX`),
//! `-default-device`, `--std=c++17` and `--fmad=false`; never `--use_fast_math` (the
//! kernels are deterministic and some are bit-exact with CPU code).

use std::fmt;
use std::io::Write;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use cudarc::nvrtc::{CompileError, CompileOptions, compile_ptx_with_opts};
use rayon::prelude::*;
use sha2::{Digest, Sha256};

use crate::cuda_src::{KernelSource, source_hash, sources};

/// One source compiled: its module name, its PTX and the kernels it defines.
#[derive(Debug, Clone)]
pub struct CompiledModule {
    pub name: &'static str,
    pub ptx: String,
    pub kernels: &'static [&'static str],
    /// Whether the PTX was read from the disk cache rather than compiled by this call.
    pub from_cache: bool,
}

/// Why kernels could not be compiled.
#[derive(Clone, Debug)]
pub enum NvrtcError {
    /// The architecture is not of the form `sm_<digits>`.
    BadArch(String),
    /// libnvrtc could not be loaded (or did not answer).
    LibraryMissing(String),
    /// NVRTC rejected a source: its log says why.
    Compile {
        module: String,
        arch: String,
        options: Vec<String>,
        log: String,
    },
    /// Another NVRTC failure (creating the program, reading its PTX).
    Nvrtc { module: String, detail: String },
}

impl fmt::Display for NvrtcError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            NvrtcError::BadArch(a) => write!(
                f,
                "bad GPU architecture {a:?}: expected sm_ and digits, e.g. sm_90 or sm_120"
            ),
            NvrtcError::LibraryMissing(m) => f.write_str(m),
            NvrtcError::Compile {
                module,
                arch,
                options,
                log,
            } => write!(
                f,
                "NVRTC could not compile {module}.cu for {arch} (options {options:?}):\n{log}"
            ),
            NvrtcError::Nvrtc { module, detail } => {
                write!(f, "NVRTC failed on {module}.cu: {detail}")
            }
        }
    }
}

impl std::error::Error for NvrtcError {}

/// `sm_90` → `compute_90`: the virtual architecture whose PTX NVRTC emits.
fn virtual_arch(arch: &str) -> Result<String, NvrtcError> {
    match arch.strip_prefix("sm_") {
        Some(d) if !d.is_empty() && d.len() <= 4 && d.bytes().all(|b| b.is_ascii_digit()) => {
            Ok(format!("compute_{d}"))
        }
        _ => Err(NvrtcError::BadArch(arch.to_owned())),
    }
}

fn panic_text(p: &(dyn std::any::Any + Send)) -> String {
    p.downcast_ref::<String>()
        .cloned()
        .or_else(|| p.downcast_ref::<&str>().map(|s| (*s).to_owned()))
        .unwrap_or_else(|| "unknown panic".into())
}

fn missing_library(detail: &str) -> NvrtcError {
    let names = cudarc::get_lib_name_candidates("nvrtc");
    NvrtcError::LibraryMissing(format!(
        "libnvrtc could not be loaded ({detail}); looked for {names:?}. Set LD_LIBRARY_PATH to \
         the directory holding libnvrtc.so.13 (or .so.12): a CUDA toolkit's lib64, or \
         nvidia/cu13/lib of the PyPI package nvidia-cuda-nvrtc (`export \
         LD_LIBRARY_PATH=$(scripts/ci/nvrtc-env)` installs it under target/nvrtc)"
    ))
}

/// The loaded library's version, `(major, minor)`; loads it on first use. cudarc panics
/// when the library is absent: that becomes [`NvrtcError::LibraryMissing`].
pub fn nvrtc_version() -> Result<(i32, i32), NvrtcError> {
    static VERSION: OnceLock<Result<(i32, i32), NvrtcError>> = OnceLock::new();
    VERSION
        .get_or_init(|| {
            // SAFETY: only tries to open the candidate libraries.
            if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
                return Err(missing_library("not found"));
            }
            let r = catch_unwind(|| {
                let (mut major, mut minor) = (0, 0);
                // SAFETY: two valid out-pointers.
                let rc = unsafe { cudarc::nvrtc::sys::nvrtcVersion(&mut major, &mut minor) };
                rc.result().map(|()| (major, minor))
            });
            match r {
                Ok(Ok(v)) => Ok(v),
                Ok(Err(e)) => Err(missing_library(&format!("nvrtcVersion failed: {e:?}"))),
                Err(p) => Err(missing_library(&panic_text(p.as_ref()))),
            }
        })
        .clone()
}

/// The NVRTC options for `arch` (already validated).
fn options(virt: &str) -> Vec<String> {
    vec![
        format!("--gpu-architecture={virt}"),
        "-default-device".into(),
        "--std=c++17".into(),
        "--fmad=false".into(),
    ]
}

/// Compiles one CUDA C source, exactly as given (nothing prepended), to PTX for `arch`
/// (`sm_90`, `sm_120`, ...). `name` names the program in NVRTC's log (`<name>.cu`).
pub fn compile_source_ptx(name: &str, code: &str, arch: &str) -> Result<String, NvrtcError> {
    let virt = virtual_arch(arch)?;
    nvrtc_version()?;
    if code.contains('\0') {
        return Err(NvrtcError::Nvrtc {
            module: name.to_owned(),
            detail: "the source contains a NUL byte".into(),
        });
    }
    let opts = CompileOptions {
        options: options(&virt),
        name: Some(format!("{name}.cu")),
        ..Default::default()
    };
    let r = catch_unwind(AssertUnwindSafe(|| compile_ptx_with_opts(code, opts)));
    match r {
        Ok(Ok(ptx)) => Ok(ptx.to_src()),
        Ok(Err(CompileError::CompileError { log, options, .. })) => Err(NvrtcError::Compile {
            module: name.to_owned(),
            arch: arch.to_owned(),
            options,
            log: log.to_string_lossy().into_owned(),
        }),
        Ok(Err(e)) => Err(NvrtcError::Nvrtc {
            module: name.to_owned(),
            detail: format!("{e:?}"),
        }),
        Err(p) => Err(NvrtcError::Nvrtc {
            module: name.to_owned(),
            detail: panic_text(p.as_ref()),
        }),
    }
}

/// Compiles one CUDA C source, exactly as given, to a CUBIN (machine code, an ELF image)
/// for the real architecture `arch`. A driver older than the NVRTC cannot JIT the newer
/// NVRTC's PTX (CUDA's minor-version compatibility covers machine code only); a CUBIN for
/// the device's own architecture needs no JIT.
pub fn compile_source_cubin(name: &str, code: &str, arch: &str) -> Result<Vec<u8>, NvrtcError> {
    use cudarc::nvrtc::{result, sys};
    virtual_arch(arch)?;
    nvrtc_version()?;
    let fail = |detail: String| NvrtcError::Nvrtc {
        module: name.to_owned(),
        detail,
    };
    let src =
        std::ffi::CString::new(code).map_err(|_| fail("the source contains a NUL byte".into()))?;
    let cname = std::ffi::CString::new(format!("{name}.cu")).expect("no NUL in a module name");
    let prog = result::create_program(&src, Some(&cname)).map_err(|e| fail(format!("{e:?}")))?;
    let mut opts = options(arch);
    opts[0] = format!("--gpu-architecture={arch}");
    // SAFETY: `prog` was created above and is destroyed once, below.
    let out = unsafe {
        match result::compile_program(prog, &opts) {
            Err(_) => {
                let log = result::get_program_log(prog)
                    .map(|l| {
                        let bytes: Vec<u8> = l.iter().map(|&c| c as u8).collect();
                        String::from_utf8_lossy(&bytes)
                            .trim_end_matches('\0')
                            .to_owned()
                    })
                    .unwrap_or_default();
                Err(NvrtcError::Compile {
                    module: name.to_owned(),
                    arch: arch.to_owned(),
                    options: opts.clone(),
                    log,
                })
            }
            Ok(()) => {
                let mut size = 0usize;
                sys::nvrtcGetCUBINSize(prog, &mut size)
                    .result()
                    .map_err(|e| fail(format!("nvrtcGetCUBINSize: {e:?}")))
                    .and_then(|()| {
                        let mut buf = vec![0u8; size];
                        sys::nvrtcGetCUBIN(prog, buf.as_mut_ptr().cast())
                            .result()
                            .map_err(|e| fail(format!("nvrtcGetCUBIN: {e:?}")))
                            .map(|()| buf)
                    })
            }
        }
    };
    // SAFETY: created above, not yet destroyed.
    let _ = unsafe { result::destroy_program(prog) };
    out
}

/// Every kernel source as a CUBIN for `arch` (no cache: machine code for one device, built
/// when the driver cannot take the PTX).
pub fn compile_cubins(arch: &str) -> Result<Vec<(&'static KernelSource, Vec<u8>)>, NvrtcError> {
    sources()
        .par_iter()
        .map(|s| Ok((s, compile_source_cubin(s.name, &s.full_source(), arch)?)))
        .collect()
}

fn compile_module(src: &'static KernelSource, arch: &str) -> Result<CompiledModule, NvrtcError> {
    Ok(CompiledModule {
        name: src.name,
        ptx: compile_source_ptx(src.name, &src.full_source(), arch)?,
        kernels: src.kernels,
        from_cache: false,
    })
}

/// Compiles every kernel source to PTX for `arch` (`sm_` and digits), without a cache.
pub fn compile_ptx(arch: &str) -> Result<Vec<CompiledModule>, NvrtcError> {
    virtual_arch(arch)?;
    nvrtc_version()?;
    sources()
        .par_iter()
        .map(|s| compile_module(s, arch))
        .collect()
}

/// The default cache directory: `$PDMESH_KERNEL_CACHE`, else
/// `$XDG_CACHE_HOME/pdmesh/kernels`, else `$HOME/.cache/pdmesh/kernels` (`None` if none is
/// set).
pub fn default_cache_dir() -> Option<PathBuf> {
    let var = |k: &str| {
        std::env::var_os(k)
            .filter(|v| !v.is_empty())
            .map(PathBuf::from)
    };
    var("PDMESH_KERNEL_CACHE")
        .or_else(|| var("XDG_CACHE_HOME").map(|d| d.join("pdmesh/kernels")))
        .or_else(|| var("HOME").map(|d| d.join(".cache/pdmesh/kernels")))
}

/// The cache folder's name for `arch` under the loaded NVRTC: the sources' hash, the
/// architecture and NVRTC's version, so any of them changing misses the cache.
pub fn cache_key(arch: &str) -> Result<String, NvrtcError> {
    virtual_arch(arch)?;
    let (major, minor) = nvrtc_version()?;
    Ok(format!("{}-{arch}-nvrtc{major}.{minor}", source_hash()))
}

/// The last line of a cache file: a PTX comment with the SHA-256 of everything before it,
/// so a truncated or corrupted file is recognized and compiled again.
const TRAILER: &str = "// pdmesh-ptx-sha256 ";

fn sha256_hex(bytes: &[u8]) -> String {
    Sha256::digest(bytes)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

fn read_cached(path: &Path) -> Option<String> {
    let text = std::fs::read_to_string(path).ok()?;
    let body = text.strip_suffix('\n')?;
    let at = body.rfind('\n').map_or(0, |i| i + 1);
    let (ptx, last) = body.split_at(at);
    let want = last.strip_prefix(TRAILER)?;
    (!ptx.is_empty() && sha256_hex(ptx.as_bytes()) == want).then(|| ptx.to_owned())
}

/// Writes `ptx` (with its trailer) to `path` through a temporary file in the same folder
/// and a rename, so readers see the whole file or none.
fn write_cached(path: &Path, ptx: &str) -> std::io::Result<()> {
    static SEQ: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let dir = path.parent().expect("a cache file has a folder");
    std::fs::create_dir_all(dir)?;
    let seq = SEQ.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let tmp = dir.join(format!(
        ".{}.{}.{seq}.tmp",
        path.file_name().and_then(|n| n.to_str()).unwrap_or("ptx"),
        std::process::id()
    ));
    let mut body = String::with_capacity(ptx.len() + 100);
    body.push_str(ptx);
    if !ptx.ends_with('\n') {
        body.push('\n');
    }
    // The hash covers exactly what read_cached returns.
    let hash = sha256_hex(body.as_bytes());
    let write = || -> std::io::Result<()> {
        let mut f = std::fs::File::create(&tmp)?;
        f.write_all(body.as_bytes())?;
        writeln!(f, "{TRAILER}{hash}")?;
        f.sync_all()?;
        std::fs::rename(&tmp, path)
    };
    write().inspect_err(|_| {
        let _ = std::fs::remove_file(&tmp);
    })
}

/// [`compile_ptx`] through a disk cache: `<cache_dir>/<cache_key>/<module>.ptx`
/// (`cache_dir` `None`: [`default_cache_dir`]; no cache at all if that is `None` too). A
/// module whose file is missing, truncated or corrupted is compiled and its file written
/// (atomically); a cache that cannot be written only costs the next call a compile.
/// [`CompiledModule::from_cache`] says which modules came from disk.
pub fn compile_ptx_cached(
    arch: &str,
    cache_dir: Option<&Path>,
) -> Result<Vec<CompiledModule>, NvrtcError> {
    let Some(dir) = cache_dir.map(Path::to_path_buf).or_else(default_cache_dir) else {
        return compile_ptx(arch);
    };
    let dir = dir.join(cache_key(arch)?);
    sources()
        .par_iter()
        .map(|s| {
            let path = dir.join(format!("{}.ptx", s.name));
            if let Some(ptx) = read_cached(&path) {
                return Ok(CompiledModule {
                    name: s.name,
                    ptx,
                    kernels: s.kernels,
                    from_cache: true,
                });
            }
            let mut m = compile_module(s, arch)?;
            // As read_cached returns it, so a cached and a fresh module match.
            if !m.ptx.ends_with('\n') {
                m.ptx.push('\n');
            }
            let _ = write_cached(&path, &m.ptx);
            Ok(m)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn architectures_map_to_their_virtual_ones() {
        assert_eq!(virtual_arch("sm_90").unwrap(), "compute_90");
        assert_eq!(virtual_arch("sm_120").unwrap(), "compute_120");
        for bad in [
            "",
            "sm_",
            "sm90",
            "compute_90",
            "sm_90a",
            "sm_9 0",
            "SM_90",
            "sm_-1",
        ] {
            assert!(
                matches!(virtual_arch(bad), Err(NvrtcError::BadArch(_))),
                "{bad}"
            );
        }
    }

    #[test]
    fn cache_files_round_trip_and_damage_is_seen() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("k/m.ptx");
        let ptx = "//\n.version 9.0\n.visible .entry f()\n{\n\tret;\n}\n";
        write_cached(&p, ptx).unwrap();
        assert_eq!(read_cached(&p).as_deref(), Some(ptx));
        let full = std::fs::read_to_string(&p).unwrap();
        std::fs::write(&p, &full[..full.len() / 2]).unwrap();
        assert_eq!(read_cached(&p), None);
        std::fs::write(&p, full.replace("ret", "reT")).unwrap();
        assert_eq!(read_cached(&p), None);
        std::fs::write(&p, "").unwrap();
        assert_eq!(read_cached(&p), None);
        // No temporary files are left behind.
        let names: Vec<_> = std::fs::read_dir(p.parent().unwrap())
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names, ["m.ptx"]);
    }
}
