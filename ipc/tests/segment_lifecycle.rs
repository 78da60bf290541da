//! Segments are anonymous memfds: they never appear in /dev/shm, are inherited only by the
//! children they are handed to, and leave nothing behind when any process exits or dies.

mod common;

use std::collections::BTreeSet;
use std::os::fd::{AsFd, AsRawFd};
use std::sync::atomic::Ordering;
use std::time::Duration;

use thaw_ipc::*;

const FD_VAR: &str = "THAW_SCRATCH_FD";

fn dev_shm() -> BTreeSet<String> {
    std::fs::read_dir("/dev/shm")
        .map(|d| {
            d.filter_map(|e| e.ok())
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default()
}

#[test]
fn child_entry() {
    let Some(role) = common::role() else { return };
    let seg = Segment::from_inherited_env(FD_VAR, SegmentKind::Scratch).unwrap();
    let word = seg.atomic_u64(HEADER_LEN);
    match role.as_str() {
        "answer" => {
            assert_eq!(word.load(Ordering::Acquire), 0xfeed);
            word.store(0xbeef, Ordering::Release);
        }
        "hang" => {
            word.store(1, Ordering::Release);
            std::thread::sleep(Duration::from_secs(60));
        }
        r => panic!("unknown role {r}"),
    }
    std::process::exit(0);
}

#[test]
fn memfd_segments_leave_no_trace_in_dev_shm() {
    let before = dev_shm();
    {
        let seg = Segment::create(SegmentKind::Scratch, "lifecycle", 4096).unwrap();
        let ex = Exchange::create(ExchangeConfig {
            max_d_in: 64,
            max_d_out: 64,
            ..Default::default()
        })
        .unwrap();
        let store = HostStore::create(1 << 16, 4).unwrap();
        for s in [&seg, ex.segment(), store.segment()] {
            let link =
                std::fs::read_link(format!("/proc/self/fd/{}", s.as_fd().as_raw_fd())).unwrap();
            let link = link.to_string_lossy().into_owned();
            assert!(
                link.starts_with("/memfd:thaw-"),
                "segment fd is {link}, not an anonymous memfd"
            );
            assert!(!link.contains("/dev/shm"));
        }
        assert_eq!(
            dev_shm(),
            before,
            "a live segment must not show up in /dev/shm"
        );

        // A child that exits normally.
        seg.atomic_u64(HEADER_LEN).store(0xfeed, Ordering::Release);
        let child = common::spawn_child("answer", &[(&seg, FD_VAR)], &[]);
        common::expect_success(child, Duration::from_secs(20));
        assert_eq!(seg.atomic_u64(HEADER_LEN).load(Ordering::Acquire), 0xbeef);

        // A child killed with SIGKILL while it has the segment mapped.
        seg.atomic_u64(HEADER_LEN).store(0, Ordering::Release);
        let mut child = common::spawn_child("hang", &[(&seg, FD_VAR)], &[]);
        let t = std::time::Instant::now();
        while seg.atomic_u64(HEADER_LEN).load(Ordering::Acquire) != 1 {
            assert!(
                t.elapsed() < Duration::from_secs(20),
                "child never mapped the segment"
            );
            std::thread::sleep(Duration::from_millis(5));
        }
        child.kill().unwrap();
        child.wait().unwrap();
        assert_eq!(dev_shm(), before);
    }
    assert_eq!(
        dev_shm(),
        before,
        "/dev/shm changed after dropping every segment"
    );
}

#[test]
fn parent_fd_stays_close_on_exec() {
    let seg = Segment::create(SegmentKind::Scratch, "cloexec", 64).unwrap();
    let flags = nix::fcntl::fcntl(seg.as_fd().as_raw_fd(), nix::fcntl::FcntlArg::F_GETFD).unwrap();
    assert_ne!(flags & libc::FD_CLOEXEC, 0);
    let mut cmd = std::process::Command::new("true");
    seg.inherit_into(&mut cmd, FD_VAR);
    assert!(cmd.status().unwrap().success());
    let flags = nix::fcntl::fcntl(seg.as_fd().as_raw_fd(), nix::fcntl::FcntlArg::F_GETFD).unwrap();
    assert_ne!(
        flags & libc::FD_CLOEXEC,
        0,
        "inherit_into must only clear CLOEXEC in the child"
    );
}

#[test]
fn segment_is_sealed_against_resizing() {
    let seg = Segment::create(SegmentKind::Scratch, "sealed", 4096).unwrap();
    assert!(
        nix::unistd::ftruncate(seg.as_fd(), 1).is_err(),
        "shrink must be refused"
    );
    assert!(
        nix::unistd::ftruncate(seg.as_fd(), 1 << 20).is_err(),
        "grow must be refused"
    );
}

#[test]
fn exchange_config_round_trips_through_the_header() {
    let cfg = ExchangeConfig {
        max_workers: 5,
        max_jobs: 9,
        max_inputs: 3,
        max_rows: 7,
        max_d_in: 33,
        max_d_out: 65,
    };
    let ex = Exchange::create(cfg).unwrap();
    let seg =
        Segment::open_fd(ex.segment().try_clone_fd().unwrap(), SegmentKind::Exchange).unwrap();
    let theirs = Exchange::open(seg).unwrap();
    assert_eq!(*theirs.config(), cfg);
    assert_eq!(theirs.layout(), ex.layout());
    // The wrong layout on a valid segment is refused.
    let seg =
        Segment::open_fd(ex.segment().try_clone_fd().unwrap(), SegmentKind::Exchange).unwrap();
    assert!(matches!(
        StoreReader::open(seg, ReaderSlot(0)),
        Err(IpcError::KindMismatch { .. })
    ));
    let err =
        Segment::open_fd(ex.segment().try_clone_fd().unwrap(), SegmentKind::HostStore).unwrap_err();
    assert!(
        matches!(
            err,
            IpcError::KindMismatch {
                found: 1,
                expected: SegmentKind::HostStore
            }
        ),
        "{err}"
    );
}
