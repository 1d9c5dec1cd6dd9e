//! The emulation itself: the kernel sources compiled as host C++ with the CUDA shim, the
//! grid launcher, and the helpers every kernel's tests share.

use std::ffi::c_void;
use std::hash::{Hash, Hasher};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

use pdmesh_kernels::cuda_src;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

const SHIM_H: &str = include_str!("../emu/shim.h");
const LAUNCH_CPP: &str = include_str!("../emu/launch.cpp");

type Body = unsafe extern "C" fn(*mut c_void);
type LaunchFn = unsafe extern "C" fn(u32, u32, u32, Body, *mut c_void) -> i32;

/// The compiled emulation: the loaded library and its launcher.
pub(crate) struct Emu {
    lib: libloading::Library,
    launch: LaunchFn,
}

/// A raw pointer that the launch closure may share between the emulated threads (the
/// kernels are what coordinate their accesses, as on a GPU).
#[derive(Clone, Copy)]
pub(crate) struct P<T>(*mut T);
// SAFETY: only handed to kernels, whose threads write disjoint elements or synchronize.
unsafe impl<T> Sync for P<T> {}
// SAFETY: as for Sync.
unsafe impl<T> Send for P<T> {}
impl<T> P<T> {
    pub(crate) fn p(&self) -> *mut T {
        self.0
    }
}
pub(crate) fn m<T>(v: &mut [T]) -> P<T> {
    P(v.as_mut_ptr())
}
pub(crate) fn c<T>(v: &[T]) -> P<T> {
    P(v.as_ptr() as *mut T)
}

fn compiler() -> String {
    for cxx in ["c++", "g++"] {
        if Command::new(cxx)
            .arg("--version")
            .output()
            .is_ok_and(|o| o.status.success())
        {
            return cxx.to_string();
        }
    }
    panic!(
        "no C++ compiler (c++ or g++) found: the CPU emulation of the CUDA kernels needs one; \
         install g++ (e.g. `apt-get install g++`)"
    );
}

/// The C++ name of kernel `k` in the library: every module's kernels are renamed
/// `pd_emu_<module>_<kernel>` so that a module that repeats another's text (deepseek holds
/// fp8.cu's) links beside it.
fn symbol(kernel: &str) -> String {
    let src = cuda_src::source_of(kernel).unwrap_or_else(|| panic!("no kernel {kernel}"));
    format!("pd_emu_{}_{}", src.name, kernel)
}

