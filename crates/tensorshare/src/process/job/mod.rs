//! What a worker runs: a closure that captures nothing (the same binary has the same code),
//! or one made with [`closure!`](crate::closure) whose captured state travels with it, and
//! how a parent names it to the worker (`name`).

mod name;
mod stateless;

use serde::de::DeserializeOwned;
use serde::Serialize;

pub use name::trust_libraries_without_build_id;
pub(crate) use name::{entry_name, Desc, Entry, InitEntry, JobName, TaskEntry};
pub(crate) use stateless::Stateless;

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

impl<F, A, R> Job<A> for F
where
    F: Fn(usize, A) -> R + Send + Sync + 'static,
    R: JobReturn,
{
    type State = ();

    fn state(&self) -> &() {
        let () = Stateless::<F>::OK;
        &()
    }

    fn run(_: (), rank: usize, args: A) -> JobResult {
        Stateless::<F>::make()(rank, args).into_job_result()
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
        let () = Stateless::<G>::OK;
        &self.state
    }

    fn run(state: S, rank: usize, args: A) -> JobResult {
        Stateless::<G>::make()(state, rank, args).into_job_result()
    }
}

/// A worker closure that takes variables along: `closure!([a, b] |rank, args| body)`. The
/// listed variables are moved into the job and must be serializable (tensors and queues
/// included); the body may use them and nothing else from outside.
///
/// A capture may be initialised with an expression, evaluated where the closure is made
/// (`[w = w.clone()]` keeps `w` usable there), and the closure may name its return type,
/// which then needs a block body:
///
/// ```
/// let scale = 2.0f32;
/// let w = vec![1.0f32, 2.0];
/// let job = tensorshare::closure!([scale, w = w.clone()] |rank, x: f32| -> Result<(), String> {
///     if w.len() < rank { return Err("no weight for this rank".into()) }
///     let _ = x * scale;
///     Ok(())
/// });
/// # let _ = (job, w);
/// ```
#[macro_export]
macro_rules! closure {
    ([$($cap:ident $(= $init:expr)?),* $(,)?] |$rank:ident $(: $rt:ty)?, $args:tt $(: $at:ty)?| -> $ret:ty $body:block) => {
        $crate::Captured::new(
            ($($crate::closure!(@capture $cap $(= $init)?),)*),
            |__tensorshare_state, $rank $(: $rt)?, $args $(: $at)?| -> $ret {
                #[allow(unused_variables)]
                let ($($cap,)*) = __tensorshare_state;
                $body
            },
        )
    };
    ([$($cap:ident $(= $init:expr)?),* $(,)?] |$rank:ident $(: $rt:ty)?, $args:tt $(: $at:ty)?| $body:expr) => {
        $crate::Captured::new(
            ($($crate::closure!(@capture $cap $(= $init)?),)*),
            |__tensorshare_state, $rank $(: $rt)?, $args $(: $at)?| {
                #[allow(unused_variables)]
                let ($($cap,)*) = __tensorshare_state;
                $body
            },
        )
    };
    (@capture $cap:ident) => {
        $cap
    };
    (@capture $cap:ident = $init:expr) => {
        $init
    };
}
