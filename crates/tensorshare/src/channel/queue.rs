//! [`Queue`] and [`SimpleQueue`]: many producers, many consumers, any processes.

use std::collections::HashMap;
use std::marker::PhantomData;
use std::os::fd::{AsFd, OwnedFd};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use serde::de::DeserializeOwned;
use serde::{Deserialize, Deserializer, Serialize, Serializer};

use super::control::Control;
use super::err::SendError;
use super::frame::{self, Outgoing};
use super::outbox::Outbox;
use super::socket::{self, Deadline};
use crate::util::lock;
// layering: inside value::to_value and from_value, a queue crosses as a queue of Values
// through the value layer's bridge (which holds Values), not through the codec.
use crate::value::{bridge, Value};
use crate::wire::{self, FdSource};
use crate::{Error, Result};

/// The process-wide state of one queue: its two socket ends, its control block and this
/// process's outbox. Every handle of the queue in this process shares it.
pub(crate) struct Core {
    /// Producers write here.
    tx: Arc<OwnedFd>,
    /// Consumers read here.
    rx: Arc<OwnedFd>,
    control: Arc<Control>,
    outbox: Arc<Outbox>,
}

impl Drop for Core {
    fn drop(&mut self) {
        self.outbox.flush_at_drop();
    }
}

type Registry = Mutex<HashMap<(u64, u64), Weak<Core>>>;

fn registry() -> &'static Registry {
    static R: std::sync::OnceLock<Registry> = std::sync::OnceLock::new();
    R.get_or_init(|| {
        crate::util::fork::guard(|out| out.push(Box::new(lock(registry()))));
        Mutex::default()
    })
}

/// Drops this process's record of which queues it has (see `channel::forget_after_fork`).
pub(crate) fn forget_registry() {
    lock(registry()).clear();
}

impl Core {
    fn create(capacity: Option<u32>) -> Result<Arc<Core>> {
        let (tx, rx) = socket::pair()?;
        let control = Control::create(capacity)?;
        let id = control.id()?;
        let control = Arc::new(control);
        let core = Arc::new(Core {
            tx: Arc::new(tx),
            rx: Arc::new(rx),
            outbox: Arc::new(Outbox::new(control.clone())),
            control,
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
            drop((tx, rx));
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
        });
        reg.insert(id, Arc::downgrade(&core));
        Ok(core)
    }

    /// Whether anyone but the caller's handle could still put or get: another handle in
    /// this process, another process holding the queue, or this process's own records
    /// still on their way out.
    fn others(self: &Arc<Core>) -> bool {
        Arc::strong_count(self) > 1 || self.control.others_alive() || self.outbox.pending()
    }

    fn put<T: Serialize>(
        self: &Arc<Core>,
        value: T,
        deadline: Deadline,
    ) -> std::result::Result<(), SendError<T>> {
        self.put_ref(&value, deadline).map_err(|e| SendError::new(value, e))
    }

