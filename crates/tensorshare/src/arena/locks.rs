//! Byte-range OFD locks on arena descriptions: one byte per slot (see the module above).

use std::os::fd::{AsRawFd, BorrowedFd};

fn flock(l_type: i32, start: u32, len: u32) -> libc::flock {
    // SAFETY: struct flock is plain data; all-zero is a valid value to fill in (l_pid must
    // be 0 for OFD locks).
    let mut fl: libc::flock = unsafe { std::mem::zeroed() };
    fl.l_type = l_type as i16;
    fl.l_whence = libc::SEEK_SET as i16;
    fl.l_start = start.into();
    fl.l_len = len.into();
    fl
}

/// Sorts and dedups `slots` and returns them as runs of adjacent slots: (first, count).
pub(super) fn runs(slots: &mut Vec<u32>) -> Vec<(u32, u32)> {
    slots.sort_unstable();
    slots.dedup();
    let mut out: Vec<(u32, u32)> = Vec::new();
    for &s in slots.iter() {
        match out.last_mut() {
            Some((start, len)) if *start + *len == s => *len += 1,
            _ => out.push((s, 1)),
        }
    }
    out
}

/// Takes or gives back (`F_UNLCK`) a read lock on bytes `start..start + len` (slots) of
/// description `fd`.
///
/// rustix offers only whole-file locks; byte-range OFD locks need `fcntl` from libc.
pub(super) fn lock_range(fd: BorrowedFd<'_>, start: u32, len: u32, l_type: i32) -> std::io::Result<()> {
    let fl = flock(l_type, start, len);
    // SAFETY: F_OFD_SETLK reads one valid, initialised struct flock through the pointer,
    // which lives across the call; `fd` is a valid descriptor.
    let r = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_OFD_SETLK, &fl) };
    if r == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

/// Whether slots `start..start + len` are free of every lock but those of `fd` itself.
pub(super) fn range_free(fd: BorrowedFd<'_>, start: u32, len: u32) -> std::io::Result<bool> {
    conflict(fd, start, len).map(|c| c.is_none())
}

/// A lock of another description on slots `start..start + len`, as (first slot, end), or
/// None. (The kernel reports one such lock, not necessarily the first.)
pub(super) fn conflict(fd: BorrowedFd<'_>, start: u32, len: u32) -> std::io::Result<Option<(u64, u64)>> {
    let mut fl = flock(libc::F_WRLCK, start, len);
    // SAFETY: F_OFD_GETLK reads and writes one valid struct flock through the pointer, which
    // lives across the call; `fd` is a valid descriptor.
    let r = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_OFD_GETLK, &mut fl) };
    if r != 0 {
        return Err(std::io::Error::last_os_error());
    }
    if fl.l_type == libc::F_UNLCK as i16 {
        return Ok(None);
    }
    let first = u64::try_from(fl.l_start).unwrap_or(0);
    // A length of 0 means "to the end of the file".
    let end =
        if fl.l_len == 0 { u64::MAX } else { first.saturating_add(u64::try_from(fl.l_len).unwrap_or(0)) };
    Ok(Some((first, end)))
}
