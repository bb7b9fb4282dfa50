//! Lock-free element updates for several processes writing one tensor at once (Hogwild).

use std::marker::PhantomData;
use std::sync::atomic::{AtomicI32, AtomicI64, AtomicU32, AtomicU64, Ordering};

use super::Tensor;
use crate::{Element, Result};

mod sealed {
    pub trait Sealed {}
}

/// An element type with an atomic counterpart of the same size.
pub trait AtomicElement: Element + sealed::Sealed {
    #[doc(hidden)]
    type Atomic: Sync;
    #[doc(hidden)]
    fn load(a: &Self::Atomic) -> Self;
    #[doc(hidden)]
    fn store(a: &Self::Atomic, v: Self);
    #[doc(hidden)]
    fn fetch_add(a: &Self::Atomic, v: Self) -> Self;
}

macro_rules! float_atomic {
    ($t:ty, $a:ty) => {
        impl sealed::Sealed for $t {}
        impl AtomicElement for $t {
            type Atomic = $a;
            fn load(a: &$a) -> $t {
                <$t>::from_bits(a.load(Ordering::Relaxed))
            }
            fn store(a: &$a, v: $t) {
                a.store(v.to_bits(), Ordering::Relaxed)
            }
            fn fetch_add(a: &$a, v: $t) -> $t {
                let prev = a.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |bits| {
                    Some((<$t>::from_bits(bits) + v).to_bits())
                });
                // fetch_update with a closure that always returns Some cannot fail.
                <$t>::from_bits(prev.unwrap_or_else(|b| b))
            }
        }
    };
}

macro_rules! int_atomic {
    ($t:ty, $a:ty) => {
        impl sealed::Sealed for $t {}
        impl AtomicElement for $t {
            type Atomic = $a;
            fn load(a: &$a) -> $t {
                a.load(Ordering::Relaxed)
            }
            fn store(a: &$a, v: $t) {
                a.store(v, Ordering::Relaxed)
            }
            fn fetch_add(a: &$a, v: $t) -> $t {
                a.fetch_add(v, Ordering::Relaxed)
            }
        }
    };
}

float_atomic!(f32, AtomicU32);
float_atomic!(f64, AtomicU64);
int_atomic!(i32, AtomicI32);
int_atomic!(i64, AtomicI64);

/// A contiguous tensor seen as atomics: every load, store and add is one atomic operation
/// (relaxed), so threads and processes may update it at once without locks, as Hogwild
/// training does. Made by [`Tensor::atomic`].
pub struct AtomicView<'a, T: AtomicElement> {
    cells: &'a [T::Atomic],
    _t: PhantomData<T>,
}

impl<'a, T: AtomicElement> AtomicView<'a, T> {
    /// Number of elements.
    pub fn len(&self) -> usize {
        self.cells.len()
    }

    /// Whether the view has no elements.
    pub fn is_empty(&self) -> bool {
        self.cells.is_empty()
    }

    /// The element at `i` (panics if out of range, as slice indexing).
    pub fn load(&self, i: usize) -> T {
        T::load(&self.cells[i])
    }

    /// Sets the element at `i`.
    pub fn store(&self, i: usize, v: T) {
        T::store(&self.cells[i], v)
    }

    /// Adds `v` to the element at `i` and returns the previous value.
    pub fn fetch_add(&self, i: usize, v: T) -> T {
        T::fetch_add(&self.cells[i], v)
    }

    /// Adds `delta[i]` to every element `i` (each addition atomic on its own).
    pub fn add_slice(&self, delta: &[T]) {
        for (c, d) in self.cells.iter().zip(delta) {
            T::fetch_add(c, *d);
        }
    }

    /// A copy of every element.
    pub fn to_vec(&self) -> Vec<T> {
        self.cells.iter().map(T::load).collect()
    }
}

impl Tensor {
    /// The elements as atomics, for lock-free updates from many threads or processes.
    /// Needs a contiguous CPU tensor of dtype `T`.
    pub fn atomic<T: AtomicElement>(&self) -> Result<AtomicView<'_, T>> {
        let bytes = self.as_slice::<T>()?;
        let (ptr, len) = (bytes.as_ptr(), bytes.len());
        // SAFETY: `T::Atomic` has the size and alignment of `T` (std guarantees this for
        // the atomic integer types; f32/f64 map to AtomicU32/AtomicU64 of equal size), the
        // elements are aligned for T (storages are 64-byte aligned and offsets are whole
        // elements), in bounds and live as long as `&self`. Atomics may alias other atomic
        // accesses to the same memory.
        let cells = unsafe { std::slice::from_raw_parts(ptr.cast::<T::Atomic>(), len) };
        Ok(AtomicView { cells, _t: PhantomData })
    }
}

#[cfg(test)]
mod tests {
    use crate::{DType, Tensor};

    #[test]
    fn concurrent_adds_are_not_lost() {
        let t = Tensor::zeros(&[4], DType::F32);
        std::thread::scope(|s| {
            for _ in 0..4 {
                s.spawn(|| {
                    let v = t.atomic::<f32>().unwrap();
                    for _ in 0..1000 {
                        v.add_slice(&[1.0, 2.0, 0.5, -1.0]);
                    }
                });
            }
        });
        assert_eq!(t.to_vec::<f32>().unwrap(), vec![4000.0, 8000.0, 2000.0, -4000.0]);
    }
}