    fn put_ref<T: Serialize>(self: &Arc<Core>, value: &T, deadline: Deadline) -> Result<()> {
        let msg = wire::encode(value)?;
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
            let empty = self.is_empty() && !self.outbox.pending();
            self.control.restore_places(empty_before && empty);
            empty_before = empty;
        }
        let alive = || -> super::outbox::Alive {
            let (core, control) = (Arc::downgrade(self), self.control.clone());
            Arc::new(move || core.strong_count() > 0 || control.others_alive())
        };
        Outgoing::new(msg)
            .and_then(|out| self.outbox.put(&self.tx, out, alive))
            .inspect_err(|_| self.control.release())
    }

    /// About how many values wait: see `Queue::len`.
    fn len(&self) -> usize {
        self.control.queued(|| self.is_empty() && !self.outbox.pending()) + self.outbox.waiting()
    }

    /// Whether no record waits in the queue's socket.
    fn is_empty(&self) -> bool {
        !socket::wait(self.rx.as_fd(), rustix::event::PollFlags::IN, Duration::ZERO).unwrap_or(true)
    }

    fn get<T: DeserializeOwned>(self: &Arc<Core>, deadline: Deadline) -> Result<T> {
        let record =
            socket::recv_taken(self.rx.as_fd(), deadline, &|| self.others(), Some(self.control.awake()))?;
        self.take(record)
    }

    fn try_get<T: DeserializeOwned>(self: &Arc<Core>) -> Result<Option<T>> {
        let record = match socket::try_recv(self.rx.as_fd())? {
            socket::Received::Record(r) => Ok(r),
            socket::Received::Bad(e) => Err(e),
            socket::Received::Closed => return Err(Error::Disconnected),
            socket::Received::Empty if self.others() => return Ok(None),
            // Alone: nothing more can come, but a record may have arrived just now.
            socket::Received::Empty => match socket::try_recv(self.rx.as_fd())? {
                socket::Received::Record(r) => Ok(r),
                socket::Received::Bad(e) => Err(e),
                _ => return Err(Error::Disconnected),
            },
        };
        self.take(record).map(Some)
    }

    /// A record taken off the queue, good or not: its place is free again, and it becomes
    /// a value (or an error, having closed what it carried).
    fn take<T: DeserializeOwned>(&self, record: Result<socket::Record>) -> Result<T> {
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

fn serialize_core<S: Serializer>(core: &Core, s: S) -> std::result::Result<S::Ok, S::Error> {
    if !wire::encoding() {
        return Err(wire::ser_error("a queue can only travel inside a tensorshare message"));
    }
    let fd = |f: &Arc<OwnedFd>| wire::encode_fd(FdSource::Fd(f.clone())).map_err(wire::ser_error);
    let hold = core.control.in_flight_hold().map_err(wire::ser_error)?;
    let ctl = wire::encode_fd(FdSource::Owned(hold)).map_err(wire::ser_error)?;
    CoreRepr { tx: fd(&core.tx)?, rx: fd(&core.rx)?, ctl }.serialize(s)
}

fn deserialize_core<'de, D: Deserializer<'de>>(d: D) -> std::result::Result<Arc<Core>, D::Error> {
    let r = CoreRepr::deserialize(d)?;
    let fd = |i| wire::decode_fd(i).map_err(wire::de_error);
    Core::adopt(fd(r.tx)?, fd(r.rx)?, fd(r.ctl)?).map_err(wire::de_error)
}

macro_rules! queue_type {
    ($(#[$doc:meta])* $name:ident) => {
        $(#[$doc])*
        pub struct $name<T> {
            core: Arc<Core>,
            _t: PhantomData<fn(T) -> T>,
        }

        impl<T> Clone for $name<T> {
            fn clone(&self) -> Self {
                $name { core: self.core.clone(), _t: PhantomData }
            }
        }

        impl<T> std::fmt::Debug for $name<T> {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.debug_struct(stringify!($name)).finish_non_exhaustive()
            }
        }

        impl<T> Serialize for $name<T> {
            fn serialize<S: Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
                // Inside `value::to_value`, the queue becomes a `Value` queue: the same queue.
                let bridged = bridge::put(|| Value::$name($name { core: self.core.clone(), _t: PhantomData }));
                if let Some(index) = bridged {
                    return s.serialize_newtype_struct(bridge::TOKEN, &index);
                }
                serialize_core(&self.core, s)
            }
        }

        impl<'de, T> Deserialize<'de> for $name<T> {
            fn deserialize<D: Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
                // Inside `value::from_value`, a queue field takes the queue there.
                if bridge::active() {
                    let index = d.deserialize_newtype_struct(bridge::TOKEN, bridge::IndexVisitor)?;
                    return match bridge::take(index) {
                        Some(Value::$name(q)) => Ok($name { core: q.core, _t: PhantomData }),
                        Some(other) => Err(wire::de_error(format!(
                            "{} where a {} was expected",
                            other.kind(),
                            stringify!($name)
                        ))),
                        None => Err(wire::de_error("a bridged value taken twice")),
                    };
                }
                Ok($name { core: deserialize_core(d)?, _t: PhantomData })
            }
        }

        impl<T: Serialize + DeserializeOwned> $name<T> {
            /// Takes the next value, waiting as long as it takes. `Disconnected` once the
            /// queue is empty and no other handle, here or in another process, is left to
            /// put.
            pub fn get(&self) -> Result<T> {
                self.core.get(Deadline::after(None))
            }

            /// Takes the next value, waiting at most `timeout`: `Error::Timeout` after it.
            pub fn get_timeout(&self, timeout: Duration) -> Result<T> {
                self.core.get(Deadline::after(Some(timeout)))
            }

            /// Takes the next value if one is waiting: `Ok(None)` if none is.
            pub fn try_get(&self) -> Result<Option<T>> {
                self.core.try_get()
            }

            /// About how many values wait in the queue, put by any process and not yet
            /// taken, as Python's `Queue.qsize()` gives it: an estimate while other
            /// processes put and take (it can be high by the puts and gets in progress, and
            /// by one for a process killed in the middle of one, until the queue is next
            /// seen empty), and values still waiting in another process's outbox (an
            /// unbounded queue whose socket is full) count once written. Exact when
            /// nothing else is using the queue.
            pub fn len(&self) -> usize {
                self.core.len()
            }

            /// Whether a bounded queue has no free place now, so that `put` would wait
            /// (never, for an unbounded queue or a `SimpleQueue`).
            pub fn is_full(&self) -> bool {
                self.core.control.is_full()
            }

            /// How many values the queue holds at most; `None` if it is unbounded.
            pub fn capacity(&self) -> Option<usize> {
                self.core.control.capacity()
            }

            /// Whether no value waits in the queue now (another process may put one the
            /// next moment).
            pub fn is_empty(&self) -> bool {
                self.core.is_empty() && !self.core.outbox.pending()
            }

            /// A descriptor to wait on with `poll` or `epoll` (for an event loop, or
            /// Python's `multiprocessing.connection.wait`): it becomes readable when a
            /// value may be waiting; a wake-up can be spurious, so follow it with
            /// [`try_get`](Self::try_get). Only wait on it: reading from it takes records out
            /// from under the queue (memory stays safe, the descriptors such a record
            /// carries are closed and give back what they held, but the values are lost).
            pub fn poll_fd(&self) -> std::os::fd::BorrowedFd<'_> {
                self.core.rx.as_fd()
            }
        }
    };
}

