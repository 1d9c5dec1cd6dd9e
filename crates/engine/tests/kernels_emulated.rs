//! The CUDA kernels in `kernels/cuda/`, run on the CPU and checked against the Rust code
//! they mirror, so that a logic error in a kernel fails CI on a machine without a GPU.
//!
//! Each test compiles the committed kernel sources, exactly the text the CUDA backend
//! hands NVRTC (`pdmesh_kernels::cuda_src::sources()`, `full_source()`: the common header
//! prepended), as host C++ together with `tests/emu/shim.h` (the CUDA built-ins) and
//! `tests/emu/launch.cpp` (a grid launcher: blocks one after another, the threads of a
//! block as real OS threads with a barrier), with the system C++ compiler, into a shared
//! library that it loads with `libloading`. The library is cached under Cargo's target
//! tmp dir, keyed by a hash of everything compiled, so the test processes share one
//! compile. See `tests/emu/shim.h` for what the emulation does and does not model: it
//! checks logic (indexing, reduction orders, rounding, barriers), not GPU behaviour.
//!
//! Where a kernel goes through expf / cosf / sinf, the emulation uses the host libm (as
//! the GPU uses its own), so those results are compared with a stated tolerance; every
//! other comparison is bit-exact.
//!
//! A C++ compiler (`c++`, else `g++`) is required: without one these tests fail (CI's
//! `.ci/run` installs g++).

use std::ffi::c_void;
use std::hash::{Hash, Hasher};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::{Arc, OnceLock};

use half::f16;
use pdmesh_kernels::cuda_src;
use pdmesh_kv::fp8::{self, ScaleRule};
use pdmesh_kv::{DType, KvLayout, PagePool};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

const SHIM_H: &str = include_str!("emu/shim.h");
const LAUNCH_CPP: &str = include_str!("emu/launch.cpp");

type Body = unsafe extern "C" fn(*mut c_void);
type LaunchFn = unsafe extern "C" fn(u32, u32, u32, Body, *mut c_void) -> i32;

/// The compiled emulation: the loaded library and its launcher.
struct Emu {
    lib: libloading::Library,
    launch: LaunchFn,
}

/// A raw pointer that the launch closure may share between the emulated threads (the
/// kernels are what coordinate their accesses, as on a GPU).
#[derive(Clone, Copy)]
struct P<T>(*mut T);
// SAFETY: only handed to kernels, whose threads write disjoint elements or synchronize.
unsafe impl<T> Sync for P<T> {}
unsafe impl<T> Send for P<T> {}
impl<T> P<T> {
    fn p(&self) -> *mut T {
        self.0
    }
}
fn m<T>(v: &mut [T]) -> P<T> {
    P(v.as_mut_ptr())
}
fn c<T>(v: &[T]) -> P<T> {
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

fn emu() -> &'static Emu {
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
        let launch = unsafe { *lib.get::<LaunchFn>(b"pd_emu_launch").unwrap() };
        Emu { lib, launch }
    })
}

impl Emu {
    /// Kernel `name` as a function pointer of type `F` (the kernel's signature).
    fn kernel<F: Copy>(&self, name: &str) -> F {
        // SAFETY: the caller names the kernel's C signature.
        unsafe { *self.lib.get::<F>(symbol(name).as_bytes()).unwrap() }
    }

