//! The file_system strategy leaks nothing: torch's test_fs and leak checker, in-flight
//! messages that outlive a killed producer, and SIGKILL of producers and consumers
//! mid-stream. Each case runs in a helper process that founds its own cleanup group, so its
//! files are told apart from those of the tests running beside it.

use std::collections::VecDeque;
use std::os::fd::OwnedFd;

use serde::{Deserialize, Serialize};
use tensorshare::{raw, segments};
use tensorshare::{set_sharing_strategy, spawn, DType, Queue, SharingStrategy, Storage, Tensor};

tensorshare::enable_test_workers!();

mod common;

/// The files of the group of `root`: segments (with a creator) and the lock.
fn files_of(root: i32) -> Vec<segments::SegmentInfo> {
    segments::list().unwrap().into_iter().filter(|s| s.root == root).collect()
}

fn pidfd(pid: i32) -> OwnedFd {
    rustix::process::pidfd_open(
        rustix::process::Pid::from_raw(pid).unwrap(),
        rustix::process::PidfdFlags::empty(),
    )
    .expect("the cleaner is running")
}

/// The leak checker: once the helper that founded group `root` is gone, its cleaner ends
/// within 5 seconds, and no file of the group is left.
fn assert_cleaned(root: i32, cleaner: &OwnedFd) {
    let mut p = [rustix::event::PollFd::new(cleaner, rustix::event::PollFlags::IN)];
    let five = rustix::event::Timespec { tv_sec: 5, tv_nsec: 0 };
    assert_eq!(rustix::event::poll(&mut p, Some(&five)).unwrap(), 1, "the cleaner did not finish in 5 s");
    let left = files_of(root);
    assert!(left.is_empty(), "left behind: {left:?}");
}

/// Runs `body` in a helper that founds a group; returns the group's root and its cleaner.
fn in_new_group<A, J>(body: J, args: A) -> (i32, OwnedFd)
where
    A: Serialize + serde::de::DeserializeOwned,
    J: tensorshare::Job<(A, Queue<(i32, i32)>)>,
{
    let status: Queue<(i32, i32)> = Queue::new().unwrap();
    let mut ctx = spawn(body, (args, status.clone()), 1).unwrap();
    let (root, cleaner) = status.get().unwrap();
    let cleaner = pidfd(cleaner);
    if let Err(e) = ctx.join(None) {
        panic!("{e:#}");
    }
    (root, cleaner)
}

fn found_group(status: &Queue<(i32, i32)>) -> i32 {
    let root = raw::new_group().unwrap();
    status.put((root, raw::cleaner_pid().unwrap())).unwrap();
    set_sharing_strategy(SharingStrategy::FileSystem).unwrap();
    root
}

/// torch's test_fs: a named segment exists while a storage is in flight, and is gone once
/// it is received, dropped and its arena let go; repeated, and nothing left at the end.
fn test_fs_body(_rank: usize, ((), status): ((), Queue<(i32, i32)>)) {
    let root = found_group(&status);
    let segments = || files_of(root).into_iter().filter(|s| s.creator.is_some()).count();
    for _ in 0..5 {
        assert_eq!(segments(), 0);
        let q: Queue<Storage> = Queue::new().unwrap();
        q.put(Storage::new(32)).unwrap(); // torch: DoubleStorage(4)
        assert!(segments() > 0, "a segment exists while the storage is in flight");
        drop(q.get().unwrap());
        tensorshare::trim_arenas();
        assert_eq!(segments(), 0, "gone once received, dropped and its arena let go");
    }
}

#[test]
fn test_fs() {
    let (root, cleaner) = in_new_group(test_fs_body, ());
    assert_cleaned(root, &cleaner);
}

fn send_ten_then_wait(_rank: usize, (q, ready): (Queue<Tensor>, Queue<()>)) {
    set_sharing_strategy(SharingStrategy::FileSystem).unwrap();
    for i in 0..10 {
        let mut t = Tensor::empty_shared(&[256], DType::F32).unwrap();
        t.fill(i as f32).unwrap();
        q.put(t).unwrap();
    }
    ready.put(()).unwrap();
    loop {
        std::thread::park();
    }
}

