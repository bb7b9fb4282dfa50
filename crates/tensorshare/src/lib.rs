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
#![warn(missing_docs)]
#![deny(unsafe_op_in_unsafe_fn)]

mod arena;
mod atomic_bytes;
pub mod channel;
#[cfg(feature = "cuda")]
pub mod cuda;
mod dtype;
mod error;
mod nested;
pub mod process;
pub mod shm;
mod sparse;
mod storage;
mod strategy;
mod tensor;
mod thread;
mod util;
mod wire;

pub use channel::{pipe, Connection, Queue, SendError, SimpleQueue};
pub use dtype::{DType, Element};
pub use error::{Error, Result};
pub use nested::NestedTensor;
pub use process::{
    init, spawn, start_processes, Captured, Failure, Job, Pool, ProcessContext, ProcessError, StartMethod,
};
pub use sparse::{SparseLayout, SparseTensor};
pub use storage::Storage;
pub use strategy::{
    get_all_sharing_strategies, get_sharing_strategy, set_sharing_strategy, SharingStrategy, STRATEGY_ENV,
};
pub use tensor::{AtomicElement, AtomicView, Device, Tensor, TensorKind};
pub use thread::{get_thread_name, set_thread_name, MAX_THREAD_NAME};

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

    /// A message back into a value, as a receiver would.
    pub fn decode<T: serde::de::DeserializeOwned>(bytes: &[u8], fds: Vec<OwnedFd>) -> crate::Result<T> {
        crate::wire::decode(bytes, fds, false)
    }
}

/// Lets go of every arena of this process whose slots are all free, and of the arenas the
/// receive cache keeps mapped for speed, so that their memory goes back to the system once
/// no other process maps them; descriptors of received messages kept for later are closed
/// (values received keep their holds). Returns how many of this process's arenas were let go.
pub fn trim_arenas() -> usize {
    arena::settle();
    wire::release_cached_mappings();
    arena::trim()
}
