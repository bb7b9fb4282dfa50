//! The pool's shared state: its workers, the chunk each one runs, the `apply_async` tasks
//! waiting for a free worker, and the results filed per batch until their owner takes
//! them. Whoever waits (a `map`, an `imap` iterator, an `AsyncResult`) moves it along with
//! [`Inner::pump`], which reads results off the sockets and replaces dead workers.

use std::collections::{HashMap, HashSet, VecDeque};
use std::os::fd::{AsFd, OwnedFd};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use rustix::event::{PollFd, PollFlags};
use serde::de::DeserializeOwned;

use super::builder::Initializer;
use super::task::{pool_worker, ItemOutcome};
use crate::channel::pipe;
use crate::channel::socket::{self, Deadline, Record};
use crate::channel::Outgoing;
use crate::process::context::{reap, ProcessContext};
use crate::process::job::JobName;
use crate::process::{start_processes, StartMethod};
use crate::wire::{self, Encoded};
use crate::{Error, Failure, ProcessError, Result};

/// A task's error that does not say which item it was about (a result that cannot be
/// decoded, an item that could not be sent) gets the index.
pub(super) fn name_task(e: Error, index: usize) -> Error {
    match e {
        Error::Process(p) => Error::Process(p),
        e => Error::Task { index, source: Arc::new(e) },
    }
}

pub(super) struct Worker {
    pub(super) ctx: ProcessContext,
    pub(super) sock: OwnedFd,
    /// The chunk it runs.
    pub(super) task: Option<InFlight>,
}

impl Worker {
    pub(super) fn rank(&self) -> usize {
        self.ctx.children[0].rank
    }

    pub(super) fn pid(&self) -> i32 {
        self.ctx.children[0].pid.as_raw_nonzero().get()
    }
}

/// A chunk sent to a worker: the batch it belongs to, its first item's index, how many
/// items it has, and how many of their results came back (the next one is running).
#[derive(Clone, Copy)]
pub(super) struct InFlight {
    pub(super) batch: u64,
    pub(super) first: usize,
    pub(super) count: usize,
    pub(super) done: usize,
}

/// One item's result, read off a worker's socket and not yet taken by its batch's owner.
pub(super) struct Filed {
    pub(super) index: usize,
    pub(super) rank: usize,
    pub(super) pid: i32,
    pub(super) outcome: std::result::Result<Record, Error>,
}

