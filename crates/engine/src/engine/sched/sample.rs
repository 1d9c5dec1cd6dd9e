//! How one sequence takes its next token: sampling a logits row (grammar mask,
//! `min_tokens`, penalties, temperature), then the stop checks and the events the token
//! makes. Plain steps, prompt groups and hand-overs all sample through here, so a token
//! is chosen the same way on every path.

use crate::{FinishReason, Logprob, StepEvent};

use super::seq::{Finish, Seq};

/// Reports `s`'s prompt log-probabilities, when asked for, as its first token is sampled.
pub(super) fn prompt_logprobs(s: &Seq, events: &mut Vec<StepEvent>) {
    if s.generated() == 0 && s.params.prompt_logprobs.is_some() {
        events.push(StepEvent::PromptLogprobs {
            id: s.id.clone(),
            tokens: s.tokens[1..s.prompt_len].to_vec(),
            logprobs: s.prompt_lp.clone(),
        });
    }
}

/// Samples `s`'s next token from `row`, the logits after its last token, and appends it:
/// the grammar's mask, `min_tokens`' mask, penalties and temperature apply; the
/// log-probability (when asked for) is the raw row's.
pub(super) fn sample_row(
    s: &mut Seq,
    mut row: Vec<f32>,
    eog: &[u32],
    capture: bool,
) -> (u32, Option<Logprob>) {
    if capture {
        s.logits.push(row.clone());
    }
    // Raw log-probabilities: of the row before anything below changes it.
    let raw = s.params.logprobs.then(|| row.clone());
    let live = match &mut s.constraint {
        Some(c) => c.apply(&mut row, eog),
        None => true,
    };
    if s.generated() < s.params.min_tokens as usize {
        let ends: &[u32] = if s.params.ignore_eos { &[] } else { eog };
        for &t in ends.iter().chain(&s.params.stop_token_ids) {
            if let Some(l) = row.get_mut(t as usize) {
                *l = f32::NEG_INFINITY;
            }
        }
    }
    let mut tok = s.sampler.sample(&mut row, &s.params, &s.tokens);
    if !live && !eog.contains(&tok) {
        // The grammar allows nothing more: end the sequence.
        tok = eog[0];
    }
    let logprob = raw.map(|r| Logprob::of(&r, tok, s.params.top_logprobs as usize));
    if let Some(c) = &mut s.constraint
        && let Err(e) = c.commit(tok, eog)
    {
        tracing::warn!(id = %s.id, tok, error = %e, "the grammar refused a sampled token");
    }
    s.sampler.record(tok);
    s.tokens.push(tok);
    (tok, logprob)
}

/// Emits the events for a token just appended to `s`; whether `s` is finished. `ends`:
/// the end-of-generation tokens, each token's bytes and the context length.
pub(super) fn after_sample(
    s: &mut Seq,
    tok: u32,
    logprob: Option<Logprob>,
    (eog, token_bytes, context): (&[u32], &[Vec<u8>], usize),
    events: &mut Vec<StepEvent>,
) -> bool {
    let Some(finish) = finish_check(s, tok, eog, token_bytes, context) else {
        events.push(StepEvent::Token {
            id: s.id.clone(),
            token: tok,
            logprob,
        });
        return false;
    };
    let (_, _, matched_token) = &finish;
    if matched_token.is_none() {
        events.push(StepEvent::Token {
            id: s.id.clone(),
            token: tok,
            logprob,
        });
    }
    events.push(s.finished(finish, s.generated()));
    true
}

/// Whether `s` is finished after appending `tok`.
fn finish_check(
    s: &mut Seq,
    tok: u32,
    eog: &[u32],
    token_bytes: &[Vec<u8>],
    context: usize,
) -> Option<Finish> {
    if (!s.params.ignore_eos && eog.contains(&tok)) || s.params.stop_token_ids.contains(&tok) {
        return Some((FinishReason::Stop, None, Some(tok)));
    }
    if s.constraint.as_ref().is_some_and(|c| c.done()) {
        // The grammar is complete: nothing more may be written.
        let end = eog.contains(&tok).then_some(tok);
        return Some((FinishReason::Stop, None, end));
    }
    if !s.params.stop.is_empty() {
        let before = s.tail.len();
        s.tail.extend_from_slice(&token_bytes[tok as usize]);
        // Before min_tokens, stop strings do not match (vLLM's rule).
        let matching = s.generated() >= s.params.min_tokens as usize;
        for stop in s.params.stop.iter().filter(|_| matching) {
            let sb = stop.as_bytes();
            // Only matches that end inside the new bytes are new.
            let from = before.saturating_sub(sb.len() - 1);
            if s.tail.len() >= sb.len() && s.tail[from..].windows(sb.len()).any(|w| w == sb) {
                return Some((FinishReason::Stop, Some(stop.clone()), None));
            }
        }
        let keep = s.params.stop.iter().map(String::len).max().unwrap_or(1);
        if s.tail.len() > keep {
            s.tail.drain(..s.tail.len() - keep);
        }
    }
    if s.generated() >= s.max_new || s.tokens.len() >= context {
        return Some((FinishReason::Length, None, None));
    }
    None
}
