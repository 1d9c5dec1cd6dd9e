//! Wire compatibility of pdmesh's SGLang scheduler types with smg's reference protos.
//!
//! `fixtures/sglang_wire.hex` holds messages that scripts/proto/sglang_wire_fixtures.py
//! built with the Python classes generated from smg-grpc-proto's own .proto files. Each is
//! decoded here with pdmesh's prost types and must equal the same values built in Rust,
//! and prost must re-encode exactly the reference's bytes. The values below mirror that
//! script's `build_messages`; change both together and regenerate the fixture.

use std::collections::{BTreeMap, HashMap};

use pdmesh_proto::sglang::grpc::scheduler as s;
use pdmesh_proto::smg::grpc::common as c;
use prost::Message;
use prost_types::value::Kind;

const FIXTURE: &str = include_str!("fixtures/sglang_wire.hex");

fn fixtures() -> HashMap<&'static str, Vec<u8>> {
    FIXTURE
        .lines()
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
        .map(|l| {
            let (name, hex) = l.split_once(' ').expect("`name hex` lines");
            let bytes = (0..hex.len())
                .step_by(2)
                .map(|i| u8::from_str_radix(&hex[i..i + 2], 16).expect("hex"))
                .collect();
            (name, bytes)
        })
        .collect()
}

/// Decodes the reference bytes, compares with `expected`, and checks prost's encoding of
/// `expected` is byte-for-byte the reference's and round-trips.
fn check<M: Message + Default + PartialEq + std::fmt::Debug>(name: &str, expected: M) {
    let all = fixtures();
    let bytes = all
        .get(name)
        .unwrap_or_else(|| panic!("fixture {name} missing"));
    let decoded = M::decode(bytes.as_slice()).unwrap_or_else(|e| panic!("{name}: {e}"));
    assert_eq!(
        decoded, expected,
        "{name}: reference bytes decode to other values"
    );
    let ours = expected.encode_to_vec();
    assert_eq!(
        &ours, bytes,
        "{name}: prost encodes other bytes than the reference"
    );
    assert_eq!(
        M::decode(ours.as_slice()).unwrap(),
        expected,
        "{name}: round trip"
    );
}

fn value(kind: Kind) -> prost_types::Value {
    prost_types::Value { kind: Some(kind) }
}
fn num(v: f64) -> prost_types::Value {
    value(Kind::NumberValue(v))
}
fn text(v: &str) -> prost_types::Value {
    value(Kind::StringValue(v.into()))
}
fn boolean(v: bool) -> prost_types::Value {
    value(Kind::BoolValue(v))
}

/// A Generate answer to request `id`.
fn answer(id: &str, response: s::generate_response::Response) -> s::GenerateResponse {
    s::GenerateResponse {
        request_id: id.into(),
        response: Some(response),
    }
}

// The sections a load report carries, with the values the reference script gives them in
// SGLang's own messages (`GetLoads`) and in smg's (the KV event stream's engine load):
// the two spell each section with a type of their own.
macro_rules! memory {
    ($($t:ident)::+) => {
        $($t)::+ {
            weight_gb: 1.5,
            kv_cache_gb: 2.5,
            graph_gb: 0.5,
            token_capacity: 4096,
        }
    };
}
macro_rules! speculative {
    ($($t:ident)::+) => {
        $($t)::+ {
            accept_length: 2.5,
            accept_rate: 0.75,
        }
    };
}
macro_rules! lora {
    ($($t:ident)::+) => {
        $($t)::+ {
            slots_used: 1,
            slots_total: 4,
            utilization: 0.25,
        }
    };
}
macro_rules! queues {
    ($($t:ident)::+) => {
        $($t)::+ {
            waiting: 2,
            grammar: 1,
            paused: 0,
            retracted: 3,
        }
    };
}
macro_rules! disaggregation {
    ($($t:ident)::+, $mode:expr) => {
        $($t)::+ {
            mode: $mode.into(),
            prefill_prealloc_queue_reqs: 1,
            prefill_inflight_queue_reqs: 2,
            decode_prealloc_queue_reqs: 3,
            decode_transfer_queue_reqs: 4,
            decode_retracted_queue_reqs: 5,
            kv_transfer_speed_gb_s: 10.5,
            kv_transfer_latency_ms: 0.125,
        }
    };
}
fn object(fields: Vec<(&str, prost_types::Value)>) -> prost_types::Struct {
    prost_types::Struct {
        fields: fields
            .into_iter()
            .map(|(k, v)| (k.to_string(), v))
            .collect::<BTreeMap<_, _>>(),
    }
}
fn strings(v: &[&str]) -> Vec<String> {
    v.iter().map(|s| s.to_string()).collect()
}

