//! Reading SGLang's requests: proto3 zeros, unsupported features, rooms and grammars.

use pdmesh_proto::sglang::grpc::scheduler as s;

use super::request::{generate_request, room, sampling};
use crate::pd::Role;

#[test]
fn proto_zeros_read_as_sglang_reads_them() {
    let p = sampling(Some(s::SamplingParams::default())).unwrap();
    assert_eq!(p.temperature, Some(0.0), "temperature 0 is greedy");
    assert_eq!((p.top_p, p.top_k, p.repetition_penalty), (None, None, None));
    assert_eq!(p.max_tokens, 0, "absent max_new_tokens: up to the context");
    let p = sampling(Some(s::SamplingParams {
        temperature: 0.7,
        top_p: 0.9,
        top_k: 40,
        repetition_penalty: 1.1,
        max_new_tokens: Some(12),
        stop: vec!["\n".into()],
        stop_token_ids: vec![2],
        ignore_eos: true,
        min_new_tokens: 3,
        logit_bias: [("28".to_owned(), -100.0)].into(),
        ..Default::default()
    }))
    .unwrap();
    assert_eq!(
        (
            p.temperature,
            p.top_p,
            p.top_k,
            p.repetition_penalty,
            p.max_tokens
        ),
        (Some(0.7), Some(0.9), Some(40), Some(1.1), 12)
    );
    assert_eq!(
        (p.stop, p.stop_token_ids, p.ignore_eos),
        (vec![b"\n".to_vec()], vec![2], true)
    );
    assert_eq!((p.min_tokens, p.logit_bias), (3, [(28, -100.0)].into()));
}

#[test]
fn unsupported_features_are_invalid_argument_naming_the_field() {
    for (params, field) in [
        (
            s::SamplingParams {
                n: 17,
                ..Default::default()
            },
            "sampling_params.n",
        ),
        (
            s::SamplingParams {
                logit_bias: [("the".to_owned(), 1.0)].into(),
                ..Default::default()
            },
            "sampling_params.logit_bias",
        ),
        (
            s::SamplingParams {
                max_new_tokens: Some(0),
                ..Default::default()
            },
            "sampling_params.max_new_tokens",
        ),
        (
            s::SamplingParams {
                constraint: Some(s::sampling_params::Constraint::EbnfGrammar(
                    "root ::= \"a\"".into(),
                )),
                ..Default::default()
            },
            "sampling_params.ebnf_grammar",
        ),
        (
            s::SamplingParams {
                constraint: Some(s::sampling_params::Constraint::JsonSchema("{".into())),
                ..Default::default()
            },
            "sampling_params.json_schema",
        ),
    ] {
        let e = tonic::Status::from(sampling(Some(params)).unwrap_err());
        assert_eq!(e.code(), tonic::Code::InvalidArgument);
        assert!(e.message().starts_with(field), "{}", e.message());
    }
    let no_ids = s::GenerateRequest::default();
    let e = generate_request(no_ids, Role::Unified).unwrap_err();
    assert!(e.to_string().starts_with("tokenized"), "{e}");
}

#[test]
fn rooms_are_never_zero_and_only_for_pd_roles() {
    assert_eq!(room(0), 1 << 32);
    assert_eq!(room(-1), (1 << 32) | 0xffff_ffff);
    assert_ne!(room(5), room(6));
    let req = |role| {
        generate_request(
            s::GenerateRequest {
                tokenized: Some(s::TokenizedInput {
                    original_text: String::new(),
                    input_ids: vec![1, 2],
                }),
                disaggregated_params: Some(s::DisaggregatedParams {
                    bootstrap_host: "127.0.0.1".into(),
                    bootstrap_port: 1,
                    bootstrap_room: 7,
                }),
                ..Default::default()
            },
            role,
        )
        .unwrap()
        .room
    };
    assert_eq!(req(Role::Unified), 0);
    assert_eq!(req(Role::Decode), room(7));
    assert_eq!(req(Role::Prefill), room(7));
}

#[test]
fn json_schemas_and_regexes_become_grammars() {
    let p = sampling(Some(s::SamplingParams {
        constraint: Some(s::sampling_params::Constraint::JsonSchema(
            r#"{"type":"object"}"#.into(),
        )),
        ..Default::default()
    }))
    .unwrap();
    assert_eq!(
        p.grammar,
        "start: %json{\"type\":\"object\",\"x-guidance\":{\"whitespace_flexible\":false}}\n"
    );
    // Strict, as SGLang's default: properties the schema does not name are not
    // generated unless it says so.
    let grammar = |schema: &str| {
        sampling(Some(s::SamplingParams {
            constraint: Some(s::sampling_params::Constraint::JsonSchema(schema.into())),
            ..Default::default()
        }))
        .unwrap()
        .grammar
    };
    assert_eq!(
        grammar(r#"{"type":"object","properties":{"a":{"type":"integer"}}}"#),
        "start: %json{\"type\":\"object\",\"properties\":{\"a\":{\"type\":\"integer\"}},\"additionalProperties\":false,\"x-guidance\":{\"whitespace_flexible\":false}}\n"
    );
    assert_eq!(
        grammar(r#"{"properties":{"a":{}},"additionalProperties":true}"#),
        "start: %json{\"properties\":{\"a\":{}},\"additionalProperties\":true,\"x-guidance\":{\"whitespace_flexible\":false}}\n"
    );
    let p = sampling(Some(s::SamplingParams {
        constraint: Some(s::sampling_params::Constraint::Regex("a/b+".into())),
        ..Default::default()
    }))
    .unwrap();
    assert_eq!(p.grammar, "start: /a\\/b+/\n");
}
