//! [`Pool`]: a fixed set of worker processes that run tasks (torch's / Python's
//! `multiprocessing.Pool`): `map`, `imap` (ordered, streaming), `imap_unordered`,
//! `starmap`, `apply_async`, chunks of items, and an initializer with arguments.
//!
//! Each worker has its own socket. A task is two records (which function and how many
//! items, then the chunk of items); the worker answers with one record per item, sent as
//! soon as that item is done, so that the parent always knows which item a worker was
//! running when it died. A task that panics fails alone and its worker goes on; a worker
//! that dies fails the item it was running with its [`ProcessError`] (naming the item), the
//! rest of its chunk with an error that says so, and is replaced.
//!
//! Every call (`imap`, `map`, one `apply_async`) is a *batch* with its own number. Results
//! are filed by batch and item index in the pool's shared state, whoever happens to read
//! them off a socket: an `AsyncResult` waiting may read a `map`'s results and the other way
//! round, and neither takes the other's. A batch whose owner is gone (an `imap` iterator
//! dropped early, an `AsyncResult` dropped) has its results discarded.

use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};
use std::marker::PhantomData;
use std::os::fd::{AsFd, OwnedFd};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use rustix::event::{PollFd, PollFlags};
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

use super::context::{reap, ProcessContext};
use super::job::{Desc, InitEntry, JobName, JobResult, TaskEntry};
use super::pool_async::{AsyncResult, StarFn};
use super::worker::{catch, install_panic_hook, Report};
use super::{start_processes, StartMethod};
use crate::channel::socket::{self, Deadline, Record};
use crate::channel::{pipe, Connection};
use crate::wire::{self, Encoded};
use crate::{Error, Failure, ProcessError, Result};

/// What became of one item, as the worker sends it.
#[derive(Serialize, Deserialize)]
enum ItemOutcome<U> {
    Ok(U),
    Raised { message: String, location: Option<String>, backtrace: Option<String> },
}

fn conjure<F>() -> F {
    assert_eq!(std::mem::size_of::<F>(), 0);
    // SAFETY: F is a zero-sized closure (or a wrapper of one) that captures nothing (checked
    // at compile time by `ZeroSized`, and above): it has no bytes and no invariants.
    unsafe { std::mem::zeroed() }
}

/// How a task's function is applied to one item: `f(item)` ([`Plain`]) or `f(a, b, ..)`
/// for a tuple item ([`Star`]).
pub(crate) trait Call<T>: Send + Sync + 'static {
    type Out: Serialize + DeserializeOwned;
    fn call(&self, item: T) -> Self::Out;
}

/// `f(item)`.
pub(crate) struct Plain<F>(F);
/// `f(a, b, ..)` for an item `(a, b, ..)`.
pub(crate) struct Star<F>(F);

impl<F, T, U> Call<T> for Plain<F>
where
    F: Fn(T) -> U + Send + Sync + 'static,
    U: Serialize + DeserializeOwned,
{
    type Out = U;
    fn call(&self, item: T) -> U {
        (self.0)(item)
    }
}

impl<F, A> Call<A> for Star<F>
where
    F: StarFn<A>,
{
    type Out = F::Output;
    fn call(&self, item: A) -> F::Output {
        self.0.call_with(item)
    }
}

fn task_entry<C, T>(record: Record, count: usize, emit: &mut dyn FnMut(Encoded) -> JobResult) -> JobResult
where
    C: Call<T>,
    T: DeserializeOwned,
{
    let raised = |message: String| ItemOutcome::<C::Out>::Raised { message, location: None, backtrace: None };
    let items: Vec<T> = match record.decode() {
        Ok(items) => items,
        Err(e) => {
            for _ in 0..count {
                emit(
                    wire::encode(&raised(format!("cannot decode the task: {e}")))
                        .map_err(|e| e.to_string())?,
                )?;
            }
            return Ok(());
        }
    };
    let f = conjure::<C>();
    for item in items {
        let mut out = None;
        let outcome = match catch(|| {
            out = Some(f.call(item));
            Ok(())
        }) {
            Report::Raised { message, location, backtrace } => {
                ItemOutcome::Raised { message, location, backtrace }
            }
            _ => match out {
                Some(v) => ItemOutcome::Ok(v),
                None => raised("the task produced no result".into()),
            },
        };
        let encoded = match wire::encode(&outcome) {
            Ok(m) => m,
            Err(e) => {
                wire::encode(&raised(format!("cannot encode the result: {e}"))).map_err(|e| e.to_string())?
            }
        };
        emit(encoded)?;
    }
    Ok(())
}

