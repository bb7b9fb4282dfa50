//! A pool task as a worker runs it: how the function is applied to each item of a chunk
//! (`f(item)`, or `f(a, b, ..)` for [`Pool::starmap`](crate::Pool::starmap)), what it
//! sends back per item, the entries a parent names the function and the initializer by,
//! and the worker's loop.

use std::marker::PhantomData;
use std::os::fd::AsFd;

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

use crate::channel::socket::{self, Deadline, Record};
use crate::channel::Connection;
use crate::process::job::Stateless;
use crate::process::job::{Desc, InitEntry, JobName, JobResult, TaskEntry};
use crate::process::worker::{catch, install_panic_hook, Report};
use crate::wire::{self, Encoded};
use crate::Error;

/// What became of one item, as the worker sends it.
#[derive(Serialize, Deserialize)]
pub(super) enum ItemOutcome<U> {
    Ok(U),
    Raised { message: String, location: Option<String>, backtrace: Option<String> },
}

/// How a task's function is applied to one item: `f(item)` ([`Plain`]) or `f(a, b, ..)`
/// for a tuple item ([`Star`]).
pub(super) trait Call<T>: Send + Sync + 'static {
    type Out: Serialize + DeserializeOwned;
    fn call(&self, item: T) -> Self::Out;
}

/// `f(item)`.
pub(super) struct Plain<F>(F);
/// `f(a, b, ..)` for an item `(a, b, ..)`.
pub(super) struct Star<F>(F);

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

/// A function of several arguments that [`Pool::starmap`](crate::Pool::starmap) applies to
/// tuple items: `Fn(A) -> U` takes `(A,)`, `Fn(A, B) -> U` takes `(A, B)`, up to four. Like
/// every pool task it must capture nothing.
pub trait StarFn<Args>: Send + Sync + 'static {
    /// What the function returns.
    type Output: Serialize + DeserializeOwned;

    /// `self(a, b, ..)` for `args` = `(a, b, ..)`.
    fn call_with(&self, args: Args) -> Self::Output;
}

macro_rules! star_fn {
    ($($a:ident),+) => {
        impl<F, U, $($a),+> StarFn<($($a,)+)> for F
        where
            F: Fn($($a),+) -> U + Send + Sync + 'static,
            U: Serialize + DeserializeOwned,
        {
            type Output = U;

            #[allow(non_snake_case)]
            fn call_with(&self, ($($a,)+): ($($a,)+)) -> U {
                self($($a),+)
            }
        }
    };
}

star_fn!(A);
star_fn!(A, B);
star_fn!(A, B, C);
star_fn!(A, B, C, D);

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
    let f = Stateless::<C>::make();
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
    Stateless::<I>::make()(rank, args);
    Ok(())
}

fn rank_init_entry<I: Fn(usize)>(rank: usize, _: Record) -> JobResult {
    Stateless::<I>::make()(rank);
    Ok(())
}

/// The descriptor of `task_entry::<C, T>` (see `job`).
pub(super) struct TaskDesc<C, T>(PhantomData<(C, T)>);

impl<C: Call<T>, T: DeserializeOwned> TaskDesc<C, T> {
    pub(super) const DESC: &'static Desc<TaskEntry> =
        &Desc::new(std::any::type_name::<(C, T)>, task_entry::<C, T>);
}

/// The descriptor of `init_entry::<I, A>`.
pub(super) struct InitDesc<I, A>(PhantomData<(I, A)>);

impl<I: Fn(usize, A), A: DeserializeOwned> InitDesc<I, A> {
    pub(super) const DESC: &'static Desc<InitEntry> =
        &Desc::new(std::any::type_name::<(I, A)>, init_entry::<I, A>);
}

/// The descriptor of `rank_init_entry::<I>`.
pub(super) struct RankInitDesc<I>(PhantomData<I>);

impl<I: Fn(usize)> RankInitDesc<I> {
    pub(super) const DESC: &'static Desc<InitEntry> =
        &Desc::new(std::any::type_name::<I>, rank_init_entry::<I>);
}

/// The worker's loop: the initializer, then tasks until the pool hangs up. Its rank in the
/// pool comes with its arguments (each worker is started alone, as rank 0).
pub(super) fn pool_worker(
    _: usize,
    (conn, init, rank): (Connection<()>, Option<JobName>, usize),
) -> JobResult {
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
