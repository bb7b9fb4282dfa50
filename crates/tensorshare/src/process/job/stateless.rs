//! Closures that capture nothing: a worker's job or a pool's task is named by its type
//! alone, and the worker makes the closure out of nothing. Whether a closure captures
//! anything is checked at compile time, by its size.
//!
//! The size cannot tell a closure that captures nothing from one that captures only
//! zero-sized values. Those are made anew in the worker, with no constructor run there:
//! harmless for data (a `()`, a `PhantomData`), but a zero-sized type that is `Send`, `Sync`
//! and `'static` and whose existence proves something about the process that made it (an
//! "initialised" token of some library) would be forged in the worker. Do not capture
//! such tokens in a worker closure; pass what the worker needs in its arguments.

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
        // SAFETY: F is zero-sized (checked at compile time by `OK`, evaluated above), so it
        // has no bytes: every value of it has the one empty representation `zeroed` gives,
        // the same as the closure the parent passed (whose code is this binary's, see
        // `name`). What this does not see is a captured zero-sized value whose type makes it
        // a proof of something (a token): see the module docs.
        unsafe { std::mem::zeroed() }
    }
}
