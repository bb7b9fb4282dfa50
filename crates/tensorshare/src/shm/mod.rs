//! Operating-system shared memory: a [`Segment`] is a memfd (file_descriptor strategy) or a
//! named file in the shared-memory directory (file_system strategy), with its space reserved
//! up front and mapped once per process.
//!
//! Everything here is Linux. A macOS backend (file_system only) would replace this module.

mod fault;
pub use fault::SIGBUS_HANDLER_ENV;
pub(crate) mod fd_reserve;
pub(crate) mod group;
mod limits;
mod named;
pub(crate) mod sealed;
mod tools;

use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::ptr::NonNull;

use rustix::fs::{FallocateFlags, MemfdFlags, SealFlags};
use rustix::io::Errno;
use rustix::mm::{MapFlags, ProtFlags};

pub(crate) use limits::named_room;
pub use limits::{available_bytes, shm_dir, SHM_DIR_ENV};
pub(crate) use named::{is_valid_name, parse_name, unlink as unlink_name, NAME_PREFIX};
pub use tools::{gc, list, SegmentInfo};

/// See [`crate::segments::guard_sigbus`].
pub(crate) fn guard_sigbus() -> Result<()> {
    fault::install(true)
}

use crate::{Error, Result, SharingStrategy};

/// The identity of a segment, the same in every process that maps it: the key of the
/// receive cache.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub(crate) enum SegmentId {
    /// A memfd, by device and inode number.
    Inode {
        /// `st_dev`.
        dev: u64,
        /// `st_ino`.
        ino: u64,
    },
    /// A named segment, by its file name in the shared-memory directory.
    Name(String),
}

/// The identity of an open file, (st_dev, st_ino), as the kernel reports it for a
/// descriptor: what the receive cache keys arenas by, so that a process names an arena
/// only through a descriptor it holds.
pub(crate) type FileId = (u64, u64);

/// The identity of the file `fd` refers to.
pub(crate) fn file_id(fd: BorrowedFd<'_>) -> Result<FileId> {
    let st = rustix::fs::fstat(fd).map_err(|e| Error::io("fstat of a shared-memory descriptor", e))?;
    Ok((st.st_dev, st.st_ino))
}

/// A shared-memory segment mapped into this process (read and write).
///
/// The descriptor is kept open so that the segment can be sent on to other processes.
pub(crate) struct Segment {
    fd: OwnedFd,
    ptr: NonNull<u8>,
    len: usize,
    id: SegmentId,
    /// (st_dev, st_ino) of the file, read from its descriptor.
    file: FileId,
    /// For a named segment that this process created: unlink it on drop.
    owned_name: Option<String>,
    /// The process that created it: a child that inherited the segment through fork and
    /// drops it (forgetting inherited arenas, or freeing what it inherited) must not remove
    /// its parent's file.
    creator: i32,
    /// For a named segment: its registration with the SIGBUS handler that turns pages a
    /// peer cut off into zeros (see `fault`). Dropped before the mapping is unmapped.
    guard: Option<fault::Guard>,
}

// SAFETY: the segment is a mapping of shared memory plus a file descriptor; neither is tied
// to a thread. Access to the bytes is governed by the storages built on it.
unsafe impl Send for Segment {}
// SAFETY: as above; `&Segment` only hands out the address and length.
unsafe impl Sync for Segment {}

impl std::fmt::Debug for Segment {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Segment").field("id", &self.id).field("len", &self.len).finish()
    }
}

