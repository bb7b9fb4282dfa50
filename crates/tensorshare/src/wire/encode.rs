//! Values into messages.

use std::os::fd::AsRawFd;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use serde::Serialize;

use super::header::{self, Header, SegmentDesc, StorageDesc};
use super::{cache, Encoded, FdSource, LaneArena, LaneForm, ENCODING};
use crate::arena::Arena;
use crate::storage::Shared;
use crate::util::FastMap;
use crate::{Error, Result, Storage};

/// The encoding context of a thread: what the message being encoded names so far. It stays
/// in its thread-local between messages, emptied, so that a message of a few tensors
/// allocates no map or list of its own and moves no context around.
#[derive(Default)]
pub(super) struct EncodeCtx {
    /// Whether a value is being serialized into a message on this thread now.
    pub(super) active: bool,
    fds: Vec<FdSource>,
    fd_index: FastMap<i32, u32>,
    /// Arenas named so far, in table order.
    arenas: Vec<Arc<Arena>>,
    segment_index: FastMap<*const Arena, u32>,
    /// The slots the message names: (index in `arenas`, slot).
    named: Vec<(u32, u32)>,
    /// Room for one arena's slots at a time, as `send_hold` takes them.
    slots: Vec<u32>,
    storages: Vec<StorageDesc>,
    storage_index: FastMap<*const crate::storage::Inner, u32>,
}

/// Most entries a kept map or list may have room for: a message of a batch of small
/// tensors reuses them (a map of this many entries is a few pages), and one of far more
/// storages does not leave its large maps to this thread for good.
const SPARE_ROOM: usize = 1024;

impl EncodeCtx {
    /// Empties the context for the next message, keeping the room of its maps and lists
    /// unless one grew past `SPARE_ROOM`.
    fn finish(&mut self) {
        let most = [
            self.fds.capacity(),
            self.fd_index.capacity(),
            self.segment_index.capacity(),
            self.storage_index.capacity(),
            self.arenas.capacity(),
            self.named.capacity(),
            self.slots.capacity(),
            self.storages.capacity(),
        ];
        if most.into_iter().max().unwrap_or(0) > SPARE_ROOM {
            *self = EncodeCtx::default();
            return;
        }
        self.active = false;
        self.fds.clear();
        self.fd_index.clear();
        self.segment_index.clear();
        self.storage_index.clear();
        self.arenas.clear();
        self.named.clear();
        self.slots.clear();
        self.storages.clear();
    }

    /// The context of the message being serialized on this thread, if one is.
    fn if_active(&mut self) -> Result<&mut EncodeCtx> {
        match self.active {
            true => Ok(self),
            false => Err(Error::Serialize("not encoding a message".into())),
        }
    }
}

/// Bytes a payload starts with room for.
const PAYLOAD_ROOM: usize = 256;

/// Turns `value` into a message: tensors become handles to shared memory. A private
/// storage is moved into shared memory first, in place, for all of its handles (as torch
/// does), so that the sender and the receiver see the same bytes.
pub(crate) fn encode<T: Serialize + ?Sized>(value: &T) -> Result<Encoded> {
    encode_with(value, None)
}

/// Most slots a lane message may name. A lane holds what its messages name for a window of
/// them (see `channel::lane`), far longer than a consumer that drops them at once would:
/// a message of many storages (a batch of small tensors) would keep thousands of slots held,
/// and its creator would make new arenas instead of reusing warm ones. Such messages go
/// through the socket, whose holds end at the consumer's next receive.
const LANE_MAX_SLOTS: usize = 16;
/// Largest slot a lane message may name, for the same reason: a window of 1 MiB storages
/// would keep 64 MiB from being reused, and the syscalls the lane saves are small beside
/// touching that much memory.
const LANE_MAX_SLOT_BYTES: usize = 64 << 10;

/// As [`encode`], and also in the form of a queue's lane (see [`LaneForm`]) when the
/// message fits one: at most `lane_max` bytes, and no descriptor but the send descriptions
/// of arenas of size classes of at most `LANE_MAX_SLOT_BYTES`, naming at most
/// `LANE_MAX_SLOTS` slots.
pub(crate) fn encode_for_lane<T: Serialize + ?Sized>(value: &T, lane_max: usize) -> Result<Encoded> {
    encode_with(value, Some(lane_max))
}