    /// Runs `f` (a kernel call) once per CUDA thread of a `grid` of blocks of `block`.
    fn launch<F: Fn() + Sync>(&self, grid: (u32, u32), block: u32, f: F) {
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

fn rng(seed: u64) -> ChaCha8Rng {
    ChaCha8Rng::seed_from_u64(seed)
}

fn randv(r: &mut ChaCha8Rng, n: usize, scale: f32) -> Vec<f32> {
    (0..n)
        .map(|_| r.random_range(-1.0f32..1.0) * scale)
        .collect()
}

fn assert_bits_eq(what: &str, got: &[f32], want: &[f32]) {
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
fn ulps(a: f32, b: f32) -> u32 {
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

// ---------------------------------------------------------------------------------------
// fp8.cu

type QuantFn = unsafe extern "C" fn(*const f32, *mut u8, *mut f32, i32, i32, i32);
type DequantFn = unsafe extern "C" fn(*const u8, *const f32, *mut f32, i32, i32);

#[test]
fn fp8_quantize_and_dequantize_bit_exact() {
    let e = emu();
    let quant: QuantFn = e.kernel("fp8_quantize_blocks");
    let dequant: DequantFn = e.kernel("fp8_dequantize_blocks");
    let mut r = rng(1);
    for (block, ue8m0) in [(128usize, 0), (128, 1), (64, 1), (200, 0)] {
        let nb = 6;
        let mut x = Vec::with_capacity(nb * block);
        for b in 0..nb {
            // Magnitudes from tiny (subnormal e4m3, the amax floor) to saturating.
            let scale = [1e-6f32, 3e-3, 0.7, 1.0, 300.0, 2e4][b];
            x.extend(randv(&mut r, block, scale));
        }
        x[3] = 0.0;
        x[5] = -0.0;
        if ue8m0 == 0 {
            // A block of zeros (the amax floor) and exact halfway values.
            x[block..2 * block].fill(0.0);
        }
        let mut q = vec![0u8; x.len()];
        let mut s = vec![0f32; nb];
        let mut back = vec![0f32; x.len()];
        let (px, pq, ps, pb) = (c(&x), m(&mut q), m(&mut s), m(&mut back));
        let (nbi, bi) = (nb as i32, block as i32);
        e.launch((nb as u32, 1), 128, || unsafe {
            quant(px.p(), pq.p(), ps.p(), nbi, bi, ue8m0)
        });
        e.launch((nb as u32, 1), 128, || unsafe {
            dequant(pq.p(), ps.p(), pb.p(), nbi, bi)
        });
        let rule = if ue8m0 == 1 {
            ScaleRule::Ue8m0
        } else {
            ScaleRule::Exact
        };
        for b in 0..nb {
            let xs = &x[b * block..(b + 1) * block];
            let mut wq = vec![0u8; block];
            let ws = fp8::quantize_block(xs, &mut wq, rule);
            let mut wb = vec![0f32; block];
            fp8::dequantize_block(&wq, ws, &mut wb);
            let what = format!("block {block} ue8m0 {ue8m0} #{b}");
            assert_eq!(s[b].to_bits(), ws.to_bits(), "{what}: scale");
            assert_eq!(&q[b * block..(b + 1) * block], &wq[..], "{what}: codes");
            assert_bits_eq(&what, &back[b * block..(b + 1) * block], &wb);
        }
    }
}

// ---------------------------------------------------------------------------------------
// checksum.cu

type ChecksumFn = unsafe extern "C" fn(*const u8, i64, *const i64, *const u8, i32, *mut u64, i32);

#[test]
fn page_checksum_xxh3_bit_exact() {
    let e = emu();
    let k: ChecksumFn = e.kernel("page_checksum_xxh3");
    let secret = pdmesh_kv::checksum_secret();
    let mut r = rng(2);
    let data: Vec<u8> = (0..40_000).map(|_| r.random()).collect();
    // Every length class of XXH3: 0, 1-3, 4-8, 9-16, 17-128, 129-240, long (stripes,
    // whole blocks, a partial last stripe).
    for len in [
        0usize, 1, 3, 4, 8, 9, 16, 17, 100, 128, 129, 200, 240, 241, 1000, 1024, 4096, 4103, 9000,
    ] {
        let offs: Vec<i64> = vec![0, 7, (data.len() - len) as i64, 333];
        let mut out = vec![0u64; offs.len()];
        let (pd, po, psec, pout) = (c(&data), c(&offs), c(secret), m(&mut out));
        let n = offs.len() as i32;
        let sl = secret.len() as i32;
        e.launch((offs.len() as u32, 1), 1, || unsafe {
            k(pd.p(), len as i64, po.p(), psec.p(), sl, pout.p(), n)
        });
        for (o, got) in offs.iter().zip(&out) {
            let want = pdmesh_kv::page_checksum(&data[*o as usize..*o as usize + len]);
            assert_eq!(*got, want, "len {len} offset {o}");
        }
    }
}

// ---------------------------------------------------------------------------------------
// dsa.cu

type TopkFn = unsafe extern "C" fn(*const f32, i32, i32, *mut i32);
type TopkRowsFn = unsafe extern "C" fn(*const f32, i32, *const i32, *const i32, i32, *mut i32, i32);
type DsaScoresFn =
    unsafe extern "C" fn(*const f32, *const f32, *const f32, *mut f32, i32, i32, i32, i32);

/// The CPU's selection in crates/engine/src/deepseek.rs: highest score first (total
/// order), earlier position on ties, the kept positions sorted ascending; every position
/// when n <= k.
fn cpu_topk(scores: &[f32], k: usize) -> Vec<i32> {
    let n = scores.len();
    if n <= k {
        return (0..n as i32)
            .chain(std::iter::repeat_n(-1, k - n))
            .collect();
    }
    let mut scored: Vec<(f32, usize)> = scores.iter().copied().zip(0..).collect();
    let by = |a: &(f32, usize), b: &(f32, usize)| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1));
    scored.select_nth_unstable_by(k - 1, by);
    let mut keep: Vec<i32> = scored[..k].iter().map(|s| s.1 as i32).collect();
    keep.sort_unstable();
    keep
}

/// topk_indices_rows: chosen rows of a wider matrix, each with its own length (some at
/// most k, so every position), written at their rows of `out`; rows not chosen keep
/// their sentinel. Each row equals the CPU's selection over its own scores.
#[test]
fn topk_indices_rows_selects_each_row_over_its_own_length() {
    let e = emu();
    let kern: TopkRowsFn = e.kernel("topk_indices_rows");
    let mut r = rng(13);
    let (stride, k, out_stride) = (700usize, 64usize, 70usize);
    let total = 6usize;
    let s: Vec<f32> = (0..total * stride)
        .map(|_| r.random_range(-3i32..3) as f32 * 0.25)
        .collect();
    let rows = [5i32, 0, 3, 2];
    let ns = [700i32, 65, 64, 300];
    let mut out = vec![-7i32; total * out_stride];
    let (ps, pr, pn, po) = (c(&s), c(&rows), c(&ns), m(&mut out));
    let (si, ki, oi) = (stride as i32, k as i32, out_stride as i32);
    e.launch((rows.len() as u32, 1), 256, || unsafe {
        kern(ps.p(), si, pr.p(), pn.p(), ki, po.p(), oi)
    });
    for row in 0..total {
        let got = &out[row * out_stride..(row + 1) * out_stride];
        match rows.iter().position(|&x| x as usize == row) {
            Some(b) => {
                let n = ns[b] as usize;
                let want = cpu_topk(&s[row * stride..row * stride + n], k);
                assert_eq!(&got[..k], &want[..], "row {row} (n {n})");
                assert!(got[k..].iter().all(|&v| v == -7), "row {row}: past k");
            }
            None => assert!(got.iter().all(|&v| v == -7), "row {row} was not chosen"),
        }
    }
}

#[test]
fn topk_indices_exact() {
    let e = emu();
    let kern: TopkFn = e.kernel("topk_indices");
    let mut r = rng(3);
    for (n, k, ties) in [
        (3000usize, 64usize, false),
        (2500, 100, true),
        (40, 64, false),
        (777, 1, true),
        (513, 512, true),
    ] {
        let rows = 3;
        let mut s: Vec<f32> = (0..rows * n)
            .map(|_| {
                if ties {
                    r.random_range(-4i32..4) as f32 * 0.5
                } else {
                    r.random_range(-10.0f32..10.0)
                }
            })
            .collect();
        // Specials: both zeros, infinities and NaNs of either sign.
        for (i, v) in [
            0.0f32,
            -0.0,
            f32::INFINITY,
            f32::NEG_INFINITY,
            f32::NAN,
            -f32::NAN,
        ]
        .into_iter()
        .enumerate()
        {
            if 5 * i + 2 < n {
                s[5 * i + 2] = v;
            }
        }
        let mut out = vec![12345i32; rows * k];
        let (ps, po) = (c(&s), m(&mut out));
        let (ni, ki) = (n as i32, k as i32);
        e.launch((rows as u32, 1), 256, || unsafe {
            kern(ps.p(), ni, ki, po.p())
        });
        for row in 0..rows {
            let want = cpu_topk(&s[row * n..(row + 1) * n], k);
            assert_eq!(
                &out[row * k..(row + 1) * k],
                &want[..],
                "n {n} k {k} row {row}"
            );
        }
    }
}

#[test]
fn dsa_index_scores_bit_exact() {
    let e = emu();
    let kern: DsaScoresFn = e.kernel("dsa_index_scores");
    let mut r = rng(4);
    let (t, heads, dim, nk) = (3usize, 4usize, 68usize, 300usize);
    let q_stride = heads * dim + 5;
    let q = randv(&mut r, t * q_stride, 1.0);
    let w = randv(&mut r, t * heads, 1.0);
    let keys = randv(&mut r, nk * dim, 1.0);
    let mut out = vec![f32::NAN; t * nk];
    let (pq, pw, pk, po) = (c(&q), c(&w), c(&keys), m(&mut out));
    let grid = (t as u32, nk.div_ceil(128) as u32);
    e.launch(grid, 128, || unsafe {
        kern(
            pq.p(),
            pw.p(),
            pk.p(),
            po.p(),
            heads as i32,
            dim as i32,
            nk as i32,
            q_stride as i32,
        )
    });
    let mut want = vec![0f32; t * nk];
    for ti in 0..t {
        let qt = &q[ti * q_stride..ti * q_stride + heads * dim];
        for j in 0..nk {
            want[ti * nk + j] = pdmesh_engine::deepseek::index_score(
                qt,
                &w[ti * heads..(ti + 1) * heads],
                &keys[j * dim..(j + 1) * dim],
            );
        }
    }
    assert_bits_eq("dsa_index_scores", &out, &want);
}

// ---------------------------------------------------------------------------------------
// matmul.cu

type MatmulFn = unsafe extern "C" fn(*const f32, *const f32, *mut f32, i32, i32, i32, i32);
type MatmulTilesFn =
    unsafe extern "C" fn(*const f32, *const f32, *mut f32, i32, i32, i32, i32, i32);
type AddFn = unsafe extern "C" fn(*mut f32, *const f32, i32);

/// matmul_rows's documented order: lane l fuses k = l, l+32, ... into its accumulator,
/// then the lanes meet in the xor-shuffle tree (each step a + b of lane l and l ^ off).
fn matmul_order(w: &[f32], x: &[f32]) -> f32 {
    let mut lanes = [0f32; 32];
    for (k, (a, b)) in w.iter().zip(x).enumerate() {
        lanes[k % 32] = a.mul_add(*b, lanes[k % 32]);
    }
    for off in [16, 8, 4, 2, 1] {
        let prev = lanes;
        for l in 0..32 {
            lanes[l] = prev[l] + prev[l ^ off];
        }
    }
    lanes[0]
}

#[test]
fn matmul_rows_reference_and_batch_invariance() {
    let e = emu();
    let kern: MatmulFn = e.kernel("matmul_rows");
    let mut r = rng(5);
    let (rows, cols, tokens) = (37usize, 300usize, 3usize);
    let w = randv(&mut r, rows * cols, 1.0);
    let x = randv(&mut r, tokens * cols, 2.0);
    let stride = rows + 3;
    let col0 = 2;
    let mut full = vec![-1f32; tokens * stride];
    let (pw, px, pf) = (c(&w), c(&x), m(&mut full));
    let (ri, ci, si) = (rows as i32, cols as i32, stride as i32);
    e.launch((rows.div_ceil(8) as u32, tokens as u32), 256, || unsafe {
        kern(pw.p(), px.p(), pf.p(), ri, ci, si, col0)
    });
    for t in 0..tokens {
        let xt = &x[t * cols..(t + 1) * cols];
        for rr in 0..rows {
            let wr = &w[rr * cols..(rr + 1) * cols];
            let got = full[t * stride + col0 as usize + rr];
            // The documented order, bit for bit.
            assert_eq!(
                got.to_bits(),
                matmul_order(wr, xt).to_bits(),
                "t {t} row {rr}"
            );
            // And the value: within f32 accumulation error of the f64 product.
            let exact: f64 = wr.iter().zip(xt).map(|(a, b)| *a as f64 * *b as f64).sum();
            let mag: f64 = wr
                .iter()
                .zip(xt)
                .map(|(a, b)| (*a as f64 * *b as f64).abs())
                .sum();
            assert!(
                (got as f64 - exact).abs() <= 1e-6 * mag + 1e-30,
                "t {t} row {rr}: {got} vs f64 {exact}"
            );
        }
        // Untouched columns stay as they were.
        assert_eq!(full[t * stride], -1.0);
        assert_eq!(full[t * stride + 1], -1.0);
        assert_eq!(full[t * stride + stride - 1], -1.0);
    }
    // Batch invariance: one token at a time, rows 5.. in one launch and rows 0..5 in
    // another, give the same bits as the whole launch.
    let mut parts = vec![-1f32; tokens * stride];
    for t in 0..tokens {
        let pxt = c(&x[t * cols..]);
        let po = m(&mut parts[t * stride..]);
        let pw5 = c(&w[5 * cols..]);
        e.launch(((rows - 5).div_ceil(8) as u32, 1), 256, || unsafe {
            kern(pw5.p(), pxt.p(), po.p(), ri - 5, ci, si, col0 + 5)
        });
        e.launch((1, 1), 256, || unsafe {
            kern(pw.p(), pxt.p(), po.p(), 5, ci, si, col0)
        });
    }
    assert_bits_eq("matmul_rows batch invariance", &parts, &full);

    // matmul_tiles: matmul_rows's bits for every token and row, whatever the number of
    // tokens (partial tiles of tokens and rows at both ends), placed by out_stride and
    // out_col0 with the other columns untouched.
    let tiles: MatmulTilesFn = e.kernel("matmul_tiles");
    for n in [tokens, 1, 19] {
        let x = randv(&mut r, n * cols, 2.0);
        let (mut by_rows, mut by_tiles) = (vec![-1f32; n * stride], vec![-1f32; n * stride]);
        let (px, pr, pt) = (c(&x), m(&mut by_rows), m(&mut by_tiles));
        let ni = n as i32;
        e.launch((rows.div_ceil(8) as u32, n as u32), 256, || unsafe {
            kern(pw.p(), px.p(), pr.p(), ri, ci, si, col0)
        });
        e.launch(
            (rows.div_ceil(32) as u32, n.div_ceil(16) as u32),
            256,
            || unsafe { tiles(pw.p(), px.p(), pt.p(), ri, ci, ni, si, col0) },
        );
        assert_bits_eq(
            &format!("matmul_tiles vs matmul_rows, {n} tokens"),
            &by_tiles,
            &by_rows,
        );
        assert!(
            by_tiles
                .chunks(stride)
                .all(|row| row[0] == -1.0 && row[1] == -1.0 && row[stride - 1] == -1.0)
        );
    }

    // add_in_place: exact.
    let add: AddFn = e.kernel("add_in_place");
    let mut a = randv(&mut r, 1000, 3.0);
    let b = randv(&mut r, 1000, 3.0);
    let want: Vec<f32> = a.iter().zip(&b).map(|(x, y)| x + y).collect();
    let (pa, pb) = (m(&mut a), c(&b));
    e.launch((4, 1), 256, || unsafe { add(pa.p(), pb.p(), 1000) });
    assert_bits_eq("add_in_place", &a, &want);
}

type SwigluFn = unsafe extern "C" fn(*mut f32, *const f32, i32);

#[test]
fn swiglu_matches_cpu() {
    let e = emu();
    let kern: SwigluFn = e.kernel("swiglu");
    let mut r = rng(11);
    // n not a multiple of the block; a tail past n that must stay as it was.
    let (n, tail, sentinel) = (1000usize, 30usize, 4242.0f32);
    let mut g: Vec<f32> = (0..n + tail)
        .map(|_| r.random_range(-20.0f32..20.0))
        .collect();
    g[..4].copy_from_slice(&[0.0, -0.0, -100.0, 100.0]);
    g[n..].fill(sentinel);
    let u = randv(&mut r, n + tail, 3.0);
    // deepseek.rs / model.rs: silu(gate) * up, g / (1 + exp(-g)) * u.
    let want: Vec<f32> = (0..n)
        .map(|i| g[i] / (1.0 + (-g[i]).exp()) * u[i])
        .collect();
    let (pg, pu) = (m(&mut g), c(&u));
    e.launch((n.div_ceil(256) as u32, 1), 256, || unsafe {
        kern(pg.p(), pu.p(), n as i32)
    });
    for i in 0..n {
        // expf: the host libm here (CUDA's on a GPU); 1e-6 relative.
        assert!(
            (g[i] - want[i]).abs() <= 1e-6 * want[i].abs() + f32::MIN_POSITIVE,
            "swiglu [{i}] (u {}): kernel {} vs CPU {}",
            u[i],
            g[i],
            want[i]
        );
    }
    assert!(g[n..].iter().all(|&v| v == sentinel), "swiglu wrote past n");
}

// ---------------------------------------------------------------------------------------
// norm.cu

type RmsFn = unsafe extern "C" fn(*const f32, *const f32, *mut f32, i32, f32);
type EmbedFn = unsafe extern "C" fn(*const f32, *const u32, *mut f32, i32, i32);
type RopePairsFn = unsafe extern "C" fn(*mut f32, *const i32, i32, i32, i32, f32);

/// The rms scale of row `xr` two ways: (the 256-thread kernels' documented order:
/// thread-strided f64 sums, then a fixed tree; model.rs's rms_norm: a sequential f64 sum).
fn rms_scales(xr: &[f32], eps: f32) -> (f32, f32) {
    let dim = xr.len();
    let mut buf = [0f64; 256];
    for (j, v) in xr.iter().enumerate() {
        buf[j % 256] += (v * v) as f64;
    }
    let mut s = 128;
    while s > 0 {
        for t in 0..s {
            buf[t] += buf[t + s];
        }
        s /= 2;
    }
    let tree = 1.0 / ((buf[0] / dim as f64) as f32 + eps).sqrt();
    let seq: f64 = xr.iter().map(|&v| (v * v) as f64).sum();
    (tree, 1.0 / ((seq / dim as f64) as f32 + eps).sqrt())
}

#[test]
fn rms_norm_matches_cpu() {
    let e = emu();
    let kern: RmsFn = e.kernel("rms_norm");
    let mut r = rng(6);
    let (rows, dim, eps) = (4usize, 700usize, 1e-6f32);
    let x = randv(&mut r, rows * dim, 3.0);
    let w = randv(&mut r, dim, 1.5);
    let mut out = vec![0f32; rows * dim];
    let (px, pw, po) = (c(&x), c(&w), m(&mut out));
    e.launch((rows as u32, 1), 256, || unsafe {
        kern(px.p(), pw.p(), po.p(), dim as i32, eps)
    });
    for row in 0..rows {
        let xr = &x[row * dim..(row + 1) * dim];
        // The kernel's documented order; model.rs's rms_norm (sequential f64 sum): the
        // same up to the sum's rounding.
        let (scale, cpu_scale) = rms_scales(xr, eps);
        for j in 0..dim {
            let got = out[row * dim + j];
            let exact = xr[j] * scale * w[j];
            assert_eq!(got.to_bits(), exact.to_bits(), "row {row} [{j}]");
            let cpu = xr[j] * cpu_scale * w[j];
            assert!(ulps(got, cpu) <= 2, "row {row} [{j}]: {got} vs CPU {cpu}");
        }
    }

    // embed_gather: exact copies of the table rows.
    let embed: EmbedFn = e.kernel("embed_gather");
    let table = randv(&mut r, 10 * 300, 1.0);
    let toks = [3u32, 0, 9, 3, 7];
    let mut emb = vec![0f32; toks.len() * 300];
    let (pt, pk, pe) = (c(&table), c(&toks), m(&mut emb));
    e.launch((toks.len() as u32, 1), 256, || unsafe {
        embed(pt.p(), pk.p(), pe.p(), 300, toks.len() as i32)
    });
    for (i, &t) in toks.iter().enumerate() {
        let t = t as usize;
        assert_bits_eq(
            "embed_gather",
            &emb[i * 300..(i + 1) * 300],
            &table[t * 300..(t + 1) * 300],
        );
    }
}

/// model.rs's rope_table + apply_rope (private there), line for line: theta from `pos`,
/// times theta_scale per pair, iteratively in f32.
fn rope_pairs_cpu(x: &mut [f32], pos: usize, theta_scale: f32) {
    let mut theta = pos as f32;
    for i in 0..x.len() / 2 {
        let (c, s) = (theta.cos(), theta.sin());
        let (x0, x1) = (x[2 * i], x[2 * i + 1]);
        x[2 * i] = x0 * c - x1 * s;
        x[2 * i + 1] = x0 * s + x1 * c;
        theta *= theta_scale;
    }
}

#[test]
fn rope_pairs_matches_cpu() {
    let e = emu();
    let kern: RopePairsFn = e.kernel("rope_pairs");
    let mut r = rng(12);
    // hd 128: 64 pairs over 32 threads; a row stride wider than the heads (the extra
    // columns must stay as they were).
    for (heads, hd, base, extra) in [(2usize, 128usize, 10000f32, 5usize), (3, 16, 500000.0, 0)] {
        let t = 5usize;
        let stride = heads * hd + extra;
        let pos = [0i32, 1, 8000, 7999, 37];
        let x = randv(&mut r, t * stride, 1.0);
        // The host's theta_scale (crates/engine/src/cuda/llama.rs): the CPU's powf.
        let theta_scale = base.powf(-2.0 / hd as f32);
        let mut want = x.clone();
        for (ti, &p) in pos.iter().enumerate() {
            for h in 0..heads {
                let at = ti * stride + h * hd;
                rope_pairs_cpu(&mut want[at..at + hd], p as usize, theta_scale);
            }
        }
        let mut got = x.clone();
        let (pg, pp) = (m(&mut got), c(&pos));
        e.launch((t as u32, heads as u32), 32, || unsafe {
            kern(
                pg.p(),
                pp.p(),
                heads as i32,
                hd as i32,
                stride as i32,
                theta_scale,
            )
        });
        for (ti, p) in pos.iter().enumerate() {
            for cc in 0..stride {
                let i = ti * stride + cc;
                if cc >= heads * hd {
                    assert_eq!(
                        got[i].to_bits(),
                        x[i].to_bits(),
                        "rope wrote past the heads"
                    );
                    continue;
                }
                // cosf / sinf: the host libm here (CUDA's on a GPU); 1e-6 absolute on
                // values of magnitude <= sqrt(2).
                assert!(
                    (got[i] - want[i]).abs() <= 1e-6,
                    "rope hd {hd} token {ti} (pos {p}) [{cc}]: kernel {} vs CPU {}",
                    got[i],
                    want[i]
                );
            }
        }
    }
}

// ---------------------------------------------------------------------------------------
// sampling.cu

type ArgmaxFn = unsafe extern "C" fn(*const f32, i32, *mut u32);

#[test]
fn argmax_rows_exact() {
    let e = emu();
    let kern: ArgmaxFn = e.kernel("argmax_rows");
    let mut r = rng(7);
    let (rows, vocab) = (5usize, 1500usize);
    let mut l: Vec<f32> = (0..rows * vocab)
        .map(|_| r.random_range(-20i32..20) as f32 * 0.25)
        .collect();
    // Row 1: a tie at the top (lowest index wins); row 2: NaNs (never chosen);
    // row 3: all equal; row 4: the maximum in the last slot.
    l[vocab + 100] = 50.0;
    l[vocab + 900] = 50.0;
    l[2 * vocab + 7] = f32::NAN;
    l[2 * vocab + 800] = -f32::NAN;
    l[3 * vocab..4 * vocab].fill(-1.5);
    l[5 * vocab - 1] = 1e30;
    let mut out = vec![u32::MAX; rows];
    let (pl, po) = (c(&l), m(&mut out));
    e.launch((rows as u32, 1), 256, || unsafe {
        kern(pl.p(), vocab as i32, po.p())
    });
    for row in 0..rows {
        // crates/engine/src/sampler.rs's argmax.
        let lr = &l[row * vocab..(row + 1) * vocab];
        let mut best = 0;
        for (i, &v) in lr.iter().enumerate() {
            if v > lr[best] {
                best = i;
            }
        }
        assert_eq!(out[row], best as u32, "row {row}");
    }
}

type LogSoftmaxFn = unsafe extern "C" fn(*const f32, *mut f32, i32);

#[test]
fn log_softmax_rows_matches_cpu() {
    let e = emu();
    let kern: LogSoftmaxFn = e.kernel("log_softmax_rows");
    let mut r = rng(13);
    // Fewer logits than threads, exactly one per thread, several per thread.
    for vocab in [3usize, 256, 1000] {
        let mut rows: Vec<Vec<f32>> = vec![randv(&mut r, vocab, 20.0)];
        let mut neg = randv(&mut r, vocab, 5.0);
        for v in neg.iter_mut().step_by(3) {
            *v = f32::NEG_INFINITY;
        }
        rows.push(neg);
        let mut peak = randv(&mut r, vocab, 1.0);
        peak[vocab / 2] = 1000.0;
        rows.push(peak);
        rows.push(vec![0.25; vocab]);
        let mut nan = randv(&mut r, vocab, 1.0);
        nan[vocab - 1] = f32::NAN;
        rows.push(nan);
        let flat = rows.concat();
        let mut out = vec![0f32; flat.len()];
        let (pl, po) = (c(&flat), m(&mut out));
        e.launch((rows.len() as u32, 1), 256, || unsafe {
            kern(pl.p(), po.p(), vocab as i32)
        });
        for (ri, row) in rows.iter().enumerate() {
            // sampler.rs's log_softmax_at (private there) for every token.
            let max = row.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v));
            let sum: f64 = row.iter().map(|&l| (l - max).exp() as f64).sum();
            for (j, &l) in row.iter().enumerate() {
                let want = (l - max) - sum.ln() as f32;
                let got = out[ri * vocab + j];
                // expf (the host libm here, CUDA's on a GPU) and the f64 sum's order
                // (strided, then a tree, against sequential): 1e-5 · max(1, |value|);
                // infinities exactly, NaN where the CPU gives NaN.
                let ok = if want.is_nan() {
                    got.is_nan()
                } else if want.is_infinite() {
                    got == want
                } else {
                    (got - want).abs() <= 1e-5 * want.abs().max(1.0)
                };
                assert!(
                    ok,
                    "vocab {vocab} row {ri} [{j}]: kernel {got} vs CPU {want}"
                );
            }
        }
    }
}