#[test]
fn generate_request_full() {
    let tensor = s::TensorData {
        data: vec![1, 0, 0, 0, 0, 0, 0, 0],
        shape: vec![1],
        dtype: "int64".into(),
    };
    let expected = s::GenerateRequest {
        request_id: "req-42".into(),
        tokenized: Some(s::TokenizedInput {
            original_text: "Hello".into(),
            input_ids: vec![1, 15043, 300000],
        }),
        mm_inputs: Some(s::MultimodalInputs {
            image_urls: strings(&["http://img/a.png"]),
            video_urls: strings(&["v.mp4"]),
            audio_urls: strings(&["a.wav"]),
            pixel_values: Some(s::TensorData {
                data: vec![0, 0, 0x80, 0x3f],
                shape: vec![1, 1],
                dtype: "float32".into(),
            }),
            image_data: vec![b"\x89PNG".to_vec()],
            video_data: vec![b"vid".to_vec()],
            audio_data: vec![b"aud".to_vec()],
            modalities: strings(&["image"]),
            model_specific_tensors: HashMap::from([("image_grid_thw".to_string(), tensor)]),
            im_token_id: Some(0),
            mm_placeholders: vec![s::PlaceholderRange {
                offset: 1,
                length: 2,
            }],
        }),
        sampling_params: Some(s::SamplingParams {
            temperature: 0.5,
            top_p: 0.75,
            top_k: -1,
            min_p: 0.125,
            frequency_penalty: 0.25,
            presence_penalty: -0.5,
            repetition_penalty: 1.5,
            max_new_tokens: Some(64),
            stop: strings(&["</s>", "\n\n"]),
            stop_token_ids: vec![2, 128009],
            skip_special_tokens: true,
            spaces_between_special_tokens: true,
            constraint: Some(s::sampling_params::Constraint::JsonSchema(
                r#"{"type":"object"}"#.into(),
            )),
            n: 2,
            min_new_tokens: 1,
            ignore_eos: true,
            no_stop_trim: true,
            stream_interval: Some(0),
            logit_bias: HashMap::from([("15043".to_string(), -2.5)]),
            custom_params: Some(object(vec![
                ("alpha", num(1.5)),
                ("mode", text("x")),
                (
                    "flags",
                    prost_types::Value {
                        kind: Some(Kind::ListValue(prost_types::ListValue {
                            values: vec![
                                boolean(true),
                                prost_types::Value {
                                    kind: Some(Kind::NullValue(0)),
                                },
                            ],
                        })),
                    },
                ),
                (
                    "nested",
                    prost_types::Value {
                        kind: Some(Kind::StructValue(object(vec![("k", num(3.0))]))),
                    },
                ),
            ])),
        }),
        return_logprob: true,
        logprob_start_len: -1,
        top_logprobs_num: 5,
        token_ids_logprob: vec![7, 8],
        return_hidden_states: true,
        disaggregated_params: Some(s::DisaggregatedParams {
            bootstrap_host: "10.0.0.7".into(),
            bootstrap_port: 8998,
            bootstrap_room: 123456789,
        }),
        custom_logit_processor: "proc".into(),
        timestamp: Some(prost_types::Timestamp {
            seconds: 1700000000,
            nanos: 500,
        }),
        log_metrics: true,
        input_embeds: vec![0.5, -1.0],
        lora_id: "lora-a".into(),
        data_parallel_rank: Some(0),
        stream: true,
        require_reasoning: true,
    };
    check("generate_request", expected);
}

