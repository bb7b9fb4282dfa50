//! [`Pool`]: a fixed set of worker processes that run tasks (torch's / Python's
//! `multiprocessing.Pool`): `map`, `imap` (ordered, streaming), `imap_unordered`,
//! `starmap`, `apply_async`, chunks of items, and an initializer with arguments.
//!
//! Each worker has its own socket. A task is two records (which function and how many
//! items, then the chunk of items); the worker answers with one record per item, sent as
//! soon as that item is done, so that the parent always knows which item a worker was
//! running when it died. A task that panics fails alone and its worker goes on; a worker
//! that dies fails the item it was running with its [`ProcessError`](crate::ProcessError)
//! (naming the item), the rest of its chunk with an error that says so, and is replaced.
//!
//! Here: [`Pool`] and its calls. `builder`: how a pool is made. `task`: a task as the
//! worker runs it. `dispatch`: the shared state that sends chunks, files results and
//! replaces dead workers. `imap`: the streaming iterator. `async_result`: `apply_async`'s
//! result.
//!
//! Every call (`imap`, `map`, one `apply_async`) is a *batch* with its own number. Results
//! are filed by batch and item index in the pool's shared state, whoever happens to read
//! them off a socket: an `AsyncResult` waiting may read a `map`'s results and the other way
//! round, and neither takes the other's. A batch whose owner is gone (an `imap` iterator
//! dropped early, an `AsyncResult` dropped) has its results discarded.

mod async_result;
mod builder;
mod dispatch;
mod imap;
mod task;

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde::de::DeserializeOwned;
use serde::Serialize;

pub use async_result::AsyncResult;
use builder::Initializer;
pub use builder::PoolBuilder;
use dispatch::{lock, Inner};
pub use imap::Tasks;
pub use task::StarFn;
use task::{Call, Plain, RankInitDesc, Star, TaskDesc};

use super::job::{JobName, Stateless};
use super::StartMethod;
use crate::wire;
use crate::{Error, Result};

/// A pool of worker processes running tasks. Dropping it ends its workers.
///
/// ```no_run
/// # fn main() -> tensorshare::Result<()> {
/// use tensorshare::{Pool, StartMethod};
/// let mut pool = Pool::builder(4)
///     .method(StartMethod::Spawn)
///     .initializer(|_rank, scale: u64| std::env::set_var("SCALE", scale.to_string()), 3u64)
///     .build()?;
/// let squares = pool.map(|x: u64| x * x, 0..100u64)?;
/// let sums = pool.starmap(|a: u64, b: u64| a + b, vec![(1, 2), (3, 4)])?;
/// let small: Vec<u64> = pool.imap(|x: u64| x + 1, 0..10_000u64).chunksize(64).collect::<tensorshare::Result<_>>()?;
/// let job = pool.apply_async(|x: u64| x * 2, 21u64)?;
/// assert_eq!(job.get()?, 42);
/// # let _ = (squares, sums, small);
/// # Ok(())
/// # }
/// ```
pub struct Pool {
    inner: Arc<Mutex<Inner>>,
}

impl std::fmt::Debug for Pool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pool").field("workers", &self.pids()).finish()
    }
}

impl Pool {
    /// `n` workers, started with [`StartMethod::Spawn`].
    pub fn new(n: usize) -> Result<Pool> {
        Pool::build(n, StartMethod::Spawn, None)
    }

    /// `n` workers started with `method`.
    pub fn with_method(n: usize, method: StartMethod) -> Result<Pool> {
        Pool::build(n, method, None)
    }

    /// A pool of `n` workers, with a start method and an initializer to choose.
    pub fn builder(n: usize) -> PoolBuilder {
        PoolBuilder { n, method: StartMethod::Spawn, init: None }
    }

    /// `n` workers, each running `init(rank)` once before its first task (also a worker
    /// that replaces a dead one). `init` must capture nothing; for arguments, see
    /// [`PoolBuilder::initializer`].
    pub fn with_initializer<I>(n: usize, method: StartMethod, init: I) -> Result<Pool>
    where
        I: Fn(usize) + Send + Sync + 'static,
    {
        let () = Stateless::<I>::OK;
        let _ = init;
        let name = JobName::of(RankInitDesc::<I>::DESC)?;
        Pool::build(n, method, Some(Initializer { name, args: Box::new(|| wire::encode(&())) }))
    }

    fn build(n: usize, method: StartMethod, init: Option<Initializer>) -> Result<Pool> {
        if n == 0 {
            return Err(Error::invalid_argument("worker count", "a pool needs at least one worker"));
        }
        let mut inner = Inner {
            workers: Vec::with_capacity(n),
            batches: 0,
            method,
            init,
            queued: VecDeque::new(),
            live: HashSet::new(),
            filed: HashMap::new(),
            closed: false,
        };
        for rank in 0..n {
            let w = inner.start(rank)?;
            inner.workers.push(w);
        }
        Ok(Pool { inner: Arc::new(Mutex::new(inner)) })
    }

    /// The workers' process ids.
    pub fn pids(&self) -> Vec<i32> {
        lock(&self.inner).workers.iter().flat_map(|w| w.ctx.pids()).collect()
    }

    /// `f` applied to every item, in order. The first failed task's error is returned.
    ///
    /// `f` runs in the workers, so it may not capture variables (pass data in the items);
    /// one that does is a compile-time error:
    ///
    /// ```compile_fail,E0080
    /// let mut pool = tensorshare::Pool::new(1).unwrap();
    /// let offset = 3u32;
    /// let _ = pool.map(move |x: u32| x + offset, [1u32, 2]);
    /// ```
    pub fn map<F, T, U>(&mut self, f: F, items: impl IntoIterator<Item = T>) -> Result<Vec<U>>
    where
        F: Fn(T) -> U + Send + Sync + 'static,
        T: Serialize + DeserializeOwned,
        U: Serialize + DeserializeOwned,
    {
        self.imap(f, items).collect()
    }

