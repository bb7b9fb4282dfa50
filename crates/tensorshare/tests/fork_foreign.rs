//! A fork tensorshare did not make (Python's `os.fork`, a program's own `libc::fork`)
//! leaves none of tensorshare's locks held in the child, whatever other threads were doing
//! at the fork: the library's `pthread_atfork` handlers take its locks around every fork of
//! a process that has made them, not only around its own.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use rustix::event::{poll, PollFd, PollFlags, Timespec};
use rustix::process::{pidfd_open, waitpid, Pid, PidfdFlags, WaitOptions};
use tensorshare::{DType, Queue, SharingStrategy, Storage, Tensor};

tensorshare::enable_test_workers!();

mod common;

/// What a child does with every lock the threads below take: the queue registry (making a
/// queue, flushing), the allocator (a shared tensor), the forked-outbox map (adopting).
fn child_uses_every_lock() -> ! {
    let used = std::panic::catch_unwind(|| {
        tensorshare::adopt_forked_queues();
        use_the_locks();
    });
    // SAFETY: _exit ends the child at once; it touches no state of this program.
    unsafe { libc::_exit(if used.is_ok() { 0 } else { 1 }) }
}

/// A queue made and dropped, a tensor moved into shared memory and sent, what is unwritten
/// flushed.
fn use_the_locks() {
    let q = Queue::<Tensor>::new().unwrap();
    let mut t = Tensor::zeros(&[64], DType::F32);
    t.share_memory().unwrap();
    q.put(t).unwrap();
    let _ = q.get().unwrap();
    drop(q);
    tensorshare::flush_queues();
}

/// Waits until `deadline` for `pid` to end; `false` (and the child killed and reaped) if it
/// did not, or did not exit with 0.
fn ended_by(pid: Pid, deadline: Instant) -> bool {
    how_it_ended(pid, deadline).is_ok()
}

/// As `ended_by`, saying how a child that did not exit with 0 ended: its exit status or
/// signal, or, if it hung, where (its kernel wait channel and system call, read before it
/// is killed), so that a failure seen once under load says which it was.
fn how_it_ended(pid: Pid, deadline: Instant) -> Result<(), String> {
    let fd = pidfd_open(pid, PidfdFlags::empty()).unwrap();
    let mut fds = [PollFd::new(&fd, PollFlags::IN)];
    let left = deadline.saturating_duration_since(Instant::now());
    let timeout = Timespec { tv_sec: left.as_secs() as i64, tv_nsec: left.subsec_nanos() as i64 };
    let ended = poll(&mut fds, Some(&timeout)).unwrap() == 1;
    let mut hung = String::new();
    if !ended {
        let read = |what: &str| std::fs::read_to_string(format!("/proc/{}/{what}", pid.as_raw_nonzero()));
        let threads =
            std::fs::read_dir(format!("/proc/{}/task", pid.as_raw_nonzero())).map(|d| d.count()).unwrap_or(0);
        hung = format!(
            "hung ({threads} threads; main thread in {:?}, system call {:?})",
            read("wchan").unwrap_or_default(),
            read("syscall").unwrap_or_default().trim()
        );
        // SAFETY: kill has no memory-safety preconditions; pid is our unreaped child.
        unsafe { libc::kill(pid.as_raw_nonzero().get(), libc::SIGKILL) };
    }
    let (_, status) = waitpid(Some(pid), WaitOptions::empty()).unwrap().unwrap();
    match (ended, status.exit_status(), status.terminating_signal()) {
        (false, ..) => Err(hung),
        (true, Some(0), _) => Ok(()),
        (true, Some(code), _) => Err(format!("exited with {code}")),
        (true, None, signal) => Err(format!("killed by signal {signal:?}")),
    }
}

/// In a forked child: says `msg` on stderr without a lock another thread may have held at
/// the fork (std's stderr has one).
fn say(msg: &str) {
    let line = format!("fork_foreign child {}: {msg}\n", std::process::id());
    // SAFETY: write reads `line.len()` bytes of `line`, which lives across the call.
    unsafe { libc::write(2, line.as_ptr().cast(), line.len()) };
}

const PATIENCE: Duration = Duration::from_secs(20);

