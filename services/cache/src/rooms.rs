//! Rooms: the rendezvous of one request's prefill and decode sides at the cache service.
//! `state/` ties them to mirror slots and leases; `grpc/` serves them.
//!
//! A room moves Bootstrapping → WaitingForInput → Transferring → Success, or to Failed
//! from any state that is not final; never backwards (a room that succeeded fails only
//! when nobody takes its pages: its receiver's lease is lost, or the hard watchdog gives
//! up on it). Every state has a deadline; either side may abort; losing a side's lease
//! fails its rooms. A failed room refuses every
//! later call, so a late commit from its sender is rejected. The mirror slots a room held
//! while its sender could still be writing are not reused until that sender's lease lets
//! go of them (they are quarantined), so a late write through shared memory cannot land
//! in pages another request now uses.

use std::collections::HashMap;
use std::time::{Duration, Instant, SystemTime};

use pdmesh_cache_client::Lease;
use pdmesh_telemetry::labels;

/// Where a room is. The numbering follows SGLang's transfer states.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum RoomState {
    Failed = 0,
    Bootstrapping = 1,
    WaitingForInput = 2,
    Transferring = 3,
    Success = 4,
}

impl RoomState {
    pub const ALL: [RoomState; 5] = [
        RoomState::Failed,
        RoomState::Bootstrapping,
        RoomState::WaitingForInput,
        RoomState::Transferring,
        RoomState::Success,
    ];

    /// The metric label (from the set the gateway creates its room series from).
    pub fn label(self) -> labels::RoomState {
        match self {
            Self::Failed => labels::RoomState::Failed,
            Self::Bootstrapping => labels::RoomState::Bootstrapping,
            Self::WaitingForInput => labels::RoomState::WaitingForInput,
            Self::Transferring => labels::RoomState::Transferring,
            Self::Success => labels::RoomState::Success,
        }
    }

    /// The metric label's value.
    pub fn name(self) -> &'static str {
        self.label().name()
    }

    pub fn is_final(self) -> bool {
        matches!(self, Self::Failed | Self::Success)
    }

    /// The only moves a room makes.
    fn may_become(self, next: Self) -> bool {
        use RoomState::*;
        matches!(
            (self, next),
            (Bootstrapping, WaitingForInput)
                | (WaitingForInput, Transferring)
                | (Transferring, Success)
                | (Bootstrapping | WaitingForInput | Transferring, Failed)
        )
    }
}

/// Which end of a room a worker is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Side {
    /// Prefill: computes and writes the pages.
    Sender,
    /// Decode: reserves its pages first, then loads and decodes.
    Receiver,
}

/// How long a room may stay in each state (and, for Success, how long the receiver has
/// to take its pages).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RoomDeadlines {
    /// Until both sides joined (decode joins once its pages are reserved).
    pub bootstrapping: Duration,
    /// Until the sender starts writing (prefill computes meanwhile).
    pub waiting_for_input: Duration,
    pub transferring: Duration,
    pub success: Duration,
}

impl Default for RoomDeadlines {
    fn default() -> Self {
        Self {
            bootstrapping: Duration::from_secs(60),
            waiting_for_input: Duration::from_secs(120),
            transferring: Duration::from_secs(30),
            success: Duration::from_secs(30),
        }
    }
}

impl RoomDeadlines {
    pub fn of(&self, s: RoomState) -> Option<Duration> {
        match s {
            RoomState::Bootstrapping => Some(self.bootstrapping),
            RoomState::WaitingForInput => Some(self.waiting_for_input),
            RoomState::Transferring => Some(self.transferring),
            RoomState::Success => Some(self.success),
            RoomState::Failed => None,
        }
    }
}

/// The ages (seconds in the current state) rooms are counted past, for the wedge
/// dashboard's age buckets.
pub const AGE_THRESHOLDS: [f64; 4] = [1.0, 5.0, 30.0, 120.0];

