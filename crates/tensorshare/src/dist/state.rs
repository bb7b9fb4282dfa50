//! The process group's state, kept by the thread that called `init` (MPI is initialised
//! as `MPI_THREAD_FUNNELED`: only that thread calls it), and the [`Session`] that ends it.
//!
//! A failure after the ranks have agreed on a collective, or a rank gone, breaks the group:
//! this rank closes its sockets to the node's other ranks (so none of them waits for it in
//! vain) and every later call returns the error that broke it.

use std::cell::RefCell;
use std::marker::PhantomData;
use std::sync::atomic::{AtomicU32, AtomicU8, Ordering};
use std::sync::Arc;

use mpi::environment::Universe;
use mpi::topology::{Color, Communicator, SimpleCommunicator};
use mpi::Threading;

use super::links::{self, NodeLinks};
use super::topology::{self, Topology};
use super::{rendezvous, DistError};
use crate::util::Lazy;
use crate::{Error, Result};

/// Where this process stands: never initialised, running, ended, or failed to start.
static PHASE: AtomicU8 = AtomicU8::new(NEVER);
const NEVER: u8 = 0;
const RUNNING: u8 = 1;
const ENDED: u8 = 2;
const FAILED: u8 = 3;
/// The process that initialised MPI (a fork of it is no rank).
static PID: AtomicU32 = AtomicU32::new(0);
/// The topology, readable from any thread of the rank.
static TOPOLOGY: Lazy<Arc<Topology>> = Lazy::new();

thread_local! {
    static STATE: RefCell<Option<State>> = const { RefCell::new(None) };
}

/// The group as this rank sees it.
pub(super) struct State {
    pub(super) topo: Arc<Topology>,
    /// A copy of the world communicator, for `send` and `recv` between nodes.
    pub(super) world: SimpleCommunicator,
    /// On a node's leader, when there are several nodes: the leaders, by node.
    pub(super) leaders: Option<SimpleCommunicator>,
    /// Collectives started (their parity picks the board's set).
    pub(super) seq: u64,
    /// `None` once the group is broken.
    links: Option<NodeLinks>,
    broken: Option<DistError>,
    mpi: Mpi,
}

/// MPI itself: finalised only by [`Session`]'s drop, never by the drop of a thread's state.
struct Mpi(Option<Universe>);

impl Drop for Mpi {
    fn drop(&mut self) {
        // MPI_Finalize waits for every rank: only a session that ends cleanly calls it.
        std::mem::forget(self.0.take());
    }
}

impl State {
    /// The node's links, or the error that broke the group.
    pub(super) fn links(&self) -> Result<&NodeLinks> {
        match (&self.links, &self.broken) {
            (Some(l), None) => Ok(l),
            (_, Some(e)) => Err(e.clone().into()),
            (None, None) => Err(DistError::Broken("the process group has no links".into()).into()),
        }
    }

    /// Which of the board's two sets the next collective uses.
    pub(super) fn set(&self) -> usize {
        (self.seq % 2) as usize
    }

    /// The board's barrier among the node's ranks, which fails when one of them is gone.
    pub(super) fn barrier(&self, during: &str) -> Result<()> {
        let links = self.links()?;
        links.board.barrier(&mut || links.check_alive(&self.topo, during))
    }

    /// Leaves the process group because of `e`: closes this rank's sockets to its node.
    fn break_with(&mut self, e: &Error, during: &str) {
        let why = match e {
            Error::Dist(d) => d.clone(),
            e => {
                DistError::Broken(format!("{during} failed on this rank, which left the process group: {e}"))
            }
        };
        if let Some(links) = &self.links {
            let me = self.topo.local_rank();
            let cause = match &why {
                DistError::RankGone { rank, .. } => self.topo.local_index(*rank).unwrap_or(me),
                _ => me,
            };
            links.board.depart(me, cause);
            // What this rank sent and nobody received will not be: it goes now, without
            // waiting for receivers that may never come.
            links.abandon_routes();
        }
        self.broken.get_or_insert(why);
        self.links = None;
    }
}

/// Runs a collective: any failure but one the ranks agreed on breaks the group.
pub(super) fn collective<R>(during: &str, f: impl FnOnce(&mut State) -> Result<R>) -> Result<R> {
    with(|st| {
        let r = f(st);
        if let Err(e) = &r {
            if !matches!(e, Error::Dist(DistError::Mismatch { .. } | DistError::Refused { .. })) {
                st.break_with(e, during);
            }
        }
        r
    })
}

/// Runs a `send` or `recv`: a rank gone, or a pair that cannot carry values any more,
/// breaks the group; other failures do not.
pub(super) fn point_to_point<R>(during: &str, f: impl FnOnce(&mut State) -> Result<R>) -> Result<R> {
    with(|st| {
        let r = f(st);
        if let Err(e) = &r {
            if links::is_gone(e) || matches!(e, Error::Dist(DistError::Broken(_))) {
                st.break_with(e, during);
            }
        }
        r
    })
}

/// This process's id, without a system call each time (every call of `dist` asks).
fn this_pid() -> u32 {
    crate::util::fork::pid() as u32
}

fn not_initialized(why: impl Into<String>) -> Error {
    DistError::NotInitialized(why.into()).into()
}

