//! The cache service's life: its drain at shutdown, its mirror private to the service
//! user, nothing left behind once it stops, and a loose mirror directory refused at start.

use std::time::Duration;

use pdmesh_cache::client::DataPlane;
use pdmesh_proto::cache::v1 as pb;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

mod common;

use common::{Server, client, config, layout, start, start_with};

/// At shutdown (SIGTERM) the service drains: a new room is refused as UNAVAILABLE (the
/// gateway then tries another host), while a room already open still gets its other side
/// and the service keeps answering; it stops once that room has ended.
#[tokio::test]
async fn at_shutdown_no_new_room_opens_and_the_service_stops_once_the_rooms_under_way_end() {
    let s = start_with("127.0.0.1:0".parse().unwrap(), 16, |c| {
        c.drain_timeout_ms = 60_000;
    })
    .await;
    let receiver = client(&s, "decode", DataPlane::Grpc).await;
    let sender = client(&s, "prefill", DataPlane::Grpc).await;
    receiver
        .room_open(1, pb::RoomSide::Receiver, "r1", "")
        .await
        .unwrap();
    s.svc.shutdown.cancel();
    let mut refused = None;
    for _ in 0..200 {
        match sender.room_open(2, pb::RoomSide::Sender, "r2", "").await {
            Err(e)
                if e.code() == tonic::Code::Unavailable && e.to_string().contains("draining") =>
            {
                refused = Some(e);
                break;
            }
            Err(e) => panic!("{e}"),
            // Not draining yet: this room is under way too; end it.
            Ok(_) => sender.room_abort(2, "not yet draining").await.unwrap(),
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let refused = refused.expect("a new room is refused while draining");
    assert!(
        refused.to_string().contains("try another host"),
        "{refused}"
    );
    // The room under way still takes its sender, and the service still answers.
    sender
        .room_open(1, pb::RoomSide::Sender, "r1", "")
        .await
        .unwrap();
    let census: u32 = s.stats().await.rooms.values().sum();
    assert!(census >= 1, "the open room is counted");
    assert!(!s.svc.task.is_finished(), "the drain waits for the room");
    sender.room_abort(1, "done").await.unwrap();
    // The service stops once no room is under way.
    s.svc.join().await.unwrap();
}

#[tokio::test]
async fn a_room_that_never_ends_holds_the_drain_only_to_its_bound() {
    let s = start_with("127.0.0.1:0".parse().unwrap(), 16, |c| {
        c.drain_timeout_ms = 300;
    })
    .await;
    let receiver = client(&s, "decode", DataPlane::Grpc).await;
    receiver
        .room_open(1, pb::RoomSide::Receiver, "r1", "")
        .await
        .unwrap();
    let t0 = std::time::Instant::now();
    // The drain ends at its bound.
    s.svc.stop().await.unwrap();
    assert!(
        t0.elapsed() >= Duration::from_millis(300),
        "{:?}",
        t0.elapsed()
    );
}

/// The mirror's directory and file are the service user's alone: the directory is made
/// 0700 as the service starts, the file 0600, and another local user (nobody, by a child
/// that drops root before trying) can open neither, though the --shm-dir above is open to
/// all (as /dev/shm is).
#[tokio::test]
async fn the_mirror_is_private_to_the_service_user_and_another_user_cannot_open_it() {
    use std::os::unix::fs::{MetadataExt, PermissionsExt};
    let s = start(4, 10_000).await;
    std::fs::set_permissions(s.dir.path(), std::fs::Permissions::from_mode(0o1777)).unwrap();
    // Serving (a Stats answer) means the start-up checks are behind it.
    s.stats().await;
    let dir = s.mirror_dir();
    let meta = std::fs::symlink_metadata(&dir).unwrap();
    assert!(meta.is_dir());
    assert_eq!(meta.mode() & 0o7777, 0o700, "{}", dir.display());
    let _w = client(&s, "writer", DataPlane::Shm).await;
    let files: Vec<_> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    assert_eq!(files.len(), 1, "{files:?}");
    let file = &files[0];
    let meta = std::fs::symlink_metadata(file).unwrap();
    assert!(meta.is_file());
    assert_eq!(meta.mode() & 0o7777, 0o600, "{}", file.display());
    assert_eq!(meta.uid(), effective_uid());

    if effective_uid() == 0 {
        // A control: a file others may read, beside the private directory, is read by
        // nobody; the mirror and its directory are not.
        let open_to_all = s.dir.path().join("open-to-all");
        std::fs::write(&open_to_all, b"x").unwrap();
        std::fs::set_permissions(&open_to_all, std::fs::Permissions::from_mode(0o644)).unwrap();
        assert_eq!(open_as_nobody(&open_to_all).map_err(|e| e.kind()), Ok(()));
        for path in [file, &dir] {
            let e = open_as_nobody(path).unwrap_err();
            assert_eq!(
                e.raw_os_error(),
                Some(libc::EACCES),
                "{}: {e}",
                path.display()
            );
        }
    } else {
        // Not root, so no other user to become: the mode bits (no group or other bit on
        // the directory or the file) are what keeps other users out.
        assert_eq!(std::fs::metadata(&dir).unwrap().mode() & 0o077, 0);
        assert_eq!(std::fs::metadata(file).unwrap().mode() & 0o077, 0);
    }
    s.stop().await;
}

/// A stopped service leaves nothing in the shared-memory directory: its mirror file goes,
/// and so does this user's directory for mirrors once it is empty. A file another cache
/// service keeps there keeps the directory.
#[tokio::test]
async fn a_stopped_service_leaves_no_mirror_file_or_empty_directory_behind() {
    for other in [false, true] {
        let s = start(4, 10_000).await;
        let w = client(&s, "writer", DataPlane::Shm).await;
        let dir = s.mirror_dir();
        assert_eq!(
            std::fs::read_dir(&dir).unwrap().count(),
            1,
            "the mirror file"
        );
        if other {
            std::fs::write(dir.join("pdmesh-mirror-of-another-service"), b"x").unwrap();
        }
        drop(w);
        // Stopped by hand: `Server::stop` would remove the --shm-dir with it.
        let Server { svc, dir: base } = s;
        svc.stop().await.unwrap();
        if other {
            let left: Vec<_> = std::fs::read_dir(&dir)
                .unwrap()
                .map(|e| e.unwrap().file_name())
                .collect();
            assert_eq!(
                left,
                ["pdmesh-mirror-of-another-service"],
                "only the other file"
            );
        } else {
            assert!(!dir.exists(), "{} is left behind", dir.display());
            assert!(base.path().is_dir(), "the --shm-dir itself stays");
        }
    }
}

/// Opens `path` read-only in a child that first becomes nobody (uid and gid 65534, no
/// supplementary groups): `Ok` if it could, else the error it got. The open runs between
/// fork and exec, so its error comes back as the spawn's.
fn open_as_nobody(path: &std::path::Path) -> std::io::Result<()> {
    use std::os::unix::process::CommandExt;
    let c_path = std::ffi::CString::new(path.as_os_str().as_encoded_bytes()).unwrap();
    let mut cmd = std::process::Command::new("/bin/true");
    // SAFETY: the closure only makes async-signal-safe calls (setgroups, setgid, setuid,
    // open, close) on memory allocated before the fork.
    unsafe {
        cmd.pre_exec(move || {
            if libc::setgroups(0, std::ptr::null()) != 0
                || libc::setgid(65534) != 0
                || libc::setuid(65534) != 0
            {
                return Err(std::io::Error::other("could not become nobody"));
            }
            let fd = libc::open(c_path.as_ptr(), libc::O_RDONLY | libc::O_CLOEXEC);
            if fd < 0 {
                return Err(std::io::Error::last_os_error());
            }
            libc::close(fd);
            Ok(())
        });
    }
    let status = cmd.status()?;
    assert!(status.success());
    Ok(())
}

fn effective_uid() -> u32 {
    // SAFETY: geteuid has no preconditions.
    unsafe { libc::geteuid() }
}

/// The error a service started with `cfg` refuses to start with (before serving: it
/// returns without being shut down).
async fn refused(cfg: pdmesh_cache::Config) -> String {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    tokio::time::timeout(
        Duration::from_secs(30),
        pdmesh_cache::run(cfg, listener, CancellationToken::new()),
    )
    .await
    .expect("the service started instead of refusing")
    .unwrap_err()
    .to_string()
}

/// A private directory someone made loose (0777), or one owned by another user, stops
/// the service at start with an error naming the directory and why.
#[tokio::test]
async fn a_loose_or_foreign_mirror_directory_makes_the_service_refuse_to_start() {
    use std::os::unix::fs::PermissionsExt;
    let base = tempfile::tempdir().unwrap();
    let dir = pdmesh_cache::mirror::dirs(Some(base.path())).remove(0);
    std::fs::create_dir(&dir).unwrap();
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o777)).unwrap();
    let cfg = config(base.path(), 4 * layout().bytes_per_page() as u64);
    let e = refused(cfg.clone()).await;
    assert!(
        e.contains(&dir.display().to_string()) && e.contains("mode is 0777"),
        "{e}"
    );
    if effective_uid() == 0 {
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o700)).unwrap();
        std::os::unix::fs::chown(&dir, Some(65534), Some(65534)).unwrap();
        let e = refused(cfg).await;
        assert!(e.contains("owned by uid 65534"), "{e}");
    }
    // Not root, no directory of another user can be made here: the owner check is then
    // covered by pdmesh-cache-client's mirror tests, which check against another uid.
}

