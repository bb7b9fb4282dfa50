//! A queue's lane against peers that die in the middle of a step, stop holding its lock, or
//! write its memory and its directory: each test states what must hold all the same.

use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use tensorshare::raw;
use tensorshare::{DType, Queue, Tensor};

const ENDS_AT: usize = 1024;
const RING_AT: usize = 4096;
const LEN: usize = RING_AT + 64 * 4096;

/// What a peer holding the queue has: its control block mapped, and its socket ends.
/// (The layout is the lane's: `tail` at 1024, `head` at 1088, cells from 4096.)
struct Peer {
    map: *mut u8,
    ctl: OwnedFd,
    tx: OwnedFd,
    rx: OwnedFd,
}

impl Peer {
    fn of<T: serde::Serialize>(q: &Queue<T>) -> Peer {
        // serialize_core pushes ctl first, then tx, then rx.
        let (_bytes, mut fds) = raw::encode(q).unwrap();
        assert_eq!(fds.len(), 3);
        let rx = fds.pop().unwrap();
        let tx = fds.pop().unwrap();
        let ctl = fds.pop().unwrap();
        // SAFETY: maps the control block's memfd, LEN bytes, shared.
        let map = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                LEN,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                ctl.as_raw_fd(),
                0,
            )
        };
        assert_ne!(map, libc::MAP_FAILED);
        Peer { map: map.cast(), ctl, tx, rx }
    }

    fn word(&self, at: usize) -> &AtomicU64 {
        // SAFETY: inside the mapping, 8-aligned.
        unsafe { AtomicU64::from_ptr(self.map.add(at).cast()) }
    }
    fn tail(&self) -> &AtomicU64 {
        self.word(ENDS_AT)
    }
    fn head(&self) -> &AtomicU64 {
        self.word(ENDS_AT + 64)
    }
    /// Bytes waiting in the lane's directory (tx's receive queue; SIOCINQ sums a
    /// SEQPACKET queue).
    fn directory_bytes(&self) -> i32 {
        let mut n: libc::c_int = 0;
        // SAFETY: FIONREAD/SIOCINQ writes one int.
        let r = unsafe { libc::ioctl(self.tx.as_raw_fd(), libc::FIONREAD, &mut n) };
        assert_eq!(r, 0);
        n
    }
}

impl Drop for Peer {
    fn drop(&mut self) {
        // SAFETY: the mapping made in `of`, LEN bytes, not used after this.
        unsafe { libc::munmap(self.map.cast(), LEN) };
    }
}

fn ofd_lock(fd: BorrowedFd<'_>, at: i64, l_type: i16) -> i32 {
    // SAFETY: plain struct flock.
    let mut fl: libc::flock = unsafe { std::mem::zeroed() };
    fl.l_type = l_type;
    fl.l_whence = libc::SEEK_SET as i16;
    fl.l_start = at;
    fl.l_len = 1;
    // SAFETY: F_OFD_SETLK with a valid struct.
    unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_OFD_SETLK, &fl) }
}

/// A producer killed between claiming a lane position and publishing it (here: a forked
/// child that claims and _exits). A consumer that only polls, with `try_get` or with
/// `get_timeout` shorter than the time a claim may stay unpublished, still skips the dead
/// position (how long it has been seen is kept across calls) and gets the value behind it.
#[test]
fn a_dead_claim_is_skipped_by_consumers_that_only_poll() {
    let q: Queue<u32> = Queue::new().unwrap();
    let peer = Peer::of(&q);
    // SAFETY: the child only does an atomic compare-exchange on shared memory and
    // `_exit`s: no lock another thread of the test binary holds is touched in it.
    let pid = unsafe { libc::fork() };
    if pid == 0 {
        // Ring::claim: tail 0 -> 1 while cell 0's sequence word is 0; then killed.
        let ok = peer.tail().compare_exchange(0, 1, Ordering::AcqRel, Ordering::Acquire).is_ok();
        unsafe { libc::_exit(if ok { 0 } else { 1 }) };
    }
    let mut status = 0;
    // SAFETY: waits for our child.
    unsafe { libc::waitpid(pid, &mut status, 0) };
    assert_eq!(libc::WEXITSTATUS(status), 0);

    q.put(7).unwrap(); // through the lane, at position 1
    let start = Instant::now();
    let mut got = None;
    while start.elapsed() < Duration::from_secs(1) && got.is_none() {
        got = q.try_get().unwrap();
        std::thread::sleep(Duration::from_millis(1));
    }
    let tg = got;
    let start = Instant::now();
    let mut got = None;
    while start.elapsed() < Duration::from_secs(1) && got.is_none() {
        got = q.get_timeout(Duration::from_millis(20)).ok();
    }
    let gt = got;
    eprintln!(
        "try_get loop (1 s): {tg:?}; get_timeout(20ms) loop (1 s): {gt:?}; get_timeout(1s): {:?}",
        q.get_timeout(Duration::from_secs(1))
    );
    assert_eq!(tg, Some(7), "try_get never delivered the value behind the dead claim");
}