/// What a sender hands over with its pages; the receiver checks `room` on arrival.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Aux {
    pub room: u64,
    pub first_token: u32,
    pub first_logprob: f32,
    /// The first token's alternatives (token, log-probability), when asked for.
    pub first_top: Vec<(u32, f32)>,
    pub prompt_tokens: u32,
    pub cached_tokens: u32,
    /// The sender's cache sources and stage times, passed through for the receiver's
    /// report (see `RoomAux`).
    pub host_cached_tokens: u32,
    pub queue_seconds: f64,
    pub prefill_seconds: f64,
    pub send_seconds: f64,
}

/// One transferred page: its mirror slot and checksum.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RoomPage {
    pub slot: u32,
    pub checksum: u64,
}

#[derive(Debug, thiserror::Error, PartialEq)]
pub enum RoomError {
    #[error("room {room} failed: {reason}")]
    Failed { room: u64, reason: String },
    #[error("room {0} does not exist (finished, failed long ago, or never opened)")]
    Unknown(u64),
    #[error("room {room} already has a {side:?}")]
    SideTaken { room: u64, side: Side },
    #[error("this lease is not the {side:?} of room {room}")]
    NotYours { room: u64, side: Side },
    #[error("room {room} is {state:?}; this needs {need:?}")]
    WrongState {
        room: u64,
        state: RoomState,
        need: RoomState,
    },
}

/// Mirror slots a room gave back: free at once, or held until a lease lets go.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Released {
    pub free_now: Vec<u32>,
    /// (slot, sender lease): the sender might still write these.
    pub quarantined: Vec<(u32, Lease)>,
}

#[derive(Debug)]
struct Room {
    state: RoomState,
    entered: Instant,
    sender: Option<Lease>,
    receiver: Option<Lease>,
    /// Mirror slots reserved for the transfer.
    slots: Vec<u32>,
    pages: Vec<RoomPage>,
    aux: Option<Aux>,
    reason: Option<String>,
    request_id: String,
    trace_id: String,
    /// The watchdog already reported this room in its current state.
    stalled: bool,
    /// Leading pages the receiver holds already: they do not travel.
    held: u32,
    /// What happened to it and when (wall clock), for an incident report's timeline.
    history: Vec<(SystemTime, Step)>,
}

/// Most rooms remembered as aborted before they opened (see [`Rooms::abort`]).
pub const MAX_EARLY_ABORTS: usize = 4096;

impl Room {
    fn new(now: Instant) -> Self {
        Self {
            state: RoomState::Bootstrapping,
            entered: now,
            sender: None,
            receiver: None,
            slots: Vec::new(),
            pages: Vec::new(),
            aux: None,
            reason: None,
            request_id: String::new(),
            trace_id: String::new(),
            stalled: false,
            held: 0,
            history: {
                // Room for a whole hand-over's steps without growing.
                let mut h = Vec::with_capacity(8);
                h.push((SystemTime::now(), Step::Opened));
                h
            },
        }
    }

    /// A failed room nobody joined: an abort that came before either open.
    fn is_early_abort(&self) -> bool {
        self.state == RoomState::Failed && self.sender.is_none() && self.receiver.is_none()
    }
}

/// One step of a room's life, kept as data and worded only when a report is written (a
/// room takes several on every hand-over's path).
#[derive(Clone, Debug, PartialEq)]
pub enum Step {
    Opened,
    Joined { side: Side, lease: Lease },
    Entered(RoomState),
    Stuck { seconds: f64 },
    Failed(String),
    FailedAfterHandOver(String),
    ReceiverLeaseLost(Lease),
}

impl std::fmt::Display for Step {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Opened => f.write_str("opened (bootstrapping)"),
            Self::Joined { side, lease } => {
                let who = match side {
                    Side::Sender => "the sender (prefill)",
                    Side::Receiver => "the receiver (decode)",
                };
                write!(f, "{who} joined (lease {lease})")
            }
            Self::Entered(st) => write!(f, "entered {}", st.name()),
            Self::Stuck { seconds } => write!(f, "the watchdog found it stuck for {seconds:.1} s"),
            Self::Failed(why) => write!(f, "failed: {why}"),
            Self::FailedAfterHandOver(why) => write!(f, "failed after its hand-over: {why}"),
            Self::ReceiverLeaseLost(lease) => write!(f, "failed: receiver lease {lease} lost"),
        }
    }
}

