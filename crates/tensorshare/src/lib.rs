//! tensorshare: tensors shared between processes without copying — torch.multiprocessing
//! for Rust.
//!
//! Tensors live in shared memory (memfd or named segments), cut from a few large arenas;
//! any serde value holding them travels through queues, pipes and process arguments as a
//! small message plus the arenas' descriptors, and the receiver maps the same pages.
//!
//! ```
//! use tensorshare::{DType, Tensor};
//!
//! # fn main() -> tensorshare::Result<()> {
//! let mut x = Tensor::zeros(&[5, 5], DType::F32);
//! x.share_memory()?; // in place: x.is_shared() is now true
//! let mut col = x.narrow(1, 1, 1)?; // a view of the same shared memory
//! col.fill(4.0f32)?;
//! assert_eq!(x.to_vec::<f32>()?[1], 4.0);
//! assert!(col.is_shared());
//! # Ok(())
//! # }
//! ```
//!
//! # Aliasing and what is safe
//! Clones and views of a tensor reach the same bytes, in this process and in every process
//! the tensor was sent to. No safe function can reach undefined behaviour whatever those
//! other handles do at the same time:
//! - copies in and out ([`Tensor::to_vec`], [`Tensor::to_bytes`], [`Tensor::fill`],
//!   [`Tensor::copy_from_slice`], [`Tensor::copy_into`]) and the lock-free [`AtomicView`]
//!   are safe: they access the memory with atomic word operations, so a concurrent writer
//!   causes a mix of old and new values at worst, and every value read is checked to be
//!   valid for its type (`bool`);
//! - zero-copy borrows ([`Tensor::as_slice`], [`Tensor::as_mut_slice`], `view`, `view_mut`)
//!   are `unsafe fn`s: the caller promises that nothing else writes (or, for the `mut`
//!   ones, accesses) the elements while the borrow lives;
//! - [`Tensor::exclusive_slice_mut`] (and `exclusive_view_mut`) borrow without a copy and
//!   without `unsafe` where nothing else can reach the bytes: a private storage whose only
//!   handle is this tensor.
//!
//! As in torch, the program orders accesses for meaningful values: a message on a queue
//! orders what came before `put` before what comes after `get`.
//!
//! # Workers
//! [`spawn`], [`start_processes`] and [`Pool`] run Rust closures in other processes, whose
//! `main` starts with [`init`]. A worker runs a closure: one that captures nothing (the worker runs the same
//! executable, so it has the same code), or one made with [`closure!`](crate::closure)
//! whose captured variables are sent along. Arguments travel as a message, so tensors in
//! them are shared, not copied, and queues and pipes work in the worker.
//!
//! Workers die with their parent (PR_SET_PDEATHSIG). In Linux terms the parent of a
//! [`StartMethod::Spawn`] or [`StartMethod::Fork`] worker is the *thread* that started it:
//! start long-lived workers from a thread that outlives them. A
//! [`StartMethod::ForkServer`] worker is the fork server's child and dies with it; the
//! server lives as long as the process that started it, whatever its threads do.
//!
//! ## Who is a worker, and what it runs
//! A re-executed worker ([`StartMethod::Spawn`], and the fork server) is this program again,
//! told by a variable (`TENSORSHARE_WORKER`, `TENSORSHARE_FORKSERVER`) that it is one. The
//! variable alone proves nothing, so [`init`] makes a process a worker only when its parent
//! proves that it started it as one: descriptor 3 must be an AF_UNIX SOCK_SEQPACKET socket
//! whose peer (SO_PEERCRED, recorded by the kernel) is the parent the variable names, and a
//! hello must already wait on it with the random token the variable holds. Otherwise
//! `init` writes one line to stderr and returns: the program runs as usual, it never waits
//! on a socket it was not given. The same proof guards the shared-memory cleaner, which
//! runs before `main` (see [`segments`]).
//!
//! A parent names the job to run by the loaded object that holds its code (the executable,
//! or a shared library by path), that object's GNU build-id, an offset in it, and a hash of
//! the job's type name. The hello carries the parent's executable identity (file and
//! build-id), and a worker of another executable refuses, with an error its parent
//! reports. A worker then calls the named code only after it has checked that the object
//! is loaded and the same build, and that the bytes at the offset are a job descriptor of
//! the right kind and type; see [`trust_libraries_without_build_id`] for the one check a
//! program can waive, `unsafe`ly. So a worker never jumps to an address that it has not
//! checked to be an entry of this very build, across shared libraries as well
//! (`-C prefer-dynamic`, a job in a `dylib`).
//!
//! # Paths
//! Every item has one path: the crate root, except the tools of the shared-memory
//! directory in [`segments`], with feature `cuda` the device functions in `cuda`, with
//! feature `safetensors` the file functions in `safetensors`, with feature `mpi` distributed
//! communication in `dist`, and the conversions to other libraries in [`interop`] (one module
//! and one feature per library: `dlpack`, `candle`, `burn`). The crates the API speaks are
//! re-exported whole ([`ndarray`], [`half`]), so a program uses the versions tensorshare was
//! built with. The modules behind them are private:
//!
//! ```compile_fail,E0603
//! use tensorshare::process::Pool; // the path is tensorshare::Pool
//! ```
//!
//! ```compile_fail,E0603
//! use tensorshare::channel::Queue; // the path is tensorshare::Queue
//! ```
#![warn(missing_docs)]
#![deny(unsafe_op_in_unsafe_fn)]