fn build(cxx: &str, dir: &Path) -> PathBuf {
    let flags = [
        "-O2",
        "-std=c++20", // std::barrier
        "-pthread",
        "-fPIC",
        "-fno-fast-math",
        "-ffp-contract=off",
        "-w",
    ];
    std::fs::write(dir.join("shim.h"), SHIM_H).unwrap();
    std::fs::write(dir.join("launch.cpp"), LAUNCH_CPP).unwrap();
    let all: Vec<&str> = cuda_src::sources()
        .iter()
        .flat_map(|s| s.kernels.iter().copied())
        .collect();
    let mut units = vec!["launch".to_string()];
    for src in cuda_src::sources() {
        std::fs::write(dir.join(format!("{}.cu", src.name)), src.full_source()).unwrap();
        let mut tu = String::from("#include \"shim.h\"\n");
        for k in &all {
            tu.push_str(&format!("#define {k} pd_emu_{}_{k}\n", src.name));
        }
        tu.push_str(&format!("#include \"{}.cu\"\n", src.name));
        std::fs::write(dir.join(format!("{}.cpp", src.name)), tu).unwrap();
        units.push(src.name.to_string());
    }
    // Compile the units in parallel, then link.
    let children: Vec<_> = units
        .iter()
        .map(|u| {
            let child = Command::new(cxx)
                .args(flags)
                .arg("-c")
                .arg(format!("{u}.cpp"))
                .arg("-o")
                .arg(format!("{u}.o"))
                .current_dir(dir)
                .stderr(std::process::Stdio::piped())
                .spawn()
                .unwrap_or_else(|e| panic!("running {cxx}: {e}"));
            (u, child)
        })
        .collect();
    for (u, child) in children {
        let out = child.wait_with_output().unwrap();
        assert!(
            out.status.success(),
            "{cxx} failed on {u}.cpp:\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let lib = dir.join("libpd_emu.so");
    let status = Command::new(cxx)
        .args(["-shared", "-pthread", "-o"])
        .arg(&lib)
        .args(units.iter().map(|u| format!("{u}.o")))
        .current_dir(dir)
        .status()
        .unwrap();
    assert!(status.success(), "linking the emulation library failed");
    lib
}

pub(crate) fn emu() -> &'static Emu {
    static EMU: OnceLock<Emu> = OnceLock::new();
    EMU.get_or_init(|| {
        let cxx = compiler();
        let mut h = std::collections::hash_map::DefaultHasher::new();
        (&cxx, SHIM_H, LAUNCH_CPP).hash(&mut h);
        for s in cuda_src::sources() {
            (s.name, s.full_source(), s.kernels).hash(&mut h);
        }
        let root = Path::new(env!("CARGO_TARGET_TMPDIR")).join("kernels_emulated");
        let cached = root.join(format!("{:016x}.so", h.finish()));
        if !cached.exists() {
            std::fs::create_dir_all(&root).unwrap();
            let dir = tempfile::tempdir_in(&root).unwrap();
            let lib = build(&cxx, dir.path());
            // Atomic: a concurrent test process either sees no file or a whole one.
            std::fs::rename(lib, &cached).unwrap();
        }
        // SAFETY: our own library; its initializers only set up globals.
        let lib = unsafe { libloading::Library::new(&cached) }.expect("loading the emulation");
        // SAFETY: the symbol is the emulation's launcher, of type LaunchFn.
        let launch = unsafe { *lib.get::<LaunchFn>(b"pd_emu_launch").unwrap() };
        Emu { lib, launch }
    })
}

impl Emu {
    /// Kernel `name` as a function pointer of type `F` (the kernel's signature).
    pub(crate) fn kernel<F: Copy>(&self, name: &str) -> F {
        // SAFETY: the caller names the kernel's C signature.
        unsafe { *self.lib.get::<F>(symbol(name).as_bytes()).unwrap() }
    }

    /// Runs `f` (a kernel call) once per CUDA thread of a `grid` of blocks of `block`.
    pub(crate) fn launch<F: Fn() + Sync>(&self, grid: (u32, u32), block: u32, f: F) {
        unsafe extern "C" fn body<F: Fn() + Sync>(ctx: *mut c_void) {
            // SAFETY: ctx is the &F passed below, alive for the whole launch.
            unsafe { (*(ctx as *const F))() }
        }
        // The launcher's state (grid, barriers, `__shared__` statics) is global: one
        // launch at a time, also when the tests run as threads of one process.
        static ONE: std::sync::Mutex<()> = std::sync::Mutex::new(());
        let _one = ONE.lock().unwrap_or_else(|e| e.into_inner());
        // SAFETY: the launcher returns after every thread has finished.
        let rc = unsafe {
            (self.launch)(
                grid.0,
                grid.1,
                block,
                body::<F>,
                &f as *const F as *mut c_void,
            )
        };
        assert_eq!(rc, 0, "bad launch shape {grid:?} x {block}");
    }
}

pub(crate) fn rng(seed: u64) -> ChaCha8Rng {
    ChaCha8Rng::seed_from_u64(seed)
}

pub(crate) fn randv(r: &mut ChaCha8Rng, n: usize, scale: f32) -> Vec<f32> {
    (0..n)
        .map(|_| r.random_range(-1.0f32..1.0) * scale)
        .collect()
}

pub(crate) fn assert_bits_eq(what: &str, got: &[f32], want: &[f32]) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert_eq!(
            g.to_bits(),
            w.to_bits(),
            "{what}[{i}]: kernel {g:e} vs CPU {w:e}"
        );
    }
}

/// Distance in units in the last place between two finite f32s of the same sign.
pub(crate) fn ulps(a: f32, b: f32) -> u32 {
    if a == b {
        return 0;
    }
    let key = |x: f32| {
        let b = x.to_bits() as i64;
        if b & (1 << 31) != 0 {
            -(b & 0x7fff_ffff)
        } else {
            b
        }
    };
    (key(a) - key(b)).unsigned_abs() as u32
}