/// While any process of the group lives, messages in flight stay readable: the producer is
/// SIGKILLed with ten messages unread, and all ten are read afterwards.
fn in_flight_body(_rank: usize, ((), status): ((), Queue<(i32, i32)>)) {
    let root = found_group(&status);
    let q: Queue<Tensor> = Queue::with_capacity(16).unwrap();
    let ready: Queue<()> = Queue::new().unwrap();
    let mut p = spawn(send_ten_then_wait, (q.clone(), ready.clone()), 1).unwrap();
    ready.get().unwrap();
    assert!(
        files_of(root).iter().any(|s| s.creator == Some(p.pids()[0])),
        "the producer made named segments"
    );
    rustix::process::kill_process(
        rustix::process::Pid::from_raw(p.pids()[0]).unwrap(),
        rustix::process::Signal::KILL,
    )
    .unwrap();
    assert_eq!(p.join(None).unwrap_err().signal_name(), Some("SIGKILL"));
    for i in 0..10 {
        let t = q.get().unwrap();
        assert!(t.to_vec::<f32>().unwrap().iter().all(|v| *v == i as f32));
    }
}

#[test]
fn in_flight_messages_outlive_a_sigkilled_producer() {
    let (root, cleaner) = in_new_group(in_flight_body, ());
    assert_cleaned(root, &cleaner);
}

#[derive(Clone, Copy, Debug, Serialize, Deserialize)]
enum Kill {
    Producer,
    Consumer,
    Both,
}

fn produce_forever(_rank: usize, q: Queue<Tensor>) {
    set_sharing_strategy(SharingStrategy::FileSystem).unwrap();
    for i in 0.. {
        let mut t = Tensor::empty_shared(&[1024], DType::F32).unwrap();
        t.fill(i as f32).unwrap();
        if q.put(t).is_err() {
            return; // the consumer is gone
        }
    }
}

fn consume_forever(_rank: usize, (q, ready): (Queue<Tensor>, Queue<()>)) {
    let mut held = VecDeque::new();
    let mut n = 0;
    while let Ok(t) = q.get() {
        held.push_back(t); // hold some, as a training loop holds its batches
        if held.len() > 8 {
            held.pop_front();
        }
        n += 1;
        if n == 3 {
            ready.put(()).unwrap();
        }
    }
}

fn crash_body(_rank: usize, (kill, status): (Kill, Queue<(i32, i32)>)) {
    let root = found_group(&status);
    let q: Queue<Tensor> = Queue::with_capacity(4).unwrap();
    let ready: Queue<()> = Queue::new().unwrap();
    let mut p = spawn(produce_forever, q.clone(), 1).unwrap();
    let mut c = spawn(consume_forever, (q.clone(), ready.clone()), 1).unwrap();
    drop(q); // the workers alone hold the queue: a survivor sees its peer's death
    ready.get().unwrap();
    assert!(files_of(root).iter().any(|s| s.creator.is_some()), "named segments are in use");
    let victims = match kill {
        Kill::Producer => vec![p.pids()[0]],
        Kill::Consumer => vec![c.pids()[0]],
        Kill::Both => vec![p.pids()[0], c.pids()[0]],
    };
    for pid in victims {
        rustix::process::kill_process(
            rustix::process::Pid::from_raw(pid).unwrap(),
            rustix::process::Signal::KILL,
        )
        .unwrap();
    }
    // The survivor ends by itself (Disconnected); the killed ones report SIGKILL.
    let _ = p.join(None);
    let _ = c.join(None);
}

fn crash(kill: Kill) {
    for _ in 0..20 {
        let (root, cleaner) = in_new_group(crash_body, kill);
        assert_cleaned(root, &cleaner);
    }
}

#[test]
fn sigkill_of_the_producer_mid_stream_leaves_nothing() {
    crash(Kill::Producer);
}

#[test]
fn sigkill_of_the_consumer_mid_stream_leaves_nothing() {
    crash(Kill::Consumer);
}

#[test]
fn sigkill_of_both_mid_stream_leaves_nothing() {
    crash(Kill::Both);
}

