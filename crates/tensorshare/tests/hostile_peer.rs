//! A hostile peer against honest processes: replayed and duplicated messages, descriptors it
//! truncates or forges, oversized claims, sockets and files that are not what a message
//! says, deaths at any moment. Afterwards the honest processes hold correct data, none of
//! them crashed, and nothing is left held or on disk.

use std::os::fd::{AsFd, BorrowedFd, OwnedFd};

use tensorshare::{pipe, raw, spawn, Connection, DType, Error, Queue, SharedFd, SharingStrategy, Tensor};

tensorshare::enable_test_workers!();

#[macro_use]
mod common;

type Raw = (Vec<u8>, Vec<SharedFd>);

/// A message as one channel record: a frame byte with no flags, then the message.
fn record(message: &[u8]) -> Vec<u8> {
    [&[0u8][..], message].concat()
}

/// Writes one record with `fds` attached, as a peer may, bypassing the codec.
fn send_raw(sock: BorrowedFd<'_>, bytes: &[u8], fds: &[BorrowedFd<'_>]) {
    use rustix::net::{SendAncillaryBuffer, SendAncillaryMessage, SendFlags};
    let iov = [std::io::IoSlice::new(bytes)];
    let mut space = vec![std::mem::MaybeUninit::<u8>::uninit(); SendAncillaryMessage::ScmRights(fds).size()];
    let mut control = SendAncillaryBuffer::new(&mut space);
    if !fds.is_empty() {
        assert!(control.push(SendAncillaryMessage::ScmRights(fds)));
    }
    rustix::net::sendmsg(sock, &iov, &mut control, SendFlags::NOSIGNAL).unwrap();
}

/// Reads one record as a peer may, waiting for it.
fn recv_raw(sock: BorrowedFd<'_>) -> (Vec<u8>, Vec<OwnedFd>) {
    use rustix::net::{RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags};
    let mut p = [rustix::event::PollFd::new(&sock, rustix::event::PollFlags::IN)];
    rustix::event::poll(&mut p, None).unwrap();
    let mut buf = vec![0u8; 1 << 17];
    let mut space = vec![std::mem::MaybeUninit::<u8>::uninit(); rustix::cmsg_space!(ScmRights(253))];
    let mut control = RecvAncillaryBuffer::new(&mut space);
    let mut iov = [std::io::IoSliceMut::new(&mut buf)];
    let r = rustix::net::recvmsg(sock, &mut iov, &mut control, RecvFlags::CMSG_CLOEXEC).unwrap();
    let mut fds = Vec::new();
    for m in control.drain() {
        if let RecvAncillaryMessage::ScmRights(rights) = m {
            fds.extend(rights);
        }
    }
    buf.truncate(r.bytes);
    (buf, fds)
}

fn owned(fds: &[SharedFd]) -> Vec<OwnedFd> {
    fds.iter().map(|f| f.as_fd().try_clone_to_owned().unwrap()).collect()
}

/// Replay: a receiver decodes one message three times and drops two of the results. The
/// creator then hands out every other slot of the arena, twice over, and writes 7.0 into
/// each: the slot the receiver still holds is never among them.
#[test]
fn a_replayed_message_cannot_free_a_slot_its_receiver_holds() {
    let (ours, theirs) = pipe::<Raw>().unwrap();
    let (go, wait) = pipe::<u32>().unwrap();
    let mut ctx = spawn(
        |_rank, (c, wait): (Connection<Raw>, Connection<u32>)| {
            let (bytes, fds) = c.recv().unwrap();
            let kept: Tensor = raw::decode(&bytes, owned(&fds)).unwrap();
            for _ in 0..2 {
                let again: Tensor = raw::decode(&bytes, owned(&fds)).unwrap();
                assert!(again.storage().ptr_eq(kept.storage()), "one slot, one storage here");
                drop(again);
            }
            drop((bytes, fds));
            wait.send(1).unwrap();
            assert_eq!(wait.recv().unwrap(), 2);
            assert!(kept.to_vec::<f32>().unwrap().iter().all(|v| *v == 1.0), "the held slot was reused");
            wait.send(3).unwrap();
        },
        (theirs, wait),
        1,
    )
    .unwrap();
    let mut t = Tensor::empty_shared(&[1024], DType::F32).unwrap();
    t.fill(1.0f32).unwrap();
    let (bytes, fds) = raw::encode(&t).unwrap();
    ours.send((bytes, fds.into_iter().map(SharedFd::new).collect())).unwrap();
    assert_eq!(go.recv().unwrap(), 1);
    drop(t);
    // Twice as many 4 KiB slots as the arenas held when the slot was sent: every free slot
    // is handed out, and new arenas made, rather than the held one.
    let others: Vec<Tensor> = (0..4096)
        .map(|_| {
            let mut x = Tensor::empty_shared(&[1024], DType::F32).unwrap();
            x.fill(7.0f32).unwrap();
            x
        })
        .collect();
    go.send(2).unwrap();
    assert_eq!(go.recv().unwrap(), 3);
    assert_eq!(ctx.join(None), Ok(true));
    drop(others);
}