// ---------------------------------------------------------------------------------------
// kv.cu

type KvWriteFn = unsafe extern "C" fn(*const f32, i32, *mut u8, *const i64, i64, i32, i32, i32);
type GatherFn = unsafe extern "C" fn(*const u8, *const i64, *mut u8, i32, i32);
type ScatterFn = unsafe extern "C" fn(*const u8, *mut u8, *const i64, i32, i32);

#[test]
fn kv_write_f16_exact() {
    let e = emu();
    let kern: KvWriteFn = e.kernel("kv_write_f16");
    let mut r = rng(8);
    let (n, stride, cols, col0, comp_off) = (5usize, 80usize, 70usize, 3usize, 6usize);
    let mut src = randv(&mut r, n * stride, 100.0);
    src[0] = 65520.0; // rounds to inf
    src[1] = 1e-8; // subnormal half
    src[2] = f32::NAN;
    src[3] = -0.0;
    let row = stride * 2 + 64;
    let mut pool = vec![0xABu8; n * row];
    let offs: Vec<i64> = (0..n).map(|i| ((n - 1 - i) * row) as i64).collect();
    let (ps, pp, po) = (c(&src), m(&mut pool), c(&offs));
    e.launch((n as u32, 1), 128, || unsafe {
        kern(
            ps.p(),
            stride as i32,
            pp.p(),
            po.p(),
            comp_off as i64,
            col0 as i32,
            cols as i32,
            n as i32,
        )
    });
    let mut want = vec![0xABu8; n * row];
    for i in 0..n {
        for cc in 0..cols {
            let at = offs[i] as usize + comp_off + 2 * (col0 + cc);
            let h = f16::from_f32(src[i * stride + cc]).to_bits().to_le_bytes();
            want[at..at + 2].copy_from_slice(&h);
        }
    }
    assert_eq!(pool, want);
}

