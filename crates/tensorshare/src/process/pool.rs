//! [`Pool`]: a fixed set of worker processes that run tasks (torch's / Python's
//! `multiprocessing.Pool`): `map`, `imap` (ordered, streaming), `imap_unordered`.
//!
//! Each worker has its own socket: a task is two records (which function, then its
//! argument), a result two records (the outcome, then the value). A task that panics fails
//! alone and its worker goes on; a worker that dies fails the task it had with its
//! [`ProcessError`] and is replaced.

use std::collections::{BTreeMap, VecDeque};
use std::marker::PhantomData;
use std::os::fd::{AsFd, OwnedFd};

use rustix::event::{PollFd, PollFlags};
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

use super::context::{reap, ProcessContext};
use super::job::{Desc, InitEntry, JobName, TaskEntry};
use super::worker::{catch, install_panic_hook, Report};
use super::{start_processes, Failure, ProcessError, StartMethod};
use crate::channel::socket::{self, Deadline};
use crate::channel::{pipe, Connection};
use crate::wire::{self, Encoded};
use crate::{Error, Result};

#[derive(Serialize, Deserialize)]
enum Outcome {
    Ok,
    Raised { message: String, location: Option<String>, backtrace: Option<String> },
}

fn conjure<F>() -> F {
    assert_eq!(std::mem::size_of::<F>(), 0);
    // SAFETY: F is a zero-sized closure that captures nothing (checked at compile time by
    // the const in `Pool::imap`, and above): it has no bytes and no invariants.
    unsafe { std::mem::zeroed() }
}

fn task_entry<F, T, U>(record: socket::Record) -> std::result::Result<Encoded, String>
where
    F: Fn(T) -> U,
    T: DeserializeOwned,
    U: Serialize,
{
    let item: T = record.decode().map_err(|e| format!("cannot decode the task: {e}"))?;
    let out = conjure::<F>()(item);
    wire::encode(&out).map_err(|e| format!("cannot encode the result: {e}"))
}

fn init_entry<I: Fn(usize)>(rank: usize) {
    conjure::<I>()(rank)
}

/// The descriptor of `task_entry::<F, T, U>` (see `job`).
struct TaskDesc<F, T, U>(PhantomData<(F, T, U)>);

impl<F, T, U> TaskDesc<F, T, U>
where
    F: Fn(T) -> U,
    T: DeserializeOwned,
    U: Serialize,
{
    const DESC: &'static Desc<TaskEntry> =
        &Desc::new(std::any::type_name::<(F, T, U)>, task_entry::<F, T, U>);
}

/// The descriptor of `init_entry::<I>`.
struct InitDesc<I>(PhantomData<I>);

impl<I: Fn(usize)> InitDesc<I> {
    const DESC: &'static Desc<InitEntry> = &Desc::new(std::any::type_name::<I>, init_entry::<I>);
}

/// A task's error that does not say which item it was about (a result that cannot be
/// decoded) gets the index.
fn name_task(e: Error, index: usize) -> Error {
    match e {
        Error::Process(p) => Error::Process(p),
        e => Error::InvalidMessage(format!("the result of task {index}: {e}")),
    }
}

/// The worker's loop: tasks until the pool hangs up.
fn pool_worker(
    rank: usize,
    (conn, init): (Connection<()>, Option<(JobName, usize)>),
) -> std::result::Result<(), String> {
    install_panic_hook();
    if let Some((name, _)) = init {
        let f = name.resolve::<InitEntry>()?;
        f(rank);
    }
    let fd = conn.socket().clone();
    // A map sends the same name with every task: it is checked once.
    let mut last: Option<(JobName, TaskEntry)> = None;
    loop {
        let head = match socket::recv(fd.as_fd(), Deadline::after(None), &|| true) {
            Ok(r) => r,
            Err(Error::Disconnected) => return Ok(()),
            Err(e) => return Err(e.to_string()),
        };
        let name: JobName = head.decode().map_err(|e| e.to_string())?;
        let entry = match &last {
            Some((known, entry)) if *known == name => *entry,
            _ => {
                let entry = name.resolve::<TaskEntry>()?;
                last = Some((name, entry));
                entry
            }
        };
        let payload = socket::recv(fd.as_fd(), Deadline::after(None), &|| true).map_err(|e| e.to_string())?;
        let mut result = None;
        let report = catch(|| {
            result = Some(entry(payload)?);
            Ok(())
        });
        let (outcome, value) = match (report, result) {
            (Report::Done, Some(v)) => (Outcome::Ok, Some(v)),
            (Report::Raised { message, location, backtrace }, _) => {
                (Outcome::Raised { message, location, backtrace }, None)
            }
            (_, _) => (
                Outcome::Raised {
                    message: "the task produced no result".into(),
                    location: None,
                    backtrace: None,
                },
                None,
            ),
        };
        let send = |m: Encoded| socket::send(fd.as_fd(), m, Deadline::after(None), &|| true);
        send(wire::encode(&outcome).map_err(|e| e.to_string())?).map_err(|e| e.to_string())?;
        if let Some(v) = value {
            send(v).map_err(|e| e.to_string())?;
        }
    }
}