/// Most steps a room's history keeps (a room has a handful in a normal life).
const HISTORY: usize = 32;

fn note(r: &mut Room, what: Step) {
    if r.history.len() < HISTORY {
        r.history.push((SystemTime::now(), what));
    }
}

/// Who a room serves and what happened to it (see [`Rooms::story`]).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Story {
    pub request_id: String,
    pub trace_id: String,
    pub history: Vec<(SystemTime, Step)>,
}

/// A room the watchdog found stuck.
#[derive(Clone, Debug, PartialEq)]
pub struct Stuck {
    pub room: u64,
    pub request_id: String,
    pub trace_id: String,
    pub state: RoomState,
    pub age: Duration,
    /// Its history: when it opened, who joined, each state it entered.
    pub timeline: Vec<(SystemTime, Step)>,
}

/// Every open room. Failed rooms are kept (so both sides learn why) until both sides
/// have left or their leases are gone.
#[derive(Debug, Default)]
pub struct Rooms {
    rooms: HashMap<u64, Room>,
    deadlines: RoomDeadlines,
}

impl Rooms {
    pub fn new(deadlines: RoomDeadlines) -> Self {
        Self {
            rooms: HashMap::new(),
            deadlines,
        }
    }

    pub fn deadlines(&self) -> &RoomDeadlines {
        &self.deadlines
    }

    pub fn state(&self, room: u64) -> Option<(RoomState, Option<&str>)> {
        self.rooms
            .get(&room)
            .map(|r| (r.state, r.reason.as_deref()))
    }

    fn get(&mut self, room: u64) -> Result<&mut Room, RoomError> {
        let r = self.rooms.get_mut(&room).ok_or(RoomError::Unknown(room))?;
        if r.state == RoomState::Failed {
            return Err(RoomError::Failed {
                room,
                reason: r.reason.clone().unwrap_or_default(),
            });
        }
        Ok(r)
    }

    fn advance(r: &mut Room, next: RoomState, now: Instant) {
        assert!(
            r.state.may_become(next),
            "room moved {:?} → {next:?}",
            r.state
        );
        r.state = next;
        r.entered = now;
        r.stalled = false;
        note(r, Step::Entered(next));
    }

    /// A side joins `room` (creating it if it is new). Once both have, it waits for input.
    pub fn open(
        &mut self,
        room: u64,
        side: Side,
        lease: Lease,
        now: Instant,
    ) -> Result<RoomState, RoomError> {
        let r = match self.rooms.get_mut(&room) {
            Some(_) => self.get(room)?,
            None => self.rooms.entry(room).or_insert(Room::new(now)),
        };
        let slot = match side {
            Side::Sender => &mut r.sender,
            Side::Receiver => &mut r.receiver,
        };
        match *slot {
            Some(holder) if holder != lease => {
                return Err(RoomError::SideTaken { room, side });
            }
            Some(_) => {}
            None => {
                *slot = Some(lease);
                note(r, Step::Joined { side, lease });
            }
        }
        if r.state == RoomState::Bootstrapping && r.sender.is_some() && r.receiver.is_some() {
            Self::advance(r, RoomState::WaitingForInput, now);
        }
        Ok(r.state)
    }

    fn check_side(r: &Room, room: u64, side: Side, lease: Lease) -> Result<(), RoomError> {
        let holder = match side {
            Side::Sender => r.sender,
            Side::Receiver => r.receiver,
        };
        if holder == Some(lease) {
            Ok(())
        } else {
            Err(RoomError::NotYours { room, side })
        }
    }

    /// The sender starts writing into `slots` (reserved for it in the mirror).
    pub fn start_transfer(
        &mut self,
        room: u64,
        lease: Lease,
        slots: Vec<u32>,
        now: Instant,
    ) -> Result<(), RoomError> {
        let r = self.get(room)?;
        Self::check_side(r, room, Side::Sender, lease)?;
        if r.state != RoomState::WaitingForInput {
            return Err(RoomError::WrongState {
                room,
                state: r.state,
                need: RoomState::WaitingForInput,
            });
        }
        r.slots = slots;
        Self::advance(r, RoomState::Transferring, now);
        Ok(())
    }

