//! [`Tasks`]: the results of `imap`, `imap_unordered` and `istarmap` as an iterator that
//! sends the items in chunks as workers come free and yields each result in order (or as
//! it comes).

use std::collections::{BTreeMap, VecDeque};
use std::marker::PhantomData;
use std::sync::Arc;

use serde::de::DeserializeOwned;
use serde::Serialize;

use super::dispatch::lock;
use super::Pool;
use crate::process::job::JobName;
use crate::wire;
use crate::{Error, Result};

/// The results of [`Pool::imap`], [`Pool::imap_unordered`] or [`Pool::istarmap`], as an
/// iterator of `Result<U>`: a task that failed yields its error and the others go on.
pub struct Tasks<'p, T, U, I> {
    pool: &'p mut Pool,
    /// The tasks' name, or why the function cannot be named (then every item fails).
    entry: std::result::Result<JobName, String>,
    items: I,
    batch: u64,
    next_index: usize,
    chunksize: usize,
    ordered: bool,
    /// Items sent whose results have not come yet.
    outstanding: usize,
    /// Done, waiting to be yielded (ordered mode) or in completion order.
    done: BTreeMap<usize, Result<U>>,
    done_order: VecDeque<usize>,
    next_yield: usize,
    exhausted: bool,
    _t: PhantomData<fn(T)>,
}

impl<'p, T, U, I> Tasks<'p, T, U, I>
where
    T: Serialize + DeserializeOwned,
    U: Serialize + DeserializeOwned,
    I: Iterator<Item = T>,
{
    pub(super) fn new(
        pool: &'p mut Pool,
        entry: std::result::Result<JobName, String>,
        items: I,
        ordered: bool,
    ) -> Self {
        let batch = lock(&pool.inner).open_batch();
        Tasks {
            pool,
            entry,
            items,
            batch,
            next_index: 0,
            chunksize: 1,
            ordered,
            outstanding: 0,
            done: BTreeMap::new(),
            done_order: VecDeque::new(),
            next_yield: 0,
            exhausted: false,
            _t: PhantomData,
        }
    }

    /// Sends the items to the workers in chunks of `n` (Python's `chunksize`; 1, the
    /// default, for 0): one message per chunk instead of one per item, for many small
    /// tasks. Results still come one per item, in the same order, and an error names its
    /// item's index among all the items. A worker that dies fails the item it was running
    /// with how it died, and the rest of its chunk with [`Failure::Lost`](crate::Failure::Lost).
    pub fn chunksize(mut self, n: usize) -> Self {
        self.chunksize = n.max(1);
        self
    }

    fn finish(&mut self, index: usize, r: Result<U>) {
        self.done.insert(index, r);
        self.done_order.push_back(index);
    }

    /// Takes this batch's filed results; if there were none, gives idle workers their next
    /// chunks and waits for something to happen.
    fn step(&mut self) -> Result<()> {
        let inner_arc = self.pool.inner.clone();
        let mut inner = lock(&inner_arc);
        let mut took = false;
        while let Some(f) = inner.take_filed(self.batch) {
            self.outstanding -= 1;
            took = true;
            let index = f.index;
            self.finish(index, f.decode());
        }
        if took {
            return Ok(());
        }
        inner.dispatch_queued();
        while !self.exhausted && inner.idle()?.is_some() {
            let chunk: Vec<T> = self.items.by_ref().take(self.chunksize).collect();
            if chunk.is_empty() {
                self.exhausted = true;
                break;
            }
            let (first, count) = (self.next_index, chunk.len());
            self.next_index += count;
            let sent = match &self.entry {
                Ok(name) => inner.send(self.batch, first, count, name, wire::encode(&chunk)),
                Err(e) => Err(Error::Unsupported(e.clone())),
            };
            match sent {
                Ok(()) => self.outstanding += count,
                Err(e) => {
                    // Not sent: every item of the chunk fails with the one cause.
                    let source = Arc::new(e);
                    for index in first..first + count {
                        self.finish(index, Err(Error::Task { index, source: source.clone() }));
                    }
                }
            }
        }
        // Items of ours are running, or every worker is busy (with other calls' tasks)
        // while items are left: either way something will happen.
        if self.outstanding > 0 || !self.exhausted {
            inner.pump(None)?;
        }
        Ok(())
    }
}

impl<T, U, I> Drop for Tasks<'_, T, U, I> {
    fn drop(&mut self) {
        // Its tasks still running finish; their results are discarded.
        lock(&self.pool.inner).forget(self.batch);
    }
}

impl<T, U, I> Iterator for Tasks<'_, T, U, I>
where
    T: Serialize + DeserializeOwned,
    U: Serialize + DeserializeOwned,
    I: Iterator<Item = T>,
{
    type Item = Result<U>;

    fn next(&mut self) -> Option<Result<U>> {
        loop {
            if self.ordered {
                if let Some(r) = self.done.remove(&self.next_yield) {
                    self.next_yield += 1;
                    return Some(r);
                }
            } else if let Some(index) = self.done_order.pop_front() {
                if let Some(r) = self.done.remove(&index) {
                    return Some(r);
                }
                continue;
            }
            if self.exhausted && self.outstanding == 0 && self.done.is_empty() {
                return None;
            }
            if let Err(e) = self.step() {
                return Some(Err(e));
            }
        }
    }
}
