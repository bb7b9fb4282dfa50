//! A queue's outbox: what this process put that the socket could not take yet.
//!
//! A socket holds a few hundred records. So that `put` on an unbounded queue never waits
//! ("fill the task queue, then start the workers"), records that do not fit wait here, in
//! order, and a feeder thread writes them out as consumers make room (Python's
//! `multiprocessing.Queue` works the same way). While the outbox has records, new ones
//! queue behind them, so each producer's values arrive in the order it put them.
//!
//! The records keep what they hold (descriptors, and with them their slots) until they are
//! written. The last handle of the queue in a process waits, when dropped, until the
//! outbox is written out, as long as another process holds the queue and could read it.
//! A forked child does not own the outbox it inherits: it writes directly, waiting for room,
//! or, once it has adopted its queues, puts through an outbox of its own (see `forked`).

use std::collections::VecDeque;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::Duration;

use rustix::event::PollFlags;
use rustix::io::Errno;

use super::control::Control;
use super::feed::{crowded_backoff, wait_for, FeedError};
use super::forked::{self, adopted};
use super::frame::Outgoing;
use super::socket::{self, Deadline};
use crate::util::fork_mutex::ForkMutex;
use crate::util::lock;
use crate::{Error, Result};

/// Whether a reader of the queue can still exist.
pub(crate) type Alive = Arc<dyn Fn() -> bool + Send + Sync>;
/// Whether a record may be written now: false while lane messages it must not overtake
/// are still waiting to be taken (see `queue_lane`).
pub(crate) type Gate = Arc<dyn Fn() -> bool + Send + Sync>;

pub(crate) struct Outbox {
    /// The process whose outbox this is.
    pid: i32,
    /// Rung after each record written (see `Control::ring`).
    control: Arc<Control>,
    state: Mutex<State>,
    written: Condvar,
    /// Records of this process may still wait in the socket: set after each write, and
    /// cleared by `in_socket` once the socket is seen empty.
    in_socket: AtomicBool,
    /// One look at the socket at a time (see `in_socket`); a forked child without an outbox
    /// of its own looks through this one, with a lock of its own (see `ForkMutex`).
    pub(super) looking: ForkMutex<()>,
}

#[derive(Default)]
struct State {
    records: VecDeque<(Outgoing, Option<Gate>)>,
    /// A feeder thread runs (it may hold the front record outside the lock).
    feeding: bool,
    /// The feeder holds a record it has not written yet.
    in_hand: bool,
    /// Why the feeder gave up: every record since is refused with it.
    failed: Option<FeedError>,
    /// The last handle went with nobody left to read: the feeder drops what it holds.
    abandoned: bool,
    /// The process leaves without waiting for what it did not write (`leave_unwritten`).
    leaving: bool,
}

impl Outbox {
    pub(crate) fn new(control: Arc<Control>) -> Outbox {
        Outbox {
            pid: getpid(),
            control,
            state: Mutex::new(State::default()),
            written: Condvar::new(),
            in_socket: AtomicBool::new(false),
            looking: ForkMutex::default(),
        }
    }

    pub(super) fn own(&self) -> bool {
        self.pid == getpid()
    }

    /// For an outbox this process inherited by `fork` (not its own): the one it made in its
    /// place, if it has made one (see `forked`).
    fn mine(&self) -> Option<Arc<Outbox>> {
        forked::mine(self as *const Outbox as usize)
    }

    /// As `mine`, made now if there is none yet.
    fn make_mine(&self) -> Arc<Outbox> {
        forked::make_mine(self as *const Outbox as usize, || Outbox::new(self.control.clone()))
    }

