//! SGLang's `GenerateRequest` read as pdmesh's: sampling parameters with proto3 zeros read
//! as SGLang reads them, bootstrap rooms as pdmesh rooms, and every feature pdmesh lacks
//! refused naming its field.

use pdmesh_proto::sglang::grpc::scheduler as s;
use pdmesh_proto::worker::v1 as pb;

use super::grammar::constraint_grammar;
use super::{Invalid, invalid};
use crate::pd::Role;

/// Most choices one request may ask for (`sampling_params.n`), as at the gateway.
const MAX_CHOICES: u32 = 16;

/// SGLang sampling parameters → pdmesh's. `None` means the proto's zero values.
pub(super) fn sampling(p: Option<s::SamplingParams>) -> Result<pb::SamplingParams, Invalid> {
    let p = p.unwrap_or_default();
    if p.n > MAX_CHOICES {
        return Err(invalid(
            "sampling_params.n",
            format!("at most {MAX_CHOICES} choices per request (got {})", p.n),
        ));
    }
    // Token ids as decimal strings (SGLang's JSON-born map keys).
    let logit_bias = p
        .logit_bias
        .iter()
        .map(|(k, &v)| match k.parse::<u32>() {
            Ok(t) => Ok((t, v)),
            Err(_) => Err(invalid(
                "sampling_params.logit_bias",
                format!("keys are token ids, not {k:?}"),
            )),
        })
        .collect::<Result<_, _>>()?;
    let max_tokens = match p.max_new_tokens {
        None => 0,
        Some(0) => {
            return Err(invalid(
                "sampling_params.max_new_tokens",
                "0 (prompt scoring only) is not supported; ask for at least 1 token",
            ));
        }
        Some(n) => n,
    };
    let grammar = constraint_grammar(p.constraint)?;
    Ok(pb::SamplingParams {
        temperature: Some(p.temperature),
        top_p: (p.top_p > 0.0).then_some(p.top_p),
        top_k: (p.top_k > 0).then_some(p.top_k),
        min_p: Some(p.min_p),
        frequency_penalty: p.frequency_penalty,
        presence_penalty: p.presence_penalty,
        repetition_penalty: (p.repetition_penalty > 0.0).then_some(p.repetition_penalty),
        seed: None,
        max_tokens,
        stop: p.stop.into_iter().map(String::into_bytes).collect(),
        stop_token_ids: p.stop_token_ids,
        ignore_eos: p.ignore_eos,
        logprobs: false,
        top_logprobs: 0,
        logit_bias,
        min_tokens: p.min_new_tokens,
        grammar,
        prompt_logprobs: None,
    })
}

/// SGLang's 32-bit bootstrap room as a pdmesh room: never 0 (SGLang's room 0 is a room;
/// pdmesh's 0 is "none"), the same on the prefill and the decode side.
pub(super) fn room(bootstrap_room: i32) -> u64 {
    (1 << 32) | u64::from(bootstrap_room as u32)
}

/// The pdmesh request for an SGLang one; `role` decides whether rooms apply.
pub(super) fn generate_request(
    r: s::GenerateRequest,
    role: Role,
) -> Result<pb::GenerateRequest, Invalid> {
    let Some(tokenized) = r.tokenized else {
        return Err(invalid(
            "tokenized",
            "input must be token ids (`tokenized.input_ids`)",
        ));
    };
    if r.mm_inputs.is_some() {
        return Err(invalid("mm_inputs", "this model takes text only"));
    }
    if !r.input_embeds.is_empty() {
        return Err(invalid("input_embeds", "is not supported"));
    }
    if r.return_hidden_states {
        return Err(invalid("return_hidden_states", "is not supported"));
    }
    if !r.token_ids_logprob.is_empty() {
        return Err(invalid(
            "token_ids_logprob",
            "the logprobs of chosen ids are not returned; use top_logprobs_num",
        ));
    }
    if !(0..=pdmesh_engine::MAX_TOP_LOGPROBS as i32).contains(&r.top_logprobs_num) {
        return Err(invalid(
            "top_logprobs_num",
            format!(
                "must be between 0 and {} (got {})",
                pdmesh_engine::MAX_TOP_LOGPROBS,
                r.top_logprobs_num
            ),
        ));
    }
    if !r.lora_id.is_empty() {
        return Err(invalid("lora_id", "LoRA adapters are not supported"));
    }
    let mut sampling = sampling(r.sampling_params)?;
    sampling.logprobs = r.return_logprob;
    // SGLang's input logprobs: from logprob_start_len on (-1: none).
    if r.return_logprob && r.logprob_start_len >= 0 {
        sampling.prompt_logprobs = Some(r.top_logprobs_num as u32);
    }
    sampling.top_logprobs = if r.return_logprob {
        r.top_logprobs_num as u32
    } else {
        0
    };
    let room = match (role, r.disaggregated_params) {
        (Role::Unified, _) | (_, None) => 0,
        (_, Some(d)) => room(d.bootstrap_room),
    };
    Ok(pb::GenerateRequest {
        request_id: r.request_id,
        input_ids: tokenized.input_ids,
        sampling: Some(sampling),
        room,
        trace_id: String::new(),
        kv_home: String::new(),
        prompt_group: String::new(),
        prompt_group_size: 0,
        // SGLang's GenerateRequest has no salt.
        cache_salt: None,
    })
}