/// A peer (or a process stopped under a debugger while it looks at the directory) holds the
/// directory's lock: a producer does not wait for it beyond a few milliseconds (its value
/// goes through the socket), so `put_timeout` returns.
#[test]
fn a_directory_lock_held_by_a_peer_does_not_stop_producers() {
    let q: Queue<Tensor> = Queue::new().unwrap();
    let peer = Peer::of(&q);
    assert_eq!(ofd_lock(peer.ctl.as_fd(), 1, libc::F_WRLCK as i16), 0);
    let q2 = q.clone();
    let (tx, rx) = std::sync::mpsc::channel();
    let h = std::thread::spawn(move || {
        let t = Tensor::zeros(&[16], DType::F32);
        let r = q2.put_timeout(t, Duration::from_millis(100));
        tx.send(r.is_ok()).unwrap();
    });
    let r = rx.recv_timeout(Duration::from_secs(3));
    ofd_lock(peer.ctl.as_fd(), 1, libc::F_UNLCK as i16);
    h.join().unwrap();
    assert!(r.is_ok(), "put_timeout(100 ms) still blocked after 3 s");
}

/// A record of no bytes in the directory (a peer's `send` of 0 bytes on the consumers' end)
/// is not taken for the end of the entries: windows behind it are still taken out, and
/// what they held is given back.
fn directory_after_traffic(blocker: bool) -> i32 {
    let q: Queue<Tensor> = Queue::new().unwrap();
    let peer = Peer::of(&q);
    if blocker {
        let n = rustix::net::send(peer.rx.as_fd(), &[], rustix::net::SendFlags::DONTWAIT).unwrap();
        assert_eq!(n, 0);
    }
    for round in 0..3 {
        for i in 0..40 {
            q.put(Tensor::full(&[16], (round * 100 + i) as f32)).unwrap();
        }
        for _ in 0..40 {
            q.get().unwrap();
        }
    }
    tensorshare::trim_arenas();
    peer.directory_bytes()
}

#[test]
fn a_zero_length_record_does_not_block_the_directory() {
    let clean = directory_after_traffic(false);
    let blocked = directory_after_traffic(true);
    eprintln!(
        "directory bytes after the traffic and trim_arenas: clean {clean}, with a 0-byte record {blocked}"
    );
    assert_eq!(clean, 0);
    assert_eq!(blocked, 0, "entries stay parked behind the peer's 0-byte record");
}

/// A peer writes `tail` and `head` near u64::MAX: a consumer that waits on does not panic
/// (positions are computed with checked arithmetic), and leaves the directory's lock free.
#[test]
fn positions_a_peer_wrote_near_the_end_of_u64_panic_nobody() {
    let q: Queue<u32> = Queue::new().unwrap();
    let peer = Peer::of(&q);
    peer.tail().store(u64::MAX - 5, Ordering::SeqCst);
    peer.head().store(u64::MAX - 5, Ordering::SeqCst);
    let q2 = q.clone();
    let r = std::thread::spawn(move || q2.get_timeout(Duration::from_millis(200))).join();
    let panicked = r.is_err();
    // Is the directory lock still held by this process's description? Ask from the peer's.
    let held = ofd_lock(peer.ctl.as_fd(), 1, libc::F_WRLCK as i16) != 0;
    eprintln!("consumer panicked: {panicked}; directory lock left held: {held}");
    assert!(!panicked, "a consumer panicked on what a peer wrote");
    assert!(!held, "the directory's lock was left held");
}
