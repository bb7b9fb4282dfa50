//! Messages back into values, every handle checked before use.

use std::os::fd::{AsFd, OwnedFd};
use std::sync::Arc;

use serde::de::DeserializeOwned;

use super::header::{self, SegmentDesc, StorageDesc};
use super::{cache, DECODING};
use crate::arena::{Arena, Slot};
use crate::shm::{FileId, Segment};
use crate::storage::Shared;
use crate::{Error, Result, Storage};
use lists::Lists;

#[path = "decode_lists.rs"]
mod lists;

pub(super) struct DecodeCtx {
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

/// Turns a message (bytes and the descriptors that came with it) back into a value,
/// checking every handle. A malformed message is [`Error::InvalidMessage`]; its
/// descriptors are closed, which gives back whatever it held.
///
/// With `borrow` (a message from a queue or a pipe), the slots it brings are held through
/// its own descriptors until this process next receives or waits, and descriptors it no
/// longer needs close then too (see `arena::borrow`): a value passed straight on costs no
/// lock. Without, this process takes its own holds now.
pub(crate) fn decode<T: DeserializeOwned>(message: &[u8], fds: Vec<OwnedFd>, borrow: bool) -> Result<T> {
    decode_from(message, fds, borrow, None)
}

/// A message taken from a queue's lane back into a value: it carries no descriptor, and
/// names each arena by identity, which must be one `lane` knows or finds in the queue's
/// directory. The slots it brings are borrowed, as from a socket message, through the send
/// description parked in the directory under the tag the message names (see
/// `LaneArenas::via`); where there is none, this process takes its own holds at once.
pub(crate) fn decode_lane<T: DeserializeOwned>(message: &[u8], lane: &dyn super::LaneArenas) -> Result<T> {
    decode_from(message, Vec::new(), true, Some(lane))
}

fn decode_from<T: DeserializeOwned>(
    message: &[u8],
    fds: Vec<OwnedFd>,
    borrow: bool,
    lane: Option<&dyn super::LaneArenas>,
) -> Result<T> {
    // What earlier messages borrowed is settled before this one borrows.
    crate::arena::settle();
    let (body, storages, fds) =
        Lists::with(|lists| resolve_message(message, fds, borrow, lane, lists)).map_err(lost_at_the_limit)?;
    DECODING.with(|c| *c.borrow_mut() = Some(DecodeCtx { storages, fds }));
    struct Reset;
    impl Drop for Reset {
        fn drop(&mut self) {
            DECODING.with(|c| c.borrow_mut().take());
        }
    }
    let _reset = Reset;
    super::forget_reason();
    postcard::from_bytes::<T>(&message[body..]).map_err(|e| Error::invalid(super::reason(e)))
}

/// A failure to finish a message taken already, for want of descriptors (more than the
/// reserve kept for it: see `shm::fd_reserve`), says that the message is lost, unlike a
/// receive refused before it took one.
fn lost_at_the_limit(e: Error) -> Error {
    match e {
        Error::Io { context, source }
            if matches!(source.raw_os_error(), Some(libc::EMFILE | libc::ENFILE)) =>
        {
            Error::Io { context: format!("{context}; the message that needed it is lost"), source }
        }
        e => e,
    }
}

/// The arena a received descriptor refers to: this process's own mapping of it if it has
/// one (found by the identity the kernel reports for the descriptor, never by a claim of
/// the message), else a new mapping through a description of this process's own.
///
/// `named`: the identity a lane message named the arena by, which the descriptor must have.
fn resolve_arena(
    d: &SegmentDesc,
    fd: std::os::fd::BorrowedFd<'_>,
    named: Option<FileId>,
) -> Result<Arc<Arena>> {
    let id = crate::shm::file_id(fd)?;
    if named.is_some_and(|n| n != id) {
        return Err(Error::invalid("a lane's arena descriptor is not the arena the message names"));
    }
    if let Some(a) = cache::cache().arena(id) {
        return Ok(a);
    }
    let own = crate::shm::reopen(fd)?;
    let seg = match &d.name {
        None => Segment::from_fd(own, 0)?,
        Some(name) => Segment::from_named_fd(own, name)?,
    };
    if seg.file_id() != id {
        return Err(Error::invalid("a received segment changed identity while it was opened"));
    }
    let arena = crate::arena::listed(Arena::open(seg)?);
    cache::cache().insert_arena(&arena);
    Ok(arena)
}

/// An arena a lane message names by `id`: this process's mapping of it if the queue has
/// shown it this arena before, else one through a descriptor from the queue's directory.
/// Never an arena this process has from elsewhere only: a peer cannot name into those.
fn lane_arena(d: &SegmentDesc, id: FileId, lane: &dyn super::LaneArenas) -> Result<Arc<Arena>> {
    if lane.known(id) {
        if let Some(a) = cache::cache().arena(id) {
            return Ok(a);
        }
    }
    let fd = lane.fetch(id)?;
    resolve_arena(d, fd.as_fd(), Some(id))
}

/// The first part of decoding a message: its header read into `lists`, its arenas and its
/// storages resolved. Returns where the value starts, the storages, and the descriptors
/// the value may still take.
fn resolve_message(
    message: &[u8],
    fds: Vec<OwnedFd>,
    borrow: bool,
    lane: Option<&dyn super::LaneArenas>,
    lists: &mut Lists,
) -> Result<(usize, Vec<Storage>, Vec<Option<OwnedFd>>)> {
    let mut header = std::mem::take(&mut lists.header);
    let body = header::parse_into(message, &mut header)?;
    if fds.len() != header.nfds as usize {
        return Err(Error::invalid(format!(
            "the message names {} descriptors but {} came with it",
            header.nfds,
            fds.len()
        )));
    }
    let mut fds: Vec<Option<OwnedFd>> = fds.into_iter().map(Some).collect();
    // The arenas' descriptors stay open until this process holds its own locks on the
    // slots it keeps, or borrows their holds: until then they are what holds them. (A lane
    // message's are parked in its queue's directory until this process is done with it.)
    let Lists { arenas, carried, .. } = &mut *lists;
    for d in &header.segments {
        match (d.id, lane) {
            (None, None) => {
                let fd = fds.get_mut(d.fd as usize).and_then(Option::take).ok_or_else(|| {
                    Error::invalid(format!("segment descriptor {} is missing or used twice", d.fd))
                })?;
                arenas.push(resolve_arena(d, fd.as_fd(), None)?);
                carried.push(Some(Arc::new(fd)));
            }
            (Some((dev, ino, tag)), Some(lane)) => {
                let arena = lane_arena(d, (dev, ino), lane)?;
                // Its creator holds no slot of it: nothing to borrow.
                let borrows = tag != 0 && !arena.is_creator();
                carried.push(if borrows { lane.via((dev, ino), tag) } else { None });
                arenas.push(arena);
            }
            (Some(_), None) => {
                return Err(Error::invalid("a segment named by identity outside a queue's lane"))
            }
            (None, Some(_)) => return Err(Error::invalid("a lane message with a segment descriptor")),
        }
    }
    let storages = resolve_storages(&header.storages, lists, borrow, &mut fds)?;
    for fd in lists.carried.drain(..).flatten() {
        // Closed now, later (after the reply), or when the slots that borrow it go.
        match Arc::try_unwrap(fd) {
            Ok(fd) if borrow => crate::arena::let_go(fd),
            _ => {}
        }
    }
    lists.header = header;
    Ok((body, storages, fds))
}

/// Resolves every storage of the table: the storage this process already has for a slot,
/// or a new handle of it. New handles take this process's holds, segment by segment, in
/// one step each (see `Arena::hold`).
fn resolve_storages(
    descs: &[StorageDesc],
    lists: &mut Lists,
    borrow: bool,
    fds: &mut [Option<OwnedFd>],
) -> Result<Vec<Storage>> {
    let Lists { arenas, carried, new, slots, .. } = lists;
    let mut out: Vec<Option<Storage>> = Vec::with_capacity(descs.len());
    // Slots this process does not hold yet, one per entry (a message may name a slot
    // twice).
    new.clear();
    {
        let cache = cache::cache();
        for (i, d) in descs.iter().enumerate() {
            let s = match d {
                StorageDesc::Empty(s) => Some(Storage::from_shared(0, Shared::Empty(*s))),
                StorageDesc::Slot { segment, slot, len } => {
                    let arena = arenas.get(*segment as usize).ok_or_else(|| {
                        Error::invalid(format!(
                            "storage names segment {segment}, which is not in the message"
                        ))
                    })?;
                    let len = check_slot(arena, *slot, *len)?;
                    match cache.storage(arena.segment().file_id(), *slot) {
                        Some(inner) => Some(existing(Storage::from_inner(inner), len)?),
                        None => {
                            new.push((*segment, *slot, len, i));
                            None
                        }
                    }
                }
                StorageDesc::Device(_) => None,
            };
            out.push(s);
        }
    }
    for (i, d) in descs.iter().enumerate() {
        if let StorageDesc::Device(d) = d {
            out[i] = Some(resolve_device(d, fds)?);
        }
    }
    // By segment, the entries naming one slot side by side.
    new.sort_unstable_by_key(|&(segment, slot, _, at)| (segment, slot, at));
    for pending in new.chunk_by(|a, b| a.0 == b.0) {
        let i = pending[0].0 as usize;
        let arena = &arenas[i];
        // Each slot once, with one length.
        slots.clear();
        for (k, &(_, slot, len, _)) in pending.iter().enumerate() {
            match k.checked_sub(1).map(|p| pending[p]) {
                Some((_, prev, prev_len, _)) if prev == slot => {
                    if prev_len != len {
                        return Err(Error::invalid("one slot named with two lengths"));
                    }
                }
                _ => slots.push(slot),
            }
        }
        let via = carried.get(i).and_then(Option::as_ref).filter(|_| borrow);
        let mut handles = Slot::hold(arena, slots, via)?;
        let mut cache = cache::cache();
        let mut last: Option<(u32, Storage)> = None;
        for &(_, slot, len, at) in pending {
            let storage = match &last {
                Some((s, storage)) if *s == slot => storage.clone(),
                _ => {
                    let handle =
                        handles.next().ok_or_else(|| Error::invalid("a slot left without a handle"))?;
                    let storage = Storage::from_shared(len, Shared::Slot(handle));
                    cache.insert_storage(arena.segment().file_id(), slot, &storage.inner);
                    last = Some((slot, storage.clone()));
                    storage
                }
            };
            out[at] = Some(storage);
        }
    }
    out.into_iter()
        .map(|s| s.ok_or_else(|| Error::invalid("a storage of the message was not resolved")))
        .collect()
}

/// The length of a storage in `slot`, checked against the arena.
fn check_slot(arena: &Arena, slot: u32, len: u64) -> Result<usize> {
    if slot >= arena.nslots() {
        return Err(Error::invalid(format!("slot {slot} is outside an arena of {} slots", arena.nslots())));
    }
    usize::try_from(len).ok().filter(|&l| l <= arena.slot_size() && l > 0).ok_or_else(|| {
        Error::invalid(format!(
            "a storage of {len} bytes does not fit its slot of {} bytes",
            arena.slot_size()
        ))
    })
}

/// A storage this process has already, named again: it must have the length named.
fn existing(storage: Storage, len: usize) -> Result<Storage> {
    if storage.len() != len {
        return Err(Error::invalid(format!(
            "a storage of {len} bytes names a slot that holds one of {} here",
            storage.len()
        )));
    }
    Ok(storage)
}

#[cfg(not(feature = "cuda"))]
fn resolve_device(d: &super::header::DeviceDesc, _fds: &mut [Option<OwnedFd>]) -> Result<Storage> {
    Err(Error::Device(format!(
        "a tensor on cuda:{} arrived, but this build has no CUDA support (feature `cuda`)",
        d.device
    )))
}

/// Resolves a device allocation: the storage this process already has for it, or a new
/// one (the creator's own allocation coming back, or an import). The sender's work on it
/// was done before the message left (see `cuda::finish_for_send`): nothing to wait for.
#[cfg(feature = "cuda")]
fn resolve_device(d: &super::header::DeviceDesc, fds: &mut [Option<OwnedFd>]) -> Result<Storage> {
    use super::header::DeviceMemory;
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
                let s = Storage::from_shared(len, Shared::Device(Box::new(alloc)));
                cache.insert_device(id, &s.inner);
                s
            }
        }
    };
    Ok(storage)
}

#[cfg(test)]
#[path = "decode_tests.rs"]
mod tests;
