//! Interprocess events: [`Event`], and [`EventHandle`], the form in which one travels.
//!
//! Messages carry no events: a forged or damaged event handle makes the driver's
//! cuIpcOpenEventHandle read out of bounds and the receiver die of SIGSEGV (seen on an
//! H200 with driver 580: one flipped bit of the handle's index field), so no bytes from a
//! peer are opened as an event unless the program says, with `unsafe`, that it trusts
//! them. A sender finishes its work on the CUDA storages of a message before it leaves
//! instead (`finish_for_send`).

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex, MutexGuard, Weak};

use serde::{Deserialize, Serialize};

use super::driver::{backend, IpcBytes};
use crate::{Device, Error, Result};

/// Events opened from other processes' handles, kept open for reuse.
const KEEP_OPEN: usize = 64;

struct EventInner {
    device: u32,
    raw: u64,
    handle: IpcBytes,
}

impl Drop for EventInner {
    fn drop(&mut self) {
        if let Ok(b) = backend() {
            b.event_destroy(self.device, self.raw);
        }
    }
}

#[derive(Default)]
struct Events {
    /// Every event this process made or opened, by handle, so a handle coming back is the
    /// same event.
    by_handle: HashMap<IpcBytes, Weak<EventInner>>,
    recent: VecDeque<Arc<EventInner>>,
}

fn events() -> MutexGuard<'static, Events> {
    static E: std::sync::OnceLock<Mutex<Events>> = std::sync::OnceLock::new();
    crate::util::lock(E.get_or_init(Default::default))
}

fn create(device: u32) -> Result<Arc<EventInner>> {
    let (raw, handle) = backend()?.event_create(device)?;
    let ev = Arc::new(EventInner { device, raw, handle });
    let mut e = events();
    if e.by_handle.len() > 1024 {
        e.by_handle.retain(|_, w| w.strong_count() > 0);
    }
    e.by_handle.insert(handle, Arc::downgrade(&ev));
    Ok(ev)
}

/// The event a handle names: the live one of this process that has it, or the driver's.
///
/// # Safety
/// As [`Event::from_ipc_handle`].
unsafe fn open(device: u32, handle: &IpcBytes) -> Result<Arc<EventInner>> {
    let mut e = events();
    if let Some(ev) = e.by_handle.get(handle).and_then(Weak::upgrade) {
        if ev.device != device {
            return Err(Error::invalid(format!(
                "an event of cuda:{} arrived as an event of cuda:{device}",
                ev.device
            )));
        }
        return Ok(ev);
    }
    // SAFETY: no live event of this process has the handle, so the caller's contract says
    // it is a real handle of another process's event.
    let raw = unsafe { backend()?.event_open(device, handle)? };
    let ev = Arc::new(EventInner { device, raw, handle: *handle });
    e.by_handle.insert(*handle, Arc::downgrade(&ev));
    if e.recent.len() == KEEP_OPEN {
        e.recent.pop_front();
    }
    e.recent.push_back(ev.clone());
    Ok(ev)
}

/// A CUDA event that other processes can wait on (torch's `Event(interprocess=True)`).
///
/// Work is queued on tensorshare's stream of the event's device ([`super::raw_stream`]):
/// [`Event::record`] marks the point reached so far; another process that received the
/// event's [`EventHandle`] (it travels in messages and arguments) and opened it can
/// [`Event::wait`] (its stream waits, the host does not) or [`Event::synchronize`].
#[derive(Clone)]
pub struct Event {
    inner: Arc<EventInner>,
}

impl std::fmt::Debug for Event {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Event").field("device", &self.device()).finish()
    }
}

fn cuda_ordinal(device: Device) -> Result<u32> {
    match device {
        Device::Cuda(i) => Ok(i),
        d => Err(Error::Device(format!("an event needs a CUDA device, not {d}"))),
    }
}

impl Event {
    /// A new interprocess event on `device`, not yet recorded (waiting on it returns at once).
    pub fn new(device: Device) -> Result<Event> {
        Ok(Event { inner: create(cuda_ordinal(device)?)? })
    }

    /// The event's device.
    pub fn device(&self) -> Device {
        Device::Cuda(self.inner.device)
    }

    /// Records the event at the current end of this process's stream of its device.
    pub fn record(&self) -> Result<()> {
        backend()?.event_record(self.inner.device, self.inner.raw)
    }

    /// Makes this process's stream wait until the work before the last record is done; the
    /// host goes on at once.
    pub fn wait(&self) -> Result<()> {
        backend()?.event_wait(self.inner.device, self.inner.raw)
    }

    /// Blocks the calling thread until the work before the last record is done.
    pub fn synchronize(&self) -> Result<()> {
        backend()?.event_synchronize(self.inner.device, self.inner.raw)
    }

    /// Whether the work before the last record is done.
    pub fn query(&self) -> Result<bool> {
        backend()?.event_query(self.inner.device, self.inner.raw)
    }

    /// The 64-byte interprocess handle (torch's `ipc_handle()`).
    pub fn ipc_handle(&self) -> [u8; 64] {
        self.inner.handle
    }

    /// The event's device and handle, to send to another process, which opens it with
    /// [`EventHandle::open`].
    pub fn handle(&self) -> EventHandle {
        EventHandle { device: self.inner.device, handle: self.inner.handle.to_vec() }
    }

    /// The event named by a handle from [`Event::ipc_handle`] (torch's
    /// `Event.from_ipc_handle`): the same event when an [`Event`] of this process has it.
    ///
    /// # Safety
    /// `handle` must be what [`Event::ipc_handle`] returned, unchanged, for an event on
    /// `device` that is still alive: in this process (an [`Event`] of it not yet dropped,
    /// by any thread) or in another. The CUDA driver does not check a handle's contents,
    /// and a forged or damaged one makes it read out of bounds (the process dies of
    /// SIGSEGV, or worse).
    pub unsafe fn from_ipc_handle(device: Device, handle: [u8; 64]) -> Result<Event> {
        // SAFETY: the caller's contract is open's.
        Ok(Event { inner: unsafe { open(cuda_ordinal(device)?, &handle)? } })
    }
}

/// An [`Event`] as it travels: its device and 64-byte handle, inert until opened. A
/// message can carry one from any peer, so opening it is `unsafe`: see
/// [`EventHandle::open`].
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct EventHandle {
    device: u32,
    handle: Vec<u8>,
}

impl EventHandle {
    /// The device of the event it names.
    pub fn device(&self) -> Device {
        Device::Cuda(self.device)
    }

    /// Opens the event: the same [`Event`] when an [`Event`] of this process has it.
    ///
    /// # Safety
    /// As [`Event::from_ipc_handle`]: the handle must come from [`Event::handle`] of an event
    /// still alive (in this process or another), unchanged. Whoever could write the message
    /// it came in must be trusted with that: the driver reads out of bounds on a forged or
    /// damaged handle.
    ///
    /// # Errors
    /// [`Error::InvalidMessage`] for a handle that is not 64 bytes or names an event this
    /// process has on another device; [`Error::Device`] when the driver refuses it (its
    /// process has exited, for one).
    pub unsafe fn open(&self) -> Result<Event> {
        let handle: IpcBytes =
            self.handle.as_slice().try_into().map_err(|_| {
                Error::invalid(format!("an event handle of {} bytes, not 64", self.handle.len()))
            })?;
        // SAFETY: the caller's contract is from_ipc_handle's.
        unsafe { Event::from_ipc_handle(Device::Cuda(self.device), handle) }
    }
}