// The modules are layers, and imports go down (README, "How it works"; the order and its
// check are in tests/layering.rs). Every public item has one path: the crate root, or
// `segments`, `cuda`, `dist` and `interop` for the few that belong there; the modules
// behind them are private.
mod arena;
mod atomic_bytes;
mod channel;
#[cfg(feature = "cuda")]
pub mod cuda;
mod device;
#[cfg(feature = "mpi")]
pub mod dist;
mod dtype;
mod error;
pub mod interop;
pub mod message;
mod nested;
mod process;
pub mod segments;
mod shm;
mod sparse;
mod storage;
mod strategy;
mod tensor;
mod thread;
mod util;
pub mod value;
mod weights;
mod wire;

/// The half crate whose `f16` and `bf16` are the element types of [`DType::F16`] and
/// [`DType::BF16`].
pub use half;
/// The ndarray crate that [`Tensor::view`], [`Tensor::view_dim`] and [`Tensor::to_array`]
/// speak (feature `ndarray`, on by default): use it through this path, and its version is
/// always the one tensorshare was built with.
#[cfg(feature = "ndarray")]
pub use ndarray;

pub use channel::{
    adopt_forked_queues, flush_queues, pipe, Connection, Queue, SendError, SharedFd, SimpleQueue,
    MAX_MESSAGE_ENV,
};
pub use device::Device;
pub use dtype::{DType, Element};
pub use error::{Error, Failure, ProcessError, Result};
pub use message::Message;
pub use nested::NestedTensor;
pub use process::{
    allow_fork_with_threads, init, set_helper_command, spawn, start_processes,
    trust_libraries_without_build_id, AsyncResult, Captured, Job, JobResult, JobReturn, Pool, PoolBuilder,
    ProcessContext, StarFn, StartMethod, Tasks, DEFAULT_GRACE, WORKER_ARGS,
};
pub use sparse::{SparseLayout, SparseTensor};
pub use storage::Storage;
pub use strategy::{
    get_all_sharing_strategies, get_sharing_strategy, set_sharing_strategy, SharingStrategy, STRATEGY_ENV,
};
pub use tensor::{AtomicElement, AtomicView, Tensor, TensorKind};
pub use thread::{get_thread_name, set_thread_name, MAX_THREAD_NAME};
pub use value::Value;
#[cfg(feature = "safetensors")]
pub use weights::safetensors;
pub use weights::Weights;

/// The bare codec, for tests and hostile-peer tools (feature `test-support`, off by
/// default; not part of the API).
///
/// Decoding is as safe as receiving: a message holds its slots through the descriptors it
/// carries, so a replayed, duplicated or forged message can only add holds.
#[cfg(feature = "test-support")]
#[doc(hidden)]
pub mod raw {
    use std::os::fd::OwnedFd;

    /// `value` as a message: its bytes, and its own descriptors (which hold its slots).
    pub fn encode<T: serde::Serialize + ?Sized>(value: &T) -> crate::Result<(Vec<u8>, Vec<OwnedFd>)> {
        let msg = crate::wire::encode(value)?;
        let fds = msg
            .borrowed_fds()
            .iter()
            .map(|f| f.try_clone_to_owned().map_err(|e| crate::Error::io("dup", e)))
            .collect::<crate::Result<_>>()?;
        Ok((msg.bytes, fds))
    }

    /// Makes this process's reserve of descriptors for receiving now (see README, "loses
    /// nothing"), which its first receive makes otherwise: for tests that count descriptors.
    pub fn keep_descriptors_in_reserve() -> crate::Result<()> {
        crate::shm::fd_reserve::ready()
    }

    /// How many positions of `q`'s lane producers have claimed so far: whether small
    /// messages went through the lane rather than the socket.
    pub fn lane_claimed<T: serde::Serialize + serde::de::DeserializeOwned>(q: &crate::Queue<T>) -> u64 {
        q.lane_claimed()
    }

