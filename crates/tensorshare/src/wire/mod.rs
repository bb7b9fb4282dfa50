//! Values into messages and back.
//!
//! A message is `[u32 header length][header][payload]`, both postcard. The payload is the
//! value itself, in which every tensor and storage is a handle: an index into the header's
//! table of storages, each a slot of a segment in the header's table of segments. A memfd
//! segment travels as a descriptor (SCM_RIGHTS, in the same `sendmsg`), a named one by name,
//! so a message is self-contained: its sender may exit as soon as it is sent.
//!
//! Every storage in a message holds one count on its slot (see `arena`), taken when the
//! message is encoded and handed to the receiver, who keeps it or, when it already holds
//! that storage, gives it back. Everything read from a message is checked before use.

mod bytes;
mod cache;
mod repr;

use std::cell::RefCell;
use std::collections::HashMap;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::sync::atomic::Ordering;
use std::sync::Arc;

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

use crate::arena::{Arena, Block};
use crate::shm::{Segment, SegmentId};
use crate::storage::Shared;
use crate::{Error, Result, SharingStrategy, Storage};

pub use cache::{cache_entries, release_cached_mappings};

/// Holds the receive cache's lock (see `process::atfork`).
pub(crate) fn fork_guards(out: &mut Vec<Box<dyn std::any::Any>>) {
    out.push(Box::new(cache::cache()));
}

/// Most descriptors one message may carry (the kernel's SCM_MAX_FD).
pub const MAX_FDS: usize = 253;

#[derive(Serialize, Deserialize, Debug)]
struct Header {
    /// Descriptors that ride with the message, the spilled payload's included.
    nfds: u32,
    segments: Vec<SegmentDesc>,
    storages: Vec<StorageDesc>,
    /// The payload is not inline but in the last descriptor (a memfd) of this many bytes.
    spilled: Option<u64>,
    /// The descriptor table has this many entries, more than one record may carry: they
    /// wait on a side socket, written in full before this message was sent, which travels
    /// as the message's first descriptor.
    side: Option<u32>,
}

#[derive(Serialize, Deserialize, Debug)]
enum SegmentDesc {
    /// A memfd, with the identity the sender sees (device, inode): a receiver that has it
    /// mapped already closes the descriptor unexamined. A false claim can only name an
    /// arena the receiver maps anyway (a live mapping keeps its inode from reuse), so it
    /// cannot reach memory outside the receiver's mappings.
    Fd {
        fd: u32,
        dev: u64,
        ino: u64,
    },
    Named {
        name: String,
    },
}

#[derive(Serialize, Deserialize, Debug)]
enum StorageDesc {
    Empty(SharingStrategy),
    Block {
        segment: u32,
        slot: u32,
        len: u64,
    },
    /// A CUDA storage: one device allocation (see `cuda`).
    Device(DeviceDesc),
}

/// A device allocation in a message. Its descriptors (the memory handle when it is one,
/// and a hold on the creator's lease) ride with the message.
#[derive(Serialize, Deserialize, Debug)]
struct DeviceDesc {
    device: u32,
    /// The creator's id of the allocation: the receive cache's key.
    id: (u64, u64),
    /// Bytes of the allocation.
    size: u64,
    /// Bytes of the storage in it.
    len: u64,
    memory: DeviceMemory,
    /// Index of the lease descriptor.
    lease: u32,
    /// Handle of the event recorded on the sender's stream at send.
    event: Option<Vec<u8>>,
}

#[derive(Serialize, Deserialize, Debug)]
enum DeviceMemory {
    /// A descriptor (CUDA VMM POSIX-fd handle), by index.
    Fd(u32),
    /// A legacy 64-byte IPC memory handle.
    Ipc(Vec<u8>),
}

/// Something whose descriptor a message carries; kept alive until the message is sent.
pub(crate) enum FdSource {
    Arena(Arc<Arena>),
    Segment(Arc<Segment>),
    Fd(Arc<OwnedFd>),
    Owned(OwnedFd),
}

