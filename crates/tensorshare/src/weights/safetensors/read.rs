//! Reading: the header first, then one shared storage for every tensor, then each
//! tensor's bytes straight from the file (or the buffer) into its place in that storage.

use std::fs::File;
use std::os::fd::AsRawFd;
use std::path::Path;

use super::header::{self, Entry, Header, N_LEN};
use crate::weights::{layout, Weights};
use crate::{get_sharing_strategy, DType, Error, Result, Storage};

/// Reads `path` into weights; see [`super::load`].
pub(super) fn load(path: &Path) -> Result<Weights> {
    let source = path.display().to_string();
    let file = File::open(path).map_err(|e| Error::io(format!("opening {source}"), e))?;
    let total = file.metadata().map_err(|e| Error::io(format!("reading the size of {source}"), e))?.len();
    let mut prefix = [0u8; N_LEN];
    if total < N_LEN as u64 {
        return Err(header::bad(
            &source,
            format!("it has {total} bytes, fewer than a header's length field"),
        ));
    }
    read_at(&file, &mut prefix, 0, &source)?;
    let n = header::header_len(prefix, total, &source)?;
    let mut json = Vec::new();
    json.try_reserve_exact(n).map_err(|_| Error::AllocationFailed { bytes: n })?;
    json.resize(n, 0);
    read_at(&file, &mut json, N_LEN as u64, &source)?;
    // 8 + n <= total (header_len), so neither overflows.
    let data_start = N_LEN as u64 + n as u64;
    let data_len = usize::try_from(total - data_start)
        .map_err(|_| header::bad(&source, format!("{total} bytes are more than this machine can address")))?;
    let header = header::parse(&json, data_len, &source)?;
    assemble(header, &source, |storage, entry, offset| {
        // Both fit: entry.start + entry.len <= data_len (parse), data_start + data_len = total.
        let at = data_start + entry.start as u64;
        read_into(&file, storage, offset, entry.len, at, &source, &entry.name)
    })
}

/// Reads a whole buffer into weights; see [`super::load_bytes`].
pub(super) fn load_bytes(bytes: &[u8]) -> Result<Weights> {
    let source = "a safetensors buffer";
    let prefix: [u8; N_LEN] = match bytes.get(..N_LEN) {
        Some(p) => p.try_into().map_err(|_| header::bad(source, "no header length"))?,
        None => {
            return Err(header::bad(
                source,
                format!("it has {} bytes, fewer than a header's length field", bytes.len()),
            ))
        }
    };
    let n = header::header_len(prefix, bytes.len() as u64, source)?;
    let (json, data) = bytes[N_LEN..].split_at(n);
    let header = header::parse(json, data.len(), source)?;
    assemble(header, source, |storage, entry, offset| {
        let src = &data[entry.start..entry.start + entry.len];
        // SAFETY: offset + len <= storage.len() (layout::place sized the storage from these
        // lengths), `src` is a private buffer of len bytes, and the storage is fresh: no
        // other handle of it exists, in this process or another, so nothing else accesses
        // its bytes while they are written.
        unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), storage.as_mut_ptr().add(offset), entry.len) };
        Ok(())
    })
}

/// Places the header's tensors in one new shared storage, fills each with `fill(storage,
/// entry, offset)`, and makes the weights of it.
fn assemble(
    header: Header,
    source: &str,
    mut fill: impl FnMut(&Storage, &Entry, usize) -> Result<()>,
) -> Result<Weights> {
    let sizes: Vec<usize> = header.entries.iter().map(|e| e.len).collect();
    let placed = layout::place(&sizes)?;
    let storage = placed.storage(get_sharing_strategy())?;
    let mut tensors = Vec::with_capacity(header.entries.len());
    for (entry, &offset) in header.entries.iter().zip(&placed.offsets) {
        fill(&storage, entry, offset)?;
        let t = layout::view(&storage, offset, entry.dtype, &entry.shape)?;
        if entry.dtype == DType::Bool {
            check_bools(&t.to_bytes()?, source, &entry.name)?;
        }
        tensors.push((entry.name.clone(), t));
    }
    Weights::from_parts(storage, tensors, header.metadata).map_err(|e| header::bad(source, e))
}

/// A bool is one byte, 0 or 1: anything else in a file is an error, not a bool.
fn check_bools(bytes: &[u8], source: &str, name: &str) -> Result<()> {
    match bytes.iter().position(|&b| b > 1) {
        Some(i) => Err(header::bad(
            source,
            format!("tensor {name:?}: element {i} is {}, not a bool (0 or 1)", bytes[i]),
        )),
        None => Ok(()),
    }
}

/// Reads exactly `buf.len()` bytes of `file` at `at`.
fn read_at(file: &File, buf: &mut [u8], at: u64, source: &str) -> Result<()> {
    use std::os::unix::fs::FileExt;
    file.read_exact_at(buf, at).map_err(|e| Error::io(format!("reading {source}"), e))
}

/// Reads `len` bytes of `file` at `at` into `storage` at `offset`, with pread(2) straight
/// into the shared pages: the kernel writes them, and no Rust reference to them is made.
fn read_into(
    file: &File,
    storage: &Storage,
    offset: usize,
    len: usize,
    at: u64,
    source: &str,
    name: &str,
) -> Result<()> {
    // Linux reads at most this much at once.
    const MAX_READ: usize = 0x7fff_f000;
    let mut done = 0;
    while done < len {
        let n = (len - done).min(MAX_READ);
        let pos = at
            .checked_add(done as u64)
            .and_then(|p| i64::try_from(p).ok())
            .ok_or_else(|| header::bad(source, format!("tensor {name:?} lies past any file offset")))?;
        // SAFETY: offset + len <= storage.len() (layout::place sized the storage from these
        // lengths), so the n bytes from offset + done lie in the storage, which `storage`
        // keeps mapped. The storage is fresh: no other handle of it exists, in this process
        // or another, so nothing else accesses these bytes while the kernel writes them.
        let r =
            unsafe { libc::pread(file.as_raw_fd(), storage.as_mut_ptr().add(offset + done).cast(), n, pos) };
        match r {
            r if r > 0 => done += r as usize,
            0 => {
                return Err(header::bad(
                    source,
                    format!("the file ends inside tensor {name:?} (did it shrink while it was read?)"),
                ))
            }
            _ => {
                let e = std::io::Error::last_os_error();
                if e.kind() != std::io::ErrorKind::Interrupted {
                    return Err(Error::io(format!("reading tensor {name:?} of {source}"), e));
                }
            }
        }
    }
    Ok(())
}
