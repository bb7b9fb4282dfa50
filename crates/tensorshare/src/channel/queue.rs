//! [`Queue`] and [`SimpleQueue`]: many producers, many consumers, any processes.

use std::marker::PhantomData;
use std::os::fd::AsFd;
use std::sync::Arc;
use std::time::Duration;

use serde::de::DeserializeOwned;
use serde::{Deserialize, Deserializer, Serialize, Serializer};

use super::err::SendError;
use super::queue_core::{deserialize_core, serialize_core, Core};
use super::socket::Deadline;
// layering: inside value::to_value and from_value, a queue crosses as a queue of Values
// through the value layer's bridge (which holds Values), not through the codec.
use crate::value::{bridge, Value};
use crate::wire;
use crate::{Error, Result};

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
                    return match bridge::receive(d)? {
                        Value::$name(q) => Ok($name { core: q.core, _t: PhantomData }),
                        other => Err(wire::de_error(format!(
                            "{} where a {} was expected",
                            other.kind(),
                            stringify!($name)
                        ))),
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
                self.core.drained()
            }

            /// Whether a value waits now, told without taking one off the queue (which other
            /// processes may be reading): `Some(false)` when none does (as
            /// [`is_empty`](Self::is_empty)), `Some(true)` when one does. `None` when what
            /// waits is a record in the queue's socket while someone waits on
            /// [`poll_fd`](Self::poll_fd): it may be a wake-up with no value, which only
            /// [`try_get`](Self::try_get) tells. A value another process is still putting
            /// does not count yet, so a producer killed in the middle of its put leaves no
            /// value this says waits for good.
            pub fn has_ready(&self) -> Option<bool> {
                self.core.has_ready()
            }

            /// Lets this process go without waiting for what it put on this queue to be
            /// written out (Python's `cancel_join_thread`): from now on, dropping the queue's
            /// last handle here or [`flush_queues`](crate::flush_queues) returns at once;
            /// what waits for room is written on while this process lives, and lost if it
            /// leaves first. For a process whose reader may have stopped reading (a worker
            /// told to stop).
            pub fn cancel_join_thread(&self) {
                self.core.outbox.leave_unwritten();
            }

            /// Whether values this process put on the queue still wait in its outbox for
            /// room (see `put`). Dropping the queue's last handle in this process waits for
            /// them while another process, or a message in flight, could still read them;
            /// a caller that must not wait there (a garbage collector holding a lock) can
            /// drop the handle on a thread of its own instead, as the Python package does.
            pub fn has_unwritten(&self) -> bool {
                self.core.outbox.pending()
            }

            /// A descriptor to wait on with `poll` or `epoll` (for an event loop, or
            /// Python's `multiprocessing.connection.wait`): it becomes readable when a
            /// value may be waiting; a wake-up can be spurious, so follow it with
            /// [`try_get`](Self::try_get). From the first call on, the queue's values travel
            /// through this socket, not the lane (see the README, "How it works"); until a
            /// consumer looks, `is_empty` may then count a wake-up as a value. Only wait on
            /// it: reading from it takes records out
            /// from under the queue (memory stays safe, the descriptors such a record
            /// carries are closed and give back what they held, but the values are lost).
            pub fn poll_fd(&self) -> std::os::fd::BorrowedFd<'_> {
                self.core.watch_socket();
                self.core.rx.as_fd()
            }

            /// How many positions of the queue's lane producers have claimed so far (for
            /// tests: whether messages went through the lane).
            #[cfg(feature = "test-support")]
            #[allow(dead_code)] // `raw` asks a Queue only
            pub(crate) fn lane_claimed(&self) -> u64 {
                self.core.control.lane().tail()
            }

            /// Takes a place and keeps it (see `raw::lose_a_place`).
            #[cfg(feature = "test-support")]
            #[allow(dead_code)] // `raw` asks a Queue only
            pub(crate) fn lose_a_place(&self) -> bool {
                self.core.control.lose_a_place()
            }

            /// Runs `f` with the queue's per-process locks held, as a thread holds them
            /// while it waits on the lane's directory (for tests of what a child forked
            /// meanwhile can do).
            #[cfg(feature = "test-support")]
            #[allow(dead_code)] // `raw` asks a Queue only
            pub(crate) fn with_locks_held<R>(&self, f: impl FnOnce() -> R) -> R {
                self.core.with_locks_held(f)
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