impl Filed {
    /// The item's value, or its error naming the item.
    pub(super) fn decode<U: DeserializeOwned>(self) -> Result<U> {
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
pub(super) struct Queued {
    pub(super) batch: u64,
    pub(super) name: JobName,
    pub(super) payload: Encoded,
}

/// What the pool, its iterators and its `AsyncResult`s share.
pub(super) struct Inner {
    pub(super) workers: Vec<Worker>,
    /// The number of the next batch.
    pub(super) batches: u64,
    pub(super) method: StartMethod,
    pub(super) init: Option<Initializer>,
    pub(super) queued: VecDeque<Queued>,
    /// Batches whose owner still wants their results.
    pub(super) live: HashSet<u64>,
    /// Results waiting for their owner, per batch, in the order they came.
    pub(super) filed: HashMap<u64, VecDeque<Filed>>,
    /// The pool was dropped: nothing more will run.
    pub(super) closed: bool,
}

impl Inner {
    /// A new batch, whose results are kept until [`Inner::forget`].
    pub(super) fn open_batch(&mut self) -> u64 {
        let b = self.batches;
        self.batches += 1;
        self.live.insert(b);
        b
    }

    /// The batch's owner is gone: its results, and its tasks not yet sent, are dropped.
    pub(super) fn forget(&mut self, batch: u64) {
        self.live.remove(&batch);
        self.filed.remove(&batch);
        self.queued.retain(|q| q.batch != batch);
    }

    pub(super) fn take_filed(&mut self, batch: u64) -> Option<Filed> {
        let q = self.filed.get_mut(&batch)?;
        let f = q.pop_front();
        if q.is_empty() {
            self.filed.remove(&batch);
        }
        f
    }

    pub(super) fn is_closed(&self) -> bool {
        self.closed
    }

    pub(super) fn file(&mut self, batch: u64, f: Filed) {
        if self.live.contains(&batch) {
            self.filed.entry(batch).or_default().push_back(f);
        }
    }

    pub(super) fn start(&self, rank: usize) -> Result<Worker> {
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

    /// A worker with nothing to run, after replacing those that died while idle (killed
    /// between tasks: their sockets are not watched then, so this is where that shows).
    pub(super) fn idle(&mut self) -> Result<Option<usize>> {
        let idle: Vec<usize> = (0..self.workers.len()).filter(|&i| self.workers[i].task.is_none()).collect();
        let mut fds: Vec<PollFd<'_>> = idle
            .iter()
            .map(|&i| PollFd::new(&self.workers[i].ctx.children[0].pidfd, PollFlags::IN))
            .collect();
        let zero = rustix::event::Timespec { tv_sec: 0, tv_nsec: 0 };
        match rustix::event::poll(&mut fds, Some(&zero)) {
            Ok(_) | Err(rustix::io::Errno::INTR) => {}
            Err(e) => return Err(Error::io("poll on pool workers", e)),
        }
        let dead: Vec<usize> =
            idle.iter().zip(&fds).filter(|(_, fd)| !fd.revents().is_empty()).map(|(&i, _)| i).collect();
        drop(fds);
        for i in dead {
            self.replace(i)?;
        }
        Ok(idle.first().copied())
    }

    /// Sends a chunk of `count` items, starting at `first`, to an idle worker (the caller
    /// has seen one with `idle`). A worker that turns out to be dead (it died since `idle`
    /// looked) never got the chunk: it is replaced, and the chunk goes to an idle worker
    /// again (usually that replacement).
    pub(super) fn send(
        &mut self,
        batch: u64,
        first: usize,
        count: usize,
        name: &JobName,
        payload: Result<Encoded>,
    ) -> Result<()> {
        let head = wire::encode(&(name, count))?;
        let mut body = Outgoing::new(payload?)?;
        // A bounded number of tries (one more than there are workers): workers that die as
        // soon as they start (a failing initializer) do not keep this call going. Then the
        // chunk fails with how the last of them died.
        let mut death = None;
        for _ in 0..=self.workers.len() {
            let Some(wi) = self.idle()? else { break };
            let w = &mut self.workers[wi];
            let mut head = Outgoing::new(Encoded::bytes_only(head.bytes.clone()))?;
            let sent = socket::send_framed(w.sock.as_fd(), &mut head, Deadline::after(None), &|| true)
                .and_then(|()| {
                    socket::send_framed(w.sock.as_fd(), &mut body, Deadline::after(None), &|| true)
                });
            match sent {
                Ok(()) => {
                    w.task = Some(InFlight { batch, first, count, done: 0 });
                    return Ok(());
                }
                Err(Error::Disconnected) => death = Some(self.replace(wi)?),
                Err(e) => return Err(e),
            }
        }
        Err(death.map_or(Error::Disconnected, Error::Process))
    }

    /// Gives idle workers the queued `apply_async` tasks.
    pub(super) fn dispatch_queued(&mut self) {
        while !self.queued.is_empty() {
            match self.idle() {
                Ok(Some(_)) => {}
                Ok(None) => break, // every worker is busy: the next free one takes it
                Err(e) => {
                    // No worker to replace a dead one (it could not be started): the task
                    // fails with why, rather than wait for a worker that will not come.
                    if let Some(q) = self.queued.pop_front() {
                        self.fail(q.batch, 0, e);
                    }
                    continue;
                }
            }
            let Some(q) = self.queued.pop_front() else { break };
            if let Err(e) = self.send(q.batch, 0, 1, &q.name, Ok(q.payload)) {
                self.fail(q.batch, 0, e);
            }
        }
    }

    /// Files the error of an item that never reached a worker.
    pub(super) fn fail(&mut self, batch: u64, index: usize, e: Error) {
        // No worker ran it: rank and pid are only read for errors a worker raised.
        self.file(batch, Filed { index, rank: 0, pid: 0, outcome: Err(name_task(e, index)) });
    }

    pub(super) fn enqueue(&mut self, batch: u64, name: JobName, payload: Encoded) {
        self.queued.push_back(Queued { batch, name, payload });
        self.dispatch_queued();
    }

    /// Waits up to `timeout` (forever: `None`) for results or deaths of busy workers, and
    /// files what came. Returns at once when no worker is busy.
    pub(super) fn pump(&mut self, timeout: Option<Duration>) -> Result<()> {
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
    pub(super) fn read_results(&mut self, i: usize) -> bool {
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
    /// an error that says so, and a new worker takes its place. Returns how it died.
    pub(super) fn replace(&mut self, i: usize) -> Result<ProcessError> {
        let w = &mut self.workers[i];
        let child = &mut w.ctx.children[0];
        if child.outcome.is_none() {
            // (Reaped already if it was replaced before and its replacement could not start.)
            reap(child, true);
        }
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
        Ok(death)
    }
}

/// Locks the shared state; a panic elsewhere while it was held leaves it consistent
/// enough to go on (at worst a result is lost, and its owner sees the worker's error).
pub(super) fn lock(inner: &Mutex<Inner>) -> MutexGuard<'_, Inner> {
    inner.lock().unwrap_or_else(|e| e.into_inner())
}
