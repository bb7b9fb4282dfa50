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
    /// An unbounded queue.
    pub(crate) fn new() -> Result<AnyQueue> {
        Ok(AnyQueue { core: Core::create(None)? })
    }

    /// Puts a value; never waits for room (the queue is unbounded).
    pub(crate) fn put<T: Serialize + ?Sized>(&self, value: &T) -> Result<()> {
        self.core.put_ref(value, Deadline::after(None))
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