#[test]
fn a_child_of_a_foreign_fork_finds_no_tensorshare_lock_held() {
    // Every lock made first: a fork while a thread makes one (a static's first use) is
    // not what this test is about.
    use_the_locks();
    let stop = Arc::new(AtomicBool::new(false));
    let busy: Vec<_> = (0..2)
        .map(|_| {
            let stop = stop.clone();
            std::thread::spawn(move || {
                while !stop.load(Ordering::Relaxed) {
                    use_the_locks();
                }
            })
        })
        .collect();
    let forks = 200;
    let mut failed = None;
    for i in 0..forks {
        // SAFETY: fork has no memory-safety preconditions. The child only runs
        // `child_uses_every_lock`, whose locks are what this test is about (libc's fork
        // looks after malloc's), and leaves by _exit.
        match unsafe { libc::fork() } {
            -1 => panic!("fork: {}", std::io::Error::last_os_error()),
            0 => child_uses_every_lock(),
            pid => {
                let pid = Pid::from_raw(pid).unwrap();
                if let Err(how) = how_it_ended(pid, Instant::now() + PATIENCE) {
                    failed = Some((i, how));
                    break;
                }
            }
        }
    }
    stop.store(true, Ordering::Relaxed);
    for t in busy {
        t.join().unwrap();
    }
    assert_eq!(failed, None, "a child forked beside busy threads hung or failed (of {forks} forks)");
}

/// A child forked while another thread founds the process's cleanup group (its first
/// `file_system` allocation: a lock file, the cleaner started, a fork of its own) can make
/// named arenas too: it finds no lock held by that thread, and founds a group itself if the
/// other had not finished.
#[test]
fn a_child_forked_while_the_cleanup_group_is_founded_can_use_it() {
    let named = || Storage::empty_shared_with(64, SharingStrategy::FileSystem).map(drop);
    let founded = Arc::new(AtomicBool::new(false));
    let start = Arc::new(std::sync::Barrier::new(2));
    let founder = {
        let (founded, start) = (founded.clone(), start.clone());
        std::thread::spawn(move || {
            start.wait();
            let made = named();
            founded.store(true, Ordering::Release);
            made
        })
    };
    // Children forked back to back while the founder works (and a few after), then each
    // waited for.
    start.wait();
    let mut children = Vec::new();
    while children.len() < 32 && !(founded.load(Ordering::Acquire) && children.len() >= 4) {
        // SAFETY: as in the test above; the child makes one named arena and leaves by _exit.
        match unsafe { libc::fork() } {
            -1 => panic!("fork: {}", std::io::Error::last_os_error()),
            0 => {
                let made = match std::panic::catch_unwind(named) {
                    Ok(Ok(())) => true,
                    Ok(Err(e)) => {
                        say(&format!("no named arena: {e}"));
                        false
                    }
                    Err(_) => false,
                };
                // SAFETY: _exit ends the child at once.
                unsafe { libc::_exit(if made { 0 } else { 1 }) }
            }
            pid => children.push(Pid::from_raw(pid).unwrap()),
        }
    }
    let deadline = Instant::now() + PATIENCE;
    let failed: Vec<String> = children
        .iter()
        .enumerate()
        .filter_map(|(i, &pid)| how_it_ended(pid, deadline).err().map(|how| format!("child {i}: {how}")))
        .collect();
    founder.join().unwrap().unwrap();
    assert!(
        failed.is_empty(),
        "of {} children forked while the group was founded, {} hung or failed: {failed:?}",
        children.len(),
        failed.len()
    );
}

/// A child forked while another thread of its parent held the record of a shared tensor's
/// arena (taking or giving back a handle) can still use and drop a tensor in that arena:
/// what it inherited is the parent's, and it counts nothing there. In a helper process of
/// its own: the fork waits for the allocators' locks, which another test's thread could
/// hold while it waits for the busy record.
#[test]
fn a_child_drops_an_inherited_tensor_whose_arena_was_busy_at_the_fork() {
    common::isolated_with(drop_an_inherited_tensor_whose_arena_was_busy, ());
}

