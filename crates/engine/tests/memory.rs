//! Weights stay quantized: after loading the default model and generating, the process's
//! resident memory stays under 1.5x the GGUF file size plus the KV pool.

mod common;

fn rss_bytes() -> usize {
    let status = std::fs::read_to_string("/proc/self/status").expect("Linux /proc");
    let line = status
        .lines()
        .find(|l| l.starts_with("VmRSS:"))
        .expect("VmRSS line");
    line.split_whitespace()
        .nth(1)
        .unwrap()
        .parse::<usize>()
        .unwrap()
        * 1024
}

#[test]
fn resident_memory_is_bounded_by_the_quantized_file() {
    let path = pdmesh_gguf::models::require_default_model();
    let file = std::fs::metadata(&path).unwrap().len() as usize;
    let mut e = common::engine(|c| {
        c.kv_pages = 512;
        c.capture_logits = false;
    });
    let pool = e.pool().layout().bytes_per_pool(e.pool().total_pages());
    let fx = common::fixtures();
    let prompt: Vec<u32> = fx["prompts"][0]["prompt_ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_u64().unwrap() as u32)
        .collect();
    let out = common::run_all(&mut e, vec![common::greedy("m", &prompt, 16)]);
    assert_eq!(out["m"].tokens.len(), 16);
    let rss = rss_bytes();
    let budget = file * 3 / 2 + pool;
    eprintln!(
        "rss {} MiB, file {} MiB, pool {} MiB",
        rss >> 20,
        file >> 20,
        pool >> 20
    );
    assert!(
        rss < budget,
        "resident {rss} B exceeds 1.5 x file ({file} B) + pool ({pool} B)"
    );
}
