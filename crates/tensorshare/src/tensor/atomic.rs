//! Lock-free element updates for several processes writing one tensor at once (Hogwild).
//!
//! The view is a raw pointer and a length, never a reference to the elements: other
//! handles may write them at any time. Every operation is one atomic operation on the
//! aligned 8-byte word that holds the element (see [`crate::atomic_bytes`]), the same unit
//! the crate's safe copies use, so atomic updates, copies and fills of the same memory
//! never race, whatever their dtypes.

use std::marker::PhantomData;

use super::Tensor;
use crate::atomic_bytes::{self, WORD};
use crate::{Element, Result};

mod sealed {
    pub trait Sealed {}
}

/// An element type the atomic view supports: `f32`, `f64`, `i32`, `i64`.
pub trait AtomicElement: Element + bytemuck::Pod + sealed::Sealed {
    /// `self + other`, wrapping for integers (as `AtomicI32::fetch_add`).
    #[doc(hidden)]
    fn add(self, other: Self) -> Self;
}

macro_rules! atomic_element {
    ($t:ty, |$a:ident, $b:ident| $add:expr) => {
        impl sealed::Sealed for $t {}
        impl AtomicElement for $t {
            fn add(self, other: $t) -> $t {
                let ($a, $b) = (self, other);
                $add
            }
        }
    };
}

atomic_element!(f32, |a, b| a + b);
atomic_element!(f64, |a, b| a + b);
atomic_element!(i32, |a, b| a.wrapping_add(b));
atomic_element!(i64, |a, b| a.wrapping_add(b));

/// A contiguous tensor seen as atomics: every load, store and add is one atomic operation
/// (relaxed), so threads and processes may update it at once without locks, as Hogwild
/// training does. Made by [`Tensor::atomic`].
///
/// The view finds the tensor's bytes again at each operation: should the storage move into
/// shared memory while the view lives (a clone sent to a worker, or shared), the view's
/// updates follow it rather than landing in the bytes it left. An update made while such a
/// move copies the bytes can be lost, as any write made then (see
/// [`Storage::share_memory`](crate::Storage::share_memory)).
pub struct AtomicView<'a, T: AtomicElement> {
    /// A contiguous host tensor of dtype `T`, which keeps its storage alive.
    tensor: &'a Tensor,
    len: usize,
    _t: PhantomData<T>,
}

impl<'a, T: AtomicElement> AtomicView<'a, T> {
    const SIZE: usize = std::mem::size_of::<T>();

    /// Number of elements.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the view has no elements.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The address of element `i`, checked like slice indexing, where the storage's bytes
    /// are now (a private storage moves once, into shared memory).
    fn at(&self, i: usize) -> *mut u8 {
        assert!(i < self.len, "index {i} is out of range for an atomic view of {} elements", self.len);
        // The pointer is only formed here: element `offset + i` of a contiguous tensor with
        // `i < numel` lies in the storage (check_bounds, run on every tensor).
        self.tensor.elem_ptr(self.tensor.offset + i)
    }

    /// Atomically replaces element `i` by `f(old)`; returns `old`.
    fn update(&self, i: usize, mut f: impl FnMut(T) -> T) -> T {
        let p = self.at(i);
        // SAFETY: `p` is an element of the view, in a host storage that lives as long as the
        // view; elements are aligned to their size (a power of two up to WORD), so the
        // element lies in one aligned word.
        let old = unsafe {
            atomic_bytes::update(p, Self::SIZE, |bytes| {
                let new = f(bytemuck::pod_read_unaligned(bytes));
                bytes.copy_from_slice(bytemuck::bytes_of(&new));
            })
        };
        bytemuck::pod_read_unaligned(&old[..Self::SIZE])
    }

    /// The element at `i` (panics if out of range, as slice indexing).
    pub fn load(&self, i: usize) -> T {
        let mut bytes = [0u8; WORD];
        // SAFETY: `at` checked that element i lies in the view's storage, which lives as
        // long as the view.
        unsafe { atomic_bytes::load(self.at(i), &mut bytes[..Self::SIZE]) };
        bytemuck::pod_read_unaligned(&bytes[..Self::SIZE])
    }

