//! [`Dims`]: a tensor's shape or strides, kept inline up to four dimensions.
//!
//! Every received tensor gets a shape and strides, so a `Vec` for each cost two allocations
//! and two frees per tensor on each side of a batch of small tensors. Four dimensions cover
//! scalars, vectors, matrices and NCHW images; longer geometry goes on the heap. Safe code
//! only: the inline buffer is a plain array and its length is checked on every view.

use std::ops::{Deref, DerefMut};

use serde::de::{Deserialize, Deserializer, SeqAccess, Visitor};

const INLINE: usize = 4;

/// A list of dimensions (sizes or strides) that allocates only beyond four of them.
#[derive(Clone)]
pub(crate) enum Dims {
    Inline { len: u8, buf: [usize; INLINE] },
    Heap(Vec<usize>),
}

impl Dims {
    /// No dimensions: a scalar's shape.
    pub(crate) const fn new() -> Dims {
        Dims::Inline { len: 0, buf: [0; INLINE] }
    }

    /// The dimensions copied out into a `Vec`, for public APIs and errors that own one.
    pub(crate) fn into_vec(self) -> Vec<usize> {
        match self {
            Dims::Heap(v) => v,
            inline => inline.to_vec(),
        }
    }

    /// Adds a dimension at the end.
    pub(crate) fn push(&mut self, d: usize) {
        match self {
            Dims::Inline { len, buf } if usize::from(*len) < INLINE => {
                buf[usize::from(*len)] = d;
                *len += 1;
            }
            Dims::Inline { .. } => {
                let mut v = Vec::with_capacity(INLINE * 2);
                v.extend_from_slice(self);
                v.push(d);
                *self = Dims::Heap(v);
            }
            Dims::Heap(v) => v.push(d),
        }
    }

    /// Inserts a dimension at `at`, shifting the later ones along.
    ///
    /// # Panics
    /// If `at` is past the end, as `Vec::insert` does.
    pub(crate) fn insert(&mut self, at: usize, d: usize) {
        assert!(at <= self.len(), "insertion index {at} past the end of {} dims", self.len());
        self.push(d);
        self[at..].rotate_right(1);
    }

    /// Removes and returns the dimension at `at`, shifting the later ones back.
    ///
    /// # Panics
    /// If `at` is out of range, as `Vec::remove` does.
    pub(crate) fn remove(&mut self, at: usize) -> usize {
        match self {
            Dims::Inline { len, buf } => {
                let n = usize::from(*len);
                assert!(at < n, "removal index {at} out of {n} dims");
                let d = buf[at];
                buf[at..n].rotate_left(1);
                *len -= 1;
                d
            }
            Dims::Heap(v) => {
                let d = v.remove(at);
                // Back inline once it fits, so that clones of it stop allocating.
                if v.len() <= INLINE {
                    *self = Dims::from(v.as_slice());
                }
                d
            }
        }
    }
}

impl<'a> IntoIterator for &'a Dims {
    type Item = &'a usize;
    type IntoIter = std::slice::Iter<'a, usize>;

    fn into_iter(self) -> Self::IntoIter {
        self.iter()
    }
}

impl Default for Dims {
    fn default() -> Dims {
        Dims::new()
    }
}

impl Deref for Dims {
    type Target = [usize];

    fn deref(&self) -> &[usize] {
        match self {
            Dims::Inline { len, buf } => &buf[..usize::from(*len)],
            Dims::Heap(v) => v,
        }
    }
}

impl DerefMut for Dims {
    fn deref_mut(&mut self) -> &mut [usize] {
        match self {
            Dims::Inline { len, buf } => &mut buf[..usize::from(*len)],
            Dims::Heap(v) => v,
        }
    }
}

impl From<&[usize]> for Dims {
    fn from(s: &[usize]) -> Dims {
        if s.len() <= INLINE {
            let mut buf = [0; INLINE];
            buf[..s.len()].copy_from_slice(s);
            // The length is at most INLINE, so it fits in a u8.
            Dims::Inline { len: s.len() as u8, buf }
        } else {
            Dims::Heap(s.to_vec())
        }
    }
}

impl From<Vec<usize>> for Dims {
    fn from(v: Vec<usize>) -> Dims {
        if v.len() <= INLINE {
            Dims::from(v.as_slice())
        } else {
            Dims::Heap(v)
        }
    }
}

impl<const N: usize> From<[usize; N]> for Dims {
    fn from(a: [usize; N]) -> Dims {
        Dims::from(&a[..])
    }
}