fn drop_an_inherited_tensor_whose_arena_was_busy(_rank: usize, _: ()) {
    // Two tensors in one arena: the other thread keeps a handle of the first, so the child
    // drops the last handle it has of the second.
    let (busy, dropped) = loop {
        let mut a = Tensor::zeros(&[256], DType::F32);
        let mut b = Tensor::zeros(&[256], DType::F32);
        a.share_memory().unwrap();
        b.share_memory().unwrap();
        if tensorshare::raw::same_arena(a.storage(), b.storage()) {
            break (a.storage().clone(), b);
        }
    };
    let (locked, is_locked) = std::sync::mpsc::channel();
    let (forked, was_forked) = std::sync::mpsc::channel::<()>();
    let holder = std::thread::spawn(move || {
        tensorshare::raw::with_arena_record_locked(&busy, || {
            locked.send(()).unwrap();
            was_forked.recv().unwrap();
        })
        .is_some()
    });
    is_locked.recv().unwrap();
    // SAFETY: as in the tests above; the child reads and drops the tensor it inherited and
    // leaves by _exit.
    let pid = match unsafe { libc::fork() } {
        -1 => panic!("fork: {}", std::io::Error::last_os_error()),
        0 => {
            let used = std::panic::catch_unwind(std::panic::AssertUnwindSafe(move || {
                let views: Vec<Tensor> = (0..4).map(|_| dropped.clone()).collect();
                let sum: f32 = views.iter().map(|v| v.to_vec::<f32>().unwrap().iter().sum::<f32>()).sum();
                drop(views);
                drop(dropped);
                sum == 0.0
            }));
            // SAFETY: _exit ends the child at once.
            unsafe { libc::_exit(if matches!(used, Ok(true)) { 0 } else { 1 }) }
        }
        pid => Pid::from_raw(pid).unwrap(),
    };
    forked.send(()).unwrap();
    assert!(holder.join().unwrap(), "the tensor is in no arena");
    assert!(
        ended_by(pid, Instant::now() + PATIENCE),
        "the child hung or failed dropping an inherited tensor"
    );
}

/// A child forked while another thread of its parent holds that process's locks of a
/// queue (as a thread does while it waits on the lane's directory, or on other processes,
/// with Python's GIL released: no fork guard waits for them) can still use the queue: put,
/// take what it put, ask whether it is empty, drop it. It locks locks of its own, never
/// waiting for a thread it does not have. In a helper process of its own.
#[test]
fn a_child_forked_while_a_thread_holds_a_queues_locks_can_use_the_queue() {
    common::isolated_with(use_a_queue_whose_locks_were_held, ());
}

fn use_a_queue_whose_locks_were_held(_rank: usize, _: ()) {
    let q = Queue::<Tensor>::new().unwrap();
    let shared = |v: f32| {
        let mut t = Tensor::full(&[16], v);
        t.share_memory().unwrap();
        t
    };
    // Used once, through the lane, so that the locks have something to guard.
    q.put(shared(1.0)).unwrap();
    assert_eq!(q.get().unwrap().to_vec::<f32>().unwrap(), vec![1.0; 16]);
    assert!(tensorshare::raw::lane_claimed(&q) > 0, "the value did not go through the lane");
    let (locked, is_locked) = std::sync::mpsc::channel();
    let (forked, was_forked) = std::sync::mpsc::channel::<()>();
    let holder = {
        let q = q.clone();
        std::thread::spawn(move || {
            tensorshare::raw::with_queue_locks_held(&q, || {
                locked.send(()).unwrap();
                was_forked.recv().unwrap();
            })
        })
    };
    is_locked.recv().unwrap();
    // SAFETY: as in the tests above; the child uses the queue it inherited and leaves by
    // _exit.
    let pid = match unsafe { libc::fork() } {
        -1 => panic!("fork: {}", std::io::Error::last_os_error()),
        0 => {
            let used = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                q.put(shared(2.0)).unwrap();
                let got = q.get_timeout(PATIENCE).unwrap().to_vec::<f32>().unwrap();
                let empty = q.is_empty();
                drop(q);
                got == vec![2.0; 16] && empty
            }));
            if !matches!(used, Ok(true)) {
                say(&format!("the queue did not work: {used:?}"));
            }
            // SAFETY: _exit ends the child at once.
            unsafe { libc::_exit(if matches!(used, Ok(true)) { 0 } else { 1 }) }
        }
        pid => Pid::from_raw(pid).unwrap(),
    };
    forked.send(()).unwrap();
    holder.join().unwrap();
    let child = how_it_ended(pid, Instant::now() + PATIENCE);
    // The parent's queue works on.
    q.put(shared(3.0)).unwrap();
    assert_eq!(q.get().unwrap().to_vec::<f32>().unwrap(), vec![3.0; 16]);
    assert_eq!(child, Ok(()), "the child forked while the queue's locks were held");
}

