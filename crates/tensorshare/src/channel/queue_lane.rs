//! A queue's lane as its core uses it (see `lane`): which messages go there, how a producer
//! parks what holds them, how a consumer waits for the lane and the socket at once, and the
//! order of a process's messages across the two.
//!
//! Order: each process's values arrive in the order it put them, whichever way each went,
//! and after every value whose record another process wrote into the socket before the put
//! (a producer that was joined). A process sends through the lane only when no record of
//! any process may wait in the socket (the control block counts them), and through the
//! socket only once its own lane messages were taken (a record that would overtake one
//! waits in the outbox, whose feeder waits for that). Consumers look at the lane first. Not
//! promised: that another process's lane message published before a socket write comes
//! first, when a consumer's one look spans both (holding records back until the lane is
//! drained would make producers wait at exit for others' values to be taken).

use std::collections::HashSet;
use std::os::fd::{AsFd, OwnedFd};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use serde::de::DeserializeOwned;

use super::awake::watch;
use super::frame;
use super::lane::{directory, taken, Claim, Look, Ring, STUCK};
use super::outbox::Gate;
use super::queue_core::Core;
use super::socket::{self, Deadline, Received, SPIN};
use crate::shm::FileId;
use crate::wire::{self, Encoded};
use crate::{Error, Result};

#[path = "queue_lane_arenas.rs"]
mod arenas;
use arenas::{Borrowed, Taking};

/// How long a consumer waits with nothing arriving before it ends the lane's current
/// window early, so that what the window holds is given back (see `Ring::close_window`).
const QUIET: Duration = Duration::from_millis(10);
/// How long a producer waits for the lane directory's lock before it sends through the
/// socket instead (the lock is held for microseconds; a process stopped holding it, or a
/// hostile one, must not stop producers).
const PARK_PATIENCE: Duration = Duration::from_millis(5);
/// How long a consumer waits for it to find an arena a message it took names, before the
/// message is an error (it cannot be held, so it cannot be read).
const FETCH_PATIENCE: Duration = Duration::from_secs(1);
/// Most nudges one look drops before it says it found nothing.
const MAX_NUDGES: usize = 256;

/// What a process keeps about a queue's lane, for all its handles of the queue.
#[derive(Default)]
pub(super) struct LaneLocal {
    /// Send descriptions this process parked, with the latest window each was parked for.
    /// A `Weak` keeps the allocation, so a live description is never mistaken for another.
    parked: Vec<(Weak<OwnedFd>, u64)>,
    /// Arenas this queue's directory has shown this process: the only ones a lane message
    /// may name from this process's receive cache. (Device and inode numbers the kernel
    /// gave, of descriptors found in the directory: no peer picks them freely.)
    known: HashSet<FileId, std::hash::BuildHasherDefault<crate::util::FastHasher>>,
    /// Send descriptions found in the directory under a tag, whose holds this process
    /// borrows (see `arenas`).
    borrowed: Vec<Borrowed>,
    /// The position of this process's latest lane message.
    last: Option<u64>,
    /// The window of the latest lane message this process took, when it last let go of
    /// the borrowed descriptions of windows over (see `arenas::forget_old`): once per window.
    forgot_at: u64,
    /// A lane position seen claimed and unpublished: (position, sequence word, since when).
    stuck: Option<(u64, u64, Instant)>,
}

impl LaneLocal {
    fn parked_for(&self, desc: &Arc<OwnedFd>) -> Option<u64> {
        self.parked.iter().find(|(w, _)| w.as_ptr() == Arc::as_ptr(desc)).map(|&(_, k)| k)
    }

    fn note_parked(&mut self, desc: &Arc<OwnedFd>, window: u64) {
        if self.parked.len() >= 64 {
            self.parked.retain(|(w, _)| w.strong_count() > 0);
        }
        match self.parked.iter_mut().find(|(w, _)| w.as_ptr() == Arc::as_ptr(desc)) {
            Some(e) => e.1 = window,
            None => self.parked.push((Arc::downgrade(desc), window)),
        }
    }
}

