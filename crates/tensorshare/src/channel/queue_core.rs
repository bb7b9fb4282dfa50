//! The state a process keeps for one queue, shared by all its handles there: the socket
//! ends, the control block, the outbox, and how a queue crosses in a message.

use std::collections::HashMap;
use std::os::fd::{AsFd, OwnedFd};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use serde::de::DeserializeOwned;
use serde::{Deserialize, Deserializer, Serialize, Serializer};

use super::control::Control;
use super::err::SendError;
use super::frame::{self, Outgoing};
use super::outbox::Outbox;
use super::queue_lane::LaneLocal;
use super::socket::{self, Deadline};
use crate::util::fork_mutex::ForkMutex;
use crate::util::lock;
use crate::wire::{self, FdSource};
use crate::{Error, Result};

/// The process-wide state of one queue: its two socket ends, its control block and this
/// process's outbox. Every handle of the queue in this process shares it.
pub(crate) struct Core {
    /// Producers write here (its own receive queue is the lane's directory).
    pub(super) tx: Arc<OwnedFd>,
    /// Consumers read here.
    pub(super) rx: Arc<OwnedFd>,
    pub(super) control: Arc<Control>,
    pub(super) outbox: Arc<Outbox>,
    /// Held while a thread waits on the lane's directory (with Python's GIL released): a
    /// child forked meanwhile locks one of its own (see `ForkMutex`).
    pub(super) lane: ForkMutex<LaneLocal>,
}

impl Drop for Core {
    fn drop(&mut self) {
        self.outbox.flush_at_drop();
        // What the lane's last window holds need not wait for more traffic.
        self.close_idle_window();
    }
}

type Registry = Mutex<HashMap<(u64, u64), Weak<Core>>>;

static REGISTRY: crate::util::Lazy<Registry> = crate::util::Lazy::new();

crate::util::fork::guard_at_load!(crate::util::fork::Rank::Channel, |out| out
    .push(Box::new(lock(registry()))));

fn registry() -> &'static Registry {
    REGISTRY.get_or_make(Mutex::default)
}

/// See `channel::close_idle_lanes`.
pub(crate) fn close_idle_lanes() {
    let cores: Vec<Arc<Core>> = lock(registry()).values().filter_map(Weak::upgrade).collect();
    for core in cores {
        core.close_idle_window();
    }
}

/// Lets go of the descriptions every queue of this process keeps from its lane's directory
/// (see `queue_lane`).
pub(crate) fn forget_borrowed() {
    let cores: Vec<Arc<Core>> = lock(registry()).values().filter_map(Weak::upgrade).collect();
    for core in cores {
        core.forget_borrowed();
    }
}

/// See `channel::flush_queues`.
pub(crate) fn flush_all() {
    let cores: Vec<Arc<Core>> = lock(registry()).values().filter_map(Weak::upgrade).collect();
    for core in cores {
        core.outbox.flush_while(&|| true);
    }
}

/// Drops this process's record of which queues it has (see `channel::forget_after_fork`).
pub(crate) fn forget_registry() {
    lock(registry()).clear();
}

impl Core {
    pub(super) fn create(capacity: Option<u32>) -> Result<Arc<Core>> {
        let (tx, rx) = socket::pair()?;
        let control = Control::create(capacity)?;
        let id = control.id()?;
        let control = Arc::new(control);
        let core = Arc::new(Core {
            tx: Arc::new(tx),
            rx: Arc::new(rx),
            outbox: Arc::new(Outbox::new(control.clone())),
            control,
            lane: ForkMutex::default(),
        });
        let mut reg = lock(registry());
        reg.retain(|_, w| w.strong_count() > 0);
        reg.insert(id, Arc::downgrade(&core));
        Ok(core)
    }

    /// The queue received in a message: this process's existing core if it has one.
    fn adopt(tx: OwnedFd, rx: OwnedFd, ctl: OwnedFd) -> Result<Arc<Core>> {
        let st = rustix::fs::fstat(&ctl).map_err(|e| Error::io("fstat of a queue's memfd", e))?;
        let id = (st.st_dev, st.st_ino);
        let mut reg = lock(registry());
        if let Some(core) = reg.get(&id).and_then(Weak::upgrade) {
            drop(reg);
            drop((tx, rx));
            // Not under the registry's lock: if this is the last handle, dropping it on an
            // error flushes its outbox, which may wait.
            core.control.take_over(ctl)?;
            return Ok(core);
        }
        for fd in [&tx, &rx] {
            let st = rustix::fs::fstat(fd).map_err(|e| Error::io("fstat of a queue's socket", e))?;
            if rustix::fs::FileType::from_raw_mode(st.st_mode) != rustix::fs::FileType::Socket {
                return Err(Error::invalid("a queue endpoint that is not a socket"));
            }
        }
        let control = Arc::new(Control::open(ctl)?);
        let core = Arc::new(Core {
            tx: Arc::new(tx),
            rx: Arc::new(rx),
            outbox: Arc::new(Outbox::new(control.clone())),
            control,
            lane: ForkMutex::default(),
        });
        reg.insert(id, Arc::downgrade(&core));
        Ok(core)
    }

    /// See `raw::with_queue_locks_held`: taken in the order `lane_put` takes them.
    #[cfg(feature = "test-support")]
    pub(super) fn with_locks_held<R>(&self, f: impl FnOnce() -> R) -> R {
        let _lane = self.lane.lock();
        self.control.with_hold_locked(|| {
            let _looking = self.outbox.looking.lock();
            f()
        })
    }

    /// Whether anyone but the caller's handle could still put or get: another handle in
    /// this process, another process holding the queue, or this process's own records
    /// still on their way out.
    pub(super) fn others(self: &Arc<Core>) -> bool {
        Arc::strong_count(self) > 1 || self.control.others_alive() || self.outbox.pending()
    }