queue_type!(
    /// A multi-producer, multi-consumer queue between processes, optionally bounded.
    ///
    /// Clone it, send it inside a message, or pass it to workers: every copy, in every
    /// process, is the same queue. Values travel as messages: tensors
    /// as handles to shared memory, never copied on the way.
    Queue
);

queue_type!(
    /// An unbounded queue between processes (torch's `SimpleQueue`): `put` never waits for
    /// room in the queue, only for room in the socket.
    SimpleQueue
);

impl<T: Serialize + DeserializeOwned> Queue<T> {
    /// An unbounded queue.
    pub fn new() -> Result<Queue<T>> {
        Ok(Queue { core: Core::create(None)?, _t: PhantomData })
    }

    /// A queue of at most `capacity` values: `put` waits while it is full.
    pub fn with_capacity(capacity: usize) -> Result<Queue<T>> {
        let cap = u32::try_from(capacity).ok().filter(|&c| c > 0 && c < u32::MAX).ok_or_else(|| {
            Error::invalid_argument(
                "queue capacity",
                format!("a queue capacity must be in 1..{}, got {capacity}", u32::MAX),
            )
        })?;
        Ok(Queue { core: Core::create(Some(cap))?, _t: PhantomData })
    }

    /// Puts a value, waiting while the queue is full (never, if it is unbounded). Fails,
    /// giving the value back, with `Disconnected` if it is full and no other handle is left
    /// to take from it.
    pub fn put(&self, value: T) -> std::result::Result<(), SendError<T>> {
        self.core.put(value, Deadline::after(None))
    }

    /// Puts a value, waiting at most `timeout` for room; `Timeout` gives the value back.
    pub fn put_timeout(&self, value: T, timeout: Duration) -> std::result::Result<(), SendError<T>> {
        self.core.put(value, Deadline::after(Some(timeout)))
    }

    /// Puts a value only if there is room now; `Timeout` gives the value back.
    pub fn try_put(&self, value: T) -> std::result::Result<(), SendError<T>> {
        self.core.put(value, Deadline::now())
    }
}

impl<T: Serialize + DeserializeOwned> SimpleQueue<T> {
    /// A new queue.
    pub fn new() -> Result<SimpleQueue<T>> {
        Ok(SimpleQueue { core: Core::create(None)?, _t: PhantomData })
    }

    /// Puts a value; never waits. A failure gives the value back.
    pub fn put(&self, value: T) -> std::result::Result<(), SendError<T>> {
        self.core.put(value, Deadline::after(None))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A consumer killed between taking a record and giving its place back took the place
    /// with it; once the queue has stayed empty for a whole wait, the places come back.
    #[test]
    fn places_lost_with_dead_consumers_come_back() {
        let q: Queue<u32> = Queue::with_capacity(2).unwrap();
        let _consumer = q.clone();
        // Two records taken, never given back: as if both consumers died at that moment.
        assert!(q.core.control.acquire(Duration::ZERO) && q.core.control.acquire(Duration::ZERO));
        q.put_timeout(1, Duration::from_secs(5)).unwrap();
        q.put_timeout(2, Duration::from_secs(5)).unwrap();
        assert!(q.try_put(3).unwrap_err().is_timeout(), "and never more than the capacity");
        assert_eq!((q.get().unwrap(), q.get().unwrap()), (1, 2));
    }
}