impl Segment {
    /// Creates a segment of `len` bytes (`len > 0`) with the given strategy, its space
    /// reserved with `fallocate`, so that a full filesystem or memory limit is an
    /// [`Error::OutOfSharedMemory`] now and never a SIGBUS later.
    pub(crate) fn create(len: usize, strategy: SharingStrategy) -> Result<Segment> {
        assert!(len > 0, "Segment::create needs a positive length");
        match strategy {
            SharingStrategy::FileDescriptor => {
                let fd =
                    rustix::fs::memfd_create("tensorshare", MemfdFlags::CLOEXEC | MemfdFlags::ALLOW_SEALING)
                        .map_err(|e| Error::io("memfd_create", e))?;
                reserve(&fd, len, "memfd")?;
                seal(&fd)?;
                let st = rustix::fs::fstat(&fd).map_err(|e| Error::io("fstat of a new memfd", e))?;
                let id = SegmentId::Inode { dev: st.st_dev, ino: st.st_ino };
                Segment::map(fd, len, id, (st.st_dev, st.st_ino), None)
            }
            SharingStrategy::FileSystem => {
                let (fd, name) = named::create_exclusive()?;
                let dir = shm_dir();
                if let Err(e) = reserve(&fd, len, &dir.display().to_string()) {
                    named::unlink(&name);
                    return Err(e);
                }
                let file = match file_id(fd.as_fd()) {
                    Ok(f) => f,
                    Err(e) => {
                        named::unlink(&name);
                        return Err(e);
                    }
                };
                Segment::map(fd, len, SegmentId::Name(name.clone()), file, Some(name))
            }
        }
    }

    /// Maps every page of a segment this process just made in one call, instead of one page
    /// fault per page at first touch, for a segment its maker is about to write whole (a
    /// large storage's one-slot arena): `reserve` already allocated and zeroed the pages,
    /// and one call saves a fault (a trap, and on a virtual machine often an exit) per page.
    /// Only a hint: a kernel older than 5.14 refuses it, and the pages are then mapped
    /// lazily as before.
    pub(crate) fn populate(&self) {
        // SAFETY: the range is this segment's own live mapping; MADV_POPULATE_WRITE only
        // faults its pages in (writable, contents unchanged) and changes no byte, so no
        // Rust object can observe it.
        let _ = unsafe {
            rustix::mm::madvise(self.ptr.as_ptr().cast(), self.len, rustix::mm::Advice::LinuxPopulateWrite)
        };
    }

    /// Maps a memfd received from another process. `min_len` is the size the sender
    /// claims; the file must be at least that long. Only a memfd sealed against shrinking
    /// and growing is accepted: nobody, the sender included, can then cut the pages this
    /// process maps, so touching them can never raise SIGBUS.
    pub(crate) fn from_fd(fd: OwnedFd, min_len: usize) -> Result<Segment> {
        let st = rustix::fs::fstat(&fd).map_err(|e| Error::io("fstat of a received fd", e))?;
        if rustix::fs::FileType::from_raw_mode(st.st_mode) != rustix::fs::FileType::RegularFile {
            return Err(Error::invalid("a received descriptor is not a shared-memory file"));
        }
        check_sealed(&fd)?;
        let size = usize::try_from(st.st_size)
            .map_err(|_| Error::invalid("a received shared-memory file has a negative size"))?;
        if size < min_len || size == 0 {
            return Err(Error::invalid(format!(
                "a received shared-memory file has {size} bytes, the message claims {min_len}"
            )));
        }
        Segment::map(
            fd,
            size,
            SegmentId::Inode { dev: st.st_dev, ino: st.st_ino },
            (st.st_dev, st.st_ino),
            None,
        )
    }