#[test]
fn generate_request_minimal() {
    let expected = s::GenerateRequest {
        request_id: "req-43".into(),
        tokenized: Some(s::TokenizedInput {
            input_ids: vec![5, 6],
            ..Default::default()
        }),
        sampling_params: Some(s::SamplingParams {
            temperature: 1.0,
            constraint: Some(s::sampling_params::Constraint::Regex("[a-z]+".into())),
            ..Default::default()
        }),
        stream: false,
        ..Default::default()
    };
    check("generate_request_minimal", expected);
}

#[test]
fn generate_response_chunk() {
    let chunk = s::GenerateStreamChunk {
        token_ids: vec![10, 11],
        prompt_tokens: 3,
        completion_tokens: 2,
        cached_tokens: 1,
        reasoning_tokens: 1,
        output_logprobs: Some(s::OutputLogProbs {
            token_logprobs: vec![-0.5, -0.25],
            token_ids: vec![10, 11],
            top_logprobs: vec![s::TopLogProbs {
                values: vec![-0.5, -1.0],
                token_ids: vec![10, 12],
            }],
            token_ids_logprobs: vec![s::TopLogProbs {
                values: vec![-3.0],
                token_ids: vec![7],
            }],
        }),
        hidden_states: vec![0.25, 0.5],
        input_logprobs: Some(s::InputLogProbs {
            token_logprobs: vec![
                s::InputTokenLogProb { value: None },
                s::InputTokenLogProb { value: Some(-1.5) },
            ],
            token_ids: vec![1, 15043],
            top_logprobs: vec![s::TopLogProbs {
                values: vec![-1.5],
                token_ids: vec![15043],
            }],
        }),
        index: 1,
    };
    let expected = answer("req-42", s::generate_response::Response::Chunk(chunk));
    check("generate_response_chunk", expected);
}

#[test]
fn generate_response_complete() {
    let done = s::GenerateComplete {
        output_ids: vec![10, 11, 2],
        finish_reason: "stop".into(),
        prompt_tokens: 3,
        completion_tokens: 3,
        cached_tokens: 1,
        reasoning_tokens: 2,
        output_logprobs: Some(s::OutputLogProbs {
            token_logprobs: vec![-0.5],
            token_ids: vec![10],
            ..Default::default()
        }),
        all_hidden_states: vec![s::HiddenStates {
            values: vec![0.5],
            layer: -1,
            position: 4,
        }],
        matched_stop: Some(s::generate_complete::MatchedStop::MatchedStopStr(
            "</s>".into(),
        )),
        input_logprobs: Some(s::InputLogProbs {
            token_ids: vec![1],
            ..Default::default()
        }),
        index: 1,
        spec_accepted_tokens: 5,
        spec_draft_tokens: 8,
    };
    let expected = answer("req-42", s::generate_response::Response::Complete(done));
    check("generate_response_complete", expected);

    // A matched stop token 0 is present on the wire (oneof member), not "no stop".
    let done = s::GenerateComplete {
        finish_reason: "length".into(),
        matched_stop: Some(s::generate_complete::MatchedStop::MatchedTokenId(0)),
        ..Default::default()
    };
    let expected = answer("req-44", s::generate_response::Response::Complete(done));
    check("generate_response_complete_token", expected);
}

#[test]
fn embed_and_management() {
    check(
        "embed_request",
        s::EmbedRequest {
            request_id: "emb-1".into(),
            tokenized: Some(s::TokenizedInput {
                input_ids: vec![5, 6],
                ..Default::default()
            }),
            mm_inputs: Some(s::MultimodalInputs {
                image_urls: strings(&["u"]),
                ..Default::default()
            }),
            sampling_params: Some(s::SamplingParams {
                temperature: 1.0,
                ..Default::default()
            }),
            token_type_ids: vec![0, 1],
            data_parallel_rank: 3,
            is_cross_encoder: true,
            texts: strings(&["a", "b"]),
        },
    );
    check(
        "embed_response",
        s::EmbedResponse {
            embedding_dim: 3,
            embedding: vec![0.5, 0.25, -1.0],
            prompt_tokens: 2,
        },
    );
    check(
        "health_check_response",
        s::HealthCheckResponse {
            healthy: true,
            message: "ok".into(),
        },
    );
    check(
        "abort_request",
        s::AbortRequest {
            request_id: "req-42".into(),
            reason: "client gone".into(),
        },
    );
    check(
        "abort_response",
        s::AbortResponse {
            success: true,
            message: "aborted".into(),
        },
    );
    check(
        "flush_cache_request",
        c::FlushCacheRequest { timeout_s: 2.5 },
    );
    check(
        "flush_cache_response",
        c::FlushCacheResponse {
            success: true,
            message: "flushed".into(),
        },
    );
    check(
        "get_tokenizer_chunk",
        c::GetTokenizerChunk {
            data: b"PK\x03\x04".to_vec(),
            sha256: "ab".repeat(32),
        },
    );
    check(
        "subscribe_kv_events_request",
        c::SubscribeKvEventsRequest {
            start_sequence_number: 17,
            load_records_before_first_batch: true,
        },
    );
}