fn init_entry<I, A>(rank: usize, record: Record) -> JobResult
where
    I: Fn(usize, A),
    A: DeserializeOwned,
{
    let args: A = record.decode().map_err(|e| format!("cannot decode the initializer's arguments: {e}"))?;
    conjure::<I>()(rank, args);
    Ok(())
}

fn rank_init_entry<I: Fn(usize)>(rank: usize, _: Record) -> JobResult {
    conjure::<I>()(rank);
    Ok(())
}

/// The descriptor of `task_entry::<C, T>` (see `job`).
struct TaskDesc<C, T>(PhantomData<(C, T)>);

impl<C: Call<T>, T: DeserializeOwned> TaskDesc<C, T> {
    const DESC: &'static Desc<TaskEntry> = &Desc::new(std::any::type_name::<(C, T)>, task_entry::<C, T>);
}

/// The descriptor of `init_entry::<I, A>`.
struct InitDesc<I, A>(PhantomData<(I, A)>);

impl<I: Fn(usize, A), A: DeserializeOwned> InitDesc<I, A> {
    const DESC: &'static Desc<InitEntry> = &Desc::new(std::any::type_name::<(I, A)>, init_entry::<I, A>);
}

/// The descriptor of `rank_init_entry::<I>`.
struct RankInitDesc<I>(PhantomData<I>);

impl<I: Fn(usize)> RankInitDesc<I> {
    const DESC: &'static Desc<InitEntry> = &Desc::new(std::any::type_name::<I>, rank_init_entry::<I>);
}

/// A task's error that does not say which item it was about (a result that cannot be
/// decoded, an item that could not be sent) gets the index.
fn name_task(e: Error, index: usize) -> Error {
    match e {
        Error::Process(p) => Error::Process(p),
        e => Error::Task { index, source: Arc::new(e) },
    }
}

/// The worker's loop: the initializer, then tasks until the pool hangs up. Its rank in the
/// pool comes with its arguments (each worker is started alone, as rank 0).
fn pool_worker(_: usize, (conn, init, rank): (Connection<()>, Option<JobName>, usize)) -> JobResult {
    install_panic_hook();
    let fd = conn.socket().clone();
    let recv = || socket::recv(fd.as_fd(), Deadline::after(None), &|| true);
    if let Some(name) = init {
        let f = name.resolve::<InitEntry>()?;
        f(rank, recv().map_err(|e| e.to_string())?)?;
    }
    // A map sends the same name with every chunk: it is checked once.
    let mut last: Option<(JobName, TaskEntry)> = None;
    loop {
        let head = match recv() {
            Ok(r) => r,
            Err(Error::Disconnected) => return Ok(()),
            Err(e) => return Err(e.to_string()),
        };
        let (name, count): (JobName, usize) = head.decode().map_err(|e| e.to_string())?;
        let entry = match &last {
            Some((known, entry)) if *known == name => *entry,
            _ => {
                let entry = name.resolve::<TaskEntry>()?;
                last = Some((name, entry));
                entry
            }
        };
        let payload = recv().map_err(|e| e.to_string())?;
        let mut emit = |m: Encoded| {
            socket::send(fd.as_fd(), m, Deadline::after(None), &|| true).map_err(|e| e.to_string())
        };
        entry(payload, count, &mut emit)?;
    }
}

struct Worker {
    ctx: ProcessContext,
    sock: OwnedFd,
    /// The chunk it runs.
    task: Option<InFlight>,
}

impl Worker {
    fn rank(&self) -> usize {
        self.ctx.children[0].rank
    }

    fn pid(&self) -> i32 {
        self.ctx.children[0].pid.as_raw_nonzero().get()
    }
}

