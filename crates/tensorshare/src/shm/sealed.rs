//! Sealed byte buffers: a memfd written once, then sealed against every change, so that
//! the receiver can read it in place, as a `&[u8]`, whatever the sender does afterwards.

use std::os::fd::OwnedFd;
use std::ptr::NonNull;

use rustix::fs::{MemfdFlags, SealFlags};
use rustix::mm::{MapFlags, ProtFlags};

use crate::{Error, Result};

/// Environment variable: the largest message, in bytes, this process accepts (default
/// 1 GiB). A message's bytes are read in place from a sealed mapping, so a larger claim is
/// refused before anything is mapped or allocated.
pub const MAX_MESSAGE_ENV: &str = "TENSORSHARE_MAX_MESSAGE_BYTES";

const SEALS: SealFlags =
    SealFlags::WRITE.union(SealFlags::SHRINK).union(SealFlags::GROW).union(SealFlags::SEAL);

/// Writes `bytes` into a new memfd and seals it: nobody can change its contents or size.
pub(crate) fn write(bytes: &[u8]) -> Result<OwnedFd> {
    let fd = rustix::fs::memfd_create("tensorshare-msg", MemfdFlags::CLOEXEC | MemfdFlags::ALLOW_SEALING)
        .map_err(|e| Error::io("memfd_create for a large message", e))?;
    let mut off = 0;
    while off < bytes.len() {
        let n = rustix::io::pwrite(&fd, &bytes[off..], off as u64)
            .map_err(|e| Error::io("writing a large message", e))?;
        if n == 0 {
            return Err(Error::io(
                "writing a large message",
                std::io::Error::from(std::io::ErrorKind::WriteZero),
            ));
        }
        off += n;
    }
    rustix::fs::fcntl_add_seals(&fd, SEALS).map_err(|e| Error::io("sealing a large message", e))?;
    Ok(fd)
}

/// A sealed memfd mapped read-only.
pub(crate) struct SealedBytes {
    ptr: NonNull<u8>,
    len: usize,
    _fd: OwnedFd,
}

impl SealedBytes {
    /// Maps a received sealed memfd of exactly `len` bytes (`len <= max`). Anything else is
    /// refused before a byte is read: an unsealed file could change under the reader or be
    /// truncated (SIGBUS), and a size over `max` is not read at all.
    pub(crate) fn open(fd: OwnedFd, len: u64, max: u64) -> Result<SealedBytes> {
        if len > max {
            return Err(Error::invalid(format!(
                "a message of {len} bytes is over this process's limit of {max} bytes (set {} to raise it)",
                MAX_MESSAGE_ENV
            )));
        }
        let seals = rustix::fs::fcntl_get_seals(&fd)
            .map_err(|_| Error::invalid("a spilled message is not a memfd"))?;
        if !seals.contains(SealFlags::WRITE | SealFlags::SHRINK | SealFlags::GROW) {
            return Err(Error::invalid("a spilled message's memfd is not sealed against changes"));
        }
        let st = rustix::fs::fstat(&fd).map_err(|e| Error::io("fstat of a spilled message", e))?;
        if u64::try_from(st.st_size).ok() != Some(len) {
            return Err(Error::invalid(format!(
                "a spilled message claims {len} bytes, its memfd has {}",
                st.st_size
            )));
        }
        let len = usize::try_from(len).map_err(|_| Error::invalid("a spilled message is too large"))?;
        if len == 0 {
            return Ok(SealedBytes { ptr: NonNull::dangling(), len: 0, _fd: fd });
        }
        // SAFETY: a fresh read-only shared mapping of a file we hold open; the file's size is
        // sealed at `len`, so every page of the mapping stays backed and no access faults.
        let p =
            unsafe { rustix::mm::mmap(std::ptr::null_mut(), len, ProtFlags::READ, MapFlags::SHARED, &fd, 0) }
                .map_err(|e| Error::io(format!("mmap of a {len}-byte message"), e))?;
        let ptr = NonNull::new(p.cast::<u8>())
            .ok_or_else(|| Error::io("mmap of a message", std::io::Error::other("it returned address 0")))?;
        Ok(SealedBytes { ptr, len, _fd: fd })
    }

    /// The bytes.
    pub(crate) fn as_slice(&self) -> &[u8] {
        // SAFETY: `ptr..ptr+len` is our read-only mapping (or a dangling pointer with len 0),
        // alive as long as self; the file is sealed against writes, so no process can change
        // the bytes while this borrow lasts.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }
}

impl Drop for SealedBytes {
    fn drop(&mut self) {
        if self.len > 0 {
            // SAFETY: the mapping made in `open`; the only borrows of it end with `self`.
            let _ = unsafe { rustix::mm::munmap(self.ptr.as_ptr().cast(), self.len) };
        }
    }
}
