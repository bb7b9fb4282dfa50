//! safetensors files (feature `safetensors`): a model's weights loaded once into shared
//! memory, for any number of processes.
//!
//! [`load`] reads a file into **one** shared storage: one arena allocation big enough for
//! every tensor, each at a 64-byte-aligned offset in it, the file read straight into the
//! shared pages (one copy, from the file; nothing is staged in private memory). It
//! returns [`Weights`]: the tensors, in file order, as views of that storage. Sending the
//! weights to workers (a [`crate::Queue`], a worker's arguments) sends one handle for the
//! whole model, however many tensors it has, and every receiving process maps the same
//! pages: N workers hold the model once, not N times.
//!
//! ```
//! use tensorshare::{safetensors, DType, Tensor};
//! # fn main() -> tensorshare::Result<()> {
//! let dir = std::env::temp_dir().join(format!("tensorshare-doc-{}", std::process::id()));
//! std::fs::create_dir_all(&dir).unwrap();
//! let path = dir.join("model.safetensors");
//! let w = Tensor::from_vec((0..6).map(|v| v as f32).collect(), &[2, 3])?;
//! safetensors::save(&path, [("w", &w), ("wt", &w.t()?)])?; // any strides
//! let weights = safetensors::load(&path)?;
//! assert!(weights.storage().is_shared());
//! assert_eq!(weights.get("wt").unwrap().to_vec::<f32>()?, vec![0.0, 3.0, 1.0, 4.0, 2.0, 5.0]);
//! // weights.clone() into a Queue, or as spawn's arguments: one arena handle for the model.
//! std::fs::remove_dir_all(&dir).unwrap();
//! # Ok(())
//! # }
//! ```
//!
//! # Aliasing and copying
//! - [`load`] copies the file once, into the new shared storage; [`load_bytes`] copies the
//!   buffer once, into the new shared storage. Neither aliases its source afterwards.
//! - The tensors of the result alias that storage, in every process the weights reach
//!   (see [`Weights`]).
//! - [`save`], [`save_with_metadata`] and [`save_bytes`] copy the tensors' elements out
//!   (safe copies, a few MiB at a time, whatever their strides; CUDA tensors from their
//!   device): they never borrow the shared memory.
//!
//! # Dtypes and checks
//! The file's `BOOL`, `U8`, `I8`, `I16`, `I32`, `I64`, `F16`, `BF16`, `F32` and `F64` are
//! [`DType`](crate::DType)'s ten types; any other (`U16`, `F8_E4M3`, ...) is an
//! [`Error::Unsupported`](crate::Error::Unsupported) that names the tensor and its dtype.
//! Everything else in a file is checked before use (see `header`): a file that breaks the
//! format is an [`Error::Parse`](crate::Error::Parse) naming the file and the tensor, and
//! a `BOOL` byte other than 0 or 1 too. No file makes this module panic or reach outside
//! the storage it made.

mod header;
mod read;
mod write;

use std::borrow::Borrow;
use std::collections::BTreeMap;
use std::path::Path;

use crate::{Result, Tensor, Weights};

/// Reads a safetensors file into [`Weights`]: every tensor in one new shared storage (the
/// current sharing strategy), each at a 64-byte-aligned offset, read straight from the
/// file into the shared pages, in file order, with the file's `__metadata__`.
///
/// # Errors
/// [`Error::Io`](crate::Error::Io) if the file cannot be read,
/// [`Error::Parse`](crate::Error::Parse) if it is no valid safetensors file,
/// [`Error::Unsupported`](crate::Error::Unsupported) for a dtype tensorshare has no type
/// for, and the errors of shared memory (see [`crate::Storage`]).
pub fn load(path: impl AsRef<Path>) -> Result<Weights> {
    read::load(path.as_ref())
}

/// [`load`] from a buffer holding a whole safetensors file (copied once, into the shared
/// storage).
///
/// # Errors
/// As [`load`].
pub fn load_bytes(bytes: &[u8]) -> Result<Weights> {
    read::load_bytes(bytes)
}