/// A chunk sent to a worker: the batch it belongs to, its first item's index, how many
/// items it has, and how many of their results came back (the next one is running).
#[derive(Clone, Copy)]
struct InFlight {
    batch: u64,
    first: usize,
    count: usize,
    done: usize,
}

/// One item's result, read off a worker's socket and not yet taken by its batch's owner.
pub(crate) struct Filed {
    index: usize,
    rank: usize,
    pid: i32,
    outcome: std::result::Result<Record, Error>,
}

impl Filed {
    /// The item's value, or its error naming the item.
    pub(crate) fn decode<U: DeserializeOwned>(self) -> Result<U> {
        let index = self.index;
        match self.outcome?.decode::<ItemOutcome<U>>() {
            Ok(ItemOutcome::Ok(v)) => Ok(v),
            Ok(ItemOutcome::Raised { message, location, backtrace }) => Err(Error::Process(ProcessError {
                rank: self.rank,
                pid: self.pid,
                task: Some(index),
                failure: Failure::Task { index, message, location, backtrace },
            })),
            Err(e) => Err(name_task(e, index)),
        }
    }
}

/// A task of `apply_async` waiting for a free worker.
struct Queued {
    batch: u64,
    name: JobName,
    payload: Encoded,
}

/// The initializer's name and how to encode its arguments (once per worker started).
struct Initializer {
    name: JobName,
    args: Box<dyn Fn() -> Result<Encoded> + Send + Sync>,
}

/// What the pool, its iterators and its `AsyncResult`s share.
pub(crate) struct Inner {
    workers: Vec<Worker>,
    /// The number of the next batch.
    batches: u64,
    method: StartMethod,
    init: Option<Initializer>,
    queued: VecDeque<Queued>,
    /// Batches whose owner still wants their results.
    live: HashSet<u64>,
    /// Results waiting for their owner, per batch, in the order they came.
    filed: HashMap<u64, VecDeque<Filed>>,
    /// The pool was dropped: nothing more will run.
    closed: bool,
}

impl Inner {
    /// A new batch, whose results are kept until [`Inner::forget`].
    pub(crate) fn open_batch(&mut self) -> u64 {
        let b = self.batches;
        self.batches += 1;
        self.live.insert(b);
        b
    }

    /// The batch's owner is gone: its results, and its tasks not yet sent, are dropped.
    pub(crate) fn forget(&mut self, batch: u64) {
        self.live.remove(&batch);
        self.filed.remove(&batch);
        self.queued.retain(|q| q.batch != batch);
    }

    pub(crate) fn take_filed(&mut self, batch: u64) -> Option<Filed> {
        let q = self.filed.get_mut(&batch)?;
        let f = q.pop_front();
        if q.is_empty() {
            self.filed.remove(&batch);
        }
        f
    }

    pub(crate) fn is_closed(&self) -> bool {
        self.closed
    }

    fn file(&mut self, batch: u64, f: Filed) {
        if self.live.contains(&batch) {
            self.filed.entry(batch).or_default().push_back(f);
        }
    }

    fn start(&self, rank: usize) -> Result<Worker> {
        let (ours, theirs) = pipe::<()>()?;
        let init = self.init.as_ref().map(|i| i.name.clone());
        let mut ctx = start_processes(pool_worker, (theirs, init, rank), 1, self.method)?;
        ctx.children[0].rank = rank;
        let sock = ours.socket().try_clone().map_err(|e| Error::io("dup of a pool socket", e))?;
        if let Some(init) = &self.init {
            socket::send(sock.as_fd(), (init.args)()?, Deadline::after(None), &|| true)?;
        }
        Ok(Worker { ctx, sock, task: None })
    }

    fn idle(&self) -> Option<usize> {
        self.workers.iter().position(|w| w.task.is_none())
    }