impl FdSource {
    fn fd(&self) -> BorrowedFd<'_> {
        match self {
            FdSource::Arena(a) => a.segment().fd(),
            FdSource::Segment(s) => s.fd(),
            FdSource::Fd(f) => f.as_fd(),
            FdSource::Owned(f) => f.as_fd(),
        }
    }
}

#[derive(Default)]
struct EncodeCtx {
    fds: Vec<FdSource>,
    fd_index: HashMap<i32, u32>,
    segments: Vec<SegmentDesc>,
    segment_index: HashMap<*const Arena, u32>,
    storages: Vec<StorageDesc>,
    storage_index: HashMap<*const crate::storage::Inner, u32>,
    /// Slot counts this message holds; given back if it is never sent.
    held: Vec<(Arc<Arena>, u32)>,
    /// The send event recorded for this message, per device: one record covers every
    /// CUDA storage of the message on that device.
    #[cfg(feature = "cuda")]
    events: HashMap<u32, crate::cuda::IpcBytes>,
}

thread_local! {
    static ENCODING: RefCell<Option<EncodeCtx>> = const { RefCell::new(None) };
    static DECODING: RefCell<Option<DecodeCtx>> = const { RefCell::new(None) };
}

/// A value turned into a message, not yet sent. Dropping it unsent gives back the slot
/// counts it took.
pub struct Encoded {
    /// Length prefix and header.
    head: Vec<u8>,
    payload: Vec<u8>,
    fds: Vec<FdSource>,
    held: Vec<(Arc<Arena>, u32)>,
}

impl std::fmt::Debug for Encoded {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Encoded")
            .field("head", &self.head.len())
            .field("payload", &self.payload.len())
            .field("fds", &self.fds.len())
            .finish()
    }
}

impl Encoded {
    /// The bytes, in order: header then payload.
    pub fn parts(&self) -> [&[u8]; 2] {
        [&self.head, &self.payload]
    }

    /// Total bytes.
    pub fn len(&self) -> usize {
        self.head.len() + self.payload.len()
    }

    /// Whether the message has no bytes (never: the header is always there).
    pub fn is_empty(&self) -> bool {
        false
    }

    /// The descriptors to send with the bytes.
    pub fn fds(&self) -> Vec<BorrowedFd<'_>> {
        self.fds.iter().map(FdSource::fd).collect()
    }

    /// The message was delivered: its slot counts now belong to the receiver.
    pub fn mark_sent(mut self) {
        for (arena, _) in self.held.drain(..) {
            drop(arena);
        }
    }

    /// The whole message as one buffer (for transports without descriptors, and tests).
    pub fn to_vec(&self) -> Vec<u8> {
        [&self.head[..], &self.payload[..]].concat()
    }

    /// Moves the payload into a memfd that travels as the last descriptor, so that a
    /// message of any size fits in one socket record.
    pub(crate) fn spill(&mut self) -> Result<()> {
        let len = self.payload.len();
        let fd = rustix::fs::memfd_create("tensorshare-msg", rustix::fs::MemfdFlags::CLOEXEC)
            .map_err(|e| Error::io("memfd_create for a large message", e))?;
        let mut off = 0;
        while off < len {
            let n = rustix::io::pwrite(&fd, &self.payload[off..], off as u64)
                .map_err(|e| Error::io("writing a large message", e))?;
            off += n;
        }
        let mut header: Header = parse_header(&self.head)?.0;
        header.nfds += 1;
        header.spilled = Some(len as u64);
        self.head = frame_head(&header)?;
        self.payload = Vec::new();
        self.fds.push(FdSource::Owned(fd));
        Ok(())
    }
}

impl Drop for Encoded {
    fn drop(&mut self) {
        for (arena, slot) in self.held.drain(..) {
            arena.release(slot);
        }
    }
}

fn frame_head(header: &Header) -> Result<Vec<u8>> {
    let mut head = vec![0u8; 4];
    let mut head = postcard::to_extend(header, std::mem::take(&mut head))
        .map_err(|e| Error::Serialize(e.to_string()))?;
    let n = (head.len() - 4) as u32;
    head[..4].copy_from_slice(&n.to_le_bytes());
    Ok(head)
}

