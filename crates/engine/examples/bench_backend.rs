//! Prefill and decode throughput of one backend at several batch sizes, as JSON lines.
//!
//! `cargo run --release -p pdmesh-engine [--features cuda] --example bench_backend --
//!  [--model PATH] [--device cpu|cuda] [--gpus 0,1] [--fast] [--batches 1,16,64]
//!  [--prompt-len 128] [--tokens 64] [--threads N] [--tp N] [--load-back PAGES]
//!  [--matmul]`
//!
//! Prefill: B distinct prompts of `--prompt-len` tokens submitted at once, timed until
//! every first token (prompt tokens per second). Decode: the following `--tokens` steps
//! of the same B streams (generated tokens per second, all streams together).
//! `--model dsa-tiny` writes the seeded DeepSeek V3.2 tiny checkpoint (random weights, the
//! default model's tokenizer) to a temporary directory and measures that.
//! `--load-back PAGES` (cuda builds, `--device cuda`): host → device copy bandwidth of that
//! many of the model's KV pages, as the engine copies them (per page and layer, pinned),
//! one copy per page, and one cudaMemcpy of the same bytes, pinned and pageable.
//! `--matmul` (cuda builds): instead of the model, each matrix-product kernel
//! (`matmul_rows`, `matmul_tiles`, cuBLAS) timed alone on SmolLM2's shapes and a larger
//! one, at 1 to 8192 tokens: where the tiled kernel overtakes the row kernel, and how far
//! the invariant kernels are from cuBLAS.

use std::time::Instant;

use pdmesh_engine::{Engine, EngineConfig, GenRequest, GpuConfig, SamplingParams};

mod common;

use common::tokens_of;

struct Args {
    model: Option<String>,
    cuda: bool,
    gpus: Vec<usize>,
    fast: bool,
    batches: Vec<usize>,
    prompt_len: usize,
    tokens: u32,
    threads: usize,
    tp: usize,
    load_back: usize,
    matmul: bool,
}

fn parse() -> Args {
    let mut a = Args {
        model: None,
        cuda: false,
        gpus: vec![0],
        fast: false,
        batches: vec![1, 16, 64],
        prompt_len: 128,
        tokens: 64,
        threads: 0,
        tp: 1,
        load_back: 0,
        matmul: false,
    };
    let mut it = std::env::args().skip(1);
    let list = |s: String| -> Vec<usize> {
        s.split(',')
            .map(|v| v.trim().parse().expect("a number"))
            .collect()
    };
    while let Some(flag) = it.next() {
        let mut val = || it.next().unwrap_or_else(|| panic!("{flag} needs a value"));
        match flag.as_str() {
            "--model" => a.model = Some(val()),
            "--device" => {
                a.cuda = match val().as_str() {
                    "cpu" => false,
                    "cuda" => true,
                    other => panic!("--device {other:?}: expected cpu or cuda"),
                }
            }
            "--gpus" => a.gpus = list(val()),
            "--fast" => a.fast = true,
            "--batches" => a.batches = list(val()),
            "--prompt-len" => a.prompt_len = val().parse().expect("a number"),
            "--tokens" => a.tokens = val().parse().expect("a number"),
            "--threads" => a.threads = val().parse().expect("a number"),
            "--tp" => a.tp = val().parse().expect("a number"),
            "--load-back" => a.load_back = val().parse().expect("a number"),
            "--matmul" => a.matmul = true,
            other => panic!("unknown flag {other}"),
        }
    }
    a
}

/// (prompt tokens/s, generated tokens/s, KV bytes held and a dense layout's bytes for the
/// same pages during the last decode step) for `batch` streams.
fn run(
    e: &mut Engine,
    batch: usize,
    prompt_len: usize,
    tokens: u32,
    round: usize,
) -> (f64, f64, (usize, usize)) {
    let vocab = e.info().vocab_size;
    for i in 0..batch {
        // Distinct prompts, so the prefix cache shares nothing between streams or rounds.
        let prompt: Vec<u32> = (0..prompt_len)
            .map(|j| ((i * 7919 + j * 104_729 + round * 15_485_863) as u32 + 3) % vocab)
            .collect();
        let params = SamplingParams {
            ignore_eos: true,
            ..SamplingParams::greedy(tokens)
        };
        e.submit(GenRequest {
            id: format!("r{round}s{i}"),
            prompt,
            params,
        })
        .expect("valid request");
    }
    let t0 = Instant::now();
    let mut first = 0;
    while first < batch {
        first += tokens_of(&e.step());
    }
    let prefill = t0.elapsed().as_secs_f64();
    let t1 = Instant::now();
    let mut generated = 0;
    let mut kv = (0, 0);
    while e.has_work() {
        let pool = e.pool();
        if pool.used_pages() > 0 {
            kv = (
                pool.held_bytes(),
                pool.used_pages() * pool.layout().bytes_per_page(),
            );
        }
        generated += tokens_of(&e.step());
    }
    let decode = t1.elapsed().as_secs_f64();
    (
        (batch * prompt_len) as f64 / prefill,
        generated as f64 / decode,
        kv,
    )
}