    /// Sets the element at `i` (panics if out of range).
    pub fn store(&self, i: usize, v: T) {
        // SAFETY: as in `load`; the element lies in one aligned word, so the store is one
        // atomic operation.
        unsafe { atomic_bytes::store(self.at(i), bytemuck::bytes_of(&v)) }
    }

    /// Adds `v` to the element at `i` and returns the previous value (panics if out of
    /// range).
    pub fn fetch_add(&self, i: usize, v: T) -> T {
        self.update(i, |old| old.add(v))
    }

    /// Adds `delta[i]` to every element `i` (each addition atomic on its own), for as many
    /// elements as both have.
    pub fn add_slice(&self, delta: &[T]) {
        for (i, d) in delta.iter().enumerate().take(self.len) {
            self.update(i, |old| old.add(*d));
        }
    }

    /// A copy of every element (each read atomic on its own).
    pub fn to_vec(&self) -> Vec<T> {
        (0..self.len).map(|i| self.load(i)).collect()
    }
}

impl Tensor {
    /// The elements as atomics, for lock-free updates from many threads or processes.
    /// Needs a contiguous host tensor of dtype `T`.
    pub fn atomic<T: AtomicElement>(&self) -> Result<AtomicView<'_, T>> {
        self.check_dtype::<T>()?;
        self.check_cpu()?;
        self.check_contiguous()?;
        Ok(AtomicView { tensor: self, len: self.numel(), _t: PhantomData })
    }
}

#[cfg(test)]
mod tests {
    use crate::{DType, Tensor};

    /// Updates per thread (few under Miri, which checks these tests for data races).
    const ROUNDS: usize = if cfg!(miri) { 50 } else { 50_000 };

    #[test]
    fn concurrent_adds_are_not_lost() {
        let t = Tensor::zeros(&[4], DType::F32);
        std::thread::scope(|s| {
            for _ in 0..4 {
                s.spawn(|| {
                    let v = t.atomic::<f32>().unwrap();
                    for _ in 0..ROUNDS {
                        v.add_slice(&[1.0, 2.0, 0.5, -1.0]);
                    }
                });
            }
        });
        let n = 4.0 * ROUNDS as f32;
        assert_eq!(t.to_vec::<f32>().unwrap(), vec![n, 2.0 * n, 0.5 * n, -n]);
    }

    #[test]
    fn two_threads_incrementing_one_element_reach_the_exact_total() {
        let t = Tensor::zeros(&[1], DType::I64);
        let alias = t.clone();
        std::thread::scope(|s| {
            for h in [&t, &alias] {
                s.spawn(move || {
                    let v = h.atomic::<i64>().unwrap();
                    for _ in 0..ROUNDS {
                        v.fetch_add(0, 1);
                    }
                });
            }
        });
        assert_eq!(t.to_vec::<i64>().unwrap(), vec![2 * ROUNDS as i64]);
    }

    #[test]
    fn neighbours_in_one_word_are_updated_independently() {
        // Two i32 elements share an 8-byte word: each thread adds to its own, and neither
        // may undo the other's adds.
        let t = Tensor::zeros(&[2], DType::I32);
        std::thread::scope(|s| {
            for i in 0..2 {
                let t = &t;
                s.spawn(move || {
                    let v = t.atomic::<i32>().unwrap();
                    for _ in 0..ROUNDS {
                        v.fetch_add(i, 1);
                    }
                });
            }
        });
        let v = t.atomic::<i32>().unwrap();
        assert_eq!(v.to_vec(), vec![ROUNDS as i32; 2]);
        v.store(1, -3);
        assert_eq!((v.load(0), v.load(1), v.len()), (ROUNDS as i32, -3, 2));
        assert!(t.atomic::<f32>().is_err(), "the dtype must match");
    }
}
