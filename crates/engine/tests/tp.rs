//! Tensor parallelism (`EngineConfig::tp`): the same requests under 2 and 3 ranks give
//! the tokens and the bit-identical logits of the unsharded model — greedy and seeded
//! sampling, a mixed batch, chunked prefill, prefix-cache reuse — while each rank computes
//! only its share of every matrix, cache write and attention (`Engine::rank_work`). Also
//! the shard plan, the host all-gather, and the values refused at load.

mod common;

use std::collections::HashMap;
use std::time::Duration;

use common::{Outcome, assert_same_turns, cached_tokens, fixture_prompts, greedy, run_all};
use pdmesh_engine::tp::{
    Collective, HostCollective, RankShard, RankWork, ShardPlan, WorkKind, split,
};
use pdmesh_engine::{Engine, EngineConfig, EngineError, GenRequest, LlamaConfig, SamplingParams};

const PAGES: usize = 128;

fn sampled(id: &str, prompt: &[u32], seed: u64) -> GenRequest {
    GenRequest {
        id: id.into(),
        prompt: prompt.to_vec(),
        params: SamplingParams {
            temperature: 0.8,
            top_p: 0.9,
            top_k: 40,
            seed: Some(seed),
            max_tokens: Some(10),
            ignore_eos: true,
            ..Default::default()
        },
    }
}

fn cat(parts: &[&[u32]]) -> Vec<u32> {
    parts.concat()
}

/// Two rounds on one engine: a batch of five requests of mixed lengths (greedy and
/// seeded sampling) prefilled 7 tokens per step beside the others' decodes, then two
/// requests extending earlier prompts, which start from the prefix cache. Returns both
/// rounds' outcomes and what each rank computed.
fn workload(tp: usize) -> (Vec<HashMap<String, Outcome>>, Vec<RankWork>) {
    let mut e = common::engine(|c| {
        c.tp = tp;
        c.prefill_chunk = 7;
        c.page_size = 8;
        c.kv_pages = PAGES;
    });
    let fx = fixture_prompts();
    let long = cat(&[&fx[0], &fx[3]]);
    let first = run_all(
        &mut e,
        vec![
            greedy("g0", &fx[2], 10),
            greedy("g1", &fx[4], 10),
            greedy("g2", &long, 10),
            sampled("s0", &fx[1], 7),
            sampled("s1", &fx[5], 11),
        ],
    );
    let second = run_all(
        &mut e,
        vec![
            greedy("p0", &cat(&[&long, &fx[6]]), 8),
            sampled("p1", &cat(&[&fx[2], &fx[7]]), 3),
        ],
    );
    for id in ["p0", "p1"] {
        assert!(
            cached_tokens(&second[id]) >= 56,
            "tp={tp} {id}: the prefix cache must serve the earlier prompt, got {}",
            cached_tokens(&second[id])
        );
    }
    for (id, o) in first.iter().chain(&second) {
        let want = if id == "p0" { 8 } else { 10 };
        assert_eq!(o.tokens.len(), want, "tp={tp} {id}: tokens");
        assert_eq!(o.logits.len(), want, "tp={tp} {id}: a logits row per token");
    }
    assert_eq!(common::available(&e), PAGES, "tp={tp}: every page returned");
    (vec![first, second], e.rank_work())
}

#[test]
fn tp2_and_tp3_are_bit_identical_to_tp1_and_each_rank_computes_only_its_share() {
    let cfg = default_config();
    let (one, whole) = workload(1);
    assert_eq!(whole.len(), 1, "tp=1 is one rank");
    let whole = &whole[0];
    assert!(whole.tokens > 0);
    for kind in WorkKind::ALL {
        let all = kind.units(&RankShard::whole(&cfg), cfg.head_dim);
        let s = whole.share(kind);
        assert_eq!(s.units, Some(all.clone()), "tp=1 computes all of {kind:?}");
        assert!(
            s.computed > 0 && s.computed % all.len() as u64 == 0,
            "{kind:?}"
        );
    }
    for tp in [2, 3] {
        let (turns, ranks) = workload(tp);
        assert_same_turns(&one, &turns, &format!("tp={tp} vs tp=1"));
        assert_sharded(&cfg, tp, whole, &ranks);
    }
}

