//! The decode side of a hand-over: reserves pages for the prompt, joins the room saying
//! how many it holds already, waits for prefill's pages, imports them checked against
//! their checksums, then generates the rest.

use std::sync::Arc;
use std::time::Instant;

use futures::StreamExt;
use pdmesh_cache_client::client::{HostClient, RoomOpen};
use pdmesh_engine::{GenRequest, Logprob};
use pdmesh_proto::cache::v1 as cpb;
use tokio::sync::mpsc;
use tonic::Status;

use super::stats::{Handover, transfer_event};
use super::{Item, Pd, PdError};
use crate::actor::{EngineHandle, Generation};
use crate::engine_core::{Event, Finish, Stages};
use crate::error::Error;
use crate::incidents::{BadPage, Handed};
use pdmesh_cache_client::rooms::{RoomGuard, by, room_event, wait_room};

impl Pd {
    pub(super) async fn decode(
        &self,
        engine: &EngineHandle,
        client: Arc<HostClient>,
        req: GenRequest,
        (room, trace_id, handover): (u64, String, Handover),
        mut generation: Generation,
        tx: &mpsc::Sender<Item>,
    ) -> Result<(), PdError> {
        // Decode reserves first; a pool that stays full is a clear error, not a wedge.
        let reserved = tokio::time::timeout(self.times.admission, async {
            loop {
                match generation.next().await {
                    Some(Ok(Event::Reserved { pages, held })) => return Ok((pages, held)),
                    Some(Ok(_)) => {}
                    Some(Err(e)) => return Err(e.into()),
                    None => return Err(PdError::EngineGone),
                }
            }
        })
        .await;
        let mut guard = RoomGuard {
            client: client.clone(),
            room,
            reason: "decode ended before it took its pages",
            armed: true,
        };
        let (pages, held) = match reserved {
            Ok(r) => r?,
            Err(_) => {
                guard.reason = "decode pool exhausted";
                return Err(PdError::NoPages {
                    prompt: req.prompt.len(),
                    within: self.times.admission,
                });
            }
        };
        let deadline = tokio::time::Instant::now() + self.times.transfer;
        let (client, _) = self
            .link()?
            .open_room(
                client,
                deadline,
                (room, cpb::RoomSide::Receiver),
                (&req.id, &trace_id),
                RoomOpen {
                    home: "",
                    held_pages: held as u32,
                },
            )
            .await?;
        guard.client = client.clone();
        room_event("receiver_joined");
        // The prefill computes the prompt meanwhile. However long that takes on this
        // machine is bounded by the room's own deadline at the cache service
        // (`--room-wait-ms`), which fails the room; here the service only has to answer
        // each wait in time. This side's transfer deadline starts once the sender writes.
        let transfer = self.times.transfer;
        wait_room(&client, room, cpb::RoomState::Transferring, || {
            tokio::time::Instant::now() + transfer
        })
        .await?;
        room_event("transferring");
        let deadline = tokio::time::Instant::now() + transfer;
        wait_room(&client, room, cpb::RoomState::Success, || deadline).await?;
        room_event("success");
        let arrived = Instant::now();
        let got = by(deadline, "room result", client.room_result(room)).await?;
        let aux = got
            .aux
            .ok_or_else(|| PdError::Internal("a room result without aux data".into()))?;
        if aux.room != room || aux.prompt_tokens as usize != req.prompt.len() {
            return Err(PdError::Corrupt(format!(
                "aux data for room {} ({} prompt tokens) arrived in room {room} ({} tokens)",
                aux.room,
                aux.prompt_tokens,
                req.prompt.len()
            )));
        }
        // The pages it held stayed here; the rest arrived.
        let pages = pages - held;
        if got.pages.len() != pages {
            return Err(PdError::Corrupt(format!(
                "{} pages arrived for {pages} reserved",
                got.pages.len()
            )));
        }
        let mirror = client
            .shared_mirror()
            .ok_or_else(|| PdError::Internal("rooms need the shm data plane".into()))?;
        transfer_event(
            "kv_cache_transfer_start",
            (pages, held),
            client.page_bytes(),
            None,
        );
        let t0 = Instant::now();
        let sent = got.pages;
        let of = sent.len();
        let logprob = (!aux.first_logprob.is_nan()).then(|| Logprob {
            logprob: aux.first_logprob,
            top: aux
                .first_top_logprobs
                .iter()
                .map(|t| (t.token_id, t.logprob))
                .collect(),
        });
        engine
            .import(
                (req.id.clone(), generation.ticket()),
                aux.first_token,
                logprob,
                aux.cached_tokens as usize,
                Box::new(move |dst: &mut [&mut [u8]]| {
                    for (index, (d, p)) in dst.iter_mut().zip(&sent).enumerate() {
                        let found = mirror.read_checked(p.slot, d);
                        if found != p.checksum {
                            return Err(BadPage {
                                index,
                                slot: p.slot,
                                expected: p.checksum,
                                found,
                            }
                            .into());
                        }
                    }
                    Ok(())
                }),
            )
            .await
            .map_err(|e| match e {
                pdmesh_engine::EngineError::Fill(e) => {
                    let Ok(b) = e.downcast::<BadPage>() else {
                        let why = "the hand-over's pages could not be written";
                        return PdError::Corrupt(why.into());
                    };
                    if let Some(inc) = &self.incidents {
                        let summary = format!(
                            "Room {room}: page {} of the {of} pages prefill committed did not \
                             match its checksum when this decode worker read it from the \
                             host mirror (slot {}): the bytes changed in the mirror after the \
                             commit. The request failed with DATA_LOSS; nothing was \
                             generated from those pages.",
                            b.index, b.slot
                        );
                        let h = Handed {
                            req: &req,
                            trace_id: &trace_id,
                            room,
                        };
                        inc.handover_checksum("hand-over read", &h, (&[*b], of), None, summary);
                    }
                    PdError::Corrupt(b.to_string())
                }
                pdmesh_engine::EngineError::Transfer(m) => PdError::Corrupt(m),
                e => e.into(),
            })?;
        let secs = t0.elapsed().as_secs_f64();
        // The bytes are verified and ours: the room may end even if this call is lost.
        if let Err(s) = by(deadline, "room finish", client.room_finish(room)).await {
            tracing::debug!(room, error = %s, "room finish failed; its deadline frees the slots");
        }
        guard.armed = false;
        self.transferred((pages, held), client.page_bytes(), secs);
        drop(handover);
        // The whole request's stages, as the prefill side measured its own: the report a
        // unified worker would give, plus the hand-over.
        let prefill_stages = Stages {
            queue: aux.queue_seconds,
            prefill: aux.prefill_seconds,
            transfer: aux.send_seconds + arrived.elapsed().as_secs_f64(),
            decode: 0.0,
        };
        let host_cached = aux.host_cached_tokens;
        let page_size = self.layout.page_size();
        while let Some(item) = generation.next().await {
            let item = item
                .map(|ev| match ev {
                    Event::Finished(f) => Event::Finished(Finish {
                        host_cached_tokens: host_cached.min(f.cached_tokens),
                        // Pages decode held already were not handed over.
                        transferred_tokens: f
                            .prompt_tokens
                            .saturating_sub((held * page_size) as u32),
                        stages: Stages {
                            decode: f.stages.decode,
                            ..prefill_stages
                        },
                        ..f
                    }),
                    ev => ev,
                })
                .map_err(|e| Status::from(Error::from(e)));
            if tx.send(item).await.is_err() {
                break; // the caller left; dropping the generation aborts the request
            }
        }
        Ok(())
    }
}