/// A disk tier folder other users may enter, a disk tier of no bytes, or a file named as
/// the folder stops the service at start with an error naming the flag and why.
#[tokio::test]
async fn a_loose_disk_folder_an_empty_disk_size_or_a_file_makes_the_service_refuse_to_start() {
    use std::os::unix::fs::PermissionsExt;
    let base = tempfile::tempdir().unwrap();
    let disk = base.path().join("disk");
    std::fs::create_dir(&disk).unwrap();
    std::fs::set_permissions(&disk, std::fs::Permissions::from_mode(0o755)).unwrap();
    let mut cfg = config(base.path(), 4 * layout().bytes_per_page() as u64);
    cfg.disk.disk_dir = Some(disk.clone());
    let e = refused(cfg.clone()).await;
    assert!(
        e.contains("--disk-dir") && e.contains("may be read by other users") && e.contains("755"),
        "{e}"
    );
    std::fs::set_permissions(&disk, std::fs::Permissions::from_mode(0o700)).unwrap();
    cfg.disk.disk_size = pdmesh_cache::DiskSize(0);
    let e = refused(cfg.clone()).await;
    assert!(e.contains("--disk-size must be at least 1"), "{e}");
    // A file where the folder should be (a typo): refused, not a degraded tier.
    let file = base.path().join("pages.txt");
    std::fs::write(&file, b"notes").unwrap();
    cfg.disk.disk_size = pdmesh_cache::DiskSize(1 << 20);
    cfg.disk.disk_dir = Some(file.clone());
    let e = refused(cfg).await;
    assert!(
        e.contains("--disk-dir") && e.contains("is not a folder"),
        "{e}"
    );
    assert_eq!(std::fs::read(&file).unwrap(), b"notes");
    assert!(
        std::fs::read_dir(&disk).unwrap().next().is_none(),
        "nothing written into the folder"
    );
}