fn parse_header(frame: &[u8]) -> Result<(Header, usize)> {
    if frame.len() < 4 {
        return Err(Error::invalid(format!("a message of {} bytes has no header", frame.len())));
    }
    let n = u32::from_le_bytes([frame[0], frame[1], frame[2], frame[3]]) as usize;
    let end = 4usize.checked_add(n).filter(|&e| e <= frame.len()).ok_or_else(|| {
        Error::invalid(format!("the header claims {n} bytes, the message has {}", frame.len()))
    })?;
    let header: Header = postcard::from_bytes(&frame[4..end])?;
    Ok((header, end))
}

/// Turns `value` into a message: tensors become handles to shared memory (a private
/// tensor is copied into shared memory once; the caller's tensor stays private).
pub fn encode<T: Serialize + ?Sized>(value: &T) -> Result<Encoded> {
    struct Reset;
    impl Drop for Reset {
        fn drop(&mut self) {
            // Leave no context behind, also when a Serialize impl panics.
            if let Some(ctx) = ENCODING.with(|c| c.borrow_mut().take()) {
                for (arena, slot) in ctx.held {
                    arena.release(slot);
                }
            }
        }
    }
    let nested = ENCODING.with(|c| c.borrow().is_some());
    if nested {
        return Err(Error::Serialize("encode called while encoding another message".into()));
    }
    ENCODING.with(|c| *c.borrow_mut() = Some(EncodeCtx::default()));
    let reset = Reset;
    let payload = postcard::to_allocvec(value).map_err(|e| Error::Serialize(e.to_string()));
    let ctx = ENCODING.with(|c| c.borrow_mut().take()).expect("the encode context is set above");
    drop(reset);
    let mut encoded = Encoded { head: Vec::new(), payload: Vec::new(), fds: ctx.fds, held: ctx.held };
    encoded.payload = payload?;
    // One place is kept free for a spilled payload's memfd.
    let side = if encoded.fds.len() >= MAX_FDS {
        let n = encoded.fds.len() as u32;
        let sock = write_side(&encoded.fds)?;
        encoded.fds = vec![FdSource::Owned(sock)];
        Some(n)
    } else {
        None
    };
    let header = Header {
        nfds: encoded.fds.len() as u32,
        segments: ctx.segments,
        storages: ctx.storages,
        spilled: None,
        side,
    };
    encoded.head = frame_head(&header)?;
    Ok(encoded)
}

/// Writes a descriptor table too large for one record onto a new socket, in records of at
/// most MAX_FDS, and returns the reading end (the writing end closes, so the reader sees
/// where the table ends).
fn write_side(fds: &[FdSource]) -> Result<OwnedFd> {
    let (w, r) = crate::channel::socket::pair()?;
    for chunk in fds.chunks(MAX_FDS) {
        let borrowed: Vec<BorrowedFd<'_>> = chunk.iter().map(FdSource::fd).collect();
        crate::channel::socket::send_record(w.as_fd(), [&[1u8], &[]], &borrowed)
            .map_err(|e| Error::io(format!("passing the {} descriptors of one message", fds.len()), e))?;
    }
    Ok(r)
}

/// Reads a descriptor table of `n` entries from a side socket.
fn read_side(sock: OwnedFd, n: u32) -> Result<Vec<OwnedFd>> {
    let mut out = Vec::with_capacity((n as usize).min(1 << 16));
    loop {
        match crate::channel::socket::try_recv(sock.as_fd())? {
            crate::channel::socket::Received::Record(r) => out.extend(r.fds),
            crate::channel::socket::Received::Closed | crate::channel::socket::Received::Empty => break,
        }
        if out.len() > n as usize {
            break;
        }
    }
    if out.len() != n as usize {
        return Err(Error::invalid(format!(
            "the message names {n} descriptors, its side socket held {}",
            out.len()
        )));
    }
    Ok(out)
}

/// Whether a value is being encoded into a message on this thread (tensors then serialize
/// as handles, otherwise by value).
pub(crate) fn encoding() -> bool {
    ENCODING.with(|c| c.borrow().is_some())
}