#[test]
fn get_model_info_response() {
    let expected = s::GetModelInfoResponse {
        model_path: "/models/llama".into(),
        tokenizer_path: "/models/llama/tok".into(),
        is_generation: true,
        preferred_sampling_params: r#"{"temperature":0.6}"#.into(),
        weight_version: "v1".into(),
        served_model_name: "llama".into(),
        max_context_length: 8192,
        vocab_size: 128256,
        supports_vision: true,
        model_type: "llama".into(),
        eos_token_ids: vec![128001, 128009],
        pad_token_id: 128004,
        bos_token_id: 128000,
        max_req_input_len: 8000,
        architectures: strings(&["LlamaForCausalLM"]),
        id2label_json: r#"{"0":"neg"}"#.into(),
        num_labels: 1,
        default_sampling_params_json: r#"{"top_p":0.9}"#.into(),
    };
    check("get_model_info_response", expected);
}

#[test]
fn get_server_info_response() {
    let expected = s::GetServerInfoResponse {
        server_args: Some(object(vec![
            ("model_path", text("/m")),
            ("tp_size", num(2.0)),
            ("enable_x", boolean(false)),
        ])),
        scheduler_info: Some(object(vec![("max_total_num_tokens", num(4096.0))])),
        active_requests: 3,
        is_paused: true,
        last_receive_timestamp: 1700000000.25,
        uptime_seconds: 12.5,
        sglang_version: "0.5.0".into(),
        server_type: "grpc".into(),
        start_time: Some(prost_types::Timestamp {
            seconds: 1699999000,
            nanos: 0,
        }),
        max_total_num_tokens: 4096,
    };
    check("get_server_info_response", expected);
}

#[test]
fn get_loads() {
    check(
        "get_loads_request",
        s::GetLoadsRequest {
            dp_rank: Some(0),
            include: strings(&["core", "memory"]),
        },
    );
    let full = s::SchedulerLoad {
        dp_rank: 0,
        num_running_reqs: 4,
        num_waiting_reqs: 2,
        num_total_reqs: 6,
        num_used_tokens: 1000,
        max_total_num_tokens: 4096,
        token_usage: 0.25,
        gen_throughput: 100.5,
        cache_hit_rate: 0.5,
        utilization: 0.75,
        max_running_requests: 32,
        num_waiting_uncached_tokens: 77,
        memory: Some(memory!(s::MemoryMetrics)),
        speculative: Some(speculative!(s::SpeculativeMetrics)),
        lora: Some(lora!(s::LoRaMetrics)),
        disaggregation: Some(disaggregation!(s::DisaggregationMetrics, "prefill")),
        queues: Some(queues!(s::QueueMetrics)),
    };
    // An empty section is still present.
    let sparse = s::SchedulerLoad {
        dp_rank: 1,
        num_running_reqs: 1,
        memory: Some(s::MemoryMetrics::default()),
        ..Default::default()
    };
    let expected = s::GetLoadsResponse {
        timestamp: "2024-01-01T00:00:00Z".into(),
        version: "0.5.0".into(),
        dp_rank_count: 2,
        loads: vec![full, sparse],
        aggregate: Some(s::AggregateMetrics {
            total_running_reqs: 5,
            total_waiting_reqs: 2,
            total_reqs: 7,
            avg_token_usage: 0.125,
            avg_throughput: 200.25,
            avg_utilization: 0.5,
        }),
    };
    check("get_loads_response", expected);
}

