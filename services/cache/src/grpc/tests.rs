//! Tests of the commit that rides on a peer's last batch of pages, at the room's home and back at the sender.

use std::time::Duration;

use prost::Message as _;

use super::convert::status;
use super::relay::peer_commit_result;
use super::rooms::peer_commit;
use super::*;
use crate::MirrorSize;
use crate::rooms::RoomState;

#[test]
fn a_commit_trailer_that_does_not_decode_or_names_another_room_is_refused_with_a_code() {
    let dir = tempfile::tempdir().unwrap();
    let shared = Shared::new(State::new(
        MirrorSize::Tokens(64),
        Some(crate::mirror::private_dir(dir.path()).unwrap()),
        Duration::from_secs(10),
    ));
    // Over the page-transport connection of lease `sender`.
    let reply = |room, sender, trailer: &[u8]| {
        pb::PeerCommitReply::decode(&peer_commit(&shared, room, sender, trailer)[..]).unwrap()
    };
    let garbage = reply(7, Lease::from_test_number(1), &[0xff; 9]);
    assert_eq!(garbage.code, tonic::Code::InvalidArgument as i32);
    assert!(garbage.message.contains("does not decode"), "{garbage:?}");
    let other = pb::RoomCommitRequest {
        room: 8,
        ..Default::default()
    }
    .encode_to_vec();
    let other = reply(7, Lease::from_test_number(1), &other);
    assert_eq!(other.code, tonic::Code::InvalidArgument as i32);
    assert!(other.message.contains("room 8"), "{other:?}");
    // A lease that is not a peer's (unknown here, or a local worker's) is refused.
    let commit_over = |lease: Lease, sender: Lease| {
        let req = pb::RoomCommitRequest {
            lease: lease.to_wire(),
            room: 7,
            pages: Vec::new(),
            aux: Some(pb::RoomAux {
                room: 7,
                ..Default::default()
            }),
        };
        reply(7, sender, &req.encode_to_vec())
    };
    let commit_with = |lease: Lease| commit_over(lease, lease);
    let unknown = commit_with(Lease::from_test_number(99));
    assert_eq!(
        unknown.code,
        tonic::Code::PermissionDenied as i32,
        "{unknown:?}"
    );
    assert!(unknown.status.is_none());
    let layout = pdmesh_kv::KvLayout::llama(2, 1, 8, pdmesh_kv::DType::F16, 16);
    let worker = shared
        .with(|s| s.register("w", layout.clone(), std::time::Instant::now()))
        .unwrap()
        .lease;
    let local = commit_with(worker);
    assert_eq!(
        local.code,
        tonic::Code::PermissionDenied as i32,
        "{local:?}"
    );
    assert!(local.message.contains("not a peer"), "{local:?}");
    // A peer's lease commits only over its own connection.
    let peer = shared
        .with(|s| s.register_peer("p", &layout, std::time::Instant::now()))
        .unwrap()
        .lease;
    let other_peer = shared
        .with(|s| s.register_peer("q", &layout, std::time::Instant::now()))
        .unwrap()
        .lease;
    let stolen = commit_over(peer, other_peer);
    assert_eq!(
        stolen.code,
        tonic::Code::PermissionDenied as i32,
        "{stolen:?}"
    );
    assert!(stolen.message.contains("another lease"), "{stolen:?}");
}

#[test]
fn a_homes_reply_to_a_commit_becomes_the_status_or_the_error_it_names() {
    let ok = pb::PeerCommitReply {
        code: 0,
        message: String::new(),
        status: Some(status(RoomState::Success, None)),
    }
    .encode_to_vec();
    let st = peer_commit_result("home", Some(&ok)).unwrap();
    assert_eq!(st.state, pb::RoomState::Success as i32);
    let refused = pb::PeerCommitReply {
        code: tonic::Code::Aborted as i32,
        message: "room 3 failed: deadline".into(),
        status: None,
    }
    .encode_to_vec();
    let e = peer_commit_result("home", Some(&refused)).unwrap_err();
    assert_eq!(e.code(), tonic::Code::Aborted);
    let e = e.to_string();
    assert!(
        e.contains("room 3 failed: deadline") && e.contains("home"),
        "{e}"
    );
    for bad in [None, Some(&[0xffu8; 3][..])] {
        let e = peer_commit_result("home", bad).unwrap_err();
        assert_eq!(e.code(), tonic::Code::Internal, "{e:?}");
    }
}