#[test]
fn gather_and_scatter_rows_exact() {
    let e = emu();
    let gather: GatherFn = e.kernel("gather_rows");
    let scatter: ScatterFn = e.kernel("scatter_rows");
    let src: Vec<u8> = (0..1usize << 16).map(|i| (i * 131 + 7) as u8).collect();
    // Row lengths and offsets that take each copy path: 16-byte words, 4-byte words, bytes.
    for rb in [64usize, 100, 37, 4096] {
        for shift in [0usize, 4, 1] {
            let n = 6;
            let offs: Vec<i64> = (0..n)
                .map(|i| ((n - 1 - i) * (rb + 16) + shift) as i64)
                .collect();
            let mut stage = vec![0u8; n * rb];
            let mut dst = vec![0u8; src.len()];
            let (psrc, po, pst, pd) = (c(&src), c(&offs), m(&mut stage), m(&mut dst));
            let (rbi, ni) = (rb as i32, n as i32);
            e.launch((n as u32, 1), 256, || unsafe {
                gather(psrc.p(), po.p(), pst.p(), rbi, ni)
            });
            e.launch((n as u32, 1), 256, || unsafe {
                scatter(pst.p(), pd.p(), po.p(), rbi, ni)
            });
            let mut want_dst = vec![0u8; src.len()];
            for (i, &o) in offs.iter().enumerate() {
                let o = o as usize;
                assert_eq!(
                    &stage[i * rb..(i + 1) * rb],
                    &src[o..o + rb],
                    "gather rb {rb} shift {shift} row {i}"
                );
                want_dst[o..o + rb].copy_from_slice(&src[o..o + rb]);
            }
            assert!(dst == want_dst, "scatter rb {rb} shift {shift}");
        }
    }
}

