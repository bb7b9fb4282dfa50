//! The safetensors header: `[u64 little-endian n][n bytes of JSON][data]`, the JSON naming
//! each tensor's dtype, shape and `data_offsets` (a byte range of the data section).
//!
//! Everything in it is checked before it is used, with checked arithmetic, and a file that
//! breaks a rule is an error that names the file (and the tensor): a header length past
//! the end of the file or over the format's 100 MB limit, JSON that is not a header, a
//! shape whose size overflows, offsets that do not match the shape, overlap another
//! tensor's, leave a gap or leave the data section, data left over after the last tensor,
//! a dtype tensorshare has no [`DType`] for. The JSON is read into the safetensors crate's
//! own types; the checks are this module's, so that each error can name its tensor.

use std::collections::{BTreeMap, HashMap};

use ::safetensors::tensor::TensorInfo;
use ::safetensors::Dtype;
use serde::Deserialize;

use crate::{DType, Error, Result};

/// Bytes of the header length field.
pub(super) const N_LEN: usize = 8;
/// The largest header the format allows (the safetensors crate's limit).
pub(super) const MAX_HEADER: usize = 100_000_000;

/// One tensor of a file, checked.
#[derive(Debug)]
pub(super) struct Entry {
    pub(super) name: String,
    pub(super) dtype: DType,
    pub(super) shape: Vec<usize>,
    /// Its bytes in the data section: `start..start + len`.
    pub(super) start: usize,
    pub(super) len: usize,
}

/// A checked header: the tensors in file order (by offset), and the metadata.
#[derive(Debug)]
pub(super) struct Header {
    pub(super) entries: Vec<Entry>,
    pub(super) metadata: BTreeMap<String, String>,
}

pub(super) fn bad(source: &str, why: impl std::fmt::Display) -> Error {
    Error::Parse(format!("{source}: not a valid safetensors file: {why}"))
}

/// The safetensors dtype of a tensorshare dtype.
pub(super) fn to_safetensors(d: DType) -> Dtype {
    match d {
        DType::Bool => Dtype::BOOL,
        DType::U8 => Dtype::U8,
        DType::I8 => Dtype::I8,
        DType::I16 => Dtype::I16,
        DType::I32 => Dtype::I32,
        DType::I64 => Dtype::I64,
        DType::F16 => Dtype::F16,
        DType::BF16 => Dtype::BF16,
        DType::F32 => Dtype::F32,
        DType::F64 => Dtype::F64,
    }
}

/// The tensorshare dtype of a safetensors dtype, if there is one.
pub(super) fn from_safetensors(d: Dtype) -> Option<DType> {
    DType::ALL.into_iter().find(|&t| to_safetensors(t) == d)
}

/// The header's length, from the file's first 8 bytes, checked against the file's `total`
/// length: the header and its length field lie in the file.
pub(super) fn header_len(prefix: [u8; N_LEN], total: u64, source: &str) -> Result<usize> {
    let n = u64::from_le_bytes(prefix);
    if n > MAX_HEADER as u64 {
        return Err(bad(source, format!("its header claims {n} bytes, more than the format's {MAX_HEADER}")));
    }
    let fits = (N_LEN as u64).checked_add(n).is_some_and(|end| end <= total);
    if !fits {
        return Err(bad(source, format!("its header claims {n} bytes, but the file has {total} in all")));
    }
    // At most MAX_HEADER: fits in usize.
    Ok(n as usize)
}

/// The header's JSON, as the format defines it: `__metadata__`, and a map of tensors.
#[derive(Deserialize)]
struct RawHeader {
    #[serde(rename = "__metadata__", default)]
    metadata: Option<BTreeMap<String, String>>,
    #[serde(flatten)]
    tensors: HashMap<String, TensorInfo>,
}

/// Parses and checks the JSON `header` of a file whose data section has `data_len` bytes:
/// the tensors must lie one after the other in the data, covering it exactly, as the
/// format requires.
pub(super) fn parse(header: &[u8], data_len: usize, source: &str) -> Result<Header> {
    let raw: RawHeader = serde_json::from_slice(header).map_err(|e| bad(source, e))?;
    let mut tensors: Vec<(String, TensorInfo)> = raw.tensors.into_iter().collect();
    // File order; names break ties between tensors without bytes.
    tensors.sort_by(|(a, x), (b, y)| x.data_offsets.cmp(&y.data_offsets).then_with(|| a.cmp(b)));
    let mut entries: Vec<Entry> = Vec::with_capacity(tensors.len());
    let mut end = 0usize;
    for (name, info) in tensors {
        let tensor = |why: String| bad(source, format!("tensor {name:?}: {why}"));
        let dtype = from_safetensors(info.dtype).ok_or_else(|| {
            Error::Unsupported(format!(
                "{source}: tensor {name:?} has dtype {}, which tensorshare cannot hold (it has BOOL, U8, I8, \
                 I16, I32, I64, F16, BF16, F32 and F64); convert it before loading",
                info.dtype
            ))
        })?;
        let len = info
            .shape
            .iter()
            .try_fold(dtype.size(), |acc, &d| acc.checked_mul(d))
            .filter(|&n| n <= isize::MAX as usize)
            .ok_or_else(|| {
                tensor(format!("the size of a {dtype:#} tensor of shape {:?} overflows", info.shape))
            })?;
        let (start, stop) = info.data_offsets;
        if stop < start || stop - start != len {
            return Err(tensor(format!(
                "data_offsets [{start}, {stop}] do not hold the {len} bytes of a {dtype:#} tensor of shape {:?}",
                info.shape
            )));
        }
        let before = entries.last().map_or("", |e| e.name.as_str());
        if start < end {
            return Err(tensor(format!("data_offsets [{start}, {stop}] overlap those of tensor {before:?}")));
        }
        if start > end {
            return Err(tensor(format!(
                "data_offsets [{start}, {stop}] leave bytes {end}..{start} of the data to no tensor"
            )));
        }
        if stop > data_len {
            return Err(tensor(format!(
                "data_offsets [{start}, {stop}] run past the end of the {data_len} bytes of data"
            )));
        }
        end = stop;
        entries.push(Entry { name, dtype, shape: info.shape, start, len });
    }
    if end != data_len {
        return Err(bad(source, format!("the tensors end at byte {end} of the data, which has {data_len}")));
    }
    Ok(Header { entries, metadata: raw.metadata.unwrap_or_default() })
}