/// Adds a descriptor to the message being encoded; returns its index.
pub(crate) fn encode_fd(source: FdSource) -> Result<u32> {
    ENCODING.with(|c| {
        let mut c = c.borrow_mut();
        let ctx = c.as_mut().ok_or_else(|| Error::Serialize("not encoding a message".into()))?;
        Ok(push_fd(ctx, source))
    })
}

fn push_fd(ctx: &mut EncodeCtx, source: FdSource) -> u32 {
    let raw = source.fd().as_raw_fd();
    *ctx.fd_index.entry(raw).or_insert_with(|| {
        ctx.fds.push(source);
        (ctx.fds.len() - 1) as u32
    })
}

/// Adds a storage to the message being encoded; returns its index in the storage table.
pub(crate) fn encode_storage(storage: &Storage) -> Result<u32> {
    ENCODING.with(|c| {
        let mut c = c.borrow_mut();
        let ctx = c.as_mut().ok_or_else(|| Error::Serialize("not encoding a message".into()))?;
        let key = Arc::as_ptr(&storage.inner);
        if let Some(&i) = ctx.storage_index.get(&key) {
            return Ok(i);
        }
        let desc = match storage.shared() {
            Some(Shared::Empty(s)) => StorageDesc::Empty(*s),
            Some(Shared::Block(block)) => {
                let arena = block.arena().clone();
                if !storage.inner.cached.load(Ordering::Relaxed) {
                    // So that the storage is found again if it comes back to this process.
                    let mut cache = cache::cache();
                    cache.insert_storage(arena.segment().id(), block.slot(), &storage.inner);
                    if !arena.cached.load(Ordering::Relaxed) {
                        cache.insert_arena(&arena);
                    }
                }
                arena.retain(block.slot());
                ctx.held.push((arena.clone(), block.slot()));
                block_desc(ctx, arena, block.slot(), storage.len())
            }
            None => {
                // A private storage: copy it into shared memory once, for this message only.
                let strategy = crate::get_sharing_strategy();
                if storage.is_empty() {
                    StorageDesc::Empty(strategy)
                } else {
                    let block = crate::arena::allocate(storage.len(), strategy)?;
                    // SAFETY: the block is fresh (no other handle) and holds at least len
                    // bytes; the private storage has len initialised bytes.
                    unsafe { std::ptr::copy_nonoverlapping(storage.as_ptr(), block.ptr(), storage.len()) };
                    let (arena, slot) = block.into_raw();
                    ctx.held.push((arena.clone(), slot));
                    block_desc(ctx, arena, slot, storage.len())
                }
            }
            #[cfg(feature = "cuda")]
            Some(Shared::Device(alloc)) => {
                if !storage.inner.cached.load(Ordering::Relaxed) {
                    cache::cache().insert_device(alloc.id, &storage.inner);
                }
                device_desc(ctx, alloc, storage.len())?
            }
        };
        ctx.storages.push(desc);
        let i = (ctx.storages.len() - 1) as u32;
        ctx.storage_index.insert(key, i);
        Ok(i)
    })
}

fn block_desc(ctx: &mut EncodeCtx, arena: Arc<Arena>, slot: u32, len: usize) -> StorageDesc {
    let key = Arc::as_ptr(&arena);
    let segment = match ctx.segment_index.get(&key) {
        Some(&i) => i,
        None => {
            let desc = match arena.segment().id() {
                SegmentId::Name(name) => SegmentDesc::Named { name: name.clone() },
                &SegmentId::Inode { dev, ino } => {
                    SegmentDesc::Fd { fd: push_fd(ctx, FdSource::Arena(arena.clone())), dev, ino }
                }
            };
            ctx.segments.push(desc);
            let i = (ctx.segments.len() - 1) as u32;
            ctx.segment_index.insert(key, i);
            i
        }
    };
    StorageDesc::Block { segment, slot, len: len as u64 }
}