    /// Takes one of `q`'s places and keeps it, as a producer killed right after taking one
    /// and before writing its record does: whether there was one to take.
    pub fn lose_a_place<T: serde::Serialize + serde::de::DeserializeOwned>(q: &crate::Queue<T>) -> bool {
        q.lose_a_place()
    }

    /// Runs `f` with `q`'s locks of this process held (its lane's, its hold's, its outbox's
    /// look at the socket), as a thread holds them while it waits on other processes, which
    /// no fork guard waits for. For the tests of what a child forked meanwhile can do.
    pub fn with_queue_locks_held<T: serde::Serialize + serde::de::DeserializeOwned, R>(
        q: &crate::Queue<T>,
        f: impl FnOnce() -> R,
    ) -> R {
        q.with_locks_held(f)
    }

    /// The layers whose locks no fork guard takes yet (see `util::fork`): empty from the
    /// moment the library is loaded, before any of it is used.
    pub fn layers_without_fork_guard() -> Vec<String> {
        let registered = crate::util::fork::registered();
        crate::util::fork::Rank::ALL
            .iter()
            .filter(|rank| !registered.contains(rank))
            .map(|rank| format!("{rank:?}"))
            .collect()
    }

    /// Runs `f` while this process's record of `storage`'s arena is locked, as it is while a
    /// thread takes or gives back a handle of one of its slots; `None` for a storage in no
    /// arena. For the tests of what a child forked meanwhile can do.
    pub fn with_arena_record_locked<R>(storage: &crate::Storage, f: impl FnOnce() -> R) -> Option<R> {
        match storage.shared()? {
            crate::storage::Shared::Slot(slot) => Some(slot.arena().with_state_locked(f)),
            _ => None,
        }
    }

    /// Runs `f` with this process's record of its fork server locked, as it is while a server
    /// starts or a request waits for its answer. For the tests of what a child forked
    /// meanwhile can do.
    pub fn with_fork_server_record_locked<R>(f: impl FnOnce() -> R) -> R {
        crate::process::with_fork_server_record_locked(f)
    }

    /// Whether this process holds `storage`'s slot through a description it borrowed (a
    /// received message's, see `arena::borrow`) rather than a lock of its own.
    pub fn borrowed(storage: &crate::Storage) -> bool {
        match storage.shared() {
            Some(crate::storage::Shared::Slot(slot)) => slot.arena().is_borrowed(slot.slot()),
            _ => false,
        }
    }

    /// Whether two storages are slots of one arena.
    pub fn same_arena(a: &crate::Storage, b: &crate::Storage) -> bool {
        match (a.shared(), b.shared()) {
            (Some(crate::storage::Shared::Slot(a)), Some(crate::storage::Shared::Slot(b))) => {
                std::sync::Arc::ptr_eq(a.arena(), b.arena())
            }
            _ => false,
        }
    }

    /// A message back into a value, as a receiver would.
    pub fn decode<T: serde::de::DeserializeOwned>(bytes: &[u8], fds: Vec<OwnedFd>) -> crate::Result<T> {
        crate::wire::decode(bytes, fds, false)
    }

    /// Leaves this process's cleanup group and founds a new one with this process as its
    /// root (see `shm::group`), so that a test's named segments can be told apart from
    /// every other test's. Returns the new root (this process's pid, unless a group of that
    /// number exists already).
    pub fn new_group() -> crate::Result<i32> {
        crate::shm::group::new_group()
    }

    /// The root of this process's cleanup group, joining the inherited one or founding one.
    pub fn ensure_group() -> crate::Result<i32> {
        crate::shm::group::ensure()
    }

    /// The pid of the cleaner this process started for its group, if it founded one.
    pub fn cleaner_pid() -> Option<i32> {
        crate::shm::group::cleaner_pid()
    }

    /// rsmpi, as `dist` uses it: for benchmarks that measure MPI itself beside `dist`.
    #[cfg(feature = "mpi")]
    pub use mpi;
}

/// Lets go of every arena of this process whose slots are all free, and of the arenas the
/// receive cache keeps mapped for speed, so that their memory goes back to the system once
/// no other process maps them; descriptors of received messages kept for later are closed
/// (values received keep their holds), and the queues of this process whose lanes are idle
/// give back what their lanes held for messages already taken (see "How it works" in the
/// README). Returns how many of this process's arenas were let go.
pub fn trim_arenas() -> usize {
    arena::settle();
    channel::close_idle_lanes();
    wire::release_cached_mappings();
    arena::trim()
}
