//! `sglang.grpc.scheduler.SglangScheduler` on a real worker, through the generated tonic
//! client: every RPC a gateway calls, the same tokens as `pdmesh.worker.v1`, and invalid
//! requests answered with gRPC codes.

use crate::common::*;
use pdmesh_proto::sglang::grpc::scheduler as s;
use pdmesh_proto::smg::grpc::common as c;
use s::sglang_scheduler_client::SglangSchedulerClient;
use sha2::Digest;

async fn sglang(srv: &Server) -> SglangSchedulerClient<Channel> {
    srv.svc.client(SglangSchedulerClient::new).await
}

fn sreq(id: &str, stream: bool, max_new_tokens: u32) -> s::GenerateRequest {
    s::GenerateRequest {
        request_id: id.into(),
        tokenized: Some(s::TokenizedInput {
            original_text: String::new(),
            input_ids: PROMPT.to_vec(),
        }),
        sampling_params: Some(s::SamplingParams {
            temperature: 0.0,
            top_p: 1.0,
            top_k: -1,
            repetition_penalty: 1.0,
            max_new_tokens: Some(max_new_tokens),
            ignore_eos: true,
            ..Default::default()
        }),
        stream,
        return_logprob: true,
        // Output logprobs only, as smg asks.
        logprob_start_len: -1,
        ..Default::default()
    }
}