#[cfg(feature = "cuda")]
fn device_desc(ctx: &mut EncodeCtx, alloc: &crate::cuda::Allocation, len: usize) -> Result<StorageDesc> {
    let (export, lease) = alloc.wire_parts()?;
    let memory = match export {
        crate::cuda::Export::Fd(fd) => DeviceMemory::Fd(push_fd(ctx, FdSource::Fd(fd))),
        crate::cuda::Export::Ipc(h) => DeviceMemory::Ipc(h.to_vec()),
    };
    let lease = push_fd(ctx, FdSource::Fd(lease));
    let event = match ctx.events.get(&alloc.device) {
        Some(e) => *e,
        None => {
            let e = crate::cuda::record_for_send(alloc.device)?;
            ctx.events.insert(alloc.device, e);
            e
        }
    };
    Ok(StorageDesc::Device(DeviceDesc {
        device: alloc.device,
        id: (alloc.id.origin, alloc.id.serial),
        size: alloc.size as u64,
        len: len as u64,
        memory,
        lease,
        event: Some(event.to_vec()),
    }))
}

struct DecodeCtx {
    storages: Vec<Storage>,
    fds: Vec<Option<OwnedFd>>,
}

/// Takes a descriptor of the message being decoded (each can be taken once).
pub(crate) fn decode_fd(index: u32) -> Result<OwnedFd> {
    DECODING.with(|c| {
        let mut c = c.borrow_mut();
        let ctx =
            c.as_mut().ok_or_else(|| Error::invalid("an endpoint handle outside a tensorshare message"))?;
        ctx.fds
            .get_mut(index as usize)
            .and_then(Option::take)
            .ok_or_else(|| Error::invalid(format!("descriptor {index} is missing or used twice")))
    })
}

/// The storage at `index` of the message being decoded.
pub(crate) fn decode_storage(index: u32) -> Result<Storage> {
    DECODING.with(|c| {
        let c = c.borrow();
        let ctx =
            c.as_ref().ok_or_else(|| Error::invalid("a tensor handle outside a tensorshare message"))?;
        ctx.storages.get(index as usize).cloned().ok_or_else(|| {
            Error::invalid(format!("storage {index} is not in the message's table of {}", ctx.storages.len()))
        })
    })
}

/// Turns a message (bytes and the descriptors that came with them) back into a value,
/// checking every handle. A malformed message is [`Error::InvalidMessage`].
pub fn decode<T: DeserializeOwned>(frame: &[u8], fds: Vec<OwnedFd>) -> Result<T> {
    let (header, body) = parse_header(frame)?;
    if fds.len() != header.nfds as usize {
        return Err(Error::invalid(format!(
            "the message names {} descriptors but {} came with it",
            header.nfds,
            fds.len()
        )));
    }
    let mut fds: Vec<Option<OwnedFd>> = fds.into_iter().map(Some).collect();
    let spilled;
    let payload: &[u8] = match header.spilled {
        None => &frame[body..],
        Some(len) => {
            let fd =
                fds.pop().flatten().ok_or_else(|| Error::invalid("a spilled message without its memfd"))?;
            spilled = read_spilled(fd, len)?;
            &spilled
        }
    };
    if let Some(n) = header.side {
        let sock = fds.first_mut().and_then(Option::take).ok_or_else(|| Error::invalid("no side socket"))?;
        if fds.len() != 1 {
            return Err(Error::invalid("a message with a side socket carries no other descriptor"));
        }
        fds = read_side(sock, n)?.into_iter().map(Some).collect();
    }
    let segments = resolve_segments(&header.segments, &mut fds);
    let storages = resolve_storages(&header.storages, &segments, &mut fds)?;
    let segments_ok: Result<Vec<_>> = segments.into_iter().collect();
    segments_ok?;
    DECODING.with(|c| *c.borrow_mut() = Some(DecodeCtx { storages, fds }));
    struct Reset;
    impl Drop for Reset {
        fn drop(&mut self) {
            DECODING.with(|c| c.borrow_mut().take());
        }
    }
    let _reset = Reset;
    let value = postcard::from_bytes::<T>(payload)?;
    Ok(value)
}

