//! The ranks' side: each scenario runs on every rank and prints `rank R: ok ...`, or
//! `rank R: FAILED: ...` and exits with 1 (which makes mpirun end the job).

use tensorshare::dist::{self, DistError};
use tensorshare::{DType, Error, Tensor};

use crate::suite;

/// A check's failure, with where it failed.
pub type Check<T = ()> = Result<T, String>;

/// Fails the scenario at this line unless `cond`.
#[macro_export]
macro_rules! ensure {
    ($cond:expr, $($msg:tt)+) => {
        if !$cond {
            return Err(format!("{}:{}: {}", file!(), line!(), format!($($msg)+)));
        }
    };
}

/// tensorshare's results as checks.
pub trait Ctx<T> {
    fn ctx(self, what: &str) -> Check<T>;
}

impl<T> Ctx<T> for tensorshare::Result<T> {
    fn ctx(self, what: &str) -> Check<T> {
        self.map_err(|e| format!("{what}: {e}"))
    }
}

/// Runs scenario `name` and returns the process's exit code.
pub fn run(name: &str) -> i32 {
    let outcome = match name {
        "node" => suite::node(),
        "nodes" => suite::nodes(),
        "single" => single(),
        "dies" => dies(false),
        "dies_leaving_a_fork" => dies(true),
        "panics" => goes(true),
        "ends" => goes(false),
        other => Err(format!("no scenario {other:?}")),
    };
    // The launcher's word (a session may have ended); a job without mpirun is rank 0.
    let rank = std::env::var("OMPI_COMM_WORLD_RANK").unwrap_or_else(|_| "0".into());
    match outcome {
        Ok(summary) => {
            println!("rank {rank}: ok: {summary}");
            0
        }
        Err(e) => {
            println!("rank {rank}: FAILED: {e}");
            1
        }
    }
}

/// A rank goes while another waits on it, with values on their way to that other: with
/// `panic`, rank 0 panics with values for rank 1, and ranks 1 to 3 wait at a barrier; else
/// rank 3 ends its session with values for rank 2, which keeps sending to it. The ranks
/// left must name the rank that went: the going rank must not wait for its values to be
/// taken by ranks that will not take them (which wait for it in turn).
fn goes(panic: bool) -> Check<String> {
    let session = dist::init().ctx("init")?;
    let rank = dist::rank().ctx("rank")?;
    ensure!(dist::world_size().ctx("size")? == 4, "this scenario runs on 4 ranks");
    // Ranks 2 and 3 each hold the queue the other made for the pair.
    if !panic && rank >= 2 {
        let other = 5 - rank;
        dist::send(&1u64, other).ctx("a value")?;
        ensure!(dist::recv::<u64>(other).ctx("the other's value")? == 1, "the other's value");
    }
    dist::barrier().ctx("barrier")?;
    let big = || Tensor::zeros(&[300_000], DType::F32);
    let (e, gone) = match (panic, rank) {
        (true, 0) => {
            dist::send(&2u64, 1).ctx("a small value")?;
            dist::send(&big(), 1).ctx("a large value")?;
            panic!("rank 0 fails on purpose");
        }
        (true, _) => (dist::barrier().unwrap_err(), 0),
        (false, 3) => {
            dist::send(&2u64, 2).ctx("a small value")?;
            dist::send(&big(), 2).ctx("a large value")?;
            drop(session);
            return Ok("ended its session".into());
        }
        (false, 2) => {
            // Small values (through the lane) and large ones (through the queue's socket,
            // which wait in rank 2 until the small ones before them are taken).
            let mut sent = 0u64;
            let e = loop {
                let r = match sent % 2 {
                    0 => dist::send(&sent, 3),
                    _ => dist::send(&big(), 3),
                };
                match r {
                    Ok(()) => sent += 1,
                    Err(e) => break e,
                }
                ensure!(sent <= 1000, "rank 2 sent {sent} values to a rank that ended its session");
            };
            (e, 3)
        }
        (false, _) => return Ok("not involved".into()),
    };
    ensure!(matches!(&e, Error::Dist(DistError::RankGone { rank, .. }) if *rank == gone), "{e}");
    Ok(format!("saw {e}"))
}

/// Forks a child that holds everything this process holds (its sockets, its queues) and
/// lives until the launcher that started this rank ends.
fn leave_a_fork() -> Check {
    let launcher = rustix::process::getppid().ok_or("this rank has no parent")?;
    // SAFETY: the child makes only system calls (open, dup2, pidfd_open, poll) and _exits;
    // it touches nothing another thread of this process could have left half done.
    if unsafe { libc::fork() } == 0 {
        // Off the launcher's output pipes, which it drains before it ends.
        // SAFETY: open and dup2 of descriptors this child owns.
        unsafe {
            let null = libc::open(c"/dev/null".as_ptr(), libc::O_RDWR);
            for std in 0..3 {
                libc::dup2(null, std);
            }
        }
        if let Ok(fd) = rustix::process::pidfd_open(launcher, rustix::process::PidfdFlags::empty()) {
            let mut fds = [rustix::event::PollFd::new(&fd, rustix::event::PollFlags::IN)];
            let _ = rustix::event::poll(&mut fds, None);
        }
        // SAFETY: ends the child without running the parent's exit handlers.
        unsafe { libc::_exit(0) };
    }
    Ok(())
}

/// Waits until process `pid` has ended.
fn wait_for_end(pid: i32) -> Check {
    let pid = rustix::process::Pid::from_raw(pid).ok_or("no such pid")?;
    let fd = match rustix::process::pidfd_open(pid, rustix::process::PidfdFlags::empty()) {
        Ok(fd) => fd,
        Err(rustix::io::Errno::SRCH) => return Ok(()),
        Err(e) => return Err(format!("pidfd_open: {e}")),
    };
    let mut fds = [rustix::event::PollFd::new(&fd, rustix::event::PollFlags::IN)];
    while matches!(rustix::event::poll(&mut fds, None), Err(rustix::io::Errno::INTR)) {}
    Ok(())
}

