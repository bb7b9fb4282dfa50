//! [`Weights`]: a model's named tensors, all views of one shared storage, so that a model
//! loaded once travels to any number of processes as one arena handle and every process
//! maps the same pages.
//!
//! # Aliasing and copying
//! - [`Weights::pack`] copies the tensors it is given into one new shared storage: the
//!   result aliases none of them.
//! - [`Weights::get`], [`Weights::iter`] and [`Weights::into_tensors`] hand out the
//!   weights' own tensors: views that alias the one storage, in this process and in every
//!   process the weights were sent to. Writing through one of them (`fill`,
//!   `copy_from_slice`) changes the model for everyone, as sending a tensor does; reading
//!   them is a safe copy (`to_vec`) or an `unsafe` zero-copy borrow (`as_slice`, `view`)
//!   whose contract is that nothing writes the elements meanwhile.
//! - Sending weights (a [`crate::Queue`], a worker's arguments) copies nothing: the
//!   message carries the storage once (one descriptor for its arena) and each tensor's
//!   name and geometry. Serialized outside a message (any other serde format), the
//!   storage's bytes are written once, and the tensors come back as views of one storage.
//!
//! `safetensors` (feature `safetensors`) reads and writes them as files.

mod layout;
#[cfg(feature = "safetensors")]
pub mod safetensors;

use std::borrow::Borrow;
use std::collections::{BTreeMap, HashMap};

use serde::{Deserialize, Serialize};

use crate::{get_sharing_strategy, DType, Error, Result, Storage, Tensor};

/// Named tensors that are views of one storage (a model's weights): in shared memory, in
/// a fixed order, with string metadata.
///
/// Cloning is cheap (the tensors are views). See the module docs on what aliases what.
///
/// ```
/// use tensorshare::{DType, Tensor, Weights};
/// # fn main() -> tensorshare::Result<()> {
/// let w = Tensor::full(&[2, 3], 0.5f32);
/// let b = Tensor::zeros(&[3], DType::F32);
/// let weights = Weights::pack([("layer.weight", &w), ("layer.bias", &b)])?; // one copy
/// assert!(weights.storage().is_shared());
/// assert_eq!(weights.get("layer.weight").unwrap().to_vec::<f32>()?, vec![0.5; 6]);
/// let names: Vec<&str> = weights.names().collect();
/// assert_eq!(names, ["layer.weight", "layer.bias"]);
/// # Ok(())
/// # }
/// ```
#[derive(Clone)]
pub struct Weights {
    storage: Storage,
    tensors: Vec<(String, Tensor)>,
    index: HashMap<String, usize>,
    metadata: BTreeMap<String, String>,
}

impl std::fmt::Debug for Weights {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut m = f.debug_map();
        for (name, t) in &self.tensors {
            m.entry(name, &format_args!("{} {:?}", t.dtype(), t.shape()));
        }
        m.finish()
    }
}

impl Weights {
    /// Weights from tensors that are all views of `storage`; checks that they are and that
    /// no name comes twice.
    pub(crate) fn from_parts(
        storage: Storage,
        tensors: Vec<(String, Tensor)>,
        metadata: BTreeMap<String, String>,
    ) -> Result<Weights> {
        let mut index = HashMap::with_capacity(tensors.len());
        for (i, (name, t)) in tensors.iter().enumerate() {
            if index.insert(name.clone(), i).is_some() {
                return Err(Error::invalid_argument("tensor name", format!("{name:?} names two tensors")));
            }
            if !t.storage().ptr_eq(&storage) {
                return Err(Error::invalid_argument(
                    "tensor",
                    format!("tensor {name:?} is not a view of the weights' storage"),
                ));
            }
        }
        Ok(Weights { storage, tensors, index, metadata })
    }