    fn state(&self) -> MutexGuard<'_, State> {
        lock(&self.state)
    }

    /// Whether records of this process are still on their way (a reader may wait for them).
    pub(crate) fn pending(&self) -> bool {
        if !self.own() {
            return self.mine().is_some_and(|o| o.pending());
        }
        let st = self.state();
        st.feeding || !st.records.is_empty()
    }

    /// Whether a record this process wrote may still wait in the socket whose reading end is
    /// `rx` (looked at only if it wrote one since the socket was last seen empty).
    pub(crate) fn in_socket(&self, rx: BorrowedFd<'_>) -> bool {
        if !self.own() {
            if let Some(o) = self.mine() {
                return o.in_socket(rx);
            }
            // A forked child without an outbox of its own writes directly, through this one
            // (`put`): its flag is this one's.
        }
        // One look at a time: while one thread has cleared the flag to look, another must
        // not take it for an answer.
        let _one = self.looking.lock();
        // Cleared before the look: a record written after the look sets it again.
        if !self.in_socket.swap(false, Ordering::SeqCst) {
            return false;
        }
        let waiting = socket::wait(rx, PollFlags::IN, Duration::ZERO).unwrap_or(true);
        if waiting {
            self.in_socket.store(true, Ordering::SeqCst);
        }
        waiting
    }

    /// One try at writing `out`, announced to receivers first (see `Control::records`).
    fn write(&self, tx: &OwnedFd, out: &Outgoing) -> rustix::io::Result<()> {
        self.control.record_coming();
        socket::send_record(tx.as_fd(), out.parts(), &out.fds()).inspect_err(|_| self.control.record_gone())
    }

    /// A record is in the socket now.
    fn wrote(&self) {
        self.in_socket.store(true, Ordering::SeqCst);
        self.control.ring();
    }

    /// How many records of this process wait to be written.
    pub(crate) fn waiting(&self) -> usize {
        if !self.own() {
            return self.mine().map_or(0, |o| o.waiting());
        }
        let st = self.state();
        st.records.len() + usize::from(st.in_hand)
    }

    /// Sends `out` now if the socket has room and nothing of ours waits before it;
    /// otherwise queues it for the feeder. Never waits for room.
    ///
    /// `alive` makes the test of whether a reader can still exist (a handle in this process,
    /// or another process holding the queue), asked while a write waits; it is made only
    /// then, not on every put.
    pub(crate) fn put(
        self: &Arc<Outbox>,
        tx: &Arc<OwnedFd>,
        mut out: Outgoing,
        alive: impl FnOnce() -> Alive,
        gate: Option<Gate>,
    ) -> Result<()> {
        if !self.own() {
            // A forked child: its parent's records and feeder are not its own.
            if adopted() {
                return self.make_mine().put(tx, out, alive, gate);
            }
            // One that has not promised to flush before its `_exit`: write directly, waiting,
            // so that nothing it put waits in this process when it goes.
            let alive = alive();
            if !wait_for(gate.as_ref(), &*alive, &|| false) {
                return Err(Error::Disconnected);
            }
            self.control.record_coming();
            socket::send_outgoing(tx.as_fd(), out, Deadline::after(None), &*alive)
                .inspect_err(|_| self.control.record_gone())?;
            self.wrote();
            return Ok(());
        }
        let mut st = self.state();
        match &st.failed {
            Some(FeedError::Disconnected) => return Err(Error::Disconnected),
            Some(FeedError::Failed(context, code)) => {
                let source = code.map_or_else(
                    || std::io::Error::other(context.clone()),
                    std::io::Error::from_raw_os_error,
                );
                return Err(Error::io(
                    format!(
                        "a value put earlier on this queue could not be written out ({context}); it and the \
                         values this process put after it were dropped"
                    ),
                    source,
                ));
            }
            Some(FeedError::NoThread) | None => {}
        }
        if st.records.is_empty() && !st.feeding && gate.as_ref().is_none_or(|g| g()) {
            loop {
                match self.write(tx, &out) {
                    Ok(()) => {
                        self.wrote();
                        drop(st);
                        return Ok(());
                    }
                    // No room, or too many descriptors in flight (the kernel's cap per user,
                    // RLIMIT_NOFILE): both clear as readers take records.
                    Err(Errno::AGAIN) | Err(Errno::TOOMANYREFS) => break,
                    Err(Errno::MSGSIZE) if !out.is_spilled() => out.spill()?,
                    Err(Errno::PIPE) | Err(Errno::CONNRESET) | Err(Errno::NOTCONN) => {
                        return Err(Error::Disconnected)
                    }
                    Err(e) => return Err(Error::io("sendmsg", e)),
                }
            }
        }
        st.records.push_back((out, gate));
        if !st.feeding {
            let (me, tx, alive) = (self.clone(), tx.clone(), alive());
            let spawned = std::thread::Builder::new()
                .name("tensorshare-feed".into())
                .spawn(move || me.feed(&tx, &*alive));
            match spawned {
                Ok(_) => st.feeding = true,
                Err(e) => {
                    st.records.pop_back();
                    st.failed = Some(FeedError::NoThread);
                    return Err(Error::io("starting a queue's feeder thread", e));
                }
            }
        }
        Ok(())
    }

    /// The feeder: writes the records out in order, waiting for room, until none is left,
    /// or no process that could read them is left (then they are dropped, which gives back
    /// what they held).
    fn feed(&self, tx: &OwnedFd, alive: &(dyn Fn() -> bool + Send + Sync)) {
        loop {
            let popped = {
                let mut st = self.state();
                let out = st.records.pop_front();
                st.in_hand = out.is_some();
                out
            };
            let Some((mut out, gate)) = popped else {
                let mut st = self.state();
                if st.records.is_empty() {
                    st.feeding = false;
                    self.written.notify_all();
                    return;
                }
                continue;
            };
            let abandoned = || self.state().abandoned;
            let mut crowded = Duration::ZERO;
            let sent = if !wait_for(gate.as_ref(), alive, &abandoned) {
                Err(FeedError::Disconnected)
            } else {
                loop {
                    match self.write(tx, &out) {
                        Ok(()) => {
                            // Counted (by the ring) before it stops counting as in hand.
                            self.wrote();
                            self.state().in_hand = false;
                            break Ok(());
                        }
                        Err(Errno::AGAIN) => crowded = Duration::ZERO,
                        Err(Errno::TOOMANYREFS) => crowded = crowded_backoff(crowded),
                        Err(Errno::MSGSIZE) if !out.is_spilled() => match out.spill() {
                            Ok(()) => continue,
                            Err(e) => break Err(FeedError::failed(&e)),
                        },
                        Err(Errno::PIPE) | Err(Errno::CONNRESET) | Err(Errno::NOTCONN) => {
                            break Err(FeedError::Disconnected)
                        }
                        Err(e) => break Err(FeedError::failed(&Error::io("sendmsg", e))),
                    }
                    let ready = if crowded.is_zero() {
                        socket::wait(tx.as_fd(), PollFlags::OUT, Duration::from_millis(50)).unwrap_or(false)
                    } else {
                        // The socket may have room: descriptors in flight must go first.
                        std::thread::sleep(crowded);
                        false
                    };
                    if !ready && (abandoned() || !alive()) {
                        break Err(FeedError::Disconnected);
                    }
                }
            };
            if let Err(why) = sent {
                let mut st = self.state();
                st.in_hand = false;
                st.records.clear();
                st.failed = Some(why);
                st.feeding = false;
                self.written.notify_all();
                return;
            }
        }
    }

    /// Waits until what this process put is written out, while another process holds the
    /// queue (otherwise nobody could ever read it, and the records go).
    pub(crate) fn flush_at_drop(&self) {
        if self.own() {
            return self.flush_while(&|| true);
        }
        // The queue goes from this forked child: so does the outbox it made for it (which
        // holds the queue's control block open), once written.
        if let Some(o) = forked::take_mine(self as *const Outbox as usize) {
            o.flush_while(&|| true);
        }
    }

    /// As `flush_at_drop`, and the records go as soon as `readers` says that nobody who
    /// would read them is left (for a holder that knows more than the queue does: a
    /// process that died leaving a fork that holds the queue on).
    pub(crate) fn flush_while(&self, readers: &dyn Fn() -> bool) {
        let control = &self.control;
        if !self.own() {
            if let Some(o) = self.mine() {
                o.flush_while(readers);
            }
            return;
        }
        let mut st = self.state();
        if st.leaving {
            // The process goes without waiting (`leave_unwritten`): the feeder writes on
            // while it lives, as multiprocessing's does after `cancel_join_thread`.
            return;
        }
        while st.feeding || !st.records.is_empty() {
            if !st.feeding {
                break; // records with no feeder (it could not start): nothing will write them
            }
            if !control.others_alive() || !readers() {
                // Nobody can read them: they go, and so does what the feeder holds (a record
                // waiting for room or for its gate keeps its descriptors, and the queue's
                // socket, open), before this handle is gone.
                st.records.clear();
                st.abandoned = true;
                for _ in 0..40 {
                    if !st.feeding {
                        break;
                    }
                    st = self.wait_written(st);
                }
                break;
            }
            st = self.wait_written(st);
        }
    }

    /// See `Queue::cancel_join_thread`: this process's flushes of the queue stop waiting.
    pub(crate) fn leave_unwritten(&self) {
        if !self.own() {
            // A forked child that did not adopt the queue writes directly: nothing waits.
            if adopted() {
                self.make_mine().leave_unwritten();
            }
            return;
        }
        self.state().leaving = true;
    }

    /// Drops every record still waiting, and makes the feeder drop the one it holds:
    /// nobody will read them.
    #[cfg(feature = "mpi")]
    pub(crate) fn abandon(&self) {
        if !self.own() {
            if let Some(o) = self.mine() {
                o.abandon();
            }
            return;
        }
        let mut st = self.state();
        st.records.clear();
        st.abandoned = true;
    }

    /// Waits (at most 50 ms) for the feeder to write a record or to stop.
    fn wait_written<'a>(&self, st: MutexGuard<'a, State>) -> MutexGuard<'a, State> {
        self.written
            .wait_timeout(st, Duration::from_millis(50))
            .map(|(g, _)| g)
            .unwrap_or_else(|p| p.into_inner().0)
    }
}

fn getpid() -> i32 {
    crate::util::fork::pid()
}