/// A child forked while its parent holds a shared tensor reads that tensor's values for as
/// long as it keeps it, though the parent drops its own handle and makes many tensors of
/// that size meanwhile: the slot stays held for the child (the fork hold), not handed out
/// again under it. In a helper process of its own, whose allocator no other test uses.
#[test]
fn a_forked_child_keeps_what_it_inherited_while_its_parent_allocates_again() {
    common::isolated_with(keep_what_was_inherited, ());
}

fn keep_what_was_inherited(_rank: usize, _: ()) {
    let mut t = Tensor::full(&[1024], 7.0f32);
    t.share_memory().unwrap();
    let (mut parent_end, mut child_end) = std::os::unix::net::UnixStream::pair().unwrap();
    // SAFETY: this helper process has one thread; the child reads the tensor it inherited
    // when its parent says so, and leaves by _exit.
    let pid = match unsafe { libc::fork() } {
        -1 => panic!("fork: {}", std::io::Error::last_os_error()),
        0 => {
            use std::io::Read;
            let kept = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                let mut word = [0u8; 1];
                child_end.read_exact(&mut word).unwrap();
                t.to_vec::<f32>().unwrap().iter().all(|&v| v == 7.0)
            }));
            // SAFETY: _exit ends the child at once.
            unsafe { libc::_exit(if matches!(kept, Ok(true)) { 0 } else { 1 }) }
        }
        pid => Pid::from_raw(pid).unwrap(),
    };
    drop(t);
    // More than an arena of this size class has slots: the allocator comes round to the
    // slot the parent let go, and would hand it out again if nothing held it for the child.
    let others: Vec<Tensor> = (0..200)
        .map(|_| {
            let mut x = Tensor::full(&[1024], -1.0f32);
            x.share_memory().unwrap();
            x
        })
        .collect();
    std::io::Write::write_all(&mut parent_end, &[1]).unwrap();
    assert!(
        ended_by(pid, Instant::now() + PATIENCE),
        "the child found its inherited tensor written over by its parent's new ones"
    );
    drop(others);
}

/// A forked child that drops every handle it inherited of an arena lets its fork hold go
/// then, not when it leaves: its parent, having dropped its own handle too, hands the slot
/// out again while the child lives on. (The child's allocator still lists the arena, as it
/// does until the child's first allocation: that list is not a handle.)
#[test]
fn a_forked_child_that_drops_what_it_inherited_lets_its_parent_reuse_it() {
    common::isolated_with(drop_what_was_inherited, ());
}

fn drop_what_was_inherited(_rank: usize, _: ()) {
    let mut t = Tensor::full(&[1024], 7.0f32);
    t.share_memory().unwrap();
    let at = t.storage().data_ptr();
    let (mut parent_end, mut child_end) = std::os::unix::net::UnixStream::pair().unwrap();
    // SAFETY: this helper process has one thread; the child drops the tensor it inherited,
    // says so, waits for its parent's word and leaves by _exit.
    let pid = match unsafe { libc::fork() } {
        -1 => panic!("fork: {}", std::io::Error::last_os_error()),
        0 => {
            use std::io::{Read, Write};
            let ok = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                drop(t);
                child_end.write_all(&[1]).unwrap();
                let mut word = [0u8; 1];
                child_end.read_exact(&mut word).unwrap();
            }));
            // SAFETY: _exit ends the child at once.
            unsafe { libc::_exit(if ok.is_ok() { 0 } else { 1 }) }
        }
        pid => Pid::from_raw(pid).unwrap(),
    };
    let mut word = [0u8; 1];
    std::io::Read::read_exact(&mut parent_end, &mut word).unwrap();
    drop(t);
    // More than an arena of this size class has slots: the allocator comes round to the
    // slot both let go.
    let others: Vec<Tensor> = (0..200).map(|_| Tensor::empty_shared(&[1024], DType::F32).unwrap()).collect();
    let reused = others.iter().any(|x| x.storage().data_ptr() == at);
    std::io::Write::write_all(&mut parent_end, &[1]).unwrap();
    assert!(ended_by(pid, Instant::now() + PATIENCE), "the child failed");
    assert!(reused, "a slot the child no longer had a handle of stayed held for it while it lived");
}