/// A producer SIGKILLed with a message in flight: the message stays readable, and the dead
/// producer's files go as soon as a member of the group that still runs makes a named
/// arena, not only when the whole group exits.
fn dead_producer_body(_rank: usize, ((), status): ((), Queue<(i32, i32)>)) {
    let root = found_group(&status);
    let q: Queue<Tensor> = Queue::with_capacity(16).unwrap();
    let ready: Queue<()> = Queue::new().unwrap();
    let mut p = spawn(send_ten_then_wait, (q.clone(), ready.clone()), 1).unwrap();
    ready.get().unwrap();
    let producer = p.pids()[0];
    assert!(files_of(root).iter().any(|s| s.creator == Some(producer)));
    let pid = rustix::process::Pid::from_raw(producer).unwrap();
    rustix::process::kill_process(pid, rustix::process::Signal::KILL).unwrap();
    assert_eq!(p.join(None).unwrap_err().signal_name(), Some("SIGKILL"));
    let first = q.get().unwrap();
    // This process makes a named arena of its own: the dead producer's names are swept.
    let mine = Tensor::zeros_shared(&[3 << 20], DType::U8).unwrap();
    let left: Vec<_> = files_of(root).into_iter().filter(|s| s.creator == Some(producer)).collect();
    assert!(left.is_empty(), "the dead producer's files outlive it: {left:?}");
    // What was in flight is still there, memory and all.
    assert!(first.to_vec::<f32>().unwrap().iter().all(|v| *v == 0.0));
    for i in 1..10 {
        assert!(q.get().unwrap().to_vec::<f32>().unwrap().iter().all(|v| *v == i as f32));
    }
    drop((first, mine));
}

#[test]
fn a_dead_producers_files_go_while_the_group_runs() {
    let (root, cleaner) = in_new_group(dead_producer_body, ());
    assert_cleaned(root, &cleaner);
}

/// The founder of a group, alone in a process group of its own, shares a tensor and then
/// kills its whole process group at once (a launcher's `killpg`, a container's end): its
/// cleaner, started in a session of its own, is not in that group, and removes the files.
fn killpg_body(_rank: usize, ((), status): ((), Queue<(i32, i32)>)) {
    rustix::process::setsid().unwrap(); // so that the kill below reaches this process only
    let root = found_group(&status);
    let mut t = Tensor::zeros(&[1024], DType::F32);
    t.share_memory().unwrap();
    assert!(!files_of(root).is_empty());
    rustix::process::kill_current_process_group(rustix::process::Signal::KILL).unwrap();
}

#[test]
fn killing_the_founders_process_group_at_once_leaves_nothing() {
    let status: Queue<(i32, i32)> = Queue::new().unwrap();
    let mut ctx = spawn(killpg_body, ((), status.clone()), 1).unwrap();
    let (root, cleaner) = status.get().unwrap();
    // The cleaner may have finished already: then there is nothing to wait for.
    let cleaner = rustix::process::pidfd_open(
        rustix::process::Pid::from_raw(cleaner).unwrap(),
        rustix::process::PidfdFlags::empty(),
    );
    let e = ctx.join(None).unwrap_err();
    assert_eq!(e.failure, tensorshare::Failure::Signaled { signal: 9, name: "SIGKILL".into() });
    match cleaner {
        Ok(cleaner) => assert_cleaned(root, &cleaner),
        Err(_) => assert!(files_of(root).is_empty(), "left behind: {:?}", files_of(root)),
    }
}

/// A root no process can have (above the kernel's pid limit), unique to this test run.
fn unused_root() -> i32 {
    (1 << 23) + 1000 + (std::process::id() as i32 % 1_000_000)
}

/// A group whose cleaner never ran (killed with it) is removed by the next group founded
/// on the same directory: no member of it is left, by the same test as `shm gc`.
fn founding_body(_rank: usize, (dead, status): (i32, Queue<(i32, i32)>)) {
    let root = found_group(&status);
    assert_ne!(root, dead);
}