fn hold_then_die(_rank: usize, (q, ready): (Queue<Tensor>, Queue<()>)) {
    let held: Vec<Tensor> = (0..200).map(|_| q.get().unwrap()).collect();
    ready.put(()).unwrap();
    loop {
        std::thread::park();
        let _ = &held;
    }
}

/// A holder SIGKILLed while it holds 200 slots gives them all back: once the creator drops
/// its own handles, every arena is free again, and with file_system no file is left.
fn sigkilled_holder(strategy: SharingStrategy) {
    tensorshare::set_sharing_strategy(strategy).unwrap();
    let q: Queue<Tensor> = Queue::new().unwrap();
    let ready: Queue<()> = Queue::new().unwrap();
    let mut ctx = spawn(hold_then_die, (q.clone(), ready.clone()), 1).unwrap();
    for i in 0..200 {
        let mut t = Tensor::empty_shared(&[16 << 10], DType::F32).unwrap();
        t.fill(i as f32).unwrap();
        q.put(t).unwrap();
    }
    ready.get().unwrap();
    let pid = rustix::process::Pid::from_raw(ctx.pids()[0]).unwrap();
    rustix::process::kill_process(pid, rustix::process::Signal::KILL).unwrap();
    assert_eq!(ctx.join(None).unwrap_err().signal_name(), Some("SIGKILL"));
    // 64 KiB slots: several arenas, all free now.
    assert!(tensorshare::trim_arenas() >= 2, "the dead holder's slots are still held");
}

#[test]
fn a_sigkilled_holder_gives_its_slots_back() {
    checked!(sigkilled_holder, SharingStrategy::FileDescriptor, SharingStrategy);
    checked!(sigkilled_holder, SharingStrategy::FileSystem, SharingStrategy);
}

/// Messages destroyed unread (a queue dropped with 200 of them in it) give their slots back.
fn unread_messages(strategy: SharingStrategy) {
    tensorshare::set_sharing_strategy(strategy).unwrap();
    let q: Queue<Tensor> = Queue::new().unwrap();
    for i in 0..200 {
        let mut t = Tensor::empty_shared(&[16 << 10], DType::F32).unwrap();
        t.fill(i as f32).unwrap();
        q.put(t).unwrap();
    }
    drop(q);
    assert!(tensorshare::trim_arenas() >= 2, "slots of messages nobody will read are still held");
}

#[test]
fn messages_destroyed_unread_give_their_slots_back() {
    checked!(unread_messages, SharingStrategy::FileDescriptor, SharingStrategy);
    checked!(unread_messages, SharingStrategy::FileSystem, SharingStrategy);
}

/// A receiver that reads the raw record gets the arena's descriptor, and can neither shrink
/// nor grow the file, nor seal it further: the sender reads and writes its tensor after
/// that without a SIGBUS.
#[test]
fn a_receiver_cannot_truncate_what_it_was_sent() {
    let (ours, theirs) = pipe::<Tensor>().unwrap();
    let (done, wait) = pipe::<Vec<String>>().unwrap();
    let mut ctx = spawn(
        |_rank, (c, done): (Connection<Tensor>, Connection<Vec<String>>)| {
            let (_bytes, fds) = recv_raw(c.as_fd());
            let mut refused = Vec::new();
            for fd in &fds {
                if rustix::fs::ftruncate(fd, 0).is_err() {
                    refused.push("shrink".to_string());
                }
                if rustix::fs::ftruncate(fd, 1 << 30).is_err() {
                    refused.push("grow".to_string());
                }
                if rustix::fs::fcntl_add_seals(fd, rustix::fs::SealFlags::FUTURE_WRITE).is_err() {
                    refused.push("seal".to_string());
                }
            }
            done.send(refused).unwrap();
        },
        (theirs, wait),
        1,
    )
    .unwrap();
    let mut t = Tensor::empty_shared(&[1 << 20], DType::F32).unwrap();
    t.fill(3.0f32).unwrap();
    ours.send(t.clone()).unwrap();
    let refused = done.recv().unwrap();
    assert_eq!(refused, ["shrink", "grow", "seal"]);
    assert_eq!(ctx.join(None), Ok(true));
    t.fill(4.0f32).unwrap();
    assert!(t.to_vec::<f32>().unwrap().iter().all(|v| *v == 4.0));
}