/// A forked child puts many views of a tensor it inherited while nobody reads yet: the
/// messages waiting in its outbox share its fork hold's description, one descriptor for
/// them all (each used to open a description of its own, so a backlog of thousands ran the
/// child out of descriptors), and each still arrives whole.
#[test]
fn a_forked_childs_backlog_of_inherited_views_keeps_no_descriptor_each() {
    common::isolated_with(backlog_of_inherited_views, ());
}

fn backlog_of_inherited_views(_rank: usize, _: ()) {
    const N: usize = 2000;
    let open_fds = || std::fs::read_dir("/proc/self/fd").map(|d| d.count()).unwrap_or(0);
    let t = Tensor::zeros_shared(&[64], DType::F32).unwrap();
    for i in 0..64 {
        t.atomic::<f32>().unwrap().store(i, i as f32);
    }
    let q = Queue::<Tensor>::new().unwrap();
    let (mut parent_end, mut child_end) = std::os::unix::net::UnixStream::pair().unwrap();
    // SAFETY: this helper process has one thread; the child puts views of what it
    // inherited, says how many descriptors that left open, writes its outbox out and
    // leaves by _exit.
    let pid = match unsafe { libc::fork() } {
        -1 => panic!("fork: {}", std::io::Error::last_os_error()),
        0 => {
            use std::io::Write;
            let put = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                tensorshare::adopt_forked_queues(); // puts never wait: a backlog builds up
                let before = open_fds();
                for i in 0..N {
                    q.put(t.narrow(0, i % 64, 1).unwrap()).unwrap();
                }
                let grown = open_fds().saturating_sub(before) as u64;
                child_end.write_all(&grown.to_le_bytes()).unwrap();
                tensorshare::flush_queues();
            }));
            // SAFETY: _exit ends the child at once.
            unsafe { libc::_exit(if put.is_ok() { 0 } else { 1 }) }
        }
        pid => Pid::from_raw(pid).unwrap(),
    };
    let mut word = [0u8; 8];
    let told = std::io::Read::read_exact(&mut parent_end, &mut word);
    let got: Vec<f32> =
        (0..N).map_while(|_| q.get_timeout(PATIENCE).ok()).map(|v| v.to_vec::<f32>().unwrap()[0]).collect();
    assert!(ended_by(pid, Instant::now() + PATIENCE), "the child failed");
    told.unwrap();
    let grown = u64::from_le_bytes(word);
    assert!(grown < 16, "{N} messages waiting in the child's outbox kept {grown} descriptors open");
    assert_eq!(got, (0..N).map(|i| (i % 64) as f32).collect::<Vec<_>>());
}

/// A forked child sends a view of a tensor it inherited (its arena's record is its
/// parent's): the parent receives a view of its own memory, as torch's would be.
#[test]
fn a_forked_child_sends_back_a_view_of_a_tensor_it_inherited() {
    common::isolated_with(send_back_what_was_inherited, ());
}

fn send_back_what_was_inherited(_rank: usize, _: ()) {
    let mut t = Tensor::full(&[64], 3.0f32);
    t.share_memory().unwrap();
    let q = Queue::<Tensor>::new().unwrap();
    // SAFETY: this helper process has one thread; the child sends what it inherited and
    // leaves by _exit.
    let pid = match unsafe { libc::fork() } {
        -1 => panic!("fork: {}", std::io::Error::last_os_error()),
        0 => {
            let sent = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                q.put(t.narrow(0, 8, 4).unwrap()).is_ok()
            }));
            // SAFETY: _exit ends the child at once.
            unsafe { libc::_exit(if matches!(sent, Ok(true)) { 0 } else { 1 }) }
        }
        pid => Pid::from_raw(pid).unwrap(),
    };
    let back = q.get_timeout(PATIENCE);
    assert!(ended_by(pid, Instant::now() + PATIENCE), "the child could not send what it inherited");
    let mut back = back.unwrap();
    // The same memory (mapped again here: the parent never sent the arena, so its receive
    // cache did not know it): a write through the view shows in `t`.
    back.fill(-1.0f32).unwrap();
    let seen = t.to_vec::<f32>().unwrap();
    assert_eq!(&seen[8..12], &[-1.0; 4], "the view is not of the parent's own memory");
    assert!(seen[..8].iter().chain(&seen[12..]).all(|&v| v == 3.0));
}