impl Core {
    fn lane_ring(&self) -> Ring<'_> {
        self.control.lane()
    }

    /// Whether `msg` may go through the lane now: it has a lane form, nobody waits on the
    /// socket for values, and no record waits in this process's outbox or in the socket.
    pub(super) fn lane_may_take(&self, msg: &Encoded) -> bool {
        msg.lane.is_some() && !self.control.polled() && !self.outbox.pending() && !self.socket_may_hold()
    }

    /// Whether a record, this process's or another's, may wait in the socket. A zero count
    /// costs no syscall; any other is checked against the socket (a consumer that died
    /// between taking a record and counting it leaves the count high). This process's flag
    /// is asked too: a peer that lowers the count cannot reorder this process's values.
    fn socket_may_hold(&self) -> bool {
        let rx = self.rx.as_fd();
        self.outbox.in_socket(rx)
            || (self.control.may_have_records()
                && socket::wait(rx, rustix::event::PollFlags::IN, Duration::ZERO).unwrap_or(true))
    }

    /// Publishes `msg` in the lane. False when it cannot go there (the ring is full, the
    /// directory refused a hold, or a consumer skipped the position): it must go through
    /// the socket, and nothing of it is in the lane.
    pub(super) fn lane_put(&self, msg: &Encoded) -> bool {
        let Some(form) = &msg.lane else { return false };
        let ring = self.lane_ring();
        let mut l = self.lane.lock();
        let Claim::At(pos) = ring.claim() else { return false };
        ring.write(pos, &form.bytes);
        let window = Ring::window(pos);
        for a in &form.arenas {
            if l.parked_for(&a.desc).is_some_and(|k| k >= window) {
                continue;
            }
            let parked = self.control.with_directory(PARK_PATIENCE, || {
                self.take_out_over(ring);
                directory::park(self.rx.as_fd(), a.desc.as_fd(), window, a.id, a.tag, a.name.as_deref())
            });
            if !matches!(parked, Ok(Ok(()))) {
                ring.abandon(pos);
                return false;
            }
            l.note_parked(&a.desc, window);
        }
        if !ring.publish(pos) {
            return false;
        }
        l.last = Some(pos);
        drop(l);
        // Not counted in `queued`: the ring counts its own (see `Core::len`).
        self.control.bell().ring();
        if self.control.polled() {
            // Someone started waiting on the socket meanwhile (see `watch_socket`).
            self.nudge();
        }
        true
    }

    /// Lets go of the descriptions this process keeps from the lane's directory.
    pub(super) fn forget_borrowed(&self) {
        let kept = std::mem::take(&mut self.lane.lock().borrowed);
        drop(kept); // closed without the lock
    }

    /// Someone is about to wait on the socket for values: from now on messages go through
    /// the socket, and a nudge (a record without a message) stands for what the lane holds
    /// already. A producer that publishes in the lane after this looked at it sees the
    /// flag and nudges too (both sides' steps are sequentially consistent).
    pub(super) fn watch_socket(&self) {
        if !self.control.polled() {
            self.control.set_polled();
        }
        if !self.lane_ring().is_empty() {
            self.nudge();
        }
    }

    /// Writes a nudge into the socket (announced as any record is).
    fn nudge(&self) {
        self.control.record_coming();
        if !frame::nudge(self.tx.as_fd()) {
            self.control.record_gone();
        }
    }

    /// Before a record goes into the socket: the gate it must wait for, if this process
    /// has lane messages not taken yet.
    pub(super) fn socket_gate(&self) -> Option<Gate> {
        let mut l = self.lane.lock();
        let last = l.last?;
        if taken(self.lane_ring().head(), last) {
            l.last = None;
            return None;
        }
        let control = self.control.clone();
        Some(Arc::new(move || taken(control.lane().head(), last)))
    }

    /// Takes out of the directory the entries of windows that are over. Under its lock.
    fn take_out_over(&self, ring: Ring<'_>) {
        let _ =
            directory::take_out_over(self.tx.as_fd(), ring.first_open_window(), Ring::window(ring.tail()));
    }

    /// Ends the lane's window if the lane is idle, and takes out what is over: what the
    /// lane held is given back, as are the descriptions this process borrowed from it.
    pub(super) fn close_idle_window(&self) {
        self.forget_borrowed();
        let ring = self.lane_ring();
        let _ = self.control.with_directory(Duration::ZERO, || {
            ring.close_window();
            self.take_out_over(ring);
        });
    }

    /// A message taken from the lane at `pos`, into a value. The position is done with
    /// (and the window may end) only once this process holds what the message names.
    fn take_lane<T: DeserializeOwned>(
        &self,
        pos: u64,
        bytes: std::result::Result<Vec<u8>, usize>,
    ) -> Result<T> {
        struct Done<'a>(Ring<'a>, u64);
        impl Drop for Done<'_> {
            fn drop(&mut self) {
                self.0.done(self.1);
            }
        }
        let _done = Done(self.lane_ring(), pos);
        {
            let mut l = self.lane.lock();
            let window = Ring::window(pos);
            if window != l.forgot_at {
                l.forgot_at = window;
                arenas::forget_old(&mut l.borrowed, window);
            }
        }
        self.control.release();
        let bytes =
            bytes.map_err(|n| Error::invalid(format!("a lane message of {n} bytes, more than a cell")))?;
        let value = wire::decode_lane(&bytes, &Taking { core: self, window: Ring::window(pos) });
        super::lane::give_back(bytes);
        value
    }

    /// One look at the lane, then the socket (unless `sure` is false and no record is said
    /// to wait there): a value (or the error of a bad message) if either had one.
    /// `waiting` says whether the lane's next position is claimed and not published yet.
    fn look<T: DeserializeOwned>(&self, waiting: &mut bool, sure: bool) -> Result<Option<Result<T>>> {
        let ring = self.lane_ring();
        *waiting = false;
        for _ in 0..2 {
            match ring.take() {
                Look::Took { pos, bytes } => return Ok(Some(self.take_lane(pos, bytes))),
                Look::Waiting { pos, seq } if self.stuck_for_long(pos, seq) => ring.skip(pos, seq),
                Look::Waiting { .. } => {
                    *waiting = true;
                    break;
                }
                Look::Empty => break,
            }
        }
        if !sure && !self.control.may_have_records() {
            return Ok(None);
        }
        // Nudges are dropped; the lane message one stands for may have been published
        // after the look above, so the lane is looked at again once one was dropped (a
        // process waiting on the socket would otherwise sleep with it there).
        let mut nudged = false;
        for _ in 0..MAX_NUDGES {
            match socket::try_recv(self.rx.as_fd())? {
                Received::Record(r) if frame::is_nudge(&r) => {
                    self.control.record_gone();
                    nudged = true;
                }
                Received::Record(r) => return Ok(Some(self.take(Ok(r)))),
                Received::Bad(e) => return Ok(Some(self.take(Err(e)))),
                Received::Closed => return Err(Error::Disconnected),
                Received::Empty => break,
            }
        }
        if nudged {
            if let Look::Took { pos, bytes } = ring.take() {
                return Ok(Some(self.take_lane(pos, bytes)));
            }
        }
        Ok(None)
    }

    /// Whether the lane's position `pos` has been seen claimed and unpublished (sequence word
    /// `seq`) for `STUCK`, by any look of this process: its producer is taken for dead.
    fn stuck_for_long(&self, pos: u64, seq: u64) -> bool {
        let mut l = self.lane.lock();
        match l.stuck {
            Some((p, s, since)) if p == pos && s == seq => since.elapsed() >= STUCK,
            _ => {
                l.stuck = Some((pos, seq, Instant::now()));
                false
            }
        }
    }

    /// Waits for a value in the lane or the socket until the deadline: polling awake for
    /// as long as this queue's patience says, then asleep on the queue's bell, which both
    /// ways of sending ring.
    pub(super) fn get<T: DeserializeOwned>(self: &Arc<Core>, deadline: Deadline) -> Result<T> {
        super::ready_to_receive()?;
        let awake = self.control.awake();
        let bell = awake.bell;
        let mut waiting = false;
        // Once a look found nothing: when, until when to poll, and when to start yielding
        // (no clock is read before that: a value already there is returned without).
        let mut empty_since: Option<(Instant, Instant, Instant)> = None;
        // The latest reading of the clock while polling (none after a sleep).
        let mut seen: Option<Instant> = None;
        let mut closed = false;
        // The socket is looked at when the count of its records says one may be there, and
        // after every sleep whatever the count says. Honest writers count a record before
        // writing it and ring after, so only a peer that writes uncounted records or lowers
        // the count delays records (its own and those behind it) by the polling window and
        // one sleep of at most `QUIET`, and a get whose deadline passes within the window
        // (a zero timeout) may miss them, where `try_get` would not. Looking for sure at
        // first would cost a `recvmsg` on every receive that finds the lane empty.
        let mut sure = false;
        loop {
            // Read before looking: a message sent after the look rings after this read.
            let rung = bell.rung();
            if let Some(v) = self.look(&mut waiting, std::mem::take(&mut sure))? {
                if let Some((since, ..)) = empty_since {
                    // A wait caught while polling ended less than a batch of looks after
                    // the last reading (see `watch`): close enough for the window, and one
                    // reading fewer on the way to the value.
                    let end = seen.unwrap_or_else(Instant::now);
                    awake.patience.learn(end.saturating_duration_since(since));
                }
                return v;
            }
            let (since, spin_until, yield_after, now) = match empty_since {
                Some((since, spin_until, yield_after)) => (since, spin_until, yield_after, Instant::now()),
                None => {
                    // Nothing yet: time for what the last receive left for later (see
                    // `socket::recv_taken`).
                    crate::arena::idle();
                    let s = Instant::now();
                    let until = if bell.sender_shares_this_cpu() { s } else { s + awake.patience.window() };
                    empty_since = Some((s, until, s + SPIN));
                    (s, until, s + SPIN, s)
                }
            };
            seen = Some(now);
            if now < spin_until && !deadline.passed(now) {
                seen = watch(bell, rung, spin_until, yield_after, deadline).or(seen);
                continue;
            }
            let Some(slice) = deadline.slice() else { return Err(Error::Timeout) };
            let nap = match (waiting, closed) {
                (true, _) => slice.min(STUCK / 4),
                (false, false) => slice.min(QUIET),
                (false, true) => slice,
            };
            bell.sleep(rung, nap);
            seen = None;
            sure = true;
            if bell.rung() != rung {
                continue;
            }
            self.control.watch_lost_places(rung, || self.drained());
            if !closed && since.elapsed() >= QUIET {
                self.close_idle_window();
                // Nothing this process borrowed from any lane is kept through a long wait.
                super::queue_core::forget_borrowed();
                closed = true;
            }
            if !waiting && !self.others() {
                // A message may have come just before the last sender went away.
                return match self.look(&mut waiting, true)? {
                    Some(v) => v,
                    None => Err(Error::Disconnected),
                };
            }
        }
    }

    /// A value if one waits in the lane or the socket now (never waits).
    pub(super) fn try_get<T: DeserializeOwned>(self: &Arc<Core>) -> Result<Option<T>> {
        super::ready_to_receive()?;
        let mut waiting = false;
        if let Some(v) = self.look(&mut waiting, true)? {
            return v.map(Some);
        }
        if waiting && self.control.polled() {
            // One waiting on the descriptor must come back until the claim is published or
            // skipped: the nudge that woke it is gone.
            self.nudge();
        }
        if self.others() {
            return Ok(None);
        }
        // Alone: nothing more can come, but a message may have arrived just now.
        match self.look(&mut waiting, true)? {
            Some(v) => v.map(Some),
            None => Err(Error::Disconnected),
        }
    }
}

#[cfg(test)]
#[path = "queue_lane_tests.rs"]
mod tests;