    /// The sender hands over its pages and aux data. Refused once the room failed.
    pub fn commit(
        &mut self,
        room: u64,
        lease: Lease,
        pages: Vec<RoomPage>,
        aux: Aux,
        now: Instant,
    ) -> Result<(), RoomError> {
        let r = self.get(room)?;
        Self::check_side(r, room, Side::Sender, lease)?;
        if r.state != RoomState::Transferring {
            return Err(RoomError::WrongState {
                room,
                state: r.state,
                need: RoomState::Transferring,
            });
        }
        r.pages = pages;
        r.aux = Some(aux);
        Self::advance(r, RoomState::Success, now);
        Ok(())
    }

    /// Leading pages the receiver of `room` said it holds.
    pub fn held(&self, room: u64) -> u32 {
        self.rooms.get(&room).map_or(0, |r| r.held)
    }

    /// The receiver of `room` holds its first `held` pages already.
    pub fn set_held(&mut self, room: u64, held: u32) {
        if let Some(r) = self.rooms.get_mut(&room) {
            r.held = held;
        }
    }

    /// The sender of `room`, if it has one.
    pub fn sender(&self, room: u64) -> Option<Lease> {
        self.rooms.get(&room).and_then(|r| r.sender)
    }

    /// The mirror slots `room` holds for its transfer.
    pub fn slots(&self, room: u64) -> &[u32] {
        self.rooms.get(&room).map_or(&[], |r| &r.slots)
    }

    /// Remembers who the request behind `room` is, for the watchdog's table.
    pub fn describe(&mut self, room: u64, request_id: &str, trace_id: &str) {
        if let Some(r) = self.rooms.get_mut(&room) {
            if r.request_id.is_empty() {
                r.request_id = request_id.to_owned();
            }
            if r.trace_id.is_empty() {
                r.trace_id = trace_id.to_owned();
            }
        }
    }

    /// Every room whose hand-over has not ended: not failed, and not yet finished by its
    /// receiver (a room that succeeded waits for that), oldest in its state first (for a
    /// report of the service's own stall; nothing is marked).
    pub fn under_way(&self, now: Instant) -> Vec<Stuck> {
        let mut out: Vec<Stuck> = self
            .rooms
            .iter()
            .filter(|(_, r)| r.state != RoomState::Failed)
            .map(|(&id, r)| Stuck {
                room: id,
                request_id: r.request_id.clone(),
                trace_id: r.trace_id.clone(),
                state: r.state,
                age: now.duration_since(r.entered),
                timeline: r.history.clone(),
            })
            .collect();
        out.sort_by_key(|s| std::cmp::Reverse(s.age));
        out
    }

    /// Rooms by state and the oldest one's age in each.
    pub fn census(&self, now: Instant) -> Vec<(RoomState, usize, Duration)> {
        RoomState::ALL
            .iter()
            .map(|&st| {
                let mut n = 0;
                let mut oldest = Duration::ZERO;
                for r in self.rooms.values().filter(|r| r.state == st) {
                    n += 1;
                    oldest = oldest.max(now.duration_since(r.entered));
                }
                (st, n, oldest)
            })
            .collect()
    }

    /// How many rooms still under way (not yet succeeded or failed) have been in their
    /// state longer than each of [`AGE_THRESHOLDS`] seconds.
    pub fn older_than(&self, now: Instant) -> [usize; AGE_THRESHOLDS.len()] {
        let mut out = [0; AGE_THRESHOLDS.len()];
        for r in self.rooms.values().filter(|r| !r.state.is_final()) {
            let age = now.duration_since(r.entered).as_secs_f64();
            for (n, &t) in out.iter_mut().zip(&AGE_THRESHOLDS) {
                *n += usize::from(age > t);
            }
        }
        out
    }

