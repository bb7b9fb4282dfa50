//! Interprocess events: [`Event`], and the events that order a consumer's first use of a
//! received allocation after the producer's work on it.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex, MutexGuard, Weak};

use serde::{Deserialize, Deserializer, Serialize, Serializer};

use super::driver::{backend, IpcBytes};
// layering: an Event travels in messages, and why a received one is refused must reach the
// receiver's error, which only the codec can carry through serde (`wire::de_error`).
use crate::wire::de_error;
use crate::{Device, Error, Result};

/// Send events per device, reused round-robin. Re-recording an event that a consumer has
/// not waited on yet only makes that consumer wait for more of the producer's (ordered)
/// stream, never for less, so the ring needs no bound on messages in flight and no stream
/// synchronisation when it wraps (torch stops at 1,000 events and synchronises instead).
const SEND_RING: usize = 32;
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
    rings: HashMap<u32, (Vec<Arc<EventInner>>, usize)>,
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

fn open(device: u32, handle: &IpcBytes) -> Result<Arc<EventInner>> {
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
    let raw = backend()?.event_open(device, handle)?;
    let ev = Arc::new(EventInner { device, raw, handle: *handle });
    e.by_handle.insert(*handle, Arc::downgrade(&ev));
    if e.recent.len() == KEEP_OPEN {
        e.recent.pop_front();
    }
    e.recent.push_back(ev.clone());
    Ok(ev)
}

/// Records a send event on this process's stream of `device`; its handle goes in the
/// message.
pub(crate) fn record_for_send(device: u32) -> Result<IpcBytes> {
    let ev = {
        let mut e = events();
        let (ring, next) = e.rings.entry(device).or_default();
        if ring.len() < SEND_RING {
            drop(e);
            let ev = create(device)?;
            let mut e = events();
            e.rings.entry(device).or_default().0.push(ev.clone());
            ev
        } else {
            let ev = ring[*next % SEND_RING].clone();
            *next = next.wrapping_add(1);
            ev
        }
    };
    backend()?.event_record(device, ev.raw)?;
    Ok(ev.handle)
}

/// Makes this process's stream of `device` wait for a received send event.
///
/// A handle that cannot be opened is skipped: it belongs to a sender that has exited (its
/// queued work finished or was torn down with it, so nothing is left to wait for), or it is
/// forged (and a peer that can forge it can write the memory anyway). A driver that fails
/// to *wait* is an error.
pub(crate) fn wait_received(device: u32, handle: &IpcBytes) -> Result<()> {
    let Ok(ev) = open(device, handle) else { return Ok(()) };
    backend()?.event_wait(device, ev.raw)
}

/// A CUDA event that other processes can wait on (torch's `Event(interprocess=True)`).
///
/// Work is queued on tensorshare's stream of the event's device ([`super::raw_stream`]):
/// [`Event::record`] marks the point reached so far; another process that received the
/// event (it travels in messages and arguments as a 64-byte handle) can
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

    /// The event named by a handle from [`Event::ipc_handle`] (torch's
    /// `Event.from_ipc_handle`): the same event when this process made it.
    pub fn from_ipc_handle(device: Device, handle: [u8; 64]) -> Result<Event> {
        Ok(Event { inner: open(cuda_ordinal(device)?, &handle)? })
    }
}

#[derive(Serialize, Deserialize)]
struct EventRepr {
    device: u32,
    handle: Vec<u8>,
}

impl Serialize for Event {
    fn serialize<S: Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        EventRepr { device: self.inner.device, handle: self.inner.handle.to_vec() }.serialize(s)
    }
}

impl<'de> Deserialize<'de> for Event {
    fn deserialize<D: Deserializer<'de>>(d: D) -> std::result::Result<Event, D::Error> {
        let r = EventRepr::deserialize(d)?;
        let handle: IpcBytes =
            r.handle.try_into().map_err(|_| de_error("an event handle is not 64 bytes"))?;
        Event::from_ipc_handle(Device::Cuda(r.device), handle).map_err(de_error)
    }
}