struct Worker {
    ctx: ProcessContext,
    sock: OwnedFd,
    /// The task it runs.
    task: Option<InFlight>,
}

/// A task sent to a worker: its item's index, and the batch (one `imap` or `map`) it
/// belongs to. A batch whose iterator was dropped early leaves its tasks running; their
/// results are recognised by the batch and discarded, never taken for another's.
#[derive(Clone, Copy)]
struct InFlight {
    index: usize,
    batch: u64,
}

/// A pool of worker processes running tasks. Dropping it ends its workers.
pub struct Pool {
    workers: Vec<Worker>,
    /// The number of the next batch of tasks.
    batches: u64,
    method: StartMethod,
    init: Option<(JobName, usize)>,
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

    /// `n` workers, each running `init(rank)` once before its first task (also a worker
    /// that replaces a dead one). `init` must capture nothing.
    pub fn with_initializer<I>(n: usize, method: StartMethod, init: I) -> Result<Pool>
    where
        I: Fn(usize) + Send + Sync + 'static,
    {
        let () = ZeroSized::<I>::OK;
        let _ = init;
        Pool::build(n, method, Some((JobName::of(InitDesc::<I>::DESC)?, 0)))
    }

    fn build(n: usize, method: StartMethod, init: Option<(JobName, usize)>) -> Result<Pool> {
        if n == 0 {
            return Err(Error::shape("a pool needs at least one worker"));
        }
        let mut pool = Pool { workers: Vec::with_capacity(n), batches: 0, method, init };
        for rank in 0..n {
            let w = pool.start(rank)?;
            pool.workers.push(w);
        }
        Ok(pool)
    }

    fn start(&self, rank: usize) -> Result<Worker> {
        let (ours, theirs) = pipe::<()>()?;
        let mut ctx = start_processes(pool_worker, (theirs, self.init.clone()), 1, self.method)?;
        ctx.children[0].rank = rank;
        let sock = ours.socket().try_clone().map_err(|e| Error::io("dup of a pool socket", e))?;
        Ok(Worker { ctx, sock, task: None })
    }