/// Whether this process may use the group (see [`DistError::NotInitialized`]).
fn check_process() -> Result<()> {
    match PHASE.load(Ordering::Acquire) {
        NEVER if crate::process::is_worker() => Err(not_initialized(
            "this process is a tensorshare worker (spawn, Pool), not an MPI rank: call dist in the rank \
             that started it, and pass values between them through queues or pipes",
        )),
        NEVER => Err(not_initialized(
            "call tensorshare::dist::init() first, in a program started by mpirun (or alone: a job of one rank)",
        )),
        ENDED => Err(not_initialized("its session ended: dropping the dist::Session finalised MPI")),
        FAILED => Err(not_initialized("dist::init() failed in this process, which cannot take part")),
        _ if PID.load(Ordering::Relaxed) != this_pid() => Err(not_initialized(format!(
            "this process is a fork of the rank (pid {}): only the rank itself talks to the other ranks",
            PID.load(Ordering::Relaxed)
        ))),
        _ => Ok(()),
    }
}

/// Runs `f` on this thread's state.
fn with<R>(f: impl FnOnce(&mut State) -> Result<R>) -> Result<R> {
    check_process()?;
    STATE.with(|cell| {
        let Ok(mut guard) = cell.try_borrow_mut() else {
            return Err(not_initialized("dist was called from inside a dist call (by a value's Serialize?)"));
        };
        let Some(st) = guard.as_mut() else {
            return Err(not_initialized(
                "this is not the thread that called dist::init(): MPI runs on that thread only \
                 (MPI_THREAD_FUNNELED)",
            ));
        };
        if let Some(e) = &st.broken {
            return Err(e.clone().into());
        }
        f(st)
    })
}

/// The topology, from any thread of the rank.
pub(super) fn topology() -> Result<Arc<Topology>> {
    check_process()?;
    TOPOLOGY.get().cloned().ok_or_else(|| not_initialized("dist::init() has not finished"))
}

/// While it lives, this process is a rank of the job and the functions of
/// [`dist`](crate::dist) work on the thread that made it. Dropping it ends the process
/// group and finalises MPI (torch's `destroy_process_group`), a collective step: every
/// rank drops its session. The node's other ranks see this rank leave at once: one that
/// waits for it (in a `recv`, a collective, or a `send` to it) fails with
/// [`DistError::RankGone`] naming it. Values it sent that are still on their way (a large
/// one behind small ones not yet received) are written first, while their receiver has
/// not ended or left; while the thread panics they are dropped. After a failure that broke
/// the group, or while the thread panics, the drop does not finalise MPI (that would wait
/// for ranks that are gone): the process exits without, which `mpirun` reports.
#[must_use = "dropping the session ends MPI: keep it as long as the program uses dist"]
pub struct Session {
    /// MPI runs on the thread that initialised it: the session stays there.
    _thread: PhantomData<*const ()>,
}

impl std::fmt::Debug for Session {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Session").finish_non_exhaustive()
    }
}

impl Drop for Session {
    fn drop(&mut self) {
        let Some(st) = STATE.with(|cell| cell.try_borrow_mut().ok().and_then(|mut s| s.take())) else {
            return;
        };
        PHASE.store(ENDED, Ordering::Release);
        let State { links, world, leaders, broken, mut mpi, .. } = st;
        // Communicators are freed, and sockets closed, before MPI ends.
        drop((links, world, leaders));
        if broken.is_none() && !std::thread::panicking() {
            drop(mpi.0.take()); // MPI_Finalize
        }
    }
}

/// `dist::init`: see there.
pub(super) fn init() -> Result<Session> {
    if crate::process::is_worker() {
        check_process()?;
    }
    match PHASE.load(Ordering::Acquire) {
        NEVER => {}
        RUNNING if PID.load(Ordering::Relaxed) == this_pid() => {
            return Err(not_initialized("dist::init() was called twice: a process is one rank, once"))
        }
        ENDED | FAILED => {
            return Err(not_initialized("MPI has ended in this process and cannot start again"))
        }
        _ => check_process()?,
    }
    let Some((universe, _threading)) = mpi::initialize_with_threading(Threading::Funneled) else {
        return Err(not_initialized(
            "MPI was initialised by other code of this process: let tensorshare::dist::init() initialise it",
        ));
    };
    // From here on, a failure leaves MPI initialised and unfinalised: finalising would wait
    // for ranks in another state. The process cannot take part, and exits without.
    PHASE.store(FAILED, Ordering::Release);
    let mpi = Mpi(Some(universe));
    let world_comm = SimpleCommunicator::world();
    let rank = world_comm.rank();
    let local = world_comm.split_shared(rank);
    let leader = local.rank() == 0;
    let leaders = world_comm.split_by_color(if leader { Color::with_value(0) } else { Color::undefined() });
    let topo = Arc::new(topology::build(&world_comm, &local, leaders.as_ref())?);
    let links = rendezvous::connect(&local, &topo)?;
    drop(local);
    let leaders = if topo.nodes().len() > 1 { leaders } else { None };
    let world = world_comm.duplicate();
    let _ = TOPOLOGY.set(topo.clone());
    PID.store(this_pid(), Ordering::Relaxed);
    STATE.with(|cell| {
        *cell.borrow_mut() =
            Some(State { topo, world, leaders, seq: 0, links: Some(links), broken: None, mpi });
    });
    PHASE.store(RUNNING, Ordering::Release);
    Ok(Session { _thread: PhantomData })
}