    /// Rooms past `fraction` of their state's deadline that were not reported in that
    /// state yet (each is reported once per state).
    pub fn stuck(&mut self, now: Instant, fraction: f64) -> Vec<Stuck> {
        let mut out = Vec::new();
        for (&id, r) in &mut self.rooms {
            let Some(limit) = self.deadlines.of(r.state) else {
                continue;
            };
            let age = now.duration_since(r.entered);
            if !r.stalled && age >= limit.mul_f64(fraction) {
                r.stalled = true;
                note(
                    r,
                    Step::Stuck {
                        seconds: age.as_secs_f64(),
                    },
                );
                out.push(Stuck {
                    room: id,
                    request_id: r.request_id.clone(),
                    trace_id: r.trace_id.clone(),
                    state: r.state,
                    age,
                    timeline: r.history.clone(),
                });
            }
        }
        out.sort_by_key(|s| std::cmp::Reverse(s.age));
        out
    }

    /// Who room `room` serves (request and trace ids) and its history, if it is known.
    pub fn story(&self, room: u64) -> Option<Story> {
        let r = self.rooms.get(&room)?;
        Some(Story {
            request_id: r.request_id.clone(),
            trace_id: r.trace_id.clone(),
            history: r.history.clone(),
        })
    }

    /// Drops failed rooms older than `linger`: both sides had that long to learn why.
    pub fn forget_failed(&mut self, now: Instant, linger: Duration) {
        self.rooms
            .retain(|_, r| r.state != RoomState::Failed || now.duration_since(r.entered) < linger);
    }

    /// What the receiver loads: pages and aux data, once the room succeeded.
    pub fn result(&mut self, room: u64, lease: Lease) -> Result<(Vec<RoomPage>, Aux), RoomError> {
        let r = self.get(room)?;
        Self::check_side(r, room, Side::Receiver, lease)?;
        match (r.state, &r.aux) {
            (RoomState::Success, Some(aux)) => Ok((r.pages.clone(), aux.clone())),
            (state, _) => Err(RoomError::WrongState {
                room,
                state,
                need: RoomState::Success,
            }),
        }
    }

    /// The receiver took its pages: the room ends and its slots are free.
    pub fn finish(&mut self, room: u64, lease: Lease) -> Result<Released, RoomError> {
        self.result(room, lease)?;
        let r = self.rooms.remove(&room).expect("checked above");
        Ok(Released {
            free_now: r.slots,
            quarantined: Vec::new(),
        })
    }

    /// `sender_done`: the sender itself gave up, so it writes no more.
    fn fail(r: &mut Room, reason: String, sender_done: bool, now: Instant) -> Released {
        let writing = r.state == RoomState::Transferring && !sender_done;
        Self::advance(r, RoomState::Failed, now);
        note(r, Step::Failed(reason.clone()));
        r.reason = Some(reason);
        let slots = std::mem::take(&mut r.slots);
        match (writing, r.sender) {
            // The sender may still be writing: hold its slots until its lease lets go.
            (true, Some(lease)) => Released {
                free_now: Vec::new(),
                quarantined: slots.into_iter().map(|s| (s, lease)).collect(),
            },
            _ => Released {
                free_now: slots,
                quarantined: Vec::new(),
            },
        }
    }

    /// Either side gives up (client gone, error, its own deadline). None if the room is
    /// already final or not this lease's. An abort can overtake its side's open (the
    /// client left while the open was on its way): a room not known yet is remembered as
    /// failed, so the late open is refused instead of waiting for its deadline; it is
    /// forgotten with the other failed rooms ([`Self::forget_failed`]), and at most
    /// [`MAX_EARLY_ABORTS`] wait at once.
    pub fn abort(
        &mut self,
        room: u64,
        lease: Lease,
        reason: &str,
        now: Instant,
    ) -> Option<Released> {
        let Some(r) = self.rooms.get_mut(&room) else {
            let early = self.rooms.values().filter(|r| r.is_early_abort()).count();
            if early < MAX_EARLY_ABORTS {
                let mut r = Room::new(now);
                r.state = RoomState::Failed;
                let why = format!("aborted before it opened: {reason}");
                note(&mut r, Step::Failed(why.clone()));
                r.reason = Some(why);
                self.rooms.insert(room, r);
            }
            return None;
        };
        if r.state.is_final() || (r.sender != Some(lease) && r.receiver != Some(lease)) {
            return None;
        }
        let by_sender = r.sender == Some(lease);
        Some(Self::fail(r, format!("aborted: {reason}"), by_sender, now))
    }

