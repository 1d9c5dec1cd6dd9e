//! Tests of the rooms' state machine: its moves, deadlines, aborts, watchdog and lost leases.

use super::*;
use RoomState::*;

const D: RoomDeadlines = RoomDeadlines {
    bootstrapping: Duration::from_secs(1),
    waiting_for_input: Duration::from_secs(2),
    transferring: Duration::from_secs(3),
    success: Duration::from_secs(4),
};
const P: Lease = Lease::from_test_number(7); // prefill's lease
const DEC: Lease = Lease::from_test_number(9); // decode's lease

#[test]
fn every_state_has_its_own_label_and_every_label_a_state() {
    let labels: Vec<_> = RoomState::ALL.iter().map(|s| s.label()).collect();
    assert_eq!(labels, labels::RoomState::ALL);
}

fn aux(room: u64) -> Aux {
    Aux {
        room,
        first_token: 42,
        first_logprob: -0.5,
        prompt_tokens: 3,
        ..Aux::default()
    }
}

#[test]
fn rooms_under_way_are_counted_past_each_age_threshold_in_their_state() {
    let (mut rooms, t) = (Rooms::new(D), Instant::now());
    assert_eq!(rooms.older_than(t), [0; 4]);
    rooms.open(1, Side::Receiver, DEC, t).unwrap();
    rooms
        .open(2, Side::Receiver, DEC, t + Duration::from_secs(4))
        .unwrap();
    let now = t + Duration::from_secs(10);
    // Room 1: 10 s in bootstrapping; room 2: 6 s.
    assert_eq!(rooms.older_than(now), [2, 2, 0, 0]);
    // A move to another state restarts the clock; finished rooms are not counted.
    rooms.open(2, Side::Sender, P, now).unwrap();
    assert_eq!(rooms.older_than(now), [1, 1, 0, 0]);
    rooms.abort(1, DEC, "test", now).unwrap();
    assert_eq!(
        rooms.older_than(now + Duration::from_secs(40)),
        [1, 1, 1, 0]
    );
}

#[test]
fn only_forward_moves_and_failure_are_allowed() {
    let all = [
        Failed,
        Bootstrapping,
        WaitingForInput,
        Transferring,
        Success,
    ];
    let allowed: Vec<_> = all
        .iter()
        .flat_map(|&a| all.iter().map(move |&b| (a, b)))
        .filter(|&(a, b)| a.may_become(b))
        .collect();
    assert_eq!(
        allowed,
        [
            (Bootstrapping, Failed),
            (Bootstrapping, WaitingForInput),
            (WaitingForInput, Failed),
            (WaitingForInput, Transferring),
            (Transferring, Failed),
            (Transferring, Success),
        ]
    );
}

#[test]
fn a_room_goes_from_bootstrap_to_success_and_ends_when_the_receiver_takes_it() {
    let (mut rooms, t) = (Rooms::new(D), Instant::now());
    assert_eq!(rooms.open(1, Side::Receiver, DEC, t), Ok(Bootstrapping));
    assert_eq!(rooms.open(1, Side::Sender, P, t), Ok(WaitingForInput));
    assert!(matches!(
        rooms.open(1, Side::Sender, Lease::from_test_number(99), t),
        Err(RoomError::SideTaken { .. })
    ));
    assert!(matches!(
        rooms.start_transfer(1, DEC, vec![], t),
        Err(RoomError::NotYours { .. })
    ));
    rooms.start_transfer(1, P, vec![3, 4], t).unwrap();
    assert!(matches!(
        rooms.result(1, DEC),
        Err(RoomError::WrongState {
            state: Transferring,
            ..
        })
    ));
    let pages = vec![
        RoomPage {
            slot: 3,
            checksum: 11,
        },
        RoomPage {
            slot: 4,
            checksum: 12,
        },
    ];
    rooms.commit(1, P, pages.clone(), aux(1), t).unwrap();
    assert_eq!(rooms.result(1, DEC), Ok((pages, aux(1))));
    let rel = rooms.finish(1, DEC).unwrap();
    assert_eq!(rel.free_now, vec![3, 4]);
    assert!(rooms.is_empty());
}

#[test]
fn every_state_has_a_deadline() {
    let t = Instant::now();
    for (stage, limit) in [
        (Bootstrapping, 1),
        (WaitingForInput, 2),
        (Transferring, 3),
        (Success, 4),
    ] {
        let mut rooms = Rooms::new(D);
        rooms.open(5, Side::Receiver, DEC, t).unwrap();
        if stage != Bootstrapping {
            rooms.open(5, Side::Sender, P, t).unwrap();
        }
        if matches!(stage, Transferring | Success) {
            rooms.start_transfer(5, P, vec![1], t).unwrap();
        }
        if stage == Success {
            rooms.commit(5, P, vec![], aux(5), t).unwrap();
        }
        assert_eq!(rooms.state(5).unwrap().0, stage);
        let just_before = t + Duration::from_secs(limit) - Duration::from_millis(1);
        assert!(rooms.expire(just_before).is_empty(), "{stage:?}");
        let gone = rooms.expire(t + Duration::from_secs(limit));
        assert_eq!(gone.len(), 1, "{stage:?}");
        assert_eq!(gone[0].1, stage);
        if stage == Success {
            // The receiver never came: the room is dropped and its slot is free.
            assert_eq!(gone[0].2.free_now, vec![1]);
            assert!(rooms.state(5).is_none());
            continue;
        }
        let (state, reason) = rooms.state(5).unwrap();
        assert_eq!(state, Failed);
        assert!(reason.unwrap().contains("deadline"), "{reason:?}");
        // Both sides learn it: every later call names the failure.
        assert!(matches!(
            rooms.result(5, DEC),
            Err(RoomError::Failed { .. })
        ));
    }
}

