//! Rooms' states, pages and aux data to and from their wire forms.

use pdmesh_proto::cache::v1 as pb;

use crate::rooms::{Aux, RoomPage, RoomState};

pub(super) fn room_state_pb(s: RoomState) -> pb::RoomState {
    match s {
        RoomState::Failed => pb::RoomState::Failed,
        RoomState::Bootstrapping => pb::RoomState::Bootstrapping,
        RoomState::WaitingForInput => pb::RoomState::WaitingForInput,
        RoomState::Transferring => pb::RoomState::Transferring,
        RoomState::Success => pb::RoomState::Success,
    }
}

pub(super) fn room_state_from_pb(v: i32) -> Option<RoomState> {
    Some(match pb::RoomState::try_from(v).ok()? {
        pb::RoomState::Failed => RoomState::Failed,
        pb::RoomState::Bootstrapping => RoomState::Bootstrapping,
        pb::RoomState::WaitingForInput => RoomState::WaitingForInput,
        pb::RoomState::Transferring => RoomState::Transferring,
        pb::RoomState::Success => RoomState::Success,
    })
}

pub(super) trait Held {
    fn held(self, pages: u32) -> Self;
}

impl Held for pb::RoomStatus {
    /// With the receiver's held pages.
    fn held(mut self, pages: u32) -> Self {
        self.held_pages = pages;
        self
    }
}

pub(super) fn pages_from_pb(pages: &[pb::RoomPage]) -> Vec<RoomPage> {
    pages
        .iter()
        .map(|p| RoomPage {
            slot: p.slot,
            checksum: p.checksum,
        })
        .collect()
}

pub(super) fn aux_from_pb(a: pb::RoomAux) -> Aux {
    Aux {
        room: a.room,
        first_token: a.first_token,
        first_logprob: a.first_logprob,
        first_top: a
            .first_top_logprobs
            .iter()
            .map(|t| (t.token_id, t.logprob))
            .collect(),
        prompt_tokens: a.prompt_tokens,
        cached_tokens: a.cached_tokens,
        host_cached_tokens: a.host_cached_tokens,
        queue_seconds: a.queue_seconds,
        prefill_seconds: a.prefill_seconds,
        send_seconds: a.send_seconds,
    }
}

pub(super) fn aux_to_pb(a: Aux) -> pb::RoomAux {
    pb::RoomAux {
        room: a.room,
        first_token: a.first_token,
        first_logprob: a.first_logprob,
        first_top_logprobs: a
            .first_top
            .iter()
            .map(|&(token_id, logprob)| pb::TopToken { token_id, logprob })
            .collect(),
        prompt_tokens: a.prompt_tokens,
        cached_tokens: a.cached_tokens,
        host_cached_tokens: a.host_cached_tokens,
        queue_seconds: a.queue_seconds,
        prefill_seconds: a.prefill_seconds,
        send_seconds: a.send_seconds,
    }
}

pub(super) fn status(st: RoomState, why: Option<String>) -> pb::RoomStatus {
    pb::RoomStatus {
        state: room_state_pb(st).into(),
        reason: why.unwrap_or_default(),
        held_pages: 0,
    }
}