/// Whether `e` is `NotInitialized` and says `words`.
pub fn not_initialized(e: Error, words: &str) -> Check {
    let text = e.to_string();
    ensure!(matches!(e, Error::Dist(DistError::NotInitialized(_))) && text.contains(words), "{text}");
    Ok(())
}

/// A job of one rank, started without a launcher.
fn single() -> Check<String> {
    not_initialized(dist::rank().unwrap_err(), "call tensorshare::dist::init() first")?;
    let session = dist::init().ctx("init")?;
    ensure!(dist::rank().ctx("rank")? == 0, "the rank of a job of one");
    let topo = dist::topology().ctx("topology")?;
    ensure!(topo.world_size() == 1 && topo.rank() == 0 && topo.nodes().len() == 1, "{topo:?}");
    let mut t = Tensor::from_vec(vec![1.5f32, -2.0, 3.0], &[3]).ctx("tensor")?;
    for op in [dist::ReduceOp::Sum, dist::ReduceOp::Mean, dist::ReduceOp::Max] {
        dist::all_reduce(&mut t, op).ctx("all_reduce")?;
        ensure!(
            t.to_vec::<f32>().ctx("values")? == vec![1.5, -2.0, 3.0],
            "{op:?} of one rank is the identity"
        );
    }
    dist::broadcast(&mut t, 0).ctx("broadcast")?;
    let all = dist::all_gather(&t).ctx("all_gather")?;
    ensure!(all.len() == 1 && all[0].equal(&t), "all_gather of one rank");
    dist::barrier().ctx("barrier")?;
    let e = dist::send(&1u8, 0).unwrap_err();
    ensure!(matches!(e, Error::InvalidArgument { .. }) && e.to_string().contains("is this rank"), "{e}");
    let e = dist::recv::<u8>(1).unwrap_err();
    ensure!(e.to_string().contains("rank 1 in a job of 1 ranks"), "{e}");
    drop(session);
    not_initialized(dist::barrier().unwrap_err(), "session ended")?;
    not_initialized(dist::init().unwrap_err(), "cannot start again")?;
    Ok("a job of one rank".into())
}

/// Rank 2 kills itself while the others wait on it: in a receive through the queue rank 2
/// made for the pair (rank 1), in a receive on the pair's socket (rank 3, to which rank 2
/// never sent) and in a collective (rank 0). Each must name rank 2, and stay broken.
///
/// With `leave_fork`, rank 2 first forks a child that holds its sockets and queues open and
/// outlives it (until the launcher that started rank 2 ends): its death must be seen all
/// the same. Rank 0 forks such a child too, and rank 3 waits in a receive through the queue
/// rank 0 made for the pair instead: rank 0 leaves the process group when its collective
/// fails, and stays alive until rank 3 has ended, so only its departure can tell rank 3.
fn dies(leave_fork: bool) -> Check<String> {
    let _session = dist::init().ctx("init")?;
    let rank = dist::rank().ctx("rank")?;
    ensure!(dist::world_size().ctx("size")? == 4, "this scenario runs on 4 ranks");
    // Rank 2 has sent to rank 1 once: rank 1 then waits in the queue rank 2 made for the
    // pair. Rank 1 also sends rank 2 values it will never receive: once rank 1 knows rank 2
    // is gone, it must not wait to write them out (rank 2's fork holds the queue on).
    let mut rank_3 = None;
    match rank {
        2 => dist::send(&7u64, 1).ctx("send to rank 1")?,
        1 => {
            ensure!(dist::recv::<u64>(2).ctx("recv from rank 2")? == 7, "rank 2's value");
            dist::send(&8u64, 2).ctx("a small value to rank 2")?;
            dist::send(&Tensor::zeros(&[300_000], DType::F32), 2).ctx("a large value to rank 2")?;
        }
        0 if leave_fork => {
            dist::send(&9u64, 3).ctx("send to rank 3")?;
            rank_3 = Some(dist::recv::<i32>(3).ctx("rank 3's pid")?);
            leave_a_fork()?;
        }
        3 if leave_fork => {
            ensure!(dist::recv::<u64>(0).ctx("recv from rank 0")? == 9, "rank 0's value");
            dist::send(&(std::process::id() as i32), 0).ctx("send the pid")?;
        }
        _ => {}
    }
    dist::barrier().ctx("barrier")?;
    let e = match rank {
        2 => {
            if leave_fork {
                leave_a_fork()?;
            }
            // SAFETY: kill has no memory preconditions; the process ends here.
            unsafe { libc::kill(libc::getpid(), libc::SIGKILL) };
            return Err("still alive after SIGKILL".into());
        }
        3 if leave_fork => dist::recv::<u64>(0).map(|_| ()).unwrap_err(),
        1 | 3 => dist::recv::<u64>(2).map(|_| ()).unwrap_err(),
        _ => {
            let e = dist::all_reduce(&mut Tensor::zeros(&[16], DType::F32), dist::ReduceOp::Sum).unwrap_err();
            if let Some(pid) = rank_3 {
                wait_for_end(pid)?;
            }
            e
        }
    };
    ensure!(matches!(&e, Error::Dist(DistError::RankGone { rank: 2, .. })), "{e}");
    let again = dist::barrier().unwrap_err();
    ensure!(again.to_string() == e.to_string(), "later calls return the same error: {again}");
    Ok(format!("saw {e}"))
}