// ---------------------------------------------------------------------------------------
// attention.cu

#[allow(clippy::type_complexity)]
type AttnFn = unsafe extern "C" fn(
    *const f32,
    i32,
    *mut f32,
    i32,
    *mut f32,
    i32,
    *const u8,
    *const i32,
    *const i32,
    *const i32,
    *const i32,
    i64,
    i64,
    i64,
    i32,
    i32,
    i32,
    i32,
    i32,
    f32,
);

#[test]
fn paged_attention_f16_matches_attend() {
    let e = emu();
    let kern: AttnFn = e.kernel("paged_attention_f16");
    let mut r = rng(9);
    let (layers, layer, kv_heads, hd, ps) = (2usize, 1usize, 2usize, 32usize, 4usize);
    let group_rep = 2usize; // query heads per KV head
    let q_heads = kv_heads * group_rep;
    let layout = Arc::new(KvLayout::llama(layers, kv_heads, hd, DType::F16, ps));
    let mut pool = PagePool::new(layout.clone(), 8);
    // Two sequences: 10 and 7 positions, over pages handed out out of order.
    let seq_len = [10usize, 7];
    let all = pool.alloc(6).unwrap();
    let pages: [Vec<u32>; 2] = [vec![all[4], all[1], all[2]], vec![all[5], all[0]]];
    let row = kv_heads * hd;
    let mut kv: Vec<[Vec<f32>; 2]> = Vec::new(); // per sequence: K rows, V rows
    for (s, &len) in seq_len.iter().enumerate() {
        let k = randv(&mut r, len * row, 1.0);
        let v = randv(&mut r, len * row, 1.0);
        for p in 0..len {
            let page = pages[s][p / ps];
            for (comp, src) in [(0usize, &k), (1, &v)] {
                let vals = pool.values_mut::<f16>(page, layer, comp);
                for d in 0..row {
                    vals[(p % ps) * row + d] = f16::from_f32(src[p * row + d]);
                }
            }
        }
        kv.push([k, v]);
    }
    // Tokens: (sequence, position), several per sequence, causal.
    let toks = [(0usize, 9usize), (1, 3), (0, 0), (1, 6), (0, 4)];
    let q_stride = q_heads * hd + 8;
    let out_stride = q_heads * hd + 4;
    let q = randv(&mut r, toks.len() * q_stride, 1.0);
    let seq_of: Vec<i32> = toks.iter().map(|t| t.0 as i32).collect();
    let pos: Vec<i32> = toks.iter().map(|t| t.1 as i32).collect();
    let table: Vec<i32> = pages.iter().flatten().map(|&p| p as i32).collect();
    let table_start = [0i32, pages[0].len() as i32];
    let scratch_stride = 16usize;
    let mut out = vec![0f32; toks.len() * out_stride];
    let mut scratch = vec![0f32; toks.len() * q_heads * scratch_stride];
    let scale = 1.0 / (hd as f32).sqrt();
    let bpp = layout.bytes_per_page() as i64;
    let k_off = layout.value_offset(layer, 0, 0) as i64;
    let v_off = layout.value_offset(layer, 1, 0) as i64;
    let arena = pool.arena();
    let (pq, po, psc, pa) = (c(&q), m(&mut out), m(&mut scratch), c(arena));
    let (pso, ppos, pt, pts) = (c(&seq_of), c(&pos), c(&table), c(&table_start));
    e.launch((toks.len() as u32, q_heads as u32), 128, || unsafe {
        kern(
            pq.p(),
            q_stride as i32,
            po.p(),
            out_stride as i32,
            psc.p(),
            scratch_stride as i32,
            pa.p(),
            pso.p(),
            ppos.p(),
            pt.p(),
            pts.p(),
            bpp,
            k_off,
            v_off,
            row as i32,
            hd as i32,
            group_rep as i32,
            0,
            ps as i32,
            scale,
        )
    });
    for (ti, &(s, p)) in toks.iter().enumerate() {
        let n = p + 1;
        for g in 0..kv_heads {
            let rows16 = |src: &Vec<f32>| -> Vec<Vec<f16>> {
                (0..n)
                    .map(|j| {
                        src[j * row + g * hd..j * row + (g + 1) * hd]
                            .iter()
                            .map(|&x| f16::from_f32(x))
                            .collect()
                    })
                    .collect()
            };
            let kr = rows16(&kv[s][0]);
            let vr = rows16(&kv[s][1]);
            let keys: Vec<&[f16]> = kr.iter().map(|v| &v[..]).collect();
            let vals: Vec<&[f16]> = vr.iter().map(|v| &v[..]).collect();
            let qg =
                &q[ti * q_stride + g * group_rep * hd..ti * q_stride + (g + 1) * group_rep * hd];
            let mut want = vec![0f32; group_rep * hd];
            pdmesh_kernels::attend(qg, hd, &keys, &vals, scale, &mut want);
            let got = &out
                [ti * out_stride + g * group_rep * hd..ti * out_stride + (g + 1) * group_rep * hd];
            for (d, (a, b)) in got.iter().zip(&want).enumerate() {
                // expf (host libm here, CUDA's on a GPU) and the order of the f64 sum may
                // move a probability by an f16 ulp: 2e-3 relative to the output's scale.
                assert!(
                    (a - b).abs() <= 2e-3 * (1.0 + b.abs()),
                    "token {ti} kv head {g} [{d}]: {a} vs attend {b}"
                );
            }
        }
    }
}

// ---------------------------------------------------------------------------------------
// deepseek.cu

