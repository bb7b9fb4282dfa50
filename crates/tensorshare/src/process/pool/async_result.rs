//! [`AsyncResult`]: what [`Pool::apply_async`](crate::Pool::apply_async) gives, a result
//! to come that does not borrow the pool.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde::de::DeserializeOwned;

use super::dispatch::{lock, Inner};
use crate::{Error, Result};

/// The result of one [`Pool::apply_async`](crate::Pool::apply_async) task, to come
/// (Python's `AsyncResult`). It does not borrow the pool: calls on the pool may go on while
/// it waits, and whichever call reads a result off a worker files it for its owner.
/// Waiting on it also moves the pool's other work along (results of a `map`, other
/// `AsyncResult`s) without taking any of it. Dropping it discards its result.
///
/// If the pool is dropped before the task's result came, waiting ends with
/// [`Error::Disconnected`].
pub struct AsyncResult<U> {
    inner: Arc<Mutex<Inner>>,
    batch: u64,
    /// The result once it came; `None` inside once taken.
    result: Option<Option<Result<U>>>,
}

impl<U> std::fmt::Debug for AsyncResult<U> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AsyncResult")
            .field("batch", &self.batch)
            .field("ready", &self.result.is_some())
            .finish()
    }
}

impl<U: DeserializeOwned> AsyncResult<U> {
    pub(super) fn new(inner: Arc<Mutex<Inner>>, batch: u64) -> AsyncResult<U> {
        AsyncResult { inner, batch, result: None }
    }

    /// Waits until the result came or `deadline` passed (`None`: no deadline); true if it
    /// came.
    fn wait_until(&mut self, deadline: Option<Instant>) -> bool {
        while self.result.is_none() {
            let mut inner = lock(&self.inner);
            if let Some(f) = inner.take_filed(self.batch) {
                self.result = Some(Some(f.decode()));
                break;
            }
            if inner.is_closed() {
                self.result = Some(Some(Err(Error::Disconnected)));
                break;
            }
            let left = match deadline {
                None => None,
                Some(d) => match d.checked_duration_since(Instant::now()) {
                    Some(left) if !left.is_zero() => Some(left),
                    _ => return false,
                },
            };
            if let Err(e) = inner.pump(left) {
                self.result = Some(Some(Err(e)));
            }
        }
        true
    }

    /// Whether the result came (Python's `ready()`); never waits.
    pub fn ready(&mut self) -> bool {
        self.wait_until(Some(Instant::now()))
    }

    /// Waits until the result came (Python's `wait()`).
    pub fn wait(&mut self) {
        self.wait_until(None);
    }

    /// Waits up to `timeout` for the result; true if it came (Python's `wait(timeout)`
    /// followed by `ready()`).
    pub fn wait_timeout(&mut self, timeout: Duration) -> bool {
        self.wait_until(Instant::now().checked_add(timeout))
    }

    /// The task's value, or its error (which names the item, index 0, and the worker),
    /// once it came.
    pub fn get(mut self) -> Result<U> {
        self.wait();
        self.take()
    }

    /// The task's value, or [`Error::Timeout`] if it did not come within `timeout`; then
    /// the `AsyncResult` stays usable. The value is given once: a later call is an error.
    pub fn get_timeout(&mut self, timeout: Duration) -> Result<U> {
        if !self.wait_timeout(timeout) {
            return Err(Error::Timeout);
        }
        self.take()
    }

    fn take(&mut self) -> Result<U> {
        match self.result.as_mut().and_then(Option::take) {
            Some(r) => r,
            None => Err(Error::invalid_argument("AsyncResult", "its result was already taken")),
        }
    }
}

impl<U> Drop for AsyncResult<U> {
    fn drop(&mut self) {
        lock(&self.inner).forget(self.batch);
    }
}