/// What the victim process makes of what a hostile peer sends: each item is one raw record
/// (bytes, descriptors), answered with the error's text or the value's sum.
fn victim(_rank: usize, (c, out): (Connection<Tensor>, Queue<Result<f32, String>>)) {
    loop {
        match c.recv() {
            Ok(t) => out.put(Ok(t.to_vec::<f32>().unwrap().iter().sum())).unwrap(),
            Err(Error::Disconnected) => return,
            Err(e) => out.put(Err(e.to_string())).unwrap(),
        }
    }
}

/// Runs a victim, lets `attack` write records to its connection, and returns what the
/// victim made of each of them. The victim must survive every one. What the attack returns
/// besides the count stays open until the victim has answered.
fn against_victim<K>(attack: impl FnOnce(BorrowedFd<'_>) -> (usize, K)) -> Vec<Result<f32, String>> {
    let (ours, theirs) = pipe::<Tensor>().unwrap();
    let out: Queue<Result<f32, String>> = Queue::new().unwrap();
    let mut ctx = spawn(victim, (theirs, out.clone()), 1).unwrap();
    let (n, keep) = attack(ours.as_fd());
    let got = (0..n).map(|_| out.get().unwrap()).collect();
    drop((ours, keep));
    assert_eq!(ctx.join(None), Ok(true), "the victim survived");
    got
}

/// An honest message (a tensor of 1024 ones) after an attack: the victim still works.
fn honest(sock: BorrowedFd<'_>) {
    let t = Tensor::full(&[1024], 1.0f32);
    let (bytes, fds) = raw::encode(&t).unwrap();
    let borrowed: Vec<_> = fds.iter().map(|f| f.as_fd()).collect();
    send_raw(sock, &record(&bytes), &borrowed);
}

/// The bytes of a real arena holding a tensor, copied into `into`.
fn copy_arena(into: &OwnedFd) -> Vec<u8> {
    let t = Tensor::full(&[1024], 666.0f32);
    let (bytes, fds) = raw::encode(&t).unwrap();
    let st = rustix::fs::fstat(&fds[0]).unwrap();
    let mut data = vec![0u8; st.st_size as usize];
    let mut off = 0;
    while off < data.len() {
        off += rustix::io::pread(&fds[0], &mut data[off..], off as u64).unwrap();
    }
    rustix::io::pwrite(into, &data, 0).unwrap();
    bytes
}

#[test]
fn an_unsealed_memfd_or_a_disk_file_is_not_an_arena() {
    let got = against_victim(|sock| {
        // A memfd with a perfect arena in it, but unsealed: its sender could cut it later.
        let unsealed = rustix::fs::memfd_create("fake", rustix::fs::MemfdFlags::CLOEXEC).unwrap();
        let bytes = copy_arena(&unsealed);
        send_raw(sock, &record(&bytes), &[unsealed.as_fd()]);
        // A file on disk with the same bytes.
        let dir = std::env::temp_dir().join(format!("tensorshare-hostile-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("arena");
        let file: OwnedFd = std::fs::File::create_new(&path).unwrap().into();
        let bytes = copy_arena(&file);
        std::fs::remove_dir_all(&dir).unwrap();
        send_raw(sock, &record(&bytes), &[file.as_fd()]);
        honest(sock);
        (3, ())
    });
    assert!(matches!(&got[0], Err(e) if e.contains("not a memfd") || e.contains("not sealed")), "{got:?}");
    assert!(matches!(&got[1], Err(e) if e.contains("not a memfd")), "{got:?}");
    assert_eq!(got[2], Ok(1024.0));
}

#[test]
fn oversized_spill_claims_are_refused_before_anything_is_read() {
    let got = against_victim(|sock| {
        // 40 bytes claiming a payload of 1 TiB, in a sparse memfd sealed at that size.
        let tib = 1u64 << 40;
        let fd = rustix::fs::memfd_create(
            "huge",
            rustix::fs::MemfdFlags::CLOEXEC | rustix::fs::MemfdFlags::ALLOW_SEALING,
        )
        .unwrap();
        rustix::fs::ftruncate(&fd, tib).unwrap();
        let seals =
            rustix::fs::SealFlags::WRITE | rustix::fs::SealFlags::SHRINK | rustix::fs::SealFlags::GROW;
        rustix::fs::fcntl_add_seals(&fd, seals).unwrap();
        let head = [&[1u8][..], &tib.to_le_bytes()].concat();
        send_raw(sock, &head, &[fd.as_fd()]);
        // A small spilled message in an unsealed memfd: it could change while being read.
        let t = Tensor::full(&[4], 1.0f32);
        let (bytes, fds) = raw::encode(&t).unwrap();
        let spill = rustix::fs::memfd_create("spill", rustix::fs::MemfdFlags::CLOEXEC).unwrap();
        rustix::io::pwrite(&spill, &bytes, 0).unwrap();
        let head = [&[1u8][..], &(bytes.len() as u64).to_le_bytes()].concat();
        send_raw(sock, &head, &[fds[0].as_fd(), spill.as_fd()]);
        honest(sock);
        (3, ())
    });
    assert!(matches!(&got[0], Err(e) if e.contains("over this process's limit")), "{got:?}");
    assert!(matches!(&got[1], Err(e) if e.contains("not sealed")), "{got:?}");
    assert_eq!(got[2], Ok(1024.0));
}

#[test]
fn a_live_socket_passed_as_a_side_table_is_refused() {
    let got = against_victim(|sock| {
        // The "side table" is a socket whose writer is still open, with a record in it: read
        // as a table, it would swallow that record.
        let (w, r) = rustix::net::socketpair(
            rustix::net::AddressFamily::UNIX,
            rustix::net::SocketType::SEQPACKET,
            rustix::net::SocketFlags::CLOEXEC,
            None,
        )
        .unwrap();
        send_raw(w.as_fd(), b"x", &[]);
        let head = [&[2u8][..], &1u32.to_le_bytes(), &[0, 0, 0, 0]].concat();
        send_raw(sock, &head, &[r.as_fd()]);
        honest(sock);
        (2, w) // the writer stays open until the victim has answered
    });
    assert!(matches!(&got[0], Err(e) if e.contains("still open for writing")), "{got:?}");
    assert_eq!(got[1], Ok(1024.0));
}

#[test]
fn an_empty_record_is_not_a_hang_up() {
    let got = against_victim(|sock| {
        send_raw(sock, &[], &[]);
        honest(sock);
        (2, ())
    });
    assert!(matches!(&got[0], Err(e) if e.contains("empty record")), "{got:?}");
    assert_eq!(got[1], Ok(1024.0));
}

/// A peer that never had the victim's arena names it in vain: the receiver knows arenas only
/// by the descriptors that come with a message, so a message with the peer's own arena
/// reaches the peer's memory and nothing else.
#[test]
fn an_arena_is_reached_only_through_its_descriptor() {
    let (ours, theirs) = pipe::<Raw>().unwrap();
    let back: Queue<bool> = Queue::new().unwrap();
    let mut ctx = spawn(
        |_rank, (c, back): (Connection<Raw>, Queue<bool>)| {
            // The victim holds an arena with ones in it.
            let mine = Tensor::full(&[1024], 1.0f32);
            let mine = {
                let q: Queue<Tensor> = Queue::new().unwrap();
                q.put(mine).unwrap();
                q.get().unwrap()
            };
            // The peer's message names its own arena with the same slot and length.
            let (bytes, fds) = c.recv().unwrap();
            let theirs: Tensor = raw::decode(&bytes, owned(&fds)).unwrap();
            let separate = !theirs.storage().ptr_eq(mine.storage())
                && theirs.to_vec::<f32>().unwrap().iter().all(|v| *v == 666.0)
                && mine.to_vec::<f32>().unwrap().iter().all(|v| *v == 1.0);
            back.put(separate).unwrap();
        },
        (theirs, back.clone()),
        1,
    )
    .unwrap();
    let t = Tensor::full(&[1024], 666.0f32);
    let (bytes, fds) = raw::encode(&t).unwrap();
    ours.send((bytes, fds.into_iter().map(SharedFd::new).collect())).unwrap();
    assert!(back.get().unwrap(), "the peer's message reached the victim's memory");
    assert_eq!(ctx.join(None), Ok(true));
}

/// A named file cannot be sealed, so a process that can open it can truncate it. The pages
/// cut off read as zeros from then on, in the creator and in the receiver (here one with the
/// default strategy), and the rest stays shared: nobody gets SIGBUS, as torch's file_system
/// readers do.
fn named_truncation(_: ()) {
    tensorshare::set_sharing_strategy(SharingStrategy::FileSystem).unwrap();
    let n = 1 << 20;
    let mut t = Tensor::full(&[n], 1.0f32);
    t.share_memory().unwrap();
    let name = t.storage().segment_name().expect("a named segment");
    let (go, wait) = pipe::<u32>().unwrap();
    let (back, answer) = pipe::<Vec<f32>>().unwrap();
    let mut ctx = spawn(
        |_rank, (t, wait, answer): (Tensor, Connection<u32>, Connection<Vec<f32>>)| {
            assert_eq!(tensorshare::get_sharing_strategy(), SharingStrategy::FileDescriptor);
            wait.send(0).unwrap(); // mapped
            while wait.recv().is_ok() {
                answer.send(t.to_vec::<f32>().unwrap()).unwrap(); // touches the cut pages
            }
        },
        (t.clone(), wait, answer),
        1,
    )
    .unwrap();
    assert_eq!(go.recv().unwrap(), 0);
    let path = tensorshare::segments::shm_dir().join(&name);
    let file = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
    // Cut at a page boundary: the bytes past the end of a file in its last page stay that
    // page's, shared as before.
    let page = rustix::param::page_size() as u64;
    file.set_len(file.metadata().unwrap().len() / 2 / page * page).unwrap();
    go.send(1).unwrap();
    let seen = back.recv().unwrap();
    // The first elements are still the file's, the rest are zeros.
    let kept = seen.iter().take_while(|v| **v == 1.0).count();
    assert!(kept > 0 && kept < n, "kept {kept} of {n}");
    assert!(seen[kept..].iter().all(|v| *v == 0.0), "the cut part reads as zeros");
    // The creator touches the cut pages too, and writes through: what both still share
    // reaches the receiver, what was cut stays each process's own.
    t.fill(5.0f32).unwrap();
    assert!(t.to_vec::<f32>().unwrap().iter().all(|v| *v == 5.0));
    go.send(2).unwrap();
    let seen = back.recv().unwrap();
    assert!(seen[..kept].iter().all(|v| *v == 5.0), "the uncut part is still shared");
    assert!(seen[kept..].iter().all(|v| *v == 0.0), "the receiver's zeros are its own");
    // Cut it to nothing: everything reads as zeros, in the receiver too.
    file.set_len(0).unwrap();
    go.send(3).unwrap();
    assert!(back.recv().unwrap()[..kept].iter().all(|v| *v == 0.0));
    drop((go, back));
    assert_eq!(ctx.join(None), Ok(true));
    drop(t); // unmapping touches nothing
}

#[test]
fn a_truncated_named_segment_reads_as_zeros_not_sigbus() {
    checked!(named_truncation, (), ());
}

/// Maps `path` (a file of 64 KiB of sevens, not a segment), cuts it to nothing and reads a
/// cut page: a SIGBUS that is not tensorshare's to mend.
fn touch_a_cut_page(path: &std::path::Path) {
    let file = std::fs::OpenOptions::new().read(true).write(true).open(path).unwrap();
    // SAFETY: a fresh shared mapping of a file of 64 KiB, read below through raw pointers
    // only.
    let p = unsafe {
        rustix::mm::mmap(
            std::ptr::null_mut(),
            1 << 16,
            rustix::mm::ProtFlags::READ,
            rustix::mm::MapFlags::SHARED,
            &file,
            0,
        )
    }
    .unwrap()
    .cast::<u8>();
    // SAFETY: within the mapping, which is still there.
    assert_eq!(unsafe { p.read_volatile() }, 7);
    file.set_len(0).unwrap();
    // SAFETY: within the mapping; the page is cut, so this raises SIGBUS.
    let v = unsafe { p.add(4096).read_volatile() };
    println!("read {v} from a cut page");
}

/// The handler mends only named segments: a SIGBUS from any other mapping still ends the
/// process with SIGBUS, as it would have without tensorshare.
#[test]
fn a_sigbus_outside_named_segments_still_ends_the_process() {
    let path = std::env::temp_dir().join(format!(
        "tensorshare-sigbus-{}-{:?}",
        std::process::id(),
        std::thread::current().id()
    ));
    std::fs::write(&path, vec![7u8; 1 << 16]).unwrap();
    let mut ctx = spawn(
        |_rank, path: std::path::PathBuf| {
            tensorshare::set_sharing_strategy(SharingStrategy::FileSystem).unwrap();
            let mut t = Tensor::full(&[1024], 1.0f32);
            t.share_memory().unwrap(); // a named segment: the handler is installed
            assert!(t.storage().segment_name().is_some());
            touch_a_cut_page(&path);
        },
        path.clone(),
        1,
    )
    .unwrap();
    let joined = ctx.join(None);
    std::fs::remove_file(&path).unwrap();
    let err = joined.unwrap_err();
    assert_eq!(err.signal_name(), Some("SIGBUS"), "{err}");
}

/// Set once the cut named segment has been read as zeros: only a SIGBUS after that is the
/// one `exit_77` is there for.
static ZEROS_SEEN: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

extern "C" fn exit_77(_sig: libc::c_int) {
    let code = if ZEROS_SEEN.load(std::sync::atomic::Ordering::Relaxed) { 77 } else { 78 };
    // SAFETY: _exit is async-signal-safe.
    unsafe { libc::_exit(code) }
}

/// A program that installs a SIGBUS handler of its own after tensorshare's (one that does not
/// pass the signal on) puts tensorshare's back on top with `guard_sigbus`: a cut named
/// segment reads as zeros again, and every other SIGBUS still reaches the program's handler.
#[test]
fn guard_sigbus_puts_the_handler_back_on_top_of_a_later_one() {
    let path = std::env::temp_dir().join(format!("tensorshare-sigbus-guard-{}", std::process::id()));
    std::fs::write(&path, vec![7u8; 1 << 16]).unwrap();
    let mut ctx = spawn(
        |_rank, path: std::path::PathBuf| {
            tensorshare::set_sharing_strategy(SharingStrategy::FileSystem).unwrap();
            let mut t = Tensor::full(&[1 << 16], 1.0f32);
            t.share_memory().unwrap();
            let seg = tensorshare::segments::shm_dir().join(t.storage().segment_name().unwrap());
            // SAFETY: a handler with the plain signature, installed for SIGBUS.
            unsafe { libc::signal(libc::SIGBUS, exit_77 as *const () as libc::sighandler_t) };
            tensorshare::segments::guard_sigbus().unwrap();
            std::fs::OpenOptions::new().write(true).open(&seg).unwrap().set_len(0).unwrap();
            assert!(t.to_vec::<f32>().unwrap().iter().all(|v| *v == 0.0), "the cut reads as zeros");
            ZEROS_SEEN.store(true, std::sync::atomic::Ordering::Relaxed);
            touch_a_cut_page(&path); // which the program's handler answers with exit code 77
        },
        path.clone(),
        1,
    )
    .unwrap();
    let joined = ctx.join(None);
    std::fs::remove_file(&path).unwrap();
    let err = joined.unwrap_err();
    assert_eq!(err.exit_code(), Some(77), "{err} (78: the program's handler got the cut segment's fault)");
}

/// The handler that `passes_back` found when it was installed: tensorshare's.
static FOUND: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

extern "C" fn passes_back(sig: libc::c_int, info: *mut libc::siginfo_t, ctx: *mut libc::c_void) {
    let f = FOUND.load(std::sync::atomic::Ordering::Relaxed);
    // SAFETY: FOUND holds the SA_SIGINFO handler that was installed before this one.
    let f: extern "C" fn(libc::c_int, *mut libc::siginfo_t, *mut libc::c_void) =
        unsafe { std::mem::transmute(f) };
    f(sig, info, ctx);
}

/// `guard_sigbus` on top of a handler that passes SIGBUS back to tensorshare's (misuse):
/// a SIGBUS then goes round once and ends the process as the default would, instead of
/// going round until the stack overflows.
#[test]
fn two_handlers_passing_sigbus_to_each_other_end_with_sigbus() {
    let mut ctx = spawn(
        |_rank, ()| {
            tensorshare::set_sharing_strategy(SharingStrategy::FileSystem).unwrap();
            let mut t = Tensor::full(&[1024], 1.0f32);
            // tensorshare's handler is installed here.
            t.share_memory().unwrap();
            // SAFETY: installs a complete SA_SIGINFO disposition and keeps the one it
            // replaces (tensorshare's, checked below) for `passes_back` to call.
            let (rc, old) = unsafe {
                let mut act: libc::sigaction = std::mem::zeroed();
                act.sa_sigaction = passes_back as *const () as libc::sighandler_t;
                act.sa_flags = libc::SA_SIGINFO;
                let mut old: libc::sigaction = std::mem::zeroed();
                let rc = libc::sigaction(libc::SIGBUS, &act, &mut old);
                (rc, old)
            };
            assert_eq!(rc, 0);
            assert!(old.sa_flags & libc::SA_SIGINFO != 0 && old.sa_sigaction > 1, "tensorshare's handler");
            FOUND.store(old.sa_sigaction, std::sync::atomic::Ordering::Relaxed);
            tensorshare::segments::guard_sigbus().unwrap();
            // SAFETY: sends this process a SIGBUS, which is not a fault.
            unsafe { libc::raise(libc::SIGBUS) };
            println!("survived a SIGBUS");
        },
        (),
        1,
    )
    .unwrap();
    let err = ctx.join(None).unwrap_err();
    assert_eq!(err.signal_name(), Some("SIGBUS"), "{err}");
}

fn take_then_wait(_rank: usize, (q, got): (Queue<Tensor>, Queue<usize>)) {
    let mut held = Vec::new();
    while let Ok(t) = q.get() {
        held.push(t);
        got.put(held.len()).unwrap();
    }
}

/// Peers killed at every step: holders SIGKILLed after taking 0, 1, 2, ... messages, with
/// messages still in flight, over and over, while the creator keeps tensors of its own in
/// the same arenas. Afterwards the creator's tensors hold what it wrote, every slot the dead
/// held is free again, and nothing is left (the leak checker: no file, no descriptor).
fn kills_at_every_step(strategy: SharingStrategy) {
    tensorshare::set_sharing_strategy(strategy).unwrap();
    let mine: Vec<Tensor> = (0..32)
        .map(|i| {
            let mut t = Tensor::empty_shared(&[1024], DType::F32).unwrap();
            t.fill(i as f32).unwrap();
            t
        })
        .collect();
    for round in 0..12 {
        let q: Queue<Tensor> = Queue::new().unwrap();
        let got: Queue<usize> = Queue::new().unwrap();
        let mut ctx = spawn(take_then_wait, (q.clone(), got.clone()), 1).unwrap();
        for i in 0..round + 3 {
            let mut t = Tensor::empty_shared(&[1024], DType::F32).unwrap();
            t.fill(-(i as f32)).unwrap();
            q.put(t).unwrap();
        }
        // Kill it once it holds `round % 4` of them, the rest still in flight.
        let stop = round % 4;
        while stop > 0 && got.get().unwrap() < stop {}
        let pid = rustix::process::Pid::from_raw(ctx.pids()[0]).unwrap();
        rustix::process::kill_process(pid, rustix::process::Signal::KILL).unwrap();
        assert_eq!(ctx.join(None).unwrap_err().signal_name(), Some("SIGKILL"));
    }
    for (i, t) in mine.iter().enumerate() {
        assert!(t.to_vec::<f32>().unwrap().iter().all(|v| *v == i as f32), "tensor {i} was overwritten");
    }
    drop(mine);
    assert!(tensorshare::trim_arenas() >= 1, "the dead holders' slots are still held");
}

#[test]
fn peers_killed_at_every_step_leave_nothing_behind() {
    checked!(kills_at_every_step, SharingStrategy::FileDescriptor, SharingStrategy);
    checked!(kills_at_every_step, SharingStrategy::FileSystem, SharingStrategy);
}