    pub(super) fn put<T: Serialize>(
        self: &Arc<Core>,
        value: T,
        deadline: Deadline,
    ) -> std::result::Result<(), SendError<T>> {
        self.put_ref(&value, deadline).map_err(|e| SendError::new(value, e))
    }

    pub(super) fn put_ref<T: Serialize + ?Sized>(
        self: &Arc<Core>,
        value: &T,
        deadline: Deadline,
    ) -> Result<()> {
        // The lines a lane put writes are fetched while the message is encoded (not while
        // someone waits on the socket: messages then go there).
        if !self.control.polled() {
            self.control.lane().prepare_claim();
        }
        let mut msg = wire::encode_for_lane(value, super::lane::CELL_BYTES)?;
        if deadline.slice().is_none() && self.control.is_full() {
            // `try_put` on a full queue: no place now, so no framing (a large message would
            // be written into a memfd only to be dropped).
            return Err(Error::Timeout);
        }
        // Framed before a place is taken: a large message is written into a memfd here,
        // which takes a while, and a place held that long with nothing in the socket would
        // look lost to a producer waiting for one (see `restore_places`). A message for the
        // lane is small: framed only if the lane cannot take it.
        // (The message stays where it is for the lane: it is not moved about on the way.)
        let mut out = match self.lane_may_take(&msg) {
            true => None,
            false => Some(Outgoing::new(std::mem::take(&mut msg))?),
        };
        // A free place (an unbounded queue always has one): no syscall.
        let mut placed = self.control.try_acquire();
        // Whether the queue was empty when the current wait began; asked only once a wait
        // has failed, so that a producer that finds the queue full pays no syscall for it.
        let mut empty_before = false;
        while !placed {
            // Try once even when the deadline has passed (try_put, a zero timeout).
            let slice = deadline.slice();
            if self.control.acquire(slice.unwrap_or_default()) {
                placed = true;
                continue;
            }
            if slice.is_none() {
                return Err(Error::Timeout);
            }
            if !self.others() {
                return Err(Error::Disconnected);
            }
            // No place for a whole slice, and the queue was empty all along: the places
            // were lost (a consumer died holding one), not taken.
            let empty = self.drained();
            self.control.restore_places(empty_before && empty);
            empty_before = empty;
        }
        let out = match out.take() {
            Some(out) => out,
            None if self.lane_put(&msg) => return Ok(()),
            None => Outgoing::new(msg).inspect_err(|_| self.control.release())?,
        };
        let alive = || -> super::outbox::Alive {
            let (core, control) = (Arc::downgrade(self), self.control.clone());
            Arc::new(move || core.strong_count() > 0 || control.others_alive())
        };
        let gate = self.socket_gate();
        self.outbox.put(&self.tx, out, alive, gate).inspect_err(|_| self.control.release())
    }

    /// About how many values wait: see `Queue::len`.
    pub(super) fn len(&self) -> usize {
        self.control.queued(|| self.drained()) + self.control.lane().waiting() + self.outbox.waiting()
    }

    /// Whether no message waits in the queue's lane or socket and none of this process's
    /// is on its way out.
    pub(super) fn drained(&self) -> bool {
        let socket_empty =
            !socket::wait(self.rx.as_fd(), rustix::event::PollFlags::IN, Duration::ZERO).unwrap_or(true);
        socket_empty && !self.outbox.pending() && self.control.lane().is_empty()
    }

    /// See `Queue::has_ready`. A lane position claimed and not yet published counts for
    /// nothing: its producer may have died there. The socket is looked at before the flag:
    /// nudges (records without a message) are written only after the flag is set, and it
    /// is never cleared, so a record seen while the flag is still clear is a message.
    pub(super) fn has_ready(&self) -> Option<bool> {
        if self.outbox.pending() || self.control.lane().has_published() {
            return Some(true);
        }
        let in_socket =
            socket::wait(self.rx.as_fd(), rustix::event::PollFlags::IN, Duration::ZERO).unwrap_or(true);
        if !in_socket {
            return Some(false);
        }
        (!self.control.polled()).then_some(true)
    }

    /// A record taken off the queue, good or not: its place is free again, and it becomes
    /// a value (or an error, having closed what it carried).
    pub(super) fn take<T: DeserializeOwned>(&self, record: Result<socket::Record>) -> Result<T> {
        self.control.record_gone();
        self.control.count_taken();
        self.control.release();
        frame::decode(record?, true)
    }
}

#[derive(Serialize, Deserialize)]
struct CoreRepr {
    tx: u32,
    rx: u32,
    ctl: u32,
}

pub(super) fn serialize_core<S: Serializer>(core: &Core, s: S) -> std::result::Result<S::Ok, S::Error> {
    if !wire::encoding() {
        return Err(wire::ser_error("a queue can only travel inside a tensorshare message"));
    }
    let fd = |f: &Arc<OwnedFd>| wire::encode_fd(FdSource::Fd(f.clone())).map_err(wire::ser_error);
    let hold = core.control.in_flight_hold().map_err(wire::ser_error)?;
    let ctl = wire::encode_fd(FdSource::Owned(hold)).map_err(wire::ser_error)?;
    CoreRepr { tx: fd(&core.tx)?, rx: fd(&core.rx)?, ctl }.serialize(s)
}

pub(super) fn deserialize_core<'de, D: Deserializer<'de>>(d: D) -> std::result::Result<Arc<Core>, D::Error> {
    let r = CoreRepr::deserialize(d)?;
    let fd = |i| wire::decode_fd(i).map_err(wire::de_error);
    Core::adopt(fd(r.tx)?, fd(r.rx)?, fd(r.ctl)?).map_err(wire::de_error)
}
