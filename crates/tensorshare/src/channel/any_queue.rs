//! [`AnyQueue`]: a queue of values of any type, for the crate's own links.

use std::sync::Arc;
use std::time::Duration;

use serde::de::DeserializeOwned;
use serde::{Deserialize, Deserializer, Serialize, Serializer};

use super::queue_core::{deserialize_core, serialize_core, Core};
use super::socket::Deadline;
use crate::Result;

/// A queue whose values may differ in type from one `put` to the next, for the crate's own
/// links (`dist`'s `send` and `recv`, where every call names its type): the same queue, on
/// the wire and in every promise, as a [`Queue`](super::Queue).
pub(crate) struct AnyQueue {
    core: Arc<Core>,
}

impl AnyQueue {
    /// A queue of at most `capacity` values (at least 1).
    pub(crate) fn with_capacity(capacity: u32) -> Result<AnyQueue> {
        Ok(AnyQueue { core: Core::create(Some(capacity.max(1)))? })
    }

    /// Puts a value, waiting at most `timeout` for room: `Error::Timeout` after it.
    pub(crate) fn put_timeout<T: Serialize + ?Sized>(&self, value: &T, timeout: Duration) -> Result<()> {
        self.core.put_ref(value, Deadline::after(Some(timeout)))
    }

    /// Drops this handle. What this process put and has not written into the queue yet
    /// is written first, while `readers` says that someone who would read it is left.
    pub(crate) fn close_while(self, readers: &dyn Fn() -> bool) {
        self.core.outbox.flush_while(readers);
    }

    /// Drops this handle and, unwritten, whatever this process put and has not written
    /// into the queue yet: nobody will read it.
    pub(crate) fn abandon(self) {
        self.core.outbox.abandon();
    }

    /// Whether this is this process's only handle of the queue (a queue received from a
    /// peer that this process held already is not one the peer made for it).
    pub(crate) fn only_handle(&self) -> bool {
        Arc::strong_count(&self.core) == 1
    }

    /// Takes the next value as a `T`, waiting at most `timeout`: `Error::Timeout` after it,
    /// `Disconnected` once the queue is empty and no other handle is left to put.
    pub(crate) fn get_timeout<T: DeserializeOwned>(&self, timeout: Duration) -> Result<T> {
        self.core.get(Deadline::after(Some(timeout)))
    }
}

impl Serialize for AnyQueue {
    fn serialize<S: Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        serialize_core(&self.core, s)
    }
}

impl<'de> Deserialize<'de> for AnyQueue {
    fn deserialize<D: Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        Ok(AnyQueue { core: deserialize_core(d)? })
    }
}
