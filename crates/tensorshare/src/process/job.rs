//! What a worker runs: a closure that captures nothing (the same binary has the same code),
//! or one made with [`closure!`](crate::closure) whose captured state travels with it.
//!
//! A job is named across processes by the address of its monomorphised entry function,
//! relative to an anchor function: the worker runs the same executable (re-executed from
//! `/proc/self/exe`, or forked), so the offset names the same code there.

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

use crate::channel::socket::Record;
use crate::wire;

/// A job's outcome as the worker sees it: Ok, or the error's text.
pub type JobResult = std::result::Result<(), String>;

/// What a worker closure may return: `()` or `Result<(), E: Display>`.
pub trait JobReturn {
    /// The outcome, with an error's `Display` text.
    fn into_job_result(self) -> JobResult;
}

impl JobReturn for () {
    fn into_job_result(self) -> JobResult {
        Ok(())
    }
}

impl<E: std::fmt::Display> JobReturn for std::result::Result<(), E> {
    fn into_job_result(self) -> JobResult {
        self.map_err(|e| e.to_string())
    }
}

/// Something a worker can run with `(rank, args)`. Implemented for closures that capture
/// nothing and for [`Captured`] (made by [`closure!`](crate::closure)).
pub trait Job<A>: Send + Sync + 'static {
    /// The state that travels with the job (`()` for a closure that captures nothing).
    type State: Serialize + DeserializeOwned;

    /// The state to send.
    fn state(&self) -> &Self::State;

    /// Runs the job in the worker, from its state.
    fn run(state: Self::State, rank: usize, args: A) -> JobResult;
}

const CAPTURES: &str = "tensorshare: a worker closure runs in another process and must capture nothing; \
pass data through the `args` argument, or write tensorshare::closure!([a, b] |rank, args| ...) to send \
serializable captured variables along";

struct AssertZst<F>(std::marker::PhantomData<F>);
impl<F> AssertZst<F> {
    const OK: () = assert!(std::mem::size_of::<F>() == 0, "{}", CAPTURES);
}

impl<F, A, R> Job<A> for F
where
    F: Fn(usize, A) -> R + Send + Sync + 'static,
    R: JobReturn,
{
    type State = ();

    fn state(&self) -> &() {
        let () = AssertZst::<F>::OK;
        &()
    }

    fn run(_: (), rank: usize, args: A) -> JobResult {
        let () = AssertZst::<F>::OK;
        // SAFETY: F is zero-sized (checked at compile time above) and captures nothing, so
        // it has no bytes and no invariants to uphold: any "value" of it is the closure.
        let f: F = unsafe { std::mem::zeroed() };
        f(rank, args).into_job_result()
    }
}

/// A job with captured state that travels to the worker: made by
/// [`closure!`](crate::closure).
pub struct Captured<S, G> {
    state: S,
    _g: std::marker::PhantomData<G>,
}

impl<S, G> Captured<S, G> {
    /// Pairs `state` with a function of `(state, rank, args)` that captures nothing.
    pub fn new<A, R>(state: S, _f: G) -> Captured<S, G>
    where
        G: Fn(S, usize, A) -> R,
    {
        Captured { state, _g: std::marker::PhantomData }
    }
}

impl<S, G, A, R> Job<A> for Captured<S, G>
where
    S: Serialize + DeserializeOwned + Send + Sync + 'static,
    G: Fn(S, usize, A) -> R + Send + Sync + 'static,
    R: JobReturn,
{
    type State = S;

    fn state(&self) -> &S {
        let () = AssertZst::<G>::OK;
        &self.state
    }

    fn run(state: S, rank: usize, args: A) -> JobResult {
        let () = AssertZst::<G>::OK;
        // SAFETY: as for plain closures: G is zero-sized and captures nothing.
        let g: G = unsafe { std::mem::zeroed() };
        g(state, rank, args).into_job_result()
    }
}

/// A worker closure that takes variables along: `closure!([a, b] |rank, args| body)`. The
/// listed variables are moved into the job and must be serializable (tensors and queues
/// included); the body may use them and nothing else from outside.
///
/// ```
/// let scale = 2.0f32;
/// let job = tensorshare::closure!([scale] |rank, x: f32| {
///     let _ = (rank, x * scale);
/// });
/// # let _ = job;
/// ```
#[macro_export]
macro_rules! closure {
    ([$($cap:ident),* $(,)?] |$rank:ident $(: $rt:ty)?, $args:tt $(: $at:ty)?| $body:expr) => {
        $crate::process::Captured::new(
            ($($cap,)*),
            |__tensorshare_state, $rank $(: $rt)?, $args $(: $at)?| {
                #[allow(unused_variables)]
                let ($($cap,)*) = __tensorshare_state;
                $body
            },
        )
    };
}

/// The worker side of a job: decodes `(rank, state, args)` from the job record and runs.
pub(crate) type Entry = fn(Record) -> JobResult;

pub(crate) fn entry<J: Job<A>, A: DeserializeOwned>(record: Record) -> JobResult {
    let (rank, state, args): (usize, J::State, A) =
        record.decode().map_err(|e| format!("cannot decode the job's arguments: {e}"))?;
    J::run(state, rank, args)
}

#[inline(never)]
fn anchor() {}

/// How the parent names an entry function to the worker.
#[derive(Serialize, Deserialize, Debug, Clone, Copy)]
pub(crate) struct EntryName {
    offset: isize,
    /// The offset of a second function: equal on both sides only in the same executable.
    check: isize,
}

fn addr(f: usize) -> isize {
    f as isize - anchor as fn() as usize as isize
}

impl EntryName {
    pub(crate) fn of(f: Entry) -> EntryName {
        EntryName { offset: addr(f as usize), check: addr(entry_check as fn() as usize) }
    }

    fn address(self) -> Option<usize> {
        if self.check != addr(entry_check as fn() as usize) {
            return None;
        }
        Some((anchor as fn() as usize as isize + self.offset) as usize)
    }

    /// The entry function in this process.
    pub(crate) fn resolve(self) -> Option<Entry> {
        let ptr = self.address()?;
        // SAFETY: this process runs the same executable as the one that made the name (the
        // check offset agrees, and workers are started from /proc/self/exe or by fork), so
        // anchor + offset is the address of the same `fn(Record) -> JobResult` there.
        // Names are made only by `of` from an `Entry`.
        Some(unsafe { std::mem::transmute::<usize, Entry>(ptr) })
    }

    pub(crate) fn of_task(f: fn(Record) -> std::result::Result<wire::Encoded, String>) -> EntryName {
        EntryName { offset: addr(f as usize), check: addr(entry_check as fn() as usize) }
    }

    /// A task function named by `of_task`.
    pub(crate) fn resolve_task(self) -> Option<fn(Record) -> std::result::Result<wire::Encoded, String>> {
        let ptr = self.address()?;
        // SAFETY: as in `resolve`; pool workers only receive names made by `of_task`.
        Some(unsafe {
            std::mem::transmute::<usize, fn(Record) -> std::result::Result<wire::Encoded, String>>(ptr)
        })
    }

    pub(crate) fn of_init(f: fn(usize)) -> EntryName {
        EntryName { offset: addr(f as usize), check: addr(entry_check as fn() as usize) }
    }

    /// An initializer named by `of_init`.
    pub(crate) fn resolve_init(self) -> Option<fn(usize)> {
        let ptr = self.address()?;
        // SAFETY: as in `resolve`; the pool sends only names made by `of_init`.
        Some(unsafe { std::mem::transmute::<usize, fn(usize)>(ptr) })
    }
}

#[inline(never)]
fn entry_check() {
    std::hint::black_box(());
}