    /// Copies `tensors` into one new shared storage (current sharing strategy), each
    /// contiguous at a 64-byte-aligned offset, in the order given, and returns them as views
    /// of it. Any strides are fine; CUDA tensors are copied from their device.
    ///
    /// # Errors
    /// If a name comes twice, a tensor is on the meta device (no data), or the shared
    /// memory cannot be had.
    pub fn pack<S: AsRef<str>, T: Borrow<Tensor>>(
        tensors: impl IntoIterator<Item = (S, T)>,
    ) -> Result<Weights> {
        let tensors: Vec<(String, T)> =
            tensors.into_iter().map(|(n, t)| (n.as_ref().to_owned(), t)).collect();
        let mut sizes = Vec::with_capacity(tensors.len());
        for (name, t) in &tensors {
            let t = t.borrow();
            if t.device() == crate::Device::Meta {
                return Err(Error::Device(format!(
                    "tensor {name:?} is on the meta device: it has no data to pack"
                )));
            }
            // Exact: every tensor's byte size fits in isize.
            sizes.push(t.numel() * t.dtype().size());
        }
        let placed = layout::place(&sizes)?;
        let storage = placed.storage(get_sharing_strategy())?;
        let mut views = Vec::with_capacity(tensors.len());
        for ((name, t), &offset) in tensors.into_iter().zip(&placed.offsets) {
            let t = t.borrow();
            let mut view = layout::view(&storage, offset, t.dtype(), t.shape())?;
            // A device tensor comes to the host first (the copies below are host copies).
            #[cfg(feature = "cuda")]
            let t = &t.to_cpu()?;
            t.copy_into(&mut view)?;
            views.push((name, view));
        }
        Weights::from_parts(storage, views, BTreeMap::new())
    }

    /// How many tensors there are.
    pub fn len(&self) -> usize {
        self.tensors.len()
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.tensors.is_empty()
    }

    /// The tensor of this name: a view of the weights' storage (see the module docs).
    pub fn get(&self, name: &str) -> Option<&Tensor> {
        self.index.get(name).map(|&i| &self.tensors[i].1)
    }

    /// The names, in order (a loaded file's order).
    pub fn names(&self) -> impl ExactSizeIterator<Item = &str> {
        self.tensors.iter().map(|(n, _)| n.as_str())
    }

    /// The names and tensors, in order.
    pub fn iter(&self) -> impl ExactSizeIterator<Item = (&str, &Tensor)> {
        self.tensors.iter().map(|(n, t)| (n.as_str(), t))
    }

    /// The string metadata (a safetensors file's `__metadata__`).
    pub fn metadata(&self) -> &BTreeMap<String, String> {
        &self.metadata
    }

    /// The metadata, to change (it travels and is saved with the weights).
    pub fn metadata_mut(&mut self) -> &mut BTreeMap<String, String> {
        &mut self.metadata
    }

    /// The one storage every tensor is a view of (in shared memory, unless the weights
    /// were deserialized from a format other than a message).
    pub fn storage(&self) -> &Storage {
        &self.storage
    }

    /// The names and tensors, in order: views of the one storage, which they keep alive.
    pub fn into_tensors(self) -> Vec<(String, Tensor)> {
        self.tensors
    }
}

impl<'a> IntoIterator for &'a Weights {
    type Item = (&'a str, &'a Tensor);
    type IntoIter = Box<dyn Iterator<Item = (&'a str, &'a Tensor)> + 'a>;

    fn into_iter(self) -> Self::IntoIter {
        Box::new(self.iter())
    }
}

/// What travels: the storage once, and each tensor's name and geometry over it.
#[derive(Serialize)]
struct ReprOut<'a> {
    storage: &'a Storage,
    tensors: Vec<TensorOut<'a>>,
    metadata: &'a BTreeMap<String, String>,
}

#[derive(Serialize)]
struct TensorOut<'a> {
    name: &'a str,
    dtype: DType,
    shape: &'a [usize],
    strides: &'a [usize],
    offset: usize,
}

#[derive(Deserialize)]
struct ReprIn {
    storage: Storage,
    tensors: Vec<TensorIn>,
    metadata: BTreeMap<String, String>,
}

#[derive(Deserialize)]
struct TensorIn {
    name: String,
    dtype: DType,
    shape: crate::tensor::Dims,
    strides: crate::tensor::Dims,
    offset: usize,
}

impl Serialize for Weights {
    fn serialize<S: serde::Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        let tensors = self
            .tensors
            .iter()
            .map(|(name, t)| TensorOut {
                name,
                dtype: t.dtype(),
                shape: t.shape(),
                strides: t.strides(),
                offset: t.storage_offset(),
            })
            .collect();
        ReprOut { storage: &self.storage, tensors, metadata: &self.metadata }.serialize(s)
    }
}

