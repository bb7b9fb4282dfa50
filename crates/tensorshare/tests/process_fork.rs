//! What only the Fork start method does: the worker inherits the parent's memory.

use std::sync::OnceLock;

use tensorshare::{start_processes, DType, StartMethod, Tensor};

tensorshare::enable_test_workers!();

mod common;

/// A tensor made before the fork, reached through a global (torch's test_inherit_tensor
/// passes it as an attribute of the process object, which fork inherits too).
static INHERITED: OnceLock<Tensor> = OnceLock::new();

fn fill_the_inherited_tensor(_rank: usize, _: ()) {
    let mut t = INHERITED.get().expect("inherited from the parent").clone();
    t.fill(3.0f32).unwrap();
}

fn inherit_tensor(_rank: usize, _: StartMethod) {
    common::allow_fork_in_helper();
    let mut t = Tensor::zeros(&[5, 5], DType::F32);
    t.share_memory().unwrap();
    INHERITED.set(t.clone()).unwrap();
    let mut ctx = start_processes(fill_the_inherited_tensor, (), 1, StartMethod::Fork).unwrap();
    assert_eq!(ctx.join(None), Ok(true));
    assert_eq!(t.to_vec::<f32>().unwrap(), vec![3.0; 25]);
}

/// torch's test_inherit_tensor.
#[test]
fn test_inherit_tensor() {
    common::isolated(inherit_tensor, StartMethod::Fork);
}

/// A thread that waits until told to finish, holding `hold` (if any) meanwhile.
fn parked_thread(hold_stdout: bool) -> (std::sync::mpsc::Sender<()>, std::thread::JoinHandle<()>) {
    let (ready_tx, ready_rx) = std::sync::mpsc::channel();
    let (done_tx, done_rx) = std::sync::mpsc::channel::<()>();
    let t = std::thread::spawn(move || {
        let guard = hold_stdout.then(|| std::io::stdout().lock());
        ready_tx.send(()).unwrap();
        let _ = done_rx.recv();
        drop(guard);
    });
    ready_rx.recv().unwrap();
    (done_tx, t)
}

fn refuses_with_threads(_rank: usize, _: ()) {
    let (done, t) = parked_thread(false);
    let err = start_processes(|_rank, _: ()| {}, (), 1, StartMethod::Fork).unwrap_err();
    let text = err.to_string();
    assert!(text.contains("StartMethod::Fork refused") && text.contains("allow_fork_with_threads"), "{text}");
    done.send(()).unwrap();
    t.join().unwrap();
}

#[test]
fn fork_from_a_process_with_threads_is_refused() {
    common::isolated_with(refuses_with_threads, ());
}

fn exits_while_stdout_is_held(_rank: usize, _: ()) {
    common::allow_fork_in_helper();
    // Another thread holds stdout's lock at the fork: the worker must not need it to leave.
    let (done, t) = parked_thread(true);
    let mut ctx = start_processes(|_rank, _: ()| {}, (), 1, StartMethod::Fork).unwrap();
    let joined = ctx.join(Some(std::time::Duration::from_secs(60)));
    done.send(()).unwrap();
    t.join().unwrap();
    assert_eq!(joined, Ok(true), "the forked worker hung on its way out");
}

#[test]
fn a_forked_worker_leaves_without_the_locks_of_other_threads() {
    common::isolated_with(exits_while_stdout_is_held, ());
}

fn wait_for_the_word(_rank: usize, q: tensorshare::Queue<()>) {
    q.get().unwrap();
}

fn keeps_no_pipe_of_its_parent(_rank: usize, _: ()) {
    common::allow_fork_in_helper();
    let (reader, writer) = rustix::pipe::pipe().unwrap();
    let q: tensorshare::Queue<()> = tensorshare::Queue::new().unwrap();
    let mut ctx = start_processes(wait_for_the_word, q.clone(), 1, StartMethod::Fork).unwrap();
    // The worker runs (it waits for the word). Once the parent lets go of the write end,
    // nobody holds it unless the worker inherited it.
    drop(writer);
    let mut poll = [rustix::event::PollFd::new(&reader, rustix::event::PollFlags::IN)];
    let minute = rustix::event::Timespec { tv_sec: 60, tv_nsec: 0 };
    rustix::event::poll(&mut poll, Some(&minute)).unwrap();
    let mut byte = [0u8; 1];
    let hung_up = !poll[0].revents().is_empty() && rustix::io::read(&reader, &mut byte).unwrap() == 0;
    q.put(()).unwrap();
    assert_eq!(ctx.join(None), Ok(true));
    assert!(hung_up, "the forked worker kept its parent's pipe open");
}

#[test]
fn a_forked_worker_does_not_keep_its_parents_pipes() {
    common::isolated_with(keeps_no_pipe_of_its_parent, ());
}

fn allocate_named_storage(_rank: usize, _: ()) {
    // Allocating makes the allocator forget the arenas inherited through fork; dropping
    // them must not remove the parent's files.
    tensorshare::Storage::empty_shared_with(4096, tensorshare::SharingStrategy::FileSystem).unwrap();
}

fn named_arena_survives_the_child(_rank: usize, _: StartMethod) {
    common::allow_fork_in_helper();
    let storage =
        tensorshare::Storage::empty_shared_with(4096, tensorshare::SharingStrategy::FileSystem).unwrap();
    let name = storage.segment_name().expect("a named storage");
    // The arena stays in this process's allocator, and no storage of it is alive at the fork.
    drop(storage);
    let path = tensorshare::segments::shm_dir().join(&name);
    assert!(path.exists(), "{name} was removed before the fork");
    let mut ctx = start_processes(allocate_named_storage, (), 1, StartMethod::Fork).unwrap();
    assert_eq!(ctx.join(None), Ok(true));
    assert!(path.exists(), "the forked child removed its parent's arena {name}");
    // And the parent can still hand out and send slots of it.
    let again =
        tensorshare::Storage::empty_shared_with(4096, tensorshare::SharingStrategy::FileSystem).unwrap();
    assert!(again.segment_name().is_some());
}

/// A child forked from a process with named arenas (the file_system strategy) leaves their
/// files alone when it forgets or frees what it inherited: they are its parent's.
#[test]
fn a_forked_child_leaves_its_parents_named_arenas_alone() {
    common::isolated(named_arena_survives_the_child, StartMethod::Fork);
}
