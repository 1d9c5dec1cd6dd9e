//! The prefill side of a hand-over: computes the prompt, sends the first token, stages
//! the pages decode does not hold yet, writes them into the room's mirror slots and
//! commits the room with the first token's data (the test-only write delay included).

use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::StreamExt;
use pdmesh_cache_client::client::HostClient;
use pdmesh_engine::GenRequest;
use pdmesh_proto::cache::v1 as cpb;
use tokio::sync::mpsc;

use super::pages::{changed, report_write, stage, write_pages};
use super::stats::transfer_event;
use super::{Item, Pd, PdError};
use crate::actor::{EngineHandle, Generation};
use crate::engine_core::{Event, Finish, Stages};
use pdmesh_cache_client::rooms::{HandoverError, RoomGuard, by, room_event, wait_room};

/// Lets go of a prefill's held pages when dropped armed: those of its own submission
/// (`ticket`) only, as the request may have been tried again under the same id by then.
struct ExportGuard {
    engine: EngineHandle,
    id: Option<String>,
    ticket: u64,
}

impl ExportGuard {
    /// The pages were exported: nothing left to let go of.
    fn disarm(&mut self) {
        self.id = None;
    }
}

impl Drop for ExportGuard {
    fn drop(&mut self) {
        if let Some(id) = self.id.take() {
            self.engine.drop_export(id, self.ticket);
        }
    }
}