    /// Maps a descriptor of a named segment received from another process: accepted only
    /// if `name` is a segment name and the descriptor is a regular file on the filesystem of
    /// the shared-memory directory, so that no file on disk is taken for a segment. The name
    /// itself need not exist any more (a dead creator's names are swept while the memory
    /// lives on in the descriptors that hold it).
    ///
    /// Named files cannot be sealed: a peer can truncate one, and the pages it cut off then
    /// read as zeros in this process (see `fault`), never SIGBUS.
    pub(crate) fn from_named_fd(fd: OwnedFd, name: &str) -> Result<Segment> {
        if !is_valid_name(name) {
            return Err(Error::invalid(format!("{name:?} is not a tensorshare segment name")));
        }
        let st = rustix::fs::fstat(&fd).map_err(|e| Error::io("fstat of a received fd", e))?;
        let dir = rustix::fs::stat(limits::shm_dir())
            .map_err(|e| Error::io(format!("stat of {}", limits::shm_dir().display()), e))?;
        if st.st_dev != dir.st_dev
            || rustix::fs::FileType::from_raw_mode(st.st_mode) != rustix::fs::FileType::RegularFile
        {
            return Err(Error::invalid(format!(
                "a received descriptor named {name} is not a file of the shared-memory directory's filesystem"
            )));
        }
        let size = usize::try_from(st.st_size)
            .ok()
            .filter(|&s| s > 0)
            .ok_or_else(|| Error::invalid(format!("received segment {name} is empty")))?;
        Segment::map(fd, size, SegmentId::Name(name.to_owned()), (st.st_dev, st.st_ino), None)
    }

    fn map(
        fd: OwnedFd,
        len: usize,
        id: SegmentId,
        file: FileId,
        owned_name: Option<String>,
    ) -> Result<Segment> {
        // SAFETY: a fresh shared mapping of a file we hold open; no Rust object aliases the
        // returned range until this `Segment` hands it out. A file shorter than the mapping
        // is excluded above (fstat or our own reservation). A memfd is then sealed against
        // shrinking; a named file is not, and a page another process cuts off is replaced
        // with zeros by `fault` (registered below) instead of faulting.
        let ptr = unsafe {
            rustix::mm::mmap(
                std::ptr::null_mut(),
                len,
                ProtFlags::READ | ProtFlags::WRITE,
                MapFlags::SHARED,
                &fd,
                0,
            )
        };
        let ptr = match ptr {
            Ok(p) => p,
            Err(e) => {
                if let Some(name) = &owned_name {
                    named::unlink(name);
                }
                let why = if e == rustix::io::Errno::NOMEM {
                    " (this process's address space is full: its `ulimit -v`, or vm.max_map_count mappings)"
                } else {
                    ""
                };
                return Err(Error::io(format!("mmap of {len} bytes of shared memory{why}"), e));
            }
        };
        let ptr = NonNull::new(ptr.cast::<u8>()).ok_or_else(|| {
            Error::io("mmap of shared memory", std::io::Error::other("it returned address 0"))
        })?;
        let creator = rustix::process::getpid().as_raw_nonzero().get();
        let mut seg = Segment { fd, ptr, len, id, file, owned_name, creator, guard: None };
        if matches!(seg.id, SegmentId::Name(_)) {
            // A named file can be truncated by any process that can open it: register the
            // mapping before anything reads it, so that a cut is zeros, never SIGBUS. On
            // failure, dropping `seg` unmaps it and removes a file this process created.
            seg.guard = Some(fault::register(seg.ptr.as_ptr(), seg.len, seg.fd.as_fd())?);
        }
        Ok(seg)
    }

    /// The first byte of the mapping.
    pub(crate) fn as_ptr(&self) -> *const u8 {
        self.ptr.as_ptr()
    }

    /// The first byte of the mapping, to write through. Other processes map the same
    /// pages: see the crate's memory model for who may write what.
    pub(crate) fn as_mut_ptr(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }

    /// The mapping's length in bytes.
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// The identity shared by every process that maps this segment.
    pub(crate) fn id(&self) -> &SegmentId {
        &self.id
    }

    /// The file's identity (device, inode).
    pub(crate) fn file_id(&self) -> FileId {
        self.file
    }

    /// The file name, for a named segment.
    pub(crate) fn name(&self) -> Option<&str> {
        match &self.id {
            SegmentId::Name(n) => Some(n),
            SegmentId::Inode { .. } => None,
        }
    }

    /// The descriptor, to pass the segment on.
    pub(crate) fn fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }

    /// A new open file description of the same file (not a `dup`, which shares one): file
    /// locks taken on it (OFD locks) belong to it alone and live exactly as long as some
    /// descriptor refers to it, in this process, in a message in flight, or elsewhere.
    pub(crate) fn reopen(&self) -> Result<OwnedFd> {
        reopen(self.fd.as_fd())
    }
}