#[allow(clippy::type_complexity)]
type DsWriteFn = unsafe extern "C" fn(
    *const f32,
    i32,
    *const f32,
    i32,
    *mut u8,
    *const i64,
    *const i32,
    i32,
    i32,
    i32,
    i32,
    i32,
    i64,
    i64,
    i64,
    i64,
    i64,
    i64,
    i32,
    i64,
    i64,
    i64,
    i64,
);
#[allow(clippy::type_complexity)]
type DsScoresFn = unsafe extern "C" fn(
    *const f32,
    i32,
    *const f32,
    i32,
    i32,
    *const u8,
    *const i32,
    *const i32,
    *const i32,
    *const i32,
    *const i32,
    i64,
    i32,
    i32,
    i64,
    i64,
    i64,
    i64,
    *mut f32,
    i32,
);
#[allow(clippy::type_complexity)]
type DsMlaFn = unsafe extern "C" fn(
    *const f32,
    *const f32,
    *mut f32,
    *mut f32,
    *const i32,
    *const i32,
    i32,
    *const u8,
    *const i32,
    *const i32,
    *const i32,
    i64,
    i32,
    i32,
    i32,
    i32,
    i32,
    i32,
    f32,
    i32,
    i64,
    i64,
    i64,
    i64,
    i64,
    i64,
);

/// deepseek.rs's `dot` (and common.cuh's pd_dot8): eight lanes, summed pairwise, then
/// the tail in order.
fn dot8(a: &[f32], b: &[f32]) -> f32 {
    let n8 = a.len() / 8 * 8;
    let mut l = [0f32; 8];
    for c in (0..n8).step_by(8) {
        for i in 0..8 {
            l[i] += a[c + i] * b[c + i];
        }
    }
    let mut s = ((l[0] + l[1]) + (l[2] + l[3])) + ((l[4] + l[5]) + (l[6] + l[7]));
    for i in n8..a.len() {
        s += a[i] * b[i];
    }
    s
}

fn put_bf16(dst: &mut [u8], v: &[f32]) -> Vec<f32> {
    for (j, x) in v.iter().enumerate() {
        dst[2 * j..2 * j + 2].copy_from_slice(&half::bf16::from_f32(*x).to_bits().to_le_bytes());
    }
    v.iter()
        .map(|x| half::bf16::from_f32(*x).to_f32())
        .collect()
}

/// fp8 codes at `at` and per-128 ue8m0 scales at `sc_at` (bytes of `pool`); the decoded values.
fn put_fp8(pool: &mut [u8], at: usize, sc_at: usize, v: &[f32]) -> Vec<f32> {
    let mut dec = vec![0f32; v.len()];
    for (b, (blk, d)) in v.chunks(128).zip(dec.chunks_mut(128)).enumerate() {
        let mut q = vec![0u8; blk.len()];
        let s = fp8::quantize_block(blk, &mut q, ScaleRule::Ue8m0);
        pool[at + 128 * b..at + 128 * b + blk.len()].copy_from_slice(&q);
        pool[sc_at + 4 * b..sc_at + 4 * b + 4].copy_from_slice(&s.to_le_bytes());
        fp8::dequantize_block(&q, s, d);
    }
    dec
}

#[test]
fn deepseek_cache_entry_index_scores_and_mla_attention() {
    use pdmesh_kv::{IndexKDtype, MlaCacheDtype, MlaDims};
    let e = emu();
    let write: DsWriteFn = e.kernel("ds_write_entry");
    let scores: DsScoresFn = e.kernel("ds_index_scores_paged");
    let mla: DsMlaFn = e.kernel("ds_mla_attention");
    let (r, dr, di, hi, heads, dn, dv) = (
        256usize, 32usize, 128usize, 2usize, 2usize, 32usize, 32usize,
    );
    let (ps, n, layer) = (4usize, 13usize, 1usize);
    let pages_of_seq = [2i32, 0, 3, 1];
    let pts = [0i32];
    let mut rg = rng(10);
    for mla_fp8 in [false, true] {
        for ik_fp8 in [false, true] {
            let what = format!("mla fp8 {mla_fp8} index-k fp8 {ik_fp8}");
            let dims = MlaDims {
                kv_lora_rank: r,
                rope_dim: dr,
                index_head_dim: di,
            };
            let layout = KvLayout::deepseek_v32(
                2,
                dims,
                if mla_fp8 {
                    MlaCacheDtype::Fp8
                } else {
                    MlaCacheDtype::Bf16
                },
                if ik_fp8 {
                    IndexKDtype::Fp8
                } else {
                    IndexKDtype::Bf16
                },
                ps,
            )
            .unwrap();
            let bpp = layout.bytes_per_page();
            let comp = |name: &str| layout.component_index(name).unwrap();
            let val = |cn: usize, slot: usize| layout.value_offset(layer, cn, slot);
            let scl = |cn: usize, slot: usize| layout.scale_offset(layer, cn, slot).unwrap();
            let stride = |cn: usize| layout.token_stride(cn) as i64;
            let sc_stride = |cn: usize| layout.scale_stride(cn).unwrap() as i64;
            let (lat_c, ik_c) = (
                comp(if mla_fp8 { "mla_nope" } else { "mla_latent" }),
                comp("index_k"),
            );
            let rope_c = mla_fp8.then(|| comp("mla_rope"));
            let lat_off = val(lat_c, 0) as i64;
            let lat_st = stride(lat_c);
            let (lat_sc_off, lat_sc_st, rope_off, rope_st) = match rope_c {
                Some(rc) => (
                    scl(lat_c, 0) as i64,
                    sc_stride(lat_c),
                    val(rc, 0) as i64,
                    stride(rc),
                ),
                None => (0, 0, 0, 0),
            };
            let ik_off = val(ik_c, 0) as i64;
            let ik_st = stride(ik_c);
            let (ik_sc_off, ik_sc_st) = if ik_fp8 {
                (scl(ik_c, 0) as i64, sc_stride(ik_c))
            } else {
                (0, 0)
            };

            // 1. ds_write_entry: the cache bytes, exactly as the CPU's fp8 / bf16 write them.
            let lat_stride = r + dr + 3;
            let lat = randv(&mut rg, n * lat_stride, 1.0);
            let ik = randv(&mut rg, n * di, 1.0);
            let base: Vec<i64> = (0..n)
                .map(|p| layout.page_offset(pages_of_seq[p / ps] as usize) as i64)
                .collect();
            let slot: Vec<i32> = (0..n).map(|p| (p % ps) as i32).collect();
            let mut pool = vec![0u8; layout.bytes_per_pool(4)];
            let (pl, pik, pp, pb, psl) = (c(&lat), c(&ik), m(&mut pool), c(&base), c(&slot));
            e.launch((n as u32, 1), 128, || unsafe {
                write(
                    pl.p(),
                    lat_stride as i32,
                    pik.p(),
                    di as i32,
                    pp.p(),
                    pb.p(),
                    psl.p(),
                    n as i32,
                    r as i32,
                    dr as i32,
                    di as i32,
                    mla_fp8 as i32,
                    lat_off,
                    lat_st,
                    lat_sc_off,
                    lat_sc_st,
                    rope_off,
                    rope_st,
                    ik_fp8 as i32,
                    ik_off,
                    ik_st,
                    ik_sc_off,
                    ik_sc_st,
                )
            });
            let mut want = vec![0u8; pool.len()];
            let mut dlat = Vec::new(); // decoded latents: r + dr values per position
            let mut dik = Vec::new(); // decoded index keys
            for p in 0..n {
                let (pg, s) = (base[p] as usize, p % ps);
                let l = &lat[p * lat_stride..p * lat_stride + r + dr];
                let k = &ik[p * di..(p + 1) * di];
                // Where the layout itself puts slot `s`'s values and scales.
                let v_at = |cn: usize| pg + val(cn, s);
                let s_at = |cn: usize| pg + scl(cn, s);
                if let Some(rc) = rope_c {
                    let mut d = put_fp8(&mut want, v_at(lat_c), s_at(lat_c), &l[..r]);
                    d.extend(put_bf16(&mut want[v_at(rc)..], &l[r..]));
                    dlat.push(d);
                } else {
                    dlat.push(put_bf16(&mut want[v_at(lat_c)..], l));
                }
                if ik_fp8 {
                    dik.push(put_fp8(&mut want, v_at(ik_c), s_at(ik_c), k));
                } else {
                    dik.push(put_bf16(&mut want[v_at(ik_c)..], k));
                }
            }
            assert!(pool == want, "{what}: ds_write_entry cache bytes differ");

            // 2. ds_index_scores_paged: index_score over the keys read back from the cache.
            let pos = [12i32, 5];
            let seq = [0i32, 0];
            let has = [1i32, 1];
            let tt = pos.len();
            let q_stride = hi * di + 4;
            let qi = randv(&mut rg, tt * q_stride, 1.0);
            let wi = randv(&mut rg, tt * hi, 1.0);
            let out_stride = n;
            let mut sc = vec![-7f32; tt * out_stride];
            let (pq, pw, ppool, ppt, ppts) = (c(&qi), c(&wi), c(&pool), c(&pages_of_seq), c(&pts));
            let (pseq, ppos, phas, psc) = (c(&seq), c(&pos), c(&has), m(&mut sc));
            e.launch((tt as u32, 1), 128, || unsafe {
                scores(
                    pq.p(),
                    q_stride as i32,
                    pw.p(),
                    hi as i32,
                    di as i32,
                    ppool.p(),
                    ppt.p(),
                    ppts.p(),
                    pseq.p(),
                    ppos.p(),
                    phas.p(),
                    bpp as i64,
                    ps as i32,
                    ik_fp8 as i32,
                    ik_off,
                    ik_st,
                    ik_sc_off,
                    ik_sc_st,
                    psc.p(),
                    out_stride as i32,
                )
            });
            for t in 0..tt {
                for j in 0..n {
                    let got = sc[t * out_stride + j];
                    if j as i32 > pos[t] {
                        assert_eq!(got, -7.0, "{what}: score past the position written");
                        continue;
                    }
                    let want = pdmesh_engine::deepseek::index_score(
                        &qi[t * q_stride..t * q_stride + hi * di],
                        &wi[t * hi..(t + 1) * hi],
                        &dik[j],
                    );
                    assert_eq!(got.to_bits(), want.to_bits(), "{what}: score t {t} j {j}");
                }
            }

            // 3. ds_mla_attention over selected positions, against the documented absorbed
            // MLA (deepseek.rs `attention`'s order), transcribed.
            let cap = 8usize;
            let mut sel = vec![-1i32; tt * cap];
            sel[..cap].copy_from_slice(&[0, 2, 3, 5, 7, 8, 11, 12]);
            sel[cap..cap + 6].copy_from_slice(&[0, 1, 2, 3, 4, 5]);
            let sel_n = [8i32, 6];
            let q = randv(&mut rg, tt * heads * (dn + dr), 1.0);
            let kvb = randv(&mut rg, heads * (dn + dv) * r, 0.2);
            let scale = 0.125f32;
            let mut out = vec![0f32; tt * heads * dv];
            let mut scratch = vec![0f32; tt * heads * cap];
            let (pq, pkvb, po, pscr) = (c(&q), c(&kvb), m(&mut out), m(&mut scratch));
            let (psel, pseln) = (c(&sel), c(&sel_n));
            e.launch((tt as u32, heads as u32), 128, || unsafe {
                mla(
                    pq.p(),
                    pkvb.p(),
                    po.p(),
                    pscr.p(),
                    psel.p(),
                    pseln.p(),
                    cap as i32,
                    ppool.p(),
                    ppt.p(),
                    ppts.p(),
                    pseq.p(),
                    bpp as i64,
                    ps as i32,
                    heads as i32,
                    r as i32,
                    dr as i32,
                    dn as i32,
                    dv as i32,
                    scale,
                    mla_fp8 as i32,
                    lat_off,
                    lat_st,
                    lat_sc_off,
                    lat_sc_st,
                    rope_off,
                    rope_st,
                )
            });
            for t in 0..tt {
                for h in 0..heads {
                    let qh = &q[(t * heads + h) * (dn + dr)..(t * heads + h + 1) * (dn + dr)];
                    let wb = &kvb[h * (dn + dv) * r..(h + 1) * (dn + dv) * r];
                    let qabs: Vec<f32> = (0..r)
                        .map(|a| (0..dn).fold(0f32, |acc, dd| acc + qh[dd] * wb[dd * r + a]))
                        .collect();
                    let picks: Vec<&Vec<f32>> = sel[t * cap..t * cap + sel_n[t] as usize]
                        .iter()
                        .map(|&p| &dlat[p as usize])
                        .collect();
                    let s: Vec<f32> = picks
                        .iter()
                        .map(|e| scale * (dot8(&qabs, &e[..r]) + dot8(&qh[dn..], &e[r..])))
                        .collect();
                    let mx = s.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b));
                    let ex: Vec<f32> = s.iter().map(|v| (v - mx).exp()).collect();
                    let sum = ex.iter().fold(0f32, |a, &b| a + b);
                    let olat: Vec<f32> = (0..r)
                        .map(|a| {
                            ex.iter()
                                .zip(&picks)
                                .fold(0f32, |acc, (x, e)| acc + (x / sum) * e[a])
                        })
                        .collect();
                    for dd in 0..dv {
                        let want = dot8(&olat, &wb[(dn + dd) * r..(dn + dd + 1) * r]);
                        let got = out[(t * heads + h) * dv + dd];
                        // exp: the host libm here (CUDA's expf on a GPU); 1e-5 relative.
                        assert!(
                            (got - want).abs() <= 1e-5 * (1.0 + want.abs()),
                            "{what}: mla t {t} h {h} [{dd}]: {got} vs {want}"
                        );
                    }
                }
            }
        }
    }
}