    /// Sends a chunk of `count` items, starting at `first`, to worker `wi`.
    fn send(
        &mut self,
        wi: usize,
        batch: u64,
        first: usize,
        count: usize,
        name: &JobName,
        payload: Result<Encoded>,
    ) -> Result<()> {
        let w = &mut self.workers[wi];
        socket::send(w.sock.as_fd(), wire::encode(&(name, count))?, Deadline::after(None), &|| true)?;
        socket::send(w.sock.as_fd(), payload?, Deadline::after(None), &|| true)?;
        w.task = Some(InFlight { batch, first, count, done: 0 });
        Ok(())
    }

    /// Gives idle workers the queued `apply_async` tasks.
    fn dispatch_queued(&mut self) {
        while let (Some(wi), false) = (self.idle(), self.queued.is_empty()) {
            let Some(q) = self.queued.pop_front() else { break };
            if let Err(e) = self.send(wi, q.batch, 0, 1, &q.name, Ok(q.payload)) {
                let (rank, pid) = (self.workers[wi].rank(), self.workers[wi].pid());
                self.file(q.batch, Filed { index: 0, rank, pid, outcome: Err(name_task(e, 0)) });
            }
        }
    }

    pub(crate) fn enqueue(&mut self, batch: u64, name: JobName, payload: Encoded) {
        self.queued.push_back(Queued { batch, name, payload });
        self.dispatch_queued();
    }

    /// Waits up to `timeout` (forever: `None`) for results or deaths of busy workers, and
    /// files what came. Returns at once when no worker is busy.
    pub(crate) fn pump(&mut self, timeout: Option<Duration>) -> Result<()> {
        self.dispatch_queued();
        let busy: Vec<usize> = (0..self.workers.len()).filter(|&i| self.workers[i].task.is_some()).collect();
        if busy.is_empty() {
            return Ok(());
        }
        let mut fds: Vec<PollFd<'_>> = Vec::with_capacity(busy.len() * 2);
        for &i in &busy {
            let w = &self.workers[i];
            fds.push(PollFd::new(&w.sock, PollFlags::IN));
            fds.push(PollFd::new(&w.ctx.children[0].pidfd, PollFlags::IN));
        }
        let ts = timeout.map(|t| rustix::event::Timespec {
            tv_sec: t.as_secs().min(i64::MAX as u64) as i64,
            tv_nsec: i64::from(t.subsec_nanos()),
        });
        match rustix::event::poll(&mut fds, ts.as_ref()) {
            Ok(_) | Err(rustix::io::Errno::INTR) => {}
            Err(e) => return Err(Error::io("poll on pool workers", e)),
        }
        let ready: Vec<(usize, bool, bool)> = busy
            .iter()
            .enumerate()
            .map(|(k, &i)| (i, !fds[2 * k].revents().is_empty(), !fds[2 * k + 1].revents().is_empty()))
            .collect();
        drop(fds);
        for (i, sock_ready, died) in ready {
            let mut hung_up = false;
            if sock_ready {
                hung_up = self.read_results(i);
            }
            if (died || hung_up) && self.workers[i].task.is_some() {
                self.replace(i)?;
            } else if died {
                // It died after its last result: replace it before it is given more.
                self.replace(i)?;
            }
        }
        self.dispatch_queued();
        Ok(())
    }

    /// Files every result waiting on worker `i`'s socket; true when the socket is closed or
    /// broken (the worker is gone).
    fn read_results(&mut self, i: usize) -> bool {
        loop {
            let w = &mut self.workers[i];
            let Some(mut t) = w.task else { return false };
            let (rank, pid) = (w.rank(), w.pid());
            let outcome = match socket::try_recv(w.sock.as_fd()) {
                Ok(socket::Received::Record(r)) => Ok(r),
                Ok(socket::Received::Empty) => return false,
                Ok(socket::Received::Closed) | Err(_) => return true,
                Ok(socket::Received::Bad(e)) => Err(e),
            };
            let index = t.first + t.done;
            t.done += 1;
            w.task = (t.done < t.count).then_some(t);
            self.file(t.batch, Filed { index, rank, pid, outcome: outcome.map_err(|e| name_task(e, index)) });
        }
    }