/// A new open file description of the file `fd` refers to, through `/proc/self/fd`.
pub(crate) fn reopen(fd: BorrowedFd<'_>) -> Result<OwnedFd> {
    use std::os::fd::AsRawFd;
    let path = format!("/proc/self/fd/{}", fd.as_raw_fd());
    crate::shm::fd_reserve::rescue(|| {
        rustix::fs::open(
            path.as_str(),
            rustix::fs::OFlags::RDWR | rustix::fs::OFlags::CLOEXEC,
            rustix::fs::Mode::empty(),
        )
    })
    .map_err(|e| match e {
        rustix::io::Errno::MFILE | rustix::io::Errno::NFILE => Error::io(
            "reopening a shared-memory segment: this process has reached its descriptor limit \
             (RLIMIT_NOFILE); raise it or hold fewer shared segments",
            e,
        ),
        e => Error::io("reopening a shared-memory segment through /proc/self/fd (is /proc mounted?)", e),
    })
}

/// The seals every memfd of ours carries once sized: its length can never change again, and
/// no further seal can be added.
const SEALS: SealFlags = SealFlags::SHRINK.union(SealFlags::GROW).union(SealFlags::SEAL);

fn seal(fd: &OwnedFd) -> Result<()> {
    rustix::fs::fcntl_add_seals(fd, SEALS).map_err(|e| Error::io("sealing a memfd", e))
}

/// Refuses a memfd whose size a peer could still change (or a file that is no memfd).
pub(crate) fn check_sealed(fd: &OwnedFd) -> Result<()> {
    let seals = rustix::fs::fcntl_get_seals(fd)
        .map_err(|_| Error::invalid("a received descriptor is not a memfd (it cannot be sealed)"))?;
    if !seals.contains(SealFlags::SHRINK | SealFlags::GROW) {
        return Err(Error::invalid(
            "a received memfd is not sealed against shrinking and growing: refused, since a peer could \
             truncate it under this process's mapping",
        ));
    }
    Ok(())
}

impl Drop for Segment {
    fn drop(&mut self) {
        // Unregistered first: the handler must never take this range for a segment once
        // something else may be mapped there.
        drop(self.guard.take());
        // SAFETY: `ptr..ptr+len` is the mapping made in `map`, and every storage that points
        // into it holds an `Arc<Segment>`, so nothing uses it any more.
        let _ = unsafe { rustix::mm::munmap(self.ptr.as_ptr().cast(), self.len) };
        if let Some(name) = &self.owned_name {
            if rustix::process::getpid().as_raw_nonzero().get() == self.creator {
                named::unlink(name);
            }
        }
    }
}

/// Sizes the file and reserves its space, so that later page faults cannot fail.
fn reserve(fd: &OwnedFd, len: usize, place: &str) -> Result<()> {
    let requested = len as u64;
    // fallocate on tmpfs fills page by page before it fails; refuse what cannot fit up
    // front, so that an impossible request neither takes the machine's memory for a moment
    // nor wakes the OOM killer.
    let available = available_bytes(Some(fd.as_fd()));
    if requested > available {
        return Err(Error::OutOfSharedMemory { requested, available, place: place.to_owned() });
    }
    rustix::fs::ftruncate(fd, requested).map_err(|e| Error::io(format!("ftruncate to {len} bytes"), e))?;
    match rustix::fs::fallocate(fd, FallocateFlags::empty(), 0, requested) {
        Ok(()) => Ok(()),
        Err(Errno::NOSPC) | Err(Errno::NOMEM) | Err(Errno::FBIG) | Err(Errno::DQUOT) => {
            Err(Error::OutOfSharedMemory {
                requested,
                available: available_bytes(Some(fd.as_fd())),
                place: place.to_owned(),
            })
        }
        Err(e) => Err(Error::io(format!("fallocate of {len} bytes of shared memory"), e)),
    }
}