impl FromIterator<usize> for Dims {
    fn from_iter<I: IntoIterator<Item = usize>>(iter: I) -> Dims {
        let mut d = Dims::new();
        for x in iter {
            d.push(x);
        }
        d
    }
}

/// Read as a sequence of `usize`, the way a `Vec<usize>` (or a slice) is written: the wire
/// keeps its shape. The elements are pushed as they are read, so a length a peer claims
/// reserves nothing beyond what it actually sends.
impl<'de> Deserialize<'de> for Dims {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Dims, D::Error> {
        struct Visit;
        impl<'de> Visitor<'de> for Visit {
            type Value = Dims;

            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a sequence of dimensions")
            }

            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Dims, A::Error> {
                let mut dims = Dims::new();
                while let Some(x) = seq.next_element::<usize>()? {
                    dims.push(x);
                }
                Ok(dims)
            }
        }
        d.deserialize_seq(Visit)
    }
}

impl std::fmt::Debug for Dims {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_list().entries(self.iter()).finish()
    }
}

impl PartialEq for Dims {
    fn eq(&self, other: &Dims) -> bool {
        **self == **other
    }
}

impl Eq for Dims {}

#[cfg(test)]
mod tests {
    use super::Dims;

    #[test]
    fn dims_hold_any_length_inline_or_on_the_heap() {
        for n in 0..12 {
            let v: Vec<usize> = (0..n).map(|i| i * 3 + 1).collect();
            let from_vec = Dims::from(v.clone());
            let from_slice = Dims::from(v.as_slice());
            let collected: Dims = v.iter().copied().collect();
            let mut pushed = Dims::new();
            for &x in &v {
                pushed.push(x);
            }
            for d in [&from_vec, &from_slice, &collected, &pushed] {
                assert_eq!(&d[..], &v[..], "length {n}");
                assert_eq!(d.clone().into_vec(), v);
            }
            assert_eq!(matches!(from_vec, Dims::Inline { .. }), n <= 4, "length {n}");
            assert_eq!(from_vec, pushed);
        }
    }

    #[test]
    fn dims_are_mutable_in_place() {
        let mut d = Dims::from([4, 5, 6]);
        d.swap(0, 2);
        d[1] = 9;
        assert_eq!(&d[..], &[6, 9, 4]);
        assert_ne!(d, Dims::from([6, 9]));
        d.insert(1, 7);
        d.insert(4, 8);
        assert_eq!(&d[..], &[6, 7, 9, 4, 8]);
        assert_eq!(d.remove(0), 6);
        assert_eq!(d.remove(3), 8);
        d.insert(0, 1);
        assert_eq!(&d[..], &[1, 7, 9, 4]);
        d.push(2);
        assert!(matches!(d, Dims::Heap(_)));
        assert_eq!(d.remove(4), 2);
        assert!(matches!(d, Dims::Inline { .. }), "back inline once it fits");
        assert_eq!((&d).into_iter().sum::<usize>(), 21);
        assert_eq!(format!("{d:?}"), "[1, 7, 9, 4]");
    }

    #[test]
    fn dims_read_what_a_vec_or_slice_writes() {
        for n in [0usize, 1, 4, 5, 9] {
            let v: Vec<usize> = (0..n).map(|i| usize::MAX >> i).collect();
            let bytes = postcard::to_allocvec(&v[..]).unwrap();
            let d: Dims = postcard::from_bytes(&bytes).unwrap();
            assert_eq!(&d[..], &v[..]);
        }
        // Every prefix and every one-byte change of an encoding reads as a `Vec` reads it:
        // the same values or an error for both.
        let bytes = postcard::to_allocvec(&[1usize, 300, 70000, 1 << 40, 5, 6][..]).unwrap();
        let mut inputs: Vec<Vec<u8>> = (0..=bytes.len()).map(|n| bytes[..n].to_vec()).collect();
        for i in 0..bytes.len() {
            for b in [0u8, 0x7f, 0x80, 0xff] {
                let mut m = bytes.clone();
                m[i] = b;
                inputs.push(m);
            }
        }
        for input in &inputs {
            let as_vec = postcard::from_bytes::<Vec<usize>>(input).ok();
            let as_dims = postcard::from_bytes::<Dims>(input).ok().map(Dims::into_vec);
            assert_eq!(as_dims, as_vec, "input {input:?}");
        }
        // A claimed length beyond the bytes sent is an error, not an allocation of it.
        let lie = postcard::to_allocvec(&u32::MAX).unwrap();
        assert!(postcard::from_bytes::<Dims>(&lie).is_err());
    }
}