/// `ranks` split every piece of `whole`'s work: rank `r` was handed exactly the units
/// (rows, cache columns, KV heads) of its shard in the plan, those cover the whole model
/// once and in order, and it computed them for every token `whole` did, so together the
/// ranks did tp=1's work once, none of it twice.
fn assert_sharded(cfg: &LlamaConfig, tp: usize, whole: &RankWork, ranks: &[RankWork]) {
    let plan = ShardPlan::new(cfg, tp).unwrap();
    assert_eq!(ranks.len(), tp, "tp={tp}: one count per rank");
    for (r, w) in ranks.iter().enumerate() {
        assert_eq!(w.tokens, whole.tokens, "tp={tp} rank {r}: the same batches");
    }
    for kind in WorkKind::ALL {
        let all = whole.share(kind);
        let total = all.units.clone().unwrap().len() as u64;
        let mut next = 0;
        let mut sum = 0;
        for (r, w) in ranks.iter().enumerate() {
            let got = w.share(kind);
            let units = got.units.clone().unwrap_or_else(|| {
                panic!("tp={tp} rank {r} computed no {kind:?}");
            });
            let what = format!("tp={tp} rank {r} {kind:?}: {got:?} of {all:?}");
            assert_eq!(units, kind.units(&plan.ranks[r], cfg.head_dim), "{what}");
            assert_eq!(units.start, next, "{what}: after the previous rank's");
            assert!((units.len() as u64) < total, "{what}: not the whole");
            assert_eq!(
                got.computed * total,
                all.computed * units.len() as u64,
                "{what}: its units for every token tp=1 computed"
            );
            next = units.end;
            sum += got.computed;
        }
        assert_eq!(
            next as u64, total,
            "tp={tp} {kind:?}: the shares cover the model"
        );
        assert_eq!(sum, all.computed, "tp={tp} {kind:?}: tp=1's work, once");
    }
}

/// The default model's hyper-parameters, as the engine reads them.
fn default_config() -> LlamaConfig {
    let path = pdmesh_gguf::models::require_default_model();
    let gguf = pdmesh_gguf::GgufFile::open(&path).expect("the default model opens");
    LlamaConfig::from_gguf(&gguf).expect("a llama-family model")
}

fn load(f: impl FnOnce(&mut EngineConfig)) -> EngineError {
    let mut cfg = EngineConfig::new(pdmesh_gguf::models::require_default_model());
    cfg.kv_pages = 16;
    f(&mut cfg);
    Engine::load(cfg).expect_err("the engine must refuse this configuration")
}

#[test]
fn tp_zero_and_tp_above_the_kv_heads_are_refused() {
    match load(|c| c.tp = 0) {
        EngineError::InvalidParam { field: "tp", .. } => {}
        other => panic!("tp=0: {other}"),
    }
    // SmolLM2-135M has 3 KV heads: a fourth rank would own none.
    match load(|c| c.tp = 4) {
        e @ EngineError::InvalidParam { field: "tp", .. } => {
            let msg = e.to_string();
            assert!(
                msg.contains("3 KV heads") && msg.contains("at most 3"),
                "{msg}"
            );
        }
        other => panic!("tp=4: {other}"),
    }
    match load(|c| {
        c.model_path = common::tiny_dir().to_path_buf();
        c.tp = 2;
    }) {
        EngineError::Unsupported(msg) => assert!(msg.contains("llama-family"), "{msg}"),
        other => panic!("DeepSeek with tp=2: {other}"),
    }
}

fn llama(heads: usize, kv_heads: usize, dim: usize, ffn: usize, vocab: usize) -> LlamaConfig {
    LlamaConfig {
        layers: 1,
        dim,
        ffn,
        heads,
        kv_heads,
        head_dim: dim / heads,
        rope_base: 10000.0,
        rms_eps: 1e-5,
        context_length: 2048,
        vocab,
    }
}