#[test]
fn kv_event_batch() {
    use c::kv_block_extra_key::Key;
    use c::kv_cache_event::Data;
    let stored = c::KvBlocksStored {
        blocks: vec![c::KvBlock {
            block_hash: -5,
            token_ids: vec![1, 2, 3, 4],
            block_size: 4,
            lora_id: Some(0),
            cache_level: Some(0),
            extra_keys: vec![
                c::KvBlockExtraKey {
                    key: Some(Key::Text("lora".into())),
                },
                c::KvBlockExtraKey {
                    key: Some(Key::Blob(vec![1])),
                },
                c::KvBlockExtraKey {
                    key: Some(Key::Number(-3)),
                },
                c::KvBlockExtraKey {
                    key: Some(Key::Multimodal(c::KvMultimodalKey {
                        identifier: "img".into(),
                        offset: 2,
                    })),
                },
            ],
        }],
        parent_block_hash: Some(-9),
        tier: Some(c::KvCacheTier::Host as i32),
        medium: Some("CPU_PINNED".into()),
        group_idx: Some(0),
        kv_cache_spec_kind: Some("full".into()),
        kv_cache_spec_sliding_window: Some(128),
        locality: Some(c::KvCacheLocality::Local as i32),
        ownership: Some("engine".into()),
        session_id: Some("s".into()),
        lora_name: Some("l".into()),
        cache_salt: Some("salt".into()),
    };
    let removed = c::KvBlocksRemoved {
        block_hashes: vec![-5, 7],
        cache_level: Some(1),
        tier: Some(c::KvCacheTier::Device as i32),
        medium: Some("GPU".into()),
        group_idx: Some(1),
        locality: Some(c::KvCacheLocality::Remote as i32),
        ownership: Some("agent".into()),
    };
    let load = c::EngineLoad {
        running_requests: 3,
        waiting_requests: 1,
        waiting_uncached_tokens: Some(0),
        token_usage: 0.5,
        active_token_usage: Some(0.25),
        gen_throughput: 50.5,
        max_running_requests: 16,
        age_ms: 7,
        sample: 99,
        load_only: true,
        cache_hit_rate: Some(0.75),
        num_used_tokens: Some(512),
        max_total_num_tokens: Some(4096),
        memory: Some(memory!(c::EngineMemory)),
        queues: Some(queues!(c::EngineQueues)),
        speculative: Some(speculative!(c::EngineSpeculative)),
        lora: Some(lora!(c::EngineLora)),
        disaggregation: Some(disaggregation!(c::EngineDisaggregation, "decode")),
        engine_silence_ms: Some(1500),
        engine_reports_steps: Some(false),
        prefill_pending_tokens: Some(300),
    };
    let expected = c::KvEventBatch {
        sequence_number: 18,
        timestamp: 1700000000.5,
        events: vec![
            c::KvCacheEvent {
                event_id: 1,
                data: Some(Data::Stored(stored)),
            },
            c::KvCacheEvent {
                event_id: 2,
                data: Some(Data::Removed(removed)),
            },
            c::KvCacheEvent {
                event_id: 3,
                data: Some(Data::Cleared(c::KvCacheCleared {
                    ownership: Some("engine".into()),
                })),
            },
            c::KvCacheEvent {
                event_id: 4,
                data: Some(Data::Cleared(c::KvCacheCleared::default())),
            },
        ],
        dp_rank: Some(0),
        snapshot: Some(c::KvSnapshotChunk {
            index: 1,
            count: 3,
            blocks: 100,
            unknown_before: 2,
        }),
        load: Some(load),
    };
    check("kv_event_batch", expected);
}

/// The gRPC service name the gateway dials (method paths are `/<name>/<Method>`; the
/// methods themselves are checked against the reference by the fixture script).
#[test]
fn service_name() {
    assert_eq!(
        s::sglang_scheduler_server::SERVICE_NAME,
        "sglang.grpc.scheduler.SglangScheduler"
    );
}
