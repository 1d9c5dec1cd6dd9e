//! matmul.cu: `matmul_rows` and `matmul_tiles` in their fixed order, batch invariance,
//! and SwiGLU.

use rand::Rng;

use crate::emu::{assert_bits_eq, c, emu, m, randv, rng};

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
    // SAFETY: the emulated kernel reads and writes only the buffers bound above, each sized as it expects.
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
        // SAFETY: the emulated kernel reads and writes only the buffers bound above, each sized as it expects.
        e.launch(((rows - 5).div_ceil(8) as u32, 1), 256, || unsafe {
            kern(pw5.p(), pxt.p(), po.p(), ri - 5, ci, si, col0 + 5)
        });
        // SAFETY: the emulated kernel reads and writes only the buffers bound above, each sized as it expects.
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
        // SAFETY: the emulated kernel reads and writes only the buffers bound above, each sized as it expects.
        e.launch((rows.div_ceil(8) as u32, n as u32), 256, || unsafe {
            kern(pw.p(), px.p(), pr.p(), ri, ci, si, col0)
        });
        e.launch(
            (rows.div_ceil(32) as u32, n.div_ceil(16) as u32),
            256,
            // SAFETY: the emulated kernel reads and writes only the buffers bound above, each sized as it expects.
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
    // SAFETY: the emulated kernel reads and writes only the buffers bound above, each sized as it expects.
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
    // deepseek/weights.rs / model.rs: silu(gate) * up, g / (1 + exp(-g)) * u.
    let want: Vec<f32> = (0..n)
        .map(|i| g[i] / (1.0 + (-g[i]).exp()) * u[i])
        .collect();
    let (pg, pu) = (m(&mut g), c(&u));
    // SAFETY: the emulated kernel reads and writes only the buffers bound above, each sized as it expects.
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