fn read_spilled(fd: OwnedFd, len: u64) -> Result<Vec<u8>> {
    let st = rustix::fs::fstat(&fd).map_err(|e| Error::io("fstat of a spilled message", e))?;
    if st.st_size < 0 || (st.st_size as u64) < len {
        return Err(Error::invalid(format!(
            "a spilled message claims {len} bytes, its memfd has {}",
            st.st_size
        )));
    }
    let len = usize::try_from(len).map_err(|_| Error::invalid("a spilled message is too large"))?;
    let mut buf = vec![0u8; len];
    let mut off = 0;
    while off < len {
        match rustix::io::pread(&fd, &mut buf[off..], off as u64) {
            Ok(0) => return Err(Error::invalid("a spilled message is shorter than it claims")),
            Ok(n) => off += n,
            Err(e) => return Err(Error::io("reading a spilled message", e)),
        }
    }
    Ok(buf)
}

fn resolve_segments(descs: &[SegmentDesc], fds: &mut [Option<OwnedFd>]) -> Vec<Result<Arc<Arena>>> {
    descs
        .iter()
        .map(|d| match d {
            SegmentDesc::Fd { fd, dev, ino } => {
                let fd = fds.get_mut(*fd as usize).and_then(Option::take).ok_or_else(|| {
                    Error::invalid(format!("segment descriptor {fd} is missing or used twice"))
                })?;
                if let Some(a) = cache::cache().arena(&SegmentId::Inode { dev: *dev, ino: *ino }) {
                    return Ok(a); // `fd` closes unexamined: this process maps it already
                }
                let st = rustix::fs::fstat(&fd).map_err(|e| Error::io("fstat of a received segment", e))?;
                let id = SegmentId::Inode { dev: st.st_dev, ino: st.st_ino };
                if let Some(a) = cache::cache().arena(&id) {
                    return Ok(a); // `fd` closes: this process has the mapping already
                }
                let arena = Arc::new(Arena::open(Segment::from_fd(fd, 0)?)?);
                cache::cache().insert_arena(&arena);
                Ok(arena)
            }
            SegmentDesc::Named { name } => {
                let id = SegmentId::Name(name.clone());
                if let Some(a) = cache::cache().arena(&id) {
                    return Ok(a);
                }
                let arena = Arc::new(Arena::open(Segment::open_named(name, 0)?)?);
                cache::cache().insert_arena(&arena);
                Ok(arena)
            }
        })
        .collect()
}

/// Resolves every storage of the table. Each holds a count on its slot taken by the sender:
/// kept by a new storage, given back when this process already holds that storage. Counts
/// of entries that cannot be resolved are given back as far as their segment is known.
fn resolve_storages(
    descs: &[StorageDesc],
    segments: &[Result<Arc<Arena>>],
    fds: &mut [Option<OwnedFd>],
) -> Result<Vec<Storage>> {
    let mut out = Vec::with_capacity(descs.len());
    let mut first_err = None;
    // Send events to wait on, once each (a message has one per device).
    let mut events = Vec::new();
    for d in descs {
        let r = match d {
            StorageDesc::Empty(s) => Ok(Storage::from_shared(0, Shared::Empty(*s))),
            StorageDesc::Block { segment, slot, len } => match segments.get(*segment as usize) {
                None => Err(Error::invalid(format!(
                    "storage names segment {segment}, which is not in the message"
                ))),
                Some(Err(e)) => Err(Error::invalid(format!("a storage's segment could not be mapped: {e}"))),
                Some(Ok(arena)) => resolve_block(arena, *slot, *len),
            },
            StorageDesc::Device(d) => resolve_device(d, fds, &mut events),
        };
        match r {
            Ok(s) => out.push(s),
            Err(e) => {
                first_err.get_or_insert(e);
            }
        }
    }
    if let Some(e) = first_err {
        return Err(e); // `out` drops: its counts are given back
    }
    #[cfg(feature = "cuda")]
    for (device, handle) in events {
        crate::cuda::wait_received(device, &handle)?;
    }
    Ok(out)
}