impl<'de> Deserialize<'de> for Weights {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Weights, D::Error> {
        use serde::de::Error as _;
        let r = ReprIn::deserialize(d)?;
        let mut tensors = Vec::with_capacity(r.tensors.len());
        for t in r.tensors {
            // Checked against the storage like any received tensor.
            let view = Tensor::from_storage_owned(r.storage.clone(), t.dtype, t.shape, t.strides, t.offset)
                .map_err(|e| D::Error::custom(format!("weights tensor {:?}: {e}", t.name)))?;
            tensors.push((t.name, view));
        }
        Weights::from_parts(r.storage, tensors, r.metadata).map_err(D::Error::custom)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> Weights {
        let w = Tensor::from_vec((0..6).map(|v| v as f32).collect(), &[2, 3]).unwrap();
        let b = Tensor::from_vec(vec![1i64, -2, 3], &[3]).unwrap();
        let mut weights =
            Weights::pack([("w.t", &w.t().unwrap()), ("b", &b), ("e", &Tensor::zeros(&[0], DType::U8))])
                .unwrap();
        weights.metadata_mut().insert("format".into(), "pt".into());
        weights
    }

    #[test]
    fn pack_copies_into_one_shared_storage() {
        let mut src = Tensor::from_vec(vec![1.0f64, 2.0], &[2]).unwrap();
        let weights = Weights::pack([("x", &src)]).unwrap();
        src.fill(9.0f64).unwrap();
        assert_eq!(weights.get("x").unwrap().to_vec::<f64>().unwrap(), vec![1.0, 2.0], "a copy");
        let w = sample();
        assert!(w.storage().is_shared());
        assert_eq!(w.names().collect::<Vec<_>>(), ["w.t", "b", "e"]);
        assert_eq!(w.get("w.t").unwrap().to_vec::<f32>().unwrap(), vec![0.0, 3.0, 1.0, 4.0, 2.0, 5.0]);
        assert_eq!(w.get("b").unwrap().storage_offset() * 8, 64, "each tensor at a 64-byte boundary");
        assert!(w.iter().all(|(_, t)| t.storage().ptr_eq(w.storage()) && t.is_contiguous()));
        assert!(w.get("nope").is_none());
        let e = Weights::pack([("x", &src), ("x", &src)]).unwrap_err();
        assert!(e.to_string().contains("\"x\" names two tensors"), "{e}");
        assert!(matches!(Weights::pack([("m", Tensor::meta(&[2], DType::F32))]), Err(Error::Device(_))));
        assert!(Weights::pack(Vec::<(&str, Tensor)>::new()).unwrap().is_empty());
    }

    /// Outside a message, the storage's bytes are written once and the tensors come back
    /// as views of one storage.
    #[test]
    fn other_serde_formats_keep_one_storage() {
        let w = sample();
        let bytes = postcard::to_allocvec(&w).unwrap();
        assert!(bytes.len() < w.storage().len() + 200, "the bytes once, not once per tensor");
        let back: Weights = postcard::from_bytes(&bytes).unwrap();
        assert!(!back.storage().ptr_eq(w.storage()));
        assert_eq!(back.names().collect::<Vec<_>>(), w.names().collect::<Vec<_>>());
        assert_eq!(back.metadata(), w.metadata());
        for (name, t) in &back {
            assert!(t.equal(w.get(name).unwrap()) && t.storage().ptr_eq(back.storage()), "{name}");
        }
    }

    #[test]
    fn deserializing_checks_names_and_bounds() {
        let w = sample();
        let storage = w.storage();
        let meta = BTreeMap::new();
        let tensor = |name, offset| TensorOut { name, dtype: DType::I64, shape: &[3], strides: &[1], offset };
        let encode = |tensors| postcard::to_allocvec(&ReprOut { storage, tensors, metadata: &meta }).unwrap();
        let good = encode(vec![tensor("a", 0), tensor("b", 8)]);
        assert_eq!(postcard::from_bytes::<Weights>(&good).unwrap().len(), 2);
        assert!(postcard::from_bytes::<Weights>(&encode(vec![tensor("a", 0), tensor("a", 8)])).is_err());
        assert!(postcard::from_bytes::<Weights>(&encode(vec![tensor("far", 1 << 40)])).is_err());
        let e = Weights::from_parts(
            storage.clone(),
            vec![("x".into(), Tensor::zeros(&[1], DType::U8))],
            meta.clone(),
        )
        .unwrap_err();
        assert!(e.to_string().contains("not a view of the weights' storage"), "{e}");
    }
}
