//! A disaggregated request's prefill and decode streams, merged into the one stream its
//! client sees, with the check that both sides agree on the first token.

use futures::{Stream, StreamExt};
use pdmesh_proto::worker::v1 as wk;
use tonic::Status;

use super::{GenStream, Inflight};

/// How long decode's ABORTED (its room failed) waits for prefill's own error, the cause
/// when prefill failed: it aborts the room as it fails, and which of the two errors reaches
/// the gateway first is a race. A prefill that ends well ends the wait at once.
const PREFILL_CAUSE_GRACE: std::time::Duration = std::time::Duration::from_secs(2);

/// How the DATA_LOSS of a first token that differs between prefill and decode ends (the
/// gateway's own check; the workers' checksum failures say otherwise and report
/// themselves).
pub(crate) const FIRST_TOKEN_MISMATCH: &str = "the KV hand-over is corrupt";

/// A disaggregated request's two streams as the one its client sees. Prefill streams the
/// first token before the hand-over, so it is shown first; decode streams it again, and
/// its copy is checked against prefill's and dropped (a mismatch means decode got other
/// KV: the request fails with DATA_LOSS). Decode's messages that reach the gateway before
/// prefill's first token wait for it, so the check and what the client sees are the same
/// whichever stream's token comes first. Prefill's error, if it fails first, ends the
/// request at once rather than at decode's room deadline; so does decode's. Dropping the
/// stream ends prefill's call too (it aborts what it still holds), so a request that
/// failed or left at decode costs no more compute.
pub(super) fn merge<P, D>(
    prefill: P,
    decode: D,
    (pguard, dguard): (Inflight, Inflight),
) -> GenStream
where
    P: Stream<Item = Result<wk::GenerateResponse, Status>> + Send + 'static,
    D: Stream<Item = Result<wk::GenerateResponse, Status>> + Send + 'static,
{
    // From prefill's own stream: its first token, and its error if it fails.
    let (first_tx, first_rx) = tokio::sync::oneshot::channel::<wk::TokenChunk>();
    let (fail_tx, fail_rx) = tokio::sync::oneshot::channel::<Status>();
    let (done_tx, mut done_rx) = tokio::sync::oneshot::channel::<()>();
    tokio::spawn(async move {
        let _p = pguard;
        let mut ps = Box::pin(prefill);
        let mut first_tx = Some(first_tx);
        // The prompt's logprobs (only prefill computes them): they ride on its first token.
        let mut prompt = Vec::new();
        loop {
            tokio::select! {
                m = ps.next() => match m {
                    Some(Ok(wk::GenerateResponse {
                        kind: Some(wk::generate_response::Kind::Chunk(mut c)),
                    })) if !c.token_ids.is_empty() => {
                        if let Some(tx) = first_tx.take() {
                            c.prompt_logprobs = std::mem::take(&mut prompt);
                            let _ = tx.send(c);
                        }
                    }
                    Some(Ok(wk::GenerateResponse {
                        kind: Some(wk::generate_response::Kind::Chunk(c)),
                    })) => prompt = c.prompt_logprobs,
                    Some(Ok(_)) => {}
                    None => {
                        // A first token that ends the generation is never sent: the
                        // prompt's logprobs go alone.
                        if !prompt.is_empty() && let Some(tx) = first_tx.take() {
                            let _ = tx.send(wk::TokenChunk {
                                prompt_logprobs: prompt,
                                ..Default::default()
                            });
                        }
                        // Closed before the first token's sender drops (at the return):
                        // the merge that sees no first token finds no failure pending.
                        drop(fail_tx);
                        return;
                    }
                    // Sent before `first_tx` drops: a first token that never comes because
                    // prefill failed finds the failure already there.
                    Some(Err(s)) => {
                        let _ = fail_tx.send(s);
                        return;
                    }
                },
                _ = &mut done_rx => return,
            }
        }
    });
    let stream = async_stream::stream! {
        let _d = dguard;
        let _done = done_tx;
        let mut ds = Box::pin(decode);
        let mut fail_rx = Some(fail_rx);
        let mut first_rx = Some(first_rx);
        // Prefill's first token once known (`Some(None)`: prefill ended without one, as
        // it does when that token ends the generation).
        let mut first: Option<Option<u32>> = None;
        // Decode's messages (`None`: its end) that came before prefill's first token.
        let mut held = std::collections::VecDeque::new();
        let mut decode_open = true;
        let mut checked = false;
        loop {
            let m = if first.is_some() && let Some(m) = held.pop_front() {
                m
            } else {
                tokio::select! {
                    // Decode before prefill's failure: when decode refused the request
                    // (its pool is full), prefill's failure is only the consequence.
                    biased;
                    m = ds.next(), if decode_open => {
                        let m = match m {
                            Some(Ok(m)) => Some(m),
                            Some(Err(s)) => {
                                // ABORTED: decode's room failed, which is what a prefill
                                // that failed does to it. Prefill's own error says why.
                                let s = match (s.code(), fail_rx.take()) {
                                    (tonic::Code::Aborted, Some(rx)) => {
                                        match tokio::time::timeout(PREFILL_CAUSE_GRACE, rx).await {
                                            Ok(Ok(p)) => prefill_failure(&p),
                                            _ => s,
                                        }
                                    }
                                    _ => s,
                                };
                                yield Err(s);
                                break;
                            }
                            None => { decode_open = false; None }
                        };
                        if first.is_none() {
                            held.push_back(m);
                            continue;
                        }
                        m
                    },
                    f = async { fail_rx.as_mut().expect("polled while present").await },
                        if fail_rx.is_some() => match f {
                        Ok(s) => {
                            yield Err(prefill_failure(&s));
                            break;
                        }
                        // Prefill finished normally: only decode matters now.
                        Err(_) => { fail_rx = None; continue; }
                    },
                    c = async { first_rx.as_mut().expect("polled while present").await },
                        if first_rx.is_some() => {
                        first_rx = None;
                        match c {
                            Ok(c) => {
                                first = Some(c.token_ids.first().copied());
                                yield Ok(wk::GenerateResponse {
                                    kind: Some(wk::generate_response::Kind::Chunk(c)),
                                });
                            }
                            Err(_) => {
                                // A receiver that answered try_recv (a value or closed) is
                                // spent: polling it again panics, so it goes. One still
                                // empty (prefill's task is ending) is kept and awaited.
                                if let Some(rx) = fail_rx.as_mut() {
                                    match rx.try_recv() {
                                        Ok(s) => {
                                            yield Err(prefill_failure(&s));
                                            break;
                                        }
                                        Err(tokio::sync::oneshot::error::TryRecvError::Closed) => {
                                            fail_rx = None;
                                        }
                                        Err(tokio::sync::oneshot::error::TryRecvError::Empty) => {}
                                    }
                                }
                                first = Some(None);
                            }
                        }
                        continue;
                    },
                    else => break,
                }
            };
            let Some(mut m) = m else { break };
            if !checked && let Some(wk::generate_response::Kind::Chunk(c)) = m.kind.as_mut() {
                checked = true;
                if let Some(Some(t)) = first {
                    if c.token_ids.first() != Some(&t) {
                        yield Err(Status::data_loss(format!(
                            "prefill sent first token {t} but decode {:?}: {FIRST_TOKEN_MISMATCH}",
                            c.token_ids.first()
                        )));
                        break;
                    }
                    c.token_ids.remove(0);
                    if c.token_ids.is_empty() {
                        continue;
                    }
                }
            }
            yield Ok(m);
        }
    };
    Box::pin(stream)
}

/// Prefill's failure as the request's: its message names the side. A status the transport
/// made (the connection to prefill broke; it carries its cause, which the new status
/// cannot) is UNAVAILABLE, so the client hears the mesh's fault, not a backend's error.
fn prefill_failure(s: &Status) -> Status {
    let code = if pdmesh_proto::error_kind::connection_lost(s) {
        tonic::Code::Unavailable
    } else {
        s.code()
    };
    Status::new(code, format!("prefill: {}", s.message()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_broken_prefill_connection_is_unavailable_and_prefills_own_error_keeps_its_code() {
        let broken = Status::from_error(Box::new(std::io::Error::other("connection reset")));
        let s = prefill_failure(&broken);
        assert_eq!(s.code(), tonic::Code::Unavailable);
        assert!(s.message().starts_with("prefill: "), "{}", s.message());
        let sent = prefill_failure(&Status::invalid_argument("prompt too long"));
        assert_eq!(sent.code(), tonic::Code::InvalidArgument);
        assert_eq!(sent.message(), "prefill: prompt too long");
    }
}