#[test]
fn founding_a_group_removes_what_dead_groups_left() {
    let dead = unused_root();
    let dir = segments::shm_dir();
    let planted =
        [format!("tensorshare_{dead}_group"), format!("tensorshare_{dead}_{dead}_00000000deadbeef")];
    // Left a while ago: a founder leaves a dead group's files alone for a minute (to its
    // cleaner, or to `shm gc`), then removes them.
    let long_ago = std::time::SystemTime::now() - std::time::Duration::from_secs(3600);
    for name in &planted {
        let f = std::fs::File::create(dir.join(name)).unwrap();
        f.set_modified(long_ago).unwrap();
    }
    let (root, cleaner) = in_new_group(founding_body, dead);
    assert!(files_of(dead).is_empty(), "left behind: {:?}", files_of(dead));
    assert_cleaned(root, &cleaner);
}

/// A founder whose pid already names a group it cannot replace (another pid namespace's
/// live group on a shared /dev/shm, or a name another user planted) founds one under a
/// root that no pid can be, and works as usual.
fn blocked_body(_rank: usize, ((), status): ((), Queue<(i32, i32)>)) {
    let me = std::process::id() as i32;
    let blocker = segments::shm_dir().join(format!("tensorshare_{me}_group"));
    std::fs::create_dir(&blocker).unwrap();
    let root = raw::new_group();
    // `shm gc` does not say it removed what it could not.
    let gc = segments::gc(false);
    std::fs::remove_dir(&blocker).unwrap();
    let root = root.unwrap();
    assert!(root >= 1 << 23, "root {root}, pid {me}");
    assert!(!gc.unwrap().iter().any(|n| n.starts_with(&format!("tensorshare_{me}_"))));
    status.put((root, raw::cleaner_pid().unwrap())).unwrap();
    set_sharing_strategy(SharingStrategy::FileSystem).unwrap();
    let mut t = Tensor::zeros(&[1024], DType::F32);
    t.share_memory().unwrap();
    let names: Vec<String> = files_of(root).into_iter().map(|s| s.name).collect();
    assert!(names.iter().any(|n| n.starts_with(&format!("tensorshare_{root}_{me}_"))), "{names:?}");
}

#[test]
fn a_founder_whose_pid_names_a_group_already_takes_another_root() {
    let (root, cleaner) = in_new_group(blocked_body, ());
    assert_cleaned(root, &cleaner);
}

/// Run by the test below, in a 64 MiB tmpfs: eight workers in turn each send a 16 MiB
/// tensor (file_system) and exit, and this process drops each after receiving it. 128 MiB in all, so the
/// receiver must not keep the dead workers' arenas mapped for speed (their room in the
/// filesystem would stay taken), or a later worker runs out of shared memory.
#[test]
#[ignore = "run in a 64 MiB tmpfs by a_receiver_in_a_64_mib_dev_shm_keeps_no_dead_workers_arenas"]
fn large_tensors_of_dead_workers_in_a_small_dev_shm() {
    set_sharing_strategy(SharingStrategy::FileSystem).unwrap();
    for round in 0..8 {
        let q: Queue<Tensor> = Queue::new().unwrap();
        let mut ctx = spawn(
            |_rank, q: Queue<Tensor>| {
                set_sharing_strategy(SharingStrategy::FileSystem).unwrap(); // a worker's own choice
                let mut t = Tensor::full(&[4 << 20], 1.0f32); // written: its pages take room
                t.share_memory().unwrap();
                q.put(t).unwrap();
            },
            q.clone(),
            1,
        )
        .unwrap();
        let t = q.get().unwrap();
        assert_eq!(t.shape(), [4 << 20]);
        drop(t);
        if let Err(e) = ctx.join(None) {
            panic!("round {round}: {e:#}");
        }
    }
}

