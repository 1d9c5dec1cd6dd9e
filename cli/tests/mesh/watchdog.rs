//! The cache service's watchdog across a real process: `pdmesh cache --watchdog soft` logs
//! a table of the rooms stuck past half their state's deadline, each named by request,
//! room, state and trace id, and leaves them to their deadlines; `--watchdog hard` fails
//! them, and the mirror slots they held come back. Rooms are driven over gRPC by two
//! registered clients (a sender, as prefill is, and a receiver, as decode is); a room is
//! made stuck by a side that joins it and then does nothing more.

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::process::{Child, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use pdmesh_cache::client::{DataPlane, HostClient};
use pdmesh_kv::{DType, KvLayout};
use pdmesh_proto::cache::v1 as pb;
use pdmesh_testkit::service::{answer, connect};

/// A `pdmesh cache` child, killed when dropped, and its stderr as it comes.
struct Cache {
    child: Child,
    addr: SocketAddr,
    log: Arc<Mutex<Vec<String>>>,
    _dir: tempfile::TempDir,
}

impl Drop for Cache {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Cache {
    /// Starts `pdmesh cache --watchdog MODE` with deadlines (ms) for bootstrapping,
    /// waiting for input, transferring and success.
    fn start(mode: &str, [boot, wait, transfer, success]: [u64; 4]) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let mut child = crate::pdmesh()
            .args([
                "cache",
                "--listen",
                "127.0.0.1:0",
                "--host-mirror-size",
                "64tokens",
            ])
            .arg("--shm-dir")
            .arg(dir.path())
            .arg("--incident-dir")
            .arg(dir.path().join("incidents"))
            .args(["--watchdog", mode])
            .arg(format!("--room-bootstrap-ms={boot}"))
            .arg(format!("--room-wait-ms={wait}"))
            .arg(format!("--room-transfer-ms={transfer}"))
            .arg(format!("--room-success-ms={success}"))
            .env("RUST_LOG", "warn")
            .env_remove("OTEL_EXPORTER_OTLP_ENDPOINT")
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let log = Arc::new(Mutex::new(Vec::new()));
        let (tx, rx) = std::sync::mpsc::channel();
        let (lines, sink) = (child.stderr.take().unwrap(), log.clone());
        std::thread::spawn(move || {
            for line in BufReader::new(lines).lines() {
                let Ok(line) = line else { return };
                if let Some(a) = line.strip_prefix("cache listening on ") {
                    let _ = tx.send(a.trim().parse::<SocketAddr>().unwrap());
                }
                sink.lock().unwrap().push(line);
            }
        });
        let addr = rx
            .recv_timeout(Duration::from_secs(60))
            .expect("the cache service never printed its address");
        Self {
            child,
            addr,
            log,
            _dir: dir,
        }
    }

    fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    fn incidents(&self) -> Vec<pdmesh_incident::Incident> {
        pdmesh_incident::list(&self._dir.path().join("incidents")).unwrap()
    }

    fn log(&self) -> String {
        self.log.lock().unwrap().join("\n")
    }

    async fn stats(&self) -> pb::StatsResponse {
        let mut c = connect(self.url(), pb::cache_client::CacheClient::new).await;
        answer(c.stats(pb::StatsRequest {})).await
    }

    async fn client(&self, name: &str) -> HostClient {
        let auth = pdmesh_tls::test_ca::auth();
        HostClient::connect(&self.url(), (name, ""), &layout(), DataPlane::Grpc, &auth)
            .await
            .unwrap()
    }

    /// Every row of every stuck-room table logged so far, with the table's heading (what
    /// was done with them).
    fn stuck_rows(&self) -> Vec<(String, Row)> {
        stuck_rows(&self.log.lock().unwrap())
    }
}

/// 4-token pages of a small llama layout: the 64-token mirror holds 16 of them.
fn layout() -> KvLayout {
    KvLayout::llama(2, 1, 8, DType::F16, 4)
}

/// One row of the watchdog's table.
#[derive(Clone, Debug, PartialEq)]
struct Row {
    request: String,
    room: u64,
    state: String,
    age_s: f64,
    trace: String,
}

fn stuck_rows(log: &[String]) -> Vec<(String, Row)> {
    let mut out = Vec::new();
    let mut lines = log.iter();
    while let Some(line) = lines.next() {
        let Some(rest) = line.split("stuck rooms (").nth(1) else {
            continue;
        };
        let heading = rest.split("):").next().unwrap_or_default().to_owned();
        // A table still being read has no header yet.
        let Some(header) = lines.next() else { break };
        let header: Vec<&str> = header.split_whitespace().collect();
        assert_eq!(
            header,
            ["request", "room", "state", "age", "trace"],
            "the table's header, in {log:#?}"
        );
        // Rows run until the next log line; the last one ends with the event's fields.
        for row in lines.clone() {
            let cols: Vec<&str> = row.split_whitespace().collect();
            let parsed = match cols[..] {
                [request, room, state, age, trace, ..] => room
                    .parse()
                    .ok()
                    .zip(age.strip_suffix('s').and_then(|a| a.parse().ok()))
                    .map(|(room, age_s)| Row {
                        request: request.into(),
                        room,
                        state: state.into(),
                        age_s,
                        trace: trace.into(),
                    }),
                _ => None,
            };
            let Some(r) = parsed else { break };
            out.push((heading.clone(), r));
            lines.next();
        }
    }
    out
}

async fn until<T>(what: &str, secs: u64, log: &Cache, mut f: impl AsyncFnMut() -> Option<T>) -> T {
    let deadline = Instant::now() + Duration::from_secs(secs);
    loop {
        if let Some(v) = f().await {
            return v;
        }
        assert!(
            Instant::now() < deadline,
            "timed out waiting for {what}; the cache service logged:\n{}",
            log.log()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Rooms, one per state the test leaves it in.
const BOOTSTRAPPING: u64 = 11;
const WAITING: u64 = 12;
const TRANSFERRING: u64 = 13;
const SUCCEEDED: u64 = 14;
const FINISHED: u64 = 15;

fn request_id(room: u64) -> String {
    format!("req-{room}")
}

/// A distinct 32-hex-digit trace id per room, as the workers send theirs.
fn trace_id(room: u64) -> String {
    format!("{:032x}", 0x7ace_0000_0000_u64 + room)
}

async fn open(c: &HostClient, room: u64, side: pb::RoomSide) -> pb::RoomState {
    let st = c
        .room_open(room, side, &request_id(room), &trace_id(room))
        .await
        .unwrap();
    st.state()
}

fn aux(room: u64) -> pb::RoomAux {
    pb::RoomAux {
        room,
        first_token: 7,
        prompt_tokens: 12,
        ..Default::default()
    }
}

fn pages(slots: &[u32]) -> Vec<pb::RoomPage> {
    slots
        .iter()
        .map(|&slot| pb::RoomPage {
            slot,
            checksum: 0xc0ffee + u64::from(slot),
        })
        .collect()
}

/// The rooms of both tests, and the slots the two that hold some were given. Decode
/// (`d`) joins every room; prefill (`p`) stops at a different step in each.
async fn rooms(p: &HostClient, d: &HostClient) -> (Vec<u32>, Vec<u32>) {
    use pb::RoomSide::{Receiver, Sender};
    // Prefill never joins.
    assert_eq!(
        open(d, BOOTSTRAPPING, Receiver).await,
        pb::RoomState::Bootstrapping
    );
    // Prefill joins and never starts writing.
    open(d, WAITING, Receiver).await;
    assert_eq!(
        open(p, WAITING, Sender).await,
        pb::RoomState::WaitingForInput
    );
    // Prefill starts writing and never commits.
    open(d, TRANSFERRING, Receiver).await;
    open(p, TRANSFERRING, Sender).await;
    let writing = p.room_start(TRANSFERRING, 3).await.unwrap();
    assert_eq!(writing.len(), 3);
    // Prefill hands its pages over; decode never takes them.
    let handed = hand_over(p, d, SUCCEEDED, 2).await;
    // A healthy hand-over from start to end.
    let slots = hand_over(p, d, FINISHED, 1).await;
    assert_eq!(d.room_result(FINISHED).await.unwrap().pages, pages(&slots));
    d.room_finish(FINISHED).await.unwrap();
    (writing, handed)
}

/// Room `room` opened on both sides and `n` pages written and committed by `p`: the
/// slots they went to.
async fn hand_over(p: &HostClient, d: &HostClient, room: u64, n: u32) -> Vec<u32> {
    use pb::RoomSide::{Receiver, Sender};
    open(d, room, Receiver).await;
    open(p, room, Sender).await;
    let slots = p.room_start(room, n).await.unwrap();
    p.room_commit(room, pages(&slots), aux(room)).await.unwrap();
    slots
}

/// Every stuck-room row logged once each of `stuck` is in the table (`what`).
async fn tabled(cache: &Cache, what: &str, stuck: &[u64]) -> Vec<(String, Row)> {
    until(what, 30, cache, async || {
        let rows = cache.stuck_rows();
        stuck
            .iter()
            .all(|r| rows.iter().any(|(_, row)| row.room == *r))
            .then_some(rows)
    })
    .await
}

/// The room's state and reason now, as its receiver sees it.
async fn state(d: &HostClient, room: u64) -> (pb::RoomState, String) {
    let st = d
        .room_wait(room, pb::RoomState::Success, Duration::ZERO)
        .await
        .unwrap();
    (st.state(), st.reason)
}

/// The rows by room, checked to name each room once.
fn by_room(rows: &[(String, Row)]) -> BTreeMap<u64, (String, Row)> {
    let out: BTreeMap<u64, (String, Row)> = rows
        .iter()
        .map(|(h, r)| (r.room, (h.clone(), r.clone())))
        .collect();
    assert_eq!(out.len(), rows.len(), "a room is listed twice: {rows:#?}");
    out
}

fn check_row(rows: &BTreeMap<u64, (String, Row)>, room: u64, state: &str, heading: &str) {
    let (h, r) = &rows[&room];
    assert_eq!(h, heading, "{r:?}");
    assert_eq!(r.request, request_id(room));
    assert_eq!(r.trace, trace_id(room), "the row names the room's trace");
    assert_eq!(r.state, state, "{r:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn soft_watchdog_tables_exactly_the_stuck_rooms_with_their_traces_and_fails_none() {
    // Rooms under way are stuck after 3 s; one that succeeded only after 30 s.
    let cache = Cache::start("soft", [6_000, 6_000, 6_000, 60_000]);
    let (p, d) = (cache.client("prefill").await, cache.client("decode").await);
    let (writing, handed) = rooms(&p, &d).await;

    let stuck = [BOOTSTRAPPING, WAITING, TRANSFERRING];
    let rows = tabled(&cache, "the three stuck rooms in the log", &stuck).await;
    // Reported, not failed: every room is where it was.
    for (room, want) in [
        (BOOTSTRAPPING, pb::RoomState::Bootstrapping),
        (WAITING, pb::RoomState::WaitingForInput),
        (TRANSFERRING, pb::RoomState::Transferring),
        (SUCCEEDED, pb::RoomState::Success),
    ] {
        assert_eq!(state(&d, room).await, (want, String::new()), "room {room}");
    }
    let st = cache.stats().await;
    assert_eq!(st.room_stalls, 3, "{st:?}");
    assert!(!st.room_aborts.contains_key("watchdog"), "{st:?}");
    assert_eq!(
        st.room_slots as usize,
        writing.len() + handed.len(),
        "{st:?}"
    );

    // One wedge report (one cause, one component) naming every stuck room and its trace,
    // with the oldest room's timeline.
    let reports = until("the wedge report", 10, &cache, async || {
        // (A report of the service's own stall, were this machine to starve it, is
        // another cause.)
        let r: Vec<_> = cache
            .incidents()
            .into_iter()
            .filter(|i| i.place.stage != "service stall")
            .collect();
        (r.len() == 1 && r[0].stuck_rooms.len() == stuck.len()).then_some(r)
    })
    .await;
    let w = &reports[0];
    assert_eq!(w.kind, pdmesh_incident::Kind::Wedge);
    assert_eq!(w.place.service, "cache");
    let mut named: Vec<(u64, String)> = w
        .stuck_rooms
        .iter()
        .map(|r| (r.room, r.trace_id.clone()))
        .collect();
    named.sort();
    assert_eq!(named, stuck.map(|r| (r, trace_id(r))));
    let oldest = w.place.room.expect("the oldest room");
    assert_eq!(w.place.trace_id, trace_id(oldest));
    let steps: Vec<&str> = w.timeline.iter().map(|s| &s.what[..]).collect();
    assert_eq!(steps.first(), Some(&"opened (bootstrapping)"), "{steps:?}");
    assert!(
        steps
            .last()
            .unwrap()
            .starts_with("the watchdog found it stuck"),
        "{steps:?}"
    );
    assert!(
        w.metrics
            .iter()
            .any(|m| m.name == "room stalls seen" && m.after >= Some(1.0))
    );
    assert_eq!(w.config["watchdog"], "soft");

    let rows = by_room(&rows);
    assert_eq!(rows.keys().copied().collect::<Vec<_>>(), stuck, "{rows:#?}");
    let heading = "left to their deadlines";
    check_row(&rows, BOOTSTRAPPING, "bootstrapping", heading);
    check_row(&rows, WAITING, "waiting_for_input", heading);
    check_row(&rows, TRANSFERRING, "transferring", heading);
    for (_, r) in rows.values() {
        assert!(r.age_s >= 3.0, "reported before half its deadline: {r:?}");
    }

    // Their own deadlines fail them, each once; the watchdog reports none of them again.
    for room in stuck {
        let st = d
            .room_wait(room, pb::RoomState::Success, Duration::from_secs(20))
            .await
            .unwrap();
        assert_eq!(st.state(), pb::RoomState::Failed, "room {room}");
        assert!(st.reason.starts_with("deadline: "), "room {room}: {st:?}");
    }
    let st = cache.stats().await;
    let timeouts: BTreeMap<&str, u64> = st
        .room_timeouts
        .iter()
        .map(|(k, v)| (k.as_str(), *v))
        .collect();
    assert_eq!(
        timeouts,
        BTreeMap::from([
            ("bootstrapping", 1),
            ("transferring", 1),
            ("waiting_for_input", 1)
        ]),
        "{st:?}"
    );
    assert_eq!(st.room_stalls, 3, "{st:?}");
    assert!(!st.room_aborts.contains_key("watchdog"), "{st:?}");
    // The three deadlines are one room_deadline report (one cause, one component), its
    // first room's timeline ending in the failure.
    let failed = until(
        "the deadline report counting three",
        10,
        &cache,
        async || {
            cache
                .incidents()
                .into_iter()
                .find(|i| i.kind == pdmesh_incident::Kind::RoomDeadline && i.repeats == 3)
        },
    )
    .await;
    let room = failed.place.room.expect("a room");
    assert!(stuck.contains(&room) && failed.place.trace_id == trace_id(room));
    let last = &failed.timeline.last().expect("a timeline").what;
    assert!(last.starts_with("failed: deadline"), "{last}");
    let again = by_room(&cache.stuck_rows());
    assert_eq!(
        again.keys().copied().collect::<Vec<_>>(),
        stuck,
        "{again:#?}"
    );
    // The room that succeeded in time was never stuck: decode still takes its pages.
    let got = d.room_result(SUCCEEDED).await.unwrap();
    assert_eq!(got.pages, pages(&handed));
    assert_eq!(got.aux.map(|a| a.first_token), Some(7));
    d.room_finish(SUCCEEDED).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hard_watchdog_fails_the_stuck_rooms_and_their_mirror_slots_come_back() {
    // Every room not finished is stuck after 2 s.
    let cache = Cache::start("hard", [4_000; 4]);
    let (p, d) = (cache.client("prefill").await, cache.client("decode").await);
    let (writing, handed) = rooms(&p, &d).await;

    let stuck = [BOOTSTRAPPING, WAITING, TRANSFERRING, SUCCEEDED];
    let rows = tabled(&cache, "the four stuck rooms in the log", &stuck).await;
    let rows = by_room(&rows);
    assert_eq!(rows.keys().copied().collect::<Vec<_>>(), stuck, "{rows:#?}");
    check_row(&rows, BOOTSTRAPPING, "bootstrapping", "failed");
    check_row(&rows, WAITING, "waiting_for_input", "failed");
    check_row(&rows, TRANSFERRING, "transferring", "failed");
    check_row(&rows, SUCCEEDED, "success", "failed");

    // Both sides learn why; decode cannot take pages the watchdog gave back.
    for room in stuck {
        assert_eq!(
            state(&d, room).await,
            (pb::RoomState::Failed, "watchdog: stuck".to_owned()),
            "room {room}"
        );
    }
    let err = d.room_result(SUCCEEDED).await.unwrap_err();
    assert!(err.to_string().contains("watchdog: stuck"), "{err:?}");
    let st = cache.stats().await;
    assert_eq!(st.room_aborts.get("watchdog"), Some(&4), "{st:?}");
    assert_eq!(st.room_stalls, 4, "{st:?}");
    assert!(
        st.room_timeouts.is_empty(),
        "the watchdog came first: {st:?}"
    );
    // The handed-over pages are free at once; the slots prefill was writing wait for it.
    assert_eq!(st.room_slots, 0, "{st:?}");
    assert_eq!(st.quarantined_slots as usize, writing.len(), "{st:?}");
    assert_eq!(st.used_pages as usize, writing.len(), "{st:?}");
    assert!(handed.iter().all(|s| !writing.contains(s)));

    // Prefill's late commit is refused, naming the watchdog, and its slots come back.
    let err = p
        .room_commit(TRANSFERRING, pages(&writing), aux(TRANSFERRING))
        .await
        .unwrap_err();
    assert!(err.to_string().contains("watchdog: stuck"), "{err:?}");
    let st = cache.stats().await;
    assert_eq!(
        (st.used_pages, st.quarantined_slots, st.late_writes_rejected),
        (0, 0, 1),
        "{st:?}"
    );
    // The whole mirror is there for the next hand-over.
    const NEXT: u64 = 21;
    open(&d, NEXT, pb::RoomSide::Receiver).await;
    open(&p, NEXT, pb::RoomSide::Sender).await;
    let all = p.room_start(NEXT, st.total_pages).await.unwrap();
    assert_eq!(all.len(), 16);
}