fn encode_with<T: Serialize + ?Sized>(value: &T, lane_max: Option<usize>) -> Result<Encoded> {
    struct Reset;
    impl Drop for Reset {
        fn drop(&mut self) {
            // Leave the context empty for the next message, also when a Serialize impl or a
            // hold panics (the borrow below is given up before this runs).
            ENCODING.with(|c| c.borrow_mut().finish());
        }
    }
    let begun = ENCODING.with(|c| !std::mem::replace(&mut c.borrow_mut().active, true));
    if !begun {
        return Err(Error::Serialize("encode called while encoding another message".into()));
    }
    let _reset = Reset;
    super::forget_reason();
    // Room for a value of a few tensors from the start, rather than growing from a few bytes.
    let payload = postcard::to_extend(value, Vec::with_capacity(PAYLOAD_ROOM))
        .map_err(|e| Error::Serialize(super::reason(e)))?;
    ENCODING.with(|c| {
        let mut ctx = c.borrow_mut();
        // Serialized: from here on tensors are no longer encoded as handles (`encoding`).
        ctx.active = false;
        finish_message(&mut ctx, payload, lane_max)
    })
}

/// The rest of a message once its value is serialized: the send holds of its arenas, its
/// header, and its lane form when it has one.
fn finish_message(ctx: &mut EncodeCtx, payload: Vec<u8>, lane_max: Option<usize>) -> Result<Encoded> {
    // What the sender queued on the devices of the message's CUDA storages is done before
    // the message exists, once the whole value is serialized (a write queued while it was
    // being serialized included): its receivers read it without waiting on anything of ours.
    #[cfg(feature = "cuda")]
    {
        let mut finished: Vec<u32> = Vec::new();
        for s in &ctx.storages {
            if let StorageDesc::Device(d) = s {
                if !finished.contains(&d.device) {
                    crate::cuda::finish_for_send(d.device)?;
                    finished.push(d.device);
                }
            }
        }
    }
    // The slots, arena by arena.
    ctx.named.sort_unstable();
    // Only arenas' descriptors, none of them a large storage's (which the lane's windows
    // would keep alive far longer than a message does).
    let mut lane_ok = lane_max.is_some()
        && ctx.fds.is_empty()
        && ctx.arenas.iter().all(|a| !a.is_large() && a.slot_size() <= LANE_MAX_SLOT_BYTES)
        && ctx.named.len() <= LANE_MAX_SLOTS
        && ctx.storages.iter().all(|s| !matches!(s, StorageDesc::Device(_)));
    // The arenas' descriptors last: each is a send description with the message's slots
    // locked on it, taken only now that the whole value is known.
    let mut segments = Vec::with_capacity(ctx.arenas.len());
    let mut lane_arenas = Vec::new();
    let arenas = std::mem::take(&mut ctx.arenas);
    let mut slots = std::mem::take(&mut ctx.slots);
    let mut next = 0;
    for (i, arena) in arenas.iter().enumerate() {
        slots.clear();
        // Every arena of the table has a slot named (it was added for one).
        while let Some(&(_, slot)) = ctx.named.get(next).filter(|&&(a, _)| a as usize == i) {
            slots.push(slot);
            next += 1;
        }
        let (fd, tag) = arena.send_hold(&slots)?;
        let name = arena.segment().name().map(str::to_owned);
        if lane_ok {
            lane_ok = name.as_ref().is_none_or(|n| n.len() <= 255);
            let id = arena.segment().file_id();
            lane_arenas.push(LaneArena { desc: fd.clone(), tag, id, name: name.clone() });
        }
        segments.push(SegmentDesc { fd: push_fd(ctx, FdSource::Fd(fd)), name, id: None });
    }
    ctx.arenas = arenas;
    ctx.slots = slots;
    let nfds = u32::try_from(ctx.fds.len()).map_err(|_| Error::Serialize("too many descriptors".into()))?;
    let fds = std::mem::take(&mut ctx.fds);
    let mut header = Header { nfds, segments, storages: std::mem::take(&mut ctx.storages) };
    let lane = match lane_max {
        Some(max) if lane_ok => lane_form(&mut header, &payload, lane_arenas, max)?,
        _ => None,
    };
    if lane.is_some() {
        return Ok(Encoded { bytes: Vec::new(), fds, lane, unframed: Some((header, payload)) });
    }
    let mut bytes = header::frame(&header, payload.len())?;
    bytes.extend_from_slice(&payload);
    Ok(Encoded { bytes, fds, lane, unframed: None })
}

