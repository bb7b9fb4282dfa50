//! The device layer under `cuda`: the CUDA driver or the simulated device, chosen once per
//! process (`TENSORSHARE_CUDA_DRIVER`), and the fork rule that goes with it.

use std::os::fd::OwnedFd;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};

use super::real::Real;
use super::sim::Sim;
use crate::shm::Segment;
use crate::{Error, Result};

/// Environment variable choosing the device layer: unset or `cuda` for the CUDA driver,
/// `cuda-legacy-ipc` for the driver with legacy IPC memory handles on every device
/// (cuMemAlloc; the only way to share the memory of a device without VMM or POSIX-fd
/// handles, and the program's consent to open such handles from messages: the driver does
/// not check them, so a forged one can crash the receiver), `simulated`
/// (two devices) or `simulated:N` for the simulated device, which keeps "device" memory in
/// memfds so that CUDA sharing can be exercised without a GPU. Workers inherit it.
pub const DRIVER_ENV: &str = "TENSORSHARE_CUDA_DRIVER";

/// A legacy IPC handle (memory or event): 64 opaque bytes.
pub(crate) type IpcBytes = [u8; 64];

/// What this process must give back for an allocation it maps.
pub(crate) enum Mem {
    /// Simulated: the memfd mapping.
    Sim(Segment),
    /// VMM: the generic handle and its mapped range.
    Vmm { handle: u64, ptr: u64, size: usize },
    /// cuMemAlloc'd here, or opened from a legacy IPC handle.
    Legacy { ptr: u64, imported: bool },
}

/// An allocation mapped in this process: what to give back, where it is, how big.
pub(crate) struct Mapped {
    pub(crate) mem: Mem,
    pub(crate) ptr: u64,
    pub(crate) size: usize,
}

/// How an allocation travels.
#[derive(Clone)]
pub(crate) enum Export {
    /// A descriptor (VMM POSIX-fd handle, or the simulated memfd): rides SCM_RIGHTS.
    Fd(Arc<OwnedFd>),
    /// A legacy IPC memory handle: plain bytes.
    Ipc(IpcBytes),
}

pub(crate) enum Backend {
    Real(Real),
    Sim(Sim),
}

/// The process that initialised the device layer, by its `fork::stamp` (0: none). A forked
/// child inherits the initialised state but not a usable driver, so it gets an error
/// instead. Not a pid: a descendant may be given the pid of a dead ancestor.
static INIT_BY: AtomicU64 = AtomicU64::new(0);

/// Whether this process (or the parent it was forked from) has initialised the device
/// layer.
pub(crate) fn initialised() -> bool {
    INIT_BY.load(Ordering::Relaxed) != 0
}

/// The device layer, initialised on first use.
pub(crate) fn backend() -> Result<&'static Backend> {
    static BACKEND: OnceLock<std::result::Result<Backend, String>> = OnceLock::new();
    // The stamp (`fork::stamp`) of the process in which a thread began to initialise the
    // layer. Loading the driver has effects (a library loaded, `cuInit`), so two threads do
    // not race to do it as a `Lazy` would: one waits for the other. A child forked meanwhile
    // has no thread to wait for, and says so instead.
    static INITIALISING: AtomicU64 = AtomicU64::new(0);
    if BACKEND.get().is_none() {
        let me = crate::util::fork::stamp();
        let began = INITIALISING.compare_exchange(0, me, Ordering::AcqRel, Ordering::Acquire);
        if began.is_err_and(|by| by != me) {
            return Err(Error::Device(
                "Cannot initialize CUDA in forked subprocess: another thread of the parent was \
                 initialising it when this process was forked; start workers with \
                 StartMethod::Spawn or ForkServer"
                    .into(),
            ));
        }
    }
    let b = BACKEND.get_or_init(|| {
        let b = choose().map_err(|e| e.to_string());
        if b.is_ok() {
            INIT_BY.store(crate::util::fork::stamp(), Ordering::Relaxed);
        }
        b
    });
    let init = INIT_BY.load(Ordering::Relaxed);
    if init != 0 && init != crate::util::fork::stamp() {
        return Err(Error::Device(
            "Cannot re-initialize CUDA in forked subprocess: a process this one was forked from \
             initialised CUDA first; start workers with StartMethod::Spawn or ForkServer"
                .into(),
        ));
    }
    b.as_ref().map_err(|e| Error::Device(e.clone()))
}

fn choose() -> Result<Backend> {
    let var = std::env::var(DRIVER_ENV).unwrap_or_default();
    match var.as_str() {
        "" | "cuda" => Ok(Backend::Real(Real::load(false)?)),
        "cuda-legacy-ipc" => Ok(Backend::Real(Real::load(true)?)),
        "simulated" => Ok(Backend::Sim(Sim::new(2))),
        other => match other.strip_prefix("simulated:").and_then(|n| n.parse::<u32>().ok()) {
            Some(n) => Ok(Backend::Sim(Sim::new(n))),
            None => Err(Error::Parse(format!(
                "{DRIVER_ENV}={other:?}: expected `cuda`, `cuda-legacy-ipc`, `simulated` or `simulated:N`"
            ))),
        },
    }
}