impl Pd {
    pub(super) async fn prefill(
        &self,
        engine: &EngineHandle,
        client: Arc<HostClient>,
        (req, trace_id): (GenRequest, String),
        mut generation: Generation,
        mut guard: RoomGuard,
        tx: &mpsc::Sender<Item>,
    ) -> Result<(), PdError> {
        let room = guard.room;
        let prompt_tokens = req.prompt.len() as u32;
        let (token, logprob, pages, cached, host_cached, stages) = loop {
            match generation.next().await {
                Some(Ok(Event::Exported {
                    token,
                    logprob,
                    pages,
                    cached,
                    host_cached,
                    stages,
                })) => break (token, logprob, pages, cached, host_cached, stages),
                Some(Ok(Event::Finished(f))) => {
                    let why = format!("prefill ended: {:?}", f.reason);
                    return Err(HandoverError::Failed(why).into());
                }
                // Computed here only: they go to the client before the first token.
                Some(Ok(ev @ Event::PromptLogprobs { .. })) => {
                    let _ = tx.send(Ok(ev)).await;
                }
                Some(Ok(_)) => {}
                Some(Err(e)) => return Err(e.into()),
                None => return Err(PdError::EngineGone),
            }
        };
        let mut export = ExportGuard {
            engine: engine.clone(),
            id: Some(req.id.clone()),
            ticket: generation.ticket(),
        };
        // The first token goes out now, before the hand-over: the gateway can show it
        // while the KV travels (decode streams it again, and the gateway checks they are
        // the same). A token that ends the generation is never shown, so it is not sent.
        let p = &req.params;
        let ends =
            (!p.ignore_eos && self.eos.contains(&token)) || p.stop_token_ids.contains(&token);
        if !ends {
            let _ = tx
                .send(Ok(Event::Token {
                    token,
                    logprob: logprob.clone(),
                }))
                .await;
        }
        let exported = Instant::now();
        let deadline = tokio::time::Instant::now() + self.times.transfer;
        // Decode joins once it has reserved pages for this prompt, saying how many of
        // its leading pages it holds already: only the rest travel.
        let st = wait_room(&client, room, cpb::RoomState::WaitingForInput, || deadline).await?;
        room_event("waiting_for_input");
        let held = st.held_pages as usize;
        if held >= pages {
            return Err(PdError::Internal(format!(
                "decode says it holds {held} of the prompt's {pages} pages; the last one always travels"
            )));
        }
        let pages = pages - held;
        // The pages leave the engine first, into this task's own buffer with each page's
        // checksum: the engine hands them over between two of its steps, however long
        // one takes on this machine. Only then does the room take mirror slots and start
        // transferring, so its deadline bounds the write and the commit, not a step.
        let page_bytes = client.page_bytes();
        let t0 = Instant::now();
        let (staged, sums) =
            stage(engine, (&req.id, generation.ticket()), held, page_bytes).await?;
        export.disarm();
        if sums.len() != pages {
            return Err(PdError::Internal(format!(
                "the engine exported {} pages of the {pages} that travel",
                sums.len()
            )));
        }
        let slots = loop {
            match by(
                deadline,
                "room start",
                client.room_start(room, pages as u32),
            )
            .await
            {
                Ok(slots) => break slots,
                // The mirror is full of other rooms' pages for now.
                Err(e) if e.mirror_full() => {
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
                Err(e) => return Err(e.into()),
            }
        };
        if slots.len() != pages {
            return Err(PdError::Internal(format!(
                "the cache service granted {} slots for {pages} pages",
                slots.len()
            )));
        }
        transfer_event("kv_cache_transfer_start", (pages, held), page_bytes, None);
        let mirror = client
            .shared_mirror()
            .ok_or_else(|| PdError::Internal("rooms need the shm data plane".into()))?;
        let delay = self.times.write_delay.filter(|_| {
            self.faults
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed)
                < self.times.fault_count
        });
        let client2 = client.clone();
        let (missize, layout) = (self.times.missize, self.layout.clone());
        // What a report needs, only when reports are written: the request itself moves
        // in (nothing after this needs it), so a hand-over copies nothing for it.
        let report = self.incidents.clone().map(|inc| (inc, req, trace_id));
        let write_and_commit = async move {
            if let Some(d) = delay {
                tracing::warn!(room, delay = ?d, "fault injection: a write that does not hear aborts, delayed");
                tokio::time::sleep(d).await;
            }
            let write_slots = slots.clone();
            let engine_layout = layout.clone();
            let written = tokio::task::spawn_blocking(move || {
                write_pages(
                    &mirror,
                    &staged,
                    &write_slots,
                    &sums,
                    missize.map(|m| (m, &layout)),
                )
            })
            .await
            .map_err(|e| PdError::Internal(format!("the page write failed: {e}")))??;
            let sums = match written {
                Ok(sums) => sums,
                Err(bad) => {
                    if let Some((inc, req, trace_id)) = &report {
                        report_write(
                            inc,
                            (req, trace_id, room),
                            &bad,
                            pages,
                            &engine_layout,
                            missize,
                        );
                    }
                    return Err(changed(&bad, pages, "the engine and the host mirror"));
                }
            };
            let secs = t0.elapsed().as_secs_f64();
            let aux = cpb::RoomAux {
                room,
                first_token: token,
                first_logprob: logprob.as_ref().map_or(f32::NAN, |l| l.logprob),
                first_top_logprobs: logprob.as_ref().map_or_else(Vec::new, |l| {
                    l.top
                        .iter()
                        .map(|&(token_id, logprob)| cpb::TopToken { token_id, logprob })
                        .collect()
                }),
                prompt_tokens,
                cached_tokens: cached as u32,
                host_cached_tokens: host_cached as u32,
                queue_seconds: stages.queue,
                prefill_seconds: stages.prefill,
                send_seconds: exported.elapsed().as_secs_f64(),
            };
            let pages_pb = slots
                .iter()
                .zip(&sums)
                .map(|(&slot, &checksum)| cpb::RoomPage { slot, checksum })
                .collect();
            let commit = client2.room_commit(room, pages_pb, aux);
            match delay {
                Some(_) => commit.await.map_err(HandoverError::from_cache)?,
                None => by(deadline, "room commit", commit).await?,
            }
            Ok::<f64, PdError>(secs)
        };
        let secs = match delay {
            // The fault: a sender that does not hear its abort (as over a partition)
            // writes and commits late, detached from this request.
            Some(_) => tokio::spawn(write_and_commit)
                .await
                .map_err(|e| PdError::Internal(format!("the transfer task failed: {e}")))??,
            None => write_and_commit.await?,
        };
        guard.armed = false;
        self.transferred((pages, held), client.page_bytes(), secs);
        let _ = tx
            .send(Ok(Event::Finished(Finish {
                reason: pdmesh_engine::FinishReason::Length,
                matched_stop: None,
                matched_token: None,
                prompt_tokens,
                completion_tokens: 1,
                cached_tokens: 0,
                host_cached_tokens: 0,
                transferred_tokens: 0,
                stages: Stages {
                    transfer: exported.elapsed().as_secs_f64(),
                    ..stages
                },
            })))
            .await;
        Ok(())
    }
}
