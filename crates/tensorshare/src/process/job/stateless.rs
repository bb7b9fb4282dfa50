//! Closures that capture nothing: a worker's job or a pool's task is named by its type
//! alone, and the worker makes the closure out of nothing. Whether a closure captures
//! anything is checked at compile time, by its size.

use std::marker::PhantomData;

/// What a capturing closure gets at compile time.
const CAPTURES: &str = "tensorshare: a closure that runs in another process (a worker's job, a pool's \
task or initializer) must capture nothing; pass data through the arguments or the items, or write \
tensorshare::closure!([a, b] |rank, args| ...) to send serializable captured variables along";

pub(crate) struct Stateless<F>(PhantomData<F>);

impl<F> Stateless<F> {
    /// Evaluated at compile time wherever a closure of type `F` is accepted: fails the build
    /// if `F` captures anything of nonzero size.
    pub(crate) const OK: () = assert!(std::mem::size_of::<F>() == 0, "{}", CAPTURES);

    /// The closure of type `F`, made out of nothing.
    pub(crate) fn make() -> F {
        let () = Self::OK;
        // SAFETY: F is zero-sized (checked at compile time by `OK`, evaluated above): a
        // closure that captures nothing of nonzero size has no bytes, and the only values
        // it could carry are zero-sized ones, which `zeroed` makes as a copy would.
        unsafe { std::mem::zeroed() }
    }
}