/// The message with its arenas named by identity and no descriptor, if it fits `max`.
/// Leaves `header` as it was.
fn lane_form(
    header: &mut Header,
    payload: &[u8],
    arenas: Vec<LaneArena>,
    max: usize,
) -> Result<Option<LaneForm>> {
    // A lane message carries no other descriptor, so segment `i`'s is descriptor `i`.
    if header.segments.iter().enumerate().any(|(i, s)| s.fd as usize != i) {
        return Ok(None);
    }
    let nfds = std::mem::replace(&mut header.nfds, 0);
    for (s, a) in header.segments.iter_mut().zip(&arenas) {
        s.fd = 0;
        s.id = Some((a.id.0, a.id.1, a.tag));
    }
    let framed = header::frame(header, payload.len());
    header.nfds = nfds;
    for (i, s) in header.segments.iter_mut().enumerate() {
        s.fd = i as u32;
        s.id = None;
    }
    let mut bytes = framed?;
    if bytes.len() + payload.len() > max {
        return Ok(None);
    }
    bytes.extend_from_slice(payload);
    Ok(Some(LaneForm { bytes, arenas }))
}

/// Adds a descriptor to the message being encoded; returns its index.
pub(crate) fn encode_fd(source: FdSource) -> Result<u32> {
    ENCODING.with(|c| Ok(push_fd(c.borrow_mut().if_active()?, source)))
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
        let ctx = c.if_active()?;
        let key = Arc::as_ptr(&storage.inner);
        if let Some(&i) = ctx.storage_index.get(&key) {
            return Ok(i);
        }
        if storage.shared().is_none() {
            storage.share_memory()?;
        }
        let desc = match storage.shared() {
            None => return Err(Error::Serialize("a storage that is not shared after share_memory".into())),
            Some(Shared::Empty(s)) => StorageDesc::Empty(*s),
            Some(Shared::Slot(slot)) => {
                let arena = slot.arena();
                // (An arena inherited through fork is its parent's: the cache keeps this
                // process's own mapping of that file, and a kept inherited one would keep
                // the child's fork hold for good.)
                if !storage.inner.cached.load(Ordering::Relaxed) && arena.is_own() {
                    // So that the storage is found again if it comes back to this process.
                    let mut cache = cache::cache();
                    cache.insert_storage(arena.segment().file_id(), slot.slot(), &storage.inner);
                    if !arena.cached.load(Ordering::Relaxed) {
                        cache.insert_arena(arena);
                    }
                }
                let segment = match ctx.segment_index.get(&Arc::as_ptr(arena)) {
                    Some(&i) => i,
                    None => {
                        ctx.arenas.push(arena.clone());
                        let i = (ctx.arenas.len() - 1) as u32;
                        ctx.segment_index.insert(Arc::as_ptr(arena), i);
                        i
                    }
                };
                ctx.named.push((segment, slot.slot()));
                StorageDesc::Slot { segment, slot: slot.slot(), len: storage.len() as u64 }
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

#[cfg(feature = "cuda")]
fn device_desc(ctx: &mut EncodeCtx, alloc: &crate::cuda::Allocation, len: usize) -> Result<StorageDesc> {
    use super::header::{DeviceDesc, DeviceMemory};
    let (export, lease) = alloc.wire_parts()?;
    let memory = match export {
        crate::cuda::Export::Fd(fd) => DeviceMemory::Fd(push_fd(ctx, FdSource::Fd(fd))),
        crate::cuda::Export::Ipc(h) => DeviceMemory::Ipc(h.to_vec()),
    };
    let lease = push_fd(ctx, FdSource::Fd(lease));
    Ok(StorageDesc::Device(DeviceDesc {
        device: alloc.device,
        id: (alloc.id.origin, alloc.id.serial),
        size: alloc.size as u64,
        len: len as u64,
        memory,
        lease,
    }))
}