    /// A worker died: the item it ran fails with how it died, the rest of its chunk with
    /// an error that says so, and a new worker takes its place.
    fn replace(&mut self, i: usize) -> Result<()> {
        let w = &mut self.workers[i];
        let child = &mut w.ctx.children[0];
        reap(child, true);
        let death = child.outcome.clone().flatten().unwrap_or(ProcessError {
            rank: child.rank,
            pid: child.pid.as_raw_nonzero().get(),
            task: None,
            failure: Failure::Lost { reason: "the worker hung up".into() },
        });
        if let Some(t) = w.task.take() {
            let culprit = t.first + t.done;
            for index in culprit..t.first + t.count {
                let e = if index == culprit {
                    ProcessError { task: Some(index), ..death.clone() }
                } else {
                    ProcessError {
                        task: Some(index),
                        failure: Failure::Lost {
                            reason: format!(
                                "did not run it: it died running item {culprit} of the same chunk ({death})"
                            ),
                        },
                        ..death.clone()
                    }
                };
                let f = Filed { index, rank: death.rank, pid: death.pid, outcome: Err(Error::Process(e)) };
                self.file(t.batch, f);
            }
        }
        let rank = self.workers[i].rank();
        self.workers[i] = self.start(rank)?;
        Ok(())
    }
}

/// Locks the shared state; a panic elsewhere while it was held leaves it consistent
/// enough to go on (at worst a result is lost, and its owner sees the worker's error).
pub(crate) fn lock(inner: &Mutex<Inner>) -> MutexGuard<'_, Inner> {
    inner.lock().unwrap_or_else(|e| e.into_inner())
}

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

/// How a [`Pool`] is made: its start method and initializer. From [`Pool::builder`].
pub struct PoolBuilder {
    n: usize,
    method: StartMethod,
    init: Option<std::result::Result<Initializer, Error>>,
}

impl std::fmt::Debug for PoolBuilder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PoolBuilder").field("n", &self.n).field("method", &self.method).finish()
    }
}

impl PoolBuilder {
    /// How the workers are started ([`StartMethod::Spawn`] unless told).
    pub fn method(mut self, method: StartMethod) -> PoolBuilder {
        self.method = method;
        self
    }

    /// Each worker runs `init(rank, args)` once before its first task, a worker that
    /// replaces a dead one included (Python's `initializer` and `initargs`). `init` must
    /// capture nothing; `args` travels as a message to every worker started, so tensors in
    /// it are shared, not copied.
    pub fn initializer<I, A>(mut self, init: I, args: A) -> PoolBuilder
    where
        I: Fn(usize, A) + Send + Sync + 'static,
        A: Serialize + DeserializeOwned + Send + Sync + 'static,
    {
        let () = ZeroSized::<I>::OK;
        let _ = init;
        self.init = Some(
            JobName::of(InitDesc::<I, A>::DESC)
                .map(|name| Initializer { name, args: Box::new(move || wire::encode(&args)) }),
        );
        self
    }

    /// Starts the workers.
    pub fn build(self) -> Result<Pool> {
        Pool::build(self.n, self.method, self.init.transpose()?)
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
        let () = ZeroSized::<I>::OK;
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
        let () = ZeroSized::<F>::OK;
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
        let () = ZeroSized::<F>::OK;
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
        let () = ZeroSized::<F>::OK;
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
        let () = ZeroSized::<F>::OK;
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

struct ZeroSized<F>(PhantomData<F>);
impl<F> ZeroSized<F> {
    const OK: () = assert!(
        std::mem::size_of::<F>() == 0,
        "tensorshare: a pool task runs in another process and must capture nothing; pass data in the items"
    );
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
    fn new(pool: &'p mut Pool, entry: std::result::Result<JobName, String>, items: I, ordered: bool) -> Self {
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
    /// with how it died, and the rest of its chunk with [`Failure::Lost`].
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
        while let (false, Some(wi)) = (self.exhausted, inner.idle()) {
            let chunk: Vec<T> = self.items.by_ref().take(self.chunksize).collect();
            if chunk.is_empty() {
                self.exhausted = true;
                break;
            }
            let (first, count) = (self.next_index, chunk.len());
            self.next_index += count;
            let sent = match &self.entry {
                Ok(name) => inner.send(wi, self.batch, first, count, name, wire::encode(&chunk)),
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
