//! Writing: the header (made and checked by the safetensors crate), then each tensor's
//! elements in row-major order, copied out a few MiB at a time, whatever its strides and
//! wherever it lives. A file is written beside its destination and renamed over it once
//! complete, so a reader never sees half a file.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::io::Write;
use std::path::Path;

use ::safetensors::tensor::{Metadata, TensorInfo};

use super::header::{to_safetensors, MAX_HEADER, N_LEN};
use crate::{Device, Error, Result, Tensor};

/// Bytes copied out of a tensor at a time.
const CHUNK: usize = 4 << 20;

/// The tensors in the order they are written, and the header that describes them.
pub(super) struct Prepared<'a> {
    header: Vec<u8>,
    tensors: Vec<(String, &'a Tensor)>,
    total: usize,
}

/// Checks the tensors, orders them (by element size, largest first, and otherwise as
/// given, so that every tensor's data is aligned to its element size in the file, as the
/// safetensors crate writes it) and makes the header.
pub(super) fn prepare<'a>(
    mut tensors: Vec<(String, &'a Tensor)>,
    metadata: &BTreeMap<String, String>,
) -> Result<Prepared<'a>> {
    let mut seen = HashSet::with_capacity(tensors.len());
    for (name, t) in &tensors {
        if name == "__metadata__" {
            return Err(Error::invalid_argument(
                "tensor name",
                "`__metadata__` is the metadata's key in a safetensors header",
            ));
        }
        if !seen.insert(name.as_str()) {
            return Err(Error::invalid_argument("tensor name", format!("{name:?} names two tensors")));
        }
        if t.device() == Device::Meta {
            return Err(Error::Device(format!(
                "tensor {name:?} is on the meta device: it has no data to save"
            )));
        }
    }
    tensors.sort_by_key(|(_, t)| std::cmp::Reverse(t.dtype().size()));
    let mut infos = Vec::with_capacity(tensors.len());
    let mut end = 0usize;
    for (name, t) in &tensors {
        // Exact: every tensor's byte size fits in isize.
        let len = t.numel() * t.dtype().size();
        let stop = end.checked_add(len).ok_or_else(|| {
            Error::invalid_argument("tensors", "their bytes add up to more than a file offset can hold")
        })?;
        let info = TensorInfo {
            dtype: to_safetensors(t.dtype()),
            shape: t.shape().to_vec(),
            data_offsets: (end, stop),
        };
        infos.push((name.clone(), info));
        end = stop;
    }
    // The crate checks the header it would read back; the bytes are written from ordered
    // maps, so that the same tensors and metadata always make the same file.
    let meta = (!metadata.is_empty())
        .then(|| metadata.iter().map(|(k, v)| (k.clone(), v.clone())).collect::<HashMap<_, _>>());
    Metadata::new(meta, infos.clone()).map_err(|e| Error::Serialize(format!("safetensors header: {e}")))?;
    let mut json = serde_json::to_vec(&HeaderOut { metadata, infos: &infos })
        .map_err(|e| Error::Serialize(format!("safetensors header: {e}")))?;
    // The data starts 8-byte aligned: the header is padded with spaces, as the format does.
    let padded = json.len().next_multiple_of(N_LEN);
    if padded > MAX_HEADER {
        return Err(Error::invalid_argument(
            "safetensors header",
            format!("{padded} bytes of header, more than the format's {MAX_HEADER}: fewer tensors or less metadata"),
        ));
    }
    json.resize(padded, b' ');
    let mut bytes = Vec::with_capacity(N_LEN + padded);
    bytes.extend_from_slice(&(padded as u64).to_le_bytes());
    bytes.extend_from_slice(&json);
    let total = bytes
        .len()
        .checked_add(end)
        .ok_or_else(|| Error::invalid_argument("tensors", "too large for one file"))?;
    Ok(Prepared { header: bytes, tensors, total })
}

/// The header's JSON: `__metadata__` (if any), then the tensors in file order.
struct HeaderOut<'a> {
    metadata: &'a BTreeMap<String, String>,
    infos: &'a [(String, TensorInfo)],
}

impl serde::Serialize for HeaderOut<'_> {
    fn serialize<S: serde::Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        use serde::ser::SerializeMap;
        let meta = !self.metadata.is_empty();
        let mut map = s.serialize_map(Some(self.infos.len() + usize::from(meta)))?;
        if meta {
            map.serialize_entry("__metadata__", self.metadata)?;
        }
        for (name, info) in self.infos {
            map.serialize_entry(name, info)?;
        }
        map.end()
    }
}

impl Prepared<'_> {
    /// The file's length.
    pub(super) fn total(&self) -> usize {
        self.total
    }

    /// Writes the header and the data to `w`; `what` names the destination in errors.
    pub(super) fn write_to(&self, w: &mut impl Write, what: &str) -> Result<()> {
        let io = |e| Error::io(format!("writing {what}"), e);
        w.write_all(&self.header).map_err(io)?;
        for (_, t) in &self.tensors {
            write_tensor(w, t, what)?;
        }
        w.flush().map_err(io)
    }
}

/// Writes a tensor's elements in row-major order, a few MiB of whole rows at a time (safe
/// copies, so other handles may write the tensor meanwhile).
fn write_tensor(w: &mut impl Write, t: &Tensor, what: &str) -> Result<()> {
    let io = |e| Error::io(format!("writing {what}"), e);
    let bytes = t.numel() * t.dtype().size();
    let rows = t.shape().first().copied().unwrap_or(1);
    if bytes <= CHUNK || rows <= 1 {
        return w.write_all(&t.to_bytes()?).map_err(io);
    }
    let step = (CHUNK / (bytes / rows)).max(1);
    let mut row = 0;
    while row < rows {
        let k = step.min(rows - row);
        w.write_all(&t.narrow(0, row, k)?.to_bytes()?).map_err(io)?;
        row += k;
    }
    Ok(())
}

/// Writes a file beside `path`, then renames it over `path`.
pub(super) fn save(path: &Path, prepared: &Prepared<'_>) -> Result<()> {
    let what = path.display().to_string();
    let file_name = path
        .file_name()
        .ok_or_else(|| Error::invalid_argument("path", format!("{what} names no file")))?
        .to_string_lossy();
    let mut r = [0u8; 8];
    crate::util::random_bytes(&mut r);
    let tmp = path.with_file_name(format!(".{file_name}.{:016x}.tmp", u64::from_le_bytes(r)));
    let file = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(&tmp)
        .map_err(|e| Error::io(format!("creating {}", tmp.display()), e))?;
    let written = (|| {
        let mut w = std::io::BufWriter::with_capacity(1 << 20, &file);
        prepared.write_to(&mut w, &what)?;
        drop(w);
        std::fs::rename(&tmp, path).map_err(|e| Error::io(format!("renaming {} to {what}", tmp.display()), e))
    })();
    if written.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    written
}