fn resolve_block(arena: &Arc<Arena>, slot: u32, len: u64) -> Result<Storage> {
    if slot >= arena.nslots() {
        return Err(Error::invalid(format!("slot {slot} is outside an arena of {} slots", arena.nslots())));
    }
    let len = usize::try_from(len).ok().filter(|&l| l <= arena.slot_size() && l > 0);
    let Some(len) = len else {
        arena.release(slot);
        return Err(Error::invalid(format!(
            "a storage does not fit its slot of {} bytes",
            arena.slot_size()
        )));
    };
    let mut cache = cache::cache();
    if let Some(inner) = cache.storage(arena.segment().id(), slot) {
        let existing = Storage::from_inner(inner);
        arena.release(slot); // this process already holds one count for it
        if existing.len() != len {
            return Err(Error::invalid(format!(
                "a storage of {len} bytes names a slot that holds one of {} here",
                existing.len()
            )));
        }
        return Ok(existing);
    }
    let storage = Storage::from_shared(len, Shared::Block(Block::adopt(arena.clone(), slot)?));
    cache.insert_storage(arena.segment().id(), slot, &storage.inner);
    Ok(storage)
}

#[cfg(not(feature = "cuda"))]
fn resolve_device(d: &DeviceDesc, _fds: &mut [Option<OwnedFd>], _events: &mut Vec<()>) -> Result<Storage> {
    Err(Error::Device(format!(
        "a tensor on cuda:{} arrived, but this build has no CUDA support (feature `cuda`)",
        d.device
    )))
}

/// Resolves a device allocation: the storage this process already has for it, or a new
/// one (the creator's own allocation coming back, or an import). Either way the sender's
/// event joins `events`, which this process's stream waits on before the value is built.
#[cfg(feature = "cuda")]
fn resolve_device(
    d: &DeviceDesc,
    fds: &mut [Option<OwnedFd>],
    events: &mut Vec<(u32, crate::cuda::IpcBytes)>,
) -> Result<Storage> {
    use crate::cuda::{AllocId, Allocation, Export, IpcBytes};
    let mut take = |i: u32| {
        fds.get_mut(i as usize)
            .and_then(Option::take)
            .ok_or_else(|| Error::invalid(format!("device descriptor {i} is missing or used twice")))
    };
    let lease = take(d.lease)?;
    let export = match &d.memory {
        DeviceMemory::Fd(i) => Export::Fd(Arc::new(take(*i)?)),
        DeviceMemory::Ipc(h) => Export::Ipc(
            IpcBytes::try_from(h.as_slice())
                .map_err(|_| Error::invalid("an IPC memory handle is not 64 bytes"))?,
        ),
    };
    let event = match &d.event {
        None => None,
        Some(h) => Some(
            IpcBytes::try_from(h.as_slice())
                .map_err(|_| Error::invalid("an event handle is not 64 bytes"))?,
        ),
    };
    let size = usize::try_from(d.size).map_err(|_| Error::invalid("a device allocation's size overflows"))?;
    let len = usize::try_from(d.len).ok().filter(|&l| l <= size).ok_or_else(|| {
        Error::invalid(format!("a device storage of {} bytes in an allocation of {size}", d.len))
    })?;
    let id = AllocId { origin: d.id.0, serial: d.id.1 };
    let storage = {
        let mut cache = cache::cache();
        match cache.device(&id) {
            Some(inner) => {
                let existing = Storage::from_inner(inner);
                if existing.len() != len || existing.device() != crate::Device::Cuda(d.device) {
                    return Err(Error::invalid(format!(
                        "a storage of {len} bytes on cuda:{} names an allocation held here as {} bytes on {}",
                        d.device,
                        existing.len(),
                        existing.device()
                    )));
                }
                existing // the message's lease and handle close: this process holds it already
            }
            None => {
                let alloc = Allocation::receive(d.device, id, size, export, lease)?;
                let s = Storage::from_shared(len, Shared::Device(alloc));
                cache.insert_device(id, &s.inner);
                s
            }
        }
    };
    if let Some(h) = event {
        if !events.contains(&(d.device, h)) {
            events.push((d.device, h));
        }
    }
    Ok(storage)
}

/// The holder count of a shared storage's slot, across processes (for tests and tools).
pub fn holders(storage: &Storage) -> Option<u32> {
    match storage.shared()? {
        Shared::Block(b) => Some(b.arena().holders(b.slot())),
        _ => None,
    }
}
