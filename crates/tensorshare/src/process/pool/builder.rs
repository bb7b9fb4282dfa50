//! [`PoolBuilder`]: how a [`Pool`] is made, its start method and its initializer.

use serde::de::DeserializeOwned;
use serde::Serialize;

use super::task::InitDesc;
use super::Pool;
use crate::process::job::JobName;
use crate::process::job::Stateless;
use crate::process::StartMethod;
use crate::wire::{self, Encoded};
use crate::{Error, Result};

/// The initializer's name and how to encode its arguments (once per worker started).
pub(super) struct Initializer {
    pub(super) name: JobName,
    pub(super) args: Box<dyn Fn() -> Result<Encoded> + Send + Sync>,
}

/// How a [`Pool`] is made: its start method and initializer. From [`Pool::builder`].
pub struct PoolBuilder {
    pub(super) n: usize,
    pub(super) method: StartMethod,
    pub(super) init: Option<std::result::Result<Initializer, Error>>,
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
        let () = Stateless::<I>::OK;
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