type DsRmsInplaceFn = unsafe extern "C" fn(*mut f32, i32, *const f32, i32, f32);
type DsRopeInterleavedFn =
    unsafe extern "C" fn(*mut f32, i32, i32, i32, *const f32, *const f32, i32);
#[allow(clippy::type_complexity)]
type DsIndexPrepFn = unsafe extern "C" fn(
    *mut f32,
    i32,
    i32,
    i32,
    *const f32,
    *const f32,
    i32,
    *const f32,
    *const f32,
    f32,
    i32,
);
type DsScaleFn = unsafe extern "C" fn(*mut f32, i32, f32);
type DsMoeCombineFn = unsafe extern "C" fn(*mut f32, *const f32, *const i32, *const f32, i32, i32);

/// The host's rope tables (deepseek.rs `rope_at`, private there): per token, cos and sin
/// of pos × freq for each of `pairs` pairs, frequencies base^(-2i / (2 pairs)); t × pairs.
fn rope_tables(pos: &[i32], pairs: usize, base: f32) -> (Vec<f32>, Vec<f32>) {
    let freqs: Vec<f32> = (0..pairs)
        .map(|i| base.powf(-2.0 * i as f32 / (2 * pairs) as f32))
        .collect();
    pos.iter()
        .flat_map(|&p| {
            freqs.iter().map(move |&f| {
                let a = p as f32 * f;
                (a.cos(), a.sin())
            })
        })
        .unzip()
}

/// deepseek.rs's round_like_index_k (private there): 1 through bf16, 2 through fp8 (one
/// ue8m0 scale per 128 values, quantized then dequantized).
fn round_like_index_k(v: &mut [f32], mode: i32) {
    match mode {
        1 => v
            .iter_mut()
            .for_each(|x| *x = half::bf16::from_f32(*x).to_f32()),
        2 => {
            for blk in v.chunks_mut(128) {
                let mut q = vec![0u8; blk.len()];
                let s = fp8::quantize_block(blk, &mut q, ScaleRule::Ue8m0);
                fp8::dequantize_block(&q, s, blk);
            }
        }
        _ => {}
    }
}