/// Every message of a Generate stream.
async fn all(mut st: Streaming<s::GenerateResponse>) -> Vec<s::generate_response::Response> {
    let mut out = Vec::new();
    while let Some(m) = tokio::time::timeout(HANG, st.message())
        .await
        .expect("stream hung")
        .unwrap()
    {
        out.push(m.response.expect("a response"));
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn generate_streams_chunks_then_complete_with_the_native_tokens() {
    let mut srv = start().await;
    let mut sg = sglang(&srv).await;
    let (native, _) = srv.complete(request("n", PROMPT, greedy(6))).await;

    // Streaming: a chunk per token with cumulative counts, then `complete` repeating the
    // last chunk's tokens (as SGLang's own server does).
    let msgs = all(answer(sg.generate(sreq("st", true, 6))).await).await;
    assert_eq!(msgs.len(), 7, "{msgs:?}");
    let mut streamed: Vec<u32> = Vec::new();
    for (i, m) in msgs[..6].iter().enumerate() {
        let s::generate_response::Response::Chunk(ch) = m else {
            panic!("chunk expected: {m:?}")
        };
        assert_eq!(ch.completion_tokens, i as u32 + 1);
        assert_eq!(ch.prompt_tokens, PROMPT.len() as u32);
        let lp = ch.output_logprobs.as_ref().expect("logprobs asked for");
        assert_eq!(lp.token_ids, ch.token_ids);
        assert!(lp.token_logprobs[0] <= 0.0);
        streamed.extend(&ch.token_ids);
    }
    assert_eq!(streamed, native);
    let s::generate_response::Response::Complete(done) = &msgs[6] else {
        panic!("complete expected: {:?}", msgs[6])
    };
    assert_eq!(done.finish_reason, "length");
    assert_eq!(done.output_ids, native[5..]);
    assert_eq!(
        (done.prompt_tokens, done.completion_tokens),
        (PROMPT.len() as u32, 6)
    );

    // Not streaming: one `complete` with every token.
    let msgs = all(answer(sg.generate(sreq("one", false, 6))).await).await;
    let [s::generate_response::Response::Complete(done)] = &msgs[..] else {
        panic!("one complete expected: {msgs:?}")
    };
    assert_eq!(done.output_ids, native);
    assert_eq!(
        done.output_logprobs.as_ref().unwrap().token_logprobs.len(),
        6
    );

    // Top logprobs: per position, the most likely first; greedy took the first.
    let mut top = sreq("top", false, 6);
    top.top_logprobs_num = 3;
    let msgs = all(answer(sg.generate(top.clone())).await).await;
    let [s::generate_response::Response::Complete(done)] = &msgs[..] else {
        panic!("one complete expected: {msgs:?}")
    };
    let lp = done.output_logprobs.as_ref().unwrap();
    assert_eq!(lp.top_logprobs.len(), 6);
    for (i, t) in lp.top_logprobs.iter().enumerate() {
        assert_eq!((t.token_ids.len(), t.values.len()), (3, 3));
        assert_eq!(t.token_ids[0], native[i]);
        assert_eq!(t.values[0], lp.token_logprobs[i]);
        assert!(t.values[0] >= t.values[1] && t.values[1] >= t.values[2]);
    }
    assert!(done.input_logprobs.is_none(), "logprob_start_len -1: none");
    // Input logprobs from position 3 on: every one has a value (only the first token has
    // none), with their alternatives.
    top.request_id = "input".into();
    top.logprob_start_len = 3;
    let msgs = all(answer(sg.generate(top)).await).await;
    let [s::generate_response::Response::Complete(scored)] = &msgs[..] else {
        panic!("one complete expected: {msgs:?}")
    };
    assert_eq!(scored.output_ids, native, "the output is the same");
    let input = scored.input_logprobs.as_ref().expect("asked for");
    assert_eq!(input.token_ids, PROMPT[3..]);
    assert_eq!(input.token_logprobs.len(), PROMPT.len() - 3);
    for (v, t) in input.token_logprobs.iter().zip(&input.top_logprobs) {
        let v = v.value.expect("after the first token");
        assert!(v <= 0.0 && t.values.len() == 3 && t.values[0] >= v);
    }

    // A stop token: the matched id is reported and not part of the output.
    let mut stop = sreq("stop", false, 6);
    let sp = stop.sampling_params.as_mut().unwrap();
    sp.stop_token_ids = vec![native[2]];
    sp.ignore_eos = false;
    let msgs = all(answer(sg.generate(stop)).await).await;
    let [s::generate_response::Response::Complete(done)] = &msgs[..] else {
        panic!("{msgs:?}")
    };
    assert_eq!(done.finish_reason, "stop");
    assert_eq!(done.output_ids, native[..2]);
    assert_eq!(
        done.matched_stop,
        Some(s::generate_complete::MatchedStop::MatchedTokenId(native[2]))
    );
    srv.wait_free_pages(KV_PAGES).await;
    srv.svc.shutdown.cancel();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn model_server_and_load_info_describe_the_worker() {
    let srv = start().await;
    let mut sg = sglang(&srv).await;
    let h = answer(sg.health_check(s::HealthCheckRequest {})).await;
    assert!(h.healthy, "{h:?}");

    let m = answer(sg.get_model_info(s::GetModelInfoRequest {})).await;
    assert_eq!(m.max_context_length, MAX_CONTEXT as i32);
    assert_eq!(m.vocab_size, 49152);
    assert!(m.is_generation);
    assert!(!m.eos_token_ids.is_empty());
    assert_eq!(m.architectures, ["LlamaForCausalLM"]);
    // The tokenizer path is a real HF directory that reads back with its chat template.
    let tok =
        pdmesh_chat::ChatTokenizer::from_hf_dir(std::path::Path::new(&m.tokenizer_path)).unwrap();
    assert!(tok.chat_template().is_some());

    let info = answer(sg.get_server_info(s::GetServerInfoRequest {})).await;
    let args = info.server_args.unwrap().fields;
    let num = |k: &str| match args[k].kind {
        Some(prost_types::value::Kind::NumberValue(n)) => n,
        ref other => panic!("{k}: {other:?}"),
    };
    assert_eq!(
        args["disaggregation_mode"].kind,
        Some(prost_types::value::Kind::StringValue("null".into()))
    );
    assert_eq!(
        (
            num("dp_size"),
            num("max_running_requests"),
            num("context_length")
        ),
        (1.0, 8.0, MAX_CONTEXT as f64)
    );
    assert_eq!(info.server_type, "grpc");

    let loads = answer(sg.get_loads(s::GetLoadsRequest {
        dp_rank: None,
        include: vec!["all".into()],
    }))
    .await;
    assert_eq!(loads.dp_rank_count, 1);
    let l = &loads.loads[0];
    assert_eq!(
        (l.num_running_reqs, l.num_waiting_reqs, l.num_used_tokens),
        (0, 0, 0)
    );
    assert_eq!(l.max_total_num_tokens, (KV_PAGES * 16) as i32);
    let e = sg
        .get_loads(s::GetLoadsRequest {
            dp_rank: Some(3),
            include: vec![],
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument);

    // While a request runs, the loads say so.
    let mut running = answer(sg.generate(sreq("busy", true, 200))).await;
    running.message().await.unwrap().unwrap();
    let l = answer(sg.get_loads(s::GetLoadsRequest::default()))
        .await
        .loads
        .remove(0);
    assert_eq!(l.num_running_reqs, 1);
    assert!(l.num_used_tokens > 0);
    drop(running);
    srv.svc.shutdown.cancel();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_tokenizer_zip_matches_its_hash_and_holds_the_three_files() {
    let srv = start().await;
    let mut sg = sglang(&srv).await;
    let mut st = answer(sg.get_tokenizer(c::GetTokenizerRequest {})).await;
    let (mut zip, mut sha) = (Vec::new(), String::new());
    while let Some(ch) = st.message().await.unwrap() {
        assert!(sha.is_empty(), "the hash comes on the last chunk only");
        zip.extend(ch.data);
        sha = ch.sha256;
    }
    let digest: String = sha2::Sha256::digest(&zip)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    assert_eq!(sha, digest);
    let mut z = zip::ZipArchive::new(std::io::Cursor::new(zip)).unwrap();
    let mut names: Vec<&str> = z.file_names().collect();
    names.sort_unstable();
    assert_eq!(
        names,
        ["config.json", "tokenizer.json", "tokenizer_config.json"]
    );
    let mut cfg = String::new();
    std::io::Read::read_to_string(&mut z.by_name("tokenizer_config.json").unwrap(), &mut cfg)
        .unwrap();
    assert!(cfg.contains("chat_template"), "{cfg}");
    srv.svc.shutdown.cancel();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn abort_stops_a_request_and_an_unknown_id_is_harmless() {
    let mut srv = start().await;
    let mut sg = sglang(&srv).await;
    let r = answer(sg.abort(s::AbortRequest {
        request_id: "nobody".into(),
        reason: String::new(),
    }))
    .await;
    assert!(!r.success, "{r:?}");

    let mut st = answer(sg.generate(sreq("victim", true, 400))).await;
    st.message().await.unwrap().unwrap();
    let r = answer(sg.abort(s::AbortRequest {
        request_id: "victim".into(),
        reason: "test".into(),
    }))
    .await;
    assert!(r.success, "{r:?}");
    let rest = all(st).await;
    match rest.last() {
        Some(s::generate_response::Response::Complete(done)) => {
            assert_eq!(done.finish_reason, "abort")
        }
        other => panic!("{other:?}"),
    }
    srv.wait_free_pages(KV_PAGES).await;
    srv.svc.shutdown.cancel();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn invalid_requests_get_codes_and_hold_nothing() {
    let mut srv = start().await;
    let mut sg = sglang(&srv).await;
    let mut cases: Vec<(s::GenerateRequest, &str)> = Vec::new();
    let mut r = sreq("a", false, 4);
    r.tokenized = None;
    cases.push((r, "tokenized"));
    let mut r = sreq("b", false, 4);
    r.sampling_params.as_mut().unwrap().n = 17;
    cases.push((r, "sampling_params.n"));
    let mut r = sreq("c", false, 4);
    r.top_logprobs_num = 21;
    cases.push((r, "top_logprobs_num"));
    let mut r = sreq("c2", false, 4);
    r.token_ids_logprob = vec![5];
    cases.push((r, "token_ids_logprob"));
    let mut r = sreq("d", false, 4);
    r.tokenized.as_mut().unwrap().input_ids = vec![1, 999_999];
    cases.push((r, "outside the vocabulary"));
    let mut r = sreq("e", false, 4);
    r.sampling_params.as_mut().unwrap().constraint = Some(
        s::sampling_params::Constraint::JsonSchema(r#"{"type": "strin"}"#.into()),
    );
    cases.push((r, "grammar"));
    let mut r = sreq("f", false, 4);
    r.disaggregated_params = Some(s::DisaggregatedParams {
        bootstrap_host: "127.0.0.1".into(),
        bootstrap_port: 1,
        bootstrap_room: 9,
    });
    r.sampling_params.as_mut().unwrap().max_new_tokens = Some(4);
    // A unified worker ignores the room (as SGLang's would without disaggregation).
    let ok = all(answer(sg.generate(r)).await).await;
    assert!(matches!(
        ok.last(),
        Some(s::generate_response::Response::Complete(_))
    ));
    for (req, needle) in cases {
        let e = match sg.generate(req).await {
            Err(e) => e,
            Ok(st) => st.into_inner().message().await.unwrap_err(),
        };
        assert_eq!(e.code(), Code::InvalidArgument, "{needle}: {e:?}");
        assert!(e.message().contains(needle), "{needle}: {}", e.message());
    }
    let e = sg.embed(s::EmbedRequest::default()).await.unwrap_err();
    assert_eq!(e.code(), Code::Unimplemented);
    srv.wait_free_pages(KV_PAGES).await;
    srv.svc.shutdown.cancel();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kv_events_list_the_cached_prompt_pages_with_their_tokens() {
    let mut srv = start().await;
    let mut sg = sglang(&srv).await;
    let mut ev = answer(sg.subscribe_kv_events(c::SubscribeKvEventsRequest::default())).await;
    let mut next = async || {
        let b = tokio::time::timeout(HANG, ev.message())
            .await
            .expect("event stream hung")
            .unwrap()
            .expect("stream ended");
        assert_eq!(b.events.len(), 1);
        (
            b.sequence_number,
            b.events[0].data.clone().expect("event data"),
        )
    };
    let (seq, first) = next().await;
    assert_eq!(seq, 1);
    assert!(
        matches!(first, c::kv_cache_event::Data::Cleared(_)),
        "{first:?}"
    );
    // A finished request hands its whole prompt pages to the cache: they come as blocks
    // whose tokens are the prompt's, a page each, chained from one parent.
    all(answer(sg.generate(sreq("cache-me", false, 2))).await).await;
    srv.wait_free_pages(KV_PAGES).await;
    let mut blocks = Vec::new();
    let mut last = seq;
    while blocks.len() < PROMPT.len() / 16 {
        let (seq, data) = next().await;
        assert_eq!(seq, last + 1, "numbered in order");
        last = seq;
        if let c::kv_cache_event::Data::Stored(st) = data {
            blocks.extend(st.blocks);
        }
    }
    let tokens: Vec<u32> = blocks.iter().flat_map(|b| b.token_ids.clone()).collect();
    assert_eq!(tokens, PROMPT[..tokens.len()]);
    assert!(
        blocks
            .iter()
            .all(|b| b.block_size == 16 && b.token_ids.len() == 16)
    );
    srv.svc.shutdown.cancel();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn flush_cache_empties_the_device_prefix_cache() {
    let mut srv = start().await;
    let mut sg = sglang(&srv).await;
    all(answer(sg.generate(sreq("c", false, 4))).await).await;
    srv.wait_free_pages(KV_PAGES).await;
    let cached = srv.info().await.cached_pages;
    assert!(cached >= 1);
    let r = answer(sg.flush_cache(c::FlushCacheRequest { timeout_s: 0.0 })).await;
    assert!(r.success, "{r:?}");
    assert!(
        r.message.contains(&format!("flushed {cached} pages")),
        "{r:?}"
    );
    let info = srv.info().await;
    assert_eq!((info.cached_pages, info.free_pages), (0, KV_PAGES));
    srv.svc.shutdown.cancel();
}

/// A Gemma 3 worker's KV events after a prompt longer than its 512-token sliding window:
/// the cached pages the window slid past (their local layers given back) are named
/// unservable on pdmesh's stream, and SGLang's stream, which cannot say that, does not
/// claim them: its chain starts at the one page a hit could end at.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hybrid_models_events_do_not_claim_prefixes_its_window_slid_past() {
    let mut srv = start_with(|c| {
        c.model = pdmesh_gguf::models::require_gemma3_model();
        c.max_context = Some(1024);
    })
    .await;
    let mut sg = sglang(&srv).await;
    let mut native = srv.kv_events().await;
    let mut blocks = answer(sg.subscribe_kv_events(c::SubscribeKvEventsRequest::default())).await;
    let prompt: Vec<u32> = (0..700).map(|i| 1000 + i * 7).collect();
    let (out, _) = srv.complete(request("long", &prompt, greedy(4))).await;
    srv.wait_free_pages(KV_PAGES).await;
    // Its prompt and the 3 tokens computed after it: 43 whole pages. The last step's
    // window began at position 191 (page 11): a hit of fewer than 43 pages would need
    // pages before it.
    let computed = [&prompt[..], &out[..3]].concat();
    let seed = u64::from_str_radix(&srv.info().await.kv_layout_fingerprint, 16).unwrap();
    let hashes = pdmesh_kv::page_hashes(seed, &computed, 16);
    assert_eq!(hashes.len(), 43);
    let stored = loop {
        if let Some(pdmesh_proto::cache::v1::kv_event::Kind::Stored(st)) =
            next_of(&mut native).await.kind
        {
            break st;
        }
    };
    assert_eq!(stored.hashes, hashes);
    assert_eq!(stored.unservable, hashes[..42]);
    let stored = loop {
        if let Some(c::kv_cache_event::Data::Stored(st)) =
            next_of(&mut blocks).await.events[0].data.clone()
        {
            break st;
        }
    };
    let claimed: Vec<i64> = stored.blocks.iter().map(|b| b.block_hash).collect();
    assert_eq!(claimed, [hashes[42] as i64]);
    assert_eq!(stored.parent_block_hash, Some(hashes[41] as i64));
    assert_eq!(stored.blocks[0].token_ids, computed[42 * 16..43 * 16]);
    srv.svc.shutdown.cancel();
}

/// The next message of an event stream, within [`HANG`].
async fn next_of<T>(s: &mut Streaming<T>) -> T {
    tokio::time::timeout(HANG, s.message())
        .await
        .expect("event stream hung")
        .unwrap()
        .expect("stream ended")
}