    /// Fails `room` whoever asks (the watchdog). A room that succeeded and whose receiver
    /// has not taken its pages fails too, giving its slots back at once (nobody writes
    /// them any more). None if it is unknown or failed.
    pub fn abort_any(&mut self, room: u64, reason: &str, now: Instant) -> Option<Released> {
        let r = self.rooms.get_mut(&room)?;
        match r.state {
            RoomState::Failed => None,
            RoomState::Success => {
                r.state = RoomState::Failed;
                r.entered = now;
                r.stalled = false;
                note(r, Step::FailedAfterHandOver(reason.to_owned()));
                r.reason = Some(reason.to_owned());
                r.pages.clear();
                Some(Released {
                    free_now: std::mem::take(&mut r.slots),
                    quarantined: Vec::new(),
                })
            }
            _ => Some(Self::fail(r, reason.to_owned(), false, now)),
        }
    }

    /// Fails every room past its state's deadline; a Success room whose receiver never
    /// took its pages is dropped. Returns them with the state they were stuck in and what
    /// they released.
    pub fn expire(&mut self, now: Instant) -> Vec<(u64, RoomState, Released)> {
        let mut out = Vec::new();
        let mut dropped = Vec::new();
        for (&id, r) in &mut self.rooms {
            let Some(limit) = self.deadlines.of(r.state) else {
                continue;
            };
            if now.duration_since(r.entered) < limit {
                continue;
            }
            if r.state == RoomState::Success {
                // Nobody writes any more: the slots are free.
                dropped.push(id);
                out.push((
                    id,
                    RoomState::Success,
                    Released {
                        free_now: std::mem::take(&mut r.slots),
                        quarantined: Vec::new(),
                    },
                ));
            } else {
                let (state, reason) = (
                    r.state,
                    format!("deadline: {:?} for more than {limit:?}", r.state),
                );
                out.push((id, state, Self::fail(r, reason, false, now)));
            }
        }
        for id in dropped {
            self.rooms.remove(&id);
        }
        out
    }

    /// A lease ended (its worker died): its rooms fail; failed rooms it was the last side
    /// of are dropped.
    pub fn lease_lost(&mut self, lease: Lease, now: Instant) -> Vec<(u64, Released)> {
        let mut out = Vec::new();
        for (&id, r) in &mut self.rooms {
            if r.sender != Some(lease) && r.receiver != Some(lease) {
                continue;
            }
            if !r.state.is_final() {
                let reason = "the peer's lease was lost".to_owned();
                out.push((id, Self::fail(r, reason, false, now)));
            } else if r.state == RoomState::Success && r.receiver == Some(lease) {
                // Nobody will take these pages: the room ends here.
                out.push((
                    id,
                    Released {
                        free_now: std::mem::take(&mut r.slots),
                        quarantined: Vec::new(),
                    },
                ));
                r.state = RoomState::Failed;
                note(r, Step::ReceiverLeaseLost(lease));
                r.reason = Some("the receiver's lease was lost".to_owned());
            }
            if r.sender == Some(lease) {
                r.sender = None;
            }
            if r.receiver == Some(lease) {
                r.receiver = None;
            }
        }
        self.rooms.retain(|_, r| {
            !(r.state == RoomState::Failed && r.sender.is_none() && r.receiver.is_none())
        });
        out
    }

    pub fn len(&self) -> usize {
        self.rooms.len()
    }

    pub fn is_empty(&self) -> bool {
        self.rooms.is_empty()
    }
}

#[cfg(test)]
mod tests;