    /// [`Pool::map`] with the items sent in chunks of `chunksize` (one message per chunk):
    /// many small tasks then do not pay a round trip each. Results and errors are as with
    /// `map`; an error still names its item's index in `items`.
    pub fn map_chunked<F, T, U>(
        &mut self,
        f: F,
        items: impl IntoIterator<Item = T>,
        chunksize: usize,
    ) -> Result<Vec<U>>
    where
        F: Fn(T) -> U + Send + Sync + 'static,
        T: Serialize + DeserializeOwned,
        U: Serialize + DeserializeOwned,
    {
        self.imap(f, items).chunksize(chunksize).collect()
    }

    /// `f` applied to every item; results stream out in the items' order as they are done.
    /// Send items in chunks with [`Tasks::chunksize`].
    pub fn imap<F, T, U, I>(&mut self, f: F, items: I) -> Tasks<'_, T, U, I::IntoIter>
    where
        F: Fn(T) -> U + Send + Sync + 'static,
        T: Serialize + DeserializeOwned,
        U: Serialize + DeserializeOwned,
        I: IntoIterator<Item = T>,
    {
        let () = Stateless::<F>::OK;
        let _ = f;
        self.tasks::<Plain<F>, T, U, I>(items, true)
    }

    /// Like [`Pool::imap`], but each result comes out as soon as it is done.
    pub fn imap_unordered<F, T, U, I>(&mut self, f: F, items: I) -> Tasks<'_, T, U, I::IntoIter>
    where
        F: Fn(T) -> U + Send + Sync + 'static,
        T: Serialize + DeserializeOwned,
        U: Serialize + DeserializeOwned,
        I: IntoIterator<Item = T>,
    {
        let () = Stateless::<F>::OK;
        let _ = f;
        self.tasks::<Plain<F>, T, U, I>(items, false)
    }

    /// Python's `starmap`: each item is a tuple of arguments, `f(a, b)` for an item
    /// `(a, b)` (tuples of 1 to 4 elements, see [`StarFn`]); the results in order.
    ///
    /// ```no_run
    /// # fn main() -> tensorshare::Result<()> {
    /// let mut pool = tensorshare::Pool::new(2)?;
    /// let sums = pool.starmap(|a: u32, b: u32| a + b, vec![(1, 2), (3, 4)])?;
    /// assert_eq!(sums, vec![3, 7]);
    /// # Ok(())
    /// # }
    /// ```
    pub fn starmap<F, A, I>(&mut self, f: F, items: I) -> Result<Vec<F::Output>>
    where
        F: StarFn<A>,
        A: Serialize + DeserializeOwned,
        I: IntoIterator<Item = A>,
    {
        self.istarmap(f, items).collect()
    }

    /// [`Pool::starmap`] as a stream of results in order, like [`Pool::imap`] (and
    /// [`Tasks::chunksize`] applies).
    pub fn istarmap<F, A, I>(&mut self, f: F, items: I) -> Tasks<'_, A, F::Output, I::IntoIter>
    where
        F: StarFn<A>,
        A: Serialize + DeserializeOwned,
        I: IntoIterator<Item = A>,
    {
        let () = Stateless::<F>::OK;
        let _ = f;
        self.tasks::<Star<F>, A, F::Output, I>(items, true)
    }

    /// Python's `apply_async`: runs `f(arg)` on the next free worker and returns at once.
    /// Any number may be in flight, alongside `map`s and `imap`s: each result goes to its
    /// own [`AsyncResult`]. The error is only for an `arg` that cannot be encoded.
    pub fn apply_async<F, T, U>(&self, f: F, arg: T) -> Result<AsyncResult<U>>
    where
        F: Fn(T) -> U + Send + Sync + 'static,
        T: Serialize + DeserializeOwned,
        U: Serialize + DeserializeOwned,
    {
        let () = Stateless::<F>::OK;
        let _ = f;
        let name = JobName::of(TaskDesc::<Plain<F>, T>::DESC)?;
        // A slice, as the chunk of one item the worker decodes as a `Vec<T>`.
        let payload = wire::encode(std::slice::from_ref(&arg))?;
        let mut inner = lock(&self.inner);
        let batch = inner.open_batch();
        inner.enqueue(batch, name, payload);
        drop(inner);
        Ok(AsyncResult::new(self.inner.clone(), batch))
    }

    fn tasks<C, T, U, I>(&mut self, items: I, ordered: bool) -> Tasks<'_, T, U, I::IntoIter>
    where
        C: Call<T, Out = U>,
        T: Serialize + DeserializeOwned,
        U: Serialize + DeserializeOwned,
        I: IntoIterator<Item = T>,
    {
        let entry = JobName::of(TaskDesc::<C, T>::DESC).map_err(|e| e.to_string());
        Tasks::new(self, entry, items.into_iter(), ordered)
    }
}

impl Drop for Pool {
    fn drop(&mut self) {
        let workers = {
            let mut inner = lock(&self.inner);
            inner.closed = true;
            inner.queued.clear();
            std::mem::take(&mut inner.workers)
        };
        let mut contexts = Vec::with_capacity(workers.len());
        for w in workers {
            // Hanging up tells the worker to finish; it exits on its own.
            drop(w.sock);
            contexts.push(w.ctx);
        }
        for mut ctx in contexts {
            // One that does not finish in time is killed when its context drops.
            let _ = ctx.join(Some(Duration::from_secs(1)));
        }
    }
}