/// Runs the ignored test `name` of this binary in a private mount namespace, with the
/// named segments' directory a tmpfs of `mib` MiB. Returns false where that cannot be
/// mounted (it needs root and unshare).
fn run_in_small_shm_dir(mib: usize, name: &str) -> bool {
    let dir = std::env::temp_dir().join(format!("tensorshare-shm{mib}-{}-{name}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let mount = format!("mount -t tmpfs -o size={mib}m tensorshare-test {}", dir.display());
    let probe = std::process::Command::new("unshare").args(["-m", "sh", "-c", &mount]).output();
    if !probe.as_ref().is_ok_and(|p| p.status.success()) {
        std::fs::remove_dir(&dir).unwrap();
        eprintln!("skipped: cannot mount a tmpfs in a private mount namespace (needs root and unshare)");
        return false;
    }
    let exe = std::env::current_exe().unwrap();
    let script = format!(
        "{mount} && TENSORSHARE_SHM_DIR={} exec {} --ignored --exact {name}",
        dir.display(),
        exe.display()
    );
    let out = std::process::Command::new("unshare").args(["-m", "sh", "-c", &script]).output().unwrap();
    std::fs::remove_dir(&dir).unwrap();
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success() && text.contains("1 passed"), "{text}");
    true
}

#[test]
fn a_receiver_in_a_64_mib_dev_shm_keeps_no_dead_workers_arenas() {
    run_in_small_shm_dir(64, "large_tensors_of_dead_workers_in_a_small_dev_shm");
}

/// Run by the test below, in an 8 MiB tmpfs: two workers each stream 128 tensors of 128 KiB
/// to 1 MiB (file_system) through a queue of 8 places, and this process checks and drops
/// each. About 6 MiB are live at most; each process keeps only its share of the room:
/// arenas of a 64th of it, no more than a 16th of it in free ones, and no receiver keeps
/// mapped more than a 16th of it, nor arenas their creator has let go. (Size classes whose
/// arenas grew to 8 MiB filled it within a few dozen tensors.)
#[test]
#[ignore = "run in an 8 MiB tmpfs by a_stream_of_mixed_sizes_fits_a_small_dev_shm"]
fn a_stream_of_mixed_sizes_in_a_small_dev_shm() {
    const N: usize = 128;
    let len = |i: usize| 32 << (10 + i % 4);
    set_sharing_strategy(SharingStrategy::FileSystem).unwrap();
    let q: Queue<Tensor> = Queue::with_capacity(8).unwrap();
    let mut ctx = spawn(
        move |rank, q: Queue<Tensor>| {
            set_sharing_strategy(SharingStrategy::FileSystem).unwrap();
            for i in 0..N {
                let mut t = Tensor::full(&[len(i)], (rank * N + i) as f32);
                t.share_memory().unwrap();
                q.put(t).unwrap();
            }
        },
        q.clone(),
        2,
    )
    .unwrap();
    let mut seen = vec![false; 2 * N];
    for _ in 0..2 * N {
        let t = q.get().unwrap();
        let v = t.to_vec::<f32>().unwrap();
        let k = v[0] as usize;
        assert!(k < 2 * N && !seen[k], "tensor {k} twice or out of range");
        seen[k] = true;
        assert_eq!(t.shape(), [len(k % N)], "tensor {k}");
        assert!(v.iter().all(|&x| x == k as f32), "tensor {k}");
    }
    if let Err(e) = ctx.join(None) {
        panic!("{e:#}");
    }
}

/// Run by the test below, in a 16 MiB tmpfs: a worker that holds 2 MiB of its own (more
/// than an eighth of the room, so its bounds apply) streams 4,000 tensors of 4 KiB, and this
/// process keeps every 8th. The worker's pooled arenas of 4 KiB slots are each partly held
/// here: letting them go would strand their free slots and make a new arena every few
/// tensors until the room is gone (it failed after about 950 tensors so).
#[test]
#[ignore = "run in a 16 MiB tmpfs by small_tensors_partly_kept_by_a_receiver_fit_a_small_dev_shm"]
fn small_tensors_partly_kept_by_a_receiver_in_a_small_dev_shm() {
    const N: usize = 4000;
    set_sharing_strategy(SharingStrategy::FileSystem).unwrap();
    let q: Queue<Tensor> = Queue::with_capacity(8).unwrap();
    let mut ctx = spawn(
        |_rank, q: Queue<Tensor>| {
            set_sharing_strategy(SharingStrategy::FileSystem).unwrap();
            let mut held = Tensor::full(&[1 << 19], 1.0f32);
            held.share_memory().unwrap();
            for i in 0..N {
                let mut t = Tensor::full(&[1024], i as f32);
                t.share_memory().unwrap();
                q.put(t).unwrap();
            }
            drop(held);
        },
        q.clone(),
        1,
    )
    .unwrap();
    let mut kept = Vec::new();
    for i in 0..N {
        let t = q.get().unwrap();
        assert_eq!(t.to_vec::<f32>().unwrap()[0], i as f32, "tensor {i}");
        if i % 8 == 0 {
            kept.push(t);
        }
    }
    if let Err(e) = ctx.join(None) {
        panic!("{e:#}");
    }
}

#[test]
fn small_tensors_partly_kept_by_a_receiver_fit_a_small_dev_shm() {
    run_in_small_shm_dir(16, "small_tensors_partly_kept_by_a_receiver_in_a_small_dev_shm");
}

#[test]
fn a_stream_of_mixed_sizes_fits_a_small_dev_shm() {
    run_in_small_shm_dir(8, "a_stream_of_mixed_sizes_in_a_small_dev_shm");
}

/// A forked worker leaves without exit handlers (they are its parent's): the names of the
/// named arenas it made go as it leaves, while the job runs on; what it sent stays readable.
fn forked_worker_body(_rank: usize, ((), status): ((), Queue<(i32, i32)>)) {
    common::allow_fork_in_helper();
    let root = found_group(&status);
    let q: Queue<(Tensor, u32)> = Queue::new().unwrap();
    let mut ctx = tensorshare::start_processes(
        |_rank, q: Queue<(Tensor, u32)>| {
            set_sharing_strategy(SharingStrategy::FileSystem).unwrap();
            let mut t = Tensor::full(&[1 << 16], 3.0f32);
            t.share_memory().unwrap();
            q.put((t, std::process::id())).unwrap();
        },
        q.clone(),
        1,
        tensorshare::StartMethod::Fork,
    )
    .unwrap();
    let (t, worker) = q.get().unwrap();
    assert_eq!(ctx.join(None), Ok(true));
    let left: Vec<_> = files_of(root).into_iter().filter(|s| s.creator == Some(worker as i32)).collect();
    assert!(left.is_empty(), "the forked worker's names stay: {left:?}");
    assert!(t.to_vec::<f32>().unwrap().iter().all(|&v| v == 3.0));
}

#[test]
fn a_forked_workers_named_arenas_go_with_it() {
    let (root, cleaner) = in_new_group(forked_worker_body, ());
    assert_cleaned(root, &cleaner);
}

/// A process told to join a group (its parent's) whose files are being removed at that
/// moment (its last member gone, its cleaner holding the lock file's exclusive lock) waits
/// for that lock; once the cleaner has unlinked the file and let go, the joiner founds a
/// group of its own instead of joining one nobody will clean.
fn joiner_body(_rank: usize, _: ()) {
    use std::os::unix::fs::MetadataExt;
    let dead = unused_root() + 7;
    let path = segments::shm_dir().join(format!("tensorshare_{dead}_group"));
    let cleaner = std::fs::File::create(&path).unwrap();
    rustix::fs::flock(&cleaner, rustix::fs::FlockOperation::LockExclusive).unwrap();
    // The variable a parent sets for its workers; this helper has one thread here.
    std::env::set_var("TENSORSHARE_SHM_GROUP", dead.to_string());
    let joiner = std::thread::spawn(|| raw::ensure_group().unwrap());
    // Until the joiner waits for the lock (a blocked request shows with `->` in /proc/locks).
    let ino = format!(":{} ", cleaner.metadata().unwrap().ino());
    while !std::fs::read_to_string("/proc/locks")
        .unwrap()
        .lines()
        .any(|l| l.contains("->") && l.contains(&ino))
    {
        std::thread::yield_now();
    }
    std::fs::remove_file(&path).unwrap();
    drop(cleaner);
    let root = joiner.join().unwrap();
    assert_ne!(root, dead, "joined a group whose files were being removed");
}

#[test]
fn a_process_joining_a_group_being_removed_founds_its_own() {
    common::isolated_with(joiner_body, ());
}