#[test]
fn deepseek_rms_norm_inplace_bit_exact() {
    let e = emu();
    let kern: DsRmsInplaceFn = e.kernel("ds_rms_norm_inplace");
    let mut r = rng(14);
    let eps = 1e-6f32;
    // The latent rows of kv (r + dr values): the norm on the first r, the rope values
    // after them (and a little more stride) untouched.
    for (dim, dr) in [(512usize, 64usize), (100, 8)] {
        let (t, stride) = (3usize, dim + dr + 3);
        let x = randv(&mut r, t * stride, 3.0);
        let w = randv(&mut r, dim, 1.5);
        let mut got = x.clone();
        let (pg, pw) = (m(&mut got), c(&w));
        e.launch((t as u32, 1), 256, || unsafe {
            kern(pg.p(), stride as i32, pw.p(), dim as i32, eps)
        });
        for ti in 0..t {
            let xr = &x[ti * stride..ti * stride + dim];
            let (scale, cpu_scale) = rms_scales(xr, eps);
            for j in 0..stride {
                let g = got[ti * stride + j];
                if j >= dim {
                    assert_eq!(g.to_bits(), x[ti * stride + j].to_bits(), "wrote past dim");
                    continue;
                }
                // The documented order bit for bit; model.rs's rms_norm within 2 ulps.
                let exact = xr[j] * scale * w[j];
                assert_eq!(g.to_bits(), exact.to_bits(), "dim {dim} row {ti} [{j}]");
                let cpu = xr[j] * cpu_scale * w[j];
                assert!(
                    ulps(g, cpu) <= 2,
                    "dim {dim} row {ti} [{j}]: {g} vs CPU {cpu}"
                );
            }
        }
    }
}

#[test]
fn deepseek_rope_interleaved_bit_exact() {
    let e = emu();
    let kern: DsRopeInterleavedFn = e.kernel("ds_rope_interleaved");
    let mut r = rng(15);
    let pos = [0i32, 5, 4000, 17];
    let t = pos.len();
    let (dn, dr, rank) = (16usize, 80usize, 40usize); // 40 pairs over 32 threads
    let pairs = dr / 2;
    let (cos, sin) = rope_tables(&pos, pairs, 10000.0);
    // The host's two uses: each query head's last dr values (heads, head stride dn + dr,
    // offset dn; here with 3 spare columns per row), and the latent's rope values (one
    // "head" at offset r).
    for (heads, row_stride, head_stride, offset) in [
        (3usize, 3 * (dn + dr) + 3, dn + dr, dn),
        (1, rank + dr, 0, rank),
    ] {
        let x = randv(&mut r, t * row_stride, 2.0);
        let mut want = x.clone();
        for ti in 0..t {
            for h in 0..heads {
                let at = ti * row_stride + h * head_stride + offset;
                pdmesh_engine::deepseek::rope_interleaved(
                    &mut want[at..at + dr],
                    &cos[ti * pairs..(ti + 1) * pairs],
                    &sin[ti * pairs..(ti + 1) * pairs],
                );
            }
        }
        let mut got = x.clone();
        let (pg, pc, ps) = (m(&mut got), c(&cos), c(&sin));
        e.launch((t as u32, heads as u32), 32, || unsafe {
            kern(
                pg.p(),
                row_stride as i32,
                head_stride as i32,
                offset as i32,
                pc.p(),
                ps.p(),
                pairs as i32,
            )
        });
        // The tables are inputs: no transcendental in the kernel, so exact.
        assert_bits_eq(&format!("ds_rope_interleaved heads {heads}"), &got, &want);
    }
}

#[test]
fn deepseek_index_prep_bit_exact() {
    let e = emu();
    let kern: DsIndexPrepFn = e.kernel("ds_index_prep");
    let mut r = rng(16);
    let pos = [3i32, 0, 2500];
    let t = pos.len();
    let eps = 1e-6f32;
    // dim: less than the block, the real 128, the largest (1024); rope_dim/2 pairs each.
    for (dim, rope_dim) in [(64usize, 16usize), (128, 64), (1024, 64)] {
        let (cos, sin) = rope_tables(&pos, rope_dim / 2, 10000.0);
        let ln_w: Vec<f32> = randv(&mut r, dim, 0.5).iter().map(|v| 1.0 + v).collect();
        let ln_b = randv(&mut r, dim, 0.1);
        // The host's two uses: the index key (one vector, LayerNorm, no rounding) and the
        // index queries (several heads, no LayerNorm, rounded like the stored keys).
        for (vecs, has_ln, round) in [(1usize, 1i32, 0i32), (3, 0, 1), (3, 0, 2)] {
            let what = format!("dim {dim} rope {rope_dim} vecs {vecs} ln {has_ln} round {round}");
            // A row stride 5 past the vectors: those values must stay as they were.
            let row_stride = vecs * dim + 5;
            let x: Vec<f32> = randv(&mut r, t * row_stride, 2.0)
                .iter()
                .map(|v| v + 0.3)
                .collect();
            let mut want = x.clone();
            for ti in 0..t {
                let (cs, sn) = (
                    &cos[ti * rope_dim / 2..(ti + 1) * rope_dim / 2],
                    &sin[ti * rope_dim / 2..(ti + 1) * rope_dim / 2],
                );
                for v in 0..vecs {
                    let at = ti * row_stride + v * dim;
                    let xv = &mut want[at..at + dim];
                    if has_ln == 1 {
                        pdmesh_engine::deepseek::layer_norm(xv, &ln_w, &ln_b, eps);
                    }
                    pdmesh_engine::deepseek::rope_half(&mut xv[..rope_dim], cs, sn);
                    pdmesh_engine::deepseek::hadamard(xv);
                    round_like_index_k(xv, round);
                }
            }
            let mut got = x.clone();
            let (pg, pc, ps, pw, pb) = (m(&mut got), c(&cos), c(&sin), c(&ln_w), c(&ln_b));
            e.launch((t as u32, vecs as u32), 128, || unsafe {
                kern(
                    pg.p(),
                    row_stride as i32,
                    dim as i32,
                    rope_dim as i32,
                    pc.p(),
                    ps.p(),
                    has_ln,
                    pw.p(),
                    pb.p(),
                    eps,
                    round,
                )
            });
            // The CPU's operation order throughout (f64 LayerNorm statistics in index
            // order, the same butterflies, the same roundings): exact.
            assert_bits_eq(&what, &got, &want);
        }
    }
}

#[test]
fn deepseek_scale_and_moe_combine_bit_exact() {
    let e = emu();
    let mut r = rng(17);

    // ds_scale: the indexer weights times iscale; nothing past n.
    let scale: DsScaleFn = e.kernel("ds_scale");
    let (n, tail, sentinel) = (1000usize, 20usize, -4242.0f32);
    let mut x = randv(&mut r, n + tail, 5.0);
    x[n..].fill(sentinel);
    let s = 1.0 / (4f32.sqrt() * 128f32.sqrt());
    let mut want: Vec<f32> = x.iter().map(|v| v * s).collect();
    want[n..].fill(sentinel);
    let px = m(&mut x);
    e.launch((n.div_ceil(256) as u32, 1), 256, || unsafe {
        scale(px.p(), n as i32, s)
    });
    assert_bits_eq("ds_scale", &x, &want);

    // ds_moe_combine: each token's k expert outputs (rows of y, in the host's expert-major
    // order, so not the token's) weighted and summed in routing order, then added to the
    // shared expert's output.
    let combine: DsMoeCombineFn = e.kernel("ds_moe_combine");
    let (t, k, d) = (4usize, 3usize, 300usize);
    let total = t * k;
    let y = randv(&mut r, total * d, 2.0);
    let mut rows: Vec<i32> = (0..total as i32).collect();
    for i in (1..total).rev() {
        rows.swap(i, r.random_range(0..=i));
    }
    let wts: Vec<f32> = (0..total).map(|_| r.random_range(0.0f32..2.5)).collect();
    let out0 = randv(&mut r, t * d, 1.0);
    // deepseek.rs `ffn` (private there): acc from 0, acc += w * y per route, then
    // add_in_place(out, acc).
    let mut want = out0.clone();
    for i in 0..t {
        let mut acc = vec![0f32; d];
        for s in 0..k {
            let (w, row) = (wts[i * k + s], rows[i * k + s] as usize);
            for (a, &yv) in acc.iter_mut().zip(&y[row * d..(row + 1) * d]) {
                *a += w * yv;
            }
        }
        for (o, a) in want[i * d..(i + 1) * d].iter_mut().zip(&acc) {
            *o += a;
        }
    }
    let mut out = out0.clone();
    let (po, py, pr, pw) = (m(&mut out), c(&y), c(&rows), c(&wts));
    e.launch((t as u32, 1), 256, || unsafe {
        combine(po.p(), py.p(), pr.p(), pw.p(), k as i32, d as i32)
    });
    assert_bits_eq("ds_moe_combine", &out, &want);
}