impl Backend {
    pub(crate) fn name(&self) -> &'static str {
        match self {
            Backend::Real(r) if r.legacy_ipc => "cuda-legacy-ipc",
            Backend::Real(_) => "cuda",
            Backend::Sim(_) => "simulated",
        }
    }

    pub(crate) fn device_count(&self) -> u32 {
        match self {
            Backend::Real(r) => r.device_count(),
            Backend::Sim(s) => s.device_count(),
        }
    }

    /// Checks that `dev` exists.
    pub(crate) fn check_device(&self, dev: u32) -> Result<()> {
        let n = self.device_count();
        if dev >= n {
            return Err(Error::Device(format!(
                "cuda:{dev} does not exist: the {} device layer has {n} device{}",
                self.name(),
                if n == 1 { "" } else { "s" }
            )));
        }
        Ok(())
    }

    /// A new allocation on `dev` (checked by the caller) of at least `len` bytes.
    pub(crate) fn alloc(&self, dev: u32, len: usize) -> Result<Mapped> {
        match self {
            Backend::Real(r) => r.alloc(dev, len),
            Backend::Sim(s) => s.alloc(len),
        }
    }

    /// Whether an allocation's export is kept for later sends. The driver's exports are
    /// kept (an export is a driver call, and an imported VMM handle or legacy pointer is
    /// sent on with the handle it came with); the simulated device re-exports its mapping's
    /// descriptor for each send, so a holder keeps one descriptor less.
    pub(crate) fn keeps_exports(&self) -> bool {
        matches!(self, Backend::Real(_))
    }

    pub(crate) fn export(&self, dev: u32, mem: &Mem) -> Result<Export> {
        match self {
            Backend::Real(r) => r.export(dev, mem),
            Backend::Sim(s) => s.export(mem),
        }
    }

    /// Maps an allocation received from another process (`size`: the sender's claim).
    pub(crate) fn import(&self, dev: u32, export: &Export, size: usize) -> Result<Mapped> {
        self.check_device(dev)?;
        match (self, export) {
            (Backend::Real(r), Export::Fd(fd)) => r.import_fd(dev, fd, size),
            (Backend::Real(r), Export::Ipc(h)) => r.import_ipc(dev, h, size),
            (Backend::Sim(s), Export::Fd(fd)) => s.import_fd(fd, size),
            (Backend::Sim(_), Export::Ipc(_)) => {
                Err(Error::invalid("a legacy IPC handle cannot be opened on the simulated device"))
            }
        }
    }

    pub(crate) fn release(&self, dev: u32, mem: Mem) {
        match self {
            Backend::Real(r) => r.release(dev, mem),
            Backend::Sim(_) => drop(mem),
        }
    }

    /// Copies host bytes to `dst`.
    ///
    /// # Safety
    /// `dst..dst + src.len()` must lie in one live allocation of `dev` mapped here.
    pub(crate) unsafe fn htod(&self, dev: u32, dst: u64, src: &[u8]) -> Result<()> {
        match self {
            Backend::Real(r) => r.htod(dev, dst, src),
            Backend::Sim(s) => {
                // SAFETY: the caller's contract; host and device ranges are distinct maps.
                unsafe { s.copy(dst, src.as_ptr() as u64, src.len()) };
                Ok(())
            }
        }
    }

    /// Copies `len` bytes of a host storage at `src` to `dst`, read straight from the
    /// storage's pages (pinned ones are copied by DMA, no staging): other handles and
    /// processes may write them meanwhile, which leaves a mix of old and new values in the
    /// copy, as the crate's safe copies do.
    ///
    /// # Safety
    /// `dst..dst + len` must lie in one live allocation of `dev` mapped here, and
    /// `src..src + len` in one host storage's bytes (see `atomic_bytes`), live for the call.
    pub(crate) unsafe fn htod_from_storage(
        &self,
        dev: u32,
        dst: u64,
        src: *const u8,
        len: usize,
    ) -> Result<()> {
        match self {
            // SAFETY: the caller's contract; the driver reads the host range, and no Rust
            // reference to it is made.
            Backend::Real(r) => unsafe { r.htod_raw(dev, dst, src, len) },
            Backend::Sim(s) => {
                // SAFETY: the caller's contract: the device range is a simulated allocation,
                // the host range storage bytes, read with the atomic copies.
                unsafe { s.copy_from_storage(dst, src, len) };
                Ok(())
            }
        }
    }

    /// Page-locks `len` host bytes at `ptr` for every device's context.
    ///
    /// # Safety
    /// `ptr..ptr + len` must be mapped in this process until [`Backend::host_unregister`].
    pub(crate) unsafe fn host_register(&self, ptr: u64, len: usize) -> Result<()> {
        match self {
            // SAFETY: the caller's contract.
            Backend::Real(r) => unsafe { r.host_register(ptr, len) },
            Backend::Sim(s) => s.host_register(ptr, len),
        }
    }

    /// Undoes [`Backend::host_register`] of the range starting at `ptr`; errors are ignored
    /// (this runs in drops).
    pub(crate) fn host_unregister(&self, ptr: u64) {
        match self {
            Backend::Real(r) => r.host_unregister(ptr),
            Backend::Sim(s) => s.host_unregister(ptr),
        }
    }

    /// Copies device bytes from `src` to the host.
    ///
    /// # Safety
    /// `src..src + dst.len()` must lie in one live allocation of `dev` mapped here.
    pub(crate) unsafe fn dtoh(&self, dev: u32, dst: &mut [u8], src: u64) -> Result<()> {
        match self {
            Backend::Real(r) => r.dtoh(dev, dst, src),
            Backend::Sim(s) => {
                // SAFETY: the caller's contract; dst is an exclusive host borrow.
                unsafe { s.copy(dst.as_mut_ptr() as u64, src, dst.len()) };
                Ok(())
            }
        }
    }

    /// Writes `count` copies of a 1-, 2- or 4-byte `pattern` from `dst`.
    ///
    /// # Safety
    /// `count * pattern.len()` bytes from `dst` must lie in one live allocation of `dev`.
    pub(crate) unsafe fn memset(&self, dev: u32, dst: u64, pattern: &[u8], count: usize) -> Result<()> {
        match self {
            Backend::Real(r) => r.memset(dev, dst, pattern, count),
            Backend::Sim(s) => {
                // SAFETY: the caller's contract.
                unsafe { s.memset(dst, pattern, count) };
                Ok(())
            }
        }
    }

    pub(crate) fn synchronize(&self, dev: u32) -> Result<()> {
        self.check_device(dev)?;
        match self {
            Backend::Real(r) => r.synchronize(dev),
            Backend::Sim(_) => Ok(()),
        }
    }

    pub(crate) fn mem_get_info(&self, dev: u32) -> Result<(u64, u64)> {
        self.check_device(dev)?;
        match self {
            Backend::Real(r) => r.mem_get_info(dev),
            Backend::Sim(_) => Err(Error::Device(
                "the simulated device keeps no device-wide memory figures (cuMemGetInfo needs the \
                 CUDA driver)"
                    .into(),
            )),
        }
    }

    pub(crate) fn stream(&self, dev: u32) -> Result<u64> {
        self.check_device(dev)?;
        match self {
            Backend::Real(r) => r.stream(dev),
            Backend::Sim(_) => Ok(0),
        }
    }

    pub(crate) fn event_create(&self, dev: u32) -> Result<(u64, IpcBytes)> {
        self.check_device(dev)?;
        match self {
            Backend::Real(r) => r.event_create(dev),
            Backend::Sim(s) => Ok(s.event_create()),
        }
    }

    /// Opens an event from its handle.
    ///
    /// # Safety
    /// On the driver, `handle` must be one that cuIpcGetEventHandle gave for an event of
    /// `dev` (see `Event::from_ipc_handle`): the driver does not check it.
    pub(crate) unsafe fn event_open(&self, dev: u32, handle: &IpcBytes) -> Result<u64> {
        self.check_device(dev)?;
        match self {
            // SAFETY: the caller's contract.
            Backend::Real(r) => unsafe { r.event_open(dev, handle) },
            Backend::Sim(s) => s.event_open(handle),
        }
    }

    pub(crate) fn event_record(&self, dev: u32, ev: u64) -> Result<()> {
        match self {
            Backend::Real(r) => r.event_record(dev, ev),
            Backend::Sim(_) => Ok(()),
        }
    }

    pub(crate) fn event_wait(&self, dev: u32, ev: u64) -> Result<()> {
        match self {
            Backend::Real(r) => r.event_wait(dev, ev),
            Backend::Sim(_) => Ok(()),
        }
    }

    pub(crate) fn event_synchronize(&self, dev: u32, ev: u64) -> Result<()> {
        match self {
            Backend::Real(r) => r.event_synchronize(dev, ev),
            Backend::Sim(_) => Ok(()),
        }
    }

    pub(crate) fn event_query(&self, dev: u32, ev: u64) -> Result<bool> {
        match self {
            Backend::Real(r) => r.event_query(dev, ev),
            Backend::Sim(_) => Ok(true),
        }
    }

    pub(crate) fn event_destroy(&self, dev: u32, ev: u64) {
        if let Backend::Real(r) = self {
            r.event_destroy(dev, ev)
        }
    }
}