fn main() {
    let a = parse();
    if a.matmul {
        return matmul(&a);
    }
    let _tiny; // keeps a synthesized checkpoint's directory alive
    let model = match a.model.as_deref() {
        None => pdmesh_gguf::models::require_default_model(),
        Some("dsa-tiny") => {
            let dir = tempfile::tempdir().expect("a temporary directory");
            let tokenizer = tempfile::tempdir().expect("a temporary directory");
            pdmesh_tokenize::TextTokenizer::from_path(pdmesh_gguf::models::require_default_model())
                .expect("the default model's tokenizer")
                .write_hf_dir(tokenizer.path())
                .expect("the tokenizer's files");
            pdmesh_engine::deepseek_synth::write(
                dir.path(),
                &pdmesh_engine::deepseek_synth::tiny_config(),
                7,
                Some(tokenizer.path()),
            )
            .expect("write the tiny checkpoint");
            let path = dir.path().to_path_buf();
            _tiny = dir;
            path
        }
        Some(p) => std::path::PathBuf::from(p),
    };
    if a.load_back > 0 {
        load_back(&a, &model);
    }
    let label = match a.model.as_deref() {
        Some("dsa-tiny") => "dsa-tiny".to_string(),
        _ => model
            .file_name()
            .and_then(|n| n.to_str())
            .unwrap_or("model")
            .to_string(),
    };
    let biggest = a.batches.iter().copied().max().unwrap_or(1);
    let mut cfg = EngineConfig::new(&model);
    cfg.threads = a.threads;
    cfg.tp = a.tp;
    cfg.max_batch = biggest;
    cfg.prefill_chunk = (biggest * a.prompt_len).max(512);
    cfg.kv_pages = (biggest * (a.prompt_len + a.tokens as usize)).div_ceil(cfg.page_size) * 2 + 64;
    cfg.prefix_cache = false;
    if a.cuda {
        cfg.gpu = Some(GpuConfig {
            devices: a.gpus.clone(),
            invariant: !a.fast,
            ..GpuConfig::default()
        });
    }
    let mut e = Engine::load(cfg).expect("engine loads");
    run(&mut e, 1, 16, 4, 0); // warm-up: kernels loaded, buffers touched
    for (round, &b) in a.batches.iter().enumerate() {
        let (prefill, decode, (held, dense)) = run(&mut e, b, a.prompt_len, a.tokens, round + 1);
        println!(
            "{}",
            serde_json::json!({
                "model": label,
                "device": if a.cuda { "cuda" } else { "cpu" },
                "gpus": if a.cuda { a.gpus.len() } else { 0 },
                "invariant": !a.fast,
                "tp": a.tp,
                "batch": b,
                "prompt_len": a.prompt_len,
                "tokens": a.tokens,
                "prefill_tok_s": (prefill * 10.0).round() / 10.0,
                "decode_tok_s": (decode * 10.0).round() / 10.0,
                "kv_held_bytes": held,
                "kv_dense_bytes": dense,
            })
        );
    }
}

#[cfg(feature = "cuda")]
fn load_back(a: &Args, model: &std::path::Path) {
    let gguf = pdmesh_gguf::GgufFile::open(model).expect("a GGUF model");
    let layout = pdmesh_engine::LlamaConfig::from_gguf(&gguf)
        .expect("a llama model")
        .kv_layout(16);
    let r = pdmesh_engine::cuda::measure_load_back(a.gpus[0], &layout, a.load_back, 5)
        .expect("load-back measurement");
    println!(
        "{}",
        serde_json::json!({
            "load_back": r,
            "pages": a.load_back,
            "page_bytes": layout.bytes_per_page(),
            // The figures to read: the engine's copies against one pinned cudaMemcpy.
            "per_layer_vs_bulk": r.per_layer_gb_s / r.bulk_pinned_gb_s,
            "per_page_vs_bulk": r.per_page_gb_s / r.bulk_pinned_gb_s,
        })
    );
}

#[cfg(feature = "cuda")]
fn matmul(a: &Args) {
    // SmolLM2's products (q/o, k/v, gate/up, down, the vocabulary) and a 4096² one.
    let shapes = [
        (576, 576),
        (192, 576),
        (1536, 576),
        (576, 1536),
        (49152, 576),
        (4096, 4096),
    ];
    let all: Vec<_> = shapes
        .iter()
        .flat_map(|&(r, c)| [1, 8, 16, 64, 512, 2048, 8192].map(|t| (r, c, t)))
        .collect();
    let times = pdmesh_engine::cuda::measure_matmul(a.gpus[0], &all).expect("matmul measurement");
    for t in times {
        println!("{}", serde_json::json!({ "matmul": t }));
    }
}

#[cfg(not(feature = "cuda"))]
fn matmul(_: &Args) {
    panic!("--matmul needs a build with --features cuda");
}

#[cfg(not(feature = "cuda"))]
fn load_back(_: &Args, _: &std::path::Path) {
    panic!("--load-back needs a build with --features cuda");
}