#[test]
fn shard_plans_cover_every_unit_exactly_once() {
    for n in [1, 3, 7, 576, 1536, 49152] {
        for world in 1..=n.min(5) {
            let ranges = split(n, world);
            assert_eq!(ranges.len(), world);
            assert_eq!(ranges[0].start, 0);
            assert_eq!(ranges[world - 1].end, n);
            for w in ranges.windows(2) {
                assert_eq!(w[0].end, w[1].start, "{n}/{world}: contiguous");
            }
            let (lo, hi) = (
                ranges.iter().map(|r| r.len()).min().unwrap(),
                ranges.iter().map(|r| r.len()).max().unwrap(),
            );
            assert!(lo >= 1 && hi - lo <= 1, "{n}/{world}: {ranges:?}");
        }
    }
    // SmolLM2-135M over two ranks: an uneven split of 3 KV groups of 3 query heads.
    let smol = llama(9, 3, 576, 1536, 49152);
    let p = ShardPlan::new(&smol, 2).unwrap();
    assert_eq!(p.world, 2);
    assert_eq!(p.ranks[0].kv_heads, 0..1);
    assert_eq!(p.ranks[1].kv_heads, 1..3);
    assert_eq!(p.ranks[0].q_heads, 0..3);
    assert_eq!(p.ranks[1].q_heads, 3..9);
    assert_eq!(p.ranks[0].dim, 0..288);
    assert_eq!(p.ranks[1].ffn, 768..1536);
    assert_eq!(p.ranks[1].vocab, 24576..49152);
    for (cfg, world) in [
        (smol.clone(), 3),
        (llama(32, 8, 4096, 11008, 32000), 3),
        (llama(32, 8, 4096, 11008, 32000), 8),
        (llama(12, 12, 768, 3072, 50257), 5),
    ] {
        let p = ShardPlan::new(&cfg, world).unwrap();
        let rep = cfg.heads / cfg.kv_heads;
        let mut next = (0, 0, 0, 0, 0);
        for s in &p.ranks {
            assert!(!s.kv_heads.is_empty(), "every rank owns a KV head");
            assert_eq!(s.q_heads, s.kv_heads.start * rep..s.kv_heads.end * rep);
            assert_eq!(
                (
                    s.kv_heads.start,
                    s.q_heads.start,
                    s.dim.start,
                    s.ffn.start,
                    s.vocab.start
                ),
                next
            );
            next = (
                s.kv_heads.end,
                s.q_heads.end,
                s.dim.end,
                s.ffn.end,
                s.vocab.end,
            );
        }
        assert_eq!(
            next,
            (cfg.kv_heads, cfg.heads, cfg.dim, cfg.ffn, cfg.vocab),
            "{p}"
        );
    }
    assert!(ShardPlan::new(&smol, 0).is_err());
    assert!(ShardPlan::new(&smol, 4).is_err());
}

#[test]
fn host_all_gather_joins_uneven_blocks_in_rank_order() {
    let world = 3;
    let coll = HostCollective::new(world);
    assert_eq!(coll.world(), world);
    // Value of (round, rank, row, col) in rank's local block.
    let val = |round: usize, rank: usize, row: usize, col: usize| {
        (round * 1000 + rank * 100 + row * 10 + col) as f32
    };
    let shapes: [&[usize]; 4] = [&[1, 3, 2], &[2, 0, 5], &[4, 4, 4], &[0, 1, 0]];
    std::thread::scope(|s| {
        for rank in 0..world {
            let coll = &coll;
            s.spawn(move || {
                let _abort = coll.abort_on_panic();
                for round in 0..12 {
                    let cols = shapes[round % shapes.len()];
                    let rows = 1 + round % 4;
                    let local: Vec<f32> = (0..rows)
                        .flat_map(|r| (0..cols[rank]).map(move |c| val(round, rank, r, c)))
                        .collect();
                    if (round + rank) % 4 == 0 {
                        // Someone arrives late: nobody may read or overwrite early.
                        std::thread::sleep(Duration::from_millis(5));
                    }
                    let total: usize = cols.iter().sum();
                    let mut out = vec![f32::NAN; rows * total];
                    coll.all_gather(rank, &local, cols, rows, &mut out);
                    let mut want = Vec::new();
                    for r in 0..rows {
                        for (owner, &c) in cols.iter().enumerate() {
                            want.extend((0..c).map(|c| val(round, owner, r, c)));
                        }
                    }
                    assert_eq!(out, want, "round {round}, rank {rank}");
                }
            });
        }
    });
}

#[test]
fn a_rank_that_panics_releases_the_others() {
    let coll = HostCollective::new(3);
    let results: Vec<bool> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..3)
            .map(|rank| {
                let coll = &coll;
                s.spawn(move || {
                    let _abort = coll.abort_on_panic();
                    let mut out = vec![0f32; 3];
                    coll.all_gather(rank, &[1.0], &[1, 1, 1], 1, &mut out);
                    if rank == 1 {
                        std::thread::sleep(Duration::from_millis(20));
                        panic!("rank 1 fails between two gathers");
                    }
                    coll.all_gather(rank, &[2.0], &[1, 1, 1], 1, &mut out);
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().is_err()).collect()
    });
    assert_eq!(
        results,
        [true, true, true],
        "every rank ends, none waits forever"
    );
}