    /// The workers' process ids.
    pub fn pids(&self) -> Vec<i32> {
        self.workers.iter().flat_map(|w| w.ctx.pids()).collect()
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

    /// `f` applied to every item; results stream out in the items' order as they are done.
    pub fn imap<F, T, U, I>(&mut self, f: F, items: I) -> Tasks<'_, T, U, I::IntoIter>
    where
        F: Fn(T) -> U + Send + Sync + 'static,
        T: Serialize + DeserializeOwned,
        U: Serialize + DeserializeOwned,
        I: IntoIterator<Item = T>,
    {
        self.tasks(f, items, true)
    }

    /// Like [`Pool::imap`], but each result comes out as soon as it is done.
    pub fn imap_unordered<F, T, U, I>(&mut self, f: F, items: I) -> Tasks<'_, T, U, I::IntoIter>
    where
        F: Fn(T) -> U + Send + Sync + 'static,
        T: Serialize + DeserializeOwned,
        U: Serialize + DeserializeOwned,
        I: IntoIterator<Item = T>,
    {
        self.tasks(f, items, false)
    }

    fn tasks<F, T, U, I>(&mut self, f: F, items: I, ordered: bool) -> Tasks<'_, T, U, I::IntoIter>
    where
        F: Fn(T) -> U + Send + Sync + 'static,
        T: Serialize + DeserializeOwned,
        U: Serialize + DeserializeOwned,
        I: IntoIterator<Item = T>,
    {
        let () = ZeroSized::<F>::OK;
        let _ = f;
        let entry = JobName::of(TaskDesc::<F, T, U>::DESC).map_err(|e| e.to_string());
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
        let mut contexts = Vec::with_capacity(self.workers.len());
        for w in std::mem::take(&mut self.workers) {
            // Hanging up tells the worker to finish; it exits on its own.
            drop(w.sock);
            contexts.push(w.ctx);
        }
        for mut ctx in contexts {
            // One that does not finish in time is killed when its context drops.
            let _ = ctx.join(Some(std::time::Duration::from_secs(1)));
        }
    }
}

/// The results of [`Pool::imap`] or [`Pool::imap_unordered`], as an iterator of
/// `Result<U>`: a task that failed yields its error and the others go on.
pub struct Tasks<'p, T, U, I> {
    pool: &'p mut Pool,
    /// The tasks' name, or why the function cannot be named (then every item fails).
    entry: std::result::Result<JobName, String>,
    items: I,
    batch: u64,
    next_index: usize,
    ordered: bool,
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
        let batch = pool.batches;
        pool.batches += 1;
        Tasks {
            pool,
            entry,
            items,
            batch,
            next_index: 0,
            ordered,
            done: BTreeMap::new(),
            done_order: VecDeque::new(),
            next_yield: 0,
            exhausted: false,
            _t: PhantomData,
        }
    }

    fn finish(&mut self, index: usize, r: Result<U>) {
        self.done.insert(index, r);
        self.done_order.push_back(index);
    }

    /// Gives idle workers their next task.
    fn dispatch(&mut self) {
        for wi in 0..self.pool.workers.len() {
            if self.exhausted || self.pool.workers[wi].task.is_some() {
                continue;
            }
            let Some(item) = self.items.next() else {
                self.exhausted = true;
                break;
            };
            let index = self.next_index;
            self.next_index += 1;
            let sent = (|| -> Result<()> {
                let w = &self.pool.workers[wi];
                let entry = self.entry.as_ref().map_err(|e| Error::Unsupported(e.clone()))?;
                socket::send(w.sock.as_fd(), wire::encode(entry)?, Deadline::after(None), &|| true)?;
                socket::send(w.sock.as_fd(), wire::encode(&item)?, Deadline::after(None), &|| true)
            })();
            match sent {
                Ok(()) => self.pool.workers[wi].task = Some(InFlight { index, batch: self.batch }),
                Err(e) => self.finish(index, Err(e)),
            }
        }
    }

    /// Waits for a result or a worker's death, and records it.
    fn collect_one(&mut self) -> Result<()> {
        let busy: Vec<usize> =
            (0..self.pool.workers.len()).filter(|&i| self.pool.workers[i].task.is_some()).collect();
        let mut fds: Vec<PollFd<'_>> = Vec::with_capacity(busy.len() * 2);
        for &i in &busy {
            let w = &self.pool.workers[i];
            fds.push(PollFd::new(&w.sock, PollFlags::IN));
            fds.push(PollFd::new(&w.ctx.children[0].pidfd, PollFlags::IN));
        }
        match rustix::event::poll(&mut fds, None) {
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
            if sock_ready {
                if let Some(r) = self.read_result(i) {
                    let task = self.pool.workers[i].task.take().expect("busy worker");
                    if task.batch == self.batch {
                        let r = r.and_then(|value| value.decode::<U>());
                        self.finish(task.index, r.map_err(|e| name_task(e, task.index)));
                    }
                    continue;
                }
            }
            if died || sock_ready {
                self.replace(i)?;
            }
        }
        Ok(())
    }

    /// The outcome and value record a worker sent, if it sent them.
    fn read_result(&mut self, i: usize) -> Option<Result<socket::Record>> {
        let w = &self.pool.workers[i];
        let rank = w.ctx.children[0].rank;
        let pid = w.ctx.pids()[0];
        let index = w.task.map_or(0, |t| t.index);
        let head = match socket::try_recv(w.sock.as_fd()) {
            Ok(socket::Received::Record(r)) => r,
            _ => return None,
        };
        let outcome: Outcome = match head.decode() {
            Ok(o) => o,
            Err(e) => return Some(Err(e)),
        };
        Some(match outcome {
            Outcome::Raised { message, location, backtrace } => Err(Error::Process(ProcessError {
                rank,
                pid,
                failure: Failure::Task { index, message, location, backtrace },
            })),
            Outcome::Ok => socket::recv(w.sock.as_fd(), Deadline::after(None), &|| true),
        })
    }

    /// A worker died: its task fails with how it died, and a new worker takes its place.
    fn replace(&mut self, i: usize) -> Result<()> {
        let w = &mut self.pool.workers[i];
        let child = &mut w.ctx.children[0];
        reap(child, true);
        let err = child.outcome.clone().flatten().unwrap_or(ProcessError {
            rank: child.rank,
            pid: child.pid.as_raw_nonzero().get(),
            failure: Failure::Lost { reason: "the worker hung up".into() },
        });
        if let Some(task) = w.task.take() {
            if task.batch == self.batch {
                self.finish(task.index, Err(Error::Process(err)));
            }
        }
        let rank = self.pool.workers[i].ctx.children[0].rank;
        self.pool.workers[i] = self.pool.start(rank)?;
        Ok(())
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
            self.dispatch();
            let mine = self.pool.workers.iter().any(|w| w.task.is_some_and(|t| t.batch == self.batch));
            if self.exhausted && !mine && self.done.is_empty() {
                return None;
            }
            // Workers still busy with an abandoned batch are waited for too: they are the
            // ones that take the rest of the items once free.
            if self.pool.workers.iter().any(|w| w.task.is_some()) {
                if let Err(e) = self.collect_one() {
                    return Some(Err(e));
                }
            }
        }
    }
}