/// Writes `tensors` (any strides, on the host or a CUDA device) to a safetensors file at
/// `path`, replacing it only once the new file is complete.
///
/// Tensors are written by element size, largest first, and otherwise in the order given
/// (so each one's data is aligned to its element size in the file); [`load`] returns them
/// in that order. Saving [`Weights`] is `save(path, &weights)`.
///
/// # Errors
/// If a name comes twice or is `__metadata__`, a tensor is on the meta device, or the
/// file cannot be written.
pub fn save<S: AsRef<str>, T: Borrow<Tensor>>(
    path: impl AsRef<Path>,
    tensors: impl IntoIterator<Item = (S, T)>,
) -> Result<()> {
    save_with_metadata(path, tensors, &BTreeMap::new())
}

/// [`save`] with string metadata (the header's `__metadata__`; [`Weights::metadata`]
/// after [`load`]).
///
/// # Errors
/// As [`save`].
pub fn save_with_metadata<S: AsRef<str>, T: Borrow<Tensor>>(
    path: impl AsRef<Path>,
    tensors: impl IntoIterator<Item = (S, T)>,
    metadata: &BTreeMap<String, String>,
) -> Result<()> {
    let owned: Vec<(String, T)> = tensors.into_iter().map(|(n, t)| (n.as_ref().to_owned(), t)).collect();
    let refs = owned.iter().map(|(n, t)| (n.clone(), t.borrow())).collect();
    write::save(path.as_ref(), &write::prepare(refs, metadata)?)
}

/// What [`save_with_metadata`] would write, as bytes in memory.
///
/// # Errors
/// As [`save`], and if the bytes cannot be allocated.
pub fn save_bytes<S: AsRef<str>, T: Borrow<Tensor>>(
    tensors: impl IntoIterator<Item = (S, T)>,
    metadata: &BTreeMap<String, String>,
) -> Result<Vec<u8>> {
    let owned: Vec<(String, T)> = tensors.into_iter().map(|(n, t)| (n.as_ref().to_owned(), t)).collect();
    let refs = owned.iter().map(|(n, t)| (n.clone(), t.borrow())).collect();
    let prepared = write::prepare(refs, metadata)?;
    let mut out = Vec::new();
    out.try_reserve_exact(prepared.total())
        .map_err(|_| crate::Error::AllocationFailed { bytes: prepared.total() })?;
    prepared.write_to(&mut out, "a safetensors buffer")?;
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::DType;

    /// Files written here are what the safetensors crate reads, and the other way round.
    #[test]
    fn files_are_the_safetensors_crates_own() {
        let a = Tensor::from_vec((0..12).map(|v| v as f32 * 0.5).collect(), &[3, 4]).unwrap();
        let m = Tensor::from_vec(vec![true, false, true], &[3]).unwrap();
        let meta: BTreeMap<String, String> = [("format".to_owned(), "pt".to_owned())].into();
        let ours = save_bytes([("a.t", &a.t().unwrap()), ("m", &m)], &meta).unwrap();
        let theirs = ::safetensors::SafeTensors::deserialize(&ours).unwrap();
        let at = theirs.tensor("a.t").unwrap();
        assert_eq!((at.dtype(), at.shape()), (::safetensors::Dtype::F32, &[4, 3][..]));
        assert_eq!(at.data(), a.t().unwrap().to_bytes().unwrap());
        assert_eq!(theirs.tensor("m").unwrap().data(), &[1, 0, 1]);

        let views = [("m", theirs.tensor("m").unwrap()), ("a.t", at)];
        let written =
            ::safetensors::serialize(views, Some([("k".to_owned(), "v".to_owned())].into())).unwrap();
        let back = load_bytes(&written).unwrap();
        assert!(back.get("a.t").unwrap().equal(&a.t().unwrap()));
        assert_eq!(back.get("m").unwrap().dtype(), DType::Bool);
        assert_eq!(back.metadata().get("k").map(String::as_str), Some("v"));
    }
}