#[test]
fn an_abort_reaches_the_other_side_and_a_late_commit_is_rejected() {
    let (mut rooms, t) = (Rooms::new(D), Instant::now());
    rooms.open(2, Side::Receiver, DEC, t).unwrap();
    rooms.open(2, Side::Sender, P, t).unwrap();
    rooms.start_transfer(2, P, vec![8, 9], t).unwrap();
    assert_eq!(
        rooms.abort(2, Lease::from_test_number(1234), "not mine", t),
        None,
        "only a side may abort"
    );
    let rel = rooms.abort(2, DEC, "client disconnected", t).unwrap();
    // Prefill was writing: its slots wait for its lease before anyone reuses them.
    assert_eq!(rel.quarantined, vec![(8, P), (9, P)]);
    assert!(rel.free_now.is_empty());
    let err = rooms.commit(2, P, vec![], aux(2), t).unwrap_err();
    assert!(err.to_string().contains("client disconnected"), "{err}");
    assert_eq!(
        rooms.abort(2, P, "again", t),
        None,
        "final states stay final"
    );
}

/// The client left while decode's open was still on its way: its abort arrives first. The
/// late open is refused at once (it would otherwise wait for its deadline), and so is the
/// other side's; the record goes with the other failed rooms, and there is a bound on how
/// many wait.
#[test]
fn an_abort_that_overtakes_its_open_fails_the_late_opens() {
    let (mut rooms, t) = (Rooms::new(D), Instant::now());
    assert_eq!(
        rooms.abort(5, DEC, "client disconnected", t),
        None,
        "nothing to release"
    );
    for (side, lease) in [(Side::Receiver, DEC), (Side::Sender, P)] {
        let err = rooms.open(5, side, lease, t).unwrap_err();
        assert!(
            err.to_string()
                .contains("aborted before it opened: client disconnected"),
            "{err}"
        );
    }
    assert_eq!(rooms.state(5).map(|s| s.0), Some(Failed));
    assert!(rooms.under_way(t).is_empty());
    rooms.forget_failed(t + Duration::from_secs(10), Duration::from_secs(5));
    assert!(rooms.is_empty());
    for room in 0..MAX_EARLY_ABORTS as u64 + 10 {
        rooms.abort(1000 + room, DEC, "gone", t);
    }
    assert_eq!(rooms.len(), MAX_EARLY_ABORTS);
}

#[test]
fn the_watchdog_sees_each_stuck_room_once_per_state_and_may_fail_even_a_succeeded_one() {
    let (mut rooms, t) = (Rooms::new(D), Instant::now());
    rooms.open(1, Side::Receiver, DEC, t).unwrap(); // bootstrapping: 1 s
    rooms.open(2, Side::Receiver, DEC, t).unwrap();
    rooms.open(2, Side::Sender, P, t).unwrap();
    rooms.start_transfer(2, P, vec![5], t).unwrap();
    rooms.commit(2, P, vec![], aux(2), t).unwrap(); // success: 4 s
    rooms.describe(1, "req-1", "trace-1");
    let half = |s| t + Duration::from_millis(s);
    assert!(rooms.stuck(half(499), 0.5).is_empty());
    let stuck = rooms.stuck(half(500), 0.5);
    assert_eq!(stuck.len(), 1);
    assert_eq!(
        (
            stuck[0].room,
            stuck[0].state,
            &*stuck[0].request_id,
            &*stuck[0].trace_id
        ),
        (1, Bootstrapping, "req-1", "trace-1")
    );
    let steps: Vec<String> = stuck[0]
        .timeline
        .iter()
        .map(|(_, w)| w.to_string())
        .collect();
    assert_eq!(
        steps,
        [
            "opened (bootstrapping)".to_owned(),
            format!("the receiver (decode) joined (lease {DEC})"),
            "the watchdog found it stuck for 0.5 s".to_owned(),
        ]
    );
    assert!(rooms.stuck(half(900), 0.5).is_empty(), "reported once");
    let stuck = rooms.stuck(half(2000), 0.5);
    assert_eq!(stuck.iter().map(|s| s.room).collect::<Vec<_>>(), [2]);
    // Nobody took the pages: failing the room frees its slots at once.
    let rel = rooms.abort_any(2, "watchdog: stuck", half(2000)).unwrap();
    assert_eq!(rel.free_now, vec![5]);
    assert!(rel.quarantined.is_empty());
    assert_eq!(
        rooms.result(2, DEC),
        Err(RoomError::Failed {
            room: 2,
            reason: "watchdog: stuck".into()
        })
    );
    assert_eq!(rooms.abort_any(2, "again", half(2000)), None);
}

#[test]
fn a_lost_lease_fails_its_rooms_and_forgets_them_once_both_sides_are_gone() {
    let (mut rooms, t) = (Rooms::new(D), Instant::now());
    rooms.open(3, Side::Receiver, DEC, t).unwrap();
    rooms.open(3, Side::Sender, P, t).unwrap();
    rooms.open(4, Side::Receiver, DEC, t).unwrap(); // still bootstrapping
    let failed = rooms.lease_lost(P, t);
    assert_eq!(failed.len(), 1);
    assert_eq!(rooms.state(3).unwrap().0, Failed);
    assert_eq!(
        rooms.state(4).unwrap().0,
        Bootstrapping,
        "rooms without that lease go on"
    );
    assert_eq!(rooms.lease_lost(DEC, t).len(), 1, "room 4 fails now");
    assert!(
        rooms.state(3).is_none() && rooms.state(4).is_none(),
        "nobody is left to tell"
    );
    assert!(rooms.is_empty());
}
